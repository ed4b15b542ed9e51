"""Observers: turn systemd, /proc and each replica's HTTP endpoints into immutable values.

Every call is bounded; a hung replica or a slow bus yields an observation that says so.
"""

from __future__ import annotations

import asyncio

import httpx

from . import probes
from .config import Config, ReplicaConfig
from .observations import CanaryResult, PortOwner, ReplicaObservation, RestartOutcome, UnitInfo
from .proc import listeners
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
    canaries: dict[str, CanaryResult], outcomes: dict[str, RestartOutcome],
) -> dict[str, ReplicaObservation]:
    owners = await port_owners(sd, {r.port for r in cfg.replicas})
    results = await asyncio.gather(*(
        observe_replica(sd, client, r, at, owners.get(r.port), canaries.pop(r.name, None), outcomes.pop(r.name, None))
        for r in cfg.replicas
    ))
    return {o.name: o for o in results}
