"""The kernel's memory figures: /proc/meminfo and /proc/pressure/memory."""

from __future__ import annotations

from pathlib import Path

from ..core.observations import MemorySample


def read_meminfo(path: Path = Path("/proc/meminfo")) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in path.read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


def read_psi(path: Path = Path("/proc/pressure/memory")) -> tuple[float | None, float | None]:
    try:
        text = path.read_text()
    except OSError:
        return None, None  # kernel without PSI: normal
    vals: dict[str, float] = {}
    for line in text.splitlines():
        kind, *pairs = line.split()
        for pair in pairs:
            k, _, v = pair.partition("=")
            if k == "avg10":
                vals[kind] = float(v)
    return vals.get("some"), vals.get("full")


def sample_memory() -> MemorySample:
    info = read_meminfo()
    some, full = read_psi()
    return MemorySample(
        info["MemTotal"],
        info.get("MemAvailable", info["MemFree"]),
        info["MemFree"],
        some,
        full,
        info.get("Active(file)", 0) + info.get("Inactive(file)", 0),
    )
