"""The probes against a hostile replica on loopback: every byte is bounded before it is decoded,
and parsing runs off the event loop (issue 10, rows 1, 2, 4, 6)."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

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
    assert not result.ok and f"larger than {probes.MAX_SMALL_BYTES} bytes" in result.error
    assert result.latency_s < hostile.canary_timeout_s  # ended by the bytes, not by the deadline


def test_a_compressed_metrics_page_is_unreadable_never_inflated(hostile):
    probe, sample = run(lambda c: probes.probe_metrics(c, hostile))
    assert sample is None and not probe.ok and "compressed answer (Content-Encoding: gzip)" in probe.error


def test_a_declared_huge_answer_is_refused_before_reading(hostile):
    probe = run(lambda c: probes.probe_health(c, hostile))
    assert not probe.ok and "more than 65536" in probe.error


def test_a_huge_model_id_is_cut_to_a_bounded_length(hostile):
    probe, models = run(lambda c: probes.probe_models(c, hostile))
    assert probe.ok and models is not None and len(models[0]) <= probes.MAX_MODEL_ID_CHARS + 3


def test_metrics_are_parsed_off_the_event_loop(hostile, monkeypatch):
    """A parse that only ends when the event loop runs proves the loop was free meanwhile."""
    page = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
    released = threading.Event()
    real = probes.parse_vllm_metrics

    def slow_parse(text: str):  # noqa: ANN202
        assert released.wait(5), "the event loop was blocked while /metrics was parsed"
        return real(page + "vllm:num_requests_waiting 0\nvllm:generation_tokens_total 0\n")

    monkeypatch.setattr(probes, "parse_vllm_metrics", slow_parse)

    async def fetch_ok(client, url):  # noqa: ANN001, ANN202
        return probes.Probe(True, 200, 0.0), page.encode()

    monkeypatch.setattr(probes, "_get", lambda client, url, t, n: fetch_ok(client, url))

    async def both(client):  # noqa: ANN001, ANN202
        parse = asyncio.create_task(probes.probe_metrics(client, hostile))
        await asyncio.sleep(0.05)  # the loop runs on while the parse waits in its thread
        released.set()
        return await asyncio.wait_for(parse, 10)

    probe, sample = run(both)
    assert probe.ok and sample is not None and sample.running == 0
