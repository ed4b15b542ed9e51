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


class SockDiagError(OSError):
    pass


def _sock_diag_listeners(family: int) -> list[tuple[int, int]]:
    """(port, inode) of every listening TCP socket of FAMILY in guardian's network namespace."""
    req = _DIAG_REQ.pack(family, socket.IPPROTO_TCP, 0, 1 << _TCP_LISTEN)
    hdr = _NLMSG_HDR.pack(_NLMSG_HDR.size + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
    out: list[tuple[int, int]] = []
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
                if kind == _SOCK_DIAG_BY_FAMILY and length >= _NLMSG_HDR.size + 72:
                    (port,) = _DIAG_MSG_SPORT.unpack_from(data, body + 4)
                    (inode,) = _DIAG_MSG_INODE.unpack_from(data, body + 68)
                    out.append((port, inode))
                offset += (length + 3) & ~3


def listening_inodes(ports: set[int]) -> dict[int, int] | None:
    """Port -> inode of its listening socket (IPv4 first, then IPv6). No per-process scan.

    None: the kernel's socket tables could not be read at all.
    """
    found: dict[int, int] = {}
    try:
        for family in (socket.AF_INET, socket.AF_INET6):
            for port, inode in _sock_diag_listeners(family):
                if port in ports and port not in found:
                    found[port] = inode
        return found
    except OSError:
        return _proc_net_listening_inodes(ports)


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
