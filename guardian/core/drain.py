"""Draining through the proxy: every rule about a replica's place at the proxy lives here. Pure.

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
(D11, D13-D16: an away replica marked up, or warmed first) are checked in order. The others are
steps of a procedure (a drain begun, followed, given up, a hung replica marked down), each enforced
by the function of this module its row names, at the bottom of this file; every line they say names
its Rule. ``P`` = the [proxy] config.
"Another replica of the model serves" means: a replica of this box with the same model that serves
(watchdog/judge.py serves(): healthy or busy, or degraded only by a late probe, within the last
SERVED_RECENTLY_S) and is not marked down; or a `memory.peer_urls` peer that answered with the model; or,
with [fleet], a replica of another box serving it in the fleet view.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from ..config import Config, ReplicaConfig
from . import admission, restarts, stopping
from .actions import AnswerRequest, LogLine, SetFraction, WarmUp
from .drainstate import Drain, Phase
from .observations import ProxyView, ReplicaObservation, RestartRequest, TickObservation, VllmSample, WarmupResult
from .rules import Refusal, Row, Rule, first_match
from .vocab import RESTART_STATES, SERVING_STATES, Decision, Gate, Priority, RestartKind
from .watchdog.judge import serves
from .watchdog.track import Track
from .work import RestartAsk, Tick


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
class _Plan:
    """A planned restart (an operator's) admitted, with a proxy configured, as D1-D3 read it."""

    undrained: str | None  # why it goes undrained on purpose: asked with --no-drain, or no peer configured
    serving: int  # other replicas of its model serving now (this box, M.peer_urls, the fleet)


# D1-D3: an admitted planned restart under a proxy; the first row that holds is its plan (each
# condition is whole). The evidence is D2's reason. Asked by core/requests.py through plan().
PLAN_ROWS: tuple[Row[_Plan, str | None], ...] = (
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

RULES = (
    *(row.rule for row in PLAN_ROWS),
    PROXY_FAILED := Rule(  # enforced by _follow_drain() (and _say_memory_drain_waits() for a memory drain)
        "D4",
        "drain abandoned",
        "draining for an operator AND the proxy reported that marking it down failed: marked up again, no "
        "restart, the request refused with the proxy's error (a memory guard's drain waits for the proxy's "
        "retry instead, said once)",
    ),
    NONE_LEFT := Rule(  # enforced by _follow_drain(), after D4
        "D5",
        "drain abandoned",
        "draining AND no other replica of the model serves any more: marked up again, no restart, the request refused",
    ),
    *(row.rule for row in DRAINED_ROWS),
    MEMORY_DRAIN := Rule(  # enforced by lowering_at_the_proxy() and mark_up_unasked() (core/memstep.py)
        "D8",
        "memory drain: lowered, or given up",
        "a memory guard's drain (M16) that is drained (D6, D7): the memory guard lowers it on this tick (M17) "
        "and it is away; one the memory guard no longer asks for (the squeeze ended, it chose another): "
        "marked up again",
    ),
    REFUSED_WHEN_DUE := Rule(  # enforced by _restart_drained(), after D6/D7 and A4 (_requeue())
        "D9",
        "marked up",
        "draining AND the restart is refused when it comes to it (admission A1-A3, G1-G9): marked up "
        "again, the request answered with the refusal",
    ),
    MARKED_DOWN := Rule(  # enforced by mark_down_hung() (step 3) and lowering_at_the_proxy()
        "D10",
        "away",
        "a hung replica's restart is issued (L8, L9, L13, L14, L15), or a critical lowering's (not drained): "
        "marked down at once; a proxy that cannot be told never holds that restart up",
    ),
    MARKED_UP := Rule(
        "D11",
        "marked up",
        "away AND no restart by guardian in flight AND the replica is healthy or busy (back) AND it has no "
        "R.warmup_file",
    ),
    # enforced by core/work.py Tick.__init__, which drops the drain
    FORGOTTEN := Rule("D12", "forgotten", "the replica is no longer in the config: its server line goes with it"),
    WARMING := Rule(
        "D13",
        "warming",
        "away AND back AND R.warmup_file AND not warming yet: its warm-up requests are sent (one token each, "
        "within R.warmup_timeout_s in all); still marked down",
    ),
    WARMED := Rule(
        "D14",
        "marked up (warm)",
        "warming AND its warm-up ended: marked up, said with how many of its requests were served in how long "
        "(at warning when some failed)",
    ),
    WARMUP_LATE := Rule(
        "D15",
        "marked up (warm-up past its bound)",
        "warming AND now - the warm-up's start >= R.warmup_timeout_s + WARMUP_MARGIN_S with no end reported: "
        "marked up anyway, said at warning",
    ),
    WARMUP_DROPPED := Rule(
        "D16",
        "warm-up dropped",
        "warming AND not back any more (it hung, or a restart of it is in flight): its warm-up is forgotten and it "
        "stays marked down; once back it is warmed afresh (D13)",
    ),
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


# --- the steps: a tick's drains (core/tick.py steps 2-4 and 6) -----------------------------------


def follow_drains(t: Tick) -> None:
    """Step 2: each replica marked down at the proxy (core/py D4-D9, D11)."""
    for replica in t.cfg.replicas:
        down = t.drains.get(replica.name)
        if down is None:
            continue
        if down.phase is Phase.AWAY:
            _mark_up_when_back(t, replica, down)
        elif t.tracks[replica.name].state not in RESTART_STATES:  # one that hung: step 3 restarts it (D10)
            _follow_drain(t, replica, down)


def _mark_up_when_back(t: Tick, replica: ReplicaConfig, down: Drain) -> None:
    """D11, D13-D16 (BACK_ROWS): marked up once back, its warm-up served first where it has one."""
    track = t.tracks[replica.name]
    warmup = t.obs.replicas[replica.name].warmup
    found = away_verdict(down, track, warmup, replica.warmup_file is not None, replica.warmup_timeout_s, t.now)
    if found is None:
        return
    rule, verdict = found
    if verdict is not Back.MARK_UP:  # still down: its warm-up sent (D13), or dropped (D16)
        warming = verdict is Back.WARM
        t.drains[replica.name] = replace(down, warm_from=t.now if warming else None)
        if warming:
            t.actions.append(WarmUp(replica.name, t.now, replica.warmup_timeout_s))
        what = (
            f"serving again ({track.evidence}); its warm-up requests ({replica.warmup_file}) are sent before it "
            "is marked up"
            if warming
            else f"stopped serving while it warmed ({track.evidence}); its warm-up is dropped, and sent again "
            "once it is back"
        )
        t.say(_back_line(t, replica, track, rule, Priority.INFO, what))
        return
    del t.drains[replica.name]
    priority, what = Priority.INFO, f"serving again ({track.evidence})"
    if rule is WARMED and warmup is not None:
        priority = Priority.WARNING if warmup.failed or warmup.error else Priority.INFO
        what = f"warm: {warmup.served} of {warmup.served + warmup.failed} warm-up requests served in "
        what += f"{warmup.took_s:.1f} s" + (f" ({warmup.error})" if warmup.error else "")
    elif rule is WARMUP_LATE:
        priority = Priority.WARNING
        what = f"its warm-up requests did not end within {replica.warmup_timeout_s:g} s"
    t.say(
        _back_line(
            t,
            replica,
            track,
            rule,
            priority,
            f"{what}; marked up at the proxy, which also clears its count of failed attempts",
        )
    )


def _back_line(t: Tick, replica: ReplicaConfig, track: Track, rule: Rule, priority: Priority, what: str) -> LogLine:
    return LogLine(
        priority,
        f"replica {replica.name}: {what} ({rule.id})",
        Decision.PROXY,
        replica.name,
        replica.unit,
        state=track.state,
        rule=rule.id,
    )


def _follow_drain(t: Tick, replica: ReplicaConfig, down: Drain) -> None:
    """A draining replica: wait, give the drain up (D4, D5), or restart it once drained (D6, D7,
    D9); one the memory guard waits for is its business once drained (D8)."""
    down = confirmed(down, replica.name, t.obs.proxy, t.now)
    t.drains[replica.name] = down
    error = refused_by_proxy(down, replica.name, t.obs.proxy)
    if error is not None and down.for_memory:
        _say_memory_drain_waits(t, replica, down, error)
        return
    if error is not None:
        _abandon(
            t,
            replica,
            down,
            PROXY_FAILED.id,
            f"marking it down at the proxy failed: {error}; fix the proxy (see `guardian check`) or "
            "P.drain_command, then ask again",
        )
        return
    peers = serving_peer_count(t.obs, t.cfg, replica.model)
    if others_serving(replica.name, t.cfg, t.tracks, t.drains, peers, t.now) == 0:
        none_left = f"no other replica of {replica.model} serves any more, so draining it would leave none"
        _abandon(t, replica, down, NONE_LEFT.id, none_left)
        return
    over = drained(down, t.obs.replicas[replica.name], t.now, t.cfg)
    if over is not None and not down.for_memory:
        _restart_drained(t, replica, down, over)


def _say_memory_drain_waits(t: Tick, replica: ReplicaConfig, down: Drain, error: str) -> None:
    """D4 for the memory guard's drain: it waits for the proxy's retry, said once."""
    if down.error_said:
        return
    t.say(
        LogLine(
            Priority.ERROR,
            f"replica {replica.name}: the memory guard's change of fraction waits: marking it down at the proxy "
            f"failed: {error}; the proxy is asked again every 30 s ({PROXY_FAILED.id})",
            Decision.REFUSED,
            replica.name,
            replica.unit,
            rule=PROXY_FAILED.id,
        )
    )
    t.drains[replica.name] = replace(down, error_said=True)


def _restart_drained(t: Tick, replica: ReplicaConfig, down: Drain, why: str) -> None:
    """D6, D7: the planned restart, with a bounded stop; refused when it comes to it: D9, unless
    its request waits through that refusal (A4): then it is marked up and waits as asked."""
    if _requeue(t, replica, down):
        return
    ask = RestartAsk(
        RestartKind.OPERATOR,
        f"replica {replica.name}: {why}",
        f"requested by an operator; {why}",
        down.request_id,
    )
    refusal = restarts.restart(t, replica, ask, t.restart_under_way)
    if refusal is not None:
        _abandon(t, replica, down, REFUSED_WHEN_DUE.id, f"refused ({refusal.gate}): {refusal.text}", already_said=True)
        return
    t.drains[replica.name] = Drain(
        Phase.AWAY, t.now, "planned restart after its drain", down.request_id, down.confirmed_at
    )
    t.restart_under_way = True  # a dry run's too, as the restart it stands for would be


def _requeue(t: Tick, replica: ReplicaConfig, down: Drain) -> bool:
    """A4 after a drain: the request asked with a wait that has not ended, refused now by a rule
    that passes by itself, is taken again this tick (take_requests), the replica marked up
    meanwhile: kept down, it would serve nobody for as long as the other restart takes."""
    request = next((q for q in t.obs.persistent.requests if q.id == down.request_id), None)
    refusal = admission.passing_refusal(t, replica, request, t.restart_under_way) if request else None
    if request is None or refusal is None:
        return False
    del t.drains[replica.name]
    t.requeued.add(request.id)
    text = (
        f"replica {replica.name}: drained, but its restart waits: {refusal.text} ({refusal.rule}); "
        f"marked up again at the proxy meanwhile, drained again once it may go ({admission.WAIT_RULE.id})"
    )
    t.say(LogLine(Priority.INFO, text, Decision.REQUEST, replica.name, replica.unit, rule=admission.WAIT_RULE.id))
    return True


def _abandon(t: Tick, replica: ReplicaConfig, down: Drain, rule: str, why: str, already_said: bool = False) -> None:
    """Give a drain up: marked up again, its operator's request refused; said unless ALREADY_SAID."""
    del t.drains[replica.name]
    what = "the memory guard's change of fraction" if down.for_memory else "planned restart"
    if not already_said:
        t.say(
            LogLine(
                Priority.ERROR,
                f"replica {replica.name}: {what} of {replica.unit} given up and the replica marked up again at "
                f"the proxy: {why} ({rule})",
                Decision.REFUSED,
                replica.name,
                replica.unit,
                rule=rule,
            )
        )
    if down.request_id is not None:
        t.actions.append(AnswerRequest(down.request_id, replica.name, False, f"refused ({rule}): {why}"))


def mark_down_hung(t: Tick, replica: ReplicaConfig, track: Track) -> None:
    """D10: marked down while it restarts; a drain it hung in ends here, its request answered."""
    down = t.drains.get(replica.name)
    if not t.cfg.proxy.enabled or (down is not None and down.phase is not Phase.DRAINING):
        return
    if down is not None and down.request_id is not None:
        t.actions.append(
            AnswerRequest(
                down.request_id,
                replica.name,
                True,
                f"it hung while draining ({track.state}): restarted as a hung replica",
            )
        )
    t.drains[replica.name] = Drain(
        Phase.AWAY, t.now, f"hung: {track.state}", confirmed_at=down.confirmed_at if down else None
    )
    if down is None:
        t.say(
            LogLine(
                Priority.WARNING,
                f"replica {replica.name}: marked down at the proxy while it restarts ({track.state}): no new "
                f"request goes to it until it serves again ({MARKED_DOWN.id})",
                Decision.PROXY,
                replica.name,
                replica.unit,
                rule=MARKED_DOWN.id,
            )
        )


def plan(t: Tick, replica: ReplicaConfig, request: RestartRequest) -> tuple[Rule, str | None]:
    """D1-D3 for an admitted planned restart under a proxy: its row, and D2's reason."""
    peers = serving_peer_count(t.obs, t.cfg, replica.model)
    serving = others_serving(replica.name, t.cfg, t.tracks, t.drains, peers, t.now)
    found = first_match(PLAN_ROWS, _Plan(_undrained_why(t, replica, request), serving))
    assert found is not None, "the rows cover every case"
    return found


def no_peer(t: Tick, replica: ReplicaConfig) -> Refusal:
    """D3's refusal: an admitted planned restart waits for another replica of its model to serve."""
    others = not_serving(replica.name, t.cfg, t.tracks, t.drains)
    return Refusal(
        Gate.NO_PEER,
        NO_PEER.id,
        f"no other replica of {replica.model} serves now ({others}), and draining it would leave none",
        "it is drained once one serves; `guardian restart --no-drain` restarts it at once, undrained",
        Priority.INFO,
        key=tuple(
            sorted(
                f"{o.name}:{t.tracks[o.name].state}"
                for o in t.cfg.replicas
                if o.name != replica.name and o.model == replica.model and o.name in t.tracks
            )
        ),
    )


def _undrained_why(t: Tick, replica: ReplicaConfig, request: RestartRequest) -> str | None:
    """D2: why REQUEST restarts REPLICA undrained on purpose, or None (it is drained, or waits: D1, D3)."""
    if request.no_drain:
        return "asked with --no-drain"
    if not peers_configured(replica.name, t.obs, t.cfg):
        return f"no other replica of {replica.model} is configured (on this box, at peer_urls or in the fleet)"
    return None


def wait_for_peer(t: Tick, replica: ReplicaConfig, request: RestartRequest, head: str, no_peer: Refusal) -> bool:
    """D3: the request waits for a serving peer while its `--wait` lasts, then (or at once without
    one) is refused; True once answered."""
    if request.wait_until is not None and not admission.wait_over(request, t.now):
        admission.say_wait(t, replica, request, no_peer, Decision.REQUEST)
        return False
    text = f"{head}; restart of {replica.unit} refused: {no_peer.text} ({NO_PEER.id})"
    t.say(
        LogLine(Priority.ERROR, text, Decision.REFUSED, replica.name, replica.unit, gate=no_peer.gate, rule=NO_PEER.id)
    )
    t.actions.append(admission.refused_answer(t, request, no_peer, passing=True))
    return True


def start_drain(t: Tick, replica: ReplicaConfig, request: RestartRequest, head: str, why: str | None) -> bool:
    """D1: mark REPLICA down at the proxy instead of restarting it now; True if so. D2 (WHY, its
    reason) says why not: asked with --no-drain, or no other replica of its model is configured."""
    request_id = request.id
    if why is not None:
        t.say(
            LogLine(
                Priority.WARNING,
                f"{head}; not drained: {why}, so it is restarted at once and its clients will see errors until "
                f"it serves again ({UNDRAINED.id})",
                Decision.PROXY,
                replica.name,
                replica.unit,
                rule=UNDRAINED.id,
            )
        )
        return False
    sample = t.obs.replicas[replica.name].metrics
    work = (
        "an unknown number of" if sample is None else f"{sample.running:.0f} running and {sample.waiting:.0f} waiting"
    )
    t.drains[replica.name] = Drain(Phase.DRAINING, t.now, "an operator's restart", request_id)
    t.say(
        LogLine(
            Priority.WARNING,
            f"{head}; draining first: marked down at the proxy, restarted once its {work} requests end or after "
            f"{t.cfg.proxy.drain_timeout_s:g} s ({DRAINING.id})",
            Decision.PROXY,
            replica.name,
            replica.unit,
            rule=DRAINING.id,
        )
    )
    return True


def lowering_at_the_proxy(t: Tick, lowering: SetFraction) -> SetFraction:
    """A lowering's restart: after its drain (D8) with a bounded stop; a critical one, not drained,
    is marked down as it restarts (D10). Its stop is bounded in every case, as a planned one."""
    if lowering.stop_timeout_s is None:  # as long as its vLLM lets its requests finish, where it does (T1)
        bound_s = stopping.planned_stop(t.cfg, t.obs.replicas[lowering.replica].declared).bound_s
        lowering = replace(lowering, stop_timeout_s=bound_s)
    if not t.cfg.proxy.enabled:
        return lowering
    name = lowering.replica
    down = t.drains.get(name)
    replica = t.cfg.replica(name)
    unit = replica.unit if replica is not None else None
    if down is not None and down.for_memory and down.phase is Phase.DRAINING:
        why = drained(down, t.obs.replicas[name], t.now, t.cfg) or "drained"
        t.drains[name] = replace(down, phase=Phase.AWAY, since=t.now)
        verb = "raises" if lowering.new > lowering.old else "lowers"
        text = f"replica {name}: {why}; the memory guard {verb} it now ({MEMORY_DRAIN.id})"
        t.say(LogLine(Priority.INFO, text, Decision.PROXY, name, unit, rule=MEMORY_DRAIN.id))
        return lowering
    if down is None:
        t.drains[name] = Drain(Phase.AWAY, t.now, "a critical lowering")
        text = f"replica {name}: marked down at the proxy while the memory guard restarts it ({MARKED_DOWN.id})"
        t.say(LogLine(Priority.WARNING, text, Decision.PROXY, name, unit, rule=MARKED_DOWN.id))
    return lowering


def mark_up_unasked(t: Tick, asked: set[str]) -> None:
    """D8: a drain the memory guard no longer asks for (the squeeze ended, it chose another)."""
    for replica in t.cfg.replicas:
        down = t.drains.get(replica.name)
        if down is None or not down.for_memory or down.phase is not Phase.DRAINING or replica.name in asked:
            continue
        del t.drains[replica.name]
        t.say(
            LogLine(
                Priority.INFO,
                f"replica {replica.name}: the memory guard no longer changes its fraction; marked up again at the "
                f"proxy ({MEMORY_DRAIN.id})",
                Decision.PROXY,
                replica.name,
                replica.unit,
                rule=MEMORY_DRAIN.id,
            )
        )
