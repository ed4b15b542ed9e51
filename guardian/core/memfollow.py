"""A change of fraction in flight, a lowering or a raise, followed until it is done or given up
(M3-M8), and the restart of a failed start that admission held back (M18, M19). Pure.
"""

from __future__ import annotations

from dataclasses import replace

from ..config import MemoryConfig
from .memstate import (
    Facts,
    MemoryView,
    Pending,
    ReplicaMemory,
    choose_fraction,
    grid_below,
    held_of,
    highest_fit_between,
)
from .rules import Refusal, Rule
from .vocab import SERVING_STATES, Gate, MemVerdict, State

# M3-M8: a change of fraction in flight, a lowering or a raise (follow_change).
LOWERING_RULES = (
    Rule(
        "M3",
        MemVerdict.PENDING,
        "a lowering (or a raise) is pending: issued, and the replica not serving since with a new start",
    ),
    Rule(
        "M4",
        MemVerdict.DONE,
        "the pending replica serves (healthy or busy), was started after the change, and reports "
        "the new fraction (or reports none)",
    ),
    Rule(
        "M5",
        MemVerdict.MISMATCH,
        "the pending replica serves, was started after the change, and reports another "
        "fraction than the one written: something overrides guardian's env file; no further change of it",
    ),
    Rule("M6", MemVerdict.ABANDONED, "the change's restart was refused by a gate or failed"),
    Rule(
        "M7",
        MemVerdict.RETRY,
        "the new start failed (vLLM's refusal in this start's journal, unit failed, or not serving "
        "R.startup_grace_s after the change) AND a lower fraction >= M.floor fits (after a failed raise: the "
        "highest that fits <= the fraction it was raised from): it is written at once, and the unit restarted "
        "unless it is starting by itself (Restart=) or admission refuses (M18)",
    ),
    Rule("M8", MemVerdict.GAVE_UP, "the new start failed AND no lower fraction >= M.floor fits: left to the operator"),
)

# M18, M19: M7's restart through admission (follow_change).
RETRY_RULES = (
    RETRY_GIVEN_UP := Rule(
        "M18",
        MemVerdict.RETRY_WAITS,
        "M7 holds, its unit is not starting by itself, AND restart admission refuses now: the lower fraction is "
        "written at once (a file write is not a restart); for back-off or one at a time (A2, A3, which end by "
        "themselves) the restart waits, said once per refusal; for the budget (A1: spent, when M7 holds or while "
        "the restart waits) the lowering is given up (critical): the fraction stays written for the unit's next "
        "start, nothing is pending",
    ),
    RETRY_DROPPED := Rule(
        "M19",
        MemVerdict.RETRY_RESTART,
        "a restart that waited (M18), its unit not started since the fraction was written, the replica not "
        "serving (healthy or busy) and not paused, AND admission (A1-A3) lets it through now: the unit is restarted "
        "with that fraction. One that serves (its start finished after all) or is paused: the restart is dropped "
        "and the change concluded (info); the fraction stays written for its next start",
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
    """M3-M8, M18, M19 for the change in flight; None when its replica is no longer configured."""
    replica = next((r for r in view.replicas if r.name == pending.replica), None)
    if replica is None:
        return None
    headroom = view.sample.available_bytes
    facts = Facts(
        written=pending.new,
        change="raise" if pending.raising else "lowering",
        since_lowering_s=now - pending.issued_at,
        headroom_bytes=headroom,
    )
    outcome = (view.restart_results or {}).get(pending.replica)
    if outcome is not None and not outcome.issued:
        return MemVerdict.ABANDONED, replica, replace(facts, failure=outcome.result)
    restarted = replica.started_at is not None and replica.started_at >= pending.issued_at
    if replica.state in SERVING_STATES and restarted:
        running = replica.running_fraction
        overridden = running is not None and abs(running - pending.new) > 1e-6
        return (MemVerdict.MISMATCH if overridden else MemVerdict.DONE), replica, facts
    if pending.restart_owed and not restarted:  # M18 held its restart back, and nobody has started it since
        return _owed(pending, replica, view, facts)
    failure = _start_failure(replica, facts.since_lowering_s)
    if failure is None:
        return MemVerdict.PENDING, replica, facts
    return _retry(pending, replica, view, replace(facts, failure=failure), memory)


def _retry(
    pending: Pending, replica: ReplicaMemory, view: MemoryView, facts: Facts, memory: MemoryConfig
) -> tuple[MemVerdict, ReplicaMemory, Facts]:
    """M7, M8, M18: the new start failed. After a failed raise the retry goes back toward the
    fraction it was raised from (never above it), and that raise is not tried again."""
    held, headroom, total = held_of(replica, view.total_bytes), view.sample.available_bytes, view.total_bytes
    if pending.raising:
        lower = highest_fit_between(grid_below(pending.old), pending.new, held, headroom, total, memory)
        facts = replace(facts, not_again=f"; it is not raised to {pending.new:g} again while guardian runs")
    else:
        lower = choose_fraction(pending.new, held, headroom, total, memory)
    if lower is None:
        return MemVerdict.GAVE_UP, replica, facts
    facts = replace(facts, new=lower)
    # systemd restarts a unit still starting by itself (Restart=): only the file is written, no restart to admit
    refusal = _admission_refusal(replica, view) if replica.state is not State.STARTING else None
    if refusal is not None:
        return _waits_or_gives_up(refusal), replica, replace(facts, refusal=refusal)
    return MemVerdict.RETRY, replica, facts


def _owed(
    pending: Pending, replica: ReplicaMemory, view: MemoryView, facts: Facts
) -> tuple[MemVerdict, ReplicaMemory, Facts]:
    """M18, M19: the restart M18 held back, its unit not started since the fraction was written."""
    facts = replace(facts, written=pending.old, new=pending.new, failure=pending.failure)
    dropped = _why_dropped(replica)
    if dropped is not None:
        return MemVerdict.RETRY_DROPPED, replica, replace(facts, dropped=dropped)
    refusal = _admission_refusal(replica, view)
    if refusal is not None:
        return _waits_or_gives_up(refusal), replica, replace(facts, refusal=refusal)
    return MemVerdict.RETRY_RESTART, replica, facts


def _why_dropped(replica: ReplicaMemory) -> str | None:
    """M19: why a restart that waited is not issued at all; None when it still is."""
    if replica.state is State.PAUSED:  # the operator's: guardian restarts nothing of it
        return "it is paused by the operator (guardian pause)"
    if replica.state in SERVING_STATES:  # the start judged failed finished after all: nothing to restart
        running = replica.running_fraction
        with_what = f"gpu_memory_utilization {running:g}" if running is not None else "the fraction it started with"
        return f"it serves again with {with_what}, from its start before the fraction was written"
    return None


def _waits_or_gives_up(refusal: Refusal) -> MemVerdict:
    """M18: back-off and one at a time end by themselves; a spent budget may last the window."""
    return MemVerdict.RETRY_GIVEN_UP if refusal.gate is Gate.BUDGET else MemVerdict.RETRY_WAITS


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
