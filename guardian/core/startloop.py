"""A replica whose starts fail one after another (issue 44 item 3): counted from what systemd says
of its unit at each tick. Pure.

Why: a start that fails because memory its processes held did not come back (core/fit/startfit.py U8:
the driver, or a file left in /dev/shm, still holds it) fails again at the next start, and the
next: a compose restart loop of about 35 starts thrashed a GB10 until a physical reset
(eugr/spark-vllm-docker #257). guardian must not feed that loop; its unit's own Restart= still does,
and only an operator can stop that.

A start is one invocation of the replica's unit (its InvocationID). It failed when it ended (the
unit inactive or failed, or waiting for its Restart= to start it again: sub-state auto-restart;
or a new invocation seen) without the replica having served (healthy or busy) during it. The
unit's NRestarts counts the starts its Restart= made between two looks, so a loop faster than the
ticks is counted whole. A start that serves sets the count back to 0. What happened before
guardian first looked is not counted.

A replica whose last FAILED_STARTS_LOOP starts failed while U8's finding for it stands is in a
start loop: admission refuses every restart guardian would cause of it (core/admission.py A6:
the watchdog's, the memory guard's, an operator's `guardian restart`), and the tick says so once
at critical when it begins, naming its unit's Restart= as the loop that remains, and once at info
when it ends (it served, or the memory came back).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .observations import UnitInfo
from .vocab import ActiveState

# Three: one failed start is an accident, two may be the next one's bad luck with the same cause;
# by the third the cause is still there, and each further start only feeds the loop.
FAILED_STARTS_LOOP = 3
_ENDED = (ActiveState.INACTIVE, ActiveState.FAILED)


@dataclass(frozen=True)
class StartRun:
    """A replica's starts as the ticks have followed them."""

    invocation: str = ""  # the unit's invocation followed ("": none seen yet)
    restarts: int = 0  # the unit's NRestarts when last looked at
    served: bool = False  # the replica served during that invocation
    over: bool = False  # that invocation has ended (and was counted)
    failed: int = 0  # starts in a row that ended without serving
    not_returned_bytes: int | None = None  # U8's standing finding for the replica, as last given

    @property
    def looping(self) -> bool:
        """FAILED_STARTS_LOOP starts in a row failed while U8's finding stands (A6)."""
        return self.failed >= FAILED_STARTS_LOOP and self.not_returned_bytes is not None


def _ended(unit: UnitInfo) -> bool:
    return unit.active_state in _ENDED or unit.sub_state == "auto-restart"


def _exits(run: StartRun, unit: UnitInfo) -> int:
    """How many starts ended since RUN was looked at, now that UNIT shows a new invocation: those its
    Restart= made (NRestarts up), at least one; after a reset of NRestarts (an operator's start) the
    one before it and those since."""
    if unit.n_restarts > run.restarts:
        return unit.n_restarts - run.restarts
    return 1 + unit.n_restarts if unit.n_restarts < run.restarts else 1


def fold(run: StartRun, unit: UnitInfo | None, serving: bool, not_returned_bytes: int | None) -> StartRun:
    """RUN with this tick's look folded in: UNIT as systemd reports it (None: not asked), whether
    the replica SERVES now (healthy or busy), U8's NOT_RETURNED_BYTES for it (None: no finding)."""
    run = replace(run, not_returned_bytes=not_returned_bytes)
    if unit is None:
        return run
    failed = run.failed
    if unit.invocation_id and unit.invocation_id != run.invocation:  # a new start
        first = not run.invocation  # the first guardian sees: what came before is not counted
        if not first:  # the one followed ended, and any between: each that did not serve failed
            exits = _exits(run, unit) - (1 if run.over else 0)
            failed += max(0, exits - (1 if run.served and not run.over else 0))
        ended = _ended(unit) and not serving  # and this one has ended already
        failed += 1 if ended and not first else 0
        return StartRun(
            unit.invocation_id, unit.n_restarts, serving, ended, 0 if serving else failed, not_returned_bytes
        )
    run = replace(run, restarts=unit.n_restarts)
    if serving:
        return replace(run, served=True, failed=0)
    if not run.over and run.invocation and _ended(unit):
        return replace(run, over=True, failed=failed + (0 if run.served else 1))
    return run
