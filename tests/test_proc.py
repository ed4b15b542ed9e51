"""The socket-table reader behind the port-owner cache, against this machine's real /proc."""

import os
import socket

import pytest

from guardian.observe.sockets import cgroup_dirs, first_pid, listeners, listening, unit_of_cgroup


def listening_inodes(ports, host="localhost"):
    """Port -> inode of the listening socket that serves HOST on it, from guardian's reader
    (netlink, else /proc/net)."""
    table = listening({p: host for p in ports})
    return None if table is None else {p: inode for p, (inode, _cg) in table.items()}


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
        assert set(listeners({p: "localhost" for p in ports})) == ports  # the full scan agrees
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
    from guardian.observe.sockets import _proc_net_listeners, _sock_diag_listeners

    v4, v6 = _listener(), _listener(socket.AF_INET6, "::1")
    try:
        ports = {v4.getsockname()[1], v6.getsockname()[1]}
        netlink = [x for family in (socket.AF_INET, socket.AF_INET6) for x in _sock_diag_listeners(family)
                   if x.port in ports]
        proc = _proc_net_listeners(ports)
        assert sorted((x.family, x.address, x.port, x.inode) for x in netlink) == sorted(
            (x.family, x.address, x.port, x.inode) for x in proc)
        assert {(x.address, x.port) for x in netlink} == {("127.0.0.1", v4.getsockname()[1]), ("::1", v6.getsockname()[1])}
        assert {x.port: x.inode for x in netlink} == listening_inodes(ports) != {}
    finally:
        v4.close()
        v6.close()


def _own_cgroup() -> str:
    with open("/proc/self/cgroup") as f:
        return next(line.split("::", 1)[1].strip() for line in f if line.startswith("0::"))


def test_a_socket_is_mapped_to_the_cgroup_that_created_it_without_reading_proc():
    s = _listener()
    port = s.getsockname()[1]
    try:
        inode, cgroup_id = listening({port: "127.0.0.1"})[port]
        assert inode == os.fstat(s.fileno()).st_ino
        own = _own_cgroup()
        assert cgroup_id == os.stat(f"/sys/fs/cgroup{own}").st_ino  # a cgroup's id is its directory's inode
        assert cgroup_dirs()[cgroup_id] == own
    finally:
        s.close()


def test_cgroup_dirs_walks_the_tree_by_inode(tmp_path):
    (tmp_path / "system.slice/vllm-a.service/payload").mkdir(parents=True)
    (tmp_path / "system.slice/cgroup.procs").write_text("")
    dirs = cgroup_dirs(str(tmp_path))
    assert dirs[os.stat(tmp_path / "system.slice/vllm-a.service").st_ino] == "/system.slice/vllm-a.service"
    assert dirs[os.stat(tmp_path / "system.slice/vllm-a.service/payload").st_ino] == "/system.slice/vllm-a.service/payload"
    assert dirs[os.stat(tmp_path).st_ino] == "/"
    assert len(dirs) == 4  # files are not cgroups
    assert cgroup_dirs(str(tmp_path / "absent")) == {}


@pytest.mark.parametrize(
    ("path", "unit"),
    [
        ("/system.slice/vllm-a.service", "vllm-a.service"),
        ("/system.slice/system-vllm\\x2dreplica.slice/vllm-replica@a.service", "vllm-replica@a.service"),
        ("/system.slice/vllm-a.service/payload", "vllm-a.service"),  # a delegated sub-cgroup
        ("/user.slice/user-1000.slice/session-3.scope", "session-3.scope"),
        # issue 34 rows 3 and 10: names made in a user's own (delegated) tree are that user's manager's
        ("/user.slice/user-65534.slice/user@65534.service/app.slice/vllm-replica@r1.service", "user@65534.service"),
        ("/user.slice/user-1000.slice/user@1000.service/app.slice/nginx.service", "user@1000.service"),
        ("/user.slice/user-1000.slice/user@1000.service/app.slice/app-squat.scope", "user@1000.service"),
        ("/system.slice/vllm-d.service/libpod-payload-abc/init.scope", "vllm-d.service"),  # a unit's own tree
        ("/init.scope", None),  # systemd itself: socket activation, not the server
        ("/system.slice", None),
        ("/", None),
    ],
)
def test_unit_of_cgroup(path, unit):
    assert unit_of_cgroup(path) == unit


def test_first_pid_reads_cgroup_procs(tmp_path):
    (tmp_path / "a.service").mkdir()
    (tmp_path / "a.service/cgroup.procs").write_text("4242\n4243\n")
    (tmp_path / "empty.service").mkdir()
    (tmp_path / "empty.service/cgroup.procs").write_text("")
    assert first_pid("/a.service", str(tmp_path)) == 4242
    assert first_pid("/empty.service", str(tmp_path)) is None
    assert first_pid("/gone.service", str(tmp_path)) is None


def _bound(host, port, family=socket.AF_INET):
    s = socket.socket(family)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    s.bind((host, port))
    s.listen()
    return s


def _side_by_side(first_host, first_family, second_host, tries=50):
    """Two listeners on one port: FIRST_HOST's on a free port, then SECOND_HOST's (IPv4) on the same
    one; another port when that one is taken on the second address (another test's, say)."""
    for _ in range(tries):
        first = _bound(first_host, 0, first_family)
        try:
            return first, _bound(second_host, first.getsockname()[1])
        except OSError:
            first.close()
    pytest.fail(f"no port free on both {first_host} and {second_host} in {tries} tries")


@pytest.mark.parametrize("replica_host, squatter_host, squatter_family", [
    ("127.0.0.1", "127.0.0.2", socket.AF_INET),  # issue 34 row 3A: another address of the loopback
    ("0.0.0.0", "::1", socket.AF_INET6),  # row 1: IPv6 beside the replica's IPv4 wildcard
])
def test_the_listener_that_serves_a_replicas_url_is_its_own_not_a_squatters_on_the_port(
        replica_host, squatter_host, squatter_family):
    """Issue 34 rows 1 and 3A: guardian keeps the port's listener that a connection to the
    replica's URL (http://127.0.0.1:P) reaches, whichever was bound first."""
    squatter, replica = _side_by_side(squatter_host, squatter_family, replica_host)
    port = squatter.getsockname()[1]
    try:
        assert listening_inodes({port}, "127.0.0.1") == {port: os.fstat(replica.fileno()).st_ino}
        by_proc = listeners({port: "127.0.0.1"})
        assert by_proc == {port: os.getpid()}
        assert listening_inodes({port}, squatter_host) == {port: os.fstat(squatter.fileno()).st_ino}
    finally:
        replica.close()
        squatter.close()


def test_nothing_serves_a_replicas_address_when_only_another_address_listens():
    other = _bound("127.0.0.2", 0)
    port = other.getsockname()[1]
    try:
        assert listening_inodes({port}, "127.0.0.1") == {}
        assert listening_inodes({port}, "127.0.0.2") == {port: os.fstat(other.fileno()).st_ino}
    finally:
        other.close()


def test_the_port_owners_take_the_listening_sockets_the_pins_read_this_tick(monkeypatch):
    """WorldObserver.pin reads the listening sockets on the replicas' ports; the port owners of the
    same tick judge from that table (the same answer as reading it again), once: a later look
    without a pin reads it afresh."""
    import asyncio

    from guardian.config import Config, ReplicaConfig
    from guardian.observe import replicas as observed
    from guardian.observe.sockets import listener_table, listening_in

    s = _listener()
    port = s.getsockname()[1]
    wanted = {port: "127.0.0.1"}
    cfg = Config(replicas=[ReplicaConfig(name="a", unit="vllm-a.service", url=f"http://127.0.0.1:{port}", model="m")])
    read: list[dict] = []

    def reading(w):  # noqa: ANN001, ANN202
        read.append(dict(w))
        return listening(w)

    class NoBus:  # names the holder where its cgroup does not (the tests' shell): the key is kept
        async def unit_by_pid(self, pid: int) -> str:
            return "test.service"

    monkeypatch.setattr(observed, "listening", reading)
    try:
        assert listening_in(listener_table({port}), wanted) == listening(wanted)
        assert listening_in(None, wanted) is None  # unreadable, as listening says it

        async def go() -> tuple:
            world = observed.WorldObserver(NoBus(), None)  # type: ignore[arg-type]
            counts = []
            await world.pin(cfg)
            first = await world.port_cache.get(NoBus(), wanted, world._pinned_table)  # a new key: scanned
            counts.append(len(read))
            fresh = await observed.PortOwnerCache().get(NoBus(), wanted)  # as before: read first, and after
            counts.append(len(read))
            await world.pin(cfg)
            table, world._pinned_table = world._pinned_table, None
            again = await world.port_cache.get(NoBus(), wanted, table)  # the same sockets: not read at all
            counts.append(len(read))
            return first, fresh, again, table, counts

        read.clear()
        first, fresh, again, table, counts = asyncio.run(go())
        assert first == fresh == again and table == (listener_table({port}),)
        assert counts == [2, 5, 5]  # port_owners' own read and the check after it; the same plus the first
    finally:
        s.close()
