"""guardian's own metrics, folded from each tick's state, observation and actions.

Names follow Prometheus' rules: the `guardian_` prefix, base units (seconds, bytes, ratios),
`_total` only on counters, labels of low cardinality (replica, unit, state, reason, gate, kind).
vLLM's own series are not re-exported: Prometheus scrapes each replica directly (files.py).
Counters count since guardian started; Prometheus' rate() and increase() handle the reset.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..config import Config
from ..core import admission
from ..core.actions import Action, LogLine, LowerFraction, RestartUnit
from ..core.bypass import Bypass
from ..core.hazards import Hazard
from ..core.liveness import Track
from ..core.observations import PersistentView, TickObservation
from ..core.vocab import RESTART_STATES, SERVING_STATES, Decision, RestartKind, State
from ..observe.clock import Now

DETECTION_BUCKETS_S = (1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 300)
TO_SERVING_BUCKETS_S = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800)
CANARY_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2, 5, 10, 15, 30)
TICK_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5)
MAX_BYPASS_PEERS = 8


def detection_start(t: Track) -> float | None:
    """When the hang began, as far as guardian can tell (monotonic): the first probe without an
    answer (unresponsive), the last progress or the first tick with work (stalled), the verdict
    itself otherwise (idle-dead: the canaries that failed are the evidence)."""
    if t.state is State.UNRESPONSIVE and t.failing_since is not None:
        return t.failing_since
    if t.state is State.STALLED:
        marks = [m for m in (t.last_progress_at, t.work_since) if m is not None]
        if marks:
            return max(marks)
    return t.state_since


class Metrics:
    def __init__(self, version: str) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.build_info = Gauge("guardian_build_info", "guardian's version (always 1)", ["version"], registry=r)
        self.build_info.labels(version).set(1)
        self.state = Gauge(
            "guardian_replica_state",
            "1 for the replica's current verdict, 0 for the others",
            ["replica", "unit", "state"],
            registry=r,
        )
        self.info = Gauge(
            "guardian_replica_info",
            "a configured replica (always 1): its unit and model",
            ["replica", "unit", "model"],
            registry=r,
        )
        self.restarts = Counter(
            "guardian_restarts",
            "restarts guardian issued, by reason (a verdict, operator, memory)",
            ["replica", "reason"],
            registry=r,
        )
        self.refusals = Counter(
            "guardian_restart_refusals",
            "restart refusals, once per episode, by the gate that refused",
            ["replica", "gate"],
            registry=r,
        )
        self.budget = Gauge(
            "guardian_restart_budget_remaining", "restarts left in the replica's budget window", ["replica"], registry=r
        )
        self.gave_up = Gauge(
            "guardian_gave_up", "1 while the replica needs a restart and its budget is spent", ["replica"], registry=r
        )
        self.detection = Histogram(
            "guardian_detection_seconds",
            "from the start of a hang to the restart decision",
            buckets=DETECTION_BUCKETS_S,
            registry=r,
        )
        self.to_serving = Histogram(
            "guardian_restart_to_serving_seconds",
            "from a restart decision to the replica judged serving again",
            buckets=TO_SERVING_BUCKETS_S,
            registry=r,
        )
        self.canary = Histogram(
            "guardian_canary_duration_seconds",
            "canary completions, each to its answer or failure",
            buckets=CANARY_BUCKETS_S,
            registry=r,
        )
        self.canary_failures = Counter("guardian_canary_failures", "canaries that failed", ["replica"], registry=r)
        self.last_progress = Gauge(
            "guardian_replica_last_progress_timestamp_seconds",
            "wall time of the replica's last progress (token counters, kv cache or requests moved)",
            ["replica"],
            registry=r,
        )
        self.fraction = Gauge(
            "guardian_replica_gpu_memory_utilization_ratio",
            "the replica's gpu_memory_utilization as its /metrics reports it",
            ["replica"],
            registry=r,
        )
        self.mem_available = Gauge(
            "guardian_memory_available_bytes", "MemAvailable: what everything else can still get", registry=r
        )
        self.psi_some = Gauge(
            "guardian_memory_pressure_some_ratio",
            "share of the last 10 s some task stalled on memory (PSI some avg10)",
            registry=r,
        )
        self.mem_floor = Gauge(
            "guardian_memory_floor_ratio", "the memory guard's floor: no fraction goes below it", registry=r
        )
        self.lowerings = Counter(
            "guardian_memory_lowerings", "fractions the memory guard lowered", ["replica"], registry=r
        )
        self.hazards = Gauge("guardian_hazards", "1 for each hazard present now", ["kind", "unit"], registry=r)
        self.bypass = Gauge(
            "guardian_bypass_connections",
            "connections to a replica's own port from a client that bypasses the proxy (at most 8 per replica)",
            ["replica", "peer"],
            registry=r,
        )
        self.tick = Histogram(
            "guardian_tick_duration_seconds", "one tick, observe to act", buckets=TICK_BUCKETS_S, registry=r
        )
        self.last_tick = Gauge("guardian_last_tick_timestamp_seconds", "wall time the last tick completed", registry=r)
        self._decided_at: dict[str, float] = {}  # replica -> mono of its last restart decision

    # --- folding one tick -------------------------------------------------------------------
    def fold(
        self,
        cfg: Config,
        tracks: dict[str, Track],
        obs: TickObservation,
        actions: Iterable[Action],
        persistent: PersistentView,
        now: Now,
    ) -> None:
        # NaN while the memory guard is off: every comparison with it is false (no floor alert)
        self.mem_floor.set(cfg.memory.floor if cfg.memory.enabled else float("nan"))
        for a in actions:
            if isinstance(a, RestartUnit):
                t = tracks.get(a.replica)
                reason = "operator" if a.kind is RestartKind.OPERATOR else str(t.state if t else "unknown")
                self.restarts.labels(a.replica, reason).inc()
                self._decided_at[a.replica] = now.mono
                start = detection_start(t) if t is not None and a.kind is RestartKind.HANG else None
                if start is not None:
                    self.detection.observe(max(0.0, now.mono - start))
            elif isinstance(a, LowerFraction):
                self.lowerings.labels(a.replica).inc()
                if a.restart:
                    self.restarts.labels(a.replica, "memory").inc()
                    self._decided_at[a.replica] = now.mono
            elif isinstance(a, LogLine) and a.decision is Decision.REFUSED and a.replica and a.gate:
                self.refusals.labels(a.replica, str(a.gate)).inc()
        self.state.clear()
        self.info.clear()
        for g in (self.budget, self.gave_up, self.last_progress, self.fraction):
            g.clear()
        for r in cfg.replicas:
            self.info.labels(r.name, r.unit, r.model).set(1)
            t = tracks.get(r.name)
            if t is None:
                continue
            for s in State:
                self.state.labels(r.name, r.unit, str(s)).set(1 if s is t.state else 0)
            b = admission.budget(r.name, persistent, now.mono, cfg)
            self.budget.labels(r.name).set(max(0, b.limit - b.used))
            self.gave_up.labels(r.name).set(1 if b.spent and t.state in RESTART_STATES else 0)
            if t.last_progress_at is not None:
                self.last_progress.labels(r.name).set(now.wall - (now.mono - t.last_progress_at))
            o = obs.replicas.get(r.name)
            if o is not None and o.metrics is not None and o.metrics.gpu_memory_utilization is not None:
                self.fraction.labels(r.name).set(o.metrics.gpu_memory_utilization)
            if o is not None and o.canary is not None:
                self.canary.observe(o.canary.latency_s)
                if not o.canary.ok:
                    self.canary_failures.labels(r.name).inc()
            decided = self._decided_at.get(r.name)
            if decided is not None and t.state in SERVING_STATES and t.start_ts is not None and t.start_ts >= decided:
                self.to_serving.observe(max(0.0, now.mono - decided))
                del self._decided_at[r.name]
        if obs.memory is not None:
            self.mem_available.set(obs.memory.sample.available_bytes)
            if obs.memory.sample.psi_some_avg10 is not None:
                self.psi_some.set(obs.memory.sample.psi_some_avg10 / 100)

    def set_hazards(self, found: Iterable[Hazard]) -> None:
        self.hazards.clear()
        for h in found:
            self.hazards.labels(h.key.split(":", 1)[0], h.unit or "").set(1)

    def set_bypass(self, bypassing: Iterable[Bypass]) -> None:
        """Bounded in cardinality: the 8 peers with the most connections per replica."""
        self.bypass.clear()
        per: dict[str, list[Bypass]] = {}
        for b in bypassing:
            per.setdefault(b.replica, []).append(b)
        for replica, found in per.items():
            for b in sorted(found, key=lambda b: (-b.connections, b.peer))[:MAX_BYPASS_PEERS]:
                self.bypass.labels(replica, b.peer).set(b.connections)

    def tick_done(self, duration_s: float, now: Now) -> None:
        self.tick.observe(duration_s)
        self.last_tick.set(now.wall)

    def render(self) -> bytes:
        return generate_latest(self.registry)
