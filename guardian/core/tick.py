"""One tick's decision: ``decide(state, observation, now, cfg) -> (state, actions)``. Pure.

This is the whole of guardian's judgement; the daemon observes, calls this once, and performs
the actions. ``now`` is the tick's moment in monotonic seconds (CLOCK_MONOTONIC, a float): the
clock of every time in the observation and in the state (core/observations.py). The core never
reads a clock itself.

decide() makes a Tick, which holds what it was given and what it has decided so far, and runs
its steps in order:

1. judge_liveness: each replica's observation is folded into its track (core/liveness.py,
   L1-L18); state changes and unreadable /metrics are logged once; canaries are asked for;
   canary latencies that changed are recorded in the state file (one action a tick), where a
   track created later starts from them;
2. follow_drains (core/drain.py, D4-D9, D11, D12): a drained replica is restarted, a drain that
   cannot go on is abandoned, a replica back in service is marked up at the proxy;
3. restart_unplanned: a replica whose verdict asks for one (stalled, unresponsive, idle-dead) is
   restarted if admission allows (core/admission.py, A1-A3 then G1-G9), at most one per tick,
   and marked down at the proxy (D10);
4. take_requests: operators' restart requests (`guardian restart NAME`, recorded in the state
   file) wait for a fleet slot when [fleet] is set (core/fleet.py, F2-F6), pass the same
   admission, then drain first when a proxy is configured (D1, D2); each is answered, refused
   or done, exactly once; one asked with `--wait` waits through a refusal that passes by itself
   (A4: back-off, one at a time, a job pending), said once per cause, until its wait ends;
5. guard_starts: the start guard (core/startguard.py, S1-S10) watches each replica's start, and
   stops one that takes the box below the critical headroom, restarting it one step lower; that
   change becomes the memory guard's pending one, which step 6 follows (M3-M8);
6. guard_memory: the memory guard (its view built by core/memview.py, its verdict by
   core/memguard.py, M1-M26) sees the tracks and what admission would say; a change it starts
   marks that replica's restart in flight, as any other restart does; its drains are kept here
   (D8, D10);
7. release_fleet_slots: a fleet slot whose planned restart is over is given back (F7);
8. watch_bypass: clients that talk to a replica past the proxy are said (core/bypass.py, B1-B3);
9. sync_proxy: with a proxy configured, the last action is SyncProxy(the replicas marked down).

The coupling lives here and nowhere else: a restart under way (in flight, or issued in step 2, 3
or 4) blocks the others (one at a time per box), and a drain in progress blocks the planned ones
too (Tick.planned_restarts_blocked); a lowering's restart counts against the same budget and
back-off.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from ..config import Config, ReplicaConfig
from . import admission, bypass, drain, fleet, liveness, memguard, memview, startguard
from .actions import (
    HUNG_STOP_GRACE_S,
    AcquireSlot,
    Action,
    AnswerRequest,
    DrainReplica,
    LogLine,
    RecordCanaryLatencies,
    ReleaseSlot,
    RequestWaits,
    RestartUnit,
    SetFraction,
    StartCanary,
    SyncProxy,
    WarmUp,
)
from .drain import Drain, Phase
from .liveness import Track
from .observations import MemoryObservation, ReplicaMemoryObservation, RestartRequest, TickObservation
from .rules import Refusal, Rule
from .vocab import (
    LOADING_STATES,
    RESTART_STATES,
    SERVING_STATES,
    ActiveState,
    Decision,
    Gate,
    Priority,
    RestartKind,
    State,
)


@dataclass(frozen=True)
class TickState:
    """What one tick hands the next (the daemon keeps it in memory; the state file is the shell's)."""

    tracks: dict[str, Track] = field(default_factory=dict)
    mem: memguard.MemTrack = field(default_factory=memguard.MemTrack)
    requests_taken: frozenset[str] = frozenset()  # operators' requests acted on, answer not yet recorded
    drains: dict[str, Drain] = field(default_factory=dict)  # replicas marked down at the proxy (core/drain.py)
    # request id -> why it waits (a fleet slot, or a refusal that passes by itself: A4), as last said
    waits_said: dict[str, tuple[str, ...]] = field(default_factory=dict)
    slots_released: frozenset[str] = frozenset()  # fleet slots given back that the view may still show
    bypass_seen: dict[tuple[str, str], float] = field(default_factory=dict)  # (replica, peer) -> connected since
    bypassing: tuple[bypass.Bypass, ...] = ()  # clients bypassing the proxy now (core/bypass.py B2)
    starts: dict[str, startguard.Start] = field(default_factory=dict)  # starts the start guard watches (S1)

    @property
    def proxy_down(self) -> frozenset[str]:
        return frozenset(self.drains)


@dataclass(frozen=True)
class RestartAsk:
    """A restart to put through admission (Tick._restart)."""

    kind: RestartKind
    head: str  # how its journal lines start: "replica a: stalled (...)"
    evidence: str  # what the restart is recorded with
    request_id: str | None = None  # an operator's request: answered when the job ends, its refusals said every time


def decide(state: TickState, obs: TickObservation, now: float, cfg: Config) -> tuple[TickState, list[Action]]:
    tick = Tick(state, obs, now, cfg)
    tick.judge_liveness()
    tick.follow_drains()
    tick.restart_unplanned()
    tick.take_requests()
    tick.guard_starts()
    tick.guard_memory()
    tick.release_fleet_slots()
    tick.watch_bypass()
    tick.sync_proxy()
    return tick.next_state(), tick.actions


class Tick:
    """One tick's decision in the making: what it was given (the previous state, the observation,
    now, the config) and what it has decided so far (the next state's parts and the actions).
    decide() runs each step (a public method) once, in order, then takes next_state() and the
    actions; each step reads and adds to what is here."""

    def __init__(self, previous: TickState, obs: TickObservation, now: float, cfg: Config) -> None:
        self.previous = previous
        self.obs = obs
        self.now = now
        self.cfg = cfg
        self.actions: list[Action] = []
        # The next state's parts, as the steps make them.
        self.tracks: dict[str, Track] = {}
        # D12: a replica gone from the config leaves the proxy's file with its server line.
        self.drains = {name: down for name, down in previous.drains.items() if cfg.replica(name) is not None}
        self.mem = previous.mem
        self.requests_taken = previous.requests_taken
        asked = {request.id for request in obs.persistent.requests}
        self.waits_said = {rid: said for rid, said in previous.waits_said.items() if rid in asked}
        self.slots_released = previous.slots_released
        self.bypass_seen = previous.bypass_seen
        self.bypassing = previous.bypassing
        self.starts = previous.starts
        # A restart is under way on this box: in flight since an earlier tick, or issued on this
        # one. No other starts (A3).
        self.restart_under_way = False
        self.requeued: set[str] = set()  # requests whose drain ended into a refusal they wait through (A4)

    @property
    def planned_restarts_blocked(self) -> bool:
        """A planned restart (an operator's, a lowering's) waits: a restart is under way, or a
        drain is in progress."""
        return self.restart_under_way or any(down.phase is Phase.DRAINING for down in self.drains.values())

    def next_state(self) -> TickState:
        return TickState(
            self.tracks,
            self.mem,
            self.requests_taken,
            self.drains,
            self.waits_said,
            self.slots_released,
            self.bypass_seen,
            self.bypassing,
            self.starts,
        )

    def _say(self, line: LogLine) -> None:
        self.actions.append(line)

    # --- 1. liveness --------------------------------------------------------------------------

    def judge_liveness(self) -> None:
        """Step 1 (L1-L18): every replica's verdict, said when it changes; canaries asked for."""
        before = self.previous.tracks
        for replica in self.cfg.replicas:
            old = before[replica.name] if replica.name in before else _new_track(replica.name, self.obs, self.now)
            self._judge(replica, old)
        self._record_canary_latencies()
        self.restart_under_way = any(track.restart_in_flight for track in self.tracks.values())

    def _judge(self, replica: ReplicaConfig, old: Track) -> None:
        seen = self.obs.replicas[replica.name]
        pause = self.obs.persistent.pauses.get(replica.name)
        new, canary_timeout_s = liveness.step(old, seen, self.now, replica, self.cfg.watchdog, pause)
        if new.state not in RESTART_STATES:
            new = replace(new, last_notice=None)
        if _to_say(old, new, self.now):
            self._say(_state_change(replica, old, new, self.now))
            new = replace(new, said_state=new.state)
        # Garbage on /metrics is bad input: say so once, and base no restart on it.
        error = seen.metrics_probe.error if seen.metrics_probe.answered and seen.metrics is None else None
        if error != new.metrics_error:
            if error is not None:
                self._say(
                    LogLine(
                        Priority.ERROR,
                        f"replica {replica.name}: /metrics {error}; progress cannot be judged, so no "
                        "stall or idle verdict (and no restart) will be based on it until it reads again",
                        Decision.NOTE,
                        replica.name,
                        replica.unit,
                    )
                )
            new = replace(new, metrics_error=error)
        # once "serving again N s after guardian's restart" is said (a quiet journal may hold it back)
        if new.state is State.HEALTHY and new.said_state is State.HEALTHY and new.restart_issued_at is not None:
            new = replace(new, restart_issued_at=None)
        if new.slow_said is not None:
            self._say(
                LogLine(
                    Priority.INFO,
                    f"replica {replica.name}: {new.slow_said}",
                    Decision.NOTE,
                    replica.name,
                    replica.unit,
                    state=new.state,
                    rule="C2",
                )
            )
        if canary_timeout_s is not None:
            self.actions.append(StartCanary(replica.name, canary_timeout_s, self.now))
        self.tracks[replica.name] = new

    def _record_canary_latencies(self) -> None:
        """One action for all the replicas whose canary latencies changed this tick (a canary
        succeeded), none when nothing changed: the state file is written at most once a tick."""
        before = self.previous.tracks
        changed = tuple(
            (name, track.canary_latencies)
            for name, track in self.tracks.items()
            if track.canary_latencies != (before[name].canary_latencies if name in before else _kept(name, self.obs))
        )
        steps = tuple(
            (name, track.steps)
            for name, track in self.tracks.items()
            if track.steps != (before[name].steps if name in before else self.obs.persistent.step_seconds.get(name, ()))
        )
        if changed or steps:
            self.actions.append(RecordCanaryLatencies(changed, steps))

    # --- 2. drains in progress ----------------------------------------------------------------

    def follow_drains(self) -> None:
        """Step 2: each replica marked down at the proxy (core/drain.py D4-D9, D11)."""
        for replica in self.cfg.replicas:
            down = self.drains.get(replica.name)
            if down is None:
                continue
            if down.phase is Phase.AWAY:
                self._mark_up_when_back(replica, down)
            elif self.tracks[replica.name].state not in RESTART_STATES:  # one that hung: step 3 restarts it (D10)
                self._follow_drain(replica, down)

    def _mark_up_when_back(self, replica: ReplicaConfig, down: Drain) -> None:
        """D11, D13-D16 (drain.BACK_ROWS): marked up once back, its warm-up served first where it has one."""
        track = self.tracks[replica.name]
        warmup = self.obs.replicas[replica.name].warmup
        found = drain.away_verdict(
            down, track, warmup, replica.warmup_file is not None, replica.warmup_timeout_s, self.now
        )
        if found is None:
            return
        rule, verdict = found
        if verdict is not drain.Back.MARK_UP:  # still down: its warm-up sent (D13), or dropped (D16)
            warming = verdict is drain.Back.WARM
            self.drains[replica.name] = replace(down, warm_from=self.now if warming else None)
            if warming:
                self.actions.append(WarmUp(replica.name, self.now, replica.warmup_timeout_s))
            what = (
                f"serving again ({track.evidence}); its warm-up requests ({replica.warmup_file}) are sent before it "
                "is marked up"
                if warming
                else f"stopped serving while it warmed ({track.evidence}); its warm-up is dropped, and sent again "
                "once it is back"
            )
            self._say(self._back_line(replica, track, rule, Priority.INFO, what))
            return
        del self.drains[replica.name]
        priority, what = Priority.INFO, f"serving again ({track.evidence})"
        if rule is drain.WARMED and warmup is not None:
            priority = Priority.WARNING if warmup.failed or warmup.error else Priority.INFO
            what = f"warm: {warmup.served} of {warmup.served + warmup.failed} warm-up requests served in "
            what += f"{warmup.took_s:.1f} s" + (f" ({warmup.error})" if warmup.error else "")
        elif rule is drain.WARMUP_LATE:
            priority = Priority.WARNING
            what = f"its warm-up requests did not end within {replica.warmup_timeout_s:g} s"
        self._say(
            self._back_line(
                replica,
                track,
                rule,
                priority,
                f"{what}; marked up at the proxy, which also clears its count of failed attempts",
            )
        )

    def _back_line(self, replica: ReplicaConfig, track: Track, rule: Rule, priority: Priority, what: str) -> LogLine:
        return LogLine(
            priority,
            f"replica {replica.name}: {what} ({rule.id})",
            Decision.PROXY,
            replica.name,
            replica.unit,
            state=track.state,
            rule=rule.id,
        )

    def _follow_drain(self, replica: ReplicaConfig, down: Drain) -> None:
        """A draining replica: wait, give the drain up (D4, D5), or restart it once drained (D6, D7,
        D9); one the memory guard waits for is its business once drained (D8)."""
        down = drain.confirmed(down, replica.name, self.obs.proxy, self.now)
        self.drains[replica.name] = down
        error = drain.refused_by_proxy(down, replica.name, self.obs.proxy)
        if error is not None and down.for_memory:
            self._say_memory_drain_waits(replica, down, error)
            return
        if error is not None:
            self._abandon(
                replica,
                down,
                "D4",
                f"marking it down at the proxy failed: {error}; fix the proxy (see `guardian check`) or "
                "P.drain_command, then ask again",
            )
            return
        peers = drain.serving_peer_count(self.obs, self.cfg, replica.model)
        if drain.others_serving(replica.name, self.cfg, self.tracks, self.drains, peers, self.now) == 0:
            none_left = f"no other replica of {replica.model} serves any more, so draining it would leave none"
            self._abandon(replica, down, "D5", none_left)
            return
        over = drain.drained(down, self.obs.replicas[replica.name], self.now, self.cfg)
        if over is not None and not down.for_memory:
            self._restart_drained(replica, down, over)

    def _say_memory_drain_waits(self, replica: ReplicaConfig, down: Drain, error: str) -> None:
        """D4 for the memory guard's drain: it waits for the proxy's retry, said once."""
        if down.error_said:
            return
        self._say(
            LogLine(
                Priority.ERROR,
                f"replica {replica.name}: the memory guard's change of fraction waits: marking it down at the proxy "
                f"failed: {error}; the proxy is asked again every 30 s (D4)",
                Decision.REFUSED,
                replica.name,
                replica.unit,
                rule="D4",
            )
        )
        self.drains[replica.name] = replace(down, error_said=True)

    def _restart_drained(self, replica: ReplicaConfig, down: Drain, why: str) -> None:
        """D6, D7: the planned restart, with a bounded stop; refused when it comes to it: D9, unless
        its request waits through that refusal (A4): then it is marked up and waits as asked."""
        if self._requeue(replica, down):
            return
        ask = RestartAsk(
            RestartKind.OPERATOR,
            f"replica {replica.name}: {why}",
            f"requested by an operator; {why}",
            down.request_id,
        )
        refusal = self._restart(replica, ask, self.restart_under_way)
        if refusal is not None:
            self._abandon(replica, down, "D9", f"refused ({refusal.gate}): {refusal.text}", already_said=True)
            return
        self.drains[replica.name] = Drain(
            Phase.AWAY, self.now, "planned restart after its drain", down.request_id, down.confirmed_at
        )
        self.restart_under_way = True  # a dry run's too, as the restart it stands for would be

    def _requeue(self, replica: ReplicaConfig, down: Drain) -> bool:
        """A4 after a drain: the request asked with a wait that has not ended, refused now by a rule
        that passes by itself, is taken again this tick (take_requests), the replica marked up
        meanwhile: kept down, it would serve nobody for as long as the other restart takes."""
        request = next((q for q in self.obs.persistent.requests if q.id == down.request_id), None)
        refusal = self._passing_refusal(replica, request, self.restart_under_way) if request else None
        if request is None or refusal is None:
            return False
        del self.drains[replica.name]
        self.requeued.add(request.id)
        text = (
            f"replica {replica.name}: drained, but its restart waits: {refusal.text} ({refusal.rule}); "
            "marked up again at the proxy meanwhile, drained again once it may go (A4)"
        )
        self._say(LogLine(Priority.INFO, text, Decision.REQUEST, replica.name, replica.unit, rule="A4"))
        return True

    def _abandon(self, replica: ReplicaConfig, down: Drain, rule: str, why: str, already_said: bool = False) -> None:
        """Give a drain up: marked up again, its operator's request refused; said unless ALREADY_SAID."""
        del self.drains[replica.name]
        what = "the memory guard's change of fraction" if down.for_memory else "planned restart"
        if not already_said:
            self._say(
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
            self.actions.append(AnswerRequest(down.request_id, replica.name, False, f"refused ({rule}): {why}"))

    # --- restarts: one path for the watchdog's and the operators' -----------------------------

    def _restart(self, replica: ReplicaConfig, ask: RestartAsk, busy: bool) -> Refusal | None:
        """Admit (BUSY: another restart is under way), then issue, or log the dry run. A refusal is
        logged and returned."""
        track = self.tracks[replica.name]
        refusal = admission.refusal(replica.name, self.tracks, self.obs, self.now, self.cfg, busy)
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
            self._say_once(replica, ask, refusal.key, line)
        elif self.cfg.dry_run:
            line = LogLine(
                Priority.WARNING,
                f"{ask.head}; DRY-RUN: would restart {replica.unit} now",
                Decision.DRY_RUN,
                replica.name,
                replica.unit,
                state=track.state,
                rule=track.rule,
            )
            self._say_once(replica, ask, (Decision.DRY_RUN,), line)
        else:
            self._issue(replica, ask)
        return refusal

    def _say_once(self, replica: ReplicaConfig, ask: RestartAsk, key: tuple[str, ...], line: LogLine) -> None:
        """LINE: the watchdog's once per episode (KEY, kept in the track), an operator's every time."""
        track = self.tracks[replica.name]
        if ask.request_id is not None:
            self._say(line)
        elif track.last_notice != key:
            self._say(line)
            self.tracks[replica.name] = replace(track, last_notice=key)

    def _issue(self, replica: ReplicaConfig, ask: RestartAsk) -> None:
        budget = admission.budget(replica.name, self.obs.persistent, self.now, self.cfg)
        # A hung engine will not shut down gracefully: vLLM's API server would wait on it until
        # systemd's TimeoutStopSec. Its processes are killed once its stop has run HUNG_STOP_GRACE_S.
        kill = ask.kind is RestartKind.HANG
        # Every planned stop is bounded, drained or not: a loaded vLLM's graceful stop took 196.5 s.
        stop_timeout_s = None if kill else self.cfg.proxy.stop_timeout_s
        how = f", its processes killed if its stop lasts {HUNG_STOP_GRACE_S:g} s (hung)" if kill else ""
        if stop_timeout_s is not None:
            how = f", its processes killed if the stop takes over {stop_timeout_s:g} s"
        track = self.tracks[replica.name]
        said = LogLine(  # an action taken is always said: by the restart, once its re-check passes
            Priority.WARNING,
            f"{ask.head}; restarting {replica.unit}{how} (restart {budget.used + 1} of {budget.limit} in "
            f"{self.cfg.watchdog.restart_window_s:.0f} s)",
            Decision.RESTART,
            replica.name,
            replica.unit,
            state=track.state,
            rule=track.rule if kill else None,
        )
        self.actions.append(
            RestartUnit(
                replica.name,
                replica.unit,
                ask.kind,
                ask.evidence,
                ask.request_id,
                kill_first=kill,
                stop_timeout_s=stop_timeout_s,
                said=said,
                may_lower=memguard.fraction_settled(self.mem, replica.name),
            )
        )
        self.tracks[replica.name] = replace(
            track,
            restart_in_flight=True,
            restart_issued_at=self.now,
            last_notice=(Decision.RESTART,) if ask.request_id is None else track.last_notice,
        )

    # --- 3. unplanned restarts ----------------------------------------------------------------

    def restart_unplanned(self) -> None:
        """Step 3: a replica whose verdict asks for a restart gets one if admitted, and is marked
        down at the proxy (D10)."""
        for replica in self.cfg.replicas:
            track = self.tracks[replica.name]
            if track.state not in RESTART_STATES:
                continue
            ask = RestartAsk(
                RestartKind.HANG,
                f"replica {replica.name}: {track.state} ({track.evidence})",
                f"{track.state}: {track.evidence}",
            )
            self._restart(replica, ask, self.restart_under_way)
            if self.tracks[replica.name].restart_in_flight:
                self.restart_under_way = True
                self._mark_down_hung(replica, track)

    def _mark_down_hung(self, replica: ReplicaConfig, track: Track) -> None:
        """D10: marked down while it restarts; a drain it hung in ends here, its request answered."""
        down = self.drains.get(replica.name)
        if not self.cfg.proxy.enabled or (down is not None and down.phase is not Phase.DRAINING):
            return
        if down is not None and down.request_id is not None:
            self.actions.append(
                AnswerRequest(
                    down.request_id,
                    replica.name,
                    True,
                    f"it hung while draining ({track.state}): restarted as a hung replica",
                )
            )
        self.drains[replica.name] = Drain(
            Phase.AWAY, self.now, f"hung: {track.state}", confirmed_at=down.confirmed_at if down else None
        )
        if down is None:
            self._say(
                LogLine(
                    Priority.WARNING,
                    f"replica {replica.name}: marked down at the proxy while it restarts ({track.state}): no new "
                    "request goes to it until it serves again (D10)",
                    Decision.PROXY,
                    replica.name,
                    replica.unit,
                    rule="D10",
                )
            )

    # --- 4. operators' requests ---------------------------------------------------------------

    def take_requests(self) -> None:
        """Each operator's request is acted on once: admitted and issued, or refused; and answered."""
        asked = {request.id for request in self.obs.persistent.requests}
        taken = set(self.previous.requests_taken & asked) - self.requeued  # answered ones have left the file
        for request in self.obs.persistent.requests:
            if request.id not in taken and self._take(request):
                taken.add(request.id)
        self.requests_taken = frozenset(taken)

    def _take(self, request: RestartRequest) -> bool:
        """Act on REQUEST; False while it waits (for a fleet slot, or with `--wait` through a refusal
        that passes by itself, A4): it is asked again on the next tick."""
        replica = self.cfg.replica(request.replica)
        if replica is None:
            answer = f"no replica named {request.replica!r} in the config"
            self.actions.append(AnswerRequest(request.id, request.replica, False, answer))
            return True
        if request.asker_gone or (request.expires is not None and self.now >= request.expires):
            self._withdraw(replica, request)
            return True
        head = f"replica {replica.name}: an operator asked for a restart (it is {self.tracks[replica.name].state})"
        slot = self._fleet_wait(replica)
        if slot is not None:
            return self._wait_for_fleet(replica, request, head, slot)
        if self._waits_through(replica, request):
            return False
        # Without the proxy's report (no daemon runs: `guardian restart` decides alone) nobody would
        # finish a drain, so it is restarted at once.
        drain_first = self.cfg.proxy.enabled and self.obs.proxy is not None and not self.cfg.dry_run
        if drain_first and replica.name not in self.drains and self._admitted(replica):
            no_peer = self._no_peer(replica, request)
            if no_peer is not None:
                return self._wait_for_peer(replica, request, head, no_peer)
            if self._start_drain(replica, request, head):
                return True
        ask = RestartAsk(RestartKind.OPERATOR, head, "requested by an operator", request.id)
        refusal = self._restart(replica, ask, self.planned_restarts_blocked)
        if refusal is not None:
            self.actions.append(self._refused(request, refusal, admission.passes_by_itself(refusal)))
        elif self.cfg.dry_run:
            self.actions.append(AnswerRequest(request.id, replica.name, True, f"DRY-RUN: would restart {replica.unit}"))
        else:
            self.restart_under_way = True
        return True

    def _withdraw(self, replica: ReplicaConfig, request: RestartRequest) -> None:
        """A5: a request whose command is gone, or stopped waiting, is never acted on later."""
        if request.asker_gone:
            assert request.asker is not None
            why = f"the command that asked (pid {request.asker[0]}) is gone without withdrawing it"
        else:
            why = (
                f"the command that asked stopped waiting for its answer {self.now - (request.expires or 0.0):.0f} s ago"
            )
        self._say(
            LogLine(
                Priority.ERROR,
                f"replica {replica.name}: an operator's restart request (asked {self.now - request.at:.0f} s ago) "
                f"withdrawn, not acted on: {why} (A5)",
                Decision.REQUEST,
                replica.name,
                replica.unit,
                rule="A5",
            )
        )
        self.actions.append(AnswerRequest(request.id, replica.name, False, f"withdrawn: {why}"))

    def _refused(self, request: RestartRequest, refusal: Refusal, passing: bool) -> AnswerRequest:
        """The answer to a refused request; one that waited until its end for a refusal that passes by
        itself (PASSING) says so, and is told apart (waited_out: its own exit status)."""
        answer = f"refused ({refusal.gate}): {refusal.text}"
        over = passing and _wait_over(request, self.now)
        if over:
            answer += f"; after waiting {self.now - request.at:.0f} s (A4)"
        return AnswerRequest(request.id, request.replica, False, answer, waited_out=over)

    def _waits_through(self, replica: ReplicaConfig, request: RestartRequest) -> bool:
        """A4: True while REQUEST, asked with a wait that has not ended, is refused by a rule that passes
        by itself; each cause is said once per request, and shown to the waiting command (RequestWaits)."""
        refusal = self._passing_refusal(replica, request, self.planned_restarts_blocked)
        if refusal is None:
            return False
        self._say_wait(replica, request, refusal, Decision.REQUEST)
        return True

    def _passing_refusal(self, replica: ReplicaConfig, request: RestartRequest, busy: bool) -> Refusal | None:
        """A4: the refusal REQUEST waits through now (BUSY: another restart under way): one that passes
        by itself, while the wait it was asked with has not ended; None when it would not wait."""
        if request.wait_until is None or _wait_over(request, self.now):
            return None
        refusal = admission.refusal(replica.name, self.tracks, self.obs, self.now, self.cfg, busy)
        return refusal if refusal is not None and admission.passes_by_itself(refusal) else None

    def _say_wait(self, replica: ReplicaConfig, request: RestartRequest, cause: Refusal, decision: Decision) -> None:
        """What REQUEST waits for (CAUSE), once per request and cause: a journal line, and the text the
        waiting command prints."""
        key = (cause.rule, *cause.key)
        if self.waits_said.get(request.id) == key:
            return
        self.waits_said[request.id] = key
        waits = f"{cause.text} ({cause.rule})"
        left = "" if request.wait_until is None else f"; up to {request.wait_until - self.now:.0f} s more (A4)"
        text = f"replica {replica.name}: an operator's restart waits: {waits}{left}"
        # A fleet slot's wait is said at its own priority (etcd unreachable is an error), as before.
        priority = cause.priority if decision is Decision.FLEET else Priority.INFO
        state = self.tracks[replica.name].state
        rule = "A4" if decision is Decision.REQUEST else cause.rule
        self._say(LogLine(priority, text, decision, replica.name, replica.unit, state, cause.gate, rule))
        self.actions.append(RequestWaits(request.id, replica.name, waits))

    def _admitted(self, replica: ReplicaConfig) -> bool:
        """Admission (A1-A3, G1-G9) would let a planned restart of REPLICA through now."""
        busy = self.planned_restarts_blocked
        return admission.refusal(replica.name, self.tracks, self.obs, self.now, self.cfg, busy) is None

    def _fleet_wait(self, replica: ReplicaConfig) -> Refusal | None:
        """F2-F6 for an operator's request that admission would let through: why it waits for a fleet
        slot, or None (no fleet, a slot held, or refused on this box's own grounds: the restart path says so)."""
        if not self.cfg.fleet.enabled or self.cfg.dry_run or not self._admitted(replica):
            return None
        return fleet.slot_refusal(replica.name, replica.model, self.obs.fleet, self.cfg, self.slots_released)

    def _wait_for_fleet(self, replica: ReplicaConfig, request: RestartRequest, head: str, slot: Refusal) -> bool:
        """The request waits for a fleet slot (asked for with F6), each reason said once; with `--wait`,
        until its end (A4), when it is refused (True: answered)."""
        if _wait_over(request, self.now):
            text = (
                f"{head}; restart of {replica.unit} refused: {slot.text} ({slot.rule}), after waiting for a fleet slot"
            )
            self._say(
                LogLine(slot.priority, text, Decision.REFUSED, replica.name, replica.unit, gate=slot.gate, rule="A4")
            )
            self.actions.append(self._refused(request, slot, passing=True))
            return True
        if slot.rule == "F6":
            self.actions.append(AcquireSlot(replica.name, replica.model))
        self._say_wait(replica, request, slot, Decision.FLEET)
        return False

    def _no_peer(self, replica: ReplicaConfig, request: RestartRequest) -> Refusal | None:
        """D3: why an admitted planned restart waits for another replica of its model to serve, or None
        (one serves: D1; or it goes undrained on purpose: D2)."""
        if self._undrained_why(replica, request) is not None:
            return None
        peers = drain.serving_peer_count(self.obs, self.cfg, replica.model)
        if drain.others_serving(replica.name, self.cfg, self.tracks, self.drains, peers, self.now) > 0:
            return None
        others = drain.not_serving(replica.name, self.cfg, self.tracks, self.drains)
        return Refusal(
            Gate.NO_PEER,
            "D3",
            f"no other replica of {replica.model} serves now ({others}), and draining it would leave none",
            "it is drained once one serves; `guardian restart --no-drain` restarts it at once, undrained",
            Priority.INFO,
            key=tuple(
                sorted(
                    f"{o.name}:{self.tracks[o.name].state}"
                    for o in self.cfg.replicas
                    if o.name != replica.name and o.model == replica.model and o.name in self.tracks
                )
            ),
        )

    def _undrained_why(self, replica: ReplicaConfig, request: RestartRequest) -> str | None:
        """D2: why REQUEST restarts REPLICA undrained on purpose, or None (it is drained, or waits: D1, D3)."""
        if request.no_drain:
            return "asked with --no-drain"
        if not drain.peers_configured(replica.name, self.obs, self.cfg):
            return f"no other replica of {replica.model} is configured (on this box, at peer_urls or in the fleet)"
        return None

    def _wait_for_peer(self, replica: ReplicaConfig, request: RestartRequest, head: str, no_peer: Refusal) -> bool:
        """D3: the request waits for a serving peer while its `--wait` lasts, then (or at once without
        one) is refused; True once answered."""
        if request.wait_until is not None and not _wait_over(request, self.now):
            self._say_wait(replica, request, no_peer, Decision.REQUEST)
            return False
        text = f"{head}; restart of {replica.unit} refused: {no_peer.text} (D3)"
        self._say(
            LogLine(Priority.ERROR, text, Decision.REFUSED, replica.name, replica.unit, gate=no_peer.gate, rule="D3")
        )
        self.actions.append(self._refused(request, no_peer, passing=True))
        return True

    def _start_drain(self, replica: ReplicaConfig, request: RestartRequest, head: str) -> bool:
        """D1: mark REPLICA down at the proxy instead of restarting it now; True if so. D2 says why not:
        asked with --no-drain, or no other replica of its model is configured."""
        request_id = request.id
        why = self._undrained_why(replica, request)
        if why is not None:
            self._say(
                LogLine(
                    Priority.WARNING,
                    f"{head}; not drained: {why}, so it is restarted at once and its clients will see errors until "
                    f"it serves again (D2)",
                    Decision.PROXY,
                    replica.name,
                    replica.unit,
                    rule="D2",
                )
            )
            return False
        sample = self.obs.replicas[replica.name].metrics
        work = (
            "an unknown number of"
            if sample is None
            else f"{sample.running:.0f} running and {sample.waiting:.0f} waiting"
        )
        self.drains[replica.name] = Drain(Phase.DRAINING, self.now, "an operator's restart", request_id)
        self._say(
            LogLine(
                Priority.WARNING,
                f"{head}; draining first: marked down at the proxy, restarted once its {work} requests end or after "
                f"{self.cfg.proxy.drain_timeout_s:g} s (D1)",
                Decision.PROXY,
                replica.name,
                replica.unit,
                rule="D1",
            )
        )
        return True

    # --- 5. the start guard -------------------------------------------------------------------

    def guard_starts(self) -> None:
        """Step 5 (S1-S10): each replica's start is watched; one that takes the box below the critical
        headroom is stopped and restarted a step lower. That restart is the memory guard's pending
        change from now on (memguard.Pending), so that step 6 follows it as it follows a lowering (M3-M8)."""
        observed = self.obs.memory
        if observed is None or not self.cfg.memory.start_guard:  # off: nothing is watched
            self.starts = {}
            return
        view = self._start_view(observed)
        self.starts, actions = startguard.decide(self.previous.starts, view, self.now, self.cfg)
        for action in actions:
            if isinstance(action, SetFraction):
                self.mem = memguard.start_stopped(self.mem, action, self.now)
                self.restart_under_way = True
        self._take_memory_actions(actions)  # its restart in flight, marked down at the proxy (D10)

    def _start_view(self, observed: MemoryObservation) -> startguard.StartView:
        """The start guard's view: the memory guard's view of each replica, the tick's verdicts and
        units, and admission's budget (A1; S9)."""
        replicas = tuple(
            self._starting(mine, observed.replicas.get(mine.name))
            for mine in memview.memory_view(self, observed).replicas
        )
        sample = observed.sample
        return startguard.StartView(
            sample.available_bytes, observed.total_bytes, replicas, observed.consumers, self.mem.pending
        )

    def _starting(self, mine: memguard.ReplicaMemory, found: ReplicaMemoryObservation | None) -> startguard.Starting:
        """One replica as the start guard sees it: loading is S1's set."""
        track, seen = self.tracks[mine.name], self.obs.replicas[mine.name]
        unit = seen.unit
        active = unit is not None and unit.active_state in (ActiveState.ACTIVATING, ActiveState.ACTIVE)
        loading = track.state in LOADING_STATES and not track.restart_in_flight and active
        wiring = mine.wiring_problem
        if wiring is None and loading and found is not None:  # S5: an ExecStart= drop-in shows while it loads
            pending = self.previous.mem.pending
            wiring = startguard.overridden(
                mine.name, found.configured_fraction, found.cmdline_fraction, mine.started_at, pending
            )
        outcome = seen.restart_outcome
        return startguard.Starting(
            mine.name,
            mine.unit,
            loading,
            (unit.invocation_id, unit.inactive_exit_mono) if unit is not None else ("", None),
            mine.fraction,
            wiring,
            nvml_bytes=mine.usage_bytes,
            cgroup_bytes=found.cgroup_bytes if found is not None else None,
            refusal=self._budget_refusal(mine.name) if loading else None,
            ended=track.state in SERVING_STATES or not active,
            refused=outcome.result if outcome is not None and not outcome.issued else None,
            pid=(unit.main_pid or None) if unit is not None else None,
        )

    def _budget_refusal(self, name: str) -> Refusal | None:
        """S9: admission's budget (A1) for a stop of NAME's start. A2 (back-off) is not asked: guardian's
        own restart's start is in its back-off for the whole load; nor A3: the stop adds no start."""
        alone = {name: self.tracks[name]}  # its own restarts only
        refusal = admission.admit(name, alone, self.obs.persistent, self.now, self.cfg)
        return refusal if refusal is not None and refusal.gate is Gate.BUDGET else None

    # --- 6. the memory guard ------------------------------------------------------------------

    def guard_memory(self) -> None:
        """Step 6 (M1-M26): the memory guard's verdict on its view of the box, and its drains (D8, D10);
        a start the start guard stopped (step 5) is its pending change already."""
        observed = self.obs.memory
        if observed is None:  # the memory guard is off (a reload): its drains are not waited for
            self.drains = {
                name: down
                for name, down in self.drains.items()
                if not (down.for_memory and down.phase is Phase.DRAINING)
            }
            return
        view = memview.memory_view(self, observed)
        self.mem, actions = memguard.decide(self.mem, view, self.now, self.cfg)
        asked = self._take_memory_actions(actions)
        self._mark_up_unasked(asked)

    def _take_memory_actions(self, actions: Iterable[memguard.MemAction]) -> set[str]:
        """The memory guard's actions (and the start guard's), its drains kept here; returns the
        replicas it works on."""
        asked: set[str] = set()
        for action in actions:
            if isinstance(action, DrainReplica):  # consumed here, never by the executor
                asked.add(action.replica)
                if action.replica not in self.drains:
                    why = "the memory guard's change of fraction"
                    self.drains[action.replica] = Drain(Phase.DRAINING, self.now, why, for_memory=True)
                continue
            if isinstance(action, SetFraction) and action.restart and action.replica in self.tracks:
                asked.add(action.replica)
                # The watchdog keeps out of it, and no other restart starts, until the job is done.
                track = self.tracks[action.replica]
                self.tracks[action.replica] = replace(track, restart_in_flight=True, restart_issued_at=self.now)
                self.actions.append(self._lowering_at_the_proxy(action))
                continue
            self.actions.append(action)
        return asked

    def _lowering_at_the_proxy(self, lowering: SetFraction) -> SetFraction:
        """A lowering's restart: after its drain (D8) with a bounded stop; a critical one, not drained,
        is marked down as it restarts (D10). Its stop is bounded in every case, as a planned one."""
        if lowering.stop_timeout_s is None:
            lowering = replace(lowering, stop_timeout_s=self.cfg.proxy.stop_timeout_s)
        if not self.cfg.proxy.enabled:
            return lowering
        name = lowering.replica
        down = self.drains.get(name)
        replica = self.cfg.replica(name)
        unit = replica.unit if replica is not None else None
        if down is not None and down.for_memory and down.phase is Phase.DRAINING:
            why = drain.drained(down, self.obs.replicas[name], self.now, self.cfg) or "drained"
            self.drains[name] = replace(down, phase=Phase.AWAY, since=self.now)
            verb = "raises" if lowering.new > lowering.old else "lowers"
            text = f"replica {name}: {why}; the memory guard {verb} it now (D8)"
            self._say(LogLine(Priority.INFO, text, Decision.PROXY, name, unit, rule="D8"))
            return lowering
        if down is None:
            self.drains[name] = Drain(Phase.AWAY, self.now, "a critical lowering")
            text = f"replica {name}: marked down at the proxy while the memory guard restarts it (D10)"
            self._say(LogLine(Priority.WARNING, text, Decision.PROXY, name, unit, rule="D10"))
        return lowering

    def _mark_up_unasked(self, asked: set[str]) -> None:
        """D8: a drain the memory guard no longer asks for (the squeeze ended, it chose another)."""
        for replica in self.cfg.replicas:
            down = self.drains.get(replica.name)
            if down is None or not down.for_memory or down.phase is not Phase.DRAINING or replica.name in asked:
                continue
            del self.drains[replica.name]
            self._say(
                LogLine(
                    Priority.INFO,
                    f"replica {replica.name}: the memory guard no longer changes its fraction; marked up again at the "
                    "proxy (D8)",
                    Decision.PROXY,
                    replica.name,
                    replica.unit,
                    rule="D8",
                )
            )

    # --- 7. fleet slots -----------------------------------------------------------------------

    def release_fleet_slots(self) -> None:
        """F7: give back each slot of this box whose planned restart is over or given up. The
        slots given back that the view may still show (the release is under way) are not asked twice."""
        view = self.obs.fleet
        if view is None or not view.ok:
            return
        released = self.previous.slots_released & view.mine
        for name in sorted(view.mine - released):
            if self._slot_in_use(name):
                continue
            track = self.tracks.get(name)
            state = track.state if track is not None else "not configured"
            self.actions.append(ReleaseSlot(name))
            self._say(
                LogLine(
                    Priority.INFO,
                    f"replica {name}: its planned restart is over ({state}); fleet slot given back (F7)",
                    Decision.FLEET,
                    name,
                    rule="F7",
                )
            )
            released |= {name}
        self.slots_released = released

    def _slot_in_use(self, name: str) -> bool:
        """NAME's planned restart is not over: drained or away, asking for its slot, requested, being
        lowered, or restarting."""
        track = self.tracks.get(name)
        pending = self.mem.pending
        return (
            name in self.drains
            or any(isinstance(action, AcquireSlot) and action.replica == name for action in self.actions)
            or any(request.replica == name for request in self._requests_waiting())
            or (pending is not None and pending.replica == name)
            or (track is not None and (track.restart_in_flight or track.state in LOADING_STATES))
        )

    def _requests_waiting(self) -> list[RestartRequest]:
        """Operators' requests not acted on yet (waiting for a fleet slot)."""
        return [request for request in self.obs.persistent.requests if request.id not in self.requests_taken]

    # --- 8. clients that bypass the proxy -----------------------------------------------------

    def watch_bypass(self) -> None:
        """B1-B3: each client that starts bypassing the proxy is said once at warning, and once more
        when it has gone."""
        conns = {name: seen.conns for name, seen in self.obs.replicas.items()}
        before = self.previous.bypassing
        self.bypass_seen, found = bypass.update(self.previous.bypass_seen, before, conns, self.now, self.cfg)
        self.bypassing = tuple(found)
        for client in found:
            if (client.replica, client.peer) not in {(b.replica, b.peer) for b in before}:
                hazard = client.hazard(self.cfg, self.now)
                self._say(
                    LogLine(
                        Priority.WARNING,
                        f"hazard: {hazard.message}",
                        Decision.HAZARD,
                        hazard.replica,
                        hazard.unit,
                        rule="B2",
                        hazard=hazard.key,
                    )
                )
        for client in before:
            if (client.replica, client.peer) not in {(f.replica, f.peer) for f in found}:
                self._say_bypass_gone(client)

    def _say_bypass_gone(self, client: bypass.Bypass) -> None:
        replica = self.cfg.replica(client.replica)
        self._say(
            LogLine(
                Priority.INFO,
                f"replica {client.replica}: {client.peer} no longer talks to it directly",
                Decision.HAZARD,
                client.replica,
                replica.unit if replica is not None else None,
                rule="B2",
                hazard=f"bypass:{client.replica}:{client.peer}",
            )
        )

    # --- 9. the proxy -------------------------------------------------------------------------

    def sync_proxy(self) -> None:
        """The whole set marked down, every tick: the shell applies only a change, and retries a failed one."""
        if self.cfg.proxy.enabled:
            self.actions.append(SyncProxy(frozenset(self.drains)))


def next_tick_at(state: TickState, last_started: float, now: float, cfg: Config) -> float:
    """When the next tick starts: INTERVAL_S after the last one started, or earlier so that its
    judgment lands on a replica's deadline (liveness.next_deadline). A tick judges once its probes
    are in, up to cfg.probe_wait_s after it starts, so it starts that much before the deadline; if
    that moment has passed (this tick judged just short of it), it starts at the deadline itself.
    At most two extra ticks per deadline; never one in the past.

    While the start guard watches a start (watching_starts), ticks come every
    memory.start_guard_interval_s instead (never slower than interval_s): headroom may fall by at
    most critical_headroom_bytes between two looks before the box is out of memory."""
    at = last_started + _interval_s(state, cfg)
    for track in state.tracks.values():
        deadline = liveness.next_deadline(track, cfg.watchdog, after=now)
        if deadline is None:
            continue
        early = deadline - cfg.probe_wait_s
        at = min(at, early if early > now else deadline)
    return at


PROBE_WAIT_FLOOR_S = 0.05  # a healthy replica answers within it


def probe_wait_s(state: TickState, now: float, cfg: Config) -> float:
    """How long this tick waits for its probes: cfg.probe_wait_s, but not past a replica's
    deadline (liveness.next_deadline), so that the verdict is given at it rather than a whole
    wait later; at least PROBE_WAIT_FLOOR_S, for the replicas that do answer. While a start is
    watched, at most half the start guard's interval: a probe still out is carried to the next tick."""
    wait = min(cfg.probe_wait_s, _interval_s(state, cfg) / 2)
    for track in state.tracks.values():
        # one already past must not shorten every tick; one due now gets the floor
        deadline = liveness.next_deadline(track, cfg.watchdog, after=now - 1e-6)
        if deadline is not None:
            wait = min(wait, max(deadline - now, PROBE_WAIT_FLOOR_S))
    return wait


def watching_starts(state: TickState, cfg: Config) -> bool:
    """The start guard is on and watches a start it has not stopped (S1's set: its unit activating or
    active within its grace, no restart job in flight): each tick is its look. Not a unit deactivating,
    a restart in flight or a crash loop between its starts, though liveness calls them starting."""
    memory = cfg.memory
    return memory.enabled and memory.start_guard and any(not s.stopped for s in state.starts.values())


def _interval_s(state: TickState, cfg: Config) -> float:
    """How often ticks start now: interval_s, or memory.start_guard_interval_s while a start is
    watched (whichever is shorter: the start guard never slows the watchdog down)."""
    if watching_starts(state, cfg):
        return min(cfg.interval_s, cfg.memory.start_guard_interval_s)
    return cfg.interval_s


def _wait_over(request: RestartRequest, now: float) -> bool:
    """REQUEST was asked with a wait (`guardian restart --wait D`), and it has ended (A4)."""
    return request.wait_until is not None and now >= request.wait_until


def _kept(name: str, obs: TickObservation) -> tuple[float, ...]:
    """NAME's canary latencies as the state file kept them."""
    return obs.persistent.canary_latencies.get(name, ())[-liveness.CANARY_LATENCIES_KEPT :]


def _new_track(name: str, obs: TickObservation, now: float) -> Track:
    """A replica guardian has no track of yet (guardian started, or the replica was added by a
    reload) starts from the canary latencies the state file kept: with 3 or more, its learned
    deadline holds from its first canary, and it gets no learning canaries."""
    steps = obs.persistent.step_seconds.get(name, ())[: liveness.STEPS_KEPT]
    return Track(state_since=now, canary_latencies=_kept(name, obs), steps=steps)


# A quiet journal (issue 35 item 6): a change between these verdicts is said only once it has held
# SAY_AFTER_S; one that returns within it (a /metrics answer late by a second, a /health timeout
# while counters advance) is in `guardian status` and the metrics, not in the journal. A change to
# or from any other verdict (starting, stopped, a hang that is restarted, an error) is said at once.
QUIET_STATES = frozenset({State.HEALTHY, State.BUSY, State.DEGRADED})
SAY_AFTER_S = 10.0


def _to_say(old: Track, new: Track, now: float) -> bool:
    """NEW's verdict is to be said now: the first, one the journal has not said, at once or once held."""
    if not old.observed or new.said_state is None:
        return True
    if new.state == new.said_state:
        return False
    quiet = new.state in QUIET_STATES and new.said_state in QUIET_STATES
    return not quiet or now - new.state_since >= SAY_AFTER_S


def _state_change(replica: ReplicaConfig, old: Track, new: Track, now: float) -> LogLine:
    """The line for a replica's new verdict (or its first), from the one the journal last said."""
    said = old.said_state if old.said_state is not None else old.state
    held = f", for {now - new.state_since:.0f} s" if new.state in QUIET_STATES and now > new.state_since else ""
    text = f"replica {replica.name}: {said} -> {new.state} ({new.evidence}{held})"
    if new.state is State.HEALTHY and old.restart_issued_at is not None:
        text += f"; serving again {now - old.restart_issued_at:.1f} s after guardian's restart"
    if new.state is State.WRONG_MODEL:
        text += "; not restarting: a wrong model is a wiring or cutover fault, fix the unit or the config"
    if new.state is State.PORT_TAKEN:
        text += "; not restarting: restarting the unit would not free its port, stop the other listener"
    priority = Priority.ERROR if new.state in (State.WRONG_MODEL, State.UNKNOWN, State.PORT_TAKEN) else Priority.INFO
    return LogLine(priority, text, Decision.STATE, replica.name, replica.unit, state=new.state, rule=new.rule)
