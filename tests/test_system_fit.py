"""A start that fits (issue 31), in a real systemd with the real page cache: replica a's model is a
4 GiB file that its command line names, read into the cache after a has started, until MemFree is
2 GiB under what a's start needs. Its simulator checks MemFree at start as vLLM does on GB10
(`--check-memory --sim-free-source memfree`). a is frozen, and guardian restarts it:

- with its files' cache released (the default), the start fits and a serves; the journal names
  the bytes released (U3);
- with `release_cache = false`, guardian says the start may not fit and why (U5), and the start
  fails with vLLM's own message.

The thresholds are set from the host's MemFree right after the host's page cache was dropped
(this test runs as root on the host, alone: host_memory)."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from systemd_box import DISK_DIR, wait_for
from world import GiB, World, line_with

# host_memory (run alone, scripts/run-tests): each drops the host's page cache and measures MemFree,
# which every box shares; the polkit test alone does not, and runs side by side
pytestmark = pytest.mark.system
host_memory = pytest.mark.host_memory

MODEL_DIR = f"{DISK_DIR}/models/a"  # on the host's disk: the box's own root is memory (an overlay on tmpfs)
MODEL_BYTES = 4 * GiB
MARGIN_BYTES = MODEL_BYTES // 2  # each side of the need: its first start fits by this, the cached box misses by it
FRACTION = 0.9


def meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} in /proc/meminfo")


def mem_free() -> int:
    return meminfo("MemFree")


def file_cache() -> int:
    return meminfo("Active(file)") + meminfo("Inactive(file)")


def drop_host_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1")


@pytest.fixture
def world(box):
    w = World(box)
    yield w
    w.teardown()
    box.run(["rm", "-rf", f"{DISK_DIR}/models"], check=False)


def start_and_fill(w: World, release_cache: bool) -> int:
    """Replicas up with a's need MARGIN_BYTES under MemFree, then a's model file cached; the need."""
    a = w.replicas[0]
    drop_host_cache()
    need = mem_free() - MARGIN_BYTES
    total = int(need / FRACTION)
    a.model = MODEL_DIR
    a.fraction = FRACTION
    a.sim_args = f"--check-memory --sim-free-source memfree --sim-total-memory-bytes {total} --hang-on-sigterm"
    w.memory = dict(device_total_bytes=total, unified=True, release_cache=release_cache)
    w.box.run(["mkdir", "-p", MODEL_DIR])
    w.setup()
    cache0 = file_cache()
    # The weights, as a download or a sync leaves them: written, flushed, and in the page cache.
    w.box.run(["dd", "if=/dev/zero", f"of={MODEL_DIR}/model.safetensors", "bs=16M",
               f"count={MODEL_BYTES // (16 * 2**20)}", "conv=fsync", "status=none"], timeout=300)
    w.box.run(f"cat {MODEL_DIR}/model.safetensors > /dev/null", timeout=300)
    assert file_cache() - cache0 > MODEL_BYTES // 2, f"{MODEL_DIR} is not in the page cache: not on a disk?"
    free = mem_free()
    assert free < need - MARGIN_BYTES // 2, (
        f"the cached model did not take MemFree under a's need ({free / GiB:.1f} GiB free, need {need / GiB:.1f} GiB)")
    check = w.box.run(["guardian", "check"], check=False).stdout
    assert "start fit: replica a: U3" in check or "start fit: replica a: U5" in check, check
    return need


@host_memory
def test_a_hung_replica_restarted_into_a_full_cache_serves_once_its_files_are_released(world):
    start_and_fill(world, release_cache=True)
    a = world.replicas[0]
    world.fault(a, "frozen")
    line = line_with(world, "released its model files' page cache", "GUARDIAN_REPLICA=a",
                     "GUARDIAN_DECISION=cache", timeout_s=90)
    assert line["GUARDIAN_RULE"] == "U3" and line["PRIORITY"] == "4", line
    assert "1 files" in line["MESSAGE"] and MODEL_DIR in line["MESSAGE"]
    freed_gib = float(line["MESSAGE"].split("the file cache fell by ")[1].split(" GiB")[0])
    assert freed_gib >= 3.0, line["MESSAGE"]  # of the 4 GiB cached
    world.wait_states({"a": "healthy"}, timeout_s=90)
    assert not any("Free memory on device" in m for m in world.box.messages(since=world.since, unit=a.unit))


@host_memory
def test_without_the_release_the_start_fails_with_vllms_message_and_guardian_says_why(world):
    need = start_and_fill(world, release_cache=False)
    a = world.replicas[0]
    world.fault(a, "frozen")
    line = line_with(world, "may not fit", "GUARDIAN_REPLICA=a", "GUARDIAN_DECISION=cache", timeout_s=90)
    assert line["GUARDIAN_RULE"] == "U5" and line["PRIORITY"] == "4", line
    assert "memory.release_cache is off" in line["MESSAGE"] and "memory.release_cache = true" in line["MESSAGE"]
    assert f"it needs {need / GiB:.1f} GiB" in line["MESSAGE"]
    wait_for(lambda: any("Free memory on device" in m for m in world.box.messages(since=world.since, unit=a.unit)),
             60, "a's start to fail with vLLM's free-memory message")
    assert not world.guardian_messages("GUARDIAN_REPLICA=a", "GUARDIAN_DECISION=cache", "GUARDIAN_RULE=U3")


def _as_guardian(w: World, *cmd: str):
    return w.box.run(["runuser", "-u", "guardian", "--", *cmd], check=False)


def test_the_drop_caches_helper_is_guardians_to_start_only_with_drop_caches_set(world):
    """polkit lets user guardian start guardian-drop-caches.service, only with memory.drop_caches on,
    and nothing else; guardian's user cannot write drop_caches itself. (The test bed's /proc/sys is
    read-only, as systemd-nspawn mounts it: the helper runs, as root, and fails there on EROFS; on a
    box it drops the cache.)"""
    unit = "guardian-drop-caches.service"
    world.setup()
    refused = _as_guardian(world, "systemctl", "--no-ask-password", "start", unit)
    assert refused.returncode != 0 and re.search(r"authentication required|Access denied", refused.stderr), refused
    world.memory = dict(drop_caches=True)
    world.write_config()
    world.box.systemctl("reload", "guardian.service")
    wait_for(lambda: unit in world.box.run(["cat", "/etc/polkit-1/rules.d/50-guardian.rules"]).stdout, 20,
             "the rule rewritten on reload with drop_caches")
    since = time.time()
    ran = _as_guardian(world, "systemctl", "--no-ask-password", "start", unit)
    assert not re.search(r"authentication required|Access denied", ran.stderr), ran
    wait_for(lambda: world.box.messages(since=since, unit=unit), 20, "the helper's own journal lines")
    assert world.box.prop(unit, "ExecMainStatus") in ("0", "1", "2")  # it ran: done on a box, EROFS here
    for verb, other in (("stop", unit), ("start", "db.service"), ("restart", unit)):
        r = _as_guardian(world, "systemctl", "--no-ask-password", verb, other)
        assert r.returncode != 0 and re.search(r"authentication required|Access denied", r.stderr), (verb, other, r)
    own = _as_guardian(world, "sh", "-c", "echo 1 > /proc/sys/vm/drop_caches")
    assert own.returncode != 0, own


@host_memory
def test_memory_a_killed_replica_leaves_held_is_said_and_no_start_into_it_is_attempted(world):
    """The driver keeps 3 GiB after replica a's processes exit (the simulator's leak fault: a /dev/shm
    file its process maps, as a driver allocation; it outlives the process). a's need is set 1.5 GiB
    under MemFree at its first start, so once the 3 GiB stay held its start cannot fit. a is frozen
    and guardian restarts it: the 3 GiB measured before the stop did not come back (U8, critical,
    in status and check); a's own start then fails with vLLM's message, and guardian's next start of
    it (an operator's restart) is refused on the memory that is left (U7), not attempted. With the
    memory guard on (a reload), the same restart starts a at the highest fraction that fits (U6),
    written to guardian's env file with its base kept, and a serves."""
    a = world.replicas[0]
    leak = 3 * GiB
    drop_host_cache()
    need = mem_free() - leak + MARGIN_BYTES * 3 // 4  # 1.5 GiB above what the leak leaves
    total = int(need / FRACTION)
    a.fraction = FRACTION
    a.restart_sec = 10  # its crash loop stays activating between attempts, where a restart is asked for
    a.sim_args = f"--check-memory --sim-free-source memfree --sim-total-memory-bytes {total} --hang-on-sigterm"
    world.memory = dict(device_total_bytes=total, unified=True)
    world.setup()
    try:
        # on the box's root, an overlay on a tmpfs as large as the host allows (its /dev/shm is small)
        world.fault(a, "leak", bytes=leak, dir="/var/tmp")
        world.fault(a, "frozen")
        line = line_with(world, "not returned after", "GUARDIAN_REPLICA=a", "GUARDIAN_DECISION=hazard", timeout_s=90)
        assert line["GUARDIAN_RULE"] == "U8" and line["PRIORITY"] == "2", line
        missing_gib = float(line["MESSAGE"].split("replica a: ")[1].split(" GiB")[0])
        assert 2.4 <= missing_gib <= 3.1, line["MESSAGE"]
        assert "at the latest by a reboot" in line["MESSAGE"] and "(U10)" in line["MESSAGE"]
        wait_for(lambda: any("Free memory on device" in m for m in world.box.messages(since=world.since, unit=a.unit)),
                 60, "a's start to fail with vLLM's free-memory message in what the driver left")
        wait_for(lambda: "did not come back" in world.box.run(["guardian", "status"]).stdout, 20,
                 "guardian status to show what was not returned")
        check = world.box.run(["guardian", "check"], check=False)
        # the figure the journal gave (it varies with what MemFree regained), as the running guardian found it
        said = f"replica a: {missing_gib:.1f} GiB its processes held did not come back"
        assert said in check.stdout + check.stderr, check
        wait_for(lambda: world.box.prop(a.unit, "ActiveState") == "activating", 30, "a between two failed starts")
        asked = world.box.run(["guardian", "restart", a.name], check=False, timeout=120)
        assert asked.returncode != 0, asked
        refusal = line_with(world, "not starting vllm-a.service", "GUARDIAN_REPLICA=a", "GUARDIAN_GATE=no-fit")
        assert refusal["GUARDIAN_RULE"] == "U7" and refusal["PRIORITY"] == "3", refusal
        assert f"it needs {need / GiB:.1f} GiB" in refusal["MESSAGE"]
        # the memory guard on, never squeezed by the box's own headroom: only the start's fit lowers a
        world.memory = dict(world.memory, enabled=True, min_headroom_bytes=0, critical_headroom_bytes=0)
        world.write_config()
        world.box.systemctl("reload", "guardian.service")
        line_with(world, "configuration reloaded", "PRIORITY=6")
        asked = world.box.run(["guardian", "restart", a.name], check=False, timeout=120)
        assert asked.returncode == 0, asked
        lowered = line_with(world, "lowered from 0.9", "GUARDIAN_REPLICA=a", "GUARDIAN_RULE=U6")
        assert lowered["PRIORITY"] == "4" and "0.9 is kept as its base" in lowered["MESSAGE"], lowered
        written = world.box.run(["cat", "/var/lib/guardian/replicas/a.env"]).stdout
        fraction = float(re.search(r"^GPU_MEMORY_UTILIZATION=([0-9.]+)$", written, re.M).group(1))
        assert 0.5 <= fraction < FRACTION, written
        assert f"gpu_memory_utilization {fraction:g}, lowered from 0.9" in lowered["MESSAGE"]
        world.wait_states({"a": "healthy"}, timeout_s=60)
        assert world.sim_state(a)["gpu_memory_utilization"] == fraction  # what its start checked and serves with
        kept = json.loads(world.box.run(["cat", "/var/lib/guardian/state.json"]).stdout)
        assert kept["fraction_bases"] == {"a": 0.9}, kept  # restore raises it back from here
    finally:
        world.box.run("rm -f /var/tmp/vllm-sim-held-*", check=False)
