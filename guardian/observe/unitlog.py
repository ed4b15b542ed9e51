"""A unit's own journal lines: vLLM's refusal to start since a lowering, and what `nginx -t` said.

Only vLLM's memory refusal counts ("Free memory on device ... is less than desired GPU memory
utilization (0.74, ...)"), and only when it names the fraction that was written: a start is
failed by facts (this refusal, the unit failed, or the startup grace ran out; core/memory/memguard.py
M7), never by a word in a log. Every vLLM start logs warnings that say "error" (the ulimit one).
"""

from __future__ import annotations

import asyncio

REFUSAL_MARKERS = ("Free memory on device", "less than desired GPU memory utilization")


def find_start_error(lines: list[str], fraction: float | None = None) -> str | None:
    """vLLM's memory refusal among LINES, or None. With FRACTION, only a refusal about that fraction
    (so that the failure of a start with the previous fraction is not taken for the new one's)."""
    for line in reversed(lines):
        if not any(m in line for m in REFUSAL_MARKERS):
            continue
        if (
            fraction is not None
            and "utilization (" in line
            and f"utilization ({fraction:g}," not in line
            and f"utilization ({fraction}," not in line
        ):
            continue
        return line.strip()[:400]
    return None


async def unit_lines(unit: str, since_ts: float, n: int = 300, timeout_s: float = 5.0) -> list[str] | None:
    """The last N lines UNIT logged since SINCE_TS (wall), or None when the journal cannot be read."""
    try:
        proc = await asyncio.create_subprocess_exec(
            "journalctl",
            "--no-pager",
            "-o",
            "cat",
            "-u",
            unit,
            "--since",
            f"@{since_ts:.6f}",
            "-n",
            str(n),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
    except OSError:
        return None
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return None
    return out.decode(errors="replace").splitlines()


async def start_error(unit: str, since_ts: float, fraction: float | None = None, timeout_s: float = 5.0) -> str | None:
    lines = await unit_lines(unit, since_ts, 300, timeout_s)
    return None if lines is None else find_start_error(lines, fraction)
