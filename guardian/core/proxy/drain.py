"""Draining through the proxy: every rule about a replica's place at the proxy lives here, and the
facts they read; the tick's steps that apply them are draining.py. Pure.

A replica of this box is up at the proxy (no entry) or marked down (a Drain entry):
- ``draining``: marked down for a planned restart; guardian waits for its queue to empty, then
  restarts it (gracefully, with a bounded stop);
- ``away``: marked down while it restarts (a planned restart after its drain, or an unplanned one
  because it hung), until it serves again, and, where it has warm-up requests (R.warmup_file),
  until they were served or their bound passed (its prefix cache then holds what its clients
  share when they come back).

The set of replicas marked down is state of the core (TickState.drains). Every tick ends with
SyncProxy(that set) when a proxy is configured, and the shell makes the proxy match it
(act/proxy.py: nginx's upstream file or the command hooks) and reports what it applied
(ProxyView); a drain waits for that report before it counts.

Rules: RULES below (D1-D16), rendered into docs/rules.md; PLAN_ROWS (D1-D3: an admitted planned
restart drained, restarted undrained, or waiting for a peer), DRAINED_ROWS (D6, D7) and BACK_ROWS
(D11, D13-D16: an away replica marked up, or warmed first) and FOLLOW_ROWS (D4, D5: a drain given
up) are checked in order. The others (D8-D10, D12) are rows asked alone at a step of the procedure
(a memory guard's drain, a restart refused when due, a replica marked down as it restarts, one gone
from the config); every line they say names its Rule. ``P`` = the [proxy] config.
"Another replica of the model serves" means: a replica of this box with the same model that serves
(watchdog/judge.py serves(): healthy or busy, or degraded only by a late probe, within the last
SERVED_RECENTLY_S) and is not marked down; or a `memory.peer_urls` peer that answered with the model; or,
with [fleet], a replica of another box serving it in the fleet view.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

from ...config import Config
from ..observations import ProxyView, ReplicaObservation, TickObservation, VllmSample, WarmupResult
from ..rules import Refusal, Row, Rule, first_match
from ..vocab import SERVING_STATES
from ..watchdog.judge import serves
from ..watchdog.track import Track
from .drainstate import Drain, Phase


@dataclass(frozen=True)
class _Waited:
    """A confirmed drain as D6 and D7 read it."""

    waited_s: float  # since the proxy confirmed it marked the replica down
    sample: VllmSample | None  # the replica's /metrics now; None: unreadable
    timeout_s: float  # P.drain_timeout_s

    @property
    def left(self) -> str:
        """The requests still running, as the D7 line says them."""
        if self.sample is None:
            return "unknown (/metrics unreadable)"
        return f"{self.sample.running:.0f} running, {self.sample.waiting:.0f} waiting"


# D6, D7: when a draining replica is drained; the evidence is the restart line's.
DRAINED_ROWS: tuple[Row[_Waited, str], ...] = (
    Row(
        Rule(
            "D6",
            "restart (drained)",
            "draining AND the proxy confirmed it AND /metrics readable AND running + waiting == 0",
        ),
        lambda w: w.sample is not None and w.sample.queued == 0,
        lambda w: f"drained: no request left after {w.waited_s:.1f} s (D6)",
    ),
    Row(
        Rule(
            "D7",
            "restart (drained)",
            "draining AND the proxy confirmed it AND now - confirmed >= P.drain_timeout_s (the line says how "
            "many requests were still running)",
        ),
        lambda w: w.waited_s >= w.timeout_s,
        lambda w: f"drain timeout: {w.timeout_s:g} s passed with {w.left} (D7)",
    ),
)


@dataclass(frozen=True)
class Plan:
    """A planned restart (an operator's) admitted, with a proxy configured, as D1-D3 read it."""

    undrained: str | None  # why it goes undrained on purpose: asked with --no-drain, or no peer configured
    serving: int  # other replicas of its model serving now (this box, M.peer_urls, the fleet)


# D1-D3: an admitted planned restart under a proxy; the first row that holds is its plan (each
# condition is whole). The evidence is D2's reason. Asked by core/requests.py through plan().
PLAN_ROWS: tuple[Row[Plan, str | None], ...] = (
    Row(
        DRAINING := Rule(
            "D1",
            "draining",
            "a planned restart (`guardian restart`) passes admission AND the proxy is configured AND another "
            "replica of the model serves: the replica is marked down; no restart yet",
        ),
        lambda p: p.undrained is None and p.serving > 0,
        lambda p: None,
    ),
    Row(
        UNDRAINED := Rule(
            "D2",
            "restart, not drained",
            "a planned restart passes admission AND the proxy is configured AND (it was asked with `--no-drain` OR "
            "no other replica of the model is configured at all: none on this box, no M.peer_urls, none of the "
            "model on another box of the fleet): restarted at once and not marked down (its clients see errors, "
            "said at warning); its stop is bounded as a drained one's (P.stop_timeout_s)",
        ),
        lambda p: p.undrained is not None,
        lambda p: p.undrained,
    ),
    Row(
        NO_PEER := Rule(
            "D3",
            "waits for a peer",
            "a planned restart passes admission AND the proxy is configured AND another replica of the model is "
            "configured AND none serves now: the request waits for one (A4: with `--wait D` until D is over, then "
            "refused; without, refused at once), said with who does not serve and why; never restarted undrained "
            "by accident",
        ),
        lambda p: p.undrained is None and p.serving <= 0,
        lambda p: None,
    ),
)


@dataclass(frozen=True)
class Following:
    """A draining replica as FOLLOW_ROWS read it (draining.py _follow_drain)."""

    error: str | None  # the proxy's error when its last attempt to mark it down failed (refused_by_proxy)
    serving: int  # other replicas of its model that serve now (others_serving)
    model: str


# A draining replica, first match, before its drain is judged over (D6, D7); the evidence is why
# it is given up. A memory guard's drain that D4 holds for waits instead (draining.py).
FOLLOW_ROWS: tuple[Row[Following, str], ...] = (
    Row(
        PROXY_FAILED := Rule(
            "D4",
            "drain abandoned",
            "draining for an operator AND the proxy reported that marking it down failed: marked up again, no "
            "restart, the request refused with the proxy's error (a memory guard's drain waits for the proxy's "
            "retry instead, said once)",
        ),
        lambda f: f.error is not None,
        lambda f: (
            f"marking it down at the proxy failed: {f.error}; fix the proxy (see `guardian check`) or "
            "P.drain_command, then ask again"
        ),
    ),
    Row(
        NONE_LEFT := Rule(
            "D5",
            "drain abandoned",
            "draining AND no other replica of the model serves any more: marked up again, no restart, the request "
            "refused",
        ),
        lambda f: f.serving == 0,
        lambda f: f"no other replica of {f.model} serves any more, so draining it would leave none",
    ),
)

# A memory guard's drain still draining (draining.py): once drained it is lowered on this tick
# (lowering_at_the_proxy), and one the memory guard no longer asks for is marked up (mark_up_unasked).
MEMORY_DRAIN_ROW: Row[Drain | None, None] = Row(
    MEMORY_DRAIN := Rule(
        "D8",
        "memory drain: lowered, or given up",
        "a memory guard's drain (M16) that is drained (D6, D7): the memory guard lowers it on this tick (M17) "
        "and it is away; one the memory guard no longer asks for (the squeeze ended, it chose another): "
        "marked up again",
    ),
    lambda d: d is not None and d.for_memory and d.phase is Phase.DRAINING,
    lambda d: None,
)

# The restart of a drained replica, when it comes to it (draining.py _restart_drained): its refusal.
REFUSED_WHEN_DUE_ROW: Row[Refusal | None, str] = Row(
    REFUSED_WHEN_DUE := Rule(
        "D9",
        "marked up",
        "draining AND the restart is refused when it comes to it (admission A1-A3, G1-G9): marked up "
        "again, the request answered with the refusal",
    ),
    lambda r: r is not None,
    lambda r: f"refused ({r.gate}): {r.text}" if r is not None else "",
)


@dataclass(frozen=True)
class Restarting:
    """A replica whose restart is issued unplanned, as MARKED_DOWN_ROW reads it."""

    proxy: bool  # a proxy is configured
    down: Drain | None  # its place at the proxy before
    hung: bool  # a hung replica's restart (else a critical lowering's, not drained)


MARKED_DOWN_ROW: Row[Restarting, None] = Row(
    MARKED_DOWN := Rule(
        "D10",
        "away",
        "a hung replica's restart is issued (L8, L9, L13, L14, L15), or a critical lowering's (not drained): "
        "marked down at once; a proxy that cannot be told never holds that restart up",
    ),
    # a hung replica that was draining is away from now on; a lowering's drain is D8's
    lambda r: r.proxy and (r.down is None or (r.hung and r.down.phase is Phase.DRAINING)),
    lambda r: None,
)

MARKED_UP = Rule(
    "D11",
    "marked up",
    "away AND no restart by guardian in flight AND the replica is healthy or busy (back) AND it has no R.warmup_file",
)


@dataclass(frozen=True)
class Configured:
    """A replica marked down at the proxy, and the config of this tick."""

    name: str
    cfg: Config


FORGOTTEN_ROW: Row[Configured, None] = Row(
    FORGOTTEN := Rule("D12", "forgotten", "the replica is no longer in the config: its server line goes with it"),
    lambda c: c.cfg.replica(c.name) is None,
    lambda c: None,
)
WARMING = Rule(
    "D13",
    "warming",
    "away AND back AND R.warmup_file AND not warming yet: its warm-up requests are sent (one token each, "
    "within R.warmup_timeout_s in all); still marked down",
)
WARMED = Rule(
    "D14",
    "marked up (warm)",
    "warming AND its warm-up ended: marked up, said with how many of its requests were served in how long "
    "(at warning when some failed)",
)
WARMUP_LATE = Rule(
    "D15",
    "marked up (warm-up past its bound)",
    "warming AND now - the warm-up's start >= R.warmup_timeout_s + WARMUP_MARGIN_S with no end reported: "
    "marked up anyway, said at warning",
)
WARMUP_DROPPED = Rule(
    "D16",
    "warm-up dropped",
    "warming AND not back any more (it hung, or a restart of it is in flight): its warm-up is forgotten and it "
    "stays marked down; once back it is warmed afresh (D13)",
)
WARMUP_MARGIN_S = 2.0  # past the warm-up's own bound: the tick that brings its result


class Back(StrEnum):
    """What an away replica's tick does (BACK_ROWS)."""

    MARK_UP = "mark up"
    WARM = "warm"
    FORGET = "forget the warm-up"


@dataclass(frozen=True)
class _Away:
    """An away replica as BACK_ROWS read it."""

    back: bool  # back(): no restart by guardian in flight, healthy or busy
    has_warmup: bool  # R.warmup_file
    warm_from: float | None
    ended: bool  # its warm-up's result came on this tick
    waited_s: float  # since its warm-up was sent (0: not warming)
    timeout_s: float  # R.warmup_timeout_s


# An away replica, first match; none: it stays marked down (not back yet, or warming). The table's
# order is not the ids': a warming replica is judged on its warm-up before anything else.
BACK_ROWS: tuple[Row[_Away, Back], ...] = (
    Row(WARMUP_DROPPED, lambda a: a.warm_from is not None and not a.back, lambda a: Back.FORGET),
    Row(WARMED, lambda a: a.warm_from is not None and a.ended, lambda a: Back.MARK_UP),
    Row(
        WARMUP_LATE,
        lambda a: a.warm_from is not None and a.waited_s >= a.timeout_s + WARMUP_MARGIN_S,
        lambda a: Back.MARK_UP,
    ),
    Row(WARMING, lambda a: a.back and a.has_warmup and a.warm_from is None, lambda a: Back.WARM),
    Row(MARKED_UP, lambda a: a.back and not a.has_warmup, lambda a: Back.MARK_UP),
)


RULES = (
    *(row.rule for row in PLAN_ROWS),
    *(row.rule for row in FOLLOW_ROWS),
    *(row.rule for row in DRAINED_ROWS),
    MEMORY_DRAIN_ROW.rule,
    REFUSED_WHEN_DUE_ROW.rule,
    MARKED_DOWN_ROW.rule,
    MARKED_UP,
    FORGOTTEN_ROW.rule,
    WARMING,
    WARMED,
    WARMUP_LATE,
    WARMUP_DROPPED,
)


def forget_unconfigured(drains: Mapping[str, Drain], cfg: Config) -> dict[str, Drain]:
    """DRAINS less those of replicas gone from the config (D12): the proxy's file loses their server lines."""
    return {name: down for name, down in drains.items() if not FORGOTTEN_ROW.holds(Configured(name, cfg))}


def away_verdict(
    down: Drain, track: Track, warmup: WarmupResult | None, has_warmup: bool, timeout_s: float, now: float
) -> tuple[Rule, Back] | None:
    """What an away replica's tick does: the first of BACK_ROWS that holds, or None (it waits).
    WARMUP: the warm-up result this tick brought, counted only if it is this drain's."""
    warming = down.warm_from
    away = _Away(
        back=back(down, track),
        has_warmup=has_warmup,
        warm_from=warming,
        ended=warmup is not None and warming is not None and warmup.started_at == warming,
        waited_s=now - warming if warming is not None else 0.0,
        timeout_s=timeout_s,
    )
    return first_match(BACK_ROWS, away)


def peers_configured(name: str, obs: TickObservation, cfg: Config) -> bool:
    """D2: some other replica of NAME's model could carry its load: another of this box's replicas
    of the model (whatever its state), M.peer_urls, or one of the model on another box of the fleet."""
    replica = cfg.replica(name)
    if replica is None:
        return False
    if any(o.name != name and o.model == replica.model for o in cfg.replicas):
        return True
    if cfg.memory.enabled and cfg.memory.peer_urls:
        return True
    view = obs.fleet
    return view is not None and any(m.model == replica.model and m.box != view.box for m in view.members)


def not_serving(name: str, cfg: Config, tracks: dict[str, Track], drains: dict[str, Drain]) -> str:
    """D3's evidence: the other replicas of NAME's model on this box and why each does not serve."""
    replica = cfg.replica(name)
    found = [
        f"{o.name} is {'marked down' if o.name in drains else tracks[o.name].state} ({tracks[o.name].evidence})"
        for o in cfg.replicas
        if replica is not None and o.name != name and o.model == replica.model and o.name in tracks
    ]
    return "; ".join(found) or "none on this box"


def serving_elsewhere(obs: TickObservation, cfg: Config) -> dict[str, tuple[str, ...]]:
    """Per model, the replicas serving on other boxes, from the fleet view (this box's own are
    judged by its own tracks)."""
    view = obs.fleet
    if view is None or not view.ok:
        return {}
    return {
        model: tuple(found for found in view.serving(model, "") if not found.startswith(f"{view.box}/"))
        for model in {r.model for r in cfg.replicas}
    }


def serving_peer_count(obs: TickObservation, cfg: Config, model: str) -> int:
    """Replicas of MODEL serving elsewhere: memory.peer_urls that answered with it, and other boxes
    in the fleet."""
    peers = len(obs.memory.peers_serving.get(model, ())) if obs.memory is not None else 0
    return peers + len(serving_elsewhere(obs, cfg).get(model, ()))


def others_serving(
    name: str, cfg: Config, tracks: dict[str, Track], drains: dict[str, Drain], peers: int, now: float
) -> int:
    """How many other replicas of NAME's model serve (judge.serves): this box's, not marked down, and PEERS."""
    replica = cfg.replica(name)
    if replica is None:
        return 0
    local = sum(
        1
        for o in cfg.replicas
        if o.name != name
        and o.model == replica.model
        and o.name in tracks
        and serves(tracks[o.name], now)
        and o.name not in drains
    )
    return local + peers


def confirmed(down: Drain, name: str, proxy: ProxyView | None, now: float) -> Drain:
    """DOWN with the proxy's report folded in (the drain timer starts when the proxy has it down)."""
    if down.confirmed_at is None and proxy is not None and name in proxy.applied:
        return replace(down, confirmed_at=now)
    return down


def refused_by_proxy(down: Drain, name: str, proxy: ProxyView | None) -> str | None:
    """D4: the proxy's error when its last attempt to mark NAME down failed, else None."""
    if down.confirmed_at is not None or proxy is None or proxy.error is None:
        return None
    return proxy.error if name in proxy.failed and name not in proxy.applied else None


def drained(down: Drain, observed: ReplicaObservation, now: float, cfg: Config) -> str | None:
    """D6 and D7: why the drain is over (the evidence for the restart line), or None."""
    if down.confirmed_at is None:
        return None
    found = first_match(DRAINED_ROWS, _Waited(now - down.confirmed_at, observed.metrics, cfg.proxy.drain_timeout_s))
    return found[1] if found is not None else None


def back(down: Drain, track: Track) -> bool:
    """D11: an away replica serves again."""
    return down.phase is Phase.AWAY and not track.restart_in_flight and track.state in SERVING_STATES
