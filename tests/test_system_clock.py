"""guardian under a stepped wall clock (issue 10, row 7). The machine's clock is shared by
everything on it and is never touched: guardian alone runs under libfaketime (Debian's
`faketime`), reading a timestamp file that the test rewrites, with the monotonic clock left real
(FAKETIME_DONT_FAKE_MONOTONIC=1). Stepping guardian's wall clock by an hour either way, in the
middle of a model load and of a dead replica's window, must change no decision."""

from __future__ import annotations

import time

import pytest

from systemd_box import wait_for
from world import Replica

pytestmark = pytest.mark.system

CLOCK_FILE = "/run/guardian-faketime"


def run_under_faketime(world) -> None:
    lib = next(p for p in world.box.run(["dpkg", "-L", "libfaketime"]).stdout.split()
               if p.endswith("/libfaketimeMT.so.1"))
    world.box.write(CLOCK_FILE, "+0\n")
    world.box.write("/etc/systemd/system/guardian.service.d/faketime.conf", (
        "[Service]\n"
        f"Environment=LD_PRELOAD={lib}\n"
        f"Environment=FAKETIME_TIMESTAMP_FILE={CLOCK_FILE}\n"
        "Environment=FAKETIME_NO_CACHE=1\n"
        "Environment=FAKETIME_DONT_FAKE_MONOTONIC=1\n"
    ))
    world.box.daemon_reload()


def step(world, offset: str) -> None:
    world.box.write(CLOCK_FILE, offset + "\n")


def test_a_wall_clock_step_changes_no_decision(world):
    world.replicas = [Replica("a", 8001), Replica("b", 8002, load_time_s=12)]
    world.watchdog["engine_quiet_s"] = 120  # L22 out of reach: the unresponsive window (L8) is under test
    world.setup(start_guardian=False)
    run_under_faketime(world)
    world.start_guardian()
    a, b = world.replicas
    # guardian's wall clock is really faked: its status file is stamped an hour ahead
    step(world, "+3600")
    wait_for(lambda: world.status().get("updated_at", 0) > time.time() + 3000, 60, "guardian's clock to step")
    step(world, "+0")

    # 1. +1 h in the middle of a 12 s model load (grace 20 s): still starting, then healthy; never restarted
    world.box.systemctl("restart", b.unit)
    old_b = world.box.identity(b.unit)
    world.wait_states({"b": "starting"}, timeout_s=60)
    step(world, "+3600")
    world.wait_states({"b": "healthy"}, timeout_s=30)
    assert world.box.identity(b.unit) == old_b and world.restarts_of(b) == []

    # 2. -1 h in the middle of a frozen replica's unresponsive window (4 s): restarted as without it
    old_a = world.box.identity(a.unit)
    world.kill(a.unit, "STOP")
    step(world, "-3600")
    wait_for(lambda: world.box.identity(a.unit) != old_a, 60, "the frozen replica to be restarted despite the step")
    # by L8, as without the step. (More than one decision only where a restart could not be issued:
    # on a loaded box polkitd once took 15 s to load its rules, and the D-Bus call ran out at 5 s.)
    lines = world.restarts_of(a)
    assert lines and all(e["GUARDIAN_STATE"] == "unresponsive" and e["GUARDIAN_RULE"] == "L8" for e in lines), lines
    issued_again = [m for m in world.guardian_messages("GUARDIAN_REPLICA=a") if "could not be issued" in m]
    assert len(lines) == 1 + len(issued_again), (len(lines), issued_again)
    world.wait_states({"a": "healthy", "b": "healthy"}, timeout_s=30)
