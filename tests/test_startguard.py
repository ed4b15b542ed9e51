"""The start guard (core/memory/startguard.py, S1-S10): a start that takes the box below the critical
headroom is stopped and restarted a step lower. Its rows alone (startguard.decide on a fake clock),
then through the real tick (harness.Box): the look interval, admission, the memory guard's
following of the change, and never a unit that is not a configured replica."""

from __future__ import annotations

from dataclasses import replace

import pytest

from guardian.config import MemoryConfig
from guardian.core.memory import startguard
from guardian.core import tick
from guardian.core.actions import LogLine, RestartUnit, SetFraction
from guardian.core.memory.memguard import Pending
from guardian.core.observations import (
    MemoryObservation, MemorySample, PersistentView, Probe, ReplicaMemoryObservation, RestartOutcome,
)
from guardian.core.rules import Refusal
from guardian.core.memory.startguard import CGROUP, FALL, NVML, StartView, Starting
from guardian.core.vocab import Decision, Gate, Priority, State
from harness import TOTAL, Box, GiB, cfg, lines, obs, unit, wired, with_memory
from harness import run_startguard as run

CRITICAL = 3 * GiB  # with_memory's critical line
REFUSED = Probe(False, None, 0.0, "connection refused")  # a replica that is loading binds no port yet


def config(**memory):
    """Replicas a and b, the memory guard on as harness.with_memory has it (critical 3 GiB, step 0.04,
    floor 0.5, 1 GiB reserve); the start guard on by default."""
    return with_memory(cfg(2), **memory)


def starting(name="b", *, loading=True, start=("i1", 100.0), fraction=0.9, wiring=None, nvml=None, cgroup=None,
             refusal=None) -> Starting:
    return Starting(name, f"vllm-{name}.service", loading, start, fraction, wiring, nvml_bytes=nvml,
                    cgroup_bytes=cgroup, refusal=refusal)


def view(headroom_gib: float, *replicas: Starting, pending: Pending | None = None) -> StartView:
    return StartView(int(headroom_gib * GiB), TOTAL, replicas or (starting(),),
                     "build.service 20.0 GiB, vllm-b.service 90.0 GiB, make (pid 9) 3.0 GiB", pending)


def stops(actions) -> list[SetFraction]:
    return [a for a in actions if isinstance(a, SetFraction)]


def said(actions) -> list[str]:
    return [a.rule for a in actions if isinstance(a, LogLine)]


# A start that grows by G GiB while headroom falls from 100 GiB to H GiB, measured by its cgroup.
def grows(headroom_gib: float, grown_gib: float, **kw) -> list:
    first = starting(cgroup=int(0.5 * GiB), **kw)
    then = replace(first, cgroup_bytes=int((0.5 + grown_gib) * GiB))
    return [(100.0, view(100, first)), (110.0, view(headroom_gib, then))]


# --- the rows, one at a time ----------------------------------------------------------------------------

@pytest.mark.parametrize("headroom_gib, rule", [(3.0, None), (2.99, "S10")])  # S3: strictly below the line
def test_critical_is_strictly_below_the_line(headroom_gib, rule):
    starts, every = run(config(), grows(headroom_gib, 97))
    assert said(every) == ([rule] if rule else [])
    assert starts["b"].rule == (rule or "S3")
    assert bool(stops(every)) == bool(rule)


@pytest.mark.parametrize("grown_gib, rule", [
    (49.0, "S10"),  # the fall is 98 GiB: growth of exactly half of it is the replica's doing
    (48.99, "S4"),  # less than half: something else takes the memory
    (0.0, "S4"),
    (-1.0, "S4"),
])
def test_the_replica_is_the_one_growing_when_it_grew_at_least_half_the_fall(grown_gib, rule):
    # a floor of 0.1: what half the fall frees fits a lower fraction, so S4 alone decides
    _, every = run(config(floor=0.1, reserve_bytes=0), grows(2, grown_gib))
    assert said(every) == [rule]
    assert bool(stops(every)) == (rule == "S10")


def test_nvml_is_asked_before_the_cgroup_and_the_cgroup_before_the_fall():
    both = starting(nvml=0, cgroup=0)
    # NVML lists its processes: it grew 90 GiB there; its cgroup (host side only on a GB10) barely moved
    _, every = run(config(), [(100.0, view(100, both)), (110.0, view(2, replace(both, nvml_bytes=90 * GiB,
                                                                                  cgroup_bytes=GiB // 10)))])
    assert said(every) == ["S10"] and f"({NVML})" in lines(every)[0].message
    # NVML lists nothing for it: the cgroup decides, and it barely moved
    quiet = replace(both, nvml_bytes=None, cgroup_bytes=GiB // 10)
    _, every = run(config(), [(100.0, view(100, both)), (110.0, view(2, quiet))])
    assert said(every) == ["S4"] and f"({CGROUP})" in lines(every)[0].message
    # neither (a container replica, no NVML): the headroom's fall is taken as its growth
    bare = starting()
    _, every = run(config(), [(100.0, view(100, bare)), (110.0, view(2, bare))])
    assert said(every) == ["S10"] and f"({FALL})" in lines(every)[0].message


@pytest.mark.parametrize("first_gib, then_gib, rules", [
    (100, 2.0, ["S10"]),  # with no measure of its own, the whole fall is taken as its growth
    (3.0, 2.9, ["S7"]),  # at the line (not below it) at the first look, then under it: judged (no fit here)
    (2.5, 2.5, []),  # already below the line at the first look: this start did not take it there (S3)
    (2.5, 1.0, []),  # ... however far it falls: the squeeze rules act on a box already critical
])
def test_with_the_fall_alone_the_start_must_take_the_box_under_the_line(first_gib, then_gib, rules):
    bare = starting()
    _, every = run(config(), [(100.0, view(first_gib, bare)), (110.0, view(then_gib, bare))])
    assert said(every) == rules


def test_a_critical_lowerings_own_start_is_not_stopped():
    """Through the tick: the box is already under the critical line when a's lowering restarts it
    (the fit check chose its fraction); its start takes some more: no stop, no walk down to the
    floor (found in the memory system test)."""
    box = loading_box(config(), headroom_gib=2.5)
    box.tick(205.0, memory=mem(2.2, 0.5), b=b_loading(205.0))
    box.tick(206.0, memory=mem(2.0, 0.8), b=b_loading(206.0))
    assert not [s for s in box.of(SetFraction) if s.kill_first]
    assert not [line for line in box.lines() if line.rule and line.rule.startswith("S")]


@pytest.mark.parametrize("critical, rules", [(True, []), (False, ["S7"])])  # S7: judged (no fit for 0.4 GiB held)
def test_a_critical_lowerings_start_is_left_alone_though_the_kill_lifted_headroom_over_the_line(critical, rules):
    """The memory guard lowered b under the critical line; killing b's old process lifted headroom
    just over it by the start's first look, and the squeeze went on (a hog, not b: no measure of b's
    own here). That start is the critical answer already (S3), not one that took the box under the
    line; a lowering decided above the line gets no such pass (found by the memory system test in CI)."""
    own = Pending("b", 0.94, 0.9, 90.0, critical=critical)
    bare = starting()
    _, every = run(config(), [(100.0, view(3.2, bare, pending=own)), (110.0, view(2.8, bare, pending=own))])
    assert said(every) == rules


def test_the_first_look_only_records():
    """Below the line already at a start's first look: nothing is known of its growth yet."""
    starts, every = run(config(), [(100.0, view(1, starting(cgroup=50 * GiB)))])
    assert every == [] and starts["b"].rule == "S1"  # the record carries its rule until S2-S10 judge it
    assert (starts["b"].headroom_bytes, starts["b"].cgroup_bytes, starts["b"].seen_at) == (GiB, 50 * GiB, 100.0)


@pytest.mark.parametrize("kw, rule", [
    (dict(wiring="vllm-b.service does not read guardian's env file last"), "S5"),
    (dict(fraction=None), "S5"),
    (dict(fraction=0.5), "S6"),  # at the floor
    (dict(fraction=0.49), "S6"),  # below it (set by hand)
])
def test_unwired_unknown_or_at_the_floor_kills_nothing_and_says_so_at_critical(kw, rule):
    _, every = run(config(), grows(2, 97, **kw))
    (line,) = lines(every)
    assert (line.rule, line.priority, line.decision) == (rule, Priority.CRITICAL, Decision.MEMORY_NOTE)
    assert stops(every) == []
    assert "is not stopped" in line.message


def test_no_fraction_that_fits_kills_nothing_and_says_so_at_critical():
    # 0.6 of 128 GiB; the next that could be written, 0.56 down to the floor 0.5 (64 GiB), must fit in
    # headroom 2 + what it holds 50 - reserve 1 = 51 GiB: none does
    _, every = run(config(), grows(2, 49.5, fraction=0.6))
    (line,) = lines(every)
    assert (line.rule, line.priority) == ("S7", Priority.CRITICAL) and stops(every) == []
    assert "no fraction between 0.56 and the floor 0.5 fits" in line.message


def test_the_fraction_written_is_one_step_lower_or_further_down_until_it_fits():
    # It holds 97.5 GiB, headroom 2 GiB, reserve 1: 0.86 (110 GiB) does not fit in 98.5, 0.76 (97.3) does
    _, every = run(config(), grows(2, 97))
    (stop,) = stops(every)
    assert (stop.old, stop.new) == (0.9, 0.76)
    # Plenty held: exactly one step (M.step 0.04) lower
    _, every = run(config(reserve_bytes=0), grows(2, 97, fraction=0.78))
    assert [(s.old, s.new) for s in stops(every)] == [(0.78, 0.74)]


def test_the_stop_kills_at_once_and_its_line_names_everything():
    _, every = run(config(), grows(2.5, 97))
    (stop,) = stops(every)
    assert (stop.replica, stop.unit, stop.restart, stop.kill_first, stop.retry) == (
        "b", "vllm-b.service", True, True, False)
    (line,) = lines(every)
    assert (line.priority, line.decision, line.rule, line.replica, line.unit) == (
        Priority.WARNING, Decision.MEMORY, "S10", "b", "vllm-b.service")
    m = line.message
    assert "headroom 2.5 GiB < critical 3.0 GiB" in m and "it was 100.0 GiB at this start's first look, 10.0 s ago" in m
    assert f"b grew 97.0 GiB since ({CGROUP}) of the headroom's fall of 97.5 GiB" in m
    assert "largest others: build.service 20.0 GiB, make (pid 9) 3.0 GiB;" in m  # not the replica's own unit
    assert "gpu_memory_utilization 0.9 -> 0.77" in m and "vllm-b.service's processes killed" in m


def test_a_change_of_another_replica_pending_waits_and_of_its_own_does_not():
    other = Pending("a", 0.78, 0.74, 90.0)
    steps = grows(2, 97)
    _, every = run(config(), [(t, replace(v, pending=other)) for t, v in steps])
    assert said(every) == ["S8"] and stops(every) == []
    assert "a change of replica a" in lines(every)[0].message and lines(every)[0].priority == Priority.ERROR
    own = Pending("b", 0.94, 0.9, 90.0)  # the memory guard lowered b, and this is that start
    _, every = run(config(), [(t, replace(v, pending=own)) for t, v in steps])
    assert said(every) == ["S10"]


@pytest.mark.parametrize("refusal, priority", [
    (Refusal(Gate.BACKOFF, "A2", "back-off: last restart 10 s ago, next allowed 60 s after it", key=("backoff",)),
     Priority.ERROR),
    (Refusal(Gate.BUDGET, "A1", "restart budget spent", priority=Priority.CRITICAL, key=("budget",)),
     Priority.CRITICAL),
])
def test_admission_refuses_and_the_refusal_is_said_once_per_start(refusal, priority):
    first = starting(cgroup=0, refusal=refusal)
    steps = [(100.0, view(100, first))] + [(100.0 + i, view(2, replace(first, cgroup_bytes=97 * GiB)))
                                           for i in range(1, 6)]
    starts, every = run(config(), steps)
    (line,) = lines(every)
    assert (line.rule, line.gate, line.priority) == ("S9", refusal.gate, priority)
    assert refusal.reason in line.message and f"({refusal.rule}; S9)" in line.message
    assert stops(every) == [] and starts["b"].rule == "S9"
    # admitted now (the back-off is over): stopped
    starts, every = run(config(), [(110.0, view(2, replace(first, cgroup_bytes=97 * GiB, refusal=None)))], starts)
    assert said(every) == ["S10"] and len(stops(every)) == 1


def test_dry_run_says_what_it_would_do_once_and_does_nothing():
    dry = config().model_copy(update={"dry_run": True})
    steps = grows(2, 97) + [(111.0, grows(2, 97)[1][1]), (112.0, grows(1, 98)[1][1])]
    _, every = run(dry, steps)
    (line,) = lines(every)
    assert (line.rule, line.decision, line.priority) == ("S10", Decision.DRY_RUN, Priority.WARNING)
    assert line.message.count("DRY-RUN: would stop its start") == 1 and stops(every) == []


def test_a_start_is_stopped_once_and_a_new_start_is_watched_anew():
    steps = grows(2, 97)
    starts, every = run(config(), steps + [(111.0, steps[1][1]), (112.0, steps[1][1])])
    assert said(every) == ["S10"] and len(stops(every)) == 1 and starts["b"].rule == "S2"
    # the next start (another InvocationID): its first look records the headroom and its cgroup anew
    again = starting(start=("i2", 120.0), cgroup=int(0.2 * GiB), fraction=0.76)
    starts, every = run(config(), [(121.0, view(99, again))], starts)
    assert every == [] and starts["b"].headroom_bytes == 99 * GiB and not starts["b"].stopped
    starts, every = run(config(), [(130.0, view(2.9, replace(again, cgroup_bytes=int(96.3 * GiB))))], starts)
    assert [(s.old, s.new) for s in stops(every)] == [(0.76, 0.72)]


def test_a_start_no_longer_loading_is_forgotten_and_one_not_loading_never_watched():
    starts, _ = run(config(), grows(50, 50))
    assert set(starts) == {"b"}
    starts, every = run(config(), [(120.0, view(2, starting(loading=False, cgroup=99 * GiB)))], starts)
    assert starts == {} and every == []


def test_each_start_is_judged_and_a_second_stop_on_one_tick_waits_for_the_first():
    """Two replicas loading at once (systemd and an operator started both): the first stopped is the
    memory guard's pending change, so the other waits for it (S8)."""
    a0, b0 = starting("a", cgroup=0, fraction=0.45 + 0.1), starting("b", cgroup=0, fraction=0.55)
    a1, b1 = replace(a0, cgroup_bytes=50 * GiB), replace(b0, cgroup_bytes=50 * GiB)
    _, every = run(config(reserve_bytes=0, floor=0.1), [(100.0, view(102, a0, b0)), (110.0, view(2, a1, b1))])
    assert said(every) == ["S10", "S8"] and [s.replica for s in stops(every)] == ["a"]


def test_may_be_loading_is_a_superset_of_the_watched_starts():
    now = 1000.0
    loading = obs("b", now, health=REFUSED, u=unit("vllm-b.service", inactive_exit_mono=990.0))
    assert startguard.may_be_loading(loading, 1200, now)
    assert not startguard.may_be_loading(loading, 5, now)  # past its startup grace
    assert startguard.may_be_loading(replace(loading, unit=unit("vllm-b.service", active_state="activating")), 5, now)
    assert not startguard.may_be_loading(obs("b", now, u=unit("vllm-b.service", inactive_exit_mono=990.0)), 1200, now)
    assert not startguard.may_be_loading(replace(loading, unit=unit("vllm-b.service", active_state="failed")), 1200, now)
    assert not startguard.may_be_loading(replace(loading, unit=None), 1200, now)


# --- through the real tick ----------------------------------------------------------------------------

def mem(headroom_gib: float, b_cgroup_gib: float | None = None, b=0.9, **extra: ReplicaMemoryObservation):
    """The memory observation: HEADROOM_GIB available of TOTAL; a at 0.5, b at B (its env file), b's
    unit's MemoryCurrent B_CGROUP_GIB (None: not asked); EXTRA: observations of other names."""
    s = MemorySample(TOTAL, int(headroom_gib * GiB), int(headroom_gib * GiB), None, None)
    cgroup = int(b_cgroup_gib * GiB) if b_cgroup_gib is not None else None
    return MemoryObservation(s, TOTAL, {
        "a": ReplicaMemoryObservation(0.5, None, None, wired("a")),
        "b": ReplicaMemoryObservation(b, None, None, wired("b"), cgroup_bytes=cgroup),
        **extra,
    }, consumers="build.service 20.0 GiB")


def b_loading(t: float, since: float = 200.0, invocation: str = "i1", outcome=None, **kw):
    """b's unit active since SINCE (a new start), nothing answering on its port yet; KW: the unit's."""
    return obs("b", t, health=REFUSED, outcome=outcome,
               u=unit("vllm-b.service", inactive_exit_mono=since, invocation_id=invocation, **kw))


def loading_box(config, persistent=None, headroom_gib=100.0) -> Box:
    """a and b serving at 100 s; b restarted (by systemd, an operator) at 200 s and loading at 201 s."""
    box = Box(config, persistent)
    box.tick(100.0, memory=mem(30))
    box.tick(201.0, memory=mem(headroom_gib, 0.5), b=b_loading(201.0))
    assert box.state("b") == State.STARTING and box.rule("b") == "L6"
    return box


def test_through_the_tick_the_stop_becomes_the_memory_guards_pending_change_and_is_followed():
    box = loading_box(config())
    assert box.core.starts["b"].headroom_bytes == 100 * GiB and box.of(SetFraction) == []
    box.tick(210.0, memory=mem(2.5, 97.5), b=b_loading(210.0))
    (stop,) = box.of(SetFraction)
    assert (stop.replica, stop.old, stop.new, stop.kill_first, stop.restart) == ("b", 0.9, 0.77, True, True)
    assert box.core.mem.pending == Pending("b", 0.9, 0.77, 210.0) and box.core.mem.last_change_at == 210.0
    assert box.tracks["b"].restart_in_flight and box.core.mem.rule == "M3"
    assert box.of(RestartUnit) == []  # the stop is the only restart
    # the restart job: b is down, then starts again with 0.77 (the env file says so) and serves
    box.tick(211.0, memory=mem(90, b=0.77), b=b_loading(211.0, active_state="deactivating"))
    assert box.core.starts == {} and box.core.mem.rule == "M3"  # a stop is not watched as a start
    done = RestartOutcome("vllm-b.service", "done", issued=True, ok=True)
    box.tick(212.0, memory=mem(99, 0.3, b=0.77), b=b_loading(212.0, since=211.5, invocation="i2", outcome=done))
    assert box.core.starts["b"].start == ("i2", 211.5) and not box.core.starts["b"].stopped
    box.tick(260.0, memory=mem(6, b=0.77), b=obs("b", 260.0, u=unit("vllm-b.service", inactive_exit_mono=211.5)))
    assert box.core.mem.rule == "M4" and box.lines(rule="M4")
    assert len(box.of(SetFraction)) == 1 and box.core.starts == {}


def test_through_the_tick_a_failed_start_after_the_stop_is_the_memory_guards_retry():
    box = loading_box(config())
    box.tick(210.0, memory=mem(2.5, 97.5), b=b_loading(210.0))
    done = RestartOutcome("vllm-b.service", "done", issued=True, ok=True)
    box.tick(212.0, memory=mem(99, b=0.77), b=b_loading(212.0, since=211.5, invocation="i2", outcome=done))
    failed = obs("b", 230.0, health=REFUSED, u=unit("vllm-b.service", active_state="failed", inactive_exit_mono=211.5))
    box.tick(230.0, memory=mem(99, b=0.77), b=failed)
    assert box.lines(rule="M7"), "M7 follows the start guard's change as it follows a lowering"


@pytest.mark.parametrize("age_s", [1.0, 59.0, 60.0])
def test_through_the_tick_the_back_off_does_not_hold_the_stop(age_s):
    """b's last restart (guardian's) at 200 s; back-off 60 s: the start of that restart loads inside its
    back-off, and the stop replaces it, adding no start: A2 is not asked (S9 asks A1 only)."""
    box = loading_box(config().model_copy(update={"watchdog": cfg(2, backoff_s=60).watchdog}),
                      PersistentView(restarts={"b": (200.0,)}))
    box.tick(200.0 + age_s, memory=mem(2.5, 97.5), b=b_loading(200.0 + age_s))
    assert [(s.old, s.new, s.kill_first) for s in box.of(SetFraction)] == [(0.9, 0.77, True)]
    assert box.lines(rule="S9") == []


def test_through_the_tick_a_spent_budget_holds_the_stop_at_critical():
    spent = PersistentView(restarts={"b": (150.0, 160.0, 170.0)})  # 3 in the window: the budget
    box = loading_box(config().model_copy(update={"watchdog": cfg(2, backoff_s=0).watchdog}), spent)
    box.tick(210.0, memory=mem(2.5, 97.5), b=b_loading(210.0))
    (line,) = box.lines(rule="S9")
    assert line.priority == Priority.CRITICAL and line.gate == Gate.BUDGET and box.of(SetFraction) == []


def test_never_a_unit_that_is_not_a_configured_replica():
    """While b loads and the box sinks below critical, a stray the config does not have (a replica
    removed by a reload, another service) is the one growing: nothing is stopped, b is not blamed
    (its cgroup did not grow: S4), and the stray is never judged or named as a replica."""
    box = loading_box(config())
    stray = ReplicaMemoryObservation(0.9, 0.9, None, wired("c"), cgroup_bytes=0)
    box.tick(205.0, memory=mem(100, 0.5, x=stray), b=b_loading(205.0))
    box.tick(210.0, memory=mem(2, 0.5, x=replace(stray, cgroup_bytes=98 * GiB)), b=b_loading(210.0))
    assert set(box.core.starts) == {"b"}
    assert [line.rule for line in box.lines() if line.rule and line.rule.startswith("S")] == ["S4"]
    assert [s for s in box.of(SetFraction) if s.kill_first or s.replica == "x"] == []  # the squeeze rules may act
    assert all(line.replica in (None, "a", "b") for line in box.lines())


def test_through_the_tick_the_start_guard_off_watches_nothing():
    box = loading_box(config(start_guard=False))
    box.tick(210.0, memory=mem(2.5, 97.5), b=b_loading(210.0))
    assert box.core.starts == {} and not any(line.rule and line.rule.startswith("S") for line in box.lines())


# --- the look interval ----------------------------------------------------------------------------------

@pytest.mark.parametrize("memory, b_starting, interval_s", [
    (dict(), True, 0.5),  # a start watched: every start_guard_interval_s
    (dict(), False, 2.0),  # nothing starting: interval_s
    (dict(start_guard=False), True, 2.0),
    (None, True, 2.0),  # the memory guard off: no start guard either
    (dict(start_guard_interval_s=0.2), True, 0.2),
    (dict(start_guard_interval_s=5.0), True, 2.0),  # never slower than interval_s
])
def test_ticks_come_every_start_guard_interval_while_a_replica_is_starting(memory, b_starting, interval_s):
    c = cfg(2) if memory is None else config(**memory)
    box = Box(c)
    box.tick(100.0, memory=mem(30) if memory is not None else None)
    b = b_loading(101.0) if b_starting else obs("b", 101.0)
    box.tick(101.0, memory=mem(30, 0.5) if memory is not None else None, b=b)
    assert (box.state("b") == State.STARTING) == b_starting
    assert tick.next_tick_at(box.core, 101.0, 101.1, c) == pytest.approx(101.0 + interval_s)
    assert tick.probe_wait_s(box.core, 101.1, c) <= interval_s / 2


def test_the_fast_interval_is_a_memory_setting_with_a_bound():
    assert MemoryConfig().start_guard and MemoryConfig().start_guard_interval_s == 0.5
    with pytest.raises(ValueError):
        MemoryConfig(start_guard_interval_s=0)


def test_the_start_lines_state_the_start_guard_and_its_margin():
    from guardian.config import Config, MemoryConfig
    from guardian.core import thresholds

    def line(**memory):
        return next(x for x in thresholds.describe(Config(memory=MemoryConfig(**memory))) if x.startswith("start guard"))

    on = line(enabled=True)
    assert "a look every 0.5 s" in on and "MemAvailable < 3.0 GiB" in on and "6.0 GiB/s" in on
    assert "1.5 GiB/s" in line(enabled=True, start_guard_interval_s=2.0)
    assert line(enabled=True, start_guard=False).startswith("start guard: off")
    assert line(enabled=False).startswith("start guard: off")


# --- a raise's start, an overridden fraction, a refused stop, the fast ticks, the observer ---------------

RESTORE = dict(sustain_s=30, restore_after_s=600, restore_cooldown_s=600)
DONE = RestartOutcome("vllm-b.service", "done", issued=True, ok=True)


def raised_box() -> Box:
    """b lowered to 0.74 (base 0.78) serves with room to spare; at 1600 s the memory guard raises it to
    0.78 (M26), and at 1601 s that raise's start is loading."""
    box = Box(config(**RESTORE), PersistentView(fraction_bases={"b": 0.78}))
    for t in (1000.0, 1600.0):
        box.tick(t, memory=mem(30, b=0.74), b=obs("b", t, u=unit("vllm-b.service", inactive_exit_mono=0.0)))
    assert [(s.old, s.new) for s in box.of(SetFraction)] == [(0.74, 0.78)] and box.core.mem.pending.raising
    box.tick(1601.0, memory=mem(124, 0.5, b=0.78), b=b_loading(1601.0, since=1600.5, invocation="i2", outcome=DONE))
    return box


def test_through_the_tick_a_raises_start_stopped_is_its_ceiling_and_goes_back_where_it_was_raised_from():
    box = raised_box()
    box.tick(1620.0, memory=mem(2.5, 99, b=0.78), b=b_loading(1620.0, since=1600.5, invocation="i2"))
    (stop,) = [s for s in box.of(SetFraction) if s.kill_first]
    assert (stop.old, stop.new) == (0.78, 0.74)
    # as a raise whose start failed (M7 after a raise): not raised to 0.78 again while guardian runs (M20)
    assert box.core.mem.ceilings == {"b": 0.78}
    assert box.core.mem.pending == Pending("b", 0.78, 0.74, 1620.0)


def test_a_raises_start_is_stopped_back_to_the_fraction_it_was_raised_from():
    raised = Pending("b", 0.74, 0.76, 90.0)  # a raise of less than a step (under a ceiling)
    first = starting(fraction=0.76, cgroup=0)
    steps = [(100.0, view(100, first, pending=raised)),
             (110.0, view(2, replace(first, cgroup_bytes=97 * GiB), pending=raised))]
    _, every = run(config(reserve_bytes=0), steps)
    assert [(s.old, s.new) for s in stops(every)] == [(0.76, 0.74)]  # not 0.72, one step below 0.76


def test_through_the_tick_a_fraction_overridden_on_the_command_line_is_not_wired_and_not_stopped():
    """An ExecStart= drop-in says 0.9 while guardian's env file says 0.74: a stop would restart it with
    the same memory, again and again (S5, said once a start). (sustain_s 300: the squeeze rules wait.)"""
    box = loading_box(config(sustain_s=300))
    overridden = replace(mem(2, 97.5, b=0.74).replicas["b"], cmdline_fraction=0.9)
    for t in (210.0, 210.5, 211.0):
        observed = mem(2, 97.5, b=0.74)
        box.tick(t, memory=replace(observed, replicas={**observed.replicas, "b": overridden}), b=b_loading(t))
    assert box.of(SetFraction) == []
    (line,) = box.lines(rule="S5")
    assert line.priority == Priority.CRITICAL
    assert "--gpu-memory-utilization 0.9 while guardian's env file says 0.74" in line.message


@pytest.mark.parametrize("cmdline, started_at, pending, overridden", [
    (0.74, 200.0, None, False),  # what the file says
    (None, 200.0, None, False),  # no flag on its command line (a wrapper script): nothing to compare
    (0.9, 200.0, None, True),
    (0.9, 200.0, Pending("a", 0.9, 0.74, 150.0), True),  # another replica's change
    (0.9, 100.0, Pending("b", 0.9, 0.74, 150.0), False),  # started before the file was written (M7, Restart=)
    (0.9, 200.0, Pending("b", 0.9, 0.74, 150.0), False),  # runs with the fraction the change replaced
    (0.86, 200.0, Pending("b", 0.9, 0.74, 150.0), True),  # neither: something else sets it
])
def test_the_command_line_overrides_the_env_file_only_outside_a_change_being_made(
        cmdline, started_at, pending, overridden):
    found = startguard.overridden("b", 0.74, cmdline, started_at, pending)
    assert (found is not None) == overridden


REFUSED_JOB = RestartOutcome("vllm-b.service", "refused: vllm-b.service already has a systemd job pending")


def test_through_the_tick_a_stop_whose_restart_is_refused_is_not_repeated_for_that_start():
    """The stop's restart is refused (a job of systemd's pending): the memory guard abandons it (M6); the
    start goes on, and is not measured again from the headroom it has taken and stopped again (no kill loop)."""
    box = loading_box(config(), headroom_gib=118.0)
    activating = dict(active_state="activating", job_pending=True)
    box.tick(210.0, memory=mem(1.0, 117), b=b_loading(210.0, **activating))
    assert len(box.of(SetFraction)) == 1 and box.tracks["b"].restart_in_flight
    box.tick(210.5, memory=mem(0.9, 117.1), b=b_loading(210.5, **activating))  # its restart in flight
    assert box.core.starts["b"].stopped and box.core.starts["b"].headroom_bytes == 118 * GiB
    t = 211.0
    box.tick(t, memory=mem(0.9, 117.1), b=b_loading(t, outcome=REFUSED_JOB, **activating))
    for i in range(1, 30):
        box.tick(t + i / 2, memory=mem(0.9 - i / 20, 117.1 + i / 20), b=b_loading(t + i / 2, **activating))
    assert len(box.of(SetFraction)) == 1 and len(box.lines(rule="S10")) == 1 and box.lines(rule="M6")
    (line,) = box.lines(rule="S2")
    assert line.priority == Priority.ERROR and "already has a systemd job pending" in line.message
    assert box.core.starts["b"].rule == "S2"


def test_a_stopped_start_is_kept_while_it_is_not_watched_until_it_is_over():
    steps = grows(2, 97)
    starts, _ = run(config(), steps)
    assert starts["b"].stopped
    last = steps[1][1].replicas[0]
    aside = replace(last, loading=False)  # its stop's restart in flight
    starts, every = run(config(), [(111.0, view(1, aside))], starts)
    assert every == [] and starts["b"].stopped and starts["b"].headroom_bytes == 100 * GiB
    # refused: kept, and said once when it is watched again
    starts, _ = run(config(), [(112.0, view(1, replace(aside, refused="refused: a job is pending")))], starts)
    starts, every = run(config(), [(112.5 + i, view(1, last)) for i in range(3)], starts)
    assert said(every) == ["S2"] and stops(every) == [] and "a job is pending" in lines(every)[0].message
    # over: it serves or its unit stopped, or its unit started anew
    for over in (replace(aside, ended=True), replace(aside, start=("i2", 120.0))):
        assert run(config(), [(120.0, view(1, over))], starts)[0] == {}


def test_fast_ticks_only_while_a_start_is_watched_and_not_stopped():
    c = config()
    box = Box(c)
    box.tick(100.0, memory=mem(30))
    box.tick(101.0, memory=mem(30, 0.5), b=b_loading(101.0, active_state="deactivating"))  # a stop, not a start
    assert box.state("b") == State.STARTING and box.core.starts == {}
    assert tick.next_tick_at(box.core, 101.0, 101.1, c) == pytest.approx(103.0)
    box = loading_box(c)
    assert tick.next_tick_at(box.core, 201.0, 201.1, c) == pytest.approx(201.5)
    box.tick(210.0, memory=mem(2.5, 97.5), b=b_loading(210.0))  # stopped: its restart in flight
    assert box.tracks["b"].restart_in_flight and box.core.starts["b"].stopped
    assert tick.next_tick_at(box.core, 210.0, 210.1, c) == pytest.approx(212.0)


def test_the_largest_others_leave_out_the_replicas_own_processes():
    consumers = ("python3 (pid 4242 in vllm-b.service) 90.0 GiB, VLLM::EngineCore (pid 77) 40.0 GiB, "
                 "build.service 20.0 GiB, make (pid 9 in build.service) 3.0 GiB")
    first = replace(starting(cgroup=0), pid=77)
    v0, v1 = view(100, first), view(2, replace(first, cgroup_bytes=97 * GiB))
    _, every = run(config(), [(100.0, replace(v0, consumers=consumers)), (110.0, replace(v1, consumers=consumers))])
    assert "largest others: build.service 20.0 GiB, make (pid 9 in build.service) 3.0 GiB;" in lines(every)[0].message


def test_the_observer_names_each_large_process_with_its_unit(tmp_path):
    from guardian.observe.memory import consumers_text, unit_of_pid

    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cgroup").write_text("0::/system.slice/vllm-b.service\n")
    (tmp_path / "9").mkdir()
    (tmp_path / "9" / "cgroup").write_text("0::/\n")
    assert [unit_of_pid(p, str(tmp_path)) for p in (4242, 9, 5)] == ["vllm-b.service", None, None]
    text = consumers_text([("build.service", 20 * GiB)], [("python3", 4242, 90 * GiB, "vllm-b.service"),
                                                           ("make", 9, 3 * GiB, None)])
    assert text == "build.service 20.0 GiB, python3 (pid 4242 in vllm-b.service) 90.0 GiB, make (pid 9) 3.0 GiB"


def test_the_observer_asks_the_peers_at_most_once_per_cache_period(monkeypatch):
    """Below the line they are wanted on every tick, and a dead peer costs up to peer_timeout_s."""
    import asyncio

    import guardian.observe.memory as observer_module
    from guardian.observe.clock import Now
    from guardian.observe.memory import PEERS_MAX_AGE_S, MemoryObserver
    from guardian.observe.systemd import Systemd

    c = config(peer_urls=["http://box2:8000"])
    monkeypatch.setattr(observer_module, "sample_memory", lambda: MemorySample(TOTAL, 2 * GiB, 2 * GiB, None, None))
    monkeypatch.setattr(observer_module, "read_env_fraction", lambda path: None)
    calls = []

    async def peers(self, cfg):
        calls.append(len(calls))
        return {"m": ("http://box2:8000",)} if len(calls) == 1 else {"m": ()}

    async def consumers(self):
        return "build.service 20.0 GiB"

    monkeypatch.setattr(MemoryObserver, "_serving_peers", peers)
    monkeypatch.setattr(MemoryObserver, "_largest_consumers", consumers)
    observer = MemoryObserver(Systemd(), None)

    def at(mono, config=c):
        return asyncio.run(observer.observe(config, {}, None, Now(mono, 1e9 + mono))).peers_serving

    assert [at(100.0 + i / 2) for i in range(int(PEERS_MAX_AGE_S * 2))] == [{"m": ("http://box2:8000",)}] * 20
    assert len(calls) == 1
    assert at(100.0 + PEERS_MAX_AGE_S) == {"m": ()} and len(calls) == 2
    assert at(100.0 + PEERS_MAX_AGE_S + 1, config(peer_urls=["http://box3:8000"])) == {"m": ()} and len(calls) == 3
