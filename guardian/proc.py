"""Who listens on a TCP port: psutil's socket table (one /proc scan for all ports)."""

from __future__ import annotations

import psutil


def listeners(ports: set[int]) -> dict[int, int | None] | None:
    """Port -> PID of its listener (None: listening, but the PID is hidden from us).

    Ports nobody listens on are absent. None as a whole: the socket table could not be read.
    """
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return None
    found: dict[int, int | None] = {}
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in ports:
            if found.get(c.laddr.port) is None:
                found[c.laddr.port] = c.pid
    return found


_LISTEN = "0A"


def listening_inodes(ports: set[int]) -> dict[int, int] | None:
    """Port -> inode of its listening socket, from /proc/net/tcp{,6}: cheap, no per-process scan.

    None: neither table could be read.
    """
    found: dict[int, int] = {}
    read_any = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        read_any = True
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            try:
                port = int(fields[1].rsplit(":", 1)[1], 16)
                inode = int(fields[9])
            except (IndexError, ValueError):
                continue
            if port in ports and port not in found:
                found[port] = inode
    return found if read_any else None
