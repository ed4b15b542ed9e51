"""The command line as an operator meets it (issue 23 item 4): `guardian check` counts the problem
lines it prints, names what listens on a replica's port, says what to do without a system bus,
treats "no replicas" as a problem and prints the limits one per line; `check --json`; one table of
exit statuses, in --help, in each subcommand's help and in the man page; every subcommand described;
`restart --wait` prints what the daemon says it waits for, and exits 4 when the wait ran out. No root."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from guardian.cli import check as cli_check
from guardian.cli import requests as cli_requests
from guardian.act.state import StateStore, record_answer, record_waiting
from guardian.cli import EXIT_STATUS, Exit, build_parser, main
from guardian.config import ReplicaConfig
from guardian.observe import askers, clock
from guardian.core.actions import AnswerRequest
from harness import NOBODY_PYTHON, Running, as_nobody, free_port, unit
from systemd_box import wait_for

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "packaging"))
import manpages  # noqa: E402  (guardian.8, written from README.md as the package build writes it)


@pytest.fixture(autouse=True)
def no_system_bus(monkeypatch):
    """Whatever bus the machine has, these tests see none (a check with systemd says so)."""
    monkeypatch.setenv("GUARDIAN_DBUS_ADDRESS", "unix:path=/nonexistent/guardian-test-bus")


def config(tmp_path, *replicas: tuple[str, str], health_timeout_s: float = 1.0) -> str:
    """A config in TMP_PATH with REPLICAS (name, url), its state and status there too."""
    text = f'state_dir = "{tmp_path}/state"\nruntime_dir = "{tmp_path}/run"\n'
    for name, url in replicas:
        text += (f'[[replicas]]\nname = "{name}"\nunit = "vllm-{name}.service"\nurl = "{url}"\nmodel = "m"\n'
                 f"health_timeout_s = {health_timeout_s}\nmetrics_timeout_s = {health_timeout_s}\n")
    path = tmp_path / "guardian.toml"
    path.write_text(text)
    return str(path)


def check(capsys, path: str, *flags: str) -> tuple[int, list[str]]:
    rc = main(["--config", path, "check", *flags])
    return rc, capsys.readouterr().out.splitlines()


def problem_lines(lines: list[str]) -> list[str]:
    return [x for x in lines if x.startswith(("problem: ", "hazard: ", "warning: "))]


def summary_count(lines: list[str]) -> int:
    m = re.fullmatch(r"(\d+) problem\(s\).*", lines[-1])
    assert m, lines[-1]
    return int(m.group(1))


# --- check ------------------------------------------------------------------------------------------------

def test_check_with_no_replicas_is_one_problem_and_exit_1(tmp_path, capsys):
    path = config(tmp_path)
    rc, lines = check(capsys, path, "--no-systemd")
    assert rc == Exit.PROBLEM == 1
    (line,) = problem_lines(lines)
    assert line.startswith(f"problem: no replicas configured in {path}: guardian would watch nothing")
    assert "[[replicas]]" in line and summary_count(lines) == 1


def test_an_unreachable_replica_names_its_url_unit_and_that_nothing_listens_on_its_port(tmp_path, capsys):
    port = free_port()
    rc, lines = check(capsys, config(tmp_path, ("a", f"http://127.0.0.1:{port}")), "--no-systemd")
    assert rc == 1
    (line,) = problem_lines(lines)
    assert line == (f"problem: replica a (http://127.0.0.1:{port}, unit vllm-a.service): nothing listens on port "
                    f"{port} (connection refused)")
    assert "All connection attempts failed" not in "\n".join(lines)


def test_a_port_held_by_a_process_that_does_not_answer_names_the_pid_and_its_name(tmp_path, capsys):
    with socket.socket() as held:  # listens, never answers: the probes time out
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        rc, lines = check(capsys, config(tmp_path, ("a", f"http://127.0.0.1:{port}"), health_timeout_s=0.2),
                          "--no-systemd")
    assert rc == 1
    (line,) = problem_lines(lines)
    assert f"port {port} is held by pid {os.getpid()} (" in line and "does not answer /health (timeout)" in line


def test_the_problem_count_is_the_number_of_problem_lines_printed(tmp_path, capsys):
    """It said "4 problem(s)" for 2 printed lines: /health and /metrics of one replica counted apart."""
    path = config(tmp_path, ("a", f"http://127.0.0.1:{free_port()}"), ("b", f"http://127.0.0.1:{free_port()}"))
    rc, lines = check(capsys, path, "--no-systemd")
    assert rc == 1 and len(problem_lines(lines)) == 2 == summary_count(lines)
    rc, lines = check(capsys, path)  # and with no system bus: one more, with what to do
    bus = [x for x in problem_lines(lines) if "system bus" in x]
    assert len(bus) == 1 and "run `guardian check --no-systemd`" in bus[0]
    assert rc == 1 and len(problem_lines(lines)) == 3 == summary_count(lines)


def test_check_of_a_serving_replica_is_ok_and_prints_the_limits_one_per_line(tmp_path, capsys):
    sim = Running().wait_up()
    try:
        rc, lines = check(capsys, config(tmp_path, ("a", sim.url)), "--no-systemd")
    finally:
        sim.stop()
    assert rc == 0 and lines[-1] == "ok" and problem_lines(lines) == [], lines
    assert any(x.startswith(f"replica a ({sim.url}): /health 200") for x in lines), lines
    start = lines.index("limits in effect:")
    limits = [x for x in lines[start + 1:] if x.startswith("  ")]
    assert "  restarts: one at a time per box" in limits and "  watchdog: unresponsive when" not in lines
    assert any(x.startswith("  watchdog: stalled when") for x in limits)
    assert len([x for x in limits if x.startswith("  watchdog: ")]) >= 4  # was one line of 400 characters


def test_check_json_is_one_document_with_the_problems_replicas_and_limits(tmp_path, capsys):
    sim = Running().wait_up()
    port = free_port()
    try:
        rc, lines = check(capsys, config(tmp_path, ("a", sim.url), ("b", f"http://127.0.0.1:{port}")),
                          "--no-systemd", "--json")
    finally:
        sim.stop()
    doc = json.loads("\n".join(lines))
    assert rc == 1 and doc["exit_code"] == 1 and doc["ok"] is False
    assert len(doc["problems"]) == 1 and f"nothing listens on port {port}" in doc["problems"][0]
    a, b = doc["replicas"]
    assert (a["name"], a["url"], a["unit"], a["serving"], a["health"]["status"]) == ("a", sim.url, "vllm-a.service",
                                                                                      True, 200)
    assert (b["name"], b["serving"], b["health"]["ok"], b["port"]) == ("b", False, False, port)
    assert "restarts: one at a time per box" in doc["limits"]
    assert doc["not_serving"] == [] and doc["problems"][0] in doc["lines"]


def test_check_json_of_an_invalid_config_is_a_document_too_with_exit_2(tmp_path, capsys):
    path = tmp_path / "guardian.toml"
    path.write_text("interval_s = 0.5\nstall_windw_s = 3\n")
    rc = main(["--config", str(path), "check", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == Exit.USAGE == 2 and doc["exit_code"] == 2 and "stall_windw_s" in doc["problems"][0]


def test_a_replica_whose_unit_is_still_starting_is_not_serving_not_a_problem():
    r = ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:8001", model="m",
                          startup_grace_s=600)
    assert "activating" in cli_check._starting_now(r, unit(active_state="activating"), 100.0)
    assert "within its startup grace of 600 s" in cli_check._starting_now(r, unit(inactive_exit_mono=90.0), 100.0)
    assert cli_check._starting_now(r, unit(inactive_exit_mono=90.0), 700.0) is None  # past its grace: a problem
    assert cli_check._starting_now(r, unit(active_state="failed"), 100.0) is None
    assert cli_check._starting_now(r, None, 100.0) is None  # systemd not asked: cannot tell
    report = cli_check.Report(json_out=True)
    report.not_serving("replica a: loading")
    assert report.exit_code() is Exit.NOT_SERVING
    report.problem("something")
    assert report.exit_code() is Exit.PROBLEM


# --- help, exit statuses, descriptions ------------------------------------------------------------------

def subcommands() -> dict:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return sub.choices


def test_every_subcommand_has_a_description_and_a_help_line():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    helped = {a.dest: a.help for a in sub._choices_actions}
    assert set(helped) == set(sub.choices) == set(EXIT_STATUS) - {""}
    for name, sp in sub.choices.items():
        assert sp.description and len(sp.description) > 40, name
        assert helped[name], name


def test_the_exit_status_table_is_in_help_in_each_subcommands_help_and_in_the_man_page(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for code, text in EXIT_STATUS[""].items():
        assert f"  {int(code):<3} {text.split()[0]}" in out
    for name in subcommands():
        with pytest.raises(SystemExit):
            main([name, "--help"])
        out = capsys.readouterr().out
        assert "exit status:" in out
        for code in EXIT_STATUS[name]:
            assert re.search(rf"^  {int(code)}\s", out, re.M), (name, code)
    man = manpages.guardian_8((REPO / "README.md").read_text(), "0", "2000-01-01")
    section = man[man.index(".SH EXIT STATUS"):man.index(".SH SEE ALSO")]
    for code in EXIT_STATUS[""]:
        assert f".B {int(code)}\n" in section, code


@pytest.mark.parametrize("text, seconds", [("300", 300.0), ("5m", 300.0), ("90s", 90.0), ("0", 0.0)])
def test_restart_wait_takes_seconds_or_a_unit(text, seconds):
    assert build_parser().parse_args(["restart", "a", "--wait", text]).wait == seconds


def test_restart_wait_refuses_what_is_not_a_duration(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["restart", "a", "--wait", "soon"])
    assert e.value.code == 2 and "not a duration" in capsys.readouterr().err


# --- restart --wait against a daemon (this test plays the daemon's part in the state file) --------------

def fake_daemon_status(tmp_path) -> None:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "status.json").write_text(json.dumps({"pid": os.getpid(), "updated_at": time.time(), "interval_s": 0.5}))


def counting_reads(monkeypatch, thread_name: str) -> list[int]:
    """How many times the thread THREAD_NAME has read the state file so far: [n]."""
    reads = [0]
    original = StateStore.read

    def read(self):
        if threading.current_thread().name == thread_name:
            reads[0] += 1
        return original(self)

    monkeypatch.setattr(StateStore, "read", read)
    return reads


def test_restart_wait_prints_what_it_waits_for_once_and_exits_4_when_the_wait_ran_out(tmp_path, capsys, monkeypatch):
    path = config(tmp_path, ("a", "http://127.0.0.1:8001"))
    fake_daemon_status(tmp_path)
    store = StateStore(tmp_path / "state")
    result = {}
    reads = counting_reads(monkeypatch, "asking")
    asking = threading.Thread(target=lambda: result.update(rc=main(["--config", path, "restart", "a", "--wait", "5m"])),
                              name="asking")
    asking.start()
    try:
        rid, q = wait_for(lambda: next(iter(store.read()["requests"].items()), None), 30, "the request")
        assert q["replica"] == "a" and q["wait_until"]["mono"] == pytest.approx(q["at"]["mono"] + 300, abs=0.01)
        for _ in range(3):  # said over several ticks: printed once
            store.update(lambda d: record_waiting(d, rid, "b is starting or being restarted (A3)"))
        seen = reads[0]
        wait_for(lambda: reads[0] >= seen + 3, 30, "the command to read the same waiting text 3 times")
        answer = AnswerRequest(rid, "a", False, "refused (one-at-a-time): b is starting; after waiting 300 s (A4)",
                               waited_out=True)
        store.update(lambda d: record_answer(d, answer, clock.now()))
    finally:
        asking.join(20)
    out, err = capsys.readouterr()
    assert result["rc"] == Exit.WAITED_OUT == 4
    assert out.count("waiting: b is starting or being restarted (A3)") == 1, out
    assert "waiting up to 300 s" in out and "after waiting 300 s" in err
    assert store.read()["answers"] == {}  # the command took its answer


def test_restart_without_wait_keeps_exit_1_for_a_refusal(tmp_path, capsys):
    path = config(tmp_path, ("a", "http://127.0.0.1:8001"))
    fake_daemon_status(tmp_path)
    store = StateStore(tmp_path / "state")
    result = {}
    asking = threading.Thread(target=lambda: result.update(rc=main(["--config", path, "restart", "a"])))
    asking.start()
    try:
        rid, q = wait_for(lambda: next(iter(store.read()["requests"].items()), None), 30, "the request")
        assert q.get("wait_until") is None
        store.update(lambda d: record_answer(d, AnswerRequest(rid, "a", False, "refused (masked): x"), clock.now()))
    finally:
        asking.join(20)
    assert result["rc"] == Exit.PROBLEM == 1 and "refused (masked)" in capsys.readouterr().err


def test_ctrl_c_while_waiting_withdraws_the_request(tmp_path, capsys, monkeypatch):
    """A request left open after the operator gave up would be acted on up to --wait later."""
    path = config(tmp_path, ("a", "http://127.0.0.1:8001"))
    fake_daemon_status(tmp_path)
    store = StateStore(tmp_path / "state")
    asked = []

    def interrupted(_s: float) -> None:
        asked.append(dict(store.read()["requests"]))
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_requests.time, "sleep", interrupted)
    assert main(["--config", path, "restart", "a", "--wait", "1h"]) == Exit.INTERRUPTED
    assert len(asked) == 1 and len(asked[0]) == 1, asked  # it was asked, then
    assert store.read()["requests"] == {}
    assert "request withdrawn" in capsys.readouterr().err


def test_wait_0_is_no_wait(tmp_path, capsys, monkeypatch):
    path = config(tmp_path, ("a", "http://127.0.0.1:8001"))
    fake_daemon_status(tmp_path)
    store = StateStore(tmp_path / "state")
    seen = []

    def once(_s: float) -> None:
        seen.append(next(iter(store.read()["requests"].values())))
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_requests.time, "sleep", once)
    main(["--config", path, "restart", "a", "--wait", "0"])
    assert seen and seen[0].get("wait_until") is None


# --- issue 34 row 6: the CLI reads the daemon's status file back bounded and not followed ---------------
@pytest.mark.parametrize("plant", ["fifo", "link to /dev/zero"])
def test_restart_reads_the_status_file_bounded_a_fifo_or_dev_zero_there_means_no_daemon(tmp_path, plant):
    """`guardian restart` asks whether a daemon runs from /run/guardian/status.json: a FIFO planted
    there blocked it for ever, a link to /dev/zero filled its memory (MemoryError)."""
    from guardian.config import load_config

    cfg = load_config(Path(config(tmp_path, ("a", "http://127.0.0.1:9"))))
    cfg.runtime_dir.mkdir(parents=True)
    status = cfg.runtime_dir / "status.json"
    if plant == "fifo":
        os.mkfifo(status)
    else:
        status.symlink_to("/dev/zero")
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(cli_requests._running_daemon(cfg)), daemon=True)
    t.start()
    t.join(30)  # a deadline for a hang only
    if t.is_alive():
        os.open(status, os.O_WRONLY | os.O_NONBLOCK) if plant == "fifo" else None  # let the reader go
        pytest.fail(f"reading the status file ({plant}) blocked")
    assert got == [None]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_command_ended_by_sigterm_or_sighup_withdraws_its_request(tmp_path, signum):
    """Issue 34 row 12: a request left by a command killed with SIGTERM or SIGHUP (a closed terminal,
    systemd-run's stop) never expired. It withdraws it as Ctrl-C does; its request names it (pid and
    start) and says when it stops waiting, for the daemon to withdraw what a SIGKILL leaves (A5)."""
    path = config(tmp_path, ("a", "http://127.0.0.1:8001"))
    fake_daemon_status(tmp_path)
    store = StateStore(tmp_path / "state")
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "guardian", "--config", path, "restart", "a", "--wait", "1h"],
                            cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _rid, q = wait_for(lambda: next(iter(store.read()["requests"].items()), None), 30, "the request")
        assert q["asker"] == {"pid": proc.pid, "start": askers.start_ticks(proc.pid)}
        assert q["expires"]["mono"] > q["wait_until"]["mono"]  # it waits the answer's margin beyond --wait
        proc.send_signal(signum)
        _out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert store.read()["requests"] == {}
    assert "request withdrawn" in err, err


def test_check_reads_each_warmup_file_and_says_when_no_proxy_would_ever_send_it(tmp_path):
    from guardian.config import Config, ProxyConfig

    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text('{"prompt": "shared"}\n{"messages": [{"role": "system", "content": "s"}]}\n')
    bad.write_text('{"prompt": "x"}\n{oops\n')
    reps = [ReplicaConfig(name=n, unit=f"vllm-{n}.service", url=f"http://127.0.0.1:800{i}", model="m",
                              warmup_file=f) for i, (n, f) in enumerate((("a", good), ("b", bad)), 1)]
    proxied = Config(replicas=reps, proxy=ProxyConfig(drain_command=["/bin/true"]))
    report = cli_check.Report(json_out=True)
    cli_check._check_warmup(proxied, report)
    (ok,) = [t for k, t in report.lines if k == ""]
    assert "replica a: 2 requests" in ok and "(1 chat)" in ok
    (problem,) = report.of("problem")
    assert "replica b:" in problem and "line 2: not JSON" in problem
    report = cli_check.Report(json_out=True)
    cli_check._check_warmup(Config(replicas=reps[:1]), report)
    (warning,) = report.of("warning")
    assert "is never sent" in warning and "no [proxy]" in warning


WRITE_DEEP = "import sys; open(sys.argv[1], 'w').write('{\"prompt\": \"x\"}\\n' + '[' * 100000 + ']' * 100000 + '\\n')"


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a process as user nobody: needs root (make test runs as root)")
def test_check_names_a_warmup_file_nested_100000_deep_and_checks_the_rest(tmp_path, capsys):
    """Issue 41 row 5: user nobody writes, in a warm-up file guardian reads, a line nested 100,000
    deep; `guardian check` died with a RecursionError traceback and checked nothing after it."""
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="guardian-warmup-"))
    try:
        base.chmod(0o755)
        os.chown(base, 65534, 65534)
        deep = base / "warmup.jsonl"
        python = NOBODY_PYTHON
        subprocess.run([python, "-c", WRITE_DEEP, str(deep)], check=True, timeout=30, preexec_fn=as_nobody)
        assert deep.stat().st_uid == 65534
        path = Path(config(tmp_path, ("a", f"http://127.0.0.1:{free_port()}"), ("b", f"http://127.0.0.1:{free_port()}")))
        path.write_text(path.read_text().replace('model = "m"\n', f'model = "m"\nwarmup_file = "{deep}"\n', 1))
        rc, lines = check(capsys, str(path), "--no-systemd")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    (bad,) = [x for x in lines if "warm-up: replica a" in x]
    assert bad.startswith("problem: ") and f"{deep} line 2: not JSON: nested too deep" in bad, bad
    assert any("nothing listens on port" in x and "replica b" in x for x in lines), lines  # and it went on
    assert rc == 1
