"""The memory guard: give co-located work its headroom back. Pure.

``headroom`` is the kernel's MemAvailable. ``total`` is what vLLM's --gpu-memory-utilization
is a fraction of: ``memory.device_total_bytes``, or MemTotal when unset (GB10: one memory).

Rules: RULES below (ids M1-M26), rendered into docs/rules.md. ``M`` = the memory config, times in
seconds, sizes in bytes. M1 and M2 say when the box is squeezed. A pending change of fraction (a
lowering, or a raise) is followed by M3-M8, and a failed start's restart that admission held back
by M18 and M19 (follow_change). M9 is applied where the view is built (core/memview.py).
Otherwise, when squeezed, the rows of SQUEEZE_ROWS (M10-M17) are checked in order and the first
that holds is the verdict (squeeze_chain); when not squeezed and memory.restore is on, a replica
below its base (M20) is raised back one step by the rows of RESTORE_ROWS (M21-M26, restore_chain).

Each verdict's journal line is its row of MESSAGES, filled in from the replica it is about and
its Facts; it is said once per squeeze and cause, or every time when the row says so.

A lowering is confirmed from what the restarted replica reports (vllm:cache_config_info, else
--gpu-memory-utilization on its command line): a replica that serves with another fraction than
the one guardian wrote is overridden by something (a later EnvironmentFile=, an ExecStart= drop-in),
and guardian says so instead of lowering again.

A replica's base is the fraction it had before guardian first lowered it (kept in the state file
by the shell at each lowering: act/state.py). Only a replica with a base is raised, never above
it, one step at a time, and only after headroom has stayed clear of the squeeze line by the raise
and the reserve for M.restore_after_s (> M.sustain_s): after the raise the box is still not
squeezed, so a raise cannot cause the lowering that would undo it.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, replace
from typing import Any

from ..config import Config
from . import fleet
from .actions import AcquireSlot, DrainReplica, LogLine, SetFraction
from .memfollow import LOWERING_RULES, RETRY_HELD, RETRY_OWED, RETRY_RULES, follow_change
from .memrestore import RAISABLE, RAISE, RESTORE_ROWS, count_clear, restore_chain
from .memsqueeze import DEFINITIONS, LOWER, OVERRIDDEN, SQUEEZE_ROWS, count_squeeze, is_squeezed, squeeze_chain
from .memstate import Facts, MemAction, MemoryView, MemTrack, Pending, ReplicaMemory, choose_fraction
from .observations import gib
from .rules import Rule
from .vocab import Decision, Gate, MemVerdict, Priority, State

# The memory guard's values live in core/memstate.py; they are named here too, as the memory guard's.
__all__ = [
    "RULES",
    "MemAction",
    "MemTrack",
    "MemoryView",
    "Pending",
    "ReplicaMemory",
    "choose_fraction",
    "decide",
    "fraction_settled",
    "not_read",
    "start_stopped",
    "weights_changed",
]

RULES: tuple[Rule, ...] = (
    *DEFINITIONS,
    *LOWERING_RULES,
    OVERRIDDEN,
    *(row.rule for row in SQUEEZE_ROWS),
    *RETRY_RULES,
    RAISABLE,
    *(row.rule for row in RESTORE_ROWS),
)
_ID = {rule.outcome: rule.id for rule in RULES} | {
    MemVerdict.DRY_RUN: LOWER.id,
    MemVerdict.RESTORE_DRY_RUN: RAISE.id,
    MemVerdict.RETRY_GIVEN_UP: RETRY_HELD.id,
    MemVerdict.RETRY_DROPPED: RETRY_OWED.id,
}


@dataclass(frozen=True)
class Message:
    """How a verdict is said: a str.format template over `replica`, `memory` (the [memory] config)
    and the fields of Facts, where a size takes the GiB spec: {total_bytes:GiB} is "128.0 GiB"."""

    priority: Priority
    template: str
    decision: Decision = Decision.MEMORY_NOTE
    every_time: bool = False  # False: once per squeeze and cause


MESSAGES: dict[MemVerdict, Message] = {
    MemVerdict.DONE: Message(
        Priority.INFO,
        "replica {replica.name}: serving again with {replica.knob} {written:g} {since_lowering_s:.0f} s "
        "after the {change}; headroom {headroom_bytes:GiB}",
        every_time=True,
    ),
    MemVerdict.MISMATCH: Message(
        Priority.ERROR,
        "replica {replica.name}: serving again, but with {replica.knob} {replica.running_fraction:g}, "
        "not the {written:g} guardian wrote: something overrides guardian's env file (a later EnvironmentFile= "
        "that sets GPU_MEMORY_UTILIZATION, or an ExecStart= drop-in); not changing its fraction again until that "
        "is fixed (guardian check; systemctl cat {replica.unit})",
        every_time=True,
    ),
    MemVerdict.ABANDONED: Message(
        Priority.ERROR, "replica {replica.name}: {change} to {written:g} abandoned: {failure}", every_time=True
    ),
    MemVerdict.RETRY: Message(
        Priority.ERROR,
        "replica {replica.name}: start with {replica.knob} {written:g} failed ({failure}); trying {new:g}{not_again}",
        every_time=True,
    ),
    MemVerdict.GAVE_UP: Message(
        Priority.ERROR,
        "replica {replica.name}: start with {replica.knob} {written:g} failed ({failure}); no lower "
        "fraction >= floor {memory.floor:g} fits in headroom {headroom_bytes:GiB}; leaving it to the operator "
        "(journalctl -u {replica.unit}){not_again}",
        every_time=True,
    ),
    MemVerdict.RETRY_WAITS: Message(
        Priority.ERROR,
        "replica {replica.name}: start with {replica.knob} {written:g} failed ({failure}); {new:g} is "
        "written to its env file, but restarting {replica.unit} waits: {refusal.text}{not_again}",
    ),
    MemVerdict.RETRY_GIVEN_UP: Message(
        Priority.CRITICAL,
        "replica {replica.name}: start with {replica.knob} {written:g} failed ({failure}); {new:g} is "
        "written to its env file, but restarting {replica.unit} is refused: {refusal.text}; giving up on the "
        "lowering: the unit's next start reads {new:g} (journalctl -u {replica.unit}; systemctl restart "
        "{replica.unit}){not_again}",
        every_time=True,
    ),
    MemVerdict.RETRY_DROPPED: Message(
        Priority.INFO,
        "replica {replica.name}: {dropped}; the restart owed to it with {replica.knob} {new:g} (written "
        "after its start with {written:g} was judged failed: {failure}) is dropped and the lowering concluded: "
        "{new:g} stays in its env file and is read at its next start",
        every_time=True,
    ),
    MemVerdict.RETRY_RESTART: Message(
        Priority.WARNING,
        "replica {replica.name}: restarting {replica.unit} with {replica.knob} {new:g}, written after its "
        "start with {written:g} failed ({failure}): admission lets it through now",
        Decision.MEMORY,
        every_time=True,
    ),
    MemVerdict.COOLDOWN: Message(
        Priority.INFO,
        "memory squeezed: {why}; cooldown: last lowering {since_lowering_s:.0f} s ago, next allowed after "
        "{memory.cooldown_s:g} s",
    ),
    MemVerdict.UNWIRED: Message(
        Priority.ERROR,
        "memory squeezed: {why}; replica {replica.name}: {replica.unit} is not wired for the memory guard, "
        "refusing to restart it (a restart without a lower fraction frees nothing): {replica.wiring_problem}",
    ),
    MemVerdict.FLOOR: Message(
        Priority.ERROR,
        "memory squeezed: {why}; every replica is at its floor {memory.floor:g} (or its fraction is unknown): "
        "nothing left to give",
    ),
    MemVerdict.NO_FIT: Message(
        Priority.ERROR,
        "memory squeezed: {why}; replica {replica.name}: no fraction between {highest:g} and the floor "
        "{memory.floor:g} fits (total {total_bytes:GiB} x fraction must be <= headroom + what it holds - reserve "
        "{memory.reserve_bytes:GiB}); waiting rather than a start vLLM would refuse",
    ),
    MemVerdict.NO_PEER: Message(
        Priority.ERROR,
        "memory squeezed: {why}; replica {replica.name}: no other replica of {replica.model} is serving right now, "
        "deferring the lowering to {new:g} (acts anyway below {memory.critical_headroom_bytes:GiB})",
    ),
    MemVerdict.DEFERRED: Message(
        Priority.ERROR, "memory squeezed: {why}; replica {replica.name}: lowering to {new:g} deferred: {refusal.text}"
    ),
    MemVerdict.DRY_RUN: Message(
        Priority.WARNING,
        "memory squeezed: {why}; DRY-RUN: would lower replica {replica.name} {current:g} -> {new:g} and restart "
        "{replica.unit} alone; {serving}",
        Decision.DRY_RUN,
    ),
    MemVerdict.DRAINING: Message(
        Priority.WARNING,
        "memory squeezed: {why}; replica {replica.name}: draining it at the proxy first, then lowering it "
        "{current:g} -> {new:g}; {serving}",
        Decision.PROXY,
    ),
    MemVerdict.LOWER: Message(
        Priority.WARNING,
        "{why}; replica {replica.name} {current:g} -> {new:g}; restarting {replica.unit} alone; {serving}{undrained}",
        Decision.MEMORY,
        every_time=True,
    ),
}
# The raise's lines (M21-M26): "headroom 20.0 GiB >= 14.1 GiB for 600 s" is their {why}.
MESSAGES |= {
    MemVerdict.RESTORE_WAIT: Message(
        Priority.INFO,
        "replica {replica.name}: {replica.knob} {current:g}, below its base {base:g}; it is raised to "
        "{new:g} once headroom has stayed >= {line_bytes:GiB} (min_headroom {memory.min_headroom_bytes:GiB} + the "
        "raise {raise_bytes:GiB} + reserve {memory.reserve_bytes:GiB}) for {memory.restore_after_s:g} s with no "
        "replica starting; headroom now {headroom_bytes:GiB}",
    ),
    MemVerdict.RESTORE_COOLDOWN: Message(
        Priority.INFO,
        "replica {replica.name}: {why}; raising it {current:g} -> {new:g} waits for the cooldown: last change of "
        "fraction {since_change_s:.0f} s ago, next allowed after {memory.restore_cooldown_s:g} s",
    ),
    MemVerdict.RESTORE_NO_PEER: Message(
        Priority.ERROR,
        "replica {replica.name}: {why}; not raising it {current:g} -> {new:g} (base {base:g}): no other replica of "
        "{replica.model} is serving to carry its load while it restarts",
    ),
    MemVerdict.RESTORE_DEFERRED: Message(
        Priority.ERROR,
        "replica {replica.name}: {why}; raising it {current:g} -> {new:g} (base {base:g}) deferred: {refusal.text}",
    ),
    MemVerdict.RESTORE_DRY_RUN: Message(
        Priority.WARNING,
        "replica {replica.name}: {why}; DRY-RUN: would raise it {current:g} -> {new:g} (base {base:g}) and restart "
        "{replica.unit} alone; {serving}",
        Decision.DRY_RUN,
    ),
    MemVerdict.RESTORE_DRAINING: Message(
        Priority.WARNING,
        "replica {replica.name}: {why}; draining it at the proxy first, then raising it {current:g} -> {new:g} "
        "(base {base:g}); {serving}",
        Decision.PROXY,
    ),
    MemVerdict.RAISE: Message(
        Priority.WARNING,
        "replica {replica.name}: {why}; raising it {current:g} -> {new:g} (base {base:g}); restarting "
        "{replica.unit} alone; {serving}",
        Decision.MEMORY,
        every_time=True,
    ),
}
# Said before a critical lowering's own line when it goes ahead without a fleet slot (M15).
NO_SLOT_BUT_CRITICAL = Message(
    Priority.ERROR,
    "memory squeezed: {why}; replica {replica.name}: no fleet slot ({no_slot.text}); critical, so the lowering goes "
    "ahead without one",
    Decision.FLEET,
    every_time=True,
)


class _Text(string.Formatter):
    """str.format, plus the GiB spec for sizes in bytes."""

    def format_field(self, value: Any, format_spec: str) -> Any:
        return gib(value) if format_spec == "GiB" else super().format_field(value, format_spec)


_TEXT = _Text()


def _line(message: Message, verdict: MemVerdict, replica: ReplicaMemory | None, facts: Facts, cfg: Config) -> LogLine:
    text = _TEXT.vformat(message.template, (), {"replica": replica, "memory": cfg.memory, **vars(facts)})
    name, unit = (replica.name, replica.unit) if replica is not None else (None, None)
    return LogLine(message.priority, text, message.decision, name, unit, rule=_ID[verdict])


def decide(track: MemTrack, view: MemoryView, now: float, cfg: Config) -> tuple[MemTrack, list[MemAction]]:
    """The memory guard's tick: the verdict, in TRACK, and what it says and does."""
    track = count_squeeze(_read_since(track, view), view.sample, now, cfg.memory)
    track = count_clear(track, view, now, cfg.memory)
    if track.pending is not None:
        followed = follow_change(track.pending, view, now, cfg.memory)
        if followed is None:  # the replica has left the config: nothing left to follow
            return replace(track, pending=None), []
        return _conclude(track, *followed, now, cfg)
    if is_squeezed(track, now, cfg.memory):
        return _conclude(track, *squeeze_chain(track, view, now, cfg), now, cfg)
    raising = restore_chain(track, view, now, cfg)
    if raising is None:
        return replace(track, last_notice=None, verdict=MemVerdict.NOT_SQUEEZED, rule=None), []
    return _conclude(track, *raising, now, cfg)


def _read_since(track: MemTrack, view: MemoryView) -> MemTrack:
    """Forget a fraction written as unread (M9) once its replica has started since, or left the config."""
    configured = {r.name: r for r in view.replicas}
    unread = {n: at for n, at in track.unread.items() if n in configured and not_read(configured[n].started_at, at)}
    return track if unread == track.unread else replace(track, unread=unread)


def weights_changed(track: MemTrack, replica: str) -> MemTrack:
    """W2 (core/weights.py): what the memory guard learned of REPLICA's old weights is dropped: the
    fraction a raise failed to start at (M20) was that model's size, not the new one's."""
    if replica not in track.ceilings:
        return track
    return replace(track, ceilings={n: c for n, c in track.ceilings.items() if n != replica})


def fraction_settled(track: MemTrack, replica: str) -> bool:
    """No change of REPLICA's fraction in flight: none pending, none written and unread (M9)."""
    return (track.pending is None or track.pending.replica != replica) and replica not in track.unread


def not_read(started_at: float | None, written_at: float) -> bool:
    """A start at STARTED_AT (None: not known) has not read a fraction written at WRITTEN_AT (M9)."""
    return started_at is None or started_at < written_at


# --- the verdict's effects --------------------------------------------------------------------


def _conclude(
    track: MemTrack, verdict: MemVerdict, replica: ReplicaMemory | None, facts: Facts, now: float, cfg: Config
) -> tuple[MemTrack, list[MemAction]]:
    """The verdict's effects: its line (once per cause, unless said every time), what it asks
    for, and the track it leaves."""
    previous = track.pending
    track = replace(track, verdict=verdict, rule=_ID[verdict])
    actions: list[MemAction] = []
    if facts.refusal is not None and facts.refusal.gate is Gate.FLEET and facts.refusal.rule == fleet.ASK_SLOT.id:
        assert replica is not None
        actions.append(AcquireSlot(replica.name, replica.model))
    if facts.no_slot is not None:
        actions.append(_line(NO_SLOT_BUT_CRITICAL, MemVerdict.LOWER, replica, facts, cfg))
    message = MESSAGES.get(verdict)
    if message is not None:
        cause = None if message.every_time else _cause(verdict, replica, facts)
        if cause is None or track.last_notice != cause:
            actions.append(_line(message, verdict, replica, facts, cfg))
            track = replace(track, last_notice=cause)
    track = _settle(track, verdict, now)
    if verdict in (MemVerdict.DRAINING, MemVerdict.RESTORE_DRAINING) and replica is not None:
        actions.append(DrainReplica(replica.name, facts.why))
    change = _change(verdict, replica, facts, previous)
    if change is not None:
        actions.append(change)
        track = _issued(track, verdict, change, facts, now)
    return track, actions


def _raise_failed(track: MemTrack) -> MemTrack:
    """The pending change is a raise whose start failed: its fraction becomes the replica's ceiling,
    and M20 does not raise it there again while guardian runs."""
    pending = track.pending
    if pending is None or not pending.raising:
        return track
    return replace(track, ceilings={**track.ceilings, pending.replica: pending.new})


def start_stopped(track: MemTrack, stop: SetFraction, now: float) -> MemTrack:
    """The track once the start guard stopped a start (S10): STOP becomes the pending change,
    followed as a lowering (M3-M8). When the start stopped is the pending raise's own, that raise
    failed as a failed start fails it (_settle)."""
    pending = track.pending
    if pending is not None and pending.replica == stop.replica and abs(pending.new - stop.old) < 1e-9:
        track = _raise_failed(track)
    return replace(track, pending=Pending(stop.replica, stop.old, stop.new, now), last_change_at=now)


def _settle(track: MemTrack, verdict: MemVerdict, now: float) -> MemTrack:
    """The pending change that this verdict ends; a raise whose start failed becomes a ceiling."""
    if verdict in _START_FAILED:
        track = _raise_failed(track)
    pending = track.pending
    if verdict in (MemVerdict.DONE, MemVerdict.ABANDONED):
        track = replace(track, pending=None)
    elif verdict in (MemVerdict.MISMATCH, MemVerdict.GAVE_UP):
        track = replace(track, pending=None, last_change_at=now)
    elif pending is not None and verdict in (MemVerdict.RETRY_GIVEN_UP, MemVerdict.RETRY_DROPPED):
        # the fraction stays written, unread by the running start (M9 waits for its next start)
        written_at = pending.issued_at if pending.restart_owed else now
        track = replace(track, pending=None, unread={**track.unread, pending.replica: written_at})
    return track


_START_FAILED = frozenset({MemVerdict.RETRY, MemVerdict.RETRY_WAITS, MemVerdict.RETRY_GIVEN_UP, MemVerdict.GAVE_UP})


def _cause(verdict: MemVerdict, replica: ReplicaMemory | None, facts: Facts) -> tuple[str, ...]:
    """What makes a line new: its verdict, its replica, and the refusal's own key (M15)."""
    about = (replica.name,) if replica is not None else ()
    return (verdict, *about, *(facts.refusal.key if facts.refusal is not None else ()))


def _change(
    verdict: MemVerdict, replica: ReplicaMemory | None, facts: Facts, pending: Pending | None
) -> SetFraction | None:
    """The env file to write and the restart: a lowering (M17), a raise (M26), or the next fraction
    after a failed start (M7), written at once with its restart held back (M18) and issued later (M19)."""
    if replica is None:
        return None
    name, unit = replica.name, replica.unit
    if verdict in (MemVerdict.LOWER, MemVerdict.RAISE):
        return SetFraction(name, unit, facts.current, facts.new, restart=True, evidence=facts.why)
    evidence = f"start with {facts.written:g} failed: {facts.failure}"
    if verdict is MemVerdict.RETRY:
        # systemd restarts a unit still starting by itself (Restart=): only the file is written
        restart = replica.state is not State.STARTING
        return SetFraction(name, unit, facts.written, facts.new, restart=restart, evidence=evidence, retry=True)
    held_back = verdict in (MemVerdict.RETRY_WAITS, MemVerdict.RETRY_GIVEN_UP)
    if held_back and not (pending is not None and pending.restart_owed):
        return SetFraction(name, unit, facts.written, facts.new, restart=False, evidence=evidence, retry=True)
    if verdict is MemVerdict.RETRY_RESTART:
        return SetFraction(name, unit, facts.written, facts.new, restart=True, evidence=evidence, retry=True)
    return None


def _issued(track: MemTrack, verdict: MemVerdict, change: SetFraction, facts: Facts, now: float) -> MemTrack:
    """The pending change CHANGE leaves, and the clocks of the cooldowns (M10, M22)."""
    if verdict is MemVerdict.RETRY_RESTART and track.pending is not None:
        return replace(track, pending=replace(track.pending, issued_at=now, restart_owed=False))
    if verdict is MemVerdict.RETRY_GIVEN_UP:  # the file only, nothing left pending (M18)
        return replace(track, last_change_at=now)
    owed = verdict is MemVerdict.RETRY_WAITS
    failure = facts.failure if owed else ""  # what M19 will say when the restart is issued
    critical = facts.critical and verdict is MemVerdict.LOWER
    pending = Pending(change.replica, change.old, change.new, now, owed, failure, critical)
    if verdict is MemVerdict.RAISE:
        return replace(track, pending=pending, last_raise_at=now)
    return replace(track, pending=pending, last_change_at=now)
