"""What the subcommands share: the exit statuses (Exit), the config named on the command line,
and an error made fit for one line of a terminal."""

from __future__ import annotations

import argparse
from enum import IntEnum

from ..config import Config, config_path, load_config


class Exit(IntEnum):
    """guardian's exit statuses, one meaning each across the subcommands (EXIT_STATUS says what
    each means for each one)."""

    OK = 0
    PROBLEM = 1  # a problem to fix
    USAGE = 2  # a bad command line (argparse's own 2) or an invalid config: RestartPreventExitStatus=2
    NOT_SERVING = 3  # nothing to fix, but not serving right now: a replica loading, guardian not running
    WAITED_OUT = 4  # `restart --wait D`: what refused it passes by itself, and was still there after D
    INTERRUPTED = 130


EXIT_CONFIG = Exit.USAGE

# The daemon's status file, read back bounded by `status` and by `restart` (is a daemon running?):
# status.json is a few KiB per replica.
STATUS_MAX_BYTES = 8 * 2**20


def load(args: argparse.Namespace) -> Config:
    return load_config(config_path(args.config))


def one_line(text: str, max_chars: int = 500) -> str:
    """An error for the terminal: one line of printable text, of bounded length (it may quote etcd)."""
    flat = " ".join("".join(c if c.isprintable() else " " for c in text[: 4 * max_chars]).split())
    return flat if len(flat) <= max_chars else flat[:max_chars] + " [...]"
