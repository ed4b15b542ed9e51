"""guardian's command line: run, check, status, pause, resume, restart, polkit-rule, container.

Every subcommand exits with one of Exit's statuses, whose meaning for each is the one table
EXIT_STATUS (printed by --help). main() is the `guardian` command; each subcommand is a module of
its own: check.py, status.py, requests.py (pause, resume, restart), service.py (what guardian's
units run); parser.py builds the command line, and common.py holds what they share."""

from __future__ import annotations

import sys

from ..config import ConfigError
from .common import Exit
from .parser import EXIT_STATUS, build_parser

__all__ = ["EXIT_STATUS", "Exit", "build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as e:
        # Under systemd, stderr is the journal; exit 2 is RestartPreventExitStatus= in the unit.
        print(f"guardian: {e}", file=sys.stderr)
        return Exit.USAGE
    except KeyboardInterrupt:
        return Exit.INTERRUPTED
