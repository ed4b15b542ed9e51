"""Step 1 of a tick: each replica's verdict (core/watchdog/judge.py: the liveness rows L1-L22 and the canary's C1-C5),
said when it changes; unreadable /metrics said once; canaries asked for; canary latencies that
changed recorded in the state file (one action a tick), where a track created later starts from
them. Pure.
"""

from __future__ import annotations

from dataclasses import replace

from ...config import ReplicaConfig
from .. import admission, startloop
from ..actions import Action, LogLine, RecordCanaryLatencies, StartCanary
from ..fit import startfit
from ..observations import TickObservation, gib
from ..vocab import RESTART_STATES, SERVING_STATES, Decision, Priority, State
from ..work import Tick
from . import canary, judge, liveness
from .steps import kept_steps, longest_step_s
from .track import Track


def judge_liveness(t: Tick) -> tuple[dict[str, Track], list[Action]]:
    """Step 1 (L1-L22): every replica's verdict, said when it changes; canaries asked for. Reads
    what the Tick was given; returns the new tracks and the actions (lines, canaries, the canary
    latencies to record), which decide() puts in the Tick."""
    before = t.previous.tracks
    tracks: dict[str, Track] = {}
    out: list[Action] = []
    for replica in t.cfg.replicas:
        old = (
            before[replica.name]
            if replica.name in before
            else _new_track(replica.name, t.obs, t.now, t.cfg.watchdog.max_step_s)
        )
        tracks[replica.name] = _judge(t, replica, old, out)
    recorded = _record_canary_latencies(t, tracks)
    return tracks, out + ([recorded] if recorded is not None else [])


def _judge(t: Tick, replica: ReplicaConfig, old: Track, out: list[Action]) -> Track:
    """REPLICA's new track, its lines and canary added to OUT."""
    seen = t.obs.replicas[replica.name]
    pause = t.obs.persistent.pauses.get(replica.name)
    new, canary_timeout_s = judge.step(old, seen, t.now, replica, t.cfg.watchdog, pause)
    if new.state not in RESTART_STATES:
        new = replace(new, last_notice=None)
    if _to_say(old, new, t.now):
        out.append(_state_change(replica, old, new, t.now))
        new = replace(new, said_state=new.state)
    # Garbage on /metrics is bad input: say so once, and base no restart on it.
    error = seen.metrics_probe.error if seen.metrics_probe.answered and seen.metrics is None else None
    if error != new.metrics_error:
        if error is not None:
            out.append(
                LogLine(
                    Priority.ERROR,
                    f"replica {replica.name}: /metrics {error}; progress cannot be judged, so no "
                    "stall or idle verdict (and no restart) will be based on it until it reads again",
                    Decision.NOTE,
                    replica.name,
                    replica.unit,
                )
            )
        new = replace(new, metrics_error=error)
    # once "serving again N s after guardian's restart" is said (a quiet journal may hold it back)
    if new.state is State.HEALTHY and new.said_state is State.HEALTHY and new.restart_issued_at is not None:
        new = replace(new, restart_issued_at=None)
    if new.slow_said is not None:
        out.append(
            LogLine(
                Priority.INFO,
                f"replica {replica.name}: {new.slow_said}",
                Decision.NOTE,
                replica.name,
                replica.unit,
                state=new.state,
                rule=canary.CANARY_LATE.id,
            )
        )
    new = _start_loop(t, replica, old, new, out)
    _learned(t, replica, old, new, out)
    if canary_timeout_s is not None:
        out.append(StartCanary(replica.name, canary_timeout_s, t.now))
    return new


def _start_loop(t: Tick, replica: ReplicaConfig, old: Track, new: Track, out: list[Action]) -> Track:
    """NEW with this tick's look at its unit's starts folded in (core/startloop.py); a start loop (A6)
    said once at critical when it begins, once at info when it ends."""
    seen = t.obs.replicas[replica.name]
    found = t.obs.not_returned.get(replica.name)
    run = startloop.fold(old.start_run, seen.unit, new.state in SERVING_STATES, found)
    if run.looping and not old.start_run.looping:
        restart = seen.unit.restart if seen.unit is not None and seen.unit.restart else "no"
        loop = (
            f"Restart={restart} in {replica.unit} is the loop that remains: systemd starts it again after every "
            "failure, and nothing but an operator stops that"
            if restart != "no"
            else f"{replica.unit} has Restart=no: nothing starts it again but an operator"
        )
        out.append(
            LogLine(
                Priority.CRITICAL,
                f"replica {replica.name}: {run.failed} starts of {replica.unit} in a row ended without serving while "
                f"{gib(found or 0)} its processes held did not come back ({startfit.NOT_RETURNED.id}): guardian "
                f"causes no start of it any more ({admission.START_LOOP.id}); {loop} (a compose restart loop of "
                f"about 35 starts thrashed a GB10 until a physical reset); stop it (systemctl stop {replica.unit}) "
                f"until that memory is back (what holds it: a file in /dev/shm, the driver; a reboot frees it), "
                f"then systemctl start {replica.unit}",
                Decision.HAZARD,
                replica.name,
                replica.unit,
                rule=admission.START_LOOP.id,
                hazard=f"start-loop:{replica.name}",
            )
        )
    elif old.start_run.looping and not run.looping:
        why = "it served again" if run.failed == 0 else "the memory its processes held came back"
        out.append(
            LogLine(
                Priority.INFO,
                f"replica {replica.name}: its start loop is over ({why}): guardian may cause its starts again "
                f"({admission.START_LOOP.id})",
                Decision.NOTE,
                replica.name,
                replica.unit,
                rule=admission.START_LOOP.id,
                hazard=f"start-loop:{replica.name}",
            )
        )
    return replace(new, start_run=run)


def _record_canary_latencies(t: Tick, tracks: dict[str, Track]) -> RecordCanaryLatencies | None:
    """One action for all the replicas whose canary latencies changed this tick (a canary
    succeeded), none when nothing changed: the state file is written at most once a tick."""
    before = t.previous.tracks
    changed = tuple(
        (name, track.canary_latencies)
        for name, track in tracks.items()
        if track.canary_latencies != (before[name].canary_latencies if name in before else _kept(name, t.obs))
    )
    steps = tuple(
        (name, track.steps)
        for name, track in tracks.items()
        if track.steps != (before[name].steps if name in before else t.obs.persistent.step_seconds.get(name, ()))
    )
    return RecordCanaryLatencies(changed, steps) if changed or steps else None


def _kept(name: str, obs: TickObservation) -> tuple[float, ...]:
    """NAME's canary latencies as the state file kept them."""
    return obs.persistent.canary_latencies.get(name, ())[-canary.CANARY_LATENCIES_KEPT :]


def _new_track(name: str, obs: TickObservation, now: float, cap_s: float) -> Track:
    """A replica guardian has no track of yet (guardian started, or the replica was added by a
    reload) starts from the canary latencies the state file kept: with 3 or more, its learned
    deadline holds from its first canary, and it gets no learning canaries. Its steps are those
    kept, each at most CAP_S (W.max_step_s)."""
    steps = kept_steps(obs.persistent.step_seconds.get(name, ()), cap_s)
    return Track(state_since=now, canary_latencies=_kept(name, obs), steps=steps)


def _learned(t: Tick, replica: ReplicaConfig, old: Track, new: Track, out: list[Action]) -> None:
    """Said at info when a longer step is learned, with its source: how long the stall window (L13)
    and a stall canary (L14) now wait (at most W.max_step_s)."""
    wcfg = t.cfg.watchdog
    before = longest_step_s(old, t.now, wcfg.max_step_s) if old.observed else None
    after = longest_step_s(new, t.now, wcfg.max_step_s)
    if after is None or (before is not None and after <= before):
        return
    longest = max(s for s, _ in new.steps)
    source = "its prefill-time histogram" if old.observed else "the state file (learned before)"
    out.append(
        LogLine(
            Priority.INFO,
            f"replica {replica.name}: learned a step of up to {longest:g} s from {source}: with work queued and "
            f"nothing moving, the stall window ({liveness.STALL_WINDOW.id}) is now "
            f"{max(wcfg.stall_window_s, after):g} s and a stall canary ({liveness.STALL_CANARY.id}) waits {after:g} s "
            f"(a step's wait is at most watchdog.max_step_s, {wcfg.max_step_s:g} s)",
            Decision.NOTE,
            replica.name,
            replica.unit,
        )
    )


# A quiet journal (issue 35 item 6): a change between these verdicts is said only once it has held
# SAY_AFTER_S; one that returns within it (a /metrics answer late by a second, a /health timeout
# while counters advance) is in `guardian status` and the metrics, not in the journal. A change to
# or from any other verdict (starting, stopped, a hang that is restarted, an error) is said at once.
QUIET_STATES = frozenset({State.HEALTHY, State.BUSY, State.DEGRADED})
SAY_AFTER_S = 10.0


def _to_say(old: Track, new: Track, now: float) -> bool:
    """NEW's verdict is to be said now: the first, one the journal has not said, at once or once held."""
    if not old.observed or new.said_state is None:
        return True
    if new.state == new.said_state:
        return False
    quiet = new.state in QUIET_STATES and new.said_state in QUIET_STATES
    return not quiet or now - new.state_since >= SAY_AFTER_S


def _state_change(replica: ReplicaConfig, old: Track, new: Track, now: float) -> LogLine:
    """The line for a replica's new verdict (or its first), from the one the journal last said."""
    said = old.said_state if old.said_state is not None else old.state
    held = f", for {now - new.state_since:.0f} s" if new.state in QUIET_STATES and now > new.state_since else ""
    text = f"replica {replica.name}: {said} -> {new.state} ({new.evidence}{held})"
    if new.state is State.HEALTHY and old.restart_issued_at is not None:
        text += f"; serving again {now - old.restart_issued_at:.1f} s after guardian's restart"
    if new.state is State.WRONG_MODEL:
        text += "; not restarting: a wrong model is a wiring or cutover fault, fix the unit or the config"
    if new.state is State.PORT_TAKEN:
        text += "; not restarting: restarting the unit would not free its port, stop the other listener"
    priority = Priority.ERROR if new.state in (State.WRONG_MODEL, State.UNKNOWN, State.PORT_TAKEN) else Priority.INFO
    return LogLine(priority, text, Decision.STATE, replica.name, replica.unit, state=new.state, rule=new.rule)
