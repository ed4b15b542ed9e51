"""Every rule is a row (issue 45): its id, its text and the condition the code decides by sit in one
Row, and the code asks that row. Here: each rule of every table is a row's; the texts of G5 and
L5 name the states their checks let through; and the rules that were once tied to their code by a
comment only (M1, M2, M9, M20, S1, B3, D12) decide what the code does, with their ids."""

from __future__ import annotations

import importlib
import re
from dataclasses import replace
from types import ModuleType, SimpleNamespace

import pytest
from harness import RULE_TABLES, GiB, cfg, lowerings, rule_modules, rules, run_memguard
from harness import memory_cfg, rep, view

from guardian.core import gates
from guardian.core.memory import memrestore
from guardian.core.memory.memsqueeze import CRITICAL_ROW, OVERRIDDEN_ROW, SQUEEZED_ROW, Clocks, Served
from guardian.core.proxy import bypass, drain
from guardian.core.proxy.drainstate import Drain, Phase
from guardian.core.rules import Row, Rule, first_match
from guardian.core.vocab import ActiveState, MemVerdict
from guardian.core.watchdog import liveness

# --- every rule of a table is a row ------------------------------------------------------------


def _rows_of(module: ModuleType) -> list[Row]:
    """The rows MODULE holds at its top level: alone, or in a tuple of rows."""
    found: list[Row] = []
    for value in vars(module).values():
        if isinstance(value, Row):
            found.append(value)
        elif isinstance(value, tuple) and value and all(isinstance(v, Row) for v in value):
            found += value
    return found


def _all_rows() -> list[Row]:
    modules = {*rule_modules().values(), importlib.import_module("guardian.core.watchdog.canary")}
    # the memory guard's rows live in the modules its RULES gathers them from
    modules |= {importlib.import_module(f"guardian.core.memory.{m}") for m in ("memsqueeze", "memfollow", "memrestore")}
    return [row for module in modules for row in _rows_of(module)]


def test_every_rule_of_every_table_is_a_row():
    """A rule id the journal can carry (GUARDIAN_RULE: harness.check_rule_ids holds every line's to
    the tables) is a row's: its condition is the predicate the code decides by, not a comment."""
    rows = {id(row.rule) for row in _all_rows()}
    not_rows = sorted(rule.id for rules_ in RULE_TABLES.values() for rule in rules_ if id(rule) not in rows)
    assert not_rows == [], f"rules that are no row's: {not_rows}"


def test_the_row_check_sees_a_rule_that_is_no_row():
    module = ModuleType("fake")
    module.ROW = Row(Rule("Z1", "x", "y"), lambda c: True, lambda c: None)
    module.RULES = (module.ROW.rule, Rule("Z2", "x", "y"))
    assert {row.rule.id for row in _rows_of(module)} == {"Z1"}


# --- a rule's text names what its check lets through -------------------------------------------


def _word(state: ActiveState) -> str:
    """How a rule's text names STATE: systemd's word, or for one this guardian cannot parse, that."""
    return "does not know" if state is ActiveState.OTHER else state.value


def _row(rows, rule_id: str) -> Row:
    (row,) = [r for r in rows if r.rule.id == rule_id]
    return row


@pytest.mark.parametrize("state", list(ActiveState))
def test_g5s_text_names_exactly_the_states_its_check_lets_through(state):
    row = _row(gates.ROWS, "G5")
    let_through, refused = re.fullmatch(r"it is not (.*?) \(so (.*?)\):.*", row.rule.condition).groups()
    refuses = row.holds(SimpleNamespace(unit=SimpleNamespace(active_state=state), allow_failed=False))
    assert (re.search(rf"\b{_word(state)}\b", let_through) is None) == refuses
    assert (re.search(rf"\b{_word(state)}\b", refused) is not None) == refuses


@pytest.mark.parametrize("state", [s for s in ActiveState if not s.down])
def test_l5s_text_names_exactly_the_states_its_check_takes_as_starting(state):
    """L3 takes the states that are down first (its own text names them); of the others, L5 holds
    for exactly those its text names."""
    row = _row(liveness.ROWS, "L5")
    named = row.rule.condition.split(", or a restart by guardian")[0]
    facts = SimpleNamespace(unit=SimpleNamespace(active_state=state), track=SimpleNamespace(restart_in_flight=False))
    holds = row.holds(facts)
    assert (re.search(rf"\b{_word(state)}\b", named) is not None) == holds


@pytest.mark.parametrize("state", list(ActiveState))
def test_l3s_text_names_exactly_the_states_it_takes_as_stopped(state):
    row = _row(liveness.ROWS, "L3")
    named = row.rule.condition.split(" (")[0]
    holds = row.holds(SimpleNamespace(unit=SimpleNamespace(exists=True, active_state=state)))
    assert (re.search(rf"\b{_word(state)}\b", named) is not None) == holds


# --- the rules once tied to their code by a comment only ----------------------------------------


@pytest.mark.parametrize("dt", [29.0, 30.0])
def test_m1_the_squeeze_rows_judge_exactly_when_m1_holds(dt):
    config = memory_cfg()
    track, every, _ = run_memguard(config, [(100, view(5)), (100 + dt, view(5))])
    squeezed = first_match((SQUEEZED_ROW,), Clocks(track.below_since, track.psi_since, 100 + dt, config.memory))
    assert (squeezed is not None) == bool(lowerings(every)) == (dt >= 30)
    if squeezed is not None:
        assert squeezed[0].id == "M1" and rules(every) == ["M17"] and track.verdict is MemVerdict.LOWER


@pytest.mark.parametrize("headroom_gib, critical", [(2.9, True), (3.0, False)])
def test_m2_critical_is_what_the_lowering_says(headroom_gib, critical):
    config = memory_cfg(sustain_s=0)
    _, every, _ = run_memguard(config, [(100, view(headroom_gib))])
    assert CRITICAL_ROW.rule.id == "M2"
    assert CRITICAL_ROW.holds((int(headroom_gib * GiB), config.memory)) == critical
    (line,) = [a for a in every if getattr(a, "rule", None) == "M17"]
    assert ("CRITICAL" in line.message) == critical


def test_m9_a_served_fraction_not_the_files_is_not_wired():
    served = Served(True, True, True, 0.70, 0.78, "gpu_memory_utilization")
    rule, why = first_match((OVERRIDDEN_ROW,), served)
    assert rule.id == "M9" and why.startswith("it serves with gpu_memory_utilization 0.78 while guardian's env file")
    for other in (replace(served, wired=False), replace(served, settled=False), replace(served, serving=False),
                  replace(served, reported=0.70), replace(served, reported=None)):
        assert first_match((OVERRIDDEN_ROW,), other) is None
    # what M9 finds is the memory guard's wiring problem: M11 says it
    _, every, _ = run_memguard(memory_cfg(sustain_s=0), [(100, view(5, rep("a", wiring=why), rep("b", 0.5)))])
    assert "M11" in rules(every)


def test_m20_decides_whether_the_restore_rows_judge():
    raised = replace(rep("a", 0.70), base=0.78)
    track, _, _ = run_memguard(memory_cfg(), [(100, view(40, raised, rep("b", 0.70)))])
    assert track.rule == "M21" and track.verdict is MemVerdict.RESTORE_WAIT  # M20 chose a; M21 waits
    assert memrestore.RAISABLE_ROW.rule.id == "M20"
    track, _, _ = run_memguard(memory_cfg(restore=False), [(100, view(40, raised, rep("b", 0.70)))])
    assert track.rule is None and track.verdict is MemVerdict.NOT_SQUEEZED  # M20 does not hold


def test_b3_a_look_without_the_kernels_view_keeps_what_was_seen():
    config = cfg(2, proxy_peers=["127.0.0.1"])
    client = bypass.Bypass("a", "batch.service", 3, 10.0)
    seen, found = bypass.update({("a", "batch.service"): 10.0}, (client,), {"a": None}, 500.0, config)
    assert seen == {("a", "batch.service"): 10.0} and found == [client]
    assert bypass.said((client,), found, config, 500.0) == []  # no news is not "gone"
    assert bypass.NO_VIEW_ROW.rule.id == "B3"


def test_d12_a_drain_of_a_replica_gone_from_the_config_is_forgotten():
    config = cfg(2)
    drains = {"a": Drain(Phase.DRAINING, 1.0, "x"), "gone": Drain(Phase.AWAY, 1.0, "y")}
    assert drain.forget_unconfigured(drains, config) == {"a": drains["a"]}
    rule, _ = first_match((drain.FORGOTTEN_ROW,), drain.Configured("gone", config))
    assert rule.id == "D12" and first_match((drain.FORGOTTEN_ROW,), drain.Configured("a", config)) is None
