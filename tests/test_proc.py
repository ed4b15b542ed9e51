"""The socket-table reader behind the port-owner cache, against this machine's real /proc."""

import os
import socket

from guardian.observe.sockets import listening_inodes, listeners


def _listener(family=socket.AF_INET, host="127.0.0.1"):
    s = socket.socket(family)
    s.bind((host, 0))
    s.listen()
    return s


def test_listening_inodes_names_each_listening_socket_by_its_inode():
    v4, v6 = _listener(), _listener(socket.AF_INET6, "::1")
    try:
        ports = {v4.getsockname()[1], v6.getsockname()[1]}
        assert listening_inodes(ports) == {
            v4.getsockname()[1]: os.fstat(v4.fileno()).st_ino,
            v6.getsockname()[1]: os.fstat(v6.fileno()).st_ino,
        }
        assert set(listeners(ports)) == ports  # the full scan agrees on which ports are held
    finally:
        v4.close()
        v6.close()


def test_a_new_socket_on_the_same_port_has_a_new_inode_and_a_closed_one_is_gone():
    first = _listener()
    port = first.getsockname()[1]
    old = listening_inodes({port})[port]
    first.close()
    assert port not in listening_inodes({port})
    second = socket.socket()
    second.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    second.bind(("127.0.0.1", port))
    second.listen()
    try:
        assert listening_inodes({port})[port] != old
    finally:
        second.close()


def test_connected_sockets_and_other_ports_are_not_listeners():
    server = _listener()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    try:
        found = listening_inodes({port, client.getsockname()[1]})
        assert list(found) == [port]  # the client's ephemeral port is established, not listening
    finally:
        for s in (client, accepted, server):
            s.close()


def test_netlink_and_proc_net_agree():
    """sock_diag is the normal path; /proc/net/tcp is the fallback where netlink is refused.
    Netlink is asked directly: through listening_inodes a failing netlink would hide behind the
    fallback and the two sides would trivially agree."""
    from guardian.observe.sockets import _proc_net_listening_inodes, _sock_diag_listeners

    v4, v6 = _listener(), _listener(socket.AF_INET6, "::1")
    try:
        ports = {v4.getsockname()[1], v6.getsockname()[1]}
        netlink = {}
        for family in (socket.AF_INET, socket.AF_INET6):
            for port, inode in _sock_diag_listeners(family):
                if port in ports:
                    netlink.setdefault(port, inode)
        assert netlink == _proc_net_listening_inodes(ports) == listening_inodes(ports) != {}
    finally:
        v4.close()
        v6.close()
