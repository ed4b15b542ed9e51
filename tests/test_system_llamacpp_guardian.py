"""guardian against real llama.cpp llama-server replicas (issue 42, "Done when", the llama.cpp row).

Three llama-servers (tests/llamacpp.py: Debian sid's CPU build, a tiny GGUF, all three serving the alias
"tiny") run under the box's systemd for the whole module, and guardian watches them:

  a  the packaged shape (llama.cpp-services: bare ExecStart=/usr/bin/llama-server, LLAMA_ARG_* in
     /etc/default/llama-server-a), with --metrics (LLAMA_ARG_ENDPOINT_METRICS), engine = "auto";
  b  the DGX Spark playbook's shape (every option a flag on ExecStart=, --metrics), engine = "llama.cpp";
  c  the packaged shape as shipped: no --metrics, engine = "auto".

The replicas are set up once (module fixture); each test restores a serving state first (thawed, started,
/health 200) and says the guardian config it needs: guardian is restarted only when the config changes, so
the tests are grouped by config, in file order: guardian's own defaults (the packaged shape, a busy replica
and a long prompt, a wrong model), far windows (the freezes: the rule under test decides, as in
test_system_engine_cpu.py), far windows under nginx (a planned restart), the memory guard (host_memory).
Journal lines are asserted by GUARDIAN_RULE and their evidence, never a time; facts are printed (pytest -rP).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import pytest

from llamacpp import (
    cleanup,
    finish_load,
    freeze_engine,
    freeze_server,
    holder_unit,
    install_llama,
    install_llama_unit,
    long_prompt,
    main_pid,
    metric,
    start_load,
    thaw_engine,
    thaw_server,
    thread_state,
    unit_name,
    wait_llama,
)
from systemd_box import BoxError, wait_for
from world import FAST_WATCHDOG, HOG, PROXY, PROXY_URL, Replica, World, hog, line_with, mem_available, toml_value

pytestmark = pytest.mark.system

ALIAS = "tiny"  # every replica's -a / LLAMA_ARG_ALIAS, and the model guardian expects
LONG_CTX = 16384  # a's context: room for the long prompt (tests/llamacpp.py: 12,000 tokens prefill in ~10 s)
LONG_PROMPT_TOKENS = 8000  # its prefill ~10 s on one thread here: longer than engine_quiet_s, the stall canary

# Nothing but the replica's own processes may decide in the freezing tests (as test_system_engine_cpu.py):
# the stall window, the stall canary, the unresponsive window and the idle canary's bound (guardian's own
# per-replica canary_timeout_s, 15 s) are out of reach; restarts of a one after another are allowed.
FAR = {**FAST_WATCHDOG, "stall_window_s": 120, "stall_canary_after_s": 60, "unresponsive_after_s": 60,
       "canary_interval_s": 3, "restart_budget": 20, "backoff_s": 0, "restart_job_timeout_s": 60}
# guardian's own interval (2 s), not the test world's 0.5 s: a look's quiet is CPU <= quiet_cpu (0.01) of a core
# over the look, counted in 10 ms clock ticks, and llama-server's HTTP threads, which share the engine's process,
# answer guardian's own /health at every look: at 0.5 s one tick of theirs (2 % of the look) breaks the quiet
# of a frozen engine (measured: C5 never held, L15 restarted it after two 15 s canaries); at 2 s it is 0.5 %.
TICKS: dict = {}


@dataclass
class LlamaReplica(Replica):
    """A llama-server replica: its unit is tests/llamacpp.py's, its config names the engine."""

    model: str = ALIAS
    style: str = "argv"  # "env": llama.cpp-services' shape; "argv": the playbook's
    metrics: bool = True
    engine: str = "llama.cpp"
    ctx: int = 4096

    @property
    def unit(self) -> str:  # type: ignore[override]
        return unit_name(self.name)


@dataclass
class LlamaWorld(World):
    """World's looking and nginx helpers over llama-server replicas; config_text writes their [[replicas]]
    itself (engine and all), always with guardian's own per-replica defaults."""

    replicas: list = field(default_factory=lambda: [
        LlamaReplica("a", 8411, style="env", engine="auto", ctx=LONG_CTX),
        LlamaReplica("b", 8412, style="argv", engine="llama.cpp"),
        LlamaReplica("c", 8413, style="env", engine="auto", metrics=False),
    ])
    top: dict = field(default_factory=dict)
    watchdog: dict = field(default_factory=dict)
    bystanders: tuple[str, ...] = ()
    replica_defaults: bool = True
    models: dict = field(default_factory=dict)  # replica name -> the model its config expects (not the alias)
    running_config: str | None = None
    guardian_since: float = 0.0

    def config_text(self, replicas=None, **top) -> str:  # type: ignore[override]
        lines = [f"{k} = {toml_value(v)}" for k, v in {**self.top, **top}.items()]
        for section, values in (("watchdog", self.watchdog), ("memory", self.memory), ("proxy", self.proxy)):
            if values:
                lines.append(f"[{section}]")
                lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
        for r in replicas if replicas is not None else self.replicas:
            lines += ["[[replicas]]", f"name = {toml_value(r.name)}", f"unit = {toml_value(r.unit)}",
                      f"url = {toml_value(r.url)}", f"model = {toml_value(self.models.get(r.name, r.model))}",
                      f"engine = {toml_value(r.engine)}"]
        return "\n".join(lines) + "\n"

    def install_replica(self, r: LlamaReplica) -> None:  # type: ignore[override]
        # one compute thread each: a server that computes takes one core, not both, beside the suite's other tests
        install_llama_unit(self.box, r.name, r.port, metrics=r.metrics, alias=ALIAS, style=r.style, ctx=r.ctx,
                           threads=1, reload=False)

    def wait_serving(self, r: Replica, timeout_s: float = 60) -> None:
        wait_llama(self.box, r.port, timeout_s)

    def setup(self, start_guardian: bool = False) -> LlamaWorld:
        for r in self.replicas:
            self.install_replica(r)
        self.box.daemon_reload()
        self.box.systemctl("enable", "--now", *[r.unit for r in self.replicas])  # guardian restarts no disabled unit
        for r in self.replicas:
            self.wait_serving(r)
        return self

    def configure(self, top: dict, watchdog: dict, memory: dict | None = None, proxy: dict | None = None,
                  models: dict | None = None) -> bool:
        """Guardian running with this config: restarted (and waited for: every replica healthy) only when
        the config differs from the one it runs. True when it was restarted."""
        self.top, self.watchdog = dict(top), dict(watchdog)
        self.memory, self.proxy = dict(memory or {}), dict(proxy or {})
        self.models = dict(models or {})
        text = self.config_text()
        if text == self.running_config and self.box.prop("guardian.service", "ActiveState") == "active":
            return False
        self.write_config(text)
        self.running_config = text
        self.guardian_since = time.time()
        self.box.systemctl("restart", "guardian.service")
        want = {r.name: ("wrong-model" if r.name in self.models else "healthy") for r in self.replicas}
        self.wait_states(want, timeout_s=60)
        return True

    def replica(self, name: str) -> LlamaReplica:
        return next(r for r in self.replicas if r.name == name)

    def lines(self, *match: str) -> list[dict]:
        return self.guardian_lines(*match)

    def said(self, *match: str) -> str:
        """Guardian's lines since the test began, one a line with its rule: what a failed assertion shows."""
        return "\n".join(f"{e.get('GUARDIAN_REPLICA', '-')} {e.get('GUARDIAN_RULE', '-')} {e['MESSAGE']}"
                         for e in self.lines(*match)[-40:])

    def restarts(self, name: str) -> list[dict]:
        return self.lines(f"GUARDIAN_REPLICA={name}", "GUARDIAN_DECISION=restart")

    def load_on(self, url: str, clients: int, max_tokens: int, *more: str) -> None:
        """tests/loadgen.py's clients against URL (a replica, or nginx), in the box, until stop_load()."""
        self.box.run(["rm", "-f", "/run/loadgen.stop", "/run/loadgen.jsonl"])
        self.box.systemctl("reset-failed", "loadgen.service", check=False)
        self.box.run(["systemd-run", "--unit=loadgen", "-p", "Restart=no", "/usr/bin/python3",
                      "/opt/guardian/src/tests/loadgen.py", url, ALIAS, "/run/loadgen.jsonl",
                      "--clients", str(clients), "--max-tokens", str(max_tokens), *more])


@pytest.fixture(scope="module")
def lw(box):
    try:
        install_llama(box)
    except BoxError as e:
        pytest.fail(f"cannot put a real llama-server in the test box: {e}", pytrace=False)
    w = LlamaWorld(box)
    try:
        w.setup()
        yield w
    finally:
        w.teardown()
        cleanup(box)


@pytest.fixture
def llw(lw):
    """The module's world, every replica serving: thawed, started if it is not, /health 200."""
    box = lw.box
    for r in lw.replicas:
        box.systemctl("stop", holder_unit(r.unit), check=False)
        if box.prop(r.unit, "ActiveState") == "active":
            thaw_server(box, r.unit)
        else:
            box.systemctl("reset-failed", r.unit, check=False)
            box.systemctl("start", r.unit)
    for r in lw.replicas:
        lw.wait_serving(r)
    lw.since = time.time()
    yield lw
    if box.prop("loadgen.service", "ActiveState") in ("active", "activating"):
        lw.stop_load()


def completions_ok(reqs: list[dict]) -> int:
    return sum(1 for q in reqs if not q["failed"])


def wait_restarted(w: LlamaWorld, name: str, timeout_s: float = 90) -> str:
    """The line that says NAME's restart job ended well; then NAME serves and is healthy again."""
    line = wait_for(lambda: next(iter(w.lines(f"GUARDIAN_REPLICA={name}", "GUARDIAN_DECISION=restarted")), None),
                    timeout_s, f"{name}'s restart to end well (guardian said: {w.said()})")
    w.wait_serving(w.replica(name))
    w.wait_states({name: "healthy"}, timeout_s=60)
    return line["MESSAGE"]


def restart_line(w: LlamaWorld, name: str, timeout_s: float = 60) -> dict:
    """Guardian's restart line for NAME; meanwhile NAME's verdicts as `guardian status` has them, printed
    (each change of state, rule or evidence, with its processes' view): how guardian came to it."""
    trail: list[str] = []

    def restarted() -> dict | None:
        s = w.status().get("replicas", {}).get(name, {})
        procs = s.get("processes") or {}
        seen = (f"{s.get('state')} {s.get('rule')} {s.get('evidence')} | engine "
                f"{json.dumps(procs.get('engine'))} api {json.dumps(procs.get('api'))}")
        if not trail or trail[-1].split(" | ", 1)[0] != seen.split(" | ", 1)[0]:
            trail.append(seen)
        return next(iter(w.restarts(name)), None)
    try:
        return wait_for(restarted, timeout_s, f"guardian to restart {name}")
    except AssertionError:
        print(w.said())
        raise
    finally:
        print(f"FACTS {name}'s verdicts until its restart:\n  " + "\n  ".join(trail))


def ticks(w: LlamaWorld) -> int:
    return (w.status().get("ticks") or {}).get("count", 0)


# --- guardian's own defaults --------------------------------------------------------------------------

DEFAULTS: dict = {}  # no [watchdog] keys, no interval_s: guardian's defaults (and its per-replica ones)


def test_busy_replicas_and_a_long_prompt_are_not_restarted_under_guardians_defaults(llw):
    """c) four clients' completions on a for longer than every window, then one prompt of 8,000 tokens
    (prefill of ~10 s here on one thread, 2048-token chunks): a is never restarted, never anything but healthy or busy."""
    w = llw
    w.configure(DEFAULTS, {})
    a = w.replica("a")
    span_s = 30  # longer than unresponsive_after_s (10), stall_canary_after_s (10), canary_timeout_s (15)
    seen: dict[str, set] = {"states": set(), "rules": set()}

    def watch_until(done) -> None:
        while not done():
            s = w.status().get("replicas", {}).get("a", {})
            seen["states"].add(s.get("state"))
            seen["rules"].add(s.get("rule"))
            time.sleep(0.5)

    w.load_on(a.url, 4, 200, "--mode", "plain")
    began = time.monotonic()
    watch_until(lambda: time.monotonic() - began >= span_s)
    code, page = w.box.http(a.url + "/metrics")
    reqs = w.stop_load()
    busy = {"completions_ok": completions_ok(reqs), "failed": len(reqs) - completions_ok(reqs),
            "states": sorted(map(str, seen["states"])), "rules": sorted(map(str, seen["rules"])),
            "tokens_predicted_total": metric(page, "llamacpp:tokens_predicted_total") if code == 200 else None}
    print("FACTS busy:", json.dumps(busy))

    seen["states"].clear(), seen["rules"].clear()
    load = start_load(w.box, a.port, n=1, max_tokens=1, prompt=long_prompt(LONG_PROMPT_TOKENS), timeout_s=300)
    watch_until(lambda: load.poll() is not None)
    r = finish_load(load)[0]
    prompt = {"ok": r["ok"], "wall_s": r["s"], "prompt_tokens": (r.get("usage") or {}).get("prompt_tokens"),
              "prompt_ms": (r.get("timings") or {}).get("prompt_ms"),
              "states": sorted(map(str, seen["states"])), "rules": sorted(map(str, seen["rules"]))}
    print("FACTS long prompt:", json.dumps(prompt))

    assert busy["completions_ok"] > 0 and busy["failed"] == 0, busy
    assert r["ok"] and prompt["prompt_tokens"] == LONG_PROMPT_TOKENS, r
    for name in ("a", "b", "c"):
        assert w.restarts(name) == [], w.said()
    assert set(busy["states"]) | set(prompt["states"]) <= {"healthy", "busy"}, (busy, prompt, w.said())
    assert w.box.prop(a.unit, "NRestarts") == "0"


def test_the_packaged_shape_is_told_and_a_replica_without_metrics_is_healthy(llw):
    """g) engine = "auto" on llama.cpp-services' bare ExecStart=/usr/bin/llama-server: told llama.cpp from it
    at start and by `guardian check`; c (no --metrics, as packaged) is healthy, never degraded, and check says
    its page is not offered and names --metrics."""
    w = llw
    w.configure(DEFAULTS, {})
    since = w.guardian_since
    # c watched for 8 ticks of guardian's (16 s at its 2 s interval): a canary (canary_interval_s 10) in them, and
    # its learning canaries where guardian has just started. A degraded spell under 10 s is not said in the
    # journal (core/verdicts.py QUIET_STATES): its status is polled.
    seen_c: set = set()
    first = ticks(w)

    def c_looked_at() -> bool:
        s = w.status().get("replicas", {}).get("c", {})
        seen_c.add((s.get("state"), s.get("rule")))
        return ticks(w) >= first + 8
    wait_for(c_looked_at, 60, "guardian to tick 8 times", interval_s=0.5)
    told = {e["GUARDIAN_REPLICA"]: e["MESSAGE"] for e in w.box.journal("SYSLOG_IDENTIFIER=guardian", since=since)
            if e.get("GUARDIAN_REPLICA") and ": engine " in e["MESSAGE"]}
    check = w.box.run(["guardian", "check"], check=False)
    print("FACTS engine lines at start:", json.dumps(told, indent=1))
    print(f"FACTS guardian check (exit {check.returncode}):\n{check.stdout}{check.stderr}")
    line = {n: next((ln for ln in check.stdout.splitlines() if ln.startswith(f"replica {n}: engine ")), "")
            for n in "abc"}

    for name in ("a", "c"):
        unit = unit_name(name)
        auto = (f"replica {name}: engine llama.cpp (llama-server) "
                f"(auto: `/usr/bin/llama-server` on {unit}'s command line)")
        assert told[name] == auto, told
        assert line[name].startswith(auto + "; health from /health"), check.stdout
    assert told["b"] == "replica b: engine llama.cpp (llama-server) (configured)", told
    assert line["b"].startswith(told["b"] + "; "), check.stdout
    assert "progress from /metrics, answered by its engine's own loop" in line["a"], line["a"]
    assert "its page (/metrics) is NOT offered: start it with --metrics for /metrics" in line["c"], line["c"]
    assert "memory guard: never lowers it (no memory fraction)" in line["c"], line["c"]

    c = w.status()["replicas"]["c"]
    print("FACTS c:", json.dumps({**{k: c[k] for k in ("state", "rule", "evidence")}, "seen": sorted(seen_c)}))
    # healthy: L18 ("answering"), or L12 at a look where its canary answered (a canary's answer is progress)
    assert c["state"] == "healthy" and (c["rule"], c["evidence"]) in (("L18", "answering"),
                                                                      ("L12", "queue unknown, counters advance")), c
    states_c = w.box.journal("SYSLOG_IDENTIFIER=guardian", "GUARDIAN_REPLICA=c", "GUARDIAN_DECISION=state", since=since)
    assert not [e for e in states_c if "degraded" in e["MESSAGE"]], [e["MESSAGE"] for e in states_c]
    assert seen_c <= {("healthy", "L18"), ("healthy", "L12")}, seen_c
    assert w.restarts("c") == []


def test_a_replica_serving_another_model_is_said_wrong_model(llw):
    """d) b's config expects a model its llama-server does not serve (its alias is "tiny"): wrong_model by L7,
    said with what /v1/models lists; it is not restarted."""
    w = llw
    w.configure(DEFAULTS, {}, models={"b": "not-tiny"})
    line = wait_for(lambda: next((e for e in w.lines("GUARDIAN_REPLICA=b", "GUARDIAN_RULE=L7")), None), 30,
                    f"b's L7 line ({w.said()})")
    print("FACTS wrong model:", line["MESSAGE"])
    assert line["PRIORITY"] == "3" and line.get("GUARDIAN_DECISION") == "state", line
    assert "-> wrong-model (/v1/models lists tiny, expected not-tiny)" in line["MESSAGE"], line["MESSAGE"]
    assert "not restarting: a wrong model is a wiring or cutover fault" in line["MESSAGE"], line["MESSAGE"]
    assert w.states()["b"] == "wrong-model"
    assert w.restarts("b") == [], w.said()


# --- far windows: the freezes ---------------------------------------------------------------------------

def others_not_restarted(w: LlamaWorld, name: str = "a") -> None:
    for other in ("a", "b", "c"):
        if other != name:
            assert w.restarts(other) == [], w.said()


def test_a_frozen_server_is_restarted_alone_by_its_quiet_processes(llw):
    """a) SIGSTOP of a's llama-server: nothing answers, its process uses no CPU: L22 (L8's 60 s out of reach),
    and the restart completes (a hung replica's stop: SIGKILL if SIGTERM, sent with SIGCONT, has not ended it)."""
    w = llw
    w.configure(TICKS, FAR)
    a = w.replica("a")
    old = w.box.identity(a.unit)
    identities = {r.unit: w.box.identity(r.unit) for r in w.replicas if r.name != "a"}
    freeze_server(w.box, a.unit)
    line = restart_line(w, "a")
    done = wait_restarted(w, "a")
    print("FACTS frozen server:", json.dumps({"rule": line["GUARDIAN_RULE"], "restart": line["MESSAGE"],
                                              "restarted": done}, indent=1))
    assert line["GUARDIAN_RULE"] in ("L22", "L8"), line["MESSAGE"]
    if line["GUARDIAN_RULE"] == "L22":
        assert "its processes (1 process) used no CPU and waited for none" in line["MESSAGE"], line["MESSAGE"]
    assert ("so its processes were killed (SIGKILL)" in done or "it stopped by itself" in done), done
    assert w.box.identity(a.unit) != old
    assert {r.unit: w.box.identity(r.unit) for r in w.replicas if r.name != "a"} == identities
    others_not_restarted(w)


def test_an_idle_frozen_engine_fails_its_canary_at_once_and_is_idle_dead(llw):
    """b) a's main thread held while idle (ptrace): /health 200, /metrics and completions wait. The metrics read
    that times out while /health answers lets a canary go out; C5 fails it (a's process used no CPU) and L21
    restarts a. SIGTERM cannot end an engine-frozen llama-server: guardian kills it."""
    w = llw
    w.configure(TICKS, FAR)
    a = w.replica("a")
    old = w.box.identity(a.unit)
    try:
        freeze_engine(w.box, a.unit)
        line = restart_line(w, "a")
        done = wait_restarted(w, "a")
    finally:
        thaw_engine(w.box, a.unit)
    print("FACTS idle frozen engine:", json.dumps({"rule": line["GUARDIAN_RULE"], "restart": line["MESSAGE"],
                                                   "restarted": done}, indent=1))
    assert line["GUARDIAN_RULE"] == "L21", line["MESSAGE"]
    assert "idle; a canary sent" in line["MESSAGE"] and "got nothing while its processes (1 process) used no CPU" \
        in line["MESSAGE"] and "(/health 200)" in line["MESSAGE"], line["MESSAGE"]
    assert "so its processes were killed (SIGKILL)" in done, done
    assert w.box.identity(a.unit) != old
    others_not_restarted(w)


def test_a_busy_frozen_engine_is_stalled_by_its_quiet_process(llw):
    """b) a's main thread held 1 request into a long completion: /metrics answers from the loop's copy with
    requests_processing 1 and every counter standing still (or waits, tests/llamacpp.py): L19 (work in a
    quiet engine) or L20 (a canary it never touched); a is restarted, b and c are not."""
    w = llw
    w.configure(TICKS, FAR)
    a = w.replica("a")
    load = start_load(w.box, a.port, n=1, max_tokens=3000, timeout_s=120)
    try:
        wait_for(lambda: metric(w.box.http(a.url + "/metrics")[1], "llamacpp:requests_processing") == 1, 20,
                 "a completion processing in a", interval_s=0.1)
        freeze_engine(w.box, a.unit)
        code, page = w.box.http(a.url + "/metrics", timeout_s=3)
        frozen = {"metrics": code, "requests_processing": metric(page, "llamacpp:requests_processing") if code == 200
                  else None, "main_thread": thread_state(w.box, main_pid(w.box, a.unit))}
        line = restart_line(w, "a")
        done = wait_restarted(w, "a")
    finally:
        thaw_engine(w.box, a.unit)
    held = finish_load(load, timeout_s=120)[0]
    print("FACTS busy frozen engine:", json.dumps({
        **frozen, "rule": line["GUARDIAN_RULE"], "restart": line["MESSAGE"], "restarted": done,
        "held_completion": held.get("error") or held.get("ok")}, indent=1))
    assert line["GUARDIAN_RULE"] in ("L19", "L20"), line["MESSAGE"]
    if line["GUARDIAN_RULE"] == "L19":
        assert "1 running, 0 waiting" in line["MESSAGE"], line["MESSAGE"]
        assert "its processes (1 process) used no CPU and waited for none" in line["MESSAGE"], line["MESSAGE"]
    else:
        assert "got nothing while its processes (1 process) used no CPU" in line["MESSAGE"], line["MESSAGE"]
    assert "so its processes were killed (SIGKILL)" in done, done
    others_not_restarted(w)


# --- far windows, under nginx: a planned restart -------------------------------------------------------

def proxy_rules(w: LlamaWorld, name: str = "a") -> list[str]:
    return [e.get("GUARDIAN_RULE", "") for e in w.lines(f"GUARDIAN_REPLICA={name}", "GUARDIAN_DECISION=proxy")]


def test_a_planned_restart_drains_through_nginx_and_no_request_fails(llw):
    """e) nginx (the README's snippet) in front of a, b and c, guardian's [proxy] writing its upstream file,
    8 clients through nginx; `guardian restart a` marks a down (D1), waits for its requests, restarts it,
    marks it up (D11): no client request fails, and a serves clients again."""
    w = llw
    w.configure(TICKS, FAR, proxy=PROXY)
    w.start_nginx()
    wait_for(lambda: all(f"server 127.0.0.1:{r.port}" in w.upstream_file() for r in w.replicas), 20,
             "guardian's upstream file naming every replica")
    a = w.replica("a")
    try:
        w.load_on(PROXY_URL, 8, 40)
        w.wait_requests(30)
        # and one longer completion on a itself (300 tokens: seconds here, under the clients' load; 3000 outlasted
        # the 60 s drain timeout): work the drain must wait for, and a client nginx does not retry
        held = start_load(w.box, a.port, n=1, max_tokens=300, timeout_s=120)
        wait_for(lambda: (metric(w.box.http(a.url + "/metrics")[1], "llamacpp:requests_processing") or 0) >= 1, 20,
                 "the long completion processing in a", interval_s=0.1)
        asked = w.box.run(["guardian", "restart", "a"], check=False, timeout=120)
        assert asked.returncode == 0, asked.stdout + asked.stderr
        long_one = finish_load(held, timeout_s=120)[0]
        w.wait_states({"a": "healthy"}, timeout_s=60)
        wait_for(lambda: "D11" in proxy_rules(w), 30, "a marked up again")
        back_at = float(w.box.run(["date", "+%s.%N"]).stdout.strip())
        wait_for(lambda: any(q["t0"] > back_at and q["upstream"] == f"127.0.0.1:{a.port}" and not q["failed"]
                             for q in w.requests()), 60, "a request served by a after its restart")
        reqs = w.stop_load()
    finally:
        w.box.systemctl("stop", "nginx.service", check=False)
    failed = [q for q in reqs if q["failed"]]
    restart = w.lines("GUARDIAN_REPLICA=a", "GUARDIAN_DECISION=restart")
    done = w.guardian_messages("GUARDIAN_REPLICA=a", "GUARDIAN_DECISION=restarted")
    print("FACTS planned restart:", json.dumps({
        "requests": len(reqs), "failed": len(failed),
        "per_upstream": {u: [str(q["upstream"]) for q in reqs].count(u) for u in {str(q["upstream"]) for q in reqs}},
        "proxy_rules": proxy_rules(w), "restart": [e["MESSAGE"] for e in restart],
        "long_completion_on_a": {k: long_one.get(k) for k in ("ok", "s", "error")}, "restarted": done}, indent=1))
    assert failed == [], failed[:5]
    assert long_one["ok"] and long_one["usage"]["completion_tokens"] == 300, long_one
    assert len(restart) == 1 and "(D6)" in restart[0]["MESSAGE"] and "drained" in restart[0]["MESSAGE"], restart
    assert proxy_rules(w)[:1] == ["D1"] and "D11" in proxy_rules(w)
    # (a stop over before guardian looked is not timed: "the stop took" is then left out of the line)
    assert done and "restart job of llama-server-a.service done" in done[0] and "(D6)" in done[0], done
    others_not_restarted(w)


# --- the memory guard -------------------------------------------------------------------------------------

GiB = 2**30


@pytest.mark.host_memory  # guardian reads the host's /proc/meminfo, which every box shares (scripts/run-tests)
def test_the_memory_guard_refuses_to_lower_a_llama_server_and_says_why(llw):
    """f) the memory guard on, a squeeze (a hog unit, thresholds just below what is available now): a is first
    in its priority but llama.cpp has no memory fraction: guardian's error line names a and says so; no
    replica is restarted (a's identity unchanged)."""
    w = llw
    avail = mem_available()
    memory = dict(enabled=True, sustain_s=2, cooldown_s=600, step=0.04, floor=0.5, reserve_bytes=0,
                  device_total_bytes=GiB, priority=["a"], min_headroom_bytes=avail - GiB,
                  critical_headroom_bytes=avail - 6 * GiB)
    w.configure(TICKS, FAR, memory=memory)
    identities = {r.unit: w.box.identity(r.unit) for r in w.replicas}
    w.box.write("/usr/local/bin/hog", HOG, mode=0o755)
    try:
        hog(w, "build.service", 3)
        line = line_with(w, "has no memory fraction to lower", "GUARDIAN_REPLICA=a")
        now = ticks(w)
        wait_for(lambda: ticks(w) >= now + 10, 30, "guardian to tick on in the squeeze")
    finally:
        w.box.systemctl("stop", "build.service", check=False)
    print("FACTS memory guard:", json.dumps({
        "rule": line.get("GUARDIAN_RULE"), "priority": line["PRIORITY"], "line": line["MESSAGE"],
        "wiring": w.status()["replicas"]["a"]["memory_wiring"]}, indent=1))
    assert line["PRIORITY"] == "3" and line.get("GUARDIAN_RULE") == "M11", line
    assert "replica a: llama-server-a.service is not wired for the memory guard" in line["MESSAGE"], line["MESSAGE"]
    assert "llama.cpp" in line["MESSAGE"] and "the memory guard never lowers it" in line["MESSAGE"], line["MESSAGE"]
    assert {r.unit: w.box.identity(r.unit) for r in w.replicas} == identities
    assert w.guardian_messages("GUARDIAN_DECISION=memory") == []
    for name in ("a", "b", "c"):
        assert w.restarts(name) == [], w.said()
