"""A replica simulator for four engines: vLLM (the default, this module's own surface, described below),
SGLang, TensorRT-LLM's trtllm-serve and llama.cpp's llama-server (``--sim-engine``): the same engine
thread, faults, engine process and memory behaviour, seen from outside as that engine (its routes,
health semantics, metrics, model id, memory knob, process names, stop; engines.py says what and where
each engine's source says so, and what a fault means there). The package keeps the name vllm_sim.

What it imitates (observed on a real vLLM 0.32 server, see shared/BRIEF.md):

* startup: connection refused until the "model" has loaded (``--load-time-s``), then 200 at once;
  vLLM's startup memory check fails the start when ``--gpu-memory-utilization`` x total memory is
  more than the free memory (exit status 1, vLLM's own message).
* memory, as on GB10 where the fraction is of the memory CPU and GPU share (``--sim-total-memory-bytes``
  as the device's size): ``--sim-allocate`` holds ``--gpu-memory-utilization`` x total once loaded;
  ``--sim-load-memory`` takes it in steps over ``--load-time-s``, before the port is bound, every page
  touched, as a real start's memory grows while it loads (the start guard's case).
* an engine thread runs iterations: it admits waiting requests (up to ``--max-num-seqs``), counts
  a request's prompt tokens when its prefill completes, then emits one token per running request
  per iteration; the vllm: gauges are updated by the engine, so they freeze when it does.
* vLLM V1's process shape (engine_core.py): the API server (this, the unit's main process) forks a
  child ``VLLM::EngineCore`` (its comm: ``VLLM::EngineCor``) at start, as vLLM starts its EngineCore
  before the model loads; with ``--sim-workers N`` that forks ``VLLM::Worker_TP<i>`` processes, as
  tensor parallelism's workers. All state stays in the engine thread here; each iteration that has
  work is a round trip to the child, which burns its CPU: ``--sim-step-cpu-s`` (0.002) per step with
  running requests, ``--sim-prefill-busy`` (0.2) of a core all through a long prefill (in ~20 ms
  slices), while every counter stands still. With no work nothing is sent and the child blocks in
  recv, as vLLM's EngineCore blocks on its input queue: a replica's CPU outside its API server is
  then a real engine's, none while it idles, is frozen or dead, some whenever it works. The children
  die with the API server (PR_SET_PDEATHSIG, even after a SIGKILL of it; EOF on their socket) and
  ignore SIGTERM (a unit's stop signals the whole cgroup: draining or hanging is the API server's
  choice). A killed EngineCore fails the API server as vLLM's does (its monitor sees the process
  die): ``engine-killed`` below. ``/_sim/state`` lists their pids (``engine_pids``).
  ``--no-sim-engine-process``: the old single process, no CPU burnt.
* a prefix cache, as vLLM's automatic prefix caching: a prompt's tokens (its words) in blocks of 16,
  each block keyed by everything before it and cached once its prefill is done; a prompt's leading
  blocks already cached are hits, the rest take ``--sim-prefill-s-per-token`` each before its first
  token (0, the default: one engine step); least recently used blocks go past
  ``--sim-prefix-cache-blocks``; the cache is the process's, so a restart empties it. Reported as
  vLLM does: ``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total`` (tokens),
  ``vllm:time_to_first_token_seconds``.
* ``/health`` ``/ping`` ``/version`` ``/v1/models`` ``/metrics`` ``/v1/completions``
  ``/v1/chat/completions`` (both streaming with ``"stream": true``).

Faults, at start (``--fault NAME``, with ``--fault-after-s``) or at run time
(``POST /_sim/fault {"fault": NAME, ...}``, ``POST /_sim/clear``):

  engine-dead      engine stops iterating; /health 200, metrics frozen, requests hang; nothing is
                   sent to the engine core, which then uses no CPU
  engine-frozen    SIGSTOP of the engine core and its workers (what ``kill -STOP`` on VLLM::EngineCore
                   does): the step in flight, or the next, never returns, so the engine thread
                   blocks: counters and gauges freeze, /health 200, new requests are accepted and
                   never answered; the engine's CPU is exactly 0. ``/_sim/clear`` SIGCONTs them
  spinning         the engine core (its workers, with ``--sim-workers``) burns ``busy`` (default 0.5)
                   of a core in ~20 ms slices and answers no step: nothing moves, /health 200,
                   requests hang, yet the engine uses CPU (a GPU engine spinning on a wedged
                   kernel). ``/_sim/clear`` ends it and the held step completes
  between-steps    the engine freezes at the first step with nothing running (the load it was
                   serving finishes first): /metrics shows 0 running, 0 waiting and frozen
                   counters, /health 200, and every new request is accepted and never answered:
                   its connection stays open; a plain completion gets no byte; a streaming one
                   gets its 200 status line and headers at once and then no event, as from vLLM
                   (its handler returns the StreamingResponse before the engine has the request,
                   and Starlette/uvicorn write the headers before the first chunk); once frozen,
                   the engine core is sent nothing and uses no CPU
  engine-killed    /health 503, completions 500; exits with status 0 after ``exit_after_s``
                   (default 4 s, as vLLM's API server does); ``exit_after_s: null`` stays up
                   (VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1)
  slow-health      /health takes ``delay_s`` (default 5 s) while requests run; tokens still flow
  stall-endpoints  the API server's event loop is starved (measured on vLLM 0.32, 2 cores, 8 streams
                   through nginx: 11 s): for ``stall_s`` (default 11 s) from the injection, every
                   request to /health /ping /version /v1/models /metrics is held unanswered (the
                   request is read, no byte of answer) and answered normally when the stall ends,
                   if its client still waits; streams in flight keep their pace, new completions
                   are served as usual, the engine keeps iterating. The fault then clears itself
  starved          a saturated box (measured: a real vLLM 0.32 on 2 cores beside 16 streams of its
                   peer): every answer (/health /ping /version /v1/models /metrics, completions and
                   canaries too) is delayed by a random ``min_s``-``max_s`` (default 1-8 s) before
                   it is begun, while the engine keeps iterating and streams already running keep
                   their pace; with ``seed`` each path draws from its own repeatable sequence, so
                   the Nth completion's delay is the same whenever the probes beside it come (the
                   engine core keeps using CPU for the steps it keeps running); each delayed answer
                   uses 5 % of a core while it waits, as a starved process waits on the run queue
                   (runnable, its wait counted by the kernel), not asleep as a frozen one
  wrong-model      /v1/models lists ``model`` (default "other-model") instead
  leak             memory that outlives the process, as GB10's driver keeps a killed engine's
                   (NVIDIA/open-gpu-kernel-modules #1358): the reservation (``--sim-allocate``), or
                   ``bytes``, moves into a file on a tmpfs (``dir``, default /dev/shm:
                   ``DIR/vllm-sim-held-PORT``), mapped into the process, charged to the same cgroup
                   and never freed when the process exits; it keeps serving
  frozen           the API server stops itself with SIGSTOP (what ``kill -STOP`` on it does); its
                   engine core is sent nothing more and uses no CPU
  fail-startup     exit 1 before serving, with an error (start-time only)

With ``--hang-on-sigterm``, SIGTERM does not end a process whose engine is dead, frozen or spinning,
or that was frozen (systemd sends SIGCONT with it): the stop hangs as vLLM's does, until SIGKILL. Without
it, SIGTERM aborts every request in flight (vLLM's default), unless ``--shutdown-timeout N``: then
no new connection is accepted and the running requests get up to N s to finish (vLLM >= 0.32).

``POST /_sim/load {"streams": N, "max_tokens": M, "prompt_tokens": P}`` keeps N synthetic
requests in the engine (they count like real ones) until ``{"streams": 0}``.

``POST /_sim/prefill {"prompt_tokens": 7185, "chunk_tokens": 512, "chunk_s": 2.7, "coschedule": false}``
starts one long prompt, prefilled in chunks as vLLM 0.32 does (measured: a 7,185-token prompt in
30 s): while it runs, every token counter stands still and ``kv_cache_usage_perc`` rises once per
chunk, while the engine core burns ``--sim-prefill-busy`` of a core. By default the prompt takes the
whole per-step token budget, so every other request (a canary too) waits behind it;
``coschedule: true`` is ``--long-prefill-token-threshold`` below ``--max-num-batched-tokens``: other
requests run beside it. A ``chunk_s`` longer than guardian's windows is the case its stall window
must be sized for.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    gc_collector,
    generate_latest,
    platform_collector,
    process_collector,
)
from prometheus_client.parser import text_string_to_metric_families

from . import engine_core, engines

VERSION = "0.32.0+sim"
_ids = itertools.count(1)


@dataclass
class Req:
    prompt_tokens: int
    max_tokens: int
    synthetic: bool = False
    stream: bool = False
    words: tuple[str, ...] = ()  # the prompt's tokens (its words), for the prefix cache
    prefilled: bool = False
    cached_tokens: int = 0  # its leading tokens found in the prefix cache
    ready_at: float | None = None  # its prefill of the uncached tokens ends (--sim-prefill-s-per-token)
    submitted_at: float = field(default_factory=time.monotonic)
    generated: int = 0
    done: bool = False
    failed: str | None = None
    id: str = field(default_factory=lambda: f"cmpl-sim-{next(_ids)}")
    cond: threading.Condition = field(default_factory=threading.Condition)


class Metrics:
    def __init__(self, model: str, gpu_util: float, registry: CollectorRegistry) -> None:
        lab = ["engine", "model_name"]
        self.labels = {"engine": "0", "model_name": model}
        r = registry
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", lab,
                             registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lab,
                             registry=r)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lab, registry=r)
        self.prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", lab, registry=r)
        self.gen = Counter("vllm:generation_tokens", "Number of generation tokens processed.", lab, registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               [*lab, "finished_reason"], registry=r)
        self.iteration = Histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", lab,
                                   buckets=[1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384], registry=r)
        # vLLM 0.32's own buckets (vllm/v1/metrics/loggers.py, request_latency_buckets)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase "
                                      "for request.", lab, buckets=PREFILL_BUCKETS_S, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                      "queried tokens.", lab, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                   "tokens.", lab, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", lab,
                              buckets=TTFT_BUCKETS_S, registry=r)
        # The real server's label set (36 labels, a 1 KiB line), with this replica's fraction.
        info = dict(REAL_PAGE.cache_config_labels, engine="0", gpu_memory_utilization=str(gpu_util))
        cfg = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", sorted(info), registry=r)
        cfg.labels(**info).set(1)
        for reason in ("stop", "length", "abort", "error", "repetition"):
            self.success.labels(finished_reason=reason, **self.labels)
        for m in (self.running, self.waiting, self.kv, self.prompt, self.gen, self.iteration, self.prefill_time,
                  self.prefix_queries, self.prefix_hits, self.ttft):
            m.labels(**self.labels)


SAMPLE_PAGE = Path(__file__).resolve().parent / "data" / "vllm-0.32-metrics-sample.txt"
# vLLM 0.32's own (the real page's vllm:time_to_first_token_seconds)
TTFT_BUCKETS_S = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0, 160.0, 640.0, 2560.0]
PREFIX_BLOCK_TOKENS = 16  # vLLM's default block size: a prefix is cached, and hit, in whole blocks
PREFILL_BUCKETS_S = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                     480.0, 960.0, 1920.0, 7680.0]


class RealPage:
    """The page of a real vLLM 0.32 server (39 vllm: families, histograms, _created series: 51 KB).

    The simulator drives the families guardian reads; every other family of the real page is
    emitted as the real server last showed it (with this replica's model name), so that what
    guardian parses, and what that costs, is the size and shape of the real thing.
    """

    def __init__(self, path: Path = SAMPLE_PAGE) -> None:
        self.blocks: list[tuple[str, str]] = []  # (family name of its HELP line, its lines)
        self.cache_config_labels: dict[str, str] = {}
        name, lines = None, []
        for line in path.read_text().splitlines():
            if line.startswith("# HELP "):
                if name is not None:
                    self.blocks.append((name, "\n".join(lines) + "\n"))
                name, lines = line.split(" ", 3)[2], []
            lines.append(line)
            if line.startswith("vllm:cache_config_info{"):
                for family in text_string_to_metric_families(line + "\n"):
                    self.cache_config_labels = dict(family.samples[0].labels)
        if name is not None:
            self.blocks.append((name, "\n".join(lines) + "\n"))

    def rest(self, driven: bytes, model: str) -> bytes:
        """The real page's families that the page DRIVEN lacks, for MODEL."""
        have = {line.split(b" ", 3)[2].decode() for line in driven.splitlines() if line.startswith(b"# HELP ")}
        text = "".join(block for name, block in self.blocks if name not in have)
        return text.replace('model_name="' + REAL_MODEL + '"', 'model_name="' + model.replace('"', "") + '"').encode()


REAL_MODEL = "tiny"  # the model_name label on the real page
REAL_PAGE = RealPage()


class Engine:
    """The simulated EngineCore: iterations on a thread; requests wait on their conditions. With an
    engine core process (CORE), each iteration that has work is run there first (engine_core.py)."""

    def __init__(self, args, metrics: Metrics, core: engine_core.EngineCore | None = None) -> None:
        self.args = args
        self.m = metrics
        self.core = core
        # no engine process, for an engine that has none (trtllm, llama.cpp): its steps burn here
        self.burns_here = core is None and getattr(args, "sim_engine", "vllm") in ("trtllm", "llama.cpp")
        self.lock = threading.Lock()
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.dead = False  # engine-dead: no more iterations
        self.freeze_when_idle = False  # between-steps: freeze at the first step with nothing running
        self.prefill: dict | None = None  # a long chunked prefill in progress (/_sim/prefill)
        self.killed = False  # engine-killed
        self.synthetic_target = 0
        self.synthetic_max_tokens = 64
        self.synthetic_prompt_tokens = 16
        self.kv_capacity_tokens = 16384
        self.prefix: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently used first
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        self.last_prefill_s = 0.0  # the last prompt's prefill as the simulator computed it (not measured)
        # another engine's surface (engines.py) reads each step: what it prefilled and finished
        self.on_step: Callable[[], None] | None = None
        self.last_prefilled: list[Req] = []
        self.last_finished: list[Req] = []

    def _cached_tokens(self, words: tuple[str, ...], insert: bool) -> int:
        """The prompt's leading tokens in whole cached blocks; INSERT: its blocks cached now (LRU), as
        once its prefill computed them (a request admitted beside it before then finds none)."""
        hit, chained, hitting = 0, 0, True
        for at in range(0, len(words) - PREFIX_BLOCK_TOKENS + 1, PREFIX_BLOCK_TOKENS):
            chained = hash((chained, words[at : at + PREFIX_BLOCK_TOKENS]))
            if hitting and chained in self.prefix:
                hit += PREFIX_BLOCK_TOKENS
                self.prefix.move_to_end(chained)
            else:
                hitting = False
            if insert:
                self.prefix[chained] = None
                self.prefix.move_to_end(chained)
        while len(self.prefix) > self.args.sim_prefix_cache_blocks:
            self.prefix.popitem(last=False)
        return hit

    def _begin_prefill(self, r: Req, now: float) -> None:
        hit = self._cached_tokens(r.words, insert=False) if r.words else 0
        self.m.prefix_queries.labels(**self.m.labels).inc(r.prompt_tokens)
        self.m.prefix_hits.labels(**self.m.labels).inc(hit)
        self.prefix_query_tokens += r.prompt_tokens
        self.prefix_hit_tokens += hit
        r.cached_tokens = hit
        self.last_prefill_s = (r.prompt_tokens - hit) * self.args.sim_prefill_s_per_token
        r.ready_at = now + self.last_prefill_s

    def submit(self, req: Req) -> None:
        with self.lock:
            if self.freeze_when_idle:
                # stays in the API server's queue: the engine freezing (or frozen) never sees it, so the
                # load it was serving ends and it freezes whatever the clients' timing (a test's clients
                # that kept a request always running held it off on a loaded box)
                return
            self.waiting.append(req)

    def abort(self, req: Req) -> None:
        """The client went away: vLLM aborts its request (it leaves the batch, counted as no success)."""
        with self.lock:
            for queue in (self.running, self.waiting):
                if req in queue:
                    queue.remove(req)
        with req.cond:
            req.failed = req.failed or "aborted: the client disconnected"
            req.cond.notify_all()

    def _refill_synthetic(self) -> None:
        have = sum(1 for r in self.running + self.waiting if r.synthetic)
        for _ in range(self.synthetic_target - have):
            self.waiting.append(Req(self.synthetic_prompt_tokens, self.synthetic_max_tokens, synthetic=True))

    def loop(self) -> None:
        period = 1.0 / self.args.tokens_per_s
        while True:
            began = time.monotonic()
            if not (self.dead or self.killed):
                cost = self._step_cost(period) if self.core or self.burns_here else None
                if cost and self.core is None:
                    # trtllm-serve and llama-server compute in their own process: the step's CPU is
                    # this thread's (a frozen process burns none; one that computes always does)
                    engine_core.run_step(*cost)
                elif cost and not self.core.step(*cost):
                    return  # the engine core is gone (its monitor says so): no step can run again
                self.iterate()
                if self.on_step is not None and not self.dead:
                    with self.lock:
                        self.on_step()
            # the step's own time is part of the period: --tokens-per-s stays the iteration rate
            time.sleep(max(0.0, period - (time.monotonic() - began)))

    def _step_cost(self, period: float) -> tuple[float, float] | None:
        """What the next iteration costs the engine core: (CPU seconds, wall seconds to spread them
        over); None when it has nothing to do, and so is sent nothing and uses no CPU."""
        with self.lock:
            if self.freeze_when_idle and not self.running:
                return None  # between-steps: this iteration freezes the engine, it runs nothing
            prefill = self.prefill is not None
            decode = bool(self.running or self.waiting or self.synthetic_target) and (
                not prefill or self.prefill_coschedule)
        cpu_s = self.args.sim_step_cpu_s if decode else 0.0
        if prefill:  # a chunk in progress keeps it busy over the whole step, counters standing still
            return cpu_s + self.args.sim_prefill_busy * period, period
        return (cpu_s, 0.0) if decode else None

    def iterate(self) -> None:
        with self.lock:
            self.last_prefilled, self.last_finished = [], []
            if self.freeze_when_idle and not self.running:
                # Frozen right after a batch finished: the gauges keep the last scheduler stats
                # (0 running, 0 waiting) and the counters stop, as vLLM's do.
                self.dead = True
                self.m.running.labels(**self.m.labels).set(0)
                self.m.waiting.labels(**self.m.labels).set(0)
                log("SIM engine frozen between steps")  # the moment of the freeze, for the tests' clocks
                return
            if self.prefill is not None and self._prefill_step() and not self.prefill_coschedule:
                return  # the long prompt takes the whole step: everything else waits
            self._refill_synthetic()
            while self.waiting and len(self.running) < self.args.max_num_seqs:
                self.running.append(self.waiting.pop(0))
            computed = 0
            finished: list[Req] = []
            now = time.monotonic()
            for r in self.running:
                if not r.prefilled and not r.synthetic:
                    if r.ready_at is None:
                        self._begin_prefill(r, now)
                    if r.ready_at is not None and now < r.ready_at:
                        continue  # its uncached tokens are still being computed: no token yet
                    self._cached_tokens(r.words, insert=True)
                    self.m.ttft.labels(**self.m.labels).observe(now - r.submitted_at)
                if not r.prefilled:
                    r.prefilled = True
                    self.last_prefilled.append(r)
                    self.m.prompt.labels(**self.m.labels).inc(r.prompt_tokens)
                    self.m.prefill_time.labels(**self.m.labels).observe(1.0 / self.args.tokens_per_s)
                    computed += r.prompt_tokens
                r.generated += 1
                computed += 1
                if r.generated >= r.max_tokens:
                    r.done = True
                    finished.append(r)
            if self.running:
                self.m.gen.labels(**self.m.labels).inc(len(self.running))
                self.m.iteration.labels(**self.m.labels).observe(computed)
            for r in finished:
                self.running.remove(r)
                self.m.success.labels(finished_reason="length", **self.m.labels).inc()
            long_prompt = self.prefill["done_tokens"] if self.prefill is not None else 0
            used = sum(r.prompt_tokens + r.generated for r in self.running) + long_prompt
            self.m.running.labels(**self.m.labels).set(len(self.running) + (self.prefill is not None))
            self.m.waiting.labels(**self.m.labels).set(len(self.waiting))
            self.m.kv.labels(**self.m.labels).set(min(1.0, used / self.kv_capacity_tokens))
            touched = list(self.running) + finished
            self.last_finished = finished
        for r in touched:
            if not r.synthetic:
                with r.cond:
                    r.cond.notify_all()

    prefill_coschedule = False

    def start_prefill(self, prompt_tokens: int, chunk_tokens: int, chunk_s: float, coschedule: bool) -> None:
        with self.lock:
            self.prefill = {"left": prompt_tokens, "total": prompt_tokens, "chunk": chunk_tokens,
                            "chunk_s": chunk_s, "next_at": time.monotonic() + chunk_s, "done_tokens": 0,
                            "began": time.monotonic()}
            self.prefill_coschedule = coschedule
            self.m.running.labels(**self.m.labels).set(len(self.running) + 1)

    def _prefill_step(self) -> bool:
        """Advance the long prompt by a chunk when one is due. True while it is still prefilling."""
        p = self.prefill
        assert p is not None
        now = time.monotonic()
        if now >= p["next_at"]:
            step = min(p["chunk"], p["left"])
            p["left"] -= step
            p["done_tokens"] += step
            p["next_at"] = now + p["chunk_s"]
            used = sum(r.prompt_tokens + r.generated for r in self.running) + p["done_tokens"]
            self.m.kv.labels(**self.m.labels).set(min(1.0, used / self.kv_capacity_tokens))
        if p["left"] > 0:
            self.m.running.labels(**self.m.labels).set(len(self.running) + 1)
            self.m.waiting.labels(**self.m.labels).set(len(self.waiting))
            return True
        # prefill complete: vLLM counts the prompt's tokens now, and the request ends (max_tokens 1)
        self.m.prompt.labels(**self.m.labels).inc(p["total"])
        self.m.prefill_time.labels(**self.m.labels).observe(now - p["began"])
        self.m.gen.labels(**self.m.labels).inc(1)
        self.m.success.labels(finished_reason="length", **self.m.labels).inc()
        self.prefill = None
        return False

    def fail_all(self, why: str) -> None:
        with self.lock:
            reqs = self.running + self.waiting
            self.running, self.waiting = [], []
        for r in reqs:
            with r.cond:
                r.failed = why
                r.cond.notify_all()


class Sim:
    def __init__(self, args, core: engine_core.EngineCore | None = None) -> None:
        self.args = args
        self.core = core
        self.model = engines.model_id(args)
        self.registry = CollectorRegistry()
        process_collector.ProcessCollector(registry=self.registry)
        platform_collector.PlatformCollector(registry=self.registry)
        gc_collector.GCCollector(registry=self.registry)
        self.metrics = Metrics(self.model, args.gpu_memory_utilization, self.registry)
        self.engine = Engine(args, self.metrics, core)
        self.fault: dict = {}
        self.started_at = time.time()
        self.stall_until = 0.0  # stall-endpoints: time.monotonic() at which the held requests go on
        self.stall_cond = threading.Condition()
        self.starve_rngs: dict[str, random.Random] = {}
        self.starve_seed: object = None
        self.starve_drawn: dict[str, list[float]] = {}  # each path's delays so far, for /_sim/state
        # completions being answered (read to written): a stop with --shutdown-timeout waits for their last byte
        self.answering = 0
        self.answering_lock = threading.Lock()
        self.surface = engines.make(self)  # None: vLLM
        if self.surface is not None:
            self.engine.on_step = self.surface.on_step

    def answers(self, delta: int) -> None:
        with self.answering_lock:
            self.answering += delta

    def set_fault(self, spec: dict) -> None:
        name = spec.get("fault")
        log(f"SIM fault injected: {json.dumps(spec)}")
        self.fault = dict(spec)
        if self.surface is not None and self.surface.set_fault(spec):
            return
        if name == "engine-dead":
            self.engine.dead = True
        elif name == "engine-killed":
            self.engine.killed = True
            self.engine.fail_all("engine dead")
            exit_after = spec.get("exit_after_s", 4.0)
            if exit_after is not None:
                threading.Timer(float(exit_after), lambda: os._exit(0)).start()
        elif name == "between-steps":
            self.engine.synthetic_target = 0  # the traffic it was serving ends; new requests hang
            self.engine.freeze_when_idle = True
        elif name == "frozen":
            threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGSTOP)).start()
        elif name in ("engine-frozen", "spinning"):
            if self.core is None:
                raise ValueError(f"{name} needs the engine core process (--sim-engine-process)")
            if name == "engine-frozen":
                self.core.kill(signal.SIGSTOP)
            else:
                self.core.spin(min(1.0, max(0.0, float(spec.get("busy", 0.5)))))
        elif name == "stall-endpoints":
            stall_s = float(spec.get("stall_s", 11.0))
            with self.stall_cond:
                self.stall_until = time.monotonic() + stall_s
            fault = self.fault
            timer = threading.Timer(stall_s, self._stall_over, [fault])
            timer.daemon = True
            timer.start()
        elif name == "starved":
            self.starve_rngs, self.starve_drawn = {}, {}
            self.starve_seed = spec.get("seed")
        elif name == "leak":
            self._leak(spec.get("bytes"), str(spec.get("dir", "/dev/shm")))
        elif name not in ("slow-health", "wrong-model"):
            raise ValueError(f"unknown fault {name!r}")

    def _leak(self, n: int | None, where: str) -> None:
        """The reservation (or N bytes) moved into a /dev/shm file that no exit frees, mapped into
        this process as a driver's allocation is (RssShmem shows it while the process lives)."""
        import mmap

        n = int(n) if n is not None else sum(map(len, HELD))
        path = f"{where}/vllm-sim-held-{self.args.port}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, n)
            if n:
                held = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                for at in range(0, n, 4096):
                    held[at] = 1  # every page really taken
                LEAKED.append(held)
        finally:
            os.close(fd)
        HELD.clear()  # the process's own copy goes: the memory is now the file's
        log(f"SIM leak: {n / 2**30:.2f} GiB held in {path}, beyond this process")

    def _stall_over(self, fault: dict[str, object]) -> None:
        """stall-endpoints clears itself (unless cleared, or another fault injected, meanwhile)."""
        if self.fault is fault:
            self.fault = {}
            log("SIM fault over: stall-endpoints")

    def starve(self, path: str) -> None:
        """starved: hold this answer for a random while, as a saturated box's scheduler does. One
        sequence per path: a shared one would hand the canary whichever draw the probes' timing left
        it, and a test could not say which of its canaries come late."""
        fault = self.fault
        if fault.get("fault") != "starved":
            return
        lo, hi = float(fault.get("min_s", 1.0)), float(fault.get("max_s", 8.0))
        with self.stall_cond:
            if path not in self.starve_rngs:
                seed = self.starve_seed
                self.starve_rngs[path] = random.Random(None if seed is None else f"{seed}:{path}")
            delay_s = self.starve_rngs[path].uniform(lo, hi)
            self.starve_drawn.setdefault(path, []).append(round(delay_s, 6))
        waiting_to_run(delay_s)

    def wait_stall(self) -> None:
        """Hold the caller while stall-endpoints lasts."""
        with self.stall_cond:
            while (left := self.stall_until - time.monotonic()) > 0:
                self.stall_cond.wait(left)

    def clear(self) -> None:
        self.fault = {}
        with self.stall_cond:
            self.stall_until = 0.0
            self.stall_cond.notify_all()
        self.engine.freeze_when_idle = False
        self.engine.dead = False
        self.engine.killed = False
        if self.surface is not None:
            self.surface.clear()
        if self.core is not None:  # whichever fault came after them: a stopped or spinning core goes on
            self.core.kill(signal.SIGCONT)
            self.core.spin(0.0)

    def engine_hung(self) -> bool:
        """The engine does not answer: dead, frozen or spinning (or the whole process frozen)."""
        return self.engine.dead or self.fault.get("fault") in ("frozen", "engine-frozen", "spinning")


# What stall-endpoints holds: every endpoint but the completions (and the simulator's own /_sim/).
STALLED_PATHS = ("/health", "/ping", "/version", "/v1/models", "/metrics")


def log(msg: str) -> None:
    print(f"INFO {time.strftime('%m-%d %H:%M:%S')} [sim] {msg}", flush=True)


def make_handler(sim: Sim):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *a):  # quiet: a journal line per probe is noise
            pass

        def _send(self, code: int, body: bytes, ctype="application/json") -> None:
            try:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # its client gave up (a held probe): nothing to answer

        def do_GET(self) -> None:
            if sim.surface is not None and sim.surface.refuse(self):
                return
            if self.path.split("?")[0] in (STALLED_PATHS if sim.surface is None else sim.surface.stalled_paths):
                sim.wait_stall()  # stall-endpoints: the starved API server has not got to it yet
            if not self.path.startswith("/_sim/"):
                sim.starve(self.path.split("?")[0])
            self._get()

        def _json(self, code: int, obj) -> None:
            self._send(code, json.dumps(obj).encode())

        def _body(self) -> dict:
            n = int(self.headers.get("Content-Length") or 0)
            try:
                return json.loads(self.rfile.read(n) or b"{}")
            except json.JSONDecodeError:
                return {}

        def _get(self) -> None:
            fault = sim.fault.get("fault")
            path = self.path.split("?")[0]
            if sim.surface is not None and sim.surface.get(self, path):
                return None
            if path in ("/health", "/ping"):
                if fault == "engine-killed":
                    return self._send(503, b"")
                if fault == "slow-health" and sim.engine.running:
                    time.sleep(float(sim.fault.get("delay_s", 5.0)))
                return self._send(200, b"")
            if path == "/version":
                return self._json(200, {"version": VERSION})
            if path == "/v1/models":
                served = sim.fault.get("model", "other-model") if fault == "wrong-model" else sim.model
                return self._json(200, {"object": "list", "data": [
                    {"id": served, "object": "model", "created": int(sim.started_at), "owned_by": "vllm",
                     "root": sim.args.model, "parent": None, "max_model_len": 4096}]})
            if path == "/metrics":
                driven = generate_latest(sim.registry)
                page = driven + REAL_PAGE.rest(driven, sim.model)
                return self._send(200, page, "text/plain; version=0.0.4; charset=utf-8")
            if path == "/_sim/state":
                return self._json(200, {"fault": sim.fault, "running": len(sim.engine.running),
                                        "prefill": None if sim.engine.prefill is None else sim.engine.prefill["left"],
                                        "waiting": len(sim.engine.waiting), "pid": os.getpid(),
                                        "engine_pids": sim.core.pids if sim.core else [],
                                        "gpu_memory_utilization": sim.args.gpu_memory_utilization,
                                        "model": sim.model, "starved_delays_s": sim.starve_drawn,
                                        # clients' plain completions in the engine: no byte of theirs sent yet
                                        "plain": sum(1 for r in sim.engine.running + sim.engine.waiting
                                                     if not r.synthetic and not r.stream),
                                        "prefix_cache": {"blocks": len(sim.engine.prefix),
                                                         "query_tokens": sim.engine.prefix_query_tokens,
                                                         "hit_tokens": sim.engine.prefix_hit_tokens,
                                                         "last_prefill_s": sim.engine.last_prefill_s}})
            self._json(404, {"detail": "Not Found"})

        def do_POST(self):
            if sim.surface is not None and sim.surface.refuse(self):
                return None
            path = self.path.split("?")[0]
            body = self._body()
            if path == "/_sim/fault":
                try:
                    sim.set_fault(body)
                except ValueError as e:
                    return self._json(400, {"error": str(e)})
                return self._json(200, {"fault": sim.fault})
            if path == "/_sim/clear":
                sim.clear()
                return self._json(200, {"fault": {}})
            if path == "/_sim/load":
                e = sim.engine
                with e.lock:
                    e.synthetic_target = int(body.get("streams", 0))
                    e.synthetic_max_tokens = int(body.get("max_tokens", 64))
                    e.synthetic_prompt_tokens = int(body.get("prompt_tokens", 16))
                return self._json(200, {"streams": e.synthetic_target})
            if path == "/_sim/prefill":
                sim.engine.start_prefill(int(body.get("prompt_tokens", 7185)), int(body.get("chunk_tokens", 512)),
                                         float(body.get("chunk_s", 2.7)), bool(body.get("coschedule", False)))
                return self._json(200, {"prefill": True})
            if path in ("/v1/completions", "/v1/chat/completions"):
                sim.answers(+1)
                try:
                    sim.starve(path)
                    return self._complete(path, body)
                finally:
                    sim.answers(-1)
            self._json(404, {"detail": "Not Found"})

        def _complete(self, path: str, body: dict) -> None:
            chat = path.endswith("chat/completions")
            if body.get("model") not in (None, sim.model):
                return self._json(404, {"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                                  "type": "NotFoundError", "code": 404}})
            if sim.engine.killed:
                return self._json(500, {"error": {"message": "EngineCore encountered an issue.", "code": 500}})
            prompt = json.dumps(body.get("messages")) if chat else str(body.get("prompt", ""))
            words = tuple(prompt.split())
            req = Req(prompt_tokens=max(1, len(words)), max_tokens=max(1, int(body.get("max_tokens") or 16)),
                      stream=bool(body.get("stream")), words=words)
            sim.engine.submit(req)
            if body.get("stream"):
                return self._stream(req, chat)
            with req.cond:
                while not req.done and req.failed is None:
                    req.cond.wait(1.0)
            if req.failed:
                return self._json(500, {"error": {"message": req.failed, "code": 500}})
            text = " tok" * req.generated
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": text, "finish_reason": "length"})
            self._json(200, {"id": req.id, "object": "chat.completion" if chat else "text_completion",
                             "model": sim.model, "choices": [choice],
                             "usage": {"prompt_tokens": req.prompt_tokens, "completion_tokens": req.generated,
                                       "total_tokens": req.prompt_tokens + req.generated}})

        def _stream(self, req: Req, chat: bool) -> None:
            # As vLLM: the status line and headers go out at once, before the engine has produced
            # (or even seen) anything; the events follow the tokens.
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def chunk(data: str) -> None:
                raw = f"data: {data}\n\n".encode()
                self.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
                self.wfile.flush()

            sent = 0
            try:
                while True:
                    with req.cond:
                        while req.generated == sent and not req.done and req.failed is None:
                            req.cond.wait(1.0)
                        generated, done, failed = req.generated, req.done, req.failed
                    if failed:
                        chunk(json.dumps({"error": {"message": failed, "code": 500}}))
                        break
                    for _ in range(generated - sent):
                        delta = {"delta": {"content": " tok"}} if chat else {"text": " tok"}
                        chunk(json.dumps({"id": req.id, "model": sim.model, "choices": [{"index": 0, **delta}]}))
                    sent = generated
                    if done:
                        chunk("[DONE]")
                        break
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                sim.engine.abort(req)  # as vLLM: a client that went away takes its request with it

    return Handler


def _meminfo_bytes(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def startup_memory_check(args) -> str | None:
    """vLLM's check: desired = utilization x total must not exceed free memory at startup."""
    total = args.sim_total_memory_bytes or _meminfo_bytes("MemTotal")
    free = _meminfo_bytes("MemFree" if args.sim_free_source == "memfree" else "MemAvailable")
    if args.sim_free_bytes_file and os.path.exists(args.sim_free_bytes_file):
        with open(args.sim_free_bytes_file) as f:
            free = int(f.read().strip())
    desired = args.gpu_memory_utilization * total
    if desired > free and args.sim_engine != "vllm":
        return engines.memory_error(args, free, total, desired)
    if desired > free:
        gib = 2**30
        return (f"ValueError: Free memory on device cuda:0 ({free / gib:.2f}/{total / gib:.2f} GiB) on startup is "
                f"less than desired GPU memory utilization ({args.gpu_memory_utilization}, {desired / gib:.2f} GiB). "
                "Decrease GPU memory utilization or reduce GPU memory used by other processes.")
    return None


def allocate(n: int) -> bytearray:
    """N bytes that are really resident: every page written."""
    buf = bytearray(n)
    buf[::4096] = b"\x01" * len(range(0, n, 4096))
    return buf


# A starved process is runnable: the kernel counts its wait on the run queue (schedstat), which is
# what tells it from a frozen one (guardian's L22, C5). A sleep here would look frozen, so the wait is
# spent as STARVED_DUTY of a core in 20 ms slices: CPU time standing for run-queue time.
STARVED_DUTY = 0.05


def waiting_to_run(delay_s: float) -> None:
    end = time.monotonic() + delay_s
    while (left := end - time.monotonic()) > 0:
        spin_until = time.thread_time() + STARVED_DUTY * 0.02
        while time.thread_time() < spin_until:
            pass
        time.sleep(min(left, 0.02 * (1 - STARVED_DUTY)))


HELD: list[bytearray] = []  # --sim-allocate's reservation (the leak fault moves it out)
LEAKED: list = []  # the leak fault's mappings of its /dev/shm file (mmap.mmap)

LOAD_STEP_S = 0.1  # --sim-load-memory takes its memory in a step this often


def load_memory(n: int, load_time_s: float, step_s: float = LOAD_STEP_S) -> list[bytearray]:
    """N bytes taken in equal steps over LOAD_TIME_S, every page written as it is taken: how a
    real start's memory grows while it loads its weights and profiles its KV cache (on GB10 all
    of it from the one memory that CPU and GPU share). Paced by the clock, not by the allocations."""
    steps = max(1, round(load_time_s / step_s))
    chunk = n // steps
    held: list[bytearray] = []
    began = time.monotonic()
    for i in range(steps):
        held.append(allocate(chunk if i < steps - 1 else n - chunk * (steps - 1)))
        delay_s = began + (i + 1) * load_time_s / steps - time.monotonic()
        if delay_s > 0:
            time.sleep(delay_s)
    return held


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="vllm-sim", description="vLLM replica simulator for guardian's tests")
    p.add_argument("serve", nargs="?", help="ignored, as in `vllm serve MODEL` (trtllm: `trtllm-serve MODEL`)")
    p.add_argument("model_arg", nargs="?", help="trtllm: MODEL after `serve`; ignored otherwise")
    p.add_argument("--model", "--model-path", "-m", default="sim-model",
                   help="the model (SGLang's --model-path, llama-server's -m GGUF file)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=12)
    p.add_argument("--tokens-per-s", type=float, default=20.0, help="engine iterations per second")
    p.add_argument("--load-time-s", type=float, default=1.0, help="time before the port is bound")
    p.add_argument("--fault", default=None, help="fault to inject after --fault-after-s once serving")
    p.add_argument("--fault-after-s", type=float, default=0.0)
    p.add_argument("--fault-json", default="{}", help="extra fault parameters as JSON")
    p.add_argument("--check-memory", action="store_true", help="run vLLM's startup free-memory check")
    p.add_argument("--sim-prefix-cache-blocks", type=int, default=4096,
                   help="the prefix cache's size in blocks of 16 tokens (emptied by a restart: it is the process's)")
    p.add_argument("--sim-prefill-s-per-token", type=float, default=0.0,
                   help="seconds of prefill per prompt token not in the prefix cache (0: one engine step)")
    p.add_argument("--shutdown-timeout", type=float, default=0.0,
                   help="as vLLM >= 0.32: on SIGTERM, stop accepting and give running requests up to N s "
                        "(0: abort them)")
    p.add_argument("--kv-transfer-config", default=None,
                   help="as vLLM's KV connector (JSON): accepted and ignored, the simulator keeps no KV outside "
                        "its process")
    p.add_argument("--hang-on-sigterm", action="store_true",
                   help="while the engine is dead, frozen or spinning, or the process frozen, SIGTERM does not "
                        "end the process")
    p.add_argument("--sim-engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the steps in a child process VLLM::EngineCore, as vLLM V1 does (off: one process); "
                        "default on for vllm and sglang (its scheduler), off for trtllm and llama.cpp")
    p.add_argument("--sim-step-cpu-s", type=float, default=0.002,
                   help="CPU seconds the engine core burns per step with running requests")
    p.add_argument("--sim-prefill-busy", type=float, default=0.2,
                   help="fraction of a core the engine core burns while a long prefill (/_sim/prefill) runs")
    p.add_argument("--sim-workers", type=int, default=0,
                   help="the engine core's worker processes (VLLM::Worker_TP<i>), which burn the steps' CPU")
    p.add_argument("--sim-total-memory-bytes", type=int, default=0, help="pretend total memory (0: MemTotal)")
    p.add_argument("--sim-free-source", choices=["memavailable", "memfree"], default="memavailable")
    p.add_argument("--sim-free-bytes-file", default=None,
                   help="if this file exists, its number is the free memory the startup check sees")
    p.add_argument("--sim-allocate", action="store_true",
                   help="really hold gpu_memory_utilization x total bytes, as vLLM's reservation does on GB10")
    p.add_argument("--sim-load-memory", action="store_true",
                   help="take gpu_memory_utilization x total bytes in steps over --load-time-s, before the port is "
                        "bound, and hold them (a start whose memory grows while it loads)")
    add_engine_args(p)
    args = p.parse_args(argv)
    engines.resolve_args(args)
    return args


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """--sim-engine, and the flags of the other engines that the simulator takes (engines.py)."""
    p.add_argument("--sim-engine", choices=engines.ENGINES, default="vllm",
                   help="whose outside to show: routes, health, metrics, model id, names (engines.py)")
    g = p.add_argument_group("SGLang (--sim-engine sglang)")
    g.add_argument("--mem-fraction-static", type=float, default=None, help="the memory fraction (default 0.88)")
    g.add_argument("--enable-metrics", action="store_true", help="serve /metrics (else 404)")
    g.add_argument("--decode-log-interval", type=int, default=40,
                   help="the scheduler's gauges are refreshed every N decode steps (and per prefill batch)")
    g.add_argument("--watchdog-timeout", type=float, default=300.0,
                   help="a batch with no forward step for N s kills the process tree")
    g.add_argument("--sim-health-generate-timeout-s", type=float, default=20.0,
                   help="SGLANG_HEALTH_CHECK_TIMEOUT: /health's generate must see output within it")
    g = p.add_argument_group("TensorRT-LLM (--sim-engine trtllm)")
    g.add_argument("--kv_cache_free_gpu_memory_fraction", "--kv-cache-free-gpu-memory-fraction", type=float,
                   default=None, help="the memory fraction (default 0.9, or the YAML's)")
    g.add_argument("--extra_llm_api_options", "--extra-llm-api-options", default=None,
                   help="YAML: enable_iter_perf_stats, return_perf_metrics, kv_cache_config.free_gpu_memory_fraction")
    g.add_argument("--sim-iter-stats", action="store_true", help="enable_iter_perf_stats: /metrics JSON entries")
    g.add_argument("--sim-perf-metrics", action="store_true", help="return_perf_metrics: /prometheus/metrics")
    g = p.add_argument_group("llama.cpp llama-server (--sim-engine llama.cpp)")
    g.add_argument("-a", "--alias", default=None, help="the model's alias(es), comma-separated: /v1/models id")
    g.add_argument("--metrics", action="store_true", help="serve /metrics (else 501)")
    g.add_argument("-c", "--ctx-size", dest="ctx", type=int, default=4096)
    g.add_argument("-np", "--parallel", type=int, default=4, help="slots: the requests decoded at once")


def raise_fd_limit(target: int = 65536) -> None:
    """What vLLM does at start (vllm/utils/system_utils.py): raise the soft open-file limit, and
    warn, with a line that says "error", when the hard limit is too low. The start goes on."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= target:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except ValueError as e:
        print(f"(APIServer pid={os.getpid()}) WARNING {time.strftime('%m-%d %H:%M:%S')} [system_utils.py:255] "
              f"Found ulimit of {soft} and failed to automatically increase with error {e}. This can cause fd limit "
              "errors like `OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n",
              file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    vllm = args.sim_engine == "vllm"
    model = args.served_model_name or args.model
    if vllm:
        log(f"vLLM API server version {VERSION}; model={model} gpu_memory_utilization={args.gpu_memory_utilization} "
            f"pid={os.getpid()}")
    else:
        log(engines.banner(args))
    if vllm:
        raise_fd_limit()
    failed = "EngineCore failed to start" if vllm else f"{args.sim_engine} failed to start"
    if args.fault == "fail-startup":
        print(f"ERROR [sim] {failed}: RuntimeError: simulated startup failure", file=sys.stderr, flush=True)
        return 1
    if args.check_memory:
        problem = startup_memory_check(args)
        if problem:
            print(f"ERROR [sim] {failed}.\n{problem}", file=sys.stderr, flush=True)
            return 1
    # vLLM's EngineCore is a process of its own, started before the model loads; forked now, while this
    # process has one thread (fork copies only the caller) and before the memory below is taken
    core = engine_core.start(args.sim_workers, *engines.process_names(args)) if args.sim_engine_process else None
    if core is not None:
        log(f"SIM engine core pid={core.pids[0]} workers={core.pids[1:]}")
    sim: Sim | None = None
    server: ThreadingHTTPServer | None = None
    serving: threading.Thread | None = None
    if not vllm and engines.SURFACES[args.sim_engine].bind_before_load:
        # llama-server binds its port at once and answers 503 "Loading model" until loaded
        sim = Sim(args, core)
        server = serve(sim, args)
        serving = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
        serving.start()
    want = int(args.gpu_memory_utilization * (args.sim_total_memory_bytes or _meminfo_bytes("MemTotal")))
    if args.sim_load_memory:  # loading: the port is not bound yet (connection refused), the memory grows
        log(f"loading: taking {want / 2**30:.2f} GiB (gpu_memory_utilization x total) over {args.load_time_s:g} s")
        HELD.extend(load_memory(want, args.load_time_s))
        log(f"holding {sum(map(len, HELD)) / 2**30:.2f} GiB (gpu_memory_utilization x total)")
    else:
        time.sleep(args.load_time_s)  # loading weights: the port is not bound yet (connection refused)
    if args.sim_allocate and not args.sim_load_memory:
        HELD.append(allocate(want))
        log(f"holding {want / 2**30:.2f} GiB (gpu_memory_utilization x total)")
    if sim is None:
        sim = Sim(args, core)
    if core is not None:
        def on_core_death() -> None:  # something killed it: vLLM's API server then fails and exits
            if sim.surface is not None:
                sim.surface.on_core_death()
                return
            log("Engine core proc EngineCore_DP0 died unexpectedly, shutting down client.")
            sim.set_fault({"fault": "engine-killed"})
        core.watch(on_core_death)
    if server is None:
        server = serve(sim, args)
    threading.Thread(target=sim.engine.loop, daemon=True, name="EngineCore").start()
    if sim.surface is not None:
        sim.surface.start()
    if args.fault:
        spec = {"fault": args.fault, **json.loads(args.fault_json)}
        threading.Timer(args.fault_after_s, sim.set_fault, [spec]).start()
    def on_sigterm(*_: object) -> None:
        if args.hang_on_sigterm and sim.engine_hung():
            # vLLM's API server shuts down by asking its engine, which never answers: only
            # systemd's SIGKILL (TimeoutStopSec, or guardian's kill) ends the process.
            log("SIM shutdown: waiting for the engine, which does not answer (--hang-on-sigterm)")
            return
        if sim.surface is not None:
            sim.surface.on_sigterm(server)
            return
        threading.Thread(target=server.shutdown).start()

    signal.signal(signal.SIGTERM, on_sigterm)
    if vllm:
        log(f"Starting vLLM API server on http://{args.host}:{args.port}")
        log("Application startup complete.")
        server.serve_forever(poll_interval=0.2)
    else:
        log(f"{args.sim_engine}: serving on http://{args.host}:{args.port}; startup complete")
        if serving is None:
            server.serve_forever(poll_interval=0.2)
        else:
            while serving.is_alive():
                serving.join(0.2)
        if sim.surface is not None:
            sim.surface.after_serve(server)
    if args.shutdown_timeout > 0:
        server.server_close()  # no new connection; the streams in flight go on
        end = time.monotonic() + args.shutdown_timeout
        log(f"Shutting down: waiting up to {args.shutdown_timeout:g} s for running requests")
        while time.monotonic() < end:
            with sim.engine.lock:
                left = sum(1 for r in sim.engine.running + sim.engine.waiting if not r.synthetic)
            if not left and not sim.answering:  # every answer written to its last byte, as vLLM's drain
                break
            time.sleep(0.05)
    log("Shutting down")
    return 0


def serve(sim: Sim, args) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((args.host, args.port), make_handler(sim))
    server.daemon_threads = True
    return server


if __name__ == "__main__":
    sys.exit(main())
