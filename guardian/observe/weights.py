"""What weights a replica really loaded (issue 33), as a fingerprint: read from what its main
process runs (observe/modelfiles.locate: its model path or Hugging Face repo, in a container
through its binds), never from its served name. Judged in core/weights.py.

- a model directory: sha256 of its config.json and its weight index (model.safetensors.index.json
  or pytorch_model.bin.index.json; each read back capped, observe/readback.py), and of each of its
  weight files (*.safetensors, *.bin, *.pt, *.gguf at its top) its name, size and sampled bytes
  (observe/weightbytes.py: 17 blocks of 4 KiB of its data, kept by the file's identity): a fine-tune
  has its base's config, names and sizes, and other bytes (issue 44);
- one weight file (a GGUF): its name, size, first 64 KiB (where GGUF keeps its metadata) and
  sampled bytes;
- a Hugging Face repo: its snapshot's directory, as a model directory (its files read through the
  links to its blobs, never outside its hub folder), the commit named in what is said; the commit
  alone (`--revision` when it is a commit, else `refs/<revision or main>` in its hub folder) when
  the snapshot is not there.

Recomputed only when the replica's process changes (its main pid or its unit's start). Each look
runs in a daemon thread of its own, never the event loop's default executor, and at most one per
replica at a time: on a file system that hangs, a look that outlives its bound (LOOK_S) leaves the
replica's fingerprint unknown and is not started again until it ends, so that no tick starts
another and the default pool that every other `to_thread` of the tick needs is never used up
(issue 41).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..config import Config, ReplicaConfig
from ..core.observations import UnitInfo
from ..core.weights import Weights
from . import modelfiles
from .memory import runs_with, service_details
from .readback import read_back
from .systemd import ServiceDetails, Systemd
from .weightbytes import BLOCK_BYTES, CACHE, SAMPLES, SampleCache

META_MAX_BYTES = 16 << 20  # a config.json or an index is far smaller
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
HEAD_BYTES = 64 << 10
# Weight files sampled in one directory; past it by name and size (a model is at most a few hundred
# shards: 1024 x 17 reads of 4 KiB is about 70 MiB read once, at the worst).
MAX_SAMPLED_FILES = 1024
SAMPLED = f"sampled bytes ({SAMPLES + 1} x {BLOCK_BYTES >> 10} KiB each)"
# The kinds of fingerprint. "dir2"/"file2": the weights' bytes sampled (issue 44); an older guardian's
# "dir"/"file" (config and names only) is another kind, never compared with these (core/weights.py),
# so that boxes of a fleet mid-upgrade do not call the same weights different (W3).
# "dirn": a directory some of whose weight files could not be read (their names and sizes only),
# compared only with others of its kind, never with a "dir2" whose bytes were read.
DIR, FILE, NAMES = "dir2:", "file2:", "dirn:"
_COMMIT = re.compile(r"[0-9a-f]{40}")
# A look's wait, at most: a fingerprint is a few capped reads (milliseconds); past it the replica's
# is unknown for this tick, its thread left to end by itself. Half the daemon's WEIGHTS_LOOK_S (10 s,
# the whole step's bound), which also holds the D-Bus questions for the units' details.
LOOK_S = 5.0
_Key = tuple[int, float | None]  # a replica's process: (main pid, its unit's start)
_Ended = tuple[Weights | None, Exception | None]  # a look's answer, or what it raised


def _read(path: str, max_bytes: int = META_MAX_BYTES) -> bytes | None:
    try:
        return read_back(path, max_bytes, follow_symlinks=True)
    except OSError:
        return None


def _weight_names(top: str) -> list[str]:
    """The weight files' names in TOP, looking at MAX_ENTRIES entries at most (a model path is the
    replica's to name); none when it cannot be listed."""
    names = []
    try:
        with os.scandir(top) as it:
            for n, entry in enumerate(it):
                if n >= modelfiles.MAX_ENTRIES:
                    break
                if entry.name.endswith(WEIGHT_SUFFIXES):
                    names.append(entry.name)
    except OSError:
        return []
    return sorted(names)


@dataclass(frozen=True)
class _File:
    """One weight file of a directory: its size (None: not stat'able) and sample digest (None: not
    sampled: past MAX_SAMPLED_FILES, or unreadable here)."""

    name: str
    size: int | None
    digest: str | None


def _weight_files(top: str, names: list[str], within: str, cache: SampleCache) -> list[_File]:
    """Each of NAMES in TOP with its size and, for the first MAX_SAMPLED_FILES, its sample digest."""
    found = []
    for n, name in enumerate(names):
        path = os.path.join(top, name)
        try:
            size = os.stat(path).st_size
        except OSError:
            found.append(_File(name, None, None))
            continue
        found.append(_File(name, size, cache.of_path(path, within) if n < MAX_SAMPLED_FILES else None))
    return found


def _of_dir(top: str, source: str, within: str, cache: SampleCache) -> Weights | None:
    """TOP's config.json, weight index and weight files (each by its name, size and sampled bytes,
    read only under WITHIN, a real path); None when it has none of them. Where a file that would be
    sampled cannot be read here, no bytes count (a NAMES fingerprint): bytes read on one side only
    must never make a difference."""
    config = _read(os.path.join(top, "config.json"))
    index = next((b for b in (_read(os.path.join(top, n)) for n in INDEXES) if b is not None), None)
    names = _weight_names(top)
    if config is None and index is None and not names:
        return None
    files = _weight_files(top, names, within, cache)
    unread = sum(1 for f in files[:MAX_SAMPLED_FILES] if f.digest is None)
    h = hashlib.sha256()
    for part in (config, index):
        h.update(part if part is not None else b"\0absent\0")
    for f in files:
        digest = (f.digest or "past the bound") if not unread else ""
        h.update(f"{f.name}\0{f.size if f.size is not None else 'unreadable'}\0{digest}\0".encode())
    read = [x for x, b in (("config.json", config), ("its weight index", index)) if b is not None]
    if names and not unread:
        past = len(names) - MAX_SAMPLED_FILES
        read.append(
            f"the names, sizes and {SAMPLED} of {len(names)} weight files"
            + (f" (the {past} past the first {MAX_SAMPLED_FILES} by name and size)" if past > 0 else "")
        )
    elif names:
        read.append(
            f"the names and sizes of {len(names)} weight files ({unread} of them unreadable here: no bytes count, "
            "and it is compared only with fingerprints that count none)"
        )
    said = ", ".join(read[:-1]) + " and " + read[-1] if len(read) > 1 else read[0]
    return Weights((NAMES if unread else DIR) + h.hexdigest()[:12], f"{said} of {source}")


def _of_file(path: str, source: str, cache: SampleCache) -> Weights | None:
    fd = modelfiles.open_regular(path)  # never a FIFO or a device: opening one could block the tick
    if fd is None:
        return None
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, HEAD_BYTES, 0)
        sampled = cache.of_fd(fd, os.path.basename(path))
    except OSError:
        return None
    finally:
        os.close(fd)
    h = hashlib.sha256(f"{os.path.basename(path)}\0{size}\0{sampled}\0".encode() + head)
    return Weights(FILE + h.hexdigest()[:12], f"the name, size, first 64 KiB and {SAMPLED} of {source}")


def _of_repo(found: modelfiles.Located, cache: SampleCache) -> Weights | None:
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
        # its files link to the repo's blobs/: read there, never out of the repo's folder
        within = os.path.realpath(found.top)
        found_dir = _of_dir(snapshot, f"snapshot {commit[:12]} of {found.source}", within, cache)
        if found_dir is not None:
            return found_dir
    return Weights(f"hf:{found.repo}@{commit[:12]}", f"the commit revision {revision} resolves to, {found.source}")


def fingerprint(
    argv: tuple[str, ...], env: Mapping[str, str] | None = None, home: str = "/root", cache: SampleCache = CACHE
) -> Weights | None:
    """The fingerprint of the weights that ARGV (run with ENV) loads; None when none can be read.
    CACHE keeps each weight file's sample digest (the process's own by default)."""
    found = modelfiles.locate(argv, env or {}, home)
    if found is None:
        return None
    if found.repo is not None:
        return _of_repo(found, cache)
    if os.path.isdir(found.top):
        return _of_dir(found.top, found.source, os.path.realpath(found.top), cache)
    return _of_file(found.top, found.source, cache)


def _in_own_thread(name: str, read: Callable[[], Weights | None]) -> asyncio.Future[_Ended]:
    """READ run in a daemon thread of its own (never the loop's default executor, which a read that
    hangs would hold); its answer, or what it raised, comes back on the running loop."""
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[_Ended] = loop.create_future()

    def settle(answer: _Ended) -> None:
        if not ended.done():
            ended.set_result(answer)

    def run() -> None:
        try:
            answer: _Ended = (read(), None)
        except Exception as e:  # noqa: BLE001 - said by whoever awaits it (the daemon: once, at error)
            answer = (None, e)
        try:
            loop.call_soon_threadsafe(settle, answer)
        except RuntimeError:
            pass  # the loop is closed: nobody waits for it any more

    threading.Thread(target=run, name=f"guardian-weights-{name}", daemon=True).start()
    return ended


class WeightsWatch:
    """Each replica's fingerprint, read again only when its process changes; at most one look per
    replica at a time, each in its own thread."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[_Key, Weights | None]] = {}
        self._running: dict[str, asyncio.Future[_Ended]] = {}  # replica -> its look still in flight

    async def look(
        self, cfg: Config, sd: Systemd, units: Mapping[str, UnitInfo | None], bound_s: float = LOOK_S
    ) -> dict[str, Weights | None]:
        """Each replica's fingerprint: kept while its process is the same, else read anew, waited for
        at most BOUND_S (all together); one still running from an earlier look is unknown (None),
        not waited for and not started again. Raises what a look that ended raised."""
        out: dict[str, Weights | None] = {}
        started: dict[str, asyncio.Future[_Ended]] = {}
        for r in cfg.replicas:
            unit = units.get(r.name)
            key: _Key = (unit.main_pid, unit.inactive_exit_mono) if unit is not None else (0, None)
            kept = self._seen.get(r.name)
            if kept is not None and kept[0] == key:
                out[r.name] = kept[1]
            elif r.name in self._running:
                out[r.name] = None  # its look outlived its bound: one at a time
            else:
                started[r.name] = await self._start(sd, r, unit, key)
        if started:
            await asyncio.wait(started.values(), timeout=bound_s)
        for name, ended in started.items():
            found, error = ended.result() if ended.done() else (None, None)
            if error is not None:
                raise error
            out[name] = found
        self._seen = {n: v for n, v in self._seen.items() if n in out}
        return out

    async def _start(self, sd: Systemd, r: ReplicaConfig, unit: UnitInfo | None, key: _Key) -> asyncio.Future[_Ended]:
        """R's look begun; its answer kept (for KEY) whenever it ends, and R free for the next."""
        details = await service_details(sd, r)
        ended = _in_own_thread(r.name, _reader(unit.main_pid if unit is not None else 0, details))
        self._running[r.name] = ended

        def done(_: asyncio.Future[_Ended]) -> None:
            self._running.pop(r.name, None)
            found, error = ended.result()
            if error is None:
                self._seen[r.name] = (key, found)

        ended.add_done_callback(done)
        return ended


def _reader(pid: int, details: ServiceDetails | None) -> Callable[[], Weights | None]:
    def read() -> Weights | None:
        runs = runs_with(pid, details)
        return fingerprint(runs.argv, runs.env, runs.home)

    return read


async def of_replica(sd: Systemd, r: ReplicaConfig, unit: UnitInfo | None, bound_s: float = LOOK_S) -> Weights | None:
    """R's fingerprint from its running process's command line, else its unit's ExecStart= (None:
    unknown, or not read within BOUND_S: its thread is left to end by itself)."""
    details = await service_details(sd, r)
    ended = _in_own_thread(r.name, _reader(unit.main_pid if unit is not None else 0, details))
    try:
        found, error = await asyncio.wait_for(asyncio.shield(ended), bound_s)
    except TimeoutError:
        return None
    if error is not None:
        raise error
    return found
