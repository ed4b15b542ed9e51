"""`guardian restart NAME --wait D` (A4): an operator's request waits through the refusals that pass
by themselves, says what it waits for once per cause, and is refused after D; a refusal that lasts
is answered at once. Through the real tick (harness Box), and the request's way through the state
file and the executor."""

from __future__ import annotations

import json

import pytest

from guardian.act.state import StateStore, record_answer, record_waiting, view
from guardian.core import admission
from guardian.core.actions import AcquireSlot, AnswerRequest, RequestWaits, RestartUnit
from guardian.core.observations import PersistentView
from guardian.core.vocab import Decision, Gate, Priority, State
from guardian.observe.clock import Now, boot_id
from harness import (
    KNOWN_RULE_IDS, TIMEOUT, Box, cfg, fleet_view, obs, request, unit, with_fleet,
)

NOW = Now(mono=5000.0, wall=1_700_000_000.0)


def loading_b(t: float, since: float = 95.0):
    """Replica b, "active" and loading since SINCE: no answer yet (A3 for any other restart)."""
    return obs("b", t, u=unit("vllm-b.service", inactive_exit_mono=since), health=TIMEOUT)


def box_with_b_loading(wait_until: float | None) -> Box:
    """Both serve at 100; b restarts at 101 (loading from then); a's restart is asked at 102."""
    box = Box(cfg(2))
    box.tick(100.0)
    box.tick(101.0, b=loading_b(101.0, since=101.0))
    box.persistent = PersistentView(requests=(request(at=102.0, wait_until=wait_until),))
    return box


def test_a_request_with_a_wait_waits_while_another_loads_says_so_once_and_goes_once_it_serves():
    box = box_with_b_loading(wait_until=402.0)
    for t in range(102, 130, 2):
        acts = box.tick(float(t), b=loading_b(float(t), since=101.0))
        assert not [a for a in acts if isinstance(a, AnswerRequest | RestartUnit)], acts
    (said,) = box.lines(Decision.REQUEST)
    assert said.rule == "A4" and said.gate == Gate.ONE_AT_A_TIME and said.priority is Priority.INFO
    assert said.message.startswith("replica a: an operator's restart waits: b is starting")
    assert "(A3)" in said.message and "up to 300 s more" in said.message
    (waits,) = box.of(RequestWaits)
    assert (waits.request_id, waits.replica) == ("r1", "a") and waits.text.startswith("b is starting")
    assert box.lines(Decision.REFUSED) == []
    box.tick(130.0)  # b serves: a is admitted now
    (restart,) = box.of(RestartUnit)
    assert (restart.replica, restart.request_id) == ("a", "r1")
    assert box.of(AnswerRequest) == []  # answered when the job ends, by the executor


def test_a_request_still_refused_when_its_wait_ends_is_refused_after_waiting():
    box = box_with_b_loading(wait_until=160.0)
    for t in (102.0, 140.0, 159.9):
        box.tick(t, b=loading_b(t, since=101.0))
    assert box.of(AnswerRequest) == []
    box.tick(160.0, b=loading_b(160.0, since=101.0))
    (answer,) = box.of(AnswerRequest)
    assert not answer.ok and answer.waited_out
    assert "one-at-a-time" in answer.message and "after waiting 58 s" in answer.message
    assert box.of(RestartUnit) == []
    (refused,) = box.lines(Decision.REFUSED)
    assert refused.rule == "A3"


def test_without_a_wait_a_passing_refusal_is_answered_at_once_as_before():
    box = box_with_b_loading(wait_until=None)
    box.tick(102.0, b=loading_b(102.0, since=101.0))
    (answer,) = box.of(AnswerRequest)
    assert not answer.ok and not answer.waited_out and "one-at-a-time" in answer.message
    assert box.of(RequestWaits) == [] and box.lines(Decision.REQUEST) == []


@pytest.mark.parametrize("a_unit, persistent, gate", [
    (unit(load_state="masked"), PersistentView(), Gate.MASKED),
    (unit(unit_file_state="disabled"), PersistentView(), Gate.DISABLED),
    (unit(active_state="inactive"), PersistentView(), Gate.INACTIVE),  # stopped on purpose
    (None, PersistentView(restarts={"a": (10.0, 20.0, 30.0)}), Gate.BUDGET),
])
def test_a_lasting_refusal_is_answered_at_once_even_with_a_wait(a_unit, persistent, gate):
    box = Box(cfg(2), persistent)
    box.tick(100.0)
    box.persistent = PersistentView(restarts=persistent.restarts, requests=(request(at=101.0, wait_until=900.0),))
    box.tick(101.0, **({"a": obs("a", 101.0, u=a_unit)} if a_unit is not None else {}))
    (answer,) = box.of(AnswerRequest)
    assert not answer.ok and not answer.waited_out and f"({gate})" in answer.message, answer
    assert box.of(RequestWaits) == [] and box.lines(Decision.REQUEST) == []


def test_a_wait_through_back_off_ends_when_the_back_off_does():
    box = Box(cfg(2, backoff_s=60), PersistentView(restarts={"a": (1000.0,)}))
    box.tick(1001.0)
    box.persistent = PersistentView(restarts={"a": (1000.0,)}, requests=(request(at=1010.0, wait_until=1310.0),))
    for t in (1010.0, 1030.0, 1059.0):
        box.tick(t)
    assert box.of(RestartUnit) == [] and box.of(AnswerRequest) == []
    (said,) = box.lines(Decision.REQUEST)
    assert said.gate == Gate.BACKOFF and "(A2)" in said.message
    box.tick(1060.0)
    assert [r.request_id for r in box.of(RestartUnit)] == ["r1"]


def test_a_new_cause_is_said_again_the_same_one_is_not():
    box = Box(cfg(3))
    box.tick(100.0)
    box.persistent = PersistentView(requests=(request(at=101.0, wait_until=900.0),))
    box.tick(101.0, b=loading_b(101.0))
    box.tick(103.0, b=loading_b(103.0))
    c_loading = obs("c", 105.0, u=unit("vllm-c.service", inactive_exit_mono=104.0), health=TIMEOUT)
    box.tick(105.0, b=loading_b(105.0), c=c_loading)
    texts = [w.text for w in box.of(RequestWaits)]
    assert len(texts) == 2 and texts[0].startswith("b is starting") and texts[1].startswith("b, c are starting")
    assert len(box.lines(Decision.REQUEST)) == 2


def test_a_wait_for_a_fleet_slot_is_shown_and_refused_when_the_wait_ends():
    box = Box(with_fleet(cfg(2)))
    down = fleet_view(ok=False, error="no etcd endpoint answered")
    box.tick(98.0, fleet=down)
    box.persistent = PersistentView(requests=(request("q1", at=99.0, wait_until=130.0),))
    for t in (100.0, 110.0, 129.0):
        box.tick(t, fleet=down)
    (waits,) = box.of(RequestWaits)
    assert "etcd" in waits.text and "(F3)" in waits.text
    assert box.of(AnswerRequest) == [] and box.of(AcquireSlot) == []
    box.tick(130.0, fleet=down)
    (answer,) = box.of(AnswerRequest)
    assert not answer.ok and answer.waited_out and "after waiting 31 s" in answer.message
    assert box.of(RestartUnit) == []


def test_the_passing_refusals_are_rule_ids_of_the_tables_and_a4_is_one():
    assert admission.PASSING_RULES <= KNOWN_RULE_IDS and "A4" in KNOWN_RULE_IDS
    assert {"A1", "G2", "G3", "G4", "G5", "G7", "G8", "G9"}.isdisjoint(admission.PASSING_RULES)
    assert {"A2", "A3", "G6"} <= admission.PASSING_RULES


# --- the request's way: the state file, the view, the executor --------------------------------------------

def test_a_wait_until_survives_the_state_file_on_the_monotonic_clock_and_lies_ahead(tmp_path):
    store = StateStore(tmp_path, clock=lambda: NOW)
    ahead = {"wall": NOW.wall + 300, "mono": NOW.mono + 300}
    store.update(lambda d: d["requests"].update({"r1": {"replica": "a", "at": {"wall": NOW.wall, "mono": NOW.mono},
                                                        "wait_until": ahead}}))
    (q,) = view(store.read(), NOW).requests
    assert (q.at, q.wait_until) == (NOW.mono, NOW.mono + 300)  # not clamped to now: an end lies ahead
    plain = {"replica": "a", "at": {"wall": NOW.wall, "mono": NOW.mono}}
    store.update(lambda d: d["requests"].update({"r2": plain}))
    assert {q.id: q.wait_until for q in view(store.read(), NOW).requests} == {"r1": NOW.mono + 300, "r2": None}


def test_what_a_request_waits_for_is_written_with_it_and_a_withdrawn_one_is_not_brought_back(tmp_path):
    store = StateStore(tmp_path, clock=lambda: NOW)
    store.update(lambda d: d["requests"].update({"r1": {"replica": "a", "at": NOW.wall}}))
    store.update(lambda d: record_waiting(d, "r1", "b is starting (A3)"))
    store.update(lambda d: record_waiting(d, "gone", "x"))
    data = store.read()
    assert data["requests"]["r1"]["waiting"] == "b is starting (A3)" and "gone" not in data["requests"]
    store.update(lambda d: record_answer(d, AnswerRequest("r1", "a", False, "refused", waited_out=True), NOW))
    data = json.loads((tmp_path / "state.json").read_text())
    assert data["requests"] == {} and data["answers"]["r1"]["waited_out"] is True
    assert store.read()["answers"]["r1"]["waited_out"] is True


def test_the_executor_records_what_a_request_waits_for(tmp_path):
    from guardian.act.executor import Executor
    from guardian.act.journal import Journal
    from guardian.act.restart import Tools
    from guardian.config import Config

    store = StateStore(tmp_path, clock=lambda: NOW)
    store.update(lambda d: d["requests"].update({"r1": {"replica": "a", "at": NOW.wall}}))
    ex = Executor(Tools(None, store, Journal(socket_path="/nonexistent"), Config(), lambda: NOW), None)
    ex.perform([RequestWaits("r1", "a", "b is starting (A3)")], {}, NOW)
    assert store.read()["requests"]["r1"]["waiting"] == "b is starting (A3)"
    ex.perform([AnswerRequest("r1", "a", False, "refused (one-at-a-time): ...", waited_out=True)], {}, NOW)
    answer = store.read()["answers"]["r1"]
    assert answer["waited_out"] is True and not answer["ok"] and store.read()["requests"] == {}


def test_a_waiting_text_or_waited_out_of_the_wrong_type_makes_the_file_corrupt(tmp_path):
    from guardian.act.state import CorruptState

    for bad in ({"requests": {"r": {"replica": "a", "at": 1, "waiting": 5}}},
                {"answers": {"r": {"replica": "a", "ok": False, "message": "m", "at": 1, "waited_out": "yes"}}}):
        (tmp_path / "state.json").write_text(json.dumps({"version": 1, "boot_id": boot_id(), **bad}))
        with pytest.raises(CorruptState):
            StateStore(tmp_path, clock=lambda: NOW).read()


def test_a_replica_loading_is_state_starting_for_the_tick():
    """The set-up the tests above rely on: b "active" with no answer since its start is starting."""
    box = Box(cfg(2))
    box.tick(100.0)
    box.tick(101.0, b=loading_b(101.0, since=101.0))
    assert box.state("b") is State.STARTING


# --- A5: a request whose command is gone, or stopped waiting, is withdrawn (issue 34 row 12) ---------

@pytest.mark.parametrize(("gone", "expires", "withdrawn", "why"), [
    (True, None, True, "the command that asked (pid 4242) is gone without withdrawing it"),
    (False, 100.9, True, "the command that asked stopped waiting for its answer 1 s ago"),
    (False, 102.5, False, ""),  # its command still waits
    (False, None, False, ""),  # an older guardian's request: no end said, its command alive
])
def test_a_request_whose_command_is_gone_or_stopped_waiting_is_withdrawn_unacted(gone, expires, withdrawn, why):
    from dataclasses import replace as _replace

    box = Box(cfg(2))
    box.tick(100.0)
    box.persistent = PersistentView(requests=(_replace(request(at=100.5), expires=expires, asker=(4242, 77),
                                                       asker_gone=gone),))
    acts = box.tick(102.0)
    restarts = [a for a in acts if isinstance(a, RestartUnit)]
    if not withdrawn:
        assert [r.replica for r in restarts] == ["a"]
        assert box.lines(rule="A5") == []
        return
    assert restarts == []
    (said,) = box.lines(rule="A5")
    assert said.priority is Priority.ERROR and said.decision is Decision.REQUEST
    assert said.message == f"replica a: an operator's restart request (asked 2 s ago) withdrawn, not acted on: {why} (A5)"
    (answer,) = [a for a in acts if isinstance(a, AnswerRequest)]
    assert (answer.request_id, answer.ok, answer.message) == ("r1", False, f"withdrawn: {why}")


def test_a_request_already_acted_on_is_not_withdrawn_when_its_command_goes():
    """A5 is for requests not acted on yet: a restart already issued goes on."""
    from dataclasses import replace as _replace

    box = Box(cfg(2))
    box.tick(100.0)
    box.persistent = PersistentView(requests=(_replace(request(at=100.5), asker=(4242, 77)),))
    assert [a.replica for a in box.tick(101.0) if isinstance(a, RestartUnit)] == ["a"]
    box.persistent = PersistentView(requests=(_replace(request(at=100.5), asker=(4242, 77), asker_gone=True),))
    acts = box.tick(102.0)
    assert box.lines(rule="A5") == [] and not [a for a in acts if isinstance(a, AnswerRequest)]


def test_the_asker_of_a_request_is_a_real_process_by_its_pid_and_its_start():
    import subprocess
    import sys

    from guardian.observe.askers import askers_checked, start_ticks

    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        start = start_ticks(proc.pid)
        assert start is not None and start > 0
        asked = (RequestFor := request(at=1.0))  # noqa: F841 - named for the three cases below
        from dataclasses import replace as _replace
        view = PersistentView(requests=(
            _replace(RequestFor, id="alive", asker=(proc.pid, start)),
            _replace(RequestFor, id="reused", asker=(proc.pid, start + 1)),  # the pid now names another process
            _replace(RequestFor, id="older"),  # no asker recorded
        ))
        assert {q.id: q.asker_gone for q in askers_checked(view).requests} == {
            "alive": False, "reused": True, "older": False}
    finally:
        proc.kill()
        proc.wait()
    assert {q.id: q.asker_gone for q in askers_checked(view).requests}["alive"] is True  # gone once it ended
