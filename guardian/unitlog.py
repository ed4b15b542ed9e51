"""What a unit's own journal says about why it did not start (vLLM's startup errors)."""

from __future__ import annotations

import asyncio

MARKERS = ("Free memory on device", "less than desired GPU memory utilization", "failed to start", "Error", "ERROR")


def find_start_error(lines: list[str], fraction: float | None = None) -> str | None:
    """The most telling line: vLLM's memory refusal first, else the last error-looking line.

    With FRACTION, a memory refusal counts only if it is about that fraction (vLLM prints
    "desired GPU memory utilization (0.74, ...)"), so that the failure of a start with the
    previous fraction is not taken for a failure of the new one."""
    for marker in MARKERS:
        for line in reversed(lines):
            if marker not in line:
                continue
            if fraction is not None and "utilization (" in line and f"utilization ({fraction:g}," not in line \
                    and f"utilization ({fraction}," not in line:
                continue
            return line.strip()[:400]
    return None


async def start_error(unit: str, since_ts: float, fraction: float | None = None, timeout_s: float = 5.0) -> str | None:
    try:
        proc = await asyncio.create_subprocess_exec(
            "journalctl", "--no-pager", "-o", "cat", "-u", unit, "--since", f"@{since_ts:.6f}", "-n", "300",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    except OSError:
        return None
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        return None
    return find_start_error(out.decode(errors="replace").splitlines(), fraction)
