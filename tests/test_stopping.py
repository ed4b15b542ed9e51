"""A planned stop that lets vLLM finish what it holds (core/stopping.py, T1-T3): the bound, the
restart's line, and `guardian check`'s warnings, as pure functions and as the tick applies them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from guardian.core import stopping
from guardian.core.observations import RestartRequest, UnitDeclared
from harness import DRAIN_S, Box, cfg, obs, restarts, sample, with_proxy

SERVE = ("/usr/bin/vllm", "serve", "/models/qwen", "--port", "8001")


def declared(*extra: str, timeout_stop_s: float | None = 90.0, env=None, argv=SERVE) -> UnitDeclared:
    return UnitDeclared("vllm-a.service", (*argv, *extra), env or {}, timeout_stop_s=timeout_stop_s)


@pytest.mark.parametrize(
    ("extra", "n"),
    [
        ((), None),  # not passed: vLLM's default 0 aborts
        (("--shutdown-timeout", "60"), 60.0),
        (("--shutdown-timeout=45.5",), 45.5),
        (("--shutdown-timeout", "10", "--shutdown-timeout", "60"), 60.0),  # the last one, as argparse takes it
        (("--shutdown-timeout", "0"), None),
        (("--shutdown-timeout", ""), None),  # ${VAR} of an unset VAR: guardian cannot tell
        (("--shutdown-timeout", "inf"), None),
        (("--shutdown-timeout", "-5"), None),
        (("--shutdown-timeout",), None),  # no value
    ],
)
def test_the_shutdown_timeout_a_unit_passes(extra, n):
    assert stopping.shutdown_s(declared(*extra)) == n


def test_a_container_units_shutdown_timeout_is_the_containers_command():
    argv = ("/usr/bin/docker", "run", "--rm", "--name", "vllm-a", "-e", "X=1", "vllm/vllm-openai:v0.32.0",
            "/models/qwen", "--shutdown-timeout", "60")
    assert stopping.shutdown_s(declared(argv=argv)) == 60.0
    # the flag given to docker itself is not vLLM's
    argv = ("/usr/bin/docker", "run", "--stop-timeout", "60", "--name", "vllm-a", "vllm/vllm-openai:v0.32.0")
    assert stopping.shutdown_s(declared(argv=argv)) is None


def test_an_unread_unit_has_no_shutdown_timeout():
    assert stopping.shutdown_s(None) is None
    assert stopping.shutdown_s(UnitDeclared("vllm-a.service", unseen="systemd could not be asked")) is None


@pytest.mark.parametrize(
    ("extra", "bound_s"),
    [
        ((), 30.0),  # P.stop_timeout_s as before
        (("--shutdown-timeout", "60"), 75.0),  # N + the margin
        (("--shutdown-timeout", "5"), 30.0),  # within P.stop_timeout_s already
        (("--shutdown-timeout", "15"), 30.0),  # 15 + 15 == 30: the same
        (("--shutdown-timeout", "16"), 31.0),
    ],
)
def test_the_stop_bound_covers_the_shutdown_timeout_and_a_margin_t1(extra, bound_s):
    config = with_proxy(cfg(2))
    assert stopping.planned_stop(config, declared(*extra)).bound_s == bound_s


def test_the_restart_job_is_waited_for_as_much_longer_as_the_bound_t1():
    config = with_proxy(cfg(2, restart_job_timeout_s=300))
    assert stopping.job_wait_s(config, None) == 300
    assert stopping.job_wait_s(config, 30) == 300
    assert stopping.job_wait_s(config, 75) == 345


def test_the_restart_line_says_what_was_running_at_the_stop():
    config = with_proxy(cfg(2))
    with_n = stopping.planned_stop(config, declared("--shutdown-timeout", "60"))
    without = stopping.planned_stop(config, declared())
    busy = sample(running=2, waiting=1)
    assert with_n.bound_text == ", its processes killed if the stop takes over 75 s (vLLM's --shutdown-timeout 60 s + 15 s: T1)"
    assert without.bound_text == ", its processes killed if the stop takes over 30 s"
    assert with_n.held_text(busy) == "; 2 running and 1 waiting at its last /metrics, which vLLM lets finish for up to 60 s"
    assert without.held_text(busy) == ("; 2 running and 1 waiting at its last /metrics, which its stop may cut "
                                       "(no --shutdown-timeout on its command line)")
    assert without.held_text(sample()) == "; no request running or waiting at its last /metrics"
    assert "unknown (/metrics unreadable)" in with_n.held_text(None)


def with_declared(box_obs, d: UnitDeclared):
    return replace(box_obs, declared=d)


def test_an_undrained_planned_restart_is_bounded_by_the_shutdown_timeout_and_says_so_t1():
    box = Box(with_proxy(cfg(1)))
    d = declared("--shutdown-timeout", "60")
    box.tick(98, a=with_declared(obs("a", 98), d))
    box.persistent = replace(box.persistent, requests=(RestartRequest("q1", "a", 100.0),))
    acts = box.tick(100, a=with_declared(obs("a", 100, s=sample(gen=5, running=2)), d))
    (r,) = restarts(acts)
    assert r.stop_timeout_s == 75 and not r.kill_first
    assert r.said is not None and r.said.rule == stopping.BOUND.id
    assert "2 running and 0 waiting at its last /metrics, which vLLM lets finish for up to 60 s" in r.said.message


def test_a_drained_restart_after_its_drain_timed_out_keeps_the_bound_t1():
    from guardian.core.observations import ProxyView

    box = Box(with_proxy(cfg(2)))
    d = declared("--shutdown-timeout", "100")

    def busy(t: float):  # 3 long requests, their tokens flowing
        return with_declared(obs("a", t, s=sample(gen=t, running=3)), d)

    box.tick(98, a=with_declared(obs("a", 98), d))
    box.persistent = replace(box.persistent, requests=(RestartRequest("q1", "a", 100.0),))
    box.tick(100, a=busy(100))
    acts = []
    for t in range(101, int(101 + DRAIN_S) + 1, 5):
        acts = box.tick(t, a=busy(t), proxy=ProxyView(frozenset({"a"})))
    (r,) = restarts(acts)
    assert r.stop_timeout_s == 115
    assert "(D7)" in r.said.message and "vLLM lets finish for up to 100 s" in r.said.message


def test_a_hung_replica_is_killed_at_once_whatever_its_shutdown_timeout():
    box = Box(cfg(1))
    d = declared("--shutdown-timeout", "600")
    acts = []
    for t in range(0, 400, 2):  # 3 requests running and nothing moving: stalled
        acts = box.tick(t, a=with_declared(obs("a", t, s=sample(gen=1, running=3)), d))
        if restarts(acts):
            break
    (r,) = restarts(acts)
    assert r.kill_first and r.stop_timeout_s is None


# --- `guardian check`: T2, T3 -------------------------------------------------------------------------


def test_a_timeout_stop_sec_shorter_than_the_shutdown_timeout_and_margin_is_warned_t2():
    config = cfg(1)
    short = declared("--shutdown-timeout", "60", timeout_stop_s=60)
    (text,) = stopping.warnings(config, {"a": short})
    assert "(T2)" in text and "TimeoutStopSec=60s" in text and "TimeoutStopSec=75s or more" in text
    assert stopping.warnings(config, {"a": replace(short, timeout_stop_s=75)}) == []
    assert stopping.warnings(config, {"a": replace(short, timeout_stop_s=None)}) == []  # infinity


def test_under_a_proxy_a_replica_without_a_shutdown_timeout_is_warned_t3():
    proxied = with_proxy(cfg(1))
    (text,) = stopping.warnings(proxied, {"a": declared()})
    assert "(T3)" in text and "aborts every request still running" in text
    (zero,) = stopping.warnings(proxied, {"a": declared("--shutdown-timeout", "0")})
    assert "no --shutdown-timeout but 0" in zero
    assert stopping.warnings(proxied, {"a": declared("--shutdown-timeout", "60", timeout_stop_s=120)}) == []
    assert stopping.warnings(cfg(1), {"a": declared()}) == []  # no [proxy]: no drain to time out
    # an unread unit, or one guardian cannot tell, is not warned about
    assert stopping.warnings(proxied, {"a": UnitDeclared("vllm-a.service", unseen="no bus")}) == []
    assert stopping.warnings(proxied, {"a": declared("--shutdown-timeout", "${N}")}) == []


def test_what_a_unit_declares_is_read_as_systemd_runs_it(tmp_path):
    """observe/declared.py: ExecStart='s ${VAR}s expanded from Environment= and the env files (a later
    file wins), TimeoutStopUSec in s (UINT64_MAX: infinity), User= resolved to its uid."""
    from guardian.observe.declared import declared_from, uid_of
    from guardian.observe.systemd import ServiceDetails

    env_file = tmp_path / "a.env"
    env_file.write_text("SHUTDOWN_S=60\n")
    details = ServiceDetails((str(env_file), str(tmp_path / "gone.env")),
                             ("/usr/bin/vllm", "serve", "m", "--shutdown-timeout", "${SHUTDOWN_S}"),
                             ("SHUTDOWN_S=5", "PYTHONHASHSEED=0"), "root", 60_000_000)
    d = declared_from("vllm-a.service", details)
    assert d.argv[-1] == "60" and d.env["PYTHONHASHSEED"] == "0"
    assert d.timeout_stop_s == 60.0 and d.uid == 0 and d.env_unreadable == ()
    assert stopping.shutdown_s(d) == 60.0
    assert declared_from("u", replace(details, timeout_stop_us=None)).timeout_stop_s is None
    assert uid_of("") == 0 and uid_of("1234") == 1234 and uid_of("no-such-user-here") is None
