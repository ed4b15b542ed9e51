"""Real container engines in the test box: Debian 12's dockerd (20.10) and podman (4.3), running the
replica simulator (vllm_sim) in containers, under systemd units shaped as in the field.

Usage (the session fixture ``engines`` in conftest.py does the first step once)::

    eng = start_engines(box)                      # dockerd + containerd up, the image in both engines
    install_unit(box, "a", docker_unit("a", 8101))
    box.systemctl("start", unit_name("a"))
    wait_serving(box, 8101)
    ...
    cleanup(box)                                  # every container and every unit written here, gone

The four shapes (NAME is the replica's name; it is also the container's name):

  a) ``docker_unit(NAME, PORT)``: ``docker run --rm --name NAME -p PORT:8000 IMAGE`` as the unit's main
     process (the docker client; the sim itself runs in docker's own scope, system.slice/docker-ID.scope),
     ExecStartPre=-docker rm -f, ExecStop=docker stop -t 10, Restart=always.
  b) ``docker_unit(NAME, PORT, host_network=True)``: the same with ``--network host``; the sim listens on
     127.0.0.1:PORT in the box's own network namespace.
  c) ``podman_unit(NAME, PORT)``: the service Quadlet (podman >= 4.4) generates for a .container file,
     as far as podman 4.3 allows: Type=notify via ``--sdnotify=conmon`` (conmon is MainPID),
     ``--cgroups=split`` and Delegate=yes (the sim is in ``vllm-NAME.service/libpod-payload-ID``, conmon in
     ``vllm-NAME.service/runtime``), KillMode=mixed, ``--cidfile=%t/%N.cid``, ``--log-driver passthrough``.
  d) ``run_unitless(box, NAME, PORT)``: ``docker run -d --restart unless-stopped``; no unit of its own.

Every unit reads guardian's env file when ``wired`` (the default), as tests/world.py's replicas do:
``Environment=GPU_MEMORY_UTILIZATION=F`` then ``EnvironmentFile=-/var/lib/guardian/replicas/NAME.env``, and the
sim gets ``--gpu-memory-utilization ${GPU_MEMORY_UTILIZATION}``.

The image, ``localhost/guardian-sim:test`` in both engines (IMAGE), is a 10 KiB tar imported with
``docker import``/``podman import``: only the merged-/usr symlinks and empty directories. Each container
bind-mounts the box's /usr, and /opt/guardian/src and /opt/guardian/deps, read-only; python3 needs nothing
from /etc (the engines provide /etc/hosts, /etc/resolv.conf and /etc/hostname).

What the box needed beyond the packages (start_engines does it; all measured on Debian 12 in nspawn):
  * the nspawn flags in systemd_box.py (a cgroup v2 hierarchy inside, keyctl/add_key/bpf allowed);
  * /var/lib/docker and /var/lib/containers on tmpfs: the box's root is an overlayfs (--volatile=overlay)
    and neither engine's overlay driver runs on top of overlayfs; podman.service, which Debian enables,
    failed at boot on exactly that and cached "overlay not supported" in /run/containers/storage, which is
    cleared once;
  * podman with runc, not crun: crun 1.8 raises RLIMIT_MEMLOCK before loading its device-cgroup BPF
    program, and the box has no CAP_SYS_RESOURCE ("crun: setrlimit (RLIM_MEMLOCK): Operation not
    permitted", fixed upstream in crun 1.13); ``pids_limit = 0`` (no pids controller in the box's
    cgroup v2 tree: it has no controllers at all on this host); the netavark network backend, named
    explicitly (Debian also ships a CNI config, which 4.3 would otherwise consider).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from dataclasses import dataclass, field

from systemd_box import BoxError, SystemdBox, wait_for

IMAGE = "localhost/guardian-sim:test"
CONTAINER_PORT = 8000
MARKER = "# written by tests/engines.py"
UNIT_DIR = "/usr/lib/systemd/system"  # where a package puts units (as tests/world.py), so `systemctl mask` works
SIM_ENV = "/opt/guardian/src:/opt/guardian/deps"
MOUNTS = ["/usr:/usr:ro", "/opt/guardian/src:/opt/guardian/src:ro", "/opt/guardian/deps:/opt/guardian/deps:ro"]

CONTAINERS_CONF = """# written by tests/engines.py
[containers]
# the box's cgroup v2 tree has no pids controller
pids_limit = 0

[network]
network_backend = "netavark"

[engine]
# crun 1.8 needs CAP_SYS_RESOURCE (RLIMIT_MEMLOCK) for its device-cgroup BPF program; runc does not
runtime = "runc"
"""

# The image's whole content; everything else is bind-mounted from the box at run time.
MAKE_IMAGE_TAR = """set -e
d=$(mktemp -d); cd "$d"; chmod 755 .
mkdir -p usr etc tmp proc sys dev run opt/guardian/src opt/guardian/deps
chmod 1777 tmp
ln -s usr/bin bin; ln -s usr/lib lib; ln -s usr/lib64 lib64; ln -s usr/sbin sbin
tar --numeric-owner --owner=0 --group=0 -cf {tar} .
cd /; rm -rf "$d"
"""
IMAGE_TAR = "/var/tmp/guardian-sim-image.tar"


@dataclass
class Engines:
    """Both engines running in BOX, with IMAGE in each. ``timings`` holds what start_engines measured (s)."""

    box: SystemdBox
    image: str = IMAGE
    timings: dict[str, float] = field(default_factory=dict)
    imported: tuple[str, ...] = ()  # the engines this call imported IMAGE into (it was not there yet)

    def docker(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        return self.box.run(["docker", *args], check=check, timeout=timeout)

    def podman(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        return self.box.run(["podman", *args], check=check, timeout=timeout)

    def sim_pid(self, engine: str, name: str) -> int:
        """The PID (in the box's PID namespace) of container NAME's first process: the sim. 0 if not running."""
        return container_pid(self.box, engine, name)


# --- starting the engines -------------------------------------------------------------------------

def _mount_tmpfs(box: SystemdBox, path: str, mode: str) -> None:
    if box.run(["mountpoint", "-q", path], check=False).returncode != 0:
        box.run(f"mkdir -p {path} && mount -t tmpfs -o mode={mode} tmpfs {path}")


def _has_image(box: SystemdBox, engine: str) -> bool:
    return box.run([engine, "image", "inspect", IMAGE], check=False, timeout=60).returncode == 0


def _docker_answers(box: SystemdBox) -> bool:
    return box.run(["docker", "info", "--format", "{{.ServerVersion}}"], check=False, timeout=20).returncode == 0


def start_engines(box: SystemdBox, timeout_s: float = 60) -> Engines:
    """Start containerd and dockerd (systemctl start docker.service), set podman up, and import IMAGE into
    both engines unless it is already there. Idempotent: a second call only checks. Raises BoxError (with
    the engine's words) when an engine does not work."""
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    box.write("/etc/containers/containers.conf", CONTAINERS_CONF)
    fresh = box.run(["mountpoint", "-q", "/var/lib/containers"], check=False).returncode != 0
    _mount_tmpfs(box, "/var/lib/docker", "0711")
    _mount_tmpfs(box, "/var/lib/containers", "0700")
    if fresh:
        # podman.service ran at boot, failed on the overlayfs root and cached that verdict here.
        box.run("rm -rf /run/containers/storage /run/libpod")
        box.systemctl("reset-failed", "podman.service", "podman-auto-update.service", check=False)
    t = time.monotonic()
    r = box.run(["systemctl", "start", "docker.service"], check=False, timeout=timeout_s)
    if r.returncode != 0:
        journal = box.run(["journalctl", "--no-pager", "-n", "40", "-u", "docker.service", "-u", "containerd.service"],
                          check=False).stdout
        raise BoxError(f"docker.service did not start: {r.stderr}\n{journal}")
    try:
        wait_for(lambda: _docker_answers(box), timeout_s, "`docker info` to answer")
    except AssertionError as e:
        raise BoxError(f"{e}: {box.run(['docker', 'info'], check=False).stderr}") from e
    timings["dockerd_s"] = time.monotonic() - t
    imported: list[str] = []
    for engine in ("docker", "podman"):
        t = time.monotonic()
        if not _has_image(box, engine):
            imported.append(engine)
            if box.run(["test", "-s", IMAGE_TAR], check=False).returncode != 0:
                box.run(MAKE_IMAGE_TAR.format(tar=IMAGE_TAR))
            r = box.run([engine, "import", IMAGE_TAR, IMAGE], check=False, timeout=max(timeout_s, 120))
            if r.returncode != 0:
                raise BoxError(f"{engine} import failed ({r.returncode}): {r.stdout[-1500:]}{r.stderr[-1500:]}")
        timings[f"{engine}_image_s"] = time.monotonic() - t
    t = time.monotonic()
    r = box.run(["podman", "info", "--format", "{{.Host.NetworkBackend}} {{.Store.GraphDriverName}} {{.Host.OCIRuntime.Name}}"],
                check=False)
    if r.returncode != 0 or r.stdout.split() != ["netavark", "overlay", "runc"]:
        raise BoxError(f"podman is not set up as expected (netavark overlay runc): {r.stdout}{r.stderr}")
    timings["podman_info_s"] = time.monotonic() - t
    timings["total_s"] = time.monotonic() - t0
    return Engines(box, IMAGE, timings, tuple(imported))


# --- unit texts -----------------------------------------------------------------------------------

def unit_name(name: str) -> str:
    """The unit of replica NAME (the convention of tests/world.py)."""
    return f"vllm-{name}.service"


def sim_command(model: str, host: str, port: int, *, fraction_arg: str, load_time_s: float = 0.3,
                sim_args: str = "") -> str:
    """The sim's command line inside a container (python3 from the box's /usr, PYTHONPATH set with -e)."""
    cmd = (f"python3 -m vllm_sim serve --model {shlex.quote(model)} --host {host} --port {port} "
           f"--gpu-memory-utilization {fraction_arg} --load-time-s {load_time_s}")
    return f"{cmd} {sim_args}".rstrip()


def _run_opts() -> str:
    return " ".join(f"-v {m}" for m in MOUNTS) + f" -e PYTHONPATH={SIM_ENV} -e PYTHONUNBUFFERED=1"


def _env_lines(name: str, fraction: float, wired: bool) -> tuple[str, str]:
    """([Service] lines, the sim's --gpu-memory-utilization argument)."""
    if not wired:
        return "", str(fraction)
    return (f"Environment=GPU_MEMORY_UTILIZATION={fraction}\n"
            f"EnvironmentFile=-/var/lib/guardian/replicas/{name}.env\n"), "${GPU_MEMORY_UTILIZATION}"


def docker_unit(name: str, host_port: int, model: str = "sim-model", sim_args: str = "", *, wired: bool = True,
                host_network: bool = False, fraction: float = 0.9, load_time_s: float = 0.3,
                restart: str = "always", restart_sec: float = 1, image: str = IMAGE) -> str:
    """Shape a) (``-p HOST_PORT:8000``, the sim on 0.0.0.0:8000 in the container's network namespace) or,
    with HOST_NETWORK, shape b) (``--network host``, the sim on 127.0.0.1:HOST_PORT)."""
    env, fraction_arg = _env_lines(name, fraction, wired)
    if host_network:
        net, sim = "--network host", sim_command(model, "127.0.0.1", host_port, fraction_arg=fraction_arg,
                                                 load_time_s=load_time_s, sim_args=sim_args)
    else:
        net, sim = f"-p {host_port}:{CONTAINER_PORT}", sim_command(model, "0.0.0.0", CONTAINER_PORT,
                                                                    fraction_arg=fraction_arg,
                                                                    load_time_s=load_time_s, sim_args=sim_args)
    return f"""{MARKER}
[Unit]
Description=simulated vLLM replica {name} (docker, {net})
After=docker.service
Requires=docker.service

[Service]
{env}ExecStartPre=-/usr/bin/docker rm -f {name}
ExecStart=/usr/bin/docker run --rm --name {name} {net} {_run_opts()} {image} {sim}
ExecStop=/usr/bin/docker stop -t 10 {name}
Restart={restart}
RestartSec={restart_sec}

[Install]
WantedBy=multi-user.target
"""


def podman_unit(name: str, host_port: int, model: str = "sim-model", sim_args: str = "", *, wired: bool = True,
                fraction: float = 0.9, load_time_s: float = 0.3, restart: str = "always", restart_sec: float = 1,
                image: str = IMAGE) -> str:
    """Shape c): the service Quadlet writes for

        [Container]
        Image=IMAGE
        ContainerName=NAME
        PublishPort=HOST_PORT:8000
        Volume=/usr:/usr:ro ...
        Environment=PYTHONPATH=...
        Exec=python3 -m vllm_sim serve ...
        [Service]
        Environment=GPU_MEMORY_UTILIZATION=0.9
        EnvironmentFile=-/var/lib/guardian/replicas/NAME.env
        Restart=always

    The keys of Quadlet's early (4.4-4.6) output, as recalled from its source, not checked against a 4.4
    install (none here: Debian 12 ships 4.3, without Quadlet): Environment=PODMAN_SYSTEMD_UNIT=%n,
    KillMode=mixed, ExecStop and ExecStopPost ``podman rm -f -i --cidfile=%t/%N.cid``, Delegate=yes,
    Type=notify, NotifyAccess=all, SyslogIdentifier=%N, RequiresMountsFor=%t/containers, and ``run --cidfile
    --replace --rm --log-driver passthrough --cgroups=split --sdnotify=conmon -d``; plus the cidfile removal
    before start and after stop that ``podman generate systemd --new`` writes (a crash leaves a
    stale cidfile: `run --cidfile` fails when the file exists). Checked against current upstream quadlet.go (podman 5): same Delegate/KillMode/Type/
    NotifyAccess/--replace --rm --cgroups=split --sdnotify=conmon -d, but ExecStop/ExecStopPost are
    ``podman rm -v -f -i NAME`` (no cidfile) and no ``--runtime``. Departures, forced by this box: no
    ``--runtime crun`` (early Quadlet wrote it; crun cannot run here, see the module's docstring: containers.conf
    makes runc the runtime), and the container is named NAME (ContainerName=NAME) where Quadlet's default
    is systemd-%N."""
    env, fraction_arg = _env_lines(name, fraction, wired)
    sim = sim_command(model, "0.0.0.0", CONTAINER_PORT, fraction_arg=fraction_arg, load_time_s=load_time_s,
                      sim_args=sim_args)
    return f"""{MARKER}
[Unit]
Description=simulated vLLM replica {name} (podman, Quadlet-style)
RequiresMountsFor=%t/containers

[Service]
{env}Restart={restart}
RestartSec={restart_sec}
Environment=PODMAN_SYSTEMD_UNIT=%n
KillMode=mixed
ExecStartPre=-/bin/rm -f %t/%N.cid
ExecStop=/usr/bin/podman rm -f -i --cidfile=%t/%N.cid
ExecStopPost=-/usr/bin/podman rm -f -i --cidfile=%t/%N.cid
ExecStopPost=-/bin/rm -f %t/%N.cid
Delegate=yes
Type=notify
NotifyAccess=all
SyslogIdentifier=%N
ExecStart=/usr/bin/podman run --name {name} --cidfile=%t/%N.cid --replace --rm --log-driver passthrough --cgroups=split --sdnotify=conmon -d -p {host_port}:{CONTAINER_PORT} {_run_opts()} {image} {sim}

[Install]
WantedBy=multi-user.target
"""


def install_unit(box: SystemdBox, name: str, text: str, reload: bool = True) -> str:
    """Write TEXT as replica NAME's unit (in UNIT_DIR) and daemon-reload; returns the unit's name."""
    unit = unit_name(name)
    box.write(f"{UNIT_DIR}/{unit}", text)
    if reload:
        box.daemon_reload()
    return unit


def run_unitless(box: SystemdBox, name: str, host_port: int, model: str = "sim-model", sim_args: str = "", *,
                 fraction: float = 0.9, load_time_s: float = 0.3, image: str = IMAGE) -> str:
    """Shape d): ``docker run -d --restart unless-stopped --name NAME -p HOST_PORT:8000 IMAGE sim...``, no unit
    (dockerd restarts it; it lives in system.slice/docker-ID.scope). Returns the container's ID."""
    sim = sim_command(model, "0.0.0.0", CONTAINER_PORT, fraction_arg=str(fraction), load_time_s=load_time_s,
                      sim_args=sim_args)
    cmd = (f"docker run -d --restart unless-stopped --name {name} -p {host_port}:{CONTAINER_PORT} "
           f"{_run_opts()} {image} {sim}")
    return box.run(cmd, timeout=60).stdout.strip()


# --- looking --------------------------------------------------------------------------------------

def wait_serving(box: SystemdBox, port: int, timeout_s: float = 30, host: str = "127.0.0.1") -> None:
    """Until GET /health on HOST:PORT, from inside the box, answers 200."""
    wait_for(lambda: box.http(f"http://{host}:{port}/health", timeout_s=2)[0] == 200, timeout_s,
             f"the sim on {host}:{port} to serve /health")


def container_pid(box: SystemdBox, engine: str, name: str) -> int:
    """PID of container NAME's first process as the box sees it (0: not running or no such container)."""
    r = box.run([engine, "inspect", "--format", "{{.State.Pid}}", name], check=False)
    try:
        return int(r.stdout.strip()) if r.returncode == 0 else 0
    except ValueError:
        return 0


def cgroup_of(box: SystemdBox, pid: int) -> str:
    """PID's cgroup v2 path, relative to the box's root ("/system.slice/docker.service"); "" if it is gone."""
    out = box.run(["cat", f"/proc/{pid}/cgroup"], check=False).stdout
    return next((line[3:] for line in out.splitlines() if line.startswith("0::")), "")


_SS_USER = re.compile(r'\("([^"]*)",pid=(\d+),fd=(\d+)\)')


def listeners(box: SystemdBox, port: int, netns_pid: int | None = None) -> list[dict]:
    """The listening TCP sockets on PORT (in the box's network namespace, or in NETNS_PID's): one dict a
    socket and holder, {"local", "comm", "pid", "fd", "socket_cgroup", "cgroup"}: socket_cgroup is the
    cgroup the socket was created in (ss -e), cgroup the holding process's cgroup now."""
    cmd = ["ss", "-Hltnpe", "sport", "=", f":{port}"]
    if netns_pid:
        cmd = ["nsenter", "-t", str(netns_pid), "-n", "--", *cmd]
    out = box.run(cmd, check=False).stdout
    found = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        m = re.search(r"cgroup:(\S*)", line)
        for comm, pid, fd in _SS_USER.findall(line):
            found.append({"local": parts[3], "comm": comm, "pid": int(pid), "fd": int(fd),
                          "socket_cgroup": m.group(1) if m else None, "cgroup": cgroup_of(box, int(pid))})
    return found


def readable_by_nobody(box: SystemdBox, path: str) -> tuple[bool, str]:
    """Whether user nobody (65534, no groups) can read PATH in the box: (ok, first 200 characters of what it
    read, or its error)."""
    r = box.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "cat", path], check=False)
    return r.returncode == 0 and bool(r.stdout), (r.stdout if r.returncode == 0 else r.stderr).strip()[:200]


def cmdline(box: SystemdBox, pid: int) -> str:
    return box.run(["cat", f"/proc/{pid}/cmdline"], check=False).stdout.replace("\0", " ").strip()


# --- teardown -------------------------------------------------------------------------------------

def cleanup(box: SystemdBox) -> None:
    """Stop, disable and delete every unit written here (found by MARKER), then remove every container of
    both engines. The engines and the image stay."""
    out = box.run(f"grep -l -s -x -F {shlex.quote(MARKER)} {UNIT_DIR}/*.service /etc/systemd/system/*.service",
                  check=False).stdout
    paths = out.split()
    units = sorted({p.rsplit("/", 1)[1] for p in paths})
    if units:
        box.run(["systemctl", "disable", "--now", *units], check=False, timeout=120)
        box.run(["systemctl", "unmask", *units], check=False)
        box.run(["rm", "-f", *paths], check=False)
        box.daemon_reload()
        box.systemctl("reset-failed", *units, check=False)
    if box.run(["systemctl", "is-active", "-q", "docker.service"], check=False).returncode == 0:
        box.run("ids=$(docker ps -aq); [ -z \"$ids\" ] || docker rm -f $ids", check=False, timeout=120)
    box.run(["podman", "rm", "-a", "-f", "-i"], check=False, timeout=120)
