"""guardian's metrics, folded from the real tick.decide on a fake clock, rendered and parsed back;
the file_sd targets; and the /metrics endpoint against slow, idle and hostile clients."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from guardian.config import Config, MetricsConfig, ReplicaConfig
from guardian.core.actions import LogLine, RestartUnit
from guardian.core.hazards import Hazard
from guardian.core.observations import CanaryResult, Pause, PersistentView, ProxyView, RestartOutcome
from guardian.core.vocab import RESTART_STATES, Decision, Gate, Priority, RestartKind, State
from guardian.export.files import file_sd
from guardian.export.http import MAX_CONNECTIONS, MetricsServer
from guardian.export.metrics import DETECTION_BUCKETS_S, REFUSAL_GATES, RESTART_REASONS, Metrics
from guardian.observe.clock import Now
from harness import TIMEOUT, Box, cfg, fleet_view, obs, sample, unit, with_fleet, with_proxy
from systemd_box import wait_for

WALL0 = 1_800_000_000.0
REPO = Path(__file__).resolve().parent.parent


def now(t: float) -> Now:
    return Now(t, WALL0 + t)


def samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: Metrics, name: str, **labels) -> float | None:
    return samples(m).get((name, tuple(sorted(labels.items()))))


def folded(box: Box, m: Metrics, t: float, **replicas) -> list:
    """One tick of BOX at T, then its actions counted into M as the executor performs them, and M's
    gauges set, as the daemon does after every tick."""
    acts = box.tick(t, **replicas)
    for a in acts:
        m.count(a, box.tracks, now(t))
    m.gauges(box.cfg, box.core, box.observation, box.persistent, now(t))
    return acts


def test_a_frozen_replica_counts_one_restart_one_detection_and_its_way_back_to_serving():
    box = Box(cfg(2))
    m = Metrics("9.9.9", box.cfg)
    series_at_start = {k for k in samples(m) if k[0] == "guardian_restarts_total"}
    for t in (100.0, 102.0):
        folded(box, m, t)
    assert value(m, "guardian_replica_state", replica="a", unit="vllm-a.service", state="healthy") == 1
    assert value(m, "guardian_replica_state", replica="a", unit="vllm-a.service", state="unresponsive") == 0
    assert value(m, "guardian_restart_budget_remaining", replica="a") == 3
    t = 104.0
    while not box.of(RestartUnit):
        folded(box, m, t, a=obs("a", t, health=TIMEOUT))
        t += 2.0
        assert t < 140, "no restart decided"
    decided = t - 2.0
    assert value(m, "guardian_restarts_total", replica="a", reason="unresponsive") == 1
    # counted under a series that existed at 0 from the start: increase() sees this first restart
    assert {k for k in samples(m) if k[0] == "guardian_restarts_total"} == series_at_start
    assert value(m, "guardian_detection_seconds_count", replica="a") == 1
    assert value(m, "guardian_detection_seconds_count", replica="b") == 0
    # the last answer came at 102 s: the detection is counted from there (unresponsive_after_s = 10)
    assert value(m, "guardian_detection_seconds_sum", replica="a") == pytest.approx(decided - 102.0) == 10.0
    assert value(m, "guardian_restart_to_serving_seconds_count", replica="a") == 0
    # the new process (started after the decision) serves 20 s later
    started = decided + 1.0
    u = unit("vllm-a.service", inactive_exit_mono=started)
    done = RestartOutcome("vllm-a.service", "done", issued=True, ok=True)
    folded(box, m, decided + 2, a=obs("a", decided + 2, u=u, outcome=done))
    for t2 in (decided + 21, decided + 23):
        folded(box, m, t2, a=obs("a", t2, u=u))
    assert box.state("a") is State.HEALTHY
    assert value(m, "guardian_restart_to_serving_seconds_count", replica="a") == 1
    assert value(m, "guardian_restart_to_serving_seconds_sum", replica="a") <= 21.0
    assert value(m, "guardian_restart_to_serving_seconds_count", replica="b") == 0
    assert value(m, "guardian_restarts_total", replica="b", reason="unresponsive") == 0


def test_refusals_canaries_hazards_and_one_hot_states():
    m = Metrics("9.9.9")
    box = Box(cfg(2))
    box.tick(100.0)
    refusal = LogLine(Priority.ERROR, "refused", Decision.REFUSED, "a", "vllm-a.service", gate=Gate.MASKED)
    canary = CanaryResult(False, 99.0, 15.0, "timeout")
    o = box.tick(102.0, a=obs("a", 102.0, canary=canary))
    for a in [*o, refusal]:
        m.count(a, box.tracks, now(102.0))
    m.gauges(box.cfg, box.core, box.observation, box.persistent, now(102.0))
    assert value(m, "guardian_restart_refusals_total", replica="a", gate="masked") == 1
    assert value(m, "guardian_canary_failures_total", replica="a") == 1
    assert value(m, "guardian_canary_duration_seconds_count") == 1
    assert value(m, "guardian_build_info", version="9.9.9") == 1
    states = {k: v for k, v in samples(m).items() if k[0] == "guardian_replica_state" and ("replica", "a") in k[1]}
    assert len(states) == len(State) and sum(states.values()) == 1
    m.set_hazards([Hazard("masked:vllm-a.service", "x", "a", "vllm-a.service")])
    assert value(m, "guardian_hazards", kind="masked", unit="vllm-a.service") == 1
    m.set_hazards([])
    assert value(m, "guardian_hazards", kind="masked", unit="vllm-a.service") is None


def test_every_configured_replica_has_every_counter_and_histogram_at_0_from_the_start():
    """A labelled series that appears with its first increment is missed by increase() (issue 23):
    after construction with a 2-replica config, every replica x every label value the code can
    count (derived from the enums: the verdicts that ask for a restart, every gate) is there at 0."""
    m = Metrics("9.9.9", cfg(2))
    reasons = {"operator", "memory"} | {str(s) for s in RESTART_STATES}
    assert set(RESTART_REASONS) == reasons and set(REFUSAL_GATES) == {str(g) for g in Gate}
    found = samples(m)

    def labelled(name: str) -> dict[tuple[tuple[str, str], ...], float]:
        return {labels: v for (n, labels), v in found.items() if n == name}

    assert labelled("guardian_restarts_total") == {
        (("reason", r), ("replica", x)): 0 for r in reasons for x in "ab"}
    assert labelled("guardian_restart_refusals_total") == {
        (("gate", str(g)), ("replica", x)): 0 for g in Gate for x in "ab"}
    for name in ("guardian_canary_failures_total", "guardian_memory_lowerings_total",
                 "guardian_detection_seconds_count", "guardian_restart_to_serving_seconds_count"):
        assert labelled(name) == {(("replica", "a"),): 0, (("replica", "b"),): 0}, name
    buckets = labelled("guardian_detection_seconds_bucket")
    assert len(buckets) == 2 * (len(DETECTION_BUCKETS_S) + 1) and set(buckets.values()) == {0}

    # a reload: a replica gone takes its series along; one added starts at 0
    m.restarts.labels("a", "stalled").inc()
    m.configure(cfg(1))
    assert {labels for labels in labelled_now(m, "guardian_restarts_total") if ("replica", "b") in labels} == set()
    m.configure(cfg(3))
    assert value(m, "guardian_restarts_total", replica="a", reason="stalled") == 1  # kept across reloads
    assert value(m, "guardian_restarts_total", replica="c", reason="operator") == 0
    assert value(m, "guardian_restart_refusals_total", replica="b", gate="budget") == 0


def labelled_now(m: Metrics, name: str) -> set[tuple[tuple[str, str], ...]]:
    return {labels for (n, labels) in samples(m) if n == name}


def test_no_created_series_in_guardians_output_and_other_registries_are_left_alone():
    """`*_created` (six families, a line per label set) are noise: guardian's registry drops them,
    without prometheus_client's process-wide switch."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    box = Box(cfg(2))
    m = Metrics("9.9.9", box.cfg)
    folded(box, m, 100.0)
    m.count(RestartUnit("a", "vllm-a.service", RestartKind.OPERATOR, "asked"), box.tracks, now(100.0))
    m.tick_done(0.01, now(100.0))
    text = m.render().decode()
    assert "guardian_restarts_total" in text and "guardian_tick_duration_seconds_count" in text
    assert not [line for line in text.splitlines() if re.match(r"(# (HELP|TYPE) )?\S+_created\b", line)]
    other = CollectorRegistry()
    Counter("other_things", "x", registry=other).inc()
    assert b"other_things_created" in generate_latest(other)


def test_dry_run_pauses_proxy_marks_and_etcd_each_have_a_gauge():
    """Issue 23: what a box runs in, a pause and since when, a replica marked down at the proxy,
    and whether etcd answered, each readable by an alert."""
    paused_cfg = with_fleet(with_proxy(cfg(2))).model_copy(update={"dry_run": True})
    box = Box(paused_cfg, PersistentView(pauses={"a": Pause(None)}))
    m = Metrics("9.9.9", box.cfg)
    box.tick(100.0, proxy=ProxyView(frozenset({"b"})), fleet=fleet_view(ok=False, error="refused"))
    m.gauges(box.cfg, box.core, box.observation, box.persistent, now(100.0))
    box.tick(102.0, proxy=ProxyView(frozenset({"b"})), fleet=fleet_view(ok=False, error="refused"))
    m.gauges(box.cfg, box.core, box.observation, box.persistent, now(102.0))
    assert box.state("a") is State.PAUSED
    assert value(m, "guardian_dry_run") == 1
    assert value(m, "guardian_replica_paused", replica="a", unit="vllm-a.service") == 1
    assert value(m, "guardian_replica_paused", replica="b", unit="vllm-b.service") == 0
    # the pause began at the first tick that saw it, not at each tick
    assert value(m, "guardian_replica_paused_since_timestamp_seconds", replica="a", unit="vllm-a.service") == WALL0 + 100
    assert value(m, "guardian_replica_paused_since_timestamp_seconds", replica="b", unit="vllm-b.service") is None
    assert value(m, "guardian_proxy_marked_down", replica="b", unit="vllm-b.service") == 1
    assert value(m, "guardian_proxy_marked_down", replica="a", unit="vllm-a.service") == 0
    assert value(m, "guardian_etcd_up", fleet="default") == 0
    box.tick(104.0, proxy=ProxyView(frozenset()), fleet=fleet_view())
    m.gauges(box.cfg, box.core, box.observation, box.persistent, now(104.0))
    assert value(m, "guardian_etcd_up", fleet="default") == 1
    assert value(m, "guardian_proxy_marked_down", replica="b", unit="vllm-b.service") == 0

    # a pause that records when it began (`guardian pause` writes `since`) is dated from then, across guardian restarts
    recorded = Box(cfg(2), PersistentView(pauses={"a": Pause(None, since=40.0)}))
    m3 = Metrics("9.9.9", recorded.cfg)
    recorded.tick(100.0)
    m3.gauges(recorded.cfg, recorded.core, recorded.observation, recorded.persistent, now(100.0))
    assert value(m3, "guardian_replica_paused_since_timestamp_seconds", replica="a", unit="vllm-a.service") == WALL0 + 40

    # without [proxy] and [fleet], and not in dry run: no proxy or etcd series at all; the pause ended
    plain = Box(cfg(2))
    m2 = Metrics("9.9.9", plain.cfg)
    folded(plain, m2, 100.0)
    assert value(m2, "guardian_dry_run") == 0
    assert value(m2, "guardian_replica_paused", replica="a", unit="vllm-a.service") == 0
    names = {n for n, _ in samples(m2)}
    assert not names & {"guardian_proxy_marked_down", "guardian_etcd_up",
                        "guardian_replica_paused_since_timestamp_seconds"}


def readme_metrics() -> dict[str, str]:
    """The README's table of metrics: name -> type."""
    text = (REPO / "README.md").read_text()
    return dict(re.findall(r"^\| `(guardian_[a-z0-9_]+)` \| (counter|gauge|histogram) \|", text, re.M))


def test_every_name_follows_prometheus_rules():
    m = Metrics("9.9.9")
    text = m.render().decode()
    fams = list(text_string_to_metric_families(text))
    assert fams and all(f.name.startswith("guardian_") for f in fams)
    for f in fams:
        assert not any(unit in f.name for unit in ("_ms", "_milliseconds", "_percent", "_gib", "_mib"))
    # Each counter is exposed as NAME_total (prometheus_client adds the suffix, the parser strips it
    # again: neither can tell). What can go wrong is a counter the README does not name, or names
    # otherwise: the exposition's counters are exactly the README's, by their full names.
    exposed = {name for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M) if kind == "counter"}
    documented = {name for name, kind in readme_metrics().items() if kind == "counter"}
    assert documented and exposed == documented


def test_file_sd_lists_each_replica_by_its_own_address_and_path():
    cfg = Config(
        replicas=[
            ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:8001", model="m1"),
            ReplicaConfig(name="b", unit="vllm-b.service", url="https://10.0.0.2:8443/v/", model="m2"),
        ],
        metrics=MetricsConfig(box="spark-1"),
    )
    groups = json.loads(json.dumps(file_sd(cfg)))
    assert groups == [
        {"targets": ["127.0.0.1:8001"], "labels": {"replica": "a", "unit": "vllm-a.service", "model": "m1",
                                                   "box": "spark-1", "__scheme__": "http", "__metrics_path__": "/metrics"}},
        {"targets": ["10.0.0.2:8443"], "labels": {"replica": "b", "unit": "vllm-b.service", "model": "m2",
                                                  "box": "spark-1", "__scheme__": "https", "__metrics_path__": "/v/metrics"}},
    ]


@pytest.mark.parametrize("address", ["", "9464", "127.0.0.1:0", "127.0.0.1:70000", "host :1", ":9464"])
def test_a_bad_metrics_address_is_refused(address):
    with pytest.raises(ValueError):
        MetricsConfig(address=address)


# --- the endpoint ----------------------------------------------------------------------------


@pytest.fixture
def server():
    s = MetricsServer("127.0.0.1", 0, stale_after_s=2.0)
    s.start()
    yield s
    s.stop()


def test_the_endpoint_serves_what_the_tick_published_and_nothing_else(server):
    base = f"http://127.0.0.1:{server.port}"
    assert httpx.get(base + "/healthz").status_code == 503  # no tick yet
    server.publish(b"guardian_x 1\n", time.monotonic())
    r = httpx.get(base + "/metrics")
    assert r.status_code == 200 and r.content == b"guardian_x 1\n" and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert httpx.get(base + "/metrics?x=1").status_code == 200
    server.publish(b"guardian_x 1\n", time.monotonic())  # a tick just now: a loaded box's GETs above took long
    assert httpx.get(base + "/healthz").status_code == 200
    assert httpx.post(base + "/metrics", content=b"x").status_code == 405
    assert httpx.get(base + "/").status_code == 404
    assert httpx.get(base + "/metrics/../etc/passwd").status_code == 404
    # the loop stops completing ticks: /healthz turns 503 on its own
    wait_for(lambda: httpx.get(base + "/healthz").status_code == 503, 30, "/healthz to say stuck")
    assert "stuck" in httpx.get(base + "/healthz").text


def test_idle_and_endless_clients_cannot_delay_the_main_loop_or_grow_without_bound(server):
    """Many connections that never finish their request: the server holds at most
    MAX_CONNECTIONS of them; the main thread's event loop (where ticks and watchdog pings run)
    keeps its timers, and a scrape works again once the idle ones time out."""
    base = f"http://127.0.0.1:{server.port}"
    server.publish(b"guardian_x 1\n", time.monotonic())
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4 * MAX_CONNECTIONS)]
    endless = socket.create_connection(("127.0.0.1", server.port))
    stop = threading.Event()

    def drip():
        try:
            endless.sendall(b"GET /metrics HTTP/1.1\r\n")
            while not stop.is_set():
                endless.sendall(b"X-A: " + b"a" * 1000 + b"\r\n")
                stop.wait(0.01)
        except OSError:
            pass

    t = threading.Thread(target=drip)
    t.start()
    try:
        async def ticks() -> float:
            late = 0.0
            for _ in range(20):
                before = time.monotonic()
                await asyncio.sleep(0.05)
                late = max(late, time.monotonic() - before - 0.05)
            return late

        # The deadline only stops a hung test; how late the timers ran is printed (bench/ has the figure).
        late_s = asyncio.run(asyncio.wait_for(ticks(), 60))
        print(f"the main loop's timers ran at most {late_s:.2f} s late beside {4 * MAX_CONNECTIONS} idle clients")
        assert server._active <= MAX_CONNECTIONS + 1
        for s in idle:
            s.close()
        wait_for(lambda: _scrape(base) == b"guardian_x 1\n", 30, "a scrape after the idle clients went")
    finally:
        stop.set()
        t.join()
        endless.close()


def _scrape(base: str) -> bytes | None:
    try:
        r = httpx.get(base + "/metrics", timeout=1)
        return r.content if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def test_a_port_in_use_is_an_error_for_the_caller(server):
    other = MetricsServer("127.0.0.1", server.port, stale_after_s=1)
    with pytest.raises(OSError):
        other.start()


# --- the dashboard and the alerts use only what guardian exports -------------------------------

NAME = re.compile(r"\b(guardian_[a-z0-9_]+|node_[a-z0-9_]+|up)\b(?!\s*\()")


def exported_names() -> set[str]:
    names = set()
    for fam in Metrics("x").registry.collect():
        if fam.type == "counter":
            names.add(fam.name + "_total")
        elif fam.type == "histogram":
            names |= {fam.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            names.add(fam.name)
    return names


def dashboard_panels() -> list[dict]:
    return json.loads((REPO / "packaging/grafana/guardian-dashboard.json").read_text())["panels"]


def test_every_dashboard_expression_names_only_metrics_guardian_exports():
    exprs = [t["expr"] for p in dashboard_panels() for t in p["targets"]]
    assert len(exprs) >= 10
    exported = exported_names()
    used = set()
    for e in exprs:
        found = set(NAME.findall(e))
        assert found, e
        assert found <= exported, (e, found - exported)
        used |= found
    # states, restarts, detection, canary latency, headroom, PSI, fractions, the restart budget, gave
    # up, pauses, the proxy's marks, dry run and etcd: all on the dashboard
    for name in ("guardian_replica_state", "guardian_restarts_total", "guardian_detection_seconds_bucket",
                 "guardian_canary_duration_seconds_bucket", "guardian_memory_available_bytes",
                 "guardian_memory_pressure_some_ratio", "guardian_replica_gpu_memory_utilization_ratio",
                 "guardian_restart_budget_remaining", "guardian_gave_up", "guardian_replica_paused",
                 "guardian_proxy_marked_down", "guardian_dry_run", "guardian_etcd_up"):
        assert name in used, name


def target_unit(expr: str) -> str:
    """The Grafana unit of what EXPR computes, from the units its metric names carry."""
    names = set(NAME.findall(expr))
    if any(n.endswith("_timestamp_seconds") for n in names):
        return "s" if "time() -" in expr else "dateTimeAsIso"
    if any(n.endswith(("_seconds", "_seconds_bucket", "_seconds_sum")) for n in names):
        return "s"
    if any(n.endswith("_bytes") for n in names):
        return "bytes"
    if any(n.endswith("_ratio") for n in names):
        return "percentunit"
    return "short"  # counts, states, flags


def test_every_dashboard_panel_shows_one_unit_and_the_restart_budget_and_gave_up_have_panels():
    """Issue 23: two panels drew seconds and counts on one axis (canary latency and failures;
    fractions and lowerings per hour)."""
    panels = dashboard_panels()
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        unit = p["fieldConfig"]["defaults"].get("unit")
        assert unit, p["title"]
        for override in p["fieldConfig"].get("overrides", []):
            assert all(prop["id"] != "unit" or prop["value"] == unit for prop in override["properties"]), p["title"]
        assert {target_unit(t["expr"]) for t in p["targets"]} == {unit}, p["title"]
    by_title = {p["title"]: p for p in panels}
    budget = next(p for t, p in by_title.items() if "budget" in t.lower())
    gave_up = next(p for t, p in by_title.items() if "gave up" in t.lower())
    assert "guardian_restart_budget_remaining" in budget["targets"][0]["expr"]
    assert "guardian_gave_up" in gave_up["targets"][0]["expr"]


RULES = REPO / "packaging/prometheus/guardian-rules.yml"
RUNBOOK = "https://example.invalid/guardian/README.md#"


def alerts() -> dict[str, dict[str, str]]:
    """guardian-rules.yml's alerts: name -> its expr and runbook_url (no YAML parser in the venv)."""
    out = {}
    for block in re.split(r"^      - alert: ", RULES.read_text(), flags=re.M)[1:]:
        name, _, body = block.partition("\n")
        expr = re.search(r"^        expr: (?:>-\n)?(.*?)(?=^        \w)", body, re.M | re.S)
        url = re.search(r'^          runbook_url: "(.*)"$', body, re.M)
        out[name.strip()] = {"expr": expr.group(1) if expr else "", "runbook_url": url.group(1) if url else ""}
    return out


def test_every_alert_expression_names_metrics_that_exist():
    found = alerts()
    assert len(found) == RULES.read_text().count("- alert:") >= 14
    for name, a in found.items():
        assert NAME.findall(a["expr"]), name
        for metric in NAME.findall(a["expr"]):
            assert metric in exported_names() or metric in ("node_textfile_mtime_seconds", "up"), (name, metric)


def test_every_alert_has_a_runbook_url_into_the_readmes_runbook():
    for name, a in alerts().items():
        assert a["runbook_url"] == RUNBOOK + name.lower(), name


def test_readme_has_a_runbook_heading_for_every_alert():
    """Each runbook_url's anchor is GitHub's for a README heading `#### <AlertName>`: an alert
    added without its runbook entry fails here."""
    headings = set(re.findall(r"^#### (Guardian\w+)\s*$", (REPO / "README.md").read_text(), re.M))
    assert set(alerts()) <= headings, sorted(set(alerts()) - headings)


def test_every_alert_has_a_promtool_case_where_it_fires_and_one_where_it_does_not():
    """guardian-rules.test.yml (run by promtool in test_system_prometheus.py) proves each alert
    quiet before its condition or its `for:` and firing after."""
    text = (REPO / "packaging/prometheus/guardian-rules.test.yml").read_text()
    cases = re.findall(r"alertname: (\w+)\n\s+exp_alerts:(.*)", text)
    quiet = {name for name, rest in cases if rest.strip() == "[]"}
    firing = {name for name, rest in cases if rest.strip() == ""}
    assert set(alerts()) <= quiet, sorted(set(alerts()) - quiet)
    assert set(alerts()) <= firing, sorted(set(alerts()) - firing)


# --- files others can plant in (issue 21): read back bounded, written without following links ---------

def _sd_config(path) -> Config:
    return Config(replicas=[ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:8001", model="m")],
                  metrics=MetricsConfig(file_sd_path=path))


def _within(fn, timeout_s: float, unblock=lambda: None):
    """fn() in a thread; fails (after UNBLOCK) if it does not return within TIMEOUT_S."""
    out: list[object] = []

    def go():
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        unblock()
        pytest.fail(f"did not return within {timeout_s:g} s")
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


@pytest.mark.parametrize("plant", ["fifo", "link to /dev/zero", "link to a file", "large file"])
def test_what_is_planted_at_the_file_sd_path_is_replaced_by_a_regular_file_never_read(tmp_path, plant):
    """A FIFO blocked guardian's start and reload; a link to /dev/zero took 1308 MiB, then MemoryError."""
    import os
    import stat

    from guardian.export.files import FILE_SD_MAX_BYTES, write_file_sd

    path = tmp_path / "sd" / "guardian.json"
    path.parent.mkdir()
    cfg = _sd_config(path)
    # what guardian would write, so that a link to it read through passes for "unchanged"
    target = tmp_path / "target"
    target.write_text(json.dumps(file_sd(cfg), indent=1, sort_keys=True) + "\n")
    before = target.read_text()
    if plant == "fifo":
        os.mkfifo(path)
    elif plant == "large file":
        path.write_bytes(b"[" * (FILE_SD_MAX_BYTES + 1))
    else:
        path.symlink_to("/dev/zero" if "zero" in plant else target)
    unblock = (lambda: os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))) if plant == "fifo" else (lambda: None)
    assert _within(lambda: write_file_sd(cfg), 5, unblock) == path
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644
    assert json.loads(path.read_text()) == json.loads(json.dumps(file_sd(cfg)))
    assert target.read_text() == before
    assert write_file_sd(cfg) is None  # read back, the same: not written again


def test_atomic_write_sets_the_mode_on_its_descriptor_and_renames_only_the_file_it_wrote(tmp_path, monkeypatch):
    """Another user of a group-writable directory swaps the temporary file for a symlink between
    the write and the rename: a chmod by name changed the link's target (a 0600 file became
    0644), and the rename made guardian.prom that link."""
    import os
    import stat

    from guardian.act.state import atomic_write
    from guardian.export.files import TEXTFILE_NAME, write_textfile

    victim = tmp_path / "secret"
    victim.write_text("0600\n")
    victim.chmod(0o600)
    textfiles = tmp_path / "textfile"
    textfiles.mkdir()
    prom = textfiles / TEXTFILE_NAME
    prom.symlink_to(victim)  # planted at the target: replaced, not followed
    write_textfile(textfiles, b"guardian_x 1\n")
    assert not prom.is_symlink() and prom.read_bytes() == b"guardian_x 1\n"
    assert stat.S_IMODE(prom.stat().st_mode) == 0o644 and victim.read_text() == "0600\n"

    real_fsync = os.fsync

    def swap_then_fsync(fd: int) -> None:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            for tmp in textfiles.glob(f".{TEXTFILE_NAME}.*.tmp"):
                tmp.unlink()
                tmp.symlink_to(victim)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", swap_then_fsync)
    with pytest.raises(OSError, match="replaced by another process"):
        write_textfile(textfiles, b"guardian_x 2\n")
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600 and victim.read_text() == "0600\n"
    assert not prom.is_symlink() and prom.read_bytes() == b"guardian_x 1\n"
    assert [p.name for p in textfiles.iterdir()] == [TEXTFILE_NAME]
    monkeypatch.setattr(os, "fsync", real_fsync)

    # and no mode is ever set by name
    monkeypatch.setattr(os, "chmod", lambda *a, **kw: pytest.fail(f"chmod by name: {a}"))
    atomic_write(textfiles / "private", b"x", mode=0o600)
    assert stat.S_IMODE((textfiles / "private").stat().st_mode) == 0o600


TICK_GAUGES = ("guardian_replica_state", "guardian_replica_info", "guardian_replica_paused",
               "guardian_replica_paused_since_timestamp_seconds", "guardian_proxy_marked_down",
               "guardian_restart_budget_remaining", "guardian_gave_up",
               "guardian_replica_last_progress_timestamp_seconds", "guardian_replica_gpu_memory_utilization_ratio")


def _tick_gauge_lines(m: Metrics) -> list[str]:
    """The rendered lines of the gauges each tick sets anew, in the page's order."""
    return [line for line in m.render().decode().splitlines()
            if not line.startswith("#") and line.split("{", 1)[0].split(" ", 1)[0] in TICK_GAUGES]


def test_the_gauges_each_tick_sets_are_what_a_fresh_registry_shows_tick_after_tick():
    """The children kept from tick to tick (_EachTick) give the series, values and order that
    clearing and setting each of them anew gives (here: a fresh Metrics each tick), through a pause,
    its end, a replica marked down, one added and one gone by a reload, and a replica's progress."""
    two, three = with_proxy(cfg(2)), with_proxy(cfg(3))
    box = Box(two)
    kept = Metrics("9.9.9", two)
    steps = [
        (two, PersistentView(), frozenset()),
        (two, PersistentView(pauses={"a": Pause(None)}), frozenset()),
        (two, PersistentView(pauses={"a": Pause(None)}), frozenset({"b"})),
        (two, PersistentView(), frozenset({"b"})),
        (three, PersistentView(), frozenset()),
        (two, PersistentView(), frozenset()),
        (two, PersistentView(), frozenset()),
    ]
    t, seen = 100.0, []
    for config, persistent, down in steps:
        box.cfg, box.persistent = config, persistent
        box.tick(t, proxy=ProxyView(down), a=obs("a", t, s=sample(gen=t)))
        fresh = Metrics("9.9.9", config)
        for m in (kept, fresh):
            m.gauges(box.cfg, box.core, box.observation, box.persistent, now(t))
        assert _tick_gauge_lines(kept) == _tick_gauge_lines(fresh), t
        seen.append("\n".join(_tick_gauge_lines(kept)))
        t += 2.0
    # the series did come and go: a pause's start, a third replica, a's progress at each tick
    assert ["paused_since" in page for page in seen] == [False, True, True, False, False, False, False]
    assert ['replica="c"' in page for page in seen] == [False, False, False, False, True, False, False]
    assert len(set(seen)) == len(seen)
