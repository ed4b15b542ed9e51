"""Planned restarts across a fleet of boxes: when one may begin, and when its slot is given back. Pure.

With `[fleet]` set, every guardian publishes its replicas in etcd and a planned restart (an
operator's `guardian restart`, a memory-guard lowering) first takes one of the fleet's
`max_planned_restarts` slots. The shell (fleet/sync.py) reads the fleet view from etcd each
tick (FleetView), asks for slots with an etcd transaction, and gives them back; this module says
which, from the view alone. Unplanned restarts (a hung replica) never wait for the fleet.

Rules: the rows of ROWS below (F1-F6), first match wins, each its table row, the predicate that
says when it holds and what it says then, over one _Planned; and RELEASE (F7), which the tick
enforces (core/tick.py gives back the slots it names). RULES, all seven, is rendered into
docs/rules.md. ``F`` = the [fleet] config.
"Serving" in the fleet view: a published replica of the model, healthy or busy, that holds no slot
(it is about to restart), other than the one asking.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..config import Config, FleetConfig
from .actions import Action, LogLine, ReleaseSlot
from .observations import FleetView
from .rules import Refusal, Row, Rule, Why, first_match
from .vocab import Decision, Gate, Priority
from .watchdog.track import Track


@dataclass(frozen=True)
class _Planned:
    """A planned restart of replica NAME (of MODEL) asking the fleet, with the view read this tick."""

    name: str
    model: str
    view: FleetView
    fleet: FleetConfig
    released: frozenset[str]  # slots given back that the view may still show

    @property
    def holders(self) -> str:
        """Who holds the slots; a slot held by no guardian's lease is named by its key, and why."""
        return ", ".join(
            f"{slot.box}/{slot.replica}"
            + (
                f" (key {slot.key!r}, not a guardian's lease: {slot.not_leased}; deleting it frees the slot)"
                if slot.not_leased
                else ""
            )
            for slot in self.view.slots
        )

    @property
    def serving(self) -> list[str]:
        return self.view.serving(self.model, self.name)


def _capacity(planned: _Planned) -> Why:
    serving = planned.serving
    shown = ", ".join(serving) or "none"
    return Why(
        f"waiting for capacity: {len(serving)} other replica(s) of {planned.model} serve in the fleet ({shown}), "
        f"min_serving is {planned.fleet.min_serving}",
        priority=Priority.INFO,
        episode=(shown,),
    )


# The evidence of a rule that lets the restart go is None: nothing to wait for, nothing to say.
ROWS: tuple[Row[_Planned, Why | None], ...] = (
    Row(
        Rule("F1", "go", "no [fleet] configured: the box decides alone (one restart at a time per box)"),
        lambda p: not p.fleet.enabled,
        lambda p: None,
    ),
    Row(
        Rule("F2", "go", "the replica holds a fleet slot"),
        lambda p: p.view.ok and p.name in p.view.mine and p.name not in p.released,
        lambda p: None,
    ),
    Row(
        Rule(
            "F3",
            "wait: etcd",
            "etcd could not be read this tick: planned restarts wait; a critical memory lowering goes ahead "
            "(said at error); unplanned restarts never wait",
        ),
        lambda p: not p.view.ok,
        lambda p: Why(
            f"etcd cannot be reached ({p.view.error or 'no answer yet'}): planned restarts wait for the fleet; "
            "hung replicas are still restarted",
            priority=Priority.ERROR,
        ),
    ),
    Row(
        Rule(
            "F4",
            "wait: slots",
            "slots held in the fleet >= F.max_planned_restarts (the line names who holds them, and the key of one "
            "held by no guardian's lease); a key under slots/ that is not a guardian's slot holds none",
        ),
        lambda p: len(p.view.slots) >= p.fleet.max_planned_restarts,
        lambda p: Why(
            f"waiting for a fleet slot: {len(p.view.slots)} of {p.fleet.max_planned_restarts} held, by {p.holders}",
            priority=Priority.INFO,
            episode=(p.holders,),
        ),
    ),
    Row(
        Rule("F5", "wait: capacity", "other replicas of the model serving in the fleet view < F.min_serving"),
        lambda p: len(p.serving) < p.fleet.min_serving,
        _capacity,
    ),
    Row(
        ASK_SLOT := Rule(
            "F6",
            "ask",
            "otherwise a slot is asked for: one etcd transaction creates a free slot key (or writes over one that "
            "holds no guardian's slot, compared at its revision as read), bound to this guardian's lease, only if no "
            "slot was taken for the same model since the view was read; the restart begins on a later tick, once "
            "the view shows the slot held",
        ),
        lambda p: True,
        lambda p: Why("asking the fleet for a planned-restart slot", priority=Priority.INFO),
    ),
)


@dataclass(frozen=True)
class _Slot:
    """A slot of this box that the fleet view shows held, as RELEASE_ROW reads it."""

    name: str
    in_use: bool  # its replica is draining, away, restarting, starting, being lowered or asking
    state: str  # its replica's verdict, for the line ("not configured" when it has none)


# Not a question a planned restart asks: each tick gives back the slots this row names (core/tick.py).
RELEASE_ROW: Row[_Slot, str] = Row(
    RELEASE := Rule(
        "F7",
        "release",
        "a slot of this box whose replica is not draining, away, restarting, starting, being lowered or "
        "asking: given back at once (its planned restart is over, or given up)",
    ),
    lambda s: not s.in_use,
    lambda s: f"replica {s.name}: its planned restart is over ({s.state}); fleet slot given back ({RELEASE.id})",
)
RULES = (*(row.rule for row in ROWS), RELEASE_ROW.rule)


def slot_refusal(
    name: str, model: str, view: FleetView | None, cfg: Config, released: frozenset[str] = frozenset()
) -> Refusal | None:
    """F1-F6 for a planned restart of NAME: None to go ahead, else why it waits. A refusal with
    rule F6 means: ask for a slot now. RELEASED: slots given back that the view may still show."""
    # No view read yet is a view etcd did not answer.
    read = view if view is not None else FleetView(box="", ok=False)
    found = first_match(ROWS, _Planned(name, model, read, cfg.fleet, released))
    assert found is not None, "the last row always holds"
    rule, why = found
    if why is None:  # a rule that lets it go
        return None
    # The rule is part of the episode: every fleet refusal has the same gate.
    key = (Gate.FLEET, rule.id, *why.episode)
    return Refusal(Gate.FLEET, rule.id, why.reason, why.remedy, why.priority, key=key)


# --- F7: a slot given back once its planned restart is over --------------------------------------


def release_slots(
    view: FleetView, released_before: frozenset[str], in_use: Callable[[str], bool], tracks: Mapping[str, Track]
) -> tuple[frozenset[str], list[Action]]:
    """F7: give back each slot of this box (VIEW.mine) whose planned restart is over or given up
    (not IN_USE). The slots given back that the view may still show (RELEASED_BEFORE: the release is
    under way) are not asked twice. Returns the slots given back that the view may still show, and
    the actions."""
    released = released_before & view.mine
    actions: list[Action] = []
    for name in sorted(view.mine - released):
        track = tracks.get(name)
        found = first_match(
            (RELEASE_ROW,), _Slot(name, in_use(name), track.state if track is not None else "not configured")
        )
        if found is None:
            continue
        rule, text = found
        actions.append(ReleaseSlot(name))
        actions.append(LogLine(Priority.INFO, text, Decision.FLEET, name, rule=rule.id))
        released |= {name}
    return released, actions
