"""One observation folded into a replica's track (core/watchdog/judge.py step()): what outlives it
(a new start forgets, a canary whose result never came is given up), and the bookkeeping every
liveness row may read: progress, queued work, traffic, the canary that came back, answers, 503s
and the replica's processes. A listener that is not the replica's has its answers taken away first. Pure.
"""

from __future__ import annotations

from dataclasses import replace

from ...config import ReplicaConfig, WatchdogConfig
from ..observations import Activity, Probe, ProcView, ReplicaObservation, VllmSample
from .canary import CANARY_LOST_AFTER_S, fold_canary, judge_canary_out
from .facts import Seen, flowing, queue_judged
from .steps import learn_step, longest_new_prefill
from .track import Track, fresh_start


def carry_over(track: Track, obs: ReplicaObservation, now: float) -> Track:
    """What outlives this observation: a new start of the unit forgets, a restart's outcome ends it,
    a canary whose result never came is given up."""
    unit = obs.unit
    if unit is not None and unit.inactive_exit_mono != track.start_ts:
        track = fresh_start(track, unit.inactive_exit_mono)
    if obs.restart_outcome is not None:
        track = replace(track, restart_in_flight=False)
    if obs.canary is None and track.canary_due_at is not None and now > track.canary_due_at + CANARY_LOST_AFTER_S:
        # its result never came (the executor lost it): no canary would ever be sent again
        track = _no_canary_in_flight(track)
    if track.first_seen_at is None:
        track = replace(track, first_seen_at=now)
    return track


def fold(
    track: Track, obs: ReplicaObservation, now: float, rcfg: ReplicaConfig, wcfg: WatchdogConfig
) -> tuple[Track, Seen]:
    """The bookkeeping that every rule may read: progress, queued work, traffic, the canary that
    came back, answers and 503s."""
    track = _fold_procs(track, obs, wcfg.quiet_cpu, wcfg.probe_cpu_s)
    sample = obs.metrics
    counters_moved = _progressed(track.last_sample, sample)  # a counter that went down (new engine) counts too
    track = learn_step(track, longest_new_prefill(track.last_sample, sample), now, wcfg.max_step_s)
    waiting_clients, waiting_since = _waits(track, obs, now, wcfg)
    queued = _queued(sample, waiting_clients)
    health_in_time = obs.health.ok and obs.health.latency_s < rcfg.health_timeout_s
    judged = queue_judged(obs, health_in_time)
    ours = track.canary_in_flight_since is not None or obs.canary is not None  # a canary's token is not traffic
    if judged and (
        (not ours and (counters_moved or queued > 0))
        or (ours and sample is not None and _beyond_a_canary(track.last_sample, sample))
        or (ours and sample is None and waiting_clients > 0)
    ):
        track = replace(track, last_traffic_at=now)
    track, canary_ok, canary_failed = fold_canary(track, obs, queued if judged else 0.0, counters_moved or flowing(obs))
    progressed = counters_moved or canary_ok or flowing(obs)
    if progressed:
        track = replace(track, last_progress_at=_progress_at(track, obs, now, counters_moved or canary_ok))
    if not obs.metrics_probe.pending:
        track = replace(track, metrics_readable=sample is not None)
    if judged:
        if queued > 0 and track.work_since is None:
            # clients waiting were queued from the moment the longest-waiting one spoke
            track = replace(track, work_since=waiting_since if waiting_clients else now)
        elif queued == 0:
            track = replace(track, work_since=None)
    if sample is not None:
        track = replace(track, last_sample=sample)
    if obs.all_probes_failed or obs.probes_pending_s is not None:
        # Counted from the last answer, not from the first failed tick: a hung probe takes its
        # whole timeout, and counting from its end would add that timeout to every detection.
        since = track.failing_since if track.failing_since is not None else track.last_answer_at
        track = replace(track, failing_since=since if since is not None else now)
    else:
        track = replace(track, failing_since=None, last_answer_at=now)
    if obs.health.status == 503:
        track = replace(track, dead_503_since=track.dead_503_since if track.dead_503_since is not None else now)
    else:
        track = replace(track, dead_503_since=None)
    if health_in_time and not track.healthy_since_start and _sent_since(obs.health, track.start_ts):
        track = replace(track, healthy_since_start=True)
    in_time_since = (
        (track.health_in_time_since if track.health_in_time_since is not None else now) if health_in_time else None
    )
    track = replace(track, health_in_time_since=in_time_since)
    if obs.canary is None:
        track, untouched = judge_canary_out(track, obs, queued if judged else 0.0, wcfg)
        canary_failed = canary_failed or untouched
    seen = Seen(
        counters_moved, progressed, waiting_clients, waiting_since, queued, health_in_time, canary_failed, judged
    )
    return track, seen


def _quiet_from(
    since: float | None, act: Activity | None, view: ProcView, quiet_cpu: float, allowed_s: float = 0.0
) -> float | None:
    """When a group's quiet spell began, as of VIEW; None: it was not quiet at this look, or it is not
    known. ALLOWED_S: CPU it may use besides (guardian's own probes, answered by a whole-process engine)."""
    if act is None or view.since_s is None or view.since_s <= 0:
        return None
    if act.running or act.used_s > quiet_cpu * view.since_s + allowed_s:
        return None
    return since if since is not None else view.at - view.since_s


def _fold_procs(track: Track, obs: ReplicaObservation, quiet_cpu: float, probe_cpu_s: float) -> Track:
    """TRACK with this look at the replica's processes folded in: a look that could not be had ends both
    spells. An engine that is its whole process answers guardian's probes too: each answered at this
    look adds PROBE_CPU_S to what its quiet allows (the API server's own quiet, L22, needs no answer)."""
    view = obs.procs
    if view is None:
        api, engine = None, None
    else:
        answered = sum(p.answered for p in (obs.health, obs.metrics_probe, obs.models_probe))
        allowed_s = probe_cpu_s * answered if view.engine_whole else 0.0
        api = _quiet_from(track.api_quiet_since, view.api, view, quiet_cpu)
        engine = _quiet_from(track.engine_quiet_since, view.engine, view, quiet_cpu, allowed_s)
    if (api, engine) == (track.api_quiet_since, track.engine_quiet_since):
        return track
    return replace(track, api_quiet_since=api, engine_quiet_since=engine)


def _progressed(prev: VllmSample | None, cur: VllmSample | None) -> bool:
    if prev is None or cur is None:
        return False
    if cur.kv_cache_usage != prev.kv_cache_usage:
        return True
    return any(c != p for c, p in zip(cur.progress_counters(), prev.progress_counters(), strict=False))


def _progress_at(track: Track, obs: ReplicaObservation, now: float, seen_now: bool) -> float:
    """When the progress seen at this tick happened: now for counters and canaries; for a response
    flowing, when its last byte was sent (a frozen server's last bytes are acked after the freeze:
    counted at the look, they would stretch L8's window by up to a tick), counted from when the
    kernel was read (the tick judges after its probe wait)."""
    conns = obs.conns
    if seen_now or conns is None or conns.last_flow_s is None:
        return now
    at = min(now, conns.at if conns.at is not None else now)
    return max(at - conns.last_flow_s, track.last_progress_at if track.last_progress_at is not None else float("-inf"))


def _waits(track: Track, obs: ReplicaObservation, now: float, wcfg: WatchdogConfig) -> tuple[int, float]:
    """Client connections whose request has had no byte of answer for >= W.client_wait_s, and when
    the longest-waiting of them spoke. A client waiting since before the last successful canary
    (an upload stuck half-way: uvicorn has no timeout for it) proves nothing about the engine,
    and none counts from before guardian first saw the replica."""
    conns = obs.conns
    if conns is None or conns.waiting == 0:
        return 0, now
    at = min(now, conns.at if conns.at is not None else now)
    waits = conns.waits_s
    after = max(x for x in (track.last_canary_ok_at, track.first_seen_at, float("-inf")) if x is not None)
    counted = [w for w in waits if w >= wcfg.client_wait_s and at - w >= after]
    if not counted:
        return 0, now
    return len(counted), max(
        at - max(counted), track.first_seen_at if track.first_seen_at is not None else float("-inf")
    )


def _queued(sample: VllmSample | None, waiting_clients: int) -> float:
    return (sample.queued if sample is not None else 0.0) + waiting_clients


def _beyond_a_canary(prev: VllmSample | None, cur: VllmSample) -> bool:
    """Traffic while a canary of guardian's runs: more than one request in the engine, or counters
    that moved more than one 1-token canary explains (one generated token, one finished request)."""
    if cur.queued > 1:
        return True
    if prev is None:
        return False
    return cur.generation_tokens - prev.generation_tokens > 1 or cur.request_success - prev.request_success > 1


def _no_canary_in_flight(track: Track) -> Track:
    """TRACK with no canary in flight (none, nor a closer look): forgotten, never judged."""
    return replace(
        track,
        canary_in_flight_since=None,
        canary_due_at=None,
        canary_late_at=None,
        closer_since=None,
        closer_due_at=None,
    )


def _sent_since(probe: Probe, start_ts: float | None) -> bool:
    """PROBE was sent at or after the unit's latest start (START_TS), or either is not known. A /health
    200 to a probe sent before it came from the run that start ended (a probe carried over a tick, or
    sent while an operator's restart stopped the old server, is read beside a view of the unit that
    already shows the new start): it must not end the new start's grace (L6) before it served once.
    It is still an answer (the port answered) for everything else, as any late answer is."""
    return probe.sent_at is None or start_ts is None or probe.sent_at >= start_ts


def not_its_answers(track: Track, obs: ReplicaObservation) -> tuple[Track, ReplicaObservation]:
    """OBS without the answers of a listener that is not the replica's: nothing they say (health,
    counters, a model, a canary) is the replica's progress or its start's end (issue 34 row 13)."""
    none = Probe(False, None, 0.0, "answered by another's listener")
    if obs.canary is not None:
        track = _no_canary_in_flight(track)
    blind = replace(
        obs,
        health=none,
        metrics_probe=none,
        metrics=None,
        models_probe=none,
        models=None,
        canary=None,
        probes_pending_s=None,
    )
    return track, blind
