"""The canary: when guardian sends one (its schedule, a closer look), the deadline it learns
for it, and what its result means (CANARY_ROWS, C1-C4; CANARY_OUT_ROWS, C5: one still out), folded
into the track. ``W`` = watchdog config, ``R`` = replica config, times in seconds. Pure.

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
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...config import ReplicaConfig, WatchdogConfig
from ..observations import CanaryResult, ProcView, ReplicaObservation
from ..rules import Row, Rule, first_match
from ..vocab import State
from .facts import Facts, used
from .track import Track


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
            f"{used(o.view, 'engine', o.view.at - o.sent)}"
        ),
    ),
)
CANARY_RULES = (*(row.rule for row in CANARY_ROWS), *(row.rule for row in CANARY_OUT_ROWS))
_SLOW_CANARY, _FAILED_CANARY = CANARY_RULES[1].id, CANARY_RULES[3].id


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


def schedule_canary(facts: Facts, state: State) -> tuple[Track, float | None]:
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


def _closer_look_due(facts: Facts) -> bool:
    """A closer look (issue 35 item 7): an idle replica's canary past its learned deadline, with no
    sign of life since it was sent, gets a second canary at once. Each fails only at
    R.canary_timeout_s (C4), so W.canary_failures (2) in a row come within the late mark +
    R.canary_timeout_s of the first's send, not twice R.canary_timeout_s plus a retry."""
    track = facts.track
    late_at = track.canary_late_at
    return _closer_look_possible(track) and late_at is not None and facts.now >= late_at and facts.seen.queued == 0


def _canary_due(facts: Facts) -> bool:
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


def judge_canary_out(track: Track, obs: ReplicaObservation, queued: float, wcfg: WatchdogConfig) -> tuple[Track, bool]:
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


def fold_canary(track: Track, obs: ReplicaObservation, queued: float, moving_now: bool) -> tuple[Track, bool, bool]:
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
