"""Rules as data: each rule is a row with a stable id. Verdicts and refusals carry the id,
tests assert ids, and the README's rule tables are rendered from these rows
(``scripts/render-rules`` writes them into the README; a test checks the README against them)."""

from __future__ import annotations

from dataclasses import dataclass

from .vocab import Gate, Priority


@dataclass(frozen=True)
class Rule:
    id: str  # stable: L3, A1, G5, M4 ...; never reused for another meaning
    outcome: str  # the state, gate or verdict this rule yields
    condition: str  # exact, with AND/OR and < versus <=; W., R., M. are config sections


@dataclass(frozen=True)
class Refusal:
    """Why a restart may not happen now: an admission row (A1-A3), a unit gate (G1-G9) or the
    fleet (F1-F6). KEY is stable while the cause is the same (it carries no live seconds), so a
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


def tables() -> dict[str, str]:
    """Every rule table, keyed by the README marker it is rendered under."""
    from . import admission, bypass, drain, fleet, gates, liveness, memguard

    return {
        "liveness": markdown_table(liveness.RULES, "state"),
        "admission": markdown_table(admission.RULES, "refusal"),
        "gates": markdown_table(gates.RULES, "refusal"),
        "memory": markdown_table(memguard.RULES, "verdict"),
        "drain": markdown_table(drain.RULES, "outcome"),
        "fleet": markdown_table(fleet.RULES, "outcome"),
        "bypass": markdown_table(bypass.RULES, "outcome"),
    }


def render_into(text: str) -> str:
    """TEXT with each ``<!-- rules:NAME -->`` ... ``<!-- /rules:NAME -->`` block replaced by the table."""
    for name, table in tables().items():
        start, end = f"<!-- rules:{name} -->", f"<!-- /rules:{name} -->"
        a, b = text.find(start), text.find(end)
        if a < 0 or b < a:
            raise ValueError(f"no {start} ... {end} block")
        text = text[: a + len(start)] + "\n" + table + "\n" + text[b:]
    return text
