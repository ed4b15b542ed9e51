"""Warm-up requests (issue 33 item 2): the file as observe/warmup.py reads it, and act/warmup.py
sending it to a real simulator, whose prefix cache then holds the shared prefix."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from guardian.act.warmup import warm_up
from guardian.config import ReplicaConfig
from guardian.observe import warmup
from harness import Running

SYSTEM = " ".join(f"rule{i}" for i in range(48))  # 3 blocks of 16 tokens: what the clients share


@pytest.mark.parametrize(
    "text, paths",
    [
        ('{"prompt": "x"}\n', ["/v1/completions"]),
        ('# shared\n\n{"messages": [{"role": "system", "content": "s"}], "tools": []}\n', ["/v1/chat/completions"]),
        ('{"prompt": "x", "model": "other", "max_tokens": 900, "max_completion_tokens": 9, "stream": true, "n": 4}\n',
         ["/v1/completions"]),
    ],
)
def test_a_warmup_file_is_read_as_requests(tmp_path, text, paths):
    path = tmp_path / "w.jsonl"
    path.write_text(text)
    found = warmup.load(path)
    assert [q.path for q in found] == paths
    assert not set(warmup.GUARDIANS_KEYS) & set(found[0].body)  # guardian's own keys


@pytest.mark.parametrize(
    "text, why",
    [
        ("", "no request in it"),
        ("{not json}\n", "line 1: not JSON"),
        ('{"prompt": "x"}\n[1]\n', "line 2: not a JSON object"),
        ('{"prompt": 3}\n', 'line 1: neither "prompt"'),
        ('{"messages": []}\n', 'line 1: neither "prompt"'),
        ('{"messages": [{"content": "no role"}]}\n', 'line 1: neither "prompt"'),
        ('{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}\n', "and not both"),
        ('{"prompt": "x"}\n' * (warmup.MAX_REQUESTS + 1), "more than"),
        ('{"prompt": "x", "temperature": NaN}\n', "line 1: not JSON .*NaN is not a JSON number"),
    ],
)
def test_a_warmup_file_that_cannot_be_used_is_named_with_its_line(tmp_path, text, why):
    path = tmp_path / "w.jsonl"
    path.write_text(text)
    with pytest.raises(warmup.WarmupFileError, match=why) as e:
        warmup.load(path)
    assert str(path) in str(e.value)


def test_a_missing_or_oversized_file_is_said(tmp_path):
    with pytest.raises(warmup.WarmupFileError, match="cannot be read"):
        warmup.load(tmp_path / "absent.jsonl")
    big = tmp_path / "big.jsonl"
    big.write_bytes(b"#" * (warmup.MAX_BYTES + 1))
    with pytest.raises(warmup.WarmupFileError, match="cannot be read"):
        warmup.load(big)


@pytest.fixture
def sim():
    s = Running("--sim-prefill-s-per-token", "0.0001").wait_up()
    yield s
    s.stop()


def _run(r: ReplicaConfig, timeout_s: float = 20.0):
    async def go():
        async with httpx.AsyncClient() as client:
            return await warm_up(client, r, 116.0, timeout_s)
    return asyncio.run(go())


def test_the_warmup_fills_the_replicas_prefix_cache_with_what_its_clients_share(sim, tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in (
        {"prompt": SYSTEM + " tool-a"},
        {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]},
        {"prompt": SYSTEM + " tool-b", "model": "not-its-own"},
    )) + "\n")
    r = ReplicaConfig(name="a", unit="vllm-a.service", url=sim.url, model="m", warmup_file=path)
    result = _run(r)
    assert (result.started_at, result.served, result.failed, result.error) == (116.0, 3, 0, None)
    cache = sim.get("/_sim/state").json()["prefix_cache"]
    assert cache["hit_tokens"] >= 48  # the third found the first's 3 blocks: a client's first request would too
    # a client's request with the shared prefix now hits it
    before = cache["hit_tokens"]
    assert sim.post("/v1/completions", {"model": "m", "prompt": SYSTEM + " question", "max_tokens": 1}).status_code == 200
    assert sim.get("/_sim/state").json()["prefix_cache"]["hit_tokens"] - before == 48


def test_a_failed_request_is_counted_and_the_rest_still_sent(sim, tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    r = ReplicaConfig(name="a", unit="vllm-a.service", url=sim.url, model="other-model", warmup_file=path)
    result = _run(r)  # the simulator answers 404 for a model it does not serve
    assert (result.served, result.failed) == (0, 2) and result.error == "request 1: HTTP 404"


def test_requests_past_the_bound_are_not_sent(tmp_path):
    slow = Running("--sim-prefill-s-per-token", "0.05").wait_up()  # 48 tokens: 2.4 s a request
    try:
        path = tmp_path / "w.jsonl"
        path.write_text("\n".join(json.dumps({"prompt": SYSTEM + f" {i}"}) for i in range(5)) + "\n")
        r = ReplicaConfig(name="a", unit="vllm-a.service", url=slow.url, model="m", warmup_file=path)
        result = _run(r, timeout_s=1.0)
        assert result.served == 0 and result.failed == 5  # the first timed out at the bound, the rest unsent
        assert result.error == "its bound of 1 s passed with 4 of 5 not sent; request 1: no answer within the 1 s bound"
        assert slow.get("/_sim/state").json()["prefix_cache"]["query_tokens"] == 49  # only the first reached it
    finally:
        slow.stop()


def test_an_unreadable_file_is_the_result_and_nothing_is_sent(sim, tmp_path):
    r = ReplicaConfig(name="a", unit="vllm-a.service", url=sim.url, model="m", warmup_file=tmp_path / "none.jsonl")
    result = _run(r)
    assert (result.served, result.failed) == (0, 0) and "cannot be read" in (result.error or "")
    assert sim.get("/_sim/state").json()["prefix_cache"]["query_tokens"] == 0


# --- issue 41 row 5: a line nested 100,000 deep -----------------------------------------------
DEEP = {
    "array": "[" * 100_000 + "]" * 100_000,
    "object": '{"a":' * 100_000 + "1" + "}" * 100_000,
}


@pytest.mark.parametrize("kind", sorted(DEEP))
def test_a_line_nested_100000_deep_is_a_file_error_naming_its_line_and_the_nesting(tmp_path, kind):
    """It raised RecursionError out of load (ValueError alone was caught): `guardian check` died with a
    traceback and the daemon's warm-up task ended with no result."""
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "x"}\n' + DEEP[kind] + "\n")
    with pytest.raises(warmup.WarmupFileError, match=r"line 2: not JSON: nested too deep") as e:
        warmup.load(path)
    assert str(path) in str(e.value) and len(str(e.value)) < 1000  # the cause, never the line itself


def _executor(cfg):
    from guardian.act.executor import Executor
    from guardian.act.restart import Tools

    return Executor(Tools(None, None, None, cfg, lambda: None), httpx.AsyncClient())  # type: ignore[arg-type]


def _warm_through_the_executor(r: ReplicaConfig):
    """The daemon's path: a WarmUp action performed by the executor, its result taken as the observer takes it."""
    from guardian.config import Config
    from guardian.core.actions import WarmUp

    async def go():
        ex = _executor(Config(replicas=[r]))
        ex.perform([WarmUp(r.name, 116.0, 5.0)], {}, None)  # type: ignore[arg-type]
        await asyncio.wait(set(ex.tasks), timeout=30)  # a deadline for a hang only
        await ex.client.aclose()
        return ex.take_results().warmups.get(r.name)

    return asyncio.run(go())


def test_a_deep_line_in_the_daemon_is_a_failed_warmup_with_its_cause_not_a_task_that_died(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(DEEP["array"] + "\n")
    r = ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:9", model="m", warmup_file=path)
    result = _warm_through_the_executor(r)
    assert result is not None, "the warm-up task died with no result: D14 never comes"
    assert (result.started_at, result.served) == (116.0, 0) and "line 1: not JSON: nested too deep" in result.error


def test_a_warmup_that_raises_anything_ends_as_a_failed_warmup(tmp_path, monkeypatch):
    def broken(path):
        raise RuntimeError("something no one foresaw")

    monkeypatch.setattr(warmup, "load", broken)
    r = ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:9", model="m",
                      warmup_file=tmp_path / "w.jsonl")
    result = _warm_through_the_executor(r)
    assert result is not None, "the warm-up task died with no result: D14 never comes"
    assert result.started_at == 116.0 and result.served == 0
    assert "RuntimeError: something no one foresaw" in (result.error or "")
