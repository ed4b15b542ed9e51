"""The memory guard's policy: give co-located work its headroom back. Pure, like policy.py.

``headroom`` is the kernel's MemAvailable. ``total`` is what vLLM's --gpu-memory-utilization
is a fraction of: ``memory.device_total_bytes``, or MemTotal when unset (GB10: one memory).

Rules (``M`` = the memory config, times in seconds, sizes in bytes):

  squeezed   headroom < M.min_headroom_bytes on every tick for >= M.sustain_s, AND, when
             M.psi_some_threshold_pct is set, PSI "some" avg10 >= that threshold on every tick
             for >= M.sustain_s
  critical   squeezed AND headroom < M.critical_headroom_bytes on this tick

When squeezed, in this order (the first that fails is logged once per squeeze):

  1. no lowering is pending (issued, and the replica not serving yet with its new fraction)
  2. now - last lowering >= M.cooldown_s
  3. a replica can give: its fraction is known and > M.floor, and its unit is wired (it reads
     guardian's env file and passes --gpu-memory-utilization ${GPU_MEMORY_UTILIZATION}).
     The first of M.priority that can, else the one with the most fraction above the floor.
  4. fit: new = the highest fraction on the 0.01 grid, <= current - M.step and >= M.floor, with
     total x new <= headroom + what the replica holds now (NVML, else total x current)
     - M.reserve_bytes; vLLM refuses a start that does not fit, so none fitting means wait
  5. another replica of the same model is healthy or busy right now (on this box, or at one of
     M.peer_urls), unless critical
  6. the watchdog allows a restart now (budget, back-off, one restart at a time per box)
  then: write the env file, restart that replica's unit alone through the unit gates.

After a lowering: when the replica serves again the lowering is done. When its unit's journal
shows vLLM refusing the start (or the unit is failed, or still not serving after its startup
grace), the cause is logged and the next fraction down is written at once, if it is >= M.floor
and fits. While systemd is restarting the unit by itself (Restart=always), the file is all it
takes; a unit that is active, or failed after this start, is restarted by guardian.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .config import Config
from .memory import MemorySample, gib

SERVING = frozenset({"healthy", "busy"})


@dataclass(frozen=True)
class ReplicaMemory:
    name: str
    unit: str
    model: str
    fraction: float | None  # what it is configured with: guardian's env file, else what it runs with
    running_fraction: float | None  # what it reports in /metrics (vllm:cache_config_info)
    started_at: float | None  # its unit's last start (InactiveExitTimestamp)
    wiring_problem: str | None  # None: wired for the memory guard
    state: str  # the watchdog's verdict
    usage_bytes: int | None = None  # NVML per-process memory, when the driver reports it
    start_failure: str | None = None  # vLLM's startup error, from the unit's journal since the lowering
    startup_grace_s: float = 1200.0


@dataclass(frozen=True)
class MemoryView:
    sample: MemorySample
    total_bytes: int
    replicas: tuple[ReplicaMemory, ...]
    peers_serving: tuple[str, ...] = ()  # peer URLs that answered healthy with the model
    consumers: str = ""  # "db.service 22.1 GiB, make 9.3 GiB"
    restart_blocked: dict[str, str] | None = None  # replica -> why the watchdog would not restart it now
    restart_results: dict[str, str] | None = None  # replica -> result of a restart job that ended this tick


@dataclass(frozen=True)
class Pending:
    replica: str
    old: float
    new: float
    issued_at: float


@dataclass(frozen=True)
class MemTrack:
    below_since: float | None = None
    psi_since: float | None = None
    last_change_at: float | None = None
    pending: Pending | None = None
    last_notice: str | None = None


@dataclass(frozen=True)
class LowerFraction:
    replica: str
    unit: str
    old: float
    new: float
    restart: bool  # False: only write the env file (systemd is restarting the unit by itself)
    evidence: str
    retry: bool = False  # after a failed start with the previous fraction: a failed unit may be restarted


@dataclass(frozen=True)
class MemLog:
    priority: str
    message: str
    replica: str | None = None
    unit: str | None = None


MemAction = LowerFraction | MemLog


def grid(x: float) -> float:
    return round(x + 1e-9, 2)


def choose_fraction(current: float, held_bytes: int, headroom: int, total: int, step: float, floor: float,
                    reserve: int) -> float | None:
    """The highest grid fraction <= current - step and >= floor that fits; None if none does."""
    f = grid(max(floor, current - step))
    available_after = headroom + held_bytes - reserve
    while f >= floor - 1e-9 and f < current:
        if total * f <= available_after:
            return f
        f = grid(f - 0.01)
    return None


def _held(r: ReplicaMemory, total: int) -> int:
    return r.usage_bytes if r.usage_bytes is not None else int(total * (r.fraction or 0.0))


def decide(track: MemTrack, view: MemoryView, now: float, cfg: Config) -> tuple[MemTrack, list[MemAction]]:
    m = cfg.memory
    actions: list[MemAction] = []
    headroom = view.sample.available_bytes
    t = track
    t = replace(t, below_since=(t.below_since if t.below_since is not None else now) if headroom < m.min_headroom_bytes else None)
    psi = view.sample.psi_some_avg10
    if m.psi_some_threshold_pct is not None and psi is not None and psi >= m.psi_some_threshold_pct:
        t = replace(t, psi_since=t.psi_since if t.psi_since is not None else now)
    else:
        t = replace(t, psi_since=None)
    by_name = {r.name: r for r in view.replicas}

    def notice(key: str, priority: str, message: str, r: ReplicaMemory | None = None) -> None:
        nonlocal t
        if t.last_notice != key:
            actions.append(MemLog(priority, message, r.name if r else None, r.unit if r else None))
            t = replace(t, last_notice=key)

    # --- a lowering in flight ---------------------------------------------------------------
    if t.pending is not None:
        p = t.pending
        r = by_name.get(p.replica)
        if r is None:
            return replace(t, pending=None), actions
        result = (view.restart_results or {}).get(p.replica)
        if result is not None and result.startswith(("refused", "error")):
            actions.append(MemLog("error", f"replica {r.name}: lowering to {p.new:g} abandoned: {result}", r.name, r.unit))
            return replace(t, pending=None), actions
        restarted = r.started_at is not None and r.started_at >= p.issued_at
        runs_new = (abs(r.running_fraction - p.new) < 1e-6) if r.running_fraction is not None else restarted
        if r.state in SERVING and restarted and runs_new:
            actions.append(MemLog("info", f"replica {r.name}: serving again with gpu_memory_utilization {p.new:g} "
                                  f"{now - p.issued_at:.0f} s after the lowering; headroom {gib(headroom)}", r.name, r.unit))
            return replace(t, pending=None, last_notice=None), actions
        failed = r.start_failure or (
            "unit failed" if r.state == "stopped" else
            f"not serving {now - p.issued_at:.0f} s after the restart (grace {r.startup_grace_s:g} s)"
            if now - p.issued_at >= r.startup_grace_s else None)
        if failed is None:
            return t, actions
        nxt = choose_fraction(p.new, _held(r, view.total_bytes), headroom, view.total_bytes, m.step, m.floor, m.reserve_bytes)
        if nxt is None:
            actions.append(MemLog("error", f"replica {r.name}: start with gpu_memory_utilization {p.new:g} failed ({failed}); "
                                  f"no lower fraction >= floor {m.floor:g} fits in headroom {gib(headroom)}; "
                                  f"leaving it to the operator (journalctl -u {r.unit})", r.name, r.unit))
            return replace(t, pending=None, last_change_at=now), actions
        actions.append(MemLog("error", f"replica {r.name}: start with gpu_memory_utilization {p.new:g} failed ({failed}); "
                              f"trying {nxt:g}", r.name, r.unit))
        actions.append(LowerFraction(r.name, r.unit, p.new, nxt, restart=r.state != "starting",
                                     evidence=f"start with {p.new:g} failed: {failed}", retry=True))
        return replace(t, pending=Pending(r.name, p.new, nxt, now), last_change_at=now), actions

    squeezed = t.below_since is not None and now - t.below_since >= m.sustain_s and (
        m.psi_some_threshold_pct is None or (t.psi_since is not None and now - t.psi_since >= m.sustain_s))
    if not squeezed:
        return replace(t, last_notice=None), actions
    critical = headroom < m.critical_headroom_bytes
    why = (f"headroom {gib(headroom)} < {gib(m.min_headroom_bytes)} for {now - t.below_since:.0f} s"
           + (f", PSI some {psi:.1f}%" if psi is not None else "")
           + (f" (CRITICAL: < {gib(m.critical_headroom_bytes)})" if critical else "")
           + (f" (largest: {view.consumers})" if view.consumers else ""))

    if t.last_change_at is not None and now - t.last_change_at < m.cooldown_s:
        notice("cooldown", "info", f"memory squeezed: {why}; cooldown: last lowering {now - t.last_change_at:.0f} s ago, "
               f"next allowed after {m.cooldown_s:g} s")
        return t, actions

    order = [by_name[n] for n in m.priority if n in by_name] + sorted(
        (r for r in view.replicas if r.name not in m.priority),
        key=lambda r: -((r.fraction or 0.0) - m.floor))
    able = [r for r in order if r.fraction is not None and r.fraction > m.floor + 1e-9 and r.wiring_problem is None]
    if not able:
        unwired = [r for r in order if r.wiring_problem is not None]
        if unwired:
            r = unwired[0]
            notice(f"unwired:{r.name}", "error", f"memory squeezed: {why}; replica {r.name}: {r.unit} is not wired for the "
                   f"memory guard, refusing to restart it (a restart without a lower fraction frees nothing): {r.wiring_problem}", r)
        else:
            notice("floor", "error", f"memory squeezed: {why}; every replica is at its floor {m.floor:g} "
                   "(or its fraction is unknown): nothing left to give")
        return t, actions
    r = able[0]
    new = choose_fraction(r.fraction, _held(r, view.total_bytes), headroom, view.total_bytes, m.step, m.floor, m.reserve_bytes)
    if new is None:
        notice(f"fit:{r.name}", "error", f"memory squeezed: {why}; replica {r.name}: no fraction between "
               f"{grid(r.fraction - m.step):g} and the floor {m.floor:g} fits (total {gib(view.total_bytes)} x fraction must be "
               f"<= headroom + what it holds - reserve {gib(m.reserve_bytes)}); waiting rather than a start vLLM would refuse", r)
        return t, actions
    peers = [o.name for o in view.replicas if o.name != r.name and o.model == r.model and o.state in SERVING]
    peers += list(view.peers_serving)
    if not peers and not critical:
        notice(f"peer:{r.name}", "error", f"memory squeezed: {why}; replica {r.name}: no other replica of {r.model} is "
               f"serving right now, deferring the lowering to {new:g} (acts anyway below "
               f"{gib(m.critical_headroom_bytes)})", r)
        return t, actions
    blocked = (view.restart_blocked or {}).get(r.name)
    if blocked:
        notice(f"blocked:{r.name}:{blocked}", "error", f"memory squeezed: {why}; replica {r.name}: lowering to {new:g} "
               f"deferred: {blocked}", r)
        return t, actions
    serving = f"{', '.join(peers)} serving" if peers else "NO other replica serving (critical)"
    if cfg.dry_run:
        notice(f"dry-run:{r.name}", "warning", f"memory squeezed: {why}; DRY-RUN: would lower replica {r.name} "
               f"{r.fraction:g} -> {new:g} and restart {r.unit} alone; {serving}", r)
        return t, actions
    actions.append(MemLog("warning", f"{why}; replica {r.name} {r.fraction:g} -> {new:g}; restarting {r.unit} alone; {serving}",
                          r.name, r.unit))
    actions.append(LowerFraction(r.name, r.unit, r.fraction, new, restart=True, evidence=why))
    return replace(t, pending=Pending(r.name, r.fraction, new, now), last_change_at=now, last_notice=None), actions
