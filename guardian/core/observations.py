"""Immutable values that observers make of the world and the core reads.

Times are monotonic seconds (CLOCK_MONOTONIC, floats), the clock of the ``now`` the core is
given and of systemd's *TimestampMonotonic properties, so that they compare directly and no step
of the wall clock moves a window. Persisted wall-clock times are converted at the edge
(act/state.py). One exception, named as such: VllmSample.process_start_time_s is vLLM's own
wall-clock stamp, only compared with itself (to tell one serving process from another).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from .vocab import SERVING_STATES, ActiveState, LoadState, PortOwner, UnitFileState


@dataclass(frozen=True)
class Probe:
    """One bounded HTTP request to a replica."""

    ok: bool  # answered 2xx within its timeout
    status: int | None = None  # HTTP status, None when no answer
    latency_s: float = 0.0
    error: str | None = None  # "timeout", "connection refused", "HTTP 503", "unparseable: ..."
    pending: bool = False  # no answer yet: the probe is still in flight, carried to a later tick
    sent_at: float | None = None  # when it was sent (monotonic s); None: not known

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
    process_start_time_s: float | None = None  # the serving process's start (wall time): who answered
    # vllm:request_prefill_time_seconds' cumulative buckets (upper bound, count), inf last: how long
    # the prefills that ended took, to a bucket (liveness learns a replica's longest step from them)
    prefill_buckets: tuple[tuple[float, float], ...] = ()

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
    load_state: LoadState
    active_state: ActiveState
    sub_state: str = ""  # shown only; depends on the unit type
    unit_file_state: UnitFileState = UnitFileState.OTHER
    inactive_exit_mono: float | None = None  # when it last began starting (monotonic s)
    main_pid: int = 0
    invocation_id: str = ""
    restart: str = ""  # Restart= setting: no, on-failure, always, ...
    n_restarts: int = 0
    # Units that starting this one would stop, with their ActiveState.
    conflicts: tuple[tuple[str, ActiveState], ...] = ()
    fragment_path: str = ""
    job_pending: bool = False

    @property
    def exists(self) -> bool:
        return self.load_state is not LoadState.NOT_FOUND

    @property
    def masked(self) -> bool:
        return self.load_state is LoadState.MASKED or self.unit_file_state.masked


@dataclass(frozen=True)
class CanaryResult:
    ok: bool
    started_at: float
    latency_s: float
    error: str | None = None


@dataclass(frozen=True)
class WarmupResult:
    """A replica's warm-up requests (core/proxy/drain.py D13-D16), as they ended."""

    started_at: float  # the WarmUp action's tick (the drain's warm_from): which warm-up it is
    served: int
    failed: int
    took_s: float
    error: str | None = None  # the file could not be read, or the first request's failure


@dataclass(frozen=True)
class RestartOutcome:
    """The end of a restart job guardian issued."""

    unit: str
    result: str  # systemd job result: done, failed, timeout, canceled, ...; or why none was made
    issued: bool = False  # a job was made (False: refused on the re-check, or the call failed)
    ok: bool = False  # the job ended "done"


class PeerKind(StrEnum):
    """Who is at the other end of a connection to a replica's port."""

    PROXY = "proxy"  # the [proxy]'s unit (nginx), or an address or unit in watchdog.proxy_peers
    GUARDIAN = "guardian"  # guardian's own probes and canaries
    MONITORING = "monitoring"  # a unit or address in watchdog.monitoring_peers (Prometheus)
    OTHER = "other"  # a client: a local unit, or a remote address


@dataclass(frozen=True)
class Peer:
    """Connections from one peer to a replica's port."""

    kind: PeerKind
    name: str  # the local peer's unit ("batch.service"), else its address ("10.0.0.7")
    connections: int


@dataclass(frozen=True)
class ConnView:
    """What the kernel shows of a replica's established connections at one look (sock_diag with
    tcp_info), and of its unit's CPU; "clients" are the peers of kind PROXY and OTHER.

    A response "flows" on a client connection when the replica sent it bytes that were acked
    since the previous look while the client sent nothing in that time (tcp_info's
    tcpi_bytes_acked up, tcpi_last_data_recv older than the previous look): a token stream, or
    any answer that lasts longer than a look, not a quick answer to a new request. A client
    "waits" when it spoke last (tcpi_last_data_recv more recent than tcpi_last_data_sent): its
    request has had no byte of answer since.
    """

    connections: int  # established to the replica's port, every peer
    flowing: int  # client connections with a response flowing since the previous look
    bytes_out: int  # bytes acked on those since the previous look
    waiting: int  # client connections waiting for an answer
    since_s: float | None  # seconds since the previous look (None: the first look: nothing flows yet)
    cpu_s: float | None  # CPU time the unit's cgroup used since the previous look (None: unknown)
    peers: tuple[Peer, ...] = ()
    truncated: bool = False  # more sockets than guardian reads in one look: counts are partial
    # seconds since the last byte was sent on a connection where a response flowed (tcp_info's
    # tcpi_last_data_sent): when the flow was last seen alive, not when it was looked at
    last_flow_s: float | None = None
    at: float | None = None  # when the kernel was read (monotonic): the times above count from it
    waits_s: tuple[float, ...] = ()  # how long each waiting client has waited, longest first (at most 16)

    @property
    def oldest_wait_s(self) -> float:
        """How long the longest-waiting client has waited (0.0: none waits)."""
        return self.waits_s[0] if self.waits_s else 0.0


@dataclass(frozen=True)
class Activity:
    """What one group of a replica's processes did between two looks (observe/procs.py)."""

    used_s: float  # CPU time plus time waiting on a run queue (a starved process waits there; a frozen one does not)
    running: bool  # one of them was running, runnable or in uninterruptible wait (R, D) at the look
    procs: int


@dataclass(frozen=True)
class ProcView:
    """A replica's own processes at one look: its API server and its engine, each an Activity
    (None: not known at this look: a process of the group began or ended since the last one, or
    nothing could be read). ENGINE is None too where no process is named as the engine's
    (observe/procs.ENGINE_NAMES): API is then the whole replica."""

    at: float  # when they were read (monotonic)
    since_s: float | None  # seconds since the previous look (None: the first look: nothing is known yet)
    api: Activity | None
    engine: Activity | None
    engine_named: bool = False  # some process is named as the engine's
    # No process is named, and its engine computes in the server's own process (guardian/engines/:
    # single_process): ENGINE is the whole replica's Activity, as API is.
    engine_whole: bool = False


@dataclass(frozen=True)
class GpuLife:
    """One GPU's own sign of life, where NVML reports it (observe/nvml.py): evidence shown, not judged.
    A wedged GB10 drew 16-27 W against about 45 W healthy while its utilization read about 96 %
    either way (eugr/spark-vllm-docker #260): power says more than utilization there."""

    index: int
    power_w: float | None  # nvmlDeviceGetPowerUsage; None: not reported
    util_pct: float | None  # nvmlDeviceGetUtilizationRates().gpu; None: not reported


@dataclass(frozen=True)
class UnitDeclared:
    """How a replica's unit says its server runs, as systemd reports it, read when units may have
    changed (at start, after a daemon-reload or a change of unit files, a reload of guardian's
    config): what the stop bound (core/stopping.py) and the hazards from outside the replica
    (core/outside.py) judge. ARGV is its first ExecStart= with its ${VAR}s expanded from ENV, the
    environment the unit gives it (Environment=, overridden by its EnvironmentFile= entries in
    order), as systemd runs it; UNSEEN says why it could not be read (nothing else is known then)."""

    unit: str
    argv: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    user: str = ""  # User= ("": root)
    uid: int | None = 0  # User='s uid on this box; None: a name this box does not resolve
    timeout_stop_s: float | None = None  # TimeoutStopSec; None: infinity, or not reported
    env_unreadable: tuple[str, ...] = ()  # its EnvironmentFile= entries that exist and could not be read
    unseen: str | None = None


@dataclass(frozen=True)
class LogindConf:
    """What systemd-logind reads its settings from, in the order it applies them (the main file,
    then its drop-ins by name: a later assignment wins), each (path, text): read by the observer
    (observe/declared.py), judged by core/outside.py. ERROR says why some could not be read."""

    files: tuple[tuple[str, str], ...] = ()
    error: str | None = None


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
    warmup: WarmupResult | None = None  # a warm-up that ended since the last tick
    unit_error: str | None = None
    # The probes sent earlier are still running (each bounded by its timeout): no news this
    # tick, and the three probes above are placeholders.
    probes_pending_s: float | None = None
    conns: ConnView | None = None  # None: the kernel's view could not be read (said once)
    procs: ProcView | None = None  # None: the replica's processes could not be read
    gpus: tuple[GpuLife, ...] = ()  # each GPU's power and utilization; (): no NVML, or it reports neither
    declared: UnitDeclared | None = None  # how its unit says it runs, as last read (None: not read)
    # False: its engine serves no page at /metrics as started (llama-server without --metrics: 501;
    # SGLang without --enable-metrics: 404): the rules that need its counts are not applied, and its
    # failure is no problem (guardian/engines/).
    metrics_offered: bool = True
    # Its page is answered by the engine's own loop, not the API server alone (llama-server): a read
    # that times out while /health answers in time is the engine not answering.
    metrics_via_engine: bool = False
    # Its page's running and waiting are refreshed only with its engine's own steps (SGLang: per prefill
    # batch and every 40 decode steps): once it idles they may still show the last batch's work, so
    # they never prove work in a quiet engine (L19); a canary still tells.
    queue_lags: bool = False

    @property
    def all_probes_failed(self) -> bool:
        return not (self.health.answered or self.metrics_probe.answered or self.models_probe.answered)


@dataclass(frozen=True)
class RestartRequest:
    """An operator's `guardian restart NAME`, recorded in the state file for the daemon."""

    id: str
    replica: str
    at: float
    # `--wait D`: until when a refusal that passes by itself keeps it waiting rather than answered
    # (core/admission.py A4; now's clock); None: answered at once, whatever the refusal
    wait_until: float | None = None
    # When the command that asked stops waiting for the answer (now's clock; None: a request of an
    # older guardian, which says no end), and whether that command is gone (observe/askers.py)
    expires: float | None = None
    asker: tuple[int, int] | None = None  # (pid, start in clock ticks after boot) of the asking command
    asker_gone: bool = False
    no_drain: bool = False  # `--no-drain`: restarted at once under a proxy, not marked down first (D2)


@dataclass(frozen=True)
class Pause:
    until: float | None  # None: until resumed
    reason: str = "operator"
    since: float | None = None  # when it began (None: a pause written before 0.2.0 recorded it)


@dataclass(frozen=True)
class PersistentView:
    """The part of the persistent state the core reads."""

    restarts: dict[str, tuple[float, ...]] = field(default_factory=dict)  # replica -> restart times
    pauses: dict[str, Pause] = field(default_factory=dict)
    resumed_at: dict[str, float] = field(default_factory=dict)  # budget counts restarts after this only
    requests: tuple[RestartRequest, ...] = ()  # operators' restart requests not answered yet
    proxy_down: tuple[str, ...] = ()  # replicas guardian last marked down at the proxy
    # replica -> the longest steps it was seen to take, (s, when learned), longest first: a Track starts from them
    step_seconds: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    # replica -> its last successful canaries' latencies (s), newest last: a Track starts from them
    canary_latencies: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # replica -> its base fraction: the one it had before the memory guard first lowered it (act/state.py);
    # a lowered fraction is raised back toward it, never above it; a replica with none is never raised
    fraction_bases: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class MemorySample:
    """The kernel's memory figures at one moment."""

    total_bytes: int
    available_bytes: int  # MemAvailable: what everything else on the box can still get
    free_bytes: int  # MemFree: about what a unified-memory GPU sees as free (cudaMemGetInfo on GB10)
    psi_some_avg10: float | None  # percent of time some task stalled on memory, last 10 s
    psi_full_avg10: float | None
    # The reclaimable file cache, Active(file) + Inactive(file): counted in MemAvailable, NOT in MemFree,
    # and on GB10 not free to the GPU (core/fit/startfit.py)
    file_cache_bytes: int = 0


@dataclass(frozen=True)
class EnvFile:
    """One EnvironmentFile= entry of a unit, in the unit's order, with what the observer read."""

    path: str
    text: str | None  # None: the file does not exist (fine for an optional "-" entry)
    error: str | None = None  # it exists but could not be read


@dataclass(frozen=True)
class UnitWiring:
    """What a replica's unit shows of its wiring for the memory guard, which the core judges
    (core/memory/wiring.py): its EnvironmentFile= entries as read, its ExecStart=, and guardian's env file
    for it; or why the unit could not be looked at (UNSEEN: a container without a unit, systemd
    not answering), said as it is."""

    unit: str
    env_files: tuple[EnvFile, ...] = ()
    exec_start: tuple[str, ...] = ()
    env_path: str = ""
    unseen: str | None = None
    knob: str | None = "--gpu-memory-utilization"  # its engine's memory flag (guardian/engines/); None: none
    engine: str = "vLLM"  # its engine, as people write it


@dataclass(frozen=True)
class ReplicaMemoryObservation:
    """What the memory observer found about one replica."""

    configured_fraction: float | None  # GPU_MEMORY_UTILIZATION in guardian's env file for it
    cmdline_fraction: float | None  # --gpu-memory-utilization on its main process's command line
    usage_bytes: int | None  # NVML per-process memory of its process tree, when the driver says
    wiring: UnitWiring | None  # what its unit shows of its wiring; None: not looked at yet
    start_failure: str | None = None  # vLLM's refusal in this start's journal (asked only while a lowering is pending)
    # The unit's cgroup memory (systemd's MemoryCurrent), asked only while the replica may be loading, for
    # the start guard; never for a container replica (its unit holds only the engine's CLI). On GB10 CUDA
    # allocations are not charged to it: there it shows only a start's host-side memory.
    cgroup_bytes: int | None = None


@dataclass(frozen=True)
class MemoryObservation:
    sample: MemorySample
    total_bytes: int  # what --gpu-memory-utilization is a fraction of
    replicas: dict[str, ReplicaMemoryObservation]
    # model -> the peer URLs (memory.peer_urls) that answered healthy and list that model
    peers_serving: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    consumers: str = ""  # "db.service 22.1 GiB, make (pid 9) 9.3 GiB": asked only when below the line


@dataclass(frozen=True)
class ProxyView:
    """What the shell last applied at the proxy (act/proxy.py), for core/proxy/drain.py."""

    applied: frozenset[str]  # replicas marked down at the proxy now
    failed: frozenset[str] = frozenset()  # the down set of the last attempt, when it failed
    error: str | None = None  # why it failed


@dataclass(frozen=True)
class FleetMember:
    """A replica as some box's guardian published it in etcd."""

    box: str
    name: str
    model: str
    state: str
    serves: bool | None = None  # watchdog/judge.py serves(), as its box judged it (None: a guardian that did not say)
    weights: str | None = None  # the fingerprint of its weights, as its box read it (core/weights.py; None: unknown)

    @property
    def serving(self) -> bool:
        return self.serves if self.serves is not None else self.state in SERVING_STATES


@dataclass(frozen=True)
class FleetSlot:
    """A planned-restart slot held in the fleet."""

    box: str
    replica: str
    model: str
    key: str = ""  # its etcd key
    # Why its key is held by no guardian's lease ("": it is bound to the lease BOX publishes its
    # replicas with): one that reads as a guardian's but is bound to no lease, or to another's. It
    # still counts as held (the safe side: a guardian's slot skipped by mistake would let one more
    # planned restart run than max_planned_restarts); it is named, for an operator to delete.
    not_leased: str = ""


@dataclass(frozen=True)
class FleetView:
    """What the shell read from etcd this tick (fleet/sync.py), for core/fleet.py."""

    box: str  # this box's name in the fleet
    ok: bool  # etcd answered
    error: str | None = None
    members: tuple[FleetMember, ...] = ()
    slots: tuple[FleetSlot, ...] = ()

    @property
    def mine(self) -> frozenset[str]:
        return frozenset(s.replica for s in self.slots if s.box == self.box)

    def serving(self, model: str, except_replica: str) -> list[str]:
        """Replicas of MODEL serving in the fleet (healthy or busy, holding no slot), but this one."""
        held = {(s.box, s.replica) for s in self.slots}
        return [
            f"{m.box}/{m.name}"
            for m in self.members
            if m.model == model
            and m.serving
            and (m.box, m.name) not in held
            and not (m.box == self.box and m.name == except_replica)
        ]


@dataclass(frozen=True)
class TickObservation:
    """Everything one tick observed; the input of core.tick.decide."""

    replicas: dict[str, ReplicaObservation]
    persistent: PersistentView
    memory: MemoryObservation | None = None  # None: the memory guard is off
    proxy: ProxyView | None = None  # None: no proxy configured
    fleet: FleetView | None = None  # None: no fleet configured, or not read (core/fleet.py)
    # replica -> the bytes its processes held that did not come back when they exited (core/fit/startfit.py
    # U8's standing findings, as the shell keeps them: act/fit.py not_returned_now); read by the start loop
    not_returned: Mapping[str, int] = field(default_factory=dict)
    # the replicas whose weights changed since the last tick's decision (W2, core/notices.py's
    # weights_read): what the memory guard learned of their old weights is dropped before it judges
    weights_moved: tuple[str, ...] = ()


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"
