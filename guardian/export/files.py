"""Files for Prometheus: node_exporter's textfile (guardian.prom) and the replicas' file_sd targets.

Both are written atomically (act/state.atomic_write): a scraper never reads half a file. The
file_sd file is read back (to write it only when it changed) with act/state.read_back: its
directory may be writable by others, and what is planted there (a FIFO, a link to /dev/zero) is
replaced, never read.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from urllib.parse import urlsplit

from ..act.state import atomic_write, read_back
from ..config import Config

TEXTFILE_NAME = "guardian.prom"
# A file_sd file of a thousand replicas is ~300 KiB; anything larger at that path is rewritten unread.
FILE_SD_MAX_BYTES = 2**20


def write_textfile(directory: Path, body: bytes) -> None:
    atomic_write(directory / TEXTFILE_NAME, body, mode=0o644)


def box_name(cfg: Config) -> str:
    return cfg.metrics.box or socket.gethostname()


def file_sd(cfg: Config) -> list[dict[str, object]]:
    """One target group per replica: its own /metrics (never the proxy's), with its labels."""
    groups: list[dict[str, object]] = []
    for r in cfg.replicas:
        u = urlsplit(r.url)
        labels = {
            "replica": r.name,
            "unit": r.unit,
            "model": r.model,
            "box": box_name(cfg),
            "__scheme__": u.scheme,
            "__metrics_path__": u.path.rstrip("/") + "/metrics",
        }
        groups.append({"targets": [u.netloc], "labels": labels})
    return groups


def write_file_sd(cfg: Config) -> Path | None:
    """Write the file_sd JSON if configured and changed; the path written, or None."""
    path = cfg.metrics.file_sd_path
    if path is None:
        return None
    data = (json.dumps(file_sd(cfg), indent=1, sort_keys=True) + "\n").encode()
    try:
        if read_back(path, FILE_SD_MAX_BYTES) == data:
            return None
    except OSError:
        pass  # absent, unreadable, not a regular file, too large: replaced by the rename
    atomic_write(path, data, mode=0o644)
    return path
