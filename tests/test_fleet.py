"""Planned restarts across a fleet (core/fleet.py, F1-F7), pure: the fleet view is the input, a
fake clock the time. Assertions name rule ids."""

from __future__ import annotations

from dataclasses import replace

import pytest

from guardian.config import Config, FleetConfig
from guardian.core import fleet, tick
from guardian.core.actions import AcquireSlot, AnswerRequest, LogLine, LowerFraction, ReleaseSlot, RestartUnit
from guardian.core.observations import (
    FleetMember, FleetSlot, FleetView, PersistentView, RestartOutcome, RestartRequest, TickObservation,
)
from guardian.core.vocab import Decision, State
from test_liveness import cfg, obs, sample, unit

BOX = "box1"


def fleet_cfg(base: Config | None = None, **kw) -> Config:
    base = base if base is not None else cfg(2)
    return base.model_copy(update={"fleet": FleetConfig(endpoints=["http://127.0.0.1:2379"], box=BOX, **kw)})


def view(members=(), slots=(), ok=True, error=None) -> FleetView:
    return FleetView(BOX, ok, error, tuple(members), tuple(slots))


def m(box, name, state="healthy", model="m") -> FleetMember:
    return FleetMember(box, name, model, state)


SERVING_ELSEWHERE = (m("box1", "a"), m("box1", "b"), m("box2", "a"), m("box3", "a"))


@pytest.mark.parametrize("v, max_planned, min_serving, rule", [
    (None, 1, 1, "F3"),
    (view(ok=False, error="connection refused"), 1, 1, "F3"),
    (view(SERVING_ELSEWHERE, [FleetSlot(BOX, "a", "m")]), 1, 1, None),  # F2: it holds one
    (view(SERVING_ELSEWHERE, [FleetSlot("box2", "a", "m")]), 1, 1, "F4"),  # 1 of 1 held elsewhere
    (view(SERVING_ELSEWHERE, [FleetSlot("box2", "a", "m")]), 2, 1, "F6"),  # 1 of 2 held
    (view(SERVING_ELSEWHERE), 1, 3, "F6"),  # 3 others serve (box1/b, box2/a, box3/a): exactly min_serving
    (view(SERVING_ELSEWHERE), 1, 4, "F5"),  # just short
    (view(SERVING_ELSEWHERE, [FleetSlot("box2", "a", "m")]), 2, 3, "F5"),  # a slot holder does not count as serving
    (view((m("box1", "a"), m("box2", "a", "stalled"), m("box3", "a", model="other"))), 1, 1, "F5"),
])
def test_when_a_planned_restart_may_begin(v, max_planned, min_serving, rule):
    c = fleet_cfg(max_planned_restarts=max_planned, min_serving=min_serving)
    b = fleet.slot_refusal("a", "m", v, c)
    assert (b.rule if b else None) == rule


def test_without_a_fleet_nothing_waits():
    assert fleet.slot_refusal("a", "m", None, cfg(2)) is None


def test_the_wait_names_who_holds_the_slots():
    b = fleet.slot_refusal("a", "m", view(SERVING_ELSEWHERE, [FleetSlot("box7", "x", "m")]), fleet_cfg())
    assert "box7/x" in b.text


class FleetSim:
    def __init__(self, c: Config) -> None:
        self.cfg = c
        self.state = tick.TickState()
        self.persistent = PersistentView()
        self.actions: list = []

    def step(self, t: float, v: FleetView | None, **per_replica) -> list:
        reps = {r.name: replace(per_replica.get(r.name) or obs(r.name, t), at=t) for r in self.cfg.replicas}
        self.state, acts = tick.decide(self.state, TickObservation(reps, self.persistent, fleet=v), t, self.cfg)
        self.actions += acts
        return acts


def of(actions, kind) -> list:
    return [a for a in actions if isinstance(a, kind)]


def test_an_operators_restart_asks_for_a_slot_waits_and_goes_once_it_holds_one_then_gives_it_back():
    sim = FleetSim(fleet_cfg())
    free = view(SERVING_ELSEWHERE)
    sim.step(98, free)
    sim.persistent = PersistentView(requests=(RestartRequest("q1", "a", 99.0),))
    acts = sim.step(100, free)
    assert of(acts, AcquireSlot) == [AcquireSlot("a", "m")] and not of(acts, RestartUnit) and not of(acts, AnswerRequest)
    acts = sim.step(102, free)  # the transaction lost a race, say: asked again, not said again
    assert of(acts, AcquireSlot) and not [a for a in acts if isinstance(a, LogLine) and a.rule == "F6"]
    held = view(SERVING_ELSEWHERE, [FleetSlot(BOX, "a", "m")])
    acts = sim.step(104, held)
    (r,) = of(acts, RestartUnit)
    assert r.request_id == "q1" and not of(acts, ReleaseSlot)
    # restarting, then starting: the slot is kept
    acts = sim.step(106, held)
    assert not of(acts, ReleaseSlot)
    done = RestartOutcome("vllm-a.service", "done", 0, True, True)
    new = unit(inactive_exit_mono=105.0)
    acts = sim.step(108, held, a=obs("a", 108, u=new, outcome=done, health=obs("a").health, s=sample()))
    acts += sim.step(110, held, a=obs("a", 110, u=new, s=sample(gen=1)))
    assert sim.state.tracks["a"].state is State.HEALTHY
    assert of(acts, ReleaseSlot) == [ReleaseSlot("a")]


def test_etcd_unreachable_holds_a_planned_restart_and_says_so_once_at_error():
    sim = FleetSim(fleet_cfg())
    down = view(ok=False, error="no etcd endpoint answered")
    sim.step(98, down)
    sim.persistent = PersistentView(requests=(RestartRequest("q1", "a", 99.0),))
    for t in (100, 102, 104):
        acts = sim.step(t, down)
        assert not of(acts, RestartUnit) and not of(acts, AcquireSlot)
    said = [a for a in sim.actions if isinstance(a, LogLine) and a.rule == "F3"]
    assert len(said) == 1 and said[0].priority.value == "error" and said[0].decision is Decision.FLEET


def test_a_hung_replica_is_restarted_even_with_etcd_down():
    from test_liveness import TIMEOUT
    sim = FleetSim(fleet_cfg(cfg(2, unresponsive_after_s=10)))
    down = view(ok=False, error="down")
    sim.step(100, down)
    sim.step(105, down, a=obs("a", 105, health=TIMEOUT))
    acts = sim.step(110, down, a=obs("a", 110, health=TIMEOUT))
    assert of(acts, RestartUnit)


def test_a_slot_nobody_uses_is_given_back():
    sim = FleetSim(fleet_cfg())
    acts = sim.step(100, view(SERVING_ELSEWHERE, [FleetSlot(BOX, "b", "m")]))  # b: no request, nothing pending
    assert of(acts, ReleaseSlot) == [ReleaseSlot("b")]


def test_the_memory_guard_waits_for_a_slot_unless_critical():
    from test_tick import config, memory
    base = config()
    c = fleet_cfg(base)
    sim = FleetSim(c)
    free = view(SERVING_ELSEWHERE)
    sim.step(100, free)
    acts = sim.step(110, free)  # not squeezed
    assert not of(acts, AcquireSlot)
    reps = {r.name: obs(r.name, 112) for r in c.replicas}
    sim.state, acts = tick.decide(sim.state, TickObservation(reps, PersistentView(), memory(5), fleet=free), 112, c)
    assert of(acts, AcquireSlot) == [AcquireSlot("a", "m")] and not of(acts, LowerFraction)
    assert sim.state.mem.rule == "M14"
    held = view(SERVING_ELSEWHERE, [FleetSlot(BOX, "a", "m")])
    reps = {r.name: obs(r.name, 114) for r in c.replicas}
    sim.state, acts = tick.decide(sim.state, TickObservation(reps, PersistentView(), memory(5), fleet=held), 114, c)
    assert [lf.replica for lf in of(acts, LowerFraction)] == ["a"] and not of(acts, ReleaseSlot)
    # critical (below 3 GiB) with etcd down: it goes ahead, said at error
    sim2 = FleetSim(c)
    down = view(ok=False, error="down")
    sim2.step(100, down)
    reps = {r.name: obs(r.name, 112) for r in c.replicas}
    sim2.state, acts = tick.decide(sim2.state, TickObservation(reps, PersistentView(), memory(2), fleet=down), 112, c)
    assert of(acts, LowerFraction)
    assert any(isinstance(a, LogLine) and a.decision is Decision.FLEET and a.priority.value == "error" for a in acts)


def test_with_a_fleet_another_box_serving_the_model_is_the_peer_that_lets_a_lowering_go():
    """One replica per box: without the fleet view the memory guard finds no peer (M13)."""
    from test_tick import config, memory
    from guardian.config import ReplicaConfig
    base = config().model_copy(update={"replicas": [
        ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:8001", model="m")]})
    c = fleet_cfg(base)
    alone = view((m(BOX, "a"),))
    other = view((m(BOX, "a"), m("box2", "a")))
    for v, rule in ((alone, "M13"), (other, "M14")):  # M14: it asks for a slot (F6)
        sim = FleetSim(c)
        sim.step(100, v)
        reps = {"a": obs("a", 112)}
        sim.state, acts = tick.decide(sim.state, TickObservation(reps, PersistentView(), memory(5), fleet=v), 112, c)
        assert sim.state.mem.rule == rule
