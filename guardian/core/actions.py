"""What the core asks the shell to do, one type per act. Every Action goes through the one
dispatcher (act/executor.py: `Executor.perform`, matched exhaustively), which performs it or hands
it to its part: the fleet's slots (AcquireSlot, ReleaseSlot) to fleet/sync.py, SyncProxy to
act/proxy.py. DrainReplica is not an Action: it never leaves the core (the tick's memory step,
core/memory/memstep.py _take_memory_actions, consumes it)."""

from __future__ import annotations

from dataclasses import dataclass

from .vocab import Decision, Gate, Priority, RestartKind, State

# A hung replica's stop (kill_first), once its restart job has begun, before its processes are
# SIGKILLed. systemd's KillUnit hits whatever runs in the unit at that moment: a process that does
# end on SIGTERM (a SIGSTOPped one gets SIGCONT with it) is gone within this and never killed, so
# the kill cannot reach the new process of a restart that went on without it. A hung vLLM never
# ends its stop by itself: it waits this long instead of the unit's TimeoutStopSec.
HUNG_STOP_GRACE_S = 1.0


@dataclass(frozen=True)
class LogLine:
    """One journal line, with every field that journalctl can filter on. The core says its
    verdicts, refusals and actions with these; the shell makes them too, for what it sees and does
    itself (act/, fleet/, daemon.py: a restart job's end, the proxy's and the fleet's news, hazards,
    a tick that failed), and writes them all (act/journal.py)."""

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
    kill_first: bool = False  # SIGKILL the unit's processes if the stop lasts HUNG_STOP_GRACE_S (a hung replica)
    stop_timeout_s: float | None = None  # a drained replica: SIGKILL its processes if the stop takes longer
    # The warning line that says this restart ("...; restarting vllm-a.service (restart 2 of 3 ...)"):
    # written by the restart once the re-check right before acting passes, so that a restart refused
    # there is said only as refused (act/restart.py)
    said: LogLine | None = None
    # no change of its fraction in flight (no lowering or raise pending, none written and unread): a
    # start that cannot fit at its own fraction may be lowered to fit (core/fit/startfit.py U6)
    may_lower: bool = False


@dataclass(frozen=True)
class StartCanary:
    replica: str
    timeout_s: float  # its bound (R.canary_timeout_s: a late answer is an answer)
    sent_at: float | None = None  # the tick's now: its result carries it, so liveness knows which canary it is


@dataclass(frozen=True)
class RecordCanaryLatencies:
    """Write these replicas' canary latencies (newest last) to the state file, where a Track
    created later (guardian restarted or reloaded) starts from them. At most one a tick."""

    latencies: tuple[tuple[str, tuple[float, ...]], ...]  # (replica, latencies), for those that changed
    # (replica, its longest steps as (s, when learned)), for those that changed
    steps: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = ()


@dataclass(frozen=True)
class SetFraction:
    """Write NEW to the replica's env file (a lowering, or a raise back toward its base), then (if
    RESTART) restart its unit through the gates."""

    replica: str
    unit: str
    old: float
    new: float
    restart: bool  # False: only write the file (systemd is restarting the unit by itself)
    evidence: str
    retry: bool = False  # after a failed start with the previous fraction: a failed unit may be restarted
    stop_timeout_s: float | None = None  # drained first: SIGKILL its processes if the stop takes longer
    # SIGKILL the unit's processes if the stop lasts HUNG_STOP_GRACE_S, as RestartUnit's: the start guard
    # stops a start that is taking the box's last memory at once (core/memory/startguard.py)
    kill_first: bool = False


@dataclass(frozen=True)
class DrainReplica:
    """The memory guard asks for REPLICA to be drained at the proxy before it lowers it (M16).
    Consumed by the tick's memory step (core/memory/memstep.py), which keeps its drains (core/proxy/draining.py);
    never performed."""

    replica: str
    evidence: str


@dataclass(frozen=True)
class AnswerRequest:
    """Answer an operator's restart request now: refused, no such replica, a dry run, or restarted
    as a hung replica. A restart issued for it (RestartUnit.request_id) is answered when its job ends."""

    request_id: str
    replica: str
    ok: bool
    message: str
    # refused when its `--wait` ended, by a refusal that passes by itself (A4): `guardian restart`
    # exits with its own code, so that a script can tell "try again later" from "fix something"
    waited_out: bool = False


@dataclass(frozen=True)
class RequestWaits:
    """An operator's request waits (A4): TEXT, what it waits for, is shown to the waiting `guardian
    restart` (recorded with the request in the state file). Not an answer: the request stays open."""

    request_id: str
    replica: str
    text: str


@dataclass(frozen=True)
class AcquireSlot:
    """Ask the fleet for a planned-restart slot for REPLICA (core/fleet.py F6; fleet/sync.py)."""

    replica: str
    model: str


@dataclass(frozen=True)
class ReleaseSlot:
    """Give REPLICA's fleet slot back (core/fleet.py F7)."""

    replica: str


@dataclass(frozen=True)
class SyncProxy:
    """Make the proxy mark down exactly DOWN and every other replica of this box up: the last action
    of every tick when a proxy is configured. The whole set every time (act/proxy.py applies only a
    change), so a failed apply is tried again."""

    down: frozenset[str]


@dataclass(frozen=True)
class WarmUp:
    """Serve REPLICA's warm-up requests (R.warmup_file, one token each) within TIMEOUT_S; the result
    comes back as a WarmupResult carrying STARTED_AT (core/proxy/drain.py D13)."""

    replica: str
    started_at: float
    timeout_s: float


Action = (
    LogLine
    | RestartUnit
    | StartCanary
    | WarmUp
    | RecordCanaryLatencies
    | SetFraction
    | AnswerRequest
    | RequestWaits
    | AcquireSlot
    | ReleaseSlot
    | SyncProxy
)
