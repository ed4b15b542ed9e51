#!/usr/bin/env python3
"""The driver of scripts/differential-fuzz: drives ``guardian.core.tick.decide`` through random scenarios.

Run by scripts/differential-fuzz, once per tree, with PYTHONPATH naming the tree whose ``guardian``
it imports (and PYTHONHASHSEED fixed, so that set orders match). Each seed makes one scenario with
``random.Random(seed)``: a config (replicas, [watchdog], [memory], [proxy], [fleet], dry run) and a
small world on a fake clock (replicas that serve, hang, freeze, die, load, are stopped, masked,
squatted; units, jobs, canaries, warm-ups, the memory of the box, the proxy, etcd, operators'
requests and pauses). Each tick the world is observed into a TickObservation, ``decide`` is called
with the state it returned last, and the actions are performed back into the world as the daemon's
executor would (their results come back in later observations). Only the public types build the
inputs (guardian.config, guardian.core.observations, guardian.core.vocab, guardian.core.actions);
the SHIM section below is the one place that absorbs changes of their fields in the tree under test.

Output, on stdout, one JSON line each: ``{"seed": S}`` when a scenario begins (or with "error" when
its config raises), then one line per tick, ``{"tick": I, "now": T, "actions": [...], "state": {...}}``
(or ``{"tick": I, "error": "Type: message"}`` when decide raises, which ends the scenario), every
value canonical (canon()); the last line is ``{"stats": {...}}``: ticks, actions, rule ids and action
types seen. ``--coverage FILE`` also writes which lines of guardian/core ran (sys.settrace; slow).

    PYTHONPATH=. PYTHONHASHSEED=0 .venv/bin/python scripts/fuzz_driver.py --seeds 5 --ticks 60
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import heapq
import json
import math
import random
import re
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path, PurePath
from typing import Any

import guardian
from guardian import config as gconfig
from guardian.core import observations as ob
from guardian.core import tick
from guardian.core.vocab import ActiveState, HeldBy, Hidden, LoadState, Nobody, UnitFileState, Unreadable

GiB = 2**30
TOTAL = 128 * GiB
BOX = "box1"
OTHER_BOXES = ("box2", "box3")

# ==== SHIM: the one place that absorbs API changes of the tree under test =============================
# Everything the driver builds goes through make(); keep what a tree changed here, keyed by the
# fields its types have, so that both trees get the same values from the same seed.

# Fields a type of the tree under test no longer takes: {type name: {field, ...}}; their values are dropped.
DROPPED: dict[str, set[str]] = {}
# Fields renamed: {type name: {field as the driver names it: field as the tree names it}}.
RENAMED: dict[str, dict[str, str]] = {}


def make(cls: type, **kw: Any) -> Any:
    """CLS(**KW), with the fields DROPPED and RENAMED for it applied where CLS lacks them."""
    have = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else None
    name = cls.__name__
    if have is not None:
        for old, new in RENAMED.get(name, {}).items():
            if old in kw and old not in have:
                kw[new] = kw.pop(old)
        for gone in DROPPED.get(name, set()):
            if gone not in have:
                kw.pop(gone, None)
    return cls(**kw)


def replica_memory(facts: dict[str, Any], **kw: Any) -> ob.ReplicaMemoryObservation:
    """A ReplicaMemoryObservation from the raw wiring FACTS (unit, env_files as (path, text, error),
    exec_start, env_path) and KW. Today's type takes the judged wiring_problem (what the shell's
    observer computes with core.wiring); a tree that judges the raw facts in the core takes them."""
    have = {f.name for f in dataclasses.fields(ob.ReplicaMemoryObservation)}
    if "wiring_problem" in have:
        from guardian.core.memory import wiring

        files = tuple(wiring.EnvFile(*e) for e in facts["env_files"])
        kw["wiring_problem"] = wiring.wiring_problem(facts["unit"], files, facts["exec_start"], facts["env_path"])
    else:  # the raw facts, judged in the core (issue 32): the observation carries a UnitWiring
        files = tuple(ob.EnvFile(*e) for e in facts["env_files"])
        kw["wiring"] = ob.UnitWiring(facts["unit"], files, tuple(facts["exec_start"]), facts["env_path"])
    return make(ob.ReplicaMemoryObservation, **kw)


def adapt(obs: ob.TickObservation) -> ob.TickObservation:
    """The whole observation, last: a hook for a change that make() cannot absorb field by field."""
    return obs


def state_view(state: Any) -> Any:
    """The next state as it is compared (canon() of it): a hook for a tree whose TickState (or a part
    of it) is reshaped on purpose, to map it to the base's shape. Both trees pass through it."""
    return state


# ==== end of the SHIM =================================================================================


def canon(x: Any) -> Any:
    """X as plain JSON values, generically: a dataclass is a dict of its fields with "_t" its type's
    name, an enum its value, a set or frozenset sorted, dict keys sorted (keys that are not strings
    are their canonical JSON text), tuples lists, paths strings; floats stay floats (json writes
    float.__repr__); anything else its repr."""
    if isinstance(x, enum.Enum):
        return canon(x.value)
    if x is None or isinstance(x, bool | int | float | str):
        return x
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        out = {"_t": type(x).__name__}
        out.update({f.name: canon(getattr(x, f.name)) for f in dataclasses.fields(x)})
        return out
    if isinstance(x, dict):
        return {
            k if isinstance(k, str) and not isinstance(k, enum.Enum) else _text(canon(k)): canon(v)
            for k, v in x.items()
        }
    if isinstance(x, set | frozenset):
        return sorted((canon(v) for v in x), key=_text)
    if isinstance(x, list | tuple):
        return [canon(v) for v in x]
    if isinstance(x, PurePath):
        return str(x)
    if hasattr(x, "model_dump"):
        return {"_t": type(x).__name__, **canon(x.model_dump())}
    return {"_repr": repr(x)}


def _text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


NAMED = re.compile(r"\(([A-Z][0-9]{1,2})\)")  # "... (D6)": a rule named at the end of a line's text


def rules_in(value: Any, found: Counter, named: Counter) -> None:
    """Every string under a "rule" key in VALUE (canonical: LogLines, refusals, verdicts) into FOUND,
    and the rule ids named in parentheses in the messages into NAMED."""
    if isinstance(value, dict):
        rule = value.get("rule")
        if isinstance(rule, str):
            found[rule] += 1
        message = value.get("message")
        if isinstance(message, str):
            named.update(NAMED.findall(message))
        for v in value.values():
            rules_in(v, found, named)
    elif isinstance(value, list):
        for v in value:
            rules_in(v, found, named)


# --- probes ---------------------------------------------------------------------------------------


def probe(kind: str, latency: float = 0.01) -> ob.Probe:
    if kind == "ok":
        return make(ob.Probe, ok=True, status=200, latency_s=latency)
    if kind == "503":
        return make(ob.Probe, ok=False, status=503, latency_s=latency, error="HTTP 503")
    if kind == "refused":
        return make(ob.Probe, ok=False, status=None, latency_s=0.0, error="connection refused")
    if kind == "pending":
        return make(ob.Probe, ok=False, status=None, latency_s=0.0, error=None, pending=True)
    if kind == "garbage":
        return make(ob.Probe, ok=False, status=200, latency_s=latency, error="unparseable: line 3: no value")
    return make(ob.Probe, ok=False, status=None, latency_s=latency, error="timeout")


# --- the world ------------------------------------------------------------------------------------

# What a replica's engine does while its process is up and loaded.
MODES = {
    "idle": 30,
    "busy": 25,
    "hung": 8,  # work queued, nothing moves
    "frozen": 7,  # idle, answers /health, canaries never answer
    "dead503": 5,
    "unresponsive": 6,
    "pending": 4,  # the probes are still in flight
    "wrong_model": 3,
    "garbage": 3,  # /metrics unparseable
    "slow_health": 4,
    "starved": 3,  # no probe answers, but responses flow (the kernel's view)
    "waiting": 4,  # clients wait for an answer, nothing on /metrics
}


@dataclasses.dataclass
class Rep:
    """One replica as the world has it."""

    name: str
    unit: str
    model: str
    port: int
    container: str | None
    mode: str = "idle"
    active: str = "active"  # the unit's ActiveState, as systemd would say it
    load: str = "loaded"
    file_state: str = "enabled"
    started_at: float = 0.0
    loaded_at: float = 0.0
    invocation: int = 1
    pid: int = 100
    gen: float = 0.0
    prompt: float = 0.0
    success: float = 0.0
    kv: float = 0.0
    running: int = 0
    waiting: int = 0
    prefill: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])
    outcome: tuple | None = None  # a restart job's end, for the next observation
    canaries: list[tuple] = dataclasses.field(default_factory=list)  # (due, sent_at, ok, latency, error)
    warmups: list[tuple] = dataclasses.field(default_factory=list)  # (due, started_at, served, failed, took, error)
    configured: float | None = 0.4  # guardian's env file
    running_fraction: float | None = 0.4  # what the running start was given
    override: float | None = None  # a drop-in that makes every start run with this fraction
    reports_fraction: bool = True  # vllm:cache_config_info
    nvml: bool = True
    wiring: str = "wired"
    start_failure: str | None = None
    fail_starts: float = 0.0  # probability that a start fails
    restart_policy: str = "always"
    dbus_until: float = -1.0
    job_until: float = -1.0
    conflict_until: float = -1.0
    port_mode: str = "own"
    port_until: float = -1.0
    bypass_until: float = -1.0
    no_conns_until: float = -1.0
    load_s: float = 20.0
    request: str | None = None  # the request a running restart job answers when it ends


class World:
    """The box on a fake clock, its replicas, and what the executor, etcd and the proxy do."""

    def __init__(self, seed: int, rng: random.Random, cfg: gconfig.Config, reps: list[Rep], now: float) -> None:
        self.seed = seed
        self.rng = rng
        self.cfg = cfg
        self.reps = {r.name: r for r in reps}
        self.now = now
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = 0
        self.chaos = rng.choice((0.3, 0.6, 1.0, 1.0, 1.5, 2.5))
        # persistent state (the state file)
        self.restarts: dict[str, list[float]] = {}
        self.pauses: dict[str, ob.Pause] = {}
        self.resumed_at: dict[str, float] = {}
        self.requests: list[ob.RestartRequest] = []
        self.asked = 0
        self.step_seconds: dict[str, tuple] = {}
        self.canary_latencies: dict[str, tuple] = {}
        self.bases: dict[str, float] = {}
        # memory
        self.consumer = rng.choice((0, 0, 4, 8, 12, 16)) * GiB
        self.psi = rng.random() < 0.6
        self.peer_up = rng.random() < 0.5
        self.memory_gone_until = -1.0
        # proxy
        self.applied: frozenset[str] = frozenset()
        self.failed: frozenset[str] = frozenset()
        self.proxy_error: str | None = None
        self.proxy_broken_until = -1.0
        self.proxy_silent = rng.random() < 0.05
        # fleet
        self.etcd_down_until = -1.0
        self.my_slots: dict[str, str] = {}  # replica -> model: this box's slots in etcd
        self.other_slots: list[ob.FleetSlot] = []
        self.others = self._fleet_members()
        self.top: dict[str, Any] = {}  # what the config was made of (reload())

    def reload(self) -> gconfig.Config:
        """`systemctl reload guardian`: the config without its last replica, or without a section."""
        top, rng = dict(self.top), self.rng
        what = rng.choice(("replica", "replica", "memory", "proxy", "fleet"))
        if what == "replica" and len(top["replicas"]) > 1:
            top["replicas"] = top["replicas"][:-1]
            gone = self.top["replicas"][-1].name
            del self.reps[gone]
            if "memory" in top:
                memory = top["memory"]
                top["memory"] = memory.model_copy(update={"priority": [n for n in memory.priority if n != gone]})
        else:
            top.pop(what, None)
        self.top = top
        self.cfg = gconfig.Config(**top)
        return self.cfg

    # -- scheduling
    def at(self, when: float, fn: Callable[[], None]) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, fn))

    def chance(self, p: float) -> bool:
        return self.rng.random() < p * self.chaos

    def _fleet_members(self) -> list[ob.FleetMember]:
        rng, found = self.rng, []
        models = sorted({r.model for r in self.reps.values()})
        for box in OTHER_BOXES:
            for i in range(rng.randint(0, 2)):
                model = rng.choice((*models, "other-model"))
                weights = rng.choice((None, "dir:aaaa", "dir:bbbb", "hf:Org/M@c0ffee"))
                state = rng.choice(("healthy", "healthy", "busy", "starting", "stalled"))
                serves = rng.choice((None, True, False))
                found.append(
                    make(
                        ob.FleetMember, box=box, name=f"r{i}", model=model, state=state, serves=serves, weights=weights
                    )
                )
        return found

    # -- a replica's process
    def start(self, r: Rep, when: float) -> None:
        """R's unit starts anew at WHEN: a new process that loads for its load time."""
        rng = self.rng
        r.started_at = when
        r.invocation += 1
        r.pid += 7
        r.active = "activating" if rng.random() < 0.3 else "active"
        r.load_s = rng.choice((3.0, 8.0, 20.0, 45.0, 90.0, 400.0))
        r.loaded_at = when + r.load_s
        r.gen = r.prompt = r.success = r.kv = 0.0
        r.running = r.waiting = 0
        r.prefill = [0.0, 0.0, 0.0, 0.0]
        r.canaries = []
        r.start_failure = None
        r.running_fraction = r.override if r.override is not None else r.configured
        if rng.random() >= 0.15:  # a restart that does not help keeps its engine's trouble
            r.mode = rng.choice(("idle", "idle", "busy", "busy", "slow_health"))
        if rng.random() < r.fail_starts:
            fail_at = when + rng.uniform(0.5, r.load_s)
            invocation = r.invocation
            self.at(fail_at, lambda: self._start_failed(r, invocation))
        elif r.active == "activating":
            invocation = r.invocation
            self.at(r.loaded_at, lambda: self._activated(r, invocation))

    def _activated(self, r: Rep, invocation: int) -> None:
        if r.invocation == invocation and r.active == "activating":
            r.active = "active"

    def _start_failed(self, r: Rep, invocation: int) -> None:
        if r.invocation != invocation or r.active not in ("active", "activating"):
            return
        r.active = "failed"
        r.start_failure = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
        if r.restart_policy == "always" and self.rng.random() < 0.7:
            self.at(self.now + self.rng.uniform(2, 12), lambda: self._systemd_restarts(r, invocation))

    def _systemd_restarts(self, r: Rep, invocation: int) -> None:
        if r.invocation == invocation and r.active == "failed" and r.load == "loaded":
            self.start(r, self.now)

    def up(self, r: Rep) -> bool:
        return r.active in ("active", "reloading", "activating") and r.load != "not-found"

    def serving(self, r: Rep, now: float) -> bool:
        return self.up(r) and now >= r.loaded_at

    # -- time passes
    def evolve(self, now: float) -> None:
        self.now = now
        while self.events and self.events[0][0] <= now:
            _, _, fn = heapq.heappop(self.events)
            fn()
        for r in self.reps.values():
            self._evolve_replica(r, now)
        self._evolve_box(now)

    def _evolve_replica(self, r: Rep, now: float) -> None:
        rng = self.rng
        if self.chance(0.05):
            r.mode = rng.choices(list(MODES), weights=list(MODES.values()))[0]
        if r.mode == "busy" or (r.mode == "slow_health" and rng.random() < 0.7):
            r.running, r.waiting = rng.randint(1, 6), rng.randint(0, 3)
            r.gen += rng.randint(5, 400)
            r.prompt += rng.randint(0, 2000)
            r.success += rng.randint(0, 3)
            r.kv = round(rng.random(), 3)
            if rng.random() < 0.2:
                r.prefill = [c + inc for c, inc in zip(r.prefill, self._prefill_rise(), strict=True)]
        elif r.mode == "hung":
            r.running = max(r.running, 1)
        elif r.mode in ("idle", "frozen", "waiting"):
            r.running = r.waiting = 0
        if self.chance(0.012):
            self._unit_event(r, now)
        if self.chance(0.01):
            r.port_mode = rng.choice(("other", "hidden", "unreadable", "stray", "own"))
            r.port_until = now + rng.choice((5, 30, 120))
        if now >= r.port_until:
            r.port_mode = "own"
        if self.chance(0.01):
            r.bypass_until = now + rng.choice((10, 40, 200))
        if self.chance(0.01):
            r.no_conns_until = now + rng.choice((2, 10))

    def _prefill_rise(self) -> list[float]:
        longest = self.rng.choice((0, 1, 2, 3))
        return [1.0 if i >= longest else 0.0 for i in range(4)]

    def _unit_event(self, r: Rep, now: float) -> None:
        rng = self.rng
        what = rng.choice(
            (
                "stop",
                "crash",
                "start",
                "mask",
                "unmask",
                "disable",
                "enable",
                "static",
                "not-found",
                "found",
                "dbus",
                "job",
                "conflict",
                "deactivating",
                "maintenance",
            )
        )
        if what == "stop":
            r.active = "inactive"
        elif what == "crash":
            r.active = "failed"
            if r.restart_policy == "always":
                invocation = r.invocation
                self.at(now + rng.uniform(1, 10), lambda: self._systemd_restarts(r, invocation))
        elif what == "start" and r.active in ("inactive", "failed"):
            self.start(r, now)
        elif what == "mask":
            r.load, r.file_state = rng.choice((("masked", "masked"), ("loaded", "masked-runtime")))
        elif what == "unmask":
            r.load, r.file_state = "loaded", "enabled"
        elif what in ("disable", "enable", "static"):
            r.file_state = {"disable": "disabled", "enable": "enabled", "static": "static"}[what]
        elif what == "not-found":
            r.load, r.active = "not-found", "inactive"
        elif what == "found":
            r.load = "loaded"
        elif what == "dbus":
            r.dbus_until = now + rng.choice((2, 10, 40))
        elif what == "job":
            r.job_until = now + rng.choice((2, 10))
        elif what == "conflict":
            r.conflict_until = now + rng.choice((10, 60))
        elif what in ("deactivating", "maintenance") and r.active == "active":
            r.active = what
            invocation = r.invocation
            self.at(now + rng.uniform(1, 6), lambda: self._settle(r, invocation))

    def _settle(self, r: Rep, invocation: int) -> None:
        if r.invocation == invocation and r.active in ("deactivating", "maintenance"):
            r.active = self.rng.choice(("active", "inactive", "failed"))

    def _evolve_box(self, now: float) -> None:
        rng = self.rng
        if self.chance(0.04):
            self.consumer = rng.choice((0, 2, 6, 10, 14, 18, 24, 30)) * GiB
        if self.chance(0.03):
            self.peer_up = not self.peer_up
        if self.chance(0.01):
            self.memory_gone_until = now + rng.choice((2, 6))
        if self.chance(0.015):
            self.proxy_broken_until = now + rng.choice((5, 30, 90))
        if self.chance(0.015):
            self.etcd_down_until = now + rng.choice((4, 20, 60))
        if self.chance(0.03):
            self.others = self._fleet_members()
        if self.chance(0.02):
            self._other_slots()
        if self.chance(0.04):
            self._ask_restart(now)
        if self.chance(0.02):
            self._pause_or_resume(now)
        for i, q in enumerate(self.requests):
            if q.asker is not None and not q.asker_gone and self.chance(0.005):
                self.requests[i] = dataclasses.replace(q, asker_gone=True)

    def _other_slots(self) -> None:
        rng = self.rng
        slots = []
        for box in OTHER_BOXES:
            if rng.random() < 0.3:
                model = rng.choice(sorted({r.model for r in self.reps.values()}))
                slots.append(make(ob.FleetSlot, box=box, replica="r0", model=model))
        self.other_slots = slots

    def _ask_restart(self, now: float) -> None:
        rng = self.rng
        self.asked += 1
        name = rng.choice(sorted(self.reps)) if rng.random() > 0.05 else "nosuch"
        wait = rng.choice((None, None, 10.0, 60.0, 300.0))
        expires = rng.choice((None, (now + (wait or 0.0) + 30.0)))
        asker = rng.choice((None, (4000 + self.asked, 123456)))
        self.requests.append(
            make(
                ob.RestartRequest,
                id=f"req-{self.seed}-{self.asked}",
                replica=name,
                at=now,
                wait_until=now + wait if wait is not None else None,
                expires=expires,
                asker=asker,
                asker_gone=False,
                no_drain=rng.random() < 0.2,
            )
        )

    def _pause_or_resume(self, now: float) -> None:
        rng = self.rng
        name = rng.choice(sorted(self.reps))
        if name in self.pauses:
            del self.pauses[name]
            self.resumed_at[name] = now
        else:
            until = rng.choice((None, now + 20.0, now + 120.0))
            reason = rng.choice(("operator", "maintenance window"))
            self.pauses[name] = make(ob.Pause, until=until, reason=reason, since=rng.choice((None, now)))

    # -- the observation
    def observe(self, now: float) -> ob.TickObservation:
        reps = {name: self._replica(r, now) for name, r in self.reps.items()}
        persistent = make(
            ob.PersistentView,
            restarts={k: tuple(v) for k, v in self.restarts.items()},
            pauses=dict(self.pauses),
            resumed_at=dict(self.resumed_at),
            requests=tuple(self.requests),
            proxy_down=tuple(sorted(self.applied)),
            step_seconds=dict(self.step_seconds),
            canary_latencies=dict(self.canary_latencies),
            fraction_bases=dict(self.bases),
        )
        cfg = self.cfg
        memory = self._memory(now) if cfg.memory.enabled and now >= self.memory_gone_until else None
        proxy = None
        if cfg.proxy.enabled and not self.proxy_silent:
            proxy = make(ob.ProxyView, applied=self.applied, failed=self.failed, error=self.proxy_error)
        fleet = self._fleet(now) if cfg.fleet.enabled else None
        return adapt(
            make(ob.TickObservation, replicas=reps, persistent=persistent, memory=memory, proxy=proxy, fleet=fleet)
        )

    def _unit(self, r: Rep, now: float) -> ob.UnitInfo | None:
        if now < r.dbus_until:
            return None
        conflicts: tuple = ()
        if now < r.conflict_until:
            conflicts = (("batch.service", ActiveState.ACTIVE),)
        elif r.port % 2:
            conflicts = (("old-vllm.service", ActiveState.INACTIVE),)
        return make(
            ob.UnitInfo,
            name=r.unit,
            load_state=LoadState.parse(r.load),
            active_state=ActiveState.parse(r.active),
            sub_state="running" if r.active == "active" else "dead",
            unit_file_state=UnitFileState.parse(r.file_state),
            inactive_exit_mono=r.started_at,
            main_pid=r.pid if self.up(r) else 0,
            invocation_id=f"{r.name}-{r.invocation:04d}",
            restart=r.restart_policy,
            n_restarts=r.invocation - 1,
            conflicts=conflicts,
            fragment_path=f"/etc/systemd/system/{r.unit}",
            job_pending=now < r.job_until,
        )

    def _port(self, r: Rep, now: float) -> ob.PortOwner:
        mode = r.port_mode
        if mode == "other":
            return make(HeldBy, port=r.port, pid=999, unit="squatter.service")
        if mode == "hidden":
            return make(Hidden, port=r.port)
        if mode == "unreadable":
            return make(Unreadable, port=r.port)
        if mode == "stray" and r.container is not None:
            return make(
                HeldBy,
                port=r.port,
                pid=998,
                unit="docker.service",
                container="intruder",
                via="docker-proxy",
                stray=True,
            )
        if not self.up(r) or now < r.started_at + 1.0:
            return make(Nobody, port=r.port)
        if r.container is not None:
            return make(
                HeldBy,
                port=r.port,
                pid=r.pid,
                unit="docker.service",
                container=r.container,
                own_container=True,
                via="docker-proxy",
            )
        return make(HeldBy, port=r.port, pid=r.pid, unit=r.unit)

    def _sample(self, r: Rep) -> ob.VllmSample:
        buckets = ((1.0, r.prefill[0]), (10.0, r.prefill[1]), (60.0, r.prefill[2]), (math.inf, r.prefill[3]))
        return make(
            ob.VllmSample,
            running=float(r.running),
            waiting=float(r.waiting),
            kv_cache_usage=r.kv,
            generation_tokens=r.gen,
            prompt_tokens=r.prompt,
            iteration_count=r.gen,
            iteration_sum=r.gen + r.prompt,
            request_success=r.success,
            gpu_memory_utilization=r.running_fraction if r.reports_fraction else None,
            model_names=(r.model,),
            process_start_time_s=1.7e9 + r.started_at,
            prefill_buckets=buckets if r.port % 3 else (),
        )

    def _probes(self, r: Rep, now: float) -> dict[str, Any]:
        """health, metrics_probe, metrics, models_probe, models, probes_pending_s for R now."""
        if not self.serving(r, now):
            loading = self.up(r) and self.rng.random() < 0.3
            kind = "503" if loading else "refused"
            return dict(
                health=probe(kind),
                metrics_probe=probe("refused"),
                metrics=None,
                models_probe=probe("refused"),
                models=None,
            )
        mode, sample = r.mode, self._sample(r)
        ok = dict(
            health=probe("ok"), metrics_probe=probe("ok"), metrics=sample, models_probe=probe("ok"), models=(r.model,)
        )
        if mode in ("idle", "busy", "hung", "frozen", "waiting"):
            if mode == "hung" and self.rng.random() < 0.4:
                ok["health"] = probe("timeout", 2.0)
            return ok
        if mode == "dead503":
            return dict(ok, health=probe("503"))
        if mode in ("unresponsive", "starved"):
            t = probe("timeout", 2.0)
            return dict(health=t, metrics_probe=t, metrics=None, models_probe=t, models=None)
        if mode == "pending":
            p = probe("pending")
            return dict(health=p, metrics_probe=p, metrics=None, models_probe=p, models=None, probes_pending_s=1.5)
        if mode == "wrong_model":
            return dict(ok, models=("some-other-model",))
        if mode == "garbage":
            return dict(ok, metrics_probe=probe("garbage"), metrics=None)
        return dict(ok, health=probe("ok", 2.5) if self.rng.random() < 0.5 else probe("timeout", 2.0))

    def _conns(self, r: Rep, now: float, step_s: float) -> ob.ConnView | None:
        if now < r.no_conns_until:
            return None
        peers = [make(ob.Peer, kind=ob.PeerKind.GUARDIAN, name="guardian.service", connections=1)]
        serving = self.serving(r, now)
        flowing = r.running if serving and r.mode in ("busy", "starved", "slow_health") else 0
        if r.mode == "starved" and serving:
            flowing = max(flowing, 2)
        waiting = 2 if serving and r.mode in ("waiting", "hung") else 0
        if flowing or waiting:
            peers.append(make(ob.Peer, kind=ob.PeerKind.PROXY, name="nginx.service", connections=flowing + waiting))
        if now < r.bypass_until:
            peers.append(make(ob.Peer, kind=ob.PeerKind.OTHER, name="10.0.0.7", connections=2))
        if self.rng.random() < 0.2:
            peers.append(make(ob.Peer, kind=ob.PeerKind.MONITORING, name="prometheus.service", connections=1))
        return make(
            ob.ConnView,
            connections=sum(p.connections for p in peers),
            flowing=flowing,
            bytes_out=flowing * 1500,
            waiting=waiting,
            since_s=step_s,
            cpu_s=self.rng.choice((None, 0.0, 0.4)),
            peers=tuple(peers),
            truncated=self.rng.random() < 0.02,
            last_flow_s=0.2 if flowing else None,
            at=now - 0.1,
            waits_s=tuple(sorted((self.rng.choice((1.0, 4.0, 9.0, 30.0)) for _ in range(waiting)), reverse=True)),
        )

    def _replica(self, r: Rep, now: float) -> ob.ReplicaObservation:
        rng = self.rng
        canary = None
        due = [c for c in r.canaries if c[0] <= now]
        if due:
            first = min(due, key=lambda c: (c[0], c[1]))
            r.canaries.remove(first)
            _, sent_at, ok, latency, error = first
            canary = make(ob.CanaryResult, ok=ok, started_at=sent_at, latency_s=latency, error=error)
            if ok:
                r.gen += 1
                r.success += 1
        warmup = None
        wdue = [w for w in r.warmups if w[0] <= now]
        if wdue:
            first_w = min(wdue, key=lambda w: (w[0], w[1]))
            r.warmups.remove(first_w)
            _, started_at, served, failed, took, error = first_w
            warmup = make(
                ob.WarmupResult, started_at=started_at, served=served, failed=failed, took_s=took, error=error
            )
        outcome = None
        if r.outcome is not None:
            unit, result, issued, ok = r.outcome
            outcome = make(ob.RestartOutcome, unit=unit, result=result, issued=issued, ok=ok)
            r.outcome = None
        unit_info = self._unit(r, now)
        return make(
            ob.ReplicaObservation,
            name=r.name,
            at=now,
            unit=unit_info,
            **self._probes(r, now),
            port_owner=self._port(r, now),
            canary=canary,
            restart_outcome=outcome,
            warmup=warmup,
            unit_error="org.freedesktop.DBus.Error.NoReply: timed out" if unit_info is None else None,
            conns=self._conns(r, now, rng.choice((None, 2.0))),
        )

    def usage(self, r: Rep, now: float) -> float:
        """What R's process holds of the box now: its fraction of the total, taken while it loads."""
        if not self.up(r) or r.running_fraction is None:
            return 0.0
        ramp = min(1.0, max(0.0, (now - r.started_at) / max(r.load_s, 1.0)))
        return r.running_fraction * TOTAL * ramp

    def _memory(self, now: float) -> ob.MemoryObservation:
        rng = self.rng
        held = sum(self.usage(r, now) for r in self.reps.values())
        available = int(max(64 * 2**20, TOTAL - 3 * GiB - self.consumer - held))
        if rng.random() < 0.08:  # now and then right at a line the rules compare with
            memory = self.cfg.memory
            line = rng.choice(
                (
                    memory.critical_headroom_bytes,
                    memory.min_headroom_bytes,
                    memory.min_headroom_bytes + memory.reserve_bytes,
                )
            )
            available = line + rng.choice((-1, 0, 0, 1))
        psi = (25.0 + rng.random() * 30 if available < 4 * GiB else rng.random() * 5) if self.psi else None
        sample = make(
            ob.MemorySample,
            total_bytes=TOTAL,
            available_bytes=available,
            free_bytes=max(0, available - 2 * GiB),
            psi_some_avg10=psi,
            psi_full_avg10=psi / 2 if psi is not None else None,
            file_cache_bytes=2 * GiB,
        )
        replicas = {}
        for r in self.reps.values():
            if rng.random() < 0.02:
                continue  # not observed this tick
            loading = self.up(r) and now < r.loaded_at + 5
            replicas[r.name] = replica_memory(
                self._wiring(r),
                configured_fraction=r.configured,
                cmdline_fraction=r.running_fraction if self.up(r) else None,
                usage_bytes=int(self.usage(r, now)) if r.nvml and self.up(r) else None,
                start_failure=r.start_failure,
                cgroup_bytes=int(GiB + 0.01 * self.usage(r, now)) if loading and r.container is None else None,
            )
        peers = {}
        if self.cfg.memory.peer_urls and self.peer_up:
            peers = {self.rng.choice(sorted({r.model for r in self.reps.values()})): tuple(self.cfg.memory.peer_urls)}
        line = self.cfg.memory.min_headroom_bytes
        consumers = "db.service 22.1 GiB, make (pid 9) 9.3 GiB" if available < line else ""
        return make(
            ob.MemoryObservation,
            sample=sample,
            total_bytes=TOTAL,
            replicas=replicas,
            peers_serving=peers,
            consumers=consumers,
        )

    def _wiring(self, r: Rep) -> dict[str, Any]:
        """R's unit's wiring as the observer reads it: EnvironmentFile= entries and ExecStart=."""
        env = f"/var/lib/guardian/replicas/{r.name}.env"
        files = [
            ("/etc/default/vllm", "HF_HOME=/srv/hf\n", None),
            (env, f"GPU_MEMORY_UTILIZATION={r.configured}\n", None),
        ]
        argv = ["/usr/bin/vllm", "serve", r.model, "--gpu-memory-utilization", "${GPU_MEMORY_UTILIZATION}"]
        if r.wiring == "no-env-file":
            files = files[:1]
        elif r.wiring == "later-sets":
            files.append(("/etc/vllm/override.env", "GPU_MEMORY_UTILIZATION=0.9\n", None))
        elif r.wiring == "later-unreadable":
            files.append(("/etc/vllm/secret.env", None, "Permission denied"))
        elif r.wiring == "no-flag":
            argv = argv[:3]
        return dict(unit=r.unit, env_files=tuple(files), exec_start=tuple(argv), env_path=env)

    def _fleet(self, now: float) -> ob.FleetView:
        if now < self.etcd_down_until:
            return make(ob.FleetView, box=BOX, ok=False, error="etcd: connection refused")
        mine = [
            make(
                ob.FleetMember,
                box=BOX,
                name=r.name,
                model=r.model,
                state="healthy" if self.serving(r, now) else "starting",
                serves=None,
                weights="dir:aaaa",
            )
            for r in self.reps.values()
        ]
        slots = [
            *self.other_slots,
            *(make(ob.FleetSlot, box=BOX, replica=n, model=m) for n, m in sorted(self.my_slots.items())),
        ]
        return make(ob.FleetView, box=BOX, ok=True, error=None, members=(*mine, *self.others), slots=tuple(slots))

    # -- the executor
    def perform(self, actions: list[Any], now: float) -> None:
        for action in actions:
            getattr(self, f"_do_{type(action).__name__}", self._do_unknown)(action, now)

    def _do_unknown(self, action: Any, now: float) -> None:
        pass  # LogLine, RequestWaits, and any type a tree adds: nothing comes back of them

    def _do_StartCanary(self, a: Any, now: float) -> None:
        r = self.reps.get(a.replica)
        if r is None or self.rng.random() < 0.03:
            return  # lost: its result never comes
        sent = a.sent_at if a.sent_at is not None else now
        rng = self.rng
        if not self.serving(r, now):
            r.canaries.append((now + 0.05, sent, False, 0.01, "connection refused"))
        elif r.mode in ("hung", "frozen", "unresponsive", "dead503", "pending"):
            r.canaries.append((sent + a.timeout_s, sent, False, a.timeout_s, "timeout"))
        elif rng.random() < 0.05:
            r.canaries.append((now + 0.1, sent, False, 0.05, "HTTP 500"))
        else:
            latency = rng.choice((0.05, 0.1, 0.3, 0.8, 1.5, 4.0, 9.0, 20.0))
            if latency > a.timeout_s:
                r.canaries.append((sent + a.timeout_s, sent, False, a.timeout_s, "timeout"))
            else:
                r.canaries.append((sent + latency, sent, True, latency, None))

    def _do_WarmUp(self, a: Any, now: float) -> None:
        r = self.reps.get(a.replica)
        rng = self.rng
        if r is None or rng.random() < 0.1:
            return
        took = rng.uniform(0.2, a.timeout_s * 1.2)
        error = rng.choice((None, None, None, "cannot read /etc/guardian/warm.jsonl: No such file"))
        served = 0 if error else rng.randint(1, 20)
        r.warmups.append((now + took, a.started_at, served, rng.choice((0, 0, 1)), took, error))

    def _do_RecordCanaryLatencies(self, a: Any, now: float) -> None:
        for name, latencies in a.latencies:
            self.canary_latencies[name] = tuple(latencies)
        for name, steps in a.steps:
            self.step_seconds[name] = tuple(steps)

    def _do_AnswerRequest(self, a: Any, now: float) -> None:
        self.requests = [q for q in self.requests if q.id != a.request_id]

    def _do_AcquireSlot(self, a: Any, now: float) -> None:
        if now < self.etcd_down_until:
            return
        held = len(self.other_slots) + len(self.my_slots)
        if held < self.cfg.fleet.max_planned_restarts and self.rng.random() < 0.85:
            self.at(now + self.rng.choice((0.0, 0.0, 3.0)), lambda: self.my_slots.setdefault(a.replica, a.model))

    def _do_ReleaseSlot(self, a: Any, now: float) -> None:
        self.at(now + self.rng.choice((0.0, 0.0, 3.0)), lambda: self.my_slots.pop(a.replica, None))

    def _do_SyncProxy(self, a: Any, now: float) -> None:
        down = frozenset(a.down)
        if now < self.proxy_broken_until and down != self.applied:
            self.failed, self.proxy_error = down, "drain command /bin/true exited with status 1"
        else:
            self.applied, self.failed, self.proxy_error = down, frozenset(), None

    def _do_RestartUnit(self, a: Any, now: float) -> None:
        r = self.reps.get(a.replica)
        if r is not None:
            self._job(r, now, a.request_id, None, kill=a.kill_first, allow_failed=False)

    def _do_SetFraction(self, a: Any, now: float) -> None:
        r = self.reps.get(a.replica)
        if r is None:
            return
        if not a.restart:
            self._write_fraction(r, a.old, a.new)
            return
        self._job(r, now, None, (a.old, a.new), kill=a.kill_first, allow_failed=a.retry)

    def _answered(self, request: str | None) -> None:
        self.requests = [q for q in self.requests if q.id != request]

    def _write_fraction(self, r: Rep, old: float, new: float) -> None:
        if new < old:
            self.bases[r.name] = max(self.bases.get(r.name, 0.0), old)
        r.configured = new

    def _job(
        self, r: Rep, now: float, request: str | None, fraction: tuple | None, kill: bool, allow_failed: bool
    ) -> None:
        """A restart as act/restart.py does it: the re-check, the record, the job, its end next ticks."""
        rng = self.rng
        refused = not self.up(r) and not (allow_failed and r.active == "failed")
        if refused or r.load != "loaded" or rng.random() < 0.08:
            why = "refused: the unit changed on the re-check right before acting"
            r.outcome = (
                r.unit,
                why if rng.random() < 0.8 else "error: org.freedesktop.systemd1.NoSuchUnit",
                False,
                False,
            )
            self._answered(request)  # the executor answers a request with the outcome, whatever it is
            return
        if fraction is not None:
            self._write_fraction(r, *fraction)
        self.restarts.setdefault(r.name, []).append(now)
        keep = self.cfg.watchdog.restart_window_s * 4
        self.restarts[r.name] = [t for t in self.restarts[r.name] if t > now - keep]
        r.active = "deactivating"
        r.request = request
        invocation = r.invocation
        stop_s = rng.choice((0.25, 0.5, 1.0, 1.5)) if kill else rng.choice((0.5, 2.0, 8.0, 40.0))
        result = rng.choice(("done",) * 9 + ("failed", "timeout"))
        end_s = stop_s + rng.choice((0.1, 0.5, 3.0))

        def stopped() -> None:
            if r.invocation == invocation:
                self.start(r, now + stop_s)

        def ended() -> None:
            if result != "done" and r.active in ("active", "activating"):
                r.active = "failed"
            r.outcome = (r.unit, result, True, result == "done")
            self._answered(r.request)  # the executor answers the request when its job ends
            r.request = None

        self.at(now + stop_s, stopped)
        self.at(now + end_s, ended)


# --- the scenario ---------------------------------------------------------------------------------


def scenario(seed: int) -> tuple[World, gconfig.Config]:
    """SEED's config and world (raises as the config does, for a combination it refuses)."""
    rng = random.Random(seed)
    n = rng.choice((1, 2, 2, 2, 3, 3, 4))
    two_models = n >= 3 and rng.random() < 0.5
    replicas, reps = [], []
    for i in range(n):
        name = "abcd"[i]
        model = "m2" if two_models and i % 2 else "m"
        container = f"ctr-{name}" if rng.random() < 0.1 else None
        warm = rng.random() < 0.3
        replicas.append(
            dict(
                name=name,
                unit=f"vllm-{name}.service",
                container=container,
                url=f"http://127.0.0.1:{8001 + i}",
                model=model,
                startup_grace_s=rng.choice((30.0, 120.0, 1200.0)),
                canary_timeout_s=rng.choice((5.0, 15.0)),
                health_timeout_s=2.0,
                warmup_file=Path(f"/etc/guardian/warm-{name}.jsonl") if warm else None,
                warmup_timeout_s=rng.choice((5.0, 30.0)),
            )
        )
        reps.append(Rep(name, f"vllm-{name}.service", model, 8001 + i, container))
    watchdog = dict(
        stall_window_s=rng.choice((20.0, 60.0)),
        unresponsive_after_s=rng.choice((6.0, 10.0)),
        canary_interval_s=rng.choice((5.0, 10.0)),
        canary_retry_s=rng.choice((3.0, 5.0)),
        canary_after_traffic_s=rng.choice((3.0, 5.0)),
        stall_canary_after_s=rng.choice((5.0, 10.0)),
        canary_failures=rng.choice((1, 2, 2, 3)),
        restart_budget=rng.choice((1, 2, 3, 3, 5)),
        restart_window_s=rng.choice((300.0, 1800.0)),
        backoff_s=rng.choice((0.0, 5.0, 20.0, 60.0)),
        client_wait_s=rng.choice((3.0, 8.0)),
        bypass_after_s=rng.choice((10.0, 30.0)),
        proxy_peers=rng.choice(([], [], ["10.0.0.99"])),
    )
    fractions = [round(rng.uniform(0.72, 0.92) / n, 2) for _ in range(n)]
    top: dict[str, Any] = dict(
        interval_s=rng.choice((1.0, 2.0, 2.0, 5.0)),
        dry_run=rng.random() < 0.12,
        replicas=[gconfig.ReplicaConfig(**r) for r in replicas],
        watchdog=gconfig.WatchdogConfig(**watchdog),
    )
    if rng.random() < 0.6:
        sustain = rng.choice((0.0, 0.0, 4.0, 15.0))
        top["memory"] = gconfig.MemoryConfig(
            enabled=True,
            min_headroom_bytes=8 * GiB,
            critical_headroom_bytes=3 * GiB,
            sustain_s=sustain,
            cooldown_s=rng.choice((0.0, 4.0, 10.0, 20.0, 600.0)),
            reserve_bytes=GiB,
            step=rng.choice((0.02, 0.04, 0.1)),
            floor=max(0.01, round(min(fractions) - rng.choice((-0.02, 0.03, 0.08, 0.15)), 2)),
            psi_some_threshold_pct=rng.choice((None, None, 10.0)),
            restore=rng.random() < 0.7,
            restore_after_s=sustain + rng.choice((10.0, 40.0, 600.0)),
            restore_cooldown_s=rng.choice((0.0, 4.0, 30.0, 600.0)),
            start_guard=rng.random() < 0.8,
            priority=rng.sample([r["name"] for r in replicas], rng.randint(0, n)),
            peer_urls=rng.choice(([], [], ["http://10.0.0.5:8000"])),
        )
    if rng.random() < 0.55:
        proxy: dict[str, Any] = dict(drain_timeout_s=rng.choice((10.0, 40.0, 120.0)), stop_timeout_s=30.0)
        if rng.random() < 0.5:
            proxy["nginx_upstream_dir"] = Path("/etc/nginx/guardian")
        else:
            proxy["drain_command"] = ["/bin/true"]
        top["proxy"] = gconfig.ProxyConfig(**proxy)
    if rng.random() < 0.3:
        top["fleet"] = gconfig.FleetConfig(
            endpoints=["http://127.0.0.1:2379"],
            box=BOX,
            max_planned_restarts=rng.choice((1, 1, 2)),
            min_serving=rng.choice((0, 1, 1, 2)),
        )
    cfg = gconfig.Config(**top)
    now = 1000.0 + rng.randrange(800) / 8  # binary fractions: differences of times are exact, so boundaries are hit
    world = World(seed, rng, cfg, reps, now)
    world.top = top
    for r, f in zip(reps, fractions, strict=True):
        r.configured = r.running_fraction = f
        if rng.random() < 0.1:
            r.configured = None  # no env file of guardian's yet
        r.override = rng.choice((None,) * 9 + (round(f + 0.05, 2),))
        r.reports_fraction = rng.random() < 0.7
        r.nvml = rng.random() < 0.7
        r.wiring = rng.choice(("wired",) * 6 + ("no-env-file", "later-sets", "later-unreadable", "no-flag"))
        r.fail_starts = rng.choice((0.0, 0.0, 0.1, 0.4))
        r.restart_policy = rng.choice(("always", "always", "on-failure", "no"))
        r.mode = rng.choices(list(MODES), weights=list(MODES.values()))[0] if rng.random() < 0.5 else "idle"
        if rng.random() < 0.25:
            world.start(r, now - rng.randrange(0, 30))  # starting as guardian starts
        else:
            r.started_at = now - rng.randrange(100, 5000)
            r.loaded_at = r.started_at + 30
        if rng.random() < 0.3:
            world.restarts[r.name] = [now - rng.randrange(10, 1500) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.4:
            world.canary_latencies[r.name] = tuple(round(rng.uniform(0.05, 1.0), 2) for _ in range(rng.randint(1, 8)))
        if rng.random() < 0.2 and r.configured is not None:
            world.bases[r.name] = round(r.configured + rng.choice((0.02, 0.08)), 2)
        if rng.random() < 0.08:
            world.pauses[r.name] = make(ob.Pause, until=rng.choice((None, now + 30.0)), since=now - 5)
    return world, cfg


STEPS = ((0.5, 2), (1.0, 2), (2.0, 10), (3.0, 3), (5.0, 3), (10.0, 2), (30.0, 1), (120.0, 0.4), (700.0, 0.2))


def run(seed: int, ticks: int, out: Any, stats: dict[str, Any]) -> None:
    try:
        world, cfg = scenario(seed)
    except Exception as e:  # noqa: BLE001 - compared between the trees as it is
        out.write(_text({"seed": seed, "error": f"{type(e).__name__}: {e}"}) + "\n")
        stats["config_errors"] += 1
        return
    out.write(_text({"seed": seed}) + "\n")
    stats["scenarios"] += 1
    rng = world.rng
    state = tick.TickState()
    now = world.now
    reload_at = rng.randrange(ticks) if rng.random() < 0.12 else -1
    for i in range(ticks):
        if i == reload_at:
            try:
                cfg = world.reload()
            except Exception as e:  # noqa: BLE001 - compared between the trees as it is
                out.write(_text({"tick": i, "error": f"reload: {type(e).__name__}: {e}"}) + "\n")
                return
            stats["reloads"] += 1
        step = rng.choices([s for s, _ in STEPS], weights=[w for _, w in STEPS])[0]
        now += step + rng.choice((0.0, 0.0, 0.0, 0.0, 0.0, 0.125, 0.25))
        world.evolve(now)
        obs = world.observe(now)
        try:
            state, actions = tick.decide(state, obs, now, cfg)
        except Exception as e:  # noqa: BLE001 - compared between the trees as it is
            out.write(_text({"tick": i, "error": f"{type(e).__name__}: {e}"}) + "\n")
            stats["decide_errors"] += 1
            return
        line = {"tick": i, "now": now, "actions": canon(actions), "state": canon(state_view(state))}
        out.write(_text(line) + "\n")
        stats["ticks"] += 1
        stats["actions"] += len(actions)
        stats["action_types"].update(type(a).__name__ for a in actions)
        rules_in(line, stats["rules"], stats["named"])
        world.perform(actions, now)


def _coverage(path: str) -> Callable[[], None]:
    """Line coverage of guardian/core by sys.settrace (no coverage package needed); the returned
    function writes {module: [lines run, lines in all]} to PATH."""
    core = Path(tick.__file__).resolve().parent
    prefix = str(core) + "/"
    seen: set[tuple[str, int]] = set()

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            seen.add((frame.f_code.co_filename, frame.f_lineno))
        return local

    def call(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename.startswith(prefix) else None

    sys.settrace(call)

    def lines_of(code: Any, functions: bool) -> set[int]:
        """The lines of the code objects under CODE: of its functions' bodies (FUNCTIONS: their def
        lines left out, never traced) or of the module's and its classes' bodies (run at import)."""
        own = {line for _, _, line in code.co_lines() if line is not None}
        function = bool(code.co_flags & 1)  # CO_OPTIMIZED: a function or a lambda, not a module or class body
        found = (own - {code.co_firstlineno}) if function == functions else set()
        for c in code.co_consts:
            if hasattr(c, "co_lines"):
                found |= lines_of(c, functions)
        return found

    def write() -> None:
        sys.settrace(None)
        report = {}
        for file in sorted(core.rglob("*.py")):  # its subpackages too (core/watchdog/)
            code = compile(file.read_text(), str(file), "exec")
            body = lines_of(code, True) - lines_of(code, False)
            ran = {line for f, line in seen if f == str(file)} & body
            report[str(file.relative_to(core))] = [len(ran), len(body), sorted(body - ran)]
        Path(path).write_text(json.dumps(report) + "\n")

    return write


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=1500)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--ticks", type=int, default=60)
    ap.add_argument("--coverage", metavar="FILE")
    args = ap.parse_args()
    out = sys.stdout
    out.write(_text({"guardian": str(Path(guardian.__file__).resolve().parent)}) + "\n")
    stats: dict[str, Any] = dict(
        scenarios=0,
        config_errors=0,
        decide_errors=0,
        ticks=0,
        actions=0,
        action_types=Counter(),
        rules=Counter(),
        named=Counter(),
        reloads=0,
    )
    write_coverage = _coverage(args.coverage) if args.coverage else None
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        run(seed, args.ticks, out, stats)
    if write_coverage is not None:
        write_coverage()
    out.write(_text({"stats": stats}) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
