"""The daemon's lifecycle in uvicorn's ``Server`` shape: startup, main loop, reload and shutdown
as short steps; signal handlers only set flags, acted on between ticks. The parts (act/part.py:
executor, proxy, fleet, exports) reload themselves and are stopped in order; this only sequences.

A tick is observe -> decide -> act, then the gauges and the status file:

    obs = await fleet.beside(observer.observe(...), ...)    # guardian/observe; etcd read beside
    state, actions = tick.decide(state, obs, at.mono, cfg)  # guardian/core: pure
    executor.perform(actions, state.tracks, at)             # guardian/act: one handler per action

Once it completed, the metrics are published and systemd's watchdog pinged: a tick that never
completes means no WATCHDOG=1, and systemd restarts guardian. So does a system bus gone for
``bus_lost_restart_s``: guardian is blind without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from . import __version__
from .act import fit
from .act.executor import Executor
from .act.journal import Journal
from .act.notices import Notices
from .act.notify import Notifier, Watchdog, why_not_ping
from .act.part import Part
from .act.proxy import ProxySync
from .act.restart import Tools
from .act.state import STATUS_FILE, StateCache, StateStore, atomic_write_json
from .config import Config, ConfigError, load_config
from .core import thresholds, tick
from .core.hazards import Hazard
from .core.memory.wiring import problem_of
from .core.observations import MemorySample, TickObservation
from .core.vocab import Priority
from .core.weights import Weights
from .export.exports import Exports
from .fleet.sync import Fleet
from .observe import startlook
from .observe.askers import askers_checked
from .observe.clock import Now
from .observe.clock import now as clock_now
from .observe.meminfo import sample_memory
from .observe.probes import make_client
from .observe.replicas import WorldObserver
from .observe.systemd import Systemd, SystemdError, SystemdEvent
from .observe.weights import WeightsWatch
from .status import LoopStats, Snapshot, status_dict, status_line

# the replicas' weights fingerprints, at most, in one tick (the D-Bus questions, then each look's own
# bound, observe/weights.py LOOK_S: a look past it runs on in its own thread, one per replica at a time)
WEIGHTS_LOOK_S = 10.0


class StartupError(Exception):
    pass


class Daemon:
    def __init__(
        self,
        cfg: Config,
        config_path: Path,
        journal: Journal | None = None,
        notifier: Notifier | None = None,
        clock: Callable[[], Now] = clock_now,
    ) -> None:
        self.cfg, self.config_path, self.clock = cfg, config_path, clock
        self.journal = journal or Journal()
        self.notifier = notifier or Notifier()
        self.notices = Notices(self.journal)
        self.weights = WeightsWatch()
        self.weights_found: dict[str, Weights | None] = {}
        self.weights_differ: list[Hazard] = []
        self.weights_moved: tuple[str, ...] = ()  # W2 found since the last decision, for the next one
        self.weights_error_said = False
        self.watchdog = Watchdog(self.notifier, self.journal)
        self.sd, self.client = Systemd(), make_client()
        self.persistent = StateCache(StateStore(cfg.state_dir))
        self.observer = WorldObserver(self.sd, self.client)
        self.proxy = ProxySync(cfg, self.sd, StateStore(cfg.state_dir), self.journal, clock)
        self.fleet = Fleet(cfg, self.journal, clock)
        self.exports = Exports(cfg, self.journal, __version__)
        store = StateStore(cfg.state_dir)
        released = self.exports.metrics.released
        tools = Tools(self.sd, store, self.journal, cfg, clock, self.observer.containers, released)
        self.executor = Executor(tools, self.client, self.proxy, self.fleet, self.exports.metrics)
        self.executor.address_of = self.observer.addresses.address_of
        # Stopped in order: the restarts under way, the proxy's change (so that the state file says
        # what the proxy has), the fleet (its lease revoked), the exports.
        self.parts: tuple[Part, ...] = (self.executor, self.proxy, self.fleet, self.exports)
        self.state = tick.TickState()
        self.last_observation: TickObservation | None = None
        self.memory: MemorySample | None = None
        self.stats = LoopStats()
        self.stop_requested, self.reload_requested = asyncio.Event(), False
        self.rescan = True  # units may have changed: hazards and wiring are looked at again
        self.wake = asyncio.Event()
        self.last_tick_started_mono = self.last_completed_mono = time.monotonic()

    # --- signals and bus events: flags only ------------------------------------------------
    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for stop in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(stop, self._on_stop)
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
        self.watchdog.bus_changed(reason)

    # --- startup and reload ----------------------------------------------------------------
    async def startup(self) -> None:
        self.journal.send(Priority.INFO, f"guardian {__version__} starting with {self.config_path}")
        self.journal.send_each(Priority.INFO, [f"limits in effect: {line}" for line in thresholds.limits(self.cfg)])
        self.journal.send_each(Priority.ERROR, self.persistent.reset(self.cfg))
        at = self.clock()
        self.state = replace(self.state, drains=self.proxy.adopt(self.persistent.view(at).proxy_down, at.mono))
        try:
            await self.sd.connect()
        except SystemdError as e:
            raise StartupError(f"cannot talk to systemd over the system bus: {e}") from None
        self.sd.on_units_changed(self._on_units_changed)
        self.journal.send_each(Priority.INFO, self.observer.start(self.cfg))
        self.exports.start()
        await self.tick()
        self.journal.send(Priority.INFO, f"guardian ready: {self.status_line()}")
        self.notifier.ready(self.status_line())

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
        # The tracks and drains of the replicas still configured, the memory guard's and the
        # requests taken outlive a reload; the rest is found again.
        tracks = {name: t for name, t in self.state.tracks.items() if new.replica(name) is not None}
        drains = {name: d for name, d in self.state.drains.items() if new.replica(name) is not None}
        self.state = tick.TickState(
            tracks=tracks, mem=self.state.mem, requests_taken=self.state.requests_taken, drains=drains
        )
        self.rescan = True
        self.observer.invalidate()
        for part in self.parts:
            part.reload(new)
        self.journal.send(Priority.INFO, f"configuration reloaded from {self.config_path}")
        self.journal.send_each(Priority.INFO, [f"limits in effect: {line}" for line in thresholds.limits(new)])
        self.journal.send_each(Priority.INFO, self.observer.start(new))
        self.journal.send_each(Priority.ERROR, self.persistent.reset(new))
        self.notifier.reloaded(self.status_line())

    # --- one tick --------------------------------------------------------------------------
    async def tick(self) -> None:
        started_mono = self.last_tick_started_mono = time.monotonic()
        try:
            await self._tick()
        except Exception as e:  # noqa: BLE001 - a bug or a surprise must not kill the watchdog of every replica
            self.journal.with_traceback(Priority.CRITICAL, f"tick abandoned without acting: {type(e).__name__}: {e}")
            return
        finally:
            self.stats.add(time.monotonic() - started_mono)
        self.last_completed_mono = time.monotonic()
        self.exports.tick_done(time.monotonic() - started_mono, self.clock())

    async def _tick(self) -> None:
        self.journal.send_each(Priority.ERROR, self.persistent.load())
        self.watchdog.say_bus(self.cfg.bus_lost_restart_s)
        if not self.rescan and self.observer.logind_changed():  # logind's files changed: H1 judged again
            self.rescan = True
        if self.rescan:  # hazards and wiring
            self.rescan = False
            self.exports.metrics.set_hazards(self.notices.hazards(self.cfg, await self.observer.scan(self.cfg)))
            self.notices.engines(self.cfg, self.observer.told)
        started = self.clock()
        wait_s = tick.probe_wait_s(self.state, started.mono, self.cfg)
        persistent = askers_checked(self.persistent.view(started))
        observing = self.observer.observe(
            self.cfg, persistent, self.executor.take_results, self.state.mem.pending, started, wait_s
        )
        obs = await self.fleet.beside(observing, self.state.tracks, started)
        # Judge as of when the answers were in: a probe that hung for its whole timeout has
        # shown no answer for that long, and the tick started before it was sent.
        at = self.clock()
        obs = replace(
            obs,
            proxy=self.proxy.view(),
            not_returned=fit.not_returned_now(self.executor.tools.leftovers),
            weights_moved=self.weights_moved,
        )
        self.state, actions = tick.decide(self.state, obs, at.mono, self.cfg)
        self.weights_moved = ()  # decided on: a tick abandoned before this hands them to the next
        self.executor.perform(actions, self.state.tracks, at)
        self.exports.metrics.gauges(self.cfg, self.state, obs, self.persistent.view(at), at)
        self.notices.kernel_view(self.observer.conns.unavailable)
        partial = frozenset(n for n, seen in obs.replicas.items() if seen.conns is not None and seen.conns.truncated)
        self.notices.partial_views(self.cfg, partial)
        self.notices.addresses(self.cfg, self.observer.pins)
        self.last_observation = obs
        # /proc/meminfo and /proc/pressure/memory on the loop: two reads of procfs (0.1 ms) cost less than a thread hop
        self.memory = obs.memory.sample if obs.memory else sample_memory()
        await self._weights(obs)
        await self._leftovers(obs, at)
        self.write_status(at)

    async def _leftovers(self, obs: TickObservation, at: Now) -> None:
        """Each kept U8 finding judged again on this tick's memory (act/fit.py judge_kept): a hazard in
        `guardian status` until what was missing is back. Nothing is read while none is kept."""
        kept = self.executor.tools.leftovers
        for name in [n for n in kept if self.cfg.replica(n) is None]:
            del kept[name]  # a replica no longer configured: nothing to say of it
        for name in list(kept):
            r, seen = self.cfg.replica(name), obs.replicas.get(name)
            pid = seen.unit.main_pid if seen is not None and seen.unit is not None else 0
            try:
                look = await asyncio.to_thread(startlook.look_kept, pid, at.mono)
            except (OSError, ValueError, KeyError):
                continue  # /proc unreadable this tick: kept as it was, judged again at the next
            if r is not None:
                fit.judge_kept(kept, r, look, self.journal)

    async def _weights(self, obs: TickObservation) -> None:
        """Each replica's weights (W1, W2): a failure to read them is said and never stops the tick."""
        units = {name: seen.unit for name, seen in obs.replicas.items()}
        try:
            # bounded: a model path on a file system that hangs must not hold the tick up
            self.weights_found = await asyncio.wait_for(self.weights.look(self.cfg, self.sd, units), WEIGHTS_LOOK_S)
        except Exception as e:  # noqa: BLE001 - fingerprints are a report, not the watchdog
            if not self.weights_error_said:
                self.journal.with_traceback(
                    Priority.ERROR, f"cannot read the replicas' weights: {type(e).__name__}: {e}"
                )
            self.weights_error_said = True
            return
        self.weights_error_said = False
        self.weights_differ, moved = self.notices.weights(self.cfg, self.weights_found, obs.fleet)
        self.weights_moved += tuple(moved)  # the next tick's decision drops what was learned of the old weights
        self.exports.metrics.set_weights(self.weights_found, self.weights_differ)
        self.fleet.publish_weights(self.weights_found)

    def status_line(self) -> str:
        at = self.clock()
        return status_line(self.cfg, self.state, self.persistent.view(at), self.memory, at.mono)

    def write_status(self, at: Now) -> None:
        leftovers = {n: (x.missing_bytes, x.found_wall) for n, x in self.executor.tools.leftovers.items()}
        snapshot = Snapshot(
            self.state,
            self.persistent.view(at),
            self.last_observation,
            self.memory,
            {name: problem_of(w) for name, w in self.observer.memory.wiring.items()},
            leftovers,
            self.weights_found,
            tuple(h.message for h in self.weights_differ),
        )
        self.exports.metrics.set_not_returned({n: b for n, (b, _at) in leftovers.items()})
        data = status_dict(self.cfg, str(self.config_path), snapshot, self.stats, self.sd.connected, at)
        try:
            atomic_write_json(self.cfg.runtime_dir / STATUS_FILE, data)
        except OSError as e:
            self.journal.send(Priority.ERROR, f"cannot write {self.cfg.runtime_dir / STATUS_FILE}: {e}")

    # --- main loop and shutdown ------------------------------------------------------------
    async def main_loop(self) -> None:
        while not self.stop_requested.is_set():
            self.wake.clear()
            # Ticks start every interval_s, not interval_s after the last one ended: a replica
            # that hangs every probe for its timeout would otherwise stretch the cadence.
            now_mono = time.monotonic()
            delay_s = tick.next_tick_at(self.state, self.last_tick_started_mono, now_mono, self.cfg) - now_mono
            if delay_s > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), delay_s)
            if self.stop_requested.is_set():
                break
            if self.reload_requested:
                self.reload()
            await self.tick()
            self.ping_watchdog()

    def ping_watchdog(self) -> None:
        mono = time.monotonic()
        why_not = why_not_ping(self.sd.lost_for_s(mono), mono - self.last_completed_mono, self.cfg)
        gap_s = self.watchdog.ping(mono, why_not, self.status_line)
        self.stats.max_watchdog_ping_gap_s = max(self.stats.max_watchdog_ping_gap_s, gap_s)

    async def shutdown(self) -> None:
        self.notifier.stopping()
        deadline_mono = time.monotonic() + (timeout_s := self.cfg.shutdown_timeout_s)  # one bound for all parts
        # the proxy marks replicas up after the executor's tasks end: a slice of the bound is kept for it
        kept_s = min(3.0, timeout_s / 3) if self.cfg.proxy.enabled else 0.0
        left = 0
        for part in self.parts:
            left += await part.stop(
                max(0.0, deadline_mono - time.monotonic() - (kept_s if part is self.executor else 0))
            )
        if left:
            self.journal.send(Priority.WARNING, f"stopping with {left} task(s) cut short after {timeout_s:g} s")
        self.observer.carry.forget(set())  # probes carried over from the last tick: nobody will read them
        await self.client.aclose()
        self.sd.close()
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
