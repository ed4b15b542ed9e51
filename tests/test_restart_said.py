"""A restart is said once it has passed the re-check right before acting (issue 34 row 14): the core's
warning line ("...; restarting vllm-a.service, ... (restart 1 of 3 in 1800 s)") is written by the restart
itself once the unit gates pass on a fresh look, so that a restart refused there is said only as
refused, and never counted in the journal as taken. The real tick decides; the executor performs
with a journal that keeps its lines, and a systemd whose restart job is done at once."""

from __future__ import annotations

import asyncio

import pytest

import guardian.act.restart as restart_module
from guardian.act.executor import Executor
from guardian.act.restart import Tools
from guardian.act.state import StateStore
from guardian.core.actions import LogLine, RestartUnit
from guardian.core.observations import PersistentView
from guardian.core.rules import Refusal
from guardian.core.vocab import Decision, Gate
from guardian.observe.clock import Now
from harness import Box, JobDone, Recorder, cfg, request, unit

NOW = Now(mono=5000.0, wall=1_700_000_000.0)


def operator_restart_actions() -> list:
    box = Box(cfg(2))
    box.tick(100.0)
    box.persistent = PersistentView(requests=(request(at=101.0),))
    return box.tick(102.0)


@pytest.mark.parametrize("refused", [False, True])
def test_the_restart_line_is_written_only_once_the_recheck_passes(tmp_path, monkeypatch, refused):
    actions = operator_restart_actions()
    (restart,) = [a for a in actions if isinstance(a, RestartUnit)]
    said = restart.said  # the core's line travels with the restart, not beside it
    assert said is not None and said.decision is Decision.RESTART and said.replica == "a"
    assert "restarting vllm-a.service, its processes killed if the stop takes over 30 s (restart 1 of" in said.message
    assert not [a for a in actions if isinstance(a, LogLine) and a.decision is Decision.RESTART]

    async def fresh_look(sd, r, containers, allow_failed):
        gate = Refusal(Gate.PORT_OWNER, "G7", "port 8001 is held by squat.service") if refused else None
        return unit("vllm-a.service"), gate

    monkeypatch.setattr(restart_module, "_fresh_look", fresh_look)
    journal, sd = Recorder(), JobDone()
    config = cfg(2).model_copy(update={"state_dir": tmp_path})
    ex = Executor(Tools(sd, StateStore(tmp_path, clock=lambda: NOW), journal, config, lambda: NOW), None)

    async def perform() -> None:
        ex.perform(actions, {}, NOW)
        await asyncio.gather(*ex.tasks)

    asyncio.run(perform())
    lines = [line for line, _extra in journal.lines if line.replica == "a"]
    decisions = [line.decision for line in lines]
    if refused:
        assert Decision.RESTART not in decisions, [line.message for line in lines]
        (no,) = [line for line in lines if line.decision is Decision.REFUSED]
        assert no.rule == "G7" and "refused on the re-check right before acting" in no.message
        assert "it was for " in no.message  # the evidence it was asked on
        assert sd.restarted == []
    else:
        assert said in lines
        assert decisions.index(Decision.RESTART) < decisions.index(Decision.RESTARTED)
        assert sd.restarted == ["vllm-a.service"]
