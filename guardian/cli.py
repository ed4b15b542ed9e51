"""guardian's command line: run, check, status, pause, resume, restart, polkit-rule."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from . import __version__, engine_helper, polkit
from .act import proxy
from .act.journal import Journal
from .act.restart import RestartOrder, Tools, checked_restart
from .act.state import STATUS_FILE, CorruptState, StateDoc, StateStore, atomic_write, stamp, view
from .config import MAX_WINDOW_S, Config, ConfigError, ReplicaConfig, config_path, load_config
from .core import gates, hazards, thresholds, tick
from .core.actions import AnswerRequest, LogLine, RestartUnit
from .core.container import KEEPING_POLICIES, helper_unit, parse_run_line, unit_problems
from .core.observations import RestartRequest, TickObservation, UnitInfo, VllmSample
from .core.vocab import Decision, Priority
from .observe import clock, probes
from .observe.containers import ContainerWatch
from .observe.memory import env_path, wiring_of
from .observe.nvml import Nvml
from .observe.probes import make_client
from .observe.readback import Refused, read_back
from .observe.replicas import WorldObserver, port_owners, unit_or_error
from .observe.systemd import Systemd, SystemdError

EXIT_CONFIG = 2


def parse_duration(text: str) -> float:
    """'90', '90s', '15m', '2h', '1d' -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use e.g. 90s, 15m, 2h)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def pause_duration(text: str) -> float:
    """A pause's length: more than 0 and at most 30 days (`guardian resume` ends any pause)."""
    seconds = parse_duration(text)
    if not 0 < seconds <= MAX_WINDOW_S:
        raise argparse.ArgumentTypeError(
            f"a pause lasts more than 0 s and at most 30 days (got {text!r}); leave --for out to pause until resumed"
        )
    return seconds


def _load(args: argparse.Namespace) -> Config:
    return load_config(config_path(args.config))


def cmd_run(args: argparse.Namespace) -> int:
    from .daemon import Daemon

    path = config_path(args.config)
    cfg = load_config(path)
    return asyncio.run(Daemon(cfg, path).run())


def cmd_check(args: argparse.Namespace) -> int:
    cfg = _load(args)
    print(f"config {config_path(args.config)}: valid")
    for line in thresholds.describe(cfg):
        print(f"  {line}")
    return asyncio.run(_check_live(cfg, args.no_systemd))


@dataclass
class _Bus:
    """What `check` learned over the system bus, for the per-replica lines."""

    sd: Systemd
    watch: ContainerWatch
    units: dict[str, UnitInfo | None]


async def _check_live(cfg: Config, no_systemd: bool) -> int:
    problems = 0
    sd = Systemd()
    bus = None
    if not no_systemd:
        try:
            await sd.connect()
        except SystemdError as e:
            print(f"problem: cannot talk to systemd over the system bus: {e}")
            return 1
        bus, problems = await _check_units(cfg, sd)
    problems += _check_proxy(cfg)
    if cfg.fleet.enabled:
        problems += await _check_fleet(cfg)
    async with make_client() as client:
        for r in cfg.replicas:
            problems += await _check_replica(client, r, bus)
    problems += _check_connections(cfg)
    sd.close()
    print("ok" if problems == 0 else f"{problems} problem(s)")
    return 0 if problems == 0 else 1


async def _check_units(cfg: Config, sd: Systemd) -> tuple[_Bus, int]:
    """Each replica's unit and container, the hazards among the enabled units, and the memory
    guard's wiring. Counts the problems."""
    problems = 0
    watch = ContainerWatch(sd)
    units = {
        r.unit: (await watch.unitless_view(r) if r.unitless else await unit_or_error(sd, r.unit))[0]
        for r in cfg.replicas
    }
    for r in cfg.replicas:
        problems += await _check_container(sd, r, watch)
    try:
        enabled = await sd.enabled_service_conflicts()
    except SystemdError as e:
        print(f"problem: cannot list enabled unit files: {e}")
        enabled, problems = {}, problems + 1
    found = hazards.find_hazards(cfg, units, enabled)
    for h in found:
        print(f"hazard: {h.message}")
    problems += len(found)
    if cfg.memory.enabled:
        problems += await _check_wiring(cfg, sd)
    return _Bus(sd, watch, units), problems


async def _check_wiring(cfg: Config, sd: Systemd) -> int:
    print(f"memory guard: {Nvml().note}")
    problems = 0
    for r in cfg.replicas:
        problem = await wiring_of(sd, cfg, r)
        if problem:
            problems += 1
            print(
                f"memory guard: replica {r.name}: NOT wired, it will never be restarted to lower its "
                f"fraction: {problem}"
            )
        else:
            print(
                f"memory guard: replica {r.name}: wired ({env_path(cfg, r.name)} is the last "
                "EnvironmentFile= that sets GPU_MEMORY_UTILIZATION)"
            )
    return problems


def _check_proxy(cfg: Config) -> int:
    try:
        down = frozenset(view(StateStore(cfg.state_dir).read(), clock.now()).proxy_down)
    except (OSError, CorruptState):
        down = frozenset()  # what the files say is still shown; the diff assumes nothing is marked down
    problems = 0
    for bad, text in proxy.describe(cfg, down):
        problems += bad
        print(text)
    return problems


async def _check_replica(client: httpx.AsyncClient, r: ReplicaConfig, bus: _Bus | None) -> int:
    """One line for the replica: its probes, its model and whether guardian could restart it.
    Counts the problems (a proxy suspected in front of it is a warning line of its own)."""
    problems = 0
    health = await probes.probe_health(client, r)
    mprobe, sample = await probes.probe_metrics(client, r)
    models_probe, models = await probes.probe_models(client, r)
    line = f"replica {r.name} ({r.url}): /health {health.status or health.error} in {health.latency_s:.2f} s"
    if sample is not None:
        line += (
            f"; {sample.running:.0f} running, {sample.waiting:.0f} waiting, "
            f"{sample.generation_tokens:.0f} tokens so far"
        )
        if sample.gpu_memory_utilization is not None:
            line += f", gpu_memory_utilization {sample.gpu_memory_utilization:g}"
    else:
        line += f"; /metrics {mprobe.error}"
        problems += 1
    problems += await _check_proxy_suspect(client, r, sample)
    if models is not None and r.model not in models:
        line += f"; WRONG MODEL: serves {', '.join(models) or 'nothing'}, expected {r.model}"
        problems += 1
    elif models is None:
        line += f"; /v1/models {models_probe.error}"
    if not health.ok:
        problems += 1
    if bus is not None:
        owner = (await bus.watch.owners([r], await port_owners(bus.sd, {r.port})))[r.port]
        refusal = gates.unit_refusal(bus.units[r.unit], owner)
        line += f"; {r.unit}: " + (f"guardian could NOT restart it: {refusal.text}" if refusal else "restartable")
    print(line)
    return problems


async def _check_proxy_suspect(client: httpx.AsyncClient, r: ReplicaConfig, first: VllmSample | None) -> int:
    """A process start time that changes between reads: a load balancer answers for the URL."""
    starts = [first.process_start_time_s if first is not None else None]
    for _ in range(hazards.PROXY_READS - 1):
        _probe, again = await probes.probe_metrics(client, r)
        starts.append(again.process_start_time_s if again is not None else None)
    suspect = hazards.proxy_suspect(r.name, r.url, starts)
    if suspect is not None:
        print(f"warning: {suspect}")
        return 1
    return 0


async def _check_container(sd: Systemd, r: ReplicaConfig, watch: ContainerWatch) -> int:
    """The replica's container shape in one line, and each thing that keeps it from being restarted
    as a problem with the line to add (core/container.py). Counts the problems."""
    if r.unitless:
        assert r.container is not None
        unit, why = await watch.unitless_view(r)
        report = watch.reports.get(r.name)
        c = report.by_name(r.container) if report is not None else None
        if why is not None or c is None or unit is None:
            print(f"problem: replica {r.name}: container {r.container}: {why or 'no such container (docker ps -a)'}")
            return 1
        print(
            f"replica {r.name}: Docker container {c.name} without a unit ({c.status}), kept by its restart policy "
            f"{c.restart_policy or 'no'}; guardian restarts it with `docker restart --time 0` through "
            f"{helper_unit('restart', r.name)}"
        )
        if c.restart_policy not in KEEPING_POLICIES:
            print(
                f"problem: replica {r.name}: container {c.name} has restart policy {c.restart_policy or 'no'}: Docker "
                "does not keep it, and guardian restarts only a kept container (G4); "
                f"add: docker update --restart unless-stopped {c.name}"
            )
            return 1
        return 0
    try:
        lines = await sd.exec_lines(r.unit)
    except SystemdError:
        return 0  # the unit gates say what is wrong with the unit itself
    run = parse_run_line(lines["ExecStart"][0]) if lines["ExecStart"] else None
    if r.container is None:
        if run is None:
            return 0
        print(
            f"problem: replica {r.name}: {r.unit} runs a container (`{run.engine} run --name {run.name}`), but the "
            f"replica names none: guardian would kill only the {run.engine} CLI of a hung replica; "
            f'add: container = "{run.name}"'
            + (' and engine = "podman"' if run.engine == "podman" else "")
            + " to the replica"
        )
        return 1
    if run is not None:
        shape = (
            f"`{run.engine} run`"
            + (" --network host" if run.host_network else f" -p {', '.join(run.publishes)}" if run.publishes else "")
            + (" --cgroups=split (Quadlet's shape)" if run.cgroups_split else "")
        )
        print(f"replica {r.name}: {r.unit} runs container {run.name} with {shape}")
    found = unit_problems(r.unit, r.container, run, lines["ExecStartPre"], lines["ExecStop"] + lines["ExecStopPost"])
    for problem, fix in found:
        print(f"problem: replica {r.name}: {problem}; add: {fix}")
    return len(found)


async def _check_fleet(cfg: Config) -> int:
    """The fleet as etcd shows it, in one line; 1 problem when it cannot be read."""
    from .fleet.etcd import EtcdError
    from .fleet.sync import box_name, fleet_status

    try:
        fv = await fleet_status(cfg)
    except (EtcdError, OSError) as e:
        why = str(e)
    except Exception as e:  # noqa: BLE001 - a line and a problem counted, not a traceback
        why = f"{type(e).__name__}: {e}"
    else:
        print(
            f"fleet: {cfg.fleet.name} on etcd answers: {len(fv['boxes'])} box(es), "
            f"{len(fv['slots'])} of {cfg.fleet.max_planned_restarts} slot(s) held; this box is {box_name(cfg)}"
        )
        return 0
    print(f"problem: fleet: etcd cannot be read ({_one_line(why)}); planned restarts would wait")
    return 1


def _check_connections(cfg: Config) -> int:
    """The kernel's view of each replica's port, once; with a proxy configured, a client connected
    straight to a replica is a problem (B2 needs W.bypass_after_s of it; check shows it now)."""
    from .core.bypass import proxy_configured
    from .core.observations import PeerKind
    from .observe.conns import ConnObserver

    observer = ConnObserver()
    views = observer.look_now(cfg, time.monotonic())
    if observer.unavailable is not None:
        print(f"connections: the kernel's view is not available: {observer.unavailable}")
        return 0
    problems = 0
    if cfg.proxy.enabled and not proxy_configured(cfg):
        print(
            "connections: a proxy is driven by drain commands but its address is not known: set "
            "watchdog.proxy_peers to it so that clients bypassing it can be told from it (B1)"
        )
    for r in cfg.replicas:
        v = views.get(r.name)
        if v is None:
            continue
        peers = ", ".join(f"{p.kind} {p.name} x{p.connections}" for p in v.peers) or "none"
        print(f"replica {r.name}: {v.connections} connection(s) to port {r.port}; peers: {peers}")
        if not proxy_configured(cfg):
            continue
        for p in v.peers:
            if p.kind is PeerKind.OTHER:
                problems += 1
                print(
                    f"warning: replica {r.name} ({r.unit}): {p.name} talks to it directly on port {r.port}, "
                    f"not through the proxy ({p.connections} connection(s)); point it at the proxy"
                )
    return problems


def _runtime_dir(args: argparse.Namespace) -> Path:
    try:
        return _load(args).runtime_dir
    except ConfigError:
        return Path(str(Config.model_fields["runtime_dir"].default))


# status.json is a few KiB per replica; the rule a few hundred bytes per unit.
STATUS_MAX_BYTES = 8 * 2**20
POLKIT_RULE_MAX_BYTES = 2**20


def cmd_status(args: argparse.Namespace) -> int:
    if args.fleet:
        return _fleet_status(args)
    path = _runtime_dir(args) / STATUS_FILE
    try:
        # Not followed, not a FIFO (it would hang a root `guardian status`), not without end.
        data = json.loads(read_back(path, STATUS_MAX_BYTES))
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not guardian's status object")
    except FileNotFoundError:
        print(f"guardian is not running (no {path})", file=sys.stderr)
        return 3
    except Refused as e:
        print(f"cannot read {path}: {e.strerror}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"cannot read {path}: {e}".replace("\n", " "), file=sys.stderr)
        return 1
    age = time.time() - data.get("updated_at", 0)
    stale = age > max(30.0, 5 * data.get("interval_s", 2.0))
    if args.json:
        data["age_s"] = age
        data["stale"] = stale
        print(json.dumps(data, indent=1, sort_keys=True))
        return 0 if not stale else 3
    print(
        f"guardian pid {data['pid']}, updated {age:.1f} s ago{' (STALE: is it running?)' if stale else ''}"
        f"{', DRY-RUN' if data.get('dry_run') else ''}"
        f"{', SYSTEM BUS LOST' if data.get('system_bus') == 'LOST' else ''}"
    )
    if data.get("memory"):
        _print_memory(data["memory"])
    for text in data.get("bypassing", []):
        print(f"hazard: {text}")
    for name, r in data.get("replicas", {}).items():
        extra = " GAVE UP (restart budget spent)" if r.get("gave_up") else ""
        frac_text = _fraction_text(r.get("gpu_memory_utilization"), r.get("gpu_memory_utilization_base"))
        print(
            f"  {name:<12} {r['state']:<13} {r['unit']:<28} {frac_text:<25} "
            f"restarts {r['restarts_in_window']}/{r['restart_budget']}{extra}  {r['evidence']}"
        )
        conns = r.get("connections")
        if isinstance(conns, dict):
            print(f"  {'':<12} {_connections_line(conns)}")
    return 0 if not stale else 3


def _print_memory(mem: dict[str, Any]) -> None:
    psi = mem.get("psi_some_avg10")
    print(
        f"memory: {mem['available_bytes'] / 2**30:.1f} GiB available of {mem['total_bytes'] / 2**30:.1f} GiB"
        + (f", PSI some avg10 {psi:.2f}%" if psi is not None else ", PSI not available")
    )
    if not mem.get("guard"):
        print("memory guard: off")
        return
    below = mem.get("below_min_since")
    line = f"memory guard: on, min headroom {mem['min_headroom_bytes'] / 2**30:.1f} GiB"
    line += f", below it for {time.time() - below:.0f} s" if below else ", not squeezed"
    if mem.get("pending"):
        pending = mem["pending"]
        what = "raise" if pending.get("raise") else "lowering"
        waits = ", its restart waiting for admission" if pending.get("restart_waits") else ""
        line += f"; {what} of {pending['replica']} {pending['old']:g} -> {pending['new']:g} in progress{waits}"
    print(line)
    restore = mem.get("restore")
    if isinstance(restore, dict):
        print(_restore_line(restore))


def _restore_line(restore: dict[str, Any]) -> str:
    """Raising fractions back, as `guardian status` prints it."""
    if not restore.get("enabled"):
        return "memory restore: off (a lowered fraction stays lowered)"
    line = f"memory restore: on, after {restore['after_s']:g} s of clear headroom, cooldown {restore['cooldown_s']:g} s"
    since = restore.get("clear_since")
    if since is not None and restore.get("clear_for"):
        line += f"; headroom clear for a raise of {restore['clear_for']} for {time.time() - since:.0f} s"
    for name, ceiling in (restore.get("ceilings") or {}).items():
        line += f"; {name} not raised to {ceiling:g} or above (a raise to it failed to start)"
    return line


def _fraction_text(current: float | None, base: float | None) -> str:
    """A replica's fraction, and its base when guardian has lowered it."""
    text = f"fraction {current:g}" if current is not None else "fraction ?"
    return text + (f" (base {base:g})" if base is not None else "")


def _connections_line(c: dict[str, Any]) -> str:
    """The kernel's view of one replica's port, as `guardian status` prints it."""
    over = f" in {c['over_s']:.1f} s" if c.get("over_s") is not None else ""
    line = f"connections {c['established']}: {c['flowing']} flowing ({c['bytes_out']} bytes{over})"
    line += f", {c['waiting']} waiting" + (f" (longest {c['oldest_wait_s']:.0f} s)" if c["waiting"] else "")
    if c.get("cpu_s") is not None:
        line += f", unit CPU {1000 * c['cpu_s']:.0f} ms{over}"
    peers = ", ".join(f"{p['kind']} {p['name']} x{p['connections']}" for p in c.get("peers", [])[:6])
    partial = " (partial: too many sockets)" if c.get("truncated") else ""
    return line + (f"; peers: {peers}" if peers else "") + partial


def _need_replica(cfg: Config, name: str) -> None:
    if cfg.replica(name) is None:
        known = ", ".join(r.name for r in cfg.replicas) or "none"
        raise SystemExit(f"guardian: no replica named {name!r} in the config (known: {known})")


def _update_state(cfg: Config, change: Callable[[StateDoc], None]) -> None:
    store = StateStore(cfg.state_dir)
    try:
        store.update(change)
    except CorruptState as e:  # the change was applied to fresh defaults and written
        print(f"warning: {e}", file=sys.stderr)


def _unit_of(cfg: Config, name: str) -> str:
    r = cfg.replica(name)
    return r.unit if r is not None else ""


def _fleet_status(args: argparse.Namespace) -> int:
    from .fleet.etcd import EtcdError
    from .fleet.sync import fleet_status

    cfg = _load(args)
    if not cfg.fleet.enabled:
        print("no [fleet] in the config: this box decides alone", file=sys.stderr)
        return 1
    try:
        data = asyncio.run(fleet_status(cfg))
    except (EtcdError, OSError) as e:
        print(f"guardian: cannot read the fleet from etcd: {_one_line(str(e))}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - one line and exit status 1, not a traceback
        print(f"guardian: cannot read the fleet from etcd: {_one_line(f'{type(e).__name__}: {e}')}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(data, indent=1, sort_keys=True))
        return 0
    now = time.time()
    print(
        f"fleet {data['fleet']} on {', '.join(data['endpoints'])} (revision {data['revision']}): "
        f"{len(data['boxes'])} box(es); planned restarts {len(data['slots'])} of {data['max_planned_restarts']} "
        f"slot(s) held; min_serving {data['min_serving']}"
    )
    for s in sorted(data["slots"], key=lambda x: str(x.get("slot"))):
        since = s.get("since")
        held = f" for {now - since:.0f} s" if isinstance(since, int | float) else ""
        print(f"  slot {s.get('slot')}: held by {s.get('box')}/{s.get('replica')} ({s.get('model')}){held}")
    for box in sorted(data["boxes"]):
        for name, r in sorted(data["boxes"][box].items()):
            print(f"  {box + '/' + name:<24} {r.get('state')!s:<13} {r.get('unit')!s:<28} {r.get('model')}")
    for bad in data["ignored"]:
        print(f"  ignored {bad['key']!r}: {bad['why']} (not a guardian's)")
    return 0


def _one_line(text: str, max_chars: int = 500) -> str:
    """An error for the terminal: one line of printable text, of bounded length (it may quote etcd)."""
    flat = " ".join("".join(c if c.isprintable() else " " for c in text[: 4 * max_chars]).split())
    return flat if len(flat) <= max_chars else flat[:max_chars] + " [...]"


def cmd_pause(args: argparse.Namespace) -> int:
    cfg = _load(args)
    _need_replica(cfg, args.name)
    n = clock.now()
    until = stamp(clock.Now(n.mono + args.for_, n.wall + args.for_)) if args.for_ else None

    def change(d: StateDoc) -> None:
        d["pauses"][args.name] = {"until": until, "reason": "operator"}

    _update_state(cfg, change)
    how = f"for {args.for_:g} s" if until else "until `guardian resume`"
    Journal().send(
        Priority.WARNING,
        f"replica {args.name}: paused by an operator {how}",
        Decision.REQUEST,
        args.name,
        _unit_of(cfg, args.name),
    )
    print(f"replica {args.name} paused {how}")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    cfg = _load(args)
    _need_replica(cfg, args.name)

    def change(d: StateDoc) -> None:
        d["pauses"].pop(args.name, None)
        d["resumed_at"][args.name] = stamp(clock.now())

    _update_state(cfg, change)
    Journal().send(
        Priority.WARNING,
        f"replica {args.name}: resumed by an operator (restart budget starts afresh)",
        Decision.REQUEST,
        args.name,
        _unit_of(cfg, args.name),
    )
    print(f"replica {args.name} resumed")
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    cfg = _load(args)
    _need_replica(cfg, args.name)
    pid = _running_daemon(cfg)
    if pid is not None:
        return _ask_daemon_to_restart(cfg, args.name, pid, args.wait)
    return asyncio.run(_restart_without_daemon(cfg, args.name))


def _running_daemon(cfg: Config) -> int | None:
    """The PID of the daemon that serves this config's state, if it runs and ticks."""
    try:
        data = json.loads((cfg.runtime_dir / STATUS_FILE).read_text())
        pid = int(data["pid"])
        fresh = time.time() - float(data["updated_at"]) <= max(30.0, 5 * float(data.get("interval_s", 2.0)))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not fresh:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # it runs, as another user
    return pid


def _ask_daemon_to_restart(cfg: Config, name: str, pid: int, wait_s: float | None) -> int:
    """Record the request for the daemon, which admits it like any restart (core/tick.py), and
    wait for its answer."""
    rid = uuid.uuid4().hex[:16]
    store = StateStore(cfg.state_dir)

    def ask(d: StateDoc) -> None:
        d["requests"][rid] = {"replica": name, "at": stamp(clock.now())}

    _update_state(cfg, ask)
    default_s = cfg.watchdog.restart_job_timeout_s + 10 * cfg.interval_s + 10
    if cfg.proxy.enabled:  # it drains first (README, Under a proxy)
        default_s += cfg.proxy.drain_timeout_s + cfg.proxy.stop_timeout_s
        print(f"asked the running guardian (pid {pid}) to drain and restart replica {name}; waiting for its answer")
    else:
        print(f"asked the running guardian (pid {pid}) to restart replica {name}; waiting for its answer")
    deadline = time.monotonic() + (wait_s if wait_s is not None else default_s)
    while time.monotonic() < deadline:
        try:
            answer = store.read()["answers"].get(rid)
        except CorruptState as e:
            print(f"guardian: {e}", file=sys.stderr)
            return 1
        if answer is not None:

            def forget(d: StateDoc) -> None:
                d["answers"].pop(rid, None)

            _update_state(cfg, forget)
            print(answer["message"], file=sys.stdout if answer["ok"] else sys.stderr)
            return 0 if answer["ok"] else 1
        time.sleep(0.2)

    def withdraw(d: StateDoc) -> None:
        d["requests"].pop(rid, None)

    _update_state(cfg, withdraw)
    print(
        f"guardian: no answer from the running daemon within the wait; request withdrawn "
        f"(see journalctl -u guardian GUARDIAN_REPLICA={name})",
        file=sys.stderr,
    )
    return 1


async def _restart_without_daemon(cfg: Config, name: str) -> int:
    """No daemon runs: observe once and put the request through the same pure tick."""
    r = cfg.replica(name)
    assert r is not None
    journal = Journal()
    store = StateStore(cfg.state_dir)
    now = clock.now()
    try:
        pv = view(store.read(), now)
    except CorruptState as e:
        print(f"warning: {e}", file=sys.stderr)
        pv = view(store.update(lambda d: None), now)
    sd = Systemd()
    try:
        await sd.connect()
    except SystemdError as e:
        print(f"guardian: cannot talk to systemd: {e}", file=sys.stderr)
        return 1
    rid = "cli"
    if cfg.fleet.enabled:
        print(
            f"guardian: not restarting {name}: with [fleet] a planned restart takes a fleet slot, which only the "
            "running daemon can hold (start guardian.service, or `systemctl restart` the unit yourself)",
            file=sys.stderr,
        )
        return 1
    if cfg.proxy.enabled:
        print(
            f"warning: guardian is not running, so {name} is restarted without being drained at the proxy",
            file=sys.stderr,
        )
    try:
        async with make_client() as client:
            replicas = await WorldObserver(sd, client).replicas(cfg, now.mono)
        now = clock.now()
        persistent = replace(pv, requests=(RestartRequest(rid, name, now.mono),))
        _state, actions = tick.decide(tick.TickState(), TickObservation(replicas, persistent), now.mono, cfg)
        for a in actions:
            if isinstance(a, LogLine) and a.replica == name and a.decision in _REQUEST_DECISIONS:
                journal.line(a)
            elif isinstance(a, AnswerRequest) and a.request_id == rid:
                print(a.message, file=sys.stdout if a.ok else sys.stderr)
                return 0 if a.ok else 1
            elif isinstance(a, RestartUnit) and a.request_id == rid:
                order = RestartOrder(r, "requested by an operator")
                outcome = await checked_restart(Tools(sd, store, journal, cfg), order)
                print(f"{r.unit}: {outcome.result}")
                return 0 if outcome.ok else 1
        print(f"guardian: the request for {name} got no answer (a bug)", file=sys.stderr)
        return 1
    finally:
        sd.close()


def cmd_container(args: argparse.Namespace) -> int:
    return engine_helper.main(args.instance, config_path(args.config))


def cmd_polkit_rule(args: argparse.Namespace) -> int:
    path = config_path(args.config)
    cfg = load_config(path)  # a broken config leaves the rule in place: the daemon keeps its running config
    text = polkit.render(cfg, str(path))
    if args.stdout:
        sys.stdout.write(text)
        return 0
    out = Path(args.output)
    units = ", ".join(sorted({r.unit for r in cfg.replicas})) or "none"
    try:
        if read_back(out, POLKIT_RULE_MAX_BYTES) == text.encode():
            print(f"guardian: polkit rule {out} unchanged (units: {units})")
            return 0
    except Refused as e:  # a link, a FIFO, a device, a huge file: never read, replaced by the rename
        print(f"guardian: {out} was not read ({e.strerror}): replaced by the rule", file=sys.stderr)
    except OSError:
        pass  # absent or unreadable: written
    atomic_write(out, text.encode(), mode=0o644)
    print(f"guardian: wrote polkit rule {out}: user guardian may {', '.join(polkit.VERBS)} {units}")
    return 0


_REQUEST_DECISIONS = frozenset({Decision.REFUSED, Decision.RESTART, Decision.DRY_RUN})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="guardian", description="Keeps local vLLM replicas serving.")
    p.add_argument("--version", action="version", version=f"guardian {__version__}")
    p.add_argument("--config", help="config file (default: $GUARDIAN_CONFIG or /etc/guardian/guardian.toml)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="run the daemon in the foreground").set_defaults(func=cmd_run)
    c = sub.add_parser("check", help="validate the config, show the limits, probe every replica once")
    c.add_argument("--no-systemd", action="store_true", help="skip the systemd checks (no system bus)")
    c.set_defaults(func=cmd_check)
    s = sub.add_parser("status", help="what the running daemon sees now")
    s.add_argument("--json", action="store_true")
    s.add_argument("--fleet", action="store_true", help="the fleet view from etcd: boxes, replicas, slots and holders")
    s.set_defaults(func=cmd_status)
    pa = sub.add_parser("pause", help="stop acting on a replica (survives guardian restarts)")
    pa.add_argument("name")
    pa.add_argument("--for", dest="for_", type=pause_duration, default=None, help="e.g. 30m; default: until resumed")
    pa.set_defaults(func=cmd_pause)
    re_ = sub.add_parser("resume", help="act on a paused replica again; also resets its restart budget")
    re_.add_argument("name")
    re_.set_defaults(func=cmd_resume)
    rs = sub.add_parser(
        "restart",
        help="restart a replica's unit through guardian's admission and gates "
        "(asks the running daemon, which acts on its next tick)",
    )
    rs.add_argument("name")
    rs.add_argument(
        "--wait",
        type=parse_duration,
        default=None,
        help="how long to wait for the daemon's answer (default: the restart job timeout + 10 ticks)",
    )
    rs.set_defaults(func=cmd_restart)
    pk = sub.add_parser(
        "polkit-rule",
        help="write the polkit rule that lets user guardian restart exactly the configured units "
        "(run as root by guardian.service before every start and reload)",
    )
    pk.add_argument("--output", default=str(polkit.RULE_PATH))
    pk.add_argument("--stdout", action="store_true", help="print the rule instead of writing it")
    pk.set_defaults(func=cmd_polkit_rule)
    co = sub.add_parser(
        "container",
        help="the root helper for container replicas (run by guardian-container@VERB:REPLICA.service, "
        "which guardian starts over D-Bus): inspect, kill or restart the configured replica's container",
    )
    co.add_argument("instance", metavar="VERB:REPLICA")
    co.set_defaults(func=cmd_container)
    for sp in sub.choices.values():
        sp.add_argument("--config", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as e:
        # Under systemd, stderr is the journal; exit 2 is RestartPreventExitStatus= in the unit.
        print(f"guardian: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130
