"""What `guardian check` says of each replica's engine: which one, how it was told, and what is and
is not judged for it (guardian/engines/)."""

from __future__ import annotations

from ..core.fit.startfit import NOT_SIZED
from ..core.observations import Probe
from ..core.watchdog.liveness import ENGINE_QUIET, STALL_CANARY, STALL_WINDOW
from ..engines.base import Engine
from ..engines.resolve import Told

# The rules that read an engine's own count of its work (/metrics): left out where none is read.
COUNT_RULES = (
    f"{STALL_WINDOW.id}, {STALL_CANARY.id} and {ENGINE_QUIET.id} on its own count of work (clients waiting still count)"
)


def engine_line(name: str, told: Told, metrics_probe: Probe | None, memory_guard: bool) -> str:
    """One line: REPLICA's engine, how it was told, what its probes read, what is not judged and why."""
    e = told.engine
    parts = [f"replica {name}: engine {e.label} ({told.how})", f"health from {e.health_note}"]
    parts.append(_page(e, metrics_probe))
    parts += [f"not judged: {lack}" for lack in e.lacks]
    parts.append(_knob(e, memory_guard))
    return "; ".join(parts)


def _page(e: Engine, probe: Probe | None) -> str:
    if probe is not None and not e.page_offered(probe.status):
        return (
            f"its page ({e.metrics_path}) is NOT offered: {e.metrics_hint()} ({COUNT_RULES} are not applied till then)"
        )
    via = ", answered by its engine's own loop (an unanswered read while /health answers is the engine not answering)"
    return f"progress from {e.metrics_path}" + (via if e.metrics_via_engine else "")


def _knob(e: Engine, memory_guard: bool) -> str:
    if e.knob is None:
        return f"memory guard: never lowers it (no memory fraction); start fit: not judged ({NOT_SIZED.id})"
    lowers = f"lowers it with {e.knob.flag} ({e.knob.meaning})" if memory_guard else "off"
    fit = "judged" if e.knob.of_total else f"not judged ({NOT_SIZED.id}: its fraction is not of the whole memory)"
    return f"memory guard: {lowers}; start fit: {fit}"
