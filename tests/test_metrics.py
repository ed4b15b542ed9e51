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


# --- the page's short road (parse_vllm_page) gives what the long one gives ------------------------

def _long_road(page: bytes):
    """What parse_vllm_page gave before its short road: prometheus_client on select_lines."""
    from guardian.observe.metrics import select_lines

    return _outcome(lambda: parse_vllm_metrics(select_lines(page)))


def _outcome(parse):
    try:
        return parse()
    except MetricsError as e:
        return f"MetricsError: {e}"


def _simulator_page() -> bytes:
    """The page the simulator serves (its driven families, then the rest of the real page)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from vllm_sim.server import REAL_PAGE, Metrics

    registry = CollectorRegistry()
    m = Metrics("m", 0.74, registry)
    m.running.labels(**m.labels).set(2)
    m.gen.labels(**m.labels).inc(7)
    m.prefill_time.labels(**m.labels).observe(0.4)
    m.success.labels(finished_reason="stop", **m.labels).inc()
    driven = generate_latest(registry)
    return driven + REAL_PAGE.rest(driven, "m")


@pytest.mark.parametrize("which", ["real", "simulator"])
def test_the_short_road_reads_the_real_and_the_simulators_pages_as_prometheus_client_does(which):
    from guardian.observe.metrics import _plain_samples, _wanted_lines, parse_vllm_page, select_lines

    page = SAMPLE.read_bytes() if which == "real" else _simulator_page()
    text = select_lines(page)
    assert b"\n".join([*_wanted_lines(page), b""]).decode() == text  # the same lines found
    assert _plain_samples(text) is not None  # and each of the plain shape: prometheus_client is not asked
    assert parse_vllm_page(page) == parse_vllm_metrics(text) == parse_vllm_metrics(page.decode())
    if which == "simulator":
        s = parse_vllm_page(page)
        assert (s.running, s.generation_tokens, s.request_success, s.gpu_memory_utilization) == (2, 7, 1, 0.74)
        assert s.model_names == ("m",) and dict(s.prefill_buckets)[0.5] == 1


_FUZZ_PAGE = "\n".join([
    "# HELP vllm:num_requests_running Number of requests in model execution batches.",
    "# TYPE vllm:num_requests_running gauge",
    'vllm:num_requests_running{engine="0",model_name="m"} 1.0',
    'vllm:num_requests_waiting{engine="0",model_name="m"} 0',
    'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 0.0',
    'vllm:generation_tokens_total{engine="0",model_name="m\\\\x"} 5.0',
    'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 3e0',
    'vllm:request_prefill_time_seconds_bucket{engine="0",le="0.3",model_name="m"} 1.0',
    'vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 2.0',
    'vllm:cache_config_info{_block="True",block_size="16",gpu_memory_utilization="0.9",x="a\\"b,c=d}"} 1.0',
    "process_start_time_seconds 1.79595705884e+09",
    "other_series 1",
]) + "\n"
_TOKENS = ['"', "\\", "\\\\", '\\"', "\\n", "{", "}", ",", "=", " ", "  ", "\t", "\r", "#", " # ", "_", "__", "+",
           "-", ".", "e", "E", "Inf", "NaN", "0", "9" * 20, "1e400", "x", ":", "le=", 'le="1"', "model_name",
           '"m"', "\xff", "é", "\n", "\nvllm:num_requests_running ", "\nvllm:generation_tokens_total{"]


def test_the_short_road_gives_the_long_roads_sample_or_error_for_every_mutated_page():
    """Random edits of a page (quotes, escapes, braces, spaces, numbers, names, bytes that are no
    UTF-8): the short road's sample, or error, is the long road's. Both roads are exercised."""
    import random

    from guardian.observe.metrics import _plain_samples, _wanted_lines, parse_vllm_page, select_lines

    rng = random.Random(41)
    base = _FUZZ_PAGE.encode()
    short = errors = 0
    for _ in range(3000):
        page = base
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(page) + 1)
            if rng.random() < 0.25:
                page = page[:at] + page[at + rng.randint(1, 3):]
            else:
                page = page[:at] + rng.choice(_TOKENS).encode("utf-8", "surrogateescape") + page[at:]
        want = _long_road(page)
        assert _outcome(lambda: parse_vllm_page(page)) == want, page
        lines = _wanted_lines(page)
        short += lines is not None and _plain_samples(select_lines(page)) is not None
        errors += isinstance(want, str)
    assert short > 1000 and errors > 300  # both roads, and both outcomes, were taken often


@pytest.mark.parametrize("text, reason", [
    ("<html><body>502 Bad Gateway</body></html>", "no vllm:num_requests_running"),
    ('vllm:num_requests_running{engine="0" 1\n', "not Prometheus text"),
    ('vllm:num_requests_running{engine="0",engine="1"} 1\n', "not Prometheus text: Invalid labels"),
    ("vllm:num_requests_running NaN\nvllm:num_requests_waiting 0\nvllm:generation_tokens_total 1\n", "impossible value"),
    ("vllm:num_requests_running 0x1\nvllm:num_requests_waiting 0\nvllm:generation_tokens_total 1\n", "not Prometheus"),
    ('vllm:num_requests_running{__x="0"} 1\nvllm:num_requests_waiting 0\nvllm:generation_tokens_total 1\n',
     "not Prometheus text"),
    ("\x00\x01\x02 garbage \xff", "no vllm:num_requests_running"),
])
def test_garbage_on_the_page_is_the_same_clear_error_on_both_roads(text, reason):
    from guardian.observe.metrics import parse_vllm_page

    page = text.encode("utf-8", "surrogateescape")
    with pytest.raises(MetricsError, match=reason) as e:
        parse_vllm_page(page)
    assert f"MetricsError: {e.value}" == _long_road(page)


@pytest.mark.parametrize("extra, reason", [
    (['vllm:cache_config_info{x="' + "a" * 20_000 + '"} 1'], "a vllm:cache_config_info line of 20030 bytes"),
    ([f'vllm:kv_cache_usage_perc{{engine="{i}",x="{"a" * 9000}"}} 0' for i in range(30)], "more than 262144 bytes"),
    (["x"] * 20_000, None),  # 20,000 lines: the long road's (it reads them, under its caps)
])
def test_a_page_near_or_over_a_bound_is_the_long_roads_to_judge(extra, reason):
    from guardian.observe.metrics import _wanted_lines, parse_vllm_page

    page = _page("vllm:generation_tokens_total 0", *extra).encode()
    assert _wanted_lines(page) is None
    assert _outcome(lambda: parse_vllm_page(page)) == _long_road(page)
    if reason is not None:
        with pytest.raises(MetricsError, match=reason):
            parse_vllm_page(page)
