"""A replica judged at one tick: `step()` folds the observation into its track (fold.py), takes the
first liveness row that holds (liveness.py, L1-L22) and asks for a canary when one is due
(canary.py); `serves()`, whether a replica serves now, is the one definition every family asks
("another replica serves"). Pure: no clock, no I/O, no sleeping.
"""

from __future__ import annotations

from dataclasses import replace

from ...config import ReplicaConfig, WatchdogConfig
from ..observations import Pause, ReplicaObservation
from ..rules import UNCHANGED, first_match
from ..vocab import SERVING_STATES, State
from .canary import schedule_canary
from .facts import Facts, Seen, port_taken_by
from .fold import carry_over, fold, not_its_answers
from .liveness import NO_NEWS_RULE, ROWS
from .track import Track


def step(
    track: Track,
    obs: ReplicaObservation,
    now: float,
    rcfg: ReplicaConfig,
    wcfg: WatchdogConfig,
    pause: Pause | None = None,
) -> tuple[Track, float | None]:
    """Fold one observation into the track. Returns (new track, the deadline of a canary to start, or None)."""
    track = replace(carry_over(track, obs, now), slow_said=None)
    if port_taken_by(obs.port_owner, rcfg) is not None:
        track, obs = not_its_answers(track, obs)
    track, seen = fold(track, obs, now, rcfg, wcfg)
    facts = Facts(track, obs, now, rcfg, wcfg, pause, seen)
    state, rule, evidence = _classify(facts)
    track, want_canary = schedule_canary(facts, state)
    if state != track.state:
        track = replace(track, state=state, state_since=now)
    if rule != NO_NEWS_RULE and _serving_now(state, seen, obs, rcfg):
        track = replace(track, served_at=now)
    return replace(track, rule=rule, evidence=evidence, observed=True), want_canary


def _classify(facts: Facts) -> tuple[State, str, str]:
    """The first row that holds: (the verdict, its rule's id, the evidence)."""
    found = first_match(ROWS, facts)
    assert found is not None, "the last row always holds"
    rule, evidence = found
    state = facts.track.state if rule.outcome == UNCHANGED else State(rule.outcome)
    return state, rule.id, evidence


# "Another replica serves" (issue 35 item 3), the one definition for every rule that asks it: the
# drain (D1-D5), the memory guard's peers (M14, the raise), the fleet's counts. A replica serves
# when, at its last tick with evidence, it was healthy or busy, or degraded only by a probe that
# was late or unreadable while /health answered 200 or its work progressed, or paused (not judged)
# while its /health answered 200 with its model listed; and that tick was
# at most SERVED_RECENTLY_S ago (a /health 200 counts however late it came: a late answer is an
# answer), with nothing since that says it stopped (a verdict other than
# healthy, busy or degraded, a restart in flight, a /health 503, a failed canary). A /metrics
# answer late by a second on a loaded box is not the end of serving.
SERVED_RECENTLY_S = 10.0
_MAY_SERVE = frozenset({State.HEALTHY, State.BUSY, State.DEGRADED, State.PAUSED})


def _serving_now(state: State, seen: Seen, obs: ReplicaObservation, rcfg: ReplicaConfig) -> bool:
    if state in SERVING_STATES:
        return True
    if state is State.PAUSED:  # not judged, but it may well serve: by its own answers
        return obs.health.ok and (obs.models is None or rcfg.model in obs.models)
    # (a 503 or a failed canary since is serves()'s to weigh, at the moment it is asked)
    return state is State.DEGRADED and (obs.health.ok or seen.progressed)


def serves(track: Track, now: float) -> bool:
    """TRACK's replica serves now, by the definition above."""
    return (
        track.state in _MAY_SERVE
        and not track.restart_in_flight
        and track.dead_503_since is None
        and track.canary_failures == 0
        and track.served_at is not None
        and now - track.served_at <= SERVED_RECENTLY_S
    )
