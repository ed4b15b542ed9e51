"""Restore (issue 25): a fraction the memory guard lowered comes back, one step at a time, to its
base and no further, once the squeeze is over and headroom has stayed clear of the raise line for
restore_after_s; a hog held in the band between the squeeze line and the raise line, or started
and stopped faster than sustain_s, moves nothing. Real memory: the simulated replicas hold
fraction x DEVICE_TOTAL, the hogs hold theirs; thresholds are set relative to the box's
MemAvailable at the start of each test."""

from __future__ import annotations

import json
import re
import time

import pytest

from systemd_box import wait_for
from world import DEVICE_TOTAL, HOG, GiB, World, hog, line_with, mem_available, start_with_thresholds

# host_memory: guardian reads the host's /proc/meminfo, which every box shares: run alone (scripts/run-tests)
pytestmark = [pytest.mark.system, pytest.mark.host_memory]

RESTORE_AFTER_S = 4.0
RESTORE_COOLDOWN_S = 3.0
SUSTAIN_S = 2.0


@pytest.fixture
def world(box):
    w = World(box)
    for r in w.replicas:
        r.restart_sec = 3
        r.sim_args = f"--sim-allocate --sim-total-memory-bytes {DEVICE_TOTAL}"
    # Every change is a restart: a budget and back-off that let the test see several in a row.
    w.watchdog = dict(backoff_s=0, restart_budget=20)
    w.memory = dict(enabled=True, sustain_s=SUSTAIN_S, cooldown_s=0, step=0.04, reserve_bytes=0,
                    device_total_bytes=DEVICE_TOTAL, priority=["a"], restore=True,
                    restore_after_s=RESTORE_AFTER_S, restore_cooldown_s=RESTORE_COOLDOWN_S)
    box.write("/usr/local/bin/hog", HOG, mode=0o755)
    yield w
    w.teardown()


def changes(w: World) -> list[dict]:
    """Every lowering and raise guardian issued since the test began (the memory decision lines
    that restart a replica), oldest first."""
    return [e for e in w.guardian_lines("GUARDIAN_DECISION=memory") if "restarting" in e["MESSAGE"]]


def fraction_status(w: World, name: str) -> tuple[float | None, float | None]:
    replica = json.loads(w.box.run(["guardian", "status", "--json"]).stdout)["replicas"][name]
    return replica["gpu_memory_utilization"], replica.get("gpu_memory_utilization_base")


def env_fraction(w: World, name: str) -> str:
    """The GPU_MEMORY_UTILIZATION line of guardian's env file for replica NAME."""
    text = w.box.run(["cat", f"/var/lib/guardian/replicas/{name}.env"]).stdout
    return next(line for line in text.splitlines() if line.startswith("GPU_MEMORY_UTILIZATION="))


def nothing_changes_for(w: World, seconds: float) -> None:
    """No lowering and no raise for SECONDS: the absence of an action can only be watched for a
    while; SECONDS is stated against the thresholds at each call."""
    before = len(changes(w))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert len(changes(w)) == before, changes(w)[before:]
        time.sleep(0.5)


def clear_for_s(line: dict) -> float:
    """What a raise says of its evidence: "headroom X >= Y for N s"."""
    m = re.search(r"headroom [\d.]+ GiB >= [\d.]+ GiB for (\d+) s", line["MESSAGE"])
    assert m, line["MESSAGE"]
    return float(m.group(1))


def test_a_lowered_fraction_comes_back_one_step_at_a_time_to_its_base_and_no_further(world):
    a, b = world.replicas
    a.fraction, b.fraction = 0.78, 0.70
    world.memory["floor"] = 0.70  # a gives two steps, b none
    start_with_thresholds(world)
    hog(world, "build.service", 3)
    line_with(world, "0.78 -> 0.74", "GUARDIAN_REPLICA=a", "GUARDIAN_DECISION=memory")
    line_with(world, "0.74 -> 0.7", "GUARDIAN_REPLICA=a", "GUARDIAN_DECISION=memory", timeout_s=60)
    line_with(world, "serving again with gpu_memory_utilization 0.7 ", "GUARDIAN_REPLICA=a", timeout_s=60)
    assert fraction_status(world, "a") == (0.7, 0.78)
    squeeze_over = time.time()
    world.box.systemctl("stop", "build.service")
    first = line_with(world, "raising it 0.7 -> 0.74 (base 0.78)", "GUARDIAN_REPLICA=a", timeout_s=60)
    assert first["PRIORITY"] == "4" and first["GUARDIAN_RULE"] == "M26"
    assert "restarting vllm-a.service alone; b serving" in first["MESSAGE"]
    # the hysteresis: headroom clear of the raise line for restore_after_s before the first step, by
    # guardian's own evidence (how long it saw headroom clear), and after the squeeze was over
    assert clear_for_s(first) >= RESTORE_AFTER_S, first["MESSAGE"]
    assert int(first["__REALTIME_TIMESTAMP"]) / 1e6 > squeeze_over
    line_with(world, "serving again with gpu_memory_utilization 0.74", "GUARDIAN_REPLICA=a", timeout_s=60)
    second = line_with(world, "raising it 0.74 -> 0.78 (base 0.78)", "GUARDIAN_REPLICA=a", timeout_s=60)
    assert second["GUARDIAN_RULE"] == "M26" and clear_for_s(second) >= RESTORE_AFTER_S, second["MESSAGE"]
    # the cooldown's own boundary is test_memguard.py's (a fake clock)
    line_with(world, "serving again with gpu_memory_utilization 0.78", "GUARDIAN_REPLICA=a", timeout_s=60)
    # at its base: never above it, however clear the headroom stays
    nothing_changes_for(world, RESTORE_AFTER_S + RESTORE_COOLDOWN_S + 2)  # one more raise would have come by then
    assert len(changes(world)) == 4 and env_fraction(world, "a") == "GPU_MEMORY_UTILIZATION=0.78"
    assert fraction_status(world, "a") == (0.78, 0.78)
    assert json.loads(world.box.http(a.url + "/_sim/state")[1])["gpu_memory_utilization"] == 0.78
    assert fraction_status(world, "b") == (0.7, None)  # never lowered, so never raised


def test_a_hog_around_the_thresholds_moves_nothing(world):
    """Lowered once, a sits at its floor. A hog that leaves headroom between the squeeze line and
    the raise line, then a hog started and stopped faster than sustain_s on top of it: no raise,
    no lowering. Once both are gone, a is raised, so the band alone was holding it."""
    a, b = world.replicas
    a.fraction, b.fraction = 0.78, 0.74
    # The band: the squeeze line 2 GiB under what is available at the start, the raise line 1.04 GiB
    # above it (the raise 0.04 GiB + reserve 1 GiB); each margin below is 0.5 GiB or more, wider than
    # the box's own MemAvailable drifts during a test.
    world.memory |= dict(floor=0.74, reserve_bytes=GiB)
    avail0 = start_with_thresholds(world, below_now_gib=2.0)
    hog(world, "build.service", 3)
    line_with(world, "0.78 -> 0.74", "GUARDIAN_REPLICA=a", "GUARDIAN_DECISION=memory")
    line_with(world, "serving again with gpu_memory_utilization 0.74", "GUARDIAN_REPLICA=a", timeout_s=60)
    world.box.systemctl("stop", "build.service")
    hog(world, "steady.service", 1.5)  # headroom ~ avail0 - 1.46 GiB: above min (avail0 - 2), below the raise line
    wait_for(lambda: avail0 - 2 * GiB < mem_available() < avail0 - 0.96 * GiB, 20, "headroom in the band")
    nothing_changes_for(world, 2 * RESTORE_AFTER_S)
    for _ in range(3):  # on for less than sustain_s, off for less than restore_after_s
        world.box.systemctl("start", "build.service")
        time.sleep(SUSTAIN_S / 2)
        world.box.systemctl("stop", "build.service")
        time.sleep(RESTORE_AFTER_S / 2)
    nothing_changes_for(world, RESTORE_AFTER_S)
    assert len(changes(world)) == 1 and fraction_status(world, "a") == (0.74, 0.78)
    world.box.systemctl("stop", "steady.service")
    line_with(world, "raising it 0.74 -> 0.78 (base 0.78)", "GUARDIAN_REPLICA=a", timeout_s=60)
