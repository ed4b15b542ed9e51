"""Where a replica's URL leads (issue 41 item 1): its host resolved as its client resolves it, the
probes pinned to the address chosen, and the listener judged there. Rows 1 and 2 of issue 41: a
URL by host name took nobody's listener on 127.0.0.2:P (the first in the dump) for the replica's,
and `localhost` sent the probes to nobody's fake vLLM on [::1]:P while the kernel's view looked
at 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from guardian.config import ReplicaConfig
from guardian.observe import addresses, probes
from guardian.observe.addresses import Holders, Pin, Place, Resolved, Resolver, choose, pin_all
from guardian.observe.plainhttp import pinned
from guardian.observe.sockets import Listener, serving

P = 8001
NOBODY_V6 = Listener(socket.AF_INET6, "::1", P, 11, cgroup_id=500)
NOBODY_V4 = Listener(socket.AF_INET, "127.0.0.2", P, 12, cgroup_id=500)
REPLICA = Listener(socket.AF_INET, "0.0.0.0", P, 13, cgroup_id=700)
HOLDERS = {500: "squat.service", 700: "vllm-a.service"}


def replica(url: str) -> ReplicaConfig:
    return ReplicaConfig(name="a", unit="vllm-a.service", url=url, model="m")


def test_a_host_name_is_judged_at_the_address_it_resolves_to_not_at_the_ports_first_listener():
    """Row 1: nobody's 127.0.0.2:P was the first in the dump and was taken for the replica's."""
    table = [NOBODY_V4, REPLICA]
    assert serving(table, "box", P) is NOBODY_V4  # a name guardian did not resolve: the port's first
    pin = choose("box", Resolved(("127.0.1.1",)), table, P, lambda _p: False)
    assert pin.address == "127.0.1.1" and pin.listener is REPLICA and not pin.split


def test_localhost_is_pinned_to_the_replicas_own_listener_and_the_split_is_a_hazard(monkeypatch):
    """Row 2: stock Debian's `::1 localhost` made the probes try [::1] first: nobody's server."""
    monkeypatch.setattr(addresses, "_holders", lambda: HOLDERS)
    r = replica(f"http://localhost:{P}")
    (pin,) = pin_all([r], [Resolved(("::1", "127.0.0.1"))], [NOBODY_V6, NOBODY_V4, REPLICA], Holders().of).values()
    assert pin.address == "127.0.0.1" and pin.listener is REPLICA
    assert pin.split
    text = pin.split_text(r.unit)
    assert "[::1] -> [::1]:8001 held by squat.service" in text
    assert "127.0.0.1 -> 0.0.0.0:8001 held by vllm-a.service" in text
    assert "guardian probes 127.0.0.1 (vllm-a.service's listener)" in text and "put one address in the URL" in text


def test_two_listeners_of_the_replicas_own_unit_are_no_split(monkeypatch):
    monkeypatch.setattr(addresses, "_holders", lambda: HOLDERS)
    v6 = Listener(socket.AF_INET6, "::", P, 14, cgroup_id=700)
    (pin,) = pin_all([replica(f"http://localhost:{P}")], [Resolved(("::1", "127.0.0.1"))], [v6, REPLICA],
                     Holders().of).values()
    assert pin.address == "::1" and not pin.split  # a client's first: the replica's too


def test_with_no_listener_of_its_own_the_first_address_a_client_reaches_is_judged(monkeypatch):
    monkeypatch.setattr(addresses, "_holders", lambda: HOLDERS)
    (pin,) = pin_all([replica(f"http://localhost:{P}")], [Resolved(("::1", "127.0.0.1"))], [NOBODY_V6],
                     Holders().of).values()
    assert pin.address == "::1" and pin.listener is NOBODY_V6  # where clients land: L4 names its holder


def test_a_name_that_does_not_resolve_keeps_its_url_and_says_why():
    pin = choose("nowhere.invalid", Resolved(error="nowhere.invalid does not resolve: ..."), [REPLICA], P, bool)
    assert pin == Pin("nowhere.invalid", None, error="nowhere.invalid does not resolve: ...")


def test_an_address_literal_is_not_looked_up():
    def never(_host: str, _port: int) -> list[str]:
        raise AssertionError("looked up")

    r = Resolver(never)
    assert asyncio.run(r.resolve("[::ffff:127.0.0.1]", P)) == Resolved(("127.0.0.1",))
    assert asyncio.run(r.resolve("::1", P)) == Resolved(("::1",))


def test_a_hung_lookup_holds_one_thread_and_the_tick_uses_the_last_answer():
    """A resolver that hangs must not fill the default thread pool (every to_thread of the tick
    would stall): one lookup per name at a time, on a thread of its own."""
    release = threading.Event()
    calls: list[str] = []

    def lookup(host: str, _port: int) -> list[str]:
        calls.append(host)
        if len(calls) > 1:
            release.wait(30)
        return ["127.0.0.1"]

    async def ticks() -> list[Resolved]:
        r = Resolver(lookup, wait_s=0.05)
        got = [await r.resolve("box", P)]  # answers at once
        r._running.clear()  # a new tick's lookup: this one hangs
        r._last.clear()
        got += [await r.resolve("box", P) for _ in range(3)]
        release.set()
        for _ in range(200):
            again = await r.resolve("box", P)
            if again.addresses:
                return [*got, again]
        raise AssertionError("the lookup never came back")

    first, *hung, back = asyncio.run(ticks())
    assert first == Resolved(("127.0.0.1",)) and back == Resolved(("127.0.0.1",))
    assert all(h.error is not None and "has not answered" in h.error for h in hung), hung
    assert len(calls) == 2  # the hung lookup was not started again at each tick


def test_a_lookup_error_is_said():
    def fails(host: str, _port: int) -> list[str]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    got = asyncio.run(Resolver(fails).resolve("nowhere.invalid", P))
    assert got.addresses == () and got.error is not None and "nowhere.invalid does not resolve" in got.error


class _Seen(BaseHTTPRequestHandler):
    hosts: list[str] = []

    def _answer(self) -> None:
        type(self).hosts.append(self.headers.get("Host", ""))
        body = b'{"choices":[{"text":"x"}]}' if self.command == "POST" else b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._answer()

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self._answer()

    def log_message(self, *_a: object) -> None:
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Seen)
    _Seen.hosts = []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def test_the_probes_and_the_canary_connect_to_the_pinned_address_and_keep_the_name(server):
    """A name no resolver knows: only the pin gets the probes there; the server is asked for the name."""
    r = replica(f"http://guardian-pin.invalid:{server}")

    async def go() -> tuple:
        async with probes.make_client() as client:
            health = await probes.health_at(client, r.url, 5, "127.0.0.1")
            metrics, _ = await probes.probe_metrics(client, r, 5, "127.0.0.1")
            canary = await probes.canary(client, r, 0.0, 5, "127.0.0.1")
            unpinned = await probes.health_at(client, r.url, 5)
            return health, metrics, canary, unpinned

    health, metrics, canary, unpinned = asyncio.run(go())
    assert health.ok and canary.ok, (health, canary)
    assert metrics.status == 200  # it answered (its page is no vLLM's)
    assert not unpinned.ok and unpinned.status is None  # without the pin the name goes nowhere
    assert _Seen.hosts == [f"guardian-pin.invalid:{server}"] * 3


def test_a_pinned_https_request_keeps_the_name_for_tls():
    url, headers, extensions = pinned("https://box.example:8443/v1", "127.0.0.1")
    assert url == "https://127.0.0.1:8443/v1" and headers == {"Host": "box.example:8443"}
    assert extensions == {"sni_hostname": "box.example"}
    request = httpx.Request("GET", url, headers=headers, extensions=extensions)
    assert request.headers["Host"] == "box.example:8443" and request.url.host == "127.0.0.1"


def test_an_ipv6_pin_is_bracketed():
    assert pinned("http://localhost:8001", "::1")[0] == "http://[::1]:8001"
    assert pinned("http://localhost:8001", None) == ("http://localhost:8001", {}, {})


def test_places_are_named_by_their_listeners_cgroup():
    named = addresses.named([Place("::1", NOBODY_V6), Place("127.0.0.9", None)], HOLDERS)
    assert [p.holder for p in named] == ["squat.service", None]


def test_holders_are_walked_for_once_per_unknown_cgroup(monkeypatch):
    walks: list[int] = []

    def walk() -> dict[int, str]:
        walks.append(1)
        return dict(HOLDERS)

    monkeypatch.setattr(addresses, "_holders", walk)
    h = Holders(every_s=0)
    assert h.of({500, 700}) == HOLDERS and h.of({700}) == HOLDERS and len(walks) == 1
    h.of({999})  # a cgroup no walk finds (removed since): walked for once, not at every tick
    h.of({999})
    assert len(walks) == 2


def test_a_hung_lookup_with_an_earlier_answer_does_not_hold_the_tick():
    """With an answer from an earlier tick, a lookup that hangs is not waited for (RESOLVE_WAIT_S is
    for a name with no answer yet): a resolver that hangs must not slow every tick."""
    release = threading.Event()
    calls: list[str] = []

    def lookup(host: str, _port: int) -> list[str]:
        calls.append(host)
        if len(calls) > 1:
            release.wait(60)
        return ["127.0.0.1"]

    async def ticks() -> list[Resolved]:
        r = Resolver(lookup, wait_s=30)
        first = await r.resolve("box", P)
        r._running.clear()  # the next tick's lookup: this one hangs
        try:
            return [first, *[await asyncio.wait_for(r.resolve("box", P), 5) for _ in range(3)]]
        finally:
            release.set()

    got = asyncio.run(ticks())
    assert got == [Resolved(("127.0.0.1",))] * 4 and len(calls) == 2


def test_a_lookup_that_fails_any_way_is_an_answer_and_not_kept():
    state = {"fail": True}

    def lookup(_host: str, _port: int) -> list[str]:
        if state["fail"]:
            raise RuntimeError("resolver plugin crashed")
        return ["127.0.0.1"]

    async def go() -> tuple[Resolved, Resolved, Resolved]:
        r = Resolver(lookup, wait_s=5)
        failed = await r.resolve("box", P)
        state["fail"] = False
        ok = await r.resolve("box", P)  # not stuck: a new lookup ran
        state["fail"] = True
        again = await r.resolve("box", P)
        return failed, ok, again

    failed, ok, again = asyncio.run(go())
    assert failed.addresses == () and failed.error is not None and "RuntimeError" in failed.error
    assert ok == Resolved(("127.0.0.1",))
    assert again.error is not None  # a failure is this tick's answer; the last good one is kept for timeouts only


def test_a_scoped_link_local_address_is_not_a_place(monkeypatch):
    infos = [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fe80::1%eth0", P, 0, 2)),
             (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", P))]
    monkeypatch.setattr(addresses.socket, "getaddrinfo", lambda *_a, **_k: infos)
    assert addresses.getaddrinfo_lookup("box", P) == ["127.0.1.1"]


@pytest.mark.parametrize("holder", ["docker.service", "docker-0123abcd.scope", "init.scope", None])
def test_a_listener_that_may_be_the_replicas_own_is_chosen_over_another_units(monkeypatch, holder):
    """A Docker replica's port is held by docker-proxy (docker.service), a socket-activated one's by
    init.scope: neither is the replica's unit, but nobody's [::1] listener must not win for it."""
    names = {500: "squat.service"} | ({700: holder} if holder is not None else {})
    r = replica(f"http://localhost:{P}")
    (pin,) = pin_all([r], [Resolved(("::1", "127.0.0.1"))], [NOBODY_V6, REPLICA], lambda _ids: names).values()
    assert pin.address == "127.0.0.1" and pin.listener is REPLICA


def test_an_unresolved_pin_fails_the_probes_at_once_without_resolving_by_name():
    from guardian.observe import replicas as observe_replicas

    pin = Pin("nowhere.invalid", None, error="nowhere.invalid does not resolve: Name or service not known")
    r = replica("http://nowhere.invalid:8001")

    async def go() -> tuple:
        async with probes.make_client() as client:
            return (await observe_replicas._send(client, r, "health", (1.0, pin)),
                    await observe_replicas._send(client, r, "metrics", (1.0, pin)))

    health, (metrics, sample) = asyncio.run(go())
    assert not health.ok and health.status is None and "does not resolve" in (health.error or "")
    assert not metrics.ok and sample is None


def test_holders_are_walked_at_most_once_per_period(monkeypatch):
    walks: list[int] = []
    monkeypatch.setattr(addresses, "_holders", lambda: walks.append(1) or {})
    h = Holders(every_s=3600)
    h.of({1})
    h.of({2})  # a new unknown id within the period: not walked for (a user making cgroups at every tick)
    assert len(walks) == 1


def test_a_split_host_is_said_once_as_a_hazard_and_once_when_it_ends(monkeypatch):
    from guardian.act.notices import Notices
    from guardian.config import Config
    from guardian.core.vocab import Priority
    from harness import Recorder

    monkeypatch.setattr(addresses, "_holders", lambda: HOLDERS)
    r = replica(f"http://localhost:{P}")
    cfg = Config(replicas=[r])
    split = pin_all([r], [Resolved(("::1", "127.0.0.1"))], [NOBODY_V6, REPLICA], Holders().of)
    whole = pin_all([r], [Resolved(("::1", "127.0.0.1"))], [REPLICA], Holders().of)
    journal = Recorder()
    notices = Notices(journal)
    for pins in (split, split, whole, whole):
        notices.addresses(cfg, pins)
    said = [(line.priority, line.hazard, line.unit, line.message) for line, _ in journal.lines]
    assert [s[:3] for s in said] == [(Priority.ERROR, "address:a", "vllm-a.service"),
                                     (Priority.INFO, "address:a", "vllm-a.service")], said
    assert "held by squat.service" in said[0][3] and "leads to one holder again" in said[1][3]


def test_the_pins_read_the_listening_sockets_by_netlink_on_the_loop_and_proc_net_in_a_thread(monkeypatch):
    """The kernel's listening hash is a fraction of a ms: read on the loop. Where netlink cannot be
    read, /proc/net (a walk of every socket) is read in a thread, as before."""
    from guardian.config import Config
    from guardian.observe.sockets import listener_table

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    cfg = Config(replicas=[replica(f"http://127.0.0.1:{port}")])
    hops: list[object] = []
    real_to_thread = asyncio.to_thread

    async def to_thread(fn, *args):  # noqa: ANN001, ANN202
        hops.append(fn)
        return await real_to_thread(fn, *args)

    monkeypatch.setattr(addresses.asyncio, "to_thread", to_thread)
    try:
        a = addresses.Addresses()
        (pin,) = asyncio.run(a.pins(cfg)).values()
        assert a.table == listener_table({port}) and pin.listener in a.table and hops == []

        def refused(_ports: set[int]) -> list[Listener]:
            raise PermissionError("netlink refused")

        from_proc = [Listener(socket.AF_INET, "127.0.0.1", port, 99)]
        monkeypatch.setattr(addresses, "netlink_listener_table", refused)
        monkeypatch.setattr(addresses, "listener_table", lambda ports: from_proc if ports == {port} else None)
        asyncio.run(a.pins(cfg))
        assert a.table == from_proc and len(hops) == 1
    finally:
        srv.close()
