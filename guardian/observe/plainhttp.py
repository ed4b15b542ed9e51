"""One bounded HTTP/1.1 request over a plain TCP connection, with h11: the replicas' probes and
canaries.

Why not httpx here: guardian sends three GETs to every replica every tick, and httpx's client
layers cost about 1.3 ms of CPU per request on this kind of box, against 0.3-0.45 ms for the same
request with h11 (the HTTP/1.1 state machine httpx itself is built on) on an asyncio protocol:
at two replicas that was a third of guardian's CPU at idle. A canary through httpx cost 4-5 ms
(httpcore also looks for sniffio, which is not installed, with a failed import at every request):
a tenth of it at the default cadence. HTTPS replicas keep httpx (probes.py).

Every byte is bounded before anything is decoded: the head by MAX_HEAD_BYTES, the body by the
caller's max_bytes (a declared Content-Length over it is refused unread), and nothing compressed
is accepted (none is asked for). The caller bounds the time (asyncio.timeout).
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit, urlunsplit

import h11

MAX_HEAD_BYTES = 64 * 2**10


class TooLarge(ValueError):
    """The answer was refused for its size or encoding; STATUS is its HTTP status (it answered)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def pinned(url: str, address: str | None) -> tuple[str, dict[str, str], dict[str, str]]:
    """URL with its host replaced by ADDRESS (observe/addresses.py: where guardian connects), the
    Host header that keeps the name the server was asked for, and httpx's extensions (the TLS
    server name stays the URL's host); URL as it is where ADDRESS is None."""
    parts = urlsplit(url)
    if address is None or parts.hostname is None:
        return url, {}, {}
    host = f"[{address}]" if ":" in address else address
    netloc = host + (f":{parts.port}" if parts.port is not None else "")
    extensions = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
    return urlunsplit(parts._replace(netloc=netloc)), {"Host": parts.netloc}, extensions


async def get(url: str, max_bytes: int, address: str | None = None) -> tuple[int, bytes]:
    """GET URL (http://), connecting to ADDRESS where given (else to the URL's host): its status
    and body. Raises OSError (cannot connect), TooLarge, or h11.ProtocolError (not HTTP/1.x)."""
    return await request("GET", url, max_bytes, address)


async def request(
    method: str, url: str, max_bytes: int, address: str | None = None, json_body: bytes | None = None
) -> tuple[int, bytes]:
    """METHOD URL (http://) as get does, with JSON_BODY (encoded JSON) as its body where given."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or 80
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
    headers = [("Host", parts.netloc), ("Accept-Encoding", "identity"), ("Connection", "close")]
    if json_body is not None:
        headers += [("Content-Type", "application/json"), ("Content-Length", str(len(json_body)))]
    sent = conn.send(h11.Request(method=method, target=target, headers=headers)) or b""
    if json_body:
        sent += conn.send(h11.Data(data=json_body)) or b""
    sent += conn.send(h11.EndOfMessage()) or b""
    loop = asyncio.get_running_loop()
    transport, answer = await loop.create_connection(lambda: _Answer(conn, sent, max_bytes), address or host, port)
    try:
        return await answer.done
    finally:
        transport.close()


class _Answer(asyncio.Protocol):
    """One request sent and its answer read: each arrival fed to h11 as it comes (a protocol, not
    asyncio's streams: a reader, a writer and a coroutine woken per read cost a fifth of a probe's
    CPU). DONE: (status, body), or what the answer was (TooLarge, h11.ProtocolError, OSError)."""

    def __init__(self, conn: h11.Connection, request: bytes, max_bytes: int) -> None:
        self.conn, self.request, self.max_bytes = conn, request, max_bytes
        self.done: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        self.status: int | None = None
        self.body = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self._feed(data)

    def eof_received(self) -> bool:
        self._feed(b"")
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(exc or ConnectionResetError("closed before a complete answer"))

    def _feed(self, data: bytes) -> None:
        """DATA (b"": the server closed) to h11, and each event it makes of it."""
        if self.done.done():
            return
        try:
            if not data and self.status is None:
                raise ConnectionResetError("closed before a complete answer")
            self.conn.receive_data(data)
            while (event := self.conn.next_event()) is not h11.NEED_DATA:
                if isinstance(event, h11.Response):
                    self.status = event.status_code
                    _check_head(event, self.status, self.max_bytes)
                elif isinstance(event, h11.Data):
                    self.body += event.data
                    if len(self.body) > self.max_bytes and self.status is not None:
                        raise TooLarge(f"answer larger than {self.max_bytes} bytes", self.status)
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed) and self.status is not None:
                    self.done.set_result((self.status, bytes(self.body)))
                    return
        except Exception as e:  # noqa: BLE001 - the caller's to say (probes._error_text)
            self.done.set_exception(e)


def _check_head(response: h11.Response, status: int, max_bytes: int) -> None:
    headers = dict(response.headers)
    check_head(
        status,
        headers.get(b"content-encoding", b"").decode("ascii", "replace"),
        headers.get(b"content-length", b"").decode("ascii", "replace"),
        max_bytes,
    )


def check_head(status: int, content_encoding: str, content_length: str, max_bytes: int) -> None:
    """Raise TooLarge for an answer compressed (none was asked for: a 1 MB gzip can inflate to
    1 GiB) or declared larger than MAX_BYTES: refused before its body is read."""
    encoding = content_encoding.strip().lower()
    if encoding not in ("", "identity"):
        raise TooLarge(f"compressed answer (Content-Encoding: {encoding[:40]}) though none was asked for", status)
    if content_length.isdigit() and int(content_length) > max_bytes:
        raise TooLarge(f"answer of {int(content_length)} bytes, more than {max_bytes}", status)
