"""Fixtures. System tests share one booted container per session (booting takes seconds,
building the rootfs about a minute the first time, then it is cached)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import psutil
import pytest
from engines import cleanup, start_engines
from harness import Running, gone
from systemd_box import BoxError, SystemdBox, ensure_deps, ensure_rootfs, wait_for
from world import World

_STARTED = pytest.StashKey[float]()

# scripts/run-tests runs the suite with pytest-xdist: each worker boots a box of its own on first use,
# and a test goes to whichever worker is free, except these files, whose tests go to one worker
# together, in their order (docs/testbed.md):
SAME_WORKER = {
    # a module-scoped etcd cluster on fixed loopback ports of the host
    "test_fleet_etcd.py": "etcd-ports",
    # three real llama-servers set up once for the module, guardian's config changed between its tests
    "test_system_llamacpp_guardian.py": "llama-guardian",
    # dockerd and podman started in the box once, the image imported once
    "test_system_containers.py": "engines",
    "test_system_engines.py": "engines",
    # the package purged, reinstalled and upgraded in the box: one after another, as they were written
    "test_system_deb.py": "package",
    "test_system_quickstart.py": "package",
}


@pytest.hookimpl(optionalhook=True)  # xdist's hook: a run with -p no:xdist has no such hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's scope scheduler with a scope per test, or per SAME_WORKER group. (Not xdist's own
    loadgroup: it renames a test's nodeid, which pytest 9 no longer reads.) The largest scopes go
    out first (xdist's reorder), so the package group's few minutes start at once."""
    from xdist.scheduler import LoadScopeScheduling

    class SameWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return SAME_WORKER.get(nodeid.split("::", 1)[0].rsplit("/", 1)[-1], nodeid)

    return SameWorker(config, log)


@pytest.fixture(scope="session")
def box():
    b = None
    try:
        rootfs = ensure_rootfs()
        deps = ensure_deps()
        b = SystemdBox(rootfs, deps)
        b.boot()
    except Exception as e:  # noqa: BLE001 - BoxError, and whatever else a boot raised: the box goes
        if b is not None:
            b.halt()
        # Fail, never skip: a system test that cannot run must say so loudly.
        pytest.fail(f"cannot boot the real-systemd test container: {type(e).__name__}: {e}", pytrace=False)
    yield b
    b.halt()


@pytest.fixture
def world(box):
    """Two replicas, a database and a proxy in the box; everything is taken down afterwards."""
    w = World(box)
    yield w
    w.teardown()


@pytest.fixture(scope="session")
def engines(box):
    """dockerd and podman running in the box, the simulator's image in both (tests/engines.py). Started
    once, on first use; they keep running until the box halts. Each test removes its own containers and
    units with engines.cleanup(box)."""
    try:
        eng = start_engines(box)
    except BoxError as e:
        pytest.fail(f"cannot start the container engines in the test box: {e}", pytrace=False)
    yield eng
    cleanup(box)


# --- a failed system test names its container and keeps its journal (the box is volatile) ------------
LOGS = Path(os.environ.get("GUARDIAN_TEST_LOGS", "/tmp/guardian-test-logs"))


def _box_of(item: pytest.Item) -> SystemdBox | None:
    for value in getattr(item, "funcargs", {}).values():
        if isinstance(value, SystemdBox):
            return value
        inner = getattr(value, "box", None)
        if isinstance(inner, SystemdBox):
            return inner
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_STARTED] = time.time()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    outcome = yield
    rep = outcome.get_result()
    if not rep.failed or call.when == "teardown":
        return
    box = _box_of(item)
    if box is None or box.leader is None:
        return
    try:
        rep.sections.append(("container journal", _save_journal(item, box)))
    except Exception as e:  # noqa: BLE001 - the failure itself must still be reported, whatever this does
        rep.sections.append(("container journal", f"box {box.name}: its journal could not be saved: {e}"))


def _save_journal(item: pytest.Item, box: SystemdBox) -> str:
    since = item.stash.get(_STARTED, None)
    cmd = ["journalctl", "--no-pager", "-o", "short-precise"] + (["--since", f"@{int(since) - 1}"] if since else [])
    text = box.run(cmd, check=False, timeout=30).stdout
    LOGS.mkdir(parents=True, exist_ok=True)
    path = LOGS / (re.sub(r"[^A-Za-z0-9_.-]+", "_", item.nodeid)[-150:] + ".journal")
    path.write_text(text)
    tail = "\n".join(text.splitlines()[-30:])
    return f"box {box.name} (nspawn log {box.log_path}); its journal during the test: {path}\n...\n{tail}"


@pytest.fixture
def sim():
    """A simulator started per call (harness.Running), each stopped after the test, its engine
    processes with it (tests/test_simulator.py, tests/test_simulator_engines.py)."""
    started: list[Running] = []

    def start(*args: str) -> Running:
        r = Running(*args)
        started.append(r)
        return r
    yield start
    for r in started:
        kids = psutil.Process(r.proc.pid).children(recursive=True) if r.proc.poll() is None else []
        r.stop()
        # the engine core and its workers die with the API server: no test leaves an orphan
        wait_for(lambda kids=kids: gone([k.pid for k in kids]), 10, "the engine processes to go")
