"""One tick's decision in the making (Tick), and what one tick hands the next (TickState). Pure.

core/tick.py's decide() makes a Tick and runs the steps over it in order; each step is a function
of the module that holds its rules (core/watchdog/verdicts.py, proxy/draining.py, restarts.py, requests.py,
admission.py, memstep.py, fleet.py, proxy/bypass.py), which reads what the Tick was given and adds to
what it has decided. The Tick itself decides nothing: it holds the inputs, the next state's parts
as the steps make them, and the action list.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import Config
from .actions import AcquireSlot, Action, LogLine
from .memory import memstate, startguard
from .observations import TickObservation
from .proxy import bypass, drain
from .proxy.drainstate import Drain, Phase
from .vocab import LOADING_STATES, RestartKind
from .watchdog.track import Track


@dataclass(frozen=True)
class TickState:
    """What one tick hands the next (the daemon keeps it in memory; the state file is the shell's)."""

    tracks: dict[str, Track] = field(default_factory=dict)
    mem: memstate.MemTrack = field(default_factory=memstate.MemTrack)
    requests_taken: frozenset[str] = frozenset()  # operators' requests acted on, answer not yet recorded
    drains: dict[str, Drain] = field(default_factory=dict)  # replicas marked down at the proxy (core/proxy/drain.py)
    # request id -> why it waits (a fleet slot, or a refusal that passes by itself: A4), as last said
    waits_said: dict[str, tuple[str, ...]] = field(default_factory=dict)
    slots_released: frozenset[str] = frozenset()  # fleet slots given back that the view may still show
    bypass_seen: dict[tuple[str, str], float] = field(default_factory=dict)  # (replica, peer) -> connected since
    bypassing: tuple[bypass.Bypass, ...] = ()  # clients bypassing the proxy now (core/proxy/bypass.py B2)
    starts: dict[str, startguard.Start] = field(default_factory=dict)  # starts the start guard watches (S1)

    @property
    def proxy_down(self) -> frozenset[str]:
        return frozenset(self.drains)


@dataclass(frozen=True)
class RestartAsk:
    """A restart to put through admission (core/restarts.py restart())."""

    kind: RestartKind
    head: str  # how its journal lines start: "replica a: stalled (...)"
    evidence: str  # what the restart is recorded with
    request_id: str | None = None  # an operator's request: answered when the job ends, its refusals said every time


class Tick:
    """One tick's decision in the making: what it was given (the previous state, the observation,
    now, the config) and what it has decided so far (the next state's parts and the actions).
    core/tick.py's decide() runs each step over it once, in order, then takes next_state(...) and the
    actions."""

    def __init__(self, previous: TickState, obs: TickObservation, now: float, cfg: Config) -> None:
        self.previous = previous
        self.obs = obs
        self.now = now
        self.cfg = cfg
        self.actions: list[Action] = []
        # The next state's parts, as the steps make them.
        self.tracks: dict[str, Track] = {}
        self.drains = drain.forget_unconfigured(previous.drains, cfg)
        self.mem = previous.mem
        self.requests_taken = previous.requests_taken
        asked = {request.id for request in obs.persistent.requests}
        self.waits_said = {rid: said for rid, said in previous.waits_said.items() if rid in asked}
        self.starts = previous.starts
        # Replicas whose planned restart after their drain a dry run stood for on this tick
        # (draining.py): it blocks the others as the restart would have (A3), though no track waits
        # for a job that never comes. (A dry run's other restarts block nothing, as before.)
        self.stood_for: set[str] = set()

    @property
    def restart_under_way(self) -> bool:
        """A restart is under way on this box (in flight since an earlier tick, or issued on this
        one, a dry run's included): no other starts (A3)."""
        return bool(self.stood_for) or any(track.restart_in_flight for track in self.tracks.values())

    @property
    def planned_restarts_blocked(self) -> bool:
        """A planned restart (an operator's, a lowering's) waits: a restart is under way, or a
        drain is in progress."""
        return self.restart_under_way or any(down.phase is Phase.DRAINING for down in self.drains.values())

    def slot_in_use(self, name: str) -> bool:
        """NAME's planned restart is not over (its fleet slot is kept, F7): drained or away, asking
        for its slot, requested, being lowered, or restarting."""
        track = self.tracks.get(name)
        pending = self.mem.pending
        waiting = (request for request in self.obs.persistent.requests if request.id not in self.requests_taken)
        return (
            name in self.drains
            or any(isinstance(action, AcquireSlot) and action.replica == name for action in self.actions)
            or any(request.replica == name for request in waiting)
            or (pending is not None and pending.replica == name)
            or (track is not None and (track.restart_in_flight or track.state in LOADING_STATES))
        )

    def next_state(
        self,
        slots_released: frozenset[str],
        bypass_seen: dict[tuple[str, str], float],
        bypassing: tuple[bypass.Bypass, ...],
    ) -> TickState:
        """The state the next tick starts from: the parts the steps made here, and those steps 7
        and 8 returned to decide()."""
        return TickState(
            self.tracks,
            self.mem,
            self.requests_taken,
            self.drains,
            self.waits_said,
            slots_released,
            bypass_seen,
            bypassing,
            self.starts,
        )

    def say(self, line: LogLine) -> None:
        self.actions.append(line)
