"""Immutable values that observers make of the world and the policy reads.

Times are wall-clock seconds since the epoch (floats), the same clock as the ``now`` the
policy is given, so that systemd's activation timestamps compare directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Probe:
    """One bounded HTTP request to a replica."""

    ok: bool  # answered 2xx within its timeout
    status: int | None = None  # HTTP status, None when no answer
    latency_s: float = 0.0
    error: str | None = None  # "timeout", "connection refused", "HTTP 503", "unparseable: ..."

    @property
    def answered(self) -> bool:
        """The server answered at all (any status): the API server process is alive."""
        return self.status is not None


@dataclass(frozen=True)
class VllmSample:
    """The progress-relevant part of one replica's /metrics page."""

    running: float
    waiting: float
    kv_cache_usage: float
    generation_tokens: float
    prompt_tokens: float
    iteration_count: float
    iteration_sum: float
    request_success: float
    gpu_memory_utilization: float | None = None
    model_names: tuple[str, ...] = ()

    @property
    def queued(self) -> float:
        return self.running + self.waiting

    def progress_counters(self) -> tuple[float, ...]:
        return (
            self.generation_tokens,
            self.prompt_tokens,
            self.iteration_count,
            self.iteration_sum,
            self.request_success,
        )


@dataclass(frozen=True)
class UnitInfo:
    """What systemd says about one unit (D-Bus properties)."""

    name: str
    load_state: str  # loaded, not-found, masked, error, bad-setting
    active_state: str  # active, activating, deactivating, inactive, failed, reloading
    sub_state: str = ""
    unit_file_state: str = ""  # enabled, disabled, masked, static, ...
    inactive_exit_ts: float | None = None  # when it last began starting (epoch s)
    main_pid: int = 0
    invocation_id: str = ""
    restart: str = ""  # Restart= setting: no, on-failure, always, ...
    n_restarts: int = 0
    # Units that starting this one would stop, with their ActiveState.
    conflicts: tuple[tuple[str, str], ...] = ()
    fragment_path: str = ""
    job_pending: bool = False

    @property
    def exists(self) -> bool:
        return self.load_state not in ("not-found", "")

    @property
    def running(self) -> bool:
        return self.active_state in ("active", "reloading")


@dataclass(frozen=True)
class PortOwner:
    """Who listens on a replica's TCP port, as seen from /proc and systemd."""

    port: int
    pid: int | None  # None: nobody listens
    unit: str | None  # the unit whose cgroup holds that PID


@dataclass(frozen=True)
class CanaryResult:
    ok: bool
    started_at: float
    latency_s: float
    error: str | None = None


@dataclass(frozen=True)
class RestartOutcome:
    """The end of a restart job guardian issued."""

    unit: str
    result: str  # systemd job result: done, failed, timeout, canceled, ... or "error: ..."
    finished_at: float


@dataclass(frozen=True)
class ReplicaObservation:
    name: str
    at: float
    unit: UnitInfo | None  # None: systemd could not be asked (D-Bus error)
    health: Probe
    metrics_probe: Probe
    metrics: VllmSample | None
    models_probe: Probe
    models: tuple[str, ...] | None
    port_owner: PortOwner | None = None
    canary: CanaryResult | None = None  # a canary that finished since the last tick
    restart_outcome: RestartOutcome | None = None
    unit_error: str | None = None

    @property
    def all_probes_failed(self) -> bool:
        return not (self.health.answered or self.metrics_probe.answered or self.models_probe.answered)


@dataclass(frozen=True)
class Pause:
    until: float | None  # None: until resumed
    reason: str = "operator"


@dataclass(frozen=True)
class PersistentView:
    """The part of the persistent state the policy reads."""

    restarts: dict[str, tuple[float, ...]] = field(default_factory=dict)  # replica -> restart times
    pauses: dict[str, Pause] = field(default_factory=dict)
    resumed_at: dict[str, float] = field(default_factory=dict)  # budget counts restarts after this only
