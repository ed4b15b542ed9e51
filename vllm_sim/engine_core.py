"""The simulator's engine core process: vLLM V1's process shape, an API server (the unit's main
process) and a child ``VLLM::EngineCore`` (comm ``VLLM::EngineCor``) that runs the steps, with
``VLLM::Worker_TP<i>`` grandchildren under tensor parallelism.

Why: a replica's CPU outside its API server must be what a real engine's is. A frozen or dead
engine uses none; a working one always uses some, a long prefill too while every counter stands
still. The API server's engine thread keeps all the state (server.Engine); each step that has work
is a round trip to this process over a socketpair: the step's cost goes there, the CPU is burnt
there, the answer comes back, and the engine thread waits for it. With nothing to do nothing is
sent, and the engine core blocks in recv using no CPU, as vLLM's EngineCore blocks on its input queue.

Messages (one a packet, JSON): ``{"cpu_s": C, "over_s": W}`` a step: burn C seconds of CPU, at
once or spread over W wall seconds, then answer ``{}``; ``{"spin": F}`` (the spinning fault) burn
F of a core and answer nothing until ``{"spin": 0}``, which answers the step it held.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import select
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

SLICE_S = 0.02  # a fraction of a core is burnt in slices this long: burn, then sleep the rest
PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15
_libc = ctypes.CDLL(None, use_errno=True)


def _pair() -> tuple[socket.socket, socket.socket]:
    # SEQPACKET: each send is one message, and a closed peer reads as b"" (EOF)
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def _child(name: str, parent: int, body: Callable[[], object]) -> NoReturn:
    """Run BODY as this forked process NAME (its comm, 15 characters kept, as vLLM's setproctitle
    leaves it), which never outlives PARENT; never return into the parent's code."""
    status = 1
    try:
        _libc.prctl(PR_SET_NAME, name.encode(), 0, 0, 0)
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # no orphan, even after a SIGKILL of PARENT
        if os.getppid() != parent:  # PARENT died before the line above: no signal will come
            os._exit(0)
        # Its end is its parent's: a unit's stop sends SIGTERM to every process of the cgroup, and
        # whether the API server drains (--shutdown-timeout) or hangs (--hang-on-sigterm) is its own.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        body()
        status = 0
    except Exception:
        traceback.print_exc()  # then on to the finally: exit 1
        raise
    finally:
        os._exit(status)  # whatever happened: no atexit, no flush of buffers copied from the parent


def _recv(sock: socket.socket) -> dict:
    data = sock.recv(4096)
    if not data:  # its parent closed the socket, or is gone
        os._exit(0)
    return json.loads(data)


def _burn(cpu_s: float) -> None:
    """Use CPU_S seconds of this thread's CPU time (time stopped by SIGSTOP does not count)."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def run_step(cpu_s: float, over_s: float) -> None:
    """Burn CPU_S at once, or spread over OVER_S wall seconds in slices (a prefill's busy fraction)."""
    slices = max(1, round(over_s / SLICE_S))
    for _ in range(slices):
        began = time.monotonic()
        _burn(cpu_s / slices)
        if over_s > 0:
            time.sleep(max(0.0, over_s / slices - (time.monotonic() - began)))


def _serve(sock: socket.socket) -> None:
    """Run the steps SOCK sends, each answered once its CPU is burnt; blocked in recv between them.
    Spinning, burn that fraction of a core in slices and answer no step (a GPU engine spinning on a
    wedged kernel) until the spin ends: then the step it held completes."""
    spin, owed = 0.0, False
    while True:
        if spin:
            _burn(spin * SLICE_S)
            if not select.select([sock], [], [], (1 - spin) * SLICE_S)[0]:
                continue
        msg = _recv(sock)
        if "spin" in msg:
            spin = min(1.0, max(0.0, float(msg["spin"])))
            if not spin and owed:
                sock.send(b"{}")
                owed = False
        elif spin:
            owed = True
        else:
            run_step(float(msg["cpu_s"]), float(msg["over_s"]))
            sock.send(b"{}")


def _relay(api: socket.socket, workers: list[socket.socket]) -> None:
    """The engine core of --sim-workers N: every message goes to each worker, which burns the CPU;
    a step is answered once all of them have answered it (vLLM's executor waits for every rank)."""
    owed = 0
    while True:
        for sock in select.select([api, *workers], [], [])[0]:
            data = sock.recv(4096)
            if not data:  # the API server, or a worker, is gone
                os._exit(0)
            if sock is api:
                for w in workers:
                    w.send(data)
                owed += len(workers) if "cpu_s" in json.loads(data) else 0
            else:
                owed -= 1
                if not owed:
                    api.send(b"{}")


def _engine_core(api: socket.socket, workers: int, worker_name: str = "VLLM::Worker_TP{i}") -> None:
    pids, socks = [os.getpid()], []
    for i in range(workers):
        mine, theirs = _pair()
        pid = os.fork()
        if pid == 0:
            for s in (api, mine, *socks):
                s.close()
            _child(worker_name.format(i=i, n=i + 1), pids[0], functools.partial(_serve, theirs))
        theirs.close()
        socks.append(mine)
        pids.append(pid)
    api.send(json.dumps({"pids": pids}).encode())
    if socks:
        _relay(api, socks)
    else:
        _serve(api)


class EngineCore:
    """The API server's end of the engine core process."""

    def __init__(self, sock: socket.socket, pids: list[int]) -> None:
        self.sock = sock
        self.pids = pids  # the engine core's, then its workers'

    def step(self, cpu_s: float, over_s: float = 0.0) -> bool:
        """Run a step there and wait for its answer: for ever, from a frozen or spinning engine core.
        False: the engine core is gone."""
        try:
            self.sock.send(json.dumps({"cpu_s": cpu_s, "over_s": over_s}).encode())
            return bool(self.sock.recv(64))
        except OSError:
            return False

    def spin(self, fraction: float) -> None:
        try:
            self.sock.send(json.dumps({"spin": fraction}).encode())
        except OSError:
            pass  # gone: nothing to spin

    def kill(self, sig: int) -> None:
        """Send SIG to the engine core and its workers (SIGSTOP: what ``kill -STOP`` on them does)."""
        for pid in self.pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def watch(self, on_death: Callable[[], object]) -> None:
        """Call ON_DEATH once the engine core has died (and reap it), as vLLM's API server watches its
        EngineCore's process sentinel. It dies before its API server only when something killed it."""
        def wait() -> None:
            os.waitpid(self.pids[0], 0)
            on_death()
        threading.Thread(target=wait, daemon=True, name="EngineCoreMonitor").start()


def start(workers: int = 0, name: str = "VLLM::EngineCore", worker_name: str = "VLLM::Worker_TP{i}") -> EngineCore:
    """Fork the engine core (and its WORKERS), called NAME and WORKER_NAME ({i}: from 0, {n}: from 1;
    another engine's names, engines.py). Call it before any thread starts: fork copies only the
    calling thread, and PR_SET_PDEATHSIG fires when that thread ends."""
    api, mine = _pair()
    api_pid = os.getpid()
    pid = os.fork()
    if pid == 0:
        api.close()
        _child(name, api_pid, functools.partial(_engine_core, mine, workers, worker_name))
    mine.close()
    hello = api.recv(4096)
    if not hello:
        raise RuntimeError("the engine core process died at its start")
    return EngineCore(api, json.loads(hello)["pids"])
