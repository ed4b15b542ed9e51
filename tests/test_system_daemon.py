"""guardian as a systemd service: READY, watchdog pings, config errors, reload, status, state (issue 2)."""

from __future__ import annotations

import json
import time

import pytest

from systemd_box import wait_for
from world import Replica

pytestmark = pytest.mark.system


def test_active_only_after_ready(world):
    world.setup(start_guardian=False)
    world.box.systemctl("start", "guardian.service")  # Type=notify: returns once READY=1 arrived
    msgs = world.box.messages(since=world.since, unit="guardian.service")
    ready = next(i for i, m in enumerate(msgs) if m.startswith("guardian ready:"))
    started = next(i for i, m in enumerate(msgs) if m.startswith("Started guardian.service"))
    first_verdict = next(i for i, m in enumerate(msgs) if m.startswith("replica a: starting -> healthy"))
    assert first_verdict < ready < started, msgs
    # the thresholds in effect are logged before anything else happens
    assert any(m.startswith("limits in effect: watchdog: stalled when") for m in msgs[:ready])
    assert "a healthy" in world.box.prop("guardian.service", "StatusText")


def test_frozen_loop_gets_guardian_restarted_by_systemds_watchdog(world):
    world.setup(start_guardian=False)
    # 5 s: guardian refuses a probe timeout over a quarter of it (the test world's are 1 s)
    world.box.write("/etc/systemd/system/guardian.service.d/watchdog.conf", "[Service]\nWatchdogSec=5s\nRestartSec=1s\n")
    world.box.daemon_reload()
    world.start_guardian()
    # Pings keep coming while the loop runs: well past WatchdogSec, no restart.
    time.sleep(5)
    assert world.box.prop("guardian.service", "NRestarts") == "0"
    world.kill("guardian.service", "STOP")
    wait_for(lambda: world.box.prop("guardian.service", "NRestarts") == "1", 20, "systemd to restart guardian")
    msgs = world.box.messages(since=world.since, unit="guardian.service")
    assert any("Watchdog timeout" in m for m in msgs), msgs
    wait_for(lambda: world.box.prop("guardian.service", "ActiveState") == "active", 20, "guardian active again")


def test_bad_config_exits_2_naming_the_key_and_does_not_loop(world):
    world.setup(start_guardian=False)
    world.write_config(world.config_text().replace("interval_s = 0.5", "interval_s = 0.5\nstall_windw_s = 3"))
    r = world.box.run(["guardian", "check"], check=False)
    assert r.returncode == 2
    assert "stall_windw_s: unknown key" in r.stderr and "/etc/guardian/guardian.toml" in r.stderr
    world.box.systemctl("start", "guardian.service", check=False)
    wait_for(lambda: world.box.prop("guardian.service", "ActiveState") == "failed", 20, "guardian to fail")
    time.sleep(7)  # > RestartSec=5s: a restart loop would have begun
    assert world.box.prop("guardian.service", "NRestarts") == "0"
    assert world.box.prop("guardian.service", "ExecMainStatus") == "2"
    msgs = world.box.messages(since=world.since, unit="guardian.service")
    assert any("stall_windw_s: unknown key" in m for m in msgs)


def test_sighup_reloads_a_valid_config_and_keeps_the_old_on_an_invalid_one(world):
    world.replicas = [Replica("a", 8001), Replica("b", 8002)]
    world.setup(start_guardian=False)
    world.write_config(world.config_text([world.replicas[0]]))
    world.box.systemctl("start", "guardian.service")
    world.wait_states({"a": "healthy"}, timeout_s=20)
    assert "b" not in world.states()
    pid = world.box.prop("guardian.service", "MainPID")
    # valid: b is watched from now on
    world.write_config()
    world.box.systemctl("reload", "guardian.service")
    world.wait_states({"a": "healthy", "b": "healthy"}, timeout_s=20)
    # invalid: error logged, still running the previous config
    world.write_config(world.config_text() + "\n[[replicas]]\nname = \"a\"\n")
    world.box.systemctl("reload", "guardian.service")
    line = wait_for(lambda: next((e for e in world.guardian_lines("PRIORITY=3") if "reload refused" in e["MESSAGE"]), None),
                    20, "the reload refusal")
    assert "keeping the running config" in line["MESSAGE"]
    time.sleep(2)
    assert world.box.prop("guardian.service", "MainPID") == pid
    assert world.box.prop("guardian.service", "ActiveState") == "active"
    assert world.states() == {"a": "healthy", "b": "healthy"}


def test_status_shows_each_replica_from_the_running_daemon(world):
    world.setup()
    world.box.systemctl("stop", "vllm-b.service")
    world.wait_states({"a": "healthy", "b": "stopped"}, timeout_s=60)
    out = world.box.run(["guardian", "status"]).stdout
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "healthy" in lines["a"] and "vllm-a.service" in lines["a"]
    assert "stopped" in lines["b"] and "vllm-b.service is inactive" in lines["b"]
    assert "memory:" in out and "GiB available" in out
    data = json.loads(world.box.run(["guardian", "status", "--json"]).stdout)
    assert data["pid"] == int(world.box.prop("guardian.service", "MainPID"))
    assert data["stale"] is False
    assert data["ticks"]["count"] > 0 and 0 < data["ticks"]["p50_s"] <= data["ticks"]["max_s"]
    world.box.systemctl("stop", "guardian.service")
    r = world.box.run(["guardian", "status"], check=False)
    assert r.returncode == 3 and "not running" in r.stderr


def test_a_restart_by_someone_else_is_seen_on_the_next_ticks(world):
    """guardian keeps systemd's full view of a unit between ticks; a restart must still show at once
    (not when that view ages out after 30 s), or a new engine would be judged by the old one's past."""
    world.setup()
    a = world.replicas[0]
    before = time.time()
    world.box.systemctl("restart", a.unit)  # returns once the new process has started
    restarted = time.time()
    started = wait_for(lambda: (world.status()["replicas"]["a"]["unit_started_at"] or 0) >= before and
                       world.status()["replicas"]["a"]["unit_started_at"], 5, "guardian to see vllm-a's new start")
    # the new process's own start, not when guardian saw it (a tick later): an order of two points,
    # the second moved by the monotonic-to-wall conversion's error (load only makes `restarted` later)
    latest_start = restarted + 0.5
    assert started <= latest_start, (before, started, restarted)
    world.wait_states({"a": "healthy"}, timeout_s=20)


MANY_CALLS = """
import asyncio
from guardian.observe.systemd import Systemd
async def main():
    sd = Systemd()
    await sd.connect()
    names = ["vllm-a.service", "vllm-b.service", "db.service", "proxy.service"] * 40
    views = await asyncio.gather(*(sd.unit_info(n) for n in names), return_exceptions=True)
    bad = [repr(v) for v in views if isinstance(v, BaseException)]
    print(len(views) - len(bad), "ok;", bad[:3])
asyncio.run(main())
"""


def test_many_unit_views_at_once_all_succeed(world):
    """160 unit views at once are some 2,000 D-Bus calls: dbus-next fails a send with EAGAIN, and
    the connection with it, when too many are written at once (32 replicas did that)."""
    world.setup(start_guardian=False)
    world.box.write("/tmp/many_calls.py", MANY_CALLS)
    r = world.box.run("PYTHONPATH=/usr/lib/guardian python3 -s /tmp/many_calls.py", timeout=120)
    assert r.stdout.startswith("160 ok;"), r.stdout + r.stderr


def test_sigterm_stops_cleanly_and_quickly(world):
    world.setup()
    t0 = time.monotonic()
    world.box.systemctl("stop", "guardian.service")  # SIGTERM; TimeoutStopSec=20s would SIGKILL
    print(f"guardian stopped {time.monotonic() - t0:.1f} s after SIGTERM")
    # by itself: a stop that ran past TimeoutStopSec would end in SIGKILL and Result=timeout
    assert world.box.prop("guardian.service", "Result") == "success"
    assert world.box.prop("guardian.service", "ExecMainStatus") == "0"
    assert "guardian stopped" in world.guardian_messages()[-1]
    # the runtime status went with it (RuntimeDirectory), so `status` cannot show stale data as live
    assert world.box.run(["guardian", "status"], check=False).returncode == 3


def test_corrupt_state_file_is_moved_aside_and_the_daemon_runs(world):
    world.setup(start_guardian=False)
    world.box.write("/var/lib/guardian/state.json", '{"version": 1, "restarts": {"a": [1, 2')
    world.start_guardian()
    line = wait_for(lambda: next((e for e in world.guardian_lines("PRIORITY=3") if "was corrupt" in e["MESSAGE"]), None),
                    20, "the corrupt-state line")
    assert "moved aside" in line["MESSAGE"]
    listing = world.box.run("ls /var/lib/guardian").stdout.split()
    assert any(n.startswith("state.json.corrupt-") for n in listing), listing
    state = json.loads(world.box.run(["cat", "/var/lib/guardian/state.json"]).stdout)
    assert state["version"] == 1 and state["restarts"] == {}
    assert world.box.prop("guardian.service", "ActiveState") == "active"
    # and it still does its job
    a = world.replicas[0]
    old = world.box.identity(a.unit)
    world.kill(a.unit, "STOP")
    wait_for(lambda: world.box.identity(a.unit) != old, 30, "the frozen replica to be restarted")


def test_pause_survives_a_guardian_restart_and_resume_ends_it(world):
    world.setup()
    a = world.replicas[0]
    out = world.box.run(["guardian", "pause", "a"]).stdout
    assert "paused" in out
    world.box.systemctl("restart", "guardian.service")
    world.wait_states({"a": "paused", "b": "healthy"}, timeout_s=20)
    old = world.box.identity(a.unit)
    world.kill(a.unit, "STOP")
    time.sleep(world.watchdog["unresponsive_after_s"] + 3)
    assert world.box.identity(a.unit) == old and world.restarts_of(a) == []
    world.box.run(["guardian", "resume", "a"])
    wait_for(lambda: world.box.identity(a.unit) != old, 30, "a restart once resumed")


def test_manual_restart_goes_through_the_gates(world):
    world.setup()
    a = world.replicas[0]
    old = world.box.identity(a.unit)
    r = world.box.run(["guardian", "restart", "a"], check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert world.box.identity(a.unit) != old
    world.box.systemctl("disable", a.unit)
    old = world.box.identity(a.unit)
    r = world.box.run(["guardian", "restart", "a"], check=False)
    assert r.returncode == 1 and world.box.identity(a.unit) == old
    assert any("refused" in m and "disabled" in m for m in world.guardian_messages("GUARDIAN_REPLICA=a"))
    r = world.box.run(["guardian", "restart", "nosuch"], check=False)
    assert r.returncode != 0 and "no replica named 'nosuch'" in r.stderr


def test_manual_restart_waits_while_another_replica_loads_with_or_without_the_daemon(world):
    """A Type=simple vLLM is "active" for minutes while it loads: `guardian restart a` must not start
    a second load next to it (vLLM #35920), whether the daemon answers or the CLI acts alone."""
    world.replicas = [Replica("a", 8001), Replica("b", 8002, load_time_s=8)]
    world.setup()
    a, b = world.replicas
    old = world.box.identity(a.unit)
    world.box.systemctl("restart", b.unit)  # b is active, loading, not serving
    r = world.box.run(["guardian", "restart", "a"], check=False)
    assert r.returncode == 1 and "one-at-a-time" in r.stderr and "asked the running guardian" in r.stdout, r
    assert world.box.identity(a.unit) == old
    line = world.guardian_lines("GUARDIAN_REPLICA=a", "GUARDIAN_DECISION=refused")[-1]
    assert line["GUARDIAN_GATE"] == "one-at-a-time" and line["GUARDIAN_RULE"] == "A3"
    # --wait (A4): the request waits while b loads, says what for once, and goes through once b serves
    r = world.box.run(["guardian", "restart", "a", "--wait", "60"], check=False, timeout=90)
    assert r.returncode == 0 and "waiting: b is starting" in r.stdout and "vllm-a.service: done" in r.stdout, r
    assert r.stdout.count("waiting:") == 1, r.stdout
    (said,) = world.guardian_lines("GUARDIAN_REPLICA=a", "GUARDIAN_RULE=A4")
    assert said["PRIORITY"] == "6" and "an operator's restart waits: b is starting" in said["MESSAGE"]
    assert world.box.identity(a.unit) != old
    old = world.box.identity(a.unit)

    world.box.systemctl("stop", "guardian.service")
    world.box.systemctl("restart", b.unit)
    r = world.box.run(["guardian", "restart", "a"], check=False)
    assert r.returncode == 1 and "one-at-a-time" in r.stderr and "asked the running" not in r.stdout, r
    assert world.box.identity(a.unit) == old
    # without the daemon the command waits itself, looking again every interval_s: admitted once b serves
    r = world.box.run(["guardian", "restart", "a", "--wait", "60"], check=False, timeout=90)
    assert r.returncode == 0 and "waiting: b is starting" in r.stdout and "vllm-a.service: done" in r.stdout, r
    assert world.box.identity(a.unit) != old


def test_guardian_reconnects_after_the_system_bus_restarts(world):
    """After `systemctl restart dbus`, guardian used to stay blind ("D-Bus ListUnitsByNames timed
    out") for as long as it ran. It reconnects, subscribes again, says so once, and acts again."""
    world.setup()
    a = world.replicas[0]
    world.box.systemctl("restart", "dbus.service")
    wait_for(lambda: any(m.startswith("system bus back: reconnected") for m in world.guardian_messages()), 30,
             "guardian to reconnect")
    lost = [m for m in world.guardian_messages() if m.startswith("lost the system bus")]
    assert len(lost) == 1
    world.wait_states({"a": "healthy", "b": "healthy"}, timeout_s=30)
    # it acts again, and hears the job's JobRemoved signal on the new connection
    old = world.box.identity(a.unit)
    world.kill(a.unit, "STOP")
    wait_for(lambda: world.box.identity(a.unit) != old, 30, "the frozen replica to be restarted")
    wait_for(lambda: any("restart job of vllm-a.service done" in m for m in world.guardian_messages()), 30,
             "the restart job's result")
    assert world.box.prop("guardian.service", "NRestarts") == "0"


def test_a_bus_that_stays_gone_gets_guardian_restarted_by_systemds_watchdog(world):
    world.setup(start_guardian=False)
    world.top["bus_lost_restart_s"] = 3
    world.write_config()
    world.box.write("/etc/systemd/system/guardian.service.d/watchdog.conf", "[Service]\nWatchdogSec=6s\nRestartSec=1s\n")
    world.box.daemon_reload()
    world.start_guardian()
    try:
        world.box.systemctl("stop", "dbus.socket", "dbus.service")
        wait_for(lambda: any("stops pinging systemd's watchdog" in m for m in world.guardian_messages("PRIORITY=2")),
                 30, "guardian to give up on the bus")
        wait_for(lambda: int(world.box.prop("guardian.service", "NRestarts")) >= 1, 30, "systemd to restart guardian")
        assert any("Watchdog timeout" in m for m in world.box.messages(since=world.since, unit="guardian.service"))
    finally:
        world.box.systemctl("start", "dbus.socket", "dbus.service")
    wait_for(lambda: world.box.prop("guardian.service", "ActiveState") == "active", 60, "guardian active again")
    world.wait_states({"a": "healthy", "b": "healthy"}, timeout_s=30)
