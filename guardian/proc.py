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
