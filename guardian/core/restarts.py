"""The one path of every restart the tick issues, the watchdog's and the operators' (core/tick.py
steps 2-4): admitted (core/admission.py, A1-A3 then G1-G9) then issued, or logged as a dry run; a
refusal said once per episode for the watchdog, every time for an operator. Step 3 is here: a
replica whose verdict asks for a restart (stalled, unresponsive, idle-dead) gets one if admitted,
at most one a tick. Pure.
"""

from __future__ import annotations

from dataclasses import replace

from ..config import ReplicaConfig
from . import admission, stopping
from .actions import HUNG_STOP_GRACE_S, LogLine, RestartUnit
from .memory import memguard
from .rules import Refusal
from .vocab import RESTART_STATES, Decision, Priority, RestartKind
from .watchdog.track import Track
from .work import RestartAsk, Tick


def restart(t: Tick, replica: ReplicaConfig, ask: RestartAsk, busy: bool) -> Refusal | None:
    """Admit (BUSY: another restart is under way), then issue, or log the dry run. A refusal is
    logged and returned."""
    track = t.tracks[replica.name]
    refusal = admission.refusal(replica.name, t.tracks, t.obs, t.now, t.cfg, busy)
    if refusal is not None:
        line = LogLine(
            refusal.priority,
            f"{ask.head}; restart of {replica.unit} refused: {refusal.text}",
            Decision.REFUSED,
            replica.name,
            replica.unit,
            state=track.state,
            gate=refusal.gate,
            rule=refusal.rule,
        )
        _say_once(t, replica, ask, refusal.key, line)
    elif t.cfg.dry_run:
        line = LogLine(
            Priority.WARNING,
            f"{ask.head}; DRY-RUN: would restart {replica.unit} now",
            Decision.DRY_RUN,
            replica.name,
            replica.unit,
            state=track.state,
            rule=track.rule,
        )
        _say_once(t, replica, ask, (Decision.DRY_RUN,), line)
    else:
        _issue(t, replica, ask)
    return refusal


def _say_once(t: Tick, replica: ReplicaConfig, ask: RestartAsk, key: tuple[str, ...], line: LogLine) -> None:
    """LINE: the watchdog's once per episode (KEY, kept in the track), an operator's every time."""
    track = t.tracks[replica.name]
    if ask.request_id is not None:
        t.say(line)
    elif track.last_notice != key:
        t.say(line)
        t.tracks[replica.name] = replace(track, last_notice=key)


def _issue(t: Tick, replica: ReplicaConfig, ask: RestartAsk) -> None:
    budget = admission.budget(replica.name, t.obs.persistent, t.now, t.cfg)
    # A hung engine will not shut down gracefully: vLLM's API server would wait on it until
    # systemd's TimeoutStopSec. Its processes are killed once its stop has run HUNG_STOP_GRACE_S.
    kill = ask.kind is RestartKind.HANG
    track = t.tracks[replica.name]
    seen = t.obs.replicas[replica.name]
    # Every planned stop is bounded, drained or not: a loaded vLLM's graceful stop took 196.5 s; one
    # whose vLLM lets its requests finish (--shutdown-timeout) is given that long first (T1).
    stop = None if kill else stopping.planned_stop(t.cfg, seen.declared)
    stop_timeout_s = stop.bound_s if stop is not None else None
    how, held = f", its processes killed if its stop lasts {HUNG_STOP_GRACE_S:g} s (hung)", ""
    if stop is not None:
        how, held = stop.bound_text, stop.held_text(seen.metrics if seen.metrics is not None else track.last_sample)
    rule = track.rule if kill else stopping.BOUND.id if stop is not None and stop.shutdown_s is not None else None
    said = LogLine(  # an action taken is always said: by the restart, once its re-check passes
        Priority.WARNING,
        f"{ask.head}; restarting {replica.unit}{how} (restart {budget.used + 1} of {budget.limit} in "
        f"{t.cfg.watchdog.restart_window_s:.0f} s){held}",
        Decision.RESTART,
        replica.name,
        replica.unit,
        state=track.state,
        rule=rule,
    )
    t.actions.append(
        RestartUnit(
            replica.name,
            replica.unit,
            ask.kind,
            ask.evidence,
            ask.request_id,
            kill_first=kill,
            stop_timeout_s=stop_timeout_s,
            said=said,
            may_lower=memguard.fraction_settled(t.mem, replica.name),
        )
    )
    t.tracks[replica.name] = replace(
        track,
        restart_in_flight=True,
        restart_issued_at=t.now,
        last_notice=(Decision.RESTART,) if ask.request_id is None else track.last_notice,
    )


def restart_unplanned(t: Tick, replica: ReplicaConfig) -> Track | None:
    """Step 3, for one replica: its verdict asks for a restart (stalled, unresponsive, idle-dead)
    and admission lets it through; the track it was restarted from, for the proxy's D10 (None: not
    restarted)."""
    track = t.tracks[replica.name]
    if track.state not in RESTART_STATES:
        return None
    ask = RestartAsk(
        RestartKind.HANG,
        f"replica {replica.name}: {track.state} ({track.evidence})",
        f"{track.state}: {track.evidence}",
    )
    restart(t, replica, ask, t.restart_under_way)
    return track if t.tracks[replica.name].restart_in_flight else None
