"""Bounded HTTP probes of one replica, straight at its own address (never a proxy)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from ..config import ReplicaConfig
from ..core.observations import CanaryResult, Probe, VllmSample
from .metrics import MetricsError, parse_vllm_metrics

# Never more than this much of a page is read: a broken replica must not fill our memory.
MAX_BODY_BYTES = 4 * 2**20


def make_client() -> httpx.AsyncClient:
    # trust_env=False: an HTTP(S)_PROXY in the environment must not route probes via a proxy.
    return httpx.AsyncClient(
        trust_env=False, follow_redirects=False, limits=httpx.Limits(max_connections=200, max_keepalive_connections=0)
    )


def _error_text(e: BaseException) -> str:
    if isinstance(e, (httpx.TimeoutException, asyncio.TimeoutError)):
        return "timeout"
    if isinstance(e, httpx.ConnectError):
        return "connection refused" if "refused" in str(e).lower() else f"cannot connect: {e}"
    return f"{type(e).__name__}: {e}"


async def _get(client: httpx.AsyncClient, url: str, timeout_s: float) -> tuple[Probe, bytes]:
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("GET", url, timeout=timeout_s) as resp:
                body = bytearray()
                async for chunk in resp.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_BODY_BYTES:
                        raise ValueError(f"body larger than {MAX_BODY_BYTES} bytes")
    except Exception as e:  # noqa: BLE001 - every failure is an observation, not a crash
        return Probe(False, None, time.monotonic() - start, _error_text(e)), b""
    latency = time.monotonic() - start
    ok = 200 <= resp.status_code < 300
    return Probe(ok, resp.status_code, latency, None if ok else f"HTTP {resp.status_code}"), bytes(body)


async def health_at(client: httpx.AsyncClient, base_url: str, timeout_s: float) -> Probe:
    probe, _ = await _get(client, base_url + "/health", timeout_s)
    return probe


async def probe_health(client: httpx.AsyncClient, r: ReplicaConfig) -> Probe:
    return await health_at(client, r.url, r.health_timeout_s)


async def probe_metrics(client: httpx.AsyncClient, r: ReplicaConfig) -> tuple[Probe, VllmSample | None]:
    probe, body = await _get(client, r.url + "/metrics", r.metrics_timeout_s)
    if not probe.ok:
        return probe, None
    try:
        return probe, parse_vllm_metrics(body.decode("utf-8", errors="replace"))
    except MetricsError as e:
        return Probe(False, probe.status, probe.latency_s, f"unreadable: {e}"), None


async def models_at(client: httpx.AsyncClient, base_url: str, timeout_s: float) -> tuple[Probe, tuple[str, ...] | None]:
    probe, body = await _get(client, base_url + "/v1/models", timeout_s)
    if not probe.ok:
        return probe, None
    try:
        data = json.loads(body)
        ids = tuple(str(m["id"]) for m in data["data"])
    except Exception as e:  # noqa: BLE001 - any shape of garbage is "unreadable", not a crash
        return Probe(False, probe.status, probe.latency_s, f"unreadable: {type(e).__name__}"), None
    return probe, ids


async def probe_models(client: httpx.AsyncClient, r: ReplicaConfig) -> tuple[Probe, tuple[str, ...] | None]:
    return await models_at(client, r.url, r.health_timeout_s)


async def canary(client: httpx.AsyncClient, r: ReplicaConfig, started_at: float) -> CanaryResult:
    """A one-token completion: proves the engine, not just the API server, is alive."""
    start = time.monotonic()
    try:
        async with asyncio.timeout(r.canary_timeout_s):
            resp = await client.post(
                r.url + "/v1/completions",
                json={"model": r.model, "prompt": "ping", "max_tokens": 1, "temperature": 0},
                timeout=r.canary_timeout_s,
            )
        latency = time.monotonic() - start
        if resp.status_code != 200:
            return CanaryResult(False, started_at, latency, f"HTTP {resp.status_code}")
        if not resp.json().get("choices"):
            return CanaryResult(False, started_at, latency, "no choices in the answer")
        return CanaryResult(True, started_at, latency)
    except Exception as e:  # noqa: BLE001 - every failure is an observation, not a crash
        return CanaryResult(False, started_at, time.monotonic() - start, _error_text(e))
