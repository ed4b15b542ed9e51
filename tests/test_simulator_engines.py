"""The simulator as SGLang, TensorRT-LLM and llama.cpp (--sim-engine): each engine's endpoints, metric
names, health semantics, knobs and stop, on real processes over loopback (vllm_sim/engines.py)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import httpx
import psutil
import pytest
from harness import Running
from prometheus_client.parser import text_string_to_metric_families
from systemd_box import wait_for


def families(text: str) -> dict[str, dict[str, float]]:
    """Each family's samples (name -> value; the labels dropped: one series each here)."""
    out: dict[str, dict[str, float]] = {}
    for f in text_string_to_metric_families(text):
        out[f.name] = {s.name: s.value for s in f.samples}
    return out


def completion(s: Running, max_tokens: int, timeout: float = 10.0) -> httpx.Response:
    return s.post("/v1/completions", {"prompt": "hello there", "max_tokens": max_tokens}, timeout=timeout)


def in_thread(fn, *args) -> list:
    """Run FN(*ARGS) on a thread; the list gets its result (or the exception that ended it)."""
    out: list = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except httpx.HTTPError as e:
            out.append(e)

    threading.Thread(target=run, daemon=True).start()
    return out


def hangs(s: Running, path: str, for_s: float = 1.5) -> bool:
    """GET PATH gets no answer within FOR_S."""
    try:
        s.get(path, timeout=for_s)
    except httpx.ReadTimeout:
        return True
    return False


def children(s: Running) -> list[psutil.Process]:
    return psutil.Process(s.proc.pid).children(recursive=True)


# -- SGLang ------------------------------------------------------------------------------------------

SGLANG_FAMILIES = {
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:token_usage",
    "sglang:prompt_tokens",
    "sglang:generation_tokens",
    "sglang:cached_tokens",
    "sglang:time_to_first_token_seconds",
    "sglang:inter_token_latency_seconds",
    "sglang:e2e_request_latency_seconds",
    "sglang:queue_time_seconds",
    "process_start_time_seconds",
}


def test_sglang_endpoints_metrics_names_knob_and_scheduler_process(sim):
    s = sim(
        "--sim-engine", "sglang", "--enable-metrics", "--mem-fraction-static", "0.61", "--served-model-name", "qwen"
    ).wait_up()
    assert s.get("/ping").status_code == 200
    assert [m["id"] for m in s.get("/v1/models").json()["data"]] == ["qwen"]
    assert s.get("/get_model_info").json() == {"model_path": "m", "tokenizer_path": "m", "is_generation": True}
    assert s.get("/version").status_code == 404  # vLLM's, not SGLang's
    assert s.get("/_sim/state").json()["gpu_memory_utilization"] == 0.61
    assert [p.name() for p in children(s)] == ["sglang::schedul"]  # the comm of sglang::scheduler
    r = completion(s, 5)
    assert r.status_code == 200 and r.json()["model"] == "qwen"
    page = families(s.get("/metrics").text)
    assert SGLANG_FAMILIES <= set(page)
    # counted when the request finished; the health probes' requests are not counted
    assert page["sglang:generation_tokens"]["sglang:generation_tokens_total"] == 5
    assert page["sglang:prompt_tokens"]["sglang:prompt_tokens_total"] == 2


def test_sglang_metrics_need_enable_metrics_and_model_path_is_the_id(sim):
    s = sim("--sim-engine", "sglang", "--model-path", "/models/Qwen3-8B").wait_up()
    assert s.get("/metrics").status_code == 404
    assert s.get("/v1/models").json()["data"][0]["id"] == "/models/Qwen3-8B"


def test_sglang_health_is_503_once_the_engine_freezes_within_the_generate_timeout(sim):
    s = sim("--sim-engine", "sglang", "--sim-health-generate-timeout-s", "2").wait_up()
    assert s.get("/health", timeout=5).status_code == 200  # a 1-token generate
    assert s.post("/_sim/fault", {"fault": "engine-frozen"}).status_code == 200
    # the server's answer at its generate timeout (2 s), well before the client's (6 s) would raise
    assert s.get("/health", timeout=6).status_code == 503
    assert s.get("/health_generate", timeout=6).status_code == 503
    assert s.get("/ping").status_code == 200
    s.post("/_sim/clear", {})
    assert s.get("/health", timeout=5).status_code == 200


def test_sglang_plain_health_env_leaves_health_generate_generating(sim, monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
    s = sim("--sim-engine", "sglang", "--sim-health-generate-timeout-s", "2").wait_up()
    s.post("/_sim/fault", {"fault": "engine-dead"})
    assert s.get("/health").status_code == 200  # plain: the engine is not asked
    assert s.get("/health_generate", timeout=6).status_code == 503  # still a generate


def test_sglang_watchdog_kills_a_stalled_engine_but_not_a_stopped_scheduler(sim):
    s = sim("--sim-engine", "sglang", "--watchdog-timeout", "1").wait_up()
    s.post("/_sim/load", {"streams": 2, "max_tokens": 100000})
    s.post("/_sim/fault", {"fault": "engine-frozen"})  # the watchdog lives in the stopped scheduler
    time.sleep(2.5)  # an observation window: 2.5 x the watchdog timeout without its kill
    assert s.proc.poll() is None
    s.post("/_sim/clear", {})
    s.post("/_sim/fault", {"fault": "engine-dead"})  # a forward that never returns, watchdog running
    assert s.proc.wait(10) == -signal.SIGKILL  # kill_process_tree: SIGKILL of its own process
    assert "watchdog timeout" in s.proc.stdout.read()


def test_sglang_sigterm_answers_503_then_drains_with_no_timeout_and_kills_itself(sim):
    s = sim("--sim-engine", "sglang").wait_up()
    running = in_thread(completion, s, 100)  # 2 s at 50 tokens/s
    wait_for(lambda: s.get("/_sim/state").json()["running"], 5, "the completion to run")
    s.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: s.get("/health").status_code == 503, 2, "/health 503")
    assert s.proc.poll() is None and not running
    wait_for(lambda: running, 10, "the completion to finish")
    assert running[0].status_code == 200 and running[0].json()["usage"]["completion_tokens"] == 100
    assert s.proc.wait(12) == -signal.SIGKILL  # its sigterm_watchdog looks every 5 s, then kill_process_tree


def test_sglang_sigterm_after_a_failed_health_check_exits_without_draining(sim):
    s = sim("--sim-engine", "sglang", "--sim-health-generate-timeout-s", "1").wait_up()
    s.post("/_sim/fault", {"fault": "engine-dead"})
    hung = in_thread(completion, s, 5, 30.0)  # never answered
    assert s.get("/health", timeout=4).status_code == 503
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(12) == -signal.SIGKILL
    wait_for(lambda: hung, 5, "the hung completion's end")


def test_sglang_a_scheduler_killed_from_outside_leaves_the_server_up_and_unhealthy(sim):
    s = sim("--sim-engine", "sglang", "--sim-health-generate-timeout-s", "1").wait_up()
    (scheduler,) = children(s)
    scheduler.kill()  # its SIGCHLD handler only logs
    wait_for(lambda: s.get("/health", timeout=4).status_code == 503, 10, "/health 503")
    assert s.get("/ping").status_code == 200 and s.proc.poll() is None


# -- TensorRT-LLM ------------------------------------------------------------------------------------


def test_trtllm_endpoints_knob_from_yaml_and_metrics_consumed_by_their_reader(sim, tmp_path):
    model = tmp_path / "Llama-3.1-8B"
    model.mkdir()
    options = tmp_path / "extra.yaml"
    options.write_text("enable_iter_perf_stats: true\nkv_cache_config:\n  free_gpu_memory_fraction: 0.55\n")
    s = sim(
        "--sim-engine", "trtllm", "--extra_llm_api_options", str(options), "--sim-perf-metrics", str(model)
    ).wait_up()
    assert s.get("/v1/models").json()["data"][0]["id"] == "Llama-3.1-8B"  # the directory's basename
    assert s.get("/_sim/state").json()["gpu_memory_utilization"] == 0.55
    assert children(s) == []  # the executor is in the process
    assert completion(s, 4).status_code == 200
    stats = s.get("/metrics").json()
    assert stats and {"iter", "iterLatencyMS", "numActiveRequests", "kvCacheStats"} <= set(stats[0])
    assert max(e["numActiveRequests"] for e in stats) == 1
    assert s.get("/metrics").json() == []  # read once: the entries are gone, and an idle executor adds none
    page = families(s.get("/prometheus/metrics").text)
    assert {
        "trtllm_num_requests_running",
        "trtllm_num_requests_waiting",
        "trtllm_generation_tokens",
        "trtllm_prompt_tokens",
        "trtllm_kv_cache_utilization",
        "trtllm_request_prefill_time_seconds",
        "trtllm_iteration_latency_seconds",
    } <= set(page)
    assert page["trtllm_generation_tokens"]["trtllm_generation_tokens_total"] == 4


def test_trtllm_without_the_options_metrics_are_empty_and_prometheus_404(sim):
    s = sim("--sim-engine", "trtllm", "--kv_cache_free_gpu_memory_fraction", "0.4", "/no/such/dir").wait_up()
    assert s.get("/v1/models").json()["data"][0]["id"] == "/no/such/dir"  # not a directory: as given
    assert s.get("/_sim/state").json()["gpu_memory_utilization"] == 0.4
    assert completion(s, 2).status_code == 200
    assert s.get("/metrics").json() == []
    assert s.get("/prometheus/metrics").status_code == 404


def test_trtllm_health_200_after_the_executor_died_while_health_generate_hangs_then_rank_dead_503(sim):
    s = sim("--sim-engine", "trtllm").wait_up()
    assert s.get("/health_generate").status_code == 200
    assert s.post("/_sim/fault", {"fault": "engine-frozen"}).status_code == 400  # no engine process
    s.post("/_sim/fault", {"fault": "engine-killed"})  # the executor thread died (#13318)
    assert s.get("/health").status_code == 200
    assert hangs(s, "/health_generate")
    s.post("/_sim/fault", {"fault": "rank-dead"})  # #18663
    assert s.get("/health").status_code == 503
    assert s.get("/health_generate").status_code == 500
    assert completion(s, 2).status_code == 500
    assert s.proc.poll() is None


def test_trtllm_sigterm_refuses_new_connections_and_finishes_the_running_request(sim):
    s = sim("--sim-engine", "trtllm").wait_up()
    running = in_thread(completion, s, 100)
    wait_for(lambda: s.get("/_sim/state").json()["running"], 5, "the completion to run")
    s.proc.send_signal(signal.SIGTERM)

    def refused() -> bool:
        try:
            s.get("/health")
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            return True  # refused, or taken into the closing listener's backlog and reset: not served
        return False

    wait_for(refused, 3, "new connections refused")
    wait_for(lambda: running, 10, "the completion to finish")
    assert running[0].status_code == 200
    assert s.proc.wait(5) == 0


# -- llama.cpp ---------------------------------------------------------------------------------------

LLAMACPP_NAMES = {
    "llamacpp:requests_processing",
    "llamacpp:requests_deferred",
    "llamacpp:tokens_predicted",
    "llamacpp:prompt_tokens",
    "llamacpp:prompt_seconds",
    "llamacpp:tokens_predicted_seconds",
    "llamacpp:n_decode",
    "llamacpp:n_busy_slots_per_decode",
}


def test_llamacpp_loading_503_on_a_bound_port_then_alias_slots_and_metrics(sim):
    s = sim(
        "--sim-engine",
        "llama.cpp",
        "--load-time-s",
        "2",
        "-a",
        "tiny,other",
        "--metrics",
        "-np",
        "2",
        "-m",
        "/models/tiny.gguf",
    )

    def loading() -> httpx.Response | None:
        try:
            return s.get("/health")
        except httpx.ConnectError:
            return None

    r = wait_for(loading, 5, "the port to be bound")
    assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model"
    assert s.get("/v1/models").status_code == 503
    s.wait_up()
    assert s.get("/health").json() == {"status": "ok"}
    assert s.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert children(s) == []
    assert completion(s, 3).status_code == 200
    assert len(s.get("/slots").json()) == 2
    page = families(s.get("/metrics").text)
    assert LLAMACPP_NAMES <= set(page)
    assert page["llamacpp:tokens_predicted"]["llamacpp:tokens_predicted_total"] == 3
    assert not any("kv" in name for name in page)


def test_llamacpp_health_stays_200_while_metrics_and_slots_hang_on_a_hung_main_loop(sim):
    s = sim("--sim-engine", "llama.cpp", "--metrics", "-m", "/models/tiny.gguf").wait_up()
    assert s.get("/v1/models").json()["data"][0]["id"] == "tiny.gguf"
    s.post("/_sim/fault", {"fault": "engine-dead"})
    assert s.get("/health").status_code == 200
    assert hangs(s, "/metrics") and hangs(s, "/slots")
    s.post("/_sim/clear", {})
    assert s.get("/metrics").status_code == 200


def test_llamacpp_metrics_501_without_the_flag(sim):
    s = sim("--sim-engine", "llama.cpp").wait_up()
    assert s.get("/metrics").status_code == 501


def test_llamacpp_sigterm_does_not_drain_and_a_hung_loop_needs_a_second_signal(sim):
    s = sim("--sim-engine", "llama.cpp").wait_up()
    running = in_thread(completion, s, 1000)
    wait_for(lambda: s.get("/_sim/state").json()["running"], 5, "the completion to run")
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(5) == 0  # at once: its 20 s of tokens are not waited for
    wait_for(lambda: running, 5, "the completion's end")
    assert isinstance(running[0], httpx.HTTPError)
    hung = sim("--sim-engine", "llama.cpp").wait_up()
    hung.post("/_sim/fault", {"fault": "engine-dead"})
    hung.proc.send_signal(signal.SIGTERM)
    with pytest.raises(subprocess.TimeoutExpired):
        hung.proc.wait(1.5)  # an observation window: the stop waits on the main loop
    hung.proc.send_signal(signal.SIGTERM)
    assert hung.proc.wait(5) == 1
