"""`guardian check`: the config validated, the limits and hazards printed, and every replica
probed once, each finding one line (Report), counted in the last line and the exit status."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

from ..act import fit, proxy_check
from ..act.state import STATUS_FILE, CorruptState, StateStore, view
from ..config import Config, ConfigError, ReplicaConfig, config_path, load_config
from ..core import gates, hazards, stopping, thresholds
from ..core import weights as core_weights
from ..core.container import KEEPING_POLICIES, helper_unit, parse_run_line, unit_problems
from ..core.fit import startfit
from ..core.memory.wiring import problem_of
from ..core.observations import FleetMember, Probe, UnitInfo, VllmSample
from ..core.outside import outside_hazards
from ..core.proxy import bypass, drain
from ..core.vocab import ActiveState, HeldBy, Hidden, Nobody, PortOwner
from ..core.weights import Weights
from ..engines.resolve import Told, told
from ..observe import clock, probes, startlook, warmup
from ..observe import weights as observe_weights
from ..observe.addresses import pin_of
from ..observe.containers import CHECK_HELPER_TIMEOUT_S, ContainerWatch
from ..observe.declared import declared_of, read_logind
from ..observe.memory import env_path, service_details, wiring_of
from ..observe.nvml import Nvml
from ..observe.probes import make_client
from ..observe.replicas import UnitView, engine_told, port_owners, unit_or_error
from ..observe.sockets import cgroup_of_pid, unit_of_cgroup
from ..observe.systemd import Systemd, SystemdError
from .common import Exit, one_line
from .engine_lines import engine_line


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
# A finding says its cause in one line: an unforeseen exception's text is cut here (a hostile file
# could make it long), as the daemon's warm-up cuts its own (act/executor.py).
MAX_CAUSE_CHARS = 500


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
    weights: dict[str, Weights | None]  # each replica's fingerprint, for W3 once the fleet is read
    told: dict[str, Told]  # each replica's engine, as its config or its unit's command line tells it


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
        await _check_fleet(cfg, bus.weights if bus is not None else None, report)
    async with make_client() as client:
        for r in cfg.replicas:
            await _check_replica(client, r, bus, report, cfg.memory.enabled)
    _check_connections(cfg, report)
    sd.close()


async def _check_units(cfg: Config, sd: Systemd, report: Report) -> _Bus:
    """Each replica's unit and container, the hazards among the enabled units, and the memory
    guard's wiring."""
    watch = ContainerWatch(sd, helper_timeout_s=CHECK_HELPER_TIMEOUT_S)
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
    declared = {r.name: await declared_of(sd, r) for r in cfg.replicas}
    told = {r.name: engine_told(r, declared[r.name]) for r in cfg.replicas}
    for h in outside_hazards(cfg, declared, await asyncio.to_thread(read_logind)):
        report.problem(h.message, "hazard")
    for text in stopping.warnings(cfg, declared):
        report.problem(text, "warning")
    if cfg.memory.enabled:
        await _check_wiring(cfg, sd, report)
    await _check_fit(cfg, sd, units, report)
    weights = await _check_weights(cfg, sd, units, report)
    return _Bus(sd, watch, units, weights, told)


async def _check_fit(cfg: Config, sd: Systemd, units: dict[str, UnitInfo | None], report: Report) -> None:
    """Each replica's next start as the fit step would judge it now (core/fit/startfit.py)."""
    if not startlook.unified(cfg):
        why = "the GPU's memory is not the box's, or no GPU"
        report.say(f"start fit: not judged on this box ({startfit.NOT_UNIFIED.id}: {why})")
        return
    try:
        status = json.loads((cfg.runtime_dir / STATUS_FILE).read_text())
        left, loops = status.get("not_returned", {}), status.get("start_loops", {})
    except (OSError, ValueError, AttributeError):
        left, loops = {}, {}  # no daemon running, or its status unreadable: nothing it found to repeat
    for _name, text in sorted(loops.items()):
        report.problem(f"{text} (found by the running guardian)", "hazard")
    for name, found in sorted(left.items()):
        report.problem(f"hazard: {startfit.not_returned_text(name, found['bytes'], 'found by the running guardian')}")
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
        problem = problem_of(await wiring_of(sd, cfg, r))
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


async def _check_weights(
    cfg: Config, sd: Systemd, units: dict[str, UnitInfo | None], report: Report
) -> dict[str, Weights | None]:
    """Each replica's weights fingerprint (observe/weights.py), and W1 (core/weights.py); the fingerprints."""
    found = {r.name: await observe_weights.of_replica(sd, r, units.get(r.unit)) for r in cfg.replicas}
    for name, w in found.items():
        if w is None:
            report.say(f"weights: replica {name}: unknown (no model path or hub snapshot guardian can read)")
        else:
            report.say(f"weights: replica {name}: {w.digest} ({w.what})")
    for h in core_weights.differing(cfg, found):
        report.problem(h.message, "hazard")
    return found


def _check_warmup(cfg: Config, report: Report) -> None:
    """Each replica's warm-up file, read as the warm-up reads it (observe/warmup.py)."""
    for r in cfg.replicas:
        if r.warmup_file is None:
            continue
        try:
            found = warmup.load(r.warmup_file)
        except Exception as e:  # noqa: BLE001 - WarmupFileError, or anything unforeseen: a finding, and on to the rest
            cause = str(e) if isinstance(e, warmup.WarmupFileError) else f"{r.warmup_file}: {type(e).__name__}: {e}"
            without = f"it is marked up without a warm-up ({drain.WARMED.id} says why)"
            report.problem(f"warm-up: replica {r.name}: {cause[:MAX_CAUSE_CHARS]}; {without}")
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
    for bad, text in proxy_check.describe(cfg, down):
        if bad:
            report.problem(text)
        else:
            report.say(text)
    for text in proxy_check.retry_warnings(cfg):
        report.problem(text, "warning")


@dataclass(frozen=True)
class _Probed:
    """One replica as `check` probed it."""

    health: Probe
    metrics: VllmSample | None
    metrics_probe: Probe
    models: tuple[str, ...] | None
    models_probe: Probe
    page_not_offered: bool = False  # its engine serves no page as started: said, not a problem


async def _check_replica(
    client: httpx.AsyncClient, r: ReplicaConfig, bus: _Bus | None, report: Report, memory_on: bool
) -> None:
    """One line for the replica: its probes, its model, who holds its port when it does not answer,
    and whether guardian could restart it; a problem, "not serving" (loading, restarting), or neither.
    A proxy suspected in front of it is a warning line of its own."""
    pin = await pin_of(r)  # where its URL leads: the address the daemon's probes and gates use
    if pin.split:
        report.problem(f"replica {r.name} ({r.url}, unit {r.unit}): {pin.split_text(r.unit)}")
    said = bus.told[r.name] if bus is not None else told(r, None, "its unit was not read (no system bus)")
    engine = said.engine
    health = await probes.health_at(client, r.url, r.health_timeout_s, pin.address, engine.health_path)
    mprobe, sample = await probes.probe_metrics(client, r, None, pin.address, engine)
    models_probe, models = await probes.probe_models(client, r, pin.address)
    seen = _Probed(health, sample, mprobe, models, models_probe, not engine.page_offered(mprobe.status))
    report.say(engine_line(r.name, said, mprobe if health.answered else None, memory_on))
    # Without the bus the port's holder is looked up only to say why the replica does not answer.
    owner = await _port_owner(r, bus, pin.address) if bus is not None or not health.answered else None
    unit = bus.units.get(r.unit) if bus is not None else None
    findings, wrong = _replica_findings(r, seen, owner)
    if bus is not None:
        refusal = gates.unit_refusal(unit, owner)
        findings.append(
            f"{r.unit}: " + (f"guardian could NOT restart it: {refusal.text}" if refusal else "restartable")
        )
        asked = bus.watch.reports.get(r.name)
        if isinstance(owner, HeldBy) and owner.container is None and asked is not None and asked.error:
            findings.append(f"the holder's container is not named: {asked.error}")
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
    unread = health.ok and sample is None and not seen.page_not_offered
    wrong = (seen.models is not None and r.model not in seen.models) or unread
    if seen.models is not None and r.model not in seen.models:
        found.append(f"WRONG MODEL: serves {', '.join(seen.models) or 'nothing'}, expected {r.model}")
    elif seen.models is None and health.answered:
        found.append(f"/v1/models {seen.models_probe.error}")
    return found, wrong


async def _port_owner(r: ReplicaConfig, bus: _Bus | None, address: str | None) -> PortOwner:
    """Who listens on the replica's port at ADDRESS (its pin; None: its URL's host): with the bus,
    as the gates see it (containers too); without, what the socket table and /proc tell (an
    unconnected Systemd names no unit: the cgroup does)."""
    sd = bus.sd if bus is not None else Systemd()
    owners = await port_owners(sd, {r.port: address or r.host})
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
                + (' and runtime = "podman"' if run.engine == "podman" else "")
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
            f"does not keep it, and guardian restarts only a kept container ({gates.NOT_KEPT.id}); "
            f"add: docker update --restart unless-stopped {c.name}"
        )


async def _check_fleet(cfg: Config, weights: Mapping[str, Weights | None] | None, report: Report) -> None:
    """The fleet as etcd shows it, in one line; a problem when it cannot be read. Then W3 as the
    daemon judges it (core/weights.py), from the members read and this box's fingerprints (WEIGHTS:
    None when systemd was not asked, so that none is known); never judged on a fleet not read."""
    from ..fleet.etcd import EtcdError
    from ..fleet.sync import box_name, fleet_read

    try:
        fleet = await fleet_read(cfg)
    except (EtcdError, OSError) as e:
        why = str(e)
    except Exception as e:  # noqa: BLE001 - a line and a problem counted, not a traceback
        why = f"{type(e).__name__}: {e}"
    else:
        fv = fleet.status
        report.say(
            f"fleet: {cfg.fleet.name} on etcd answers: {len(fv['boxes'])} box(es), "
            f"{len(fv['slots'])} of {cfg.fleet.max_planned_restarts} slot(s) held; this box is {box_name(cfg)}"
        )
        _check_weights_in_fleet(cfg, weights, fleet.members, box_name(cfg), report)
        return
    report.problem(
        f"fleet: etcd cannot be read ({one_line(why)}); planned restarts would wait; the weights across the fleet "
        f"({core_weights.DIFFER_FLEET.id}) are not judged"
    )


def _check_weights_in_fleet(
    cfg: Config,
    weights: Mapping[str, Weights | None] | None,
    members: tuple[FleetMember, ...],
    box: str,
    report: Report,
) -> None:
    """W3: this box's replicas against the other boxes' of the same model name, as the daemon does."""
    rule = core_weights.DIFFER_FLEET.id
    if weights is None:
        report.say(f"weights across the fleet ({rule}): not judged: this box's fingerprints need systemd")
        return
    found = core_weights.differing_in_fleet(cfg, weights, members, box)
    for h in found:
        report.problem(h.message, "hazard")
    if not found:
        models = {r.model for r in cfg.replicas}
        compared = [m for m in members if m.box != box and m.model in models and m.weights is not None]
        report.say(
            f"weights across the fleet ({rule}): no other box serves these model names with other weights "
            f"({len(compared)} fingerprint(s) of other boxes' replicas of them read)"
        )


def _check_connections(cfg: Config, report: Report) -> None:
    """The kernel's view of each replica's port, once; with a proxy configured, a client connected
    straight to a replica is a warning (B2 needs W.bypass_after_s of it; check shows it now)."""
    from ..core.observations import PeerKind
    from ..core.proxy.bypass import proxy_configured
    from ..observe.conns import ConnObserver

    observer = ConnObserver()
    views = observer.look_now(cfg, time.monotonic())
    if observer.unavailable is not None:
        report.say(f"connections: the kernel's view is not available: {observer.unavailable}")
        return
    if cfg.proxy.enabled and not proxy_configured(cfg):
        report.say(
            "connections: a proxy is driven by drain commands but its address is not known: set "
            f"watchdog.proxy_peers to it so that clients bypassing it can be told from it ({bypass.NO_PROXY.id})"
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
