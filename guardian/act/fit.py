"""A start that fits (core/fit/startfit.py), as a restart performs it right before its job: the figures
measured afresh, the releases the verdict asks for done and measured, and the start refused where
it cannot fit. Nothing here decides: `startfit.judge` does."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from ..config import Config, ReplicaConfig
from ..core.fit import fitsay, startfit
from ..core.fit.startfit import DROP_CACHES_UNIT, Leftover, LeftoverLook, Release, StartFit, Verdict
from ..core.memory.wiring import EnvFile, wiring_problem
from ..core.observations import MemorySample, UnitInfo, gib
from ..observe import modelfiles, startlook
from ..observe.meminfo import sample_memory
from ..observe.memory import env_path, service_details
from ..observe.systemd import ServiceDetails, Systemd, SystemdError
from . import units
from .journal import Journal

VLLM_DEFAULT_FRACTION = 0.9  # vLLM's --gpu-memory-utilization when none is given
# The root helper's drop of the page cache, waited for at most this long (its unit's TimeoutStartSec=
# is the same): `echo 1 > drop_caches` frees clean pages only and waits on no writeback (the helper no
# longer runs `sync`, which any user's steady writes held for its whole 60 s, issue 41); dropping a
# 100 GiB cache takes seconds. Well under FIT_STEP_S, which it is a part of.
DROP_CACHES_TIMEOUT_S = 10.0
# A restart's whole fit step (its unit asked, its figures measured, its releases done and measured
# again), at most: past it the restart goes on without the fit, said at warning (act/restart.py),
# and the step's threads stop at this deadline too. Its parts are bounded well under it (a walk of the
# model files WALK_MAX_S = 2 s, up to three times; the drop 10 s; a D-Bus call 5 s), and a hung
# replica's restart must not wait on a model path built to be slow (issue 41 row 4: 13.7 s for 800
# files of a deep tree, about 20 min for 20,000).
FIT_STEP_S = 30.0

# replica, how ("own", "all"), bytes: the metric's hook (export/metrics.py)
Released = Callable[[str, str, int], None]


@dataclass(frozen=True)
class Measured:
    fit: StartFit
    files: modelfiles.ModelFiles


@dataclass(frozen=True)
class Start:
    """The start being judged. NEW: the fraction a change of fraction starts it at (None: its own);
    MAY_LOWER: no change of its fraction is in flight (the core's say), so U6 may lower it;
    OWN_RELEASED: its files' cache was just released, so what the kernel would not measure counts as 0."""

    new: float | None = None
    may_lower: bool = False
    own_released: bool = False


def measure(
    cfg: Config,
    r: ReplicaConfig,
    unit: UnitInfo | None,
    details: ServiceDetails | None,
    start: Start = Start(),
    deadline_mono: float = math.inf,
) -> Measured:
    """The figures of R's next START, right now (blocking: run in a thread): one look
    (observe/startlook.py) made into the core's StartFit."""
    seen = startlook.look(cfg, r, unit, details, deadline_mono)
    total = seen.total_bytes
    fraction = start.new or seen.own_fraction or VLLM_DEFAULT_FRACTION
    held = seen.returned_bytes
    if seen.running:
        # a wrapper (a shell, `docker run -e ...`) hides the fraction vLLM runs with: then what it
        # would start with, as a refusal on too small a hold would leave a hung replica unrestarted
        running = seen.running_fraction or seen.own_fraction or VLLM_DEFAULT_FRACTION
        held = max(seen.returned_bytes, int(running * total))
    knob = seen.engine.knob.flag if seen.engine.knob is not None else None
    fit = StartFit(
        replica=r.name,
        unit=r.unit,
        fraction=fraction,
        total_bytes=total,
        free_bytes=seen.sample.free_bytes,
        returned_bytes=seen.returned_bytes,
        held_bytes=held,
        own_cached_bytes=_own_cached_bytes(seen.files, seen.cached, seen.sample, start),
        own_measured=seen.cached.measured and not seen.files.cut,
        own_files=len(seen.files.paths),
        cache_bytes=seen.sample.file_cache_bytes,
        release_own=cfg.memory.release_cache,
        drop_caches=cfg.memory.drop_caches,
        unified=startlook.unified(cfg),
        lower_floor=startfit.lowering_floor(
            cfg.memory.enabled,
            cfg.memory.floor,
            _wired(cfg, r, details, seen.env_files, knob),
            start.may_lower and start.new is None,
            seen.own_fraction is not None,
        ),
        reserve_bytes=cfg.memory.reserve_bytes,
        sized_by_fraction=seen.engine.knob is not None and seen.engine.knob.of_total,
        engine=seen.engine.label,
    )
    return Measured(fit, seen.files)


def _own_cached_bytes(
    files: modelfiles.ModelFiles, cached: modelfiles.Cached, sample: MemorySample, start: Start
) -> int:
    """Its own files' page cache: measured; else 0 once released (what the kernel would not say);
    else at most their size and the whole cache, or the whole cache where the search for them was
    cut short (the files it did not reach may hold any of it)."""
    if cached.measured and not files.cut:
        return cached.bytes
    if start.own_released:
        return 0
    return sample.file_cache_bytes if files.cut else min(cached.bytes, sample.file_cache_bytes)


def _wired(
    cfg: Config, r: ReplicaConfig, details: ServiceDetails | None, env_files: tuple[EnvFile, ...], knob: str | None
) -> bool:
    """Its unit passes guardian's env file to KNOB, its engine's flag (core/memory/wiring.py); unknown
    without its details."""
    return (
        details is not None
        and wiring_problem(r.unit, env_files, details.exec_start, str(env_path(cfg, r.name)), knob) is None
    )


@dataclass(frozen=True)
class Freed:
    """One release done: how ("own", "all"), what it freed, how long it took."""

    how: str
    bytes: int
    took_s: float


def would_release(m: Measured, verdict: Verdict) -> str:
    """What a start judged VERDICT would release first, for `guardian check`."""
    own = f"its model files' page cache ({len(m.files.paths)} files, {m.files.source})" if m.files.paths else ""
    if verdict.release is Release.OWN and own:
        return own
    if verdict.release is Release.ALL:
        return f"{own + ', then ' if own else ''}the whole page cache (drop_caches)"
    return "nothing"


def judge_kept(leftovers: dict[str, Leftover], r: ReplicaConfig, look: LeftoverLook, journal: Journal) -> None:
    """R's kept U8 finding judged on LOOK (core/fit/startfit.py judge_kept): kept, or ended and said once at info."""
    kept = leftovers.get(r.name)
    if kept is None:
        return
    verdict = startfit.judge_kept(kept, look)
    if verdict.kept is not None:
        leftovers[r.name] = verdict.kept
        return
    del leftovers[r.name]
    journal.line(fitsay.kept_over(r.name, r.unit, kept, verdict))


def not_returned_now(leftovers: Mapping[str, Leftover]) -> dict[str, int]:
    """U8's findings that stand now, by replica: the bytes that did not come back. The one reading of
    U8 outside the fit step: the tick's observation carries it to the start loop (core/startloop.py, A6)."""
    return {name: found.missing_bytes for name, found in leftovers.items()}


@dataclass(frozen=True)
class Fitted:
    """A fit step's answer: REFUSED (None: start; else why not, said at error), the figures it was
    judged on (None: not judged, U1), and FRACTION, the lower one it starts at (U6) or None."""

    refused: str | None
    measured: Measured | None = None
    fraction: float | None = None


@dataclass
class FitStep:
    """One restart's fit step: measure, judge, release, measure again."""

    sd: Systemd
    journal: Journal
    cfg: Config
    released: Released | None = None
    leftovers: dict[str, Leftover] = field(default_factory=dict)  # U8's findings kept, by replica (shared)
    said: dict[str, str] = field(default_factory=dict)  # replica -> the U7 episode said (shared: once each)
    bound_s: float = FIT_STEP_S  # the whole step's, past which the restart goes on without it (act/restart.py)
    doing: str = field(default="not yet begun", init=False)  # what the step is at: said if it outlives its bound
    deadline_mono: float = field(default=math.inf, init=False)  # its threads stop here (time.monotonic's)

    async def run(self, r: ReplicaConfig, unit: UnitInfo | None, start: Start) -> Fitted:
        if not startlook.unified(self.cfg):
            return Fitted(None)  # U1, without measuring anything
        self.deadline_mono = time.monotonic() + self.bound_s
        self.doing = f"asking systemd for {r.unit}'s ExecStart= and environment"
        details = await service_details(self.sd, r)
        self.doing = "measuring its start's memory and walking its model files"
        m = await asyncio.to_thread(measure, self.cfg, r, unit, details, start, self.deadline_mono)
        verdict = startfit.judge(m.fit)
        if verdict.release is not Release.NOTHING:
            m = await self._release(r, unit, details, replace(start, own_released=True), m, verdict)
            verdict = startfit.judge(m.fit)  # on what the releases left: a fit now, or a refusal after all
        return Fitted(self._say(r, m, verdict), m, verdict.fraction)

    async def check_returned(self, r: ReplicaConfig, before: Measured, stopped: MemorySample | None = None) -> None:
        """U8, after the restart job: did what the old processes held come back to MemFree? STOPPED:
        the box's memory when their stop was seen over (Stop), the first of the samples."""
        held = before.fit.returned_bytes
        if held < startfit.RETURN_CHECK_MIN_BYTES:
            return
        began = time.monotonic()
        best = stopped.free_bytes - before.fit.free_bytes if stopped is not None else 0
        while True:
            best = max(best, (await asyncio.to_thread(sample_memory)).free_bytes - before.fit.free_bytes)
            if startfit.not_returned_bytes(held, best) is None or time.monotonic() - began >= startfit.RETURN_WAIT_S:
                break
            await asyncio.sleep(0.1)
        missing = startfit.not_returned_bytes(held, best)
        if missing is None:  # a clean restart: what was kept of an earlier one ends (U9)
            judge_kept(self.leftovers, r, LeftoverLook(0, 0, 0, time.monotonic(), restarted_clean=True), self.journal)
            return
        self.leftovers[r.name] = Leftover(missing, held, time.time())  # a finding kept replaces the one before
        self.journal.line(fitsay.not_returned(r.name, r.unit, missing, held, best))

    async def _release(
        self,
        r: ReplicaConfig,
        unit: UnitInfo | None,
        details: ServiceDetails | None,
        start: Start,
        m: Measured,
        verdict: Verdict,
    ) -> Measured:
        before = m.fit
        if before.release_own and m.files.paths:
            began = time.monotonic()
            self.doing = f"releasing its model files' page cache ({len(m.files.paths)} files, {m.files.source})"
            await asyncio.to_thread(modelfiles.release, m.files.paths, m.files.top, self.deadline_mono)
            self.doing = "measuring its start's memory again after that release"
            after = await asyncio.to_thread(measure, self.cfg, r, unit, details, start, self.deadline_mono)
            freed = max(0, before.cache_bytes - after.fit.cache_bytes)
            self._said_release(r, Freed("own", freed, time.monotonic() - began), m, verdict, after.fit)
            m, before = after, after.fit
        # judged again on what its own files' release left (an unmeasured "own" was only a bound): the
        # policy says whether the whole cache is still wanted (U4, U5), or it fits now (U2)
        if startfit.judge(before).release is Release.ALL:
            began = time.monotonic()
            self.doing = f"dropping the whole page cache ({DROP_CACHES_UNIT})"
            result = await self._drop_caches()
            self.doing = "measuring its start's memory again after the drop"
            after = await asyncio.to_thread(measure, self.cfg, r, unit, details, start, self.deadline_mono)
            freed = max(0, before.cache_bytes - after.fit.cache_bytes)
            if result is None:
                self._said_release(r, Freed("all", freed, time.monotonic() - began), m, verdict, after.fit)
            else:
                self.journal.line(fitsay.drop_failed(r.name, r.unit, result, verdict))
            m = after
        return m

    async def _drop_caches(self) -> str | None:
        """The whole page cache, through the root helper's one unit; None when done, else why not."""
        try:
            result = await units.run_job(self.sd, "StartUnit", DROP_CACHES_UNIT, DROP_CACHES_TIMEOUT_S)
        except SystemdError as e:
            return f"{DROP_CACHES_UNIT} could not be started: {e}"
        if result == "done":
            return None
        return f"{DROP_CACHES_UNIT} ended with '{result}' (journalctl -u {DROP_CACHES_UNIT})"

    def _said_release(self, r: ReplicaConfig, freed: Freed, m: Measured, verdict: Verdict, after: StartFit) -> None:
        what = (
            f"its model files' page cache ({len(m.files.paths)} files, {m.files.source}): the file cache fell by "
            f"{gib(freed.bytes)}"
            if freed.how == "own"
            else f"the page cache (drop_caches, by {DROP_CACHES_UNIT}): the file cache fell by {gib(freed.bytes)}"
        )
        self.journal.line(fitsay.released(r.name, r.unit, what, freed.took_s, verdict, after))
        if self.released is not None:
            self.released(r.name, freed.how, freed.bytes)

    def _say(self, r: ReplicaConfig, m: Measured, verdict: Verdict) -> str | None:
        said = fitsay.verdict(r.name, r.unit, m.fit, verdict, self.said.get(r.name))
        if said.episode is None:
            self.said.pop(r.name, None)
        else:
            self.said[r.name] = said.episode
        for line in said.lines:
            self.journal.line(line)
        return said.refused
