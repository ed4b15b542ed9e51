"""The start guard: a replica's start that is taking the box's last memory is stopped at once and
restarted one step lower. Pure.

Why: on a GB10 the CPU and the GPU share the 128 GB, vLLM's start takes its whole
--gpu-memory-utilization x total, and a host that runs out does not OOM-kill, it wedges (NVIDIA
open-gpu-kernel-modules #1358). A start is when that happens: guardian's own restarts, systemd's
Restart=, an operator's. The memory guard's squeeze rules (core/memory/memguard.py) need a squeeze to
last M.sustain_s, and admission keeps them from restarting another replica while one loads (A3),
so they cannot help here.

Rules: RULES below (ids S1-S10), rendered into docs/rules.md. ``M`` = the memory config. S1 says which
starts are watched and what is recorded at a start's first look (its Start); then, on every tick,
the rows of ROWS are checked in order for each watched start and the first that holds is the
verdict. The stop (S10) is a SetFraction like a lowering's, with ``kill_first``: the restart job
is queued and the unit's processes SIGKILLed if its stop lasts HUNG_STOP_GRACE_S, so the memory is
back within about a second. The tick records it
as the memory guard's pending change (memguard.Pending), and M3-M8 follow it as they follow a
lowering: done, mismatch, abandoned, a failed start retried a step lower (core/tick.py).

A start's record is kept while its unit is in that start (the same InvocationID and start
timestamp); a stopped start's even while it is not watched (its stop's restart in flight, a restart
refused), so that it is never measured again from the headroom it left: it ends when its unit
starts anew, it serves, or its unit stops. A stop whose restart was refused (the memory guard's
M6) is not tried again for that start (S2).

Each verdict's line is said once per start and cause; S3 says nothing, and S2 only a refused stop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ...config import Config, MemoryConfig
from ..actions import HUNG_STOP_GRACE_S, LogLine, SetFraction
from ..observations import ReplicaObservation, gib
from ..rules import Refusal, Row, Rule, first_match
from ..vocab import LOADING_STATES, ActiveState, Decision, Priority, State
from .memstate import Pending, choose_fraction, grid

# Where a replica's growth was measured (S4), best first.
NVML = "NVML per-process memory"
CGROUP = "its unit's cgroup, MemoryCurrent"
FALL = "taken as the headroom's fall: neither NVML nor its cgroup could tell"


def may_be_loading(seen: ReplicaObservation, startup_grace_s: float, now: float) -> bool:
    """What the observer asks a unit's MemoryCurrent for, from one tick's look alone (it has no
    verdict yet): a superset of S1's starts. Its unit is activating, or active for less than
    STARTUP_GRACE_S, and /health does not answer 200."""
    unit = seen.unit
    if unit is None or seen.health.ok:
        return False
    if unit.active_state is ActiveState.ACTIVATING:
        return True
    started = unit.inactive_exit_mono
    return unit.active_state is ActiveState.ACTIVE and started is not None and now - started < startup_grace_s


@dataclass(frozen=True)
class Starting:
    """One configured replica as the start guard sees it on this tick (built by core/memory/memstep.py)."""

    name: str
    unit: str
    loading: bool  # S1: liveness starting, its unit activating or active, no restart job of guardian's in flight
    start: tuple[str, float | None]  # which start: the unit's InvocationID and InactiveExitTimestampMonotonic
    fraction: float | None  # its fraction: guardian's env file, else what it reports or its command line
    wiring_problem: str | None  # None: wired for the memory guard (core/memory/wiring.py, M9)
    nvml_bytes: int | None = None  # NVML per-process memory of its process tree, when the driver reports it
    cgroup_bytes: int | None = None  # its unit's MemoryCurrent (never a container replica's)
    refusal: Refusal | None = None  # admission's budget (A1) for a restart of it now
    ended: bool = False  # its start is over: it serves, or its unit is not activating or active
    refused: str | None = None  # its restart job was refused on this tick (the memory guard's M6)
    pid: int | None = None  # its unit's main process, when known


@dataclass(frozen=True)
class StartView:
    """What the start guard decides on."""

    headroom_bytes: int  # MemAvailable now
    total_bytes: int  # what the fraction is of
    replicas: tuple[Starting, ...]
    consumers: str = ""  # the largest consumers, "db.service 22.1 GiB, make (pid 9) 9.3 GiB"
    pending: Pending | None = None  # the memory guard's change in flight (M3)


@dataclass(frozen=True)
class Start:
    """One watched start, as recorded at its first look (S1), and what was said of it."""

    start: tuple[str, float | None]  # Starting.start
    seen_at: float  # its first look
    headroom_bytes: int  # headroom then
    nvml_bytes: int  # its NVML memory then (0 when none is listed: a new process holds none)
    cgroup_bytes: int | None  # its MemoryCurrent then
    began_critical: bool = False  # S3: headroom was under the critical line then, or it is a critical lowering's start
    stopped: bool = False  # S10 stopped it (or, with dry_run, said it would)
    refused: str | None = None  # why its stop's restart was refused (S2): it is not stopped again
    said: tuple[str, ...] | None = None  # the last cause said: a line is said once per start and cause
    rule: str | None = None  # the last verdict's id


@dataclass(frozen=True)
class Growth:
    """How much a starting replica grew since its first look, and what it holds now."""

    grown_bytes: int
    held_bytes: int  # what stopping it gives back: choose_fraction's "what it holds"
    source: str  # NVML, CGROUP or FALL


@dataclass(frozen=True)
class _Look:
    """What the rows read about one watched start on this tick."""

    replica: Starting
    start: Start
    memory: MemoryConfig
    headroom_bytes: int
    fall_bytes: int  # the headroom's fall since the start's first look (negative: it rose)
    growth: Growth
    new: float | None  # one step lower: choose_fraction(its fraction, what it holds, headroom); None if none fits
    pending_other: str | None  # another replica whose change the memory guard follows (M3)
    highest: float = 0.0  # the highest fraction S7 tries

    @property
    def grows(self) -> bool:
        """S4's test, negated: it is the one growing."""
        if self.growth.source == FALL:
            return self.fall_bytes > 0
        return self.growth.grown_bytes > 0 and 2 * self.growth.grown_bytes >= self.fall_bytes


# --- the rules ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Loading:
    """A configured replica as WATCHED_ROW reads it (core/memory/memstep.py builds Starting.loading with it)."""

    state: State  # its liveness verdict
    restart_in_flight: bool  # a restart job of guardian's
    active_state: ActiveState | None  # its unit's (None: systemd not reachable)


# Asked of each replica, by core/memory/memstep.py, only while M.enabled and M.start_guard; decide() records
# a start it holds for at its first look, and the record carries its id until ROWS judge it.
WATCHED_ROW: Row[Loading, None] = Row(
    WATCHED := Rule(
        "S1",
        "watched",
        "M.enabled AND M.start_guard AND a configured replica's liveness is starting AND its unit is activating or "
        "active (a start, not a stop) AND no restart job of guardian's is in flight for it; at the first tick that "
        "sees this start (its unit's InvocationID and InactiveExitTimestampMonotonic), the headroom and the "
        "replica's own memory (NVML, else its cgroup's MemoryCurrent) are recorded, and S2-S10 are checked from the "
        "next tick on; a stopped start's record is kept until its unit starts anew, it serves or its unit stops; "
        "while a start is watched and not stopped, ticks come every min(M.start_guard_interval_s, interval_s)",
    ),
    lambda k: (
        k.state in LOADING_STATES
        and not k.restart_in_flight
        and k.active_state in (ActiveState.ACTIVATING, ActiveState.ACTIVE)
    ),
    lambda k: None,
)

# What a row says when it holds: its line's priority and template (after _HEAD; "{rule}" is its id),
# or None: nothing (S3). S2 speaks only when its stop's restart was refused (_judge).
Says = tuple[Priority, str]

ROWS: tuple[Row[_Look, Says | None], ...] = (
    Row(
        STOPPED := Rule(
            "S2",
            "stopped",
            "the start guard stopped this start already: nothing more; when that stop's restart was refused (M6), "
            "said once (error): it is not stopped again",
        ),
        lambda k: k.start.stopped,
        lambda k: (
            Priority.ERROR,
            "its start was stopped, and the restart of {unit} refused: {refused} (M6); it is not stopped again, this "
            "start goes on; free memory by hand ({rule})",
        ),
    ),
    Row(
        CLEAR := Rule(
            "S3",
            "clear",
            "headroom >= M.critical_headroom_bytes on this tick, OR it was already below it at this start's first "
            "look, OR this start is that of a lowering the memory guard decided below it (M2, M17): this start did "
            "not take the box under the line (a critical lowering's own start, whose fraction the fit check chose, "
            "M13; the squeeze rules, M2, are what act on a box already critical): nothing",
        ),
        lambda k: k.headroom_bytes >= k.memory.critical_headroom_bytes or k.start.began_critical,
        lambda k: None,
    ),
    Row(
        Rule(
            "S4",
            "not-growing",
            "it is not the one growing: measured by NVML (where the driver lists memory for its processes now), "
            "else by its cgroup (MemoryCurrent now and at the first look), its growth since the first look is <= 0 "
            "OR < half the headroom's fall since then; with neither measure, the headroom's fall since then is <= 0; "
            "its start is not stopped (the squeeze rules apply)",
        ),
        lambda k: not k.grows,
        lambda k: (
            Priority.ERROR,
            "it is not what takes the memory, so its start is not stopped ({rule}; the squeeze rules apply)",
        ),
    ),
    Row(
        Rule(
            "S5",
            "unwired",
            "it is not wired for the memory guard, or its command line shows another fraction than guardian's env "
            "file (something overrides it, an ExecStart= drop-in; not for a start begun before its change of "
            "fraction pending was written, nor one that runs with the fraction that change replaced), or its "
            "fraction is unknown: restarted, it would take the same memory again; not stopped (critical)",
        ),
        lambda k: k.replica.wiring_problem is not None or k.replica.fraction is None,
        lambda k: (
            Priority.CRITICAL,
            "{unit} is not wired for the memory guard ({problem}): restarted, it would take the same memory again, so "
            "its start is not stopped; the box may run out of memory ({rule})",
        ),
    ),
    Row(
        Rule("S6", "floor", "its fraction <= M.floor: it cannot go lower; not stopped (critical)"),
        lambda k: (k.replica.fraction or 0.0) <= k.memory.floor + 1e-9,
        lambda k: (
            Priority.CRITICAL,
            "its gpu_memory_utilization {fraction} is at the floor {floor:g}: it cannot go lower, so its start is not "
            "stopped; free memory by hand ({rule})",
        ),
    ),
    Row(
        Rule(
            "S7",
            "no-fit",
            "no fraction on the 0.01 grid, <= its fraction - M.step (the start of a raise pending: <= the fraction "
            "it was raised from) and >= M.floor, has total x fraction <= headroom + what it holds (NVML, else its "
            "cgroup, else the headroom's fall) - M.reserve_bytes; not stopped (critical)",
        ),
        lambda k: k.new is None,
        lambda k: (
            Priority.CRITICAL,
            "no fraction between {highest:g} and the floor {floor:g} fits (total {total} x fraction must be <= "
            "headroom + the {held} it holds - reserve {reserve}), so its start is not stopped; free memory by hand "
            "({rule})",
        ),
    ),
    Row(
        Rule(
            "S8",
            "pending",
            "the memory guard follows a change of another replica (M3): one change at a time; not stopped now",
        ),
        lambda k: k.pending_other is not None,
        lambda k: (
            Priority.ERROR,
            "the memory guard follows a change of replica {other} (M3), one change at a time, so its start is not "
            "stopped now ({rule})",
        ),
    ),
    Row(
        REFUSED := Rule(
            "S9",
            "refused",
            "admission's budget refuses a restart of it now (A1: it bounds a loop of stops, as M.floor bounds their "
            "steps); A2 (back-off) and A3 are not asked: the stop replaces a start under way and adds none, and "
            "the start of guardian's own restart is in its back-off for the whole load",
        ),
        lambda k: k.replica.refusal is not None,
        lambda k: (Priority.ERROR, "stopping its start is refused now: {refusal} ({refusal_rule}; {rule})"),
    ),
    Row(
        STOP := Rule(
            "S10",
            "stop",
            "otherwise: write the next fraction down (S7's) to its env file and restart its unit alone, its "
            f"processes SIGKILLed if its stop lasts {HUNG_STOP_GRACE_S:g} s once the job began; the memory guard "
            "follows it as a lowering (M3-M8) (with dry_run = true: logged, not done)",
        ),
        lambda k: True,
        lambda k: (
            Priority.WARNING,
            "stopping its start now: {unit}'s processes killed if its stop lasts "
            f"{HUNG_STOP_GRACE_S:g} s, and the unit restarted alone with "
            "gpu_memory_utilization {fraction} -> {new:g} ({rule})",
        ),
    ),
)

RULES: tuple[Rule, ...] = (WATCHED_ROW.rule, *(row.rule for row in ROWS))


# --- what each verdict says -----------------------------------------------------------------

_HEAD = (
    "replica {name}: headroom {headroom} < critical {critical} during its start (it was {at_start} at this start's "
    "first look, {since_s:.1f} s ago); {name} grew {grown} since ({source}) of the headroom's fall of {fall}; "
    "largest others: {others}; "
)

DRY_RUN = (
    Priority.WARNING,
    "DRY-RUN: would stop its start: kill {unit}'s processes and restart it alone with gpu_memory_utilization "
    "{fraction} -> {new:g} ({rule})",
)


def _fields(look: _Look, view: StartView, now: float) -> dict[str, Any]:
    replica, start, memory, growth = look.replica, look.start, look.memory, look.growth
    fraction = replica.fraction
    others = [c for c in view.consumers.split(", ") if c and not _own(c, replica)]
    return {
        "name": replica.name,
        "unit": replica.unit,
        "headroom": gib(look.headroom_bytes),
        "critical": gib(memory.critical_headroom_bytes),
        "at_start": gib(start.headroom_bytes),
        "since_s": now - start.seen_at,
        "grown": gib(growth.grown_bytes),
        "source": growth.source,
        "fall": gib(look.fall_bytes),
        "others": ", ".join(others) or "none found",
        "problem": replica.wiring_problem or "its fraction is unknown",
        "fraction": f"{fraction:g}" if fraction is not None else "unknown",
        "floor": memory.floor,
        "highest": look.highest,
        "total": gib(view.total_bytes),
        "held": gib(growth.held_bytes),
        "reserve": gib(memory.reserve_bytes),
        "other": look.pending_other,
        "refusal": replica.refusal.text if replica.refusal is not None else "",
        "refusal_rule": replica.refusal.rule if replica.refusal is not None else "",
        "new": look.new or 0.0,
        "refused": start.refused or "",
    }


def _own(consumer: str, replica: Starting) -> bool:
    """CONSUMER (observe/memory.py: "unit 1.0 GiB", "name (pid 9 in unit) 1.0 GiB") is REPLICA's own:
    its unit, or a process of it (in its unit, or its main process)."""
    unit, pid = replica.unit, replica.pid
    if consumer.startswith(f"{unit} ") or f" in {unit}) " in consumer:
        return True
    return pid is not None and (f"(pid {pid}) " in consumer or f"(pid {pid} in " in consumer)


def _line(rule: Rule, says: Says, look: _Look, view: StartView, now: float, cfg: Config) -> LogLine:
    """RULE's line: what its row SAYS (the dry run's instead for a stop), after the common head."""
    priority, tail = DRY_RUN if rule is STOP and cfg.dry_run else says
    refusal = look.replica.refusal if rule is REFUSED else None
    if refusal is not None:
        priority = max(priority, refusal.priority, key=lambda p: -p.syslog)  # A1's giving up is critical
    decision = Decision.MEMORY_NOTE
    if rule is STOP:
        decision = Decision.DRY_RUN if cfg.dry_run else Decision.MEMORY
    text = (_HEAD + tail).format(**_fields(look, view, now), rule=rule.id)
    replica = look.replica
    gate = refusal.gate if refusal else None
    return LogLine(priority, text, decision, replica.name, replica.unit, gate=gate, rule=rule.id)


# --- the decision ---------------------------------------------------------------------------


def decide(
    starts: Mapping[str, Start], view: StartView, now: float, cfg: Config
) -> tuple[dict[str, Start], list[LogLine | SetFraction]]:
    """The start guard's tick: each watched start's record, and what is said and done. A start
    no longer watched is forgotten, a stopped one only once it is over (_carried)."""
    kept: dict[str, Start] = {}
    actions: list[LogLine | SetFraction] = []
    for replica in view.replicas:
        start = _carried(starts.get(replica.name), replica)
        if not replica.loading:
            if start is not None and start.stopped:  # its stop's restart in flight, or refused: S2 until it is over
                kept[replica.name] = start
            continue
        if start is None:  # S1: this start's first look records, no more
            kept[replica.name] = _first_look(replica, view, now, cfg.memory)
            continue
        start, said = _judge(start, replica, view, now, cfg)
        kept[replica.name] = start
        actions += said
        stop = next((a for a in said if isinstance(a, SetFraction)), None)
        if stop is not None:  # the memory guard follows it: the next replica sees it pending (S8)
            view = replace(view, pending=Pending(stop.replica, stop.old, stop.new, now))
    return kept, actions


def _first_look(replica: Starting, view: StartView, now: float, memory: MemoryConfig) -> Start:
    """S1's record. A critical lowering's start counts as begun under the line even when the kill of
    its old process lifted headroom above it by the first look: the box was under it when it began."""
    pending = view.pending
    lowered_critical = pending is not None and pending.replica == replica.name and pending.critical
    critical = view.headroom_bytes < memory.critical_headroom_bytes or lowered_critical
    return Start(
        replica.start,
        now,
        view.headroom_bytes,
        replica.nvml_bytes or 0,
        replica.cgroup_bytes,
        critical,
        rule=WATCHED.id,
    )


def _carried(start: Start | None, replica: Starting) -> Start | None:
    """START as this tick carries it: None once REPLICA's unit started anew or its start is over (it
    serves, its unit stopped); a refusal of its stop's restart is kept (S2)."""
    if start is None or start.start != replica.start or replica.ended:
        return None
    if start.stopped and start.refused is None and replica.refused is not None:
        return replace(start, refused=replica.refused)
    return start


def overridden(
    name: str, configured: float | None, cmdline: float | None, started_at: float | None, pending: Pending | None
) -> str | None:
    """S5 for a loading replica NAME: its command line shows another fraction than guardian's env file,
    so something overrides that file (an ExecStart= drop-in) and a stop would restart it with the same
    memory; None otherwise. A start begun before its change of fraction pending was written (the file
    is newer than the start: systemd restarting it by itself, M7), or one that runs with the fraction
    that change replaced, is not overridden."""
    if configured is None or cmdline is None or abs(configured - cmdline) <= 1e-6:
        return None
    if pending is not None and pending.replica == name:
        before = started_at is None or started_at < pending.issued_at
        if before or abs(cmdline - pending.old) <= 1e-6:
            return None
    return (
        f"its command line says --gpu-memory-utilization {cmdline:g} while guardian's env file says {configured:g}: "
        "something overrides that file (an ExecStart= drop-in, a later EnvironmentFile=)"
    )


def growth(replica: Starting, start: Start, fall_bytes: int) -> Growth:
    """How much REPLICA grew since START's first look: NVML where the driver lists memory for its
    processes, else its cgroup, else the headroom's fall (all of it taken as the replica's)."""
    if replica.nvml_bytes is not None:
        return Growth(replica.nvml_bytes - start.nvml_bytes, replica.nvml_bytes, NVML)
    if replica.cgroup_bytes is not None and start.cgroup_bytes is not None:
        return Growth(replica.cgroup_bytes - start.cgroup_bytes, replica.cgroup_bytes, CGROUP)
    return Growth(fall_bytes, max(fall_bytes, 0), FALL)


def _top(replica: Starting, pending: Pending | None, memory: MemoryConfig) -> float:
    """What S7 goes one step below: its fraction; for the start of a raise pending, the fraction it
    was raised from plus a step, so that it goes back there, as M7 after a failed raise."""
    fraction = replica.fraction or 0.0
    if pending is not None and pending.replica == replica.name and pending.raising:
        if abs(pending.new - fraction) < 1e-9:
            return pending.old + memory.step
    return fraction


def _judge(
    start: Start, replica: Starting, view: StartView, now: float, cfg: Config
) -> tuple[Start, list[LogLine | SetFraction]]:
    """S2-S10 for one watched start."""
    memory = cfg.memory
    fall = start.headroom_bytes - view.headroom_bytes
    grew = growth(replica, start, fall)
    pending = view.pending
    top = _top(replica, pending, memory)
    new = None
    if replica.fraction is not None:
        new = choose_fraction(top, grew.held_bytes, view.headroom_bytes, view.total_bytes, memory)
    other = pending.replica if pending is not None and pending.replica != replica.name else None
    look = _Look(replica, start, memory, view.headroom_bytes, fall, grew, new, other, grid(top - memory.step))
    found = first_match(ROWS, look)
    assert found is not None, "the last row always holds"
    matched, says = found
    rule = matched.id
    start = replace(start, rule=rule)
    # Nothing to say: a row without a line (clear of the critical line), or stopped already unless refused.
    if says is None or (matched is STOPPED and start.refused is None):
        return start, []
    actions: list[LogLine | SetFraction] = []
    refusal_key = replica.refusal.key if matched is REFUSED and replica.refusal else ()
    cause = (rule, *refusal_key, *((other,) if other else ()))
    if start.said != cause:
        actions.append(_line(matched, says, look, view, now, cfg))
        start = replace(start, said=cause)
    if matched is STOP:
        start = replace(start, stopped=True)
        if not cfg.dry_run and new is not None and replica.fraction is not None:
            evidence = f"start guard: headroom {gib(view.headroom_bytes)} < {gib(memory.critical_headroom_bytes)}"
            actions.append(
                SetFraction(replica.name, replica.unit, replica.fraction, new, True, evidence, kill_first=True)
            )
    return start, actions
