"""A start that fits (core/fit/startfit.py): the rows U1-U7 at their boundaries, and the model files a
replica's command line names (observe/modelfiles.py) with their real page cache."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from guardian.core.fit import startfit
from guardian.core.fit.startfit import Release, StartFit
from guardian.observe import modelfiles

GiB = 2**30


def fit(**kw: object) -> StartFit:
    """A 10 GiB need (0.5 x 20 GiB) on a box whose MemFree is 6 GiB, 1 GiB coming back, 5 GiB of
    the cache its own files', 12 GiB cached in all; release of its own files on, drop off."""
    base = StartFit(
        replica="a",
        unit="vllm-a.service",
        fraction=0.5,
        total_bytes=20 * GiB,
        free_bytes=6 * GiB,
        returned_bytes=1 * GiB,
        held_bytes=1 * GiB,
        own_cached_bytes=5 * GiB,
        own_files=3,
        cache_bytes=12 * GiB,
        release_own=True,
        drop_caches=False,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


LOWERABLE = {"lower_floor": 0.3, "reserve_bytes": 1 * GiB}
ROW_CASES = [
    ({"unified": False, "free_bytes": 0}, "U1", Release.NOTHING, True),
    # an engine whose need no fraction of the whole memory says (llama.cpp, TensorRT-LLM): not judged
    ({"sized_by_fraction": False, "free_bytes": 0}, "U11", Release.NOTHING, True),
    ({"sized_by_fraction": False, "unified": False}, "U1", Release.NOTHING, True),
    ({"free_bytes": 9 * GiB}, "U2", Release.NOTHING, True),  # 9 + 1 = 10: <= need
    ({"free_bytes": 9 * GiB - 1}, "U3", Release.OWN, True),
    ({"free_bytes": 4 * GiB}, "U3", Release.OWN, True),  # 4 + 1 + 5 = 10
    ({"free_bytes": 4 * GiB - 1}, "U7", Release.NOTHING, False),
    ({"free_bytes": 2 * GiB, "drop_caches": True}, "U4", Release.ALL, True),  # 2 + 1 + 12 > 10
    ({"free_bytes": 2 * GiB, "release_own": False}, "U7", Release.NOTHING, False),
    # what its fraction reserves may come back: started after the releases allowed, said
    ({"free_bytes": 2 * GiB, "held_bytes": 3 * GiB}, "U5", Release.OWN, True),  # 2 + 3 + 5 = 10
    ({"free_bytes": 2 * GiB, "held_bytes": 3 * GiB - 1}, "U7", Release.NOTHING, False),
    ({"free_bytes": 2 * GiB, "held_bytes": 10 * GiB, "release_own": False}, "U5", Release.NOTHING, True),
    (
        {"free_bytes": 0, "held_bytes": 1 * GiB, "drop_caches": True, "cache_bytes": 8 * GiB},
        "U7",
        Release.NOTHING,
        False,
    ),
    # the memory guard may lower it (lower_floor set): the highest fraction that fits, else refused
    ({"free_bytes": 2 * GiB, **LOWERABLE}, "U6", Release.OWN, True),  # 2 + 1 + 5 - 1 = 7 of 20: 0.35
    ({"free_bytes": 2 * GiB, **LOWERABLE, "lower_floor": 0.36}, "U7", Release.NOTHING, False),
    ({"free_bytes": 9 * GiB, **LOWERABLE}, "U2", Release.NOTHING, True),  # a fit is never lowered
    ({"free_bytes": 2 * GiB, "held_bytes": 3 * GiB, **LOWERABLE}, "U5", Release.OWN, True),
]


@pytest.mark.parametrize("changes, rule, release, start", ROW_CASES)
def test_rows(changes: dict[str, object], rule: str, release: Release, start: bool) -> None:
    v = startfit.judge(fit(**changes))
    assert (v.rule.id, v.release, v.start) == (rule, release, start)


@pytest.mark.parametrize(
    "changes, fraction",
    [
        ({"free_bytes": 2 * GiB}, 0.35),
        ({"free_bytes": 2 * GiB, "release_own": False}, None),  # 2 + 1 - 1 = 2 of 20: 0.1, below the floor
        ({"free_bytes": 6 * GiB, "release_own": False}, 0.3),  # 6 + 1 - 1 = 6: the floor itself
        ({"free_bytes": 2 * GiB, "reserve_bytes": 0}, 0.4),  # 8 of 20
        ({"free_bytes": 7 * GiB, "own_cached_bytes": 0, "reserve_bytes": 0}, 0.4),  # 8 of 20: 0.4 < 0.5
        ({"free_bytes": 2 * GiB, "drop_caches": True, "cache_bytes": 6 * GiB}, 0.4),  # 2 + 1 + 6 - 1 = 8
        ({"free_bytes": 9 * GiB - 1, "fraction": 0.55, "own_cached_bytes": 0, "reserve_bytes": 0}, 0.49),  # 10 GiB - 1 B
        ({"free_bytes": 2 * GiB, "lower_floor": None}, None),  # the memory guard off, or not wired
    ],
)
def test_a_lowered_start_takes_the_highest_grid_fraction_that_fits_below_its_own(
    changes: dict[str, object], fraction: float | None
) -> None:
    v = startfit.judge(fit(**{**LOWERABLE, **changes}))
    assert v.fraction == fraction
    assert v.rule.id == ("U6" if fraction is not None else "U7")
    if fraction is not None:  # it fits, and the next step up would not
        f = fit(**{**LOWERABLE, **changes})
        room = f.free_bytes + f.held_bytes + f.all_release_bytes - f.reserve_bytes
        assert fraction * f.total_bytes <= room < (fraction + 0.01) * f.total_bytes


def test_the_whole_cache_counts_its_own_files_once() -> None:
    # drop_caches frees the whole cache, which holds its own files: 4 + 1 + 5 (own, within 5 cached) = 10
    f = fit(free_bytes=4 * GiB - 1, cache_bytes=5 * GiB, release_own=False, drop_caches=True)
    assert startfit.judge(f).rule.id == "U7"
    assert startfit.judge(replace(f, free_bytes=4 * GiB)).rule.id == "U4"


def test_the_table_above_reaches_every_row() -> None:
    # each first-match row is the verdict of some case of ROW_CASES; U8 is checked on its own (below)
    assert {case[1] for case in ROW_CASES} == {row.rule.id for row in startfit.ROWS}
    assert startfit.NOT_RETURNED.id not in {row.rule.id for row in startfit.ROWS}


def test_the_remedy_names_the_switches_that_are_off() -> None:
    text = startfit.remedy(fit(release_own=False, drop_caches=False))
    assert "memory.release_cache = true" in text and "memory.drop_caches = true" in text
    assert "lower its gpu_memory_utilization below 0.35" in text  # (6 + 1) / 20
    assert "release_cache" not in startfit.remedy(fit())


# --- the model files, on a real file system and its page cache ---------------------------------


@pytest.mark.parametrize(
    "argv, model",
    [
        (("vllm", "serve", "/m/qwen", "--port", "8000"), "/m/qwen"),
        (("vllm", "serve", "--port", "8000"), None),
        (("python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "Qwen/Qwen3-8B"), "Qwen/Qwen3-8B"),
        (("vllm-sim", "--model=/m/x.gguf"), "/m/x.gguf"),
        ((), None),
    ],
)
def test_model_of(argv: tuple[str, ...], model: str | None) -> None:
    assert modelfiles.model_of(argv) == model


def _write(path: str, n: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"\x01" * n)
        f.flush()
        os.fsync(f.fileno())  # clean pages: DONTNEED drops only those


def test_a_hub_repo_in_download_dir_is_found_once_per_blob(tmp_path) -> None:
    hub = tmp_path / "hub"
    blob = hub / "models--Org--Name" / "blobs" / "abc"
    _write(str(blob), 4096)
    snap = hub / "models--Org--Name" / "snapshots" / "c0ffee"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to(blob)
    os.mkfifo(hub / "models--Org--Name" / "a-fifo")  # never opened: it would block
    found = modelfiles.find(("vllm", "serve", "Org/Name", "--download-dir", str(hub)), {})
    assert found.paths == (str(blob),)
    assert "Org/Name in" in found.source


def test_the_hub_cache_from_the_unit_environment(tmp_path) -> None:
    _write(str(tmp_path / "hf" / "hub" / "models--Org--Name" / "blobs" / "x"), 10)
    env = modelfiles.unit_env(("HF_HOME=/nowhere",), (f"HF_HOME={tmp_path / 'hf'}\n",))
    assert env["HF_HOME"] == str(tmp_path / "hf")  # a file's value overrides Environment=
    assert len(modelfiles.find(("vllm", "serve", "Org/Name"), env).paths) == 1
    assert modelfiles.find(("vllm", "serve", "Org/Other"), env).paths == ()


def test_release_drops_the_files_clean_pages(tmp_path) -> None:
    path = str(tmp_path / "models" / "big.safetensors")
    _write(path, 8 * 2**20)
    with open(path, "rb") as f:
        while f.read(2**20):
            pass
    found = modelfiles.find(("vllm-sim", "--model", str(tmp_path / "models")), {})
    assert found.paths == (path,)
    assert modelfiles.cached_bytes(found.paths).bytes > 4 * 2**20
    assert modelfiles.release(found.paths) == 1
    assert modelfiles.cached_bytes(found.paths).bytes < 2**20


def test_mincore_where_cachestat_is_missing(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "w.bin")
    _write(path, 2 * 2**20)
    with open(path, "rb") as f:
        f.read()
    with_cachestat = modelfiles.cached_bytes((path,))
    monkeypatch.setattr(modelfiles, "CACHESTAT_NR", 100_000)  # no such syscall: ENOSYS, as before Linux 6.5
    assert modelfiles.cached_bytes((path,)) == with_cachestat
    assert with_cachestat.measured and with_cachestat.bytes > 0


def test_mincore_maps_a_chunk_at_a_time_and_a_sparse_giant_is_not_mapped(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "w.bin")
    _write(path, 5 * 2**20 + 4096)
    with open(path, "rb") as f:
        f.read()
    monkeypatch.setattr(modelfiles, "CACHESTAT_NR", 100_000)
    whole = modelfiles.cached_bytes((path,))
    monkeypatch.setattr(modelfiles, "MINCORE_CHUNK_BYTES", 2**20)  # 6 chunks, the last one page
    assert modelfiles.cached_bytes((path,)) == whole and whole.bytes > 0
    # a sparse file claiming more than a measure may ask mincore about: counted at its size, unmeasured
    giant = str(tmp_path / "sparse.bin")
    with open(giant, "wb") as f:
        f.truncate(modelfiles.MINCORE_MAX_BYTES + 4096)
    assert modelfiles.cached_bytes((giant,)) == modelfiles.Cached(modelfiles.MINCORE_MAX_BYTES + 4096, measured=False)


def test_a_search_stops_after_max_entries(tmp_path, monkeypatch) -> None:
    top = tmp_path / "models"
    for i in range(30):
        (top / f"d{i}").mkdir(parents=True)
    _write(str(top / "d29" / "w.bin"), 10)
    monkeypatch.setattr(modelfiles, "MAX_ENTRIES", 10)  # 30 directories, no file among the first 10 entries
    found = modelfiles.find(("vllm", "serve", str(top)), {})
    assert found.truncated and found.paths == ()
    monkeypatch.setattr(modelfiles, "MAX_ENTRIES", 1000)
    assert len(modelfiles.find(("vllm", "serve", str(top)), {}).paths) == 1


def test_a_file_the_kernel_will_not_measure_counts_at_its_size(tmp_path, monkeypatch) -> None:
    # mincore(2) reports every page resident to a process that neither owns nor may write the file,
    # and cachestat(2) refuses it: such a file is at most its size, and said to be unmeasured
    path = str(tmp_path / "w.bin")
    _write(path, 3 * 4096)
    monkeypatch.setattr(modelfiles, "CACHESTAT_NR", 100_000)
    monkeypatch.setattr(modelfiles, "_may_measure", lambda fd, p: False)
    assert modelfiles.cached_bytes((path,)) == modelfiles.Cached(3 * 4096, measured=False)


def test_an_unmeasured_own_cache_is_said_as_at_most() -> None:
    assert "at most 5.0 GiB of it its own model files (3)" in startfit.figures(fit(own_measured=False))


@pytest.mark.parametrize(
    "returned_gib, rise_gib, missing_gib",
    [
        (0.99, 0.0, None),  # under 1 GiB held: not told from the box's own noise
        (1.0, 0.0, 1.0),
        (1.0, 0.5, None),  # missing 0.5 GiB: not more than max(0.5 GiB, a quarter)
        (1.0, 0.49, 0.51),
        (8.0, 6.0, None),  # a quarter of 8 GiB is 2 GiB
        (8.0, 5.9, 2.1),
        (8.0, -1.0, 8.0),  # MemFree fell meanwhile: nothing came back
    ],
)
def test_memory_not_returned(returned_gib: float, rise_gib: float, missing_gib: float | None) -> None:
    got = startfit.not_returned_bytes(int(returned_gib * GiB), int(rise_gib * GiB))
    assert (None if got is None else round(got / GiB, 2)) == missing_gib


def test_a_containers_model_is_found_on_the_host_through_its_binds(tmp_path) -> None:
    _write(str(tmp_path / "srv" / "qwen" / "model.safetensors"), 10)
    _write(str(tmp_path / "hf" / "hub" / "models--Org--Name" / "blobs" / "b"), 10)
    run = (
        "/usr/bin/docker",
        "run",
        "--rm",
        "--name",
        "vllm-a",
        "-v",
        f"{tmp_path / 'srv'}:/models:ro",
        "--mount",
        f"type=bind,source={tmp_path / 'hf'},target=/root/.cache/huggingface",
        "-e",
        "HF_TOKEN=x",
        "vllm/vllm-openai:latest",
        "--model",
    )
    by_path = modelfiles.find((*run[:-1], "serve", "/models/qwen"), {})
    assert by_path.paths == (str(tmp_path / "srv" / "qwen" / "model.safetensors"),)
    assert "in its container" in by_path.source and "on the host" in by_path.source
    by_repo = modelfiles.find((*run, "Org/Name"), {})
    assert by_repo.paths == (str(tmp_path / "hf" / "hub" / "models--Org--Name" / "blobs" / "b"),)
    assert modelfiles.find((*run[:-1], "serve", "/opt/elsewhere"), {}).paths == ()  # under no mount


@pytest.mark.parametrize(
    "mounts, path, host",
    [
        ((("/srv/m", "/models"),), "/models/q/a.bin", "/srv/m/q/a.bin"),
        ((("/srv/m", "/models"),), "/modelsx/a.bin", None),  # a prefix of the name is not a mount
        ((("/a", "/m"), ("/b", "/m/inner")), "/m/inner/x", "/b/x"),  # the longest mount wins
        ((("/a", "/"),), "/x/y", "/a/x/y"),
    ],
)
def test_on_host(mounts, path, host) -> None:
    assert modelfiles.on_host(path, mounts) == host


# --- what a running replica holds, from its real process tree ----------------------------------


def _tree(tmp_path, child_args: str) -> subprocess.Popen[bytes]:
    """A wrapper shell (not exec'ing) whose child is given CHILD_ARGS, as a start script runs vLLM."""
    ready = tmp_path / "ready"
    code = f"import pathlib, time; pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"
    proc = subprocess.Popen(["sh", "-c", f'{sys.executable} -c "{code}" {child_args}; true'])
    deadline = time.monotonic() + 20
    while not ready.exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the wrapper's child did not start"
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize(
    "child_args, held_fraction",
    [
        ("--gpu-memory-utilization 0.7", 0.7),  # the child's own, behind the wrapper
        ("--port 8000", 0.9),  # hidden by the wrapper (docker -e, a script): vLLM's default, what it would start with
    ],
)
def test_a_running_replica_behind_a_wrapper_is_taken_to_hold_its_fraction(tmp_path, child_args, held_fraction) -> None:
    from guardian.act import fit as act_fit
    from guardian.config import Config, ReplicaConfig
    from guardian.core.observations import UnitInfo
    from guardian.core.vocab import ActiveState, LoadState

    r = ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:8001", model="m")
    cfg = Config(replicas=[r], state_dir=tmp_path / "state", memory={"device_total_bytes": 100 * GiB, "unified": True})
    proc = _tree(tmp_path, child_args)
    try:
        unit = UnitInfo("vllm-a.service", LoadState.LOADED, ActiveState.ACTIVE, main_pid=proc.pid)
        m = act_fit.measure(cfg, r, unit, None)
        assert m.fit.held_bytes >= int(held_fraction * 100 * GiB) > m.fit.returned_bytes
        assert m.fit.held_bytes < int((held_fraction + 0.01) * 100 * GiB)
        inactive = act_fit.measure(cfg, r, replace(unit, active_state=ActiveState.INACTIVE), None).fit
        assert inactive.held_bytes == inactive.returned_bytes < int(0.5 * 100 * GiB)  # nothing reserved once down
    finally:
        proc.kill()
        proc.wait()


def test_memory_back_when_the_stop_was_seen_over_counts_whatever_the_new_start_took_since(monkeypatch, capsys) -> None:
    """U8 reads MemFree the moment the old processes are gone: a start that loads fast (or a unit
    that is ready only once loaded) takes memory before the job ends, and must not read as a leak."""
    import asyncio

    from guardian.act import fit as act_fit
    from guardian.act.journal import Journal
    from guardian.config import Config, ReplicaConfig
    from guardian.observe.meminfo import sample_memory

    monkeypatch.setattr(startfit, "RETURN_WAIT_S", 0.3)
    monkeypatch.setenv("GUARDIAN_LOG_STDERR", "1")
    r = ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:8001", model="m")
    step = act_fit.FitStep(None, Journal(socket_path="/nonexistent"), Config(replicas=[r]))  # type: ignore[arg-type]
    now = sample_memory()
    # before the stop: 100 GiB more free than the box has now, as if the new start took it all at once
    before = act_fit.Measured(
        fit(free_bytes=now.free_bytes + 100 * GiB, returned_bytes=4 * GiB), modelfiles.ModelFiles("", ())
    )
    asyncio.run(step.check_returned(r, before))
    assert step.leftovers["a"].missing_bytes >= 4 * GiB  # read after the job only: all of it "not returned"
    stopped = replace(now, free_bytes=before.fit.free_bytes + 4 * GiB - 2**20)  # back when the stop was over
    asyncio.run(step.check_returned(r, before, stopped))
    assert "a" not in step.leftovers  # a clean restart: the finding kept before it ends (U9)
    asyncio.run(step.check_returned(r, before, replace(stopped, free_bytes=before.fit.free_bytes + GiB)))
    assert step.leftovers["a"].missing_bytes == 3 * GiB  # 1 of 4 back even then: the rest held
    err = capsys.readouterr().err
    assert err.count("hazard over: replica a:") == 1 and "(U9: back: restarted cleanly)" in err  # said once


@pytest.mark.parametrize(
    "environment, own, lowers",
    [
        (("GPU_MEMORY_UTILIZATION=0.78",), 0.78, True),  # the default wiring.py tells operators to keep
        ((), 0.9, False),  # nothing says: vLLM's default, and never lowered from a guess (it would be its base)
    ],
)
def test_a_stopped_wired_units_fraction_is_its_environments_and_a_guess_is_never_lowered(
    tmp_path, environment, own, lowers
) -> None:
    from guardian.act import fit as act_fit
    from guardian.config import Config, ReplicaConfig
    from guardian.observe.systemd import ServiceDetails

    r = ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:8001", model="m")
    cfg = Config(replicas=[r], state_dir=tmp_path / "state",
                 memory={"device_total_bytes": 100 * GiB, "unified": True, "enabled": True})
    details = ServiceDetails(
        environment_files=(str(cfg.env_dir / "a.env"),),
        exec_start=("/usr/bin/vllm", "serve", "m", "--gpu-memory-utilization", "${GPU_MEMORY_UTILIZATION}"),
        environment=environment,
    )
    m = act_fit.measure(cfg, r, None, details, act_fit.Start(may_lower=True))
    assert m.fit.fraction == own
    assert (m.fit.lower_floor is not None) == lowers
    # the core's say: with a change of its fraction in flight it is never lowered here
    assert act_fit.measure(cfg, r, None, details, act_fit.Start()).fit.lower_floor is None


@pytest.mark.parametrize(
    "guard_on, wired, settled, own_known, floor",
    [
        (True, True, True, True, 0.5),
        (False, True, True, True, None),  # the memory guard off
        (True, False, True, True, None),  # its unit does not read guardian's env file
        (True, True, False, True, None),  # a change of its fraction in flight (or this start is one)
        (True, True, True, False, None),  # nothing says its fraction: never lowered from vLLM's default
    ],
)
def test_a_start_may_be_lowered_only_where_every_condition_holds(guard_on, wired, settled, own_known, floor) -> None:
    assert startfit.lowering_floor(guard_on, 0.5, wired, settled, own_known) == floor


# --- issue 44 item 4(b): a U8 finding kept, judged each tick, until what was missing is back ---------

MISSING = int(1.5 * GiB)  # back once the unheld memory rose by 1.5 - max(0.5, 1.5 / 4) = 1.0 GiB


def look(t: float, free: float, cache: float, own: float, clean: bool = False) -> startfit.LeftoverLook:
    return startfit.LeftoverLook(int(free * GiB), int(cache * GiB), int(own * GiB), t, restarted_clean=clean)


# Each case: the looks, one a tick, on a fake clock (s, then MemFree, file cache and what the replica's
# processes hold, GiB), and what each look leaves: None while the finding is kept, else the rule that ended it.
KEPT_CASES = {
    "the file in /dev/shm deleted while the replica serves: back for 10 s, over": (
        [look(0, 10, 20, 5), look(2, 5, 25, 5), look(4, 6.5, 25, 5), look(8, 6.5, 25, 5), look(14, 6.5, 25, 5)],
        [None, None, None, None, "U10"],
    ),
    "its new start loads: MemFree moves into the page cache and its own memory, nothing comes back": (
        [look(0, 30, 5, 1), look(2, 20, 12, 4), look(4, 8, 20, 8), look(30, 8, 20, 8), look(60, 8, 20, 8)],
        [None, None, None, None, None],
    ),
    "back for a moment only (a process exits and starts again): the 10 s begin anew": (
        [look(0, 10, 20, 5), look(2, 12, 20, 5), look(6, 10, 20, 5), look(8, 12, 20, 5), look(16, 12, 20, 5),
         look(18, 12, 20, 5)],
        [None, None, None, None, None, "U10"],
    ),
    "exactly the slack short of all of it: back": (
        [look(0, 10, 0, 0), look(2, 11, 0, 0), look(12, 11, 0, 0)],
        [None, None, "U10"],
    ),
    "less than that: kept, however long": (
        [look(0, 10, 0, 0), look(2, 11 - 1 / 1024, 0, 0), look(600, 11 - 1 / 1024, 0, 0)],
        [None, None, None],
    ),
    "a later restart of it returned what its processes held: over at once": (
        [look(0, 10, 0, 0), look(2, 0, 0, 0, clean=True)],
        [None, "U9"],
    ),
    "the first look is the base, whatever MemFree was at the finding": (
        [look(0, 50, 0, 0), look(20, 50, 0, 0)],
        [None, None],
    ),
}


@pytest.mark.parametrize("looks, ends", list(KEPT_CASES.values()), ids=list(KEPT_CASES))
def test_a_kept_finding_ends_only_when_what_was_missing_is_back(looks, ends) -> None:
    kept: startfit.Leftover | None = startfit.Leftover(MISSING, 4 * GiB, found_wall=1000.0)
    got = []
    for seen in looks:
        assert kept is not None, "judged after it ended"
        verdict = startfit.judge_kept(kept, seen)
        kept = verdict.kept
        got.append(verdict.rule.id if verdict.rule is not None else None)
        assert (verdict.kept is None) == (verdict.rule is not None)
    assert got == ends


def test_a_kept_finding_has_its_base_from_the_first_look_and_back_since_while_back() -> None:
    kept = startfit.Leftover(MISSING, 4 * GiB, found_wall=1000.0)
    first = startfit.judge_kept(kept, look(0, 10, 20, 5)).kept
    assert first is not None and first.base_bytes == 35 * GiB and first.back_since_mono is None
    back = startfit.judge_kept(first, look(4, 11, 20, 5)).kept
    assert back is not None and back.back_since_mono == 4 and back.base_bytes == 35 * GiB
    assert startfit.judge_kept(back, look(6, 10, 20, 5)).kept.back_since_mono is None


def test_the_kept_finding_is_said_over_once_at_info_and_leaves_status(capsys, monkeypatch) -> None:
    from guardian.act import fit as act_fit
    from guardian.act.journal import Journal
    from guardian.config import ReplicaConfig

    monkeypatch.setenv("GUARDIAN_LOG_STDERR", "1")
    journal = Journal(socket_path="/nonexistent")
    r = ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:8001", model="m")
    leftovers = {"a": startfit.Leftover(MISSING, 4 * GiB, found_wall=1000.0)}
    for seen in (look(0, 10, 0, 0), look(2, 12, 0, 0), look(12, 12, 0, 0), look(14, 12, 0, 0)):
        act_fit.judge_kept(leftovers, r, seen, journal)
    assert leftovers == {}
    err = capsys.readouterr().err
    assert err.count("hazard over: replica a: the 1.5 GiB its processes held that did not come back") == 1
    assert "(U10: back: memory regained)" in err


def test_the_status_line_of_a_kept_finding_no_longer_says_only_a_reboot_frees_it() -> None:
    text = startfit.not_returned_text("a", MISSING)
    assert text.startswith("replica a: 1.5 GiB its processes held did not come back when they exited (U8)")
    assert "comes back once deleted" in text and "(U10)" in text and "(U9)" in text
    assert "a reboot frees it" not in text


# --- what the fit says (core/fit/fitsay.py): the core chooses the lines, the fit step writes them -------

def test_a_refusal_is_said_when_its_episode_begins_and_a_start_ends_the_episode() -> None:
    from guardian.core.fit import fitsay

    no_fit, fits = fit(free_bytes=0, own_cached_bytes=0), fit(free_bytes=9 * GiB)
    said, episode, out = None, None, []
    for f in (no_fit, no_fit, replace(no_fit, fraction=0.8), fits, no_fit):
        said = fitsay.verdict("a", "vllm-a.service", f, startfit.judge(f), episode)
        episode = said.episode
        out.append((said.refused is not None, [(x.rule, x.gate) for x in said.lines]))
    u7 = [("U7", "no-fit")]
    # refused each time; said at the first, again for another need (0.8 x 20 GiB), and after a start between
    assert out == [(True, u7), (True, []), (True, u7), (False, []), (True, u7)], out


@pytest.mark.parametrize("kw, rule, priority", [
    ({"free_bytes": 7 * GiB, "own_cached_bytes": 0, **LOWERABLE}, "U6", "warning"),  # 0.35 x 20 <= 7 + 1 - 1
    ({"free_bytes": 0, "own_cached_bytes": 0, "held_bytes": 12 * GiB}, "U5", "warning"),
    ({"free_bytes": 9 * GiB}, None, None),  # U2: a start that fits says nothing
])
def test_a_lowered_or_doubtful_start_is_said_at_warning_with_its_rule(kw, rule, priority) -> None:
    from guardian.core.fit import fitsay

    f = fit(**kw)
    said = fitsay.verdict("a", "vllm-a.service", f, startfit.judge(f), None)
    assert said.refused is None and said.episode is None
    assert [(x.rule, x.priority.name.lower()) for x in said.lines] == ([(rule, priority)] if rule else [])
