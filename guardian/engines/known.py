"""The engines guardian knows, by config name, and which one a command line starts."""

from __future__ import annotations

from .base import Engine
from .llamacpp import LLAMACPP
from .sglang import SGLANG
from .trtllm import TRTLLM
from .vllm import VLLM

ENGINES: dict[str, Engine] = {e.name: e for e in (VLLM, LLAMACPP, SGLANG, TRTLLM)}
DEFAULT = VLLM


def named(name: str) -> Engine:
    """The engine a config names; "auto" before detect() has told it is vLLM, the default."""
    return ENGINES.get(name, DEFAULT)


def detect(argv: tuple[str, ...]) -> tuple[Engine, str] | None:
    """The engine ARGV starts (a unit's ExecStart, expanded; a `docker run` line with its image and
    command), and the word that told it; None: no engine's word is on it."""
    for word in argv:
        base = word.rsplit("/", 1)[-1]
        for engine in ENGINES.values():
            for marker in engine.markers:
                if marker in base:
                    return engine, word
    return None
