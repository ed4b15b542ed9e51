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
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Callable

import psutil

from . import hazards, memguard, policy, probes, thresholds, unitlog
from .config import Config, ConfigError, ReplicaConfig, load_config
from .executor import Executor
from .journal import Journal
from .liveness import Track
from .memory import MemorySample, gib, sample_memory
from .notify import Notifier
from .nvml import Nvml
from .wiring import read_env_fraction, wiring_problem
from .observe import PortOwnerCache, UnitInfoCache, observe_all, unit_or_error
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
        self.tick_durations_s: deque[float] = deque(maxlen=1000)
        self.last_tick_started_mono = time.monotonic()
        self.last_ping_mono: float | None = None
        self.max_ping_gap_s = 0.0
        self.memtrack = memguard.MemTrack()
        self.nvml: Nvml | None = None
        self.wiring: dict[str, str | None] = {}
        self.port_cache = PortOwnerCache()
        self.unit_cache = UnitInfoCache()

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
        self.unit_cache.invalidate()  # enablement, masks and Conflicts= may have changed

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
        if self.cfg.memory.enabled:
            self.nvml = Nvml()
            self.journal.send("info", f"memory guard: {self.nvml.note}")
        await self.tick()
        self.journal.send("info", f"guardian ready: {self.status_line()}")
        self.notifier.ready(self.status_line())

    # --- one tick ---------------------------------------------------------------------
    async def tick(self) -> None:
        started = time.monotonic()
        self.last_tick_started_mono = started
        try:
            await self._tick()
        finally:
            self.tick_durations_s.append(time.monotonic() - started)

    async def _tick(self) -> None:
        now = self.clock()
        self._load_persistent()
        if self.rescan_hazards:
            self.rescan_hazards = False
            await self.scan_hazards()
            if self.cfg.memory.enabled:
                await self.scan_wiring()
        observations = await observe_all(self.cfg, self.sd, self.client, now, self.executor.canaries, self.executor.outcomes,
                                         self.port_cache, self.unit_cache)
        # Judge as of when the answers were in: a probe that hung for its whole timeout has
        # shown no answer for that long, and the tick started before it was sent.
        now = self.clock()
        self.memory = await asyncio.to_thread(sample_memory)
        self.tracks, actions = policy.decide(self.tracks, observations, view(self.persistent), now, self.cfg)
        self.executor.perform(actions)
        if self.cfg.memory.enabled:
            await self.memory_step(now, observations)
        self.write_status(now)
        self.ticks += 1

    # --- memory guard ---------------------------------------------------------------------
    async def memory_step(self, now: float, observations: dict) -> None:
        if self.nvml is None:  # turned on by a reload
            self.nvml = Nvml()
            self.journal.send("info", f"memory guard: {self.nvml.note}")
        mv = await self.memory_view(now, observations)
        self.memtrack, actions = memguard.decide(self.memtrack, mv, now, self.cfg)
        for a in actions:
            if isinstance(a, memguard.LowerFraction) and a.restart and a.replica in self.tracks:
                # The watchdog keeps out of it, and no other restart starts, until the job is done.
                self.tracks[a.replica] = replace(self.tracks[a.replica], restart_in_flight=True, restart_issued_at=now)
        self.executor.perform(actions)

    async def memory_view(self, now: float, observations: dict) -> memguard.MemoryView:
        m = self.cfg.memory
        sample = self.memory
        total = m.device_total_bytes or (self.nvml.device_total_bytes() if self.nvml else None) or sample.total_bytes
        gpu_by_pid = await asyncio.to_thread(self.nvml.process_memory) if self.nvml else None
        pv = view(self.persistent)
        in_flight = any(t.restart_in_flight for t in self.tracks.values())
        replicas = []
        for r in self.cfg.replicas:
            t = self.tracks.get(r.name, Track())
            obs = observations.get(r.name)
            unit = obs.unit if obs else None
            running = t.last_sample.gpu_memory_utilization if t.last_sample else None
            configured = read_env_fraction(self.executor.env_path(r.name))
            usage = None
            if gpu_by_pid and unit is not None and unit.main_pid:
                usage = sum(gpu_by_pid.get(pid, 0) for pid in _process_tree(unit.main_pid)) or None
            failure = None
            p = self.memtrack.pending
            if p is not None and p.replica == r.name and t.state not in memguard.SERVING:
                failure = await unitlog.start_error(r.unit, p.issued_at, p.new)
            replicas.append(memguard.ReplicaMemory(
                name=r.name, unit=r.unit, model=r.model, fraction=configured if configured is not None else running,
                running_fraction=running, started_at=unit.inactive_exit_ts if unit else None,
                wiring_problem=self.wiring.get(r.name, "wiring not checked yet"), state=t.state, usage_bytes=usage,
                start_failure=failure, startup_grace_s=r.startup_grace_s))
        consumers, peers = "", ()
        if sample.available_bytes < m.min_headroom_bytes:
            consumers = await self._largest_consumers()
            peers = tuple(await self._serving_peers())
        blocked = {}
        for r in self.cfg.replicas:
            b = policy.restart_blocker(r.name, self.tracks, pv, now, self.cfg, in_flight)
            if b is not None:
                blocked[r.name] = b[2]
        results = {n: o.restart_outcome.result for n, o in observations.items() if o.restart_outcome is not None}
        return memguard.MemoryView(sample, total, tuple(replicas), peers, consumers, blocked, results)

    async def _largest_consumers(self) -> str:
        try:
            units = await self.sd.largest_units(3)
        except SystemdError:
            units = []
        procs = await asyncio.to_thread(_largest_processes, 2)
        return ", ".join([f"{n} {gib(b)}" for n, b in units] + [f"{n} (pid {pid}) {gib(b)}" for n, pid, b in procs])

    async def _serving_peers(self) -> list[str]:
        m = self.cfg.memory
        models = {r.model for r in self.cfg.replicas}

        async def serving(url: str) -> str | None:
            peer = ReplicaConfig(name="peer", unit="peer.service", url=url, model="?", health_timeout_s=m.peer_timeout_s)
            health, (_p, served) = await asyncio.gather(probes.probe_health(self.client, peer), probes.probe_models(self.client, peer))
            return url if health.ok and served and models & set(served) else None

        found = await asyncio.gather(*(serving(u) for u in m.peer_urls))
        return [u for u in found if u]

    def check_wiring_details(self, details: dict) -> None:
        for r in self.cfg.replicas:
            d = details.get(r.name)
            self.wiring[r.name] = (wiring_problem(r.unit, d.environment_files, d.exec_start, self.executor.env_path(r.name))
                                   if d is not None else f"systemd could not be asked about {r.unit}")

    async def scan_wiring(self) -> None:
        details = {}
        for r in self.cfg.replicas:
            try:
                details[r.name] = await self.sd.service_details(r.unit)
            except SystemdError:
                details[r.name] = None
        self.check_wiring_details(details)

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
                "since": t.state_since, "evidence": t.evidence, "unit_started_at": t.start_ts,
                "restarts_in_window": b.used, "restart_budget": b.limit, "gave_up": b.spent,
                "paused_until": (pv.pauses[r.name].until if r.name in pv.pauses else None),
                "paused": r.name in pv.pauses,
                "last_progress_at": t.last_progress_at,
                "gpu_memory_utilization": _first(read_env_fraction(self.executor.env_path(r.name)),
                                                 t.last_sample.gpu_memory_utilization if t.last_sample else None),
                "memory_wiring": self.wiring.get(r.name, "not checked (memory guard off)"),
            }
        mem = self.memory
        ticks = sorted(self.tick_durations_s)
        return {
            "pid": os.getpid(), "updated_at": now, "interval_s": self.cfg.interval_s, "dry_run": self.cfg.dry_run,
            "ticks": {  # over the last (up to) 1000 ticks
                "count": self.ticks, "p50_s": _pct(ticks, 0.50), "p99_s": _pct(ticks, 0.99),
                "max_s": ticks[-1] if ticks else None, "max_watchdog_ping_gap_s": self.max_ping_gap_s,
            },
            "config": str(self.config_path), "status": self.status_line(), "replicas": replicas,
            "memory": None if mem is None else {
                "total_bytes": mem.total_bytes, "available_bytes": mem.available_bytes, "free_bytes": mem.free_bytes,
                "psi_some_avg10": mem.psi_some_avg10, "psi_full_avg10": mem.psi_full_avg10,
                "guard": self.cfg.memory.enabled, "min_headroom_bytes": self.cfg.memory.min_headroom_bytes,
                "below_min_since": self.memtrack.below_since,
                "pending": None if self.memtrack.pending is None else vars(self.memtrack.pending),
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
        self.unit_cache.invalidate()
        self.journal.send("info", f"configuration reloaded from {self.config_path}")
        for line in thresholds.describe(new):
            self.journal.send("info", f"limits in effect: {line}")
        self._load_persistent(force=True)
        self.notifier.reloaded(self.status_line())

    # --- main loop and shutdown ------------------------------------------------------------
    async def main_loop(self) -> None:
        while not self.stop_requested.is_set():
            self.wake.clear()
            # Ticks start every interval_s, not interval_s after the last one ended: a replica
            # that hangs every probe for its timeout would otherwise stretch the cadence.
            delay_s = self.last_tick_started_mono + self.cfg.interval_s - time.monotonic()
            if delay_s > 0:
                try:
                    await asyncio.wait_for(self.wake.wait(), delay_s)
                except asyncio.TimeoutError:
                    pass
            if self.stop_requested.is_set():
                break
            if self.reload_requested:
                self.reload()
            await self.tick()
            self.notifier.watchdog(self.status_line())
            mono = time.monotonic()
            if self.last_ping_mono is not None:
                self.max_ping_gap_s = max(self.max_ping_gap_s, mono - self.last_ping_mono)
            self.last_ping_mono = mono

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


def _pct(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _first(*values):
    return next((v for v in values if v is not None), None)


def _process_tree(pid: int) -> list[int]:
    try:
        p = psutil.Process(pid)
        return [pid] + [c.pid for c in p.children(recursive=True)]
    except psutil.Error:
        return [pid]


def _largest_processes(n: int) -> list[tuple[str, int, int]]:
    procs = []
    for p in psutil.process_iter(["name", "memory_info"]):
        mi = p.info.get("memory_info")
        if mi is not None:
            procs.append((p.info.get("name") or "?", p.pid, mi.rss))
    return sorted(procs, key=lambda x: -x[2])[:n]


def _version() -> str:
    from . import __version__

    return __version__
