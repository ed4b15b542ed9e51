"""What guardian remembers about one replica from tick to tick (`Track`; its state is the verdict),
and what a new start of its unit leaves of it. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..observations import VllmSample
from ..startloop import StartRun
from ..vocab import State
from .liveness import NOT_OBSERVED_RULE


@dataclass(frozen=True)
class Track:
    """What guardian remembers about one replica from tick to tick; STATE is its verdict."""

    state: State = State.STARTING
    rule: str = NOT_OBSERVED_RULE  # the id of the rule behind the verdict
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
    said_state: State | None = None  # the verdict the journal last said (verdicts.py: a quiet journal)
    metrics_readable: bool = False  # /metrics was readable at its last answer (a probe in flight keeps it)
    steps: tuple[tuple[float, float], ...] = ()  # (a long step's bound in s, when learned): see longest_step_s
    # The replica's own processes (observe/procs.py): when each group's quiet spell began (None: not quiet)
    api_quiet_since: float | None = None
    engine_quiet_since: float | None = None
    health_in_time_since: float | None = None  # /health answered 2xx in time at every tick since then
    engine_proof_at: float | None = None  # the send time of a canary its engine never touched (C5)
    judged_canary: float | None = None  # the send time of the canary C5 judged while it was still out
    start_run: StartRun = field(default_factory=StartRun)  # its starts, how many in a row failed (startloop, A6)


def fresh_start(track: Track, start_ts: float | None) -> Track:
    """What a new start of the unit (at START_TS) leaves of TRACK: its verdict, the restart bookkeeping
    and what it learned (canary latencies, steps); the rest is forgotten."""
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
