#!/usr/bin/env python3
"""Build guardian's .deb for one target or both, with one command:

    python3 packaging/build_deb.py --target all --out dist/

Targets:
  arm64-noble     DGX OS (Ubuntu 24.04, arm64, Python 3.12): the real one, cross-built here
                  from the target's wheels (pip --platform manylinux aarch64, cp312)
  amd64-bookworm  Debian 12 (amd64, Python 3.11): what the system tests install
  arm64-bookworm  Debian 12 (arm64, Python 3.11): not shipped ("all" leaves it out); the tests
                  run it under qemu-user in an arm64 Debian 12 root, where Python is 3.11, to
                  show the aarch64 wheels bundled the same way import and run

The Python dependencies (Ubuntu 24.04 ships pydantic 1 only) are bundled privately under
/usr/lib/guardian and run by the system python3; Depends: pins the Python minor version the
bundled binary wheels (pydantic-core) were built for. Downloads are cached under
$GUARDIAN_BUILD_CACHE (default /var/cache/guardian-build).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CACHE = Path(os.environ.get("GUARDIAN_BUILD_CACHE", "/var/cache/guardian-build"))
sys.path.insert(0, str(HERE))
from deps import runtime_deps  # noqa: E402  (the one dependency list: pyproject.toml)

BINARY_DEPS, SDIST_DEPS = runtime_deps()


@dataclass(frozen=True)
class Target:
    name: str
    arch: str  # Debian architecture
    machine: str  # manylinux platform suffix
    python: str  # X.Y
    unit_dir: str
    distribution: str
    shipped: bool = True


TARGETS = {
    "arm64-noble": Target("arm64-noble", "arm64", "aarch64", "3.12", "/usr/lib/systemd/system", "noble"),
    "amd64-bookworm": Target("amd64-bookworm", "amd64", "x86_64", "3.11", "/lib/systemd/system", "bookworm"),
    "arm64-bookworm": Target("arm64-bookworm", "arm64", "aarch64", "3.11", "/lib/systemd/system", "bookworm", False),
}


def version() -> str:
    text = (REPO / "guardian" / "__init__.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def run(cmd: list[str], **kw) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"build_deb: {' '.join(cmd[:6])} ... failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def bundled_deps(t: Target) -> Path:
    key = hashlib.sha256("\0".join(BINARY_DEPS + SDIST_DEPS + [t.name, t.python]).encode()).hexdigest()[:12]
    out = CACHE / f"deps-{t.name}-{key}"
    if (out / ".complete").exists():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="deps-", dir=CACHE))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile", "--target", str(tmp)]
    plats = [f"manylinux2014_{t.machine}", f"manylinux_2_17_{t.machine}", f"manylinux_2_28_{t.machine}"]
    run(pip + ["--only-binary=:all:", "--implementation", "cp", "--python-version", t.python]
        + [a for p in plats for a in ("--platform", p)] + BINARY_DEPS)
    run(pip + ["--no-deps"] + SDIST_DEPS)
    for junk in list(tmp.rglob("__pycache__")) + list(tmp.glob("bin")):
        shutil.rmtree(junk, ignore_errors=True)
    (tmp / ".complete").write_text("ok")
    os.replace(tmp, out)
    return out


WRAPPER = """#!/bin/sh
# guardian's private Python packages live in /usr/lib/guardian; the system python3 runs them.
PYTHONPATH=/usr/lib/guardian exec /usr/bin/python3 -s -m guardian "$@"
"""

CONTROL = """Package: guardian
Version: {version}
Architecture: {arch}
Maintainer: guardian authors <guardian@example.invalid>
Installed-Size: {size_kib}
Depends: python3 (>= {py}), python3 (<< {py_next}), libc6 (>= 2.28), systemd, polkitd | policykit-1
Section: admin
Priority: optional
Homepage: https://example.invalid/guardian
Description: keeps local vLLM replicas serving (watchdog and memory guard)
 guardian probes each local vLLM replica directly and restarts exactly the
 systemd unit that serves it when it stops making progress, after checking
 that the restart cannot hurt anything else (masking, enablement, Conflicts=).
 Its memory guard lowers one replica's GPU memory fraction when co-located
 work runs short of memory, and restarts that replica alone.
 .
 Python dependencies for Python {py} are bundled under /usr/lib/guardian.
"""


def build(t: Target, out_dir: Path, ver: str) -> Path:
    root = Path(tempfile.mkdtemp(prefix=f"guardian-{t.name}-"))
    try:
        lib = root / "usr/lib/guardian"
        shutil.copytree(bundled_deps(t), lib, ignore=shutil.ignore_patterns(".complete"))
        shutil.copytree(REPO / "guardian", lib / "guardian", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        files = {
            "usr/bin/guardian": (WRAPPER, 0o755),
            f"{t.unit_dir.lstrip('/')}/guardian.service": ((REPO / "units/guardian.service").read_text(), 0o644),
            f"{t.unit_dir.lstrip('/')}/guardian-nginx-check.service": (
                (REPO / "units/guardian-nginx-check.service").read_text(), 0o644),
            f"{t.unit_dir.lstrip('/')}/guardian-container@.service": (
                (REPO / "units/guardian-container@.service").read_text(), 0o644),
            "etc/guardian/guardian.toml": ((HERE / "guardian.toml").read_text(), 0o644),
            "usr/share/guardian/prometheus/guardian-rules.yml": ((HERE / "prometheus/guardian-rules.yml").read_text(), 0o644),
            "usr/share/guardian/grafana/guardian-dashboard.json": ((HERE / "grafana/guardian-dashboard.json").read_text(), 0o644),
            "usr/lib/sysusers.d/guardian.conf": ((HERE / "debian/guardian.sysusers").read_text(), 0o644),
            "usr/share/doc/guardian/copyright": ((HERE / "debian/copyright").read_text(), 0o644),
            "usr/share/doc/guardian/README.md": ((REPO / "README.md").read_text(), 0o644),
            "usr/share/doc/guardian/examples/vllm-replica@.service": ((REPO / "units/vllm-replica@.service").read_text(), 0o644),
        }
        for rel, (text, mode) in files.items():
            p = root / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
            p.chmod(mode)
        changelog = (f"guardian ({ver}) {t.distribution}; urgency=medium\n\n  * Release {ver}.\n\n"
                     f" -- guardian authors <guardian@example.invalid>  {time.strftime('%a, %d %b %Y %H:%M:%S +0000', time.gmtime())}\n")
        with open(root / "usr/share/doc/guardian/changelog.gz", "wb") as raw:
            with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0, filename="") as gz:
                gz.write(changelog.encode())
        man = root / "usr/share/man/man1/guardian.1.gz"
        man.parent.mkdir(parents=True, exist_ok=True)
        with open(man, "wb") as raw:
            with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0, filename="") as gz:
                gz.write((HERE / "debian/guardian.1").read_bytes())
        overrides = root / "usr/share/lintian/overrides/guardian"
        overrides.parent.mkdir(parents=True, exist_ok=True)
        overrides.write_text((HERE / "debian/lintian-overrides").read_text())
        for py in lib.rglob("*.py"):
            text = py.read_bytes()
            if text.startswith(b"#!"):  # library modules are imported, never run: no interpreter line
                py.write_bytes(text.split(b"\n", 1)[1] if b"\n" in text else b"")
        for d in [root] + [p for p in root.rglob("*") if p.is_dir()]:
            d.chmod(0o755)
        for f in root.rglob("*"):
            if f.is_file():
                f.chmod(0o755 if f == root / "usr/bin/guardian" else 0o644)
        size_kib = sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) // 1024 + 1
        debian = root / "DEBIAN"
        debian.mkdir()
        major, minor = (int(x) for x in t.python.split("."))
        (debian / "control").write_text(CONTROL.format(version=ver, arch=t.arch, size_kib=size_kib, py=t.python,
                                                       py_next=f"{major}.{minor + 1}"))
        (debian / "conffiles").write_text("/etc/guardian/guardian.toml\n")
        for script in ("postinst", "prerm", "postrm"):
            shutil.copy(HERE / "debian" / script, debian / script)
            (debian / script).chmod(0o755)
        sums = []
        for f in sorted(root.rglob("*")):
            if f.is_file() and debian not in f.parents:
                sums.append(f"{hashlib.md5(f.read_bytes()).hexdigest()}  {f.relative_to(root)}")
        (debian / "md5sums").write_text("\n".join(sums) + "\n")
        (debian / "md5sums").chmod(0o644)
        (debian / "control").chmod(0o644)
        (debian / "conffiles").chmod(0o644)
        out_dir.mkdir(parents=True, exist_ok=True)
        deb = out_dir / f"guardian_{ver}_{t.arch}.deb"
        run(["dpkg-deb", "--root-owner-group", "-Zxz", "--build", str(root), str(deb)])
        return deb
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=[*TARGETS, "all"], default="all", help="all: the shipped targets")
    p.add_argument("--out", default=str(REPO / "dist"))
    p.add_argument("--version", default=None, help="package version (default: guardian.__version__)")
    args = p.parse_args(argv)
    ver = args.version or version()
    for name in [n for n, t in TARGETS.items() if t.shipped] if args.target == "all" else [args.target]:
        print(build(TARGETS[name], Path(args.out), ver))
    return 0


if __name__ == "__main__":
    sys.exit(main())
