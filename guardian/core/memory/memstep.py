"""Steps 5 and 6 of a tick: the start guard (core/memory/startguard.py, S1-S10) watches each replica's
start and stops one that takes the box below the critical headroom, restarting it one step lower;
that change becomes the memory guard's pending one. The memory guard (its view built once by
core/memory/memview.py, from step 5's replicas where step 5 built them and nothing changed since; its
verdict by core/memory/memguard.py) then decides; a change it starts marks that
replica's restart in flight, as any other restart does, and its drains are core/proxy/drain.py's (D8,
D10). Pure.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from .. import admission
from ..actions import DrainReplica, SetFraction
from ..observations import MemoryObservation, ReplicaMemoryObservation
from ..proxy import draining
from ..proxy.drainstate import Drain, Phase
from ..rules import Refusal
from ..vocab import SERVING_STATES, ActiveState, Gate
from ..work import Tick
from . import memguard, memstate, memview, startguard


def inputs(t: Tick) -> memview.Inputs:
    """The tick so far, as the memory view reads it."""
    return memview.Inputs(
        t.obs,
        t.now,
        t.cfg,
        dict(t.tracks),
        dict(t.drains),
        t.previous.mem,
        t.planned_restarts_blocked,
        t.previous.slots_released,
    )


def guard_starts(t: Tick) -> tuple[dict[str, startguard.Start], tuple[memstate.ReplicaMemory, ...] | None]:
    """Step 5 (S1-S10): each replica's start is watched; one that takes the box below the critical
    headroom is stopped and restarted a step lower. That restart is the memory guard's pending
    change from now on (memguard.Pending), so that step 6 follows it as it follows a lowering (M3-M8).
    Returns the starts it watches (the next state's), and the memory view's replicas for step 6, or
    None where step 6 must build them: the start guard is off, or it stopped a start (its restart in
    flight, its drain moved)."""
    observed = t.obs.memory
    if observed is None or not t.cfg.memory.start_guard:  # off: nothing is watched
        return {}, None
    replicas = memview.replicas(inputs(t), observed)
    view = _start_view(t, observed, replicas)
    starts, actions = startguard.decide(t.previous.starts, view, t.now, t.cfg)
    for action in actions:
        if isinstance(action, SetFraction):
            t.mem = memguard.start_stopped(t.mem, action, t.now)
    _take_memory_actions(t, actions)  # its restart in flight, marked down at the proxy (D10)
    return starts, None if actions else replicas


def _start_view(
    t: Tick, observed: MemoryObservation, replicas: tuple[memstate.ReplicaMemory, ...]
) -> startguard.StartView:
    """The start guard's view: the memory guard's view of each replica, the tick's verdicts and
    units, and admission's budget (A1; S9)."""
    starting = tuple(_starting(t, mine, observed.replicas.get(mine.name)) for mine in replicas)
    sample = observed.sample
    return startguard.StartView(
        sample.available_bytes, observed.total_bytes, starting, observed.consumers, t.mem.pending
    )


def _starting(t: Tick, mine: memstate.ReplicaMemory, found: ReplicaMemoryObservation | None) -> startguard.Starting:
    """One replica as the start guard sees it: loading is S1's set."""
    track, seen = t.tracks[mine.name], t.obs.replicas[mine.name]
    unit = seen.unit
    active = unit is not None and unit.active_state in (ActiveState.ACTIVATING, ActiveState.ACTIVE)
    state = unit.active_state if unit is not None else None
    loading = startguard.WATCHED_ROW.holds(startguard.Loading(track.state, track.restart_in_flight, state))
    wiring = mine.wiring_problem
    if wiring is None and loading and found is not None:  # S5: an ExecStart= drop-in shows while it loads
        pending = t.previous.mem.pending
        wiring = startguard.overridden(
            mine.name, found.configured_fraction, found.cmdline_fraction, mine.started_at, pending
        )
    outcome = seen.restart_outcome
    return startguard.Starting(
        mine.name,
        mine.unit,
        loading,
        (unit.invocation_id, unit.inactive_exit_mono) if unit is not None else ("", None),
        mine.fraction,
        wiring,
        nvml_bytes=mine.usage_bytes,
        cgroup_bytes=found.cgroup_bytes if found is not None else None,
        refusal=_budget_refusal(t, mine.name) if loading else None,
        ended=track.state in SERVING_STATES or not active,
        refused=outcome.result if outcome is not None and not outcome.issued else None,
        pid=(unit.main_pid or None) if unit is not None else None,
    )


def _budget_refusal(t: Tick, name: str) -> Refusal | None:
    """S9: admission's budget (A1) for a stop of NAME's start. A2 (back-off) is not asked: guardian's
    own restart's start is in its back-off for the whole load; nor A3: the stop adds no start."""
    alone = {name: t.tracks[name]}  # its own restarts only
    refusal = admission.admit(name, alone, t.obs.persistent, t.now, t.cfg)
    return refusal if refusal is not None and refusal.gate is Gate.BUDGET else None


def guard_memory(t: Tick, replicas: tuple[memstate.ReplicaMemory, ...] | None) -> None:
    """Step 6 (M1-M26): the memory guard's verdict on its view of the box, and its drains (D8, D10);
    a start the start guard stopped (step 5) is its pending change already. REPLICAS: the view's
    replicas as step 5 built them, if it did."""
    observed = t.obs.memory
    if observed is None:  # the memory guard is off (a reload): its drains are not waited for
        t.drains = {
            name: down for name, down in t.drains.items() if not (down.for_memory and down.phase is Phase.DRAINING)
        }
        return
    here = inputs(t)
    view = memview.memory_view(replicas or memview.replicas(here, observed), here, observed)
    t.mem, actions = memguard.decide(t.mem, view, t.now, t.cfg)
    asked = _take_memory_actions(t, actions)
    draining.mark_up_unasked(t, asked)


def _take_memory_actions(t: Tick, actions: Iterable[memstate.MemAction]) -> set[str]:
    """The memory guard's actions (and the start guard's), its drains kept here; returns the
    replicas it works on."""
    asked: set[str] = set()
    for action in actions:
        if isinstance(action, DrainReplica):  # consumed here, never by the executor
            asked.add(action.replica)
            if action.replica not in t.drains:
                why = "the memory guard's change of fraction"
                t.drains[action.replica] = Drain(Phase.DRAINING, t.now, why, for_memory=True)
            continue
        if isinstance(action, SetFraction) and action.restart and action.replica in t.tracks:
            asked.add(action.replica)
            # The watchdog keeps out of it, and no other restart starts, until the job is done.
            track = t.tracks[action.replica]
            t.tracks[action.replica] = replace(track, restart_in_flight=True, restart_issued_at=t.now)
            t.actions.append(draining.lowering_at_the_proxy(t, action))
            continue
        t.actions.append(action)
    return asked
