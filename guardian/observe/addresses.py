"""Where a replica's URL leads (issue 41 item 1): its host resolved as its HTTP client resolves
it, and the one address that guardian's probes, its canaries, the kernel's view, L4 and G7 then
all use, so that what guardian judges is what its probes reached.

A name is resolved with getaddrinfo, as asyncio's and httpx's connections resolve it (/etc/hosts,
then DNS), every address in the order a client tries them: stock Debian's `::1 localhost` makes a
connection to `localhost` try [::1] first, and another user's listener on [::1]:P then answers
for the replica. For each address, the listener that a connection to it reaches (sockets.serving:
the address itself, then its family's wildcard). guardian connects to the first address whose
listener is the replica's unit's, else to the first whose listener may be its own (a container
engine's, socket activation's, unnamed: _plausible), else to the first one that has a listener
(where a client would land), else to the first address. A name whose addresses lead to different holders is a hazard:
clients of that name may reach another's server (said once, and by `guardian check`).

Lookups run on a thread of their own (never the default executor, which a hung resolver would
fill), at most one per host at a time; a tick waits RESOLVE_WAIT_S for one, then uses the last
answer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..config import Config, ReplicaConfig
from .sockets import (
    Listener,
    cgroup_dirs,
    cgroup_mounts,
    listener_table,
    netlink_listener_table,
    serving,
    unit_of_cgroup,
)

RESOLVE_WAIT_S = 1.0  # a tick's wait for a name's lookup with no earlier answer (/etc/hosts: microseconds)
QUICK_WAIT_S = 0.1  # ... and with one: a resolver that hangs must not slow every tick by a second
HOLDERS_WALK_EVERY_S = 10.0  # the cgroup tree is walked (to name a listener's holder) at most this often
MAX_ADDRESSES = 16  # addresses of one name that are looked at (a client rarely tries more)

Lookup = Callable[[str, int], list[str]]


def getaddrinfo_lookup(host: str, port: int) -> list[str]:
    """HOST's addresses in the order a TCP client tries them (getaddrinfo's, RFC 6724 sorted)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out: list[str] = []
    for _family, _type, _proto, _name, sockaddr in infos:
        address = str(sockaddr[0])
        if "%" in address:  # a scoped (link-local) address: never a replica's loopback or its own
            continue
        if address not in out:
            out.append(address)
    return out[:MAX_ADDRESSES]


def literal(host: str) -> str | None:
    """HOST as an IP address, if it is one (an IPv4-mapped IPv6 address as IPv4)."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


@dataclass(frozen=True)
class Resolved:
    """A host's addresses, in a client's order; ERROR says why there are none."""

    addresses: tuple[str, ...] = ()
    error: str | None = None


class Resolver:
    """Names looked up once per tick, each on a thread of its own, at most one per name at a time."""

    def __init__(self, lookup: Lookup = getaddrinfo_lookup, wait_s: float = RESOLVE_WAIT_S) -> None:
        self._lookup = lookup
        self._wait_s = wait_s
        self._last: dict[tuple[str, int], Resolved] = {}
        self._running: dict[tuple[str, int], concurrent.futures.Future[Resolved]] = {}

    def _run(self, key: tuple[str, int], done: concurrent.futures.Future[Resolved]) -> None:
        try:
            found = self._lookup(*key)
            result = Resolved(tuple(found)) if found else Resolved(error=f"{key[0]} has no address")
        except (OSError, UnicodeError) as e:
            result = Resolved(error=f"{key[0]} does not resolve: {e}"[:300])
        except BaseException as e:  # noqa: BLE001 - a lookup that fails any other way is an answer too
            result = Resolved(error=f"the lookup of {key[0]} failed: {type(e).__name__}: {e}"[:300])
        done.set_result(result)

    async def resolve(self, host: str, port: int) -> Resolved:
        ip = literal(host)
        if ip is not None:
            return Resolved((ip,))
        key = (host.lower(), port)
        running = self._running.get(key)
        if running is None:
            running = concurrent.futures.Future()
            self._running[key] = running
            threading.Thread(target=self._run, args=(key, running), daemon=True, name=f"resolve {host}").start()
        last = self._last.get(key)
        wait_s = self._wait_s if last is None else min(self._wait_s, QUICK_WAIT_S)
        try:
            result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(running)), wait_s)
        except TimeoutError:
            if last is not None:
                return last
            return Resolved(error=f"the lookup of {host} has not answered in {self._wait_s:g} s")
        self._running.pop(key, None)
        if result.addresses:  # a failed lookup is this tick's answer, never kept for the next
            self._last[key] = result
        return result


# --- the choice (pure) -------------------------------------------------------------------------


@dataclass(frozen=True)
class Place:
    """One address of a replica's host, and the listener a connection to it reaches (None: none)."""

    address: str
    listener: Listener | None
    holder: str | None = None  # the unit that made that listener, where it was looked up


@dataclass(frozen=True)
class Pin:
    """Where guardian connects for one replica: ADDRESS (None: its host did not resolve, and its
    URL is used as it is), the listener there, every place its host leads to, and why it could not
    be resolved."""

    host: str
    address: str | None
    listener: Listener | None = None
    places: tuple[Place, ...] = ()
    error: str | None = None

    @property
    def split(self) -> bool:
        """The host's addresses lead to listeners of different holders."""
        return len({_holder_key(p) for p in self.places if p.listener is not None}) > 1

    def split_text(self, unit: str) -> str:
        """What the split is, for the hazard line and `guardian check`."""
        where = "; ".join(
            f"{_bracketed(p.address)} -> {_where(p.listener)} held by {p.holder or 'an unnamed process'}"
            for p in self.places
            if p.listener is not None
        )
        chosen = next((p for p in self.places if p.address == self.address), None)
        whose = f" ({unit}'s listener)" if chosen is not None and chosen.holder == unit else ""
        return (
            f"its URL's host {self.host} leads to listeners of different holders ({where}): guardian probes "
            f"{_bracketed(self.address or '?')}{whose}; a client of that name may reach another's server: "
            "put one address in the URL"
        )


def _holder_key(p: Place) -> object:
    if p.holder is not None:
        return p.holder
    if p.listener is not None and p.listener.cgroup_id is not None:
        return p.listener.cgroup_id
    return p.listener.inode if p.listener is not None else None


def _bracketed(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _where(x: Listener) -> str:
    return f"{_bracketed(x.address or '?')}:{x.port}"


def choose(host: str, resolved: Resolved, table: Sequence[Listener], port: int, rank: Callable[[Place], int]) -> Pin:
    """The pin of a replica whose URL names HOST:PORT, from its RESOLVED addresses and the
    listening sockets (TABLE): the first address whose listener ranks lowest (RANK: 0 the
    replica's own), else the first address."""
    if not resolved.addresses:
        return Pin(host, None, error=resolved.error)
    places = tuple(Place(a, serving(table, a, port)) for a in resolved.addresses)
    return _pick(host, places, rank)


def _pick(host: str, places: tuple[Place, ...], rank: Callable[[Place], int]) -> Pin:
    """The first heard place of the lowest RANK (0: the replica's own), else the first place."""
    heard = [p for p in places if p.listener is not None]
    chosen = min(heard, key=rank) if heard else places[0]  # min keeps the first of equal rank
    return Pin(host, chosen.address, chosen.listener, places)


# Holders a replica's own listener may have other than its unit: a container engine's (docker-proxy
# in docker.service, a container's scope, conmon's), systemd's socket activation (init.scope), or
# none named (the root cgroup, no cgroup v2). Any other unit's listener is another's.
_ENGINE_UNITS = frozenset({"docker.service", "containerd.service", "init.scope"})


def _plausible(holder: str | None) -> bool:
    if holder is None or holder in _ENGINE_UNITS:
        return True
    return holder.endswith(".scope") and holder.startswith(("docker-", "libpod-"))


def named(places: Iterable[Place], holders: Mapping[int, str]) -> tuple[Place, ...]:
    """PLACES with each listener's holder (its cgroup's unit, HOLDERS: cgroup id -> unit)."""
    out = []
    for p in places:
        cg = p.listener.cgroup_id if p.listener is not None else None
        out.append(Place(p.address, p.listener, holders.get(cg) if cg is not None else None))
    return tuple(out)


# --- the observer ------------------------------------------------------------------------------


class Holders:
    """cgroup id -> the unit it belongs to, walked for only when an id is not known yet (cgroup ids
    are never reused: a name, once found, holds; an id not found by a walk is not walked for again)."""

    MAX_TRIED = 10_000

    def __init__(self, every_s: float = HOLDERS_WALK_EVERY_S) -> None:
        self.names: dict[int, str] = {}
        self._tried: set[int] = set()
        self._every_s = every_s
        self._walked_at: float | None = None

    def missing(self, ids: Iterable[int]) -> bool:
        """Whether a walk would name one of IDS that no walk has tried, and one may run now (a user
        who makes a cgroup for each listener cannot have the tree walked at every tick)."""
        now = time.monotonic()
        if self._walked_at is not None and now - self._walked_at < self._every_s:
            return False
        return bool(set(ids) - self.names.keys() - self._tried)

    def of(self, ids: Iterable[int]) -> Mapping[int, str]:
        """The names known of IDS, after a walk if one is missing and may run (blocking: call it
        in a thread where it may walk)."""
        wanted = set(ids)
        if self.missing(wanted):
            self._walked_at = time.monotonic()
            self.names.update(_holders())
            if len(self._tried) > self.MAX_TRIED:
                self._tried.clear()
            self._tried |= wanted - self.names.keys()
        return self.names

    def known(self, _ids: Iterable[int]) -> Mapping[int, str]:
        """The names known, never walking (on the event loop)."""
        return self.names


class Addresses:
    """Each replica's pin, once per tick (pins()); the latest is kept for the canaries and warm-ups
    the executor sends between ticks (address_of), and the listening sockets it was chosen from
    (table), for the kernel's view of the same tick."""

    def __init__(self, resolver: Resolver | None = None) -> None:
        self.resolver = resolver or Resolver()
        self.holders = Holders()
        self.latest: dict[str, Pin] = {}
        self.table: list[Listener] | None = None  # the listening sockets of the last look

    def address_of(self, name: str) -> str | None:
        pin = self.latest.get(name)
        return pin.address if pin is not None else None

    async def pins(self, cfg: Config) -> dict[str, Pin]:
        resolved = await asyncio.gather(*(self.resolver.resolve(r.host, r.port) for r in cfg.replicas))
        ports = {r.port for r in cfg.replicas}
        try:  # the kernel's listening sockets (0.1 ms) on the loop: a thread hop cost more
            self.table = netlink_listener_table(ports) if ports else []
        except OSError:  # /proc/net walks every socket on the host: in a thread
            self.table = await asyncio.to_thread(listener_table, ports)
        first = pin_all(cfg.replicas, resolved, self.table or [], self.holders.known)
        ids = {x.cgroup_id for pin in first.values() if needs_names(pin) for x in _heard(pin)}
        if self.holders.missing(i for i in ids if i is not None):  # in a thread: the walk of the cgroup tree
            await asyncio.to_thread(self.holders.of, [i for i in ids if i is not None])
            first = pin_all(cfg.replicas, resolved, self.table or [], self.holders.known)
        self.latest = first
        return self.latest


def pin_all(
    replicas: Sequence[ReplicaConfig],
    resolved: Sequence[Resolved],
    table: Sequence[Listener],
    holders: Callable[[Iterable[int]], Mapping[int, str]],
) -> dict[str, Pin]:
    """Each replica's pin; its listeners' holders are asked of HOLDERS (cgroup ids -> units) only
    for a host whose addresses lead to more than one listener."""
    out: dict[str, Pin] = {}
    for r, res in zip(replicas, resolved, strict=True):
        pin = choose(r.host, res, table, r.port, _first)
        if needs_names(pin):
            names = holders({x.cgroup_id for x in _heard(pin) if x.cgroup_id is not None})
            pin = _pick(r.host, named(pin.places, names), _rank_for(r.unit))
        out[r.name] = pin
    return out


def _heard(pin: Pin) -> list[Listener]:
    return [p.listener for p in pin.places if p.listener is not None]


def needs_names(pin: Pin) -> bool:
    """PIN's host leads to more than one listener: which is the replica's is told by their holders."""
    return len({x.inode for x in _heard(pin)}) > 1


def _first(_place: Place) -> int:
    return 0


def _rank_for(unit: str) -> Callable[[Place], int]:
    """0: the replica's unit's listener; 1: one that may be its own (_plausible); 2: another's."""
    return lambda place: 0 if place.holder == unit else 1 if _plausible(place.holder) else 2


def _holders() -> dict[int, str]:
    """cgroup id -> the unit it belongs to, for the whole cgroup2 tree."""
    root = cgroup_mounts().unified
    if root is None:
        return {}
    out: dict[int, str] = {}
    for ino, path in cgroup_dirs(root).items():
        unit = unit_of_cgroup(path)
        if unit is not None:
            out[ino] = unit
    return out


async def pin_of(r: ReplicaConfig, resolver: Resolver | None = None) -> Pin:
    """R's pin looked at now (the re-check before a restart, `guardian check`)."""
    resolved = await (resolver or Resolver()).resolve(r.host, r.port)
    table = await asyncio.to_thread(listener_table, {r.port})
    return (await asyncio.to_thread(pin_all, [r], [resolved], table or [], Holders().of))[r.name]
