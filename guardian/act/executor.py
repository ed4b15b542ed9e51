"""The dispatcher: every action the core decides goes through Executor.perform, to exactly one
handler (the match is exhaustive: mypy --strict proves every Action type is handled).

Restarts, canaries and changes of a replica's fraction run as tasks, so that a long systemd job or
a hanging canary never holds up the loop; their results come back to the observer on a later tick
(take_results). The proxy's work (SyncProxy: ProxySync applies only a change) and the fleet's
slots (a SlotKeeper) are handed to those parts, and every action is counted for the metrics (a
Counter). Each part is given at construction; one not given (a test's executor) is a no-op at
its one place in the match. Nothing here decides.

An operator's request is answered (AnswerRequest, and a requested restart once its job ended)
and told what it waits for (RequestWaits) in the state file, where its `guardian restart` reads
them; with an Asker given (that command deciding alone, with no daemon running: cli/requests.py),
it is told directly instead.

A lowering (SetFraction with new < old) records where it lowered from as the replica's base
fraction in the state file (act/state.py) right before the env file is written (after the gates
of its restart pass: a lowering refused records none; before the write, so that a crash between
leaves the base recorded): the memory guard raises a fraction back toward its base and never
above it, and a lowered fraction with no base recorded is never raised (a failed record is said,
and the lowering goes on).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import replace
from typing import Any, assert_never

import httpx

from ..config import Config, ReplicaConfig
from ..core.actions import (
    AcquireSlot,
    Action,
    AnswerRequest,
    LogLine,
    RecordCanaryLatencies,
    ReleaseSlot,
    RequestWaits,
    RestartUnit,
    SetFraction,
    StartCanary,
    SyncProxy,
    WarmUp,
)
from ..core.observations import CanaryResult, RestartOutcome, WarmupResult
from ..core.vocab import Decision, Gate, Priority
from ..core.watchdog.track import Track
from ..observe import probes
from ..observe.clock import Now
from ..observe.memory import env_path
from ..observe.replicas import Results
from .part import Asker, Counter, SlotKeeper
from .proxy import ProxySync
from .restart import RestartOrder, Tools, checked_restart, write_fraction
from .state import (
    CorruptState,
    StateDoc,
    StateStore,
    record_answer,
    record_canary_latencies,
    record_steps,
    record_waiting,
)
from .warmup import warm_up

# What a warm-up that raised says of its exception, in its D14 line: the cause, never a whole
# structure a hostile file could make of it (the journal would cut it at 8 KiB anyway).
MAX_WARMUP_ERROR_CHARS = 500


def _unpinned(_name: str) -> str | None:
    return None


class Executor:
    def __init__(
        self,
        tools: Tools,
        client: httpx.AsyncClient,
        proxy: ProxySync | None = None,
        slots: SlotKeeper | None = None,
        counter: Counter | None = None,
        asker: Asker | None = None,
    ) -> None:
        self.tools = tools
        self.client = client  # the canaries'
        self.proxy = proxy
        self.slots = slots
        self.counter = counter
        self.asker = asker  # None: requests are answered in the state file (see the top)
        # Where a replica's canaries connect: the address its probes were pinned to at the last
        # tick (observe/addresses.py, set by whoever runs the observer); None: its URL's host.
        self.address_of: Callable[[str], str | None] = _unpinned
        self.tasks: set[asyncio.Task[None]] = set()
        # What the tasks brought back, until the observer takes it.
        # A replica may have two canaries in flight (liveness: a closer look): their results are
        # handed over one a tick, oldest first.
        self._canaries: dict[str, list[CanaryResult]] = {}
        self._outcomes: dict[str, RestartOutcome] = {}
        self._warmups: dict[str, WarmupResult] = {}

    @property
    def cfg(self) -> Config:
        return self.tools.cfg

    def perform(self, actions: Iterable[Action], tracks: Mapping[str, Track], at: Now) -> None:
        """Perform ACTIONS, decided AT from the replicas' TRACKS, then count them: counting comes
        after every action is under way, so that nothing in the metrics can hold one back."""
        actions = list(actions)
        for action in actions:
            self._dispatch(action)
        if self.counter is None:
            return
        for action in actions:
            self.counter.count(action, tracks, at)

    def _dispatch(self, action: Action) -> None:
        match action:
            case LogLine():
                self.tools.journal.line(action)
            case StartCanary():
                self._spawn(self._canary(action.replica, action.timeout_s, action.sent_at))
            case WarmUp():
                self._spawn(self._warm(action))
            case RestartUnit():
                self._spawn(self._restart(action))
            case SetFraction():
                self._spawn(self._set_fraction(action))
            case AnswerRequest():
                self._answer(action)
            case RequestWaits():
                self._record_waiting(action)
            case RecordCanaryLatencies():
                self._record_canary_latencies(action)
            case AcquireSlot():
                if self.slots is not None:
                    self.slots.acquire_slot(action)
            case ReleaseSlot():
                if self.slots is not None:
                    self.slots.release_slot(action)
            case SyncProxy():
                if self.proxy is not None:
                    self.proxy.sync(action.down)
            case _:
                assert_never(action)

    def take_results(self) -> Results:
        """What the tasks brought back since the last call, handed over once."""
        canaries = {name: got.pop(0) for name, got in self._canaries.items() if got}
        self._canaries = {name: got for name, got in self._canaries.items() if got}
        results = Results(canaries, self._outcomes, self._warmups)
        self._outcomes, self._warmups = {}, {}
        return results

    def reload(self, cfg: Config) -> None:
        self.tools = replace(self.tools, cfg=cfg, store=StateStore(cfg.state_dir))

    async def stop(self, timeout_s: float) -> int:
        """Wait up to TIMEOUT_S for running tasks (a restart job in flight), then cancel the rest."""
        if not self.tasks:
            return 0
        _done, pending = await asyncio.wait(set(self.tasks), timeout=timeout_s)
        for task in pending:
            task.cancel()
        return len(pending)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _write_state(self, change: Callable[[StateDoc], None], what: str) -> OSError | None:
        """CHANGE to the state file. A corrupt file is said here; a write that failed is said as
        "cannot record WHAT" when WHAT is given, else returned for the caller to say."""
        store, journal = self.tools.store, self.tools.journal
        try:
            store.update(change)
        except CorruptState as e:
            journal.send(Priority.ERROR, str(e))
        except OSError as e:
            if not what:
                return e
            journal.send(Priority.ERROR, f"cannot record {what} in {store.dir}: {e}")
        return None

    def _answer(self, answer: AnswerRequest) -> None:
        if self.asker is not None:
            self.asker.answer(answer)
            return
        clock = self.tools.clock
        self._write_state(lambda d: record_answer(d, answer, clock()), "the answer to a restart request")

    def _record_waiting(self, action: RequestWaits) -> None:
        """What an open request waits for, for the waiting `guardian restart` to print. Not kept: said
        (the journal line of the wait was said too), and the request waits all the same."""
        if self.asker is not None:
            self.asker.waits(action)
            return
        self._write_state(
            lambda d: record_waiting(d, action.request_id, action.text), "what a restart request waits for"
        )

    def _record_canary_latencies(self, action: RecordCanaryLatencies) -> None:
        """Kept in the state file, so that a guardian restarted or reloaded need not learn the
        canary deadlines anew. Not kept: said, and the deadlines still hold in memory."""

        def both(d: StateDoc) -> None:
            record_canary_latencies(d, action.latencies)
            record_steps(d, action.steps, self.tools.clock())

        self._write_state(both, "canary latencies and steps")

    def _dropped(self, what: str, replica: str, request_id: str | None = None) -> None:
        """An action for a replica the config no longer names (a reload removed it while the action was
        on its way): said, never silently dropped; an operator's request in it is answered, refused."""
        why = f"replica {replica} is no longer in the config (reloaded since it was decided)"
        self.tools.journal.line(LogLine(Priority.ERROR, f"{what} not performed: {why}", Decision.REFUSED, replica))
        if request_id is not None:
            self._answer(AnswerRequest(request_id, replica, False, f"refused: {why}"))

    async def _canary(self, name: str, timeout_s: float, sent_at: float | None) -> None:
        r = self.cfg.replica(name)
        if r is None:
            self._dropped("a canary", name)
            return
        started = sent_at if sent_at is not None else self.tools.clock().mono
        result = await probes.canary(self.client, r, started, timeout_s, self.address_of(name))
        self._canaries.setdefault(name, []).append(result)

    async def _warm(self, action: WarmUp) -> None:
        r = self.cfg.replica(action.replica)
        if r is None or r.warmup_file is None:
            why = "its warm-up file is no longer in the config" if r is not None else None
            if why is None:
                self._dropped("a warm-up", action.replica)
            else:
                # the core waits for a result: a warm-up of nothing, said as such, marks it up (D16)
                self._warmups[action.replica] = WarmupResult(action.started_at, 0, 0, 0.0, why)
            return
        began = time.monotonic()
        try:
            result = await warm_up(self.client, r, action.started_at, action.timeout_s, self.address_of(r.name))
        except Exception as e:  # noqa: BLE001 - a warm-up that raises is a failed one (D14 at warning), never silence
            cause = f"the warm-up raised {type(e).__name__}: {e}"[:MAX_WARMUP_ERROR_CHARS]
            result = WarmupResult(action.started_at, 0, 0, time.monotonic() - began, cause)
        kept = self._warmups.get(r.name)
        if kept is None or kept.started_at <= result.started_at:  # a late older one never hides a newer one
            self._warmups[r.name] = result

    async def _guarded(self, order: RestartOrder, what: str) -> RestartOutcome:
        """The checked restart; an exception out of it is said and is the outcome."""
        r = order.replica
        try:
            return await checked_restart(self.tools, order)
        except Exception as e:  # noqa: BLE001 - an executor bug must not kill the loop; say it and move on
            self.tools.journal.line(
                LogLine(
                    Priority.ERROR,
                    f"replica {r.name}: {what} of {r.unit} failed: {type(e).__name__}: {e}",
                    Decision.RESTART_FAILED,
                    r.name,
                    r.unit,
                )
            )
            return RestartOutcome(r.unit, f"error: {e}")

    async def _restart(self, action: RestartUnit) -> None:
        r = self.cfg.replica(action.replica)
        if r is None:
            self._dropped(f"a restart ({action.kind})", action.replica, action.request_id)
            return
        order = RestartOrder(
            r,
            f"{action.kind}: {action.evidence}",
            kill_first=action.kill_first,
            stop_timeout_s=action.stop_timeout_s,
            announce=action.said,
            may_lower=action.may_lower,
        )
        outcome = await self._guarded(order, "restart")
        self._outcomes[action.replica] = outcome
        if action.request_id is not None:
            self._answer(AnswerRequest(action.request_id, r.name, outcome.ok, f"{r.unit}: {outcome.result}"))

    async def _set_fraction(self, action: SetFraction) -> None:
        r = self.cfg.replica(action.replica)
        if r is None:
            self._dropped(f"a change of fraction ({action.old:g} -> {action.new:g})", action.replica)
            return

        def write() -> None:
            write_fraction(self.tools, r, action.old, action.new)  # its base first, if it lowers (see the top)

        if not action.restart:
            self._write_fraction(r, action, write)
            return
        order = RestartOrder(
            r,
            f"memory: {action.old:g} -> {action.new:g}",
            allow_failed=action.retry,
            kill_first=action.kill_first,
            stop_timeout_s=action.stop_timeout_s,
            before_restart=write,
            fraction=action.new,
            killed_what="starting",  # only the start guard kills first here (a start it stops)
        )
        what = "raise restart" if action.new > action.old else "lowering restart"
        self._outcomes[action.replica] = await self._guarded(order, what)

    def _write_fraction(self, r: ReplicaConfig, action: SetFraction, write: Callable[[], None]) -> None:
        """Only the env file: systemd is restarting the unit by itself, and its next start reads it."""
        path = env_path(self.cfg, action.replica)
        try:
            write()
        except OSError as e:
            self.tools.journal.line(
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
        self.tools.journal.line(
            LogLine(
                Priority.WARNING,
                f"replica {r.name}: wrote GPU_MEMORY_UTILIZATION={action.new:g} "
                f"to {path}; systemd's next start of {r.unit} uses it",
                Decision.MEMORY,
                r.name,
                r.unit,
            )
        )
