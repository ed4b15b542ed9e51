"""One dispatcher (issue 32 item 5): every type of the Action union (core/actions.py) has its handler
in the executor's exhaustive match, and what is not an Action is an error there, never dropped."""

from __future__ import annotations

import asyncio
import typing

import pytest

from guardian.act.executor import Executor
from guardian.act.restart import Tools
from guardian.act.state import StateStore
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
from guardian.core.vocab import Decision, Priority, RestartKind
from guardian.observe.clock import Now
from harness import Recorder, cfg

NOW = Now(mono=5000.0, wall=1_700_000_000.0)

# One of each Action type, about replica "a": for a config without "a", the
# executor's tasks find no replica and end at once.
EXAMPLES: tuple[Action, ...] = (
    LogLine(Priority.WARNING, "replica a: refused", Decision.REFUSED, "a", "vllm-a.service"),
    RestartUnit("a", "vllm-a.service", RestartKind.OPERATOR, "requested by an operator", "q1"),
    StartCanary("a", 15.0, 100.0),
    WarmUp("a", 100.0, 30.0),
    RecordCanaryLatencies((("a", (0.5,)),)),
    SetFraction("a", "vllm-a.service", 0.8, 0.7, True, "squeezed"),
    AnswerRequest("q1", "a", False, "refused (masked): x"),
    RequestWaits("q1", "a", "b is starting (A3)"),
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
    assert [line for line, _extra in journal.lines] == [EXAMPLES[0]]
    assert asker.got == [EXAMPLES[6], EXAMPLES[7]]  # the answer and the wait, told to the asker
    assert parts.got[:3] == [EXAMPLES[8], EXAMPLES[9], EXAMPLES[10]]  # the slots, then the proxy
    assert parts.got[3:] == [("counted", a) for a in EXAMPLES]
    assert store.read()["canary_latencies"]["a"] == [0.5]  # RecordCanaryLatencies: written


def test_what_is_not_an_action_is_an_error_not_dropped(tmp_path):
    """DrainReplica never leaves the core (core/tick.py consumes it): handed to the executor, it is
    an error, not silently dropped."""
    tools = Tools(None, StateStore(tmp_path, clock=lambda: NOW), Recorder(), cfg(0), lambda: NOW)
    drain = DrainReplica("a", "squeezed")
    with pytest.raises(AssertionError):
        Executor(tools, None).perform([drain], {}, NOW)  # type: ignore[list-item]
