"""A real 3-member etcd cluster on loopback (Debian's etcd-server), started and stopped by PID.

Each member has its own data directory under a temporary directory and its own client and peer
ports. The fixture can stop a member (or all), kill the leader, and start them again with their
data, as an operator's box would see it.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from systemd_box import wait_for

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


class EtcdCluster:
    def __init__(self, n: int = 3, base_port: int = 24379) -> None:
        if not Path(ETCD).exists():
            raise RuntimeError("etcd is not installed (Debian's etcd-server; scripts/setup.sh installs it)")
        self.dir = Path(tempfile.mkdtemp(prefix="guardian-etcd-"))
        self.names = [f"m{i}" for i in range(n)]
        self.client = {m: f"http://127.0.0.1:{base_port + 2 * i}" for i, m in enumerate(self.names)}
        self.peer = {m: f"http://127.0.0.1:{base_port + 2 * i + 1}" for i, m in enumerate(self.names)}
        self.procs: dict[str, subprocess.Popen] = {}
        self.initial = ",".join(f"{m}={self.peer[m]}" for m in self.names)

    @property
    def endpoints(self) -> list[str]:
        return [self.client[m] for m in self.names]

    def start(self, member: str | None = None) -> None:
        for m in [member] if member else self.names:
            if m in self.procs and self.procs[m].poll() is None:
                continue
            log = open(self.dir / f"{m}.log", "ab")
            self.procs[m] = subprocess.Popen(
                [ETCD, "--name", m, "--data-dir", str(self.dir / m), "--listen-client-urls", self.client[m],
                 "--advertise-client-urls", self.client[m], "--listen-peer-urls", self.peer[m],
                 "--initial-advertise-peer-urls", self.peer[m], "--initial-cluster", self.initial,
                 "--initial-cluster-state", "new", "--initial-cluster-token", "guardian-test",
                 "--heartbeat-interval", "100", "--election-timeout", "1000", "--logger", "zap",
                 "--log-outputs", "stderr"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_for(self.leader, 30, "an etcd leader", interval_s=0.2)

    def status(self, m: str) -> dict | None:
        try:
            req = urllib.request.Request(self.client[m] + "/v3/maintenance/status", data=b"{}", method="POST")
            with urllib.request.urlopen(req, timeout=1) as r:
                return json.loads(r.read())
        except OSError:
            return None

    def leader(self) -> str | None:
        """The member that is leader, as the running members agree."""
        for m in self.names:
            if m in self.procs and self.procs[m].poll() is None:
                st = self.status(m)
                if st and st.get("leader") and st["leader"] == st["header"]["member_id"]:
                    return m
        return None

    def stop(self, member: str, sig: int = signal.SIGTERM) -> None:
        p = self.procs.get(member)
        if p is not None and p.poll() is None:
            p.send_signal(sig)
            p.wait(15)

    def stop_all(self) -> None:
        for m in self.names:
            self.stop(m)

    def close(self) -> None:
        for m in self.names:
            self.stop(m, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)

    def wait_quorum(self, timeout_s: float = 30) -> None:
        wait_for(self.leader, timeout_s, "an etcd leader", interval_s=0.2)
