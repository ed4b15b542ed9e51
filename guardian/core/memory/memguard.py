"""The memory guard: give co-located work its headroom back. Pure.

``headroom`` is the kernel's MemAvailable. ``total`` is what vLLM's --gpu-memory-utilization
is a fraction of: ``memory.device_total_bytes``, or MemTotal when unset (GB10: one memory).

Rules: RULES below (ids M1-M26), rendered into docs/rules.md. ``M`` = the memory config, times in
seconds, sizes in bytes. M1 and M2 (rows of core/memory/memsqueeze.py) say when the box is squeezed. A
pending change of fraction (a lowering, or a raise) is followed by M3-M8, and a failed start's
restart that admission held back by M18 and M19 (follow_change). M9's row is asked where the view is
built (core/memory/memview.py). Otherwise, when squeezed, the rows of SQUEEZE_ROWS (M10-M17) are checked in
order and the first that holds is the verdict (squeeze_chain); when not squeezed and memory.restore
is on, a replica below its base (M20) is raised back one step by the rows of RESTORE_ROWS (M21-M26,
restore_chain).

Each verdict's journal line is its Message, which sits in the row that yields the verdict
(memstate.SaidRow.says: the rule's id, condition and lines together), filled in from the replica it
is about and its Facts; it is said once per squeeze and cause, or every time when the row says so.

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
from dataclasses import replace
from typing import Any

from ...config import Config
from .. import fleet
from ..actions import AcquireSlot, DrainReplica, LogLine, SetFraction
from ..observations import gib
from ..rules import Rule
from ..vocab import Gate, MemVerdict, State
from .memfollow import FOLLOW_ROWS, RETRY_ROWS, follow_change
from .memrestore import RAISABLE_ROW, RESTORE_ROWS, count_clear, restore_chain
from .memsqueeze import (
    CRITICAL_ROW,
    NO_SLOT_BUT_CRITICAL,
    OVERRIDDEN_ROW,
    SQUEEZE_ROWS,
    SQUEEZED_ROW,
    count_squeeze,
    is_squeezed,
    squeeze_chain,
)
from .memstate import Facts, MemAction, MemoryView, MemTrack, Message, Pending, ReplicaMemory, SaidRow, choose_fraction

# The memory guard's values live in core/memory/memstate.py; they are named here too, as the memory guard's.
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
    SQUEEZED_ROW.rule,
    CRITICAL_ROW.rule,
    *(row.rule for row in FOLLOW_ROWS),
    OVERRIDDEN_ROW.rule,
    *(row.rule for row in SQUEEZE_ROWS),
    *(row.rule for row in RETRY_ROWS),
    RAISABLE_ROW.rule,
    *(row.rule for row in RESTORE_ROWS),
)
# The rule behind each verdict: the row whose outcome it is, or whose lines it is said by.
_ID = {rule.outcome: rule.id for rule in RULES} | {
    verdict: row.rule.id
    for row in (*FOLLOW_ROWS, *SQUEEZE_ROWS, *RETRY_ROWS, *RESTORE_ROWS)
    if isinstance(row, SaidRow)
    for verdict in row.says
}


# Each verdict's line, from the row that yields it.
MESSAGES: dict[MemVerdict, Message] = {
    verdict: message
    for row in (*FOLLOW_ROWS, *SQUEEZE_ROWS, *RETRY_ROWS, *RESTORE_ROWS)
    if isinstance(row, SaidRow)
    for verdict, message in row.says.items()
}


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
