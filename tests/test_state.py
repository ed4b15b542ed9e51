"""State files: atomic writes, corrupt files moved aside, restart history kept bounded."""

from __future__ import annotations

import json
import os

import pytest

from guardian.act.state import (
    CorruptState, StateStore, atomic_write_json, forget_unconfigured, record_restart, stamp, view,
)
from guardian.observe.clock import Now, boot_id

NOW = Now(mono=5000.0, wall=1_700_000_000.0)  # in the past: reads clamp the future


def test_update_round_trips_and_leaves_no_temporary_files(tmp_path):
    store = StateStore(tmp_path)
    store.update(lambda d: record_restart(d, "a", NOW, keep_s=600))
    store.update(lambda d: d["pauses"].__setitem__("b", {"until": None, "reason": "operator"}))
    pv = view(store.read(), NOW)
    assert pv.restarts == {"a": (5000.0,)} and pv.pauses["b"].until is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [".state.lock", "state.json"]


def test_record_restart_forgets_what_is_older_than_keep():
    old, recent = {"wall": NOW.wall - 900, "mono": None}, {"wall": NOW.wall - 100, "mono": None}
    d = {"restarts": {"a": [old, recent]}}
    record_restart(d, "a", NOW, keep_s=500)
    assert d["restarts"]["a"] == [recent, stamp(NOW)]


@pytest.mark.parametrize("content", ['{"version": 1, "restarts": {"a": [1, 2', "null", '{"version": 7}',
                                     '{"version": 1, "restarts": {"a": ["x"]}}', "\x00\x01"])
def test_corrupt_state_is_moved_aside(tmp_path, content):
    (tmp_path / "state.json").write_text(content)
    store = StateStore(tmp_path)
    with pytest.raises(CorruptState) as e:
        store.read()
    moved = e.value.moved_to
    assert moved.exists() and moved.read_text() == content
    assert not (tmp_path / "state.json").exists()
    assert store.read()["restarts"] == {}


def test_atomic_write_failure_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "status.json"
    atomic_write_json(path, {"old": True})

    def boom(*a):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        atomic_write_json(path, {"new": True})
    assert json.loads(path.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]


def test_update_over_a_corrupt_file_applies_the_change_once_and_says_so(tmp_path):
    (tmp_path / "state.json").write_text("{garbage")
    store = StateStore(tmp_path)
    with pytest.raises(CorruptState):
        store.update(lambda d: record_restart(d, "a", NOW, keep_s=600))
    assert store.read()["restarts"] == {"a": [stamp(NOW)]}
    assert any(p.name.startswith("state.json.corrupt-") for p in tmp_path.iterdir())


@pytest.mark.parametrize("content, why", [
    ('{"version": 1, "restarts": {"a": "999"}}', "a string is not three restarts"),
    ('{"version": 1, "restarts": {"a": [1e999]}}', "inf would hold budget and back-off forever"),
    ('{"version": 1, "restarts": {"a": [true]}}', "a bool is not a time"),
    ('{"version": 1, "pauses": {"a": {"until": "soon"}}}', "a pause's end must be a number"),
    ('{"version": 1, "pauses": {"a": {"until": NaN}}}', "not finite"),
    ('{"version": 1, "resumed_at": {"a": -Infinity}}', "not finite"),
    ('{"version": 1, "restarts": []}', "a section must be an object"),
    ('{"version": 1, "requests": {"r": {"replica": 5, "at": 1}}}', "a replica name is text"),
    ('{"version": 1, "proxy_down": "a"}', "proxy_down is a list"),
    ('{"version": 1, "proxy_down": [7]}', "a replica name is text"),
    ('{"version": 1, "restarts": {"a": ' + "[" * 100_000 + "]" * 100_000 + "}}", "nested 100k deep"),
])
def test_state_of_the_wrong_shape_is_corrupt_said_once_and_moved_aside(tmp_path, content, why):
    (tmp_path / "state.json").write_text(content)
    store = StateStore(tmp_path)
    with pytest.raises(CorruptState):
        store.read()
    assert store.read()["restarts"] == {}, why


def test_times_in_the_future_are_clamped_to_now(tmp_path):
    future = 4_000_000_000.0  # year 2096: a clock that was stepped back since
    (tmp_path / "state.json").write_text(json.dumps({"version": 1, "restarts": {"a": [future]},
                                                     "resumed_at": {"a": future}}))
    data = StateStore(tmp_path).read()
    assert data["restarts"]["a"][0]["wall"] < future and data["resumed_at"]["a"]["wall"] < future
    pv = view(data, NOW)
    assert pv.restarts["a"] == (NOW.mono,) and pv.resumed_at["a"] == NOW.mono


# --- two clocks: windows on the monotonic clock, wall time only persisted -------------------------

def test_in_the_same_boot_the_monotonic_time_is_used_whatever_the_wall_clock_did(tmp_path):
    store = StateStore(tmp_path)
    store.update(lambda d: record_restart(d, "a", NOW, keep_s=3600))
    data = store.read()
    assert data["boot_id"] == boot_id()
    for step_s in (3600.0, -3600.0):  # the wall clock stepped by an hour either way since
        later = Now(mono=NOW.mono + 30, wall=NOW.wall + 30 + step_s)
        assert view(data, later).restarts["a"] == (NOW.mono,)  # still "30 s ago"


def test_after_a_reboot_only_the_wall_time_counts(tmp_path):
    store = StateStore(tmp_path)
    store.update(lambda d: record_restart(d, "a", NOW, keep_s=3600))
    data = store.read()
    after_reboot = Now(mono=12.0, wall=NOW.wall + 100)
    assert view(data, after_reboot, this_boot="another-boot").restarts["a"] == (12.0 - 100,)
    # and the next write drops the other boot's monotonic times
    data["boot_id"] = "another-boot"
    (tmp_path / "state.json").write_text(json.dumps(data))
    store.update(lambda d: None)
    assert store.read()["restarts"]["a"][0]["mono"] is None


def test_the_older_format_of_bare_wall_times_still_reads(tmp_path):
    (tmp_path / "state.json").write_text(json.dumps({"version": 1, "restarts": {"a": [NOW.wall - 60]}}))
    assert view(StateStore(tmp_path).read(), NOW).restarts["a"] == (NOW.mono - 60,)


def test_what_the_proxy_was_told_survives_a_restart_and_a_file_from_before_the_proxy_has_nobody_down(tmp_path):
    (tmp_path / "state.json").write_text(json.dumps({"version": 1, "restarts": {}}))
    store = StateStore(tmp_path)
    assert view(store.read(), NOW).proxy_down == ()
    store.update(lambda d: d.__setitem__("proxy_down", ["b", "a", "b"]))
    assert view(StateStore(tmp_path).read(), NOW).proxy_down == ("a", "b")


def test_history_of_replicas_no_longer_configured_is_dropped():
    d = {"restarts": {"a": [1.0], "gone": [2.0]}, "pauses": {"gone": {"until": None}}, "resumed_at": {"gone": 3.0}}
    forget_unconfigured(d, {"a"})
    assert d == {"restarts": {"a": [1.0]}, "pauses": {}, "resumed_at": {}}


def test_the_lock_file_is_never_followed_through_a_symlink(tmp_path):
    """`sudo guardian pause a` with .state.lock replaced by a link must not create root's file elsewhere."""
    target = tmp_path / "elsewhere"
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / ".state.lock").symlink_to(target)
    with pytest.raises(OSError):
        StateStore(tmp_path / "state").update(lambda d: None)
    assert not target.exists()
