"""Freeze ONE thread of another process and hold it frozen until this process is told to let go.

    python3 ptrace_hold.py TID

PTRACE_SEIZE then PTRACE_INTERRUPT on TID: the kernel stops that thread alone (a ptrace "event stop";
no group stop, the process's other threads run on), where SIGSTOP would stop every thread of the
process. Used by tests/llamacpp.py to freeze llama-server's main thread (its task loop) while its
HTTP threads keep answering /health.

While held, /proc/TID/stat shows state `t` (tracing stop); this script prints `frozen TID` on stdout
once the stop is confirmed (waitpid), then waits. A signal meant for the frozen thread stops it again
(a signal-delivery stop, reported here): the signal is kept and handed back on release, so that a
SIGTERM sent while frozen is not lost.

Release: SIGTERM or SIGINT (`systemctl stop` of the transient unit this runs in): PTRACE_DETACH, with
the signal kept if any, then exit 0. SIGKILL also releases (the kernel detaches a dead tracer's
tracees and restarts them) but drops a kept signal. If the thread exits meanwhile, this exits too.

Standard library only: it runs under the test box's own python3 (Debian 12), as root.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import sys

PTRACE_DETACH = 17
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_LISTEN = 0x4208
PTRACE_EVENT_STOP = 128
WALL = 0x40000000  # __WALL: wait for a thread (not only a child process)

libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]


def ptrace(req: int, tid: int, data: int = 0) -> None:
    if libc.ptrace(req, tid, None, ctypes.c_void_p(data)) == -1:
        e = ctypes.get_errno()
        raise OSError(e, f"ptrace({req:#x}, {tid}): {os.strerror(e)}")


def main() -> int:
    tid = int(sys.argv[1])
    kept = 0  # a signal that arrived for the frozen thread, handed back on release
    releasing = False

    def release(signum: int, frame: object) -> None:
        nonlocal releasing
        releasing = True
        try:
            ptrace(PTRACE_DETACH, tid, kept)
        except OSError as e:  # it exited meanwhile (ESRCH): nothing left to release
            if e.errno != errno.ESRCH:
                raise
        print(f"released {tid}" + (f" (handed back signal {kept})" if kept else ""), flush=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, release)
    signal.signal(signal.SIGINT, release)
    ptrace(PTRACE_SEIZE, tid)
    ptrace(PTRACE_INTERRUPT, tid)
    announced = False
    while not releasing:
        try:
            _, status = os.waitpid(tid, WALL)
        except InterruptedError:
            continue
        except ChildProcessError:
            print(f"thread {tid} is gone", flush=True)
            return 0
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            print(f"thread {tid} exited", flush=True)
            return 0
        if not os.WIFSTOPPED(status):
            continue
        sig, event = os.WSTOPSIG(status), status >> 16
        if event == PTRACE_EVENT_STOP:
            if sig in (signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU):
                # a group stop (someone SIGSTOPped the whole process): PTRACE_LISTEN lets it end with
                # SIGCONT as it would untraced, the thread staying stopped meanwhile
                ptrace(PTRACE_LISTEN, tid)
            elif not announced:  # the PTRACE_INTERRUPT stop: the thread is frozen
                announced = True
                print(f"frozen {tid}", flush=True)
            continue
        # a signal-delivery stop: keep the signal (handed back on release); the thread stays stopped
        kept = sig
        print(f"kept signal {sig} for {tid}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
