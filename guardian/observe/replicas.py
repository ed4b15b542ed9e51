"""Observers: turn systemd, /proc and each replica's HTTP endpoints into immutable values.

Every call is bounded; a hung replica or a slow bus yields an observation that says so.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from .. import engines
from ..config import Config, ReplicaConfig
from ..core.container import engine_words
from ..core.memory.memstate import Pending
from ..core.observations import (
    CanaryResult,
    ConnView,
    LogindConf,
    PersistentView,
    Probe,
    ProcView,
    ReplicaObservation,
    RestartOutcome,
    TickObservation,
    UnitDeclared,
    UnitInfo,
    VllmSample,
    WarmupResult,
)
from ..core.vocab import HeldBy, Hidden, Nobody, PortOwner, Unreadable
from ..engines.base import Engine
from ..engines.resolve import Told, told
from . import nvml, probes
from .addresses import Addresses, Pin
from .clock import Now
from .conns import ConnObserver
from .containers import ContainerWatch
from .declared import declared_of, logind_signature, read_logind
from .procs import ProcObserver
from .sockets import (
    CGROUP_ROOT,
    Listener,
    Listening,
    cgroup_dirs,
    cgroup_mounts,
    first_pid,
    listeners,
    listening,
    listening_in,
    unit_of_cgroup,
)
from .systemd import Systemd, SystemdError

UnitView = tuple[UnitInfo | None, str | None]  # the unit, or None and why systemd could not be asked


async def unit_or_error(sd: Systemd, name: str) -> UnitView:
    try:
        return await sd.unit_info(name), None
    except (TimeoutError, SystemdError, OSError) as e:
        return None, str(e)


def _owners_by_cgroup(table: dict[int, Listening]) -> dict[int, HeldBy]:
    """The ports whose socket's cgroup names a unit (see sockets.py), without /proc."""
    if not any(cg is not None for _inode, cg in table.values()):
        return {}
    # The cgroup2 hierarchy itself: under systemd's hybrid layout /sys/fs/cgroup holds the v1
    # trees, whose inodes can collide with v2 cgroup ids.
    root = cgroup_mounts().unified or CGROUP_ROOT
    dirs = cgroup_dirs(root)
    out: dict[int, HeldBy] = {}
    for port, (_inode, cg) in table.items():
        path = dirs.get(cg) if cg is not None else None
        unit = unit_of_cgroup(path) if path is not None else None
        if path is not None and unit is not None:
            out[port] = HeldBy(port, first_pid(path, root), unit)
    return out


async def port_owners(sd: Systemd, wanted: Mapping[int, str]) -> dict[int, PortOwner]:
    """Who holds each port of WANTED (port -> the host of a replica's URL): the listener that
    serves that host on it (sockets.serving), not any socket on the port."""
    ports = set(wanted)
    table = await asyncio.to_thread(listening, wanted)
    if table is None:
        return {p: Unreadable(p) for p in ports}
    by_cgroup = await asyncio.to_thread(_owners_by_cgroup, table)
    scanned: dict[int, int | None] | None = None
    out: dict[int, PortOwner] = {}
    for port in ports:
        if port not in table:
            out[port] = Nobody(port)
            continue
        if port in by_cgroup:
            out[port] = by_cgroup[port]
            continue
        # No cgroup id (old kernel, no netlink) or systemd's own cgroup: ask /proc, which
        # shows only guardian's own processes' sockets without the capabilities.
        if scanned is None:
            scanned = await asyncio.to_thread(listeners, wanted) or {}
        pid = scanned.get(port)
        if pid is None:
            out[port] = Hidden(port)
            continue
        try:
            unit = await sd.unit_by_pid(pid)
        except SystemdError:
            unit = None
        out[port] = HeldBy(port, pid, unit)
    return out


class UnitInfoCache:
    """systemd's view of each replica's unit, asked for in full only when it may have changed.

    A unit's full view takes 14 D-Bus calls, plus 2 per Conflicts=/ConflictedBy= entry; its
    fingerprint (states, job, invocation id) is cheap. The full view is asked again when the
    fingerprint changes, after a daemon-reload, a change of unit files or a bus reconnect
    (invalidate()), and at least every max_age_s. Restarts re-check the
    unit gates on a fresh, uncached view anyway (act/restart.checked_restart).
    """

    def __init__(self, max_age_s: float = 30.0) -> None:
        self.max_age_s = max_age_s
        self._entries: dict[str, tuple[tuple[str, ...], float, UnitInfo]] = {}

    def invalidate(self) -> None:
        self._entries.clear()

    async def get(self, sd: Systemd, names: list[str], mono_now: float) -> dict[str, UnitView]:
        try:
            prints = await sd.unit_fingerprints(names)
        except (TimeoutError, SystemdError, OSError) as e:
            self.invalidate()
            return {n: (None, str(e)) for n in names}
        out: dict[str, UnitView] = {}

        async def one(name: str) -> None:
            cached = self._entries.get(name)
            fp = prints.get(name)
            if cached is not None and fp is not None and cached[0] == fp and mono_now - cached[1] < self.max_age_s:
                out[name] = (cached[2], None)
                return
            info, err = await unit_or_error(sd, name)
            if info is None or fp is None:
                self._entries.pop(name, None)
            else:
                self._entries[name] = (fp, mono_now, info)
            out[name] = (info, err)

        await asyncio.gather(*(one(n) for n in names))
        return out


class PortOwnerCache:
    """Who holds each replica's port, found again only when the listening sockets change.

    Naming a socket's unit walks the cgroup tree (or, as a fallback, every process's /proc/PID/fd),
    the costliest part of a tick on a box with many processes; the socket table itself is cheap.
    """

    def __init__(self) -> None:
        self._key: tuple[tuple[tuple[int, str], ...], tuple[tuple[int, Listening], ...] | None] | None = None
        self._owners: dict[int, PortOwner] = {}

    async def get(
        self, sd: Systemd, wanted: Mapping[int, str], table: tuple[list[Listener] | None] | None = None
    ) -> dict[int, PortOwner]:
        """WANTED: port -> the host of the replica's URL on it (see port_owners). TABLE: the listening
        sockets on WANTED's ports as this tick's pins read them (listener_table), if they did: not
        read again (one thread hop and two dumps less a tick); None: read here."""
        before = listening_in(table[0], wanted) if table is not None else await asyncio.to_thread(listening, wanted)
        key = (tuple(sorted(wanted.items())), tuple(sorted(before.items())) if before is not None else None)
        if before is not None and key == self._key:
            return self._owners
        owners = await port_owners(sd, wanted)
        after = await asyncio.to_thread(listening, wanted)
        # Kept only when the sockets did not change during the scan and every holder was named
        # (a failed D-Bus lookup must not stick).
        complete = all(isinstance(o, Nobody) or (isinstance(o, HeldBy) and o.unit is not None) for o in owners.values())
        self._key = key if after == before and complete else None
        self._owners = owners
        return owners


ProbeResults = tuple[Probe, tuple[Probe, VllmSample | None], tuple[Probe, tuple[str, ...] | None]]


class ProbeCarry:
    """A replica's probes that outlive the tick's wait are carried into the next tick.

    A tick waits at most its budget for a replica's /health, /metrics and /v1/models; a probe
    still running then (a frozen server never answers) stays in flight, bounded by its own
    timeout, and the tick judges with "no answer yet". The next tick takes its result if it
    ended, and starts no second copy of it. So a hung replica cannot stretch the tick cadence,
    and a new process is seen as soon as it answers.

    Each endpoint is carried on its own: a /health that answered is an answer whatever /metrics
    does (a page slow to fetch or to parse once hid a fast /health 200 for 11 s, and the replica
    was judged unresponsive and killed). Only when none of the three answered this tick and one
    is still in flight is there no news (L10).
    """

    ENDPOINTS = ("health", "metrics", "models")

    def __init__(self) -> None:
        # replica -> endpoint -> (its probe in flight or finished and not yet taken, sent at)
        self.tasks: dict[str, dict[str, tuple[asyncio.Task[Any], float]]] = {}

    def start(
        self,
        client: httpx.AsyncClient,
        r: ReplicaConfig,
        mono: float,
        bound_s: float = 0.0,
        pin: Pin | None = None,
        engine: Engine = engines.DEFAULT,
    ) -> list[asyncio.Task[Any]]:
        """Send each probe of R that is not already in flight, to its PIN's address (None, or a pin
        without one: its URL's host); the tasks to wait for. Each may run up to the longer of its
        own timeout and BOUND_S (W.unresponsive_after_s): a late answer is an answer (a starved box
        answered in 1-8 s); its latency still tells slow from in time."""
        slots = self.tasks.setdefault(r.name, {})
        for endpoint in self.ENDPOINTS:
            if endpoint not in slots:
                slots[endpoint] = (asyncio.ensure_future(_send(client, r, endpoint, (bound_s, pin), engine)), mono)
        return [task for task, _ in slots.values()]

    def take(self, name: str, mono: float) -> tuple[ProbeResults, float | None]:
        """NAME's finished probes (forgotten once taken) and placeholders for those still running,
        and, when none got an answer and one is still running, how long the oldest has run."""
        slots = self.tasks.get(name, {})
        got: dict[str, Any] = {}
        running_s: list[float] = []
        for endpoint in self.ENDPOINTS:
            task, sent = slots.get(endpoint, (None, mono))
            if task is not None and task.done():
                got[endpoint] = _stamped(task.result(), sent)
                del slots[endpoint]
                continue
            running_s.append(mono - sent)
            waiting = Probe(
                False, None, mono - sent, f"no answer yet (in flight for {mono - sent:.1f} s)", pending=True
            )
            got[endpoint] = waiting if endpoint == "health" else (waiting, None)
        results: ProbeResults = (got["health"], got["metrics"], got["models"])
        answered = results[0].answered or results[1][0].answered or results[2][0].answered
        return results, (max(running_s) if running_s and not answered else None)

    def forget(self, keep: set[str]) -> None:
        for name in [n for n in self.tasks if n not in keep]:
            for task, _ in self.tasks.pop(name).values():
                task.cancel()


def _stamped(result: Any, sent: float) -> Any:
    """A finished probe's RESULT (a Probe, or a Probe and what it read) with the time it was SENT:
    an answer to a probe sent before its unit's latest start is the previous run's (core/watchdog/fold.py)."""
    if isinstance(result, Probe):
        return replace(result, sent_at=sent)
    probe, data = result
    return replace(probe, sent_at=sent), data


async def _send(
    client: httpx.AsyncClient,
    r: ReplicaConfig,
    endpoint: str,
    at: tuple[float, Pin | None],
    engine: Engine = engines.DEFAULT,
) -> Any:
    bound_s, pin = at
    address = pin.address if pin is not None else None
    if pin is not None and address is None and pin.error is not None:
        # Its host did not resolve this tick: no probe resolves it again (by name, on the default
        # thread pool, which a hung resolver would fill).
        failed = Probe(False, None, 0.0, f"cannot connect: {pin.error}")
        return failed if endpoint == "health" else (failed, None)
    if endpoint == "health":
        return await probes.health_at(client, r.url, max(r.health_timeout_s, bound_s), address, engine.health_path)
    if endpoint == "metrics":
        return await probes.probe_metrics(client, r, max(r.metrics_timeout_s, bound_s), address, engine)
    return await probes.models_at(client, r.url, max(r.health_timeout_s, bound_s), address)


def engine_told(r: ReplicaConfig, declared: UnitDeclared) -> Told:
    """R's engine, told from its config, or (auto) from what its unit (DECLARED) starts."""
    words = engine_words(declared.argv) if declared.unseen is None else None
    return told(r, words, declared.unseen)


@dataclass(frozen=True)
class Results:
    """What the executor's tasks brought back since the last tick (Executor.take_results), for the
    observation of their replicas: the canaries' results and the restarts' outcomes."""

    canaries: Mapping[str, CanaryResult] = field(default_factory=dict)
    outcomes: Mapping[str, RestartOutcome] = field(default_factory=dict)
    warmups: Mapping[str, WarmupResult] = field(default_factory=dict)


def replica_observation(
    r: ReplicaConfig,
    at_mono: float,
    unit_view: UnitView,
    owner: PortOwner | None,
    results: Results,
    probed: tuple[ProbeResults, float | None],
) -> ReplicaObservation:
    """R's observation from its UNIT_VIEW, its port's OWNER, the executor's RESULTS and its probes
    (PROBED, as ProbeCarry.take gives them: their results, and how long they have been pending
    when none answered); what its engine's page means is set by WorldObserver.replicas (metrics_offered)."""
    unit, unit_error = unit_view
    (health, (mprobe, sample), (models_probe, models)), pending_s = probed
    return ReplicaObservation(
        name=r.name,
        at=at_mono,
        unit=unit,
        unit_error=unit_error,
        health=health,
        metrics_probe=mprobe,
        metrics=sample,
        models_probe=models_probe,
        models=models,
        port_owner=owner,
        canary=results.canaries.get(r.name),
        restart_outcome=results.outcomes.get(r.name),
        warmup=results.warmups.get(r.name),
        probes_pending_s=pending_s,
    )


def as_engine(o: ReplicaObservation, engine: Engine) -> ReplicaObservation:
    """O with what ENGINE's page means (engines/): offered as it is started, answered by its engine's loop."""
    offered = engine.page_offered(o.metrics_probe.status)
    return replace(
        o, metrics_offered=offered, metrics_via_engine=engine.metrics_via_engine, queue_lags=engine.queue_lags
    )


@dataclass(frozen=True)
class UnitScan:
    """Each replica's unit (by unit name; None: not seen), and every enabled service unit file with
    the units it conflicts with (empty, and why, when systemd could not list them)."""

    units: dict[str, UnitInfo | None]
    enabled_conflicts: dict[str, tuple[str, ...]]
    enabled_error: str | None = None
    declared: dict[str, UnitDeclared] = field(default_factory=dict)  # by replica: how its unit runs its server
    logind: LogindConf | None = None  # logind's files (core/outside.py H1); None: not read


class WorldObserver:
    """Everything a tick observes, as one frozen TickObservation; keeps only caches between ticks."""

    def __init__(self, sd: Systemd, client: httpx.AsyncClient) -> None:
        from .memory import MemoryObserver

        self.sd = sd
        self.client = client
        self.port_cache = PortOwnerCache()
        self.unit_cache = UnitInfoCache()
        self.carry = ProbeCarry()
        self.memory = MemoryObserver(sd, client)
        self.conns = ConnObserver()
        self.procs = ProcObserver()
        self.containers = ContainerWatch(sd)
        self.addresses = Addresses()
        self.declared: dict[str, UnitDeclared] = {}  # how each replica's unit runs its server, as last read
        self.told: dict[str, Told] = {}  # each replica's engine, as told from its config or its unit (engines/)
        self.logind_seen: tuple[tuple[str, int, int], ...] = ()  # logind's files at the last scan
        # The listening sockets the last pin() read, until the port owners take them (_views); None:
        # not read since (the pin failed, or they were taken).
        self._pinned_table: tuple[list[Listener] | None] | None = None

    def _cpu_units(self, cfg: Config) -> dict[str, str]:
        """A Docker replica's work is done in its container's scope, not in its unit (the docker CLI)."""
        scopes = {r.name: self.containers.scope_of(r) for r in cfg.replicas if r.runtime == "docker" and r.container}
        return {name: scope for name, scope in scopes.items() if scope is not None}

    async def _procs(self, cfg: Config, mono: float) -> dict[str, ProcView | None]:
        """The replicas' own processes (observe/procs.py), never an exception: none is then known."""
        scopes = {r.name: self.containers.scope_of(r) for r in cfg.replicas if r.container}
        try:
            kinds = {r.name: self.engine_of(r) for r in cfg.replicas}
            return await asyncio.to_thread(self.procs.look_now, cfg, mono, scopes, kinds)
        except Exception:  # noqa: BLE001 - unreadable processes prove nothing: no view, no rule that needs one
            return {}

    async def _look(self, cfg: Config, mono: float) -> dict[str, ConnView | None]:
        """The kernel's view, never an exception: beside the probes, a failure here would lose
        their results and the executor's (taken as they are read)."""
        try:
            return await self.conns.look(cfg, mono, self.pins, self.addresses.table)
        except Exception as e:  # noqa: BLE001 - a surprise here is "no kernel view", said once by the daemon
            self.conns.unavailable = f"the kernel's view failed: {type(e).__name__}: {e}"[:300]
            return {}

    def start(self, cfg: Config) -> list[str]:
        """Open what CFG needs (NVML, once, for the memory guard); what to say about it, once: which
        source the memory figures come from (never an error per tick where NVML cannot say)."""
        said = [f"memory guard: {self.memory.start()}"] if cfg.memory.enabled else []
        return [*said, f"memory: {nvml.describe(cfg.memory.unified)}"]

    def invalidate(self) -> None:
        """systemd reloaded, unit files changed, or the bus dropped: no cached unit view is trusted."""
        self.unit_cache.invalidate()

    async def scan(self, cfg: Config) -> UnitScan:
        """What the hazards are judged from, looked at afresh (when units may have changed), and
        the memory guard's wiring."""
        unitless = [r for r in cfg.replicas if r.unitless]
        # the unit-less ones as a tick's observation asks for them: at once, within CONTAINER_PHASE_S
        _owners, views = await self.containers.views(unitless, {}) if unitless else ({}, {})
        units = {}
        for r in cfg.replicas:
            if r.unitless:
                units[r.unit] = views[r.unit][0]
            else:
                units[r.unit], _ = await unit_or_error(self.sd, r.unit)
        try:
            enabled, error = await self.sd.enabled_service_conflicts(), None
        except SystemdError as e:
            enabled, error = {}, str(e)
        declared = await self.read_declared(cfg)
        self.logind_seen = await asyncio.to_thread(logind_signature)
        logind = await asyncio.to_thread(read_logind)
        if cfg.memory.enabled:
            await self.memory.scan_wiring(cfg)
        return UnitScan(units, enabled, error, declared, logind)

    def logind_changed(self) -> bool:
        """logind's files changed since the last scan (H1 is judged on them): a few stat(2) calls."""
        return logind_signature() != self.logind_seen

    async def read_declared(self, cfg: Config) -> dict[str, UnitDeclared]:
        """How each replica's unit says its server runs (observe/declared.py), read afresh and kept for
        the ticks' observations until units may have changed."""
        found = await asyncio.gather(*(declared_of(self.sd, r) for r in cfg.replicas))
        self.declared = {r.name: d for r, d in zip(cfg.replicas, found, strict=True)}
        self.told = {r.name: engine_told(r, self.declared[r.name]) for r in cfg.replicas}
        return self.declared

    def engine_of(self, r: ReplicaConfig) -> Engine:
        """R's engine as last told (engines/resolve.py); before its unit is read, its configured one."""
        told = self.told.get(r.name)
        return told.engine if told is not None else engines.named(r.engine)

    async def observe(
        self,
        cfg: Config,
        persistent: PersistentView,
        take_results: Callable[[], Results],
        pending: Pending | None,
        at: Now,
        wait_s: float | None = None,
    ) -> TickObservation:
        """The tick's observation, started AT. TAKE_RESULTS is called once the probes are in."""
        await self.pin(cfg)
        # The kernel's view is taken beside the probes, at the tick's start: what flowed since the
        # last look is measured over the same span as the probes' wait.
        self.conns.cpu_units = self._cpu_units(cfg)
        replicas, views, procs = await asyncio.gather(
            self.replicas(cfg, at.mono, take_results, cfg.probe_wait_s if wait_s is None else wait_s),
            self._look(cfg, at.mono),
            self._procs(cfg, at.mono),
        )
        gpus = await asyncio.to_thread(nvml.shared().life) if nvml.shared().available else ()
        replicas = {n: replace(o, conns=views.get(n), procs=procs.get(n), gpus=gpus) for n, o in replicas.items()}
        bases = persistent.fraction_bases
        memory = await self.memory.observe(cfg, replicas, pending, at, bases) if cfg.memory.enabled else None
        return TickObservation(replicas, persistent, memory)

    async def pin(self, cfg: Config) -> dict[str, Pin]:
        """Where each replica's URL leads this tick (observe/addresses.py), never an exception: a
        replica whose pin could not be had is probed at its URL as it is."""
        self._pinned_table = None
        try:
            pins = await self.addresses.pins(cfg)
        except Exception:  # noqa: BLE001 - no pin is the URL as it is, not a lost tick (nor a failed probe)
            self.addresses.latest = {r.name: Pin(r.host, None) for r in cfg.replicas}
            return self.addresses.latest
        self._pinned_table = (self.addresses.table,)
        return pins

    @property
    def pins(self) -> dict[str, Pin]:
        """Where each replica's URL led at the last tick (observe/addresses.py)."""
        return self.addresses.latest

    def where(self, r: ReplicaConfig) -> str:
        """The address R's port owner is judged at: its pin, else its URL's host."""
        pin = self.pins.get(r.name)
        return pin.address if pin is not None and pin.address is not None else r.host

    async def replicas(
        self,
        cfg: Config,
        at_mono: float,
        take_results: Callable[[], Results] = Results,
        wait_s: float | None = None,
    ) -> dict[str, ReplicaObservation]:
        """One observation per replica. Probes still running after WAIT_S are carried over (see
        ProbeCarry); with WAIT_S None, every probe is waited for (its own timeout bounds it)."""
        self.carry.forget({r.name for r in cfg.replicas})
        bound_s = cfg.watchdog.unresponsive_after_s
        if not self.pins:
            await self.pin(cfg)
        tasks = [
            task
            for r in cfg.replicas
            for task in self.carry.start(self.client, r, at_mono, bound_s, self.pins.get(r.name), self.engine_of(r))
        ]
        (owners, units), _ = await asyncio.gather(
            self._views(cfg),
            asyncio.wait(tasks, timeout=wait_s) if tasks else asyncio.sleep(0),
        )
        judged_at = time.monotonic() if wait_s is not None else at_mono
        results = take_results()
        return {
            r.name: as_engine(
                replace(
                    replica_observation(
                        r, at_mono, units[r.unit], owners.get(r.port), results, self.carry.take(r.name, judged_at)
                    ),
                    declared=self.declared.get(r.name),
                ),
                self.engine_of(r),
            )
            for r in cfg.replicas
        }

    async def _views(self, cfg: Config) -> tuple[dict[int, PortOwner], dict[str, UnitView]]:
        """Who holds each replica's port, and each unit; the containers name the containers that
        hold ports and stand in for the unit of a unit-less container."""
        table, self._pinned_table = self._pinned_table, None  # listener_table of cfg's ports, as wanted's
        owners, units = await asyncio.gather(
            self.port_cache.get(self.sd, {r.port: self.where(r) for r in cfg.replicas}, table),
            self.unit_cache.get(self.sd, [r.unit for r in cfg.replicas if not r.unitless], time.monotonic()),
        )
        if any(r.container is not None for r in cfg.replicas):
            owners, unitless = await self.containers.views(cfg.replicas, owners)
            units.update(unitless)
        return owners, units
