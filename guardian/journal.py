"""Journal lines: one per event, with structured fields, at the priority the guide asks for.

Speaks journald's native protocol on its socket (no libsystemd needed), so that
``journalctl GUARDIAN_REPLICA=a`` works; falls back to stderr, with the syslog-style
``<N>`` priority prefix that journald understands, when there is no journal socket.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading

JOURNAL_SOCKET = "/run/systemd/journal/socket"
PRIORITY = {"critical": 2, "error": 3, "warning": 4, "notice": 5, "info": 6, "debug": 7}


def _field(key: str, value: str) -> bytes:
    data = value.encode("utf-8", errors="replace")
    if b"\n" in data:
        return key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
    return key.encode() + b"=" + data + b"\n"


class Journal:
    def __init__(self, identifier: str = "guardian", socket_path: str = JOURNAL_SOCKET) -> None:
        self.identifier = identifier
        self.socket_path = socket_path
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        if os.path.exists(socket_path) and os.environ.get("GUARDIAN_LOG_STDERR") != "1":
            try:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.connect(socket_path)
            except OSError:
                self._sock = None

    def send(self, priority: str, message: str, replica: str | None = None, unit: str | None = None,
             fields: tuple[tuple[str, str], ...] | dict = ()) -> None:
        prio = PRIORITY.get(priority, 6)
        items = dict(fields)
        if replica:
            items["GUARDIAN_REPLICA"] = replica
        if unit:
            items["GUARDIAN_UNIT"] = unit
        if self._sock is not None:
            payload = b"".join(
                [_field("MESSAGE", message), _field("PRIORITY", str(prio)),
                 _field("SYSLOG_IDENTIFIER", self.identifier)]
                + [_field(k, str(v)) for k, v in items.items()]
            )
            try:
                with self._lock:
                    self._sock.send(payload)
                return
            except OSError:
                pass  # journald restarting or message too big: the line still goes to stderr
        with self._lock:
            print(f"<{prio}>{message}", file=sys.stderr, flush=True)
