"""One tick's decision: ``decide(state, observation, now, cfg) -> (state, actions)``. Pure.

This is guardian's judgement of the replicas, their restarts and the box's memory; the daemon
observes, calls this once, and performs the actions. What is judged elsewhere, and why: the
said-once conditions (hazards, weights W1-W3, a host's split, the engine) in core/notices.py, whose
transitions the shell runs as its scans and reads come in (they act on nothing); the start fit
(core/fit/startfit.py, U1-U11), judged by its pure `judge` on figures measured right before a
start, since a fit measured a tick earlier could be wrong by then, and a kept U8 finding judged
each tick on that tick's memory (U9, U10: startfit.judge_kept).

``now`` is the tick's moment in monotonic seconds (CLOCK_MONOTONIC, a float): the clock of every
time in the observation and in the state (core/observations.py). The core never reads a clock itself.

decide() makes a Tick (core/work.py), which holds what it was given and what it has decided so
far, and runs the steps over it in order; each step is a function of the module that holds its
rules, and this module is only their order:

0. weights: the memory guard forgets what it learned of a replica whose weights changed (W2);
1. verdicts.judge_liveness: each replica's observation is folded into its track (core/watchdog/,
   L1-L22); state changes and unreadable /metrics are logged once; canaries are asked for;
   canary latencies that changed are recorded in the state file (one action a tick), where a
   track created later starts from them;
2. draining.follow_drains (core/proxy/, D4-D9, D11, D12): a drained replica is restarted, a drain that
   cannot go on is abandoned, a replica back in service is marked up at the proxy;
3. restarts.restart_unplanned: a replica whose verdict asks for one (stalled, unresponsive, idle-dead) is
   restarted if admission allows (core/admission.py, A1-A3 then G1-G9), at most one per tick,
   and marked down at the proxy (D10);
4. requests.take_requests: operators' restart requests (`guardian restart NAME`, recorded in the state
   file) wait for a fleet slot when [fleet] is set (core/fleet.py, F2-F6), pass the same
   admission, then drain first when a proxy is configured (D1, D2); each is answered, refused
   or done, exactly once; one asked with `--wait` waits through a refusal that passes by itself
   (A4: back-off, one at a time, a job pending), said once per cause, until its wait ends;
5. memstep.guard_starts: the start guard (core/memory/startguard.py, S1-S10) watches each replica's start, and
   stops one that takes the box below the critical headroom, restarting it one step lower; that
   change becomes the memory guard's pending one, which step 6 follows (M3-M8);
6. memstep.guard_memory: the memory guard (its view built by core/memory/memview.py, its verdict by
   core/memory/memguard.py, M1-M26) sees the tracks and what admission would say; a change it starts
   marks that replica's restart in flight, as any other restart does; its drains are kept here
   (D8, D10);
7. fleet.release_slots: a fleet slot whose planned restart is over is given back (F7);
8. bypass: clients that talk to a replica past the proxy are said (core/proxy/bypass.py, B1-B3);
9. with a proxy configured, the last action is SyncProxy(the replicas marked down).

The steps are coupled through what the Tick holds. A restart under way (Tick.restart_under_way:
a track with its restart in flight, since an earlier tick or issued on this one, or a planned
restart after its drain that a dry run stood for, Tick.stood_for) blocks the others (one at a time
per box), and a drain in progress blocks the planned ones too (Tick.planned_restarts_blocked); a
lowering's restart counts against the same budget and back-off. The other hand-overs are values
decide() passes on: step 1 returns the tracks and its actions; step 2 the requests whose drain ended
into a refusal they wait through (A4), for step 4; step 3 the track a hung replica was restarted
from, for the proxy's D10; step 5 the starts it watches and the replicas as it left them, for step
6; steps 7 and 8 their parts of the next state. What steps 2-6 still write in turn are the next
state's tracks (a restart put in flight: restarts.restart, and memstep for the guards' restarts),
drains (draining.py, memstep), the memory track (memstep), the requests taken and the waits said
(step 4), and the actions.
"""

from __future__ import annotations

from dataclasses import replace

from ..config import Config
from . import fleet, requests, restarts
from .actions import Action, SyncProxy
from .memory import memguard, memstep
from .observations import TickObservation
from .proxy import bypass, draining
from .watchdog import canary, verdicts
from .work import Tick, TickState

__all__ = ["TickState", "decide", "next_tick_at", "probe_wait_s", "watching_starts"]


def decide(state: TickState, obs: TickObservation, now: float, cfg: Config) -> tuple[TickState, list[Action]]:
    for name in obs.weights_moved:  # 0
        state = replace(state, mem=memguard.weights_changed(state.mem, name))
    tick = Tick(state, obs, now, cfg)
    tick.tracks, judged = verdicts.judge_liveness(tick)  # 1
    tick.actions += judged
    requeued = draining.follow_drains(tick)  # 2
    for replica in cfg.replicas:  # 3
        hung = restarts.restart_unplanned(tick, replica)
        if hung is not None:
            draining.mark_down_hung(tick, replica, hung)  # D10
    requests.take_requests(tick, requeued)  # 4
    tick.starts, replicas = memstep.guard_starts(tick)  # 5
    memstep.guard_memory(tick, replicas)  # 6
    slots_released = _release_slots(tick)  # 7
    bypass_seen, bypassing = _watch_bypass(tick)  # 8
    if cfg.proxy.enabled:  # 9: the whole set, every tick: the shell applies a change, and retries a failed one
        tick.actions.append(SyncProxy(frozenset(tick.drains)))
    return tick.next_state(slots_released, bypass_seen, bypassing), tick.actions


def _release_slots(tick: Tick) -> frozenset[str]:
    """Step 7: the fleet slots given back (F7), their ReleaseSlot actions added; the slots released
    that the view may still show."""
    view = tick.obs.fleet
    if view is None or not view.ok:
        return tick.previous.slots_released
    slots_released, released = fleet.release_slots(view, tick.previous.slots_released, tick.slot_in_use, tick.tracks)
    tick.actions += released
    return slots_released


def _watch_bypass(tick: Tick) -> tuple[dict[tuple[str, str], float], tuple[bypass.Bypass, ...]]:
    """Step 8: clients bypassing the proxy, said when they begin and end (B1-B3); what is seen of
    them for the next tick."""
    conns = {name: seen.conns for name, seen in tick.obs.replicas.items()}
    before = tick.previous.bypassing
    bypass_seen, found = bypass.update(tick.previous.bypass_seen, before, conns, tick.now, tick.cfg)
    tick.actions += bypass.said(before, found, tick.cfg, tick.now)
    return bypass_seen, tuple(found)


def next_tick_at(state: TickState, last_started: float, now: float, cfg: Config) -> float:
    """When the next tick starts: INTERVAL_S after the last one started, or earlier so that its
    judgment lands on a replica's deadline (watchdog/canary.py next_deadline). A tick judges once its probes
    are in, up to cfg.probe_wait_s after it starts, so it starts that much before the deadline; if
    that moment has passed (this tick judged just short of it), it starts at the deadline itself.
    At most two extra ticks per deadline; never one in the past.

    While the start guard watches a start (watching_starts), ticks come every
    memory.start_guard_interval_s instead (never slower than interval_s): headroom may fall by at
    most critical_headroom_bytes between two looks before the box is out of memory."""
    at = last_started + _interval_s(state, cfg)
    for track in state.tracks.values():
        deadline = canary.next_deadline(track, cfg.watchdog, after=now)
        if deadline is None:
            continue
        early = deadline - cfg.probe_wait_s
        at = min(at, early if early > now else deadline)
    return at


PROBE_WAIT_FLOOR_S = 0.05  # a healthy replica answers within it


def probe_wait_s(state: TickState, now: float, cfg: Config) -> float:
    """How long this tick waits for its probes: cfg.probe_wait_s, but not past a replica's
    deadline (watchdog/canary.py next_deadline), so that the verdict is given at it rather than a whole
    wait later; at least PROBE_WAIT_FLOOR_S, for the replicas that do answer. While a start is
    watched, at most half the start guard's interval: a probe still out is carried to the next tick."""
    wait = min(cfg.probe_wait_s, _interval_s(state, cfg) / 2)
    for track in state.tracks.values():
        # one already past must not shorten every tick; one due now gets the floor
        deadline = canary.next_deadline(track, cfg.watchdog, after=now - 1e-6)
        if deadline is not None:
            wait = min(wait, max(deadline - now, PROBE_WAIT_FLOOR_S))
    return wait


def watching_starts(state: TickState, cfg: Config) -> bool:
    """The start guard is on and watches a start it has not stopped (S1's set: its unit activating or
    active within its grace, no restart job in flight): each tick is its look. Not a unit deactivating,
    a restart in flight or a crash loop between its starts, though liveness calls them starting."""
    memory = cfg.memory
    return memory.enabled and memory.start_guard and any(not s.stopped for s in state.starts.values())


def _interval_s(state: TickState, cfg: Config) -> float:
    """How often ticks start now: interval_s, or memory.start_guard_interval_s while a start is
    watched (whichever is shorter: the start guard never slows the watchdog down)."""
    if watching_starts(state, cfg):
        return min(cfg.interval_s, cfg.memory.start_guard_interval_s)
    return cfg.interval_s
