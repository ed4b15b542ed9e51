"""A change of fraction in flight, a lowering or a raise, followed until it is done or given up
(M3-M8), and the restart of a failed start that admission held back (M18, M19). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...config import MemoryConfig
from ..rules import Refusal, Row, Rule, first_match
from ..vocab import SERVING_STATES, Decision, Gate, MemVerdict, Priority, State
from .memstate import (
    Facts,
    MemoryView,
    Message,
    Pending,
    ReplicaMemory,
    SaidRow,
    choose_fraction,
    grid_below,
    held_of,
    highest_fit_between,
)


@dataclass(frozen=True)
class _Follow:
    """What the rows of FOLLOW_ROWS read of the change in flight, each fact computed once."""

    replica: ReplicaMemory
    facts: Facts  # the line's numbers as far as they are known before a row is chosen
    abandoned: str | None  # its restart's result, when the restart was not issued (refused, failed)
    started: bool  # it serves, from a start after the change
    overridden: bool  # ... and reports another fraction than the one written
    owed: bool  # M18 held its restart back, and its unit has not started since
    dropped: str | None  # why that owed restart is not issued at all (it serves again, or is paused)
    failure: str | None  # why the new start failed; None while it may still succeed
    lower: float | None  # the next fraction after a failed start (None: none fits)
    refusal: Refusal | None  # admission's refusal (A1-A3) of the restart this change would issue now

    @property
    def failing(self) -> bool:
        """The new start failed, and the change is not concluded otherwise."""
        return self.abandoned is None and not self.started and not self.owed and self.failure is not None

    @property
    def retrying(self) -> bool:
        """A restart at a lower fraction is due: after a failed start, or the one M18 held back."""
        return (self.failing and self.lower is not None) or (self.owed and self.dropped is None)


Followed = tuple[MemVerdict, Facts]


def _failed(f: _Follow) -> Facts:
    return replace(f.facts, failure=f.failure or "")


def _retried(f: _Follow) -> Followed:
    """M18: back-off and one at a time end by themselves (the restart waits); a spent budget may
    last the window (the lowering is given up)."""
    assert f.refusal is not None
    verdict = MemVerdict.RETRY_GIVEN_UP if f.refusal.gate is Gate.BUDGET else MemVerdict.RETRY_WAITS
    facts = f.facts if f.owed else replace(_failed(f), new=f.lower or 0.0)
    return verdict, replace(facts, refusal=f.refusal)


# M3-M8, M18, M19: a change of fraction in flight, a lowering or a raise. The first row that holds
# is the verdict (each condition is written whole, so the order is only the table's); its evidence is
# the verdict (M18 and M19 have two each) and the line's numbers.
FOLLOW_ROWS: tuple[Row[_Follow, Followed], ...] = (
    Row(
        Rule(
            "M3",
            MemVerdict.PENDING,
            "a lowering (or a raise) is pending: issued, and the replica not serving since with a new start",
        ),
        lambda f: f.abandoned is None and not f.started and not f.owed and f.failure is None,
        lambda f: (MemVerdict.PENDING, f.facts),
    ),
    SaidRow(
        Rule(
            "M4",
            MemVerdict.DONE,
            "the pending replica serves (healthy or busy), was started after the change, and reports "
            "the new fraction (or reports none)",
        ),
        lambda f: f.abandoned is None and f.started and not f.overridden,
        lambda f: (MemVerdict.DONE, f.facts),
        says={
            MemVerdict.DONE: Message(
                Priority.INFO,
                "replica {replica.name}: serving again with {replica.knob} {written:g} {since_lowering_s:.0f} s "
                "after the {change}; headroom {headroom_bytes:GiB}",
                every_time=True,
            )
        },
    ),
    SaidRow(
        Rule(
            "M5",
            MemVerdict.MISMATCH,
            "the pending replica serves, was started after the change, and reports another "
            "fraction than the one written: something overrides guardian's env file; no further change of it",
        ),
        lambda f: f.abandoned is None and f.started and f.overridden,
        lambda f: (MemVerdict.MISMATCH, f.facts),
        says={
            MemVerdict.MISMATCH: Message(
                Priority.ERROR,
                "replica {replica.name}: serving again, but with {replica.knob} {replica.running_fraction:g}, not the "
                "{written:g} guardian wrote: something overrides guardian's env file (a later EnvironmentFile= that "
                "sets GPU_MEMORY_UTILIZATION, or an ExecStart= drop-in); not changing its fraction again until that is "
                "fixed (guardian check; systemctl cat {replica.unit})",
                every_time=True,
            )
        },
    ),
    SaidRow(
        Rule("M6", MemVerdict.ABANDONED, "the change's restart was refused by a gate or failed"),
        lambda f: f.abandoned is not None,
        lambda f: (MemVerdict.ABANDONED, replace(f.facts, failure=f.abandoned or "")),
        says={
            MemVerdict.ABANDONED: Message(
                Priority.ERROR, "replica {replica.name}: {change} to {written:g} abandoned: {failure}", every_time=True
            )
        },
    ),
    SaidRow(
        Rule(
            "M7",
            MemVerdict.RETRY,
            "the new start failed (vLLM's refusal in this start's journal, unit failed, or not serving "
            "R.startup_grace_s after the change) AND a lower fraction >= M.floor fits (after a failed raise: the "
            "highest that fits <= the fraction it was raised from): it is written at once, and the unit restarted "
            "unless it is starting by itself (Restart=) or admission refuses (M18)",
        ),
        lambda f: f.failing and f.lower is not None and f.refusal is None,
        lambda f: (MemVerdict.RETRY, replace(_failed(f), new=f.lower or 0.0)),
        says={
            MemVerdict.RETRY: Message(
                Priority.ERROR,
                "replica {replica.name}: start with {replica.knob} {written:g} failed ({failure}); trying "
                "{new:g}{not_again}",
                every_time=True,
            )
        },
    ),
    SaidRow(
        Rule(
            "M8",
            MemVerdict.GAVE_UP,
            "the new start failed AND no lower fraction >= M.floor fits: left to the operator",
        ),
        lambda f: f.failing and f.lower is None,
        lambda f: (MemVerdict.GAVE_UP, _failed(f)),
        says={
            MemVerdict.GAVE_UP: Message(
                Priority.ERROR,
                "replica {replica.name}: start with {replica.knob} {written:g} failed ({failure}); no lower "
                "fraction >= floor {memory.floor:g} fits in headroom {headroom_bytes:GiB}; leaving it to the operator "
                "(journalctl -u {replica.unit}){not_again}",
                every_time=True,
            )
        },
    ),
)

# M18, M19: M7's restart through admission. Rows of the same table as M3-M8 (FOLLOW_ROWS), kept
# apart in the rule table only because the squeeze's rows came to be numbered before them.
RETRY_ROWS: tuple[Row[_Follow, Followed], ...] = (
    SaidRow(
        RETRY_HELD := Rule(
            "M18",
            MemVerdict.RETRY_WAITS,
            "M7 holds, its unit is not starting by itself, AND restart admission refuses now: the lower fraction is "
            "written at once (a file write is not a restart); for back-off or one at a time (A2, A3, which end by "
            "themselves) the restart waits, said once per refusal; for the budget (A1: spent, when M7 holds or "
            "while the restart waits) the lowering is given up (critical): the fraction stays written for the "
            "unit's next start, nothing is pending",
        ),
        lambda f: f.retrying and f.refusal is not None,
        _retried,
        says={
            MemVerdict.RETRY_WAITS: Message(
                Priority.ERROR,
                "replica {replica.name}: start with {replica.knob} {written:g} failed ({failure}); {new:g} is "
                "written to its env file, but restarting {replica.unit} waits: {refusal.text}{not_again}",
            ),
            MemVerdict.RETRY_GIVEN_UP: Message(
                Priority.CRITICAL,
                "replica {replica.name}: start with {replica.knob} {written:g} failed ({failure}); {new:g} is "
                "written to its env file, but restarting {replica.unit} is refused: {refusal.text}; giving up on the "
                "lowering: the unit's next start reads {new:g} (journalctl -u {replica.unit}; systemctl restart "
                "{replica.unit}){not_again}",
                every_time=True,
            ),
        },
    ),
    SaidRow(
        RETRY_OWED := Rule(
            "M19",
            MemVerdict.RETRY_RESTART,
            "a restart that waited (M18), its unit not started since the fraction was written, the replica not "
            "serving (healthy or busy) and not paused, AND admission (A1-A3) lets it through now: the unit is "
            "restarted with that fraction. One that serves (its start finished after all) or is paused: the "
            "restart is dropped and the change concluded (info); the fraction stays written for its next start",
        ),
        lambda f: f.owed,
        lambda f: (
            (MemVerdict.RETRY_DROPPED, replace(f.facts, dropped=f.dropped))
            if f.dropped is not None
            else (MemVerdict.RETRY_RESTART, f.facts)
        ),
        says={
            MemVerdict.RETRY_RESTART: Message(
                Priority.WARNING,
                "replica {replica.name}: restarting {replica.unit} with {replica.knob} {new:g}, written after its "
                "start with {written:g} failed ({failure}): admission lets it through now",
                Decision.MEMORY,
                every_time=True,
            ),
            MemVerdict.RETRY_DROPPED: Message(
                Priority.INFO,
                "replica {replica.name}: {dropped}; the restart owed to it with {replica.knob} {new:g} (written "
                "after its start with {written:g} was judged failed: {failure}) is dropped and the lowering concluded: "
                "{new:g} stays in its env file and is read at its next start",
                every_time=True,
            ),
        },
    ),
)

# What M18 heeds: admission's own rows (A1-A3). A failed start's unit is down already, so a
# fleet slot (F3-F6, for a planned restart of a serving replica) does not hold it back. It waits
# out back-off and one at a time (A2, A3), which end by themselves; a spent budget (A1) can last
# W.restart_window_s, and a change pending that long would hold the memory guard (and the start
# guard's stops) for every replica: the lowering is given up instead.
_ADMISSION_GATES = frozenset({Gate.BUDGET, Gate.BACKOFF, Gate.ONE_AT_A_TIME})


def follow_change(
    pending: Pending, view: MemoryView, now: float, memory: MemoryConfig
) -> tuple[MemVerdict, ReplicaMemory, Facts] | None:
    """M3-M8, M18, M19 for the change in flight (the first row that holds); None when its replica
    is no longer configured."""
    replica = next((r for r in view.replicas if r.name == pending.replica), None)
    if replica is None:
        return None
    found = first_match((*FOLLOW_ROWS, *RETRY_ROWS), _follow(pending, replica, view, now, memory))
    assert found is not None, "the rows cover every case"
    (verdict, facts) = found[1]
    return verdict, replica, facts


def _follow(pending: Pending, replica: ReplicaMemory, view: MemoryView, now: float, memory: MemoryConfig) -> _Follow:
    facts = Facts(
        written=pending.new,
        change="raise" if pending.raising else "lowering",
        since_lowering_s=now - pending.issued_at,
        headroom_bytes=view.sample.available_bytes,
    )
    outcome = (view.restart_results or {}).get(pending.replica)
    abandoned = outcome.result if outcome is not None and not outcome.issued else None
    restarted = replica.started_at is not None and replica.started_at >= pending.issued_at
    running = replica.running_fraction
    owed = pending.restart_owed and not restarted
    if owed:  # what the restart M18 held back is said with
        facts = replace(facts, written=pending.old, new=pending.new, failure=pending.failure)
    failure = _start_failure(replica, facts.since_lowering_s)
    started = replica.state in SERVING_STATES and restarted
    failing = abandoned is None and not started and not owed and failure is not None
    lower, facts = _lower(pending, replica, view, facts, memory) if failing else (None, facts)
    # systemd restarts a unit still starting by itself (Restart=): only the file is written, no restart to admit
    asks = owed or replica.state is not State.STARTING
    return _Follow(
        replica,
        facts,
        abandoned,
        started=started,
        overridden=running is not None and abs(running - pending.new) > 1e-6,
        owed=owed,
        dropped=_why_dropped(replica) if owed else None,
        failure=failure,
        lower=lower,
        refusal=_admission_refusal(replica, view) if asks else None,
    )


def _lower(
    pending: Pending, replica: ReplicaMemory, view: MemoryView, facts: Facts, memory: MemoryConfig
) -> tuple[float | None, Facts]:
    """M7, M8: the next fraction after a failed start. After a failed raise it goes back toward the
    fraction it was raised from (never above it), and that raise is not tried again."""
    held, headroom, total = held_of(replica, view.total_bytes), view.sample.available_bytes, view.total_bytes
    if pending.raising:
        lower = highest_fit_between(grid_below(pending.old), pending.new, held, headroom, total, memory)
        return lower, replace(facts, not_again=f"; it is not raised to {pending.new:g} again while guardian runs")
    return choose_fraction(pending.new, held, headroom, total, memory), facts


def _why_dropped(replica: ReplicaMemory) -> str | None:
    """M19: why a restart that waited is not issued at all; None when it still is."""
    if replica.state is State.PAUSED:  # the operator's: guardian restarts nothing of it
        return "it is paused by the operator (guardian pause)"
    if replica.state in SERVING_STATES:  # the start judged failed finished after all: nothing to restart
        running = replica.running_fraction
        with_what = f"{replica.knob} {running:g}" if running is not None else "the fraction it started with"
        return f"it serves again with {with_what}, from its start before the fraction was written"
    return None


def _admission_refusal(replica: ReplicaMemory, view: MemoryView) -> Refusal | None:
    """Why admission (A1-A3) would not restart REPLICA now; a fleet slot is not asked for (M18)."""
    found = (view.restart_blocked or {}).get(replica.name)
    return found if found is not None and found.gate in _ADMISSION_GATES else None


def _start_failure(replica: ReplicaMemory, since_lowering_s: float) -> str | None:
    """Why the start after a lowering failed (M7, M8), by facts only; None while it may still succeed."""
    if replica.start_failure:
        return replica.start_failure
    if replica.state is State.STOPPED:
        return "unit failed"
    if since_lowering_s >= replica.startup_grace_s:
        return f"not serving {since_lowering_s:.0f} s after the restart (grace {replica.startup_grace_s:g} s)"
    return None
