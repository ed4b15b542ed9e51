"""Files for Prometheus: node_exporter's textfile (guardian.prom) and the replicas' file_sd targets.

Both are written atomically (act/state.atomic_write): a scraper never reads half a file.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from urllib.parse import urlsplit

from ..act.state import atomic_write
from ..config import Config

TEXTFILE_NAME = "guardian.prom"


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
        if path.read_bytes() == data:
            return None
    except OSError:
        pass
    atomic_write(path, data, mode=0o644)
    return path
