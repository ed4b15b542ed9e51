"""Files guardian writes: persistent state (StateDirectory) and runtime status (RuntimeDirectory).

Every write is atomic: a temporary file in the same directory, fsync, rename over the old one,
fsync of the directory. A reader sees the old file or the new one, never half of one.
Read-modify-write of the persistent state holds an flock, because ``guardian pause`` and
``guardian restart`` (other processes) change it too.

``guardian restart NAME`` records a request under "requests" while the daemon runs; the daemon
acts on it on its next tick (core/tick.py) and moves it to "answers" with the outcome, which the
command waits for and prints.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..core.observations import Pause, PersistentView, RestartRequest

STATE_FILE = "state.json"
STATUS_FILE = "status.json"
STATE_VERSION = 1
ANSWERS_KEPT_S = 600.0  # an answer nobody fetched is dropped after this


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
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


class CorruptState(Exception):
    def __init__(self, path: Path, moved_to: Path, reason: str) -> None:
        super().__init__(f"state file {path} was corrupt ({reason}); moved aside to {moved_to}, starting from defaults")
        self.moved_to = moved_to


State = dict[str, Any]


def _empty() -> State:
    return {"version": STATE_VERSION, "restarts": {}, "pauses": {}, "resumed_at": {}, "requests": {}, "answers": {}}


def _time(value: Any, now: float) -> float:
    """A persisted wall-clock time: a finite number (not a string, not a bool), clamped to NOW so
    that a time in the future (a clock stepped back) cannot hold a window open."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{value!r} is not a finite time")
    return min(float(value), now)


def _text(value: Any, limit: int = 4096) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise ValueError("a text field is not a string or is too long")
    return value


def _table(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError("a section is not a JSON object")
    return value


def _validate(data: Any, now: float) -> State:
    """Typed validation: anything of the wrong type, or not finite, makes the file corrupt."""
    if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
        raise ValueError("not a guardian state file of version 1")
    out = _empty()
    for name, times in _table(data.get("restarts", {})).items():
        if not isinstance(times, list):
            raise ValueError(f"restarts of {name!r} is not a list")
        out["restarts"][name] = sorted(_time(t, now) for t in times)
    for name, p in _table(data.get("pauses", {})).items():
        until = _table(p).get("until")
        if until is not None and (
            isinstance(until, bool) or not isinstance(until, int | float) or not math.isfinite(until)
        ):
            raise ValueError(f"pause of {name!r} ends at {until!r}")
        out["pauses"][name] = {
            "until": None if until is None else float(until),
            "reason": _text(p.get("reason", "operator")),
        }
    for name, t in _table(data.get("resumed_at", {})).items():
        out["resumed_at"][name] = _time(t, now)
    for rid, q in _table(data.get("requests", {})).items():
        out["requests"][rid] = {"replica": _text(_table(q)["replica"]), "at": _time(q["at"], now)}
    for rid, a in _table(data.get("answers", {})).items():
        a = _table(a)
        if not isinstance(a["ok"], bool):
            raise ValueError("an answer's ok is not true or false")
        out["answers"][rid] = {
            "replica": _text(a["replica"]),
            "ok": a["ok"],
            "message": _text(a["message"]),
            "at": _time(a["at"], now),
        }
    for k, v in data.items():
        if k not in out:
            out[k] = v  # sections owned by later features are kept as they are
    return out


def forget_unconfigured(data: State, replicas: set[str]) -> None:
    """Drop the history and pauses of replicas that are no longer in the config."""
    for section in ("restarts", "pauses", "resumed_at"):
        data[section] = {k: v for k, v in data[section].items() if k in replicas}


class StateStore:
    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir
        self.path = state_dir / STATE_FILE
        self.lock_path = state_dir / ".state.lock"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.dir.mkdir(parents=True, exist_ok=True)
        # Read-only is enough for flock, and works whichever user (root's CLI, the daemon's
        # own user) created the lock file.
        fd = os.open(self.lock_path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _read_unlocked(self) -> State:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return _empty()
        try:
            return _validate(json.loads(raw), time.time())
        except (ValueError, TypeError, AttributeError, KeyError, RecursionError) as e:
            moved = self.path.with_name(f"{STATE_FILE}.corrupt-{int(time.time())}")
            os.replace(self.path, moved)
            raise CorruptState(self.path, moved, str(e) or type(e).__name__) from None

    def read(self) -> State:
        with self._locked():
            return self._read_unlocked()

    def update(self, change: Callable[[State], None]) -> State:
        """Apply CHANGE to the state under the lock and write it atomically; return the new state.

        A corrupt file is moved aside first (CorruptState is raised after the write, so the
        caller can log it)."""
        corrupt: CorruptState | None = None
        with self._locked():
            try:
                data = self._read_unlocked()
            except CorruptState as e:
                corrupt, data = e, _empty()
            change(data)
            atomic_write_json(self.path, data)
        if corrupt is not None:
            raise corrupt
        return data


def view(data: State) -> PersistentView:
    return PersistentView(
        restarts={k: tuple(v) for k, v in data["restarts"].items()},
        pauses={k: Pause(p["until"], p.get("reason", "operator")) for k, p in data["pauses"].items()},
        resumed_at=dict(data["resumed_at"]),
        requests=tuple(
            sorted(
                (RestartRequest(rid, q["replica"], q["at"]) for rid, q in data["requests"].items()),
                key=lambda q: (q.at, q.id),
            )
        ),
    )


def record_restart(data: State, replica: str, at: float, keep_s: float) -> None:
    times = [t for t in data["restarts"].get(replica, []) if t > at - keep_s]
    data["restarts"][replica] = [*times, at]


def record_answer(data: State, request_id: str, replica: str, ok: bool, message: str, at: float) -> None:
    """Move a request to the answers (and forget answers nobody fetched for ANSWERS_KEPT_S)."""
    data["requests"].pop(request_id, None)
    data["answers"] = {k: a for k, a in data["answers"].items() if a["at"] > at - ANSWERS_KEPT_S}
    data["answers"][request_id] = {"replica": replica, "ok": ok, "message": message, "at": at}


class StateCache:
    """The persistent state as the daemon last read it; read again only when the file changed
    (the CLI writes pauses, resumes and restart requests). Problems come back as text to log."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.data: State = _empty()
        self._view = view(self.data)
        self._mtime: float | None = None
        self._loaded = False

    def _stat(self) -> float | None:
        try:
            return self.store.path.stat().st_mtime_ns / 1e9
        except FileNotFoundError:
            return None

    def load(self, force: bool = False) -> list[str]:
        mtime = self._stat()
        if not force and self._loaded and mtime == self._mtime:
            return []
        problems: list[str] = []
        try:
            self.data = self.store.read()
        except CorruptState as e:
            problems.append(str(e))
            self.data = self.store.update(lambda d: None)
        except OSError as e:
            problems.append(f"cannot read state in {self.store.dir}: {e}; keeping what was loaded")
        self._loaded = True
        self._mtime = self._stat()
        self._view = view(self.data)
        return problems

    def view(self) -> PersistentView:
        return self._view
