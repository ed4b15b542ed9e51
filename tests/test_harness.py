"""The test suite's own rules: no test module imports another (what they share is in
tests/harness.py), and every rule id is in exactly one table, in reading order, and every id the
code returns is in a table (the harness checks each one it sees)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from guardian.core.memory import memguard
from guardian.core import tick
from guardian.core.actions import LogLine
from guardian.core.watchdog.track import Track
from guardian.core.memory.memguard import MemoryView
from guardian.core.rules import Refusal
from guardian.core.vocab import Decision, Gate, Priority
from harness import (
    KNOWN_RULE_IDS, RULE_TABLES, TOTAL, Box, cfg, check_rule_ids, checked, memory, run_memguard, with_memory,
)

TESTS = Path(__file__).resolve().parent


# --- no test module imports another ------------------------------------------------------------------

def imported_test_modules(source: str) -> set[str]:
    """The test_* modules SOURCE imports, wherever the import is (a function's body too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
              in ("__import__", "import_module") and node.args and isinstance(node.args[0], ast.Constant)):
            found.add(str(node.args[0].value))
    return {m for m in found if m.split(".")[0].startswith("test_")}


def test_no_test_module_imports_another():
    offenders = {p.name: sorted(imported_test_modules(p.read_text())) for p in sorted(TESTS.glob("test_*.py"))}
    assert len(offenders) > 20  # the suite itself was read
    assert {name: found for name, found in offenders.items() if found} == {}


@pytest.mark.parametrize("source, found", [
    ("from test_liveness import Sim, cfg\n", {"test_liveness"}),
    ("def f():\n    from test_tick import config\n", {"test_tick"}),
    ("import test_shell as shell\n", {"test_shell"}),
    ("m = __import__('test_simulator')\n", {"test_simulator"}),
    ("from harness import Box\nfrom systemd_box import wait_for\nimport pytest\n", set()),
])
def test_the_import_check_sees_each_way_of_importing(source, found):
    assert imported_test_modules(source) == found


# --- rule ids, every family ---------------------------------------------------------------------------

def test_every_family_of_rules_is_read():
    assert set(RULE_TABLES) >= {"liveness", "admission", "gates", "memguard", "startguard", "drain", "fleet", "bypass"}


def test_each_table_is_one_family_numbered_with_no_gap():
    """Ids are stable (core/rules.py: never reused for another meaning): a row added between two
    others takes the family's next number (liveness's L19-L22, issue 43), so reading order and
    numbering may part; no number is skipped or taken twice."""
    families = {}
    for name, rows in RULE_TABLES.items():
        ids = [r.id for r in rows]
        assert ids, f"{name}: an empty table"
        letter = re.fullmatch(r"([A-Z])\d+", ids[0]).group(1)
        assert sorted(ids, key=lambda i: int(i[1:])) == [f"{letter}{i}" for i in range(1, len(ids) + 1)], name
        assert letter not in families, f"{name} and {families.get(letter)} share the letter {letter}"
        families[letter] = name


def test_every_rule_id_is_in_one_table_only():
    ids = [r.id for rows in RULE_TABLES.values() for r in rows]
    assert len(ids) == len(set(ids)) == len(KNOWN_RULE_IDS)


def _line(rule: str | None) -> LogLine:
    return LogLine(Priority.INFO, "x", Decision.STATE, "a", rule=rule)


def test_the_harness_fails_on_a_rule_id_in_no_table():
    check_rule_ids([_line("L1"), _line("D12"), _line(None)], {"a": Track(rule="L18")})
    with pytest.raises(AssertionError, match="L99"):
        check_rule_ids([_line("L99")])
    with pytest.raises(AssertionError, match="X1"):
        check_rule_ids([], {"a": Track(rule="X1")})
    with pytest.raises(AssertionError, match="no L rule"):  # a known id of another family
        check_rule_ids([], {"a": Track(rule="A1")})
    check_rule_ids([], mem_rule="M4")
    with pytest.raises(AssertionError, match="no M rule"):
        check_rule_ids([], mem_rule="L5")
    assert checked(None) is None
    assert checked(Refusal(Gate.MASKED, "G1", "masked")).rule == "G1"
    with pytest.raises(AssertionError, match="G99"):
        checked(Refusal(Gate.MASKED, "G99", "masked"))


def test_every_decision_the_harness_drives_is_checked(monkeypatch):
    """As if the core had said a rule that no table has: Box and run_memguard both fail."""
    def saying(decide):
        def decide_and_say_l0(state, view, now, config):
            state, actions = decide(state, view, now, config)
            return state, [*actions, _line("L0")]
        return decide_and_say_l0

    Box(cfg(1)).tick(100)
    monkeypatch.setattr(tick, "decide", saying(tick.decide))
    with pytest.raises(AssertionError, match="L0"):
        Box(cfg(1)).tick(100)
    monkeypatch.setattr(memguard, "decide", saying(memguard.decide))
    with pytest.raises(AssertionError, match="L0"):
        run_memguard(with_memory(cfg(2)), [(100.0, MemoryView(memory(20).sample, TOTAL, ()))])
