"""systemd's D-Bus face, as much of it as guardian's tick asks (bench/tick_cost.py): the Manager's
calls and each unit's Unit and Service properties, every unit loaded, active and enabled.

    python bench/fake_systemd.py BUS_ADDRESS '{"vllm-a.service": PID, ...}'

Prints "ready" once it owns org.freedesktop.systemd1 on BUS_ADDRESS (a private dbus-daemon).
Only for measuring guardian's own side of the bus: it starts, stops and restarts nothing.
"""

# No `from __future__ import annotations`: dbus-fast reads the D-Bus signatures from the annotations.
import asyncio
import json
import sys

from dbus_fast.aio import MessageBus
from dbus_fast.service import PropertyAccess, ServiceInterface, dbus_property, method

SD_PATH = "/org/freedesktop/systemd1"
UNITS: dict[str, int] = {}  # unit -> its MainPID
READ = PropertyAccess.READ


def unit_path(name: str) -> str:
    return SD_PATH + "/unit/" + name.replace("-", "_2d").replace(".", "_2e").replace("@", "_40")


def _row(name: str) -> list:
    return [name, "", "loaded", "active", "running", "", unit_path(name), 0, "", "/"]


class Manager(ServiceInterface):
    def __init__(self) -> None:
        super().__init__("org.freedesktop.systemd1.Manager")

    @method()
    def Subscribe(self) -> "":
        return None

    @method()
    def LoadUnit(self, name: "s") -> "o":
        return unit_path(name)

    @method()
    def GetUnit(self, name: "s") -> "o":
        return unit_path(name)

    @method()
    def GetUnitByPID(self, pid: "u") -> "o":
        return unit_path(next((n for n, p in UNITS.items() if p == pid), "other.service"))

    @method()
    def ListUnitsByNames(self, names: "as") -> "a(ssssssouso)":
        return [_row(n) for n in names]

    @method()
    def ListUnitFilesByPatterns(self, states: "as", patterns: "as") -> "a(ss)":
        return [["/usr/lib/systemd/system/" + n, "enabled"] for n in UNITS]

    @method()
    def ListUnitsByPatterns(self, states: "as", patterns: "as") -> "a(ssssssouso)":
        return [_row(n) for n in UNITS]

    @method()
    def GetUnitProcesses(self, name: "s") -> "a(sus)":
        return [["/system.slice/" + name, UNITS.get(name, 1), "vllm"]]


class Unit(ServiceInterface):
    def __init__(self, name: str) -> None:
        super().__init__("org.freedesktop.systemd1.Unit")
        self.unit = name  # not .name: the interface's own

    @dbus_property(access=READ)
    def Id(self) -> "s":
        return self.unit

    @dbus_property(access=READ)
    def LoadState(self) -> "s":
        return "loaded"

    @dbus_property(access=READ)
    def ActiveState(self) -> "s":
        return "active"

    @dbus_property(access=READ)
    def SubState(self) -> "s":
        return "running"

    @dbus_property(access=READ)
    def UnitFileState(self) -> "s":
        return "enabled"

    @dbus_property(access=READ)
    def InactiveExitTimestampMonotonic(self) -> "t":
        return 1_000_000

    @dbus_property(access=READ)
    def InvocationID(self) -> "ay":
        return bytes(range(16))

    @dbus_property(access=READ)
    def Conflicts(self) -> "as":
        return ["shutdown.target"]

    @dbus_property(access=READ)
    def ConflictedBy(self) -> "as":
        return []

    @dbus_property(access=READ)
    def FragmentPath(self) -> "s":
        return "/usr/lib/systemd/system/" + self.unit

    @dbus_property(access=READ)
    def Job(self) -> "(uo)":
        return [0, "/"]


class Service(ServiceInterface):
    def __init__(self, name: str) -> None:
        super().__init__("org.freedesktop.systemd1.Service")
        self.unit = name

    @dbus_property(access=READ)
    def MainPID(self) -> "u":
        return UNITS.get(self.unit, 0)

    @dbus_property(access=READ)
    def Restart(self) -> "s":
        return "always"

    @dbus_property(access=READ)
    def NRestarts(self) -> "u":
        return 0

    @dbus_property(access=READ)
    def MemoryCurrent(self) -> "t":
        return 2**30

    @dbus_property(access=READ)
    def EnvironmentFiles(self) -> "a(sb)":
        return []

    @dbus_property(access=READ)
    def ExecStart(self) -> "a(sasbttttuii)":
        argv = ["/usr/bin/python3", "-m", "vllm_sim", "--model", "m"]
        return [["/usr/bin/python3", argv, False, 0, 0, 0, 0, 0, 0, 0]]

    @dbus_property(access=READ)
    def ExecStartPre(self) -> "a(sasbttttuii)":
        return []

    @dbus_property(access=READ)
    def ExecStop(self) -> "a(sasbttttuii)":
        return []

    @dbus_property(access=READ)
    def ExecStopPost(self) -> "a(sasbttttuii)":
        return []

    @dbus_property(access=READ)
    def Environment(self) -> "as":
        return []

    @dbus_property(access=READ)
    def User(self) -> "s":
        return ""


async def main(address: str) -> None:
    bus = await MessageBus(bus_address=address).connect()
    bus.export(SD_PATH, Manager())
    for name in [*UNITS, "shutdown.target", "other.service"]:
        bus.export(unit_path(name), Unit(name))
        bus.export(unit_path(name), Service(name))
    await bus.request_name("org.freedesktop.systemd1")
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    UNITS.update(json.loads(sys.argv[2]))
    asyncio.run(main(sys.argv[1]))
