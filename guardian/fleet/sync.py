"""This box in the fleet: its etcd lease, its published replicas, the view, and its slots.

Keys, under ``/guardian/FLEET/`` (F = the [fleet] config):
- ``replicas/BOX/NAME``: {"box", "name", "unit", "model", "state", "since"} for every replica of
  every box, bound to that box's lease: a guardian that dies (or a box that is cut off) vanishes
  from the view F.lease_ttl_s after its last renewal, by etcd's clock, not the box's;
- ``slots/I`` (I < F.max_planned_restarts): {"box", "replica", "model", "since"}, one per planned
  restart in flight, bound to the holder's lease;
- ``models/MODEL``: rewritten with every slot taken for MODEL, so that two boxes that read the same
  view cannot both take a slot for the same model (the transaction compares its revision).

Once per tick, bounded by 2 x F.timeout_s, running beside the replicas' probes: renew the lease
every lease_ttl_s / 3 (a new lease when it expired, and everything published again), publish the
replicas whose state changed, and read the whole prefix (one range request). Slots are asked for
and given back as the core says (AcquireSlot, ReleaseSlot), as tasks. When etcd cannot be reached
this is said once; the view says so to the core, which holds planned restarts (core/fleet.py F3).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Callable
from typing import Any

from ..config import Config
from ..core.actions import AcquireSlot, Action, LogLine, ReleaseSlot
from ..core.liveness import Track
from ..core.observations import FleetMember, FleetSlot, FleetView
from ..core.vocab import Decision, Priority
from ..observe.clock import Now
from .etcd import KV, Compare, Etcd, EtcdError, delete_op, put_op


def box_name(cfg: Config) -> str:
    return cfg.fleet.box or socket.gethostname().split(".")[0]


def make_etcd(cfg: Config) -> Etcd:
    f = cfg.fleet
    password = None
    if f.password_file is not None:
        password = f.password_file.read_text().strip()  # OSError: said by the caller
    return Etcd(
        f.endpoints,
        f.timeout_s,
        str(f.ca_file) if f.ca_file else None,
        str(f.cert_file) if f.cert_file else None,
        str(f.key_file) if f.key_file else None,
        f.username or None,
        password,
    )


def parse_view(box: str, prefix: str, kvs: list[KV]) -> tuple[list[FleetMember], list[tuple[FleetSlot, KV]]]:
    """Members and slots from the keys under PREFIX; a value that is not ours is skipped."""
    members, slots = [], []
    for kv in kvs:
        rest = kv.key[len(prefix) :]
        try:
            data = json.loads(kv.value)
            if rest.startswith("replicas/"):
                members.append(FleetMember(str(data["box"]), str(data["name"]), str(data["model"]), str(data["state"])))
            elif rest.startswith("slots/"):
                slots.append((FleetSlot(str(data["box"]), str(data["replica"]), str(data["model"])), kv))
        except (ValueError, KeyError, TypeError):
            continue
    return members, slots


class FleetSync:
    def __init__(self, cfg: Config, journal: Any, clock: Callable[[], Now]) -> None:
        self.cfg = cfg
        self.journal = journal
        self.clock = clock
        self.box = box_name(cfg)
        self.prefix = f"/guardian/{cfg.fleet.name}/"
        self.etcd: Etcd | None = None
        self.lease: int | None = None
        self.renewed_mono = 0.0
        self.published: dict[str, str] = {}
        self.kvs: dict[str, KV] = {}
        self.slot_kvs: list[tuple[FleetSlot, KV]] = []
        self.view: FleetView = FleetView(self.box, False, "not read yet")
        self.down_said = False
        self.lock = asyncio.Lock()
        self.tasks: set[asyncio.Task[None]] = set()

    # --- each tick -----------------------------------------------------------------------------
    async def step(self, tracks: dict[str, Track], now: Now) -> FleetView:
        try:
            async with self.lock:
                await asyncio.wait_for(self._step(tracks, now), 2 * self.cfg.fleet.timeout_s)
        except (EtcdError, OSError, TimeoutError) as e:
            err = f"{type(e).__name__}: {e}" if not isinstance(e, EtcdError) else str(e)
            if isinstance(e, TimeoutError):
                err = f"etcd did not answer within {2 * self.cfg.fleet.timeout_s:g} s"
            self.view = FleetView(self.box, False, err[:500])
            self.published = {}  # etcd may have lost writes: everything is published again once it answers
            if not self.down_said:
                self.down_said = True
                self._say(
                    Priority.ERROR,
                    f"fleet: etcd cannot be reached ({err[:300]}); planned restarts wait (a critical memory "
                    "lowering goes ahead), hung replicas are still restarted; retried every tick",
                )
            return self.view
        if self.down_said:
            self.down_said = False
            self._say(Priority.INFO, "fleet: etcd answers again; this box's replicas are published again")
        return self.view

    async def _step(self, tracks: dict[str, Track], now: Now) -> None:
        f = self.cfg.fleet
        if self.etcd is None:
            self.etcd = make_etcd(self.cfg)
        if self.lease is not None and now.mono - self.renewed_mono >= f.lease_ttl_s / 3:
            if await self.etcd.keepalive(self.lease) > 0:
                self.renewed_mono = now.mono
            else:
                held = [s.replica for s, _ in self.slot_kvs if s.box == self.box]
                self._say(
                    Priority.ERROR,
                    f"fleet: this box's etcd lease expired (no renewal for {f.lease_ttl_s} s)"
                    + (f"; the slots of {', '.join(held)} went with it" if held else "")
                    + "; joining again with a new lease",
                )
                self.lease = None
        if self.lease is None:
            self.lease = await self.etcd.grant(f.lease_ttl_s)
            self.renewed_mono = now.mono
            self.published = {}
            self._say(
                Priority.INFO,
                f"fleet: box {self.box} joined fleet {f.name} on {', '.join(f.endpoints)} (lease {self.lease:x}, "
                f"ttl {f.lease_ttl_s} s)",
            )
        for r in self.cfg.replicas:
            t = tracks.get(r.name)
            state = str(t.state) if t is not None else "starting"
            since = now.wall - (now.mono - t.state_since) if t is not None else now.wall
            value = json.dumps(
                {"box": self.box, "name": r.name, "unit": r.unit, "model": r.model, "state": state},
                sort_keys=True,
            )
            if self.published.get(r.name) != value:
                stamped = json.loads(value) | {"since": round(since, 3)}
                await self.etcd.put(f"{self.prefix}replicas/{self.box}/{r.name}", json.dumps(stamped), self.lease)
                self.published[r.name] = value
        for name in [n for n in self.published if self.cfg.replica(n) is None]:
            await self.etcd.delete(f"{self.prefix}replicas/{self.box}/{name}")
            del self.published[name]
        _rev, kvs = await self.etcd.range_prefix(self.prefix)
        self.kvs = {kv.key: kv for kv in kvs}
        members, self.slot_kvs = parse_view(self.box, self.prefix, kvs)
        self.view = FleetView(self.box, True, None, tuple(members), tuple(s for s, _ in self.slot_kvs))

    # --- slots ---------------------------------------------------------------------------------
    def perform(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, AcquireSlot):
                self._spawn(self.acquire(a.replica, a.model))
            elif isinstance(a, ReleaseSlot):
                self._spawn(self.release(a.replica))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def acquire(self, replica: str, model: str) -> None:
        """F6: take a free slot, only if no slot was taken for MODEL since the view was read."""
        async with self.lock:
            if self.etcd is None or self.lease is None or not self.view.ok:
                return
            taken = {kv.key for _, kv in self.slot_kvs}
            free = [
                k
                for k in (f"{self.prefix}slots/{i}" for i in range(self.cfg.fleet.max_planned_restarts))
                if k not in taken
            ]
            if not free:
                return
            epoch = f"{self.prefix}models/{model}"
            seen = self.kvs.get(epoch)
            value = json.dumps(
                {"box": self.box, "replica": replica, "model": model, "since": round(self.clock().wall, 3)}
            )
            try:
                ok = await self.etcd.txn(
                    [
                        Compare(free[0], "CREATE", "EQUAL", 0),
                        Compare(epoch, "MOD", "EQUAL", seen.mod_revision if seen else 0),
                    ],
                    [put_op(free[0], value, self.lease), put_op(epoch, value)],
                )
            except EtcdError as e:
                self._say(Priority.ERROR, f"replica {replica}: asking etcd for a fleet slot failed: {e}", replica)
                return
            if ok:
                n = free[0].rsplit("/", 1)[1]
                self._say(Priority.INFO, f"replica {replica}: fleet slot {n} taken for a planned restart (F6)", replica)

    async def release(self, replica: str) -> None:
        """F7: delete this box's slot of REPLICA, if it is still the one we read."""
        async with self.lock:
            if self.etcd is None:
                return
            for slot, kv in self.slot_kvs:
                if slot.box == self.box and slot.replica == replica:
                    try:
                        await self.etcd.txn([Compare(kv.key, "MOD", "EQUAL", kv.mod_revision)], [delete_op(kv.key)])
                    except EtcdError as e:
                        self._say(Priority.ERROR, f"replica {replica}: giving its fleet slot back failed: {e}", replica)

    async def close(self) -> None:
        """At a graceful stop: this box leaves the fleet view at once (its lease is revoked)."""
        for t in list(self.tasks):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, self.cfg.fleet.timeout_s)
        if self.etcd is not None:
            if self.lease is not None:
                with contextlib.suppress(EtcdError, OSError):
                    await asyncio.wait_for(self.etcd.revoke(self.lease), self.cfg.fleet.timeout_s)
            await self.etcd.aclose()

    def _say(self, priority: Priority, text: str, replica: str | None = None) -> None:
        r = self.cfg.replica(replica) if replica else None
        self.journal.line(LogLine(priority, text, Decision.FLEET, replica, r.unit if r else None))


async def fleet_status(cfg: Config) -> dict[str, Any]:
    """The fleet view as `guardian status --fleet` shows it: boxes, replicas and states, slots and
    their holders, read from etcd with this box's config. Raises EtcdError or OSError."""
    etcd = make_etcd(cfg)
    prefix = f"/guardian/{cfg.fleet.name}/"
    try:
        revision, kvs = await etcd.range_prefix(prefix)
    finally:
        await etcd.aclose()
    boxes: dict[str, dict[str, Any]] = {}
    slots = []
    for kv in kvs:
        rest = kv.key[len(prefix) :]
        try:
            data = json.loads(kv.value)
        except ValueError:
            continue
        if rest.startswith("replicas/") and isinstance(data, dict):
            boxes.setdefault(str(data.get("box")), {})[str(data.get("name"))] = data
        elif rest.startswith("slots/") and isinstance(data, dict):
            slots.append(data | {"slot": rest.split("/", 1)[1]})
    return {
        "fleet": cfg.fleet.name,
        "endpoints": cfg.fleet.endpoints,
        "revision": revision,
        "max_planned_restarts": cfg.fleet.max_planned_restarts,
        "min_serving": cfg.fleet.min_serving,
        "boxes": boxes,
        "slots": slots,
    }
