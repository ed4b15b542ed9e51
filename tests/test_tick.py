"""The tick's one decide() call, where the watchdog, operators' requests and the memory guard
meet: table rows before, at and after each threshold, with a fake clock. Assertions name rule
ids and gates, not wording."""

from __future__ import annotations

from dataclasses import replace

import pytest

from guardian.core.actions import AnswerRequest, SetFraction, RecordCanaryLatencies, RestartUnit
from guardian.core.observations import CanaryResult, PersistentView, RestartOutcome
from guardian.core.vocab import Decision, Gate, RestartKind, State
from harness import TIMEOUT, Box, cfg, memory, obs, request, sample, unit, with_memory


def serving(box: Box, t: float = 100.0) -> None:
    box.tick(t)
    assert {n: tr.state for n, tr in box.tracks.items()} == {"a": State.HEALTHY, "b": State.HEALTHY}


# --- the memory guard's deferral: one line per episode, through the real tick ------------------------------

def test_a_lowering_deferred_by_back_off_is_said_once_over_many_ticks():
    """The defect: the deferral's text carried live seconds ("last restart 130 s ago"), so its
    once-per-episode key never matched and the error line repeated on every tick."""
    box = Box(with_memory(cfg(2, backoff_s=60)), PersistentView(restarts={"a": (1000.0,)}))
    serving(box, 1001.0)
    for t in range(1030, 1060, 2):  # 15 ticks inside the 60 s back-off, squeezed all along
        box.tick(float(t), memory=memory(5))
    deferred = box.lines(rule="M15")
    assert len(deferred) == 1 and deferred[0].decision == Decision.MEMORY_NOTE
    assert box.of(SetFraction) == []
    assert box.core.mem.rule == "M15"
    # back-off over (at exactly 60 s): the lowering goes ahead
    box.tick(1060.0, memory=memory(5))
    assert [lf.replica for lf in box.of(SetFraction)] == ["a"]


@pytest.mark.parametrize("dt, lowered", [(59.0, False), (60.0, True)])
def test_back_off_boundary_holds_the_memory_guard_too(dt, lowered):
    box = Box(with_memory(cfg(2, backoff_s=60)), PersistentView(restarts={"a": (1000.0,)}))
    serving(box, 1001.0)
    box.tick(1000.0 + dt, memory=memory(5))
    assert bool(box.of(SetFraction)) == lowered


# --- restarts in flight couple the two sides ---------------------------------------------------------

def test_a_lowering_marks_its_replica_restarting_and_holds_a_hang_restart_of_the_other():
    box = Box(with_memory(cfg(2)))
    serving(box)
    box.tick(110.0, memory=memory(5))
    assert [lf.replica for lf in box.of(SetFraction)] == ["a"]
    assert box.core.tracks["a"].restart_in_flight
    # b stalls now: its restart waits for a (one at a time per box), said once with gate A3
    flat = sample(gen=5, running=3)
    box.tick(200.0, b=obs("b", 200.0, s=flat), a=obs("a", 200.0, u=unit(active_state="activating")))
    for t in (300.0, 301.0, 302.0):
        box.tick(t, b=obs("b", t, s=flat), a=obs("a", t, u=unit(active_state="activating")))
    assert box.core.tracks["b"].state == State.STALLED
    assert box.of(RestartUnit) == []
    refused = box.lines(Decision.REFUSED)
    assert len(refused) == 1 and refused[0].gate == Gate.ONE_AT_A_TIME and refused[0].rule == "A3"
    # a's job ends and it serves again: now b is restarted
    done = RestartOutcome("vllm-a.service", "done", issued=True, ok=True)
    box.tick(304.0, a=obs("a", 304.0, u=unit(inactive_exit_mono=301.0), outcome=done), b=obs("b", 304.0, s=flat))
    assert [(r.replica, r.kind) for r in box.of(RestartUnit)] == [("b", RestartKind.HANG)]


def test_a_hang_restart_in_the_same_tick_defers_the_lowering():
    box = Box(with_memory(cfg(2, stall_window_s=60)))
    serving(box)
    flat = sample(gen=5, running=2)
    box.tick(200.0, a=obs("a", 200.0, s=flat))
    box.tick(260.0, memory=memory(5), a=obs("a", 260.0, s=flat))
    assert [(r.replica, r.kind) for r in box.of(RestartUnit)] == [("a", RestartKind.HANG)]
    assert box.of(SetFraction) == []
    (deferred,) = box.lines(rule="M15")
    assert "one restart at a time" in deferred.message


# --- operators' requests: the same admission -------------------------------------------------------

def test_an_operators_restart_is_admitted_once_and_answered_by_the_job():
    box = Box(cfg(2))
    serving(box)
    box.persistent = PersistentView(requests=(request(),))
    box.tick(101.0)
    box.tick(102.0)  # the request is still in the state file until the job's answer is written
    (r,) = box.of(RestartUnit)
    assert (r.replica, r.kind, r.request_id) == ("a", RestartKind.OPERATOR, "r1")
    assert box.core.tracks["a"].restart_in_flight and box.core.requests_taken == {"r1"}
    box.persistent = PersistentView()  # the executor moved it to the answers
    box.tick(103.0)
    assert box.core.requests_taken == frozenset()


@pytest.mark.parametrize("b_unit, b_health, admitted", [
    (unit("vllm-b.service", inactive_exit_mono=95.0), TIMEOUT, False),  # b loading its model: "active", no answer yet
    (unit("vllm-b.service", active_state="activating"), TIMEOUT, False),
    (unit("vllm-b.service"), None, True),  # b serves
])
def test_an_operators_restart_waits_while_another_replica_loads(b_unit, b_health, admitted):
    """The CLI used to look only at activating/deactivating units, so a Type=simple vLLM that is
    "active" for minutes while it loads did not stop `guardian restart a` (vLLM #35920)."""
    box = Box(cfg(2))
    serving(box)
    box.persistent = PersistentView(requests=(request(),))
    b = obs("b", 101.0, u=b_unit, **({"health": b_health} if b_health is not None else {}))
    box.tick(101.0, b=b)
    assert bool(box.of(RestartUnit)) == admitted
    if not admitted:
        (answer,) = box.of(AnswerRequest)
        assert not answer.ok and answer.request_id == "r1" and "one-at-a-time" in answer.message
        (line,) = box.lines(Decision.REFUSED)
        assert line.gate == Gate.ONE_AT_A_TIME and line.rule == "A3"


@pytest.mark.parametrize("age_s, admitted", [(59.0, False), (60.0, True)])
def test_an_operators_restart_respects_the_back_off(age_s, admitted):
    box = Box(cfg(2, backoff_s=60), PersistentView(restarts={"a": (1000.0,)}))
    serving(box, 1001.0)
    box.persistent = replace(box.persistent, requests=(request(at=1000.0 + age_s),))
    box.tick(1000.0 + age_s)
    assert bool(box.of(RestartUnit)) == admitted
    if not admitted:
        assert box.lines(Decision.REFUSED)[0].gate == Gate.BACKOFF


def test_a_request_for_an_unknown_replica_is_answered_not_acted_on():
    box = Box(cfg(2))
    serving(box)
    box.persistent = PersistentView(requests=(request(replica="zz"),))
    box.tick(101.0)
    (answer,) = box.of(AnswerRequest)
    assert not answer.ok and "zz" in answer.message and box.of(RestartUnit) == []


# --- the lowering confirmed end to end -------------------------------------------------------------

def test_an_overridden_fraction_stops_further_lowerings_of_that_replica():
    box = Box(with_memory(cfg(2)))
    serving(box)
    box.tick(110.0, memory=memory(5))
    (low,) = box.of(SetFraction)
    assert (low.replica, low.new) == ("a", 0.74)
    # a restarts and serves, but with 0.78 (a later EnvironmentFile= overrides guardian's file)
    done = RestartOutcome("vllm-a.service", "done", issued=True, ok=True)
    box.tick(112.0, memory=memory(5, a=0.74, cmdline=0.78),
             a=obs("a", 112.0, u=unit(inactive_exit_mono=111.0), outcome=done))
    box.tick(113.0, memory=memory(5, a=0.74, cmdline=0.78))
    assert box.lines(rule="M5"), "the mismatch must be said"
    # after the cooldown, squeezed again: a is not lowered again (it is not wired), b is
    box.tick(800.0, memory=memory(5, a=0.74, cmdline=0.78))
    assert [lf.replica for lf in box.of(SetFraction)] == ["a", "b"]


# --- canary latencies kept in the state file: one action a tick, only on a change (issue 20) -----------

def test_changed_canary_latencies_of_every_replica_are_recorded_in_one_action_and_nothing_when_unchanged():
    def recorded(acts: list) -> list:
        return [a for a in acts if isinstance(a, RecordCanaryLatencies)]

    box = Box(cfg(2), PersistentView(canary_latencies={"b": (0.2, 0.2, 0.2)}))
    assert recorded(box.tick(100.0)) == []  # a learning canary to a, none to b (kept: learned)
    assert box.core.tracks["b"].canary_latencies == (0.2, 0.2, 0.2)
    ok = CanaryResult(True, 100.0, 0.5)
    assert recorded(box.tick(102.0, a=obs("a", 102.0, canary=ok), b=obs("b", 102.0, canary=ok))) == [
        RecordCanaryLatencies((("a", (0.5,)), ("b", (0.2, 0.2, 0.2, 0.5))))
    ]  # both changed in the same tick: one write
    failed = CanaryResult(False, 102.0, 1.0, "timeout")
    assert recorded(box.tick(104.0, a=obs("a", 104.0, canary=failed))) == []  # a failure changes nothing kept
    assert recorded(box.tick(106.0)) == []  # a's next learning canary is in flight
    assert recorded(box.tick(108.0, a=obs("a", 108.0, canary=CanaryResult(True, 104.0, 0.3)))) == [
        RecordCanaryLatencies((("a", (0.5, 0.3)),))  # a's third learning canary, sent at 104
    ]
