"""What guardian does to systemd units: restart a replica's unit, kill its processes, run a job
(a proxy's reload, the drop-caches helper). Every change guardian makes to a unit goes through here,
over the bus connection that observe/systemd.py keeps (and its one job primitive, Systemd.run_job);
the container helper, which restarts or kills a container (and inspects them for the observer), is
started by Systemd.run_helper, its one road.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from ..observe.systemd import MANAGER, Systemd


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
