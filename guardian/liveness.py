"""Per-replica liveness: every state and every transition rule lives in this module.

Pure: a Track (what guardian remembers about one replica) plus one ReplicaObservation plus
``now`` give the next Track, whose ``state`` is the verdict. No clock, no I/O, no sleeping.

Rules, first match wins (``W`` = watchdog config, ``R`` = replica config, times in seconds):

=====  ==============  ==============================================================================
 rule   state           condition
=====  ==============  ==============================================================================
  1     paused          an operator pause is in force (``guardian pause``; until <= now ends it)
  2     unknown         systemd could not be asked about the unit (D-Bus error)
  3     stopped         unit not found, inactive or failed (a masked unit still running is judged,
                        and the restart gates refuse it)
  4     starting        unit activating or deactivating, or a restart by guardian is in flight
  5     starting        unit active, not healthy once since it last started, and
                        now - start < R.startup_grace_s  (start = systemd's InactiveExitTimestamp)
  6     wrong-model     /v1/models answered and does not list R.model
  7     unresponsive    no probe got any HTTP answer for >= W.unresponsive_after_s (from the last answer)
                        AND no progress for >= W.unresponsive_after_s
  8     unresponsive    /health answered 503 (vLLM: engine dead) for >= W.unresponsive_after_s
                        AND no progress for >= W.unresponsive_after_s
  9     busy            progress this tick AND (/health failed or took >= R.health_timeout_s)
 10     healthy         progress this tick AND /health answered 2xx in time
 11     stalled         /metrics readable AND running + waiting > 0 AND
                        now - max(last progress, work first queued) >= W.stall_window_s
 12     idle-dead       /metrics readable AND running + waiting == 0 AND
                        consecutive failed canaries >= W.canary_failures
 13     busy            /health failed, AND progress within W.stall_window_s
 14     degraded        some probe failed or /metrics unreadable (no grounds to restart yet)
 15     healthy         otherwise
=====  ==============  ==============================================================================

Progress means: any of generation_tokens_total, prompt_tokens_total,
iteration_tokens_total_count/_sum, request_success_total went up, or kv_cache_usage_perc changed
(it moves during a long chunked prefill when the token counters stand still), or a counter went
down (the engine restarted), or a canary completed.

A canary (a 1-token completion) is asked for only when /metrics is readable and shows
running + waiting == 0, /health answered, none is in flight, and
now - max(last progress, last canary) >= W.canary_interval_s (W.canary_retry_s after a failure).
A failed canary counts only if no progress was seen while it ran (real traffic proves the engine).

When the unit's start time changes (it was restarted, by anyone), everything but the restart
bookkeeping is forgotten and rule 5 applies afresh.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .config import ReplicaConfig, WatchdogConfig
from .observations import Pause, ReplicaObservation, VllmSample

PAUSED = "paused"
UNKNOWN = "unknown"
STOPPED = "stopped"
STARTING = "starting"
WRONG_MODEL = "wrong-model"
UNRESPONSIVE = "unresponsive"
BUSY = "busy"
HEALTHY = "healthy"
STALLED = "stalled"
IDLE_DEAD = "idle-dead"
DEGRADED = "degraded"

NO_OBSERVATION = "no observation yet"
RESTART_STATES = frozenset({STALLED, UNRESPONSIVE, IDLE_DEAD})
# States that mean "this replica is not serving yet": a second restart on the box waits for them.
STARTING_STATES = frozenset({STARTING})


@dataclass(frozen=True)
class Track:
    state: str = STARTING
    state_since: float = 0.0
    evidence: str = "no observation yet"  # == NO_OBSERVATION
    start_ts: float | None = None
    healthy_since_start: bool = False
    last_sample: VllmSample | None = None
    last_progress_at: float | None = None
    work_since: float | None = None
    last_answer_at: float | None = None  # last tick where any probe got an HTTP answer
    failing_since: float | None = None  # no answer since then (the last answer, else the first failure)
    dead_503_since: float | None = None
    canary_in_flight_since: float | None = None
    last_canary_at: float | None = None
    canary_failures: int = 0
    restart_in_flight: bool = False
    restart_issued_at: float | None = None
    last_notice: str | None = None  # dedup key of the last refusal / notice logged
    metrics_error: str | None = None


def _progressed(prev: VllmSample | None, cur: VllmSample | None) -> bool:
    if prev is None or cur is None:
        return False
    if cur.kv_cache_usage != prev.kv_cache_usage:
        return True
    return any(c != p for c, p in zip(cur.progress_counters(), prev.progress_counters()))


def _fresh_start(track: Track, start_ts: float | None) -> Track:
    return Track(
        state=track.state,
        state_since=track.state_since,
        evidence=track.evidence,
        start_ts=start_ts,
        restart_in_flight=track.restart_in_flight,
        restart_issued_at=track.restart_issued_at,
        last_notice=None,
    )


def _ago(now: float, t: float | None) -> str:
    return "none seen yet" if t is None else f"{now - t:.0f} s ago"


def step(
    track: Track,
    obs: ReplicaObservation,
    now: float,
    rcfg: ReplicaConfig,
    wcfg: WatchdogConfig,
    pause: Pause | None = None,
) -> tuple[Track, bool]:
    """Fold one observation into the track. Returns (new track, whether to start a canary)."""
    unit = obs.unit
    t = track
    if unit is not None and unit.inactive_exit_ts != t.start_ts:
        t = _fresh_start(t, unit.inactive_exit_ts)
    if obs.restart_outcome is not None:
        t = replace(t, restart_in_flight=False)

    # --- bookkeeping that every rule may read -------------------------------------------
    sample = obs.metrics
    progressed = _progressed(t.last_sample, sample)  # a counter that went down (new engine) counts too
    canary = obs.canary
    canary_failed = False
    if canary is not None:
        t = replace(t, canary_in_flight_since=None, last_canary_at=canary.started_at + canary.latency_s)
        if canary.ok:
            progressed = True
            t = replace(t, canary_failures=0)
        elif t.last_progress_at is None or t.last_progress_at <= canary.started_at:
            canary_failed = True
            t = replace(t, canary_failures=t.canary_failures + 1)
    if progressed:
        t = replace(t, last_progress_at=now)
    if sample is not None:
        if sample.queued > 0 and t.work_since is None:
            t = replace(t, work_since=now)
        elif sample.queued == 0:
            t = replace(t, work_since=None)
        t = replace(t, last_sample=sample)
    if obs.all_probes_failed:
        # Counted from the last answer, not from the first failed tick: a hung probe takes its
        # whole timeout, and counting from its end would add that timeout to every detection.
        since = t.failing_since if t.failing_since is not None else t.last_answer_at
        t = replace(t, failing_since=since if since is not None else now)
    else:
        t = replace(t, failing_since=None, last_answer_at=now)
    if obs.health.status == 503:
        t = replace(t, dead_503_since=t.dead_503_since if t.dead_503_since is not None else now)
    else:
        t = replace(t, dead_503_since=None)
    health_in_time = obs.health.ok and obs.health.latency_s < rcfg.health_timeout_s
    if health_in_time and not t.healthy_since_start:
        t = replace(t, healthy_since_start=True)

    state, evidence = _classify(t, obs, now, rcfg, wcfg, pause, progressed, health_in_time, canary_failed)

    # --- canary scheduling ----------------------------------------------------------------
    want_canary = False
    if (
        state in (HEALTHY, DEGRADED)
        and sample is not None
        and sample.queued == 0
        and obs.health.answered
        and t.canary_in_flight_since is None
    ):
        gap = wcfg.canary_retry_s if t.canary_failures else wcfg.canary_interval_s
        last = max(x for x in (t.last_progress_at, t.last_canary_at, t.start_ts, 0.0) if x is not None)
        if now - last >= gap:
            want_canary = True
            t = replace(t, canary_in_flight_since=now)

    if state != t.state:
        t = replace(t, state=state, state_since=now, evidence=evidence)
    else:
        t = replace(t, evidence=evidence)
    return t, want_canary


def _classify(t, obs, now, rcfg, wcfg, pause, progressed, health_in_time, canary_failed) -> tuple[str, str]:
    unit = obs.unit
    if pause is not None and (pause.until is None or now < pause.until):
        until = "until resumed" if pause.until is None else f"for {pause.until - now:.0f} s more"
        return PAUSED, f"paused by {pause.reason} {until}"
    if unit is None:
        return UNKNOWN, f"systemd not reachable: {obs.unit_error or 'D-Bus error'}"
    if not unit.exists or unit.active_state in ("inactive", "failed"):
        what = unit.load_state if not unit.exists else unit.active_state
        return STOPPED, f"unit {unit.name} is {what}"
    if unit.active_state in ("activating", "deactivating") or t.restart_in_flight:
        why = "restart by guardian in flight" if t.restart_in_flight else f"unit {unit.active_state}"
        return STARTING, why
    since = now - t.start_ts if t.start_ts is not None else None
    if not t.healthy_since_start and (since is None or since < rcfg.startup_grace_s):
        shown = "unknown time" if since is None else f"{since:.0f} s"
        return STARTING, f"loading for {shown} of {rcfg.startup_grace_s:.0f} s grace"
    if obs.models is not None and rcfg.model not in obs.models:
        served = ", ".join(obs.models) or "nothing"
        return WRONG_MODEL, f"/v1/models lists {served}, expected {rcfg.model}"
    quiet_for = now - t.last_progress_at if t.last_progress_at is not None else float("inf")
    if t.failing_since is not None and now - t.failing_since >= wcfg.unresponsive_after_s and quiet_for >= wcfg.unresponsive_after_s:
        return UNRESPONSIVE, (
            f"no HTTP answer for {now - t.failing_since:.0f} s (/health: {obs.health.error}), "
            f"last progress {_ago(now, t.last_progress_at)}"
        )
    if t.dead_503_since is not None and now - t.dead_503_since >= wcfg.unresponsive_after_s and quiet_for >= wcfg.unresponsive_after_s:
        return UNRESPONSIVE, f"/health 503 (engine dead) for {now - t.dead_503_since:.0f} s, last progress {_ago(now, t.last_progress_at)}"
    sample = obs.metrics
    if progressed:
        if health_in_time:
            return HEALTHY, _work(sample) + ", tokens flowing"
        return BUSY, f"/health {obs.health.error or f'took {obs.health.latency_s:.1f} s'}, but counters advance ({_work(sample)})"
    if sample is not None and sample.queued > 0:
        ref = max(x for x in (t.last_progress_at, t.work_since) if x is not None)
        if now - ref >= wcfg.stall_window_s:
            return STALLED, (
                f"{_work(sample)} and no counter progress for {now - ref:.0f} s "
                f"(/health {'200' if obs.health.ok else obs.health.error})"
            )
    if sample is not None and sample.queued == 0 and t.canary_failures >= wcfg.canary_failures:
        return IDLE_DEAD, (
            f"idle, and {t.canary_failures} canary completions failed in a row "
            f"(/health {'200' if obs.health.ok else obs.health.error})"
        )
    if not obs.health.ok and quiet_for < wcfg.stall_window_s:
        return BUSY, f"/health {obs.health.error}, progress {_ago(now, t.last_progress_at)}"
    problems = [
        f"{label}: {p.error}"
        for label, p in (("/health", obs.health), ("/metrics", obs.metrics_probe), ("/v1/models", obs.models_probe))
        if not p.ok
    ]
    if canary_failed or t.canary_failures:
        problems.append(f"{t.canary_failures} canary failure(s)")
    if problems:
        return DEGRADED, "; ".join(problems)
    return HEALTHY, _work(sample) if sample is not None else "answering"


def _work(sample: VllmSample | None) -> str:
    if sample is None:
        return "queue unknown"
    return f"{sample.running:.0f} running, {sample.waiting:.0f} waiting"
