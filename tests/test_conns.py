"""The kernel's view of a replica's clients (observe/conns.py): real loopback sockets read back
through sock_diag, and the pure rules table by table."""

from __future__ import annotations

from pathlib import Path

import asyncio
import errno
import os
import socket
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from guardian.config import Config, ProxyConfig, ReplicaConfig, WatchdogConfig
from guardian.core.observations import ConnView, Peer, PeerKind
from guardian.observe import conns
from guardian.observe.conns import (
    MAX_PEERS,
    ConnObserver,
    Memory,
    Seen,
    Who,
    classify,
    conn_views,
    cpu_delta,
    guardian_cgroup_of,
    parse_cpu_stat,
    parse_cpuacct_usage,
)
from guardian.observe.netlink import Sock, Table, parse_sock, port_filter, read_table
from guardian.observe.sockets import DIAG_MSG_SIZE, CgroupMounts, Listener, cgroup_dirs, parse_mountinfo
from harness import NOBODY_PYTHON, as_nobody

DEADLINE_S = 5.0


def _cfg(port: int, **kw: object) -> Config:
    return Config(
        replicas=[ReplicaConfig(name="a", unit="vllm-a.service", url=f"http://127.0.0.1:{port}", model="m")],
        **kw,  # type: ignore[arg-type]
    )


def _until(what: Callable[[], object], why: str) -> object:
    """WHAT's value once it is truthy (the kernel's state, read again until then)."""
    end = time.monotonic() + DEADLINE_S
    while True:
        got = what()
        if got:
            return got
        assert time.monotonic() < end, f"timed out waiting for {why}"
        time.sleep(0.005)


class Loop:
    """A listener on loopback and connections to it, both ends in this process."""

    def __init__(self, family: int = socket.AF_INET, host: str = "127.0.0.1") -> None:
        self.srv = socket.socket(family, socket.SOCK_STREAM)
        self.srv.bind((host, 0))
        self.srv.listen()
        self.port: int = self.srv.getsockname()[1]
        self.open: list[socket.socket] = [self.srv]

    def connect(self, host: str = "127.0.0.1") -> tuple[socket.socket, socket.socket]:
        client = socket.create_connection((host, self.port))
        server, _ = self.srv.accept()
        self.open += [client, server]
        return client, server

    def close(self) -> None:
        for s in self.open:
            s.close()


@pytest.fixture
def loop() -> Iterator[Loop]:
    lp = Loop()
    yield lp
    lp.close()


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        assert chunk, "connection closed"
        out += chunk
    return out


def _kernel(server: socket.socket) -> Sock | None:
    """The kernel's record of SERVER (a server-side socket of this process), by inode."""
    inode = os.fstat(server.fileno()).st_ino
    port = server.getsockname()[1]
    return next((s for s in read_table({port}).socks if s.inode == inode), None)


def _field(server: socket.socket, name: str, at_least: int) -> Sock:
    got = _until(
        lambda: (k := _kernel(server)) is not None and getattr(k, name) >= at_least and k,
        f"{name} >= {at_least}",
    )
    assert isinstance(got, Sock)
    return got


def _observer() -> ConnObserver:
    # This process is both ends: not recognised as guardian; no cgroups (peers named by address).
    return ConnObserver(recognise_self=False, mounts=CgroupMounts())


def _look(ob: ConnObserver, cfg: Config) -> ConnView:
    view = ob.look_now(cfg, time.monotonic())["a"]
    assert view is not None, ob.unavailable
    return view


# --- real sockets ------------------------------------------------------------------------------


def test_tcp_info_offsets_bytes_each_way(loop):
    client, server = loop.connect()
    n, m = 12_345, 777
    client.sendall(b"q" * n)
    _recv_exactly(server, n)
    server.sendall(b"r" * m)
    _recv_exactly(client, m)
    srv = _field(server, "bytes_acked", m)
    assert srv.bytes_acked == m  # the passive side counts no SYN
    assert srv.bytes_received == n
    assert srv.data_segs_out is not None and srv.data_segs_out >= 1
    assert (srv.lport, srv.remote, srv.local) == (loop.port, "127.0.0.1", "127.0.0.1")
    assert srv.rport == client.getsockname()[1]
    cli = next(s for s in read_table({loop.port}).socks if s.inode == os.fstat(client.fileno()).st_ino)
    assert cli.bytes_received == m
    assert cli.bytes_acked is not None and cli.bytes_acked - n in (0, 1)  # the active side's SYN may count
    assert (cli.rport, cli.lport) == (loop.port, srv.rport)


def test_tcp_info_offsets_the_two_times(loop):
    """last_data_sent and last_data_recv are the ones named (not the ack times, not swapped)."""
    client, server = loop.connect()
    server.sendall(b"answer")
    _recv_exactly(client, 6)
    _field(server, "last_sent_ms", 150)  # the server sent 150 ms ago at least
    client.sendall(b"request")
    _recv_exactly(server, 7)
    k = _kernel(server)
    assert k is not None and k.last_sent_ms is not None and k.last_recv_ms is not None
    assert k.last_sent_ms >= 150 > 100 > k.last_recv_ms


def test_a_fresh_server_socket_has_sent_no_data(loop):
    client, server = loop.connect()
    client.sendall(b"GET")
    _recv_exactly(server, 3)
    k = _kernel(server)
    assert k is not None and k.data_segs_out == 0 and k.bytes_acked == 0 and k.bytes_received == 3


def test_ipv6_and_ipv4_mapped_addresses():
    v6 = Loop(socket.AF_INET6, "::1")
    dual = socket.socket(socket.AF_INET6)
    dual.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    dual.bind(("::", 0))
    dual.listen()
    try:
        v6.connect("::1")
        client = socket.create_connection(("127.0.0.1", dual.getsockname()[1]))
        server, _ = dual.accept()
        try:
            by_port = {s.lport: s for s in read_table({v6.port, dual.getsockname()[1]}).socks}
            assert (by_port[v6.port].local, by_port[v6.port].remote) == ("::1", "::1")
            mapped = by_port[dual.getsockname()[1]]
            assert (mapped.local, mapped.remote, mapped.rport) == ("127.0.0.1", "127.0.0.1", client.getsockname()[1])
        finally:
            client.close()
            server.close()
    finally:
        v6.close()
        dual.close()


def test_the_kernel_sends_only_the_replicas_ports(loop):
    other = Loop()
    try:
        other.connect()
        loop.connect()
        socks = read_table({loop.port}).socks
        assert len(socks) == 2  # the server and the client side of the one connection
        assert all(loop.port in (s.lport, s.rport) for s in socks)
    finally:
        other.close()


def test_port_filter_is_accepted_for_many_ports(loop):
    loop.connect()
    ports = {loop.port, *range(20_000, 20_030)}
    assert {s.lport for s in read_table(ports).socks} >= {loop.port}
    assert len(port_filter(ports)) == 20 * 2 * len(ports) - 4


JIFFY_S = 0.010


def test_streaming_to_a_silent_client_flows(loop):
    client, server = loop.connect()
    cfg = _cfg(loop.port)
    client.sendall(b"POST /v1/completions")
    _recv_exactly(server, 20)
    _field(server, "last_recv_ms", 20)  # the request is older than the first look by a jiffy at least
    ob = _observer()
    first = _look(ob, cfg)
    assert (first.connections, first.flowing, first.waiting, first.since_s) == (1, 0, 1, None)
    for _ in range(5):
        server.sendall(b"data: token\n\n")
        _recv_exactly(client, 13)
    _field(server, "bytes_acked", 65)
    second = _look(ob, cfg)
    # one interval of bytes could be a quick answer: a response flows from its second interval on
    assert (second.flowing, second.bytes_out, second.waiting) == (0, 0, 0)
    for _ in range(5):
        server.sendall(b"data: token\n\n")
        _recv_exactly(client, 13)
    _field(server, "bytes_acked", 130)
    third = _look(ob, cfg)
    assert (third.flowing, third.bytes_out, third.waiting) == (1, 65, 0)
    assert third.since_s is not None and third.since_s > 0
    assert third.peers == (Peer(PeerKind.OTHER, "127.0.0.1", 1),)
    assert first.last_flow_s is None and second.last_flow_s is None  # nothing flowed yet
    # the last token's send, within the interval; tcp_info counts in jiffies (up to 10 ms at HZ=100),
    # so the kernel's figure may pass the look's own clock by one of them
    assert third.last_flow_s is not None and 0 <= third.last_flow_s <= third.since_s + JIFFY_S


def test_an_idle_keep_alive_connection_neither_flows_nor_waits(loop):
    client, server = loop.connect()
    cfg = _cfg(loop.port)
    client.sendall(b"GET /v1/models")
    _recv_exactly(server, 14)
    server.sendall(b"200 OK")
    _recv_exactly(client, 6)
    _field(server, "bytes_acked", 6)
    ob = _observer()
    _look(ob, cfg)
    _field(server, "last_sent_ms", 20)
    second = _look(ob, cfg)
    assert (second.connections, second.flowing, second.bytes_out, second.waiting) == (1, 0, 0, 0)


@pytest.mark.parametrize("keep_alive", [False, True])
def test_an_unanswered_request_waits_longer_at_each_look(loop, keep_alive):
    client, server = loop.connect()
    cfg = _cfg(loop.port)
    if keep_alive:  # an earlier request was answered: the new one is more recent than that answer
        client.sendall(b"GET /health")
        _recv_exactly(server, 11)
        server.sendall(b"200 OK")
        _recv_exactly(client, 6)
        _field(server, "last_sent_ms", 20)
    client.sendall(b"POST /v1/chat/completions")  # a fresh connection: sent with the handshake's ACK
    _recv_exactly(server, 25)
    ob = _observer()
    first = _look(ob, cfg)
    assert (first.waiting, first.flowing) == (1, 0)
    k = _field(server, "last_recv_ms", int(first.oldest_wait_s * 1000) + 30)
    assert k.last_recv_ms is not None
    second = _look(ob, cfg)
    assert (second.waiting, second.flowing) == (1, 0)
    assert second.oldest_wait_s >= k.last_recv_ms / 1000 > first.oldest_wait_s


def test_quick_answers_to_a_new_request_each_look_do_not_flow(loop):
    client, server = loop.connect()
    cfg = _cfg(loop.port)
    ob = _observer()
    acked = 0
    views = []
    for i in range(3):
        client.sendall(b"GET /v1/models")
        _recv_exactly(server, 14)
        server.sendall(b"x" * 1000)
        _recv_exactly(client, 1000)
        acked += 1000
        _field(server, "bytes_acked", acked)  # the answer went out since the previous look
        views.append(_look(ob, cfg))
        after = _kernel(server)
        assert after is not None and after.last_sent_ms is not None
        # the next request a few jiffies after this look (the kernel's times are in jiffies)
        _field(server, "last_sent_ms", after.last_sent_ms + 20)
    assert [(v.flowing, v.bytes_out, v.waiting) for v in views] == [(0, 0, 0)] * 3
    assert all(v.since_s is not None for v in views[1:])


def test_guardians_own_connection_is_recognised_by_its_socket(loop):
    client, server = loop.connect()
    client.sendall(b"GET /health")
    _recv_exactly(server, 11)
    ob = ConnObserver(mounts=CgroupMounts())  # recognises this process as guardian
    view = _look(ob, _cfg(loop.port))
    assert view.peers == (Peer(PeerKind.GUARDIAN, "127.0.0.1", 1),)
    assert (view.connections, view.waiting) == (1, 0)


def test_more_sockets_than_the_limit_are_a_partial_view(loop):
    for _ in range(3):
        loop.connect()
    full = _look(_observer(), _cfg(loop.port))
    assert (full.connections, full.truncated) == (3, False)
    partial = _look(ConnObserver(recognise_self=False, mounts=CgroupMounts(), limit=2), _cfg(loop.port))
    assert partial.truncated and partial.connections <= 2


def test_look_runs_in_a_thread(loop):
    loop.connect()
    views = asyncio.run(_observer().look(_cfg(loop.port), time.monotonic()))
    assert views["a"] is not None and views["a"].connections == 1


def test_an_unreadable_table_is_none_for_every_replica_and_says_why(monkeypatch, loop):
    cfg = Config(
        replicas=[
            ReplicaConfig(name="a", unit="vllm-a.service", url=f"http://127.0.0.1:{loop.port}", model="m"),
            ReplicaConfig(name="b", unit="vllm-b.service", url="http://127.0.0.1:1", model="m"),
        ]
    )
    ob = _observer()
    assert ob.look_now(cfg, 1.0)["a"] is not None and ob.unavailable is None

    def refused(*_a: object, **_k: object) -> Table:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(conns, "read_sockets", refused)
    assert ob.look_now(cfg, 2.0) == {"a": None, "b": None}
    assert ob.unavailable is not None and "Permission denied" in ob.unavailable
    monkeypatch.undo()
    again = ob.look_now(cfg, 3.0)["a"]
    assert ob.unavailable is None
    assert again is not None and again.since_s is None  # the memory went with the failed look


def test_a_kernel_without_bytes_acked_gives_no_view(monkeypatch):
    old = Sock("127.0.0.1", 8000, "10.0.0.1", 5000, inode=1, last_sent_ms=5, last_recv_ms=3)
    monkeypatch.setattr(conns, "read_sockets", lambda *_a, **_k: Table((old,)))
    ob = _observer()
    assert ob.look_now(_cfg(8000), 1.0) == {"a": None}
    assert ob.unavailable is not None and "tcp_info" in ob.unavailable


# --- parsing a message -------------------------------------------------------------------------


def _message(info_len: int | None, cgroup_id: int | None = 77) -> bytes:
    msg = bytearray(DIAG_MSG_SIZE)
    msg[0] = socket.AF_INET
    struct.pack_into(">HH", msg, 4, 8000, 40000)
    msg[8:12] = socket.inet_aton("10.0.0.1")
    msg[24:28] = socket.inet_aton("10.0.0.2")
    struct.pack_into("=I", msg, 68, 4242)
    if info_len is not None:
        info = bytearray(info_len)
        fields = ((44, "=I", 11), (52, "=I", 22), (120, "=Q", 333), (128, "=Q", 444), (144, "=I", 60), (156, "=I", 5),
                  (200, "=Q", 1000), (208, "=Q", 100))
        for off, fmt, value in fields:
            if off + struct.calcsize(fmt) <= info_len:
                struct.pack_into(fmt, info, off, value)
        msg += struct.pack("=HH", 4 + info_len, 2) + info + bytes(-info_len % 4)
    if cgroup_id is not None:
        msg += struct.pack("=HHQ", 12, 21, cgroup_id)
    return bytes(msg)


@pytest.mark.parametrize(
    ("info_len", "want"),
    [
        # written: bytes_sent 1000 - bytes_retrans 100 + notsent 60
        (232, (11, 22, 333, 444, 5, 960)),
        (216, (11, 22, 333, 444, 5, 960)),  # Linux 4.19: ends with bytes_retrans
        (200, (11, 22, 333, 444, 5, None)),  # 4.6 to 4.18: no bytes_sent, so nothing written known
        (136, (11, 22, 333, 444, None, None)),  # Linux 4.1 to 4.5: no data_segs_out
        (104, (11, 22, None, None, None, None)),  # before 4.1: no bytes counts
        (None, (None, None, None, None, None, None)),  # no INET_DIAG_INFO at all
    ],
)
def test_a_short_tcp_info_leaves_the_later_fields_unknown(info_len, want):
    data = _message(info_len)
    s = parse_sock(data, 0, len(data))
    got = (s.last_sent_ms, s.last_recv_ms, s.bytes_acked, s.bytes_received, s.data_segs_out, s.bytes_written)
    assert got == want
    assert (s.local, s.lport, s.remote, s.rport, s.inode, s.cgroup_id) == ("10.0.0.1", 8000, "10.0.0.2", 40000, 4242, 77)


def test_no_cgroup_id_before_linux_5_7():
    data = _message(232, cgroup_id=None)
    assert parse_sock(data, 0, len(data)).cgroup_id is None


# --- the rules (pure) --------------------------------------------------------------------------

PORT = 8000
REPLICAS = [("a", PORT)]


def _srv(
    remote: str = "10.0.0.9",
    rport: int = 40000,
    inode: int = 100,
    acked: int | None = 0,
    recv_ms: int | None = 5000,
    sent_ms: int | None = 5000,
    received: int | None = 100,
    segs: int | None = 1,
    written: int | None = None,
) -> Sock:
    return Sock(
        "10.0.0.1", PORT, remote, rport, inode, None, sent_ms, recv_ms, acked, received, segs, written
    )


def _one(socks: list[Sock], prev: Memory = Memory(), now: float = 12.0, who: Who = Who()) -> ConnView:
    return conn_views(Table(tuple(socks)), REPLICAS, who, prev, now)[0]["a"]


def _prev(acked: int = 1000, inode: int = 100, at: float = 10.0, moving: bool = True, written: int | None = None) -> Memory:
    """The previous look; MOVING: a response was already moving on it in the interval before."""
    return Memory(at=at, sockets={("10.0.0.1", PORT, "10.0.0.9", 40000): Seen(inode, acked, moving, 100, 1, written)})


@pytest.mark.parametrize(
    ("sock", "prev", "flowing", "bytes_out"),
    [
        (_srv(acked=1500, recv_ms=2000, sent_ms=1), _prev(), 1, 500),  # silent exactly since the last look
        (_srv(acked=1500, recv_ms=9000, sent_ms=1), _prev(), 1, 500),
        (_srv(acked=1500, recv_ms=1999, sent_ms=1), _prev(), 0, 0),  # the client spoke since
        (_srv(acked=1000, recv_ms=9000, sent_ms=1), _prev(), 0, 0),  # nothing more acked
        (_srv(acked=1500, recv_ms=9000, sent_ms=1, inode=101), _prev(), 0, 0),  # another connection
        (_srv(acked=1500, recv_ms=9000, sent_ms=1, inode=101), _prev(inode=0), 1, 500),  # accepted since
        (_srv(acked=1500, recv_ms=9000, sent_ms=1), Memory(at=10.0), 0, 0),  # new since the last look
        (_srv(acked=1500, recv_ms=9000, sent_ms=1), Memory(), 0, 0),  # the first look
        (_srv(acked=None, recv_ms=9000, sent_ms=1), _prev(), 0, 0),  # no tcp_info
        # a quick answer to a request that spanned one look (a dead engine's 500): not a response flowing
        (_srv(acked=1500, recv_ms=2001, sent_ms=1999), _prev(moving=False), 0, 0),
        (_srv(acked=1500, recv_ms=9000, sent_ms=1), _prev(moving=False), 0, 0),  # its first interval only
        # issue 34 row 2: what the process wrote, where the kernel says (the previous look kept it)
        (_srv(acked=1200, written=1500, recv_ms=9000, sent_ms=1), _prev(acked=1000, written=1000), 1, 500),
        # a frozen process: its kernel still sends the buffer to a slow reader (acked 1000 -> 1400) but
        # the process wrote nothing more: no response flows
        (_srv(acked=1400, written=1000, recv_ms=9000, sent_ms=1), _prev(acked=1000, written=1000), 0, 0),
        # counted as sent again, nothing acked: a send that failed below TCP and was retried
        (_srv(acked=1000, written=1500, recv_ms=9000, sent_ms=1), _prev(acked=1000, written=1000), 0, 0),
    ],
)
def test_flowing(sock, prev, flowing, bytes_out):
    view = _one([sock], prev)
    assert (view.flowing, view.bytes_out) == (flowing, bytes_out)
    assert view.since_s == (None if prev.at is None else 2.0)


@pytest.mark.parametrize(
    ("recv_ms", "sent_ms", "received", "segs", "acked", "waits"),
    [
        (100, 101, 10, 1, 5, True),  # the client spoke last
        (101, 100, 10, 1, 5, False),
        (100, 100, 10, 1, 5, False),  # answered within the jiffy of the request
        (100, 100, 10, 0, 0, True),  # a fresh connection's request: no data ever sent
        (100, 100, 0, 0, 0, False),  # connected, nothing said either way
        (100, 100, 10, None, 0, True),  # no data_segs_out: nothing acked says the same
        (100, 100, 10, None, 5, False),
        (None, 100, 10, 1, 5, False),
        (100, None, 10, 1, 5, False),
    ],
)
def test_waiting(recv_ms, sent_ms, received, segs, acked, waits):
    view = _one([_srv(recv_ms=recv_ms, sent_ms=sent_ms, received=received, segs=segs, acked=acked)])
    assert (view.waiting, view.oldest_wait_s) == ((1, recv_ms / 1000) if waits else (0, 0.0))


def test_the_oldest_wait_is_the_longest():
    socks = [_srv(rport=40000 + i, inode=100 + i, recv_ms=ms, sent_ms=9000) for i, ms in enumerate((300, 4200, 10))]
    view = _one(socks)
    assert (view.waiting, view.oldest_wait_s, view.connections) == (3, 4.2, 3)


def test_guardian_and_monitoring_never_flow_nor_wait():
    who = Who(proxy=frozenset({"10.0.0.9"}), monitoring=frozenset({"10.0.0.8"}), guardian_sockets=frozenset({7}))
    flowing = {"acked": 1500, "recv_ms": 9000, "sent_ms": 1}
    waiting = {"recv_ms": 10, "sent_ms": 900}
    guardian_client = Sock("127.0.0.1", 41000, "10.0.0.1", PORT, inode=7)
    socks = [
        _srv(remote="10.0.0.8", **flowing),  # type: ignore[arg-type]
        _srv(remote="10.0.0.8", rport=40001, inode=101, **waiting),  # type: ignore[arg-type]
        _srv(remote="127.0.0.1", rport=41000, inode=102, **waiting),  # type: ignore[arg-type]
        guardian_client,
    ]
    prev = Memory(at=10.0, sockets={("10.0.0.1", PORT, "10.0.0.8", 40000): Seen(100, 1000, True)})
    view = _one(socks, prev, who=who)
    assert (view.connections, view.flowing, view.waiting) == (3, 0, 0)
    assert {p.kind for p in view.peers} == {PeerKind.GUARDIAN, PeerKind.MONITORING}
    # the same sockets from a proxy's address count
    view = _one([_srv(**flowing), _srv(rport=40001, inode=101, **waiting)], _prev(), who=who)  # type: ignore[arg-type]
    assert (view.flowing, view.waiting, view.peers) == (1, 1, (Peer(PeerKind.PROXY, "10.0.0.9", 2),))


def test_memory_keeps_the_sockets_of_this_look_only():
    _v, mem = conn_views(Table((_srv(acked=5),)), REPLICAS, Who(), _prev(), 12.0)
    assert mem == Memory(at=12.0, sockets={("10.0.0.1", PORT, "10.0.0.9", 40000): Seen(100, 5, False, 100, 1)})
    _v, mem = conn_views(Table(()), REPLICAS, Who(), mem, 14.0)
    assert mem == Memory(at=14.0, sockets={})


def test_a_replica_without_connections_and_cpu():
    views, _ = conn_views(Table(()), [("a", PORT), ("b", 9000)], Who(), Memory(), 1.0, cpu={"b": 0.25})
    assert views["a"] == ConnView(0, 0, 0, 0, None, None, at=1.0)
    assert views["b"].cpu_s == 0.25


# --- who is at the other end -------------------------------------------------------------------

GUARDIAN_CG = "/system.slice/guardian.service"
CGROUPS = {
    1: GUARDIAN_CG,
    2: GUARDIAN_CG + "/canary",
    3: "/system.slice/nginx.service",
    4: "/system.slice/prometheus.service",
    5: "/system.slice/batch.service",
    6: "/system.slice/haproxy.service",
    7: "/user.slice/user-1000.slice/session-4.scope",
    8: "/system.slice",
    # issue 34 row 10: a user's own units named like the proxy and the monitoring (its delegated tree)
    9: "/user.slice/user-1000.slice/user@1000.service/app.slice/nginx.service",
    10: "/user.slice/user-1000.slice/user@1000.service/app.slice/prometheus.service",
}


def _local(cgroup_id: int | None, inode: int = 500) -> tuple[Sock, Sock]:
    server = _srv(remote="127.0.0.1", rport=41000)
    client = Sock("127.0.0.1", 41000, "10.0.0.1", PORT, inode=inode, cgroup_id=cgroup_id)
    return server, client


def _who(**kw: object) -> Who:
    cfg = Config(
        watchdog=WatchdogConfig(
            proxy_peers=["haproxy.service", "10.0.0.5", "::ffff:10.0.0.6"], monitoring_peers=["prometheus.service", "10.0.0.4"]
        ),
        **kw,  # type: ignore[arg-type]
    )
    return Who.of(cfg, cgroups=CGROUPS, guardian_cgroup=GUARDIAN_CG, guardian_sockets=frozenset({900}))


PROXY_ON = {"proxy": ProxyConfig(nginx_upstream_dir=Path("/var/lib/guardian/nginx"))}
DRAINS_ONLY = {"proxy": ProxyConfig(drain_command=["/bin/true"])}  # a proxy elsewhere: nginx here is not it


@pytest.mark.parametrize(
    ("cgroup_id", "inode", "proxy", "kind", "name"),
    [
        (1, 500, {}, PeerKind.GUARDIAN, "guardian.service"),
        (2, 500, {}, PeerKind.GUARDIAN, "guardian.service"),  # a sub-cgroup of guardian's
        (None, 900, {}, PeerKind.GUARDIAN, "127.0.0.1"),  # guardian's own socket, no cgroup id
        (3, 500, PROXY_ON, PeerKind.PROXY, "nginx.service"),
        (3, 500, {}, PeerKind.OTHER, "nginx.service"),  # [proxy] off: nginx is a client like any
        (3, 500, DRAINS_ONLY, PeerKind.OTHER, "nginx.service"),
        (6, 500, {}, PeerKind.PROXY, "haproxy.service"),  # watchdog.proxy_peers
        (4, 500, {}, PeerKind.MONITORING, "prometheus.service"),
        (5, 500, {}, PeerKind.OTHER, "batch.service"),
        (7, 500, {}, PeerKind.OTHER, "session-4.scope"),
        (8, 500, {}, PeerKind.OTHER, "127.0.0.1"),  # a cgroup that names no unit
        (9, 500, PROXY_ON, PeerKind.OTHER, "user@1000.service"),  # not the proxy: B2 still sees it
        (10, 500, {}, PeerKind.OTHER, "user@1000.service"),  # not monitoring
        (99, 500, {}, PeerKind.OTHER, "127.0.0.1"),  # an unknown cgroup id
        (None, 500, {}, PeerKind.OTHER, "127.0.0.1"),  # no cgroup id (Linux < 5.7)
    ],
)
def test_local_peers(cgroup_id, inode, proxy, kind, name):
    server, client = _local(cgroup_id, inode)
    assert classify(server, client, _who(**proxy)) == (kind, name)


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("10.0.0.5", PeerKind.PROXY),
        ("10.0.0.6", PeerKind.PROXY),  # written IPv4-mapped in the config
        ("10.0.0.4", PeerKind.MONITORING),
        ("10.0.0.7", PeerKind.OTHER),
        ("2001:db8::7", PeerKind.OTHER),
    ],
)
def test_remote_peers_by_address(address, kind):
    assert classify(_srv(remote=address), None, _who(**PROXY_ON)) == (kind, address)


def test_peers_are_counted_sorted_and_capped():
    socks = [_srv(remote="10.0.0.5", rport=30000 + i, inode=1000 + i) for i in range(3)]  # the proxy
    socks += [_srv(remote="10.0.0.4", rport=31000, inode=2000)]  # monitoring
    socks += [
        _srv(remote=f"10.1.{i}.0", rport=32000 + 10 * i + j, inode=3000 + 10 * i + j)
        for i in range(20)
        for j in range(1 + (i == 7) * 2)
    ]
    server, client = _local(1)
    view = _one([*socks, server, client], who=_who())
    assert view.connections == 3 + 1 + 22 + 1
    assert len(view.peers) == MAX_PEERS
    assert view.peers[:5] == (
        Peer(PeerKind.PROXY, "10.0.0.5", 3),
        Peer(PeerKind.GUARDIAN, "guardian.service", 1),
        Peer(PeerKind.MONITORING, "10.0.0.4", 1),
        Peer(PeerKind.OTHER, "10.1.7.0", 3),  # the most connections first
        Peer(PeerKind.OTHER, "10.1.0.0", 1),
    )


def test_a_local_peer_is_found_by_its_socket_not_its_address():
    """A peer at one of this box's own addresses (not loopback) is local all the same."""
    server = _srv(remote="10.0.0.1", rport=41000)
    client = Sock("10.0.0.1", 41000, "10.0.0.1", PORT, inode=500, cgroup_id=5)
    view = _one([server, client], who=_who())
    assert view.peers == (Peer(PeerKind.OTHER, "batch.service", 1),)


# --- cgroups and CPU ---------------------------------------------------------------------------


def test_parse_cpu_stat_and_cpuacct_usage():
    assert parse_cpu_stat("usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n") == 2.5
    assert parse_cpu_stat("user_usec 1\n") is None
    assert parse_cpu_stat("usage_usec x\n") is None
    assert parse_cpuacct_usage("1500000000\n") == 1.5
    assert parse_cpuacct_usage("") is None


@pytest.mark.parametrize(
    ("before", "after", "delta"),
    [
        ((7, 2.0), (7, 2.75), 0.75),
        ((7, 2.0), (7, 2.0), 0.0),
        ((7, 2.0), (8, 3.0), None),  # a new cgroup directory: the unit was restarted
        ((7, 2.0), (7, 1.0), None),
        (None, (7, 1.0), None),  # the first look
        ((7, 2.0), None, None),
    ],
)
def test_cpu_delta(before, after, delta):
    assert cpu_delta(before, after) == delta


def test_cpu_of_the_unit_on_cgroup_v2(tmp_path, monkeypatch):
    unit_dir = tmp_path / "system.slice/vllm-a.service"
    unit_dir.mkdir(parents=True)
    (unit_dir / "cpu.stat").write_text("usage_usec 1000000\n")
    monkeypatch.setattr(conns, "read_sockets", lambda *_a, **_k: Table(()))
    ob = ConnObserver(recognise_self=False, mounts=CgroupMounts(unified=str(tmp_path)))
    first = ob.look_now(_cfg(8000), 1.0)["a"]
    assert first is not None and first.cpu_s is None
    (unit_dir / "cpu.stat").write_text("usage_usec 1750000\n")
    second = ob.look_now(_cfg(8000), 3.0)["a"]
    assert second is not None and second.cpu_s == 0.75


def test_cpu_of_a_templated_unit_on_cgroup_v1_only(tmp_path, monkeypatch):
    unit_dir = tmp_path / "system.slice/system-vllm.slice/vllm@a.service"
    unit_dir.mkdir(parents=True)
    (unit_dir / "cpuacct.usage").write_text("2000000000\n")
    monkeypatch.setattr(conns, "read_sockets", lambda *_a, **_k: Table(()))
    cfg = Config(replicas=[ReplicaConfig(name="a", unit="vllm@a.service", url="http://127.0.0.1:8000", model="m")])
    ob = ConnObserver(recognise_self=False, mounts=CgroupMounts(cpuacct=str(tmp_path)))
    assert ob.look_now(cfg, 1.0)["a"].cpu_s is None  # type: ignore[union-attr]
    (unit_dir / "cpuacct.usage").write_text("2500000000\n")
    assert ob.look_now(cfg, 3.0)["a"].cpu_s == 0.5  # type: ignore[union-attr]
    (unit_dir / "cpuacct.usage").unlink()
    assert ob.look_now(cfg, 5.0)["a"].cpu_s is None  # type: ignore[union-attr]


def test_a_removed_cgroup_is_not_looked_for_again(tmp_path, monkeypatch):
    (tmp_path / "system.slice/batch.service").mkdir(parents=True)
    walks: list[str] = []

    def counting(root: str) -> dict[int, str]:
        walks.append(root)
        return cgroup_dirs(root)

    socks = [_srv(remote="127.0.0.1", rport=41000), Sock("127.0.0.1", 41000, "10.0.0.1", PORT, inode=5, cgroup_id=10**9)]
    monkeypatch.setattr(conns, "cgroup_dirs", counting)
    monkeypatch.setattr(conns, "read_sockets", lambda *_a, **_k: Table(tuple(socks)))
    ob = ConnObserver(recognise_self=False, mounts=CgroupMounts(unified=str(tmp_path)))
    cfg = Config(replicas=[ReplicaConfig(name="a", unit="batch.service", url=f"http://127.0.0.1:{PORT}", model="m")])
    ob.look_now(cfg, 1.0)
    assert len(walks) == 1
    ob.look_now(cfg, 2.0)
    assert len(walks) == 1  # the id is gone; the unit's cgroup is where it was
    socks.append(Sock("127.0.0.1", 41001, "10.0.0.1", PORT, inode=6, cgroup_id=10**9 + 1))
    socks.append(_srv(remote="127.0.0.1", rport=41001, inode=101))
    ob.look_now(cfg, 3.0)
    assert len(walks) == 2  # a new id: walked again


def test_local_peers_are_named_through_the_cgroup2_tree(tmp_path, monkeypatch):
    batch = tmp_path / "system.slice/batch.service"
    batch.mkdir(parents=True)
    server = _srv(remote="127.0.0.1", rport=41000, acked=5)
    client = Sock("127.0.0.1", 41000, "10.0.0.1", PORT, inode=500, cgroup_id=os.stat(batch).st_ino)
    monkeypatch.setattr(conns, "read_sockets", lambda *_a, **_k: Table((server, client)))
    monkeypatch.setattr(conns, "listener_table", lambda _ports: [Listener(socket.AF_INET, "0.0.0.0", PORT, 1)])
    ob = ConnObserver(recognise_self=False, mounts=CgroupMounts(unified=str(tmp_path)))
    view = ob.look_now(_cfg(PORT), 1.0)["a"]
    assert view is not None and view.peers == (Peer(PeerKind.OTHER, "batch.service", 1),)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("0::/system.slice/guardian.service\n", "/system.slice/guardian.service"),
        ("0::/system.slice/guardian.service/main\n", "/system.slice/guardian.service"),
        ("1:name=systemd:/system.slice/guardian.service\n0::/system.slice/guardian.service\n",
         "/system.slice/guardian.service"),
        ("0::/\n", None),  # the root cgroup holds everyone
        ("0::/user.slice/user-0.slice\n", None),
        ("4:memory:/x\n", None),  # cgroup v1 only
    ],
)
def test_guardian_cgroup_of(text, want):
    assert guardian_cgroup_of(text) == want


HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:9 - cgroup cgroup rw,cpu,cpuacct
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime shared:5 - cgroup2 cgroup2 rw,nsdelegate
"""
UNIFIED = "27 22 0:26 / /sys/fs/cgroup rw,nosuid,nodev shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n"
V1 = "33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct\n"
ESCAPED = "50 1 0:40 /sub /mnt/a\\040b rw - cgroup2 cgroup2 rw\n51 1 0:40 / /mnt/c\\040d rw - cgroup2 cgroup2 rw\n"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (HYBRID, CgroupMounts("/sys/fs/cgroup/unified", "/sys/fs/cgroup/cpu,cpuacct")),
        (UNIFIED, CgroupMounts("/sys/fs/cgroup", None)),
        (V1, CgroupMounts(None, "/sys/fs/cgroup/cpuacct")),
        (ESCAPED, CgroupMounts("/mnt/c d", None)),  # the hierarchy's root first
        ("", CgroupMounts()),
    ],
)
def test_parse_mountinfo(text, want):
    assert parse_mountinfo(text) == want


def test_this_boxs_cgroup2_mount_holds_the_sockets_cgroups(loop):
    """The socket's cgroup id is the inode of its cgroup's directory in the cgroup2 mount found."""
    from guardian.observe.sockets import cgroup_mounts

    mounts = cgroup_mounts()
    if mounts.unified is None:
        pytest.skip("no cgroup2 on this box")
    loop.connect()
    ids = {s.cgroup_id for s in read_table({loop.port}).socks}
    with open("/proc/self/cgroup") as f:
        own = next(line[3:].strip() for line in f if line.startswith("0::"))
    assert ids == {os.stat(mounts.unified + own).st_ino}


def test_a_request_sent_within_the_jiffy_of_the_last_answer_waits():
    """nginx reuses an upstream connection at once under load: the request lands in the jiffy of
    the previous answer, the two times stay equal, and only the counters show who spoke last."""
    key = ("10.0.0.1", PORT, "10.0.0.9", 40000)
    prev = Memory(at=10.0, sockets={key: Seen(100, 1000, False, 100, 4)})
    asked = _srv(acked=1000, recv_ms=700, sent_ms=700, received=180, segs=4)  # 80 bytes more, nothing out
    assert _one([asked], prev).waiting == 1
    answered = _srv(acked=1000, recv_ms=700, sent_ms=700, received=180, segs=5)  # a data segment went out
    assert _one([answered], prev).waiting == 0


def test_a_unit_without_a_cgroup_is_not_searched_for_by_a_walk_at_every_look(tmp_path, monkeypatch):
    """A stopped or crash-looping replica has no cgroup: the walk of the whole tree (up to 100k
    directories on a container host) is done once per ABSENT_LOOKS looks, not at each."""
    from guardian.observe import conns as c

    (tmp_path / "system.slice" / "other.service").mkdir(parents=True)
    walks: list[str] = []
    real = c.cgroup_dirs
    monkeypatch.setattr(c, "cgroup_dirs", lambda root: walks.append(root) or real(root))
    tree = c._Tree(str(tmp_path))
    for _ in range(c.ABSENT_LOOKS):
        tree.new_look()
        assert tree.unit_path("vllm-a.service") is None
    assert len(walks) == 1
    (tmp_path / "system.slice" / "vllm-a.service").mkdir()
    tree.new_look()
    assert tree.unit_path("vllm-a.service") == "/system.slice/vllm-a.service"  # found where it usually is


# --- whose sockets (issue 34 rows 1 and 13) -----------------------------------------------------

V4, V6 = socket.AF_INET, socket.AF_INET6


def _at(local: str, cgroup_id: int | None = 7) -> Sock:
    return Sock(local, PORT, "10.0.0.9", 40000, 100, cgroup_id, 1, 9000, 1500, 100, 1, 1500)


@pytest.mark.parametrize(
    ("sock", "listener", "accepted"),
    [
        (_at("127.0.0.1"), Listener(V4, "0.0.0.0", PORT, 1, 7), True),
        (_at("10.0.0.1"), Listener(V4, "0.0.0.0", PORT, 1, 7), True),
        (_at("::1"), Listener(V4, "0.0.0.0", PORT, 1, 7), False),  # the squatter's [::1] beside 0.0.0.0
        (_at("::1"), Listener(V6, "::", PORT, 1, 7), True),  # dual-stack takes both
        (_at("127.0.0.1"), Listener(V6, "::", PORT, 1, 7), True),
        (_at("127.0.0.1"), Listener(V4, "127.0.0.1", PORT, 1, 7), True),
        (_at("127.0.0.2"), Listener(V4, "127.0.0.1", PORT, 1, 7), False),  # another loopback address
        (_at("127.0.0.1"), Listener(V6, "::ffff:127.0.0.1", PORT, 1, 7), True),
        (_at("127.0.0.1", cgroup_id=8), Listener(V4, "0.0.0.0", PORT, 1, 7), False),  # another cgroup's
        (_at("127.0.0.1", cgroup_id=None), Listener(V4, "0.0.0.0", PORT, 1, 7), True),  # before Linux 5.7
        (_at("127.0.0.1", cgroup_id=8), Listener(V4, "", PORT, 1, None), True),  # /proc/net: the port alone
        (_at("127.0.0.1"), None, False),  # nothing serves the replica's address
    ],
)
def test_a_socket_is_the_replicas_only_if_its_listener_accepted_it(sock, listener, accepted):
    assert conns.accepted_by(sock, listener) is accepted


def test_a_squatters_flowing_connections_on_the_port_are_not_the_replicas():
    """Row 1: a frozen replica on 0.0.0.0:P; another user's listener on [::1]:P trickles to its own
    client. Counted by port, the squatter's flow kept the replica busy (L11) for as long as it wished."""
    prev = Memory(at=10.0, sockets={("::1", PORT, "10.0.0.9", 40000): Seen(100, 1000, True, 100, 1, 1000)})
    squat = _at("::1")
    by_port = conn_views(Table((squat,)), REPLICAS, Who(), prev, 12.0)[0]["a"]
    assert (by_port.connections, by_port.flowing) == (1, 1)  # what a port alone says
    own = conn_views(Table((squat,)), REPLICAS, Who(listeners={"a": Listener(V4, "0.0.0.0", PORT, 1, 7)}),
                     prev, 12.0)[0]["a"]
    assert (own.connections, own.flowing, own.bytes_out) == (0, 0, 0)


def test_two_replicas_on_one_port_at_two_addresses_each_count_their_own():
    a, b = _at("127.0.0.1", cgroup_id=7), _at("127.0.0.2", cgroup_id=8)
    who = Who(listeners={"a": Listener(V4, "127.0.0.1", PORT, 1, 7), "b": Listener(V4, "127.0.0.2", PORT, 2, 8)})
    views, _ = conn_views(Table((a, b)), [("a", PORT), ("b", PORT)], who, Memory(), 12.0)
    assert (views["a"].connections, views["b"].connections) == (1, 1)


def test_a_squatter_on_another_family_is_left_out_by_a_real_look(loop):
    """Row 1 with real sockets: the replica listens on 0.0.0.0:P (IPv4, as vLLM does), a squatter
    on [::1]:P streams to its own client; the replica's view has none of the squatter's sockets."""
    for _ in range(50):  # a port free on both: another test may hold it on IPv4
        squat = socket.socket(socket.AF_INET6)
        squat.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        squat.bind(("::1", 0))
        squat.listen()
        port = squat.getsockname()[1]
        replica = socket.socket()
        try:
            replica.bind(("0.0.0.0", port))
            break
        except OSError:
            replica.close()
            squat.close()
    else:
        pytest.fail("no port free on both [::1] and 0.0.0.0 in 50 tries")
    replica.listen()
    client = socket.create_connection(("::1", port))
    served, _ = squat.accept()
    try:
        ob, cfg = _observer(), _cfg(port)
        first = _look(ob, cfg)
        served.sendall(b"x" * 1000)
        _recv_exactly(client, 1000)
        second = _look(ob, cfg)
        assert (first.connections, second.connections, second.flowing) == (0, 0, 0)
        assert replica.fileno() > 0
    finally:
        for s in (client, served, squat, replica):
            s.close()


# --- another user's sockets never fill the replica's view (issue 41 item 3, row 3) --------------

FLOOD = """
import socket, sys, time
family, host, port, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
listener = socket.socket(family)
if family == socket.AF_INET6:
    listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
listener.bind((host, port))
listener.listen(4096)
pairs = []
for _ in range(n):
    client = socket.create_connection((host, port))
    served, _ = listener.accept()
    pairs.append((client, served))
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a process as user nobody: needs root (make test runs as root)")
@pytest.mark.parametrize(("replica_host", "flood"), [
    ("127.0.0.1", (socket.AF_INET, "127.0.0.2")),  # the row: nobody on 127.0.0.2:P
    ("0.0.0.0", (socket.AF_INET6, "::1")),  # a wildcard replica, nobody on [::1]:P beside it
])
def test_another_users_sockets_on_the_port_neither_fill_nor_hide_the_replicas_own(replica_host, flood):
    """Row 3 of issue 41: nobody's 54,000 sockets on 127.0.0.2-4:P truncated the view (its bound),
    the replica's own flowing connections were not in it, and a serving replica was restarted.
    Here 300 of nobody's connections (600 sockets) against a bound of 100: the replica's three
    connections are all seen, and the view is whole."""
    import subprocess

    lp = Loop(host=replica_host)
    family, host = flood
    # the system's python3: the venv's may lie under /root, which nobody cannot enter
    python = NOBODY_PYTHON
    hog = subprocess.Popen([python, "-c", FLOOD, str(int(family)), host, str(lp.port), "300"],
                           stdout=subprocess.PIPE, text=True, preexec_fn=as_nobody)
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "ready", hog.poll()
        for _ in range(3):
            lp.connect()
        cfg = _cfg(lp.port)
        ob = ConnObserver(recognise_self=False, mounts=CgroupMounts(), limit=100)
        view = _look(ob, cfg)
        assert not view.truncated and view.connections == 3, view
        before = read_table({lp.port}, limit=100)  # the port alone, as the look read it before
        assert before.truncated
    finally:
        hog.kill()
        hog.wait()
        lp.close()


def test_the_filter_the_kernel_runs_keeps_to_the_listeners_address_and_cgroup():
    """The bytecode is accepted by the kernel (a bad jump is EINVAL) and does what it says: a
    clause of the listener's port, cgroup and address; a wildcard's clause leaves out the
    addresses other listeners hold."""
    from guardian.observe.netlink import program, read_filtered
    from guardian.observe.sockets import listener_table

    lp = Loop()
    try:
        lp.connect()
        (mine,) = listener_table({lp.port})
        assert mine.cgroup_id is not None
        got = read_filtered(program([conns.server_clause(mine, [mine])]), frozenset({lp.port}))
        assert [(s.local, s.lport) for s in got.socks] == [("127.0.0.1", lp.port)]
        other = replace_cgroup(mine, mine.cgroup_id + 1)
        assert read_filtered(program([conns.server_clause(other, [other])]), frozenset({lp.port})).socks == ()
        wild = Listener(socket.AF_INET, "0.0.0.0", lp.port, mine.inode, mine.cgroup_id)
        shadowed = Listener(socket.AF_INET, "127.0.0.1", lp.port, 1, None)
        assert read_filtered(program([conns.server_clause(wild, [wild, shadowed])]), frozenset({lp.port})).socks == ()
        two = [conns.server_clause(other, [other]), conns.server_clause(mine, [mine])]  # the second clause holds
        assert len(read_filtered(program(two), frozenset({lp.port})).socks) == 1
    finally:
        lp.close()


def replace_cgroup(x: Listener, cgroup_id: int) -> Listener:
    return Listener(x.family, x.address, x.port, x.inode, cgroup_id)


def test_a_pin_without_an_address_falls_back_to_its_urls_host(loop):
    """A host that did not resolve this tick: the replica's view is its URL's host's listener, as
    before pins, not an empty view that would hide its flowing responses."""
    from guardian.observe.addresses import Pin

    loop.connect()
    cfg = _cfg(loop.port)
    view = _observer().look_now(cfg, time.monotonic(), {"a": Pin("127.0.0.1", None, error="no answer")})["a"]
    assert view is not None and view.connections == 1


def test_many_local_addresses_ask_for_loopback_by_prefix_and_a_partial_peer_read_leaves_the_view_whole(monkeypatch):
    from guardian.observe.sockets import listener_table

    monkeypatch.setattr(conns, "MAX_PEER_PLACES", 0)
    lp = Loop()
    try:
        pairs = [lp.connect() for _ in range(3)]
        (mine,) = listener_table({lp.port})
        clauses = conns.peer_clauses([_kernel(server) for _client, server in pairs])  # type: ignore[misc]
        assert len(clauses) == 1  # 127.0.0.0/8 on the port: no clause of the port alone
        table = conns.read_owned([mine], [mine], limit=4)  # 3 server ends, room for 1 peer end
        assert not table.truncated and len([s for s in table.socks if s.lport == lp.port]) == 3
        table = conns.read_owned([mine], [mine])
        assert len([s for s in table.socks if s.rport == lp.port]) == 3  # the peers' ends, by the prefix
    finally:
        lp.close()


# --- the peers' ends looked up by their 4-tuples, not dumped (conns.peer_ends) --------------------

def _ends(table: Table) -> set[tuple]:
    return {(s.key, s.inode, s.cgroup_id) for s in table.socks}


def _both_ways(lp: Loop, monkeypatch) -> tuple[Table, Table]:
    """read_owned as a look reads it (the peers' ends looked up), and with the peers' ends dumped."""
    from guardian.observe.sockets import listener_table

    mine = listener_table({lp.port})
    looked_up = conns.read_owned(mine, mine)
    with monkeypatch.context() as m:
        m.setattr(conns, "MAX_LOOKUPS", 0)
        dumped = conns.read_owned(mine, mine)
    return looked_up, dumped


@pytest.mark.parametrize("listen, connect", [
    ((socket.AF_INET, "127.0.0.1"), [(socket.AF_INET, "127.0.0.1")] * 3),
    ((socket.AF_INET6, "::1"), [(socket.AF_INET6, "::1")] * 2),
    # a dual-stack listener: IPv4 clients, and an IPv6 socket talking IPv4 (a v4-mapped address)
    ((socket.AF_INET6, "::"), [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::ffff:127.0.0.1"),
                               (socket.AF_INET6, "::1")]),
])
def test_the_peers_ends_looked_up_are_those_the_dump_finds(monkeypatch, listen, connect):
    family, host = listen
    lp = Loop(family, host)
    try:
        for client_family, to in connect:
            client = socket.socket(client_family)
            client.connect((to, lp.port))
            server, _ = lp.srv.accept()
            lp.open += [client, server]
        looked_up, dumped = _both_ways(lp, monkeypatch)
        assert _ends(looked_up) == _ends(dumped) and not looked_up.truncated
        assert len(conns.local_peers(looked_up.socks, {lp.port})) == len(connect)
    finally:
        lp.close()


def test_a_peer_closing_or_gone_is_looked_up_as_the_dump_finds_it(monkeypatch):
    lp = Loop()
    try:
        half, _served = lp.connect()
        half.shutdown(socket.SHUT_WR)  # the client's end is no longer established (FIN_WAIT2)
        lp.connect()
        key = ("127.0.0.1", half.getsockname()[1], "127.0.0.1", lp.port)
        _until(lambda: not conns.read_exact([key])[0].established, "the client's FIN_WAIT2")  # type: ignore[union-attr]
        looked_up, dumped = _both_ways(lp, monkeypatch)
        assert _ends(looked_up) == _ends(dumped)
        assert len(conns.local_peers(looked_up.socks, {lp.port})) == 1
    finally:
        lp.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="SO_BINDTODEVICE needs CAP_NET_RAW")
def test_a_client_bound_to_a_device_is_not_found_by_its_4_tuple_and_the_peers_are_dumped(monkeypatch):
    """A lookup by 4-tuple does not find a socket bound to a device: a peer not there at an address
    of this box makes the look dump the peers' ends, as before."""
    lp = Loop()
    try:
        bound = socket.socket()
        bound.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b"lo")
        bound.connect(("127.0.0.1", lp.port))
        server, _ = lp.srv.accept()
        lp.open += [bound, server]
        (server_end,) = [s for s in read_table({lp.port}).socks if s.lport == lp.port]
        assert conns.read_exact([server_end.peer_key]) == [errno.ENOENT]  # there, but not by its 4-tuple
        assert conns.peer_ends([server_end], [socket.AF_INET]) is None
        looked_up, dumped = _both_ways(lp, monkeypatch)
        assert _ends(looked_up) == _ends(dumped) and len(conns.local_peers(looked_up.socks, {lp.port})) == 1
    finally:
        lp.close()


def test_a_peer_not_there_at_an_address_of_another_box_is_a_remote_client():
    remote = Sock("127.0.0.1", 8001, "192.0.2.7", 40000, inode=5)  # TEST-NET-1: no box's address
    assert conns.peer_ends([remote], [socket.AF_INET]) == []
    assert conns.is_local("127.0.0.1") and conns.is_local("127.9.9.9") and conns.is_local("::1")
    assert not conns.is_local("192.0.2.7") and not conns.is_local("2001:db8::7")
    assert conns.is_local("fe80::1")  # link-local: not known without its interface, taken to be


def test_guardians_own_sockets_are_read_only_where_a_peers_cgroup_cannot_say(monkeypatch):
    """A socket is made in its maker's cgroup: where each peer's cgroup and guardian's are known,
    they say alone whether the peer is guardian's, and /proc/self/fd is not read."""
    reads: list[int] = []
    monkeypatch.setattr(conns, "own_socket_inodes", lambda: reads.append(1) or frozenset({7}))
    g = "/system.slice/guardian.service"
    dirs = {1: g, 2: "/system.slice/nginx.service"}
    mine, nginx, unnamed = (Sock("127.0.0.1", 40000 + i, "127.0.0.1", PORT, inode=7 + i, cgroup_id=c)
                            for i, c in enumerate((1, 2, None)))
    assert conns.own_sockets([mine, nginx], dirs, g) == frozenset() and reads == []
    assert conns.own_sockets([], dirs, None) == frozenset() and reads == []
    assert conns.own_sockets([mine, unnamed], dirs, g) == {7} and len(reads) == 1  # no cgroup id (Linux < 5.7)
    assert conns.own_sockets([mine], dirs, None) == {7} and len(reads) == 2  # guardian outside a unit
    gone = Sock("127.0.0.1", 40009, "127.0.0.1", PORT, inode=9, cgroup_id=3)  # a cgroup removed since
    assert conns.own_sockets([gone], dirs, g) == {7} and len(reads) == 3
    # and the verdicts are those the inodes would have given
    who = Who(cgroups=dirs, guardian_cgroup=g)
    server = Sock("127.0.0.1", PORT, "127.0.0.1", 40000, inode=1)
    assert classify(server, mine, who)[0] is PeerKind.GUARDIAN
    assert classify(replace(server, rport=40001), nginx, who) == (PeerKind.OTHER, "nginx.service")


def test_a_peer_gone_with_its_connection_since_the_dump_is_no_reason_to_dump_again():
    """guardian's own probes often end while a look walks the table: a peer's end not there, at an
    address of this box, whose server end is no longer established, was no established socket."""
    lp = Loop()
    try:
        client, server = lp.connect()
        (server_end,) = [s for s in read_table({lp.port}).socks if s.lport == lp.port]
        server.close()  # the server closes first (as vLLM does after an answer): the client's end goes
        client.close()
        _until(lambda: conns.read_exact([server_end.peer_key]) == [errno.ENOENT], "the client's end to go")
        assert conns.peer_ends([server_end], [socket.AF_INET]) == []
        assert conns.closed_since([server_end])
    finally:
        lp.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="SO_BINDTODEVICE needs CAP_NET_RAW")
def test_a_socket_bound_to_a_device_says_which():
    lp = Loop()
    try:
        bound = socket.socket()
        bound.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b"lo")
        bound.connect(("127.0.0.1", lp.port))
        lp.open += [bound, lp.srv.accept()[0]]
        ends = {s.lport == lp.port: s for s in read_table({lp.port}).socks}
        assert ends[False].bound_if == socket.if_nametoindex("lo") and ends[True].bound_if == 0
        assert not conns.closed_since([replace(ends[True], bound_if=1)])  # gone or not, it cannot say
    finally:
        lp.close()
