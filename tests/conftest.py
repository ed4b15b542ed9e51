"""Fixtures. System tests share one booted container per session (booting takes seconds,
building the rootfs about a minute the first time, then it is cached)."""

from __future__ import annotations

import pytest

from engines import cleanup, start_engines
from systemd_box import BoxError, SystemdBox, ensure_deps, ensure_rootfs
from world import World


@pytest.fixture(scope="session")
def box():
    b = None
    try:
        rootfs = ensure_rootfs()
        deps = ensure_deps()
        b = SystemdBox(rootfs, deps)
        b.boot()
    except BoxError as e:
        if b is not None:
            b.halt()
        # Fail, never skip: a system test that cannot run must say so loudly.
        pytest.fail(f"cannot boot the real-systemd test container: {e}", pytrace=False)
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
