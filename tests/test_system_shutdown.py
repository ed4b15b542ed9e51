"""A planned stop lets vLLM finish what it holds (issue 44 item 2, core/stopping.py T1-T3): through a
real nginx (Debian's, set up as the README says), a planned restart of a replica started with
`--shutdown-timeout` whose drain times out with a request still running: the request completes
through nginx with its whole answer, and guardian's bound waits for it."""

from __future__ import annotations

import json
import threading

import pytest

from systemd_box import wait_for
from world import PROXY, PROXY_URL, World

pytestmark = pytest.mark.system

MAX_TOKENS = 200  # 10 s at the simulator's 20 tokens a second: longer than the drain and the bound without T1


def running(world: World, r) -> float:
    code, text = world.box.http(r.url + "/metrics")
    if code != 200:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running{"))


def test_a_planned_restart_lets_the_running_request_finish_through_nginx(world):
    a, b = world.replicas
    a.sim_args = "--shutdown-timeout 30"
    a.service_extra = "TimeoutStopSec=90s"
    world.proxy = {**PROXY, "drain_timeout_s": 2, "stop_timeout_s": 3}
    world.setup()
    world.start_nginx()
    answers: list[tuple[int, str]] = []

    def ask() -> None:  # one long plain completion through nginx
        body = {"model": a.model, "prompt": "hello there", "max_tokens": MAX_TOKENS}
        answers.append(world.box.http(PROXY_URL + "/v1/completions", "POST", body, timeout_s=120))

    # two at once: nginx's least_conn gives one to each replica
    clients = [threading.Thread(target=ask, daemon=True) for _ in range(2)]
    for c in clients:
        c.start()
    wait_for(lambda: running(world, a) > 0 and running(world, b) > 0, 20, "a request running on each replica")
    old = world.box.identity(a.unit)
    asked = world.box.run(["guardian", "restart", "a"], check=False, timeout=180)
    assert asked.returncode == 0, asked.stdout + asked.stderr
    for c in clients:
        c.join(120)
    assert len(answers) == 2, answers
    for code, text in answers:  # a's request too: vLLM let it finish, and guardian waited for it
        assert code == 200, (code, text[:300])
        assert json.loads(text)["usage"]["completion_tokens"] == MAX_TOKENS, text[:300]
    assert world.box.identity(a.unit) != old
    (line,) = world.guardian_messages("GUARDIAN_REPLICA=a", "GUARDIAN_DECISION=restart")
    assert "drain timeout" in line and "(D7)" in line, line
    assert "its processes killed if the stop takes over 45 s (vLLM's --shutdown-timeout 30 s + 15 s: T1)" in line
    assert "1 running and 0 waiting at its last /metrics, which vLLM lets finish for up to 30 s" in line, line
    (done,) = world.guardian_messages("GUARDIAN_REPLICA=a", "GUARDIAN_DECISION=restarted")
    assert "the stop took" in done and "killed" not in done, done
    world.wait_states({"a": "healthy", "b": "healthy"}, timeout_s=30)
    # `guardian check`: b, under [proxy] with no --shutdown-timeout, is warned about (T3); a's
    # TimeoutStopSec (90 s) covers its 30 s and the margin (no T2)
    checked = json.loads(world.box.run(["guardian", "check", "--json"], check=False).stdout)
    warned = [p for p in checked["problems"] if p.startswith("warning:") and "(T" in p]
    assert [p for p in warned if "replica b:" in p and "(T3)" in p], checked["problems"]
    assert not [p for p in warned if "replica a:" in p], checked["problems"]
