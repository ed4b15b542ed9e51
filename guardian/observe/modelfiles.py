"""A replica's own model files, found from what its unit declares, and how much of them the page cache holds.

Where vLLM reads its weights from (its unit's ExecStart=, its ${VAR}s expanded from the unit's
Environment= and EnvironmentFile= as systemd expands them, and that environment): never a live
command line, which its process may rewrite (`exec -a vllm ... serve ANOTHER-TREE` made guardian
walk and release another model's files, issue 41 row 4):

- `vllm serve MODEL` or `--model MODEL` (and each engine's own: model_of): a path (a directory,
  or one file such as a GGUF) is read as it is; anything else is a Hugging Face repo id, whose
  files are in the hub cache as `models--ORG--NAME/` (blobs, with snapshots linking to them);
- the hub cache is `--download-dir`, else `HF_HUB_CACHE`, else `HF_HOME/hub`, else
  `~/.cache/huggingface/hub` of the unit's user (root: /root);
- in a container (the unit runs `docker run` / `podman run`), MODEL, `--download-dir` and the
  hub cache (its `-e HF_HOME`/`HF_HUB_CACHE`, else `/root/.cache/huggingface/hub`) are the
  container's paths: each is found on the host through the container's `-v`/`--mount` binds and
  named volumes, the longest mount first; one under no mount is not on the host.

Only regular files are counted, each once (a snapshot's links and their blobs are one file), and
only those whose real path (links resolved) lies under the model path's real path: a link out of
it is not followed. The walk is breadth first (a model's files lie near its top, so a deep tree
beside them cannot hide them) and bounded: at most MAX_FILES files among at most MAX_ENTRIES
directory entries in at most MAX_DIRS directories, for at most WALK_MAX_S; never through a FIFO or
a device (os.stat first, then O_NONBLOCK and fstat). A model path may hold other users' files
(issue 41 row 4: a tree of nobody's 1,000-1,800 deep cost 60 ms a file), and guardian must not
block on them. A file is released (and measured) only through a read-only descriptor guardian
opens with its own rights, whose real path (the kernel's, read back from /proc/self/fd) still lies
under the model path: a file swapped for a link after the walk is left alone.

How much of a file is cached: cachestat(2) (Linux >= 6.5) without mapping it, else mincore(2) on
a read-only mapping, a chunk at a time, for at most MINCORE_MAX_BYTES of files per measure (the
rest count at their size, unmeasured).
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import math
import os
import re
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..core.container import parse_run_line

MAX_FILES = 20_000
MAX_ENTRIES = 200_000  # directory entries looked at in one search, files or not
# Directories read in one search: a hub folder has blobs/, refs/, snapshots/ and one per snapshot,
# a model directory a handful; 10,000 is far past any model and bounds a tree of someone else's
# directories (one directory read is at least one open, a getdents and a close).
MAX_DIRS = 10_000
# One search's time, whatever the tree: a model of 20,000 files is walked in about 0.1 s on a local
# disk; a tree built to be slow (1,000-1,800 deep: 60 ms a file, issue 41 row 4) is cut here, with
# what was found so far (the fit then counts its own files as unmeasured). Well under the fit
# step's bound (act/fit.py FIT_STEP_S), which may walk three times.
WALK_MAX_S = 2.0
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
    """Where a replica's weights are, as found; PATHS are regular files, each once, each under TOP."""

    source: str  # "/models/qwen (--model)", "Qwen/Qwen3-8B in /root/.cache/huggingface/hub"; "" if none found
    paths: tuple[str, ...]
    cut: str = ""  # why the search stopped short ("more than 20000 files", ...): PATHS are those found first
    top: str = ""  # the model path's real path: every one of PATHS lies under it

    @property
    def truncated(self) -> bool:
        return bool(self.cut)


def option(argv: tuple[str, ...], name: str) -> str | None:
    for at, arg in enumerate(argv):
        if arg == name and at + 1 < len(argv):
            return argv[at + 1]
        if arg.startswith(name + "="):
            return arg.partition("=")[2]
    return None


def model_of(argv: tuple[str, ...], env: Mapping[str, str] | None = None) -> str | None:
    """The model a serving engine is started with (guardian/engines/): SGLang's `--model-path M`;
    MODEL of `vllm serve MODEL`, `trtllm-serve [serve] MODEL`; `--model M` (vLLM, llama-server);
    llama-server's `-m FILE` (only where llama-server is the program: `python3 -m MODULE` is not a
    model), else its LLAMA_ARG_MODEL in ENV (how Debian's llama.cpp-services configures it)."""
    found = option(argv, "--model-path")
    if found:
        return found
    for at, word in enumerate(argv):
        if word == "serve" or word.rsplit("/", 1)[-1] == "trtllm-serve":
            rest = argv[at + 1 :]
            if rest[:1] == ("serve",):
                rest = rest[1:]
            if rest and not rest[0].startswith("-"):
                return rest[0]
            break
    found = option(argv, "--model")
    if found:
        return found
    if any(w.rsplit("/", 1)[-1].startswith("llama-server") for w in argv):
        return option(argv, "-m") or (env or {}).get("LLAMA_ARG_MODEL")
    return None


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


def under(path: str, top: str) -> bool:
    """PATH is TOP or lies below it (both real paths)."""
    return path == top or path.startswith(top.rstrip("/") + "/")


@dataclass(frozen=True)
class Walked:
    """A search's files (real paths, regular, each once) and why it stopped short ("": it did not)."""

    paths: tuple[str, ...]
    cut: str


def _walk(top: str, deadline_mono: float, clock: Callable[[], float]) -> Walked:
    """The regular files under real path TOP (TOP itself if it is one), breadth first. A model path
    is the replica's to name and may hold anyone's files: "/" (or one directory of millions, or a
    tree thousands deep) must not be read through. Links to directories are not followed, links to
    files only where their target lies under TOP."""
    if _regular(top) is not None:
        return Walked((top,), "")
    walk = _Walk(top, deadline_mono, clock)
    dirs = collections.deque([top])
    while dirs and not walk.cut:
        dirs.extend(walk.read(dirs.popleft()))
    return Walked(tuple(walk.paths), walk.cut)


class _Walk:
    """One search's state: what it found, what it has left of each bound."""

    def __init__(self, top: str, deadline_mono: float, clock: Callable[[], float]) -> None:
        self.top, self.deadline_mono, self.clock = top, deadline_mono, clock
        self.entries_left, self.dirs_left = MAX_ENTRIES, MAX_DIRS
        self.paths: list[str] = []
        self.seen: set[tuple[int, int]] = set()
        self.cut = ""

    def read(self, path: str) -> list[str]:
        """The directories in directory PATH; its files added to what was found."""
        self.dirs_left -= 1
        if self._late():
            return []
        if self.dirs_left < 0:
            self.cut = f"more than {MAX_DIRS} directories"
            return []
        found, dirs = [], []
        try:
            with os.scandir(path) as it:
                for entry in it:
                    self.entries_left -= 1
                    if self.entries_left < 0:
                        self.cut = f"more than {MAX_ENTRIES} directory entries"
                        return []
                    if self._late():
                        return []
                    if entry.is_dir(follow_symlinks=False):
                        dirs.append(entry.path)
                    else:
                        found.append((entry.path, entry.is_symlink()))
        except OSError:
            return []
        for file, link in sorted(found):
            if self.cut or (link and self._late()):
                break
            self._add(os.path.realpath(file) if link else file)  # a link's target: its real path read
        return dirs

    def _late(self) -> bool:
        if self.clock() >= self.deadline_mono:
            self.cut = f"its time ({WALK_MAX_S:g} s at most) spent"
        return bool(self.cut)

    def _add(self, real: str) -> None:
        key = _regular(real) if under(real, self.top) else None
        if key is None or key in self.seen:
            return
        if len(self.paths) >= MAX_FILES:
            self.cut = f"more than {MAX_FILES} files"
            return
        self.seen.add(key)
        self.paths.append(real)


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


def find(
    argv: tuple[str, ...],
    env: Mapping[str, str],
    home: str = "/root",
    deadline_mono: float = math.inf,
    clock: Callable[[], float] = time.monotonic,
) -> ModelFiles:
    """The model files of a replica whose unit runs ARGV (its ExecStart=, expanded) with ENV, searched
    for at most WALK_MAX_S and not past DEADLINE_MONO (CLOCK's)."""
    found = locate(argv, env, home)
    if found is None:
        return ModelFiles("", ())
    top = os.path.realpath(found.top)
    walked = _walk(top, min(deadline_mono, clock() + WALK_MAX_S), clock)
    return ModelFiles(found.source, walked.paths, walked.cut, top)


def _locate(
    argv: tuple[str, ...], env: Mapping[str, str], home: str, mounts: tuple[tuple[str, str], ...] | None
) -> Located | None:
    """MOUNTS: the container's, whose paths ARGV and ENV name (None: the host's own)."""

    def host(path: str) -> str | None:
        return path if mounts is None else on_host(path, mounts)

    model = model_of(argv, env)
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


def open_regular(path: str, within: str = "") -> int | None:
    """A read-only descriptor of regular file PATH, or None; never blocks on a FIFO. WITHIN (a real
    path): only a file whose real path, as the kernel resolved the open, lies under it."""
    if _regular(path) is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode) or (within and not _opened_under(fd, within)):
        os.close(fd)
        return None
    return fd


def _opened_under(fd: int, top: str) -> bool:
    """FD's file, as the kernel opened it (links resolved at that moment), lies under TOP."""
    try:
        return under(os.readlink(f"/proc/self/fd/{fd}"), top)
    except OSError:
        return False


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


def cached_bytes(
    paths: tuple[str, ...],
    within: str = "",
    deadline_mono: float = math.inf,
    clock: Callable[[], float] = time.monotonic,
) -> Cached:
    """How much of PATHS (those under WITHIN) the page cache holds now: measured where the kernel
    tells, each file that it does not counted at its size (an upper bound); unmeasured when
    DEADLINE_MONO (CLOCK's) came before the last file."""
    total, measured, mincore_left = 0, True, MINCORE_MAX_BYTES
    for path in paths:
        if clock() >= deadline_mono:
            return Cached(total, False)
        fd = open_regular(path, within)
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


def release(
    paths: tuple[str, ...],
    within: str = "",
    deadline_mono: float = math.inf,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Ask the kernel to drop the clean pages of PATHS under WITHIN from the page cache (posix_fadvise
    DONTNEED: any reader may, so only through a descriptor guardian opens with its own rights); how
    many of the files it was asked for. It stops at DEADLINE_MONO (CLOCK's), counting what it did by
    then: a start that went on without its fit must not lose its files' cache while it loads."""
    done = 0
    for path in paths:
        if clock() >= deadline_mono:
            break
        fd = open_regular(path, within)
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


_BRACED = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$\$")
_BARE = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")


def unit_argv(exec_start: tuple[str, ...], env: Mapping[str, str]) -> tuple[str, ...]:
    """A unit's ExecStart= (as systemd's D-Bus gives it: unexpanded) as systemd runs it with ENV:
    `${VAR}` is VAR's value in its word, a word `$VAR` is VAR's value split at whitespace (zero or
    more words), `$$` is `$`; an unset VAR is empty (systemd.service(5), "Command lines")."""
    out: list[str] = []
    for arg in exec_start:
        bare = _BARE.fullmatch(arg)
        if bare is not None:
            out.extend(env.get(bare[1], "").split())
        else:
            out.append(_BRACED.sub(lambda m: "$" if m[0] == "$$" else env.get(m[1], ""), arg))
    return tuple(out)


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
