"""Reading a file back when what is at its name may not be what guardian expects (issue 21): a
FIFO would block the reader for ever (on the event loop: the whole daemon), a link to /dev/zero
would be read without end, a huge file would fill memory.

read_back reads only a regular file, only up to a size, without blocking: the name is stat'ed
first, so a FIFO, socket or device found there is refused without being opened; then it is
opened with O_NONBLOCK (a FIFO swapped in meanwhile opens at once) and O_NOCTTY, and checked
again with fstat on the descriptor it reads. It does not follow a symbolic link unless asked to:
guardian's own files are never links; an operator's files (/etc/nginx, a unit's
EnvironmentFile=) may be links to regular files, as Debian's sites-enabled/* are.

Here, in observe/, because the observers, act/ and the command line all read files back.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class Refused(OSError):
    """What is at the name is not a file guardian reads: a symbolic link not followed (errno
    ELOOP), a socket (ENXIO), another file that is not regular (EINVAL), or a regular file larger
    than the cap (EFBIG). strerror says which, in words; filename is the path."""


def _check(path: Path | str, st: os.stat_result, max_bytes: int) -> None:
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        raise Refused(errno.ELOOP, "a symbolic link (not followed)", str(path))
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a file")
        raise Refused(errno.ENXIO if stat.S_ISSOCK(mode) else errno.EINVAL, f"not a regular file ({kind})", str(path))
    if st.st_size > max_bytes:
        raise Refused(errno.EFBIG, f"larger than {max_bytes} bytes", str(path))


def read_back(path: Path | str, max_bytes: int, *, follow_symlinks: bool = False) -> bytes:
    """PATH's bytes, when it is a regular file of at most MAX_BYTES (and not a symbolic link,
    unless FOLLOW_SYMLINKS). FileNotFoundError when absent; Refused when something else is
    there; another OSError (permissions, I/O) when it cannot be read."""
    _check(path, os.stat(path, follow_symlinks=follow_symlinks), max_bytes)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:  # swapped since the stat: a link (ELOOP under O_NOFOLLOW), a socket (ENXIO)
        if e.errno == errno.ELOOP and not follow_symlinks:
            raise Refused(errno.ELOOP, "a symbolic link (not followed)", str(path)) from None
        if e.errno == errno.ENXIO:
            raise Refused(errno.ENXIO, "not a regular file (a socket)", str(path)) from None
        raise
    try:
        _check(path, os.fstat(fd), max_bytes)
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, min(2**16, max_bytes + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:  # it grew while read
                raise Refused(errno.EFBIG, f"larger than {max_bytes} bytes", str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)
