"""Per-replica liveness: every state and every transition rule lives in this module.

Pure: a Track (what guardian remembers about one replica) plus one ReplicaObservation plus
``now`` give the next Track, whose ``state`` is the verdict. No clock, no I/O, no sleeping.

Rules, first match wins: the rows of ROWS below (ids L1-L18, in table order), each its table row, the predicate
that says when it holds and the evidence it gives, over one _Facts value; RULES (their rules) is
rendered into docs/rules.md. ``W`` = watchdog config, ``R`` = replica config, times in seconds.

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

The queue is judged (queue_judged) when /metrics was read; or when the replica's engine serves no
page as started (llama-server without --metrics, SGLang without --enable-metrics: the observation's
metrics_offered is False), or serves it from its engine's own loop (llama-server) and it did not come
while /health answered in time: the engine then does not answer. In those two its clients waiting are
its queue, and the rows that say "queue judged" apply; L19, which reads the engine's own count, does not.

Traffic means: queued work, or a counter moved, at a tick with no canary of guardian's
in flight or just folded in (a canary's own token is not traffic); with one, running + waiting > 1,
or generation_tokens_total or request_success_total up by more than 1 (more than the canary).

A canary (a 1-token completion) is asked for only when /metrics is readable (or this tick's is in
flight and the last look's was; or the engine serves none; or it serves it from its own loop and
/health answered 2xx), /health answered or is in flight, and none is in flight, and one of:
- idle (running + waiting == 0) and no canary since the last traffic and
  now - last traffic >= W.canary_after_traffic_s (an engine that froze between two steps shows
  0 running, 0 waiting and frozen counters while clients' requests wait: this finds it);
- idle and now - max(last progress, last canary, start) >= W.canary_interval_s
  (W.canary_retry_s after a failure);
- work queued (running + waiting > 0) and nothing moved for >= W.stall_canary_after_s, and no
  canary yet in this quiet spell (W.canary_retry_s after a failure); for >= W.engine_quiet_s only,
  when the engine's processes have been quiet that long too (its answer, or C5, then says).
- learning: healthy or degraded (idle or not), and fewer than 3 canaries have succeeded: one at once,
  at every tick, at most LEARNING_CANARIES (3) times per replica per guardian run (a restart of the
  replica does not give it more), so that its deadline is learned within seconds of it first
  serving; a failed one counts as any failed canary.
- a closer look: idle, the canary in flight past its learned deadline (its late mark) with no
  progress since it was sent, and none sent for it yet: a second one beside it (_closer_look_due).
It is sent with the hard bound R.canary_timeout_s. Its learned deadline, canary_deadline(), only
marks it late: R.canary_timeout_s until 3 canaries have succeeded, then
W.canary_deadline_factor x the slowest of the last 8 successful ones, within
[W.canary_deadline_floor_s, R.canary_timeout_s]. The latencies are kept in the state file
(act/state.py), so a guardian restart or reload, or a restart of the replica, learns nothing anew.
What its result means is CANARY_ROWS (C1-C4): a late answer is an answer (C2, its latency learned,
so the deadline follows the box's load); a failure counts only with no sign of life while it ran
(C3, C4: real traffic proves the engine; a kv change during a long prefill proves it too).

When the unit's start time changes (it was restarted, by anyone), everything but the restart
bookkeeping, the canary latencies and the count of learning canaries is forgotten, and rule L6
applies afresh.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from ..config import ReplicaConfig, WatchdogConfig
from .container import engine_holder
from .observations import Activity, CanaryResult, Pause, Probe, ProcView, ReplicaObservation, UnitInfo, VllmSample
from .rules import UNCHANGED, Row, Rule, first_match
from .startloop import StartRun
from .vocab import SERVING_STATES, ActiveState, HeldBy, PortOwner, State


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
    judged: bool  # its queue is judged at this look (queue_judged)


@dataclass(frozen=True)
class _Facts:
    """Everything the rules read at one tick: the track with this observation folded in, the
    observation, what it shows, and the config."""

    track: Track
    obs: ReplicaObservation
    now: float
    rcfg: ReplicaConfig
    wcfg: WatchdogConfig
    pause: Pause | None
    seen: _Seen

    @property
    def unit(self) -> UnitInfo:
        """The unit as systemd reported it; the rows that read it come after the one for an unreachable systemd."""
        assert self.obs.unit is not None, "a row read the unit before the row for an unreachable systemd"
        return self.obs.unit

    @property
    def since_start_s(self) -> float | None:
        return self.now - self.track.start_ts if self.track.start_ts is not None else None

    @property
    def quiet_for_s(self) -> float:
        """Seconds since the last progress; infinite when none was ever seen."""
        last = self.track.last_progress_at
        return self.now - last if last is not None else float("inf")

    @property
    def failing_for_s(self) -> float:
        """Seconds with no HTTP answer; -inf while answers come (no threshold is reached)."""
        return _age_s(self.now, self.track.failing_since)

    @property
    def dead_503_for_s(self) -> float:
        return _age_s(self.now, self.track.dead_503_since)

    @property
    def work_queued(self) -> bool:
        """Its queue judged (queue_judged) AND queued work (running + waiting > 0, or clients waiting)."""
        return self.seen.judged and self.seen.queued > 0

    @property
    def quiet_since(self) -> float:
        """When the quiet spell with work queued began: the later of the last progress and when
        the work was first queued (only read while work is queued, when the latter is known)."""
        return max(at for at in (self.track.last_progress_at, self.track.work_since) if at is not None)

    @property
    def step_bound_s(self) -> float | None:
        """STEP_MARGIN x the longest step this replica was seen to take recently, or None: none learned."""
        return longest_step_s(self.track, self.now, self.wcfg.max_step_s)

    @property
    def engine_quiet_for_s(self) -> float:
        """How long the engine's processes have been quiet at this look (observe/procs.py); -inf:
        not quiet, not known, or not told apart from the API server."""
        return _quiet_for_s(self.obs.procs, self.track.engine_quiet_since)

    @property
    def api_quiet_for_s(self) -> float:
        """How long the API server's processes (the whole replica where the engine is not told
        apart) have been quiet at this look; -inf: not quiet or not known."""
        return _quiet_for_s(self.obs.procs, self.track.api_quiet_since)

    @property
    def health_said(self) -> str:
        return "200" if self.obs.health.ok else str(self.obs.health.error)

    @property
    def work_said(self) -> str:
        sample, seen = self.obs.metrics, self.seen
        text = "queue unknown" if sample is None else f"{sample.running:.0f} running, {sample.waiting:.0f} waiting"
        if seen.waiting_clients:
            waited_s = self.now - seen.waiting_since
            text += f", {seen.waiting_clients} client(s) waiting for an answer for up to {waited_s:.0f} s"
        return text

    @property
    def progress_said(self) -> str:
        """How progress showed: counters, or else the kernel's view of responses flowing."""
        flowing_only = not self.seen.counters_moved and _flowing(self.obs)
        return _flow(self.obs) if flowing_only else "counters advance"

    @property
    def problems(self) -> list[str]:
        """The probes that failed, and the canaries, for a degraded verdict."""
        obs, track = self.obs, self.track
        probes: tuple[tuple[str, Probe], ...] = (
            ("/health", obs.health),
            ("/metrics", obs.metrics_probe),
            ("/v1/models", obs.models_probe),
        )
        found = [
            f"{label}: {probe.error}"
            for label, probe in probes
            if not probe.ok and (label != "/metrics" or obs.metrics_offered)
        ]
        if self.seen.canary_failed or track.canary_failures:
            found.append(f"{track.canary_failures} canary failure(s)")
        return found


def queue_judged(obs: ReplicaObservation, health_in_time: bool) -> bool:
    """Whether the replica's queue is judged at this look: its page was read (running + waiting, and
    its clients waiting); or its engine serves none as started (ReplicaObservation.metrics_offered),
    or its page comes from the engine's own loop and did not come while /health answered in time
    (metrics_via_engine: the engine does not answer). In the last two its clients waiting are its queue."""
    if obs.metrics is not None or not obs.metrics_offered:
        return True
    return obs.metrics_via_engine and health_in_time


def _age_s(now: float, since: float | None) -> float:
    """Seconds since SINCE; -inf when it has not begun, so that no `age >= limit` holds."""
    return now - since if since is not None else float("-inf")


def _quiet_for_s(view: ProcView | None, since: float | None) -> float:
    return view.at - since if view is not None and since is not None else float("-inf")


def _ago(now: float, at: float | None) -> str:
    return "none seen yet" if at is None else f"{now - at:.0f} s ago"


# The evidence of the rows whose text takes more than a line; the others say it in the row.


def _paused(facts: _Facts) -> str:
    pause = facts.pause
    assert pause is not None, "said only under a pause"
    until = "until resumed" if pause.until is None else f"for {pause.until - facts.now:.0f} s more"
    return f"paused by {pause.reason} {until}"


def _loading(facts: _Facts) -> str:
    since_s = facts.since_start_s
    shown = "unknown time" if since_s is None else f"{since_s:.0f} s"
    return f"loading for {shown} of {facts.rcfg.startup_grace_s:.0f} s grace"


def _no_answer(facts: _Facts) -> str:
    last = _ago(facts.now, facts.track.last_progress_at)
    return (
        f"no HTTP answer for {facts.failing_for_s:.0f} s (/health: {facts.obs.health.error}), "
        f"last progress {last}{_kernel_quiet(facts.obs)}"
    )


def _busy_progressing(facts: _Facts) -> str:
    health = facts.obs.health
    return f"/health {health.error or f'took {health.latency_s:.1f} s'}, but {facts.progress_said} ({facts.work_said})"


def _healthy_progressing(facts: _Facts) -> str:
    return facts.work_said + (", tokens flowing" if facts.seen.counters_moved else f", {facts.progress_said}")


def _stall_proven(facts: _Facts) -> bool:
    proof_at = facts.track.stall_proof_at
    if not facts.work_queued or proof_at is None or proof_at < facts.quiet_since:
        return False
    bound_s = facts.step_bound_s
    return facts.now - facts.quiet_since >= (bound_s if bound_s is not None else facts.wcfg.stall_window_s)


def _stall_proof(facts: _Facts) -> str:
    proof_age_s = _age_s(facts.now, facts.track.stall_proof_at)
    return (
        f"{facts.work_said}, nothing moved for {facts.now - facts.quiet_since:.0f} s, and a canary sent "
        f"{proof_age_s:.0f} s ago failed with nothing moving (/health {facts.health_said}){_gpus(facts.obs)}"
    )


def _engine_quiet(facts: _Facts) -> str:
    return (
        f"{facts.work_said}, nothing moved for {facts.now - facts.quiet_since:.0f} s, and "
        f"{_used(facts.obs.procs, 'engine', facts.engine_quiet_for_s)} (/health {facts.health_said}){_gpus(facts.obs)}"
    )


def _gpus(obs: ReplicaObservation) -> str:
    """Each GPU's own sign of life where NVML reports it: "; GPU 0: 21 W, 96 % busy"; "" without."""
    said = []
    for g in obs.gpus:
        parts = [
            f"{g.power_w:.0f} W" if g.power_w is not None else "",
            f"{g.util_pct:.0f} % busy" if g.util_pct is not None else "",
        ]
        said.append(f"GPU {g.index}: " + ", ".join(p for p in parts if p))
    return "; " + "; ".join(said) if said else ""


def _engine_proof(facts: _Facts) -> str:
    proof_at = facts.track.engine_proof_at
    assert proof_at is not None, "said only after a canary the engine never touched"
    return (
        f"{facts.work_said if facts.seen.queued else 'idle'}; a canary sent {facts.now - proof_at:.0f} s ago got "
        f"nothing while {_used(facts.obs.procs, 'engine', facts.engine_quiet_for_s)} (/health {facts.health_said})"
        f"{_gpus(facts.obs)}"
    )


def _api_quiet(facts: _Facts) -> str:
    return (
        f"no HTTP answer for {facts.failing_for_s:.0f} s (/health: {facts.obs.health.error}), last progress "
        f"{_ago(facts.now, facts.track.last_progress_at)}, and "
        f"{_used(facts.obs.procs, 'api', facts.api_quiet_for_s)}{_kernel_quiet(facts.obs)}"
    )


def _used(view: ProcView | None, group: str, quiet_s: float) -> str:
    """How a group's quiet reads in a journal line: "its engine (2 processes) used 0 ms of CPU in 4 s"."""
    act: Activity | None = None if view is None else (view.engine if group == "engine" else view.api)
    whole = view is not None and ((group == "api" and not view.engine_named) or view.engine_whole)
    who = "its processes" if whole else ("its engine" if group == "engine" else "its API server")
    procs = f" ({act.procs} process{'es' if act.procs != 1 else ''})" if act is not None else ""
    return f"{who}{procs} used no CPU and waited for none in {quiet_s:.1f} s"


def port_taken_by(owner: PortOwner | None, rcfg: ReplicaConfig) -> HeldBy | None:
    """The listener on the replica's address when it is known to be someone else's. A holder that
    may still be the replica's own (a container its engine has not named yet, a process guardian
    cannot map to a unit) is not: its answers are judged as the replica's, and G7 refuses to
    restart while it is unknown."""
    if not isinstance(owner, HeldBy) or owner.own_container or owner.unit is None or owner.unit == rcfg.unit:
        return None
    if rcfg.container is None or owner.stray:
        return owner
    # a container replica's port held by a unit no engine holds ports from (seen as no container)
    return owner if not owner.via and owner.container is None and not engine_holder(owner.unit) else None


def _port_taken(facts: _Facts) -> str:
    owner = port_taken_by(facts.obs.port_owner, facts.rcfg)
    assert owner is not None, "said only while the port is another's"
    pid = f", pid {owner.pid}" if owner.pid is not None else ""
    return (
        f"port {owner.port} is held by {owner.holder_text()}{pid}, not by {facts.rcfg.unit}: "
        "what answers there is not this replica"
    )


def _no_canary_in_flight(track: Track) -> Track:
    """TRACK with no canary in flight (none, nor a closer look): forgotten, never judged."""
    return replace(
        track,
        canary_in_flight_since=None,
        canary_due_at=None,
        canary_late_at=None,
        closer_since=None,
        closer_due_at=None,
    )


def _not_its_answers(track: Track, obs: ReplicaObservation) -> tuple[Track, ReplicaObservation]:
    """OBS without the answers of a listener that is not the replica's: nothing they say (health,
    counters, a model, a canary) is the replica's progress or its start's end (issue 34 row 13)."""
    none = Probe(False, None, 0.0, "answered by another's listener")
    if obs.canary is not None:
        track = _no_canary_in_flight(track)
    blind = replace(
        obs,
        health=none,
        metrics_probe=none,
        metrics=None,
        models_probe=none,
        models=None,
        canary=None,
        probes_pending_s=None,
    )
    return track, blind


# First match wins: a row may count on the rows above it not holding.
ROWS: tuple[Row[_Facts, str], ...] = (
    Row(
        Rule("L1", State.PAUSED, "an operator pause is in force (`guardian pause`; until <= now ends it)"),
        lambda f: f.pause is not None and (f.pause.until is None or f.now < f.pause.until),
        _paused,
    ),
    Row(
        Rule(
            "L2", State.UNKNOWN, "systemd could not be asked about the unit (D-Bus error, or the bus is not connected)"
        ),
        lambda f: f.obs.unit is None,
        lambda f: f"systemd not reachable: {f.obs.unit_error or 'D-Bus error'}",
    ),
    Row(
        Rule(
            "L3",
            State.STOPPED,
            "unit not found, inactive or failed (a masked unit still running is judged, and the restart gates "
            "refuse it)",
        ),
        lambda f: not f.unit.exists or f.unit.active_state.down,
        lambda f: f"unit {f.unit.name} is {f.unit.load_state if not f.unit.exists else f.unit.active_state}",
    ),
    Row(
        Rule(
            "L4",
            State.PORT_TAKEN,
            "the listener on the replica's address is known to be another's (not R.unit's cgroup and not "
            "R.container: another unit, a container of another name or engine, a forged engine scope): its "
            "answers are not the replica's, and none of them is folded in",
        ),
        lambda f: port_taken_by(f.obs.port_owner, f.rcfg) is not None,
        _port_taken,
    ),
    Row(
        Rule(
            "L5",
            State.STARTING,
            "unit activating, deactivating or in maintenance, or a restart by guardian is in flight",
        ),
        lambda f: (
            f.unit.active_state.transitional or f.unit.active_state is ActiveState.OTHER or f.track.restart_in_flight
        ),
        lambda f: "restart by guardian in flight" if f.track.restart_in_flight else f"unit {f.unit.active_state}",
    ),
    Row(
        Rule(
            "L6",
            State.STARTING,
            "unit active, not healthy once since it last started, AND now - start < R.startup_grace_s "
            "(start = systemd's InactiveExitTimestampMonotonic)",
        ),
        lambda f: (
            not f.track.healthy_since_start and (f.since_start_s is None or f.since_start_s < f.rcfg.startup_grace_s)
        ),
        _loading,
    ),
    Row(
        Rule("L7", State.WRONG_MODEL, "/v1/models answered AND does not list R.model"),
        lambda f: f.obs.models is not None and f.rcfg.model not in f.obs.models,
        lambda f: f"/v1/models lists {', '.join(f.obs.models or ()) or 'nothing'}, expected {f.rcfg.model}",
    ),
    Row(
        API_QUIET := Rule(
            "L22",
            State.UNRESPONSIVE,
            "no probe got any HTTP answer for >= W.engine_quiet_s (counted from the last answer) AND no "
            "progress for >= W.engine_quiet_s AND the API server's processes (every process of the replica "
            "not named as its engine's; all of them where none is) quiet for >= W.engine_quiet_s: at each look "
            "CPU plus run-queue wait <= W.quiet_cpu of a core AND none running, runnable or in uninterruptible "
            "wait (a frozen server; a starved one waits on the run queue, a busy one computes)",
        ),
        lambda f: (
            f.failing_for_s >= f.wcfg.engine_quiet_s
            and f.quiet_for_s >= f.wcfg.engine_quiet_s
            and f.api_quiet_for_s >= f.wcfg.engine_quiet_s
        ),
        _api_quiet,
    ),
    Row(
        Rule(
            "L8",
            State.UNRESPONSIVE,
            "no probe got any HTTP answer for >= W.unresponsive_after_s (counted from the last "
            "answer) AND no progress for >= W.unresponsive_after_s",
        ),
        lambda f: f.failing_for_s >= f.wcfg.unresponsive_after_s and f.quiet_for_s >= f.wcfg.unresponsive_after_s,
        _no_answer,
    ),
    Row(
        Rule(
            "L9",
            State.UNRESPONSIVE,
            "/health answered 503 (vLLM: engine dead) for >= W.unresponsive_after_s AND no "
            "progress for >= W.unresponsive_after_s",
        ),
        lambda f: f.dead_503_for_s >= f.wcfg.unresponsive_after_s and f.quiet_for_s >= f.wcfg.unresponsive_after_s,
        lambda f: (
            f"/health 503 (engine dead) for {f.dead_503_for_s:.0f} s, "
            f"last progress {_ago(f.now, f.track.last_progress_at)}"
        ),
    ),
    Row(
        Rule(
            "L10",
            UNCHANGED,
            "no probe answered this tick AND one sent at an earlier tick is still running (each bounded by "
            "its timeout): no news, the verdict stands (L1-L9 still apply)",
        ),
        lambda f: f.obs.probes_pending_s is not None and f.track.observed,
        lambda f: f.track.evidence,
    ),
    Row(
        Rule(
            "L11",
            State.BUSY,
            "progress this tick (counters, or responses flowing to clients per the kernel) AND (/health failed "
            "OR took >= R.health_timeout_s)",
        ),
        lambda f: f.seen.progressed and not f.seen.health_in_time,
        _busy_progressing,
    ),
    Row(
        Rule(
            "L12",
            State.HEALTHY,
            "progress this tick (counters, or responses flowing to clients per the kernel) AND /health answered "
            "2xx in < R.health_timeout_s",
        ),
        lambda f: f.seen.progressed and f.seen.health_in_time,
        _healthy_progressing,
    ),
    Row(
        ENGINE_QUIET := Rule(
            "L19",
            State.STALLED,
            "/metrics readable AND running + waiting > 0 (the engine's own count) AND now - max(last progress, "
            "work first queued) >= W.engine_quiet_s AND the engine's processes (named: observe/procs.py) quiet "
            "for >= W.engine_quiet_s, as L22 measures it: work in the engine that its processes do not touch "
            "(an engine that burns CPU while nothing moves is left to L13 and L14)",
        ),
        lambda f: (
            f.obs.metrics is not None
            and f.obs.metrics.queued > 0
            and f.now - f.quiet_since >= f.wcfg.engine_quiet_s
            and f.engine_quiet_for_s >= f.wcfg.engine_quiet_s
        ),
        _engine_quiet,
    ),
    Row(
        Rule(
            "L20",
            State.STALLED,
            "queue judged AND queued work (as L13) AND a canary sent after the last progress (and after "
            "work was first queued) failed by C5 (its engine never touched it)",
        ),
        lambda f: f.work_queued and f.track.engine_proof_at is not None and f.track.engine_proof_at >= f.quiet_since,
        _engine_proof,
    ),
    Row(
        STALL_WINDOW := Rule(
            "L13",
            State.STALLED,
            "queue judged AND queued work (running + waiting > 0, or clients waiting >= W.client_wait_s) "
            "AND now - max(last progress, work first queued) >= max(W.stall_window_s, min(W.max_step_s, "
            "STEP_MARGIN x the replica's longest recent step))",
        ),
        lambda f: f.work_queued and f.now - f.quiet_since >= max(f.wcfg.stall_window_s, f.step_bound_s or 0.0),
        lambda f: (
            f"{f.work_said} and no counter progress for {f.now - f.quiet_since:.0f} s (/health {f.health_said})"
            f"{_gpus(f.obs)}"
        ),
    ),
    Row(
        STALL_CANARY := Rule(
            "L14",
            State.STALLED,
            "queue judged AND queued work (as L13) AND a canary sent after the last progress (and "
            "after work was first queued) failed with no progress while it ran (C4) AND now - max(last "
            "progress, work first queued) >= min(W.max_step_s, STEP_MARGIN x the replica's longest recent step) "
            "(W.stall_window_s while none is learned): a stall canary never ends a step shorter than the "
            "replica's own",
        ),
        _stall_proven,
        _stall_proof,
    ),
    Row(
        Rule(
            "L21",
            State.IDLE_DEAD,
            "queue judged AND no queued work AND the last canary failed by C5 (its engine never touched "
            "it) AND no progress since it was sent: one such canary is proof enough",
        ),
        lambda f: (
            f.seen.judged
            and f.seen.queued == 0
            and f.track.engine_proof_at is not None
            and (f.track.last_progress_at is None or f.track.last_progress_at <= f.track.engine_proof_at)
        ),
        _engine_proof,
    ),
    Row(
        Rule(
            "L15",
            State.IDLE_DEAD,
            "queue judged AND no queued work AND consecutive failed canaries >= W.canary_failures",
        ),
        lambda f: f.seen.judged and f.seen.queued == 0 and f.track.canary_failures >= f.wcfg.canary_failures,
        lambda f: f"idle, and {f.track.canary_failures} canary completions failed in a row (/health {f.health_said})",
    ),
    Row(
        Rule("L16", State.BUSY, "/health failed AND last progress < W.stall_window_s ago"),
        lambda f: not f.obs.health.ok and f.quiet_for_s < f.wcfg.stall_window_s,
        lambda f: f"/health {f.obs.health.error}, progress {_ago(f.now, f.track.last_progress_at)}",
    ),
    Row(
        Rule(
            "L17",
            State.DEGRADED,
            "some probe failed, or /metrics unreadable, or a canary failed (no grounds to restart yet)",
        ),
        lambda f: bool(f.problems),
        lambda f: "; ".join(f.problems),
    ),
    Row(
        Rule("L18", State.HEALTHY, "otherwise"),
        lambda f: True,
        lambda f: f.work_said if f.obs.metrics is not None else "answering",
    ),
)
RULES = tuple(row.rule for row in ROWS)
_NO_NEWS_RULE = next(rule.id for rule in RULES if rule.outcome == UNCHANGED)  # evidence of nothing
# A replica not observed yet is starting, as by the first rule that says so.
_NOT_OBSERVED_RULE = next(rule.id for rule in RULES if rule.outcome == State.STARTING)
# STALL_WINDOW and STALL_CANARY (in the rows above) are the two rules a learned step holds back.


@dataclass(frozen=True)
class Track:
    """What guardian remembers about one replica from tick to tick; STATE is its verdict."""

    state: State = State.STARTING
    rule: str = _NOT_OBSERVED_RULE  # the id of the rule behind the verdict
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
    canary_due_at: float | None = None  # when the canary in flight has failed unanswered (R.canary_timeout_s)
    canary_late_at: float | None = None  # when it is past its learned deadline (late, not failed: C2)
    closer_since: float | None = None  # a second canary sent while the first was late (a closer look)
    closer_due_at: float | None = None
    closer_for: float | None = None  # the send time of the canary a closer look was sent for (one each)
    slow_spell: bool = False  # the last canary was late (C2): the next late one is not said again
    slow_said: str | None = None  # this tick's C2 line, for the tick to say (None: nothing to say)
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
    served_at: float | None = None  # the last tick with evidence that it serves (see serves())
    said_state: State | None = None  # the verdict the journal last said (core/verdicts.py: a quiet journal)
    metrics_readable: bool = False  # /metrics was readable at its last answer (a probe in flight keeps it)
    steps: tuple[tuple[float, float], ...] = ()  # (a long step's bound in s, when learned): see longest_step_s
    # The replica's own processes (observe/procs.py): when each group's quiet spell began (None: not quiet)
    api_quiet_since: float | None = None
    engine_quiet_since: float | None = None
    health_in_time_since: float | None = None  # /health answered 2xx in time at every tick since then
    engine_proof_at: float | None = None  # the send time of a canary its engine never touched (C5)
    judged_canary: float | None = None  # the send time of the canary C5 judged while it was still out
    start_run: StartRun = field(default_factory=StartRun)  # its starts, how many in a row failed (startloop, A6)


def _progressed(prev: VllmSample | None, cur: VllmSample | None) -> bool:
    if prev is None or cur is None:
        return False
    if cur.kv_cache_usage != prev.kv_cache_usage:
        return True
    return any(c != p for c, p in zip(cur.progress_counters(), prev.progress_counters(), strict=False))


def _flowing(obs: ReplicaObservation) -> bool:
    """The kernel saw a response flowing to a client since its last look (ConnView). A partial view
    (more sockets than one look reads) is no evidence of it: whoever filled the dump with sockets of
    their own could otherwise keep a frozen replica "busy" (issue 34 row 11)."""
    return obs.conns is not None and not obs.conns.truncated and obs.conns.flowing > 0


def _progress_at(track: Track, obs: ReplicaObservation, now: float, seen_now: bool) -> float:
    """When the progress seen at this tick happened: now for counters and canaries; for a response
    flowing, when its last byte was sent (a frozen server's last bytes are acked after the freeze:
    counted at the look, they would stretch L8's window by up to a tick), counted from when the
    kernel was read (the tick judges after its probe wait)."""
    conns = obs.conns
    if seen_now or conns is None or conns.last_flow_s is None:
        return now
    at = min(now, conns.at if conns.at is not None else now)
    return max(at - conns.last_flow_s, track.last_progress_at if track.last_progress_at is not None else float("-inf"))


def _waits(track: Track, obs: ReplicaObservation, now: float, wcfg: WatchdogConfig) -> tuple[int, float]:
    """Client connections whose request has had no byte of answer for >= W.client_wait_s, and when
    the longest-waiting of them spoke. A client waiting since before the last successful canary
    (an upload stuck half-way: uvicorn has no timeout for it) proves nothing about the engine,
    and none counts from before guardian first saw the replica."""
    conns = obs.conns
    if conns is None or conns.waiting == 0:
        return 0, now
    at = min(now, conns.at if conns.at is not None else now)
    waits = conns.waits_s
    after = max(x for x in (track.last_canary_ok_at, track.first_seen_at, float("-inf")) if x is not None)
    counted = [w for w in waits if w >= wcfg.client_wait_s and at - w >= after]
    if not counted:
        return 0, now
    return len(counted), max(
        at - max(counted), track.first_seen_at if track.first_seen_at is not None else float("-inf")
    )


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


@dataclass(frozen=True)
class _CanaryBack:
    """A canary's result as the canary rows read it."""

    canary: CanaryResult
    late_after_s: float | None  # its learned deadline when it was sent (None: not marked)
    life: bool  # a sign of life while it ran: progress since it was sent, this tick's included

    @property
    def late(self) -> bool:
        return self.late_after_s is not None and self.canary.latency_s > self.late_after_s


def _slow(back: _CanaryBack) -> str:
    assert back.late_after_s is not None, "said only of a canary marked late"
    return (
        f"a canary answered in {back.canary.latency_s:.1f} s, past its learned deadline of "
        f"{back.late_after_s:.1f} s: alive and slow, and the deadline follows"
    )


# What a canary's result means (issue 35 items 1 and 2): one table for idle-dead (L15) and the stall's
# proof (L14) alike. First match wins.
CANARY_ROWS: tuple[Row[_CanaryBack, str], ...] = (
    Row(
        Rule("C1", "alive", "the canary answered within its learned deadline (canary_deadline())"),
        lambda b: b.canary.ok and not b.late,
        lambda b: f"a canary answered in {b.canary.latency_s:.1f} s",
    ),
    Row(
        CANARY_LATE := Rule(
            "C2",
            "alive, slow",
            "the canary answered after its learned deadline, within R.canary_timeout_s (the bound it is sent "
            "with): a late answer is an answer; its latency is learned as any other, so the deadline follows "
            "the box's load; said at info once per spell of late canaries; never a failure",
        ),
        lambda b: b.canary.ok,
        _slow,
    ),
    Row(
        Rule(
            "C3",
            "no failure",
            "the canary failed (no answer within R.canary_timeout_s, or an error) AND a sign of life came while "
            "it ran: a counter or the kv cache moved, or a response the replica's process wrote flowed to a "
            "client (the tick that brings the result included)",
        ),
        lambda b: b.life,
        lambda b: f"a canary failed ({b.canary.error}) while the replica was working",
    ),
    Row(
        Rule(
            "C4",
            "failed",
            "otherwise: the canary failed with no sign of life while it ran: it counts toward idle-dead (L15: "
            "W.canary_failures in a row) and, with work queued, is a stall's proof (L14)",
        ),
        lambda b: True,
        lambda b: f"a canary failed ({b.canary.error}) with nothing moving",
    ),
)


@dataclass(frozen=True)
class _CanaryOut:
    """The canary still in flight at a tick with no result for it, as C5 reads it."""

    track: Track
    view: ProcView
    sent: float
    wcfg: WatchdogConfig


def _untouched(o: _CanaryOut) -> bool:
    t = o.track
    return (
        t.engine_quiet_since is not None
        and t.engine_quiet_since <= o.sent
        and o.view.at - o.sent >= o.wcfg.engine_quiet_s
        and (t.last_progress_at is None or t.last_progress_at <= o.sent)
        and t.health_in_time_since is not None
        and t.health_in_time_since <= o.sent
    )


# A canary still out (issue 43): its engine's processes say at once what its bound would say 15 s later.
CANARY_OUT_ROWS: tuple[Row[_CanaryOut, str], ...] = (
    Row(
        CANARY_UNTOUCHED := Rule(
            "C5",
            "failed",
            "the canary has been out for >= W.engine_quiet_s with no progress since it was sent, the engine's "
            "processes (named: observe/procs.py) quiet from before it was sent until now (as L22 measures it), "
            "AND /health answered 2xx in < R.health_timeout_s at every tick from its send on (the API server was "
            "not starved: it handed the canary on): it fails now, not at R.canary_timeout_s; its late answer, if "
            "one comes, is progress, its failure is not counted again",
        ),
        _untouched,
        lambda o: (
            f"a canary out for {o.view.at - o.sent:.1f} s was never touched: "
            f"{_used(o.view, 'engine', o.view.at - o.sent)}"
        ),
    ),
)
CANARY_RULES = (*(row.rule for row in CANARY_ROWS), *(row.rule for row in CANARY_OUT_ROWS))
_SLOW_CANARY, _FAILED_CANARY = CANARY_RULES[1].id, CANARY_RULES[3].id

# A replica's longest recent step (issue 35 item 8): a long prompt's prefill is one step in which
# nothing moves (measured on a real vLLM 0.32 with default scheduler settings: 67-69 s for a
# 7k-token prompt). It is learned from vllm:request_prefill_time_seconds (the bucket bound that
# covers every prefill that ended since the last look) and kept: the STEPS_KEPT longest within
# STEP_MEMORY_S, in the state file too, so a guardian restart learns nothing anew. A stall canary
# (L14) and the stall window (L13) never end a replica's work sooner than STEP_MARGIN x it.
STEPS_KEPT = 8
STEP_MEMORY_S = 24 * 3600.0
STEP_MARGIN = 1.5


def longest_new_prefill(prev: VllmSample | None, cur: VllmSample | None) -> float | None:
    """An upper bound of the longest prefill that ended between PREV and CUR: the smallest bucket
    bound whose count rose as much as the whole histogram's (the largest finite bound if only +Inf
    did); None when none ended, or the counts went down (a new engine)."""
    if prev is None or cur is None or not cur.prefill_buckets or not prev.prefill_buckets:
        return None
    before = dict(prev.prefill_buckets)
    rises = [(bound, count - before.get(bound, 0.0)) for bound, count in cur.prefill_buckets]
    total = rises[-1][1]
    if total <= 0 or any(rise < 0 for _, rise in rises):
        return None
    finite = [bound for bound, _ in rises if bound != float("inf")]
    for bound, rise in rises:
        if rise >= total:
            return bound if bound != float("inf") else (max(finite) if finite else None)
    return None


def learn_step(track: Track, step_s: float | None, now: float, cap_s: float) -> Track:
    """TRACK with STEP_S learned at NOW: the STEPS_KEPT longest of the last STEP_MEMORY_S. A step
    that is not a number in (0, CAP_S] (W.max_step_s) is dropped: a page that says 1e300 s (or a
    bucket bound past what guardian would wait anyway) teaches nothing."""
    recent = [s for s in track.steps if now - s[1] < STEP_MEMORY_S]
    if step_s is not None and _in_range(step_s, cap_s):
        recent.append((step_s, now))
    kept = tuple(sorted(recent, key=lambda s: (-s[0], -s[1]))[:STEPS_KEPT])
    return track if kept == track.steps else replace(track, steps=kept)


def kept_steps(steps: Iterable[tuple[float, float]], cap_s: float) -> tuple[tuple[float, float], ...]:
    """Steps read back from the state file, as learn_step keeps them: each in (0, CAP_S], others dropped."""
    ok = [(s, at) for s, at in steps if _in_range(s, cap_s) and math.isfinite(at)]
    return tuple(sorted(ok, key=lambda s: (-s[0], -s[1]))[:STEPS_KEPT])


def _in_range(step_s: float, cap_s: float) -> bool:
    return math.isfinite(step_s) and 0 < step_s <= cap_s


def longest_step_s(track: Track, now: float, cap_s: float) -> float | None:
    """STEP_MARGIN x the longest step learned in the last STEP_MEMORY_S, at most CAP_S (W.max_step_s),
    or None: none learned."""
    recent = [bound for bound, at in track.steps if now - at < STEP_MEMORY_S]
    return min(cap_s, STEP_MARGIN * max(recent)) if recent else None


CANARY_LATENCIES_KEPT = 8
CANARY_LATENCIES_NEEDED = 3
LEARNING_CANARIES = 3  # canaries sent at once, one a tick, to a replica with nothing learned


def canary_deadline(track: Track, rcfg: ReplicaConfig, wcfg: WatchdogConfig) -> float:
    """A canary's deadline, from this replica's own canaries while it was healthy."""
    if len(track.canary_latencies) < CANARY_LATENCIES_NEEDED:
        return rcfg.canary_timeout_s
    learned = wcfg.canary_deadline_factor * max(track.canary_latencies)
    return min(rcfg.canary_timeout_s, max(wcfg.canary_deadline_floor_s, learned))


# A canary's result is taken at the tick after its deadline; its task ends a little after it.
CANARY_JUDGE_MARGIN_S = 0.25
CANARY_LOST_AFTER_S = 30.0  # past its deadline with no result: forgotten, as if never sent


def next_deadline(track: Track, wcfg: WatchdogConfig, after: float | None = None) -> float | None:
    """The next moment at which T's verdict may change with no news, or None: its unresponsive
    window ends (L8, L9) if no answer and no progress comes before it; the canary in flight has
    failed (its deadline); a stall canary falls due (queued work, nothing moving for
    W.stall_canary_after_s). The daemon judges at that moment instead of at the next tick mark:
    a frozen server is then found U seconds after its last answer, and a frozen engine with work
    queued as soon as its canary's deadline passes, not up to a tick later. AFTER: only moments
    after it (the daemon's now)."""
    if track.state not in (State.HEALTHY, State.BUSY, State.DEGRADED):
        return None
    quiet_from = track.last_progress_at if track.last_progress_at is not None else float("-inf")
    ends = [
        max(since, quiet_from) + wcfg.unresponsive_after_s
        for since in (track.failing_since, track.dead_503_since)
        if since is not None
    ]
    if track.canary_due_at is not None:
        ends.append(track.canary_due_at + CANARY_JUDGE_MARGIN_S)
        if _closer_look_possible(track) and track.canary_late_at is not None:
            ends.append(track.canary_late_at)  # a closer look may be due then (_closer_look_due)
        if track.closer_due_at is not None:
            ends.append(track.closer_due_at + CANARY_JUDGE_MARGIN_S)
    elif track.work_since is not None:
        quiet_ref = max(x for x in (track.last_progress_at, track.work_since) if x is not None)
        if track.last_canary_at is None or track.last_canary_at < quiet_ref:
            ends.append(quiet_ref + wcfg.stall_canary_after_s)
    ahead = [at for at in ends if after is None or at > after]  # one already past hides none to come
    return min(ahead) if ahead else None


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
        said_state=track.said_state,
        steps=track.steps,  # the same model on the same box: its steps are still as long
    )


def step(
    track: Track,
    obs: ReplicaObservation,
    now: float,
    rcfg: ReplicaConfig,
    wcfg: WatchdogConfig,
    pause: Pause | None = None,
) -> tuple[Track, float | None]:
    """Fold one observation into the track. Returns (new track, the deadline of a canary to start, or None)."""
    track = replace(_carry_over(track, obs, now), slow_said=None)
    if port_taken_by(obs.port_owner, rcfg) is not None:
        track, obs = _not_its_answers(track, obs)
    track, seen = _fold(track, obs, now, rcfg, wcfg)
    facts = _Facts(track, obs, now, rcfg, wcfg, pause, seen)
    state, rule, evidence = _classify(facts)
    track, want_canary = _schedule_canary(facts, state)
    if state != track.state:
        track = replace(track, state=state, state_since=now)
    if rule != _NO_NEWS_RULE and _serving_now(state, seen, obs, rcfg):
        track = replace(track, served_at=now)
    return replace(track, rule=rule, evidence=evidence, observed=True), want_canary


# "Another replica serves" (issue 35 item 3), the one definition for every rule that asks it: the
# drain (D1-D5), the memory guard's peers (M14, the raise), the fleet's counts. A replica serves
# when, at its last tick with evidence, it was healthy or busy, or degraded only by a probe that
# was late or unreadable while /health answered 200 or its work progressed, or paused (not judged)
# while its /health answered 200 with its model listed; and that tick was
# at most SERVED_RECENTLY_S ago (a /health 200 counts however late it came: a late answer is an
# answer), with nothing since that says it stopped (a verdict other than
# healthy, busy or degraded, a restart in flight, a /health 503, a failed canary). A /metrics
# answer late by a second on a loaded box is not the end of serving.
SERVED_RECENTLY_S = 10.0
_MAY_SERVE = frozenset({State.HEALTHY, State.BUSY, State.DEGRADED, State.PAUSED})


def _serving_now(state: State, seen: _Seen, obs: ReplicaObservation, rcfg: ReplicaConfig) -> bool:
    if state in SERVING_STATES:
        return True
    if state is State.PAUSED:  # not judged, but it may well serve: by its own answers
        return obs.health.ok and (obs.models is None or rcfg.model in obs.models)
    # (a 503 or a failed canary since is serves()'s to weigh, at the moment it is asked)
    return state is State.DEGRADED and (obs.health.ok or seen.progressed)


def serves(track: Track, now: float) -> bool:
    """TRACK's replica serves now, by the definition above."""
    return (
        track.state in _MAY_SERVE
        and not track.restart_in_flight
        and track.dead_503_since is None
        and track.canary_failures == 0
        and track.served_at is not None
        and now - track.served_at <= SERVED_RECENTLY_S
    )


def _classify(facts: _Facts) -> tuple[State, str, str]:
    """The first row that holds: (the verdict, its rule's id, the evidence)."""
    found = first_match(ROWS, facts)
    assert found is not None, "the last row always holds"
    rule, evidence = found
    state = facts.track.state if rule.outcome == UNCHANGED else State(rule.outcome)
    return state, rule.id, evidence


def _carry_over(track: Track, obs: ReplicaObservation, now: float) -> Track:
    """What outlives this observation: a new start of the unit forgets, a restart's outcome ends it,
    a canary whose result never came is given up."""
    unit = obs.unit
    if unit is not None and unit.inactive_exit_mono != track.start_ts:
        track = _fresh_start(track, unit.inactive_exit_mono)
    if obs.restart_outcome is not None:
        track = replace(track, restart_in_flight=False)
    if obs.canary is None and track.canary_due_at is not None and now > track.canary_due_at + CANARY_LOST_AFTER_S:
        # its result never came (the executor lost it): no canary would ever be sent again
        track = _no_canary_in_flight(track)
    if track.first_seen_at is None:
        track = replace(track, first_seen_at=now)
    return track


def _fold(
    track: Track, obs: ReplicaObservation, now: float, rcfg: ReplicaConfig, wcfg: WatchdogConfig
) -> tuple[Track, _Seen]:
    """The bookkeeping that every rule may read: progress, queued work, traffic, the canary that
    came back, answers and 503s."""
    track = _fold_procs(track, obs.procs, wcfg.quiet_cpu)
    sample = obs.metrics
    counters_moved = _progressed(track.last_sample, sample)  # a counter that went down (new engine) counts too
    track = learn_step(track, longest_new_prefill(track.last_sample, sample), now, wcfg.max_step_s)
    waiting_clients, waiting_since = _waits(track, obs, now, wcfg)
    queued = _queued(sample, waiting_clients)
    health_in_time = obs.health.ok and obs.health.latency_s < rcfg.health_timeout_s
    judged = queue_judged(obs, health_in_time)
    ours = track.canary_in_flight_since is not None or obs.canary is not None  # a canary's token is not traffic
    if judged and (
        (not ours and (counters_moved or queued > 0))
        or (ours and sample is not None and _beyond_a_canary(track.last_sample, sample))
        or (ours and sample is None and waiting_clients > 0)
    ):
        track = replace(track, last_traffic_at=now)
    track, canary_ok, canary_failed = _fold_canary(
        track, obs, queued if judged else 0.0, counters_moved or _flowing(obs)
    )
    progressed = counters_moved or canary_ok or _flowing(obs)
    if progressed:
        track = replace(track, last_progress_at=_progress_at(track, obs, now, counters_moved or canary_ok))
    if not obs.metrics_probe.pending:
        track = replace(track, metrics_readable=sample is not None)
    if judged:
        if queued > 0 and track.work_since is None:
            # clients waiting were queued from the moment the longest-waiting one spoke
            track = replace(track, work_since=waiting_since if waiting_clients else now)
        elif queued == 0:
            track = replace(track, work_since=None)
    if sample is not None:
        track = replace(track, last_sample=sample)
    if obs.all_probes_failed or obs.probes_pending_s is not None:
        # Counted from the last answer, not from the first failed tick: a hung probe takes its
        # whole timeout, and counting from its end would add that timeout to every detection.
        since = track.failing_since if track.failing_since is not None else track.last_answer_at
        track = replace(track, failing_since=since if since is not None else now)
    else:
        track = replace(track, failing_since=None, last_answer_at=now)
    if obs.health.status == 503:
        track = replace(track, dead_503_since=track.dead_503_since if track.dead_503_since is not None else now)
    else:
        track = replace(track, dead_503_since=None)
    if health_in_time and not track.healthy_since_start:
        track = replace(track, healthy_since_start=True)
    in_time_since = (
        (track.health_in_time_since if track.health_in_time_since is not None else now) if health_in_time else None
    )
    track = replace(track, health_in_time_since=in_time_since)
    if obs.canary is None:
        track, untouched = _judge_canary_out(track, obs, queued if judged else 0.0, wcfg)
        canary_failed = canary_failed or untouched
    seen = _Seen(
        counters_moved, progressed, waiting_clients, waiting_since, queued, health_in_time, canary_failed, judged
    )
    return track, seen


def _quiet_from(since: float | None, act: Activity | None, view: ProcView, quiet_cpu: float) -> float | None:
    """When a group's quiet spell began, as of VIEW; None: it was not quiet at this look, or it is not known."""
    if act is None or view.since_s is None or view.since_s <= 0:
        return None
    if act.running or act.used_s > quiet_cpu * view.since_s:
        return None
    return since if since is not None else view.at - view.since_s


def _fold_procs(track: Track, view: ProcView | None, quiet_cpu: float) -> Track:
    """TRACK with this look at the replica's processes folded in: a look that could not be had ends both spells."""
    if view is None:
        api, engine = None, None
    else:
        api = _quiet_from(track.api_quiet_since, view.api, view, quiet_cpu)
        engine = _quiet_from(track.engine_quiet_since, view.engine, view, quiet_cpu)
    if (api, engine) == (track.api_quiet_since, track.engine_quiet_since):
        return track
    return replace(track, api_quiet_since=api, engine_quiet_since=engine)


def _judge_canary_out(track: Track, obs: ReplicaObservation, queued: float, wcfg: WatchdogConfig) -> tuple[Track, bool]:
    """The canary in flight judged before its result comes (C5): (track, it failed now)."""
    sent, view = track.canary_in_flight_since, obs.procs
    if sent is None or view is None:
        return track, False
    found = first_match(CANARY_OUT_ROWS, _CanaryOut(track, view, sent, wcfg))
    if found is None:
        return track, False
    track = _canary_back(track, False, view.at)
    track = replace(
        track,
        canary_failures=track.canary_failures + 1,
        engine_proof_at=sent,
        judged_canary=sent,
        stall_proof_at=sent if queued > 0 else track.stall_proof_at,
    )
    return track, True


def _canary_back(track: Track, closer: bool, ended_at: float) -> Track:
    """TRACK with the canary that came back out of flight: the closer look's own slot, or the first's,
    the closer look (if one runs) taking its place."""
    if closer:
        return replace(track, closer_since=None, closer_due_at=None, last_canary_at=ended_at)
    return replace(
        track,
        canary_in_flight_since=track.closer_since,
        canary_due_at=track.closer_due_at,
        canary_late_at=None,
        closer_since=None,
        closer_due_at=None,
        last_canary_at=ended_at,
    )


def _fold_canary(track: Track, obs: ReplicaObservation, queued: float, moving_now: bool) -> tuple[Track, bool, bool]:
    """The canary that came back this tick, if any: (track, it answered, it failed and counts)."""
    canary = obs.canary
    if canary is None or (track.start_ts is not None and canary.started_at < track.start_ts):
        return track, False, False  # none, or one sent to the engine before this start: not this one's
    if canary.started_at == track.judged_canary:  # judged by C5 while out: an answer is still progress
        if not canary.ok:
            return track, False, False
        return replace(track, canary_failures=0, engine_proof_at=None, judged_canary=None), True, False
    closer = track.closer_since is not None and canary.started_at == track.closer_since
    late_at = None if closer else track.canary_late_at
    late_after_s = late_at - canary.started_at if late_at is not None else None
    life = moving_now or (track.last_progress_at is not None and track.last_progress_at > canary.started_at)
    back = _CanaryBack(canary, late_after_s, life)
    found = first_match(CANARY_ROWS, back)
    assert found is not None, "the last canary row always holds"
    rule, said = found
    track = _canary_back(track, closer, canary.started_at + canary.latency_s)
    if canary.ok:
        kept = (*track.canary_latencies, canary.latency_s)[-CANARY_LATENCIES_KEPT:]
        slow = rule.id == _SLOW_CANARY
        track = replace(
            track,
            canary_failures=0,
            engine_proof_at=None,
            canary_latencies=kept,
            last_canary_ok_at=canary.started_at,
            slow_spell=slow,
            slow_said=f"{said} ({rule.id})" if slow and not track.slow_spell else None,
        )
        return track, True, False
    if rule.id != _FAILED_CANARY:
        return track, False, False  # something moved while it ran: the engine was working
    track = replace(track, canary_failures=track.canary_failures + 1)
    if queued > 0:
        track = replace(track, stall_proof_at=canary.started_at)
    return track, False, True


def _schedule_canary(facts: _Facts, state: State) -> tuple[Track, float | None]:
    """A canary to send now, and its deadline (the module docstring's canary rules), or None."""
    track, obs = facts.track, facts.obs
    if state not in (State.HEALTHY, State.DEGRADED, State.BUSY) or not _may_send_canary(track, obs):
        return track, None
    if _closer_look_due(facts):
        timeout_s = facts.rcfg.canary_timeout_s
        track = replace(
            track, closer_since=facts.now, closer_due_at=facts.now + timeout_s, closer_for=track.canary_in_flight_since
        )
        return track, timeout_s
    if track.canary_in_flight_since is not None:
        return track, None
    # Under load too: a replica that is never idle must still learn its deadline (its canaries
    # then wait their turn, and the learned deadline is the longer for it).
    learning = (
        state in (State.HEALTHY, State.DEGRADED)
        and len(track.canary_latencies) < CANARY_LATENCIES_NEEDED
        and track.learning_canaries < LEARNING_CANARIES
    )
    if learning:
        track = replace(track, learning_canaries=track.learning_canaries + 1)
    elif not _canary_due(facts):
        return track, None
    # It is sent with the hard bound, R.canary_timeout_s: a late answer is an answer (C2). The learned
    # deadline marks it late, no more.
    late_s = canary_deadline(track, facts.rcfg, facts.wcfg)
    timeout_s = facts.rcfg.canary_timeout_s
    track = replace(
        track, canary_in_flight_since=facts.now, canary_due_at=facts.now + timeout_s, canary_late_at=facts.now + late_s
    )
    return track, timeout_s


def _may_send_canary(track: Track, obs: ReplicaObservation) -> bool:
    """/metrics readable (this tick, or at the last look while this tick's is still in flight) and
    /health answered or still in flight: on a starved box (every answer 1-8 s late) a tick with
    both answered at once is rare, and no canary would go out (issue 35)."""
    metrics = obs.metrics is not None or (obs.metrics_probe.pending and track.metrics_readable)
    # No page to read, or one the engine's loop left unanswered while the API server answers: the
    # canary is then the engine's only probe, and the API server takes it.
    unread_by_design = not obs.metrics_offered or (obs.metrics_via_engine and obs.health.ok)
    return (metrics or unread_by_design) and (obs.health.answered or obs.health.pending)


def _closer_look_possible(track: Track) -> bool:
    """No closer look has been sent for the canary in flight, and nothing since its send says the
    replica works (idle, no progress): one is due at its late mark."""
    sent = track.canary_in_flight_since
    return (
        sent is not None
        and track.closer_since is None
        and track.closer_for != sent
        and track.work_since is None
        and (track.last_progress_at is None or track.last_progress_at <= sent)
    )


def _closer_look_due(facts: _Facts) -> bool:
    """A closer look (issue 35 item 7): an idle replica's canary past its learned deadline, with no
    sign of life since it was sent, gets a second canary at once. Each fails only at
    R.canary_timeout_s (C4), so W.canary_failures (2) in a row come within the late mark +
    R.canary_timeout_s of the first's send, not twice R.canary_timeout_s plus a retry."""
    track = facts.track
    late_at = track.canary_late_at
    return _closer_look_possible(track) and late_at is not None and facts.now >= late_at and facts.seen.queued == 0


def _canary_due(facts: _Facts) -> bool:
    """A canary is due by time: idle after traffic, idle for a while, or work queued and nothing moving."""
    track, now, wcfg = facts.track, facts.now, facts.wcfg
    if facts.seen.queued == 0:
        if track.canary_failures:
            return now - max(at for at in (track.last_canary_at, 0.0) if at is not None) >= wcfg.canary_retry_s
        last_traffic_at = track.last_traffic_at
        if last_traffic_at is not None and (track.last_canary_at is None or track.last_canary_at < last_traffic_at):
            return now - last_traffic_at >= wcfg.canary_after_traffic_s
        last = max(at for at in (track.last_progress_at, track.last_canary_at, track.start_ts, 0.0) if at is not None)
        return now - last >= wcfg.canary_interval_s
    quiet_since = facts.quiet_since
    after_s = wcfg.stall_canary_after_s
    if facts.engine_quiet_for_s >= wcfg.engine_quiet_s:
        after_s = min(after_s, wcfg.engine_quiet_s)  # an engine that touches nothing: ask it now (C5 then judges)
    if now - quiet_since < after_s:
        return False
    asked = track.last_canary_at is not None and track.last_canary_at >= quiet_since
    return not asked or now - (track.last_canary_at or 0.0) >= wcfg.canary_retry_s


def _kernel_quiet(obs: ReplicaObservation) -> str:
    conns = obs.conns
    if conns is None or conns.since_s is None:
        return ""
    if conns.truncated:  # a partial view is evidence of nothing, flowing or not (issue 41 item 3)
        return "; kernel: its view was partial (more of its sockets than one look reads), no evidence either way"
    cpu = f", its unit used {1000 * conns.cpu_s:.0f} ms of CPU" if conns.cpu_s is not None else ""
    return f"; kernel: nothing flowed to {conns.connections} connection(s) in {conns.since_s:.1f} s{cpu}"


def _flow(obs: ReplicaObservation) -> str:
    conns = obs.conns
    if conns is None:
        return "no kernel view"
    over = f" in {conns.since_s:.1f} s" if conns.since_s is not None else ""
    return f"responses flowing to {conns.flowing} client connection(s), {conns.bytes_out} bytes{over} (kernel)"
