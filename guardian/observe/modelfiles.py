"""A replica's own model files, found from what it runs, and how much of them the page cache holds.

Where vLLM reads its weights from (its command line and its unit's environment):

- `vllm serve MODEL` or `--model MODEL`: a path (a directory, or one file such as a GGUF) is read
  as it is; anything else is a Hugging Face repo id, whose files are in the hub cache as
  `models--ORG--NAME/` (blobs, with snapshots linking to them);
- the hub cache is `--download-dir`, else `HF_HUB_CACHE`, else `HF_HOME/hub`, else
  `~/.cache/huggingface/hub` of the unit's user (root: /root);
- in a container (the unit runs `docker run` / `podman run`), MODEL, `--download-dir` and the
  hub cache (its `-e HF_HOME`/`HF_HUB_CACHE`, else `/root/.cache/huggingface/hub`) are the
  container's paths: each is found on the host through the container's `-v`/`--mount` binds and
  named volumes, the longest mount first; one under no mount is not on the host.

Only regular files are counted, each once (a snapshot's links and their blobs are one file), at
most MAX_FILES of them among at most MAX_ENTRIES directory entries, never through a FIFO or a
device (os.stat first, then O_NONBLOCK and fstat): a command line is the replica user's to write,
and guardian must not block on it.

How much of a file is cached: cachestat(2) (Linux >= 6.5) without mapping it, else mincore(2) on
a read-only mapping, a chunk at a time, for at most MINCORE_MAX_BYTES of files per measure (the
rest count at their size, unmeasured).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from ..core.container import parse_run_line

MAX_FILES = 20_000
MAX_ENTRIES = 200_000  # directory entries looked at in one search, files or not
MINCORE_CHUNK_BYTES = 2**30  # mapped at a time: its residency vector is 256 KiB (4 KiB pages)
MINCORE_MAX_BYTES = 256 * 2**30  # asked of mincore in one measure; beyond it files count at their size
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
CACHESTAT_NR = 451  # the same number on x86_64 and aarch64 (the generic syscall table)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Range(ctypes.Structure):
    _fields_ = (("off", ctypes.c_uint64), ("len", ctypes.c_uint64))


class _Stat(ctypes.Structure):
    _fields_ = (
        ("nr_cache", ctypes.c_uint64),
        ("nr_dirty", ctypes.c_uint64),
        ("nr_writeback", ctypes.c_uint64),
        ("nr_evicted", ctypes.c_uint64),
        ("nr_recently_evicted", ctypes.c_uint64),
    )


@dataclass(frozen=True)
class ModelFiles:
    """Where a replica's weights are, as found; PATHS are regular files, each once."""

    source: str  # "/models/qwen (--model)", "Qwen/Qwen3-8B in /root/.cache/huggingface/hub"; "" if none found
    paths: tuple[str, ...]
    truncated: bool = False  # more than MAX_FILES: the first MAX_FILES only


def option(argv: tuple[str, ...], name: str) -> str | None:
    for at, arg in enumerate(argv):
        if arg == name and at + 1 < len(argv):
            return argv[at + 1]
        if arg.startswith(name + "="):
            return arg.partition("=")[2]
    return None


def model_of(argv: tuple[str, ...]) -> str | None:
    """MODEL of `vllm serve MODEL ...`, else of `--model MODEL`."""
    if "serve" in argv:
        rest = argv[argv.index("serve") + 1 :]
        if rest and not rest[0].startswith("-"):
            return rest[0]
    return option(argv, "--model")


def hub_dirs(argv: tuple[str, ...], env: Mapping[str, str], home: str) -> list[str]:
    """The hub caches a repo id may be in, in vLLM's order of preference."""
    found = [d for d in (option(argv, "--download-dir"), env.get("HF_HUB_CACHE")) if d]
    if env.get("HF_HOME"):
        found.append(os.path.join(env["HF_HOME"], "hub"))
    found.append(os.path.join(home, ".cache", "huggingface", "hub"))
    return found


def _regular(path: str) -> tuple[int, int] | None:
    """(device, inode) of a regular file PATH (links followed), or None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def _walk(top: str) -> Iterator[str | None]:
    """The files under TOP (TOP itself if it is a file), then None if MAX_ENTRIES ran out first: a
    model path is the replica's to name, and "/" (or one directory of millions) must not be read
    through. Entries are counted as they are read; links to directories are not followed."""
    if _regular(top) is not None:
        yield top
        return
    left, dirs = MAX_ENTRIES, [top]
    while dirs:
        try:
            with os.scandir(dirs.pop()) as it:
                found = []
                for entry in it:
                    left -= 1
                    if left < 0:
                        yield None
                        return
                    if entry.is_dir(follow_symlinks=False):
                        dirs.append(entry.path)
                    else:
                        found.append(entry.path)
        except OSError:
            continue
        yield from sorted(found)


def on_host(path: str, mounts: tuple[tuple[str, str], ...]) -> str | None:
    """A container's PATH on the host, through the mount whose target holds it (the longest)."""
    for host, target in sorted(mounts, key=lambda m: -len(m[1])):
        t = target.rstrip("/") or "/"
        if path == t or path.startswith(t.rstrip("/") + "/"):
            return host.rstrip("/") + path[len(t.rstrip("/")) :]
    return None


@dataclass(frozen=True)
class Located:
    """Where a replica's model is on the host: TOP (its model path, or its repo's folder in a hub
    cache), how that was found (SOURCE), and the command line that names it (ARGV: a container's
    own command inside its run line)."""

    top: str
    source: str
    argv: tuple[str, ...]
    repo: str | None = None  # the Hugging Face repo id, when TOP is its hub folder


def locate(argv: tuple[str, ...], env: Mapping[str, str], home: str = "/root") -> Located | None:
    """Where the model of a replica whose main process runs ARGV with ENV is, or None."""
    run = parse_run_line(argv)
    if run is None:
        return _locate(argv, env, home, None)
    run_env = dict(e.split("=", 1) for e in run.envs if "=" in e)
    return _locate(run.command, run_env, "/root", run.mounts)


def find(argv: tuple[str, ...], env: Mapping[str, str], home: str = "/root") -> ModelFiles:
    """The model files of a replica whose main process runs ARGV with ENV."""
    found = locate(argv, env, home)
    return ModelFiles("", ()) if found is None else _files(found)


def _locate(
    argv: tuple[str, ...], env: Mapping[str, str], home: str, mounts: tuple[tuple[str, str], ...] | None
) -> Located | None:
    """MOUNTS: the container's, whose paths ARGV and ENV name (None: the host's own)."""

    def host(path: str) -> str | None:
        return path if mounts is None else on_host(path, mounts)

    model = model_of(argv)
    if not model:
        return None
    where = "" if mounts is None else " in its container"
    if model.startswith(("/", "./", "~")) or (mounts is None and os.path.isdir(model)):
        found = host(os.path.expanduser(model))
        if found is None:
            return None
        return Located(
            found, f"{model}{where} (its model path{'' if found == model else ', ' + found + ' on the host'})", argv
        )
    org, _, name = model.rpartition("/")
    folder = "models--" + "--".join(p for p in (org, name) if p)
    for hub in hub_dirs(argv, env, home):
        at = host(os.path.join(hub, folder))
        if at is not None and os.path.isdir(at):
            source = f"{model} in {hub}{where}" + ("" if at.startswith(hub) else f" ({at} on the host)")
            return Located(at, source, argv, repo=model)
    return None


def _files(found: Located) -> ModelFiles:
    seen: set[tuple[int, int]] = set()
    paths: list[str] = []
    for path in _walk(found.top):
        if path is None:
            return ModelFiles(found.source, tuple(paths), truncated=True)
        key = _regular(path)
        if key is None or key in seen:
            continue
        if len(paths) >= MAX_FILES:
            return ModelFiles(found.source, tuple(paths), truncated=True)
        seen.add(key)
        paths.append(os.path.realpath(path))
    return ModelFiles(found.source, tuple(paths))


def open_regular(path: str) -> int | None:
    """A read-only descriptor of regular file PATH, or None; never blocks on a FIFO."""
    if _regular(path) is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _may_measure(fd: int, path: str) -> bool:
    """Whether the kernel tells this process a file's page cache: cachestat(2) and mincore(2) do so
    only to its owner or a process that may write it (mincore reports every page resident to any
    other, cachestat refuses with EPERM): a root-owned model file is not guardian's to measure."""
    return os.geteuid() in (0, os.fstat(fd).st_uid) or os.access(path, os.W_OK)


def _cachestat_pages(fd: int) -> int | None:
    """FD's pages in the page cache by cachestat(2) (Linux >= 6.5), without mapping it; None: not answered."""
    rng, out = _Range(0, 0), _Stat()
    if _libc.syscall(CACHESTAT_NR, fd, ctypes.byref(rng), ctypes.byref(out), 0) == 0:
        return int(out.nr_cache)
    return None


def _mincore_pages(fd: int, path: str, size: int) -> int | None:
    """FD's pages in the page cache by mincore(2), a chunk at a time; None where the kernel will not say."""
    if not _may_measure(fd, path):
        return None
    pages = 0
    for offset in range(0, size, MINCORE_CHUNK_BYTES):
        found = _mincore(fd, offset, min(MINCORE_CHUNK_BYTES, size - offset))
        if found is None:
            return None
        pages += found
    return pages


def _mincore(fd: int, offset: int, length: int) -> int | None:
    """Resident pages of FD's LENGTH bytes from OFFSET (a multiple of the chunk: page-aligned)."""
    addr = _libc.mmap(None, length, 1, 1, fd, offset)  # PROT_READ, MAP_SHARED
    if addr in (None, _MAP_FAILED):
        return None
    try:
        vec = (ctypes.c_ubyte * ((length + PAGE_BYTES - 1) // PAGE_BYTES))()
        if _libc.mincore(addr, length, vec) != 0:
            return None
        return sum(b & 1 for b in vec)
    finally:
        _libc.munmap(addr, length)


@dataclass(frozen=True)
class Cached:
    """How much of a set of files the page cache holds: BYTES, exact where MEASURED, else at most
    their size (the kernel would not say)."""

    bytes: int
    measured: bool


def cached_bytes(paths: tuple[str, ...]) -> Cached:
    """How much of PATHS the page cache holds now: measured where the kernel tells, each file that it
    does not counted at its size (an upper bound)."""
    total, measured, mincore_left = 0, True, MINCORE_MAX_BYTES
    for path in paths:
        fd = open_regular(path)
        if fd is None:
            continue
        try:
            size = os.fstat(fd).st_size
            pages = _cachestat_pages(fd)
            if pages is None and size <= mincore_left:  # a sparse file may claim any size: bounded
                mincore_left -= size
                pages = _mincore_pages(fd, path, size)
            if pages is None:
                total, measured = total + size, False
            else:
                total += pages * PAGE_BYTES
        finally:
            os.close(fd)
    return Cached(total, measured)


def release(paths: tuple[str, ...]) -> int:
    """Ask the kernel to drop PATHS' clean pages from the page cache (posix_fadvise DONTNEED: any
    reader may); how many of the files it was asked for."""
    done = 0
    for path in paths:
        fd = open_regular(path)
        if fd is None:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            done += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return done


def home_of(user: str | None) -> str:
    """The home directory of a unit's User= (root when unset or unknown)."""
    if not user:
        return "/root"
    import pwd

    try:
        return pwd.getpwnam(user).pw_dir
    except KeyError:
        return "/root"


def unit_env(pairs: tuple[str, ...], files: tuple[str | None, ...]) -> dict[str, str]:
    """A unit's Environment= ("K=V" each) overridden by its environment files' texts, in order."""
    env: dict[str, str] = {}
    for text in files:
        for line in (text or "").splitlines():
            line = line.strip()
            if line and not line.startswith(("#", ";")) and "=" in line:
                key, _, value = line.partition("=")
                env[key.strip().removeprefix("export ").strip()] = value.strip().strip("\"'")
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if sep:
            env.setdefault(key, value)
    return env
