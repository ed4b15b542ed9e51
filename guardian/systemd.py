"""All of guardian's D-Bus talk with systemd, in one thin module.

Only dbus_next imports live here, and only its aio MessageBus and Message API, which the
maintained fork dbus-fast has too: switching is a change of imports. Every call has a timeout.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Callable

from dbus_next import BusType, Message, MessageType, Variant
from dbus_next.aio import MessageBus

from .observations import UnitInfo

SD = "org.freedesktop.systemd1"
SD_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
UNIT_IFACE = "org.freedesktop.systemd1.Unit"
SERVICE_IFACE = "org.freedesktop.systemd1.Service"
PROPS = "org.freedesktop.DBus.Properties"
UNIT_PROPS = ("LoadState", "ActiveState", "SubState", "UnitFileState", "InactiveExitTimestamp", "InvocationID",
              "Conflicts", "ConflictedBy", "FragmentPath", "Job")
SERVICE_PROPS = ("MainPID", "Restart", "NRestarts")


MAX_CALLS_IN_FLIGHT = 16


class SystemdError(Exception):
    pass


def _v(value):
    return value.value if isinstance(value, Variant) else value


@dataclass(frozen=True)
class ServiceDetails:
    """Service properties the memory guard and hazard scan read."""

    environment_files: tuple[str, ...]
    exec_start: tuple[str, ...]  # argv of the first ExecStart=


class Systemd:
    def __init__(self, call_timeout_s: float = 5.0) -> None:
        self.call_timeout_s = call_timeout_s
        self.bus: MessageBus | None = None
        self._jobs: dict[str, asyncio.Future[str]] = {}
        self._finished: dict[str, str] = {}
        self._listeners: list[Callable[[str], None]] = []
        # dbus-next fails a send with EAGAIN, and leaves the stream unusable, once its socket's
        # buffer is full: with 32 replicas a tick's unit views were some 450 calls at once.
        self._in_flight = asyncio.Semaphore(MAX_CALLS_IN_FLIGHT)

    async def connect(self) -> None:
        address = os.environ.get("GUARDIAN_DBUS_ADDRESS")  # tests may point elsewhere
        bus = MessageBus(bus_address=address) if address else MessageBus(bus_type=BusType.SYSTEM)
        self.bus = await asyncio.wait_for(bus.connect(), self.call_timeout_s)
        self.bus.add_message_handler(self._on_message)
        await self._call(MANAGER, "Subscribe", "", [], path=SD_PATH)
        for member in ("JobRemoved", "Reloading", "UnitFilesChanged"):
            await self._call(
                "org.freedesktop.DBus", "AddMatch", "s",
                [f"type='signal',sender='{SD}',interface='{MANAGER}',member='{member}'"],
                path="/org/freedesktop/DBus", destination="org.freedesktop.DBus",
            )

    def close(self) -> None:
        if self.bus is not None:
            self.bus.disconnect()
            self.bus = None

    def on_units_changed(self, listener: Callable[[str], None]) -> None:
        """LISTENER(reason) is called when unit files change or systemd reloads."""
        self._listeners.append(listener)

    def _on_message(self, msg: Message):
        if msg.message_type != MessageType.SIGNAL or msg.interface != MANAGER:
            return None
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
        elif msg.member in ("UnitFilesChanged",) or (msg.member == "Reloading" and msg.body and not msg.body[0]):
            for listener in self._listeners:
                listener(msg.member)
        return None

    async def _call(self, interface, member, signature, body, path=SD_PATH, destination=SD, timeout_s=None):
        if self.bus is None:
            raise SystemdError("not connected to the system bus")
        msg = Message(destination=destination, path=path, interface=interface, member=member,
                      signature=signature, body=body)
        try:
            async with self._in_flight:
                reply = await asyncio.wait_for(self.bus.call(msg), timeout_s or self.call_timeout_s)
        except asyncio.TimeoutError:
            raise SystemdError(f"D-Bus {member} timed out after {timeout_s or self.call_timeout_s:.0f} s") from None
        if reply.message_type == MessageType.ERROR:
            detail = reply.body[0] if reply.body else ""
            raise SystemdError(f"{member}: {reply.error_name}: {detail}")
        return reply.body

    async def unit_path(self, name: str) -> str:
        (path,) = await self._call(MANAGER, "LoadUnit", "s", [name])
        return path

    async def active_state(self, name: str) -> str:
        try:
            (path,) = await self._call(MANAGER, "GetUnit", "s", [name])
        except SystemdError as e:
            if "NoSuchUnit" in str(e):
                return "inactive"  # not loaded means not running
            raise
        (v,) = await self._call(PROPS, "Get", "ss", [UNIT_IFACE, "ActiveState"], path=path)
        return _v(v)

    async def _some_props(self, path: str, interface: str, names: tuple[str, ...]) -> dict:
        values = await asyncio.gather(*(self._call(PROPS, "Get", "ss", [interface, n], path=path) for n in names))
        return {n: _v(v) for n, (v,) in zip(names, values)}

    async def unit_fingerprints(self, names: list[str]) -> dict[str, tuple]:
        """Per unit (load, active, sub state, job id, invocation id): what changes when it starts,
        stops, restarts or gets a job. One call for all units plus one per unit, where unit_info
        makes 13 per unit."""
        (rows,) = await self._call(MANAGER, "ListUnitsByNames", "as", [list(names)])
        invocations = await asyncio.gather(*(self._call(PROPS, "Get", "ss", [UNIT_IFACE, "InvocationID"], path=row[6])
                                             for row in rows))
        out: dict[str, tuple] = {}
        for row, (inv,) in zip(rows, invocations):
            name, _desc, load, active, sub, _following, _path, job_id, _jt, _jp = row
            out[name] = (load, active, sub, job_id, bytes(_v(inv)).hex())
        return out

    async def unit_info(self, name: str) -> UnitInfo:
        # Asked for by name, not GetAll: a service's GetAll carries some 300 properties, and
        # unmarshalling them every tick was most of guardian's CPU time (bench/, docs/benchmarks.md).
        path = await self.unit_path(name)
        u = await self._some_props(path, UNIT_IFACE, UNIT_PROPS)
        svc: dict = {}
        if u.get("LoadState") == "loaded" and name.endswith(".service"):
            svc = await self._some_props(path, SERVICE_IFACE, SERVICE_PROPS)
        others = sorted(set(u.get("Conflicts", [])) | set(u.get("ConflictedBy", [])))
        conflicts = []
        for other in others:
            conflicts.append((other, await self.active_state(other)))
        exit_us = u.get("InactiveExitTimestamp", 0)
        job = u.get("Job") or (0, "/")
        return UnitInfo(
            name=name,
            load_state=u.get("LoadState", ""),
            active_state=u.get("ActiveState", ""),
            sub_state=u.get("SubState", ""),
            unit_file_state=u.get("UnitFileState", ""),
            inactive_exit_ts=exit_us / 1e6 if exit_us else None,
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
        svc = await self._some_props(path, SERVICE_IFACE, ("EnvironmentFiles", "ExecStart"))
        env_files = tuple(p for p, _optional in svc.get("EnvironmentFiles", []))
        exec_start = svc.get("ExecStart", [])
        argv = tuple(exec_start[0][1]) if exec_start else ()
        return ServiceDetails(env_files, argv)

    async def unit_by_pid(self, pid: int) -> str | None:
        try:
            (path,) = await self._call(MANAGER, "GetUnitByPID", "u", [pid])
        except SystemdError:
            return None
        (v,) = await self._call(PROPS, "Get", "ss", [UNIT_IFACE, "Id"], path=path)
        return _v(v)

    async def enabled_service_conflicts(self) -> dict[str, tuple[str, ...]]:
        """Every enabled service unit file -> the units it conflicts with.

        systemd loads units lazily, so a disabled-but-not-loaded or enabled-but-inactive unit's
        Conflicts= is invisible in the replica's ConflictedBy=; LoadUnit makes it visible.
        """
        (files,) = await self._call(MANAGER, "ListUnitFilesByPatterns", "asas", [["enabled", "enabled-runtime"], ["*.service"]])
        result: dict[str, tuple[str, ...]] = {}
        for file_path, _state in files:
            name = os.path.basename(file_path)
            if name.endswith("@.service"):
                continue  # a template: its instances are looked at when loaded
            try:
                path = await self.unit_path(name)
                (v,) = await self._call(PROPS, "Get", "ss", [UNIT_IFACE, "Conflicts"], path=path)
            except SystemdError:
                continue
            result[name] = tuple(_v(v))
        return result

    async def largest_units(self, n: int = 3) -> list[tuple[str, int]]:
        """The N running services with the most MemoryCurrent (cgroup memory: on GB10 a replica's
        GPU memory is not in it, a database's is)."""
        (units,) = await self._call(MANAGER, "ListUnitsByPatterns", "asas", [["active"], ["*.service"]])
        sizes = []
        for u in units:
            name, path = u[0], u[6]
            try:
                (v,) = await self._call(PROPS, "Get", "ss", [SERVICE_IFACE, "MemoryCurrent"], path=path)
            except SystemdError:
                continue
            value = int(_v(v))
            if value < 2**64 - 1:  # UINT64_MAX: not known
                sizes.append((name, value))
        return sorted(sizes, key=lambda x: -x[1])[:n]

    async def restart(self, name: str, timeout_s: float) -> str:
        """RestartUnit(name, "replace") and wait for the job's JobRemoved result."""
        loop = asyncio.get_running_loop()
        (job_path,) = await self._call(MANAGER, "RestartUnit", "ss", [name, "replace"])
        if job_path in self._finished:
            return self._finished.pop(job_path)
        fut: asyncio.Future[str] = loop.create_future()
        self._jobs[job_path] = fut
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            return f"no result within {timeout_s:.0f} s"
        finally:
            self._jobs.pop(job_path, None)
