"""Finds assertions on how fast something happened in the test tree (issue 30).

A test asserts what guardian decided, by which rule and in what order; a deadline only stops a hung
test, and the speed a test used to assert lives in bench/ and docs/benchmarks.md. On a loaded 2-core
machine a duration bound fails a test whose decision was right, so none may be asserted.

What counts as a measured duration (an expression is "timed" when any part of it is):
- a difference with a point in time in it: time.monotonic() - t0, where t0 was assigned from
  time.monotonic/time/perf_counter (and their _ns forms) in the same function, or a name that says
  it is a point (gone_at, decided_us, t0, started; a journal's __REALTIME_TIMESTAMP); a point alone
  is not a duration, and comparing points is an order, not a speed;
- a name assigned in the same function from a timed expression (followed through assignments);
- a name, attribute or string subscript key that is named like a measured time: took, elapsed,
  late, latency, duration, wall, waited, lag (alone or with _s/_ms), or ending in _after_s;
- anything read out of something named timings.

What is flagged: an ``assert`` whose condition puts an upper bound on a timed expression: ``timed <
number``, ``timed <= number``, ``number > timed`` or ``number >= timed``, where the number is a
literal, an UPPER_CASE constant or a setting named in seconds (``cfg.timeout_s``), alone or in
arithmetic; or that bounds a point by another plus a bound (``now < t0 + 5``, a deadline written
inline). That is the assertion a busy machine fails
although the decision was right. A lower bound ("not raised before restore_after_s") is left alone:
it says a rule waited its window, and load only makes a wait longer. Equality, a comparison of two
points in time (an order: "decided after the freeze"), and waits are not flagged either.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

CLOCKS = {"monotonic", "time", "perf_counter", "monotonic_ns", "time_ns", "perf_counter_ns", "process_time"}
TIMED_NAME = re.compile(r"^(took|elapsed|late|latency|duration|wall|waited|lag)(_[a-z0-9]+)*$"
                        r"|_(took|elapsed|latency|duration|waited)(_s|_ms)?$|_after_s$")
# a point in time by its name (decided_at, t0, started_mono) or a journal's timestamp field
TIME_POINT = re.compile(r"(_at|_mono|_wall|_ts|_us|_ns)$|^(t\d*|now|since|started|began|before|after)$|TIMESTAMP|Timestamp")
ORDERING = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    source: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: asserts a measured duration: {self.source}"


def _ident(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        return node.slice.value
    return None


def _reads_clock(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    return name in CLOCKS and not node.args


def _reading(node: ast.AST, readings: set[str]) -> bool:
    for sub in ast.walk(node):
        if _reads_clock(sub) or (isinstance(sub, ast.Name) and sub.id in readings):
            return True
        ident = _ident(sub)
        if ident is not None and TIME_POINT.search(ident):
            return True
    return False


def _timed(node: ast.AST, timed_names: set[str], readings: set[str] = frozenset()) -> bool:  # type: ignore[assignment]
    for sub in ast.walk(node):
        # a difference with a clock reading in it is a duration; a reading alone is a point in time
        if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Sub) and (
                _reading(sub.left, readings) or _reading(sub.right, readings)):
            return True
        ident = _ident(sub)
        if isinstance(sub, ast.Name) and sub.id in timed_names:
            return True
        if ident is not None and not isinstance(sub, ast.Subscript) and TIMED_NAME.search(ident):
            return True
        if isinstance(sub, ast.Subscript):
            if ident is not None and TIMED_NAME.search(ident):
                return True
            base = _ident(sub.value)
            if base is not None and "timings" in base:
                return True
    return False


BOUND_NAME = re.compile(r"(_s|_ms|timeout)$")


def _numeric(node: ast.AST) -> bool:
    """A bound: a number, a module constant (an UPPER_CASE name such as TIMEOUT_S), or a setting
    named in seconds (cfg.canary_timeout_s), alone or in arithmetic."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, int | float) and not isinstance(sub.value, bool):
            return True
        if isinstance(sub, ast.Name) and sub.id.isupper():
            return True
        ident = _ident(sub)
        if ident is not None and not isinstance(sub, ast.Subscript) and BOUND_NAME.search(ident):
            return True
    return False


def _point_plus_bound(small: ast.AST, large: ast.AST, readings: set[str]) -> bool:
    """``now < t0 + 5``: a duration bound written as a deadline (now - t0 < 5)."""
    return (
        _reading(small, readings)
        and isinstance(large, ast.BinOp)
        and isinstance(large.op, ast.Add)
        and _reading(large, readings)
        and _numeric(large)
    )


def _names_of(fn: ast.AST) -> tuple[set[str], set[str]]:
    """(timed names, names that hold a plain clock reading) assigned in FN, followed to a fixed point."""
    timed: set[str] = set()
    readings: set[str] = set()
    assigns: list[tuple[list[str], ast.AST]] = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple) and len(t.elts) == len(node.value.elts):
                    # a, b = x, y: each name from its own value
                    assigns += [([n.id for n in ast.walk(e) if isinstance(n, ast.Name)], v)
                                for e, v in zip(t.elts, node.value.elts, strict=True)]
                else:
                    assigns.append(([n.id for n in ast.walk(t) if isinstance(n, ast.Name)], node.value))
        elif isinstance(node, ast.AnnAssign | ast.AugAssign) and node.value is not None and isinstance(node.target, ast.Name):
            assigns.append(([node.target.id], node.value))
    for targets, value in assigns:
        if _reads_clock(value):
            readings.update(targets)
    changed = True
    while changed:
        changed = False
        for targets, value in assigns:
            if _timed(value, timed, readings) and not set(targets) <= timed:
                timed.update(targets)
                changed = True
    return timed, readings


def _flag(test: ast.AST, timed: set[str], readings: set[str]) -> bool:
    for cmp in (n for n in ast.walk(test) if isinstance(n, ast.Compare)):
        sides = [cmp.left, *cmp.comparators]
        for op, left, right in zip(cmp.ops, sides, sides[1:], strict=False):
            if not isinstance(op, ORDERING):
                continue
            # (small, large): the side an upper bound is put on is the smaller one
            small, large = (left, right) if isinstance(op, ast.Lt | ast.LtE) else (right, left)
            if _timed(small, timed, readings) and _numeric(large) and not _timed(large, timed, readings):
                return True
            if _point_plus_bound(small, large, readings):
                return True
    return False


def find(source: str, path: str = "<string>") -> list[Finding]:
    tree = ast.parse(source)
    findings: list[Finding] = []
    scopes = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)] or [tree]
    seen: set[int] = set()
    for fn in scopes:
        timed, readings = _names_of(fn)
        for node in ast.walk(fn):
            if isinstance(node, ast.Assert) and id(node) not in seen and _flag(node.test, timed, readings):
                seen.add(id(node))
                findings.append(Finding(path, node.lineno, ast.get_source_segment(source, node) or ""))
    return sorted(findings, key=lambda f: f.line)


def find_in_tree(root: Path) -> list[Finding]:
    out: list[Finding] = []
    for p in sorted(root.rglob("*.py")):
        out += find(p.read_text(), str(p.relative_to(root.parent)))
    return out
