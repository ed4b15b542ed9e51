"""The README's quick start, followed as written (issue 23): its blocks are read from the README
between ``<!-- quickstart -->`` and ``<!-- /quickstart -->`` and run in the test box, so a change of
the README that this test does not follow fails it.

The only text replaced is the package's path: the README installs the arm64 package for DGX OS,
the box is Debian 12 on this machine's architecture and installs the amd64 package it built. The
replicas are the test bed's simulated ones, given the names, units, ports and model the README's
config names (read from it), so nothing else needs changing. Steps the README leaves to the reader
(a day in dry run with a hang in it) are the test's own: a replica frozen in dry run, then thawed.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from systemd_box import wait_for
from world import Replica

pytestmark = pytest.mark.system

README = Path(__file__).resolve().parent.parent / "README.md"
# What each block of the quick start is, in order: the test runs them at these steps.
STEPS = ("install", "config", "check", "start", "dry-run", "live", "freeze", "watch")
KINDS = ("sh", "toml", "sh", "sh", "sh", "sh", "sh", "sh")
README_DEB = re.compile(r"\./guardian_[0-9.]+_arm64\.deb")
# The box has no sudo: root running `sudo X` runs X.
SUDO = "/usr/local/bin/sudo"


def quickstart_blocks(text: str) -> dict[str, str]:
    """The fenced blocks between the quick start's markers, by step."""
    m = re.search(r"<!-- quickstart -->\n(.*?)<!-- /quickstart -->", text, re.S)
    assert m, "the README has no <!-- quickstart --> ... <!-- /quickstart --> section"
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", m.group(1), re.S | re.M)
    kinds = tuple(kind for kind, _ in blocks)
    assert kinds == KINDS, f"the quick start's blocks are {kinds}, this test follows {KINDS}: update it with the README"
    return {step: body for step, (_, body) in zip(STEPS, blocks, strict=True)}


def test_the_quick_start_blocks_are_found_and_a_changed_readme_is_seen():
    blocks = quickstart_blocks(README.read_text())
    assert len(README_DEB.findall(blocks["install"])) == 1, blocks["install"]
    assert "dry_run = true" in blocks["config"] and "dry_run" in blocks["live"]
    one_more = README.read_text().replace("<!-- /quickstart -->", "```sh\ntrue\n```\n<!-- /quickstart -->")
    with pytest.raises(AssertionError, match="update it with the README"):
        quickstart_blocks(one_more)


def _run(world, step: str, script: str) -> str:
    r = world.box.run(["sh", "-ec", script], check=False, timeout=180, input="")
    out = r.stdout + r.stderr
    print(f"--- {step} (exit {r.returncode})\n{script}{out}")
    assert r.returncode == 0, f"the quick start's {step} step failed:\n{script}\n{out}"
    return out


def _replicas_of(config: str) -> list[Replica]:
    """The simulated replicas the README's config describes: its names, units, ports and model."""
    replicas = []
    for r in tomllib.loads(config)["replicas"]:
        port = int(re.fullmatch(r"http://127\.0\.0\.1:(\d+)", r["url"]).group(1))
        replica = Replica(r["name"], port, model=r["model"])
        assert replica.unit == r["unit"], f"the test bed names a replica's unit {replica.unit}, the README {r['unit']}"
        replicas.append(replica)
    return replicas


def test_the_readme_quick_start_installs_watches_in_dry_run_then_restarts_a_frozen_replica(world):
    box = world.box
    steps = quickstart_blocks(README.read_text())
    config_path = steps["config"].splitlines()[0].removeprefix("# ")
    assert config_path == "/etc/guardian/guardian.toml", steps["config"]
    world.replicas = _replicas_of(steps["config"])
    a, b = world.replicas
    world.setup(start_guardian=False)
    # A box that has never seen guardian (the fixtures installed it): purged, and sudo as the README uses it.
    box.run(["apt-get", "purge", "-y", "-q", "guardian"], timeout=120)
    shim = box.run(["sh", "-c", "command -v sudo"], check=False).returncode != 0
    if shim:
        box.write(SUDO, '#!/bin/sh\nexec "$@"\n', mode=0o755)
    try:
        deb = f"/opt/guardian/dist/{box.deb.name}"
        _run(world, "install", README_DEB.sub(deb, steps["install"]))
        assert box.prop("guardian.service", "ActiveState") == "active"
        box.write(config_path, steps["config"])

        out = _run(world, "check", steps["check"])
        assert re.search(rf"^replica a \({re.escape(a.url)}\): .*restartable$", out, re.M), out
        assert re.search(rf"^replica b \({re.escape(b.url)}\): .*restartable$", out, re.M), out
        assert out.rstrip().endswith("ok"), out

        _run(world, "start", steps["start"])
        world.wait_states({"a": "healthy", "b": "healthy"}, timeout_s=30)
        # Dry run: a frozen replica is found and named, and left alone.
        before = world.identities([a.unit, b.unit])
        world.kill(a.unit, "STOP")
        would = f"DRY-RUN: would restart {a.unit} now"
        wait_for(lambda: any(would in m for m in world.guardian_messages("GUARDIAN_DECISION=dry-run")), 40,
                 "the dry run's would-be restart")
        assert would in _run(world, "dry-run", steps["dry-run"])
        assert world.identities([a.unit, b.unit]) == before
        world.kill(a.unit, "CONT")
        world.wait_states({"a": "healthy", "b": "healthy"}, timeout_s=30)

        _run(world, "live", steps["live"])
        wait_for(lambda: world.status().get("dry_run") is False, 20, "guardian live after the reload")
        assert world.identities([a.unit, b.unit]) == before
        # Live: the README's frozen replica is restarted, alone, and serves again.
        _run(world, "freeze", steps["freeze"])
        wait_for(lambda: box.identity(a.unit)[1] != before[a.unit][1], 40, f"{a.unit} restarted (a new InvocationID)")
        world.wait_states({"a": "healthy", "b": "healthy"}, timeout_s=30)
        world.wait_serving(a)
        assert box.identity(b.unit) == before[b.unit]
        watched = _run(world, "watch", steps["watch"])
        assert f"restarting {a.unit}" in watched and "serving again" in watched, watched
        assert world.restarts_of(b) == []
    finally:
        if shim:
            box.run(["rm", "-f", SUDO], check=False)
        # As the other tests expect it: guardian installed from the box's package, stopped (the world
        # fixture stops it and removes the config).
        if box.run(["dpkg-query", "-W", "-f", "${Status}", "guardian"], check=False).stdout != "install ok installed":
            box.install_deb(box.deb)


def _dropin(text: str) -> tuple[str, str]:
    """The README's drop-in for an existing unit: its path and its text."""
    m = re.search(r"<!-- unit:dropin -->\n```ini\n(.*?)```\n<!-- /unit:dropin -->", text, re.S)
    assert m, "the README has no <!-- unit:dropin --> block"
    body = m.group(1)
    return body.splitlines()[0].removeprefix("# "), body


def test_the_readme_drop_in_wires_an_existing_unit_for_the_memory_guard(world):
    """An existing unit with Restart=on-failure and a literal fraction: the README's drop-in (vLLM's
    command swapped for the simulator's, as in the container tests) makes it restart always, read
    guardian's env file last and pass the fraction, as `guardian check` and the served fraction show."""
    box = world.box
    path, dropin = _dropin(README.read_text())
    assert path == "/etc/systemd/system/vllm-a.service.d/guardian.conf", path
    old = re.search(r"^ExecStart=/usr/bin/vllm serve (\S+) --port (\d+) (--gpu-memory-utilization \$\{GPU_MEMORY_UTILIZATION\})$",
                    dropin, re.M)
    assert old, f"the README's drop-in no longer has the ExecStart= this test swaps: update it\n{dropin}"
    a = Replica("a", int(old.group(2)), model=old.group(1), restart="on-failure", wired=False)
    world.replicas = [a, Replica("b", 8002, model=a.model)]
    world.memory = {"enabled": True}
    world.setup(start_guardian=False)
    try:
        before = box.run(["guardian", "check"], check=False).stdout
        assert "add Restart=always to vllm-a.service" in before and "replica a: NOT wired" in before, before
        sim = f"ExecStart=/usr/local/bin/vllm-sim serve --model {a.model} --port {a.port} {old.group(3)} --load-time-s 0.3"
        box.write(path, dropin.replace(old.group(0), sim))
        box.run(["mkdir", "-p", "/var/lib/guardian/replicas"])
        box.write("/var/lib/guardian/replicas/a.env", "GPU_MEMORY_UTILIZATION=0.55\n")
        box.daemon_reload()
        box.systemctl("restart", a.unit)
        world.wait_serving(a)
        assert box.prop(a.unit, "Restart") == "always"
        r = box.run(["guardian", "check"], check=False)
        print(r.stdout)
        assert r.returncode == 0 and "replica a: wired" in r.stdout, r.stdout
        assert re.search(r"^replica a \(.*gpu_memory_utilization 0\.55;", r.stdout, re.M), r.stdout
    finally:
        box.run(["rm", "-rf", str(Path(path).parent)], check=False)
