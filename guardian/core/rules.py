"""Rules as data: each rule is a row with a stable id. Verdicts and refusals carry the id,
tests assert ids, and the rule tables of docs/rules.md are rendered from these rows
(guardian/rule_tables.py; ``scripts/render-rules`` writes them into docs/rules.md and a test checks
docs/rules.md against them).

A rule module holds its rules as ROWS of Row: the Rule (its table row), the predicate that says
when it holds and the evidence it gives then, over one immutable context value; ``first_match``
walks them in order, so the table is the classifier. Its ``RULES`` are the rows' rules. A leaf:
it imports nothing of guardian but the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from .vocab import Gate, Priority


@dataclass(frozen=True)
class Rule:
    id: str  # stable: L3, A1, G5, M4 ...; never reused for another meaning
    outcome: str  # the state, gate or verdict this rule yields
    condition: str  # exact, with AND/OR and < versus <=; W., R., M. are config sections


# The outcome of a rule that keeps what was there (the last verdict, what was seen).
UNCHANGED = "(unchanged)"

Context = TypeVar("Context")
Evidence = TypeVar("Evidence")


@dataclass(frozen=True)
class Row(Generic[Context, Evidence]):
    """One rule as code: its table row, when it holds, and what it says when it does."""

    rule: Rule
    holds: Callable[[Context], bool]
    evidence: Callable[[Context], Evidence]


def first_match(rows: Iterable[Row[Context, Evidence]], context: Context) -> tuple[Rule, Evidence] | None:
    """The first row that holds for CONTEXT, as (its rule, its evidence); None when none holds."""
    for row in rows:
        if row.holds(context):
            return row.rule, row.evidence(context)
    return None


@dataclass(frozen=True)
class Why:
    """What a refusal row says when it holds: the journal line's reason and remedy, its priority,
    and what besides the gate tells one episode of it from the next (never live seconds)."""

    reason: str
    remedy: str = ""
    priority: Priority = Priority.ERROR
    episode: tuple[str, ...] = ()


@dataclass(frozen=True)
class Refusal:
    """Why a restart may not happen now: an admission row (A1-A3), a unit gate (G1-G9) or the
    fleet (F3-F6). KEY is stable while the cause is the same (it carries no live seconds), so a
    refusal is logged once per episode; TEXT is for the journal line."""

    gate: Gate
    rule: str
    reason: str
    remedy: str = ""
    priority: Priority = Priority.ERROR
    key: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        return f"{self.reason}; {self.remedy}" if self.remedy else self.reason


def markdown_table(rows: tuple[Rule, ...], outcome_header: str) -> str:
    lines = [f"| id | {outcome_header} | condition |", "|---|---|---|"]
    lines += ["| " + " | ".join((r.id, r.outcome, r.condition.replace("|", r"\|"))) + " |" for r in rows]
    return "\n".join(lines)
