"""What the start fit says (core/fit/startfit.py judges): the line of each verdict, once per episode
where a watchdog asks again every tick, the line of each release a restart performed, and U8's
findings. Pure: the restart's fit step (act/fit.py) measures, performs the releases the verdict
asks for, and writes the lines chosen here."""

from __future__ import annotations

from dataclasses import dataclass

from ..actions import LogLine
from ..observations import gib
from ..vocab import Decision, Gate, Priority
from . import startfit
from .startfit import Leftover, StartFit, Verdict


@dataclass(frozen=True)
class Said:
    """A verdict's answer: REFUSED (None: it starts; else why not), the U7 episode said now (None:
    none stands), and the lines to write."""

    refused: str | None
    episode: str | None
    lines: tuple[LogLine, ...] = ()


def verdict(replica: str, unit: str, f: StartFit, v: Verdict, episode_said: str | None) -> Said:
    """The lines of V, the verdict on F, for REPLICA's start of UNIT; EPISODE_SAID: the U7 episode
    said before (the same refusal of the same need is said when it begins, never every tick)."""
    rule = v.rule.id
    if rule == startfit.NO_FIT.id:
        why = f"it cannot fit: {startfit.figures(f)}"
        episode = f"{rule}:{f.need_bytes >> 30}"
        if episode_said == episode:
            return Said(why, episode)
        line = LogLine(
            Priority.ERROR,
            f"replica {replica}: not starting {unit}: {why}; vLLM's start would fail its free-memory check "
            f"({startfit.NO_FIT.id}); {startfit.remedy(f)}",
            Decision.REFUSED,
            replica,
            unit,
            gate=Gate.NO_FIT,
            rule=rule,
        )
        return Said(why, episode, (line,))
    if rule == startfit.LOWERED.id:
        text = (
            f"replica {replica}: starting {unit} at gpu_memory_utilization {v.fraction:g}, lowered "
            f"from {f.fraction:g}: at its own it cannot fit: {startfit.figures(f)} ({startfit.LOWERED.id}: "
            f"{v.rule.outcome}); {f.fraction:g} is kept as its base, and the memory guard raises it "
            "back once headroom allows"
            + (
                "; it may still not fit unless what its fraction reserves comes back"
                if f.held_bytes > f.returned_bytes
                else ""
            )
        )
        return Said(None, None, (LogLine(Priority.WARNING, text, Decision.MEMORY, replica, unit, rule=rule),))
    if rule == startfit.MAY_FIT.id and f.need_bytes > f.sure_bytes:
        off = " (memory.release_cache is off)" if not f.release_own and f.own_cached_bytes else ""
        text = (
            f"replica {replica}: starting {unit} though it may not fit ({startfit.MAY_FIT.id}: {v.rule.outcome}): "
            f"{startfit.figures(f)}{off}; vLLM's start fails its free-memory check unless memory its "
            f"processes hold comes back; {startfit.remedy(f)}"
        )
        return Said(None, None, (LogLine(Priority.WARNING, text, Decision.CACHE, replica, unit, rule=rule),))
    return Said(None, None)


def released(replica: str, unit: str, what: str, took_s: float, v: Verdict, after: StartFit) -> LogLine:
    """A release the fit step performed for V (WHAT: the cache released and by how much it fell)."""
    return LogLine(
        Priority.WARNING,
        f"replica {replica}: released {what} in {took_s:.2f} s before starting {unit} "
        f"({v.rule.id}: {v.rule.outcome}); now {startfit.figures(after)}",
        Decision.CACHE,
        replica,
        unit,
        rule=v.rule.id,
    )


def drop_failed(replica: str, unit: str, why: str, v: Verdict) -> LogLine:
    """The whole page cache could not be dropped before the start V asked it for."""
    return LogLine(
        Priority.ERROR,
        f"replica {replica}: could not drop the page cache before starting {unit}: {why}",
        Decision.CACHE,
        replica,
        unit,
        rule=v.rule.id,
    )


def not_returned(replica: str, unit: str, missing_bytes: int, held_bytes: int, rose_bytes: int) -> LogLine:
    """U8 found: MISSING_BYTES of the HELD_BYTES its old processes held did not come back to MemFree
    (which rose by ROSE_BYTES at most once they were gone)."""
    return LogLine(
        Priority.CRITICAL,
        f"replica {replica}: {gib(missing_bytes)} not returned after {unit}'s processes exited (they "
        f"held {gib(held_bytes)}; MemFree rose by at most {gib(max(0, rose_bytes))}, once they were gone and within "
        f"{startfit.RETURN_WAIT_S:g} s of the restart): the driver, or a file they left in /dev/shm, still "
        "holds it (a file there comes back once deleted; what the driver keeps, at the latest by a reboot) "
        f"({startfit.NOT_RETURNED.id}); its next start is judged on what is left, and guardian says when it "
        f"is back ({startfit.REGAINED.id}) or a clean restart of it ends this ({startfit.CLEAN.id})",
        Decision.HAZARD,
        replica,
        unit,
        rule=startfit.NOT_RETURNED.id,
        hazard=f"memory-not-returned:{replica}",
    )


def kept_over(replica: str, unit: str, kept: Leftover, ended: startfit.KeptVerdict) -> LogLine:
    """A kept U8 finding ended (ENDED: judge_kept's verdict, by U9 or U10), said once at info."""
    assert ended.rule is not None
    return LogLine(
        Priority.INFO,
        f"hazard over: replica {replica}: the {gib(kept.missing_bytes)} its processes held that did not come back "
        f"when they exited ({startfit.NOT_RETURNED.id}) is back: {ended.why} ({ended.rule.id}: {ended.rule.outcome})",
        Decision.NOTE,
        replica,
        unit,
        rule=ended.rule.id,
        hazard=f"memory-not-returned:{replica}",
    )
