"""A replica's own processes (observe/procs.py, issue 43): what is read, how the groups are told
apart, and when a group's activity is not known. The files are written as the kernel shows them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from harness import cfg

from guardian.core.observations import Activity
from guardian.observe.procs import ProcObserver, ProcStat, activity, parse_schedstat, parse_stat, read_proc, split, view

TICK = 1.0 / os.sysconf("SC_CLK_TCK")


def stat_line(pid: int, name: str, state: str = "S", ppid: int = 1, utime: int = 0, stime: int = 0, start: int = 500):
    fields = [state, str(ppid)] + ["0"] * 9 + [str(utime), str(stime)] + ["0"] * 6 + [str(start)] + ["0"] * 30
    return f"{pid} ({name}) " + " ".join(fields) + "\n"


def test_a_stat_line_is_read_past_a_name_with_spaces_and_parentheses():
    p = parse_stat(7, stat_line(7, "VLLM::EngineCor) (x", state="T", ppid=3, utime=120, stime=30, start=999))
    assert p == ProcStat(7, "VLLM::EngineCor) (x", "T", 3, 150 * TICK, 999)
    assert p.engine
    assert parse_stat(7, "7 (x) S 1 2") is None  # cut short
    assert parse_stat(7, "garbage") is None
    assert parse_stat(7, stat_line(7, "x").replace(" 0 0 0 0 0 0 500", " 0 0 0 0 0 0 x")) is None


def test_schedstat_gives_the_run_queue_wait():
    assert parse_schedstat("123456789 2500000000 77\n") == 2.5
    assert parse_schedstat("12\n") is None
    assert parse_schedstat("a b c") is None


def p(pid: int, name: str = "python3", cpu_s: float = 0.0, wait_s: float = 0.0, state: str = "S") -> ProcStat:
    return ProcStat(pid, name, state, 1, cpu_s, 100 + pid, wait_s)


def test_activity_is_cpu_plus_run_queue_wait_of_the_same_processes_only():
    before = [p(1, cpu_s=1.0, wait_s=0.5), p(2, cpu_s=2.0)]
    after = [p(1, cpu_s=1.25, wait_s=0.75), p(2, cpu_s=2.0)]
    assert activity(before, after) == Activity(0.5, False, 2)
    assert activity(before, [p(1, cpu_s=1.0), p(2, state="R", cpu_s=2.0)]) == Activity(0.0, True, 2)
    assert activity(before, [p(1, cpu_s=1.0, state="D"), p(2, cpu_s=2.0)]).running  # type: ignore[union-attr]
    assert activity(before, [p(1, cpu_s=1.0)]) is None  # one ended: its CPU since the last look is lost
    assert activity(before, [*after, p(3)]) is None  # one began: it may have run before it was seen
    assert activity(before, [replace(after[0], start_ticks=1), after[1]]) is None  # a pid reused
    assert activity(None, after) is None and activity(before, []) is None


def test_the_engine_is_the_processes_named_so_and_the_api_server_every_other():
    api = p(10, "vllm")
    core, worker, init = p(11, "VLLM::EngineCor"), p(12, "VLLM::Worker_TP"), p(9, "docker-init")
    assert split([init, api, core, worker]) == ([init, api], [core, worker])
    named = view(split([api, core]), split([replace(api, cpu_s=0.5), core]), 10.0, 2.0)
    assert named.engine == Activity(0.0, False, 1) and named.api == Activity(0.5, False, 1) and named.engine_named
    whole = view(split([api]), split([replace(api, cpu_s=0.5)]), 10.0, 2.0)
    assert whole.engine is None and whole.api == Activity(0.5, False, 1) and not whole.engine_named
    first = view(None, split([api, core]), 10.0, None)
    assert first.api is None and first.engine is None and first.since_s is None


def write_proc(root: Path, pid: int, name: str, cpu_ticks: int, wait_ns: int | None = 0, state: str = "S") -> None:
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "stat").write_text(stat_line(pid, name, state=state, utime=cpu_ticks))
    if wait_ns is not None:
        (d / "schedstat").write_text(f"0 {wait_ns} 0\n")


def test_the_observer_reads_the_units_cgroup_and_every_cgroup_below_it(tmp_path):
    cg, proc = tmp_path / "cg", tmp_path / "proc"
    unit = cg / "system.slice" / "vllm-a.service"
    (unit / "worker").mkdir(parents=True)
    (unit / "cgroup.procs").write_text("10\n11\n")
    (unit / "worker" / "cgroup.procs").write_text("12\n")
    write_proc(proc, 10, "vllm", 100)
    write_proc(proc, 11, "VLLM::EngineCor", 300)
    write_proc(proc, 12, "VLLM::Worker_TP", 500, wait_ns=None)  # no schedstats: CPU alone
    ob = ProcObserver(str(cg), str(proc))
    config = cfg(2)  # b has no cgroup: stopped
    first = ob.look_now(config, 50.0, {})
    assert first["b"] is None and first["a"] is not None and first["a"].api is None
    write_proc(proc, 10, "vllm", 100 + 2, wait_ns=10**9)  # its API server waited 1 s for a CPU
    write_proc(proc, 11, "VLLM::EngineCor", 300)
    second = ob.look_now(config, 52.0, {})["a"]
    assert second is not None and second.since_s == 2.0 and second.engine_named
    assert second.api == Activity(pytest.approx(2 * TICK + 1.0), False, 1)
    assert second.engine == Activity(0.0, False, 2)
    (unit / "worker" / "cgroup.procs").write_text("")  # the worker ended
    assert ob.look_now(config, 54.0, {})["a"].engine is None  # type: ignore[union-attr]


def test_a_container_replica_is_read_in_its_scope_and_not_at_all_without_one(tmp_path):
    from guardian.config import Config, ReplicaConfig

    cg, proc = tmp_path / "cg", tmp_path / "proc"
    scope = cg / "system.slice" / "docker-abc.scope"
    scope.mkdir(parents=True)
    (scope / "cgroup.procs").write_text("20\n")
    unit = cg / "system.slice" / "vllm-a.service"
    unit.mkdir(parents=True)
    (unit / "cgroup.procs").write_text("30\n")  # the docker client: its quiet says nothing of the replica
    write_proc(proc, 20, "python3", 5)
    write_proc(proc, 30, "docker", 1)
    r = ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:8001", model="m", container="vllm-a")
    config = Config(replicas=[r])
    ob = ProcObserver(str(cg), str(proc))
    assert ob.look_now(config, 1.0, {"a": None}) == {"a": None}
    ob.look_now(config, 1.0, {"a": "docker-abc.scope"})
    write_proc(proc, 20, "python3", 9)
    got = ob.look_now(config, 3.0, {"a": "docker-abc.scope"})["a"]
    assert got is not None and got.api == Activity(pytest.approx(4 * TICK), False, 1)


def test_real_processes_a_stopped_one_is_quiet_and_a_computing_one_is_not():
    """On this machine's own /proc: a SIGSTOPped child uses nothing; a spinning one uses CPU."""
    spin = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: pass"])
    stopped = subprocess.Popen([sys.executable, "-c", "import time\ntime.sleep(60)"])
    try:
        os.kill(stopped.pid, 19)  # SIGSTOP
        deadline = time.monotonic() + 10
        while (s := read_proc(stopped.pid)) is None or s.state != "T":
            assert time.monotonic() < deadline, "the child never showed as stopped"
            time.sleep(0.01)
        before = [read_proc(spin.pid), read_proc(stopped.pid)]
        deadline = time.monotonic() + 10
        while True:
            after = [read_proc(spin.pid), read_proc(stopped.pid)]
            if after[0].cpu_s - before[0].cpu_s >= 0.05:  # type: ignore[union-attr]
                break
            assert time.monotonic() < deadline, "the spinning child used no CPU"
            time.sleep(0.05)
        assert activity([before[1]], [after[1]]) == Activity(0.0, False, 1)  # type: ignore[list-item]
        assert activity([before[0]], [after[0]]).used_s >= 0.05  # type: ignore[list-item, union-attr]
    finally:
        for c in (spin, stopped):
            c.kill()
            c.wait()


class _NotSupported(Exception):
    pass


class _Driver:
    """What a driver answers through pynvml: device 0 reports power (in mW) and utilization, device 1
    only utilization (as GB10 answers NOT_SUPPORTED for some queries), device 2 neither."""

    def nvmlDeviceGetHandleByIndex(self, i):  # noqa: N802 - pynvml's names
        return i

    def nvmlDeviceGetPowerUsage(self, h):  # noqa: N802
        if h != 0:
            raise _NotSupported()
        return 21400

    def nvmlDeviceGetUtilizationRates(self, h):  # noqa: N802
        if h == 2:
            raise _NotSupported()
        return type("Util", (), {"gpu": 96 if h == 0 else 3})()


def test_nvml_life_reads_power_and_utilization_and_leaves_out_what_is_not_reported():
    from guardian.core.observations import GpuLife
    from guardian.observe.nvml import Nvml

    n = Nvml.__new__(Nvml)
    n.available, n.count, n._n = True, 3, _Driver()
    assert n.life() == (GpuLife(0, 21.4, 96.0), GpuLife(1, None, 3.0))
    n.available = False
    assert n.life() == ()


def test_an_engine_named_by_its_title_alone_is_the_engine(tmp_path):
    """setproctitle rewrites the command line; comm may still say python3 (vLLM's VLLM::EngineCore)."""
    cg, proc = tmp_path / "cg", tmp_path / "proc"
    unit = cg / "system.slice" / "vllm-a.service"
    unit.mkdir(parents=True)
    (unit / "cgroup.procs").write_text("10\n11\n")
    write_proc(proc, 10, "python3", 100)
    write_proc(proc, 11, "python3", 300)
    (proc / "10" / "cmdline").write_text("/usr/bin/python3\0-m\0vllm.entrypoints.openai.api_server\0")
    (proc / "11" / "cmdline").write_text("VLLM::EngineCore\0\0\0")
    ob = ProcObserver(str(cg), str(proc))
    ob.look_now(cfg(1), 1.0, {})
    got = ob.look_now(cfg(1), 3.0, {})["a"]
    assert got is not None and got.engine_named and got.engine == Activity(0.0, False, 1)
    (proc / "11" / "cmdline").write_text("python3\0")  # read once in the process's life: not again
    assert ob.look_now(cfg(1), 5.0, {})["a"].engine_named  # type: ignore[union-attr]
