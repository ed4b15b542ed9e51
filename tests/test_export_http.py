"""The /metrics endpoint under connection floods (issue 21): one address cannot take every
slot, a full endpoint answers 503 at once instead of closing in silence, idle and dripping
clients are cut off within the stated bounds, and the refusals are said, at most once per
interval, naming the addresses. Two "peers" are two loopback addresses (127.0.0.2, ...)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from systemd_box import wait_for

from guardian.export.http import (
    FIRST_BYTE_TIMEOUT_S,
    HEAD_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_PER_PEER,
    CutOff,
    MetricsServer,
)

BODY = b"guardian_x 1\n"
GET = b"GET /metrics HTTP/1.1\r\nHost: guardian\r\n\r\n"
PARTIAL = b"GET /metrics HTTP/1.1\r\n"  # a head begun, never ended: held until HEAD_TIMEOUT_S


class Lines:
    """on_refused: what the server said, with when (monotonic)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.said: list[tuple[float, str]] = []

    def __call__(self, message: str) -> None:
        with self.lock:
            self.said.append((time.monotonic(), message))

    def messages(self) -> list[str]:
        with self.lock:
            return [m for _, m in self.said]

    def times(self) -> list[float]:
        with self.lock:
            return [t for t, _ in self.said]


@pytest.fixture
def lines() -> Lines:
    return Lines()


def make_server(lines: Lines, refused_log_interval_s: float = 60.0) -> MetricsServer:
    s = MetricsServer("127.0.0.1", 0, stale_after_s=30, on_refused=lines, refused_log_interval_s=refused_log_interval_s)
    s.start()
    s.publish(BODY, time.monotonic())
    return s


@pytest.fixture
def server(lines):
    s = make_server(lines)
    yield s
    s.stop()


def connect(port: int, source: str = "127.0.0.1", timeout_s: float = 10.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout_s, source_address=(source, 0))


def read_to_end(s: socket.socket) -> bytes:
    """Everything until the server closes (a reset counts as closed)."""
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def exchange(port: int, source: str, request: bytes = GET) -> tuple[int, dict[str, str], bytes, float]:
    """Status, headers (lower-cased names), body, and the seconds from connect to the end."""
    started = time.monotonic()
    with connect(port, source) as s:
        s.sendall(request)
        data = read_to_end(s)
    elapsed_s = time.monotonic() - started
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    assert status_line.startswith("HTTP/1.1 "), data[:200]
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return int(status_line.split(" ")[1]), headers, body, elapsed_s


def hold(port: int, source: str, count: int) -> list[socket.socket]:
    """COUNT connections from SOURCE that began a request and never end it."""
    held = []
    for _ in range(count):
        s = connect(port, source)
        s.sendall(PARTIAL)
        held.append(s)
    return held


def test_one_address_with_idle_sockets_leaves_room_for_a_scrape(server):
    """The review's attack: more idle sockets than MAX_CONNECTIONS from one host. That host
    gets MAX_PER_PEER slots, the rest of its sockets a 503, and Prometheus is still served."""
    idle = [connect(server.port) for _ in range(MAX_CONNECTIONS + 8)]
    try:
        wait_for(
            lambda: server.refused_total == len(idle) - MAX_PER_PEER,
            5,
            "the idle sockets past the per-address cap to be refused",
            interval_s=0.01,
        )
        assert server._active <= MAX_PER_PEER
        status, _, body, elapsed_s = exchange(server.port, "127.0.0.2")
        assert (status, body) == (200, BODY)
        print(f"the scrape beside {len(idle)} idle sockets took {elapsed_s:.2f} s")
        # every idle socket past the cap was told, not dropped; the others are closed silently
        answers = [read_to_end(s) for s in idle]
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")]
        assert len(refused) == len(idle) - MAX_PER_PEER
        assert answers.count(b"") == MAX_PER_PEER
    finally:
        for s in idle:
            s.close()


def test_a_full_endpoint_answers_503_at_once(server, lines):
    held = [
        s for i in range(MAX_CONNECTIONS // MAX_PER_PEER) for s in hold(server.port, f"127.0.0.{2 + i}", MAX_PER_PEER)
    ]
    try:
        wait_for(lambda: server._active == MAX_CONNECTIONS, 30, "every slot held", interval_s=0.01)
        for source in ("127.0.0.100", "127.0.0.2"):  # a newcomer (full), a holder (its cap)
            status, headers, body, elapsed_s = exchange(server.port, source)
            assert status == 503 and b"busy" in body
            assert headers["connection"] == "close" and int(headers["retry-after"]) >= 1
            print(f"the 503 from {source} took {elapsed_s:.2f} s")
        assert server.refused_total == 2
        assert server._active == MAX_CONNECTIONS
    finally:
        for s in held:
            s.close()
    wait_for(lambda: server._active == 0, 30, "the slots given back", interval_s=0.01)
    assert exchange(server.port, "127.0.0.100")[0] == 200


def test_a_client_that_sends_nothing_is_cut_off_at_the_first_byte_bound(server):
    started = time.monotonic()
    with connect(server.port) as s:
        assert read_to_end(s) == b""
    print(f"cut off after {time.monotonic() - started:.2f} s (FIRST_BYTE_TIMEOUT_S = {FIRST_BYTE_TIMEOUT_S})")
    assert server.cut_off_total == {CutOff.FIRST_BYTE: 1, CutOff.HEAD: 0}


def test_a_slow_drip_is_cut_off_at_the_head_bound(server):
    """A client that sends a byte every 0.1 s passes the first-byte bound, and is still cut off
    once HEAD_TIMEOUT_S have passed since it connected, without an answer."""
    stop = threading.Event()
    started = time.monotonic()
    s = connect(server.port)

    def drip() -> None:
        try:
            s.sendall(PARTIAL)
            while not stop.wait(0.1):
                s.sendall(b"X")
        except OSError:
            pass

    t = threading.Thread(target=drip)
    t.start()
    try:
        assert read_to_end(s) == b""
        print(f"cut off after {time.monotonic() - started:.2f} s (HEAD_TIMEOUT_S = {HEAD_TIMEOUT_S})")
    finally:
        stop.set()
        t.join()
        s.close()
    # the head bound, not the first byte's: the drip had passed that one
    assert server.cut_off_total == {CutOff.FIRST_BYTE: 0, CutOff.HEAD: 1}


def test_refusals_are_said_at_once_then_at_most_once_per_interval(server, lines):
    held = hold(server.port, "127.0.0.2", MAX_PER_PEER)
    try:
        wait_for(lambda: server._active == MAX_PER_PEER, 30, "the address at its cap", interval_s=0.01)
        assert lines.messages() == []
        assert exchange(server.port, "127.0.0.2")[0] == 503
        # said before the 503 was written: by now it is there
        (first,) = lines.messages()
        assert "503 to 1 connection" in first and "127.0.0.2 (1)" in first
        for _ in range(3):
            assert exchange(server.port, "127.0.0.2")[0] == 503
        assert server.refused_total == 4
        assert lines.messages() == [first], "a second line within the minute"
    finally:
        for s in held:
            s.close()


def test_refusals_held_back_are_said_when_the_interval_is_up_with_their_count_and_addresses(lines):
    interval_s = 1.0
    server = make_server(lines, refused_log_interval_s=interval_s)
    held = [
        s for i in range(MAX_CONNECTIONS // MAX_PER_PEER) for s in hold(server.port, f"127.0.0.{2 + i}", MAX_PER_PEER)
    ]
    try:
        wait_for(lambda: server._active == MAX_CONNECTIONS, 30, "every slot held", interval_s=0.01)
        assert exchange(server.port, "127.0.0.2")[0] == 503
        assert len(lines.messages()) == 1
        for source in ("127.0.0.100", "127.0.0.100", "127.0.0.2"):
            assert exchange(server.port, source)[0] == 503
        assert len(lines.messages()) == 1
        wait_for(lambda: len(lines.messages()) == 2, 30, "the held-back refusals to be said", interval_s=0.01)
        second = lines.messages()[1]
        assert "503 to 3 connection" in second
        assert "127.0.0.100 (2), 127.0.0.2 (1)" in second
        assert f"2 while all {MAX_CONNECTIONS} connections were held, 1 from an address already holding" in second
        t0, t1 = lines.times()
        assert t1 - t0 >= interval_s - 0.05
    finally:
        for s in held:
            s.close()
        server.stop()
    assert len(lines.messages()) == 2


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /metrics HTTP/1.1\r\n\r\nGET /metrics HTTP/1.1\r\n\r\n", 200),  # pipelined: the first answered
        (b"DELETE /metrics HTTP/1.1\r\n\r\n", 405),
        (b"\x00\xff /\x01 HTTP/1.1\r\n\r\n", 405),
        (b"GET /%00/../../etc/passwd HTTP/1.1\r\n\r\n", 404),
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),
        (b"GET /metrics\r\n\r\n", 400),
    ],
)
def test_odd_requests_get_a_plain_answer(server, request_bytes, status):
    assert exchange(server.port, "127.0.0.1", request_bytes)[0] == status


@pytest.mark.parametrize(
    "request_bytes",
    [b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n", b"GET /metrics HTTP/1.1\r\n" + b"X-A: b\r\n" * 3000 + b"\r\n"],
    ids=["long request line", "huge headers"],
)
def test_an_oversized_head_is_dropped_and_the_endpoint_serves_on(server, request_bytes):
    with connect(server.port) as s:
        try:
            s.sendall(request_bytes)
        except OSError:
            pass  # cut off while still sending
        assert read_to_end(s) == b""
    assert exchange(server.port, "127.0.0.2")[:3:2] == (200, BODY)


def test_two_thousand_rapid_connects_leave_the_endpoint_serving(server):
    for _ in range(2000):
        connect(server.port).close()
    assert exchange(server.port, "127.0.0.2")[:3:2] == (200, BODY)
    wait_for(lambda: server._active == 0, 30, "every slot given back", interval_s=0.01)
    assert exchange(server.port, "127.0.0.1")[:3:2] == (200, BODY)
