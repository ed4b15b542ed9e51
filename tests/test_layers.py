"""The layout is the architecture: imports only point down, the rule tables of docs/rules.md are
the code's rows, and every rule id exists once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from harness import RULE_TABLES

from guardian.core.watchdog import liveness
from guardian.rule_tables import render_into, tables

PKG = Path(__file__).resolve().parent.parent / "guardian"
RULES_DOC = PKG.parent / "docs" / "rules.md"

# What each layer may import from guardian. The core is pure: the vocabulary, values, rules and
# the tick's decision, and the typed config it reads.
ALLOWED = {
    "core": {"core", "config"},
    "engines": {"config", "engines"},  # what each serving engine is: data, no I/O
    "observe": {"core", "config", "engines", "observe"},
    "act": {"core", "config", "engines", "observe", "act"},
    "export": {"core", "config", "engines", "observe", "act", "export"},
    "fleet": {"core", "config", "engines", "observe", "fleet"},
}
# I/O the pure core must not touch (the clock included: `now` is an argument).
FORBIDDEN_IN_CORE = {"os", "time", "asyncio", "socket", "subprocess", "httpx", "psutil", "pynvml", "dbus_fast",
                     "pathlib", "open"}


def _guardian_imports(path: Path, root: Path = PKG.parent) -> set[str]:
    """The guardian sub-packages or top modules PATH (a file of ROOT/guardian) imports."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(root).with_suffix("").parts  # ('guardian', 'core', 'tick')
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(rel[: len(rel) - node.level])
                parts = base + (node.module.split(".") if node.module else [])
                if not node.module:  # from . import x, y
                    found |= {(parts + [a.name])[1] if len(parts) == 1 else parts[1] for a in node.names}
                    continue
            else:
                parts = (node.module or "").split(".")
            if parts and parts[0] == "guardian" and len(parts) > 1:
                found.add(parts[1])
            elif parts == ["guardian"]:
                found |= {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "guardian" and len(parts) > 1:
                    found.add(parts[1])
    return found


def _third_party_and_stdlib(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
            names.add("open")
    return names


def _layer_files(layer: str, root: Path = PKG) -> list[Path]:
    """Every module of LAYER, its subpackages' too (core/watchdog/ is core)."""
    return sorted((root / layer).rglob("*.py"))


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_imports_only_point_down(layer):
    bad = {}
    for path in _layer_files(layer):
        wrong = {m.removesuffix(".py") for m in _guardian_imports(path)} - ALLOWED[layer]
        if wrong:
            bad[str(path.relative_to(PKG))] = sorted(wrong)
    assert bad == {}, f"guardian/{layer} imports from layers above it: {bad}"


def test_the_core_does_no_io_and_reads_no_clock():
    bad = {str(p.relative_to(PKG)): sorted(_third_party_and_stdlib(p) & FORBIDDEN_IN_CORE) for p in _layer_files("core")}
    assert {k: v for k, v in bad.items() if v} == {}
    assert any(p.parent.name == "watchdog" for p in _layer_files("core")), "the core's subpackages are read"


def test_the_import_checker_sees_a_violation(tmp_path):
    """The checker itself must be able to fail (on a copy of the layout, never in the source tree)."""
    fake = tmp_path / "guardian" / "core" / "probe.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("from ..observe import probes\nfrom ..act.journal import Journal\nimport time\n")
    assert _guardian_imports(fake, tmp_path) == {"observe", "act"}
    assert "time" in _third_party_and_stdlib(fake)


def test_the_import_checker_counts_a_subpackage_of_the_core_as_core(tmp_path):
    """A module of core/watchdog/ is in the core: `...observe` leaves it, `..rules` stays in it."""
    fake = tmp_path / "guardian" / "core" / "family" / "probe.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("from ...observe import probes\nfrom ..rules import Rule\nfrom . import sibling\n"
                    "from ...config import Config\nimport os\n")
    assert _guardian_imports(fake, tmp_path) == {"observe", "core", "config"}
    assert fake in _layer_files("core", tmp_path / "guardian")
    assert "os" in _third_party_and_stdlib(fake)


def _run_time_nodes(node: ast.AST):
    """NODE and every node below it that runs: an ``if TYPE_CHECKING:`` block is read by the type
    checker alone."""
    yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            for branch in child.orelse:  # its else branch does run
                yield from _run_time_nodes(branch)
            continue
        yield from _run_time_nodes(child)


def _module_graph(root: Path = PKG.parent) -> dict[str, set[str]]:
    """Module -> the guardian modules it imports (dotted names; a package is its __init__), from the
    AST: imports inside functions count, for they run too (only later); those for the type checker
    alone do not."""
    files = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
             for p in sorted((root / "guardian").rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found: set[str] = set()
        for node in _run_time_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                source = ".".join(base + (node.module.split(".") if node.module else []))
                found |= {source} | {f"{source}.{a.name}" for a in node.names}
        graph[module] = {m for m in found if m in files and m != module}
    return graph


def _a_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle in GRAPH (its modules, the first repeated at the end), or []."""
    done: set[str] = set()

    def walk(module: str, path: list[str]) -> list[str]:
        if module in path:
            return [*path[path.index(module):], module]
        if module in done:
            return []
        for target in sorted(graph[module]):
            cycle = walk(target, [*path, module])
            if cycle:
                return cycle
        done.add(module)
        return []

    for module in sorted(graph):
        cycle = walk(module, [])
        if cycle:
            return cycle
    return []


def test_no_import_cycle_among_guardians_modules():
    assert _a_cycle(_module_graph()) == []


def test_the_rules_module_is_a_leaf():
    """Every rule module imports core/rules.py: it imports nothing of guardian but the vocabulary."""
    assert _module_graph()["guardian.core.rules"] <= {"guardian.core.vocab"}


def test_the_cycle_checker_sees_a_cycle(tmp_path):
    """Through a function-level import, as the rule tables once were (on a copy, never in the source tree)."""
    core = tmp_path / "guardian" / "core"
    core.mkdir(parents=True)
    (tmp_path / "guardian" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("")
    (core / "rules.py").write_text("from .vocab import Gate\n\ndef tables():\n    from . import gates\n")
    (core / "gates.py").write_text("from .rules import Rule\nif TYPE_CHECKING:\n    from .tick import Tick\n")
    (core / "tick.py").write_text("from . import gates\n")
    (core / "vocab.py").write_text("import enum\n")
    graph = _module_graph(tmp_path)
    assert graph["guardian.core.rules"] == {"guardian.core", "guardian.core.vocab", "guardian.core.gates"}
    assert graph["guardian.core.gates"] == {"guardian.core.rules"}  # not tick: for the type checker alone
    assert _a_cycle(graph) == ["guardian.core.gates", "guardian.core.rules", "guardian.core.gates"]


def test_every_rule_id_is_unique_and_well_formed():
    """Over every rule table, found by construction (harness.RULE_TABLES): a journal's GUARDIAN_RULE
    leads to exactly one row."""
    ids = [r.id for rules in RULE_TABLES.values() for r in rules]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    assert not repeated, f"rule ids in more than one row: {repeated}"
    malformed = [i for i in ids if not RULE_ID.fullmatch(i)]
    assert not malformed, f"rule ids not a letter and one or two digits: {malformed}"
    assert len(RULE_TABLES) == len(tables()) and len(ids) > 100  # every table found is rendered


def test_the_rule_tables_in_docs_are_the_codes_rows():
    text = RULES_DOC.read_text()
    assert render_into(text) == text, "docs/rules.md rule tables are stale: run scripts/render-rules"
    for name, table in tables().items():
        assert f"<!-- rules:{name} -->\n{table}\n<!-- /rules:{name} -->" in text


def test_every_liveness_rule_is_reachable_in_the_table_tests():
    """Each L-rule id is produced by at least one pure test row (tests/test_liveness.py asserts them)."""
    used = set(re.findall(r'"(L\d+)"', (Path(__file__).parent / "test_liveness.py").read_text()))
    assert {r.id for r in liveness.RULES} <= used


# --- rule ids come from their rows ---------------------------------------------------------------
# An id is text in exactly one place: the Rule(...) of its row. Everywhere else the code names the
# Rule (``drain.NO_PEER.id``), so a journal's GUARDIAN_RULE leads to one row, and a renumbering is
# one edit. Text inside a Rule(...) or Row(...) (a condition, a row's own evidence) is the table.

RULE_ID = re.compile(r"[A-Z]\d{1,2}")
ID_IN_TEXT = re.compile(r"(?<![\w.])(?!V1\b)[A-Z]\d{1,2}(?![\w.])")  # not "vLLM V1"
TABLE_CALLS = {"Rule", "Row"}


def _call_name(node: ast.Call) -> str | None:
    return getattr(node.func, "id", getattr(node.func, "attr", None))


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def rule_id_literals(source: str) -> list[tuple[int, str]]:
    """(line, text) of each string in SOURCE, outside a Rule(...) or Row(...) and not a docstring,
    that is a rule id or has one in its text."""
    tree = ast.parse(source)
    exempt = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _call_name(node) in TABLE_CALLS:
            exempt |= {id(inner) for inner in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in exempt:
            if RULE_ID.fullmatch(node.value) or ID_IN_TEXT.search(node.value):
                found.append((node.lineno, node.value))
    return found


def test_no_rule_id_is_written_outside_its_row():
    found = [
        f"{path.relative_to(PKG.parent)}:{line}: {text!r}"
        for path in sorted(PKG.rglob("*.py"))
        for line, text in rule_id_literals(path.read_text())
    ]
    assert found == [], "rule ids written outside their rows (name the Rule instead):\n" + "\n".join(found)


def test_the_rule_id_check_sees_a_literal_and_lets_a_row_be():
    assert rule_id_literals('x = LogLine(rule="D4")') == [(1, "D4")]
    assert rule_id_literals('x = f"given up ({why}) (D4)"') == [(1, ") (D4)")]
    assert rule_id_literals('R = Rule("D4", "abandoned", "see D5")') == []
    assert rule_id_literals('R = Row(Rule("D6", "x", "y"), lambda w: True, lambda w: f"{w} (D6)")') == []
    assert rule_id_literals('def f():\n    """D4 is said here."""\n    return GB10, "H200"') == []


def test_every_rule_is_in_its_own_familys_table():
    """Each Rule(...) the package builds is a row of a RULES table, and each table holds one family
    (its ids' letter; the liveness family has two tables, L and C (core/watchdog/liveness.py, canary.py), admission A, gates G)."""
    in_tables = {rule.id: name for name, rules in RULE_TABLES.items() for rule in rules}
    for name, rules in RULE_TABLES.items():
        letters = {rule.id[0] for rule in rules}
        assert len(letters) == 1, f"the {name} table mixes families {sorted(letters)}"
    built = set()
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and _call_name(node) == "Rule" and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    built.add(first.value)
    assert built and built <= set(in_tables), f"rules in no table: {sorted(built - set(in_tables))}"


def test_observers_bring_the_wiring_facts_and_the_core_judges_them():
    """observe/ reads a unit's wiring (core/observations.py UnitWiring); the judgement
    (core/memory/wiring.py wiring_problem, problem_of) is made in the core, from those values. From
    core/memory/wiring.py an observer takes only the parsers of what it read."""
    parsers = {"cmdline_fraction", "env_value", "parse_fraction", "VAR", "VAR_FORMS", "EnvFile"}  # EnvFile: a value
    for path in sorted((PKG / "observe").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith("core.wiring"):
                taken = {a.name for a in node.names}
                assert taken <= parsers, f"{path.name} takes {sorted(taken - parsers)} of core/memory/wiring.py"
    assert "wiring_problem" not in (PKG / "observe" / "memory.py").read_text()


def test_no_class_of_the_core_holds_a_room_of_its_own():
    """A class in core/ stays under 300 lines: the tick's steps live in the modules of their rules,
    not in methods of one Tick (which held 753 lines once)."""
    for path in _layer_files("core"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno - node.lineno < 300, f"{path.relative_to(PKG)}: class {node.name}"


def test_observers_change_no_unit():
    """observe/ reads; every restart, kill and stop guardian causes is in act/ (act/units.py). The
    bus's one job primitive (Systemd.run_job) stays with the connection, for act/, and so does the one
    road to the container helper (Systemd.run_helper: it starts guardian-container@VERB:REPLICA, which
    the inspector must start to read, and act/ to restart or kill a container)."""
    verbs = re.compile(r'"(TryRestartUnit|RestartUnit|KillUnit|StopUnit|ReloadUnit|StartUnit)"')
    for path in sorted((PKG / "observe").glob("*.py")):
        found = verbs.findall(path.read_text())
        assert found == (["StartUnit"] if path.name == "systemd.py" else []), f"{path.name}: {found}"
    text = (PKG / "observe" / "systemd.py").read_text()
    helper = text.split("async def run_helper(", 1)[1].split("\n    async def ", 1)[0]
    assert '"StartUnit", helper_unit(' in helper  # its one StartUnit: the container helper's unit
    assert not re.search(r"async def (restart|kill)\(", (PKG / "observe" / "systemd.py").read_text())
