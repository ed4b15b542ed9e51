"""Hazards from outside the replica (issue 44 item 3, core/outside.py H1 and H2) on a box built for
them: Debian's logind (RemoveIPC= left at its default, yes) with replica a run as a regular user, and
replica b configured for a KV cache on disk without PYTHONHASHSEED. Each is in `guardian check
--json` and said by the daemon at error; each remedied as the line says (a logind drop-in; a unit
drop-in with Environment=PYTHONHASHSEED=0), it leaves `check` and is said over, at info."""

from __future__ import annotations

import json

import pytest

from systemd_box import wait_for
from world import Replica, World

pytestmark = pytest.mark.system

USER = "h1replica"
LOGIND_DROPIN = "/etc/systemd/logind.conf.d/90-guardian-removeipc.conf"
SEED_DROPIN = "/etc/systemd/system/vllm-b.service.d/seed.conf"
KV = """--kv-transfer-config '{"kv_connector":"SharedStorageConnector","kv_role":"kv_both","kv_connector_extra_config":{"shared_storage_path":"/var/cache/vllm-kv"}}'"""


def hazards(world: World) -> dict[str, str]:
    """`guardian check --json`'s hazard lines of rules H1 and H2, by rule."""
    out = world.box.run(["guardian", "check", "--json"], check=False).stdout
    problems = json.loads(out)["problems"]
    return {rule: p for p in problems for rule in ("H1", "H2") if p.startswith("hazard:") and f"({rule})" in p}


def lines_of(world: World, rule: str) -> list[dict]:
    return world.guardian_lines(f"GUARDIAN_RULE={rule}")


def test_a_regular_users_replica_under_removeipc_and_a_kv_disk_tier_without_a_seed_and_their_remedies(world):
    box = world.box
    box.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", USER])
    try:
        uid = int(box.run(["id", "-u", USER]).stdout.strip())
        assert uid >= 1000  # useradd's default: a regular user
        world.replicas = [Replica("a", 8001, service_extra=f"User={USER}"), Replica("b", 8002, sim_args=KV)]
        world.setup()
        found = hazards(world)
        assert set(found) == {"H1", "H2"}, found
        assert f"runs as {USER} (uid {uid})" in found["H1"] and "RemoveIPC=yes" in found["H1"], found["H1"]
        assert "replica b:" in found["H2"] and "PYTHONHASHSEED is unset" in found["H2"], found["H2"]
        for rule in ("H1", "H2"):  # the daemon said each once, at error
            said = wait_for(lambda rule=rule: lines_of(world, rule), 20, f"the daemon's {rule} line")
            assert [e["PRIORITY"] for e in said] == ["3"], said
            assert said[0]["GUARDIAN_DECISION"] == "hazard"
        # the remedies, as the lines give them
        box.write(LOGIND_DROPIN, "[Login]\nRemoveIPC=no\n")
        box.write(SEED_DROPIN, "[Service]\nEnvironment=PYTHONHASHSEED=0\n")
        box.daemon_reload()
        assert hazards(world) == {}
        for rule in ("H1", "H2"):  # over, said once at info
            over = wait_for(lambda rule=rule: [e for e in lines_of(world, rule) if e["PRIORITY"] == "6"], 20,
                            f"the daemon's {rule} over line")
            assert len(over) == 1 and over[0]["MESSAGE"].startswith("hazard over: replica "), over
    finally:  # the world's own teardown follows: its units go, and guardian stops
        box.run(["rm", "-rf", LOGIND_DROPIN, "/etc/systemd/system/vllm-b.service.d"], check=False)
        box.systemctl("stop", "vllm-a.service", check=False)
        box.run(["userdel", USER], check=False)
