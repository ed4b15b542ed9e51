"""A start loop (core/startloop.py, admission A6): a replica's starts that fail one after another
while its memory did not come back (U8). The count as the ticks fold it; the tick that says it once
at critical and refuses every restart guardian would cause of it; its end said at info."""

from __future__ import annotations

from dataclasses import replace

import pytest

from guardian.core import admission, startloop, tick
from guardian.core.observations import PersistentView, RestartRequest, TickObservation
from guardian.core.startloop import StartRun, fold
from guardian.core.vocab import Decision, Gate, Priority
from harness import OK, TIMEOUT, GiB, answers, cfg, check_rule_ids, obs, restarts, said, unit

LEFT = 2 * GiB  # what U8 found not returned


def u(invocation: str, state: str = "active", sub: str = "running", n_restarts: int = 0):
    return unit(invocation_id=invocation, active_state=state, sub_state=sub, n_restarts=n_restarts)


def run_through(*looks, left: int | None = LEFT) -> StartRun:
    """The StartRun after LOOKS, each (unit, serving)."""
    run = StartRun()
    for seen, serving in looks:
        run = fold(run, seen, serving, left)
    return run


def test_what_came_before_guardians_first_look_is_not_counted():
    assert run_through((u("i1", "failed", "failed"), False)).failed == 0
    assert run_through((u("i1", "activating", "auto-restart", n_restarts=30), False)).failed == 0


def test_each_start_that_ends_without_serving_counts_once_through_its_restart_wait():
    looks = [
        (u("i1", "activating", "start"), False),  # loading
        (u("i1", "activating", "auto-restart"), False),  # it failed: Restart= waits RestartSec
        (u("i1", "activating", "auto-restart"), False),  # the same failure, seen again
        (u("i2", "activating", "start", 1), False),  # Restart= started it again
        (u("i2", "failed", "failed", 1), False),  # failed for good (StartLimitBurst)
    ]
    assert [run_through(*looks[: n + 1]).failed for n in range(len(looks))] == [0, 1, 1, 1, 2]


def test_a_loop_faster_than_the_ticks_is_counted_whole_by_nrestarts():
    assert run_through((u("i1", "activating", "start"), False), (u("i9", "activating", "start", 3), False)).failed == 3
    # a new invocation seen once its predecessor was counted: only those between
    looks = [(u("i1", "activating", "start"), False), (u("i1", "activating", "auto-restart"), False),
             (u("i5", "activating", "start", 4), False)]
    assert run_through(*looks).failed == 4


def test_a_start_that_serves_sets_the_count_back_and_its_own_end_is_no_failure():
    failing = [(u("i1", "activating", "start"), False), (u("i4", "activating", "start", 3), False)]
    assert run_through(*failing).failed == 3
    assert run_through(*failing, (u("i4"), True)).failed == 0
    # it served, then died: Restart= starts it again; that one exit is no failed start
    assert run_through((u("i1"), True), (u("i2", "activating", "start", 1), False)).failed == 0
    # an operator's restart of a serving replica (no NRestarts), its start failing for good
    assert run_through((u("i1"), True), (u("i2", "activating", "start"), False),
                       (u("i2", "failed", "failed"), False)).failed == 1


def test_a_loop_needs_the_memory_not_returned_u8():
    looks = [(u("i1", "activating", "start"), False), (u("i4", "activating", "start", 3), False)]
    assert run_through(*looks).looping
    assert not run_through(*looks, left=None).looping
    assert not run_through((u("i1", "activating", "start"), False), (u("i3", "activating", "start", 2), False)).looping
    assert fold(run_through(*looks), None, False, LEFT).looping  # systemd not asked: nothing changes


# --- as the tick applies it ------------------------------------------------------------------------


class Loop:
    """One replica, a, whose unit's starts fail; U8's finding for it as the daemon carries it."""

    def __init__(self) -> None:
        self.cfg = cfg(1)
        self.state = tick.TickState()
        self.persistent = PersistentView()
        self.actions: list = []

    def tick(self, t: float, seen, left: int | None = LEFT) -> list:
        observed = TickObservation({"a": replace(seen, at=t)}, self.persistent, not_returned={"a": left} if left else {})
        self.state, acts = tick.decide(self.state, observed, t, self.cfg)
        check_rule_ids(acts)
        self.actions += acts
        return acts


def failing(t: float, invocation: str, n: int):
    return obs("a", t, health=TIMEOUT, u=u(invocation, "activating", "start", n))


def test_a_start_loop_is_said_once_at_critical_and_refuses_every_restart_guardian_would_cause_a6():
    box = Loop()
    box.tick(0, failing(0, "i0", 0))
    for n in range(1, 4):
        box.tick(10 * n, failing(10 * n, f"i{n}", n))
    critical = [a for a in said(box.actions) if a.priority is Priority.CRITICAL]
    (line,) = critical
    assert line.rule == admission.START_LOOP.id and line.decision is Decision.HAZARD and line.hazard == "start-loop:a"
    assert "3 starts of vllm-a.service in a row ended without serving while 2.0 GiB" in line.message
    assert "Restart=always in vllm-a.service is the loop that remains" in line.message
    # an operator's restart is refused (A6), said at error, answered at once
    box.persistent = replace(box.persistent, requests=(RestartRequest("q1", "a", 40.0),))
    acts = box.tick(40, failing(40, "i3", 3))
    assert not restarts(acts)
    (answer,) = answers(acts)
    assert not answer.ok and "start-loop" in answer.message and "(A6)" not in answer.message
    refused = [a for a in said(acts) if a.decision is Decision.REFUSED]
    assert [(a.rule, a.gate, a.priority) for a in refused] == [(admission.START_LOOP.id, Gate.START_LOOP, Priority.ERROR)]
    assert "guardian causes no start of it" in refused[0].message
    box.persistent = PersistentView()
    # more failed starts: not said again
    box.tick(50, failing(50, "i4", 4))
    assert len([a for a in said(box.actions) if a.priority is Priority.CRITICAL]) == 1
    # it serves: the loop is over, said at info
    acts = box.tick(60, obs("a", 60, health=OK, u=u("i5", n_restarts=5)))
    (over,) = [a for a in said(acts) if a.rule == admission.START_LOOP.id]
    assert over.priority is Priority.INFO and "its start loop is over (it served again)" in over.message


def test_the_loop_ends_when_the_memory_comes_back_a6():
    box = Loop()
    box.tick(0, failing(0, "i0", 0))
    for n in range(1, 4):
        box.tick(10 * n, failing(10 * n, f"i{n}", n))
    assert box.state.tracks["a"].start_run.looping
    acts = box.tick(40, failing(40, "i4", 4), left=None)
    (over,) = [a for a in said(acts) if a.rule == admission.START_LOOP.id]
    assert "the memory its processes held came back" in over.message
    assert not box.state.tracks["a"].start_run.looping


@pytest.mark.parametrize("restart", ["on-failure", ""])
def test_the_line_names_the_units_own_restart_setting(restart):
    box = Loop()
    for n in range(0, 4):
        seen = failing(10 * n, f"i{n}", n)
        box.tick(10 * n, replace(seen, unit=replace(seen.unit, restart=restart)))
    (line,) = [a for a in said(box.actions) if a.priority is Priority.CRITICAL]
    want = "Restart=on-failure in vllm-a.service is the loop that remains" if restart else "has Restart=no"
    assert want in line.message
