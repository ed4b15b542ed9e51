"""The memory guard's policy: give co-located work its headroom back. Pure, like policy.py.

``headroom`` is the kernel's MemAvailable. ``total`` is what vLLM's --gpu-memory-utilization
is a fraction of: ``memory.device_total_bytes``, or MemTotal when unset (GB10: one memory).

Rules: the rows of RULES below (ids M1-M16), rendered into the README. ``M`` = the memory
config, times in seconds, sizes in bytes. When squeezed, M9-M16 are checked in order and the
first that holds is the verdict, logged once per squeeze.

A lowering is confirmed from what the restarted replica reports (vllm:cache_config_info, else
--gpu-memory-utilization on its command line): a replica that serves with another fraction than
the one guardian wrote is overridden by something (a later EnvironmentFile=, an ExecStart= drop-in),
and guardian says so instead of lowering again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import Config
from .actions import AcquireSlot, DrainReplica, LogLine, LowerFraction
from .observations import MemorySample, RestartOutcome, gib
from .rules import Refusal, Rule
from .vocab import SERVING_STATES, Decision, Gate, MemVerdict, Priority, State

V = MemVerdict
RULES = (
    Rule(
        "M1",
        "squeezed",
        "headroom (MemAvailable) < M.min_headroom_bytes on every tick for >= M.sustain_s, AND, "
        "when M.psi_some_threshold_pct is set, PSI some avg10 >= it on every tick for >= M.sustain_s",
    ),
    Rule("M2", "critical", "squeezed AND headroom < M.critical_headroom_bytes on this tick"),
    Rule("M3", V.PENDING, "a lowering is pending: issued, and the replica not serving since with a new start"),
    Rule(
        "M4",
        V.DONE,
        "the pending replica serves (healthy or busy), was started after the lowering, and reports "
        "the new fraction (or reports none)",
    ),
    Rule(
        "M5",
        V.MISMATCH,
        "the pending replica serves, was started after the lowering, and reports another "
        "fraction than the one written: something overrides guardian's env file; no further lowering of it",
    ),
    Rule("M6", V.ABANDONED, "the lowering's restart was refused by a gate or failed"),
    Rule(
        "M7",
        V.RETRY,
        "the new start failed (vLLM's refusal in this start's journal, unit failed, or not serving "
        "R.startup_grace_s after the lowering) AND a lower fraction >= M.floor fits: it is written at once",
    ),
    Rule("M8", V.GAVE_UP, "the new start failed AND no lower fraction >= M.floor fits: left to the operator"),
    Rule("M9", V.COOLDOWN, "now - last lowering < M.cooldown_s"),
    Rule(
        "M10",
        V.UNWIRED,
        "no replica can give: the one that could is not wired (its unit does not read "
        "guardian's env file last, or does not pass --gpu-memory-utilization ${GPU_MEMORY_UTILIZATION})",
    ),
    Rule("M11", V.FLOOR, "no replica can give: every fraction is unknown or <= M.floor"),
    Rule(
        "M12",
        V.NO_FIT,
        "for the chosen replica (the first of M.priority that can give, else the most above the "
        "floor) no fraction on the 0.01 grid, <= current - M.step and >= M.floor, has total x fraction <= "
        "headroom + what it holds (NVML, else total x current) - M.reserve_bytes",
    ),
    Rule(
        "M13",
        V.NO_PEER,
        "no other replica of the same model is healthy or busy (on this box, at M.peer_urls, or on another box "
        "in the fleet view when [fleet] is set) AND not critical",
    ),
    Rule(
        "M14",
        V.DEFERRED,
        "restart admission refuses it now (A1-A3: budget, back-off, one at a time), or it waits for a fleet "
        "slot (F3-F6; not when critical: then it goes ahead without one, said at error)",
    ),
    Rule(
        "M15",
        V.DRAINING,
        "a proxy is configured ([proxy]) AND not critical AND the chosen replica is not drained yet "
        "(core/drain.py D5, D6): it is marked down and drained first; the lowering waits (with dry_run: not drained)",
    ),
    Rule(
        "M16",
        V.LOWER,
        "otherwise: write the env file, restart that replica's unit alone through the unit gates "
        "(with dry_run = true: logged, not done)",
    ),
)
del V
_ID = {r.outcome: r.id for r in RULES} | {MemVerdict.DRY_RUN: "M16"}


@dataclass(frozen=True)
class ReplicaMemory:
    name: str
    unit: str
    model: str
    fraction: float | None  # what it is configured with: guardian's env file, else what it runs with
    running_fraction: float | None  # what it reports: vllm:cache_config_info, else its command line
    started_at: float | None  # its unit's last start (InactiveExitTimestampMonotonic)
    wiring_problem: str | None  # None: wired for the memory guard
    state: State  # the watchdog's verdict
    usage_bytes: int | None = None  # NVML per-process memory, when the driver reports it
    start_failure: str | None = None  # vLLM's startup error, from the unit's journal since the lowering
    startup_grace_s: float = 1200.0
    drained: bool = False  # marked down at the proxy and drained (core/drain.py D5, D6)


@dataclass(frozen=True)
class MemoryView:
    sample: MemorySample
    total_bytes: int
    replicas: tuple[ReplicaMemory, ...]
    peers_serving: tuple[str, ...] = ()  # peer URLs that answered healthy with the model
    consumers: str = ""  # "db.service 22.1 GiB, make 9.3 GiB"
    restart_blocked: dict[str, Refusal] | None = None  # replica -> why admission would not restart it now
    restart_results: dict[str, RestartOutcome] | None = None  # replica -> a restart job that ended this tick
    drain_first: bool = False  # a proxy is configured: a replica is drained before it is lowered (M15)
    fleet_serving: dict[str, tuple[str, ...]] | None = None  # model -> BOX/NAME serving on other boxes ([fleet])


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
    last_notice: tuple[str, ...] | None = None
    verdict: MemVerdict = MemVerdict.NOT_SQUEEZED
    rule: str | None = None


MemAction = LogLine | LowerFraction | DrainReplica | AcquireSlot


def _log(
    priority: Priority,
    verdict: MemVerdict,
    message: str,
    r: ReplicaMemory | None = None,
    decision: Decision = Decision.MEMORY_NOTE,
) -> LogLine:
    return LogLine(priority, message, decision, r.name if r else None, r.unit if r else None, rule=_ID[verdict])


def grid(x: float) -> float:
    return round(x + 1e-9, 2)


def choose_fraction(
    current: float, held_bytes: int, headroom: int, total: int, step: float, floor: float, reserve: int
) -> float | None:
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
    t = replace(
        t,
        below_since=(t.below_since if t.below_since is not None else now) if headroom < m.min_headroom_bytes else None,
    )
    psi = view.sample.psi_some_avg10
    if m.psi_some_threshold_pct is not None and psi is not None and psi >= m.psi_some_threshold_pct:
        t = replace(t, psi_since=t.psi_since if t.psi_since is not None else now)
    else:
        t = replace(t, psi_since=None)
    by_name = {r.name: r for r in view.replicas}

    def verdict(v: MemVerdict, key: tuple[str, ...] | None = None, line: LogLine | None = None) -> None:
        """The tick's verdict; LINE is logged once per KEY (once per squeeze and cause)."""
        nonlocal t
        t = replace(t, verdict=v, rule=_ID.get(v))
        if line is not None and (key is None or t.last_notice != key):
            actions.append(line)
            t = replace(t, last_notice=key)

    # --- a lowering in flight ---------------------------------------------------------------
    if t.pending is not None:
        p = t.pending
        r = by_name.get(p.replica)
        if r is None:
            return replace(t, pending=None), actions
        outcome = (view.restart_results or {}).get(p.replica)
        if outcome is not None and not outcome.issued:
            verdict(
                MemVerdict.ABANDONED,
                None,
                _log(
                    Priority.ERROR,
                    MemVerdict.ABANDONED,
                    f"replica {r.name}: lowering to {p.new:g} abandoned: {outcome.result}",
                    r,
                ),
            )
            return replace(t, pending=None), actions
        restarted = r.started_at is not None and r.started_at >= p.issued_at
        if r.state in SERVING_STATES and restarted:
            if r.running_fraction is not None and abs(r.running_fraction - p.new) > 1e-6:
                verdict(
                    MemVerdict.MISMATCH,
                    None,
                    _log(
                        Priority.ERROR,
                        MemVerdict.MISMATCH,
                        f"replica {r.name}: serving again, but with gpu_memory_utilization "
                        f"{r.running_fraction:g}, not the {p.new:g} guardian wrote: something overrides "
                        f"guardian's env file (a later EnvironmentFile= "
                        f"that sets GPU_MEMORY_UTILIZATION, or an ExecStart= drop-in); not lowering it again until "
                        f"that is fixed (guardian check; systemctl cat {r.unit})",
                        r,
                    ),
                )
                return replace(t, pending=None, last_change_at=now), actions
            verdict(
                MemVerdict.DONE,
                None,
                _log(
                    Priority.INFO,
                    MemVerdict.DONE,
                    f"replica {r.name}: serving again with gpu_memory_utilization {p.new:g} "
                    f"{now - p.issued_at:.0f} s after the lowering; headroom {gib(headroom)}",
                    r,
                ),
            )
            return replace(t, pending=None, last_notice=None), actions
        failed = r.start_failure or (
            "unit failed"
            if r.state is State.STOPPED
            else f"not serving {now - p.issued_at:.0f} s after the restart (grace {r.startup_grace_s:g} s)"
            if now - p.issued_at >= r.startup_grace_s
            else None
        )
        if failed is None:
            verdict(MemVerdict.PENDING)
            return t, actions
        nxt = choose_fraction(
            p.new, _held(r, view.total_bytes), headroom, view.total_bytes, m.step, m.floor, m.reserve_bytes
        )
        if nxt is None:
            verdict(
                MemVerdict.GAVE_UP,
                None,
                _log(
                    Priority.ERROR,
                    MemVerdict.GAVE_UP,
                    f"replica {r.name}: start with gpu_memory_utilization {p.new:g} failed ({failed}); "
                    f"no lower fraction >= floor {m.floor:g} fits in headroom {gib(headroom)}; "
                    f"leaving it to the operator (journalctl -u {r.unit})",
                    r,
                ),
            )
            return replace(t, pending=None, last_change_at=now), actions
        verdict(
            MemVerdict.RETRY,
            None,
            _log(
                Priority.ERROR,
                MemVerdict.RETRY,
                f"replica {r.name}: start with gpu_memory_utilization {p.new:g} failed ({failed}); trying {nxt:g}",
                r,
            ),
        )
        actions.append(
            LowerFraction(
                r.name,
                r.unit,
                p.new,
                nxt,
                restart=r.state is not State.STARTING,
                evidence=f"start with {p.new:g} failed: {failed}",
                retry=True,
            )
        )
        return replace(t, pending=Pending(r.name, p.new, nxt, now), last_change_at=now), actions

    squeezed = (
        t.below_since is not None
        and now - t.below_since >= m.sustain_s
        and (m.psi_some_threshold_pct is None or (t.psi_since is not None and now - t.psi_since >= m.sustain_s))
    )
    if not squeezed or t.below_since is None:
        return replace(t, last_notice=None, verdict=MemVerdict.NOT_SQUEEZED, rule=None), actions
    critical = headroom < m.critical_headroom_bytes
    why = (
        f"headroom {gib(headroom)} < {gib(m.min_headroom_bytes)} for {now - t.below_since:.0f} s"
        + (f", PSI some {psi:.1f}%" if psi is not None else "")
        + (f" (CRITICAL: < {gib(m.critical_headroom_bytes)})" if critical else "")
        + (f" (largest: {view.consumers})" if view.consumers else "")
    )

    if t.last_change_at is not None and now - t.last_change_at < m.cooldown_s:
        verdict(
            MemVerdict.COOLDOWN,
            (MemVerdict.COOLDOWN,),
            _log(
                Priority.INFO,
                MemVerdict.COOLDOWN,
                f"memory squeezed: {why}; cooldown: last lowering {now - t.last_change_at:.0f} s ago, "
                f"next allowed after {m.cooldown_s:g} s",
            ),
        )
        return t, actions

    order = [by_name[n] for n in m.priority if n in by_name] + sorted(
        (r for r in view.replicas if r.name not in m.priority), key=lambda r: -((r.fraction or 0.0) - m.floor)
    )
    able = [r for r in order if r.fraction is not None and r.fraction > m.floor + 1e-9 and r.wiring_problem is None]
    if not able:
        unwired = [r for r in order if r.wiring_problem is not None]
        if unwired:
            r = unwired[0]
            verdict(
                MemVerdict.UNWIRED,
                (MemVerdict.UNWIRED, r.name),
                _log(
                    Priority.ERROR,
                    MemVerdict.UNWIRED,
                    f"memory squeezed: {why}; replica {r.name}: {r.unit} is not wired for the memory guard, "
                    f"refusing to restart it (a restart without a lower fraction frees nothing): {r.wiring_problem}",
                    r,
                ),
            )
        else:
            verdict(
                MemVerdict.FLOOR,
                (MemVerdict.FLOOR,),
                _log(
                    Priority.ERROR,
                    MemVerdict.FLOOR,
                    f"memory squeezed: {why}; every replica is at its floor {m.floor:g} "
                    "(or its fraction is unknown): nothing left to give",
                ),
            )
        return t, actions
    r = able[0]
    assert r.fraction is not None
    new = choose_fraction(
        r.fraction, _held(r, view.total_bytes), headroom, view.total_bytes, m.step, m.floor, m.reserve_bytes
    )
    if new is None:
        verdict(
            MemVerdict.NO_FIT,
            (MemVerdict.NO_FIT, r.name),
            _log(
                Priority.ERROR,
                MemVerdict.NO_FIT,
                f"memory squeezed: {why}; replica {r.name}: no fraction between {grid(r.fraction - m.step):g} and the "
                f"floor {m.floor:g} fits (total {gib(view.total_bytes)} x fraction must be <= headroom + what it holds "
                f"- reserve {gib(m.reserve_bytes)}); waiting rather than a start vLLM would refuse",
                r,
            ),
        )
        return t, actions
    peers = [o.name for o in view.replicas if o.name != r.name and o.model == r.model and o.state in SERVING_STATES]
    peers += list(view.peers_serving)
    peers += list((view.fleet_serving or {}).get(r.model, ()))
    if not peers and not critical:
        verdict(
            MemVerdict.NO_PEER,
            (MemVerdict.NO_PEER, r.name),
            _log(
                Priority.ERROR,
                MemVerdict.NO_PEER,
                f"memory squeezed: {why}; replica {r.name}: no other replica of {r.model} is serving right now, "
                f"deferring the lowering to {new:g} (acts anyway below {gib(m.critical_headroom_bytes)})",
                r,
            ),
        )
        return t, actions
    blocked = (view.restart_blocked or {}).get(r.name)
    if blocked is not None and blocked.gate is Gate.FLEET and critical:
        actions.append(
            _log(
                Priority.ERROR,
                MemVerdict.LOWER,
                f"memory squeezed: {why}; replica {r.name}: no fleet slot ({blocked.text}); critical, so the "
                "lowering goes ahead without one",
                r,
                Decision.FLEET,
            )
        )
        blocked = None
    if blocked is not None:
        if blocked.gate is Gate.FLEET and blocked.rule == "F6":
            actions.append(AcquireSlot(r.name, r.model))
        verdict(
            MemVerdict.DEFERRED,
            (MemVerdict.DEFERRED, r.name, *blocked.key),
            _log(
                Priority.ERROR,
                MemVerdict.DEFERRED,
                f"memory squeezed: {why}; replica {r.name}: lowering to {new:g} deferred: {blocked.text}",
                r,
            ),
        )
        return t, actions
    serving = f"{', '.join(peers)} serving" if peers else "NO other replica serving (critical)"
    if cfg.dry_run:
        verdict(
            MemVerdict.DRY_RUN,
            (MemVerdict.DRY_RUN, r.name),
            _log(
                Priority.WARNING,
                MemVerdict.DRY_RUN,
                f"memory squeezed: {why}; DRY-RUN: would lower replica {r.name} {r.fraction:g} -> {new:g} and restart "
                f"{r.unit} alone; {serving}",
                r,
                Decision.DRY_RUN,
            ),
        )
        return t, actions
    if view.drain_first and not critical and not r.drained:
        verdict(
            MemVerdict.DRAINING,
            (MemVerdict.DRAINING, r.name),
            _log(
                Priority.WARNING,
                MemVerdict.DRAINING,
                f"memory squeezed: {why}; replica {r.name}: draining it at the proxy first, then lowering it "
                f"{r.fraction:g} -> {new:g}; {serving}",
                r,
                Decision.PROXY,
            ),
        )
        actions.append(DrainReplica(r.name, why))
        return t, actions
    undrained = "; not drained (critical)" if view.drain_first and critical else ""
    verdict(
        MemVerdict.LOWER,
        None,
        _log(
            Priority.WARNING,
            MemVerdict.LOWER,
            f"{why}; replica {r.name} {r.fraction:g} -> {new:g}; restarting {r.unit} alone; {serving}{undrained}",
            r,
            Decision.MEMORY,
        ),
    )
    actions.append(LowerFraction(r.name, r.unit, r.fraction, new, restart=True, evidence=why))
    return replace(t, pending=Pending(r.name, r.fraction, new, now), last_change_at=now, last_notice=None), actions
