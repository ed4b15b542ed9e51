"""The release (issue 23): one version, locked dependencies, a reproducible .deb whose copyright file
lists what it bundles, and etcd's TLS verified with the system's CA store."""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import ssl
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import guardian
from guardian.fleet.etcd import Etcd, Tls, tls_context

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "packaging"))
import manpages  # noqa: E402
from build_deb import TARGETS, changelog_top, man_date  # noqa: E402
from deps import requirement_name, runtime_deps  # noqa: E402
from lock import read_lock  # noqa: E402


def test_the_changelogs_top_entry_and_pyproject_give_guardians_version():
    version, epoch = changelog_top()
    assert version == guardian.__version__
    assert epoch > 1_700_000_000
    # pyproject.toml takes the version from guardian.__version__, never a copy of it
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "guardian.__version__"}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_each_targets_lock_pins_with_hashes_what_pyproject_requires(target):
    binary, sdist = runtime_deps()
    text = (REPO / "packaging" / "lock" / f"{target}.txt").read_text()
    made_from = re.search(r"^# requirements: (.*)$", text, re.M)
    assert made_from and made_from.group(1) == json.dumps(binary + sdist), (
        f"packaging/lock/{target}.txt was made from other requirements than pyproject.toml's: "
        "run python3 packaging/lock.py")
    pins = read_lock(target)
    for req in map(Requirement, binary + sdist):
        name = requirement_name(req.name)
        assert name in pins, f"{name} is required by pyproject.toml but not pinned for {target}"
        assert req.specifier.contains(pins[name], prereleases=True), (name, pins[name], str(req.specifier))
    entries = re.findall(r"^([a-z0-9-]+)==\S+ \\\n((?:\s+--hash=sha256:[0-9a-f]{64}(?: \\)?\n)+)", text, re.M)
    assert sorted(n for n, _ in entries) == sorted(pins), "every pin carries a sha256 hash"


def _one_ca(tmp_path: Path, index: int) -> Path:
    """A CA certificate in a file of its own: one of the roots httpx's certifi bundle carries
    (no key is needed: a context's loaded CAs are compared, no handshake is made)."""
    import certifi

    blocks = re.findall(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", Path(certifi.where()).read_text(), re.S)
    path = tmp_path / f"ca{index}.pem"
    path.write_text(blocks[index] + "\n")
    return path


def _subjects(ctx: ssl.SSLContext) -> set[tuple]:
    return {c["subject"] for c in ctx.get_ca_certs()}


def _subjects_in(pem: Path) -> set[tuple]:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cafile=str(pem))
    return _subjects(ctx)


def test_etcd_tls_verifies_with_the_systems_ca_store_unless_ca_file_is_set(tmp_path, monkeypatch):
    # OpenSSL's default verify paths, which the operator controls (SSL_CERT_FILE points them at one
    # CA here): a context built on certifi's bundle would hold its 100-odd roots, not this one alone.
    system_ca, own_ca = _one_ca(tmp_path, 0), _one_ca(tmp_path, 1)
    monkeypatch.setenv("SSL_CERT_FILE", str(system_ca))
    monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path / "none"))
    assert _subjects(tls_context(Tls())) == _subjects_in(system_ca)
    assert _subjects(tls_context(Tls(ca_file=str(own_ca)))) == _subjects_in(own_ca) != _subjects_in(system_ca)
    # and the client etcd talks through is built on that context
    etcd = Etcd(["https://127.0.0.1:2379"], tls=Tls())
    try:
        assert _subjects(etcd.ssl_context) == _subjects_in(system_ca)
        assert etcd.client._transport._pool._ssl_context is etcd.ssl_context  # httpx 0.28's transport
    finally:
        asyncio.run(etcd.aclose())


def _build(out: Path) -> Path:
    r = subprocess.run([sys.executable, str(REPO / "packaging/build_deb.py"), "--target", "amd64-bookworm",
                        "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return Path(r.stdout.strip().splitlines()[-1])


def _listing(deb: Path) -> list[str]:
    return subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout.splitlines()


@pytest.mark.system  # builds the package: dpkg-deb, and the dependency cache (root's, first filled from PyPI)
def test_two_builds_of_one_tree_are_byte_identical_and_copyright_lists_what_is_bundled(tmp_path):
    first, second = _build(tmp_path / "1"), _build(tmp_path / "2")
    if first.read_bytes() != second.read_bytes():
        import difflib

        x, y = tmp_path / "x", tmp_path / "y"
        for deb, d in ((first, x), (second, y)):
            subprocess.run(["dpkg-deb", "-R", str(deb), str(d)], check=True)
        diff = subprocess.run(["diff", "-r", str(x / "DEBIAN"), str(y / "DEBIAN")], capture_output=True, text=True)
        listing = "\n".join(difflib.unified_diff(_listing(first), _listing(second), lineterm="", n=0))
        pytest.fail(f"two builds differ:\n{diff.stdout[-3000:]}\n{listing[-3000:]}")
    # the files carry SOURCE_DATE_EPOCH (the changelog's date by default), not the time of the build
    day = subprocess.run(["date", "-u", "-d", f"@{changelog_top()[1]}", "+%Y-%m-%d %H:%M"], capture_output=True,
                         text=True, check=True).stdout.strip()
    assert all(day in line for line in _listing(first)), _listing(first)[:3]

    root = tmp_path / "root"
    subprocess.run(["dpkg-deb", "-x", str(first), str(root)], check=True)
    bundled = set()
    for meta in (root / "usr/lib/guardian").glob("*.dist-info/METADATA"):
        bundled.add(requirement_name(re.search(r"^Name: (.+)$", meta.read_text(), re.M).group(1)))
    copyright_text = (root / "usr/share/doc/guardian/copyright").read_text()
    block = copyright_text.split("License: various-permissive", 1)[1].split("\n .\n", 1)[0]
    listed = {requirement_name(n) for n in re.findall(r"([A-Za-z0-9_.-]+) \(", block)}
    assert listed == bundled, f"copyright lists {sorted(listed - bundled)} not bundled, omits {sorted(bundled - listed)}"
    assert bundled == set(read_lock("amd64-bookworm")), "the package bundles exactly what the lock pins"
    # the man pages are the ones the README makes (tests/test_manpages.py checks what they say)
    made = manpages.pages((REPO / "README.md").read_text(), guardian.__version__, man_date())
    for name, text in made.items():
        assert gzip.decompress((root / manpages.INSTALLED[name]).read_bytes()).decode() == text, name
    pages = sorted(p.relative_to(root).as_posix() for p in (root / "usr/share/man").rglob("*.gz"))
    assert pages == sorted(manpages.INSTALLED.values())
    # the README's links into docs/ resolve next to the README the package ships
    doc = root / "usr/share/doc/guardian"
    links = set(re.findall(r"\]\((docs/[^)#]+)", (doc / "README.md").read_text()))
    assert links and all((doc / link).is_file() for link in links), sorted(l for l in links if not (doc / l).is_file())
