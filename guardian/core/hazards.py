"""Hazards: set-ups that make a restart, or the ops layer, hurt a replica. Pure.

Reported by ``guardian check``, at daemon start, and whenever systemd reloads or unit files change.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..config import Config, ReplicaConfig
from .observations import UnitInfo

CRASH_SAFE_RESTART = frozenset({"always"})


@dataclass(frozen=True)
class Hazard:
    key: str  # stable, for logging each hazard once
    message: str
    replica: str | None = None
    unit: str | None = None
    rule: str | None = None  # the rule that found it, where one does (core/weights.py W1, W3)
    over: str = ""  # what is said when it ends ("" : nothing)


def find_hazards(
    cfg: Config,
    units: Mapping[str, UnitInfo | None],
    enabled_conflicts: Mapping[str, tuple[str, ...]],
) -> list[Hazard]:
    """Every hazard of this set-up: replicas sharing a port, each replica's unit, and enabled
    units that conflict with a running replica. UNITS: each replica's unit as systemd reported it
    (None: not asked); ENABLED_CONFLICTS: enabled units -> the units they conflict with."""
    found = _shared_ports(cfg)
    for replica in cfg.replicas:
        unit = units.get(replica.unit)
        if unit is not None:
            found += _unit_hazards(replica, unit)
    return found + _conflicts(cfg, units, enabled_conflicts)


def _shared_ports(cfg: Config) -> list[Hazard]:
    by_port: dict[int, list[str]] = defaultdict(list)
    for replica in cfg.replicas:
        by_port[replica.port].append(replica.name)
    return [
        Hazard(
            f"port:{port}",
            f"replicas {', '.join(names)} are configured on the same port {port}: "
            "guardian cannot tell them apart; give each replica its own URL",
        )
        for port, names in sorted(by_port.items())
        if len(names) > 1
    ]


def _unit_hazards(replica: ReplicaConfig, unit: UnitInfo) -> list[Hazard]:
    """What in REPLICA's unit keeps guardian from restarting it, or systemd from bringing it back."""
    name, unit_name = replica.name, replica.unit
    if not unit.exists:
        return [
            Hazard(
                f"missing:{unit_name}",
                f"replica {name}: unit {unit_name} does not exist "
                "(check replicas[].unit, or install the unit file and run systemctl daemon-reload)",
                name,
                unit_name,
            )
        ]
    found: list[Hazard] = []
    if unit.masked:
        found.append(
            Hazard(
                f"masked:{unit_name}",
                f"replica {name}: unit {unit_name} is masked: guardian will not restart it",
                name,
                unit_name,
            )
        )
    elif not unit.unit_file_state.enabled:
        found.append(
            Hazard(
                f"disabled:{unit_name}",
                f"replica {name}: unit {unit_name} is {unit.unit_file_state}: "
                f"guardian will not restart it (systemctl enable {unit_name} if it should)",
                name,
                unit_name,
            )
        )
    if unit.restart not in CRASH_SAFE_RESTART:
        found.append(
            Hazard(
                f"restart:{unit_name}",
                f"replica {name}: {unit_name} has Restart={unit.restart or 'no'}: a server may exit by "
                "itself, with status 0 too (vLLM's API server when its engine dies), which only Restart=always "
                "restarts, and guardian never starts a stopped unit; "
                f"add Restart=always to {unit_name} (systemctl stop is still respected)",
                name,
                unit_name,
            )
        )
    return found


def _conflicts(
    cfg: Config, units: Mapping[str, UnitInfo | None], enabled_conflicts: Mapping[str, tuple[str, ...]]
) -> list[Hazard]:
    """Enabled units that conflict with a running replica's unit, as either side declares it."""
    replica_units = {replica.unit: replica for replica in cfg.replicas}
    pairs: set[tuple[str, str]] = set()  # (the enabled unit, the replica's unit)
    for other, conflicts in sorted(enabled_conflicts.items()):
        for target in conflicts:
            if target in replica_units and other != target:
                pairs.add((other, target))
    for replica in cfg.replicas:
        unit = units.get(replica.unit)
        if unit is None:
            continue
        for other, _state in unit.conflicts:
            if other in enabled_conflicts:
                pairs.add((other, replica.unit))
    found: list[Hazard] = []
    for other, target in sorted(pairs):
        name = replica_units[target].name
        unit = units.get(target)
        if unit is None or not unit.active_state.running:
            continue
        found.append(
            Hazard(
                f"conflict:{other}:{target}",
                f"replica {name}: {other} is enabled and conflicts with {target} (Conflicts=): starting it "
                f"would stop the replica. Remedy: systemctl disable --now {other}; stop alone is not enough, "
                "because an enabled unit is started again at boot and by anything that starts enabled units "
                "that are not running",
                name,
                target,
            )
        )
    return found


PROXY_READS = 4  # reads of a replica's /metrics by `guardian check`; a proxy spreads them


def proxy_suspect(name: str, url: str, starts: Sequence[float | None]) -> str | None:
    """A warning when one URL's /metrics came from more than one process (its
    process_start_time_seconds changed between reads): the URL is a proxy's or a load balancer's,
    whose counters come from whichever replica answered. None when one process answered."""
    seen = sorted({s for s in starts if s is not None})
    if len(seen) < 2:
        return None
    return (
        f"replica {name}: {url} answered from {len(seen)} different processes in {len(starts)} reads of /metrics "
        f"(process_start_time_seconds {', '.join(f'{s:.0f}' for s in seen)}): it looks like a proxy's URL. "
        "guardian must probe each replica directly: give this replica's own address and port"
    )
