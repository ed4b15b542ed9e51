"""Who listens on a TCP port: the kernel's listening sockets, and which process holds one."""

from __future__ import annotations

import os
import socket
import struct

import psutil


def listeners(ports: set[int]) -> dict[int, int | None] | None:
    """Port -> PID of its listener (None: listening, but the PID is hidden from us).

    Ports nobody listens on are absent. None as a whole: the socket table could not be read.
    """
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return None
    found: dict[int, int | None] = {}
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in ports:
            if found.get(c.laddr.port) is None:
                found[c.laddr.port] = c.pid
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
_DIAG_MSG_SIZE = 72
_RTA_HDR = struct.Struct("=HH")
_INET_DIAG_CGROUP_ID = 21  # Linux >= 5.7: the cgroup the socket was created in, always sent
_U64 = struct.Struct("=Q")


class SockDiagError(OSError):
    pass


def _cgroup_id(data: bytes, start: int, end: int) -> int | None:
    """INET_DIAG_CGROUP_ID among the attributes that follow an inet_diag_msg, if the kernel sent it."""
    while start + _RTA_HDR.size <= end:
        length, kind = _RTA_HDR.unpack_from(data, start)
        if length < _RTA_HDR.size:
            return None
        if kind == _INET_DIAG_CGROUP_ID and length >= _RTA_HDR.size + _U64.size:
            return int(_U64.unpack_from(data, start + _RTA_HDR.size)[0])
        start += (length + 3) & ~3
    return None


def _sock_diag_listeners(family: int) -> list[tuple[int, int, int | None]]:
    """(port, inode, cgroup id) of every listening TCP socket of FAMILY in guardian's network namespace."""
    req = _DIAG_REQ.pack(family, socket.IPPROTO_TCP, 0, 1 << _TCP_LISTEN)
    hdr = _NLMSG_HDR.pack(_NLMSG_HDR.size + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
    out: list[tuple[int, int, int | None]] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(2.0)
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
                    return out
                if kind == _NLMSG_ERROR:
                    (errno_neg,) = struct.unpack_from("=i", data, body)
                    raise SockDiagError(-errno_neg, f"sock_diag: {os.strerror(-errno_neg)}")
                if kind == _SOCK_DIAG_BY_FAMILY and length >= _NLMSG_HDR.size + _DIAG_MSG_SIZE:
                    (port,) = _DIAG_MSG_SPORT.unpack_from(data, body + 4)
                    (inode,) = _DIAG_MSG_INODE.unpack_from(data, body + 68)
                    end = min(offset + length, len(data))
                    out.append((port, inode, _cgroup_id(data, body + _DIAG_MSG_SIZE, end)))
                offset += (length + 3) & ~3


Listening = tuple[int, int | None]  # (socket inode, cgroup id of its creator; None: not known)


def listening(ports: set[int]) -> dict[int, Listening] | None:
    """Port -> its listening socket (IPv4 first, then IPv6). No per-process scan.

    None: the kernel's socket tables could not be read at all. The cgroup id is None where
    netlink is not allowed (the /proc/net fallback) or the kernel is older than 5.7.
    """
    found: dict[int, Listening] = {}
    try:
        for family in (socket.AF_INET, socket.AF_INET6):
            for port, inode, cgroup_id in _sock_diag_listeners(family):
                if port in ports and port not in found:
                    found[port] = (inode, cgroup_id)
        return found
    except OSError:
        table = _proc_net_listening_inodes(ports)
        return None if table is None else {p: (inode, None) for p, inode in table.items()}


# A socket's cgroup id is the inode of its cgroup's directory in the cgroup2 hierarchy, which
# anyone may read: the port's unit is found without reading other users' /proc/PID/fd, so
# guardian needs neither CAP_SYS_PTRACE nor CAP_DAC_READ_SEARCH. The id names the cgroup of the
# process that *created* the socket; systemd's own (init.scope, socket activation) is not the
# unit that serves on it, so that case is left to the process scan.
CGROUP_ROOT = "/sys/fs/cgroup"
_UNIT_SUFFIXES = (".service", ".scope", ".socket", ".mount", ".swap")
_NOT_AN_OWNER = frozenset({"init.scope"})
_MAX_CGROUP_DIRS = 100_000


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


def unit_of_cgroup(path: str) -> str | None:
    """The unit a cgroup path belongs to: its deepest component named like a unit (not a slice)."""
    for part in reversed(path.strip("/").split("/")):
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


def _proc_net_listening_inodes(ports: set[int]) -> dict[int, int] | None:
    """The same from /proc/net/tcp{,6}, where netlink is not allowed."""
    found: dict[int, int] = {}
    read_any = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
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
                port = int(fields[1].rsplit(":", 1)[1], 16)
                inode = int(fields[9])
            except (IndexError, ValueError):
                continue
            if port in ports and port not in found:
                found[port] = inode
    return found if read_any else None
