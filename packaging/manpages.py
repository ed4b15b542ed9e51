#!/usr/bin/env python3
"""guardian's man pages, written in roff (man(7) macros) from README.md: the one source of the
commands, the exit statuses and the configuration keys.

    python3 packaging/manpages.py --out DIR     # writes DIR/guardian.8 and DIR/guardian.toml.5

- guardian.8: NAME and DESCRIPTION from the README's opening (up to its table of contents), each
  command and its exit statuses from "## Commands and exit codes" (its table of guardian's own
  commands, the table of statuses, the paragraphs after them), FILES from the Reference table's
  path keys and "### Files guardian writes".
- guardian.toml.5: DESCRIPTION from the paragraphs of "## Configuration" and "### Reference",
  every key of the Reference table (its default, its unit, its meaning) under its section (top
  level, [watchdog], ..., [[replicas]], [fleet]), and the quick start's example file.

Markdown inside the text: `code` and **bold** are bold, a link is its text (italic when it points
at a section of the README or of docs/; docs/X.md itself becomes its installed path). The version
and the date are given (packaging/build_deb.py: guardian.__version__ and its changelog entry's
date), so a build makes the same bytes every time. The standard library only: the package build
needs nothing else, and tests/test_manpages.py checks the pages against the README and the parser.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DOC = "/usr/share/doc/guardian"
CONFIG = "/etc/guardian/guardian.toml"

# Where each page is installed (build_deb.py gzips them there).
INSTALLED = {
    "guardian.8": "usr/share/man/man8/guardian.8.gz",
    "guardian.toml.5": "usr/share/man/man5/guardian.toml.5.gz",
}


# --- the README, read --------------------------------------------------------------------------------


def section(md: str, title: str) -> str:
    """The text under the heading TITLE ("## X" or "### X"), up to the next heading of its level or
    above. A missing heading is an error: the pages would silently lose a part."""
    m = re.search(rf"^(#+) {re.escape(title)}\n", md, re.M)
    if not m:
        raise ValueError(f"README.md has no heading {title!r}")
    level = len(m.group(1))
    rest = md[m.end() :]
    end = re.search(rf"^#{{1,{level}}} ", _blank_code(rest), re.M)
    return rest[: end.start()] if end else rest


def _blank_code(md: str) -> str:
    """MD with the lines inside ``` blocks blanked out (same length), so that a '# comment' in a code
    block is not taken for a heading."""
    return re.sub(r"^```.*?^```", lambda m: re.sub(r"[^\n]", " ", m.group(0)), md, flags=re.M | re.S)


def blocks(md: str) -> list[tuple[str, object]]:
    """MD's blocks, in order: ("para", text), ("item", (marker, text)), ("table", rows), ("code", lines)."""
    out: list[tuple[str, object]] = []
    lines = md.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            j = lines.index("```", i + 1) if "```" in lines[i + 1 :] else len(lines)
            out.append(("code", lines[i + 1 : j]))
            i = j + 1
        elif line.startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            out.append(("table", table_rows(lines[i:j])))
            i = j
        elif not line.strip() or line.startswith("#"):
            i += 1
        else:
            j = i + 1
            while j < len(lines) and lines[j].strip() and not re.match(r"(```|\||#|- |\d+\. )", lines[j]):
                j += 1
            text = " ".join(x.strip() for x in lines[i:j])
            item = re.match(r"(- |\d+\. )(.*)", text)
            out.append(("item", (item.group(1).strip(), item.group(2))) if item else ("para", text))
            i = j
    return out


def table_rows(lines: list[str]) -> list[list[str]]:
    """A Markdown table's body rows (no header, no rule), each a list of cells; `\\|` is a '|'."""
    rows = [[c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]] for line in lines]
    return [r for r in rows[1:] if not all(re.fullmatch(r":?-+:?", c) for c in r)]


def first_table(md: str) -> list[list[str]]:
    for kind, value in blocks(md):
        if kind == "table":
            return value
    raise ValueError("no table")


def reference_keys(readme: str) -> list[tuple[str, list[str], list[str]]]:
    """The Reference table's rows as (section, key names, [default, unit, meaning]). A row such as
    `fleet.ca_file`, `cert_file`, `key_file` names three keys of [fleet]. Section "" is the top level,
    "replicas[]" the [[replicas]] tables."""
    out = []
    for row in first_table(section(readme, "Reference")):
        names = re.findall(r"`([^`]+)`", row[0])
        if not names or len(row) != 4:
            raise ValueError(f"Reference: not a row of a key: {row}")
        where, _, first = names[0].rpartition(".")
        out.append((where, [first, *names[1:]], row[1:]))
    return out


def commands(readme: str) -> list[list[str]]:
    """The table of guardian's own commands: [command, what it does, exit status] rows."""
    part = section(readme, "Commands and exit codes")
    return first_table(part[part.index("guardian's own commands") :])


def exit_statuses(readme: str) -> list[list[str]]:
    """The table of statuses: [status, meaning] rows."""
    part = section(readme, "Commands and exit codes")
    return first_table(part[part.index("| status | meaning |") :])


# --- roff --------------------------------------------------------------------------------------------


def esc(text: str, code: bool = False) -> str:
    """TEXT escaped for roff. In code every '-' is a hyphen-minus (\\-) and "'" an apostrophe; in
    prose a '-' between two letters is a hyphen (try-restart), any other a minus."""
    text = text.replace("\\", "\\e")
    if code:
        text = text.replace("-", "\\-").replace("'", "\\(aq")
    else:
        text = re.sub(r"(?<![A-Za-z])-|-(?![A-Za-z])", r"\\-", text)
    text = text.replace("^", "\\(ha").replace("~", "\\(ti").replace("`", "\\(ga")
    return "".join(c if ord(c) < 128 else f"\\[u{ord(c):04X}]" for c in text)


def inline(md: str) -> str:
    """A line of Markdown in roff: `code` and **bold** bold, [text](target) its text."""
    md = re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", _link, md)
    out, bold, italic = [], False, False
    for tok in re.split(r"(`[^`]+`|\*\*|\x01|\x02)", md):
        if tok == "**":
            bold = not bold
            out.append("\\fB" if bold else ("\\fI" if italic else "\\fR"))
        elif tok in ("\x01", "\x02"):
            italic = tok == "\x01"
            out.append("\\fB" if bold else ("\\fI" if italic else "\\fR"))
        elif len(tok) > 2 and tok[0] == tok[-1] == "`":
            out.append("\\fB" + esc(tok[1:-1], code=True) + ("\\fB" if bold else ("\\fI" if italic else "\\fR")))
        else:
            out.append(esc(tok))
    return "".join(out)


def _link(m: re.Match[str]) -> str:
    text, target = m.group(1), m.group(2)
    if re.fullmatch(r"docs/[\w.-]+\.md", target) and text.strip("`") == target:
        return f"`{DOC}/{target}`"  # the page itself: where the package installs it
    if target.startswith("#") or target.startswith("docs/"):
        return f"\x01{text}\x02"  # a section of the README or of docs/: italic
    return text


def fill(roff: str) -> list[str]:
    """A paragraph's roff text as input lines (a line must not start with '.' or "'")."""
    lines = textwrap.wrap(roff, 100, break_long_words=False, break_on_hyphens=False)
    return ["\\&" + x if x[:1] in (".", "'") else x for x in lines]


def arg(text: str) -> str:
    """A macro's argument, quoted."""
    return '"' + text.replace('"', "\\(dq") + '"'


def render(md: str) -> list[str]:
    """Markdown blocks as roff: paragraphs, list items, code blocks (tables are the callers')."""
    out: list[str] = []
    for kind, value in blocks(md):
        if kind == "para":
            out += [".PP", *fill(inline(value))]
        elif kind == "item":
            marker, text = value
            out += [".IP \\(bu 2" if marker == "-" else f".IP {marker} 4", *fill(inline(text))]
        elif kind == "code":
            out += [
                ".PP",
                ".RS 4",
                ".nf",
                *(("\\&" if x[:1] in (".", "'") else "") + esc(x, code=True) for x in value),
                ".fi",
                ".RE",
            ]
        else:
            raise ValueError(f"a table where the page takes prose: {value}")
    return out


def synopsis_form(cmd: str) -> str:
    """A command cell (`guardian check [--no-systemd] [--json]`) as roff: words bold, placeholders
    (NAME, D, VERB:REPLICA) italic, brackets and bars plain."""
    words = []
    for word in re.findall(r"[\[\]|]|[^\s\[\]|]+", cmd.strip("`")):
        if word in "[]|":
            words.append(word)
        elif re.fullmatch(r"[A-Z][A-Z:_]*", word):
            words.append(f"\\fI{esc(word, code=True)}\\fR")
        else:
            words.append(f"\\fB{esc(word, code=True)}\\fR")
    return re.sub(r"(\[) | (\])", r"\1\2", " ".join(words))


def th(name: str, sec: int, version: str, date: str, manual: str) -> list[str]:
    """The title line, then text left-aligned and never hyphenated: long paths would stretch justified
    lines, and a name or an option broken by a hyphen would read as another."""
    return [f".TH {arg(name.upper())} {sec} {arg(date)} {arg('guardian ' + version)} {arg(manual)}", ".ad l", ".nh"]


def sentence(md: str) -> str:
    """A table cell as a sentence: with a full stop at its end."""
    return md if md.endswith((".", ":", "?", "!")) else md + "."


def intro(readme: str) -> tuple[str, str]:
    """(what guardian does in a line, for NAME; the README's opening, up to its table of contents)."""
    opening = readme.split("\n", 1)[1].split("\nContents:", 1)[0]
    m = re.match(r"\s*guardian (keeps [^:.]+)", opening)
    if not m:
        raise ValueError("README.md does not open with 'guardian keeps ...'")
    return " ".join(m.group(1).split()), opening


# --- the pages ---------------------------------------------------------------------------------------


def guardian_8(readme: str, version: str, date: str) -> str:
    what, opening = intro(readme)
    cmds = commands(readme)
    part = section(readme, "Commands and exit codes")
    after = part[part.index("| status | meaning |") :].split("\n\n", 1)[1]
    out = th("guardian", 8, version, date, "System Administration")
    out += [".SH NAME", f"guardian \\- {esc(what)}", ".SH SYNOPSIS"]
    for i, (cmd, _, _) in enumerate(cmds):
        form = synopsis_form(cmd)
        if form.startswith("\\fBguardian\\fR \\fB") and not form.startswith("\\fBguardian\\fR \\fB\\-"):
            form = form.replace("\\fBguardian\\fR", "\\fBguardian\\fR [\\fB\\-\\-config\\fR \\fIFILE\\fR]", 1)
        out += ([".br"] if i else []) + [form]
    out += [".SH DESCRIPTION", *render(opening)[1:]]
    out += [
        ".SH OPTIONS",
        ".TP",
        "\\fB\\-\\-config\\fR \\fIFILE\\fR",
        "the configuration file; without it, the file \\fB$GUARDIAN_CONFIG\\fR names, and without that",
        f"\\fB{esc(CONFIG, True)}\\fR. Every key is in",
        ".BR guardian.toml (5).",
        ".TP",
        "\\fB\\-\\-help\\fR",
        "the commands and the table of exit statuses; after a command, what the command does and what each "
        "status means for it.",
        ".SH COMMANDS",
    ]
    for cmd, does, statuses in cmds:
        out += [".TP", synopsis_form(cmd)]
        if does:
            out += fill(inline(sentence(does)))
        if statuses:
            out += [".IP", *fill("Exit status: " + inline(sentence(statuses)))]
    out += render(after)
    statuses_part = part[part.index("`guardian --help` prints") : part.index("| status | meaning |")]
    out += [".SH EXIT STATUS", *render(statuses_part)[1:]]
    for code, meaning in exit_statuses(readme):
        out += [".TP", f".B {esc(code)}", *fill(inline(sentence(meaning)))]
    out += [".SH FILES", ".TP", f".I {esc(CONFIG, True)}", "the configuration:", ".BR guardian.toml (5)."]
    for where, names, (default, _, meaning) in reference_keys(readme):
        if where == "" and default.startswith("/"):
            out += [".TP", f".I {esc(default, True)}", f"(\\fB{esc(names[0], True)}\\fR) " + inline(sentence(meaning))]
    out += [".PP", *render(section(readme, "Files guardian writes"))[1:]]
    out += see_also("guardian.toml", 5)
    return "\n".join(out) + "\n"


def guardian_toml_5(readme: str, version: str, date: str) -> str:
    what, _ = intro(readme)
    out = th("guardian.toml", 5, version, date, "File Formats")
    out += [
        ".SH NAME",
        f"guardian.toml \\- the configuration of guardian, which {esc(what)}",
        ".SH SYNOPSIS",
        f".I {esc(CONFIG, True)}",
        ".SH DESCRIPTION",
    ]
    conf = section(readme, "Configuration")
    out += render(conf[: conf.index("\n### ")])[1:]
    out += render(section(readme, "Reference").split("\n|", 1)[0])
    out += [".SH KEYS"]
    sections: dict[str, list[tuple[list[str], list[str]]]] = {}  # in the order the table first names them
    for where, names, cells in reference_keys(readme):
        sections.setdefault(where, []).append((names, cells))
    for where, keys in sections.items():
        title = "top level" if not where else (f"[[{where[:-2]}]]" if where.endswith("[]") else f"[{where}]")
        out += [f".SS {arg(title)}"]
        for names, (default, unit, meaning) in keys:
            head = ", ".join(f"\\fB{esc(n, True)}\\fR" for n in names)
            said = [inline(default) if default == "required" else f"default {inline(default)}"] if default else []
            said += [f"unit: {inline(unit)}"] if unit else []
            out += [".TP", head + (f" ({'; '.join(said)})" if said else ""), *fill(inline(sentence(meaning)))]
    example = re.search(rf"^```toml\n# {re.escape(CONFIG)}\n.*?^```", readme, re.M | re.S)
    if example:
        out += [".SH EXAMPLE", *render(example.group(0))]
    out += see_also("guardian", 8)
    return "\n".join(out) + "\n"


def see_also(page: str, sec: int) -> list[str]:
    return [
        ".SH SEE ALSO",
        f".BR {page} ({sec}),",
        ".BR systemctl (1),",
        ".BR journalctl (1)",
        ".PP",
        *fill(
            f"\\fB{esc(DOC, True)}/README.md\\fR, from which this page is made, and "
            f"\\fB{esc(DOC, True)}/docs/rules.md\\fR, every rule by its id. Names in italics are sections of "
            "those files."
        ),
    ]


def pages(readme: str, version: str, date: str) -> dict[str, str]:
    """{file name: roff text} of both pages."""
    return {"guardian.8": guardian_8(readme, version, date), "guardian.toml.5": guardian_toml_5(readme, version, date)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the directory to write guardian.8 and guardian.toml.5 in")
    args = p.parse_args(argv)
    sys.path.insert(0, str(HERE))
    from build_deb import man_date, version  # the package's version and date, checked as the build checks them

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in pages((REPO / "README.md").read_text(), version(), man_date()).items():
        (out / name).write_text(text)
        print(out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
