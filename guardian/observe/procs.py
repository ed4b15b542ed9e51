"""What a replica's own processes do (issue 43): ProcView, look after look.

A frozen or dead engine uses no CPU, while a working one always does: a GPU engine's scheduler
loop spins while its kernels run, a CPU engine computes. A starved process is not quiet either: it
waits on a run queue. So each look reads, for every process in the replica's cgroup (the unit's,
or its container's scope; every cgroup below it too: podman's payload, a worker's scope):

- /proc/PID/stat: its name, state, parent and CPU time (utime + stime of the whole process, in
  clock ticks), and its start time (a pid reused by a new process is another process);
- /proc/PID/schedstat: its main thread's time waiting on a run queue (absent on a kernel without
  schedstats: CPU alone then);
- /proc/PID/cmdline, once in a process's life: its title (setproctitle's).

Both are world-readable: guardian needs no capability for them.

The processes fall in two groups. The engine's are those named so (ENGINE_NAMES and ENGINE_TITLES: vLLM's
``VLLM::EngineCore`` and ``VLLM::Worker*`` set their names; SGLang's scheduler too); the API server
is every other process (a container's init, conmon, a shell wrapper: they add to it, so it is the
later to look quiet, the safe side). Where no process is named, the engine is not told apart from
the API server: the view's ``engine`` is None and its ``api`` is the whole replica; but for an engine
that computes in the server's own process (llama-server, trtllm-serve on one GPU: engines/), the
whole replica is its engine too (``engine_whole``): quiet all through, nothing works on a request.

A group's Activity between two looks is unknown (None) when its set of processes changed: the
CPU of one that ended since is lost, and one that began may have run before it was seen.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from ..config import Config, ReplicaConfig
from ..core.observations import Activity, ProcView
from ..engines.base import Engine
from .sockets import cgroup_mounts

# Process names (comm, at most 15 characters) that say a process is the engine's, by prefix.
ENGINE_NAMES = ("VLLM::EngineCor", "VLLM::Worker", "VLLM::EngineCore", "sglang::schedul")
# The same by command line: vLLM and SGLang name their processes with setproctitle, which rewrites
# /proc/PID/cmdline whether or not it also sets comm.
ENGINE_TITLES = ("VLLM::EngineCore", "VLLM::Worker", "sglang::scheduler")
_MAX_DIRS = 64  # cgroups below a replica's that are read (a unit has a handful)
_MAX_PROCS = 512  # processes of one replica that are read
_SLICES = ("system.slice", "machine.slice")  # where a unit or a container's scope is
_BUSY_STATES = frozenset("RD")  # running or runnable; uninterruptible wait (I/O, a fault): not frozen
_TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


@dataclass(frozen=True)
class ProcStat:
    """One process at one look."""

    pid: int
    name: str
    state: str
    ppid: int
    cpu_s: float
    start_ticks: int  # its start, in clock ticks since boot: with the pid, who it is
    run_delay_s: float = 0.0
    title: str = ""  # its command line's first word: setproctitle's title where comm is not set

    @property
    def key(self) -> tuple[int, int]:
        return self.pid, self.start_ticks

    @property
    def engine(self) -> bool:
        return self.name.startswith(ENGINE_NAMES) or self.title.startswith(ENGINE_TITLES)


def parse_stat(pid: int, text: str) -> ProcStat | None:
    """/proc/PID/stat's TEXT as a ProcStat; None when it is not one (a name may hold spaces and
    parentheses: the fields start after the last ')')."""
    open_at, close_at = text.find("("), text.rfind(")")
    if open_at < 0 or close_at < open_at:
        return None
    rest = text[close_at + 1 :].split()
    if len(rest) < 20:
        return None
    try:
        cpu_ticks = int(rest[11]) + int(rest[12])
        return ProcStat(pid, text[open_at + 1 : close_at], rest[0], int(rest[1]), cpu_ticks * _TICK_S, int(rest[19]))
    except ValueError:
        return None


def parse_schedstat(text: str) -> float | None:
    """Seconds waited on a run queue from /proc/PID/schedstat's TEXT ("run_ns wait_ns slices")."""
    parts = text.split()
    try:
        return int(parts[1]) / 1e9 if len(parts) >= 2 else None
    except ValueError:
        return None


def activity(before: Iterable[ProcStat] | None, after: Iterable[ProcStat]) -> Activity | None:
    """What the group did from BEFORE to AFTER (the same group at two looks); None when it is not
    the same set of processes, or it is empty."""
    now = {p.key: p for p in after}
    if before is None or not now:
        return None
    then = {p.key: p for p in before}
    if then.keys() != now.keys():
        return None
    used_s = sum(max(0.0, (p.cpu_s + p.run_delay_s) - (then[k].cpu_s + then[k].run_delay_s)) for k, p in now.items())
    return Activity(used_s, any(p.state in _BUSY_STATES for p in now.values()), len(now))


def split(procs: list[ProcStat]) -> tuple[list[ProcStat], list[ProcStat]]:
    """(the API server's processes, the engine's): by name; the engine's is empty where none is named."""
    api = [p for p in procs if not p.engine]
    engine = [p for p in procs if p.engine]
    return api, engine


def view(
    before: tuple[list[ProcStat], list[ProcStat]] | None,
    after: tuple[list[ProcStat], list[ProcStat]],
    at: float,
    since_s: float | None,
    single_process: bool = False,
) -> ProcView:
    """The ProcView of one replica from its groups at the previous look (BEFORE) and now (AFTER).
    SINGLE_PROCESS: its engine computes in the server's own process (llama-server, trtllm-serve:
    engines/), so where none is named the whole replica is its engine as well as its API server."""
    api_then, engine_then = before if before is not None else (None, None)
    api_now, engine_now = after
    named = bool(engine_now)
    api = activity(api_then, api_now)
    whole = single_process and not named
    engine = activity(engine_then, engine_now) if named else (api if whole else None)
    return ProcView(at, since_s, api, engine, named, whole)


# --- reading ------------------------------------------------------------------------------------


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read(4096)
    except OSError:
        return None


def pids_of(cgroup_dir: str) -> list[int] | None:
    """The processes of CGROUP_DIR and every cgroup below it (bounded); None: it cannot be read."""
    pids: list[int] = []
    dirs, seen = [cgroup_dir], 0
    while dirs and seen < _MAX_DIRS:
        d = dirs.pop()
        seen += 1
        text = _read(f"{d}/cgroup.procs")
        if text is None:
            if d == cgroup_dir:
                return None
            continue
        pids.extend(int(x) for x in text.split() if x.isdigit())
        try:
            with os.scandir(d) as it:
                dirs.extend(e.path for e in it if e.is_dir(follow_symlinks=False))
        except OSError:
            continue
    return pids[:_MAX_PROCS]


def read_proc(pid: int, proc: str = "/proc") -> ProcStat | None:
    text = _read(f"{proc}/{pid}/stat")
    stat = parse_stat(pid, text) if text is not None else None
    if stat is None:
        return None
    sched = _read(f"{proc}/{pid}/schedstat")
    delay_s = parse_schedstat(sched) if sched is not None else None
    return stat if delay_s is None else replace(stat, run_delay_s=delay_s)


class ProcObserver:
    """Each replica's ProcView, look after look (the daemon's tick, in a thread beside the probes)."""

    def __init__(self, cgroup_root: str | None = None, proc: str = "/proc") -> None:
        self._root = cgroup_root
        self._proc = proc
        self._last: dict[str, tuple[tuple[list[ProcStat], list[ProcStat]], float]] = {}
        self._paths: dict[str, str] = {}
        self._titles: dict[tuple[int, int], str] = {}  # a process's title, read once in its life

    def _cgroup_dir(self, r: ReplicaConfig, scope: str | None) -> str | None:
        """The cgroup directory (v2) of R's processes: its unit's, or for a container its scope's
        (SCOPE; podman's --cgroups=split payload below the unit); None where it is not known: a
        container's unit holds only its engine's client (docker, conmon), whose quiet would prove
        nothing."""
        if self._root is None:
            self._root = cgroup_mounts().unified or ""
        if not self._root:
            return None
        if r.container is None:
            candidates = [f"{self._root}/{s}/{r.unit}" for s in _SLICES]
        elif scope is not None:
            payload = scope.removeprefix("libpod-").removesuffix(".scope")
            candidates = [f"{self._root}/{s}/{scope}" for s in _SLICES]
            candidates.append(f"{self._root}/system.slice/{r.unit}/libpod-payload-{payload}")
        else:
            return None
        key = f"{r.unit} {scope}"
        for path in (self._paths.get(key), *candidates):
            if path is not None and os.path.isdir(path):
                self._paths[key] = path
                return path
        return None

    def look_now(
        self,
        cfg: Config,
        mono_now: float,
        scopes: Mapping[str, str | None],
        kinds: Mapping[str, Engine] | None = None,
    ) -> dict[str, ProcView | None]:
        """Each replica's view at MONO_NOW, by name; None for one whose processes cannot be read (a
        stopped unit has no cgroup). SCOPES: a container replica's scope unit, where known. KINDS:
        each replica's engine (engines/), where it is a single process."""
        out: dict[str, ProcView | None] = {}
        for r in cfg.replicas:
            where = self._cgroup_dir(r, scopes.get(r.name))
            pids = pids_of(where) if where is not None else None
            if not pids:
                self._last.pop(r.name, None)
                out[r.name] = None
                continue
            groups = split([self._titled(p) for p in (read_proc(pid, self._proc) for pid in pids) if p is not None])
            last = self._last.get(r.name)
            since_s = mono_now - last[1] if last is not None else None
            single = kinds is not None and r.name in kinds and kinds[r.name].single_process
            out[r.name] = view(last[0] if last is not None else None, groups, mono_now, since_s, single)
            self._last[r.name] = (groups, mono_now)
        for gone in self._last.keys() - {r.name for r in cfg.replicas}:
            del self._last[gone]
        seen = {p.key for groups, _ in self._last.values() for group in groups for p in group}
        self._titles = {k: v for k, v in self._titles.items() if k in seen}
        return out

    def _titled(self, p: ProcStat) -> ProcStat:
        title = self._titles.get(p.key)
        if title is None:
            text = _read(f"{self._proc}/{p.pid}/cmdline")
            title = text.split("\0", 1)[0].strip() if text else ""
            self._titles[p.key] = title
        return replace(p, title=title) if title else p
