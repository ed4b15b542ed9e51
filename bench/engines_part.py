"""The engines part of bench/run.py (issue 42): guardian against a REAL llama-server (Debian's package,
a tiny GGUF: tests/llamacpp.py) beside the simulated vLLM of the other parts, and guardian's CPU per
replica for each engine.

- detection: a frozen server (SIGSTOP), a frozen engine while idle and while a completion runs (the
  main thread held with ptrace: /health stays 200), each injected into replica la; injection -> guardian's
  restart line, with the rule it named.
- false restarts: la under 4 concurrent completions, and one long prompt (its prefill 10-20 s on 2
  cores); guardian's restarts of la in each (0 expected).
- cost: guardian's CPU with 2 idle replicas of one engine, per replica, for each engine (vLLM, SGLang and
  TensorRT-LLM simulated, llama.cpp real), the other engines' replicas stopped.

guardian runs at its defaults; only backoff_s is 0 (trials in a row)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from llamacpp import (
    freeze_engine,
    freeze_server,
    install_llama,
    install_llama_unit,
    long_prompt,
    start_load,
    finish_load,
    thaw_engine,
    thaw_server,
    unit_name,
    wait_llama,
)
from systemd_box import wait_for
from world import Replica

LLAMA = (("la", 8401), ("lb", 8402))
ALIAS = "tiny"
CTX = 32768  # a long prompt of 16k tokens fits one slot
LLAMA_FAULTS = ("frozen", "engine-frozen-idle", "engine-frozen")
SIM_ENGINES = ("vllm", "sglang", "trtllm")


def _replica_toml(name: str, unit: str, port: int, model: str, engine: str) -> str:
    return (f'[[replicas]]\nname = "{name}"\nunit = "{unit}"\nurl = "http://127.0.0.1:{port}"\n'
            f'model = "{model}"\nengine = "{engine}"\n')


def _guardian(b: Any, replicas: str) -> None:
    b.box.write("/etc/guardian/guardian.toml", "[watchdog]\nbackoff_s = 0\n" + replicas)
    b.box.systemctl("restart", "guardian.service")


def _restart_after(b: Any, name: str, t0: float) -> dict | None:
    lines = b.box.journal("SYSLOG_IDENTIFIER=guardian", f"GUARDIAN_REPLICA={name}", "GUARDIAN_DECISION=restart",
                          since=t0)
    return next((e for e in lines if int(e["__REALTIME_TIMESTAMP"]) / 1e6 >= t0), None)


def _llama_up(b: Any) -> None:
    install_llama(b.box)
    for name, port in LLAMA:
        install_llama_unit(b.box, name, port, alias=ALIAS, ctx=CTX, restart="always", reload=False)
    b.box.daemon_reload()
    b.box.systemctl("enable", "--now", *(unit_name(n) for n, _ in LLAMA))
    for _, port in LLAMA:
        wait_llama(b.box, port)
    _guardian(b, "".join(_replica_toml(n, unit_name(n), p, ALIAS, "llama.cpp") for n, p in LLAMA))


def _llama_down(b: Any) -> None:
    b.box.systemctl("stop", "guardian.service")
    b.box.systemctl("disable", "--now", *(unit_name(n) for n, _ in LLAMA), check=False)


def _clean(b: Any) -> None:
    """la serving, with no fault, guardian seeing it healthy with a fresh budget."""
    unit = unit_name("la")
    thaw_engine(b.box, unit)
    if b.box.http("http://127.0.0.1:8401/health", timeout_s=2)[0] != 200:
        thaw_server(b.box, unit)
        b.box.systemctl("restart", unit)
    wait_llama(b.box, 8401, 60)
    b.box.run(["guardian", "resume", "la"])
    wait_for(lambda: b.world.states().get("la") == "healthy", 120, "guardian to see la healthy")


def _cell(d: dict) -> str:
    """A detection series as the other parts' cells read: median / p95 (n), and what was missed."""
    v, missed = sorted(d["values"]), d["missed"]
    if not v:
        return f"not detected in {d['window_s']:.0f} s ({missed} of {missed} trials)" if missed else "not run"
    p95 = v[min(len(v) - 1, int(0.95 * len(v)))]
    text = f"{statistics.median(v):.1f} s / {p95:.1f} s (n={len(v)})"
    return text + (f", {missed} not detected in {d['window_s']:.0f} s" if missed else "")


def llama_detection(b: Any, trials: int, window_s: float = 90.0) -> dict:
    out: dict = {}
    unit = unit_name("la")
    for fault in LLAMA_FAULTS:
        series: dict = {"values": [], "missed": 0, "window_s": window_s}
        rules: list[str] = []
        for i in range(trials):
            _clean(b)
            load = None
            if fault == "engine-frozen":
                load = start_load(b.box, 8401, n=1, max_tokens=3000)
                wait_for(lambda: b.box.http("http://127.0.0.1:8401/slots", timeout_s=2)[1].count('"is_processing":true'),
                         30, "a completion running in la")
            t0 = time.time()
            if fault == "frozen":
                freeze_server(b.box, unit)
            else:
                freeze_engine(b.box, unit)
            try:
                line = wait_for(lambda: _restart_after(b, "la", t0), window_s, f"guardian to restart la ({fault})")
            except AssertionError:
                series["missed"] += 1
                b.say(f"  llama {fault} trial {i + 1}: not detected in {window_s:.0f} s")
                continue
            finally:
                thaw_engine(b.box, unit)
                if load is not None:
                    try:
                        finish_load(load, 120)
                    except Exception:  # noqa: BLE001 - a request cut by the restart ends the load with an error
                        pass
            at = int(line["__REALTIME_TIMESTAMP"]) / 1e6
            series["values"].append(at - t0)
            rules.append(line.get("GUARDIAN_RULE", "?"))
            b.say(f"  llama {fault} trial {i + 1}: {at - t0:.1f} s by {rules[-1]}")
        out[fault] = {**series, "rules": sorted(set(rules))}
    return out


def _restarts_since(b: Any, name: str, t0: float) -> int:
    return len(b.box.journal("SYSLOG_IDENTIFIER=guardian", f"GUARDIAN_REPLICA={name}", "GUARDIAN_DECISION=restart",
                             since=t0))


def llama_false(b: Any, load_s: float, prompt_tokens: int = 16000) -> dict:
    """Restarts of la by guardian under load (4 streams, again and again for LOAD_S) and one long prompt."""
    _clean(b)
    t0 = time.time()
    end, requests, failed = time.monotonic() + load_s, 0, 0
    while time.monotonic() < end:
        done = finish_load(start_load(b.box, 8401, n=4, max_tokens=1000), 300)
        requests += len(done)
        failed += sum(1 for d in done if not d["ok"])
    load_restarts = _restarts_since(b, "la", t0)
    _clean(b)
    t1 = time.time()
    began = time.monotonic()
    done = finish_load(start_load(b.box, 8401, n=1, max_tokens=8, prompt=long_prompt(prompt_tokens)), 600)
    return {"load_s": load_s, "load_requests": requests, "load_failed": failed, "load_restarts": load_restarts,
            "long_prompt_tokens": prompt_tokens, "long_prompt_s": time.monotonic() - began,
            "long_prompt_ok": all(d["ok"] for d in done), "long_prompt_restarts": _restarts_since(b, "la", t1)}


def _cpu_per_replica(b: Any, window_s: float, n: int = 2) -> float:
    pid = b.box.prop("guardian.service", "MainPID")
    c0, t0 = b.cpu_seconds(pid), time.monotonic()
    time.sleep(window_s)  # a measurement window, not a wait for a condition
    c1, t1 = b.cpu_seconds(pid), time.monotonic()
    return 100 * (c1 - c0) / (t1 - t0) / n


def cost_per_engine(b: Any, window_s: float) -> dict:
    """guardian's CPU per idle replica, 2 replicas of one engine at a time (learning canaries over first)."""
    out: dict = {}
    w = b.world
    for engine in SIM_ENGINES:
        replicas = [Replica(f"{engine[:2]}{i}", 8500 + 10 * SIM_ENGINES.index(engine) + i, engine=engine)
                    for i in (1, 2)]
        for r in replicas:
            w.install_replica(r)
        b.box.daemon_reload()
        b.box.systemctl("enable", "--now", *(r.unit for r in replicas))
        for r in replicas:
            w.wait_serving(r, timeout_s=60)
        _guardian(b, "".join(_replica_toml(r.name, r.unit, r.port, r.model, engine) for r in replicas))
        w.wait_states({r.name: "healthy" for r in replicas}, timeout_s=120)
        time.sleep(10)  # the learning canaries (3, one a tick) are behind it: a measurement starts in the steady state
        out[engine] = _cpu_per_replica(b, window_s)
        b.say(f"  cost {engine}: {out[engine]:.2f} % of a core per replica")
        b.box.systemctl("stop", "guardian.service")
        b.box.systemctl("disable", "--now", *(r.unit for r in replicas), check=False)
    _llama_up(b)
    w.wait_states({n: "healthy" for n, _ in LLAMA}, timeout_s=120)
    time.sleep(10)  # as above
    out["llama.cpp"] = _cpu_per_replica(b, window_s)
    b.say(f"  cost llama.cpp: {out['llama.cpp']:.2f} % of a core per replica")
    return out


def engines(b: Any, trials: int, load_s: float, cost_s: float) -> dict:
    b.world.teardown()  # the vLLM world's replicas are not needed here
    out: dict = {"cost": cost_per_engine(b, cost_s)}  # ends with the llama replicas up and watched
    out["detection"] = llama_detection(b, trials)
    out["false"] = llama_false(b, load_s)
    _llama_down(b)
    return out


def lines(e: dict | None, vllm: dict) -> list[str]:
    """docs/benchmarks.md's section: llama-server (real) beside vLLM (simulated, from the detection part)."""
    if not e:
        return []
    names = {"frozen": "frozen server (SIGSTOP)", "engine-frozen-idle": "frozen engine, idle",
             "engine-frozen": "frozen engine, a completion running"}
    out = ["", "## Every engine (issue 42)", "",
           "llama-server is real (Debian's `llama.cpp-tools` 0.7.0, b11669, a 200 KB GGUF, CPU); vLLM is the "
           "simulator (the detection part above). For llama-server a frozen engine is its main thread held with "
           "ptrace: `/health` stays 200 (llama.cpp #27388).", "",
           "| fault | llama-server (real): detection, median / p95 | rule | vLLM (simulated) |", "|---|---|---|---|"]
    vllm_of = {"frozen": "frozen", "engine-frozen-idle": "engine-frozen-idle", "engine-frozen": "engine-frozen"}
    for fault, d in e["detection"].items():
        v = vllm.get(vllm_of[fault])
        out.append(f"| {names[fault]} | {_cell(d)} | {', '.join(d['rules']) or '-'} | {v[0].cell() if v else 'not run'} |")
    f = e["false"]
    out += ["", f"False restarts of llama-server: {f['load_restarts']} in {f['load_s']:.0f} s of 4 concurrent "
            f"completions ({f['load_requests']} requests, {f['load_failed']} failed); {f['long_prompt_restarts']} during a "
            f"{f['long_prompt_tokens']}-token prompt whose prefill took {f['long_prompt_s']:.1f} s "
            f"(answered: {'yes' if f['long_prompt_ok'] else 'NO'}).", "",
            "guardian's CPU per idle replica, 2 replicas of one engine (target <= 0.5 % of a core for 2):", "",
            "| engine | % of a core per replica |", "|---|---|"]
    for engine, pct in e["cost"].items():
        out.append(f"| {engine}{' (real)' if engine == 'llama.cpp' else ' (simulated)'} | {pct:.2f} |")
    return out
