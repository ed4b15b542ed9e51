"""guardian's runtime dependencies, read from the one list in pyproject.toml.

The .deb build (bundled wheels) and the test bed (the container's Python) both call this, so a
dependency is added or changed in pyproject.toml alone. Names under [tool.guardian] sdist-only
are published as source only (pure Python) and are installed without --only-binary.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def requirement_name(requirement: str) -> str:
    """The distribution's normalized name (PEP 503) in a requirement such as "prometheus_client>=0.17"."""
    return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]).lower()


def runtime_deps() -> tuple[list[str], list[str]]:
    """(binary-wheel requirements, sdist-only requirements)."""
    data = tomllib.loads(PYPROJECT.read_text())
    reqs = list(data["project"]["dependencies"])
    sdist_only = {requirement_name(n) for n in data.get("tool", {}).get("guardian", {}).get("sdist-only", [])}
    return [r for r in reqs if requirement_name(r) not in sdist_only], [r for r in reqs if requirement_name(r) in sdist_only]
