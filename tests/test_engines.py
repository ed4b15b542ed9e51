"""Every engine the Spark runs (guardian/engines/): which one a unit starts, how its page reads, what
its probes and its memory knob mean, and how the core judges a replica whose page is missing, or is
answered by its engine's own loop (llama-server). Pure: the core's inputs are values here; the real
servers are in tests/test_system_llamacpp_guardian.py and the simulator's engines."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from harness import OK, TIMEOUT, Box, canaries, cfg, conns, obs, restarts

from guardian.config import Config, ConfigError, ReplicaConfig, load_config
from guardian.core.container import engine_words
from guardian.core.observations import Activity, CanaryResult, EnvFile, Probe, ProcView
from guardian.core.vocab import State
from guardian.core.memory.wiring import cmdline_fraction, wiring_problem
from guardian.engines import ENGINES, detect
from guardian.engines.llamacpp import LLAMACPP
from guardian.engines.resolve import told
from guardian.engines.sglang import SGLANG
from guardian.engines.trtllm import TRTLLM
from guardian.engines.vllm import VLLM
from guardian.observe import probes
from guardian.observe.metrics import MetricsError, parse_page
from guardian.observe.procs import ProcStat, view
from guardian.observe.replicas import as_engine

# --- which engine a unit starts -------------------------------------------------------------------

DETECTED = [
    (("/opt/vllm/bin/vllm", "serve", "/models/Llama-3.1-8B"), "vllm"),
    (("/usr/bin/python3", "-m", "sglang.launch_server", "--model-path", "/models/vllm-quant"), "sglang"),
    (("trtllm-serve", "/models/llama", "--port", "8355"), "trtllm"),
    (("/usr/bin/llama-server", "-m", "/srv/models/llama-3.gguf", "--port", "30000"), "llama.cpp"),
    # a container: its image and command tell, never its options (`--name vllm-a` runs SGLang here)
    (
        (
            "/usr/bin/docker",
            "run",
            "--rm",
            "--name",
            "vllm-a",
            "-p",
            "8001:30000",
            "lmsysorg/sglang:latest-cu130",
            "python3",
            "-m",
            "sglang.launch_server",
        ),
        "sglang",
    ),
    (("/usr/bin/podman", "run", "--name", "x", "ghcr.io/ggml-org/llama.cpp:server", "-m", "/m.gguf"), "llama.cpp"),
    (
        ("docker", "run", "--name", "llama-server", "nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc13", "trtllm-serve"),
        "trtllm",
    ),
    (("docker", "run", "--name", "t", "vllm/vllm-openai:latest", "--model", "/models/llama-server-test"), "vllm"),
]


@pytest.mark.parametrize("argv, engine", DETECTED)
def test_auto_tells_the_engine_from_the_first_word_that_names_one(argv, engine):
    found = detect(engine_words(argv))
    assert found is not None and found[0].name == engine


def test_auto_without_an_engine_word_or_an_unread_unit_assumes_vllm_and_says_so():
    r = replica(engine="auto")
    nothing = told(r, ("/usr/local/bin/serve.sh", "--port", "8001"))
    assert nothing.engine is VLLM and "no engine's name on vllm-a.service's command line; vLLM assumed" in nothing.how
    unread = told(r, None, "systemd could not be asked about vllm-a.service: timeout")
    assert unread.engine is VLLM and "systemd could not be asked" in unread.how and "set engine" in unread.how
    said = told(r, ("/usr/bin/llama-server", "-m", "x.gguf"))
    assert said.engine is LLAMACPP and said.how == "auto: `/usr/bin/llama-server` on vllm-a.service's command line"
    assert told(replica(engine="sglang"), ("vllm", "serve")).engine is SGLANG  # configured wins


def replica(**kw) -> ReplicaConfig:
    return ReplicaConfig.model_validate(
        {"name": "a", "unit": "vllm-a.service", "url": "http://127.0.0.1:8001", "model": "m", **kw}
    )


def test_engine_names_the_serving_engine_and_the_old_container_spelling_is_runtime(tmp_path):
    assert replica(engine="llama.cpp").engine == "llama.cpp" and replica().engine == "vllm"
    old = replica(container="vllm-p", engine="podman")  # a config of 0.2: engine was the container runtime
    assert (old.runtime, old.engine) == ("podman", "vllm")
    with pytest.raises(ValueError, match="disagree"):
        replica(container="vllm-p", engine="podman", runtime="docker")
    bad = tmp_path / "g.toml"
    bad.write_text(
        '[[replicas]]\nname = "a"\nunit = "a.service"\nurl = "http://127.0.0.1:1"\nmodel = "m"\nengine = "ollama"\n'
    )
    with pytest.raises(ConfigError, match="engine"):
        load_config(bad)


# --- each engine's page -----------------------------------------------------------------------------

LLAMACPP_PAGE = b"""# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 412
llamacpp:prompt_seconds_total 1.5
llamacpp:tokens_predicted_total 96
llamacpp:tokens_predicted_seconds_total 2.25
llamacpp:n_decode_total 130
llamacpp:n_busy_slots_per_decode 1.2
llamacpp:n_tokens_max 512
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
llamacpp:requests_deferred 1
"""
SGLANG_PAGE = b"""sglang:num_running_reqs{model_name="qwen"} 3.0
sglang:num_queue_reqs{model_name="qwen"} 0.0
sglang:token_usage{model_name="qwen"} 0.25
sglang:generation_tokens_total{model_name="qwen"} 700.0
sglang:prompt_tokens_total{model_name="qwen"} 90.0
sglang:e2e_request_latency_seconds_count{model_name="qwen"} 7.0
sglang:e2e_request_latency_seconds_sum{model_name="qwen"} 12.5
"""
TRTLLM_PAGE = b"""trtllm_num_requests_running 1
trtllm_num_requests_waiting 4
trtllm_kv_cache_utilization 0.5
trtllm_generation_tokens_total 33
trtllm_prompt_tokens_total 128
trtllm_request_prefill_time_seconds_bucket{le="0.5"} 2
trtllm_request_prefill_time_seconds_bucket{le="+Inf"} 3
"""


@pytest.mark.parametrize(
    "engine, page, want",
    [
        (
            LLAMACPP,
            LLAMACPP_PAGE,
            dict(
                running=2,
                waiting=1,
                generation_tokens=96,
                prompt_tokens=412,
                iteration_count=130,
                kv_cache_usage=0.0,
                model_names=(),
            ),
        ),
        (
            SGLANG,
            SGLANG_PAGE,
            dict(
                running=3,
                waiting=0,
                kv_cache_usage=0.25,
                generation_tokens=700,
                prompt_tokens=90,
                request_success=7,
                model_names=("qwen",),
            ),
        ),
        (
            TRTLLM,
            TRTLLM_PAGE,
            dict(
                running=1,
                waiting=4,
                kv_cache_usage=0.5,
                generation_tokens=33,
                prompt_tokens=128,
                prefill_buckets=((0.5, 2.0), (float("inf"), 3.0)),
            ),
        ),
    ],
    ids=["llama.cpp", "sglang", "trtllm"],
)
def test_each_engines_page_fills_the_figures_it_has(engine, page, want):
    got = parse_page(page, engine.page)
    assert {k: getattr(got, k) for k in want} == want


@pytest.mark.parametrize("engine", [LLAMACPP, SGLANG, TRTLLM], ids=lambda e: e.name)
def test_another_engines_page_is_unreadable_and_says_which_server_it_expected(engine):
    vllm_page = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:generation_tokens_total 1\n"
    with pytest.raises(MetricsError, match=engine.page.hint.replace("?", r"\?")):
        parse_page(vllm_page, engine.page)


def test_every_engine_states_its_probe_paths_knob_and_what_its_page_lacks():
    assert set(ENGINES) == {"vllm", "llama.cpp", "sglang", "trtllm"}
    assert SGLANG.health_path == "/ping"  # its /health generates, and piled-up probes crashed it (#35884)
    assert TRTLLM.metrics_path == "/prometheus/metrics"  # /metrics is JSON that a read consumes
    assert LLAMACPP.knob is None and LLAMACPP.metrics_via_engine and LLAMACPP.single_process
    assert [e.knob.flag for e in (VLLM, SGLANG, TRTLLM) if e.knob] == [
        "--gpu-memory-utilization",
        "--mem-fraction-static",
        "--kv_cache_free_gpu_memory_fraction",
    ]
    assert all(e.lacks for e in (LLAMACPP, SGLANG, TRTLLM)) and VLLM.lacks == ()


# --- the probes, per engine ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "engine, status, offered",
    [
        (LLAMACPP, 501, False),
        (SGLANG, 404, False),
        (TRTLLM, 404, False),
        (VLLM, 404, True),
        (LLAMACPP, 503, True),
    ],
)
def test_a_page_not_enabled_is_said_with_the_flag_that_enables_it(monkeypatch, engine, status, offered):
    asked = []

    async def fake_get(client, url, timeout_s, max_bytes, address=None):
        asked.append(url)
        return Probe(False, status, 0.01, f"HTTP {status}"), b""

    monkeypatch.setattr(probes, "_get", fake_get)
    probe, sample = asyncio.run(probes.probe_metrics(None, replica(), 1.0, None, engine))  # type: ignore[arg-type]
    assert sample is None and asked == ["http://127.0.0.1:8001" + engine.metrics_path]
    o = as_engine(replace(obs(), metrics_probe=probe, metrics=None), engine)
    assert o.metrics_offered is offered
    if not offered:
        assert probe.error is not None and engine.metrics_flag is not None and engine.metrics_flag in probe.error


# --- the core, judging a replica without a page, or with one its engine's loop answers ----------------


def llama(t, health=OK, metrics="absent", **kw):
    """llama-server at T: METRICS "absent" (started without --metrics: 501), "hung" (queued to its task
    loop, no answer in time) or "read" (its page, idle)."""
    o = obs(t=t, health=health, **kw)
    if metrics == "absent":
        o = replace(o, metrics_probe=Probe(False, 501, 0.01, "not offered (HTTP 501)"), metrics=None)
    elif metrics == "hung":
        o = replace(o, metrics_probe=TIMEOUT, metrics=None)
    return replace(o, metrics_offered=metrics != "absent", metrics_via_engine=True)


def whole(t, used_ms=0.0, since_s=2.0):
    """One process that is engine and API server at once (ProcView.engine_whole)."""
    act = Activity(used_ms / 1000, False, 1)
    return ProcView(t, since_s, act, act, False, True)


def test_a_page_not_offered_is_no_problem_and_the_canary_still_goes_out():
    box = Box(cfg(1))
    box.tick(100.0, a=llama(100.0))
    assert (box.state(), box.rule()) == (State.HEALTHY, "L18")  # not degraded by a page it never had
    assert canaries(box.actions)  # learning: the canary is its engine's only probe


@pytest.mark.parametrize("metrics", ["absent", "hung"])
def test_an_idle_canary_a_whole_quiet_process_never_touches_proves_it_idle_dead(metrics):
    box = Box(cfg(1))
    box.tick(100.0, a=replace(llama(100.0, metrics=metrics), procs=whole(100.0, since_s=0)))
    assert canaries(box.actions)
    for t in (102.0, 104.0):
        box.tick(t, a=replace(llama(t, metrics=metrics), procs=whole(t)))
    assert (box.state(), box.rule()) == (State.IDLE_DEAD, "L21") and restarts(box.actions)
    assert "its processes (1 process) used no CPU" in box.tracks["a"].evidence


def test_clients_waiting_on_a_hung_task_loop_are_its_queue_and_a_quiet_process_proves_the_stall():
    """llama.cpp #27388: /health 200 from the HTTP thread, /metrics queued to the hung task loop, clients
    waiting; no page to count work by: the clients are the queue, the canary the proof (L20)."""
    box = Box(cfg(1, stall_canary_after_s=10, client_wait_s=3))
    box.tick(100.0, a=replace(llama(100.0, metrics="read"), procs=whole(100.0, since_s=0)))
    box.tick(
        101.0,
        a=replace(llama(101.0, metrics="read", canary=CanaryResult(True, 100.0, 0.1)), procs=whole(101.0, since_s=1)),
    )
    t = 102.0
    while t <= 140 and box.state() is not State.STALLED:
        box.tick(
            t, a=replace(llama(t, metrics="hung"), conns=conns(waiting=2, oldest_wait_s=t - 102.0), procs=whole(t))
        )
        t += 2.0
    assert (box.state(), box.rule()) == (State.STALLED, "L20")


def test_a_long_decode_that_computes_is_not_restarted_while_its_page_waits_on_it():
    """One long llama_decode (a big prompt's chunk): /metrics waits on it, its client waits, the
    process computes: nothing is proven before the stall window, as for vLLM's longest step."""
    box = Box(cfg(1, stall_canary_after_s=10, client_wait_s=3))
    box.tick(100.0, a=replace(llama(100.0, metrics="read"), procs=whole(100.0, since_s=0)))
    box.tick(
        101.0,
        a=replace(llama(101.0, metrics="read", canary=CanaryResult(True, 100.0, 0.1)), procs=whole(101.0, since_s=1)),
    )
    for t in range(102, 150, 2):
        box.tick(
            float(t),
            a=replace(
                llama(float(t), metrics="hung"),
                conns=conns(waiting=1, oldest_wait_s=t - 102.0),
                procs=whole(float(t), 1900),
            ),
        )
    assert box.state() is not State.STALLED and restarts(box.actions) == []


def test_a_page_that_vllm_fails_to_answer_still_holds_canaries_back():
    """vLLM answers /metrics from its API server, not its engine: an unread page there is no reason to
    send a canary (the metrics_via_engine distinction)."""
    box = Box(cfg(1))
    o = obs(t=100.0, metrics_down=True)
    box.tick(100.0, a=o)
    assert canaries(box.actions) == [] and box.state() is State.DEGRADED


# --- the memory knob and the processes -------------------------------------------------------------------


ENV = "/var/lib/guardian/replicas/a.env"


@pytest.mark.parametrize(
    "engine, argv, problem",
    [
        (SGLANG, ("python3", "-m", "sglang.launch_server", "--mem-fraction-static", "${GPU_MEMORY_UTILIZATION}"), None),
        (
            SGLANG,
            ("python3", "-m", "sglang.launch_server", "--gpu-memory-utilization", "${GPU_MEMORY_UTILIZATION}"),
            "pass --mem-fraction-static ${GPU_MEMORY_UTILIZATION}",
        ),
        (TRTLLM, ("trtllm-serve", "m", "--kv_cache_free_gpu_memory_fraction=$GPU_MEMORY_UTILIZATION"), None),
        (LLAMACPP, ("llama-server", "-m", "m.gguf"), "has no memory fraction to lower"),
    ],
)
def test_the_memory_guard_is_wired_by_each_engines_own_knob(engine, argv, problem):
    knob = engine.knob.flag if engine.knob is not None else None
    got = wiring_problem("a.service", (EnvFile(ENV, ""),), argv, ENV, knob, engine.label)
    assert got == problem if problem is None else problem in got


def test_a_running_servers_fraction_is_read_after_its_engines_flag():
    argv = ("python3", "-m", "sglang.launch_server", "--mem-fraction-static", "0.75")
    assert cmdline_fraction(argv, "--mem-fraction-static") == 0.75
    assert cmdline_fraction(argv) is None and cmdline_fraction(argv, None) is None


def test_a_single_process_engine_is_its_whole_replica_where_none_is_named():
    before = ([ProcStat(7, "llama-server", "S", 1, 1.0, 50)], [])
    after = ([ProcStat(7, "llama-server", "S", 1, 1.0, 50)], [])
    single = view(before, after, 10.0, 2.0, single_process=True)
    assert single.engine == single.api == Activity(0.0, False, 1) and single.engine_whole
    assert view(before, after, 10.0, 2.0).engine is None  # vLLM's API server alone: not its engine


def test_an_unknown_engine_in_a_whole_config_file_names_the_field(tmp_path):
    path = tmp_path / "g.toml"
    path.write_text(
        '[[replicas]]\nname = "a"\nunit = "a.service"\nurl = "http://127.0.0.1:1"\nmodel = "m"\nengine = "auto"\n'
    )
    assert load_config(path).replicas[0].engine == "auto"
    assert isinstance(Config.model_validate({"replicas": []}), Config)


# --- where each engine's model comes from (the start fit's files, the weights' fingerprint) -------------

@pytest.mark.parametrize("argv, env, model", [
    (("vllm", "serve", "/models/q", "--port", "1"), {}, "/models/q"),
    (("/usr/bin/python3", "-m", "sglang.launch_server", "--model-path", "/models/s"), {}, "/models/s"),
    (("trtllm-serve", "/models/t", "--port", "8355"), {}, "/models/t"),
    (("trtllm-serve", "serve", "/models/t2"), {}, "/models/t2"),
    (("/usr/bin/llama-server", "-m", "/srv/m.gguf", "--port", "1"), {}, "/srv/m.gguf"),
    (("/usr/bin/llama-server", "--port", "1"), {"LLAMA_ARG_MODEL": "/srv/e.gguf"}, "/srv/e.gguf"),
    (("/usr/bin/python3", "-m", "vllm_sim", "--port", "1"), {}, None),  # `python3 -m MODULE` is no model
])
def test_each_engines_model_is_found_on_its_command_line(argv, env, model):
    from guardian.observe.modelfiles import model_of

    assert model_of(argv, env) == model


# --- the README's unit per engine --------------------------------------------------------------------


def _readme_units() -> dict[str, str]:
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    found = dict(re.findall(r"<!-- unit:engine:([a-z.]+) -->\n```ini\n(.*?)```\n<!-- /unit:engine:\1 -->", text, re.S))
    assert set(found) == set(ENGINES), f"the README's units per engine: {sorted(found)}"
    return found


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_the_readmes_unit_per_engine_is_told_by_auto_and_wired_where_the_engine_has_a_knob(name):
    import shlex

    unit = _readme_units()[name]
    lines = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#"))
    argv = tuple(shlex.split(lines["ExecStart"]))
    found = detect(engine_words(argv))
    assert found is not None and found[0].name == name
    engine = ENGINES[name]
    env_file = lines.get("EnvironmentFile", "").lstrip("-")
    knob = engine.knob.flag if engine.knob is not None else None
    problem = wiring_problem("x.service", (EnvFile(env_file, ""),), argv, env_file, knob, engine.label)
    assert (problem is None) == (engine.knob is not None), problem
    assert lines["Restart"] == "always"
    if engine.metrics_flag is not None and engine.metrics_flag.startswith("--"):
        assert engine.metrics_flag in argv  # the page guardian counts work by is on


# --- gauges that lag their engine's steps (SGLang), and a whole process answering guardian's probes ---------


def stale_one_running(t, lags):
    """An engine whose last batch ended at 100: its page still says 1 running (SGLang refreshes its gauges
    per prefill batch and every 40 decode steps), its scheduler idle and quiet."""
    from harness import sample

    o = replace(obs(t=t, s=sample(gen=50, running=1)), queue_lags=lags)
    return replace(o, procs=ProcView(t, 2.0, Activity(0.03, False, 1), Activity(0.0, False, 1), True))


@pytest.mark.parametrize("lags, stalled", [(False, True), (True, False)], ids=["current-gauges", "lagging-gauges"])
def test_a_lagging_running_gauge_in_a_quiet_engine_proves_no_work(lags, stalled):
    from guardian.core.observations import PersistentView

    learned = PersistentView(canary_latencies={"a": (0.1, 0.1, 0.1)})  # no learning canary in the way
    box = Box(cfg(1, stall_canary_after_s=60, canary_after_traffic_s=60), learned)
    box.tick(100.0, a=replace(stale_one_running(100.0, lags), procs=None))
    for t in (102.0, 104.0):  # two quiet looks: engine_quiet_s (4 s)
        box.tick(t, a=stale_one_running(t, lags))
    assert (box.state() is State.STALLED) == stalled
    assert (box.rule() == "L19") == stalled
    assert bool(restarts(box.actions)) == stalled


@pytest.mark.parametrize("used_ms, answered, quiet", [
    (40.0, 3, True),  # a Python server's three answers: within 20 ms + 3 x 15 ms
    (70.0, 3, False),  # more than its probes explain: it computes
    (40.0, 0, False),  # no probe answered: only the plain 20 ms
])
def test_a_whole_process_engine_is_allowed_guardians_own_probes(used_ms, answered, quiet):
    from guardian.core.watchdog.fold import _fold_procs
    from guardian.core.watchdog.track import Track

    o = obs(t=10.0)
    if answered == 0:
        o = replace(o, health=TIMEOUT, metrics_probe=TIMEOUT, models_probe=TIMEOUT)
    o = replace(o, procs=whole(10.0, used_ms))
    track = _fold_procs(Track(), o, 0.01, 0.015)
    assert (track.engine_quiet_since is not None) == quiet
    named = replace(o, procs=ProcView(10.0, 2.0, Activity(0.0, False, 1), Activity(used_ms / 1000, False, 1), True))
    assert _fold_procs(Track(), named, 0.01, 0.015).engine_quiet_since is None  # a named engine: no allowance


def test_the_wiring_the_start_fit_and_the_daemon_tell_one_engine_from_an_expanded_exec_start(tmp_path):
    """An ExecStart= whose program is a ${VAR}: the daemon told the engine from it expanded, the memory
    guard's wiring and the start fit from it raw, so one replica had two engines (and two knobs)."""
    import asyncio

    from guardian.config import Config
    from guardian.observe import declared as declared_mod
    from guardian.observe import memory, startlook
    from guardian.observe.replicas import engine_told
    from guardian.observe.systemd import ServiceDetails

    env = tmp_path / "llama.env"
    env.write_text("SERVER=/usr/bin/llama-server\n")
    details = ServiceDetails((str(env),), ("${SERVER}", "-m", "/models/x.gguf", "--port", "8001"))
    cfg = Config.model_validate({"replicas": [{"name": "a", "unit": "llama-a.service", "url": "http://127.0.0.1:8001",
                                               "model": "m", "engine": "auto"}]})
    r = cfg.replicas[0]

    class Sd:
        async def service_details(self, unit):
            return details

    daemon = engine_told(r, declared_mod.declared_from(r.unit, details)).engine.label
    wiring = asyncio.run(memory.wiring_of(Sd(), cfg, r)).engine  # type: ignore[arg-type]
    fit = startlook.look(cfg, r, None, details).engine.label  # the start fit's look (no process: pid 0)
    assert daemon == wiring == fit == "llama.cpp (llama-server)", (daemon, wiring, fit)
