"""The start guard in a real systemd (issue 25): a replica restarted with a fraction whose load would
take the box below the critical headroom, while a hog holds memory, is stopped during its load and
restarted one step lower, where it serves. The simulated replicas take gpu_memory_utilization x
DEVICE bytes of real memory over their load time (vllm-sim --sim-load-memory), as a start does on a
GB10; the thresholds are set relative to the machine's MemAvailable once both replicas serve."""

from __future__ import annotations

import json
import threading

import pytest

from guardian.core.memory.startguard import CGROUP, FALL
from systemd_box import wait_for
from world import HOG, GiB, World, hog, line_with, mem_available, start_with_thresholds

# host_memory: guardian reads the host's /proc/meminfo, which every box shares: run alone (scripts/run-tests)
pytestmark = [pytest.mark.system, pytest.mark.host_memory]

DEVICE = 8 * GiB  # what the fractions are of, for the simulated replicas and for guardian
LOAD_S = 12.0  # b's load time: 0.95 x 8 GiB = 7.6 GiB taken at 0.63 GiB/s
HOG_GIB = 2.0
# Relative to MemAvailable with a and b serving at 0.4 (3.2 GiB each): the squeeze line 3 GiB below
# it, the critical line 4 GiB below it. With the hog (-2) and b restarted at 0.95 (+3.2 freed, then
# -7.6 taken), an unguarded load ends 6.4 GiB below it; one step lower (0.55: 4.4 GiB) ends 3.2 below
# it, clear of the critical line.
BELOW_GIB, CRITICAL_GIB = 3.0, 4.0
# What MemAvailable must never fall under: 1.5 GiB below the critical line, about 2.4 s of b's growth;
# the guard looks every 0.5 s.
BOUND_GIB = CRITICAL_GIB + 1.5
DROP_IN = "/etc/systemd/system/vllm-b.service.d"


@pytest.fixture
def world(box):
    w = World(box)
    a, b = w.replicas
    for r in w.replicas:
        r.fraction = 0.4
        r.sim_args = f"--sim-load-memory --sim-total-memory-bytes {DEVICE}"
    a.load_time_s = 1.0
    b.load_time_s, b.startup_grace_s = LOAD_S, 90
    # sustain_s keeps the squeeze rules (M10-M17) out of it: what stops b's start here is the start guard.
    w.memory = dict(enabled=True, sustain_s=300, cooldown_s=600, step=0.4, floor=0.5, reserve_bytes=0,
                    device_total_bytes=DEVICE, start_guard_interval_s=0.5)
    box.write("/usr/local/bin/hog", HOG, mode=0o755)
    yield w
    w.teardown()
    box.run(["rm", "-rf", DROP_IN])
    box.daemon_reload()


class Sampler:
    """MemAvailable every 0.1 s on a thread (the box shares the host's memory), until stopped."""

    def __init__(self) -> None:
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.samples.append(mem_available())

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join(5)
        return self.samples


def test_a_start_that_would_take_the_box_below_critical_is_stopped_and_restarted_a_step_lower(world):
    a, b = world.replicas
    avail0 = start_with_thresholds(world, below_now_gib=BELOW_GIB, critical_below_now_gib=CRITICAL_GIB)
    bound = avail0 - int(BOUND_GIB * GiB)
    a_before = world.box.identity(a.unit)
    hog(world, "build.service", HOG_GIB)
    wait_for(lambda: mem_available() < avail0 - int(0.9 * HOG_GIB * GiB), 20, "the hog to hold its memory")
    sampler = Sampler()
    try:
        # An operator gives b a bigger fraction in a drop-in (guardian has written no env file for it) and restarts it.
        world.box.write(f"{DROP_IN}/fraction.conf", "[Service]\nEnvironment=GPU_MEMORY_UTILIZATION=0.95\n")
        world.box.daemon_reload()
        world.box.systemctl("restart", b.unit)
        stop = line_with(world, "stopping its start now", "GUARDIAN_REPLICA=b", timeout_s=LOAD_S + 20)
        served = line_with(world, "serving again with gpu_memory_utilization 0.55", "GUARDIAN_REPLICA=b",
                           timeout_s=LOAD_S + 30)
    except AssertionError:
        print("\n".join(f"{e.get('GUARDIAN_RULE', '')} {e['MESSAGE']}" for e in world.guardian_lines()))
        print(world.box.run(["journalctl", "-u", b.unit, "--no-pager", "-n", "60"], check=False).stdout)
        raise
    finally:
        samples = sampler.stop()
    assert len(samples) > 100, "MemAvailable was sampled all along"
    lowest = min(samples)
    assert lowest >= bound, (f"MemAvailable fell to {lowest / GiB:.2f} GiB, under the bound "
                             f"{bound / GiB:.2f} GiB (critical {(avail0 - CRITICAL_GIB * GiB) / GiB:.2f} GiB)")
    m = stop["MESSAGE"]
    assert stop["PRIORITY"] == "4" and stop["GUARDIAN_RULE"] == "S10" and stop["GUARDIAN_DECISION"] == "memory"
    assert "gpu_memory_utilization 0.95 -> 0.55" in m and "vllm-b.service's processes killed" in m
    assert " grew " in m and "of the headroom's fall of" in m and "largest others: " in m, m
    # Where b's growth was measured: its cgroup where systemd accounts its memory (cgroup v2 with the
    # memory controller, as on DGX OS), else the headroom's fall (this test bed's container has no
    # memory controller: MemoryCurrent is "[not set]"). No NVML here.
    accounted = world.box.prop(b.unit, "MemoryCurrent") not in ("", "[not set]")
    assert f"({CGROUP if accounted else FALL})" in m, m
    print(f"lowest MemAvailable {(lowest - bound) / GiB:.2f} GiB above the bound; measured by "
          f"{'cgroup' if accounted else 'the fall'}")
    assert served["GUARDIAN_RULE"] == "M4"
    code, body = world.box.http(b.url + "/_sim/state")
    assert code == 200 and json.loads(body)["gpu_memory_utilization"] == 0.55
    assert "GPU_MEMORY_UTILIZATION=0.55" in world.box.run(["cat", "/var/lib/guardian/replicas/b.env"]).stdout
    # one stop, of b alone; a was never touched
    assert len(world.guardian_lines("GUARDIAN_RULE=S10")) == 1
    assert world.box.identity(a.unit) == a_before
