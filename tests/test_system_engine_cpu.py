"""A frozen engine found from what its processes do (issue 43): real systemd, the simulator with
vLLM's process shape (an API server, and an engine core in a process of its own whose CPU is a real
engine's: busy while it steps, none while it waits or is frozen).

Each test sets the windows that would otherwise decide first far out of reach, so that the rule
that decides is the one under test, and asserts that rule and its evidence, never a time."""

from __future__ import annotations

import pytest

from systemd_box import wait_for
from world import World

pytestmark = pytest.mark.system

# Nothing but the replica's own processes may decide within a test: the stall window, the stall
# canary, the unresponsive window and the idle canary's bound (guardian's own per-replica defaults:
# canary_timeout_s 15 s, not the test world's 2 s) are all out of reach.
FAR = {"stall_window_s": 120, "stall_canary_after_s": 60, "unresponsive_after_s": 60, "canary_interval_s": 3}


def far(world: World, **more: float) -> None:
    world.watchdog.update({**FAR, **more})
    world.replica_defaults = True


def engine_pids(world: World, name: str = "a") -> list[int]:
    r = next(r for r in world.replicas if r.name == name)
    return list(world.sim_state(r)["engine_pids"])


def restart_line(world: World, name: str = "a", timeout_s: float = 40) -> dict:
    return wait_for(lambda: next(iter(world.guardian_lines(f"GUARDIAN_REPLICA={name}", "GUARDIAN_DECISION=restart")), None),
                    timeout_s, f"guardian to restart {name}")


def settle(world: World) -> None:
    """Both replicas healthy, their canary deadlines learned (the learning canaries answered)."""
    world.wait_states({"a": "healthy", "b": "healthy"}, timeout_s=60)
    wait_for(lambda: engine_pids(world), 20, "a's engine process")


def four_streams(world: World, a) -> None:
    world.sim(a, "load", "4")
    wait_for(lambda: world.sim_state(a).get("running") == 4, 20, f"4 streams running in {a.name}")


def test_an_engine_frozen_with_streams_running_is_stalled_by_its_quiet_processes(world):
    far(world)
    world.setup()
    settle(world)
    a = world.replicas[0]
    four_streams(world, a)
    world.fault(a, "engine-frozen")
    line = restart_line(world)
    assert line["GUARDIAN_RULE"] == "L19", line["MESSAGE"]
    assert "4 running" in line["MESSAGE"] and "its engine (1 process) used no CPU and waited for none" in line["MESSAGE"]
    assert world.restarts_of(world.replicas[1]) == []


def test_a_frozen_idle_engine_fails_its_canary_at_once_and_is_idle_dead(world):
    far(world)
    world.setup()
    settle(world)
    a = world.replicas[0]
    world.fault(a, "engine-frozen")
    line = restart_line(world)
    assert line["GUARDIAN_RULE"] == "L21", line["MESSAGE"]
    assert "got nothing while its engine (1 process) used no CPU" in line["MESSAGE"]


def test_an_api_server_frozen_under_load_is_unresponsive_by_its_quiet_processes(world):
    far(world)
    world.setup()
    settle(world)
    a = world.replicas[0]
    four_streams(world, a)
    world.kill(a.unit, "STOP")  # the unit's main process: the API server, not its engine
    line = restart_line(world)
    assert line["GUARDIAN_RULE"] == "L22", line["MESSAGE"]
    assert "its API server (1 process) used no CPU and waited for none" in line["MESSAGE"]


def test_an_engine_spinning_with_work_queued_is_left_to_the_stall_window(world):
    """A GPU engine spinning on a wedged kernel burns CPU while nothing moves: its processes prove
    nothing, so L19, L20 and L21 never hold; the stall canary and the stall window still decide."""
    far(world, stall_window_s=20, stall_canary_after_s=6)
    world.setup()
    settle(world)
    a = world.replicas[0]
    four_streams(world, a)
    world.fault(a, "spinning", busy=0.3)
    line = restart_line(world, timeout_s=60)
    assert line["GUARDIAN_RULE"] in ("L13", "L14"), line["MESSAGE"]
    assert not [e for e in world.guardian_lines("GUARDIAN_REPLICA=a")
                if e.get("GUARDIAN_RULE") in ("L19", "L20", "L21", "L22")]
