"""The replica simulator's faults really happen (real HTTP, real processes, on loopback)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from harness import Running, gone
from systemd_box import wait_for

from guardian.observe.metrics import parse_vllm_metrics

# A complete /metrics page from a real vLLM 0.32 server (copied from shared/).
SAMPLE = Path(__file__).resolve().parent.parent / "vllm_sim" / "data" / "vllm-0.32-metrics-sample.txt"


def stream_tokens(s: Running, max_tokens: int) -> list[float]:
    """Start a streaming completion on a thread; the list fills with when each token arrived."""
    stamps: list[float] = []

    def read() -> None:
        try:
            with httpx.stream("POST", s.url + "/v1/completions", timeout=30,
                              json={"model": "m", "prompt": "x", "max_tokens": max_tokens, "stream": True}) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        stamps.append(time.monotonic())
        except httpx.HTTPError:
            pass  # the simulator was stopped under it
    threading.Thread(target=read, daemon=True).start()
    return stamps


def timed_get(s: Running, path: str, timeout: float) -> tuple[object, float]:
    """GET PATH: (its status code, or the exception that ended it; when that was)."""
    try:
        got: object = s.get(path, timeout=timeout).status_code
    except httpx.HTTPError as e:
        got = e
    return got, time.monotonic()


def raw_post(s: Running, body: dict) -> socket.socket:
    """A completion request on a plain socket, to see every byte of the answer (or that none comes)."""
    data = json.dumps(body).encode()
    conn = socket.create_connection(("127.0.0.1", s.port), timeout=5)
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return conn


def read_for(conn: socket.socket, seconds: float) -> tuple[bytes, bool]:
    """Every byte CONN receives within SECONDS, and whether it got EOF."""
    got, deadline = b"", time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        conn.settimeout(left)
        try:
            chunk = conn.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            return got, True
        got += chunk
    return got, False


def cpu_s(pids: list[int]) -> float:
    """The CPU time PIDS have used (utime + stime: fields 14 and 15 of /proc/PID/stat), in seconds."""
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # from field 3 on
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def engine_pids(s: Running) -> list[int]:
    return s.get("/_sim/state").json()["engine_pids"]


def cpu_rises(pids: list[int], by_s: float, what: str) -> None:
    """Wait until PIDS have used BY_S more seconds of CPU."""
    base = cpu_s(pids)
    wait_for(lambda: cpu_s(pids) >= base + by_s, 30, what, interval_s=0.05)


def cpu_flat(pids: list[int], window_s: float = 2.0) -> float:
    """The CPU PIDS use over WINDOW_S: an observation window, not a wait for a condition."""
    base = cpu_s(pids)
    time.sleep(window_s)
    return cpu_s(pids) - base


def stopped(pids: list[int]) -> bool:
    return all(psutil.Process(pid).status() == psutil.STATUS_STOPPED for pid in pids)


def test_serves_vllms_endpoints_and_counters_move(sim):
    s = sim("--gpu-memory-utilization", "0.74").wait_up()
    assert s.get("/ping").status_code == 200 and "version" in s.get("/version").json()
    assert [m["id"] for m in s.get("/v1/models").json()["data"]] == ["m"]
    before = s.sample()
    r = s.post("/v1/completions", {"model": "m", "prompt": "hello there", "max_tokens": 5})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    after = s.sample()
    assert after.generation_tokens >= before.generation_tokens + 5
    assert after.prompt_tokens > before.prompt_tokens and after.request_success == before.request_success + 1
    assert after.gpu_memory_utilization == 0.74 and after.model_names == ("m",)
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=5, json=chat) as resp:
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert len(events) == 4 and events[-1] == "data: [DONE]"


def test_metrics_page_uses_the_real_servers_names():
    real = SAMPLE.read_text()
    assert parse_vllm_metrics(real).generation_tokens == 166


def test_metric_families_match_the_real_sample(sim):
    s = sim().wait_up()

    def names(text: str) -> set[str]:
        return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE vllm:")}
    mine, real = names(s.get("/metrics").text), names(SAMPLE.read_text())
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:request_success_total",
            "vllm:iteration_tokens_total", "vllm:cache_config_info"} <= mine
    assert mine == real, (mine - real, real - mine)


def test_metrics_page_is_the_size_and_shape_of_the_real_one(sim):
    """What guardian parses, and what that costs, must be measured on a real-size page."""
    s = sim("--gpu-memory-utilization", "0.74").wait_up()
    page, real = s.get("/metrics").text, SAMPLE.read_text()

    def samples(text: str) -> int:
        return sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    assert 0.8 * len(real) <= len(page) <= 1.2 * len(real), (len(page), len(real))
    assert 0.8 * samples(real) <= samples(page) <= 1.2 * samples(real)
    assert 'model_name="tiny"' not in page and 'model_name="m"' in page
    info = [line for line in page.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and len(info[0]) > 1000 and 'gpu_memory_utilization="0.74"' in info[0]


def test_engine_dead_health_200_requests_hang_counters_flat(sim):
    s = sim().wait_up()
    s.post("/_sim/load", {"streams": 3})
    wait_for(lambda: s.sample().running == 3, 30, "load to run")
    s.post("/_sim/fault", {"fault": "engine-dead"})
    frozen = s.sample()
    assert s.get("/health").status_code == 200
    with pytest.raises(httpx.TimeoutException):
        s.post("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 1}, timeout=1.5)
    later = s.sample()
    assert later.generation_tokens == frozen.generation_tokens and later.running == 3
    assert later.waiting == frozen.waiting  # the new request never shows up, as in real vLLM


def test_slow_health_under_load_while_tokens_flow(sim):
    s = sim().wait_up()
    s.post("/_sim/fault", {"fault": "slow-health", "delay_s": 30})
    # idle: not delayed (a delayed answer would run past this timeout, a third of the delay)
    assert s.get("/health", timeout=10.0).status_code == 200
    s.post("/_sim/load", {"streams": 4})
    wait_for(lambda: s.sample().running > 0, 30, "load to run")
    before = s.sample()
    with pytest.raises(httpx.TimeoutException):
        s.get("/health", timeout=1.0)
    assert s.sample().generation_tokens > before.generation_tokens


def test_wrong_model(sim):
    s = sim().wait_up()
    s.post("/_sim/fault", {"fault": "wrong-model", "model": "old"})
    assert [m["id"] for m in s.get("/v1/models").json()["data"]] == ["old"]


def test_frozen_process(sim):
    s = sim().wait_up()
    s.post("/_sim/fault", {"fault": "frozen"})
    wait_for(lambda: psutil.Process(s.proc.pid).status() == psutil.STATUS_STOPPED, 30, "SIGSTOP")
    with pytest.raises(httpx.TimeoutException):
        s.get("/health", timeout=1.0)


def test_engine_killed_503_then_exit_0(sim):
    s = sim().wait_up()
    s.post("/_sim/fault", {"fault": "engine-killed", "exit_after_s": 1.0})
    assert s.get("/health").status_code == 503
    assert s.post("/v1/completions", {"model": "m", "prompt": "x"}).status_code == 500
    assert s.proc.wait(10) == 0  # like vLLM's API server: Restart=on-failure would not restart it


def test_fail_at_startup(sim):
    s = sim("--fault", "fail-startup")
    assert s.proc.wait(10) == 1
    assert "failed to start" in s.proc.stdout.read()


def test_startup_memory_check_refuses_a_fraction_that_does_not_fit(sim):
    s = sim("--check-memory", "--gpu-memory-utilization", "0.999")
    assert s.proc.wait(10) == 1
    assert "Free memory on device" in s.proc.stdout.read()
    ok = sim("--check-memory", "--gpu-memory-utilization", "0.01").wait_up()
    assert ok.sample().gpu_memory_utilization == 0.01


def test_slow_startup_refuses_connections_until_loaded(sim):
    s = sim("--load-time-s", "2")
    time.sleep(0.5)  # not a wait for a condition: we check that it is NOT up yet mid-load
    with pytest.raises(httpx.ConnectError):
        s.get("/health")
    s.wait_up()


def test_hang_on_sigterm_keeps_a_dead_engines_process_until_sigkill(sim):
    s = sim("--hang-on-sigterm").wait_up()
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(s.proc.stdout.readline, "")), daemon=True).start()
    s.post("/_sim/fault", {"fault": "engine-dead"})
    s.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: any("SIM shutdown: waiting for the engine" in line for line in lines), 30, "the hung shutdown")
    assert s.proc.poll() is None and s.get("/health").status_code == 200
    s.proc.kill()
    assert s.proc.wait(5) == -signal.SIGKILL


def plain_completion_in_thread(s: Running, max_tokens: int) -> list:
    """A plain completion on a thread; the list gets (status, body) or the exception that ended it."""
    got: list = []

    def ask() -> None:
        try:
            r = httpx.post(s.url + "/v1/completions", timeout=60,
                           json={"model": "m", "prompt": "x", "max_tokens": max_tokens})
            got.append((r.status_code, r.json()))
        except httpx.HTTPError as e:
            got.append(e)
    threading.Thread(target=ask, daemon=True).start()
    return got


def test_shutdown_timeout_lets_a_running_completion_finish_and_refuses_new_ones(sim):
    """vLLM's --shutdown-timeout N: on SIGTERM no new request, the running ones answered in full."""
    s = sim("--shutdown-timeout", "20").wait_up()
    got = plain_completion_in_thread(s, 100)  # 2 s at 50 tokens a second
    wait_for(lambda: s.get("/_sim/state").json()["plain"] > 0, 10, "the completion running")
    s.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: got, 20, "the completion's answer")
    (status, body), = got
    assert status == 200 and body["usage"]["completion_tokens"] == 100
    assert s.proc.wait(10) == 0
    with pytest.raises(httpx.ConnectError):
        s.get("/health")


def test_without_shutdown_timeout_sigterm_aborts_a_running_completion(sim):
    s = sim().wait_up()
    got = plain_completion_in_thread(s, 500)
    wait_for(lambda: s.get("/_sim/state").json()["plain"] > 0, 10, "the completion running")
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(10) == 0
    wait_for(lambda: got, 10, "the completion to end")
    assert isinstance(got[0], httpx.HTTPError), got


def test_without_hang_on_sigterm_a_dead_engines_process_stops(sim):
    s = sim().wait_up()
    s.post("/_sim/fault", {"fault": "engine-dead"})
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(10) == 0


def test_engine_frozen_between_steps_looks_idle_while_requests_hang(sim):
    """Seen on a real vLLM 0.32: the gauges and counters are the engine's last scheduler stats,
    so an engine that stops right after a batch shows 0 running, 0 waiting, frozen counters."""
    s = sim().wait_up()
    s.post("/_sim/load", {"streams": 3, "max_tokens": 8})
    wait_for(lambda: s.sample().running == 3, 30, "load to run")
    s.post("/_sim/fault", {"fault": "between-steps"})
    wait_for(lambda: s.sample().running == 0, 30, "the batch to finish")
    frozen = s.sample()
    with pytest.raises(httpx.TimeoutException):
        s.post("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 1}, timeout=1.5)
    later = s.sample()
    assert (later.running, later.waiting) == (0, 0)  # the request that hangs is not even "waiting"
    assert later.generation_tokens == frozen.generation_tokens and later.request_success == frozen.request_success
    assert s.get("/health").status_code == 200


def test_between_steps_holds_new_requests_open_stream_headers_only(sim):
    """What the kernel shows of a client waiting on a frozen engine: an established connection;
    no byte of answer to a plain completion; a stream's 200 headers (sent at once, as vLLM's
    Starlette StreamingResponse does) and then no event."""
    s = sim().wait_up()
    s.post("/_sim/load", {"streams": 3, "max_tokens": 8})
    wait_for(lambda: s.sample().running == 3, 30, "load to run")
    s.post("/_sim/fault", {"fault": "between-steps"})
    wait_for(lambda: s.sample().running == 0, 30, "the batch to finish")
    plain = raw_post(s, {"model": "m", "prompt": "x", "max_tokens": 1})
    stream = raw_post(s, {"model": "m", "prompt": "x", "max_tokens": 1, "stream": True})
    try:
        assert read_for(plain, 2.0) == (b"", False)  # no status line, no EOF: still waiting
        head, eof = read_for(stream, 2.0)
        assert not eof and head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n"), head
        assert b"text/event-stream" in head and b"data:" not in head  # the headers, no token
        server_side = {c.raddr.port for c in psutil.Process(s.proc.pid).net_connections("tcp")
                       if c.laddr and c.laddr.port == s.port and c.raddr and c.status == psutil.CONN_ESTABLISHED}
        assert {plain.getsockname()[1], stream.getsockname()[1]} <= server_side
    finally:
        plain.close()
        stream.close()


def test_stall_endpoints_holds_every_probe_while_streams_flow(sim):
    """Measured on a real vLLM 0.32 (2 cores, 8 streams through nginx): its /health, /metrics and
    /v1/models went unanswered for 11 s while its streams kept delivering tokens."""
    s = sim().wait_up()
    streams = [stream_tokens(s, 2000), stream_tokens(s, 2000)]  # 40 s at 50 tokens/s: they outlast the stall
    wait_for(lambda: all(streams), 30, "both streams to deliver tokens")
    # Long enough that what happens "during the stall" (1 s probe timeouts, a 3-token completion)
    # happens during it on a loaded machine too: the comparisons below are orders of events and the
    # stall's end, which the simulator sets at stall_s after the fault (a point between these two).
    stall_s = 10.0
    t0 = time.monotonic()
    assert s.post("/_sim/fault", {"fault": "stall-endpoints", "stall_s": stall_s}).status_code == 200
    t1 = time.monotonic()
    stall_ends_after, stall_ends_before = t0 + stall_s, t1 + stall_s
    with ThreadPoolExecutor(6) as pool:
        patient = pool.submit(timed_get, s, "/health", 30.0)
        quick = [pool.submit(timed_get, s, path, 1.0) for path in ("/health", "/metrics", "/v1/models", "/version")]
        completion = pool.submit(lambda: s.post("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 3}))
        timed_out = [f.result() for f in quick]
        assert all(isinstance(got, httpx.TimeoutException) for got, _ in timed_out), timed_out
        held_until = min(at for _, at in timed_out)
        assert held_until < stall_ends_after  # they gave up during the stall, not after it
        done = completion.result()
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3
        assert time.monotonic() < stall_ends_after  # a new completion is served while the probes are held
        for stamps in streams:
            assert sum(1 for at in stamps if t1 < at < held_until) > 0  # tokens kept flowing
        got, answered_at = patient.result()
    print(f"the patient /health answered {answered_at - stall_ends_before:.2f} s after the stall's end at the latest")
    assert got == 200 and answered_at >= stall_ends_after  # held to the stall's end, then answered
    assert s.get("/health", timeout=1.0).status_code == 200 and s.get("/metrics", timeout=1.0).status_code == 200
    wait_for(lambda: s.get("/_sim/state").json()["fault"] == {}, 30, "the stall to clear itself")


def test_starved_delays_every_answer_while_streams_keep_their_pace(sim):
    """Issue 35 item 9: a saturated box delays each of the replica's answers by 1-8 s (here 1-2 s),
    canaries included, while its engine keeps producing tokens for the streams already running."""
    s = sim().wait_up()
    stream = stream_tokens(s, 2000)
    wait_for(lambda: stream, 30, "the stream to deliver tokens")
    assert s.post("/_sim/fault", {"fault": "starved", "min_s": 1.0, "max_s": 2.0, "seed": 7}).status_code == 200
    t0 = time.monotonic()
    with ThreadPoolExecutor(5) as pool:
        gets = [pool.submit(timed_get, s, path, 30.0) for path in ("/health", "/metrics", "/v1/models", "/version")]
        canary = pool.submit(lambda: (s.post("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 1},
                                             timeout=30.0), time.monotonic()))
        answered = [f.result() for f in gets]
        done, done_at = canary.result()
    assert [got for got, _ in answered] == [200, 200, 200, 200] and done.status_code == 200
    first = min(at for _, at in [*answered, (None, done_at)])
    assert first - t0 >= 1.0  # none was answered before its delay (a lower bound: load only adds to it)
    assert sum(1 for at in stream if t0 < at < first) > 0  # tokens flowed while every answer was held
    assert s.get("/_sim/state", timeout=5).json()["fault"]["fault"] == "starved"  # the simulator's own: not held
    s.post("/_sim/clear", {})


def test_a_starved_answer_waits_runnable_as_on_a_saturated_box_not_asleep_as_a_frozen_one(sim):
    """Issue 43: guardian tells a starved API server from a frozen one by its CPU plus its run-queue
    wait; the simulator's delay stands for that wait, so its API server uses CPU while it is held."""
    s = sim().wait_up()
    assert s.post("/_sim/fault", {"fault": "starved", "min_s": 3.0, "max_s": 3.0}).status_code == 200
    api = [s.proc.pid]
    before = cpu_s(api)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(timed_get, s, "/health", 30.0)
        got, _ = held.result()
    assert got == 200
    assert cpu_s(api) - before >= 0.05  # 5 % of a core for 3 s is 0.15 s; a sleeping wait is 0
    s.post("/_sim/clear", {})


def test_starved_with_a_seed_gives_each_path_its_own_sequence_whatever_comes_beside_it(sim):
    """A test's canaries must come late by a known draw: with one shared sequence, which delay the
    canary got depended on how many probes the box's timing let in before it."""
    s = sim().wait_up()
    canary = {"model": "m", "prompt": "x", "max_tokens": 1}
    drawn = []
    for probes_first in (0, 3):
        assert s.post("/_sim/fault", {"fault": "starved", "min_s": 0.01, "max_s": 0.05, "seed": 11}).status_code == 200
        for _ in range(probes_first):
            assert s.get("/health", timeout=10).status_code == 200
        for _ in range(2):
            assert s.post("/v1/completions", canary, timeout=10).status_code == 200
        delays = s.get("/_sim/state", timeout=5).json()["starved_delays_s"]
        assert len(delays.get("/health", [])) == probes_first
        drawn.append(delays["/v1/completions"])
    assert len(drawn[0]) == 2 and drawn[0] == drawn[1]
    assert drawn[0][0] != drawn[0][1]  # a sequence, not one value
    s.post("/_sim/clear", {})


def _prefix_counters(s: Running) -> tuple[float, float, float]:
    """vllm:prefix_cache_queries_total, _hits_total and the TTFT histogram's count, as the page says."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    for family in text_string_to_metric_families(s.get("/metrics").text):
        for sample in family.samples:
            if sample.name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                               "vllm:time_to_first_token_seconds_count"):
                found[sample.name] = sample.value
    return (found["vllm:prefix_cache_queries_total"], found["vllm:prefix_cache_hits_total"],
            found["vllm:time_to_first_token_seconds_count"])


def test_a_shared_prefix_is_a_hit_in_whole_blocks_and_a_restart_empties_the_cache(sim):
    """Issue 33 item 4: a prompt's leading blocks of 16 tokens already cached are hits; its uncached
    tokens take --sim-prefill-s-per-token each (the figure the simulator computes, not a timing)."""
    args = ("--sim-prefill-s-per-token", "0.001")
    s = sim(*args).wait_up()
    system = " ".join(f"s{i}" for i in range(40))  # 40 tokens: 2 whole blocks of 16, and 8 more
    for prompt, queried, hit in ((system + " one", 41, 0), (system + " two", 41, 32), ("other " + system, 41, 0)):
        before = _prefix_counters(s)
        assert s.post("/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 1}).status_code == 200
        after = _prefix_counters(s)
        assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (queried, hit, 1), prompt
        assert s.get("/_sim/state").json()["prefix_cache"]["last_prefill_s"] == pytest.approx((queried - hit) * 0.001)
    s.stop()
    again = sim(*args).wait_up()  # a restarted replica comes back cold
    assert again.post("/v1/completions", {"model": "m", "prompt": system + " two", "max_tokens": 1}).status_code == 200
    assert _prefix_counters(again)[:2] == (41, 0)


@pytest.mark.parametrize("coschedule", [False, True])
def test_a_long_chunked_prefill_moves_only_the_kv_cache_and_blocks_others_unless_coscheduled(sim, coschedule):
    s = sim().wait_up()
    before = s.sample()
    # 32 chunks of 0.5 s: the checks between the second chunk and the blocked request took over 7 s
    # on the suite's loaded box (8 chunks, then 16, were not enough).
    s.post("/_sim/prefill", {"prompt_tokens": 16384, "chunk_tokens": 512, "chunk_s": 0.5, "coschedule": coschedule})
    wait_for(lambda: s.sample().kv_cache_usage > before.kv_cache_usage, 30, "the first chunk")
    first = s.sample()
    assert first.running == 1 and first.prompt_tokens == before.prompt_tokens  # counted only at the end
    wait_for(lambda: s.sample().kv_cache_usage > first.kv_cache_usage, 30, "the next chunk")
    assert s.sample().generation_tokens == before.generation_tokens  # token counters stand still
    if coschedule:
        assert s.post("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 1}, timeout=1.5).status_code == 200
    else:
        with pytest.raises(httpx.TimeoutException):
            s.post("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 1}, timeout=0.8)
    wait_for(lambda: s.sample().prompt_tokens >= before.prompt_tokens + 16384, 60, "the prefill to complete")
    assert s.sample().running == 0 or coschedule


def test_a_stream_whose_client_goes_away_is_aborted_as_vllm_does(sim):
    """vLLM aborts a request whose client disconnected; without that, streams of killed clients
    kept their places in the batch and new clients waited behind them (seen in the benchmark)."""
    import socket

    s = sim().wait_up()
    port = int(s.url.rsplit(":", 1)[1])
    conns = []
    for _ in range(3):
        c = socket.create_connection(("127.0.0.1", port))
        body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 100000, "stream": True}).encode()
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        conns.append(c)
    wait_for(lambda: s.sample().running == 3, 30, "3 streams running")
    for c in conns:
        c.close()
    wait_for(lambda: s.sample().running == 0, 30, "the streams of the clients that went away aborted")


def test_sim_load_memory_takes_its_fraction_of_the_device_in_steps_before_the_port_is_bound(sim):
    """--sim-load-memory: gpu_memory_utilization x --sim-total-memory-bytes, really resident, taken
    over --load-time-s while connections are refused (the start guard's case), then held."""
    mib = 2**20
    want = 100 * mib  # 0.5 x 200 MiB
    s = sim("--sim-load-memory", "--sim-total-memory-bytes", str(200 * mib), "--gpu-memory-utilization", "0.5",
            "--load-time-s", "3")
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(s.proc.stdout.readline, "")), daemon=True).start()
    wait_for(lambda: any("loading: taking 0.10 GiB" in line for line in lines), 30, "the load to begin")
    began, proc = time.monotonic(), psutil.Process(s.proc.pid)
    base = proc.memory_info().rss
    grown: list[int] = []  # RSS above the first look, while the port still refuses connections
    while True:
        rss = proc.memory_info().rss
        try:
            s.get("/health", timeout=1)
            break
        except httpx.ConnectError:
            grown.append(rss - base)
        if time.monotonic() - began > 60:  # stops a hung test only
            pytest.fail("the simulator never served after its load")
        time.sleep(0.05)
    print(f"served {time.monotonic() - began:.1f} s after the load began (--load-time-s 3)")
    assert grown, "the port answered at the first look: no load time was taken"
    assert any(0.2 * want <= g <= 0.8 * want for g in grown), grown  # in steps, not at once
    assert grown[-1] - grown[0] >= 0.5 * want  # it grew while connections were refused
    assert proc.memory_info().rss - base >= 0.9 * want  # and holds it all once serving
    assert s.get("/health").status_code == 200 and any("holding 0.10 GiB" in line for line in lines)


def test_leak_keeps_the_reservation_after_the_process_exits(sim):
    """The leak fault: the --sim-allocate reservation moves into a /dev/shm file that outlives the
    process, as GB10's driver keeps a killed engine's memory."""
    s = sim("--sim-allocate", "--sim-total-memory-bytes", str(64 * 2**20), "--gpu-memory-utilization", "0.5").wait_up()
    held = Path(f"/dev/shm/vllm-sim-held-{s.port}")
    try:
        assert s.post("/_sim/fault", {"fault": "leak"}).status_code == 200
        assert held.stat().st_size == 32 * 2**20
        assert s.get("/health").status_code == 200  # it keeps serving
        s.stop()
        assert held.stat().st_size == 32 * 2**20  # and the memory stays held once it is gone
    finally:
        held.unlink(missing_ok=True)


def test_the_engine_core_is_a_child_process_with_vllms_names(sim):
    """vLLM V1: the API server (the unit's main process), its child VLLM::EngineCore, and under
    tensor parallelism the engine core's VLLM::Worker_TP<i> processes, which run the steps."""
    s = sim().wait_up()
    [core] = engine_pids(s)
    assert psutil.Process(core).name() == "VLLM::EngineCor" and psutil.Process(core).ppid() == s.proc.pid
    tp = sim("--sim-workers", "2").wait_up()
    core, *workers = engine_pids(tp)
    assert psutil.Process(core).ppid() == tp.proc.pid and len(workers) == 2
    assert {(psutil.Process(w).name(), psutil.Process(w).ppid()) for w in workers} == {("VLLM::Worker_TP", core)}
    tp.post("/_sim/load", {"streams": 3})
    cpu_rises(workers, 0.05, "the workers to burn the steps' CPU")
    assert tp.get("/health").status_code == 200 and tp.sample().generation_tokens > 0


def test_the_engine_core_uses_cpu_while_it_works_and_none_while_idle(sim):
    s = sim().wait_up()
    pids = engine_pids(s)
    assert cpu_flat(pids) <= 0.02  # idle: it blocks on its input, as vLLM's EngineCore does
    s.post("/_sim/load", {"streams": 3})
    cpu_rises(pids, 0.05, "the engine core to burn CPU while requests stream")


@pytest.mark.parametrize("fault", ["engine-frozen", "engine-dead", "frozen", "between-steps"])
def test_a_hung_engine_uses_no_cpu(sim, fault):
    """A frozen or dead engine uses no CPU: what guardian reads to tell a hang from a slow engine."""
    s = sim().wait_up()
    pids = engine_pids(s)
    s.post("/_sim/load", {"streams": 3, "max_tokens": 8})
    cpu_rises(pids, 0.02, "the engine core to work")
    s.post("/_sim/fault", {"fault": fault})
    if fault == "engine-frozen":
        wait_for(lambda: stopped(pids), 30, "the engine core stopped")
    elif fault == "frozen":
        wait_for(lambda: stopped([s.proc.pid]), 30, "the API server stopped")
    elif fault == "between-steps":
        wait_for(lambda: s.sample().running == 0, 30, "the batch to finish and the engine to freeze")
    assert cpu_flat(pids) <= 0.02


def test_engine_frozen_freezes_everything_but_health_and_clear_resumes(sim):
    s = sim().wait_up()
    pids = engine_pids(s)
    s.post("/_sim/load", {"streams": 3})
    wait_for(lambda: s.sample().running == 3, 30, "load to run")
    s.post("/_sim/fault", {"fault": "engine-frozen"})
    wait_for(lambda: stopped(pids), 30, "the engine core stopped")
    frozen = s.sample()
    assert s.get("/health").status_code == 200
    with pytest.raises(httpx.TimeoutException):
        s.post("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 1}, timeout=1.5)
    later = s.sample()
    assert (later.generation_tokens, later.running, later.waiting) == (frozen.generation_tokens, 3, frozen.waiting)
    s.post("/_sim/clear", {})
    wait_for(lambda: s.sample().generation_tokens > later.generation_tokens, 30, "tokens to flow again")


def test_a_spinning_engine_uses_cpu_while_nothing_moves(sim):
    """A GPU engine spinning on a wedged kernel: no step completes, yet its CPU is used."""
    s = sim().wait_up()
    pids = engine_pids(s)
    s.post("/_sim/load", {"streams": 3})
    wait_for(lambda: s.sample().running == 3, 30, "load to run")
    s.post("/_sim/fault", {"fault": "spinning", "busy": 0.5})
    cpu_rises(pids, 0.1, "the engine core to spin")  # by then the step that was in flight has ended
    first = s.sample()
    cpu_rises(pids, 0.1, "the engine core to go on spinning")
    later = s.sample()
    assert (later.generation_tokens, later.prompt_tokens, later.request_success) == (
        first.generation_tokens, first.prompt_tokens, first.request_success)
    assert s.get("/health").status_code == 200
    with pytest.raises(httpx.TimeoutException):
        s.post("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 1}, timeout=1.5)
    s.post("/_sim/clear", {})
    wait_for(lambda: s.sample().generation_tokens > later.generation_tokens, 30, "tokens to flow again")


def test_a_long_prefill_uses_cpu_while_the_token_counters_stand_still(sim):
    s = sim().wait_up()
    pids = engine_pids(s)
    before = s.sample()
    s.post("/_sim/prefill", {"prompt_tokens": 4096, "chunk_tokens": 4096, "chunk_s": 60})
    cpu_rises(pids, 0.1, "the engine core to burn CPU on the prefill")
    during = s.sample()
    assert (during.prompt_tokens, during.generation_tokens) == (before.prompt_tokens, before.generation_tokens)
    assert during.running == 1


@pytest.mark.parametrize(("sig", "fault"), [(signal.SIGTERM, None), (signal.SIGTERM, "engine-frozen"),
                                            (signal.SIGKILL, "engine-frozen")])
def test_no_engine_process_outlives_the_api_server(sim, sig, fault):
    s = sim("--sim-workers", "1").wait_up()
    pids = engine_pids(s)
    if fault:
        s.post("/_sim/fault", {"fault": fault})
        wait_for(lambda: stopped(pids), 30, "the engine processes stopped")
    s.proc.send_signal(sig)
    assert s.proc.wait(10) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
    wait_for(lambda: gone(pids), 10, "the engine processes to go with the API server")


def test_a_killed_engine_core_fails_the_api_server_as_vllms_does(sim):
    """vLLM's API server watches its EngineCore: once that process dies, /health is 503 and it exits."""
    s = sim().wait_up()
    os.kill(engine_pids(s)[0], signal.SIGKILL)
    wait_for(lambda: s.get("/health").status_code == 503, 30, "/health 503")
    assert s.proc.wait(15) == 0


def test_without_the_engine_process_it_is_one_process(sim):
    s = sim("--no-sim-engine-process").wait_up()
    assert engine_pids(s) == [] and psutil.Process(s.proc.pid).children() == []
    assert s.post("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 2}).status_code == 200
    assert s.post("/_sim/fault", {"fault": "engine-frozen"}).status_code == 400
