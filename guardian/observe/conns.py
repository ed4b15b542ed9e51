"""The kernel's view of each replica's clients (issue 20): ConnView.

A vLLM API server under load can leave /health, /metrics and /v1/models unanswered for seconds
while its token streams keep flowing. The kernel knows: one sock_diag dump of the established TCP
sockets on the replicas' ports, with tcp_info (bytes written, acked and received, how long ago
data was last sent and received), says which clients are being answered and which wait. A
response flows when the replica's process wrote more of it since the last look (its write
sequence: bytes sent once plus bytes not yet sent), not when the kernel sends what is already
in the buffer: a frozen process's kernel goes on feeding a slow reader for minutes (issue 34). Unprivileged:
sock_diag shows every user's sockets with their tcp_info, and a socket's cgroup id (the inode of
its cgroup v2 directory) names the unit of a local peer without reading anyone's /proc/PID.

The parts: read_table (observe/netlink.py: the dump, thin, in a thread, parsed into Sock records),
classify and conn_views here (pure: socket records, the previous look's memory and who is who, to
views), ConnObserver (the two, the cgroup lookups and the unit's CPU time, look after look).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import os
import socket
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ..config import Config
from ..core.observations import ConnView, Peer, PeerKind
from .addresses import Pin
from .netlink import (
    BOTH_FAMILIES,
    MAX_SOCKETS,
    Bounds,
    Clause,
    Key,
    Sock,
    Table,
    Test,
    address_is,
    cgroup_filter_refused,
    cgroup_is,
    cgroup_is_known,
    ipv4_local,
    port_is,
    program,
    read_exact,
    read_filtered,
    read_table,
)
from .sockets import (
    CgroupMounts,
    Listener,
    SockDiagError,
    cgroup_dirs,
    cgroup_mounts,
    cgroup_v2_path,
    listener_table,
    serving,
    takes,
    unit_of_cgroup,
)

MAX_PEERS = 16  # peers named per replica
CpuSample = tuple[int, float]  # (inode of the unit's cgroup directory, CPU seconds it has used)

# --- who is at the other end (pure) ------------------------------------------------------------


def _normal(peer: str) -> str:
    """An address as the kernel's side is written (IPv4-mapped as IPv4); a unit name unchanged."""
    try:
        ip = ipaddress.ip_address(peer)
    except ValueError:
        return peer
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return str(mapped or ip)


@dataclass(frozen=True)
class Who:
    """What names the peers: cgroup id -> path, guardian's own cgroup and sockets, and the units
    and addresses that are proxies or monitoring; and whose the server-side sockets are: the
    listener that serves each replica's URL (sockets.serving; None: nothing does), of which only
    the sockets it accepted are the replica's (None as a whole: every socket on its port)."""

    cgroups: Mapping[int, str] = field(default_factory=dict)
    guardian_cgroup: str | None = None  # guardian's unit's cgroup path ("/system.slice/guardian.service")
    guardian_sockets: frozenset[int] = frozenset()  # inodes of guardian's own sockets
    proxy: frozenset[str] = frozenset()  # units and addresses
    monitoring: frozenset[str] = frozenset()
    listeners: Mapping[str, Listener | None] | None = None

    @classmethod
    def of(
        cls,
        cfg: Config,
        cgroups: Mapping[int, str] | None = None,
        guardian_cgroup: str | None = None,
        guardian_sockets: frozenset[int] = frozenset(),
        listeners: Mapping[str, Listener | None] | None = None,
    ) -> Who:
        proxy = {_normal(p) for p in cfg.watchdog.proxy_peers}
        if cfg.proxy.nginx_upstream_dir is not None:  # guardian drives nginx on this box (core/proxy/bypass.py B1)
            proxy.add(cfg.proxy.nginx_unit)
        return cls(
            cgroups=cgroups or {},
            guardian_cgroup=guardian_cgroup,
            guardian_sockets=guardian_sockets,
            proxy=frozenset(proxy),
            monitoring=frozenset(_normal(p) for p in cfg.watchdog.monitoring_peers),
            listeners=listeners,
        )


def classify(server: Sock, client: Sock | None, who: Who) -> tuple[PeerKind, str]:
    """The peer of SERVER, a socket on a replica's port; CLIENT is the socket at the other end
    when it is on this machine. Named by its unit when the kernel tells it, else by address."""
    unit: str | None = None
    mine = False
    if client is not None:
        path = who.cgroups.get(client.cgroup_id) if client.cgroup_id is not None else None
        unit = unit_of_cgroup(path) if path is not None else None
        g = who.guardian_cgroup
        mine = (client.inode != 0 and client.inode in who.guardian_sockets) or (
            g is not None and path is not None and (path == g or path.startswith(g + "/"))
        )
    name = unit or server.remote
    if mine:
        return PeerKind.GUARDIAN, name
    names = {server.remote} if unit is None else {server.remote, unit}
    if names & who.proxy:
        return PeerKind.PROXY, name
    if names & who.monitoring:
        return PeerKind.MONITORING, name
    return PeerKind.OTHER, name


# --- views (pure) ------------------------------------------------------------------------------


class Seen(NamedTuple):
    """A server-side socket at the previous look."""

    inode: int  # so that a 4-tuple reused by a new connection is not taken for the old one
    acked: int  # tcpi_bytes_acked
    moving: bool = False  # a response moved in the interval before that look, the client silent
    received: int | None = None  # tcpi_bytes_received
    segs_out: int | None = None  # tcpi_data_segs_out
    written: int | None = None  # Sock.bytes_written


@dataclass(frozen=True)
class Memory:
    """The previous look: its time, and each server-side socket then."""

    at: float | None = None
    sockets: Mapping[Key, Seen] = field(default_factory=dict)


_CLIENTS = (PeerKind.PROXY, PeerKind.OTHER)
_KIND_ORDER = {k: i for i, k in enumerate(PeerKind)}


@dataclass
class _Tally:
    connections: int = 0
    flowing: int = 0
    bytes_out: int = 0
    waiting: int = 0
    waits_ms: list[int] = field(default_factory=list)
    last_flow_ms: int | None = None
    peers: dict[tuple[PeerKind, str], int] = field(default_factory=dict)


def _same(s: Sock, before: Seen | None) -> Seen | None:
    """BEFORE if it was this connection (not another one on the same 4-tuple)."""
    return before if before is not None and before.inode in (0, s.inode) else None


def _moving(s: Sock, before: Seen | None, since_s: float | None) -> int:
    """Bytes the server's process wrote on S since the previous look, while the peer acked some
    and the client sent nothing (0 if not). Both: a frozen process's kernel still sends (and the
    peer acks) its buffer, and a send that failed below TCP (a full qdisc, a firewall's DROP) is
    counted in tcpi_bytes_sent again when the kernel retries it. On a kernel that does not say
    what was written (Linux < 4.19): the bytes acked."""
    if since_s is None or before is None or s.bytes_acked is None or s.last_recv_ms is None:
        return 0
    delta = s.bytes_acked - before.acked
    if s.bytes_written is not None and before.written is not None:
        delta = s.bytes_written - before.written if delta > 0 else 0
    return delta if delta > 0 and s.last_recv_ms >= since_s * 1000 else 0


def _flowed(s: Sock, before: Seen | None, moved: int) -> int:
    """Bytes of a response that flowed on S since the previous look: it moved in this interval and
    in the one before, the client silent throughout. A quick answer to a request that happened to
    span one look (a dead engine's 500, a stream's 200 headers sent by the API server alone) is
    not a response flowing; a token stream is, from its third look on."""
    return moved if moved and before is not None and before.moving else 0


def _waits(s: Sock, before: Seen | None) -> bool:
    """The client spoke last: its request has had no byte of answer since. The two times are
    jiffies: a server socket's both start when it is accepted, so a request sent with the
    connection's first ACK leaves them equal; then the client spoke last if the server never sent
    data (an answer in the same jiffy as the request leaves them equal too, with data sent). On a
    kept-alive connection a request sent within the jiffy of the last answer leaves them equal as
    well: then the client spoke last if it sent more since the previous look and no data segment
    went out since."""
    recv, sent = s.last_recv_ms, s.last_sent_ms
    if recv is None or sent is None:
        return False
    if recv != sent:
        return recv < sent
    never_sent = s.data_segs_out == 0 if s.data_segs_out is not None else s.bytes_acked == 0
    if never_sent and bool(s.bytes_received):
        return True
    return (
        before is not None
        and s.bytes_received is not None
        and before.received is not None
        and s.bytes_received > before.received
        and s.data_segs_out is not None
        and s.data_segs_out == before.segs_out
    )


def local_peers(socks: Iterable[Sock], ports: Iterable[int]) -> list[Sock]:
    """The client-side sockets at the other end of the server-side ones on PORTS (local peers)."""
    ports = frozenset(ports)
    servers = {s.peer_key for s in socks if s.lport in ports}
    return [s for s in socks if s.rport in ports and s.key in servers]


def accepted_by(s: Sock, listener: Listener | None) -> bool:
    """Whether the server-side socket S came from LISTENER: its local address is one the listener
    is bound to (the address itself, or its family's wildcard; "::" takes IPv4 too), and, where
    the kernel gives both, its cgroup is the listener's (an accepted socket takes its listener's).
    Another user's listener on the port at another address ([::1] beside 0.0.0.0, 127.0.0.2
    beside 127.0.0.1) makes sockets that are never the replica's (issue 34)."""
    if listener is None:
        return False
    if s.cgroup_id is not None and listener.cgroup_id is not None and s.cgroup_id != listener.cgroup_id:
        return False
    return takes(listener, s.local)


def _owned(
    socks: Iterable[Sock], replicas: Sequence[tuple[str, int]], listeners: Mapping[str, Listener | None] | None
) -> Iterator[tuple[str, Sock]]:
    """(replica, socket) for each server-side socket that is a replica's (accepted_by)."""
    on_port: dict[int, list[str]] = {}
    for name, port in replicas:
        on_port.setdefault(port, []).append(name)
    for s in socks:
        names = on_port.get(s.lport, ())
        owner = next((n for n in names if listeners is None or accepted_by(s, listeners.get(n))), None)
        if owner is not None:
            yield owner, s


def conn_views(
    table: Table,
    replicas: Sequence[tuple[str, int]],
    who: Who,
    prev: Memory,
    now: float,
    cpu: Mapping[str, float | None] | None = None,
) -> tuple[dict[str, ConnView], Memory]:
    """Each replica's ConnView (REPLICAS: (name, port)) from the sockets of one look at NOW
    (monotonic seconds), and the memory for the next look. CPU: each replica's CPU seconds
    since the previous look, None or absent where unknown. A socket is a replica's by
    who.listeners (see Who)."""
    socks, truncated = table.socks, table.truncated
    ports = {port for _name, port in replicas}
    clients = {s.key: s for s in socks if s.rport in ports}
    since_s = None if prev.at is None else max(0.0, now - prev.at)
    sockets: dict[Key, Seen] = {}
    tallies: dict[str, _Tally] = {}
    for owner, s in _owned(socks, replicas, who.listeners):
        kind, name = classify(s, clients.get(s.peer_key), who)
        t = tallies.setdefault(owner, _Tally())
        t.connections += 1
        t.peers[kind, name] = t.peers.get((kind, name), 0) + 1
        before = _same(s, prev.sockets.get(s.key))
        moved = _moving(s, before, since_s)
        if s.bytes_acked is not None:
            sockets[s.key] = Seen(s.inode, s.bytes_acked, moved > 0, s.bytes_received, s.data_segs_out, s.bytes_written)
        if kind not in _CLIENTS:
            continue
        flowed = _flowed(s, before, moved)
        if flowed:
            t.flowing += 1
            t.bytes_out += flowed
            sent_ms = s.last_sent_ms if s.last_sent_ms is not None else 0
            t.last_flow_ms = sent_ms if t.last_flow_ms is None else min(t.last_flow_ms, sent_ms)
        if _waits(s, before):
            t.waiting += 1
            t.waits_ms.append(s.last_recv_ms or 0)
    views: dict[str, ConnView] = {}
    for name, _port in replicas:
        t = tallies.get(name, _Tally())
        ranked = sorted(t.peers.items(), key=lambda kv: (_KIND_ORDER[kv[0][0]], -kv[1], kv[0][1]))
        views[name] = ConnView(
            connections=t.connections,
            flowing=t.flowing,
            bytes_out=t.bytes_out,
            waiting=t.waiting,
            since_s=since_s,
            cpu_s=(cpu or {}).get(name),
            peers=tuple(Peer(kind, peer, n) for (kind, peer), n in ranked[:MAX_PEERS]),
            truncated=truncated,
            last_flow_s=t.last_flow_ms / 1000 if t.last_flow_ms is not None else None,
            at=now,
            waits_s=tuple(ms / 1000 for ms in sorted(t.waits_ms, reverse=True)[:MAX_PEERS]),
        )
    return views, Memory(at=now, sockets=sockets)


# --- what the kernel is asked for (pure) -------------------------------------------------------

MAX_SHADOWED = 64  # other listeners' addresses a wildcard listener's clause leaves out
MAX_PEER_PLACES = 64  # local addresses of accepted sockets whose local peers are asked for by address
_WILDCARDS = frozenset({"0.0.0.0", "::"})


def server_clause(listener: Listener, table: Iterable[Listener]) -> list[Test]:
    """The sockets LISTENER accepted (issue 41 item 3): on its port, made in its cgroup (an accepted
    socket takes its listener's; Linux >= 5.10 filters on it), at its address, or, for a wildcard,
    in its family and at none of the addresses that other listeners on the port are bound to. So
    another user's sockets on the port, however many, are never sent and never fill the look."""
    tests = port_is(listener.port)
    if listener.cgroup_id is not None and cgroup_is_known():
        tests.append(cgroup_is(listener.cgroup_id))
    if not listener.address:
        return tests
    if listener.address not in _WILDCARDS:
        return [*tests, address_is(listener.address)]
    if listener.address == "0.0.0.0":
        tests.append(ipv4_local())
    others = sorted({x.address for x in table if x.port == listener.port and x.address and x.address not in _WILDCARDS})
    return tests + [address_is(a, negated=True) for a in others[:MAX_SHADOWED]]


def peer_clauses(servers: Iterable[Sock]) -> list[Clause]:
    """The client-side sockets of local peers of SERVERS (their remote end is a server socket's
    local address and port), asked for by address where there are at most MAX_PEER_PLACES of them."""
    places = sorted({(s.lport, s.local) for s in servers})
    if len(places) <= MAX_PEER_PLACES:
        return [[*port_is(port, local=False), address_is(local, local=False)] for port, local in places]
    # Many addresses (a local user connecting through each of 127.0.0.0/8): IPv4 loopback as one
    # prefix per port; the rest by port alone.
    out: list[Clause] = []
    for port in sorted({port for port, _ in places}):
        out.append([*port_is(port, local=False), address_is("127.0.0.0", local=False, prefix_len=8)])
        if any(p == port and not local.startswith("127.") for p, local in places):
            out.append(port_is(port, local=False))
    return out


def read_owned(listeners: Iterable[Listener | None], table: Sequence[Listener], limit: int = MAX_SOCKETS) -> Table:
    """The sockets that LISTENERS accepted, and their local peers' ends: a filtered dump, then the
    peers' ends each looked up by its 4-tuple (peer_ends), or where that could miss one, or there
    are more than MAX_LOOKUPS, a second filtered dump; at most LIMIT messages together. Raises OSError."""
    mine = list({x.inode: x for x in listeners if x is not None}.values())
    if not mine:
        return Table(())
    ports = frozenset(x.port for x in mine)
    # A listener's accepted sockets are of its own family (an IPv6 one's IPv4 clients are mapped):
    # the kernel walks its whole table for each family dumped.
    families = [f for f in BOTH_FAMILIES if any(x.family == f for x in mine)]
    try:
        servers = read_filtered(program([server_clause(x, table) for x in mine]), ports, Bounds(limit), families)
    except SockDiagError as e:
        if e.errno != errno.EINVAL or not cgroup_is_known():
            raise
        cgroup_filter_refused()  # a kernel older than 5.10: the address tests and accepted_by remain
        servers = read_filtered(program([server_clause(x, table) for x in mine]), ports, Bounds(limit), families)
    if servers.truncated or not servers.socks:
        return servers
    left = max(1, limit - len(servers.socks))
    # The peers' ends are of their server ends' family (an IPv4 client of an IPv6 listener: IPv4);
    # each family dumped costs a walk of the kernel's whole table (14 ms measured on a 24 GiB box).
    peer_families = [f for f in BOTH_FAMILIES if any((":" in s.local) == (f == socket.AF_INET6) for s in servers.socks)]
    if len(servers.socks) <= min(left, MAX_LOOKUPS):
        found = peer_ends(servers.socks, peer_families)
        if found is not None:
            return Table(servers.socks + tuple(found))
    peers = read_filtered(program(peer_clauses(servers.socks)), ports, Bounds(left), peer_families)
    # The peers' ends only name the clients: a partial read of them leaves those unnamed (named by
    # address), never the replica's own view partial.
    return Table(servers.socks + peers.socks)


# Server ends whose peers' ends are looked up one by one (about 15 us each) rather than dumped (a
# walk of the kernel's whole established table: 1.5-4 ms on a 24 GiB box, twice that from 48 GiB).
MAX_LOOKUPS = 256
MAX_UNFOUND_PLACES = 32  # addresses of peers not found, each asked whether it is this box's


def peer_ends(servers: Sequence[Sock], families: Sequence[int]) -> list[Sock] | None:
    """The local peers' ends of SERVERS that the filtered dump of FAMILIES finds (peer_clauses,
    then local_peers), each looked up by its 4-tuple instead: no walk of the kernel's table. None
    where the lookups could miss one that the dump finds: a lookup refused otherwise than "none
    there", or a peer not there at an address of this box whose server end is still established
    (a client socket bound to a device, or to an IPv6 link-local address, is not found by its
    4-tuple alone): then the caller dumps. Not there at an address that is not this box's: a
    remote client, no local peer; nor where its connection closed since the server end was read
    (guardian's own probes, often: a look's walk of the table takes longer than they do).
    Raises OSError."""
    out: list[Sock] = []
    unfound: list[Sock] = []
    for server, got in zip(servers, read_exact([s.peer_key for s in servers]), strict=True):
        if isinstance(got, int):
            if got != errno.ENOENT:
                return None
            unfound.append(server)
        elif got.established and got.family in families:
            out.append(got.sock)
    places = {s.remote for s in unfound}
    if len(places) > MAX_UNFOUND_PLACES:
        return None
    local = {a for a in places if is_local(a)}
    if not closed_since([s for s in unfound if s.remote in local]):
        return None
    return out


def closed_since(servers: Sequence[Sock]) -> bool:
    """Whether each of SERVERS, server ends whose peers' ends were not there at an address of this
    box, has closed since it was read: no longer established, or gone (unless bound to a device,
    where a lookup by 4-tuple alone does not find it). Its peer's end then is no established socket
    either, as a dump would find; else (one still established) that end must be bound to a device."""
    if any(s.bound_if for s in servers):
        return False
    for got in read_exact([s.key for s in servers]) if servers else ():
        if isinstance(got, int) and got != errno.ENOENT:
            return False
        if not isinstance(got, int) and got.established:
            return False
    return True


def is_local(address: str) -> bool:
    """Whether ADDRESS may be one of this box's own: a socket can be bound to it (any address, with
    net.ipv4.ip_nonlocal_bind set); an IPv6 link-local one, which needs its interface, is taken to be."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((address, 0))
    except OSError as e:
        return e.errno != errno.EADDRNOTAVAIL
    return True


def read_sockets(
    ports: Iterable[int], listeners: Iterable[Listener | None], table: Sequence[Listener] | None, limit: int
) -> Table:
    """The replicas' sockets of one look: those their LISTENERS accepted and their local peers'
    (read_owned); without the listening sockets (TABLE None: unreadable), every socket on PORTS."""
    if table is None:
        return read_table(ports, limit)
    return read_owned(listeners, table, limit)


# --- a unit's CPU time (pure parts) ------------------------------------------------------------


def parse_cpu_stat(text: str) -> float | None:
    """CPU seconds from a cgroup v2 cpu.stat (usage_usec)."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "usage_usec":
            try:
                return int(value) / 1e6
            except ValueError:
                return None
    return None


def parse_cpuacct_usage(text: str) -> float | None:
    """CPU seconds from a cgroup v1 cpuacct.usage (ns)."""
    try:
        return int(text.strip()) / 1e9
    except ValueError:
        return None


def cpu_delta(before: CpuSample | None, after: CpuSample | None) -> float | None:
    """CPU seconds used between two samples of a unit's cgroup; None if either is unknown or the
    cgroup is not the same one (the unit was restarted: a new directory)."""
    if before is None or after is None or before[0] != after[0] or after[1] < before[1]:
        return None
    return after[1] - before[1]


def guardian_cgroup_of(text: str) -> str | None:
    """Guardian's unit's cgroup (v2) path from /proc/self/cgroup's TEXT; None outside a unit (a
    shell, the root cgroup), where a cgroup would name others as well."""
    path = cgroup_v2_path(text)
    unit = unit_of_cgroup(path) if path is not None else None
    if path is None or unit is None:
        return None
    parts = path.strip("/").split("/")
    last = max(i for i, part in enumerate(parts) if part == unit)
    return "/" + "/".join(parts[: last + 1])


def own_sockets(peers: Sequence[Sock], cgroups: Mapping[int, str], guardian_cgroup: str | None) -> frozenset[int]:
    """The inodes of guardian's own sockets, where classify needs them for PEERS: not where each
    peer's cgroup is known and guardian's too, which say alone whether it is guardian's (a socket
    is made in its maker's cgroup; guardian's are in its unit's). Reading /proc/self/fd costs a
    readlink per open descriptor."""
    decided = guardian_cgroup is not None and all(p.cgroup_id is not None and p.cgroup_id in cgroups for p in peers)
    return frozenset() if decided or not peers else own_socket_inodes()


def own_socket_inodes(fd_dir: str = "/proc/self/fd") -> frozenset[int]:
    """The inodes of this process's sockets."""
    out: set[int] = set()
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return frozenset()
    for name in names:
        try:
            target = os.readlink(f"{fd_dir}/{name}")
        except OSError:
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            with contextlib.suppress(ValueError):
                out.add(int(target[8:-1]))
    return frozenset(out)


# --- the observer ------------------------------------------------------------------------------


class _Tree:
    """One cgroup hierarchy: inode -> path, walked again at most once a look when a cgroup id or a
    unit is not in it. An id still missing after a walk is a cgroup removed since (ids are never
    reused; a socket keeps its cgroup's id): it is not looked for again."""

    def __init__(self, root: str | None) -> None:
        self.root = root
        self.dirs: dict[int, str] = {}
        self._units: dict[str, str] = {}
        self._gone: set[int] = set()
        self._walked = False
        self._absent: dict[str, int] = {}  # unit -> looks left before its cgroup is searched for again
        self._looks = 0

    def new_look(self) -> None:
        self._walked = False
        self._looks += 1

    def _walk(self) -> bool:
        if self.root is None or self._walked:
            return False
        self._walked = True
        self.dirs = cgroup_dirs(self.root)
        return True

    def paths(self, ids: Iterable[int]) -> Mapping[int, str]:
        unknown = {i for i in ids if i not in self.dirs and i not in self._gone}
        if unknown and self._walk():
            if len(self._gone) > _MAX_GONE:
                self._gone.clear()
            self._gone |= unknown - self.dirs.keys()
        return self.dirs

    def unit_path(self, unit: str) -> str | None:
        """The cgroup path of UNIT (system.slice/UNIT, or wherever its slice puts it)."""
        if self.root is None:
            return None
        for path in (self._units.get(unit), f"/system.slice/{unit}"):
            if path is not None and os.path.isdir(self.root + path):
                self._units[unit] = path
                return path
        if self._absent.get(unit, -1) > self._looks:
            return None  # a stopped or crash-looping unit has no cgroup: not walked for at every look
        while True:
            named = sorted((p for p in self.dirs.values() if p.rsplit("/", 1)[-1] == unit), key=len)
            found = next((p for p in named if os.path.isdir(self.root + p)), None)
            if found is not None:
                self._units[unit] = found
                self._absent.pop(unit, None)
                return found
            if not self._walk():
                self._absent[unit] = self._looks + ABSENT_LOOKS
                return None


_MAX_GONE = 10_000
# A unit with no cgroup (stopped) is searched for again (a walk of the whole tree) every this many
# looks, not at every one; system.slice/UNIT, where nearly every unit is, is still tried each look.
ABSENT_LOOKS = 15


def _read(path: str) -> tuple[int, str] | None:
    """(inode of the file's directory, the file's text)."""
    try:
        ino = os.stat(os.path.dirname(path)).st_ino
        with open(path) as f:
            return ino, f.read(4096)
    except OSError:
        return None


class ConnObserver:
    """The kernel's view of each replica's connections, look after look (the daemon's tick); two
    looks at once run one after the other."""

    def __init__(
        self,
        recognise_self: bool = True,
        mounts: CgroupMounts | None = None,
        proc_self_cgroup: str = "/proc/self/cgroup",
        limit: int = MAX_SOCKETS,
    ) -> None:
        # Why the kernel's view could not be had at the last look (None: it could). The caller
        # says it once, when it changes.
        self.unavailable: str | None = None
        # Replica -> the unit whose cgroup does its work, where not its own (a Docker container's scope).
        self.cpu_units: dict[str, str] = {}
        self._recognise_self = recognise_self
        self._mounts = mounts
        self._proc_self_cgroup = proc_self_cgroup
        self._limit = limit
        self._memory = Memory()
        self._cpu: dict[str, CpuSample] = {}
        self._v2: _Tree | None = None
        self._v1: _Tree | None = None
        self._guardian_cgroup: str | None = None
        self._lock = threading.Lock()  # a look abandoned by its caller still runs in its thread

    async def look(
        self,
        cfg: Config,
        mono_now: float,
        pins: Mapping[str, Pin] | None = None,
        listening: list[Listener] | None = None,
    ) -> dict[str, ConnView | None]:
        """Each replica's view at MONO_NOW (time.monotonic()), by replica name; None for every
        replica when the kernel's socket table cannot be read (self.unavailable says why). PINS:
        where each replica's URL leads (observe/addresses.py), and LISTENING the listening sockets
        they were chosen from; without them, its URL's host, and the listening sockets read here."""
        return await asyncio.to_thread(self.look_now, cfg, mono_now, pins, listening)

    def _trees(self) -> tuple[_Tree, _Tree]:
        if self._v2 is None or self._v1 is None:
            mounts = self._mounts or cgroup_mounts()
            self._v2, self._v1 = _Tree(mounts.unified), _Tree(mounts.cpuacct)
            if self._recognise_self:
                try:
                    with open(self._proc_self_cgroup) as f:
                        self._guardian_cgroup = guardian_cgroup_of(f.read())
                except OSError:
                    self._guardian_cgroup = None
        return self._v2, self._v1

    def look_now(
        self,
        cfg: Config,
        mono_now: float,
        pins: Mapping[str, Pin] | None = None,
        listening: list[Listener] | None = None,
    ) -> dict[str, ConnView | None]:
        """look, in the caller's thread."""
        with self._lock:
            return self._look(cfg, mono_now, pins or {}, listening)

    def _look(
        self, cfg: Config, mono_now: float, pins: Mapping[str, Pin], listening: list[Listener] | None
    ) -> dict[str, ConnView | None]:
        v2, v1 = self._trees()
        v2.new_look()
        v1.new_look()
        replicas = [(r.name, r.port) for r in cfg.replicas]
        ports = {port for _name, port in replicas}
        found = listening if listening is not None and pins else listener_table(ports)
        serves = {
            # A pin without an address (its host did not resolve this tick): its URL's host, as before.
            r.name: pins[r.name].listener
            if r.name in pins and pins[r.name].address is not None
            else serving(found or [], r.host, r.port)
            for r in cfg.replicas
        }
        try:
            table = read_sockets(ports, serves.values(), found, self._limit)
        except OSError as e:
            self.unavailable = f"the kernel's socket table could not be read (sock_diag: {e})"
            self._memory, self._cpu = Memory(), {}
            return {name: None for name, _port in replicas}
        old = [s for s in table.socks if s.lport in ports and (s.bytes_acked is None or s.last_recv_ms is None)]
        if old:
            self.unavailable = "the kernel sends no tcp_info with bytes acked (Linux >= 4.1 does)"
            self._memory, self._cpu = Memory(), {}
            return {name: None for name, _port in replicas}
        self.unavailable = None
        peers = local_peers(table.socks, ports)
        ids = {s.cgroup_id for s in peers if s.cgroup_id is not None}
        who = Who.of(
            cfg,
            cgroups=v2.paths(ids) if ids else {},
            guardian_cgroup=self._guardian_cgroup,
            guardian_sockets=own_sockets(peers, v2.dirs, self._guardian_cgroup)
            if self._recognise_self
            else frozenset(),
            listeners=None if found is None else serves,
        )
        cpu: dict[str, float | None] = {}
        samples: dict[str, CpuSample] = {}
        for r in cfg.replicas:
            sample = self._cpu_sample(self.cpu_units.get(r.name, r.unit), v2, v1)
            cpu[r.name] = cpu_delta(self._cpu.get(r.name), sample)
            if sample is not None:
                samples[r.name] = sample
        self._cpu = samples
        views, self._memory = conn_views(table, replicas, who, self._memory, mono_now, cpu)
        return dict(views)

    @staticmethod
    def _cpu_sample(unit: str, v2: _Tree, v1: _Tree) -> CpuSample | None:
        """The CPU time UNIT's cgroup has used: cpu.stat usage_usec (v2), else cpuacct.usage (v1)."""
        path = v2.unit_path(unit)
        if path is not None and v2.root is not None:
            got = _read(f"{v2.root}{path}/cpu.stat")
            seconds = parse_cpu_stat(got[1]) if got is not None else None
            if got is not None and seconds is not None:
                return got[0], seconds
        if v1.root is None:
            return None
        v1_path = path if path is not None and os.path.isdir(v1.root + path) else v1.unit_path(unit)
        if v1_path is None:
            return None
        got = _read(f"{v1.root}{v1_path}/cpuacct.usage")
        seconds = parse_cpuacct_usage(got[1]) if got is not None else None
        return (got[0], seconds) if got is not None and seconds is not None else None
