"""Hazards from outside the replica (issue 44 item 3): set-ups of the box or of the unit that hang
a replica, or throw its cache away, with nothing wrong in the replica itself. Pure.

- H1: a replica's unit runs as a regular user (User= with a uid in 1000-60000, systemd's and
  Debian's range of regular users; root and system users, below 1000, are exempt, as logind
  exempts them) on a box whose logind has RemoveIPC=yes, systemd's default and Debian's: when
  that user's last login session ends (an ssh logout), logind deletes every System V semaphore
  and shared-memory segment, and every POSIX shared-memory file, that uid owns, the running
  vLLM's included, and a vLLM head then blocks for ever (eugr/spark-vllm-docker #352). Not judged
  for a replica in a container (its IPC is the container's own namespace) nor for a User= this box
  does not resolve.
- H2: a replica configured for a KV cache offloaded to disk (vLLM's --kv-transfer-config naming a
  file-backed connector or a path, directory or disk in its kv_connector_extra_config; or LMCache's
  LMCACHE_LOCAL_DISK beside a KV connector or --kv-offloading-backend lmcache) without a fixed
  PYTHONHASHSEED in its environment: vLLM seeds its prefix-cache keys from os.urandom at every
  start when PYTHONHASHSEED is unset (or "random"), so nothing on that disk tier is ever found
  again after a restart (vllm docs #44415). Not judged where an environment guardian cannot read
  (an unreadable EnvironmentFile=, a container's --env-file) may set it.

What they read: the unit as systemd runs it (core/observations.py UnitDeclared) and logind's
files (LogindConf), both read by observe/declared.py when units may have changed, and logind's
files again when they change. Each is said once at error when it appears and once at info when it
ends (act/notices.py), and by `guardian check`. The start loop (A6) lives with admission.

Rules: RULES below (H1, H2), each a row over one replica's _Seen.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from ..config import Config
from .container import Served, last_option, parse_run_line, served
from .hazards import Hazard
from .observations import LogindConf, UnitDeclared
from .rules import Row, Rule

# systemd's (and Debian's login.defs) regular users: UID_MIN 1000 to UID_MAX 60000. Below are system
# users, which logind's RemoveIPC= spares; above, systemd's dynamic users, containers' ranges and
# nobody (65534), which never log in.
REGULAR_UIDS = range(1000, 60001)
LOGIND_DROPIN = "/etc/systemd/logind.conf.d/90-guardian-removeipc.conf"
KV_FLAG = "--kv-transfer-config"
# vLLM's example connector, which keeps every block in files (SharedStorageConnector; ExampleConnector since its rename)
FILE_CONNECTORS = frozenset({"SharedStorageConnector", "ExampleConnector"})
# a kv_connector_extra_config key naming where blocks are stored on disk
DISK_WORDS = ("path", "dir", "disk", "file", "storage", "ssd", "nvme")
MAX_SEED = 4294967295  # Python takes PYTHONHASHSEED as "random" or an integer in [0, 2**32 - 1]
_TRUE = frozenset({"1", "yes", "y", "true", "t", "on"})
_FALSE = frozenset({"0", "no", "n", "false", "f", "off"})
_NOT_SET = frozenset({"", "none", "null", "false", "0", "no"})


def remove_ipc(conf: LogindConf) -> tuple[bool, str]:
    """logind's RemoveIPC= as it applies its files (the last assignment in [Login] wins; an empty one
    is the default again; one it cannot parse is ignored), and where it was set."""
    value, where = True, "systemd's default: no file sets it"
    for path, text in conf.files:
        section = ""
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1].strip()
                continue
            key, sep, setting = line.partition("=")
            if not sep or section != "Login" or key.strip() != "RemoveIPC":
                continue
            setting = setting.strip().lower()
            if not setting:
                value, where = True, f"{path} sets it empty: the default"
            elif setting in _TRUE | _FALSE:
                value, where = setting in _TRUE, f"set in {path}"
    return value, where


def _fixed_seed(value: str | None) -> bool:
    return value is not None and value.isascii() and value.isdigit() and int(value) <= MAX_SEED


def _disk_setting(extra: object, prefix: str = "") -> str | None:
    """The first setting of a kv_connector_extra_config that names a place on disk, as "key=value"."""
    items = extra.items() if isinstance(extra, dict) else ()
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, str) and value.strip():
            if any(w in str(key).lower() for w in DISK_WORDS) or value.startswith(("/", "file://")):
                return f"{name}={value}"
        found = _disk_setting(value, f"{name}.")
        if found is not None:
            return found
    return None


def disk_tier(s: Served) -> str | None:
    """What configures a KV cache tier on disk for the server S runs, in words; None: none."""
    text = last_option(s.argv, KV_FLAG)
    try:
        config = json.loads(text) if text is not None else None
    except ValueError:
        config = None
    if isinstance(config, dict):
        connector = str(config.get("kv_connector", ""))
        if connector in FILE_CONNECTORS:
            return f"{KV_FLAG} with kv_connector {connector}, which keeps its blocks in files"
        found = _disk_setting(config.get("kv_connector_extra_config"))
        if found is not None:
            return f"{KV_FLAG} with kv_connector {connector or '(unnamed)'}, kv_connector_extra_config {found}"
    lmcache = text is not None or (last_option(s.argv, "--kv-offloading-backend") or "").lower() == "lmcache"
    local_disk = s.env.get("LMCACHE_LOCAL_DISK", "")
    if lmcache and local_disk.strip().lower() not in _NOT_SET:
        return f"LMCache's LMCACHE_LOCAL_DISK={local_disk}"
    return None


@dataclass(frozen=True)
class _Seen:
    """One replica as H1 and H2 read it."""

    replica: str
    unit: str
    in_container: bool
    declared: UnitDeclared
    served: Served
    remove_ipc: tuple[bool, str] | None  # logind's RemoveIPC= and where it was set; None: not read

    @property
    def regular_user(self) -> bool:
        return self.declared.uid is not None and self.declared.uid in REGULAR_UIDS

    @property
    def seed(self) -> str | None:
        return self.served.env.get("PYTHONHASHSEED")

    @property
    def env_known(self) -> bool:
        """Every setting of its server's environment was read."""
        return self.served.env_complete and (self.in_container or not self.declared.env_unreadable)


def _ipc_text(s: _Seen) -> str:
    assert s.remove_ipc is not None
    where = s.remove_ipc[1]
    return (
        f"replica {s.replica}: {s.unit} runs as {s.declared.user} (uid {s.declared.uid}), a regular user, and this "
        f"box's logind has RemoveIPC=yes ({where}): when that user's last login session ends (an ssh logout), "
        "logind deletes every System V semaphore and shared-memory segment and every POSIX shared-memory file of "
        "that uid, the running vLLM's too, and a vLLM head then blocks for ever (eugr/spark-vllm-docker #352); "
        f"remedy: RemoveIPC=no under [Login] in a logind drop-in ({LOGIND_DROPIN}), then systemctl restart "
        f"systemd-logind, or run {s.unit} as a system user (useradd --system: uid below 1000) ({SHARED_MEMORY.id})"
    )


def _seed_text(s: _Seen) -> str:
    tier = disk_tier(s.served)
    why = "unset" if s.seed is None else f"PYTHONHASHSEED={s.seed}"
    where = (
        f"-e PYTHONHASHSEED=0 in the `run` line of {s.unit}"
        if s.in_container
        else f"Environment=PYTHONHASHSEED=0 in {s.unit} (systemctl edit {s.unit}), then restart it"
    )
    return (
        f"replica {s.replica}: {s.unit} keeps vLLM's KV cache on disk ({tier}) but PYTHONHASHSEED is {why}: vLLM "
        "seeds its prefix-cache keys at random at every start, so nothing on that disk tier is found again after a "
        "restart and a restarted replica gets its warm-up alone (vllm docs #44415); remedy: "
        f"{where} (any fixed value, the same on every replica that shares the tier) ({HASH_SEED.id})"
    )


ROWS: tuple[Row[_Seen, str], ...] = (
    Row(
        SHARED_MEMORY := Rule(
            "H1",
            "hazard",
            "a replica's unit (not a container) runs as User= with a uid in 1000-60000 (a regular user) AND "
            "logind's RemoveIPC= is yes (its files, the last assignment wins; none: yes): said with its remedy, "
            "RemoveIPC=no in a logind.conf.d drop-in, or a system user",
        ),
        lambda s: not s.in_container and s.regular_user and s.remove_ipc is not None and s.remove_ipc[0],
        _ipc_text,
    ),
    Row(
        HASH_SEED := Rule(
            "H2",
            "hazard",
            "a replica's vLLM keeps its KV cache on disk (--kv-transfer-config with a file-backed connector or a "
            "path, directory or disk in its kv_connector_extra_config; or LMCACHE_LOCAL_DISK with a KV connector "
            "or --kv-offloading-backend lmcache) AND its environment, all of it read, has no PYTHONHASHSEED that "
            "is an integer in [0, 2^32 - 1]: said with its remedy, Environment=PYTHONHASHSEED=0",
        ),
        lambda s: disk_tier(s.served) is not None and not _fixed_seed(s.seed) and s.env_known,
        _seed_text,
    ),
)
RULES = tuple(row.rule for row in ROWS)
_KEYS = {SHARED_MEMORY.id: "removeipc", HASH_SEED.id: "hashseed"}
_OVER = {
    SHARED_MEMORY.id: "no longer runs as a regular user where logind removes its IPC",
    HASH_SEED.id: "keeps no KV cache on disk without a fixed PYTHONHASHSEED any more",
}


def outside_hazards(
    cfg: Config, declared: Mapping[str, UnitDeclared | None], logind: LogindConf | None
) -> list[Hazard]:
    """H1 and H2 for every replica whose unit was read (DECLARED: by replica name); LOGIND: logind's
    files as read (None: not read, and H1 not judged)."""
    ipc = remove_ipc(logind) if logind is not None else None
    found = []
    for r in cfg.replicas:
        d = declared.get(r.name)
        if d is None or d.unseen is not None:
            continue
        in_container = r.container is not None or parse_run_line(d.argv) is not None
        seen = _Seen(r.name, r.unit, in_container, d, served(d.argv, d.env), ipc)
        for row in ROWS:
            if row.holds(seen):
                found.append(
                    Hazard(
                        f"{_KEYS[row.rule.id]}:{r.unit}",
                        row.evidence(seen),
                        r.name,
                        r.unit,
                        rule=row.rule.id,
                        over=f"hazard over: replica {r.name}: {r.unit} {_OVER[row.rule.id]} ({row.rule.id})",
                    )
                )
    return found
