"""Conditions said when they begin (and when they end), never every tick: the kernel's view of
the replicas' connections lost and back, and each hazard a scan finds. (The system bus lost and
back, and the watchdog no longer pinged, are said by act/notify.Watchdog.)"""

from __future__ import annotations

from collections.abc import Mapping

from ..config import Config
from ..core import weights
from ..core.actions import LogLine
from ..core.hazards import Hazard, find_hazards
from ..core.observations import FleetView
from ..core.outside import outside_hazards
from ..core.vocab import Decision, Priority
from ..core.weights import Weights
from ..engines.resolve import Told
from ..observe.addresses import Pin
from ..observe.replicas import UnitScan
from .journal import Journal


class Notices:
    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.hazards_said: dict[str, Hazard] = {}  # the hazards found by the last scan, by key
        self.engines_said: dict[str, str] = {}  # each replica's engine line, as last said
        self.kernel_view_said: str | None = None  # why the kernel's view was last said to be missing
        self.weights_seen: dict[str, Weights | None] = {}  # each replica's fingerprint, as last read
        self.weights_said: dict[str, Hazard] = {}  # the weights hazards said (W1, W3), by key
        self.partial_said: frozenset[str] = frozenset()  # replicas whose kernel view was last partial
        self.split_said: dict[str, str] = {}  # replica -> the split of its URL's host, as last said

    def kernel_view(self, why_unavailable: str | None) -> None:
        """Once when the kernel's view of the replicas' connections is lost, once when it is back."""
        if why_unavailable == self.kernel_view_said:
            return
        if why_unavailable is not None:
            self.journal.send(
                Priority.WARNING,
                f"the kernel's view of the replicas' connections is not available: {why_unavailable}; responses "
                "flowing and clients waiting are not seen, so replicas are judged from their probes alone",
            )
        else:
            self.journal.send(Priority.INFO, "the kernel's view of the replicas' connections is available again")
        self.kernel_view_said = why_unavailable

    def partial_views(self, cfg: Config, partial: frozenset[str]) -> None:
        """Once when a replica's kernel view becomes partial (more of its own sockets than one look
        reads: evidence of nothing), once when it is whole again."""
        for name in sorted(partial ^ self.partial_said):
            r = cfg.replica(name)
            unit = r.unit if r is not None else None
            if name in partial:
                text = (
                    f"replica {name}: the kernel's view of its connections is partial (more of its own sockets "
                    "than one look reads): it is evidence of nothing, flowing or not, until it is whole again"
                )
                self.journal.line(LogLine(Priority.WARNING, text, Decision.NOTE, name, unit))
            else:
                text = f"replica {name}: the kernel's view of its connections is whole again"
                self.journal.line(LogLine(Priority.INFO, text, Decision.NOTE, name, unit))
        self.partial_said = partial

    def addresses(self, cfg: Config, pins: Mapping[str, Pin]) -> None:
        """A replica whose URL's host leads to listeners of different holders (observe/addresses.py):
        a hazard said once when it begins, at info when it ends."""
        now = {r.name: pins[r.name].split_text(r.unit) for r in cfg.replicas if r.name in pins and pins[r.name].split}
        for r in cfg.replicas:
            text, was = now.get(r.name), self.split_said.get(r.name)
            if text is not None and was is None:
                message = f"hazard: replica {r.name}: {text}"
                self.journal.line(
                    LogLine(Priority.ERROR, message, Decision.HAZARD, r.name, r.unit, hazard=f"address:{r.name}")
                )
            elif text is None and was is not None:
                again = f"replica {r.name}: its URL's host leads to one holder again"
                self.journal.line(
                    LogLine(Priority.INFO, again, Decision.NOTE, r.name, r.unit, hazard=f"address:{r.name}")
                )
        self.split_said = now

    def engines(self, cfg: Config, told: Mapping[str, Told]) -> None:
        """Each replica's engine and how it was told (engines/resolve.py): said at start, and when a
        scan tells another (its unit was edited to start another engine)."""
        for r in cfg.replicas:
            t = told.get(r.name)
            if t is None:
                continue
            text = f"replica {r.name}: engine {t.engine.label} ({t.how})"
            if self.engines_said.get(r.name) != text:
                self.engines_said[r.name] = text
                self.journal.line(LogLine(Priority.INFO, text, Decision.NOTE, r.name, r.unit))

    def hazards(self, cfg: Config, seen: UnitScan) -> list[Hazard]:
        """The hazards in what a scan SEEN (core/hazards.py), each said once, when a scan first
        finds it, again if it comes back after a scan without it; and those found."""
        if seen.enabled_error is not None:
            self.journal.send(
                Priority.ERROR, f"cannot list enabled unit files for the Conflicts= scan: {seen.enabled_error}"
            )
        found = find_hazards(cfg, seen.units, seen.enabled_conflicts)
        found += outside_hazards(cfg, seen.declared, seen.logind)
        for h in found:
            if h.key not in self.hazards_said:
                self.journal.line(
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
        for key, gone in self.hazards_said.items():  # one that says when it ends (Hazard.over) says so once
            if key not in keys and gone.over:
                self.journal.line(
                    LogLine(
                        Priority.INFO, gone.over, Decision.NOTE, gone.replica, gone.unit, rule=gone.rule, hazard=key
                    )
                )
        self.hazards_said = {h.key: h for h in found}
        return found

    def weights(
        self, cfg: Config, found: dict[str, Weights | None], fleet: FleetView | None = None
    ) -> tuple[list[Hazard], list[str]]:
        """W1 and W3 said once while they last (and when they end), W2 at each change; the hazards
        now, and the replicas whose weights changed."""
        moved = weights.changed(self.weights_seen, found)
        for name, was, now in moved:
            r = cfg.replica(name)
            self.journal.line(
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
        self.weights_seen = dict(found)
        hazards = weights.differing(cfg, found)
        if fleet is not None and fleet.ok:
            hazards += weights.differing_in_fleet(cfg, found, fleet.members, fleet.box)
        for h in hazards:
            if h.key not in self.weights_said:
                self.journal.line(
                    LogLine(Priority.ERROR, f"hazard: {h.message}", Decision.HAZARD, hazard=h.key, rule=h.rule)
                )
        now_keys = {h.key for h in hazards}
        for key, gone in self.weights_said.items():
            if key not in now_keys:
                self.journal.send(Priority.INFO, gone.over)
        self.weights_said = {h.key: h for h in hazards}
        return hazards, [name for name, _, _ in moved]
