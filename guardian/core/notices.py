"""Conditions said when they begin (and when they end), never every tick: the kernel's view of the
replicas' connections lost and back, a partial view, a URL's host split between holders, each
replica's engine, each hazard a scan finds, and the weights (W1-W3).

Each is a transition: what was said before (`Said`, immutable) and what is found now give what is
said now and the lines to write. The shell holds the `Said` and writes the lines (act/notices.py);
nothing here reads the clock or the world. The system bus lost and back, and the watchdog no
longer pinged, are said by act/notify.Watchdog (they are the shell's own health).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TypeVar

from ..config import Config
from . import weights
from .actions import LogLine
from .hazards import Hazard, find_hazards
from .observations import FleetView, LogindConf, UnitDeclared, UnitInfo
from .outside import outside_hazards
from .vocab import Decision, Priority
from .weights import Weights

V = TypeVar("V")


def _frozen(items: Mapping[str, V]) -> Mapping[str, V]:
    return MappingProxyType(dict(items))


@dataclass(frozen=True)
class Said:
    """What was last said of each condition."""

    hazards: Mapping[str, Hazard] = field(default_factory=lambda: _frozen({}))  # by key, as the last scan found them
    engines: Mapping[str, str] = field(default_factory=lambda: _frozen({}))  # each replica's engine line
    kernel_view: str | None = None  # why the kernel's view was last said to be missing (None: it is there)
    weights_seen: Mapping[str, Weights | None] = field(default_factory=lambda: _frozen({}))  # as last read
    weights: Mapping[str, Hazard] = field(default_factory=lambda: _frozen({}))  # W1, W3 said, by key
    partial: frozenset[str] = frozenset()  # replicas whose kernel view was last partial
    split: Mapping[str, str] = field(default_factory=lambda: _frozen({}))  # replica -> its URL host's split


SaidLines = tuple[Said, list[LogLine]]


def kernel_view(said: Said, why_unavailable: str | None) -> SaidLines:
    """Once when the kernel's view of the replicas' connections is lost, once when it is back."""
    if why_unavailable == said.kernel_view:
        return said, []
    if why_unavailable is not None:
        line = LogLine(
            Priority.WARNING,
            f"the kernel's view of the replicas' connections is not available: {why_unavailable}; responses "
            "flowing and clients waiting are not seen, so replicas are judged from their probes alone",
            Decision.NOTE,
        )
    else:
        line = LogLine(
            Priority.INFO, "the kernel's view of the replicas' connections is available again", Decision.NOTE
        )
    return replace(said, kernel_view=why_unavailable), [line]


def partial_views(said: Said, cfg: Config, partial: frozenset[str]) -> SaidLines:
    """Once when a replica's kernel view becomes partial (more of its own sockets than one look
    reads: evidence of nothing), once when it is whole again."""
    lines = []
    for name in sorted(partial ^ said.partial):
        r = cfg.replica(name)
        unit = r.unit if r is not None else None
        if name in partial:
            text = (
                f"replica {name}: the kernel's view of its connections is partial (more of its own sockets "
                "than one look reads): it is evidence of nothing, flowing or not, until it is whole again"
            )
            lines.append(LogLine(Priority.WARNING, text, Decision.NOTE, name, unit))
        else:
            text = f"replica {name}: the kernel's view of its connections is whole again"
            lines.append(LogLine(Priority.INFO, text, Decision.NOTE, name, unit))
    return replace(said, partial=partial), lines


def addresses(said: Said, cfg: Config, splits: Mapping[str, str]) -> SaidLines:
    """A replica whose URL's host leads to listeners of different holders (SPLITS: replica -> the
    split in words, observe/addresses.py): a hazard said once when it begins, at info when it ends."""
    now = {r.name: splits[r.name] for r in cfg.replicas if r.name in splits}
    lines = []
    for r in cfg.replicas:
        text, was = now.get(r.name), said.split.get(r.name)
        if text is not None and was is None:
            message = f"hazard: replica {r.name}: {text}"
            lines.append(LogLine(Priority.ERROR, message, Decision.HAZARD, r.name, r.unit, hazard=f"address:{r.name}"))
        elif text is None and was is not None:
            again = f"replica {r.name}: its URL's host leads to one holder again"
            lines.append(LogLine(Priority.INFO, again, Decision.NOTE, r.name, r.unit, hazard=f"address:{r.name}"))
    return replace(said, split=_frozen(now)), lines


def engines(said: Said, cfg: Config, told: Mapping[str, str]) -> SaidLines:
    """Each replica's engine and how it was told (TOLD: replica -> "LABEL (HOW)", engines/resolve.py):
    said at start, and when a scan tells another (its unit was edited to start another engine)."""
    now = dict(said.engines)
    lines = []
    for r in cfg.replicas:
        t = told.get(r.name)
        if t is None:
            continue
        text = f"replica {r.name}: engine {t}"
        if now.get(r.name) != text:
            now[r.name] = text
            lines.append(LogLine(Priority.INFO, text, Decision.NOTE, r.name, r.unit))
    return replace(said, engines=_frozen(now)), lines


def hazards(said: Said, cfg: Config, scan: Scan) -> tuple[Said, list[LogLine], list[Hazard]]:
    """The hazards in what a scan saw (core/hazards.py, core/outside.py), said by said_hazards;
    returns the hazards found too."""
    found = find_hazards(cfg, scan.units, scan.enabled_conflicts)
    found += outside_hazards(cfg, scan.declared, scan.logind)
    after, lines = said_hazards(said, found, scan.enabled_error)
    return after, lines, found


def said_hazards(said: Said, found: list[Hazard], enabled_error: str | None) -> SaidLines:
    """Each hazard FOUND said once, when a scan first finds it, again if it comes back after a scan
    without it; one that says when it ends (Hazard.over) says so once. ENABLED_ERROR: why the
    enabled unit files could not be listed (the Conflicts= scan is partial then)."""
    lines = []
    if enabled_error is not None:
        lines.append(
            LogLine(
                Priority.ERROR,
                f"cannot list enabled unit files for the Conflicts= scan: {enabled_error}",
                Decision.NOTE,
            )
        )
    for h in found:
        if h.key not in said.hazards:
            lines.append(
                LogLine(
                    Priority.ERROR,
                    f"hazard: {h.message}",
                    Decision.HAZARD,
                    h.replica,
                    h.unit,
                    rule=h.rule,
                    hazard=h.key,
                )
            )
    keys = {h.key for h in found}
    for key, gone in said.hazards.items():
        if key not in keys and gone.over:
            lines.append(
                LogLine(Priority.INFO, gone.over, Decision.NOTE, gone.replica, gone.unit, rule=gone.rule, hazard=key)
            )
    return replace(said, hazards=_frozen({h.key: h for h in found})), lines


@dataclass(frozen=True)
class Scan:
    """What a scan of the units saw, as the hazards read it (observe/replicas.py UnitScan)."""

    units: Mapping[str, UnitInfo | None]
    enabled_conflicts: Mapping[str, tuple[str, ...]]
    enabled_error: str | None
    declared: Mapping[str, UnitDeclared | None]
    logind: LogindConf | None


@dataclass(frozen=True)
class WeightsSaid:
    """What the weights' transition found: the hazards that stand (W1, W3) and the replicas whose
    weights changed (W2), beside what is said and written."""

    said: Said
    lines: list[LogLine]
    hazards: list[Hazard]
    moved: list[str]


def weights_read(
    said: Said, cfg: Config, found: Mapping[str, Weights | None], fleet: FleetView | None = None
) -> WeightsSaid:
    """W2 said at each change; W1 (FOUND's replicas here) and W3 (against FLEET's other boxes, while
    the fleet's view is whole) said once while they last, and when they end."""
    lines = []
    moved = weights.changed(said.weights_seen, found)
    for name, was, now in moved:
        r = cfg.replica(name)
        lines.append(
            LogLine(
                Priority.INFO,
                f"replica {name}: its weights changed: {was.digest} -> {now.digest} ({now.what}): a model "
                "update; what the memory guard learned of the old weights is dropped",
                Decision.NOTE,
                name,
                r.unit if r is not None else None,
                rule=weights.CHANGED.id,
            )
        )
    standing = weights.differing(cfg, found)
    if fleet is not None and fleet.ok:
        standing += weights.differing_in_fleet(cfg, found, fleet.members, fleet.box)
    for h in standing:
        if h.key not in said.weights:
            lines.append(LogLine(Priority.ERROR, f"hazard: {h.message}", Decision.HAZARD, hazard=h.key, rule=h.rule))
    keys = {h.key for h in standing}
    for key, gone in said.weights.items():
        if key not in keys:
            lines.append(LogLine(Priority.INFO, gone.over, Decision.NOTE))
    after = replace(said, weights_seen=_frozen(found), weights=_frozen({h.key: h for h in standing}))
    return WeightsSaid(after, lines, standing, [name for name, _, _ in moved])
