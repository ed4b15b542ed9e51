"""The pure core's watchdog side (liveness, admission, gates), driven through the tick's one
decide() call in memory with a fake clock (harness.Box), table by table.

Every threshold is tested at the boundary: one tick before, exactly at, one tick after.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from guardian.config import Config, ReplicaConfig, WatchdogConfig
from guardian.core import gates, tick
from guardian.core.actions import LogLine, RecordCanaryLatencies
from guardian.core.hazards import find_hazards
from guardian.core.observations import (
    Activity, CanaryResult, GpuLife, Pause, PersistentView, Probe, ProcView, ReplicaObservation, RestartOutcome,
    VllmSample,
)
from guardian.core.vocab import Decision, HeldBy, Hidden, Nobody, Priority, State
from guardian.core.watchdog.canary import LEARNING_CANARIES, canary_deadline, next_deadline
from guardian.core.watchdog.steps import learn_step, longest_step_s
from guardian.core.watchdog.track import Track
from harness import (
    DEAD_503, OK, SLOW, SLOW_FAIL, TIMEOUT, Box, canaries, cfg, checked, conns, logs, obs, restarts, said, sample, unit,
)

# Three canaries of 0.1 s learned, as the state file keeps them (the tests that count idle
# canaries start from it: with nothing learned, a replica first gets its learning canaries).
# And a short prefill learned (the 0.3 s bucket), as every replica that served a request has: the
# stall canary's shortcut (L14) then waits no longer than 1.5 x that (issue 35 item 8).
SHORT_STEPS = {"a": ((0.3, 0.0),)}  # (seconds, when learned)
LEARNED = PersistentView(canary_latencies={"a": (0.1, 0.1, 0.1)}, step_seconds=SHORT_STEPS)


def healthy_start(box: Box, t0=100.0, **kw):
    """A replica that was started at 0 and is serving at t0 (grace over by being healthy once)."""
    box.tick(t0, **kw)
    assert box.state() == State.HEALTHY


# --- stalled --------------------------------------------------------------------------------

@pytest.mark.parametrize("dt, state", [(59.0, State.HEALTHY), (60.0, State.STALLED), (61.0, State.STALLED)])
def test_stall_window_boundary(dt, state):
    box = Box(cfg(1, stall_window_s=60))
    healthy_start(box)
    flat = sample(gen=500, running=4, kv=0.3)
    box.tick(200, a=obs(t=200, s=flat))  # work first seen queued here
    actions = box.tick(200 + dt, a=obs(t=200 + dt, s=flat))
    assert box.state() == state
    assert bool(restarts(actions)) == (state == State.STALLED)


def test_stall_counts_from_last_progress_not_from_when_work_appeared():
    box = Box(cfg(1, stall_window_s=60))
    healthy_start(box)
    box.tick(200, a=obs(t=200, s=sample(gen=1, running=2)))
    box.tick(250, a=obs(t=250, s=sample(gen=9, running=2)))  # progress at 250
    box.tick(309, a=obs(t=309, s=sample(gen=9, running=2)))
    assert box.state() != State.STALLED
    box.tick(310, a=obs(t=310, s=sample(gen=9, running=2)))
    assert box.state() == State.STALLED


def test_long_prefill_moves_kv_usage_only_and_is_not_a_stall():
    box = Box(cfg(1, stall_window_s=60))
    healthy_start(box)
    for i, t in enumerate(range(200, 500, 10)):
        box.tick(t, a=obs(t=t, s=sample(gen=10, running=1, kv=0.01 * i)))  # token counters flat for 300 s
        assert box.state() == State.HEALTHY, t
    assert restarts(box.actions) == []


# --- busy is not hung -------------------------------------------------------------------------

@pytest.mark.parametrize("health", [SLOW, TIMEOUT])
def test_busy_with_slow_or_timed_out_health_is_never_restarted(health):
    box = Box(cfg(1))
    healthy_start(box)
    for i, t in enumerate(range(200, 200 + 600, 2)):  # ten minutes of load
        o = obs(t=t, s=sample(gen=100 + i * 7, running=12, waiting=3))
        o = replace(o, health=health)  # /health slow or failing; /metrics still answers
        box.tick(t, a=o)
        assert box.state() in (State.BUSY, State.HEALTHY)
    assert box.state() == State.BUSY
    assert restarts(box.actions) == []


# --- unresponsive ---------------------------------------------------------------------------

@pytest.mark.parametrize("dt, state", [(9.5, State.DEGRADED), (10.0, State.UNRESPONSIVE), (10.5, State.UNRESPONSIVE)])
def test_unresponsive_window_boundary(dt, state):
    """The window runs from the last answer, not from the first failed tick (which ends a whole
    probe timeout after the process hung)."""
    box = Box(cfg(1, unresponsive_after_s=10))
    healthy_start(box, t0=200.0)  # the last answer
    box.tick(205, a=obs(t=205, health=TIMEOUT))  # first failure
    actions = box.tick(200 + dt, a=obs(t=200 + dt, health=TIMEOUT))
    assert box.state() == state
    assert bool(restarts(actions)) == (state == State.UNRESPONSIVE)


@pytest.mark.parametrize("dt, state", [(9.5, State.DEGRADED), (10.0, State.UNRESPONSIVE)])
def test_health_503_means_engine_dead_after_the_window(dt, state):
    box = Box(cfg(1, unresponsive_after_s=10))
    healthy_start(box)
    box.tick(200, a=obs(t=200, health=DEAD_503))
    box.tick(200 + dt, a=obs(t=200 + dt, health=DEAD_503))
    assert box.state() == state


# --- starting and its grace ---------------------------------------------------------------------

@pytest.mark.parametrize("t, state", [(1199.0, State.STARTING), (1200.0, State.UNRESPONSIVE)])
def test_startup_grace_is_measured_from_the_units_own_start(t, state):
    box = Box(cfg(1, unresponsive_after_s=10))
    u = unit(inactive_exit_mono=0.0)
    for now in (5.0, 600.0, t):  # connection refused all along
        box.tick(now, a=obs(t=now, health=TIMEOUT, u=u))
    assert box.state() == state


def test_guardian_restart_does_not_reset_grace():
    """A fresh policy (guardian restarted) still measures grace from systemd's start time."""
    box = Box(cfg(1))
    u = unit(inactive_exit_mono=0.0)
    box.tick(1199.0, a=obs(t=1199.0, health=TIMEOUT, u=u))
    assert box.state() == State.STARTING
    box.tick(1200.0, a=obs(t=1200.0, health=TIMEOUT, u=u))
    assert box.state() == State.DEGRADED  # grace over; failures counted from first seen
    box.tick(1209.0, a=obs(t=1209.0, health=TIMEOUT, u=u))
    assert box.state() == State.UNRESPONSIVE


def test_activating_unit_is_starting_and_healthy_once_ends_grace():
    box = Box(cfg(1))
    box.tick(10, a=obs(t=10, health=TIMEOUT, u=unit(active_state="activating")))
    assert box.state() == State.STARTING
    box.tick(20, a=obs(t=20))
    assert box.state() == State.HEALTHY
    assert any("starting -> healthy" in m for m in logs(box.actions, "info"))


def test_unit_restarted_by_anyone_starts_a_new_grace():
    box = Box(cfg(1))
    healthy_start(box)
    box.tick(300, a=obs(t=300, health=TIMEOUT, u=unit(inactive_exit_mono=295.0)))
    assert box.state() == State.STARTING


@pytest.mark.parametrize("sent_at, state, rule", [
    (294.9, State.STARTING, "L6"),  # sent to the old server, read beside the new start: not this start's
    (295.0, State.HEALTHY, "L18"),
    (None, State.HEALTHY, "L18"),  # when it was sent is not known: an answer, as before
])
def test_an_answer_sent_before_the_units_latest_start_is_not_that_starts(sent_at, state, rule):
    """The suite's r41: an operator's restart stopped the old server while guardian's /health to it
    was out; its 200 came in the tick whose view of the unit showed the new start, ended the grace
    (L6) at once, and the loading server was restarted as unresponsive 4 s later."""
    box = Box(cfg(1))
    healthy_start(box)
    restarted = unit(inactive_exit_mono=295.0)
    late = replace(OK, sent_at=sent_at)
    answered = replace(obs(t=300, u=restarted), health=late, metrics_probe=late, models_probe=late)
    box.tick(300, a=answered)
    assert (box.state(), box.rule()) == (state, rule)
    if state is State.STARTING:  # and the grace holds while it loads
        box.tick(310, a=obs(t=310, health=TIMEOUT, u=restarted))
        assert (box.state(), box.rule()) == (State.STARTING, "L6")


# --- idle-dead and canaries ---------------------------------------------------------------------

def test_canary_only_when_idle_and_due():
    box = Box(cfg(1, canary_interval_s=30), LEARNED)
    healthy_start(box, t0=100.0)  # start_ts 0: the first canary is due at once
    assert canaries(box.actions)
    box.actions.clear()
    box.tick(110, a=obs(t=110, canary=CanaryResult(True, 100.0, 0.1)))
    box.tick(139, a=obs(t=139))
    assert not canaries(box.actions)
    box.tick(140.1, a=obs(t=140.1, s=sample(running=3)))  # busy: no canary, even though due
    assert not canaries(box.actions)
    box.tick(141, a=obs(t=141))  # traffic stopped 0.9 s ago: not yet (canary_after_traffic_s = 5)
    assert not canaries(box.actions)
    box.tick(145.1, a=obs(t=145.1))
    assert canaries(box.actions)


@pytest.mark.parametrize("failures, state", [(1, State.DEGRADED), (2, State.IDLE_DEAD)])
def test_idle_dead_after_consecutive_canary_failures(failures, state):
    box = Box(cfg(1, canary_failures=2, canary_retry_s=5))
    healthy_start(box)
    t = 100.0
    for _ in range(failures):
        t += 10
        box.tick(t, a=obs(t=t, canary=CanaryResult(False, t - 10, 10.0, "timeout")))
    assert box.state() == state
    assert bool(restarts(box.actions)) == (state == State.IDLE_DEAD)


def test_canary_failure_during_real_progress_does_not_count():
    box = Box(cfg(1, canary_failures=1))
    healthy_start(box)
    box.tick(105, a=obs(t=105, s=sample(gen=50)))  # traffic moved the counters while the canary ran
    box.tick(110, a=obs(t=110, s=sample(gen=50), canary=CanaryResult(False, 100.0, 10.0, "timeout")))
    assert box.state() == State.HEALTHY and restarts(box.actions) == []


# --- wrong model, stopped, paused -------------------------------------------------------------------

def test_wrong_model_is_an_error_and_never_restarted():
    box = Box(cfg(1))
    healthy_start(box)
    for t in range(200, 400, 5):
        box.tick(t, a=obs(t=t, models=("old-split",), s=sample(running=2)))
    assert box.state() == State.WRONG_MODEL
    errors = logs(box.actions, "error")
    assert len(errors) == 1 and "old-split" in errors[0] and "expected m" in errors[0]
    assert restarts(box.actions) == []


@pytest.mark.parametrize("u", [unit(active_state="inactive"), unit(active_state="failed"), unit(load_state="not-found")])
def test_stopped_units_are_reported_not_started(u):
    box = Box(cfg(1))
    healthy_start(box)
    for t in range(200, 300, 5):
        box.tick(t, a=obs(t=t, health=TIMEOUT, u=u))
    assert box.state() == State.STOPPED and restarts(box.actions) == []


@pytest.mark.parametrize("until, now, state", [(None, 500, State.PAUSED), (600, 599, State.PAUSED),
                                               (600, 600, State.UNRESPONSIVE)])
def test_pause_boundary(until, now, state):
    box = Box(cfg(1))
    healthy_start(box, t0=1.0)
    box.persistent = PersistentView(pauses={"a": Pause(until)})
    box.tick(now - 20, a=obs(t=now - 20, health=TIMEOUT))
    box.tick(now, a=obs(t=now, health=TIMEOUT))
    assert box.state() == state


# --- restart checks: budget, back-off, one at a time, dry-run ---------------------------------------------

def stalled_sim(config, persistent=None, t=1000.0) -> tuple[Box, list]:
    box = Box(config, persistent)
    box.tick(t - 200, a=obs(t=t - 200))
    box.tick(t - 100, a=obs(t=t - 100, s=sample(gen=5, running=2)))
    actions = box.tick(t, a=obs(t=t, s=sample(gen=5, running=2)))
    assert box.state() == State.STALLED
    return box, actions


@pytest.mark.parametrize("ages, allowed", [
    ((), True),
    ((1800.0, 1900.0, 1000.0), True),  # oldest two are exactly at / past the window edge: not counted
    ((1799.0, 1000.0, 500.0), False),  # three inside the window: spent
])
def test_budget_window_boundary(ages, allowed):
    now = 5000.0
    box, actions = stalled_sim(cfg(1, restart_budget=3, restart_window_s=1800, backoff_s=0),
                               PersistentView(restarts={"a": tuple(now - a for a in ages)}), t=now)
    assert bool(restarts(actions)) == allowed
    if not allowed:
        crit = logs(actions, "critical")
        assert len(crit) == 1 and "budget spent" in crit[0] and "guardian resume a" in crit[0]
        box.tick(now + 5, a=obs(t=now + 5, s=sample(gen=5, running=2)))
        assert logs(box.actions, "critical") == crit  # said once, not every tick


def test_resume_resets_the_budget():
    now = 5000.0
    pv = PersistentView(restarts={"a": (now - 30, now - 20, now - 10)}, resumed_at={"a": now - 5})
    _, actions = stalled_sim(cfg(1, backoff_s=0), pv, t=now)
    assert restarts(actions)


@pytest.mark.parametrize("restart_ages, backoff_s, allowed", [
    ((59.0,), 60, False), ((60.0,), 60, True),  # first gap: backoff_s
    ((119.0, 300.0), 60, False), ((120.0, 300.0), 60, True),  # second gap: doubled
])
def test_backoff_boundary(restart_ages, backoff_s, allowed):
    now = 5000.0
    _, actions = stalled_sim(cfg(1, backoff_s=backoff_s), PersistentView(restarts={"a": tuple(now - a for a in restart_ages)}), t=now)
    assert bool(restarts(actions)) == allowed
    if not allowed:
        assert any("back-off" in m for m in logs(actions, "error"))


def test_one_restart_at_a_time_per_box():
    box = Box(cfg(2))
    t = 1000.0
    box.tick(t - 200)
    flat = sample(gen=5, running=2)
    box.tick(t - 100, a=obs("a", t - 100, s=flat), b=obs("b", t - 100, s=flat))
    actions = box.tick(t, a=obs("a", t, s=flat), b=obs("b", t, s=flat))
    assert [r.replica for r in restarts(actions)] == ["a"]
    assert any("one restart at a time" in m for m in logs(actions, "error"))
    # while a is starting again, b still waits
    actions = box.tick(t + 5, a=obs("a", t + 5, u=unit(active_state="activating")), b=obs("b", t + 5, s=flat))
    assert restarts(actions) == [] and box.state("a") == State.STARTING


def test_restart_outcome_clears_in_flight():
    box, actions = stalled_sim(cfg(1))
    assert restarts(actions) and box.tracks["a"].restart_in_flight
    box.tick(1001, a=obs(t=1001, health=TIMEOUT))
    assert box.state() == State.STARTING
    box.tick(1010, a=obs(t=1010, u=unit(inactive_exit_mono=1005.0), outcome=RestartOutcome("vllm-a.service", "done")))
    assert not box.tracks["a"].restart_in_flight and box.state() == State.HEALTHY
    assert any("serving again 10.0 s after guardian's restart" in m for m in logs(box.actions, "info"))


def test_dry_run_logs_what_it_would_do_once():
    config = cfg(1).model_copy(update={"dry_run": True})
    box, actions = stalled_sim(config)
    assert restarts(actions) == []
    warn = logs(actions, "warning")
    assert len(warn) == 1 and "DRY-RUN: would restart vllm-a.service" in warn[0]
    box.tick(1005, a=obs(t=1005, s=sample(gen=5, running=2)))
    assert len(logs(box.actions, "warning")) == 1


def test_unit_gate_refusal_is_logged_once_with_reason():
    box = Box(cfg(1))
    t = 1000.0
    u = unit(unit_file_state="disabled")
    box.tick(t - 200, a=obs(t=t - 200, u=u))
    for now in (t - 100, t, t + 1, t + 2):
        box.tick(now, a=obs(t=now, s=sample(gen=5, running=2), u=u))
    errors = logs(box.actions, "error")
    assert len(errors) == 1 and "disabled" in errors[0] and "systemctl enable vllm-a.service" in errors[0]
    assert restarts(box.actions) == []


# --- gates ------------------------------------------------------------------------------------

OWN = HeldBy(8001, 100, "vllm-a.service")


@pytest.mark.parametrize("u, owner, gate", [
    (unit(), OWN, None),
    (unit(unit_file_state="static"), OWN, None),
    (unit(active_state="activating"), OWN, None),
    (unit(), Nobody(8001), None),  # nobody listens: this unit's problem
    (unit(conflicts=(("old.service", "inactive"),)), OWN, None),
    (unit(load_state="masked", unit_file_state="masked"), OWN, "masked"),
    (unit(load_state="not-found", unit_file_state=""), OWN, "not-loaded"),
    (unit(unit_file_state="disabled"), OWN, "disabled"),
    (unit(active_state="inactive"), OWN, "inactive"),
    (unit(active_state="failed"), OWN, "inactive"),
    (unit(job_pending=True), OWN, "job-pending"),
    (unit(), HeldBy(8001, 4242, "impostor.service"), "port-owner"),
    (unit(), HeldBy(8001, None, "impostor.service"), "port-owner"),  # found by cgroup, its process gone
    (unit(), HeldBy(8001, None, "vllm-a.service"), None),
    (unit(), Hidden(8001), "port-unknown"),
    (unit(conflicts=(("old.service", "active"),)), OWN, "conflicts"),
    (unit(conflicts=(("old.service", "deactivating"),)), OWN, "conflicts"),
    (None, OWN, "dbus"),
])
def test_unit_gates(u, owner, gate):
    refusal = checked(gates.unit_refusal(u, owner))
    assert (refusal.gate if refusal else None) == gate
    if refusal is not None and u is not None:
        assert refusal.remedy


def test_refusals_name_what_would_be_hurt():
    r = checked(gates.unit_refusal(unit(conflicts=(("legacy.service", "active"),)), OWN))
    assert "would stop legacy.service (active)" in r.reason
    r = checked(gates.unit_refusal(unit(), HeldBy(8001, 4242, "impostor.service")))
    assert "impostor.service (pid 4242)" in r.reason
    r = checked(gates.unit_refusal(unit(), HeldBy(8001, None, "impostor.service")))
    assert "held by impostor.service, not by vllm-a.service" in r.reason


# --- hazards ----------------------------------------------------------------------------------

def test_hazards():
    config = cfg(2)
    units = {"vllm-a.service": unit(restart="on-failure"),
             "vllm-b.service": unit("vllm-b.service", unit_file_state="disabled")}
    found = {h.key: h.message for h in find_hazards(config, units, {"legacy.service": ("vllm-a.service",)})}
    assert "systemctl disable --now legacy.service" in found["conflict:legacy.service:vllm-a.service"]
    assert "Restart=always" in found["restart:vllm-a.service"]
    assert "disabled:vllm-b.service" in found
    # no hazard for a conflicting unit whose replica is not running
    units["vllm-a.service"] = unit(active_state="inactive")
    assert not any(k.startswith("conflict:") for k in (h.key for h in find_hazards(config, units, {"legacy.service": ("vllm-a.service",)})))


def test_hazard_missing_unit_and_shared_port():
    config = Config(replicas=[
        ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:8001", model="m"),
        ReplicaConfig(name="b", unit="vllm-b.service", url="http://192.0.2.7:8001", model="m"),
    ])
    units = {"vllm-a.service": unit(load_state="not-found", unit_file_state=""), "vllm-b.service": unit("vllm-b.service")}
    keys = {h.key for h in find_hazards(config, units, {})}
    assert {"port:8001", "missing:vllm-a.service"} <= keys


def test_garbage_metrics_is_said_once_and_never_grounds_for_a_restart():
    box = Box(cfg(1, stall_window_s=60))
    healthy_start(box)
    box.actions.clear()
    garbage = Probe(False, 200, 0.01, "unreadable: not Prometheus text: could not convert string to float")
    for t in range(200, 500, 5):
        o = replace(obs(t=t), metrics_probe=garbage, metrics=None)
        box.tick(t, a=o)
        assert box.state() == State.DEGRADED
    errors = logs(box.actions, "error")
    assert len(errors) == 1 and "/metrics unreadable" in errors[0] and "no restart" in errors[0]
    assert restarts(box.actions) == [] and not canaries(box.actions)


def test_failed_unit_is_restartable_only_for_the_memory_guards_retry():
    failed = unit(active_state="failed")
    assert checked(gates.unit_refusal(failed, OWN)).gate == "inactive"
    assert gates.unit_refusal(failed, OWN, allow_failed=True) is None
    assert checked(gates.unit_refusal(unit(active_state="inactive"), OWN, allow_failed=True)).gate == "inactive"


# --- every liveness rule, by id ---------------------------------------------------------------

def _after_healthy(*steps):
    """A replica healthy at t=100, then STEPS as (t, observation kwargs)."""
    def run():
        box = Box(cfg(1, stall_window_s=60, unresponsive_after_s=10, canary_failures=2))
        healthy_start(box)
        for t, kw in steps:
            o = kw.pop("_obs", None) or obs(t=t, **kw)
            box.tick(t, a=o)
        return box
    return run


def _paused():
    box = Box(cfg(1), PersistentView(pauses={"a": Pause(None)}))
    box.tick(100)
    return box


def _fresh(**kw):
    def run():
        box = Box(cfg(1))
        box.tick(100, a=obs(t=100, **kw))
        return box
    return run


FLAT = sample(gen=5, running=2)


@pytest.mark.parametrize("scenario, state, rule, evidence", [
    (_paused, State.PAUSED, "L1", "paused by operator until resumed"),
    (_after_healthy((110, {"_obs": replace(obs(t=110), unit=None, unit_error="D-Bus GetUnit timed out")})),
     State.UNKNOWN, "L2", "systemd not reachable: D-Bus GetUnit timed out"),
    (_after_healthy((110, {"u": unit(active_state="failed"), "health": TIMEOUT})), State.STOPPED, "L3",
     "unit vllm-a.service is failed"),
    (_after_healthy((110, {"port": HeldBy(8001, 4242, "app-squat.scope")})), State.PORT_TAKEN, "L4",
     "port 8001 is held by app-squat.scope, pid 4242, not by vllm-a.service"),
    (_after_healthy((110, {"u": unit(active_state="deactivating")})), State.STARTING, "L5", "unit deactivating"),
    (_fresh(health=TIMEOUT, u=unit(inactive_exit_mono=50.0)), State.STARTING, "L6", "loading for 50 s of 1200 s grace"),
    (_after_healthy((110, {"models": ("other",)})), State.WRONG_MODEL, "L7", "/v1/models lists other, expected m"),
    (_after_healthy((105, {"health": TIMEOUT}), (110, {"health": TIMEOUT})), State.UNRESPONSIVE, "L8",
     "no HTTP answer for 10 s (/health: timeout)"),
    (_after_healthy((105, {"health": DEAD_503}), (115, {"health": DEAD_503})), State.UNRESPONSIVE, "L9",
     "/health 503 (engine dead) for 10 s"),
    (_after_healthy((110, {"s": sample(gen=9, running=2), "health": SLOW})), State.BUSY, "L11",
     "/health took 2.5 s, but counters advance (2 running, 0 waiting)"),
    (_after_healthy((110, {"s": sample(gen=9, running=2)})), State.HEALTHY, "L12",
     "2 running, 0 waiting, tokens flowing"),
    (_after_healthy((110, {"s": FLAT}), (170, {"s": FLAT})), State.STALLED, "L13",
     "2 running, 0 waiting and no counter progress for 60 s"),
    (lambda: _quiet_queue_canary(QUEUED), State.STALLED, "L14",
     "12 running, 4 waiting, nothing moved for 25 s, and a canary sent 15 s ago failed"),
    (_after_healthy((110, {"canary": CanaryResult(False, 105, 2, "timeout")}),
                    (120, {"canary": CanaryResult(False, 115, 2, "timeout")})), State.IDLE_DEAD, "L15",
     "idle, and 2 canary completions failed in a row"),
    (_after_healthy((110, {"s": FLAT}), (120, {"s": FLAT, "health": SLOW_FAIL})), State.BUSY, "L16",
     "/health timeout, progress 10 s ago"),
    (_after_healthy((110, {"metrics_down": True})), State.DEGRADED, "L17", "/metrics: timeout"),
    (_after_healthy((110, {})), State.HEALTHY, "L18", "0 running, 0 waiting"),
    # no news: the standing verdict keeps its own evidence (L18's, from the tick at 100)
    (_after_healthy((102, {"_obs": replace(obs(t=102, health=TIMEOUT), probes_pending_s=1.0)})), State.HEALTHY, "L10",
     "0 running, 0 waiting"),
])
def test_each_liveness_rule_by_id(scenario, state, rule, evidence):
    box = scenario()
    assert (box.state(), box.rule()) == (state, rule)
    assert evidence in box.tracks["a"].evidence  # the verdict says why, with this case's own facts


# --- probes carried over (observe/replicas.py ProbeCarry): no news is not a verdict ----------------

def pending(t: float, for_s: float):
    return replace(obs(t=t, health=TIMEOUT), probes_pending_s=for_s)


@pytest.mark.parametrize("last_t, state, rule", [
    (109.9, State.HEALTHY, "L10"),  # just before unresponsive_after_s from the last answer (100)
    (110.0, State.UNRESPONSIVE, "L8"),  # at it: probes still in flight count as no answer
    (110.1, State.UNRESPONSIVE, "L8"),
])
def test_probes_in_flight_count_from_the_last_answer(last_t, state, rule):
    box = Box(cfg(1, unresponsive_after_s=10))
    healthy_start(box)
    t = 101.0
    while t < last_t - 0.5:
        box.tick(t, a=pending(t, t - 100.5))
        assert box.state() == State.HEALTHY
        t += 1.0
    box.tick(last_t, a=pending(last_t, last_t - 100.5))
    assert (box.state(), box.rule()) == (state, rule)


def test_a_replica_whose_probes_take_longer_than_half_an_interval_does_not_flap():
    """Under load, /health slow: every other tick has no news. The verdict must not flip each tick."""
    box = Box(cfg(1))
    healthy_start(box)
    gen = 10.0
    for i, t in enumerate(range(102, 160, 2)):
        if i % 2:
            box.tick(t, a=pending(t, 1.0))
        else:
            gen += 40
            box.tick(t, a=obs(t=t, s=sample(gen=gen, running=4), health=SLOW))
        assert box.state() in (State.BUSY, State.HEALTHY), (t, box.state())
    changes = [a for a in box.actions if isinstance(a, LogLine) and a.decision == Decision.STATE]
    assert len(changes) <= 2, [c.message for c in changes]


# --- canaries after traffic, for a quiet queue, with a learned deadline (issue 13) -----------------

def idle_after_traffic(after_s: float):
    """Healthy and idle; traffic (tokens moving) until 200, then nothing: a tick at 200 + AFTER_S."""
    box = Box(cfg(1, canary_after_traffic_s=5, canary_interval_s=30), LEARNED)
    healthy_start(box)
    box.tick(101, a=obs(t=101, canary=CanaryResult(True, 100.0, 0.1)))
    for i, t in enumerate(range(150, 201, 2)):
        box.tick(t, a=obs(t=t, s=sample(gen=10.0 * (i + 1))))
    box.actions.clear()
    frozen = sample(gen=10.0 * 26)  # counters as they stood at 200 (26 traffic ticks)
    box.tick(200 + after_s, a=obs(t=200 + after_s, s=frozen))
    return box


@pytest.mark.parametrize("after_s, sent", [(4.9, False), (5.0, True), (5.1, True)])
def test_a_canary_soon_after_traffic_stops(after_s, sent):
    """An engine frozen between two steps shows 0 running, 0 waiting and frozen counters while
    clients' requests wait in the API server: only a canary finds it, and it is sent
    canary_after_traffic_s after the traffic stopped, not canary_interval_s."""
    assert bool(canaries(idle_after_traffic(after_s).actions)) == sent


def test_after_the_traffic_canary_the_idle_interval_applies_again():
    box = idle_after_traffic(5.0)
    box.tick(206, a=obs(t=206, s=sample(gen=261.0), canary=CanaryResult(True, 205.0, 0.1)))
    box.actions.clear()
    for t in (210, 230, 235.0):
        box.tick(t, a=obs(t=t, s=sample(gen=261.0)))
    assert canaries(box.actions) == []  # the canary's own token is not traffic
    box.tick(236.2, a=obs(t=236.2, s=sample(gen=261.0)))
    assert len(canaries(box.actions)) == 1  # 30 s after the last canary (its progress at 206)


QUEUED = sample(gen=50, running=12, waiting=4)


@pytest.mark.parametrize("quiet_s, sent", [(9.9, False), (10.0, True)])
def test_a_quiet_queue_gets_a_canary_after_stall_canary_after_s(quiet_s, sent):
    box = Box(cfg(1, stall_canary_after_s=10), LEARNED)
    healthy_start(box)
    box.tick(101, a=obs(t=101, canary=CanaryResult(True, 100.0, 0.1)))
    box.tick(110, a=obs(t=110, s=sample(gen=40, running=12, waiting=4)))
    box.tick(112, a=obs(t=112, s=QUEUED))  # the last progress: 112
    box.actions.clear()
    box.tick(112 + quiet_s, a=obs(t=112 + quiet_s, s=QUEUED))
    assert bool(canaries(box.actions)) == sent


def _quiet_queue_canary(during: VllmSample, steps=SHORT_STEPS):
    box = Box(cfg(1, stall_canary_after_s=10, stall_window_s=60), PersistentView(step_seconds=steps))
    healthy_start(box)
    box.tick(110, a=obs(t=110, s=sample(gen=40, running=12, waiting=4)))
    box.tick(112, a=obs(t=112, s=QUEUED))
    box.tick(122, a=obs(t=122, s=QUEUED))  # canary sent at 122
    assert canaries(box.actions)
    box.tick(124, a=obs(t=124, s=during))
    box.tick(137, a=obs(t=137, s=during, canary=CanaryResult(False, 122.0, 15.0, "timeout")))
    return box


def test_a_canary_that_fails_while_nothing_moves_with_work_queued_is_a_stall():
    box = _quiet_queue_canary(QUEUED)
    assert (box.state(), box.rule()) == (State.STALLED, "L14")
    assert restarts(box.actions)


def test_a_canary_late_while_the_kv_cache_moves_proves_nothing():
    """A long chunked prefill: token counters flat, kv_cache_usage_perc rising with every chunk.
    The canary waits behind the prompt; it failing is no evidence."""
    box = _quiet_queue_canary(replace(QUEUED, kv_cache_usage=0.3))
    assert box.state() is not State.STALLED and not restarts(box.actions)


@pytest.mark.parametrize("latencies, deadline", [
    ((), 15.0),  # nothing learned yet: the replica's canary_timeout_s
    ((0.1, 0.2), 15.0),  # fewer than 3
    ((0.1, 0.2, 0.3), 3.0),  # 4 x 0.3 = 1.2, raised to the floor
    ((0.5, 1.0, 2.0), 8.0),  # 4 x the slowest
    ((5.0, 1.0, 1.0), 15.0),  # capped at canary_timeout_s
])
def test_canary_deadline_is_learned_within_floor_and_ceiling(latencies, deadline):
    r = cfg(1).replicas[0]
    w = WatchdogConfig(canary_deadline_factor=4, canary_deadline_floor_s=3)
    assert canary_deadline(Track(canary_latencies=latencies), r, w) == pytest.approx(deadline)


# --- judging at the deadline, not at the next tick mark ------------------------------------

def _failing_since(t_answer: float, t_fail: float, health=TIMEOUT) -> Box:
    box = Box(cfg(1, unresponsive_after_s=10))  # interval 2 s: probes waited for up to 1 s
    healthy_start(box, t0=t_answer)  # the last answer
    box.tick(t_fail, a=obs(t=t_fail, health=health))
    return box


@pytest.mark.parametrize("last_started, now, expected", [
    (202.0, 203.0, 204.0),  # deadline 210 is far: the next tick mark
    (207.5, 208.2, 209.0),  # before the mark (209.5): the tick starts 1 s (the probe wait) before 210
    (208.0, 208.9, 209.0),  # 209 is before the mark 210
    (208.0, 209.1, 210.0),  # a tick that judged just after 209, short of the deadline: at the deadline
    (208.0, 210.0, 210.0),  # the deadline reached (the verdict was given): the mark, nothing earlier
])
def test_the_next_tick_judges_at_the_unresponsive_deadline(last_started, now, expected):
    box = _failing_since(200.0, 202.0)
    assert next_deadline(box.tracks["a"], box.cfg.watchdog) == 210.0
    assert tick.next_tick_at(box.core, last_started, now, box.cfg) == pytest.approx(expected)


def test_a_deadline_counts_from_the_later_of_the_last_answer_and_the_last_progress():
    box = Box(cfg(1, unresponsive_after_s=10))
    healthy_start(box, t0=200.0, a=obs(t=200.0, s=sample(gen=5)))
    box.tick(203, a=obs(t=203, health=Probe(True, 503, 0.01, "HTTP 503"), s=sample(gen=9)))  # 503, yet progress
    assert next_deadline(box.tracks["a"], box.cfg.watchdog) == 213.0


@pytest.mark.parametrize("setup", ["healthy", "stopped", "unresponsive"])
def test_no_deadline_for_a_replica_that_answers_is_down_or_already_judged(setup):
    box = Box(cfg(1, unresponsive_after_s=10), LEARNED)
    healthy_start(box, t0=200.0)
    if setup == "healthy":  # its canary answered: nothing in flight, no work queued
        box.tick(201, a=obs(t=201, canary=CanaryResult(True, 200.0, 0.1)))
        assert box.tracks["a"].canary_due_at is None
    if setup == "stopped":
        box.tick(202, a=obs(t=202, u=unit(active_state="inactive")))
    elif setup == "unresponsive":
        box.tick(205, a=obs(t=205, health=TIMEOUT))
        box.tick(210, a=obs(t=210, health=TIMEOUT))
        assert box.state() is State.UNRESPONSIVE
    assert next_deadline(box.tracks["a"], box.cfg.watchdog) is None
    assert tick.next_tick_at(box.core, 210.0, 210.5, box.cfg) == 212.0


@pytest.mark.parametrize("now, wait", [
    (205.0, 1.0),  # deadline 210 far: the whole probe wait (interval / 2)
    (209.4, 0.6),  # not past the deadline: judged at it
    (209.98, 0.05),  # at least the floor, for the replicas that answer
    (210.0, 0.05),
])
def test_a_tick_waits_for_its_probes_no_longer_than_a_replicas_deadline(now, wait):
    box = _failing_since(200.0, 202.0)
    assert tick.probe_wait_s(box.core, now, box.cfg) == pytest.approx(wait)


def test_with_no_deadline_a_tick_waits_half_an_interval():
    box = Box(cfg(1))
    healthy_start(box, t0=200.0)
    assert tick.probe_wait_s(box.core, 201.0, box.cfg) == pytest.approx(1.0)


@pytest.mark.parametrize("during, counts", [
    (sample(gen=1), False),  # the canary's own token and request
    (sample(gen=1, running=1), False),  # the canary itself, running
    (sample(gen=4), True),  # three tokens more than a canary makes: clients' requests
    (sample(gen=1, running=2), True),  # a request beside the canary
])
def test_traffic_while_a_canary_runs_is_still_traffic(during, counts):
    """A short batch of clients' requests that starts and ends while guardian's canary is in
    flight: it must still count as traffic, or no canary follows it (an engine frozen right
    after it would be found by the 30 s idle cycle instead)."""
    box = Box(cfg(1, canary_after_traffic_s=5, canary_interval_s=30), LEARNED)
    healthy_start(box)
    box.tick(101, a=obs(t=101, canary=CanaryResult(True, 100.0, 0.1)))
    box.tick(131, a=obs(t=131))  # the idle canary is due: sent
    assert box.tracks["a"].canary_in_flight_since == 131
    box.tick(132, a=obs(t=132, s=during))
    assert (box.tracks["a"].last_traffic_at == 132) == counts


# --- the kernel's view (issue 20): responses flowing are progress, waiting clients queued work -----

def starved(t: float, flowing: int) -> ReplicaObservation:
    """Every endpoint times out (the API server's loop is starved); the kernel sees FLOWING streams."""
    return replace(obs(t=t, health=TIMEOUT), conns=conns(flowing=flowing, bytes_out=4000 * flowing))


def test_a_replica_whose_endpoints_all_time_out_while_responses_flow_is_never_unresponsive():
    """The false restart measured on a real vLLM 0.32 (issue 20): /health, /metrics and /v1/models
    unanswered for 11 s while 5 streams kept delivering tokens; guardian killed it."""
    box = Box(cfg(1, unresponsive_after_s=10))
    healthy_start(box)
    for t in range(102, 160, 2):
        box.tick(t, a=starved(t, flowing=5))
        assert box.state() in (State.HEALTHY, State.BUSY), (t, box.state(), box.rule())
    assert not restarts(box.actions)
    assert box.rule() == "L11" and "responses flowing to 5 client connection(s), 20000 bytes" in box.tracks["a"].evidence


def test_a_partial_kernel_view_is_no_evidence_of_flow_so_a_frozen_replica_is_still_unresponsive():
    """Issue 34 row 11: 27,000 sockets of another user filled the 50,000-socket bound; a view cut
    there counts no response as flowing, so L8 runs its window as without the kernel's view."""
    box = Box(cfg(1, unresponsive_after_s=10))
    healthy_start(box)
    for t in range(102, 160, 2):
        partial = replace(starved(t, flowing=5), conns=replace(conns(flowing=5, bytes_out=20000), truncated=True))
        box.tick(t, a=partial)
        if restarts(box.actions):
            break
    assert restarts(box.actions) and box.rule() == "L8", (box.state(), box.rule(), box.tracks["a"].evidence)


@pytest.mark.parametrize("last_flow_t, t, state, rule", [
    (120.0, 129.9, State.BUSY, "L16"),  # 9.9 s after the last response flowed: not yet
    (120.0, 130.0, State.UNRESPONSIVE, "L8"),  # at unresponsive_after_s: a frozen server sends nothing
    (120.0, 130.1, State.UNRESPONSIVE, "L8"),
])
def test_when_the_flow_stops_too_the_window_runs_from_the_last_response_that_flowed(last_flow_t, t, state, rule):
    box = Box(cfg(1, unresponsive_after_s=10))
    healthy_start(box)
    tt = 102.0
    while tt <= last_flow_t:
        box.tick(tt, a=starved(tt, flowing=3))
        tt += 2.0
    while tt < t - 1.0:
        box.tick(tt, a=starved(tt, flowing=0))
        tt += 2.0
    box.tick(t, a=starved(t, flowing=0))
    assert (box.state(), box.rule()) == (state, rule)


def test_a_sigstopped_server_is_unresponsive_in_the_usual_window_with_its_kernel_view_read():
    box = Box(cfg(1, unresponsive_after_s=10))
    healthy_start(box)
    for t in (102.0, 104.0, 106.0, 108.0, 109.9):
        box.tick(t, a=replace(obs(t=t, health=TIMEOUT), conns=conns(cpu_s=0.0)))
    assert box.state() != State.UNRESPONSIVE
    box.tick(110.0, a=replace(obs(t=110.0, health=TIMEOUT), conns=conns(cpu_s=0.0)))
    assert (box.state(), box.rule()) == (State.UNRESPONSIVE, "L8")
    assert restarts(box.actions)


def frozen_between_steps(oldest_wait_s_at: callable, until: float, canary=None):  # noqa: ANN001
    """Healthy and idle at 100 (3 canaries learned), frozen counters from 110; clients waiting as told."""
    box = Box(cfg(1, stall_canary_after_s=10, client_wait_s=3, canary_interval_s=30), LEARNED)
    healthy_start(box)
    frozen = sample()  # the counters as they stood at 100: nothing moves from here on
    box.tick(101, a=obs(t=101, s=frozen, canary=CanaryResult(True, 100.0, 0.1)))  # the idle canary at 100
    box.actions.clear()
    t = 102.0
    while t <= until:
        wait = oldest_wait_s_at(t)
        c = conns(waiting=4 if wait > 0 else 0, oldest_wait_s=max(0.0, wait))
        box.tick(t, a=replace(obs(t=t, s=frozen, canary=canary(t) if canary else None), conns=c))
        t += 1.0
    return box


@pytest.mark.parametrize("oldest_wait_s, queued", [(2.9, False), (3.0, True), (3.1, True)])
def test_clients_waiting_at_least_client_wait_s_are_queued_work(oldest_wait_s, queued):
    box = frozen_between_steps(lambda t: oldest_wait_s if t == 130 else 0.0, until=130)
    assert (box.tracks["a"].work_since is not None) == queued
    if queued:
        assert box.tracks["a"].work_since == pytest.approx(130 - oldest_wait_s)
        assert "4 client(s) waiting for an answer" in box.tracks["a"].evidence


def test_an_engine_frozen_between_steps_with_clients_waiting_gets_a_stall_canary_then_is_stalled():
    """0 running, 0 waiting, frozen counters, /health 200: only the waiting clients say work is queued."""
    def wait_from_110(t: float) -> float:
        return t - 110.0

    box = frozen_between_steps(wait_from_110, until=119)
    assert not canaries(box.actions)  # 9 s since the work was queued
    box = frozen_between_steps(wait_from_110, until=120)
    sent = canaries(box.actions)
    assert len(sent) == 1  # stall_canary_after_s after the oldest client started waiting
    failed = CanaryResult(False, 120.0, 3.0, "timeout")
    box = frozen_between_steps(wait_from_110, until=124, canary=lambda t: failed if t == 124 else None)
    assert (box.state(), box.rule()) == (State.STALLED, "L14")
    assert restarts(box.actions)


def test_an_idle_keep_alive_or_a_long_answer_with_counters_moving_is_not_a_stall():
    box = Box(cfg(1, stall_canary_after_s=10, client_wait_s=3), LEARNED)
    healthy_start(box)
    box.tick(101, a=obs(t=101, canary=CanaryResult(True, 100.0, 0.1)))  # the idle canary at 100
    box.actions.clear()
    for i, t in enumerate(range(102, 200, 2)):  # 4 clients waiting on long non-streaming answers
        moving = sample(gen=10.0 * i, running=4)
        box.tick(t, a=replace(obs(t=t, s=moving), conns=conns(waiting=4, oldest_wait_s=float(t - 100))))
        assert box.state() == State.HEALTHY
    assert not canaries(box.actions) and not restarts(box.actions)


# --- learned canary deadlines: kept in the state file, learned within seconds (issue 20) ----------

STARTED_95 = unit(inactive_exit_mono=95.0)  # the idle interval's first canary is due at 125


def started_at_95(t: float, **kw) -> ReplicaObservation:
    return obs(t=t, u=STARTED_95, **kw)


def late_mark(box: Box) -> float | None:
    """The learned deadline the canary in flight was marked late at (seconds after it was sent)."""
    t = box.tracks["a"]
    return t.canary_late_at - t.canary_in_flight_since if t.canary_late_at is not None else None


def sent_at(box: Box) -> dict[float, float]:
    """When each canary was asked for -> its deadline."""
    return {box.tracks["a"].canary_in_flight_since: a.timeout_s for a in canaries(box.actions)}


def test_a_replica_that_first_serves_with_nothing_learned_gets_a_canary_at_each_tick_until_3_succeed():
    """Measured on a real vLLM (issue 20): an engine frozen 77 s after guardian started was found
    only at the unlearned 15 s deadline. Now the deadline is learned in the first seconds."""
    box = Box(cfg(1, canary_interval_s=30))
    asked: dict[float, float] = {}
    for t, canary in ((100.0, None), (102.0, CanaryResult(True, 100.0, 0.5)), (104.0, CanaryResult(True, 102.0, 0.6)),
                      (106.0, CanaryResult(True, 104.0, 0.7))):
        box.actions.clear()
        box.tick(t, a=started_at_95(t, canary=canary))
        asked |= sent_at(box)
        assert box.state() is State.HEALTHY
    assert asked == {100.0: 15.0, 102.0: 15.0, 104.0: 15.0}  # one a tick, at canary_timeout_s until 3 succeeded
    assert box.tracks["a"].canary_latencies == (0.5, 0.6, 0.7) and box.tracks["a"].learning_canaries == 3
    box.actions.clear()
    for t in range(108, 136):  # idle, nothing learned is missing: the interval applies (30 s after 106)
        box.tick(float(t), a=started_at_95(float(t)))
    assert canaries(box.actions) == []
    box.tick(136.0, a=started_at_95(136.0))
    # sent with the hard bound; late past the learned 4 x 0.7 = 2.8, raised to the floor (C2)
    assert [a.timeout_s for a in canaries(box.actions)] == [15.0] and late_mark(box) == 3.0


def test_learning_canaries_are_at_most_3_even_when_they_fail_and_a_restart_of_the_replica_gives_no_more():
    box = Box(cfg(1, canary_interval_s=30, canary_retry_s=30, canary_failures=5))
    asked: dict[float, float] = {}
    for t in (100.0, 102.0, 104.0, 106.0, *range(108, 136)):
        box.actions.clear()
        failed = CanaryResult(False, t - 2, 2.0, "timeout") if t in (102.0, 104.0, 106.0) else None
        box.tick(t, a=started_at_95(t, canary=failed))
        asked |= sent_at(box)
    assert asked == {100.0: 15.0, 102.0: 15.0, 104.0: 15.0}  # degraded after a failure: still one a tick
    assert LEARNING_CANARIES == 3 and box.tracks["a"].learning_canaries == 3
    assert box.tracks["a"].canary_failures == 3 and box.state() is State.DEGRADED  # counted as any failure
    assert box.tracks["a"].canary_latencies == ()
    box.actions.clear()
    restarted = unit(inactive_exit_mono=140.0)  # the replica restarted (by anyone): serving again at 141
    for t in range(141, 170):
        box.tick(float(t), a=obs(t=float(t), u=restarted))
        assert box.state() is State.HEALTHY
    assert canaries(box.actions) == []  # no burst again: its first canary is the idle interval's, at 170
    box.tick(170.0, a=obs(t=170.0, u=restarted))
    assert [a.timeout_s for a in canaries(box.actions)] == [15.0]


def test_a_replica_whose_latencies_the_state_file_kept_gets_its_learned_deadline_at_once_and_no_burst():
    box = Box(cfg(1, canary_interval_s=30), PersistentView(canary_latencies={"a": (0.5, 1.0, 2.0)}))
    for t in range(100, 125):
        box.tick(float(t), a=started_at_95(float(t)))
    assert canaries(box.actions) == [] and box.tracks["a"].learning_canaries == 0
    assert not [a for a in box.actions if isinstance(a, RecordCanaryLatencies)]  # read, not changed
    box.tick(125.0, a=started_at_95(125.0))
    assert [a.timeout_s for a in canaries(box.actions)] == [15.0] and late_mark(box) == 8.0  # 4 x 2.0


def test_a_replica_with_fewer_than_3_kept_gets_only_the_canaries_it_misses():
    box = Box(cfg(1, canary_interval_s=30), PersistentView(canary_latencies={"a": (0.5, 1.0)}))
    box.tick(100.0, a=started_at_95(100.0))
    box.tick(102.0, a=started_at_95(102.0, canary=CanaryResult(True, 100.0, 0.4)))
    box.tick(104.0, a=started_at_95(104.0))
    assert [a.timeout_s for a in canaries(box.actions)] == [15.0]
    assert box.tracks["a"].canary_latencies == (0.5, 1.0, 0.4) and box.tracks["a"].learning_canaries == 1


def test_a_track_that_exists_keeps_its_own_latencies_whatever_the_state_file_says():
    box = Box(cfg(1), LEARNED)
    healthy_start(box)
    box.persistent = PersistentView(canary_latencies={"a": (9.0, 9.0, 9.0)})  # written since (a reload re-reads)
    box.tick(102.0)
    assert box.tracks["a"].canary_latencies == (0.1, 0.1, 0.1)


def test_learned_latencies_go_to_the_state_file_once_per_change_and_a_new_guardian_starts_from_them():
    """A guardian restarted: the latencies the first one recorded seed the second one's tracks."""
    box = Box(cfg(1, canary_interval_s=30))
    records: list[list] = []
    for t, canary in ((100.0, None), (102.0, CanaryResult(True, 100.0, 0.5)), (103.0, None),
                      (104.0, CanaryResult(True, 102.0, 0.6)), (105.0, None), (106.0, CanaryResult(True, 104.0, 0.7)),
                      (107.0, None)):
        acts = box.tick(t, a=started_at_95(t, canary=canary))
        records.append([a for a in acts if isinstance(a, RecordCanaryLatencies)])
    assert [len(r) for r in records] == [0, 1, 0, 1, 0, 1, 0]  # only at ticks where a canary succeeded
    assert records[-2] == [RecordCanaryLatencies((("a", (0.5, 0.6, 0.7)),))]
    again = Box(cfg(1, canary_interval_s=30), PersistentView(canary_latencies=dict(records[-2][0].latencies)))
    for t in range(200, 230):
        again.tick(float(t), a=obs(t=float(t), u=unit(inactive_exit_mono=200.0)))
    again.tick(230.0, a=obs(t=230.0, u=unit(inactive_exit_mono=200.0)))
    assert [a.timeout_s for a in canaries(again.actions)] == [15.0] and late_mark(again) == 3.0  # learned: no burst


@pytest.mark.parametrize("t, state", [(127.4, State.BUSY), (127.5, State.UNRESPONSIVE)])
def test_the_window_runs_from_the_last_byte_that_flowed_not_from_the_look_that_saw_it(t, state):
    """A frozen server's last bytes are acked after the freeze: the look after it still sees a flow,
    sent 0.5 s before that look (tcpi_last_data_sent). L8 counts from the send, not the look."""
    box = Box(cfg(1, unresponsive_after_s=10))
    healthy_start(box)
    for tt in (102.0, 104.0, 106.0, 118.0):
        box.tick(tt, a=replace(starved(tt, flowing=3), conns=conns(flowing=3, bytes_out=100) if tt < 118
                               else replace(conns(flowing=3, bytes_out=100), last_flow_s=0.5)))
    assert box.tracks["a"].last_progress_at == 117.5
    box.tick(t, a=starved(t, flowing=0))
    assert box.state() == state, (box.state(), box.rule())


def test_a_canary_in_flight_and_a_stall_canary_falling_due_are_deadlines_of_their_own():
    """The tick lands on them (next_tick_at), not up to an interval later: an engine frozen between
    steps with clients waiting is judged as soon as its canary's deadline passes."""
    box = Box(cfg(1, stall_canary_after_s=10, client_wait_s=3), LEARNED)
    healthy_start(box)
    # the canary sent at 100: late at its learned deadline (the floor), failed only at canary_timeout_s
    assert (box.tracks["a"].canary_late_at, box.tracks["a"].canary_due_at) == (103.0, 115.0)
    # the first moment its verdict may change: the late mark, where a closer look may be due
    assert next_deadline(box.tracks["a"], box.cfg.watchdog) == 103.0
    box.tick(101, a=obs(t=101, canary=CanaryResult(True, 100.0, 0.1)))
    assert next_deadline(box.tracks["a"], box.cfg.watchdog) is None
    box.tick(104, a=replace(obs(t=104), conns=conns(waiting=4, oldest_wait_s=3.0)))  # queued since 101
    assert box.tracks["a"].work_since == 101.0
    assert next_deadline(box.tracks["a"], box.cfg.watchdog) == 111.0
    # the tick starts a probe wait early, so that its judgment lands on the due moment
    assert tick.next_tick_at(box.core, 108.5, 109.0, box.cfg) == pytest.approx(111.0 - box.cfg.probe_wait_s)


def test_a_replica_never_idle_still_learns_its_canary_deadline():
    """Measured in the container: 4 clients looping kept the replica busy from its first tick, no
    learning canary went out, and when its engine froze the first canary had the unlearned 15 s."""
    box = Box(cfg(1))
    for i, t in enumerate((100.0, 102.0, 104.0, 106.0)):
        done = CanaryResult(True, t - 2.0, 0.4) if i else None
        box.tick(t, a=obs(t=t, s=sample(gen=10.0 * (i + 1), running=4), canary=done))
    sent = canaries(box.actions)
    assert len(sent) == 3 and all(c.timeout_s == 15.0 for c in sent)  # one a tick until 3 succeeded
    assert canary_deadline(box.tracks["a"], box.cfg.replicas[0], box.cfg.watchdog) == pytest.approx(3.0)


def test_clients_that_waited_before_guardian_first_looked_are_not_a_stall_at_its_first_tick():
    """guardian (re)started while a long non-streaming answer was being computed: the client had
    waited 90 s. Counting its wait from before guardian watched made L13 fire at once."""
    box = Box(cfg(1), LEARNED)
    box.tick(100.0, a=replace(obs(t=100.0, s=sample(gen=5000, running=1)), conns=conns(waiting=1, oldest_wait_s=90)))
    assert box.state() != State.STALLED and not restarts(box.actions)
    assert box.tracks["a"].work_since == 100.0


def test_a_client_stuck_since_before_the_last_good_canary_is_not_queued_work():
    """An upload stuck half-way (uvicorn has no timeout for it) waits for ever; once a canary has
    succeeded after it began, it says nothing about the engine, and one failed canary is no stall."""
    box = Box(cfg(1, client_wait_s=3), LEARNED)
    healthy_start(box)
    stuck = lambda t: replace(conns(waiting=1, oldest_wait_s=t - 90.0), at=t)  # noqa: E731
    box.tick(101, a=replace(obs(t=101, canary=CanaryResult(True, 100.0, 0.1)), conns=stuck(101)))
    assert box.tracks["a"].work_since is None  # it began at 90, before the canary that succeeded at 100
    box.tick(140, a=replace(obs(t=140, canary=CanaryResult(False, 131.0, 3.0, "timeout")), conns=stuck(140)))
    assert box.state() != State.STALLED and not restarts(box.actions)


def test_times_from_the_kernel_count_from_when_it_was_read_not_from_the_judgment():
    """The tick reads the kernel at its start and judges after its probe wait (1 s here)."""
    box = Box(cfg(1), LEARNED)
    healthy_start(box)
    for t in (102.0, 104.0):
        box.tick(t, a=replace(obs(t=t), conns=replace(conns(flowing=2, bytes_out=10), last_flow_s=0.5, at=t - 1.0)))
    assert box.tracks["a"].last_progress_at == 104.0 - 1.0 - 0.5


def test_a_deadline_already_past_does_not_shorten_every_tick_and_a_lost_canary_is_forgotten():
    """A stall canary that cannot be sent (/health failing) leaves its due moment in the past; and
    a canary whose result never came (the executor lost it) would block every later canary."""
    box = Box(cfg(1, stall_canary_after_s=10, unresponsive_after_s=100), LEARNED)
    healthy_start(box)
    box.tick(101, a=obs(t=101, s=sample(running=4), canary=CanaryResult(True, 100.0, 0.1)))  # queued from 101
    slow = Probe(False, None, 2.0, "timeout")  # /health times out, /metrics answers: no canary can go
    box.tick(113, a=replace(obs(t=113, s=sample(running=4)), health=slow))
    assert box.state() is State.BUSY and next_deadline(box.tracks["a"], box.cfg.watchdog) == 111.0
    assert tick.probe_wait_s(box.core, 113.5, box.cfg) == pytest.approx(1.0)  # not the 0.05 floor
    s2 = Box(cfg(1), LEARNED)
    healthy_start(s2)  # its canary went out at 100, due at 115 (canary_timeout_s)
    s2.tick(145.0)
    assert s2.tracks["a"].canary_due_at == 115.0  # not yet given up: 30 s past its deadline
    s2.tick(145.5)
    assert s2.tracks["a"].canary_in_flight_since is None or s2.tracks["a"].canary_in_flight_since == 145.5
    assert s2.tracks["a"].canary_due_at != 115.0


# --- a stray on the replica's address (issue 34 row 13) -----------------------------------------

STRAY = HeldBy(8001, 4242, "docker.service", container="stray", via="docker-proxy", stray=True)


def container_cfg():
    c = cfg(1)
    return c.model_copy(update={"replicas": [c.replicas[0].model_copy(update={"container": "vllm-a"})]})


def test_a_stray_answering_while_the_unit_crash_loops_never_makes_it_healthy():
    """The unit starts, its container cannot bind, it fails, it starts again; a stray answers on the
    port all along with the right model: the verdict is port-taken, said once as an error, never
    healthy, and nothing is restarted."""
    box = Box(container_cfg())
    for i, t in enumerate(range(10, 200, 2)):
        phase = ("activating", "active", "failed")[i % 3]
        u = unit(active_state=phase, inactive_exit_mono=float(t - t % 6))
        box.tick(t, a=obs(t=t, u=u, s=sample(gen=i), port=STRAY))
        assert box.state() in (State.PORT_TAKEN, State.STOPPED), (t, box.state())
    assert restarts(box.actions) == []
    errors = [m for m in logs(box.actions, "error") if "port-taken" in m]
    assert errors and all("container stray (docker-proxy)" in m and "not restarting" in m for m in errors)
    assert not any("-> healthy" in m for m in logs(box.actions, "info"))


def test_a_strays_answers_do_not_end_the_replicas_startup_grace():
    """Answers from the stray are not folded in: once it is gone, the replica that never answered
    is still loading in its grace (L6), not judged from a health it never gave."""
    box = Box(cfg(1))
    for t in (10.0, 12.0, 14.0):
        box.tick(t, a=obs(t=t, port=HeldBy(8001, 4242, "app-squat.scope")))
        assert (box.state(), box.rule()) == (State.PORT_TAKEN, "L4")
    box.tick(16.0, a=obs(t=16.0, health=TIMEOUT, port=Nobody(8001)))
    assert (box.state(), box.rule()) == (State.STARTING, "L6")
    assert box.tracks["a"].canary_latencies == ()


@pytest.mark.parametrize("owner, state", [
    # a container holder the engine has not named yet may be the replica's own: judged as such
    (HeldBy(8001, 4242, "docker.service", via="docker-proxy"), State.HEALTHY),
    # the replica's own container, named by its engine
    (HeldBy(8001, 4242, "docker.service", container="vllm-a", own_container=True), State.HEALTHY),
    # guardian could not map the process to a unit: unknown, not another's
    (HeldBy(8001, 4242, None), State.HEALTHY),
    (Hidden(8001), State.HEALTHY),
    (STRAY, State.PORT_TAKEN),
    (HeldBy(8001, 4242, "app-x.scope", container="other", via="conmon", stray=True), State.PORT_TAKEN),
])
def test_only_a_holder_known_to_be_anothers_takes_the_answers_away(owner, state):
    box = Box(container_cfg())
    box.tick(100.0, a=obs(t=100.0, port=owner))
    assert box.state() == state


# --- "serves": one definition for the drain, the memory guard's peers and the fleet (issue 35 item 3) ---

from guardian.core.watchdog.judge import SERVED_RECENTLY_S, serves  # noqa: E402

METRICS_LATE = {"_obs": replace(obs(t=0), metrics_probe=replace(TIMEOUT, error="no answer yet (in flight for 1.1 s)"),
                                metrics=None)}


def _then(t: float, **kw) -> dict:
    """Observation kwargs at T; METRICS_LATE-style entries carry a whole observation, moved to T."""
    if "_obs" in kw:
        return {"_obs": replace(kw["_obs"], at=t)}
    return kw


@pytest.mark.parametrize("steps, now, expected", [
    ([], 100.0, True),  # healthy at 100
    ([(102, _then(102, **METRICS_LATE))], 102.0, True),  # degraded: /metrics late, /health in time
    ([(102 + i, _then(102 + i, **METRICS_LATE)) for i in range(0, 30, 2)], 130.0, True),  # for as long as it lasts
    ([(102, {"health": TIMEOUT, "metrics_down": True})], 102.0, True),  # no answer at all, served 2 s ago
    ([(102, {"health": TIMEOUT})], 100.0 + SERVED_RECENTLY_S + 0.5, False),  # ... but not 10 s on
    ([(102, {"health": DEAD_503})], 102.0, False),  # a 503 says the engine died
    ([(110, {"canary": CanaryResult(False, 105, 2, "timeout")})], 110.0, False),  # a failed canary
    ([(102, {"models": ("other",)})], 102.0, False),  # wrong model
    ([(102, {"u": unit(active_state="activating")})], 102.0, False),  # starting
])
def test_serves_is_evidence_of_serving_within_the_last_few_seconds(steps, now, expected):
    box = _after_healthy(*steps)()
    assert serves(box.tracks["a"], now) is expected, box.tracks["a"]


def test_no_news_is_no_evidence_of_serving():
    """Probes in flight (L10) keep the verdict, not the evidence: a replica with no answer for
    longer than SERVED_RECENTLY_S does not serve, whatever its standing verdict."""
    box = Box(cfg(1, unresponsive_after_s=30))
    healthy_start(box)
    for t in (102.0, 106.0, 111.0):
        box.tick(t, a=replace(obs(t=t, health=TIMEOUT), probes_pending_s=t - 100.0))
    assert box.rule() == "L10" and box.state() is State.HEALTHY
    assert not serves(box.tracks["a"], 111.0)


# --- a late answer is an answer (issue 35 items 1 and 2: C1-C4) -----------------------------------

def test_idle_canaries_late_past_the_learned_deadline_are_slow_not_failed_and_said_once():
    """Issue 35's false idle-dead: b, idle, learned 0.1 s canaries on an idle box; then the box is
    saturated and its canaries answer in 5-7 s. Each is slow (C2), never a failure: no restart, one
    info line for the spell, and the latencies learned, so the deadline follows the load."""
    box = Box(cfg(1, canary_interval_s=30, canary_failures=2), LEARNED)
    healthy_start(box)
    box.tick(101.0, a=obs(t=101.0, canary=CanaryResult(True, 100.0, 0.1)))
    t = 101.0
    for latency in (5.0, 6.0, 7.0, 5.5):
        sent = t + 30.0
        box.tick(sent, a=obs(t=sent))
        assert box.tracks["a"].canary_in_flight_since == sent
        box.tick(sent + latency + 0.2, a=obs(t=sent + latency + 0.2, canary=CanaryResult(True, sent, latency)))
        assert box.state() is State.HEALTHY and box.tracks["a"].canary_failures == 0
        t = sent + latency + 0.2
    assert restarts(box.actions) == []
    slow = [a for a in said(box.actions) if a.rule == "C2"]
    assert len(slow) == 1 and slow[0].priority == "info" and "past its learned deadline of 3.0 s" in slow[0].message
    assert box.tracks["a"].canary_latencies[-4:] == (5.0, 6.0, 7.0, 5.5)
    deadline = canary_deadline(box.tracks["a"], box.cfg.replicas[0], box.cfg.watchdog)
    assert deadline == 15.0  # 4 x 7.0, within canary_timeout_s: the next late mark follows the box


@pytest.mark.parametrize("canary, during, counted, rule", [
    (CanaryResult(True, 100.0, 0.5), {}, False, "C1"),
    (CanaryResult(True, 100.0, 9.0), {}, False, "C2"),
    # no answer at canary_timeout_s, but tokens were counted at the tick that brings its result
    (CanaryResult(False, 100.0, 15.0, "timeout"), {"s": sample(gen=40, running=0)}, False, "C3"),
    # ... or the replica's process wrote to a client while it ran
    (CanaryResult(False, 100.0, 15.0, "timeout"), {"_conns": conns(flowing=1, bytes_out=900)}, False, "C3"),
    (CanaryResult(False, 100.0, 15.0, "timeout"), {}, True, "C4"),
    (CanaryResult(False, 100.0, 0.1, "HTTP 500"), {}, True, "C4"),
])
def test_what_a_canarys_result_means(canary, during, counted, rule):
    box = Box(cfg(1), LEARNED)
    healthy_start(box)  # its canary is sent at 100
    kw = dict(during)
    c = kw.pop("_conns", None)
    o = obs(t=115.5, canary=canary, **kw)
    box.tick(115.5, a=replace(o, conns=c) if c is not None else o)
    assert box.tracks["a"].canary_failures == (1 if counted else 0)
    lines = [a.rule for a in said(box.actions) if a.rule and a.rule.startswith("C")]
    assert lines == (["C2"] if rule == "C2" else [])
    from guardian.core.rules import first_match
    from guardian.core.watchdog.canary import CANARY_ROWS, _CanaryBack

    found = first_match(CANARY_ROWS, _CanaryBack(canary, 3.0, bool(during)))
    assert found is not None and found[0].id == rule


# --- a quiet journal (issue 35 item 6) -----------------------------------------------------------

def state_lines(box: Box) -> list[str]:
    return [a.message for a in said(box.actions) if a.decision is Decision.STATE]


def test_a_verdict_that_returns_within_say_after_s_is_not_said():
    """Issue 35: b changed state 14 times in 100 s while it served (/metrics late by a second, back
    2-7 s later). Each change is in the track (status, metrics); the journal says none of them."""
    box = Box(cfg(1), LEARNED)
    healthy_start(box)
    box.actions.clear()
    late = replace(obs(t=0), metrics_probe=replace(TIMEOUT, error="no answer yet (in flight for 1.0 s)"), metrics=None)
    flips = 0
    t = 102.0
    for _ in range(14):
        box.tick(t, a=replace(late, at=t))
        flips += box.state() is State.DEGRADED
        box.tick(t + 3, a=obs(t=t + 3))
        t += 7
    assert flips == 14 and box.state() is State.HEALTHY
    assert state_lines(box) == []


def test_a_verdict_that_holds_is_said_once_with_how_long_it_held_and_a_hang_at_once():
    box = Box(cfg(1, unresponsive_after_s=30), LEARNED)
    healthy_start(box)
    box.actions.clear()
    late = replace(obs(t=0), metrics_probe=replace(TIMEOUT, error="timeout"), metrics=None)
    for t in (102.0, 106.0, 111.0, 112.0, 116.0):
        box.tick(t, a=replace(late, at=t))
    (line,) = state_lines(box)
    assert "healthy -> degraded" in line and "for 10 s" in line  # said at 112, held since 102
    box.tick(140.0, a=obs(t=140.0, health=TIMEOUT))
    box.tick(146.0, a=obs(t=146.0, health=TIMEOUT))  # no answer for 30 s since 116: unresponsive
    assert box.state() is State.UNRESPONSIVE
    assert "degraded -> unresponsive" in state_lines(box)[-1]  # a hang is said at once


# --- a long step is not a hang (issue 35 item 8) -------------------------------------------------

from guardian.core.watchdog.steps import STEP_MARGIN, longest_new_prefill  # noqa: E402

INF = float("inf")


def buckets(*counts: float, bounds=(0.3, 1.0, 10.0, 60.0, 120.0, INF)) -> VllmSample:
    return replace(sample(), prefill_buckets=tuple(zip(bounds, counts, strict=True)))


@pytest.mark.parametrize("prev, cur, bound", [
    (buckets(5, 5, 5, 5, 5, 5), buckets(5, 5, 5, 5, 5, 5), None),  # no prefill ended
    (buckets(5, 5, 5, 5, 5, 5), buckets(7, 7, 7, 7, 7, 7), 0.3),  # two short ones
    (buckets(5, 5, 5, 5, 5, 5), buckets(6, 6, 6, 7, 7, 7), 60.0),  # a short one and one of 10-60 s
    (buckets(5, 5, 5, 5, 5, 5), buckets(5, 5, 5, 5, 5, 6), 120.0),  # longer than every finite bound
    (buckets(5, 5, 5, 5, 5, 5), buckets(0, 0, 0, 0, 0, 1), None),  # counts went down: a new engine
    (None, buckets(1, 1, 1, 1, 1, 1), None),
])
def test_the_longest_prefill_that_ended_is_bounded_by_its_bucket(prev, cur, bound):
    assert longest_new_prefill(prev, cur) == bound


LONG_PROMPT_WAIT = 60.0  # one prefill step of 60 s: nothing moves, a client waits, a canary queues behind


def one_long_step(steps, until: float = 100.0 + LONG_PROMPT_WAIT - 1) -> Box:
    """Healthy at 100; from 101 one long prefill: 1 running, counters still, a client waiting; the stall
    canary queued behind it fails at canary_timeout_s with nothing moving."""
    box = Box(cfg(1, stall_canary_after_s=3, stall_window_s=300, client_wait_s=3),
              PersistentView(canary_latencies={"a": (0.1, 0.1, 0.1)}, step_seconds=steps))
    healthy_start(box)
    box.tick(100.5, a=obs(t=100.5, canary=CanaryResult(True, 100.0, 0.1)))
    frozen = sample(running=1)
    t, sent = 101.0, None
    while t <= until:
        canary = None
        if sent is not None and t >= sent + 15.0:
            canary, sent = CanaryResult(False, sent, 15.0, "timeout"), None
        box.tick(t, a=replace(obs(t=t, s=frozen, canary=canary), conns=conns(waiting=1, oldest_wait_s=t - 101.0)))
        if canaries(box.actions) and sent is None and box.tracks["a"].canary_in_flight_since == t:
            sent = t
        t += 1.0
    return box


@pytest.mark.parametrize("steps, stalled", [
    ({"a": ((60.0, 50.0),)}, False),  # it took a 60 s step before: 1.5 x 60 = 90 s before any stall verdict
    ({}, False),  # nothing learned: the stall window (300 s here) is the bound
    ({"a": ((0.3, 50.0),)}, True),  # only short prefills seen: a failed stall canary proves a stall (L14)
    ({"a": ((60.0, 100.0 - 24 * 3600), (0.3, 50.0))}, True),  # the 60 s step was learned a day ago: forgotten
])
def test_a_stall_canary_never_ends_a_step_shorter_than_the_replicas_own_longest(steps, stalled):
    box = one_long_step(steps)
    verdicts = [(a.state, a.rule) for a in said(box.actions) if a.decision is Decision.STATE]
    assert ((State.STALLED, "L14") in verdicts) is stalled, verdicts
    assert bool(restarts(box.actions)) is stalled


def test_a_long_step_is_learned_from_the_histogram_kept_in_the_state_file_and_bounds_the_stall_window():
    box = Box(cfg(1, stall_window_s=60), LEARNED)
    box.tick(100.0, a=obs(t=100.0, s=buckets(5, 5, 5, 5, 5, 5)))
    acts = box.tick(102.0, a=obs(t=102.0, s=replace(buckets(5, 5, 5, 5, 6, 6), generation_tokens=1.0)))
    (record,) = [a for a in acts if isinstance(a, RecordCanaryLatencies)]
    assert record.steps == (("a", ((120.0, 102.0), (0.3, 0.0))),)  # longest first, the 0.3 s one from the state file
    assert longest_step_s(box.tracks["a"], 103.0, 300.0) == STEP_MARGIN * 120.0
    # L13 waits max(stall_window_s, 1.5 x 120 s) = 180 s of nothing moving with work queued
    flat = replace(buckets(5, 5, 5, 5, 6, 6), generation_tokens=1.0, running=2)
    for t in (104.0, 170.0, 283.0):
        box.tick(t, a=obs(t=t, s=flat))
    assert box.state() is not State.STALLED
    box.tick(284.0, a=obs(t=284.0, s=flat))
    assert (box.state(), box.rule()) == (State.STALLED, "L13")


# --- a closer look: idle-dead within the late mark + canary_timeout_s (issue 35 item 7) ----------

def idle_frozen(box: Box, sent: float, until: float, results: dict[float, CanaryResult] | None = None) -> list:
    """An idle replica whose canary goes out at SENT; ticks every second until UNTIL, canary results
    arriving as RESULTS says (tick time -> result)."""
    results = results or {}
    asked = []
    t = sent
    while t <= until:
        box.actions.clear()
        box.tick(t, a=obs(t=t, canary=results.get(t)))
        asked += [(t, a.timeout_s) for a in canaries(box.actions)]
        t += 1.0
    return asked


def test_an_idle_canary_past_its_late_mark_gets_a_closer_look_and_two_failures_make_idle_dead():
    box = Box(cfg(1, canary_interval_s=10), LEARNED)  # learned 0.1 s: late mark at the 3 s floor
    healthy_start(box)  # its canary sent at 100
    results = {115.0: CanaryResult(False, 100.0, 15.0, "timeout"), 118.0: CanaryResult(False, 103.0, 15.0, "timeout")}
    asked = idle_frozen(box, 101.0, 118.0, results)
    assert asked == [(103.0, 15.0)]  # the closer look at the late mark, with the hard bound
    verdicts = [(a.state, a.rule) for a in said(box.actions) if a.decision is Decision.STATE]
    assert (State.IDLE_DEAD, "L15") in verdicts and restarts(box.actions)


def test_a_late_canary_that_answers_ends_the_closer_look_without_a_failure():
    box = Box(cfg(1, canary_interval_s=10), LEARNED)
    healthy_start(box)
    results = {108.0: CanaryResult(True, 100.0, 7.5), 109.0: CanaryResult(True, 103.0, 5.5)}
    asked = idle_frozen(box, 101.0, 110.0, results)
    assert asked == [(103.0, 15.0)]
    t = box.tracks["a"]
    assert t.canary_failures == 0 and t.canary_in_flight_since is None and t.closer_since is None
    assert box.state() is State.HEALTHY and restarts(box.actions) == []


def test_no_closer_look_while_work_is_queued_or_something_moved():
    box = Box(cfg(1, canary_interval_s=10), LEARNED)
    healthy_start(box)
    for t in (101.0, 102.0, 103.0, 104.0, 105.0):  # work queued and tokens flowing: a canary waits its turn
        box.actions.clear()
        box.tick(t, a=obs(t=t, s=sample(gen=10 * t, running=3)))
        assert canaries(box.actions) == []


def test_canary_results_from_before_the_units_restart_count_for_nothing():
    """Review of issue 35: a canary and its closer look in flight when the unit restarted; both fail
    (connection reset). They were sent to the engine before this start: no failure counts."""
    box = Box(cfg(1, canary_interval_s=10), LEARNED)
    healthy_start(box)
    idle_frozen(box, 101.0, 103.0)  # the closer look at 103
    restarted = unit(inactive_exit_mono=104.5)
    for t, result in ((105.0, CanaryResult(False, 100.0, 4.9, "reset")), (106.0, CanaryResult(False, 103.0, 2.9, "reset"))):
        box.tick(t, a=obs(t=t, u=restarted, canary=result))
    assert box.tracks["a"].canary_failures == 0
    box.tick(140.0, a=obs(t=140.0, u=restarted))
    assert box.state() is State.HEALTHY and restarts(box.actions) == []


def test_a_closer_look_that_comes_back_first_is_its_own_and_is_sent_once():
    box = Box(cfg(1, canary_interval_s=10), LEARNED)
    healthy_start(box)  # A sent at 100
    asked = idle_frozen(box, 101.0, 110.0, {104.0: CanaryResult(False, 103.0, 0.5, "HTTP 500")})  # B fails fast
    assert asked == [(103.0, 15.0)]  # one closer look for A, not one a tick after B's failure
    t = box.tracks["a"]
    assert (t.canary_in_flight_since, t.canary_due_at, t.closer_since) == (100.0, 115.0, None)
    assert t.canary_failures == 1
    assert not [a for a in said(box.actions) if a.rule == "C2"]  # B was not taken for A


def test_a_late_mark_already_past_hides_no_later_deadline():
    """A frozen server with its canary in flight: the late mark has passed with no closer look
    possible (no answer: no canary can go); L8's moment is still the next deadline."""
    box = Box(cfg(1, unresponsive_after_s=10), LEARNED)
    healthy_start(box)  # canary at 100, late at 103
    box.tick(101.0, a=obs(t=101.0, health=TIMEOUT))
    assert next_deadline(box.tracks["a"], box.cfg.watchdog, after=104.0) == 110.0


def test_serving_again_after_guardians_restart_is_said_even_when_the_quiet_journal_holds_it():
    box = Box(cfg(1, stall_window_s=60), LEARNED)
    healthy_start(box)
    box.tick(110.0, a=obs(t=110.0, s=sample(gen=5, running=2)))
    box.tick(171.0, a=obs(t=171.0, s=sample(gen=5, running=2)))  # stalled: guardian restarts it
    assert restarts(box.actions)
    started = unit(inactive_exit_mono=172.0)
    box.tick(173.0, a=obs(t=173.0, u=started, outcome=RestartOutcome("vllm-a.service", "done", True, True),
                          health=TIMEOUT))
    late = replace(obs(t=0, u=started), metrics_probe=replace(TIMEOUT, error="timeout"), metrics=None)
    box.tick(175.0, a=replace(late, at=175.0))  # degraded first (said: from starting)
    for t in (177.0, 182.0, 188.0):
        box.tick(t, a=obs(t=t, u=started))
    back = [m for m in state_lines(box) if "-> healthy" in m]
    assert back and "serving again" in back[-1], state_lines(box)


def test_a_paused_replica_serves_by_its_own_answers():
    """guardian does not judge a paused replica, but one that answers with its model carries load."""
    box = Box(cfg(1), PersistentView(pauses={"a": Pause(None)}))
    box.tick(100.0, a=obs(t=100.0))
    assert box.state() is State.PAUSED and serves(box.tracks["a"], 100.0)
    box.tick(102.0, a=obs(t=102.0, health=DEAD_503))
    assert not serves(box.tracks["a"], 102.0)


def test_on_a_starved_box_a_canary_goes_out_while_this_ticks_probes_are_still_in_flight():
    """Issue 35: every answer 1-8 s late, so a tick with /health and /metrics both answered is rare;
    a canary due goes out while they are in flight (the last look's /metrics was readable)."""
    box = Box(cfg(1, canary_interval_s=10), LEARNED)
    healthy_start(box)
    box.tick(100.5, a=obs(t=100.5, canary=CanaryResult(True, 100.0, 0.1)))
    box.actions.clear()
    flight = Probe(False, None, 1.0, "no answer yet (in flight for 1.0 s)", pending=True)
    t = 101.0
    while t <= 111.0:
        o = replace(obs(t=t), health=flight, metrics_probe=flight, metrics=None, models_probe=OK)
        box.tick(t, a=o)
        t += 0.5
    assert [c.timeout_s for c in canaries(box.actions)] == [15.0]
    # a /metrics that answered garbage is not readable: no canary on it
    garbage = Box(cfg(1, canary_interval_s=10), LEARNED)
    healthy_start(garbage)
    bad = replace(obs(t=101.0), metrics_probe=Probe(False, 200, 0.1, "unreadable: x"), metrics=None)
    garbage.tick(101.0, a=bad)
    garbage.actions.clear()
    for t in (105.0, 111.0, 112.0):
        garbage.tick(t, a=replace(obs(t=t), health=flight, metrics_probe=flight, metrics=None))
    assert canaries(garbage.actions) == []


@pytest.mark.parametrize("unit, taken", [
    ("app-squat.scope", True),  # a user's scope: no engine holds a container's port from there
    ("nginx.service", True),
    ("docker.service", False),  # docker-proxy, not named yet: may be the replica's own
    ("docker-" + "a" * 64 + ".scope", False),  # a container's own scope, not named yet
])
def test_a_container_replicas_port_held_by_a_unit_no_engine_uses_is_taken(unit, taken):
    box = Box(container_cfg())
    box.tick(100.0, a=obs(t=100.0, port=HeldBy(8001, 4242, unit)))
    assert (box.state() is State.PORT_TAKEN) is taken


# --- a learned figure never blinds a rule (issue 41 item 2) --------------------------------------

HUGE = (0.3, 1e300, INF)  # a fake /metrics page's prefill histogram (issue 41 row 2: le="1e300")


def test_a_step_learned_from_a_page_that_says_1e300_s_is_dropped_and_l13_waits_its_window():
    """Before, the bucket bound was learned as it was (1.5e300 s in memory, 7,680 s written to the
    state file), and L13/L14 waited for it for 24 h."""
    box = Box(cfg(1, stall_window_s=60, max_step_s=300.0), LEARNED)
    box.tick(100.0, a=obs(t=100.0, s=buckets(5, 5, 5, bounds=HUGE)))
    acts = box.tick(102.0, a=obs(t=102.0, s=replace(buckets(5, 6, 6, bounds=HUGE), generation_tokens=1.0)))
    assert box.tracks["a"].steps == ((0.3, 0.0),)  # only the state file's short step: 1e300 taught nothing
    assert not [a for a in acts if isinstance(a, RecordCanaryLatencies) and a.steps]
    assert not [x for x in said(acts) if "learned a step" in x.message]
    flat = replace(buckets(5, 6, 6, bounds=HUGE), generation_tokens=1.0, running=2)
    box.tick(103.0, a=obs(t=103.0, s=flat))  # work first queued: L13 counts from here
    box.tick(162.0, a=obs(t=162.0, s=flat))
    assert box.state() is not State.STALLED
    box.tick(163.0, a=obs(t=163.0, s=flat))
    assert (box.state(), box.rule()) == (State.STALLED, "L13")


@pytest.mark.parametrize("cap_s, learned", [(300.0, True), (100.0, False)])
def test_a_step_within_the_cap_is_learned_and_said_once_with_its_source(cap_s, learned):
    box = Box(cfg(1, stall_window_s=60, max_step_s=cap_s), LEARNED)
    box.tick(100.0, a=obs(t=100.0, s=buckets(5, 5, 5, 5, 5, 5)))
    acts = box.tick(102.0, a=obs(t=102.0, s=replace(buckets(5, 5, 5, 5, 6, 6), generation_tokens=1.0)))  # le=120
    lines = [x for x in said(acts) if "learned a step" in x.message]
    assert bool(lines) is learned and (box.tracks["a"].steps[0][0] == 120.0) is learned
    if learned:
        (line,) = lines
        assert line.priority is Priority.INFO and "up to 120 s from its prefill-time histogram" in line.message
        assert "stall window (L13) is now 180 s" in line.message and "(L14) waits 180 s" in line.message
        again = box.tick(104.0, a=obs(t=104.0, s=replace(buckets(5, 5, 5, 5, 7, 7), generation_tokens=2.0)))
        assert not [x for x in said(again) if "learned a step" in x.message]  # the same step: said once


@pytest.mark.parametrize("kept, want", [
    (((7680.0, 50.0), (60.0, 40.0)), ((60.0, 40.0),)),  # the old file's 7,680 s: past the cap, dropped
    (((60.0, 50.0), (float("nan"), 40.0)), ((60.0, 50.0),)),  # not a number: dropped
    (((-1.0, 50.0), (float("inf"), 50.0)), ()),
])
def test_steps_read_back_from_the_state_file_are_held_to_the_cap(kept, want):
    box = Box(cfg(1, max_step_s=300.0), PersistentView(canary_latencies={"a": (0.1, 0.1, 0.1)},
                                                       step_seconds={"a": kept}))
    acts = box.tick(100.0, a=obs(t=100.0))
    assert box.tracks["a"].steps == want
    learned = [x.message for x in said(acts) if "learned a step" in x.message]
    assert bool(learned) is bool(want) and all("the state file" in m for m in learned), learned


@pytest.mark.parametrize("step_s", [float("nan"), float("inf"), -3.0, 0.0, None, 300.5])
def test_a_step_that_is_not_a_positive_finite_number_is_not_learned(step_s):
    track = Track(steps=((2.0, 99.0),))
    assert learn_step(track, step_s, 100.0, 300.0) is track


def test_a_partial_kernel_view_is_not_said_to_show_nothing_flowing():
    """Issue 41 row 3: a view truncated by others' sockets was read as 'nothing flowed'."""
    box = Box(cfg(1, unresponsive_after_s=4), LEARNED)
    healthy_start(box)
    partial = replace(conns(), truncated=True)
    for t in (101.0, 103.0, 105.0, 107.0):
        box.tick(t, a=replace(obs(t=t, health=TIMEOUT), conns=partial))
    l8 = [x.message for x in said(box.actions) if x.rule == "L8"]
    assert l8 and all("nothing flowed" not in m and "partial" in m for m in l8), l8


# --- a replica's own processes as evidence (issue 43: L19-L22, C5) ----------------------------------

def procs(t, engine_ms=0.0, api_ms=30.0, since_s=2.0, named=True, engine_running=False, api_running=False):
    """A look at the replica's processes at T: what its engine and its API server used (CPU plus
    run-queue wait) in the SINCE_S before it; NAMED=False: no process named as the engine's (API is the
    whole replica)."""
    engine = Activity(engine_ms / 1000, engine_running, 1) if named else None
    return ProcView(t, since_s, Activity(api_ms / 1000, api_running, 1), engine, named)


def with_procs(o, view):
    return replace(o, procs=view)


FROZEN_4 = sample(gen=50, running=4)  # the streams' counters, frozen


def engine_frozen_with_streams(until: float, **look) -> Box:
    """4 streams last seen moving at 100 (the engine busy then); from there its counters stand still while its
    processes are looked at every 2 s (LOOK: what procs() says of each look)."""
    box = Box(cfg(1), LEARNED)
    healthy_start(box, a=with_procs(obs(t=100, s=FROZEN_4), procs(100, engine_ms=200)))
    t = 102.0
    while t <= until:
        box.tick(t, a=with_procs(obs(t=t, s=FROZEN_4), procs(t, **look)))
        t += 2.0
    return box


@pytest.mark.parametrize("until, state, rule", [(102, State.HEALTHY, "L18"), (104, State.STALLED, "L19")])
def test_work_in_an_engine_whose_processes_stay_quiet_is_stalled_at_engine_quiet_s(until, state, rule):
    box = engine_frozen_with_streams(until)
    assert (box.state(), box.rule()) == (state, rule)
    assert bool(restarts(box.actions)) == (state is State.STALLED)
    if state is State.STALLED:
        ev = box.tracks["a"].evidence
        assert "4 running, 0 waiting, nothing moved for 4 s" in ev
        assert "its engine (1 process) used no CPU and waited for none in 4.0 s" in ev


@pytest.mark.parametrize("look", [
    {"engine_ms": 30.0},  # 30 ms in 2 s is 1.5 % of a core: above quiet_cpu (1 %): it works
    {"engine_running": True},  # runnable at the look (a starved engine waits on the run queue)
    {"named": False},  # no process named as the engine's: its quiet is not told apart
], ids=["busy", "runnable", "not-named"])
def test_an_engine_that_computes_waits_to_run_or_is_not_told_apart_is_left_to_the_stall_window(look):
    box = engine_frozen_with_streams(130, **look)
    assert box.state() is State.HEALTHY and restarts(box.actions) == []
    box = engine_frozen_with_streams(160, **look)
    assert (box.state(), box.rule()) == (State.STALLED, "L13")  # the backstop still holds


def test_a_look_that_could_not_be_had_ends_the_quiet_spell():
    box = Box(cfg(1), LEARNED)
    healthy_start(box, a=with_procs(obs(t=100, s=FROZEN_4), procs(100, engine_ms=200)))
    box.tick(102, a=with_procs(obs(t=102, s=FROZEN_4), procs(102)))
    box.tick(104, a=obs(t=104, s=FROZEN_4))  # no view of its processes at this tick
    box.tick(106, a=with_procs(obs(t=106, s=FROZEN_4), procs(106)))
    assert box.state() is State.HEALTHY  # quiet since 104 only: 2 s
    box.tick(108, a=with_procs(obs(t=108, s=FROZEN_4), procs(108)))
    assert (box.state(), box.rule()) == (State.STALLED, "L19")


def idle_canary_untouched(until: float, health=lambda t: OK, engine_ms=lambda t: 0.0) -> Box:
    """An idle replica whose canary is sent at 100 (its first idle one); looked at every 2 s after."""
    box = Box(cfg(1, canary_interval_s=10), LEARNED)
    healthy_start(box, a=with_procs(obs(t=100), procs(100)))
    assert canaries(box.actions)
    t = 102.0
    while t <= until:
        box.tick(t, a=with_procs(obs(t=t, health=health(t)), procs(t, engine_ms=engine_ms(t))))
        t += 2.0
    return box


@pytest.mark.parametrize("until, state, rule", [(102, State.HEALTHY, "L18"), (104, State.IDLE_DEAD, "L21")])
def test_an_idle_canary_its_engine_never_touches_fails_at_engine_quiet_s_and_proves_idle_dead(until, state, rule):
    box = idle_canary_untouched(until)
    assert (box.state(), box.rule()) == (state, rule)
    assert bool(restarts(box.actions)) == (state is State.IDLE_DEAD)
    if state is State.IDLE_DEAD:
        assert "a canary sent 4 s ago got nothing while its engine (1 process) used no CPU" in box.tracks["a"].evidence
        assert box.tracks["a"].engine_proof_at == 100.0 and box.tracks["a"].canary_failures == 1  # C5


@pytest.mark.parametrize("case", ["health-late", "engine-worked"])
def test_a_canary_out_is_not_judged_early_while_health_is_late_or_the_engine_worked(case):
    health = (lambda t: SLOW) if case == "health-late" else (lambda t: OK)
    engine_ms = (lambda t: 50.0 if t == 102 else 0.0) if case == "engine-worked" else (lambda t: 0.0)
    box = idle_canary_untouched(112, health=health, engine_ms=engine_ms)
    t = box.tracks["a"]
    assert t.canary_in_flight_since == 100.0 and t.canary_failures == 0  # still out: its bound decides
    assert box.state() is not State.IDLE_DEAD and restarts(box.actions) == []


def test_the_late_failure_of_a_canary_judged_early_is_not_counted_again_and_a_late_answer_is_progress():
    box = idle_canary_untouched(104)
    assert box.tracks["a"].canary_failures == 1
    box.tick(115, a=with_procs(obs(t=115, canary=CanaryResult(False, 100.0, 15.0, "timeout")), procs(115)))
    assert box.tracks["a"].canary_failures == 1
    box = idle_canary_untouched(104)
    box.tick(106, a=with_procs(obs(t=106, canary=CanaryResult(True, 100.0, 6.0)), procs(106, engine_ms=40)))
    assert box.tracks["a"].canary_failures == 0 and box.tracks["a"].engine_proof_at is None


def test_clients_waiting_on_an_engine_frozen_between_steps_get_a_canary_that_c5_fails_then_l20():
    """0 running, 0 waiting (the engine's own gauges, frozen), clients waiting: a stall canary goes out
    after stall_canary_after_s, and its engine never touching it is the proof (L20), not its bound."""
    box = Box(cfg(1, stall_canary_after_s=10, client_wait_s=3), LEARNED)
    healthy_start(box, a=with_procs(obs(t=100), procs(100)))
    box.tick(101, a=with_procs(obs(t=101, canary=CanaryResult(True, 100.0, 0.1)), procs(101, since_s=1.0)))
    t = 102.0
    sent = None
    while t <= 130 and box.state() is not State.STALLED:
        box.actions.clear()
        view = conns(waiting=4, oldest_wait_s=t - 102.0)
        box.tick(t, a=with_procs(replace(obs(t=t), conns=view), procs(t)))
        if canaries(box.actions):
            sent = t
        t += 2.0
    assert sent is not None and (box.state(), box.rule()) == (State.STALLED, "L20")
    assert box.tracks["a"].engine_proof_at == sent
    assert "a canary sent 4 s ago got nothing" in box.tracks["a"].evidence


@pytest.mark.parametrize("until, state, rule", [(102, State.DEGRADED, "L17"), (104, State.UNRESPONSIVE, "L22")])
def test_no_answer_and_an_api_server_that_neither_runs_nor_waits_is_unresponsive_at_engine_quiet_s(until, state, rule):
    box = Box(cfg(1), LEARNED)
    healthy_start(box, a=with_procs(obs(t=100), procs(100)))
    t = 102.0
    while t <= until:
        box.tick(t, a=with_procs(obs(t=t, health=TIMEOUT), procs(t, api_ms=0.0)))
        t += 2.0
    assert (box.state(), box.rule()) == (state, rule)
    if state is State.UNRESPONSIVE:
        assert "and its API server (1 process) used no CPU and waited for none in 4.0 s" in box.tracks["a"].evidence


@pytest.mark.parametrize("look", [{"api_ms": 30.0}, {"api_running": True}], ids=["computes", "waits-to-run"])
def test_a_starved_or_busy_api_server_with_no_answer_is_left_to_l8(look):
    box = Box(cfg(1), LEARNED)
    healthy_start(box, a=with_procs(obs(t=100), procs(100)))
    for t in (102.0, 104.0, 106.0, 108.0):
        box.tick(t, a=with_procs(obs(t=t, health=TIMEOUT), procs(t, **look)))
        assert box.state() is not State.UNRESPONSIVE
    box.tick(110.0, a=with_procs(obs(t=110.0, health=TIMEOUT), procs(110.0, **look)))
    assert (box.state(), box.rule()) == (State.UNRESPONSIVE, "L8")


def test_the_gpus_own_sign_of_life_is_in_the_evidence_where_nvml_reports_it():
    box = engine_frozen_with_streams(102)
    gpus = (GpuLife(0, 21.4, 96.0), GpuLife(1, None, 3.0))
    box.tick(104, a=replace(with_procs(obs(t=104, s=FROZEN_4), procs(104)), gpus=gpus))
    assert box.rule() == "L19"
    assert box.tracks["a"].evidence.endswith("; GPU 0: 21 W, 96 % busy; GPU 1: 3 % busy")
    box = engine_frozen_with_streams(104)  # no NVML: the same verdict, nothing said of a GPU
    assert box.rule() == "L19" and "GPU" not in box.tracks["a"].evidence


@pytest.mark.parametrize("engine_ms, first_canary_at", [(0.0, 106), (50.0, 112)])
def test_clients_waiting_on_a_quiet_engine_get_their_stall_canary_at_engine_quiet_s(engine_ms, first_canary_at):
    """Clients waiting from 102 (counted once they waited client_wait_s, 3 s: work queued from 102): a
    stall canary after stall_canary_after_s (10 s: at 112), or after engine_quiet_s (4 s: at 106)
    when the engine's processes have been quiet that long too."""
    box = Box(cfg(1, stall_canary_after_s=10, client_wait_s=3), LEARNED)
    healthy_start(box, a=with_procs(obs(t=100), procs(100)))
    box.tick(101, a=with_procs(obs(t=101, canary=CanaryResult(True, 100.0, 0.1)), procs(101, since_s=1.0)))
    sent = []
    for t in range(102, 116, 2):
        box.actions.clear()
        view = conns(waiting=2, oldest_wait_s=t - 102.0)
        box.tick(t, a=with_procs(replace(obs(t=t), conns=view), procs(t, engine_ms=engine_ms)))
        sent += [t] * len(canaries(box.actions))
    assert sent[:1] == [first_canary_at]
