"""vLLM (V1): the engine guardian was built on (shared/BRIEF.md, "vLLM facts")."""

from __future__ import annotations

from .base import Engine, Knob, PageShape

PAGE = PageShape(
    summed={
        "vllm:num_requests_running": "running",
        "vllm:num_requests_waiting": "waiting",
        "vllm:kv_cache_usage_perc": "kv_cache_usage",
        "vllm:generation_tokens_total": "generation_tokens",
        "vllm:prompt_tokens_total": "prompt_tokens",
        "vllm:iteration_tokens_total_count": "iteration_count",
        "vllm:iteration_tokens_total_sum": "iteration_sum",
        "vllm:request_success_total": "request_success",
    },
    # Without these, "work queued" and "tokens flowing" cannot be told.
    required=("running", "waiting", "generation_tokens"),
    prefill_bucket="vllm:request_prefill_time_seconds_bucket",
    fraction_series="vllm:cache_config_info",
    fraction_label="gpu_memory_utilization",
    hint="is this a vLLM V1 server?",
)

VLLM = Engine(
    name="vllm",
    label="vLLM",
    health_path="/health",
    health_note="/health: the API server's check of its engine client (503 once the engine is dead)",
    metrics_path="/metrics",
    page=PAGE,
    metrics_flag=None,
    not_offered=frozenset(),
    metrics_via_engine=False,
    queue_lags=False,
    knob=Knob(
        "--gpu-memory-utilization", True, "a share of the device's whole memory (weights, KV cache, activations)"
    ),
    engine_names=("VLLM::EngineCor", "VLLM::Worker"),
    engine_titles=("VLLM::EngineCore", "VLLM::Worker"),
    single_process=False,
    markers=("vllm",),
    lacks=(),
)
