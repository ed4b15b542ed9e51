"""What the daemon asks of each of its parts, and what the executor asks of the parts it hands
work to.

A Part (the executor, the proxy, the fleet, the exports) is built once with the daemon, reloads
itself when the config is reloaded, and is stopped in order at shutdown: the daemon only
sequences them. What a part does at startup is its own (the exports listen, the proxy takes what
the state file says it was told).

SlotKeeper and Counter are what the executor hands the fleet's slot actions to (fleet/sync.py)
and what it tells of every action it performs (export/metrics.py): they live in layers above
act/, so the executor knows them only by these shapes. So is an Asker: an operator's request
answered where its command waits, when that is not the state file (cli/requests.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from ..config import Config
from ..core.actions import AcquireSlot, Action, AnswerRequest, ReleaseSlot, RequestWaits
from ..core.watchdog.track import Track
from ..observe.clock import Now


class Part(Protocol):
    def reload(self, cfg: Config) -> None:
        """Take the reloaded config; what changes with it is the part's own business."""

    async def stop(self, timeout_s: float) -> int:
        """Finish what is under way, within about TIMEOUT_S; the number of tasks cut short."""


class SlotKeeper(Protocol):
    """The fleet's planned-restart slots: each call starts a task, whose outcome the next fleet
    view shows."""

    def acquire_slot(self, action: AcquireSlot) -> None: ...

    def release_slot(self, action: ReleaseSlot) -> None: ...


class Counter(Protocol):
    def count(self, action: Action, tracks: Mapping[str, Track], at: Now) -> None:
        """Count ACTION, performed AT, decided from the replicas' TRACKS."""


class Asker(Protocol):
    """The command that asked for a restart, told directly: a `guardian restart` that decides alone
    (no daemon running) is the executor's asker. Without one, requests are answered in the state
    file, where the asking command reads its answer."""

    def answer(self, answer: AnswerRequest) -> None: ...

    def waits(self, action: RequestWaits) -> None: ...
