"""The tick's drain steps (core/tick.py steps 2-4 and 6): each replica marked down at the proxy
followed (a drain waited for, given up or restarted once drained; an away replica warmed and
marked up), a hung replica marked down, an operator's planned restart drained first, a memory
guard's lowering at the proxy. The rules they enforce are drain.py's (D1-D16); every line they say
names its Rule. Pure.
"""

from __future__ import annotations

from dataclasses import replace

from ...config import ReplicaConfig
from .. import admission, restarts, stopping
from ..actions import AnswerRequest, LogLine, SetFraction, WarmUp
from ..observations import RestartRequest
from ..rules import Refusal, Rule, first_match
from ..vocab import RESTART_STATES, Decision, Gate, Priority, RestartKind
from ..watchdog.track import Track
from ..work import RestartAsk, Tick
from .drain import (
    DRAINING,
    FOLLOW_ROWS,
    MARKED_DOWN,
    MARKED_DOWN_ROW,
    MEMORY_DRAIN,
    MEMORY_DRAIN_ROW,
    NO_PEER,
    PLAN_ROWS,
    PROXY_FAILED,
    REFUSED_WHEN_DUE_ROW,
    UNDRAINED,
    WARMED,
    WARMUP_LATE,
    Back,
    Following,
    Plan,
    Restarting,
    away_verdict,
    confirmed,
    drained,
    not_serving,
    others_serving,
    peers_configured,
    refused_by_proxy,
    serving_peer_count,
)
from .drainstate import Drain, Phase


def follow_drains(t: Tick) -> frozenset[str]:
    """Step 2: each replica marked down at the proxy (drain.py D4-D9, D11). Returns the requests
    whose drain ended into a refusal they wait through (A4), for step 4 to take again."""
    requeued = set()
    for replica in t.cfg.replicas:
        down = t.drains.get(replica.name)
        if down is None:
            continue
        if down.phase is Phase.AWAY:
            _mark_up_when_back(t, replica, down)
        elif t.tracks[replica.name].state not in RESTART_STATES:  # one that hung: step 3 restarts it (D10)
            again = _follow_drain(t, replica, down)
            if again is not None:
                requeued.add(again)
    return frozenset(requeued)


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


def _follow_drain(t: Tick, replica: ReplicaConfig, down: Drain) -> str | None:
    """A draining replica: wait, give the drain up (D4, D5), or restart it once drained (D6, D7,
    D9); one the memory guard waits for is its business once drained (D8). Returns the request
    taken again (A4), if its restart waits."""
    down = confirmed(down, replica.name, t.obs.proxy, t.now)
    t.drains[replica.name] = down
    error = refused_by_proxy(down, replica.name, t.obs.proxy)
    peers = serving_peer_count(t.obs, t.cfg, replica.model)
    serving = others_serving(replica.name, t.cfg, t.tracks, t.drains, peers, t.now)
    found = first_match(FOLLOW_ROWS, Following(error, serving, replica.model))
    if found is not None:
        rule, why = found
        if rule is PROXY_FAILED and error is not None and down.for_memory:
            _say_memory_drain_waits(t, replica, down, error)
        else:
            _abandon(t, replica, down, rule.id, why)
        return None
    over = drained(down, t.obs.replicas[replica.name], t.now, t.cfg)
    if over is not None and not down.for_memory:
        return _restart_drained(t, replica, down, over)
    return None


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


def _restart_drained(t: Tick, replica: ReplicaConfig, down: Drain, why: str) -> str | None:
    """D6, D7: the planned restart, with a bounded stop; refused when it comes to it: D9, unless
    its request waits through that refusal (A4): then it is marked up and waits as asked."""
    again = _requeue(t, replica, down)
    if again is not None:
        return again
    ask = RestartAsk(
        RestartKind.OPERATOR,
        f"replica {replica.name}: {why}",
        f"requested by an operator; {why}",
        down.request_id,
    )
    refused = first_match((REFUSED_WHEN_DUE_ROW,), restarts.restart(t, replica, ask, t.restart_under_way))
    if refused is not None:
        rule, why = refused
        _abandon(t, replica, down, rule.id, why, already_said=True)
        return None
    t.drains[replica.name] = Drain(
        Phase.AWAY, t.now, "planned restart after its drain", down.request_id, down.confirmed_at
    )
    if t.cfg.dry_run:
        t.stood_for.add(replica.name)  # the restart a dry run stands for blocks the others as it would
    return None


def _requeue(t: Tick, replica: ReplicaConfig, down: Drain) -> str | None:
    """A4 after a drain: the request asked with a wait that has not ended, refused now by a rule
    that passes by itself, is taken again this tick (take_requests), the replica marked up
    meanwhile: kept down, it would serve nobody for as long as the other restart takes."""
    request = next((q for q in t.obs.persistent.requests if q.id == down.request_id), None)
    refusal = admission.passing_refusal(t, replica, request, t.restart_under_way) if request else None
    if request is None or refusal is None:
        return None
    del t.drains[replica.name]
    text = (
        f"replica {replica.name}: drained, but its restart waits: {refusal.text} ({refusal.rule}); "
        f"marked up again at the proxy meanwhile, drained again once it may go ({admission.WAIT_RULE.id})"
    )
    t.say(LogLine(Priority.INFO, text, Decision.REQUEST, replica.name, replica.unit, rule=admission.WAIT_RULE.id))
    return request.id


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
    if not MARKED_DOWN_ROW.holds(Restarting(t.cfg.proxy.enabled, down, hung=True)):
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
    found = first_match(PLAN_ROWS, Plan(_undrained_why(t, replica, request), serving))
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
        "requests end (how many is not known: its /metrics was not read)"
        if sample is None
        else f"{sample.running:.0f} running and {sample.waiting:.0f} waiting requests end"
    )
    t.drains[replica.name] = Drain(Phase.DRAINING, t.now, "an operator's restart", request_id)
    t.say(
        LogLine(
            Priority.WARNING,
            f"{head}; draining first: marked down at the proxy, restarted once its {work} or after "
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
    if MEMORY_DRAIN_ROW.holds(down):
        assert down is not None
        why = drained(down, t.obs.replicas[name], t.now, t.cfg) or "drained"
        t.drains[name] = replace(down, phase=Phase.AWAY, since=t.now)
        verb = "raises" if lowering.new > lowering.old else "lowers"
        text = f"replica {name}: {why}; the memory guard {verb} it now ({MEMORY_DRAIN.id})"
        t.say(LogLine(Priority.INFO, text, Decision.PROXY, name, unit, rule=MEMORY_DRAIN.id))
        return lowering
    if MARKED_DOWN_ROW.holds(Restarting(t.cfg.proxy.enabled, down, hung=False)):
        t.drains[name] = Drain(Phase.AWAY, t.now, "a critical lowering")
        text = f"replica {name}: marked down at the proxy while the memory guard restarts it ({MARKED_DOWN.id})"
        t.say(LogLine(Priority.WARNING, text, Decision.PROXY, name, unit, rule=MARKED_DOWN.id))
    return lowering


def mark_up_unasked(t: Tick, asked: set[str]) -> None:
    """D8: a drain the memory guard no longer asks for (the squeeze ended, it chose another)."""
    for replica in t.cfg.replicas:
        down = t.drains.get(replica.name)
        if not MEMORY_DRAIN_ROW.holds(down) or replica.name in asked:
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
