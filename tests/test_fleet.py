"""Planned restarts across a fleet (core/fleet.py, F1-F7), pure: the fleet view is the input, a
fake clock the time. Assertions name rule ids."""

from __future__ import annotations

import pytest

from guardian.core import fleet
from guardian.core.actions import AcquireSlot, AnswerRequest, LogLine, SetFraction, ReleaseSlot, RestartUnit
from guardian.core.observations import FleetSlot, PersistentView, RestartOutcome, RestartRequest
from guardian.core.vocab import Decision, State
from harness import (
    BOX, TIMEOUT, Box, cfg, checked, fleet_view, member, memory, obs, of, sample, unit, with_fleet, with_memory,
)

SERVING_ELSEWHERE = (member("box1", "a"), member("box1", "b"), member("box2", "a"), member("box3", "a"))


@pytest.mark.parametrize("v, max_planned, min_serving, rule", [
    (None, 1, 1, "F3"),
    (fleet_view(ok=False, error="connection refused"), 1, 1, "F3"),
    (fleet_view(SERVING_ELSEWHERE, [FleetSlot(BOX, "a", "m")]), 1, 1, None),  # F2: it holds one
    (fleet_view(SERVING_ELSEWHERE, [FleetSlot("box2", "a", "m")]), 1, 1, "F4"),  # 1 of 1 held elsewhere
    (fleet_view(SERVING_ELSEWHERE, [FleetSlot("box2", "a", "m")]), 2, 1, "F6"),  # 1 of 2 held
    (fleet_view(SERVING_ELSEWHERE), 1, 3, "F6"),  # 3 others serve (box1/b, box2/a, box3/a): exactly min_serving
    (fleet_view(SERVING_ELSEWHERE), 1, 4, "F5"),  # just short
    (fleet_view(SERVING_ELSEWHERE, [FleetSlot("box2", "a", "m")]), 2, 3, "F5"),  # a slot holder is not serving
    (fleet_view((member("box1", "a"), member("box2", "a", "stalled"), member("box3", "a", model="other"))), 1, 1, "F5"),
])
def test_when_a_planned_restart_may_begin(v, max_planned, min_serving, rule):
    c = with_fleet(cfg(2), max_planned_restarts=max_planned, min_serving=min_serving)
    b = checked(fleet.slot_refusal("a", "m", v, c))
    assert (b.rule if b else None) == rule


def test_without_a_fleet_nothing_waits():
    assert fleet.slot_refusal("a", "m", None, cfg(2)) is None


def test_the_wait_names_who_holds_the_slots():
    held_by_box7 = fleet_view(SERVING_ELSEWHERE, [FleetSlot("box7", "x", "m")])
    b = checked(fleet.slot_refusal("a", "m", held_by_box7, with_fleet(cfg(2))))
    assert "box7/x" in b.text


def test_the_wait_names_the_key_of_a_slot_held_by_no_guardians_lease():
    """Issue 41 row 6: a slot that reads as a guardian's but is bound to no lease (it never expires)
    still counts, and the wait line says which key it is and why it is not a guardian's."""
    ghost = FleetSlot("ghost", "x", "m", key="/guardian/f/slots/0", not_leased="bound to no lease, so it never expires")
    b = checked(fleet.slot_refusal("a", "m", fleet_view(SERVING_ELSEWHERE, [ghost]), with_fleet(cfg(2))))
    assert b.rule == "F4" and "ghost/x" in b.text
    assert "'/guardian/f/slots/0'" in b.text and "not a guardian's lease: bound to no lease" in b.text
    assert "deleting it frees the slot" in b.text


def test_an_operators_restart_asks_for_a_slot_waits_and_goes_once_it_holds_one_then_gives_it_back():
    box = Box(with_fleet(cfg(2)))
    free = fleet_view(SERVING_ELSEWHERE)
    box.tick(98, fleet=free)
    box.persistent = PersistentView(requests=(RestartRequest("q1", "a", 99.0),))
    acts = box.tick(100, fleet=free)
    assert of(acts, AcquireSlot) == [AcquireSlot("a", "m")] and not of(acts, RestartUnit) and not of(acts, AnswerRequest)
    acts = box.tick(102, fleet=free)  # the transaction lost a race, say: asked again, not said again
    assert of(acts, AcquireSlot) and not [a for a in acts if isinstance(a, LogLine) and a.rule == "F6"]
    held = fleet_view(SERVING_ELSEWHERE, [FleetSlot(BOX, "a", "m")])
    acts = box.tick(104, fleet=held)
    (r,) = of(acts, RestartUnit)
    assert r.request_id == "q1" and not of(acts, ReleaseSlot)
    # restarting, then starting: the slot is kept
    acts = box.tick(106, fleet=held)
    assert not of(acts, ReleaseSlot)
    done = RestartOutcome("vllm-a.service", "done", True, True)
    new = unit(inactive_exit_mono=105.0)
    acts = box.tick(108, fleet=held, a=obs("a", 108, u=new, outcome=done, health=obs("a").health, s=sample()))
    acts += box.tick(110, fleet=held, a=obs("a", 110, u=new, s=sample(gen=1)))
    assert box.tracks["a"].state is State.HEALTHY
    assert of(acts, ReleaseSlot) == [ReleaseSlot("a")]


def test_etcd_unreachable_holds_a_planned_restart_and_says_so_once_at_error():
    box = Box(with_fleet(cfg(2)))
    down = fleet_view(ok=False, error="no etcd endpoint answered")
    box.tick(98, fleet=down)
    box.persistent = PersistentView(requests=(RestartRequest("q1", "a", 99.0),))
    for t in (100, 102, 104):
        acts = box.tick(t, fleet=down)
        assert not of(acts, RestartUnit) and not of(acts, AcquireSlot)
    said = [a for a in box.actions if isinstance(a, LogLine) and a.rule == "F3"]
    assert len(said) == 1 and said[0].priority.value == "error" and said[0].decision is Decision.FLEET


def test_a_hung_replica_is_restarted_even_with_etcd_down():
    box = Box(with_fleet(cfg(2, unresponsive_after_s=10)), fleet=fleet_view(ok=False, error="down"))
    box.tick(100)
    box.tick(105, a=obs("a", 105, health=TIMEOUT))
    acts = box.tick(110, a=obs("a", 110, health=TIMEOUT))
    assert of(acts, RestartUnit)


def test_a_slot_nobody_uses_is_given_back():
    box = Box(with_fleet(cfg(2)), fleet=fleet_view(SERVING_ELSEWHERE, [FleetSlot(BOX, "b", "m")]))
    acts = box.tick(100)  # b holds a slot, with no request and nothing pending
    assert of(acts, ReleaseSlot) == [ReleaseSlot("b")]


def test_the_memory_guard_waits_for_a_slot_unless_critical():
    c = with_fleet(with_memory(cfg(2)))
    box = Box(c)
    free = fleet_view(SERVING_ELSEWHERE)
    box.tick(100, fleet=free)
    acts = box.tick(110, fleet=free)  # not squeezed
    assert not of(acts, AcquireSlot)
    acts = box.tick(112, memory=memory(5), fleet=free)
    assert of(acts, AcquireSlot) == [AcquireSlot("a", "m")] and not of(acts, SetFraction)
    assert box.core.mem.rule == "M15"
    held = fleet_view(SERVING_ELSEWHERE, [FleetSlot(BOX, "a", "m")])
    acts = box.tick(114, memory=memory(5), fleet=held)
    assert [lf.replica for lf in of(acts, SetFraction)] == ["a"] and not of(acts, ReleaseSlot)
    # critical (below 3 GiB) with etcd down: it goes ahead, said at error
    etcd_down = Box(c)
    down = fleet_view(ok=False, error="down")
    etcd_down.tick(100, fleet=down)
    acts = etcd_down.tick(112, memory=memory(2), fleet=down)
    assert of(acts, SetFraction)
    assert any(isinstance(a, LogLine) and a.decision is Decision.FLEET and a.priority.value == "error" for a in acts)


def test_with_a_fleet_another_box_serving_the_model_is_the_peer_that_lets_a_lowering_go():
    """One replica per box: without the fleet view the memory guard finds no peer (M14)."""
    c = with_fleet(with_memory(cfg(1)))
    alone = fleet_view((member(BOX, "a"),))
    other = fleet_view((member(BOX, "a"), member("box2", "a")))
    for v, rule in ((alone, "M14"), (other, "M15")):  # M15: it asks for a slot (F6)
        box = Box(c, fleet=v)
        box.tick(100)
        box.tick(112, memory=memory(5))
        assert box.core.mem.rule == rule


@pytest.mark.parametrize("value, serving", [
    ('{"box": "b2", "name": "a", "model": "m", "state": "degraded", "serves": true}', True),  # late /metrics only
    ('{"box": "b2", "name": "a", "model": "m", "state": "healthy", "serves": false}', False),  # its box says not
    ('{"box": "b2", "name": "a", "model": "m", "state": "busy"}', True),  # an older guardian: by its state
    ('{"box": "b2", "name": "a", "model": "m", "state": "degraded"}', False),
])
def test_another_box_counts_its_replica_by_the_one_definition_of_serving(value, serving):
    """Issue 35 item 3: the fleet's counts use what the replica's own box judged (watchdog/judge.py serves)."""
    from guardian.fleet.sync import read_member

    member_, _ = read_member(value)
    assert member_.serving is serving


def test_a_members_serves_that_is_not_a_boolean_is_not_a_guardians():
    from guardian.fleet.sync import NotOurs, read_member

    with pytest.raises(NotOurs):
        read_member('{"box": "b2", "name": "a", "model": "m", "state": "healthy", "serves": "yes"}')
