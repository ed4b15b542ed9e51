"""The fleet on a real 3-member etcd cluster in the container, with real guardians as boxes (issue
12). Each box's memory guard is squeezed from the start (its line is above all the memory there is),
so each wants one lowering, which is a planned restart: the fleet lets one happen at a time."""

from __future__ import annotations

import json
import time

import pytest

from fleet_world import FleetWorld, max_overlap
from systemd_box import wait_for

pytestmark = pytest.mark.system


@pytest.fixture
def fleet(box):
    w = FleetWorld(box)
    yield w
    w.teardown()


def test_eight_squeezed_boxes_lower_one_at_a_time_through_a_leader_kill_and_a_clock_an_hour_off(fleet):
    fleet.faketime = {7: "+3600"}  # box7's guardian lives an hour ahead: leases are etcd's time
    fleet.setup()
    fleet.start_guardians()
    # two lowerings in, kill the etcd leader while the fleet is busy
    wait_for(lambda: sum(fleet.lowered(i) for i in range(fleet.n)) >= 2, 120, "two boxes lowered")
    leader = fleet.leader()
    fleet.box.kill_unit(f"etcd-{leader}.service")
    wait_for(fleet.leader, 30, "a new etcd leader")
    wait_for(lambda: all(fleet.lowered(i) for i in range(fleet.n)), 240,
             "every box lowered in turn", interval_s=1)
    intervals = fleet.slot_intervals()
    assert sorted(b for b, _, _ in intervals) == sorted(fleet.names()), intervals
    assert max_overlap(intervals) == 1, intervals  # never more than max_planned_restarts = 1
    # each model (4 replicas each) kept at least min_serving = 1 other replica serving: with one
    # restart at a time across the fleet, at most one of its four was ever out
    for i in range(fleet.n):
        lowers = [e for e in fleet.lines(i, "GUARDIAN_DECISION=memory") if "restarting" in e["MESSAGE"]]
        assert len(lowers) == 1, [e["MESSAGE"] for e in lowers]
    waits = [e["MESSAGE"] for i in range(fleet.n) for e in fleet.lines(i, "GUARDIAN_RULE=M15")]
    assert any("waiting for a fleet slot" in m and "held, by box" in m for m in waits), waits[:3]
    out = fleet.box.run(["guardian", "--config", "/etc/guardian/box0.toml", "status", "--fleet"]).stdout
    assert "8 box(es)" in out and "planned restarts 0 of 1" in out


def test_a_guardian_killed_holding_a_slot_frees_it_when_its_lease_expires(fleet):
    """box0's memory guard lowers its replica, which then loads for 20 s: box0 holds the slot all
    along. box1's operator asks for a restart and waits for it. box0's guardian is SIGKILLed (and
    not restarted): its slot goes with its lease, and box1 proceeds."""
    fleet.n, fleet.models, fleet.min_serving = 2, 1, 0
    fleet.load_time_s = {0: 20.0}
    fleet.no_restart = {0}
    fleet.unsqueezed = {1}
    fleet.setup()
    fleet.start_guardians()
    wait_for(lambda: any("taken" in e["MESSAGE"] for e in fleet.lines(0, "GUARDIAN_DECISION=fleet")), 60,
             "box0 to take the slot")
    fleet.box.run(["systemd-run", "--unit=ask-box1", "guardian", "--config", "/etc/guardian/box1.toml", "restart", "a"])
    wait_for(lambda: any("held, by box0/a" in e["MESSAGE"] for e in fleet.lines(1, "GUARDIAN_RULE=F4")), 30,
             "box1 waiting for box0's slot")
    fleet.box.kill_unit(fleet.unit(0))
    killed = time.time()
    wait_for(lambda: any("taken" in e["MESSAGE"] for e in fleet.lines(1, "GUARDIAN_DECISION=fleet")), 30,
             "box1 to take the slot once box0's lease expired")
    taken = next(int(e["__REALTIME_TIMESTAMP"]) / 1e6 for e in fleet.lines(1, "GUARDIAN_DECISION=fleet")
                 if "taken" in e["MESSAGE"])
    print(f"box1 took the slot {taken - killed:.1f} s after box0 was killed (lease ttl {fleet.ttl_s} s)")
    assert taken > killed  # freed by the lease: box0 never gave it back
    wait_for(lambda: fleet.lines(1, "GUARDIAN_DECISION=restart"), 30, "box1's restart")
    fleet.box.systemctl("stop", "ask-box1.service", check=False)
    fleet.box.systemctl("reset-failed", "ask-box1.service", check=False)


def test_with_etcd_down_a_hung_replica_is_restarted_planned_restarts_wait_then_resume(fleet):
    fleet.n, fleet.models = 2, 1
    fleet.setup(memory_squeezed=False)
    fleet.start_guardians()
    wait_for(lambda: any("joined fleet" in e["MESSAGE"] for e in fleet.lines(1)), 30, "box1 in the fleet")
    fleet.box.systemctl("stop", *[f"etcd-{m}.service" for m in fleet.members])
    wait_for(lambda: any("etcd cannot be reached" in e["MESSAGE"] for e in fleet.lines(0)), 30, "box0 to say so")
    # a hung replica: restarted all the same
    pid = fleet.box.prop(fleet.replica_unit(0), "MainPID")
    fleet.box.run(["kill", "-STOP", pid])
    wait_for(lambda: fleet.box.prop(fleet.replica_unit(0), "MainPID") not in (pid, "0"), 30, "the hung replica restarted")
    # a planned restart waits, said at error, and the daemon refuses it when its wait ends (exit 4)
    asked = fleet.box.run(["guardian", "--config", "/etc/guardian/box1.toml", "restart", "a", "--wait", "5s"],
                          check=False, timeout=60)
    assert asked.returncode == 4, asked
    assert "waiting: " in asked.stdout and "etcd cannot be reached" in asked.stdout, asked
    f3 = [e for e in fleet.lines(1, "GUARDIAN_RULE=F3")]
    assert f3 and f3[0]["PRIORITY"] == "3" and "etcd cannot be reached" in f3[0]["MESSAGE"]
    said = [e for e in fleet.lines(0) if "etcd cannot be reached" in e["MESSAGE"]]
    assert len(said) == 1
    # etcd back: everything resumes, and a planned restart goes through
    fleet.box.systemctl("start", *[f"etcd-{m}.service" for m in fleet.members])
    wait_for(fleet.leader, 30, "an etcd leader again")
    wait_for(lambda: any("etcd answers again" in e["MESSAGE"] for e in fleet.lines(1)), 60, "box1 back in the fleet")
    asked = fleet.box.run(["guardian", "--config", "/etc/guardian/box1.toml", "restart", "a"], check=False, timeout=120)
    assert asked.returncode == 0, asked.stdout + asked.stderr


def test_garbage_written_under_the_prefix_by_one_member_does_not_stop_a_restart_on_another_box(fleet):
    """Issue 21, row 2: a 100 KB value of '[' under replicas/ made every box's view raise, every tick
    was abandoned, the watchdog pings stopped and systemd restarted the guardians in a loop. Now a
    value that is not a member's is skipped; a frozen replica is restarted as fast as ever."""
    import base64

    fleet.n, fleet.models = 2, 1
    fleet.setup(memory_squeezed=False)
    fleet.start_guardians()
    for i in range(fleet.n):
        wait_for(lambda i=i: any("joined fleet" in e["MESSAGE"] for e in fleet.lines(i)), 30, f"box{i} in the fleet")
    b64 = lambda raw: base64.b64encode(raw).decode()  # noqa: E731
    garbage = {
        "replicas/box1/evil": b"[" * 100_000,
        "replicas/box1/deep": b"[" * 50_000 + b"]" * 50_000,  # valid JSON, too deep to decode recursively
        "replicas/box1/list": b'["box", "name"]',
        "replicas/box1/bytes": b"\xff\xfe\x00garbage",
        "slots/7": b"{not json",
    }
    # what box1, a fleet member, may write under the prefix (too large for a command line: a file)
    puts = [{"key": b64(f"/guardian/test/{key}".encode()), "value": b64(value)} for key, value in garbage.items()]
    fleet.box.write("/tmp/garbage.json", json.dumps(puts))
    script = ("import json,urllib.request\n"
              "for body in json.load(open('/tmp/garbage.json')):\n"
              f"  r=urllib.request.urlopen(urllib.request.Request({fleet.endpoints[0] + '/v3/kv/put'!r}, "
              "data=json.dumps(body).encode(), headers={'Content-Type': 'application/json'}), timeout=5)\n"
              "  assert r.status == 200, r.status\n")
    fleet.box.run(["python3", "-c", script])
    pid = fleet.box.prop(fleet.replica_unit(0), "MainPID")
    fleet.box.run(["kill", "-STOP", pid])
    frozen = time.time()
    wait_for(lambda: fleet.lines(0, "GUARDIAN_DECISION=restart"), 30, "box0's frozen replica restarted")
    first = fleet.lines(0, "GUARDIAN_DECISION=restart")[0]
    decided = int(first["__REALTIME_TIMESTAMP"]) / 1e6
    print(f"box0's frozen replica: restart decided {decided - frozen:.1f} s after the freeze")
    # by the same rule as without garbage: the watchdog's own verdict, not held back by the fleet
    assert decided > frozen and "unresponsive" in first["MESSAGE"], first["MESSAGE"]
    for i in range(fleet.n):
        said = [e["MESSAGE"] for e in fleet.lines(i)]
        assert not [m for m in said if "abandoned" in m or "etcd cannot be reached" in m], said
        assert fleet.box.prop(fleet.unit(i), "NRestarts") == "0"
    out = fleet.box.run(["guardian", "--config", "/etc/guardian/box1.toml", "status", "--fleet"], check=False)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stdout + out.stderr
    assert "2 box(es)" in out.stdout, out.stdout


def test_a_box_serving_the_model_with_other_weights_is_a_hazard_on_the_other_box(fleet):
    """Issue 33 item 1: box0's replica loads /opt/fleet/a, box1's /opt/fleet/b (another config.json),
    both served as m0. Each box publishes its fingerprint with its replica; each sees the other's
    differ (W3), said once, naming the other box."""
    fleet.box.write("/opt/fleet/a/config.json", json.dumps({"num_hidden_layers": 32}))
    fleet.box.write("/opt/fleet/b/config.json", json.dumps({"num_hidden_layers": 36}))
    fleet.n, fleet.models = 2, 1
    fleet.model_paths = {0: "/opt/fleet/a", 1: "/opt/fleet/b"}
    try:
        fleet.setup(memory_squeezed=False)
        fleet.start_guardians()
        for i, other in ((0, "box1"), (1, "box0")):
            line = wait_for(lambda i=i: next((e for e in fleet.lines(i, "GUARDIAN_RULE=W3")), None), 60,
                            f"box{i} to see the other box's weights")
            assert line["PRIORITY"] == "3" and f"{other}/a: dir2:" in line["MESSAGE"], line
            assert line["GUARDIAN_HAZARD"] == "weights-differ-fleet:m0"
        assert all(len(fleet.lines(i, "GUARDIAN_RULE=W3")) == 1 for i in range(2))  # said once
    finally:
        fleet.box.run(["rm", "-rf", "/opt/fleet"], check=False)
