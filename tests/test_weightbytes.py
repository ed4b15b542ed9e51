"""Weights told apart by their bytes (issue 44 item 1): each weight file's sampled blocks
(observe/weightbytes.py) in the fingerprint (observe/weights.py), read once per change of the file,
bounded whatever its header says; and W1 (core/weights.py) for two replicas whose weights differ in
content only, as a fine-tune differs from its base."""

from __future__ import annotations

import itertools
import json
import os
import random
import struct

import pytest

from guardian.config import Config, ReplicaConfig
from guardian.core.weights import differing
from guardian.observe import weightbytes
from guardian.observe.weightbytes import BLOCK_BYTES, SAMPLES, SampleCache, blocks
from guardian.observe.weights import fingerprint

MiB = 2**20
CONFIG = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def safetensors(path, data: bytes, metadata: str = "base") -> None:
    """A real safetensors file: the u64 header length, its JSON header (padded to 8), the tensor."""
    header = json.dumps(
        {"__metadata__": {"note": metadata}, "w": {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]}}
    ).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def model(tmp_path, name: str, seed: int, size: int = 2 * MiB):
    """A model directory: the same config.json, file names and sizes whatever SEED; tensors from SEED."""
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": SHARDS[0]}}))
    for i, shard in enumerate(SHARDS):
        safetensors(d / shard, random.Random(seed * 10 + i).randbytes(size))
    return d


def fp(d, cache: SampleCache | None = None):
    return fingerprint(("vllm", "serve", str(d)), cache=cache or SampleCache())


def test_a_fine_tune_with_its_bases_config_names_and_sizes_is_told_apart(tmp_path):
    base, copy, tuned = model(tmp_path, "base", 1), model(tmp_path, "copy", 1), model(tmp_path, "tuned", 2)
    assert [p.stat().st_size for p in sorted(base.iterdir())] == [p.stat().st_size for p in sorted(tuned.iterdir())]
    fb, fc, ft = fp(base), fp(copy), fp(tuned)
    assert fb.digest == fc.digest  # identical copies, wherever they are
    assert fb.digest != ft.digest  # every tensor byte changed: another fingerprint
    assert "sampled bytes (17 x 4 KiB each) of 2 weight files" in fb.what


def test_w1_for_two_replicas_of_one_name_whose_weights_differ_in_content_only(tmp_path):
    base, tuned = model(tmp_path, "base", 1), model(tmp_path, "tuned", 2)
    cfg = Config(
        replicas=[
            ReplicaConfig(name=n, unit=f"vllm-{n}.service", url=f"http://127.0.0.1:800{i}", model="m")
            for i, n in enumerate("ab", 1)
        ]
    )
    found = {"a": fp(base), "b": fp(tuned)}
    hazards = differing(cfg, found)
    assert [(h.key, h.rule) for h in hazards] == [("weights-differ:m", "W1")]
    assert found["a"].digest in hazards[0].message and found["b"].digest in hazards[0].message
    assert differing(cfg, {"a": fp(base), "b": fp(model(tmp_path, "again", 1))}) == []


def test_the_samples_are_past_the_safetensors_header(tmp_path):
    data = random.Random(3).randbytes(MiB)
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    safetensors(a, data, metadata="by tool A")  # the same length of header, other text in it
    safetensors(b, data, metadata="by tool B")
    cache = SampleCache()
    assert cache.of_path(str(a), str(tmp_path)) == cache.of_path(str(b), str(tmp_path))
    fd = os.open(a, os.O_RDONLY)
    try:
        start = weightbytes.data_start(fd, "a.safetensors", a.stat().st_size)
    finally:
        os.close(fd)
    assert start == a.stat().st_size - MiB


@pytest.mark.parametrize(
    "start, end, expected",
    [
        (0, 0, []),
        (8, 8 + 100, [(8, 100)]),  # a small region: read whole
        (0, (SAMPLES + 1) * BLOCK_BYTES, [(0, (SAMPLES + 1) * BLOCK_BYTES)]),
    ],
)
def test_a_small_region_is_read_whole(start, end, expected):
    assert blocks(start, end) == expected


@pytest.mark.parametrize("start, end", [(0, 64 * MiB), (1234, 64 * MiB + 77), (8 + 4000, 5 * MiB)])
def test_a_large_region_is_sampled_evenly_with_its_last_block(start, end):
    got = blocks(start, end)
    assert len(got) == SAMPLES + 1 and all(n == BLOCK_BYTES for _, n in got)
    offs = [o for o, _ in got]
    assert offs[0] == start and offs[-1] == end - BLOCK_BYTES and offs == sorted(offs)
    assert all(start <= o and o + BLOCK_BYTES <= end for o in offs)
    assert all(o % BLOCK_BYTES == 0 for o in offs[1:-1])  # one page each, not two
    gaps = [b - a for a, b in itertools.pairwise(offs[:-1])]
    assert max(gaps) - min(gaps) <= BLOCK_BYTES  # evenly spread


def test_a_file_is_read_once_until_its_size_or_time_changes(tmp_path):
    d = model(tmp_path, "m", 1)
    cache = SampleCache()
    first = fp(d, cache)
    assert cache.read.files == 2
    assert fp(d, cache).digest == first.digest and cache.read.files == 2  # kept: nothing read again
    shard = d / SHARDS[0]
    st = shard.stat()
    with open(shard, "r+b") as f:  # the last byte changed in place (always sampled), its time put back
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(b"\xff" if last != b"\xff" else b"\0")
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert fp(d, cache).digest == first.digest and cache.read.files == 2  # the limit: its identity is the same
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    changed = fp(d, cache)
    assert changed.digest != first.digest and cache.read.files == 3  # a new time: read again, that file only
    with open(shard, "ab") as f:
        f.write(b"\0" * 8)
    assert fp(d, cache).digest != changed.digest and cache.read.files == 4  # a new size


def test_the_kept_digests_are_bounded(tmp_path):
    cache = SampleCache(max_kept=2)
    paths = []
    for i in range(3):
        p = tmp_path / f"{i}.bin"
        p.write_bytes(bytes([i]) * 100)
        paths.append(p)
        cache.of_path(str(p), str(tmp_path))
    cache.of_path(str(paths[2]), str(tmp_path))
    assert cache.read.files == 3  # the newest kept
    cache.of_path(str(paths[0]), str(tmp_path))
    assert cache.read.files == 4  # the oldest was dropped


@pytest.mark.parametrize("length", [2**64 - 1, 2**40, 2 * MiB, 100_000_001])
def test_a_garbage_header_length_samples_the_whole_file_with_bounded_reads(tmp_path, monkeypatch, length):
    path = tmp_path / "w.safetensors"
    path.write_bytes(struct.pack("<Q", length) + random.Random(4).randbytes(MiB))
    asked: list[int] = []
    pread = os.pread

    def counted(fd: int, n: int, offset: int) -> bytes:
        asked.append(n)
        return pread(fd, n, offset)

    monkeypatch.setattr(weightbytes.os, "pread", counted)
    cache = SampleCache()
    got = cache.of_path(str(path), str(tmp_path))
    assert got is not None
    assert len(asked) == 1 + SAMPLES + 1 and sum(asked) == 8 + (SAMPLES + 1) * BLOCK_BYTES  # its length, 17 blocks
    monkeypatch.setattr(weightbytes.os, "pread", pread)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert weightbytes.data_start(fd, path.name, path.stat().st_size) == 0  # the whole file sampled
    finally:
        os.close(fd)
    assert fp(tmp_path) is not None  # and the directory's fingerprint too, without an exception


def test_a_short_safetensors_file_and_an_empty_one_are_read(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(b"\1\2\3")
    (tmp_path / "b.safetensors").write_bytes(b"")
    cache = SampleCache()
    assert cache.of_path(str(tmp_path / "a.safetensors"), str(tmp_path)) is not None
    assert cache.of_path(str(tmp_path / "b.safetensors"), str(tmp_path)) is not None
    assert fp(tmp_path) is not None


def test_a_weight_file_linked_from_outside_the_model_path_is_not_read(tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    safetensors(outside, b"secret" * 1000)
    d = model(tmp_path, "m", 1)
    (d / "model-00003.safetensors").symlink_to(outside)
    cache = SampleCache()
    found = fp(d, cache)
    assert cache.read.files == 2 and found.digest.startswith("dirn:") and "1 of them unreadable here" in found.what


def test_a_fifo_named_as_a_weight_file_is_never_opened(tmp_path):
    d = model(tmp_path, "m", 1)
    os.mkfifo(d / "model-00003.safetensors")
    found = fp(d)  # returns at once: opening it would block
    assert found is not None and found.digest.startswith("dirn:") and "1 of them unreadable here" in found.what


def test_bytes_read_on_one_side_only_never_make_a_difference(tmp_path):
    """A replica whose files guardian can read and one with a file it cannot: no W1 (unknown), and
    two that cannot read the same file compare by names and sizes."""
    readable, blocked, blocked_too = model(tmp_path, "a", 1), model(tmp_path, "b", 2), model(tmp_path, "c", 3)
    for d in (blocked, blocked_too):
        os.mkfifo(d / "model-00003.safetensors")
    (readable / "model-00003.safetensors").write_bytes(b"")  # the same name and size, a regular file here
    cfg = Config(
        replicas=[
            ReplicaConfig(name=n, unit=f"vllm-{n}.service", url=f"http://127.0.0.1:800{i}", model="m")
            for i, n in enumerate("abc", 1)
        ]
    )
    found = {"a": fp(readable), "b": fp(blocked), "c": fp(blocked_too)}
    assert found["a"].digest.startswith("dir2:") and found["b"].digest.startswith("dirn:")
    assert differing(cfg, {"a": found["a"], "b": found["b"]}) == []  # bytes on one side only: not compared
    assert found["b"].digest == found["c"].digest  # other bytes, unread: the same names and sizes


def test_a_gguf_file_is_told_apart_past_its_head(tmp_path):
    head = b"GGUF" + b"\0" * (64 * 1024)
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    a.parent.mkdir()
    b.parent.mkdir()
    a.write_bytes(head + random.Random(5).randbytes(4 * MiB))
    b.write_bytes(head + random.Random(6).randbytes(4 * MiB))  # the same head and size, other tensors
    fa, fb = fingerprint(("vllm", "serve", str(a)), cache=SampleCache()), fingerprint(("vllm", "serve", str(b)))
    assert fa.digest.startswith("file2:") and fa.digest != fb.digest


def test_a_change_between_the_samples_is_not_seen(tmp_path):
    """The limit, pinned: a byte that no block covers (a few layers' merge may change only such bytes)."""
    base, merged = model(tmp_path, "base", 1), model(tmp_path, "merged", 1)
    shard = merged / SHARDS[0]
    size = shard.stat().st_size
    fd = os.open(shard, os.O_RDONLY)
    try:
        start = weightbytes.data_start(fd, shard.name, size)
    finally:
        os.close(fd)
    read = blocks(start, size)
    between = read[1][0] + BLOCK_BYTES + 10  # past the second block, before the third
    assert between < read[2][0]
    with open(shard, "r+b") as f:
        f.seek(between)
        flipped = bytes([f.read(1)[0] ^ 0xFF])
        f.seek(between)
        f.write(flipped)
    assert fp(base).digest == fp(merged).digest
