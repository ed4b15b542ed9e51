"""What guardian knows of one serving engine (a value; the modules beside this one each give one)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class PageShape:
    """Which series of an engine's Prometheus page guardian reads (guardian/engines/ gives one per
    engine): each summed series and the VllmSample field it fills, those without which the page
    says nothing, the prefill histogram's buckets and the info series whose label is the memory
    fraction (where the engine has them)."""

    summed: Mapping[str, str]
    required: tuple[str, ...]
    prefill_bucket: str | None = None  # each request's prefill time (its longest step)
    fraction_series: str | None = None
    fraction_label: str = ""
    hint: str = ""  # said when a required series is missing: what server the page should be

    @cached_property
    def wanted(self) -> tuple[str, ...]:
        extra = (self.fraction_series, self.prefill_bucket)
        return (*self.summed, "process_start_time_seconds", *(n for n in extra if n is not None))

    @cached_property
    def wanted_names(self) -> frozenset[bytes]:
        return frozenset(n.encode() for n in self.wanted)

    @cached_property
    def wanted_prefixes(self) -> tuple[bytes, ...]:
        return tuple(self.wanted_names)

    @cached_property
    def line_patterns(self) -> tuple[re.Pattern[bytes], re.Pattern[bytes]]:
        """A wanted line: a wanted name, then "{", " " or the line's end (select_lines' split); the
        page's first line, and each line after a newline. One regular expression finds them all in C."""
        line = b"(?:" + b"|".join(re.escape(n) for n in sorted(self.wanted_names)) + rb")(?=[{ \n]|\Z)[^\n]*"
        return re.compile(line), re.compile(rb"\n(" + line + rb")")


@dataclass(frozen=True)
class Knob:
    """The engine's memory knob: the flag the memory guard passes guardian's fraction with, and
    what the fraction is a share of."""

    flag: str  # e.g. --gpu-memory-utilization
    of_total: bool  # True: a share of the device's whole memory (the start fit can size it)
    meaning: str  # one line for `guardian check` and the README


@dataclass(frozen=True)
class Engine:
    name: str  # as `engine` in the config
    label: str  # as people write it
    health_path: str  # answered by the API server alone: it says the server answers, not that it computes
    health_note: str  # what that answer proves, and why this path
    metrics_path: str
    page: PageShape | None  # None: no Prometheus page guardian can read
    metrics_flag: str | None  # what the operator adds for the page; None: always served
    # HTTP statuses of metrics_path that mean "not enabled" (llama-server's 501, a 404 of a missing route)
    not_offered: frozenset[int]
    # The page is answered by the engine's own loop (llama-server queues it to its task loop): a read
    # that times out while /health answers is the engine not answering, and does not hold canaries back.
    metrics_via_engine: bool
    # Its page's running and waiting are refreshed only by its engine's steps, so they may show work
    # after it idles (SGLang): they never prove work in a quiet engine (L19).
    queue_lags: bool
    knob: Knob | None  # None: no fraction to lower (the memory guard never lowers it)
    engine_names: tuple[str, ...]  # comm prefixes of its engine's processes (observe/procs.py)
    engine_titles: tuple[str, ...]  # the same, by setproctitle's title on the command line
    # True: one process computes and serves (llama-server; trtllm-serve on one GPU): the whole
    # replica is its engine as well as its API server.
    single_process: bool
    markers: tuple[str, ...]  # words on a command line or in an image name that tell this engine
    lacks: tuple[str, ...]  # figures its page does not give, each "figure: the rule left out"

    def page_offered(self, status: int | None) -> bool:
        """Whether a read of its page that got STATUS means the page is served (no status: no answer,
        which says nothing of it); a not_offered status means it was not enabled as started."""
        return status not in self.not_offered

    def metrics_hint(self) -> str:
        if self.metrics_flag is None:
            return f"{self.label} serves {self.metrics_path} always"
        return f"start it with {self.metrics_flag} for {self.metrics_path}"
