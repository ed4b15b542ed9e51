"""Turn a vLLM /metrics page into a VllmSample, with prometheus_client's parser.

Values are summed over label sets (several engines, finished reasons). A page that does not
parse, or that lacks the gauges guardian judges progress by, raises MetricsError: guardian
then cannot tell busy from stalled and must not restart on that replica's metrics.
"""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from ..core.observations import VllmSample
from ..core.wiring import parse_fraction


class MetricsError(ValueError):
    pass


_SUMMED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:iteration_tokens_total_count": "iteration_count",
    "vllm:iteration_tokens_total_sum": "iteration_sum",
    "vllm:request_success_total": "request_success",
}
# Without these, "work queued" and "tokens flowing" cannot be told.
_REQUIRED = ("running", "waiting", "generation_tokens")


# A real vLLM 0.32 page has about 600 samples (tests/data); a page with many more is not one
# guardian should spend its tick on.
MAX_SAMPLES = 20_000
MAX_MODEL_NAMES = 16


def parse_vllm_metrics(text: str) -> VllmSample:
    values: dict[str, float] = {}
    models: set[str] = set()
    gpu_util: float | None = None
    started: float | None = None
    count = 0
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                count += 1
                if count > MAX_SAMPLES:
                    raise MetricsError(f"more than {MAX_SAMPLES} samples on the page")
                field = _SUMMED.get(sample.name)
                if field is not None:
                    if not math.isfinite(sample.value) or sample.value < 0:
                        raise MetricsError(f"{sample.name} has an impossible value {sample.value!r}")
                    values[field] = values.get(field, 0.0) + sample.value
                    if "model_name" in sample.labels and len(models) < MAX_MODEL_NAMES:
                        models.add(sample.labels["model_name"][:256])
                elif sample.name == "process_start_time_seconds" and math.isfinite(sample.value):
                    started = sample.value if started is None else min(started, sample.value)
                elif sample.name == "vllm:cache_config_info":
                    # Anything but a finite number in (0, 1] is no fraction (never written to an env file).
                    gpu_util = parse_fraction(sample.labels.get("gpu_memory_utilization"))
    except MetricsError:
        raise
    except Exception as e:  # noqa: BLE001 - the parser raises ValueError, IndexError, ... on garbage
        raise MetricsError(f"not Prometheus text: {e}") from None
    for field, total in values.items():
        if not math.isfinite(total):  # finite samples can still sum to inf (two of 1e308)
            raise MetricsError(f"the {field} samples add up to {total!r}")
    missing = [f for f in _REQUIRED if f not in values]
    if missing:
        names = ", ".join(k for k, v in _SUMMED.items() if v in missing)
        raise MetricsError(f"no {names} on the page (is this a vLLM V1 server?)")
    return VllmSample(
        running=values["running"],
        waiting=values["waiting"],
        kv_cache_usage=values.get("kv_cache_usage", 0.0),
        generation_tokens=values["generation_tokens"],
        prompt_tokens=values.get("prompt_tokens", 0.0),
        iteration_count=values.get("iteration_count", 0.0),
        iteration_sum=values.get("iteration_sum", 0.0),
        request_success=values.get("request_success", 0.0),
        gpu_memory_utilization=gpu_util,
        model_names=tuple(sorted(models)),
        process_start_time_s=started,
    )
