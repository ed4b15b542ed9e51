"""What a weights fingerprint costs (issue 44 item 1): observe/weights.py on a model directory of
FILES safetensors shards of GIB GiB each, real bytes on this machine's disk (not sparse), each with
a real header; first read with the files' page cache dropped, then with the pages cached (a fresh
digest cache), then with the digests kept (what the daemon does at a replica's next start).

The page cache of just these files is dropped with posix_fadvise(DONTNEED) after an fsync (clean
pages: all of them go), checked with cachestat/mincore (observe/modelfiles.cached_bytes), so that
nothing else on the box loses its cache. Bytes read are those the fingerprint asked for (its own
count) and those storage served (/proc/self/io read_bytes). The disk's own random 4 KiB read time
is measured too (reads at offsets the fingerprint does not use, cold), since a first read costs
about files x 17 of those: the figure to carry to another disk.

Standalone: PYTHONPATH=TREE python bench/fingerprint_cost.py [--files 4] [--gib 4] [--dir D].
Writes FILES x GIB GiB under D (default /tmp), removes them at the end (--keep to keep them).
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import struct
import sys
import time
from pathlib import Path
from typing import Any

from guardian.observe import modelfiles
from guardian.observe.weightbytes import BLOCK_BYTES, SAMPLES, SampleCache
from guardian.observe.weights import fingerprint

GiB = 2**30
CHUNK_BYTES = 64 * 2**20
TENSORS_PER_FILE = 64  # a shard's header names its tensors: a few KiB of JSON, as a real one


def write_shard(path: Path, size_bytes: int, seed: int) -> None:
    """A safetensors shard of SIZE_BYTES: its header (tensors evenly split), then real bytes."""
    each = (size_bytes - 64 * 2**10) // TENSORS_PER_FILE
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for i in range(TENSORS_PER_FILE):
        header[f"model.layers.{i}.mlp.weight"] = {
            "dtype": "BF16",
            "shape": [each // 2],
            "data_offsets": [i * each, (i + 1) * each],
        }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    data_bytes = each * TENSORS_PER_FILE
    rng = random.Random(seed)
    chunk = rng.randbytes(CHUNK_BYTES)  # written over and over, each time a little changed: real blocks
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        left = data_bytes
        n = 0
        while left > 0:
            piece = chunk[: min(left, CHUNK_BYTES)]
            f.write(n.to_bytes(8, "little") + piece[8:])
            left -= len(piece)
            n += 1
        f.flush()
        os.fsync(f.fileno())


def drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def storage_read_bytes() -> int:
    """What storage served this process so far (/proc/self/io read_bytes)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def timed(top: Path, cache: SampleCache) -> dict[str, Any]:
    asked, served = cache.read.bytes, storage_read_bytes()
    began = time.perf_counter()
    found = fingerprint(("vllm", "serve", str(top)), cache=cache)
    ms = (time.perf_counter() - began) * 1000
    assert found is not None
    return {
        "ms": ms,
        "asked_bytes": cache.read.bytes - asked,
        "storage_bytes": storage_read_bytes() - served,
        "digest": found.digest,
    }


def random_read_ms(paths: list[Path], reads: int) -> float:
    """The median time of one cold 4 KiB read at a random page of PATHS (readahead off)."""
    drop_cache(paths)
    rng = random.Random(7)
    times = []
    for _ in range(reads):
        p = rng.choice(paths)
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            off = rng.randrange(os.fstat(fd).st_size // BLOCK_BYTES) * BLOCK_BYTES
            began = time.perf_counter()
            os.pread(fd, BLOCK_BYTES, off)
            times.append((time.perf_counter() - began) * 1000)
        finally:
            os.close(fd)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    top = Path(args.dir) / "guardian-fingerprint-bench"
    size = int(args.gib * GiB)
    need = args.files * size + GiB
    if shutil.disk_usage(args.dir).free < need:
        print(f"not enough room under {args.dir}: {need / GiB:.1f} GiB wanted", file=sys.stderr)
        return 2
    top.mkdir(parents=True, exist_ok=True)
    shards = [top / f"model-{i + 1:05d}-of-{args.files:05d}.safetensors" for i in range(args.files)]
    try:
        return run(args, top, shards, size)
    finally:
        if not args.keep:
            shutil.rmtree(top, ignore_errors=True)


def run(args: argparse.Namespace, top: Path, shards: list[Path], size: int) -> int:
    began = time.perf_counter()
    (top / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 64}))
    index = {"weight_map": {f"t{i}": s.name for i, s in enumerate(shards)}}
    (top / "model.safetensors.index.json").write_text(json.dumps(index))
    for i, p in enumerate(shards):
        if not (p.exists() and p.stat().st_size >= size - 64 * 2**10):
            write_shard(p, size, i)
    written_s = time.perf_counter() - began
    total = sum(p.stat().st_size for p in shards)
    cold, cached_before = [], []
    for _ in range(args.trials):
        drop_cache(shards)
        cached_before.append(modelfiles.cached_bytes(tuple(map(str, shards))).bytes)
        cold.append(timed(top, SampleCache()))
    warm = [timed(top, SampleCache()) for _ in range(args.trials)]
    cache = SampleCache()
    timed(top, cache)
    kept = [timed(top, cache) for _ in range(args.trials)]
    disk_ms = random_read_ms(shards, 200)
    per_file_reads = SAMPLES + 2  # the header's length, 16 blocks and the last
    out = {
        "files": len(shards),
        "file_bytes": size,
        "model_bytes": total,
        "write_s": round(written_s, 1),
        "cached_before_cold_bytes": max(cached_before),
        "cold_ms": [round(x["ms"], 2) for x in cold],
        "cold_asked_bytes": cold[0]["asked_bytes"],
        "cold_storage_bytes": [x["storage_bytes"] for x in cold],
        "page_cached_ms": [round(x["ms"], 2) for x in warm],
        "kept_ms": [round(x["ms"], 3) for x in kept],
        "kept_asked_bytes": kept[0]["asked_bytes"],
        "disk_random_4k_read_ms": round(disk_ms, 3),
        "reads_per_file": per_file_reads,
        "same_digest": len({x["digest"] for x in cold + warm + kept}) == 1,
    }
    report(out)
    print(json.dumps(out))
    return 0


def report(out: dict[str, Any]) -> None:
    med = statistics.median
    files = out["files"]
    print(f"model: {files} safetensors files of {out['file_bytes'] / GiB:.1f} GiB ({out['model_bytes'] / GiB:.1f} GiB)")
    print(f"page cache of the files before each cold read: {out['cached_before_cold_bytes']} bytes")
    print(
        f"cold:        median {med(out['cold_ms']):.2f} ms ({out['cold_ms']}); asked {out['cold_asked_bytes']} bytes, "
        f"storage served {out['cold_storage_bytes']} bytes"
    )
    print(f"page cached: median {med(out['page_cached_ms']):.2f} ms ({out['page_cached_ms']})")
    print(f"kept:        median {med(out['kept_ms']):.3f} ms; asked {out['kept_asked_bytes']} bytes")
    per_file_ms = med(out["cold_ms"]) / files
    print(
        f"disk: a cold random 4 KiB read {out['disk_random_4k_read_ms']:.3f} ms (median of 200); cold per file "
        f"{per_file_ms:.2f} ms for {out['reads_per_file']} reads"
    )
    for shards in (24, 50):
        print(
            f"EXTRAPOLATED, not measured: a 120 GB model in {shards} shards: about {shards * per_file_ms:.0f} ms cold "
            f"on this disk, {shards * out['cold_asked_bytes'] / files / 2**20:.2f} MiB asked for"
        )


if __name__ == "__main__":
    sys.exit(main())
