"""The man pages (issue 45): `man guardian` (8) and `man guardian.toml` (5), written from README.md by
packaging/manpages.py when the package is built. The package ships what the README makes; every key of
the README's Reference table is in guardian.toml(5) under its section; every subcommand of guardian's
parser is in guardian(8) with its options and exactly its exit statuses; a key or a command the README
gains and the page lacks is seen; the roff is well formed, and groff and man read it without a warning.
Pure: no container, no package build (tests/test_packaging.py looks into a built .deb)."""

from __future__ import annotations

import argparse
import gzip
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import guardian
from guardian.cli import EXIT_STATUS, build_parser

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "packaging"))
import build_deb  # noqa: E402
import manpages  # noqa: E402

README = (REPO / "README.md").read_text()
DATE = "2026-12-01"


def page8(readme: str = README) -> str:
    return manpages.guardian_8(readme, guardian.__version__, DATE)


def page5(readme: str = README) -> str:
    return manpages.guardian_toml_5(readme, guardian.__version__, DATE)


# --- read independently of the generator: the README's tables, the pages' entries -----------------------


def readme_keys(readme: str) -> dict[str, set[str]]:
    """The Reference table's keys by section title as the page names it ("top level", "[watchdog]",
    "[[replicas]]"), read straight from the Markdown rows."""
    part = readme.split("\n### Reference\n", 1)[1].split("\n## ", 1)[0]
    out: dict[str, set[str]] = {}
    for line in part.splitlines():
        if not line.startswith("| `"):
            continue
        names = re.findall(r"`([^`]+)`", line.split(" | ", 1)[0])
        where, _, first = names[0].rpartition(".")
        title = "top level" if not where else f"[[{where[:-2]}]]" if where.endswith("[]") else f"[{where}]"
        out.setdefault(title, set()).update([first, *names[1:]])
    return out


def page_keys(page: str) -> dict[str, set[str]]:
    """guardian.toml.5's keys by .SS section: the bold names of each .TP entry's tag line."""
    out: dict[str, set[str]] = {}
    keys = page.split("\n.SH KEYS\n", 1)[1].split("\n.SH ", 1)[0]
    for part in keys.split(".SS ")[1:]:
        title, body = part.split("\n", 1)
        assert title.strip('"') not in out, f"two sections {title}"
        tags = re.findall(r"^\.TP\n(.*)$", body, re.M)
        names = (n for tag in tags for n in re.findall(r"\\fB(.+?)\\fR", tag.split(" (")[0]))
        out[title.strip('"')] = {n.replace("\\-", "-") for n in names}
    return out


def missing_keys(readme: str, page: str) -> list[str]:
    have = page_keys(page)
    return sorted(f"{title} {k}" for title, keys in readme_keys(readme).items() for k in keys - have.get(title, set()))


def page_commands(page: str) -> dict[str, dict[str, object]]:
    """guardian.8's COMMANDS entries by subcommand ("" for `guardian --version`): the options named in
    their tag lines and the exit statuses their "Exit status:" lines list."""
    part = page.split("\n.SH COMMANDS\n", 1)[1].split("\n.SH ", 1)[0].split("\n.PP\n", 1)[0]
    out: dict[str, dict[str, object]] = {}
    for entry in part.split(".TP\n")[1:]:
        tag, body = entry.split("\n", 1)
        words = [w.replace("\\-", "-") for w in re.findall(r"\\fB(.+?)\\fR", tag)]
        assert words[0] == "guardian", tag
        name = words[1] if len(words) > 1 and not words[1].startswith("-") else ""
        said = " ".join(body.split()).split("Exit status: ", 1)
        listed = said[1].split(", ") if len(said) > 1 else []
        codes = {int(p.split()[0].rstrip(".")) for p in listed if p[:1].isdigit()}
        seen = out.setdefault(name, {"options": set(), "codes": set()})
        seen["options"] |= {w for w in words if w.startswith("-")}  # type: ignore[operator]
        seen["codes"] |= codes  # type: ignore[operator]
    return out


def parser_commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def options(parser: argparse.ArgumentParser) -> set[str]:
    """PARSER's own options: not --help, not the hidden ones (a subcommand's --config)."""
    return {s for a in parser._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
            for s in a.option_strings}


# --- the package ships what the README makes --------------------------------------------------------------


def test_the_package_ships_both_pages_gzipped_reproducibly_as_the_readme_makes_them():
    shipped = build_deb.man_pages(guardian.__version__)
    assert set(shipped) == {"usr/share/man/man8/guardian.8.gz", "usr/share/man/man5/guardian.toml.5.gz"}
    made = manpages.pages(README, guardian.__version__, build_deb.man_date())
    assert gzip.decompress(shipped["usr/share/man/man8/guardian.8.gz"]).decode() == made["guardian.8"]
    assert gzip.decompress(shipped["usr/share/man/man5/guardian.toml.5.gz"]).decode() == made["guardian.toml.5"]
    for data in shipped.values():  # gzip -9n: no name (FLG 0), no time (MTIME 0), best compression (XFL 2)
        assert data[:4] == b"\x1f\x8b\x08\x00" and data[4:8] == b"\0\0\0\0" and data[8] == 2
    assert build_deb.man_pages(guardian.__version__) == shipped
    # dated by the release, versioned by guardian.__version__
    date = build_deb.man_date()
    assert made["guardian.8"].startswith(f'.TH "GUARDIAN" 8 "{date}" "guardian {guardian.__version__}"')
    assert made["guardian.toml.5"].startswith(f'.TH "GUARDIAN.TOML" 5 "{build_deb.man_date()}"')


def test_the_generators_command_writes_the_same_pages(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "packaging/manpages.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    made = manpages.pages(README, guardian.__version__, build_deb.man_date())
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == made


# --- guardian.toml(5): every key -----------------------------------------------------------------------


def test_every_key_of_the_reference_table_is_in_guardian_toml_5_under_its_section():
    keys = readme_keys(README)
    assert list(keys) == ["top level", "[watchdog]", "[memory]", "[metrics]", "[proxy]", "[[replicas]]", "[fleet]"]
    assert sum(map(len, keys.values())) > 80 and {"cert_file", "key_file", "password_file"} <= keys["[fleet]"]
    page = page5()
    assert missing_keys(README, page) == []
    assert page_keys(page) == keys  # and no key the README does not have


def test_each_keys_default_unit_and_meaning_are_on_its_entry():
    page = page5()
    entry = page.split("\\fBstall_window_s\\fR", 1)[1].split("\n.TP\n", 1)[0]
    assert entry.startswith(" (default 60; unit: s)\n") and "\\fB\\-\\-max\\-num\\-batched\\-tokens\\fR" in entry
    assert "\\fBname\\fR (required)\n" in page
    assert "\\fBmin_headroom_bytes\\fR (default 8589934592 (8 GiB); unit: bytes)" in page
    assert "\\fBca_file\\fR, \\fBcert_file\\fR, \\fBkey_file\\fR (default unset; unit: path)" in page
    # the precedence and validation paragraph, and the quick start's file as the example
    assert "GUARDIAN_WATCHDOG__STALL_WINDOW_S=90" in page and "RestartPreventExitStatus=2" in page
    assert '.SH EXAMPLE\n' in page and 'unit = "vllm\\-a.service"' in page


def test_a_key_the_readme_gains_is_missed_by_the_old_page_and_written_by_the_generator():
    row = "| `fleet.ca_file`, `cert_file`, `key_file` |"
    assert README.count(row) == 1
    gained = README.replace(row, "| `watchdog.new_window_s` | 7 | s | a key only this test knows |\n" + row)
    assert missing_keys(gained, page5()) == ["[watchdog] new_window_s"]
    assert missing_keys(gained, page5(gained)) == []
    assert "\\fBnew_window_s\\fR (default 7; unit: s)\na key only this test knows." in page5(gained)
    # a new section, and a key dropped from the page
    gained = README.replace(row, "| `tls.mode` | off | | a section only this test knows |\n" + row)
    assert page_keys(page5(gained))["[tls]"] == {"mode"}
    assert missing_keys(README, page5().replace("\\fBdrop_caches\\fR", "\\fBdropped\\fR")) == ["[memory] drop_caches"]


# --- guardian(8): every subcommand, option and exit status -------------------------------------------------


def test_every_subcommand_is_in_guardian_8_with_its_options_and_exactly_its_exit_statuses():
    listed = page_commands(page8())
    parsers = parser_commands()
    assert set(listed) - {""} == set(parsers), "guardian.8's commands are not the parser's"
    for name, sub in parsers.items():
        assert listed[name]["codes"] == {int(c) for c in EXIT_STATUS[name]}, name
        assert options(sub) <= listed[name]["options"], name  # type: ignore[operator]
    assert listed[""]["options"] == {"--version"} and listed[""]["codes"] == {0}


def test_guardian_8_has_the_general_exit_statuses_the_global_options_and_the_files():
    page = page8()
    section = page.split("\n.SH EXIT STATUS\n", 1)[1].split("\n.SH ", 1)[0]
    assert set(map(int, re.findall(r"^\.B (\d+)$", section, re.M))) == {int(c) for c in EXIT_STATUS[""]}
    for option in options(build_parser()) | {"--help"}:
        assert f"\\fB{option.replace('-', chr(92) + '-')}\\fR" in page, option
    files = page.split("\n.SH FILES\n", 1)[1].split("\n.SH ", 1)[0]
    for path in ("/etc/guardian/guardian.toml", "/var/lib/guardian", "/run/guardian", "/etc/polkit-1/rules.d/"):
        assert path in files.replace("\\-", "-"), path
    assert "state.json.corrupt\\-<time>" in files
    assert re.search(r"^\.BR guardian\.toml \(5\)", page, re.M)
    assert re.search(r"^\.BR guardian \(8\)", page5(), re.M)


def test_a_command_the_readme_loses_or_an_exit_status_it_drops_is_seen():
    row = next(line for line in README.splitlines() if line.startswith("| `guardian container "))
    assert "container" not in page_commands(page8(README.replace(row + "\n", "")))
    changed = README.replace("| 0, 1 status unreadable, 3 not running or stale |", "| 0, 1 status unreadable |")
    assert page_commands(page8(changed))["status"]["codes"] == {0, 1} != {int(c) for c in EXIT_STATUS["status"]}


# --- well-formed roff -------------------------------------------------------------------------------------

MACROS = {".TH", ".SH", ".SS", ".PP", ".TP", ".IP", ".RS", ".RE", ".nf", ".fi", ".B", ".I", ".BR", ".br", ".ad", ".nh"}
ESCAPES = r"\\(?:-|e|&|f[BIR]|\([a-z]{2}|\[u[0-9A-F]{4}\])"


@pytest.mark.parametrize("name", ["guardian.8", "guardian.toml.5"])
def test_the_pages_are_well_formed_roff(name):
    page = manpages.pages(README, guardian.__version__, DATE)[name]
    lines = page.splitlines()
    title, section = name.rsplit(".", 1)
    assert re.fullmatch(rf'\.TH "{re.escape(title.upper())}" {section} "{DATE}" "guardian [^"]+" "[^"]+"', lines[0])
    heads = re.findall(r"^\.SH (.+)$", page, re.M)
    assert heads[:3] == ["NAME", "SYNOPSIS", "DESCRIPTION"] and heads[-1] == "SEE ALSO", heads
    assert re.fullmatch(rf"{re.escape(title)} \\- \S.+", lines[lines.index(".SH NAME") + 1])
    for n, line in enumerate(lines, 1):
        assert line.isascii(), (n, line)  # anything else as \[uXXXX]
        if line[:1] in (".", "'"):
            assert line.split()[0] in MACROS, (n, line)
        assert not re.search(r"\\(?!-|e|&|f[BIR]|\([a-z]{2}|\[u[0-9A-F]{4}\])", line), (n, line)
        text = re.sub(ESCAPES, "", line)
        # a '-' left bare is a hyphen between two letters; every other is \- (options, code, minus)
        if not text.startswith(".TH "):
            assert not re.search(r"(?<![A-Za-z])-|-(?![A-Za-z])", text), (n, line)
        assert "`" not in text and "**" not in text and "](" not in text, (n, line)  # no Markdown left
    assert page.count(".nf") == page.count(".fi") and page.count(".RS") == page.count(".RE")


def test_code_and_options_are_hyphen_minus_and_roff_specials_are_escaped():
    assert manpages.inline("`--no-drain` a try-restart of S1-S10") == (
        "\\fB\\-\\-no\\-drain\\fR a try-restart of S1\\-S10")
    assert manpages.inline("**`guardian restart`.** x") == "\\fB\\fBguardian restart\\fB.\\fR x"
    assert manpages.inline("[Engines](#engines), [docs/rules.md](docs/rules.md)") == (
        "\\fIEngines\\fR, \\fB/usr/share/doc/guardian/docs/rules.md\\fR")
    assert manpages.inline("`a\\b 'c'` 2^n ~ ·") == "\\fBa\\eb \\(aqc\\(aq\\fR 2\\(han \\(ti \\[u00B7]"
    assert manpages.fill(".a line that starts with a dot") == ["\\&.a line that starts with a dot"]
    assert manpages.fill("'quoted") == ["\\&'quoted"]


# --- what groff and man (as lintian runs it) make of them ---------------------------------------------------


@pytest.mark.parametrize("name", ["guardian.8", "guardian.toml.5"])
def test_groff_and_man_read_the_pages_without_a_warning(tmp_path, name):
    tools = [t for t in ("groff", "man") if shutil.which(t)]
    if not tools:
        pytest.skip("neither groff nor man is installed here: the roff is checked by the test above only")
    path = tmp_path / name
    path.write_text(manpages.pages(README, guardian.__version__, DATE)[name])
    env = {**os.environ, "LC_ALL": "C.UTF-8", "MANWIDTH": "80"}
    commands = {"groff": ["groff", "-man", "-Tutf8", "-ww", "-z", str(path)],
                # what lintian's manpage-has-errors-from-man runs
                "man": ["man", "--warnings", "-E", "UTF-8", "-l", "-Tutf8", "-Z", str(path)]}
    for tool in tools:
        r = subprocess.run(commands[tool], capture_output=True, text=True, env=env)
        assert r.returncode == 0 and r.stderr == "", (tool, r.stderr)
    if "groff" in tools:  # rendered, each key reads as written
        r = subprocess.run(["groff", "-man", "-Tutf8", "-rLL=300n", "-P-cbou", str(path)], capture_output=True,
                           text=True, env=env)
        if name == "guardian.toml.5":
            assert "stall_window_s (default 60; unit: s)" in r.stdout
        else:
            assert "guardian [--config FILE] restart NAME [--wait D] [--no-drain]" in r.stdout
