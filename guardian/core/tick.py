"""One tick's decision: ``decide(state, observation, now, cfg) -> (state, actions)``. Pure.

This is the whole of guardian's judgement; the daemon observes, calls this once, and performs
the actions. In order:

1. liveness: each replica's observation is folded into its track (core/liveness.py, L1-L17);
   state changes and unreadable /metrics are logged once; canaries are asked for; canary
   latencies that changed are recorded in the state file (one action a tick), where a track
   created later starts from them;
2. drains in progress (core/drain.py, D3-D8, D10-D11): a drained replica is restarted, a drain
   that cannot go on is abandoned, a replica back in service is marked up at the proxy;
3. unplanned restarts: a replica whose verdict asks for one (stalled, unresponsive, idle-dead)
   is restarted if admission allows (core/admission.py, A1-A3 then G1-G9), at most one per tick,
   and marked down at the proxy (D9);
4. operators' restart requests (`guardian restart NAME`, recorded in the state file) pass the
   same admission, then drain first when a proxy is configured (D1, D2); each is answered,
   refused or done, exactly once;
5. the memory guard (core/memguard.py, M1-M16) sees the tracks and what admission would say, and
   a lowering it starts marks that replica's restart in flight, as any other restart does.

The coupling lives here and nowhere else: a restart issued in step 2, 3 or 4 blocks the others
(one at a time per box), and so does a drain in progress for planned ones; a lowering's restart
counts against the same budget and back-off.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..config import Config, ReplicaConfig
from . import admission, bypass, drain, fleet, liveness, memguard
from .actions import (
    AcquireSlot,
    Action,
    AnswerRequest,
    DrainReplica,
    LogLine,
    LowerFraction,
    RecordCanaryLatencies,
    ReleaseSlot,
    RestartUnit,
    StartCanary,
)
from .drain import Drain, Phase
from .liveness import Track
from .observations import MemoryObservation, ReplicaObservation, TickObservation
from .rules import Refusal
from .vocab import LOADING_STATES, RESTART_STATES, SERVING_STATES, Decision, Priority, RestartKind, State


@dataclass(frozen=True)
class TickState:
    tracks: dict[str, Track] = field(default_factory=dict)
    mem: memguard.MemTrack = field(default_factory=memguard.MemTrack)
    requests_taken: frozenset[str] = frozenset()  # operators' requests acted on, answer not yet recorded
    drains: dict[str, Drain] = field(default_factory=dict)  # replicas marked down at the proxy (core/drain.py)
    fleet_said: dict[str, tuple[str, ...]] = field(default_factory=dict)  # request id -> why it waits, as last said
    slots_released: frozenset[str] = frozenset()  # fleet slots given back that the view may still show
    bypass_seen: dict[tuple[str, str], float] = field(default_factory=dict)  # (replica, peer) -> connected since
    bypassing: tuple[bypass.Bypass, ...] = ()  # clients bypassing the proxy now (core/bypass.py B2)

    @property
    def proxy_down(self) -> frozenset[str]:
        return frozenset(self.drains)


@dataclass
class _Out:
    tracks: dict[str, Track]
    drains: dict[str, Drain] = field(default_factory=dict)
    fleet_said: dict[str, tuple[str, ...]] = field(default_factory=dict)
    slots_released: frozenset[str] = frozenset()
    actions: list[Action] = field(default_factory=list)

    def log(self, line: LogLine) -> None:
        self.actions.append(line)


def decide(state: TickState, obs: TickObservation, now: float, cfg: Config) -> tuple[TickState, list[Action]]:
    # D11: a replica gone from the config leaves the proxy's file with its server line.
    out = _Out(
        tracks={},
        drains={n: d for n, d in state.drains.items() if cfg.replica(n) is not None},
        slots_released=state.slots_released,
    )
    for r in cfg.replicas:
        old = state.tracks[r.name] if r.name in state.tracks else _new_track(r.name, obs, now)
        _liveness(out, r, old, obs.replicas[r.name], obs, now, cfg)
    _record_canary_latencies(out, state.tracks, obs)
    issued = any(t.restart_in_flight for t in out.tracks.values())
    for r in cfg.replicas:
        issued = _drain_step(out, r, obs, now, cfg, issued) or issued
    for r in cfg.replicas:
        issued = _unplanned(out, r, obs, now, cfg, issued) or issued
    planned = issued or any(d.phase is Phase.DRAINING for d in out.drains.values())
    out.fleet_said = {k: v for k, v in state.fleet_said.items() if k in {q.id for q in obs.persistent.requests}}
    taken, planned = _requests(out, state.requests_taken, obs, now, cfg, planned)
    mem = state.mem
    if obs.memory is not None:
        mem = _memory(out, state.mem, obs.memory, obs, now, cfg, planned)
    else:  # the memory guard is off (a reload): its drains are not waited for
        out.drains = {n: d for n, d in out.drains.items() if not (d.for_memory and d.phase is Phase.DRAINING)}
    waiting = {q.replica for q in obs.persistent.requests if q.id not in taken}
    released = _release_slots(out, obs, mem, waiting, state.slots_released)
    seen, bypassing = _bypass(out, state, obs, now, cfg)
    return TickState(out.tracks, mem, taken, out.drains, out.fleet_said, released, seen, bypassing), out.actions


def _bypass(
    out: _Out, state: TickState, obs: TickObservation, now: float, cfg: Config
) -> tuple[dict[tuple[str, str], float], tuple[bypass.Bypass, ...]]:
    """B1-B3: each client that starts bypassing the proxy is said once at warning, and once more
    when it has gone."""
    views = {n: o.conns for n, o in obs.replicas.items()}
    seen, found = bypass.update(state.bypass_seen, state.bypassing, views, now, cfg)
    before = {(b.replica, b.peer) for b in state.bypassing}
    for b in found:
        if (b.replica, b.peer) not in before:
            h = b.hazard(cfg, now)
            out.log(
                LogLine(
                    Priority.WARNING,
                    f"hazard: {h.message}",
                    Decision.HAZARD,
                    h.replica,
                    h.unit,
                    rule="B2",
                    hazard=h.key,
                )
            )
    for b in state.bypassing:
        if (b.replica, b.peer) not in {(f.replica, f.peer) for f in found}:
            r = cfg.replica(b.replica)
            out.log(
                LogLine(
                    Priority.INFO,
                    f"replica {b.replica}: {b.peer} no longer talks to it directly",
                    Decision.HAZARD,
                    b.replica,
                    r.unit if r is not None else None,
                    rule="B2",
                    hazard=f"bypass:{b.replica}:{b.peer}",
                )
            )
    return seen, tuple(found)


def next_tick_at(state: TickState, last_started: float, now: float, cfg: Config) -> float:
    """When the next tick starts: INTERVAL_S after the last one started, or earlier so that its
    judgment lands on a replica's deadline (liveness.next_deadline). A tick judges once its probes
    are in, up to cfg.probe_wait_s after it starts, so it starts that much before the deadline; if
    that moment has passed (this tick judged just short of it), it starts at the deadline itself.
    At most two extra ticks per deadline; never one in the past."""
    at = last_started + cfg.interval_s
    for t in state.tracks.values():
        deadline = liveness.next_deadline(t, cfg.watchdog)
        if deadline is None or deadline <= now:
            continue
        early = deadline - cfg.probe_wait_s
        at = min(at, early if early > now else deadline)
    return at


PROBE_WAIT_FLOOR_S = 0.05  # a healthy replica answers within it


def probe_wait_s(state: TickState, now: float, cfg: Config) -> float:
    """How long this tick waits for its probes: cfg.probe_wait_s, but not past a replica's
    deadline (liveness.next_deadline), so that the verdict is given at it rather than a whole
    wait later; at least PROBE_WAIT_FLOOR_S, for the replicas that do answer."""
    wait = cfg.probe_wait_s
    for t in state.tracks.values():
        deadline = liveness.next_deadline(t, cfg.watchdog)
        if deadline is not None and deadline >= now:  # one already past must not shorten every tick
            wait = min(wait, max(deadline - now, PROBE_WAIT_FLOOR_S))
    return wait


# --- 1. liveness ------------------------------------------------------------------------------


def _kept(name: str, obs: TickObservation) -> tuple[float, ...]:
    """NAME's canary latencies as the state file kept them."""
    return obs.persistent.canary_latencies.get(name, ())[-liveness.CANARY_LATENCIES_KEPT :]


def _new_track(name: str, obs: TickObservation, now: float) -> Track:
    """A replica guardian has no track of yet (guardian started, or the replica was added by a
    reload) starts from the canary latencies the state file kept: with 3 or more, its learned
    deadline holds from its first canary, and it gets no learning canaries."""
    return Track(state_since=now, canary_latencies=_kept(name, obs))


def _record_canary_latencies(out: _Out, before: dict[str, Track], obs: TickObservation) -> None:
    """One action for all the replicas whose canary latencies changed this tick (a canary
    succeeded), none when nothing changed: the state file is written at most once a tick."""
    changed = tuple(
        (name, t.canary_latencies)
        for name, t in out.tracks.items()
        if t.canary_latencies != (before[name].canary_latencies if name in before else _kept(name, obs))
    )
    if changed:
        out.actions.append(RecordCanaryLatencies(changed))


def _liveness(
    out: _Out, r: ReplicaConfig, old: Track, o: ReplicaObservation, obs: TickObservation, now: float, cfg: Config
) -> None:
    new, want_canary = liveness.step(old, o, now, r, cfg.watchdog, obs.persistent.pauses.get(r.name))
    if new.state not in RESTART_STATES:
        new = replace(new, last_notice=None)
    if new.state != old.state or not old.observed:
        msg = f"replica {r.name}: {old.state} -> {new.state} ({new.evidence})"
        if new.state is State.HEALTHY and old.restart_issued_at is not None:
            msg += f"; serving again {now - old.restart_issued_at:.1f} s after guardian's restart"
        if new.state is State.WRONG_MODEL:
            msg += "; not restarting: a wrong model is a wiring or cutover fault, fix the unit or the config"
        priority = Priority.ERROR if new.state in (State.WRONG_MODEL, State.UNKNOWN) else Priority.INFO
        out.log(LogLine(priority, msg, Decision.STATE, r.name, r.unit, state=new.state, rule=new.rule))
    # Garbage on /metrics is bad input: say so once, and base no restart on it.
    err = o.metrics_probe.error if o.metrics_probe.answered and o.metrics is None else None
    if err != new.metrics_error:
        if err is not None:
            out.log(
                LogLine(
                    Priority.ERROR,
                    f"replica {r.name}: /metrics {err}; progress cannot be judged, so no "
                    "stall or idle verdict (and no restart) will be based on it until it reads again",
                    Decision.NOTE,
                    r.name,
                    r.unit,
                )
            )
        new = replace(new, metrics_error=err)
    if new.state is State.HEALTHY and new.restart_issued_at is not None:
        new = replace(new, restart_issued_at=None)
    if want_canary is not None:
        out.actions.append(StartCanary(r.name, want_canary))
    out.tracks[r.name] = new


# --- 2 and 3. restarts: one path for the watchdog's and the operators' -------------------------


def _restart(
    out: _Out,
    r: ReplicaConfig,
    kind: RestartKind,
    head: str,
    evidence: str,
    obs: TickObservation,
    now: float,
    cfg: Config,
    issued: bool,
    request_id: str | None = None,
    stop_timeout_s: float | None = None,
) -> Refusal | None:
    """Admit, then issue (or log the dry run). A refusal is logged and returned; a watchdog's
    refusal or dry run is logged once per episode (its stable key), an operator's every time."""
    t = out.tracks[r.name]

    def say(key: tuple[str, ...], line: LogLine) -> None:
        """Log LINE: the watchdog's once per episode (KEY), an operator's request always."""
        nonlocal t
        if request_id is None and t.last_notice == key:
            return
        out.log(line)
        t = replace(t, last_notice=key if request_id is None else t.last_notice)

    no = admission.refusal(r.name, out.tracks, obs.replicas[r.name], obs.persistent, now, cfg, issued)
    if no is not None:
        say(
            no.key,
            LogLine(
                no.priority,
                f"{head}; restart of {r.unit} refused: {no.text}",
                Decision.REFUSED,
                r.name,
                r.unit,
                state=t.state,
                gate=no.gate,
                rule=no.rule,
            ),
        )
    elif cfg.dry_run:
        say(
            (Decision.DRY_RUN,),
            LogLine(
                Priority.WARNING,
                f"{head}; DRY-RUN: would restart {r.unit} now",
                Decision.DRY_RUN,
                r.name,
                r.unit,
                state=t.state,
                rule=t.rule,
            ),
        )
    else:
        b = admission.budget(r.name, obs.persistent, now, cfg)
        # A hung engine will not shut down gracefully: vLLM's API server would wait on it until
        # systemd's TimeoutStopSec. Its processes are killed as soon as the restart job is queued.
        kill = kind is RestartKind.HANG
        how = ", its processes killed at once (hung)" if kill else ""
        if stop_timeout_s is not None and not kill:
            how = f", its processes killed if the stop takes over {stop_timeout_s:g} s"
        out.log(
            LogLine(  # an action taken is always said
                Priority.WARNING,
                f"{head}; restarting {r.unit}{how} (restart {b.used + 1} of {b.limit} in "
                f"{cfg.watchdog.restart_window_s:.0f} s)",
                Decision.RESTART,
                r.name,
                r.unit,
                state=t.state,
                rule=t.rule if kind is RestartKind.HANG else None,
            )
        )
        out.actions.append(
            RestartUnit(r.name, r.unit, kind, evidence, request_id, kill_first=kill, stop_timeout_s=stop_timeout_s)
        )
        t = replace(
            t,
            restart_in_flight=True,
            restart_issued_at=now,
            last_notice=(Decision.RESTART,) if request_id is None else t.last_notice,
        )
    out.tracks[r.name] = t
    return no


def _unplanned(out: _Out, r: ReplicaConfig, obs: TickObservation, now: float, cfg: Config, issued: bool) -> bool:
    """Restart R if its verdict asks for it and admission allows; True when a restart was issued."""
    t = out.tracks[r.name]
    if t.state not in RESTART_STATES:
        return False
    _restart(
        out,
        r,
        RestartKind.HANG,
        f"replica {r.name}: {t.state} ({t.evidence})",
        f"{t.state}: {t.evidence}",
        obs,
        now,
        cfg,
        issued,
    )
    if not out.tracks[r.name].restart_in_flight:
        return False
    d = out.drains.get(r.name)
    if cfg.proxy.enabled and (d is None or d.phase is Phase.DRAINING):
        if d is not None and d.request_id is not None:
            out.actions.append(
                AnswerRequest(
                    d.request_id, r.name, True, f"it hung while draining ({t.state}): restarted as a hung replica"
                )
            )
        out.drains[r.name] = Drain(Phase.AWAY, now, f"hung: {t.state}", confirmed_at=d.confirmed_at if d else None)
        if d is None:
            out.log(
                LogLine(
                    Priority.WARNING,
                    f"replica {r.name}: marked down at the proxy while it restarts ({t.state}): no new request "
                    "goes to it until it serves again (D9)",
                    Decision.PROXY,
                    r.name,
                    r.unit,
                    rule="D9",
                )
            )
    return True


def _drain_step(out: _Out, r: ReplicaConfig, obs: TickObservation, now: float, cfg: Config, issued: bool) -> bool:
    """A replica marked down at the proxy: restart it once drained, give the drain up, or mark it
    up once it serves again (core/drain.py). True when a restart was issued."""
    d = out.drains.get(r.name)
    if d is None:
        return False
    t = out.tracks[r.name]
    if d.phase is Phase.AWAY:
        if drain.back(d, t):
            del out.drains[r.name]
            out.log(
                LogLine(
                    Priority.INFO,
                    f"replica {r.name}: serving again ({t.evidence}); marked up at the proxy, which also clears "
                    "its count of failed attempts (D10)",
                    Decision.PROXY,
                    r.name,
                    r.unit,
                    state=t.state,
                    rule="D10",
                )
            )
        return False
    if t.state in RESTART_STATES:
        return False  # it hung while draining: the unplanned path restarts it (D9)
    d = drain.confirmed(d, r.name, obs.proxy, now)
    out.drains[r.name] = d
    err = drain.refused_by_proxy(d, r.name, obs.proxy)
    peers = _peer_count(obs, cfg, r.model)
    if err is not None and d.for_memory:
        if not d.error_said:
            out.log(
                LogLine(
                    Priority.ERROR,
                    f"replica {r.name}: the memory guard's lowering waits: marking it down at the proxy failed: "
                    f"{err}; the proxy is asked again every 30 s (D3)",
                    Decision.REFUSED,
                    r.name,
                    r.unit,
                    rule="D3",
                )
            )
            out.drains[r.name] = replace(d, error_said=True)
        return False
    if err is not None:
        _abandon(
            out,
            r,
            d,
            "D3",
            f"marking it down at the proxy failed: {err}; fix the proxy (see `guardian check`) or "
            "P.drain_command, then ask again",
        )
        return False
    if drain.others_serving(r.name, cfg, out.tracks, out.drains, peers) == 0:
        _abandon(out, r, d, "D4", f"no other replica of {r.model} serves any more, so draining it would leave none")
        return False
    why = drain.drained(d, obs.replicas[r.name], now, cfg)
    if why is None or d.for_memory:  # the memory guard lowers it when it is drained (D7)
        return False
    no = _restart(
        out,
        r,
        RestartKind.OPERATOR,
        f"replica {r.name}: {why}",
        f"requested by an operator; {why}",
        obs,
        now,
        cfg,
        issued,
        d.request_id,
        stop_timeout_s=cfg.proxy.stop_timeout_s,
    )
    if no is not None:
        _abandon(out, r, d, "D8", f"refused ({no.gate}): {no.text}", logged=True)
        return False
    out.drains[r.name] = Drain(Phase.AWAY, now, "planned restart after its drain", d.request_id, d.confirmed_at)
    return True


def _abandon(out: _Out, r: ReplicaConfig, d: Drain, rule: str, why: str, logged: bool = False) -> None:
    del out.drains[r.name]
    what = "the memory guard's lowering" if d.for_memory else "planned restart"
    if not logged:
        out.log(
            LogLine(
                Priority.ERROR,
                f"replica {r.name}: {what} of {r.unit} given up and the replica marked up again at the "
                f"proxy: {why} ({rule})",
                Decision.REFUSED,
                r.name,
                r.unit,
                rule=rule,
            )
        )
    if d.request_id is not None:
        out.actions.append(AnswerRequest(d.request_id, r.name, False, f"refused ({rule}): {why}"))


def _requests(
    out: _Out, taken: frozenset[str], obs: TickObservation, now: float, cfg: Config, issued: bool
) -> tuple[frozenset[str], bool]:
    """Each operator's request is acted on once: admitted and issued, or refused; and answered."""
    pending = {q.id for q in obs.persistent.requests}
    still = set(taken & pending)  # answered ones have left the state file
    for q in obs.persistent.requests:
        if q.id in still:
            continue
        still.add(q.id)
        r = cfg.replica(q.replica)
        if r is None:
            out.actions.append(AnswerRequest(q.id, q.replica, False, f"no replica named {q.replica!r} in the config"))
            continue
        head = f"replica {r.name}: an operator asked for a restart (it is {out.tracks[r.name].state})"
        if _waits_for_fleet(out, r, q.id, head, obs, now, cfg, issued):
            still.discard(q.id)  # asked again on the next tick
            continue
        # Without the proxy's report (no daemon runs: `guardian restart` decides alone) nobody would
        # finish a drain, so it is restarted at once.
        if cfg.proxy.enabled and obs.proxy is not None and not cfg.dry_run and r.name not in out.drains:
            if _start_drain(out, r, q.id, head, obs, now, cfg, issued):
                issued = True
                continue
        no = _restart(out, r, RestartKind.OPERATOR, head, "requested by an operator", obs, now, cfg, issued, q.id)
        if no is not None:
            out.actions.append(AnswerRequest(q.id, r.name, False, f"refused ({no.gate}): {no.text}"))
        elif cfg.dry_run:
            out.actions.append(AnswerRequest(q.id, r.name, True, f"DRY-RUN: would restart {r.unit}"))
        else:
            issued = True
    return frozenset(still), issued


def _waits_for_fleet(
    out: _Out, r: ReplicaConfig, request_id: str, head: str, obs: TickObservation, now: float, cfg: Config, issued: bool
) -> bool:
    """F2-F6 for an operator's request that admission would let through: True while it waits for
    a fleet slot (asked for with F6); each reason is said once per request."""
    if not cfg.fleet.enabled or cfg.dry_run:
        return False
    if admission.refusal(r.name, out.tracks, obs.replicas[r.name], obs.persistent, now, cfg, issued) is not None:
        return False  # refused on this box's own grounds: the restart path says so
    b = fleet.slot_refusal(r.name, r.model, obs.fleet, cfg, out.slots_released)
    if b is None:
        return False
    if b.rule == "F6":
        out.actions.append(AcquireSlot(r.name, r.model))
    if out.fleet_said.get(request_id) != b.key:
        out.fleet_said[request_id] = b.key
        out.log(LogLine(b.priority, f"{head}; {b.text} ({b.rule})", Decision.FLEET, r.name, r.unit, rule=b.rule))
    return True


def _release_slots(
    out: _Out, obs: TickObservation, mem: memguard.MemTrack, pending_requests: set[str], released: frozenset[str]
) -> frozenset[str]:
    """F7: give back each slot of this box whose planned restart is over or given up. Returns the
    slots given back that the view may still show (the release is under way): not asked twice."""
    if obs.fleet is None or not obs.fleet.ok:
        return released
    asking = {a.replica for a in out.actions if isinstance(a, AcquireSlot)}
    still = released & obs.fleet.mine
    for name in sorted(obs.fleet.mine - still):
        t = out.tracks.get(name)
        busy = (
            name in out.drains
            or name in asking
            or name in pending_requests
            or (mem.pending is not None and mem.pending.replica == name)
            or (t is not None and (t.restart_in_flight or t.state in LOADING_STATES))
        )
        if not busy:
            out.actions.append(ReleaseSlot(name))
            state = t.state if t is not None else "not configured"
            out.log(
                LogLine(
                    Priority.INFO,
                    f"replica {name}: its planned restart is over ({state}); fleet slot given back (F7)",
                    Decision.FLEET,
                    name,
                    rule="F7",
                )
            )
            still |= {name}
    return still


def _start_drain(
    out: _Out, r: ReplicaConfig, request_id: str, head: str, obs: TickObservation, now: float, cfg: Config, issued: bool
) -> bool:
    """D1: mark R down at the proxy instead of restarting it now; True if so. D2 says why not."""
    if admission.refusal(r.name, out.tracks, obs.replicas[r.name], obs.persistent, now, cfg, issued) is not None:
        return False  # the restart path logs and answers the refusal
    peers = _peer_count(obs, cfg, r.model)
    if drain.others_serving(r.name, cfg, out.tracks, out.drains, peers) == 0:
        out.log(
            LogLine(
                Priority.WARNING,
                f"{head}; not drained: no other replica of {r.model} serves, so it is restarted at once and its "
                "clients will see errors until it serves again (D2)",
                Decision.PROXY,
                r.name,
                r.unit,
                rule="D2",
            )
        )
        return False
    s = obs.replicas[r.name].metrics
    work = "an unknown number of" if s is None else f"{s.running:.0f} running and {s.waiting:.0f} waiting"
    out.drains[r.name] = Drain(Phase.DRAINING, now, "an operator's restart", request_id)
    out.log(
        LogLine(
            Priority.WARNING,
            f"{head}; draining first: marked down at the proxy, restarted once its {work} requests end or after "
            f"{cfg.proxy.drain_timeout_s:g} s (D1)",
            Decision.PROXY,
            r.name,
            r.unit,
            rule="D1",
        )
    )
    return True


# --- 4. the memory guard ----------------------------------------------------------------------


def _memory(
    out: _Out,
    track: memguard.MemTrack,
    mobs: MemoryObservation,
    obs: TickObservation,
    now: float,
    cfg: Config,
    issued: bool,
) -> memguard.MemTrack:
    pending = track.pending
    replicas = []
    blocked: dict[str, Refusal] = {}
    for r in cfg.replicas:
        t = out.tracks[r.name]
        o = obs.replicas[r.name]
        mo = mobs.replicas.get(r.name)
        reported = t.last_sample.gpu_memory_utilization if t.last_sample is not None else None
        if reported is None and mo is not None:
            reported = mo.cmdline_fraction
        configured = mo.configured_fraction if mo is not None else None
        wiring = mo.wiring_problem if mo is not None else "not observed"
        lowering = pending is not None and pending.replica == r.name
        if (
            wiring is None
            and not lowering
            and t.state in SERVING_STATES
            and configured is not None
            and reported is not None
            and abs(configured - reported) > 1e-6
        ):
            wiring = (
                f"it serves with gpu_memory_utilization {reported:g} while guardian's env file says "
                f"{configured:g}: something overrides that file (a later EnvironmentFile= or an ExecStart= drop-in)"
            )
        replicas.append(
            memguard.ReplicaMemory(
                name=r.name,
                unit=r.unit,
                model=r.model,
                fraction=configured if configured is not None else reported,
                running_fraction=reported,
                started_at=o.unit.inactive_exit_mono if o.unit else None,
                wiring_problem=wiring,
                state=t.state,
                usage_bytes=mo.usage_bytes if mo else None,
                start_failure=mo.start_failure if mo and lowering else None,
                startup_grace_s=r.startup_grace_s,
                drained=_memory_drained(out.drains.get(r.name), o, now, cfg),
            )
        )
        # Its own drain is the first step of this lowering, not another restart in flight.
        mine = out.drains.get(r.name)
        own = mine is not None and mine.for_memory and mine.phase is Phase.DRAINING
        others = any(d.phase is Phase.DRAINING for n, d in out.drains.items() if n != r.name)
        b = admission.admit(r.name, out.tracks, obs.persistent, now, cfg, issued if not own else others)
        if b is None and not own:  # a drain for the memory guard was begun with its slot held
            b = fleet.slot_refusal(r.name, r.model, obs.fleet, cfg, out.slots_released)
        if b is not None:
            blocked[r.name] = b
    results = {n: o.restart_outcome for n, o in obs.replicas.items() if o.restart_outcome is not None}
    view = memguard.MemoryView(
        mobs.sample,
        mobs.total_bytes,
        tuple(replicas),
        mobs.peers_serving,
        mobs.consumers,
        blocked,
        results,
        drain_first=cfg.proxy.enabled,
        fleet_serving=_fleet_serving(obs, cfg),
    )
    new, actions = memguard.decide(track, view, now, cfg)
    asked: set[str] = set()
    for a in actions:
        if isinstance(a, DrainReplica):
            asked.add(a.replica)
            if a.replica not in out.drains:
                out.drains[a.replica] = Drain(Phase.DRAINING, now, "the memory guard's lowering", for_memory=True)
            continue
        if isinstance(a, LowerFraction) and a.restart and a.replica in out.tracks:
            asked.add(a.replica)
            # The watchdog keeps out of it, and no other restart starts, until the job is done.
            out.tracks[a.replica] = replace(out.tracks[a.replica], restart_in_flight=True, restart_issued_at=now)
            a = _lowering_at_the_proxy(out, a, obs, now, cfg)
        out.actions.append(a)
    for r in cfg.replicas:
        d = out.drains.get(r.name)
        if d is not None and d.for_memory and d.phase is Phase.DRAINING and r.name not in asked:
            del out.drains[r.name]
            out.log(
                LogLine(
                    Priority.INFO,
                    f"replica {r.name}: the memory guard no longer lowers it; marked up again at the proxy (D7)",
                    Decision.PROXY,
                    r.name,
                    r.unit,
                    rule="D7",
                )
            )
    return new


def _peer_count(obs: TickObservation, cfg: Config, model: str) -> int:
    """Replicas of MODEL serving elsewhere: memory.peer_urls that answered, and other boxes in the fleet."""
    peers = len(obs.memory.peers_serving) if obs.memory is not None else 0
    return peers + len(_fleet_serving(obs, cfg).get(model, ()))


def _fleet_serving(obs: TickObservation, cfg: Config) -> dict[str, tuple[str, ...]]:
    """Per model, the replicas serving on other boxes, from the fleet view (this box's own are
    judged by its own tracks)."""
    v = obs.fleet
    if v is None or not v.ok:
        return {}
    out: dict[str, tuple[str, ...]] = {}
    for model in {r.model for r in cfg.replicas}:
        out[model] = tuple(x for x in v.serving(model, "") if not x.startswith(f"{v.box}/"))
    return out


def _memory_drained(d: Drain | None, o: ReplicaObservation, now: float, cfg: Config) -> bool:
    return d is not None and d.for_memory and d.phase is Phase.DRAINING and drain.drained(d, o, now, cfg) is not None


def _lowering_at_the_proxy(out: _Out, a: LowerFraction, obs: TickObservation, now: float, cfg: Config) -> LowerFraction:
    """A lowering's restart: after its drain (D7) with a bounded stop; a critical one, not drained,
    is marked down as it restarts (D9)."""
    if not cfg.proxy.enabled:
        return a
    d = out.drains.get(a.replica)
    r = cfg.replica(a.replica)
    unit = r.unit if r is not None else None
    if d is not None and d.for_memory and d.phase is Phase.DRAINING:
        why = drain.drained(d, obs.replicas[a.replica], now, cfg) or "drained"
        out.drains[a.replica] = replace(d, phase=Phase.AWAY, since=now)
        out.log(
            LogLine(
                Priority.INFO,
                f"replica {a.replica}: {why}; the memory guard lowers it now (D7)",
                Decision.PROXY,
                a.replica,
                unit,
                rule="D7",
            )
        )
        return replace(a, stop_timeout_s=cfg.proxy.stop_timeout_s)
    if d is None:
        out.drains[a.replica] = Drain(Phase.AWAY, now, "a critical lowering")
        out.log(
            LogLine(
                Priority.WARNING,
                f"replica {a.replica}: marked down at the proxy while the memory guard restarts it (D9)",
                Decision.PROXY,
                a.replica,
                unit,
                rule="D9",
            )
        )
    return a
