"""guardian's command line: run, check, status, pause, resume, restart, polkit-rule, container.

Every subcommand exits with one of Exit's statuses, whose meaning for each is the one table
EXIT_STATUS (printed by --help)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import IntEnum
from pathlib import Path
from typing import Any

import httpx
import psutil

from . import __version__, engine_helper, polkit
from .act import fit, proxy
from .act.journal import Journal
from .act.restart import RestartOrder, Tools, checked_restart
from .act.state import STATUS_FILE, CorruptState, StateDoc, StateStore, atomic_write, stamp, view
from .config import MAX_WINDOW_S, Config, ConfigError, ReplicaConfig, config_path, load_config
from .core import gates, hazards, startfit, thresholds, tick
from .core import weights as core_weights
from .core.actions import Action, AnswerRequest, LogLine, RequestWaits, RestartUnit
from .core.container import KEEPING_POLICIES, helper_unit, parse_run_line, unit_problems
from .core.observations import Probe, RestartRequest, TickObservation, UnitInfo, VllmSample
from .core.vocab import ActiveState, Decision, HeldBy, Hidden, Nobody, PortOwner, Priority
from .observe import askers, clock, probes, warmup
from .observe import weights as observe_weights
from .observe.containers import ContainerWatch
from .observe.memory import env_path, service_details, wiring_of
from .observe.nvml import Nvml
from .observe.probes import make_client
from .observe.readback import Refused, read_back
from .observe.replicas import UnitView, WorldObserver, port_owners, unit_or_error
from .observe.sockets import cgroup_of_pid, unit_of_cgroup
from .observe.systemd import Systemd, SystemdError


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

# The one table of exit statuses: in general ("") and for each subcommand. `guardian --help` and
# `guardian SUB --help` print it; the man page (packaging/debian/guardian.1) and the README say the same
# (tests/test_cli.py checks the man page).
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


def _load(args: argparse.Namespace) -> Config:
    return load_config(config_path(args.config))


def cmd_run(args: argparse.Namespace) -> int:
    from .daemon import Daemon

    path = config_path(args.config)
    cfg = load_config(path)
    return asyncio.run(Daemon(cfg, path).run())


def cmd_check(args: argparse.Namespace) -> int:
    path = config_path(args.config)
    report = Report(json_out=args.json)
    try:
        cfg = load_config(path)
    except ConfigError as e:
        if not args.json:
            raise  # main() says it and exits 2
        report.problem(str(e))
        return report.finish(Exit.USAGE)
    report.say(f"config {path}: valid")
    report.limits = thresholds.limits(cfg)
    report.say("limits in effect:")
    for line in report.limits:
        report.say(f"  {line}")
    if not cfg.replicas:
        report.problem(
            f"no replicas configured in {path}: guardian would watch nothing; add a [[replicas]] table "
            "(README: Quick start)"
        )
    asyncio.run(_check_live(cfg, args.no_systemd, report))
    return report.finish()


# The kinds of line `guardian check` prints that are a problem to fix, each counted once.
PROBLEM_KINDS = ("problem", "hazard", "warning")
NOT_SERVING = "not serving"


@dataclass
class Report:
    """What `guardian check` found, one line each: printed as it is found (or gathered into one JSON
    document with --json), so that the count of problems is the count of problem lines."""

    json_out: bool = False
    lines: list[tuple[str, str]] = field(default_factory=list)  # (kind: "" or one of PROBLEM_KINDS ..., text)
    limits: list[str] = field(default_factory=list)
    replicas: list[dict[str, Any]] = field(default_factory=list)

    def _add(self, kind: str, text: str) -> None:
        self.lines.append((kind, text))
        if not self.json_out:
            print(f"{kind}: {text}" if kind else text, flush=True)

    def say(self, text: str) -> None:
        self._add("", text)

    def problem(self, text: str, kind: str = "problem") -> None:
        assert kind in PROBLEM_KINDS, kind
        self._add(kind, text)

    def not_serving(self, text: str) -> None:
        self._add(NOT_SERVING, text)

    def of(self, *kinds: str) -> list[str]:
        return [f"{kind}: {text}" for kind, text in self.lines if kind in kinds]

    def exit_code(self) -> Exit:
        if self.of(*PROBLEM_KINDS):
            return Exit.PROBLEM
        return Exit.NOT_SERVING if self.of(NOT_SERVING) else Exit.OK

    def finish(self, code: Exit | None = None) -> int:
        """The last line (or the JSON document) and the exit status."""
        code = self.exit_code() if code is None else code
        problems, waiting = self.of(*PROBLEM_KINDS), self.of(NOT_SERVING)
        if self.json_out:
            doc = {
                "ok": code is Exit.OK,
                "exit_code": int(code),
                "problems": problems,
                "not_serving": waiting,
                "replicas": self.replicas,
                "limits": self.limits,
                "lines": [f"{kind}: {text}" if kind else text for kind, text in self.lines],
            }
            print(json.dumps(doc, indent=1))
        elif problems:
            print(f"{len(problems)} problem(s): the lines above that start with problem:, hazard: or warning:")
        elif waiting:
            print(f"no problem found; {len(waiting)} replica(s) not serving right now: try again once loaded")
        else:
            print("ok")
        return int(code)


@dataclass
class _Bus:
    """What `check` learned over the system bus, for the per-replica lines."""

    sd: Systemd
    watch: ContainerWatch
    units: dict[str, UnitInfo | None]


NO_BUS_HINT = "(no system bus here? run `guardian check --no-systemd` to check the config and replicas without systemd)"


async def _check_live(cfg: Config, no_systemd: bool, report: Report) -> None:
    sd = Systemd()
    bus = None
    if not no_systemd:
        try:
            await sd.connect()
        except SystemdError as e:
            report.problem(f"cannot talk to systemd over the system bus: {e} {NO_BUS_HINT}")
        else:
            bus = await _check_units(cfg, sd, report)
    _check_proxy(cfg, report)
    _check_warmup(cfg, report)
    if cfg.fleet.enabled:
        await _check_fleet(cfg, report)
    async with make_client() as client:
        for r in cfg.replicas:
            await _check_replica(client, r, bus, report)
    _check_connections(cfg, report)
    sd.close()


async def _check_units(cfg: Config, sd: Systemd, report: Report) -> _Bus:
    """Each replica's unit and container, the hazards among the enabled units, and the memory
    guard's wiring."""
    watch = ContainerWatch(sd)
    units = {
        r.unit: (await watch.unitless_view(r) if r.unitless else await unit_or_error(sd, r.unit))[0]
        for r in cfg.replicas
    }
    for r in cfg.replicas:
        await _check_container(sd, r, watch, report)
    try:
        enabled = await sd.enabled_service_conflicts()
    except SystemdError as e:
        report.problem(f"cannot list enabled unit files: {e}")
        enabled = {}
    for h in hazards.find_hazards(cfg, units, enabled):
        report.problem(h.message, "hazard")
    if cfg.memory.enabled:
        await _check_wiring(cfg, sd, report)
    await _check_fit(cfg, sd, units, report)
    await _check_weights(cfg, sd, units, report)
    return _Bus(sd, watch, units)


async def _check_fit(cfg: Config, sd: Systemd, units: dict[str, UnitInfo | None], report: Report) -> None:
    """Each replica's next start as the fit step would judge it now (core/startfit.py)."""
    if not fit.unified(cfg):
        report.say("start fit: not judged on this box (U1: the GPU's memory is not the box's, or no GPU)")
        return
    try:
        left = json.loads((cfg.runtime_dir / STATUS_FILE).read_text()).get("not_returned", {})
    except (OSError, ValueError):
        left = {}  # no daemon running, or its status unreadable: nothing it found to repeat
    for name, found in sorted(left.items()):
        report.problem(
            f"hazard: replica {name}: {found['bytes'] / 2**30:.1f} GiB its processes held did not come back when they "
            "exited (U8, found by the running guardian): the driver, or a file in /dev/shm, still holds it; a reboot "
            "frees it"
        )
    for r in cfg.replicas:
        details = await service_details(sd, r)
        m = await asyncio.to_thread(fit.measure, cfg, r, units.get(r.unit), details, fit.Start(may_lower=True))
        verdict = startfit.judge(m.fit)
        line = f"start fit: replica {r.name}: {verdict.rule.id} ({verdict.rule.outcome}): {startfit.figures(m.fit)}"
        would = fit.would_release(m, verdict)
        if verdict.fraction is not None:
            report.say(f"{line}; its next start would be lowered to {verdict.fraction:g} and release {would}")
        elif verdict.start:
            report.say(f"{line}; its next start would release {would}")
        else:
            report.problem(f"{line}; its next start would be refused: {startfit.remedy(m.fit)}")


async def _check_wiring(cfg: Config, sd: Systemd, report: Report) -> None:
    report.say(f"memory guard: {Nvml().note}")
    for r in cfg.replicas:
        problem = await wiring_of(sd, cfg, r)
        if problem:
            report.problem(
                f"memory guard: replica {r.name}: NOT wired, it will never be restarted to lower its "
                f"fraction: {problem}"
            )
        else:
            report.say(
                f"memory guard: replica {r.name}: wired ({env_path(cfg, r.name)} is the last "
                "EnvironmentFile= that sets GPU_MEMORY_UTILIZATION)"
            )


async def _check_weights(cfg: Config, sd: Systemd, units: dict[str, UnitInfo | None], report: Report) -> None:
    """Each replica's weights fingerprint (observe/weights.py), and W1 (core/weights.py)."""
    found = {r.name: await observe_weights.of_replica(sd, r, units.get(r.unit)) for r in cfg.replicas}
    for name, w in found.items():
        if w is None:
            report.say(f"weights: replica {name}: unknown (no model path or hub snapshot guardian can read)")
        else:
            report.say(f"weights: replica {name}: {w.digest} ({w.what})")
    for h in core_weights.differing(cfg, found):
        report.problem(h.message, "hazard")


def _check_warmup(cfg: Config, report: Report) -> None:
    """Each replica's warm-up file, read as the warm-up reads it (observe/warmup.py)."""
    for r in cfg.replicas:
        if r.warmup_file is None:
            continue
        try:
            found = warmup.load(r.warmup_file)
        except warmup.WarmupFileError as e:
            report.problem(f"warm-up: replica {r.name}: {e}; it is marked up without a warm-up (D14 says why)")
            continue
        if not cfg.proxy.enabled:
            report.problem(
                f"warm-up: replica {r.name}: {r.warmup_file} is never sent: a warm-up comes before a replica is "
                "marked up at the proxy, and no [proxy] is configured",
                "warning",
            )
            continue
        chats = sum(1 for q in found if q.path.endswith("chat/completions"))
        report.say(
            f"warm-up: replica {r.name}: {len(found)} requests in {r.warmup_file} ({chats} chat), one token each, "
            f"within {r.warmup_timeout_s:g} s, before it is marked up after a restart or a drain"
        )


def _check_proxy(cfg: Config, report: Report) -> None:
    try:
        down = frozenset(view(StateStore(cfg.state_dir).read(), clock.now()).proxy_down)
    except (OSError, CorruptState):
        down = frozenset()  # what the files say is still shown; the diff assumes nothing is marked down
    for bad, text in proxy.describe(cfg, down):
        if bad:
            report.problem(text)
        else:
            report.say(text)
    for text in proxy.retry_warnings(cfg):
        report.problem(text, "warning")


@dataclass(frozen=True)
class _Probed:
    """One replica as `check` probed it."""

    health: Probe
    metrics: VllmSample | None
    metrics_probe: Probe
    models: tuple[str, ...] | None
    models_probe: Probe


async def _check_replica(client: httpx.AsyncClient, r: ReplicaConfig, bus: _Bus | None, report: Report) -> None:
    """One line for the replica: its probes, its model, who holds its port when it does not answer,
    and whether guardian could restart it; a problem, "not serving" (loading, restarting), or neither.
    A proxy suspected in front of it is a warning line of its own."""
    health = await probes.probe_health(client, r)
    mprobe, sample = await probes.probe_metrics(client, r)
    models_probe, models = await probes.probe_models(client, r)
    seen = _Probed(health, sample, mprobe, models, models_probe)
    # Without the bus the port's holder is looked up only to say why the replica does not answer.
    owner = await _port_owner(r, bus) if bus is not None or not health.answered else None
    unit = bus.units.get(r.unit) if bus is not None else None
    findings, wrong = _replica_findings(r, seen, owner)
    if bus is not None:
        refusal = gates.unit_refusal(unit, owner)
        findings.append(
            f"{r.unit}: " + (f"guardian could NOT restart it: {refusal.text}" if refusal else "restartable")
        )
    loading = _starting_now(r, unit, time.monotonic()) if not seen.health.ok else None
    if seen.health.ok and not wrong:
        report.say(f"replica {r.name} ({r.url}): " + "; ".join(findings))
    elif loading is not None and not wrong:
        report.not_serving(f"replica {r.name} ({r.url}, unit {r.unit}): " + "; ".join([*findings, loading]))
    else:
        report.problem(f"replica {r.name} ({r.url}, unit {r.unit}): " + "; ".join(findings))
    report.replicas.append(_replica_doc(r, seen, findings, loading))
    await _check_proxy_suspect(client, r, sample, report)


def _replica_findings(r: ReplicaConfig, seen: _Probed, owner: PortOwner | None) -> tuple[list[str], bool]:
    """What the probes found, in the order of the line, and whether it is a problem even if the
    replica is loading (a wrong model; /metrics unreadable while /health answers)."""
    health = seen.health
    if health.answered:
        found = [f"/health {health.status if health.ok else health.error} in {health.latency_s:.2f} s"]
    else:
        found = [_listener_text(r.port, owner, health.error or "no answer")]
    sample = seen.metrics
    if sample is not None:
        text = (
            f"{sample.running:.0f} running, {sample.waiting:.0f} waiting, {sample.generation_tokens:.0f} tokens so far"
        )
        if sample.gpu_memory_utilization is not None:
            text += f", gpu_memory_utilization {sample.gpu_memory_utilization:g}"
        found.append(text)
    elif health.answered:
        found.append(f"/metrics {seen.metrics_probe.error}")
    wrong = (seen.models is not None and r.model not in seen.models) or (health.ok and sample is None)
    if seen.models is not None and r.model not in seen.models:
        found.append(f"WRONG MODEL: serves {', '.join(seen.models) or 'nothing'}, expected {r.model}")
    elif seen.models is None and health.answered:
        found.append(f"/v1/models {seen.models_probe.error}")
    return found, wrong


async def _port_owner(r: ReplicaConfig, bus: _Bus | None) -> PortOwner:
    """Who listens on the replica's port: with the bus, as the gates see it (containers too); without,
    what the socket table and /proc tell (an unconnected Systemd names no unit: the cgroup does)."""
    sd = bus.sd if bus is not None else Systemd()
    owners = await port_owners(sd, {r.port: r.host})
    if bus is not None:
        owners = await bus.watch.owners([r], owners)
    return owners[r.port]


def _listener_text(port: int, owner: PortOwner | None, error: str) -> str:
    """A replica that does not answer: what listens on its port, in words."""
    if owner is None:
        return f"/health {error}"
    if isinstance(owner, Nobody):
        refused = error == "connection refused" or error.startswith("cannot connect")
        return f"nothing listens on port {port} ({'connection refused' if refused else error})"
    if isinstance(owner, HeldBy):
        pid = f"pid {owner.pid} ({_process_name(owner.pid)})" if owner.pid is not None else "a process"
        unit = owner.unit or (_unit_of_pid(owner.pid) if owner.pid is not None else None)
        where = f"container {owner.container}" if owner.container else f"unit {unit}" if unit else "no unit"
        return f"port {port} is held by {pid} in {where}, which does not answer /health ({error})"
    if isinstance(owner, Hidden):
        return (
            f"something listens on port {port}, but guardian cannot tell which process (run `guardian check` as "
            f"root to see); /health {error}"
        )
    return f"who listens on port {port} cannot be read (the kernel's socket table); /health {error}"


def _process_name(pid: int) -> str:
    try:
        return str(psutil.Process(pid).name())
    except (psutil.Error, OSError):
        return "name unreadable"


def _unit_of_pid(pid: int) -> str | None:
    path = cgroup_of_pid(pid)
    return unit_of_cgroup(path) if path is not None else None


def _starting_now(r: ReplicaConfig, unit: UnitInfo | None, now_mono: float) -> str | None:
    """Why a replica that does not serve is not a problem yet: its unit is on its way up or down, has a
    job pending, or started within its startup grace (a Type=simple vLLM is "active" while it loads);
    None: none of these (or systemd was not asked)."""
    if unit is None:
        return None
    if unit.job_pending or unit.active_state.transitional or unit.active_state is ActiveState.RELOADING:
        return f"{unit.name} is {unit.active_state}" + (" with a job pending" if unit.job_pending else "")
    started = unit.inactive_exit_mono
    if unit.active_state.running and started is not None and now_mono - started < r.startup_grace_s:
        return (
            f"{unit.name} started {now_mono - started:.0f} s ago, within its startup grace of {r.startup_grace_s:g} s"
        )
    return None


def _replica_doc(r: ReplicaConfig, seen: _Probed, findings: list[str], loading: str | None) -> dict[str, Any]:
    """One replica in `check --json`."""
    health = seen.health
    return {
        "name": r.name,
        "url": r.url,
        "unit": r.unit,
        "port": r.port,
        "health": {"ok": health.ok, "status": health.status, "error": health.error, "latency_s": health.latency_s},
        "serving": health.ok and (seen.models is None or r.model in seen.models),
        "starting": loading,
        "detail": "; ".join(findings),
    }


async def _check_proxy_suspect(
    client: httpx.AsyncClient, r: ReplicaConfig, first: VllmSample | None, report: Report
) -> None:
    """A process start time that changes between reads: a load balancer answers for the URL."""
    starts = [first.process_start_time_s if first is not None else None]
    for _ in range(hazards.PROXY_READS - 1):
        _probe, again = await probes.probe_metrics(client, r)
        starts.append(again.process_start_time_s if again is not None else None)
    suspect = hazards.proxy_suspect(r.name, r.url, starts)
    if suspect is not None:
        report.problem(suspect, "warning")


async def _check_container(sd: Systemd, r: ReplicaConfig, watch: ContainerWatch, report: Report) -> None:
    """The replica's container shape in one line, and each thing that keeps it from being restarted
    as a problem with the line to add (core/container.py)."""
    if r.unitless:
        _check_unitless(r, watch, report, await watch.unitless_view(r))
        return
    try:
        lines = await sd.exec_lines(r.unit)
    except SystemdError:
        return  # the unit gates say what is wrong with the unit itself
    run = parse_run_line(lines["ExecStart"][0]) if lines["ExecStart"] else None
    if r.container is None:
        if run is not None:
            report.problem(
                f"replica {r.name}: {r.unit} runs a container (`{run.engine} run --name {run.name}`), but the "
                f"replica names none: guardian would kill only the {run.engine} CLI of a hung replica; "
                f'add: container = "{run.name}"'
                + (' and engine = "podman"' if run.engine == "podman" else "")
                + " to the replica"
            )
        return
    if run is not None:
        shape = (
            f"`{run.engine} run`"
            + (" --network host" if run.host_network else f" -p {', '.join(run.publishes)}" if run.publishes else "")
            + (" --cgroups=split (Quadlet's shape)" if run.cgroups_split else "")
        )
        report.say(f"replica {r.name}: {r.unit} runs container {run.name} with {shape}")
    found = unit_problems(r.unit, r.container, run, lines["ExecStartPre"], lines["ExecStop"] + lines["ExecStopPost"])
    for problem, fix in found:
        report.problem(f"replica {r.name}: {problem}; add: {fix}")


def _check_unitless(r: ReplicaConfig, watch: ContainerWatch, report: Report, seen: UnitView) -> None:
    """A Docker container without a unit: kept by its restart policy, or a problem."""
    assert r.container is not None
    unit, why = seen
    found = watch.reports.get(r.name)
    c = found.by_name(r.container) if found is not None else None
    if why is not None or c is None or unit is None:
        report.problem(f"replica {r.name}: container {r.container}: {why or 'no such container (docker ps -a)'}")
        return
    report.say(
        f"replica {r.name}: Docker container {c.name} without a unit ({c.status}), kept by its restart policy "
        f"{c.restart_policy or 'no'}; guardian restarts it with `docker restart --time 0` through "
        f"{helper_unit('restart', r.name)}"
    )
    if c.restart_policy not in KEEPING_POLICIES:
        report.problem(
            f"replica {r.name}: container {c.name} has restart policy {c.restart_policy or 'no'}: Docker "
            "does not keep it, and guardian restarts only a kept container (G4); "
            f"add: docker update --restart unless-stopped {c.name}"
        )


async def _check_fleet(cfg: Config, report: Report) -> None:
    """The fleet as etcd shows it, in one line; a problem when it cannot be read."""
    from .fleet.etcd import EtcdError
    from .fleet.sync import box_name, fleet_status

    try:
        fv = await fleet_status(cfg)
    except (EtcdError, OSError) as e:
        why = str(e)
    except Exception as e:  # noqa: BLE001 - a line and a problem counted, not a traceback
        why = f"{type(e).__name__}: {e}"
    else:
        report.say(
            f"fleet: {cfg.fleet.name} on etcd answers: {len(fv['boxes'])} box(es), "
            f"{len(fv['slots'])} of {cfg.fleet.max_planned_restarts} slot(s) held; this box is {box_name(cfg)}"
        )
        return
    report.problem(f"fleet: etcd cannot be read ({_one_line(why)}); planned restarts would wait")


def _check_connections(cfg: Config, report: Report) -> None:
    """The kernel's view of each replica's port, once; with a proxy configured, a client connected
    straight to a replica is a warning (B2 needs W.bypass_after_s of it; check shows it now)."""
    from .core.bypass import proxy_configured
    from .core.observations import PeerKind
    from .observe.conns import ConnObserver

    observer = ConnObserver()
    views = observer.look_now(cfg, time.monotonic())
    if observer.unavailable is not None:
        report.say(f"connections: the kernel's view is not available: {observer.unavailable}")
        return
    if cfg.proxy.enabled and not proxy_configured(cfg):
        report.say(
            "connections: a proxy is driven by drain commands but its address is not known: set "
            "watchdog.proxy_peers to it so that clients bypassing it can be told from it (B1)"
        )
    for r in cfg.replicas:
        v = views.get(r.name)
        if v is None:
            continue
        peers = ", ".join(f"{p.kind} {p.name} x{p.connections}" for p in v.peers) or "none"
        report.say(f"replica {r.name}: {v.connections} connection(s) to port {r.port}; peers: {peers}")
        if not proxy_configured(cfg):
            continue
        for p in v.peers:
            if p.kind is PeerKind.OTHER:
                report.problem(
                    f"replica {r.name} ({r.unit}): {p.name} talks to it directly on port {r.port}, "
                    f"not through the proxy ({p.connections} connection(s)); point it at the proxy",
                    "warning",
                )


def _runtime_dir(args: argparse.Namespace) -> Path:
    try:
        return _load(args).runtime_dir
    except ConfigError:
        return Path(str(Config.model_fields["runtime_dir"].default))


# status.json is a few KiB per replica; the rule a few hundred bytes per unit.
STATUS_MAX_BYTES = 8 * 2**20
POLKIT_RULE_MAX_BYTES = 2**20


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
    for text in data.get("bypassing", []):
        print(f"hazard: {text}")
    for name, left in sorted(data.get("not_returned", {}).items()):
        print(
            f"hazard: replica {name}: {left['bytes'] / 2**30:.1f} GiB its processes held did not come back when "
            "they exited (U8): the driver, or a file in /dev/shm, still holds it; a reboot frees it"
        )
    for text in data.get("weights_differ", []):
        print(f"hazard: {text}")
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
    return Exit.OK if not stale else Exit.NOT_SERVING


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


def _need_replica(cfg: Config, name: str) -> None:
    if cfg.replica(name) is None:
        known = ", ".join(r.name for r in cfg.replicas) or "none"
        raise SystemExit(f"guardian: no replica named {name!r} in the config (known: {known})")


def _update_state(cfg: Config, change: Callable[[StateDoc], None]) -> None:
    store = StateStore(cfg.state_dir)
    try:
        store.update(change)
    except CorruptState as e:  # the change was applied to fresh defaults and written
        print(f"warning: {e}", file=sys.stderr)


def _unit_of(cfg: Config, name: str) -> str:
    r = cfg.replica(name)
    return r.unit if r is not None else ""


def _fleet_status(args: argparse.Namespace) -> int:
    from .fleet.etcd import EtcdError
    from .fleet.sync import fleet_status

    cfg = _load(args)
    if not cfg.fleet.enabled:
        print("no [fleet] in the config: this box decides alone", file=sys.stderr)
        return Exit.PROBLEM
    try:
        data = asyncio.run(fleet_status(cfg))
    except (EtcdError, OSError) as e:
        print(f"guardian: cannot read the fleet from etcd: {_one_line(str(e))}", file=sys.stderr)
        return Exit.PROBLEM
    except Exception as e:  # noqa: BLE001 - one line and exit status 1, not a traceback
        print(f"guardian: cannot read the fleet from etcd: {_one_line(f'{type(e).__name__}: {e}')}", file=sys.stderr)
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
    for box in sorted(data["boxes"]):
        for name, r in sorted(data["boxes"][box].items()):
            print(f"  {box + '/' + name:<24} {r.get('state')!s:<13} {r.get('unit')!s:<28} {r.get('model')}")
    for bad in data["ignored"]:
        print(f"  ignored {bad['key']!r}: {bad['why']} (not a guardian's)")
    return Exit.OK


def _one_line(text: str, max_chars: int = 500) -> str:
    """An error for the terminal: one line of printable text, of bounded length (it may quote etcd)."""
    flat = " ".join("".join(c if c.isprintable() else " " for c in text[: 4 * max_chars]).split())
    return flat if len(flat) <= max_chars else flat[:max_chars] + " [...]"


def cmd_pause(args: argparse.Namespace) -> int:
    cfg = _load(args)
    _need_replica(cfg, args.name)
    n = clock.now()
    until = stamp(clock.Now(n.mono + args.for_, n.wall + args.for_)) if args.for_ else None

    def change(d: StateDoc) -> None:
        d["pauses"][args.name] = {"until": until, "reason": "operator", "since": stamp(n)}

    _update_state(cfg, change)
    how = f"for {args.for_:g} s" if until else "until `guardian resume`"
    Journal().send(
        Priority.WARNING,
        f"replica {args.name}: paused by an operator {how}",
        Decision.REQUEST,
        args.name,
        _unit_of(cfg, args.name),
    )
    print(f"replica {args.name} paused {how}")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    cfg = _load(args)
    _need_replica(cfg, args.name)

    def change(d: StateDoc) -> None:
        d["pauses"].pop(args.name, None)
        d["resumed_at"][args.name] = stamp(clock.now())

    _update_state(cfg, change)
    Journal().send(
        Priority.WARNING,
        f"replica {args.name}: resumed by an operator (restart budget starts afresh)",
        Decision.REQUEST,
        args.name,
        _unit_of(cfg, args.name),
    )
    print(f"replica {args.name} resumed")
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    cfg = _load(args)
    _need_replica(cfg, args.name)
    pid = _running_daemon(cfg)
    if pid is not None:
        return _ask_daemon_to_restart(cfg, args.name, pid, args.wait, args.no_drain)
    return asyncio.run(_restart_without_daemon(cfg, args.name, args.wait))


def _running_daemon(cfg: Config) -> int | None:
    """The PID of the daemon that serves this config's state, if it runs and ticks."""
    try:
        # The bounded reader, as `status` reads it: a FIFO or a link to /dev/zero planted at the
        # name would block this command for ever, or fill its memory.
        data = json.loads(read_back(cfg.runtime_dir / STATUS_FILE, STATUS_MAX_BYTES))
        pid = int(data["pid"])
        fresh = time.time() - float(data["updated_at"]) <= max(30.0, 5 * float(data.get("interval_s", 2.0)))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not fresh:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # it runs, as another user
    return pid


def _answer_margin_s(cfg: Config) -> float:
    """How long an admitted restart takes to be answered at most: its job, ten ticks, and its drain."""
    margin_s = cfg.watchdog.restart_job_timeout_s + 10 * cfg.interval_s + 10
    if cfg.proxy.enabled:  # it drains first (README, Under a proxy)
        margin_s += cfg.proxy.drain_timeout_s + cfg.proxy.stop_timeout_s
    return margin_s


def _ask_daemon_to_restart(cfg: Config, name: str, pid: int, wait_s: float | None, no_drain: bool = False) -> int:
    """Record the request for the daemon, which admits it like any restart (core/tick.py), and
    wait for its answer: with WAIT_S, through refusals that pass by themselves (A4) for that long,
    then for as long as an admitted restart takes."""
    rid = uuid.uuid4().hex[:16]
    asked = clock.now()
    waits_s = (wait_s or 0.0) + _answer_margin_s(cfg)
    me = askers.start_ticks(os.getpid())

    def ask(d: StateDoc) -> None:
        request: dict[str, Any] = {"replica": name, "at": stamp(asked)}
        if wait_s:  # --wait 0 is no wait: answered at once
            request["wait_until"] = stamp(clock.Now(asked.mono + wait_s, asked.wall + wait_s))
        if no_drain:
            request["no_drain"] = True
        # When this command stops waiting, and who it is: a request whose command is gone without
        # withdrawing it (SIGKILL) is withdrawn by the daemon, never acted on later (A5)
        request["expires"] = stamp(clock.Now(asked.mono + waits_s, asked.wall + waits_s))
        if me is not None:
            request["asker"] = {"pid": os.getpid(), "start": me}
        d["requests"][rid] = request

    _update_state(cfg, ask)
    what = "drain and restart" if cfg.proxy.enabled and not no_drain else "restart"
    how = f"waiting up to {wait_s:g} s through what passes by itself, then" if wait_s else "waiting"
    print(f"asked the running guardian (pid {pid}) to {what} replica {name}; {how} for its answer", flush=True)
    answer = _await_answer(cfg, rid, time.monotonic() + waits_s)
    if answer is None:
        print(
            f"guardian: no answer from the running daemon within the wait; request withdrawn "
            f"(see journalctl -u guardian GUARDIAN_REPLICA={name})",
            file=sys.stderr,
        )
        return Exit.PROBLEM
    print(answer["message"], file=sys.stdout if answer["ok"] else sys.stderr)
    return Exit.OK if answer["ok"] else Exit.WAITED_OUT if answer.get("waited_out") else Exit.PROBLEM


def _interrupt_on(*signums: signal.Signals) -> dict[signal.Signals, Any]:
    """SIGNUMS raise KeyboardInterrupt (in the main thread; a test's thread keeps them); the
    handlers they had, to put back."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.signal(signum, signal.default_int_handler) for signum in signums}


def _await_answer(cfg: Config, rid: str, deadline_mono: float) -> dict[str, Any] | None:
    """Request RID's answer, once the daemon wrote it (then forgotten); each new thing it waits for
    is printed once as it comes. None: no answer by DEADLINE_MONO (the request is withdrawn) or the
    state file was corrupt (said)."""
    store = StateStore(cfg.state_dir)
    said = None
    # A command ended by SIGTERM or SIGHUP (systemd-run, a closed terminal) withdraws its request
    # as one interrupted does; SIGKILL cannot, and the daemon sees it gone (A5)
    before = _interrupt_on(signal.SIGTERM, signal.SIGHUP)
    try:
        while time.monotonic() < deadline_mono:
            try:
                data = store.read()
            except CorruptState as e:
                print(f"guardian: {e}", file=sys.stderr)
                return None
            answer = data["answers"].get(rid)
            if answer is not None:
                _update_state(cfg, lambda d: d["answers"].pop(rid, None))
                return dict(answer)
            waiting = (data["requests"].get(rid) or {}).get("waiting")
            if waiting and waiting != said:
                print(f"waiting: {waiting}", flush=True)
                said = waiting
            time.sleep(0.2)
    except KeyboardInterrupt:  # a request left open would be acted on long after the operator gave up on it
        _update_state(cfg, lambda d: d["requests"].pop(rid, None))
        print("guardian: interrupted: request withdrawn (a restart already begun goes on)", file=sys.stderr)
        raise
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
    _update_state(cfg, lambda d: d["requests"].pop(rid, None))
    return None


async def _restart_without_daemon(cfg: Config, name: str, wait_s: float | None) -> int:
    """No daemon runs: this command observes and puts the request through the same pure tick itself,
    once, or with WAIT_S every interval_s until it is answered (A4)."""
    if cfg.fleet.enabled:
        print(
            f"guardian: not restarting {name}: with [fleet] a planned restart takes a fleet slot, which only the "
            "running daemon can hold (start guardian.service, or `systemctl restart` the unit yourself)",
            file=sys.stderr,
        )
        return Exit.PROBLEM
    sd = Systemd()
    try:
        await sd.connect()
    except SystemdError as e:
        print(f"guardian: cannot talk to systemd: {e}", file=sys.stderr)
        return Exit.PROBLEM
    if cfg.proxy.enabled:
        print(
            f"warning: guardian is not running, so {name} is restarted without being drained at the proxy",
            file=sys.stderr,
        )
    try:
        async with make_client() as client:
            return await _decide_alone(cfg, WorldObserver(sd, client), name, wait_s)
    finally:
        sd.close()


async def _decide_alone(cfg: Config, observer: WorldObserver, name: str, wait_s: float | None) -> int:
    """The request's ticks, as the daemon would run them, until it is answered or acted on."""
    store = StateStore(cfg.state_dir)
    asked = clock.now()
    until = asked.mono + wait_s if wait_s is not None else None
    request = RestartRequest("cli", name, asked.mono, until)
    state = tick.TickState()
    while True:
        now = clock.now()
        try:
            pv = view(store.read(), now)
        except CorruptState as e:
            print(f"warning: {e}", file=sys.stderr)
            pv = view(store.update(lambda d: None), now)
        observer.invalidate()  # no daemon follows systemd's signals: every look asks afresh
        replicas = await observer.replicas(cfg, now.mono)
        now = clock.now()
        observed = TickObservation(replicas, replace(pv, requests=(request,)))
        state, actions = tick.decide(state, observed, now.mono, cfg)
        code = await _act_alone(cfg, observer.sd, store, name, actions)
        if code is not None:
            return code
        if until is None:
            print(f"guardian: the request for {name} got no answer (a bug)", file=sys.stderr)
            return Exit.PROBLEM
        await asyncio.sleep(cfg.interval_s)


async def _act_alone(cfg: Config, sd: Systemd, store: StateStore, name: str, actions: list[Action]) -> int | None:
    """What the daemon's executor would do with this command's request's actions; the exit status once
    it is answered or restarted, None while it waits."""
    journal = Journal()
    for a in actions:
        if isinstance(a, LogLine) and a.decision in _REQUEST_DECISIONS and a.replica == name:
            journal.line(a)
        elif isinstance(a, RequestWaits) and a.request_id == "cli":
            print(f"waiting: {a.text}", flush=True)
        elif isinstance(a, AnswerRequest) and a.request_id == "cli":
            print(a.message, file=sys.stdout if a.ok else sys.stderr)
            return Exit.OK if a.ok else Exit.WAITED_OUT if a.waited_out else Exit.PROBLEM
        elif isinstance(a, RestartUnit) and a.request_id == "cli":
            r = cfg.replica(a.replica)
            assert r is not None
            order = RestartOrder(r, "requested by an operator", announce=a.said, may_lower=a.may_lower)
            outcome = await checked_restart(Tools(sd, store, journal, cfg), order)
            print(f"{r.unit}: {outcome.result}")
            return Exit.OK if outcome.ok else Exit.PROBLEM
    return None


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


_REQUEST_DECISIONS = frozenset({Decision.REFUSED, Decision.RESTART, Decision.DRY_RUN, Decision.REQUEST})


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
