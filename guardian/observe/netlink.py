"""sock_diag for the established TCP sockets on the replicas' ports: the bytecode filter of the
ports, one dump read within its bounds (read_table, in a thread), and each message parsed into a
Sock record (parse_sock: its addresses, inode, cgroup id and the tcp_info fields guardian reads).
Bytes to records only; observe/conns.py classifies them.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .sockets import (
    DIAG_MSG_SIZE,
    INET_DIAG_CGROUP_ID,
    sock_diag_dump,
    sock_diag_lookup,
)

MAX_SOCKETS = 50_000  # messages read in one look; past it the view is partial (truncated)
READ_TIMEOUT_S = 1.0  # each read from the netlink socket (the kernel answers in microseconds)
READ_BUDGET_S = 1.0  # a whole look's dump; past it the view is partial (truncated)

_TCP_ESTABLISHED = 1
_INET_DIAG_INFO = 2  # the attribute carrying struct tcp_info
_EXT_INFO = 1 << (_INET_DIAG_INFO - 1)

# struct tcp_info (include/uapi/linux/tcp.h): 8 u8 fields, then u32 tcpi_rto at 8 ... tcpi_fackets
# at 40; tcpi_last_data_sent 44, tcpi_last_ack_sent 48, tcpi_last_data_recv 52 (ms ago); u32
# metrics up to tcpi_total_retrans at 100; u64 tcpi_pacing_rate 104, tcpi_max_pacing_rate 112,
# tcpi_bytes_acked 120, tcpi_bytes_received 128 (Linux >= 4.1); u32 tcpi_segs_out 136, segs_in
# 140, notsent_bytes 144, min_rtt 148, data_segs_in 152, tcpi_data_segs_out 156 (Linux >= 4.6);
# u64 delivery_rate 160, busy_time 168, rwnd_limited 176, sndbuf_limited 184; u32 delivered 192,
# delivered_ce 196; u64 tcpi_bytes_sent 200, tcpi_bytes_retrans 208 (Linux >= 4.19).
# Checked against getsockopt(TCP_INFO) and bytes sent over loopback (tests/test_conns.py). A
# shorter attribute (an older kernel) lacks the later fields: they are unknown.
_TCPI_LAST_DATA_SENT = 44
_TCPI_LAST_DATA_RECV = 52
_TCPI_BYTES_ACKED = 120
_TCPI_BYTES_RECEIVED = 128
_TCPI_NOTSENT_BYTES = 144
_TCPI_DATA_SEGS_OUT = 156
_TCPI_BYTES_SENT = 200
_TCPI_BYTES_RETRANS = 208
_U32 = struct.Struct("=I")
_U64 = struct.Struct("=Q")

# struct inet_diag_msg: family, state, timer, retrans (u8); inet_diag_sockid: sport, dport
# (big-endian u16) at 4 and 6, src and dst (16 bytes each, IPv4 in the first 4) at 8 and 24,
# interface, cookie; then expires, rqueue, wqueue, uid, inode (u32) at 68.
_PORTS = struct.Struct(">HH")
_INODE = struct.Struct("=I")
_V4_MAPPED = bytes(10) + b"\xff\xff"

# inet_diag bytecode (include/uapi/linux/inet_diag.h), run by the kernel on each socket.
_BC_OP = struct.Struct("=BBH")  # code, yes (bytes to the next op if true), no (if false)
_BC_JMP, _BC_S_GE, _BC_S_LE, _BC_D_GE, _BC_D_LE = 1, 2, 3, 4, 5
_BC_S_COND, _BC_D_COND, _BC_CGROUP_COND = 7, 8, 13  # CGROUP_COND: Linux >= 5.10
_HOSTCOND = struct.Struct("=BBxxi")  # inet_diag_hostcond: family, prefix_len, port (-1: any); then the address

Key = tuple[str, int, str, int]  # (local address, local port, remote address, remote port)


@dataclass(frozen=True, slots=True)
class Sock:
    """One established TCP socket as the kernel shows it. Addresses are text, an IPv4-mapped IPv6
    address as IPv4; a tcp_info field is None where the kernel did not send it."""

    local: str
    lport: int
    remote: str
    rport: int
    inode: int = 0  # 0: not accepted yet (no file)
    cgroup_id: int | None = None  # the cgroup (v2) of the process that created it (Linux >= 5.7)
    last_sent_ms: int | None = None  # tcpi_last_data_sent: ms since data was last sent
    last_recv_ms: int | None = None  # tcpi_last_data_recv: ms since data was last received
    bytes_acked: int | None = None  # tcpi_bytes_acked: bytes sent and acked by the peer
    bytes_received: int | None = None  # tcpi_bytes_received
    data_segs_out: int | None = None  # tcpi_data_segs_out: segments with data sent
    # What the process wrote to it (its write sequence): bytes sent once (tcpi_bytes_sent less
    # tcpi_bytes_retrans) plus those still queued (tcpi_notsent_bytes); Linux >= 4.19. A frozen
    # process's kernel keeps sending its buffer to a slow reader: acked bytes grow, this does not.
    bytes_written: int | None = None
    bound_if: int = 0  # the interface it is bound to (SO_BINDTODEVICE, an IPv6 link-local address); 0: none

    @property
    def key(self) -> Key:
        return (self.local, self.lport, self.remote, self.rport)

    @property
    def peer_key(self) -> Key:
        """The key of the socket at the other end, if it is on this machine."""
        return (self.remote, self.rport, self.local, self.lport)


@dataclass(frozen=True)
class Table:
    socks: tuple[Sock, ...]
    truncated: bool = False


# --- the kernel (netlink) ----------------------------------------------------------------------


def port_filter(ports: Iterable[int]) -> bytes:
    """inet_diag bytecode for "the local or the remote port is one of PORTS", as `ss` builds
    `sport = :P or dport = :P ...`: the kernel sends only those sockets, however many others the
    box has. Each alternative is a >= and a <= test (16 bytes); a true one jumps to the end (the
    socket is sent), a false one to the next alternative, past the end after the last (not sent).
    """
    conds = [(_BC_S_GE, _BC_S_LE, p) for p in sorted(set(ports))]
    conds += [(_BC_D_GE, _BC_D_LE, p) for p in sorted(set(ports))]
    total = 20 * len(conds) - 4
    out = bytearray()
    for i, (ge, le, port) in enumerate(conds):
        out += _BC_OP.pack(ge, 8, 20) + _BC_OP.pack(0, 0, port)
        out += _BC_OP.pack(le, 8, 12) + _BC_OP.pack(0, 0, port)
        if i < len(conds) - 1:
            out += _BC_OP.pack(_BC_JMP, 4, total - len(out))  # both true: to the end
    return bytes(out)


# A filter as the kernel runs it: an OR of clauses, each an AND of tests (a test: its op code, its
# operand, and whether it is negated). The kernel's audit of a filter (inet_diag_bc_audit) walks the
# "yes" jumps only and wants them to end exactly at the end, so a test's yes is always the next op;
# a false test jumps to the next clause, past the end after the last one (not sent); a negated test
# is followed by a JMP (which always takes its "no") to the clause's failure.
Test = tuple[int, bytes, bool]
Clause = Sequence[Test]


def program(clauses: Sequence[Clause]) -> bytes:
    """The bytecode of CLAUSES (an OR of ANDs; a socket is sent when one clause holds)."""

    def size(t: Test) -> int:
        return 4 + len(t[1]) + (4 if t[2] else 0)

    sizes = [sum(size(t) for t in c) + (4 if i < len(clauses) - 1 else 0) for i, c in enumerate(clauses)]
    total = sum(sizes)
    out = bytearray()
    start = 0
    for i, clause in enumerate(clauses):
        fail = start + sizes[i] if i < len(clauses) - 1 else total + 4
        for code, operand, negated in clause:
            op_size = 4 + len(operand)
            if negated:
                out += _BC_OP.pack(code, op_size, op_size + 4) + operand
                out += _BC_OP.pack(_BC_JMP, 4, fail - len(out))
            else:
                out += _BC_OP.pack(code, op_size, fail - len(out)) + operand
        if i < len(clauses) - 1:
            out += _BC_OP.pack(_BC_JMP, 4, total - len(out))  # the clause held: to the end (sent)
        start += sizes[i]
    return bytes(out)


def port_is(port: int, local: bool = True) -> list[Test]:
    """The socket's local (else remote) port is PORT: a >= and a <= test, as `ss` builds them."""
    ge, le = (_BC_S_GE, _BC_S_LE) if local else (_BC_D_GE, _BC_D_LE)
    operand = _BC_OP.pack(0, 0, port)
    return [(ge, operand, False), (le, operand, False)]


def address_is(address: str, local: bool = True, negated: bool = False, prefix_len: int | None = None) -> Test:
    """The socket's local (else remote) address is ADDRESS, or within ADDRESS/PREFIX_LEN (an IPv4
    one matches its IPv4-mapped form on an IPv6 socket too, as the kernel compares them)."""
    ip = ipaddress.ip_address(address)
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    bits = 8 * len(ip.packed) if prefix_len is None else prefix_len
    operand = _HOSTCOND.pack(family, bits, -1) + ip.packed
    return (_BC_S_COND if local else _BC_D_COND, operand, negated)


def ipv4_local() -> Test:
    """The socket's local address is IPv4 (or IPv4-mapped): a /0 IPv4 host condition."""
    return (_BC_S_COND, _HOSTCOND.pack(socket.AF_INET, 0, -1) + bytes(4), False)


_cgroup_filter = [True]  # until a kernel older than 5.10 refuses the cgroup test (EINVAL)


def cgroup_is_known() -> bool:
    """Whether the kernel takes a cgroup test in a filter (not refused yet)."""
    return _cgroup_filter[0]


def cgroup_filter_refused() -> None:
    """The kernel refused a filter with a cgroup test: filters are built without one from now on."""
    _cgroup_filter[0] = False


def cgroup_is(cgroup_id: int) -> Test:
    """The socket was made in the cgroup (v2) CGROUP_ID; an accepted socket has its listener's."""
    return (_BC_CGROUP_COND, _U64.pack(cgroup_id), False)


def _address(family: int, raw: bytes) -> str:
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[:4])
    if raw[:12] == _V4_MAPPED:
        return socket.inet_ntop(socket.AF_INET, raw[12:16])
    return socket.inet_ntop(socket.AF_INET6, raw)


def _field(info: bytes, offset: int, fmt: struct.Struct) -> int | None:
    return int(fmt.unpack_from(info, offset)[0]) if len(info) >= offset + fmt.size else None


# The eight tcp_info fields in one unpack, from tcpi_last_data_sent (44) to past tcpi_bytes_retrans
# (208): a look parses every socket on the replicas' ports, both ends of a local connection.
_TCPI_ALL = struct.Struct("=I4xI64xQQ8xI8xI40xQQ")
_TCPI_ALL_END = _TCPI_LAST_DATA_SENT + _TCPI_ALL.size
_RTA = struct.Struct("=HH")
_ATTRS_AT = DIAG_MSG_SIZE


def parse_sock(data: bytes, body: int, end: int) -> Sock:
    """One inet_diag_msg at DATA[BODY:END] (sock_diag_dump's triple) and its attributes."""
    family = data[body]
    sport, dport = _PORTS.unpack_from(data, body + 4)
    (bound_if,) = _U32.unpack_from(data, body + 40)  # inet_diag_sockid's idiag_if
    (inode,) = _INODE.unpack_from(data, body + 68)
    cgroup_id: int | None = None
    info_at, info_len = -1, 0
    at = body + _ATTRS_AT
    while at + 4 <= end:  # the attributes (diag_attributes, inline: this runs once per socket)
        length, kind = _RTA.unpack_from(data, at)
        if length < 4:
            break
        if kind == _INET_DIAG_INFO:
            info_at, info_len = at + 4, min(length, end - at) - 4
        elif kind == INET_DIAG_CGROUP_ID and length >= 12:
            (cgroup_id,) = _U64.unpack_from(data, at + 4)
        at += (length + 3) & ~3
    sent = recv = acked = received = segs = notsent = bytes_sent = retrans = None
    if info_len >= _TCPI_ALL_END:
        sent, recv, acked, received, notsent, segs, bytes_sent, retrans = _TCPI_ALL.unpack_from(
            data, info_at + _TCPI_LAST_DATA_SENT
        )
    elif info_at >= 0:  # an older kernel's shorter tcp_info: the fields it has
        info = data[info_at : info_at + info_len]
        sent = _field(info, _TCPI_LAST_DATA_SENT, _U32)
        recv = _field(info, _TCPI_LAST_DATA_RECV, _U32)
        acked = _field(info, _TCPI_BYTES_ACKED, _U64)
        received = _field(info, _TCPI_BYTES_RECEIVED, _U64)
        notsent = _field(info, _TCPI_NOTSENT_BYTES, _U32)
        segs = _field(info, _TCPI_DATA_SEGS_OUT, _U32)
        bytes_sent = _field(info, _TCPI_BYTES_SENT, _U64)
        retrans = _field(info, _TCPI_BYTES_RETRANS, _U64)
    written = None
    if bytes_sent is not None and retrans is not None and notsent is not None:
        written = bytes_sent - retrans + notsent
    return Sock(
        local=_address(family, data[body + 8 : body + 24]),
        lport=sport,
        remote=_address(family, data[body + 24 : body + 40]),
        rport=dport,
        inode=inode,
        cgroup_id=cgroup_id,
        last_sent_ms=sent,
        last_recv_ms=recv,
        bytes_acked=acked,
        bytes_received=received,
        data_segs_out=segs,
        bytes_written=written,
        bound_if=bound_if,
    )


def read_table(
    ports: Iterable[int],
    limit: int = MAX_SOCKETS,
    timeout_s: float = READ_TIMEOUT_S,
    budget_s: float = READ_BUDGET_S,
) -> Table:
    """The established TCP sockets (IPv4, then IPv6) whose local or remote port is one of PORTS,
    with tcp_info and cgroup id: one dump per family. At most LIMIT messages are read and for at
    most BUDGET_S (then truncated); each read waits at most TIMEOUT_S. Raises OSError."""
    wanted = frozenset(ports)
    if not wanted:
        return Table(())
    return read_filtered(port_filter(wanted), wanted, Bounds(limit, timeout_s, budget_s))


@dataclass(frozen=True)
class Bounds:
    """How much one look reads: LIMIT messages, each read waiting TIMEOUT_S, all within BUDGET_S."""

    limit: int = MAX_SOCKETS
    timeout_s: float = READ_TIMEOUT_S
    budget_s: float = READ_BUDGET_S


BOTH_FAMILIES = (socket.AF_INET, socket.AF_INET6)


def read_filtered(
    bytecode: bytes, ports: frozenset[int], bounds: Bounds = Bounds(), families: Sequence[int] = BOTH_FAMILIES
) -> Table:
    """The established TCP sockets of FAMILIES (IPv4, then IPv6) that BYTECODE lets through, with
    tcp_info and cgroup id, of those whose local or remote port is one of PORTS (the kernel's
    filter, checked): one dump per family, within BOUNDS (past them, truncated). Raises OSError."""
    deadline = time.monotonic() + bounds.budget_s
    socks: list[Sock] = []
    read = 0
    for family in families:
        dump = sock_diag_dump(family, 1 << _TCP_ESTABLISHED, _EXT_INFO, bytecode, bounds.timeout_s)
        with contextlib.closing(dump):
            for data, body, end in dump:
                read += 1
                if read > bounds.limit or time.monotonic() > deadline:
                    return Table(tuple(socks), truncated=True)
                sock = parse_sock(data, body, end)
                if sock.lport in ports or sock.rport in ports:
                    socks.append(sock)
    return Table(tuple(socks))


@dataclass(frozen=True)
class Found:
    """A socket looked up by its 4-tuple (read_exact): its record, family and TCP state."""

    sock: Sock
    family: int
    established: bool


def _packed(address: str) -> tuple[int, bytes]:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    return family, socket.inet_pton(family, address).ljust(16, b"\0")


def read_exact(keys: Sequence[Key], timeout_s: float = READ_TIMEOUT_S) -> list[Found | int]:
    """The socket at each of KEYS (local address, port, remote address, port; IPv4 as IPv4, which
    finds an IPv6 socket talking IPv4 too), with tcp_info and cgroup id: looked up one by one in the
    kernel's hash, no walk of its table. Each, in KEYS' order: Found, or the kernel's errno (ENOENT:
    none there). Raises OSError."""
    wanted = []
    for local, lport, remote, rport in keys:
        family, src = _packed(local)
        wanted.append((family, src, lport, _packed(remote)[1], rport))
    out: list[Found | int] = []
    for answer in sock_diag_lookup(wanted, _EXT_INFO, timeout_s):
        if isinstance(answer, int):
            out.append(answer)
            continue
        data, body, end = answer
        out.append(Found(parse_sock(data, body, end), data[body], data[body + 1] == _TCP_ESTABLISHED))
    return out
