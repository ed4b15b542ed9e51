"""Replicas in containers: the pure parts (core/container.py), the helper's report as guardian
reads it (observe/containers.py), the config, the polkit grants and the port-owner gate."""

from __future__ import annotations

import json

import pytest

from guardian import polkit
from guardian.config import Config, ConfigError, load_config
from guardian.core import gates
from guardian.core.container import (
    Container,
    EngineReport,
    container_id_of_cgroup,
    parse_run_line,
    synthetic_unit,
    unit_problems,
)
from guardian.core.observations import UnitInfo
from guardian.core.vocab import ActiveState, Gate, HeldBy, LoadState, UnitFileState
from guardian.engine_helper import normalize
from guardian.observe.containers import Seen, parse_report, resolve
from harness import checked

CID = "a" * 64
OTHER = "b" * 64
NVIDIA = (
    "/usr/bin/docker run --rm --name vllm-a --gpus all -p 8001:8000 -e HF_TOKEN "
    "nvcr.io/nvidia/vllm:25.09-py3 vllm serve m --gpu-memory-utilization ${GPU_MEMORY_UTILIZATION}"
).split()
QUADLET = (
    "/usr/bin/podman run --name=vllm-p --cidfile=/run/vllm-p.cid --replace --rm --cgroups=split "
    "--sdnotify=conmon -d -p 8003:8000 localhost/vllm vllm serve m"
).split()


@pytest.mark.parametrize(
    "argv, expect",
    [
        (NVIDIA, dict(engine="docker", name="vllm-a", rm=True, publishes=("8001:8000",), passes_fraction=True)),
        (
            "/usr/bin/env docker container run --network host --name x img serve".split(),
            dict(engine="docker", name="x", host_network=True, rm=False),
        ),
        (QUADLET, dict(engine="podman", name="vllm-p", replace=True, cgroups_split=True, detach=True,
                       cidfile="/run/vllm-p.cid")),
        ("/usr/bin/docker run -e GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION} --name y img".split(),
         dict(name="y", passes_fraction=True)),
        # the image's own arguments are not docker's options
        ("/usr/bin/docker run --name z img --name other --rm".split(), dict(name="z", rm=False)),
    ],
)
def test_a_run_line_is_read_up_to_the_image(argv, expect):
    run = parse_run_line(tuple(argv))
    assert run is not None
    for key, value in expect.items():
        assert getattr(run, key) == value, key


@pytest.mark.parametrize(
    "argv",
    [("/usr/bin/vllm", "serve", "m"), ("/usr/bin/docker", "start", "x"), ("/usr/bin/env",), ()],
)
def test_a_line_that_runs_no_container_is_none(argv):
    assert parse_run_line(argv) is None


def _problems(argv, pre=(), stop=(), container="vllm-a"):
    return unit_problems("vllm-a.service", container, parse_run_line(tuple(argv)), tuple(pre), tuple(stop))


def test_nvidias_docker_run_needs_the_removal_and_a_stop():
    found = _problems(NVIDIA)
    texts = " | ".join(p for p, _fix in found)
    fixes = [fix for _p, fix in found]
    assert "does not remove the old container" in texts
    assert "ExecStartPre=-/usr/bin/docker rm -f vllm-a" in fixes
    assert "ExecStop=/usr/bin/docker stop -t 30 vllm-a" in fixes


def test_a_docker_unit_with_removal_and_stop_has_no_problem():
    pre = [("/usr/bin/docker", "rm", "-f", "vllm-a")]
    stop = [("/usr/bin/docker", "stop", "-t", "10", "vllm-a")]
    assert _problems(NVIDIA, pre, stop) == []


def test_a_docker_unit_without_rm_nor_removal_says_both():
    argv = [w for w in NVIDIA if w != "--rm"]
    found = " | ".join(p for p, _ in _problems(argv, stop=[("/usr/bin/docker", "stop", "vllm-a")]))
    assert "without --rm" in found and "does not remove the old container" in found


def test_a_detached_docker_run_is_named():
    argv = NVIDIA[:2] + ["-d"] + NVIDIA[2:]
    found = _problems(argv, [("/usr/bin/docker", "rm", "-f", "vllm-a")], [("/usr/bin/docker", "stop", "vllm-a")])
    assert len(found) == 1 and "docker run -d" in found[0][0]


def test_podman_without_replace_needs_it():
    argv = [w for w in QUADLET if w != "--replace"]
    stop = [("/usr/bin/podman", "rm", "-f", "-i", "--cidfile=/run/vllm-p.cid")]
    found = _problems(argv, stop=stop, container="vllm-p")
    assert len(found) == 1 and "--replace" in found[0][1]
    assert _problems(QUADLET, stop=stop, container="vllm-p") == []


def test_a_unit_that_runs_another_name_or_no_container():
    assert "not 'vllm-b'" in _problems(NVIDIA, container="vllm-b")[0][0]
    found = unit_problems("vllm-a.service", "vllm-a", None, (), ())
    assert "runs no `docker run`" in found[0][0]


def test_cgroup_components_of_engines():
    assert container_id_of_cgroup(f"docker-{CID}") == CID
    assert container_id_of_cgroup(f"libpod-{CID}.scope") == CID
    assert container_id_of_cgroup(f"libpod-payload-{CID}") == CID
    assert container_id_of_cgroup("docker.service") is None
    assert container_id_of_cgroup(f"docker-{CID[:12]}.scope") is None


def _c(**kw) -> Container:
    base = dict(id=CID, name="vllm-a", running=True, restart_policy="unless-stopped", status="running")
    return Container(**{**base, **kw})


SCOPE = UnitInfo(f"docker-{CID}.scope", LoadState.LOADED, ActiveState.ACTIVE, inactive_exit_mono=12.5)


@pytest.mark.parametrize(
    "c, scope, active, enabled",
    [
        (_c(), SCOPE, ActiveState.ACTIVE, True),
        (_c(running=False, restarting=True, status="restarting"), None, ActiveState.ACTIVATING, True),
        (_c(running=False, status="exited"), None, ActiveState.INACTIVE, True),  # docker stop
        (_c(restart_policy="no"), SCOPE, ActiveState.ACTIVE, False),
        (_c(restart_policy=""), SCOPE, ActiveState.ACTIVE, False),
    ],
)
def test_a_unitless_container_as_a_unit(c, scope, active, enabled):
    u = synthetic_unit("docker:vllm-a", c, scope)
    assert u.active_state is active
    assert u.unit_file_state.enabled is enabled
    if active is ActiveState.ACTIVE:
        assert u.inactive_exit_mono == 12.5  # the startup grace counts from the container's own start


def test_a_missing_container_is_not_loaded_and_refused():
    u = synthetic_unit("docker:vllm-a", None, None)
    refusal = checked(gates.unit_refusal(u, None))
    assert refusal is not None and refusal.gate is Gate.NOT_LOADED


def test_a_container_stopped_on_purpose_is_left_alone():
    u = synthetic_unit("docker:vllm-a", _c(running=False, status="exited"), None)
    refusal = checked(gates.unit_refusal(u, None))
    assert refusal is not None and refusal.gate is Gate.INACTIVE
    assert "never starts a stopped unit" in refusal.reason


def test_a_container_without_a_restart_policy_is_refused_as_disabled():
    refusal = checked(gates.unit_refusal(synthetic_unit("docker:vllm-a", _c(restart_policy="no"), SCOPE), None))
    assert refusal is not None and refusal.gate is Gate.DISABLED


REPORT = EngineReport(
    "docker",
    1.0,
    (
        _c(ips=("172.17.0.2",)),
        _c(id=OTHER, name="stray", ips=("172.17.0.3",)),
    ),
)


def _owner(unit="docker.service", pid=77):
    return HeldBy(8001, pid, unit)


def _replica():
    return Config.model_validate(
        {"replicas": [{"name": "a", "unit": "vllm-a.service", "container": "vllm-a", "url": "http://127.0.0.1:8001",
                       "model": "m"}]}
    ).replicas[0]


@pytest.mark.parametrize(
    "seen, name, own, stray",
    [
        (Seen(ip="172.17.0.2", via="docker-proxy", engine="docker"), "vllm-a", True, False),
        (Seen(ip="172.17.0.3", via="docker-proxy", engine="docker"), "stray", False, True),
        # not in the report: not recognised, and not known to be another's
        (Seen(ip="172.17.0.9", via="docker-proxy", engine="docker"), None, False, False),
        (Seen(container_id=CID, via="scope", engine="docker"), "vllm-a", True, False),
        (Seen(container_id=OTHER, via="scope", engine="docker"), "stray", False, True),
        # conmon's command line names a container but is its own word: never the replica's own
        (Seen(name="vllm-a", via="conmon"), "vllm-a", False, False),
        (Seen(name="stray", via="conmon"), "stray", False, True),
        # Podman's holder in front of a Docker replica: another's, even under the replica's name
        (Seen(name="vllm-a", via="conmon", engine="podman"), "vllm-a", False, True),
        # a unit named like Docker's scope in a user's tree
        (Seen(via="a unit named docker-x.scope outside the engines' slices", forged=True), None, False, True),
    ],
)
def test_the_holder_is_the_replicas_own_container_or_named(seen, name, own, stray):
    held = resolve(_owner(), _replica(), seen, REPORT)
    assert (held.container, held.own_container, held.stray) == (name, own, stray)
    unit = UnitInfo("vllm-a.service", LoadState.LOADED, ActiveState.ACTIVE, unit_file_state=UnitFileState.ENABLED)
    refusal = checked(gates.unit_refusal(unit, held))
    if own:
        assert refusal is None
    else:
        assert refusal is not None and refusal.gate is Gate.PORT_OWNER
        if name is not None:
            assert f"container {name}" in refusal.reason


def test_a_stray_of_the_other_engine_is_named_from_its_part_of_the_report_and_never_the_replicas():
    """A Podman replica; Docker's docker-proxy holds its port for a container named like it: the
    name comes from the report's Docker part, and it is a stray all the same."""
    podman = _replica().model_copy(update={"runtime": "podman"})
    report = EngineReport("podman", 1.0, (_c(name="vllm-a", ips=("10.88.0.2",)),),
                          others=(_c(id=OTHER, name="vllm-a", ips=("172.17.0.3",)),))
    held = resolve(_owner(), podman, Seen(ip="172.17.0.3", via="docker-proxy", engine="docker"), report)
    assert (held.container, held.own_container, held.stray) == ("vllm-a", False, True)
    assert "a docker container" in held.holder_text()
    # an address only the replica's own engine knows is not looked up there for Docker's proxy
    held = resolve(_owner(), podman, Seen(ip="10.88.0.2", via="docker-proxy", engine="docker"), report)
    assert (held.container, held.own_container, held.stray) == (None, False, True)


def test_the_other_engines_part_of_a_report_names_strays_and_spoils_nothing():
    row = normalize(DOCKER_INSPECT)
    good = {"engine": "podman", "at_wall": 5.0, "containers": [], "others": {"engine": "docker", "containers": [row]}}
    report = parse_report(json.dumps(good).encode(), "podman")
    assert report.error is None and [c.name for c in report.others] == ["vllm-a"] and report.containers == ()
    for others in ({"engine": "docker", "containers": [{"id": 5}]}, {"engine": "podman", "containers": [row]},
                   "garbage", {"engine": "docker", "containers": [row] * 600}):
        report = parse_report(json.dumps({**good, "others": others}).encode(), "podman")
        assert report.error is None and report.others == (), others


def test_two_containers_on_one_address_are_not_guessed():
    report = EngineReport("docker", 1.0, (_c(ips=("10.0.0.2",)), _c(id=OTHER, name="x", ips=("10.0.0.2",))))
    assert report.by_ip("10.0.0.2") is None


DOCKER_INSPECT = {
    "Id": CID,
    "Name": "/vllm-a",
    "State": {"Status": "running", "Running": True, "Restarting": False, "Pid": 4242, "ExitCode": 0,
              "StartedAt": "2026-12-01T08:00:00Z", "FinishedAt": "0001-01-01T00:00:00Z"},
    "HostConfig": {"RestartPolicy": {"Name": "unless-stopped"}, "NetworkMode": "bridge"},
    "NetworkSettings": {"IPAddress": "172.17.0.2", "Networks": {"bridge": {"IPAddress": "172.17.0.2"}},
                        "Ports": {"8000/tcp": [{"HostIp": "0.0.0.0", "HostPort": "8001"}, {"HostIp": "::", "HostPort": "8001"}]}},
    "Config": {"Env": ["PATH=/usr/bin"], "Cmd": ["vllm", "serve", "m", "--gpu-memory-utilization", "0.74"]},
    "Args": ["serve", "m", "--gpu-memory-utilization", "0.74"],
}


def test_the_helpers_report_round_trips():
    row = normalize(DOCKER_INSPECT)
    report = parse_report(json.dumps({"engine": "docker", "at_wall": 5.0, "containers": [row]}).encode(), "docker")
    assert report.error is None
    c = report.by_name("vllm-a")
    assert c is not None and c.id == CID and c.ips == ("172.17.0.2",) and c.host_ports == (8001,)
    assert c.fraction == "0.74" and c.restart_policy == "unless-stopped" and c.pid == 4242


@pytest.mark.parametrize(
    "doc",
    [
        b"[" * 100_000,
        b"not json",
        json.dumps({"engine": "podman", "at_wall": 1, "containers": []}).encode(),  # another engine's
        json.dumps({"engine": "docker", "at_wall": "x", "containers": []}).encode(),
        b'{"engine": "docker", "at_wall": 1' + b"0" * 400 + b', "containers": []}',  # float() overflows
        json.dumps({"engine": "docker", "at_wall": 1, "containers": [{"id": 5}]}).encode(),
        json.dumps({"engine": "docker", "at_wall": 1, "containers": [{"id": "x", "name": "a\nb"}]}).encode(),
        json.dumps({"engine": "docker", "at_wall": 1, "containers": [{"id": "x", "running": "yes"}]}).encode(),
        json.dumps({"engine": "docker", "at_wall": 1, "containers": [{}] * 600}).encode(),
    ],
)
def test_a_report_guardian_cannot_read_is_an_error_not_a_crash(doc):
    report = parse_report(doc, "docker")
    assert report.error is not None and report.containers == ()


def test_config_unitless_docker_container():
    cfg = Config.model_validate(
        {"replicas": [{"name": "a", "container": "vllm-a", "url": "http://127.0.0.1:8001", "model": "m"}]}
    )
    r = cfg.replicas[0]
    assert r.unit == "docker:vllm-a" and r.unitless


@pytest.mark.parametrize(
    "replica, words",
    [
        ({"name": "a", "container": "vllm-a", "engine": "podman"}, "Podman container needs the unit"),
        ({"name": "a", "unit": "docker:vllm-a"}, "not a systemd service"),
        ({"name": "a", "unit": "docker:xy", "container": "vllm-a"}, "not a systemd service"),
        ({"name": "a", "unit": "x.service", "container": "-bad"}, "container name"),
        ({"name": "a", "unit": "x.service", "container": "a/b"}, "container name"),
        ({"name": "a", "unit": "x.service", "container": "x"}, "container name"),  # docker: two characters at least
        ({"name": "a", "unit": "x.service", "container": "ab", "engine": "lxc"}, "engine"),
        ({"name": "a", "unit": "docker.service", "container": "ab"}, "container engine's own unit"),
        ({"name": "a", "unit": "podman.service"}, "container engine's own unit"),
    ],
)
def test_config_refuses_bad_container_replicas(tmp_path, replica, words):
    body = {**replica, "url": "http://127.0.0.1:8001", "model": "m"}
    lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in body.items())
    path = tmp_path / "g.toml"
    path.write_text(f"[[replicas]]\n{lines}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert words in str(e.value)


def test_polkit_grants_the_helpers_of_configured_containers_only():
    cfg = Config.model_validate(
        {
            "replicas": [
                {"name": "a", "container": "vllm-a", "url": "http://127.0.0.1:8001", "model": "m"},
                {"name": "p", "unit": "vllm-p.service", "container": "vllm-p", "runtime": "podman",
                 "url": "http://127.0.0.1:8002", "model": "m"},
                {"name": "n", "unit": "vllm-n.service", "url": "http://127.0.0.1:8003", "model": "m"},
            ]
        }
    )
    assert polkit.helper_units(cfg) == [
        "guardian-container@inspect:a.service",
        "guardian-container@inspect:p.service",
        "guardian-container@kill:a.service",
        "guardian-container@kill:p.service",
        "guardian-container@restart:a.service",  # only the unit-less one is restarted by the helper
    ]
    rule = polkit.render(cfg, "/etc/guardian/guardian.toml")
    assert '"docker:vllm-a"' not in rule  # not a unit: never granted a systemd verb
    assert '["vllm-n.service", "vllm-p.service"]' in rule


def _helper_config(tmp_path):
    path = tmp_path / "g.toml"
    path.write_text(
        '[[replicas]]\nname = "a"\ncontainer = "vllm-a"\nurl = "http://127.0.0.1:8001"\nmodel = "m"\n'
        '[[replicas]]\nname = "p"\nunit = "vllm-p.service"\ncontainer = "vllm-p"\nengine = "podman"\n'
        'url = "http://127.0.0.1:8002"\nmodel = "m"\n'
        '[[replicas]]\nname = "n"\nunit = "vllm-n.service"\nurl = "http://127.0.0.1:8003"\nmodel = "m"\n'
    )
    return path


@pytest.mark.parametrize(
    "instance, words",
    [
        ("inspect", "is not VERB:REPLICA"),
        ("stop:a", "is not VERB:REPLICA"),
        ("kill:nobody", "is not a configured container replica"),
        ("kill:n", "is not a configured container replica"),  # a native replica has no container to kill
        ("restart:p", "guardian restarts that unit, not the container"),
    ],
)
def test_the_helper_refuses_what_the_config_does_not_name(tmp_path, capsys, instance, words):
    from guardian import engine_helper

    assert engine_helper.main(instance, _helper_config(tmp_path)) == 2
    assert words in capsys.readouterr().err


def test_the_helper_refuses_a_broken_config(tmp_path, capsys):
    from guardian import engine_helper

    path = tmp_path / "g.toml"
    path.write_text("[[replicas]\n")
    assert engine_helper.main("kill:a", path) == 2
    assert "g.toml" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, wall",
    [
        ("2026-12-01T09:59:13.366949123Z", 1796119153.366949),  # docker: nanoseconds
        ("2026-12-01T10:59:13.5+01:00", 1796119153.5),  # podman's JSON: an offset
        ("2026-12-01T09:59:13Z", 1796119153.0),
        ("0001-01-01T00:00:00Z", -62135596800.0),  # never started
        ("yesterday", None),
        ("", None),
    ],
)
def test_an_engines_start_time(text, wall):
    from guardian.engine_helper import started_wall

    got = started_wall(text)
    assert got == wall if wall is None else got == pytest.approx(wall, abs=1e-6)


def test_a_process_that_calls_itself_docker_proxy_outside_docker_service_points_at_no_container():
    """Issue 34 row 4: any user can start a process named docker-proxy with Docker's flags. Only
    root's docker-proxy in docker.service's cgroup is Docker's; elsewhere its command line makes
    it nobody's container, and never the replica's own (a real process, its argv forged)."""
    import subprocess
    import sys
    import time

    from guardian.observe.containers import seen_holder

    forged = subprocess.Popen(
        ["docker-proxy", "-", "-proto", "tcp", "-host-ip", "0.0.0.0", "-host-port", "8001",
         "-container-ip", "172.17.0.2", "-container-port", "8000"],
        executable=sys.executable, stdin=subprocess.PIPE,  # python reads its program from stdin: it waits
    )
    try:
        deadline = time.monotonic() + 30
        while open(f"/proc/{forged.pid}/cmdline", "rb").read().split(b"\0")[0] != b"docker-proxy":
            assert time.monotonic() < deadline, "the forged process never showed its command line"
            time.sleep(0.01)
        assert seen_holder(HeldBy(8001, forged.pid, "app-squat.scope")) is None
    finally:
        forged.kill()
        forged.wait()


def test_a_ticks_container_helpers_wait_all_at_once_and_within_one_bound(monkeypatch, tmp_path):
    """Issue 34 row 7: with an engine whose `docker ps` hangs, each replica's helper waited up to
    5 s one after another (6 unit-less replicas: 30 s, systemd's watchdog). The waits are now all
    in flight at once, and the phase ends at CONTAINER_PHASE_S with each unit-less view unknown."""
    import asyncio

    import guardian.observe.containers as containers_module
    from guardian.config import ReplicaConfig
    from guardian.observe.containers import ContainerWatch
    from guardian.observe.systemd import Systemd

    class HungHelpers:
        run_helper = Systemd.run_helper  # the real road to the helper, over this fake bus's run_job

        def __init__(self) -> None:
            self.started: list[str] = []
            self.in_flight = 0
            self.most_in_flight = 0

        async def run_job(self, member, name, timeout_s, during=None):
            self.started.append(name)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                await asyncio.Event().wait()  # the helper's `docker ps` never returns
            finally:
                self.in_flight -= 1

    monkeypatch.setattr(containers_module, "CONTAINER_PHASE_S", 0.5)
    replicas = [ReplicaConfig(name=f"c{i}", container=f"c{i}", url=f"http://127.0.0.1:{8100 + i}", model="m")
                for i in range(6)]
    sd = HungHelpers()
    watch = ContainerWatch(sd, directory=tmp_path)
    owners, units = asyncio.run(watch.views(replicas, {}))
    assert sd.most_in_flight == 6, sd.started  # all at once, not one after another
    assert sorted(sd.started) == sorted(f"guardian-container@inspect:c{i}.service" for i in range(6))
    assert owners == {}
    assert set(units) == {r.unit for r in replicas}
    for info, why in units.values():
        assert info is None and "did not answer within 0.5 s" in why, why


def test_container_replicas_count_the_helpers_wait_against_the_watchdog(monkeypatch):
    """The config check that keeps a tick inside systemd's watchdog counts the container phase."""
    from guardian.config import CONTAINER_PHASE_S, ReplicaConfig

    monkeypatch.setenv("WATCHDOG_USEC", str(int(4 * CONTAINER_PHASE_S * 1e6) - 1))  # a quarter just below it
    replica = {"name": "c", "container": "vllm-c", "url": "http://127.0.0.1:8100", "model": "m"}
    with pytest.raises(ValueError, match="container helpers' wait"):
        Config(replicas=[ReplicaConfig(**replica)])
    plain = {"name": "a", "unit": "vllm-a.service", "url": "http://127.0.0.1:8101", "model": "m"}
    assert Config(replicas=[ReplicaConfig(**plain)]).replicas[0].name == "a"  # no containers: not counted
