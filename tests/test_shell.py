"""The shell around the core: a tick that raises does not kill the daemon, journal text from a
replica cannot forge a line, and every config failure is exit status 2 (issue 10)."""

from __future__ import annotations

import asyncio
import time

import pytest

from guardian.act.journal import MAX_MESSAGE_CHARS, Journal
from guardian.act.notify import Notifier
from guardian.cli import build_parser, main
from guardian.config import Config, ReplicaConfig
from guardian.core.actions import LogLine
from guardian.core.vocab import Decision, Priority
from guardian.daemon import Daemon


class Recorder(Journal):
    def __init__(self) -> None:
        super().__init__(socket_path="/nonexistent")
        self.lines: list[tuple[LogLine, dict[str, str]]] = []

    def line(self, line: LogLine, extra: dict[str, str] | None = None) -> None:
        self.lines.append((line, extra or {}))


def test_an_unexpected_exception_in_a_tick_is_logged_critical_and_the_tick_abandoned(tmp_path):
    cfg = Config(state_dir=tmp_path / "state", runtime_dir=tmp_path / "run",
                 replicas=[ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:9", model="m")])
    journal = Recorder()

    async def go() -> Daemon:
        d = Daemon(cfg, tmp_path / "guardian.toml", journal=journal)

        async def broken(*a: object, **kw: object) -> None:
            raise OverflowError("cannot convert float infinity to integer")

        d.observer.observe = broken  # type: ignore[method-assign]
        before = d.state
        await d.tick()  # must return, not raise
        assert d.state is before  # abandoned without acting
        await d.client.aclose()
        return d

    d = asyncio.run(go())
    (line, extra) = journal.lines[-1]
    assert line.priority is Priority.CRITICAL and "tick abandoned without acting: OverflowError" in line.message
    assert "Traceback" in extra["GUARDIAN_TRACEBACK"] and "OverflowError" in extra["GUARDIAN_TRACEBACK"]
    assert d.stats.ticks == 1


class Pings(Notifier):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def watchdog(self, status: str) -> None:
        self.count += 1


def test_ticks_that_keep_failing_stop_the_watchdog_pings_so_systemd_restarts_guardian(tmp_path):
    cfg = Config(state_dir=tmp_path / "state", runtime_dir=tmp_path / "run", stuck_restart_s=60,
                 replicas=[ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:9", model="m")])
    journal, pings = Recorder(), Pings()

    async def go() -> None:
        d = Daemon(cfg, tmp_path / "guardian.toml", journal=journal, notifier=pings)

        async def broken(*a: object, **kw: object) -> None:
            raise RuntimeError("boom")

        d.observer.observe = broken  # type: ignore[method-assign]
        await d.tick()
        d.ping_watchdog()
        assert pings.count == 1  # one abandoned tick: still pinging
        d.last_completed_mono = time.monotonic() - 59.5
        await d.tick()
        d.ping_watchdog()
        assert pings.count == 2  # just under stuck_restart_s
        d.last_completed_mono = time.monotonic() - 60.0
        await d.tick()
        d.ping_watchdog()
        d.ping_watchdog()
        assert pings.count == 2  # at it: no more pings, said once
        crit = [line for line, _ in journal.lines if "stops pinging" in line.message]
        assert len(crit) == 1 and crit[0].priority is Priority.CRITICAL
        await d.client.aclose()

    asyncio.run(go())


def test_text_from_a_replica_cannot_forge_a_line_on_stderr(capsys):
    Journal(socket_path="/nonexistent").send(Priority.ERROR, "model m\n<2>forged critical\x1b[31m")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("<3>model m\\n<2>forged critical\\x1b[31m")


def test_a_huge_message_is_cut(capsys):
    Journal(socket_path="/nonexistent").send(Priority.INFO, "m" * 300_000)
    err = capsys.readouterr().err
    assert len(err) < MAX_MESSAGE_CHARS + 20 and err.rstrip().endswith("[...]")


def test_deep_nesting_in_the_config_is_exit_2_not_a_traceback(tmp_path, capsys):
    path = tmp_path / "guardian.toml"
    path.write_text("x = " + "[" * 500 + "]" * 500 + "\n")
    assert main(["--config", str(path), "check", "--no-systemd"]) == 2
    assert "config error in" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "0s", "31d"])
def test_a_pause_of_zero_or_more_than_30_days_is_refused(value):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["pause", "a", "--for", value])
    assert e.value.code == 2


def test_journal_lines_carry_their_decision_explicitly():
    rec = Recorder()
    rec.send(Priority.WARNING, "x", Decision.REQUEST, "a", "vllm-a.service")
    (line, _), = rec.lines
    assert line.decision is Decision.REQUEST and line.priority is Priority.WARNING


def test_shutdown_cancels_the_probes_carried_over_from_the_last_tick(tmp_path):
    cfg = Config(state_dir=tmp_path / "state", runtime_dir=tmp_path / "run")

    async def go() -> None:
        d = Daemon(cfg, tmp_path / "guardian.toml", journal=Recorder(), notifier=Pings())
        hung = asyncio.ensure_future(asyncio.sleep(3600))  # a probe to a frozen replica
        d.observer.carry.tasks["a"] = {"metrics": (hung, 0.0)}
        await d.shutdown()
        await asyncio.sleep(0)
        assert hung.cancelled() and d.observer.carry.tasks == {}

    asyncio.run(go())
