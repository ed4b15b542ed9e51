"""An arm64 Debian 12 root that runs under qemu-user (binfmt_misc), for the arm64 package.

debootstrap downloads the packages for arm64 (no emulation needed for that) and they are only
unpacked, never configured: enough for python3 and the libraries it links, which is all that
guardian's package needs to run `guardian check`. binfmt_misc hands every aarch64 ELF to
qemu-aarch64-static, registered with the F flag so that it works inside a chroot.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from systemd_box import CACHE, SUITE, BoxError, _key, _need, host_lock

ARM64_PACKAGES = ["python3"]
BINFMT = Path("/proc/sys/fs/binfmt_misc")
QEMU = "/usr/bin/qemu-aarch64-static"
# qemu's own magic and mask for aarch64 ELF executables (qemu's scripts/qemu-binfmt-conf.sh)
AARCH64_BINFMT = (
    r":qemu-aarch64:M::\x7f\x45\x4c\x46\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00"
    r":\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:" + QEMU + ":F"
)


def ensure_binfmt() -> None:
    if not os.path.exists(QEMU):
        raise BoxError(f"{QEMU} is missing: apt-get install qemu-user-static (scripts/setup.sh does)")
    if not (BINFMT / "register").exists():
        r = subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)], capture_output=True, text=True)
        if r.returncode != 0:
            raise BoxError(f"cannot mount binfmt_misc to run arm64 binaries: {r.stderr.strip()}")
    entry = BINFMT / "qemu-aarch64"
    if not entry.exists():
        try:
            (BINFMT / "register").write_text(AARCH64_BINFMT)
        except OSError as e:
            raise BoxError(f"cannot register qemu-aarch64 with binfmt_misc: {e}") from e
    text = entry.read_text()
    if not text.startswith("enabled") or "flags: " not in text or "F" not in text.split("flags: ")[1].split()[0]:
        raise BoxError(f"binfmt_misc's qemu-aarch64 entry is disabled or lacks the F flag (needed in a chroot):\n{text}")


def ensure_arm64_root() -> Path:
    root = CACHE / f"rootfs-{SUITE}-arm64-{_key(ARM64_PACKAGES)}"
    if (root / ".complete").exists():
        return root
    with host_lock("rootfs-arm64"):
        return _build_arm64_root(root)


def _build_arm64_root(root: Path) -> Path:
    if (root / ".complete").exists():
        return root
    debootstrap = _need("debootstrap")
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="rootfs-arm64-", dir=CACHE))
    try:
        cmd = [debootstrap, "--arch=arm64", "--variant=minbase", f"--include={','.join(ARM64_PACKAGES)}",
               "--download-only", SUITE, str(tmp)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            raise BoxError(f"debootstrap --arch=arm64 failed ({r.returncode}): {r.stdout[-2000:]}{r.stderr[-2000:]}")
        debs = sorted((tmp / "var/cache/apt/archives").glob("*.deb"))
        for deb in debs:
            subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], check=True, capture_output=True)
            deb.unlink()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / ".complete").write_text(time.strftime("%F %T"))
    os.replace(tmp, root)
    return root


def chroot(root: Path, *cmd: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
    return subprocess.run(["chroot", str(root), *cmd], capture_output=True, text=True, timeout=timeout, env=env)
