"""guardian's command line: the one table of exit statuses (EXIT_STATUS, printed by --help), the
subcommands with their descriptions and arguments, and the durations they take."""

from __future__ import annotations

import argparse
import re
import textwrap
from collections.abc import Callable

from .. import __version__, polkit
from ..config import MAX_WINDOW_S
from .check import cmd_check
from .common import Exit
from .requests import cmd_pause, cmd_restart, cmd_resume
from .service import cmd_container, cmd_polkit_rule, cmd_run
from .status import cmd_status

# The one table of exit statuses: in general ("") and for each subcommand. `guardian --help` and
# `guardian SUB --help` print it; the README says the same, and so does the man page guardian.8, written
# from the README by packaging/manpages.py (tests/test_cli.py and tests/test_manpages.py check them).
EXIT_STATUS: dict[str, dict[Exit, str]] = {
    "": {
        Exit.OK: "ok",
        Exit.PROBLEM: "a problem to fix: the config or a hazard (check), a refusal (restart: any without "
        "--wait; with --wait one that lasts) or a failed restart, no such replica",
        Exit.USAGE: "usage or config error: a bad command line, or the config file is invalid",
        Exit.NOT_SERVING: "not serving right now, nothing to fix: a replica is loading or restarting (check), "
        "guardian is not running or its status is stale (status)",
        Exit.WAITED_OUT: "restart --wait D: what refused it passes by itself and was still there after D; "
        "try again later",
        Exit.INTERRUPTED: "interrupted (Ctrl-C)",
    },
    "run": {Exit.OK: "stopped", Exit.PROBLEM: "cannot start (no system bus)", Exit.USAGE: "the config is invalid"},
    "check": {
        Exit.OK: "no problem found, and every replica serves",
        Exit.PROBLEM: "a problem to fix: each is one line starting problem:, hazard: or warning: (no replicas "
        "configured, a replica unreachable or wrong, a hazard, no system bus without --no-systemd)",
        Exit.USAGE: "the config is invalid (with --json: said in the document)",
        Exit.NOT_SERVING: "no problem found, but a replica is not serving right now: loading or restarting "
        "(a line starting not serving:)",
    },
    "status": {
        Exit.OK: "the daemon runs (--fleet: etcd was read)",
        Exit.PROBLEM: "its status file cannot be read (--fleet: no [fleet], or etcd cannot be read)",
        Exit.NOT_SERVING: "guardian is not running, or its status is stale",
    },
    "pause": {Exit.OK: "paused", Exit.PROBLEM: "no replica of that name", Exit.USAGE: "the config is invalid"},
    "resume": {Exit.OK: "resumed", Exit.PROBLEM: "no replica of that name", Exit.USAGE: "the config is invalid"},
    "restart": {
        Exit.OK: "restarted (or, with dry_run, would have been)",
        Exit.PROBLEM: "refused (without --wait, for any reason; with --wait, for one that lasts), the restart "
        "job failed, no answer from the daemon, or no replica of that name",
        Exit.USAGE: "the config is invalid",
        Exit.WAITED_OUT: "--wait D ended, and what refused it (it passes by itself) was still there",
    },
    "polkit-rule": {Exit.OK: "written, or unchanged", Exit.USAGE: "the config is invalid"},
    "container": {Exit.OK: "done", Exit.PROBLEM: "it failed", Exit.USAGE: "not VERB:REPLICA, or the config is invalid"},
}


def exit_epilog(command: str) -> str:
    """COMMAND's exit statuses ("": in general), one per line, for --help."""
    rows = [
        textwrap.fill(text, 88, initial_indent=f"  {int(code):<3} ", subsequent_indent=" " * 6)
        for code, text in EXIT_STATUS[command].items()
    ]
    return "exit status:\n" + "\n".join(rows)


def parse_duration(text: str) -> float:
    """'90', '90s', '15m', '2h', '1d' -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use e.g. 90s, 15m, 2h)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def wait_duration(text: str) -> float:
    """`restart --wait`: 0 (answer at once) up to 30 days."""
    seconds = parse_duration(text)
    if seconds > MAX_WINDOW_S:
        raise argparse.ArgumentTypeError(f"a wait lasts at most 30 days (got {text!r})")
    return seconds


def pause_duration(text: str) -> float:
    """A pause's length: more than 0 and at most 30 days (`guardian resume` ends any pause)."""
    seconds = parse_duration(text)
    if not 0 < seconds <= MAX_WINDOW_S:
        raise argparse.ArgumentTypeError(
            f"a pause lasts more than 0 s and at most 30 days (got {text!r}); leave --for out to pause until resumed"
        )
    return seconds


def _described(text: str) -> str:
    """A description or epilog paragraph, wrapped as argparse would (the formatter keeps line breaks)."""
    return "\n".join(textwrap.fill(part, 88) for part in text.split("\n"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="guardian",
        description="Keeps local vLLM replicas serving.",
        epilog=exit_epilog("") + "\n`guardian COMMAND --help` says what each status means for that command.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"guardian {__version__}")
    p.add_argument("--config", help="config file (default: $GUARDIAN_CONFIG or /etc/guardian/guardian.toml)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (short, long) in COMMANDS.items():
        sp = sub.add_parser(
            name,
            help=short,
            description=_described(long),
            epilog=exit_epilog(name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sp.add_argument("--config", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        sp.set_defaults(func=_HANDLERS[name])
    _arguments(sub.choices)
    return p


def _arguments(commands: dict[str, argparse.ArgumentParser]) -> None:
    """Each subcommand's own arguments."""
    c = commands["check"]
    c.add_argument("--no-systemd", action="store_true", help="skip the systemd checks (no system bus here)")
    c.add_argument("--json", action="store_true", help=f"one JSON document on stdout: {CHECK_JSON}")
    s = commands["status"]
    s.add_argument("--json", action="store_true", help="the daemon's status.json, with age_s and stale")
    s.add_argument("--fleet", action="store_true", help="the fleet view from etcd: boxes, replicas, slots and holders")
    pa = commands["pause"]
    pa.add_argument("name")
    pa.add_argument("--for", dest="for_", type=pause_duration, default=None, help="e.g. 30m; default: until resumed")
    commands["resume"].add_argument("name")
    rs = commands["restart"]
    rs.add_argument("name")
    rs.add_argument(
        "--wait",
        type=wait_duration,
        default=None,
        metavar="D",
        help="wait up to D (300, 90s, 5m) through refusals that pass by themselves (one restart at a time, "
        "back-off, a systemd job pending, a fleet slot, under a proxy no other replica of the model serving "
        "yet), printing what it waits for; default: answer at once",
    )
    rs.add_argument(
        "--no-drain",
        action="store_true",
        help="under a proxy, restart at once without marking it down first: its clients see errors until it "
        "serves again (default: drained first, and only while another replica of the model serves)",
    )
    pk = commands["polkit-rule"]
    pk.add_argument("--output", default=str(polkit.RULE_PATH))
    pk.add_argument("--stdout", action="store_true", help="print the rule instead of writing it")
    commands["container"].add_argument("instance", metavar="VERB:REPLICA")


CHECK_JSON = (
    '{"ok", "exit_code", "problems": [line], "not_serving": [line], "replicas": [{"name", "url", "unit", "port", '
    '"health": {"ok", "status", "error", "latency_s"}, "serving", "starting", "detail"}], "limits": [line], '
    '"lines": [every line of the text output]}'
)

# Each subcommand: (its line in `guardian --help`, its description in `guardian SUB --help`).
COMMANDS: dict[str, tuple[str, str]] = {
    "run": (
        "run the daemon in the foreground",
        "Run the daemon in the foreground: what guardian.service runs. It probes every replica each "
        "interval_s, restarts a hung one through admission and the unit gates, and runs the memory guard.",
    ),
    "check": (
        "validate the config, show the limits, probe every replica once",
        "Validate the config, print the limits in effect (one per line) and the hazards, and probe every "
        "replica once: each replica's line names its URL and unit, what listens on its port when it does not "
        "answer, and whether guardian could restart its unit. Each problem is one line starting with "
        "problem:, hazard: or warning:, and the last line counts them. A replica that is loading or "
        "restarting (its unit activating, or started within its startup grace) is a line starting with "
        "not serving:, which is not a problem.",
    ),
    "status": (
        "what the running daemon sees now",
        "What the running daemon sees now (its status file): each replica's state and evidence, restarts "
        "used, its fraction, the memory headroom; --fleet: the fleet as etcd shows it.",
    ),
    "pause": (
        "stop acting on a replica (survives guardian restarts)",
        "Stop acting on a replica, for a while (--for) or until `guardian resume`; the pause is kept in the "
        "state file, so it survives guardian restarts.",
    ),
    "resume": (
        "act on a paused replica again; also resets its restart budget",
        "End a replica's pause, and start its restart budget afresh.",
    ),
    "restart": (
        "restart a replica's unit through guardian's admission and gates",
        "Ask the running daemon to restart a replica's unit: on its next tick it passes the same admission "
        "as any restart (budget, back-off, one restart at a time per box, the unit gates), is drained first "
        "under [proxy], and the command prints the answer. A refusal that passes by itself (another replica "
        "loading, back-off, a job pending, a fleet slot) is answered at once, unless --wait D is given: then "
        "the request waits through it for up to D, printing what it waits for, and is refused, after waiting, "
        "only if it is still there (exit status 4). A refusal that lasts (masked, disabled, stopped on "
        "purpose, budget spent, port held by another unit) is answered at once.\n"
        "Without a running daemon this command makes the same decision itself, observing again every "
        "interval_s while it waits (nothing drains it then: said).",
    ),
    "polkit-rule": (
        "write the polkit rule that lets user guardian restart exactly the configured units",
        "Write the polkit rule that lets user guardian restart exactly the configured units (run as root by "
        "guardian.service before every start and reload).",
    ),
    "container": (
        "the root helper for container replicas (run by guardian-container@VERB:REPLICA.service)",
        "The root helper for container replicas, run by guardian-container@VERB:REPLICA.service, which "
        "guardian starts over D-Bus: inspect, kill or restart the configured replica's container.",
    ),
}

_HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": cmd_run,
    "check": cmd_check,
    "status": cmd_status,
    "pause": cmd_pause,
    "resume": cmd_resume,
    "restart": cmd_restart,
    "polkit-rule": cmd_polkit_rule,
    "container": cmd_container,
}
