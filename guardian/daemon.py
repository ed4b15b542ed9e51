"""The daemon's lifecycle: startup, main loop, reload and shutdown as separate steps (uvicorn's
``Server``). Signal handlers only set flags; the loop acts on them between ticks.

A tick is observe -> decide -> act:

    observation = await observer.observe(...)             # guardian/observe: the world as values
    state, actions = tick.decide(state, observation, now, cfg)   # guardian/core: pure
    executor.perform(actions)                             # guardian/act: journal, restarts, files

then the status file, then systemd's watchdog ping: a tick that never completes means no
WATCHDOG=1, and systemd restarts guardian. So does a system bus that stays gone for
``bus_lost_restart_s``: guardian is blind without it.
"""

from __future__ import annotations

import asyncio
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from . import __version__
from .act.executor import Executor
from .act.journal import Journal
from .act.notify import Notifier
from .act.proxy import ProxySync
from .act.state import STATUS_FILE, CorruptState, StateCache, StateStore, atomic_write_json, forget_unconfigured
from .config import Config, ConfigError, load_config
from .core import hazards, thresholds, tick
from .core.actions import LogLine
from .core.drain import Drain, Phase
from .core.liveness import Track
from .core.observations import FleetView, MemorySample, TickObservation
from .core.vocab import Decision, Priority
from .export.files import TEXTFILE_NAME, write_file_sd, write_textfile
from .export.http import MetricsServer
from .export.metrics import Metrics
from .fleet.sync import FleetSync
from .observe.clock import Now
from .observe.clock import now as clock_now
from .observe.meminfo import sample_memory
from .observe.probes import make_client
from .observe.replicas import WorldObserver, unit_or_error
from .observe.systemd import Systemd, SystemdError, SystemdEvent
from .status import LoopStats, status_dict, status_line


class StartupError(Exception):
    pass


async def fleet_step(fleet: FleetSync, tracks: dict[str, Track], now: Now) -> FleetView:
    """The fleet's step, gathered with the probes: whatever it raises (it should catch everything
    itself) is an unreadable fleet for this tick, said once, never a tick abandoned, which would
    stop the watchdog's pings and have systemd restart guardian over something etcd sent."""
    try:
        return await fleet.step(tracks, now)
    except Exception as e:  # noqa: BLE001 - planned restarts wait (F3); the tick acts on everything else
        return fleet.unreadable(f"{type(e).__name__}: {e}")


class Daemon:
    def __init__(
        self,
        cfg: Config,
        config_path: Path,
        journal: Journal | None = None,
        notifier: Notifier | None = None,
        clock: Callable[[], Now] = clock_now,
    ) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.journal = journal or Journal()
        self.notifier = notifier or Notifier()
        self.clock = clock
        self.sd = Systemd()
        self.client = make_client()
        self.store = StateStore(cfg.state_dir)
        self.persistent = StateCache(self.store)
        self.executor = Executor(cfg, self.sd, self.client, self.store, self.journal, clock)
        self.observer = WorldObserver(self.sd, self.client)
        self.executor.containers = self.observer.containers  # one set of container reports
        self.state = tick.TickState()
        self.proxy = ProxySync(cfg, self.sd, self.store, self.journal, clock)
        self.fleet = FleetSync(cfg, self.journal, clock) if cfg.fleet.enabled else None
        self.closing: set[asyncio.Future[None]] = set()
        self.memory: MemorySample | None = None
        self.last_observation: TickObservation | None = None
        self.hazards_logged: set[str] = set()
        self.rescan = True
        self.stop_requested = asyncio.Event()
        self.reload_requested = False
        self.wake = asyncio.Event()
        self.stats = LoopStats()
        self.last_tick_started_mono = time.monotonic()
        self.last_ping_mono: float | None = None
        self.last_completed_mono = time.monotonic()
        self.bus_events: list[SystemdEvent] = []
        self.blind_said = False  # the reason to stop pinging was said (bus gone, or no tick completing)
        self.kernel_view_said: str | None = None  # why the kernel's view was last said to be missing
        self.metrics = Metrics(__version__)
        self.metrics_server: MetricsServer | None = None
        self.export_errors: set[str] = set()  # said once each, until the export works again

    # --- signals and bus events: flags only ------------------------------------------------
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

    def _on_units_changed(self, reason: SystemdEvent) -> None:
        self.rescan = True  # enablement, masks, Conflicts= and wiring may have changed
        self.observer.invalidate()
        if reason in (SystemdEvent.BUS_LOST, SystemdEvent.BUS_BACK):
            self.bus_events.append(reason)

    # --- startup ---------------------------------------------------------------------------
    async def startup(self) -> None:
        self.journal.send(Priority.INFO, f"guardian {__version__} starting with {self.config_path}")
        self._log_limits()
        self._load_persistent(force=True)
        self._adopt_proxy_state()
        try:
            await self.sd.connect()
        except SystemdError as e:
            raise StartupError(f"cannot talk to systemd over the system bus: {e}") from None
        self.sd.on_units_changed(self._on_units_changed)
        if self.cfg.memory.enabled:
            self.journal.send(Priority.INFO, f"memory guard: {self.observer.memory.start()}")
        self.start_exports()
        await self.tick()
        self.journal.send(Priority.INFO, f"guardian ready: {self.status_line()}")
        self.notifier.ready(self.status_line())

    def _adopt_proxy_state(self) -> None:
        """Replicas marked down at the proxy when guardian last ran (it may have died in the middle
        of a drain) stay down until they serve (D10), and are then marked up."""
        now = self.clock()
        down = [n for n in self.persistent.view(now).proxy_down if self.cfg.replica(n) is not None]
        self.proxy.hook_down = frozenset(down)
        if not down or not self.cfg.proxy.enabled:
            return
        drains = {n: Drain(Phase.AWAY, now.mono, "marked down when guardian last ran") for n in down}
        self.state = replace(self.state, drains=drains)
        self.journal.send(
            Priority.INFO,
            f"proxy: {', '.join(down)} marked down when guardian last ran; each is marked up once it serves (D10)",
        )

    def _log_limits(self) -> None:
        for line in thresholds.describe(self.cfg):
            self.journal.send(Priority.INFO, f"limits in effect: {line}")

    # --- one tick --------------------------------------------------------------------------
    async def tick(self) -> None:
        started = time.monotonic()
        self.last_tick_started_mono = started
        completed = False
        try:
            await self._tick()
            completed = True
        except Exception as e:  # noqa: BLE001 - a bug or a surprise must not kill the watchdog of every replica
            self.journal.line(
                LogLine(Priority.CRITICAL, f"tick abandoned without acting: {type(e).__name__}: {e}", Decision.NOTE),
                {"GUARDIAN_TRACEBACK": traceback.format_exc()},
            )
        finally:
            self.stats.add(time.monotonic() - started)
        if completed:
            self.last_completed_mono = time.monotonic()
            self.export(time.monotonic() - started)

    async def _tick(self) -> None:
        self._load_persistent()
        self._say_bus_events()
        if self.rescan:
            self.rescan = False
            await self.scan()
        started = self.clock()
        observed = self.observer.observe(
            self.cfg,
            self.persistent.view(started),
            self.executor.canaries,
            self.executor.outcomes,
            self.state.mem.pending,
            started,
            tick.probe_wait_s(self.state, started.mono, self.cfg),
        )
        if self.fleet is not None:  # etcd is read beside the probes: neither waits for the other
            obs, fleet_view = await asyncio.gather(observed, fleet_step(self.fleet, self.state.tracks, started))
            obs = replace(obs, fleet=fleet_view)
        else:
            obs = await observed
        # Judge as of when the answers were in: a probe that hung for its whole timeout has
        # shown no answer for that long, and the tick started before it was sent.
        now = self.clock()
        obs = replace(obs, proxy=self.proxy.view())
        self.state, actions = tick.decide(self.state, obs, now.mono, self.cfg)
        self.executor.perform(actions)
        if self.fleet is not None:
            self.fleet.perform(actions)
        self.proxy.sync(self.state.proxy_down)
        self.metrics.fold(self.cfg, self.state.tracks, obs, actions, self.persistent.view(now), now)
        self.metrics.set_bypass(self.state.bypassing)
        self._say_kernel_view()
        self.last_observation = obs
        self.memory = obs.memory.sample if obs.memory else await asyncio.to_thread(sample_memory)
        self.write_status(now)

    def _say_kernel_view(self) -> None:
        """Once when the kernel's view of the replicas' connections is lost, once when it is back."""
        why = self.observer.conns.unavailable
        if why == self.kernel_view_said:
            return
        if why is not None:
            self.journal.send(
                Priority.WARNING,
                f"the kernel's view of the replicas' connections is not available: {why}; responses flowing "
                "and clients waiting are not seen, so replicas are judged from their probes alone",
            )
        else:
            self.journal.send(Priority.INFO, "the kernel's view of the replicas' connections is available again")
        self.kernel_view_said = why

    def _say_bus_events(self) -> None:
        for event in self.bus_events:
            if event is SystemdEvent.BUS_LOST:
                self.journal.send(
                    Priority.ERROR,
                    "lost the system bus: every replica is 'unknown' and nothing is "
                    "restarted until guardian reconnects (it retries with back-off); systemd's watchdog "
                    f"restarts guardian if the bus stays gone for {self.cfg.bus_lost_restart_s:g} s",
                )
            else:
                self.journal.send(
                    Priority.INFO,
                    "system bus back: reconnected and subscribed to systemd's signals "
                    "again; unit views are taken afresh",
                )
                self.blind_said = False
        self.bus_events.clear()

    # --- scans: hazards and wiring, when units may have changed ------------------------------
    async def scan(self) -> None:
        units = {}
        for r in self.cfg.replicas:
            if r.unitless:
                units[r.unit], _ = await self.observer.containers.unitless_view(r)
            else:
                units[r.unit], _ = await unit_or_error(self.sd, r.unit)
        try:
            enabled = await self.sd.enabled_service_conflicts()
        except SystemdError as e:
            self.journal.send(Priority.ERROR, f"cannot list enabled unit files for the Conflicts= scan: {e}")
            enabled = {}
        found = hazards.find_hazards(self.cfg, units, enabled)
        for h in found:
            if h.key not in self.hazards_logged:
                self.journal.line(
                    LogLine(Priority.ERROR, f"hazard: {h.message}", Decision.HAZARD, h.replica, h.unit, hazard=h.key)
                )
        self.hazards_logged = {h.key for h in found}
        self.metrics.set_hazards(found)
        if self.cfg.memory.enabled:
            await self.observer.memory.scan_wiring(self.cfg)

    def _load_persistent(self, force: bool = False) -> None:
        if force:  # at start and on reload: replicas no longer configured leave no history behind
            names = {r.name for r in self.cfg.replicas}
            try:
                self.store.update(lambda d: forget_unconfigured(d, names))
            except CorruptState as e:
                self.journal.send(Priority.ERROR, str(e))
            except OSError as e:
                self.journal.send(Priority.ERROR, f"cannot update state in {self.store.dir}: {e}")
        for problem in self.persistent.load(force):
            self.journal.send(Priority.ERROR, problem)

    # --- status ----------------------------------------------------------------------------
    def status_line(self) -> str:
        now = self.clock()
        return status_line(self.cfg, self.state, self.persistent.view(now), self.memory, now.mono)

    def write_status(self, now: Now) -> None:
        data = status_dict(
            self.cfg,
            str(self.config_path),
            self.state,
            self.persistent.view(now),
            self.last_observation,
            self.memory,
            self.observer.memory.wiring,
            self.stats,
            self.sd.connected,
            now,
        )
        try:
            atomic_write_json(self.cfg.runtime_dir / STATUS_FILE, data)
        except OSError as e:
            self.journal.send(Priority.ERROR, f"cannot write {self.cfg.runtime_dir / STATUS_FILE}: {e}")

    # --- Prometheus: the endpoint, the textfile, the file_sd targets --------------------------
    def start_exports(self) -> None:
        m = self.cfg.metrics
        if m.http:
            host, port = m.host_port
            server = MetricsServer(
                host,
                port,
                stale_after_s=max(10.0, 5 * self.cfg.interval_s),
                on_refused=lambda message: self.journal.send(Priority.WARNING, message),  # on its thread: locked
            )
            try:
                server.start()
            except OSError as e:
                self.journal.send(Priority.ERROR, f"metrics: cannot listen on {m.address}: {e}; no /metrics endpoint")
            else:
                self.metrics_server = server
                self.journal.send(Priority.INFO, f"metrics: serving /metrics and /healthz on {m.address}")
        try:
            written = write_file_sd(self.cfg)
        except OSError as e:
            self.journal.send(Priority.ERROR, f"metrics: cannot write the file_sd targets {m.file_sd_path}: {e}")
        else:
            if written is not None:
                self.journal.send(Priority.INFO, f"metrics: wrote the replicas' scrape targets to {written}")

    def stop_exports(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.stop()
            self.metrics_server = None

    def export(self, tick_s: float) -> None:
        now = self.clock()
        self.metrics.tick_done(tick_s, now)
        m = self.cfg.metrics
        if self.metrics_server is None and m.textfile_dir is None:
            return
        body = self.metrics.render()
        if self.metrics_server is not None:
            self.metrics_server.publish(body, time.monotonic())
        if m.textfile_dir is not None:
            try:
                write_textfile(m.textfile_dir, body)
                self.export_errors.discard("textfile")
            except OSError as e:
                if "textfile" not in self.export_errors:
                    self.export_errors.add("textfile")
                    self.journal.send(Priority.ERROR, f"metrics: cannot write {m.textfile_dir / TEXTFILE_NAME}: {e}")

    # --- reload ----------------------------------------------------------------------------
    def reload(self) -> None:
        self.reload_requested = False
        self.notifier.reloading()
        try:
            new = load_config(self.config_path)
        except ConfigError as e:
            self.journal.send(Priority.ERROR, f"reload refused, keeping the running config: {e}")
            self.notifier.reloaded(self.status_line())
            return
        self.cfg = new
        self.executor.cfg = new
        self.store = StateStore(new.state_dir)
        self.executor.store = self.store
        self.proxy.reconfigure(new, self.store)
        if self.fleet is not None and new.fleet != self.fleet.cfg.fleet:
            self.closing.add(asyncio.ensure_future(self.fleet.close()))  # leaves the fleet; a new lease follows
            self.fleet = None
        if self.fleet is not None:
            self.fleet.cfg = new
        elif new.fleet.enabled:
            self.fleet = FleetSync(new, self.journal, self.clock)
        self.persistent = StateCache(self.store)
        self.state = tick.TickState(
            {k: v for k, v in self.state.tracks.items() if new.replica(k) is not None},
            self.state.mem,
            self.state.requests_taken,
            {k: v for k, v in self.state.drains.items() if new.replica(k) is not None},
        )
        self.rescan = True
        self.observer.invalidate()
        self.stop_exports()
        self.start_exports()
        self.journal.send(Priority.INFO, f"configuration reloaded from {self.config_path}")
        self._log_limits()
        if new.memory.enabled:
            self.journal.send(Priority.INFO, f"memory guard: {self.observer.memory.start()}")
        self._load_persistent(force=True)
        self.notifier.reloaded(self.status_line())

    # --- main loop and shutdown ------------------------------------------------------------
    async def main_loop(self) -> None:
        while not self.stop_requested.is_set():
            self.wake.clear()
            # Ticks start every interval_s, not interval_s after the last one ended: a replica
            # that hangs every probe for its timeout would otherwise stretch the cadence.
            now_mono = time.monotonic()
            delay_s = tick.next_tick_at(self.state, self.last_tick_started_mono, now_mono, self.cfg) - now_mono
            if delay_s > 0:
                try:
                    await asyncio.wait_for(self.wake.wait(), delay_s)
                except TimeoutError:
                    pass
            if self.stop_requested.is_set():
                break
            if self.reload_requested:
                self.reload()
            await self.tick()
            self.ping_watchdog()

    def _why_not_ping(self, mono: float) -> str | None:
        """Why systemd should restart guardian (it stops pinging the watchdog), or None."""
        lost_s = self.sd.lost_for_s(mono)
        if lost_s >= self.cfg.bus_lost_restart_s:
            return f"the system bus has been gone for {lost_s:.0f} s: guardian is blind"
        stuck_s = mono - self.last_completed_mono
        if stuck_s >= self.cfg.stuck_restart_s:
            return f"no tick has completed for {stuck_s:.0f} s (each was abandoned, see the lines before)"
        return None

    def ping_watchdog(self) -> None:
        mono = time.monotonic()
        why = self._why_not_ping(mono)
        if why is not None:
            if not self.blind_said:
                self.journal.send(
                    Priority.CRITICAL, f"{why}, so it stops pinging systemd's watchdog and systemd will restart it"
                )
                self.blind_said = True
            return
        self.blind_said = False
        self.notifier.watchdog(self.status_line())
        if self.last_ping_mono is not None:
            self.stats.max_watchdog_ping_gap_s = max(self.stats.max_watchdog_ping_gap_s, mono - self.last_ping_mono)
        self.last_ping_mono = mono

    async def shutdown(self) -> None:
        self.notifier.stopping()
        left = await self.executor.finish(self.cfg.shutdown_timeout_s)
        try:  # a proxy change under way is finished, so that the state file says what nginx has
            await asyncio.wait_for(self.proxy.wait(), self.cfg.shutdown_timeout_s)
        except TimeoutError:
            left += 1
        if left:
            self.journal.send(
                Priority.WARNING, f"stopping with {left} task(s) cut short after {self.cfg.shutdown_timeout_s:g} s"
            )
        self.observer.carry.forget(set())  # probes carried over from the last tick: nobody will read them
        if self.fleet is not None:
            await self.fleet.close()
        if self.closing:  # a fleet left on reload: its lease revoked before the process goes
            await asyncio.wait(self.closing, timeout=self.cfg.shutdown_timeout_s)
        await self.client.aclose()
        self.sd.close()
        self.stop_exports()
        self.journal.send(Priority.INFO, "guardian stopped")

    async def run(self) -> int:
        self.install_signal_handlers()
        try:
            await self.startup()
        except StartupError as e:
            self.journal.send(Priority.CRITICAL, f"guardian cannot start: {e}")
            return 1
        try:
            await self.main_loop()
        finally:
            await self.shutdown()
        return 0
