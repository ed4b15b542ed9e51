"""No test asserts how fast something happened (issue 30): the checker over the whole test tree, and the
checker's own cases, so that it can fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from timed_asserts import find, find_in_tree

FLAGGED = [
    ("took = decision_after(w, a, t0)\n    assert took is not None and took <= 11.0, took", "a duration by name"),
    ("assert 0 < took_s < 15, took_s", "a chained bound"),
    ("t0 = time.monotonic()\n    run()\n    spent = time.monotonic() - t0\n    assert spent < 5", "a clock difference"),
    ("t0 = time.monotonic()\n    x = time.monotonic() - t0\n    y = x * 1000\n    assert y < 50", "followed through names"),
    ("assert time.monotonic() - t0 < 3", "inline"),
    ("assert again.timings['total_s'] < 30, again.timings", "a timings record"),
    ("assert late_s < 0.5, 'late'", "lateness"),
    ("assert took_s < 1.0 + 2 * GRACE_S + 2", "against arithmetic with a constant"),
    ("assert 2.5 <= served_after_s < 10", "an _after_s bound"),
    ("assert r.elapsed_s <= 1", "an attribute"),
    ("assert 15 >= took_s", "the bound on the left"),
    ("assert result.latency_s < cfg.canary_timeout_s", "against a setting in seconds"),
    ("t0 = time.monotonic()\n    assert time.monotonic() < t0 + stall_s", "a deadline written inline"),
    ("assert held_until_at < t0 + 4.0", "a named point against another plus a number"),
    ("assert elapsed_s < QUICK_S", "against a module constant"),
    ("assert gone_at - decided_at <= GONE_WITHIN_S", "a difference of two named points"),
    ("assert (int(b['__REALTIME_TIMESTAMP']) - int(a['__REALTIME_TIMESTAMP'])) / 1e6 < 3", "journal timestamps"),
]

ALLOWED = [
    ("assert r.startup_grace_s >= 15 * 60", "a configured window, not a measurement"),
    ("assert decided_at > frozen_at", "an order of two readings"),
    ("t0 = time.monotonic()\n    t1 = time.monotonic()\n    assert t1 >= t0", "an order of two clock readings"),
    ("took = 3\n    assert took == took", "equality"),
    ("assert took is not None", "no comparison"),
    ("wait_for(lambda: time.monotonic() - started >= 20, 30, 'x')", "a wait, not an assertion"),
    ("assert len(lines) <= 3", "a count"),
    ("assert t1 - t0 >= interval_s - 0.05", "a lower bound: a rule waited its window"),
    ("assert 2.5 <= served_after_s", "a lower bound, written the other way"),
    ("before = time.time()\n    started = wait_for(lambda: seen() >= before)\n    assert started >= before", "a point, not a span"),
    ("t0 = time.monotonic()\n    end = t0 + stall_s\n    assert time.monotonic() < end", "a point against a named point"),
    ("began, proc = time.monotonic(), Process(1)\n    base = proc.rss\n    assert proc.rss - base >= 9", "a tuple's other name"),
    ("took_s = measure()\n    print(took_s)\n    assert 'unresponsive' in line", "printed, not asserted"),
]


@pytest.mark.parametrize(("body", "why"), FLAGGED, ids=[w for _, w in FLAGGED])
def test_the_checker_flags_a_duration_bound(body, why):
    src = f"def test_x():\n    {body}\n"
    assert len(find(src)) == 1, (why, src)


@pytest.mark.parametrize(("body", "why"), ALLOWED, ids=[w for _, w in ALLOWED])
def test_the_checker_leaves_decisions_orders_and_waits_alone(body, why):
    src = f"def test_x():\n    {body}\n"
    assert find(src) == [], (why, src)


def test_no_test_asserts_a_measured_duration():
    """Speed belongs in bench/ and docs/benchmarks.md; a test asserts what was decided and by which rule."""
    findings = find_in_tree(Path(__file__).resolve().parent)
    assert findings == [], "\n".join(map(str, findings))
