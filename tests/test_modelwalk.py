"""The model walk is bounded and is the unit's (issue 41 row 4), and the threads of the fit step and
the weights are bounded (issue 41 item 5): the files guardian measures and releases before a start
come from what the replica's unit declares, never from a command line its process rewrote (`exec -a`,
as user nobody); a deep tree of nobody's under the model path is cut by the walk's bounds; a link
out of the model path is never followed nor released; a fit step past its bound lets the restart
go on, said at warning; a fingerprint look that hangs is one, on its own thread, and the default
pool stays free; the drop-caches helper waits on no `sync`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from guardian.act import fit as act_fit
from guardian.act import restart as restart_module
from guardian.config import Config, ReplicaConfig
from guardian.core.observations import MemorySample, UnitInfo
from guardian.core.vocab import ActiveState, Decision, LoadState, Priority
from guardian.core.weights import Weights
from guardian.observe import modelfiles
from guardian.observe import weights as weights_module
from guardian.observe.systemd import ServiceDetails, SystemdError
from harness import NOBODY_PYTHON, Recorder, as_nobody

GiB = 2**30
REPO = Path(__file__).resolve().parent.parent
PYTHON = NOBODY_PYTHON
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="runs a process as user nobody: needs root (make test runs as root)")


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every user may walk to (tmp_path lies under root's 0700 pytest directory)."""
    base = Path(tempfile.mkdtemp(prefix="guardian-walk-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False, timeout=120)  # shutil.rmtree recurses: too deep


def cached_file(path: Path, size: int = 4 * 2**20) -> Path:
    """A file written and read back: its pages in the page cache, as a model's after a load."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        os.fsync(f.fileno())  # clean pages: only those a release may drop
    path.read_bytes()
    return path


def cache_of(path: Path) -> int:
    return modelfiles.cached_bytes((str(path),)).bytes


@as_root
def test_a_rewritten_command_line_is_never_what_is_walked_or_released(shared) -> None:
    """Row 4: the replica's process (here user nobody's) rewrites its command line to name another
    model's tree; guardian walked that tree and evicted its cache (65,536 -> 8,192 pages). The files
    are the unit's own: its ExecStart= with ${MODEL} from its Environment=."""
    ours, other = cached_file(shared / "ours" / "model.safetensors"), cached_file(shared / "other" / "model.safetensors")
    proc = subprocess.Popen(
        ["bash", "-c", f'exec -a vllm {PYTHON} -c "import time; time.sleep(60)" serve {other.parent}'],
        preexec_fn=as_nobody,
    )
    try:
        deadline = time.monotonic() + 20
        while not Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(b"vllm\0"):
            assert time.monotonic() < deadline and proc.poll() is None, "the rewritten command line never showed"
            time.sleep(0.02)
        r = ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:8001", model="m")
        cfg = Config(replicas=[r], state_dir=shared / "state", memory={"device_total_bytes": 100 * GiB, "unified": True})
        unit = UnitInfo("vllm-a.service", LoadState.LOADED, ActiveState.ACTIVE, main_pid=proc.pid)
        details = ServiceDetails((), ("/usr/bin/env", "vllm", "serve", "${MODEL}"), (f"MODEL={ours.parent}",))
        m = act_fit.measure(cfg, r, unit, details)
        assert m.files.paths == (str(ours),), m.files
        assert cache_of(other) >= 2**20 and cache_of(ours) >= 2**20
        assert modelfiles.release(m.files.paths, m.files.top) == 1
        assert cache_of(other) >= 2**20, "another model's page cache was released"
        assert cache_of(ours) < 2**20
    finally:
        proc.kill()
        proc.wait()


DEEP = """
import os, sys
os.chdir(sys.argv[1])
for name in ["zz"] + ["d"] * int(sys.argv[2]):  # one level at a time: makedirs recurses
    os.mkdir(name)
    os.chdir(name)
for n in range(int(sys.argv[3])):
    open(f"f{n}.safetensors", "w").close()
"""


def deep_tree(model: Path, depth: int, files: int, nobody: bool) -> None:
    """The model's own two files at its top, beside a tree DEPTH deep with FILES at its bottom (nobody's)."""
    model.mkdir(mode=0o777)
    model.chmod(0o777)  # a shared model directory: others may write into it
    cached_file(model / "config.json", 100)
    cached_file(model / "model.safetensors", 4096)
    subprocess.run([PYTHON, "-c", DEEP, str(model), str(depth), str(files)], check=True, timeout=120,
                   preexec_fn=as_nobody if nobody else None)


@as_root
def test_a_deep_tree_of_nobodys_under_the_model_path_is_cut_by_the_directories_visited(shared, monkeypatch) -> None:
    """Row 4: a tree of nobody's files 1,000 deep under the model path (60 ms a file, 13.7 s for
    800 files, before). The walk reads at most MAX_DIRS directories, breadth first: the model's own
    files near its top are found, the tree's bottom is never reached."""
    model = shared / "model"
    deep_tree(model, 1000, 800, nobody=True)
    monkeypatch.setattr(modelfiles, "MAX_DIRS", 100, raising=False)
    found = modelfiles.find(("vllm", "serve", str(model)), {})
    assert found.paths == (str(model / "config.json"), str(model / "model.safetensors"))
    assert found.truncated


def test_the_walk_stops_at_its_time_bound_with_the_shallow_files_found(shared) -> None:
    """Row 4's time bound, on a fake clock that advances 10 ms each time it is read: the walk stops
    once WALK_MAX_S has passed, however deep the tree, with the files found by then."""
    model = shared / "model"
    deep_tree(model, 1000, 10, nobody=False)
    ticks = iter(range(10**9))
    found = modelfiles.find(("vllm", "serve", str(model)), {}, clock=lambda: next(ticks) * 0.01)
    assert found.paths == (str(model / "config.json"), str(model / "model.safetensors"))
    assert "time" in found.cut
    assert next(ticks) < 1000, "the walk read the whole tree"  # 2 s of 10 ms readings, and a few more
    # a deadline the caller sets (the fit step's) comes first when it is sooner
    early = modelfiles.find(("vllm", "serve", str(model)), {}, deadline_mono=0.0, clock=lambda: 1.0)
    assert early.paths == () and early.truncated


def test_a_link_out_of_the_model_path_is_neither_followed_nor_released(tmp_path) -> None:
    """Only files under the model path's real path are measured and released: a link to another
    model's file is not followed, and a file swapped for such a link after the walk is left alone."""
    other = cached_file(tmp_path / "other" / "model.safetensors")
    model = tmp_path / "ours"
    own = cached_file(model / "model.safetensors")
    (model / "evil.safetensors").symlink_to(other)
    (model / "sub").mkdir()
    (model / "sub" / "inner.safetensors").symlink_to(own)  # a link inside the path: one file, kept
    found = modelfiles.find(("vllm", "serve", str(model)), {})
    assert found.paths == (str(own),)
    own.unlink()
    own.symlink_to(other)  # swapped between the walk and the release
    assert modelfiles.release(found.paths, found.top) == 0
    assert modelfiles.cached_bytes(found.paths, found.top).bytes == 0
    assert cache_of(other) >= 2**20


def test_a_linked_model_path_is_walked_through_its_real_path(tmp_path) -> None:
    """A model path that is itself a link (a hub cache on another disk) is the place it names."""
    real = tmp_path / "disk" / "qwen"
    cached_file(real / "model.safetensors", 4096)
    (tmp_path / "models").symlink_to(tmp_path / "disk")
    found = modelfiles.find(("vllm", "serve", str(tmp_path / "models" / "qwen")), {})
    assert found.paths == (str(real / "model.safetensors"),) and found.top == str(real)


@pytest.mark.parametrize(
    "exec_start, env, argv",
    [
        (("vllm", "serve", "${MODEL}"), {"MODEL": "/m"}, ("vllm", "serve", "/m")),
        (("vllm", "serve", "/x/${NAME}-v2"), {"NAME": "q"}, ("vllm", "serve", "/x/q-v2")),
        (("vllm", "$ARGS"), {"ARGS": "serve  /m --port 1"}, ("vllm", "serve", "/m", "--port", "1")),
        (("vllm", "$ARGS", "${UNSET}"), {}, ("vllm", "")),  # a bare unset word is none, a braced one empty
        (("echo", "$$HOME", "a$${B}"), {"HOME": "/h", "B": "b"}, ("echo", "$HOME", "a${B}")),
    ],
)
def test_a_units_exec_start_is_expanded_as_systemd_does(exec_start, env, argv) -> None:
    assert modelfiles.unit_argv(exec_start, env) == argv


def test_a_walk_cut_short_counts_the_whole_cache_as_possibly_its_own() -> None:
    """Files the walk did not reach may hold any of the cache: never a refusal (U7) on a figure a
    tree built to be slow made small."""
    sample = MemorySample(100 * GiB, GiB, GiB, None, None, file_cache_bytes=30 * GiB)
    cut = modelfiles.ModelFiles("m", ("/m/a",), cut="its time (2 s at most) spent")
    whole = modelfiles.ModelFiles("m", ("/m/a",))
    measured = modelfiles.Cached(GiB, True)
    assert act_fit._own_cached_bytes(cut, measured, sample, act_fit.Start()) == 30 * GiB
    assert act_fit._own_cached_bytes(whole, measured, sample, act_fit.Start()) == GiB
    assert act_fit._own_cached_bytes(cut, measured, sample, act_fit.Start(own_released=True)) == 0


class NoSystemd:
    async def service_details(self, name: str) -> ServiceDetails:
        raise SystemdError("no bus here")


def test_a_fit_step_past_its_bound_lets_the_restart_go_on_said_at_warning(tmp_path, monkeypatch) -> None:
    """Row 4: `fit.measure` was awaited unbounded before the restart. A measure that never ends (a
    walk on a file system that hangs) now costs the restart the step's bound, then it goes on
    without the fit, said at warning naming the replica, its unit and what was skipped."""
    hang = threading.Event()
    monkeypatch.setattr(act_fit, "measure", lambda *args: hang.wait(60))
    r = ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:8001", model="m")
    cfg = Config(replicas=[r], state_dir=tmp_path, memory={"unified": True})
    journal = Recorder()
    tools = restart_module.Tools(NoSystemd(), None, journal, cfg)  # type: ignore[arg-type]
    step = act_fit.FitStep(tools.sd, journal, cfg)
    step.bound_s = 0.2
    order = restart_module.RestartOrder(r, "a test")

    async def fit() -> act_fit.Fitted:
        try:
            return await asyncio.wait_for(restart_module._fit(tools, step, order, None), 30)
        finally:
            hang.set()

    fitted = asyncio.run(fit())
    assert fitted.refused is None and fitted.measured is None
    (line,) = [x for x, _ in journal.lines]
    assert line.priority is Priority.WARNING and line.decision is Decision.CACHE
    assert (line.replica, line.unit) == ("a", "vllm-a.service")
    assert "did not end within 0.2 s (it was measuring its start's memory" in line.message
    assert "restarting vllm-a.service without it: skipped" in line.message


def test_a_fingerprint_look_that_hangs_is_one_on_its_own_thread_and_the_default_pool_stays_free(monkeypatch) -> None:
    """Item 5: a fingerprint on a file system that hangs left its thread running past WEIGHTS_LOOK_S
    and each tick started another, until the default pool was used up and every `to_thread` of the
    tick stalled. Now one look per replica at a time, on a thread of its own; one that outlived its
    bound is unknown, not waited for, and not started again until it ends."""
    hang, calls = threading.Event(), []

    def fingerprint(*args: object) -> Weights:
        calls.append(args)
        hang.wait(60)
        return Weights("dir:abc", "its config.json")

    monkeypatch.setattr(weights_module, "fingerprint", fingerprint)
    cfg = Config(replicas=[ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:8001", model="m")])
    units = {"a": UnitInfo("vllm-a.service", LoadState.LOADED, ActiveState.ACTIVE, main_pid=0)}
    watch = weights_module.WeightsWatch()

    async def ticks() -> None:
        asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=3))
        try:
            for _ in range(3):  # as the daemon's tick bounds it (WEIGHTS_LOOK_S)
                try:
                    await asyncio.wait_for(watch.look(cfg, NoSystemd(), units), 0.3)  # type: ignore[arg-type]
                except TimeoutError:
                    pass
            assert len(calls) == 1, f"{len(calls)} looks of one replica at once"
            assert await asyncio.wait_for(asyncio.to_thread(lambda: 7), 10) == 7, "the default pool is used up"
            assert await asyncio.wait_for(watch.look(cfg, NoSystemd(), units), 10) == {"a": None}  # type: ignore[arg-type]
            hang.set()
            deadline = time.monotonic() + 20
            while (await watch.look(cfg, NoSystemd(), units)).get("a") is None:  # type: ignore[arg-type]
                assert time.monotonic() < deadline, "the look's answer, once it ended, was never kept"
                await asyncio.sleep(0.02)
            assert len(calls) == 1  # its answer kept: not read again for the same process
        finally:
            hang.set()

    asyncio.run(ticks())


def test_the_drop_caches_helper_waits_on_no_sync_and_is_bounded_well_under_the_fit_step() -> None:
    """Item 5: the helper ran `sync && echo 1 > drop_caches`; any user's steady writes held `sync` for
    its 60 s while the fit step, and so the restart, waited for it."""
    text = (REPO / "units" / "guardian-drop-caches.service").read_text()
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    (exec_start,) = [line for line in lines if line.startswith("ExecStart=")]
    assert "sync" not in exec_start and "/proc/sys/vm/drop_caches" in exec_start
    (timeout,) = [line.partition("=")[2] for line in lines if line.startswith("TimeoutStartSec=")]
    assert timeout.endswith("s") and float(timeout[:-1]) <= act_fit.DROP_CACHES_TIMEOUT_S
    assert act_fit.DROP_CACHES_TIMEOUT_S <= act_fit.FIT_STEP_S / 2
