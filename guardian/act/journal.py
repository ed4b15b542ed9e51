"""Journal lines: one per event, with structured fields, at the priority the core chose.

Speaks journald's native protocol on its socket (no libsystemd needed), so that
``journalctl GUARDIAN_REPLICA=a`` works; falls back to stderr, with the syslog-style ``<N>``
priority prefix that journald understands, when there is no journal socket. On stderr, control
characters are escaped, so text that came from a replica cannot forge a line of its own.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import traceback
from collections.abc import Iterable

from ..core.actions import LogLine
from ..core.vocab import Decision, Priority

JOURNAL_SOCKET = "/run/systemd/journal/socket"
MAX_MESSAGE_CHARS = 8192  # a model id or a parser error from a replica can be any length


def _field(key: str, value: str) -> bytes:
    data = value.encode("utf-8", errors="replace")
    if b"\n" in data:
        return key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
    return key.encode() + b"=" + data + b"\n"


def _escape(text: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _clip(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + " [...]"


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

    def line(self, line: LogLine, extra: dict[str, str] | None = None) -> None:
        fields = {"GUARDIAN_DECISION": line.decision.value}
        for key, value in (
            ("GUARDIAN_REPLICA", line.replica),
            ("GUARDIAN_UNIT", line.unit),
            ("GUARDIAN_STATE", line.state),
            ("GUARDIAN_GATE", line.gate),
            ("GUARDIAN_RULE", line.rule),
            ("GUARDIAN_HAZARD", line.hazard),
        ):
            if value is not None:
                fields[key] = str(value)
        fields.update(extra or {})
        self._send(line.priority, _clip(line.message), fields)

    def send(
        self,
        priority: Priority,
        message: str,
        decision: Decision = Decision.NOTE,
        replica: str | None = None,
        unit: str | None = None,
    ) -> None:
        self.line(LogLine(priority, message, decision, replica, unit))

    def with_traceback(self, priority: Priority, message: str) -> None:
        """MESSAGE, with the traceback of the exception being handled in GUARDIAN_TRACEBACK."""
        self.line(LogLine(priority, message, Decision.NOTE), {"GUARDIAN_TRACEBACK": traceback.format_exc()})

    def send_each(self, priority: Priority, messages: Iterable[str]) -> None:
        for message in messages:
            self.send(priority, message)

    def _send(self, priority: Priority, message: str, fields: dict[str, str]) -> None:
        if self._sock is not None:
            payload = b"".join(
                [
                    _field("MESSAGE", message),
                    _field("PRIORITY", str(priority.syslog)),
                    _field("SYSLOG_IDENTIFIER", self.identifier),
                ]
                + [_field(k, v) for k, v in fields.items()]
            )
            try:
                with self._lock:
                    self._sock.send(payload)
                return
            except OSError:
                pass  # journald restarting or message too big: the line still goes to stderr
        with self._lock:
            print(f"<{priority.syslog}>{_escape(message)}", file=sys.stderr, flush=True)
