"""The one harness of the pure tests. Test modules import what they share from here, never from
one another (tests/test_harness.py checks that).

Reading order:

1. Rule ids: every rule table of the core, and ``checked`` / ``check_rule_ids``, which fail a test
   on a rule id that no table has.
2. Factories: probes, samples, units, observations, configs (``cfg`` and the parts it can be given:
   ``with_memory``, ``with_proxy``, ``with_fleet``), the memory and fleet observations.
3. Reading actions: ``restarts``, ``logs``, ``rules``, ``of`` ...
4. ``Box``: one box on a fake clock, driving the real ``tick.decide``; every rule id it sees is checked.
5. ``run_memguard``, ``run_startguard``: the memory guard's own ``memguard.decide`` and the start
   guard's ``startguard.decide`` on a fake clock, checked the same way.
6. Helpers of the shell-side tests: ``JobDone`` (systemd's bus whose jobs are done at once),
   ``Recorder`` (a journal that keeps its lines), ``returns_within``,
   ``Running`` (the replica simulator in a subprocess).

Only the core's public entry points are driven (``tick.decide``, ``tick.TickState``,
``memguard.decide``, ``startguard.decide``, ``gates.unit_refusal``, ``fleet.slot_refusal``), never its private functions.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import socket
import subprocess
import sys
import threading
from dataclasses import replace
from types import ModuleType

import httpx
import psutil
from systemd_box import wait_for

import guardian.core
from guardian.act.journal import Journal
from guardian.config import Config, FleetConfig, MemoryConfig, ProxyConfig, ReplicaConfig, WatchdogConfig
from guardian.core.memory import memguard, startguard
from guardian.core import tick
from guardian.core.actions import AnswerRequest, LogLine, RestartUnit, SetFraction, StartCanary
from guardian.core.observations import (
    ConnView,
    EnvFile,
    FleetMember,
    FleetView,
    MemoryObservation,
    MemorySample,
    PersistentView,
    Probe,
    ProxyView,
    ReplicaMemoryObservation,
    ReplicaObservation,
    RestartRequest,
    TickObservation,
    UnitInfo,
    UnitWiring,
    VllmSample,
)
from guardian.core.rules import Refusal
from guardian.core.vocab import ActiveState, Decision, HeldBy, LoadState, State, UnitFileState
from guardian.core.memory.memguard import MemoryView, ReplicaMemory
from guardian.observe.metrics import parse_vllm_metrics

# --- 1. rule ids ------------------------------------------------------------------------------------


def rule_modules() -> dict[str, ModuleType]:
    """Every module of guardian.core (its subpackages' too) with a RULES table, by its own name (no
    package's name in it: `liveness` is guardian.core.watchdog.liveness): a new family is found by
    construction."""
    found: dict[str, ModuleType] = {}
    for info in pkgutil.walk_packages(guardian.core.__path__, "guardian.core."):
        module = importlib.import_module(info.name)
        if isinstance(getattr(module, "RULES", None), tuple):
            name = info.name.rpartition(".")[2]
            assert name not in found, f"two rule modules named {name}: {found[name].__name__}, {info.name}"
            found[name] = module
    return found


def rule_tables() -> dict[str, tuple]:
    """Every RULES table, and the tables a module keeps beside it (the canary's rows beside the liveness rows, C1-C5)."""
    found = {name: module.RULES for name, module in rule_modules().items()}
    found["canary"] = importlib.import_module("guardian.core.watchdog.canary").CANARY_RULES
    return found


RULE_TABLES = rule_tables()
KNOWN_RULE_IDS = frozenset(r.id for rows in RULE_TABLES.values() for r in rows)


def family_ids(module_name: str) -> frozenset[str]:
    return frozenset(r.id for r in RULE_TABLES[module_name])


def check_rule_ids(actions: list, tracks: dict | None = None, mem_rule: str | None = None) -> None:
    """Fail on a rule id, in a journal line or behind a verdict, that is in no table; a replica's
    verdict must name a liveness rule (L), the memory guard's a memory rule (M)."""
    for a in actions:
        if isinstance(a, LogLine) and a.rule is not None:
            assert a.rule in KNOWN_RULE_IDS, f"rule {a.rule!r} is in no rule table: {a}"
    for name, track in (tracks or {}).items():
        assert track.rule in family_ids("liveness"), f"replica {name}'s verdict names rule {track.rule!r}, no L rule"
    if mem_rule is not None:
        assert mem_rule in family_ids("memguard"), f"the memory guard's verdict names rule {mem_rule!r}, no M rule"


def checked(refusal: Refusal | None) -> Refusal | None:
    """REFUSAL, once its rule id is found in a table."""
    if refusal is not None:
        assert refusal.rule in KNOWN_RULE_IDS, f"refusal rule {refusal.rule!r} is in no rule table: {refusal}"
    return refusal


# --- 2. factories -----------------------------------------------------------------------------------

GiB = 2**30
TOTAL = 128 * GiB  # the device's memory, as the memory observations here report it

OK = Probe(True, 200, 0.01)
SLOW = Probe(True, 200, 2.5)  # answered, but slower than health_timeout_s = 2
TIMEOUT = Probe(False, None, 2.0, "timeout")
DEAD_503 = Probe(False, 503, 0.01, "HTTP 503")
SLOW_FAIL = Probe(False, None, 2.0, "timeout")  # /health timed out while /metrics still answers

DRAIN_S = 120.0  # with_proxy's drain timeout
BOX = "box1"  # with_fleet's name for this box


# Tests that play another user run a real process as nobody (uid and gid 65534, no groups), with
# the system's python3: the venv's may lie under /root, which nobody cannot enter.
NOBODY_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


def as_nobody() -> None:
    """A subprocess's preexec_fn: drop to user nobody."""
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)


def cfg(n: int = 2, **watchdog) -> Config:
    """N replicas a, b, ... of model m, vllm-X.service at 127.0.0.1:800i; WATCHDOG overrides [watchdog]."""
    reps = [ReplicaConfig(name=x, unit=f"vllm-{x}.service", url=f"http://127.0.0.1:800{i}", model="m",
                          startup_grace_s=1200) for i, x in enumerate("abcd"[:n], start=1)]
    return Config(replicas=reps, watchdog=WatchdogConfig(**watchdog))


def with_memory(c: Config, **memory) -> Config:
    """C with the memory guard on: lower below 8 GiB of headroom at once (sustain 0), critical
    below 3 GiB, 600 s between lowerings, 1 GiB kept in reserve. MEMORY overrides."""
    base = dict(enabled=True, min_headroom_bytes=8 * GiB, critical_headroom_bytes=3 * GiB, sustain_s=0,
                cooldown_s=600, reserve_bytes=GiB)
    return c.model_copy(update={"memory": MemoryConfig(**(base | memory))})


def with_proxy(c: Config) -> Config:
    """C behind a proxy driven by a drain command: drained for at most DRAIN_S, then a 30 s stop."""
    return c.model_copy(
        update={"proxy": ProxyConfig(drain_command=["/bin/true"], drain_timeout_s=DRAIN_S, stop_timeout_s=30)}
    )


def with_fleet(c: Config, **fleet) -> Config:
    """C as box BOX of a fleet on etcd; FLEET overrides [fleet] (max_planned_restarts, min_serving ...)."""
    return c.model_copy(update={"fleet": FleetConfig(endpoints=["http://127.0.0.1:2379"], box=BOX, **fleet)})


def unit(name="vllm-a.service", **kw) -> UnitInfo:
    """A loaded, active, enabled unit with Restart=always; states as systemd spells them."""
    base = dict(name=name, load_state="loaded", active_state="active", unit_file_state="enabled",
                inactive_exit_mono=0.0, main_pid=100, restart="always")
    base.update(kw)
    base["load_state"] = LoadState.parse(base["load_state"])
    base["active_state"] = ActiveState.parse(base["active_state"])
    base["unit_file_state"] = UnitFileState.parse(base["unit_file_state"])
    base["conflicts"] = tuple((n, ActiveState.parse(st)) for n, st in base.get("conflicts", ()))
    return UnitInfo(**base)


def sample(gen=0.0, running=0, waiting=0, kv=0.0, prompt=0.0) -> VllmSample:
    """A /metrics sample: GEN generation tokens so far, RUNNING and WAITING requests."""
    return VllmSample(running=running, waiting=waiting, kv_cache_usage=kv, generation_tokens=gen,
                      prompt_tokens=prompt, iteration_count=gen, iteration_sum=gen + prompt, request_success=0)


def obs(name="a", t=0.0, health=OK, s=None, models=("m",), u=None, canary=None, outcome=None, port=None,
        metrics_down=False) -> ReplicaObservation:
    """What one tick saw of replica NAME at T: serving model m, idle, its unit holding its port, unless
    told otherwise. HEALTH=TIMEOUT: no endpoint answered."""
    s = s if s is not None else sample()
    unit_info = u if u is not None else unit(f"vllm-{name}.service")
    if metrics_down or health is TIMEOUT:
        mprobe, s2 = TIMEOUT, None
    else:
        mprobe, s2 = OK, s
    models_probe, m = (TIMEOUT, None) if health is TIMEOUT else (OK, models)
    owner = port if port is not None else HeldBy(8001, 100, unit_info.name)
    return ReplicaObservation(name=name, at=t, unit=unit_info, health=health, metrics_probe=mprobe, metrics=s2,
                              models_probe=models_probe, models=m, port_owner=owner, canary=canary,
                              restart_outcome=outcome)


def conns(flowing=0, bytes_out=0, waiting=0, oldest_wait_s=0.0, since_s=2.0, cpu_s=None) -> ConnView:
    """The kernel's view of a replica's client connections: FLOWING streams, WAITING clients."""
    return ConnView(connections=flowing + waiting + 1, flowing=flowing, bytes_out=bytes_out, waiting=waiting,
                    since_s=since_s, cpu_s=cpu_s, waits_s=(oldest_wait_s,) * waiting)


def wired(name: str) -> UnitWiring:
    """What a unit wired for the memory guard shows: guardian's env file last, and ExecStart= passing it."""
    env = f"/run/guardian/{name}.env"
    exec_start = ("vllm", "serve", "--gpu-memory-utilization", "${GPU_MEMORY_UTILIZATION}")
    return UnitWiring(f"vllm-{name}.service", (EnvFile(env, "GPU_MEMORY_UTILIZATION=0.78"),), exec_start, env)


def memory(headroom_gib: float, a=0.78, b=0.70, wiring=None, cmdline=None) -> MemoryObservation:
    """The memory guard's observation: HEADROOM_GIB available of TOTAL; replicas a and b at fractions
    A and B (CMDLINE: the fraction a's command line shows; WIRING: why a's unit could not be looked at)."""
    s = MemorySample(TOTAL, int(headroom_gib * GiB), int(headroom_gib * GiB), None, None)
    a_wiring = wired("a") if wiring is None else UnitWiring("vllm-a.service", unseen=wiring)
    return MemoryObservation(s, TOTAL, {
        "a": ReplicaMemoryObservation(a, cmdline, None, a_wiring),
        "b": ReplicaMemoryObservation(b, None, None, wired("b")),
    })


def fleet_view(members=(), slots=(), ok=True, error=None) -> FleetView:
    """What this box (BOX) read from etcd: MEMBERS serving, SLOTS held; ok=False: etcd unreadable."""
    return FleetView(BOX, ok, error, tuple(members), tuple(slots))


def member(box: str, name: str, state="healthy", model="m") -> FleetMember:
    return FleetMember(box, name, model, state)


def request(rid: str = "r1", replica: str = "a", at: float = 0.0, wait_until: float | None = None) -> RestartRequest:
    """An operator's `guardian restart REPLICA`, asked at AT; WAIT_UNTIL: with `--wait` until then."""
    return RestartRequest(rid, replica, at, wait_until)


# --- 3. reading actions -----------------------------------------------------------------------------


def of(actions: list, kind: type) -> list:
    return [a for a in actions if isinstance(a, kind)]


def restarts(actions: list) -> list[RestartUnit]:
    return of(actions, RestartUnit)


def answers(actions: list) -> list[AnswerRequest]:
    return of(actions, AnswerRequest)


def lowerings(actions: list) -> list[SetFraction]:
    return of(actions, SetFraction)


def canaries(actions: list) -> list[StartCanary]:
    return of(actions, StartCanary)


def said(actions: list) -> list[LogLine]:
    """Every journal line among ACTIONS, in order: a RestartUnit's own (written by the restart once
    its re-check passes, issue 34 row 14) at its place."""
    return [x for a in actions for x in ([a] if isinstance(a, LogLine) else [a.said] if isinstance(a, RestartUnit)
                                         and a.said is not None else [])]


def lines(actions: list, priority=None) -> list[LogLine]:
    return [a for a in said(actions) if priority is None or a.priority == priority]


def logs(actions: list, priority=None) -> list[str]:
    """The journal lines' text, at PRIORITY ("error", "warning" ...) or all."""
    return [a.message for a in lines(actions, priority)]


def rules(actions: list, decision: Decision | None = None) -> list[str | None]:
    """The rule id of each journal line (of DECISION, or all), in order."""
    return [a.rule for a in of(actions, LogLine) if decision is None or a.decision is decision]


# --- 4. one box on a fake clock, through the real tick ----------------------------------------------


class Box:
    """One box on a fake clock. Each tick(t) builds the TickObservation the daemon would (every
    configured replica serving, unless an observation for it is given), calls the real
    tick.decide(state, observation, t, cfg) once, keeps the new state and every action, and checks
    every rule id the tick returned against the tables.

    Optional parts, each as the daemon observes it:
    - memory: the memory observation of every tick that is given none (None: the guard sees nothing).
    - proxy: with [proxy] on, each tick carries the proxy's report; unless one is given, the proxy
      applied exactly what the state holds down (TickState.proxy_down). proxy_reports=False: no
      report at all, as when `guardian restart` decides with no daemon running.
    - fleet: the fleet view of every tick that is given none.

    As the executor does, a lowering (SetFraction with new < old) records its replica's base
    fraction in the persistent view the next tick sees.
    """

    def __init__(self, config: Config, persistent: PersistentView | None = None, *,
                 memory: MemoryObservation | None = None, fleet: FleetView | None = None,
                 proxy_reports: bool | None = None) -> None:
        self.cfg = config
        self.core = tick.TickState()
        self.persistent = persistent or PersistentView()
        self.memory = memory
        self.fleet = fleet
        self.proxy_reports = config.proxy.enabled if proxy_reports is None else proxy_reports
        self.observation: TickObservation | None = None  # the last tick's
        self.actions: list = []  # every tick's, in order

    @property
    def tracks(self) -> dict:
        return self.core.tracks

    def state(self, name: str = "a") -> State:
        """Replica NAME's verdict."""
        return self.tracks[name].state

    def rule(self, name: str = "a") -> str:
        """The id of the rule behind replica NAME's verdict."""
        return self.tracks[name].rule

    def tick(self, t: float, *, memory: MemoryObservation | None = None, proxy: ProxyView | None = None,
             fleet: FleetView | None = None, **replicas: ReplicaObservation) -> list:
        """One tick at T; REPLICAS: name -> what was observed of it (its time set to T). The actions."""
        observed = {r.name: replace(replicas.get(r.name) or obs(r.name, t), at=t) for r in self.cfg.replicas}
        if proxy is None and self.proxy_reports:
            proxy = ProxyView(self.core.proxy_down)
        self.observation = TickObservation(
            observed,
            self.persistent,
            memory if memory is not None else self.memory,
            proxy,
            fleet if fleet is not None else self.fleet,
        )
        self.core, actions = tick.decide(self.core, self.observation, t, self.cfg)
        check_rule_ids(actions, self.core.tracks, self.core.mem.rule)
        self.actions += actions
        self._record_bases(actions)
        return actions

    def _record_bases(self, actions: list) -> None:
        """As the executor does: a lowering keeps where it lowered from as its replica's base fraction
        (the state file), which the next tick's persistent view shows."""
        bases = dict(self.persistent.fraction_bases)
        for a in of(actions, SetFraction):
            if a.new < a.old:
                bases[a.replica] = max(bases.get(a.replica, 0.0), a.old)
        if bases != self.persistent.fraction_bases:
            self.persistent = replace(self.persistent, fraction_bases=bases)

    def lines(self, decision: Decision | None = None, rule: str | None = None) -> list[LogLine]:
        """Every journal line so far, of DECISION and RULE if given."""
        return [a for a in said(self.actions)
                if (decision is None or a.decision == decision) and (rule is None or a.rule == rule)]

    def of(self, kind: type) -> list:
        """Every action of KIND so far."""
        return of(self.actions, kind)


# --- 5. the memory guard alone ----------------------------------------------------------------------


def run_memguard(config: Config, steps, track: memguard.MemTrack | None = None):
    """memguard.decide over STEPS, [(now, MemoryView)], from TRACK (a fresh one if None):
    (the last track, every step's actions, the last step's actions). Rule ids are checked."""
    t = track or memguard.MemTrack()
    every, last = [], []
    for now, view in steps:
        t, last = memguard.decide(t, view, now, config)
        check_rule_ids(last, mem_rule=t.rule)
        every += last
    return t, every, last


def run_startguard(config: Config, steps, starts=None):
    """startguard.decide over STEPS, [(now, StartView)], from STARTS (none if None): (the last
    starts, every step's actions). Rule ids are checked."""
    starts = starts or {}
    every = []
    for now, v in steps:
        starts, actions = startguard.decide(starts, v, now, config)
        check_rule_ids(actions)
        every += actions
    return starts, every


# --- 6. helpers of the shell-side tests -------------------------------------------------------------


class JobDone:
    """systemd's bus, as far as a restart needs it (act/units.py): the job is done at once."""

    def __init__(self) -> None:
        self.restarted: list[str] = []

    async def run_job(self, member: str, name: str, timeout_s: float, during=None) -> str:
        if member in ("TryRestartUnit", "RestartUnit"):
            self.restarted.append(name)
        return "done"


class Recorder(Journal):
    """A journal that keeps its lines, (LogLine, extra fields), instead of sending them."""

    def __init__(self) -> None:
        super().__init__(socket_path="/nonexistent")
        self.lines: list[tuple[LogLine, dict[str, str]]] = []

    def line(self, line: LogLine, extra: dict[str, str] | None = None) -> None:
        self.lines.append((line, extra or {}))


def returns_within(bound_s: float, fn, *args, unblock=()):
    """FN(*ARGS)'s result, run in a thread: fails if it has not returned after BOUND_S (an open
    of a FIFO with no writer never returns; a read of /dev/zero never ends). UNBLOCK: FIFOs
    opened for writing and closed afterwards, so that a reader stuck on one ends too."""
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - raised again in the test's thread
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(bound_s)
    blocked = t.is_alive()
    for fifo in unblock:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass  # no reader waits on it
    if blocked:
        t.join(bound_s)
    assert not blocked, f"{getattr(fn, '__name__', fn)} did not return within {bound_s} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """The replica simulator (vllm_sim) serving model m on a free loopback port, in a subprocess."""

    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "vllm_sim", "--port", str(self.port), "--model", "m",
                                      "--tokens-per-s", "50", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)

    def get(self, path: str, timeout: float = 2.0) -> httpx.Response:
        return httpx.get(self.url + path, timeout=timeout)

    def post(self, path: str, body: dict, timeout: float = 5.0) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=timeout)

    def wait_up(self) -> Running:
        def up():
            try:
                return self.get("/health").status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(up, 15, "the simulator to serve")
        return self

    def sample(self) -> VllmSample:
        return parse_vllm_metrics(self.get("/metrics").text)

    def stop(self) -> None:
        if self.proc.poll() is None:
            psutil.Process(self.proc.pid).resume()
            self.proc.kill()
        self.proc.wait(5)


def gone(pids: list[int]) -> bool:
    """None of PIDS runs any more (a zombie left to a non-reaping init counts as gone)."""
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


# --- the memory guard's inputs, for its table tests (test_memguard.py, test_rules_rows.py) ----------------

def memory_cfg(**memory) -> Config:
    """Replicas a and b with the memory guard on as harness.with_memory has it, but a squeeze must
    last 30 s (sustain_s) before it acts. MEMORY overrides."""
    return with_memory(cfg(2), **({"sustain_s": 30} | memory))


def rep(name="a", fraction=0.78, state="healthy", wiring=None, running=None, started_at=0.0, failure=None, model="m"):
    return ReplicaMemory(name=name, unit=f"vllm-{name}.service", model=model, fraction=fraction,
                         running_fraction=running if running is not None else fraction, started_at=started_at,
                         wiring_problem=wiring, state=State(state), start_failure=failure)


def view(headroom_gib: float, *replicas, psi=None, blocked=None, peers=None) -> MemoryView:
    """PEERS: model -> the peer URLs serving it."""
    s = MemorySample(TOTAL, int(headroom_gib * GiB), int(headroom_gib * GiB), psi, None)
    reps = replicas or (rep("a", 0.78), rep("b", 0.70))
    return MemoryView(s, TOTAL, tuple(reps), peers_serving=peers or {}, consumers="db.service 22.1 GiB",
                      restart_blocked=blocked)
