"""When the box is squeezed (M1, M2), and what the memory guard does then: the rows of
SQUEEZE_ROWS (M10-M17), read in order, the first that holds the verdict. M9 (a replica overridden,
so not wired) is a row of this family applied where the view is built (core/memory/memview.py), so that
M11 and M12 see it. Pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ...config import Config, MemoryConfig
from ..observations import MemorySample, gib
from ..rules import Refusal, Row, Rule, first_match
from ..vocab import Decision, Gate, MemVerdict, Priority
from .memstate import Facts, MemoryView, MemTrack, Message, ReplicaMemory, SaidRow, choose_fraction, grid, held_of

# --- the rules ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Clocks:
    """M1's clocks on this tick (count_squeeze keeps them)."""

    below_since: float | None  # headroom below M.min_headroom_bytes on every tick since
    psi_since: float | None  # PSI some avg10 at or above its threshold on every tick since
    now: float
    memory: MemoryConfig

    def lasted(self, since: float | None) -> bool:
        return since is not None and self.now - since >= self.memory.sustain_s


# M1, M2: not verdicts but what the verdicts stand on: when M1 holds the squeeze rows (M10-M17)
# judge, and M2 is what they read as critical (asked only of a squeezed box, in _squeeze()).
SQUEEZED_ROW: Row[Clocks, None] = Row(
    Rule(
        "M1",
        "squeezed",
        "headroom (MemAvailable) < M.min_headroom_bytes on every tick for >= M.sustain_s, AND, "
        "when M.psi_some_threshold_pct is set, PSI some avg10 >= it on every tick for >= M.sustain_s",
    ),
    lambda c: c.lasted(c.below_since) and (c.memory.psi_some_threshold_pct is None or c.lasted(c.psi_since)),
    lambda c: None,
)
CRITICAL_ROW: Row[tuple[int, MemoryConfig], None] = Row(
    Rule("M2", "critical", "squeezed AND headroom < M.critical_headroom_bytes on this tick"),
    lambda h: h[0] < h[1].critical_headroom_bytes,
    lambda h: None,
)


@dataclass(frozen=True)
class Served:
    """A replica as M9 reads it, where the view is built (core/memory/memview.py)."""

    wired: bool  # core/memory/wiring.py found its unit wired
    settled: bool  # no change of its fraction pending, none written that its running start has not read
    serving: bool  # healthy or busy
    configured: float | None  # guardian's env file
    reported: float | None  # what it reports it serves with
    knob: str  # its engine's fraction, as its flag names it


# M9: applied where the view is built, so that M11 and M12 see it; the evidence is its wiring problem.
OVERRIDDEN_ROW: Row[Served, str] = Row(
    OVERRIDDEN := Rule(
        "M9",
        "not wired",
        "a replica with no lowering pending serves (healthy or busy) and reports another fraction than guardian's "
        "env file for it says: something overrides that file (a later EnvironmentFile=, an ExecStart= drop-in); it "
        "counts as not wired. Not while the fraction written is unread: written after its running start began, "
        "its restart given up (M18) or dropped (M19); its next start reads it",
    ),
    lambda v: (
        v.wired
        and v.settled
        and v.serving
        and v.configured is not None
        and v.reported is not None
        and abs(v.configured - v.reported) > 1e-6
    ),
    lambda v: (
        f"it serves with {v.knob} {v.reported:g} while guardian's env file says "
        f"{v.configured:g}: something overrides that file (a later EnvironmentFile= or an ExecStart= drop-in)"
    ),
)


@dataclass(frozen=True)
class Squeeze:
    """What the squeeze chain (M10-M17) reads: the squeeze, and the replica chosen to give."""

    memory: MemoryConfig
    why: str  # the squeeze as its lines say it: M1, M2 and the largest consumers
    critical: bool  # M2
    since_lowering_s: float  # since the last lowering (or one given up); inf when none
    chosen: ReplicaMemory | None  # who gives: the first of M.priority that can, else the one most above the floor
    unwired: ReplicaMemory | None  # the first, in that order, that is not wired
    new: float | None  # the fraction chosen for it; None when none fits
    peers: tuple[str, ...]  # who else serves its model: this box, M.peer_urls, the fleet
    refusal: Refusal | None  # why admission or the fleet would not restart it now
    drained: bool  # it is drained at the proxy
    drain_first: bool  # a proxy is configured
    dry_run: bool
    total_bytes: int

    @property
    def without_slot(self) -> bool:
        """It waits for a fleet slot, and a critical lowering does not."""
        return self.refusal is not None and self.refusal.gate is Gate.FLEET and self.critical


def _chosen(squeeze: Squeeze) -> ReplicaMemory | None:
    return squeeze.chosen


# M10-M17: when squeezed and no lowering is pending, the first row that holds is the verdict; the
# evidence is the replica its line is about. M17 with dry_run = true is the DRY_RUN verdict.
SQUEEZE_ROWS: tuple[Row[Squeeze, ReplicaMemory | None], ...] = (
    SaidRow(
        Rule("M10", MemVerdict.COOLDOWN, "now - last lowering < M.cooldown_s"),
        lambda s: s.since_lowering_s < s.memory.cooldown_s,
        lambda s: None,
        says={
            MemVerdict.COOLDOWN: Message(
                Priority.INFO,
                "memory squeezed: {why}; cooldown: last lowering {since_lowering_s:.0f} s ago, next allowed after "
                "{memory.cooldown_s:g} s",
            )
        },
    ),
    SaidRow(
        Rule(
            "M11",
            MemVerdict.UNWIRED,
            "no replica can give: the one that could is not wired (its unit does not read guardian's env file "
            "last, or does not pass --gpu-memory-utilization ${GPU_MEMORY_UTILIZATION}, or M9)",
        ),
        lambda s: s.chosen is None and s.unwired is not None,
        lambda s: s.unwired,
        says={
            MemVerdict.UNWIRED: Message(
                Priority.ERROR,
                "memory squeezed: {why}; replica {replica.name}: {replica.unit} is not wired for the memory guard, "
                "refusing to restart it (a restart without a lower fraction frees nothing): {replica.wiring_problem}",
            )
        },
    ),
    SaidRow(
        Rule("M12", MemVerdict.FLOOR, "no replica can give: every fraction is unknown or <= M.floor"),
        lambda s: s.chosen is None,
        lambda s: None,
        says={
            MemVerdict.FLOOR: Message(
                Priority.ERROR,
                "memory squeezed: {why}; every replica is at its floor {memory.floor:g} (or its fraction is unknown): "
                "nothing left to give",
            )
        },
    ),
    SaidRow(
        Rule(
            "M13",
            MemVerdict.NO_FIT,
            "for the chosen replica (the first of M.priority that can give, else the most above the "
            "floor) no fraction on the 0.01 grid, <= current - M.step and >= M.floor, has total x fraction <= "
            "headroom + what it holds (NVML, else total x current) - M.reserve_bytes",
        ),
        lambda s: s.new is None,
        _chosen,
        says={
            MemVerdict.NO_FIT: Message(
                Priority.ERROR,
                "memory squeezed: {why}; replica {replica.name}: no fraction between {highest:g} and the floor "
                "{memory.floor:g} fits (total {total_bytes:GiB} x fraction must be <= headroom + what it holds - "
                "reserve {memory.reserve_bytes:GiB}); waiting rather than a start vLLM would refuse",
            )
        },
    ),
    SaidRow(
        Rule(
            "M14",
            MemVerdict.NO_PEER,
            "no other replica of the same model is healthy or busy (on this box, at M.peer_urls, or on another box "
            "in the fleet view when [fleet] is set) AND not critical",
        ),
        lambda s: not s.peers and not s.critical,
        _chosen,
        says={
            MemVerdict.NO_PEER: Message(
                Priority.ERROR,
                "memory squeezed: {why}; replica {replica.name}: no other replica of {replica.model} is serving right "
                "now, deferring the lowering to {new:g} (acts anyway below {memory.critical_headroom_bytes:GiB})",
            )
        },
    ),
    SaidRow(
        Rule(
            "M15",
            MemVerdict.DEFERRED,
            "restart admission refuses it now (A1-A3: budget, back-off, one at a time), or it waits for a fleet "
            "slot (F3-F6; not when critical: then it goes ahead without one, said at error)",
        ),
        lambda s: s.refusal is not None and not s.without_slot,
        _chosen,
        says={
            MemVerdict.DEFERRED: Message(
                Priority.ERROR,
                "memory squeezed: {why}; replica {replica.name}: lowering to {new:g} deferred: {refusal.text}",
            )
        },
    ),
    SaidRow(
        Rule(
            "M16",
            MemVerdict.DRAINING,
            "a proxy is configured ([proxy]) AND not critical AND the chosen replica is not drained yet "
            "(core/proxy/drain.py D6, D7): it is marked down and drained first; the lowering waits (with dry_run: not "
            "drained)",
        ),
        lambda s: s.drain_first and not s.critical and not s.dry_run and not s.drained,
        _chosen,
        says={
            MemVerdict.DRAINING: Message(
                Priority.WARNING,
                "memory squeezed: {why}; replica {replica.name}: draining it at the proxy first, then lowering it "
                "{current:g} -> {new:g}; {serving}",
                Decision.PROXY,
            )
        },
    ),
    SaidRow(
        LOWER := Rule(
            "M17",
            MemVerdict.LOWER,
            "otherwise: write the env file, restart that replica's unit alone through the unit gates "
            "(with dry_run = true: logged, not done)",
        ),
        lambda s: True,
        _chosen,
        says={
            MemVerdict.LOWER: Message(
                Priority.WARNING,
                "{why}; replica {replica.name} {current:g} -> {new:g}; restarting {replica.unit} alone; "
                "{serving}{undrained}",
                Decision.MEMORY,
                every_time=True,
            ),
            MemVerdict.DRY_RUN: Message(
                Priority.WARNING,
                "memory squeezed: {why}; DRY-RUN: would lower replica {replica.name} {current:g} -> {new:g} and "
                "restart {replica.unit} alone; {serving}",
                Decision.DRY_RUN,
            ),
        },
    ),
)
# Said before a critical lowering's own line when it goes ahead without a fleet slot (M15); its rule
# is M17's, whose line follows it.
NO_SLOT_BUT_CRITICAL = Message(
    Priority.ERROR,
    "memory squeezed: {why}; replica {replica.name}: no fleet slot ({no_slot.text}); critical, so the lowering goes "
    "ahead without one",
    Decision.FLEET,
    every_time=True,
)


# The verdicts past M15: a lowering that waits for nothing more (M16 drains first, then lowers).
_GOES_AHEAD = frozenset({MemVerdict.DRAINING, MemVerdict.DRY_RUN, MemVerdict.LOWER})


def count_squeeze(track: MemTrack, sample: MemorySample, now: float, memory: MemoryConfig) -> MemTrack:
    """M1's clocks: since when headroom has been below the line, and PSI at or above its threshold."""
    below = sample.available_bytes < memory.min_headroom_bytes
    psi = sample.psi_some_avg10
    pressed = memory.psi_some_threshold_pct is not None and psi is not None and psi >= memory.psi_some_threshold_pct
    return replace(
        track,
        below_since=(track.below_since if track.below_since is not None else now) if below else None,
        psi_since=(track.psi_since if track.psi_since is not None else now) if pressed else None,
    )


def is_squeezed(track: MemTrack, now: float, memory: MemoryConfig) -> bool:
    """M1."""
    return SQUEEZED_ROW.holds(Clocks(track.below_since, track.psi_since, now, memory))


def squeeze_chain(
    track: MemTrack, view: MemoryView, now: float, cfg: Config
) -> tuple[MemVerdict, ReplicaMemory | None, Facts]:
    """M10-M17: the first row of SQUEEZE_ROWS that holds."""
    squeeze = _squeeze(track, view, now, cfg)
    found = first_match(SQUEEZE_ROWS, squeeze)
    assert found is not None, f"{LOWER.id} always holds"
    rule, replica = found
    verdict = MemVerdict(rule.outcome)
    if verdict is MemVerdict.LOWER and squeeze.dry_run:
        verdict = MemVerdict.DRY_RUN
    chosen = squeeze.chosen
    current = chosen.fraction if chosen is not None and chosen.fraction is not None else 0.0
    facts = Facts(
        why=squeeze.why,
        total_bytes=view.total_bytes,
        current=current,
        highest=grid(current - cfg.memory.step),
        new=squeeze.new or 0.0,
        since_lowering_s=squeeze.since_lowering_s,
        refusal=squeeze.refusal if verdict is MemVerdict.DEFERRED else None,
        no_slot=squeeze.refusal if squeeze.without_slot and verdict in _GOES_AHEAD else None,
        serving=f"{', '.join(squeeze.peers)} serving" if squeeze.peers else "NO other replica serving (critical)",
        undrained="; not drained (critical)" if squeeze.drain_first and squeeze.critical else "",
        critical=squeeze.critical,
    )
    return verdict, replica, facts


def _squeeze(track: MemTrack, view: MemoryView, now: float, cfg: Config) -> Squeeze:
    memory = cfg.memory
    headroom = view.sample.available_bytes
    critical = CRITICAL_ROW.holds((headroom, memory))
    order = _giving_order(view.replicas, memory)
    chosen = next((r for r in order if _can_give(r, memory)), None)
    new = None
    if chosen is not None and chosen.fraction is not None:
        new = choose_fraction(chosen.fraction, held_of(chosen, view.total_bytes), headroom, view.total_bytes, memory)
    below_for_s = now - track.below_since if track.below_since is not None else 0.0
    return Squeeze(
        memory=memory,
        why=_why(view, below_for_s, critical, memory),
        critical=critical,
        since_lowering_s=now - track.last_change_at if track.last_change_at is not None else math.inf,
        chosen=chosen,
        unwired=next((r for r in order if r.wiring_problem is not None), None),
        new=new,
        peers=serving_peers(chosen, view) if chosen is not None else (),
        refusal=(view.restart_blocked or {}).get(chosen.name) if chosen is not None else None,
        drained=chosen is not None and chosen.drained,
        drain_first=view.drain_first,
        dry_run=cfg.dry_run,
        total_bytes=view.total_bytes,
    )


def _why(view: MemoryView, below_for_s: float, critical: bool, memory: MemoryConfig) -> str:
    """The squeeze, as every line about it starts."""
    psi = view.sample.psi_some_avg10
    return (
        f"headroom {gib(view.sample.available_bytes)} < {gib(memory.min_headroom_bytes)} for {below_for_s:.0f} s"
        + (f", PSI some {psi:.1f}%" if psi is not None else "")
        + (f" (CRITICAL: < {gib(memory.critical_headroom_bytes)})" if critical else "")
        + (f" (largest: {view.consumers})" if view.consumers else "")
    )


def _giving_order(replicas: tuple[ReplicaMemory, ...], memory: MemoryConfig) -> list[ReplicaMemory]:
    """M.priority first, then the others, the most above the floor first."""
    by_name = {r.name: r for r in replicas}
    first = [by_name[name] for name in memory.priority if name in by_name]
    rest = sorted(
        (r for r in replicas if r.name not in memory.priority), key=lambda r: -((r.fraction or 0.0) - memory.floor)
    )
    return first + rest


def _can_give(replica: ReplicaMemory, memory: MemoryConfig) -> bool:
    return replica.fraction is not None and replica.fraction > memory.floor + 1e-9 and replica.wiring_problem is None


def serving_peers(chosen: ReplicaMemory, view: MemoryView) -> tuple[str, ...]:
    """Who serves CHOSEN's model while it restarts: this box's replicas, M.peer_urls, other boxes."""
    local = [r.name for r in view.replicas if r.name != chosen.name and r.model == chosen.model and r.serving]
    return (*local, *view.peers_serving.get(chosen.model, ()), *(view.fleet_serving or {}).get(chosen.model, ()))
