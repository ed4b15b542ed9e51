"""A weight file told apart by its bytes (issue 44): a fixed number of small blocks read at fixed
offsets of its data, digested, and kept by the file's identity so that a file is read once per change.

Why: a fine-tune keeps its base's config.json, file names and sizes (measured on real vLLM: a copy
whose every weight was changed got its base's fingerprint); only its tensor bytes differ. Reading a
whole 120 GB model is minutes of I/O at every replica start; SAMPLES + 1 blocks of BLOCK_BYTES a file
is a few hundred small reads for the whole model (bench/fingerprint_cost.py measures it).

What is read of one file (its data region is [start, size)):
- a *.safetensors file past its header: its first 8 bytes are the header's length N (a little-endian
  u64) and the tensors start at 8 + N. A length that runs past the file's end, or over the format's
  own limit (SAFETENSORS_MAX_HEADER_BYTES), is no safetensors header: the whole file is sampled;
- any other weight file (*.gguf, *.bin, *.pt) over the whole file. For GGUF the data's start is known
  only once all of its metadata and tensor infos are parsed (its tokenizer's vocabulary alone is
  megabytes, and that parser would read what the replica names); the metadata is a small share of a
  GGUF file, so the first sample at most falls in it, and a sample there never makes two different
  files look alike (observe/weights.py digests a GGUF's first 64 KiB besides);
- SAMPLES blocks evenly spread over the data region, the first at its start, each at a multiple of
  BLOCK_BYTES where that is past the start (one page, not two), plus the region's last block; a region
  of at most (SAMPLES + 1) x BLOCK_BYTES is read whole. Readahead is turned off for the descriptor
  (POSIX_FADV_RANDOM), so each block costs one BLOCK_BYTES read from storage, not the kernel's window.

What it cannot tell apart: files whose bytes differ only between the samples (a LoRA merged into a few
layers changes a few tensors, which 17 blocks of each file may all miss), and a file changed in place
whose size and modification time were put back (it is not read again: its digest is kept).

The digests are kept by (st_dev, st_ino, st_size, st_mtime_ns), at most MAX_KEPT files, the least
recently used dropped first: a replica's restart on the same files reads nothing, a file replaced
(a new inode) or rewritten (a new size or time) is read again. Files are opened only through
modelfiles.open_regular (never a FIFO or a device; only under the model path's real path).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

from . import modelfiles

BLOCK_BYTES = 4 << 10  # a page: the smallest read storage serves, and what a sample costs
SAMPLES = 16  # evenly spread over the data region, its last block read besides
# The safetensors format refuses a header over 100 MB (safetensors' MAX_HEADER_SIZE); a length past
# it (or past the file's end) is garbage, never a reason to read that far.
SAFETENSORS_MAX_HEADER_BYTES = 100_000_000
SAFETENSORS_LENGTH_BYTES = 8
# Files whose digest is kept: a model is at most a few hundred shards, a box a few models; past it the
# least recently used is read again when next asked for.
MAX_KEPT = 4096

_Identity = tuple[int, int, int, int]  # (st_dev, st_ino, st_size, st_mtime_ns)


def data_start(fd: int, name: str, size_bytes: int) -> int:
    """Where FD's data region starts: past a safetensors header whose length fits the file, else 0."""
    if not name.endswith(".safetensors") or size_bytes < SAFETENSORS_LENGTH_BYTES:
        return 0
    length_bytes = int.from_bytes(os.pread(fd, SAFETENSORS_LENGTH_BYTES, 0), "little")
    start = SAFETENSORS_LENGTH_BYTES + length_bytes
    if length_bytes > SAFETENSORS_MAX_HEADER_BYTES or start >= size_bytes:
        return 0  # no safetensors header: the whole file is sampled (bounded all the same)
    return start


def blocks(start: int, end: int) -> list[tuple[int, int]]:
    """The (offset, length) of each block read of the data region [START, END): SAMPLES evenly
    spread, the first at START, each moved down to a multiple of BLOCK_BYTES where that stays at or
    past START, and the region's last block; the whole region in one read when it is no longer."""
    length = end - start
    if length <= (SAMPLES + 1) * BLOCK_BYTES:
        return [(start, length)] if length > 0 else []
    spread = [start + i * (length - BLOCK_BYTES) // SAMPLES for i in range(SAMPLES)]
    aligned = [max(start, off - off % BLOCK_BYTES) for off in spread]
    return [(off, BLOCK_BYTES) for off in (*aligned, end - BLOCK_BYTES)]


@dataclass
class Read:
    """What reading cost since this cache began: files read (not kept), reads made, bytes asked for."""

    files: int = 0
    reads: int = 0
    bytes: int = 0


class SampleCache:
    """Each weight file's sample digest, kept by its identity (thread-safe: looks run on threads)."""

    def __init__(self, max_kept: int = MAX_KEPT) -> None:
        self.max_kept = max_kept
        self._kept: OrderedDict[_Identity, str] = OrderedDict()
        self._lock = threading.Lock()
        self.read = Read()

    def of_path(self, path: str, within: str) -> str | None:
        """PATH's sample digest (its real path under WITHIN), or None: not a regular file there, or unreadable."""
        fd = modelfiles.open_regular(path, within)
        if fd is None:
            return None
        try:
            return self.of_fd(fd, os.path.basename(path))
        except OSError:
            return None
        finally:
            os.close(fd)

    def of_fd(self, fd: int, name: str) -> str:
        """The sample digest of the regular file open at FD (NAME says its format); OSError if unreadable."""
        st = os.fstat(fd)
        key: _Identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
                return kept
        digest = self._sample(fd, name, st.st_size)
        with self._lock:
            self._kept[key] = digest
            self._kept.move_to_end(key)
            while len(self._kept) > self.max_kept:
                self._kept.popitem(last=False)
        return digest

    def _sample(self, fd: int, name: str, size_bytes: int) -> str:
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # one block read, not a readahead window
        except OSError:
            pass  # a file system without it: the same bytes, read with readahead
        start = data_start(fd, name, size_bytes)
        h = hashlib.sha256(f"{size_bytes}\0{start}\0".encode())
        reads, asked = (1, SAFETENSORS_LENGTH_BYTES) if name.endswith(".safetensors") else (0, 0)
        for off, want in blocks(start, size_bytes):
            block = os.pread(fd, want, off)
            h.update(f"{off}\0{len(block)}\0".encode() + block)
            reads, asked = reads + 1, asked + want
        with self._lock:
            self.read.files += 1
            self.read.reads += reads
            self.read.bytes += asked
        return h.hexdigest()


CACHE = SampleCache()  # the process's own: the daemon reads each file once per change
