"""The fleet's shell (fleet/sync.py) against a real 3-member etcd cluster on loopback: several
FleetSyncs, each with its own box name, stand in for boxes. Slots are etcd transactions, leases
are etcd's, and members are stopped, killed and started by PID."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import time

import pytest

from etcd_cluster import EtcdCluster
from guardian.config import Config, FleetConfig, ReplicaConfig
from guardian.core.watchdog.track import Track
from guardian.core.observations import FleetView
from guardian.core.vocab import State
from guardian.fleet.sync import FleetSync, fleet_status
from guardian.observe.clock import Now
from harness import NOBODY_PYTHON, Recorder, as_nobody

pytestmark = pytest.mark.system
NAMES = itertools.count()


@pytest.fixture(scope="module")
def etcd():
    try:
        c = EtcdCluster()
        c.start()
    except (RuntimeError, AssertionError) as e:
        pytest.fail(f"cannot start the etcd cluster: {e}", pytrace=False)
    yield c
    c.close()


def box(cluster: EtcdCluster, name: str, fleet: str, model: str = "m", clock_offset_s: float = 0.0,
        **kw) -> FleetSync:
    cfg = Config(replicas=[ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:8001", model=model)],
                 fleet=FleetConfig(endpoints=cluster.endpoints, name=fleet, box=name, lease_ttl_s=kw.pop("ttl", 3),
                                   timeout_s=1.0, **kw))

    def clock() -> Now:
        return Now(time.time() + clock_offset_s, time.monotonic())

    return FleetSync(cfg, Recorder(), clock)


def tracks(state: State = State.HEALTHY) -> dict[str, Track]:
    return {"a": Track(state=state, state_since=time.monotonic())}


async def step(b: FleetSync, state: State = State.HEALTHY) -> FleetView:
    return await b.step(tracks(state), b.clock())


def run(coro):
    return asyncio.run(coro)


async def holder_and_other(cluster: EtcdCluster, holder: str, other: str, ttl: int, **kw) -> tuple[FleetSync, FleetSync]:
    """Two boxes in a new fleet, both published; HOLDER has taken the one slot for its replica a."""
    name = fleet_name()
    h, o = box(cluster, holder, name, ttl=ttl, **kw), box(cluster, other, name, ttl=ttl)
    await step(h)
    await step(o)
    await step(h)
    await h.acquire("a", "m")
    assert "a" in (await step(h)).mine
    return h, o


def fleet_name() -> str:
    return f"t{next(NAMES)}-{int(time.time())}"


def test_boxes_publish_their_replicas_and_only_one_of_eight_gets_the_one_slot_for_a_model(etcd):
    async def go():
        name = fleet_name()
        boxes = [box(etcd, f"box{i}", name) for i in range(8)]
        for b in boxes:
            await step(b)
        views = [await step(b) for b in boxes]
        assert all(v.ok for v in views)
        assert sorted(f"{m.box}/{m.name}" for m in views[-1].members) == sorted(f"box{i}/a" for i in range(8))
        # all eight read the same view, then all ask at once
        await asyncio.gather(*(b.acquire("a", "m") for b in boxes))
        after = [await step(b) for b in boxes]
        holders = {(s.box, s.replica) for s in after[0].slots}
        assert len(holders) == 1
        (who,) = holders
        assert sum(1 for v in after if "a" in v.mine) == 1 and who[0] in {b.box for b in boxes}
        winner = next(b for b in boxes if b.box == who[0])
        await winner.release("a")
        assert (await step(boxes[0])).slots == ()
        for b in boxes:
            await b.close()
    run(go())


def test_max_planned_restarts_slots_for_different_models_and_never_more(etcd):
    async def go():
        name = fleet_name()
        boxes = [box(etcd, f"box{i}", name, model=f"model{i}", max_planned_restarts=2) for i in range(5)]
        for b in boxes:
            await step(b)
        for b in boxes:
            await step(b)
        seen = []
        for _ in range(5):  # rounds, as ticks: every box without a slot asks again
            await asyncio.gather(*(b.acquire("a", f"model{i}") for i, b in enumerate(boxes) if "a" not in b.view.mine))
            for b in boxes:
                seen.append(len((await step(b)).slots))
        v = await step(boxes[0])
        assert max(seen) == 2 and len(v.slots) == 2 and len({s.model for s in v.slots}) == 2
        for b in boxes:
            await b.close()
    run(go())


def test_a_guardian_that_dies_holding_a_slot_frees_it_when_its_lease_expires(etcd):
    async def go():
        dead, other = await holder_and_other(etcd, "dead", "other", 2)
        deadline = time.monotonic() + 60  # stops a hung test only: the lease's ttl is what frees the slot
        # "dead" is SIGKILLed: it renews nothing and revokes nothing; "other" keeps its own lease alive
        while True:
            v = await step(other)
            if not any(s.box == "dead" for s in v.slots):
                break
            if time.monotonic() > deadline:
                pytest.fail("the dead box's slot never expired")
            await asyncio.sleep(0.3)
        assert not any(m.box == "dead" for m in v.members)
        await other.acquire("a", "m")
        assert "a" in (await step(other)).mine
        await other.close()
        assert dead.etcd is not None
        await dead.etcd.aclose()
    run(go())


def test_the_etcd_leader_killed_while_a_slot_is_held_loses_nothing_and_doubles_nothing(etcd):
    async def go():
        holder, other = await holder_and_other(etcd, "holder", "other", 5)
        leader = etcd.leader()
        etcd.stop(leader, signal.SIGKILL)
        etcd.wait_quorum()
        for _ in range(10):  # past the old leader's term: leases and keys survive the election
            v1, v2 = await step(holder), await step(other)
            await asyncio.sleep(0.3)
        assert v1.ok and v2.ok and "a" in v1.mine and [s.box for s in v2.slots] == ["holder"]
        await other.acquire("a", "m")  # the one slot is held: nothing may be doubled
        assert [s.box for s in (await step(other)).slots] == ["holder"]
        etcd.start(leader)
        await holder.close()
        await other.close()
    run(go())


def test_all_members_down_is_said_once_then_everything_resumes(etcd):
    async def go():
        name = fleet_name()
        b = box(etcd, "box1", name, ttl=30)
        assert (await step(b)).ok
        etcd.stop_all()
        views = [await step(b) for _ in range(3)]
        assert not any(v.ok for v in views) and views[0].error
        said = [ln.message for ln, _ in b.journal.lines if "etcd cannot be reached" in ln.message]
        assert len(said) == 1
        etcd.start()
        deadline = time.monotonic() + 30
        while not (await step(b)).ok:
            assert time.monotonic() < deadline, "no fleet view 30 s after etcd came back"
            await asyncio.sleep(0.3)
        assert any("etcd answers again" in ln.message for ln, _ in b.journal.lines)
        v = await step(b)
        assert [m.box for m in v.members] == ["box1"]
        await b.close()
    run(go())


def test_a_box_whose_clock_is_an_hour_off_decides_the_same(etcd):
    """Leases are etcd's time: a box an hour ahead holds and loses its slot exactly as the others."""
    async def go():
        ahead, other = await holder_and_other(etcd, "ahead", "other", 2, clock_offset_s=3600)
        for _ in range(6):  # 3 s, longer than its ttl: its keepalives keep the slot
            v = await step(ahead)
            await step(other)
            await asyncio.sleep(0.5)
        assert "a" in v.mine
        await ahead.close()  # a graceful stop revokes its lease: gone at once
        assert (await step(other)).slots == ()
        await other.close()
    run(go())


def test_a_member_writing_garbage_under_replicas_stops_no_other_box(etcd):
    """Issue 21: one member wrote 100 KB of "[" under replicas/; parse_view raised RecursionError on
    every box, every tick was abandoned, and systemd restarted every guardian in a loop."""
    async def go():
        name = fleet_name()
        good, evil = box(etcd, "good", name), box(etcd, "evil", name)
        await step(good)
        await step(evil)
        assert evil.etcd is not None and evil.lease is not None
        prefix = f"/guardian/{name}/"
        await evil.etcd.put(prefix + "replicas/evil/x", "[" * 100_000, evil.lease)
        await evil.etcd.put(prefix + "replicas/evil/y", "[" * 5_000, evil.lease)  # small, too deep to parse
        await evil.etcd.put(prefix + "replicas/evil/z", "[1, 2, 3]", evil.lease)
        for _ in range(2):
            v = await step(good)
            assert v.ok and sorted(f"{m.box}/{m.name}" for m in v.members) == ["evil/a", "good/a"], v
        ignored = [ln.message for ln, _ in good.journal.lines if "ignored" in ln.message]
        assert len(ignored) == 3 and "replicas/evil/x' ignored: a value of 100000 characters" in ignored[0]
        await good.acquire("a", "m")  # and the fleet still coordinates
        assert "a" in (await step(good)).mine
        await good.close()
        await evil.close()
        assert (await fleet_status(good.cfg))["boxes"] == {}  # evil's garbage went with its lease
    run(go())


def test_status_fleet_shows_boxes_replicas_and_who_holds_the_slots(etcd, tmp_path):
    import subprocess
    import sys

    async def go() -> None:
        name = fleet_name()
        b1, b2 = box(etcd, "box1", name, ttl=30), box(etcd, "box2", name, ttl=30)
        await step(b1)
        await step(b2, State.STALLED)
        await step(b1)
        await b1.acquire("a", "m")
        await step(b1)
        conf = tmp_path / "guardian.toml"
        conf.write_text(f'[fleet]\nendpoints = {etcd.endpoints!r}\nname = "{name}"\n'.replace("'", '"'))
        out = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "guardian", "--config", str(conf), "status", "--fleet"],
            capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert "2 box(es); planned restarts 1 of 1 slot(s) held" in out.stdout
        assert "slot 0: held by box1/a (m)" in out.stdout
        assert "box2/a" in out.stdout and "stalled" in out.stdout
        await b1.close()
        await b2.close()
    run(go())


def test_check_reads_the_fleet_and_counts_an_unreachable_etcd_as_a_problem(etcd, tmp_path):
    import subprocess
    import sys

    def check(endpoints: list[str]) -> subprocess.CompletedProcess:
        conf = tmp_path / "guardian.toml"
        conf.write_text(f'[fleet]\nendpoints = {endpoints!r}\nname = "{fleet_name()}"\nbox = "b1"\n'.replace("'", '"'))
        return subprocess.run([sys.executable, "-m", "guardian", "--config", str(conf), "check", "--no-systemd"],
                              capture_output=True, text=True, timeout=60)

    ok = check(etcd.endpoints)
    assert "fleet: " in ok.stdout and "0 box(es), 0 of 1 slot(s) held; this box is b1" in ok.stdout, ok.stdout
    assert "at most 1 planned restart(s) in the fleet at once" in ok.stdout
    down = check(["http://127.0.0.1:9"])
    assert down.returncode == 1 and "problem: fleet: etcd cannot be read" in down.stdout, down.stdout


def test_check_says_w3_from_the_fleet_as_the_daemon_does(etcd):
    """Issue 44 item 4(a): on a real 3-member cluster the daemon said W3 while `guardian check` exited
    0 without it. Box2 publishes its replica of model m with other weights; box1's check says W3."""
    from guardian.cli import check as cli_check
    from guardian.cli.common import Exit
    from guardian.core.weights import Weights

    async def go() -> None:
        name = fleet_name()
        b1, b2 = box(etcd, "box1", name, ttl=30), box(etcd, "box2", name, ttl=30)
        b2.weights = {"a": Weights("dir2:bbbbbbbbbbbb", "box2's")}
        await step(b2)
        report = cli_check.Report(json_out=True)
        await cli_check._check_fleet(b1.cfg, {"a": Weights("dir2:aaaaaaaaaaaa", "here")}, report)
        (hazard,) = report.of("hazard")
        assert "(W3)" in hazard and "box2/a: dir2:bbbbbbbbbbbb" in hazard, report.lines
        assert report.exit_code() is Exit.PROBLEM
        same = cli_check.Report(json_out=True)
        await cli_check._check_fleet(b1.cfg, {"a": Weights("dir2:bbbbbbbbbbbb", "here")}, same)
        assert same.of("hazard") == [] and same.exit_code() is Exit.OK, same.lines
        await b2.close()
        await b1.close()
    run(go())


# --- issue 41 row 6: a slot key that is not a guardian's -----------------------------------------
PUT_AS_NOBODY = """
import base64, json, sys, urllib.request
endpoint, key, value = sys.argv[1:]
b = lambda s: base64.b64encode(s.encode()).decode()
body = json.dumps({"key": b(key), "value": b(value)}).encode()
req = urllib.request.Request(endpoint + "/v3/kv/put", body, {"Content-Type": "application/json"})
print(urllib.request.urlopen(req, timeout=10).status)
"""


def put_as_nobody(cluster: EtcdCluster, key: str, value: str) -> None:
    """A client of the cluster that is no guardian: a process of user nobody, with no lease."""
    import os
    import subprocess

    python = NOBODY_PYTHON
    drop = as_nobody if os.geteuid() == 0 else None
    out = subprocess.run([python, "-c", PUT_AS_NOBODY, cluster.endpoints[0], key, value], capture_output=True,
                         text=True, timeout=30, preexec_fn=drop)
    assert out.stdout.strip() == "200", out.stderr


async def status_fleet(cfg: Config, tmp_path) -> str:
    import subprocess
    import sys

    conf = tmp_path / "guardian.toml"
    conf.write_text(f'[fleet]\nendpoints = {cfg.fleet.endpoints!r}\nname = "{cfg.fleet.name}"\n'.replace("'", '"'))
    out = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "guardian", "--config", str(conf), "status", "--fleet"],
        capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_garbage_at_the_one_slot_key_holds_no_slot_and_a_planned_restart_takes_it(etcd, tmp_path):
    """Issue 41 row 6: `{garbage` at slots/0 (max_planned_restarts = 1) was skipped by the view ("0 of 1
    held") but counted as taken by the slot request: every planned restart in the fleet waited and was
    refused (A4), and no line named the key. One parse now decides for both: the key holds no slot, and
    the slot request takes that index over, in a transaction that compares the key's revision as read."""
    async def go():
        name = fleet_name()
        good, other = box(etcd, "good", name, ttl=30), box(etcd, "other", name, ttl=30)
        key = f"/guardian/{name}/slots/0"
        put_as_nobody(etcd, key, "{garbage")
        await step(good)
        await step(other)
        v = await step(good)
        assert v.ok and v.slots == ()
        before = await status_fleet(good.cfg, tmp_path)
        assert "planned restarts 0 of 1 slot(s) held" in before and f"ignored {key!r}" in before, before
        await good.acquire("a", "m")
        assert "a" in (await step(good)).mine, "the garbage key was counted as a taken slot"
        (said,) = [ln.message for ln, _ in good.journal.lines if "taken over" in ln.message]
        assert key in said and "not JSON" in said and "replica a" in said, said
        assert "slot 0: held by good/a (m)" in await status_fleet(good.cfg, tmp_path)
        await other.acquire("a", "m")  # and the one slot is still one: the other box waits
        assert (await step(other)).mine == frozenset() and len(other.view.slots) == 1
        await good.release("a")
        assert (await step(other)).slots == () and key not in other.kvs  # the garbage went with the slot
        await good.close()
        await other.close()
    run(go())


def test_a_well_formed_slot_bound_to_no_guardians_lease_is_named_in_the_wait_and_in_status(etcd, tmp_path):
    """Issue 41 row 6: a slot that reads as a guardian's but is held by no guardian's lease (put by a
    client with no lease: it never expires) is counted, so planned restarts wait, and the wait line and
    `guardian status --fleet` name its key and why it is not a guardian's."""
    from guardian.core import fleet as core_fleet

    async def go():
        name = fleet_name()
        good = box(etcd, "good", name, ttl=30)
        key = f"/guardian/{name}/slots/0"
        put_as_nobody(etcd, key, json.dumps({"box": "ghost", "replica": "x", "model": "m", "since": 1.0}))
        await step(good)
        v = await step(good)
        assert v.ok and [(s.box, s.replica) for s in v.slots] == [("ghost", "x")]
        why = core_fleet.slot_refusal("a", "m", v, good.cfg)
        assert why is not None and key in why.reason and "no lease" in why.reason, why
        out = await status_fleet(good.cfg, tmp_path)
        assert "slot 0: held by ghost/x (m)" in out and "no lease" in out and "not a guardian's" in out, out
        await good.close()
    run(go())
