"""One dispatcher (issue 32 item 5): every type of the Action union (core/actions.py) has its handler
in the executor's exhaustive match, and what is not an Action is an error there, never dropped. A
`guardian restart` that decides alone (no daemon running) hands its request's actions to that same
executor instead of a dispatch of its own: each action type is sorted (taken, or the daemon's work)
by an exhaustive match too, its restart is the executor's, and its answers are printed, not written
to the state file. No systemd: a restart job is done at once, and the re-check is patched."""

from __future__ import annotations

import asyncio
import typing

import pytest

import guardian.act.restart as restart_module
from guardian.act.executor import Executor
from guardian.act.restart import Tools
from guardian.act.state import StateStore
from guardian.cli.common import Exit
from guardian.cli.requests import REQUEST_ID, Alone, taken_alone
from guardian.core.actions import (
    AcquireSlot,
    Action,
    AnswerRequest,
    DrainReplica,
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
from guardian.core.observations import PersistentView
from guardian.core.vocab import Decision, Priority, RestartKind
from guardian.observe.clock import Now
from harness import Box, JobDone, Recorder, cfg, request, unit, with_proxy

NOW = Now(mono=5000.0, wall=1_700_000_000.0)

# One of each Action type, about replica "a" and request REQUEST_ID: for a config without "a", the
# executor's tasks find no replica, say so, answer the request refused, and end at once.
EXAMPLES: tuple[Action, ...] = (
    LogLine(Priority.WARNING, "replica a: refused", Decision.REFUSED, "a", "vllm-a.service"),
    RestartUnit("a", "vllm-a.service", RestartKind.OPERATOR, "requested by an operator", REQUEST_ID),
    StartCanary("a", 15.0, 100.0),
    WarmUp("a", 100.0, 30.0),
    RecordCanaryLatencies((("a", (0.5,)),)),
    SetFraction("a", "vllm-a.service", 0.8, 0.7, True, "squeezed"),
    AnswerRequest(REQUEST_ID, "a", False, "refused (masked): x"),
    RequestWaits(REQUEST_ID, "a", "b is starting (A3)"),
    AcquireSlot("a", "m"),
    ReleaseSlot("a"),
    SyncProxy(frozenset({"a"})),
)


class Spy:
    """Every part the executor hands work to, and its asker: what each was handed, in order."""

    def __init__(self) -> None:
        self.got: list[object] = []

    def sync(self, down: frozenset[str]) -> None:
        self.got.append(SyncProxy(down))

    def acquire_slot(self, action: AcquireSlot) -> None:
        self.got.append(action)

    def release_slot(self, action: ReleaseSlot) -> None:
        self.got.append(action)

    def answer(self, answer: AnswerRequest) -> None:
        self.got.append(answer)

    def waits(self, action: RequestWaits) -> None:
        self.got.append(action)

    def count(self, action: Action, tracks, at) -> None:
        self.got.append(("counted", action))


def test_there_is_an_example_of_every_action_type():
    """A new Action type fails here until it has an example, and so goes through the tests below."""
    assert {type(a) for a in EXAMPLES} == set(typing.get_args(Action))


def test_the_executor_has_a_handler_for_every_action_type(tmp_path):
    """Its match ends in assert_never: an Action type without a case raises, and fails this test."""
    journal, parts, asker = Recorder(), Spy(), Spy()
    store = StateStore(tmp_path, clock=lambda: NOW)
    tools = Tools(None, store, journal, cfg(0).model_copy(update={"state_dir": tmp_path}), lambda: NOW)
    ex = Executor(tools, None, proxy=parts, slots=parts, counter=parts, asker=asker)

    async def perform() -> int:
        ex.perform(EXAMPLES, {}, NOW)
        return await ex.stop(10.0)

    assert asyncio.run(perform()) == 0
    said = [line for line, _extra in journal.lines]
    assert said[0] == EXAMPLES[0]
    # the four tasks for a replica no longer configured: each said at error, none dropped silently
    dropped = sorted(line.message.split(" not performed")[0] for line in said[1:])
    assert dropped == ["a canary", "a change of fraction (0.8 -> 0.7)", "a restart (operator)", "a warm-up"]
    assert all(line.priority is Priority.ERROR and "no longer in the config" in line.message for line in said[1:])
    # the answer and the wait told to the asker, and the operator's request in the restart answered, refused
    assert asker.got[:2] == [EXAMPLES[6], EXAMPLES[7]]
    (refused,) = asker.got[2:]
    assert refused.request_id == REQUEST_ID and not refused.ok and "no longer in the config" in refused.message
    assert parts.got[:3] == [EXAMPLES[8], EXAMPLES[9], EXAMPLES[10]]  # the slots, then the proxy
    assert parts.got[3:] == [("counted", a) for a in EXAMPLES]
    assert store.read()["canary_latencies"]["a"] == [0.5]  # RecordCanaryLatencies: written


def test_what_is_not_an_action_is_an_error_not_dropped(tmp_path):
    """DrainReplica never leaves the core (core/tick.py consumes it): handed to the executor or the
    one-shot path, it is an error, not silently dropped."""
    tools = Tools(None, StateStore(tmp_path, clock=lambda: NOW), Recorder(), cfg(0), lambda: NOW)
    drain = DrainReplica("a", "squeezed")
    with pytest.raises(AssertionError):
        Executor(tools, None).perform([drain], {}, NOW)  # type: ignore[list-item]
    with pytest.raises(AssertionError):
        taken_alone(drain, "a")  # type: ignore[arg-type]


def test_the_one_shot_path_sorts_every_action_type():
    """Its request's own actions, and the proxy's and fleet's (no-ops without those parts), go to the
    executor; the watchdog's own work stays the daemon's."""
    taken = {type(a) for a in EXAMPLES if taken_alone(a, "a")}
    assert taken == {LogLine, RestartUnit, AnswerRequest, RequestWaits, AcquireSlot, ReleaseSlot, SyncProxy}
    assert set(typing.get_args(Action)) - taken == {StartCanary, WarmUp, RecordCanaryLatencies, SetFraction}
    # another replica's lines, a restart the watchdog decided by itself, another request: the daemon's
    assert not taken_alone(EXAMPLES[0], "b")
    assert not taken_alone(LogLine(Priority.INFO, "replica a: healthy", Decision.STATE, "a"), "a")
    assert not taken_alone(RestartUnit("b", "vllm-b.service", RestartKind.HANG, "hung"), "a")
    assert not taken_alone(AnswerRequest("r1", "a", True, "ok"), "a")


def alone_of(tmp_path, config) -> tuple[Alone, Recorder, JobDone]:
    journal, sd = Recorder(), JobDone()
    tools = Tools(sd, StateStore(tmp_path, clock=lambda: NOW), journal, config, lambda: NOW)
    return Alone(tools, None, "a"), journal, sd


def test_a_restart_decided_alone_goes_through_the_executor(tmp_path, monkeypatch, capsys):
    """The one-shot path's first tick behind a proxy (no proxy report: it restarts at once) decides
    canaries and state lines for every replica, the request's restart and a SyncProxy: each action
    it takes reaches the executor's dispatch, the rest none, and the restart is the executor's."""
    config = with_proxy(cfg(2)).model_copy(update={"state_dir": tmp_path})
    box = Box(config, PersistentView(requests=(request(REQUEST_ID, at=99.0),)), proxy_reports=False)
    actions = box.tick(100.0)
    assert {type(a) for a in actions} == {LogLine, StartCanary, RestartUnit, SyncProxy}

    async def fresh_look(sd, r, containers, allow_failed):
        return unit("vllm-a.service"), None

    monkeypatch.setattr(restart_module, "_fresh_look", fresh_look)
    dispatched: list[Action] = []
    dispatch = Executor._dispatch
    monkeypatch.setattr(Executor, "_dispatch", lambda self, a: (dispatched.append(a), dispatch(self, a))[1])
    alone, journal, sd = alone_of(tmp_path, config)
    assert asyncio.run(alone.act(actions, box.tracks, NOW)) == Exit.OK
    assert dispatched == [a for a in actions if taken_alone(a, "a")]
    assert {type(a) for a in dispatched} == {RestartUnit, SyncProxy}  # the canaries and state lines: not
    assert sd.restarted == ["vllm-a.service"]
    captured = capsys.readouterr()
    out = captured.out
    assert out.startswith("vllm-a.service: ") and "done" in out
    # what it decided and leaves to the daemon is said, not dropped
    assert "not done by this command, the daemon's work when it runs: 2 canaries (a, b)" in captured.err
    (restart,) = [a for a in actions if isinstance(a, RestartUnit)]
    assert restart.said in [line for line, _extra in journal.lines]  # said by the restart, as the daemon's
    assert alone.executor.tools.store.read()["answers"] == {}  # answered here, not in the state file


def test_deciding_alone_prints_what_it_waits_for_and_its_answer(tmp_path, capsys):
    alone, _journal, _sd = alone_of(tmp_path, cfg(2).model_copy(update={"state_dir": tmp_path}))

    def act(*actions: Action) -> int | None:
        return asyncio.run(alone.act(list(actions), {}, NOW))

    assert act(RequestWaits(REQUEST_ID, "a", "b is starting (A3)")) is None
    assert capsys.readouterr().out == "waiting: b is starting (A3)\n"
    assert act(AnswerRequest(REQUEST_ID, "a", False, "refused (one-at-a-time): b; after waiting", True)) == 4
    assert capsys.readouterr().err == "refused (one-at-a-time): b; after waiting\n"
    assert act(AnswerRequest(REQUEST_ID, "a", False, "refused (masked): x")) == Exit.PROBLEM
    assert act(AnswerRequest(REQUEST_ID, "a", True, "DRY-RUN: would restart vllm-a.service")) == Exit.OK
    assert capsys.readouterr().out == "DRY-RUN: would restart vllm-a.service\n"
    data = alone.executor.tools.store.read()
    assert data["answers"] == {} and data["requests"] == {}
