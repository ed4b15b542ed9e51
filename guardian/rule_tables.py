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
from .core.rules import markdown_table
from .core.watchdog import canary, liveness

# Where the tables live, relative to the repository root.
RULES_DOC = "docs/rules.md"


def tables() -> dict[str, str]:
    """Every rule table, keyed by the docs/rules.md marker it is rendered under."""
    return {
        "liveness": markdown_table(liveness.RULES, "state"),
        "canary": markdown_table(canary.CANARY_RULES, "meaning"),
        "admission": markdown_table(admission.RULES, "refusal"),
        "gates": markdown_table(gates.RULES, "refusal"),
        "memory": markdown_table(memguard.RULES, "verdict"),
        "start": markdown_table(startguard.RULES, "verdict"),
        "fit": markdown_table(startfit.RULES, "verdict"),
        "drain": markdown_table(drain.RULES, "outcome"),
        "fleet": markdown_table(fleet.RULES, "outcome"),
        "bypass": markdown_table(bypass.RULES, "outcome"),
        "weights": markdown_table(weights.RULES, "verdict"),
        "stopping": markdown_table(stopping.RULES, "outcome"),
        "outside": markdown_table(outside.RULES, "outcome"),
    }


def render_into(text: str) -> str:
    """TEXT with each ``<!-- rules:NAME -->`` ... ``<!-- /rules:NAME -->`` block replaced by the table."""
    for name, table in tables().items():
        start, end = f"<!-- rules:{name} -->", f"<!-- /rules:{name} -->"
        start_at, end_at = text.find(start), text.find(end)
        if start_at < 0 or end_at < start_at:
            raise ValueError(f"no {start} ... {end} block")
        text = text[: start_at + len(start)] + "\n" + table + "\n" + text[end_at:]
    return text
