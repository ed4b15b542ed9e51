"""Real dockerd and podman in the test box, running the simulator in the four shapes the field runs vLLM in
(tests/engines.py). Each test fails if its shape does not serve, and pins the facts guardian's container
support is built on: which cgroup holds the published port's listening socket, which cgroup the sim is in,
what an unprivileged user (nobody) can read of the sim's /proc, and docker-proxy's command line.

The facts are printed (pytest -rP shows them) and, when GUARDIAN_ENGINE_FACTS names a file, written there
as JSON, one object per shape.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from engines import (
    CONTAINER_PORT,
    cgroup_of,
    cleanup,
    cmdline,
    container_pid,
    docker_unit,
    install_unit,
    listeners,
    podman_unit,
    readable_by_nobody,
    run_unitless,
    start_engines,
    unit_name,
    wait_serving,
)
from systemd_box import wait_for

pytestmark = pytest.mark.system

SERVE_WITHIN_S = 30
DOCKER_SCOPE = re.compile(r"^/system\.slice/docker-[0-9a-f]{64}\.scope$")
FACTS: dict[str, dict] = {}


@pytest.fixture
def eng(box, engines):
    yield engines
    cleanup(box)


def _listens_on(tcp_table: str, port: int) -> bool:
    """Whether a /proc/PID/net/tcp text has a LISTEN (0A) socket on PORT."""
    return any(f":{port:04X} " in line and line.split()[3] == "0A" for line in tcp_table.splitlines()[1:])


def gather(box, engine: str, name: str, port: int, unit: str | None, in_container_port: int) -> dict:
    """Everything the facts are made of, for container NAME published on PORT."""
    sim = container_pid(box, engine, name)
    assert sim, f"no running container {name} in {engine}"
    f: dict = {"engine": engine, "host_port": port, "sim_pid": sim, "sim_cgroup": cgroup_of(box, sim),
               "sim_cmdline": cmdline(box, sim), "host_port_listeners": listeners(box, port)}
    if in_container_port != port:
        f["in_container_listeners"] = listeners(box, in_container_port, netns_pid=sim)
    if unit:
        main = int(box.prop(unit, "MainPID"))
        f["unit"] = unit
        f["unit_main_pid"] = main
        f["unit_main_comm"] = box.run(["cat", f"/proc/{main}/comm"], check=False).stdout.strip()
        f["unit_main_cgroup"] = cgroup_of(box, main)
        f["unit_cgroup"] = box.prop(unit, "ControlGroup")
        f["unit_tree"] = box.run(["systemd-cgls", "--no-pager", "-u", unit], check=False).stdout.strip()
    ok, text = readable_by_nobody(box, f"/proc/{sim}/net/tcp")
    f["nobody_reads_sim_net_tcp"] = ok
    f["sim_net_tcp_lists_sim_port_as_nobody"] = ok and _listens_on(
        box.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "cat", f"/proc/{sim}/net/tcp"],
                check=False).stdout, in_container_port)
    ok, text = readable_by_nobody(box, f"/proc/{sim}/cmdline")
    f["nobody_reads_sim_cmdline"] = ok
    f["sim_cmdline_as_nobody"] = text.replace("\0", " ").strip()
    ok, text = readable_by_nobody(box, f"/proc/{sim}/cgroup")
    f["nobody_reads_sim_cgroup"] = ok
    r = box.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "ls", f"/proc/{sim}/fd"], check=False)
    f["nobody_lists_sim_fds"] = r.returncode == 0
    proxies = [h for h in f["host_port_listeners"] if h["comm"] == "docker-proxy"]
    f["docker_proxy"] = [{"pid": h["pid"], "cmdline": cmdline(box, h["pid"]),
                          "nobody_reads_cmdline": readable_by_nobody(box, f"/proc/{h['pid']}/cmdline")[0]}
                         for h in proxies]
    return f


def record(key: str, facts: dict) -> None:
    FACTS[key] = facts
    print(f"FACTS {key}:\n{json.dumps(facts, indent=1)}")
    path = os.environ.get("GUARDIAN_ENGINE_FACTS")
    if path:
        with open(path, "w") as out:
            json.dump(FACTS, out, indent=1)


def assert_unprivileged_view(f: dict) -> None:
    assert f["nobody_reads_sim_net_tcp"] and f["sim_net_tcp_lists_sim_port_as_nobody"], f
    assert f["nobody_reads_sim_cmdline"] and "vllm_sim serve" in f["sim_cmdline_as_nobody"], f
    assert f["nobody_reads_sim_cgroup"], f
    assert not f["nobody_lists_sim_fds"], f  # the socket -> PID link needs privilege


def assert_docker_proxy(f: dict, port: int) -> None:
    # One docker-proxy a family (0.0.0.0 and ::), in docker.service's cgroup, holds the published port.
    holders = f["host_port_listeners"]
    assert {h["comm"] for h in holders} == {"docker-proxy"}, holders
    assert {h["cgroup"] for h in holders} == {"/system.slice/docker.service"}, holders
    assert {h["socket_cgroup"] for h in holders} == {"/system.slice/docker.service"}, holders
    assert len(f["docker_proxy"]) == len(holders) >= 1
    for p in f["docker_proxy"]:
        assert re.fullmatch(rf"/usr/sbin/docker-proxy -proto tcp -host-ip (0\.0\.0\.0|::) -host-port {port} "
                            rf"-container-ip 172\.17\.\d+\.\d+ -container-port {CONTAINER_PORT}", p["cmdline"]), p
        assert p["nobody_reads_cmdline"], p
    # The sim's own socket, in the container's network namespace, is the sim's.
    inside = f["in_container_listeners"]
    assert [h["pid"] for h in inside] == [f["sim_pid"]], inside
    assert inside[0]["local"] == f"0.0.0.0:{CONTAINER_PORT}", inside


def test_start_engines_is_quick_and_idempotent(box, eng):
    """The session's first start (dockerd, the image imported into both engines), then a second call."""
    again = start_engines(box)
    record("start_engines_s", {"first": eng.timings, "again_with_images": again.timings})
    assert again.image == eng.image == "localhost/guardian-sim:test"
    assert again.imported == (), again  # idempotent: the second call found the image in both and only checked


def test_docker_unit_publishing_a_port(box, eng):
    """a) docker run --rm -p PORT:8000 as the unit's main process."""
    port = 8301
    unit = install_unit(box, "dp", docker_unit("dp", port))
    box.systemctl("start", unit)
    wait_serving(box, port, SERVE_WITHIN_S)
    f = gather(box, "docker", "dp", port, unit, CONTAINER_PORT)
    record("a_docker_publish", f)
    # The unit holds only the docker client; the sim lives in docker's scope, outside the unit.
    assert f["unit_main_comm"] == "docker" and f["unit_main_cgroup"] == "/system.slice/vllm-dp.service", f
    assert DOCKER_SCOPE.match(f["sim_cgroup"]), f
    assert "--gpu-memory-utilization 0.9" in f["sim_cmdline"], f  # ${GPU_MEMORY_UTILIZATION} from the unit
    assert_docker_proxy(f, port)
    assert_unprivileged_view(f)
    # ExecStop stops the container and --rm removes it.
    box.systemctl("stop", unit)
    wait_for(lambda: not container_pid(box, "docker", "dp") and
             box.run(["docker", "ps", "-aq", "-f", "name=^dp$"]).stdout.strip() == "", 30, "container dp to be removed")


def test_docker_unit_on_the_host_network(box, eng):
    """b) docker run --rm --network host, the sim on 127.0.0.1:PORT."""
    port = 8302
    unit = install_unit(box, "dh", docker_unit("dh", port, host_network=True))
    box.systemctl("start", unit)
    wait_serving(box, port, SERVE_WITHIN_S)
    f = gather(box, "docker", "dh", port, unit, port)
    record("b_docker_host_network", f)
    assert f["unit_main_comm"] == "docker" and f["unit_main_cgroup"] == "/system.slice/vllm-dh.service", f
    assert DOCKER_SCOPE.match(f["sim_cgroup"]), f
    # The sim itself holds the port, from docker's scope; no docker-proxy.
    holders = f["host_port_listeners"]
    assert [(h["comm"], h["pid"], h["local"]) for h in holders] == [("python3", f["sim_pid"], f"127.0.0.1:{port}")], holders
    assert holders[0]["cgroup"] == holders[0]["socket_cgroup"] == f["sim_cgroup"], holders
    assert f["docker_proxy"] == []
    assert_unprivileged_view(f)


def test_podman_unit_as_quadlet_writes_it(box, eng):
    """c) podman run --cgroups=split --sdnotify=conmon -d -p PORT:8000, Type=notify, Delegate=yes."""
    port = 8303
    unit = install_unit(box, "pq", podman_unit("pq", port))
    box.systemctl("start", unit)  # Type=notify: returns once conmon said READY=1
    wait_serving(box, port, SERVE_WITHIN_S)
    f = gather(box, "podman", "pq", port, unit, CONTAINER_PORT)
    record("c_podman_quadlet", f)
    # conmon is MainPID, in the unit's runtime sub-cgroup; the sim is in the unit's payload sub-cgroup.
    assert f["unit_cgroup"] == "/system.slice/vllm-pq.service", f
    assert f["unit_main_comm"] == "conmon" and f["unit_main_cgroup"] == "/system.slice/vllm-pq.service/runtime", f
    assert re.fullmatch(r"/system\.slice/vllm-pq\.service/libpod-payload-[0-9a-f]{64}", f["sim_cgroup"]), f
    assert "--gpu-memory-utilization 0.9" in f["sim_cmdline"], f
    # conmon holds the published port (netavark's DNAT carries the traffic); the sim holds 8000 inside.
    holders = f["host_port_listeners"]
    assert [(h["comm"], h["pid"], h["local"]) for h in holders] == [("conmon", f["unit_main_pid"], f"0.0.0.0:{port}")], holders
    assert holders[0]["cgroup"] == holders[0]["socket_cgroup"] == "/system.slice/vllm-pq.service/runtime", holders
    inside = f["in_container_listeners"]
    assert [(h["pid"], h["local"]) for h in inside] == [(f["sim_pid"], f"0.0.0.0:{CONTAINER_PORT}")], inside
    assert f["docker_proxy"] == []
    assert_unprivileged_view(f)
    assert box.run(["test", "-s", "/run/vllm-pq.cid"], check=False).returncode == 0
    box.systemctl("stop", unit)
    assert box.prop(unit, "Result") == "success"
    wait_for(lambda: box.run(["podman", "ps", "-aq", "-f", "name=^pq$"]).stdout.strip() == "", 30,
             "container pq to be removed")
    assert box.run(["test", "-e", "/run/vllm-pq.cid"], check=False).returncode != 0


def test_docker_container_without_a_unit(box, eng):
    """d) docker run -d --restart unless-stopped: dockerd is its only keeper."""
    port = 8304
    cid = run_unitless(box, "du", port)
    wait_serving(box, port, SERVE_WITHIN_S)
    f = gather(box, "docker", "du", port, None, CONTAINER_PORT)
    f["container_id"] = cid
    f["restart_policy"] = box.run(["docker", "inspect", "-f", "{{.HostConfig.RestartPolicy.Name}}", "du"]).stdout.strip()
    f["systemd_unit_of_sim"] = box.run(["systemctl", "status", "--no-pager", str(f["sim_pid"])],
                                       check=False).stdout.splitlines()[:1]
    record("d_docker_unitless", f)
    assert f["restart_policy"] == "unless-stopped"
    assert f["sim_cgroup"] == f"/system.slice/docker-{cid}.scope", f
    assert_docker_proxy(f, port)
    assert_unprivileged_view(f)


def test_units_read_guardians_env_file(box, eng):
    """The wired units take GPU_MEMORY_UTILIZATION from /var/lib/guardian/replicas/NAME.env, over the default."""
    box.write("/var/lib/guardian/replicas/ew.env", "GPU_MEMORY_UTILIZATION=0.55\n")
    box.write("/var/lib/guardian/replicas/ep.env", "GPU_MEMORY_UTILIZATION=0.65\n")
    try:
        install_unit(box, "ew", docker_unit("ew", 8305), reload=False)
        install_unit(box, "ep", podman_unit("ep", 8306))
        box.systemctl("start", unit_name("ew"), unit_name("ep"))
        wait_serving(box, 8305, SERVE_WITHIN_S)
        wait_serving(box, 8306, SERVE_WITHIN_S)
        assert "--gpu-memory-utilization 0.55" in cmdline(box, container_pid(box, "docker", "ew"))
        assert "--gpu-memory-utilization 0.65" in cmdline(box, container_pid(box, "podman", "ep"))
    finally:
        box.run(["rm", "-f", "/var/lib/guardian/replicas/ew.env", "/var/lib/guardian/replicas/ep.env"], check=False)
