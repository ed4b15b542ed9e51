"""A small etcd v3 client over etcd's JSON gateway (grpc-gateway), with httpx.

Why this and not a library (README, A fleet): python-etcd3 is unmaintained (etcd-io/etcd #13285);
etcd3gw talks to the same gateway but is synchronous and pulls in futurist, pbr and requests;
the asyncio clients have one maintainer each. guardian needs six calls (range, put, delete, txn,
lease grant/keepalive/revoke), all plain JSON POSTs, and already ships httpx (HTTP/1.1, TLS with
client certificates, timeouts). etcd 3.4 and later serve the gateway at /v3/ on the client port.

Keys and values are bytes on the wire (base64 in JSON); here they are str (UTF-8). Every call is
bounded by the timeout and tried on each endpoint in turn, starting with the last one that
answered; an error from etcd itself (a failed compare is not one) is an EtcdError, and so is
every endpoint failing.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import httpx


class EtcdError(Exception):
    pass


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def _unb64(s: str | None) -> str:
    return base64.b64decode(s or "").decode(errors="replace")


def prefix_end(prefix: str) -> str:
    """The range_end that selects every key starting with PREFIX (its last byte plus one)."""
    b = bytearray(prefix.encode())
    while b and b[-1] == 0xFF:
        b.pop()
    if not b:
        return "\0"
    b[-1] += 1
    return b.decode(errors="surrogateescape")


@dataclass(frozen=True)
class KV:
    key: str
    value: str
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class Compare:
    """One txn comparison: KEY's TARGET ("CREATE", "MOD", "VERSION", "VALUE") EQUAL/... VALUE."""

    key: str
    target: str
    result: str
    value: int | str

    def body(self) -> dict[str, Any]:
        field = {"CREATE": "create_revision", "MOD": "mod_revision", "VERSION": "version", "VALUE": "value"}[
            self.target
        ]
        v = _b64(self.value) if self.target == "VALUE" and isinstance(self.value, str) else str(self.value)
        return {"key": _b64(self.key), "target": self.target, "result": self.result, field: v}


def put_op(key: str, value: str, lease: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        body["lease"] = str(lease)
    return {"request_put": body}


def delete_op(key: str) -> dict[str, Any]:
    return {"request_delete_range": {"key": _b64(key)}}


class Etcd:
    def __init__(
        self,
        endpoints: list[str],
        timeout_s: float = 2.0,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoints")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.current = 0
        self.timeout_s = timeout_s
        self.username, self.password = username, password
        self.token: str | None = None
        verify: Any = ca_file if ca_file else True
        cert = (cert_file, key_file) if cert_file and key_file else None
        self.client = httpx.AsyncClient(timeout=timeout_s, verify=verify, cert=cert, trust_env=False)

    async def aclose(self) -> None:
        await self.client.aclose()

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        errors = []
        n = len(self.endpoints)
        for i in range(n):
            k = (self.current + i) % n
            base = self.endpoints[k]
            try:
                data = await self._post_one(base, path, body)
            except (httpx.HTTPError, ValueError, OSError) as e:
                errors.append(f"{base}: {type(e).__name__}: {e}"[:300])
                continue
            self.current = k
            return data
        raise EtcdError("no etcd endpoint answered: " + "; ".join(errors))

    async def _post_one(self, base: str, path: str, body: dict[str, Any], retried: bool = False) -> dict[str, Any]:
        headers = {"Authorization": self.token} if self.token else {}
        r = await self.client.post(base + path, json=body, headers=headers)
        if r.status_code == 401 and self.username and not retried:
            await self._authenticate(base)
            return await self._post_one(base, path, body, retried=True)
        if r.status_code != 200:
            detail = r.text[:300]
            if r.status_code >= 500:
                raise ValueError(f"HTTP {r.status_code}: {detail}")  # this member cannot answer: try the next
            raise EtcdError(f"etcd refused {path}: HTTP {r.status_code}: {detail}")
        data = r.json()
        if not isinstance(data, dict):
            raise ValueError(f"not a JSON object from {path}")
        if "error" in data:  # a streaming endpoint's error (keepalive)
            raise ValueError(str(data["error"])[:300])
        return data

    async def _authenticate(self, base: str) -> None:
        r = await self.client.post(
            base + "/v3/auth/authenticate", json={"name": self.username, "password": self.password or ""}
        )
        if r.status_code != 200:
            raise EtcdError(f"etcd refused the user {self.username!r}: HTTP {r.status_code}: {r.text[:200]}")
        self.token = r.json().get("token")

    # --- the calls guardian makes --------------------------------------------------------------
    async def range_prefix(self, prefix: str) -> tuple[int, list[KV]]:
        """Every key under PREFIX, and the store's revision they were read at."""
        data = await self._post("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        kvs = [
            KV(
                _unb64(kv.get("key")),
                _unb64(kv.get("value")),
                int(kv.get("create_revision", 0)),
                int(kv.get("mod_revision", 0)),
                int(kv.get("lease", 0)),
            )
            for kv in data.get("kvs", [])
        ]
        return int(data.get("header", {}).get("revision", 0)), kvs

    async def put(self, key: str, value: str, lease: int = 0) -> None:
        await self._post("/v3/kv/put", put_op(key, value, lease)["request_put"])

    async def delete(self, key: str) -> None:
        await self._post("/v3/kv/deleterange", {"key": _b64(key)})

    async def txn(
        self, compare: list[Compare], success: list[dict[str, Any]], failure: list[dict[str, Any]] | None = None
    ) -> bool:
        data = await self._post(
            "/v3/kv/txn", {"compare": [c.body() for c in compare], "success": success, "failure": failure or []}
        )
        return bool(data.get("succeeded", False))

    async def grant(self, ttl_s: int) -> int:
        data = await self._post("/v3/lease/grant", {"TTL": str(ttl_s)})
        return int(data["ID"])

    async def keepalive(self, lease: int) -> int:
        """Renew LEASE; its remaining TTL in seconds, 0 when it has expired (or was revoked)."""
        data = await self._post("/v3/lease/keepalive", {"ID": str(lease)})
        return int(data.get("result", {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        await self._post("/v3/lease/revoke", {"ID": str(lease)})

    async def status(self, endpoint: str) -> dict[str, Any]:
        """One member's status (its leader's id): for tests and `guardian status --fleet`."""
        return await self._post_one(endpoint.rstrip("/"), "/v3/maintenance/status", {})
