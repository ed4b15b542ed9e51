"""llama.cpp's llama-server (shared/BRIEF.md, "Other engines the Spark runs"; tools/server/server.cpp).

- /health is answered by the HTTP thread without touching the task loop: 503 "Loading model" while
  loading, then 200 {"status":"ok"} for ever, decode hung or not (#27388, #13281, #5851).
- /metrics (only with --metrics; 501 without) and /slots queue a task to the main loop and wait with
  no timeout: a bounded read is a probe of the engine itself (metrics_via_engine), slow at most by
  one llama_decode (a chunk of at most --batch-size prompt tokens).
- its counters: llamacpp:requests_processing / requests_deferred (work in and waiting for a slot),
  tokens_predicted_total, prompt_tokens_total, n_decode_total (one per llama_decode: it moves
  through a long prompt's chunks while the token counters stand still). No KV-cache figure (removed
  in #13660), no histograms, no process start time.
- no memory fraction: -c, -np, -ngl and --fit size it; the memory guard never lowers it.
- one process: its HTTP threads and its task loop share it, so the process is the engine too.
"""

from __future__ import annotations

from .base import Engine, PageShape

PAGE = PageShape(
    summed={
        "llamacpp:requests_processing": "running",
        "llamacpp:requests_deferred": "waiting",
        "llamacpp:tokens_predicted_total": "generation_tokens",
        "llamacpp:prompt_tokens_total": "prompt_tokens",
        "llamacpp:n_decode_total": "iteration_count",
    },
    required=("running", "waiting", "generation_tokens"),
    hint="is this llama-server with --metrics?",
)

LLAMACPP = Engine(
    name="llama.cpp",
    label="llama.cpp (llama-server)",
    health_path="/health",
    health_note="/health: the HTTP thread's answer, 200 once loaded even while decoding is hung (#27388)",
    metrics_path="/metrics",
    page=PAGE,
    metrics_flag="--metrics",
    not_offered=frozenset({501, 404}),
    metrics_via_engine=True,
    queue_lags=False,
    knob=None,
    engine_names=(),
    engine_titles=(),
    single_process=True,
    markers=("llama-server", "llama.cpp", "llama-cpp"),
    lacks=(
        "KV-cache use: a long prompt shows as llama_decode calls (n_decode_total) instead",
        "the prefill histogram: no learned longest step (W.stall_window_s bounds a stall)",
        "process_start_time_seconds: a URL that leads to a proxy is not told by it",
        "a memory fraction: the memory guard never lowers it, the start fit does not size it",
    ),
)
