"""The shell around the core: a tick that raises does not kill the daemon, journal text from a
replica cannot forge a line, and every config failure is exit status 2 (issue 10)."""

from __future__ import annotations

import asyncio
import time

import pytest
from harness import Recorder, returns_within

from guardian.act.journal import MAX_MESSAGE_CHARS, Journal
from guardian.act.notify import Notifier
from guardian.cli import build_parser, main
from guardian.config import Config, ReplicaConfig
from guardian.core.vocab import Decision, Priority
from guardian.daemon import Daemon


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


# --- issue 21: files read back are bounded and not followed ------------------------------------

def test_a_fifo_at_status_json_is_one_line_and_exit_1_not_a_hang(tmp_path, capsys):
    """A FIFO planted in the runtime directory would hang a root `guardian status` for ever."""
    import os

    path = tmp_path / "guardian.toml"
    path.write_text(f'runtime_dir = "{tmp_path / "run"}"\nstate_dir = "{tmp_path / "state"}"\n')
    (tmp_path / "run").mkdir()
    fifo = tmp_path / "run" / "status.json"
    os.mkfifo(fifo)
    assert returns_within(5.0, main, ["--config", str(path), "status"], unblock=[fifo]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot read {fifo}" in err and "FIFO" in err, err
    (tmp_path / "run" / "status.json").unlink()
    os.symlink("/dev/zero", fifo)
    assert returns_within(5.0, main, ["--config", str(path), "status"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "symbolic link" in err, err


def test_a_fifo_at_the_polkit_rule_is_replaced_by_the_rule_not_read(tmp_path, capsys):
    import os
    import stat

    path, out = tmp_path / "guardian.toml", tmp_path / "rules.d" / "50-guardian.rules"
    path.write_text('[[replicas]]\nname = "a"\nunit = "llm-a.service"\nurl = "http://127.0.0.1:8001"\nmodel = "m"\n')
    out.parent.mkdir()
    os.mkfifo(out)
    assert returns_within(5.0, main, ["--config", str(path), "polkit-rule", "--output", str(out)], unblock=[out]) == 0
    assert stat.S_ISREG(os.stat(out, follow_symlinks=False).st_mode) and "llm-a.service" in out.read_text()
    assert "not a regular file (a FIFO)" in capsys.readouterr().err
    assert [p.name for p in out.parent.iterdir()] == ["50-guardian.rules"]


def test_status_shows_each_replicas_connections_flowing_and_waiting_clients():
    """issue 20: `guardian status` shows what the kernel sees of each replica's port."""
    from guardian.cli.status import _connections_line
    from guardian.core.observations import ConnView, Peer, PeerKind, Probe, ReplicaObservation, TickObservation
    from guardian.core.tick import TickState
    from guardian.observe.clock import Now
    from guardian.status import LoopStats, Snapshot, status_dict

    cfg = Config(replicas=[ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:8001", model="m")])
    view = ConnView(connections=9, flowing=5, bytes_out=20480, waiting=2, waits_s=(4.2, 1.0), since_s=2.0, cpu_s=0.35,
                    peers=(Peer(PeerKind.PROXY, "nginx.service", 7), Peer(PeerKind.OTHER, "batch.service", 2)))
    ok = Probe(True, 200, 0.01)
    o = ReplicaObservation(name="a", at=0.0, unit=None, health=ok, metrics_probe=ok, metrics=None, models_probe=ok,
                           models=None, conns=view)
    now = Now(mono=10.0, wall=1000.0)
    from guardian.core.observations import PersistentView

    data = status_dict(cfg, "/etc/guardian/guardian.toml",
                       Snapshot(TickState(), PersistentView(), TickObservation({"a": o}, PersistentView()), None, {}),
                       LoopStats(), True, now)
    c = data["replicas"]["a"]["connections"]
    assert (c["established"], c["flowing"], c["bytes_out"], c["waiting"]) == (9, 5, 20480, 2)
    line = _connections_line(c)
    assert line.startswith("connections 9: 5 flowing (20480 bytes in 2.0 s), 2 waiting (longest 4 s)")
    assert "unit CPU 350 ms" in line and "proxy nginx.service x7, other batch.service x2" in line
    none = status_dict(cfg, "x", Snapshot(TickState(), PersistentView(), None, None, {}), LoopStats(), True, now)
    assert none["replicas"]["a"]["connections"] is None and none["bypassing"] == []
    from guardian.core.proxy.bypass import Bypass

    bypassing = TickState(bypassing=(Bypass("a", "batch.service", 2, 5.0),))
    data = status_dict(cfg, "x", Snapshot(bypassing, PersistentView(), None, None, {}), LoopStats(), True, now)
    assert len(data["bypassing"]) == 1 and "batch.service talks to it directly" in data["bypassing"][0]


def test_status_shows_each_replicas_processes_and_how_long_each_group_has_been_quiet():
    """issue 43: `guardian status` shows what the replica's API server and engine did at the last look."""
    from guardian.cli.status import _processes_line
    from guardian.core.watchdog.track import Track
    from guardian.core.observations import (
        Activity,
        PersistentView,
        Probe,
        ProcView,
        ReplicaObservation,
        TickObservation,
    )
    from guardian.core.tick import TickState
    from guardian.observe.clock import Now
    from guardian.status import LoopStats, Snapshot, status_dict

    cfg = Config(replicas=[ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:8001", model="m")])
    ok = Probe(True, 200, 0.01)
    view = ProcView(50.0, 2.0, Activity(0.04, True, 1), Activity(0.0, False, 2), engine_named=True)
    o = ReplicaObservation(name="a", at=50.0, unit=None, health=ok, metrics_probe=ok, metrics=None, models_probe=ok,
                           models=None, procs=view)
    state = TickState(tracks={"a": Track(engine_quiet_since=44.0)})
    snap = Snapshot(state, PersistentView(), TickObservation({"a": o}, PersistentView()), None, {})
    data = status_dict(cfg, "x", snap, LoopStats(), True, Now(mono=51.0, wall=1000.0))
    p = data["replicas"]["a"]["processes"]
    assert p["engine"] == {"processes": 2, "used_s": 0.0, "running": False, "quiet_s": 6.0}
    assert p["api"]["quiet_s"] is None and p["api"]["running"]
    assert _processes_line(p) == "processes in 2.0 s: API server x1 40 ms, running; engine x2 0 ms, quiet 6 s"
    whole = dict(p, engine_named=False, engine=None)
    assert _processes_line(whole) == "processes in 2.0 s: processes x1 40 ms, running; engine not told apart"


def test_a_kept_u8_finding_is_judged_each_tick_and_leaves_status_once_it_is_back(tmp_path, monkeypatch):
    """Issue 44 item 4(b): the daemon's ticks judge a kept U8 finding from this tick's memory (faked
    here, with a fake clock) and it stays in the status file until it is back, said over once."""
    import json

    from guardian.observe import startlook
    from guardian.core.fit import startfit
    from guardian.core.observations import PersistentView, TickObservation
    from guardian.observe.clock import Now

    GiB = 2**30
    cfg = Config(state_dir=tmp_path / "state", runtime_dir=tmp_path / "run",
                 replicas=[ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:9", model="m")])
    journal = Recorder()
    free = iter([10, 10, 12, 12, 12, 12])  # GiB of MemFree at each tick: 2 GiB of the 1.5 missing back from the third

    def looked(pid: int, now_mono: float) -> startfit.LeftoverLook:
        return startfit.LeftoverLook(next(free) * GiB, 0, 0, now_mono)

    monkeypatch.setattr(startlook, "look_kept", looked)

    async def go() -> list[bool]:
        d = Daemon(cfg, tmp_path / "guardian.toml", journal=journal)
        d.executor.tools.leftovers["a"] = startfit.Leftover(int(1.5 * GiB), 4 * GiB, found_wall=1000.0)
        obs = TickObservation({}, PersistentView())
        shown = []
        for t in (0, 2, 4, 8, 12, 14):
            at = Now(2000.0 + t, 100.0 + t)
            await d._leftovers(obs, at)
            d.write_status(at)
            shown.append("a" in json.loads((cfg.runtime_dir / "status.json").read_text())["not_returned"])
        await d.client.aclose()
        return shown

    assert asyncio.run(go()) == [True, True, True, True, True, False]  # back at 4 s, for 10 s at 14 s
    over = [line for line, _ in journal.lines if "hazard over: replica a" in line.message]
    assert len(over) == 1 and over[0].priority is Priority.INFO and over[0].rule == "U10"

def test_a_dbus_call_that_never_answers_is_a_systemd_error_at_its_timeout_and_frees_its_slot():
    from guardian.observe.systemd import MANAGER, MAX_CALLS_IN_FLIGHT, Systemd, SystemdError

    class Hung:
        def __init__(self) -> None:
            self.cancelled = 0

        async def call(self, msg: object) -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise

    async def go() -> int:
        sd = Systemd(call_timeout_s=0.05)
        sd.bus = Hung()  # type: ignore[assignment]
        for _ in range(MAX_CALLS_IN_FLIGHT + 1):  # each slot given back: none waits for another
            with pytest.raises(SystemdError, match="D-Bus GetUnit timed out after 0 s"):
                await asyncio.wait_for(sd.call(MANAGER, "GetUnit", "s", ["x.service"]), 5)
        return sd.bus.cancelled  # type: ignore[union-attr]

    assert asyncio.run(go()) == MAX_CALLS_IN_FLIGHT + 1
