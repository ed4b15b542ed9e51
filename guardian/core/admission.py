"""Restart admission: may this replica's unit be restarted now? The one owner of that rule. Pure.

Every restart, whoever asks for it (the watchdog, the memory guard, an operator's
`guardian restart`), passes admission first: the rows of ROWS below (A1, A6, A2, A3: each its table row,
the predicate that says when it refuses and what it says then, over one _Asked; RULES, their
rules, is rendered into docs/rules.md), then the unit gates (core/gates.py, G1-G9). The first that
fails is the refusal. With ``dry_run = true`` an admitted
restart is logged as what would be done, and not issued.

An operator's `guardian restart NAME --wait D` waits through the refusals that pass by themselves
(A4; PASSING_RULES below is the one list of them, each with why it passes): core/tick.py keeps
such a request open (core/requests.py, and the A4 functions at the bottom of this module) and
asks again every tick until it is admitted or D is over. Every other
refusal is answered at once, with or without a wait.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..config import Config, ReplicaConfig, WatchdogConfig
from . import gates
from .actions import AnswerRequest, LogLine, RequestWaits
from .fit import startfit
from .observations import PersistentView, RestartRequest, TickObservation, gib
from .rules import Refusal, Row, Rule, Why, first_match
from .startloop import StartRun
from .vocab import LOADING_STATES, Decision, Gate, Priority
from .watchdog.track import Track
from .work import Tick


@dataclass(frozen=True)
class Budget:
    used: int
    limit: int
    last_at: float | None
    spent: bool
    retry_at: float | None  # when the oldest counted restart leaves the window


def budget(name: str, persistent: PersistentView, now: float, cfg: Config) -> Budget:
    watchdog = cfg.watchdog
    floor_ts = max(now - watchdog.restart_window_s, persistent.resumed_at.get(name, float("-inf")))
    counted = sorted(at for at in persistent.restarts.get(name, ()) if at > floor_ts)
    spent = len(counted) >= watchdog.restart_budget
    retry_at = counted[0] + watchdog.restart_window_s if counted else None
    return Budget(len(counted), watchdog.restart_budget, counted[-1] if counted else None, spent, retry_at)


@dataclass(frozen=True)
class _Asked:
    """What admission reads about a restart of replica NAME now."""

    name: str
    budget: Budget
    tracks: Mapping[str, Track]
    now: float
    watchdog: WatchdogConfig
    issued_this_tick: bool

    @property
    def since_last_restart_s(self) -> float:
        """Seconds since its last counted restart; infinite when there is none."""
        last_at = self.budget.last_at
        return self.now - last_at if last_at is not None else float("inf")

    @property
    def backoff_s(self) -> float:
        return self.watchdog.backoff_s * 2.0 ** (self.budget.used - 1)

    @property
    def others_loading(self) -> list[str]:
        """The other replicas on this box that are starting or have a restart in flight."""
        return sorted(
            name
            for name, track in self.tracks.items()
            if name != self.name and (track.restart_in_flight or track.state in LOADING_STATES)
        )


def _budget_spent(asked: _Asked) -> Why:
    spent = asked.budget
    when = f"in {spent.retry_at - asked.now:.0f} s" if spent.retry_at else "later"
    return Why(
        f"restart budget spent ({spent.used} restarts in {asked.watchdog.restart_window_s:.0f} s); giving up on it; "
        f"guardian acts again {when} or after `guardian resume {asked.name}`",
        priority=Priority.CRITICAL,
    )


def _one_at_a_time(asked: _Asked) -> Why:
    who = ", ".join(asked.others_loading) or "another replica"
    verb = "are" if len(asked.others_loading) > 1 else "is"
    return Why(
        f"{who} {verb} starting or being restarted; one restart at a time per box "
        "(replicas starting together race for memory)",
        episode=(who,),
    )


def _start_loop(asked: _Asked) -> Why:
    return start_loop_why(asked.tracks[asked.name].start_run)


def start_loop_why(run: StartRun) -> Why:
    """What A6 says of a replica in a start loop (RUN), for its refusals and `guardian status` and `check`."""
    left = gib(run.not_returned_bytes or 0)
    return Why(
        f"a start loop: its last {run.failed} starts ended without serving while {left} its processes held did not "
        f"come back ({startfit.NOT_RETURNED.id}); guardian causes no start of it",
        "stop its unit until that memory is back (a reboot frees what the driver holds); guardian acts on it again "
        "once it serves or the memory is back",
    )


ROWS: tuple[Row[_Asked, Why], ...] = (
    Row(
        Rule(
            "A1",
            Gate.BUDGET,
            "restarts of this replica in the last W.restart_window_s (and after its last "
            "`guardian resume`) >= W.restart_budget: guardian gives up on it (critical) until the oldest leaves "
            "the window",
        ),
        lambda a: a.budget.spent,
        _budget_spent,
    ),
    Row(
        START_LOOP := Rule(
            "A6",
            Gate.START_LOOP,
            "its last 3 starts (FAILED_STARTS_LOOP: invocations of its unit that ended, or were followed by "
            "another, without it serving; NRestarts counts those between two ticks) failed AND U8's finding for it "
            "stands (memory its processes held did not come back): every restart guardian would cause of it is "
            "refused (error), the start loop said once at critical when it begins, naming its unit's Restart= as "
            "the loop that remains, and at info when it ends (it served, or the memory came back)",
        ),
        lambda a: a.name in a.tracks and a.tracks[a.name].start_run.looping,
        _start_loop,
    ),
    Row(
        BACKOFF := Rule("A2", Gate.BACKOFF, "now - last restart < W.backoff_s x 2^(restarts in the window - 1)"),
        lambda a: a.since_last_restart_s < a.backoff_s,
        lambda a: Why(
            f"back-off: last restart {a.since_last_restart_s:.0f} s ago, next allowed {a.backoff_s:.0f} s after it",
            episode=(f"{a.budget.last_at!r}",),
        ),
    ),
    Row(
        ONE_AT_A_TIME := Rule(
            "A3",
            Gate.ONE_AT_A_TIME,
            "another replica on this box is loading (state starting) or has a restart in "
            "flight, or a restart was already issued this tick (replicas starting together race for memory)",
        ),
        lambda a: bool(a.others_loading) or a.issued_this_tick,
        _one_at_a_time,
    ),
)

# A4: the refusals an operator's `guardian restart --wait D` waits through, by rule id. Each ends
# without anyone acting; every refusal not here lasts until someone does (A1: the budget, until its
# window moves on or `guardian resume`; A6: a start loop, until it serves or its memory is back;
# G2-G5: the unit masked, not loaded, disabled or stopped on
# purpose; G7-G9: the port held by another, hidden, or a Conflicts= unit up) and is answered at once.
PASSING_RULES: frozenset[str] = frozenset(
    {
        BACKOFF.id,  # back-off: it ends at the time it names
        ONE_AT_A_TIME.id,  # one at a time: the other replica's load, restart or drain ends (its own grace bounds it)
        gates.NO_BUS.id,  # systemd could not be asked: the system bus answers again (guardian reconnects)
        gates.JOB_PENDING.id,  # a systemd job is pending for the unit: the job finishes
    }
)


@dataclass(frozen=True)
class _Waiting:
    """An operator's request, and the refusal it meets now (None: admitted, or its wait is over and
    the refusal was not asked), as WAIT_ROW reads them."""

    request: RestartRequest
    now: float
    refusal: Refusal | None


WAIT_ROW: Row[_Waiting, Refusal] = Row(
    WAIT_RULE := Rule(  # waits_through(), passing_refusal() and say_wait() below, and drain._requeue() act on it
        "A4",
        "waits",
        "an operator's `guardian restart NAME --wait D` is refused by a rule that passes by itself (A2 back-off, "
        "A3 one at a time or a drain in progress, G1 the system bus, G6 a job pending) or waits for a fleet slot "
        "(F3-F6) AND now < when it was asked + D: it stays open, said once per cause (info), and is asked again "
        "every tick; once now >= that, it is refused as it stands, after waiting D. Under a proxy, such a refusal "
        "when its drain is over marks the replica up again and the request waits again (drained anew once it may "
        "go). Any other refusal (A1, A6, G2-G5, G7-G9) is answered at once",
    ),
    lambda w: (
        w.request.wait_until is not None
        and not wait_over(w.request, w.now)
        and w.refusal is not None
        and passes_by_itself(w.refusal)
    ),
    lambda w: _passing(w.refusal),
)


def _passing(refusal: Refusal | None) -> Refusal:
    assert refusal is not None, "the row holds only for a refusal"
    return refusal


@dataclass(frozen=True)
class Withdrawing:
    """An operator's request not acted on yet, as WITHDRAW_ROW reads it."""

    request: RestartRequest
    now: float


def _withdrawn_why(a: Withdrawing) -> str:
    if a.request.asker_gone:
        assert a.request.asker is not None, "a command known gone was known"
        return f"the command that asked (pid {a.request.asker[0]}) is gone without withdrawing it"
    return f"the command that asked stopped waiting for its answer {a.now - (a.request.expires or 0.0):.0f} s ago"


# Asked of a request before any other rule (core/requests.py); its evidence is why it is withdrawn.
WITHDRAW_ROW: Row[Withdrawing, str] = Row(
    WITHDRAW_RULE := Rule(
        "A5",
        "withdrawn",
        "an operator's request not acted on yet whose command is gone (the process that asked, by its pid and "
        "start time, no longer runs: killed with SIGKILL, a machine lost; SIGINT, SIGTERM and SIGHUP make it "
        "withdraw the request itself) OR now >= its expiry (when the command stops waiting: asked + its --wait + "
        "the answer's margin): withdrawn, nothing done, said once (error). A restart already issued goes on",
    ),
    lambda a: a.request.asker_gone or (a.request.expires is not None and a.now >= a.request.expires),
    _withdrawn_why,
)
RULES = (*(row.rule for row in ROWS), WAIT_ROW.rule, WITHDRAW_ROW.rule)


def passes_by_itself(refusal: Refusal) -> bool:
    """A4: REFUSAL ends without anyone acting, so an operator's request with a wait waits through it."""
    return refusal.rule in PASSING_RULES


def admit(
    name: str,
    tracks: Mapping[str, Track],
    persistent: PersistentView,
    now: float,
    cfg: Config,
    issued_this_tick: bool = False,
) -> Refusal | None:
    """A1, A6, A2, A3 for replica NAME: the first that refuses, or None."""
    asked = _Asked(name, budget(name, persistent, now, cfg), tracks, now, cfg.watchdog, issued_this_tick)
    found = first_match(ROWS, asked)
    if found is None:
        return None
    rule, why = found
    gate = Gate(rule.outcome)
    return Refusal(gate, rule.id, why.reason, why.remedy, why.priority, key=(gate, *why.episode))


def refusal(
    name: str,
    tracks: Mapping[str, Track],
    obs: TickObservation,
    now: float,
    cfg: Config,
    issued_this_tick: bool = False,
) -> Refusal | None:
    """Admission (A1, A6, A2, A3), then the unit gates (G1-G9) on this tick's view of the unit."""
    found = admit(name, tracks, obs.persistent, now, cfg, issued_this_tick)
    if found is not None:
        return found
    seen = obs.replicas[name]
    return gates.unit_refusal(seen.unit, seen.port_owner, unit_error=seen.unit_error)


# --- A4: an operator's request that waits through a refusal that passes by itself ------------


def refused_answer(t: Tick, request: RestartRequest, refusal: Refusal, passing: bool) -> AnswerRequest:
    """The answer to a refused request; one that waited until its end for a refusal that passes by
    itself (PASSING) says so, and is told apart (waited_out: its own exit status)."""
    answer = f"refused ({refusal.gate}): {refusal.text}"
    over = passing and wait_over(request, t.now)
    if over:
        answer += f"; after waiting {t.now - request.at:.0f} s ({WAIT_RULE.id})"
    return AnswerRequest(request.id, request.replica, False, answer, waited_out=over)


def waits_through(t: Tick, replica: ReplicaConfig, request: RestartRequest) -> bool:
    """A4: True while REQUEST, asked with a wait that has not ended, is refused by a rule that passes
    by itself; each cause is said once per request, and shown to the waiting command (RequestWaits)."""
    refusal = passing_refusal(t, replica, request, t.planned_restarts_blocked)
    if refusal is None:
        return False
    say_wait(t, replica, request, refusal, Decision.REQUEST)
    return True


def passing_refusal(t: Tick, replica: ReplicaConfig, request: RestartRequest, busy: bool) -> Refusal | None:
    """A4: the refusal REQUEST waits through now (BUSY: another restart under way): one that passes
    by itself, while the wait it was asked with has not ended; None when it would not wait."""
    waiting = request.wait_until is not None and not wait_over(request, t.now)
    found = refusal(replica.name, t.tracks, t.obs, t.now, t.cfg, busy) if waiting else None
    matched = first_match((WAIT_ROW,), _Waiting(request, t.now, found))
    return matched[1] if matched is not None else None


def say_wait(t: Tick, replica: ReplicaConfig, request: RestartRequest, cause: Refusal, decision: Decision) -> None:
    """What REQUEST waits for (CAUSE), once per request and cause: a journal line, and the text the
    waiting command prints."""
    key = (cause.rule, *cause.key)
    if t.waits_said.get(request.id) == key:
        return
    t.waits_said[request.id] = key
    waits = f"{cause.text} ({cause.rule})"
    left = "" if request.wait_until is None else f"; up to {request.wait_until - t.now:.0f} s more ({WAIT_RULE.id})"
    text = f"replica {replica.name}: an operator's restart waits: {waits}{left}"
    # A fleet slot's wait is said at its own priority (etcd unreachable is an error), as before.
    priority = cause.priority if decision is Decision.FLEET else Priority.INFO
    state = t.tracks[replica.name].state
    rule = WAIT_RULE.id if decision is Decision.REQUEST else cause.rule
    t.say(LogLine(priority, text, decision, replica.name, replica.unit, state, cause.gate, rule))
    t.actions.append(RequestWaits(request.id, replica.name, waits))


def admitted(t: Tick, replica: ReplicaConfig) -> bool:
    """Admission (A1-A3, G1-G9) would let a planned restart of REPLICA through now."""
    busy = t.planned_restarts_blocked
    return refusal(replica.name, t.tracks, t.obs, t.now, t.cfg, busy) is None


def wait_over(request: RestartRequest, now: float) -> bool:
    """REQUEST was asked with a wait (`guardian restart --wait D`), and it has ended (A4)."""
    return request.wait_until is not None and now >= request.wait_until
