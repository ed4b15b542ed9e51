"""What the running daemon shows: status.json (for `guardian status`) and the one-line summary
(sd_notify STATUS=). Renders the core's state; decides nothing."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from .config import Config
from .core.admission import budget
from .core.liveness import Track
from .core.observations import MemorySample, PersistentView, gib
from .core.tick import TickState


@dataclass
class LoopStats:
    ticks: int = 0
    durations_s: list[float] = field(default_factory=list)  # the last 1000 ticks
    max_watchdog_ping_gap_s: float = 0.0

    def add(self, duration_s: float) -> None:
        self.ticks += 1
        self.durations_s = ([*self.durations_s, duration_s])[-1000:]


def _pct(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def status_line(
    cfg: Config, state: TickState, persistent: PersistentView, memory: MemorySample | None, now: float
) -> str:
    parts = []
    for r in cfg.replicas:
        t = state.tracks.get(r.name)
        text = str(t.state) if t is not None else "unknown"
        if budget(r.name, persistent, now, cfg).spent:
            text += " (gave up: restart budget spent)"
        parts.append(f"{r.name} {text}")
    mem = f"headroom {gib(memory.available_bytes)}" if memory else "headroom ?"
    return ", ".join([*parts, mem]) if parts else f"no replicas; {mem}"


def status_dict(
    cfg: Config,
    config_path: str,
    state: TickState,
    persistent: PersistentView,
    memory: MemorySample | None,
    fractions: dict[str, float | None],
    wiring: dict[str, str | None],
    stats: LoopStats,
    bus_connected: bool,
    now: float,
) -> dict[str, Any]:
    replicas = {}
    for r in cfg.replicas:
        t = state.tracks.get(r.name, Track())
        b = budget(r.name, persistent, now, cfg)
        pause = persistent.pauses.get(r.name)
        replicas[r.name] = {
            "unit": r.unit,
            "url": r.url,
            "model": r.model,
            "state": str(t.state),
            "rule": t.rule,
            "since": t.state_since,
            "evidence": t.evidence,
            "unit_started_at": t.start_ts,
            "restarts_in_window": b.used,
            "restart_budget": b.limit,
            "gave_up": b.spent,
            "paused_until": pause.until if pause else None,
            "paused": pause is not None,
            "last_progress_at": t.last_progress_at,
            "gpu_memory_utilization": fractions.get(r.name),
            "memory_wiring": (wiring.get(r.name, "not checked yet") or "wired")
            if cfg.memory.enabled
            else "not checked (memory guard off)",
        }
    ticks = sorted(stats.durations_s)
    m = state.mem
    return {
        "pid": os.getpid(),
        "updated_at": now,
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
        "status": status_line(cfg, state, persistent, memory, now),
        "replicas": replicas,
        "memory": None
        if memory is None
        else {
            "total_bytes": memory.total_bytes,
            "available_bytes": memory.available_bytes,
            "free_bytes": memory.free_bytes,
            "psi_some_avg10": memory.psi_some_avg10,
            "psi_full_avg10": memory.psi_full_avg10,
            "guard": cfg.memory.enabled,
            "min_headroom_bytes": cfg.memory.min_headroom_bytes,
            "below_min_since": m.below_since,
            "verdict": str(m.verdict),
            "rule": m.rule,
            "pending": None if m.pending is None else asdict(m.pending),
        },
    }
