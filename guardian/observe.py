"""Observers: turn systemd, /proc and each replica's HTTP endpoints into immutable values.

Every call is bounded; a hung replica or a slow bus yields an observation that says so.
"""

from __future__ import annotations

import asyncio

import httpx

from . import probes
from .config import Config, ReplicaConfig
from .observations import CanaryResult, PortOwner, ReplicaObservation, RestartOutcome, UnitInfo
from .proc import listening_inodes, listeners
from .systemd import Systemd, SystemdError


async def unit_or_error(sd: Systemd, name: str) -> tuple[UnitInfo | None, str | None]:
    try:
        return await sd.unit_info(name), None
    except (SystemdError, OSError, asyncio.TimeoutError) as e:
        return None, str(e)


async def port_owners(sd: Systemd, ports: set[int]) -> dict[int, PortOwner]:
    table = await asyncio.to_thread(listeners, ports)
    if table is None:
        return {p: PortOwner(p, None, "?") for p in ports}
    out: dict[int, PortOwner] = {}
    for port in ports:
        if port not in table:
            out[port] = PortOwner(port, None, None)
        elif table[port] is None:
            out[port] = PortOwner(port, None, "?")
        else:
            pid = table[port]
            try:
                unit = await sd.unit_by_pid(pid)
            except SystemdError:
                unit = None
            out[port] = PortOwner(port, pid, unit)
    return out


class PortOwnerCache:
    """Who holds each replica's port, found again only when the listening sockets change.

    Finding a socket's process means reading every process's /proc/PID/fd, the costliest part
    of a tick (more so on a box with many processes); the socket table itself is cheap to read.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._owners: dict[int, PortOwner] = {}

    async def get(self, sd: Systemd, ports: set[int]) -> dict[int, PortOwner]:
        before = await asyncio.to_thread(listening_inodes, ports)
        key = (frozenset(ports), tuple(sorted(before.items())) if before is not None else None)
        if before is not None and key == self._key:
            return self._owners
        owners = await port_owners(sd, ports)
        after = await asyncio.to_thread(listening_inodes, ports)
        # Kept only when the sockets did not change during the scan and every holder was named
        # (a failed D-Bus lookup must not stick).
        complete = all(o.pid is None or o.unit not in (None, "?") for o in owners.values())
        self._key = key if after == before and complete else None
        self._owners = owners
        return owners


async def observe_replica(
    sd: Systemd, client: httpx.AsyncClient, r: ReplicaConfig, at: float, owner: PortOwner | None,
    canary: CanaryResult | None, outcome: RestartOutcome | None,
) -> ReplicaObservation:
    (unit, unit_error), health, (mprobe, sample), (models_probe, models) = await asyncio.gather(
        unit_or_error(sd, r.unit),
        probes.probe_health(client, r),
        probes.probe_metrics(client, r),
        probes.probe_models(client, r),
    )
    return ReplicaObservation(
        name=r.name, at=at, unit=unit, unit_error=unit_error, health=health, metrics_probe=mprobe,
        metrics=sample, models_probe=models_probe, models=models, port_owner=owner, canary=canary,
        restart_outcome=outcome,
    )


async def observe_all(
    cfg: Config, sd: Systemd, client: httpx.AsyncClient, at: float,
    canaries: dict[str, CanaryResult], outcomes: dict[str, RestartOutcome], port_cache: PortOwnerCache,
) -> dict[str, ReplicaObservation]:
    owners = await port_cache.get(sd, {r.port for r in cfg.replicas})
    results = await asyncio.gather(*(
        observe_replica(sd, client, r, at, owners.get(r.port), canaries.pop(r.name, None), outcomes.pop(r.name, None))
        for r in cfg.replicas
    ))
    return {o.name: o for o in results}
