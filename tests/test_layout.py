"""The README's Layout section names the package as it is, and the shape limits hold.

Each ``guardian/PKG/`` named in the section is followed by the modules of that package, up to the
next package named (or "On top:", which names the top-level modules): exactly the files there."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "guardian"
NOT_NAMED = {"__init__.py", "__main__.py"}


def _layout() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("\n## Layout\n")
    end = text.index("\n`vllm_sim/`", start)
    return text[start:end]


def _parts(section: str) -> dict[str, set[str]]:
    """Package (``""`` for the top level) -> the ``name.py`` the section names for it."""
    marks = [(m.start(), m.group(1)) for m in re.finditer(r"`guardian/(\w+)/`", section)]
    marks.append((section.index("On top:"), ""))
    marks.sort()
    parts: dict[str, set[str]] = {}
    for (start, name), (end, _next) in zip(marks, [*marks[1:], (len(section), "")], strict=True):
        parts.setdefault(name, set()).update(re.findall(r"`(\w+\.py)`", section[start:end]))
    return parts


def _modules(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("*.py")} - NOT_NAMED


def test_layout_names_every_package_and_module_and_no_other():
    parts = _parts(_layout())
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert set(parts) - {""} == packages
    for name, named in parts.items():
        folder = PACKAGE / name if name else PACKAGE
        assert named == _modules(folder), f"guardian/{name}: README names {sorted(named)}"


def test_the_layout_check_sees_a_missing_module():
    section = _layout().replace("`memview.py`", "`memview`")
    assert "memview.py" not in _parts(section)["core"]


def test_no_function_breaks_the_shape_limits():
    check = runpy.run_path(str(REPO / "scripts" / "check-shape"))
    assert check["offenders"](PACKAGE) == []


def test_the_shape_check_sees_a_long_function_and_many_parameters(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    (tmp_path / "m.py").write_text(f"def long():\n{body}\n\n\ndef wide(self, a, b, c, d, e, f, *, g):\n    pass\n")
    check = runpy.run_path(str(REPO / "scripts" / "check-shape"))
    found = check["offenders"](tmp_path)
    assert any("long is 61 lines long" in line for line in found)
    assert any("wide takes 7 parameters" in line for line in found)
