"""The proxy's command hooks (P.drain_command, P.undrain_command): one bounded run of a hook,
its output kept to a tail, and its whole process tree killed when it outlives its bound (kill_tree).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass

import psutil

# A drain or undrain command's output: only its last bytes are kept (it may write without end).
OUTPUT_CHARS = 2000  # of a command's or nginx's output, in a journal line

HOOK_OUTPUT_MAX_BYTES = 4096
# How long a command's output is read on after its own process ended (or was killed): a process it
# left behind may hold the pipe for ever. Also how long a killed command is waited for.
HOOK_GRACE_S = 1.0


@dataclass(frozen=True)
class CommandRun:
    """How a hook command ended, as run_command saw it."""

    returncode: int | None  # None: its own process had not exited even after it was killed
    output: bytes  # the last HOOK_OUTPUT_MAX_BYTES of stdout and stderr
    output_bytes: int  # all it wrote, kept or not
    timed_out: bool  # still running at its limit, so it was killed with what it started
    killed: int  # how many processes it had started that were killed with it
    pipe_held: bool  # its output was still open (held by something it started) after it ended


def hook_report(program: str, run: CommandRun, timeout_s: float, took_s: float) -> tuple[bool, str]:
    """(done?, the journal's words) for one run of a drain or undrain command."""
    text = run.output.decode(errors="replace").strip()[-OUTPUT_CHARS:]
    if run.output_bytes > len(run.output):
        text = f"[last {len(run.output)} of {run.output_bytes} bytes] {text}"
    said = text or "(no output)"
    if run.timed_out:
        what = f"killed, with {run.killed} process(es) it started" if run.killed else "killed"
        if run.returncode is None:
            what += f", but its process had not exited {HOOK_GRACE_S:g} s later"
        if run.pipe_held:
            what += "; a process it started escaped the kill and still holds its output"
        return False, f"{program} did not finish within {timeout_s:g} s ({what}): {said}"
    note = (
        "; note: a process it left running still holds its output (not waited for, not killed)" if run.pipe_held else ""
    )
    if run.returncode != 0:
        return False, f"{program} exited with status {run.returncode}: {said}{note}"
    return True, f"{program} done in {took_s:.1f} s: {said}{note}"


class _Tail(asyncio.Protocol):
    """Drains a pipe, keeping only its last MAX_BYTES: a command may write without end."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.kept = bytearray()
        self.total_bytes = 0
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.total_bytes += len(data)
        self.kept += data
        del self.kept[: -self.max_bytes]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


def kill_tree(pid: int) -> int:
    """SIGKILL the process PID, leader of its own session, and everything it started; the number
    of processes it started that were signalled.

    Its descendants are listed before anything dies: one that called setsid (an ssh
    ControlPersist master) has left the process group and session, and is found only through
    its parent, which must still be alive. Members of its session whose parent already exited
    (reparented) are found by their session id. The group kill catches what forked meanwhile."""
    found: dict[int, psutil.Process] = {}
    try:
        found.update((c.pid, c) for c in psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        pass
    for proc in psutil.process_iter():
        with contextlib.suppress(OSError):
            if proc.pid != pid and os.getsid(proc.pid) == pid:
                found.setdefault(proc.pid, proc)
    killed = 0
    for proc in found.values():
        with contextlib.suppress(psutil.Error):
            proc.kill()  # psutil checks that the PID still names the process it listed
            killed += 1
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return killed


async def run_command(
    argv: list[str], env: dict[str, str], timeout_s: float, max_bytes: int = HOOK_OUTPUT_MAX_BYTES
) -> CommandRun:
    """Run ARGV in its own session with stdout and stderr on one pipe, for at most TIMEOUT_S, and
    return within about TIMEOUT_S + 2 * HOOK_GRACE_S whatever it or what it started does.

    The pipe is guardian's own, not asyncio's subprocess pipes: asyncio (3.11) wakes
    Process.wait() only once those reach EOF, and a process the command left behind (an ssh
    ControlPersist master) may hold them for ever. OSError: the command could not be started."""
    read_fd, write_fd = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=write_fd,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    loop = asyncio.get_running_loop()
    tail = _Tail(max_bytes)
    pipe = os.fdopen(read_fd, "rb", buffering=0)
    try:
        transport, _ = await loop.connect_read_pipe(lambda: tail, pipe)
    except BaseException:
        pipe.close()
        kill_tree(proc.pid)
        raise
    timed_out, killed = False, 0
    try:
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            timed_out, killed = True, kill_tree(proc.pid)
            with contextlib.suppress(TimeoutError):  # a process in uninterruptible sleep dies later
                await asyncio.wait_for(proc.wait(), HOOK_GRACE_S)
        # Whatever the command started may still hold the pipe: read on a moment, then stop.
        await asyncio.wait([tail.closed], timeout=HOOK_GRACE_S)
        pipe_held = not tail.closed.done()
    finally:
        transport.close()
        if proc.returncode is None and not timed_out:  # cancelled: leave nothing running
            kill_tree(proc.pid)
    return CommandRun(proc.returncode, bytes(tail.kept), tail.total_bytes, timed_out, killed, pipe_held)
