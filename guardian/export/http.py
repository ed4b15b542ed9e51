"""GET /metrics and /healthz on guardian's own thread, so that no client can delay a tick.

The tick renders the metrics once and publishes the bytes here; a scrape only copies them out.
The server runs its own event loop on its own thread: a slow client, a client that never sends
its request, or many clients at once cost at most MAX_CONNECTIONS sockets, each for at most
FIRST_BYTE_TIMEOUT_S (nothing sent) or HEAD_TIMEOUT_S (a request head never finished), and never
a tick or a watchdog ping. One address holds at most MAX_PER_PEER of those sockets, so a single
host cannot take every slot from Prometheus. A connection past either cap is answered at once
with 503 (never closed without a word), and the refusals are said, at most once a minute, with
the addresses they came from. /healthz is answered from this thread too, so it can say 503 when
the main loop is stuck (no tick completed for `stale_after_s`).
"""

from __future__ import annotations

import asyncio
import math
import socket
import threading
import time
from collections.abc import Callable
from enum import Enum

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_CONNECTIONS = 16
# Prometheus scrapes with one connection at a time per target, and an HA pair scrapes from two
# hosts: an address that wants more than this at once is not a scraper, and it takes four
# addresses to fill all MAX_CONNECTIONS.
MAX_PER_PEER = 4
MAX_REQUEST_BYTES = 8192
# A scraper writes its request as soon as it has connected; 2 s still covers one lost segment
# (Linux's first retransmission is after 1 s). A connection that says nothing for that long is
# idle, and gives its slot back.
FIRST_BYTE_TIMEOUT_S = 2.0
# From the accept to the end of the head (a few hundred bytes, one segment, so 5 s still covers
# a few retransmissions): a client that drips its request is cut off at half of Prometheus'
# default scrape_timeout (10 s), so it cannot hold a slot through a whole scrape.
HEAD_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 10.0
# By then every slot held by a client that had not finished its request has been given back.
RETRY_AFTER_S = math.ceil(HEAD_TIMEOUT_S)
# A refused client gets this long to send its request (read and dropped) and to read the 503:
# closing with its request unread would send a RST, which can discard the 503 before the client
# reads it. At most MAX_LINGERING refused sockets wait so; past that they are closed at once.
REFUSED_LINGER_S = 1.0
MAX_LINGERING = 64
REFUSED_LOG_INTERVAL_S = 60.0
# Connections the kernel completes while the loop is busy: a burst of connects past this is
# dropped by the kernel, and each one dropped (a scrape too) retries only a second later.
LISTEN_BACKLOG = 1024
MAX_PEERS_COUNTED = 64  # distinct addresses counted per log line; the rest are summed as "others"
MAX_PEERS_NAMED = 8


class Refusal(Enum):
    FULL = "full"
    PEER_CAP = "peer_cap"


class CutOff(Enum):
    """Which bound closed a connection that never finished its request."""

    FIRST_BYTE = "first_byte"  # nothing sent within FIRST_BYTE_TIMEOUT_S
    HEAD = "head"  # a head begun, not finished within HEAD_TIMEOUT_S of the connect


def _peer(writer: asyncio.StreamWriter) -> str:
    name = writer.get_extra_info("peername")
    if isinstance(name, tuple) and name:
        return str(name[0])
    return "unknown"


def _close(writer: asyncio.StreamWriter) -> None:
    # close() waits, without end, to flush what is still buffered to a client that may never
    # read it: that would hold the socket (and the body) after its slot is given back.
    if writer.transport.get_write_buffer_size():
        writer.transport.abort()
    else:
        writer.close()


class MetricsServer:
    def __init__(
        self,
        host: str,
        port: int,
        stale_after_s: float,
        on_refused: Callable[[str], None] | None = None,
        refused_log_interval_s: float = REFUSED_LOG_INTERVAL_S,
    ) -> None:
        """ON_REFUSED is given one line (for the journal, at warning) when connections were
        refused for the caps, at most once per REFUSED_LOG_INTERVAL_S; it runs on the server's
        thread."""
        self.host, self.port = host, port
        self.stale_after_s = stale_after_s
        self.on_refused = on_refused
        self.refused_log_interval_s = refused_log_interval_s
        self._published: tuple[bytes, float | None] = (b"", None)  # replaced whole: no lock needed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        # Everything below is touched on the server's thread only.
        self._active = 0
        self._per_peer: dict[str, int] = {}
        self._lingering = 0
        self.refused_total = 0
        self.cut_off_total = {c: 0 for c in CutOff}
        self._refused_by_peer: dict[str, int] = {}
        self._refused_by_reason = {r: 0 for r in Refusal}
        self._refused_since_mono: float | None = None
        self._refused_said_mono: float | None = None
        self._say_later: asyncio.TimerHandle | None = None

    def publish(self, body: bytes, tick_done_mono: float) -> None:
        self._published = (body, tick_done_mono)

    def start(self) -> None:
        """Bind now (an error is the caller's to report), then serve on a daemon thread."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        loop = asyncio.new_event_loop()
        self._loop = loop
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)

            async def serve() -> None:
                self._server = await asyncio.start_server(
                    self._handle, sock=sock, limit=MAX_REQUEST_BYTES, backlog=LISTEN_BACKLOG
                )
                ready.set()

            loop.run_until_complete(serve())
            loop.run_forever()
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

        self._thread = threading.Thread(target=run, name="guardian-metrics", daemon=True)
        self._thread.start()
        ready.wait(5)

    def stop(self) -> None:
        loop, server = self._loop, self._server
        if loop is None:
            return

        async def close() -> None:
            if server is not None:
                server.close()
            loop.stop()

        try:
            asyncio.run_coroutine_threadsafe(close(), loop)
        except RuntimeError:
            pass
        if self._thread is not None:
            self._thread.join(5)
        self._loop = self._server = self._thread = None

    def _answer(self, method: str, path: str) -> tuple[int, str, bytes, tuple[str, ...]]:
        if method != "GET":
            return 405, "Method Not Allowed", b"only GET\n", ("Allow: GET",)
        if path == "/metrics":
            return 200, "OK", self._published[0], ()
        if path == "/healthz":
            done = self._published[1]
            if done is None:
                return 503, "Service Unavailable", b"starting: no tick has completed yet\n", ()
            age_s = time.monotonic() - done
            if age_s > self.stale_after_s:
                return 503, "Service Unavailable", f"stuck: the last tick completed {age_s:.0f} s ago\n".encode(), ()
            return 200, "OK", f"ok: the last tick completed {age_s:.1f} s ago\n".encode(), ()
        return 404, "Not Found", b"only /metrics and /healthz\n", ()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted_mono = asyncio.get_running_loop().time()
        peer = _peer(writer)
        held = self._per_peer.get(peer, 0)
        if held >= MAX_PER_PEER:
            await self._refuse(reader, writer, peer, Refusal.PEER_CAP)
            return
        if self._active >= MAX_CONNECTIONS:
            await self._refuse(reader, writer, peer, Refusal.FULL)
            return
        self._active += 1
        self._per_peer[peer] = held + 1
        try:
            await self._serve(reader, writer, accepted_mono)
        finally:
            self._active -= 1
            left = self._per_peer[peer] - 1
            if left:
                self._per_peer[peer] = left
            else:
                del self._per_peer[peer]
            _close(writer)

    async def _read_head(self, reader: asyncio.StreamReader, accepted_mono: float) -> bytes | None:
        """The request head, through its blank line; None for a client that sent nothing within
        FIRST_BYTE_TIMEOUT_S, no complete head within HEAD_TIMEOUT_S, a head over
        MAX_REQUEST_BYTES, or that went away."""
        buf = bytearray()
        try:
            async with asyncio.timeout(FIRST_BYTE_TIMEOUT_S) as budget:
                while True:
                    chunk = await reader.read(MAX_REQUEST_BYTES)
                    if not chunk:
                        return None
                    if not buf:
                        budget.reschedule(accepted_mono + HEAD_TIMEOUT_S)
                    start = max(0, len(buf) - 3)  # the blank line may straddle two reads
                    buf += chunk
                    end = buf.find(b"\r\n\r\n", start)
                    if end >= 0:
                        return bytes(buf[: end + 4]) if end + 4 <= MAX_REQUEST_BYTES else None
                    if len(buf) >= MAX_REQUEST_BYTES:
                        return None
        except TimeoutError:
            self.cut_off_total[CutOff.HEAD if buf else CutOff.FIRST_BYTE] += 1
            return None
        except ConnectionError:
            return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, accepted_mono: float) -> None:
        head = await self._read_head(reader, accepted_mono)
        if head is None:
            return
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        extra: tuple[str, ...]
        path = ""
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            status, reason, body, extra = 400, "Bad Request", b"bad request\n", ()
        else:
            method = parts[0].decode("ascii", "replace")
            path = parts[1].decode("ascii", "replace").split("?", 1)[0]
            status, reason, body, extra = self._answer(method, path)
        ctype = CONTENT_TYPE if status == 200 and path == "/metrics" else "text/plain"
        writer.write(_response(status, reason, ctype, body, extra))
        try:
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
        except (TimeoutError, ConnectionError):
            return

    async def _refuse(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str, why: Refusal
    ) -> None:
        self._count_refusal(peer, why)
        if why is Refusal.PEER_CAP:
            body = f"busy: this address already holds {MAX_PER_PEER} connections\n".encode()
        else:
            body = f"busy: all {MAX_CONNECTIONS} connections are in use\n".encode()
        extra = (f"Retry-After: {RETRY_AFTER_S}",)
        try:
            writer.write(_response(503, "Service Unavailable", "text/plain", body, extra))
            if self._lingering >= MAX_LINGERING:
                return
            self._lingering += 1
            try:
                writer.write_eof()
                async with asyncio.timeout(REFUSED_LINGER_S):
                    while await reader.read(MAX_REQUEST_BYTES):
                        pass
            finally:
                self._lingering -= 1
        except (TimeoutError, OSError):
            pass  # gone, or still silent after REFUSED_LINGER_S: it had its answer
        finally:
            _close(writer)

    # --- refusals are said: at most one line per refused_log_interval_s ------------------------
    def _count_refusal(self, peer: str, why: Refusal) -> None:
        now_mono = asyncio.get_running_loop().time()
        self.refused_total += 1
        self._refused_by_reason[why] += 1
        if self._refused_since_mono is None:
            self._refused_since_mono = now_mono
        if peer in self._refused_by_peer or len(self._refused_by_peer) < MAX_PEERS_COUNTED:
            self._refused_by_peer[peer] = self._refused_by_peer.get(peer, 0) + 1
        else:
            self._refused_by_peer["others"] = self._refused_by_peer.get("others", 0) + 1
        if self._say_later is not None:
            return
        said = self._refused_said_mono
        if said is None or now_mono - said >= self.refused_log_interval_s:
            self._say_refusals()
        else:
            # Said once the interval is up, so the last refusals of a burst are not left unsaid.
            self._say_later = asyncio.get_running_loop().call_at(said + self.refused_log_interval_s, self._say_refusals)

    def _say_refusals(self) -> None:
        loop = asyncio.get_running_loop()
        self._say_later = None
        full, capped = self._refused_by_reason[Refusal.FULL], self._refused_by_reason[Refusal.PEER_CAP]
        since_mono = self._refused_since_mono
        if since_mono is None:
            return
        peers = sorted(self._refused_by_peer.items(), key=lambda kv: (-kv[1], kv[0]))
        named = ", ".join(f"{p} ({n})" for p, n in peers[:MAX_PEERS_NAMED])
        if len(peers) > MAX_PEERS_NAMED:
            named += f" and {len(peers) - MAX_PEERS_NAMED} more"
        span_s = loop.time() - since_mono
        over = f" over {span_s:.0f} s" if span_s >= 1 else ""
        message = (
            f"metrics endpoint: answered 503 to {full + capped} connection(s){over}, from {named}: "
            f"{full} while all {MAX_CONNECTIONS} connections were held, {capped} from an address already "
            f"holding {MAX_PER_PEER}; none was served, so a scrape among them got no metrics"
        )
        self._refused_by_peer.clear()
        self._refused_by_reason = {r: 0 for r in Refusal}
        self._refused_since_mono = None
        self._refused_said_mono = loop.time()
        if self.on_refused is not None:
            try:
                self.on_refused(message)
            except Exception:  # noqa: BLE001 - a failing logger must not take the endpoint down
                pass


def _response(status: int, reason: str, ctype: str, body: bytes, extra: tuple[str, ...]) -> bytes:
    lines = [f"HTTP/1.1 {status} {reason}", f"Content-Type: {ctype}", f"Content-Length: {len(body)}"]
    lines += [*extra, "Connection: close", "", ""]
    return "\r\n".join(lines).encode() + body
