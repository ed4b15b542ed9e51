"""A replica's place at the proxy, as the core keeps it (TickState.drains): up (no entry), or
marked down (a Drain). A leaf, so that the tick's working state (core/work.py) holds drains and
core/proxy/drain.py and draining.py, whose rules move them, can read that state. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Phase(StrEnum):
    DRAINING = "draining"
    AWAY = "away"


@dataclass(frozen=True)
class Drain:
    phase: Phase
    since: float  # marked down (asked for) at
    why: str
    request_id: str | None = None  # the operator's request a planned drain serves
    confirmed_at: float | None = None  # the proxy reported it marked down (the drain timer starts)
    for_memory: bool = False  # the memory guard's lowering waits for it (M16), not an operator
    error_said: bool = False  # the proxy's refusal was logged (a memory drain waits for the proxy's retry)
    warm_from: float | None = None  # away, back, and its warm-up requests sent at (D13); None: not warming
