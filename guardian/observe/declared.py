"""What a replica's unit says of how its server runs (core/observations.py UnitDeclared), and the
box's logind settings: read here, judged by the core (core/stopping.py, core/outside.py)."""

from __future__ import annotations

import asyncio
import os
import pwd
from pathlib import Path

from ..config import ReplicaConfig
from ..core.observations import LogindConf, UnitDeclared
from . import modelfiles
from .memory import read_env_file
from .readback import read_back
from .systemd import ServiceDetails, Systemd, SystemdError

# Where systemd-logind reads logind.conf and its drop-ins, highest priority first (systemd.syntax(7),
# "Configuration Directories and Precedence"): the first main file found; the drop-ins of every
# directory by name, a name in a higher directory hiding the same name lower, applied in name order.
LOGIND_DIRS = ("etc/systemd", "run/systemd", "usr/local/lib/systemd", "usr/lib/systemd")
LOGIND_FILE_MAX_BYTES = 64 * 2**10  # a configuration file is a few lines


def uid_of(user: str) -> int | None:
    """User='s uid on this box, as systemd resolves it (a name, or a number); root for ""; None:
    a name this box does not know (a DynamicUser= name, or a typo: systemd would not start it)."""
    if not user:
        return 0
    if user.isdigit():
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None


def declared_from(unit: str, details: ServiceDetails) -> UnitDeclared:
    """Blocking (it reads the unit's environment files and the user database): run in a thread."""
    files = tuple(read_env_file(p) for p in details.environment_files)
    env = modelfiles.unit_env(details.environment, tuple(f.text for f in files))
    stop_s = details.timeout_stop_us / 1e6 if details.timeout_stop_us is not None else None
    return UnitDeclared(
        unit,
        modelfiles.unit_argv(details.exec_start, env),
        env,
        details.user,
        uid_of(details.user),
        stop_s,
        tuple(f.path for f in files if f.error is not None),
    )


async def declared_of(sd: Systemd, r: ReplicaConfig) -> UnitDeclared:
    """How R's unit says its server runs; a container without a unit, or a unit systemd does not
    answer about, is UNSEEN (and why)."""
    if r.unitless:
        return UnitDeclared(r.unit, unseen=f"container {r.container} runs without a unit")
    try:
        details = await sd.service_details(r.unit)
    except SystemdError as e:
        return UnitDeclared(r.unit, unseen=f"systemd could not be asked about {r.unit}: {e}")
    return await asyncio.to_thread(declared_from, r.unit, details)


def _logind_files(root: Path) -> list[Path]:
    """logind's files under ROOT in the order it applies them: its main file, then its drop-ins."""
    mains = [root / d / "logind.conf" for d in LOGIND_DIRS]
    found = [next(p for p in mains if p.exists())] if any(p.exists() for p in mains) else []
    dropins: dict[str, Path] = {}
    for d in LOGIND_DIRS:
        try:
            names = os.listdir(root / d / "logind.conf.d")
        except OSError:
            continue
        for name in names:
            if name.endswith(".conf"):
                dropins.setdefault(name, root / d / "logind.conf.d" / name)
    return found + [dropins[name] for name in sorted(dropins)]


def read_logind(root: Path = Path("/")) -> LogindConf:
    """logind's files as it applies them (core/outside.py judges RemoveIPC=). A drop-in that is a link
    to /dev/null, or empty, masks the one of that name below it and sets nothing. Blocking."""
    files, errors = [], []
    for path in _logind_files(root):
        try:
            if path.is_symlink() and os.path.realpath(path) == "/dev/null":
                continue
            text = read_back(path, LOGIND_FILE_MAX_BYTES, follow_symlinks=True).decode(errors="replace")
        except OSError as e:
            errors.append(f"{path}: {e.strerror or e}")
            continue
        files.append((str(path), text))
    return LogindConf(tuple(files), "; ".join(errors) or None)


def logind_signature(root: Path = Path("/")) -> tuple[tuple[str, int, int], ...]:
    """What changes when logind's files do: each file's path, modification time and size. Blocking."""
    out = []
    for path in _logind_files(root):
        try:
            st = path.stat()
        except OSError:
            continue
        out.append((str(path), st.st_mtime_ns, st.st_size))
    return tuple(out)
