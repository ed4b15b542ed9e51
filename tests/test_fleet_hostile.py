"""Issue 21, the fleet: nothing etcd (or anyone who can write under the fleet's prefix) sends can
stop a tick or cause a restart. The etcd client and FleetSync are driven against a real HTTP server
on loopback (a fake JSON gateway, in a thread of its own) that answers with crafted garbage, gzip,
bodies past the cap and one byte at a time; the outcome is an EtcdError or a fleet view that is
not ok with its reason, within a deadline derived from the configured timeout."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from guardian.config import Config, FleetConfig, ReplicaConfig
from guardian.core.watchdog.track import Track
from guardian.core.observations import FleetView, PersistentView, TickObservation
from guardian.core.vocab import Priority, State
from guardian.fleet.etcd import KV, MAX_ANSWER_BYTES, Etcd, EtcdError
from guardian.fleet.sync import FleetSync, fleet_status, parse_view
from guardian.observe.clock import Now
from harness import Recorder, obs

MiB = 2**20
PREFIX = "/guardian/t/"

Handler = Callable[[asyncio.StreamWriter, "Gateway", str], Awaitable[None]]


def b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def kv(key: str, value: str | bytes, mod: int = 3) -> dict[str, str]:
    return {
        "key": b64(key),
        "value": b64(value),
        "create_revision": "2",
        "mod_revision": str(mod),
        "version": "1",
        "lease": "7587",
    }


def member(box: str, name: str = "a", model: str = "m", state: str = "healthy") -> str:
    return json.dumps(
        {"box": box, "name": name, "unit": f"vllm-{name}.service", "model": model, "state": state, "since": 1.0}
    )


def range_answer(*kvs: dict[str, str]) -> dict[str, Any]:
    return {
        "header": {"cluster_id": "1", "member_id": "2", "revision": "9", "raft_term": "2"},
        "kvs": list(kvs),
        "count": str(len(kvs)),
    }


GOOD_RANGE = range_answer(kv(PREFIX + "replicas/box2/a", member("box2")))


# --- the fake gateway: each handler writes one whole HTTP/1.1 answer, then the connection closes --
def head(status: int = 200, **headers: str) -> bytes:
    lines = [f"HTTP/1.1 {status} X", "Content-Type: application/json", "Connection: close"]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def answer(obj: Any = None, raw: bytes | None = None, status: int = 200) -> Handler:
    body = raw if raw is not None else json.dumps(obj).encode()

    async def handle(w: asyncio.StreamWriter, gw: Gateway, path: str) -> None:
        w.write(head(status, Content_Length=str(len(body))) + body)
        await w.drain()

    return handle


def gzipped(raw: bytes) -> Handler:
    body = gzip.compress(raw)

    async def handle(w: asyncio.StreamWriter, gw: Gateway, path: str) -> None:
        w.write(head(Content_Encoding="gzip", Content_Length=str(len(body))) + body)
        await w.drain()

    return handle


def declared(n_bytes: int) -> Handler:
    """Says N_BYTES are coming, sends 1 KiB."""

    async def handle(w: asyncio.StreamWriter, gw: Gateway, path: str) -> None:
        w.write(head(Content_Length=str(n_bytes)) + b" " * 1024)
        await w.drain()

    return handle


def endless(total_bytes: int, chunk_bytes: int = 64 * 2**10) -> Handler:
    """A chunked answer of TOTAL_BYTES (no length said), counting what the client took."""
    chunk = b"%x\r\n" % chunk_bytes + b" " * chunk_bytes + b"\r\n"

    async def handle(w: asyncio.StreamWriter, gw: Gateway, path: str) -> None:
        w.write(head(Transfer_Encoding="chunked"))
        sent = 0
        while sent < total_bytes:
            w.write(chunk)
            await w.drain()  # raises once the client has gone
            sent += chunk_bytes
            gw.sent[path] = sent
        w.write(b"0\r\n\r\n")

    return handle


def drip(period_s: float = 0.1) -> Handler:
    """One byte every PERIOD_S, well within any per-read timeout, of an answer that never ends."""

    async def handle(w: asyncio.StreamWriter, gw: Gateway, path: str) -> None:
        w.write(head(Content_Length=str(10**6)))
        for _ in range(int(60 / period_s)):
            w.write(b" ")
            await w.drain()
            await asyncio.sleep(period_s)  # the drip itself, not a wait for a condition

    return handle


GOOD: dict[str, Handler] = {
    "/v3/lease/grant": answer({"header": {"revision": "1"}, "ID": "7587", "TTL": "3"}),
    "/v3/lease/keepalive": answer({"result": {"header": {}, "ID": "7587", "TTL": "3"}}),
    "/v3/lease/revoke": answer({"header": {}}),
    "/v3/kv/put": answer({"header": {"revision": "2"}}),
    "/v3/kv/deleterange": answer({"header": {"revision": "2"}}),
    "/v3/kv/txn": answer({"header": {"revision": "3"}, "succeeded": True}),
    "/v3/kv/range": answer(GOOD_RANGE),
    "/v3/maintenance/status": answer({"header": {"member_id": "2"}, "leader": "2"}),
}


class Gateway:
    """An HTTP server on 127.0.0.1 (a random port) with an event loop in its own thread, so that
    both asyncio tests and a `guardian` subprocess can talk to it."""

    def __init__(self) -> None:
        self.routes: dict[str, Handler] = dict(GOOD)
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.bodies: list[tuple[str, bytes]] = []
        self.sent: dict[str, int] = {}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self.loop
        ).result(10)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            _method, path, _ = (await reader.readline()).decode().split(" ", 2)
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                k, v = line.decode().split(":", 1)
                headers[k.strip().lower()] = v.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            self.requests.append((path, headers))
            self.bodies.append((path, body))
            await self.routes[path](writer, self, path)
        except (ConnectionError, ValueError, asyncio.IncompleteReadError):
            pass  # the client went away, which is what several tests want of it
        finally:
            writer.close()

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def gw():
    g = Gateway()
    yield g
    g.close()


@pytest.fixture
def gw2():
    g = Gateway()
    yield g
    g.close()


# What a test gives etcd to answer when the test is not about a deadline: the fake gateway runs in
# this process and on a loaded 2-core machine answers late; a deadline's own tests pass 0.5 s.
ANSWER_WITHIN_S = 5.0


def config(*urls: str, timeout_s: float = ANSWER_WITHIN_S) -> Config:
    return Config(
        replicas=[ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:8001", model="m")],
        fleet=FleetConfig(endpoints=list(urls), name="t", box="box1", lease_ttl_s=3, timeout_s=timeout_s),
    )


def sync(*urls: str, timeout_s: float = ANSWER_WITHIN_S) -> FleetSync:
    return FleetSync(config(*urls, timeout_s=timeout_s), Recorder(), lambda: Now(time.time(), time.monotonic()))


def tracks() -> dict[str, Track]:
    return {"a": Track(state=State.HEALTHY, state_since=time.monotonic())}


async def step(s: FleetSync, later_s: float = 0.0) -> FleetView:
    return await s.step(tracks(), Now(time.time() + later_s, time.monotonic() + later_s))


def said(s: FleetSync, text: str) -> list[str]:
    return [ln.message for ln, _ in s.journal.lines if text in ln.message]


def run(coro: Awaitable[Any]) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, 20)  # a hang fails the test instead of the run

    return asyncio.run(bounded())


# --- the fake is etcd enough --------------------------------------------------------------------
def test_a_well_formed_gateway_gives_a_good_view(gw):
    async def go() -> None:
        s = sync(gw.url)
        v = await step(s)
        assert v.ok and [(m.box, m.name, m.state) for m in v.members] == [("box2", "a", "healthy")]
        assert s.lease == 7587
        await s.close()

    run(go())


# --- every answer checked into typed values, or an EtcdError -----------------------------------
MALFORMED_RANGES = {
    "kvs as an object": (answer({"header": {"revision": "5"}, "kvs": {"key": b64("x")}}), "kvs is not a list"),
    "header as a list": (answer({"header": [1, 2], "kvs": []}), "header is not a JSON object"),
    "a key that is not base64": (
        answer(range_answer({"key": "!!not base64!!", "value": b64("{}")})),
        "kvs[0].key is not valid base64",
    ),
    "a value that is not base64": (
        answer(range_answer({"key": b64(PREFIX + "x"), "value": "e30"})),
        "kvs[0].value is not valid base64",
    ),
    "a key that is a number": (answer(range_answer({"key": 12})), "kvs[0].key is not base64 text"),
    "a kv that is a string": (answer({"kvs": ["x"]}), "kvs[0] is not a JSON object"),
    "revision 3x": (answer({"header": {"revision": "3x"}, "kvs": []}), "header.revision is not an integer"),
    "revision past int64": (answer({"header": {"revision": "9" * 19}}), "header.revision 9999999999999999999 is out"),
    "revision negative": (answer({"header": {"revision": -4}}), "out of range"),
    "mod_revision a list": (
        answer(range_answer(kv(PREFIX + "x", "{}") | {"mod_revision": [1]})),
        "kvs[0].mod_revision is not an integer",
    ),
    "deeply nested JSON": (answer(raw=b'{"header":' + b"[" * 100_000), "is not JSON (RecursionError)"),
    "not JSON at all": (answer(raw=b"<html>hello</html>"), "is not JSON"),
    "a JSON list": (answer(raw=b"[]"), "is not a JSON object"),
    "an error object": (
        answer({"error": {"grpc_code": 14, "message": "etcdserver: no leader"}}),
        "etcd error: etcdserver: no leader",
    ),
}


@pytest.mark.parametrize("case", MALFORMED_RANGES)
def test_a_malformed_range_answer_is_an_etcd_error_and_the_view_unreadable_said_once(gw, case):
    handler, reason = MALFORMED_RANGES[case]
    gw.routes["/v3/kv/range"] = handler

    async def go() -> None:
        etcd = Etcd([gw.url], ANSWER_WITHIN_S)
        with pytest.raises(EtcdError) as e:  # nothing but an EtcdError leaves the client
            await etcd.range_prefix(PREFIX)
        assert reason in str(e.value) and gw.url in str(e.value)
        await etcd.aclose()
        s = sync(gw.url)
        views = [await step(s), await step(s)]
        assert [v.ok for v in views] == [False, False] and reason in (views[0].error or "")
        (line,) = said(s, "etcd cannot be reached or read")
        assert reason in line and s.journal.lines[-1][0].priority is Priority.ERROR
        gw.routes["/v3/kv/range"] = GOOD["/v3/kv/range"]
        assert (await step(s)).ok and said(s, "etcd answers again")
        await s.close()

    run(go())


@pytest.mark.parametrize(
    "grant, reason",
    [
        ({"header": {}, "TTL": "3"}, "the lease grant has no ID"),
        ({"ID": "0", "TTL": "3"}, "ID 0 is out of range"),
        ({"ID": True}, "ID is not an integer (True)"),
        ({"ID": {"x": 1}}, "ID is not an integer (a JSON object)"),
    ],
)
def test_a_lease_grant_without_a_usable_id_is_an_unreadable_view_not_a_key_error(gw, grant, reason):
    gw.routes["/v3/lease/grant"] = answer(grant)

    async def go() -> None:
        s = sync(gw.url)
        v = await step(s)
        assert not v.ok and reason in (v.error or "") and s.lease is None
        await s.close()

    run(go())


def test_a_malformed_keepalive_is_an_unreadable_view(gw):
    async def go() -> None:
        s = sync(gw.url)
        assert (await step(s)).ok
        gw.routes["/v3/lease/keepalive"] = answer({"result": [1]})
        v = await step(s, later_s=10)  # the lease is due for renewal
        assert not v.ok and "result is not a JSON object" in (v.error or "")
        gw.routes["/v3/lease/keepalive"] = answer({"result": {"TTL": "1e9"}})
        v = await step(s, later_s=20)
        assert not v.ok and "result.TTL is not an integer" in (v.error or "")
        await s.close()

    run(go())


def test_a_malformed_txn_answer_is_a_failed_slot_request_said_at_error_not_an_exception(gw):
    async def go() -> None:
        s = sync(gw.url)
        assert (await step(s)).ok
        gw.routes["/v3/kv/txn"] = answer({"succeeded": "yes"})
        await s.acquire("a", "m")  # a task's body: it must not raise
        (line,) = said(s, "asking etcd for a fleet slot failed")
        assert "succeeded is not true or false" in line
        await s.close()

    run(go())


def test_a_token_that_is_not_text_is_an_etcd_error_not_a_type_error(gw):
    gw.routes["/v3/kv/range"] = answer({"error": "etcdserver: user name is empty"}, status=401)
    gw.routes["/v3/auth/authenticate"] = answer({"token": ["not", "a", "token"]})

    async def go() -> None:
        etcd = Etcd([gw.url], ANSWER_WITHIN_S, username="u", password="p")
        with pytest.raises(EtcdError, match="no usable token"):
            await etcd.range_prefix(PREFIX)
        await etcd.aclose()

    run(go())


def test_a_members_status_that_is_garbage_is_an_etcd_error(gw):
    gw.routes["/v3/maintenance/status"] = answer(raw=b"[" * 50_000)

    async def go() -> None:
        etcd = Etcd([gw.url], ANSWER_WITHIN_S)
        with pytest.raises(EtcdError, match="not JSON"):
            await etcd.status(gw.url)
        await etcd.aclose()

    run(go())


# --- bytes: bounded, never inflated ---------------------------------------------------------------
def test_a_gzip_answer_is_refused_unread_and_identity_was_asked_for(gw):
    bomb = b'{"kvs": [' + b" " * (64 * MiB) + b"]}"  # 64 MiB inflated from some 64 KB
    gw.routes["/v3/kv/range"] = gzipped(bomb)

    async def go() -> None:
        etcd = Etcd([gw.url], 2.0)
        tracemalloc.start()
        try:
            with pytest.raises(EtcdError, match=r"compressed answer \(Content-Encoding: gzip\)"):
                await etcd.range_prefix(PREFIX)
            _, peak_bytes = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak_bytes < 8 * MiB, peak_bytes
        await etcd.aclose()

    run(go())
    path, headers = gw.requests[-1]
    assert path == "/v3/kv/range" and headers["accept-encoding"] == "identity"


def test_an_answer_declared_larger_than_the_cap_is_refused_before_its_body(gw):
    gw.routes["/v3/kv/range"] = declared(512 * MiB)

    async def go() -> None:
        etcd = Etcd([gw.url], 2.0)
        # refused on the length it declared (this message), not after a read timeout ("no answer within")
        with pytest.raises(EtcdError, match=f"answer of {512 * MiB} bytes, more than {MAX_ANSWER_BYTES}"):
            await etcd.range_prefix(PREFIX)
        await etcd.aclose()

    run(go())


def test_an_endless_answer_is_cut_past_the_cap_not_read_whole(gw):
    total_bytes = 128 * MiB
    gw.routes["/v3/kv/range"] = endless(total_bytes)

    async def go() -> None:
        s = sync(gw.url, timeout_s=3.0)
        tracemalloc.start()
        try:
            v = await step(s)
            _, peak_bytes = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert not v.ok and f"answer larger than {MAX_ANSWER_BYTES} bytes" in (v.error or "")
        assert peak_bytes < 4 * MAX_ANSWER_BYTES, peak_bytes
        await s.close()

    run(go())
    # what the server got out before the client hung up: the cap and the sockets' buffers, no more
    assert MAX_ANSWER_BYTES <= gw.sent["/v3/kv/range"] < total_bytes // 4


def test_the_cap_leaves_room_for_a_fleet_of_64_boxes_of_8_replicas(gw):
    kvs = [
        kv(f"{PREFIX}replicas/box{b}/r{r}", member(f"box{b}", f"r{r}", model="meta-llama/Llama-3.1-70B-Instruct"))
        for b in range(64)
        for r in range(8)
    ]
    body = json.dumps(range_answer(*kvs)).encode()
    assert len(body) < MAX_ANSWER_BYTES / 8
    gw.routes["/v3/kv/range"] = answer(raw=body)

    async def go() -> None:
        etcd = Etcd([gw.url], 2.0)
        revision, got = await etcd.range_prefix(PREFIX)
        assert revision == 9 and len(got) == 512 and got[0].mod_revision == 3 and got[0].lease == 7587
        await etcd.aclose()

    run(go())


# --- time: one deadline over each whole operation, the lock taken inside it ----------------------
def test_a_dripping_etcd_cannot_hold_the_step_past_its_deadline_while_a_slot_request_holds_the_lock(gw):
    async def go() -> None:
        s = sync(gw.url, timeout_s=0.5)
        assert (await step(s)).ok
        gw.routes["/v3/kv/txn"] = drip()
        gw.routes["/v3/kv/range"] = drip()
        asking = asyncio.ensure_future(s.acquire("a", "m"))
        while not s.lock.locked():  # the slot request holds the lock, its txn dripping
            await asyncio.sleep(0)
        # The drip lasts 60 s, run()'s bound 20 s: the step and the request end only by a deadline of
        # their own: the step's whole (1 s) or, on a loaded machine, its read's (0.5 s) first.
        v = await step(s)
        deadlines = (f"etcd did not answer within {s.deadline_s:g} s", "no answer within 0.5 s")
        assert not v.ok and any(d in (v.error or "") for d in deadlines), v
        await asking
        (line,) = said(s, "asking etcd for a fleet slot failed")
        assert "no answer within 0.5 s" in line, line
        await s.close()

    run(go())


def test_a_slot_given_back_to_a_dripping_etcd_is_bounded_and_said(gw):
    gw.routes["/v3/kv/range"] = answer(
        range_answer(
            kv(PREFIX + "replicas/box2/a", member("box2")),
            kv(PREFIX + "slots/0", json.dumps({"box": "box1", "replica": "a", "model": "m", "since": 1.0})),
        )
    )

    async def go() -> None:
        s = sync(gw.url, timeout_s=0.5)
        # The gateway answers at once, but a loaded box can hold its thread past the 0.5 s bound:
        # the slot is read again until a read comes back (what is tested is the release's bound).
        view, deadline_mono = await step(s), time.monotonic() + 10
        while not view.ok and time.monotonic() < deadline_mono:
            view = await step(s)
        assert "a" in view.mine, view
        gw.routes["/v3/kv/txn"] = drip()
        await s.release("a")  # the drip lasts 60 s, run()'s bound 20 s: only the release's deadline ends it
        (line,) = said(s, "giving its fleet slot back failed")
        assert "no answer within 0.5 s" in line
        await s.close()

    run(go())


def test_an_endpoint_that_drips_is_given_up_on_and_the_next_one_answers(gw, gw2):
    for path in GOOD:
        gw.routes[path] = drip()

    async def go() -> None:
        s = sync(gw.url, gw2.url, timeout_s=1.0)  # the dripping one first
        v = await step(s)
        assert v.ok and [m.box for m in v.members] == ["box2"], v
        assert s.etcd is not None and s.etcd.current == 1  # the next call starts with the one that answered
        await s.close()

    run(go())


def test_an_endpoint_that_is_not_etcd_is_passed_over_and_etcds_own_refusal_is_not(gw, gw2):
    """A stale first endpoint now served by something else (a 404 page) must not stop the fleet:
    the next endpoint is tried. etcd's own refusal (its JSON error shape) is final."""
    for path in GOOD:
        gw.routes[path] = answer(raw=b"<html>404 Not Found</html>", status=404)

    async def go() -> None:
        s = sync(gw.url, gw2.url)
        v = await step(s)
        assert v.ok and [m.box for m in v.members] == ["box2"], v
        await s.close()
        for path in GOOD:
            gw.routes[path] = answer({"error": "etcdserver: permission denied", "code": 7,
                                      "message": "etcdserver: permission denied"}, status=403)
        s = sync(gw.url, gw2.url)
        v = await step(s)
        assert not v.ok and "permission denied" in (v.error or ""), v
        await s.close()

    run(go())


def test_status_fleet_read_from_a_dripping_etcd_is_an_etcd_error_within_its_deadline(gw):
    gw.routes["/v3/kv/range"] = drip()

    async def go() -> None:
        cfg = config(gw.url, timeout_s=0.5)
        with pytest.raises(EtcdError, match=r"no answer within 0\.5 s"):  # its deadline, not the drip's end
            await fleet_status(cfg)

    run(go())


# --- values under the prefix that are not a guardian's: skipped, the rest kept -------------------
def hostile_kvs() -> list[KV]:
    def k(key: str, value: str) -> KV:
        return KV(PREFIX + key, value, 2, 3, 0)

    return [
        k("replicas/box2/a", member("box2")),
        k("replicas/evil/a", "[" * 100_000),  # 100 KB of "[": RecursionError in json.loads
        k("replicas/evil/b", "[" * 5_000),  # small enough to be read, too deep to be parsed
        k("replicas/evil/c", "[1, 2]"),
        k("replicas/evil/d", json.dumps({"box": ["x"] * 3, "name": "d", "model": "m", "state": "healthy"})),
        k("replicas/evil/e", json.dumps({"box": "evil", "name": "e", "model": "m" * 10_000, "state": "healthy"})),
        k("replicas/evil/f", "null"),
        k("slots/7", "{" * 3_000),
        k("replicas/box3/a", member("box3", state="stalled")),
        k("slots/0", json.dumps({"box": "box3", "replica": "a", "model": "m", "since": 2.0})),
    ]


def test_parse_view_skips_every_value_that_is_not_a_guardians_and_keeps_the_others():
    skipped: list[tuple[str, str]] = []
    members, slots = parse_view("box1", PREFIX, hostile_kvs(), skipped)
    assert [(m.box, m.name, m.state) for m in members] == [("box2", "a", "healthy"), ("box3", "a", "stalled")]
    assert [(s.box, s.replica) for s, _ in slots] == [("box3", "a")]
    why = dict(skipped)
    assert set(why) == {
        PREFIX + k
        for k in (
            "replicas/evil/a",
            "replicas/evil/b",
            "replicas/evil/c",
            "replicas/evil/d",
            "replicas/evil/e",
            "replicas/evil/f",
            "slots/7",
        )
    }
    assert "more than 16384" in why[PREFIX + "replicas/evil/a"]
    assert "RecursionError" in why[PREFIX + "replicas/evil/b"]
    assert "not a JSON object" in why[PREFIX + "replicas/evil/c"]
    assert "'box' is not text" in why[PREFIX + "replicas/evil/d"]
    assert "'model' is not text" in why[PREFIX + "replicas/evil/e"]


def test_a_step_reads_past_hostile_values_and_says_each_once(gw):
    gw.routes["/v3/kv/range"] = answer(range_answer(*[kv(x.key, x.value) for x in hostile_kvs()]))

    async def go() -> None:
        s = sync(gw.url)
        v = await step(s)
        assert v.ok and [m.box for m in v.members] == ["box2", "box3"] and [x.box for x in v.slots] == ["box3"]
        lines = said(s, "ignored")
        assert len(lines) == 4 and "4 more etcd key(s)" in lines[-1] and "replicas/evil/a" in lines[0]
        assert all(ln.priority is Priority.WARNING for ln, _ in s.journal.lines if "ignored" in ln.message)
        assert (await step(s)).ok and len(said(s, "ignored")) == 4  # said once, not every tick
        await s.close()

    run(go())


def test_a_slot_key_holding_garbage_holds_no_slot_and_is_taken_over_by_its_revision_as_read(gw):
    """Issue 41 row 6: it counted as taken (the view skipped it, the slot request did not): every
    planned restart waited on it. The slot request now skips it as the view does, and takes its
    index in a transaction that compares the key's mod revision as read, said at warning."""
    gw.routes["/v3/kv/range"] = answer(
        range_answer(kv(PREFIX + "replicas/box2/a", member("box2")), kv(PREFIX + "slots/0", "[" * 5_000, mod=5))
    )

    async def go() -> None:
        s = sync(gw.url)  # max_planned_restarts = 1: slots/0 is the only one
        v = await step(s)
        assert v.ok and v.slots == () and said(s, "slots/0' ignored")
        await s.acquire("a", "m")
        (txn,) = [json.loads(b) for p, b in gw.bodies if p == "/v3/kv/txn"]
        slot, epoch = txn["compare"]
        assert (base64.b64decode(slot["key"]).decode(), slot["target"], slot["mod_revision"]) == (
            PREFIX + "slots/0", "MOD", "5")
        assert base64.b64decode(epoch["key"]).decode() == PREFIX + "models/m"
        assert base64.b64decode(txn["success"][0]["request_put"]["key"]).decode() == PREFIX + "slots/0"
        (line,) = said(s, "taken over")
        assert "slots/0" in line and "RecursionError" in line
        await s.close()

    run(go())


def test_a_free_slot_key_is_taken_before_one_holding_garbage(gw):
    gw.routes["/v3/kv/range"] = answer(range_answer(kv(PREFIX + "slots/0", "{garbage")))

    async def go() -> None:
        s = FleetSync(config(gw.url).model_copy(update={"fleet": config(gw.url).fleet.model_copy(
            update={"max_planned_restarts": 2})}), Recorder(), lambda: Now(time.time(), time.monotonic()))
        assert (await step(s)).ok
        await s.acquire("a", "m")
        (txn,) = [json.loads(b) for p, b in gw.bodies if p == "/v3/kv/txn"]
        slot = txn["compare"][0]
        assert (base64.b64decode(slot["key"]).decode(), slot["target"]) == (PREFIX + "slots/1", "CREATE")
        assert not said(s, "taken over")
        await s.close()

    run(go())


# --- the daemon: a fleet step that raises anyway is an unreadable fleet, not an abandoned tick ----
def test_a_fleet_step_that_raises_is_an_unreadable_fleet_for_the_tick_said_once_and_the_tick_completes(tmp_path):
    from guardian.daemon import Daemon

    cfg = config("http://127.0.0.1:9").model_copy(
        update={"state_dir": tmp_path / "state", "runtime_dir": tmp_path / "run"}
    )
    journal = Recorder()

    async def go() -> Daemon:
        d = Daemon(cfg, tmp_path / "guardian.toml", journal=journal)
        assert d.fleet.membership is not None

        async def observed(*a: object, **kw: object) -> TickObservation:
            return TickObservation({"a": obs("a", time.monotonic())}, PersistentView())

        async def broken(*a: object, **kw: object) -> FleetView:
            raise RecursionError("maximum recursion depth exceeded")

        d.observer.observe = observed  # type: ignore[method-assign]
        d.fleet.membership.step = broken  # type: ignore[method-assign]
        for _ in range(2):
            before = d.last_completed_mono
            await d.tick()
            assert d.last_completed_mono > before  # completed: the watchdog is pinged
        await d.client.aclose()
        return d

    d = asyncio.run(go())
    assert not [ln for ln, _ in journal.lines if "tick abandoned" in ln.message]
    assert d.last_observation is not None and d.last_observation.fleet is not None
    assert not d.last_observation.fleet.ok and "RecursionError" in (d.last_observation.fleet.error or "")
    down = [ln for ln, _ in journal.lines if "etcd cannot be reached or read" in ln.message]
    assert len(down) == 1 and down[0].priority is Priority.ERROR


# --- the CLI: one line and exit status 1, within its deadline ------------------------------------
def guardian(tmp_path, gw: Gateway, *args: str, timeout_s: float = ANSWER_WITHIN_S) -> tuple[subprocess.CompletedProcess, float]:
    conf = tmp_path / "guardian.toml"
    conf.write_text(f'[fleet]\nendpoints = ["{gw.url}"]\nname = "t"\nbox = "box1"\ntimeout_s = {timeout_s}\n')
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "guardian", "--config", str(conf), *args], capture_output=True, text=True, timeout=60
    )
    return out, time.monotonic() - t0


def test_status_fleet_on_garbage_is_one_line_and_exit_status_1(gw, tmp_path):
    gw.routes["/v3/kv/range"] = answer({"header": [], "kvs": {}})
    out, _ = guardian(tmp_path, gw, "status", "--fleet")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1 and "cannot read the fleet from etcd" in out.stderr
    assert "header is not a JSON object" in out.stderr


def test_status_fleet_on_a_dripping_etcd_ends_within_its_deadline(gw, tmp_path):
    gw.routes["/v3/kv/range"] = drip()
    out, elapsed_s = guardian(tmp_path, gw, "status", "--fleet", timeout_s=0.5)  # past its 60 s timeout: failed
    print(f"status --fleet against a dripping etcd ended after {elapsed_s:.1f} s")
    assert out.returncode == 1 and "no answer within 0.5 s" in out.stderr, out.stderr


def test_status_fleet_shows_the_fleet_past_a_hostile_value_and_names_it(gw, tmp_path):
    gw.routes["/v3/kv/range"] = answer(range_answer(*[kv(x.key, x.value) for x in hostile_kvs()]))
    out, _ = guardian(tmp_path, gw, "status", "--fleet")
    assert out.returncode == 0, out.stderr
    assert "2 box(es); planned restarts 1 of 1 slot(s) held" in out.stdout
    assert "box3/a" in out.stdout and "stalled" in out.stdout and "slot 0: held by box3/a (m)" in out.stdout
    assert f"ignored '{PREFIX}replicas/evil/a': a value of 100000 characters" in out.stdout
    out, _ = guardian(tmp_path, gw, "status", "--fleet", "--json")
    data = json.loads(out.stdout)
    assert sorted(data["boxes"]) == ["box2", "box3"] and len(data["ignored"]) == 7


def test_check_counts_garbage_from_etcd_as_a_problem_without_a_traceback(gw, tmp_path):
    gw.routes["/v3/kv/range"] = answer(raw=b'{"header":' + b"[" * 100_000)
    out, _ = guardian(tmp_path, gw, "check", "--no-systemd")
    assert out.returncode == 1 and "Traceback" not in out.stderr + out.stdout, out.stderr
    assert "problem: fleet: etcd cannot be read (" in out.stdout and "RecursionError" in out.stdout
