"""A real systemd, booted with systemd-nspawn in a cached Debian 12 rootfs, for system tests.

Recipe from shared/BRIEF.md: debootstrap once (cached under $GUARDIAN_TEST_CACHE, default
/var/cache/guardian-test), boot with ``--volatile=overlay`` so every boot starts clean,
``--private-network`` so replicas' ports never clash with the host, and the source tree and the
Python dependencies bind-mounted read-only. Anything that goes wrong raises BoxError with what
nspawn said: a system test never skips quietly.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("GUARDIAN_TEST_CACHE", "/var/cache/guardian-test"))
DISK_DIR = "/srv/disk"  # in every box: a directory on the host's disk (SystemdBox.disk)
SUITE = "bookworm"
PACKAGES = ["systemd", "systemd-sysv", "dbus", "python3", "libpam-systemd", "polkitd", "procps", "faketime",
            "prometheus", "prometheus-node-exporter", "nginx-light", "etcd-server",
            # the container engines the field runs vLLM in (tests/engines.py)
            "docker.io", "podman", "netavark", "aardvark-dns", "iptables"]
# Installed for the monitoring, proxy, fleet and container tests, which start them with their own config; off at
# every boot.
DISABLED_AT_BOOT = ["prometheus.service", "prometheus-node-exporter.service", "nginx.service", "etcd.service",
                    "docker.service", "docker.socket", "containerd.service",
                    # Debian enables these; on the box's overlayfs root they fail at boot (tests/engines.py)
                    "podman.service", "podman.socket", "podman-restart.service", "podman-auto-update.service",
                    "podman-auto-update.timer"]
sys.path.insert(0, str(REPO / "packaging"))
from deps import runtime_deps  # noqa: E402  (the one dependency list: pyproject.toml)

PY_DEPS, PURE_SDIST_DEPS = runtime_deps()
GUEST_PYTHON = "3.11"  # Debian 12's python3


PR_SET_PDEATHSIG = 1  # prctl(2)


class BoxError(RuntimeError):
    pass


@contextlib.contextmanager
def host_lock(name: str):
    """One holder at a time on this machine (the pytest-xdist workers, a second suite beside this one):
    for the caches that are built once and for the host's own mounts."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".lock-{name}", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cgroup_roots() -> list[Path]:
    """Where this host mounts cgroup hierarchies that nspawn places a container in: the unified one
    and, on a hybrid host, the named systemd one."""
    if (Path("/sys/fs/cgroup") / "cgroup.controllers").exists():
        return [Path("/sys/fs/cgroup")]  # cgroup v2 only
    return [p for p in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup/systemd")) if (p / "cgroup.procs").exists()]


def _remove_cgroup(path: Path) -> None:
    """rmdir a cgroup tree bottom-up (a cgroup is removed with rmdir, its files go with it)."""
    if not path.is_dir():
        return
    for child in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            child.rmdir()
    with contextlib.suppress(OSError):
        path.rmdir()


def _key(*parts: Iterable[str]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update("\0".join(p).encode())
    return h.hexdigest()[:12]


def _need(tool: str) -> str:
    path = shutil.which(tool) or next((p for p in (f"/usr/sbin/{tool}", f"/usr/bin/{tool}") if os.path.exists(p)), None)
    if not path:
        raise BoxError(f"{tool} is not installed: run `apt-get install -y systemd-container debootstrap` "
                       "(.ci/run does this) before the system tests")
    return path


def ensure_rootfs() -> Path:
    if os.geteuid() != 0:
        raise BoxError("the system tests boot a container with systemd-nspawn and need root")
    root = CACHE / f"rootfs-{SUITE}-{_key(PACKAGES, DISABLED_AT_BOOT)}"
    if (root / ".complete").exists():
        return root
    with host_lock("rootfs"):  # the workers boot side by side: one builds, the others wait for it
        return _build_rootfs(root)


def _build_rootfs(root: Path) -> Path:
    if (root / ".complete").exists():
        return root
    debootstrap = _need("debootstrap")
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="rootfs-", dir=CACHE))
    cmd = [debootstrap, "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BoxError(f"debootstrap failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    timers = [p.name for p in (tmp / "usr/lib/systemd/system").glob("prometheus-node-exporter-*.timer")]
    proc = subprocess.run(["chroot", str(tmp), "systemctl", "disable", *DISABLED_AT_BOOT, *timers], capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BoxError(f"disabling {DISABLED_AT_BOOT} in the rootfs failed: {proc.stderr[-2000:]}")
    (tmp / ".complete").write_text(time.strftime("%F %T"))
    os.replace(tmp, root)
    return root


def ensure_deps() -> Path:
    """The guest's Python dependencies, installed from the host for the guest's CPython."""
    arch = platform.machine()
    target = CACHE / f"deps-py{GUEST_PYTHON}-{arch}-{_key(PY_DEPS, PURE_SDIST_DEPS)}"
    if not (target / ".complete").exists():
        with host_lock("deps"):
            _install_deps(target, arch)
    # mkdtemp made it 0700: a replica unit with User= (a regular user, test_system_outside.py) imports from it too
    if target.stat().st_mode & 0o005 != 0o005:
        target.chmod(0o755)
    return target


def _install_deps(target: Path, arch: str) -> Path:
    if (target / ".complete").exists():
        return target
    tmp = Path(tempfile.mkdtemp(prefix="deps-", dir=CACHE))
    plat = {"x86_64": "x86_64", "aarch64": "aarch64"}.get(arch, arch)
    base = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target", str(tmp)]
    binary = base + ["--only-binary=:all:", "--implementation", "cp", "--python-version", GUEST_PYTHON,
                     "--platform", f"manylinux2014_{plat}", "--platform", f"manylinux_2_17_{plat}",
                     "--platform", f"manylinux_2_28_{plat}"] + PY_DEPS
    for cmd in (binary, base + ["--no-deps"] + PURE_SDIST_DEPS):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise BoxError(f"installing the guest's Python dependencies failed: {proc.stderr[-3000:]}")
    (tmp / ".complete").write_text("ok")
    os.replace(tmp, target)
    return target


WRAPPER = """#!/bin/sh
export PYTHONPATH=/opt/guardian/src:/opt/guardian/deps
exec python3 -m {module} "$@"
"""
# Stand-ins for the other engines' own programs (tests/world.py EXEC_START): the simulator playing the
# engine, in the process the unit starts, so that its command line is the engine's (SGLang's
# `python3 -m sglang.launch_server ...`, `trtllm-serve MODEL ...`: a console script of python3).
SHIMS = {
    "/opt/shims/sglang/__init__.py": "",
    "/opt/shims/sglang/launch_server.py": """\"\"\"SGLang's launcher in the test box: the replica simulator playing SGLang.\"\"\"
import sys

from vllm_sim.server import main

if __name__ == "__main__":
    sys.exit(main(["--sim-engine", "sglang", *sys.argv[1:]]))
""",
    "/usr/local/bin/trtllm-serve": """#!/usr/bin/python3
\"\"\"trtllm-serve in the test box: the replica simulator playing TensorRT-LLM.\"\"\"
import sys

sys.path[:0] = ["/opt/guardian/src", "/opt/guardian/deps"]
from vllm_sim.server import main

sys.exit(main(["--sim-engine", "trtllm", *sys.argv[1:]]))
""",
}


def build_deb(out_dir: Path, target: str = "amd64-bookworm") -> Path:
    """guardian's .deb, built from this working tree by the packaging script."""
    cmd = [sys.executable, str(REPO / "packaging" / "build_deb.py"), "--target", target, "--out", str(out_dir)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise BoxError(f"building the .deb failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
    return Path(r.stdout.strip().splitlines()[-1])


class SystemdBox:
    def __init__(self, rootfs: Path, deps: Path, name: str | None = None) -> None:
        self.rootfs = rootfs
        self.deps = deps
        self.dist = Path(tempfile.mkdtemp(prefix="guardian-dist-"))
        # DISK_DIR in the box: a directory on the host's disk (the box's own root is an overlay on a
        # tmpfs, whose files are memory, never page cache): for a test of the real page cache.
        CACHE.mkdir(parents=True, exist_ok=True)
        self.disk = Path(tempfile.mkdtemp(prefix="disk-", dir=CACHE))
        self.disk.chmod(0o755)  # as /srv is: readable by every user of the box (mkdtemp makes it 0700)
        self.deb = build_deb(self.dist)
        self.name = name or f"gtest{os.getpid()}"
        self.proc: subprocess.Popen | None = None
        self.leader: int | None = None
        self.log_path = Path(tempfile.mkstemp(prefix="nspawn-", suffix=".log")[1])
        self.cgroups: list[Path] = []

    # --- lifecycle ----------------------------------------------------------------------
    def boot(self, timeout_s: float = 90.0) -> None:
        nspawn = _need("systemd-nspawn")
        # nspawn (--keep-unit, not registered) makes its supervisor and payload cgroups under its own:
        # two boxes started from one cgroup would share them. Each box gets a cgroup of its own first.
        self.cgroups = [root / f"guardian-test-{self.name}" for root in _cgroup_roots()]
        procs = [str(cg / "cgroup.procs") for cg in self.cgroups]
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
        parent = os.getpid()

        def enter_own_cgroup() -> None:
            for p in procs:
                with open(p, "w") as f:
                    f.write("0")
            # A worker that dies (killed, interrupted) takes its box with it: nspawn halts on SIGTERM.
            # (The signal follows the thread that forks: boot() runs on the worker's main thread.)
            if prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0 or os.getppid() != parent:
                os._exit(1)  # no such guard, or the worker is gone already: no box without an owner
        cmd = [nspawn, "--register=no", "--keep-unit", "-D", str(self.rootfs), "-M", self.name, "--boot",
               "--console=pipe", "--volatile=overlay", "--private-network",
               f"--bind-ro={REPO}:/opt/guardian/src", f"--bind-ro={self.deps}:/opt/guardian/deps",
               f"--bind-ro={self.dist}:/opt/guardian/dist", f"--bind={self.disk}:{DISK_DIR}",
               # dockerd and podman inside (tests/engines.py): the keyring calls and BPF_CGROUP_DEVICE programs
               # they make are filtered out by nspawn's default seccomp list.
               "--system-call-filter=add_key keyctl bpf @keyring"]
        # A unified (cgroup v2) hierarchy inside, whatever the host has: the engines need it (BPF device control).
        env = {**os.environ, "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"}
        log = open(self.log_path, "wb")
        with host_lock("nspawn-run"):  # one box at a time between making its cgroup and entering it
            Path("/run/systemd/nspawn").mkdir(parents=True, exist_ok=True)
            if subprocess.run(["mountpoint", "-q", "/run/systemd/nspawn"]).returncode != 0:
                subprocess.run(["mount", "-t", "tmpfs", "tmpfs", "/run/systemd/nspawn"], check=True)
            for root in _cgroup_roots():  # what boxes of earlier runs, killed before their halt, left
                for old in root.glob("guardian-test-gtest*"):
                    pid = old.name.removeprefix("guardian-test-gtest")
                    if pid.isdigit() and not Path(f"/proc/{pid}").exists():  # its worker is gone
                        _remove_cgroup(old)  # a cgroup that still holds a process stays (rmdir refuses)
            for cg in self.cgroups:
                cg.mkdir(exist_ok=True)
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, preexec_fn=enter_own_cgroup)
        deadline = time.monotonic() + timeout_s
        while self.leader is None:
            if self.proc.poll() is not None:
                raise BoxError(f"systemd-nspawn exited with {self.proc.returncode}: {self.log_tail()}")
            # nspawn forks helpers before the container's init: wait for the child that is systemd.
            out = subprocess.run(["ps", "--ppid", str(self.proc.pid), "-o", "pid=,comm="], capture_output=True, text=True).stdout
            pids = [int(line.split()[0]) for line in out.splitlines() if line.split()[1:] == ["systemd"]]
            if pids:
                self.leader = pids[0]
            elif time.monotonic() > deadline:
                raise BoxError(f"the container's systemd never appeared: {self.log_tail()}")
            else:
                time.sleep(0.1)
        while True:
            r = self.run(["systemctl", "is-system-running"], check=False, timeout=10)
            state = r.stdout.strip()
            if state in ("running", "degraded"):
                break
            if time.monotonic() > deadline:
                raise BoxError(f"the container's systemd did not finish booting (state {state!r}): {self.log_tail()}")
            time.sleep(0.2)
        self._install_guardian()

    def _install_guardian(self) -> None:
        """guardian as users get it: apt installs the .deb (it runs as user guardian, through polkit)."""
        self.install_deb(self.deb)
        self.systemctl("stop", "guardian.service")  # each test starts it with its own config
        self.write("/usr/local/bin/vllm-sim", WRAPPER.format(module="vllm_sim"), mode=0o755)
        self.write("/usr/local/bin/vllm-sim-ctl", WRAPPER.format(module="vllm_sim.ctl"), mode=0o755)
        for path, text in SHIMS.items():
            self.write(path, text, mode=0o755 if path.startswith("/usr/local/bin/") else 0o644)

    def install_deb(self, deb: Path, keep_conffiles: bool = False) -> subprocess.CompletedProcess:
        """KEEP_CONFFILES: as an unattended upgrade does, a config file the operator edited is kept
        when the package ships a new one (dpkg would otherwise ask)."""
        if deb.parent != self.dist:
            shutil.copy(deb, self.dist / deb.name)
        keep = ["-o", "Dpkg::Options::=--force-confdef", "-o", "Dpkg::Options::=--force-confold"] if keep_conffiles else []
        return self.run(["apt-get", "install", "-y", "-q", *keep, f"/opt/guardian/dist/{deb.name}"],
                        timeout=120)

    def halt(self) -> None:
        shutil.rmtree(self.dist, ignore_errors=True)
        shutil.rmtree(self.disk, ignore_errors=True)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for cg in self.cgroups:
            _remove_cgroup(cg)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    # --- running things inside ------------------------------------------------------------
    def run(self, cmd: list[str] | str, check: bool = True, timeout: float = 60, input: str | None = None) -> subprocess.CompletedProcess:
        if isinstance(cmd, str):
            cmd = ["sh", "-c", cmd]
        full = ["nsenter", "-t", str(self.leader), "-a", "--", "env", "-i", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "LANG=C.UTF-8", "SYSTEMD_PAGER=", "SYSTEMD_COLORS=0", *cmd]
        r = subprocess.run(full, capture_output=True, text=True, timeout=timeout, input=input)
        if check and r.returncode != 0:
            raise BoxError(f"{shlex.join(cmd)} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        return r

    def write(self, path: str, content: str, mode: int = 0o644) -> None:
        d = os.path.dirname(path)
        self.run(f"mkdir -p {shlex.quote(d)} && cat > {shlex.quote(path)}.tmp && chmod {mode:o} {shlex.quote(path)}.tmp "
                 f"&& mv {shlex.quote(path)}.tmp {shlex.quote(path)}", input=content)

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run(["systemctl", *args], check=check)

    def kill_unit(self, unit: str, signal: str = "SIGKILL") -> None:
        """`systemctl kill -s SIGNAL UNIT`. In this box (a cgroup v2 tree with no controllers, on a
        cgroup v1 host: the container engines need it) systemd signals the unit's processes and
        then fails to "kill control group ... Input/output error"; that alone is not a failure."""
        r = self.systemctl("kill", "-s", signal, unit, check=False)
        if r.returncode != 0 and "auxiliary processes: Input/output error" not in r.stderr:
            raise BoxError(f"systemctl kill -s {signal} {unit} exited {r.returncode}: {r.stderr}")

    def daemon_reload(self) -> None:
        self.systemctl("daemon-reload")

    def prop(self, unit: str, name: str) -> str:
        return self.run(["systemctl", "show", "-p", name, "--value", unit]).stdout.strip()

    def identity(self, unit: str) -> tuple[str, str]:
        """(MainPID, InvocationID): both change when a unit is restarted."""
        return self.prop(unit, "MainPID"), self.prop(unit, "InvocationID")

    def journal(self, *match: str, unit: str | None = None, since: float | None = None) -> list[dict]:
        """Journal entries (dicts of fields) matching MATCH, after epoch time SINCE."""
        cmd = ["journalctl", "--no-pager", "-o", "json"]
        if unit:
            cmd += ["-u", unit]
        if since:
            cmd += ["--since", f"@{int(since)}"]
        cmd += list(match)
        out = self.run(cmd, check=False).stdout
        lines = []
        for raw in out.splitlines():
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            if since and int(entry.get("__REALTIME_TIMESTAMP", 0)) < since * 1e6:
                continue
            if isinstance(entry.get("MESSAGE"), list):  # binary-safe form
                entry["MESSAGE"] = bytes(entry["MESSAGE"]).decode(errors="replace")
            lines.append(entry)
        return lines

    def messages(self, *match: str, since: float | None = None, unit: str | None = None) -> list[str]:
        return [e.get("MESSAGE", "") for e in self.journal(*match, unit=unit, since=since)]

    def http(self, url: str, method: str = "GET", body: dict | None = None, timeout_s: float = 5) -> tuple[int, str]:
        """An HTTP request from inside the box (its network is private)."""
        script = (
            "import json,sys,urllib.request,urllib.error\n"
            f"req=urllib.request.Request({url!r}, method={method!r}, data={json.dumps(body).encode() if body is not None else None!r},"
            " headers={'Content-Type':'application/json'})\n"
            "try:\n"
            f"  r=urllib.request.urlopen(req, timeout={timeout_s}); print(r.status); print(r.read().decode())\n"
            "except urllib.error.HTTPError as e:\n  print(e.code); print(e.read().decode())\n"
            "except Exception as e:\n  print(0); print(type(e).__name__, e)\n"
        )
        r = self.run(["python3", "-c", script], timeout=timeout_s + 10)
        code, _, text = r.stdout.partition("\n")
        return int(code), text.strip()


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.25):
    """Poll PREDICATE until it returns something truthy; fail with WHAT after TIMEOUT_S."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what} (last: {last!r})")
