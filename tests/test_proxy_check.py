"""`guardian check` warns when a replica's URL is a proxy's: its /metrics came from more than one
process. In the field a monitor read /metrics through the proxy for days without noticing."""

from __future__ import annotations

import itertools
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from guardian.cli import main
from guardian.core.hazards import proxy_suspect
from harness import Running


@pytest.mark.parametrize("starts, suspect", [
    ([1.0, 1.0, 1.0, 1.0], False),
    ([1.0, None, 1.0, None], False),  # a read that failed proves nothing
    ([None, None, None, None], False),
    ([1.0, 2.0, 1.0, 2.0], True),
    ([1.0, 1.0, 1.0, 3.0], True),
])
def test_one_process_or_several(starts, suspect):
    w = proxy_suspect("a", "http://127.0.0.1:8080", starts)
    assert (w is not None) == suspect
    if w:
        assert "replica a" in w and "proxy" in w and "own address" in w


class RoundRobin:
    """A stand-in for the field's nginx upstream: each request goes to the next replica."""

    def __init__(self, upstreams: list[str]) -> None:
        nxt = itertools.cycle(upstreams).__next__
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                with lock:
                    base = nxt()
                r = httpx.get(base + self.path, timeout=5)
                body = r.content
                self.send_response(r.status_code)
                self.send_header("Content-Type", r.headers.get("content-type", "text/plain"))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _check(tmp_path, url: str, capsys) -> tuple[int, str]:
    path = tmp_path / "guardian.toml"
    path.write_text(f'[[replicas]]\nname = "a"\nunit = "vllm-a.service"\nurl = "{url}"\nmodel = "m"\n')
    rc = main(["--config", str(path), "check", "--no-systemd"])
    return rc, capsys.readouterr().out


def test_check_warns_on_a_proxy_url_and_not_on_a_replica(tmp_path, capsys):
    a, b = Running().wait_up(), Running().wait_up()
    proxy = RoundRobin([a.url, b.url])
    try:
        rc, out = _check(tmp_path, a.url, capsys)
        assert rc == 0 and "warning" not in out, out
        rc, out = _check(tmp_path, proxy.url, capsys)
        assert rc == 1, out
        assert f"warning: replica a: {proxy.url} answered from 2 different processes" in out, out
    finally:
        proxy.close()
        a.stop()
        b.stop()
