"""Unit gates: what systemd and the socket table must say before guardian touches a unit. Pure.

The core checks them with the tick's observation, and the executor again with a fresh one right
before the restart call (earlyoom's "re-check right before acting"). In order; the first that
fails is the refusal: the rows of ROWS below (ids G1-G9), each its table row, the predicate that
says when it refuses and what it says then, over one _UnitView; RULES (their rules) is rendered
into docs/rules.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from .actions import LogLine
from .observations import UnitInfo
from .rules import Refusal, Row, Rule, Why, first_match
from .vocab import ActiveState, Decision, Gate, HeldBy, Hidden, LoadState, PortOwner, Priority, Unreadable


@dataclass(frozen=True)
class _UnitView:
    """What the gates read: the unit as systemd reported it, and who holds the replica's port."""

    reported: UnitInfo | None  # None: systemd could not be asked
    port_owner: PortOwner | None
    allow_failed: bool
    unit_error: str | None

    @property
    def unit(self) -> UnitInfo:
        """The unit; the rows that read it come after the one for an unreachable systemd."""
        assert self.reported is not None, "a row read the unit before the row for an unreachable systemd"
        return self.reported

    @property
    def port_held_by_another(self) -> HeldBy | None:
        """Whoever holds the port, when it is neither this unit nor the replica's own container."""
        owner = self.port_owner
        if isinstance(owner, HeldBy) and owner.unit != self.unit.name and not owner.own_container:
            return owner
        return None

    @property
    def conflicts_hurt(self) -> list[str]:
        """The units in Conflicts=/ConflictedBy= that are not down, as "unit (state)"."""
        return [f"{other} ({state})" for other, state in self.unit.conflicts if not state.down]


def _dbus(view: _UnitView) -> Why:
    return Why(
        f"systemd could not be asked about the unit ({view.unit_error or 'D-Bus error'})",
        "guardian acts again once the system bus answers",
    )


def _inactive(view: _UnitView) -> bool:
    state = view.unit.active_state
    return not (state.running or state is ActiveState.ACTIVATING or (view.allow_failed and state is ActiveState.FAILED))


def _port_owner(view: _UnitView) -> Why:
    holder, name = view.port_held_by_another, view.unit.name
    assert holder is not None, "said only when another process holds the port"
    pid = f" (pid {holder.pid})" if holder.pid is not None else ""
    return Why(
        f"port {holder.port} is held by {holder.holder_text()}{pid}, not by {name}: restarting {name} would not help",
        f"fix replicas[].url or stop whatever else listens on {holder.port}",
    )


def _port_unknown(view: _UnitView) -> Why:
    owner = view.port_owner
    if isinstance(owner, Unreadable):
        return Why(
            f"cannot read the kernel's socket table to see who holds port {owner.port}",
            "check that guardian may open netlink sockets or read /proc/net/tcp",
        )
    assert isinstance(owner, Hidden), "said only when the port's holder is hidden or unreadable"
    return Why(
        f"cannot tell who listens on port {owner.port} (the socket's cgroup names no unit "
        "and its process is not guardian's to read in /proc)",
        "check that the kernel is 5.7 or newer with cgroup v2, or run guardian with CAP_SYS_PTRACE "
        "and CAP_DAC_READ_SEARCH",
    )


ROWS: tuple[Row[_UnitView, Why], ...] = (
    Row(
        NO_BUS := Rule("G1", Gate.DBUS, "systemd could not be asked about the unit (D-Bus error or bus not connected)"),
        lambda v: v.reported is None,
        _dbus,
    ),
    Row(
        Rule("G2", Gate.MASKED, "the unit is masked (LoadState or UnitFileState masked)"),
        lambda v: v.unit.masked,
        lambda v: Why(f"{v.unit.name} is masked", f"systemctl unmask {v.unit.name} if it should run again"),
    ),
    Row(
        Rule("G3", Gate.NOT_LOADED, "the unit does not exist or is not loaded"),
        lambda v: not v.unit.exists or v.unit.load_state is not LoadState.LOADED,
        lambda v: Why(
            f"{v.unit.name} is not loaded (load state {v.unit.load_state})",
            f"check replicas[].unit in the config and the unit file (systemctl status {v.unit.name})",
        ),
    ),
    Row(
        NOT_KEPT := Rule(
            "G4",
            Gate.DISABLED,
            "its unit file is not enabled, enabled-runtime, static, generated or transient "
            "(a disabled unit is retired or handled by hand)",
        ),
        lambda v: not v.unit.unit_file_state.enabled,
        lambda v: Why(
            f"{v.unit.name} is {v.unit.unit_file_state}: a disabled unit is retired or handled by hand",
            f"systemctl enable {v.unit.name} if guardian should look after it",
        ),
    ),
    Row(
        Rule(
            "G5",
            Gate.INACTIVE,
            "it is not active, reloading, refreshing or activating (so inactive, failed, deactivating, in "
            "maintenance, or in a state this guardian does not know): guardian never starts a stopped unit; the "
            "memory guard may restart a unit that failed after its own lowering",
        ),
        _inactive,
        lambda v: Why(
            f"{v.unit.name} is {v.unit.active_state}: guardian never starts a stopped unit",
            f"systemctl start {v.unit.name} when it should serve",
        ),
    ),
    Row(
        JOB_PENDING := Rule("G6", Gate.JOB_PENDING, "systemd has a job pending for it"),
        lambda v: v.unit.job_pending,
        lambda v: Why(f"{v.unit.name} already has a systemd job pending", "wait for it to finish"),
    ),
    Row(
        Rule(
            "G7",
            Gate.PORT_OWNER,
            "a process listens on the replica's port, at the address its URL reaches, and it is neither in this "
            "unit's cgroup nor the replica's own container (its scope, or its engine's proxy forwarding to it)",
        ),
        lambda v: v.port_held_by_another is not None,
        _port_owner,
    ),
    Row(
        Rule(
            "G8",
            Gate.PORT_UNKNOWN,
            "something listens on the port, but guardian cannot tell which process "
            "(no permission), or the socket table cannot be read",
        ),
        lambda v: isinstance(v.port_owner, Hidden | Unreadable),
        _port_unknown,
    ),
    Row(
        Rule(
            "G9",
            Gate.CONFLICTS,
            "a unit in its Conflicts=/ConflictedBy= is active, activating, deactivating, "
            "reloading, refreshing or in maintenance: starting the replica would stop it",
        ),
        lambda v: bool(v.conflicts_hurt),
        lambda v: Why(
            f"restarting {v.unit.name} would stop {', '.join(v.conflicts_hurt)} (Conflicts=)",
            "remove the conflict or stop that unit first if it is retired (systemctl disable --now)",
        ),
    ),
)
RULES = tuple(row.rule for row in ROWS)


def unit_refusal(
    unit: UnitInfo | None, port_owner: PortOwner | None, allow_failed: bool = False, unit_error: str | None = None
) -> Refusal | None:
    """The first gate that refuses, or None. ALLOW_FAILED lets the memory guard restart a unit
    that failed to start after guardian's own lowering restart (its start, not the operator's stop)."""
    found = first_match(ROWS, _UnitView(unit, port_owner, allow_failed, unit_error))
    if found is None:
        return None
    rule, why = found
    gate = Gate(rule.outcome)
    # A D-Bus error's text changes from try to try; the episode is the gate alone.
    episode = why.reason if gate is not Gate.DBUS else ""
    return Refusal(gate, rule.id, why.reason, why.remedy, key=(gate, episode))


def refused_on_recheck(replica: str, unit: str, refusal: Refusal, why: str) -> LogLine:
    """The line of a restart the gates refused on the executor's look right before acting (the
    world changed since the tick that ordered it, for WHY)."""
    return LogLine(
        Priority.ERROR,
        f"replica {replica}: restart of {unit} refused on the re-check right before acting: {refusal.text} "
        f"(it was for {why})",
        Decision.REFUSED,
        replica,
        unit,
        gate=refusal.gate,
        rule=refusal.rule,
    )
