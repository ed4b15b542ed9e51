"""The same weights behind one name (issue 33): replicas that serve one model name with different
weights, and a replica whose weights changed. Pure.

Why: clients of a model name are sent to any of its replicas; two replicas of one name with other
weights (a model update done on one box, a snapshot half synced) answer the same prompt
differently, and any cache keyed by the name alone (a client's, a proxy's) mixes them.

What a replica's weights are is observe/weights.py's fingerprint: its model directory's
config.json and weight index and its weight files' names, sizes and sampled bytes (a fine-tune keeps
its base's config, names and sizes: issue 44), or the commit its Hugging Face snapshot resolves to
where its files are not there. An unknown fingerprint (None) is never a difference, and fingerprints
of two kinds ("dir2:" and "hf:", "dir2:" and "dirn:" (bytes unreadable), or an older guardian's "dir:")
are never compared.

Rules:
- W1, differ: two or more replicas of this box configured with one model name have known
  fingerprints that differ: a hazard at error, naming each replica, its fingerprint and where it
  was read, said once while it lasts;
- W2, changed: a replica's fingerprint differs from the one guardian saw before (both known): said
  at info, a model update; what the memory guard learned of the old weights (M20's ceiling: the
  fraction a raise failed to start at) is dropped;
- W3, differ across the fleet: a replica of this box and a replica of another box in the fleet
  view (with [fleet]) serve one model name with known fingerprints that differ: a hazard at
  error, as W1, on each box that sees it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..config import Config
from .hazards import Hazard
from .observations import FleetMember
from .rules import Row, Rule, first_match


@dataclass(frozen=True)
class Weights:
    digest: str  # "dir2:1a2b3c4d5e6f", "file2:...", "hf:Org/Name@c0ffee123456"
    what: str  # where it was read, for a reader


@dataclass(frozen=True)
class _Here:
    """One model name's replicas on this box with a known fingerprint, as DIFFER reads them."""

    model: str
    seen: tuple[tuple[str, Weights], ...]  # (replica, its fingerprint), in the config's order


@dataclass(frozen=True)
class _Moved:
    """One replica's fingerprint before and after, as CHANGED reads it."""

    name: str
    was: Weights | None
    now: Weights | None


@dataclass(frozen=True)
class _Fleet:
    """One model name, this box's known fingerprints of it and the other boxes' members that serve it
    with a known fingerprint of a kind this box has, as DIFFER_FLEET reads them."""

    model: str
    here: frozenset[tuple[str, str]]  # (replica, digest)
    there: tuple[FleetMember, ...]


def _differ_here(h: _Here) -> Hazard:
    each = "; ".join(f"{name}: {w.digest} ({w.what})" for name, w in h.seen)
    return Hazard(
        f"weights-differ:{h.model}",
        f"replicas {', '.join(n for n, _ in h.seen)} serve model {h.model} with different weights ({each}): its "
        "clients get answers from whichever replica they reach; give each set of weights its own model "
        f"name, or bring them to the same weights ({DIFFER.id})",
        rule=DIFFER.id,
        over=f"hazard over: {h.model}'s replicas serve the same weights",
    )


def _differ_fleet(f: _Fleet) -> Hazard:
    mine = "; ".join(f"{name}: {digest}" for name, digest in sorted(f.here))
    theirs = "; ".join(f"{m.box}/{m.name}: {m.weights}" for m in sorted(f.there, key=lambda m: (m.box, m.name)))
    return Hazard(
        f"weights-differ-fleet:{f.model}",
        f"model {f.model} is served with other weights on other boxes of the fleet (here {mine}; {theirs}): its "
        "clients get answers from whichever box they reach; bring the boxes to the same weights, or give each "
        f"its own model name ({DIFFER_FLEET.id})",
        rule=DIFFER_FLEET.id,
        over=f"hazard over: {f.model}'s replicas serve the same weights across the fleet",
    )


# Each row is asked of its own context (one model name here, one replica, one model name across the
# fleet); W2's evidence is (replica, before, after), said by the shell (act/notices.py).
DIFFER_ROW: Row[_Here, Hazard] = Row(
    DIFFER := Rule(
        "W1", "differ", "two or more replicas of one model name on this box have known fingerprints that differ"
    ),
    lambda h: _differ(w.digest for _, w in h.seen),
    _differ_here,
)
CHANGED_ROW: Row[_Moved, tuple[str, Weights, Weights]] = Row(
    CHANGED := Rule(
        "W2",
        "changed",
        "a replica's known fingerprint differs from the known one guardian saw before it: said at info, and the "
        "memory guard's M20 ceiling for it dropped",
    ),
    lambda m: m.was is not None and m.now is not None and m.was.digest != m.now.digest,
    lambda m: (m.name, _known(m.was), _known(m.now)),
)
DIFFER_FLEET_ROW: Row[_Fleet, Hazard] = Row(
    DIFFER_FLEET := Rule(
        "W3",
        "differ across the fleet",
        "a replica of this box and one of another box in the fleet view serve one model name with known "
        "fingerprints that differ",
    ),
    lambda f: bool(f.here) and bool(f.there),
    _differ_fleet,
)
RULES = (DIFFER_ROW.rule, CHANGED_ROW.rule, DIFFER_FLEET_ROW.rule)


def _known(w: Weights | None) -> Weights:
    assert w is not None, "the row holds only between two known fingerprints"
    return w


def differing(cfg: Config, found: Mapping[str, Weights | None]) -> list[Hazard]:
    """W1: one hazard per model name whose replicas' known fingerprints differ."""
    by_model: dict[str, list[tuple[str, Weights]]] = defaultdict(list)
    for r in cfg.replicas:
        w = found.get(r.name)
        if w is not None:
            by_model[r.model].append((r.name, w))
    matched = (first_match((DIFFER_ROW,), _Here(model, tuple(seen))) for model, seen in sorted(by_model.items()))
    return [hazard for _, hazard in filter(None, matched)]


def _kind(digest: str) -> str:
    return digest.split(":", 1)[0]


def _differ(digests: Iterable[str]) -> bool:
    """Two fingerprints of one kind that differ ("dir2:" and "hf:" are not compared: a snapshot whose
    files are not there is known by its commit only; nor an older guardian's "dir:" with "dir2:")."""
    kinds: dict[str, set[str]] = defaultdict(set)
    for d in digests:
        kinds[_kind(d)].add(d)
    return any(len(found) > 1 for found in kinds.values())


def differing_in_fleet(
    cfg: Config, found: Mapping[str, Weights | None], members: Iterable[FleetMember], box: str
) -> list[Hazard]:
    """W3: one hazard per model name whose replicas here and on other boxes have known fingerprints that differ."""
    out = []
    others = [m for m in members if m.box != box and m.weights is not None]
    for model in sorted({r.model for r in cfg.replicas}):
        here = {(r.name, w.digest) for r in cfg.replicas if r.model == model and (w := found.get(r.name)) is not None}
        kinds = {_kind(d) for _, d in here}
        there = tuple(
            m
            for m in others
            if m.model == model
            and m.weights is not None
            and _kind(m.weights) in kinds
            and m.weights not in {d for _, d in here}
        )
        matched = first_match((DIFFER_FLEET_ROW,), _Fleet(model, frozenset(here), there))
        if matched is not None:
            out.append(matched[1])
    return out


def changed(
    before: Mapping[str, Weights | None], after: Mapping[str, Weights | None]
) -> list[tuple[str, Weights, Weights]]:
    """W2: (replica, before, after) for each replica whose known fingerprint changed."""
    matched = (first_match((CHANGED_ROW,), _Moved(name, before.get(name), now)) for name, now in sorted(after.items()))
    return [moved for _, moved in filter(None, matched)]
