"""What one look at a replica shows, as the liveness rows (core/watchdog/liveness.py) read it: `Seen`
(what this observation shows, worked out once), `Facts` (the track with it folded in, the
observation, the config), whether the queue is judged at this look, whose listener answers, and the
evidence the rows give. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...config import ReplicaConfig, WatchdogConfig
from ..container import engine_holder
from ..observations import Activity, Pause, Probe, ProcView, ReplicaObservation, UnitInfo
from ..vocab import HeldBy, PortOwner
from .steps import longest_step_s

# For the type checker alone: track.py imports the rows (a new track's rule is their first STARTING
# rule), and the rows import this module; at run time it would be a cycle.
if TYPE_CHECKING:
    from .track import Track


@dataclass(frozen=True)
class Seen:
    """What this observation shows, worked out once for the rules and the canary schedule."""

    counters_moved: bool  # a counter moved or the kv cache changed
    progressed: bool  # any progress: counters, a canary that answered, or a response flowing
    waiting_clients: int  # clients waiting that count as queued work (_waits)
    waiting_since: float  # when the longest-waiting of them spoke
    queued: float  # running + waiting on /metrics, plus those clients
    health_in_time: bool
    canary_failed: bool  # a canary failed this tick with no progress while it ran
    judged: bool  # its queue is judged at this look (queue_judged)


@dataclass(frozen=True)
class Facts:
    """Everything the rules read at one tick: the track with this observation folded in, the
    observation, what it shows, and the config."""

    track: Track
    obs: ReplicaObservation
    now: float
    rcfg: ReplicaConfig
    wcfg: WatchdogConfig
    pause: Pause | None
    seen: Seen

    @property
    def unit(self) -> UnitInfo:
        """The unit as systemd reported it; the rows that read it come after the one for an unreachable systemd."""
        assert self.obs.unit is not None, "a row read the unit before the row for an unreachable systemd"
        return self.obs.unit

    @property
    def since_start_s(self) -> float | None:
        return self.now - self.track.start_ts if self.track.start_ts is not None else None

    @property
    def quiet_for_s(self) -> float:
        """Seconds since the last progress; infinite when none was ever seen."""
        last = self.track.last_progress_at
        return self.now - last if last is not None else float("inf")

    @property
    def failing_for_s(self) -> float:
        """Seconds with no HTTP answer; -inf while answers come (no threshold is reached)."""
        return _age_s(self.now, self.track.failing_since)

    @property
    def dead_503_for_s(self) -> float:
        return _age_s(self.now, self.track.dead_503_since)

    @property
    def work_queued(self) -> bool:
        """Its queue judged (queue_judged) AND queued work (running + waiting > 0, or clients waiting)."""
        return self.seen.judged and self.seen.queued > 0

    @property
    def quiet_since(self) -> float:
        """When the quiet spell with work queued began: the later of the last progress and when
        the work was first queued (only read while work is queued, when the latter is known)."""
        return max(at for at in (self.track.last_progress_at, self.track.work_since) if at is not None)

    @property
    def step_bound_s(self) -> float | None:
        """STEP_MARGIN x the longest step this replica was seen to take recently, or None: none learned."""
        return longest_step_s(self.track, self.now, self.wcfg.max_step_s)

    @property
    def engine_quiet_for_s(self) -> float:
        """How long the engine's processes have been quiet at this look (observe/procs.py); -inf:
        not quiet, not known, or not told apart from the API server."""
        return _quiet_for_s(self.obs.procs, self.track.engine_quiet_since)

    @property
    def api_quiet_for_s(self) -> float:
        """How long the API server's processes (the whole replica where the engine is not told
        apart) have been quiet at this look; -inf: not quiet or not known."""
        return _quiet_for_s(self.obs.procs, self.track.api_quiet_since)

    @property
    def health_said(self) -> str:
        return "200" if self.obs.health.ok else str(self.obs.health.error)

    @property
    def work_said(self) -> str:
        sample, seen = self.obs.metrics, self.seen
        text = "queue unknown" if sample is None else f"{sample.running:.0f} running, {sample.waiting:.0f} waiting"
        if seen.waiting_clients:
            waited_s = self.now - seen.waiting_since
            text += f", {seen.waiting_clients} client(s) waiting for an answer for up to {waited_s:.0f} s"
        return text

    @property
    def progress_said(self) -> str:
        """How progress showed: counters, or else the kernel's view of responses flowing."""
        flowing_only = not self.seen.counters_moved and flowing(self.obs)
        return _flow(self.obs) if flowing_only else "counters advance"

    @property
    def problems(self) -> list[str]:
        """The probes that failed, and the canaries, for a degraded verdict."""
        obs, track = self.obs, self.track
        probes: tuple[tuple[str, Probe], ...] = (
            ("/health", obs.health),
            ("/metrics", obs.metrics_probe),
            ("/v1/models", obs.models_probe),
        )
        found = [
            f"{label}: {probe.error}"
            for label, probe in probes
            if not probe.ok and (label != "/metrics" or obs.metrics_offered)
        ]
        if self.seen.canary_failed or track.canary_failures:
            found.append(f"{track.canary_failures} canary failure(s)")
        return found


def queue_judged(obs: ReplicaObservation, health_in_time: bool) -> bool:
    """Whether the replica's queue is judged at this look: its page was read (running + waiting, and
    its clients waiting); or its engine serves none as started (ReplicaObservation.metrics_offered),
    or its page comes from the engine's own loop and did not come while /health answered in time
    (metrics_via_engine: the engine does not answer). In the last two its clients waiting are its queue."""
    if obs.metrics is not None or not obs.metrics_offered:
        return True
    return obs.metrics_via_engine and health_in_time


def _age_s(now: float, since: float | None) -> float:
    """Seconds since SINCE; -inf when it has not begun, so that no `age >= limit` holds."""
    return now - since if since is not None else float("-inf")


def _quiet_for_s(view: ProcView | None, since: float | None) -> float:
    return view.at - since if view is not None and since is not None else float("-inf")


def ago(now: float, at: float | None) -> str:
    return "none seen yet" if at is None else f"{now - at:.0f} s ago"


# The evidence of the rows whose text takes more than a line; the others say it in the row.


def paused(facts: Facts) -> str:
    pause = facts.pause
    assert pause is not None, "said only under a pause"
    until = "until resumed" if pause.until is None else f"for {pause.until - facts.now:.0f} s more"
    return f"paused by {pause.reason} {until}"


def loading(facts: Facts) -> str:
    since_s = facts.since_start_s
    shown = "unknown time" if since_s is None else f"{since_s:.0f} s"
    return f"loading for {shown} of {facts.rcfg.startup_grace_s:.0f} s grace"


def no_answer(facts: Facts) -> str:
    last = ago(facts.now, facts.track.last_progress_at)
    return (
        f"no HTTP answer for {facts.failing_for_s:.0f} s (/health: {facts.obs.health.error}), "
        f"last progress {last}{_kernel_quiet(facts.obs)}"
    )


def busy_progressing(facts: Facts) -> str:
    health = facts.obs.health
    return f"/health {health.error or f'took {health.latency_s:.1f} s'}, but {facts.progress_said} ({facts.work_said})"


def healthy_progressing(facts: Facts) -> str:
    return facts.work_said + (", tokens flowing" if facts.seen.counters_moved else f", {facts.progress_said}")


def stall_proven(facts: Facts) -> bool:
    proof_at = facts.track.stall_proof_at
    if not facts.work_queued or proof_at is None or proof_at < facts.quiet_since:
        return False
    bound_s = facts.step_bound_s
    return facts.now - facts.quiet_since >= (bound_s if bound_s is not None else facts.wcfg.stall_window_s)


def stall_proof(facts: Facts) -> str:
    proof_age_s = _age_s(facts.now, facts.track.stall_proof_at)
    return (
        f"{facts.work_said}, nothing moved for {facts.now - facts.quiet_since:.0f} s, and a canary sent "
        f"{proof_age_s:.0f} s ago failed with nothing moving (/health {facts.health_said}){gpus(facts.obs)}"
    )


def engine_quiet(facts: Facts) -> str:
    return (
        f"{facts.work_said}, nothing moved for {facts.now - facts.quiet_since:.0f} s, and "
        f"{used(facts.obs.procs, 'engine', facts.engine_quiet_for_s)} (/health {facts.health_said}){gpus(facts.obs)}"
    )


def gpus(obs: ReplicaObservation) -> str:
    """Each GPU's own sign of life where NVML reports it: "; GPU 0: 21 W, 96 % busy"; "" without."""
    said = []
    for g in obs.gpus:
        parts = [
            f"{g.power_w:.0f} W" if g.power_w is not None else "",
            f"{g.util_pct:.0f} % busy" if g.util_pct is not None else "",
        ]
        said.append(f"GPU {g.index}: " + ", ".join(p for p in parts if p))
    return "; " + "; ".join(said) if said else ""


def engine_proof(facts: Facts) -> str:
    proof_at = facts.track.engine_proof_at
    assert proof_at is not None, "said only after a canary the engine never touched"
    return (
        f"{facts.work_said if facts.seen.queued else 'idle'}; a canary sent {facts.now - proof_at:.0f} s ago got "
        f"nothing while {used(facts.obs.procs, 'engine', facts.engine_quiet_for_s)} (/health {facts.health_said})"
        f"{gpus(facts.obs)}"
    )


def api_quiet(facts: Facts) -> str:
    return (
        f"no HTTP answer for {facts.failing_for_s:.0f} s (/health: {facts.obs.health.error}), last progress "
        f"{ago(facts.now, facts.track.last_progress_at)}, and "
        f"{used(facts.obs.procs, 'api', facts.api_quiet_for_s)}{_kernel_quiet(facts.obs)}"
    )


def used(view: ProcView | None, group: str, quiet_s: float) -> str:
    """How a group's quiet reads in a journal line: "its engine (2 processes) used 0 ms of CPU in 4 s"."""
    act: Activity | None = None if view is None else (view.engine if group == "engine" else view.api)
    whole = view is not None and ((group == "api" and not view.engine_named) or view.engine_whole)
    who = "its processes" if whole else ("its engine" if group == "engine" else "its API server")
    procs = f" ({act.procs} process{'es' if act.procs != 1 else ''})" if act is not None else ""
    return f"{who}{procs} used no CPU and waited for none in {quiet_s:.1f} s"


def flowing(obs: ReplicaObservation) -> bool:
    """The kernel saw a response flowing to a client since its last look (ConnView). A partial view
    (more sockets than one look reads) is no evidence of it: whoever filled the dump with sockets of
    their own could otherwise keep a frozen replica "busy" (issue 34 row 11)."""
    return obs.conns is not None and not obs.conns.truncated and obs.conns.flowing > 0


def _kernel_quiet(obs: ReplicaObservation) -> str:
    conns = obs.conns
    if conns is None or conns.since_s is None:
        return ""
    if conns.truncated:  # a partial view is evidence of nothing, flowing or not (issue 41 item 3)
        return "; kernel: its view was partial (more of its sockets than one look reads), no evidence either way"
    cpu = f", its unit used {1000 * conns.cpu_s:.0f} ms of CPU" if conns.cpu_s is not None else ""
    return f"; kernel: nothing flowed to {conns.connections} connection(s) in {conns.since_s:.1f} s{cpu}"


def _flow(obs: ReplicaObservation) -> str:
    conns = obs.conns
    if conns is None:
        return "no kernel view"
    over = f" in {conns.since_s:.1f} s" if conns.since_s is not None else ""
    return f"responses flowing to {conns.flowing} client connection(s), {conns.bytes_out} bytes{over} (kernel)"


def port_taken_by(owner: PortOwner | None, rcfg: ReplicaConfig) -> HeldBy | None:
    """The listener on the replica's address when it is known to be someone else's. A holder that
    may still be the replica's own (a container its engine has not named yet, a process guardian
    cannot map to a unit) is not: its answers are judged as the replica's, and G7 refuses to
    restart while it is unknown."""
    if not isinstance(owner, HeldBy) or owner.own_container or owner.unit is None or owner.unit == rcfg.unit:
        return None
    if rcfg.container is None or owner.stray:
        return owner
    # a container replica's port held by a unit no engine holds ports from (seen as no container)
    return owner if not owner.via and owner.container is None and not engine_holder(owner.unit) else None


def port_taken(facts: Facts) -> str:
    owner = port_taken_by(facts.obs.port_owner, facts.rcfg)
    assert owner is not None, "said only while the port is another's"
    pid = f", pid {owner.pid}" if owner.pid is not None else ""
    return (
        f"port {owner.port} is held by {owner.holder_text()}{pid}, not by {facts.rcfg.unit}: "
        "what answers there is not this replica"
    )
