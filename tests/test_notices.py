"""The said-once conditions as the core decides them (core/notices.py): each transition is a pure
function of what was said and what is found, in memory; and W2 reaches decide() as an observation,
so the memory guard forgets a changed model inside the tick's judgement, not beside it."""

from __future__ import annotations

from dataclasses import replace

import pytest
from harness import Box, cfg

from guardian.config import Config
from guardian.core import notices, tick
from guardian.core.hazards import Hazard
from guardian.core.memory.memstate import MemTrack
from guardian.core.vocab import Decision, Priority
from guardian.core.weights import Weights

CFG = Config.model_validate({"replicas": [
    {"name": "a", "unit": "vllm-a.service", "url": "http://127.0.0.1:8001", "model": "m"},
    {"name": "b", "unit": "vllm-b.service", "url": "http://127.0.0.1:8002", "model": "m"},
]})
H1 = Hazard("port:8001", "two replicas on one port", "a", "vllm-a.service", rule="H9", over="port shared no more")
H2 = Hazard("conflict:x", "x.service conflicts with vllm-b.service", "b", "vllm-b.service")


def run(steps, step):
    """Each of STEPS through STEP from nothing said: the lines of each, as (priority, message)."""
    said, out = notices.Said(), []
    for found in steps:
        said, lines = step(said, found)
        out.append([(line.priority, line.message) for line in lines])
    return out


@pytest.mark.parametrize("scans, said", [
    ([[H1], [H1]], [[(Priority.ERROR, "hazard: two replicas on one port")], []]),
    ([[H1], [], [H1]], [[(Priority.ERROR, "hazard: two replicas on one port")],
                        [(Priority.INFO, "port shared no more")],
                        [(Priority.ERROR, "hazard: two replicas on one port")]]),
    ([[H2], []], [[(Priority.ERROR, "hazard: x.service conflicts with vllm-b.service")], []]),  # no `over`: unsaid
    ([[H1, H2], [H2]], [[(Priority.ERROR, "hazard: two replicas on one port"),
                         (Priority.ERROR, "hazard: x.service conflicts with vllm-b.service")],
                        [(Priority.INFO, "port shared no more")]]),
])
def test_a_hazard_is_said_when_a_scan_first_finds_it_and_its_end_once(scans, said):
    assert run(scans, lambda s, found: notices.said_hazards(s, found, None)) == said


def test_a_hazard_line_carries_its_rule_and_key_and_a_partial_scan_says_why():
    said, lines = notices.said_hazards(notices.Said(), [H1], "Access denied")
    assert [(x.decision, x.rule, x.hazard, x.replica) for x in lines] == [
        (Decision.NOTE, None, None, None), (Decision.HAZARD, "H9", "port:8001", "a")]
    assert "Access denied" in lines[0].message and lines[0].priority == Priority.ERROR
    assert set(said.hazards) == {"port:8001"}


@pytest.mark.parametrize("views, said", [
    (["no netlink", "no netlink", None, None], [[Priority.WARNING], [], [Priority.INFO], []]),
    ([None, None], [[], []]),
    (["no netlink", "EPERM", None], [[Priority.WARNING], [Priority.WARNING], [Priority.INFO]]),
])
def test_the_kernel_view_lost_and_back_is_said_once_each(views, said):
    assert [[p for p, _ in lines] for lines in run(views, notices.kernel_view)] == said


def test_a_partial_view_and_a_split_host_begin_and_end_once():
    s, lines = notices.partial_views(notices.Said(), CFG, frozenset({"a"}))
    assert [(x.priority, x.replica) for x in lines] == [(Priority.WARNING, "a")]
    s, lines = notices.partial_views(s, CFG, frozenset({"a"}))
    assert lines == []
    s, lines = notices.partial_views(s, CFG, frozenset())
    assert [(x.priority, x.replica) for x in lines] == [(Priority.INFO, "a")]
    s, lines = notices.addresses(s, CFG, {"b": "127.0.0.1 and ::1 lead to two holders"})
    assert [(x.priority, x.decision, x.hazard) for x in lines] == [(Priority.ERROR, Decision.HAZARD, "address:b")]
    s, lines = notices.addresses(s, CFG, {"b": "127.0.0.1 and ::1 lead to two holders"})
    assert lines == []
    s, lines = notices.addresses(s, CFG, {})
    assert [(x.priority, x.hazard) for x in lines] == [(Priority.INFO, "address:b")]


def test_an_engine_is_said_at_start_and_when_another_is_told():
    s, lines = notices.engines(notices.Said(), CFG, {"a": "vLLM (configured)", "b": "vLLM (configured)"})
    assert [x.message for x in lines] == ["replica a: engine vLLM (configured)", "replica b: engine vLLM (configured)"]
    s, lines = notices.engines(s, CFG, {"a": "vLLM (configured)"})  # b not told this scan: nothing to say
    assert lines == []
    s, lines = notices.engines(s, CFG, {"a": "llama.cpp (llama-server) (auto: ...)", "b": "vLLM (configured)"})
    assert [x.message for x in lines] == ["replica a: engine llama.cpp (llama-server) (auto: ...)"]


W1, W2 = Weights("dir2:1", "/models/m"), Weights("dir2:2", "/models/m")


def test_weights_w1_said_once_while_it_lasts_and_w2_names_the_replica_that_moved():
    s = notices.Said()
    read = notices.weights_read(s, CFG, {"a": W1, "b": W2})
    assert [x.rule for x in read.lines] == ["W1"] and read.moved == [] and [h.rule for h in read.hazards] == ["W1"]
    read = notices.weights_read(read.said, CFG, {"a": W1, "b": W2})
    assert read.lines == [] and [h.rule for h in read.hazards] == ["W1"]
    read = notices.weights_read(read.said, CFG, {"a": W1, "b": W1})
    assert [(x.rule, x.priority) for x in read.lines] == [("W2", Priority.INFO), (None, Priority.INFO)]
    assert read.moved == ["b"] and read.hazards == []


@pytest.mark.parametrize("moved, kept", [((), {"a": 0.86, "b": 0.9}), (("a",), {"b": 0.9}), (("a", "b"), {})])
def test_decide_forgets_what_it_learned_of_weights_that_changed(moved, kept):
    box = Box(cfg(2))
    box.tick(100.0)
    box.core = replace(box.core, mem=MemTrack(ceilings={"a": 0.86, "b": 0.9}))
    seen = replace(box.observation, weights_moved=moved)
    box.core, _ = tick.decide(box.core, seen, 101.0, box.cfg)
    assert dict(box.core.mem.ceilings) == kept
