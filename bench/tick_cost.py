"""guardian's CPU per tick at 2 idle replicas, in-process: no container, no systemd, minutes not an hour.

    sudo .venv/bin/python bench/tick_cost.py                      # this tree, 60 s after 15 s
    sudo .venv/bin/python bench/tick_cost.py --tree /tmp/old      # another tree (git archive REV | tar -x -C /tmp/old)
    sudo .venv/bin/python bench/tick_cost.py --cprofile out.prof  # and a cProfile of the loop's thread
    sudo .venv/bin/python bench/tick_cost.py --parts              # and the CPU of the tick's synchronous parts

The daemon (guardian.daemon.Daemon: its startup and main loop, every tick as in production) runs in
this process against two replica simulators serving vLLM 0.32's real /metrics page (51 KB),
idle, at 127.0.0.1. systemd is bench/fake_systemd.py on a private dbus-daemon: guardian's side of
the bus is the real one (dbus-fast, the same calls), systemd's side is not measured. As root, each
simulator runs in a cgroup of its unit's name (cgroup v2, and cpuacct on a hybrid host), so that
the kernel's view and the unit's CPU are read as on a box; the runtime directory is on /dev/shm (a
tmpfs, as /run is); NOTIFY_SOCKET is read by a process of its own (systemd's end). The journal is
kept in memory (journald's socket is not this process's CPU).

What it does not have: journald, systemd's own replies (bigger than the fake's), a box's cgroup
tree and socket table (the kernel's walk of its established hash is by its size, not its use: 262,144
buckets on a 24 GiB box, 524,288 from 48 GiB). bench/run.py's `cost` part measures the package under
a real systemd.

Prints the ticks, CPU per tick (the process, and the loop's thread) and % of a core.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUS_CONF = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/><allow own="*"/><allow send_destination="*"/><allow receive_sender="*"/>
  </policy>
</busconfig>
"""
NOTIFY_READER = "import socket,sys\ns=socket.socket(socket.AF_UNIX,socket.SOCK_DGRAM)\ns.bind(sys.argv[1])\nwhile 1: s.recv(65536)"
REPLICAS = (("a", 18001), ("b", 18002))


def in_unit_cgroup(pid: int, unit: str) -> None:
    """PID into system.slice/UNIT of the cgroup v2 tree (and cpuacct's, on a hybrid host): as root only."""
    for root in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup/cpuacct", "/sys/fs/cgroup"):
        if os.path.ismount(root) and os.access(root, os.W_OK):
            d = Path(root) / "system.slice" / unit
            try:
                d.mkdir(parents=True, exist_ok=True)
                (d / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass
            if root == "/sys/fs/cgroup":
                return


class Parts:
    """CPU (thread time) of named synchronous functions, per tick; nested calls counted once."""

    def __init__(self) -> None:
        self.cpu: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.local = threading.local()

    def wrap(self, owner: object, attr: str, label: str) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*a, **k):  # noqa: ANN002, ANN003, ANN202
            depth = getattr(self.local, "depth", 0)
            self.local.depth = depth + 1
            start = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                self.local.depth = depth
                if depth == 0:
                    self.cpu[label] += time.thread_time() - start
                self.calls[label] += 1

        setattr(owner, attr, timed)

    def install(self) -> None:
        from guardian import daemon
        from guardian.core import tick
        from guardian.export import metrics
        from guardian.observe import conns, probes

        self.wrap(probes, "parse_vllm_page", "/metrics pages parsed")
        self.wrap(conns.ConnObserver, "look_now", "the kernel's view (its thread)")
        self.wrap(tick, "decide", "tick.decide")
        self.wrap(metrics.Metrics, "gauges", "the gauges")
        self.wrap(daemon.Daemon, "write_status", "status.json")
        self.wrap(daemon, "sample_memory", "/proc/meminfo")
        self.wrap(daemon.Daemon, "status_line", "the watchdog's status line")

    def report(self, ticks: int) -> None:
        for label, cpu in self.cpu.most_common():
            print(f"  {1000 * cpu / ticks:6.2f} ms/tick  {label} ({self.calls[label] / ticks:.1f} a tick)")


async def measure(config: Path, warmup_s: float, window_s: float, profile: str | None, parts: Parts | None) -> dict:
    from guardian.act.journal import Journal
    from guardian.config import load_config
    from guardian.daemon import Daemon

    class Kept(Journal):
        def __init__(self) -> None:
            super().__init__(socket_path="/nonexistent")
            self.lines: list[str] = []

        def _send(self, priority, message, fields) -> None:  # noqa: ANN001
            self.lines.append(message)

    journal = Kept()
    d = Daemon(load_config(config), config, journal=journal)
    await d.startup()
    loop = asyncio.ensure_future(d.main_loop())
    await asyncio.sleep(warmup_s)
    if parts is not None:
        parts.cpu.clear()
        parts.calls.clear()
    prof = cProfile.Profile() if profile else None
    t0, c0, m0, n0, j0 = time.monotonic(), time.process_time(), time.thread_time(), d.stats.ticks, len(journal.lines)
    if prof is not None:
        prof.enable()
    await asyncio.sleep(window_s)
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)
    m1 = time.thread_time()
    t1, c1, n1 = time.monotonic(), time.process_time(), d.stats.ticks
    ticks = max(1, n1 - n0)
    states = {n: str(t.state) for n, t in d.state.tracks.items()}
    d.stop_requested.set()
    d.wake.set()
    await loop
    await d.shutdown()
    return {
        "ticks": n1 - n0,
        "seconds": round(t1 - t0, 1),
        "cpu_ms_per_tick": round(1000 * (c1 - c0) / ticks, 2),
        "loop_thread_ms_per_tick": round(1000 * (m1 - m0) / ticks, 2),
        "cpu_pct": round(100 * (c1 - c0) / (t1 - t0), 3),
        "states": states,
        "journal_lines": len(journal.lines) - j0,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", default=str(REPO), help="the guardian tree to import (default: this one)")
    p.add_argument("--warmup", type=float, default=15.0)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--cprofile", default=None, help="write a cProfile of the loop's thread over the window here")
    p.add_argument("--parts", action="store_true", help="also the CPU of the tick's synchronous parts")
    args = p.parse_args()
    sys.path.insert(0, args.tree)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the children are stopped on the way out
    work = Path(tempfile.mkdtemp(prefix="guardian-tick-cost-"))
    run_dir = Path(tempfile.mkdtemp(prefix="guardian-tick-cost-run-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    procs: list[subprocess.Popen] = []
    try:
        bus = work / "bus.sock"
        (work / "bus.conf").write_text(BUS_CONF.format(socket=bus))
        procs.append(subprocess.Popen(["dbus-daemon", "--config-file", str(work / "bus.conf"), "--nofork", "--nopidfile"],
                                      stderr=subprocess.DEVNULL))
        units = {}
        for name, port in REPLICAS:
            sim = subprocess.Popen([sys.executable, "-m", "vllm_sim", "--port", str(port), "--model", "m",
                                    "--load-time-s", "0"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(sim)
            units[f"vllm-{name}.service"] = sim.pid
            if os.geteuid() == 0:
                in_unit_cgroup(sim.pid, f"vllm-{name}.service")
        while not bus.exists():
            time.sleep(0.05)
        address = f"unix:path={bus}"
        fake = subprocess.Popen([sys.executable, str(REPO / "bench" / "fake_systemd.py"), address, json.dumps(units)],
                                stdout=subprocess.PIPE, text=True)
        procs.append(fake)
        assert fake.stdout is not None and fake.stdout.readline().strip() == "ready"
        notify = work / "notify.sock"
        procs.append(subprocess.Popen([sys.executable, "-c", NOTIFY_READER, str(notify)]))
        while not notify.exists():
            time.sleep(0.05)
        os.environ.update(GUARDIAN_DBUS_ADDRESS=address, NOTIFY_SOCKET=str(notify))
        config = work / "guardian.toml"
        config.write_text(f'state_dir = "{work / "state"}"\nruntime_dir = "{run_dir}"\n' + "".join(
            f'[[replicas]]\nname = "{n}"\nunit = "vllm-{n}.service"\nurl = "http://127.0.0.1:{port}"\nmodel = "m"\n'
            for n, port in REPLICAS))
        time.sleep(1.5)  # the simulators serving
        parts = Parts() if args.parts else None
        if parts is not None:
            parts.install()
        result = asyncio.run(measure(config, args.warmup, args.seconds, args.cprofile, parts))
        print(json.dumps({"tree": args.tree, **result}))
        if parts is not None:
            parts.report(max(1, result["ticks"]))
        return 0
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
