"""Per-replica liveness: every state and every transition rule lives in this module.

Pure: a Track (what guardian remembers about one replica) plus one ReplicaObservation plus
``now`` give the next Track, whose ``state`` is the verdict. No clock, no I/O, no sleeping.

Rules, first match wins: the rows of RULES below (ids L1-L17), rendered into the README.
``W`` = watchdog config, ``R`` = replica config, times in seconds.

Progress means: any of generation_tokens_total, prompt_tokens_total,
iteration_tokens_total_count/_sum, request_success_total went up, or kv_cache_usage_perc changed
(it moves during a long chunked prefill when the token counters stand still), or a counter went
down (the engine restarted), or a canary completed, or the kernel saw a response flowing to a
client (ConnView.flowing > 0: bytes acked on a client connection since the last look while the
client sent nothing). The last one is evidence of its own: /metrics is served by the same event
loop as /health, so when a starved API server answers no probe, counters cannot show progress
while its streams still deliver tokens (measured on vLLM 0.32: 11 s).

Queued work means: running + waiting > 0 on /metrics, or clients waiting: client connections
whose request has had no byte of answer for >= W.client_wait_s (ConnView.waiting; an engine
frozen between two steps shows 0 running and 0 waiting while its clients wait in the API server).

Traffic means: queued work, or a counter moved, at a tick with no canary of guardian's
in flight or just folded in (a canary's own token is not traffic); with one, running + waiting > 1,
or generation_tokens_total or request_success_total up by more than 1 (more than the canary).

A canary (a 1-token completion) is asked for only when /metrics is readable, /health answered
and none is in flight, and one of:
- idle (running + waiting == 0) and no canary since the last traffic and
  now - last traffic >= W.canary_after_traffic_s (an engine that froze between two steps shows
  0 running, 0 waiting and frozen counters while clients' requests wait: this finds it);
- idle and now - max(last progress, last canary, start) >= W.canary_interval_s
  (W.canary_retry_s after a failure);
- work queued (running + waiting > 0) and nothing moved for >= W.stall_canary_after_s, and no
  canary yet in this quiet spell (W.canary_retry_s after a failure).
- learning: healthy or degraded (idle or not), and fewer than 3 canaries have succeeded: one at once,
  at every tick, at most LEARNING_CANARIES (3) times per replica per guardian run (a restart of the
  replica does not give it more), so that its deadline is learned within seconds of it first
  serving; a failed one counts as any failed canary.
Its deadline is canary_deadline(): R.canary_timeout_s until 3 canaries have succeeded, then
W.canary_deadline_factor x the slowest of the last 8 successful ones, within
[W.canary_deadline_floor_s, R.canary_timeout_s]. The latencies are kept in the state file
(act/state.py), so a guardian restart or reload, or a restart of the replica, learns nothing anew.
A failed canary counts only if no progress was seen while it ran (real traffic proves the
engine; a kv change during a long prefill proves it too).

When the unit's start time changes (it was restarted, by anyone), everything but the restart
bookkeeping, the canary latencies and the count of learning canaries is forgotten, and rule L5
applies afresh.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import ReplicaConfig, WatchdogConfig
from .observations import Pause, Probe, ReplicaObservation, VllmSample
from .rules import Rule
from .vocab import ActiveState, State

S = State
RULES = (
    Rule("L1", S.PAUSED, "an operator pause is in force (`guardian pause`; until <= now ends it)"),
    Rule("L2", S.UNKNOWN, "systemd could not be asked about the unit (D-Bus error, or the bus is not connected)"),
    Rule(
        "L3",
        S.STOPPED,
        "unit not found, inactive or failed (a masked unit still running is judged, and the restart gates refuse it)",
    ),
    Rule("L4", S.STARTING, "unit activating, deactivating or in maintenance, or a restart by guardian is in flight"),
    Rule(
        "L5",
        S.STARTING,
        "unit active, not healthy once since it last started, AND now - start < R.startup_grace_s "
        "(start = systemd's InactiveExitTimestampMonotonic)",
    ),
    Rule("L6", S.WRONG_MODEL, "/v1/models answered AND does not list R.model"),
    Rule(
        "L7",
        S.UNRESPONSIVE,
        "no probe got any HTTP answer for >= W.unresponsive_after_s (counted from the last "
        "answer) AND no progress for >= W.unresponsive_after_s",
    ),
    Rule(
        "L8",
        S.UNRESPONSIVE,
        "/health answered 503 (vLLM: engine dead) for >= W.unresponsive_after_s AND no "
        "progress for >= W.unresponsive_after_s",
    ),
    Rule(
        "L9",
        "(unchanged)",
        "no probe answered this tick AND one sent at an earlier tick is still running (each bounded by "
        "its timeout): no news, the verdict stands (L1-L8 still apply)",
    ),
    Rule(
        "L10",
        S.BUSY,
        "progress this tick (counters, or responses flowing to clients per the kernel) AND (/health failed "
        "OR took >= R.health_timeout_s)",
    ),
    Rule(
        "L11",
        S.HEALTHY,
        "progress this tick (counters, or responses flowing to clients per the kernel) AND /health answered "
        "2xx in < R.health_timeout_s",
    ),
    Rule(
        "L12",
        S.STALLED,
        "/metrics readable AND queued work (running + waiting > 0, or clients waiting >= W.client_wait_s) "
        "AND now - max(last progress, work first queued) >= W.stall_window_s",
    ),
    Rule(
        "L13",
        S.STALLED,
        "/metrics readable AND queued work (as L12) AND a canary sent after the last progress (and "
        "after work was first queued) failed with no progress while it ran",
    ),
    Rule(
        "L14",
        S.IDLE_DEAD,
        "/metrics readable AND no queued work AND consecutive failed canaries >= W.canary_failures",
    ),
    Rule("L15", S.BUSY, "/health failed AND last progress < W.stall_window_s ago"),
    Rule(
        "L16", S.DEGRADED, "some probe failed, or /metrics unreadable, or a canary failed (no grounds to restart yet)"
    ),
    Rule("L17", S.HEALTHY, "otherwise"),
)
del S


@dataclass(frozen=True)
class Track:
    state: State = State.STARTING
    rule: str = "L4"  # the id of the rule behind the verdict
    state_since: float = 0.0
    observed: bool = False  # False until the first observation has been folded in
    evidence: str = "no observation yet"
    start_ts: float | None = None
    healthy_since_start: bool = False
    last_sample: VllmSample | None = None
    last_progress_at: float | None = None
    work_since: float | None = None
    last_answer_at: float | None = None  # last tick where any probe got an HTTP answer
    failing_since: float | None = None  # no answer since then (the last answer, else the first failure)
    dead_503_since: float | None = None
    canary_in_flight_since: float | None = None
    canary_due_at: float | None = None  # when the canary in flight has failed if it has not answered
    last_canary_ok_at: float | None = None  # when the last successful canary was sent
    first_seen_at: float | None = None  # guardian's first observation of this replica (this run)
    last_canary_at: float | None = None
    canary_failures: int = 0
    canary_latencies: tuple[float, ...] = ()  # the last successful canaries' latencies, newest last
    learning_canaries: int = 0  # canaries sent at once to learn the deadline (at most LEARNING_CANARIES)
    stall_proof_at: float | None = None  # start of a canary that failed with work queued and nothing moving
    last_traffic_at: float | None = None
    restart_in_flight: bool = False
    restart_issued_at: float | None = None
    last_notice: tuple[str, ...] | None = None  # stable key of the last refusal or notice logged
    metrics_error: str | None = None


def _progressed(prev: VllmSample | None, cur: VllmSample | None) -> bool:
    if prev is None or cur is None:
        return False
    if cur.kv_cache_usage != prev.kv_cache_usage:
        return True
    return any(c != p for c, p in zip(cur.progress_counters(), prev.progress_counters(), strict=False))


def _flowing(obs: ReplicaObservation) -> bool:
    """The kernel saw a response flowing to a client since its last look (ConnView)."""
    return obs.conns is not None and obs.conns.flowing > 0


def _progress_at(t: Track, obs: ReplicaObservation, now: float, seen_now: bool) -> float:
    """When the progress seen at this tick happened: now for counters and canaries; for a response
    flowing, when its last byte was sent (a frozen server's last bytes are acked after the freeze:
    counted at the look, they would stretch L7's window by up to a tick), counted from when the
    kernel was read (the tick judges after its probe wait)."""
    c = obs.conns
    if seen_now or c is None or c.last_flow_s is None:
        return now
    at = min(now, c.at if c.at is not None else now)
    return max(at - c.last_flow_s, t.last_progress_at if t.last_progress_at is not None else float("-inf"))


def _waits(t: Track, obs: ReplicaObservation, now: float, wcfg: WatchdogConfig) -> tuple[int, float]:
    """Client connections whose request has had no byte of answer for >= W.client_wait_s, and when
    the longest-waiting of them spoke. A client waiting since before the last successful canary
    (an upload stuck half-way: uvicorn has no timeout for it) proves nothing about the engine,
    and none counts from before guardian first saw the replica."""
    c = obs.conns
    if c is None or c.waiting == 0:
        return 0, now
    at = min(now, c.at if c.at is not None else now)
    waits = c.waits_s
    after = max(x for x in (t.last_canary_ok_at, t.first_seen_at, float("-inf")) if x is not None)
    counted = [w for w in waits if w >= wcfg.client_wait_s and at - w >= after]
    if not counted:
        return 0, now
    return len(counted), max(at - max(counted), t.first_seen_at if t.first_seen_at is not None else float("-inf"))


def _queued(sample: VllmSample | None, waiting_clients: int) -> float:
    return (sample.queued if sample is not None else 0.0) + waiting_clients


def _beyond_a_canary(prev: VllmSample | None, cur: VllmSample) -> bool:
    """Traffic while a canary of guardian's runs: more than one request in the engine, or counters
    that moved more than one 1-token canary explains (one generated token, one finished request)."""
    if cur.queued > 1:
        return True
    if prev is None:
        return False
    return cur.generation_tokens - prev.generation_tokens > 1 or cur.request_success - prev.request_success > 1


CANARY_LATENCIES_KEPT = 8
CANARY_LATENCIES_NEEDED = 3
LEARNING_CANARIES = 3  # canaries sent at once, one a tick, to a replica with nothing learned


def canary_deadline(t: Track, rcfg: ReplicaConfig, wcfg: WatchdogConfig) -> float:
    """A canary's deadline, from this replica's own canaries while it was healthy."""
    if len(t.canary_latencies) < CANARY_LATENCIES_NEEDED:
        return rcfg.canary_timeout_s
    learned = wcfg.canary_deadline_factor * max(t.canary_latencies)
    return min(rcfg.canary_timeout_s, max(wcfg.canary_deadline_floor_s, learned))


# A canary's result is taken at the tick after its deadline; its task ends a little after it.
CANARY_JUDGE_MARGIN_S = 0.25
CANARY_LOST_AFTER_S = 30.0  # past its deadline with no result: forgotten, as if never sent


def next_deadline(t: Track, wcfg: WatchdogConfig) -> float | None:
    """The next moment at which T's verdict may change with no news, or None: its unresponsive
    window ends (L7, L8) if no answer and no progress comes before it; the canary in flight has
    failed (its deadline); a stall canary falls due (queued work, nothing moving for
    W.stall_canary_after_s). The daemon judges at that moment instead of at the next tick mark:
    a frozen server is then found U seconds after its last answer, and a frozen engine with work
    queued as soon as its canary's deadline passes, not up to a tick later."""
    if t.state not in (State.HEALTHY, State.BUSY, State.DEGRADED):
        return None
    quiet_from = t.last_progress_at if t.last_progress_at is not None else float("-inf")
    ends = [
        max(since, quiet_from) + wcfg.unresponsive_after_s
        for since in (t.failing_since, t.dead_503_since)
        if since is not None
    ]
    if t.canary_due_at is not None:
        ends.append(t.canary_due_at + CANARY_JUDGE_MARGIN_S)
    elif t.work_since is not None:
        quiet_ref = max(x for x in (t.last_progress_at, t.work_since) if x is not None)
        if t.last_canary_at is None or t.last_canary_at < quiet_ref:
            ends.append(quiet_ref + wcfg.stall_canary_after_s)
    return min(ends) if ends else None


def _fresh_start(track: Track, start_ts: float | None) -> Track:
    return Track(
        state=track.state,
        rule=track.rule,
        state_since=track.state_since,
        observed=track.observed,
        evidence=track.evidence,
        start_ts=start_ts,
        restart_in_flight=track.restart_in_flight,
        restart_issued_at=track.restart_issued_at,
        last_notice=None,
        canary_latencies=track.canary_latencies,  # the same model on the same box: still a fair guide
        learning_canaries=track.learning_canaries,  # at most LEARNING_CANARIES per guardian run
    )


def _ago(now: float, t: float | None) -> str:
    return "none seen yet" if t is None else f"{now - t:.0f} s ago"


@dataclass(frozen=True)
class _Seen:
    """What this observation shows, worked out once for the rules and the canary schedule."""

    counters_moved: bool  # a counter moved or the kv cache changed
    progressed: bool  # any progress: counters, a canary that answered, or a response flowing
    waiting_clients: int  # clients waiting that count as queued work (_waits)
    waiting_since: float  # when the longest-waiting of them spoke
    queued: float  # running + waiting on /metrics, plus those clients
    health_in_time: bool
    canary_failed: bool  # a canary failed this tick with no progress while it ran


def step(
    track: Track,
    obs: ReplicaObservation,
    now: float,
    rcfg: ReplicaConfig,
    wcfg: WatchdogConfig,
    pause: Pause | None = None,
) -> tuple[Track, float | None]:
    """Fold one observation into the track. Returns (new track, the deadline of a canary to start, or None)."""
    t = _carry_over(track, obs, now)
    t, seen = _fold(t, obs, now, rcfg, wcfg)
    state, rule, evidence = _classify(t, obs, now, rcfg, wcfg, pause, seen)
    t, want_canary = _schedule_canary(t, obs, state, seen, now, rcfg, wcfg)
    if state != t.state:
        t = replace(t, state=state, state_since=now)
    return replace(t, rule=rule, evidence=evidence, observed=True), want_canary


def _carry_over(t: Track, obs: ReplicaObservation, now: float) -> Track:
    """What outlives this observation: a new start of the unit forgets, a restart's outcome ends it,
    a canary whose result never came is given up."""
    unit = obs.unit
    if unit is not None and unit.inactive_exit_mono != t.start_ts:
        t = _fresh_start(t, unit.inactive_exit_mono)
    if obs.restart_outcome is not None:
        t = replace(t, restart_in_flight=False)
    if obs.canary is None and t.canary_due_at is not None and now > t.canary_due_at + CANARY_LOST_AFTER_S:
        # its result never came (the executor lost it): no canary would ever be sent again
        t = replace(t, canary_in_flight_since=None, canary_due_at=None)
    if t.first_seen_at is None:
        t = replace(t, first_seen_at=now)
    return t


def _fold(
    t: Track, obs: ReplicaObservation, now: float, rcfg: ReplicaConfig, wcfg: WatchdogConfig
) -> tuple[Track, _Seen]:
    """The bookkeeping that every rule may read: progress, queued work, traffic, the canary that
    came back, answers and 503s."""
    sample = obs.metrics
    counters_moved = _progressed(t.last_sample, sample)  # a counter that went down (new engine) counts too
    waiting_clients, waiting_since = _waits(t, obs, now, wcfg)
    queued = _queued(sample, waiting_clients)
    ours = t.canary_in_flight_since is not None or obs.canary is not None  # a canary's token is not traffic
    if sample is not None and (
        (not ours and (counters_moved or queued > 0)) or (ours and _beyond_a_canary(t.last_sample, sample))
    ):
        t = replace(t, last_traffic_at=now)
    t, canary_ok, canary_failed = _fold_canary(t, obs, queued)
    progressed = counters_moved or canary_ok or _flowing(obs)
    if progressed:
        t = replace(t, last_progress_at=_progress_at(t, obs, now, counters_moved or canary_ok))
    if sample is not None:
        if queued > 0 and t.work_since is None:
            # clients waiting were queued from the moment the longest-waiting one spoke
            t = replace(t, work_since=waiting_since if waiting_clients else now)
        elif queued == 0:
            t = replace(t, work_since=None)
        t = replace(t, last_sample=sample)
    if obs.all_probes_failed or obs.probes_pending_s is not None:
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
    seen = _Seen(counters_moved, progressed, waiting_clients, waiting_since, queued, health_in_time, canary_failed)
    return t, seen


def _fold_canary(t: Track, obs: ReplicaObservation, queued: float) -> tuple[Track, bool, bool]:
    """The canary that came back this tick, if any: (track, it answered, it failed and counts)."""
    canary = obs.canary
    if canary is None:
        return t, False, False
    t = replace(t, canary_in_flight_since=None, canary_due_at=None, last_canary_at=canary.started_at + canary.latency_s)
    if canary.ok:
        kept = (*t.canary_latencies, canary.latency_s)[-CANARY_LATENCIES_KEPT:]
        return replace(t, canary_failures=0, canary_latencies=kept, last_canary_ok_at=canary.started_at), True, False
    if t.last_progress_at is not None and t.last_progress_at > canary.started_at:
        return t, False, False  # something moved while it ran: the engine was working
    t = replace(t, canary_failures=t.canary_failures + 1)
    if obs.metrics is not None and queued > 0:
        t = replace(t, stall_proof_at=canary.started_at)
    return t, False, True


def _schedule_canary(
    t: Track, obs: ReplicaObservation, state: State, seen: _Seen, now: float, rcfg: ReplicaConfig, wcfg: WatchdogConfig
) -> tuple[Track, float | None]:
    """A canary to send now, and its deadline (the module docstring's canary rules), or None."""
    if (
        state not in (State.HEALTHY, State.DEGRADED, State.BUSY)
        or obs.metrics is None
        or not obs.health.answered
        or t.canary_in_flight_since is not None
    ):
        return t, None
    due = False
    # Under load too: a replica that is never idle must still learn its deadline (its canaries
    # then wait their turn, and the learned deadline is the longer for it).
    learning = (
        state in (State.HEALTHY, State.DEGRADED)
        and len(t.canary_latencies) < CANARY_LATENCIES_NEEDED
        and t.learning_canaries < LEARNING_CANARIES
    )
    if learning:
        due = True
        t = replace(t, learning_canaries=t.learning_canaries + 1)
    elif seen.queued == 0:
        if t.canary_failures:
            due = now - max(x for x in (t.last_canary_at, 0.0) if x is not None) >= wcfg.canary_retry_s
        elif t.last_traffic_at is not None and (t.last_canary_at is None or t.last_canary_at < t.last_traffic_at):
            due = now - t.last_traffic_at >= wcfg.canary_after_traffic_s
        else:
            last = max(x for x in (t.last_progress_at, t.last_canary_at, t.start_ts, 0.0) if x is not None)
            due = now - last >= wcfg.canary_interval_s
    else:
        quiet_ref = max(x for x in (t.last_progress_at, t.work_since) if x is not None)
        if now - quiet_ref >= wcfg.stall_canary_after_s:
            asked = t.last_canary_at is not None and t.last_canary_at >= quiet_ref
            due = not asked or now - (t.last_canary_at or 0.0) >= wcfg.canary_retry_s
    if not due:
        return t, None
    deadline = canary_deadline(t, rcfg, wcfg)
    return replace(t, canary_in_flight_since=now, canary_due_at=now + deadline), deadline


def _classify(
    t: Track,
    obs: ReplicaObservation,
    now: float,
    rcfg: ReplicaConfig,
    wcfg: WatchdogConfig,
    pause: Pause | None,
    seen: _Seen,
) -> tuple[State, str, str]:
    unit = obs.unit
    if pause is not None and (pause.until is None or now < pause.until):
        until = "until resumed" if pause.until is None else f"for {pause.until - now:.0f} s more"
        return State.PAUSED, "L1", f"paused by {pause.reason} {until}"
    if unit is None:
        return State.UNKNOWN, "L2", f"systemd not reachable: {obs.unit_error or 'D-Bus error'}"
    if not unit.exists or unit.active_state.down:
        what = unit.load_state if not unit.exists else unit.active_state
        return State.STOPPED, "L3", f"unit {unit.name} is {what}"
    if unit.active_state.transitional or unit.active_state is ActiveState.OTHER or t.restart_in_flight:
        why = "restart by guardian in flight" if t.restart_in_flight else f"unit {unit.active_state}"
        return State.STARTING, "L4", why
    since = now - t.start_ts if t.start_ts is not None else None
    if not t.healthy_since_start and (since is None or since < rcfg.startup_grace_s):
        shown = "unknown time" if since is None else f"{since:.0f} s"
        return State.STARTING, "L5", f"loading for {shown} of {rcfg.startup_grace_s:.0f} s grace"
    if obs.models is not None and rcfg.model not in obs.models:
        served = ", ".join(obs.models) or "nothing"
        return State.WRONG_MODEL, "L6", f"/v1/models lists {served}, expected {rcfg.model}"
    quiet_for = now - t.last_progress_at if t.last_progress_at is not None else float("inf")
    if (
        t.failing_since is not None
        and now - t.failing_since >= wcfg.unresponsive_after_s
        and quiet_for >= wcfg.unresponsive_after_s
    ):
        return (
            State.UNRESPONSIVE,
            "L7",
            (
                f"no HTTP answer for {now - t.failing_since:.0f} s (/health: {obs.health.error}), "
                f"last progress {_ago(now, t.last_progress_at)}{_kernel_quiet(obs)}"
            ),
        )
    if (
        t.dead_503_since is not None
        and now - t.dead_503_since >= wcfg.unresponsive_after_s
        and quiet_for >= wcfg.unresponsive_after_s
    ):
        return (
            State.UNRESPONSIVE,
            "L8",
            f"/health 503 (engine dead) for {now - t.dead_503_since:.0f} s, "
            f"last progress {_ago(now, t.last_progress_at)}",
        )
    if obs.probes_pending_s is not None and t.observed:
        return t.state, "L9", t.evidence
    sample, queued = obs.metrics, seen.queued
    work = _work(sample, seen, now)
    if seen.progressed:
        how = "counters advance" if seen.counters_moved or not _flowing(obs) else _flow(obs)
        if seen.health_in_time:
            return State.HEALTHY, "L11", work + (", tokens flowing" if seen.counters_moved else f", {how}")
        return (
            State.BUSY,
            "L10",
            f"/health {obs.health.error or f'took {obs.health.latency_s:.1f} s'}, but {how} ({work})",
        )
    if sample is not None and queued > 0:
        ref = max(x for x in (t.last_progress_at, t.work_since) if x is not None)
        if now - ref >= wcfg.stall_window_s:
            return (
                State.STALLED,
                "L12",
                (
                    f"{work} and no counter progress for {now - ref:.0f} s "
                    f"(/health {'200' if obs.health.ok else obs.health.error})"
                ),
            )
    if sample is not None and queued > 0 and t.stall_proof_at is not None:
        ref = max(x for x in (t.last_progress_at, t.work_since) if x is not None)
        if t.stall_proof_at >= ref:
            return (
                State.STALLED,
                "L13",
                (
                    f"{work}, nothing moved for {now - ref:.0f} s, and a canary sent "
                    f"{now - t.stall_proof_at:.0f} s ago failed with nothing moving "
                    f"(/health {'200' if obs.health.ok else obs.health.error})"
                ),
            )
    if sample is not None and queued == 0 and t.canary_failures >= wcfg.canary_failures:
        return (
            State.IDLE_DEAD,
            "L14",
            (
                f"idle, and {t.canary_failures} canary completions failed in a row "
                f"(/health {'200' if obs.health.ok else obs.health.error})"
            ),
        )
    if not obs.health.ok and quiet_for < wcfg.stall_window_s:
        return State.BUSY, "L15", f"/health {obs.health.error}, progress {_ago(now, t.last_progress_at)}"
    probes: tuple[tuple[str, Probe], ...] = (
        ("/health", obs.health),
        ("/metrics", obs.metrics_probe),
        ("/v1/models", obs.models_probe),
    )
    problems = [f"{label}: {p.error}" for label, p in probes if not p.ok]
    if seen.canary_failed or t.canary_failures:
        problems.append(f"{t.canary_failures} canary failure(s)")
    if problems:
        return State.DEGRADED, "L16", "; ".join(problems)
    return State.HEALTHY, "L17", work if sample is not None else "answering"


def _work(sample: VllmSample | None, seen: _Seen, now: float) -> str:
    text = "queue unknown" if sample is None else f"{sample.running:.0f} running, {sample.waiting:.0f} waiting"
    if seen.waiting_clients:
        text += f", {seen.waiting_clients} client(s) waiting for an answer for up to {now - seen.waiting_since:.0f} s"
    return text


def _kernel_quiet(obs: ReplicaObservation) -> str:
    c = obs.conns
    if c is None or c.since_s is None:
        return ""
    cpu = f", its unit used {1000 * c.cpu_s:.0f} ms of CPU" if c.cpu_s is not None else ""
    return f"; kernel: nothing flowed to {c.connections} connection(s) in {c.since_s:.1f} s{cpu}"


def _flow(obs: ReplicaObservation) -> str:
    c = obs.conns
    if c is None:
        return "no kernel view"
    over = f" in {c.since_s:.1f} s" if c.since_s is not None else ""
    return f"responses flowing to {c.flowing} client connection(s), {c.bytes_out} bytes{over} (kernel)"
