"""The same weights behind one name (issue 33 item 1): fingerprints read from real files
(observe/weights.py), W1 and W2 as tables (core/weights.py), and each said once (act/notices.py)."""

from __future__ import annotations

import json

import pytest

from guardian.act.journal import Journal
from guardian.act.notices import Notices
from guardian.config import Config, ReplicaConfig
from guardian.core.weights import Weights, changed, differing
from guardian.observe.weights import fingerprint

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def model_dir(tmp_path, name: str, config: dict, index: dict | None = None):
    d = tmp_path / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config))
    if index is not None:
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "model-00001.safetensors").write_bytes(b"\0" * 64)
    return d


def test_a_model_directory_is_its_config_and_index(tmp_path):
    a = model_dir(tmp_path, "a", {"layers": 32})
    same = model_dir(tmp_path, "same", {"layers": 32})
    other = model_dir(tmp_path, "b", {"layers": 36})
    fa, fs, fo = (fingerprint(("vllm", "serve", str(d))) for d in (a, same, other))
    assert fa is not None and fa.digest.startswith("dir2:") and "config.json" in fa.what and str(a) in fa.what
    assert fa.digest == fs.digest != fo.digest  # the same files wherever they are, another config differs
    indexed = model_dir(tmp_path, "c", {"layers": 32}, {"weight_map": {"x": "model-00001.safetensors"}})
    assert fingerprint(("vllm", "serve", str(indexed))).digest != fa.digest  # the index counts too


def test_without_config_the_weight_files_names_sizes_and_bytes(tmp_path):
    d = tmp_path / "bare"
    d.mkdir()
    (d / "w.safetensors").write_bytes(b"\0" * 10)
    first = fingerprint(("vllm", "serve", str(d)))
    (d / "w.safetensors").write_bytes(b"\0" * 11)
    assert first is not None and "names, sizes and sampled bytes (17 x 4 KiB each) of 1 weight files" in first.what
    assert fingerprint(("vllm", "serve", str(d))).digest != first.digest
    (d / "w.safetensors").unlink()
    assert fingerprint(("vllm", "serve", str(d))) is None  # nothing to read: unknown


def test_a_gguf_file_is_its_name_size_and_head(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"\1" * 100)
    first = fingerprint(("vllm", "serve", str(f)))
    f.write_bytes(b"GGUF" + b"\2" * 100)
    assert first is not None and first.digest.startswith("file2:")
    assert first.digest != fingerprint(("vllm", "serve", str(f))).digest


@pytest.mark.parametrize(
    "argv_tail, refs, digest",
    [
        ((), {"main": COMMIT_A}, f"hf:Org/Name@{COMMIT_A[:12]}"),
        (("--revision", "v2"), {"main": COMMIT_A, "v2": COMMIT_B}, f"hf:Org/Name@{COMMIT_B[:12]}"),
        (("--revision", COMMIT_B), {}, f"hf:Org/Name@{COMMIT_B[:12]}"),  # a commit names itself
        ((), {"main": "not a commit"}, None),
        ((), {}, None),
    ],
)
def test_a_hub_repo_is_the_commit_its_snapshot_resolves_to(tmp_path, argv_tail, refs, digest):
    folder = tmp_path / "hub" / "models--Org--Name"
    (folder / "refs").mkdir(parents=True)
    for name, commit in refs.items():
        (folder / "refs" / name).write_text(commit + "\n")
    found = fingerprint(("vllm", "serve", "Org/Name", "--download-dir", str(tmp_path / "hub"), *argv_tail))
    assert (found.digest if found else None) == digest


def test_a_container_replica_is_read_through_its_bind(tmp_path):
    d = model_dir(tmp_path, "host-models", {"layers": 32})
    argv = ("docker", "run", "--name", "vllm-a", "-v", f"{d}:/models/q", "vllm/vllm-openai", "--model", "/models/q")
    found = fingerprint(argv)
    assert found is not None and found.digest == fingerprint(("vllm", "serve", str(d))).digest


def cfg(*models: str) -> Config:
    return Config(replicas=[ReplicaConfig(name=n, unit=f"vllm-{n}.service", url=f"http://127.0.0.1:800{i}", model=m)
                            for i, (n, m) in enumerate(zip("abc", models, strict=False), 1)])


W = {d: Weights(d, f"read from {d}") for d in ("dir:1", "dir:2")}


@pytest.mark.parametrize(
    "models, found, hazards",
    [
        (("m", "m"), {"a": W["dir:1"], "b": W["dir:1"]}, []),
        (("m", "m"), {"a": W["dir:1"], "b": W["dir:2"]}, ["weights-differ:m"]),
        (("m", "n"), {"a": W["dir:1"], "b": W["dir:2"]}, []),  # other names may differ
        (("m", "m"), {"a": W["dir:1"], "b": None}, []),  # unknown is never a difference
        (("m", "m", "n"), {"a": W["dir:1"], "b": W["dir:2"], "c": W["dir:1"]}, ["weights-differ:m"]),
    ],
)
def test_w1_replicas_of_one_name_with_different_weights(models, found, hazards):
    got = differing(cfg(*models), found)
    assert [h.key for h in got] == hazards
    assert all(h.rule == "W1" and h.over == "hazard over: m's replicas serve the same weights" for h in got)
    if got:
        assert "a: dir:1 (read from dir:1)" in got[0].message and "b: dir:2" in got[0].message


@pytest.mark.parametrize(
    "before, after, changes",
    [
        ({"a": W["dir:1"]}, {"a": W["dir:2"]}, ["a"]),
        ({"a": W["dir:1"]}, {"a": W["dir:1"]}, []),
        ({"a": None}, {"a": W["dir:2"]}, []),  # first read: not a change
        ({"a": W["dir:1"]}, {"a": None}, []),  # unreadable now: not a change
        ({}, {"a": W["dir:1"]}, []),
    ],
)
def test_w2_a_replica_whose_weights_changed(before, after, changes):
    assert [name for name, _, _ in changed(before, after)] == changes


def test_each_difference_is_said_once_while_it_lasts_and_when_it_is_over(capsys, monkeypatch):
    monkeypatch.setenv("GUARDIAN_LOG_STDERR", "1")
    notices, c = Notices(Journal(socket_path="/nonexistent")), cfg("m", "m")
    moved = [notices.weights(c, found)[1] for found in (
        {"a": W["dir:1"], "b": W["dir:2"]}, {"a": W["dir:1"], "b": W["dir:2"]}, {"a": W["dir:1"], "b": W["dir:1"]})]
    assert moved == [[], [], ["b"]]
    err = capsys.readouterr().err
    assert err.count("serve model m with different weights") == 1
    assert err.count("replica b: its weights changed: dir:2 -> dir:1") == 1
    assert err.count("hazard over: m's replicas serve the same weights") == 1


def member(box: str, name: str, weights: str | None, model: str = "m"):
    from guardian.core.observations import FleetMember

    return FleetMember(box, name, model, "healthy", True, weights)


@pytest.mark.parametrize(
    "members, hazards",
    [
        ([member("box2", "x", "dir:1")], []),
        ([member("box2", "x", "dir:2")], ["weights-differ-fleet:m"]),
        ([member("box2", "x", None)], []),  # an older guardian, or unknown there: never a difference
        ([member("box2", "x", "dir:2", model="n")], []),  # another model
        ([member("box1", "b", "dir:2")], []),  # this box's own entry: W1's business
    ],
)
def test_w3_other_boxes_serving_the_name_with_other_weights(members, hazards):
    c = cfg("m", "m")
    from guardian.core.weights import differing_in_fleet

    got = differing_in_fleet(c, {"a": W["dir:1"], "b": W["dir:1"]}, members, "box1")
    assert [h.key for h in got] == hazards
    assert all(h.rule == "W3" and h.over.endswith("same weights across the fleet") for h in got)
    if got:
        assert "here a: dir:1; b: dir:1; box2/x: dir:2" in got[0].message


def test_a_published_member_carries_its_weights_and_garbage_there_is_refused():
    from guardian.fleet.sync import NotOurs, read_member

    base = {"box": "b2", "name": "x", "unit": "u", "model": "m", "state": "healthy", "serves": True}
    assert read_member(json.dumps(base | {"weights": "dir:1"}))[0].weights == "dir:1"
    assert read_member(json.dumps(base))[0].weights is None  # a guardian before issue 33
    with pytest.raises(NotOurs, match="'weights'"):
        read_member(json.dumps(base | {"weights": 7}))


def test_a_fifo_named_as_the_model_is_never_opened(tmp_path):
    import os

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    assert fingerprint(("vllm", "serve", str(fifo))) is None  # returns at once: opening it would block


def test_a_revision_never_reads_outside_refs(tmp_path):
    folder = tmp_path / "hub" / "models--Org--Name"
    (folder / "refs").mkdir(parents=True)
    (tmp_path / "hub" / "secret").write_text(COMMIT_A)
    argv = ("vllm", "serve", "Org/Name", "--download-dir", str(tmp_path / "hub"), "--revision", "../../secret")
    assert fingerprint(argv) is None


def test_a_snapshot_with_its_files_compares_with_a_local_copy_of_them(tmp_path):
    folder = tmp_path / "hub" / "models--Org--Name"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(COMMIT_A)
    snap = folder / "snapshots" / COMMIT_A
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"layers": 32}))
    (folder / "blobs").mkdir()
    (folder / "blobs" / "0123abcd").write_bytes(b"\0" * 64)  # the hub's layout: the snapshot links to its blob
    (snap / "model-00001.safetensors").symlink_to("../../blobs/0123abcd")
    local = model_dir(tmp_path, "copy", {"layers": 32})
    hub = fingerprint(("vllm", "serve", "Org/Name", "--download-dir", str(tmp_path / "hub")))
    assert hub is not None and hub.digest == fingerprint(("vllm", "serve", str(local))).digest
    assert f"snapshot {COMMIT_A[:12]}" in hub.what


def test_fingerprints_of_other_kinds_are_not_compared():
    found = {"a": Weights("dir:1", "x"), "b": Weights("hf:Org/Name@aaaa", "y")}
    assert differing(cfg("m", "m"), found) == []  # a commit alone says nothing of a directory's files


# --- issue 44 item 4(a): `guardian check` judges W3 as the daemon does -----------------------------


def fleet_cfg(*models: str) -> Config:
    from guardian.config import FleetConfig

    return Config(replicas=cfg(*models).replicas, fleet=FleetConfig(endpoints=["http://127.0.0.1:2379"], box="box1"))


def checked(monkeypatch, weights, members=None, error: Exception | None = None):
    """`guardian check`'s fleet part on a fleet read as MEMBERS (or failing with ERROR)."""
    import asyncio

    from guardian.cli import check as cli_check
    from guardian.fleet import sync

    async def read(c):
        if error is not None:
            raise error
        return sync.FleetRead({"boxes": {m.box: {} for m in members}, "slots": []}, tuple(members))

    monkeypatch.setattr(sync, "fleet_read", read)
    report = cli_check.Report(json_out=True)
    asyncio.run(cli_check._check_fleet(fleet_cfg("m", "m"), weights, report))
    return report


HERE = {"a": W["dir:1"], "b": W["dir:1"]}


def test_check_says_w3_when_another_box_serves_the_name_with_other_weights(monkeypatch):
    from guardian.cli.common import Exit

    report = checked(monkeypatch, HERE, [member("box2", "x", "dir:2"), member("box1", "a", "dir:1")])
    (hazard,) = report.of("hazard")
    assert "(W3)" in hazard and "box2/x: dir:2" in hazard and "here a: dir:1; b: dir:1" in hazard
    assert report.exit_code() is Exit.PROBLEM  # counted as W1 is


def test_check_without_a_difference_in_the_fleet_says_what_it_compared(monkeypatch):
    from guardian.cli.common import Exit

    report = checked(monkeypatch, HERE, [member("box2", "x", "dir:1"), member("box3", "y", None)])
    assert report.of("hazard") == [] and report.exit_code() is Exit.OK
    assert any("no other box serves these model names with other weights (1 fingerprint(s)" in t for _, t in report.lines)


def test_check_does_not_judge_w3_on_a_fleet_it_cannot_read(monkeypatch):
    from guardian.fleet.etcd import EtcdError

    report = checked(monkeypatch, HERE, error=EtcdError("etcd did not answer within 2 s"))
    (problem,) = report.of("problem")
    assert "etcd cannot be read" in problem and "(W3) are not judged" in problem
    assert report.of("hazard") == []


def test_check_without_systemd_knows_no_fingerprint_here_and_judges_no_w3(monkeypatch):
    report = checked(monkeypatch, None, [member("box2", "x", "dir:2")])
    assert report.of("hazard") == [] and any("not judged: this box's fingerprints need systemd" in t
                                             for _, t in report.lines)
