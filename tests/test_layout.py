"""docs/layout.md names the package as it is, and the shape limits hold.

Each ``## `guardian/PKG/` `` heading of docs/layout.md (``## `guardian/core/watchdog/` `` for a
subpackage) is followed by one bullet per module of that package (``- `name.py`: what it is for``),
and the ``## `guardian/` `` heading by the top-level modules: exactly the files there, each once.
No module of the core is over CORE_MODULE_LINES lines."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "guardian"
LAYOUT = REPO / "docs" / "layout.md"
NOT_NAMED = {"__init__.py", "__main__.py"}
CORE_MODULE_LINES = 600  # a module of guardian/core/ reads as one job; past this, split it by job


def _layout() -> str:
    return LAYOUT.read_text()


def _parts(text: str) -> dict[str, list[str]]:
    """Package (``""`` for the top level, ``core/watchdog`` for a subpackage) -> the ``name.py``
    bullets under its heading, in order."""
    parts: dict[str, list[str]] = {}
    current: str | None = None
    for line in text.splitlines():
        if line.startswith("## "):
            m = re.match(r"## `guardian/((?:\w+/)*)`", line)
            current = m.group(1).rstrip("/") if m else None
            if current is not None:
                assert current not in parts, f"docs/layout.md has two headings for guardian/{current}"
                parts[current] = []
        elif current is not None:
            m = re.match(r"- `(\w+\.py)`: \S", line)
            if m:
                parts[current].append(m.group(1))
    return parts


def _modules(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("*.py")} - NOT_NAMED


def _packages() -> set[str]:
    """Every package under guardian/, subpackages too, as ``core/watchdog``."""
    return {str(p.parent.relative_to(PACKAGE)) for p in PACKAGE.rglob("__init__.py")} - {"."}


def test_layout_names_every_package_and_module_and_no_other():
    parts = _parts(_layout())
    packages = _packages()
    assert "core/watchdog" in packages
    assert set(parts) - {""} == packages
    for name, named in parts.items():
        folder = PACKAGE / name if name else PACKAGE
        assert len(named) == len(set(named)), f"guardian/{name}: docs/layout.md names a module twice: {named}"
        assert set(named) == _modules(folder), f"guardian/{name}: docs/layout.md names {sorted(named)}"


def test_the_layout_check_sees_a_missing_module_and_one_without_a_line():
    text = _layout()
    assert "memview.py" in _parts(text)["core"]
    assert "memview.py" not in _parts(text.replace("- `memview.py`:", "- `memview`:"))["core"]
    no_line = re.sub(r"^- `memview.py`: .*$", "- `memview.py`:", text, flags=re.M)
    assert "memview.py" not in _parts(no_line)["core"]
    assert "daemon.py" in _parts(text)[""] and "daemon.py" not in _parts(text)["core"]
    assert "check.py" in _parts(text)["cli"] and "check.py" not in _parts(text)[""]
    assert "canary.py" in _parts(text)["core/watchdog"] and "canary.py" not in _parts(text)["core"]
    assert "draining.py" in _parts(text)["core/proxy"] and "drain.py" not in _parts(text)["core"]


def _long_core_modules(core: Path = PACKAGE / "core") -> list[str]:
    found = []
    for path in sorted(core.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > CORE_MODULE_LINES:
            found.append(f"{path.relative_to(core.parent)}: {lines} lines")
    return found


def test_no_module_of_the_core_is_over_its_limit():
    """A module of guardian/core/ is one job (issue 45 item 4): liveness.py held 1,290 lines once,
    the rows, their facts, the track, the fold and the canary together (core/watchdog/ is it split),
    and drain.py 680, the drain's rows and its procedure (core/proxy/)."""
    assert _long_core_modules() == [], f"modules of the core over {CORE_MODULE_LINES} lines: split them by job"


def test_the_size_check_sees_a_long_module(tmp_path):
    core = tmp_path / "core"
    (core / "family").mkdir(parents=True)
    (core / "short.py").write_text("x = 1\n")
    (core / "family" / "long.py").write_text("x = 1\n" * (CORE_MODULE_LINES + 1))
    assert _long_core_modules(core) == [f"core/family/long.py: {CORE_MODULE_LINES + 1} lines"]


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


def test_the_readme_layout_names_every_package_and_points_at_the_page():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Layout\n", 1)[1].split("\n## ", 1)[0]
    assert "[docs/layout.md](docs/layout.md)" in section
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert {name for name in packages if f"`{name}/`" not in section} == set()
