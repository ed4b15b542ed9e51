"""Hazards from outside the replica (core/outside.py, H1 and H2): logind's RemoveIPC= against a
replica run as a regular user, and a KV cache on disk without a fixed PYTHONHASHSEED; as pure rows,
as logind's files are read, and as the daemon says them (once at error, once at info when over)."""

from __future__ import annotations

import json
import os

import pytest

from guardian.act.notices import Notices
from guardian.config import Config, ReplicaConfig
from guardian.core import outside
from guardian.core.observations import LogindConf, UnitDeclared
from guardian.core.vocab import Priority
from guardian.observe.declared import logind_signature, read_logind
from guardian.observe.replicas import UnitScan
from harness import Recorder, cfg

SERVE = ("/usr/bin/vllm", "serve", "/models/qwen", "--port", "8001")
DEFAULT = LogindConf()  # no file sets RemoveIPC=: systemd's default, yes
OFF = LogindConf((("/etc/systemd/logind.conf.d/90.conf", "[Login]\nRemoveIPC=no\n"),))


def declared(*extra: str, user: str = "", uid: int | None = 0, env=None, argv=SERVE, **kw) -> UnitDeclared:
    return UnitDeclared("vllm-a.service", (*argv, *extra), env or {}, user, uid, **kw)


def found(d: UnitDeclared, logind: LogindConf | None = DEFAULT, config: Config | None = None) -> list[str]:
    """The rule ids of the hazards found for replica a."""
    return [h.rule for h in outside.outside_hazards(config or cfg(1), {"a": d}, logind)]


# --- logind's RemoveIPC= ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("files", "on"),
    [
        ((), True),  # systemd's default
        ((("/etc/systemd/logind.conf", "[Login]\n#RemoveIPC=yes\n"),), True),  # Debian's file: all commented
        ((("/etc/systemd/logind.conf", "[Login]\nRemoveIPC=no\n"),), False),
        ((("/etc/systemd/logind.conf", "[Login]\nRemoveIPC=no\n"), ("/etc/systemd/logind.conf.d/a.conf",
                                                                    "[Login]\nRemoveIPC=yes\n")), True),  # last wins
        ((("/etc/systemd/logind.conf", "[Login]\nRemoveIPC=no\n"), ("/etc/systemd/logind.conf.d/a.conf",
                                                                    "[Login]\nRemoveIPC=\n")), True),  # empty: default
        ((("/etc/systemd/logind.conf", "[Login]\nRemoveIPC=off\nRemoveIPC=maybe\n"),), False),  # not a boolean: ignored
        ((("/etc/systemd/logind.conf", "[Other]\nRemoveIPC=no\n"),), True),  # not its section
        ((("/etc/systemd/logind.conf", "[Login]\n RemoveIPC = No \n"),), False),
    ],
)
def test_removeipc_as_logind_applies_its_files(files, on):
    assert outside.remove_ipc(LogindConf(files))[0] is on


def test_loginds_files_are_read_in_its_order_and_a_dropin_hides_the_lower_one_of_its_name(tmp_path):
    def write(rel: str, text: str) -> None:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    assert read_logind(tmp_path).files == ()  # none: the default
    write("usr/lib/systemd/logind.conf", "[Login]\n")
    write("usr/lib/systemd/logind.conf.d/50-vendor.conf", "[Login]\nRemoveIPC=no\n")
    write("usr/lib/systemd/logind.conf.d/70-vendor.conf", "[Login]\nRemoveIPC=no\n")
    write("etc/systemd/logind.conf.d/70-vendor.conf", "[Login]\nRemoveIPC=yes\n")  # hides the vendor's 70
    write("run/systemd/logind.conf.d/60-run.conf", "[Login]\nRemoveIPC=no\n")
    conf = read_logind(tmp_path)
    assert [os.path.relpath(p, tmp_path) for p, _ in conf.files] == [
        "usr/lib/systemd/logind.conf",
        "usr/lib/systemd/logind.conf.d/50-vendor.conf",
        "run/systemd/logind.conf.d/60-run.conf",
        "etc/systemd/logind.conf.d/70-vendor.conf",
    ]
    assert outside.remove_ipc(conf) == (True, f"set in {tmp_path}/etc/systemd/logind.conf.d/70-vendor.conf")
    before = logind_signature(tmp_path)
    (tmp_path / "etc/systemd/logind.conf.d/70-vendor.conf").unlink()
    os.symlink("/dev/null", tmp_path / "etc/systemd/logind.conf.d/70-vendor.conf")  # masked
    assert outside.remove_ipc(read_logind(tmp_path))[0] is False
    assert logind_signature(tmp_path) != before


# --- H1: a regular user where logind removes its IPC ----------------------------------------------------


def test_a_replica_run_as_a_regular_user_where_logind_removes_ipc_is_a_hazard_h1():
    alice = declared(user="alice", uid=1000)
    (h,) = outside.outside_hazards(cfg(1), {"a": alice}, DEFAULT)
    assert h.rule == outside.SHARED_MEMORY.id and h.key == "removeipc:vllm-a.service" and h.replica == "a"
    assert "runs as alice (uid 1000)" in h.message and "RemoveIPC=yes (systemd's default" in h.message
    assert "RemoveIPC=no" in h.message and "system user" in h.message and "(H1)" in h.message
    assert h.over.startswith("hazard over: replica a:")
    assert found(alice, OFF) == []  # remedied: RemoveIPC=no
    assert found(declared(user="vllm", uid=998)) == []  # a system user: spared by logind
    assert found(declared()) == []  # root
    assert found(declared(user="ghost", uid=None)) == []  # not resolved: not judged
    assert found(declared(user="nobody", uid=65534)) == []
    assert found(alice, None) == []  # logind's files not read
    in_container = cfg(1).model_copy(
        update={"replicas": [ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:8001", model="m",
                                           container="vllm-a")]})
    assert found(alice, DEFAULT, in_container) == []  # its IPC is the container's own


# --- H2: a KV cache on disk without a fixed PYTHONHASHSEED -----------------------------------------------


def kv(connector: str, **extra) -> tuple[str, str]:
    config = {"kv_connector": connector, "kv_role": "kv_both"}
    if extra:
        config["kv_connector_extra_config"] = extra
    return ("--kv-transfer-config", json.dumps(config))


@pytest.mark.parametrize(
    ("extra", "env", "hazard"),
    [
        (kv("SharedStorageConnector", shared_storage_path="local_storage"), {}, True),
        (kv("SharedStorageConnector"), {"PYTHONHASHSEED": "0"}, False),  # remedied
        (kv("SharedStorageConnector"), {"PYTHONHASHSEED": "4294967295"}, False),
        (kv("SharedStorageConnector"), {"PYTHONHASHSEED": "random"}, True),
        (kv("SharedStorageConnector"), {"PYTHONHASHSEED": "4294967296"}, True),  # Python refuses it
        (kv("LMCacheConnectorV1"), {"LMCACHE_LOCAL_DISK": "file:///mnt/nvme/lmcache/"}, True),
        (kv("LMCacheConnectorV1"), {"LMCACHE_LOCAL_DISK": "None"}, False),
        (kv("LMCacheConnectorV1"), {}, False),  # LMCache in CPU memory only: nothing survives a restart anyway
        ((), {"LMCACHE_LOCAL_DISK": "/mnt/nvme"}, False),  # no KV connector: LMCache is not used
        (("--kv-offloading-backend", "lmcache"), {"LMCACHE_LOCAL_DISK": "/mnt/nvme"}, True),
        (kv("OffloadingConnector", spec_name="CPUOffloadingSpec", num_cpu_blocks=1000), {}, False),
        (kv("InferaKvdConnector", long_path="/nvme/kvd-long"), {}, True),
        (kv("MultiConnector", connectors=[]), {}, False),
        (("--kv-transfer-config", "{not json"), {}, False),
    ],
)
def test_a_kv_cache_on_disk_without_a_fixed_hash_seed_is_a_hazard_h2(extra, env, hazard):
    assert found(declared(*extra, env=env)) == ([outside.HASH_SEED.id] if hazard else [])


def test_the_h2_line_names_the_tier_and_the_remedy():
    (h,) = outside.outside_hazards(cfg(1), {"a": declared(*kv("SharedStorageConnector"))}, DEFAULT)
    assert h.key == "hashseed:vllm-a.service" and "(H2)" in h.message
    assert "kv_connector SharedStorageConnector" in h.message and "PYTHONHASHSEED is unset" in h.message
    assert "Environment=PYTHONHASHSEED=0 in vllm-a.service" in h.message


def test_a_hash_seed_set_where_guardian_cannot_read_is_not_judged_h2():
    assert found(declared(*kv("SharedStorageConnector"), env_unreadable=("/etc/vllm/secret.env",))) == []
    # `env PYTHONHASHSEED=0 vllm serve ...` sets it too
    argv = ("/usr/bin/env", "PYTHONHASHSEED=0", *SERVE)
    assert found(declared(*kv("SharedStorageConnector"), argv=argv)) == []


def test_a_containers_environment_is_its_run_lines_h2():
    run = ("/usr/bin/docker", "run", "--rm", "--name", "vllm-a", "vllm/vllm-openai:v0.32.0", "/models/qwen",
           *kv("SharedStorageConnector"))
    with_e = run[:2] + ("-e", "PYTHONHASHSEED=0") + run[2:]
    passed_on = run[:2] + ("-e", "PYTHONHASHSEED") + run[2:]
    env_file = run[:2] + ("--env-file", "/etc/vllm/a.env") + run[2:]
    assert found(declared(argv=run, env={"PYTHONHASHSEED": "0"})) == [outside.HASH_SEED.id]  # the unit's: not the container's
    assert found(declared(argv=with_e)) == []
    assert found(declared(argv=passed_on, env={"PYTHONHASHSEED": "0"})) == []
    assert found(declared(argv=env_file)) == []  # a file guardian does not read may set it
    (h,) = outside.outside_hazards(cfg(1), {"a": declared(argv=run)}, DEFAULT)
    assert "-e PYTHONHASHSEED=0 in the `run` line of vllm-a.service" in h.message


# --- as the daemon says them ------------------------------------------------------------------------------


def test_each_is_said_once_at_error_when_it_appears_and_once_at_info_when_it_ends():
    journal = Recorder()
    notices = Notices(journal)
    config = cfg(1)
    hazardous = UnitScan({}, {}, declared={"a": declared(*kv("SharedStorageConnector"), user="alice", uid=1000)},
                         logind=DEFAULT)
    assert {h.rule for h in notices.hazards(config, hazardous)} == {"H1", "H2"}
    assert {h.rule for h in notices.hazards(config, hazardous)} == {"H1", "H2"}  # the next scan: not said again
    said = [(line.priority, line.rule) for line, _ in journal.lines]
    assert sorted(said) == [(Priority.ERROR, "H1"), (Priority.ERROR, "H2")]
    remedied = UnitScan({}, {}, declared={"a": declared(*kv("SharedStorageConnector"), env={"PYTHONHASHSEED": "0"},
                                                        user="alice", uid=1000)}, logind=OFF)
    assert notices.hazards(config, remedied) == []
    over = [line for line, _ in journal.lines[2:]]
    assert sorted((line.priority, line.rule) for line in over) == [(Priority.INFO, "H1"), (Priority.INFO, "H2")]
    assert all(line.message.startswith("hazard over: replica a: vllm-a.service") for line in over)
    assert {line.hazard for line in over} == {"removeipc:vllm-a.service", "hashseed:vllm-a.service"}
