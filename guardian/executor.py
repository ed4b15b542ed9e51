"""Executors: perform the policy's actions. Restarts and canaries run as tasks so that a
long systemd job or a hanging canary never holds up the loop; their results come back as
observations on a later tick."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Callable

import httpx

from . import gates, probes
from .config import Config, ReplicaConfig
from .journal import Journal
from .observations import CanaryResult, RestartOutcome
from .observe import port_owners, unit_or_error
from .memguard import LowerFraction, MemLog
from .policy import Action, LogLine, RestartUnit, StartCanary
from .state import CorruptState, StateStore, atomic_write, record_restart
from .systemd import Systemd, SystemdError


async def checked_restart(
    sd: Systemd, store: StateStore, journal: Journal, cfg: Config, r: ReplicaConfig, why: str,
    clock: Callable[[], float] = time.time, before_restart: Callable[[], None] | None = None,
    allow_failed: bool = False,
) -> RestartOutcome:
    """Re-check the unit gates on a fresh look, record the restart, then RestartUnit and wait.

    BEFORE_RESTART (the memory guard's env file write) runs only once the gates have passed."""
    unit, err = await unit_or_error(sd, r.unit)
    owner = (await port_owners(sd, {r.port}))[r.port]
    refusal = gates.unit_refusal(unit, owner, allow_failed) if err is None else gates.Refusal("dbus", err)
    if refusal is not None:
        journal.send("error", f"replica {r.name}: restart of {r.unit} refused on the re-check right before acting: "
                     f"{refusal.text()}", r.name, r.unit, {"GUARDIAN_DECISION": "refused", "GUARDIAN_GATE": refusal.gate})
        return RestartOutcome(r.unit, f"refused: {refusal.reason}", clock())
    if before_restart is not None:
        try:
            before_restart()
        except OSError as e:
            journal.send("error", f"replica {r.name}: not restarting {r.unit}: {e}", r.name, r.unit,
                         {"GUARDIAN_DECISION": "refused"})
            return RestartOutcome(r.unit, f"refused: {e}", clock())
    issued = clock()
    try:
        store.update(lambda d: record_restart(d, r.name, issued, cfg.watchdog.restart_window_s * 4))
    except CorruptState as e:
        journal.send("error", str(e))
    try:
        result = await sd.restart(r.unit, cfg.watchdog.restart_job_timeout_s)
    except SystemdError as e:
        result = f"error: {e}"
    elapsed = clock() - issued
    if result == "done":
        journal.send("info", f"replica {r.name}: restart job of {r.unit} done in {elapsed:.1f} s ({why}); "
                     "waiting for it to serve", r.name, r.unit, {"GUARDIAN_DECISION": "restarted"})
    else:
        journal.send("error", f"replica {r.name}: restart job of {r.unit} ended with '{result}' after {elapsed:.1f} s; "
                     f"see journalctl -u {r.unit}", r.name, r.unit, {"GUARDIAN_DECISION": "restart-failed"})
    return RestartOutcome(r.unit, result, clock())


class Executor:
    def __init__(self, cfg: Config, sd: Systemd, client: httpx.AsyncClient, store: StateStore, journal: Journal,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.sd = sd
        self.client = client
        self.store = store
        self.journal = journal
        self.clock = clock
        self.tasks: set[asyncio.Task] = set()
        self.canaries: dict[str, CanaryResult] = {}
        self.outcomes: dict[str, RestartOutcome] = {}

    def perform(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, LogLine):
                self.journal.send(a.priority, a.message, a.replica, a.unit, a.fields)
            elif isinstance(a, StartCanary):
                self._spawn(self._canary(a.replica))
            elif isinstance(a, RestartUnit):
                self._spawn(self._restart(a))
            elif isinstance(a, MemLog):
                self.journal.send(a.priority, a.message, a.replica, a.unit, {"GUARDIAN_DECISION": "memory"}
                                  if a.priority == "warning" else {})
            elif isinstance(a, LowerFraction):
                self._spawn(self._lower(a))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _canary(self, name: str) -> None:
        r = self.cfg.replica(name)
        if r is not None:
            self.canaries[name] = await probes.canary(self.client, r, self.clock())

    async def _restart(self, a: RestartUnit) -> None:
        r = self.cfg.replica(a.replica)
        if r is None:
            return
        try:
            outcome = await checked_restart(self.sd, self.store, self.journal, self.cfg, r, f"{a.state}: {a.evidence}", self.clock)
        except Exception as e:  # an executor bug must not kill the loop; say it and move on
            self.journal.send("error", f"replica {r.name}: restart of {r.unit} failed: {type(e).__name__}: {e}", r.name, r.unit)
            outcome = RestartOutcome(r.unit, f"error: {e}", self.clock())
        self.outcomes[a.replica] = outcome

    def env_path(self, replica: str) -> Path:
        return self.cfg.env_dir / f"{replica}.env"

    async def _lower(self, a: LowerFraction) -> None:
        r = self.cfg.replica(a.replica)
        if r is None:
            return
        path = self.env_path(a.replica)

        def write() -> None:
            atomic_write(path, f"# written by guardian's memory guard\nGPU_MEMORY_UTILIZATION={a.new:g}\n".encode())

        if not a.restart:
            try:
                write()
                self.journal.send("warning", f"replica {r.name}: wrote GPU_MEMORY_UTILIZATION={a.new:g} to {path}; "
                                  f"systemd's next start of {r.unit} uses it", r.name, r.unit, {"GUARDIAN_DECISION": "memory"})
            except OSError as e:
                self.journal.send("error", f"replica {r.name}: cannot write {path}: {e}", r.name, r.unit)
            return
        try:
            outcome = await checked_restart(self.sd, self.store, self.journal, self.cfg, r,
                                            f"memory: {a.old:g} -> {a.new:g}", self.clock, before_restart=write,
                                            allow_failed=a.retry)
        except Exception as e:
            self.journal.send("error", f"replica {r.name}: lowering restart of {r.unit} failed: {type(e).__name__}: {e}", r.name, r.unit)
            outcome = RestartOutcome(r.unit, f"error: {e}", self.clock())
        self.outcomes[a.replica] = outcome

    async def drain(self, timeout_s: float) -> int:
        """Wait up to TIMEOUT_S for running tasks (a restart job in flight), then cancel the rest."""
        if not self.tasks:
            return 0
        _done, pending = await asyncio.wait(set(self.tasks), timeout=timeout_s)
        for t in pending:
            t.cancel()
        return len(pending)
