"""guardian's command line: run, check, status, pause, resume, restart."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path

from . import __version__, gates, hazards, thresholds
from .config import Config, ConfigError, config_path, load_config
from .journal import Journal
from .state import STATUS_FILE, CorruptState, StateStore

EXIT_CONFIG = 2


def parse_duration(text: str) -> float:
    """'90', '90s', '15m', '2h', '1d' -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use e.g. 90s, 15m, 2h)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def _load(args) -> Config:
    return load_config(config_path(args.config))


def cmd_run(args) -> int:
    from .daemon import Daemon

    path = config_path(args.config)
    cfg = load_config(path)
    return asyncio.run(Daemon(cfg, path).run())


def cmd_check(args) -> int:
    cfg = _load(args)
    print(f"config {config_path(args.config)}: valid")
    for line in thresholds.describe(cfg):
        print(f"  {line}")
    return asyncio.run(_check_live(cfg, args.no_systemd))


async def _check_live(cfg: Config, no_systemd: bool) -> int:
    from . import probes
    from .observe import port_owners, unit_or_error
    from .probes import make_client
    from .systemd import Systemd, SystemdError

    problems = 0
    sd = Systemd()
    if not no_systemd:
        try:
            await sd.connect()
        except (SystemdError, OSError, asyncio.TimeoutError) as e:
            print(f"problem: cannot talk to systemd over the system bus: {e}")
            return 1
        units = {r.unit: (await unit_or_error(sd, r.unit))[0] for r in cfg.replicas}
        try:
            enabled = await sd.enabled_service_conflicts()
        except SystemdError as e:
            print(f"problem: cannot list enabled unit files: {e}")
            enabled, problems = {}, problems + 1
        found = hazards.find_hazards(cfg, units, enabled)
        for h in found:
            print(f"hazard: {h.message}")
        problems += len(found)
        if cfg.memory.enabled:
            from .nvml import Nvml
            from .wiring import wiring_problem

            print(f"memory guard: {Nvml().note}")
            for r in cfg.replicas:
                try:
                    d = await sd.service_details(r.unit)
                    problem = wiring_problem(r.unit, d.environment_files, d.exec_start, cfg.env_dir / f"{r.name}.env")
                except SystemdError as e:
                    problem = f"cannot ask systemd: {e}"
                if problem:
                    problems += 1
                    print(f"memory guard: replica {r.name}: NOT wired, it will never be restarted to lower its fraction: {problem}")
                else:
                    print(f"memory guard: replica {r.name}: wired ({cfg.env_dir / f'{r.name}.env'})")
    async with make_client() as client:
        for r in cfg.replicas:
            health = await probes.probe_health(client, r)
            mprobe, sample = await probes.probe_metrics(client, r)
            models_probe, models = await probes.probe_models(client, r)
            line = f"replica {r.name} ({r.url}): /health {health.status or health.error} in {health.latency_s:.2f} s"
            if sample is not None:
                line += f"; {sample.running:.0f} running, {sample.waiting:.0f} waiting, {sample.generation_tokens:.0f} tokens so far"
                if sample.gpu_memory_utilization is not None:
                    line += f", gpu_memory_utilization {sample.gpu_memory_utilization:g}"
            else:
                line += f"; /metrics {mprobe.error}"
                problems += 1
            if models is not None and r.model not in models:
                line += f"; WRONG MODEL: serves {', '.join(models) or 'nothing'}, expected {r.model}"
                problems += 1
            elif models is None:
                line += f"; /v1/models {models_probe.error}"
            if not health.ok:
                problems += 1
            if not no_systemd:
                unit = units[r.unit]
                owner = (await port_owners(sd, {r.port}))[r.port]
                refusal = gates.unit_refusal(unit, owner)
                line += f"; {r.unit}: " + (f"guardian could NOT restart it: {refusal.text()}" if refusal else "restartable")
            print(line)
    sd.close()
    print("ok" if problems == 0 else f"{problems} problem(s)")
    return 0 if problems == 0 else 1


def _runtime_dir(args) -> Path:
    try:
        return _load(args).runtime_dir
    except ConfigError:
        return Config.model_fields["runtime_dir"].default


def cmd_status(args) -> int:
    path = _runtime_dir(args) / STATUS_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        print(f"guardian is not running (no {path})", file=sys.stderr)
        return 3
    except (OSError, ValueError) as e:
        print(f"cannot read {path}: {e}", file=sys.stderr)
        return 1
    age = time.time() - data.get("updated_at", 0)
    stale = age > max(30.0, 5 * data.get("interval_s", 2.0))
    if args.json:
        data["age_s"] = age
        data["stale"] = stale
        print(json.dumps(data, indent=1, sort_keys=True))
        return 0 if not stale else 3
    print(f"guardian pid {data['pid']}, updated {age:.1f} s ago{' (STALE: is it running?)' if stale else ''}"
          f"{', DRY-RUN' if data.get('dry_run') else ''}")
    mem = data.get("memory")
    if mem:
        psi = mem.get("psi_some_avg10")
        print(f"memory: {mem['available_bytes'] / 2**30:.1f} GiB available of {mem['total_bytes'] / 2**30:.1f} GiB"
              + (f", PSI some avg10 {psi:.2f}%" if psi is not None else ", PSI not available"))
        if mem.get("guard"):
            below = mem.get("below_min_since")
            line = f"memory guard: on, min headroom {mem['min_headroom_bytes'] / 2**30:.1f} GiB"
            line += f", below it for {time.time() - below:.0f} s" if below else ", not squeezed"
            if mem.get("pending"):
                p = mem["pending"]
                line += f"; lowering {p['replica']} {p['old']:g} -> {p['new']:g} in progress"
            print(line)
        else:
            print("memory guard: off")
    for name, r in data.get("replicas", {}).items():
        extra = " GAVE UP (restart budget spent)" if r.get("gave_up") else ""
        frac = r.get("gpu_memory_utilization")
        frac_text = f"fraction {frac:g}" if frac is not None else "fraction ?"
        print(f"  {name:<12} {r['state']:<13} {r['unit']:<28} {frac_text:<14} restarts {r['restarts_in_window']}/{r['restart_budget']}"
              f"{extra}  {r['evidence']}")
    return 0 if not stale else 3


def _need_replica(cfg: Config, name: str) -> None:
    if cfg.replica(name) is None:
        known = ", ".join(r.name for r in cfg.replicas) or "none"
        raise SystemExit(f"guardian: no replica named {name!r} in the config (known: {known})")


def _update_state(cfg: Config, change) -> None:
    store = StateStore(cfg.state_dir)
    try:
        store.update(change)
    except CorruptState as e:  # the change was applied to fresh defaults and written
        print(f"warning: {e}", file=sys.stderr)


def cmd_pause(args) -> int:
    cfg = _load(args)
    _need_replica(cfg, args.name)
    until = time.time() + args.for_ if args.for_ else None

    def change(d):
        d["pauses"][args.name] = {"until": until, "reason": "operator"}

    _update_state(cfg, change)
    how = f"for {args.for_:g} s" if until else "until `guardian resume`"
    Journal().send("warning", f"replica {args.name}: paused by an operator {how}", args.name, cfg.replica(args.name).unit)
    print(f"replica {args.name} paused {how}")
    return 0


def cmd_resume(args) -> int:
    cfg = _load(args)
    _need_replica(cfg, args.name)

    def change(d):
        d["pauses"].pop(args.name, None)
        d["resumed_at"][args.name] = time.time()

    _update_state(cfg, change)
    Journal().send("warning", f"replica {args.name}: resumed by an operator (restart budget starts afresh)",
                   args.name, cfg.replica(args.name).unit)
    print(f"replica {args.name} resumed")
    return 0


def cmd_restart(args) -> int:
    cfg = _load(args)
    _need_replica(cfg, args.name)
    return asyncio.run(_manual_restart(cfg, args.name))


async def _manual_restart(cfg: Config, name: str) -> int:
    from . import policy
    from .executor import checked_restart
    from .observe import unit_or_error
    from .state import view
    from .systemd import Systemd, SystemdError

    r = cfg.replica(name)
    journal = Journal()
    store = StateStore(cfg.state_dir)
    try:
        pv = view(store.read())
    except CorruptState as e:
        print(f"warning: {e}", file=sys.stderr)
        pv = view(store.update(lambda d: None))
    b = policy.budget(name, pv, time.time(), cfg)
    if b.spent:
        msg = f"replica {name}: manual restart of {r.unit} refused: restart budget spent ({b.used} in {cfg.watchdog.restart_window_s:g} s); `guardian resume {name}` resets it"
        journal.send("error", msg, name, r.unit, {"GUARDIAN_DECISION": "refused", "GUARDIAN_GATE": "budget"})
        print(msg, file=sys.stderr)
        return 1
    sd = Systemd()
    try:
        await sd.connect()
    except (SystemdError, OSError, asyncio.TimeoutError) as e:
        print(f"cannot talk to systemd: {e}", file=sys.stderr)
        return 1
    others = []
    for o in cfg.replicas:
        if o.name != name:
            u, _ = await unit_or_error(sd, o.unit)
            if u is not None and u.active_state in ("activating", "deactivating"):
                others.append(o.name)
    if others:
        msg = f"replica {name}: manual restart of {r.unit} refused: {', '.join(others)} is starting; one restart at a time per box"
        journal.send("error", msg, name, r.unit, {"GUARDIAN_DECISION": "refused", "GUARDIAN_GATE": "one-at-a-time"})
        print(msg, file=sys.stderr)
        return 1
    if cfg.dry_run:
        print(f"DRY-RUN: would restart {r.unit}")
        return 0
    journal.send("warning", f"replica {name}: manual restart of {r.unit} requested by an operator", name, r.unit,
                 {"GUARDIAN_DECISION": "restart"})
    outcome = await checked_restart(sd, store, journal, cfg, r, "requested by an operator")
    sd.close()
    print(f"{r.unit}: {outcome.result}")
    return 0 if outcome.result == "done" else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="guardian", description="Keeps local vLLM replicas serving.")
    p.add_argument("--version", action="version", version=f"guardian {__version__}")
    p.add_argument("--config", help="config file (default: $GUARDIAN_CONFIG or /etc/guardian/guardian.toml)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="run the daemon in the foreground").set_defaults(func=cmd_run)
    c = sub.add_parser("check", help="validate the config, show the limits, probe every replica once")
    c.add_argument("--no-systemd", action="store_true", help="skip the systemd checks (no system bus)")
    c.set_defaults(func=cmd_check)
    s = sub.add_parser("status", help="what the running daemon sees now")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)
    pa = sub.add_parser("pause", help="stop acting on a replica (survives guardian restarts)")
    pa.add_argument("name")
    pa.add_argument("--for", dest="for_", type=parse_duration, default=None, help="e.g. 30m; default: until resumed")
    pa.set_defaults(func=cmd_pause)
    re_ = sub.add_parser("resume", help="act on a paused replica again; also resets its restart budget")
    re_.add_argument("name")
    re_.set_defaults(func=cmd_resume)
    rs = sub.add_parser("restart", help="restart a replica's unit through guardian's gates")
    rs.add_argument("name")
    rs.set_defaults(func=cmd_restart)
    for sp in sub.choices.values():
        sp.add_argument("--config", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        # Under systemd, stderr is the journal; exit 2 is RestartPreventExitStatus= in the unit.
        print(f"guardian: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130
