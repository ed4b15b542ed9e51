"""Executors: perform the core's actions. Restarts and canaries run as tasks so that a long
systemd job or a hanging canary never holds up the loop; their results come back as
observations on a later tick. Nothing here decides: the one check it makes, the unit gates
again on a fresh view right before the restart call, is the core's own pure function."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable, Coroutine
from typing import Any

import httpx

from ..config import Config, ReplicaConfig
from ..core import gates
from ..core.actions import (
    Action,
    AnswerRequest,
    LogLine,
    LowerFraction,
    RecordCanaryLatencies,
    RestartUnit,
    StartCanary,
)
from ..core.container import helper_unit
from ..core.observations import CanaryResult, RestartOutcome, UnitInfo
from ..core.rules import Refusal
from ..core.vocab import ActiveState, Decision, Gate, HeldBy, Priority
from ..observe import probes
from ..observe.clock import Now
from ..observe.clock import now as clock_now
from ..observe.containers import ContainerWatch, run_helper
from ..observe.memory import env_path
from ..observe.replicas import port_owners, unit_or_error
from ..observe.systemd import JOB_DONE, Systemd, SystemdError
from .journal import Journal
from .state import (
    CorruptState,
    StateStore,
    atomic_write,
    record_answer,
    record_canary_latencies,
    record_restart,
)

STOP_POLL_S = 0.2  # how often a bounded stop asks systemd whether the unit is still stopping
ACT_HELPER_TIMEOUT_S = 30.0  # a kill or restart by the container helper (a task: the loop never waits for it)


async def checked_restart(
    sd: Systemd,
    store: StateStore,
    journal: Journal,
    cfg: Config,
    r: ReplicaConfig,
    why: str,
    clock: Callable[[], Now] = clock_now,
    before_restart: Callable[[], None] | None = None,
    allow_failed: bool = False,
    kill_first: bool = False,
    stop_timeout_s: float | None = None,
    containers: ContainerWatch | None = None,
) -> RestartOutcome:
    """Re-check the unit gates on a fresh look, record the restart, then RestartUnit and wait.

    BEFORE_RESTART (the memory guard's env file write) runs only once the gates have passed.
    KILL_FIRST: SIGKILL the unit's processes once the job is queued (a hung replica).
    STOP_TIMEOUT_S: a bounded stop (a drained replica): its processes are killed if the unit is
    still stopping after that long; the stop's duration is said either way.
    CONTAINERS: a replica in a container has its container killed beside its unit (the unit's
    cgroup holds only the engine's CLI or conmon), and a unit-less one is restarted by the root
    helper (`docker restart --time 0`), not by systemd."""
    containers = containers if containers is not None else ContainerWatch(sd)
    unit, refusal = await _fresh_look(sd, r, containers, allow_failed)
    if refusal is not None:
        journal.line(
            LogLine(
                Priority.ERROR,
                f"replica {r.name}: restart of {r.unit} refused on the re-check right before acting: {refusal.text}",
                Decision.REFUSED,
                r.name,
                r.unit,
                gate=refusal.gate,
                rule=refusal.rule,
            )
        )
        return RestartOutcome(r.unit, f"refused: {refusal.reason}", clock().wall)
    if before_restart is not None:
        try:
            before_restart()
        except OSError as e:
            journal.line(
                LogLine(
                    Priority.ERROR,
                    f"replica {r.name}: not restarting {r.unit}: {e}",
                    Decision.REFUSED,
                    r.name,
                    r.unit,
                    gate=Gate.ENV_FILE,
                )
            )
            return RestartOutcome(r.unit, f"refused: {e}", clock().wall)
    issued = clock()
    try:
        store.update(lambda d: record_restart(d, r.name, issued, cfg.watchdog.restart_window_s * 4))
    except CorruptState as e:
        journal.send(Priority.ERROR, str(e))
    kill_note = ""

    started_before = unit.inactive_exit_mono if unit is not None else None

    async def stopped() -> bool:
        """The unit's stop is over: it is down, starting again, or has started since (a stop faster
        than one poll). Never judged from the new process, which must not be killed."""
        try:
            now_unit = await sd.unit_info(r.unit)
        except SystemdError:
            return False
        return (
            now_unit.active_state in (ActiveState.INACTIVE, ActiveState.FAILED, ActiveState.ACTIVATING)
            or now_unit.inactive_exit_mono != started_before
        )

    async def kill(what: str) -> bool:
        if r.container is None:
            return await kill_unit(what)
        unit_killed, container_killed = await asyncio.gather(
            kill_unit(what), _kill_container(sd, journal, cfg, r, issued)
        )
        return unit_killed and container_killed

    async def kill_unit(what: str) -> bool:
        try:
            await sd.kill(r.unit)
            return True
        except SystemdError as e:
            # systemd may report a failure for the cgroup's other processes after the main one was
            # signalled ("Failed to send signal SIGKILL to auxiliary processes"): what counts is
            # whether the stop ended.
            for _ in range(5):
                if await stopped():
                    return True
                await asyncio.sleep(STOP_POLL_S)
            journal.line(
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

    async def hung_kill() -> None:
        nonlocal kill_note
        if await kill("hung"):
            kill_note = "; its processes were killed (SIGKILL) as the job began"
        else:
            kill_note = "; killing its processes failed, so the stop waited for the unit's own stop"

    async def bounded_stop() -> None:
        nonlocal kill_note
        assert stop_timeout_s is not None
        began = clock().mono
        while clock().mono - began < stop_timeout_s:
            if await stopped():
                kill_note = f"; the stop took {clock().mono - began:.1f} s"
                return
            await asyncio.sleep(STOP_POLL_S)
        killed = await kill("drained")
        kill_note = f"; the stop was still running after {stop_timeout_s:g} s, so " + (
            "its processes were killed (SIGKILL)" if killed else "killing them was tried and failed"
        )

    if r.unitless:
        return await _restart_unitless(sd, journal, r, why, issued, clock)
    during = hung_kill if kill_first else bounded_stop if stop_timeout_s is not None else None
    try:
        result = await sd.restart(
            r.unit,
            cfg.watchdog.restart_job_timeout_s,
            start_if_stopped=allow_failed,
            kill=during,
        )
    except SystemdError as e:
        journal.line(
            LogLine(
                Priority.ERROR,
                f"replica {r.name}: restart of {r.unit} could not be issued: {e}",
                Decision.RESTART_FAILED,
                r.name,
                r.unit,
            )
        )
        return RestartOutcome(r.unit, f"error: {e}", clock().wall)
    elapsed = clock().mono - issued.mono
    return _said(
        journal,
        r,
        result,
        f"restart job of {r.unit} done in {elapsed:.1f} s{kill_note} ({why})",
        f"restart job of {r.unit} ended with '{result}' after {elapsed:.1f} s; see journalctl -u {r.unit}",
        clock,
    )


def _said(
    journal: Journal, r: ReplicaConfig, result: str, done: str, failed: str, clock: Callable[[], Now]
) -> RestartOutcome:
    """The restart's end, one line at the priority it deserves, as the outcome for the next tick."""
    ok = result == JOB_DONE
    journal.line(
        LogLine(
            Priority.INFO if ok else Priority.ERROR,
            f"replica {r.name}: " + (f"{done}; waiting for it to serve" if ok else failed),
            Decision.RESTARTED if ok else Decision.RESTART_FAILED,
            r.name,
            r.unit,
        )
    )
    return RestartOutcome(r.unit, result, clock().wall, issued=True, ok=ok)


async def _fresh_look(
    sd: Systemd, r: ReplicaConfig, containers: ContainerWatch, allow_failed: bool
) -> tuple[UnitInfo | None, Refusal | None]:
    """The unit (or a unit-less container as one) and the port's holder looked at afresh, and the
    first gate that refuses. A container holding the port is judged on a fresh helper report."""
    unit, err = await containers.unitless_view(r) if r.unitless else await unit_or_error(sd, r.unit)
    owner = (await port_owners(sd, {r.port}))[r.port]
    if r.container is not None:
        if isinstance(owner, HeldBy) and owner.unit != r.unit:
            await containers.refresh(r, force=True)
        owner = (await containers.owners([r], {r.port: owner}))[r.port]
    return unit, gates.unit_refusal(unit, owner, allow_failed, unit_error=err)


async def _kill_container(sd: Systemd, journal: Journal, cfg: Config, r: ReplicaConfig, issued: Now) -> bool:
    """SIGKILL a hung replica's container through the root helper. The helper kills only the
    container that started before ISSUED: the unit's own restart may start a new one under the
    same name before the helper gets to it."""
    request = cfg.runtime_dir / f"kill-{r.name}.json"
    try:
        atomic_write(request, json.dumps({"started_before": issued.wall}).encode())
    except OSError as e:
        journal.send(Priority.ERROR, f"replica {r.name}: cannot write {request}: {e}")
        with contextlib.suppress(OSError):  # an older request would make the helper spare the hung one
            os.unlink(request)
    result = await run_helper(sd, "kill", r.name, ACT_HELPER_TIMEOUT_S)
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


async def _restart_unitless(
    sd: Systemd, journal: Journal, r: ReplicaConfig, why: str, issued: Now, clock: Callable[[], Now]
) -> RestartOutcome:
    """A container that no unit runs: the root helper restarts it at once (SIGKILL, then its
    start), and only if it is running, so a `docker stop` between the look and now still wins."""
    helper = helper_unit("restart", r.name)
    result = await run_helper(sd, "restart", r.name, ACT_HELPER_TIMEOUT_S)
    elapsed = clock().mono - issued.mono
    return _said(
        journal,
        r,
        result,
        f"container {r.container} restarted in {elapsed:.1f} s by {helper} "
        f"(docker restart --time 0: its processes were killed at once) ({why})",
        f"restart of container {r.container} ended with '{result}' after {elapsed:.1f} s; see journalctl -u {helper}",
        clock,
    )


class Executor:
    def __init__(
        self,
        cfg: Config,
        sd: Systemd,
        client: httpx.AsyncClient,
        store: StateStore,
        journal: Journal,
        clock: Callable[[], Now] = clock_now,
    ) -> None:
        self.cfg = cfg
        self.sd = sd
        self.client = client
        self.store = store
        self.journal = journal
        self.clock = clock
        self.tasks: set[asyncio.Task[None]] = set()
        # Results for the next tick's observation.
        self.canaries: dict[str, CanaryResult] = {}
        self.outcomes: dict[str, RestartOutcome] = {}
        self.containers = ContainerWatch(sd)

    def perform(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, LogLine):
                self.journal.line(a)
            elif isinstance(a, StartCanary):
                self._spawn(self._canary(a.replica, a.timeout_s))
            elif isinstance(a, RestartUnit):
                self._spawn(self._restart(a))
            elif isinstance(a, LowerFraction):
                self._spawn(self._lower(a))
            elif isinstance(a, AnswerRequest):
                self.answer(a.request_id, a.replica, a.ok, a.message)
            elif isinstance(a, RecordCanaryLatencies):
                self.record_canary_latencies(a)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def answer(self, request_id: str, replica: str, ok: bool, message: str) -> None:
        try:
            self.store.update(lambda d: record_answer(d, request_id, replica, ok, message, self.clock()))
        except CorruptState as e:
            self.journal.send(Priority.ERROR, str(e))
        except OSError as e:
            self.journal.send(Priority.ERROR, f"cannot record the answer to a restart request in {self.store.dir}: {e}")

    def record_canary_latencies(self, a: RecordCanaryLatencies) -> None:
        """Kept in the state file, so that a guardian restarted or reloaded need not learn the
        canary deadlines anew. Not kept: said, and the deadlines still hold in memory."""
        try:
            self.store.update(lambda d: record_canary_latencies(d, a.latencies))
        except CorruptState as e:
            self.journal.send(Priority.ERROR, str(e))
        except OSError as e:
            self.journal.send(Priority.ERROR, f"cannot record canary latencies in {self.store.dir}: {e}")

    async def _canary(self, name: str, timeout_s: float) -> None:
        r = self.cfg.replica(name)
        if r is not None:
            self.canaries[name] = await probes.canary(self.client, r, self.clock().mono, timeout_s)

    async def _guarded(
        self, r: ReplicaConfig, what: str, run: Callable[[], Coroutine[Any, Any, RestartOutcome]]
    ) -> RestartOutcome:
        try:
            return await run()
        except Exception as e:  # noqa: BLE001 - an executor bug must not kill the loop; say it and move on
            self.journal.line(
                LogLine(
                    Priority.ERROR,
                    f"replica {r.name}: {what} of {r.unit} failed: {type(e).__name__}: {e}",
                    Decision.RESTART_FAILED,
                    r.name,
                    r.unit,
                )
            )
            return RestartOutcome(r.unit, f"error: {e}", self.clock().wall)

    async def _restart(self, a: RestartUnit) -> None:
        r = self.cfg.replica(a.replica)
        if r is None:
            return
        outcome = await self._guarded(
            r,
            "restart",
            lambda: checked_restart(
                self.sd,
                self.store,
                self.journal,
                self.cfg,
                r,
                f"{a.kind}: {a.evidence}",
                self.clock,
                kill_first=a.kill_first,
                stop_timeout_s=a.stop_timeout_s,
                containers=self.containers,
            ),
        )
        self.outcomes[a.replica] = outcome
        if a.request_id is not None:
            self.answer(a.request_id, r.name, outcome.ok, f"{r.unit}: {outcome.result}")

    async def _lower(self, a: LowerFraction) -> None:
        r = self.cfg.replica(a.replica)
        if r is None:
            return
        path = env_path(self.cfg, a.replica)

        def write() -> None:
            atomic_write(path, f"# written by guardian's memory guard\nGPU_MEMORY_UTILIZATION={a.new:g}\n".encode())

        if not a.restart:
            try:
                write()
                self.journal.line(
                    LogLine(
                        Priority.WARNING,
                        f"replica {r.name}: wrote GPU_MEMORY_UTILIZATION={a.new:g} "
                        f"to {path}; systemd's next start of {r.unit} uses it",
                        Decision.MEMORY,
                        r.name,
                        r.unit,
                    )
                )
            except OSError as e:
                self.journal.line(
                    LogLine(
                        Priority.ERROR,
                        f"replica {r.name}: cannot write {path}: {e}",
                        Decision.REFUSED,
                        r.name,
                        r.unit,
                        gate=Gate.ENV_FILE,
                    )
                )
            return
        self.outcomes[a.replica] = await self._guarded(
            r,
            "lowering restart",
            lambda: checked_restart(
                self.sd,
                self.store,
                self.journal,
                self.cfg,
                r,
                f"memory: {a.old:g} -> {a.new:g}",
                self.clock,
                before_restart=write,
                allow_failed=a.retry,
                stop_timeout_s=a.stop_timeout_s,
                containers=self.containers,
            ),
        )

    async def finish(self, timeout_s: float) -> int:
        """Wait up to TIMEOUT_S for running tasks (a restart job in flight), then cancel the rest."""
        if not self.tasks:
            return 0
        _done, pending = await asyncio.wait(set(self.tasks), timeout=timeout_s)
        for t in pending:
            t.cancel()
        return len(pending)
