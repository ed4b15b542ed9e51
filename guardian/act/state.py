"""Files guardian writes: persistent state (StateDirectory) and runtime status (RuntimeDirectory).

Every write is atomic: a temporary file in the same directory, fsync, rename over the old one,
fsync of the directory. A reader sees the old file or the new one, never half of one.
Read-modify-write of the persistent state holds an flock, because ``guardian pause`` and
``guardian restart`` (other processes) change it too. The lock file lies in a directory of its
own, mode 0700 and owned by the state directory's owner (guardian's user), so that no other user
can open it and hold the lock (it was a 0644 file in the 0755 state directory: any user could
flock it and stop every state write, the daemon's start among them). The lock is waited for at
most STATE_LOCK_TIMEOUT_S; then the read or write fails with StateLocked (an OSError), which
every caller already says and survives.

``guardian restart NAME`` records a request under "requests" while the daemon runs; the daemon
acts on it on its next tick (core/tick.py) and moves it to "answers" with the outcome, which the
command waits for and prints. ``--wait D`` records "wait_until" (a stamp, now + D) with it: while a
refusal that passes by itself keeps it open (A4), the daemon writes what it waits for under the
request's "waiting", which the command prints; an answer refused when the wait ended has
"waited_out": true.

Every persisted time is a stamp ``{"wall": epoch s, "mono": CLOCK_MONOTONIC s}``, and the file
carries the ``boot_id`` its monotonic times belong to. Read in the same boot, the monotonic time
is used, so a step of the wall clock moves no window; after a reboot only the wall time means
anything, and a wall time in the future counts as now. A bare number (the older format) is a
wall time. A persisted time beyond MAX_TIME_S either way makes the file corrupt; one ahead of now
(wall or monotonic) is clamped to now, a pause's end to now + the longest pause.

"canary_latencies" keeps, per replica, its last successful canaries' latencies in seconds (newest
last), from which the core learns its canary deadline (core/watchdog/canary.py): a guardian restarted or
reloaded starts from them instead of learning anew. Each is a number in (0, MAX_LATENCY_S]; any
other value makes the file corrupt, and of a longer list the newest CANARY_LATENCIES_KEPT are read.

"step_seconds" keeps, per replica, the longest steps it was seen to take (a long prompt's prefill;
core/watchdog/steps.py learn_step), longest first, each {"s": seconds, "at": a stamp of when it was
learned}: the stall rules never end a step shorter than its own, across guardian's restarts too,
and a step is forgotten STEP_MEMORY_S after it was learned, restarts or not. Each "s" is a number
in (0, MAX_STEP_S]; any other value makes the file corrupt, and of a longer list the first
STEPS_KEPT are read.

"fraction_bases" keeps, per replica, its base fraction: the one it had before guardian's memory
guard first lowered it (the highest it lowered it from, if the operator raised it in between).
The memory guard raises a lowered fraction back toward it and never above it; a replica with no
base was never lowered by guardian and is never raised. Each is a number in [MIN_FRACTION, 1];
any other value makes the file corrupt.

Files read back (here and by the exporters) are read with read_back (observe/readback.py): never
through a symlink, only a regular file, only up to a size, so that a FIFO or a link to /dev/zero
planted in a directory another user can write blocks or swallows nothing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from ..config import MAX_WINDOW_S, MIN_FRACTION, Config
from ..core.actions import AnswerRequest
from ..core.observations import Pause, PersistentView, RestartRequest
from ..core.watchdog.canary import CANARY_LATENCIES_KEPT
from ..core.watchdog.steps import STEPS_KEPT
from ..observe.clock import Now, boot_id
from ..observe.clock import now as clock_now
from ..observe.readback import read_back as read_back  # re-exported: export/files.py imports it from here

STATE_FILE = "state.json"
STATUS_FILE = "status.json"
STATE_VERSION = 1
ANSWERS_KEPT_S = 600.0  # an answer nobody fetched is dropped after this
# Far beyond any epoch time (the year 5138) or uptime guardian will see, and small enough that
# every sum or difference of two times stays exact to the millisecond.
MAX_TIME_S = 1e11
# A state file is a few KiB (restarts within a window, answers for 10 minutes): one this large
# is not guardian's, and is moved aside rather than read.
STATE_MAX_BYTES = 8 * 2**20
MAX_LATENCY_S = 3600.0  # a canary latency kept in the file: within (0, this]
MAX_STEP_S = 7680.0  # a step kept in the file: within (0, vLLM's largest finite prefill bucket]


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace PATH with DATA (mode MODE). Whatever is at PATH (a symlink, a FIFO) is replaced by
    the rename, never written through.

    The directory may be writable by another user (node_exporter's textfile directory is often
    group-writable): the mode is set on the descriptor, since a chmod by name follows whatever
    link was swapped in for the temporary file; and the rename is refused when the name no
    longer holds the file written. (Such a user can still replace PATH itself at any time.)"""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            ours = os.fstat(f.fileno())
            there = os.stat(tmp, follow_symlinks=False)
            if (there.st_dev, there.st_ino) != (ours.st_dev, ours.st_ino):
                raise OSError(errno.EEXIST, "replaced by another process before the rename; not renamed", tmp)
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


LOCK_DIR = ".lock"  # in the state directory: 0700, the state directory's owner's
LOCK_FILE = "state.lock"
STATE_LOCK_TIMEOUT_S = 5.0  # the CLI holds it for a read-modify-write: milliseconds
LOCK_POLL_S = 0.02


class StateLocked(OSError):
    """The state lock was held by another process for longer than STATE_LOCK_TIMEOUT_S."""


class CorruptState(Exception):
    def __init__(self, path: Path, moved_to: Path, reason: str) -> None:
        super().__init__(f"state file {path} was corrupt ({reason}); moved aside to {moved_to}, starting from defaults")
        self.moved_to = moved_to


StateDoc = dict[str, Any]  # the state file as read: validated, one key per section


def _empty() -> StateDoc:
    return {
        "version": STATE_VERSION,
        "boot_id": "",
        "restarts": {},
        "pauses": {},
        "resumed_at": {},
        "requests": {},
        "answers": {},
        "proxy_down": [],
        "canary_latencies": {},
        "step_seconds": {},
        "fraction_bases": {},
    }


Stamp = dict[str, float | None]


def stamp(at: Now) -> Stamp:
    return {"wall": at.wall, "mono": at.mono}


def _number(value: Any) -> float:
    # Compared before float(): float(10**400) and math.isfinite(10**400) raise OverflowError;
    # NaN fails any comparison.
    if isinstance(value, bool) or not isinstance(value, int | float) or not -MAX_TIME_S <= value <= MAX_TIME_S:
        raise ValueError(f"{value!r:.40} is not a time (a finite number of seconds within +-{MAX_TIME_S:g})")
    return float(value)


def _latency(value: Any) -> float:
    # Compared before float(), as _number: an int too large for a float, NaN and inf all fail.
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_LATENCY_S:
        raise ValueError(f"{value!r:.40} is not a canary latency (a number of seconds in (0, {MAX_LATENCY_S:g}])")
    return float(value)


def _step(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_STEP_S:
        raise ValueError(f"{value!r:.40} is not a step (a number of seconds in (0, {MAX_STEP_S:g}])")
    return float(value)


def _step_entry(value: Any, latest: Now) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{value!r:.40} is not a learned step ({{'s': seconds, 'at': a time}})")
    return {"s": _step(value.get("s")), "at": _time(value.get("at"), latest)}


def _fraction(value: Any) -> float:
    # Compared before float(), as _number.
    if isinstance(value, bool) or not isinstance(value, int | float) or not MIN_FRACTION <= value <= 1:
        raise ValueError(f"{value!r:.40} is not a fraction (a number in [{MIN_FRACTION:g}, 1])")
    return float(value)


def _time(value: Any, latest: Now) -> Stamp:
    """A persisted time: a stamp, or a bare number (a wall time, the older format). Wrong types
    and numbers out of bounds are corrupt; a time after LATEST is clamped to it, on both clocks:
    a monotonic time ahead of now cannot be of this boot, nor is one of another boot used."""
    if isinstance(value, dict):
        mono = value.get("mono")
        return {
            "wall": min(_number(value.get("wall")), latest.wall),
            "mono": None if mono is None else min(_number(mono), latest.mono),
        }
    return {"wall": min(_number(value), latest.wall), "mono": None}


TEXT_MAX_CHARS = 4096  # a longer text field makes the file corrupt on reading: written shorter


def _clip(text: str) -> str:
    return text if len(text) <= TEXT_MAX_CHARS else text[: TEXT_MAX_CHARS - 3] + "..."


def _text(value: Any, limit: int = TEXT_MAX_CHARS) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise ValueError("a text field is not a string or is too long")
    return value


def _table(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError("a section is not a JSON object")
    return value


def _request(q: dict[str, Any], latest: Now) -> dict[str, Any]:
    """One restart request: its replica, when it was asked, until when it may wait (its end lies
    ahead, at most the longest window away; None: answered at once) and what it waits for now."""
    until = q.get("wait_until")
    waiting = q.get("waiting")
    expires = q.get("expires")
    out: dict[str, Any] = {
        "replica": _text(q["replica"]),
        "at": _time(q["at"], latest),
        "wait_until": None if until is None else _time(until, _ahead(latest)),
        "waiting": None if waiting is None else _text(waiting),
        "expires": None if expires is None else _time(expires, _ahead(latest)),
    }
    if q.get("no_drain") is not None:
        if not isinstance(q["no_drain"], bool):
            raise ValueError("a request's no_drain is not true or false")
        out["no_drain"] = q["no_drain"]
    asker = q.get("asker")
    if asker is not None:  # the asking command: its pid and its start (clock ticks after boot)
        asker = _table(asker)
        pid, start = asker.get("pid"), asker.get("start")
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v < 2**63 for v in (pid, start)):
            raise ValueError("a request's asker is not a pid and a start time")
        out["asker"] = {"pid": pid, "start": start}
    return out


def _ahead(latest: Now) -> Now:
    """The latest an end (a pause's, a wait's) may lie: the longest window after LATEST."""
    return Now(latest.mono + MAX_WINDOW_S, latest.wall + MAX_WINDOW_S)


def _validate(data: Any, latest: Now) -> StateDoc:
    """Typed validation: anything of the wrong type, or not a time, makes the file corrupt; a time
    after LATEST (now) is clamped to it."""
    if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
        raise ValueError("not a guardian state file of version 1")
    out = _empty()
    for name, times in _table(data.get("restarts", {})).items():
        if not isinstance(times, list):
            raise ValueError(f"restarts of {name!r} is not a list")
        out["restarts"][name] = sorted((_time(t, latest) for t in times), key=lambda st: st["wall"] or 0.0)
    for name, p in _table(data.get("pauses", {})).items():
        until = _table(p).get("until")
        if until is not None:  # a pause's end lies in the future, at most the longest pause away
            until = _time(until, _ahead(latest))
        out["pauses"][name] = {"until": until, "reason": _text(p.get("reason", "operator"))}
        since = _table(p).get("since")
        if since is not None:  # when it began: a past time (0.1.0 did not record it)
            out["pauses"][name]["since"] = _time(since, latest)
    for name, t in _table(data.get("resumed_at", {})).items():
        out["resumed_at"][name] = _time(t, latest)
    for rid, q in _table(data.get("requests", {})).items():
        out["requests"][rid] = _request(_table(q), latest)
    for rid, a in _table(data.get("answers", {})).items():
        a = _table(a)
        if not isinstance(a["ok"], bool) or not isinstance(a.get("waited_out", False), bool):
            raise ValueError("an answer's ok or waited_out is not true or false")
        out["answers"][rid] = {
            "replica": _text(a["replica"]),
            "ok": a["ok"],
            "message": _text(a["message"]),
            "at": _time(a["at"], latest),
            "waited_out": a.get("waited_out", False),
        }
    for name, latencies in _table(data.get("canary_latencies", {})).items():
        if not isinstance(latencies, list):
            raise ValueError(f"canary_latencies of {name!r} is not a list")
        out["canary_latencies"][name] = [_latency(x) for x in latencies][-CANARY_LATENCIES_KEPT:]
    for name, steps in _table(data.get("step_seconds", {})).items():
        if not isinstance(steps, list):
            raise ValueError(f"step_seconds of {name!r} is not a list")
        out["step_seconds"][name] = [_step_entry(x, latest) for x in steps][:STEPS_KEPT]
    for name, base in _table(data.get("fraction_bases", {})).items():
        out["fraction_bases"][name] = _fraction(base)
    down = data.get("proxy_down", [])
    if not isinstance(down, list):
        raise ValueError("proxy_down is not a list")
    out["proxy_down"] = sorted({_text(n, 64) for n in down})
    boot = data.get("boot_id", "")
    out["boot_id"] = _text(boot, 64)
    for k, v in data.items():
        if k not in out:
            out[k] = v  # sections owned by later features are kept as they are
    return out


def _stamps(data: StateDoc) -> Iterator[Stamp]:
    for times in data["restarts"].values():
        yield from times
    for p in data["pauses"].values():
        if p["until"] is not None:
            yield p["until"]
        if p.get("since") is not None:
            yield p["since"]
    yield from data["resumed_at"].values()
    for section in ("requests", "answers"):
        for entry in data[section].values():
            yield entry["at"]
    for entry in data["requests"].values():
        for end in ("wait_until", "expires"):
            if entry.get(end) is not None:
                yield entry[end]


def _adopt_boot(data: StateDoc, this_boot: str) -> None:
    """Before writing: monotonic times from another boot are dropped, and the file is this boot's."""
    if data.get("boot_id") != this_boot:
        for st in _stamps(data):
            st["mono"] = None
        data["boot_id"] = this_boot


def forget_unconfigured(data: StateDoc, replicas: set[str]) -> None:
    """Drop the history, pauses, canary latencies and base fractions of replicas that are no longer in the config."""
    for section in ("restarts", "pauses", "resumed_at", "canary_latencies", "step_seconds", "fraction_bases"):
        data[section] = {k: v for k, v in data[section].items() if k in replicas}


class StateStore:
    def __init__(self, state_dir: Path, clock: Callable[[], Now] = clock_now) -> None:
        self.dir = state_dir
        self.clock = clock  # times read are clamped to its now
        self.path = state_dir / STATE_FILE
        self.lock_path = state_dir / LOCK_DIR / LOCK_FILE
        self.lock_timeout_s = STATE_LOCK_TIMEOUT_S

    def _private_lock_dir(self) -> None:
        """The lock's directory: made 0700, given to the state directory's owner when root (the
        CLI) makes it, so the daemon's user can open the lock too and nobody else can."""
        lock_dir = self.lock_path.parent
        with contextlib.suppress(FileExistsError):
            os.mkdir(lock_dir, 0o700)
        st = os.lstat(lock_dir)
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, "not a directory (something else was planted there)", str(lock_dir))
        owner = os.stat(self.dir)
        if os.geteuid() == 0 and (st.st_uid, st.st_gid) != (owner.st_uid, owner.st_gid):
            os.chown(lock_dir, owner.st_uid, owner.st_gid, follow_symlinks=False)
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(lock_dir, 0o700)  # a directory: lstat said so just now

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._private_lock_dir()
        # Read-only is enough for flock; in the private directory only root and the owner reach it.
        fd = os.open(self.lock_path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if os.geteuid() == 0:  # root's CLI made it: the daemon's user must open it too
                owner = os.stat(self.dir)
                with contextlib.suppress(OSError):
                    os.fchown(fd, owner.st_uid, owner.st_gid)
            self._wait_for_lock(fd)
            yield
        finally:
            os.close(fd)

    def _wait_for_lock(self, fd: int) -> None:
        # Never an unbounded flock: in the daemon this runs on the event loop.
        deadline = time.monotonic() + self.lock_timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise StateLocked(
                        errno.EWOULDBLOCK,
                        f"the state lock was held by another process for over {self.lock_timeout_s:g} s",
                        str(self.lock_path),
                    ) from None
                time.sleep(LOCK_POLL_S)

    def _read_unlocked(self) -> StateDoc:
        try:
            raw = read_back(self.path, STATE_MAX_BYTES)
        except FileNotFoundError:
            return _empty()
        except OSError as e:
            planted = {errno.ELOOP: "a symbolic link", errno.ENXIO: "a socket"}
            if e.errno not in (*planted, errno.EINVAL, errno.EFBIG):
                raise  # unreadable (permissions, I/O): said by the caller, the file left alone
            self._move_aside(planted.get(e.errno or 0) or e.strerror or str(e))  # or a FIFO, a device, too large
        try:
            return _validate(json.loads(raw), self.clock())
        # ArithmeticError: what a number out of every range raises (OverflowError) is a corrupt
        # file like any other, not a traceback that systemd restarts into the same file.
        except (ValueError, TypeError, AttributeError, KeyError, RecursionError, ArithmeticError) as e:
            self._move_aside(str(e) or type(e).__name__)

    def _move_aside(self, reason: str) -> NoReturn:
        moved = self.path.with_name(f"{STATE_FILE}.corrupt-{int(time.time())}")
        os.replace(self.path, moved)
        raise CorruptState(self.path, moved, reason) from None

    def read(self) -> StateDoc:
        with self._locked():
            return self._read_unlocked()

    def update(self, change: Callable[[StateDoc], None]) -> StateDoc:
        """Apply CHANGE to the state under the lock and write it atomically; return the new state.

        A corrupt file is moved aside first (CorruptState is raised after the write, so the
        caller can log it)."""
        corrupt: CorruptState | None = None
        with self._locked():
            try:
                data = self._read_unlocked()
            except CorruptState as e:
                corrupt, data = e, _empty()
            _adopt_boot(data, boot_id())
            change(data)
            atomic_write_json(self.path, data)
        if corrupt is not None:
            raise corrupt
        return data


def view(data: StateDoc, at: Now, this_boot: str | None = None) -> PersistentView:
    """The core's view: every time on the monotonic clock of AT."""
    same_boot = data.get("boot_id") == (boot_id() if this_boot is None else this_boot) and data.get("boot_id")

    def mono(st: Stamp) -> float:
        m, wall = st.get("mono"), st.get("wall") or 0.0
        if same_boot and m is not None:
            return m
        return at.mono_of(wall)

    def until(st: Stamp | None) -> float | None:
        if st is None:
            return None
        m = st.get("mono")
        if same_boot and m is not None:
            return m
        return at.mono - (at.wall - (st.get("wall") or 0.0))  # an end may lie ahead

    return PersistentView(
        restarts={k: tuple(sorted(mono(st) for st in v)) for k, v in data["restarts"].items()},
        pauses={
            k: Pause(until(p["until"]), p.get("reason", "operator"), mono(p["since"]) if "since" in p else None)
            for k, p in data["pauses"].items()
        },
        resumed_at={k: mono(st) for k, st in data["resumed_at"].items()},
        requests=tuple(
            sorted(
                (
                    RestartRequest(
                        rid,
                        q["replica"],
                        mono(q["at"]),
                        until(q.get("wait_until")),
                        until(q.get("expires")),
                        (q["asker"]["pid"], q["asker"]["start"]) if same_boot and "asker" in q else None,
                        no_drain=q.get("no_drain", False),
                    )
                    for rid, q in data["requests"].items()
                ),
                key=lambda q: (q.at, q.id),
            )
        ),
        proxy_down=tuple(data["proxy_down"]),
        canary_latencies={k: tuple(v) for k, v in data["canary_latencies"].items()},
        step_seconds={k: tuple((e["s"], mono(e["at"])) for e in v) for k, v in data["step_seconds"].items()},
        fraction_bases=dict(data["fraction_bases"]),
    )


def record_restart(data: StateDoc, replica: str, at: Now, keep_s: float) -> None:
    times = [st for st in data["restarts"].get(replica, []) if (st.get("wall") or 0.0) > at.wall - keep_s]
    data["restarts"][replica] = [*times, stamp(at)]


def record_canary_latencies(data: StateDoc, latencies: tuple[tuple[str, tuple[float, ...]], ...]) -> None:
    """Keep each replica's canary latencies (newest last), the newest CANARY_LATENCIES_KEPT, each
    brought within (0, MAX_LATENCY_S] so that the file reads back (a canary_timeout_s may be longer)."""
    for name, values in latencies:
        kept = [min(max(x, 1e-6), MAX_LATENCY_S) for x in values if math.isfinite(x)]
        data["canary_latencies"][name] = kept[-CANARY_LATENCIES_KEPT:]


def record_steps(data: StateDoc, steps: tuple[tuple[str, tuple[tuple[float, float], ...]], ...], at: Now) -> None:
    """Keep each replica's longest steps (longest first): (seconds within (0, MAX_STEP_S], when
    learned on AT's monotonic clock), the time stamped on both clocks so that it reads back after a
    reboot too."""
    for name, values in steps:
        data["step_seconds"][name] = [
            {"s": min(max(s, 1e-6), MAX_STEP_S), "at": stamp(Now(learned, at.wall - (at.mono - learned)))}
            for s, learned in values
            if math.isfinite(s) and math.isfinite(learned)
        ][:STEPS_KEPT]


def record_fraction_base(data: StateDoc, replica: str, lowered_from: float) -> None:
    """A lowering of REPLICA from LOWERED_FROM: its base is the highest fraction guardian lowered it
    from (the first lowering's, unless the operator raised it above that since)."""
    lowered_from = min(max(lowered_from, MIN_FRACTION), 1.0)  # so that the file reads back
    data["fraction_bases"][replica] = max(data["fraction_bases"].get(replica, 0.0), lowered_from)


def record_answer(data: StateDoc, answer: AnswerRequest, at: Now) -> None:
    """Move a request to the answers (and forget answers nobody fetched for ANSWERS_KEPT_S)."""
    data["requests"].pop(answer.request_id, None)
    data["answers"] = {
        k: a for k, a in data["answers"].items() if (a["at"].get("wall") or 0.0) > at.wall - ANSWERS_KEPT_S
    }
    data["answers"][answer.request_id] = {
        "replica": answer.replica,
        "ok": answer.ok,
        "message": _clip(answer.message),
        "at": stamp(at),
        "waited_out": answer.waited_out,
    }


def record_waiting(data: StateDoc, request_id: str, text: str) -> None:
    """What an open request waits for now (A4), for the command that waits for its answer; a request
    withdrawn meanwhile is not brought back."""
    request = data["requests"].get(request_id)
    if request is not None:
        request["waiting"] = _clip(text)


class StateCache:
    """The persistent state as the daemon last read it; read again only when the file changed
    (the CLI writes pauses, resumes and restart requests). Problems come back as text to log."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.data: StateDoc = _empty()
        self._view: PersistentView | None = None
        self._seen: tuple[int, ...] | None = None  # the file as stat'ed just before it was last read
        self._loaded = False

    def _stat(self) -> tuple[int, ...] | None:
        """What tells one version of the file from the next: a write replaces it (a new inode),
        and the size and times change too (an inode number can be reused at once)."""
        try:
            st = self.store.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def load(self, force: bool = False) -> list[str]:
        # Stat'ed before the read, and that is what is kept: a CLI's write between the read and a
        # later stat would otherwise look already read, and its request wait for some other write.
        seen = self._stat()
        if not force and self._loaded and seen == self._seen:
            return []
        problems: list[str] = []
        try:
            self.data = self.store.read()
        except CorruptState as e:
            problems.append(str(e))
            try:
                self.data = self.store.update(lambda d: None)
            except OSError as e2:
                problems.append(f"cannot write state in {self.store.dir}: {e2}; going on from defaults")
                self.data, seen = _empty(), None
        except OSError as e:
            problems.append(f"cannot read state in {self.store.dir}: {e}; keeping what was loaded")
            if isinstance(e, StateLocked):
                seen = None  # not read: read again at the next tick (a lock held is not a file said once)
        self._loaded = True
        self._seen = seen
        self._view = None
        return problems

    def reset(self, cfg: Config) -> list[str]:
        """At start and on reload: the state file in CFG's state_dir, where replicas no longer
        configured leave no history behind, read afresh (nothing loaded before is kept)."""
        self.store, self.data, self._view, self._loaded = StateStore(cfg.state_dir), _empty(), None, False
        replicas = {r.name for r in cfg.replicas}
        problems = []
        try:
            self.store.update(lambda d: forget_unconfigured(d, replicas))
        except CorruptState as e:
            problems.append(str(e))
        except OSError as e:
            problems.append(f"cannot update state in {self.store.dir}: {e}")
        return problems + self.load(force=True)

    def view(self, at: Now) -> PersistentView:
        """Converted once per load: monotonic times do not move, and wall times only map anew
        after a reload of the file."""
        if self._view is None:
            self._view = view(self.data, at)
        return self._view
