"""A real llama.cpp llama-server (Debian sid's CPU build, tests/llamacpp.py) under the box's systemd, serving
a tiny GGUF made by the test: it serves, it can be frozen whole (SIGSTOP) or in its engine only (its main
thread held by ptrace while the HTTP threads answer /health), it can be kept busy, and SIGTERM stops it.

The facts are printed (pytest -rP shows them) and, when GUARDIAN_LLAMA_FACTS names a file, written there as
JSON. Never skipped: a sid root that cannot be built fails the test with why.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from engines import cgroup_of, cmdline
from llamacpp import (
    BOX_ROOT,
    SHIPPED_UNIT,
    USER,
    cleanup,
    finish_load,
    frozen_engine,
    frozen_server,
    holder_unit,
    install_llama,
    install_llama_unit,
    long_prompt,
    main_pid,
    metric,
    start_load,
    thread_state,
    threads,
    timed_get,
    wait_llama,
)
from systemd_box import BoxError, wait_for

pytestmark = pytest.mark.system

FACTS: dict[str, dict] = {}
URL = "http://127.0.0.1:{port}"


def record(key: str, facts: dict) -> None:
    FACTS[key] = facts
    print(f"FACTS {key}:\n{json.dumps(facts, indent=1)}")
    path = os.environ.get("GUARDIAN_LLAMA_FACTS")
    if path:
        with open(path, "w") as out:
            json.dump(FACTS, out, indent=1)


@pytest.fixture
def bed(box):
    try:
        b = install_llama(box)
    except BoxError as e:
        pytest.fail(f"cannot put a real llama-server in the test box: {e}", pytrace=False)
    yield b
    cleanup(box)


def completion(box, port: int, prompt: str = "the cat", max_tokens: int = 8, timeout_s: float = 10) -> tuple[int, dict | str]:
    code, text = box.http(f"{URL.format(port=port)}/v1/completions", method="POST",
                          body={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0},
                          timeout_s=timeout_s)
    return code, (json.loads(text) if code == 200 else text)


def unit_keys(text: str) -> list[tuple[str, str]]:
    """(key, value) of every assignment of a unit file, in order, comments and blank lines left out."""
    return [tuple(line.split("=", 1)) for line in text.splitlines()  # type: ignore[misc]
            if "=" in line and not line.startswith(("#", ";"))]


def start(box, name: str, port: int, **kw) -> tuple[str, int]:
    unit = install_llama_unit(box, name, port, **kw)
    t0 = time.monotonic()
    box.systemctl("start", unit)
    wait_llama(box, port)
    return unit, round(time.monotonic() - t0, 2)


# --- the bed ----------------------------------------------------------------------------------------

def test_the_unit_is_the_packaged_unit_plus_its_root(box, bed):
    """Our unit against llama.cpp-services' own llama-server.service, read from the package in the sid root."""
    shipped = (bed.root / SHIPPED_UNIT.lstrip("/")).read_text()
    install_llama_unit(box, "shape", 8400, reload=False)
    ours = box.run(["cat", "/usr/lib/systemd/system/llama-server-shape.service"]).stdout
    du = box.run(["du", "-sm", BOX_ROOT], check=False, timeout=120).stdout.split()
    record("bed", {**bed.facts, "rootfs": str(bed.root), "rootfs_mb": int(du[0]) if du else None,
                   "model_bytes": (bed.models / "tiny.gguf").stat().st_size,
                   "shipped_unit": shipped, "shipped_default": (bed.root / "etc/default/llama-server").read_text(),
                   "our_unit": ours, "our_defaults": box.run(["cat", "/etc/default/llama-server-shape"]).stdout})
    theirs, mine = unit_keys(shipped), unit_keys(ours)
    # every assignment of the packaged unit is ours too, the same but for its name-bound values
    same = {"Description", "EnvironmentFile"}
    for key, value in theirs:
        if key not in same:
            assert (key, value) in mine, (key, value, mine)
    assert ("EnvironmentFile", "/etc/default/llama-server-shape") in mine
    # and what ours adds is the replica's env file for guardian and what the sid root needs, nothing else
    added = [(k, v) for k, v in mine if (k, v) not in theirs and k not in same]
    assert added == [("RootDirectory", BOX_ROOT), ("BindReadOnlyPaths", "/srv/disk/llama:/var/lib/llama-server/models")]
    assert [v for k, v in mine if k == "EnvironmentFile"] == ["/etc/default/llama-server-shape",
                                                               "-/var/lib/guardian/replicas/shape.env"]
    assert "Restart" not in dict(theirs) and "Restart" not in dict(mine)
    assert dict(theirs)["User"] == USER and dict(theirs)["ExecStart"] == "/usr/bin/llama-server"


def test_it_serves_in_its_unit(box, bed):
    port = 8401
    unit, ready_s = start(box, "a", port, alias="tiny-a")
    base = URL.format(port=port)
    pid = main_pid(box, unit)
    code, health = box.http(f"{base}/health")
    assert (code, json.loads(health)) == (200, {"status": "ok"})
    code, models = box.http(f"{base}/v1/models")
    assert code == 200 and [m["id"] for m in json.loads(models)["data"]] == ["tiny-a"], models
    code, answer = completion(box, port, max_tokens=8)
    assert code == 200 and answer["usage"]["completion_tokens"] == 8, answer
    code, metrics = box.http(f"{base}/metrics")
    names = sorted({m for m in re.findall(r"^(llamacpp:\w+)", metrics, re.M)})
    assert code == 200 and "llamacpp:tokens_predicted_total" in names and "llamacpp:n_decode_total" in names, metrics
    assert metric(metrics, "llamacpp:tokens_predicted_total") == 8
    code, slots = box.http(f"{base}/slots")
    assert code == 200
    code, props = box.http(f"{base}/props")
    mounts = box.run(["cat", f"/proc/{pid}/mountinfo"]).stdout
    api_vfs = sorted({f.split()[4] for f in mounts.splitlines() if f.split()[4] in ("/proc", "/sys", "/dev")})
    f = {"unit": unit, "ready_s": ready_s, "pid": pid, "comm": box.run(["cat", f"/proc/{pid}/comm"]).stdout.strip(),
         "cmdline": cmdline(box, pid), "cgroup": cgroup_of(box, pid), "unit_cgroup": box.prop(unit, "ControlGroup"),
         "user": box.run(["ps", "-o", "user=", "-p", str(pid)]).stdout.strip(),
         "root": box.run(["readlink", f"/proc/{pid}/root"]).stdout.strip(),
         "model_via_proc_root": box.run(["stat", "-c", "%s", f"/proc/{pid}/root/var/lib/llama-server/models/tiny.gguf"],
                                        check=False).stdout.strip(),
         "exe_in_box_view": box.run(["test", "-e", "/usr/bin/llama-server"], check=False).returncode == 0,
         "environ_port": next((v for v in box.run(["cat", f"/proc/{pid}/environ"]).stdout.split("\0")
                               if v.startswith("LLAMA_ARG_PORT=")), None),
         "exe": box.run(["readlink", f"/proc/{pid}/exe"]).stdout.strip(),
         "MountAPIVFS": box.prop(unit, "MountAPIVFS"), "api_vfs_in_root": api_vfs,
         "threads": len(threads(box, pid)), "health": health, "models": json.loads(models),
         "completion": answer, "metric_names": names, "slot_keys": sorted(json.loads(slots)[0]),
         "props": {k: v for k, v in json.loads(props).items() if k in ("total_slots", "model_alias", "model_path",
                                                                       "is_sleeping", "build_info")}}
    record("serves", f)
    assert f["comm"] == "llama-server" and f["cgroup"] == f["unit_cgroup"] == f"/system.slice/{unit}", f
    # RootDirectory= is a mount namespace of its own: /proc/PID/root reads "/" and exe names the path in the
    # sid root, which the box's own /usr lacks; the files are reached through /proc/PID/root/
    assert f["user"] == USER and f["root"] == "/" and f["exe"] == "/usr/bin/llama-server", f
    assert f["model_via_proc_root"] == str((bed.models / "tiny.gguf").stat().st_size) and not f["exe_in_box_view"], f
    assert f["cmdline"] == "/usr/bin/llama-server" and f["environ_port"] == f"LLAMA_ARG_PORT={port}", f
    assert f["MountAPIVFS"] == "yes", f  # implied by RootDirectory=
    assert api_vfs == ["/dev", "/proc", "/sys"], mounts

    # without --metrics (the package's default, the Spark playbook's form): /metrics is 501, the rest serves
    unit_b, _ = start(box, "b", 8402, metrics=False, style="argv")
    code_b, text_b = box.http(f"{URL.format(port=8402)}/metrics")
    pid_b = main_pid(box, unit_b)
    record("no_metrics", {"unit": unit_b, "cmdline": cmdline(box, pid_b), "metrics": [code_b, text_b[:300]],
                          "models": json.loads(box.http(f"{URL.format(port=8402)}/v1/models")[1])["data"][0]["id"]})
    assert code_b == 501, text_b
    assert completion(box, 8402)[0] == 200

    # SIGTERM stops it: the unit goes inactive (no Restart=, as packaged)
    t0 = time.monotonic()
    box.kill_unit(unit, "SIGTERM")
    wait_for(lambda: box.prop(unit, "ActiveState") in ("inactive", "failed"), 30, f"{unit} to stop on SIGTERM")
    record("sigterm", {"stopped_s": round(time.monotonic() - t0, 2), "ActiveState": box.prop(unit, "ActiveState"),
                       "Result": box.prop(unit, "Result"), "ExecMainStatus": box.prop(unit, "ExecMainStatus"),
                       "ExecMainCode": box.prop(unit, "ExecMainCode"),
                       "journal_tail": box.messages(unit=unit)[-4:]})
    assert box.run(["test", "-e", f"/proc/{pid}"], check=False).returncode != 0


# --- freezing ---------------------------------------------------------------------------------------

def test_a_frozen_server_answers_nothing(box, bed):
    port = 8403
    unit, _ = start(box, "f", port)
    base = URL.format(port=port)
    with frozen_server(box, unit):
        pid = main_pid(box, unit)
        states = {t["state"] for t in threads(box, pid)}
        health = timed_get(box, f"{base}/health", 1)
        metrics = timed_get(box, f"{base}/metrics", 2)
    after = timed_get(box, f"{base}/health", 2)
    record("frozen_server", {"thread_states": sorted(states), "health": health, "metrics": metrics[0::2],
                             "health_after_SIGCONT": after})
    assert states == {"T"}, states
    assert health[0] == 0 and metrics[0] == 0, (health, metrics)
    assert after[0] == 200


def slot0(text: str) -> dict:
    s = json.loads(text)[0]
    return {"is_processing": s.get("is_processing"), "n_decoded": s.get("next_token", [{}])[0].get("n_decoded")
            if isinstance(s.get("next_token"), list) else (s.get("next_token") or {}).get("n_decoded")}


def test_an_idle_frozen_engine_answers_health_only(box, bed):
    """b) the main thread held while idle: /health 200 at once; /metrics, /slots and a completion wait."""
    port = 8404
    unit, _ = start(box, "e", port)
    base = URL.format(port=port)
    pid = main_pid(box, unit)
    idle = threads(box, pid)
    # which threads compute: one long completion, CPU ticks per thread over 2 s
    load = start_load(box, port, n=1, max_tokens=4000)
    time.sleep(0.3)
    t1 = {t["tid"]: t for t in threads(box, pid)}
    time.sleep(2)
    t2 = {t["tid"]: t for t in threads(box, pid)}
    busy = {tid: t2[tid]["cpu_ticks"] - t1[tid]["cpu_ticks"] for tid in t2 if tid in t1}
    finish_load(load)
    with frozen_engine(box, unit) as holder:
        states = {t["tid"]: t["state"] for t in threads(box, pid)}
        health = timed_get(box, f"{base}/health", 1)
        metrics = timed_get(box, f"{base}/metrics", 5)
        slots = timed_get(box, f"{base}/slots", 5)
        t0 = time.monotonic()
        code, answer = completion(box, port, max_tokens=4, timeout_s=5)
        completion_wait = round(time.monotonic() - t0, 2)
        health2 = timed_get(box, f"{base}/health", 1)
        holder_cmd = cmdline(box, int(box.prop(holder, "MainPID")))
    after = {"health": timed_get(box, f"{base}/health", 2)[0::2], "metrics": timed_get(box, f"{base}/metrics", 5)[0::2],
             "slots": timed_get(box, f"{base}/slots", 5)[0::2], "completion": completion(box, port, max_tokens=4)[0],
             "main_state": thread_state(box, pid)}
    # releasing by SIGKILL of the holder works too (the kernel detaches a dead tracer's tracees)
    with frozen_engine(box, unit) as holder:
        box.kill_unit(holder, "SIGKILL")
        wait_for(lambda: thread_state(box, pid) in ("S", "R"), 5, "the main thread to run after its holder died")
    killed_release = timed_get(box, f"{base}/metrics", 5)[0::2]
    record("frozen_engine_idle", {
        "threads": [(t["tid"], t["comm"]) for t in idle], "main_tid": pid,
        "cpu_ticks_per_thread_during_one_completion_2s": {str(k): v for k, v in busy.items() if v},
        "states_frozen": sorted({f"{'main' if k == pid else 'other'}:{v}" for k, v in states.items()}),
        "health_frozen": health, "health_frozen_after_the_waits": health2,
        "metrics_frozen": metrics[0::2], "slots_frozen": slots[0::2], "completion_frozen": [code, completion_wait],
        "holder": [holder_unit(unit), holder_cmd], "after_release": after, "release_by_holder_SIGKILL": killed_release})
    assert states[pid] == "t" and all(s in "SR" for tid, s in states.items() if tid != pid), states
    assert health[0] == 200 and health[2] < 1 and health2[0] == 200, (health, health2)
    assert metrics[0] == 0 and slots[0] == 0 and code == 0, (metrics, slots, code)
    assert after["health"][0] == after["metrics"][0] == after["slots"][0] == after["completion"] == 200, after
    assert killed_release[0] == 200


def busy_freeze(box, unit: str, port: int, scrape_first: bool) -> dict:
    """Hold the main thread 0.3 s into a 3000-token completion (SCRAPE_FIRST: /metrics and /slots read once
    while busy, before); read /metrics and /slots twice 1 s apart, try a new completion, release, finish."""
    base = URL.format(port=port)
    pid = main_pid(box, unit)
    load = start_load(box, port, n=1, max_tokens=3000, timeout_s=300)
    # Held once the completion computes: its main thread has used CPU since the load began (a
    # fixed 0.3 s could hold a server the loaded box had not yet handed the request to).
    ticks0 = sum(t["cpu_ticks"] for t in threads(box, pid) if t["tid"] == pid)
    wait_for(lambda: sum(t["cpu_ticks"] for t in threads(box, pid) if t["tid"] == pid) >= ticks0 + 2, 30,
             "the completion computing on the main thread", interval_s=0.05)
    m0 = timed_get(box, f"{base}/metrics", 5) if scrape_first else None
    s0 = timed_get(box, f"{base}/slots", 5) if scrape_first else None
    with frozen_engine(box, unit):
        f1 = {t["tid"]: t["cpu_ticks"] for t in threads(box, pid)}
        health = timed_get(box, f"{base}/health", 1)
        m1, s1 = timed_get(box, f"{base}/metrics", 3), timed_get(box, f"{base}/slots", 3)
        time.sleep(1)
        m2, s2 = timed_get(box, f"{base}/metrics", 3), timed_get(box, f"{base}/slots", 3)
        code, _ = completion(box, port, max_tokens=4, timeout_s=3)
        f2 = {t["tid"]: t["cpu_ticks"] for t in threads(box, pid)}
    held = finish_load(load, timeout_s=300)[0]
    m3 = timed_get(box, f"{base}/metrics", 5)

    def decodes(m):
        return metric(m[1], "llamacpp:n_decode_total") if m and m[0] == 200 else None
    return {"scraped_before": scrape_first, "cpu_ticks_while_frozen": sum(f2.values()) - sum(f1.values()),
            "health_frozen": health[0::2], "new_completion_frozen": code,
            "metrics_frozen": [m1[0], m1[2], m2[0], m2[2]], "slots_frozen": [s1[0], s1[2], s2[0], s2[2]],
            "n_decode_total_before_frozen_frozen_after": [decodes(m) for m in (m0, m1, m2, m3)],
            "requests_processing_frozen": metric(m1[1], "llamacpp:requests_processing") if m1[0] == 200 else None,
            "slot0_before_frozen_frozen": [slot0(s[1]) if s and s[0] == 200 else None for s in (s0, s1, s2)],
            "held_completion": {k: held.get(k) for k in ("ok", "s", "error")} | {
                "completion_tokens": (held.get("usage") or {}).get("completion_tokens")}}


def test_a_busy_frozen_engine_stands_still(box, bed):
    """b) the main thread held while a completion runs: nothing computes, the completion stands still and a new
    one waits; /health 200. /metrics and /slots (this build) mostly answer at once from the copy the main loop
    keeps while busy, every counter standing still; they waited only when held 0.3 s into a fresh server's first
    completion, in one run of three (the copy not made yet). Released, the held completion runs on to its end."""
    port = 8407
    unit, _ = start(box, "eb", port)
    f = {"never_scraped": busy_freeze(box, unit, port, scrape_first=False),
         "scraped_while_busy": busy_freeze(box, unit, port, scrape_first=True),
         "scraped_in_an_earlier_busy_spell": busy_freeze(box, unit, port, scrape_first=False)}
    record("frozen_engine_busy", f)
    for name, phase in f.items():
        said = f"{name}: {json.dumps(phase)}"
        assert phase["health_frozen"][0] == 200, said
        assert phase["new_completion_frozen"] == 0, said
        assert phase["cpu_ticks_while_frozen"] <= 3, said  # nothing computes (a tick or so of HTTP work)
        assert phase["held_completion"]["ok"], said
        assert phase["held_completion"]["completion_tokens"] == 3000, said
        _, frozen1, frozen2, after = phase["n_decode_total_before_frozen_frozen_after"]
        if frozen1 is not None and frozen2 is not None:  # answered: from a copy whose counters stand still
            assert frozen1 == frozen2 < after, phase
            assert phase["slot0_before_frozen_frozen"][1] == phase["slot0_before_frozen_frozen"][2], phase
        else:  # or they wait for the loop
            assert phase["metrics_frozen"][0] == 0, phase


def test_stopping_a_frozen_engine_waits_for_its_stop_timeout(box, bed):
    """What a restart of an engine-frozen llama-server costs: SIGTERM cannot end it (its main thread, which
    must return from the loop, is held), so systemd kills it at TimeoutStopSec."""
    port = 8405
    unit, _ = start(box, "t", port, service_extra="TimeoutStopSec=4")
    pid = main_pid(box, unit)
    holder = holder_unit(unit)
    with frozen_engine(box, unit):
        t0 = time.monotonic()
        box.systemctl("stop", unit, check=False)
        stop_s = round(time.monotonic() - t0, 2)
        gone = box.run(["test", "-e", f"/proc/{pid}"], check=False).returncode != 0
        holder_state = box.prop(holder, "ActiveState")
    record("stop_frozen_engine", {"stop_s": stop_s, "Result": box.prop(unit, "Result"), "pid_gone": gone,
                                  "holder_after": holder_state, "journal": box.messages(unit=unit)[-5:]})
    assert gone and stop_s >= 3.5, stop_s
    assert box.prop(unit, "Result") == "timeout"


# --- busy -------------------------------------------------------------------------------------------

def poll_during(box, base: str, proc, timeout_s: float = 2) -> dict:
    """/health and /metrics latencies, polled while PROC (a load) runs."""
    h, m = [], []
    while proc.poll() is None:
        h.append(timed_get(box, f"{base}/health", timeout_s)[0::2])
        m.append(timed_get(box, f"{base}/metrics", timeout_s)[0::2])
    return {"health": {"n": len(h), "codes": sorted({c for c, _ in h}), "max_s": max((s for _, s in h), default=None)},
            "metrics": {"n": len(m), "codes": sorted({c for c, _ in m}), "max_s": max((s for _, s in m), default=None)}}


def test_a_busy_llama_server_keeps_answering(box, bed):
    """c) long prompts (prefill in -b 2048 chunks, and in one llama_decode) and concurrent completions: /health
    and /metrics answer throughout (the facts carry the timings: 2 shared cores here)."""
    port = 8406
    ctx = 16384
    unit, _ = start(box, "busy", port, ctx=ctx)
    base = URL.format(port=port)
    f: dict = {"ctx": ctx}
    # 4,000 tokens here; the guardian tests' long prompt is longer (tests/test_system_llamacpp_guardian.py):
    # each prefill takes both cores while it runs, beside the suite's other tests
    for n in (4000,):  # one long prompt: prefill of N tokens, 1 token generated
        load = start_load(box, port, n=1, max_tokens=1, prompt=long_prompt(n), timeout_s=300)
        during = poll_during(box, base, load, timeout_s=5)
        r = finish_load(load)[0]
        assert r["ok"] and r["usage"]["prompt_tokens"] == n, r
        f[f"prefill_{n}"] = {"wall_s": r["s"], "prompt_ms": r["timings"]["prompt_ms"],
                             "tokens_per_s": round(r["timings"]["prompt_per_second"]), **during}
    # the same prompt in one llama_decode (-b/-ub as big as the context)
    unit2, _ = start(box, "busy1", port + 1, ctx=ctx, extra_args=("-b", str(ctx), "-ub", str(ctx)))
    load = start_load(box, port + 1, n=1, max_tokens=1, prompt=long_prompt(6000), timeout_s=300)
    during = poll_during(box, URL.format(port=port + 1), load, timeout_s=10)
    r = finish_load(load)[0]
    assert r["ok"], r
    f["prefill_6000_one_decode"] = {"wall_s": r["s"], "prompt_ms": r["timings"]["prompt_ms"], **during}
    box.systemctl("stop", unit2)
    # several concurrent completions
    load = start_load(box, port, n=4, max_tokens=300)
    during = poll_during(box, base, load)
    rs = finish_load(load)
    assert all(x["ok"] for x in rs), rs
    f["concurrent_4x300"] = {"wall_s": max(x["s"] for x in rs), **during,
                             "tokens_per_s_each": [round(x["timings"]["predicted_per_second"]) for x in rs]}
    record("busy", f)
    for key in ("prefill_4000", "prefill_6000_one_decode", "concurrent_4x300"):
        assert f[key]["health"]["codes"] == [200], f[key]
