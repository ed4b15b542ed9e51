"""Is a replica's unit wired for the memory guard? Pure: reads what systemd reports.

Wired means: one of its EnvironmentFile= is guardian's file for it, and its ExecStart= passes
``--gpu-memory-utilization ${GPU_MEMORY_UTILIZATION}`` (or ``$GPU_MEMORY_UTILIZATION``, or the
``--gpu-memory-utilization=...`` form). Otherwise a restart would start it with the same fraction
and free nothing.
"""

from __future__ import annotations

from pathlib import Path

VAR_FORMS = ("${GPU_MEMORY_UTILIZATION}", "$GPU_MEMORY_UTILIZATION")


def wiring_problem(unit: str, env_files: tuple[str, ...], exec_start: tuple[str, ...], env_path: Path) -> str | None:
    missing = []
    if str(env_path) not in env_files:
        missing.append(f"EnvironmentFile=-{env_path}")
    argv = list(exec_start)
    passes = any(
        (a == "--gpu-memory-utilization" and i + 1 < len(argv) and argv[i + 1] in VAR_FORMS)
        or a in tuple(f"--gpu-memory-utilization={v}" for v in VAR_FORMS)
        for i, a in enumerate(argv)
    )
    if not passes:
        missing.append("--gpu-memory-utilization ${GPU_MEMORY_UTILIZATION} in ExecStart=")
    if not missing:
        return None
    return (f"add {' and '.join(missing)} to {unit} (systemctl edit --full {unit}; keep a default with "
            "Environment=GPU_MEMORY_UTILIZATION=0.78 before the EnvironmentFile= line)")


def read_env_fraction(path: Path) -> float | None:
    """GPU_MEMORY_UTILIZATION from guardian's env file; None if absent or unreadable."""
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "GPU_MEMORY_UTILIZATION":
                f = float(value.strip().strip('"'))
                return f if 0 < f <= 1 else None
    except (OSError, ValueError):
        return None
    return None
