"""State files: atomic writes, corrupt files moved aside, restart history kept bounded."""

from __future__ import annotations

import json
import os

import pytest

from guardian.act.state import CorruptState, StateStore, atomic_write_json, forget_unconfigured, record_restart, view


def test_update_round_trips_and_leaves_no_temporary_files(tmp_path):
    store = StateStore(tmp_path)
    store.update(lambda d: record_restart(d, "a", 1000.0, keep_s=600))
    store.update(lambda d: d["pauses"].__setitem__("b", {"until": None, "reason": "operator"}))
    pv = view(store.read())
    assert pv.restarts == {"a": (1000.0,)} and pv.pauses["b"].until is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [".state.lock", "state.json"]


def test_record_restart_forgets_what_is_older_than_keep():
    d = {"restarts": {"a": [100.0, 900.0]}}
    record_restart(d, "a", 1000.0, keep_s=500)
    assert d["restarts"]["a"] == [900.0, 1000.0]


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
        store.update(lambda d: record_restart(d, "a", 1000.0, keep_s=600))
    assert store.read()["restarts"] == {"a": [1000.0]}
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
    assert data["restarts"]["a"][0] < future and data["resumed_at"]["a"] < future


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
