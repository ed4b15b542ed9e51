"""A replica's longest recent step (issue 35 item 8): a long prompt's prefill is one step in which
nothing moves (measured on a real vLLM 0.32 with default scheduler settings: 67-69 s for a
7k-token prompt). It is learned from vllm:request_prefill_time_seconds (the bucket bound that
covers every prefill that ended since the last look) and kept: the STEPS_KEPT longest within
STEP_MEMORY_S, in the state file too, so a guardian restart learns nothing anew. A stall canary
(L14) and the stall window (L13) never end a replica's work sooner than STEP_MARGIN x it. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from ..observations import VllmSample

# For the type checker alone: track.py imports the rows (a new track's rule is their first STARTING
# rule), and the rows import this module; at run time it would be a cycle.
if TYPE_CHECKING:
    from .track import Track

STEPS_KEPT = 8
STEP_MEMORY_S = 24 * 3600.0
STEP_MARGIN = 1.5


def longest_new_prefill(prev: VllmSample | None, cur: VllmSample | None) -> float | None:
    """An upper bound of the longest prefill that ended between PREV and CUR: the smallest bucket
    bound whose count rose as much as the whole histogram's (the largest finite bound if only +Inf
    did); None when none ended, or the counts went down (a new engine)."""
    if prev is None or cur is None or not cur.prefill_buckets or not prev.prefill_buckets:
        return None
    before = dict(prev.prefill_buckets)
    rises = [(bound, count - before.get(bound, 0.0)) for bound, count in cur.prefill_buckets]
    total = rises[-1][1]
    if total <= 0 or any(rise < 0 for _, rise in rises):
        return None
    finite = [bound for bound, _ in rises if bound != float("inf")]
    for bound, rise in rises:
        if rise >= total:
            return bound if bound != float("inf") else (max(finite) if finite else None)
    return None


def learn_step(track: Track, step_s: float | None, now: float, cap_s: float) -> Track:
    """TRACK with STEP_S learned at NOW: the STEPS_KEPT longest of the last STEP_MEMORY_S. A step
    that is not a number in (0, CAP_S] (W.max_step_s) is dropped: a page that says 1e300 s (or a
    bucket bound past what guardian would wait anyway) teaches nothing."""
    recent = [s for s in track.steps if now - s[1] < STEP_MEMORY_S]
    if step_s is not None and _in_range(step_s, cap_s):
        recent.append((step_s, now))
    kept = tuple(sorted(recent, key=lambda s: (-s[0], -s[1]))[:STEPS_KEPT])
    return track if kept == track.steps else replace(track, steps=kept)


def kept_steps(steps: Iterable[tuple[float, float]], cap_s: float) -> tuple[tuple[float, float], ...]:
    """Steps read back from the state file, as learn_step keeps them: each in (0, CAP_S], others dropped."""
    ok = [(s, at) for s, at in steps if _in_range(s, cap_s) and math.isfinite(at)]
    return tuple(sorted(ok, key=lambda s: (-s[0], -s[1]))[:STEPS_KEPT])


def _in_range(step_s: float, cap_s: float) -> bool:
    return math.isfinite(step_s) and 0 < step_s <= cap_s


def longest_step_s(track: Track, now: float, cap_s: float) -> float | None:
    """STEP_MARGIN x the longest step learned in the last STEP_MEMORY_S, at most CAP_S (W.max_step_s),
    or None: none learned."""
    recent = [bound for bound, at in track.steps if now - at < STEP_MEMORY_S]
    return min(cap_s, STEP_MARGIN * max(recent)) if recent else None
