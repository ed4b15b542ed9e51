"""A small world inside the test container: two simulated replicas, a stand-in database and a
stand-in proxy (each a real systemd unit), and guardian configured to watch the replicas."""

from __future__ import annotations

import json
import time
from pathlib import Path
from dataclasses import dataclass, field

from guardian.observe.meminfo import sample_memory
from systemd_box import SystemdBox, wait_for

REPLICA_UNIT = """[Unit]
Description=simulated {label} replica {name}
{unit_extra}
[Service]
Type=simple
Environment=GPU_MEMORY_UTILIZATION={fraction}{engine_env}
{env_file}
ExecStart={exec_start}
Restart={restart}
RestartSec={restart_sec}
{service_extra}
[Install]
WantedBy=multi-user.target
"""

# Each engine's command line, as its operators write it (shared/BRIEF.md, "Other engines the Spark runs"),
# started by the simulator playing that engine (vllm_sim/engines.py) through a stand-in of the engine's own
# program that systemd_box installs in the box (SHIMS): guardian's `engine = "auto"` tells them apart by
# their unit's command line, and its memory guard lowers each by its own flag.
EXEC_START = {
    "vllm": "/usr/local/bin/vllm-sim serve --model {model_arg} --port {port} --gpu-memory-utilization {fraction_arg} "
            "--load-time-s {load_time_s} {sim_args}",
    "sglang": "/usr/bin/python3 -m sglang.launch_server --model-path {model_arg} --port {port} "
              "--mem-fraction-static {fraction_arg} --enable-metrics --load-time-s {load_time_s} {sim_args}",
    "trtllm": "/usr/local/bin/trtllm-serve {model_arg} --port {port} --kv_cache_free_gpu_memory_fraction {fraction_arg} "
              "--extra_llm_api_options {options} --load-time-s {load_time_s} {sim_args}",
}
ENGINE_LABEL = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}
# `python3 -m sglang.launch_server` finds the stand-in package on this path
ENGINE_ENV = {"sglang": "\nEnvironment=PYTHONPATH=/opt/shims:/opt/guardian/src:/opt/guardian/deps"}
# trtllm-serve's Prometheus page (/prometheus/metrics) needs return_perf_metrics; its running and
# waiting gauges are set from the iteration stats, which need enable_iter_perf_stats (vllm_sim/engines.py)
TRTLLM_OPTIONS = "return_perf_metrics: true\nenable_iter_perf_stats: true\n"


PLAIN_UNIT = """[Unit]
Description={description}
{unit_extra}
[Service]
ExecStart={exec_start}
[Install]
WantedBy=multi-user.target
"""

FAST_WATCHDOG = {
    "stall_window_s": 6,
    "unresponsive_after_s": 4,
    "canary_interval_s": 3,
    "canary_retry_s": 1,
    "canary_after_traffic_s": 2,
    "stall_canary_after_s": 3,
    "canary_failures": 2,
    "restart_budget": 3,
    "restart_window_s": 600,
    "backoff_s": 0,
    "restart_job_timeout_s": 30,
}


@dataclass
class Replica:
    name: str
    port: int
    model: str = "sim-model"
    fraction: float = 0.9
    load_time_s: float = 0.3
    sim_args: str = ""
    restart: str = "always"
    unit_extra: str = ""
    service_extra: str = ""
    startup_grace_s: float = 20
    health_timeout_s: float = 1.0
    wired: bool = True  # reads guardian's env file and passes ${GPU_MEMORY_UTILIZATION}
    restart_sec: float = 1
    env_after: bool = False  # the unit also reads /etc/vllm/NAME.env, listed after guardian's file
    config: dict = field(default_factory=dict)  # more of its [[replicas]] keys (warmup_file, ...)
    model_path: str | None = None  # loads this path (--model), served as `model` (--served-model-name)
    url_host: str = "127.0.0.1"  # the host its URL names (a name is resolved in the box)
    engine: str = "vllm"  # whose command line its unit runs (EXEC_START): "vllm", "sglang", "trtllm"

    @property
    def unit(self) -> str:
        return f"vllm-{self.name}.service"

    @property
    def url(self) -> str:
        return f"http://{self.url_host}:{self.port}"


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


PROXY_URL = "http://127.0.0.1:8090"
NGINX_SITE = "/etc/nginx/conf.d/llm.conf"
def readme_nginx_site() -> str:
    """The README's nginx snippet (Under a proxy) as it is: the tests run what an operator pastes,
    listening where the tests' clients connect, and naming in each answer the upstreams nginx tried."""
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    site = text.split("\n### nginx\n", 1)[1].split("```nginx\n", 1)[1].split("```", 1)[0]
    assert "listen 8080;" in site and "proxy_pass http://llm;" in site, "README's nginx snippet changed shape"
    return site.replace("listen 8080;", "listen 127.0.0.1:8090;").replace(
        "proxy_pass http://llm;", "proxy_pass http://llm;\n        add_header X-Upstream $upstream_addr always;")


NGINX_CONF = readme_nginx_site()


def without_retry(site: str) -> str:
    lines = [ln.replace(" non_idempotent;", ";") for ln in site.splitlines(keepends=True)
             if "proxy_next_upstream_" not in ln]
    out = "".join(lines)
    assert out != site and not any("non_idempotent" in ln.split("#")[0] for ln in lines), "no retry lines to take out"
    return out


def no_byte(q: dict) -> bool:
    """A failed request that had received nothing of its answer (what a proxy may send again)."""
    return bool(q["failed"]) and q.get("status") != 200
PROXY = {"nginx_upstream_dir": "/var/lib/guardian/nginx", "drain_timeout_s": 60, "stop_timeout_s": 10}


@dataclass
class World:
    box: SystemdBox
    replicas: list[Replica] = field(default_factory=lambda: [Replica("a", 8001), Replica("b", 8002)])
    watchdog: dict = field(default_factory=lambda: dict(FAST_WATCHDOG))
    top: dict = field(default_factory=lambda: {"interval_s": 0.5})
    memory: dict = field(default_factory=dict)
    proxy: dict = field(default_factory=dict)
    nginx_on: bool = False
    replica_defaults: bool = False  # True: guardian's own per-replica defaults (the benchmark)
    bystanders: tuple[str, ...] = ("db.service", "proxy.service")
    extra_units: list[str] = field(default_factory=list)
    since: float = 0.0

    # --- set-up ----------------------------------------------------------------------------
    def config_text(self, replicas: list[Replica] | None = None, **top) -> str:
        lines = [f"{k} = {toml_value(v)}" for k, v in {**self.top, **top}.items()]
        if self.watchdog:
            lines.append("[watchdog]")
            lines += [f"{k} = {toml_value(v)}" for k, v in self.watchdog.items()]
        if self.memory:
            lines.append("[memory]")
            lines += [f"{k} = {toml_value(v)}" for k, v in self.memory.items()]
        if self.proxy:
            lines.append("[proxy]")
            lines += [f"{k} = {toml_value(v)}" for k, v in self.proxy.items()]
        for r in replicas if replicas is not None else self.replicas:
            lines += ["[[replicas]]", f'name = "{r.name}"', f'unit = "{r.unit}"', f'url = "{r.url}"', f'model = "{r.model}"']
            if not self.replica_defaults:
                lines += [f"startup_grace_s = {r.startup_grace_s}", f"health_timeout_s = {r.health_timeout_s}",
                          "metrics_timeout_s = 1.0", "canary_timeout_s = 2.0"]
            lines += [f"{k} = {toml_value(v)}" for k, v in r.config.items()]
        return "\n".join(lines) + "\n"

    def write_config(self, text: str | None = None, path: str = "/etc/guardian/guardian.toml") -> None:
        self.box.write(path, text if text is not None else self.config_text())

    def install_replica(self, r: Replica) -> None:
        options = f"/etc/trtllm/{r.name}.yaml"
        if r.engine == "trtllm":
            self.box.write(options, TRTLLM_OPTIONS)
        exec_start = EXEC_START[r.engine].format(
            model_arg=r.model if r.model_path is None else f"{r.model_path} --served-model-name {r.model}",
            port=r.port, fraction_arg="${GPU_MEMORY_UTILIZATION}" if r.wired else r.fraction,
            load_time_s=r.load_time_s, sim_args=r.sim_args, options=options)
        # Where a package puts units, so that `systemctl mask` (a symlink in /etc) can override it.
        self.box.write(f"/usr/lib/systemd/system/{r.unit}", REPLICA_UNIT.format(
            name=r.name, label=ENGINE_LABEL[r.engine], fraction=r.fraction, engine_env=ENGINE_ENV.get(r.engine, ""),
            exec_start=exec_start, restart=r.restart, unit_extra=r.unit_extra, service_extra=r.service_extra,
            restart_sec=r.restart_sec,
            env_file=(f"EnvironmentFile=-/var/lib/guardian/replicas/{r.name}.env" if r.wired else "")
            + (f"\nEnvironmentFile=-/etc/vllm/{r.name}.env" if r.env_after else "")))

    def install_plain(self, name: str, exec_start: str = "/bin/sleep infinity", unit_extra: str = "", description: str = "") -> None:
        self.box.write(f"/etc/systemd/system/{name}", PLAIN_UNIT.format(
            description=description or f"stand-in {name}", exec_start=exec_start, unit_extra=unit_extra))
        self.extra_units.append(name)

    def setup(self, start_guardian: bool = True) -> "World":
        self.since = time.time()
        for r in self.replicas:
            self.install_replica(r)
        self.install_plain("db.service", description="stand-in database")
        self.install_plain("proxy.service", exec_start="/usr/bin/python3 -m http.server 8080 --bind 127.0.0.1",
                           description="stand-in proxy")
        self.box.daemon_reload()
        units = [r.unit for r in self.replicas] + list(self.bystanders)
        self.box.systemctl("enable", "--now", *units)
        for r in self.replicas:
            self.wait_serving(r)
        self.write_config()
        if start_guardian:
            self.start_guardian()
        return self

    def start_guardian(self) -> None:
        self.box.systemctl("restart", "guardian.service")  # the package started it with its own config
        self.wait_states({r.name: "healthy" for r in self.replicas}, timeout_s=30)

    def teardown(self) -> None:
        b = self.box
        b.systemctl("stop", "guardian.service", check=False)
        units = [r.unit for r in self.replicas] + list(self.extra_units)
        b.systemctl("disable", "--now", *units, check=False)
        b.systemctl("unmask", *units, check=False)
        for u in units:
            b.run(["rm", "-f", f"/etc/systemd/system/{u}", f"/usr/lib/systemd/system/{u}"], check=False)
        if self.nginx_on:
            b.systemctl("stop", "nginx.service", "loadgen.service", check=False)
            b.run(["rm", "-f", NGINX_SITE, "/run/loadgen.stop", "/run/loadgen.jsonl"], check=False)
        b.run("rm -rf /etc/systemd/system/guardian.service.d /var/lib/guardian /run/guardian /etc/guardian/guardian.toml "
              "/run/sim-free-* /etc/vllm /etc/trtllm", check=False)
        b.daemon_reload()
        b.systemctl("reset-failed", check=False)

    # --- nginx in front, and clients through it ----------------------------------------------

    def start_nginx(self, retry: bool = True) -> None:
        """nginx from Debian's package, set up as in the field (least_conn, max_fails=3
        fail_timeout=30s from guardian's server_params), in front of guardian's upstream file, with
        the README's snippet; RETRY false: without its lines that send a request with no byte yet to
        the peer (non_idempotent, tries, timeout), as before issue 33."""
        self.nginx_on = True
        self.box.write(NGINX_SITE, NGINX_CONF if retry else without_retry(NGINX_CONF))
        self.box.systemctl("start", "nginx.service")
        wait_for(lambda: self.box.http(PROXY_URL + "/v1/models", timeout_s=2)[0] == 200, 20, "nginx to serve")

    def start_load(self, clients: int = 8, max_tokens: int = 40, *more: str) -> None:
        """MORE: loadgen's other options (--mode stream, --prefix TEXT)."""
        self.box.run(["rm", "-f", "/run/loadgen.stop", "/run/loadgen.jsonl"])
        self.box.run(["systemd-run", "--unit=loadgen", "-p", "Restart=no", "/usr/bin/python3",
                      "/opt/guardian/src/tests/loadgen.py", PROXY_URL, self.replicas[0].model, "/run/loadgen.jsonl",
                      "--clients", str(clients), "--max-tokens", str(max_tokens), *more])

    def requests(self) -> list[dict]:
        out = self.box.run(["cat", "/run/loadgen.jsonl"], check=False).stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def wait_requests(self, n: int, after: float = 0.0, timeout_s: float = 60) -> None:
        wait_for(lambda: sum(1 for q in self.requests() if q["t0"] >= after and not q["failed"]) >= n, timeout_s,
                 f"{n} requests through nginx")

    def stop_load(self) -> list[dict]:
        self.box.run(["touch", "/run/loadgen.stop"])
        wait_for(lambda: self.box.prop("loadgen.service", "ActiveState") in ("inactive", "failed"), 90,
                 "the clients to finish")
        self.box.systemctl("reset-failed", "loadgen.service", check=False)
        return self.requests()

    def upstream_file(self) -> str:
        return self.box.run(["cat", "/var/lib/guardian/nginx/llm.conf"], check=False).stdout

    # --- looking ---------------------------------------------------------------------------
    def wait_serving(self, r: Replica, timeout_s: float = 30) -> None:
        wait_for(lambda: self.box.http(r.url + "/health", timeout_s=2)[0] == 200, timeout_s, f"{r.name} to serve")

    def status(self) -> dict:
        # The file `guardian status --json` prints, read without starting guardian's CLI: on a
        # loaded box each CLI start takes seconds, and a poll for a state held for a tick or two
        # would see too few of them (test_system_busybox's degraded peer).
        out = self.box.run(["cat", "/run/guardian/status.json"], check=False).stdout
        try:
            return json.loads(out)
        except ValueError:
            return {}

    def states(self) -> dict[str, str]:
        return {n: r["state"] for n, r in self.status().get("replicas", {}).items()}

    def wait_states(self, want: dict[str, str], timeout_s: float) -> dict[str, str]:
        def ok():
            s = self.states()
            return s if all(s.get(k) == v for k, v in want.items()) else None
        return wait_for(ok, timeout_s, f"replica states {want} (now {self.states()})", interval_s=0.5)

    def identities(self, units: list[str]) -> dict[str, tuple[str, str]]:
        return {u: self.box.identity(u) for u in units}

    def bystander_units(self, except_replica: str) -> list[str]:
        return [r.unit for r in self.replicas if r.name != except_replica] + list(self.bystanders)

    def guardian_lines(self, *match: str) -> list[dict]:
        return self.box.journal("SYSLOG_IDENTIFIER=guardian", *match, since=self.since)

    def guardian_messages(self, *match: str) -> list[str]:
        return [e["MESSAGE"] for e in self.guardian_lines(*match)]

    def sim(self, r: Replica, *args: str) -> str:
        return self.box.run(["vllm-sim-ctl", r.url, *args]).stdout

    def sim_state(self, r: Replica) -> dict:
        return json.loads(self.sim(r, "state"))

    def fault(self, r: Replica, name: str, **params) -> None:
        self.sim(r, "fault", name, json.dumps(params))

    def main_pid(self, unit: str) -> int:
        return int(self.box.prop(unit, "MainPID"))

    def kill(self, unit: str, sig: str) -> None:
        pid = self.main_pid(unit)
        # `kill -STOP 0` would stop our own process group (pytest included): never send to 0.
        assert pid > 0, f"{unit} has no main process to signal ({self.box.prop(unit, 'ActiveState')})"
        self.box.run(["kill", f"-{sig}", str(pid)])

    def restarts_of(self, r: Replica) -> list[dict]:
        return [e for e in self.guardian_lines(f"GUARDIAN_REPLICA={r.name}", "GUARDIAN_DECISION=restart")]


# --- a real memory squeeze (the memory guard's system tests) ---------------------------------------

GiB = 2**30
DEVICE_TOTAL = 1 * GiB  # what the fraction is of, for the simulated replicas and for guardian
HOG = """#!/usr/bin/python3
import sys, time
n = int(sys.argv[1])
b = bytearray(n)
b[::4096] = b"\\x01" * len(range(0, n, 4096))
print(f"holding {n} bytes", flush=True)
time.sleep(1e9)
"""


def mem_available() -> int:
    return sample_memory().available_bytes


def start_with_thresholds(w: World, below_now_gib: float = 1.0, critical_below_now_gib: float = 6.0) -> int:
    """Replicas up, then thresholds relative to what is available now; then guardian."""
    w.setup(start_guardian=False)
    avail0 = mem_available()
    w.memory["min_headroom_bytes"] = avail0 - int(below_now_gib * GiB)
    w.memory["critical_headroom_bytes"] = avail0 - int(critical_below_now_gib * GiB)
    w.write_config()
    w.start_guardian()
    return avail0


def hog(w: World, name: str, gib: float) -> None:
    w.install_plain(name, exec_start=f"/usr/local/bin/hog {int(gib * GiB)}", description="stand-in build")
    w.box.daemon_reload()
    w.box.systemctl("start", name)


def line_with(w: World, contains: str, *match: str, timeout_s: float = 40) -> dict:
    try:
        return wait_for(lambda: next((e for e in w.guardian_lines(*match) if contains in e["MESSAGE"]), None),
                        timeout_s, f"a guardian line containing {contains!r}")
    except AssertionError:  # what guardian said instead is the first thing a reader of the failure needs
        print("\n".join(f"{e.get('GUARDIAN_RULE', '-')} {e['MESSAGE']}" for e in w.guardian_lines()[-40:]))
        raise
