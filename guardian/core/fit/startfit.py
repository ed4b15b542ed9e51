"""A start that fits: before every start guardian causes, its need against what the device will see
as free, and the page cache released first where that makes it fit. Pure.

Why: on a unified-memory box (GB10) vLLM's first check at start compares the device's free memory
(cudaMemGetInfo: there about the kernel's MemFree, the page cache NOT counted as free) with
gpu_memory_utilization x total, and exits when it is less ("Free memory on device ... is less than
desired GPU memory utilization"). Lowering the fraction does not cure that; releasing the cache
does. A warm cache is common there: a model download, a weights sync, a backup, a build.

Terms, all in bytes (F = one StartFit, M = the memory config):

- need = F.fraction x F.total (what vLLM computes; total is M.device_total_bytes, else MemTotal);
- free = MemFree now;
- returned = what the replica's processes now hold that is measured and comes back when they
  exit (its cgroup's or its processes' anonymous and shared memory, NVML's per-process memory
  where the driver answers); U8 checks after the restart job that it did come back, and what did
  not is kept (a hazard) until it is back (KEPT_ROWS: U9, U10, judged each tick);
- held = returned, or, while its unit is active, at least its running fraction x total (the first
  --gpu-memory-utilization in its process tree, else the fraction it would start with): on GB10
  vLLM's reservation is not charged to any cgroup and NVML does not report it, so this is the
  most the stop can give back;
- own = the page cache of the replica's own model files (observe/modelfiles.py): measured where
  the kernel tells guardian (cachestat(2) and mincore(2) answer only a file's owner or a writer),
  else at most their size and the whole cache; once released, what is measured, or 0;
- cache = the kernel's reclaimable file cache, Active(file) + Inactive(file).

Rules: ROWS below (ids U1-U7), first match, rendered into docs/rules.md. U1: only a unified-memory
box is judged: on a GPU with memory of its own the page cache is not the device's memory. U2-U4 are sure
fits, cheapest first: nothing to release, the replica's own files (M.release_cache, on by
default: posix_fadvise DONTNEED, no privilege), the whole cache (M.drop_caches, off by default:
the root helper). U5: a fit that depends on memory no one measured coming back (held > returned)
is started after every release allowed, and said at warning. U6: a start at its own fraction that
cannot fit even so is started at a lower one where the memory guard may lower it (M.enabled, and
its unit reads guardian's env file): the highest on the 0.01 grid, >= M.floor, that fits, written
to that file with its base recorded (so that restore raises it back once headroom allows). U7:
otherwise it is refused at error with the numbers and the remedy: guardian does not start into a
certain failure.

The shell re-measures right before the restart (act/restart.py), releases what the verdict
says, and measures again after a release before the job is issued.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum

from ..memory.memstate import grid, grid_below, highest_fit
from ..observations import gib
from ..rules import Row, Rule, first_match

# The root helper's one unit for U4 (units/guardian-drop-caches.service), allowed by polkit only
# with M.drop_caches (guardian/polkit.py).
DROP_CACHES_UNIT = "guardian-drop-caches.service"


class Release(StrEnum):
    """What a verdict releases before the start."""

    NOTHING = "nothing"
    OWN = "own"  # the replica's own model files' cache (posix_fadvise)
    ALL = "all"  # the whole page cache (the root helper: drop_caches), after its own files


@dataclass(frozen=True)
class StartFit:
    """One start's figures, measured right before it."""

    replica: str
    unit: str
    fraction: float
    total_bytes: int
    free_bytes: int
    returned_bytes: int
    held_bytes: int
    own_cached_bytes: int  # measured; else at most its files' size and the whole cache (OWN_MEASURED false)
    own_files: int
    cache_bytes: int
    release_own: bool  # M.release_cache
    drop_caches: bool  # M.drop_caches
    own_measured: bool = True  # the kernel tells a file's cache only to its owner or a writer
    unified: bool = True  # the GPU's memory is the box's (M.unified; "auto": NVML says NOT_SUPPORTED for it)
    # the lowest fraction U6 may start it at (M.floor): the memory guard is on, its unit reads guardian's
    # env file, and this start is at its own fraction (not a change of fraction); None: no lowering
    lower_floor: float | None = None
    reserve_bytes: int = 0  # M.reserve_bytes: what a lowered start leaves free beside it
    # its engine's need is FRACTION x total (vLLM, SGLang); False: no fraction says it (llama.cpp has
    # none; TensorRT-LLM's is a share of what its weights leave free): guardian/engines/
    sized_by_fraction: bool = True
    engine: str = "vLLM"  # its engine, as people write it

    @property
    def need_bytes(self) -> int:
        return math.ceil(self.fraction * self.total_bytes)

    @property
    def sure_bytes(self) -> int:
        """What the device sees as free once the old processes are gone, by what was measured."""
        return self.free_bytes + self.returned_bytes

    @property
    def own_release_bytes(self) -> int:
        return self.own_cached_bytes if self.release_own else 0

    @property
    def all_release_bytes(self) -> int:
        """What every allowed release could give: the whole cache includes the replica's own files."""
        return max(self.cache_bytes, self.own_release_bytes) if self.drop_caches else self.own_release_bytes


@dataclass(frozen=True)
class Verdict:
    rule: Rule
    release: Release
    start: bool
    fraction: float | None = None  # U6: the lower fraction it starts at


def lowering_floor(guard_on: bool, floor: float, wired: bool, settled: bool, own_known: bool) -> float | None:
    """StartFit.lower_floor: M.floor where U6 may lower this start, else None. GUARD_ON: M.enabled;
    WIRED: its unit reads guardian's env file (else a fraction written there is not what it runs);
    SETTLED: a start at its own fraction with no change of it in flight (the core's RestartUnit.may_lower);
    OWN_KNOWN: something says its fraction (never lowered from vLLM's default: that guess would be its base)."""
    return floor if guard_on and wired and settled and own_known else None


def lowered_fraction(f: StartFit) -> float | None:
    """U6's fraction: the highest 0.01 grid fraction < F.fraction and >= F.lower_floor whose
    fraction x total fits in free + held + the releases allowed - F.reserve_bytes; None if none does."""
    if f.lower_floor is None or f.total_bytes <= 0:
        return None
    room = f.free_bytes + f.held_bytes + f.all_release_bytes - f.reserve_bytes
    start = grid_below(min(room / f.total_bytes, f.fraction))
    if start >= f.fraction - 1e-9:  # its own fraction is on the grid: the next step down
        start = grid(start - 0.01)
    return highest_fit(start, f.fraction, room, f.total_bytes, f.lower_floor)


def _fits(f: StartFit, extra: int) -> bool:
    return f.need_bytes <= f.sure_bytes + extra


ROWS: tuple[Row[StartFit, Release], ...] = (
    Row(
        NOT_UNIFIED := Rule(
            "U1",
            "not judged",
            'NOT unified: M.unified is false, or "auto" (the default) and NVML does not answer NOT_SUPPORTED for '
            "device 0's memory (a GPU with memory of its own, or no GPU)",
        ),
        lambda f: not f.unified,
        lambda f: Release.NOTHING,
    ),
    Row(
        NOT_SIZED := Rule(
            "U11",
            "not judged",
            "its engine's need is not a share of the whole memory: an engine with no memory fraction (llama.cpp: "
            "its own flags size it), or one whose fraction is of the memory its weights leave free (TensorRT-LLM)",
        ),
        lambda f: not f.sized_by_fraction,
        lambda f: Release.NOTHING,
    ),
    Row(
        FITS := Rule("U2", "fits", "need <= free + returned"),
        lambda f: _fits(f, 0),
        lambda f: Release.NOTHING,
    ),
    Row(
        Rule("U3", "fits once its files are released", "M.release_cache AND need <= free + returned + own"),
        lambda f: f.release_own and _fits(f, f.own_cached_bytes),
        lambda f: Release.OWN,
    ),
    Row(
        Rule(
            "U4",
            "fits once the cache is dropped",
            "M.drop_caches AND need <= free + returned + max(cache, own if M.release_cache)",
        ),
        lambda f: f.drop_caches and _fits(f, f.all_release_bytes),
        lambda f: Release.ALL,
    ),
    Row(
        MAY_FIT := Rule(
            "U5",
            "may fit",
            "need <= free + held + the releases allowed (own if M.release_cache; cache if M.drop_caches): "
            "started after those releases, said at warning",
        ),
        lambda f: f.need_bytes <= f.free_bytes + f.held_bytes + f.all_release_bytes,
        lambda f: Release.ALL if f.drop_caches else Release.OWN if f.release_own else Release.NOTHING,
    ),
    Row(
        LOWERED := Rule(
            "U6",
            "lowered to fit",
            "M.enabled AND its unit reads guardian's env file (M9) AND the start is at its own fraction (not a "
            "change of fraction) AND a 0.01 grid fraction >= M.floor and < its own has fraction x total <= free + "
            "held + the releases allowed - M.reserve_bytes: started at the highest such, after those releases, "
            "written to guardian's env file with its base recorded (restore raises it back), said at warning",
        ),
        lambda f: lowered_fraction(f) is not None,
        lambda f: Release.ALL if f.drop_caches else Release.OWN if f.release_own else Release.NOTHING,
    ),
    Row(
        NO_FIT := Rule("U7", "does not fit", "otherwise: refused"),
        lambda f: True,
        lambda f: Release.NOTHING,
    ),
)
RETURN_CHECK_MIN_BYTES = 2**30  # less than this held: too little to tell from the box's own noise
RETURN_SLACK_BYTES = 2**29
RETURN_WAIT_S = 3.0  # after the restart job: how long the memory may take to come back
# How long a kept finding must read as back, every tick, before it ends (U10): a process of the box
# that exits and starts again (a build's step) frees its memory for a moment, not for good.
RETURN_BACK_S = 10.0


@dataclass(frozen=True)
class _Returned:
    """What the old processes held (measured before the stop), and how far MemFree rose once they were gone."""

    returned_bytes: int
    rise_bytes: int

    @property
    def missing_bytes(self) -> int:
        return self.returned_bytes - max(0, self.rise_bytes)


# Checked after a restart's job, not first-match with the rows above (act/fit.py); its evidence is
# what did not come back.
NOT_RETURNED_ROW: Row[_Returned, int] = Row(
    NOT_RETURNED := Rule(
        "U8",
        "not returned",
        "returned (measured before the stop) >= 1 GiB AND MemFree rose by less than returned - max(0.5 GiB, "
        "returned / 4) by every sample: the moment its stop is seen over (polled every 0.2 s), and within 3 s of "
        "the restart job's end: the rest is said at critical as memory the driver (or a "
        "file its processes left in /dev/shm) still holds, and kept as a hazard (guardian status, guardian check) "
        "until U9 or U10 ends it; the next start is judged on what is left",
    ),
    lambda r: (
        r.returned_bytes >= RETURN_CHECK_MIN_BYTES and r.missing_bytes > max(RETURN_SLACK_BYTES, r.returned_bytes // 4)
    ),
    lambda r: r.missing_bytes,
)


def not_returned_bytes(returned_bytes: int, rise_bytes: int) -> int | None:
    """What of RETURNED_BYTES (held by the old processes, measured before the stop) did not come back,
    when MemFree rose by RISE_BYTES once they were gone (U8); None: it came back."""
    found = first_match((NOT_RETURNED_ROW,), _Returned(returned_bytes, rise_bytes))
    return found[1] if found is not None else None


@dataclass(frozen=True)
class Leftover:
    """A U8 finding, kept as a hazard until what was missing is back (U9, U10).

    BASE_BYTES: the box's unheld memory (LeftoverLook.unheld_bytes) at the first look after the
    finding (None until then): what a return of the missing memory raises by MISSING_BYTES."""

    missing_bytes: int
    held_bytes: int  # what the old processes held, measured before the stop
    found_wall: float
    base_bytes: int | None = None
    back_since_mono: float | None = None  # since when it reads as back, at every look (None: it does not)


@dataclass(frozen=True)
class LeftoverLook:
    """One tick's figures for a kept finding, in bytes: MemFree, the reclaimable file cache, and what
    the replica's processes hold now (measured as returned is; 0 when none runs). RESTARTED_CLEAN: a
    restart guardian caused just found its processes' memory come back (U8 did not hold)."""

    free_bytes: int
    file_cache_bytes: int
    own_bytes: int
    now_mono: float
    restarted_clean: bool = False

    @property
    def unheld_bytes(self) -> int:
        """Memory nothing holds for good: free, or the page cache (a model's load moves MemFree into
        it), or the replica's own (its new start's): a return of the missing memory raises it, and
        neither a load nor the replica's own growth moves it."""
        return self.free_bytes + self.file_cache_bytes + self.own_bytes


def back_bytes(missing_bytes: int) -> int:
    """How much a kept finding's unheld memory must rise for its missing memory to count as back:
    all of it but U8's own slack."""
    return missing_bytes - max(RETURN_SLACK_BYTES, missing_bytes // 4)


@dataclass(frozen=True)
class KeptCase:
    """A kept finding and this tick's look at it, as the rows below read them."""

    kept: Leftover
    look: LeftoverLook

    @property
    def risen_bytes(self) -> int:
        return self.look.unheld_bytes - (self.kept.base_bytes if self.kept.base_bytes is not None else 0)


# A kept U8 finding, each tick (act/fit.py; first match, none: it is kept): what ends it.
KEPT_ROWS: tuple[Row[KeptCase, str], ...] = (
    Row(
        CLEAN := Rule(
            "U9",
            "back: restarted cleanly",
            "a later restart guardian caused found what the replica's processes held come back (U8 did not "
            "hold): the finding ends, said once at info",
        ),
        lambda c: c.look.restarted_clean,
        lambda c: "a later restart of it returned what its processes held",
    ),
    Row(
        REGAINED := Rule(
            "U10",
            "back: memory regained",
            "MemFree + Active(file) + Inactive(file) + what the replica's processes hold now (measured as "
            "returned) rose, since the first tick after the finding, by >= missing - max(0.5 GiB, missing / 4) "
            "at every tick for >= 10 s: the finding ends, said once at info",
        ),
        lambda c: c.kept.back_since_mono is not None and c.look.now_mono - c.kept.back_since_mono >= RETURN_BACK_S,
        lambda c: (
            f"MemFree + the file cache + its processes' memory rose by {gib(c.risen_bytes)} since the first look "
            f"after the finding, for {c.look.now_mono - (c.kept.back_since_mono or 0.0):.0f} s"
        ),
    ),
)
RULES = (*(row.rule for row in ROWS), NOT_RETURNED_ROW.rule, *(row.rule for row in KEPT_ROWS))


def not_returned_text(replica: str, missing_bytes: int, by: str = "") -> str:
    """A kept U8 finding, as `guardian status` and `guardian check` show it while it lasts."""
    return (
        f"replica {replica}: {gib(missing_bytes)} its processes held did not come back when they exited "
        f"({NOT_RETURNED.id}{', ' + by if by else ''}): the driver, or a file in /dev/shm, still holds it (a file "
        "there comes back once deleted; what the driver keeps, at the latest by a reboot); judged again each tick, "
        f"this ends once it is back ({REGAINED.id}) or a restart of it returns what its processes held ({CLEAN.id})"
    )


@dataclass(frozen=True)
class KeptVerdict:
    """A kept finding after one look: KEPT (None: it ended, by RULE, for WHY)."""

    kept: Leftover | None
    rule: Rule | None = None
    why: str = ""


def judge_kept(kept: Leftover, look: LeftoverLook) -> KeptVerdict:
    """KEPT after LOOK: its base taken at the first look, whether it reads as back (and since when)
    updated, and ended where a row of KEPT_ROWS holds."""
    base = kept.base_bytes if kept.base_bytes is not None else look.unheld_bytes
    back = look.unheld_bytes - base >= back_bytes(kept.missing_bytes)
    since = (kept.back_since_mono if kept.back_since_mono is not None else look.now_mono) if back else None
    now = replace(kept, base_bytes=base, back_since_mono=since)
    found = first_match(KEPT_ROWS, KeptCase(now, look))
    if found is None:
        return KeptVerdict(now)
    rule, why = found
    return KeptVerdict(None, rule, why)


def judge(f: StartFit) -> Verdict:
    found = first_match(ROWS, f)
    assert found is not None  # U7 always holds
    rule, release = found
    lowered = lowered_fraction(f) if rule.id == LOWERED.id else None
    return Verdict(rule, release, start=rule.id != NO_FIT.id, fraction=lowered)


def figures(f: StartFit) -> str:
    """The numbers a line about this start gives, as an operator checks them."""
    own = gib(f.own_cached_bytes) if f.own_measured else f"at most {gib(f.own_cached_bytes)}"
    held = ""
    if f.held_bytes > f.returned_bytes:
        held = f"; up to {gib(f.held_bytes)} if what its fraction reserves comes back"
    need = (
        f"it needs {gib(f.need_bytes)} ({f.fraction:g} x {gib(f.total_bytes)})"
        if f.sized_by_fraction
        else f"its need is not known ({f.engine}: no fraction of the whole memory says it)"
    )
    return (
        f"{need}, the device would see "
        f"{gib(f.sure_bytes)} free (MemFree {gib(f.free_bytes)} + {gib(f.returned_bytes)} its processes "
        f"return{held}); the page cache holds {gib(f.cache_bytes)}, {own} of it its own model files ({f.own_files})"
    )


def remedy(f: StartFit) -> str:
    """What an operator can do about a start that does not fit."""
    steps = ["free memory on the box", f"lower its gpu_memory_utilization below {f.sure_bytes / f.total_bytes:.2f}"]
    if f.lower_floor is not None:  # the memory guard would have lowered it, had a fraction >= its floor fitted
        steps[1] = (
            f"lower memory.floor below {f.lower_floor:g} (no fraction at or above it fits with "
            f"memory.reserve_bytes {gib(f.reserve_bytes)} left free beside it)"
        )
    if not f.release_own and f.own_cached_bytes:
        steps.append("set memory.release_cache = true")
    if not f.drop_caches and f.cache_bytes > f.own_cached_bytes:
        steps.append("set memory.drop_caches = true (or run `sync; echo 1 > /proc/sys/vm/drop_caches` as root)")
    return ", or ".join(steps)
