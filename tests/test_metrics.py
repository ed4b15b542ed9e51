"""The /metrics parser: the real vLLM 0.32 page, and garbage."""

from __future__ import annotations

from pathlib import Path

import pytest

from guardian.observe.metrics import MetricsError, parse_vllm_metrics

# A complete /metrics page from a real vLLM 0.32 server (copied from shared/).
SAMPLE = Path(__file__).resolve().parent.parent / "vllm_sim" / "data" / "vllm-0.32-metrics-sample.txt"


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


def _page(*lines: str) -> str:
    return "\n".join(["# TYPE vllm:num_requests_running gauge", "vllm:num_requests_running 0",
                      "# TYPE vllm:num_requests_waiting gauge", "vllm:num_requests_waiting 0", *lines]) + "\n"


@pytest.mark.parametrize("lines, why", [
    (['vllm:generation_tokens_total{engine="0"} 1e308', 'vllm:generation_tokens_total{engine="1"} 1e308'],
     "add up to inf"),
    (["vllm:generation_tokens_total 0"] + [f'vllm:kv_cache_usage_perc{{engine="{i}"}} 0' for i in range(20_001)],
     "more than 20000 samples"),
])
def test_hostile_pages_are_unreadable_not_a_crash(lines, why):
    with pytest.raises(MetricsError, match=why):
        parse_vllm_metrics(_page(*lines))


@pytest.mark.parametrize("label", ["inf", "7.5", "nan", "0", "-0.5", "lots"])
def test_a_fraction_that_is_no_fraction_is_not_read(label):
    """With "inf" guardian crashed in a squeeze; with "7.5" it wrote 7.46 to the env file (issue 10)."""
    page = _page("vllm:generation_tokens_total 0", f'vllm:cache_config_info{{gpu_memory_utilization="{label}"}} 1')
    assert parse_vllm_metrics(page).gpu_memory_utilization is None


def test_the_selected_lines_give_the_same_sample_as_the_whole_page():
    from guardian.observe.metrics import parse_vllm_page, select_lines

    page = SAMPLE.read_bytes()
    assert parse_vllm_page(page) == parse_vllm_metrics(page.decode())
    kept = select_lines(page).splitlines()
    # about 15 of 600 samples, and the prefill histogram's 22 buckets
    assert 30 <= len(kept) <= 45 and len(select_lines(page)) < len(page) // 10
    assert sum(1 for line in kept if line.startswith("vllm:request_prefill_time_seconds_bucket")) == 22
    assert not any(line.startswith("vllm:num_requests_waiting_by_reason") for line in kept)  # a longer name


def test_a_page_of_more_samples_than_the_cap_is_refused_in_the_linear_pass():
    from guardian.observe.metrics import parse_vllm_page

    page = _page("vllm:generation_tokens_total 0", *(f"other{{i=\"{i}\"}} 0" for i in range(20_001)))
    with pytest.raises(MetricsError, match="more than 20000 samples"):
        parse_vllm_page(page.encode())


def test_a_page_of_blank_or_comment_lines_is_refused_in_the_linear_pass():
    from guardian.observe.metrics import MAX_LINES, parse_vllm_page

    with pytest.raises(MetricsError, match=f"more than {MAX_LINES} lines"):
        parse_vllm_page(b"#\n" * (MAX_LINES + 1))
