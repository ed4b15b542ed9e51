"""The rule tables of docs/rules.md, rendered from the rule modules' rows (guardian/core/ and its subpackages: RULES).

Outside the core on purpose: it reads every rule module, while each of them reads core/rules.py,
which therefore stays a leaf. ``scripts/render-rules`` writes the tables into docs/rules.md (the
README keeps a short account and links there); a test checks docs/rules.md against them.
"""

from __future__ import annotations

from .core import admission, fleet, gates, outside, stopping, weights
from .core.fit import startfit
from .core.memory import memguard, startguard
from .core.proxy import bypass, drain
from .core.rules import Rule, markdown_table
from .core.watchdog import canary, liveness

# Where the tables live, relative to the repository root.
RULES_DOC = "docs/rules.md"


def rule_sets() -> dict[str, tuple[tuple[Rule, ...], str]]:
    """Every rule table's rows and the heading of its outcome column, keyed by its docs/rules.md marker."""
    return {
        "liveness": (liveness.RULES, "state"),
        "canary": (canary.CANARY_RULES, "meaning"),
        "admission": (admission.RULES, "refusal"),
        "gates": (gates.RULES, "refusal"),
        "memory": (memguard.RULES, "verdict"),
        "start": (startguard.RULES, "verdict"),
        "fit": (startfit.RULES, "verdict"),
        "drain": (drain.RULES, "outcome"),
        "fleet": (fleet.RULES, "outcome"),
        "bypass": (bypass.RULES, "outcome"),
        "weights": (weights.RULES, "verdict"),
        "stopping": (stopping.RULES, "outcome"),
        "outside": (outside.RULES, "outcome"),
    }


def tables() -> dict[str, str]:
    """Every rule table, keyed by the docs/rules.md marker it is rendered under."""
    return {name: markdown_table(rules, heading) for name, (rules, heading) in rule_sets().items()}


def render_into(text: str) -> str:
    """TEXT with each ``<!-- rules:NAME -->`` ... ``<!-- /rules:NAME -->`` block replaced by the table."""
    for name, table in tables().items():
        start, end = f"<!-- rules:{name} -->", f"<!-- /rules:{name} -->"
        start_at, end_at = text.find(start), text.find(end)
        if start_at < 0 or end_at < start_at:
            raise ValueError(f"no {start} ... {end} block")
        text = text[: start_at + len(start)] + "\n" + table + "\n" + text[end_at:]
    return text
