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
from guardian.core.observations import CanaryResult, RestartOutcome
from guardian.core.vocab import Decision, Gate, Priority, State
from guardian.export.files import file_sd
from guardian.export.http import MAX_CONNECTIONS, MetricsServer
from guardian.export.metrics import Metrics
from guardian.observe.clock import Now
from harness import TIMEOUT, Box, cfg, obs, unit
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
    box, m = Box(cfg(2)), Metrics("9.9.9")
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
    assert value(m, "guardian_detection_seconds_count") == 1
    # the last answer came at 102 s: the detection is counted from there (unresponsive_after_s = 10)
    assert value(m, "guardian_detection_seconds_sum") == pytest.approx(decided - 102.0) == 10.0
    assert value(m, "guardian_restart_to_serving_seconds_count") == 0
    # the new process (started after the decision) serves 20 s later
    started = decided + 1.0
    u = unit("vllm-a.service", inactive_exit_mono=started)
    done = RestartOutcome("vllm-a.service", "done", issued=True, ok=True)
    folded(box, m, decided + 2, a=obs("a", decided + 2, u=u, outcome=done))
    for t2 in (decided + 21, decided + 23):
        folded(box, m, t2, a=obs("a", t2, u=u))
    assert box.state("a") is State.HEALTHY
    assert value(m, "guardian_restart_to_serving_seconds_count") == 1
    assert value(m, "guardian_restart_to_serving_seconds_sum") <= 21.0
    assert value(m, "guardian_restarts_total", replica="b", reason="unresponsive") is None


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
    s = MetricsServer("127.0.0.1", 0, stale_after_s=0.5)
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
    assert httpx.get(base + "/healthz").status_code == 200
    assert httpx.post(base + "/metrics", content=b"x").status_code == 405
    assert httpx.get(base + "/").status_code == 404
    assert httpx.get(base + "/metrics/../etc/passwd").status_code == 404
    # the loop stops completing ticks: /healthz turns 503 on its own
    wait_for(lambda: httpx.get(base + "/healthz").status_code == 503, 5, "/healthz to say stuck")
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

        late_s = asyncio.run(ticks())
        assert late_s < 0.5, f"the main loop's timers ran {late_s:.2f} s late"
        assert server._active <= MAX_CONNECTIONS + 1
        for s in idle:
            s.close()
        wait_for(lambda: _scrape(base) == b"guardian_x 1\n", 15, "a scrape after the idle clients went")
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


def test_every_dashboard_expression_names_only_metrics_guardian_exports():
    dash = json.loads((REPO / "packaging/grafana/guardian-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    exported = exported_names()
    used = set()
    for e in exprs:
        found = set(NAME.findall(e))
        assert found, e
        assert found <= exported, (e, found - exported)
        used |= found
    # states, restarts, detection, canary latency, headroom, PSI, fractions: all on the dashboard
    for name in ("guardian_replica_state", "guardian_restarts_total", "guardian_detection_seconds_bucket",
                 "guardian_canary_duration_seconds_bucket", "guardian_memory_available_bytes",
                 "guardian_memory_pressure_some_ratio", "guardian_replica_gpu_memory_utilization_ratio"):
        assert name in used, name


def test_every_alert_expression_names_metrics_that_exist():
    text = (REPO / "packaging/prometheus/guardian-rules.yml").read_text()
    exprs = re.findall(r"expr: (?:>-\n)?((?:.+\n)(?:\s{12,}.+\n)*)", text)
    assert len(exprs) == text.count("- alert:")
    for e in exprs:
        for name in NAME.findall(e):
            assert name in exported_names() or name in ("node_textfile_mtime_seconds", "up"), (e, name)


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
