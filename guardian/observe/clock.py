"""The two clocks. Every window guardian judges runs on the monotonic clock (CLOCK_MONOTONIC,
the clock of systemd's *TimestampMonotonic properties), so a step of the wall clock (NTP, an
operator's `date -s`) cannot make a loading replica look hung or hold a window open. The wall
clock is used only where a time is persisted or shown; Now converts between the two."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class Now:
    mono: float  # time.monotonic(): seconds since boot, never stepped
    wall: float  # time.time(): seconds since the epoch, may be stepped

    def wall_of(self, mono: float | None) -> float | None:
        """A monotonic time as a wall-clock time, for display."""
        return None if mono is None else self.wall - (self.mono - mono)

    def mono_of(self, wall: float) -> float:
        """A wall-clock time (persisted before, maybe before a reboot) as a monotonic time; a time in
        the future (the wall clock was stepped back since) counts as now."""
        return self.mono - (self.wall - min(wall, self.wall))


def now() -> Now:
    return Now(time.monotonic(), time.time())


def boot_id() -> str:
    """This boot's id: a monotonic time persisted in another boot means nothing in this one."""
    try:
        return BOOT_ID_PATH.read_text().strip()
    except OSError:
        return ""
