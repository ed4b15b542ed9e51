"""What the simulator shows from outside when it plays SGLang, TensorRT-LLM or llama.cpp's llama-server
(``--sim-engine``; vLLM, the default, is server.py's own surface and is not in this module).

The engine thread, the faults, the engine process and the memory behaviour are server.py's; a
surface here only changes what a client, a probe or ``ps`` sees: routes, health answers, metrics
pages and names, the model id, the memory knob, the engine process's name, what SIGTERM does. What
each imitates, and where the engine's public source says so (read mid/late 2026):

SGLang (``--sim-engine sglang``; ``python3 -m sglang.launch_server --model-path M``)
  * ``/health`` = ``/health_generate``: 503 while exiting, else a 1-token generate through the engine;
    200 as soon as any output came back after the probe began (a busy server's batch counts), checked
    once a second, 503 after ``--sim-health-generate-timeout-s`` (SGLANG_HEALTH_CHECK_TIMEOUT, 20);
    ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false`` makes ``/health`` a plain 200. ``/ping`` 200.
    ``/get_model_info``. ``python/sglang/srt/entrypoints/http_server.py`` (``health_generate``,
    ``HEALTH_CHECK_TIMEOUT``, ``get_model_info``).
  * ``/metrics`` only with ``--enable-metrics`` (else 404): the scheduler's gauges
    ``sglang:num_running_reqs`` ``sglang:num_queue_reqs`` ``sglang:token_usage`` are set when a prefill
    batch runs and every ``--decode-log-interval`` (40) decode steps, so they lag and freeze with the
    engine; the tokenizer's counters ``sglang:prompt_tokens_total`` ``sglang:generation_tokens_total``
    ``sglang:cached_tokens_total`` and the histograms ``sglang:time_to_first_token_seconds``
    ``sglang:inter_token_latency_seconds`` ``sglang:e2e_request_latency_seconds``
    ``sglang:queue_time_seconds`` move when a request finishes (``observe_one_finished_request``), not
    per token; the health probe's request is not counted (``log_metrics=False``). Label
    ``model_name``; ``process_*`` from prometheus_client. ``python/sglang/srt/metrics/collector.py``
    (``SchedulerMetricsCollector``, ``TokenizerMetricsCollector``),
    ``python/sglang/srt/managers/scheduler_metrics_mixin.py`` (``log_prefill_stats``, ``log_decode_stats``).
  * model id: ``--served-model-name``, else ``--model-path`` (``--model`` is taken as the same).
    Memory knob ``--mem-fraction-static`` (0.88 when unset, the fallback of
    ``python/sglang/srt/server_args.py``). The engine process is the scheduler, title
    ``sglang::scheduler`` (comm ``sglang::schedul``), ``sglang::scheduler_TP<i>`` per rank with
    ``--sim-workers`` (``python/sglang/srt/managers/scheduler.py``, ``setproctitle``).
  * ``--watchdog-timeout`` (300): a batch in the engine with no forward step for that long kills the
    process tree (the scheduler's ``watchdog_thread``; ``kill_process_tree`` ends its own process
    with SIGKILL, ``python/sglang/srt/utils/common.py``): here the engine core is SIGKILLed, then this
    process, so the exit status is -9. The watchdog lives in the scheduler: a SIGSTOPped scheduler
    (``engine-frozen``) or a stopped process (``frozen``) never fires it.
  * SIGTERM: ``/health`` 503 at once (``gracefully_exit``); the ``sigterm_watchdog``, which looks every
    5 s, then drains the requests in flight with no timeout (looking every 5 s), or skips the drain when
    the last health check failed (``ServerStatus.UnHealthy``), and ends with ``kill_process_tree`` of
    itself: the process dies of SIGKILL (status -9), not exit 0
    (``python/sglang/srt/managers/tokenizer_manager.py``). The simulator keeps accepting requests
    meanwhile.

TensorRT-LLM (``--sim-engine trtllm``; ``trtllm-serve MODEL``)
  * ``/health`` reads only the executor's shutdown state: 200 while the executor is hung or its thread
    died (#13318); 503 only after ``rank-dead`` (#18663). ``/health_generate``: a 1-token chat through
    the engine, 200 or 500, no timeout of its own (it hangs with the engine). ``/version``.
    ``tensorrt_llm/serve/openai_server.py`` (``health``, ``_check_health``, ``health_generate``).
  * ``/metrics``: a JSON list of iteration stats (``iter``, ``iterLatencyMS``, ``numActiveRequests``,
    ``numQueuedRequests``, ``kvCacheStats``...), one per engine iteration with work, kept only with
    ``enable_iter_perf_stats`` (``--sim-iter-stats``, or ``enable_iter_perf_stats: true`` in the
    ``--extra_llm_api_options`` YAML; else ``[]``); a read REMOVES what it returns (one consumer
    only); the simulator keeps the last 1000 (its own bound). ``openai_server.py`` ``get_iteration_stats``.
  * ``/prometheus/metrics`` only with ``return_perf_metrics`` (``--sim-perf-metrics`` or the YAML;
    else 404): ``trtllm_num_requests_running`` ``trtllm_num_requests_waiting``
    ``trtllm_kv_cache_utilization`` ``trtllm_iteration_latency_seconds`` (gauges, set from the
    iteration stats, so only with iteration stats on), ``trtllm_prompt_tokens_total``
    ``trtllm_generation_tokens_total`` ``trtllm_request_prefill_time_seconds`` (at a request's end);
    labels ``model_name="undefined"``, ``engine_type="undefined"`` as the server sets them.
    ``tensorrt_llm/metrics/collector.py`` (``MetricsCollector``), ``openai_server.py`` (``mount_metrics``).
  * model id: ``--served-model-name``, else MODEL's basename when it is an existing directory, else
    MODEL as given (``OpenAIServer.__init__``). Memory knob ``--kv_cache_free_gpu_memory_fraction``
    (0.9; the YAML's ``kv_cache_config.free_gpu_memory_fraction`` too). The executor runs in this
    process for one GPU: no engine process unless ``--sim-engine-process`` (then plain ``python3``
    children, as MPI workers; unverified).
  * SIGTERM: uvicorn's graceful stop: no new connection, requests in flight finish (no timeout),
    exit 0.

llama.cpp ``llama-server`` (``--sim-engine llama.cpp``; light)
  * the port is bound at once; every endpoint answers 503 ``Loading model`` until loaded; then
    ``/health`` ``/v1/health`` 200 ``{"status":"ok"}`` whatever the main loop does.
    ``/metrics`` (``--metrics``, else 501) and ``/slots`` post a task to the main loop and wait for it
    with no timeout: they hang while the engine is hung. ``/props``. Metric names ``llamacpp:*``
    without labels; ``tokens_predicted_total`` moves when a request ends; no KV metric.
    ``tools/server/server.cpp`` (routes, ``signal_handler``), ``tools/server/server-context.cpp`` (the
    metrics and slots handlers, which post a task to the main loop; the metric names).
  * model id: the first ``-a/--alias``, else the ``-m`` file's name; ``-np`` slots (4 here) are the
    engine's ``--max-num-seqs``; ``-c`` is taken. No memory fraction: the simulator's memory behaviour
    uses ``--gpu-memory-utilization``. One process: no engine process unless ``--sim-engine-process``.
  * SIGTERM: stop without draining, exit 0; with the main loop hung the stop hangs (#27388: SIGKILL
    needed), and a second SIGTERM exits 1 ("Received second interrupt").

Faults per engine (server.py's list, where the meaning differs):
  engine-dead     SGLang: /health 503 after the generate timeout, /ping 200; with work in the engine the
                  watchdog kills the process after --watchdog-timeout. TRT-LLM: /health 200,
                  /health_generate hangs. llama.cpp: /health 200, /metrics and /slots hang.
  engine-frozen   SGLang: SIGSTOP of the scheduler: as engine-dead, but no watchdog. TRT-LLM and
  spinning        llama.cpp have no engine process by default: refused (400) as with
                  --no-sim-engine-process. SGLang spinning: as engine-dead, the watchdog fires.
  engine-killed   SGLang: the scheduler failed: SIGQUIT to the launcher, which kills its tree: this
                  process ends by SIGKILL after ``exit_after_s`` (default 0). A scheduler killed from
                  outside is only logged (SGLang's SIGCHLD handler): the server stays up, /health 503.
                  TRT-LLM: the executor thread died (#13318): /health 200, requests hang, no exit.
                  llama.cpp: the main loop aborted (GGML_ABORT): SIGABRT after ``exit_after_s`` (0).
  rank-dead       TRT-LLM only (#18663): /health 503 for ever, completions and /health_generate 500,
                  the process never exits by itself.
  between-steps, slow-health (on /health and /health_generate), stall-endpoints and starved (on this
  engine's GET routes too), wrong-model, leak, frozen, fail-startup: as for vLLM.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, process_collector

if TYPE_CHECKING:
    from .server import Req, Sim

ENGINES = ("vllm", "sglang", "trtllm", "llama.cpp")
SIGTERM_WATCH_S = 5.0  # SGLang's sigterm_watchdog looks this often
PROM = "text/plain; version=0.0.4; charset=utf-8"


def log(msg: str) -> None:
    print(f"INFO {time.strftime('%m-%d %H:%M:%S')} [sim] {msg}", flush=True)


def yaml_options(path: str | None) -> dict[str, Any]:
    """The few keys of a trtllm-serve --extra_llm_api_options file the simulator reads: ``key: value``
    lines, one nesting level (``kv_cache_config:`` then indented keys). Enough for the flat files the
    playbooks use; no YAML library needed."""
    out: dict[str, Any] = {}
    if not path:
        return out
    section: dict[str, Any] | None = None
    for raw in Path(path).read_text().splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip() or ":" not in line:
            continue
        key, value = (s.strip() for s in line.split(":", 1))
        if raw[:1] in (" ", "\t") and section is not None:
            section[key] = _scalar(value)
        elif not value:
            section = out.setdefault(key, {})
        else:
            section = None
            out[key] = _scalar(value)
    return out


def _scalar(value: str) -> Any:
    low = value.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return float(value) if "." in value else int(value)
    except ValueError:
        return value.strip("'\"")


def resolve_args(args) -> None:
    """Fill in what depends on --sim-engine: the model, the memory fraction (the simulator's memory
    behaviour reads args.gpu_memory_utilization), the engine process, the slots."""
    engine = args.sim_engine
    if args.sim_engine_process is None:
        args.sim_engine_process = engine in ("vllm", "sglang")
    if engine == "sglang" and args.mem_fraction_static is not None:
        args.gpu_memory_utilization = args.mem_fraction_static
    elif engine == "sglang":
        args.gpu_memory_utilization = 0.88
    if engine == "trtllm":
        opts = yaml_options(args.extra_llm_api_options)
        args.trtllm_options = opts
        kv = opts.get("kv_cache_config")
        fraction = args.kv_cache_free_gpu_memory_fraction
        if fraction is None and isinstance(kv, dict):
            fraction = kv.get("free_gpu_memory_fraction")
        args.gpu_memory_utilization = float(fraction if fraction is not None else 0.9)
        args.sim_iter_stats = args.sim_iter_stats or bool(opts.get("enable_iter_perf_stats"))
        args.sim_perf_metrics = args.sim_perf_metrics or bool(opts.get("return_perf_metrics"))
        positional = args.model_arg or (args.serve if args.serve not in (None, "serve") else None)
        if positional:
            args.model = positional
    if engine == "llama.cpp":
        args.max_num_seqs = args.parallel


def model_id(args) -> str:
    engine = args.sim_engine
    if engine == "trtllm" and not args.served_model_name:
        path = Path(args.model)
        return path.name if path.is_dir() else args.model
    if engine == "llama.cpp":
        aliases = [a for a in (args.alias or "").split(",") if a]
        return aliases[0] if aliases else Path(args.model).name
    return args.served_model_name or args.model


def process_names(args) -> tuple[str, str]:
    """The engine core's name and its workers' (with {i}), as this engine names them."""
    if args.sim_engine == "sglang":
        return ("sglang::scheduler_TP0" if args.sim_workers else "sglang::scheduler"), "sglang::scheduler_TP{n}"
    if args.sim_engine in ("trtllm", "llama.cpp"):
        return "python3", "python3"
    return "VLLM::EngineCore", "VLLM::Worker_TP{i}"


def memory_error(args, free: float, total: float, desired: float) -> str:
    gib = 2**30
    if args.sim_engine == "llama.cpp":
        return (
            f"ggml_backend_cuda_buffer_type_alloc_buffer: allocating {desired / 2**20:.2f} MiB on device 0: "
            f"cudaMalloc failed: out of memory ({free / gib:.2f} GiB free of {total / gib:.2f} GiB)"
        )
    knob = "--mem-fraction-static" if args.sim_engine == "sglang" else "free_gpu_memory_fraction"
    return (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {desired / gib:.2f} GiB "
        f"({knob} {args.gpu_memory_utilization} of {total / gib:.2f} GiB); {free / gib:.2f} GiB free."
    )


class Surface:
    """One engine's outside. GET routes (``get``: True when answered), the engine thread's step hook
    (``on_step``, with the engine's lock held), faults it reads its own way, and its stop."""

    name = ""
    owned_by = ""
    stalled_paths: tuple[str, ...] = ()
    bind_before_load = False

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.args = sim.args
        self.exiting = False
        self.health_reqs: set[str] = set()  # probes' requests: not counted in the metrics

    # -- hooks -------------------------------------------------------------------------------------
    def get(self, h, path: str) -> bool:
        raise NotImplementedError

    def refuse(self, h) -> bool:
        """Answer (and True) instead of any request, e.g. while loading."""
        return False

    def on_step(self) -> None:
        pass

    def set_fault(self, spec: dict) -> bool:
        """Handle a fault this engine reads its own way: True when handled."""
        return False

    def clear(self) -> None:
        """/_sim/clear: this engine's own fault state goes too."""

    def on_core_death(self) -> None:
        log("Engine core proc died unexpectedly")
        self.sim.set_fault({"fault": "engine-killed"})

    def on_sigterm(self, server) -> None:
        threading.Thread(target=server.shutdown).start()

    def after_serve(self, server) -> None:
        pass

    def start(self) -> None:
        pass

    # -- shared helpers ----------------------------------------------------------------------------
    def not_found(self, h, path: str, body: dict | None = None) -> bool:
        """404 for any route this engine lacks (the simulator's own /_sim/ routes go on to server.py)."""
        if path.startswith("/_sim/"):
            return False
        h._json(404, body or {"detail": "Not Found"})
        return True

    def models_json(self, extra: dict | None = None) -> dict:
        sim = self.sim
        fault = sim.fault
        served = fault.get("model", "other-model") if fault.get("fault") == "wrong-model" else sim.model
        return {
            "object": "list",
            "data": [
                {
                    "id": served,
                    "object": "model",
                    "created": int(sim.started_at),
                    "owned_by": self.owned_by,
                    **(extra or {}),
                }
            ],
        }

    def slow_health(self) -> None:
        if self.sim.fault.get("fault") == "slow-health" and self.sim.engine.running:
            time.sleep(float(self.sim.fault.get("delay_s", 5.0)))

    def generate_probe(self, max_wait_s: float | None) -> Req | None:
        """A 1-token request through the engine; the request, None when it failed (or MAX_WAIT_S passed)."""
        from .server import Req

        req = Req(prompt_tokens=1, max_tokens=1)
        self.health_reqs.add(req.id)
        self.sim.engine.submit(req)
        end = None if max_wait_s is None else time.monotonic() + max_wait_s
        with req.cond:
            while not req.done and req.failed is None:
                left = 1.0 if end is None else min(1.0, end - time.monotonic())
                if left <= 0:
                    break
                req.cond.wait(left)
        return req if req.done else None

    def in_flight(self) -> int:
        """Clients' requests in the engine, and answers being written."""
        e = self.sim.engine
        with e.lock:
            n = sum(1 for r in e.running + e.waiting if not r.synthetic and r.id not in self.health_reqs)
        return n + self.sim.answering

    def drain(self) -> None:
        """Wait, with no timeout, for every request in flight to finish."""
        while self.in_flight():
            time.sleep(0.05)

    def engine_has_work(self) -> bool:
        """A batch in the engine (the health probes' requests aside)."""
        e = self.sim.engine
        reqs = (r for r in e.running + e.waiting if r.id not in self.health_reqs)
        return e.prefill is not None or bool(e.synthetic_target) or any(True for _ in reqs)


# ------------------------------------------------------------------------------------------------
class SGLang(Surface):
    name = "sglang"
    owned_by = "sglang"
    stalled_paths = ("/health", "/health_generate", "/ping", "/v1/models", "/metrics", "/get_model_info")
    TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
    LATENCY_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800)
    ITL_BUCKETS = (
        0.002,
        0.004,
        0.006,
        0.008,
        0.01,
        0.015,
        0.02,
        0.025,
        0.03,
        0.035,
        0.04,
        0.06,
        0.08,
        0.1,
        0.2,
        0.4,
        0.6,
        0.8,
        1.0,
        2.0,
        4.0,
        6.0,
        8.0,
    )

    def __init__(self, sim: Sim) -> None:
        super().__init__(sim)
        self.registry = CollectorRegistry()
        process_collector.ProcessCollector(registry=self.registry)
        r, lab = self.registry, ["model_name"]
        self.labels = {"model_name": sim.model}
        self.running = Gauge("sglang:num_running_reqs", "The number of running requests.", lab, registry=r)
        self.queue = Gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", lab, registry=r)
        self.usage = Gauge("sglang:token_usage", "The token usage.", lab, registry=r)
        self.prompt = Counter("sglang:prompt_tokens", "Number of prefill tokens processed.", lab, registry=r)
        self.gen = Counter("sglang:generation_tokens", "Number of generation tokens processed.", lab, registry=r)
        self.cached = Counter("sglang:cached_tokens", "Number of cached prompt tokens.", lab, registry=r)
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            lab,
            buckets=self.TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            lab,
            buckets=self.ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            lab,
            buckets=self.LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "sglang:queue_time_seconds",
            "Histogram of queueing time in seconds.",
            lab,
            buckets=self.LATENCY_BUCKETS,
            registry=r,
        )
        for m in (
            self.running,
            self.queue,
            self.usage,
            self.prompt,
            self.gen,
            self.cached,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue_time,
        ):
            m.labels(**self.labels)
        self.decode_ct = 0
        self.forward_ct = 0  # engine steps, for the watchdog
        self.last_output_at = 0.0  # time.monotonic() of the last step that produced tokens
        self.first_token_at: dict[str, float] = {}
        self.plain_health = os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").lower() in ("false", "0")
        self.killed_from_outside = False
        self.unhealthy = False

    def on_step(self) -> None:
        e = self.sim.engine
        now = time.monotonic()
        self.forward_ct += 1
        if e.running or e.last_finished:  # tokens came out (a 1-token request finishes in its step)
            self.last_output_at = now
        for r in e.last_prefilled:
            self.first_token_at[r.id] = now
            if r.id not in self.health_reqs:
                self.ttft.labels(**self.labels).observe(now - r.submitted_at)
                self.queue_time.labels(**self.labels).observe(
                    max(0.0, now - r.submitted_at - 1.0 / self.args.tokens_per_s)
                )
        for r in e.last_finished:
            first = self.first_token_at.pop(r.id, now)
            if r.id in self.health_reqs:
                continue
            self.prompt.labels(**self.labels).inc(r.prompt_tokens)
            self.gen.labels(**self.labels).inc(r.generated)
            self.cached.labels(**self.labels).inc(r.cached_tokens)
            self.e2e.labels(**self.labels).observe(now - r.submitted_at)
            if r.generated > 1:
                self.itl.labels(**self.labels).observe((now - first) / (r.generated - 1))
        decoding = bool(e.running) and not e.last_prefilled
        if decoding:
            self.decode_ct += 1
        if e.last_prefilled or (decoding and self.decode_ct % self.args.decode_log_interval == 0):
            used = sum(r.prompt_tokens + r.generated for r in e.running)
            self.running.labels(**self.labels).set(len(e.running))
            self.queue.labels(**self.labels).set(len(e.waiting))
            self.usage.labels(**self.labels).set(min(1.0, used / e.kv_capacity_tokens))

    def get(self, h, path: str) -> bool:
        sim = self.sim
        if path in ("/health", "/health_generate"):
            if self.exiting or (sim.fault.get("fault") == "engine-killed" and not self.killed_from_outside):
                h._send(503, b"")
            elif path == "/health" and self.plain_health:
                self.slow_health()
                h._send(200, b"")
            else:
                self.slow_health()
                h._send(200 if self.health_generate() else 503, b"")
            return True
        if path == "/ping":
            h._send(200, b"")
            return True
        if path == "/v1/models":
            h._json(200, self.models_json({"root": self.args.model, "max_model_len": 4096}))
            return True
        if path == "/get_model_info":
            h._json(200, {"model_path": self.args.model, "tokenizer_path": self.args.model, "is_generation": True})
            return True
        if path == "/metrics" and self.args.enable_metrics:
            h._send(200, generate_latest(self.registry), PROM)
            return True
        return self.not_found(h, path)

    def health_generate(self) -> bool:
        """As health_generate: any output after the probe began, looked for once a second."""
        from .server import Req

        timeout = self.args.sim_health_generate_timeout_s
        tic = time.monotonic()
        req = Req(prompt_tokens=1, max_tokens=1)
        self.health_reqs.add(req.id)
        self.sim.engine.submit(req)
        try:
            while time.monotonic() < tic + timeout:
                time.sleep(min(1.0, max(0.0, tic + timeout - time.monotonic())))
                if self.last_output_at > tic:
                    self.unhealthy = False
                    return True
            log(f"Health check failed. Server couldn't get a response from detokenizer for last {timeout:g} s.")
            self.unhealthy = True  # ServerStatus.UnHealthy: a SIGTERM now exits without draining
            return False
        finally:
            self.sim.engine.abort(req)
            self.health_reqs.discard(req.id)

    def set_fault(self, spec: dict) -> bool:
        if spec.get("fault") != "engine-killed" or self.killed_from_outside:
            return False
        after = spec.get("exit_after_s", 0.0)
        log("Received sigquit from a child process. It usually means the child failed.")
        self.sim.engine.killed = True
        if after is not None:
            threading.Timer(float(after), self.kill_tree).start()
        return True

    def on_core_death(self) -> None:
        # SGLang's SIGCHLD handler only logs: the server stays up, its health probes find no output
        log("Child process unexpectedly failed with exitcode=-9.")
        self.killed_from_outside = True
        self.sim.engine.dead = True

    def kill_tree(self) -> None:
        if self.sim.core is not None:
            self.sim.core.kill(signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def start(self) -> None:
        threading.Thread(target=self.watchdog, daemon=True, name="watchdog").start()
        threading.Thread(target=self.sigterm_watchdog, daemon=True, name="sigterm_watchdog").start()

    def sigterm_watchdog(self) -> None:
        """As the tokenizer manager's: looks every 5 s; once SIGTERM came, drains (looking every 5 s,
        no timeout; not when the last health check failed), then kill_process_tree of itself: SIGKILL."""
        while not self.exiting:
            time.sleep(SIGTERM_WATCH_S)
        while not self.unhealthy:
            left = self.in_flight()
            log(f"Gracefully exiting... remaining number of requests {left}")
            if not left:
                break
            time.sleep(SIGTERM_WATCH_S)
        if self.unhealthy:
            log("Signal SIGTERM received while health check failed. Force exiting.")
        self.kill_tree()

    def watchdog(self) -> None:
        """The scheduler's watchdog: a batch with no forward step for --watchdog-timeout kills the tree.
        It runs in the scheduler: a SIGSTOPped one (engine-frozen) stops it too."""
        timeout = self.args.watchdog_timeout
        last_ct, since = self.forward_ct, time.monotonic()
        while True:
            time.sleep(min(1.0, timeout / 10))
            now = time.monotonic()
            if self.sim.fault.get("fault") in ("engine-frozen", "frozen") or self.forward_ct != last_ct:
                last_ct, since = self.forward_ct, now
            elif not self.engine_has_work():
                since = now
            elif now - since > timeout:
                log(
                    f"Scheduler watchdog timeout (watchdog_timeout={timeout:g}, no forward progress); "
                    "killing the process tree"
                )
                self.kill_tree()

    def on_sigterm(self, server) -> None:
        self.exiting = True  # gracefully_exit: /health 503 at once; sigterm_watchdog does the rest
        log("SIGTERM received: /health answers 503; draining the requests in flight (no timeout)")


# ------------------------------------------------------------------------------------------------
class TrtLlm(Surface):
    name = "trtllm"
    owned_by = "tensorrt_llm"
    stalled_paths = ("/health", "/health_generate", "/version", "/v1/models", "/metrics", "/prometheus/metrics")
    PREFILL_BUCKETS = (
        0.001,
        0.005,
        0.01,
        0.025,
        0.05,
        0.1,
        0.25,
        0.5,
        1.0,
        2.5,
        5.0,
        10.0,
        20.0,
        40.0,
        80.0,
        160.0,
        640.0,
        2560.0,
    )
    MAX_ITER_STATS = 1000
    TOKENS_PER_BLOCK = 32

    def __init__(self, sim: Sim) -> None:
        super().__init__(sim)
        self.stats: deque[dict] = deque(maxlen=self.MAX_ITER_STATS)
        self.iter = 0
        self.last_iter_at = time.monotonic()
        self.rank_dead = False
        self.registry = CollectorRegistry()
        r = self.registry
        self.labels = {"model_name": "undefined", "engine_type": "undefined"}
        lab = list(self.labels)
        self.running = Gauge("trtllm_num_requests_running", "Number of active requests", lab, registry=r)
        self.waiting = Gauge("trtllm_num_requests_waiting", "Number of queued requests", lab, registry=r)
        self.kv = Gauge("trtllm_kv_cache_utilization", "KV cache utilization", lab, registry=r)
        self.iter_latency = Gauge("trtllm_iteration_latency_seconds", "Iteration latency in seconds", lab, registry=r)
        self.prompt = Counter(
            "trtllm_prompt_tokens", "Cumulative number of prompt (input) tokens processed.", lab, registry=r
        )
        self.gen = Counter(
            "trtllm_generation_tokens", "Cumulative number of generation (output) tokens produced.", lab, registry=r
        )
        self.prefill = Histogram(
            "trtllm_request_prefill_time_seconds",
            "Histogram of prefill (context) phase duration in seconds (first_token_time - first_scheduled_time).",
            lab,
            buckets=self.PREFILL_BUCKETS,
            registry=r,
        )
        for m in (self.running, self.waiting, self.kv, self.iter_latency, self.prompt, self.gen, self.prefill):
            m.labels(**self.labels)
        self.lock = threading.Lock()

    def on_step(self) -> None:
        e = self.sim.engine
        now = time.monotonic()
        for r in e.last_finished:
            if r.id not in self.health_reqs:
                self.prompt.labels(**self.labels).inc(r.prompt_tokens)
                self.gen.labels(**self.labels).inc(r.generated)
                self.prefill.labels(**self.labels).observe(1.0 / self.args.tokens_per_s)
        if not (e.running or e.last_finished or e.prefill is not None):
            self.last_iter_at = now
            return  # an idle executor waits on its request queue: no iteration, no stats
        latency_s, self.last_iter_at = now - self.last_iter_at, now
        self.iter += 1
        if not self.args.sim_iter_stats:
            return
        used_tokens = sum(r.prompt_tokens + r.generated for r in e.running)
        max_blocks = e.kv_capacity_tokens // self.TOKENS_PER_BLOCK
        used = min(max_blocks, -(-used_tokens // self.TOKENS_PER_BLOCK))
        entry = {
            "iter": self.iter,
            "iterLatencyMS": round(latency_s * 1000, 3),
            "numActiveRequests": len(e.running),
            "numQueuedRequests": len(e.waiting),
            "numCompletedRequests": len(e.last_finished),
            "maxNumActiveRequests": self.args.max_num_seqs,
            "timestamp": time.strftime("%m-%d-%Y %H:%M:%S"),
            "gpuMemUsage": 0,
            "cpuMemUsage": 0,
            "pinnedMemUsage": 0,
            "kvCacheStats": {
                "maxNumBlocks": max_blocks,
                "freeNumBlocks": max_blocks - used,
                "usedNumBlocks": used,
                "tokensPerBlock": self.TOKENS_PER_BLOCK,
                "allocTotalBlocks": used,
                "allocNewBlocks": len(e.last_prefilled),
                "reusedBlocks": 0,
                "missedBlocks": 0,
                "cacheHitRate": 0.0,
            },
        }
        with self.lock:
            self.stats.append(entry)
        self.running.labels(**self.labels).set(len(e.running))
        self.waiting.labels(**self.labels).set(len(e.waiting))
        self.kv.labels(**self.labels).set(used / max_blocks if max_blocks else 0.0)
        self.iter_latency.labels(**self.labels).set(latency_s)

    def get(self, h, path: str) -> bool:
        if path == "/health":
            self.slow_health()
            if self.rank_dead or self.exiting:
                h._send(503, b"LLM is unavailable. Please check the server logs for more details.", "text/plain")
            else:
                h._send(200, b"")
            return True
        if path == "/health_generate":
            self.slow_health()
            ok = not self.rank_dead and self.generate_probe(None) is not None
            h._send(
                *((200, b"Generation health check OK") if ok else (500, b"Generation health check failed")),
                "text/plain",
            )
            return True
        if path == "/version":
            h._json(200, {"version": "1.3.0rc13+sim"})
            return True
        if path == "/v1/models":
            h._json(200, self.models_json())
            return True
        if path == "/metrics":
            with self.lock:
                taken = list(self.stats)
                self.stats.clear()
            h._json(200, taken)
            return True
        if path.startswith("/prometheus/metrics") and self.args.sim_perf_metrics:
            h._send(200, generate_latest(self.registry), PROM)
            return True
        return self.not_found(h, path)

    def set_fault(self, spec: dict) -> bool:
        name = spec.get("fault")
        if name == "rank-dead":
            log("Executor worker rank died: the executor is shut down; the server keeps running (#18663)")
            self.rank_dead = True
            self.sim.engine.killed = True
            self.sim.engine.fail_all("Executor worker returned error")
            return True
        if name == "engine-killed":
            log("Executor thread died (#13318): /health still reads no shutdown")
            self.sim.engine.dead = True
            return True
        return False

    def clear(self) -> None:
        self.rank_dead = False

    def on_sigterm(self, server) -> None:
        if self.exiting:
            return
        self.exiting = True
        log("Shutting down (uvicorn): no new connection, waiting for requests in flight")
        threading.Thread(target=server.shutdown, daemon=True).start()

    def after_serve(self, server) -> None:
        server.server_close()
        self.drain()


# ------------------------------------------------------------------------------------------------
class LlamaCpp(Surface):
    name = "llama.cpp"
    owned_by = "llamacpp"
    stalled_paths = ("/health", "/v1/health", "/v1/models", "/models", "/metrics", "/slots", "/props")
    bind_before_load = True
    LOADING: ClassVar[dict] = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}

    def __init__(self, sim: Sim) -> None:
        super().__init__(sim)
        self.loaded = False
        self.tasks: list[tuple[str, threading.Event, list]] = []
        self.n_prompt_tokens = 0
        self.t_prompt_s = 0.0
        self.n_predicted = 0
        self.t_predicted_s = 0.0
        self.n_decode = 0
        self.n_busy_slots = 0
        self.first_token_at: dict[str, float] = {}
        self.slot_of: dict[str, int] = {}
        self.terms = 0

    def start(self) -> None:
        self.loaded = True
        log("main: model loaded; server is listening")

    def refuse(self, h) -> bool:
        if self.loaded or h.path.startswith("/_sim/"):
            return False
        h._json(503, self.LOADING)
        return True

    def on_step(self) -> None:
        e = self.sim.engine
        now = time.monotonic()
        period = 1.0 / self.args.tokens_per_s
        for r in e.last_prefilled:
            self.first_token_at[r.id] = now
            self.n_prompt_tokens += r.prompt_tokens
            self.t_prompt_s += period
        if e.running:
            self.n_decode += 1
            self.n_busy_slots += len(e.running)
        for r in e.last_finished:
            self.n_predicted += r.generated
            self.t_predicted_s += now - self.first_token_at.pop(r.id, now)
        free = [i for i in range(self.args.parallel) if i not in self.slot_of.values()]
        live = {r.id for r in e.running}
        self.slot_of = {k: v for k, v in self.slot_of.items() if k in live}
        for r in e.running:
            if r.id not in self.slot_of and free:
                self.slot_of[r.id] = free.pop(0)
        tasks, self.tasks = self.tasks, []
        for kind, done, out in tasks:
            out.append(self.metrics_text() if kind == "metrics" else self.slots_json())
            done.set()

    def queue_task(self, kind: str) -> Any:
        """Post a task to the main loop and wait for its answer, with no timeout (a hung loop: for ever)."""
        done, out = threading.Event(), []
        with self.sim.engine.lock:
            self.tasks.append((kind, done, out))
        done.wait()
        return out[0]

    def metrics_text(self) -> bytes:
        e = self.sim.engine
        rows = [
            ("counter", "prompt_tokens_total", "Number of prompt tokens processed.", self.n_prompt_tokens),
            ("counter", "prompt_seconds_total", "Prompt process time", self.t_prompt_s),
            ("counter", "tokens_predicted_total", "Number of generation tokens processed.", self.n_predicted),
            ("counter", "tokens_predicted_seconds_total", "Predict process time", self.t_predicted_s),
            ("counter", "n_decode_total", "Total number of llama_decode() calls", self.n_decode),
            (
                "counter",
                "n_busy_slots_per_decode",
                "Average number of busy slots per llama_decode() call",
                self.n_busy_slots / max(1, self.n_decode),
            ),
            (
                "gauge",
                "prompt_tokens_seconds",
                "Average prompt throughput in tokens/s.",
                self.n_prompt_tokens / self.t_prompt_s if self.t_prompt_s else 0.0,
            ),
            (
                "gauge",
                "predicted_tokens_seconds",
                "Average generation throughput in tokens/s.",
                self.n_predicted / self.t_predicted_s if self.t_predicted_s else 0.0,
            ),
            ("gauge", "requests_processing", "Number of requests processing.", len(e.running)),
            ("gauge", "requests_deferred", "Number of requests deferred.", len(e.waiting)),
        ]
        lines = []
        for kind, name, help_, value in rows:
            lines += [f"# HELP llamacpp:{name} {help_}", f"# TYPE llamacpp:{name} {kind}", f"llamacpp:{name} {value}"]
        return ("\n".join(lines) + "\n").encode()

    def slots_json(self) -> list[dict]:
        e = self.sim.engine
        by_slot = {self.slot_of[r.id]: r for r in e.running if r.id in self.slot_of}
        out = []
        for i in range(self.args.parallel):
            r = by_slot.get(i)
            out.append(
                {
                    "id": i,
                    "id_task": -1 if r is None else int(r.id.rsplit("-", 1)[1]),
                    "n_ctx": self.args.ctx,
                    "is_processing": r is not None,
                    "next_token": [
                        {
                            "has_next_token": r is not None,
                            "n_remain": -1 if r is None else r.max_tokens - r.generated,
                            "n_decoded": 0 if r is None else r.generated,
                        }
                    ],
                }
            )
        return out

    def get(self, h, path: str) -> bool:
        if path in ("/health", "/v1/health"):
            h._json(200, {"status": "ok"})  # the main loop is not asked
            return True
        if path in ("/v1/models", "/models"):
            body = self.models_json({"meta": {"n_ctx_train": self.args.ctx}})
            served = body["data"][0]["id"]
            body["models"] = [{"name": served, "model": served, "type": "model", "capabilities": ["completion"]}]
            h._json(200, body)
            return True
        if path == "/props":
            h._json(
                200,
                {
                    "total_slots": self.args.parallel,
                    "model_alias": self.sim.model,
                    "model_path": self.args.model,
                    "is_sleeping": False,
                },
            )
            return True
        if path == "/metrics":
            if not self.args.metrics:
                h._json(
                    501,
                    {
                        "error": {
                            "code": 501,
                            "message": "This server does not support metrics endpoint. Start it with `--metrics`",
                            "type": "not_supported_error",
                        }
                    },
                )
            else:
                h._send(200, self.queue_task("metrics"), PROM)
            return True
        if path == "/slots":
            h._json(200, self.queue_task("slots"))
            return True
        return self.not_found(h, path, {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}})

    def set_fault(self, spec: dict) -> bool:
        if spec.get("fault") != "engine-killed":
            return False
        log("GGML_ASSERT failed: the main loop aborts")
        self.sim.engine.killed = True
        after = spec.get("exit_after_s", 0.0)
        if after is not None:
            threading.Timer(float(after), os.abort).start()
        return True

    def on_sigterm(self, server) -> None:
        self.terms += 1
        if self.terms > 1:
            print("Received second interrupt, terminating immediately.", flush=True)
            os._exit(1)
        if self.sim.engine_hung() or self.sim.engine.killed:
            log("SIGTERM: shutting down; the main loop does not return (a second SIGTERM ends it)")
            return
        threading.Thread(target=server.shutdown).start()


SURFACES: dict[str, type[Surface]] = {"sglang": SGLang, "trtllm": TrtLlm, "llama.cpp": LlamaCpp}


def make(sim: Sim) -> Surface | None:
    cls = SURFACES.get(sim.args.sim_engine)
    return cls(sim) if cls else None


def banner(args) -> str:
    return {
        "sglang": f"SGLang server (sim); model_path={args.model} mem_fraction_static={args.gpu_memory_utilization}",
        "trtllm": f"trtllm-serve (sim); model={args.model} "
        f"kv_cache_free_gpu_memory_fraction={args.gpu_memory_utilization}",
        "llama.cpp": f"llama-server (sim); model={args.model} n_parallel={args.parallel}",
    }[args.sim_engine] + (f" pid={os.getpid()}")
