"""The kernel's view with another user's sockets on the replicas' ports (issue 41 item 3): CPU per
look of guardian's ConnObserver for 2 replicas (127.0.0.1:P, 20 client connections each) while
other processes hold FLOOD connections (2 x FLOOD sockets) to listeners of their own on
127.0.0.2-4 at the same ports, as user nobody did with 54,000 sockets.

Standalone, so that one tree can be measured against another: the guardian it imports is the one
on sys.path (PYTHONPATH=TREE python bench/conns_flood.py). Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import time
from typing import Any

HOLDER = """
import resource, socket, sys
host, ports, n = sys.argv[1], [int(p) for p in sys.argv[2].split(",")], int(sys.argv[3])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
keep = []
for port in ports:
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port)); srv.listen(4096); keep.append(srv)
    for _ in range(n // len(ports)):
        keep.append(socket.create_connection((host, port))); keep.append(srv.accept()[0])
print("ready", flush=True)
sys.stdin.read()
"""


def _hold(host: str, ports: list[int], n: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, host, ",".join(map(str, ports)), str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", f"holder on {host} failed"
    return proc


def per_look(cfg: Any, looks: int) -> tuple[float, float, dict[str, Any]]:
    """CPU and wall ms per look of a fresh ConnObserver over CFG's replicas (one look first, so
    that nothing is counted from before), and the last look's views: bench/run.py's `conns` too."""
    from guardian.observe.conns import ConnObserver

    observer = ConnObserver()
    observer.look_now(cfg, time.monotonic())
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.monotonic()
    views: dict[str, Any] = {}
    for _ in range(looks):
        views = observer.look_now(cfg, time.monotonic())
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu_ms = 1000 * ((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)) / looks
    return cpu_ms, 1000 * (time.monotonic() - t0) / looks, views


def main(flood: int = 27_000, per_replica: int = 20, looks: int = 30) -> dict[str, object]:
    from guardian.config import Config, ReplicaConfig

    replicas = []
    for _ in range(2):
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(per_replica + 16)
        replicas.append(srv)
    ports = [s.getsockname()[1] for s in replicas]
    clients = [socket.create_connection(("127.0.0.1", p)) for p in ports for _ in range(per_replica)]
    accepted = [s.accept()[0] for s in replicas for _ in range(per_replica)]
    hosts = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
    held = [_hold(h, ports, flood // len(hosts)) for h in hosts]
    try:
        cfg = Config(
            replicas=[
                ReplicaConfig(name=f"r{i}", unit=f"r{i}.service", url=f"http://127.0.0.1:{p}", model="m")
                for i, p in enumerate(ports)
            ]
        )
        cpu_ms, wall_ms, views = per_look(cfg, looks)
        return {
            "flood_sockets": 2 * (flood // len(hosts)) * len(hosts),
            "cpu_ms_per_look": round(cpu_ms, 2),
            "wall_ms_per_look": round(wall_ms, 2),
            "connections_seen": sum(v.connections for v in views.values() if v is not None),
            "truncated": any(v.truncated for v in views.values() if v is not None),
            "connections": 2 * per_replica,
        }
    finally:
        for proc in held:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(60)
        for s in [*clients, *accepted, *replicas]:
            s.close()


if __name__ == "__main__":
    print(json.dumps({"tree": os.environ.get("PYTHONPATH", "."), **main()}))
