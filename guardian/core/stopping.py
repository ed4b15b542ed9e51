"""A planned stop that lets vLLM finish what it holds (issue 44 item 2). Pure.

vLLM (0.32 and later) has ``--shutdown-timeout N``: on SIGTERM it stops taking requests and lets
the running ones finish for up to N s; the default, 0, aborts them. guardian bounds every planned
stop (an operator's restart, drained or not, a lowering or a raise: P.stop_timeout_s, 30 s), then
kills the unit's processes: a bound shorter than N would kill what vLLM is letting finish. So a
replica whose unit passes N is given N + SHUTDOWN_MARGIN_S (T1), and the restart's line says how
many requests its last /metrics showed running or waiting, and whether vLLM lets them finish.

What its unit passes is read from its ExecStart= as systemd runs it (core/observations.py
UnitDeclared: its ${VAR}s expanded; a container's command for a `docker run` / `podman run` line),
when units may have changed, never from the live process (which may rewrite its command line).

`guardian check` warns (T2, T3) where the unit itself defeats this: systemd's TimeoutStopSec
kills the stop before vLLM's N is over, or, under [proxy], a replica has no N at all, so the
requests still running when its drain times out (D7), or at an undrained restart (D2), are aborted.

Rules: RULES below (T1-T3), rendered into docs/rules.md; T2 and T3 are WARNING_ROWS, checked each.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ..config import Config
from .container import last_option, served
from .observations import UnitDeclared, VllmSample
from .rules import Row, Rule, first_match

SHUTDOWN_FLAG = "--shutdown-timeout"
# Past vLLM's own N: its API server then aborts what is left, shuts its engine down and exits, and
# the GPU's memory is handed back. An idle vLLM 0.32 stopped in 1.0 s, a frozen one with streams in
# flight took 23 s (shared/BRIEF.md); KServe gives vLLM 60 s of grace over a 45 s drain (kserve
# #5496): 15 s. A hung stop past it is killed, as any planned stop past its bound.
SHUTDOWN_MARGIN_S = 15.0


@dataclass(frozen=True)
class _Stop:
    """A planned restart's stop as BOUND_ROW reads it."""

    stop_timeout_s: float  # P.stop_timeout_s
    shutdown_s: float | None  # N, where its unit passes one > 0 (shutdown_s())


# Its evidence is the stop's bound; where it does not hold the bound is P.stop_timeout_s.
BOUND_ROW: Row[_Stop, float] = Row(
    BOUND := Rule(
        "T1",
        "stop bound",
        "a planned restart (an operator's, drained or not; a lowering or a raise) of a replica whose unit's "
        "ExecStart= passes vLLM's --shutdown-timeout N > 0: its stop is bounded by max(P.stop_timeout_s, N + "
        "SHUTDOWN_MARGIN_S) (15 s) instead of P.stop_timeout_s, and its restart job waited for as much longer; its "
        "restart line says how many requests its last /metrics showed running and waiting, and that vLLM lets them "
        "finish for up to N s (without N: that its stop aborts them)",
    ),
    lambda s: s.shutdown_s is not None,
    lambda s: max(s.stop_timeout_s, (s.shutdown_s or 0.0) + SHUTDOWN_MARGIN_S),
)


@dataclass(frozen=True)
class _Unit:
    """One replica's unit as T2 and T3 read it."""

    replica: str
    unit: str
    proxy: bool  # [proxy] is configured
    given: str | None  # --shutdown-timeout's value as written (None: not passed)
    shutdown_s: float | None  # N when it is a number >= 0 (None: not passed, or not a number)
    timeout_stop_s: float | None  # TimeoutStopSec (None: infinity)

    @property
    def needed_s(self) -> float:
        return (self.shutdown_s or 0.0) + SHUTDOWN_MARGIN_S


WARNING_ROWS: tuple[Row[_Unit, str], ...] = (
    Row(
        KILLS_EARLY := Rule(
            "T2",
            "warning",
            "a replica's unit passes --shutdown-timeout N > 0 AND its TimeoutStopSec < N + SHUTDOWN_MARGIN_S: "
            "systemd kills vLLM while it still lets its requests finish (guardian check)",
        ),
        lambda u: bool(u.shutdown_s) and u.timeout_stop_s is not None and u.timeout_stop_s < u.needed_s,
        lambda u: (
            f"replica {u.replica}: {u.unit} has TimeoutStopSec={u.timeout_stop_s:g}s, shorter than vLLM's "
            f"--shutdown-timeout {u.shutdown_s:g} s + {SHUTDOWN_MARGIN_S:g} s: systemd kills vLLM before the requests "
            f"it lets finish are done; set TimeoutStopSec={math.ceil(u.needed_s)}s or more in {u.unit} "
            f"(systemctl edit {u.unit}) ({KILLS_EARLY.id})"
        ),
    ),
    Row(
        ABORTS := Rule(
            "T3",
            "warning",
            "[proxy] is configured AND a replica's unit passes no --shutdown-timeout (or 0): the requests still "
            "running when its drain times out (D7), or at a restart not drained (D2), are aborted by its stop "
            "(guardian check)",
        ),
        lambda u: u.proxy and (u.given is None or u.shutdown_s == 0.0),
        lambda u: (
            f"replica {u.replica}: {u.unit} passes vLLM no --shutdown-timeout"
            + (" but 0" if u.given is not None else "")
            + ": on SIGTERM vLLM aborts every request still running, so a drain that times out "
            "(proxy.drain_timeout_s) or a restart not drained fails those requests; pass --shutdown-timeout N "
            f"(N: your longest request, in s) in its ExecStart= ({ABORTS.id})"
        ),
    ),
)

RULES = (BOUND_ROW.rule, *(row.rule for row in WARNING_ROWS))


def given(argv: tuple[str, ...]) -> str | None:
    """--shutdown-timeout's value in ARGV as written (the last one, as vLLM's argument parser takes
    it), or None when it is not passed."""
    return last_option(argv, SHUTDOWN_FLAG)


def _seconds(value: str | None) -> float | None:
    """VALUE as vLLM's seconds: a finite number >= 0, else None (unreadable, as guardian cannot tell)."""
    try:
        seconds = float(value) if value is not None else math.nan
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def shutdown_s(declared: UnitDeclared | None) -> float | None:
    """N, vLLM's --shutdown-timeout as its unit passes it, when it is a number > 0; None: not passed,
    0, not a number, or the unit not read."""
    if declared is None or declared.unseen is not None:
        return None
    seconds = _seconds(given(served(declared.argv, declared.env).argv))
    return seconds if seconds else None


@dataclass(frozen=True)
class PlannedStop:
    """How a planned restart's stop is bounded (T1), and what its line says of it."""

    bound_s: float
    shutdown_s: float | None  # N, where the unit passes one

    @property
    def bound_text(self) -> str:
        """What the restart's line says of its bound."""
        said = f", its processes killed if the stop takes over {self.bound_s:g} s"
        if self.shutdown_s is not None:
            said += f" (vLLM's --shutdown-timeout {self.shutdown_s:g} s + {SHUTDOWN_MARGIN_S:g} s: {BOUND.id})"
        return said

    def held_text(self, sample: VllmSample | None) -> str:
        """What the restart's line says of the requests its last /metrics (SAMPLE) showed."""
        if sample is None:
            return "; requests still running at the stop: unknown (/metrics unreadable)"
        if sample.queued == 0:
            return "; no request running or waiting at its last /metrics"
        held = f"; {sample.running:.0f} running and {sample.waiting:.0f} waiting at its last /metrics"
        if self.shutdown_s is not None:
            return held + f", which vLLM lets finish for up to {self.shutdown_s:g} s"
        return held + ", which its stop may cut (no --shutdown-timeout on its command line)"


def planned_stop(cfg: Config, declared: UnitDeclared | None) -> PlannedStop:
    """T1: a planned restart's stop bound, P.stop_timeout_s or N + SHUTDOWN_MARGIN_S, the longer."""
    n = shutdown_s(declared)
    bounded = first_match((BOUND_ROW,), _Stop(cfg.proxy.stop_timeout_s, n))
    return PlannedStop(bounded[1] if bounded is not None else cfg.proxy.stop_timeout_s, n)


def job_wait_s(cfg: Config, stop_timeout_s: float | None) -> float:
    """How long a restart job is waited for: W.restart_job_timeout_s, and as much longer as its stop
    bound is past P.stop_timeout_s (T1): the stop is part of the job."""
    longer_s = max(0.0, (stop_timeout_s or 0.0) - cfg.proxy.stop_timeout_s)
    return cfg.watchdog.restart_job_timeout_s + longer_s


def warnings(cfg: Config, declared: Mapping[str, UnitDeclared | None]) -> list[str]:
    """T2 and T3 for each replica whose unit was read (DECLARED: by replica name), as `guardian
    check` says them."""
    found = []
    for r in cfg.replicas:
        seen = declared.get(r.name)
        if seen is None or seen.unseen is not None:
            continue
        value = given(served(seen.argv, seen.env).argv)
        unit = _Unit(r.name, r.unit, cfg.proxy.enabled, value, _seconds(value), seen.timeout_stop_s)
        found += [row.evidence(unit) for row in WARNING_ROWS if row.holds(unit)]
    return found
