"""A real llama.cpp ``llama-server`` (CPU build) in the test box, under systemd, serving a tiny GGUF made here.

Usage (tests/test_system_llamacpp.py)::

    bed = install_llama(box)                           # the sid root bound at /opt/llama-sid, user, model
    unit = install_llama_unit(box, "a", 8401)          # llama-server-a.service, written and daemon-reloaded
    box.systemctl("start", unit)
    wait_llama(box, 8401)                              # /health 200 {"status":"ok"}
    with frozen_engine(box, unit):                     # main thread held by ptrace: /health 200, the rest hangs
        ...
    with frozen_server(box, unit):                     # SIGSTOP: nothing answers
        ...
    cleanup(box)

Why this road (llama-server from Debian unstable's ``llama.cpp-tools``, run through ``RootDirectory=``):

  * A real, packaged llama-server (build b11669-Debian, 1:0.7.0+dfsg-2, libggml0 0.27.0) in about a
    minute: ``debootstrap --variant=minbase --include=llama.cpp-tools,curl sid ROOT`` (47 s here, 2 cores).
    Building llama.cpp from source in the Debian 12 box (cmake, llama-cpp-python's sdist) took about ten
    minutes on 2 cores, in every fresh CI run.
  * Its libraries need a newer glibc/libstdc++ than Debian 12's (GLIBCXX_3.4.31 is missing in the box), so
    llama-server runs in that sid root: the box's systemd starts it with ``RootDirectory=/opt/llama-sid``.
    It is a real unit of the box: its process is in the unit's cgroup, in the box's PID namespace and its
    /proc, signalled, stopped and restarted by the box's systemd; only its files come from sid.
  * The sid root is cached under $GUARDIAN_TEST_CACHE (``rootfs-sid-llama-KEY``; KEY changes with
    LLAMA_PACKAGES and LLAMA_RECIPE) and bound into a booted box read-only at /opt/llama-sid
    (``bind_into_box``: the kernel's open_tree/move_mount, as ``machinectl bind`` does, so the session's
    shared box needs no extra nspawn flag and a box that never runs llama-server never builds the root).

What Debian's ``llama.cpp-services`` (1:0.7.0+dfsg-2, sid) ships, read from the package (ensure_llama_rootfs
downloads it with ``apt-get download`` and unpacks it into the sid root, where the tests read it again):

  /usr/lib/systemd/system/llama-server.service::

    [Unit]
    Description=llama.cpp LLM inference server
    After=network-online.target

    [Service]
    User=_llama-server
    Group=_llama-server

    ExecStart=/usr/bin/llama-server

    Environment=LLAMA_CACHE=/var/cache/llama-server
    EnvironmentFile=/etc/default/llama-server

    [Install]
    WantedBy=multi-user.target

  /usr/lib/sysusers.d/llama.cpp-services.conf: ``u! _llama-server - "llama.cpp server" /var/lib/llama-server``
  /usr/lib/tmpfiles.d/llama.cpp-services.conf: ``d /var/lib/llama-server 0755 _llama-server _llama-server`` and
  ``d /var/cache/llama-server 0755 _llama-server _llama-server``
  /etc/default/llama-server (a conffile): only comments, e.g. ``#LLAMA_ARG_HOST=0.0.0.0``,
  ``#LLAMA_ARG_HF_REPO=allenai/OLMo-2-0425-1B-Instruct-GGUF``, ``#LLAMA_ARG_CTX_SIZE=10240``, ``#LLAMA_API_KEY=``,
  and ``#SERVER_HOME=``/``SERVER_CACHE``/``SERVER_NAME``/``SERVER_USER``/``SERVER_GROUP`` lines the unit never reads.

  So: no arguments at all, everything through ``LLAMA_ARG_*`` environment variables (llama-server reads one
  per option; a command-line flag wins over its variable); a fixed system user (not DynamicUser); no
  Restart= (systemd's default, no); Type=simple; no --metrics unless the operator sets
  LLAMA_ARG_ENDPOINT_METRICS; llama-server's own default port is 9931 and it listens on 127.0.0.1.

Our unit (``llama_unit``) is that unit, for replica NAME: the same User=/Group=, the same bare
``ExecStart=/usr/bin/llama-server`` (``extra_args`` appended when given), the same Environment=LLAMA_CACHE and a
required EnvironmentFile=/etc/default/llama-server-NAME holding the LLAMA_ARG_* lines (model, port, alias,
ctx, metrics), then guardian's ``EnvironmentFile=-/var/lib/guardian/replicas/NAME.env`` (as tests/world.py's
replicas; read last, so a LLAMA_ARG_* it sets wins over the defaults file), and no Restart= unless asked.
It differs only by what running sid's binary in a Debian 12 box needs: ``RootDirectory=/opt/llama-sid``
(systemd mounts /proc, /sys and /dev in it: MountAPIVFS= defaults to yes with RootDirectory=, checked in
the test) and ``BindReadOnlyPaths=`` of the box's model directory at /var/lib/llama-server/models (the
root is read-only). ``style="argv"`` gives the DGX Spark playbook's form instead: every option as a flag on
ExecStart= (``-m M --host 127.0.0.1 --port P [--metrics] [-a ALIAS] -c N``), no defaults file.

Freezing it (helpers below):

  a) ``frozen_server``: SIGSTOP to the unit's processes (``systemctl kill -s SIGSTOP``): nothing answers.
  b) ``frozen_engine``: only llama-server's main thread (tid == pid), which runs the task loop
     (``queue_tasks.start_loop()``) and calls llama_decode, is stopped: tests/ptrace_hold.py does
     PTRACE_SEIZE + PTRACE_INTERRUPT on it and holds it, in a transient unit ``llama-freeze-NAME.service``;
     stopping that unit (or SIGKILL to it) releases the thread. The box has no Yama (no
     /proc/sys/kernel/yama on this kernel; where it exists ptrace_scope <= 2 lets root do this) and
     nspawn keeps CAP_SYS_PTRACE and allows ptrace(2). Measured in b11669-Debian (test_system_llamacpp.py):
       - 14 threads, all comm "llama-server". During a completion the CPU goes to the main thread and ONE
         other (ggml's CPU threadpool, OpenMP, n_threads = 2 here: ~1.1 and ~1.0 cores); the rest are the
         HTTP server's. With the main thread held, the whole process uses 0 ticks: nothing progresses.
       - /health answers 200 at once throughout (the field's #27388); a new completion never answers.
       - /metrics and /slots: held while idle, they queue a task and wait (no answer in 5 s). Held while a
         request is processing, they answer AT ONCE (0.07-0.13 s) from a copy the main loop keeps
         (``server_routes::update_cached_responses`` in libllama-server-impl; the source was not read), with
         every counter standing still (n_decode_total, /slots next_token.n_decoded) and
         requests_processing 1: in 8 of 9 busy holds over three runs; the ninth (held 0.3 s into a fresh
         server's first completion, nothing read before) waited. So a bounded read of /metrics is NOT a
         liveness probe of a busy llama-server in this build; counters that stop moving are.
       - ``systemctl stop`` of an engine-frozen llama-server: SIGTERM cannot end it (the held main thread
         must leave the loop), systemd SIGKILLs it at TimeoutStopSec (Result=timeout).
  c) ``start_load``: N concurrent completions with max_tokens, from inside the box; ``long_prompt(n)`` is
     a prompt of exactly n tokens for the tiny model (digits never merge in its vocabulary). Prefill is
     quadratic here (2 cores shared with other work; times vary 2x between runs): -c 32768: 4,000 tokens
     0.9 s, 16,000 19.6 s, 30,000 40 s, 30,000 in one llama_decode (-b/-ub 32768) 93 s; -c 16384: 4,000
     2.0 s, 12,000 10.2 s, 12,000 in one llama_decode 9.6 s. /health and /metrics answered every poll
     meanwhile, even during the one long llama_decode (worst 0.47 s): /metrics from the main loop's copy.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from systemd_box import CACHE, BoxError, SystemdBox, _key, _need, host_lock, wait_for

LLAMA_SUITE = "sid"
LLAMA_PACKAGES = ["llama.cpp-tools", "curl"]
SERVICES_PACKAGE = "llama.cpp-services"  # downloaded and unpacked only: its systemd dependency is not wanted
# Bump when what _build_llama_rootfs does after debootstrap changes: the cache key follows it.
LLAMA_RECIPE = "2: services unpacked, package dirs made, apt caches dropped, root 0755"
MIRROR = os.environ.get("GUARDIAN_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")

BOX_ROOT = "/opt/llama-sid"  # where the sid root is bound in the box (read-only)
MODEL_DIR_IN_ROOT = "/var/lib/llama-server/models"  # where the unit's process sees the models
MODEL_SUBDIR = "llama"  # the models' directory in the box's disk directory (SystemdBox.disk)
TINY = "tiny.gguf"
HOLDER = "/opt/guardian/src/tests/ptrace_hold.py"
UNIT_DIR = "/usr/lib/systemd/system"  # as tests/world.py and tests/engines.py
MARKER = "# written by tests/llamacpp.py"
USER = "_llama-server"
SYSUSERS = "/usr/lib/sysusers.d/llama.cpp-services.conf"
TMPFILES = "/usr/lib/tmpfiles.d/llama.cpp-services.conf"
SHIPPED_UNIT = "/usr/lib/systemd/system/llama-server.service"  # in the sid root, from llama.cpp-services


# --- the sid root ---------------------------------------------------------------------------------

def ensure_llama_rootfs() -> Path:
    """The cached sid root with llama-server (and llama.cpp-services' files unpacked in it); built once per
    host under a host lock (about a minute), then reused. Raises BoxError with what failed."""
    if os.geteuid() != 0:
        raise BoxError("the llama-server root is built with debootstrap and needs root")
    root = CACHE / f"rootfs-{LLAMA_SUITE}-llama-{_key(LLAMA_PACKAGES, [SERVICES_PACKAGE, LLAMA_RECIPE])}"
    if (root / ".complete").exists():
        return root
    with host_lock("rootfs-llama"):
        return _build_llama_rootfs(root)


def _chroot(root: Path, *cmd: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(["chroot", str(root), *cmd], capture_output=True, text=True, timeout=timeout, env=env)


def _build_llama_rootfs(root: Path) -> Path:
    if (root / ".complete").exists():
        return root
    debootstrap = _need("debootstrap")
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="rootfs-llama-", dir=CACHE))
    started = time.monotonic()
    try:
        cmd = [debootstrap, "--variant=minbase", f"--include={','.join(LLAMA_PACKAGES)}", LLAMA_SUITE, str(tmp), MIRROR]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        if r.returncode != 0:
            raise BoxError(f"debootstrap of {LLAMA_SUITE} with {LLAMA_PACKAGES} failed ({r.returncode}); "
                           f"llama-server cannot be installed this way:\n{r.stdout[-2500:]}{r.stderr[-2500:]}")
        debootstrap_s = time.monotonic() - started
        # llama.cpp-services, for its unit and files only: apt-get download with the package lists debootstrap
        # left (no `apt-get update`: a mirror snapshot past its Release's Valid-Until would refuse it).
        shutil.copy("/etc/resolv.conf", tmp / "etc/resolv.conf")
        (tmp / "tmp/services").mkdir(parents=True, exist_ok=True)
        r = _chroot(tmp, "sh", "-c", f"cd /tmp/services && apt-get -q -o APT::Sandbox::User=root download {SERVICES_PACKAGE}")
        debs = list((tmp / "tmp/services").glob("*.deb"))
        if r.returncode != 0 or len(debs) != 1:
            raise BoxError(f"apt-get download {SERVICES_PACKAGE} in the sid root failed ({r.returncode}): "
                           f"{r.stdout[-1500:]}{r.stderr[-1500:]}")
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(tmp)], check=True, capture_output=True)
        services_version = subprocess.run(["dpkg-deb", "-f", str(debs[0]), "Version"], capture_output=True,
                                          text=True, check=True).stdout.strip()
        shutil.rmtree(tmp / "tmp/services")
        # what the package's tmpfiles.d would make; the model directory the unit binds over
        for d in ("var/lib/llama-server", "var/cache/llama-server", MODEL_DIR_IN_ROOT.lstrip("/")):
            (tmp / d).mkdir(parents=True, exist_ok=True)
        r = _chroot(tmp, "llama-server", "--version")
        if r.returncode != 0:
            raise BoxError(f"llama-server --version in the sid root failed ({r.returncode}): {r.stderr[-2000:]}")
        versions = _chroot(tmp, "dpkg-query", "-W", "-f", "${Package} ${Version}\n",
                           "llama.cpp-tools", "libllama0", "libggml0", "libc6").stdout
        _chroot(tmp, "apt-get", "clean")
        for lists in (tmp / "var/lib/apt/lists").glob("*_*"):
            lists.unlink()
        (tmp / "etc/resolv.conf").unlink()
        facts = {"built": time.strftime("%F %T"), "build_s": round(time.monotonic() - started, 1),
                 "debootstrap_s": round(debootstrap_s, 1), "mirror": MIRROR, "packages": LLAMA_PACKAGES,
                 "llama_server_version": (r.stdout + r.stderr).strip().splitlines(),
                 "dpkg": versions.strip().splitlines(), "llama.cpp-services": services_version}
        (tmp / ".llama-facts.json").write_text(json.dumps(facts, indent=1))
        tmp.chmod(0o755)  # mkdtemp made it 0700: it is the unit's "/", and the unit runs as _llama-server
        (tmp / ".complete").write_text(facts["built"])
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, root)
    return root


def rootfs_facts(root: Path) -> dict:
    """What the build recorded: versions, build time (cold), the mirror."""
    return json.loads((root / ".llama-facts.json").read_text())


# --- binding it into a running box ----------------------------------------------------------------

_BIND_SCRIPT = r"""
import ctypes, os, sys
src, leader, dst, ro = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
SYS_open_tree, SYS_move_mount, SYS_mount_setattr = 428, 429, 442  # the same on every architecture
AT_FDCWD, AT_EMPTY_PATH, AT_RECURSIVE = -100, 0x1000, 0x8000
OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC, MOVE_MOUNT_F_EMPTY_PATH, MOUNT_ATTR_RDONLY = 1, 0o2000000, 0x4, 0x1
def check(ret, what):
    if ret < 0:
        e = ctypes.get_errno()
        sys.exit(f"{what}: {os.strerror(e)} (errno {e})")
    return ret
fd = check(libc.syscall(SYS_open_tree, AT_FDCWD, src.encode(), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE),
           f"open_tree({src})")
if ro:
    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]
    attr = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    check(libc.syscall(SYS_mount_setattr, fd, b"", AT_EMPTY_PATH | AT_RECURSIVE, ctypes.byref(attr),
                       ctypes.sizeof(attr)), "mount_setattr(RDONLY)")
ns = os.open(f"/proc/{leader}/ns/mnt", os.O_RDONLY)
CLONE_NEWNS = 0x00020000
check(libc.setns(ns, CLONE_NEWNS), "setns(the box's mount namespace)")  # single-threaded; root, cwd: the box's
check(libc.syscall(SYS_move_mount, fd, b"", AT_FDCWD, dst.encode(), MOVE_MOUNT_F_EMPTY_PATH), f"move_mount(-> {dst})")
"""


def bind_into_box(box: SystemdBox, src: Path, dst: str, readonly: bool = True) -> None:
    """Bind host directory SRC at DST in the running BOX (its mount namespace), read-only unless told:
    a detached clone of SRC's mount tree (open_tree) moved into the box's namespace (move_mount), what
    ``machinectl bind`` does on newer systemd. Units started afterwards see it; it goes with the box."""
    box.run(["mkdir", "-p", dst])
    r = subprocess.run([sys.executable, "-c", _BIND_SCRIPT, str(src), str(box.leader), dst, "1" if readonly else "0"],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise BoxError(f"binding {src} at {dst} in box {box.name} failed: {r.stderr.strip()[-1500:]}")


# --- the tiny model -------------------------------------------------------------------------------

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE vocabulary's 256 base tokens)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


MERGES = ["Ġ t", "h e", "Ġ a", "i n", "Ġt he", "e r", "o n", "Ġ s"]  # digits appear in none (long_prompt)
EOS = "<|endoftext|>"


def make_tiny_gguf(path: Path | str, *, n_embd: int = 64, n_layer: int = 2, n_ff: int = 128, n_head: int = 4,
                   ctx_train: int = 32768, seed: int = 20261203) -> Path:
    """A tiny llama-architecture GGUF at PATH: random F16 weights (fixed SEED: the same bytes every time),
    a byte-level BPE tokenizer ("gpt2", pre-tokenizer "gpt-2": 256 byte tokens, 8 merges, EOS
    <|endoftext|>, no BOS added). The defaults: 99,200 parameters, 204,800 bytes, written in ~20 ms.
    The output projection is tied to token_embd (llama.cpp falls back to it)."""
    import gguf  # the test extra "gguf" (pyproject.toml); imported here: only the llama tests need it
    import numpy as np

    b2u = _bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES] + [EOS]
    n_vocab = len(tokens)
    types = [gguf.TokenType.NORMAL] * (n_vocab - 1) + [gguf.TokenType.CONTROL]
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("guardian-tiny")
    w.add_context_length(ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(n_vocab - 1)
    w.add_eos_token_id(n_vocab - 1)
    w.add_add_bos_token(False)
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> "np.ndarray":  # numpy (rows, cols) is ggml's ne = (cols, rows)
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float16)

    def ones() -> "np.ndarray":
        return np.ones(n_embd, dtype=np.float32)

    w.add_tensor("token_embd.weight", mat(n_vocab, n_embd))
    w.add_tensor("output_norm.weight", ones())
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones())
        for t in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(p + t + ".weight", mat(n_embd, n_embd))
        w.add_tensor(p + "ffn_norm.weight", ones())
        w.add_tensor(p + "ffn_gate.weight", mat(n_ff, n_embd))
        w.add_tensor(p + "ffn_up.weight", mat(n_ff, n_embd))
        w.add_tensor(p + "ffn_down.weight", mat(n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def long_prompt(n_tokens: int) -> str:
    """A prompt that is exactly N_TOKENS tokens for the tiny model (one token a digit: no merge has one)."""
    return ("0123456789" * (n_tokens // 10 + 1))[:n_tokens]


# --- the bed in a box -----------------------------------------------------------------------------

@dataclass
class LlamaBed:
    root: Path  # the sid root on the host
    models: Path  # the models' directory on the host (in the box: /srv/disk/llama, bound into each unit)
    box_models: str  # the same directory as the box sees it
    facts: dict


def install_llama(box: SystemdBox) -> LlamaBed:
    """Everything the llama-server units need in BOX, idempotent: the sid root bound read-only at BOX_ROOT,
    the package's user and directories (its sysusers.d and tmpfiles.d files, applied by the box's systemd),
    and the tiny model (TINY) in the box's disk directory."""
    root = ensure_llama_rootfs()
    if box.run(["mountpoint", "-q", BOX_ROOT], check=False).returncode != 0:
        bind_into_box(box, root, BOX_ROOT, readonly=True)
    # Debian 12's systemd-sysusers (252) reads `u!` (a locked account, newer syntax) as well? Write plain `u`
    # if it does not: the account is what matters here.
    sysusers = (root / SYSUSERS.lstrip("/")).read_text()
    box.write(SYSUSERS, sysusers)
    r = box.run(["systemd-sysusers", SYSUSERS], check=False)
    if r.returncode != 0 or box.run(["getent", "passwd", USER], check=False).returncode != 0:
        box.write(SYSUSERS, sysusers.replace("u! ", "u "))
        box.run(["systemd-sysusers", SYSUSERS])
    box.write(TMPFILES, (root / TMPFILES.lstrip("/")).read_text())
    box.run(["systemd-tmpfiles", "--create", TMPFILES])
    models = box.disk / MODEL_SUBDIR
    models.mkdir(exist_ok=True)
    models.chmod(0o755)
    if not (models / TINY).exists():
        make_tiny_gguf(models / TINY)
    return LlamaBed(root=root, models=models, box_models=f"/srv/disk/{MODEL_SUBDIR}", facts=rootfs_facts(root))


def unit_name(name: str) -> str:
    return f"llama-server-{name}.service"


def defaults_path(name: str) -> str:
    return f"/etc/default/llama-server-{name}"


def llama_env(port: int, *, model: str = TINY, metrics: bool = True, alias: str | None = None, ctx: int = 4096,
              parallel: int | None = None, threads: int | None = None, host: str = "127.0.0.1",
              extra: dict[str, str] | None = None) -> dict[str, str]:
    """The LLAMA_ARG_* variables of a replica (what /etc/default/llama-server-NAME holds)."""
    env = {"LLAMA_ARG_MODEL": f"{MODEL_DIR_IN_ROOT}/{model}", "LLAMA_ARG_HOST": host, "LLAMA_ARG_PORT": str(port),
           "LLAMA_ARG_CTX_SIZE": str(ctx)}
    if alias:
        env["LLAMA_ARG_ALIAS"] = alias
    if metrics:
        env["LLAMA_ARG_ENDPOINT_METRICS"] = "1"
    if parallel:
        env["LLAMA_ARG_N_PARALLEL"] = str(parallel)
    if threads:
        env["LLAMA_ARG_THREADS"] = str(threads)
    return {**env, **(extra or {})}


def _argv(env: dict[str, str]) -> list[str]:
    flags = {"LLAMA_ARG_MODEL": "-m", "LLAMA_ARG_HOST": "--host", "LLAMA_ARG_PORT": "--port", "LLAMA_ARG_ALIAS": "-a",
             "LLAMA_ARG_CTX_SIZE": "-c", "LLAMA_ARG_N_PARALLEL": "-np", "LLAMA_ARG_THREADS": "-t"}
    out: list[str] = []
    for k, v in env.items():
        if k == "LLAMA_ARG_ENDPOINT_METRICS":
            out.append("--metrics")
        elif k in flags:
            out += [flags[k], v]
        else:
            raise ValueError(f"no flag known for {k}")
    return out


def llama_unit(name: str, port: int, extra_args: tuple[str, ...] | list[str] = (), metrics: bool = True,
               alias: str | None = None, *, ctx: int = 4096, parallel: int | None = None, threads: int | None = None,
               model: str = TINY, restart: str | None = None, style: str = "env", service_extra: str = "") -> str:
    """The unit text of replica NAME on PORT (see the module header: llama.cpp-services' unit plus
    RootDirectory= and the model's bind). STYLE "env": the package's form, options as LLAMA_ARG_* in
    /etc/default/llama-server-NAME (written by install_llama_unit; EXTRA_ARGS go on ExecStart=); "argv": the
    Spark playbook's form, every option a flag on ExecStart=. RESTART: None as the package (no Restart=)."""
    env = llama_env(port, model=model, metrics=metrics, alias=alias, ctx=ctx, parallel=parallel, threads=threads)
    if style == "env":
        exec_start = shlex.join(["/usr/bin/llama-server", *extra_args])
        env_file = f"EnvironmentFile={defaults_path(name)}\n"
    elif style == "argv":
        exec_start = shlex.join(["/usr/bin/llama-server", *_argv(env), *extra_args])
        env_file = ""
    else:
        raise ValueError(f"style {style!r}: 'env' or 'argv'")
    return f"""{MARKER}
[Unit]
Description=llama.cpp LLM inference server (replica {name})
After=network-online.target

[Service]
User={USER}
Group={USER}

ExecStart={exec_start}

Environment=LLAMA_CACHE=/var/cache/llama-server
{env_file}EnvironmentFile=-/var/lib/guardian/replicas/{name}.env
{f"Restart={restart}" + chr(10) if restart else ""}
# the test bed's only difference: sid's llama-server in its own root (Debian 12's glibc is too old for it)
RootDirectory={BOX_ROOT}
BindReadOnlyPaths=/srv/disk/{MODEL_SUBDIR}:{MODEL_DIR_IN_ROOT}
{service_extra}
[Install]
WantedBy=multi-user.target
"""


def install_llama_unit(box: SystemdBox, name: str, port: int, extra_args: tuple[str, ...] | list[str] = (),
                       metrics: bool = True, alias: str | None = None, *, reload: bool = True, **kw) -> str:
    """Write replica NAME's unit (llama_unit) and, for the "env" style, its /etc/default file; daemon-reload.
    Returns the unit's name. install_llama(box) must have run."""
    text = llama_unit(name, port, extra_args, metrics, alias, **kw)
    if kw.get("style", "env") == "env":
        env = llama_env(port, model=kw.get("model", TINY), metrics=metrics, alias=alias, ctx=kw.get("ctx", 4096),
                        parallel=kw.get("parallel"), threads=kw.get("threads"))
        box.write(defaults_path(name), f"{MARKER}\n# as the package's /etc/default/llama-server: LLAMA_ARG_* lines\n"
                  + "".join(f"{k}={v}\n" for k, v in env.items()))
    unit = unit_name(name)
    box.write(f"{UNIT_DIR}/{unit}", text)
    if reload:
        box.daemon_reload()
    return unit


def wait_llama(box: SystemdBox, port: int, timeout_s: float = 30) -> None:
    """Until /health on 127.0.0.1:PORT, from inside the box, answers 200 (503 while the model loads)."""
    wait_for(lambda: box.http(f"http://127.0.0.1:{port}/health", timeout_s=2)[0] == 200, timeout_s,
             f"llama-server on port {port} to serve /health")


def main_pid(box: SystemdBox, unit: str) -> int:
    pid = int(box.prop(unit, "MainPID") or 0)
    if not pid:
        raise BoxError(f"{unit} has no main process")
    return pid


def thread_state(box: SystemdBox, pid: int, tid: int | None = None) -> str:
    """The state letter of thread TID (default: the main thread) of PID: R, S, T (stopped), t (traced)."""
    r = box.run(["cat", f"/proc/{pid}/task/{tid or pid}/stat"], check=False)
    return r.stdout.rsplit(")", 1)[1].split()[0] if r.returncode == 0 else ""


def threads(box: SystemdBox, pid: int) -> list[dict]:
    """PID's threads: tid, comm, state, utime+stime (clock ticks)."""
    script = (f"for t in /proc/{pid}/task/*; do echo \"${{t##*/}} $(cat $t/comm) "
              f"$(sed 's/.*) //' $t/stat | cut -d' ' -f1,12,13)\"; done")
    out = box.run(script, check=False).stdout
    rows = []
    for line in out.splitlines():
        tid, comm, state, ut, st = line.split()
        rows.append({"tid": int(tid), "comm": comm, "state": state, "cpu_ticks": int(ut) + int(st)})
    return rows


# --- freezing -------------------------------------------------------------------------------------

def freeze_server(box: SystemdBox, unit: str) -> None:
    """a) SIGSTOP every process of UNIT (the whole llama-server): nothing answers, not even /health."""
    box.kill_unit(unit, "SIGSTOP")
    pid = main_pid(box, unit)
    wait_for(lambda: thread_state(box, pid) == "T", 5, f"{unit}'s main process to stop")


def thaw_server(box: SystemdBox, unit: str) -> None:
    box.kill_unit(unit, "SIGCONT")


@contextlib.contextmanager
def frozen_server(box: SystemdBox, unit: str) -> Iterator[None]:
    freeze_server(box, unit)
    try:
        yield
    finally:
        thaw_server(box, unit)


def holder_unit(unit: str) -> str:
    return "llama-freeze-" + unit.removesuffix(".service") + ".service"


def freeze_engine(box: SystemdBox, unit: str) -> str:
    """b) Stop only llama-server's main thread (tid == pid: its task loop, the one that calls llama_decode),
    held by tests/ptrace_hold.py in a transient unit, which is returned: /health keeps answering, /metrics,
    /slots and completions wait. thaw_engine (or stopping the returned unit) releases it."""
    pid = main_pid(box, unit)
    holder = holder_unit(unit)
    box.run(["systemctl", "reset-failed", holder], check=False)
    box.run(["systemd-run", f"--unit={holder}", "--collect", "--quiet", "-p", "KillSignal=SIGTERM",
             "python3", HOLDER, str(pid)])

    def frozen() -> bool:
        if box.run(["systemctl", "is-active", "-q", holder], check=False).returncode != 0:
            raise BoxError(f"{holder} (ptrace_hold.py {pid}) stopped: "
                           + "\n".join(box.messages(unit=holder)[-10:]))
        return thread_state(box, pid) == "t"
    wait_for(frozen, 10, f"{unit}'s main thread {pid} to be held (state t)", interval_s=0.1)
    return holder


def thaw_engine(box: SystemdBox, unit: str) -> None:
    holder = holder_unit(unit)
    box.run(["systemctl", "stop", holder], check=False)
    pid = int(box.prop(unit, "MainPID") or 0)
    if pid:
        wait_for(lambda: thread_state(box, pid) not in ("t", "T"), 5, f"{unit}'s main thread to run again")


@contextlib.contextmanager
def frozen_engine(box: SystemdBox, unit: str) -> Iterator[str]:
    holder = freeze_engine(box, unit)
    try:
        yield holder
    finally:
        thaw_engine(box, unit)


# --- load -----------------------------------------------------------------------------------------

_LOAD_SCRIPT = r"""
import json, sys, threading, time, urllib.request
port, n, max_tokens, prompt, timeout_s = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
results = [None] * n
def one(i):
    t0 = time.monotonic()
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        a = json.loads(urllib.request.urlopen(req, timeout=timeout_s).read())
        results[i] = {"ok": True, "s": round(time.monotonic() - t0, 3), "usage": a.get("usage"),
                      "timings": a.get("timings")}
    except Exception as e:
        results[i] = {"ok": False, "s": round(time.monotonic() - t0, 3), "error": f"{type(e).__name__}: {e}"}
ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
[t.start() for t in ts]
print("started", flush=True)
[t.join() for t in ts]
print(json.dumps(results), flush=True)
"""


def start_load(box: SystemdBox, port: int, n: int = 4, max_tokens: int = 2000, prompt: str = "the cat",
               timeout_s: float = 300) -> subprocess.Popen:
    """c) N concurrent completions of MAX_TOKENS tokens each (ignore_eos) on PORT, sent from inside the box,
    in the background; finish_load(proc) waits and returns one dict per request."""
    cmd = ["nsenter", "-t", str(box.leader), "-a", "--", "env", "-i", "PATH=/usr/bin:/bin", "python3", "-c",
           _LOAD_SCRIPT, str(port), str(n), str(max_tokens), prompt, str(timeout_s)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "started":
        raise BoxError(f"the load did not start: {line}{proc.stderr.read() if proc.stderr else ''}")
    return proc


def finish_load(proc: subprocess.Popen, timeout_s: float = 300) -> list[dict]:
    out, err = proc.communicate(timeout=timeout_s)
    if proc.returncode != 0:
        raise BoxError(f"the load failed ({proc.returncode}): {err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def timed_get(box: SystemdBox, url: str, timeout_s: float) -> tuple[int, str, float]:
    """GET URL from inside the box: (status, body, seconds); status 0 when it did not answer in TIMEOUT_S."""
    t0 = time.monotonic()
    code, text = box.http(url, timeout_s=timeout_s)
    return code, text, round(time.monotonic() - t0, 3)


def metric(text: str, name: str) -> float | None:
    """The value of the sample NAME (no labels) in a Prometheus text page."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def cleanup(box: SystemdBox) -> None:
    """Stop and delete every unit and defaults file written here (found by MARKER), and any freeze holder."""
    box.run("systemctl stop 'llama-freeze-*.service'", check=False)
    out = box.run(f"grep -l -s -x -F {shlex.quote(MARKER)} {UNIT_DIR}/*.service /etc/default/llama-server-*",
                  check=False).stdout
    paths = out.split()
    units = sorted({p.rsplit("/", 1)[1] for p in paths if p.endswith(".service")})
    if units:
        box.run(["systemctl", "disable", "--now", *units], check=False, timeout=120)
        box.run(["systemctl", "reset-failed", *units], check=False)
    if paths:
        box.run(["rm", "-f", *paths], check=False)
        box.daemon_reload()

