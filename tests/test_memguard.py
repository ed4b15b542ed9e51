"""The memory guard's pure policy, with a fake clock: squeeze rule boundaries, choice, fit, peers, cooldown."""

from __future__ import annotations

from dataclasses import replace

import pytest

from guardian.config import Config, MemoryConfig
from guardian.core.memguard import MemoryView, MemTrack, Pending, ReplicaMemory, choose_fraction
from guardian.core.observations import MemorySample, RestartOutcome
from guardian.core.rules import Refusal
from guardian.core.vocab import Gate, MemVerdict, State
from harness import TOTAL, GiB, cfg, logs, lowerings, rules, run_memguard, with_memory


def memory_cfg(**memory) -> Config:
    """Replicas a and b with the memory guard on as harness.with_memory has it, but a squeeze must
    last 30 s (sustain_s) before it acts. MEMORY overrides."""
    return with_memory(cfg(2), **({"sustain_s": 30} | memory))


def rep(name="a", fraction=0.78, state="healthy", wiring=None, running=None, started_at=0.0, failure=None, model="m"):
    return ReplicaMemory(name=name, unit=f"vllm-{name}.service", model=model, fraction=fraction,
                         running_fraction=running if running is not None else fraction, started_at=started_at,
                         wiring_problem=wiring, state=State(state), start_failure=failure)


def view(headroom_gib: float, *replicas, psi=None, blocked=None, peers=None) -> MemoryView:
    """PEERS: model -> the peer URLs serving it."""
    s = MemorySample(TOTAL, int(headroom_gib * GiB), int(headroom_gib * GiB), psi, None)
    reps = replicas or (rep("a", 0.78), rep("b", 0.70))
    return MemoryView(s, TOTAL, tuple(reps), peers_serving=peers or {}, consumers="db.service 22.1 GiB",
                      restart_blocked=blocked)


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


def test_no_serving_peer_defers_unless_critical():
    lonely = (rep("a", 0.78), rep("b", 0.70, state="stopped"))
    t, every, _ = run_memguard(memory_cfg(), [(100, view(5, *lonely)), (130, view(5, *lonely)), (140, view(5, *lonely))])
    assert lowerings(every) == []
    errors = logs(every, "error")
    assert len(errors) == 1 and "no other replica of m is serving" in errors[0]
    _, every, _ = run_memguard(memory_cfg(), [(150, view(2.9, *lonely))], track=t)
    assert lowerings(every) and "CRITICAL" in logs(every, "warning")[0]


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
