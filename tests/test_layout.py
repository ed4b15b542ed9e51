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
    assert "memview.py" in _parts(text)["core/memory"]
    assert "memview.py" not in _parts(text.replace("- `memview.py`:", "- `memview`:"))["core/memory"]
    no_line = re.sub(r"^- `memview.py`: .*$", "- `memview.py`:", text, flags=re.M)
    assert "memview.py" not in _parts(no_line)["core/memory"]
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


# --- the shell measures and acts; the core decides (issue 45 item 1) ------------------------------------

SHELL = ("act", "observe")
RULE_TABLE = re.compile(r"^(ROWS|RULES|[A-Z_]+_ROWS?|Row|Rule|first_match|holds)$")
# The core's pure judges the shell may call itself, each right before acting, on figures measured at
# that moment (earlyoom's re-check): a fit or a gate judged a tick earlier could be wrong by then.
RECHECKS = {
    ("act/fit.py", "startfit.judge"),  # the start fit on the memory right before the start (U1-U7)
    ("act/fit.py", "startfit.judge_kept"),  # a kept U8 finding on this tick's memory
    ("act/fit.py", "judge_kept"),  # the same, through act/fit.judge_kept (the daemon's tick)
    ("act/fit.py", "startfit.not_returned_bytes"),  # U8 on MemFree as it rises after the restart job
    ("act/fit.py", "startfit.lowering_floor"),  # U6's floor, a part of the fit's figures
    ("act/fit.py", "wiring_problem"),  # whether U6 may lower it: its unit's wiring (core/memory/wiring.py)
    ("act/restart.py", "gates.unit_refusal"),  # the unit gates on a fresh look at the unit and port
}
JUDGE = re.compile(
    r"(^|\.)(judge\w*|decide|first_match|unit_refusal|\w*_hazards|not_returned_bytes|lowering_floor|wiring_problem)$"
)


def _shell_verdicts(root: Path = PACKAGE) -> list[str]:
    """Where a module of act/ or observe/ takes a verdict the core does not hand it: imports a rule
    table, calls a judge the RECHECKS do not name, or writes a rule id of its own into a line."""
    import ast

    found = []
    for pkg in SHELL:
        for path in sorted((root / pkg).glob("*.py")):
            where = f"{pkg}/{path.name}"
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and "core" in node.module:
                    found += [f"{where}:{node.lineno} imports {a.name}" for a in node.names if RULE_TABLE.match(a.name)]
                elif isinstance(node, ast.Attribute) and RULE_TABLE.match(node.attr):
                    found.append(f"{where}:{node.lineno} reads {ast.unparse(node)}")
                elif isinstance(node, ast.Call):
                    called = ast.unparse(node.func)
                    if JUDGE.search(called) and (where, called) not in RECHECKS:
                        found.append(f"{where}:{node.lineno} calls {called}")
                    rules = [k for k in node.keywords if k.arg == "rule" and isinstance(k.value, ast.Constant)]
                    found += [f"{where}:{node.lineno} writes rule {k.value.value!r} itself" for k in rules]  # type: ignore[attr-defined]
    return found


def test_no_module_of_the_shell_takes_a_verdict():
    assert _shell_verdicts() == []


def test_the_verdict_check_sees_a_rule_table_a_judge_and_a_rule_of_its_own(tmp_path):
    for pkg in SHELL:
        (tmp_path / pkg).mkdir()
    (tmp_path / "act" / "bad.py").write_text(
        "from ..core.gates import ROWS\nfrom ..core import liveness\n"
        "x = liveness.judge(1)\ny = LogLine(1, 'x', 2, rule='L9')\nz = startfit.RULES\n"
        "w = drain.MARKED_DOWN_ROW.holds(1)\nv = hazards.find_hazards(1)\n"
    )
    (tmp_path / "observe" / "fine.py").write_text("from ..core.vocab import State\nx = gates.refused_on_recheck(1)\n")
    found = _shell_verdicts(tmp_path)
    assert sorted(line.split(" ", 1)[1] for line in found) == sorted([
        "imports ROWS", "calls liveness.judge", "writes rule 'L9' itself", "reads startfit.RULES",
        "reads drain.MARKED_DOWN_ROW", "reads drain.MARKED_DOWN_ROW.holds", "calls hazards.find_hazards"]), found


def _tick_flags(source: str) -> list[str]:
    """The attributes the Tick's __init__ sets to a bool: a flag one step would set for another."""
    import ast

    tick = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == "Tick")
    init = next(n for n in tick.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return [
        target.attr
        for node in ast.walk(init)
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, bool)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute)
    ]


def test_the_tick_holds_no_flag_that_one_step_sets_for_another():
    """Issue 45 item 2: restart_under_way was a boolean flag set in four steps and read in three; it
    is now what the tracks (and Tick.stood_for, a dry run's stand-ins) say, asked when needed. This
    catches a boolean flag coming back; the Tick's other parts are the next state's (core/tick.py)."""
    assert _tick_flags((PACKAGE / "core" / "work.py").read_text()) == []
    assert _tick_flags("class Tick:\n    def __init__(self):\n        self.busy = False\n") == ["busy"]
