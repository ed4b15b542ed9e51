"""Restart admission: may this replica's unit be restarted now? The one owner of that rule. Pure.

Every restart, whoever asks for it (the watchdog, the memory guard, an operator's
`guardian restart`), passes admission first: the rows of RULES (A1-A3), then the unit gates
(core/gates.py, G1-G9). The first that fails is the refusal. With ``dry_run = true`` an admitted
restart is logged as what would be done, and not issued.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..config import Config
from . import gates
from .liveness import Track
from .observations import PersistentView, ReplicaObservation
from .rules import Refusal, Rule
from .vocab import LOADING_STATES, Gate, Priority

RULES = (
    Rule(
        "A1",
        Gate.BUDGET,
        "restarts of this replica in the last W.restart_window_s (and after its last "
        "`guardian resume`) >= W.restart_budget: guardian gives up on it (critical) until the oldest leaves the window",
    ),
    Rule("A2", Gate.BACKOFF, "now - last restart < W.backoff_s x 2^(restarts in the window - 1)"),
    Rule(
        "A3",
        Gate.ONE_AT_A_TIME,
        "another replica on this box is loading (state starting) or has a restart in "
        "flight, or a restart was already issued this tick (replicas starting together race for memory)",
    ),
)
_ID = {r.outcome: r.id for r in RULES}


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


def admit(
    name: str,
    tracks: Mapping[str, Track],
    persistent: PersistentView,
    now: float,
    cfg: Config,
    issued_this_tick: bool = False,
) -> Refusal | None:
    """A1-A3 for replica NAME: the first that refuses, or None."""
    w = cfg.watchdog
    b = budget(name, persistent, now, cfg)
    if b.spent:
        when = f"in {b.retry_at - now:.0f} s" if b.retry_at else "later"
        return Refusal(
            Gate.BUDGET,
            _ID[Gate.BUDGET],
            f"restart budget spent ({b.used} restarts in {w.restart_window_s:.0f} s); giving up on it; "
            f"guardian acts again {when} or after `guardian resume {name}`",
            priority=Priority.CRITICAL,
            key=(Gate.BUDGET,),
        )
    if b.last_at is not None:
        wait_s = w.backoff_s * 2 ** (b.used - 1)
        if now - b.last_at < wait_s:
            return Refusal(
                Gate.BACKOFF,
                _ID[Gate.BACKOFF],
                f"back-off: last restart {now - b.last_at:.0f} s ago, next allowed {wait_s:.0f} s after it",
                key=(Gate.BACKOFF, f"{b.last_at!r}"),
            )
    others = sorted(n for n, o in tracks.items() if n != name and (o.restart_in_flight or o.state in LOADING_STATES))
    if others or issued_this_tick:
        who = ", ".join(others) or "another replica"
        return Refusal(
            Gate.ONE_AT_A_TIME,
            _ID[Gate.ONE_AT_A_TIME],
            f"{who} is starting or being restarted; one restart at a time per box "
            "(replicas starting together race for memory)",
            key=(Gate.ONE_AT_A_TIME, who),
        )
    return None


def refusal(
    name: str,
    tracks: Mapping[str, Track],
    obs: ReplicaObservation,
    persistent: PersistentView,
    now: float,
    cfg: Config,
    issued_this_tick: bool = False,
) -> Refusal | None:
    """Admission (A1-A3), then the unit gates (G1-G9) on this tick's view of the unit."""
    found = admit(name, tracks, persistent, now, cfg, issued_this_tick)
    if found is not None:
        return found
    return gates.unit_refusal(obs.unit, obs.port_owner, unit_error=obs.unit_error)
