"""Who listens on a TCP port: the kernel's listening sockets, and which process holds one."""

from __future__ import annotations

import functools
import ipaddress
import os
import re
import socket
import struct
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import psutil


def listeners(wanted: Mapping[int, str]) -> dict[int, int | None] | None:
    """Port -> PID of the listener that serves WANTED's host on it (port -> host; see serving;
    None: listening, but the PID is hidden from us).

    Ports where nothing serves that host are absent. None as a whole: the socket table could not be read.
    """
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return None
    pids: dict[Listener, int | None] = {}
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in wanted:
            key = Listener(c.family, str(c.laddr.ip), c.laddr.port, 0)
            if pids.get(key) is None:
                pids[key] = c.pid
    found: dict[int, int | None] = {}
    for port, host in wanted.items():
        x = serving(pids, host, port)
        if x is not None:
            found[port] = pids[x]
    return found


# sock_diag (netlink), as `ss -ltn` does: the kernel walks only its table of listening sockets.
# /proc/net/tcp walks every TCP socket on the host, whatever the namespace, which made reading
# it the costliest part of a tick on a busy box.
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_TCP_LISTEN = 10
_NLMSG_HDR = struct.Struct("=IHHII")
_DIAG_REQ = struct.Struct("=BBBxI48x")  # inet_diag_req_v2, an all-zero inet_diag_sockid
_DIAG_MSG_SPORT = struct.Struct(">H")  # at offset 4 of inet_diag_msg
_DIAG_MSG_INODE = struct.Struct("=I")  # at offset 68
DIAG_MSG_SIZE = 72
_RTA_HDR = struct.Struct("=HH")
_INET_DIAG_REQ_BYTECODE = 1  # the request's attribute carrying a filter
INET_DIAG_CGROUP_ID = 21  # Linux >= 5.7: the cgroup the socket was created in, always sent
_U64 = struct.Struct("=Q")


class SockDiagError(OSError):
    pass


def diag_attributes(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(type, start, end of the value) of each attribute that follows an inet_diag_msg in DATA[START:END]."""
    while start + _RTA_HDR.size <= end:
        length, kind = _RTA_HDR.unpack_from(data, start)
        if length < _RTA_HDR.size:
            return
        yield kind, start + _RTA_HDR.size, min(start + length, end)
        start += (length + 3) & ~3


def _cgroup_id(data: bytes, start: int, end: int) -> int | None:
    """INET_DIAG_CGROUP_ID among the attributes that follow an inet_diag_msg, if the kernel sent it."""
    for kind, value, value_end in diag_attributes(data, start, end):
        if kind == INET_DIAG_CGROUP_ID and value_end - value >= _U64.size:
            return int(_U64.unpack_from(data, value)[0])
    return None


def sock_diag_dump(
    family: int, states: int, ext: int = 0, bytecode: bytes = b"", timeout_s: float = 2.0
) -> Generator[tuple[bytes, int, int], None, None]:
    """Each TCP socket of FAMILY in one of STATES (a mask of 1 << TCP state) that the kernel dumps,
    as (buffer, start of its inet_diag_msg, end of its message): the attributes follow the
    message's DIAG_MSG_SIZE bytes. EXT asks for extensions (1 << (INET_DIAG_x - 1)); BYTECODE is
    an inet_diag filter the kernel runs on each socket. TIMEOUT_S bounds each read. Raises OSError
    (SockDiagError for the kernel's own error). The netlink socket is closed when the generator
    is, so a reader may stop early.
    """
    req = _DIAG_REQ.pack(family, socket.IPPROTO_TCP, ext, states)
    if bytecode:
        req += _RTA_HDR.pack(_RTA_HDR.size + len(bytecode), _INET_DIAG_REQ_BYTECODE) + bytecode
    hdr = _NLMSG_HDR.pack(_NLMSG_HDR.size + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(timeout_s)
        nl.sendall(hdr + req)
        while True:
            data = nl.recv(65536)
            if not data:
                raise SockDiagError("sock_diag: the kernel closed the socket")
            offset = 0
            while offset + _NLMSG_HDR.size <= len(data):
                length, kind, _flags, _seq, _pid = _NLMSG_HDR.unpack_from(data, offset)
                if length < _NLMSG_HDR.size:
                    raise SockDiagError("sock_diag: malformed reply")
                body = offset + _NLMSG_HDR.size
                if kind == _NLMSG_DONE:
                    return
                if kind == _NLMSG_ERROR:
                    (errno_neg,) = struct.unpack_from("=i", data, body)
                    raise SockDiagError(-errno_neg, f"sock_diag: {os.strerror(-errno_neg)}")
                if kind == _SOCK_DIAG_BY_FAMILY and length >= _NLMSG_HDR.size + DIAG_MSG_SIZE:
                    yield data, body, min(offset + length, len(data))
                offset += (length + 3) & ~3


# An exact request: inet_diag_req_v2 with its inet_diag_sockid filled in (ports big-endian, then the
# two addresses, the interface, and the cookie: all ones is "any cookie", INET_DIAG_NOCOOKIE).
_DIAG_REQ_HEAD = struct.Struct("=BBBxI")  # family, protocol, ext, states
_SOCKID = struct.Struct(">HH16s16s")
_SOCKID_TAIL = struct.Struct("=I8s")  # idiag_if (0: any interface), idiag_cookie
_NOCOOKIE = b"\xff" * 8
LOOKUPS_PER_SEND = 32  # their answers (about 1 KiB each in the kernel's accounting) fit a receive buffer


def sock_diag_lookup(
    wanted: Sequence[tuple[int, bytes, int, bytes, int]], ext: int = 0, timeout_s: float = 2.0
) -> list[tuple[bytes, int, int] | int]:
    """Each TCP socket of WANTED (family, local address packed, local port, remote address packed,
    remote port) looked up by its 4-tuple, as `ss` asks for one socket: the kernel finds it in its
    hash, without the walk of its whole table that a dump is. For each, in WANTED's order: as
    sock_diag_dump yields it, or the kernel's errno (ENOENT: no such socket). Whatever its state
    (the kernel's lookup also finds a listener or a TIME_WAIT socket there): the caller checks.
    Raises OSError."""
    out: list[tuple[bytes, int, int] | int | None] = [None] * len(wanted)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(timeout_s)
        for first in range(0, len(wanted), LOOKUPS_PER_SEND):
            batch = wanted[first : first + LOOKUPS_PER_SEND]
            msgs = bytearray()
            for seq, (family, local, lport, remote, rport) in enumerate(batch, first + 1):
                req = _DIAG_REQ_HEAD.pack(family, socket.IPPROTO_TCP, ext, 0xFFFFFFFF)
                req += _SOCKID.pack(lport, rport, local, remote) + _SOCKID_TAIL.pack(0, _NOCOOKIE)
                msgs += _NLMSG_HDR.pack(_NLMSG_HDR.size + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, seq, 0) + req
            nl.sendall(msgs)
            left = len(batch)
            while left:
                data = nl.recv(65536)
                if not data:
                    raise SockDiagError("sock_diag: the kernel closed the socket")
                offset = 0
                while offset + _NLMSG_HDR.size <= len(data):
                    length, kind, _flags, seq, _pid = _NLMSG_HDR.unpack_from(data, offset)
                    if length < _NLMSG_HDR.size:
                        raise SockDiagError("sock_diag: malformed reply")
                    body = offset + _NLMSG_HDR.size
                    at = seq - 1
                    if first <= at < first + len(batch) and out[at] is None:
                        if kind == _NLMSG_ERROR:
                            (errno_neg,) = struct.unpack_from("=i", data, body)
                            if errno_neg == 0:  # an acknowledgement (none was asked for): no answer
                                offset += (length + 3) & ~3
                                continue
                            out[at] = -errno_neg
                            left -= 1
                        elif kind == _SOCK_DIAG_BY_FAMILY and length >= _NLMSG_HDR.size + DIAG_MSG_SIZE:
                            out[at] = (data, body, min(offset + length, len(data)))
                            left -= 1
                    offset += (length + 3) & ~3
    return [x for x in out if x is not None]  # each was answered (LEFT counted them down)


_DIAG_MSG_SRC = 8  # idiag_src: 16 bytes (IPv4 in the first 4) at offset 8 of inet_diag_msg


@dataclass(frozen=True, slots=True)
class Listener:
    """One listening TCP socket: where it is bound, and who made it."""

    family: int  # socket.AF_INET or socket.AF_INET6
    address: str  # "0.0.0.0", "::", "127.0.0.1", "::1" ...; "" where not known
    port: int
    inode: int
    cgroup_id: int | None = None  # the cgroup (v2) of the process that created it; None: not known


def _sock_diag_listeners(family: int) -> list[Listener]:
    """Every listening TCP socket of FAMILY in guardian's network namespace."""
    out: list[Listener] = []
    size = 4 if family == socket.AF_INET else 16
    for data, body, end in sock_diag_dump(family, 1 << _TCP_LISTEN):
        (port,) = _DIAG_MSG_SPORT.unpack_from(data, body + 4)
        (inode,) = _DIAG_MSG_INODE.unpack_from(data, body + 68)
        raw = data[body + _DIAG_MSG_SRC : body + _DIAG_MSG_SRC + size]
        address = str(ipaddress.ip_address(raw)) if len(raw) == size else ""
        out.append(Listener(family, address, port, inode, _cgroup_id(data, body + DIAG_MSG_SIZE, end)))
    return out


def listener_table(ports: set[int]) -> list[Listener] | None:
    """The listening sockets on PORTS, IPv4 first (netlink, else /proc/net without cgroup ids).
    None: the kernel's socket tables could not be read at all."""
    try:
        return netlink_listener_table(ports)
    except OSError:
        return _proc_net_listeners(ports)


def netlink_listener_table(ports: set[int]) -> list[Listener]:
    """listener_table by netlink alone: the kernel walks its listening hash, a fraction of a ms, so a
    caller may read it on its event loop. Raises OSError where netlink cannot be read."""
    families = (socket.AF_INET, socket.AF_INET6)
    return [x for family in families for x in _sock_diag_listeners(family) if x.port in ports]


Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _places(host: str) -> list[Address] | None:
    """The addresses a connection to HOST goes to; None for a name guardian does not resolve."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return [ipaddress.IPv4Address("127.0.0.1"), ipaddress.IPv6Address("::1")]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return [ip.ipv4_mapped]
    return [ip]


def _binds(ip: Address) -> list[tuple[int, Address]]:
    """The bindings that take a connection to IP, in the kernel's order: the exact address, then
    its family's wildcard; an IPv4 one, then an IPv6 socket bound to it mapped or to "::"
    (dual-stack, which a v4 socket on the port would have refused)."""
    if isinstance(ip, ipaddress.IPv4Address):
        return [
            (socket.AF_INET, ip),
            (socket.AF_INET, ipaddress.IPv4Address("0.0.0.0")),
            (socket.AF_INET6, ipaddress.IPv6Address(f"::ffff:{ip}")),
            (socket.AF_INET6, ipaddress.IPv6Address("::")),
        ]
    return [(socket.AF_INET6, ip), (socket.AF_INET6, ipaddress.IPv6Address("::"))]


@functools.lru_cache(maxsize=1024)
def takes(listener: Listener, local: str) -> bool:
    """Whether LISTENER takes a connection to its port at address LOCAL (a socket's local address
    as text): LOCAL's bindings (_binds, as serving uses them) include the listener's. One whose
    address is not known (/proc/net unreadable) takes any. Cached: a look asks it for thousands
    of sockets, which have a few local addresses between them."""
    if not listener.address:
        return True
    try:
        ip = ipaddress.ip_address(local)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return (listener.family, ipaddress.ip_address(listener.address)) in _binds(ip)


def serving(table: Iterable[Listener], host: str, port: int) -> Listener | None:
    """The listener that a connection to HOST:PORT reaches (a replica's URL): the one bound to
    that address, else its family's wildcard. A listener on the same port at another address
    (127.0.0.2, [::1] beside 0.0.0.0) serves other connections, never the replica's. A host
    name other than localhost, or a table without addresses (/proc/net unreadable), gives the
    port's first listener, as a port alone would."""
    on_port = [x for x in table if x.port == port]
    places = _places(host)
    known = [x for x in on_port if x.address]
    if places is None or not known:
        return on_port[0] if on_port else None
    bound = {(x.family, ipaddress.ip_address(x.address)): x for x in reversed(known)}
    for ip in places:
        for key in _binds(ip):
            if key in bound:
                return bound[key]
    return None


Listening = tuple[int, int | None]  # (socket inode, cgroup id of its creator; None: not known)


def listening(wanted: Mapping[int, str]) -> dict[int, Listening] | None:
    """Port -> the listening socket that serves WANTED's host on it (port -> host of a replica's
    URL; see serving). Ports where nothing serves that host are absent. No per-process scan.

    None: the kernel's socket tables could not be read at all. The cgroup id is None where
    netlink is not allowed (the /proc/net fallback) or the kernel is older than 5.7.
    """
    return listening_in(listener_table(set(wanted)), wanted)


def listening_in(table: Sequence[Listener] | None, wanted: Mapping[int, str]) -> dict[int, Listening] | None:
    """listening's answer from TABLE, listener_table's for WANTED's ports (read by the caller)."""
    if table is None:
        return None
    found: dict[int, Listening] = {}
    for port, host in wanted.items():
        x = serving(table, host, port)
        if x is not None:
            found[port] = (x.inode, x.cgroup_id)
    return found


# A socket's cgroup id is the inode of its cgroup's directory in the cgroup2 hierarchy, which
# anyone may read: the port's unit is found without reading other users' /proc/PID/fd, so
# guardian needs neither CAP_SYS_PTRACE nor CAP_DAC_READ_SEARCH. The id names the cgroup of the
# process that *created* the socket; systemd's own (init.scope, socket activation) is not the
# unit that serves on it, so that case is left to the process scan.
CGROUP_ROOT = "/sys/fs/cgroup"
_UNIT_SUFFIXES = (".service", ".scope", ".socket", ".mount", ".swap")
_NOT_AN_OWNER = frozenset({"init.scope"})
_MAX_CGROUP_DIRS = 100_000


MOUNTINFO = "/proc/self/mountinfo"


@dataclass(frozen=True)
class CgroupMounts:
    """Where the cgroup hierarchies are mounted: CGROUP_ROOT on a pure cgroup v2 box (DGX OS),
    /sys/fs/cgroup/unified under systemd's hybrid layout, none of v2 on a v1-only one."""

    unified: str | None = None  # the cgroup2 hierarchy: socket cgroup ids are its directories' inodes
    cpuacct: str | None = None  # cgroup v1's cpuacct controller (cpuacct.usage), where there is one


def _unescape(field: str) -> str:
    """A mountinfo path field: space, tab, newline and backslash are written as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _best(mounts: list[tuple[str, str]]) -> str | None:
    """The first mount of a hierarchy's root, else the first mount (ROOT, MOUNT POINT) of it."""
    return next((point for root, point in mounts if root == "/"), mounts[0][1] if mounts else None)


def parse_mountinfo(text: str) -> CgroupMounts:
    """The cgroup mounts in TEXT, a /proc/PID/mountinfo."""
    unified: list[tuple[str, str]] = []
    cpuacct: list[tuple[str, str]] = []
    for line in text.splitlines():
        fields = line.split()
        try:
            sep = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) < sep + 4:
            continue
        mount = (_unescape(fields[3]), _unescape(fields[4]))
        fstype, options = fields[sep + 1], fields[sep + 3].split(",")
        if fstype == "cgroup2":
            unified.append(mount)
        elif fstype == "cgroup" and "cpuacct" in options:
            cpuacct.append(mount)
    return CgroupMounts(unified=_best(unified), cpuacct=_best(cpuacct))


def cgroup_mounts(mountinfo: str = MOUNTINFO) -> CgroupMounts:
    """This process's cgroup mounts (none known if mountinfo cannot be read)."""
    try:
        with open(mountinfo) as f:
            return parse_mountinfo(f.read())
    except OSError:
        return CgroupMounts()


def cgroup_dirs(root: str = CGROUP_ROOT) -> dict[int, str]:
    """Inode -> path (relative to ROOT, starting with /) of every cgroup directory; {} if not cgroup2."""
    out: dict[int, str] = {}
    try:
        out[os.stat(root).st_ino] = "/"
    except OSError:
        return out
    stack = [root]
    while stack and len(out) < _MAX_CGROUP_DIRS:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        out[e.inode()] = e.path[len(root) :]
                        stack.append(e.path)
        except OSError:
            continue
    return out


def cgroup_v2_path(text: str) -> str | None:
    """The cgroup v2 path in a /proc/PID/cgroup TEXT (its "0::" line), or None (cgroup v1 only)."""
    return next((line[3:].strip() for line in text.splitlines() if line.startswith("0::")), None)


def cgroup_of_pid(pid: int, proc: str = "/proc") -> str | None:
    """PID's cgroup v2 path, or None: gone, unreadable, or no cgroup v2."""
    try:
        with open(f"{proc}/{pid}/cgroup") as f:
            return cgroup_v2_path(f.read())
    except OSError:
        return None


def unit_of_cgroup(path: str) -> str | None:
    """The system unit a cgroup path belongs to: its first component from the root named like a
    unit (slices are only the way there). Below a unit its cgroup is that unit's own (delegated)
    tree, where any name can be made: a user's manager (user@UID.service) makes its units there, so
    ".../user@65534.service/app.slice/vllm-replica@r1.service" is user@65534.service's, never
    the replica's, and a user's ".../nginx.service" is not the proxy."""
    for part in path.strip("/").split("/"):
        if part.endswith(_UNIT_SUFFIXES):
            return None if part in _NOT_AN_OWNER else part
    return None


def first_pid(path: str, root: str = CGROUP_ROOT) -> int | None:
    """A process in the cgroup (for the journal line; cgroup.procs is world-readable)."""
    try:
        with open(f"{root}{path}/cgroup.procs") as f:
            line = f.readline().strip()
        return int(line) if line else None
    except (OSError, ValueError):
        return None


_LISTEN = "0A"


def _proc_address(hex_text: str) -> str:
    """An address of /proc/net/tcp{,6}: 32-bit words in host order, as hex."""
    try:
        raw = bytes.fromhex(hex_text)
        words = b"".join(struct.pack("=I", int.from_bytes(raw[i : i + 4], "big")) for i in range(0, len(raw), 4))
        return str(ipaddress.ip_address(words))
    except ValueError:
        return ""


def _proc_net_listeners(ports: set[int]) -> list[Listener] | None:
    """The same from /proc/net/tcp{,6}, where netlink is not allowed (no cgroup ids)."""
    found: list[Listener] = []
    read_any = False
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        read_any = True
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            try:
                address, port_hex = fields[1].rsplit(":", 1)
                port = int(port_hex, 16)
                inode = int(fields[9])
            except (IndexError, ValueError):
                continue
            if port in ports:
                found.append(Listener(family, _proc_address(address), port, inode))
    return found if read_any else None
