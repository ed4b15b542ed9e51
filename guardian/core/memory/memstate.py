"""The memory guard's values: what it sees of each replica (ReplicaMemory) and of the box
(MemoryView), the change of fraction it follows (Pending), what one tick hands the next
(MemTrack), the numbers its lines are filled from (Facts), and the 0.01 grid its fractions are
chosen on (choose_fraction, highest_fit). A leaf of the memory guard's modules. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ...config import MemoryConfig
from ..actions import AcquireSlot, DrainReplica, LogLine, SetFraction
from ..observations import MemorySample, RestartOutcome
from ..rules import Refusal, Row
from ..vocab import SERVING_STATES, Decision, MemVerdict, Priority, State

Context = TypeVar("Context")
Evidence = TypeVar("Evidence")


@dataclass(frozen=True)
class Message:
    """How a verdict is said: a str.format template over `replica`, `memory` (the [memory] config)
    and the fields of Facts, where a size takes the GiB spec: {total_bytes:GiB} is "128.0 GiB"."""

    priority: Priority
    template: str
    decision: Decision = Decision.MEMORY_NOTE
    every_time: bool = False  # False: once per squeeze and cause


@dataclass(frozen=True)
class SaidRow(Row[Context, Evidence], Generic[Context, Evidence]):
    """A memory guard's row with its lines: the verdicts it yields (its outcome, and the one it
    turns into under dry_run or a spent budget) and how each is said; one yielding nothing to say
    (M3) is a plain Row."""

    says: Mapping[MemVerdict, Message] = field(default_factory=dict)


@dataclass(frozen=True)
class ReplicaMemory:
    name: str
    unit: str
    model: str
    fraction: float | None  # what it is configured with: guardian's env file, else what it runs with
    running_fraction: float | None  # what it reports: vllm:cache_config_info, else its command line
    started_at: float | None  # its unit's last start (InactiveExitTimestampMonotonic)
    wiring_problem: str | None  # None: wired for the memory guard (core/memory/wiring.py, and M9)
    state: State  # the watchdog's verdict
    usage_bytes: int | None = None  # NVML per-process memory, when the driver reports it
    start_failure: str | None = None  # vLLM's startup error, from the unit's journal since the lowering
    startup_grace_s: float = 1200.0
    drained: bool = False  # marked down at the proxy and drained (core/proxy/drain.py D6, D7)
    base: float | None = None  # its fraction before guardian first lowered it (state file); None: never lowered
    restarts_left: int | None = None  # restarts its budget still allows in the window (A1); None: not counted
    serves: bool | None = None  # watchdog/judge.py serves() (None: not judged by it; then healthy or busy)
    knob: str = "gpu_memory_utilization"  # its engine's fraction, as its flag names it (guardian/engines/)

    @property
    def serving(self) -> bool:
        """It carries its model's load while another replica restarts (the one definition: judge.serves)."""
        return self.serves if self.serves is not None else self.state in SERVING_STATES


@dataclass(frozen=True)
class MemoryView:
    """What the memory guard decides on (built by core/memory/memview.py)."""

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
    return highest_fit_between(start, current, held_bytes, headroom_bytes, total_bytes, memory)


def highest_fit_between(
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


def held_of(replica: ReplicaMemory, total_bytes: int) -> int:
    return replica.usage_bytes if replica.usage_bytes is not None else int(total_bytes * (replica.fraction or 0.0))
