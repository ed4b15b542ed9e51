"""The /metrics parser: the real vLLM 0.32 page, and garbage."""

from __future__ import annotations

from pathlib import Path

import pytest

from guardian.observe.metrics import MetricsError, parse_vllm_metrics

# A complete /metrics page from a real vLLM 0.32 server (copied from shared/).
SAMPLE = Path(__file__).resolve().parent / "data" / "vllm-0.32-metrics-sample.txt"


def test_real_vllm_page():
    s = parse_vllm_metrics(SAMPLE.read_text())
    assert (s.running, s.waiting, s.kv_cache_usage) == (0, 0, 0)
    assert s.generation_tokens == 166 and s.prompt_tokens == 77
    assert s.iteration_count == 166 and s.iteration_sum == 243
    assert s.request_success == 8  # summed over finished_reason
    assert s.gpu_memory_utilization == 0.92 and s.model_names == ("tiny",)


def test_sums_over_engines():
    text = "\n".join([
        'vllm:num_requests_running{engine="0",model_name="m"} 2',
        'vllm:num_requests_running{engine="1",model_name="m"} 3',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1',
        'vllm:generation_tokens_total{engine="0",model_name="m"} 10',
        'vllm:generation_tokens_total{engine="1",model_name="m"} 5',
    ]) + "\n"
    s = parse_vllm_metrics(text)
    assert s.running == 5 and s.waiting == 1 and s.generation_tokens == 15


@pytest.mark.parametrize("text, reason", [
    ("", "no vllm:num_requests_running"),
    ("<html><body>502 Bad Gateway</body></html>", "not Prometheus text"),
    ("vllm:num_requests_running{engine=\"0\" 1\n", "not Prometheus text"),
    ("vllm:num_requests_running 1\n", "no vllm:num_requests_waiting"),
    ("vllm:num_requests_running NaN\nvllm:num_requests_waiting 0\nvllm:generation_tokens_total 1\n", "impossible value"),
    ("vllm:num_requests_running -1\nvllm:num_requests_waiting 0\nvllm:generation_tokens_total 1\n", "impossible value"),
    ("\x00\x01\x02 garbage \xff", "not Prometheus text"),
])
def test_garbage_is_a_clear_error(text, reason):
    with pytest.raises(MetricsError, match=reason):
        parse_vllm_metrics(text)
