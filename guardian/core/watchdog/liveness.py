"""How a replica is judged: the liveness rows (L1-L22). The rest of the family (core/watchdog/)
computes what they read: judge.py steps a replica's track through them, fold.py folds each
observation in, facts.py says what one look shows, canary.py sends the canary and reads its result.

Pure: a Track (what guardian remembers about one replica) plus one ReplicaObservation plus
``now`` give the next Track, whose ``state`` is the verdict. No clock, no I/O, no sleeping.

Rules, first match wins: the rows of ROWS below (ids L1-L22, in table order), each its table row, the
predicate that says when it holds and the evidence it gives, over one Facts value (facts.py); RULES (their rules) is
rendered into docs/rules.md. ``W`` = watchdog config, ``R`` = replica config, times in seconds.

Progress means: any of generation_tokens_total, prompt_tokens_total,
iteration_tokens_total_count/_sum, request_success_total went up, or kv_cache_usage_perc changed
(it moves during a long chunked prefill when the token counters stand still), or a counter went
down (the engine restarted), or a canary completed, or the kernel saw a response flowing to a
client (ConnView.flowing > 0: bytes acked on a client connection since the last look while the
client sent nothing). The last one is evidence of its own: /metrics is served by the same event
loop as /health, so when a starved API server answers no probe, counters cannot show progress
while its streams still deliver tokens (measured on vLLM 0.32: 11 s).

Queued work means: running + waiting > 0 on /metrics, or clients waiting: client connections
whose request has had no byte of answer for >= W.client_wait_s (ConnView.waiting; an engine
frozen between two steps shows 0 running and 0 waiting while its clients wait in the API server).

The queue is judged (queue_judged) when /metrics was read; or when the replica's engine serves no
page as started (llama-server without --metrics, SGLang without --enable-metrics: the observation's
metrics_offered is False), or serves it from its engine's own loop (llama-server) and it did not come
while /health answered in time: the engine then does not answer. In those two its clients waiting are
its queue, and the rows that say "queue judged" apply; L19, which reads the engine's own count, does not.

Traffic means: queued work, or a counter moved, at a tick with no canary of guardian's
in flight or just folded in (a canary's own token is not traffic); with one, running + waiting > 1,
or generation_tokens_total or request_success_total up by more than 1 (more than the canary).

When the unit's start time changes (it was restarted, by anyone), everything but the restart
bookkeeping, the canary latencies and the count of learning canaries is forgotten (track.py
fresh_start), and rule L6 applies afresh.
"""

from __future__ import annotations

from ..rules import UNCHANGED, Row, Rule
from ..vocab import ActiveState, State
from .facts import (
    Facts,
    ago,
    api_quiet,
    busy_progressing,
    engine_proof,
    engine_quiet,
    gpus,
    healthy_progressing,
    loading,
    no_answer,
    paused,
    port_taken,
    port_taken_by,
    stall_proof,
    stall_proven,
)

# First match wins: a row may count on the rows above it not holding.
ROWS: tuple[Row[Facts, str], ...] = (
    Row(
        Rule("L1", State.PAUSED, "an operator pause is in force (`guardian pause`; until <= now ends it)"),
        lambda f: f.pause is not None and (f.pause.until is None or f.now < f.pause.until),
        paused,
    ),
    Row(
        Rule(
            "L2", State.UNKNOWN, "systemd could not be asked about the unit (D-Bus error, or the bus is not connected)"
        ),
        lambda f: f.obs.unit is None,
        lambda f: f"systemd not reachable: {f.obs.unit_error or 'D-Bus error'}",
    ),
    Row(
        Rule(
            "L3",
            State.STOPPED,
            "unit not found, inactive or failed (a masked unit still running is judged, and the restart gates "
            "refuse it)",
        ),
        lambda f: not f.unit.exists or f.unit.active_state.down,
        lambda f: f"unit {f.unit.name} is {f.unit.load_state if not f.unit.exists else f.unit.active_state}",
    ),
    Row(
        Rule(
            "L4",
            State.PORT_TAKEN,
            "the listener on the replica's address is known to be another's (not R.unit's cgroup and not "
            "R.container: another unit, a container of another name or engine, a forged engine scope): its "
            "answers are not the replica's, and none of them is folded in",
        ),
        lambda f: port_taken_by(f.obs.port_owner, f.rcfg) is not None,
        port_taken,
    ),
    Row(
        Rule(
            "L5",
            State.STARTING,
            "unit activating, deactivating, in maintenance or in a state this guardian does not know (a newer "
            "systemd's), or a restart by guardian is in flight",
        ),
        lambda f: (
            f.unit.active_state.transitional or f.unit.active_state is ActiveState.OTHER or f.track.restart_in_flight
        ),
        lambda f: "restart by guardian in flight" if f.track.restart_in_flight else f"unit {f.unit.active_state}",
    ),
    Row(
        Rule(
            "L6",
            State.STARTING,
            "unit active, not healthy once since it last started, AND now - start < R.startup_grace_s "
            "(start = systemd's InactiveExitTimestampMonotonic)",
        ),
        lambda f: (
            not f.track.healthy_since_start and (f.since_start_s is None or f.since_start_s < f.rcfg.startup_grace_s)
        ),
        loading,
    ),
    Row(
        Rule("L7", State.WRONG_MODEL, "/v1/models answered AND does not list R.model"),
        lambda f: f.obs.models is not None and f.rcfg.model not in f.obs.models,
        lambda f: f"/v1/models lists {', '.join(f.obs.models or ()) or 'nothing'}, expected {f.rcfg.model}",
    ),
    Row(
        API_QUIET := Rule(
            "L22",
            State.UNRESPONSIVE,
            "no probe got any HTTP answer for >= W.engine_quiet_s (counted from the last answer) AND no "
            "progress for >= W.engine_quiet_s AND the API server's processes (every process of the replica "
            "not named as its engine's; all of them where none is) quiet for >= W.engine_quiet_s: at each look "
            "CPU plus run-queue wait <= W.quiet_cpu of a core AND none running, runnable or in uninterruptible "
            "wait (a frozen server; a starved one waits on the run queue, a busy one computes)",
        ),
        lambda f: (
            f.failing_for_s >= f.wcfg.engine_quiet_s
            and f.quiet_for_s >= f.wcfg.engine_quiet_s
            and f.api_quiet_for_s >= f.wcfg.engine_quiet_s
        ),
        api_quiet,
    ),
    Row(
        Rule(
            "L8",
            State.UNRESPONSIVE,
            "no probe got any HTTP answer for >= W.unresponsive_after_s (counted from the last "
            "answer) AND no progress for >= W.unresponsive_after_s",
        ),
        lambda f: f.failing_for_s >= f.wcfg.unresponsive_after_s and f.quiet_for_s >= f.wcfg.unresponsive_after_s,
        no_answer,
    ),
    Row(
        Rule(
            "L9",
            State.UNRESPONSIVE,
            "/health answered 503 (vLLM: engine dead) for >= W.unresponsive_after_s AND no "
            "progress for >= W.unresponsive_after_s",
        ),
        lambda f: f.dead_503_for_s >= f.wcfg.unresponsive_after_s and f.quiet_for_s >= f.wcfg.unresponsive_after_s,
        lambda f: (
            f"/health 503 (engine dead) for {f.dead_503_for_s:.0f} s, "
            f"last progress {ago(f.now, f.track.last_progress_at)}"
        ),
    ),
    Row(
        Rule(
            "L10",
            UNCHANGED,
            "no probe answered this tick AND one sent at an earlier tick is still running (each bounded by "
            "its timeout): no news, the verdict stands (L1-L9 still apply)",
        ),
        lambda f: f.obs.probes_pending_s is not None and f.track.observed,
        lambda f: f.track.evidence,
    ),
    Row(
        Rule(
            "L11",
            State.BUSY,
            "progress this tick (counters, or responses flowing to clients per the kernel) AND (/health failed "
            "OR took >= R.health_timeout_s)",
        ),
        lambda f: f.seen.progressed and not f.seen.health_in_time,
        busy_progressing,
    ),
    Row(
        Rule(
            "L12",
            State.HEALTHY,
            "progress this tick (counters, or responses flowing to clients per the kernel) AND /health answered "
            "2xx in < R.health_timeout_s",
        ),
        lambda f: f.seen.progressed and f.seen.health_in_time,
        healthy_progressing,
    ),
    Row(
        ENGINE_QUIET := Rule(
            "L19",
            State.STALLED,
            "/metrics readable AND running + waiting > 0 (the engine's own count, and not one that lags its "
            "steps: an observation's queue_lags, SGLang's) AND now - max(last progress, work first queued) >= "
            "W.engine_quiet_s AND the engine's processes (named, or the whole process of an engine that serves "
            "from it: observe/procs.py) quiet for >= W.engine_quiet_s, as L22 measures it (the whole process "
            "allowed W.probe_cpu_s for each probe of guardian's it answered): work in the engine that its "
            "processes do not touch (an engine that burns CPU while nothing moves is left to L13 and L14)",
        ),
        lambda f: (
            f.obs.metrics is not None
            and not f.obs.queue_lags
            and f.obs.metrics.queued > 0
            and f.now - f.quiet_since >= f.wcfg.engine_quiet_s
            and f.engine_quiet_for_s >= f.wcfg.engine_quiet_s
        ),
        engine_quiet,
    ),
    Row(
        Rule(
            "L20",
            State.STALLED,
            "queue judged AND queued work (as L13) AND a canary sent after the last progress (and after "
            "work was first queued) failed by C5 (its engine never touched it)",
        ),
        lambda f: f.work_queued and f.track.engine_proof_at is not None and f.track.engine_proof_at >= f.quiet_since,
        engine_proof,
    ),
    Row(
        STALL_WINDOW := Rule(
            "L13",
            State.STALLED,
            "queue judged AND queued work (running + waiting > 0, or clients waiting >= W.client_wait_s) "
            "AND now - max(last progress, work first queued) >= max(W.stall_window_s, min(W.max_step_s, "
            "STEP_MARGIN x the replica's longest recent step))",
        ),
        lambda f: f.work_queued and f.now - f.quiet_since >= max(f.wcfg.stall_window_s, f.step_bound_s or 0.0),
        lambda f: (
            f"{f.work_said} and no counter progress for {f.now - f.quiet_since:.0f} s (/health {f.health_said})"
            f"{gpus(f.obs)}"
        ),
    ),
    Row(
        STALL_CANARY := Rule(
            "L14",
            State.STALLED,
            "queue judged AND queued work (as L13) AND a canary sent after the last progress (and "
            "after work was first queued) failed with no progress while it ran (C4) AND now - max(last "
            "progress, work first queued) >= min(W.max_step_s, STEP_MARGIN x the replica's longest recent step) "
            "(W.stall_window_s while none is learned): a stall canary never ends a step shorter than the "
            "replica's own",
        ),
        stall_proven,
        stall_proof,
    ),
    Row(
        Rule(
            "L21",
            State.IDLE_DEAD,
            "queue judged AND no queued work AND the last canary failed by C5 (its engine never touched "
            "it) AND no progress since it was sent: one such canary is proof enough",
        ),
        lambda f: (
            f.seen.judged
            and f.seen.queued == 0
            and f.track.engine_proof_at is not None
            and (f.track.last_progress_at is None or f.track.last_progress_at <= f.track.engine_proof_at)
        ),
        engine_proof,
    ),
    Row(
        Rule(
            "L15",
            State.IDLE_DEAD,
            "queue judged AND no queued work AND consecutive failed canaries >= W.canary_failures",
        ),
        lambda f: f.seen.judged and f.seen.queued == 0 and f.track.canary_failures >= f.wcfg.canary_failures,
        lambda f: f"idle, and {f.track.canary_failures} canary completions failed in a row (/health {f.health_said})",
    ),
    Row(
        Rule("L16", State.BUSY, "/health failed AND last progress < W.stall_window_s ago"),
        lambda f: not f.obs.health.ok and f.quiet_for_s < f.wcfg.stall_window_s,
        lambda f: f"/health {f.obs.health.error}, progress {ago(f.now, f.track.last_progress_at)}",
    ),
    Row(
        Rule(
            "L17",
            State.DEGRADED,
            "some probe failed, or /metrics unreadable, or a canary failed (no grounds to restart yet)",
        ),
        lambda f: bool(f.problems),
        lambda f: "; ".join(f.problems),
    ),
    Row(
        Rule("L18", State.HEALTHY, "otherwise"),
        lambda f: True,
        lambda f: f.work_said if f.obs.metrics is not None else "answering",
    ),
)
RULES = tuple(row.rule for row in ROWS)
NO_NEWS_RULE = next(rule.id for rule in RULES if rule.outcome == UNCHANGED)  # evidence of nothing
# A replica not observed yet is starting, as by the first rule that says so.
NOT_OBSERVED_RULE = next(rule.id for rule in RULES if rule.outcome == State.STARTING)
# STALL_WINDOW and STALL_CANARY (in the rows above) are the two rules a learned step holds back.
