"""The memory guard's observer: turns /proc, NVML, env files, unit journals and peer replicas
into one frozen MemoryObservation per tick. Reads only; the core decides."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from ..config import Config, ReplicaConfig
from ..core.container import engine_words
from ..core.memory.memstate import Pending
from ..core.memory.startguard import may_be_loading
from ..core.memory.wiring import cmdline_fraction, env_value, parse_fraction
from ..core.observations import (
    EnvFile,
    MemoryObservation,
    ReplicaMemoryObservation,
    ReplicaObservation,
    UnitWiring,
    gib,
)
from ..engines import DEFAULT
from ..engines.base import Engine
from ..engines.resolve import told
from . import modelfiles, probes, unitlog
from .clock import Now
from .meminfo import sample_memory
from .nvml import Nvml
from .readback import Refused, read_back
from .sockets import cgroup_of_pid, unit_of_cgroup
from .systemd import ServiceDetails, Systemd, SystemdError

# An environment file is a few lines; one larger than this is not one (and is not read).
ENV_FILE_MAX_BYTES = 64 * 2**10
# The largest consumers are looked for again at most this often: every process and every active
# unit's MemoryCurrent is too much for each tick of a start (the start guard's ticks come every 0.5 s).
CONSUMERS_MAX_AGE_S = 2.0
# The peers' answers (memory.peer_urls) are asked again at most this often: below the squeeze line
# they are wanted on every tick, and a dead peer costs a tick up to memory.peer_timeout_s (2 s) while
# the start guard's ticks come every 0.5 s. 10 s: a tick waits on them at most once in 10 s, and the
# rules that read them (M14, M23) act on a squeeze of sustain_s (30 s) or a clear spell of minutes.
PEERS_MAX_AGE_S = 10.0


def env_path(cfg: Config, replica: str) -> Path:
    """guardian's env file for a replica: the one file the memory guard writes."""
    return cfg.env_dir / f"{replica}.env"


def read_env_fraction(path: Path) -> float | None:
    """GPU_MEMORY_UTILIZATION from guardian's env file; None if absent, unreadable, not a regular
    file (a link is not followed: guardian writes it, atomically) or not a fraction. Read on the
    event loop: read_back never blocks on a FIFO."""
    try:
        return parse_fraction(env_value(read_back(path, ENV_FILE_MAX_BYTES).decode()))
    except (OSError, UnicodeDecodeError):
        return None


def read_env_file(path: str) -> EnvFile:
    """One of a unit's EnvironmentFile= entries. systemd follows a link there, so guardian does,
    to a regular file of at most ENV_FILE_MAX_BYTES only: anything else is unreadable, and why."""
    try:
        return EnvFile(path, read_back(path, ENV_FILE_MAX_BYTES, follow_symlinks=True).decode())
    except FileNotFoundError:
        return EnvFile(path, None)
    except Refused as e:
        return EnvFile(path, None, e.strerror)
    except (OSError, UnicodeDecodeError) as e:
        return EnvFile(path, None, str(e))


async def wiring_of(sd: Systemd, cfg: Config, r: ReplicaConfig) -> UnitWiring:
    """What R's unit shows of its wiring for the memory guard (judged by core/memory/wiring.py)."""
    if r.unitless:
        return UnitWiring(
            r.unit,
            unseen=(
                f"container {r.container} runs without a unit: its --gpu-memory-utilization was fixed by `docker run` "
                "when it was created, and changing it means creating it anew from a command guardian does not have; "
                "run it from a unit (README, Replicas in containers) for the memory guard to lower it"
            ),
        )
    try:
        d = await sd.service_details(r.unit)
    except SystemdError as e:
        return UnitWiring(r.unit, unseen=f"systemd could not be asked about {r.unit}: {e}")
    files = await asyncio.to_thread(lambda: tuple(read_env_file(p) for p in d.environment_files))
    engine = engine_of_unit(
        r, modelfiles.unit_argv(d.exec_start, modelfiles.unit_env(d.environment, tuple(f.text for f in files)))
    )
    knob = engine.knob.flag if engine.knob is not None else None
    return UnitWiring(r.unit, files, d.exec_start, str(env_path(cfg, r.name)), knob=knob, engine=engine.label)


def _knob(wiring: UnitWiring | None) -> str | None:
    """The memory flag of a replica's engine, as its wiring was read (vLLM's before it is)."""
    return wiring.knob if wiring is not None else DEFAULT.knob.flag if DEFAULT.knob is not None else None


def engine_of_unit(r: ReplicaConfig, declared: tuple[str, ...] | None) -> Engine:
    """R's engine as its config says, or (auto) as its unit's ExecStart= says as systemd runs it
    (DECLARED: its ${VAR}s expanded, modelfiles.unit_argv; None: unread), the words the daemon tells
    it from too (observe/replicas.py engine_told), so the two never tell two engines."""
    return told(r, engine_words(declared) if declared is not None else None).engine


async def service_details(sd: Systemd, r: ReplicaConfig) -> ServiceDetails | None:
    """R's unit's ExecStart=, environment and user, or None (a unit-less container, or no answer)."""
    if r.unitless:
        return None
    try:
        return await sd.service_details(r.unit)
    except SystemdError:
        return None


@dataclass(frozen=True)
class RunsWith:
    """What a replica's main process runs: its command line (the live one, else its unit's
    ExecStart=), its unit's environment files and environment, and its user's home. DECLARED: its
    unit's ExecStart= as systemd runs it (its ${VAR}s expanded from that environment; () without
    its unit's details): what the files guardian measures and releases come from, as a process may
    rewrite its live command line (`exec -a`) to name another model's tree (issue 41 row 4)."""

    argv: tuple[str, ...]
    env_files: tuple[EnvFile, ...]
    env: dict[str, str]
    home: str
    declared: tuple[str, ...] = ()


def runs_with(pid: int, details: ServiceDetails | None) -> RunsWith:
    """Blocking (it reads /proc and the env files): run in a thread."""
    live = cmdline_of(pid) if pid else ()
    argv = live or (details.exec_start if details is not None else ())
    env_files = tuple(read_env_file(p) for p in details.environment_files) if details is not None else ()
    env = modelfiles.unit_env(details.environment if details is not None else (), tuple(e.text for e in env_files))
    declared = modelfiles.unit_argv(details.exec_start, env) if details is not None else ()
    return RunsWith(argv, env_files, env, modelfiles.home_of(details.user if details is not None else None), declared)


def process_tree(pid: int) -> list[int]:
    """PID and its descendants (PID alone when it is gone)."""
    try:
        return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return [pid]


def cmdline_of(pid: int) -> tuple[str, ...]:
    """PID's command line (world-readable), or () when it is gone."""
    try:
        return tuple(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ()


def _below_base(cfg: Config, found: list[ReplicaMemoryObservation], bases: Mapping[str, float]) -> bool:
    """Some replica's env file holds a fraction below its base: the memory guard may raise it."""
    return any(
        x.configured_fraction is not None and r.name in bases and x.configured_fraction < bases[r.name] - 1e-9
        for r, x in zip(cfg.replicas, found, strict=False)
    )


def _largest_processes(n: int) -> list[tuple[str, int, int]]:
    procs = []
    for p in psutil.process_iter(["name", "memory_info"]):
        mi = p.info.get("memory_info")
        if mi is not None:
            procs.append((p.info.get("name") or "(unnamed)", p.pid, int(mi.rss)))
    return sorted(procs, key=lambda x: -x[2])[:n]


def unit_of_pid(pid: int, proc: str = "/proc") -> str | None:
    """The unit PID runs in (its cgroup v2 path), or None: gone, unreadable, or in no unit."""
    path = cgroup_of_pid(pid, proc)
    return unit_of_cgroup(path) if path else None


def consumers_text(units: list[tuple[str, int]], procs: list[tuple[str, int, int, str | None]]) -> str:
    """The largest consumers as the journal lines say them: each unit, then each process with its pid
    and, where known, its unit ("python3 (pid 9 in vllm-b.service) 50.0 GiB"): the start guard leaves
    out a replica's own (core/memory/startguard.py, S10's "largest others")."""
    named = [f"{n} (pid {pid}{f' in {u}' if u else ''}) {gib(b)}" for n, pid, b, u in procs]
    return ", ".join([f"{n} {gib(b)}" for n, b in units] + named)


class MemoryObserver:
    def __init__(self, sd: Systemd, client: httpx.AsyncClient) -> None:
        self.sd = sd
        self.client = client
        self.nvml: Nvml | None = None
        self.wiring: dict[str, UnitWiring] = {}
        self._consumers: tuple[float, str] | None = None  # (when, what) last found
        self._peers_found: tuple[float, object, dict[str, tuple[str, ...]]] | None = None  # (when, asked, found)

    def start(self) -> str:
        """Open NVML (once); the note says what it can tell on this box."""
        if self.nvml is None:
            self.nvml = Nvml()
        return self.nvml.note

    async def scan_wiring(self, cfg: Config) -> None:
        found = await asyncio.gather(*(wiring_of(self.sd, cfg, r) for r in cfg.replicas))
        self.wiring = {r.name: w for r, w in zip(cfg.replicas, found, strict=False)}

    async def observe(
        self,
        cfg: Config,
        replicas: dict[str, ReplicaObservation],
        pending: Pending | None,
        now: Now,
        bases: Mapping[str, float] | None = None,
    ) -> MemoryObservation:
        """BASES: each replica's base fraction (the state file): a replica below it may be raised, and
        a raise asks whether another replica of its model serves, as a lowering does (M23, M14)."""
        m = cfg.memory
        nvml = self.nvml
        sample = await asyncio.to_thread(sample_memory)
        total = m.device_total_bytes or (nvml.device_total_bytes() if nvml else None) or sample.total_bytes
        gpu_by_pid = await asyncio.to_thread(nvml.process_memory) if nvml else None

        async def one(r: ReplicaConfig) -> ReplicaMemoryObservation:
            o = replicas.get(r.name)
            pid = o.unit.main_pid if o is not None and o.unit is not None else 0
            usage = None
            argv: tuple[str, ...] = ()
            if pid:
                tree = await asyncio.to_thread(process_tree, pid)
                if gpu_by_pid:
                    usage = sum(gpu_by_pid.get(p, 0) for p in tree) or None
                argv = await asyncio.to_thread(cmdline_of, pid)
            failure = None
            if pending is not None and pending.replica == r.name:
                since_wall = now.wall_of(pending.issued_at) or now.wall  # journalctl --since is wall time
                failure = await unitlog.start_error(r.unit, since_wall, pending.new)
            return ReplicaMemoryObservation(
                configured_fraction=read_env_fraction(env_path(cfg, r.name)),
                cmdline_fraction=cmdline_fraction(argv, _knob(self.wiring.get(r.name))),
                usage_bytes=usage,
                wiring=self.wiring.get(r.name),
                start_failure=failure,
                cgroup_bytes=await self._cgroup_while_loading(cfg, r, o, now.mono),
            )

        per_replica = await asyncio.gather(*(one(r) for r in cfg.replicas))
        consumers: str = ""
        peers: dict[str, tuple[str, ...]] = {}
        if sample.available_bytes < m.min_headroom_bytes:
            consumers, peers = await asyncio.gather(self._largest_consumers(), self._peers(cfg, now.mono))
        elif m.restore and _below_base(cfg, per_replica, bases or {}):
            peers = await self._peers(cfg, now.mono)
        return MemoryObservation(
            sample, total, {r.name: x for r, x in zip(cfg.replicas, per_replica, strict=False)}, peers, consumers
        )

    async def _cgroup_while_loading(
        self, cfg: Config, r: ReplicaConfig, o: ReplicaObservation | None, mono: float
    ) -> int | None:
        """R's MemoryCurrent while it may be loading (the start guard's second measure of its growth):
        two D-Bus calls, only then. Never a container replica's: its unit holds only the engine's CLI."""
        if not cfg.memory.start_guard or r.container is not None or o is None:
            return None
        if not may_be_loading(o, r.startup_grace_s, mono):
            return None
        try:
            return await self.sd.memory_current(r.unit)
        except SystemdError:
            return None  # the start guard falls back to the headroom's fall

    async def _largest_consumers(self) -> str:
        mono = time.monotonic()
        if self._consumers is not None and mono - self._consumers[0] < CONSUMERS_MAX_AGE_S:
            return self._consumers[1]
        found = await self._find_largest_consumers()
        self._consumers = (mono, found)
        return found

    async def _find_largest_consumers(self) -> str:
        try:
            units = await self.sd.largest_units(3)
        except SystemdError:
            units = []
        procs = await asyncio.to_thread(lambda: [(n, pid, b, unit_of_pid(pid)) for n, pid, b in _largest_processes(2)])
        return consumers_text(units, procs)

    async def _peers(self, cfg: Config, mono: float) -> dict[str, tuple[str, ...]]:
        """_serving_peers, asked again only once its answers are PEERS_MAX_AGE_S old (or the peers or
        models configured changed: a reload)."""
        key = (tuple(cfg.memory.peer_urls), tuple(sorted({r.model for r in cfg.replicas})))
        cached = self._peers_found
        if cached is not None and cached[1] == key and 0 <= mono - cached[0] < PEERS_MAX_AGE_S:
            return cached[2]
        found = await self._serving_peers(cfg)
        self._peers_found = (mono, key, found)
        return found

    async def _serving_peers(self, cfg: Config) -> dict[str, tuple[str, ...]]:
        """Per model of this box, the memory.peer_urls that answered /health and list it: a peer
        that serves another model carries none of this one's load."""
        models = {r.model for r in cfg.replicas}
        timeout_s = cfg.memory.peer_timeout_s

        async def serving(url: str) -> tuple[str, frozenset[str]]:
            health, (_p, served) = await asyncio.gather(
                probes.health_at(self.client, url, timeout_s), probes.models_at(self.client, url, timeout_s)
            )
            return url, frozenset(served or ()) & models if health.ok else frozenset()

        found = await asyncio.gather(*(serving(u) for u in cfg.memory.peer_urls))
        return {model: tuple(url for url, served in found if model in served) for model in sorted(models)}
