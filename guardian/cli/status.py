"""`guardian status`: the running daemon's status file, read back bounded, in lines (or as JSON);
`--fleet`: the fleet as etcd shows it."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..act.state import STATUS_FILE
from ..config import Config, ConfigError
from ..core.fit import startfit
from ..observe.readback import Refused, read_back
from .common import STATUS_MAX_BYTES, Exit, load, one_line


def _runtime_dir(args: argparse.Namespace) -> Path:
    try:
        return load(args).runtime_dir
    except ConfigError:
        return Path(str(Config.model_fields["runtime_dir"].default))


def cmd_status(args: argparse.Namespace) -> int:
    if args.fleet:
        return _fleet_status(args)
    path = _runtime_dir(args) / STATUS_FILE
    try:
        # Not followed, not a FIFO (it would hang a root `guardian status`), not without end.
        data = json.loads(read_back(path, STATUS_MAX_BYTES))
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not guardian's status object")
    except FileNotFoundError:
        print(f"guardian is not running (no {path})", file=sys.stderr)
        return Exit.NOT_SERVING
    except Refused as e:
        print(f"cannot read {path}: {e.strerror}", file=sys.stderr)
        return Exit.PROBLEM
    except (OSError, ValueError) as e:
        print(f"cannot read {path}: {e}".replace("\n", " "), file=sys.stderr)
        return Exit.PROBLEM
    age = time.time() - data.get("updated_at", 0)
    stale = age > max(30.0, 5 * data.get("interval_s", 2.0))
    if args.json:
        data["age_s"] = age
        data["stale"] = stale
        print(json.dumps(data, indent=1, sort_keys=True))
        return Exit.OK if not stale else Exit.NOT_SERVING
    print(
        f"guardian pid {data['pid']}, updated {age:.1f} s ago{' (STALE: is it running?)' if stale else ''}"
        f"{', DRY-RUN' if data.get('dry_run') else ''}"
        f"{', SYSTEM BUS LOST' if data.get('system_bus') == 'LOST' else ''}"
    )
    if data.get("memory"):
        _print_memory(data["memory"])
    _print_hazards(data)
    weights = data.get("weights", {})
    for name, r in data.get("replicas", {}).items():
        extra = " GAVE UP (restart budget spent)" if r.get("gave_up") else ""
        if isinstance(weights.get(name), dict):
            extra += f"  weights {weights[name]['digest']}"
        frac_text = _fraction_text(r.get("gpu_memory_utilization"), r.get("gpu_memory_utilization_base"))
        print(
            f"  {name:<12} {r['state']:<13} {r['unit']:<28} {frac_text:<25} "
            f"restarts {r['restarts_in_window']}/{r['restart_budget']}{extra}  {r['evidence']}"
        )
        conns = r.get("connections")
        if isinstance(conns, dict):
            print(f"  {'':<12} {_connections_line(conns)}")
        procs = r.get("processes")
        if isinstance(procs, dict):
            print(f"  {'':<12} {_processes_line(procs)}")
    return Exit.OK if not stale else Exit.NOT_SERVING


def _print_hazards(data: dict[str, Any]) -> None:
    """The hazards the running daemon found that only its status file holds."""
    for text in data.get("bypassing", []):
        print(f"hazard: {text}")
    for name, left in sorted(data.get("not_returned", {}).items()):
        print(f"hazard: {startfit.not_returned_text(name, left['bytes'])}")
    for text in data.get("weights_differ", []):
        print(f"hazard: {text}")
    for _name, text in sorted(data.get("start_loops", {}).items()):
        print(f"hazard: {text}")


def _print_memory(mem: dict[str, Any]) -> None:
    psi = mem.get("psi_some_avg10")
    print(
        f"memory: {mem['available_bytes'] / 2**30:.1f} GiB available of {mem['total_bytes'] / 2**30:.1f} GiB"
        + (f", PSI some avg10 {psi:.2f}%" if psi is not None else ", PSI not available")
    )
    if not mem.get("guard"):
        print("memory guard: off")
        return
    below = mem.get("below_min_since")
    line = f"memory guard: on, min headroom {mem['min_headroom_bytes'] / 2**30:.1f} GiB"
    line += f", below it for {time.time() - below:.0f} s" if below else ", not squeezed"
    if mem.get("pending"):
        pending = mem["pending"]
        what = "raise" if pending.get("raise") else "lowering"
        waits = ", its restart waiting for admission" if pending.get("restart_waits") else ""
        line += f"; {what} of {pending['replica']} {pending['old']:g} -> {pending['new']:g} in progress{waits}"
    print(line)
    restore = mem.get("restore")
    if isinstance(restore, dict):
        print(_restore_line(restore))


def _restore_line(restore: dict[str, Any]) -> str:
    """Raising fractions back, as `guardian status` prints it."""
    if not restore.get("enabled"):
        return "memory restore: off (a lowered fraction stays lowered)"
    line = f"memory restore: on, after {restore['after_s']:g} s of clear headroom, cooldown {restore['cooldown_s']:g} s"
    since = restore.get("clear_since")
    if since is not None and restore.get("clear_for"):
        line += f"; headroom clear for a raise of {restore['clear_for']} for {time.time() - since:.0f} s"
    for name, ceiling in (restore.get("ceilings") or {}).items():
        line += f"; {name} not raised to {ceiling:g} or above (a raise to it failed to start)"
    return line


def _fraction_text(current: float | None, base: float | None) -> str:
    """A replica's fraction, and its base when guardian has lowered it."""
    text = f"fraction {current:g}" if current is not None else "fraction ?"
    return text + (f" (base {base:g})" if base is not None else "")


def _connections_line(c: dict[str, Any]) -> str:
    """The kernel's view of one replica's port, as `guardian status` prints it."""
    over = f" in {c['over_s']:.1f} s" if c.get("over_s") is not None else ""
    line = f"connections {c['established']}: {c['flowing']} flowing ({c['bytes_out']} bytes{over})"
    line += f", {c['waiting']} waiting" + (f" (longest {c['oldest_wait_s']:.0f} s)" if c["waiting"] else "")
    if c.get("cpu_s") is not None:
        line += f", unit CPU {1000 * c['cpu_s']:.0f} ms{over}"
    peers = ", ".join(f"{p['kind']} {p['name']} x{p['connections']}" for p in c.get("peers", [])[:6])
    partial = " (partial: too many sockets)" if c.get("truncated") else ""
    return line + (f"; peers: {peers}" if peers else "") + partial


def _processes_line(p: dict[str, Any]) -> str:
    """The replica's own processes, as `guardian status` prints them."""

    def group(name: str, g: dict[str, Any] | None) -> str:
        if g is None:
            return f"{name} not known"
        quiet = f", quiet {g['quiet_s']:.0f} s" if g.get("quiet_s") is not None else ""
        running = ", running" if g.get("running") else ""
        return f"{name} x{g['processes']} {1000 * g['used_s']:.0f} ms{running}{quiet}"

    over = f" in {p['over_s']:.1f} s" if p.get("over_s") is not None else ""
    api = "processes" if not p.get("engine_named") else "API server"
    if p.get("engine_whole"):
        engine = "its engine computes in the same process"
    else:
        engine = group("engine", p.get("engine")) if p.get("engine_named") else "engine not told apart"
    return f"processes{over}: {group(api, p.get('api'))}; {engine}"


def _fleet_status(args: argparse.Namespace) -> int:
    from ..fleet.etcd import EtcdError
    from ..fleet.sync import fleet_status

    cfg = load(args)
    if not cfg.fleet.enabled:
        print("no [fleet] in the config: this box decides alone", file=sys.stderr)
        return Exit.PROBLEM
    try:
        data = asyncio.run(fleet_status(cfg))
    except (EtcdError, OSError) as e:
        print(f"guardian: cannot read the fleet from etcd: {one_line(str(e))}", file=sys.stderr)
        return Exit.PROBLEM
    except Exception as e:  # noqa: BLE001 - one line and exit status 1, not a traceback
        print(f"guardian: cannot read the fleet from etcd: {one_line(f'{type(e).__name__}: {e}')}", file=sys.stderr)
        return Exit.PROBLEM
    if args.json:
        print(json.dumps(data, indent=1, sort_keys=True))
        return Exit.OK
    now = time.time()
    print(
        f"fleet {data['fleet']} on {', '.join(data['endpoints'])} (revision {data['revision']}): "
        f"{len(data['boxes'])} box(es); planned restarts {len(data['slots'])} of {data['max_planned_restarts']} "
        f"slot(s) held; min_serving {data['min_serving']}"
    )
    for s in sorted(data["slots"], key=lambda x: str(x.get("slot"))):
        since = s.get("since")
        held = f" for {now - since:.0f} s" if isinstance(since, int | float) else ""
        print(f"  slot {s.get('slot')}: held by {s.get('box')}/{s.get('replica')} ({s.get('model')}){held}")
        if s.get("not_leased"):
            print(f"    not a guardian's lease: {s['not_leased']}; deleting {s.get('key')!r} frees the slot")
    for box in sorted(data["boxes"]):
        for name, r in sorted(data["boxes"][box].items()):
            print(f"  {box + '/' + name:<24} {r.get('state')!s:<13} {r.get('unit')!s:<28} {r.get('model')}")
    for bad in data["ignored"]:
        print(f"  ignored {bad['key']!r}: {bad['why']} (not a guardian's)")
    return Exit.OK
