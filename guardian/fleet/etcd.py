"""A small etcd v3 client over etcd's JSON gateway (grpc-gateway), with httpx.

Why this and not a library (README, A fleet): python-etcd3 is unmaintained (etcd-io/etcd #13285);
etcd3gw talks to the same gateway but is synchronous and pulls in futurist, pbr and requests;
the asyncio clients have one maintainer each. guardian needs six calls (range, put, delete, txn,
lease grant/keepalive/revoke), all plain JSON POSTs, and already ships httpx (HTTP/1.1, TLS with
client certificates, timeouts). etcd 3.4 and later serve the gateway at /v3/ on the client port.

Keys and values are bytes on the wire (base64 in JSON); here they are str (UTF-8). Every call is
tried on each endpoint in turn, starting with the last one that answered, and each try is bounded
as a whole by the timeout (not per read: an endpoint that drips one byte at a time is given up on).
An answer is bounded in bytes and never decompressed, then checked field by field into typed
values: garbage from one endpoint is that endpoint failing, as a refused connection is. An error
from etcd itself (a failed compare is not one) is an EtcdError, and so is every endpoint failing:
nothing else leaves this module. Callers bound a whole operation (several calls) themselves.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import re
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

# An answer is read raw, at most this many bytes, and never inflated (a 700 KB gzip from a hostile
# endpoint inflated to 1.4 GiB). The largest answer guardian asks for is the whole prefix: a fleet
# of 64 boxes x 8 replicas is 512 values of about 200 bytes, some 250 KB as base64 in JSON; 4 MiB
# leaves sixteen times that. A prefix grown past it (values someone else wrote) reads as etcd being
# unreadable: planned restarts wait (F3), nothing else does.
MAX_ANSWER_BYTES = 4 * 2**20
MAX_ERROR_BYTES = 4 * 2**10  # of a refusal's body, for its text
MAX_DETAIL_CHARS = 300
MAX_TOKEN_CHARS = 4096
INLINE_PARSE_BYTES = 64 * 2**10  # larger answers are parsed off the event loop: the tick's pings go on
MAX_INT64 = 2**63 - 1
MAX_LEASE_TTL_S = 9_000_000_000  # etcd's own MaxLeaseTTL
HEADERS = {"Accept-Encoding": "identity"}
_DECIMAL = re.compile(r"-?[0-9]{1,19}")
_TOKEN = re.compile(rf"[!-~]{{1,{MAX_TOKEN_CHARS}}}")

T = TypeVar("T")


class EtcdError(Exception):
    pass


class BadAnswer(ValueError):
    """An answer that is not etcd's (too large, compressed, not JSON, a field of the wrong shape)."""


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def json_kind(value: object) -> str:
    """What VALUE is, in JSON's words."""
    kinds = {dict: "a JSON object", list: "a JSON array", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number")


def _shown(value: object) -> str:
    """VALUE in a refusal's text: short, and never the repr of a structure (it may be deep)."""
    if isinstance(value, str):
        return repr(value[:40]) + ("..." if len(value) > 40 else "")
    if value is None or isinstance(value, bool | int | float):
        return repr(value)[:40]
    return json_kind(value)


def _obj(value: object, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadAnswer(f"{what} is not a JSON object ({_shown(value)})")
    return value


def _int(value: object, what: str, lo: int = 0, hi: int = MAX_INT64) -> int:
    """An int64 as the gateway writes it (a decimal string; an int is taken too), within [LO, HI]."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str) and _DECIMAL.fullmatch(value):
        n = int(value)
    else:
        raise BadAnswer(f"{what} is not an integer ({_shown(value)})")
    if not lo <= n <= hi:
        raise BadAnswer(f"{what} {n} is out of range [{lo}, {hi}]")
    return n


def _unb64(value: object, what: str) -> str:
    if value is None:  # proto3 leaves out empty fields
        return ""
    if not isinstance(value, str):
        raise BadAnswer(f"{what} is not base64 text ({_shown(value)})")
    try:
        return base64.b64decode(value, validate=True).decode(errors="replace")
    except binascii.Error as e:
        raise BadAnswer(f"{what} is not valid base64 ({_shown(value)})") from e


def _error_text(value: object) -> str:
    if isinstance(value, dict) and isinstance(value.get("message"), str):
        value = value["message"]
    return value[:MAX_DETAIL_CHARS] if isinstance(value, str) else _shown(value)


def _etcd_error(raw: bytes) -> bool:
    """RAW is the gateway's own error shape ({"code": N, "message": "..."}, or "error"): etcd refused."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return False
    return isinstance(data, dict) and ("code" in data or "error" in data) and ("message" in data or "error" in data)


def _flat(raw: bytes) -> str:
    """A refusal's body as one short line of text."""
    return " ".join(raw.decode(errors="replace").split())[:MAX_DETAIL_CHARS]


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


# --- what each answer must be -----------------------------------------------------------------
def parse_range(data: dict[str, Any]) -> tuple[int, list[KV]]:
    revision = _int(_obj(data.get("header", {}), "header").get("revision", 0), "header.revision")
    raw = data.get("kvs", [])
    if not isinstance(raw, list):
        raise BadAnswer(f"kvs is not a list ({_shown(raw)})")
    kvs = []
    for i, item in enumerate(raw):
        kv = _obj(item, f"kvs[{i}]")
        if "key" not in kv:
            raise BadAnswer(f"kvs[{i}] has no key")
        kvs.append(
            KV(
                _unb64(kv["key"], f"kvs[{i}].key"),
                _unb64(kv.get("value"), f"kvs[{i}].value"),
                _int(kv.get("create_revision", 0), f"kvs[{i}].create_revision"),
                _int(kv.get("mod_revision", 0), f"kvs[{i}].mod_revision"),
                _int(kv.get("lease", 0), f"kvs[{i}].lease"),
            )
        )
    return revision, kvs


def parse_txn(data: dict[str, Any]) -> bool:
    succeeded = data.get("succeeded", False)
    if not isinstance(succeeded, bool):
        raise BadAnswer(f"succeeded is not true or false ({_shown(succeeded)})")
    return succeeded


def parse_grant(data: dict[str, Any]) -> int:
    if "ID" not in data:
        raise BadAnswer("the lease grant has no ID")
    return _int(data["ID"], "ID", lo=1)


def parse_keepalive(data: dict[str, Any]) -> int:
    return _int(_obj(data.get("result", {}), "result").get("TTL", 0), "result.TTL", lo=-1, hi=MAX_LEASE_TTL_S)


def parse_token(data: dict[str, Any]) -> str:
    token = data.get("token")
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        raise BadAnswer(f"no usable token in the answer ({_shown(token)})")
    return token


def _ignore(data: dict[str, Any]) -> None:
    return None


def _as_is(data: dict[str, Any]) -> dict[str, Any]:
    return data


def _decode(raw: bytes, path: str, parse: Callable[[dict[str, Any]], T]) -> T:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: deep nesting, such as 100 KB of "["
        raise BadAnswer(f"the answer to {path} is not JSON ({type(e).__name__})") from e
    data = _obj(data, f"the answer to {path}")
    if "error" in data:  # a streaming endpoint's error (keepalive)
        raise BadAnswer(f"etcd error: {_error_text(data['error'])}")
    _obj(data.get("header", {}), "header")
    return parse(data)


@dataclass(frozen=True)
class Tls:
    """Client TLS for etcd: CA_FILE is the store that verifies the server (None: the default
    store); CERT_FILE and KEY_FILE, both or neither, the client's certificate."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None


def tls_context(tls: Tls) -> ssl.SSLContext:
    """The context that verifies etcd: TLS.ca_file, or else the system's CA store (OpenSSL's default
    paths, /etc/ssl/certs on Debian and Ubuntu), where the operator adds a private CA; never the
    certifi bundle that httpx would use by default. With the client's certificate if configured."""
    ctx = ssl.create_default_context(cafile=tls.ca_file or None)
    if tls.cert_file and tls.key_file:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    return ctx


class Etcd:
    def __init__(
        self,
        endpoints: list[str],
        timeout_s: float = 2.0,
        tls: Tls | None = None,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoints")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.current = 0
        self.timeout_s = timeout_s
        self.max_bytes = MAX_ANSWER_BYTES
        self.username, self.password = username, password
        self.token: str | None = None
        self.ssl_context = tls_context(tls or Tls())
        # trust_env=False: an HTTP(S)_PROXY in the environment must not route etcd's traffic.
        self.client = httpx.AsyncClient(
            timeout=timeout_s, verify=self.ssl_context, trust_env=False, follow_redirects=False
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    def _failure(self, e: Exception) -> str:
        if isinstance(e, TimeoutError | httpx.TimeoutException):
            return f"no answer within {self.timeout_s:g} s"
        if isinstance(e, BadAnswer):
            return str(e)
        return f"{type(e).__name__}: {e}"

    async def _post(self, path: str, body: dict[str, Any], parse: Callable[[dict[str, Any]], T]) -> T:
        errors = []
        n = len(self.endpoints)
        for i in range(n):
            k = (self.current + i) % n
            base = self.endpoints[k]
            try:
                async with asyncio.timeout(self.timeout_s):
                    result = await self._post_one(base, path, body, parse)
            except EtcdError:
                raise
            except Exception as e:  # noqa: BLE001 - whatever one endpoint does, the next is tried
                errors.append(f"{base}: {self._failure(e)}"[:MAX_DETAIL_CHARS])
                continue
            self.current = k
            return result
        raise EtcdError("no etcd endpoint answered: " + "; ".join(errors))

    async def _exchange(self, url: str, body: dict[str, Any]) -> tuple[int, bytes]:
        """POST BODY to URL: the status and the raw answer, bounded by self.max_bytes (a refusal's
        body is cut at MAX_ERROR_BYTES, as only its first words are shown)."""
        headers = HEADERS | ({"Authorization": self.token} if self.token else {})
        async with self.client.stream("POST", url, json=body, headers=headers) as resp:
            encoding = resp.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                raise BadAnswer(f"compressed answer (Content-Encoding: {encoding[:40]}) though none was asked for")
            ok = resp.status_code == 200
            declared = resp.headers.get("content-length", "")
            if ok and declared.isdigit() and int(declared) > self.max_bytes:
                raise BadAnswer(f"answer of {int(declared)} bytes, more than {self.max_bytes}")
            data = bytearray()
            async for chunk in resp.aiter_raw():
                data += chunk
                if not ok and len(data) >= MAX_ERROR_BYTES:
                    break
                if len(data) > self.max_bytes:
                    raise BadAnswer(f"answer larger than {self.max_bytes} bytes")
            return resp.status_code, bytes(data)

    async def _post_one(
        self, base: str, path: str, body: dict[str, Any], parse: Callable[[dict[str, Any]], T], retried: bool = False
    ) -> T:
        status, raw = await self._exchange(base + path, body)
        if status == 401 and self.username and not retried:
            await self._authenticate(base)
            return await self._post_one(base, path, body, parse, retried=True)
        if status != 200:
            if status >= 500 or not _etcd_error(raw):
                # this member cannot answer, or it is not etcd (a stale URL, a proxy's 404): the next
                raise BadAnswer(f"HTTP {status}: {_flat(raw)}")
            raise EtcdError(f"etcd refused {path}: HTTP {status}: {_flat(raw)}")
        if len(raw) > INLINE_PARSE_BYTES:
            return await asyncio.to_thread(_decode, raw, path, parse)
        return _decode(raw, path, parse)

    async def _authenticate(self, base: str) -> None:
        self.token = None
        status, raw = await self._exchange(
            base + "/v3/auth/authenticate", {"name": self.username, "password": self.password or ""}
        )
        if status != 200:
            raise EtcdError(f"etcd refused the user {self.username!r}: HTTP {status}: {_flat(raw)}")
        self.token = _decode(raw, "/v3/auth/authenticate", parse_token)

    # --- the calls guardian makes --------------------------------------------------------------
    async def range_prefix(self, prefix: str) -> tuple[int, list[KV]]:
        """Every key under PREFIX, and the store's revision they were read at."""
        return await self._post(
            "/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}, parse_range
        )

    async def put(self, key: str, value: str, lease: int = 0) -> None:
        await self._post("/v3/kv/put", put_op(key, value, lease)["request_put"], _ignore)

    async def delete(self, key: str) -> None:
        await self._post("/v3/kv/deleterange", {"key": _b64(key)}, _ignore)

    async def txn(
        self, compare: list[Compare], success: list[dict[str, Any]], failure: list[dict[str, Any]] | None = None
    ) -> bool:
        body = {"compare": [c.body() for c in compare], "success": success, "failure": failure or []}
        return await self._post("/v3/kv/txn", body, parse_txn)

    async def grant(self, ttl_s: int) -> int:
        return await self._post("/v3/lease/grant", {"TTL": str(ttl_s)}, parse_grant)

    async def keepalive(self, lease: int) -> int:
        """Renew LEASE; its remaining TTL in seconds, 0 when it has expired (or was revoked)."""
        return await self._post("/v3/lease/keepalive", {"ID": str(lease)}, parse_keepalive)

    async def revoke(self, lease: int) -> None:
        await self._post("/v3/lease/revoke", {"ID": str(lease)}, _ignore)

    async def status(self, endpoint: str) -> dict[str, Any]:
        """One member's status (its leader's id): for tests and `guardian status --fleet`. Bounded by
        the timeout; any failure is an EtcdError."""
        base = endpoint.rstrip("/")
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._post_one(base, "/v3/maintenance/status", {}, _as_is)
        except EtcdError:
            raise
        except Exception as e:  # said as the member's failure, whatever it is
            raise EtcdError(f"{base}: {self._failure(e)}"[:MAX_DETAIL_CHARS]) from e
