"""Prometheus for real (issue 11): Debian's prometheus and prometheus-node-exporter run as units in
the container. Prometheus scrapes guardian's /metrics, node_exporter's textfile collector (which
serves guardian.prom), and each replica directly, found through guardian's file_sd file. promtool
checks and unit-tests the shipped alert rules."""

from __future__ import annotations

import json
import urllib.parse

import pytest

from systemd_box import REPO, wait_for

pytestmark = pytest.mark.system

TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"
TARGETS = "/var/lib/guardian/prometheus-targets.json"
RULES = "/usr/share/guardian/prometheus/guardian-rules.yml"

PROMETHEUS_YML = f"""
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - {RULES}
scrape_configs:
  - job_name: guardian
    static_configs: [{{targets: ["127.0.0.1:9464"]}}]
  - job_name: node
    static_configs: [{{targets: ["127.0.0.1:9100"]}}]
  - job_name: vllm
    file_sd_configs: [{{files: ["{TARGETS}"], refresh_interval: 2s}}]
"""

METRICS_TOML = f"""
[metrics]
http = true
address = "127.0.0.1:9464"
textfile_dir = "{TEXTFILE_DIR}"
file_sd_path = "{TARGETS}"
box = "box-1"
"""


def query(box, expr: str) -> list[dict]:
    code, text = box.http("http://127.0.0.1:9090/api/v1/query?query=" + urllib.parse.quote(expr))
    assert code == 200, text
    return json.loads(text)["data"]["result"]


def scalar(box, expr: str) -> float | None:
    r = query(box, expr)
    return float(r[0]["value"][1]) if r else None


def alert_count() -> int:
    return (REPO / "packaging/prometheus/guardian-rules.yml").read_text().count("- alert:")


def test_promtool_checks_the_rules_and_their_unit_tests_pass(box):
    box.run(["mkdir", "-p", "/tmp/rules"])
    for name in ("guardian-rules.yml", "guardian-rules.test.yml"):
        box.write(f"/tmp/rules/{name}", (REPO / "packaging/prometheus" / name).read_text())
    r = box.run(["promtool", "check", "rules", "/tmp/rules/guardian-rules.yml"], check=False)
    assert r.returncode == 0 and f"SUCCESS: {alert_count()} rules found" in r.stdout, r.stdout + r.stderr
    r = box.run(["sh", "-c", "cd /tmp/rules && promtool test rules guardian-rules.test.yml"], check=False)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    # the shipped copy is the tested one
    assert box.run(["cat", RULES]).stdout == (REPO / "packaging/prometheus/guardian-rules.yml").read_text()


def test_prometheus_scrapes_guardian_node_exporter_and_each_replica_directly(world):
    box = world.box
    world.setup(start_guardian=False)
    box.run(["chgrp", "guardian", TEXTFILE_DIR])
    box.run(["chmod", "g+w", TEXTFILE_DIR])
    box.write("/etc/prometheus/prometheus.yml", PROMETHEUS_YML)
    box.write("/etc/default/prometheus-node-exporter",
              f'ARGS="--collector.disable-defaults --collector.textfile --collector.textfile.directory={TEXTFILE_DIR}"\n')
    box.systemctl("restart", "prometheus-node-exporter.service", "prometheus.service")
    try:
        _scrape_and_count_a_restart(world)
    finally:
        box.systemctl("stop", "prometheus.service", "prometheus-node-exporter.service", check=False)


def _scrape_and_count_a_restart(world):
    box = world.box
    world.write_config(world.config_text() + METRICS_TOML)
    world.start_guardian()

    targets = json.loads(box.run(["cat", TARGETS]).stdout)
    assert sorted((g["targets"][0], g["labels"]["replica"], g["labels"]["box"]) for g in targets) == \
        [("127.0.0.1:8001", "a", "box-1"), ("127.0.0.1:8002", "b", "box-1")]

    def all_up():
        code, text = box.http("http://127.0.0.1:9090/api/v1/targets")
        if code != 200:
            return None
        active = json.loads(text)["data"]["activeTargets"]
        up = {(t["labels"]["job"], t["labels"].get("replica")) for t in active if t["health"] == "up"}
        return active if up >= {("guardian", None), ("node", None), ("vllm", "a"), ("vllm", "b")} else None

    active = wait_for(all_up, 60, "prometheus to scrape guardian, node_exporter and both replicas")
    vllm = {t["labels"]["replica"]: t for t in active if t["labels"]["job"] == "vllm"}
    # each replica is its own target, at its own address (never the proxy's), with guardian's labels
    assert {r: t["scrapeUrl"] for r, t in vllm.items()} == \
        {"a": "http://127.0.0.1:8001/metrics", "b": "http://127.0.0.1:8002/metrics"}
    assert all(t["labels"]["unit"] == f"vllm-{r}.service" and t["labels"]["model"] == "sim-model" for r, t in vllm.items())
    # vLLM's own series come from the replicas, not from guardian
    assert {s["metric"]["replica"] for s in query(box, 'vllm:num_requests_running{job="vllm"}')} == {"a", "b"}
    assert query(box, '{job="guardian", __name__=~"vllm:.*"}') == []

    healthy = 'guardian_replica_state{job="%s", state="healthy"} == 1'
    for job in ("guardian", "node"):
        wait_for(lambda: {s["metric"]["replica"] for s in query(box, healthy % job)} == {"a", "b"}, 30,
                 f"both replicas healthy in guardian_replica_state through job {job}")

    restarts = 'sum(guardian_restarts_total{job="%s", replica="a", reason="unresponsive"}) or vector(0)'
    detections = 'sum(guardian_detection_seconds_count{job="%s"}) or vector(0)'
    before = {job: (scalar(box, restarts % job), scalar(box, detections % job)) for job in ("guardian", "node")}
    old = box.identity("vllm-a.service")
    world.kill("vllm-a.service", "STOP")
    wait_for(lambda: box.identity("vllm-a.service") != old, 40, "guardian to restart the frozen vllm-a")
    world.wait_states({"a": "healthy", "b": "healthy"}, timeout_s=40)
    for job in ("guardian", "node"):
        r0, d0 = before[job]
        wait_for(lambda: scalar(box, restarts % job) == r0 + 1 and scalar(box, detections % job) == d0 + 1, 30,
                 f"one more restart and one more detection through job {job}")
    # the endpoint and the textfile copy agree, and nothing else restarted
    assert scalar(box, restarts % "guardian") == scalar(box, restarts % "node")
    assert scalar(box, 'sum(guardian_restarts_total{job="guardian", replica="b"}) or vector(0)') == 0
    assert scalar(box, 'guardian_gave_up{job="guardian", replica="a"}') == 0
    code, text = box.http("http://127.0.0.1:9464/healthz")
    assert code == 200 and text.startswith("ok"), text
    # the rules are loaded and no alert fires for a box that is fine again
    code, text = box.http("http://127.0.0.1:9090/api/v1/rules")
    assert code == 200 and len(json.loads(text)["data"]["groups"][0]["rules"]) == alert_count()
    # every configured replica's counters are there from guardian's start, at 0 until counted; no _created series
    assert scalar(box, 'guardian_restarts_total{job="guardian", replica="b", reason="stalled"}') == 0
    assert scalar(box, 'guardian_restart_refusals_total{job="guardian", replica="b", gate="budget"}') == 0
    assert query(box, '{job="guardian", __name__=~"guardian_.*_created"}') == []
    assert scalar(box, 'sum(guardian_detection_seconds_count{job="guardian", replica="a"})') == \
        scalar(box, 'sum(guardian_detection_seconds_count{job="guardian"})')
    assert scalar(box, 'guardian_dry_run{job="guardian"}') == 0
