"""Step 4 of a tick: operators' restart requests (`guardian restart NAME`, recorded in the state
file). Each is acted on once: it waits for a fleet slot when [fleet] is set (core/fleet.py,
F2-F6), passes admission, then drains first when a proxy is configured (core/proxy/drain.py D1-D3); it
is answered, refused or done, exactly once. One asked with `--wait` waits through a refusal that
passes by itself (A4, core/admission.py). Pure.
"""

from __future__ import annotations

from ..config import ReplicaConfig
from . import admission, fleet, restarts
from .actions import AcquireSlot, AnswerRequest, LogLine
from .observations import RestartRequest
from .proxy import drain, draining
from .rules import Refusal, first_match
from .vocab import Decision, Priority, RestartKind
from .work import RestartAsk, Tick


def take_requests(t: Tick, requeued: frozenset[str] = frozenset()) -> None:
    """Each operator's request is acted on once: admitted and issued, or refused; and answered.
    REQUEUED: those whose drain ended into a refusal they wait through (step 2, A4): taken again."""
    asked = {request.id for request in t.obs.persistent.requests}
    taken = set(t.previous.requests_taken & asked) - requeued  # answered ones have left the file
    for request in t.obs.persistent.requests:
        if request.id not in taken and _take(t, request):
            taken.add(request.id)
    t.requests_taken = frozenset(taken)


def _take(t: Tick, request: RestartRequest) -> bool:
    """Act on REQUEST; False while it waits (for a fleet slot, or with `--wait` through a refusal
    that passes by itself, A4): it is asked again on the next tick."""
    replica = t.cfg.replica(request.replica)
    if replica is None:
        answer = f"no replica named {request.replica!r} in the config"
        t.actions.append(AnswerRequest(request.id, request.replica, False, answer))
        return True
    withdrawn = first_match((admission.WITHDRAW_ROW,), admission.Withdrawing(request, t.now))
    if withdrawn is not None:
        _withdraw(t, replica, request, withdrawn[1])
        return True
    head = f"replica {replica.name}: an operator asked for a restart (it is {t.tracks[replica.name].state})"
    slot = _fleet_wait(t, replica)
    if slot is not None:
        return _wait_for_fleet(t, replica, request, head, slot)
    if admission.waits_through(t, replica, request):
        return False
    # Without the proxy's report (no daemon runs: `guardian restart` decides alone) nobody would
    # finish a drain, so it is restarted at once.
    drain_first = t.cfg.proxy.enabled and t.obs.proxy is not None and not t.cfg.dry_run
    if drain_first and replica.name not in t.drains and admission.admitted(t, replica):
        rule, undrained = draining.plan(t, replica, request)
        if rule is drain.NO_PEER:
            return draining.wait_for_peer(t, replica, request, head, draining.no_peer(t, replica))
        if draining.start_drain(t, replica, request, head, undrained):
            return True
    ask = RestartAsk(RestartKind.OPERATOR, head, "requested by an operator", request.id)
    refusal = restarts.restart(t, replica, ask, t.planned_restarts_blocked)
    if refusal is not None:
        t.actions.append(admission.refused_answer(t, request, refusal, admission.passes_by_itself(refusal)))
    elif t.cfg.dry_run:
        t.actions.append(AnswerRequest(request.id, replica.name, True, f"DRY-RUN: would restart {replica.unit}"))
    return True


def _withdraw(t: Tick, replica: ReplicaConfig, request: RestartRequest, why: str) -> None:
    """A5: a request whose command is gone, or stopped waiting (WHY), is never acted on later."""
    t.say(
        LogLine(
            Priority.ERROR,
            f"replica {replica.name}: an operator's restart request (asked {t.now - request.at:.0f} s ago) "
            f"withdrawn, not acted on: {why} ({admission.WITHDRAW_RULE.id})",
            Decision.REQUEST,
            replica.name,
            replica.unit,
            rule=admission.WITHDRAW_RULE.id,
        )
    )
    t.actions.append(AnswerRequest(request.id, replica.name, False, f"withdrawn: {why}"))


def _fleet_wait(t: Tick, replica: ReplicaConfig) -> Refusal | None:
    """F2-F6 for an operator's request that admission would let through: why it waits for a fleet
    slot, or None (no fleet, a slot held, or refused on this box's own grounds: the restart path says so)."""
    if not t.cfg.fleet.enabled or t.cfg.dry_run or not admission.admitted(t, replica):
        return None
    return fleet.slot_refusal(replica.name, replica.model, t.obs.fleet, t.cfg, t.previous.slots_released)


def _wait_for_fleet(t: Tick, replica: ReplicaConfig, request: RestartRequest, head: str, slot: Refusal) -> bool:
    """The request waits for a fleet slot (asked for with F6), each reason said once; with `--wait`,
    until its end (A4), when it is refused (True: answered)."""
    if admission.wait_over(request, t.now):
        text = f"{head}; restart of {replica.unit} refused: {slot.text} ({slot.rule}), after waiting for a fleet slot"
        rule = admission.WAIT_RULE.id
        t.say(LogLine(slot.priority, text, Decision.REFUSED, replica.name, replica.unit, gate=slot.gate, rule=rule))
        t.actions.append(admission.refused_answer(t, request, slot, passing=True))
        return True
    if slot.rule == fleet.ASK_SLOT.id:
        t.actions.append(AcquireSlot(replica.name, replica.model))
    admission.say_wait(t, replica, request, slot, Decision.FLEET)
    return False
