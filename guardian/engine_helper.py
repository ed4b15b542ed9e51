"""The root helper for replicas in containers: `guardian container VERB:REPLICA`.

guardian's own user may not talk to dockerd or Podman (membership of the `docker` group is root
on that box). It starts guardian-container@VERB:REPLICA.service over D-Bus instead, which polkit
allows for exactly the configured container replicas (guardian/polkit.py), and this runs as
root in that unit. It reads the replica from guardian's own config, never from its argument,
so a name nobody configured reaches no container. Verbs:

- inspect: write every container the engine knows (at most MAX_CONTAINERS) to
  /run/guardian-containers/REPLICA.json (root's own directory), for guardian to tell its replica's container from a
  stray one holding the port, and to see a unit-less container's state; and, when the other
  engine is installed, its containers too, only to name a stray of that engine;
- kill: SIGKILL the replica's container (a hung replica; its unit's restart then replaces it);
- restart: restart a unit-less Docker container at once (`docker restart --time 0`), only if it
  is running: a container stopped on purpose stays stopped.
Exit 0: done; 1: the engine failed (its words on stderr, in the unit's journal); 2: refused.
"""

from __future__ import annotations

import grp
import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from .config import Config, ConfigError, ReplicaConfig, load_config
from .core.container import ENGINES, MAX_CONTAINERS
from .engines import ENGINES as ENGINES_SERVING

# Root's own directory (the helper unit's RuntimeDirectory=): not under guardian's /run/guardian,
# where guardian's user could put a link for root to follow.
REPORT_DIR = Path("/run/guardian-containers")
ENGINE_TIMEOUT_S = 30.0
OTHER_ENGINE_TIMEOUT_S = 5.0  # the other engine only names strays: it may not hold the report up long
ENGINE_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
VERBS = ("inspect", "kill", "restart")


def _engine(r: ReplicaConfig) -> str:
    path = shutil.which(r.runtime, path=ENGINE_PATH)
    if path is None:
        raise RuntimeError(f"{r.runtime} is not installed (no {r.runtime} in /usr/bin or /usr/local/bin)")
    return path


def _run(argv: list[str], timeout_s: float = ENGINE_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)


# Every serving engine's memory flag (guardian/engines/): a container runs one of them.
KNOB_FLAGS = tuple(e.knob.flag for e in ENGINES_SERVING.values() if e.knob is not None)


def _fraction(env: list[Any], args: list[Any]) -> str | None:
    for i, a in enumerate(args):
        if a in KNOB_FLAGS and i + 1 < len(args):
            return str(args[i + 1])
        if isinstance(a, str) and a.startswith(tuple(f + "=" for f in KNOB_FLAGS)):
            return a.partition("=")[2]
    for e in env:
        if isinstance(e, str) and e.startswith("GPU_MEMORY_UTILIZATION="):
            return e.partition("=")[2]
    return None


def normalize(c: dict[str, Any]) -> dict[str, Any]:
    """One row of `docker inspect` / `podman inspect`, as the few fields guardian reads."""
    state = c.get("State") or {}
    net = c.get("NetworkSettings") or {}
    ips = [net.get("IPAddress") or ""] + [
        (n or {}).get("IPAddress") or "" for n in (net.get("Networks") or {}).values()
    ]
    host_ports = sorted(
        {
            int(b["HostPort"])
            for binds in (net.get("Ports") or {}).values()
            for b in (binds or [])
            if isinstance(b, dict) and str(b.get("HostPort", "")).isdigit()
        }
    )
    cfg = c.get("Config") or {}
    args = list(c.get("Args") or []) or list(cfg.get("Cmd") or [])
    return {
        "id": str(c.get("Id", "")),
        "name": str(c.get("Name", "")).lstrip("/"),
        "running": bool(state.get("Running")),
        "restarting": bool(state.get("Restarting")),
        "status": str(state.get("Status", "")),
        "pid": int(state.get("Pid") or 0),
        "started_at": str(state.get("StartedAt", "")),
        "finished_at": str(state.get("FinishedAt", "")),
        "exit_code": int(state.get("ExitCode") or 0),
        "restart_policy": str(((c.get("HostConfig") or {}).get("RestartPolicy") or {}).get("Name", "")),
        "ips": sorted({ip for ip in ips if ip}),
        "host_ports": host_ports,
        "fraction": _fraction(list(cfg.get("Env") or []), args),
    }


def _listing(engine: str, path: str, timeout_s: float) -> dict[str, Any]:
    """Every container ENGINE knows (at most MAX_CONTAINERS), as normalize() rows, and any error."""
    out: dict[str, Any] = {"containers": [], "truncated": False}
    ps = _run([path, "ps", "-a", "-q", "--no-trunc"], timeout_s)
    if ps.returncode != 0:
        out["error"] = f"`{engine} ps` failed: {ps.stderr.strip()[:500]}"
        return out
    ids = ps.stdout.split()
    out["truncated"] = len(ids) > MAX_CONTAINERS
    if ids:
        got = _run(
            [path, "inspect", "--type", "container", *ids[:MAX_CONTAINERS]]
            if engine == "docker"
            else [path, "inspect", *ids[:MAX_CONTAINERS]],
            timeout_s,
        )
        # A container removed between ps and inspect makes inspect exit 1 with the others printed.
        try:
            rows = json.loads(got.stdout or "[]")
            out["containers"] = [normalize(c) for c in rows if isinstance(c, dict)]
        except (ValueError, TypeError, KeyError) as e:
            out["error"] = f"`{engine} inspect` printed what guardian cannot read: {e}"
    return out


def _other_engine(r: ReplicaConfig) -> dict[str, Any] | None:
    """The other engine's containers, when it is installed: a stray of that engine on the
    replica's port (a Docker container in front of a Podman replica) is then named."""
    other = next(e for e in ENGINES if e != r.runtime)
    path = shutil.which(other, path=ENGINE_PATH)
    if path is None:
        return None
    try:
        return {"engine": other, **_listing(other, path, OTHER_ENGINE_TIMEOUT_S)}
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"engine": other, "containers": [], "error": f"`{other}` did not answer: {e}"}


def inspect(r: ReplicaConfig) -> int:
    engine = _engine(r)
    report: dict[str, Any] = {
        "engine": r.runtime,
        "at_wall": time.time(),
        **_listing(r.runtime, engine, ENGINE_TIMEOUT_S),
    }
    others = _other_engine(r)
    if others is not None:
        report["others"] = others
    from .act.state import atomic_write  # the one atomic writer (a reader never sees half a report)

    REPORT_DIR.mkdir(mode=0o755, exist_ok=True)
    path = REPORT_DIR / f"{r.name}.json"
    # Readable by guardian's group only: it lists every container of the box.
    try:
        gid = grp.getgrnam("guardian").gr_gid
    except KeyError:
        gid = -1
    atomic_write(path, (json.dumps(report, sort_keys=True) + "\n").encode(), mode=0o640 if gid >= 0 else 0o644)
    if gid >= 0:
        os.chown(path, 0, gid, follow_symlinks=False)
    return 1 if "error" in report else 0


_RFC3339 = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$")


def started_wall(text: str) -> float | None:
    """An engine's State.StartedAt (RFC 3339, nanoseconds) as epoch seconds, or None."""
    m = _RFC3339.match(text.strip())
    if m is None:
        return None
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    try:
        return datetime.fromisoformat(f"{m.group(1)}.{(m.group(2) or '0')[:6]:0<6}{zone}").timestamp()
    except ValueError:
        return None


def _started_before(runtime_dir: Path, r: ReplicaConfig) -> float | None:
    """guardian's request, from a directory guardian's user owns: a regular file only, not followed."""
    from .observe.readback import read_back

    try:
        doc = json.loads(read_back(runtime_dir / f"kill-{r.name}.json", 4096))
        value = doc.get("started_before") if isinstance(doc, dict) else None
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    except (OSError, ValueError, OverflowError):
        return None


def _inspect_named(engine: str, r: ReplicaConfig) -> dict[str, Any]:
    """The container of exactly this name (the engines fall back to an id prefix: never that)."""
    assert r.container is not None
    looked = _run([engine, "inspect", "--type", "container", r.container])
    try:
        rows = json.loads(looked.stdout or "[]")
    except ValueError:
        return {}
    row = rows[0] if isinstance(rows, list) and rows and isinstance(rows[0], dict) else {}
    return row if str(row.get("Name", "")).lstrip("/") == r.container else {}


def kill(r: ReplicaConfig, runtime_dir: Path) -> int:
    """SIGKILL the container guardian judged hung: the one of this name that started before
    guardian's decision (kill-REPLICA.json in guardian's runtime directory), never a newer one
    that the unit's own restart has started meanwhile under the same name. Killed by id, so a
    replacement between the look and the kill is not hit either."""
    assert r.container is not None
    engine = _engine(r)
    row = _inspect_named(engine, r)
    state = row.get("State") or {}
    if not row or not state.get("Running"):
        print(f"{r.container}: not running: nothing to kill")
        return 0
    before = _started_before(runtime_dir, r)
    started = started_wall(str(state.get("StartedAt", "")))
    if before is not None and started is not None and started >= before:
        print(
            f"{r.container} ({str(row.get('Id', ''))[:12]}) started after guardian's decision: "
            "it is the new one, left alone"
        )
        return 0
    cid = str(row.get("Id", ""))
    got = _run([engine, "kill", "--signal", "KILL", cid])
    if got.returncode != 0 and "is not running" not in got.stderr and "no such container" not in got.stderr.lower():
        print(f"{r.runtime} kill {r.container} ({cid[:12]}) failed: {got.stderr.strip()}", file=sys.stderr)
        return 1
    print(f"{r.container} ({cid[:12]}): killed (SIGKILL)" if got.returncode == 0 else f"{r.container}: was not running")
    return 0


def restart(r: ReplicaConfig) -> int:
    assert r.container is not None
    engine = _engine(r)
    row = _inspect_named(engine, r)
    state = row.get("State") or {}
    if not state.get("Running"):
        print(
            f"{r.container} is not running ({state.get('Status') or 'no such container'}): left alone", file=sys.stderr
        )
        return 2
    got = _run([engine, "restart", "--time", "0", str(row.get("Id", ""))])
    if got.returncode != 0:
        print(f"{r.runtime} restart {r.container} failed: {got.stderr.strip()}", file=sys.stderr)
        return 1
    print(f"{r.container}: restarted")
    return 0


def main(instance: str, config_path: Path) -> int:
    verb, sep, name = instance.partition(":")
    if not sep or verb not in VERBS:
        print(
            f"guardian container: {instance!r} is not VERB:REPLICA with VERB one of {', '.join(VERBS)}", file=sys.stderr
        )
        return 2
    try:
        cfg: Config = load_config(config_path)
    except ConfigError as e:
        print(f"guardian container: {e}", file=sys.stderr)
        return 2
    r = next((x for x in cfg.replicas if x.name == name), None)
    if r is None or r.container is None:
        print(f"guardian container: {name!r} is not a configured container replica: nothing done", file=sys.stderr)
        return 2
    if verb == "restart" and not r.unitless:
        print(
            f"guardian container: {r.name} runs in {r.unit}: guardian restarts that unit, not the container",
            file=sys.stderr,
        )
        return 2
    try:
        if verb == "kill":
            return kill(r, cfg.runtime_dir)
        return {"inspect": inspect, "restart": restart}[verb](r)
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"guardian container {instance}: {e}", file=sys.stderr)
        return 1
