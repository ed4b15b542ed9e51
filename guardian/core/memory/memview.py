"""The memory guard's view of the box (memguard.MemoryView), built from the tick so far. Pure.

The tick (core/tick.py) has judged every replica's liveness, moved its drains on and issued its
restarts before the memory guard looks. This module turns that (Inputs, a value the tick's
memory step core/memory/memstep.py takes of it), and what the memory observer found, into what
core/memory/memguard.py decides on. Each replica's part (replicas()) is built by the start guard's step
(core/memory/memstep.py guard_starts) and handed to the memory guard's; it is built again there where
the start guard is off or stopped a start this tick (its restart then under way changes it). The
refusals (restart_blocked) are built after the start guard, since a start it stops is a restart
under way. Per replica:

- its fraction: guardian's env file for it, else what it reports (vllm:cache_config_info, else
  --gpu-memory-utilization on its command line);
- whether it is wired (core/memory/wiring.py), and M9: a replica with no lowering pending that serves
  with another fraction than its env file says is overridden by something, so not wired (not
  while the fraction written is one its running start predates: M18 gave up or M19 dropped the
  restart that would have read it);
- whether it is drained at the proxy for a change of fraction (core/proxy/drain.py D6, D7);
- why it could not be restarted now: admission (A1-A3), then a fleet slot (F3-F6); and how many
  restarts its budget still allows (a raise never spends the last one, M24);
- its base: the fraction it had before guardian first lowered it (the state file), which a raise
  never goes above (M20).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ...config import Config, ReplicaConfig
from .. import admission, fleet
from ..observations import MemoryObservation, ReplicaMemoryObservation, TickObservation
from ..proxy import drain
from ..proxy.drainstate import Drain, Phase
from ..rules import Refusal, first_match
from ..vocab import SERVING_STATES
from ..watchdog.judge import serves
from ..watchdog.track import Track
from .memguard import not_read
from .memsqueeze import OVERRIDDEN_ROW, Served
from .memstate import MemoryView, MemTrack, ReplicaMemory
from .wiring import KNOB, problem_of


@dataclass(frozen=True)
class Inputs:
    """The tick so far, as the memory view reads it."""

    obs: TickObservation
    now: float
    cfg: Config
    tracks: Mapping[str, Track]
    drains: Mapping[str, Drain]
    previous_mem: MemTrack  # the memory guard's state as the last tick left it
    planned_restarts_blocked: bool  # core/work.py Tick.planned_restarts_blocked
    slots_released: frozenset[str]


def memory_view(replicas: tuple[ReplicaMemory, ...], inputs: Inputs, observed: MemoryObservation) -> MemoryView:
    obs = inputs.obs
    return MemoryView(
        observed.sample,
        observed.total_bytes,
        replicas,
        observed.peers_serving,
        observed.consumers,
        restart_blocked=_refusals(inputs),
        restart_results={n: o.restart_outcome for n, o in obs.replicas.items() if o.restart_outcome is not None},
        drain_first=inputs.cfg.proxy.enabled,
        fleet_serving=drain.serving_elsewhere(obs, inputs.cfg),
    )


def replicas(inputs: Inputs, observed: MemoryObservation) -> tuple[ReplicaMemory, ...]:
    """Each configured replica as the memory guard and the start guard see it."""
    return tuple(_replica(inputs, replica, observed.replicas.get(replica.name)) for replica in inputs.cfg.replicas)


def _replica(tick: Inputs, replica: ReplicaConfig, found: ReplicaMemoryObservation | None) -> ReplicaMemory:
    track = tick.tracks[replica.name]
    seen = tick.obs.replicas[replica.name]
    reported = track.last_sample.gpu_memory_utilization if track.last_sample is not None else None
    if reported is None and found is not None:
        reported = found.cmdline_fraction
    configured = found.configured_fraction if found is not None else None
    pending = tick.previous_mem.pending
    changing = pending is not None and pending.replica == replica.name
    started_at = seen.unit.inactive_exit_mono if seen.unit else None
    written_at = tick.previous_mem.unread.get(replica.name)
    unread = written_at is not None and not_read(started_at, written_at)
    wiring = problem_of(found.wiring) if found is not None else "not observed"
    knob = knob_name(found.wiring.knob if found is not None and found.wiring is not None else KNOB)
    settled = not changing and not unread
    served = Served(wiring is None, settled, track.state in SERVING_STATES, configured, reported, knob)
    overridden = first_match((OVERRIDDEN_ROW,), served)
    if overridden is not None:
        wiring = overridden[1]
    down = tick.drains.get(replica.name)
    budget = admission.budget(replica.name, tick.obs.persistent, tick.now, tick.cfg)
    return ReplicaMemory(
        name=replica.name,
        unit=replica.unit,
        model=replica.model,
        fraction=configured if configured is not None else reported,
        running_fraction=reported,
        started_at=started_at,
        wiring_problem=wiring,
        state=track.state,
        usage_bytes=found.usage_bytes if found else None,
        start_failure=found.start_failure if found and changing else None,
        startup_grace_s=replica.startup_grace_s,
        drained=down is not None
        and down.for_memory
        and down.phase is Phase.DRAINING
        and drain.drained(down, seen, tick.now, tick.cfg) is not None,
        base=tick.obs.persistent.fraction_bases.get(replica.name),
        restarts_left=budget.limit - budget.used,
        serves=serves(track, tick.now),
        knob=knob,
    )


def knob_name(flag: str | None) -> str:
    """How a journal line names an engine's fraction: its flag's words (--mem-fraction-static:
    mem_fraction_static); "its memory fraction" for an engine with none."""
    return flag.lstrip("-").replace("-", "_") if flag else "its memory fraction"


def _refusals(tick: Inputs) -> dict[str, Refusal]:
    """Per replica, why the memory guard's restart of it (a lowering's, a raise's) could not happen now."""
    found: dict[str, Refusal] = {}
    for replica in tick.cfg.replicas:
        # Its own drain is the first step of this change, not another restart in flight.
        mine = tick.drains.get(replica.name)
        own = mine is not None and mine.for_memory and mine.phase is Phase.DRAINING
        others = any(d.phase is Phase.DRAINING for n, d in tick.drains.items() if n != replica.name)
        busy = others if own else tick.planned_restarts_blocked
        refusal = admission.admit(replica.name, tick.tracks, tick.obs.persistent, tick.now, tick.cfg, busy)
        if refusal is None and not own:  # a drain for the memory guard was begun with its slot held
            refusal = fleet.slot_refusal(replica.name, replica.model, tick.obs.fleet, tick.cfg, tick.slots_released)
        if refusal is not None:
            found[replica.name] = refusal
    return found
