"""This box in the fleet: its etcd lease, its published replicas, the view, and its slots.

Keys, under ``/guardian/FLEET/`` (F = the [fleet] config):
- ``replicas/BOX/NAME``: {"box", "name", "unit", "model", "state", "since"} for every replica of
  every box, bound to that box's lease: a guardian that dies (or a box that is cut off) vanishes
  from the view F.lease_ttl_s after its last renewal, by etcd's clock, not the box's;
- ``slots/I`` (I < F.max_planned_restarts): {"box", "replica", "model", "since"}, one per planned
  restart in flight, bound to the holder's lease;
- ``models/MODEL``: rewritten with every slot taken for MODEL, so that two boxes that read the same
  view cannot both take a slot for the same model (the transaction compares its revision).

Once per tick, bounded as a whole by 2 x F.timeout_s (waiting for the lock included), running
beside the replicas' probes: renew the lease every lease_ttl_s / 3 (a new lease when it expired,
and everything published again), publish the replicas whose state changed, and read the whole
prefix (one range request). Slots are asked for and given back as the core says (AcquireSlot,
ReleaseSlot), as tasks, each under the same bound. When etcd cannot be reached, or answers what is
not etcd's, or anything at all goes wrong in the step, this is said once; the view says so to the
core, which holds planned restarts (core/fleet.py F3). A value under the prefix that is not a
guardian's is skipped, said once, and the rest of the view is used; the slot request skips it too
(parse_view decides for both): garbage at a slot key holds no slot (issue 41 row 6).

FleetSync is one membership (one lease); Fleet is the daemon's part that holds it across reloads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..config import Config
from ..core import fleet as fleet_rules
from ..core.actions import AcquireSlot, LogLine, ReleaseSlot
from ..core.observations import FleetMember, FleetSlot, FleetView, TickObservation
from ..core.vocab import Decision, Priority, State
from ..core.watchdog.judge import serves as serves_now
from ..core.watchdog.track import Track
from ..core.weights import Weights
from ..observe.clock import Now
from .etcd import KV, Compare, Etcd, EtcdError, Tls, delete_op, json_kind, put_op


def box_name(cfg: Config) -> str:
    return cfg.fleet.box or socket.gethostname().split(".")[0]


def make_etcd(cfg: Config) -> Etcd:
    f = cfg.fleet
    password = None
    if f.password_file is not None:
        password = f.password_file.read_text().strip()  # OSError: said by the caller
    tls = Tls(
        str(f.ca_file) if f.ca_file else None,
        str(f.cert_file) if f.cert_file else None,
        str(f.key_file) if f.key_file else None,
    )
    return Etcd(f.endpoints, f.timeout_s, tls, f.username or None, password)


# A guardian writes values of about 200 bytes, every field text. Anyone who can write under the
# prefix can write anything: a value longer than this is not read at all (json.loads of 100 KB of
# "[" raises RecursionError), and a field longer than MAX_FIELD_CHARS is not a guardian's either.
MAX_VALUE_CHARS = 16 * 2**10
MAX_FIELD_CHARS = 512
MAX_SKIPPED_SAID = 3  # per tick, then one line for the rest: a flood of garbage is not a flood of lines


class NotOurs(ValueError):
    pass


def read_value(value: str) -> dict[str, Any]:
    """VALUE as a guardian wrote it: a JSON object; NotOurs says why not."""
    if len(value) > MAX_VALUE_CHARS:
        raise NotOurs(f"a value of {len(value)} characters, more than {MAX_VALUE_CHARS}")
    try:
        data = json.loads(value)
    except (ValueError, RecursionError) as e:
        raise NotOurs(f"not JSON ({type(e).__name__})") from e
    if not isinstance(data, dict):
        raise NotOurs(f"not a JSON object ({json_kind(data)})")
    return data


def _text(data: dict[str, Any], field: str) -> str:
    value = data.get(field)
    if not isinstance(value, str) or len(value) > MAX_FIELD_CHARS:
        raise NotOurs(f"its {field!r} is not text of at most {MAX_FIELD_CHARS} characters")
    return value


def read_member(value: str) -> tuple[FleetMember, dict[str, Any]]:
    data = read_value(value)
    serves = data.get("serves")
    if serves is not None and not isinstance(serves, bool):
        raise NotOurs("its 'serves' is not true or false")
    weights = data.get("weights")
    if weights is not None and (not isinstance(weights, str) or len(weights) > MAX_FIELD_CHARS):
        raise NotOurs(f"its 'weights' is not text of at most {MAX_FIELD_CHARS} characters")
    member = FleetMember(
        _text(data, "box"), _text(data, "name"), _text(data, "model"), _text(data, "state"), serves, weights
    )
    return member, data


def read_slot(value: str) -> tuple[FleetSlot, dict[str, Any]]:
    data = read_value(value)
    return FleetSlot(_text(data, "box"), _text(data, "replica"), _text(data, "model")), data


def not_leased(slot: FleetSlot, kv: KV, leases: Mapping[str, set[int]]) -> str:
    """Why SLOT's key KV is held by no guardian's lease ("": it is): a guardian binds its slot to the
    lease it publishes its replicas with (LEASES: box -> the leases of its replicas' keys)."""
    if kv.lease == 0:
        return "bound to no lease, so it never expires"
    if kv.lease not in leases.get(slot.box, set()):
        return f"bound to lease {kv.lease:x}, with which box {slot.box[:40]!r} publishes no replica"
    return ""


def _scalars(data: dict[str, Any]) -> dict[str, Any]:
    """What `guardian status --fleet` may show of DATA: its short text and its numbers."""
    return {
        k: v
        for k, v in data.items()
        if (isinstance(v, str) and len(v) <= MAX_FIELD_CHARS)
        or (isinstance(v, int | float) and not isinstance(v, bool))
    }


def parse_view(
    box: str, prefix: str, kvs: list[KV], skipped: list[tuple[str, str]] | None = None
) -> tuple[list[FleetMember], list[tuple[FleetSlot, KV]]]:
    """Members and slots from the keys under PREFIX. A value that is not ours is skipped, never
    raised about: (key, why) is added to SKIPPED when it is given."""
    members, slots = [], []
    leases: dict[str, set[int]] = {}
    for kv in kvs:
        if not kv.key.startswith(prefix):
            if skipped is not None:
                skipped.append((kv.key, "outside the fleet's prefix"))
            continue
        rest = kv.key[len(prefix) :]
        try:
            if rest.startswith("replicas/"):
                member = read_member(kv.value)[0]
                members.append(member)
                leases.setdefault(member.box, set()).add(kv.lease)
            elif rest.startswith("slots/"):
                slots.append((read_slot(kv.value)[0], kv))
        except NotOurs as e:
            if skipped is not None:
                skipped.append((kv.key, str(e)))
    # Every key is read by then: whether a slot is bound to its box's lease needs the box's replicas.
    held = [(replace(s, key=kv.key[:MAX_FIELD_CHARS], not_leased=not_leased(s, kv, leases)), kv) for s, kv in slots]
    return members, held


def _reason(e: Exception, deadline: asyncio.Timeout, deadline_s: float) -> str:
    """Why the fleet could not be read, for the view and the journal."""
    if isinstance(e, TimeoutError) and deadline.expired():
        return f"etcd did not answer within {deadline_s:g} s"
    if isinstance(e, EtcdError):
        return str(e)
    return f"{type(e).__name__}: {e}"


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
        self.weights: Mapping[str, Weights | None] = {}  # this box's replicas' fingerprints, published with them
        self.down_said = False
        self.skipped_said: set[str] = set()  # keys whose value is not a guardian's, said once each
        self.skipped: dict[str, str] = {}  # of the last view: key -> why it is not a guardian's
        self.lock = asyncio.Lock()
        self.tasks: set[asyncio.Task[None]] = set()

    # --- each tick -----------------------------------------------------------------------------
    @property
    def deadline_s(self) -> float:
        """The bound on one whole step, slot request or slot release, waiting for the lock included."""
        return 2 * self.cfg.fleet.timeout_s

    async def step(self, tracks: dict[str, Track], at: Now) -> FleetView:
        failed = await self._locked(self._step(tracks, at))
        if failed is not None:  # whatever etcd sent, the tick goes on: the fleet is unreadable
            return self.unreadable(failed)
        if self.down_said:
            self.down_said = False
            self._say(Priority.INFO, "fleet: etcd answers again; this box's replicas are published again")
        return self.view

    async def _locked(self, work: Coroutine[Any, Any, None]) -> str | None:
        """Run WORK holding the lock, the wait for the lock included in one deadline (deadline_s):
        None when it went through, else why not. Nothing escapes: a step is gathered with the
        probes, and slot requests are tasks."""
        deadline_s = self.deadline_s
        deadline = asyncio.timeout(deadline_s)
        try:
            async with deadline:
                async with self.lock:
                    await work
        except Exception as e:  # noqa: BLE001 - whatever etcd sent is a reason, never an exception out
            return _reason(e, deadline, deadline_s)
        finally:
            work.close()  # never awaited when the deadline passed waiting for the lock
        return None

    def unreadable(self, reason: str) -> FleetView:
        """This tick's view when the fleet could not be read for REASON: said once, at error."""
        self.view = FleetView(self.box, False, reason[:500])
        self.published = {}  # etcd may have lost writes: everything is published again once it answers
        if not self.down_said:
            self.down_said = True
            self._say(
                Priority.ERROR,
                f"fleet: etcd cannot be reached or read ({reason[:300]}); planned restarts wait (a critical "
                "memory lowering goes ahead), hung replicas are still restarted; retried every tick",
            )
        return self.view

    async def _step(self, tracks: dict[str, Track], at: Now) -> None:
        f = self.cfg.fleet
        if self.etcd is None:
            self.etcd = make_etcd(self.cfg)
        if self.lease is not None and at.mono - self.renewed_mono >= f.lease_ttl_s / 3:
            if await self.etcd.keepalive(self.lease) > 0:
                self.renewed_mono = at.mono
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
            self.renewed_mono = at.mono
            self.published = {}
            self._say(
                Priority.INFO,
                f"fleet: box {self.box} joined fleet {f.name} on {', '.join(f.endpoints)} (lease {self.lease:x}, "
                f"ttl {f.lease_ttl_s} s)",
            )
        for r in self.cfg.replicas:
            t = tracks.get(r.name)
            state = str(t.state if t is not None else State.STARTING)
            since = at.wall - (at.mono - t.state_since) if t is not None else at.wall
            # Whether it serves, by the one definition (watchdog/judge.py serves): other boxes count it by that.
            serves = t is not None and serves_now(t, at.mono)
            w = self.weights.get(r.name)
            value = json.dumps(
                {"box": self.box, "name": r.name, "unit": r.unit, "model": r.model, "state": state, "serves": serves}
                | ({"weights": w.digest} if w is not None else {}),
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
        skipped: list[tuple[str, str]] = []
        members, self.slot_kvs = parse_view(self.box, self.prefix, kvs, skipped)
        self._say_skipped(skipped)
        self.skipped = dict(skipped)
        self.view = FleetView(self.box, True, None, tuple(members), tuple(s for s, _ in self.slot_kvs))

    def _say_skipped(self, skipped: list[tuple[str, str]]) -> None:
        new = [(k, why) for k, why in skipped if k not in self.skipped_said]
        for key, why in new[:MAX_SKIPPED_SAID]:
            self._say(
                Priority.WARNING,
                f"fleet: etcd key {key[:200]!r} ignored: {why}; it is not a guardian's, the rest of the fleet "
                "view is used",
            )
        if len(new) > MAX_SKIPPED_SAID:
            self._say(
                Priority.WARNING,
                f"fleet: {len(new) - MAX_SKIPPED_SAID} more etcd key(s) under {self.prefix} ignored: not a guardian's",
            )
        self.skipped_said = {k for k, _ in skipped}

    # --- slots ---------------------------------------------------------------------------------
    def acquire_slot(self, action: AcquireSlot) -> None:
        self._spawn(self.acquire(action.replica, action.model))

    def release_slot(self, action: ReleaseSlot) -> None:
        self._spawn(self.release(action.replica))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def acquire(self, replica: str, model: str) -> None:
        """F6: take a free slot, only if no slot was taken for MODEL since the view was read."""
        failed = await self._locked(self._acquire(replica, model))
        if failed is not None:  # the next view tells
            self._say(Priority.ERROR, f"replica {replica}: asking etcd for a fleet slot failed: {failed}", replica)

    def _slot_to_take(self) -> tuple[str, Compare] | None:
        """The slot key to take and the comparison that makes the take atomic, or None (all held).

        A slot is one of the keys slots/0 .. slots/(F.max_planned_restarts - 1): so however many
        boxes ask at once, at most that many slots are held, each key taken by one transaction that
        compares it as it was read. Held means what the view reads as a guardian's slot (parse_view,
        one rule for both): a key there that is not one (garbage) holds no slot. Its index is free,
        but the key exists, so it is taken over by comparing its revision as read (written again or
        deleted since: the transaction fails, and the next view tells); a key absent in the view is
        taken only if it was never created since. Absent keys are taken first: garbage is written
        over only when the fleet would otherwise wait on it."""
        held = {kv.key for _, kv in self.slot_kvs}
        keys = [f"{self.prefix}slots/{i}" for i in range(self.cfg.fleet.max_planned_restarts)]
        for key in keys:
            if key not in self.kvs:
                return key, Compare(key, "CREATE", "EQUAL", 0)
        for key in keys:
            if key not in held:
                return key, Compare(key, "MOD", "EQUAL", self.kvs[key].mod_revision)
        return None

    async def _acquire(self, replica: str, model: str) -> None:
        if self.etcd is None or self.lease is None or not self.view.ok:
            return
        found = self._slot_to_take()
        if found is None:
            return
        key, compare = found
        epoch = f"{self.prefix}models/{model}"
        seen = self.kvs.get(epoch)
        value = json.dumps({"box": self.box, "replica": replica, "model": model, "since": round(self.clock().wall, 3)})
        ok = await self.etcd.txn(
            [compare, Compare(epoch, "MOD", "EQUAL", seen.mod_revision if seen else 0)],
            [put_op(key, value, self.lease), put_op(epoch, value)],
        )
        if not ok:
            return
        said = f"replica {replica}: fleet slot {key.rsplit('/', 1)[1]} taken for a planned restart"
        if compare.target == "CREATE":
            self._say(Priority.INFO, f"{said} ({fleet_rules.ASK_SLOT.id})", replica)
            return
        why = self.skipped.get(key, "not a guardian's")
        self._say(
            Priority.WARNING,
            f"{said} ({fleet_rules.ASK_SLOT.id}): its etcd key {key[:200]!r} held no guardian's slot ({why}); "
            "taken over, the value there written over",
            replica,
        )

    async def release(self, replica: str) -> None:
        """F7: delete this box's slot of REPLICA, if it is still the one we read."""
        failed = await self._locked(self._release(replica))
        if failed is not None:  # the lease frees the slot at worst
            self._say(Priority.ERROR, f"replica {replica}: giving its fleet slot back failed: {failed}", replica)

    async def _release(self, replica: str) -> None:
        if self.etcd is None:
            return
        for slot, kv in self.slot_kvs:
            if slot.box == self.box and slot.replica == replica:
                await self.etcd.txn([Compare(kv.key, "MOD", "EQUAL", kv.mod_revision)], [delete_op(kv.key)])

    async def close(self) -> None:
        """At a graceful stop: this box leaves the fleet view at once (its lease is revoked)."""
        for t in list(self.tasks):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, self.deadline_s)
        if self.etcd is not None:
            if self.lease is not None:
                with contextlib.suppress(Exception):  # unanswered: the lease expires by itself
                    await asyncio.wait_for(self.etcd.revoke(self.lease), self.cfg.fleet.timeout_s)
            await self.etcd.aclose()

    def _say(self, priority: Priority, text: str, replica: str | None = None) -> None:
        r = self.cfg.replica(replica) if replica else None
        self.journal.line(LogLine(priority, text, Decision.FLEET, replica, r.unit if r else None))


class Fleet:
    """The daemon's fleet part: this box's membership (a FleetSync; None while [fleet] is off)
    across reloads. A reload that changes [fleet] leaves the fleet, its lease revoked in the
    background and waited for at stop, and joins anew with the new settings at the next step."""

    def __init__(self, cfg: Config, journal: Any, clock: Callable[[], Now]) -> None:
        self.journal = journal
        self.clock = clock
        self.membership = FleetSync(cfg, journal, clock) if cfg.fleet.enabled else None
        self.leaving: set[asyncio.Future[None]] = set()

    def publish_weights(self, found: Mapping[str, Weights | None]) -> None:
        """This box's replicas' fingerprints, published with them at the next step."""
        if self.membership is not None:
            self.membership.weights = dict(found)

    async def beside(self, observing: Awaitable[TickObservation], tracks: dict[str, Track], at: Now) -> TickObservation:
        """OBSERVING, with this tick's fleet view read beside it: neither waits for the other."""
        obs, view = await asyncio.gather(observing, self.step(tracks, at))
        return replace(obs, fleet=view)

    async def step(self, tracks: dict[str, Track], at: Now) -> FleetView | None:
        """This tick's fleet view (None: no fleet). Whatever the step raises (it should catch
        everything itself) is an unreadable fleet for this tick, said once, never a tick abandoned,
        which would stop the watchdog's pings and have systemd restart guardian over something etcd
        sent."""
        if self.membership is None:
            return None
        try:
            return await self.membership.step(tracks, at)
        except Exception as e:  # noqa: BLE001 - planned restarts wait (F3); the tick acts on everything else
            return self.membership.unreadable(f"{type(e).__name__}: {e}")

    def acquire_slot(self, action: AcquireSlot) -> None:
        if self.membership is not None:
            self.membership.acquire_slot(action)

    def release_slot(self, action: ReleaseSlot) -> None:
        if self.membership is not None:
            self.membership.release_slot(action)

    def reload(self, cfg: Config) -> None:
        if self.membership is not None and cfg.fleet != self.membership.cfg.fleet:
            self.leaving.add(asyncio.ensure_future(self.membership.close()))
            self.membership = None
        if self.membership is not None:
            self.membership.cfg = cfg
        elif cfg.fleet.enabled:
            self.membership = FleetSync(cfg, self.journal, self.clock)

    async def stop(self, timeout_s: float) -> int:
        """This box leaves the fleet view (its lease revoked), and the fleets left on reload finish
        leaving, within TIMEOUT_S in all; what is still under way then counts as cut short."""
        deadline_mono = time.monotonic() + timeout_s
        if self.membership is not None:
            try:
                await asyncio.wait_for(self.membership.close(), timeout_s)
            except TimeoutError:
                return 1 + len(self.leaving)
        if not self.leaving:
            return 0
        _done, pending = await asyncio.wait(self.leaving, timeout=max(0.0, deadline_mono - time.monotonic()))
        return len(pending)


def read_deadline_s(cfg: Config) -> float:
    """The bound on `guardian status --fleet` and check's read: every endpoint gets its turn."""
    return cfg.fleet.timeout_s * max(2, len(cfg.fleet.endpoints))


@dataclass(frozen=True)
class FleetRead:
    """One read of the fleet by a command: what `guardian status --fleet` shows (STATUS), and the
    members as the daemon's view holds them (parse_view), for `guardian check`'s W3."""

    status: dict[str, Any]
    members: tuple[FleetMember, ...]


async def fleet_status(cfg: Config) -> dict[str, Any]:
    """The fleet view as `guardian status --fleet` shows it (fleet_read)."""
    return (await fleet_read(cfg)).status


async def fleet_read(cfg: Config) -> FleetRead:
    """The fleet view as `guardian status --fleet` shows it: boxes, replicas and states, slots and
    their holders, read from etcd with this box's config, within read_deadline_s; and its members.
    Raises EtcdError (etcd unreachable, slow or answering garbage) or OSError (the password file)."""
    deadline_s = read_deadline_s(cfg)
    etcd = make_etcd(cfg)
    prefix = f"/guardian/{cfg.fleet.name}/"
    try:
        async with asyncio.timeout(deadline_s):
            revision, kvs = await etcd.range_prefix(prefix)
    except TimeoutError as e:  # each endpoint's own timeout is caught inside: this is the whole read's
        raise EtcdError(f"etcd did not answer within {deadline_s:g} s") from e
    finally:
        await etcd.aclose()
    # The daemon's parse (parse_view): what it skips is ignored here, and a slot is held here as there.
    skipped: list[tuple[str, str]] = []
    members, held = parse_view("", prefix, kvs, skipped)
    ignored = [{"key": key[:MAX_FIELD_CHARS], "why": why} for key, why in skipped]
    slots = [
        _scalars(read_slot(kv.value)[1])
        | {"slot": kv.key[len(prefix) + len("slots/") :][:MAX_FIELD_CHARS], "key": s.key}
        | ({"not_leased": s.not_leased} if s.not_leased else {})
        for s, kv in held
    ]
    boxes: dict[str, dict[str, Any]] = {}
    skipped_keys = {key for key, _ in skipped}
    for kv in kvs:
        if kv.key.startswith(f"{prefix}replicas/") and kv.key not in skipped_keys:
            m, data = read_member(kv.value)
            boxes.setdefault(m.box, {})[m.name] = _scalars(data)
    status = {
        "fleet": cfg.fleet.name,
        "endpoints": cfg.fleet.endpoints,
        "revision": revision,
        "max_planned_restarts": cfg.fleet.max_planned_restarts,
        "min_serving": cfg.fleet.min_serving,
        "boxes": boxes,
        "slots": slots,
        "ignored": ignored,
    }
    return FleetRead(status, tuple(members))
