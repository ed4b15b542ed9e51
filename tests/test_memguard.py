"""The memory guard's pure policy, with a fake clock: squeeze rule boundaries, choice, fit, peers, cooldown."""

from __future__ import annotations

from dataclasses import replace

import pytest

from guardian.config import Config, MemoryConfig
from guardian.core.memory.memguard import MemoryView, MemTrack, Pending, ReplicaMemory, choose_fraction
from guardian.core.observations import MemorySample, RestartOutcome
from guardian.core.rules import Refusal
from guardian.core.vocab import Gate, MemVerdict, State
from harness import TOTAL, GiB, cfg, logs, lowerings, memory_cfg, rep, rules, run_memguard, view, with_memory


@pytest.mark.parametrize("dt, acts", [(29.0, False), (30.0, True), (31.0, True)])
def test_sustain_boundary(dt, acts):
    _, every, _ = run_memguard(memory_cfg(), [(100, view(5)), (100 + dt, view(5))])
    assert bool(lowerings(every)) == acts


@pytest.mark.parametrize("headroom_gib, acts", [(7.99, True), (8.0, False)])
def test_min_headroom_is_strictly_below(headroom_gib, acts):
    _, every, _ = run_memguard(memory_cfg(), [(100, view(headroom_gib)), (200, view(headroom_gib))])
    assert bool(lowerings(every)) == acts


def test_a_dip_resets_the_sustain_clock():
    _, every, _ = run_memguard(memory_cfg(), [(100, view(5)), (120, view(9)), (125, view(5)), (150, view(5))])
    assert lowerings(every) == []


@pytest.mark.parametrize("psi, acts", [(None, False), (9.9, False), (10.0, True)])
def test_optional_psi_threshold_must_hold_too(psi, acts):
    _, every, _ = run_memguard(memory_cfg(psi_some_threshold_pct=10), [(100, view(5, psi=psi)), (130, view(5, psi=psi))])
    assert bool(lowerings(every)) == acts


def test_lowering_names_the_evidence_and_picks_the_most_above_floor():
    _, every, _ = run_memguard(memory_cfg(), [(100, view(5)), (130, view(5))])
    (low,) = lowerings(every)
    assert (low.replica, low.old, low.new, low.restart) == ("a", 0.78, 0.74, True)
    (warn,) = logs(every, "warning")
    assert "headroom 5.0 GiB < 8.0 GiB for 30 s" in warn and "largest: db.service 22.1 GiB" in warn
    assert "replica a 0.78 -> 0.74; restarting vllm-a.service alone; b serving" in warn


def test_priority_overrides_the_choice():
    _, every, _ = run_memguard(memory_cfg(priority=["b"]), [(100, view(5)), (130, view(5))])
    assert lowerings(every)[0].replica == "b" and lowerings(every)[0].new == 0.66


@pytest.mark.parametrize("current, floor, new", [(0.78, 0.5, 0.74), (0.52, 0.5, 0.5), (0.5, 0.5, None), (0.53, 0.5, 0.5)])
def test_step_and_floor_on_the_grid(current, floor, new):
    assert choose_fraction(current, int(TOTAL * current), 20 * GiB, TOTAL, MemoryConfig(step=0.04, floor=floor, reserve_bytes=GiB)) == new


def test_fit_check_steps_further_down_or_waits():
    # 5 GiB free + 0.78 x 128 held - 1 reserve = 103.84 GiB usable: 0.74 (94.7) fits
    assert choose_fraction(0.78, int(TOTAL * 0.78), 5 * GiB, TOTAL, MemoryConfig(step=0.04, floor=0.5, reserve_bytes=GiB)) == 0.74
    # the replica really holds less than its fraction (NVML says 80 GiB): 84 GiB usable -> 0.65
    assert choose_fraction(0.78, 80 * GiB, 5 * GiB, TOTAL, MemoryConfig(step=0.04, floor=0.5, reserve_bytes=GiB)) == 0.65
    assert choose_fraction(0.78, 50 * GiB, 5 * GiB, TOTAL, MemoryConfig(step=0.04, floor=0.5, reserve_bytes=GiB)) is None
    config = memory_cfg()
    v = view(5, replace(rep("a"), usage_bytes=50 * GiB), rep("b", 0.5))
    _, every, _ = run_memguard(config, [(100, v), (130, v)])
    assert lowerings(every) == [] and any("waiting rather than a start vLLM would refuse" in m for m in logs(every, "error"))


@pytest.mark.parametrize("peer_serves, lowered", [(True, True), (False, False)])
def test_a_peer_counts_by_the_one_definition_of_serving(peer_serves, lowered):
    """Issue 35 item 3: b degraded only by a late /metrics still serves (watchdog/judge.py serves), so a is
    lowered while b carries the load; the verdict alone (degraded) would have deferred it."""
    pair = (rep("a", 0.78), replace(rep("b", 0.70, state="degraded"), serves=peer_serves))
    _, every, _ = run_memguard(memory_cfg(), [(100, view(5, *pair)), (130, view(5, *pair))])
    assert bool(lowerings(every)) is lowered


def test_no_serving_peer_defers_unless_critical():
    lonely = (rep("a", 0.78), rep("b", 0.70, state="stopped"))
    t, every, _ = run_memguard(memory_cfg(), [(100, view(5, *lonely)), (130, view(5, *lonely)), (140, view(5, *lonely))])
    assert lowerings(every) == []
    errors = logs(every, "error")
    assert len(errors) == 1 and "no other replica of m is serving" in errors[0]
    _, every, _ = run_memguard(memory_cfg(), [(150, view(2.9, *lonely))], track=t)
    assert lowerings(every) and "CRITICAL" in logs(every, "warning")[0]


@pytest.mark.parametrize("headroom_gib, critical", [(5, False), (2.9, True)])
def test_a_lowering_records_whether_it_was_decided_under_the_critical_line(headroom_gib, critical):
    """The start guard reads it (S3): a critical lowering's own start is not stopped again."""
    t, every, _ = run_memguard(memory_cfg(), [(100, view(headroom_gib)), (130, view(headroom_gib))])
    assert lowerings(every) and t.pending is not None and t.pending.critical is critical


def test_a_peer_on_another_box_counts():
    lonely = (rep("a", 0.78), rep("b", 0.70, state="stopped"))
    _, every, _ = run_memguard(memory_cfg(), [(100, view(5, *lonely, peers={"m": ("http://box2:8000",)})), (130, view(5, *lonely, peers={"m": ("http://box2:8000",)}))])
    assert lowerings(every) and "http://box2:8000 serving" in logs(every, "warning")[0]


@pytest.mark.parametrize("since_last, acts", [(599.0, False), (600.0, True)])
def test_cooldown_boundary(since_last, acts):
    track = MemTrack(last_change_at=1000.0)
    _, every, _ = run_memguard(memory_cfg(), [(1000 + since_last - 30, view(5)), (1000 + since_last, view(5))], track=track)
    assert bool(lowerings(every)) == acts


def test_unwired_replica_is_refused_with_the_fix():
    fix = "add EnvironmentFile=-/var/lib/guardian/replicas/a.env"
    v = view(5, rep("a", 0.78, wiring=fix), rep("b", 0.5))
    _, every, _ = run_memguard(memory_cfg(), [(100, v), (130, v), (131, v)])
    assert lowerings(every) == []
    (err,) = logs(every, "error")
    assert "not wired" in err and fix in err


def test_watchdog_blocks_are_respected():
    v = view(5, blocked={"a": Refusal(Gate.ONE_AT_A_TIME, "A3", "b is starting; one restart at a time per box",
                                      key=(Gate.ONE_AT_A_TIME, "b"))})
    _, every, _ = run_memguard(memory_cfg(), [(100, v), (130, v)])
    assert lowerings(every) == [] and "one restart at a time" in logs(every, "error")[0]


def test_dry_run():
    config = memory_cfg().model_copy(update={"dry_run": True})
    _, every, _ = run_memguard(config, [(100, view(5)), (130, view(5))])
    assert lowerings(every) == [] and "DRY-RUN: would lower replica a 0.78 -> 0.74" in logs(every, "warning")[0]


def test_pending_lowering_succeeds_when_the_replica_serves_with_the_new_fraction():
    track = MemTrack(pending=Pending("a", 0.78, 0.74, 1000.0), last_change_at=1000.0)
    still_old = view(5, rep("a", 0.74, running=0.78, started_at=900.0), rep("b"))
    t, every, _ = run_memguard(memory_cfg(), [(1005, still_old)], track=track)
    assert t.pending is not None and every == []
    done = view(5, rep("a", 0.74, running=0.74, started_at=1002.0), rep("b"))
    t, every, _ = run_memguard(memory_cfg(), [(1010, done)], track=t)
    assert t.pending is None and "serving again with gpu_memory_utilization 0.74" in logs(every, "info")[0]
    assert rules(every) == ["M4"] and t.verdict is MemVerdict.DONE


def test_a_replica_serving_with_another_fraction_than_written_is_an_error_not_a_retry():
    """Something overrides guardian's env file: say so; never walk the fraction down again."""
    track = MemTrack(pending=Pending("a", 0.78, 0.74, 1000.0), last_change_at=1000.0)
    overridden = view(5, rep("a", 0.74, running=0.78, started_at=1002.0), rep("b", 0.5))
    t, every, _ = run_memguard(memory_cfg(), [(1010, overridden)], track=track)
    assert t.pending is None and lowerings(every) == [] and rules(every) == ["M5"]
    (err,) = logs(every, "error")
    assert "with gpu_memory_utilization 0.78, not the 0.74 guardian wrote" in err
    # past the startup grace nothing counts it as a failed start (no retry one step lower)
    t, every, _ = run_memguard(memory_cfg(), [(1010 + 1300, overridden)], track=t)
    assert not {"M7", "M8"} & set(rules(every))


def test_failed_start_logs_the_cause_and_tries_one_step_lower():
    cause = "ValueError: Free memory on device cuda:0 (90/128 GiB) on startup is less than desired GPU memory utilization (0.74, 94.72 GiB)"
    track = MemTrack(pending=Pending("a", 0.78, 0.74, 1000.0), last_change_at=1000.0)
    v = view(30, rep("a", 0.74, state="starting", failure=cause, started_at=1001.0), rep("b"))
    t, every, _ = run_memguard(memory_cfg(), [(1010, v)], track=track)
    (low,) = lowerings(every)
    assert (low.old, low.new, low.restart) == (0.74, 0.70, False)  # systemd's Restart=always picks up the file
    assert cause in logs(every, "error")[0] and "trying 0.7" in logs(every, "error")[0]
    assert t.pending == Pending("a", 0.74, 0.70, 1010)


def test_failed_start_at_the_floor_gives_up_loudly():
    track = MemTrack(pending=Pending("a", 0.54, 0.5, 1000.0))
    v = view(30, rep("a", 0.5, state="stopped", failure="Free memory on device ..."), rep("b"))
    t, every, _ = run_memguard(memory_cfg(), [(1010, v)], track=track)
    assert lowerings(every) == [] and t.pending is None
    assert "no lower fraction >= floor 0.5 fits" in logs(every, "error")[0]


def test_failed_unit_after_a_lowering_is_restarted_with_the_next_fraction():
    track = MemTrack(pending=Pending("a", 0.78, 0.74, 1000.0))
    v = view(30, rep("a", 0.74, state="stopped", failure="Free memory on device (0.74, 1 GiB)"), rep("b"))
    _, every, _ = run_memguard(memory_cfg(), [(1010, v)], track=track)
    (low,) = lowerings(every)
    assert low.restart and low.retry and low.new == 0.70


def test_a_refused_lowering_restart_is_abandoned_and_said():
    track = MemTrack(pending=Pending("a", 0.78, 0.74, 1000.0), last_change_at=1000.0)
    v = replace(view(5), restart_results={"a": RestartOutcome("vllm-a.service", "refused: vllm-a.service is disabled")})
    t, every, _ = run_memguard(memory_cfg(), [(1001, v)], track=track)
    assert t.pending is None and "abandoned: refused: vllm-a.service is disabled" in logs(every, "error")[0]
    assert lowerings(every) == []


# --- raising a fraction back toward its base (M20-M26) -------------------------------------------------

from guardian.core.actions import DrainReplica, RestartUnit, SetFraction  # noqa: E402 - this section's own
from guardian.core.observations import PersistentView  # noqa: E402
from harness import TIMEOUT, Box, memory, obs, restarts, sample, unit  # noqa: E402

# The raise line of 0.74 -> 0.78 on TOTAL: min_headroom 8 GiB + the raise (0.04 x 128 GiB) + reserve 1 GiB.
LINE = 8 * GiB + round(TOTAL * (0.78 - 0.74)) + GiB


def below(name="a", fraction=0.74, base=0.78, state="healthy", started_at=0.0, failure=None, **kw) -> ReplicaMemory:
    """Replica NAME with FRACTION, lowered by guardian from BASE, serving unless STATE says otherwise."""
    return replace(rep(name, fraction, state=state, started_at=started_at, failure=failure), base=base, **kw)


def clear(headroom_bytes: int = 20 * GiB, *replicas, peers=None, blocked=None, drain_first=False) -> MemoryView:
    """Headroom of HEADROOM_BYTES, a at 0.74 below its base 0.78 and b serving at 0.70, unless REPLICAS."""
    s = MemorySample(TOTAL, headroom_bytes, headroom_bytes, None, None)
    reps = replicas or (below(), rep("b", 0.70))
    return MemoryView(s, TOTAL, tuple(reps), peers_serving=peers or {}, restart_blocked=blocked, drain_first=drain_first)


def restore_cfg(**memory) -> Config:
    """memory_cfg with restore on: headroom clear 600 s, 600 s since the last change."""
    return memory_cfg(**({"restore": True, "restore_after_s": 600, "restore_cooldown_s": 600} | memory))


def raises(actions) -> list[tuple[str, float, float, bool]]:
    return [(a.replica, a.old, a.new, a.restart) for a in lowerings(actions) if a.new > a.old]


@pytest.mark.parametrize("clear_s, raised", [(599.0, False), (600.0, True)])
def test_a_lowered_replica_is_raised_once_headroom_has_been_clear_for_restore_after_s(clear_s, raised):
    t, every, _ = run_memguard(restore_cfg(), [(1000, clear()), (1000 + clear_s, clear())])
    assert raises(every) == ([("a", 0.74, 0.78, True)] if raised else [])
    if not raised:
        assert rules(every) == ["M21"] and t.verdict is MemVerdict.RESTORE_WAIT
        (wait,) = logs(every, "info")
        assert "below its base 0.78" in wait and ">= 14.1 GiB" in wait and "for 600 s" in wait
        return
    assert rules(every) == ["M21", "M26"] and t.pending == Pending("a", 0.74, 0.78, 1000 + clear_s)
    (line,) = logs(every, "warning")
    assert ("replica a: headroom 20.0 GiB >= 14.1 GiB for 600 s; raising it 0.74 -> 0.78 (base 0.78); "
            "restarting vllm-a.service alone; b serving") == line


@pytest.mark.parametrize("headroom_bytes, raised", [(LINE, True), (LINE - 1, False)])
def test_the_raise_line_is_min_headroom_plus_the_raise_plus_the_reserve(headroom_bytes, raised):
    steps = [(1000.0 + dt, clear(headroom_bytes)) for dt in (0, 300, 600)]
    _, every, _ = run_memguard(restore_cfg(), steps)
    assert bool(raises(every)) == raised


@pytest.mark.parametrize("interruption", [
    clear(LINE - 1),  # one tick under the line
    clear(20 * GiB, below(), rep("b", 0.70, state="starting")),  # b loading: its memory is not taken yet
    view(5),  # a squeeze
])
def test_one_tick_under_the_line_or_with_a_replica_starting_starts_the_count_again(interruption):
    steps = [(1000.0, clear()), (1300.0, interruption), (1310.0, clear()), (1909.0, clear())]
    t, every, _ = run_memguard(restore_cfg(), steps)
    assert raises(every) == [] and t.clear_since == 1310.0
    _, every, _ = run_memguard(restore_cfg(), [(1910.0, clear())], track=t)
    assert raises(every) == [("a", 0.74, 0.78, True)]


@pytest.mark.parametrize("fraction, base, new", [
    (0.74, 0.78, 0.78),  # one step: to the base
    (0.66, 0.78, 0.70),  # one step of M.step, not all the way
    (0.76, 0.78, 0.78),  # the last step is smaller: never above the base
    (0.74, 0.775, 0.77),  # a base off the grid: the grid point below it
    (0.78, 0.78, None),  # at its base
    (0.80, 0.78, None),  # above it (the operator raised it by hand): never lowered toward it
    (0.74, None, None),  # never lowered by guardian: never raised
])
def test_a_raise_is_one_step_and_never_above_the_base(fraction, base, new):
    v = clear(40 * GiB, below("a", fraction, base), rep("b", 0.70))
    _, every, _ = run_memguard(restore_cfg(), [(1000.0, v), (1600.0, v)])
    assert raises(every) == ([("a", fraction, new, True)] if new is not None else [])
    if new is None:
        assert every == []  # nothing to raise: quiet


def test_the_replica_furthest_below_its_base_is_raised_first_and_an_unwired_or_idle_one_never():
    v = clear(40 * GiB, below("a", 0.74, 0.78), below("b", 0.60, 0.70))
    _, every, _ = run_memguard(restore_cfg(), [(1000.0, v), (1600.0, v)])
    assert raises(every) == [("b", 0.60, 0.64, True)]
    peers = {"m": ("http://box2:8000",)}  # a stalled b carries no load: a peer elsewhere does
    for other in (below("b", 0.60, 0.70, wiring_problem="no EnvironmentFile="), below("b", 0.60, 0.70, state="stalled")):
        v = clear(40 * GiB, below(), other, peers=peers)
        _, every, _ = run_memguard(restore_cfg(), [(1000.0, v), (1600.0, v)])
        assert raises(every) == [("a", 0.74, 0.78, True)]


def test_restore_off_leaves_a_lowered_fraction_alone():
    _, every, _ = run_memguard(restore_cfg(restore=False), [(1000.0, clear()), (5000.0, clear())])
    assert every == []


def test_one_step_at_a_time_each_after_its_own_hysteresis_and_cooldown():
    config = restore_cfg()
    a_at = lambda f, started=0.0, state="healthy": below("a", f, 0.78, state=state, started_at=started)  # noqa: E731
    t, every, _ = run_memguard(config, [(1000.0, clear(40 * GiB, a_at(0.66), rep("b", 0.70))),
                                        (1600.0, clear(40 * GiB, a_at(0.66), rep("b", 0.70)))])
    assert raises(every) == [("a", 0.66, 0.70, True)]
    # the raise's restart: a starts, then serves with 0.70
    t, every, _ = run_memguard(config, [(1620.0, clear(40 * GiB, a_at(0.70, 1601.0, "starting"), rep("b", 0.70))),
                                        (1700.0, clear(40 * GiB, a_at(0.70, 1601.0), rep("b", 0.70)))], track=t)
    assert rules(every) == ["M4"] and "after the raise" in logs(every, "info")[0] and t.pending is None
    # the count starts again on the tick after: no second step before 600 s of it
    steps = [(1710.0 + dt, clear(40 * GiB, a_at(0.70, 1601.0), rep("b", 0.70))) for dt in (0, 300, 599)]
    t, every, _ = run_memguard(config, steps, track=t)
    assert raises(every) == []
    _, every, _ = run_memguard(config, [(2310.0, clear(40 * GiB, a_at(0.70, 1601.0), rep("b", 0.70)))], track=t)
    assert raises(every) == [("a", 0.70, 0.74, True)]


@pytest.mark.parametrize("since_change_s, raised", [(599.0, False), (600.0, True)])
@pytest.mark.parametrize("last", ["last_change_at", "last_raise_at"])
def test_the_restore_cooldown_counts_from_the_last_lowering_or_raise(since_change_s, raised, last):
    track = MemTrack(**{last: 1000.0})
    steps = [(1000.0, clear()), (1000.0 + since_change_s, clear())]
    t, every, _ = run_memguard(restore_cfg(restore_after_s=60), steps, track=track)
    assert bool(raises(every)) == raised
    if not raised:
        assert t.rule == "M22" and "waits for the cooldown" in logs(every, "info")[-1]


def test_a_squeeze_right_after_a_raise_lowers_at_once():
    """The lowering's cooldown (M10) counts lowerings only: a raise that turned out wrong is undone at once."""
    track = MemTrack(last_raise_at=1000.0, last_change_at=100.0)
    _, every, _ = run_memguard(restore_cfg(), [(1010.0, view(5)), (1040.0, view(5))], track=track)
    assert [(a.replica, a.old, a.new) for a in lowerings(every)] == [("a", 0.78, 0.74)]


def test_no_other_replica_serving_its_model_holds_the_raise_said_once():
    lonely = (below(), rep("b", 0.70, state="stopped"))
    steps = [(1000.0 + dt, clear(20 * GiB, *lonely)) for dt in (0, 600, 610, 620)]
    t, every, _ = run_memguard(restore_cfg(), steps)
    assert raises(every) == [] and t.rule == "M23"
    (err,) = logs(every, "error")
    assert "not raising it 0.74 -> 0.78 (base 0.78): no other replica of m is serving" in err
    # a peer at memory.peer_urls serving m counts
    peers = {"m": ("http://box2:8000",)}
    _, every, _ = run_memguard(restore_cfg(), [(s[0], replace(s[1], peers_serving=peers)) for s in steps[:2]])
    assert raises(every) == [("a", 0.74, 0.78, True)] and "http://box2:8000 serving" in logs(every, "warning")[0]


def test_a_raise_waits_for_admission_said_once_per_refusal():
    backoff = Refusal(Gate.BACKOFF, "A2", "back-off: last restart 20 s ago, next allowed 60 s after it",
                      key=(Gate.BACKOFF, "900.0"))
    steps = [(1000.0 + dt, clear(blocked={"a": backoff})) for dt in (0, 600, 610, 620)]
    t, every, _ = run_memguard(restore_cfg(), steps)
    assert raises(every) == [] and t.rule == "M24"
    (err,) = logs(every, "error")
    assert "raising it 0.74 -> 0.78 (base 0.78) deferred: back-off" in err
    _, every, _ = run_memguard(restore_cfg(), [(630.0 + 1000, clear())], track=t)
    assert raises(every) == [("a", 0.74, 0.78, True)]


@pytest.mark.parametrize("left, raised", [(1, False), (2, True)])
def test_a_raise_never_spends_the_last_restart_of_the_budget(left, raised):
    v = clear(20 * GiB, below(restarts_left=left), rep("b", 0.70))
    t, every, _ = run_memguard(restore_cfg(), [(1000.0, v), (1600.0, v)])
    assert bool(raises(every)) == raised
    if not raised:
        assert t.rule == "M24" and "last restart its budget allows" in logs(every, "error")[0]


def test_under_a_proxy_a_raise_drains_first_then_raises():
    draining = [(1000.0 + dt, clear(drain_first=True)) for dt in (0, 600, 610)]
    t, every, _ = run_memguard(restore_cfg(), draining)
    assert raises(every) == [] and t.rule == "M25"
    assert [d.replica for d in every if isinstance(d, DrainReplica)] == ["a", "a"]  # asked on every tick
    assert len(logs(every, "warning")) == 1 and "draining it at the proxy first, then raising it" in logs(every)[-1]
    drained = clear(20 * GiB, below(drained=True), rep("b", 0.70), drain_first=True)
    _, every, _ = run_memguard(restore_cfg(), [(620.0 + 1000, drained)], track=t)
    assert raises(every) == [("a", 0.74, 0.78, True)] and rules(every) == ["M26"]


def test_a_dry_run_says_the_raise_once_and_does_nothing():
    config = restore_cfg().model_copy(update={"dry_run": True})
    t, every, _ = run_memguard(config, [(1000.0 + dt, clear()) for dt in (0, 600, 610, 620)])
    assert lowerings(every) == [] and t.verdict is MemVerdict.RESTORE_DRY_RUN and t.rule == "M26"
    (line,) = logs(every, "warning")
    assert "DRY-RUN: would raise it 0.74 -> 0.78 (base 0.78) and restart vllm-a.service alone" in line


def test_a_raised_start_that_fails_goes_back_down_and_that_raise_is_not_tried_again():
    cause = "ValueError: Free memory on device cuda:0 (95/128 GiB) on startup is less than desired GPU memory utilization (0.78, 99.84 GiB)"
    track = MemTrack(pending=Pending("a", 0.74, 0.78, 1000.0), last_raise_at=1000.0)
    failed = clear(20 * GiB, below("a", 0.78, state="stopped", failure=cause, started_at=1001.0), rep("b", 0.70))
    t, every, _ = run_memguard(restore_cfg(), [(1010.0, failed)], track=track)
    # back where it was raised from (not one M.step below the failed fraction), restarted: its unit failed
    assert [(a.old, a.new, a.restart, a.retry) for a in lowerings(every)] == [(0.78, 0.74, True, True)]
    (err,) = logs(every, "error")
    assert cause in err and "trying 0.74; it is not raised to 0.78 again while guardian runs" in err
    assert rules(every) == ["M7"] and t.ceilings == {"a": 0.78}
    # it serves at 0.74 again; later raises stop below the fraction that failed
    back = clear(40 * GiB, below("a", 0.74, started_at=1020.0), rep("b", 0.70))
    t, every, _ = run_memguard(restore_cfg(), [(1030.0, back)], track=t)
    assert rules(every) == ["M4"]
    _, every, _ = run_memguard(restore_cfg(), [(1040.0, back), (1700.0, back)], track=t)
    assert raises(every) == [("a", 0.74, 0.77, True)]


def test_a_failed_raise_never_retries_above_the_fraction_it_was_raised_from():
    """Little headroom left after the failed start: the retry goes as far down as it must to fit."""
    track = MemTrack(pending=Pending("a", 0.74, 0.78, 1000.0))
    failed = replace(clear(2 * GiB, below("a", 0.78, state="stopped", started_at=1001.0), rep("b", 0.70)),
                     restart_blocked=None)
    _, every, _ = run_memguard(restore_cfg(), [(1010.0, failed)], track=track)
    (retry,) = lowerings(every)
    # held 0.78 x 128 + 2 GiB headroom - 1 GiB reserve = 100.84 GiB: 0.74 (94.7 GiB) fits, nothing above it
    assert retry.new == 0.74


# --- M7's restart through admission (M18, M19): the defect reproduced in review -------------------------

def lowered_then_failing(backoff_s: float) -> tuple[Box, list]:
    """a lowered 0.78 -> 0.74 at 110 (its restart recorded then), loading from 111 while b stalls; b's
    watchdog restart waits for a (one at a time) until a's start fails: the tick both fall due on."""
    box = Box(with_memory(cfg(2, backoff_s=backoff_s, stall_window_s=60)))
    box.tick(100.0)
    box.tick(110.0, memory=memory(5))
    assert [(a.replica, a.new, a.restart) for a in box.of(SetFraction)] == [("a", 0.74, True)]
    box.persistent = replace(box.persistent, restarts={"a": (110.0,)})  # the executor records the restart
    done = RestartOutcome("vllm-a.service", "done", issued=True, ok=True)
    flat = sample(gen=5, running=3)
    loading = dict(u=unit(inactive_exit_mono=111.0), health=TIMEOUT)
    box.tick(112.0, memory=memory(5, a=0.74), a=obs("a", 112.0, outcome=done, **loading), b=obs("b", 112.0, s=flat))
    for t in range(115, 185, 5):
        box.tick(float(t), memory=memory(5, a=0.74), a=obs("a", t, **loading), b=obs("b", t, s=flat))
    assert box.state("b") is State.STALLED and box.of(RestartUnit) == []  # held by a's start (A3)
    failed = unit(inactive_exit_mono=111.0, active_state="failed")
    last = box.tick(185.0, memory=memory(5, a=0.74), a=obs("a", 185.0, u=failed, health=TIMEOUT), b=obs("b", 185.0, s=flat))
    return box, last


def test_a_failed_starts_retry_and_a_watchdog_restart_never_go_out_on_the_same_tick():
    box, last = lowered_then_failing(backoff_s=120)
    issued = [(r.replica, "restart") for r in restarts(last)] + [
        (a.replica, "retry") for a in of_kind(last, SetFraction) if a.restart]
    assert issued == [("b", "restart")]  # b's watchdog restart only: one restart at a time (A3), a in back-off (A2)
    # a's next fraction is written at once (a file write is not a restart); its restart waits, said once
    assert [(a.replica, a.old, a.new, a.restart) for a in of_kind(last, SetFraction)] == [("a", 0.74, 0.70, False)]
    (said,) = box.lines(rule="M18")
    assert said.priority == "error" and said.replica == "a" and said.unit == "vllm-a.service"
    assert "failed (unit failed); 0.7 is written to its env file, but restarting vllm-a.service waits: back-off" in said.message


def test_a_failed_starts_retry_inside_its_back_off_restarts_only_once_admitted():
    box, _ = lowered_then_failing(backoff_s=120)
    b_done = RestartOutcome("vllm-b.service", "done", issued=True, ok=True)
    failed = dict(u=unit(inactive_exit_mono=111.0, active_state="failed"), health=TIMEOUT)
    box.tick(190.0, memory=memory(5, a=0.70), a=obs("a", 190.0, **failed),
             b=obs("b", 190.0, u=unit("vllm-b.service", inactive_exit_mono=186.0), outcome=b_done))
    for now in range(195, 230, 5):  # b serves again; a is still inside its back-off (110 + 120 s)
        box.tick(float(now), memory=memory(5, a=0.70), a=obs("a", now, **failed),
                 b=obs("b", now, u=unit("vllm-b.service", inactive_exit_mono=186.0)))
    assert [r.replica for r in box.of(RestartUnit)] == ["b"]
    assert [a.restart for a in box.of(SetFraction) if a.replica == "a" and a.new == 0.70] == [False]
    assert len(box.lines(rule="M18")) == 1  # said once, though asked on every tick
    # the back-off is over: the restart that waited goes out now, with the fraction written then
    box.tick(230.0, memory=memory(5, a=0.70), a=obs("a", 230.0, **failed),
             b=obs("b", 230.0, u=unit("vllm-b.service", inactive_exit_mono=186.0)))
    restarted = [a for a in box.of(SetFraction) if a.restart and a.new == 0.70]
    assert [(a.replica, a.old, a.new, a.retry) for a in restarted] == [("a", 0.74, 0.70, True)]
    (issued,) = box.lines(rule="M19")
    assert issued.priority == "warning" and "restarting vllm-a.service with gpu_memory_utilization 0.7" in issued.message
    assert box.tracks["a"].restart_in_flight and box.core.mem.pending.issued_at == 230.0


def of_kind(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


# --- a hog started and stopped around the thresholds: no oscillation ---------------------------------

# (from s, hog GiB): a box where the replicas hold (a + b) x 128 GiB, 5 GiB is everything else, and a hog
# comes and goes. a's base is 0.70, b's 0.10: headroom 20.6 GiB - hog at the base, 5.12 GiB more for each
# step a is lowered. Squeezed below 8 GiB; the raise line of a 0.04 step is 8 + 5.12 + 1 = 14.12 GiB.
HOG = (
    (0, 0),  # 20.6: nothing to do
    (1800, 13),  # 7.6: squeezed -> a 0.66 -> 12.7: between the lines, nothing more
    (5400, 12),  # 13.7: just under the raise line: stays
    (9000, 11),  # 14.7: just over it -> after 600 s a 0.70 -> 9.6: still not squeezed
    (12600, 20),  # 0.6: critical -> 0.66, then after the cooldown 0.62 -> 10.8
    *((16200 + 200 * i, 15 if i % 2 == 0 else 0) for i in range(18)),  # on and off every 100 s for an hour
    (19800, 0),  # gone: back up step by step, to the base and no further
)
END_S = 30000


def hog_at(t: float) -> float:
    return [gib for since, gib in HOG if since <= t][-1]


def run_the_hog(step_s: float = 10.0) -> tuple[list[tuple[float, float, float]], list[tuple[float, float, float]]]:
    """The real tick over END_S with HOG: every tick's (t, headroom GiB, a's fraction), and each change
    of a's fraction (t, old, new). A restarted replica serves with its new fraction on the next tick."""
    box = Box(with_memory(cfg(2), sustain_s=30, restore_after_s=600, restore_cooldown_s=600))
    fraction, started, restarted_at = {"a": 0.70, "b": 0.10}, {"a": 0.0, "b": 0.0}, None
    ticks, changes = [], []
    for i in range(int(END_S / step_s)):
        t = 1000.0 + i * step_s
        headroom = 128 - 5 - hog_at(t - 1000) - (fraction["a"] + fraction["b"]) * 128
        a = obs("a", t, u=unit(inactive_exit_mono=started["a"]))
        if restarted_at is not None:  # the restart job ended; a serves with what it was given
            started["a"] = restarted_at + 1
            a = obs("a", t, u=unit(inactive_exit_mono=started["a"]),
                    outcome=RestartOutcome("vllm-a.service", "done", issued=True, ok=True))
            restarted_at = None
        acts = box.tick(t, memory=memory(headroom, a=fraction["a"], b=fraction["b"]), a=a,
                        b=obs("b", t, u=unit("vllm-b.service")))
        ticks.append((t - 1000, headroom, fraction["a"]))
        for change in of_kind(acts, SetFraction):
            assert change.replica == "a" and change.restart
            changes.append((t - 1000, change.old, change.new))
            fraction["a"], restarted_at = change.new, t
            restarts = box.persistent.restarts.get("a", ())
            box.persistent = replace(box.persistent, restarts={"a": (*restarts, t)})  # as the executor records it
    return ticks, changes


def test_a_hog_coming_and_going_around_the_thresholds_never_makes_the_fraction_oscillate():
    ticks, changes = run_the_hog()
    # what happened, step by step
    assert [(old, new) for _, old, new in changes] == [
        (0.70, 0.66),  # the 13 GiB hog
        (0.66, 0.70),  # 11 GiB: just clear of the raise line for 600 s
        (0.70, 0.66), (0.66, 0.62),  # the 20 GiB hog, one cooldown apart
        (0.62, 0.66),  # the flapping hog: clear for 600 s only before a's raise to 0.66, never after
        (0.66, 0.70),  # gone: back to the base, and no further
    ]
    # within each squeeze-free stretch the changes go one way only (up)
    stretch: list[float] = []
    for t, headroom, _ in ticks:
        if headroom < 8:
            stretch = []
            continue
        stretch += [new - old for when, old, new in changes if when == t]
        assert all(d > 0 for d in stretch) or all(d < 0 for d in stretch), (t, stretch)
    # never above the base; and every lowering follows a larger hog than the raise before it had
    assert max(f for _, _, f in ticks) == 0.70
    for i, (when, old, new) in enumerate(changes):
        earlier_raises = [w for w, o, n in changes[:i] if n > o]
        if new < old and earlier_raises:
            assert hog_at(when) > hog_at(earlier_raises[-1]), f"the raise at {earlier_raises[-1]} s caused a squeeze"
    # in the flapping hour at most one change, and none in the last half hour of any steady hog
    assert len([w for w, _, _ in changes if 16200 <= w < 19800]) <= 1
    for (since, _), (until, _) in zip(HOG, [*HOG[1:], (END_S, 0)]):
        if until - since >= 3600:
            assert not [w for w, _, _ in changes if until - 1800 <= w < until], (since, until)


# --- `guardian status` shows each replica's fraction and base, and where a raise stands ---------------

def test_status_shows_the_base_and_the_current_fraction_and_the_raise_in_progress(tmp_path, capsys):
    import json
    import time

    from guardian.act.state import atomic_write_json
    from guardian.cli import main
    from guardian.core.memory.memguard import MemTrack
    from guardian.core.observations import TickObservation
    from guardian.core.tick import TickState
    from guardian.observe.clock import Now
    from guardian.status import LoopStats, Snapshot, status_dict

    config = with_memory(cfg(2)).model_copy(update={"runtime_dir": tmp_path / "run", "state_dir": tmp_path / "state"})
    now = Now(mono=5000.0, wall=time.time())
    persistent = PersistentView(fraction_bases={"a": 0.78})
    observed = TickObservation({}, persistent, memory(20, a=0.74, b=0.70))
    mem = MemTrack(pending=Pending("a", 0.74, 0.78, 4990.0), last_raise_at=4990.0, ceilings={"b": 0.74})
    snapshot = Snapshot(TickState(mem=mem), persistent, observed, observed.memory.sample, {"a": None, "b": None})
    data = status_dict(config, "guardian.toml", snapshot, LoopStats(), True, now)
    a, b = data["replicas"]["a"], data["replicas"]["b"]
    assert (a["gpu_memory_utilization"], a["gpu_memory_utilization_base"]) == (0.74, 0.78)
    assert (b["gpu_memory_utilization"], b["gpu_memory_utilization_base"]) == (0.70, None)  # never lowered
    assert data["memory"]["pending"]["raise"] is True and data["memory"]["restore"]["enabled"] is True
    assert data["memory"]["restore"]["last_raise_at"] == now.wall - 10 and data["memory"]["restore"]["ceilings"] == {"b": 0.74}
    atomic_write_json(tmp_path / "run" / "status.json", data)
    path = tmp_path / "guardian.toml"
    path.write_text(f'runtime_dir = "{tmp_path / "run"}"\nstate_dir = "{tmp_path / "state"}"\n')
    assert main(["--config", str(path), "status"]) == 0
    out = capsys.readouterr().out
    assert "fraction 0.74 (base 0.78)" in out and "fraction 0.7 " in out
    assert "raise of a 0.74 -> 0.78 in progress" in out
    assert "memory restore: on, after 600 s of clear headroom, cooldown 600 s" in out
    assert "b not raised to 0.74 or above (a raise to it failed to start)" in out
    assert main(["--config", str(path), "status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["replicas"]["a"]["gpu_memory_utilization_base"] == 0.78


def test_the_start_lines_state_the_restore_thresholds():
    from guardian.core.thresholds import describe

    (on,) = [line for line in describe(restore_cfg(restore_after_s=900, restore_cooldown_s=300))
             if line.startswith("memory guard")]
    assert ("raised to min(base, current + 0.04) (0.01 grid, rounded down) when MemAvailable >= 8.0 GiB + total x "
            "the raise + 1.0 GiB on every tick for >= 900 s with no replica starting, AND >= 300 s after the last "
            "change of fraction, AND another replica of its model serves") in on
    (off,) = [line for line in describe(restore_cfg(restore=False)) if line.startswith("memory guard")]
    assert "restore off" in off and "raised to" not in off


def test_through_the_tick_under_a_proxy_a_raise_drains_first_and_its_lines_say_raise():
    from harness import with_proxy

    config = with_proxy(with_memory(cfg(2), sustain_s=30, restore_after_s=600, restore_cooldown_s=600))
    box = Box(config, PersistentView(fraction_bases={"a": 0.78}))
    for t in range(1000, 1620, 10):
        box.tick(float(t), memory=memory(30, a=0.74))
    assert [line.rule for line in box.lines() if line.rule and line.rule.startswith(("M", "D"))] == [
        "M21", "M25", "M26", "D8"]
    assert "the memory guard raises it now (D8)" in box.lines(rule="D8")[0].message
    (up,) = box.of(SetFraction)
    assert (up.replica, up.old, up.new, up.restart, up.stop_timeout_s) == ("a", 0.74, 0.78, True, 30.0)
    assert box.core.drains["a"].phase == "away" and box.tracks["a"].restart_in_flight
    assert not any("lower" in line.message for line in box.lines() if line.rule in ("M25", "M26", "D8"))


@pytest.mark.parametrize("bases, restore, asked", [
    ({"a": 0.78}, True, True),  # a (0.74 in its env file) below its base: a raise may need the peers
    ({"a": 0.74}, True, False),  # at its base
    ({}, True, False),  # never lowered
    ({"a": 0.78}, False, False),  # restore off
])
def test_the_memory_observer_asks_the_peers_with_headroom_to_spare_only_when_a_raise_may_need_them(
        monkeypatch, bases, restore, asked):
    import asyncio

    import guardian.observe.memory as observer_module
    from guardian.observe.clock import Now
    from guardian.observe.memory import MemoryObserver
    from guardian.observe.systemd import Systemd

    config = restore_cfg(restore=restore, peer_urls=["http://box2:8000"])
    monkeypatch.setattr(observer_module, "sample_memory", lambda: MemorySample(TOTAL, 30 * GiB, 30 * GiB, None, None))
    monkeypatch.setattr(observer_module, "read_env_fraction", lambda path: 0.74 if path.name == "a.env" else None)
    calls = []

    async def peers(self, cfg):
        calls.append(cfg.memory.peer_urls)
        return {"m": ("http://box2:8000",)}

    monkeypatch.setattr(MemoryObserver, "_serving_peers", peers)
    found = asyncio.run(MemoryObserver(Systemd(), None).observe(config, {}, None, Now(100.0, 1e9), bases))
    assert bool(calls) == asked and found.peers_serving == ({"m": ("http://box2:8000",)} if asked else {})
    assert found.consumers == ""  # the largest consumers are asked for only below the squeeze line


@pytest.mark.parametrize("psi, raised", [(None, True), (9.9, True), (10.0, False)])
def test_with_a_psi_threshold_memory_pressure_holds_the_raise_too(psi, raised):
    def v(t):
        return replace(clear(), sample=MemorySample(TOTAL, 20 * GiB, 20 * GiB, psi, None))

    _, every, _ = run_memguard(restore_cfg(psi_some_threshold_pct=10), [(1000.0, v(0)), (1600.0, v(600))])
    assert bool(raises(every)) == raised


# --- M18, M19 in review: a spent budget, a replica that serves again or is paused, the base recorded --

from harness import lines  # noqa: E402 - this section's own

BUDGET_SPENT = Refusal(Gate.BUDGET, "A1", "restart budget spent (3 restarts in 1800 s)", key=(Gate.BUDGET,))


def test_a_restart_owed_refused_for_the_budget_is_given_up_and_the_guard_goes_on():
    """A spent budget can last restart_window_s: M18 must not hold the change (and every other
    replica's lowering) that long. It gives up once, at critical; the fraction stays written."""
    track = MemTrack(pending=Pending("a", 0.74, 0.70, 1000.0, restart_owed=True, failure="unit failed"),
                     last_change_at=1000.0)
    v = view(1, rep("a", 0.70, state="stopped"), rep("b", 0.90), blocked={"a": BUDGET_SPENT})
    t, every, _ = run_memguard(memory_cfg(), [(1000.0 + 10 * i, v) for i in range(1, 80)], track=track)
    (said,) = [line for line in lines(every) if line.rule == "M18"]
    assert said.priority == "critical" and said.replica == "a" and said.unit == "vllm-a.service"
    assert "0.7 is written to its env file, but restarting vllm-a.service is refused: restart budget spent" in said.message
    assert "giving up on the lowering: the unit's next start reads 0.7" in said.message
    assert not [a for a in lowerings(every) if a.replica == "a"]  # written already; no restart of a
    assert [(a.replica, a.old) for a in lowerings(every)] == [("b", 0.90)]  # after M10's cooldown, b gives
    assert t.pending.replica == "b"


@pytest.mark.parametrize("gate, rule, given_up", [
    (Gate.BUDGET, "A1", True), (Gate.BACKOFF, "A2", False), (Gate.ONE_AT_A_TIME, "A3", False)])
def test_a_failed_starts_retry_refused_for_the_budget_writes_the_fraction_and_gives_up(gate, rule, given_up):
    track = MemTrack(pending=Pending("a", 0.78, 0.74, 1000.0), last_change_at=1000.0)
    refusal = Refusal(gate, rule, f"{gate} refuses", key=(gate,))
    v = view(30, rep("a", 0.74, state="stopped", failure="Free memory on device"), rep("b"), blocked={"a": refusal})
    t, every, _ = run_memguard(memory_cfg(), [(1010.0, v)], track=track)
    (low,) = lowerings(every)
    assert (low.old, low.new, low.restart, low.retry) == (0.74, 0.70, False, True)  # the file is written either way
    (said,) = lines(every)
    assert said.rule == "M18" and said.priority == ("critical" if given_up else "error")
    if given_up:
        assert t.pending is None and t.unread == {"a": 1010.0} and t.last_change_at == 1010.0
    else:
        assert t.pending == Pending("a", 0.74, 0.70, 1010.0, restart_owed=True, failure="Free memory on device")


def slow_start_past_grace() -> Box:
    """a lowered 0.78 -> 0.74 at 110 loads slowly (started 111, grace 300 s); b's unit restarted at 395
    is loading when a's grace runs out at 415: M7's restart of a waits for b (one at a time, M18)."""
    config = with_memory(cfg(2), cooldown_s=60)
    box = Box(config.model_copy(update={"replicas": [
        r.model_copy(update={"startup_grace_s": 300}) for r in config.replicas]}))
    box.tick(100.0)
    box.tick(110.0, memory=memory(5))
    box.persistent = replace(box.persistent, restarts={"a": (110.0,)})
    done = RestartOutcome("vllm-a.service", "done", issued=True, ok=True)
    box.tick(112.0, memory=memory(9, a=0.74), a=a_loading(112.0, outcome=done))
    for t in range(120, 410, 10):
        box.tick(float(t), memory=memory(9, a=0.74), a=a_loading(t), **({"b": b_obs(t, serving=False)} if t >= 395 else {}))
    box.tick(415.0, memory=memory(9, a=0.74), a=a_loading(415.0), b=b_obs(415.0, serving=False))
    assert box.core.mem.pending == Pending("a", 0.74, 0.70, 415.0, restart_owed=True,
                                           failure="not serving 305 s after the restart (grace 300 s)")
    return box


def a_loading(t, **kw):
    return obs("a", t, health=TIMEOUT, u=unit(inactive_exit_mono=111.0), **kw)


def b_obs(t, serving=True):
    return obs("b", t, u=unit("vllm-b.service", inactive_exit_mono=395.0), **({} if serving else {"health": TIMEOUT}))


def test_a_restart_owed_to_a_replica_that_serves_again_is_dropped_and_not_called_an_override():
    box = slow_start_past_grace()
    # a's slow start finishes: it serves with 0.74 (its command line), 0.70 in its env file; b still loads
    serving = memory(9, a=0.70, cmdline=0.74)
    box.tick(420.0, memory=serving, a=obs("a", 420.0, u=unit(inactive_exit_mono=111.0)), b=b_obs(420.0, serving=False))
    (dropped,) = box.lines(rule="M19")
    assert dropped.priority == "info" and dropped.replica == "a"
    assert "it serves again with gpu_memory_utilization 0.74, from its start before the fraction was written" in dropped.message
    assert "is dropped and the lowering concluded: 0.7 stays in its env file and is read at its next start" in dropped.message
    assert box.core.mem.pending is None and box.core.mem.unread == {"a": 415.0}
    # b serves again (admission would let a restart through now), then a squeeze: a is not restarted
    # for the owed retry, and its 0.74 against the file's 0.70 is not an override (M9, M11)
    for t in range(430, 520, 10):
        box.tick(float(t), memory=serving if t < 500 else memory(5, a=0.70, b=0.5, cmdline=0.74),
                 a=obs("a", t, u=unit(inactive_exit_mono=111.0)), b=b_obs(t))
    assert not [a for a in box.of(SetFraction) if a.replica == "a" and a.restart and a.new == 0.70]
    assert "M11" not in [line.rule for line in box.lines()] and not box.lines(rule="M9")
    assert [(a.replica, a.old, a.new) for a in box.of(SetFraction) if a.old == 0.70] == [("a", 0.70, 0.66)]
    # its next start reads the file: from then on the difference would be an override again
    box.tick(600.0, memory=memory(9, a=0.66), a=obs("a", 600.0, u=unit(inactive_exit_mono=590.0)), b=b_obs(600.0))
    assert box.core.mem.unread == {}


def test_a_restart_owed_to_a_paused_replica_is_dropped():
    from guardian.core.observations import Pause

    box = slow_start_past_grace()
    box.persistent = replace(box.persistent, pauses={"a": Pause(None, "operator")})
    failed = unit(inactive_exit_mono=111.0, active_state="failed")
    for t in (420.0, 430.0, 440.0):
        box.tick(t, memory=memory(9, a=0.70), a=obs("a", t, health=TIMEOUT, u=failed), b=b_obs(t, serving=t >= 440))
    assert box.state("a") is State.PAUSED
    (dropped,) = box.lines(rule="M19")
    assert dropped.priority == "info" and "it is paused by the operator (guardian pause)" in dropped.message
    assert not [a for a in box.of(SetFraction) if a.replica == "a" and a.restart and a.new == 0.70]
    assert box.core.mem.pending is None


@pytest.mark.parametrize("gates_pass", [True, False])
def test_a_lowering_records_its_base_only_when_its_env_file_is_written(tmp_path, monkeypatch, gates_pass):
    import asyncio

    import guardian.act.executor as executor_module
    import guardian.act.restart as restart_module
    from guardian.act.executor import Executor
    from guardian.act.restart import Tools
    from guardian.act.state import StateStore
    from guardian.observe.clock import Now
    from harness import Recorder

    now = Now(mono=5000.0, wall=1_700_000_000.0)
    store = StateStore(tmp_path, clock=lambda: now)
    config = with_memory(cfg(1)).model_copy(update={"state_dir": tmp_path})
    bases_at_write = []
    real_write = restart_module.atomic_write  # the env file's writer (restart.write_fraction)

    def write(path, data, *args):
        bases_at_write.append(dict(store.read()["fraction_bases"]))
        real_write(path, data, *args)

    async def restart(tools, order):  # the re-check right before acting: the gates pass, or one refuses
        if not gates_pass:
            return RestartOutcome(order.replica.unit, "refused: vllm-a.service is disabled")
        order.before_restart()
        return RestartOutcome(order.replica.unit, "done", issued=True, ok=True)

    monkeypatch.setattr(restart_module, "atomic_write", write)
    monkeypatch.setattr(executor_module, "checked_restart", restart)
    ex = Executor(Tools(None, store, Recorder(), config, lambda: now), None)

    async def perform(action):
        ex.perform([action], {}, now)
        await asyncio.gather(*ex.tasks)

    asyncio.run(perform(SetFraction("a", "vllm-a.service", 0.78, 0.74, restart=True, evidence="squeezed")))
    assert store.read()["fraction_bases"] == ({"a": 0.78} if gates_pass else {})
    assert bases_at_write == ([{"a": 0.78}] if gates_pass else [])  # recorded before the file is written
    # a retry's file alone (systemd restarts the unit by itself) is always written, so its base recorded
    asyncio.run(perform(SetFraction("a", "vllm-a.service", 0.74, 0.70, restart=False, evidence="retry", retry=True)))
    assert store.read()["fraction_bases"] == {"a": 0.78 if gates_pass else 0.74}


@pytest.mark.parametrize(
    "track, settled",
    [
        (MemTrack(), True),
        (MemTrack(pending=Pending("a", 0.78, 0.74, 1000.0)), False),  # a lowering of a followed
        (MemTrack(pending=Pending("b", 0.78, 0.74, 1000.0)), True),  # another's
        (MemTrack(unread={"a": 1000.0}), False),  # written, its restart given up or dropped: not read yet
    ],
)
def test_a_start_is_lowered_to_fit_only_with_no_change_of_its_fraction_in_flight(track, settled):
    from guardian.core.memory.memguard import fraction_settled

    assert fraction_settled(track, "a") is settled


def test_a_change_of_weights_drops_what_the_memory_guard_learned_of_the_old_ones():
    from guardian.core.memory.memguard import weights_changed

    track = MemTrack(ceilings={"a": 0.86, "b": 0.9})
    assert weights_changed(track, "a").ceilings == {"b": 0.9}  # a's failed raise was the old model's size
    assert weights_changed(track, "c") is track
