"""`guardian pause`, `resume` and `restart`: what an operator asks of guardian, kept in the state
file. A restart is asked of the running daemon, whose answer the command waits for; with no
daemon running, the command puts the request through the tick itself, and the request's actions
through the executor, as the daemon would (Alone: the one-shot path)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, assert_never

import httpx

from ..act.executor import Executor
from ..act.journal import Journal
from ..act.restart import Tools
from ..act.state import STATUS_FILE, CorruptState, StateDoc, StateStore, stamp, view
from ..config import Config
from ..core import stopping, tick
from ..core.actions import (
    AcquireSlot,
    Action,
    AnswerRequest,
    LogLine,
    RecordCanaryLatencies,
    ReleaseSlot,
    RequestWaits,
    RestartUnit,
    SetFraction,
    StartCanary,
    SyncProxy,
    WarmUp,
)
from ..core.observations import RestartRequest, TickObservation
from ..core.vocab import Decision, Priority
from ..core.watchdog.track import Track
from ..observe import askers, clock
from ..observe.clock import Now
from ..observe.probes import make_client
from ..observe.readback import read_back
from ..observe.replicas import WorldObserver
from ..observe.systemd import Systemd, SystemdError
from .common import STATUS_MAX_BYTES, Exit, load

_REQUEST_DECISIONS = frozenset({Decision.REFUSED, Decision.RESTART, Decision.DRY_RUN, Decision.REQUEST})
REQUEST_ID = "cli"  # the one request of a `guardian restart` that decides alone


def _need_replica(cfg: Config, name: str) -> None:
    if cfg.replica(name) is None:
        known = ", ".join(r.name for r in cfg.replicas) or "none"
        raise SystemExit(f"guardian: no replica named {name!r} in the config (known: {known})")


def _update_state(cfg: Config, change: Callable[[StateDoc], None]) -> None:
    store = StateStore(cfg.state_dir)
    try:
        store.update(change)
    except CorruptState as e:  # the change was applied to fresh defaults and written
        print(f"warning: {e}", file=sys.stderr)


def _unit_of(cfg: Config, name: str) -> str:
    r = cfg.replica(name)
    return r.unit if r is not None else ""


def cmd_pause(args: argparse.Namespace) -> int:
    cfg = load(args)
    _need_replica(cfg, args.name)
    n = clock.now()
    until = stamp(clock.Now(n.mono + args.for_, n.wall + args.for_)) if args.for_ else None

    def change(d: StateDoc) -> None:
        d["pauses"][args.name] = {"until": until, "reason": "operator", "since": stamp(n)}

    _update_state(cfg, change)
    how = f"for {args.for_:g} s" if until else "until `guardian resume`"
    Journal().send(
        Priority.WARNING,
        f"replica {args.name}: paused by an operator {how}",
        Decision.REQUEST,
        args.name,
        _unit_of(cfg, args.name),
    )
    print(f"replica {args.name} paused {how}")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    cfg = load(args)
    _need_replica(cfg, args.name)

    def change(d: StateDoc) -> None:
        d["pauses"].pop(args.name, None)
        d["resumed_at"][args.name] = stamp(clock.now())

    _update_state(cfg, change)
    Journal().send(
        Priority.WARNING,
        f"replica {args.name}: resumed by an operator (restart budget starts afresh)",
        Decision.REQUEST,
        args.name,
        _unit_of(cfg, args.name),
    )
    print(f"replica {args.name} resumed")
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    cfg = load(args)
    _need_replica(cfg, args.name)
    pid = _running_daemon(cfg)
    if pid is not None:
        return _ask_daemon_to_restart(cfg, args.name, pid, args.wait, args.no_drain)
    return asyncio.run(_restart_without_daemon(cfg, args.name, args.wait))


def _running_daemon(cfg: Config) -> int | None:
    """The PID of the daemon that serves this config's state, if it runs and ticks."""
    try:
        # The bounded reader, as `status` reads it: a FIFO or a link to /dev/zero planted at the
        # name would block this command for ever, or fill its memory.
        data = json.loads(read_back(cfg.runtime_dir / STATUS_FILE, STATUS_MAX_BYTES))
        pid = int(data["pid"])
        fresh = time.time() - float(data["updated_at"]) <= max(30.0, 5 * float(data.get("interval_s", 2.0)))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not fresh:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # it runs, as another user
    return pid


def _answer_margin_s(cfg: Config, stop_bound_s: float | None = None) -> float:
    """How long an admitted restart takes to be answered at most: its job (waited for longer by as much
    as STOP_BOUND_S, the replica's planned stop bound, is past P.stop_timeout_s: core/stopping.py T1),
    ten ticks, and its drain."""
    margin_s = stopping.job_wait_s(cfg, stop_bound_s) + 10 * cfg.interval_s + 10
    if cfg.proxy.enabled:  # it drains first (README, Under a proxy)
        margin_s += cfg.proxy.drain_timeout_s + cfg.proxy.stop_timeout_s
    return margin_s


def _stop_bound_s(cfg: Config, name: str) -> float | None:
    """NAME's planned stop bound as the running daemon last said it (its status file), or None."""
    try:
        data = json.loads(read_back(cfg.runtime_dir / STATUS_FILE, STATUS_MAX_BYTES))
        return float(data["replicas"][name]["stop_bound_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _ask_daemon_to_restart(cfg: Config, name: str, pid: int, wait_s: float | None, no_drain: bool = False) -> int:
    """Record the request for the daemon, which admits it like any restart (core/tick.py), and
    wait for its answer: with WAIT_S, through refusals that pass by themselves (A4) for that long,
    then for as long as an admitted restart takes."""
    rid = uuid.uuid4().hex[:16]
    asked = clock.now()
    waits_s = (wait_s or 0.0) + _answer_margin_s(cfg, _stop_bound_s(cfg, name))
    me = askers.start_ticks(os.getpid())

    def ask(d: StateDoc) -> None:
        request: dict[str, Any] = {"replica": name, "at": stamp(asked)}
        if wait_s:  # --wait 0 is no wait: answered at once
            request["wait_until"] = stamp(clock.Now(asked.mono + wait_s, asked.wall + wait_s))
        if no_drain:
            request["no_drain"] = True
        # When this command stops waiting, and who it is: a request whose command is gone without
        # withdrawing it (SIGKILL) is withdrawn by the daemon, never acted on later (A5)
        request["expires"] = stamp(clock.Now(asked.mono + waits_s, asked.wall + waits_s))
        if me is not None:
            request["asker"] = {"pid": os.getpid(), "start": me}
        d["requests"][rid] = request

    _update_state(cfg, ask)
    what = "drain and restart" if cfg.proxy.enabled and not no_drain else "restart"
    how = f"waiting up to {wait_s:g} s through what passes by itself, then" if wait_s else "waiting"
    print(f"asked the running guardian (pid {pid}) to {what} replica {name}; {how} for its answer", flush=True)
    answer = _await_answer(cfg, rid, time.monotonic() + waits_s)
    if answer is None:
        print(
            f"guardian: no answer from the running daemon within the wait; request withdrawn "
            f"(see journalctl -u guardian GUARDIAN_REPLICA={name})",
            file=sys.stderr,
        )
        return Exit.PROBLEM
    print(answer["message"], file=sys.stdout if answer["ok"] else sys.stderr)
    return Exit.OK if answer["ok"] else Exit.WAITED_OUT if answer.get("waited_out") else Exit.PROBLEM


def _interrupt_on(*signums: signal.Signals) -> dict[signal.Signals, Any]:
    """SIGNUMS raise KeyboardInterrupt (in the main thread; a test's thread keeps them); the
    handlers they had, to put back."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.signal(signum, signal.default_int_handler) for signum in signums}


def _await_answer(cfg: Config, rid: str, deadline_mono: float) -> dict[str, Any] | None:
    """Request RID's answer, once the daemon wrote it (then forgotten); each new thing it waits for
    is printed once as it comes. None: no answer by DEADLINE_MONO (the request is withdrawn) or the
    state file was corrupt (said)."""
    store = StateStore(cfg.state_dir)
    said = None
    # A command ended by SIGTERM or SIGHUP (systemd-run, a closed terminal) withdraws its request
    # as one interrupted does; SIGKILL cannot, and the daemon sees it gone (A5)
    before = _interrupt_on(signal.SIGTERM, signal.SIGHUP)
    try:
        while time.monotonic() < deadline_mono:
            try:
                data = store.read()
            except CorruptState as e:
                print(f"guardian: {e}", file=sys.stderr)
                return None
            answer = data["answers"].get(rid)
            if answer is not None:
                _update_state(cfg, lambda d: d["answers"].pop(rid, None))
                return dict(answer)
            waiting = (data["requests"].get(rid) or {}).get("waiting")
            if waiting and waiting != said:
                print(f"waiting: {waiting}", flush=True)
                said = waiting
            time.sleep(0.2)
    except KeyboardInterrupt:  # a request left open would be acted on long after the operator gave up on it
        _update_state(cfg, lambda d: d["requests"].pop(rid, None))
        print("guardian: interrupted: request withdrawn (a restart already begun goes on)", file=sys.stderr)
        raise
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
    _update_state(cfg, lambda d: d["requests"].pop(rid, None))
    return None


async def _restart_without_daemon(cfg: Config, name: str, wait_s: float | None) -> int:
    """No daemon runs: this command observes and puts the request through the same pure tick itself,
    once, or with WAIT_S every interval_s until it is answered (A4)."""
    if cfg.fleet.enabled:
        print(
            f"guardian: not restarting {name}: with [fleet] a planned restart takes a fleet slot, which only the "
            "running daemon can hold (start guardian.service, or `systemctl restart` the unit yourself)",
            file=sys.stderr,
        )
        return Exit.PROBLEM
    sd = Systemd()
    try:
        await sd.connect()
    except SystemdError as e:
        print(f"guardian: cannot talk to systemd: {e}", file=sys.stderr)
        return Exit.PROBLEM
    if cfg.proxy.enabled:
        print(
            f"warning: guardian is not running, so {name} is restarted without being drained at the proxy",
            file=sys.stderr,
        )
    try:
        async with make_client() as client:
            return await _decide_alone(cfg, WorldObserver(sd, client), name, wait_s)
    finally:
        sd.close()


async def _decide_alone(cfg: Config, observer: WorldObserver, name: str, wait_s: float | None) -> int:
    """The request's ticks, as the daemon would run them, until it is answered or acted on."""
    store = StateStore(cfg.state_dir)
    alone = Alone(Tools(observer.sd, store, Journal(), cfg), observer.client, name)
    alone.executor.address_of = observer.addresses.address_of
    asked = clock.now()
    until = asked.mono + wait_s if wait_s is not None else None
    request = RestartRequest(REQUEST_ID, name, asked.mono, until)
    state = tick.TickState()
    while True:
        now = clock.now()
        try:
            pv = view(store.read(), now)
        except CorruptState as e:
            print(f"warning: {e}", file=sys.stderr)
            pv = view(store.update(lambda d: None), now)
        observer.invalidate()  # no daemon follows systemd's signals: every look asks afresh
        await observer.read_declared(cfg)
        await observer.pin(cfg)
        replicas = await observer.replicas(cfg, now.mono)
        now = clock.now()
        observed = TickObservation(replicas, replace(pv, requests=(request,)))
        state, actions = tick.decide(state, observed, now.mono, cfg)
        code = await alone.act(actions, state.tracks, now)
        if code is not None:
            return code
        if until is None:
            print(f"guardian: the request for {name} got no answer (a bug)", file=sys.stderr)
            return Exit.PROBLEM
        await asyncio.sleep(cfg.interval_s)


class Alone:
    """A `guardian restart NAME` that decides alone: its request's actions are performed by an
    executor as the daemon's performs them (act/executor.py, the one dispatcher), and this command
    is that executor's asker: what the request waits for is printed as it comes, and its answer
    (the core's, or its restart's once the job ended) kept for the exit status. The executor has
    no proxy, fleet or metrics part: nothing drains without the daemon (said before the first
    tick), and with [fleet] the command refuses before it ticks."""

    def __init__(self, tools: Tools, client: httpx.AsyncClient, name: str) -> None:
        self.name = name
        self.executor = Executor(tools, client, asker=self)
        self.answered: AnswerRequest | None = None

    def answer(self, answer: AnswerRequest) -> None:
        self.answered = answer

    def waits(self, action: RequestWaits) -> None:
        print(f"waiting: {action.text}", flush=True)

    async def act(self, actions: list[Action], tracks: Mapping[str, Track], at: Now) -> int | None:
        """The tick's ACTIONS that this command takes (taken_alone), performed, and a restart among
        them waited for as long as an admitted restart takes; the exit status once the request is
        answered, None while it waits."""
        taken = [a for a in actions if taken_alone(a, self.name)]
        left = left_to_daemon([a for a in actions if not taken_alone(a, self.name)])
        if left:
            print(f"guardian: not done by this command, the daemon's work when it runs: {left}", file=sys.stderr)
        self.executor.perform(taken, tracks, at)
        limit_s = _answer_margin_s(self.executor.cfg, _order_bound_s(taken))
        if await self.executor.stop(limit_s):
            print(
                f"guardian: the restart of {self.name} did not end within {limit_s:g} s; stopped waiting for it "
                "(its systemd job may still run)",
                file=sys.stderr,
            )
            return Exit.PROBLEM
        answer, self.answered = self.answered, None
        if answer is None:
            return None
        # a restart's answer is its unit's line ("vllm-a.service: done ..."): on stdout, as it always was
        restarted = any(isinstance(a, RestartUnit) for a in taken)
        print(answer.message, file=sys.stdout if answer.ok or restarted else sys.stderr)
        return Exit.OK if answer.ok else Exit.WAITED_OUT if answer.waited_out else Exit.PROBLEM


def _order_bound_s(taken: list[Action]) -> float | None:
    """The longest planned stop bound among TAKEN's restarts (core/stopping.py T1), or None."""
    bounds = [a.stop_timeout_s for a in taken if isinstance(a, RestartUnit | SetFraction) and a.stop_timeout_s]
    return max(bounds, default=None)


_KINDS: dict[type, tuple[str, str]] = {  # one, more
    RestartUnit: ("restart", "restarts"),
    SetFraction: ("change of fraction", "changes of fraction"),
    StartCanary: ("canary", "canaries"),
    WarmUp: ("warm-up", "warm-ups"),
    RecordCanaryLatencies: ("record of canary latencies", "records of canary latencies"),
}


def left_to_daemon(left: list[Action]) -> str:
    """What a one-shot `guardian restart` decided but does not perform, said (its journal lines aside):
    "1 restart (b), 2 canaries (a, b)"; "" when nothing but lines."""
    counts: dict[type, list[str]] = {}
    for a in left:
        if not isinstance(a, LogLine):
            counts.setdefault(type(a), []).append(getattr(a, "replica", ""))
    parts = []
    for kind, names in counts.items():
        one, more = _KINDS.get(kind, (kind.__name__, kind.__name__))
        who = ", ".join(sorted({n for n in names if n}))
        parts.append(f"{len(names)} {one if len(names) == 1 else more}" + (f" ({who})" if who else ""))
    return ", ".join(parts)


def taken_alone(action: Action, name: str) -> bool:
    """Whether a `guardian restart NAME` deciding alone performs ACTION, which its tick decided.

    It takes its request's own: the lines that say it, what it waits for, its answer, its restart;
    and the proxy's and the fleet's actions, which its executor, with no part for them, performs as
    no-ops. The rest is the watchdog's own work, which is the daemon's: the restarts it decides by
    itself (another replica hung), canaries, warm-ups, the memory guard's fractions, the lines of
    its verdicts; the command's one look must not restart or probe anything it was not asked to.
    Matched exhaustively: an action type not sorted here is an error (mypy, and assert_never)."""
    match action:
        case LogLine():
            return action.decision in _REQUEST_DECISIONS and action.replica == name
        case RestartUnit() | AnswerRequest() | RequestWaits():
            return action.request_id == REQUEST_ID
        case SyncProxy() | AcquireSlot() | ReleaseSlot():
            return True
        case StartCanary() | WarmUp() | RecordCanaryLatencies() | SetFraction():
            return False
        case _:
            assert_never(action)
