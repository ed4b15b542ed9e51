"""The limits in effect, as lines for the journal at start and for `guardian check`: describe()
gives one line per part of guardian (the loop, the watchdog, restarts ...), limits() one per limit."""

from __future__ import annotations

from ..config import Config
from .fit import startfit
from .observations import gib
from .watchdog import canary, liveness


def describe(cfg: Config) -> list[str]:
    watchdog = cfg.watchdog
    lines = [
        f"loop: every {cfg.interval_s:g} s; dry_run={'yes' if cfg.dry_run else 'no'}; "
        f"state in {cfg.state_dir}, status in {cfg.runtime_dir}",
        f"watchdog: stalled when running+waiting > 0 and no counter progress for >= {watchdog.stall_window_s:g} s; "
        f"unresponsive when no probe gets an answer (or /health 503) for >= {watchdog.unresponsive_after_s:g} s "
        "and no progress as long; "
        f"idle-dead when idle and >= {watchdog.canary_failures} canaries fail in a row "
        f"(one {watchdog.canary_after_traffic_s:g} s "
        f"after traffic stops, then every {watchdog.canary_interval_s:g} s when idle, "
        f"{watchdog.canary_retry_s:g} s after a failure); "
        f"stalled also when work is queued, nothing moves for >= {watchdog.stall_canary_after_s:g} s "
        "and a canary then fails; "
        f"canary deadline {watchdog.canary_deadline_factor:g} x the slowest of the last 8 good ones, within "
        f"[{watchdog.canary_deadline_floor_s:g} s, canary_timeout_s] once 3 succeeded; "
        f"a replica's processes are quiet when they use <= {watchdog.quiet_cpu:g} of a core (CPU plus run-queue "
        f"wait; an engine that serves from its own process {watchdog.probe_cpu_s:g} s more for each probe it "
        "answered) and none runs, waits to run or waits uninterruptibly; "
        f"quiet for >= {watchdog.engine_quiet_s:g} s with nothing moving: stalled with work in the engine "
        f"({liveness.ENGINE_QUIET.id}), a canary out that long fails at once ({canary.CANARY_UNTOUCHED.id}), "
        f"unresponsive with no answer as long ({liveness.API_QUIET.id})",
        f"restarts: at most {watchdog.restart_budget} per replica in {watchdog.restart_window_s:g} s, "
        f"back-off {watchdog.backoff_s:g} s "
        f"doubling per restart, job result awaited for {watchdog.restart_job_timeout_s:g} s; one at a time per box",
        _memory(cfg),
        _start_guard(cfg),
        _start_fit(cfg),
        "metrics: "
        + "; ".join(
            [
                f"endpoint on {cfg.metrics.address}" if cfg.metrics.http else "no endpoint",
                f"textfile in {cfg.metrics.textfile_dir}" if cfg.metrics.textfile_dir else "no textfile",
                f"file_sd targets in {cfg.metrics.file_sd_path}" if cfg.metrics.file_sd_path else "no file_sd",
            ]
        ),
        _proxy(cfg),
        _fleet(cfg),
    ]
    for replica in cfg.replicas:
        lines.append(
            f"replica {replica.name}: unit {replica.unit}, {replica.url}, model {replica.model}; "
            f"startup grace {replica.startup_grace_s:g} s; "
            f"timeouts /health {replica.health_timeout_s:g} s, /metrics {replica.metrics_timeout_s:g} s, "
            f"canary {replica.canary_timeout_s:g} s"
            + (
                f"; warm-up: {replica.warmup_file} served (one token each, within {replica.warmup_timeout_s:g} s) "
                "before it is marked up at the proxy after a restart or a drain"
                if replica.warmup_file is not None
                else ""
            )
        )
    if not cfg.replicas:
        lines.append("no replicas configured: guardian watches nothing")
    return lines


def limits(cfg: Config) -> list[str]:
    """The limits in effect one per line, "part: limit" (describe's lines cut at each top-level "; "):
    what `guardian check` prints and the daemon says at start, one journal line each."""
    out = []
    for line in describe(cfg):
        head, sep, rest = line.partition(": ")
        out += [f"{head}{sep}{part}" for part in _top_level_parts(rest)] if sep else [line]
    return out


def _top_level_parts(text: str) -> list[str]:
    """TEXT cut at each "; " outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth == 0 and text.startswith("; ", i):
            parts.append(text[start:i])
            start = i + 2
    return [*parts, text[start:]]


def _memory(cfg: Config) -> str:
    memory = cfg.memory
    line = (
        f"memory guard: {'on' if memory.enabled else 'off'}; squeezed when MemAvailable < "
        f"{gib(memory.min_headroom_bytes)} for >= {memory.sustain_s:g} s; "
        f"critical below {gib(memory.critical_headroom_bytes)}; "
    )
    if not memory.restore:
        return line + "restore off: a lowered fraction stays lowered until raised by hand"
    return line + (
        "restore: a replica below its base fraction (the one before guardian first lowered it) is raised to "
        f"min(base, current + {memory.step:g}) (0.01 grid, rounded down) when MemAvailable >= "
        f"{gib(memory.min_headroom_bytes)} + total x the raise + {gib(memory.reserve_bytes)} on every tick for >= "
        f"{memory.restore_after_s:g} s with no replica starting, AND >= {memory.restore_cooldown_s:g} s after the "
        "last change of fraction, AND another replica of its model serves, AND admission lets the restart through "
        "leaving one restart of its budget for a hang (drained first under a proxy)"
    )


def _start_guard(cfg: Config) -> str:
    memory = cfg.memory
    if not (memory.enabled and memory.start_guard):
        return "start guard: off (a replica's start is not watched for memory)"
    return (
        f"start guard: while a replica loads, a look every {memory.start_guard_interval_s:g} s; its start is killed "
        f"and restarted at the highest fraction that fits, <= its own - {memory.step:g} and >= {memory.floor:g}, "
        f"when MemAvailable < {gib(memory.critical_headroom_bytes)} (and was not when the start began) AND it is "
        "the one growing (its growth since the start began, by NVML, else its cgroup, > 0 and >= half of "
        "MemAvailable's fall; with neither, MemAvailable fell), within the restart budget; it keeps up with a fall "
        f"of up to {gib(int(memory.critical_headroom_bytes / memory.start_guard_interval_s))}/s"
    )


def _start_fit(cfg: Config) -> str:
    memory = cfg.memory
    if memory.unified is False:
        return "start fit: off (memory.unified = false: the GPU has memory of its own)"
    which = (
        "on"
        if memory.unified is True
        else 'on where NVML answers NOT_SUPPORTED for the device\'s memory (unified = "auto")'
    )
    releases = [
        "its own model files' page cache (posix_fadvise)" if memory.release_cache else "",
        "the whole page cache (drop_caches, by the root helper)" if memory.drop_caches else "",
    ]
    released = " then ".join(r for r in releases if r) or "nothing (release_cache and drop_caches off)"
    lowered = (
        f"lowered to the highest fraction >= {memory.floor:g} that fits, leaving {gib(memory.reserve_bytes)}, when "
        f"the unit reads guardian's env file ({startfit.LOWERED.id}), else "
        if memory.enabled
        else ""
    )
    return (
        f"start fit: {which}; before every start guardian causes, need = fraction x total against MemFree + what "
        f"its processes return; released first where that makes it fit: {released}; {lowered}refused when it "
        f"cannot fit even if what its fraction reserves comes back ({startfit.NO_FIT.id})"
    )


def _proxy(cfg: Config) -> str:
    proxy = cfg.proxy
    if not proxy.enabled:
        return "proxy: none (planned restarts are not drained; hung replicas are not marked down)"
    how = []
    if proxy.nginx_upstream_dir is not None:
        how.append(
            f"nginx upstream files in {proxy.nginx_upstream_dir} (checked by {proxy.nginx_check_unit}, "
            f"applied by reloading {proxy.nginx_unit})"
        )
    if proxy.drain_command:
        how.append(f"drain_command {proxy.drain_command[0]}, undrain_command {(proxy.undrain_command or ['none'])[0]}")
    return (
        f"proxy: {'; '.join(how)}; a planned restart drains first: restarted when running+waiting == 0 or after "
        f"{proxy.drain_timeout_s:g} s, its stop bounded to {proxy.stop_timeout_s:g} s (then its processes are killed); "
        "a hung replica is marked down when its restart is issued; marked up when it serves again"
    )


def _fleet(cfg: Config) -> str:
    fleet = cfg.fleet
    if not fleet.enabled:
        return "fleet: none (planned restarts are coordinated on this box only)"
    return (
        f"fleet: {fleet.name} on etcd {', '.join(fleet.endpoints)}; "
        f"at most {fleet.max_planned_restarts} planned restart(s) in "
        f"the fleet at once, each only with >= {fleet.min_serving} other replica(s) of its model serving; lease ttl "
        f"{fleet.lease_ttl_s} s; etcd unreachable: planned restarts wait (critical lowerings go ahead), hung replicas "
        "are restarted"
    )
