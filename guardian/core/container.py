"""Replicas in containers: what a unit's `docker run` / `podman run` line says, what the engine
says about a container, and which container holds a port. Pure: the engine is asked by the root
helper (guardian-container@.service, guardian/engine_helper.py) and the cgroup tree by observe/.

The shapes guardian knows (README, Replicas in containers):
- a unit whose ExecStart is `docker run ... --name N` (with -p: docker-proxy in docker.service
  holds the host port; with --network host: the container's own scope `docker-<id>.scope` does);
- a unit whose ExecStart is `podman run ... --name N` (Quadlet's shape, --cgroups=split: conmon
  holds the port inside the unit; default cgroups: conmon in the unit, the server in
  `machine.slice/libpod-<id>.scope`);
- no unit: a Docker container kept by its restart policy (`docker run -d --restart ...`, Compose).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from .observations import UnitInfo
from .vocab import ActiveState, LoadState, UnitFileState

ENGINES = ("docker", "podman")
# docker-<id>.scope (Docker, systemd cgroup driver), libpod-<id>.scope and libpod-conmon-<id>.scope
# (Podman, default cgroups), libpod-payload-<id> (Podman --cgroups=split, inside the unit).
_SCOPE = re.compile(r"^(?:docker|libpod|libpod-conmon|libpod-payload)-([0-9a-f]{64})(?:\.scope)?$")
# Docker's restart policies that bring a container back by themselves ("no" leaves it down).
KEEPING_POLICIES = frozenset({"always", "unless-stopped", "on-failure"})
MAX_CONTAINERS = 512  # the helper's report is bounded: a box with more is named as such


def helper_unit(verb: str, replica: str) -> str:
    """The root helper's unit for VERB on REPLICA (units/guardian-container@.service)."""
    return f"guardian-container@{verb}:{replica}.service"


def engine_holder(unit: str) -> bool:
    """UNIT is where an engine holds a container's port: docker.service (docker-proxy) or a
    container's own scope. Any other unit holding it holds it for itself, not for a container."""
    return unit == "docker.service" or container_id_of_cgroup(unit.removesuffix(".scope")) is not None


def container_id_of_cgroup(component: str) -> str | None:
    """The container id in a cgroup path component named by an engine, or None."""
    match = _SCOPE.match(component)
    return match.group(1) if match else None


@dataclass(frozen=True)
class RunLine:
    """What a unit's ExecStart `ENGINE run ...` says (only the options guardian needs)."""

    engine: str
    name: str | None = None
    image: str | None = None  # the first word after the options
    rm: bool = False
    replace: bool = False
    detach: bool = False
    host_network: bool = False
    cgroups_split: bool = False
    cidfile: str | None = None
    publishes: tuple[str, ...] = ()
    # guardian's fraction reaches the server: ${GPU_MEMORY_UTILIZATION} in its command (after its engine's
    # knob flag), or -e GPU_MEMORY_UTILIZATION
    passes_fraction: bool = False
    mounts: tuple[tuple[str, str], ...] = ()  # (host path, path in the container) of -v / --mount binds and volumes
    envs: tuple[str, ...] = ()  # -e / --env, as written
    command: tuple[str, ...] = ()  # what follows the image: the engine's own arguments
    env_files: tuple[str, ...] = ()  # --env-file, as written (guardian does not read them)


def _mounts(engine: str, opts: dict[str, list[str]]) -> tuple[tuple[str, str], ...]:
    """(host path, container path) of each -v/--volume and --mount bind or named volume (a named
    volume is the engine's own directory for it, as root runs it)."""
    store = "/var/lib/docker/volumes" if engine == "docker" else "/var/lib/containers/storage/volumes"

    def host(src: str) -> str:
        return src if src.startswith("/") else f"{store}/{src}/_data"

    found = []
    for v in opts.get("-v", []) + opts.get("--volume", []):
        parts = v.split(":")
        if len(parts) >= 2 and parts[0] and parts[1].startswith("/"):
            found.append((host(parts[0]), parts[1]))
    for m in opts.get("--mount", []):
        kv = dict(p.split("=", 1) for p in m.split(",") if "=" in p)
        src = kv.get("source") or kv.get("src")
        dst = kv.get("target") or kv.get("dst") or kv.get("destination")
        if src and dst and kv.get("type", "volume") in ("bind", "volume"):
            found.append((host(src), dst))
    return tuple(found)


# Options of `docker run` / `podman run` that take a value as the next word (when not written
# --opt=value): enough to walk past them to the image; the rest are flags.
_VALUED = frozenset(
    "-a --attach --add-host --annotation --blkio-weight --cap-add --cap-drop --cgroup-parent --cgroupns --cgroups "
    "--cidfile --conmon-pidfile --cpu-period --cpu-quota --cpu-shares --cpus --cpuset-cpus --cpuset-mems --device "
    "--dns --dns-option --dns-search -e --env --env-file --entrypoint --expose --gpus --group-add -h --hostname "
    "--health-cmd --health-interval --health-retries --health-start-period --health-timeout --ip --ip6 --ipc "
    "-l --label --label-file --log-driver --log-opt -m --memory --memory-reservation --memory-swap --mount "
    "--name --network --net --network-alias --pid --platform -p --publish --pull --restart --runtime "
    "--security-opt --shm-size --sdnotify --stop-signal --stop-timeout --sysctl --tmpfs -u --user --ulimit "
    "--userns --uts -v --volume --volumes-from -w --workdir --init-path --log-level --pidfile --secret "
    "--systemd --timeout --tz --umask --uidmap --gidmap --subuidname --subgidname --requires --pod".split()
)


def parse_run_line(argv: tuple[str, ...]) -> RunLine | None:
    """The container line of a unit's ExecStart, or None when it does not run a container.
    `/usr/bin/env docker run`, `docker container run` and `podman run` are recognised."""
    words = list(argv)
    if words and words[0].rsplit("/", 1)[-1] == "env":
        words = words[1:]
    if not words:
        return None
    engine = words[0].rsplit("/", 1)[-1]
    if engine not in ENGINES:
        return None
    rest = words[1:]
    if rest[:1] == ["container"]:
        rest = rest[1:]
    if rest[:1] != ["run"]:
        return None
    opts: dict[str, list[str]] = {}
    flags: set[str] = set()
    tail = rest[1:]
    at = 0  # the word of TAIL read next; the image once the options end
    while at < len(tail):
        word = tail[at]
        if not word.startswith("-") or word == "--":
            break
        key, eq, value = word.partition("=")
        if eq:
            opts.setdefault(key, []).append(value)
        elif key in _VALUED and at + 1 < len(tail):
            opts.setdefault(key, []).append(tail[at + 1])
            at += 1
        else:
            flags.add(key)
        at += 1
    after_image = tail[at + 1 :]
    network = (opts.get("--network") or opts.get("--net") or [""])[-1]
    envs = opts.get("-e", []) + opts.get("--env", [])
    # Whichever engine's knob flag comes before it (guardian/engines/): the variable in the command is
    # what carries guardian's fraction; wiring.py judges the flag against the replica's engine.
    fraction_arg = any("GPU_MEMORY_UTILIZATION" in w for w in after_image)
    return RunLine(
        engine=engine,
        name=opts["--name"][-1] if "--name" in opts else None,
        image=tail[at] if at < len(tail) else None,
        rm="--rm" in flags or (opts.get("--rm") or [""])[-1] == "true",
        replace="--replace" in flags or (opts.get("--replace") or [""])[-1] == "true",
        detach=bool({"-d", "--detach"} & flags),
        host_network=network == "host",
        cgroups_split=(opts.get("--cgroups") or [""])[-1] == "split",
        cidfile=opts["--cidfile"][-1] if "--cidfile" in opts else None,
        publishes=tuple(opts.get("-p", []) + opts.get("--publish", [])),
        passes_fraction=fraction_arg or any(e.split("=", 1)[0] == "GPU_MEMORY_UTILIZATION" for e in envs),
        mounts=_mounts(engine, opts),
        envs=tuple(envs),
        command=tuple(after_image),
        env_files=tuple(opts.get("--env-file", [])),
    )


@dataclass(frozen=True)
class Served:
    """What the server a unit runs is given: its command line and its environment. For a `docker
    run` / `podman run` line, the container's command and its -e/--env (a bare `-e KEY` passes the
    unit's own KEY on); else the unit's ExecStart= and environment, with what a leading `env K=V`
    sets. ENV_COMPLETE is False where a --env-file guardian does not read may set more."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    env_complete: bool = True


_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def engine_words(argv: tuple[str, ...]) -> tuple[str, ...]:
    """The words of a unit's ExecStart (expanded) that say which serving engine it starts: for a
    container, its image and command (not its options: `--name vllm-a` says nothing of what runs)."""
    run = parse_run_line(argv)
    if run is None:
        return argv
    return ((run.image,) if run.image is not None else ()) + run.command


def served(argv: tuple[str, ...], env: Mapping[str, str]) -> Served:
    """What the server of a unit whose ExecStart= is ARGV (expanded) and whose environment is ENV runs with."""
    run = parse_run_line(argv)
    if run is not None:
        inside: dict[str, str] = {}
        for pair in run.envs:
            key, sep, value = pair.partition("=")
            if sep:
                inside[key] = value
            elif key in env:
                inside[key] = env[key]
        return Served(run.command, inside, env_complete=not run.env_files)
    mine = dict(env)
    words = list(argv)
    if words and words[0].rsplit("/", 1)[-1] == "env":
        words = words[1:]
        while words and _ASSIGNMENT.match(words[0]):
            key, _, value = words.pop(0).partition("=")
            mine[key] = value
    return Served(tuple(argv), mine)


def _mentions(lines: tuple[tuple[str, ...], ...], *needles: str) -> bool:
    return any(all(any(n == w or w.endswith(n) for w in argv) for n in needles) for argv in lines)


def unit_problems(
    unit: str, container: str, run: RunLine | None, pre: tuple[tuple[str, ...], ...], stop: tuple[tuple[str, ...], ...]
) -> list[tuple[str, str]]:
    """What keeps UNIT from restarting its container, as (problem, the line to add). PRE: its
    ExecStartPre lines, STOP: its ExecStop and ExecStopPost lines (argv each)."""
    if run is None:
        return [
            (
                f"{unit} runs no `docker run` or `podman run` in its ExecStart, "
                f"but the replica's container is {container!r}",
                "point replicas[].unit at the unit that runs the container, or drop `container` for a native replica",
            )
        ]
    found = _start_problems(unit, container, run, pre)
    if not _stops_container(run, container, stop):
        found.append(
            (
                f"{unit} has no ExecStop that stops the container: `systemctl stop` ends only the {run.engine} CLI "
                "and the container serves on",
                f"ExecStop=/usr/bin/{run.engine} stop -t 30 {container}",
            )
        )
    return found


def _start_problems(unit: str, container: str, run: RunLine, pre: tuple[tuple[str, ...], ...]) -> list[tuple[str, str]]:
    """What in UNIT's start (its run line and ExecStartPre lines PRE) keeps a restart from working."""
    found: list[tuple[str, str]] = []
    engine = run.engine
    if run.name != container:
        found.append(
            (
                f"{unit} runs its container as {run.name!r}, not {container!r}",
                f"give `{engine} run` the option --name {container} (or set replicas[].container = {run.name!r})",
            )
        )
    removes_old = run.replace or _mentions(pre, engine, "rm")
    if not removes_old:
        fix = (
            f"add --replace to `podman run` (what Quadlet writes), or ExecStartPre=-/usr/bin/podman rm -f {container}"
            if engine == "podman"
            else f"ExecStartPre=-/usr/bin/docker rm -f {container}"
        )
        found.append(
            (
                f"{unit} does not remove the old container before it starts a new one: a restart fails with "
                f"'name already in use' while the old {container} still holds the model's memory",
                fix,
            )
        )
    if run.detach and engine == "docker":
        found.append(
            (
                f"{unit} runs `docker run -d`: the unit ends as soon as the container starts, so systemd "
                "cannot see it stop or restart it",
                f"run it in the foreground: drop -d (the unit then lives as long as {container})",
            )
        )
    if engine == "docker" and not run.rm and not removes_old:
        found.append(
            (
                f"{unit} runs `docker run` with a fixed --name and without --rm: the stopped container stays and "
                "blocks the next start",
                f"add --rm to `docker run`, or ExecStartPre=-/usr/bin/docker rm -f {container}",
            )
        )
    return found


def _stops_container(run: RunLine, container: str, stop: tuple[tuple[str, ...], ...]) -> bool:
    """One of the STOP lines stops the container: by its name, or (Podman) by its cidfile."""
    if _mentions(stop, run.engine, container):
        return True
    by_cidfile = _mentions(stop, "podman", "--cidfile") or (bool(run.cidfile) and _mentions(stop, "podman", "rm"))
    return run.engine == "podman" and by_cidfile


@dataclass(frozen=True)
class Container:
    """One container as the engine reports it (a row of the helper's report)."""

    id: str
    name: str
    running: bool
    restarting: bool = False
    status: str = ""
    pid: int = 0
    started_at: str = ""
    finished_at: str = ""
    exit_code: int = 0
    restart_policy: str = ""
    ips: tuple[str, ...] = ()
    host_ports: tuple[int, ...] = ()
    fraction: str | None = None  # GPU_MEMORY_UTILIZATION in its environment, or its argument


@dataclass(frozen=True)
class EngineReport:
    """The helper's report: every container the engine knows (at most MAX_CONTAINERS), or why not."""

    engine: str
    at_wall: float
    containers: tuple[Container, ...] = ()
    error: str | None = None
    truncated: bool = False
    # The other engine's containers, when it is installed: only to name a stray of that engine
    # on the replica's port (a Docker container in front of a Podman replica); never the replica's.
    others: tuple[Container, ...] = ()

    def by_name(self, name: str) -> Container | None:
        return next((c for c in self.containers if c.name == name), None)

    def by_id(self, cid: str) -> Container | None:
        return find_container(self.containers, cid=cid)

    def by_ip(self, ip: str) -> Container | None:
        return find_container(self.containers, ip=ip)


def find_container(
    containers: tuple[Container, ...], cid: str | None = None, ip: str | None = None
) -> Container | None:
    """The container of id CID, or the one running container with address IP (two: neither)."""
    if cid is not None:
        return next((c for c in containers if c.id == cid), None)
    found = [c for c in containers if c.running and ip in c.ips]
    return found[0] if len(found) == 1 else None


@dataclass(frozen=True)
class Holder:
    """Who holds a replica's port, seen through an engine: the container's name when known."""

    container: str | None
    how: str  # "its scope docker-<id>.scope", "docker-proxy (pid P) forwarding to 172.17.0.2:8000", ...
    ids: tuple[str, ...] = field(default=())


def synthetic_unit(label: str, container: Container | None, scope: UnitInfo | None) -> UnitInfo:
    """A unit-less container seen as a unit, so that the unit gates and the startup grace apply:
    running -> active (its start time is its scope's), restarting -> activating, otherwise
    inactive ("stopped": an operator's `docker stop`, or a policy that gave up). Its restart
    policy stands for enablement: "no" is a container nobody keeps (G4, like a disabled unit)."""
    if container is None:
        return UnitInfo(label, LoadState.NOT_FOUND, ActiveState.INACTIVE, sub_state="no such container")
    if container.running and scope is not None and scope.active_state.running:
        active, since = ActiveState.ACTIVE, scope.inactive_exit_mono
    elif container.restarting or container.running:
        active, since = ActiveState.ACTIVATING, scope.inactive_exit_mono if scope is not None else None
    else:
        active, since = ActiveState.INACTIVE, None
    policy = container.restart_policy or "no"
    return UnitInfo(
        name=label,
        load_state=LoadState.LOADED,
        active_state=active,
        sub_state=container.status,
        unit_file_state=UnitFileState.ENABLED if policy in KEEPING_POLICIES else UnitFileState.DISABLED,
        inactive_exit_mono=since,
        main_pid=container.pid,
        invocation_id=container.started_at,
        restart=policy,
    )


def last_option(argv: tuple[str, ...], flag: str) -> str | None:
    """FLAG's value in ARGV as written (`FLAG V` or `FLAG=V`), the last one where it is given twice,
    as a server's argument parser takes it; None when it is not given."""
    found = None
    for at, arg in enumerate(argv):
        if arg == flag and at + 1 < len(argv):
            found = argv[at + 1]
        elif arg.startswith(flag + "="):
            found = arg.partition("=")[2]
    return found
