"""Restart gates that depend on what systemd and /proc say about a replica's unit.

Pure: the policy calls this with the tick's observation, and the executor calls it again with
a fresh one right before RestartUnit (earlyoom's "re-check right before acting").

Gates, in order; the first that fails is the refusal:

1. The unit exists and is loaded, and is not masked.
2. Its unit file is enabled (enabled, enabled-runtime), or has no [Install] section to enable
   (static, generated, transient). A disabled unit has been retired or is handled by hand.
3. It is active, activating or reloading, with no other job pending. guardian never starts an
   inactive unit: stopped is the operator's or systemd's business.
4. Whoever listens on the replica's port is in this unit's cgroup. Nobody listening is allowed
   (a replica that never bound its port is this unit's problem); a listener we cannot identify
   (no permission to read /proc) or one in another unit is refused.
5. No unit in its Conflicts=/ConflictedBy= is active, activating, reloading or deactivating:
   starting the replica again would stop it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .observations import PortOwner, UnitInfo

ENABLED_STATES = frozenset({"enabled", "enabled-runtime", "static", "generated", "transient"})
RUNNING_STATES = frozenset({"active", "activating", "reloading"})
NOT_INACTIVE = frozenset({"active", "activating", "reloading", "deactivating", "refreshing"})


@dataclass(frozen=True)
class Refusal:
    gate: str  # short key, stable for dedup and tests
    reason: str
    remedy: str = ""

    def text(self) -> str:
        return f"{self.reason}; {self.remedy}" if self.remedy else self.reason


def unit_refusal(unit: UnitInfo | None, port_owner: PortOwner | None, allow_failed: bool = False) -> Refusal | None:
    """The first gate that refuses, or None. ALLOW_FAILED lets the memory guard restart a unit
    that failed to start after guardian's own lowering restart (its start, not the operator's stop)."""
    if unit is None:
        return Refusal("dbus", "systemd could not be asked about the unit", "see the D-Bus error above")
    n = unit.name
    if unit.load_state == "masked" or unit.unit_file_state.startswith("masked"):
        return Refusal("masked", f"{n} is masked", f"systemctl unmask {n} if it should run again")
    if not unit.exists or unit.load_state != "loaded":
        return Refusal(
            "not-loaded",
            f"{n} is not loaded (load state {unit.load_state or 'unknown'})",
            "check replicas[].unit in the config and the unit file (systemctl status " + n + ")",
        )
    if unit.unit_file_state not in ENABLED_STATES:
        return Refusal(
            "disabled",
            f"{n} is {unit.unit_file_state or 'not enabled'}: a disabled unit is retired or handled by hand",
            f"systemctl enable {n} if guardian should look after it",
        )
    if unit.active_state not in RUNNING_STATES and not (allow_failed and unit.active_state == "failed"):
        return Refusal(
            "inactive",
            f"{n} is {unit.active_state}: guardian never starts a stopped unit",
            f"systemctl start {n} when it should serve",
        )
    if unit.job_pending:
        return Refusal("job-pending", f"{n} already has a systemd job pending", "wait for it to finish")
    if port_owner is not None and port_owner.pid is not None and port_owner.unit != n:
        holder = port_owner.unit or "a process guardian cannot map to a unit"
        return Refusal(
            "port-owner",
            f"port {port_owner.port} is held by {holder} (pid {port_owner.pid}), not by {n}: restarting {n} would not help",
            f"fix replicas[].url or stop whatever else listens on {port_owner.port}",
        )
    if port_owner is not None and port_owner.pid is None and port_owner.unit == "?":
        return Refusal(
            "port-unknown",
            f"cannot tell who listens on port {port_owner.port} (no permission to read /proc)",
            "run guardian with CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH",
        )
    hurt = [f"{c} ({state})" for c, state in unit.conflicts if state in NOT_INACTIVE]
    if hurt:
        return Refusal(
            "conflicts",
            f"restarting {n} would stop {', '.join(hurt)} (Conflicts=)",
            "remove the conflict or stop that unit first if it is retired (systemctl disable --now)",
        )
    return None
