"""The box-level watchdog policy: tracks + observations + persistent view + now -> actions.

Pure. Each replica's verdict comes from liveness.step; this module decides what to do about
stalled, unresponsive and idle-dead replicas and which journal lines say so.

A restart is issued only when every check passes, in this order (the first failure is logged
once per episode at error priority, or critical for a spent budget, with its remedy):

  budget      restarts of this replica in the last W.restart_window_s (and after the last
              ``guardian resume``) < W.restart_budget; otherwise guardian gives up on it
  back-off    now - last restart >= W.backoff_s * 2 ** (restarts in window - 1)
  one-at-a-time
              no other replica on this box is starting or has a restart in flight, and at most
              one restart is issued per tick
  unit gates  gates.unit_refusal (loaded, not masked, enabled, active, port owner, Conflicts=)
  dry-run     with dry_run = true the restart is logged as what would be done, and not issued
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

from . import gates, liveness
from .config import Config
from .liveness import RESTART_STATES, Track
from .observations import PersistentView, ReplicaObservation


@dataclass(frozen=True)
class LogLine:
    priority: str  # info, warning, error, critical
    message: str
    replica: str | None = None
    unit: str | None = None
    fields: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class RestartUnit:
    replica: str
    unit: str
    state: str
    evidence: str


@dataclass(frozen=True)
class StartCanary:
    replica: str


Action = LogLine | RestartUnit | StartCanary


@dataclass(frozen=True)
class Budget:
    used: int
    limit: int
    last_at: float | None
    spent: bool
    retry_at: float | None  # when the oldest counted restart leaves the window


def budget(name: str, persistent: PersistentView, now: float, cfg: Config) -> Budget:
    w = cfg.watchdog
    floor_ts = max(now - w.restart_window_s, persistent.resumed_at.get(name, float("-inf")))
    counted = sorted(t for t in persistent.restarts.get(name, ()) if t > floor_ts)
    spent = len(counted) >= w.restart_budget
    retry_at = counted[0] + w.restart_window_s if counted else None
    return Budget(len(counted), w.restart_budget, counted[-1] if counted else None, spent, retry_at)


@dataclass
class _Decision:
    tracks: dict[str, Track] = field(default_factory=dict)
    actions: list[Action] = field(default_factory=list)

    def log(self, priority: str, message: str, replica: str | None = None, unit: str | None = None, **fields: str) -> None:
        self.actions.append(LogLine(priority, message, replica, unit, tuple(sorted(fields.items()))))


def decide(
    tracks: Mapping[str, Track],
    observations: Mapping[str, ReplicaObservation],
    persistent: PersistentView,
    now: float,
    cfg: Config,
) -> tuple[dict[str, Track], list[Action]]:
    d = _Decision()
    for r in cfg.replicas:
        old = tracks.get(r.name, Track(state_since=now))
        obs = observations[r.name]
        new, want_canary = liveness.step(old, obs, now, r, cfg.watchdog, persistent.pauses.get(r.name))
        if new.state not in RESTART_STATES:
            new = replace(new, last_notice=None)
        _log_transition(d, r.name, r.unit, old, new, now)
        new = _note_unreadable_metrics(d, r.name, r.unit, new, obs)
        if new.state == liveness.HEALTHY and new.restart_issued_at is not None:
            new = replace(new, restart_issued_at=None)
        if want_canary:
            d.actions.append(StartCanary(r.name))
        d.tracks[r.name] = new

    restart_issued = any(t.restart_in_flight for t in d.tracks.values())
    for r in cfg.replicas:
        t = d.tracks[r.name]
        if t.state not in RESTART_STATES:
            continue
        refusal = _refusal(r.name, d.tracks, observations[r.name], persistent, now, cfg, restart_issued)
        if refusal is not None:
            key, priority, text = refusal
            if t.last_notice != key:
                d.log(priority, f"replica {r.name}: {t.state} ({t.evidence}); restart of {r.unit} refused: {text}",
                      r.name, r.unit, GUARDIAN_DECISION="refused", GUARDIAN_GATE=key.split(":")[0])
                d.tracks[r.name] = replace(t, last_notice=key)
            continue
        if cfg.dry_run:
            if t.last_notice != "dry-run":
                d.log("warning", f"replica {r.name}: {t.state} ({t.evidence}); DRY-RUN: would restart {r.unit} now",
                      r.name, r.unit, GUARDIAN_DECISION="dry-run")
                d.tracks[r.name] = replace(t, last_notice="dry-run")
            continue
        b = budget(r.name, persistent, now, cfg)
        d.log("warning", f"replica {r.name}: {t.state} ({t.evidence}); restarting {r.unit} "
              f"(restart {b.used + 1} of {b.limit} in {cfg.watchdog.restart_window_s:.0f} s)",
              r.name, r.unit, GUARDIAN_DECISION="restart")
        d.actions.append(RestartUnit(r.name, r.unit, t.state, t.evidence))
        d.tracks[r.name] = replace(t, restart_in_flight=True, restart_issued_at=now, last_notice="restart")
        restart_issued = True
    return d.tracks, d.actions


def _refusal(name, tracks, obs, persistent, now, cfg, restart_issued) -> tuple[str, str, str] | None:
    blocker = restart_blocker(name, tracks, persistent, now, cfg, restart_issued)
    if blocker is not None:
        return blocker
    refusal = gates.unit_refusal(obs.unit, obs.port_owner)
    if refusal is not None:
        return (f"{refusal.gate}:{refusal.reason}", "error", refusal.text())
    return None


def restart_blocker(name, tracks, persistent, now, cfg, restart_issued=False) -> tuple[str, str, str] | None:
    """Budget, back-off, one-at-a-time: (key, priority, text), or None when a restart may go ahead.

    Shared with the memory guard, whose restarts spend the same budget."""
    w = cfg.watchdog
    b = budget(name, persistent, now, cfg)
    if b.spent:
        when = f"in {b.retry_at - now:.0f} s" if b.retry_at else "later"
        return ("budget", "critical",
                f"restart budget spent ({b.used} restarts in {w.restart_window_s:.0f} s); giving up on it; "
                f"guardian acts again {when} or after `guardian resume {name}`")
    if b.last_at is not None:
        wait_s = w.backoff_s * 2 ** (b.used - 1)
        if now - b.last_at < wait_s:
            return ("backoff", "error",
                    f"back-off: last restart {now - b.last_at:.0f} s ago, next allowed {wait_s:.0f} s after it")
    others = [n for n, o in tracks.items() if n != name and (o.restart_in_flight or o.state in liveness.STARTING_STATES)]
    if others or restart_issued:
        who = ", ".join(others) or "another replica"
        return (f"one-at-a-time:{who}", "error",
                f"{who} is starting or being restarted; one restart at a time per box (replicas starting together race for memory)")
    return None


def _note_unreadable_metrics(d: _Decision, name: str, unit: str, t: Track, obs: ReplicaObservation) -> Track:
    """Garbage on /metrics is bad input: say so once, and base no restart on it."""
    err = obs.metrics_probe.error if obs.metrics_probe.answered and obs.metrics is None else None
    if err != t.metrics_error:
        if err is not None:
            d.log("error", f"replica {name}: /metrics {err}; progress cannot be judged, so no stall or idle "
                  "verdict (and no restart) will be based on it until it reads again", name, unit)
        t = replace(t, metrics_error=err)
    return t


_TRANSITION_PRIORITY = {liveness.WRONG_MODEL: "error", liveness.UNKNOWN: "error"}


def _log_transition(d: _Decision, name: str, unit: str, old: Track, new: Track, now: float) -> None:
    if new.state == old.state and old.evidence != liveness.NO_OBSERVATION:
        return
    msg = f"replica {name}: {old.state} -> {new.state} ({new.evidence})"
    if new.state == liveness.HEALTHY and old.restart_issued_at is not None:
        msg += f"; serving again {now - old.restart_issued_at:.1f} s after guardian's restart"
    if new.state == liveness.WRONG_MODEL:
        msg += "; not restarting: a wrong model is a wiring or cutover fault, fix the unit or the config"
    d.log(_TRANSITION_PRIORITY.get(new.state, "info"), msg, name, unit, GUARDIAN_STATE=new.state)
