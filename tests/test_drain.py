"""Draining through the proxy (core/proxy/drain.py, D1-D16) as the tick applies it: table rows before, at
and after each threshold, with a fake clock. Assertions name rule ids, not wording."""

from __future__ import annotations

from dataclasses import replace

import pytest

from guardian.core.actions import LogLine, RequestWaits, SyncProxy, WarmUp
from guardian.core.proxy.drainstate import Drain, Phase
from guardian.core.observations import ProxyView, RestartOutcome, RestartRequest, WarmupResult
from guardian.core.vocab import Decision, Priority, RestartKind, State
from harness import (
    said,
    DRAIN_S, GiB, TIMEOUT, Box, answers, cfg, lowerings, memory, obs, restarts, rules, sample, unit, with_memory,
    with_proxy,
)

# The boxes here are behind a proxy (harness.with_proxy): each tick carries the proxy's report,
# which by default says it applied what the tick asked (harness.Box).


def asked(box: Box, rid: str = "q1", replica: str = "a", at: float = 100.0) -> None:
    box.persistent = replace(box.persistent, requests=(RestartRequest(rid, replica, at),))


def proxy_rules(actions) -> list[str | None]:
    return rules(actions, Decision.PROXY)


def refused_rules(actions) -> list[str | None]:
    return rules(actions, Decision.REFUSED)


BUSY = sample(gen=1, running=3, waiting=1)


def draining(t0: float = 100.0, load=BUSY) -> Box:
    """Both replicas serve; an operator asks to restart a, which has 3 running and 1 waiting."""
    box = Box(with_proxy(cfg(2)))
    box.tick(t0 - 2, a=obs("a", t0 - 2, s=sample(gen=0)))
    asked(box, at=t0)
    acts = box.tick(t0, a=obs("a", t0, s=load))
    assert proxy_rules(acts) == ["D1"] and not restarts(acts) and not answers(acts)
    assert box.core.drains["a"].phase is Phase.DRAINING
    return box


def confirmed(box: Box, t: float, s=BUSY) -> list:
    return box.tick(t, a=replace(obs("a", t, s=s)), proxy=ProxyView(frozenset({"a"})))


def test_without_a_proxy_a_planned_restart_is_immediate():
    box = Box(cfg(2), proxy_reports=True)  # a report, but no [proxy] configured: it is not drained
    box.tick(98)
    asked(box)
    acts = box.tick(100)
    assert restarts(acts) and not box.core.drains


def test_a_planned_restart_drains_first_d1():
    draining()


def test_with_no_other_replica_configured_it_restarts_at_once_not_drained_and_bounded_d2():
    box = Box(with_proxy(cfg(1)))
    box.tick(98)
    asked(box)
    acts = box.tick(100)
    assert proxy_rules(acts) == ["D2"] and not box.core.drains
    (r,) = restarts(acts)
    assert r.stop_timeout_s == 30 and not r.kill_first  # undrained, and bounded all the same


def test_asked_with_no_drain_it_restarts_at_once_though_a_peer_serves_d2():
    box = Box(with_proxy(cfg(2)))
    box.tick(98)
    box.persistent = replace(box.persistent, requests=(RestartRequest("q1", "a", 100.0, no_drain=True),))
    acts = box.tick(100)
    assert proxy_rules(acts) == ["D2"] and not box.core.drains
    (r,) = restarts(acts)
    assert r.stop_timeout_s == 30
    assert "--no-drain" in next(a for a in said(acts) if a.rule == "D2").message


def test_with_its_peer_not_serving_an_operators_restart_is_refused_at_once_never_undrained_d3():
    box = Box(with_proxy(cfg(2)))
    stopped = obs("b", 98, u=unit("vllm-b.service", active_state="inactive"))
    box.tick(98, b=stopped)
    asked(box)
    acts = box.tick(100, b=replace(stopped, at=100))
    assert not restarts(acts) and not box.core.drains and refused_rules(acts) == ["D3"]
    (ans,) = answers(acts)
    assert not ans.ok and "b is stopped" in ans.message and "--no-drain" in ans.message


def test_with_wait_it_waits_for_its_peer_and_drains_once_the_peer_serves_d3():
    box = Box(with_proxy(cfg(2)))
    stopped = obs("b", 98, u=unit("vllm-b.service", active_state="inactive"))
    box.tick(98, b=stopped)
    box.persistent = replace(box.persistent, requests=(RestartRequest("q1", "a", 100.0, wait_until=160.0),))
    for t in (100.0, 102.0, 104.0):
        acts = box.tick(t, b=replace(stopped, at=t))
        assert not restarts(acts) and not answers(acts) and not box.core.drains, t
    waits = [a for a in box.actions if isinstance(a, RequestWaits)]
    assert len(waits) == 1 and "b is stopped" in waits[0].text and "(D3)" in waits[0].text
    acts = box.tick(106.0, b=obs("b", 106.0))  # b serves again
    assert proxy_rules(acts) == ["D1"] and box.core.drains["a"].phase is Phase.DRAINING


@pytest.mark.parametrize("late_s, drained", [
    (1.1, True),    # b's /metrics in flight for 1.1 s: degraded, still serving (issue 35's undrained restart)
    (12.0, True),   # /metrics has not answered for 12 s, but /health answers in time: serving
])
def test_a_peer_whose_metrics_are_late_still_serves_so_the_restart_drains_d1(late_s, drained):
    box = Box(with_proxy(cfg(2)))
    box.tick(98)
    late = replace(obs("b", 100), metrics_probe=replace(TIMEOUT, error=f"no answer yet (in flight for {late_s} s)"),
                   metrics=None)
    box.tick(99, b=replace(late, at=99))
    asked(box)
    acts = box.tick(100, b=late)
    assert box.tracks["b"].state is State.DEGRADED
    assert (proxy_rules(acts) == ["D1"]) == drained and not restarts(acts)


def test_a_peer_degraded_by_a_503_or_a_failed_canary_does_not_serve_d3():
    box = Box(with_proxy(cfg(2)))
    box.tick(98)
    dead = obs("b", 100, health=replace(TIMEOUT, status=503, error="HTTP 503"))
    asked(box)
    acts = box.tick(100, b=dead)
    assert refused_rules(acts) == ["D3"] and not restarts(acts)


def test_nothing_is_restarted_before_the_proxy_confirms_the_drain():
    box = draining()
    acts = box.tick(102, a=obs("a", 102, s=sample(gen=1)), proxy=ProxyView(frozenset()))  # queue empty, not applied
    assert not restarts(acts) and box.core.drains["a"].confirmed_at is None


@pytest.mark.parametrize("running, waiting, restarted", [(1, 0, False), (0, 1, False), (0, 0, True)])
def test_restarted_once_no_request_is_left_d6(running, waiting, restarted):
    box = draining()
    confirmed(box, 102)
    acts = confirmed(box, 104, s=sample(gen=2, running=running, waiting=waiting))
    assert bool(restarts(acts)) == restarted
    if restarted:
        (r,) = restarts(acts)
        assert (r.request_id, r.kind, r.kill_first, r.stop_timeout_s) == ("q1", RestartKind.OPERATOR, False, 30)
        assert box.core.drains["a"].phase is Phase.AWAY


@pytest.mark.parametrize("waited, restarted", [(DRAIN_S - 0.5, False), (DRAIN_S, True), (DRAIN_S + 1, True)])
def test_drain_timeout_boundary_d7(waited, restarted):
    box = draining()
    confirmed(box, 102)  # the timer starts when the proxy has it down
    confirmed(box, 130, s=sample(gen=50, running=3, waiting=1))  # tokens flow: long streams, not a stall
    acts = confirmed(box, 102 + waited, s=sample(gen=100, running=3, waiting=1))
    assert bool(restarts(acts)) == restarted
    if restarted:
        line = next(a for a in said(acts) if a.decision is Decision.RESTART)
        assert "3 running, 1 waiting" in line.message and "(D7)" in line.message


def test_a_proxy_that_cannot_mark_it_down_blocks_the_planned_restart_d4():
    box = draining()
    acts = box.tick(102, a=obs("a", 102, s=BUSY), proxy=ProxyView(frozenset(), frozenset({"a"}), "exit status 1"))
    assert not restarts(acts) and "a" not in box.core.drains
    assert refused_rules(acts) == ["D4"]
    (ans,) = answers(acts)
    assert not ans.ok and "exit status 1" in ans.message


def test_a_drain_is_given_up_when_the_other_replica_stops_serving_d5():
    box = draining()
    confirmed(box, 102)
    gone = obs("b", 104, u=unit("vllm-b.service", active_state="failed"))
    acts = box.tick(104, a=obs("a", 104, s=BUSY), b=gone, proxy=ProxyView(frozenset({"a"})))
    assert refused_rules(acts) == ["D5"] and "a" not in box.core.drains and not restarts(acts)
    assert not answers(acts)[0].ok


def test_a_restart_refused_when_the_drain_ends_marks_it_up_again_d8():
    box = draining()
    confirmed(box, 102)
    box.persistent = replace(box.persistent, restarts={"a": (90.0, 95.0, 99.0)})  # budget spent meanwhile
    acts = confirmed(box, 104, s=sample(gen=2))
    assert not restarts(acts) and "a" not in box.core.drains
    (ans,) = answers(acts)
    assert not ans.ok and "(D9)" in ans.message


def test_another_planned_restart_waits_while_one_replica_drains():
    box = draining()
    box.persistent = replace(box.persistent, requests=(RestartRequest("q1", "a", 100), RestartRequest("q2", "b", 101)))
    acts = confirmed(box, 102)
    (ans,) = answers(acts)
    assert (ans.request_id, ans.ok) == ("q2", False) and "one-at-a-time" in ans.message


def test_a_hung_replica_is_marked_down_with_its_restart_and_up_once_it_serves_d8_d10():
    box = Box(with_proxy(cfg(2, unresponsive_after_s=10)))
    box.tick(100)
    box.tick(105, a=obs("a", 105, health=TIMEOUT))
    acts = box.tick(110, a=obs("a", 110, health=TIMEOUT))
    assert restarts(acts)[0].kill_first and proxy_rules(acts) == ["D10"]
    assert box.core.drains["a"].phase is Phase.AWAY
    # the restart job is under way, then done; the new process loads
    acts = box.tick(112, a=obs("a", 112, health=TIMEOUT))
    assert "a" in box.core.drains and not proxy_rules(acts)
    new = unit(inactive_exit_mono=111.0)
    acts = box.tick(114, a=obs("a", 114, health=TIMEOUT, u=new, outcome=RestartOutcome("vllm-a.service", "done", True, True)))
    assert box.state() is State.STARTING and "a" in box.core.drains
    acts = box.tick(116, a=obs("a", 116, u=new, s=sample(gen=1)))
    assert box.state() is State.HEALTHY and proxy_rules(acts) == ["D11"] and not box.core.drains


def test_a_replica_that_hangs_while_draining_is_restarted_as_hung_and_the_request_answered():
    box = Box(with_proxy(cfg(2, unresponsive_after_s=10)))
    box.tick(98)
    asked(box)
    box.tick(100, a=obs("a", 100, s=BUSY))
    box.tick(105, a=obs("a", 105, health=TIMEOUT), proxy=ProxyView(frozenset({"a"})))
    acts = box.tick(110, a=obs("a", 110, health=TIMEOUT), proxy=ProxyView(frozenset({"a"})))
    (r,) = restarts(acts)
    assert r.kind is RestartKind.HANG and r.kill_first
    assert box.core.drains["a"].phase is Phase.AWAY
    (ans,) = answers(acts)
    assert ans.ok and ans.request_id == "q1"


def test_a_replica_dropped_from_the_config_leaves_the_proxy_d11():
    box = Box(with_proxy(cfg(2)))
    box.core = replace(box.core, drains={"zz": Drain(Phase.AWAY, 0.0, "old")})
    box.tick(100)
    assert "zz" not in box.core.drains


def test_dry_run_never_drains():
    box = Box(with_proxy(cfg(2)).model_copy(update={"dry_run": True}))
    box.tick(98)
    asked(box)
    acts = box.tick(100, a=obs("a", 100, s=BUSY))
    assert not box.core.drains and answers(acts)[0].ok and "DRY-RUN" in answers(acts)[0].message


# --- the memory guard's lowerings drain first (M16, D8) -------------------------------------------

def mem_box(critical_gib: float = 3) -> Box:
    """A box with the memory guard on (critical below CRITICAL_GIB) behind a proxy; 20 GiB of
    headroom (not squeezed) at every tick that is given no memory observation."""
    return Box(with_proxy(with_memory(cfg(2), critical_headroom_bytes=int(critical_gib * GiB))), memory=memory(20))


def test_a_lowering_waits_for_its_replicas_drain_then_restarts_it_with_a_bounded_stop():
    box = mem_box()
    box.tick(100)
    acts = box.tick(110, memory=memory(5), a=obs("a", 110, s=BUSY), proxy=ProxyView(frozenset()))
    assert not lowerings(acts) and box.core.mem.rule == "M16"
    assert box.core.drains["a"].for_memory and box.core.drains["a"].phase is Phase.DRAINING
    # the proxy has it down; 3 requests still running
    acts = box.tick(112, memory=memory(5), a=obs("a", 112, s=sample(gen=2, running=3)))
    assert not lowerings(acts)
    acts = box.tick(114, memory=memory(5), a=obs("a", 114, s=sample(gen=3)))  # drained
    (low,) = lowerings(acts)
    assert (low.replica, low.restart, low.stop_timeout_s) == ("a", True, 30)
    assert box.core.drains["a"].phase is Phase.AWAY and "D8" in proxy_rules(acts)
    # one line for the M16 wait over all those ticks
    assert [a.rule for a in box.actions if isinstance(a, LogLine) and a.rule == "M16"] == ["M16"]


def test_a_squeeze_that_ends_during_the_drain_marks_the_replica_up_again():
    box = mem_box()
    box.tick(100)
    box.tick(110, memory=memory(5), a=obs("a", 110, s=BUSY))
    acts = box.tick(112, memory=memory(20), a=obs("a", 112, s=sample(gen=2, running=3)))
    assert not box.core.drains and "D8" in proxy_rules(acts) and not lowerings(acts)


def test_a_critical_squeeze_lowers_at_once_and_marks_the_replica_down_as_it_restarts():
    box = mem_box(critical_gib=6)
    box.tick(100)
    acts = box.tick(110, memory=memory(5), a=obs("a", 110, s=BUSY))
    (low,) = lowerings(acts)
    # not drained, but its stop is bounded as every planned one (issue 35 item 5)
    assert low.stop_timeout_s == 30 and box.core.drains["a"].phase is Phase.AWAY and "D10" in proxy_rules(acts)
    line = next(a for a in acts if isinstance(a, LogLine) and a.rule == "M17")
    assert "not drained (critical)" in line.message


def test_without_the_proxys_report_no_daemon_would_finish_a_drain_so_it_restarts_at_once():
    """`guardian restart` with no daemon running decides alone: the observation has no ProxyView."""
    box = Box(with_proxy(cfg(2)))
    box.tick(98)
    asked(box)
    box.proxy_reports = False
    acts = box.tick(100)
    assert restarts(acts) and not box.core.drains


def test_every_tick_behind_a_proxy_ends_by_telling_it_the_whole_set_marked_down():
    box = draining()
    assert box.tick(101, a=obs("a", 101, s=BUSY))[-1] == SyncProxy(frozenset({"a"}))
    assert not [a for a in Box(cfg(2)).tick(100) if isinstance(a, SyncProxy)]  # no proxy: nothing to tell


def test_a_request_with_a_wait_refused_by_a_passing_rule_when_its_drain_ends_is_marked_up_and_waits_a4():
    """Drained, then admission says back-off (A2: a restart of a was recorded meanwhile): with a wait
    not over, the request is not refused (D9) but marked up and waits as asked; without one, D9."""
    box = draining()
    box.persistent = replace(box.persistent, requests=(RestartRequest("q1", "a", 100.0, 1000.0),))
    confirmed(box, 102)
    box.persistent = replace(box.persistent, restarts={"a": (103.0,)})
    acts = confirmed(box, 104, s=sample(gen=2))
    assert not restarts(acts) and not answers(acts) and "a" not in box.core.drains
    said = [line for line in box.lines(Decision.REQUEST) if line.rule == "A4"]
    assert [line.message.split(": ", 1)[1].split(":")[0] for line in said] == [
        "drained, but its restart waits", "an operator's restart waits"]
    assert all("(A2)" in line.message for line in said), said
    assert [a.request_id for a in acts if isinstance(a, RequestWaits)] == ["q1"]
    acts = box.tick(106, a=obs("a", 106, s=sample(gen=3)))
    assert not answers(acts) and not restarts(acts) and "a" not in box.core.drains  # still waiting, not drained


# --- warm before traffic returns (issue 33 item 2: D13-D16) ------------------------------------------

def warm_box(timeout_s: float = 30.0) -> Box:
    """a hung and restarted behind the proxy, with a warm-up file; back at t=116 (D13 sends it)."""
    c = with_proxy(cfg(2, unresponsive_after_s=10))
    reps = [r.model_copy(update={"warmup_file": "/etc/vllm/warmup.jsonl", "warmup_timeout_s": timeout_s})
            if r.name == "a" else r for r in c.replicas]
    box = Box(c.model_copy(update={"replicas": reps}))
    box.tick(100)
    box.tick(105, a=obs("a", 105, health=TIMEOUT))
    box.tick(110, a=obs("a", 110, health=TIMEOUT))
    new = unit(inactive_exit_mono=111.0)
    box.tick(114, a=obs("a", 114, health=TIMEOUT, u=new, outcome=RestartOutcome("vllm-a.service", "done", True, True)))
    acts = box.tick(116, a=obs("a", 116, u=new, s=sample(gen=1)))
    assert box.state() is State.HEALTHY and proxy_rules(acts) == ["D13"] and "a" in box.core.drains
    (warm,) = [x for x in acts if isinstance(x, WarmUp)]
    assert (warm.replica, warm.started_at, warm.timeout_s) == ("a", 116, timeout_s)
    return box


NEW = unit(inactive_exit_mono=111.0)


@pytest.mark.parametrize(
    "result, rule, priority",
    [
        (WarmupResult(116, 3, 0, 0.4), "D14", Priority.INFO),
        (WarmupResult(116, 2, 1, 0.4, "request 3: HTTP 400"), "D14", Priority.WARNING),
        # issue 41 row 5: a warm-up that raised (act/executor.py makes it this result)
        (WarmupResult(116, 0, 0, 0.0, "the warm-up raised RuntimeError: x"), "D14", Priority.WARNING),
        (WarmupResult(90, 3, 0, 0.4), None, None),  # an earlier warm-up's result: not this drain's
    ],
)
def test_a_replica_with_a_warmup_is_marked_up_once_its_warmup_ended_d13_d14(result, rule, priority):
    box = warm_box()
    acts = box.tick(117, a=obs("a", 117, u=NEW, s=sample(gen=2)))
    assert not proxy_rules(acts) and not [x for x in acts if isinstance(x, WarmUp)]  # sent once, waits
    acts = box.tick(118, a=replace(obs("a", 118, u=NEW, s=sample(gen=3)), warmup=result))
    assert proxy_rules(acts) == ([rule] if rule else [])
    assert ("a" in box.core.drains) is (rule is None)
    if rule:
        (line,) = [x for x in said(acts) if x.decision is Decision.PROXY]
        assert line.priority is priority


@pytest.mark.parametrize("t, marked_up", [(116 + 30 + 2 - 0.1, False), (116 + 30 + 2, True)])
def test_a_warmup_that_never_ends_is_marked_up_at_its_bound_d15(t, marked_up):
    box = warm_box()
    acts = box.tick(t, a=obs("a", t, u=NEW, s=sample(gen=2)))
    assert proxy_rules(acts) == (["D15"] if marked_up else [])
    if marked_up:
        (line,) = [x for x in said(acts) if x.decision is Decision.PROXY]
        assert line.priority is Priority.WARNING and "did not end within 30 s" in line.message


def test_a_replica_without_a_warmup_file_is_marked_up_at_once_d11():
    box = Box(with_proxy(cfg(2)))
    box.core = replace(box.core, drains={"a": Drain(Phase.AWAY, 90.0, "restart")})
    acts = box.tick(100)
    assert proxy_rules(acts) == ["D11"] and not [x for x in acts if isinstance(x, WarmUp)]


def test_a_replica_that_hangs_while_it_warms_is_not_marked_up_and_warms_again_once_back_d16():
    box = warm_box()
    # it hangs before its warm-up ends (no answer past unresponsive_after_s): restarted, still down
    seen = proxy_rules(box.tick(120, a=obs("a", 120, health=TIMEOUT, u=NEW)))
    seen += proxy_rules(box.tick(131, a=replace(obs("a", 131, health=TIMEOUT, u=NEW),
                                                  warmup=WarmupResult(116, 0, 3, 4.0, "x"))))
    assert "D16" in seen and "D14" not in seen and "D15" not in seen, seen
    assert "a" in box.core.drains and box.core.drains["a"].warm_from is None
    for t in (150, 160):  # long past the warm-up's bound: still down, never D15
        assert "D15" not in proxy_rules(box.tick(t, a=obs("a", t, health=TIMEOUT, u=NEW)))
        assert "a" in box.core.drains


@pytest.mark.parametrize("unread, says", [
    (False, "restarted once its 3 running and 1 waiting requests end or after"),
    (True, "restarted once its requests end (how many is not known: its /metrics was not read) or after"),
])
def test_the_drain_line_reads_right_whether_or_not_its_work_is_known(unread, says):
    """Issue 45 item 6: built from parts, it once read "restarted once its an unknown number of requests end"."""
    box = Box(with_proxy(cfg(2)))
    box.tick(98.0, a=obs("a", 98.0, s=sample(gen=0)))
    asked(box, at=100.0)
    acts = box.tick(100.0, a=obs("a", 100.0, s=BUSY, metrics_down=unread))
    lines = [a for a in acts if isinstance(a, LogLine) and a.rule == "D1"]
    assert len(lines) == 1 and says in lines[0].message, lines
