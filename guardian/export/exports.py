"""The exports as one part of the daemon: guardian's metrics (metrics.py), published after every
completed tick to the /metrics endpoint (http.py) and to node_exporter's textfile, and the
replicas' file_sd targets (files.py), written at start and on every reload. A failure is said
once (the textfile: until a write works again), never a reason to stop."""

from __future__ import annotations

import time

from ..act.journal import Journal
from ..config import Config
from ..core.vocab import Priority
from ..observe.clock import Now
from .files import TEXTFILE_NAME, write_file_sd, write_textfile
from .http import MetricsServer
from .metrics import Metrics


class Exports:
    def __init__(self, cfg: Config, journal: Journal, version: str) -> None:
        self.cfg = cfg
        self.journal = journal
        self.metrics = Metrics(version, cfg)  # every configured replica's counters at 0 from the start
        self.server: MetricsServer | None = None
        self.textfile_failed = False  # and said so

    def start(self) -> None:
        """Listen for /metrics and /healthz if configured, and write the file_sd targets."""
        m = self.cfg.metrics
        if m.http:
            host, port = m.host_port
            server = MetricsServer(
                host,
                port,
                stale_after_s=max(10.0, 5 * self.cfg.interval_s),
                on_refused=lambda message: self.journal.send(Priority.WARNING, message),  # on its thread: locked
            )
            try:
                server.start()
            except OSError as e:
                self.journal.send(Priority.ERROR, f"metrics: cannot listen on {m.address}: {e}; no /metrics endpoint")
            else:
                self.server = server
                self.journal.send(Priority.INFO, f"metrics: serving /metrics and /healthz on {m.address}")
        try:
            written = write_file_sd(self.cfg)
        except OSError as e:
            self.journal.send(Priority.ERROR, f"metrics: cannot write the file_sd targets {m.file_sd_path}: {e}")
        else:
            if written is not None:
                self.journal.send(Priority.INFO, f"metrics: wrote the replicas' scrape targets to {written}")

    def reload(self, cfg: Config) -> None:
        """The address, the targets, the textfile's directory or the replicas may have changed: start again."""
        self._stop_server()
        self.cfg = cfg
        self.metrics.configure(cfg)  # replicas added: their counters at 0; replicas removed: theirs gone
        self.start()

    async def stop(self, timeout_s: float) -> int:
        """The endpoint closes at once: nothing of it is waited for."""
        self._stop_server()
        return 0

    def _stop_server(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def tick_done(self, tick_s: float, at: Now) -> None:
        """A tick of TICK_S completed AT: publish the metrics where they are read."""
        self.metrics.tick_done(tick_s, at)
        textfile_dir = self.cfg.metrics.textfile_dir
        if self.server is None and textfile_dir is None:
            return
        body = self.metrics.render()
        if self.server is not None:
            self.server.publish(body, time.monotonic())
        if textfile_dir is None:
            return
        try:
            write_textfile(textfile_dir, body)
            self.textfile_failed = False
        except OSError as e:
            if not self.textfile_failed:
                self.textfile_failed = True
                self.journal.send(Priority.ERROR, f"metrics: cannot write {textfile_dir / TEXTFILE_NAME}: {e}")
