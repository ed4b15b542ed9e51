"""What a replica's unit says of how its server runs (core/observations.py UnitDeclared), and the
box's logind settings: read here, judged by the core (core/stopping.py, core/outside.py)."""

from __future__ import annotations

import asyncio
import pwd

from ..config import ReplicaConfig
from ..core.observations import UnitDeclared
from . import modelfiles
from .memory import read_env_file
from .systemd import ServiceDetails, Systemd, SystemdError


def uid_of(user: str) -> int | None:
    """User='s uid on this box, as systemd resolves it (a name, or a number); root for ""; None:
    a name this box does not know (a DynamicUser= name, or a typo: systemd would not start it)."""
    if not user:
        return 0
    if user.isdigit():
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None


def declared_from(unit: str, details: ServiceDetails) -> UnitDeclared:
    """Blocking (it reads the unit's environment files and the user database): run in a thread."""
    files = tuple(read_env_file(p) for p in details.environment_files)
    env = modelfiles.unit_env(details.environment, tuple(f.text for f in files))
    stop_s = details.timeout_stop_us / 1e6 if details.timeout_stop_us is not None else None
    return UnitDeclared(
        unit,
        modelfiles.unit_argv(details.exec_start, env),
        env,
        details.user,
        uid_of(details.user),
        stop_s,
        tuple(f.path for f in files if f.error is not None),
    )


async def declared_of(sd: Systemd, r: ReplicaConfig) -> UnitDeclared:
    """How R's unit says its server runs; a container without a unit, or a unit systemd does not
    answer about, is UNSEEN (and why)."""
    if r.unitless:
        return UnitDeclared(r.unit, unseen=f"container {r.container} runs without a unit")
    try:
        details = await sd.service_details(r.unit)
    except SystemdError as e:
        return UnitDeclared(r.unit, unseen=f"systemd could not be asked about {r.unit}: {e}")
    return await asyncio.to_thread(declared_from, r.unit, details)
