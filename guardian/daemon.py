"""The daemon: startup, main loop and shutdown as separate steps (uvicorn's shape).

Signal handlers only set flags; the loop acts on them between ticks. Each tick observes,
decides (policy, pure), acts (executor), writes the status file, then pings systemd's watchdog:
a tick that never completes means no WATCHDOG=1, and systemd restarts guardian.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Callable

from . import hazards, policy, thresholds
from .config import Config, ConfigError, load_config
from .executor import Executor
from .journal import Journal
from .liveness import Track
from .memory import MemorySample, gib, sample_memory
from .notify import Notifier
from .observe import observe_all, unit_or_error
from .probes import make_client
from .state import STATUS_FILE, CorruptState, StateStore, atomic_write_json, view
from .systemd import Systemd, SystemdError


class StartupError(Exception):
    pass


class Daemon:
    def __init__(self, cfg: Config, config_path: Path, journal: Journal | None = None,
                 notifier: Notifier | None = None, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.journal = journal or Journal()
        self.notifier = notifier or Notifier()
        self.clock = clock
        self.sd = Systemd()
        self.client = make_client()
        self.store = StateStore(cfg.state_dir)
        self.executor = Executor(cfg, self.sd, self.client, self.store, self.journal, clock)
        self.tracks: dict[str, Track] = {}
        self.persistent: dict = {}
        self.state_mtime: float | None = None
        self.memory: MemorySample | None = None
        self.hazards_logged: set[str] = set()
        self.rescan_hazards = True
        self.stop_requested = asyncio.Event()
        self.reload_requested = False
        self.wake = asyncio.Event()
        self.ticks = 0

    # --- signals: flags only ------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._on_stop)
        loop.add_signal_handler(signal.SIGINT, self._on_stop)
        loop.add_signal_handler(signal.SIGHUP, self._on_reload)

    def _on_stop(self) -> None:
        self.stop_requested.set()
        self.wake.set()

    def _on_reload(self) -> None:
        self.reload_requested = True
        self.wake.set()

    def _on_units_changed(self, reason: str) -> None:
        self.rescan_hazards = True

    # --- startup ------------------------------------------------------------------------
    async def startup(self) -> None:
        self.journal.send("info", f"guardian {_version()} starting with {self.config_path}")
        for line in thresholds.describe(self.cfg):
            self.journal.send("info", f"limits in effect: {line}")
        self._load_persistent(force=True)
        try:
            await self.sd.connect()
        except (SystemdError, OSError, asyncio.TimeoutError) as e:
            raise StartupError(f"cannot talk to systemd over the system bus: {e}") from None
        self.sd.on_units_changed(self._on_units_changed)
        await self.tick()
        self.journal.send("info", f"guardian ready: {self.status_line()}")
        self.notifier.ready(self.status_line())

    # --- one tick ---------------------------------------------------------------------
    async def tick(self) -> None:
        now = self.clock()
        self._load_persistent()
        if self.rescan_hazards:
            self.rescan_hazards = False
            await self.scan_hazards()
        observations = await observe_all(self.cfg, self.sd, self.client, now, self.executor.canaries, self.executor.outcomes)
        self.memory = await asyncio.to_thread(sample_memory)
        self.tracks, actions = policy.decide(self.tracks, observations, view(self.persistent), now, self.cfg)
        self.executor.perform(actions)
        self.write_status(now)
        self.ticks += 1

    async def scan_hazards(self) -> list[hazards.Hazard]:
        units = {}
        for r in self.cfg.replicas:
            units[r.unit], _ = await unit_or_error(self.sd, r.unit)
        try:
            enabled = await self.sd.enabled_service_conflicts()
        except SystemdError as e:
            self.journal.send("error", f"cannot list enabled unit files for the Conflicts= scan: {e}")
            enabled = {}
        found = hazards.find_hazards(self.cfg, units, enabled)
        for h in found:
            if h.key not in self.hazards_logged:
                self.journal.send("error", f"hazard: {h.message}", h.replica, h.unit, {"GUARDIAN_HAZARD": h.key})
        self.hazards_logged = {h.key for h in found}
        return found

    def _load_persistent(self, force: bool = False) -> None:
        try:
            mtime = self.store.path.stat().st_mtime
        except FileNotFoundError:
            mtime = None
        if not force and mtime == self.state_mtime and self.persistent:
            return
        try:
            self.persistent = self.store.read()
        except CorruptState as e:
            self.journal.send("error", str(e))
            self.persistent = self.store.update(lambda d: None)
        except OSError as e:
            self.journal.send("error", f"cannot read state in {self.store.dir}: {e}; keeping what was loaded")
            self.persistent = self.persistent or {"version": 1, "restarts": {}, "pauses": {}, "resumed_at": {}}
        try:
            self.state_mtime = self.store.path.stat().st_mtime
        except FileNotFoundError:
            self.state_mtime = None

    # --- status ------------------------------------------------------------------------
    def status_line(self) -> str:
        parts = []
        now = self.clock()
        pv = view(self.persistent) if self.persistent else None
        for r in self.cfg.replicas:
            t = self.tracks.get(r.name)
            state = t.state if t else "unknown"
            if pv is not None and policy.budget(r.name, pv, now, self.cfg).spent:
                state += " (gave up: restart budget spent)"
            parts.append(f"{r.name} {state}")
        mem = f"headroom {gib(self.memory.available_bytes)}" if self.memory else "headroom ?"
        return ", ".join(parts + [mem]) if parts else f"no replicas; {mem}"

    def status_dict(self, now: float) -> dict:
        pv = view(self.persistent)
        replicas = {}
        for r in self.cfg.replicas:
            t = self.tracks.get(r.name, Track())
            b = policy.budget(r.name, pv, now, self.cfg)
            replicas[r.name] = {
                "unit": r.unit, "url": r.url, "model": r.model, "state": t.state,
                "since": t.state_since, "evidence": t.evidence,
                "restarts_in_window": b.used, "restart_budget": b.limit, "gave_up": b.spent,
                "paused_until": (pv.pauses[r.name].until if r.name in pv.pauses else None),
                "paused": r.name in pv.pauses,
                "last_progress_at": t.last_progress_at,
            }
        mem = self.memory
        return {
            "pid": os.getpid(), "updated_at": now, "interval_s": self.cfg.interval_s, "dry_run": self.cfg.dry_run,
            "config": str(self.config_path), "status": self.status_line(), "replicas": replicas,
            "memory": None if mem is None else {
                "total_bytes": mem.total_bytes, "available_bytes": mem.available_bytes, "free_bytes": mem.free_bytes,
                "psi_some_avg10": mem.psi_some_avg10, "psi_full_avg10": mem.psi_full_avg10,
            },
        }

    def write_status(self, now: float) -> None:
        try:
            atomic_write_json(self.cfg.runtime_dir / STATUS_FILE, self.status_dict(now))
        except OSError as e:
            self.journal.send("error", f"cannot write {self.cfg.runtime_dir / STATUS_FILE}: {e}")

    # --- reload --------------------------------------------------------------------------
    def reload(self) -> None:
        self.reload_requested = False
        self.notifier.reloading()
        try:
            new = load_config(self.config_path)
        except ConfigError as e:
            self.journal.send("error", f"reload refused, keeping the running config: {e}")
            self.notifier.reloaded(self.status_line())
            return
        self.cfg = new
        self.executor.cfg = new
        self.store = StateStore(new.state_dir)
        self.executor.store = self.store
        self.tracks = {k: v for k, v in self.tracks.items() if new.replica(k) is not None}
        self.rescan_hazards = True
        self.journal.send("info", f"configuration reloaded from {self.config_path}")
        for line in thresholds.describe(new):
            self.journal.send("info", f"limits in effect: {line}")
        self._load_persistent(force=True)
        self.notifier.reloaded(self.status_line())

    # --- main loop and shutdown ------------------------------------------------------------
    async def main_loop(self) -> None:
        while not self.stop_requested.is_set():
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), self.cfg.interval_s)
            except asyncio.TimeoutError:
                pass
            if self.stop_requested.is_set():
                break
            if self.reload_requested:
                self.reload()
            await self.tick()
            self.notifier.watchdog(self.status_line())

    async def shutdown(self) -> None:
        self.notifier.stopping()
        left = await self.executor.drain(self.cfg.shutdown_timeout_s)
        if left:
            self.journal.send("warning", f"stopping with {left} task(s) cut short after {self.cfg.shutdown_timeout_s:g} s")
        await self.client.aclose()
        self.sd.close()
        self.journal.send("info", "guardian stopped")

    async def run(self) -> int:
        self.install_signal_handlers()
        try:
            await self.startup()
        except StartupError as e:
            self.journal.send("critical", f"guardian cannot start: {e}")
            return 1
        try:
            await self.main_loop()
        finally:
            await self.shutdown()
        return 0


def _version() -> str:
    from . import __version__

    return __version__
