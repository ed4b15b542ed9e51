"""Planned restarts across a fleet of boxes: when one may begin, and when its slot is given back. Pure.

With `[fleet]` set, every guardian publishes its replicas in etcd and a planned restart (an
operator's `guardian restart`, a memory-guard lowering) first takes one of the fleet's
`max_planned_restarts` slots. The shell (fleet/sync.py) reads the fleet view from etcd each
tick (FleetView), asks for slots with an etcd transaction, and gives them back; this module says
which, from the view alone. Unplanned restarts (a hung replica) never wait for the fleet.

Rules: the rows of RULES below (F1-F7), rendered into the README. ``F`` = the [fleet] config.
"Serving" in the fleet view: a published replica of the model, healthy or busy, that holds no slot
(it is about to restart), other than the one asking.
"""

from __future__ import annotations

from ..config import Config
from .observations import FleetView
from .rules import Refusal, Rule
from .vocab import Gate, Priority

RULES = (
    Rule("F1", "go", "no [fleet] configured: the box decides alone (one restart at a time per box)"),
    Rule("F2", "go", "the replica holds a fleet slot"),
    Rule(
        "F3",
        "wait: etcd",
        "etcd could not be read this tick: planned restarts wait; a critical memory lowering goes ahead "
        "(said at error); unplanned restarts never wait",
    ),
    Rule("F4", "wait: slots", "slots held in the fleet >= F.max_planned_restarts (the line names who holds them)"),
    Rule("F5", "wait: capacity", "other replicas of the model serving in the fleet view < F.min_serving"),
    Rule(
        "F6",
        "ask",
        "otherwise a slot is asked for: one etcd transaction creates a free slot key, bound to this guardian's "
        "lease, only if no slot was taken for the same model since the view was read; the restart begins on a "
        "later tick, once the view shows the slot held",
    ),
    Rule(
        "F7",
        "release",
        "a slot of this box whose replica is not draining, away, restarting, starting, being lowered or "
        "asking: given back at once (its planned restart is over, or given up)",
    ),
)


def slot_refusal(
    name: str, model: str, view: FleetView | None, cfg: Config, released: frozenset[str] = frozenset()
) -> Refusal | None:
    """F1-F6 for a planned restart of NAME: None to go ahead, else why it waits. A refusal with
    rule F6 means: ask for a slot now. RELEASED: slots given back that the view may still show."""
    f = cfg.fleet
    if not f.enabled:
        return None
    if view is None or not view.ok:
        err = view.error if view is not None and view.error else "no answer yet"
        return Refusal(
            Gate.FLEET,
            "F3",
            f"etcd cannot be reached ({err}): planned restarts wait for the fleet; hung replicas are still restarted",
            priority=Priority.ERROR,
            key=(Gate.FLEET, "F3"),
        )
    if name in view.mine and name not in released:
        return None
    if len(view.slots) >= f.max_planned_restarts:
        who = ", ".join(f"{s.box}/{s.replica}" for s in view.slots)
        return Refusal(
            Gate.FLEET,
            "F4",
            f"waiting for a fleet slot: {len(view.slots)} of {f.max_planned_restarts} held, by {who}",
            priority=Priority.INFO,
            key=(Gate.FLEET, "F4", who),
        )
    serving = view.serving(model, name)
    if len(serving) < f.min_serving:
        shown = ", ".join(serving) or "none"
        return Refusal(
            Gate.FLEET,
            "F5",
            f"waiting for capacity: {len(serving)} other replica(s) of {model} serve in the fleet ({shown}), "
            f"min_serving is {f.min_serving}",
            priority=Priority.INFO,
            key=(Gate.FLEET, "F5", shown),
        )
    return Refusal(
        Gate.FLEET,
        "F6",
        "asking the fleet for a planned-restart slot",
        priority=Priority.INFO,
        key=(Gate.FLEET, "F6"),
    )
