"""TensorRT-LLM's trtllm-serve (shared/BRIEF.md, "Other engines the Spark runs";
tensorrt_llm/serve/openai_server.py).

- /health reads only the executor's shutdown flag: 200 after the executor thread died (#13318), 503
  for ever after a rank died with the process alive (#18663). guardian reads it as the API server's
  answer and proves the engine with its own canary (/health_generate has no timeout of its own).
- /metrics is JSON iteration stats, and reading them removes them: one consumer only, so guardian
  never reads it. The Prometheus page is /prometheus/metrics, served with return_perf_metrics: true
  in the --extra_llm_api_options file (404 without): trtllm_num_requests_running / _waiting,
  trtllm_generation_tokens_total, trtllm_prompt_tokens_total, trtllm_kv_cache_utilization, the
  prefill-time histogram trtllm_request_prefill_time_seconds (names as in 1.3.0rc13: unverified).
- memory knob --kv_cache_free_gpu_memory_fraction (0.9): a share of the memory left free after the
  weights, not of the whole: the start fit cannot size it from the fraction alone.
- one process on one GPU: the executor is a thread of the API server's process.
"""

from __future__ import annotations

from .base import Engine, Knob, PageShape

PAGE = PageShape(
    summed={
        "trtllm_num_requests_running": "running",
        "trtllm_num_requests_waiting": "waiting",
        "trtllm_kv_cache_utilization": "kv_cache_usage",
        "trtllm_generation_tokens_total": "generation_tokens",
        "trtllm_prompt_tokens_total": "prompt_tokens",
    },
    required=("running", "waiting", "generation_tokens"),
    prefill_bucket="trtllm_request_prefill_time_seconds_bucket",
    hint="is this trtllm-serve with return_perf_metrics: true?",
)

TRTLLM = Engine(
    name="trtllm",
    label="TensorRT-LLM (trtllm-serve)",
    health_path="/health",
    health_note="/health: the server's shutdown flag only, 200 after its executor died (#13318)",
    metrics_path="/prometheus/metrics",
    page=PAGE,
    metrics_flag="return_perf_metrics: true and enable_iter_perf_stats: true (in the --extra_llm_api_options file)",
    not_offered=frozenset({404}),
    metrics_via_engine=False,
    queue_lags=False,
    knob=Knob(
        "--kv_cache_free_gpu_memory_fraction",
        False,
        "a share of the memory left free after the weights, for the KV cache",
    ),
    engine_names=(),
    engine_titles=(),
    single_process=True,
    markers=("trtllm-serve", "tensorrt-llm", "tensorrt_llm", "trtllm"),
    lacks=(
        "the iteration counts and finished requests: progress is tokens and the KV cache's use",
        "process_start_time_seconds: a URL that leads to a proxy is not told by it",
    ),
)
