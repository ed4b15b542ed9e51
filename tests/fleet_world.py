"""A fleet inside the test container: a real 3-member etcd cluster (Debian's etcd-server, one unit per
member) and N "boxes", each a guardian of its own (its own unit, config, state and runtime
directories, started from the installed package's /usr/bin/guardian as user guardian) watching its
own simulated replica. Eight boxes fit on two cores: one replica each, a 1 s tick."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from systemd_box import SystemdBox, wait_for

ETCD_UNIT = """[Unit]
Description=etcd member {m} (fleet test)
[Service]
ExecStart=/usr/bin/etcd --name {m} --data-dir /var/lib/etcd-fleet/{m} --listen-client-urls {client} \
 --advertise-client-urls {client} --listen-peer-urls {peer} --initial-advertise-peer-urls {peer} \
 --initial-cluster {initial} --initial-cluster-state new --initial-cluster-token guardian-fleet \
 --heartbeat-interval 100 --election-timeout 1000
Restart=no
"""

BOX_UNIT = """[Unit]
Description=guardian of fleet box {box}
[Service]
Type=notify
NotifyAccess=main
ExecStart=/usr/bin/guardian --config /etc/guardian/{box}.toml run
User=guardian
Group=guardian
SupplementaryGroups=systemd-journal
StateDirectory=guardian-{box}
RuntimeDirectory=guardian-{box}
WatchdogSec=30s
Restart={restart}
RestartSec=1s
{extra}
"""

REPLICA_UNIT = """[Unit]
Description=simulated replica of box {box}
[Service]
Environment=GPU_MEMORY_UTILIZATION=0.78
EnvironmentFile=-/var/lib/guardian-{box}/replicas/a.env
ExecStart=/usr/local/bin/vllm-sim serve --model {model} --port {port} --gpu-memory-utilization ${{GPU_MEMORY_UTILIZATION}} --load-time-s {load_time_s}
Restart=always
RestartSec=1s
"""

GiB = 2**30


@dataclass
class FleetWorld:
    box: SystemdBox
    n: int = 8
    members: tuple[str, ...] = ("m0", "m1", "m2")
    models: int = 2
    ttl_s: int = 4
    load_time_s: dict[int, float] = field(default_factory=dict)
    model_paths: dict[int, str] = field(default_factory=dict)  # box -> the directory its replica loads
    faketime: dict[int, str] = field(default_factory=dict)  # box index -> libfaketime offset ("+3600")
    no_restart: set[int] = field(default_factory=set)  # boxes whose guardian systemd does not restart
    unsqueezed: set[int] = field(default_factory=set)  # boxes whose memory guard is off
    min_serving: int = 1
    since: float = 0.0

    @property
    def endpoints(self) -> list[str]:
        return [f"http://127.0.0.1:{23790 + 2 * i}" for i in range(len(self.members))]

    def names(self) -> list[str]:
        return [f"box{i}" for i in range(self.n)]

    def unit(self, i: int) -> str:
        return f"guardian-box{i}.service"

    def replica_unit(self, i: int) -> str:
        return f"sim-box{i}.service"

    # --- etcd --------------------------------------------------------------------------------
    def start_etcd(self) -> None:
        peers = {m: f"http://127.0.0.1:{23791 + 2 * i}" for i, m in enumerate(self.members)}
        initial = ",".join(f"{m}={p}" for m, p in peers.items())
        for i, m in enumerate(self.members):
            self.box.write(f"/etc/systemd/system/etcd-{m}.service",
                           ETCD_UNIT.format(m=m, client=self.endpoints[i], peer=peers[m], initial=initial))
        self.box.run("rm -rf /var/lib/etcd-fleet")
        self.box.daemon_reload()
        self.box.systemctl("start", *[f"etcd-{m}.service" for m in self.members])
        wait_for(self.leader, 30, "an etcd leader in the container")

    def member_status(self, i: int) -> dict | None:
        code, body = self.box.http(self.endpoints[i] + "/v3/maintenance/status", "POST", {}, timeout_s=2)
        try:
            return json.loads(body) if code == 200 else None
        except ValueError:
            return None

    def leader(self) -> str | None:
        for i, m in enumerate(self.members):
            st = self.member_status(i)
            if st and st.get("leader") and st["leader"] == st["header"]["member_id"]:
                return m
        return None

    # --- boxes -------------------------------------------------------------------------------
    def config(self, i: int) -> str:
        return f"""interval_s = 1
state_dir = "/var/lib/guardian-box{i}"
runtime_dir = "/run/guardian-box{i}"
[watchdog]
unresponsive_after_s = 4
restart_budget = 5
backoff_s = 0
[memory]
enabled = true
min_headroom_bytes = {2**44}
critical_headroom_bytes = 0
sustain_s = 2
cooldown_s = 3600
step = 0.04
floor = 0.5
reserve_bytes = 0
device_total_bytes = {4 * GiB}
[fleet]
endpoints = {json.dumps(self.endpoints)}
name = "test"
box = "box{i}"
max_planned_restarts = 1
min_serving = {self.min_serving}
lease_ttl_s = {self.ttl_s}
timeout_s = 1.0
[[replicas]]
name = "a"
unit = "{self.replica_unit(i)}"
url = "http://127.0.0.1:{8100 + i}"
model = "m{i % self.models}"
startup_grace_s = 60
health_timeout_s = 1.0
metrics_timeout_s = 1.0
canary_timeout_s = 2.0
"""

    def setup(self, memory_squeezed: bool = True) -> None:
        import time

        self.since = time.time()
        self.start_etcd()
        lib = next(p for p in self.box.run(["dpkg", "-L", "libfaketime"]).stdout.split() if p.endswith("/libfaketimeMT.so.1"))
        for i in range(self.n):
            self.box.write(f"/etc/systemd/system/{self.replica_unit(i)}", REPLICA_UNIT.format(
                box=f"box{i}", port=8100 + i, load_time_s=self.load_time_s.get(i, 0.3),
                model=f"m{i % self.models}" if i not in self.model_paths
                else f"{self.model_paths[i]} --served-model-name m{i % self.models}"))
            cfg = self.config(i)
            if not memory_squeezed or i in self.unsqueezed:
                cfg = cfg.replace("enabled = true", "enabled = false")
            self.box.write(f"/etc/guardian/box{i}.toml", cfg)
            extra = ""
            if i in self.faketime:
                extra = (f"Environment=LD_PRELOAD={lib}\nEnvironment=FAKETIME={self.faketime[i]}\n"
                         "Environment=FAKETIME_DONT_FAKE_MONOTONIC=1\n")
            self.box.write(f"/etc/systemd/system/{self.unit(i)}", BOX_UNIT.format(
                box=f"box{i}", restart="no" if i in self.no_restart else "on-failure", extra=extra))
        units = json.dumps([self.replica_unit(i) for i in range(self.n)])
        self.box.write("/etc/polkit-1/rules.d/60-fleet-test.rules", (
            "polkit.addRule(function(action, subject) {\n"
            f"    var units = {units};\n"
            '    if (action.id == "org.freedesktop.systemd1.manage-units" && subject.user == "guardian" &&\n'
            '        units.indexOf(action.lookup("unit")) >= 0) { return polkit.Result.YES; }\n'
            "});\n"))
        self.box.daemon_reload()
        self.box.systemctl("start", *[self.replica_unit(i) for i in range(self.n)])
        for i in range(self.n):
            wait_for(lambda i=i: self.box.http(f"http://127.0.0.1:{8100 + i}/health", timeout_s=2)[0] == 200, 30,
                     f"box{i}'s replica")

    def start_guardians(self, which: list[int] | None = None) -> None:
        self.box.systemctl("start", *[self.unit(i) for i in (which if which is not None else range(self.n))])

    def teardown(self) -> None:
        b = self.box
        # One at a time, each in its own call: stopped together, the guardians wait out their last
        # release and the etcd members their peers (7 s per test, measured); apart, 0.5 s in all.
        b.systemctl("stop", *[self.unit(i) for i in range(self.n)], check=False)
        b.systemctl("stop", *[self.replica_unit(i) for i in range(self.n)], check=False)
        for m in self.members:
            b.systemctl("stop", f"etcd-{m}.service", check=False)
        b.run("rm -f /etc/systemd/system/guardian-box*.service /etc/systemd/system/sim-box*.service "
              "/etc/systemd/system/etcd-m*.service /etc/guardian/box*.toml /etc/polkit-1/rules.d/60-fleet-test.rules; "
              "rm -rf /var/lib/etcd-fleet /var/lib/guardian-box* /run/guardian-box*", check=False)
        b.daemon_reload()
        b.systemctl("reset-failed", check=False)

    # --- looking -----------------------------------------------------------------------------
    def lines(self, i: int, *match: str) -> list[dict]:
        return self.box.journal(f"_SYSTEMD_UNIT={self.unit(i)}", *match, since=self.since)

    def slot_intervals(self) -> list[tuple[str, float, float]]:
        """(box, taken, given back or still held = inf) from every guardian's journal."""
        out = []
        for i in range(self.n):
            taken = None
            for e in self.lines(i, "GUARDIAN_DECISION=fleet"):
                t = int(e["__REALTIME_TIMESTAMP"]) / 1e6
                if "fleet slot" in e["MESSAGE"] and "taken" in e["MESSAGE"]:
                    taken = t
                elif "fleet slot given back" in e["MESSAGE"] and taken is not None:
                    out.append((f"box{i}", taken, t))
                    taken = None
            if taken is not None:
                out.append((f"box{i}", taken, float("inf")))
        return out

    def lowered(self, i: int) -> bool:
        return any("serving again with gpu_memory_utilization 0.74" in e["MESSAGE"]
                   for e in self.lines(i, "GUARDIAN_REPLICA=a"))


def max_overlap(intervals: list[tuple[str, float, float]]) -> int:
    events = sorted([(t0, 1) for _, t0, _ in intervals] + [(t1, -1) for _, _, t1 in intervals], key=lambda e: (e[0], e[1]))
    n = best = 0
    for _, d in events:
        n += d
        best = max(best, n)
    return best
