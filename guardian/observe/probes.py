"""Bounded HTTP probes of one replica, straight at its own address (never a proxy)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace

import httpx

from .. import engines
from ..config import ReplicaConfig
from ..core.observations import CanaryResult, Probe, VllmSample
from ..engines.base import Engine
from . import plainhttp
from .metrics import MetricsError, parse_page

# Every byte from a replica is bounded before it is decoded: guardian asks for no compression,
# refuses a compressed answer (a 1 MB gzip can inflate to 1 GiB), and reads at most this much of
# each answer; the memory it reads into is the GPU's on a GB10.
MAX_METRICS_BYTES = 4 * 2**20
MAX_MODELS_BYTES = 2**20
MAX_SMALL_BYTES = 64 * 2**10  # /health, a canary's answer
PARSE_TIMEOUT_S = 1.0  # a real page's lines parse in about 1 ms
# Parsed on the event loop up to this size: at most 64 KiB of wanted lines, a few ms at worst even
# for the parser's quadratic case (a 16 KiB line of escapes: about 2 ms); a /v1/models answer of
# this size is a fraction of a ms for json.loads.
INLINE_PARSE_BYTES = 64 * 2**10
HEADERS = {"Accept-Encoding": "identity"}


def make_client() -> httpx.AsyncClient:
    # trust_env=False: an HTTP(S)_PROXY in the environment must not route probes via a proxy.
    return httpx.AsyncClient(
        trust_env=False, follow_redirects=False, limits=httpx.Limits(max_connections=200, max_keepalive_connections=0)
    )


def _error_text(e: BaseException) -> str:
    """A failed request in a few words, whichever client made it (httpx or plainhttp)."""
    if isinstance(e, httpx.TimeoutException | TimeoutError):
        return "timeout"
    if isinstance(e, httpx.ConnectError):
        return "connection refused" if "refused" in str(e).lower() else f"cannot connect: {e}"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, ConnectionResetError | BrokenPipeError):
        return f"connection closed: {e}"[:500]
    if isinstance(e, OSError):
        return f"cannot connect: {e.strerror or e}"[:500]
    return f"{type(e).__name__}: {e}"[:500]


def _refused(e: plainhttp.TooLarge, start: float) -> tuple[Probe, bytes]:
    """An answer refused for its size or encoding: it answered, so "unreadable", never "no answer"."""
    return Probe(False, e.status, time.monotonic() - start, f"unreadable: {e}"), b""


async def _request(
    client: httpx.AsyncClient,
    method: str,
    at: tuple[str, str | None],
    timeout_s: float,
    max_bytes: int,
    body: dict[str, object] | None = None,
) -> tuple[Probe, bytes]:
    """One bounded request to AT (a URL, and the address to connect to; None: the URL's host):
    the time by TIMEOUT_S, the bytes by MAX_BYTES (raw, never inflated)."""
    start = time.monotonic()
    target, host, extensions = plainhttp.pinned(*at)
    headers = {**HEADERS, **host}
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream(
                method, target, timeout=timeout_s, headers=headers, json=body, extensions=extensions
            ) as resp:
                status = resp.status_code
                h = resp.headers
                plainhttp.check_head(status, h.get("content-encoding", ""), h.get("content-length", ""), max_bytes)
                data = bytearray()
                async for chunk in resp.aiter_raw():
                    data += chunk
                    if len(data) > max_bytes:
                        raise plainhttp.TooLarge(f"answer larger than {max_bytes} bytes", status)
    except plainhttp.TooLarge as e:
        return _refused(e, start)
    except Exception as e:  # noqa: BLE001 - every failure is an observation, not a crash
        return Probe(False, None, time.monotonic() - start, _error_text(e)), b""
    latency = time.monotonic() - start
    ok = 200 <= resp.status_code < 300
    return Probe(ok, resp.status_code, latency, None if ok else f"HTTP {resp.status_code}"), bytes(data)


async def _get(
    client: httpx.AsyncClient, url: str, timeout_s: float, max_bytes: int, address: str | None = None
) -> tuple[Probe, bytes]:
    """A bounded GET, to ADDRESS where given: over plain HTTP with h11 (a quarter of httpx's CPU,
    plainhttp.py), over HTTPS with CLIENT."""
    return await _fetch(client, "GET", (url, address), timeout_s, max_bytes)


async def _fetch(
    client: httpx.AsyncClient,
    method: str,
    at: tuple[str, str | None],
    timeout_s: float,
    max_bytes: int,
    body: dict[str, object] | None = None,
) -> tuple[Probe, bytes]:
    """One bounded request, as _request's (AT: the URL, and the address to connect to), with h11
    over plain HTTP and with CLIENT over HTTPS; BODY is sent as JSON, as httpx sends it."""
    url, address = at
    if not url.startswith("http://"):
        return await _request(client, method, at, timeout_s, max_bytes, body)
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            status, data = await plainhttp.request(method, url, max_bytes, address, _json(body))
    except plainhttp.TooLarge as e:
        return _refused(e, start)
    except Exception as e:  # noqa: BLE001 - every failure is an observation, not a crash
        return Probe(False, None, time.monotonic() - start, _error_text(e)), b""
    ok = 200 <= status < 300
    return Probe(ok, status, time.monotonic() - start, None if ok else f"HTTP {status}"), data


def _json(body: dict[str, object] | None) -> bytes | None:
    """BODY as httpx encodes json= (httpx/_content.py): compact, UTF-8, no NaN."""
    if body is None:
        return None
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


async def health_at(
    client: httpx.AsyncClient, base_url: str, timeout_s: float, address: str | None = None, path: str = "/health"
) -> Probe:
    """The API server's answer at PATH (its engine's health_path: engines/)."""
    probe, _ = await _get(client, base_url + path, timeout_s, MAX_SMALL_BYTES, address)
    return probe


async def probe_health(client: httpx.AsyncClient, r: ReplicaConfig, address: str | None = None) -> Probe:
    return await health_at(client, r.url, r.health_timeout_s, address)


async def probe_metrics(
    client: httpx.AsyncClient,
    r: ReplicaConfig,
    timeout_s: float | None = None,
    address: str | None = None,
    engine: Engine = engines.DEFAULT,
) -> tuple[Probe, VllmSample | None]:
    """ENGINE's Prometheus page of R, read as its PageShape says. A status the engine answers when
    its page is not enabled (engines/: Engine.not_offered) is said so, with the flag that enables it."""
    bound_s = timeout_s if timeout_s is not None else r.metrics_timeout_s
    probe, body = await _get(client, r.url + engine.metrics_path, bound_s, MAX_METRICS_BYTES, address)
    if not engine.page_offered(probe.status):
        return replace(probe, error=f"not offered (HTTP {probe.status}): {engine.metrics_hint()}"), None
    if not probe.ok:
        return probe, None
    page = engine.page
    if page is None:
        return Probe(False, probe.status, probe.latency_s, f"{engine.label} has no page guardian reads"), None
    try:
        if len(body) <= INLINE_PARSE_BYTES:
            # A real page (51 KB) costs about 0.5 ms; handing it to a thread cost as much again.
            return probe, parse_page(body, page)
        # Off the event loop: a large page must not delay another replica's probes or a ping.
        # Its cost is bounded by construction (metrics.select_lines); the time bound is for a box
        # so loaded that even that is slow: the page was answered, so it is "unreadable", which
        # never counts as "no answer".
        return probe, await asyncio.wait_for(asyncio.to_thread(parse_page, body, page), PARSE_TIMEOUT_S)
    except MetricsError as e:
        return Probe(False, probe.status, probe.latency_s, f"unreadable: {e}"), None
    except TimeoutError:
        return Probe(False, probe.status, probe.latency_s, f"unreadable: not parsed within {PARSE_TIMEOUT_S:g} s"), None


async def models_at(
    client: httpx.AsyncClient, base_url: str, timeout_s: float, address: str | None = None
) -> tuple[Probe, tuple[str, ...] | None]:
    probe, body = await _get(client, base_url + "/v1/models", timeout_s, MAX_MODELS_BYTES, address)
    if not probe.ok:
        return probe, None
    try:
        # A real answer (a few hundred bytes) is read on the loop: a thread hop cost more than the read.
        data = json.loads(body) if len(body) <= INLINE_PARSE_BYTES else await asyncio.to_thread(json.loads, body)
        ids = tuple(_model_id(m["id"]) for m in data["data"][:MAX_MODEL_IDS])
    except Exception as e:  # noqa: BLE001 - any shape of garbage is "unreadable", not a crash
        return Probe(False, probe.status, probe.latency_s, f"unreadable: {type(e).__name__}"), None
    return probe, ids


MAX_MODEL_IDS = 64
MAX_MODEL_ID_CHARS = 512


def _model_id(value: object) -> str:
    """A model id as guardian will show it: text, of bounded length."""
    if not isinstance(value, str):
        raise TypeError("a model id is not a string")
    return value if len(value) <= MAX_MODEL_ID_CHARS else value[:MAX_MODEL_ID_CHARS] + "..."


async def probe_models(
    client: httpx.AsyncClient, r: ReplicaConfig, address: str | None = None
) -> tuple[Probe, tuple[str, ...] | None]:
    return await models_at(client, r.url, r.health_timeout_s, address)


async def canary(
    client: httpx.AsyncClient,
    r: ReplicaConfig,
    started_at: float,
    timeout_s: float | None = None,
    address: str | None = None,
) -> CanaryResult:
    """A one-token completion: proves the engine, not just the API server, is alive. Bounded in
    time (TIMEOUT_S, the core's deadline; else canary_timeout_s) and in bytes (MAX_SMALL_BYTES):
    an answer that never ends, or is huge, is a failed canary."""
    body: dict[str, object] = {"model": r.model, "prompt": "ping", "max_tokens": 1, "temperature": 0}
    deadline_s = timeout_s if timeout_s is not None else r.canary_timeout_s
    url = r.url + "/v1/completions"
    probe, data = await _fetch(client, "POST", (url, address), deadline_s, MAX_SMALL_BYTES, body)
    if not probe.ok:
        return CanaryResult(False, started_at, probe.latency_s, probe.error)
    try:
        choices = json.loads(data).get("choices")
    except (ValueError, AttributeError, RecursionError):
        return CanaryResult(False, started_at, probe.latency_s, "unreadable answer")
    if not choices:
        return CanaryResult(False, started_at, probe.latency_s, "no choices in the answer")
    return CanaryResult(True, started_at, probe.latency_s)
