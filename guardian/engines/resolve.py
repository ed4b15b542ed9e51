"""Which engine each replica is: its config's `engine`, or for "auto" what its unit's command line says."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ReplicaConfig
from .base import Engine
from .known import DEFAULT, detect, named


@dataclass(frozen=True)
class Told:
    """A replica's engine and how it was told (said at start, and by `guardian check`)."""

    engine: Engine
    how: str


def told(r: ReplicaConfig, words: tuple[str, ...] | None, unseen: str | None = None) -> Told:
    """R's engine. WORDS: what its unit starts (core/container.engine_words of its ExecStart,
    expanded), None where it could not be read (UNSEEN says why)."""
    if r.engine != "auto":
        return Told(named(r.engine), "configured")
    if words is None:
        why = unseen or "its unit's command line was not read"
        return Told(DEFAULT, f"auto: {why}; {DEFAULT.label} assumed (set engine in the config)")
    found = detect(words)
    if found is None:
        return Told(DEFAULT, f"auto: no engine's name on {r.unit}'s command line; {DEFAULT.label} assumed")
    engine, word = found
    return Told(engine, f"auto: `{word}` on {r.unit}'s command line")
