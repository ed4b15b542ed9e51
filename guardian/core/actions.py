"""What the core asks the shell to do. The executor (act/executor.py) performs each one."""

from __future__ import annotations

from dataclasses import dataclass

from .vocab import Decision, Gate, Priority, RestartKind, State


@dataclass(frozen=True)
class LogLine:
    """One journal line. Every field that journalctl can filter on is set here, by the core."""

    priority: Priority
    message: str
    decision: Decision
    replica: str | None = None
    unit: str | None = None
    state: State | None = None  # GUARDIAN_STATE: the verdict this line is about
    gate: Gate | None = None  # GUARDIAN_GATE: the gate that refused
    rule: str | None = None  # GUARDIAN_RULE: the id of the rule behind the verdict or refusal
    hazard: str | None = None  # GUARDIAN_HAZARD: the hazard's key


@dataclass(frozen=True)
class RestartUnit:
    replica: str
    unit: str
    kind: RestartKind
    evidence: str
    request_id: str | None = None  # an operator's request, answered when the job ends
    kill_first: bool = False  # SIGKILL the unit's processes once the restart job is queued (a hung replica)
    stop_timeout_s: float | None = None  # a drained replica: SIGKILL its processes if the stop takes longer


@dataclass(frozen=True)
class StartCanary:
    replica: str
    timeout_s: float  # the canary's deadline (liveness.canary_deadline)


@dataclass(frozen=True)
class RecordCanaryLatencies:
    """Write these replicas' canary latencies (newest last) to the state file, where a Track
    created later (guardian restarted or reloaded) starts from them. At most one a tick."""

    latencies: tuple[tuple[str, tuple[float, ...]], ...]  # (replica, latencies), for those that changed


@dataclass(frozen=True)
class LowerFraction:
    """Write NEW to the replica's env file, then (if RESTART) restart its unit through the gates."""

    replica: str
    unit: str
    old: float
    new: float
    restart: bool  # False: only write the file (systemd is restarting the unit by itself)
    evidence: str
    retry: bool = False  # after a failed start with the previous fraction: a failed unit may be restarted
    stop_timeout_s: float | None = None  # drained first: SIGKILL its processes if the stop takes longer


@dataclass(frozen=True)
class DrainReplica:
    """The memory guard asks for REPLICA to be drained at the proxy before it lowers it. Consumed by
    the tick (core/drain.py), never by the executor."""

    replica: str
    evidence: str


@dataclass(frozen=True)
class AnswerRequest:
    """Answer an operator's restart request without acting (refused, or unknown replica)."""

    request_id: str
    replica: str
    ok: bool
    message: str


@dataclass(frozen=True)
class AcquireSlot:
    """Ask the fleet for a planned-restart slot for REPLICA (core/fleet.py F6; fleet/sync.py)."""

    replica: str
    model: str


@dataclass(frozen=True)
class ReleaseSlot:
    """Give REPLICA's fleet slot back (core/fleet.py F7)."""

    replica: str


Action = (
    LogLine
    | RestartUnit
    | StartCanary
    | RecordCanaryLatencies
    | LowerFraction
    | AnswerRequest
    | AcquireSlot
    | ReleaseSlot
)
