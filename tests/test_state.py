"""State files: atomic writes, corrupt files moved aside, restart history kept bounded."""

from __future__ import annotations

import json
import os

import pytest

from guardian.act.state import CorruptState, StateStore, atomic_write_json, record_restart, view


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
