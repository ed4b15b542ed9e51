"""The restore: when the box is not squeezed and memory.restore is on, the replica furthest below
its base (M20) is raised back one step by the rows of RESTORE_ROWS (M21-M26), read in order. Pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ...config import Config, MemoryConfig
from ..observations import gib
from ..rules import Refusal, Row, Rule, first_match
from ..vocab import LOADING_STATES, SERVING_STATES, Decision, Gate, MemVerdict, Priority
from .memsqueeze import serving_peers
from .memstate import Facts, MemoryView, MemTrack, Message, ReplicaMemory, SaidRow, grid_below


@dataclass(frozen=True)
class _Below:
    """Whether a raise is asked for now, and M20's choice, as RAISABLE_ROW reads them."""

    restore: bool  # M.restore
    pending: bool  # a change of fraction is pending
    chosen: tuple[ReplicaMemory, float] | None  # the replica furthest below its base, and its raise (_furthest)


def _chosen(b: _Below) -> tuple[ReplicaMemory, float]:
    assert b.chosen is not None, "the row holds only for a replica chosen"
    return b.chosen


# M20: not a verdict but what the restore rows stand on: which replica a raise is for, and how far
# (its evidence); asked only when the box is not squeezed (M1, memguard.decide()).
RAISABLE_ROW: Row[_Below, tuple[ReplicaMemory, float]] = Row(
    RAISABLE := Rule(
        "M20",
        "raisable",
        "M.restore = true AND not squeezed (M1) AND no change pending AND a replica serves (healthy or busy), is "
        "wired and has a fraction < its base (the fraction it had before guardian first lowered it, kept in the "
        "state file); the chosen: the one furthest below its base (a tie: the first configured); its raise: new = "
        "the highest 0.01 grid fraction <= min(base, current + M.step, a fraction its raise to which failed to "
        "start - 0.01), when > current; the raise line = M.min_headroom_bytes + total x (new - current) + "
        "M.reserve_bytes",
    ),
    lambda b: b.restore and not b.pending and b.chosen is not None,
    _chosen,
)


@dataclass(frozen=True)
class Raise:
    """What the restore rows (M21-M26) read: the replica chosen to be raised (M20), and its gates."""

    memory: MemoryConfig
    chosen: ReplicaMemory
    new: float
    line_bytes: int  # the raise line (M20)
    clear_for_s: float  # headroom at or above the line on every tick, no replica starting, for this long (M21)
    since_change_s: float  # since the last change of fraction: a lowering, a raise, or one given up; inf when none
    peers: tuple[str, ...]  # who else serves its model: this box, M.peer_urls, the fleet
    refusal: Refusal | None  # why admission, its budget's last restart or the fleet would not restart it now
    drain_first: bool  # a proxy is configured
    dry_run: bool


def _raised(r: Raise) -> ReplicaMemory:
    return r.chosen


# M21-M26: when M20 holds, the first row that holds is the verdict; the evidence is the chosen
# replica. M26 with dry_run = true is the RESTORE_DRY_RUN verdict.
RESTORE_ROWS: tuple[Row[Raise, ReplicaMemory], ...] = (
    SaidRow(
        Rule(
            "M21",
            MemVerdict.RESTORE_WAIT,
            "NOT (headroom >= the raise line (M20) on every tick for >= M.restore_after_s, with no replica of this "
            "box starting (state starting: it has not taken its memory yet) and, when M.psi_some_threshold_pct is "
            "set, PSI some avg10 < it on each of them): the hysteresis; a tick that is not clear starts the count "
            "again",
        ),
        lambda r: r.clear_for_s < r.memory.restore_after_s,
        _raised,
        says={
            MemVerdict.RESTORE_WAIT: Message(
                Priority.INFO,
                "replica {replica.name}: {replica.knob} {current:g}, below its base {base:g}; it is raised to {new:g} "
                "once headroom has stayed >= {line_bytes:GiB} (min_headroom {memory.min_headroom_bytes:GiB} + the "
                "raise {raise_bytes:GiB} + reserve {memory.reserve_bytes:GiB}) for {memory.restore_after_s:g} s with "
                "no replica starting; headroom now {headroom_bytes:GiB}",
            )
        },
    ),
    SaidRow(
        Rule(
            "M22",
            MemVerdict.RESTORE_COOLDOWN,
            "now - the last change of fraction (a lowering, a raise, or one given up) < M.restore_cooldown_s",
        ),
        lambda r: r.since_change_s < r.memory.restore_cooldown_s,
        _raised,
        says={
            MemVerdict.RESTORE_COOLDOWN: Message(
                Priority.INFO,
                "replica {replica.name}: {why}; raising it {current:g} -> {new:g} waits for the cooldown: last change "
                "of fraction {since_change_s:.0f} s ago, next allowed after {memory.restore_cooldown_s:g} s",
            )
        },
    ),
    SaidRow(
        Rule(
            "M23",
            MemVerdict.RESTORE_NO_PEER,
            "no other replica of the same model is healthy or busy (on this box, at M.peer_urls, or on another box "
            "in the fleet view when [fleet] is set): a raise is never critical",
        ),
        lambda r: not r.peers,
        _raised,
        says={
            MemVerdict.RESTORE_NO_PEER: Message(
                Priority.ERROR,
                "replica {replica.name}: {why}; not raising it {current:g} -> {new:g} (base {base:g}): no other "
                "replica of {replica.model} is serving to carry its load while it restarts",
            )
        },
    ),
    SaidRow(
        LAST_RESTART := Rule(
            "M24",
            MemVerdict.RESTORE_DEFERRED,
            "restart admission refuses it now (A1-A3: budget, back-off, one at a time), OR the raise would spend "
            "the last restart of its budget (restarts in the window >= W.restart_budget - 1: that one is kept for "
            "a hang), OR it waits for a fleet slot (F3-F6)",
        ),
        lambda r: r.refusal is not None,
        _raised,
        says={
            MemVerdict.RESTORE_DEFERRED: Message(
                Priority.ERROR,
                "replica {replica.name}: {why}; raising it {current:g} -> {new:g} (base {base:g}) deferred: "
                "{refusal.text}",
            )
        },
    ),
    SaidRow(
        Rule(
            "M25",
            MemVerdict.RESTORE_DRAINING,
            "a proxy is configured ([proxy]) AND the chosen replica is not drained yet (core/proxy/drain.py D6, D7): "
            "it is marked down and drained first; the raise waits (with dry_run: not drained)",
        ),
        lambda r: r.drain_first and not r.dry_run and not r.chosen.drained,
        _raised,
        says={
            MemVerdict.RESTORE_DRAINING: Message(
                Priority.WARNING,
                "replica {replica.name}: {why}; draining it at the proxy first, then raising it {current:g} -> {new:g} "
                "(base {base:g}); {serving}",
                Decision.PROXY,
            )
        },
    ),
    SaidRow(
        RAISE := Rule(
            "M26",
            MemVerdict.RAISE,
            "otherwise: write the env file, restart that replica's unit alone through the unit gates (with "
            "dry_run = true: logged, not done)",
        ),
        lambda r: True,
        _raised,
        says={
            MemVerdict.RAISE: Message(
                Priority.WARNING,
                "replica {replica.name}: {why}; raising it {current:g} -> {new:g} (base {base:g}); restarting "
                "{replica.unit} alone; {serving}",
                Decision.MEMORY,
                every_time=True,
            ),
            MemVerdict.RESTORE_DRY_RUN: Message(
                Priority.WARNING,
                "replica {replica.name}: {why}; DRY-RUN: would raise it {current:g} -> {new:g} (base {base:g}) and "
                "restart {replica.unit} alone; {serving}",
                Decision.DRY_RUN,
            ),
        },
    ),
)


# --- raising a fraction back (M20-M26) -------------------------------------------------------


def _raise_to(replica: ReplicaMemory, track: MemTrack, memory: MemoryConfig) -> float | None:
    """M20: the fraction REPLICA would be raised to now; None when it is not raised."""
    base, current = replica.base, replica.fraction
    if base is None or current is None or replica.wiring_problem is not None or replica.state not in SERVING_STATES:
        return None
    ceiling = track.ceilings.get(replica.name)
    new = grid_below(min(base, current + memory.step, math.inf if ceiling is None else ceiling - 0.01))
    return new if new > current + 1e-9 else None


def _raisable(track: MemTrack, view: MemoryView, memory: MemoryConfig) -> tuple[ReplicaMemory, float] | None:
    """M20: the replica to raise and its new fraction; None when none is raised now."""
    chosen = _furthest(track, view, memory) if memory.restore else None
    found = first_match((RAISABLE_ROW,), _Below(memory.restore, track.pending is not None, chosen))
    return found[1] if found is not None else None


def _furthest(track: MemTrack, view: MemoryView, memory: MemoryConfig) -> tuple[ReplicaMemory, float] | None:
    """The replica furthest below its base (a tie: the first configured) and its new fraction."""
    best: tuple[ReplicaMemory, float] | None = None
    for replica in view.replicas:
        new = _raise_to(replica, track, memory)
        if new is not None and (best is None or _below_base(replica) > _below_base(best[0]) + 1e-9):
            best = (replica, new)
    return best


def _below_base(replica: ReplicaMemory) -> float:
    return (replica.base or 0.0) - (replica.fraction or 0.0)


def _raise_bytes(replica: ReplicaMemory, new: float, total_bytes: int) -> int:
    return round(total_bytes * (new - (replica.fraction or 0.0)))


def _raise_line(replica: ReplicaMemory, new: float, total_bytes: int, memory: MemoryConfig) -> int:
    """M20's raise line: after the raise, headroom still clears the squeeze line by the reserve."""
    return memory.min_headroom_bytes + _raise_bytes(replica, new, total_bytes) + memory.reserve_bytes


def count_clear(track: MemTrack, view: MemoryView, now: float, memory: MemoryConfig) -> MemTrack:
    """M21's clock: since when headroom has been at or above the raise line of the same replica's
    raise on every tick, with no change pending, no replica starting (one that has not taken its
    memory yet makes headroom look larger than it is) and PSI under its threshold when one is set."""
    found = _raisable(track, view, memory)
    starting = any(replica.state in LOADING_STATES for replica in view.replicas)
    psi, threshold = view.sample.psi_some_avg10, memory.psi_some_threshold_pct
    pressed = threshold is not None and psi is not None and psi >= threshold
    if (
        found is None
        or starting
        or pressed
        or view.sample.available_bytes < _raise_line(*found, view.total_bytes, memory)
    ):
        return replace(track, clear_since=None, clear_for=None)
    name = found[0].name
    since = track.clear_since if track.clear_for == name and track.clear_since is not None else now
    return replace(track, clear_since=since, clear_for=name)


def restore_chain(
    track: MemTrack, view: MemoryView, now: float, cfg: Config
) -> tuple[MemVerdict, ReplicaMemory, Facts] | None:
    """M21-M26: the first row of RESTORE_ROWS that holds, when M20 finds a replica to raise."""
    found = _raisable(track, view, cfg.memory)
    if found is None:
        return None
    chosen, new = found
    memory = cfg.memory
    last = max((at for at in (track.last_change_at, track.last_raise_at) if at is not None), default=None)
    clear = track.clear_since if track.clear_for == chosen.name else None
    context = Raise(
        memory=memory,
        chosen=chosen,
        new=new,
        line_bytes=_raise_line(chosen, new, view.total_bytes, memory),
        clear_for_s=now - clear if clear is not None else 0.0,
        since_change_s=now - last if last is not None else math.inf,
        peers=serving_peers(chosen, view),
        refusal=_raise_refusal(chosen, view),
        drain_first=view.drain_first,
        dry_run=cfg.dry_run,
    )
    matched = first_match(RESTORE_ROWS, context)
    assert matched is not None, f"{RAISE.id} always holds"
    rule, replica = matched
    verdict = MemVerdict(rule.outcome)
    if verdict is MemVerdict.RAISE and cfg.dry_run:
        verdict = MemVerdict.RESTORE_DRY_RUN
    return verdict, replica, _raise_facts(context, view, verdict)


def _raise_refusal(chosen: ReplicaMemory, view: MemoryView) -> Refusal | None:
    """M24: admission's or the fleet's refusal, or the budget's last restart, which a raise leaves for a hang."""
    found = (view.restart_blocked or {}).get(chosen.name)
    if found is not None or chosen.restarts_left is None or chosen.restarts_left > 1:
        return found
    return Refusal(
        Gate.BUDGET,
        LAST_RESTART.id,
        "it would spend the last restart its budget allows in the window, which is kept for a hang; it waits "
        "until an older restart leaves the window",
        key=(Gate.BUDGET, "last restart"),
    )


def _raise_facts(context: Raise, view: MemoryView, verdict: MemVerdict) -> Facts:
    chosen, headroom = context.chosen, view.sample.available_bytes
    return Facts(
        why=f"headroom {gib(headroom)} >= {gib(context.line_bytes)} for {context.clear_for_s:.0f} s",
        headroom_bytes=headroom,
        total_bytes=view.total_bytes,
        current=chosen.fraction or 0.0,
        new=context.new,
        refusal=context.refusal if verdict is MemVerdict.RESTORE_DEFERRED else None,
        serving=f"{', '.join(context.peers)} serving",
        base=chosen.base or 0.0,
        line_bytes=context.line_bytes,
        raise_bytes=_raise_bytes(chosen, context.new, view.total_bytes),
        clear_for_s=context.clear_for_s,
        since_change_s=context.since_change_s,
    )
