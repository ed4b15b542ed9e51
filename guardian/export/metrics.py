"""guardian's own metrics: what was done, counted as the executor performs each action, and
gauges set from each tick's state and observation.

Names follow Prometheus' rules: the `guardian_` prefix, base units (seconds, bytes, ratios),
`_total` only on counters, labels of low cardinality (replica, unit, state, reason, gate, kind).
vLLM's own series are not re-exported: Prometheus scrapes each replica directly (files.py).
Counters count since guardian started; Prometheus' rate() and increase() handle the reset.

Every configured replica's counters and histograms exist from the start, at 0, for every label
value the code can count (configure): a series that appears with its first increment is missed by
increase(), which needs two samples. No `_created` series are exported (_Registry).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from ..config import Config, ReplicaConfig
from ..core import admission
from ..core.actions import Action, LogLine, RestartUnit, SetFraction
from ..core.fit import startfit
from ..core.hazards import Hazard
from ..core.observations import PersistentView, ReplicaObservation, TickObservation
from ..core.proxy.bypass import Bypass
from ..core.tick import TickState
from ..core.vocab import RESTART_STATES, SERVING_STATES, Decision, Gate, RestartKind, State
from ..core.watchdog.track import Track
from ..core.weights import Weights
from ..observe.clock import Now

DETECTION_BUCKETS_S = (1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 300)
TO_SERVING_BUCKETS_S = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800)
CANARY_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2, 5, 10, 15, 30)
TICK_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5)
MAX_BYPASS_PEERS = 8

# The reasons a restart is counted under (restart_reason), from the enums that decide them: an
# operator's request, the memory guard's change of fraction, or the verdict that asked for it.
OPERATOR_REASON, MEMORY_REASON = "operator", "memory"
RESTART_REASONS: tuple[str, ...] = (
    OPERATOR_REASON,
    MEMORY_REASON,
    *sorted(str(s) for s in RESTART_STATES),
)
REFUSAL_GATES: tuple[str, ...] = tuple(str(g) for g in Gate)
RELEASE_HOWS = ("own", "all")


def restart_reason(kind: RestartKind, state: State | None) -> str:
    """What a RestartUnit of KIND is counted under; STATE is its replica's verdict. tick.py issues
    the watchdog's restarts only in RESTART_STATES, so the result is one of RESTART_REASONS."""
    if kind is RestartKind.OPERATOR:
        return OPERATOR_REASON
    return str(state) if state is not None else str(State.UNKNOWN)


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


class _Registry(CollectorRegistry):
    """A registry without prometheus_client's `<name>_created` series: a creation time per label set
    that no dashboard or alert reads, a sixth of the page. Filtered here rather than with
    prometheus_client's process-wide switch, which would change every other registry too."""

    def collect(self) -> Iterator[Metric]:
        for family in super().collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


@dataclass(frozen=True)
class _PerReplica:
    """A family with a series per configured replica and per value of its other label, if any."""

    family: Counter | Histogram
    values: tuple[str, ...] = ()

    def label_sets(self, replica: str) -> list[tuple[str, ...]]:
        return [(replica, v) for v in self.values] if self.values else [(replica,)]


class _EachTick:
    """A labelled gauge that each tick sets anew: what clear() and then labels(...).set(...) for each
    label set leaves, series and order alike; its children are kept, not made again, while a tick
    sets the same label sets in the same order (making ~36 of them a tick at two replicas was most
    of the gauges' CPU). Applied at once by commit(), after the tick's put()s."""

    def __init__(self, gauge: Gauge) -> None:
        self.gauge = gauge
        self._children: dict[tuple[str, ...], Gauge] = {}
        self._values: dict[tuple[str, ...], float] = {}

    def put(self, value: float, *labels: str) -> None:
        self._values[labels] = value

    def commit(self) -> None:
        if list(self._values) != list(self._children):
            self.gauge.clear()
            self._children = {labels: self.gauge.labels(*labels) for labels in self._values}
        for labels, value in self._values.items():
            self._children[labels].set(value)
        self._values = {}


class Metrics:
    """guardian's registry. The executor tells it of every action it performs (count); the daemon
    sets the gauges after each tick (gauges, tick_done) and after a scan (set_hazards)."""

    def __init__(self, version: str, cfg: Config | None = None) -> None:
        self.registry: CollectorRegistry = _Registry(auto_describe=True)
        self.build_info = self._gauge("guardian_build_info", "guardian's version (always 1)", "version")
        self.build_info.labels(version).set(1)
        self._replica_families()
        self._restart_families()
        self._box_families()
        # set anew by each tick's gauges(), in this order
        self._each_tick = tuple(
            _EachTick(g)
            for g in (
                self.state,
                self.info,
                self.paused,
                self.paused_since,
                self.proxy_down,
                self.budget,
                self.gave_up,
                self.last_progress,
                self.fraction,
            )
        )
        (
            self._state,
            self._info,
            self._paused,
            self._paused_since,
            self._proxy_down,
            self._budget,
            self._gave_up,
            self._last_progress,
            self._fraction,
        ) = self._each_tick
        self._decided_at: dict[str, float] = {}  # replica -> mono of its last restart decision
        self._configured: frozenset[str] = frozenset()
        if cfg is not None:
            self.configure(cfg)

    def _replica_families(self) -> None:
        """The replicas' verdicts, pauses, places at the proxy, progress and fractions, and the
        clients that bypass the proxy."""
        gauge = self._gauge
        self.state = gauge(
            "guardian_replica_state",
            "1 for the replica's current verdict, 0 for the others",
            "replica",
            "unit",
            "state",
        )
        self.info = gauge(
            "guardian_replica_info", "a configured replica (always 1): its unit and model", "replica", "unit", "model"
        )
        self.paused = gauge(
            "guardian_replica_paused", "1 while an operator's pause of the replica is in force", "replica", "unit"
        )
        self.paused_since = gauge(
            "guardian_replica_paused_since_timestamp_seconds",
            "wall time the replica's pause began (as `guardian pause` recorded it); only while paused",
            "replica",
            "unit",
        )
        self.proxy_down = gauge(
            "guardian_proxy_marked_down",
            "1 while the proxy has the replica marked down by guardian, 0 while up; only with [proxy]",
            "replica",
            "unit",
        )
        self.last_progress = gauge(
            "guardian_replica_last_progress_timestamp_seconds",
            "wall time of the replica's last progress (token counters, kv cache or requests moved)",
            "replica",
        )
        self.fraction = gauge(
            "guardian_replica_gpu_memory_utilization_ratio",
            "the replica's gpu_memory_utilization as its /metrics reports it",
            "replica",
        )
        self.bypass = gauge(
            "guardian_bypass_connections",
            "connections to a replica's own port from a client that bypasses the proxy (at most 8 per replica)",
            "replica",
            "peer",
        )

    def _restart_families(self) -> None:
        """Restarts, refusals and canaries."""
        gauge, counter, histogram = self._gauge, self._counter, self._histogram
        self.restarts = counter(
            "guardian_restarts",
            "restarts guardian decided and handed to its restart step, by reason (a verdict, operator, "
            "memory); the re-check right before the job may still refuse one (its journal line says so)",
            "replica",
            "reason",
        )
        self.refusals = counter(
            "guardian_restart_refusals",
            "restart refusals, once per episode, by the gate that refused",
            "replica",
            "gate",
        )
        self.budget = gauge(
            "guardian_restart_budget_remaining", "restarts left in the replica's budget window", "replica"
        )
        self.gave_up = gauge(
            "guardian_gave_up", "1 while the replica needs a restart and its budget is spent", "replica"
        )
        self.detection = histogram(
            "guardian_detection_seconds",
            "from the start of a hang to the restart decision",
            DETECTION_BUCKETS_S,
            "replica",
        )
        self.to_serving = histogram(
            "guardian_restart_to_serving_seconds",
            "from a restart decision to the replica judged serving again",
            TO_SERVING_BUCKETS_S,
            "replica",
        )
        self.canary = histogram(
            "guardian_canary_duration_seconds", "canary completions, each to its answer or failure", CANARY_BUCKETS_S
        )
        self.canary_failures = counter("guardian_canary_failures", "canaries that failed", "replica")

    def _box_families(self) -> None:
        """The box's mode, memory, hazards, etcd and loop."""
        gauge, counter, histogram = self._gauge, self._counter, self._histogram
        self.dry_run = gauge("guardian_dry_run", "1 while guardian runs in dry run: it restarts and lowers nothing")
        self.etcd_up = gauge(
            "guardian_etcd_up", "1 when this tick's etcd read succeeded, 0 when it failed; only with [fleet]", "fleet"
        )
        self.mem_available = gauge(
            "guardian_memory_available_bytes", "MemAvailable: what everything else can still get"
        )
        self.psi_some = gauge(
            "guardian_memory_pressure_some_ratio", "share of the last 10 s some task stalled on memory (PSI some avg10)"
        )
        self.mem_floor = gauge("guardian_memory_floor_ratio", "the memory guard's floor: no fraction goes below it")
        self.lowerings = counter("guardian_memory_lowerings", "fractions the memory guard lowered", "replica")
        self.cache_released = counter(
            "guardian_cache_released_bytes",
            "page cache released before a start guardian caused (core/fit/startfit.py), by how: own (its model "
            "files, posix_fadvise) or all (drop_caches)",
            "replica",
            "how",
        )
        self.not_returned = gauge(
            "guardian_memory_not_returned_bytes",
            "memory a replica's processes held that did not come back when they exited "
            f"(startfit {startfit.NOT_RETURNED.id})",
            "replica",
        )
        self.mem_free = gauge("guardian_memory_free_bytes", "MemFree: about what a unified-memory GPU sees as free")
        self.file_cache = gauge(
            "guardian_memory_file_cache_bytes", "the reclaimable file cache, Active(file) + Inactive(file)"
        )
        self.hazards = gauge("guardian_hazards", "1 for each hazard present now", "kind", "unit")
        self.weights = gauge(
            "guardian_replica_weights_info",
            "1 with the fingerprint of the weights a replica loaded",
            "replica",
            "weights",
        )
        self.weights_differ = gauge(
            "guardian_model_weights_differ", "1 while this box's replicas of a model serve different weights", "model"
        )
        self.tick = histogram("guardian_tick_duration_seconds", "one tick, observe to act", TICK_BUCKETS_S)
        self.last_tick = gauge("guardian_last_tick_timestamp_seconds", "wall time the last tick completed")

    def _gauge(self, name: str, documentation: str, *labels: str) -> Gauge:
        return Gauge(name, documentation, labels, registry=self.registry)

    def _counter(self, name: str, documentation: str, *labels: str) -> Counter:
        return Counter(name, documentation, labels, registry=self.registry)

    def _histogram(self, name: str, documentation: str, buckets_s: tuple[float, ...], *labels: str) -> Histogram:
        return Histogram(name, documentation, labels, buckets=buckets_s, registry=self.registry)

    # --- the configured replicas' series, at 0 from the start ------------------------------------
    def _per_replica(self) -> tuple[_PerReplica, ...]:
        """Every family count() adds to per replica, with every value of its other label."""
        return (
            _PerReplica(self.restarts, RESTART_REASONS),
            _PerReplica(self.refusals, REFUSAL_GATES),
            _PerReplica(self.canary_failures),
            _PerReplica(self.lowerings),
            _PerReplica(self.cache_released, RELEASE_HOWS),
            _PerReplica(self.detection),
            _PerReplica(self.to_serving),
        )

    def configure(self, cfg: Config) -> None:
        """At start and on every reload: each configured replica's counters and histograms exist, at
        0 until counted; those of a replica no longer configured go (they would never move again)."""
        names = frozenset(r.name for r in cfg.replicas)
        for per in self._per_replica():
            for gone in sorted(self._configured - names):
                for labels in per.label_sets(gone):
                    per.family.remove(*labels)
            for name in sorted(names):
                for labels in per.label_sets(name):
                    per.family.labels(*labels)  # created at 0, not incremented
        self._configured = names

    # --- what was done, as the executor performs it ------------------------------------------
    def count(self, action: Action, tracks: Mapping[str, Track], at: Now) -> None:
        """Count ACTION, performed AT, decided from the replicas' TRACKS (for a restart's reason and
        how long its hang went undetected)."""
        if isinstance(action, RestartUnit):
            t = tracks.get(action.replica)
            self.restarts.labels(action.replica, restart_reason(action.kind, t.state if t else None)).inc()
            self._decided_at[action.replica] = at.mono
            start = detection_start(t) if t is not None and action.kind is RestartKind.HANG else None
            if start is not None:
                self.detection.labels(action.replica).observe(max(0.0, at.mono - start))
        elif isinstance(action, SetFraction):
            if action.new < action.old:  # a raise back toward the base is not a lowering
                self.lowerings.labels(action.replica).inc()
            if action.restart:
                self.restarts.labels(action.replica, MEMORY_REASON).inc()
                self._decided_at[action.replica] = at.mono
        elif isinstance(action, LogLine) and action.decision is Decision.REFUSED and action.replica and action.gate:
            self.refusals.labels(action.replica, str(action.gate)).inc()

    def set_not_returned(self, found: Mapping[str, int]) -> None:
        self.not_returned.clear()
        for replica, n in found.items():
            self.not_returned.labels(replica).set(n)

    def released(self, replica: str, how: str, freed_bytes: int) -> None:
        """The page cache a start's fit released (act/fit.py)."""
        self.cache_released.labels(replica, how).inc(freed_bytes)

    # --- the state after a tick ----------------------------------------------------------------
    def gauges(self, cfg: Config, state: TickState, obs: TickObservation, persistent: PersistentView, at: Now) -> None:
        """The replicas' and the box's gauges after the tick that observed OBS and left STATE, AT."""
        self._box(cfg, obs)
        self._set_bypass(state.bypassing)
        tracks = state.tracks
        marked_down = obs.proxy.applied if obs.proxy is not None else None  # None: no [proxy]
        for r in cfg.replicas:
            self._info.put(1, r.name, r.unit, r.model)
            if marked_down is not None:
                self._proxy_down.put(1 if r.name in marked_down else 0, r.name, r.unit)
            t = tracks.get(r.name)
            if t is not None:
                self._replica(cfg, r, t, obs.replicas.get(r.name), persistent, at)
        for g in self._each_tick:
            g.commit()

    def _box(self, cfg: Config, obs: TickObservation) -> None:
        """The box's mode, etcd as this tick found it, and its memory."""
        self.dry_run.set(1 if cfg.dry_run else 0)
        self.etcd_up.clear()
        if obs.fleet is not None:
            self.etcd_up.labels(cfg.fleet.name).set(1 if obs.fleet.ok else 0)
        # NaN while the memory guard is off: every comparison with it is false (no floor alert)
        self.mem_floor.set(cfg.memory.floor if cfg.memory.enabled else float("nan"))
        if obs.memory is not None:
            self.mem_available.set(obs.memory.sample.available_bytes)
            self.mem_free.set(obs.memory.sample.free_bytes)
            self.file_cache.set(obs.memory.sample.file_cache_bytes)
            if obs.memory.sample.psi_some_avg10 is not None:
                self.psi_some.set(obs.memory.sample.psi_some_avg10 / 100)

    def _replica(
        self,
        cfg: Config,
        r: ReplicaConfig,
        t: Track,
        o: ReplicaObservation | None,
        persistent: PersistentView,
        at: Now,
    ) -> None:
        for s in State:
            self._state.put(1 if s is t.state else 0, r.name, r.unit, str(s))
        # L1 judges a replica paused exactly while an operator's pause is in force; it began when
        # the pause says (recorded by `guardian pause`), else when this process first saw it
        paused = t.state is State.PAUSED
        self._paused.put(1 if paused else 0, r.name, r.unit)
        if paused:
            pause = persistent.pauses.get(r.name)
            began = pause.since if pause is not None and pause.since is not None else t.state_since
            self._paused_since.put(at.wall - (at.mono - began), r.name, r.unit)
        b = admission.budget(r.name, persistent, at.mono, cfg)
        self._budget.put(max(0, b.limit - b.used), r.name)
        self._gave_up.put(1 if b.spent and t.state in RESTART_STATES else 0, r.name)
        if t.last_progress_at is not None:
            self._last_progress.put(at.wall - (at.mono - t.last_progress_at), r.name)
        if o is not None and o.metrics is not None and o.metrics.gpu_memory_utilization is not None:
            self._fraction.put(o.metrics.gpu_memory_utilization, r.name)
        if o is not None and o.canary is not None:
            self.canary.observe(o.canary.latency_s)
            if not o.canary.ok:
                self.canary_failures.labels(r.name).inc()
        decided = self._decided_at.get(r.name)
        if decided is not None and t.state in SERVING_STATES and t.start_ts is not None and t.start_ts >= decided:
            self.to_serving.labels(r.name).observe(max(0.0, at.mono - decided))
            del self._decided_at[r.name]

    def set_weights(self, found: Mapping[str, Weights | None], differ: Iterable[Hazard]) -> None:
        """Each replica's fingerprint (none while unknown), and the models whose replicas differ (W1)."""
        self.weights.clear()
        for replica, w in found.items():
            if w is not None:
                self.weights.labels(replica, w.digest).set(1)
        self.weights_differ.clear()
        for h in differ:  # W1 and W3 alike: the model's replicas do not all serve the same weights
            self.weights_differ.labels(h.key.split(":", 1)[1]).set(1)

    def set_hazards(self, found: Iterable[Hazard]) -> None:
        self.hazards.clear()
        for h in found:
            self.hazards.labels(h.key.split(":", 1)[0], h.unit or "").set(1)

    def _set_bypass(self, bypassing: Iterable[Bypass]) -> None:
        """Bounded in cardinality: the 8 peers with the most connections per replica."""
        self.bypass.clear()
        per: dict[str, list[Bypass]] = {}
        for b in bypassing:
            per.setdefault(b.replica, []).append(b)
        for replica, found in per.items():
            for b in sorted(found, key=lambda b: (-b.connections, b.peer))[:MAX_BYPASS_PEERS]:
                self.bypass.labels(replica, b.peer).set(b.connections)

    def tick_done(self, duration_s: float, at: Now) -> None:
        self.tick.observe(duration_s)
        self.last_tick.set(at.wall)

    def render(self) -> bytes:
        return generate_latest(self.registry)
