"""What weights a replica really loaded (issue 33), as a fingerprint: read from what its main
process runs (observe/modelfiles.locate: its model path or Hugging Face repo, in a container
through its binds), never from its served name. Judged in core/weights.py.

- a model directory: sha256 of its config.json and its weight index (model.safetensors.index.json
  or pytorch_model.bin.index.json), else of its weight files' names and sizes
  (*.safetensors, *.bin, *.pt, *.gguf), each file read back capped (observe/readback.py);
- one weight file (a GGUF): its name, size and first 64 KiB (where GGUF keeps its metadata);
- a Hugging Face repo: the commit its snapshot resolves to: `--revision` when it is a commit,
  else `refs/<revision or main>` in its hub folder.

Recomputed only when the replica's process changes (its main pid or its unit's start).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
from collections.abc import Mapping

from ..config import Config, ReplicaConfig
from ..core.observations import UnitInfo
from ..core.weights import Weights
from . import modelfiles
from .memory import runs_with, service_details
from .readback import read_back
from .systemd import Systemd

META_MAX_BYTES = 16 << 20  # a config.json or an index is far smaller
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
HEAD_BYTES = 64 << 10
_COMMIT = re.compile(r"[0-9a-f]{40}")


def _read(path: str, max_bytes: int = META_MAX_BYTES) -> bytes | None:
    try:
        return read_back(path, max_bytes, follow_symlinks=True)
    except OSError:
        return None


def _weight_names(top: str) -> list[str] | None:
    """The weight files' names in TOP, looking at MAX_ENTRIES entries at most (a model path is the
    replica's to name); None when it cannot be listed."""
    names = []
    try:
        with os.scandir(top) as it:
            for n, entry in enumerate(it):
                if n >= modelfiles.MAX_ENTRIES:
                    break
                if entry.name.endswith(WEIGHT_SUFFIXES):
                    names.append(entry.name)
    except OSError:
        return None
    return sorted(names)


def _of_dir(top: str, source: str) -> Weights | None:
    h = hashlib.sha256()
    config = _read(os.path.join(top, "config.json"))
    index = next((b for b in (_read(os.path.join(top, n)) for n in INDEXES) if b is not None), None)
    if config is None and index is None:
        names = _weight_names(top)
        if names is None:
            return None
        if not names:
            return None
        for n in names:
            try:
                h.update(f"{n}\0{os.stat(os.path.join(top, n)).st_size}\0".encode())
            except OSError:
                return None
        return Weights("dir:" + h.hexdigest()[:12], f"the names and sizes of {len(names)} weight files of {source}")
    for part in (config, index):
        h.update(part if part is not None else b"\0absent\0")
    read = " and ".join(x for x, b in (("config.json", config), ("its weight index", index)) if b is not None)
    return Weights("dir:" + h.hexdigest()[:12], f"{read} of {source}")


def _of_file(path: str, source: str) -> Weights | None:
    fd = modelfiles.open_regular(path)  # never a FIFO or a device: opening one could block the tick
    if fd is None:
        return None
    try:
        size = os.fstat(fd).st_size
        head = os.read(fd, HEAD_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    h = hashlib.sha256(f"{os.path.basename(path)}\0{size}\0".encode() + head)
    return Weights("file:" + h.hexdigest()[:12], f"the name, size and first 64 KiB of {source}")


def _of_repo(found: modelfiles.Located) -> Weights | None:
    """The snapshot's directory fingerprint (comparable with a local copy of the same weights),
    else the commit its revision resolves to."""
    revision = modelfiles.option(found.argv, "--revision") or "main"
    commit = revision if _COMMIT.fullmatch(revision) else None
    refs = os.path.join(found.top, "refs")
    ref_path = os.path.normpath(os.path.join(refs, revision))
    if commit is None and ref_path.startswith(refs + os.sep):  # a revision never reads outside refs/
        ref = _read(ref_path, 4096)
        text = ref.decode(errors="replace").strip() if ref is not None else ""
        commit = text if _COMMIT.fullmatch(text) else None
    if commit is None:
        return None
    snapshot = os.path.join(found.top, "snapshots", commit)
    if os.path.isdir(snapshot):
        found_dir = _of_dir(snapshot, f"snapshot {commit[:12]} of {found.source}")
        if found_dir is not None:
            return found_dir
    return Weights(f"hf:{found.repo}@{commit[:12]}", f"the commit revision {revision} resolves to, {found.source}")


def fingerprint(argv: tuple[str, ...], env: Mapping[str, str] | None = None, home: str = "/root") -> Weights | None:
    """The fingerprint of the weights that ARGV (run with ENV) loads; None when none can be read."""
    found = modelfiles.locate(argv, env or {}, home)
    if found is None:
        return None
    if found.repo is not None:
        return _of_repo(found)
    if os.path.isdir(found.top):
        return _of_dir(found.top, found.source)
    return _of_file(found.top, found.source)


class WeightsWatch:
    """Each replica's fingerprint, read again only when its process changes."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[tuple[int, float | None], Weights | None]] = {}

    async def look(self, cfg: Config, sd: Systemd, units: Mapping[str, UnitInfo | None]) -> dict[str, Weights | None]:
        out: dict[str, Weights | None] = {}
        for r in cfg.replicas:
            unit = units.get(r.name)
            key = (unit.main_pid, unit.inactive_exit_mono) if unit is not None else (0, None)
            kept = self._seen.get(r.name)
            if kept is not None and kept[0] == key:
                out[r.name] = kept[1]
                continue
            found = await of_replica(sd, r, unit)
            self._seen[r.name] = (key, found)
            out[r.name] = found
        self._seen = {n: v for n, v in self._seen.items() if n in out}
        return out


async def of_replica(sd: Systemd, r: ReplicaConfig, unit: UnitInfo | None) -> Weights | None:
    """R's fingerprint from its running process's command line, else its unit's ExecStart=."""
    details = await service_details(sd, r)
    pid = unit.main_pid if unit is not None else 0

    def read() -> Weights | None:
        runs = runs_with(pid, details)
        return fingerprint(runs.argv, runs.env, runs.home)

    return await asyncio.to_thread(read)
