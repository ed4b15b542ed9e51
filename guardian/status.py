"""What the running daemon shows: status.json (for `guardian status`) and the one-line summary
(sd_notify STATUS=). Renders the core's state; decides nothing."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .config import Config, ReplicaConfig
from .core import stopping
from .core.admission import START_LOOP, budget, start_loop_why
from .core.observations import Activity, MemorySample, PersistentView, ReplicaObservation, TickObservation, gib
from .core.tick import TickState
from .core.watchdog.track import Track
from .core.weights import Weights
from .observe.clock import Now


@dataclass
class LoopStats:
    ticks: int = 0
    durations_s: deque[float] = field(default_factory=lambda: deque(maxlen=1000))  # the last 1000 ticks
    max_watchdog_ping_gap_s: float = 0.0

    def add(self, duration_s: float) -> None:
        self.ticks += 1
        self.durations_s.append(duration_s)


def _pct(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def status_line(
    cfg: Config, state: TickState, persistent: PersistentView, memory: MemorySample | None, now_mono: float
) -> str:
    parts = []
    for r in cfg.replicas:
        t = state.tracks.get(r.name)
        text = str(t.state) if t is not None else "unknown"
        if budget(r.name, persistent, now_mono, cfg).spent:
            text += " (gave up: restart budget spent)"
        parts.append(f"{r.name} {text}")
    mem = f"headroom {gib(memory.available_bytes)}" if memory else "headroom ?"
    return ", ".join([*parts, mem]) if parts else f"no replicas; {mem}"


def _fraction(name: str, t: Track | None, obs: TickObservation | None) -> float | None:
    """guardian's env file for it, else what the replica reports."""
    found = obs.memory.replicas.get(name) if obs is not None and obs.memory is not None else None
    if found is not None and found.configured_fraction is not None:
        return found.configured_fraction
    return t.last_sample.gpu_memory_utilization if t is not None and t.last_sample is not None else None


def _connections(o: ReplicaObservation | None) -> dict[str, Any] | None:
    """The kernel's view of the replica's port at the last look (What the kernel shows)."""
    c = o.conns if o is not None else None
    if c is None:
        return None
    return {
        "established": c.connections,
        "flowing": c.flowing,
        "bytes_out": c.bytes_out,
        "over_s": c.since_s,
        "waiting": c.waiting,
        "oldest_wait_s": c.oldest_wait_s,
        "cpu_s": c.cpu_s,
        "peers": [{"kind": str(p.kind), "name": p.name, "connections": p.connections} for p in c.peers],
        "truncated": c.truncated,
    }


def _processes(o: ReplicaObservation | None, track: Track | None) -> dict[str, Any] | None:
    """The replica's own processes at the last look (observe/procs.py): each group's activity since
    the look before, and how long it has been quiet (L19-L22, C5)."""
    v = o.procs if o is not None else None
    if v is None:
        return None

    def group(act: Activity | None, since: float | None) -> dict[str, Any] | None:
        if act is None:
            return None
        quiet_s = v.at - since if since is not None else None
        return {"processes": act.procs, "used_s": act.used_s, "running": act.running, "quiet_s": quiet_s}

    return {
        "over_s": v.since_s,
        "engine_named": v.engine_named,
        "engine_whole": v.engine_whole,
        "api": group(v.api, track.api_quiet_since if track is not None else None),
        "engine": group(v.engine, track.engine_quiet_since if track is not None else None),
    }


@dataclass(frozen=True)
class Snapshot:
    """What the last tick saw and decided, as the status file shows it."""

    state: TickState
    persistent: PersistentView
    observation: TickObservation | None
    memory: MemorySample | None
    wiring: dict[str, str | None]  # replica -> why the memory guard cannot lower it (None: wired)
    # replica -> (bytes, when) of memory its processes held that did not come back (startfit U8)
    not_returned: Mapping[str, tuple[int, float]] = field(default_factory=dict)
    weights: Mapping[str, Weights | None] = field(default_factory=dict)  # replica -> its fingerprint (W1, W2)
    weights_differ: tuple[str, ...] = ()  # W1's hazards, as said


def status_dict(
    cfg: Config, config_path: str, snapshot: Snapshot, stats: LoopStats, bus_connected: bool, now: Now
) -> dict[str, Any]:
    """Times in it are wall-clock (epoch s), converted from the monotonic times the core keeps."""
    ticks = sorted(stats.durations_s)
    return {
        "pid": os.getpid(),
        "updated_at": now.wall,
        "interval_s": cfg.interval_s,
        "dry_run": cfg.dry_run,
        "system_bus": "connected" if bus_connected else "LOST",
        "ticks": {  # over the last (up to) 1000 ticks
            "count": stats.ticks,
            "p50_s": _pct(ticks, 0.50),
            "p99_s": _pct(ticks, 0.99),
            "max_s": ticks[-1] if ticks else None,
            "max_watchdog_ping_gap_s": stats.max_watchdog_ping_gap_s,
        },
        "config": config_path,
        "status": status_line(cfg, snapshot.state, snapshot.persistent, snapshot.memory, now.mono),
        "bypassing": [b.hazard(cfg, now.mono).message for b in snapshot.state.bypassing],
        "not_returned": {name: {"bytes": n, "at": at} for name, (n, at) in snapshot.not_returned.items()},
        "start_loops": {  # replicas in a start loop (A6): guardian causes no start of them
            name: _start_loop_text(name, track)
            for name, track in snapshot.state.tracks.items()
            if track.start_run.looping
        },
        "weights": {
            name: None if w is None else {"digest": w.digest, "what": w.what} for name, w in snapshot.weights.items()
        },
        "weights_differ": list(snapshot.weights_differ),
        "replicas": {r.name: _replica_status(cfg, r, snapshot, now) for r in cfg.replicas},
        "memory": _memory_status(cfg, snapshot, now),
    }


def _start_loop_text(name: str, track: Track) -> str:
    why = start_loop_why(track.start_run)
    return f"replica {name}: {why.reason} ({START_LOOP.id}); {why.remedy}"


def _replica_status(cfg: Config, r: ReplicaConfig, snapshot: Snapshot, now: Now) -> dict[str, Any]:
    wall = now.wall_of
    track = snapshot.state.tracks.get(r.name, Track())
    window = budget(r.name, snapshot.persistent, now.mono, cfg)
    pause = snapshot.persistent.pauses.get(r.name)
    observed = snapshot.observation.replicas.get(r.name) if snapshot.observation is not None else None
    return {
        "unit": r.unit,
        "url": r.url,
        "model": r.model,
        "state": str(track.state),
        "rule": track.rule,
        "since": wall(track.state_since),
        "evidence": track.evidence,
        "unit_started_at": wall(track.start_ts),
        "restarts_in_window": window.used,
        "restart_budget": window.limit,
        "gave_up": window.spent,
        "paused_until": wall(pause.until) if pause else None,
        "paused": pause is not None,
        "last_progress_at": wall(track.last_progress_at),
        "gpu_memory_utilization": _fraction(r.name, snapshot.state.tracks.get(r.name), snapshot.observation),
        # the fraction before guardian first lowered it: raised back toward it, never above; None: never lowered
        "gpu_memory_utilization_base": snapshot.persistent.fraction_bases.get(r.name),
        "memory_wiring": (snapshot.wiring.get(r.name, "not checked yet") or "wired")
        if cfg.memory.enabled
        else "not checked (memory guard off)",
        "connections": _connections(observed),
        "processes": _processes(observed, snapshot.state.tracks.get(r.name)),
        # a planned restart's stop bound (core/stopping.py T1): `guardian restart` waits for it
        "stop_bound_s": stopping.planned_stop(cfg, observed.declared if observed is not None else None).bound_s,
    }


def _memory_status(cfg: Config, snapshot: Snapshot, now: Now) -> dict[str, Any] | None:
    memory, guard = snapshot.memory, snapshot.state.mem
    if memory is None:
        return None
    pending = guard.pending
    return {
        "total_bytes": memory.total_bytes,
        "available_bytes": memory.available_bytes,
        "free_bytes": memory.free_bytes,
        "psi_some_avg10": memory.psi_some_avg10,
        "psi_full_avg10": memory.psi_full_avg10,
        "guard": cfg.memory.enabled,
        "min_headroom_bytes": cfg.memory.min_headroom_bytes,
        "below_min_since": now.wall_of(guard.below_since),
        "verdict": str(guard.verdict),
        "rule": guard.rule,
        "pending": None
        if pending is None
        else {
            "replica": pending.replica,
            "old": pending.old,
            "new": pending.new,
            "issued_at": now.wall_of(pending.issued_at),
            "raise": pending.raising,
            "restart_waits": pending.restart_owed,
        },
        "restore": _restore_status(cfg, snapshot, now),
    }


def _restore_status(cfg: Config, snapshot: Snapshot, now: Now) -> dict[str, Any]:
    """Raising fractions back (memory guard M20-M26): the settings and where the hysteresis stands."""
    guard = snapshot.state.mem
    return {
        "enabled": cfg.memory.restore,
        "after_s": cfg.memory.restore_after_s,
        "cooldown_s": cfg.memory.restore_cooldown_s,
        "clear_for": guard.clear_for,  # the replica a raise is counted for
        "clear_since": now.wall_of(guard.clear_since),
        "last_raise_at": now.wall_of(guard.last_raise_at),
        "ceilings": dict(guard.ceilings),  # replica -> a fraction a raise to which failed to start
    }
