"""Unit gates: what systemd and the socket table must say before guardian touches a unit. Pure.

The core checks them with the tick's observation, and the executor again with a fresh one right
before the restart call (earlyoom's "re-check right before acting"). In order; the first that
fails is the refusal (rows in RULES, ids G1-G9).
"""

from __future__ import annotations

from .observations import UnitInfo
from .rules import Refusal, Rule
from .vocab import ActiveState, Gate, HeldBy, Hidden, LoadState, PortOwner, Unreadable

RULES = (
    Rule("G1", Gate.DBUS, "systemd could not be asked about the unit (D-Bus error or bus not connected)"),
    Rule("G2", Gate.MASKED, "the unit is masked (LoadState or UnitFileState masked)"),
    Rule("G3", Gate.NOT_LOADED, "the unit does not exist or is not loaded"),
    Rule(
        "G4",
        Gate.DISABLED,
        "its unit file is not enabled, enabled-runtime, static, generated or transient "
        "(a disabled unit is retired or handled by hand)",
    ),
    Rule(
        "G5",
        Gate.INACTIVE,
        "it is not active, reloading or refreshing (guardian never starts a stopped unit; "
        "the memory guard may restart a unit that failed after its own lowering)",
    ),
    Rule("G6", Gate.JOB_PENDING, "systemd has a job pending for it"),
    Rule(
        "G7",
        Gate.PORT_OWNER,
        "a process listens on the replica's port and it is neither in this unit's cgroup nor the replica's own "
        "container (its scope, or its engine's proxy forwarding to it)",
    ),
    Rule(
        "G8",
        Gate.PORT_UNKNOWN,
        "something listens on the port, but guardian cannot tell which process "
        "(no permission), or the socket table cannot be read",
    ),
    Rule(
        "G9",
        Gate.CONFLICTS,
        "a unit in its Conflicts=/ConflictedBy= is active, activating, deactivating, "
        "reloading, refreshing or in maintenance: starting the replica would stop it",
    ),
)
_ID = {r.outcome: r.id for r in RULES}


def _refuse(gate: Gate, reason: str, remedy: str = "") -> Refusal:
    # A D-Bus error's text changes from try to try; the episode is the gate alone.
    return Refusal(gate, _ID[gate], reason, remedy, key=(gate, reason if gate is not Gate.DBUS else ""))


def unit_refusal(
    unit: UnitInfo | None, port_owner: PortOwner | None, allow_failed: bool = False, unit_error: str | None = None
) -> Refusal | None:
    """The first gate that refuses, or None. ALLOW_FAILED lets the memory guard restart a unit
    that failed to start after guardian's own lowering restart (its start, not the operator's stop)."""
    if unit is None:
        return _refuse(
            Gate.DBUS,
            f"systemd could not be asked about the unit ({unit_error or 'D-Bus error'})",
            "guardian acts again once the system bus answers",
        )
    n = unit.name
    if unit.masked:
        return _refuse(Gate.MASKED, f"{n} is masked", f"systemctl unmask {n} if it should run again")
    if not unit.exists or unit.load_state is not LoadState.LOADED:
        return _refuse(
            Gate.NOT_LOADED,
            f"{n} is not loaded (load state {unit.load_state})",
            f"check replicas[].unit in the config and the unit file (systemctl status {n})",
        )
    if not unit.unit_file_state.enabled:
        return _refuse(
            Gate.DISABLED,
            f"{n} is {unit.unit_file_state}: a disabled unit is retired or handled by hand",
            f"systemctl enable {n} if guardian should look after it",
        )
    if not (
        unit.active_state.running
        or unit.active_state is ActiveState.ACTIVATING
        or (allow_failed and unit.active_state is ActiveState.FAILED)
    ):
        return _refuse(
            Gate.INACTIVE,
            f"{n} is {unit.active_state}: guardian never starts a stopped unit",
            f"systemctl start {n} when it should serve",
        )
    if unit.job_pending:
        return _refuse(Gate.JOB_PENDING, f"{n} already has a systemd job pending", "wait for it to finish")
    if isinstance(port_owner, HeldBy) and port_owner.unit != n and not port_owner.own_container:
        holder = port_owner.holder_text()
        pid = f" (pid {port_owner.pid})" if port_owner.pid is not None else ""
        return _refuse(
            Gate.PORT_OWNER,
            f"port {port_owner.port} is held by {holder}{pid}, not by {n}: restarting {n} would not help",
            f"fix replicas[].url or stop whatever else listens on {port_owner.port}",
        )
    if isinstance(port_owner, Hidden):
        return _refuse(
            Gate.PORT_UNKNOWN,
            f"cannot tell who listens on port {port_owner.port} (the socket's cgroup names no unit "
            "and its process is not guardian's to read in /proc)",
            "check that the kernel is 5.7 or newer with cgroup v2, or run guardian with CAP_SYS_PTRACE "
            "and CAP_DAC_READ_SEARCH",
        )
    if isinstance(port_owner, Unreadable):
        return _refuse(
            Gate.PORT_UNKNOWN,
            f"cannot read the kernel's socket table to see who holds port {port_owner.port}",
            "check that guardian may open netlink sockets or read /proc/net/tcp",
        )
    hurt = [f"{c} ({state})" for c, state in unit.conflicts if not state.down]
    if hurt:
        return _refuse(
            Gate.CONFLICTS,
            f"restarting {n} would stop {', '.join(hurt)} (Conflicts=)",
            "remove the conflict or stop that unit first if it is retired (systemctl disable --now)",
        )
    return None
