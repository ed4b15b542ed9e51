"""SGLang (python -m sglang.launch_server; shared/BRIEF.md, "Other engines the Spark runs";
python/sglang/srt/entrypoints/http_server.py, python/sglang/srt/metrics/collector.py).

- /health is /health_generate: a 1-token generate through the scheduler, waiting up to
  SGLANG_HEALTH_CHECK_TIMEOUT (20 s), and probes that pile up while it hangs have crashed it
  (#35884). guardian's probe every tick would pile them up, so it reads /ping, which the API server
  answers alone, and proves the engine with its own canary, one at a time, bounded.
- its page only with --enable-metrics (404 without): sglang:num_running_reqs, num_queue_reqs,
  generation_tokens_total, prompt_tokens_total, token_usage (the KV pool's use, 0-1), and the
  end-to-end latency histogram, whose count is the finished requests. The scheduler's gauges are
  refreshed per prefill batch and every --decode-log-interval (40) decode steps: they lag, and
  freeze when it hangs; the token counters move as tokens come out.
- memory knob --mem-fraction-static: the share of the whole memory for weights and KV pool.
- its scheduler runs in processes named sglang::scheduler (setproctitle; comm "sglang::schedul").
"""

from __future__ import annotations

from .base import Engine, Knob, PageShape

PAGE = PageShape(
    summed={
        "sglang:num_running_reqs": "running",
        "sglang:num_queue_reqs": "waiting",
        "sglang:token_usage": "kv_cache_usage",
        "sglang:generation_tokens_total": "generation_tokens",
        "sglang:prompt_tokens_total": "prompt_tokens",
        "sglang:e2e_request_latency_seconds_count": "request_success",
    },
    required=("running", "waiting", "generation_tokens"),
    hint="is this SGLang with --enable-metrics?",
)

SGLANG = Engine(
    name="sglang",
    label="SGLang",
    health_path="/ping",
    health_note="/ping: the API server alone (its /health generates a token and piles up when probed: #35884)",
    metrics_path="/metrics",
    page=PAGE,
    metrics_flag="--enable-metrics",
    not_offered=frozenset({404}),
    metrics_via_engine=False,
    queue_lags=True,
    knob=Knob("--mem-fraction-static", True, "a share of the device's whole memory for the weights and the KV pool"),
    engine_names=("sglang::schedul",),
    engine_titles=("sglang::scheduler",),
    single_process=False,
    markers=("sglang",),
    lacks=(
        "the prefill histogram: no learned longest step (W.stall_window_s bounds a stall)",
        "the iteration counts: progress is tokens, finished requests and the KV pool's use",
    ),
)
