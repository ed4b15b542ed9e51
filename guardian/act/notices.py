"""The said-once conditions (core/notices.py decides them) held between ticks and written: what
the observers found goes in, the lines the core chose come out to the journal."""

from __future__ import annotations

from collections.abc import Mapping

from ..config import Config
from ..core import notices
from ..core.actions import LogLine
from ..core.hazards import Hazard
from ..core.observations import FleetView
from ..core.weights import Weights
from ..engines.resolve import Told
from ..observe.addresses import Pin
from ..observe.replicas import UnitScan
from .journal import Journal


class Notices:
    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.said = notices.Said()

    def _write(self, said_lines: tuple[notices.Said, list[LogLine]]) -> None:
        self.said, lines = said_lines
        for line in lines:
            self.journal.line(line)

    def kernel_view(self, why_unavailable: str | None) -> None:
        self._write(notices.kernel_view(self.said, why_unavailable))

    def partial_views(self, cfg: Config, partial: frozenset[str]) -> None:
        self._write(notices.partial_views(self.said, cfg, partial))

    def addresses(self, cfg: Config, pins: Mapping[str, Pin]) -> None:
        splits = {
            r.name: pins[r.name].split_text(r.unit) for r in cfg.replicas if r.name in pins and pins[r.name].split
        }
        self._write(notices.addresses(self.said, cfg, splits))

    def engines(self, cfg: Config, told: Mapping[str, Told]) -> None:
        self._write(notices.engines(self.said, cfg, {name: f"{t.engine.label} ({t.how})" for name, t in told.items()}))

    def hazards(self, cfg: Config, seen: UnitScan) -> list[Hazard]:
        """The hazards a scan SEEN shows, said as the core chose (core/notices.py); those found."""
        scan = notices.Scan(seen.units, seen.enabled_conflicts, seen.enabled_error, seen.declared, seen.logind)
        said, lines, found = notices.hazards(self.said, cfg, scan)
        self._write((said, lines))
        return found

    def weights(
        self, cfg: Config, found: dict[str, Weights | None], fleet: FleetView | None = None
    ) -> tuple[list[Hazard], list[str]]:
        """The weights hazards that stand (W1, W3), and the replicas whose weights changed (W2)."""
        read = notices.weights_read(self.said, cfg, found, fleet)
        self._write((read.said, read.lines))
        return read.hazards, read.moved
