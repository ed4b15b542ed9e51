"""One restart, as the executor and `guardian restart` perform it: the unit gates checked again on
a fresh look right before acting, the restart recorded in the state file, the job issued and
waited for, and its stop helped along in the way the order says (Stop). Nothing here decides: the
re-check is the core's own pure function (gates.unit_refusal), and the way of the stop is the
core's (kill_first and stop_timeout_s of RestartUnit and SetFraction)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ..config import Config, ReplicaConfig
from ..core import gates, stopping
from ..core.actions import HUNG_STOP_GRACE_S, LogLine
from ..core.container import helper_unit
from ..core.fit.startfit import Leftover
from ..core.observations import MemorySample, RestartOutcome, UnitInfo
from ..core.rules import Refusal
from ..core.vocab import ActiveState, Decision, Gate, HeldBy, Priority
from ..observe.addresses import pin_of
from ..observe.clock import Now
from ..observe.clock import now as clock_now
from ..observe.containers import ContainerWatch
from ..observe.meminfo import sample_memory
from ..observe.memory import env_path
from ..observe.replicas import port_owners, unit_or_error
from ..observe.systemd import JOB_DONE, Systemd, SystemdError
from . import units
from .fit import FitStep, Fitted, Released, Start
from .journal import Journal
from .state import CorruptState, StateStore, atomic_write, record_fraction_base, record_restart

STOP_POLL_S = 0.2  # how often a bounded stop asks systemd whether the unit is still stopping
ACT_HELPER_TIMEOUT_S = 30.0  # a kill or restart by the container helper (a task: the loop never waits for it)


@dataclass(frozen=True)
class Tools:
    """What acting on this box takes. The executor keeps one and replaces it on reload."""

    sd: Systemd
    store: StateStore
    journal: Journal
    cfg: Config
    clock: Callable[[], Now] = clock_now
    # The observer's, so that there is one set of container reports; None: a fresh one per restart.
    containers: ContainerWatch | None = None
    released: Released | None = None  # the page cache a start's fit released: the metric's hook
    leftovers: dict[str, Leftover] = field(default_factory=dict)  # U8: memory not returned, kept by replica
    fit_said: dict[str, str] = field(default_factory=dict)  # U7 refusals said, by replica: once per episode


@dataclass(frozen=True)
class RestartOrder:
    """One restart to perform: REPLICA's unit (or unit-less container), for WHY (said at the end
    of the restart's journal line)."""

    replica: ReplicaConfig
    why: str
    allow_failed: bool = False  # a failed unit may be restarted (the memory guard's retry of a start)
    kill_first: bool = False  # a hung replica, or a start stopped: SIGKILL its processes if its stop lasts
    stop_timeout_s: float | None = None  # a drained replica: SIGKILL its processes if the stop takes longer
    before_restart: Callable[[], None] | None = None  # the memory guard's env file write, once the gates pass
    killed_what: str = "hung"  # what a failed kill_first names the unit: a "hung" one, or a "starting" one
    # The core's line that says the restart ("...; restarting vllm-a.service (restart 2 of 3 ...)"):
    # journaled once the re-check passes, so that a restart refused there is never said as taken
    announce: LogLine | None = None
    fraction: float | None = None  # the fraction the start will run with (a change of fraction); None: as now
    # no change of its fraction is in flight (the core's say: RestartUnit.may_lower), so a start that
    # cannot fit at its own may be lowered to fit (startfit U6)
    may_lower: bool = False


async def checked_restart(tools: Tools, order: RestartOrder) -> RestartOutcome:
    """Re-check the unit gates on a fresh look, record the restart, then restart and wait.

    A replica in a container has its container killed beside its unit when its processes are
    killed, and a unit-less one is restarted by the root helper, not by systemd (see Stop)."""
    r = order.replica
    containers = tools.containers if tools.containers is not None else ContainerWatch(tools.sd)
    unit, refusal = await _fresh_look(tools.sd, r, containers, order.allow_failed)
    if refusal is not None:
        return _refused(tools, order, refusal)
    step = FitStep(tools.sd, tools.journal, tools.cfg, tools.released, tools.leftovers, tools.fit_said)
    fitted = await _fit(tools, step, order, unit)
    if fitted.refused is not None:
        return RestartOutcome(r.unit, f"refused: {fitted.refused}")
    measured = fitted.measured
    if order.announce is not None:
        tools.journal.line(order.announce)
    before, undo = order.before_restart, None
    if fitted.fraction is not None and measured is not None:
        undo = _env_file_as_it_is(tools.cfg, r)
        before = functools.partial(write_fraction, tools, r, measured.fit.fraction, fitted.fraction)
    if before is not None:
        try:
            before()
        except OSError as e:
            tools.journal.line(
                LogLine(
                    Priority.ERROR,
                    f"replica {r.name}: not restarting {r.unit}: {e}",
                    Decision.REFUSED,
                    r.name,
                    r.unit,
                    gate=Gate.ENV_FILE,
                )
            )
            return RestartOutcome(r.unit, f"refused: {e}")
    issued = tools.clock()
    try:
        tools.store.update(lambda d: record_restart(d, r.name, issued, tools.cfg.watchdog.restart_window_s * 4))
    except CorruptState as e:
        tools.journal.send(Priority.ERROR, str(e))
    stop = Stop(tools, r, issued, unit.inactive_exit_mono if unit is not None else None)
    stop.sample_stopped = measured is not None  # U8 judges it (check_returned): one /proc read
    outcome = await stop.restart_unitless(order.why) if r.unitless else await _issue(tools, order, stop)
    if undo is not None and not outcome.issued:
        undo()  # it still runs at its fraction: the file must say so, or the memory guard reads an override
    if measured is not None and outcome.issued:
        await step.check_returned(r, measured, stop.stopped_sample)
    return outcome


def fraction_text(new: float) -> bytes:
    """guardian's env file for a replica (core/memory/wiring.py: what its unit must read)."""
    return f"# written by guardian's memory guard\nGPU_MEMORY_UTILIZATION={new:g}\n".encode()


async def _fit(tools: Tools, step: FitStep, order: RestartOrder, unit: UnitInfo | None) -> Fitted:
    """The fit step, bounded by its STEP.bound_s: past it (a model path built to be slow, a file
    system that hangs, a drop of the cache that lasts) the restart goes on without it, said at warning."""
    r = order.replica
    try:
        return await asyncio.wait_for(step.run(r, unit, Start(order.fraction, order.may_lower)), step.bound_s)
    except TimeoutError:
        tools.journal.line(
            LogLine(
                Priority.WARNING,
                f"replica {r.name}: the start's fit step did not end within {step.bound_s:g} s (it was "
                f"{step.doing}); restarting {r.unit} without it: skipped the judgement of whether its start fits "
                "and any release of the page cache not done by then",
                Decision.CACHE,
                r.name,
                r.unit,
            )
        )
        return Fitted(None)
    except Exception as e:  # noqa: BLE001 - a fit step that fails (hostile model paths, /proc gone) never stops a restart
        tools.journal.line(
            LogLine(
                Priority.ERROR,
                f"replica {r.name}: the start's fit could not be judged ({type(e).__name__}: "
                f"{e}); restarting {r.unit} without it",
                Decision.CACHE,
                r.name,
                r.unit,
            )
        )
        return Fitted(None)


def _env_file_as_it_is(cfg: Config, r: ReplicaConfig) -> Callable[[], None]:
    """What puts guardian's env file for R back as it is now (absent: removed)."""
    path = env_path(cfg, r.name)
    try:
        kept: bytes | None = path.read_bytes()
    except FileNotFoundError:
        kept = None
    except OSError:
        return lambda: None  # unreadable: the write will fail the same way, and nothing was changed

    def undo() -> None:
        with contextlib.suppress(OSError):
            if kept is None:
                path.unlink()
            else:
                atomic_write(path, kept)

    return undo


def write_fraction(tools: Tools, r: ReplicaConfig, old: float, new: float) -> None:
    """Guardian's env file for R at NEW, from OLD: a lowering's (the memory guard's, or a start
    lowered to fit, U6) base recorded first (act/executor.py says why); a base that cannot be
    recorded is said (it is not raised back by itself) and the write goes on. OSError: the env
    file could not be written."""
    if new >= old:
        atomic_write(env_path(tools.cfg, r.name), fraction_text(new))
        return
    try:
        tools.store.update(lambda d: record_fraction_base(d, r.name, old))
    except (CorruptState, OSError) as e:
        tools.journal.line(
            LogLine(
                Priority.ERROR,
                f"replica {r.name}: cannot record its base fraction {old:g} in {tools.store.dir}: {e}; the memory "
                "guard will not raise it back by itself",
                Decision.MEMORY_NOTE,
                r.name,
                r.unit,
            )
        )
    atomic_write(env_path(tools.cfg, r.name), fraction_text(new))


async def _fresh_look(
    sd: Systemd, r: ReplicaConfig, containers: ContainerWatch, allow_failed: bool
) -> tuple[UnitInfo | None, Refusal | None]:
    """The unit (or a unit-less container as one) and the port's holder looked at afresh, and the
    first gate that refuses. A container holding the port is judged on a fresh helper report."""
    unit, err = await containers.unitless_view(r) if r.unitless else await unit_or_error(sd, r.unit)
    pin = await pin_of(r)  # where its URL leads now, as the tick's probes were pinned
    owner = (await port_owners(sd, {r.port: pin.address or r.host}))[r.port]
    if r.container is not None:
        if isinstance(owner, HeldBy) and owner.unit != r.unit:
            await containers.refresh(r, force=True)
        owner = (await containers.owners([r], {r.port: owner}))[r.port]
    return unit, gates.unit_refusal(unit, owner, allow_failed, unit_error=err)


def _refused(tools: Tools, order: RestartOrder, refusal: Refusal) -> RestartOutcome:
    r = order.replica
    tools.journal.line(gates.refused_on_recheck(r.name, r.unit, refusal, order.why))
    return RestartOutcome(r.unit, f"refused: {refusal.reason}")


async def _issue(tools: Tools, order: RestartOrder, stop: Stop) -> RestartOutcome:
    """Ask systemd for the restart job, help its stop along once it is queued, and say how it ended."""
    r = order.replica
    try:
        result = await units.restart(
            tools.sd,
            r.unit,
            stopping.job_wait_s(tools.cfg, order.stop_timeout_s),
            start_if_stopped=order.allow_failed,
            kill=stop.during(order),
        )
    except SystemdError as e:
        tools.journal.line(
            LogLine(
                Priority.ERROR,
                f"replica {r.name}: restart of {r.unit} could not be issued: {e}",
                Decision.RESTART_FAILED,
                r.name,
                r.unit,
            )
        )
        return RestartOutcome(r.unit, f"error: {e}")
    elapsed_s = tools.clock().mono - stop.issued.mono
    return _said(
        tools,
        r,
        result,
        f"restart job of {r.unit} done in {elapsed_s:.1f} s{stop.note} ({order.why})",
        f"restart job of {r.unit} ended with '{result}' after {elapsed_s:.1f} s; see journalctl -u {r.unit}",
    )


def _said(tools: Tools, r: ReplicaConfig, result: str, done: str, failed: str) -> RestartOutcome:
    """The restart's end, one line at the priority it deserves, as the outcome for the next tick."""
    ok = result == JOB_DONE
    tools.journal.line(
        LogLine(
            Priority.INFO if ok else Priority.ERROR,
            f"replica {r.name}: " + (f"{done}; waiting for it to serve" if ok else failed),
            Decision.RESTARTED if ok else Decision.RESTART_FAILED,
            r.name,
            r.unit,
        )
    )
    return RestartOutcome(r.unit, result, issued=True, ok=ok)


class Stop:
    """How one restart's stop is helped along, in the way its order says (during):

    - kill_hung (kill_first): a hung replica's processes, or those of a start the start guard stops
      (core/memory/startguard.py), are SIGKILLed if the stop has not ended HUNG_STOP_GRACE_S after the
      job began;
    - bounded (stop_timeout_s): a drained replica's stop is waited for up to its bound, then its
      processes are SIGKILLed; how long the stop took is said either way;
    - either kill takes a replica's container with it, through the root helper: the unit's
      cgroup holds only the engine's CLI or conmon (_kill_container);
    - restart_unitless: a container that no unit runs is restarted by the root helper instead.

    `note` is what was done, for the end of the restart's journal line."""

    def __init__(self, tools: Tools, r: ReplicaConfig, issued: Now, started_before_mono: float | None) -> None:
        self.tools = tools
        self.r = r
        self.issued = issued
        self.started_before_mono = started_before_mono  # when the process being stopped started
        self.note = ""
        # U8: the box's memory the moment the stop is seen over, before the new start has taken any
        self.sample_stopped = False
        self.stopped_sample: MemorySample | None = None

    def during(self, order: RestartOrder) -> Callable[[], Awaitable[None]] | None:
        """What runs once the restart job has begun (its stop is under way; Systemd.run_job)."""
        helps = self._helps(order)
        if not self.sample_stopped:
            return helps

        async def then_sample() -> None:
            if helps is not None:
                await helps()
            await self._sample_once_stopped()

        return then_sample

    def _helps(self, order: RestartOrder) -> Callable[[], Awaitable[None]] | None:
        if order.kill_first:
            return functools.partial(self.kill_hung, order.killed_what)
        if order.stop_timeout_s is not None:
            return functools.partial(self.bounded, order.stop_timeout_s)
        return None

    async def _sample_once_stopped(self) -> None:
        """MemFree once the old processes are gone (the unit down, or starting anew): a new start that
        loads fast, or a unit that is ready only once loaded, must not hide what came back."""
        left_s = self.tools.cfg.watchdog.restart_job_timeout_s - (self.tools.clock().mono - self.issued.mono)
        if left_s > 0 and await self._stop_ended_within(left_s) is not None:
            try:
                self.stopped_sample = await asyncio.to_thread(sample_memory)
            except (OSError, ValueError, KeyError):
                self.stopped_sample = None  # U8 then reads after the job only; the restart goes on

    async def kill_hung(self, what: str = "hung") -> None:
        took_s = await self._stop_ended_within(HUNG_STOP_GRACE_S)
        if took_s is not None:
            self.note = f"; it stopped by itself in {took_s:.1f} s, so nothing was killed"
        elif await self._kill(what):
            self.note = f"; still stopping after {HUNG_STOP_GRACE_S:g} s, so its processes were killed (SIGKILL)"
        else:
            self.note = "; killing its processes failed, so the stop waited for the unit's own stop"

    async def bounded(self, timeout_s: float) -> None:
        took_s = await self._stop_ended_within(timeout_s)
        if took_s is not None:
            self.note = f"; the stop took {took_s:.1f} s"
            return
        killed = await self._kill("drained")
        self.note = f"; the stop was still running after {timeout_s:g} s, so " + (
            "its processes were killed (SIGKILL)" if killed else "killing them was tried and failed"
        )

    async def _stop_ended_within(self, timeout_s: float) -> float | None:
        """How long the unit's stop took, or None if it is still running after TIMEOUT_S: asked
        every STOP_POLL_S and once more at the end, right before a kill (KillUnit signals the
        unit's processes of that moment: a new process once the stop is over)."""
        clock = self.tools.clock
        began_mono = clock().mono
        while True:
            if await self._stopped():
                return clock().mono - began_mono
            left_s = timeout_s - (clock().mono - began_mono)
            if left_s <= 0:
                return None
            await asyncio.sleep(min(STOP_POLL_S, left_s))

    async def restart_unitless(self, why: str) -> RestartOutcome:
        """The root helper restarts the container at once (SIGKILL, then its start), and only if it
        is running, so a `docker stop` between the look and now still wins."""
        r = self.r
        helper = helper_unit("restart", r.name)
        result = await self.tools.sd.run_helper("restart", r.name, ACT_HELPER_TIMEOUT_S)
        elapsed_s = self.tools.clock().mono - self.issued.mono
        return _said(
            self.tools,
            r,
            result,
            f"container {r.container} restarted in {elapsed_s:.1f} s by {helper} "
            f"(docker restart --time 0: its processes were killed at once) ({why})",
            f"restart of container {r.container} ended with '{result}' after {elapsed_s:.1f} s; "
            f"see journalctl -u {helper}",
        )

    async def _stopped(self) -> bool:
        """The unit's stop is over: it is down, starting again, or has started since (a stop faster
        than one poll). Never judged from the new process, which must not be killed."""
        try:
            unit = await self.tools.sd.unit_info(self.r.unit)
        except SystemdError:
            return False
        return (
            unit.active_state in (ActiveState.INACTIVE, ActiveState.FAILED, ActiveState.ACTIVATING)
            or unit.inactive_exit_mono != self.started_before_mono
        )

    async def _kill(self, what: str) -> bool:
        if self.r.container is None:
            return await self._kill_unit(what)
        unit_killed, container_killed = await asyncio.gather(self._kill_unit(what), self._kill_container())
        return unit_killed and container_killed

    async def _kill_unit(self, what: str) -> bool:
        r = self.r
        try:
            await units.kill(self.tools.sd, r.unit)
            return True
        except SystemdError as e:
            # systemd may report a failure for the cgroup's other processes after the main one was
            # signalled ("Failed to send signal SIGKILL to auxiliary processes"): what counts is
            # whether the stop ended.
            for _ in range(5):
                if await self._stopped():
                    return True
                await asyncio.sleep(STOP_POLL_S)
            self.tools.journal.line(
                LogLine(
                    Priority.ERROR,
                    f"replica {r.name}: could not kill the processes of {what} {r.unit}: {e}; the restart goes on "
                    "with systemd's graceful stop (up to the unit's TimeoutStopSec)",
                    Decision.RESTART_FAILED,
                    r.name,
                    r.unit,
                )
            )
            return False

    async def _kill_container(self) -> bool:
        """SIGKILL the container through the root helper. The helper kills only the container that
        started before the restart was issued: the unit's own restart may start a new one under
        the same name before the helper gets to it."""
        r, journal = self.r, self.tools.journal
        request = self.tools.cfg.runtime_dir / f"kill-{r.name}.json"
        try:
            atomic_write(request, json.dumps({"started_before": self.issued.wall}).encode())
        except OSError as e:
            journal.send(Priority.ERROR, f"replica {r.name}: cannot write {request}: {e}")
            with contextlib.suppress(OSError):  # an older request would make the helper spare the hung one
                os.unlink(request)
        result = await self.tools.sd.run_helper("kill", r.name, ACT_HELPER_TIMEOUT_S)
        if result != JOB_DONE:
            journal.line(
                LogLine(
                    Priority.ERROR,
                    f"replica {r.name}: killing its container {r.container} failed: the helper ended with "
                    f"'{result}' (journalctl -u {helper_unit('kill', r.name)})",
                    Decision.RESTART_FAILED,
                    r.name,
                    r.unit,
                )
            )
        return result == JOB_DONE
