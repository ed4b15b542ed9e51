"""sd_notify messages to systemd (no-ops when NOTIFY_SOCKET is unset, as in tests and CLI), and
systemd's watchdog: pinged after each tick while guardian can see and act; when it cannot (the
system bus gone, no tick completing), no longer pinged, so that systemd restarts guardian."""

from __future__ import annotations

from collections.abc import Callable

import sdnotify

from ..config import Config
from ..core.vocab import Priority
from ..observe.systemd import SystemdEvent
from .journal import Journal


def why_not_ping(bus_lost_s: float, since_completed_s: float, cfg: Config) -> str | None:
    """Why systemd should restart guardian (it stops pinging the watchdog), or None: the system
    bus gone for BUS_LOST_S, or no tick completed for SINCE_COMPLETED_S."""
    if bus_lost_s >= cfg.bus_lost_restart_s:
        return f"the system bus has been gone for {bus_lost_s:.0f} s: guardian is blind"
    if since_completed_s >= cfg.stuck_restart_s:
        return f"no tick has completed for {since_completed_s:.0f} s (each was abandoned, see the lines before)"
    return None


class Notifier:
    def __init__(self) -> None:
        self._n = sdnotify.SystemdNotifier()

    def ready(self, status: str) -> None:
        self._n.notify(f"READY=1\nSTATUS={status}")

    def watchdog(self, status: str) -> None:
        self._n.notify(f"WATCHDOG=1\nSTATUS={status}")

    def reloading(self) -> None:
        self._n.notify("RELOADING=1")

    def reloaded(self, status: str) -> None:
        self._n.notify(f"READY=1\nSTATUS={status}")

    def stopping(self) -> None:
        self._n.notify("STOPPING=1\nSTATUS=stopping")


class Watchdog:
    def __init__(self, notifier: Notifier, journal: Journal) -> None:
        self.notifier = notifier
        self.journal = journal
        self.last_ping_mono: float | None = None
        self.unpinged_said = False  # why it is no longer pinged was said
        self.bus_events: list[SystemdEvent] = []  # not said yet

    def bus_changed(self, event: SystemdEvent) -> None:
        """From systemd's signal handler: said at the next tick (say_bus)."""
        if event in (SystemdEvent.BUS_LOST, SystemdEvent.BUS_BACK):
            self.bus_events.append(event)

    def say_bus(self, bus_lost_restart_s: float) -> None:
        """The system bus lost, or back, each event as it came."""
        events, self.bus_events = self.bus_events, []
        for event in events:
            if event is SystemdEvent.BUS_LOST:
                self.journal.send(
                    Priority.ERROR,
                    "lost the system bus: every replica is 'unknown' and nothing is "
                    "restarted until guardian reconnects (it retries with back-off); systemd's watchdog "
                    f"restarts guardian if the bus stays gone for {bus_lost_restart_s:g} s",
                )
            else:
                self.journal.send(
                    Priority.INFO,
                    "system bus back: reconnected and subscribed to systemd's signals "
                    "again; unit views are taken afresh",
                )
                self.unpinged_said = False

    def ping(self, mono: float, why_not: str | None, status: Callable[[], str]) -> float:
        """Ping at MONO with STATUS, unless WHY_NOT (why_not_ping), said once until the next ping.
        The seconds since the last ping (0.0: none before, or not pinged)."""
        if why_not is not None:
            if not self.unpinged_said:
                self.journal.send(
                    Priority.CRITICAL, f"{why_not}, so it stops pinging systemd's watchdog and systemd will restart it"
                )
                self.unpinged_said = True
            return 0.0
        self.unpinged_said = False
        self.notifier.watchdog(status())
        gap_s = 0.0 if self.last_ping_mono is None else mono - self.last_ping_mono
        self.last_ping_mono = mono
        return gap_s
