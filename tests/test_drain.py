"""Draining through the proxy (core/drain.py, D1-D11) as the tick applies it: table rows before, at
and after each threshold, with a fake clock. Assertions name rule ids, not wording."""

from __future__ import annotations

from dataclasses import replace

import pytest

from guardian.config import Config, ProxyConfig
from guardian.core import tick
from guardian.core.actions import AnswerRequest, LogLine, RestartUnit
from guardian.core.drain import Drain, Phase
from guardian.core.observations import PersistentView, ProxyView, RestartOutcome, RestartRequest
from guardian.core.vocab import Decision, RestartKind, State
from test_liveness import TIMEOUT, Sim, cfg, obs, sample, unit

DRAIN_S = 120.0


def proxied(n: int = 2, **watchdog) -> Config:
    return cfg(n, **watchdog).model_copy(
        update={"proxy": ProxyConfig(drain_command=["/bin/true"], drain_timeout_s=DRAIN_S, stop_timeout_s=30)}
    )


def asked(sim: Sim, rid: str = "q1", replica: str = "a", at: float = 100.0) -> None:
    sim.persistent = replace(sim.persistent, requests=(RestartRequest(rid, replica, at),))


def rules(actions) -> list[str]:
    return [a.rule for a in actions if isinstance(a, LogLine) and a.decision is Decision.PROXY]


def refused_rules(actions) -> list[str]:
    return [a.rule for a in actions if isinstance(a, LogLine) and a.decision is Decision.REFUSED]


def answers(actions) -> list[AnswerRequest]:
    return [a for a in actions if isinstance(a, AnswerRequest)]


def restarts(actions) -> list[RestartUnit]:
    return [a for a in actions if isinstance(a, RestartUnit)]


BUSY = sample(gen=1, running=3, waiting=1)


def draining(t0: float = 100.0, load=BUSY) -> Sim:
    """Both replicas serve; an operator asks to restart a, which has 3 running and 1 waiting."""
    sim = Sim(proxied())
    sim.tick(t0 - 2, a=obs("a", t0 - 2, s=sample(gen=0)))
    asked(sim, at=t0)
    acts = sim.tick(t0, a=obs("a", t0, s=load))
    assert rules(acts) == ["D1"] and not restarts(acts) and not answers(acts)
    assert sim.core.drains["a"].phase is Phase.DRAINING
    return sim


def confirmed(sim: Sim, t: float, s=BUSY) -> list:
    return sim.tick(t, a=replace(obs("a", t, s=s)), proxy=ProxyView(frozenset({"a"})))


class ProxySim(Sim):
    """Sim with the proxy's report in each observation."""

    def tick(self, t: float, proxy: ProxyView | None = None, **per_replica) -> list:  # type: ignore[override]
        from guardian.core.observations import TickObservation

        observations = {r.name: replace(per_replica.get(r.name) or obs(r.name, t), at=t) for r in self.cfg.replicas}
        view = proxy if proxy is not None else ProxyView(self.core.proxy_down)
        self.core, actions = tick.decide(self.core, TickObservation(observations, self.persistent, proxy=view), t, self.cfg)
        self.actions += actions
        return actions


Sim = ProxySim  # noqa: F811 - every test here sees the proxy's report


def test_without_a_proxy_a_planned_restart_is_immediate():
    sim = ProxySim(cfg(2))
    sim.tick(98)
    asked(sim)
    acts = sim.tick(100, proxy=None)
    assert restarts(acts) and not sim.core.drains


def test_a_planned_restart_drains_first_d1():
    draining()


def test_with_no_other_replica_serving_it_restarts_at_once_not_drained_d2():
    sim = Sim(proxied())
    stopped = obs("b", 98, u=unit("vllm-b.service", active_state="inactive"))
    sim.tick(98, b=stopped)
    asked(sim)
    acts = sim.tick(100, b=replace(stopped, at=100))
    assert rules(acts) == ["D2"] and restarts(acts) and not sim.core.drains


def test_nothing_is_restarted_before_the_proxy_confirms_the_drain():
    sim = draining()
    acts = sim.tick(102, a=obs("a", 102, s=sample(gen=1)), proxy=ProxyView(frozenset()))  # queue empty, not applied
    assert not restarts(acts) and sim.core.drains["a"].confirmed_at is None


@pytest.mark.parametrize("running, waiting, restarted", [(1, 0, False), (0, 1, False), (0, 0, True)])
def test_restarted_once_no_request_is_left_d5(running, waiting, restarted):
    sim = draining()
    confirmed(sim, 102)
    acts = confirmed(sim, 104, s=sample(gen=2, running=running, waiting=waiting))
    assert bool(restarts(acts)) == restarted
    if restarted:
        (r,) = restarts(acts)
        assert (r.request_id, r.kind, r.kill_first, r.stop_timeout_s) == ("q1", RestartKind.OPERATOR, False, 30)
        assert sim.core.drains["a"].phase is Phase.AWAY


@pytest.mark.parametrize("waited, restarted", [(DRAIN_S - 0.5, False), (DRAIN_S, True), (DRAIN_S + 1, True)])
def test_drain_timeout_boundary_d6(waited, restarted):
    sim = draining()
    confirmed(sim, 102)  # the timer starts when the proxy has it down
    confirmed(sim, 130, s=sample(gen=50, running=3, waiting=1))  # tokens flow: long streams, not a stall
    acts = confirmed(sim, 102 + waited, s=sample(gen=100, running=3, waiting=1))
    assert bool(restarts(acts)) == restarted
    if restarted:
        line = next(a for a in acts if isinstance(a, LogLine) and a.decision is Decision.RESTART)
        assert "3 running, 1 waiting" in line.message and "(D6)" in line.message


def test_a_proxy_that_cannot_mark_it_down_blocks_the_planned_restart_d3():
    sim = draining()
    acts = sim.tick(102, a=obs("a", 102, s=BUSY), proxy=ProxyView(frozenset(), frozenset({"a"}), "exit status 1"))
    assert not restarts(acts) and "a" not in sim.core.drains
    assert refused_rules(acts) == ["D3"]
    (ans,) = answers(acts)
    assert not ans.ok and "exit status 1" in ans.message


def test_a_drain_is_given_up_when_the_other_replica_stops_serving_d4():
    sim = draining()
    confirmed(sim, 102)
    gone = obs("b", 104, u=unit("vllm-b.service", active_state="failed"))
    acts = sim.tick(104, a=obs("a", 104, s=BUSY), b=gone, proxy=ProxyView(frozenset({"a"})))
    assert refused_rules(acts) == ["D4"] and "a" not in sim.core.drains and not restarts(acts)
    assert not answers(acts)[0].ok


def test_a_restart_refused_when_the_drain_ends_marks_it_up_again_d7():
    sim = draining()
    confirmed(sim, 102)
    sim.persistent = replace(sim.persistent, restarts={"a": (90.0, 95.0, 99.0)})  # budget spent meanwhile
    acts = confirmed(sim, 104, s=sample(gen=2))
    assert not restarts(acts) and "a" not in sim.core.drains
    (ans,) = answers(acts)
    assert not ans.ok and "(D8)" in ans.message


def test_another_planned_restart_waits_while_one_replica_drains():
    sim = draining()
    sim.persistent = replace(sim.persistent, requests=(RestartRequest("q1", "a", 100), RestartRequest("q2", "b", 101)))
    acts = confirmed(sim, 102)
    (ans,) = answers(acts)
    assert (ans.request_id, ans.ok) == ("q2", False) and "one-at-a-time" in ans.message


def test_a_hung_replica_is_marked_down_with_its_restart_and_up_once_it_serves_d8_d9():
    sim = Sim(proxied(unresponsive_after_s=10))
    sim.tick(100)
    sim.tick(105, a=obs("a", 105, health=TIMEOUT))
    acts = sim.tick(110, a=obs("a", 110, health=TIMEOUT))
    assert restarts(acts)[0].kill_first and rules(acts) == ["D9"]
    assert sim.core.drains["a"].phase is Phase.AWAY
    # the restart job is under way, then done; the new process loads
    acts = sim.tick(112, a=obs("a", 112, health=TIMEOUT))
    assert "a" in sim.core.drains and not rules(acts)
    new = unit(inactive_exit_mono=111.0)
    acts = sim.tick(114, a=obs("a", 114, health=TIMEOUT, u=new, outcome=RestartOutcome("vllm-a.service", "done", 0, True, True)))
    assert sim.state() is State.STARTING and "a" in sim.core.drains
    acts = sim.tick(116, a=obs("a", 116, u=new, s=sample(gen=1)))
    assert sim.state() is State.HEALTHY and rules(acts) == ["D10"] and not sim.core.drains


def test_a_replica_that_hangs_while_draining_is_restarted_as_hung_and_the_request_answered():
    sim = Sim(proxied(unresponsive_after_s=10))
    sim.tick(98)
    asked(sim)
    sim.tick(100, a=obs("a", 100, s=BUSY))
    sim.tick(105, a=obs("a", 105, health=TIMEOUT), proxy=ProxyView(frozenset({"a"})))
    acts = sim.tick(110, a=obs("a", 110, health=TIMEOUT), proxy=ProxyView(frozenset({"a"})))
    (r,) = restarts(acts)
    assert r.kind is RestartKind.HANG and r.kill_first
    assert sim.core.drains["a"].phase is Phase.AWAY
    (ans,) = answers(acts)
    assert ans.ok and ans.request_id == "q1"


def test_a_replica_dropped_from_the_config_leaves_the_proxy_d10():
    sim = Sim(proxied())
    sim.core = replace(sim.core, drains={"zz": Drain(Phase.AWAY, 0.0, "old")})
    sim.tick(100)
    assert "zz" not in sim.core.drains


def test_dry_run_never_drains():
    sim = Sim(proxied().model_copy(update={"dry_run": True}))
    sim.tick(98)
    asked(sim)
    acts = sim.tick(100, a=obs("a", 100, s=BUSY))
    assert not sim.core.drains and answers(acts)[0].ok and "DRY-RUN" in answers(acts)[0].message


# --- the memory guard's lowerings drain first (M15, D7) -------------------------------------------

class MemBox:
    """test_tick's fake-clocked box with [proxy] on and the proxy's report in each observation."""

    def __init__(self, critical_gib: float = 3) -> None:
        from test_tick import config

        base = config()
        self.cfg = base.model_copy(update={
            "proxy": ProxyConfig(drain_command=["/bin/true"], drain_timeout_s=DRAIN_S, stop_timeout_s=30),
            "memory": base.memory.model_copy(update={"critical_headroom_bytes": int(critical_gib * 2**30)}),
        })
        self.state = tick.TickState()
        self.actions: list = []

    def step(self, t: float, headroom_gib: float | None = None, a=None, applied=None) -> list:
        from guardian.core.observations import TickObservation
        from test_tick import memory

        reps = {r.name: replace((a if r.name == "a" and a is not None else obs(r.name, t)), at=t) for r in self.cfg.replicas}
        view = ProxyView(frozenset(applied if applied is not None else self.state.proxy_down))
        mem = memory(headroom_gib) if headroom_gib is not None else memory(20)
        self.state, acts = tick.decide(self.state, TickObservation(reps, PersistentView(), mem, view), t, self.cfg)
        self.actions += acts
        return acts


def lowerings(actions):
    from guardian.core.actions import LowerFraction
    return [a for a in actions if isinstance(a, LowerFraction)]


def test_a_lowering_waits_for_its_replicas_drain_then_restarts_it_with_a_bounded_stop():
    box = MemBox()
    box.step(100)
    acts = box.step(110, 5, a=obs("a", 110, s=BUSY), applied=set())
    assert not lowerings(acts) and box.state.mem.rule == "M15"
    assert box.state.drains["a"].for_memory and box.state.drains["a"].phase is Phase.DRAINING
    acts = box.step(112, 5, a=obs("a", 112, s=sample(gen=2, running=3)))  # the proxy has it down; 3 still running
    assert not lowerings(acts)
    acts = box.step(114, 5, a=obs("a", 114, s=sample(gen=3)))  # drained
    (low,) = lowerings(acts)
    assert (low.replica, low.restart, low.stop_timeout_s) == ("a", True, 30)
    assert box.state.drains["a"].phase is Phase.AWAY and "D7" in rules(acts)
    # one line for the M15 wait over all those ticks
    assert [a.rule for a in box.actions if isinstance(a, LogLine) and a.rule == "M15"] == ["M15"]


def test_a_squeeze_that_ends_during_the_drain_marks_the_replica_up_again():
    box = MemBox()
    box.step(100)
    box.step(110, 5, a=obs("a", 110, s=BUSY))
    acts = box.step(112, 20, a=obs("a", 112, s=sample(gen=2, running=3)))
    assert not box.state.drains and "D7" in rules(acts) and not lowerings(acts)


def test_a_critical_squeeze_lowers_at_once_and_marks_the_replica_down_as_it_restarts():
    box = MemBox(critical_gib=6)
    box.step(100)
    acts = box.step(110, 5, a=obs("a", 110, s=BUSY))
    (low,) = lowerings(acts)
    assert low.stop_timeout_s is None and box.state.drains["a"].phase is Phase.AWAY and "D9" in rules(acts)
    line = next(a for a in acts if isinstance(a, LogLine) and a.rule == "M16")
    assert "not drained (critical)" in line.message


def test_without_the_proxys_report_no_daemon_would_finish_a_drain_so_it_restarts_at_once():
    """`guardian restart` with no daemon running decides alone: the observation has no ProxyView."""
    sim = Sim(proxied())
    sim.tick(98)
    asked(sim)
    from guardian.core.observations import TickObservation
    observations = {r.name: obs(r.name, 100) for r in sim.cfg.replicas}
    _state, acts = tick.decide(sim.core, TickObservation(observations, sim.persistent), 100, sim.cfg)
    assert restarts(acts) and not _state.drains
