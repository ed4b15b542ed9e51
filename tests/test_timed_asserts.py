"""No test asserts how fast something happened (issue 30): the checker over the whole test tree, and the
checker's own cases, so that it can fail."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from timed_asserts import find, find_in_tree

CASES = tomllib.loads((Path(__file__).resolve().parent / "timed_asserts_cases.toml").read_text())
FLAGGED = [(c["body"], c["why"]) for c in CASES["flagged"]]
ALLOWED = [(c["body"], c["why"]) for c in CASES["allowed"]]


def _test(body: str) -> str:
    """BODY (lines of a test, as in the cases file: `expect` stands for the assert keyword) as a test
    function's source."""
    lines = [re.sub(r"^expect ", "assert ", line) for line in body.splitlines()]
    assert not [line for line in lines if line.startswith("expect")], body  # the stand-in is never left
    return "def test_x():\n" + "".join(f"    {line}\n" for line in lines)


@pytest.mark.parametrize(("body", "why"), FLAGGED, ids=[w for _, w in FLAGGED])
def test_the_checker_flags_a_duration_bound(body, why):
    src = _test(body)
    assert len(find(src)) == 1, (why, src)


@pytest.mark.parametrize(("body", "why"), ALLOWED, ids=[w for _, w in ALLOWED])
def test_the_checker_leaves_decisions_orders_and_waits_alone(body, why):
    src = _test(body)
    assert find(src) == [], (why, src)


def test_no_test_asserts_a_measured_duration():
    """Speed belongs in bench/ and docs/benchmarks.md; a test asserts what was decided and by which rule."""
    findings = find_in_tree(Path(__file__).resolve().parent)
    assert findings == [], "\n".join(map(str, findings))
