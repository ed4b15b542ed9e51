"""The serving engines guardian knows, one module each: what is read where, and what each reading means.

Each engine module gives one Engine: the paths guardian probes, how its Prometheus page maps onto
the observation the core judges (observe/metrics.PageShape), the figures it lacks, its memory knob,
how its engine processes are told apart from its API server, and the words that tell it on a
command line or in an image name. The core and its rules never learn an engine's name: they see
the observation (a VllmSample with the engine's figures, or none where it offers no page) and a few
plain facts (ReplicaObservation.metrics_offered, metrics_via_engine), and the memory guard sees the
knob's flag as text.

Which engine a replica is: `engine` in its config; "auto" is told by detect() from its unit's
command line (a container's image and command are on it), at start and whenever units change.
"""

from __future__ import annotations

from .base import Engine, Knob, PageShape
from .known import DEFAULT, ENGINES, detect, named

__all__ = ["DEFAULT", "ENGINES", "Engine", "Knob", "PageShape", "detect", "named"]
