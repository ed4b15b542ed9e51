"""guardian vs a Kubernetes-style /health prober, on a real systemd, with the simulator.

    sudo .venv/bin/python bench/run.py                 # the full run (about an hour), writes docs/benchmarks.md
    sudo .venv/bin/python bench/run.py --quick --out /tmp/b.md   # a smoke run of every part (minutes)

guardian runs at its default settings. The baseline (bench/baseline_prober.py, for the benchmark
only) does what a Kubernetes liveness probe does by default: GET /health every 10 s with a 1 s
timeout, and restarts the unit after 3 consecutive failures. In the detection runs each watches its
own replica (guardian replica a, with b paused in guardian; the baseline replica b) and every fault
is injected into both at the same moment. In the false-restart run both watch the same loaded replica.

Raw results go to docs/benchmarks.json after each part; `--report-only` renders the table from it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from systemd_box import DISK_DIR, SystemdBox, ensure_deps, ensure_rootfs, wait_for  # noqa: E402
from world import NGINX_CONF, NGINX_SITE, PROXY, Replica, World, no_byte, without_retry  # noqa: E402

from guardian.observe.meminfo import sample_memory  # noqa: E402  (the one MemAvailable reader)

import engines_part  # noqa: E402  (bench/, beside this file)

GiB = 2**30
PARTS = ("detection", "false", "prefill", "stall", "starved", "slowpeer", "cost", "many", "conns", "memory", "memloop",
         "scrape", "clients", "fleet", "containers", "cachefit", "warmup", "engines")
# between-steps-fresh: between-steps with guardian started 20 s before the fault with nothing learned
# engine-frozen: the engine core SIGSTOPped with 4 streams running; engine-frozen-idle: the same with
# nothing queued; api-frozen-load: the API server (the unit's main process) SIGSTOPped under 8 streams;
# spinning: the engine burns CPU with 4 streams running while nothing moves (a wedged GPU kernel)
FAULTS = ("frozen", "dead-200", "stalled", "between-steps", "between-steps-fresh", "idle-dead",
          "engine-frozen", "engine-frozen-idle", "api-frozen-load", "spinning")
WINDOWS_S = {"frozen": 90, "engine-frozen": 90, "engine-frozen-idle": 90, "api-frozen-load": 90}  # others 150
BASELINE = "baseline-prober"


@dataclass
class Series:
    values: list[float] = field(default_factory=list)
    missed: int = 0
    window_s: float = 0.0

    def cell(self) -> str:
        if not self.values and not self.missed:
            return "not run"
        if not self.values:
            return f"not detected in {self.window_s:.0f} s ({self.missed} of {self.missed} trials)"
        v = sorted(self.values)
        p95 = v[min(len(v) - 1, int(0.95 * len(v)))]
        text = f"{statistics.median(v):.1f} s / {p95:.1f} s (n={len(v)})"
        if self.missed:
            text += f", {self.missed} not detected in {self.window_s:.0f} s"
        return text


class Bench:
    def __init__(self, box: SystemdBox) -> None:
        self.box = box
        self.world = World(box, top={}, watchdog={}, replica_defaults=True)  # guardian's defaults
        self.a, self.b = self.world.replicas  # a: guardian's, b: the baseline's (paused in guardian)

    # --- helpers --------------------------------------------------------------------------
    def say(self, text: str) -> None:
        print(text, flush=True)

    def restart_lines_after(self, who: str, t0: float) -> list[float]:
        if who == "guardian":
            entries = self.box.journal("SYSLOG_IDENTIFIER=guardian", f"GUARDIAN_REPLICA={self.a.name}",
                                       "GUARDIAN_DECISION=restart", since=t0)
        else:
            entries = [e for e in self.box.journal(f"SYSLOG_IDENTIFIER={BASELINE}", since=t0) if "restarting" in e["MESSAGE"]]
        return [int(e["__REALTIME_TIMESTAMP"]) / 1e6 for e in entries if int(e["__REALTIME_TIMESTAMP"]) / 1e6 >= t0]

    def serving(self, r: Replica | None = None) -> bool:
        return self.box.http((r or self.a).url + "/health", timeout_s=2)[0] == 200

    def clean(self, both: bool = False) -> None:
        """Replica a (and b) serving with no fault and no load, guardian acting on a with a fresh budget."""
        w = self.world
        for r in (self.a, self.b) if both else (self.a,):
            if not self.serving(r):
                if w.main_pid(r.unit) > 0:
                    w.kill(r.unit, "CONT")  # a frozen one would sit out its stop timeout
                self.box.systemctl("restart", r.unit)
            wait_for(lambda: self.serving(r), 60, f"replica {r.name} to serve")
            w.sim(r, "clear")
            w.sim(r, "load", "0")
        self.box.run(["guardian", "resume", self.a.name])
        wait_for(lambda: w.states().get(self.a.name) == "healthy", 120, "guardian to see a healthy")

    def baseline(self, on: bool, r: Replica | None = None) -> None:
        r = r or self.b
        if on:
            self.box.run(["systemd-run", f"--unit={BASELINE}", "-p", "Restart=no", "-p", f"SyslogIdentifier={BASELINE}", "/usr/bin/python3",
                          "/opt/guardian/src/bench/baseline_prober.py", r.url, r.unit])
        else:
            self.box.systemctl("stop", f"{BASELINE}.service", check=False)
            self.box.systemctl("reset-failed", f"{BASELINE}.service", check=False)

    # --- faults -------------------------------------------------------------------------------
    def inject(self, fault: str) -> None:
        w = self.world
        for r in (self.a, self.b):
            if fault in ("frozen", "api-frozen-load"):
                w.kill(r.unit, "STOP")  # the unit's main process: the API server
            elif fault in ("engine-frozen", "engine-frozen-idle"):
                w.fault(r, "engine-frozen")
            elif fault == "spinning":
                w.fault(r, "spinning", busy=0.5)
            elif fault in ("between-steps", "between-steps-fresh"):
                w.fault(r, "between-steps")
            else:  # dead-200, stalled, idle-dead: the engine dies, /health stays 200; they differ in the load
                w.fault(r, "engine-dead")

    def prepare(self, fault: str) -> None:
        w = self.world
        for r in (self.a, self.b):
            if fault == "dead-200":
                w.sim(r, "load", "2", json.dumps({"max_tokens": 100000}))
            elif fault == "stalled":
                w.sim(r, "load", "16", json.dumps({"max_tokens": 100000}))  # 12 running, 4 waiting
            elif fault in ("engine-frozen", "spinning"):
                w.sim(r, "load", "4", json.dumps({"max_tokens": 100000}))
            elif fault == "api-frozen-load":
                w.sim(r, "load", "8", json.dumps({"max_tokens": 100000}))
            elif fault in ("between-steps", "between-steps-fresh"):
                w.sim(r, "load", "3", json.dumps({"max_tokens": 20}))  # short requests: the batch ends within 1 s
        if fault == "between-steps-fresh":
            self.fresh_guardian(20.0)
        if fault in ("dead-200", "stalled", "between-steps", "between-steps-fresh", "engine-frozen", "spinning",
                     "api-frozen-load"):
            wait_for(lambda: w.states().get(self.a.name) == "healthy" and self.running(self.a) > 0
                     and self.running(self.b) > 0, 30, "load to run")

    def fresh_guardian(self, before_s: float) -> None:
        """guardian restarted with nothing learned (no canary latencies in its state file), BEFORE_S
        before the fault: as on a box where it was just installed."""
        self.box.systemctl("stop", "guardian.service")
        self.box.run(["python3", "-c", "import json; p='/var/lib/guardian/state.json'; d=json.load(open(p)); "
                      "d['canary_latencies']={}; json.dump(d, open(p, 'w'))"])
        self.box.systemctl("start", "guardian.service")
        started = time.monotonic()
        self.box.run(["guardian", "pause", self.b.name])  # b is the baseline's
        wait_for(lambda: time.monotonic() - started >= before_s, before_s + 5, "guardian's head start",
                 interval_s=0.2)

    def running(self, r: Replica) -> int:
        code, body = self.box.http(r.url + "/_sim/state")
        return json.loads(body).get("running", 0) if code == 200 else 0

    def detection(self, fault: str, trials: int, window_s: float, base_window_s: float) -> tuple[Series, ...]:
        """Per trial, the same fault at the same moment in a (guardian's) and b (the baseline's):
        injection -> restart issued, for each; and, for guardian, replica serving -> reported healthy,
        and restart decision -> the unit's new process started."""
        g, k, rec = Series(window_s=window_s), Series(window_s=base_window_s), Series(window_s=60)
        stop = Series(window_s=60)
        for i in range(trials):
            self.clean(both=True)
            if base_window_s > 0:
                self.baseline(True)
            self.prepare(fault)
            t0, start = time.time(), time.monotonic()
            self.inject(fault)
            g_at = k_at = None
            while ((g_at is None and time.monotonic() < start + window_s)
                   or (k_at is None and time.monotonic() < start + base_window_s)):
                if g_at is None:
                    g_at = next(iter(self.restart_lines_after("guardian", t0)), None)
                if k_at is None:
                    k_at = next(iter(self.restart_lines_after("baseline", t0)), None)
                time.sleep(0.2)
            self.baseline(False)
            text = []
            for who, at, series, win in (("guardian", g_at, g, window_s), ("baseline", k_at, k, base_window_s)):
                if win <= 0:
                    continue  # not run (--baseline-window-s 0)
                if at is None:
                    series.missed += 1
                    text.append(f"{who} not in {win:.0f} s")
                else:
                    series.values.append(at - t0)
                    text.append(f"{who} {at - t0:.1f} s")
            self.say(f"  {fault} trial {i + 1}: " + ", ".join(text))
            if g_at is not None:
                stop_s = self.new_process_after(t0)
                if stop_s is not None:
                    stop.values.append(stop_s)
                rec_s = self.recovery_after(g_at)
                if rec_s is not None:
                    rec.values.append(rec_s)
        return g, k, rec, stop

    def containers(self, trials: int) -> dict:
        """Per shape (a native unit, and the README's container shapes under real dockerd and podman),
        a frozen replica (SIGSTOP): freeze -> restart decision, decision -> the frozen process gone,
        decision -> the new one serving /health. guardian's defaults but backoff_s = 0 (trials in a row)."""
        from engines import cleanup, start_engines
        from test_system_containers import MODEL, SHAPES, restarts, watch_gone

        engines = start_engines(self.box)
        w = self.world
        w.teardown()  # the detection world (a, b) is not needed here
        out: dict = {}

        def native(box):
            r = Replica("na", 8051, model=MODEL)
            w.install_replica(r)
            box.daemon_reload()
            box.systemctl("enable", "--now", r.unit)
            return {"name": "na", "unit": r.unit}, "", "", 8051

        for shape, setup in (("native", native), *SHAPES.items()):
            replica, engine, name, port = setup(self.box)
            wait_for(lambda: self.box.http(f"http://127.0.0.1:{port}/health", timeout_s=2)[0] == 200, 60, shape)
            replica = {**replica, "url": f"http://127.0.0.1:{port}", "model": MODEL}
            lines = ["backoff_s = 0", "[[replicas]]"] + [f"{k} = {json.dumps(v)}" for k, v in replica.items()]
            self.box.write("/etc/guardian/guardian.toml", "[watchdog]\n" + "\n".join(lines) + "\n")
            self.box.systemctl("restart", "guardian.service")
            detect, gone, serve = Series(window_s=90), Series(window_s=30), Series(window_s=120)
            for i in range(trials):
                self.box.run(["guardian", "resume", replica["name"]])  # a fresh budget; as clean() does, before
                wait_for(lambda: w.states().get(replica["name"]) == "healthy", 120, f"{shape} healthy")
                pid = engines.sim_pid(engine, name) if engine else w.main_pid(replica["unit"])
                self.box.run(["rm", "-f", "/run/gone.txt"])
                watch_gone(w, pid)
                t0 = time.time()
                self.box.run(["kill", "-STOP", str(pid)])
                try:
                    line = wait_for(lambda: next((e for e in restarts(w, replica["name"])
                                                  if int(e["__REALTIME_TIMESTAMP"]) / 1e6 >= t0), None), 90, "decision")
                except AssertionError:
                    detect.missed += 1
                    continue
                decided = int(line["__REALTIME_TIMESTAMP"]) / 1e6
                detect.values.append(decided - t0)
                gone_at = float(wait_for(lambda: self.box.run(["cat", "/run/gone.txt"], check=False).stdout.strip(),
                                         30, "the frozen process gone"))
                gone.values.append(gone_at - decided)

                def new_serving():
                    now_pid = engines.sim_pid(engine, name) if engine else w.main_pid(replica["unit"])
                    return now_pid not in (0, pid) and self.box.http(replica["url"] + "/health", timeout_s=2)[0] == 200
                wait_for(new_serving, 120, f"{shape} serving again", interval_s=0.1)
                serve.values.append(time.time() - decided)
                self.say(f"  {shape} trial {i + 1}: decision {decided - t0:.1f} s, gone +{gone_at - decided:.2f} s, "
                         f"serving +{serve.values[-1]:.1f} s")
            out[shape] = (detect, gone, serve)
            self.box.systemctl("stop", "guardian.service")
            cleanup(self.box)
            self.box.run(["docker", "rm", "-f", "vllm-c"], check=False)
            self.box.systemctl("disable", "--now", "vllm-na.service", check=False)
        return out

    def new_process_after(self, t0: float) -> float | None:
        """guardian's restart decision (its journal line) -> replica a's new main process started."""
        lines = self.box.journal("SYSLOG_IDENTIFIER=guardian", f"GUARDIAN_REPLICA={self.a.name}",
                                 "GUARDIAN_DECISION=restart", since=t0)
        if not lines:
            return None
        decided_us = int(lines[0]["__MONOTONIC_TIMESTAMP"])

        def started():
            us = int(self.box.prop(self.a.unit, "ExecMainStartTimestampMonotonic") or 0)
            return us if us > decided_us else None
        try:
            return (wait_for(started, 60, "the new process", interval_s=0.2) - decided_us) / 1e6
        except AssertionError:
            return None

    def recovery_after(self, t_restart: float) -> float | None:
        """From the replica serving again (its 'Application startup complete.') to guardian saying healthy."""
        def lines():
            up = [int(e["__REALTIME_TIMESTAMP"]) / 1e6 for e in self.box.journal(f"_SYSTEMD_UNIT={self.a.unit}", since=t_restart)
                  if "Application startup complete" in e.get("MESSAGE", "")]
            ok = [int(e["__REALTIME_TIMESTAMP"]) / 1e6 for e in self.box.journal(
                "SYSLOG_IDENTIFIER=guardian", f"GUARDIAN_REPLICA={self.a.name}", "GUARDIAN_STATE=healthy", since=t_restart)]
            return (up[0], ok[-1]) if up and ok and ok[-1] >= up[0] else None
        try:
            up, ok = wait_for(lines, 60, "recovery lines", interval_s=0.5)
        except AssertionError:
            return None
        return ok - up

    # --- false restarts under load ------------------------------------------------------------
    def false_restarts(self, duration_s: float) -> tuple[int, int]:
        w, a = self.world, self.a
        self.clean()
        t0 = time.time()
        self.box.run(["systemd-run", f"--unit={BASELINE}", "-p", "Restart=no", "-p", f"SyslogIdentifier={BASELINE}", "/usr/bin/python3",
                      "/opt/guardian/src/bench/baseline_prober.py", a.url, a.unit])
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            # keep it loaded with a slow /health (a restart by the baseline clears both: put them back)
            if self.serving():
                code, body = self.box.http(a.url + "/_sim/state")
                state = json.loads(body) if code == 200 else {}
                if state.get("fault", {}).get("fault") != "slow-health":
                    w.sim(a, "load", "8", json.dumps({"max_tokens": 100000}))
                    w.fault(a, "slow-health", delay_s=2.5)  # slower than both probes' timeouts
            time.sleep(2)
        self.box.systemctl("stop", f"{BASELINE}.service", check=False)
        self.box.systemctl("reset-failed", f"{BASELINE}.service", check=False)
        return len(self.restart_lines_after("guardian", t0)), len(self.restart_lines_after("baseline", t0))

    def starved(self, duration_s: float) -> dict:
        """Issue 35's busy box: a carries 16 streams while b, idle, is starved (every answer of b
        late by a random 1-8 s, its canaries too). Restarts of b by guardian and by the baseline
        (which probes b's /health), b's slow canaries (C2), and guardian's journal lines per replica
        per hour over the window."""
        w, a, b = self.world, self.a, self.b
        self.clean(both=True)
        self.box.run(["guardian", "resume", b.name])
        wait_for(lambda: w.states().get(b.name) == "healthy", 120, "guardian to see b healthy")
        t0 = time.time()
        self.baseline(True, b)
        w.sim(a, "load", "16", json.dumps({"max_tokens": 100000}))
        w.fault(b, "starved", min_s=1, max_s=8, seed=11)
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            code, body = self.box.http(b.url + "/_sim/state", timeout_s=5)  # the simulator's own: never held
            if code == 200 and json.loads(body).get("fault", {}).get("fault") != "starved":
                w.fault(b, "starved", min_s=1, max_s=8)  # a restart (the baseline's) cleared it: put it back
            time.sleep(2)  # a measurement window, not a wait for a condition
        self.baseline(False, b)
        took_s = time.time() - t0

        def lines(*match: str) -> list[dict]:
            return self.box.journal("SYSLOG_IDENTIFIER=guardian", *match, since=t0)

        out = {
            "duration_s": round(took_s),
            "guardian": len(lines(f"GUARDIAN_REPLICA={b.name}", "GUARDIAN_DECISION=restart")),
            "baseline": len(self.restart_lines_after("baseline", t0)),
            "slow_canaries_said": len(lines(f"GUARDIAN_REPLICA={b.name}", "GUARDIAN_RULE=C2")),
            "lines_per_hour": {r.name: round(len(lines(f"GUARDIAN_REPLICA={r.name}")) * 3600 / took_s) for r in (a, b)},
            "states_said": {r.name: len(lines(f"GUARDIAN_REPLICA={r.name}", "GUARDIAN_DECISION=state")) for r in (a, b)},
        }
        w.sim(a, "load", "0")
        w.sim(b, "clear")
        return out

    def slow_peer(self, trials: int) -> dict:
        """`guardian restart a` through a real nginx with 8 clients while b answers late (every answer
        1-4 s late: b is often degraded by a probe past its timeout): how a's restart went (D1
        drained, or D2 undrained) and the clients' failed requests."""
        w, a, b = self.world, self.a, self.b
        w.proxy = dict(PROXY)
        w.write_config()
        self._behind_nginx(True)
        out: dict = {"trials": [], "requests": 0, "failed": 0}
        for i in range(trials):
            w.wait_states({r.name: "healthy" for r in w.replicas}, timeout_s=120)
            w.start_load()
            w.wait_requests(30)
            w.fault(b, "starved", min_s=1, max_s=4, seed=i)
            t0 = time.time()
            asked = self.box.run(["guardian", "restart", a.name, "--wait", "120s"], check=False, timeout=400)
            w.wait_states({a.name: "healthy"}, timeout_s=120)
            wait_for(lambda: " down;" not in w.upstream_file(), 60, "a marked up")
            back = time.time()
            w.wait_requests(20, after=back)
            reqs = w.stop_load()
            w.sim(b, "clear")
            rules = [e.get("GUARDIAN_RULE", "") for e in self.box.journal(
                "SYSLOG_IDENTIFIER=guardian", f"GUARDIAN_REPLICA={a.name}", "GUARDIAN_DECISION=proxy", since=t0)]
            failed = [q for q in reqs if q["failed"]]
            res = {"exit": asked.returncode, "rules": rules, "requests": len(reqs), "failed": len(failed),
                   "how": sorted({f"{q['failed']} from {q.get('upstream')} at {q['t0'] - t0:+.0f} s" for q in failed})[:8]}
            out["trials"].append(res)
            out["requests"] += len(reqs)
            out["failed"] += len(failed)
            self.say(f"  slow peer trial {i + 1}: {res}")
        w.proxy = {}
        w.write_config()
        self.box.systemctl("restart", "guardian.service")
        return out

    def false_stall(self, trials: int, stall_s: float = 30.0) -> dict:
        """8 real clients stream tokens from replica a while every endpoint of its API server stalls
        for STALL_S (a starved event loop, measured at 11 s on a real vLLM 0.32; 30 s here, so that
        the baseline's 3 failures 10 s apart fit in it): restarts by guardian and by the baseline,
        and the client requests that failed."""
        w, a = self.world, self.a
        out = {"trials": trials, "stall_s": stall_s, "guardian": 0, "baseline": 0, "failed": 0, "requests": 0}
        for i in range(trials):
            self.clean()
            wait_for(lambda: self.running(a) == 0, 30, "the last trial's streams gone")
            self.box.run(["rm", "-f", "/run/stall.stop", "/run/stall.jsonl"])
            self.box.run(["systemd-run", "--unit=stall-clients", "-p", "Restart=no", "/usr/bin/python3",
                          "/opt/guardian/src/tests/loadgen.py", a.url, a.model, "/run/stall.jsonl", "--clients", "8",
                          "--max-tokens", "2000", "--mode", "stream", "--stop-file", "/run/stall.stop"])
            wait_for(lambda: self.running(a) >= 8, 30, "8 streams")
            t0 = time.time()
            self.baseline(True, a)
            w.fault(a, "stall-endpoints", stall_s=stall_s)
            end = time.monotonic() + stall_s + 10
            while time.monotonic() < end:
                time.sleep(0.5)  # a measurement window, not a wait for a condition
            self.baseline(False)
            self.box.run(["touch", "/run/stall.stop"])
            self.box.systemctl("kill", "-s", "KILL", "stall-clients.service", check=False)
            self.box.systemctl("reset-failed", "stall-clients.service", check=False)
            recs = [json.loads(x) for x in self.box.run(["cat", "/run/stall.jsonl"], check=False).stdout.splitlines()
                    if x.strip()]
            g, k = len(self.restart_lines_after("guardian", t0)), len(self.restart_lines_after("baseline", t0))
            failed = sum(1 for q in recs if q["failed"] and q["t0"] < t0 + stall_s)
            out["guardian"] += g
            out["baseline"] += k
            out["failed"] += failed
            out["requests"] += len(recs)
            self.say(f"  stall trial {i + 1}: guardian {g} restart(s), baseline {k}, {failed} client request(s) failed")
        return out

    def false_prefill(self, coschedule: bool, chunks: int = 34, chunk_s: float = 2.7) -> tuple[int, int, float]:
        """A prompt prefilled in CHUNKS chunks of 512 tokens, CHUNK_S apart (the real vLLM 0.32
        measurement): token counters flat for about 90 s, longer than the 60 s stall window, with
        2 clients' requests queued behind it (beside it when co-scheduled). Restarts counted for
        guardian and the baseline; returns them and how long the prompt took."""
        w, a = self.world, self.a
        self.clean()
        t0 = time.time()
        self.box.run(["systemd-run", f"--unit={BASELINE}", "-p", "Restart=no", "-p", f"SyslogIdentifier={BASELINE}",
                      "/usr/bin/python3", "/opt/guardian/src/bench/baseline_prober.py", a.url, a.unit])
        w.sim(a, "load", "2", json.dumps({"max_tokens": 100000}))
        tokens = chunks * 512
        before = self._prompt_tokens(a)
        self.box.http(a.url + "/_sim/prefill", "POST",
                      {"prompt_tokens": tokens, "chunk_tokens": 512, "chunk_s": chunk_s, "coschedule": coschedule})
        start = time.monotonic()
        wait_for(lambda: (self._prompt_tokens(a) or 0) >= (before or 0) + tokens or not self.serving(),
                 chunks * chunk_s + 60, "the long prefill to complete")
        took = time.monotonic() - start
        w.sim(a, "load", "0")
        self.box.systemctl("stop", f"{BASELINE}.service", check=False)
        self.box.systemctl("reset-failed", f"{BASELINE}.service", check=False)
        return len(self.restart_lines_after("guardian", t0)), len(self.restart_lines_after("baseline", t0)), took

    def _prompt_tokens(self, r: Replica) -> float | None:
        code, text = self.box.http(r.url + "/metrics")
        if code != 200:
            return None
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:prompt_tokens_total{"))

    # --- cost -------------------------------------------------------------------------------
    def cpu_seconds(self, pid: str) -> float:
        fields = self.box.run(["cat", f"/proc/{pid}/stat"]).stdout.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime, in USER_HZ

    def rss_mib(self, pid: str) -> float:
        for line in self.box.run(["cat", f"/proc/{pid}/status"]).stdout.splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def cost(self, window_s: float) -> dict:
        self.clean()
        pid = self.box.prop("guardian.service", "MainPID")
        c0, t0 = self.cpu_seconds(pid), time.monotonic()
        time.sleep(window_s)  # a measurement window, not a wait for a condition
        c1, t1 = self.cpu_seconds(pid), time.monotonic()
        return {"cpu_pct": 100 * (c1 - c0) / (t1 - t0), "cpu_s_per_h": (c1 - c0) * 3600 / (t1 - t0),
                "rss_mib": self.rss_mib(pid)}

    def scrape(self, window_s: float, per_s: float = 10.0) -> dict:
        """guardian's CPU with the endpoint and the textfile on: idle, then scraped PER_S times a second."""
        w = self.world
        self.box.run(["mkdir", "-p", "/var/lib/prometheus/node-exporter"])
        self.box.run(["chgrp", "guardian", "/var/lib/prometheus/node-exporter"])
        self.box.run(["chmod", "g+w", "/var/lib/prometheus/node-exporter"])
        w.write_config(w.config_text() + '\n[metrics]\nhttp = true\ntextfile_dir = "/var/lib/prometheus/node-exporter"\n')
        w.box.systemctl("restart", "guardian.service")
        w.wait_states({r.name: "healthy" for r in w.replicas}, timeout_s=60)
        self.clean()
        pid = self.box.prop("guardian.service", "MainPID")
        c0, t0 = self.cpu_seconds(pid), time.monotonic()
        time.sleep(window_s)  # a measurement window, not a wait for a condition
        c1, t1 = self.cpu_seconds(pid), time.monotonic()
        n = int(window_s * per_s)
        script = ("import time,urllib.request\n"
                  f"for i in range({n}):\n"
                  "  t=time.monotonic(); urllib.request.urlopen('http://127.0.0.1:9464/metrics', timeout=5).read()\n"
                  f"  time.sleep(max(0, {1 / per_s} - (time.monotonic() - t)))\n")
        c2, t2 = self.cpu_seconds(pid), time.monotonic()
        self.box.run(["python3", "-c", script], timeout=window_s * 3 + 60)
        c3, t3 = self.cpu_seconds(pid), time.monotonic()
        size = len(self.box.run(["python3", "-c", "import urllib.request;print(urllib.request.urlopen("
                                 "'http://127.0.0.1:9464/metrics').read().decode())"]).stdout)
        w.write_config()
        w.box.systemctl("restart", "guardian.service")
        idle_rate = (c1 - c0) / (t1 - t0)
        extra_s = (c3 - c2) - idle_rate * (t3 - t2)
        return {"idle_cpu_pct": 100 * idle_rate, "scrapes": n, "scrape_cpu_ms": 1000 * max(0.0, extra_s) / n,
                "scraped_cpu_pct": 100 * (c3 - c2) / (t3 - t2), "body_bytes": size}

    def many_replicas(self, n: int, window_s: float) -> dict:
        w = self.world
        many = [Replica(f"r{i:02d}", 8100 + i) for i in range(1, n + 1)]
        for r in many:
            w.install_replica(r)
        self.box.daemon_reload()
        self.box.systemctl("enable", "--now", *[r.unit for r in many])
        for r in many:
            w.wait_serving(r, timeout_s=120)
        w.write_config(w.config_text(many))
        w.box.systemctl("restart", "guardian.service")
        w.wait_states({r.name: "healthy" for r in many}, timeout_s=180)
        pid = self.box.prop("guardian.service", "MainPID")
        c0, t0 = self.cpu_seconds(pid), time.monotonic()
        time.sleep(window_s)  # a measurement window
        c1, t1 = self.cpu_seconds(pid), time.monotonic()
        ticks = dict(w.status()["ticks"], cpu_pct=100 * (c1 - c0) / (t1 - t0), rss_mib=self.rss_mib(pid))
        self.box.systemctl("disable", "--now", *[r.unit for r in many], check=False)
        for r in many:
            self.box.run(["rm", "-f", f"/usr/lib/systemd/system/{r.unit}"], check=False)
        self.box.daemon_reload()
        w.write_config()
        w.box.systemctl("restart", "guardian.service")
        return ticks

    # --- the kernel's view: the cost of one look -----------------------------------------------
    def conns_cost(self, replicas: tuple[int, ...] = (2, 32), per_replica: int = 200, looks: int = 50) -> dict:
        """CPU per look of guardian's connection dump (observe/conns.py) with PER_REPLICA open client
        connections to each of N replicas' ports, on this machine: another process holds the
        listeners and both ends of every connection (as replicas and nginx would), so the table
        has 2 x N x PER_REPLICA sockets on the replicas' ports."""
        import subprocess

        from conns_flood import per_look

        from guardian.config import Config, ReplicaConfig

        holder = (
            "import socket, sys, resource\n"
            "n, per = int(sys.argv[1]), int(sys.argv[2])\n"
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))\n"
            "keep = []\n"
            "for _ in range(n):\n"
            "    srv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen(per + 16); keep.append(srv)\n"
            "    for _ in range(per):\n"
            "        keep.append(socket.create_connection(srv.getsockname())); keep.append(srv.accept()[0])\n"
            "    print(srv.getsockname()[1], flush=True)\n"
            "print('ready', flush=True)\n"
            "sys.stdin.read()\n"
        )
        out = {}
        for n in replicas:
            proc = subprocess.Popen([sys.executable, "-c", holder, str(n), str(per_replica)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True)
            try:
                ports = []
                for line in proc.stdout:
                    if line.strip() == "ready":
                        break
                    ports.append(int(line))
                cfg = Config(replicas=[ReplicaConfig(name=f"r{i}", unit=f"r{i}.service",
                                                     url=f"http://127.0.0.1:{port}", model="m")
                                       for i, port in enumerate(ports)])
                cpu_ms, wall_ms, views = per_look(cfg, looks)
                seen = sum(v.connections for v in views.values() if v is not None)
                out[str(n)] = {"cpu_ms_per_look": cpu_ms, "wall_ms_per_look": wall_ms,
                               "connections_seen": seen, "connections": n * per_replica,
                               "cpu_pct_at_2s": cpu_ms / 2000 * 100}
                self.say(f"  conns: {n} replicas x {per_replica}: {cpu_ms:.2f} ms of CPU per look, saw {seen}")
            finally:
                proc.stdin.close()
                proc.wait(30)
        return out

    # --- what clients see through nginx ---------------------------------------------------------
    def clients(self, trials: int) -> dict:
        """8 clients through a real nginx (least_conn, max_fails=3 fail_timeout=30s): failed requests
        and seconds with a 502, for each scenario, with guardian's [proxy] on and off."""
        w = self.world
        out: dict = {}
        # the README's snippet (its retry lines: a request with no byte yet goes to the peer), and a
        # hung replica without them (the snippet before issue 33)
        for on, retry in ((True, True), (True, False), (False, True)):
            w.proxy = dict(PROXY) if on else {}
            w.write_config()
            self._behind_nginx(on, retry)
            for scenario in ("guardian restart", "hung (SIGSTOP)") if retry else ("hung (SIGSTOP)",):
                for i in range(trials):
                    key = f"{scenario}|{'on' if on else 'off'}|{'retry' if retry else 'no retry lines'}"
                    res = self._clients_trial(scenario, on)
                    out.setdefault(key, []).append(res)
                    self.say(f"  clients {key} trial {i + 1}: {res}")
        w.proxy = {}
        w.write_config()
        self.box.systemctl("restart", "guardian.service")
        return out

    def _behind_nginx(self, on: bool, retry: bool = True) -> None:
        """nginx in front of both replicas, guardian's [proxy] on (or the file kept by hand), both judged."""
        w = self.world
        self.box.run("rm -rf /var/lib/guardian/nginx", check=False)
        if not on:  # nginx's file as an operator would keep it by hand: both replicas, never changed
            self.box.write("/var/lib/guardian/nginx/llm.conf", "".join(
                f"server 127.0.0.1:{r.port} max_fails=3 fail_timeout=30s;\n" for r in w.replicas))
        self.box.systemctl("restart", "guardian.service")
        for r in w.replicas:
            self.box.run(["guardian", "resume", r.name])
        w.wait_states({r.name: "healthy" for r in w.replicas}, timeout_s=60)
        if not w.nginx_on:
            w.start_nginx(retry)
        else:
            self.box.write(NGINX_SITE, NGINX_CONF if retry else without_retry(NGINX_CONF))
            self.box.systemctl("reload", "nginx.service")

    def _clients_trial(self, scenario: str, on: bool) -> dict:
        w, a = self.world, self.a
        w.wait_states({r.name: "healthy" for r in w.replicas}, timeout_s=120)
        w.start_load()
        w.wait_requests(30)
        t0 = time.time()
        if scenario == "guardian restart":
            self.box.run(["guardian", "restart", a.name], check=False, timeout=300)
        else:
            w.kill(a.unit, "STOP")
            wait_for(lambda: self.restart_lines_after("guardian", t0), 90, "the hung replica's restart")
        w.wait_states({a.name: "healthy"}, timeout_s=120)
        if on:
            wait_for(lambda: " down;" not in w.upstream_file(), 60, "a marked up")
        back = time.time()
        # 20 s more of load after it serves again: nginx's fail_timeout is 30 s
        wait_for(lambda: time.time() - back >= 20 and w.requests(), 60, "20 s of load after the restart")
        reqs = w.stop_load()
        failed = [q for q in reqs if q["failed"]]
        for r in w.replicas:
            self.box.run(["guardian", "resume", r.name])  # a fresh budget and no back-off for the next trial
        return {"requests": len(reqs), "failed": len(failed),
                "s502": len({int(q["t1"]) for q in failed if q["failed"].startswith("HTTP 502")}),
                "kinds": sorted({q["failed"].split(":")[0] for q in failed}),
                "no_byte": sum(1 for q in failed if no_byte(q)), "mid_answer": sum(1 for q in failed if not no_byte(q))}

    # --- a fleet on etcd ---------------------------------------------------------------------------
    def fleet(self, rest_s: float) -> dict:
        """8 boxes (guardians with a replica each) on a 3-member etcd cluster, every memory guard
        squeezed at once: how the fleet's one slot is passed on, and what the fleet costs etcd at rest."""
        from fleet_world import FleetWorld, max_overlap

        self.box.systemctl("stop", "guardian.service")
        fw = FleetWorld(self.box)
        try:
            fw.setup()
            t0 = time.time()
            fw.start_guardians()
            wait_for(lambda: all(fw.lowered(i) for i in range(fw.n)), 600, "every box lowered", interval_s=2)
            intervals = fw.slot_intervals()
            to_slot = []
            for i in range(fw.n):
                asked = [int(e["__REALTIME_TIMESTAMP"]) / 1e6 for e in fw.lines(i, "GUARDIAN_RULE=M15")]
                taken = [t0_ for box, t0_, _ in intervals if box == f"box{i}"]
                if taken:
                    to_slot.append(taken[0] - (asked[0] if asked else t0))
            all_done = max(t1 for _, _, t1 in intervals)
            # at rest: every box lowered (cooldown), nothing changes; count what etcd served
            before = self._etcd_requests(fw)
            time.sleep(rest_s)  # a measurement window, not a wait for a condition
            after = self._etcd_requests(fw)
            per_min = (after - before) / fw.n / (rest_s / 60)
            return {"boxes": fw.n, "requested": fw.n, "lowered": sum(fw.lowered(i) for i in range(fw.n)),
                    "max_in_flight": max_overlap(intervals), "to_slot": sorted(to_slot),
                    "all_done_s": all_done - t0, "etcd_per_guardian_per_min": per_min}
        finally:
            fw.teardown()
            self.box.systemctl("start", "guardian.service")

    def _etcd_requests(self, fw) -> float:
        """Requests the etcd members answered (gRPC, which the JSON gateway uses), summed."""
        total = 0.0
        for ep in fw.endpoints:
            code, text = self.box.http(ep + "/metrics")
            for line in text.splitlines() if code == 200 else []:
                if line.startswith("grpc_server_handled_total{") and 'grpc_type="unary"' in line:
                    total += float(line.rsplit(" ", 1)[1])
                elif line.startswith("grpc_server_msg_received_total{") and "LeaseKeepAlive" in line:
                    total += float(line.rsplit(" ", 1)[1])
        return total

    # --- memory guard -------------------------------------------------------------------------
    def memory(self, trials: int) -> tuple[Series, Series]:
        w = self.world
        to_action, to_headroom = Series(window_s=300), Series(window_s=300)
        total = 4 * GiB
        for r in w.replicas:
            r.sim_args = f"--sim-allocate --sim-total-memory-bytes {total}"
            w.install_replica(r)
        self.box.daemon_reload()
        for i in range(trials):
            self.box.run("rm -f /var/lib/guardian/replicas/*.env", check=False)
            self.box.systemctl("restart", *[r.unit for r in w.replicas])
            for r in w.replicas:
                w.wait_serving(r)
            avail = _mem_available()
            min_headroom = avail - 1 * GiB
            w.memory = {"enabled": True, "min_headroom_bytes": min_headroom, "critical_headroom_bytes": min_headroom - 4 * GiB,
                        "device_total_bytes": total}
            w.write_config()
            self.box.systemctl("restart", "guardian.service")
            for r in w.replicas:  # each trial with a fresh budget: the last trial's lowering would hold it back
                self.box.run(["guardian", "resume", r.name])
            w.wait_states({r.name: "healthy" for r in w.replicas}, timeout_s=60)
            # a hog that leaves headroom 0.1 GiB under the line; one step (0.04 x 4 GiB) gives it back
            w.install_plain("bench-hog.service", exec_start=f"/usr/local/bin/hog {int(1.1 * GiB)}")
            self.box.write("/usr/local/bin/hog", HOG, mode=0o755)
            self.box.daemon_reload()
            self.box.systemctl("start", "bench-hog.service")
            wait_for(lambda: _mem_available() < min_headroom, 60, "the squeeze to start")
            t0 = time.time()
            line = wait_for(lambda: next((e for e in self.box.journal("SYSLOG_IDENTIFIER=guardian", "GUARDIAN_DECISION=memory",
                                                                         since=t0 - 1) if "restarting" in e["MESSAGE"]), None),
                            300, "the lowering")
            to_action.values.append(int(line["__REALTIME_TIMESTAMP"]) / 1e6 - t0)
            try:
                # headroom counts once the lowered replica holds its (smaller) share again
                wait_for(lambda: any("serving again with gpu_memory_utilization" in m for m in self.box.messages(
                    "SYSLOG_IDENTIFIER=guardian", since=t0)), 120, "the lowered replica serving", interval_s=0.5)
                wait_for(lambda: _mem_available() >= min_headroom, 120, "headroom back", interval_s=0.5)
                to_headroom.values.append(time.time() - t0)
            except AssertionError:
                to_headroom.missed += 1
            self.say(f"  memory trial {i + 1}: lowering after {to_action.values[-1]:.1f} s")
            self.box.systemctl("stop", "bench-hog.service", check=False)
        w.memory = {}
        self._memory_reset()
        return to_action, to_headroom


    # --- the memory loop: fractions restored, a start guarded (issue 25) ----------------------
    MEMLOOP = dict(enabled=True, sustain_s=5, cooldown_s=0, step=0.04, floor=0.70, reserve_bytes=0,
                   device_total_bytes=GiB, priority=["a"], restore=True, restore_after_s=20, restore_cooldown_s=10)

    def _memloop_setup(self, memory: dict, sim_args: str, fractions: tuple[float, float]) -> int:
        """Both replicas restarted with SIM_ARGS at FRACTIONS, guardian with MEMORY's settings
        (thresholds relative to MemAvailable once both serve, given as min/critical GiB below it)."""
        w = self.world
        self.box.systemctl("stop", "guardian.service")
        for r, fraction in zip(w.replicas, fractions, strict=True):
            r.sim_args, r.fraction = sim_args, fraction
            w.install_replica(r)
        self.box.run("rm -f /var/lib/guardian/replicas/*.env /var/lib/guardian/state.json", check=False)
        self.box.write("/usr/local/bin/hog", HOG, mode=0o755)
        self.box.daemon_reload()
        self.box.systemctl("restart", *[r.unit for r in w.replicas])
        for r in w.replicas:
            w.wait_serving(r, 60)
        avail = _mem_available()
        below, critical = memory.pop("below_gib"), memory.pop("critical_gib")
        w.memory = memory | {"min_headroom_bytes": avail - int(below * GiB),
                             "critical_headroom_bytes": avail - int(critical * GiB)}
        w.watchdog = {"backoff_s": 0, "restart_budget": 20}  # every change is a restart: let several follow
        w.write_config()
        self.box.systemctl("restart", "guardian.service")
        w.wait_states({r.name: "healthy" for r in w.replicas}, timeout_s=60)
        return avail

    def _line_at(self, contains: str, since: float, timeout_s: float) -> float:
        entry = wait_for(lambda: next((e for e in self.box.journal("SYSLOG_IDENTIFIER=guardian", since=since)
                                       if contains in e["MESSAGE"]), None), timeout_s, f"a line with {contains!r}")
        return int(entry["__REALTIME_TIMESTAMP"]) / 1e6

    def memloop(self, trials: int) -> dict:
        """Restore: a lowered twice (0.78 -> 0.70) by a hog; from the hog's exit, when each raise
        is issued and when a serves at it. Then one start, guarded and not: the lowest MemAvailable
        while b (8 GiB device, 20 s load) restarts at 0.95 with a hog holding 2 GiB."""
        w, a = self.world, self.a
        issued = [Series(window_s=120), Series(window_s=120)]
        served = [Series(window_s=120), Series(window_s=120)]
        for i in range(trials):
            started = time.time()
            self._memloop_setup(dict(self.MEMLOOP, below_gib=1.0, critical_gib=6.0),
                                f"--sim-allocate --sim-total-memory-bytes {GiB}", (0.78, 0.70))
            w.install_plain("bench-hog.service", exec_start=f"/usr/local/bin/hog {3 * GiB}")
            self.box.daemon_reload()
            self.box.systemctl("start", "bench-hog.service")
            self._line_at("serving again with gpu_memory_utilization 0.7 ", started, 120)
            self.box.systemctl("stop", "bench-hog.service")
            t0 = time.time()
            for step, (old, new) in enumerate((("0.7", "0.74"), ("0.74", "0.78"))):
                issued[step].values.append(self._line_at(f"raising it {old} -> {new}", t0, 120) - t0)
                served[step].values.append(self._line_at(f"serving again with gpu_memory_utilization {new} ", t0, 120) - t0)
            self.say(f"  restore trial {i + 1}: raised at {issued[0].values[-1]:.1f} s and {issued[1].values[-1]:.1f} s")
        guarded = {name: self._guarded_start(on) for name, on in (("without", False), ("with", True))}
        self.box.run("rm -f /var/lib/guardian/replicas/*.env /etc/systemd/system/vllm-b.service.d/fraction.conf",
                     check=False)
        w.memory, w.watchdog = {}, {}
        self._memory_reset()
        return {"issued": issued, "served": served, "guarded": guarded}

    def _guarded_start(self, guard: bool) -> dict:
        w, b = self.world, self.b
        device = 8 * GiB
        b.load_time_s, b.startup_grace_s = 20.0, 90
        memory = dict(enabled=True, sustain_s=300, cooldown_s=600, step=0.4, floor=0.5, reserve_bytes=0,
                      device_total_bytes=device, start_guard=guard, start_guard_interval_s=0.5, restore=False,
                      below_gib=3.0, critical_gib=4.0)
        self.box.run("rm -f /etc/systemd/system/vllm-b.service.d/fraction.conf", check=False)
        avail = self._memloop_setup(memory, f"--sim-load-memory --sim-total-memory-bytes {device}", (0.4, 0.4))
        critical = avail - 4 * GiB
        w.install_plain("bench-hog.service", exec_start=f"/usr/local/bin/hog {2 * GiB}")
        self.box.daemon_reload()
        self.box.systemctl("start", "bench-hog.service")
        wait_for(lambda: _mem_available() < avail - int(1.8 * GiB), 20, "the hog's memory")
        self.box.write("/etc/systemd/system/vllm-b.service.d/fraction.conf",
                       "[Service]\nEnvironment=GPU_MEMORY_UTILIZATION=0.95\n")
        self.box.daemon_reload()
        t0 = time.time()
        self.box.systemctl("restart", b.unit)
        lowest = _mem_available()
        while time.time() - t0 < 60 and not (time.time() - t0 > 2 and self.box.http(b.url + "/health", timeout_s=1)[0] == 200):
            lowest = min(lowest, _mem_available())
            time.sleep(0.05)
        self.box.systemctl("stop", "bench-hog.service")
        stopped = any("stopping its start now" in m for m in self.box.messages("SYSLOG_IDENTIFIER=guardian", since=t0))
        b.load_time_s, b.startup_grace_s = 0.3, 20
        self.say(f"  start {'with' if guard else 'without'} the guard: lowest {(lowest - critical) / GiB:+.2f} GiB "
                 f"from the critical line; stopped: {stopped}")
        return {"lowest_vs_critical_gib": (lowest - critical) / GiB, "stopped": stopped, "served_after_s": time.time() - t0}

    # --- warm before traffic returns (issue 33) --------------------------------------------------
    def warmup(self, trials: int, prefix_tokens: int = 1000, s_per_token: float = 0.001) -> dict:
        """`guardian restart a` through a real nginx (the README's snippet, [proxy] on) while 4 clients
        stream completions that share a PREFIX_TOKENS-token system prompt (prefilled at S_PER_TOKEN a
        token when not cached: 1 s for the whole prefix); with and without a warm-up file holding that
        prompt. Per trial, the first 20 requests nginx sent a after it was marked up: time to first
        token (at the client), and a's prefix cache hit rate over them."""
        w, a, b = self.world, self.a, self.b
        shared = " ".join(f"sys{i}" for i in range(prefix_tokens))
        self.box.write("/etc/vllm/warmup.jsonl", json.dumps({"prompt": shared}) + "\n")
        out: dict = {}
        for warm in (False, True):
            for r in (a, b):
                r.sim_args = f"--sim-prefill-s-per-token {s_per_token:g}"
                r.config = {"warmup_file": "/etc/vllm/warmup.jsonl"} if warm else {}
                w.install_replica(r)
            w.proxy = dict(PROXY)
            w.write_config()
            self.box.daemon_reload()
            self.box.systemctl("restart", a.unit, b.unit)
            self._behind_nginx(True)
            key = "warm-up" if warm else "no warm-up"
            for i in range(trials):
                out.setdefault(key, []).append(self._warmup_trial(shared))
                self.say(f"  warmup {key} trial {i + 1}: {out[key][-1]}")
        for r in (a, b):
            r.sim_args, r.config = "", {}
            w.install_replica(r)
        w.proxy = {}
        w.write_config()
        self.box.daemon_reload()
        self.box.systemctl("restart", a.unit, b.unit, "guardian.service")
        return out

    def _warmup_trial(self, shared: str, first_n: int = 20) -> dict:
        w, a = self.world, self.a
        w.wait_states({r.name: "healthy" for r in w.replicas}, timeout_s=120)
        w.start_load(4, 8, "--mode", "stream", "--prefix", shared)
        w.wait_requests(10)
        t0 = time.time()
        self.box.run(["guardian", "restart", a.name, "--wait", "120s"], check=False, timeout=300)

        def marked_up() -> list[float]:
            return [int(e["__REALTIME_TIMESTAMP"]) / 1e6 for e in self.box.journal(
                "SYSLOG_IDENTIFIER=guardian", "GUARDIAN_DECISION=proxy", since=t0)
                if "marked down: none" in e["MESSAGE"] and int(e["__REALTIME_TIMESTAMP"]) / 1e6 > t0]

        up = wait_for(marked_up, 120, "a marked up again")[0]
        before = w.sim_state(a)["prefix_cache"]
        addr = f"127.0.0.1:{a.port}"

        def first() -> list[dict]:
            got = [q for q in w.requests() if q["t0"] > up and (q["upstream"] or "").startswith(addr)
                   and not q["failed"] and q["ttft_s"] is not None]
            return got if len(got) >= first_n else []

        reqs = sorted(wait_for(first, 120, f"{first_n} requests served by a after its mark-up"), key=lambda q: q["t0"])
        after = w.sim_state(a)["prefix_cache"]
        w.stop_load()
        ttft = sorted(q["ttft_s"] for q in reqs[:first_n])
        queried = after["query_tokens"] - before["query_tokens"]
        for r in w.replicas:
            self.box.run(["guardian", "resume", r.name])  # a fresh budget for the next trial
        return {"ttft_median_s": round(statistics.median(ttft), 3),
                "ttft_p95_s": round(ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))], 3),
                "hit_rate": round((after["hit_tokens"] - before["hit_tokens"]) / queried, 3) if queried else None,
                "requests": len(ttft)}

    # --- a start into a full page cache (issue 31) -----------------------------------------------
    def cachefit(self, trials: int, model_gib: int = 4) -> dict:
        """Replica a frozen while its own 4 GiB model file fills the page cache until MemFree is 2 GiB
        under what its start needs (its simulator checks MemFree at start, as vLLM on GB10): with
        memory.release_cache (the default) and without. Per trial: fault -> restart decision,
        decision -> serving (or vLLM's refusal), the release's bytes and seconds."""
        out: dict = {}
        for release in (True, False):
            trials_out = []
            for _ in range(trials):
                trials_out.append(self._cachefit_trial(release, model_gib))
                self.say(f"  cachefit release={release}: {trials_out[-1]}")
            out["release" if release else "no_release"] = trials_out
        self._cachefit_reset()
        return out

    def _cachefit_trial(self, release: bool, model_gib: int) -> dict:
        w, a = self.world, self.a
        model_dir, size = f"{DISK_DIR}/models/a", model_gib * GiB
        self.box.systemctl("stop", "guardian.service")
        # each trial's restart from a fresh budget and back-off (the last trial's restart is in the state file)
        self.box.run(["rm", "-f", "/var/lib/guardian/state.json"])
        self.box.run(["mkdir", "-p", model_dir])
        if self.box.run(["test", "-f", f"{model_dir}/model.safetensors"], check=False).returncode != 0:
            self.box.run(["dd", "if=/dev/zero", f"of={model_dir}/model.safetensors", "bs=16M",
                          f"count={size // (16 * 2**20)}", "conv=fsync", "status=none"], timeout=300)
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1")  # the host's: this part runs as root, alone
        need = sample_memory().free_bytes - size // 2
        total = int(need / 0.9)
        a.model, a.fraction = model_dir, 0.9
        a.sim_args = f"--check-memory --sim-free-source memfree --sim-total-memory-bytes {total} --hang-on-sigterm"
        w.install_replica(a)
        w.memory = {"device_total_bytes": total, "unified": True, "release_cache": release}
        w.write_config()
        self.box.daemon_reload()
        self.box.systemctl("restart", a.unit)
        w.wait_serving(a, 60)
        self.box.systemctl("start", "guardian.service")
        self.box.run(["guardian", "pause", self.b.name])
        w.wait_states({a.name: "healthy"}, timeout_s=60)
        self.box.run(f"cat {model_dir}/model.safetensors > /dev/null", timeout=300)
        free = sample_memory().free_bytes
        t0 = time.time()
        w.kill(a.unit, "STOP")
        decided = self._line_at("restarting vllm-a.service", t0, 90)
        result: dict = {"need_gib": round(need / GiB, 1), "free_gib_before": round(free / GiB, 1),
                        "to_decision_s": round(decided - t0, 1)}
        if release:
            line = wait_for(lambda: next((e for e in self.box.journal("SYSLOG_IDENTIFIER=guardian", "GUARDIAN_DECISION=cache",
                                                                        since=t0)
                                          if "released" in e["MESSAGE"]), None), 60, "the release line")
            msg = line["MESSAGE"]
            result["released_gib"] = float(msg.split("the file cache fell by ")[1].split(" GiB")[0])
            result["release_s"] = float(msg.split(" in ")[1].split(" s before")[0])
            served = self._line_at("-> healthy", decided, 120)
            result["decision_to_serving_s"] = round(served - decided, 1)
        else:
            refused = wait_for(lambda: next((e for e in self.box.journal(since=t0, unit=a.unit)
                                             if "Free memory on device" in e["MESSAGE"]), None), 60,
                               "vLLM's refusal to start")
            result["decision_to_refusal_s"] = round(int(refused["__REALTIME_TIMESTAMP"]) / 1e6 - decided, 1)
            time.sleep(30)  # a measurement window: does it serve on its own (Restart=always) within it?
            result["served_within_30s"] = self.serving(a)
        return result

    def _cachefit_reset(self) -> None:
        w, a = self.world, self.a
        self.box.systemctl("stop", "guardian.service")
        self.box.run(["rm", "-rf", f"{DISK_DIR}/models"], check=False)
        a.model, a.fraction, a.sim_args = Replica(a.name, a.port).model, Replica(a.name, a.port).fraction, ""
        w.install_replica(a)
        w.memory = {}
        w.write_config()
        self.box.daemon_reload()
        self.box.systemctl("reset-failed", a.unit, check=False)
        self.box.systemctl("restart", a.unit)
        w.wait_serving(a, 60)
        self.box.systemctl("start", "guardian.service")
        self.box.run(["guardian", "resume", self.b.name])

    def _memory_reset(self) -> None:
        """The replicas back as the other parts expect them (no memory held, fraction 0.9, no env
        file), and guardian with the world's config."""
        w = self.world
        for r in w.replicas:
            r.sim_args, r.fraction = "", 0.9
            w.install_replica(r)
        self.box.run("rm -f /var/lib/guardian/replicas/*.env", check=False)
        self.box.daemon_reload()
        self.box.systemctl("restart", *[r.unit for r in w.replicas])
        w.write_config()
        self.box.systemctl("restart", "guardian.service")


HOG = """#!/usr/bin/python3
import sys, time
n = int(sys.argv[1]); b = bytearray(n); b[::4096] = b"\\x01" * len(range(0, n, 4096)); time.sleep(1e9)
"""


def _mem_available() -> int:
    return sample_memory().available_bytes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="1 trial each and short windows: checks the harness, not a result")
    p.add_argument("--out", default=str(REPO / "docs" / "benchmarks.md"))
    p.add_argument("--report-only", action="store_true", help="render --out from the raw results of the last run")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated subset of {','.join(PARTS)}; the others are kept from the last run's JSON")
    p.add_argument("--faults", default=",".join(FAULTS),
                   help="with the detection part: the faults to measure again (the others are kept)")
    p.add_argument("--baseline-window-s", type=float, default=75.0,
                   help="the baseline's window per detection trial; 0: the baseline is not run (its cells say so)")
    args = p.parse_args()
    raw = Path(args.out).with_suffix(".json")
    if args.report_only:
        data = json.loads(raw.read_text())
        results = {k: _unjson(v) for k, v in data["results"].items()}
        write_report(Path(args.out), results, data["quick"], data["took_s"], data["date"])
        print(f"wrote {args.out}")
        return 0
    trials = 1 if args.quick else args.trials
    load_s, cost_s, many_s = (30, 20, 20) if args.quick else (600, 300, 120)
    box = SystemdBox(ensure_rootfs(), ensure_deps(), name="guardian-bench")
    box.boot()
    b = Bench(box)
    parts = args.parts.split(",")
    results: dict = {}
    started = time.time()
    if set(parts) != set(PARTS):
        data = json.loads(raw.read_text())
        results = {k: _unjson(v) for k, v in data["results"].items()}
        started -= data["took_s"]
    try:
        b.world.setup()
        if "detection" in parts:
            b.box.run(["guardian", "pause", b.b.name])  # b is the baseline's during detection
            # The baseline restarts a failing /health within 3 periods + its timeout (31 s at
            # worst): 75 s gives it more than twice that.
            for fault in FAULTS:
                if fault not in args.faults.split(","):
                    continue
                b.say(f"detection: {fault}")
                results[fault] = b.detection(fault, trials, WINDOWS_S.get(fault, 150), args.baseline_window_s)
                save(raw, results, args, started)
            b.box.run(["guardian", "resume", b.b.name])
        for part, what, run in (("false", "false restarts under load", lambda: b.false_restarts(load_s)),
                                ("prefill", "false restarts: a long chunked prefill",
                                 lambda: (b.false_prefill(False, chunks=4 if args.quick else 34),
                                          b.false_prefill(True, chunks=4 if args.quick else 34))),
                                ("stall", "false restarts: every endpoint stalls while streams flow",
                                 lambda: b.false_stall(1 if args.quick else 3)),
                                ("starved", "the starved box: an idle replica beside a saturated one",
                                 lambda: b.starved(60 if args.quick else 600)),
                                ("slowpeer", "a planned restart while its peer answers late",
                                 lambda: b.slow_peer(1 if args.quick else 3)),
                                ("cost", "cost at 2 replicas", lambda: b.cost(cost_s)),
                                ("conns", "the kernel's view: cost of one look", lambda: b.conns_cost()),
                                ("many", "32 replicas", lambda: b.many_replicas(32, many_s)),
                                ("memory", "memory guard", lambda: b.memory(trials)),
                                ("memloop", "memory guard: restore and the start guard",
                                 lambda: b.memloop(max(1, min(trials, 5)))),
                                ("scrape", "metrics endpoint", lambda: b.scrape(cost_s / 5)),
                                ("clients", "what clients see through nginx", lambda: b.clients(1 if args.quick else 3)),
                                ("fleet", "a fleet of 8 boxes on etcd", lambda: b.fleet(20 if args.quick else 120)),
                                ("containers", "replicas in containers", lambda: b.containers(max(1, min(trials, 5)))),
                                ("cachefit", "a hung replica restarted into a full page cache",
                                 lambda: b.cachefit(max(1, min(trials, 3)))),
                                ("warmup", "a planned restart's first requests, warmed or not",
                                 lambda: b.warmup(1 if args.quick else 3)),
                                # last: it takes the vLLM world down
                                ("engines", "every engine: llama-server (real), guardian's CPU per engine",
                                 # 2 minutes a window per engine (4 engines): the cost part has 5 for one
                                 lambda: engines_part.engines(b, 1 if args.quick else min(trials, 5),
                                                              30 if args.quick else 240, min(cost_s, 120)))):
            if part in parts:
                b.say(what)
                results[part] = run()
                b.say(f"  {part}: {_json(results[part])}")
                save(raw, results, args, started)
    finally:
        b.world.teardown()
        box.halt()
    write_report(Path(args.out), results, args.quick, time.time() - started)
    print(f"wrote {args.out}")
    return 0


def save(raw: Path, results: dict, args, started: float) -> None:
    """The raw results so far: a run cut short still leaves what it measured."""
    data = {"date": time.strftime("%Y-%m-%d"), "quick": args.quick, "took_s": time.time() - started,
            "results": {k: _json(v) for k, v in results.items()}}
    tmp = raw.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(raw)


def _json(v):
    if isinstance(v, Series):
        return {"series": asdict(v)}
    if isinstance(v, dict):
        return {k: _json(x) for k, x in v.items()}
    if isinstance(v, (tuple, list)):
        return [_json(x) for x in v]
    return v


def _unjson(v):
    if isinstance(v, dict) and set(v) == {"series"}:
        return Series(**v["series"])
    if isinstance(v, dict):
        return {k: _unjson(x) for k, x in v.items()}
    if isinstance(v, list):
        return tuple(_unjson(x) for x in v)
    return v


def write_report(path: Path, r: dict, quick: bool, took_s: float, date: str | None = None) -> None:
    cost, many = r["cost"], r["many"]
    mem_action, mem_headroom = r["memory"]
    rows = []
    targets = {"frozen": ("<= 10 s", 10.0), "dead-200": ("<= 30 s", 30.0), "stalled": ("<= 30 s", 30.0),
               "between-steps": ("<= 30 s", 30.0), "between-steps-fresh": ("<= 30 s", 30.0),
               "idle-dead": ("<= 30 s", 30.0), "engine-frozen": ("<= 10 s", 10.0),
               "engine-frozen-idle": ("<= 15 s", 15.0), "api-frozen-load": ("<= 10 s", 10.0),
               "spinning": ("<= 30 s", 30.0)}
    faults = [f for f in FAULTS if f in r]
    for fault in faults:
        g, k = r[fault][0], r[fault][1]
        text, limit = targets[fault]
        rows.append(f"| {fault} | {g.cell()} | {k.cell()} | {text} | {_verdict(g, limit)} |")
    g_false, k_false = r["false"]
    cpu_ok = "met" if cost["cpu_pct"] <= 0.5 else "**missed**"
    rss_ok = "met" if cost["rss_mib"] <= 60 else "**missed**"
    many_ok = ("met" if many["p99_s"] is not None and many["p99_s"] <= 2.0 and many["max_watchdog_ping_gap_s"] <= 15
               else "**missed**")
    lines = [
        "# Benchmarks",
        "",
        f"Run on {date or time.strftime('%Y-%m-%d')}, {platform.machine()}, {_cpus()} cores, Linux {platform.release()}, "
        f"with `bench/run.py{' --quick' if quick else ''}` (took {took_s / 60:.0f} min). guardian at its default "
        "settings (interval 2 s, stall window 60 s, unresponsive after 10 s, canary every 10 s when idle (a closer look when one is late), "
        "15 s canary timeout, 2 canary failures); the baseline probes `/health` every 10 s with a 1 s timeout "
        "and restarts after 3 consecutive failures (Kubernetes' defaults). Replicas are the simulator in a "
        "real systemd (systemd-nspawn, Debian 12), guardian installed from its .deb.",
        "",
        "How: in each detection trial the same fault is injected at the same moment into two twin replicas, "
        "a (guardian's) and b (the baseline's; guardian has b paused). Guardian's time counts until its "
        "journal line `GUARDIAN_DECISION=restart`, the baseline's until its `restarting` line; the baseline "
        "gets 75 s per trial (a failing `/health` is restarted within 3 periods + its timeout, 31 s at "
        "worst), guardian 90 s (frozen) or 150 s. Raw numbers: [benchmarks.json](benchmarks.json).",
        "",
    ]
    if quick:
        lines += ["**A smoke run (`--quick`: 1 trial each, short windows): it shows the harness works; it is not "
                  "a result.**", ""]
    lines += [
        "## Detection: fault injected -> restart issued (median / p95)",
        "",
        "| fault | guardian | baseline | target (guardian) | guardian vs target |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "dead-200: the engine stops with 2 requests in flight, `/health` keeps answering 200; stalled: the same with "
        "12 running and 4 waiting; between-steps: the engine stops right after a batch of short requests ends "
        "(`/metrics` shows 0 running, 0 waiting, frozen counters; new requests hang); idle-dead: the engine stops "
        "with nothing queued, long after the last traffic (found by the idle canary); between-steps-fresh: "
        "between-steps with guardian restarted 20 s before the fault with nothing learned (no canary latencies "
        "in its state file), so its deadlines come from its learning canaries.",
        "",
        "Restart decision -> the unit's new process started (guardian kills a hung replica's processes if its "
        "stop lasts 1 s once the restart job began; a process that ends on SIGTERM is not killed):",
        "",
        *[f"- {f}: {r[f][3].cell()}" for f in faults if len(r[f]) > 3],
        "",
        "## False restarts",
        "",
        f"{'30 s' if quick else '10 minutes'} of 8 streams of load with `/health` taking 2.5 s (slower than both probes' timeouts) "
        f"while tokens flow: **guardian {g_false}**, baseline {k_false} restarts. Target: 0 for guardian: "
        f"{'met' if g_false == 0 else '**missed**'}.",
        "",
        *_prefill_lines(r.get("prefill")),
        *_stall_lines(r.get("stall")),
        "## Cost",
        "",
        f"- 2 replicas, default interval: {cost['cpu_pct']:.2f}% of one core ({cost['cpu_s_per_h']:.0f} CPU s per hour), "
        f"RSS {cost['rss_mib']:.0f} MiB, each replica serving the real vLLM 0.32 page (51 KB, ~600 samples). "
        f"Targets: <= 0.5% ({cpu_ok}) and <= 60 MiB ({rss_ok}).",
        f"- 32 replicas: tick p50 {_s(many['p50_s'])}, p99 {_s(many['p99_s'])}, max {_s(many['max_s'])} "
        f"(interval 2 s); largest gap between watchdog pings {many['max_watchdog_ping_gap_s']:.2f} s "
        f"(WatchdogSec=30s: late means > 15 s). Target: p99 <= the interval and no late ping: {many_ok}."
        + (f" guardian at {many['cpu_pct']:.2f}% of one core, RSS {many['rss_mib']:.0f} MiB." if "cpu_pct" in many
           else ""),
        *_conns_lines(r.get("conns")),
        "",
        "## Memory guard",
        "",
        "Two replicas that really hold their share (the simulator's `--sim-allocate`, 4 GiB device), "
        "`min_headroom_bytes` set 1 GiB under what is available, then a process that takes 1.1 GiB: "
        "headroom ends 0.1 GiB under the line, and one step down (0.04 x 4 GiB) gives it back.",
        "",
        f"- squeeze starts -> lowering restart issued: {mem_action.cell()} (sustain_s 30 s at defaults)",
        f"- squeeze starts -> headroom back above the line: {mem_headroom.cell()}",
        "",
        *_memloop_lines(r.get("memloop")),
        *_scrape_lines(r.get("scrape")),
        *_clients_lines(r.get("clients")),
        *_fleet_lines(r.get("fleet")),
        *_containers_lines(r.get("containers")),
        *_cachefit_lines(r.get("cachefit")),
        *_warmup_lines(r.get("warmup")),
        *engines_part.lines(r.get("engines"), r),
        "",
        "## Recovery",
        "",
        "replica serving again (its 'Application startup complete.') -> guardian reports it healthy, after "
        "guardian's restart in the detection trials:",
        "",
        *[f"- after {f}: {r[f][2].cell()}" for f in faults],
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def _warmup_lines(c: dict | None) -> list[str]:
    if not c:
        return []
    rows = []
    for key, trials in c.items():
        med = ", ".join(f"{t['ttft_median_s']:.2f}" for t in trials)
        p95 = ", ".join(f"{t['ttft_p95_s']:.2f}" for t in trials)
        hits = ", ".join("-" if t["hit_rate"] is None else f"{100 * t['hit_rate']:.0f}%" for t in trials)
        rows.append(f"| {key} | {statistics.median(t['ttft_median_s'] for t in trials):.2f} s ({med}) "
                    f"| {statistics.median(t['ttft_p95_s'] for t in trials):.2f} s ({p95}) | {hits} |")
    return [
        "## Warm before traffic returns",
        "",
        "`guardian restart a` through a real nginx (the README's snippet, `[proxy]` on) while 4 clients stream "
        "completions (8 tokens) that share a 1,000-token system prompt, each with its own tail; the simulator "
        "prefills a token not in its prefix cache in 1 ms (the whole prompt: 1 s) and a restart empties the "
        "cache. With `warmup_file` (that prompt, one request) and without. Per trial, the first 20 requests nginx "
        "sent a after guardian marked it up: time to first token at the client, and a's prefix cache hit rate "
        "over them (tokens hit / tokens queried). Median of the trials, each trial in brackets.",
        "",
        "| a's restart | time to first token, median | p95 | prefix cache hit rate |",
        "|---|---|---|---|",
        *rows,
        "",
    ]


def _cachefit_lines(c: dict | None) -> list[str]:
    if not c:
        return []
    rel, off = c.get("release", ()), c.get("no_release", ())
    served = " / ".join(f"{t['decision_to_serving_s']:.1f} s" for t in rel)
    freed = " / ".join(f"{t['released_gib']:.1f} GiB in {t['release_s']:.2f} s" for t in rel)
    never = sum(1 for t in off if not t["served_within_30s"])
    return [
        "## A start into a full page cache",
        "",
        "Replica a frozen while its own 4 GiB model file fills the page cache until MemFree is 2 GiB under its "
        "start's need (its simulator checks MemFree at start, as vLLM on GB10):",
        "",
        f"- with `release_cache = true`: restart decision -> serving {served}; released {freed}",
        f"- with `release_cache = false`: refused by vLLM's free-memory check and not serving within 30 s in "
        f"{never} of {len(off)}",
        "",
    ]


def _memloop_lines(m: dict | None) -> list[str]:
    if not m:
        return []
    issued, served, guarded = m["issued"], m["served"], m["guarded"]
    lines = [
        "## Memory guard: fractions restored, a start guarded",
        "",
        "Restore: a (device 1 GiB) lowered 0.78 -> 0.74 -> 0.70 by a 3 GiB hog; then the hog exits. Settings "
        "for the run (not the defaults, which wait 600 s): sustain_s 5, restore_after_s 20, restore_cooldown_s 10, "
        "step 0.04; from the hog's exit:",
        "",
    ]
    for step, (old, new) in enumerate((("0.70", "0.74"), ("0.74", "0.78"))):
        lines += [f"- raise {step + 1} ({old} -> {new}) issued: {issued[step].cell()}; serving at {new}: "
                  f"{served[step].cell()}"]
    lines += [
        "",
        "A guarded start, in one run: b (device 8 GiB, a 20 s load that takes its memory as it goes) restarted at "
        "0.95 by an operator while a hog holds 2 GiB; critical_headroom_bytes 4 GiB under what was available; "
        "MemAvailable sampled every 0.05 s until b serves:",
        "",
    ]
    for name in ("without", "with"):
        g = guarded[name]
        lines += [f"- {name} the start guard: lowest MemAvailable {g['lowest_vs_critical_gib']:+.2f} GiB from the "
                  f"critical line; start stopped: {'yes' if g['stopped'] else 'no'}; b serving after "
                  f"{g['served_after_s']:.0f} s"]
    return [*lines, ""]


def _containers_lines(c: dict | None) -> list[str]:
    if not c:
        return []
    rows = [f"| {shape} | {d.cell()} | {g.cell()} | {s.cell()} |" for shape, (d, g, s) in c.items()]
    return [
        "## Replicas in containers",
        "",
        "One run, each shape in turn, the simulator frozen with SIGSTOP (guardian's defaults, backoff_s = 0 so "
        "that trials follow each other): native is a plain unit; docker-p and podman are the README's units "
        "for NVIDIA's `docker run` and for Podman (Quadlet's shape), docker-host is `docker run --network host` "
        "in a unit, unitless is the README's `docker run -d --restart unless-stopped` with no unit (restarted by "
        "the root helper). Real dockerd 20.10 and podman 4.3 in the booted box. Median / p95 (n).",
        "",
        "| shape | freeze -> restart decision | decision -> frozen process gone | decision -> new one serving /health |",
        "|---|---|---|---|",
        *rows,
        "",
    ]


def _stall_lines(st) -> list[str]:
    if not st:
        return []
    return [
        f"Every endpoint of the API server stalls for {st['stall_s']:.0f} s (`/health`, `/metrics`, `/v1/models` "
        "unanswered, as a starved vLLM 0.32 event loop did for 11 s) while 8 real clients stream tokens from it "
        f"directly, {st['trials']} trials: **guardian {st['guardian']}** restarts, baseline {st['baseline']}"
        + (f"; {st['failed']} of {st['requests']} client requests failed during the stall" if st["requests"] else
           " (each stream outlasts its trial: none ended, none failed)")
        + ". Target: 0 for guardian: "
        f"{'met' if st['guardian'] == 0 else '**missed**'}. guardian sees the streams flow in the kernel's view of "
        "the replica's connections (docs/rules.md, What the kernel shows).",
        "",
    ]


def _conns_lines(c) -> list[str]:
    if not c:
        return []
    return [f"- the kernel's view (one sock_diag dump of the replicas' established connections, with tcp_info), "
            f"{n} replicas x 200 open client connections: {v['cpu_ms_per_look']:.2f} ms of CPU per look "
            f"({v['cpu_pct_at_2s']:.2f}% of a core at one look every 2 s), {v['connections_seen']} connections seen"
            for n, v in c.items()]


def _prefill_lines(p) -> list[str]:
    if p is None:
        return []
    rows = [f"| {'co-scheduled (`--long-prefill-token-threshold` < `--max-num-batched-tokens`)' if co else 'vLLM defaults (others wait behind it)'} "
            f"| {took:.0f} s | {g} | {k} | {'met' if g == 0 else '**missed**'} |"
            for co, (g, k, took) in zip((False, True), p, strict=True)]
    return [
        "A long chunked prefill: one prompt prefilled in 512-token chunks 2.7 s apart (as measured on a real "
        "vLLM 0.32), so every token counter stands still for longer than the 60 s stall window while "
        "`kv_cache_usage_perc` rises with each chunk, with 2 clients' requests queued. Target: 0 restarts.",
        "",
        "| scheduling | prompt took | guardian restarts | baseline restarts | guardian vs target |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]


def _fleet_lines(f) -> list[str]:
    if not f:
        return []
    return [
        "## A fleet",
        "",
        "8 boxes (each a guardian, with its own unit, config and state, watching one simulated replica; models m0 and "
        "m1 on four boxes each) on a real 3-member etcd cluster (Debian's etcd-server) in the container. Every memory "
        "guard is squeezed from the start, so every box wants one lowering (a planned restart); "
        "`max_planned_restarts = 1`, `min_serving = 1`, interval 1 s, lease ttl 4 s.",
        "",
        "| boxes | planned restarts requested | done | max in flight | request -> slot (median / p95) | all done after | etcd requests per guardian per minute at rest |",
        "|---|---|---|---|---|---|---|",
        f"| {f['boxes']} | {f['requested']} | {f['lowered']} | {f['max_in_flight']} | {Series(list(f['to_slot']), 0, 600).cell()} | "
        f"{f['all_done_s']:.0f} s | {f['etcd_per_guardian_per_min']:.0f} |",
        "",
    ]


def _clients_lines(c: dict | None) -> list[str]:
    if not c:
        return []
    rows = []
    for key, trials in c.items():
        scenario, on, *retry = key.split("|")
        failed = [t["failed"] for t in trials]
        s502 = [t["s502"] for t in trials]
        kinds = sorted({k for t in trials for k in t["kinds"]}) or ["-"]
        split = "-"
        if all("no_byte" in t for t in trials):
            split = f"{sum(t['no_byte'] for t in trials)} / {sum(t['mid_answer'] for t in trials)}"
        nginx = {"retry": "README's", "no retry lines": "without its retry lines"}.get(retry[0] if retry else "", "before issue 33")
        rows.append(f"| {scenario} | {on} | {nginx} | {sum(t['requests'] for t in trials)} | {sum(failed)} "
                    f"({', '.join(map(str, failed))}) | {split} | {sum(s502)} ({', '.join(map(str, s502))}) "
                    f"| {', '.join(kinds)} |")
    return [
        "## What clients see",
        "",
        "8 clients (streaming and plain completions, 40 tokens each) through a real nginx (Debian's nginx-light; "
        "`least_conn`, `max_fails=3 fail_timeout=30s`) in front of the two replicas, from before the event until "
        "20 s after the replica serves again. nginx runs the README's snippet (its retry lines: `proxy_next_upstream "
        "error timeout http_502 http_503 non_idempotent`, 2 tries, 60 s), or that snippet without them "
        "(`proxy_next_upstream error timeout http_502 http_503`, as before issue 33). `[proxy]` on: guardian "
        "drains planned restarts and marks a hung replica down (README, Under a proxy); off: nginx's server lines "
        "are static. Failed requests are split into those that had no byte of their answer yet (what a proxy may "
        "send again) and streams broken mid-answer. Per trial in brackets.",
        "",
        "| scenario | guardian's [proxy] | nginx | requests | failed | no byte yet / mid-answer | seconds with a 502 "
        "| how they failed |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def _scrape_lines(sc: dict | None) -> list[str]:
    if sc is None:
        return []
    return [
        "## Metrics endpoint",
        "",
        f"2 replicas, `[metrics] http = true` and the textfile on: guardian at {sc['idle_cpu_pct']:.2f}% of a core "
        f"unscraped; scraped 10 times a second ({sc['scrapes']} scrapes of {sc['body_bytes'] / 1024:.1f} KiB) "
        f"{sc['scraped_cpu_pct']:.2f}%: **{sc['scrape_cpu_ms']:.2f} ms of CPU per scrape** (the tick renders the page "
        "once; a scrape copies bytes out on the endpoint's own thread). Prometheus scrapes every 15 s by default.",
        "",
    ]


def _verdict(series: Series, limit: float | None) -> str:
    if limit is None:
        return "-"
    over = sum(1 for v in series.values if v > limit) + series.missed
    n = len(series.values) + series.missed
    return f"met ({n} of {n} within)" if over == 0 else f"**missed**: {over} of {n} over {limit:g} s"


def _s(x) -> str:
    return "?" if x is None else f"{x * 1000:.0f} ms"


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


if __name__ == "__main__":
    sys.exit(main())
