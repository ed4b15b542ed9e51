"""guardian on a real systemd, in two minutes.

Boots a Debian 12 container with systemd-nspawn, starts two simulated vLLM replicas, a
stand-in database and a stand-in proxy, then guardian; shows `guardian status`; freezes
replica a's process (what a hung engine looks like: the port still accepts connections);
and prints the journal lines where guardian notices and restarts exactly that replica's
unit, leaving everything else alone.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from systemd_box import BoxError, SystemdBox, ensure_deps, ensure_rootfs, wait_for  # noqa: E402
from world import World  # noqa: E402


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def show(box: SystemdBox, cmd: str) -> None:
    print(f"$ {cmd}")
    r = box.run(cmd, check=False)
    print((r.stdout + r.stderr).rstrip())


def main() -> int:
    say("preparing the container (the first run builds a Debian 12 rootfs: about a minute)")
    try:
        box = SystemdBox(ensure_rootfs(), ensure_deps(), name="guardian-demo")
        box.boot()
    except BoxError as e:
        print(f"demo: cannot boot the container: {e}", file=sys.stderr)
        return 1
    world = World(box, top={"interval_s": 1.0})
    try:
        say("two simulated vLLM replicas, a database and a proxy, as real systemd units; then guardian")
        world.setup()
        show(box, "systemctl --no-pager list-units 'vllm-*' db.service proxy.service guardian.service")
        say("what guardian sees")
        show(box, "guardian status")
        a = world.replicas[0]
        before = world.identities(world.bystander_units("a"))
        old = box.identity(a.unit)
        say(f"freezing replica a (kill -STOP the MainPID of {a.unit}): its port still accepts connections")
        world.kill(a.unit, "STOP")
        t0 = time.monotonic()
        wait_for(lambda: box.identity(a.unit) != old and box.prop(a.unit, "ActiveState") == "active", 60,
                 "guardian to restart vllm-a.service")
        world.wait_states({"a": "healthy", "b": "healthy"}, timeout_s=30)
        print(f"restarted and serving again {time.monotonic() - t0:.1f} s after the freeze")
        say("guardian's journal lines (journalctl -t guardian GUARDIAN_REPLICA=a)")
        show(box, f"journalctl --no-pager -o short-precise -t guardian GUARDIAN_REPLICA=a --since @{int(world.since)}")
        say("the other replica, the database and the proxy were not touched (MainPID, InvocationID)")
        after = world.identities(list(before))
        for unit in before:
            mark = "unchanged" if before[unit] == after[unit] else "CHANGED"
            print(f"  {unit:<18} pid {after[unit][0]:<6} {mark}")
        say("guardian status now")
        show(box, "guardian status")
        return 0 if after == before else 1
    finally:
        world.teardown()
        box.halt()


if __name__ == "__main__":
    sys.exit(main())
