"""The polkit rule rendered from the config: exactly the configured units, exactly two verbs.

polkit itself evaluates it in the system tests (test_system_deb.py); these check what is written.
"""

from __future__ import annotations

import json
import os
import re

from guardian.cli import main
from guardian.config import load_config
from guardian.polkit import render

TWO = (
    '[[replicas]]\nname = "b"\nunit = "vllm-replica@b.service"\nurl = "http://127.0.0.1:8002"\nmodel = "m"\n'
    '[[replicas]]\nname = "a"\nunit = "llm-a.service"\nurl = "http://127.0.0.1:8001"\nmodel = "m"\n'
)


def _lists(rule: str) -> dict[str, list[str]]:
    return {m.group(1): json.loads(m.group(2)) for m in re.finditer(r"var (\w+) = (\[.*?\]);", rule)}


def test_the_rule_names_exactly_the_configured_units_and_three_verbs(tmp_path):
    path = tmp_path / "guardian.toml"
    path.write_text(TWO)
    rule = render(load_config(path), str(path))
    assert _lists(rule) == {"units": ["llm-a.service", "vllm-replica@b.service"], "verbs": ["try-restart", "restart", "kill"]}
    assert 'subject.user == "guardian"' in rule and '"org.freedesktop.systemd1.manage-units"' in rule
    assert "vllm-*" not in rule and "start\"" not in rule.replace("restart\"", "")


def test_no_replicas_allow_nothing(tmp_path):
    path = tmp_path / "guardian.toml"
    path.write_text("")
    assert _lists(render(load_config(path), str(path)))["units"] == []


def test_a_path_with_a_newline_stays_inside_the_comment(tmp_path):
    path = tmp_path / "guardian.toml"
    path.write_text(TWO)
    rule = render(load_config(path), "/etc/x\npolkit.addRule(evil)")
    code = [line for line in rule.splitlines() if not line.startswith("//")]
    assert sum("polkit.addRule(" in line for line in code) == 1 and code[0] == "polkit.addRule(function(action, subject) {"


def test_the_command_writes_the_rule_atomically_and_a_broken_config_leaves_it(tmp_path, capsys):
    path, out = tmp_path / "guardian.toml", tmp_path / "rules.d" / "50-guardian.rules"
    path.write_text(TWO)
    assert main(["--config", str(path), "polkit-rule", "--output", str(out)]) == 0
    first = out.read_text()
    assert _lists(first)["units"] == ["llm-a.service", "vllm-replica@b.service"]
    assert os.stat(out).st_mode & 0o777 == 0o644  # polkitd runs as its own user
    assert "llm-a.service, vllm-replica@b.service" in capsys.readouterr().out
    assert main(["--config", str(path), "polkit-rule", "--output", str(out)]) == 0
    assert "unchanged" in capsys.readouterr().out
    path.write_text(TWO + "bogus_key = 1\n")
    assert main(["--config", str(path), "polkit-rule", "--output", str(out)]) == 2
    assert "bogus_key" in capsys.readouterr().err
    assert out.read_text() == first
    assert [p.name for p in out.parent.iterdir()] == ["50-guardian.rules"]  # no temporary file left
