"""The .deb (issue 5): installed with apt in the Debian 12 container (every system test runs
guardian from it), unprivileged through polkit, upgrade / remove / purge the Debian way; and
the arm64 package for DGX OS, cross-built, inspected."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from systemd_box import build_deb, wait_for
from world import Replica

pytestmark = pytest.mark.system


def test_runs_as_user_guardian_and_restarts_through_polkit_only_what_the_rule_allows(world):
    outsider = Replica("c", 8003)
    world.replicas.append(outsider)
    world.setup(start_guardian=False)
    # a replica whose unit name is outside the polkit rule (vllm-*.service)
    world.box.systemctl("disable", "--now", outsider.unit)
    world.box.run(f"mv /usr/lib/systemd/system/{outsider.unit} /usr/lib/systemd/system/llm-c.service")
    world.box.daemon_reload()
    world.box.systemctl("enable", "--now", "llm-c.service")
    world.extra_units.append("llm-c.service")
    world.wait_serving(outsider)
    cfg = world.config_text().replace(f'unit = "{outsider.unit}"', 'unit = "llm-c.service"')
    world.write_config(cfg)
    world.start_guardian()
    pid = world.box.prop("guardian.service", "MainPID")
    assert world.box.run(["ps", "-o", "user=", "-p", pid]).stdout.strip() == "guardian"
    # inside the rule: a real restart, by the unprivileged user
    a = world.replicas[0]
    old = world.box.identity(a.unit)
    world.kill(a.unit, "STOP")
    wait_for(lambda: world.box.identity(a.unit) != old, 40, "vllm-a.service restarted through polkit")
    world.wait_states({"a": "healthy"}, timeout_s=30)
    # outside it: refused by polkit, and guardian says so
    old_c = world.box.identity("llm-c.service")
    world.kill("llm-c.service", "STOP")
    line = wait_for(lambda: next((e for e in world.guardian_lines("GUARDIAN_REPLICA=c", "GUARDIAN_DECISION=restart-failed")), None),
                    40, "the polkit refusal")
    assert line["PRIORITY"] == "3" and "llm-c.service" in line["MESSAGE"]
    assert re.search(r"InteractiveAuthorizationRequired|Interactive authentication required|AccessDenied", line["MESSAGE"])
    assert world.box.identity("llm-c.service") == old_c
    world.kill("llm-c.service", "CONT")


def test_units_verify_and_security_exposure(box):
    r = box.run(["systemd-analyze", "verify", "/lib/systemd/system/guardian.service",
                 "/usr/share/doc/guardian/examples/vllm-replica@.service"], check=False)
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr
    out = box.run(["systemd-analyze", "security", "--no-pager", "guardian.service"], check=False).stdout
    m = re.search(r"Overall exposure level for guardian.service: (\d+\.\d+)", out)
    assert m, out[-500:]
    print(f"systemd-analyze security guardian.service: {m.group(0)}")
    assert float(m.group(1)) <= 3.0, out  # README states the measured value


def test_upgrade_keeps_config_and_state_remove_stops_purge_cleans(world, tmp_path):
    box = world.box
    world.setup()
    edited = world.config_text() + "\n# edited by the operator\n"
    world.write_config(edited)
    box.systemctl("reload", "guardian.service")
    box.run(["guardian", "pause", "b", "--for", "1h"])
    state_before = json.loads(box.run(["cat", "/var/lib/guardian/state.json"]).stdout)
    pid = box.prop("guardian.service", "MainPID")
    newer = build_deb(tmp_path, version="0.1.1")
    box.install_deb(newer)
    assert "0.1.1" in box.run(["dpkg-query", "-W", "-f", "${Version}", "guardian"]).stdout
    assert box.run(["cat", "/etc/guardian/guardian.toml"]).stdout == edited
    # The pause is kept (its wall-clock end: in this container the sandboxed daemon sees the kernel's
    # boot id while a shell sees nspawn's own, so the daemon may drop the CLI's monotonic stamp as
    # "another boot's" and fall back to the wall time, as after a real reboot).
    after = json.loads(box.run(["cat", "/var/lib/guardian/state.json"]).stdout)["pauses"]
    assert {k: (p["until"]["wall"], p["reason"]) for k, p in after.items()} == \
        {k: (p["until"]["wall"], p["reason"]) for k, p in state_before["pauses"].items()}
    wait_for(lambda: box.prop("guardian.service", "ActiveState") == "active", 30, "guardian active after upgrade")
    assert box.prop("guardian.service", "MainPID") != pid  # restarted on upgrade
    world.wait_states({"a": "healthy", "b": "paused"}, timeout_s=30)

    box.run(["apt-get", "remove", "-y", "-q", "guardian"], timeout=120)
    assert box.prop("guardian.service", "ActiveState") == "inactive"
    assert box.run(["test", "-f", "/etc/guardian/guardian.toml"], check=False).returncode == 0
    assert box.run(["test", "-d", "/var/lib/guardian"], check=False).returncode == 0

    box.run(["apt-get", "purge", "-y", "-q", "guardian"], timeout=120)
    assert box.run(["test", "-e", "/var/lib/guardian"], check=False).returncode != 0
    assert box.run(["test", "-e", "/etc/guardian/guardian.toml"], check=False).returncode != 0
    # back to the package the other tests use
    box.install_deb(box.deb)
    box.systemctl("stop", "guardian.service")


ELF_MACHINE_AARCH64 = 183


def test_arm64_package_for_dgx_os(tmp_path):
    deb = build_deb(tmp_path, target="arm64-noble")
    info = subprocess.run(["dpkg-deb", "--info", str(deb)], capture_output=True, text=True, check=True).stdout
    assert re.search(r"^ Architecture: arm64$", info, re.M)
    depends = re.search(r"^ Depends: (.*)$", info, re.M).group(1)
    assert "python3 (>= 3.12)" in depends and "python3 (<< 3.13)" in depends
    contents = subprocess.run(["dpkg-deb", "--contents", str(deb)], capture_output=True, text=True, check=True).stdout
    for path in ("./usr/bin/guardian", "./usr/lib/systemd/system/guardian.service", "./etc/guardian/guardian.toml",
                 "./usr/share/polkit-1/rules.d/50-guardian.rules", "./usr/lib/guardian/pydantic_core/"):
        assert path in contents, path
    root = tmp_path / "x"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    shared = list((root / "usr/lib/guardian").rglob("*.so"))
    assert shared, "no binary wheel bundled?"
    for so in shared:
        head = so.read_bytes()[:20]
        assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == ELF_MACHINE_AARCH64, so
    binary_wheels = 0
    for wheel in (root / "usr/lib/guardian").glob("*.dist-info/WHEEL"):
        text = wheel.read_text()
        if "Root-Is-Purelib: false" in text:
            binary_wheels += 1
            tags = re.findall(r"^Tag: (.*)$", text, re.M)
            assert all(("cp312" in t or "abi3" in t) and "aarch64" in t for t in tags), (wheel, tags)
    assert binary_wheels >= 2  # pydantic-core and psutil


def test_lintian_reports_nothing_on_either_package(tmp_path, box):
    assert shutil.which("lintian"), "lintian is not installed (scripts/setup.sh installs it)"
    for deb in (box.deb, build_deb(tmp_path, target="arm64-noble")):
        r = subprocess.run(["lintian", "--fail-on", "error,warning", str(deb)], capture_output=True, text=True)
        tags = [line for line in r.stdout.splitlines() if re.match(r"^[EW]: ", line)]
        assert r.returncode == 0 and tags == [], (deb.name, r.stdout, r.stderr)
