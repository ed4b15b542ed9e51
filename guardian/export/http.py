"""GET /metrics and /healthz on guardian's own thread, so that no client can delay a tick.

The tick renders the metrics once and publishes the bytes here; a scrape only copies them out.
The server runs its own event loop on its own thread: a slow client, a client that never sends
its request, or many clients at once cost at most MAX_CONNECTIONS sockets for READ_TIMEOUT_S
each, and never a tick or a watchdog ping. /healthz is answered from this thread too, so it can
say 503 when the main loop is stuck (no tick completed for `stale_after_s`).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_CONNECTIONS = 16
MAX_REQUEST_BYTES = 8192
READ_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 10.0


class MetricsServer:
    def __init__(self, host: str, port: int, stale_after_s: float) -> None:
        self.host, self.port = host, port
        self.stale_after_s = stale_after_s
        self._published: tuple[bytes, float | None] = (b"", None)  # replaced whole: no lock needed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._active = 0

    def publish(self, body: bytes, tick_done_mono: float) -> None:
        self._published = (body, tick_done_mono)

    def start(self) -> None:
        """Bind now (an error is the caller's to report), then serve on a daemon thread."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(64)
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
                self._server = await asyncio.start_server(self._handle, sock=sock, limit=MAX_REQUEST_BYTES)
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
        self._active += 1
        try:
            if self._active > MAX_CONNECTIONS:
                return
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
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
            lines = [f"HTTP/1.1 {status} {reason}", f"Content-Type: {ctype}", f"Content-Length: {len(body)}"]
            lines += [*extra, "Connection: close", "", ""]
            writer.write("\r\n".join(lines).encode() + body)
            try:
                await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
            except (TimeoutError, ConnectionError):
                return
        finally:
            self._active -= 1
            writer.close()
