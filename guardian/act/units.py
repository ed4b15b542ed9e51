"""What guardian does to systemd units: restart a replica's unit, kill its processes, run a job
(a proxy's reload, the drop-caches helper), and ask the container helper to restart or kill a
container. Every change guardian makes to a unit goes through here, over the bus connection that
observe/systemd.py keeps (and its one job primitive, Systemd.run_job).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from ..core.container import helper_unit
from ..observe.systemd import MANAGER, Systemd, SystemdError


async def restart(
    sd: Systemd,
    name: str,
    timeout_s: float,
    start_if_stopped: bool = False,
    kill: Callable[[], Awaitable[None]] | None = None,
) -> str:
    """TryRestartUnit(name, "replace"), and wait for the job's JobRemoved result. A try-restart
    does nothing to a unit that is not running, so an operator's stop between guardian's last
    look and this call always wins. START_IF_STOPPED (RestartUnit) is for the memory guard's
    retry of a start that failed after its own lowering. KILL runs once the job has begun (see
    Systemd.run_job): only then does systemd's own Restart= stand down for this stop."""
    member = "RestartUnit" if start_if_stopped else "TryRestartUnit"
    return await sd.run_job(member, name, timeout_s, during=kill)


async def run_job(sd: Systemd, member: str, name: str, timeout_s: float) -> str:
    """MEMBER (StartUnit, ReloadUnit, ...) of NAME, and the job's result (Systemd.run_job)."""
    return await sd.run_job(member, name, timeout_s)


async def kill(sd: Systemd, name: str, signal: int = 9) -> None:
    """KillUnit(name, "all", SIGNAL): every process of the unit (polkit verb "kill")."""
    await sd.call(MANAGER, "KillUnit", "ssi", [name, "all", signal])


async def run_helper(sd: Systemd, verb: str, replica: str, timeout_s: float) -> str:
    """Start guardian-container@VERB:REPLICA.service (restart, kill) and wait for its result ("done"
    or why not)."""
    try:
        return await sd.run_job("StartUnit", helper_unit(verb, replica), timeout_s)
    except SystemdError as e:
        return f"error: {e}"
