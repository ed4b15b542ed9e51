"""A start's figures, right now, as the start fit needs them (core/fit/startfit.py judges them): the
box's memory, what the replica's processes hold that their exit gives back, the fraction it runs
with and the one its next start would take, its unit's env files, and its model files with their
page cache. Looked at by a restart's fit step (act/fit.py) right before the start, by `guardian
check`, and each tick for a kept U8 finding. Blocking: run in a thread."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ..config import Config, ReplicaConfig
from ..core.fit.startfit import LeftoverLook
from ..core.memory.wiring import VAR, VAR_FORMS, EnvFile, cmdline_fraction
from ..core.observations import MemorySample, UnitInfo
from ..core.vocab import ActiveState
from ..engines.base import Engine
from . import modelfiles, nvml
from .meminfo import sample_memory
from .memory import cmdline_of, engine_of_unit, env_path, process_tree, read_env_fraction, runs_with
from .sockets import CGROUP_ROOT, cgroup_of_pid
from .systemd import ServiceDetails


@dataclass(frozen=True)
class StartLook:
    """One look at a replica's next start. RUNNING_FRACTION: its engine's flag on its live processes
    (None: not running, or no process was given one: a wrapper hides it); OWN_FRACTION: what its next
    start at its own fraction runs with (None: nothing says, the engine's default)."""

    sample: MemorySample
    total_bytes: int
    returned_bytes: int
    running: bool  # its unit is active or reloading: what its fraction reserves is held
    running_fraction: float | None
    own_fraction: float | None
    env_files: tuple[EnvFile, ...]
    engine: Engine
    files: modelfiles.ModelFiles
    cached: modelfiles.Cached


def look(
    cfg: Config,
    r: ReplicaConfig,
    unit: UnitInfo | None,
    details: ServiceDetails | None,
    deadline_mono: float = math.inf,
) -> StartLook:
    """R's next start as the world stands now; its model files' walk and measure stop at DEADLINE_MONO
    (time.monotonic's). The files are those its unit declares (RunsWith.declared), never those its live
    command line names."""
    sample = sample_memory()
    pid = unit.main_pid if unit is not None else 0
    runs = runs_with(pid, details)
    files = modelfiles.find(runs.declared, runs.env, runs.home, deadline_mono)
    engine = engine_of_unit(r, runs.declared if details is not None else None)
    knob = engine.knob.flag if engine.knob is not None else None
    running = unit is not None and unit.active_state in (ActiveState.ACTIVE, ActiveState.RELOADING)
    return StartLook(
        sample=sample,
        total_bytes=cfg.memory.device_total_bytes or sample.total_bytes,
        returned_bytes=held_now(pid),
        running=running,
        running_fraction=_running_fraction(pid, knob) if running else None,
        own_fraction=_own_fraction(cfg, r, runs.argv, runs.env, knob),
        env_files=runs.env_files,
        engine=engine,
        files=files,
        cached=modelfiles.cached_bytes(files.paths, files.top, deadline_mono),
    )


def nvml_bytes(pid: int) -> int:
    """NVML's per-process memory of PID's process tree (GB10 reports it), 0 where NVML cannot say."""
    by_pid = nvml.shared().process_memory() if pid else None
    if not by_pid:
        return 0
    return sum(by_pid.get(p, 0) for p in process_tree(pid))


def process_held_bytes(pid: int) -> int:
    """RssAnon + RssShmem of PID's process tree (/proc/PID/status): what they hold that their exit
    should give back, where no memory controller counts it (shared memory only if its files go: U8)."""
    total = 0
    for p in process_tree(pid) if pid else ():
        try:
            with open(f"/proc/{p}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            total += sum(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssShmem") if k in fields)
        except (OSError, ValueError):
            continue
    return total


def cgroup_held_bytes(pid: int) -> int:
    """The anonymous and shared memory of PID's cgroup (memory.stat anon + shmem): what its processes
    should give back on exit (shared memory only if they remove its files: U8 checks)."""
    path = cgroup_of_pid(pid) if pid else None
    if path is None:
        return 0
    try:
        with open(f"{CGROUP_ROOT}{path}/memory.stat") as f:
            stat = dict(line.split(" ", 1) for line in f if " " in line)
        return int(stat.get("anon", 0)) + int(stat.get("shmem", 0))
    except (OSError, ValueError):
        return 0


def held_now(pid: int) -> int:
    """What PID's processes hold that their exit should give back: the largest of the measures
    above (StartFit.returned_bytes; U8 and its kept findings read the same)."""
    return max(cgroup_held_bytes(pid), process_held_bytes(pid), nvml_bytes(pid))


def unified(cfg: Config) -> bool:
    """M.unified, with "auto" asked of NVML (once)."""
    return nvml.unified_memory_gpu() if cfg.memory.unified == "auto" else cfg.memory.unified


def _running_fraction(pid: int, knob: str | None) -> float | None:
    """KNOB (its engine's memory flag) of the first process in PID's tree that was given one."""
    for p in process_tree(pid) if pid else ():
        found = cmdline_fraction(cmdline_of(p), knob)
        if found is not None:
            return found
    return None


def _own_fraction(
    cfg: Config, r: ReplicaConfig, argv: tuple[str, ...], env: Mapping[str, str], knob: str | None
) -> float | None:
    """What its next start at its own fraction runs with: guardian's env file, else the command line
    (its ${GPU_MEMORY_UTILIZATION} as the unit's environment sets it, after KNOB, its engine's flag);
    None: nothing says (vLLM's default)."""
    found = read_env_fraction(env_path(cfg, r.name))
    if found is not None:
        return found
    value = env.get(VAR)
    return cmdline_fraction(tuple(value if a in VAR_FORMS and value is not None else a for a in argv), knob)


def look_kept(pid: int, now_mono: float) -> LeftoverLook:
    """This tick's figures for a kept U8 finding of the replica whose main process is PID (0: none):
    MemFree, the file cache, and what its processes hold (blocking: run in a thread)."""
    sample = sample_memory()
    return LeftoverLook(sample.free_bytes, sample.file_cache_bytes, held_now(pid), now_mono)
