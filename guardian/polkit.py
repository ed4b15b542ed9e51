"""The polkit rule that lets user `guardian` restart exactly the configured replica units.

Rendered from the config by `guardian polkit-rule`, which guardian.service runs as root before
every start and reload (ExecStartPre=+, ExecReload=+). A rule for a name pattern (vllm-*) would
also let guardian's user restart units nobody configured (a conflicting vllm-split.service, a
router), and start or stop any of them; guardian only ever uses two verbs:
- try-restart, for every restart (a unit that an operator stopped stays stopped);
- restart, for the memory guard's retry of a start that failed after its own lowering;
- kill, to SIGKILL a hung replica's processes as its restart begins (a hung vLLM never finishes
  a graceful stop; systemd would wait for TimeoutStopSec).
For each replica in a container, start of its container helper, one unit per verb
(guardian-container@VERB:REPLICA.service: inspect, kill; and restart for a unit-less Docker
container, which has no unit of its own to restart). The helper runs as root and reads the
container's name from the config, not from the unit name.
With memory.drop_caches set, start of guardian-drop-caches.service (root: `echo 1 >
/proc/sys/vm/drop_caches`, before a start that fits only once the page cache is released).
With [proxy] nginx_upstream_dir set, two more grants, each for one unit:
- start of the nginx check unit (guardian-nginx-check.service runs `nginx -t` as root);
- reload of nginx's unit, to apply the upstream file guardian wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import Config
from .core.container import helper_unit
from .core.fit.startfit import DROP_CACHES_UNIT

RULE_PATH = Path("/etc/polkit-1/rules.d/50-guardian.rules")
SERVICE_USER = "guardian"
VERBS = ("try-restart", "restart", "kill")
MANAGE_UNITS = "org.freedesktop.systemd1.manage-units"


def render(cfg: Config, source: str, user: str = SERVICE_USER) -> str:
    """The rule as JavaScript. Unit names passed the config's systemd grammar; json.dumps quotes them anyway."""
    units = sorted({r.unit for r in cfg.replicas if not r.unitless})
    helpers = helper_units(cfg)
    extra = ""
    if helpers:
        extra += (
            f"    if (action.id == {json.dumps(MANAGE_UNITS)} && subject.user == {json.dumps(user)} &&\n"
            f'        {json.dumps(helpers)}.indexOf(action.lookup("unit")) >= 0 &&\n'
            '        action.lookup("verb") == "start") {\n'
            "        return polkit.Result.YES;\n"
            "    }\n"
        )
    if cfg.memory.drop_caches:
        extra += (
            f"    if (action.id == {json.dumps(MANAGE_UNITS)} && subject.user == {json.dumps(user)} &&\n"
            f'        action.lookup("unit") == {json.dumps(DROP_CACHES_UNIT)} && action.lookup("verb") == "start") {{\n'
            "        return polkit.Result.YES;\n"
            "    }\n"
        )
    if cfg.proxy.nginx_upstream_dir is not None:
        check, nginx = json.dumps(cfg.proxy.nginx_check_unit), json.dumps(cfg.proxy.nginx_unit)
        extra += (
            f"    if (action.id == {json.dumps(MANAGE_UNITS)} && subject.user == {json.dumps(user)} && (\n"
            f'        (action.lookup("unit") == {check} && action.lookup("verb") == "start") ||\n'
            f'        (action.lookup("unit") == {nginx} && action.lookup("verb") == "reload"))) {{\n'
            "        return polkit.Result.YES;\n"
            "    }\n"
        )
    return (
        f"// Written by `guardian polkit-rule` from {json.dumps(source)}; guardian.service rewrites it at every start\n"
        "// and reload, so edits here are lost. It lets user "
        f"{json.dumps(user)} {', '.join(VERBS)} exactly the replica\n"
        "// units configured, and nothing else. An empty list allows nothing.\n"
        + (
            f"// [proxy]: also start of {cfg.proxy.nginx_check_unit} (nginx -t) and reload of {cfg.proxy.nginx_unit}.\n"
            if cfg.proxy.nginx_upstream_dir is not None
            else ""
        )
        + (f"// memory.drop_caches: also start of {DROP_CACHES_UNIT}.\n" if cfg.memory.drop_caches else "")
        + (
            "// Containers: also start of each container replica's helper units (root; see the unit).\n"
            if helpers
            else ""
        )
        + "polkit.addRule(function(action, subject) {\n"
        f"    var units = {json.dumps(units)};\n"
        f"    var verbs = {json.dumps(list(VERBS))};\n"
        f"    if (action.id == {json.dumps(MANAGE_UNITS)} && subject.user == {json.dumps(user)} &&\n"
        '        units.indexOf(action.lookup("unit")) >= 0 && verbs.indexOf(action.lookup("verb")) >= 0) {\n'
        "        return polkit.Result.YES;\n"
        "    }\n"
        f"{extra}"
        "});\n"
    )


def helper_units(cfg: Config) -> list[str]:
    """guardian-container@VERB:REPLICA.service for every container replica and verb it may use."""
    out = []
    for r in cfg.replicas:
        if r.container is None:
            continue
        for verb in ("inspect", "kill", "restart") if r.unitless else ("inspect", "kill"):
            out.append(helper_unit(verb, r.name))
    return sorted(out)
