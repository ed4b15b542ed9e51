"""What `guardian check` says of the proxy: which nginx file includes each upstream file guardian
writes and what guardian would change in it (describe), and whether nginx's text sends a request
with no byte yet to the other replica (retry_warnings, core/proxy/proxyretry.py). Reads; changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from ..config import Config, ReplicaConfig
from ..core.actions import HUNG_STOP_GRACE_S
from ..core.proxy import proxyretry
from ..observe.readback import Refused, read_back
from .proxy import UPSTREAM_MAX_BYTES, render_upstream, upstream_path, upstreams

NGINX_CONF_MAX_BYTES = 2**20


NGINX_CONF_DIR = Path("/etc/nginx")


def nginx_texts(conf_dir: Path = NGINX_CONF_DIR) -> Iterator[tuple[Path, str]]:
    """Each file under CONF_DIR with its text. A link is followed (Debian's sites-enabled/* are
    links), to a regular file of at most NGINX_CONF_MAX_BYTES only: a FIFO, a device or a huge file
    is skipped, never read."""
    for f in sorted(conf_dir.rglob("*")) if conf_dir.is_dir() else []:
        try:
            yield f, read_back(f, NGINX_CONF_MAX_BYTES, follow_symlinks=True).decode(errors="replace")
        except OSError:
            continue


def includers(path: Path, conf_dir: Path = NGINX_CONF_DIR) -> list[Path]:
    """Files under CONF_DIR with an `include` of PATH (exactly that path: no glob is expanded)."""
    found = []
    for f, text in nginx_texts(conf_dir):
        for line in text.splitlines():
            words = line.split("#", 1)[0].replace(";", " ").split()
            if len(words) >= 2 and words[0] == "include" and words[1] == str(path):
                found.append(f)
                break
    return found


def describe(cfg: Config, down: frozenset[str], conf_dir: Path = NGINX_CONF_DIR) -> list[tuple[bool, str]]:
    """For `guardian check`: each upstream file, who includes it, and what writing it now would
    change. Each item is (a problem?, text)."""
    out: list[tuple[bool, str]] = []
    if cfg.proxy.nginx_upstream_dir is None:
        return out
    for upstream in upstreams(cfg):
        path = upstream_path(cfg, upstream)
        want = render_upstream(cfg, upstream, down)
        planted = None
        try:
            have: str | None = read_back(path, UPSTREAM_MAX_BYTES).decode(errors="replace")
        except FileNotFoundError:
            have = None
        except Refused as e:  # what the daemon does with it too
            have, planted = None, e.strerror or str(e)
        except OSError as e:
            out.append((True, f"proxy: upstream {upstream}: cannot read {path}: {e}"))
            continue
        inc = includers(path, conf_dir)
        where = (
            f"included by {', '.join(str(f) for f in inc)}"
            if inc
            else f"NOT included by any file under {conf_dir} (add the snippet in README, Under a proxy)"
        )
        if planted is not None:
            change = f"{planted}: not read; guardian replaces it with its own file and reloads nginx"
        elif have is None:
            change = "absent: guardian writes it at its next start"
        elif have == want:
            change = "as guardian would write it (a reload would change nothing)"
        else:
            old = {ln for ln in have.splitlines() if ln.startswith("server ")}
            new = {ln for ln in want.splitlines() if ln.startswith("server ")}
            diff = [f"- {ln}" for ln in sorted(old - new)] + [f"+ {ln}" for ln in sorted(new - old)]
            change = "guardian would rewrite it and reload nginx: " + ("; ".join(diff) or "comments only")
        out.append((not inc or planted is not None, f"proxy: upstream {upstream}: {path}, {where}; {change}"))
    return out


def kill_bound_s(cfg: Config, replicas: Iterable[ReplicaConfig]) -> float:
    """The longest guardian takes from a replica's freeze to its kill: its server unresponsive (L8),
    or its engine frozen with work queued while /health answers (L14: the stall canary's wait, then
    its bound), then up to two ticks and the hung stop's grace."""
    canary_s = max((r.canary_timeout_s for r in replicas), default=0.0)
    w = cfg.watchdog
    return max(w.unresponsive_after_s, w.stall_canary_after_s + canary_s) + 2 * cfg.interval_s + HUNG_STOP_GRACE_S


def retry_warnings(cfg: Config, conf_dir: Path = NGINX_CONF_DIR) -> list[str]:
    """For `guardian check`: where a file that proxy_passes to one of guardian's upstreams would not
    send a request with no byte yet to the other replica (core/proxy/proxyretry.py)."""
    if cfg.proxy.nginx_upstream_dir is None:
        return []
    out = []
    texts = list(nginx_texts(conf_dir))
    for upstream, replicas in upstreams(cfg).items():
        bound_s = kill_bound_s(cfg, replicas)
        for f, text in texts:
            for finding in proxyretry.retry_findings(text, upstream, bound_s) or ():
                out.append(f"proxy: upstream {upstream}: {f}: {finding} (README, Under a proxy)")
    return out
