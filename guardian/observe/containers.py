"""Container replicas as guardian sees them without any engine access of its own.

The port's holder comes from the socket's cgroup (observe/replicas.port_owners). Three of them
point at a container: an engine's scope (`docker-<id>.scope`, `libpod-<id>.scope`), Docker's
docker-proxy in docker.service (its world-readable command line names the container's address),
and Podman's conmon (its command line names the container). Which container an id or address
is comes from the root helper's report (engine_helper.py), asked for only when a holder is not in
the last report, at most every REFRESH_S per replica, and right before a restart.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from ..config import CONTAINER_PHASE_S, ReplicaConfig
from ..core.container import (
    MAX_CONTAINERS,
    Container,
    EngineReport,
    container_id_of_cgroup,
    find_container,
    synthetic_unit,
)
from ..core.observations import UnitInfo
from ..core.vocab import HeldBy, PortOwner
from .memory import cmdline_of
from .readback import Refused, read_back
from .sockets import cgroup_of_pid
from .systemd import JOB_DONE, Systemd, SystemdError

REPORT_DIR = Path("/run/guardian-containers")  # the helper's (root's) RuntimeDirectory
REPORT_MAX_BYTES = 4 * 2**20
REFRESH_S = 10.0  # a replica's report is asked for at most this often, unless a restart needs it
FORCED_GAP_S = 2.0  # a report older than the port's holder is asked for again at most this often
# A tick waits this long for an inspect (systemd's watchdog is pinged after each tick); a slower
# one finishes on its own and its report is read at the next refresh.
HELPER_TIMEOUT_S = 5.0  # one helper job; a tick's together: config.CONTAINER_PHASE_S
# `guardian check` has no tick to keep: it waits as long as a restart's helper may take, so that a
# loaded box (docker inspect slow) still has its holders named rather than left as a bare scope.
CHECK_HELPER_TIMEOUT_S = 30.0
_MAX_TEXT = 256


def _text(row: dict[str, Any], key: str, max_chars: int = _MAX_TEXT) -> str:
    v = row.get(key, "")
    if not isinstance(v, str) or len(v) > max_chars or any(ord(c) < 0x20 for c in v):
        raise ValueError(f"{key} is not a short text")
    return v


def _container(row: Any) -> Container:
    if not isinstance(row, dict):
        raise ValueError("a row is not an object")
    ips, ports = row.get("ips", []), row.get("host_ports", [])
    if not (isinstance(ips, list) and all(isinstance(x, str) and len(x) <= 64 for x in ips[:64])):
        raise ValueError("ips is not a list of addresses")
    if not (isinstance(ports, list) and all(isinstance(x, int) and 0 < x < 65536 for x in ports[:1024])):
        raise ValueError("host_ports is not a list of ports")
    fraction = row.get("fraction")
    for key in ("running", "restarting"):
        if not isinstance(row.get(key, False), bool):
            raise ValueError(f"{key} is not true or false")
    for key in ("pid", "exit_code"):
        if not isinstance(row.get(key, 0), int) or isinstance(row.get(key, 0), bool):
            raise ValueError(f"{key} is not a number")
    return Container(
        id=_text(row, "id", 128),
        name=_text(row, "name", 128),
        running=row.get("running", False),
        restarting=row.get("restarting", False),
        status=_text(row, "status", 32),
        pid=row.get("pid", 0),
        started_at=_text(row, "started_at", 64),
        finished_at=_text(row, "finished_at", 64),
        exit_code=row.get("exit_code", 0),
        restart_policy=_text(row, "restart_policy", 32),
        ips=tuple(ips[:64]),
        host_ports=tuple(ports[:1024]),
        fraction=fraction if isinstance(fraction, str) and len(fraction) <= 32 else None,
    )


def _others(part: Any, engine: str) -> tuple[Container, ...]:
    """The other engine's containers in a report; a part that cannot be read names nothing
    (it only ever names a stray) and spoils nothing of the replica's own engine's part."""
    if not isinstance(part, dict) or part.get("engine") == engine:
        return ()
    rows = part.get("containers", [])
    if not isinstance(rows, list) or len(rows) > MAX_CONTAINERS:
        return ()
    try:
        return tuple(_container(x) for x in rows)
    except (ValueError, TypeError):
        return ()


def parse_report(data: bytes, engine: str) -> EngineReport:
    """The helper's report, checked field by field; anything else is a report with an error."""
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("engine") != engine:
            raise ValueError(f"not a report of {engine}")
        at = doc.get("at_wall")
        if not isinstance(at, (int, float)) or isinstance(at, bool):
            raise ValueError("at_wall is not a time")
        rows = doc.get("containers", [])
        if not isinstance(rows, list) or len(rows) > MAX_CONTAINERS:
            raise ValueError(f"containers is not a list of at most {MAX_CONTAINERS}")
        error = doc.get("error")
        return EngineReport(
            engine,
            float(at),
            tuple(_container(x) for x in rows),
            error=error[:500] if isinstance(error, str) else None,
            truncated=doc.get("truncated") is True,
            others=_others(doc.get("others"), engine),
        )
    except (ValueError, TypeError, RecursionError, OverflowError) as e:
        return EngineReport(engine, 0.0, error=f"the container helper's report cannot be read: {e}")


def read_report(r: ReplicaConfig, directory: Path = REPORT_DIR) -> EngineReport | None:
    try:
        data = read_back(directory / f"{r.name}.json", REPORT_MAX_BYTES)
    except FileNotFoundError:
        return None
    except (Refused, OSError) as e:
        return EngineReport(r.runtime, 0.0, error=f"the container helper's report cannot be read: {e}")
    return parse_report(data, r.runtime)


def _started_wall(pid: int | None) -> float | None:
    """When PID started, as epoch seconds (None: unknown or gone)."""
    if pid is None:
        return None
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def _option(argv: list[str], *names: str) -> str | None:
    for i, w in enumerate(argv):
        for n in names:
            if w == n and i + 1 < len(argv):
                return argv[i + 1]
            if w.startswith(n + "="):
                return w.partition("=")[2]
    return None


@dataclass(frozen=True)
class Seen:
    """What the holder's cgroup and command line tell by themselves, before any report."""

    container_id: str | None = None  # from an engine's scope
    ip: str | None = None  # docker-proxy's -container-ip
    name: str | None = None  # conmon's -n
    via: str = ""
    engine: str | None = None  # the engine whose holder this is (docker-proxy is Docker's, conmon Podman's)
    pid: int | None = None  # the process that stands for the holder (docker-proxy's, not dockerd's)
    forged: bool = False  # a unit named like an engine's scope outside the engines' slices


def _root_cgroup(pid: int) -> str | None:
    """PID's cgroup v2 path, when PID is root's: any user can name a unit docker.service or
    docker-<id>.scope in their own tree, and forge a command line; only root can be in
    /system.slice or /machine.slice as root."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != 0:
            return None
    except OSError:
        return None
    return cgroup_of_pid(pid)


_ENGINE_CGROUP = re.compile(r"^/(?:system|machine)\.slice/(?:docker|libpod|libpod-conmon)-[0-9a-f]{64}\.scope$")


def _in_docker_service(pid: int) -> bool:
    return _root_cgroup(pid) == "/system.slice/docker.service"


def _is_proxy_for(pid: int, port: int) -> bool:
    argv = list(cmdline_of(pid))
    return (
        bool(argv)
        and argv[0].rsplit("/", 1)[-1] == "docker-proxy"
        and _option(argv, "-host-port") == str(port)
        and _in_docker_service(pid)
    )


_PROXIES: dict[int, int] = {}  # port -> the docker-proxy last found for it (checked again before use)


def _docker_proxy(port: int) -> int | None:
    """The docker-proxy process that forwards host port PORT (docker.service holds many processes:
    the socket's cgroup alone does not say which). Command lines are world-readable; every one is
    read only when the last one found for PORT is gone."""
    known = _PROXIES.get(port)
    if known is not None and _is_proxy_for(known, port):
        return known
    _PROXIES.pop(port, None)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _is_proxy_for(int(entry.name), port):
            _PROXIES[port] = int(entry.name)
            return int(entry.name)
    return None


def seen_holder(owner: HeldBy) -> Seen | None:
    """How OWNER points at a container, or None when it does not."""
    component = (owner.unit or "").removesuffix(".scope")
    cid = container_id_of_cgroup(component)
    if cid is not None:
        path = _root_cgroup(owner.pid) if owner.pid is not None else None
        if path is None or not _ENGINE_CGROUP.match(path):
            return Seen(via=f"a unit named {owner.unit} outside the engines' slices", forged=True)
        engine = "docker" if component.startswith("docker-") else "podman"
        return Seen(container_id=cid, via=f"its scope {owner.unit}", engine=engine, pid=owner.pid)
    if owner.unit == "docker.service":
        # Docker's own docker-proxy: root's, in docker.service's cgroup (_is_proxy_for). A process
        # elsewhere that calls itself docker-proxy is any user's forgery (issue 34 row 4).
        pid = _docker_proxy(owner.port)
        if pid is None:
            return None
        argv = list(cmdline_of(pid))
        ip, port = _option(argv, "-container-ip"), _option(argv, "-container-port")
        return Seen(ip=ip, via=f"docker-proxy, pid {pid}, forwarding to {ip}:{port}", engine="docker", pid=pid)
    pid = owner.pid
    if pid is None:
        return None
    argv = list(cmdline_of(pid))
    prog = argv[0].rsplit("/", 1)[-1] if argv else ""
    if prog == "conmon":
        name = _option(argv, "-n", "--name")
        return Seen(name=name, via=f"Podman's conmon, pid {pid}", engine="podman", pid=pid)
    return None


def resolve(owner: HeldBy, r: ReplicaConfig, seen: Seen, report: EngineReport | None) -> HeldBy:
    """OWNER with the container it stands for, when a report (or conmon) names it, and whether it
    is the replica's own, known to be another's (HeldBy.stray), or not known yet."""
    foreign = seen.engine is not None and seen.engine != r.runtime
    found: Container | None = None
    if report is not None:
        pool = report.others if foreign else report.containers
        if seen.container_id is not None:
            found = find_container(pool, cid=seen.container_id)
        elif seen.ip is not None:
            found = find_container(pool, ip=seen.ip)
    name = found.name if found is not None else seen.name
    # Only the engine's report makes a holder the replica's own: a command line (conmon's -n) is
    # the process's own word, which any user's process can forge; it only names a stray.
    own = not foreign and found is not None and found.running and found.name == r.container
    stray = seen.forged or foreign or (name is not None and name != r.container)
    via = f"{seen.via}, a {seen.engine} container" if foreign and seen.engine else seen.via
    return replace(owner, container=name, own_container=own, via=via, stray=stray)


def _known(seen: Seen, r: ReplicaConfig, report: EngineReport | None) -> bool:
    if seen.name is not None or seen.forged:
        return True
    if report is None or report.error is not None:
        return False
    pool = report.others if seen.engine is not None and seen.engine != r.runtime else report.containers
    if seen.container_id is not None:
        return find_container(pool, cid=seen.container_id) is not None
    return seen.ip is not None and find_container(pool, ip=seen.ip) is not None


class ContainerWatch:
    """Each container replica's last helper report, and the unit-less ones' view as a unit."""

    def __init__(self, sd: Systemd, directory: Path = REPORT_DIR, helper_timeout_s: float = HELPER_TIMEOUT_S) -> None:
        self.sd = sd
        self.directory = directory
        self.helper_timeout_s = helper_timeout_s
        self._asked: dict[str, float] = {}
        self.reports: dict[str, EngineReport] = {}

    async def refresh(self, r: ReplicaConfig, force: bool = False) -> EngineReport | None:
        """Ask the helper for a new report (at most every REFRESH_S unless FORCE)."""
        mono = time.monotonic()
        if not force and mono - self._asked.get(r.name, -1e9) < REFRESH_S:
            return self.reports.get(r.name)
        self._asked[r.name] = mono
        result = await self.sd.run_helper("inspect", r.name, self.helper_timeout_s)
        report = read_report(r, self.directory)
        if result != JOB_DONE and (report is None or report.error is None):
            report = EngineReport(r.runtime, 0.0, error=f"the container helper's inspect ended with '{result}'")
        if report is not None:
            self.reports[r.name] = report
        return report

    async def owners(self, replicas: list[ReplicaConfig], owners: dict[int, PortOwner]) -> dict[int, PortOwner]:
        """OWNERS with the containers they stand for; the reports that must be asked for first are
        asked for all at once."""
        out = dict(owners)
        todo: list[tuple[ReplicaConfig, HeldBy, Seen]] = []
        for r in replicas:
            owner = owners.get(r.port)
            if r.container is None or not isinstance(owner, HeldBy) or owner.unit == r.unit:
                continue
            seen = seen_holder(owner)
            if seen is not None:
                todo.append((r, owner, seen))
        fresh = await asyncio.gather(
            *(self._report_for(r, seen) for r, _owner, seen in todo),
        )
        for (r, owner, seen), report in zip(todo, fresh, strict=True):
            out[r.port] = resolve(owner, r, seen, report)
        return out

    async def _report_for(self, r: ReplicaConfig, seen: Seen) -> EngineReport | None:
        """A report that can name SEEN: the last one, unless it predates the holder's process (a
        container started since may have taken a gone one's address: docker reuses 172.17.0.2),
        or does not know it; then a new one. One older than the holder names nothing."""
        report = self.reports.get(r.name)
        born = _started_wall(seen.pid)
        stale = report is not None and born is not None and report.at_wall < born
        if report is not None and not stale and _known(seen, r, report):
            return report
        if stale and time.monotonic() - self._asked.get(r.name, -1e9) < FORCED_GAP_S:
            return None  # asked for a moment ago: judged unknown until it comes
        report = await self.refresh(r, force=stale)
        if report is not None and born is not None and report.at_wall < born:
            return None
        return report

    async def views(
        self, replicas: list[ReplicaConfig], owners: dict[int, PortOwner]
    ) -> tuple[dict[int, PortOwner], dict[str, tuple[UnitInfo | None, str | None]]]:
        """A tick's container phase: the owners with their containers, and each unit-less replica's
        view, every helper wait at once and all of them within CONTAINER_PHASE_S (see there)."""
        unitless = [r for r in replicas if r.unitless]

        async def both() -> tuple[dict[int, PortOwner], list[tuple[UnitInfo | None, str | None]]]:
            named = await self.owners(replicas, owners)
            return named, list(await asyncio.gather(*(self.unitless_view(r) for r in unitless)))

        try:
            named, seen = await asyncio.wait_for(both(), CONTAINER_PHASE_S)
        except TimeoutError:
            why = f"the container helpers did not answer within {CONTAINER_PHASE_S:g} s (this tick)"
            return dict(owners), {r.unit: (None, why) for r in unitless}
        return named, {r.unit: view for r, view in zip(unitless, seen, strict=True)}

    def scope_of(self, r: ReplicaConfig) -> str | None:
        """The running container's own scope unit (its processes), from the last report."""
        report = self.reports.get(r.name)
        c = report.by_name(r.container) if report is not None and r.container else None
        if c is None or not c.id:
            return None
        return f"docker-{c.id}.scope" if r.runtime == "docker" else f"libpod-{c.id}.scope"

    async def _scope_info(self, r: ReplicaConfig) -> UnitInfo | None:
        scope = self.scope_of(r)
        if scope is None:
            return None
        try:
            return await self.sd.unit_info(scope)
        except SystemdError:
            return None

    async def unitless_view(self, r: ReplicaConfig) -> tuple[UnitInfo | None, str | None]:
        """A unit-less container as a UnitInfo (core/container.synthetic_unit), or why not."""
        report = self.reports.get(r.name) or await self.refresh(r)
        scope_info = await self._scope_info(r)
        if scope_info is None or not scope_info.active_state.running:
            report = await self.refresh(r)  # stopped, restarting or replaced: ask (at most every REFRESH_S)
            scope_info = await self._scope_info(r)
        if report is None or report.error is not None:
            return None, (report.error if report is not None else "the container helper has not reported yet")
        assert r.container is not None
        return synthetic_unit(r.unit, report.by_name(r.container), scope_info), None
