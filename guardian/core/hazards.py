"""Hazards: set-ups that make a restart, or the ops layer, hurt a replica. Pure.

Reported by ``guardian check``, at daemon start, and whenever systemd reloads or unit files change.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..config import Config
from .observations import UnitInfo

CRASH_SAFE_RESTART = frozenset({"always"})


@dataclass(frozen=True)
class Hazard:
    key: str  # stable, for logging each hazard once
    message: str
    replica: str | None = None
    unit: str | None = None


def find_hazards(
    cfg: Config,
    units: Mapping[str, UnitInfo | None],
    enabled_conflicts: Mapping[str, tuple[str, ...]],
) -> list[Hazard]:
    out: list[Hazard] = []
    by_port: dict[int, list[str]] = defaultdict(list)
    for r in cfg.replicas:
        by_port[r.port].append(r.name)
    for port, names in sorted(by_port.items()):
        if len(names) > 1:
            out.append(
                Hazard(
                    f"port:{port}",
                    f"replicas {', '.join(names)} are configured on the same port {port}: "
                    "guardian cannot tell them apart; give each replica its own URL",
                )
            )
    replica_units = {r.unit: r for r in cfg.replicas}
    for r in cfg.replicas:
        u = units.get(r.unit)
        if u is None:
            continue
        if not u.exists:
            out.append(
                Hazard(
                    f"missing:{r.unit}",
                    f"replica {r.name}: unit {r.unit} does not exist "
                    "(check replicas[].unit, or install the unit file and run systemctl daemon-reload)",
                    r.name,
                    r.unit,
                )
            )
            continue
        if u.masked:
            out.append(
                Hazard(
                    f"masked:{r.unit}",
                    f"replica {r.name}: unit {r.unit} is masked: guardian will not restart it",
                    r.name,
                    r.unit,
                )
            )
        elif not u.unit_file_state.enabled:
            out.append(
                Hazard(
                    f"disabled:{r.unit}",
                    f"replica {r.name}: unit {r.unit} is {u.unit_file_state}: "
                    f"guardian will not restart it (systemctl enable {r.unit} if it should)",
                    r.name,
                    r.unit,
                )
            )
        if u.restart not in CRASH_SAFE_RESTART:
            out.append(
                Hazard(
                    f"restart:{r.unit}",
                    f"replica {r.name}: {r.unit} has Restart={u.restart or 'no'}: vLLM's API server "
                    "exits with status 0 when its engine dies, which only Restart=always restarts; "
                    f"add Restart=always to {r.unit} (systemctl stop is still respected)",
                    r.name,
                    r.unit,
                )
            )
    seen: set[tuple[str, str]] = set()
    for other, conflicts in sorted(enabled_conflicts.items()):
        for target in conflicts:
            if target in replica_units and other != target:
                seen.add((other, target))
    for r in cfg.replicas:
        u = units.get(r.unit)
        if u is None:
            continue
        for other, _state in u.conflicts:
            if other in enabled_conflicts:
                seen.add((other, r.unit))
    for other, target in sorted(seen):
        r = replica_units[target]
        u = units.get(target)
        if u is None or not u.active_state.running:
            continue
        out.append(
            Hazard(
                f"conflict:{other}:{target}",
                f"replica {r.name}: {other} is enabled and conflicts with {target} (Conflicts=): starting it "
                f"would stop the replica. Remedy: systemctl disable --now {other}; stop alone is not enough, "
                "because an enabled unit is started again at boot and by anything that starts enabled units "
                "that are not running",
                r.name,
                target,
            )
        )
    return out


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
