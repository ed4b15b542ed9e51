"""The probes against a hostile replica on loopback: every byte is bounded before it is decoded,
and parsing runs off the event loop (issue 10, rows 1, 2, 4, 6)."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from guardian.config import ReplicaConfig
from guardian.observe import probes

ENDLESS = b"x" * 65536


class Hostile(BaseHTTPRequestHandler):
    def log_message(self, *a: object) -> None:
        pass

    def _send(self, body: bytes, headers: dict[str, str] | None = None, length: int | None = None) -> None:
        self.send_response(200)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/metrics":  # a gzip bomb (the field saw 1 MB that inflates to 1 GiB)
            self._send(self.server.bomb, {"Content-Encoding": "gzip"})  # type: ignore[attr-defined]
        elif self.path == "/v1/models":
            self._send(json.dumps({"data": [{"id": "m" * 300_000 + "\n<2>forged"}]}).encode())
        elif self.path == "/health":
            self._send(b"", length=10 * 2**30)  # declares 10 GiB
        else:
            self.send_error(404)

    def do_POST(self) -> None:  # a canary whose answer never ends
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(200)
        self.end_headers()
        try:
            while True:
                self.wfile.write(ENDLESS)
        except OSError:
            pass


@pytest.fixture(scope="module")
def hostile() -> Iterator[ReplicaConfig]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    server.daemon_threads = True
    server.bomb = gzip.compress(b"\0" * 2**26, 9)  # type: ignore[attr-defined]  # 64 KiB -> 64 MiB
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield ReplicaConfig(name="h", unit="h.service", url=f"http://127.0.0.1:{server.server_address[1]}", model="m",
                        canary_timeout_s=10, metrics_timeout_s=5, health_timeout_s=5)
    server.shutdown()


def run(coro):  # noqa: ANN001, ANN201
    async def go():  # noqa: ANN202
        async with probes.make_client() as client:
            return await coro(client)
    return asyncio.run(go())


def test_a_canary_answer_that_never_ends_is_cut_at_its_byte_cap(hostile):
    result = run(lambda c: probes.canary(c, hostile, 0.0))
    # ended by the bytes (this message), not by the deadline (that one says "no answer within")
    assert not result.ok and f"larger than {probes.MAX_SMALL_BYTES} bytes" in result.error


def test_a_compressed_metrics_page_is_unreadable_never_inflated(hostile):
    probe, sample = run(lambda c: probes.probe_metrics(c, hostile))
    assert sample is None and not probe.ok and "compressed answer (Content-Encoding: gzip)" in probe.error


def test_a_declared_huge_answer_is_refused_before_reading(hostile):
    probe = run(lambda c: probes.probe_health(c, hostile))
    assert not probe.ok and "more than 65536" in probe.error


def test_a_huge_model_id_is_cut_to_a_bounded_length(hostile):
    probe, models = run(lambda c: probes.probe_models(c, hostile))
    assert probe.ok and models is not None and len(models[0]) <= probes.MAX_MODEL_ID_CHARS + 3


def test_a_large_metrics_page_is_parsed_off_the_event_loop(hostile, monkeypatch):
    """A parse that only ends when the event loop runs proves the loop was free meanwhile. A page
    up to INLINE_PARSE_BYTES (a real one is 51 KB) is parsed inline: that is cheaper than a thread."""
    page = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
    page += "# padding\n" * (probes.INLINE_PARSE_BYTES // 10 + 1)
    released = threading.Event()
    real = probes.parse_page

    def slow_parse(body: bytes, shape):  # noqa: ANN001, ANN202
        assert released.wait(5), "the event loop was blocked while /metrics was parsed"
        return real((page + "vllm:num_requests_waiting 0\nvllm:generation_tokens_total 0\n").encode(), shape)

    monkeypatch.setattr(probes, "parse_page", slow_parse)

    async def fetch_ok(client, url):  # noqa: ANN001, ANN202
        return probes.Probe(True, 200, 0.0), page.encode()

    monkeypatch.setattr(probes, "_get", lambda client, url, t, n, address=None: fetch_ok(client, url))

    async def both(client):  # noqa: ANN001, ANN202
        parse = asyncio.create_task(probes.probe_metrics(client, hostile))
        await asyncio.sleep(0.05)  # the loop runs on while the parse waits in its thread
        released.set()
        return await asyncio.wait_for(parse, 10)

    probe, sample = run(both)
    assert probe.ok and sample is not None and sample.running == 0


# --- each probe judged on its own; the parser given a bounded input (issue 21, row 1) -------------

REAL_LINES = (
    "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 2\n"
    "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 0\n"
    "vllm:generation_tokens_total{engine=\"0\",model_name=\"m\"} 40\n"
)


class Pages(BaseHTTPRequestHandler):
    """/health at once; /metrics as the test sets it, or held until the test lets it go."""

    def log_message(self, *a: object) -> None:
        pass

    def do_GET(self) -> None:
        srv = self.server
        srv.asked[self.path] = srv.asked.get(self.path, 0) + 1  # type: ignore[attr-defined]
        if self.path == "/metrics":
            if srv.hold_metrics.is_set():  # type: ignore[attr-defined]
                srv.release.wait(30)  # type: ignore[attr-defined]
            body = srv.page  # type: ignore[attr-defined]
        elif self.path == "/v1/models":
            body = b'{"data": [{"id": "m"}]}'
        else:
            body = b""
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def pages() -> Iterator[tuple[ReplicaConfig, ThreadingHTTPServer]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Pages)
    server.daemon_threads = True
    server.asked, server.page = {}, REAL_LINES.encode()  # type: ignore[attr-defined]
    server.hold_metrics, server.release = threading.Event(), threading.Event()  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield ReplicaConfig(name="p", unit="p.service", url=f"http://127.0.0.1:{server.server_address[1]}", model="m",
                        metrics_timeout_s=5, health_timeout_s=5), server
    server.release.set()  # type: ignore[attr-defined]
    server.shutdown()


def test_a_health_answer_counts_while_metrics_are_still_in_flight(pages):
    """The field's shape: /metrics slow (a page slow to fetch or parse) hid a /health 200 for 11 s,
    and the replica was judged unresponsive. Each endpoint is carried on its own."""
    from guardian.observe.replicas import ProbeCarry

    r, server = pages
    server.hold_metrics.set()

    async def ticks():  # noqa: ANN202
        carry = ProbeCarry()
        seen = []
        async with probes.make_client() as client:
            for i in range(3):
                tasks = carry.start(client, r, float(i))
                await asyncio.wait(tasks, timeout=0.5)
                seen.append(carry.take(r.name, float(i) + 0.5))
            server.release.set()
            await asyncio.wait(carry.start(client, r, 3.0), timeout=5)
            seen.append(carry.take(r.name, 3.5))
        return seen

    seen = asyncio.run(ticks())
    for (health, (mprobe, sample), (models_probe, _)), pending_s in seen[:3]:
        assert health.ok and models_probe.ok and pending_s is None  # answered: news, not L10
        assert not mprobe.ok and mprobe.status is None and "no answer yet" in mprobe.error and sample is None
    (health, (mprobe, sample), _), pending_s = seen[3]
    assert health.ok and mprobe.ok and sample is not None and sample.running == 2 and pending_s is None
    # each answer carries when its probe was sent: the carried /metrics at the first tick's start
    assert (health.sent_at, mprobe.sent_at) == (3.0, 0.0)
    assert server.asked["/metrics"] == 1 and server.asked["/health"] == 4  # the slow one is not sent twice


@pytest.mark.parametrize("bound_s, answered", [(0.0, False), (10.0, True)])
def test_a_probe_answered_past_its_timeout_but_within_the_unresponsive_window_is_an_answer(pages, bound_s, answered):
    """Issue 35: on a starved box every answer came 1-8 s late. A probe runs up to the longer of its
    timeout and W.unresponsive_after_s: the late 200 is an answer, its latency says it was slow."""
    from guardian.observe.replicas import ProbeCarry

    r, server = pages
    r = r.model_copy(update={"metrics_timeout_s": 0.2})
    server.hold_metrics.set()

    async def run():  # noqa: ANN202
        carry = ProbeCarry()
        async with probes.make_client() as client:
            tasks = carry.start(client, r, 0.0, bound_s)
            await asyncio.wait(tasks, timeout=0.5)  # past the 0.2 s timeout: held by the server
            server.release.set()
            await asyncio.wait(tasks, timeout=5)
            return carry.take(r.name, 5.0)

    (_health, (mprobe, sample), _models), _pending = asyncio.run(run())
    assert mprobe.ok is answered and (sample is not None) is answered
    if answered:
        assert mprobe.latency_s >= 0.2  # slow, and said to be (the latency is the answer's own)
    else:
        assert mprobe.error == "timeout"


def test_no_answer_at_all_with_a_probe_in_flight_is_no_news(pages):
    from guardian.observe.replicas import ProbeCarry

    r, _server = pages
    r = r.model_copy(update={"url": "http://127.0.0.1:9"})  # nothing listens: refused at once

    async def tick():  # noqa: ANN202
        carry = ProbeCarry()
        async with probes.make_client() as client:
            await asyncio.wait(carry.start(client, r, 0.0), timeout=2)
            first = carry.take(r.name, 2.0)
            hung = asyncio.ensure_future(asyncio.sleep(3600))
            carry.tasks[r.name]["health"] = (hung, 2.0)  # a /health sent to a frozen server
            await asyncio.wait(carry.start(client, r, 4.0), timeout=0.2)
            second = carry.take(r.name, 5.0)
            carry.forget(set())
            return first, second, hung

    (_, first_pending), (results, second_pending), hung = asyncio.run(tick())
    assert first_pending is None  # every probe ended (refused): a verdict can be made
    assert second_pending == pytest.approx(3.0) and "in flight for 3.0 s" in results[0].error
    assert hung.cancelled()


def test_the_parser_is_given_only_the_series_guardian_reads(pages, monkeypatch):
    """A 2.5 MiB page whose label value is all escapes kept one core busy for minutes in
    prometheus_client's parser (quadratic): only the wanted lines may reach it (here none do: they
    are of the plain shape that parse_vllm_page reads without it)."""
    from guardian.observe import metrics

    r, server = pages
    escapes = '\\"' * (2**20 // 2)
    server.page = (REAL_LINES + f'other_series{{label="{escapes}"}} 1\n' * 2).encode()
    assert len(server.page) > 2 * 2**20
    given: list[int] = []
    real = metrics.text_string_to_metric_families

    def recording(text: str):  # noqa: ANN202
        given.append(len(text))
        return real(text)

    monkeypatch.setattr(metrics, "text_string_to_metric_families", recording)
    probe, sample = run(lambda c: probes.probe_metrics(c, r))
    assert probe.ok and sample is not None and sample.running == 2 and sample.generation_tokens == 40
    assert all(n <= metrics.MAX_SELECTED_BYTES for n in given)
    # A wanted line of another shape (a space after a comma): the wanted lines go to prometheus_client.
    other_shape = REAL_LINES.replace('"0",model_name', '"0", model_name')
    server.page = (other_shape + f'other_series{{label="{escapes}"}} 1\n' * 2).encode()
    probe, sample = run(lambda c: probes.probe_metrics(c, r))
    assert probe.ok and sample is not None and sample.running == 2 and sample.generation_tokens == 40
    assert given and max(given) <= metrics.MAX_SELECTED_BYTES


@pytest.mark.parametrize("line, why", [
    ('vllm:cache_config_info{gpu_memory_utilization="0.9",x="' + "y" * 20_000 + '"} 1', "vllm:cache_config_info line of"),
    ('vllm:num_requests_waiting{engine="0",x="' + "y" * 20_000 + '"} 1', "vllm:num_requests_waiting line of"),
])
def test_a_wanted_line_over_its_cap_is_unreadable_not_no_answer(pages, line, why):
    r, server = pages
    server.page = (REAL_LINES + line + "\n").encode()
    probe, sample = run(lambda c: probes.probe_metrics(c, r))
    assert sample is None and not probe.ok and probe.status == 200 and probe.answered
    assert probe.error.startswith("unreadable: a ") and why in probe.error


# --- the plain-HTTP GET (observe/plainhttp.py): what uvicorn and odd servers send -----------------

def _raw_server(answer: bytes):  # noqa: ANN202
    """A server that answers every connection with ANSWER, byte for byte, then closes."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.getsockname()[1]}"


@pytest.mark.parametrize("answer, ok, status, body, error", [
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
     True, 200, b"hello world", None),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA", True, 200, b"ok", None),
    (b"HTTP/1.0 200 OK\r\n\r\nuntil close", True, 200, b"until close", None),  # no length: read to EOF
    (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n", False, 503, b"", "HTTP 503"),
    (b"HTTP/1.1 301 Moved\r\nLocation: http://10.9.9.9/\r\nContent-Length: 0\r\n\r\n", False, 301, b"", "HTTP 301"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + (b"ffff\r\n" + b"x" * 0xFFFF + b"\r\n") * 2 + b"0\r\n\r\n",
     False, 200, b"", "unreadable: answer larger than 65536 bytes"),  # chunked past the cap: it answered
    (b"SSH-2.0-OpenSSH_9.2\r\n", False, None, b"", "closed before a complete answer"),
    (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", False, None, b"", "RemoteProtocolError"),  # a whole head, not HTTP
    (b"", False, None, b"", "closed before a complete answer"),
])
def test_a_plain_get_reads_what_http_servers_send_within_its_bounds(answer, ok, status, body, error):
    srv, url = _raw_server(answer)
    try:
        probe, data = run(lambda c: probes._get(c, url + "/health", 5, probes.MAX_SMALL_BYTES))
    finally:
        srv.close()
    assert (probe.ok, probe.status, data) == (ok, status, body)
    assert (probe.error is None) if error is None else (error in probe.error), probe.error


def test_a_plain_get_to_nothing_is_refused_and_to_a_silent_server_times_out():
    import socket

    probe, _ = run(lambda c: probes._get(c, "http://127.0.0.1:9/health", 5, 100))
    assert not probe.ok and probe.error == "connection refused"
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # accepts (the kernel does), never answers: a frozen API server
    try:
        probe, _ = run(lambda c: probes._get(c, f"http://127.0.0.1:{silent.getsockname()[1]}/health", 0.3, 100))
    finally:
        silent.close()
    assert not probe.ok and probe.error == "timeout" and probe.status is None


# --- the canary over plain HTTP (plainhttp.request), over HTTPS with httpx ----------------------------

def _completion_server(status: int = 200, answer: bytes = b'{"choices":[{"text":"x"}]}'):  # noqa: ANN202
    """A server that keeps each POST it gets (path, headers, body) and answers it with ANSWER."""
    seen: list[tuple[str, dict, bytes]] = []

    class Completions(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
            self.send_response(status)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *_a: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Completions)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, seen


class _NoClient(httpx.AsyncBaseTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"a plain-HTTP canary went through httpx: {request.url}")


def _canary(r: ReplicaConfig, client: httpx.AsyncClient | None = None, address: str | None = None):  # noqa: ANN202
    async def go():  # noqa: ANN202
        async with client or httpx.AsyncClient(transport=_NoClient()) as c:
            return await probes.canary(c, r, 0.0, 5, address)
    return asyncio.run(go())


def test_a_canary_posts_what_httpx_posted_and_reads_the_answer():
    srv, seen = _completion_server()
    port = srv.server_address[1]
    r = ReplicaConfig(name="a", unit="a.service", url=f"http://localhost:{port}", model="m é")
    try:
        result = _canary(r, address="127.0.0.1")
    finally:
        srv.shutdown()
        srv.server_close()
    assert result.ok and result.error is None and result.latency_s > 0
    (path, headers, body), = seen
    sent = {"model": "m é", "prompt": "ping", "max_tokens": 1, "temperature": 0}
    assert path == "/v1/completions" and body == httpx.Request("POST", "http://x/", json=sent).content
    assert headers["content-type"] == "application/json" and headers["host"] == f"localhost:{port}"
    assert headers["accept-encoding"] == "identity"


@pytest.mark.parametrize("status, answer, error", [
    (503, b"", "HTTP 503"),
    (200, b"not json", "unreadable answer"),
    (200, b'{"choices": []}', "no choices in the answer"),
])
def test_a_canary_that_fails_says_how_over_plain_http(status, answer, error):
    srv, _seen = _completion_server(status, answer)
    try:
        result = _canary(ReplicaConfig(name="a", unit="a.service", url=f"http://127.0.0.1:{srv.server_address[1]}",
                                       model="m"))
    finally:
        srv.shutdown()
        srv.server_close()
    assert not result.ok and result.error == error


def test_a_canary_to_nothing_is_refused_and_over_https_goes_through_httpx():
    refused = _canary(ReplicaConfig(name="a", unit="a.service", url="http://127.0.0.1:9", model="m"))
    assert not refused.ok and refused.error == "connection refused"
    asked: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request)
        return httpx.Response(200, stream=httpx.ByteStream(b'{"choices": [{"text": "x"}]}'))

    tls = ReplicaConfig(name="a", unit="a.service", url="https://box.example:8443", model="m")
    result = _canary(tls, httpx.AsyncClient(transport=httpx.MockTransport(answer)))
    assert result.ok and [str(x.url) for x in asked] == ["https://box.example:8443/v1/completions"]


@pytest.mark.parametrize("body, ids", [
    (b'{"object": "list", "data": [{"id": "m", "object": "model"}]}', ("m",)),
    (json.dumps({"data": [{"id": "m"}], "pad": "x" * probes.INLINE_PARSE_BYTES}).encode(), ("m",)),
    (b'{"data": [{"id": 7}]}', None),
    (b"[" * 50_000, None),
    (b"[" * 70_000, None),
])
def test_a_models_answer_is_read_on_the_loop_up_to_the_inline_size_and_the_same_either_way(monkeypatch, body, ids):
    """A real answer is a few hundred bytes: json.loads on the loop, not a thread hop; a large one
    still goes to a thread; garbage is "unreadable" either way."""
    hops: list[object] = []
    real_to_thread = asyncio.to_thread

    async def to_thread(fn, *args):  # noqa: ANN001, ANN202
        hops.append(fn)
        return await real_to_thread(fn, *args)

    async def answered(*_a: object) -> tuple:
        return probes.Probe(True, 200, 0.01), body

    monkeypatch.setattr(probes, "_get", answered)
    monkeypatch.setattr(probes.asyncio, "to_thread", to_thread)
    probe, got = asyncio.run(probes.models_at(None, "http://127.0.0.1:1", 5))  # type: ignore[arg-type]
    assert got == ids and probe.ok == (ids is not None)
    assert (probe.error is None) if ids is not None else probe.error.startswith("unreadable: ")
    assert hops == ([json.loads] if len(body) > probes.INLINE_PARSE_BYTES else [])


def _resetting_server(first: bytes):  # noqa: ANN202
    """A server that sends FIRST, then resets the connection (RST, not FIN)."""
    import socket
    import struct

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.sendall(first)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.getsockname()[1]}"


@pytest.mark.parametrize("first, error", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial", "connection closed: "),
    (b"HTTP/1.1 200 OK\r\nContent-", "connection closed: "),
])
def test_a_reset_mid_answer_is_a_closed_connection(first, error):
    srv, url = _resetting_server(first)
    try:
        probe, data = run(lambda c: probes._get(c, url + "/health", 5, probes.MAX_SMALL_BYTES))
    finally:
        srv.close()
    assert not probe.ok and data == b"" and probe.error.startswith(error), probe.error


def test_a_large_answer_in_many_reads_is_read_whole_up_to_its_cap():
    body = bytes(range(256)) * 2048  # 512 KiB, many reads
    srv, url = _raw_server(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    try:
        probe, data = run(lambda c: probes._get(c, url + "/metrics", 5, probes.MAX_METRICS_BYTES))
        small, _ = run(lambda c: probes._get(c, url + "/metrics", 5, len(body) - 1))
    finally:
        srv.close()
    assert probe.ok and data == body
    assert not small.ok and small.error == f"unreadable: answer of {len(body)} bytes, more than {len(body) - 1}"
