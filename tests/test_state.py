"""State files: atomic writes, corrupt files moved aside, restart history kept bounded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from guardian.act.state import (
    CorruptState, StateStore, atomic_write_json, forget_unconfigured, record_canary_latencies, record_restart, stamp,
    view,
)
from guardian.observe.clock import Now, boot_id
from harness import NOBODY_PYTHON, as_nobody

NOW = Now(mono=5000.0, wall=1_700_000_000.0)  # in the past: reads clamp the future


def store_at(path) -> StateStore:
    """A store whose reads clamp to NOW: a time after it cannot have been written yet."""
    return StateStore(path, clock=lambda: NOW)


def test_update_round_trips_and_leaves_no_temporary_files(tmp_path):
    store = store_at(tmp_path)
    store.update(lambda d: record_restart(d, "a", NOW, keep_s=600))
    store.update(lambda d: d["pauses"].__setitem__("b", {"until": None, "reason": "operator"}))
    pv = view(store.read(), NOW)
    assert pv.restarts == {"a": (5000.0,)} and pv.pauses["b"].until is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "state.json"]
    assert [p.name for p in (tmp_path / ".lock").iterdir()] == ["state.lock"]


def test_record_restart_forgets_what_is_older_than_keep():
    old, recent = {"wall": NOW.wall - 900, "mono": None}, {"wall": NOW.wall - 100, "mono": None}
    d = {"restarts": {"a": [old, recent]}}
    record_restart(d, "a", NOW, keep_s=500)
    assert d["restarts"]["a"] == [recent, stamp(NOW)]


@pytest.mark.parametrize("content", ['{"version": 1, "restarts": {"a": [1, 2', "null", '{"version": 7}',
                                     '{"version": 1, "restarts": {"a": ["x"]}}', "\x00\x01"])
def test_corrupt_state_is_moved_aside(tmp_path, content):
    (tmp_path / "state.json").write_text(content)
    store = store_at(tmp_path)
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
    store = store_at(tmp_path)
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
    # issue 21: numbers past every bound; float(10**400) raised OverflowError, a traceback and a loop
    ('{"version": 1, "restarts": {"a": [' + "9" * 400 + "]}}", "a 400-digit integer"),
    ('{"version": 1, "resumed_at": {"a": {"wall": 1, "mono": -' + "9" * 400 + "}}}", "a 400-digit monotonic time"),
    ('{"version": 1, "restarts": {"a": [' + ", ".join(['{"wall": 1.7e9, "mono": 1e300}'] * 3) + "]}}",
     "1e300 held a budget spent for a week"),
    ('{"version": 1, "pauses": {"a": {"until": {"wall": 1e300, "mono": null}}}}', "a pause's end past every bound"),
])
def test_state_of_the_wrong_shape_is_corrupt_said_once_and_moved_aside(tmp_path, content, why):
    (tmp_path / "state.json").write_text(content)
    store = store_at(tmp_path)
    with pytest.raises(CorruptState):
        store.read()
    assert store.read()["restarts"] == {}, why


def test_times_in_the_future_are_clamped_to_now(tmp_path):
    future = 4_000_000_000.0  # year 2096: a clock that was stepped back since
    (tmp_path / "state.json").write_text(json.dumps({"version": 1, "restarts": {"a": [future]},
                                                     "resumed_at": {"a": future}}))
    data = store_at(tmp_path).read()
    assert data["restarts"]["a"][0]["wall"] < future and data["resumed_at"]["a"]["wall"] < future
    pv = view(data, NOW)
    assert pv.restarts["a"] == (NOW.mono,) and pv.resumed_at["a"] == NOW.mono


# --- two clocks: windows on the monotonic clock, wall time only persisted -------------------------

def test_in_the_same_boot_the_monotonic_time_is_used_whatever_the_wall_clock_did(tmp_path):
    store = store_at(tmp_path)
    store.update(lambda d: record_restart(d, "a", NOW, keep_s=3600))
    data = store.read()
    assert data["boot_id"] == boot_id()
    for step_s in (3600.0, -3600.0):  # the wall clock stepped by an hour either way since
        later = Now(mono=NOW.mono + 30, wall=NOW.wall + 30 + step_s)
        assert view(data, later).restarts["a"] == (NOW.mono,)  # still "30 s ago"


def test_after_a_reboot_only_the_wall_time_counts(tmp_path):
    store = store_at(tmp_path)
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
    assert view(store_at(tmp_path).read(), NOW).restarts["a"] == (NOW.mono - 60,)


def test_what_the_proxy_was_told_survives_a_restart_and_a_file_from_before_the_proxy_has_nobody_down(tmp_path):
    (tmp_path / "state.json").write_text(json.dumps({"version": 1, "restarts": {}}))
    store = store_at(tmp_path)
    assert view(store.read(), NOW).proxy_down == ()
    store.update(lambda d: d.__setitem__("proxy_down", ["b", "a", "b"]))
    assert view(store_at(tmp_path).read(), NOW).proxy_down == ("a", "b")


def test_history_of_replicas_no_longer_configured_is_dropped():
    d = {"restarts": {"a": [1.0], "gone": [2.0]}, "pauses": {"gone": {"until": None}}, "resumed_at": {"gone": 3.0},
         "canary_latencies": {"a": [0.5], "gone": [0.25]}, "step_seconds": {"a": [60.0], "gone": [5.0]},  # shapes aside
         "fraction_bases": {"a": 0.78, "gone": 0.9}}
    forget_unconfigured(d, {"a"})
    assert d == {"restarts": {"a": [1.0]}, "pauses": {}, "resumed_at": {}, "canary_latencies": {"a": [0.5]},
                 "step_seconds": {"a": [60.0]}, "fraction_bases": {"a": 0.78}}


@pytest.mark.parametrize("planted", [".lock", ".lock/state.lock"])
def test_the_lock_file_is_never_followed_through_a_symlink(tmp_path, planted):
    """`sudo guardian pause a` with the lock (or its directory) replaced by a link must not create
    or change root's file elsewhere."""
    target = tmp_path / "elsewhere"
    (tmp_path / "state" / ".lock").mkdir(parents=True, mode=0o700)
    if planted == ".lock":
        (tmp_path / "state" / ".lock").rmdir()
    (tmp_path / "state" / planted).symlink_to(target)
    with pytest.raises(OSError):
        store_at(tmp_path / "state").update(lambda d: None)
    assert not target.exists()


def test_monotonic_times_ahead_of_now_are_clamped_and_a_budget_they_spend_comes_back_after_one_window(tmp_path):
    """Three restarts stamped a billion seconds ahead on this boot's monotonic clock (within the
    bounds, so not corrupt) count as now, not as the future: one window later the budget is back."""
    ahead = {"wall": NOW.wall - 10, "mono": NOW.mono + 1e9}
    (tmp_path / "state.json").write_text(json.dumps({"version": 1, "boot_id": boot_id(),
                                                     "restarts": {"a": [ahead] * 3}, "resumed_at": {"a": ahead}}))
    data = store_at(tmp_path).read()
    pv = view(data, NOW)
    assert pv.restarts["a"] == (NOW.mono,) * 3 and pv.resumed_at["a"] == NOW.mono
    window_s = 1800.0
    later = Now(mono=NOW.mono + window_s + 1, wall=NOW.wall + window_s + 1)
    assert [t for t in view(data, later).restarts["a"] if t > later.mono - window_s] == []


def test_a_pause_ends_at_most_the_longest_pause_from_now(tmp_path):
    from guardian.config import MAX_WINDOW_S

    far = {"wall": NOW.wall + 1e10, "mono": NOW.mono + 1e10}
    (tmp_path / "state.json").write_text(json.dumps({"version": 1, "boot_id": boot_id(),
                                                     "pauses": {"a": {"until": far, "reason": "x"}}}))
    until = view(store_at(tmp_path).read(), NOW).pauses["a"].until
    assert until == NOW.mono + MAX_WINDOW_S


def test_a_pause_keeps_when_it_began_and_a_future_start_is_clamped_to_now(tmp_path):
    began = {"wall": NOW.wall - 3600, "mono": NOW.mono - 3600}
    ahead = {"wall": NOW.wall + 3600, "mono": NOW.mono + 3600}
    (tmp_path / "state.json").write_text(json.dumps({"version": 1, "boot_id": boot_id(), "pauses": {
        "a": {"until": None, "reason": "x", "since": began}, "b": {"until": None, "reason": "x", "since": ahead},
        "c": {"until": None, "reason": "x"}}}))
    pauses = view(store_at(tmp_path).read(), NOW).pauses
    assert (pauses["a"].since, pauses["b"].since, pauses["c"].since) == (NOW.mono - 3600, NOW.mono, None)


def _read_in_a_thread(store: StateStore, fifo=None) -> object:
    """store.read() in a thread; fails (and unblocks it) if it does not return within 5 s."""
    import threading

    out: list[object] = []

    def read():
        try:
            out.append(store.read())
        except Exception as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a writer that leaves: the reader sees EOF
        pytest.fail("store.read() did not return within 5 s")
    return out[0]


@pytest.mark.parametrize("plant", ["fifo", "link to /dev/zero", "link to a good file"])
def test_a_fifo_or_a_link_at_the_state_file_is_moved_aside_not_read(tmp_path, plant):
    path = tmp_path / "state.json"
    good = tmp_path / "elsewhere.json"
    good.write_text(json.dumps({"version": 1, "restarts": {"a": [NOW.wall]}}))
    if plant == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero" if "zero" in plant else good)
    result = _read_in_a_thread(store_at(tmp_path), path if plant == "fifo" else None)
    assert isinstance(result, CorruptState), result
    assert not os.path.lexists(path) and os.path.lexists(result.moved_to)
    assert store_at(tmp_path).read()["restarts"] == {}
    assert good.exists()  # the link was moved, not what it pointed to


def test_a_state_file_past_its_size_cap_is_moved_aside_unread(tmp_path):
    from guardian.act.state import STATE_MAX_BYTES

    (tmp_path / "state.json").write_text('{"version": 1, "restarts": {}, "x": "' + "a" * STATE_MAX_BYTES + '"}')
    with pytest.raises(CorruptState, match="larger than"):
        store_at(tmp_path).read()


def test_the_daemons_cache_says_a_400_digit_number_once_and_goes_on_from_defaults(tmp_path):
    """It was an OverflowError out of the daemon: a traceback, exit 1, restarted into the same file."""
    from guardian.act.state import StateCache

    (tmp_path / "state.json").write_text('{"version": 1, "restarts": {"a": [' + "9" * 400 + "]}}")
    cache = StateCache(store_at(tmp_path))
    problems = cache.load()
    assert len(problems) == 1 and "was corrupt" in problems[0] and "moved aside" in problems[0]
    assert cache.data["restarts"] == {} and cache.load() == []


# --- canary latencies (issue 20): learned deadlines survive a restart of guardian -------------------

def executor_on(store: StateStore):
    from guardian.act.executor import Executor
    from guardian.act.restart import Tools
    from guardian.act.journal import Journal
    from guardian.config import Config

    return Executor(Tools(None, store, Journal(socket_path="/nonexistent"), Config(), lambda: NOW), None)


def test_canary_latencies_round_trip_through_the_executor_and_the_view(tmp_path):
    from guardian.core.actions import RecordCanaryLatencies

    store = store_at(tmp_path)
    store.update(lambda d: record_restart(d, "a", NOW, keep_s=600))
    ex = executor_on(store)
    ex.perform([RecordCanaryLatencies((("a", (0.5, 0.25, 0.75)), ("b", (1.0,))))], {}, NOW)
    ex.perform([RecordCanaryLatencies((("b", (1.0, 2.0)),))], {}, NOW)  # only what changed: a's are kept
    pv = view(store_at(tmp_path).read(), NOW)
    assert pv.canary_latencies == {"a": (0.5, 0.25, 0.75), "b": (1.0, 2.0)}
    assert pv.restarts == {"a": (NOW.mono,)}  # the rest of the file untouched
    # the newest 8 only; a canary_timeout_s may be longer than the file's bound: brought within it
    ex.perform([RecordCanaryLatencies((("a", tuple(float(i) for i in range(1, 10)) + (7200.0,)),))], {}, NOW)
    assert view(store_at(tmp_path).read(), NOW).canary_latencies["a"] == (3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 3600.0)


@pytest.mark.parametrize("latencies", ["[0]", "[-0.5]", "[3600.001]", "[NaN]", "[Infinity]", "[true]", '["0.5"]',
                                       "[null]", "0.5", "[" + "9" * 400 + "]", "[[0.5]]"])
def test_a_canary_latency_that_is_not_a_number_in_0_to_3600_makes_the_file_corrupt(tmp_path, latencies):
    (tmp_path / "state.json").write_text('{"version": 1, "canary_latencies": {"a": ' + latencies + "}}")
    store = store_at(tmp_path)
    with pytest.raises(CorruptState):
        store.read()
    assert store.read()["canary_latencies"] == {}


def test_canary_latencies_at_their_bounds_and_a_longer_list_read_back(tmp_path):
    longer = [9, 9, *([0.5] * 7), 2]  # 10: written by a guardian that kept more; the newest 8 are read
    (tmp_path / "state.json").write_text(json.dumps({"version": 1, "canary_latencies": {
        "a": [1e-9, 3600], "b": longer, "c": []}}))
    pv = view(store_at(tmp_path).read(), NOW)
    assert pv.canary_latencies == {"a": (1e-9, 3600.0), "b": (*([0.5] * 7), 2.0), "c": ()}


def test_a_state_file_from_before_canary_latencies_reads_as_nothing_learned(tmp_path):
    (tmp_path / "state.json").write_text(json.dumps({"version": 1, "restarts": {"a": [NOW.wall - 60]}}))
    store = store_at(tmp_path)
    pv = view(store.read(), NOW)
    assert pv.canary_latencies == {} and pv.restarts["a"] == (NOW.mono - 60,)
    store.update(lambda d: None)  # written back with the new section
    assert json.loads((tmp_path / "state.json").read_text())["canary_latencies"] == {}


def test_the_canary_latencies_of_replicas_no_longer_configured_are_dropped_from_the_file(tmp_path):
    store = store_at(tmp_path)
    store.update(lambda d: record_canary_latencies(d, (("a", (0.5,)), ("gone", (0.25,)))))
    store.update(lambda d: forget_unconfigured(d, {"a"}))
    assert view(store.read(), NOW).canary_latencies == {"a": (0.5,)}


# --- base fractions (issue 25): where the memory guard first lowered a replica from -------------------

def perform_now(ex, actions) -> None:
    """Perform ACTIONS in an event loop and wait for the tasks they started."""
    import asyncio

    async def run():
        ex.perform(actions, {}, NOW)
        await asyncio.gather(*ex.tasks)

    asyncio.run(run())


def lowering_executor(tmp_path, store, monkeypatch, journal=None):
    """An executor for replica a whose env files go under TMP_PATH and whose restarts pass the gates
    on the re-check (the env file is written: act/restart.py's before_restart), issuing no job."""
    import guardian.act.executor as executor_module
    from guardian.act.executor import Executor
    from guardian.act.journal import Journal
    from guardian.act.restart import Tools
    from guardian.core.observations import RestartOutcome
    from harness import cfg

    async def restart(tools, order):
        order.before_restart()
        return RestartOutcome(order.replica.unit, "done", issued=True, ok=True)

    monkeypatch.setattr(executor_module, "checked_restart", restart)
    config = cfg(1).model_copy(update={"state_dir": tmp_path})
    journal = journal if journal is not None else Journal(socket_path="/nonexistent")
    return Executor(Tools(None, store, journal, config, lambda: NOW), None)


def test_a_lowering_records_its_base_and_a_raise_records_nothing(tmp_path, monkeypatch):
    from guardian.core.actions import SetFraction

    store = store_at(tmp_path)
    ex = lowering_executor(tmp_path, store, monkeypatch)
    perform_now(ex, [SetFraction("a", "vllm-a.service", 0.78, 0.74, restart=True, evidence="squeezed")])
    assert view(store_at(tmp_path).read(), NOW).fraction_bases == {"a": 0.78}
    # a later lowering from below the base keeps the base; a raise writes nothing
    perform_now(ex, [SetFraction("a", "vllm-a.service", 0.74, 0.70, restart=True, evidence="squeezed"),
                     SetFraction("a", "vllm-a.service", 0.70, 0.74, restart=True, evidence="clear")])
    assert view(store_at(tmp_path).read(), NOW).fraction_bases == {"a": 0.78}
    # the operator raised it above its base by hand since: the next lowering's start is the base
    perform_now(ex, [SetFraction("a", "vllm-a.service", 0.82, 0.78, restart=True, evidence="squeezed")])
    assert view(store_at(tmp_path).read(), NOW).fraction_bases == {"a": 0.82}


def test_a_base_that_cannot_be_recorded_is_said_and_the_lowering_goes_on(tmp_path, monkeypatch):
    from guardian.core.actions import SetFraction
    from harness import Recorder

    store = store_at(tmp_path)
    journal = Recorder()
    ex = lowering_executor(tmp_path, store, monkeypatch, journal)

    def full(change):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "update", full)
    perform_now(ex, [SetFraction("a", "vllm-a.service", 0.78, 0.74, restart=True, evidence="squeezed")])
    (said,) = [line for line, _ in journal.lines]
    assert said.priority == "error" and said.replica == "a" and "cannot record its base fraction 0.78" in said.message
    assert "will not raise it back" in said.message
    # the lowering itself still goes ahead
    assert (tmp_path / "replicas" / "a.env").read_text().endswith("GPU_MEMORY_UTILIZATION=0.74\n")


@pytest.mark.parametrize("bases", ['{"a": 0}', '{"a": 0.001}', '{"a": 1.01}', '{"a": true}', '{"a": "0.78"}',
                                   '{"a": NaN}', '{"a": null}', '{"a": [0.78]}', "[0.78]", '{"a": ' + "9" * 400 + "}"])
def test_a_base_that_is_not_a_fraction_makes_the_file_corrupt(tmp_path, bases):
    (tmp_path / "state.json").write_text('{"version": 1, "fraction_bases": ' + bases + "}")
    store = store_at(tmp_path)
    with pytest.raises(CorruptState):
        store.read()
    assert store.read()["fraction_bases"] == {}


def test_bases_at_their_bounds_read_back_and_a_file_from_before_them_has_none(tmp_path):
    (tmp_path / "state.json").write_text(json.dumps({"version": 1, "fraction_bases": {"a": 0.01, "b": 1}}))
    assert view(store_at(tmp_path).read(), NOW).fraction_bases == {"a": 0.01, "b": 1.0}
    (tmp_path / "state.json").write_text(json.dumps({"version": 1, "restarts": {}}))
    assert view(store_at(tmp_path).read(), NOW).fraction_bases == {}


def test_the_base_of_a_replica_no_longer_configured_is_forgotten(tmp_path):
    from guardian.act.state import record_fraction_base

    store = store_at(tmp_path)
    store.update(lambda d: (record_fraction_base(d, "a", 0.78), record_fraction_base(d, "gone", 0.9)))
    store.update(lambda d: forget_unconfigured(d, {"a"}))
    assert view(store.read(), NOW).fraction_bases == {"a": 0.78}


def test_a_long_waiting_text_or_answer_is_written_short_enough_to_read_back(tmp_path):
    """An etcd error per endpoint can make a fleet wait's text long; a field over the reader's limit
    would make the whole file corrupt (history, pauses and proxy_down lost)."""
    from guardian.act.state import TEXT_MAX_CHARS, record_answer, record_waiting
    from guardian.core.actions import AnswerRequest

    store = store_at(tmp_path)
    store.update(lambda d: d["requests"].update(r1={"replica": "a", "at": {"wall": NOW.wall, "mono": NOW.mono}},
                                                r2={"replica": "a", "at": {"wall": NOW.wall, "mono": NOW.mono}}))
    store.update(lambda d: record_waiting(d, "r1", "x" * 10_000))
    store.update(lambda d: record_answer(d, AnswerRequest("r2", "a", False, "y" * 10_000), NOW))
    data = store.read()  # not corrupt
    assert len(data["requests"]["r1"]["waiting"]) == TEXT_MAX_CHARS and data["requests"]["r1"]["waiting"].endswith("...")
    assert len(data["answers"]["r2"]["message"]) == TEXT_MAX_CHARS


# --- issue 34: state reads that miss nothing a CLI wrote ----------------------------------------------
def test_a_request_written_between_the_daemons_read_and_its_stat_is_read_at_the_next_load(tmp_path):
    """Row 9: the cache stat'ed the file after reading it, so a CLI's write in between looked read
    already, and its restart request waited for some unrelated write."""
    from guardian.act.state import StateCache

    store = store_at(tmp_path)
    store.update(lambda d: None)
    cache = StateCache(store)
    real_read = store.read
    wrote = []

    def read_then_a_cli_writes():
        data = real_read()
        if not wrote:  # the CLI's pause lands right after the daemon's read
            store.update(lambda d: d["pauses"].update({"a": {"until": None}}))
            wrote.append(True)
        return data

    store.read = read_then_a_cli_writes  # type: ignore[method-assign]
    assert cache.load(force=True) == []
    assert "a" not in cache.data["pauses"]  # read before the CLI's write
    assert cache.load() == []
    assert "a" in cache.data["pauses"], "the CLI's write was never read"
    assert cache.load() == [] and "a" in cache.data["pauses"]


# --- issue 34 row 5: no other user can hold the state lock ----------------------------------------------
HOLD = """
import fcntl, os, sys, time
try:
    fd = os.open(sys.argv[1], os.O_RDONLY)
except OSError as e:
    print("denied", e.errno, flush=True)
    sys.exit(0)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a process as user nobody: needs root (make test runs as root)")
def test_a_user_who_is_not_guardian_cannot_open_the_lock_and_so_cannot_stop_a_state_write():
    """The attack: user nobody opened the 0644 lock file read-only and held LOCK_EX; root's
    `guardian pause` blocked, and so did the daemon's start. Here a real process as nobody tries."""
    import shutil
    import subprocess
    import tempfile
    import threading

    base = Path(tempfile.mkdtemp(prefix="guardian-lock-"))
    try:
        base.chmod(0o755)  # as /var/lib is: nobody may walk to the state directory
        store = StateStore(base / "state")
        store.update(lambda d: None)
        # the system's python3: the venv's may lie under /root, which nobody cannot enter
        python = NOBODY_PYTHON
        attacker = subprocess.Popen([python, "-c", HOLD, str(store.lock_path)], stdout=subprocess.PIPE,
                                    text=True, preexec_fn=as_nobody)
        try:
            said = attacker.stdout.readline().strip()  # type: ignore[union-attr]
            done: list[bool] = []
            t = threading.Thread(target=lambda: done.append(bool(store.update(lambda d: None))), daemon=True)
            t.start()
            t.join(30)  # a deadline for a hang only: the write takes milliseconds
            assert said.startswith("denied"), f"user nobody could open the lock: {said}"
            assert done == [True], "root's state write was held by user nobody's lock"
        finally:
            attacker.kill()
            attacker.wait()
        assert oct((base / "state" / ".lock").stat().st_mode & 0o777) == "0o700"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_lock_held_past_its_bound_fails_the_write_with_a_clear_error_and_never_hangs(tmp_path):
    import fcntl

    from guardian.act.state import StateLocked

    store = store_at(tmp_path)
    store.update(lambda d: None)
    store.lock_timeout_s = 0.2
    fd = os.open(store.lock_path, os.O_RDONLY)  # another open file: flock excludes it from this one
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(StateLocked, match="held by another process for over 0.2 s"):
            store.update(lambda d: None)
    finally:
        os.close(fd)
    assert store.update(lambda d: None) is not None  # free again: the write goes through


def test_a_state_read_refused_for_a_held_lock_is_tried_again_at_the_next_load(tmp_path):
    """A lock held past its bound is no reason to take the file as read: a CLI's pause written
    last would otherwise wait for some other write (and at the daemon's start, defaults stay)."""
    from guardian.act.state import StateCache, StateLocked

    store = store_at(tmp_path)
    store.update(lambda d: d["pauses"].update({"a": {"until": None}}))
    cache = StateCache(store)
    real_read = store.read
    calls = []

    def locked_once():
        calls.append(1)
        if len(calls) == 1:
            raise StateLocked(11, "the state lock was held by another process for over 5 s", str(store.lock_path))
        return real_read()

    store.read = locked_once  # type: ignore[method-assign]
    problems = cache.load(force=True)
    assert len(problems) == 1 and "held by another process" in problems[0]
    assert cache.load() == [] and "a" in cache.data["pauses"], "the file was taken as read"


def test_a_request_keeps_its_asker_and_its_expiry(tmp_path):
    """Issue 34 row 12: what the daemon needs to withdraw a request whose command is gone (A5)."""
    at = {"wall": NOW.wall - 5, "mono": NOW.mono - 5}
    ends = {"wall": NOW.wall + 60, "mono": NOW.mono + 60}
    (tmp_path / "state.json").write_text(json.dumps({"version": 1, "boot_id": boot_id(), "requests": {
        "r1": {"replica": "a", "at": at, "expires": ends, "asker": {"pid": 4242, "start": 77}},
        "r0": {"replica": "b", "at": at}}}))  # an older guardian's request
    pv = view(store_at(tmp_path).read(), NOW)
    by_id = {q.id: q for q in pv.requests}
    assert (by_id["r1"].expires, by_id["r1"].asker, by_id["r1"].asker_gone) == (NOW.mono + 60, (4242, 77), False)
    assert (by_id["r0"].expires, by_id["r0"].asker) == (None, None)


@pytest.mark.parametrize("asker", [{"pid": "4242", "start": 77}, {"pid": 4242}, {"pid": 0, "start": 1},
                                   {"pid": True, "start": 1}, [4242, 77]])
def test_a_request_with_a_malformed_asker_is_corrupt(tmp_path, asker):
    at = {"wall": NOW.wall - 5, "mono": NOW.mono - 5}
    (tmp_path / "state.json").write_text(json.dumps({"version": 1, "requests": {
        "r1": {"replica": "a", "at": at, "asker": asker}}}))
    with pytest.raises(CorruptState):
        store_at(tmp_path).read()


@pytest.mark.parametrize("no_drain, kept", [(True, True), (False, False), (None, False)])
def test_a_request_keeps_whether_it_was_asked_with_no_drain(tmp_path, no_drain, kept):
    """Issue 35 item 4: `guardian restart --no-drain` travels to the daemon with its request."""
    at = {"wall": NOW.wall - 5, "mono": NOW.mono - 5}
    q = {"replica": "a", "at": at} | ({} if no_drain is None else {"no_drain": no_drain})
    (tmp_path / "state.json").write_text(json.dumps({"version": 1, "boot_id": boot_id(), "requests": {"r1": q}}))
    (request,) = view(store_at(tmp_path).read(), NOW).requests
    assert request.no_drain is kept


def test_a_request_whose_no_drain_is_not_a_boolean_is_corrupt(tmp_path):
    at = {"wall": NOW.wall - 5, "mono": NOW.mono - 5}
    (tmp_path / "state.json").write_text(json.dumps({"version": 1, "requests": {
        "r1": {"replica": "a", "at": at, "no_drain": "yes"}}}))
    with pytest.raises(CorruptState):
        store_at(tmp_path).read()



def test_a_replicas_longest_steps_survive_a_restart_and_garbage_is_corrupt(tmp_path):
    """Issue 35 item 8: what the stall rules learned of a replica's long prefills outlives guardian."""
    from guardian.act.state import record_steps

    store = store_at(tmp_path)
    learned = ((120.0, NOW.mono - 50), (60.0, NOW.mono - 5), (float("nan"), NOW.mono))
    store.update(lambda d: record_steps(d, (("a", learned),), NOW))
    got = view(store_at(tmp_path).read(), NOW).step_seconds
    assert got == {"a": ((120.0, NOW.mono - 50), (60.0, NOW.mono - 5))}  # when learned, not when read
    at = {"wall": NOW.wall, "mono": NOW.mono}
    for bad in ([0], [{"s": 0, "at": at}], [{"s": -1.0, "at": at}], [{"s": "60", "at": at}], [{"s": True, "at": at}],
                [{"s": 1e9, "at": at}], [{"s": 60.0}], [{"s": 60.0, "at": "noon"}], 60.0):
        (tmp_path / "state.json").write_text(json.dumps({"version": 1, "step_seconds": {"a": bad}}))
        with pytest.raises(CorruptState):
            store_at(tmp_path).read()
