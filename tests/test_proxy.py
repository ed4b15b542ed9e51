"""The proxy's shell (act/proxy.py): the nginx include file it renders, and the command hooks, run
for real (shell scripts) with their environment, failures and time limit. nginx itself, its
check and its reload are exercised in the real systemd (test_system_proxy.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from guardian.act.proxy import ProxySync, render_upstream
from guardian.act.state import StateStore
from guardian.config import Config, ProxyConfig, ReplicaConfig
from guardian.core.vocab import Priority
from guardian.observe.clock import now
from harness import Recorder, returns_within
from systemd_box import wait_for


def config(tmp_path, **proxy) -> Config:
    reps = [
        ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:8001", model="m"),
        ReplicaConfig(name="b", unit="vllm-b.service", url="http://[::1]:8002", model="m"),
        ReplicaConfig(name="c", unit="vllm-c.service", url="http://127.0.0.1:8003", model="n", upstream="small"),
    ]
    return Config(state_dir=tmp_path / "state", runtime_dir=tmp_path / "run", replicas=reps,
                  proxy=ProxyConfig(**proxy))


def servers(text: str) -> list[str]:
    return [line.split("  #")[0] for line in text.splitlines() if line.startswith("server ")]


def test_the_include_file_holds_this_boxs_replicas_of_that_upstream_with_down_for_those_marked_down(tmp_path):
    cfg = config(tmp_path, nginx_upstream_dir="/var/lib/guardian/nginx")
    assert servers(render_upstream(cfg, "llm", frozenset({"b"}))) == [
        "server 127.0.0.1:8001 max_fails=3 fail_timeout=30s;",
        "server [::1]:8002 max_fails=3 fail_timeout=30s down;",
    ]
    assert servers(render_upstream(cfg, "small", frozenset())) == ["server 127.0.0.1:8003 max_fails=3 fail_timeout=30s;"]


def test_server_host_and_params_as_configured(tmp_path):
    cfg = config(tmp_path, nginx_upstream_dir="/x", server_host="10.0.0.5", server_params="")
    assert servers(render_upstream(cfg, "llm", frozenset({"a"}))) == ["server 10.0.0.5:8001 down;", "server 10.0.0.5:8002;"]


@pytest.mark.parametrize("bad", [{"server_params": "x; }"}, {"server_host": "a b"}, {"drain_command": ["sh"]},
                                 {"nginx_upstream_dir": "relative"}, {"nginx_unit": "nginx"}])
def test_proxy_config_refuses_what_could_break_nginx_or_run_the_wrong_thing(bad):
    with pytest.raises(ValueError):
        ProxyConfig(**bad)


def hooks(tmp_path, drain: str, undrain: str | None = None, timeout_s: float = 5.0) -> tuple[ProxySync, Recorder]:
    log = tmp_path / "calls.jsonl"
    script = tmp_path / "hook.sh"
    script.write_text(
        "#!/bin/sh\n"
        f'printf \'{{"action":"%s","replica":"%s","unit":"%s","url":"%s"}}\\n\' "$GUARDIAN_ACTION" "$GUARDIAN_REPLICA" '
        f'"$GUARDIAN_UNIT" "$GUARDIAN_URL" >> {log}\n'
        'if [ "$GUARDIAN_ACTION" = drain ]; then ' + drain + "; else " + (undrain or "true") + "; fi\n"
    )
    script.chmod(0o755)
    cfg = config(tmp_path, drain_command=[str(script)], undrain_command=[str(script)], command_timeout_s=timeout_s)
    journal = Recorder()
    return ProxySync(cfg, None, StateStore(cfg.state_dir), journal, now), journal  # type: ignore[arg-type]


def calls(tmp_path) -> list[dict]:
    path = tmp_path / "calls.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


async def apply(p: ProxySync, want: set[str]) -> None:
    p.sync(frozenset(want))
    await p.wait()


def test_drain_and_undrain_commands_get_the_replica_in_their_environment_and_are_recorded(tmp_path):
    p, journal = hooks(tmp_path, "echo drained")
    asyncio.run(apply(p, {"a"}))
    assert p.view().applied == frozenset({"a"}) and p.view().error is None
    assert calls(tmp_path) == [{"action": "drain", "replica": "a", "unit": "vllm-a.service", "url": "http://127.0.0.1:8001"}]
    assert json.loads((tmp_path / "state" / "state.json").read_text())["proxy_down"] == ["a"]
    assert any("drained" in line.message and line.priority is Priority.INFO for line, _ in journal.lines)
    asyncio.run(apply(p, set()))
    assert [c["action"] for c in calls(tmp_path)] == ["drain", "undrain"]
    assert p.view().applied == frozenset()
    assert json.loads((tmp_path / "state" / "state.json").read_text())["proxy_down"] == []


def test_a_failing_drain_command_is_reported_with_its_output_and_not_counted_as_applied(tmp_path):
    p, journal = hooks(tmp_path, "echo upstream API refused; exit 3")
    asyncio.run(apply(p, {"a"}))
    v = p.view()
    assert v.applied == frozenset() and v.failed == frozenset({"a"})
    assert "exited with status 3" in v.error and "upstream API refused" in v.error
    assert any(line.priority is Priority.ERROR and "upstream API refused" in line.message for line, _ in journal.lines)
    # the same wish is not retried at once (RETRY_S), a different one is
    asyncio.run(apply(p, {"a"}))
    assert len(calls(tmp_path)) == 1
    asyncio.run(apply(p, {"b"}))
    assert [c["replica"] for c in calls(tmp_path)] == ["a", "b"]


def test_a_command_that_hangs_is_killed_at_its_time_limit(tmp_path):
    p, _ = hooks(tmp_path, "sleep 30", timeout_s=0.5)
    asyncio.run(apply(p, {"a"}))
    assert "did not finish within 0.5 s" in (p.view().error or "")
    assert p.view().applied == frozenset()


def test_check_says_who_includes_each_file_and_what_a_rewrite_would_change(tmp_path):
    from guardian.act.proxy import upstream_path
    from guardian.act.proxy_check import describe

    conf = tmp_path / "nginx"
    (conf / "conf.d").mkdir(parents=True)
    cfg = config(tmp_path, nginx_upstream_dir=str(tmp_path / "up"))
    (conf / "conf.d" / "llm.conf").write_text(
        f"upstream llm {{\n    least_conn;\n    include {upstream_path(cfg, 'llm')};  # guardian\n}}\n")
    upstream_path(cfg, "llm").parent.mkdir()
    upstream_path(cfg, "llm").write_text(render_upstream(cfg, "llm", frozenset()))
    found = dict((text.split(":")[1].strip(), (bad, text)) for bad, text in describe(cfg, frozenset({"a"}), conf))
    bad, text = found["upstream llm"]
    assert not bad and "included by" in text and "- server 127.0.0.1:8001" in text and "+ server 127.0.0.1:8001" in text
    bad, text = found["upstream small"]
    assert bad and "NOT included" in text and "absent" in text


def test_check_warns_where_a_request_with_no_byte_yet_would_not_go_to_the_peer(tmp_path):
    from guardian.act.proxy_check import retry_warnings

    conf = tmp_path / "nginx"
    (conf / "sites-enabled").mkdir(parents=True)
    cfg = config(tmp_path, nginx_upstream_dir=str(tmp_path / "up"))
    site = "server {{ location / {{ proxy_pass http://llm; {} }} }}\n"
    (conf / "sites-enabled" / "llm").write_text(site.format("proxy_next_upstream error timeout;"))
    (conf / "sites-enabled" / "other").write_text(site.format("").replace("llm", "elsewhere"))
    (warning,) = retry_warnings(cfg, conf)
    assert warning.startswith(f"proxy: upstream llm: {conf / 'sites-enabled' / 'llm'}: ") and "non_idempotent" in warning
    (conf / "sites-enabled" / "llm").write_text(site.format(
        "proxy_next_upstream error timeout non_idempotent; proxy_next_upstream_timeout 5s;"))
    (warning,) = retry_warnings(cfg, conf)
    # up to max(unresponsive_after_s 10, stall_canary_after_s 10 + canary_timeout_s 15) + 2 ticks (2 x 2) + 1 s
    assert "shorter than guardian's time from a replica's freeze to its kill (up to 30.0 s)" in warning
    (conf / "sites-enabled" / "llm").write_text(site.format("proxy_next_upstream error non_idempotent;"))
    assert retry_warnings(cfg, conf) == []


NGINX = [(10, "nginx: master process /usr/sbin/nginx -g daemon on; master_process on;")]


@pytest.mark.parametrize(
    ("before", "now", "took_over"),
    [
        # the signal is sent, the master has not started new workers yet
        ([(11, "nginx: worker process"), (12, "nginx: worker process")],
         [(11, "nginx: worker process"), (12, "nginx: worker process")], False),
        # new workers started, the old ones not yet told to stop: both take requests
        ([(11, "nginx: worker process")], [(11, "nginx: worker process"), (13, "nginx: worker process")], False),
        # the old ones finish what they read; only the new ones take requests
        ([(11, "nginx: worker process"), (12, "nginx: worker process")],
         [(11, "nginx: worker process is shutting down"), (13, "nginx: worker process"), (14, "nginx: worker process")],
         True),
        ([(11, "nginx: worker process")], [(13, "nginx: worker process")], True),
        # no worker at all (the master is between generations, or the unit is not nginx): not in effect
        ([(11, "nginx: worker process")], [], False),
        ([(11, "nginx: worker process")], [(11, "nginx: worker process is shutting down")], False),
    ],
)
def test_a_reload_is_in_effect_once_every_worker_taking_requests_started_after_it(before, now, took_over):
    from guardian.act.proxy import nginx_took_over, nginx_workers

    assert nginx_took_over(nginx_workers(NGINX + before), nginx_workers(NGINX + now)) is took_over


def test_only_nginx_workers_that_take_requests_count():
    from guardian.act.proxy import nginx_workers

    procs = NGINX + [(11, "nginx: worker process"), (12, "nginx: worker process is shutting down"),
                     (13, "nginx: cache manager process"), (14, "/bin/sh -c nginx: worker process")]
    assert nginx_workers(procs) == frozenset({11})
    # as systemd 252's GetUnitProcesses gives them: quoted
    quoted = [(pid, f'"{cmd}"') for pid, cmd in procs]
    assert nginx_workers(quoted) == frozenset({11})


# --- hostile or careless hook commands (issue 21): bounded output, bounded waits, no leftovers ----------

def _pids(path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _kill(pids: list[int]) -> None:
    import psutil

    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass


def _apply_within(p: ProxySync, want: set[str], bound_s: float) -> float:
    """Apply WANT; fail (instead of hanging the suite) if that takes longer than BOUND_S."""
    import time

    began = time.monotonic()
    asyncio.run(asyncio.wait_for(apply(p, want), bound_s))
    return time.monotonic() - began


def test_a_command_that_floods_its_output_keeps_a_bounded_tail_and_is_killed_at_its_limit(tmp_path):
    """`yes` for as long as the limit allows: what is kept of its output is the last few KiB, not
    everything it wrote (730 MiB in 3 s before)."""
    import tracemalloc


    p, journal = hooks(tmp_path, "yes", timeout_s=1.0)
    tracemalloc.start()
    try:
        took_s = _apply_within(p, {"a"}, 30)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 8 * 2**20, f"{peak_bytes / 2**20:.0f} MiB held for the hook's output"
    print(f"the flooding hook returned after {took_s:.2f} s")
    error = p.view().error or ""
    assert "did not finish within 1 s" in error and "y\ny\n" in error
    line = next(line for line, _ in journal.lines if "did not finish" in line.message)
    assert line.priority is Priority.ERROR and len(line.message) < 4096


def test_run_command_keeps_only_the_last_bytes_and_counts_the_rest(tmp_path):
    from guardian.act.proxy_hook import HOOK_OUTPUT_MAX_BYTES, run_command

    run = asyncio.run(run_command(["/bin/sh", "-c", "head -c 1000000 /dev/zero; echo the end"], dict(), 10.0))
    assert run.returncode == 0 and not run.timed_out and not run.pipe_held
    assert len(run.output) == HOOK_OUTPUT_MAX_BYTES and run.output.endswith(b"\0the end\n")
    assert run.output_bytes == 1_000_000 + len("the end\n")


def test_a_command_whose_setsid_child_holds_its_output_is_killed_whole_and_its_wait_is_bounded(tmp_path):
    """An ssh ControlPersist master is such a child: in its own session, holding stdout. The hook
    returned never before (ProxySync then never synced again); now it returns at its limit plus a
    short grace, with the command and that child killed, as an error that is retried."""

    pids = tmp_path / "pids"
    p, journal = hooks(tmp_path, f"setsid sleep 60 & echo $! $$ > {pids}; exec sleep 60", timeout_s=0.5)
    try:
        took_s = _apply_within(p, {"a"}, 30)
        print(f"the hook returned after {took_s:.2f} s")  # _apply_within's bound fails a hang
        assert len(_pids(pids)) == 2
        assert "did not finish within 0.5 s" in (p.view().error or "")
        assert p.view().applied == frozenset() and p.view().failed == frozenset({"a"})
        assert any(line.priority is Priority.ERROR and "did not finish" in line.message for line, _ in journal.lines)
        wait_for(lambda: all(_gone(pid) for pid in _pids(pids)), 30, "the command and its setsid child to be gone")
    finally:
        _kill(_pids(pids))


def test_a_command_that_exits_0_leaving_a_child_that_holds_its_output_is_done(tmp_path):
    """Its own process ended well: the drain is done (not "killed" at the limit), with a note that
    something it left still holds its output. What it left is not killed: it may be meant to stay."""

    pids = tmp_path / "pids"
    p, journal = hooks(tmp_path, f"echo drained; setsid sleep 60 & echo $! > {pids}", timeout_s=5.0)
    try:
        took_s = _apply_within(p, {"a"}, 30)
        # a wait for the child (60 s) would run past _apply_within's 30 s bound and fail the test
        print(f"the hook returned after {took_s:.2f} s")
        assert p.view().error is None and p.view().applied == frozenset({"a"})
        line = next(line for line, _ in journal.lines if "drained" in line.message)
        assert line.priority is Priority.INFO and " done in " in line.message and "still holds its output" in line.message
        assert not _gone(_pids(pids)[0])
    finally:
        _kill(_pids(pids))


def test_a_process_that_escaped_into_its_own_session_cannot_hold_the_hook_past_its_grace(tmp_path):
    """Forked twice, then setsid: neither a descendant nor in the command's session, so nothing
    finds it to kill; the hook still returns at its limit plus the grace, and says so."""

    pids = tmp_path / "pids"
    p, _ = hooks(tmp_path, f"(setsid sleep 60 & echo $! > {pids}); exec sleep 60", timeout_s=0.5)
    try:
        took_s = _apply_within(p, {"a"}, 30)
        print(f"the hook returned after {took_s:.2f} s")  # _apply_within's bound fails a hang
        error = p.view().error or ""
        assert "did not finish within 0.5 s" in error and "escaped the kill" in error, error
    finally:
        _kill(_pids(pids))


# --- issue 21: the files read back are bounded and not followed -------------------------------
class _Nginx:
    """systemd as _nginx sees it: `nginx -t` passes (or not), nginx is not running (nothing to reload)."""

    def __init__(self, check: str = "done") -> None:
        self.check = check
        self.jobs: list[tuple[str, str]] = []

    async def run_job(self, member: str, unit: str, timeout_s: float) -> str:
        self.jobs.append((member, unit))
        return self.check if member == "StartUnit" else "done"

    async def active_state(self, unit: str):
        from guardian.core.vocab import ActiveState

        return ActiveState.INACTIVE


def _plant(path, what: str) -> None:
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    if what == "fifo":
        os.mkfifo(path)
    elif what == "dev-zero":
        os.symlink("/dev/zero", path)
    elif what == "link to a file":
        (path.parent / "elsewhere").write_text("server 10.9.9.9:1;\n")
        os.symlink(path.parent / "elsewhere", path)
    else:
        path.write_bytes(b"#" * (2**20 + 1))


@pytest.mark.parametrize("what", ["fifo", "dev-zero", "link to a file", "oversized"])
def test_what_is_planted_at_an_upstream_file_is_replaced_never_read(tmp_path, what):
    import os
    import stat

    from guardian.act.proxy import upstream_path

    cfg = config(tmp_path, nginx_upstream_dir=str(tmp_path / "up"))
    journal = Recorder()
    sd = _Nginx()
    p = ProxySync(cfg, sd, StateStore(cfg.state_dir), journal, now)  # type: ignore[arg-type]
    path = upstream_path(cfg, "llm")
    _plant(path, what)
    returns_within(5.0, asyncio.run, apply(p, {"a"}), unblock=[path])
    assert p.view().error is None and p.view().applied == frozenset({"a"})
    assert stat.S_ISREG(os.stat(path, follow_symlinks=False).st_mode)
    assert path.read_text() == render_upstream(cfg, "llm", frozenset({"a"}))
    assert sd.jobs == [("StartUnit", cfg.proxy.nginx_check_unit)]
    said = [line.message for line, _ in journal.lines if line.priority is Priority.WARNING]
    assert len(said) == 1 and f"{path} was not read" in said[0], said
    if what == "link to a file":
        assert (path.parent / "elsewhere").read_text() == "server 10.9.9.9:1;\n"  # not written through


def test_when_nginx_t_fails_what_was_planted_is_not_put_back(tmp_path):
    import os

    from guardian.act.proxy import upstream_path

    cfg = config(tmp_path, nginx_upstream_dir=str(tmp_path / "up"))
    p = ProxySync(cfg, _Nginx("failed"), StateStore(cfg.state_dir), Recorder(), now)  # type: ignore[arg-type]
    path = upstream_path(cfg, "llm")
    _plant(path, "fifo")
    upstream_path(cfg, "small").write_text("# the operator's\n")
    returns_within(5.0, asyncio.run, apply(p, {"a"}), unblock=[path])
    err = p.view().error or ""
    assert "nginx -t" in err and f"{path} is not put back" in err, err
    assert not os.path.lexists(path) and upstream_path(cfg, "small").read_text() == "# the operator's\n"


def test_check_reads_no_fifo_and_no_huge_file_and_follows_debians_links(tmp_path):
    """`guardian check` runs as root: a FIFO at an upstream file or in /etc/nginx must not hang it,
    a huge file must not be read. sites-enabled/* are links to sites-available/*: followed."""
    import os

    from guardian.act.proxy import upstream_path
    from guardian.act.proxy_check import describe

    cfg = config(tmp_path, nginx_upstream_dir=str(tmp_path / "up"))
    conf = tmp_path / "nginx"
    for d in ("sites-available", "sites-enabled", "conf.d"):
        (conf / d).mkdir(parents=True)
    (conf / "sites-available" / "llm").write_text(f"upstream llm {{\n    include {upstream_path(cfg, 'llm')};\n}}\n")
    (conf / "sites-enabled" / "llm").symlink_to(conf / "sites-available" / "llm")
    (conf / "conf.d" / "huge.conf").write_bytes(
        f"upstream small {{\n    include {upstream_path(cfg, 'small')};\n}}\n".encode() + b"#" * 2**20)
    os.mkfifo(conf / "conf.d" / "fifo.conf")
    (conf / "conf.d" / "zero.conf").symlink_to("/dev/zero")
    (conf / "conf.d" / "to-fifo.conf").symlink_to(conf / "conf.d" / "fifo.conf")
    _plant(upstream_path(cfg, "llm"), "fifo")
    _plant(upstream_path(cfg, "small"), "oversized")
    fifos = [upstream_path(cfg, "llm"), conf / "conf.d" / "fifo.conf"]
    out = returns_within(5.0, describe, cfg, frozenset(), conf, unblock=fifos)
    found = {text.split(":")[1].strip(): (bad, text) for bad, text in out}
    bad, text = found["upstream llm"]
    assert bad and "not a regular file (a FIFO)" in text and "replaces it" in text, text
    assert f"included by {conf / 'sites-available' / 'llm'}, {conf / 'sites-enabled' / 'llm'};" in text, text
    bad, text = found["upstream small"]
    assert bad and f"larger than {2**20} bytes" in text and "NOT included" in text, text
