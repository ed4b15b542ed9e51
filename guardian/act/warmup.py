"""A replica's warm-up (core/proxy/drain.py D13): its warm-up requests sent one after another straight to
its own URL, one token each, within the action's bound in all; how it ended comes back as the
observation's WarmupResult. A request past the bound is not sent; one that fails is counted and
the next is sent (a warm-up is best effort: the replica is marked up either way). Whatever this
raises all the same, the executor turns into a failed WarmupResult (D14 at warning), never a task
that dies with no result."""

from __future__ import annotations

import asyncio
import time

import httpx

from ..config import ReplicaConfig
from ..core.observations import WarmupResult
from ..observe import warmup
from ..observe.plainhttp import pinned


async def warm_up(
    client: httpx.AsyncClient, r: ReplicaConfig, started_at: float, timeout_s: float, address: str | None = None
) -> WarmupResult:
    """R's warm-up, each request sent to ADDRESS (its pin, observe/addresses.py; None: its URL's host)."""
    began = time.monotonic()
    assert r.warmup_file is not None, "only a replica with a warm-up file is warmed"
    try:
        requests = await asyncio.to_thread(warmup.load, r.warmup_file)
    except warmup.WarmupFileError as e:
        return WarmupResult(started_at, 0, 0, time.monotonic() - began, str(e))
    served, failed, error = 0, 0, None
    for at, req in enumerate(requests):
        left_s = timeout_s - (time.monotonic() - began)
        if left_s <= 0:
            failed += len(requests) - at
            late = f"its bound of {timeout_s:g} s passed with {len(requests) - at} of {len(requests)} not sent"
            error = f"{late}; {error}" if error else late
            break
        body = {**req.body, "model": r.model, "max_tokens": 1, "stream": False}
        try:
            async with asyncio.timeout(left_s):  # the whole request, not each of its reads
                url, host, extensions = pinned(r.url + req.path, address)
                resp = await client.post(url, json=body, timeout=left_s, headers=host, extensions=extensions)
        except TimeoutError:
            failed += 1
            error = error or f"request {at + 1}: no answer within the {timeout_s:g} s bound"
            continue
        except Exception as e:  # noqa: BLE001 - a warm-up is best effort: any failure is counted, the rest sent
            failed += 1
            error = error or f"request {at + 1}: {type(e).__name__}: {e}"
            continue
        if resp.status_code == 200:
            served += 1
        else:
            failed += 1
            error = error or f"request {at + 1}: HTTP {resp.status_code}"
    return WarmupResult(started_at, served, failed, time.monotonic() - began, error)
