"""The kernel's view of each replica's connections, in a real systemd with real sockets (issue 20):
responses flowing are progress, clients waiting are queued work, a client that bypasses nginx is
named. Clients are tests/loadgen.py in units of their own, so that the kernel names them."""

from __future__ import annotations

import json
import time

import pytest

from systemd_box import wait_for
from world import PROXY, PROXY_URL, Replica, World

pytestmark = pytest.mark.system


def clients(world: World, unit: str, url: str, n: int, mode: str, max_tokens: int) -> None:
    """N looping clients of URL in their own unit (stream: long token streams; plain: each waits
    for its whole answer)."""
    world.box.run(["rm", "-f", f"/run/{unit}.stop", f"/run/{unit}.jsonl"])
    world.box.run(["systemd-run", f"--unit={unit}", "-p", "Restart=no", "/usr/bin/python3",
                   "/opt/guardian/src/tests/loadgen.py", url, world.replicas[0].model, f"/run/{unit}.jsonl",
                   "--clients", str(n), "--max-tokens", str(max_tokens), "--mode", mode,
                   "--stop-file", f"/run/{unit}.stop"])
    world.extra_units.append(f"{unit}.service")


def stop_clients(world: World, unit: str) -> list[dict]:
    world.box.run(["touch", f"/run/{unit}.stop"])
    world.box.systemctl("kill", "-s", "KILL", f"{unit}.service", check=False)
    out = world.box.run(["cat", f"/run/{unit}.jsonl"], check=False).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def decision_after(world: World, r, t0_wall: float) -> float | None:
    lines = [e for e in world.restarts_of(r) if int(e["__REALTIME_TIMESTAMP"]) / 1e6 >= t0_wall]
    return int(lines[0]["__REALTIME_TIMESTAMP"]) / 1e6 - t0_wall if lines else None


def restart_while_watching(world: World, r, t0_wall: float, timeout_s: float) -> list[str]:
    """Wait for R's restart decision after T0_WALL; the evidence of every busy verdict begun after it
    that `guardian status` showed meanwhile (the journal says a busy spell only once it has held 10 s)."""
    busy: list[str] = []

    def decided() -> float | None:
        got = world.status().get("replicas", {}).get(r.name, {})
        if got.get("state") == "busy" and (got.get("since") or 0.0) > t0_wall:
            busy.append(got.get("evidence", ""))
        return decision_after(world, r, t0_wall)

    wait_for(decided, timeout_s, f"{r.name}'s restart")
    return busy


def test_a_replica_whose_endpoints_all_stall_while_streams_flow_is_not_restarted(world):
    """The false restart measured on a real vLLM 0.32: every endpoint unanswered while 8 streams
    kept delivering tokens. Without the kernel's view guardian judged it unresponsive (L8) after
    unresponsive_after_s (4 s here) and killed it."""
    world.setup()
    a = world.replicas[0]
    clients(world, "streams", a.url, 8, "stream", 2000)  # 100 s streams at 20 tokens/s
    wait_for(lambda: (world.status()["replicas"]["a"].get("connections") or {}).get("flowing", 0) >= 4, 30,
             "the kernel to see a's streams flow")
    old = world.box.identity(a.unit)
    world.fault(a, "stall-endpoints", stall_s=12)  # 3 x unresponsive_after_s
    stalled_at = time.monotonic()
    seen = set()
    busy: list[str] = []  # its evidence while busy, from `guardian status` (the journal says a busy
    while time.monotonic() - stalled_at < 15:  # spell only once it has held 10 s: a quiet journal)
        got = world.status().get("replicas", {}).get("a", {})
        seen.add(got.get("state"))
        if got.get("state") == "busy":
            busy.append(got.get("evidence", ""))
        code, _ = world.box.http(a.url + "/_sim/state", timeout_s=2)
        assert code == 200
        time.sleep(0.5)
    records = stop_clients(world, "streams")
    assert world.box.identity(a.unit) == old and world.restarts_of(a) == []
    assert seen <= {"healthy", "busy"}, seen
    assert not [q for q in records if q["failed"]], [q["failed"] for q in records if q["failed"]][:3]
    assert any("responses flowing to" in m and "(kernel)" in m for m in busy), busy


def test_a_sigstopped_server_under_load_is_still_restarted_within_its_window(world):
    """Streams were flowing; a frozen server sends nothing on any socket: unresponsive 10 s after its
    last answer and its last response that flowed (guardian's default window)."""
    world.watchdog["unresponsive_after_s"] = 10
    world.watchdog["engine_quiet_s"] = 120  # L22 (its quiet processes) out of reach: L8 and the kernel's view are under test
    world.setup()
    a = world.replicas[0]
    clients(world, "streams", a.url, 4, "stream", 2000)
    wait_for(lambda: (world.status()["replicas"]["a"].get("connections") or {}).get("flowing", 0) >= 2, 30,
             "the kernel to see a's streams flow")
    frozen_at = time.time()
    world.kill(a.unit, "STOP")
    wait_for(lambda: decision_after(world, a, frozen_at) is not None, 90, "a's restart")
    print(f"SIGSTOP under load -> restart decision: {decision_after(world, a, frozen_at):.1f} s")
    # By L8, with the kernel's word that nothing flowed: the streams did not keep it "busy". (Its
    # window, 10 s from the last answer and the last response that flowed, is test_liveness.py's
    # boundary test; the time itself is the benchmark's.)
    (line,) = world.restarts_of(a)
    assert line["GUARDIAN_RULE"] == "L8", line
    assert "unresponsive" in line["MESSAGE"] and "kernel: nothing flowed to" in line["MESSAGE"], line["MESSAGE"]


def test_an_engine_frozen_between_steps_with_clients_waiting_is_restarted_by_the_stall_shortcut(world):
    """0 running, 0 waiting and frozen counters on /metrics, /health 200; 4 clients' plain requests
    wait in the API server. guardian runs at its default windows and was started 20 s before the
    fault, so its canary deadline is learned from its first canaries (the learning burst)."""
    world.watchdog = {"restart_budget": 3, "backoff_s": 0, "restart_job_timeout_s": 30}
    world.top = {"interval_s": 2.0}
    world.replica_defaults = True
    world.setup()
    started = time.monotonic()
    a = world.replicas[0]
    clients(world, "plain", a.url, 4, "plain", 10)
    wait_for(lambda: time.monotonic() - started >= 20, 30, "guardian to have run 20 s", interval_s=0.5)
    injected_at = time.time()
    world.fault(a, "between-steps")
    frozen = wait_for(lambda: next(iter(e for e in world.box.journal(f"_SYSTEMD_UNIT={a.unit}", since=injected_at)
                                        if "SIM engine frozen between steps" in e.get("MESSAGE", "")), None), 120,
                      "the engine to freeze at its next step with nothing running")
    frozen_at = int(frozen["__REALTIME_TIMESTAMP"]) / 1e6
    wait_for(lambda: decision_after(world, a, frozen_at) is not None, 120, "a's restart")
    took = decision_after(world, a, frozen_at)
    stop_clients(world, "plain")
    (first,) = world.restarts_of(a)
    line = first["MESSAGE"]
    print(f"between steps with 4 clients waiting -> restart decision: {took:.1f} s ({first.get('GUARDIAN_RULE')}): {line}")
    # By the stall shortcut (clients waiting, a canary failed with nothing moving), not by waiting out
    # the whole stall window: the rule and its evidence say which. The time is the benchmark's.
    assert "client(s) waiting for an answer" in line and "stalled" in line, line


def test_a_job_that_talks_to_a_replica_directly_is_named_and_nginx_is_not(world):
    world.proxy = dict(PROXY)
    world.watchdog["bypass_after_s"] = 3
    world.setup()
    world.start_nginx()
    a = world.replicas[0]
    clients(world, "through-nginx", PROXY_URL, 4, "stream", 400)
    clients(world, "batch-job", a.url, 2, "stream", 400)
    line = wait_for(lambda: next(iter(world.guardian_lines("GUARDIAN_HAZARD=bypass:a:batch-job.service")), None), 30,
                    "the bypass to be named")
    assert line["PRIORITY"] == "4" and line["GUARDIAN_RULE"] == "B2" and line["GUARDIAN_UNIT"] == a.unit
    assert "batch-job.service talks to it directly on port 8001" in line["MESSAGE"]
    assert "point it at the proxy" in line["MESSAGE"]
    peers = world.status()["replicas"]["a"]["connections"]["peers"]
    kinds = {p["name"]: p["kind"] for p in peers}
    assert kinds.get("nginx.service") == "proxy" and kinds.get("batch-job.service") == "other", peers
    hazards = [e["MESSAGE"] for e in world.guardian_lines("GUARDIAN_DECISION=hazard")]
    assert not [m for m in hazards if "nginx" in m], hazards
    check = world.box.run(["guardian", "check"], check=False)
    assert "batch-job.service talks to it directly" in check.stdout, check.stdout
    stop_clients(world, "batch-job")
    stop_clients(world, "through-nginx")
    wait_for(lambda: any("no longer talks to it directly" in m for m in
                         (e["MESSAGE"] for e in world.guardian_lines("GUARDIAN_DECISION=hazard"))), 30,
             "the bypass to be said gone")


SLOW_READER = """
import socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
socks = []
for _ in range(n):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # a tiny window: the page comes 1 KiB at a time
    s.connect(("127.0.0.1", port))
    s.sendall(b"GET /metrics HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
    socks.append(s)
got = 0
while True:
    for s in socks:
        got += len(s.recv(128))
    print(got, flush=True)
    time.sleep(0.125)
"""


def test_a_frozen_replica_fed_to_slow_readers_by_its_kernel_is_still_restarted_by_its_window(world):
    """Issue 34 row 2, confirmed on a real vLLM 0.32: a frozen process's kernel keeps sending what
    is in its socket buffers, so 3 slow readers of /metrics (user nobody, a tiny window, 1 KiB/s)
    kept it "busy" for minutes. What counts is what the process wrote since the last look."""
    world.watchdog["unresponsive_after_s"] = 10
    world.watchdog["engine_quiet_s"] = 120  # L22 (its quiet processes) out of reach: L8 and the kernel's view are under test
    world.setup()
    a = world.replicas[0]
    world.box.write("/tmp/slow_reader.py", SLOW_READER)
    world.box.run(["systemd-run", "--unit=slow-readers", "-p", "User=nobody", "-p", "Restart=no",
                   "/usr/bin/python3", "/tmp/slow_reader.py", str(a.port), "3"])
    world.extra_units.append("slow-readers.service")
    # the readers are being fed: their unit's journal counts bytes going up
    wait_for(lambda: any(int(m) > 4096 for m in world.box.messages(unit="slow-readers.service") if m.isdigit()), 60,
             "the slow readers to be fed")
    frozen_at = time.time()
    world.kill(a.unit, "STOP")
    busy = restart_while_watching(world, a, frozen_at, 120)
    (line,) = world.restarts_of(a)
    print(f"frozen with 3 slow readers -> restart decision {decision_after(world, a, frozen_at):.1f} s: {line['MESSAGE']}")
    # the kernel kept feeding the readers after the freeze, and that was not taken for the replica's work
    fed = [int(m) for m in world.box.messages(unit="slow-readers.service", since=frozen_at + 2) if m.isdigit()]
    assert len(set(fed)) > 1, fed[-5:]
    assert line["GUARDIAN_RULE"] == "L8" and "unresponsive" in line["MESSAGE"], line["MESSAGE"]
    # never busy by responses flowing after the freeze: the kernel's sends were not taken for the
    # replica's answers (before, it was busy by them (L11) until the buffers ran dry, and L8's window
    # ran from then). Busy by its progress before the freeze, while L8's window runs, is right.
    flowing = [e["MESSAGE"] for e in world.guardian_lines("GUARDIAN_REPLICA=a", "GUARDIAN_STATE=busy")
               if int(e["__REALTIME_TIMESTAMP"]) / 1e6 > frozen_at and "responses flowing" in e["MESSAGE"]]
    flowing += [m for m in busy if "responses flowing" in m]
    assert not flowing, flowing


SQUATTER = """
import socket, sys, time
port = int(sys.argv[1])
pairs = []
for family, host in ((socket.AF_INET6, "::1"), (socket.AF_INET, "127.0.0.2")):
    listener = socket.socket(family)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # an earlier test's connections in TIME_WAIT
    if family == socket.AF_INET6:
        listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    listener.bind((host, port))
    listener.listen()
    client = socket.create_connection((host, port))
    served, _ = listener.accept()
    pairs.append((listener, client, served))
print("squatting", flush=True)
while True:
    for _listener, client, served in pairs:
        served.sendall(b"x")
        client.recv(16)
    time.sleep(0.3)
"""


def test_another_users_listeners_on_the_replicas_port_neither_keep_it_busy_nor_hold_its_port(world):
    """Issue 34 rows 1 and 3A. The replica serves 127.0.0.1:P; user nobody, in a unit of its own,
    listens on [::1]:P and 127.0.0.2:P and trickles a byte every 0.3 s to its own clients. Counted
    by port, that flow kept the frozen replica busy (L11) for as long as nobody wished, and G7 took
    nobody's 127.0.0.2 listener for the port's holder and refused the restart. Only the listener
    that serves the replica's URL, and the sockets it accepted, are the replica's."""
    world.watchdog["engine_quiet_s"] = 120  # L22 (its quiet processes) out of reach: L8 and the kernel's view are under test
    world.setup()
    a = world.replicas[0]
    world.box.write("/tmp/squat.py", SQUATTER)
    world.box.run(["systemd-run", "--unit=squat", "-p", "User=nobody", "-p", "Restart=no",
                   "/usr/bin/python3", "/tmp/squat.py", str(a.port)])
    world.extra_units.append("squat.service")
    wait_for(lambda: "squatting" in world.box.messages(unit="squat.service")
             or world.box.prop("squat.service", "ActiveState") != "active", 30, "the squatter to listen")
    assert "squatting" in world.box.messages(unit="squat.service"), world.box.messages(unit="squat.service")
    old = world.box.identity(a.unit)
    frozen_at = time.time()
    world.kill(a.unit, "STOP")
    busy = restart_while_watching(world, a, frozen_at, 60)
    (line,) = world.restarts_of(a)
    assert line["GUARDIAN_RULE"] == "L8" and "unresponsive" in line["MESSAGE"], line["MESSAGE"]
    flowing = [e["MESSAGE"] for e in world.guardian_lines("GUARDIAN_REPLICA=a", "GUARDIAN_STATE=busy")
               if int(e["__REALTIME_TIMESTAMP"]) / 1e6 > frozen_at and "responses flowing" in e["MESSAGE"]]
    flowing += [m for m in busy if "responses flowing" in m]
    assert not flowing, flowing
    refused = world.guardian_lines("GUARDIAN_REPLICA=a", "GUARDIAN_DECISION=refused")
    assert not refused, [e["MESSAGE"] for e in refused]
    wait_for(lambda: world.box.identity(a.unit) != old and world.box.prop(a.unit, "ActiveState") == "active", 40,
             "a to be restarted")
    world.wait_states({"a": "healthy"}, timeout_s=40)
    assert world.box.prop("squat.service", "ActiveState") == "active"  # nobody's listeners were left alone


SQUATTERS = SQUATTER.replace("port = int(sys.argv[1])\npairs = []\nfor family, host in",
                             "pairs = []\nfor port, (family, host) in ((int(p), fh) for p in sys.argv[1:] for fh in")
SQUATTERS = SQUATTERS.replace('(socket.AF_INET, "127.0.0.2")):', '(socket.AF_INET, "127.0.0.2"))):', 1)
STOCK_HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.0.1\t{name}\n"


def test_replicas_named_by_localhost_and_by_the_host_name_are_restarted_as_one_named_by_address(world):
    """Issue 41 rows 1 and 2. Stock Debian's /etc/hosts (`::1 localhost`, the box's name on
    loopback); user nobody listens on [::1]:P and 127.0.0.2:P beside each replica's 127.0.0.1:P.
    Before: `localhost` sent the probes to nobody's [::1] listener, and a URL by host name took
    nobody's listener (the first in the dump) for the replica's: port-taken, G7 refused, no
    restart. Now each name is resolved as a client resolves it and the probes, the kernel's view
    and the gates all use the address chosen: each frozen replica is restarted by L8."""
    name = world.box.run(["hostname"]).stdout.strip()
    assert name, "the box has a host name"
    world.replicas = [Replica("a", 8001), Replica("b", 8002, url_host="localhost"), Replica("c", 8003, url_host=name)]
    world.box.write("/etc/hosts", STOCK_HOSTS.format(name=name))
    assert SQUATTERS != SQUATTER and "sys.argv[1:]" in SQUATTERS
    world.box.write("/tmp/squat-names.py", SQUATTERS)
    world.watchdog["engine_quiet_s"] = 120  # L22 (its quiet processes) out of reach: L8 and the kernel's view are under test
    world.setup(start_guardian=False)
    world.box.run(["systemd-run", "--unit=squat-names", "-p", "User=nobody", "-p", "Restart=no",
                   "/usr/bin/python3", "/tmp/squat-names.py", *(str(r.port) for r in world.replicas)])
    world.extra_units.append("squat-names.service")
    wait_for(lambda: "squatting" in world.box.messages(unit="squat-names.service")
             or world.box.prop("squat-names.service", "ActiveState") != "active", 30, "the squatter to listen")
    assert "squatting" in world.box.messages(unit="squat-names.service"), world.box.messages(unit="squat-names.service")
    world.start_guardian()  # all three healthy: each probed at its own replica's address
    check = world.box.run(["guardian", "check"], check=False)
    b_lines = [ln for ln in check.stdout.splitlines() if "replica b " in ln and "different holders" in ln]
    assert b_lines and "squat-names.service" in b_lines[0] and "guardian probes 127.0.0.1" in b_lines[0], check.stdout
    assert not [ln for ln in check.stdout.splitlines() if "different holders" in ln and "replica b " not in ln]
    hazard = wait_for(lambda: next(iter(world.guardian_lines("GUARDIAN_HAZARD=address:b")), None), 30,
                      "the split of localhost to be said")
    assert hazard["PRIORITY"] == "3" and "[::1]:8002 held by squat-names.service" in hazard["MESSAGE"], hazard["MESSAGE"]
    for r in world.replicas:
        old = world.box.identity(r.unit)
        frozen_at = time.time()
        world.kill(r.unit, "STOP")
        wait_for(lambda r=r: decision_after(world, r, frozen_at) is not None, 90, f"{r.name}'s restart")
        print(f"{r.url} frozen -> restart decision {decision_after(world, r, frozen_at):.1f} s")
        (line,) = world.restarts_of(r)
        assert line["GUARDIAN_RULE"] == "L8" and "unresponsive" in line["MESSAGE"], line["MESSAGE"]
        assert not world.guardian_lines(f"GUARDIAN_REPLICA={r.name}", "GUARDIAN_DECISION=refused")
        wait_for(lambda r=r, old=old: world.box.identity(r.unit) != old
                 and world.box.prop(r.unit, "ActiveState") == "active", 40, f"{r.name} to be restarted")
        world.wait_states({r.name: "healthy"}, timeout_s=40)
    assert world.box.prop("squat-names.service", "ActiveState") == "active"
