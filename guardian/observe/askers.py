"""Whether the command that asked for a restart still runs (issue 34 row 12).

`guardian restart NAME` records its pid and its start time (clock ticks after boot, field 22 of
/proc/PID/stat) with its request, and withdraws the request itself when it stops waiting, is
interrupted, or gets SIGTERM or SIGHUP. One killed with SIGKILL (or a lost machine) cannot: its
request would be acted on whenever the daemon next runs. A pid that is gone, or now names a
process that started at another time (reused), is a command that is gone.
"""

from __future__ import annotations

from dataclasses import replace

from ..core.observations import PersistentView

PROC = "/proc"


def start_ticks(pid: int, proc: str = PROC) -> int | None:
    """PID's start, in clock ticks after boot; None: no such process (or unreadable)."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            text = f.read(4096)
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces and parentheses itself.
    fields = text[text.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 of stat, the 20th after the name and the state
    except (IndexError, ValueError):
        return None


def askers_checked(view: PersistentView, proc: str = PROC) -> PersistentView:
    """VIEW with each request's asker_gone: its recorded command no longer runs."""
    if not any(q.asker is not None for q in view.requests):
        return view
    requests = tuple(
        q if q.asker is None else replace(q, asker_gone=start_ticks(q.asker[0], proc) != q.asker[1])
        for q in view.requests
    )
    return replace(view, requests=requests)
