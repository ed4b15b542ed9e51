"""Draining through the proxy: every rule about a replica's place at the proxy lives here. Pure.

A replica of this box is up at the proxy (no entry) or marked down (a Drain entry):
- ``draining``: marked down for a planned restart; guardian waits for its queue to empty, then
  restarts it (gracefully, with a bounded stop);
- ``away``: marked down while it restarts (a planned restart after its drain, or an unplanned one
  because it hung), until it serves again.

The set of replicas marked down is state of the core (TickState.drains). The shell makes the
proxy match it after every tick (act/proxy.py: nginx's upstream file or the command hooks) and
reports what it applied (ProxyView); a drain waits for that report before it counts.

Rules: the rows of RULES below (D1-D11), rendered into the README. ``P`` = the [proxy] config.
"Another replica of the model serves" means: a replica of this box with the same model, healthy
or busy, and not marked down; or a `memory.peer_urls` peer that answered with the model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from ..config import Config
from .liveness import Track
from .observations import ProxyView, ReplicaObservation
from .rules import Rule
from .vocab import SERVING_STATES


class Phase(StrEnum):
    DRAINING = "draining"
    AWAY = "away"


@dataclass(frozen=True)
class Drain:
    phase: Phase
    since: float  # marked down (asked for) at
    why: str
    request_id: str | None = None  # the operator's request a planned drain serves
    confirmed_at: float | None = None  # the proxy reported it marked down (the drain timer starts)
    for_memory: bool = False  # the memory guard's lowering waits for it (M15), not an operator
    error_said: bool = False  # the proxy's refusal was logged (a memory drain waits for the proxy's retry)


RULES = (
    Rule(
        "D1",
        "draining",
        "a planned restart (`guardian restart`) passes admission AND the proxy is configured AND another "
        "replica of the model serves: the replica is marked down; no restart yet",
    ),
    Rule(
        "D2",
        "restart, not drained",
        "a planned restart passes admission AND the proxy is configured AND no other replica of the model "
        "serves: restarted at once and not marked down (its clients see errors, said at warning)",
    ),
    Rule(
        "D3",
        "drain abandoned",
        "draining for an operator AND the proxy reported that marking it down failed: marked up again, no "
        "restart, the request refused with the proxy's error (a memory guard's drain waits for the proxy's "
        "retry instead, said once)",
    ),
    Rule(
        "D4",
        "drain abandoned",
        "draining AND no other replica of the model serves any more: marked up again, no restart, the request refused",
    ),
    Rule(
        "D5",
        "restart (drained)",
        "draining AND the proxy confirmed it AND /metrics readable AND running + waiting == 0",
    ),
    Rule(
        "D6",
        "restart (drained)",
        "draining AND the proxy confirmed it AND now - confirmed >= P.drain_timeout_s (the line says how "
        "many requests were still running)",
    ),
    Rule(
        "D7",
        "memory drain: lowered, or given up",
        "a memory guard's drain (M15) that is drained (D5, D6): the memory guard lowers it on this tick (M16) "
        "and it is away; one the memory guard no longer asks for (the squeeze ended, it chose another): "
        "marked up again",
    ),
    Rule(
        "D8",
        "marked up",
        "draining AND the restart is refused when it comes to it (admission A1-A3, G1-G9): marked up "
        "again, the request answered with the refusal",
    ),
    Rule(
        "D9",
        "away",
        "a hung replica's restart is issued (L7, L8, L12, L13, L14), or a critical lowering's (not drained): "
        "marked down at once; a proxy that cannot be told never holds that restart up",
    ),
    Rule(
        "D10",
        "marked up",
        "away AND no restart by guardian in flight AND the replica is healthy or busy",
    ),
    Rule("D11", "forgotten", "the replica is no longer in the config: its server line goes with it"),
)


def others_serving(name: str, cfg: Config, tracks: dict[str, Track], drains: dict[str, Drain], peers: int) -> int:
    """How many other replicas of NAME's model serve: this box's, not marked down, and PEERS."""
    r = cfg.replica(name)
    if r is None:
        return 0
    local = sum(
        1
        for o in cfg.replicas
        if o.name != name
        and o.model == r.model
        and o.name in tracks
        and tracks[o.name].state in SERVING_STATES
        and o.name not in drains
    )
    return local + peers


def confirmed(d: Drain, name: str, proxy: ProxyView | None, now: float) -> Drain:
    """D: with the proxy's report folded in (the drain timer starts when the proxy has it down)."""
    if d.confirmed_at is None and proxy is not None and name in proxy.applied:
        return replace(d, confirmed_at=now)
    return d


def refused_by_proxy(d: Drain, name: str, proxy: ProxyView | None) -> str | None:
    """D3: the proxy's error when its last attempt to mark NAME down failed, else None."""
    if d.confirmed_at is not None or proxy is None or proxy.error is None:
        return None
    return proxy.error if name in proxy.failed and name not in proxy.applied else None


def drained(d: Drain, o: ReplicaObservation, now: float, cfg: Config) -> str | None:
    """D5 and D6: why the drain is over (the evidence for the restart line), or None."""
    if d.confirmed_at is None:
        return None
    s = o.metrics
    waited = now - d.confirmed_at
    if s is not None and s.queued == 0:
        return f"drained: no request left after {waited:.1f} s (D5)"
    if waited >= cfg.proxy.drain_timeout_s:
        left = "unknown (/metrics unreadable)" if s is None else f"{s.running:.0f} running, {s.waiting:.0f} waiting"
        return f"drain timeout: {cfg.proxy.drain_timeout_s:g} s passed with {left} (D6)"
    return None


def back(d: Drain, t: Track) -> bool:
    """D10: an away replica serves again."""
    return d.phase is Phase.AWAY and not t.restart_in_flight and t.state in SERVING_STATES
