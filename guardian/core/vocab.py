"""guardian's vocabulary: every state, verdict, gate and decision is one of these values.

Strings appear only where text leaves guardian (journal lines, status.json, the CLI); inside,
these enums and the port-owner union are what modules compare. systemd's own state names are
parsed into enums at the D-Bus edge, so "which ActiveStates count as running" is said once, here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class State(StrEnum):
    """A replica's liveness verdict (rules in core/watchdog/liveness.py)."""

    PAUSED = "paused"
    UNKNOWN = "unknown"
    STOPPED = "stopped"
    STARTING = "starting"
    WRONG_MODEL = "wrong-model"
    UNRESPONSIVE = "unresponsive"
    BUSY = "busy"
    HEALTHY = "healthy"
    STALLED = "stalled"
    IDLE_DEAD = "idle-dead"
    DEGRADED = "degraded"
    PORT_TAKEN = "port-taken"


# Verdicts that ask for a restart.
RESTART_STATES = frozenset({State.STALLED, State.UNRESPONSIVE, State.IDLE_DEAD})
# A replica in one of these is serving: it can carry the load while another restarts.
SERVING_STATES = frozenset({State.HEALTHY, State.BUSY})
# Not serving yet after a start: another restart on the box waits for it (vLLM #35920).
LOADING_STATES = frozenset({State.STARTING})


class Priority(StrEnum):
    """Journal priority, as the guide assigns them: info a state change, warning an action
    taken, error an action refused or failed, critical giving up."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"

    @property
    def syslog(self) -> int:
        return {"info": 6, "warning": 4, "error": 3, "critical": 2}[self.value]


class Decision(StrEnum):
    """The GUARDIAN_DECISION field of a journal line."""

    STATE = "state"  # a replica's verdict changed
    RESTART = "restart"  # a restart was issued
    REFUSED = "refused"  # a restart was refused (GUARDIAN_GATE says which gate)
    DRY_RUN = "dry-run"  # a restart or lowering that dry-run mode did not perform
    RESTARTED = "restarted"  # a restart job ended well
    RESTART_FAILED = "restart-failed"  # a restart job ended badly
    MEMORY = "memory"  # the memory guard lowered a fraction (an action taken)
    MEMORY_NOTE = "memory-note"  # the memory guard's state, deferrals and results
    HAZARD = "hazard"  # a set-up that makes a restart hurt something
    REQUEST = "request"  # an operator's request (pause, resume, restart)
    PROXY = "proxy"  # a replica marked down or up at the proxy (rules in core/proxy/drain.py)
    FLEET = "fleet"  # a planned restart waiting for, taking or giving back a fleet slot (core/fleet.py)
    CACHE = (
        "cache"  # a start's fit: the page cache released before it, or a start that may not fit (core/fit/startfit.py)
    )
    NOTE = "note"  # anything else: start, limits, bus, reload


class Gate(StrEnum):
    """Why a restart may not happen now. Admission gates first, then the unit gates."""

    BUDGET = "budget"
    BACKOFF = "backoff"
    ONE_AT_A_TIME = "one-at-a-time"
    DBUS = "dbus"
    MASKED = "masked"
    NOT_LOADED = "not-loaded"
    DISABLED = "disabled"
    INACTIVE = "inactive"
    JOB_PENDING = "job-pending"
    PORT_OWNER = "port-owner"
    PORT_UNKNOWN = "port-unknown"
    CONFLICTS = "conflicts"
    ENV_FILE = "env-file"  # the memory guard could not write the replica's env file
    FLEET = "fleet"  # a planned restart waits for the fleet (core/fleet.py)
    NO_PEER = "no-peer"  # under a proxy, a planned restart waits for another replica of its model to serve
    NO_FIT = "no-fit"  # the start cannot fit in the memory the device would see free (core/fit/startfit.py U7)
    START_LOOP = "start-loop"  # its starts fail one after another while its memory did not come back (A6)


class MemVerdict(StrEnum):
    """What the memory guard concluded on a tick (rules in core/memory/memguard.py)."""

    NOT_SQUEEZED = "not-squeezed"
    PENDING = "pending"
    DONE = "done"
    MISMATCH = "mismatch"
    ABANDONED = "abandoned"
    RETRY = "retry"
    GAVE_UP = "gave-up"
    COOLDOWN = "cooldown"
    UNWIRED = "unwired"
    FLOOR = "floor"
    NO_FIT = "no-fit"
    NO_PEER = "no-peer"
    DEFERRED = "deferred"
    DRY_RUN = "dry-run"
    DRAINING = "draining"
    LOWER = "lower"
    RETRY_WAITS = "retry-waits"  # a failed start's next fraction is written; its restart waits for admission
    RETRY_RESTART = "retry-restart"  # ... and is issued once admitted
    RETRY_GIVEN_UP = "retry-given-up"  # ... or given up: its restart budget is spent (M18)
    RETRY_DROPPED = "retry-dropped"  # ... or dropped: the replica serves again, or is paused (M19)
    RESTORE_WAIT = "restore-wait"  # a replica below its base: headroom not clear for long enough yet
    RESTORE_COOLDOWN = "restore-cooldown"
    RESTORE_NO_PEER = "restore-no-peer"
    RESTORE_DEFERRED = "restore-deferred"
    RESTORE_DRAINING = "restore-draining"
    RESTORE_DRY_RUN = "restore-dry-run"
    RAISE = "raise"


class ActiveState(StrEnum):
    """systemd's ActiveState. Unknown values (a newer systemd) parse to OTHER."""

    ACTIVE = "active"
    RELOADING = "reloading"
    INACTIVE = "inactive"
    FAILED = "failed"
    ACTIVATING = "activating"
    DEACTIVATING = "deactivating"
    MAINTENANCE = "maintenance"
    REFRESHING = "refreshing"
    OTHER = "other"

    @classmethod
    def parse(cls, value: str) -> ActiveState:
        try:
            return cls(value)
        except ValueError:
            return cls.OTHER

    @property
    def running(self) -> bool:
        """Up, and serving as far as systemd knows."""
        return self in _RUNNING

    @property
    def transitional(self) -> bool:
        """On its way up or down: a restart now would race with it."""
        return self in _TRANSITIONAL

    @property
    def down(self) -> bool:
        """Not running and not on its way: an operator's stop, or a failure."""
        return self in (ActiveState.INACTIVE, ActiveState.FAILED)


_RUNNING = frozenset({ActiveState.ACTIVE, ActiveState.RELOADING, ActiveState.REFRESHING})
_TRANSITIONAL = frozenset({ActiveState.ACTIVATING, ActiveState.DEACTIVATING, ActiveState.MAINTENANCE})


class LoadState(StrEnum):
    LOADED = "loaded"
    NOT_FOUND = "not-found"
    BAD_SETTING = "bad-setting"
    ERROR = "error"
    MASKED = "masked"
    STUB = "stub"
    MERGED = "merged"
    OTHER = "other"

    @classmethod
    def parse(cls, value: str) -> LoadState:
        try:
            return cls(value)
        except ValueError:
            return cls.OTHER


class UnitFileState(StrEnum):
    ENABLED = "enabled"
    ENABLED_RUNTIME = "enabled-runtime"
    LINKED = "linked"
    LINKED_RUNTIME = "linked-runtime"
    ALIAS = "alias"
    MASKED = "masked"
    MASKED_RUNTIME = "masked-runtime"
    STATIC = "static"
    DISABLED = "disabled"
    INDIRECT = "indirect"
    GENERATED = "generated"
    TRANSIENT = "transient"
    BAD = "bad"
    OTHER = "other"

    @classmethod
    def parse(cls, value: str) -> UnitFileState:
        try:
            return cls(value)
        except ValueError:
            return cls.OTHER

    @property
    def enabled(self) -> bool:
        """Started at boot, or has no [Install] section to enable: guardian may look after it."""
        return self in _ENABLED

    @property
    def masked(self) -> bool:
        return self in (UnitFileState.MASKED, UnitFileState.MASKED_RUNTIME)


_ENABLED = frozenset(
    {
        UnitFileState.ENABLED,
        UnitFileState.ENABLED_RUNTIME,
        UnitFileState.STATIC,
        UnitFileState.GENERATED,
        UnitFileState.TRANSIENT,
    }
)


class RestartKind(StrEnum):
    """Why a RestartUnit action is made: the watchdog's answer to a hang, or an operator's request.
    (The memory guard's restarts are SetFraction actions: the env file is written first.)"""

    HANG = "hang"
    OPERATOR = "operator"


# --- who holds a replica's port: a tagged union ---------------------------------------------


@dataclass(frozen=True)
class Nobody:
    """Nobody listens on the port."""

    port: int


@dataclass(frozen=True)
class HeldBy:
    """UNIT's cgroup holds the port's socket (None: in no unit, or systemd could not say); PID is
    a process of it (None: it exited meanwhile)."""

    port: int
    pid: int | None
    unit: str | None
    # Seen through a container engine (core/container.py): the container holding the port (its
    # scope, or the engine's proxy forwarding to it), and whether it is the replica's own.
    container: str | None = None
    own_container: bool = False
    via: str = ""  # how the container was recognised, for the journal
    # Known not to be the replica's: a container its engine names that is another, a holder of
    # the other engine, a forged engine scope (observe/containers.py resolve). A holder that may
    # still be the replica's own leaves this False; watchdog/facts.py port_taken_by judges the rest.
    stray: bool = False

    def holder_text(self) -> str:
        if self.container is not None:
            return f"container {self.container} ({self.via})" if self.via else f"container {self.container}"
        who = self.unit or "a process guardian cannot map to a unit"
        return f"{who} ({self.via})" if self.via else who


@dataclass(frozen=True)
class Hidden:
    """Someone listens, but who is hidden from guardian: no cgroup id for the socket (kernel older
    than 5.7, or no netlink) and no permission to read other users' /proc/PID/fd."""

    port: int


@dataclass(frozen=True)
class Unreadable:
    """The kernel's socket table could not be read at all."""

    port: int


PortOwner = Nobody | HeldBy | Hidden | Unreadable
