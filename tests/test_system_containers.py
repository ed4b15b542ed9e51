"""Replicas in containers, with real dockerd and podman in the booted box (tests/engines.py) and
guardian installed from its .deb: the units the README shows are taken from the README itself
(the image and `vllm serve` swapped for the simulator's, `--gpus`/`--device` dropped: no GPU)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from engines import IMAGE, _run_opts, docker_unit, install_unit, podman_unit, run_unitless, wait_serving
from systemd_box import wait_for
from world import FAST_WATCHDOG, World, toml_value

pytestmark = pytest.mark.system

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
MODEL = "Qwen/Qwen2.5-7B-Instruct"
SIM = f"{IMAGE} python3 -m vllm_sim serve --model {MODEL} --host 0.0.0.0 --port 8000 --load-time-s 0.3"


def readme_block(marker: str) -> str:
    m = re.search(rf"<!-- unit:{marker} -->\n```[a-z]*\n(.*?)```\n<!-- /unit:{marker} -->", README, re.S)
    assert m, f"the README has no <!-- unit:{marker} --> block"
    return m.group(1)


def swap(text: str, old: str, new: str) -> str:
    assert old in text, f"the README's unit no longer has {old!r}: update this test with it"
    return text.replace(old, new)


def for_the_box(text: str, gpu: str) -> str:
    """The README's line as the box can run it: no GPU, the simulator for vLLM."""
    text = swap(text, gpu + " ", _run_opts() + " ")
    return swap(text, f"nvcr.io/nvidia/vllm:25.09-py3 vllm serve {MODEL}", SIM)


def readme_docker_unit() -> str:
    return "# written by tests/engines.py\n" + for_the_box(readme_block("docker"), "--gpus all --ipc=host")


def readme_podman_unit() -> str:
    return "# written by tests/engines.py\n" + for_the_box(readme_block("podman"), "--device nvidia.com/gpu=all")


def readme_unitless_command() -> str:
    return for_the_box(readme_block("unitless").strip(), "--gpus all --ipc=host")


# Each shape: (replica as configured, how to start it, engine, container name, port).
def _docker_p(box):
    box.write("/usr/lib/systemd/system/vllm-a.service", readme_docker_unit())
    box.daemon_reload()
    box.systemctl("enable", "--now", "vllm-a.service")
    return {"name": "a", "unit": "vllm-a.service", "container": "vllm-a"}, "docker", "vllm-a", 8001


def _docker_host(box):
    install_unit(box, "ha", docker_unit("ha", 8011, model=MODEL, host_network=True))
    box.systemctl("enable", "--now", "vllm-ha.service")
    return {"name": "ha", "unit": "vllm-ha.service", "container": "ha"}, "docker", "ha", 8011


def _podman(box):
    box.write("/usr/lib/systemd/system/vllm-p.service", readme_podman_unit())
    box.daemon_reload()
    box.systemctl("enable", "--now", "vllm-p.service")
    return {"name": "p", "unit": "vllm-p.service", "container": "vllm-p", "engine": "podman"}, "podman", "vllm-p", 8003


def _unitless(box):
    box.run(readme_unitless_command(), timeout=60)
    return {"name": "c", "container": "vllm-c"}, "docker", "vllm-c", 8004


SHAPES = {"docker-p": _docker_p, "docker-host": _docker_host, "podman": _podman, "unitless": _unitless}


def config_text(replicas: list[dict], memory: dict | None = None) -> str:
    lines = ["interval_s = 0.5", "[watchdog]"] + [f"{k} = {toml_value(v)}" for k, v in FAST_WATCHDOG.items()]
    if memory:
        lines += ["[memory]"] + [f"{k} = {toml_value(v)}" for k, v in memory.items()]
    for r in replicas:
        lines.append("[[replicas]]")
        lines += [f"{k} = {toml_value(v)}" for k, v in r.items()]
        lines += ["startup_grace_s = 20", "health_timeout_s = 1.0", "metrics_timeout_s = 1.0", "canary_timeout_s = 2.0"]
    return "\n".join(lines) + "\n"


@pytest.fixture
def cw(box, engines):
    w = World(box, replicas=[], bystanders=())
    w.since = time.time()
    yield w
    w.teardown()
    from engines import cleanup

    cleanup(box)
    box.run(["rm", "-f", "/run/gone.txt"], check=False)


def start(w: World, replicas: list[dict], memory: dict | None = None, state: str = "healthy") -> None:
    w.box.write("/etc/guardian/guardian.toml", config_text(replicas, memory))
    w.box.systemctl("restart", "guardian.service")
    w.wait_states({r["name"]: state for r in replicas}, timeout_s=40)


def url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def containers_named(w: World, engine: str, name: str) -> list[str]:
    out = w.box.run([engine, "ps", "-a", "--filter", f"name=^{name}$", "--format", "{{.ID}} {{.Status}}"]).stdout
    return [line for line in out.splitlines() if line.strip()]


def restarts(w: World, replica: str) -> list[dict]:
    return w.guardian_lines(f"GUARDIAN_REPLICA={replica}", "GUARDIAN_DECISION=restart")


def watch_gone(w: World, pid: int) -> None:
    """A process in the box that writes the wall time at which PID is gone (polled every 20 ms)."""
    script = (f"import os,time\nwhile os.path.exists('/proc/{pid}'): time.sleep(0.02)\n"
              "open('/run/gone.txt','w').write(repr(time.time()))\n")
    w.box.run(["systemd-run", "--unit=gonewatch", "--collect", "/usr/bin/python3", "-c", script])


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_frozen_container_replica_is_restarted_alone_and_serves_again(cw, engines, shape):
    replica, engine, name, port = SHAPES[shape](cw.box)
    wait_serving(cw.box, port)
    replica = {**replica, "url": url(port), "model": MODEL}
    start(cw, [replica])
    old = engines.sim_pid(engine, name)
    assert old > 0
    watch_gone(cw, old)
    cw.box.run(["kill", "-STOP", str(old)])
    decision = wait_for(lambda: next(iter(restarts(cw, replica["name"])), None), 40, f"guardian's restart of {shape}")
    decided_at = int(decision["__REALTIME_TIMESTAMP"]) / 1e6
    gone_at = float(wait_for(lambda: cw.box.run(["cat", "/run/gone.txt"], check=False).stdout.strip(), 20,
                             "the frozen process to be gone"))
    print(f"{shape}: the frozen process was gone {gone_at - decided_at:.2f} s after the decision")
    # guardian killed it (hung), not after a graceful stop that a frozen process never ends
    assert "its processes killed if its stop lasts" in decision["MESSAGE"], decision["MESSAGE"]
    assert gone_at > decided_at
    wait_for(lambda: engines.sim_pid(engine, name) not in (0, old), 40, "a new container process")
    wait_serving(cw.box, port, timeout_s=40)
    cw.wait_states({replica["name"]: "healthy"}, timeout_s=40)
    assert len(containers_named(cw, engine, name)) == 1, containers_named(cw, engine, name)
    assert len(restarts(cw, replica["name"])) == 1
    if "unit" in replica:
        # The new container was never hit by the kill meant for the old one (it would have died,
        # and systemd's own Restart= would have counted it).
        assert cw.box.prop(replica["unit"], "NRestarts") == "0"
    lines = cw.guardian_messages(f"GUARDIAN_REPLICA={replica['name']}")
    assert any("restarted" in m or "restart job" in m for m in lines), lines


STRAYS = {
    # (the replica's engine, how the stray is run, what the refusal says the holder is)
    "docker-p": ("docker", "docker run -d --name stray -p 8021:8000 {opts} {sim}", "docker-proxy"),
    "docker-host": ("docker", "docker run -d --name stray --network host {opts} {hostsim}", "its scope docker-"),
    # started from an operator's shell (a session scope; here a scope of its own): conmon holds the port there
    "podman": ("podman", "systemd-run --scope --unit=operator-shell podman run -d --name stray -p 8021:8000 {opts} {sim}",
               "Podman's conmon"),
    # the other engine's container in front of a Podman replica: named from Docker's part of the report
    "podman-docker": ("podman", "docker run -d --name stray -p 8021:8000 {opts} {sim}", "a docker container"),
}


@pytest.mark.parametrize("shape", list(STRAYS))
def test_a_stray_container_on_the_replicas_port_is_refused_by_name(cw, engines, shape):
    engine, run, via = STRAYS[shape]
    # The replica's own unit serves on 8020; the config points it at 8021, where a stray serves.
    unit = (docker_unit("sa", 8020, model=MODEL) if engine == "docker" else podman_unit("sa", 8020, model=MODEL))
    install_unit(cw.box, "sa", unit)
    cw.box.systemctl("enable", "--now", "vllm-sa.service")
    hostsim = SIM.replace("--host 0.0.0.0 --port 8000", "--host 127.0.0.1 --port 8021")
    cw.box.run(run.format(opts=_run_opts(), sim=SIM, hostsim=hostsim), timeout=60)
    wait_serving(cw.box, 8021)
    wait_serving(cw.box, 8020)
    replica = {"name": "sa", "unit": "vllm-sa.service", "container": "sa", "url": url(8021), "model": MODEL}
    if engine == "podman":
        replica["engine"] = "podman"
    # The stray answers with the right model, but its answers are not the replica's (L4).
    start(cw, [replica], state="port-taken")
    said = cw.guardian_lines("GUARDIAN_REPLICA=sa", "GUARDIAN_STATE=port-taken")
    assert said and said[0]["PRIORITY"] == "3" and "held by container stray" in said[0]["MESSAGE"], said
    assert said[0]["GUARDIAN_RULE"] == "L4" and via in said[0]["MESSAGE"], said[0]
    out = cw.box.run(["guardian", "check"], check=False).stdout
    line = next((x for x in out.splitlines() if x.startswith("replica sa (")), "")
    assert "could NOT restart it" in line and "held by container stray" in line and via in line, out
    r = cw.box.run(["guardian", "restart", "sa", "--wait", "30s"], check=False)
    assert r.returncode != 0 and "container stray" in r.stdout + r.stderr, r.stdout + r.stderr
    stray_engine = "docker" if run.startswith("docker ") else "podman"
    assert len(containers_named(cw, stray_engine, "stray")) == 1  # nothing was done to it


def test_a_stray_on_the_port_of_a_crash_looping_unit_is_never_taken_for_the_replica(cw, engines):
    """The README's Docker unit stopped, a stray container started on its port, the unit started
    again: its container cannot bind, so it fails and systemd starts it again every 10 s. guardian
    says port-taken, naming the stray, and never healthy from the stray's answers (issue 34 row 13)."""
    replica, engine, name, port = _docker_p(cw.box)
    wait_serving(cw.box, port)
    replica = {**replica, "url": url(port), "model": MODEL}
    start(cw, [replica])
    cw.box.systemctl("stop", replica["unit"])
    cw.wait_states({"a": "stopped"}, timeout_s=30)
    cw.box.run(f"docker run -d --name stray -p {port}:8000 {_run_opts()} {SIM}", timeout=60)
    wait_serving(cw.box, port)
    cw.box.systemctl("start", replica["unit"])
    cw.wait_states({"a": "port-taken"}, timeout_s=40)
    # Two of the unit's failed starts (RestartSec=10s), each with the stray answering throughout.
    failed = lambda: int(cw.box.prop(replica["unit"], "NRestarts"))  # noqa: E731
    wait_for(lambda: failed() >= 2, 60, "two of the unit's own restarts")
    lines = cw.guardian_lines("GUARDIAN_REPLICA=a", "GUARDIAN_DECISION=state")
    stray_era = lines[next(i for i, e in enumerate(lines) if e.get("GUARDIAN_STATE") == "stopped"):]
    assert not any(e.get("GUARDIAN_STATE") == "healthy" for e in stray_era), [e["MESSAGE"] for e in stray_era]
    taken = [e for e in stray_era if e.get("GUARDIAN_STATE") == "port-taken"]
    assert taken and all("held by container stray" in e["MESSAGE"] for e in taken), [e["MESSAGE"] for e in taken]
    assert restarts(cw, "a") == []
    assert len(containers_named(cw, engine, "stray")) == 1


def ticks(w: World) -> int:
    return int(w.status().get("ticks", {}).get("count", 0) or 0)


@pytest.mark.parametrize("shape", ["docker-p", "unitless"])
def test_a_container_replica_stopped_on_purpose_is_left_alone(cw, engines, shape):
    replica, engine, name, port = SHAPES[shape](cw.box)
    wait_serving(cw.box, port)
    replica = {**replica, "url": url(port), "model": MODEL}
    start(cw, [replica])
    if shape == "unitless":
        cw.box.run(["docker", "stop", name], timeout=60)
    else:
        cw.box.systemctl("stop", replica["unit"])
    cw.wait_states({replica["name"]: "stopped"}, timeout_s=30)
    # Ten more ticks (5 s) of guardian looking at it stopped.
    seen = ticks(cw)
    wait_for(lambda: ticks(cw) >= seen + 10, 30, "ten more ticks of guardian")
    assert cw.states()[replica["name"]] == "stopped"
    assert restarts(cw, replica["name"]) == []
    assert engines.sim_pid(engine, name) == 0
    if shape == "unitless":
        status = cw.box.run(["docker", "inspect", "--format", "{{.State.Status}}", name]).stdout.strip()
        assert status == "exited"


def test_a_memory_lowering_reaches_the_container_and_is_confirmed(cw, engines):
    for n, port in (("ma", 8031), ("mb", 8032)):
        install_unit(cw.box, n, docker_unit(n, port, model=MODEL, fraction=0.78))
        cw.box.systemctl("enable", "--now", f"vllm-{n}.service")
        wait_serving(cw.box, port)
    from guardian.observe.meminfo import sample_memory

    avail = sample_memory().available_bytes
    memory = dict(enabled=True, sustain_s=1, cooldown_s=600, step=0.04, floor=0.5, reserve_bytes=0,
                  device_total_bytes=2**30, priority=["ma"], min_headroom_bytes=avail + 64 * 2**30,
                  critical_headroom_bytes=0)
    replicas = [{"name": n, "unit": f"vllm-{n}.service", "container": n, "url": url(p), "model": MODEL}
                for n, p in (("ma", 8031), ("mb", 8032))]
    start(cw, replicas, memory)
    done = wait_for(lambda: next((m for m in cw.guardian_messages("GUARDIAN_REPLICA=ma")
                                  if "serving again with gpu_memory_utilization 0.74" in m), None), 60,
                    "the lowering of ma to be confirmed")
    assert "0.74" in done
    args = json.loads(cw.box.run(["docker", "inspect", "--format", "{{json .Args}}", "ma"]).stdout)
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.74"
    code, body = cw.box.http(url(8031) + "/metrics")
    assert code == 200 and 'gpu_memory_utilization="0.74"' in body
    assert engines.sim_pid("docker", "mb") > 0 and len(containers_named(cw, "docker", "ma")) == 1


@pytest.mark.parametrize(
    "engine, drop, words",
    [
        ("podman", "--replace ", "add --replace to `podman run`"),
        ("docker", "ExecStartPre=-/usr/bin/docker rm -f ba\n", "ExecStartPre=-/usr/bin/docker rm -f ba"),
    ],
)
def test_check_names_the_missing_removal_of_the_old_container(cw, engines, engine, drop, words):
    unit = docker_unit("ba", 8041, model=MODEL) if engine == "docker" else podman_unit("ba", 8041, model=MODEL)
    install_unit(cw.box, "ba", swap(unit, drop, ""))
    cw.box.systemctl("enable", "--now", "vllm-ba.service")
    wait_serving(cw.box, 8041)
    replica = {"name": "ba", "unit": "vllm-ba.service", "container": "ba", "url": url(8041), "model": MODEL,
               "engine": engine}
    cw.box.write("/etc/guardian/guardian.toml", config_text([replica]))
    r = cw.box.run(["guardian", "check"], check=False)
    assert r.returncode == 1, r.stdout
    assert "does not remove the old container" in r.stdout and words in r.stdout, r.stdout
