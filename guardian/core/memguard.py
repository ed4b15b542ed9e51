"""The memory guard: give co-located work its headroom back. Pure.

``headroom`` is the kernel's MemAvailable. ``total`` is what vLLM's --gpu-memory-utilization
is a fraction of: ``memory.device_total_bytes``, or MemTotal when unset (GB10: one memory).

Rules: RULES below (ids M1-M26), rendered into docs/rules.md. ``M`` = the memory config, times in
seconds, sizes in bytes. M1 and M2 say when the box is squeezed. A pending change of fraction (a
lowering, or a raise) is followed by M3-M8, and a failed start's restart that admission held back
by M18 and M19 (_follow_change). M9 is applied where the view is built (core/memview.py).
Otherwise, when squeezed, the rows of SQUEEZE_ROWS (M10-M17) are checked in order and the first
that holds is the verdict (_squeeze_chain); when not squeezed and memory.restore is on, a replica
below its base (M20) is raised back one step by the rows of RESTORE_ROWS (M21-M26, _restore_chain).

Each verdict's journal line is its row of MESSAGES, filled in from the replica it is about and
its Facts; it is said once per squeeze and cause, or every time when the row says so.

A lowering is confirmed from what the restarted replica reports (vllm:cache_config_info, else
--gpu-memory-utilization on its command line): a replica that serves with another fraction than
the one guardian wrote is overridden by something (a later EnvironmentFile=, an ExecStart= drop-in),
and guardian says so instead of lowering again.

A replica's base is the fraction it had before guardian first lowered it (kept in the state file
by the shell at each lowering: act/state.py). Only a replica with a base is raised, never above
it, one step at a time, and only after headroom has stayed clear of the squeeze line by the raise
and the reserve for M.restore_after_s (> M.sustain_s): after the raise the box is still not
squeezed, so a raise cannot cause the lowering that would undo it.
"""

from __future__ import annotations

import math
import string
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..config import Config, MemoryConfig
from . import fleet
from .actions import AcquireSlot, DrainReplica, LogLine, SetFraction
from .observations import MemorySample, RestartOutcome, gib
from .rules import Refusal, Row, Rule, first_match
from .vocab import LOADING_STATES, SERVING_STATES, Decision, Gate, MemVerdict, Priority, State


@dataclass(frozen=True)
class ReplicaMemory:
    name: str
    unit: str
    model: str
    fraction: float | None  # what it is configured with: guardian's env file, else what it runs with
    running_fraction: float | None  # what it reports: vllm:cache_config_info, else its command line
    started_at: float | None  # its unit's last start (InactiveExitTimestampMonotonic)
    wiring_problem: str | None  # None: wired for the memory guard (core/wiring.py, and M9)
    state: State  # the watchdog's verdict
    usage_bytes: int | None = None  # NVML per-process memory, when the driver reports it
    start_failure: str | None = None  # vLLM's startup error, from the unit's journal since the lowering
    startup_grace_s: float = 1200.0
    drained: bool = False  # marked down at the proxy and drained (core/drain.py D6, D7)
    base: float | None = None  # its fraction before guardian first lowered it (state file); None: never lowered
    restarts_left: int | None = None  # restarts its budget still allows in the window (A1); None: not counted
    serves: bool | None = None  # liveness.serves (None: not judged by it; then healthy or busy)

    @property
    def serving(self) -> bool:
        """It carries its model's load while another replica restarts (the one definition: liveness.serves)."""
        return self.serves if self.serves is not None else self.state in SERVING_STATES


@dataclass(frozen=True)
class MemoryView:
    """What the memory guard decides on (built by core/memview.py)."""

    sample: MemorySample
    total_bytes: int
    replicas: tuple[ReplicaMemory, ...]
    peers_serving: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # model -> peer URLs serving it
    consumers: str = ""  # "db.service 22.1 GiB, make 9.3 GiB"
    restart_blocked: dict[str, Refusal] | None = None  # replica -> why admission would not restart it now
    restart_results: dict[str, RestartOutcome] | None = None  # replica -> a restart job that ended this tick
    drain_first: bool = False  # a proxy is configured: a replica is drained before it is lowered (M16)
    fleet_serving: dict[str, tuple[str, ...]] | None = None  # model -> BOX/NAME serving on other boxes ([fleet])


@dataclass(frozen=True)
class Pending:
    """A change of fraction issued and not confirmed yet (M3-M8): a lowering, or a raise (new > old).
    RESTART_OWED: a failed start's next fraction is written, and its unit's restart waits for
    admission (M18, M19); ISSUED_AT is then when the file was written, until the restart is issued."""

    replica: str
    old: float
    new: float
    issued_at: float
    restart_owed: bool = False
    failure: str = ""  # why the start before it failed (M18, M19)
    critical: bool = False  # a lowering decided under the critical line (M2): its start is S3's, not S10's

    @property
    def raising(self) -> bool:
        return self.new > self.old + 1e-9


@dataclass(frozen=True)
class MemTrack:
    """What the memory guard remembers from tick to tick."""

    below_since: float | None = None  # headroom below M.min_headroom_bytes since (M1)
    psi_since: float | None = None  # PSI at or above M.psi_some_threshold_pct since (M1)
    last_change_at: float | None = None  # the last lowering, or the last one given up (M10's cooldown)
    pending: Pending | None = None
    last_raise_at: float | None = None  # the last raise (M22's cooldown, with last_change_at)
    clear_since: float | None = None  # headroom at or above the raise line on every tick since (M21)
    clear_for: str | None = None  # ... for this replica's raise (another's line starts the count again)
    # replica -> a fraction a raise to which failed to start: it is raised to below it only (M20)
    ceilings: Mapping[str, float] = field(default_factory=dict)
    # replica -> when guardian wrote a fraction that its running start predates (M18 gave up or M19
    # dropped the restart): M9 does not count the difference as an override until its next start
    unread: Mapping[str, float] = field(default_factory=dict)
    last_notice: tuple[str, ...] | None = None  # the cause last said: a line is said once per cause
    verdict: MemVerdict = MemVerdict.NOT_SQUEEZED
    rule: str | None = None


MemAction = LogLine | SetFraction | DrainReplica | AcquireSlot


# --- the rules ------------------------------------------------------------------------------

# M1, M2: when the box is squeezed (_squeezed, _squeeze).
DEFINITIONS = (
    Rule(
        "M1",
        "squeezed",
        "headroom (MemAvailable) < M.min_headroom_bytes on every tick for >= M.sustain_s, AND, "
        "when M.psi_some_threshold_pct is set, PSI some avg10 >= it on every tick for >= M.sustain_s",
    ),
    Rule("M2", "critical", "squeezed AND headroom < M.critical_headroom_bytes on this tick"),
)

# M3-M8: a change of fraction in flight, a lowering or a raise (_follow_change).
LOWERING_RULES = (
    Rule(
        "M3",
        MemVerdict.PENDING,
        "a lowering (or a raise) is pending: issued, and the replica not serving since with a new start",
    ),
    Rule(
        "M4",
        MemVerdict.DONE,
        "the pending replica serves (healthy or busy), was started after the change, and reports "
        "the new fraction (or reports none)",
    ),
    Rule(
        "M5",
        MemVerdict.MISMATCH,
        "the pending replica serves, was started after the change, and reports another "
        "fraction than the one written: something overrides guardian's env file; no further change of it",
    ),
    Rule("M6", MemVerdict.ABANDONED, "the change's restart was refused by a gate or failed"),
    Rule(
        "M7",
        MemVerdict.RETRY,
        "the new start failed (vLLM's refusal in this start's journal, unit failed, or not serving "
        "R.startup_grace_s after the change) AND a lower fraction >= M.floor fits (after a failed raise: the "
        "highest that fits <= the fraction it was raised from): it is written at once, and the unit restarted "
        "unless it is starting by itself (Restart=) or admission refuses (M18)",
    ),
    Rule("M8", MemVerdict.GAVE_UP, "the new start failed AND no lower fraction >= M.floor fits: left to the operator"),
)

# M9: applied when the view is built (core/memview.py), so that M11 and M12 see it.
OVERRIDDEN = Rule(
    "M9",
    "not wired",
    "a replica with no lowering pending serves (healthy or busy) and reports another fraction than guardian's "
    "env file for it says: something overrides that file (a later EnvironmentFile=, an ExecStart= drop-in); it "
    "counts as not wired. Not while the fraction written is unread: written after its running start began, its "
    "restart given up (M18) or dropped (M19); its next start reads it",
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
    Row(
        Rule("M10", MemVerdict.COOLDOWN, "now - last lowering < M.cooldown_s"),
        lambda s: s.since_lowering_s < s.memory.cooldown_s,
        lambda s: None,
    ),
    Row(
        Rule(
            "M11",
            MemVerdict.UNWIRED,
            "no replica can give: the one that could is not wired (its unit does not read guardian's env file "
            "last, or does not pass --gpu-memory-utilization ${GPU_MEMORY_UTILIZATION}, or M9)",
        ),
        lambda s: s.chosen is None and s.unwired is not None,
        lambda s: s.unwired,
    ),
    Row(
        Rule("M12", MemVerdict.FLOOR, "no replica can give: every fraction is unknown or <= M.floor"),
        lambda s: s.chosen is None,
        lambda s: None,
    ),
    Row(
        Rule(
            "M13",
            MemVerdict.NO_FIT,
            "for the chosen replica (the first of M.priority that can give, else the most above the "
            "floor) no fraction on the 0.01 grid, <= current - M.step and >= M.floor, has total x fraction <= "
            "headroom + what it holds (NVML, else total x current) - M.reserve_bytes",
        ),
        lambda s: s.new is None,
        _chosen,
    ),
    Row(
        Rule(
            "M14",
            MemVerdict.NO_PEER,
            "no other replica of the same model is healthy or busy (on this box, at M.peer_urls, or on another box "
            "in the fleet view when [fleet] is set) AND not critical",
        ),
        lambda s: not s.peers and not s.critical,
        _chosen,
    ),
    Row(
        Rule(
            "M15",
            MemVerdict.DEFERRED,
            "restart admission refuses it now (A1-A3: budget, back-off, one at a time), or it waits for a fleet "
            "slot (F3-F6; not when critical: then it goes ahead without one, said at error)",
        ),
        lambda s: s.refusal is not None and not s.without_slot,
        _chosen,
    ),
    Row(
        Rule(
            "M16",
            MemVerdict.DRAINING,
            "a proxy is configured ([proxy]) AND not critical AND the chosen replica is not drained yet "
            "(core/drain.py D6, D7): it is marked down and drained first; the lowering waits (with dry_run: not "
            "drained)",
        ),
        lambda s: s.drain_first and not s.critical and not s.dry_run and not s.drained,
        _chosen,
    ),
    Row(
        LOWER := Rule(
            "M17",
            MemVerdict.LOWER,
            "otherwise: write the env file, restart that replica's unit alone through the unit gates "
            "(with dry_run = true: logged, not done)",
        ),
        lambda s: True,
        _chosen,
    ),
)

# M18, M19: M7's restart through admission (_follow_change).
RETRY_RULES = (
    RETRY_GIVEN_UP := Rule(
        "M18",
        MemVerdict.RETRY_WAITS,
        "M7 holds, its unit is not starting by itself, AND restart admission refuses now: the lower fraction is "
        "written at once (a file write is not a restart); for back-off or one at a time (A2, A3, which end by "
        "themselves) the restart waits, said once per refusal; for the budget (A1: spent, when M7 holds or while "
        "the restart waits) the lowering is given up (critical): the fraction stays written for the unit's next "
        "start, nothing is pending",
    ),
    RETRY_DROPPED := Rule(
        "M19",
        MemVerdict.RETRY_RESTART,
        "a restart that waited (M18), its unit not started since the fraction was written, the replica not "
        "serving (healthy or busy) and not paused, AND admission (A1-A3) lets it through now: the unit is restarted "
        "with that fraction. One that serves (its start finished after all) or is paused: the restart is dropped "
        "and the change concluded (info); the fraction stays written for its next start",
    ),
)

# M20: which replica a raise is for, and how far (_raisable).
RAISABLE = Rule(
    "M20",
    "raisable",
    "M.restore = true AND not squeezed (M1) AND no change pending AND a replica serves (healthy or busy), is wired "
    "and has a fraction < its base (the fraction it had before guardian first lowered it, kept in the state file); "
    "the chosen: the one furthest below its base (a tie: the first configured); its raise: new = the highest 0.01 "
    "grid fraction <= min(base, current + M.step, a fraction its raise to which failed to start - 0.01), when > "
    "current; the raise line = M.min_headroom_bytes + total x (new - current) + M.reserve_bytes",
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
    Row(
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
    ),
    Row(
        Rule(
            "M22",
            MemVerdict.RESTORE_COOLDOWN,
            "now - the last change of fraction (a lowering, a raise, or one given up) < M.restore_cooldown_s",
        ),
        lambda r: r.since_change_s < r.memory.restore_cooldown_s,
        _raised,
    ),
    Row(
        Rule(
            "M23",
            MemVerdict.RESTORE_NO_PEER,
            "no other replica of the same model is healthy or busy (on this box, at M.peer_urls, or on another box "
            "in the fleet view when [fleet] is set): a raise is never critical",
        ),
        lambda r: not r.peers,
        _raised,
    ),
    Row(
        LAST_RESTART := Rule(
            "M24",
            MemVerdict.RESTORE_DEFERRED,
            "restart admission refuses it now (A1-A3: budget, back-off, one at a time), OR the raise would spend "
            "the last restart of its budget (restarts in the window >= W.restart_budget - 1: that one is kept for "
            "a hang), OR it waits for a fleet slot (F3-F6)",
        ),
        lambda r: r.refusal is not None,
        _raised,
    ),
    Row(
        Rule(
            "M25",
            MemVerdict.RESTORE_DRAINING,
            "a proxy is configured ([proxy]) AND the chosen replica is not drained yet (core/drain.py D6, D7): it "
            "is marked down and drained first; the raise waits (with dry_run: not drained)",
        ),
        lambda r: r.drain_first and not r.dry_run and not r.chosen.drained,
        _raised,
    ),
    Row(
        RAISE := Rule(
            "M26",
            MemVerdict.RAISE,
            "otherwise: write the env file, restart that replica's unit alone through the unit gates (with "
            "dry_run = true: logged, not done)",
        ),
        lambda r: True,
        _raised,
    ),
)

RULES: tuple[Rule, ...] = (
    *DEFINITIONS,
    *LOWERING_RULES,
    OVERRIDDEN,
    *(row.rule for row in SQUEEZE_ROWS),
    *RETRY_RULES,
    RAISABLE,
    *(row.rule for row in RESTORE_ROWS),
)
_ID = {rule.outcome: rule.id for rule in RULES} | {
    MemVerdict.DRY_RUN: LOWER.id,
    MemVerdict.RESTORE_DRY_RUN: RAISE.id,
    MemVerdict.RETRY_GIVEN_UP: RETRY_GIVEN_UP.id,
    MemVerdict.RETRY_DROPPED: RETRY_DROPPED.id,
}
# The verdicts past M15: a lowering that waits for nothing more (M16 drains first, then lowers).
_GOES_AHEAD = frozenset({MemVerdict.DRAINING, MemVerdict.DRY_RUN, MemVerdict.LOWER})
# What M18 heeds: admission's own rows (A1-A3). A failed start's unit is down already, so a
# fleet slot (F3-F6, for a planned restart of a serving replica) does not hold it back. It waits
# out back-off and one at a time (A2, A3), which end by themselves; a spent budget (A1) can last
# W.restart_window_s, and a change pending that long would hold the memory guard (and the start
# guard's stops) for every replica: the lowering is given up instead.
_ADMISSION_GATES = frozenset({Gate.BUDGET, Gate.BACKOFF, Gate.ONE_AT_A_TIME})


# --- what each verdict says -------------------------------------------------------------------


@dataclass(frozen=True)
class Facts:
    """The numbers a verdict's line needs besides its replica; each line reads the ones it names."""

    why: str = ""  # the squeeze: headroom, for how long, PSI, critical, the largest consumers; or the clear headroom
    headroom_bytes: int = 0
    total_bytes: int = 0
    written: float = 0.0  # the fraction of the change followed (M4-M8, M18, M19)
    change: str = "lowering"  # the change followed: "lowering" or "raise" (M4-M6)
    current: float = 0.0  # the chosen replica's fraction now (M13, M16, M17, M21-M26)
    highest: float = 0.0  # the highest fraction a lowering may write: current - M.step (M13)
    new: float = 0.0  # the fraction to write (M7, M14-M19, M21-M26)
    since_lowering_s: float = 0.0  # since the change followed (M4), or the last lowering (M10)
    failure: str = ""  # why the change failed: its restart's result (M6), or the new start (M7, M8, M18, M19)
    not_again: str = ""  # after a failed raise: that it is not tried again (M7, M8, M18)
    refusal: Refusal | None = None  # why the lowering (M15), the restart (M18) or the raise (M24) waits
    dropped: str = ""  # why the restart that waited is dropped: the replica serves, or is paused (M19)
    base: float = 0.0  # the chosen replica's base (M21-M26)
    line_bytes: int = 0  # the raise line (M20)
    raise_bytes: int = 0  # total x (new - current) (M21)
    clear_for_s: float = 0.0  # how long headroom has been clear of the raise line (M22-M26)
    since_change_s: float = 0.0  # since the last change of fraction (M22)
    no_slot: Refusal | None = None  # the fleet's refusal that a critical lowering goes ahead without
    serving: str = ""  # who carries the model meanwhile (M16, M17)
    undrained: str = ""  # "; not drained (critical)" under a proxy (M17)
    critical: bool = False  # the squeeze is critical (M2)


@dataclass(frozen=True)
class Message:
    """How a verdict is said: a str.format template over `replica`, `memory` (the [memory] config)
    and the fields of Facts, where a size takes the GiB spec: {total_bytes:GiB} is "128.0 GiB"."""

    priority: Priority
    template: str
    decision: Decision = Decision.MEMORY_NOTE
    every_time: bool = False  # False: once per squeeze and cause


MESSAGES: dict[MemVerdict, Message] = {
    MemVerdict.DONE: Message(
        Priority.INFO,
        "replica {replica.name}: serving again with gpu_memory_utilization {written:g} {since_lowering_s:.0f} s "
        "after the {change}; headroom {headroom_bytes:GiB}",
        every_time=True,
    ),
    MemVerdict.MISMATCH: Message(
        Priority.ERROR,
        "replica {replica.name}: serving again, but with gpu_memory_utilization {replica.running_fraction:g}, "
        "not the {written:g} guardian wrote: something overrides guardian's env file (a later EnvironmentFile= "
        "that sets GPU_MEMORY_UTILIZATION, or an ExecStart= drop-in); not changing its fraction again until that "
        "is fixed (guardian check; systemctl cat {replica.unit})",
        every_time=True,
    ),
    MemVerdict.ABANDONED: Message(
        Priority.ERROR, "replica {replica.name}: {change} to {written:g} abandoned: {failure}", every_time=True
    ),
    MemVerdict.RETRY: Message(
        Priority.ERROR,
        "replica {replica.name}: start with gpu_memory_utilization {written:g} failed ({failure}); trying "
        "{new:g}{not_again}",
        every_time=True,
    ),
    MemVerdict.GAVE_UP: Message(
        Priority.ERROR,
        "replica {replica.name}: start with gpu_memory_utilization {written:g} failed ({failure}); no lower "
        "fraction >= floor {memory.floor:g} fits in headroom {headroom_bytes:GiB}; leaving it to the operator "
        "(journalctl -u {replica.unit}){not_again}",
        every_time=True,
    ),
    MemVerdict.RETRY_WAITS: Message(
        Priority.ERROR,
        "replica {replica.name}: start with gpu_memory_utilization {written:g} failed ({failure}); {new:g} is "
        "written to its env file, but restarting {replica.unit} waits: {refusal.text}{not_again}",
    ),
    MemVerdict.RETRY_GIVEN_UP: Message(
        Priority.CRITICAL,
        "replica {replica.name}: start with gpu_memory_utilization {written:g} failed ({failure}); {new:g} is "
        "written to its env file, but restarting {replica.unit} is refused: {refusal.text}; giving up on the "
        "lowering: the unit's next start reads {new:g} (journalctl -u {replica.unit}; systemctl restart "
        "{replica.unit}){not_again}",
        every_time=True,
    ),
    MemVerdict.RETRY_DROPPED: Message(
        Priority.INFO,
        "replica {replica.name}: {dropped}; the restart owed to it with gpu_memory_utilization {new:g} (written "
        "after its start with {written:g} was judged failed: {failure}) is dropped and the lowering concluded: "
        "{new:g} stays in its env file and is read at its next start",
        every_time=True,
    ),
    MemVerdict.RETRY_RESTART: Message(
        Priority.WARNING,
        "replica {replica.name}: restarting {replica.unit} with gpu_memory_utilization {new:g}, written after its "
        "start with {written:g} failed ({failure}): admission lets it through now",
        Decision.MEMORY,
        every_time=True,
    ),
    MemVerdict.COOLDOWN: Message(
        Priority.INFO,
        "memory squeezed: {why}; cooldown: last lowering {since_lowering_s:.0f} s ago, next allowed after "
        "{memory.cooldown_s:g} s",
    ),
    MemVerdict.UNWIRED: Message(
        Priority.ERROR,
        "memory squeezed: {why}; replica {replica.name}: {replica.unit} is not wired for the memory guard, "
        "refusing to restart it (a restart without a lower fraction frees nothing): {replica.wiring_problem}",
    ),
    MemVerdict.FLOOR: Message(
        Priority.ERROR,
        "memory squeezed: {why}; every replica is at its floor {memory.floor:g} (or its fraction is unknown): "
        "nothing left to give",
    ),
    MemVerdict.NO_FIT: Message(
        Priority.ERROR,
        "memory squeezed: {why}; replica {replica.name}: no fraction between {highest:g} and the floor "
        "{memory.floor:g} fits (total {total_bytes:GiB} x fraction must be <= headroom + what it holds - reserve "
        "{memory.reserve_bytes:GiB}); waiting rather than a start vLLM would refuse",
    ),
    MemVerdict.NO_PEER: Message(
        Priority.ERROR,
        "memory squeezed: {why}; replica {replica.name}: no other replica of {replica.model} is serving right now, "
        "deferring the lowering to {new:g} (acts anyway below {memory.critical_headroom_bytes:GiB})",
    ),
    MemVerdict.DEFERRED: Message(
        Priority.ERROR, "memory squeezed: {why}; replica {replica.name}: lowering to {new:g} deferred: {refusal.text}"
    ),
    MemVerdict.DRY_RUN: Message(
        Priority.WARNING,
        "memory squeezed: {why}; DRY-RUN: would lower replica {replica.name} {current:g} -> {new:g} and restart "
        "{replica.unit} alone; {serving}",
        Decision.DRY_RUN,
    ),
    MemVerdict.DRAINING: Message(
        Priority.WARNING,
        "memory squeezed: {why}; replica {replica.name}: draining it at the proxy first, then lowering it "
        "{current:g} -> {new:g}; {serving}",
        Decision.PROXY,
    ),
    MemVerdict.LOWER: Message(
        Priority.WARNING,
        "{why}; replica {replica.name} {current:g} -> {new:g}; restarting {replica.unit} alone; {serving}{undrained}",
        Decision.MEMORY,
        every_time=True,
    ),
}
# The raise's lines (M21-M26): "headroom 20.0 GiB >= 14.1 GiB for 600 s" is their {why}.
MESSAGES |= {
    MemVerdict.RESTORE_WAIT: Message(
        Priority.INFO,
        "replica {replica.name}: gpu_memory_utilization {current:g}, below its base {base:g}; it is raised to "
        "{new:g} once headroom has stayed >= {line_bytes:GiB} (min_headroom {memory.min_headroom_bytes:GiB} + the "
        "raise {raise_bytes:GiB} + reserve {memory.reserve_bytes:GiB}) for {memory.restore_after_s:g} s with no "
        "replica starting; headroom now {headroom_bytes:GiB}",
    ),
    MemVerdict.RESTORE_COOLDOWN: Message(
        Priority.INFO,
        "replica {replica.name}: {why}; raising it {current:g} -> {new:g} waits for the cooldown: last change of "
        "fraction {since_change_s:.0f} s ago, next allowed after {memory.restore_cooldown_s:g} s",
    ),
    MemVerdict.RESTORE_NO_PEER: Message(
        Priority.ERROR,
        "replica {replica.name}: {why}; not raising it {current:g} -> {new:g} (base {base:g}): no other replica of "
        "{replica.model} is serving to carry its load while it restarts",
    ),
    MemVerdict.RESTORE_DEFERRED: Message(
        Priority.ERROR,
        "replica {replica.name}: {why}; raising it {current:g} -> {new:g} (base {base:g}) deferred: {refusal.text}",
    ),
    MemVerdict.RESTORE_DRY_RUN: Message(
        Priority.WARNING,
        "replica {replica.name}: {why}; DRY-RUN: would raise it {current:g} -> {new:g} (base {base:g}) and restart "
        "{replica.unit} alone; {serving}",
        Decision.DRY_RUN,
    ),
    MemVerdict.RESTORE_DRAINING: Message(
        Priority.WARNING,
        "replica {replica.name}: {why}; draining it at the proxy first, then raising it {current:g} -> {new:g} "
        "(base {base:g}); {serving}",
        Decision.PROXY,
    ),
    MemVerdict.RAISE: Message(
        Priority.WARNING,
        "replica {replica.name}: {why}; raising it {current:g} -> {new:g} (base {base:g}); restarting "
        "{replica.unit} alone; {serving}",
        Decision.MEMORY,
        every_time=True,
    ),
}
# Said before a critical lowering's own line when it goes ahead without a fleet slot (M15).
NO_SLOT_BUT_CRITICAL = Message(
    Priority.ERROR,
    "memory squeezed: {why}; replica {replica.name}: no fleet slot ({no_slot.text}); critical, so the lowering goes "
    "ahead without one",
    Decision.FLEET,
    every_time=True,
)


class _Text(string.Formatter):
    """str.format, plus the GiB spec for sizes in bytes."""

    def format_field(self, value: Any, format_spec: str) -> Any:
        return gib(value) if format_spec == "GiB" else super().format_field(value, format_spec)


_TEXT = _Text()


def _line(message: Message, verdict: MemVerdict, replica: ReplicaMemory | None, facts: Facts, cfg: Config) -> LogLine:
    text = _TEXT.vformat(message.template, (), {"replica": replica, "memory": cfg.memory, **vars(facts)})
    name, unit = (replica.name, replica.unit) if replica is not None else (None, None)
    return LogLine(message.priority, text, message.decision, name, unit, rule=_ID[verdict])


# --- the decision -----------------------------------------------------------------------------


def grid(x: float) -> float:
    return round(x + 1e-9, 2)


def grid_below(x: float) -> float:
    """The highest 0.01 grid fraction <= X (a raise never goes above its base)."""
    return math.floor(x * 100 + 1e-6) / 100


def choose_fraction(
    current: float, held_bytes: int, headroom_bytes: int, total_bytes: int, memory: MemoryConfig
) -> float | None:
    """The highest grid fraction <= current - M.step and >= M.floor that fits (M13); None if none does."""
    start = grid(max(memory.floor, current - memory.step))
    return _highest_fit(start, current, held_bytes, headroom_bytes, total_bytes, memory)


def _highest_fit(
    start: float, below: float, held_bytes: int, headroom_bytes: int, total_bytes: int, memory: MemoryConfig
) -> float | None:
    """The highest grid fraction <= START, < BELOW and >= M.floor whose total x fraction fits in headroom +
    what the replica holds - M.reserve_bytes; None if none does."""
    available = headroom_bytes + held_bytes - memory.reserve_bytes
    return highest_fit(start, below, available, total_bytes, memory.floor)


def highest_fit(start: float, below: float, available_bytes: int, total_bytes: int, floor: float) -> float | None:
    """The highest 0.01 grid fraction <= START, < BELOW and >= FLOOR whose total x fraction <=
    AVAILABLE_BYTES; None if none does (the memory guard's M13, M7, and a start lowered to fit, U6)."""
    fraction = start
    while fraction >= floor - 1e-9 and fraction < below - 1e-9:
        if total_bytes * fraction <= available_bytes:
            return fraction
        fraction = grid(fraction - 0.01)
    return None


def _held(replica: ReplicaMemory, total_bytes: int) -> int:
    return replica.usage_bytes if replica.usage_bytes is not None else int(total_bytes * (replica.fraction or 0.0))


def decide(track: MemTrack, view: MemoryView, now: float, cfg: Config) -> tuple[MemTrack, list[MemAction]]:
    """The memory guard's tick: the verdict, in TRACK, and what it says and does."""
    track = _count_squeeze(_read_since(track, view), view.sample, now, cfg.memory)
    track = _count_clear(track, view, now, cfg.memory)
    if track.pending is not None:
        followed = _follow_change(track.pending, view, now, cfg.memory)
        if followed is None:  # the replica has left the config: nothing left to follow
            return replace(track, pending=None), []
        return _conclude(track, *followed, now, cfg)
    if _squeezed(track, now, cfg.memory):
        return _conclude(track, *_squeeze_chain(track, view, now, cfg), now, cfg)
    raising = _restore_chain(track, view, now, cfg)
    if raising is None:
        return replace(track, last_notice=None, verdict=MemVerdict.NOT_SQUEEZED, rule=None), []
    return _conclude(track, *raising, now, cfg)


def _read_since(track: MemTrack, view: MemoryView) -> MemTrack:
    """Forget a fraction written as unread (M9) once its replica has started since, or left the config."""
    configured = {r.name: r for r in view.replicas}
    unread = {n: at for n, at in track.unread.items() if n in configured and not_read(configured[n].started_at, at)}
    return track if unread == track.unread else replace(track, unread=unread)


def weights_changed(track: MemTrack, replica: str) -> MemTrack:
    """W2 (core/weights.py): what the memory guard learned of REPLICA's old weights is dropped: the
    fraction a raise failed to start at (M20) was that model's size, not the new one's."""
    if replica not in track.ceilings:
        return track
    return replace(track, ceilings={n: c for n, c in track.ceilings.items() if n != replica})


def fraction_settled(track: MemTrack, replica: str) -> bool:
    """No change of REPLICA's fraction in flight: none pending, none written and unread (M9)."""
    return (track.pending is None or track.pending.replica != replica) and replica not in track.unread


def not_read(started_at: float | None, written_at: float) -> bool:
    """A start at STARTED_AT (None: not known) has not read a fraction written at WRITTEN_AT (M9)."""
    return started_at is None or started_at < written_at


def _count_squeeze(track: MemTrack, sample: MemorySample, now: float, memory: MemoryConfig) -> MemTrack:
    """M1's clocks: since when headroom has been below the line, and PSI at or above its threshold."""
    below = sample.available_bytes < memory.min_headroom_bytes
    psi = sample.psi_some_avg10
    pressed = memory.psi_some_threshold_pct is not None and psi is not None and psi >= memory.psi_some_threshold_pct
    return replace(
        track,
        below_since=(track.below_since if track.below_since is not None else now) if below else None,
        psi_since=(track.psi_since if track.psi_since is not None else now) if pressed else None,
    )


def _squeezed(track: MemTrack, now: float, memory: MemoryConfig) -> bool:
    """M1."""

    def lasted(since: float | None) -> bool:
        return since is not None and now - since >= memory.sustain_s

    return lasted(track.below_since) and (memory.psi_some_threshold_pct is None or lasted(track.psi_since))


def _follow_change(
    pending: Pending, view: MemoryView, now: float, memory: MemoryConfig
) -> tuple[MemVerdict, ReplicaMemory, Facts] | None:
    """M3-M8, M18, M19 for the change in flight; None when its replica is no longer configured."""
    replica = next((r for r in view.replicas if r.name == pending.replica), None)
    if replica is None:
        return None
    headroom = view.sample.available_bytes
    facts = Facts(
        written=pending.new,
        change="raise" if pending.raising else "lowering",
        since_lowering_s=now - pending.issued_at,
        headroom_bytes=headroom,
    )
    outcome = (view.restart_results or {}).get(pending.replica)
    if outcome is not None and not outcome.issued:
        return MemVerdict.ABANDONED, replica, replace(facts, failure=outcome.result)
    restarted = replica.started_at is not None and replica.started_at >= pending.issued_at
    if replica.state in SERVING_STATES and restarted:
        running = replica.running_fraction
        overridden = running is not None and abs(running - pending.new) > 1e-6
        return (MemVerdict.MISMATCH if overridden else MemVerdict.DONE), replica, facts
    if pending.restart_owed and not restarted:  # M18 held its restart back, and nobody has started it since
        return _owed(pending, replica, view, facts)
    failure = _start_failure(replica, facts.since_lowering_s)
    if failure is None:
        return MemVerdict.PENDING, replica, facts
    return _retry(pending, replica, view, replace(facts, failure=failure), memory)


def _retry(
    pending: Pending, replica: ReplicaMemory, view: MemoryView, facts: Facts, memory: MemoryConfig
) -> tuple[MemVerdict, ReplicaMemory, Facts]:
    """M7, M8, M18: the new start failed. After a failed raise the retry goes back toward the
    fraction it was raised from (never above it), and that raise is not tried again."""
    held, headroom, total = _held(replica, view.total_bytes), view.sample.available_bytes, view.total_bytes
    if pending.raising:
        lower = _highest_fit(grid_below(pending.old), pending.new, held, headroom, total, memory)
        facts = replace(facts, not_again=f"; it is not raised to {pending.new:g} again while guardian runs")
    else:
        lower = choose_fraction(pending.new, held, headroom, total, memory)
    if lower is None:
        return MemVerdict.GAVE_UP, replica, facts
    facts = replace(facts, new=lower)
    # systemd restarts a unit still starting by itself (Restart=): only the file is written, no restart to admit
    refusal = _admission_refusal(replica, view) if replica.state is not State.STARTING else None
    if refusal is not None:
        return _waits_or_gives_up(refusal), replica, replace(facts, refusal=refusal)
    return MemVerdict.RETRY, replica, facts


def _owed(
    pending: Pending, replica: ReplicaMemory, view: MemoryView, facts: Facts
) -> tuple[MemVerdict, ReplicaMemory, Facts]:
    """M18, M19: the restart M18 held back, its unit not started since the fraction was written."""
    facts = replace(facts, written=pending.old, new=pending.new, failure=pending.failure)
    dropped = _why_dropped(replica)
    if dropped is not None:
        return MemVerdict.RETRY_DROPPED, replica, replace(facts, dropped=dropped)
    refusal = _admission_refusal(replica, view)
    if refusal is not None:
        return _waits_or_gives_up(refusal), replica, replace(facts, refusal=refusal)
    return MemVerdict.RETRY_RESTART, replica, facts


def _why_dropped(replica: ReplicaMemory) -> str | None:
    """M19: why a restart that waited is not issued at all; None when it still is."""
    if replica.state is State.PAUSED:  # the operator's: guardian restarts nothing of it
        return "it is paused by the operator (guardian pause)"
    if replica.state in SERVING_STATES:  # the start judged failed finished after all: nothing to restart
        running = replica.running_fraction
        with_what = f"gpu_memory_utilization {running:g}" if running is not None else "the fraction it started with"
        return f"it serves again with {with_what}, from its start before the fraction was written"
    return None


def _waits_or_gives_up(refusal: Refusal) -> MemVerdict:
    """M18: back-off and one at a time end by themselves; a spent budget may last the window."""
    return MemVerdict.RETRY_GIVEN_UP if refusal.gate is Gate.BUDGET else MemVerdict.RETRY_WAITS


def _admission_refusal(replica: ReplicaMemory, view: MemoryView) -> Refusal | None:
    """Why admission (A1-A3) would not restart REPLICA now; a fleet slot is not asked for (M18)."""
    found = (view.restart_blocked or {}).get(replica.name)
    return found if found is not None and found.gate in _ADMISSION_GATES else None


def _start_failure(replica: ReplicaMemory, since_lowering_s: float) -> str | None:
    """Why the start after a lowering failed (M7, M8), by facts only; None while it may still succeed."""
    if replica.start_failure:
        return replica.start_failure
    if replica.state is State.STOPPED:
        return "unit failed"
    if since_lowering_s >= replica.startup_grace_s:
        return f"not serving {since_lowering_s:.0f} s after the restart (grace {replica.startup_grace_s:g} s)"
    return None


def _squeeze_chain(
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
    critical = headroom < memory.critical_headroom_bytes
    order = _giving_order(view.replicas, memory)
    chosen = next((r for r in order if _can_give(r, memory)), None)
    new = None
    if chosen is not None and chosen.fraction is not None:
        new = choose_fraction(chosen.fraction, _held(chosen, view.total_bytes), headroom, view.total_bytes, memory)
    below_for_s = now - track.below_since if track.below_since is not None else 0.0
    return Squeeze(
        memory=memory,
        why=_why(view, below_for_s, critical, memory),
        critical=critical,
        since_lowering_s=now - track.last_change_at if track.last_change_at is not None else math.inf,
        chosen=chosen,
        unwired=next((r for r in order if r.wiring_problem is not None), None),
        new=new,
        peers=_peers(chosen, view) if chosen is not None else (),
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


def _peers(chosen: ReplicaMemory, view: MemoryView) -> tuple[str, ...]:
    """Who serves CHOSEN's model while it restarts: this box's replicas, M.peer_urls, other boxes."""
    local = [r.name for r in view.replicas if r.name != chosen.name and r.model == chosen.model and r.serving]
    return (*local, *view.peers_serving.get(chosen.model, ()), *(view.fleet_serving or {}).get(chosen.model, ()))


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
    """M20: the replica furthest below its base (a tie: the first configured) and its new fraction."""
    if not memory.restore:
        return None
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


def _count_clear(track: MemTrack, view: MemoryView, now: float, memory: MemoryConfig) -> MemTrack:
    """M21's clock: since when headroom has been at or above the raise line of the same replica's
    raise on every tick, with no change pending, no replica starting (one that has not taken its
    memory yet makes headroom look larger than it is) and PSI under its threshold when one is set."""
    found = _raisable(track, view, memory) if track.pending is None else None
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


def _restore_chain(
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
        peers=_peers(chosen, view),
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


# --- the verdict's effects --------------------------------------------------------------------


def _conclude(
    track: MemTrack, verdict: MemVerdict, replica: ReplicaMemory | None, facts: Facts, now: float, cfg: Config
) -> tuple[MemTrack, list[MemAction]]:
    """The verdict's effects: its line (once per cause, unless said every time), what it asks
    for, and the track it leaves."""
    previous = track.pending
    track = replace(track, verdict=verdict, rule=_ID[verdict])
    actions: list[MemAction] = []
    if facts.refusal is not None and facts.refusal.gate is Gate.FLEET and facts.refusal.rule == fleet.ASK_SLOT.id:
        assert replica is not None
        actions.append(AcquireSlot(replica.name, replica.model))
    if facts.no_slot is not None:
        actions.append(_line(NO_SLOT_BUT_CRITICAL, MemVerdict.LOWER, replica, facts, cfg))
    message = MESSAGES.get(verdict)
    if message is not None:
        cause = None if message.every_time else _cause(verdict, replica, facts)
        if cause is None or track.last_notice != cause:
            actions.append(_line(message, verdict, replica, facts, cfg))
            track = replace(track, last_notice=cause)
    track = _settle(track, verdict, now)
    if verdict in (MemVerdict.DRAINING, MemVerdict.RESTORE_DRAINING) and replica is not None:
        actions.append(DrainReplica(replica.name, facts.why))
    change = _change(verdict, replica, facts, previous)
    if change is not None:
        actions.append(change)
        track = _issued(track, verdict, change, facts, now)
    return track, actions


def _raise_failed(track: MemTrack) -> MemTrack:
    """The pending change is a raise whose start failed: its fraction becomes the replica's ceiling,
    and M20 does not raise it there again while guardian runs."""
    pending = track.pending
    if pending is None or not pending.raising:
        return track
    return replace(track, ceilings={**track.ceilings, pending.replica: pending.new})


def start_stopped(track: MemTrack, stop: SetFraction, now: float) -> MemTrack:
    """The track once the start guard stopped a start (S10): STOP becomes the pending change,
    followed as a lowering (M3-M8). When the start stopped is the pending raise's own, that raise
    failed as a failed start fails it (_settle)."""
    pending = track.pending
    if pending is not None and pending.replica == stop.replica and abs(pending.new - stop.old) < 1e-9:
        track = _raise_failed(track)
    return replace(track, pending=Pending(stop.replica, stop.old, stop.new, now), last_change_at=now)


def _settle(track: MemTrack, verdict: MemVerdict, now: float) -> MemTrack:
    """The pending change that this verdict ends; a raise whose start failed becomes a ceiling."""
    if verdict in _START_FAILED:
        track = _raise_failed(track)
    pending = track.pending
    if verdict in (MemVerdict.DONE, MemVerdict.ABANDONED):
        track = replace(track, pending=None)
    elif verdict in (MemVerdict.MISMATCH, MemVerdict.GAVE_UP):
        track = replace(track, pending=None, last_change_at=now)
    elif pending is not None and verdict in (MemVerdict.RETRY_GIVEN_UP, MemVerdict.RETRY_DROPPED):
        # the fraction stays written, unread by the running start (M9 waits for its next start)
        written_at = pending.issued_at if pending.restart_owed else now
        track = replace(track, pending=None, unread={**track.unread, pending.replica: written_at})
    return track


_START_FAILED = frozenset({MemVerdict.RETRY, MemVerdict.RETRY_WAITS, MemVerdict.RETRY_GIVEN_UP, MemVerdict.GAVE_UP})


def _cause(verdict: MemVerdict, replica: ReplicaMemory | None, facts: Facts) -> tuple[str, ...]:
    """What makes a line new: its verdict, its replica, and the refusal's own key (M15)."""
    about = (replica.name,) if replica is not None else ()
    return (verdict, *about, *(facts.refusal.key if facts.refusal is not None else ()))


def _change(
    verdict: MemVerdict, replica: ReplicaMemory | None, facts: Facts, pending: Pending | None
) -> SetFraction | None:
    """The env file to write and the restart: a lowering (M17), a raise (M26), or the next fraction
    after a failed start (M7), written at once with its restart held back (M18) and issued later (M19)."""
    if replica is None:
        return None
    name, unit = replica.name, replica.unit
    if verdict in (MemVerdict.LOWER, MemVerdict.RAISE):
        return SetFraction(name, unit, facts.current, facts.new, restart=True, evidence=facts.why)
    evidence = f"start with {facts.written:g} failed: {facts.failure}"
    if verdict is MemVerdict.RETRY:
        # systemd restarts a unit still starting by itself (Restart=): only the file is written
        restart = replica.state is not State.STARTING
        return SetFraction(name, unit, facts.written, facts.new, restart=restart, evidence=evidence, retry=True)
    held_back = verdict in (MemVerdict.RETRY_WAITS, MemVerdict.RETRY_GIVEN_UP)
    if held_back and not (pending is not None and pending.restart_owed):
        return SetFraction(name, unit, facts.written, facts.new, restart=False, evidence=evidence, retry=True)
    if verdict is MemVerdict.RETRY_RESTART:
        return SetFraction(name, unit, facts.written, facts.new, restart=True, evidence=evidence, retry=True)
    return None


def _issued(track: MemTrack, verdict: MemVerdict, change: SetFraction, facts: Facts, now: float) -> MemTrack:
    """The pending change CHANGE leaves, and the clocks of the cooldowns (M10, M22)."""
    if verdict is MemVerdict.RETRY_RESTART and track.pending is not None:
        return replace(track, pending=replace(track.pending, issued_at=now, restart_owed=False))
    if verdict is MemVerdict.RETRY_GIVEN_UP:  # the file only, nothing left pending (M18)
        return replace(track, last_change_at=now)
    owed = verdict is MemVerdict.RETRY_WAITS
    failure = facts.failure if owed else ""  # what M19 will say when the restart is issued
    critical = facts.critical and verdict is MemVerdict.LOWER
    pending = Pending(change.replica, change.old, change.new, now, owed, failure, critical)
    if verdict is MemVerdict.RAISE:
        return replace(track, pending=pending, last_raise_at=now)
    return replace(track, pending=pending, last_change_at=now)
