"""All of guardian's D-Bus talk with systemd, in one thin module, on dbus-fast.

dbus-fast is the maintained fork of dbus-next (same aio API). Every call has a timeout, and at
most MAX_CALLS_IN_FLIGHT are in flight: dbus-next died on EAGAIN with 32 replicas' views at once
(python-dbus-next #153), and dbus-fast still finalizes the bus on a send error.

When the system bus connection drops (``systemctl restart dbus``, a send error), every call fails
at once with SystemdError (so views are "unknown" and nothing is restarted on them), restart jobs
waiting for their JobRemoved signal end as "bus lost", and a task reconnects with back-off
(RECONNECT_FIRST_S doubling to RECONNECT_MAX_S), subscribes to systemd's signals again, and tells
the listeners. ``lost_for_s`` says how long the bus has been gone; the daemon stops pinging
systemd's watchdog past ``bus_lost_restart_s`` so that systemd restarts it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from dbus_fast import BusType, Message, MessageType, Variant
from dbus_fast.aio import MessageBus

from ..core.container import helper_unit
from ..core.observations import UnitInfo
from ..core.vocab import ActiveState, LoadState, UnitFileState

SD = "org.freedesktop.systemd1"
SD_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
UNIT_IFACE = "org.freedesktop.systemd1.Unit"
SERVICE_IFACE = "org.freedesktop.systemd1.Service"
JOB_IFACE = "org.freedesktop.systemd1.Job"
PROPS = "org.freedesktop.DBus.Properties"
UNIT_PROPS = (
    "LoadState",
    "ActiveState",
    "SubState",
    "UnitFileState",
    "InactiveExitTimestampMonotonic",
    "InvocationID",
    "Conflicts",
    "ConflictedBy",
    "FragmentPath",
    "Job",
)
SERVICE_PROPS = ("MainPID", "Restart", "NRestarts")


MAX_CALLS_IN_FLIGHT = 16
RECONNECT_FIRST_S = 0.5
RECONNECT_MAX_S = 30.0
BUS_LOST = "bus lost before the job ended"
JOB_DONE = "done"  # systemd's job result for a job that succeeded
JOB_POLL_S = 0.02  # how often a queued job is asked whether it has begun


class SystemdEvent(StrEnum):
    """Why views kept from before may be stale."""

    UNIT_FILES_CHANGED = "UnitFilesChanged"
    RELOADED = "Reloading"
    BUS_LOST = "bus-lost"
    BUS_BACK = "bus-back"


class SystemdError(Exception):
    pass


def _v(value: Any) -> Any:
    return value.value if isinstance(value, Variant) else value


@dataclass(frozen=True)
class ServiceDetails:
    """Service properties the memory guard's wiring check reads."""

    environment_files: tuple[str, ...]  # in the unit's order: a later file overrides an earlier one
    exec_start: tuple[str, ...]  # argv of the first ExecStart=
    environment: tuple[str, ...] = ()  # Environment= as "KEY=VALUE"
    user: str = ""  # User= ("": root)
    timeout_stop_us: int | None = None  # TimeoutStopUSec (None: infinity, or not reported)


class Systemd:
    def __init__(self, call_timeout_s: float = 5.0) -> None:
        self.call_timeout_s = call_timeout_s
        self.bus: MessageBus | None = None
        self._jobs: dict[str, asyncio.Future[str]] = {}
        self._finished: dict[str, str] = {}
        self._listeners: list[Callable[[SystemdEvent], None]] = []
        self._in_flight = asyncio.Semaphore(MAX_CALLS_IN_FLIGHT)
        self._lost_at_mono: float | None = None
        self._closing = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.reconnects = 0

    # --- connection -------------------------------------------------------------------------
    async def connect(self) -> None:
        """Connect once; raises SystemdError. Later drops are handled by reconnecting."""
        try:
            await self._connect_once()
        except (TimeoutError, OSError, EOFError) as e:
            raise SystemdError(f"cannot connect to the system bus: {e or type(e).__name__}") from None

    async def _connect_once(self) -> None:
        address = os.environ.get("GUARDIAN_DBUS_ADDRESS")  # tests may point elsewhere
        bus = MessageBus(bus_address=address) if address else MessageBus(bus_type=BusType.SYSTEM)
        try:
            await asyncio.wait_for(bus.connect(), self.call_timeout_s)
            bus.add_message_handler(self._on_message)
            self.bus = bus
            await self.call(MANAGER, "Subscribe", "", [], path=SD_PATH)
            for member in ("JobRemoved", "Reloading", "UnitFilesChanged"):
                await self.call(
                    "org.freedesktop.DBus",
                    "AddMatch",
                    "s",
                    [f"type='signal',sender='{SD}',interface='{MANAGER}',member='{member}'"],
                    path="/org/freedesktop/DBus",
                    destination="org.freedesktop.DBus",
                )
        except BaseException:
            self.bus = None
            bus.disconnect()
            raise
        self._spawn(self._watch(bus))

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self, bus: MessageBus) -> None:
        try:
            await bus.wait_for_disconnect()  # type: ignore[no-untyped-call]  # dbus-fast leaves it unannotated
        except Exception:  # noqa: BLE001 - the reason does not matter: the bus is gone
            pass
        if self._closing or self.bus is not bus:
            return
        self.bus = None
        self._lost_at_mono = time.monotonic()
        for job, fut in list(self._jobs.items()):
            if not fut.done():
                fut.set_result(BUS_LOST)
            self._jobs.pop(job, None)
        self._notify(SystemdEvent.BUS_LOST)
        self._spawn(self._reconnect())

    async def _reconnect(self) -> None:
        delay_s = RECONNECT_FIRST_S
        while not self._closing and self.bus is None:
            await asyncio.sleep(delay_s)
            try:
                await self._connect_once()
            except (TimeoutError, OSError, EOFError, SystemdError):
                delay_s = min(delay_s * 2, RECONNECT_MAX_S)
                continue
            self.reconnects += 1
            self._notify(SystemdEvent.BUS_BACK)
            self._lost_at_mono = None

    @property
    def connected(self) -> bool:
        return self.bus is not None

    def lost_for_s(self, mono_now: float) -> float:
        """Seconds since the bus connection dropped; 0 while connected."""
        return 0.0 if self._lost_at_mono is None else mono_now - self._lost_at_mono

    def close(self) -> None:
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        if self.bus is not None:
            self.bus.disconnect()
            self.bus = None

    def on_units_changed(self, listener: Callable[[SystemdEvent], None]) -> None:
        """LISTENER(reason) is called when unit files change, systemd reloads, or the bus is lost
        ("bus-lost") or back ("bus-back"): any view kept from before may be stale."""
        self._listeners.append(listener)

    def _notify(self, reason: SystemdEvent) -> None:
        for listener in self._listeners:
            listener(reason)

    def _on_message(self, msg: Message) -> None:
        if msg.message_type != MessageType.SIGNAL or msg.interface != MANAGER:
            return
        if msg.member == "JobRemoved":
            _id, job_path, _unit, result = msg.body
            fut = self._jobs.pop(job_path, None)
            if fut is not None and not fut.done():
                fut.set_result(result)
            else:
                # It may be ours, finishing before RestartUnit's reply was read; keep a few.
                self._finished[job_path] = result
                while len(self._finished) > 64:
                    self._finished.pop(next(iter(self._finished)))
        elif msg.member == "UnitFilesChanged":
            self._notify(SystemdEvent.UNIT_FILES_CHANGED)
        elif msg.member == "Reloading" and msg.body and not msg.body[0]:  # the end of a daemon-reload
            self._notify(SystemdEvent.RELOADED)

    async def call(
        self,
        interface: str,
        member: str,
        signature: str,
        body: list[Any],
        path: str = SD_PATH,
        destination: str = SD,
    ) -> list[Any]:
        bus = self.bus
        if bus is None:
            raise SystemdError("not connected to the system bus")
        msg = Message(
            destination=destination, path=path, interface=interface, member=member, signature=signature, body=body
        )
        limit_s = self.call_timeout_s
        try:
            async with self._in_flight:
                async with asyncio.timeout(limit_s):
                    reply = await bus.call(msg)
        except TimeoutError:
            raise SystemdError(f"D-Bus {member} timed out after {limit_s:.0f} s") from None
        except (OSError, EOFError) as e:
            raise SystemdError(f"D-Bus {member}: the bus connection failed: {e or type(e).__name__}") from None
        if reply is None:
            raise SystemdError(f"D-Bus {member}: no reply (the bus connection closed)")
        if reply.message_type == MessageType.ERROR:
            detail = reply.body[0] if reply.body else ""
            raise SystemdError(f"{member}: {reply.error_name}: {detail}")
        return list(reply.body)

    async def unit_path(self, name: str) -> str:
        (path,) = await self.call(MANAGER, "LoadUnit", "s", [name])
        return str(path)

    async def active_state(self, name: str) -> ActiveState:
        try:
            (path,) = await self.call(MANAGER, "GetUnit", "s", [name])
        except SystemdError as e:
            if "NoSuchUnit" in str(e):
                return ActiveState.INACTIVE  # not loaded means not running
            raise
        (v,) = await self.call(PROPS, "Get", "ss", [UNIT_IFACE, "ActiveState"], path=path)
        return ActiveState.parse(str(_v(v)))

    async def _some_props(self, path: str, interface: str, names: tuple[str, ...]) -> dict[str, Any]:
        values = await asyncio.gather(*(self.call(PROPS, "Get", "ss", [interface, n], path=path) for n in names))
        return {n: _v(v) for n, (v,) in zip(names, values, strict=False)}

    async def unit_fingerprints(self, names: list[str]) -> dict[str, tuple[str, ...]]:
        """Per unit (load, active, sub state, job id, invocation id): what changes when it starts,
        stops, restarts or gets a job. One call for all units plus one per unit, where unit_info
        makes 14, plus 2 per Conflicts=/ConflictedBy= entry."""
        (rows,) = await self.call(MANAGER, "ListUnitsByNames", "as", [list(names)])
        invocations = await asyncio.gather(
            *(self.call(PROPS, "Get", "ss", [UNIT_IFACE, "InvocationID"], path=row[6]) for row in rows)
        )
        out: dict[str, tuple[str, ...]] = {}
        for row, (inv,) in zip(rows, invocations, strict=False):
            name, _desc, load, active, sub, _following, _path, job_id, _jt, _jp = row
            out[name] = (load, active, sub, str(job_id), bytes(_v(inv)).hex())
        return out

    async def unit_info(self, name: str) -> UnitInfo:
        # Asked for by name, not GetAll: a service's GetAll carries some 300 properties, and
        # unmarshalling them every tick was most of guardian's CPU time (bench/, docs/benchmarks.md).
        path = await self.unit_path(name)
        u = await self._some_props(path, UNIT_IFACE, UNIT_PROPS)
        svc: dict[str, Any] = {}
        if LoadState.parse(u.get("LoadState", "")) is LoadState.LOADED and name.endswith(".service"):
            svc = await self._some_props(path, SERVICE_IFACE, SERVICE_PROPS)
        others = sorted(set(u.get("Conflicts", [])) | set(u.get("ConflictedBy", [])))
        conflicts = []
        for other in others:
            conflicts.append((other, await self.active_state(other)))
        exit_us = u.get("InactiveExitTimestampMonotonic", 0)
        job = u.get("Job") or (0, "/")
        return UnitInfo(
            name=name,
            load_state=LoadState.parse(u.get("LoadState", "")),
            active_state=ActiveState.parse(u.get("ActiveState", "")),
            sub_state=u.get("SubState", ""),
            unit_file_state=UnitFileState.parse(u.get("UnitFileState", "")),
            inactive_exit_mono=exit_us / 1e6 if exit_us else None,
            main_pid=int(svc.get("MainPID", 0)),
            invocation_id=bytes(u.get("InvocationID", b"")).hex(),
            restart=svc.get("Restart", ""),
            n_restarts=int(svc.get("NRestarts", 0)),
            conflicts=tuple(conflicts),
            fragment_path=u.get("FragmentPath", ""),
            job_pending=bool(job[0]),
        )

    async def service_details(self, name: str) -> ServiceDetails:
        path = await self.unit_path(name)
        names = ("EnvironmentFiles", "ExecStart", "Environment", "User", "TimeoutStopUSec")
        svc = await self._some_props(path, SERVICE_IFACE, names)
        env_files = tuple(str(p) for p, _optional in svc.get("EnvironmentFiles", []))
        exec_start = svc.get("ExecStart", [])
        argv = tuple(str(a) for a in exec_start[0][1]) if exec_start else ()
        env = tuple(str(e) for e in svc.get("Environment", []))
        stop_us = int(svc.get("TimeoutStopUSec", 2**64 - 1))
        timeout_stop_us = stop_us if stop_us < 2**64 - 1 else None  # UINT64_MAX: infinity
        return ServiceDetails(env_files, argv, env, str(svc.get("User", "")), timeout_stop_us)

    async def exec_lines(self, name: str) -> dict[str, tuple[tuple[str, ...], ...]]:
        """ExecStartPre, ExecStart, ExecStop and ExecStopPost of a service: the argv of each line."""
        keys = ("ExecStartPre", "ExecStart", "ExecStop", "ExecStopPost")
        path = await self.unit_path(name)
        svc = await self._some_props(path, SERVICE_IFACE, keys)
        return {k: tuple(tuple(str(a) for a in line[1]) for line in svc.get(k, [])) for k in keys}

    async def unit_by_pid(self, pid: int) -> str | None:
        try:
            (path,) = await self.call(MANAGER, "GetUnitByPID", "u", [pid])
        except SystemdError:
            return None
        (v,) = await self.call(PROPS, "Get", "ss", [UNIT_IFACE, "Id"], path=path)
        return str(_v(v))

    async def enabled_service_conflicts(self) -> dict[str, tuple[str, ...]]:
        """Every enabled service unit file -> the units it conflicts with.

        systemd loads units lazily, so a disabled-but-not-loaded or enabled-but-inactive unit's
        Conflicts= is invisible in the replica's ConflictedBy=; LoadUnit makes it visible.
        """
        (files,) = await self.call(
            MANAGER, "ListUnitFilesByPatterns", "asas", [["enabled", "enabled-runtime"], ["*.service"]]
        )
        result: dict[str, tuple[str, ...]] = {}
        for file_path, _state in files:
            name = os.path.basename(file_path)
            if name.endswith("@.service"):
                continue  # a template: its instances are looked at when loaded
            try:
                path = await self.unit_path(name)
                (v,) = await self.call(PROPS, "Get", "ss", [UNIT_IFACE, "Conflicts"], path=path)
            except SystemdError:
                continue
            result[name] = tuple(str(x) for x in _v(v))
        return result

    async def largest_units(self, n: int = 3) -> list[tuple[str, int]]:
        """The N running services with the most MemoryCurrent (cgroup memory: on GB10 a replica's
        GPU memory is not in it, a database's is)."""
        (units,) = await self.call(MANAGER, "ListUnitsByPatterns", "asas", [["active"], ["*.service"]])
        sizes = []
        for u in units:
            name, path = u[0], u[6]
            try:
                (v,) = await self.call(PROPS, "Get", "ss", [SERVICE_IFACE, "MemoryCurrent"], path=path)
            except SystemdError:
                continue
            value = int(_v(v))
            if value < 2**64 - 1:  # UINT64_MAX: not known
                sizes.append((str(name), value))
        return sorted(sizes, key=lambda x: -x[1])[:n]

    async def memory_current(self, name: str) -> int | None:
        """NAME's MemoryCurrent (its cgroup's memory.current), or None when systemd does not know it
        (no memory accounting, the unit not loaded). Two calls: cheap enough for every tick of a start."""
        try:
            (path,) = await self.call(MANAGER, "GetUnit", "s", [name])
        except SystemdError as e:
            if "NoSuchUnit" in str(e):
                return None  # not loaded: nothing is running in it
            raise
        (v,) = await self.call(PROPS, "Get", "ss", [SERVICE_IFACE, "MemoryCurrent"], path=path)
        value = int(_v(v))
        return value if value < 2**64 - 1 else None  # UINT64_MAX: not known

    async def run_helper(self, verb: str, replica: str, timeout_s: float) -> str:
        """Start guardian's container helper, guardian-container@VERB:REPLICA.service, and wait for its
        result ("done" or why not): "inspect" for the observer (it writes a report the observer reads),
        "restart" and "kill" for act/units.py. The one road to the helper, for both."""
        try:
            return await self.run_job("StartUnit", helper_unit(verb, replica), timeout_s)
        except SystemdError as e:
            return f"error: {e}"

    async def run_job(
        self, member: str, name: str, timeout_s: float, during: Callable[[], Awaitable[None]] | None = None
    ) -> str:
        """The one primitive of the bus that starts a job, for act/units.py (every restart, kill and
        job guardian causes) and for the container inspector's helper (observe/containers.py), which
        must start a unit to read. MEMBER (StartUnit, ReloadUnit, ...) of NAME in mode "replace", and wait for the job's
        result ("done", "failed", ...; polkit verbs "start", "reload"). DURING runs once the job's
        State is "running", never while it waits: systemd answers the call before its run queue
        (the lowest priority) starts the job, so a kill sent at once could reach the unit's main
        process while the unit is still active; the unit would then fail on the signal and its own
        Restart= would schedule a second restart beside guardian's (a restart job that has begun
        has called the unit's stop, which forbids that). A job that ends without running (it
        waited on another unit's job, then failed) skips DURING."""
        loop = asyncio.get_running_loop()
        (job_path,) = await self.call(MANAGER, member, "ss", [name, "replace"])
        job_path = str(job_path)
        fut: asyncio.Future[str] = loop.create_future()
        if job_path in self._finished:
            fut.set_result(self._finished.pop(job_path))
        else:
            self._jobs[job_path] = fut
        try:
            deadline_mono = loop.time() + timeout_s
            if during is not None and await self._began(job_path, fut, deadline_mono):
                await during()
            return await asyncio.wait_for(fut, max(0.0, deadline_mono - loop.time()))
        except TimeoutError:
            return f"no result within {timeout_s:.0f} s"
        finally:
            self._jobs.pop(job_path, None)

    async def _began(self, job_path: str, fut: asyncio.Future[str], deadline_mono: float) -> bool:
        """Whether JOB_PATH reached State "running" before
        it ended or the deadline passed (polled). A job object that is gone has ended."""
        loop = asyncio.get_running_loop()
        while not fut.done() and loop.time() < deadline_mono:
            try:
                (v,) = await self.call(PROPS, "Get", "ss", [JOB_IFACE, "State"], path=job_path)
                if str(_v(v)) == "running":
                    return True
            except SystemdError as e:
                if any(gone in str(e) for gone in ("UnknownObject", "NoSuchJob")):
                    return False
                # a slow or lost bus: asked again until the job ends (JobRemoved, or "bus lost")
            await asyncio.sleep(JOB_POLL_S)
        return False

    async def unit_processes(self, name: str) -> list[tuple[int, str]]:
        """(pid, command line) of each process in NAME's cgroup (GetUnitProcesses: no polkit verb)."""
        (rows,) = await self.call(MANAGER, "GetUnitProcesses", "s", [name])
        return [(int(pid), str(cmdline)) for _cgroup, pid, cmdline in rows]
