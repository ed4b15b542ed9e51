"""The subcommands guardian's units run: `run` (guardian.service), `polkit-rule` (before its every
start and reload) and `container` (guardian-container@VERB:REPLICA.service, the root helper)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from .. import engine_helper, polkit
from ..act.state import atomic_write
from ..config import config_path, load_config
from ..observe.readback import Refused, read_back

POLKIT_RULE_MAX_BYTES = 2**20  # the rule is a few hundred bytes per unit


def cmd_run(args: argparse.Namespace) -> int:
    from ..daemon import Daemon

    path = config_path(args.config)
    cfg = load_config(path)
    return asyncio.run(Daemon(cfg, path).run())


def cmd_container(args: argparse.Namespace) -> int:
    return engine_helper.main(args.instance, config_path(args.config))


def cmd_polkit_rule(args: argparse.Namespace) -> int:
    path = config_path(args.config)
    cfg = load_config(path)  # a broken config leaves the rule in place: the daemon keeps its running config
    text = polkit.render(cfg, str(path))
    if args.stdout:
        sys.stdout.write(text)
        return 0
    out = Path(args.output)
    units = ", ".join(sorted({r.unit for r in cfg.replicas})) or "none"
    try:
        if read_back(out, POLKIT_RULE_MAX_BYTES) == text.encode():
            print(f"guardian: polkit rule {out} unchanged (units: {units})")
            return 0
    except Refused as e:  # a link, a FIFO, a device, a huge file: never read, replaced by the rename
        print(f"guardian: {out} was not read ({e.strerror}): replaced by the rule", file=sys.stderr)
    except OSError:
        pass  # absent or unreadable: written
    atomic_write(out, text.encode(), mode=0o644)
    print(f"guardian: wrote polkit rule {out}: user guardian may {', '.join(polkit.VERBS)} {units}")
    return 0
