"""sd_notify messages to systemd (no-ops when NOTIFY_SOCKET is unset, as in tests and CLI)."""

from __future__ import annotations

import sdnotify


class Notifier:
    def __init__(self) -> None:
        self._n = sdnotify.SystemdNotifier()

    def ready(self, status: str) -> None:
        self._n.notify(f"READY=1\nSTATUS={status}")

    def watchdog(self, status: str) -> None:
        self._n.notify(f"WATCHDOG=1\nSTATUS={status}")

    def reloading(self) -> None:
        self._n.notify("RELOADING=1")

    def reloaded(self, status: str) -> None:
        self._n.notify(f"READY=1\nSTATUS={status}")

    def stopping(self) -> None:
        self._n.notify("STOPPING=1\nSTATUS=stopping")
