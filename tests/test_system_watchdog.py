"""Watchdog system tests: real systemd, real D-Bus, the simulator as replicas (issue 3)."""

from __future__ import annotations

import pytest

from systemd_box import wait_for
from world import World

pytestmark = pytest.mark.system


@pytest.fixture
def world(box):
    w = World(box)
    yield w
    w.teardown()


def _assert_untouched(world: World, before: dict) -> None:
    after = world.identities(list(before))
    assert after == before, f"bystanders changed: {before} -> {after}"


def _wait_restarted(world: World, r, old_identity, timeout_s=40):
    wait_for(lambda: world.box.identity(r.unit) != old_identity and world.box.prop(r.unit, "ActiveState") == "active",
             timeout_s, f"{r.unit} to be restarted")


def test_frozen_process_restarts_exactly_its_unit(world):
    world.setup()
    a = world.replicas[0]
    before = world.identities(world.bystander_units("a"))
    old = world.box.identity(a.unit)
    world.kill(a.unit, "STOP")
    _wait_restarted(world, a, old)
    world.wait_states({"a": "healthy", "b": "healthy"}, timeout_s=30)
    lines = world.restarts_of(a)
    assert len(lines) == 1, lines
    assert "unresponsive" in lines[0]["MESSAGE"] and lines[0]["PRIORITY"] == "4"
    assert lines[0]["GUARDIAN_UNIT"] == a.unit
    _assert_untouched(world, before)
