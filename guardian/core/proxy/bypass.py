"""Clients that bypass the proxy (the seed's incident: a batch job had one box's own address in its
configuration; all its load went to one replica while the other had capacity to spare). Pure.

Rules (RULES, rendered into docs/rules.md's "What the kernel shows"; they are not first-match rows,
so each names the code that enforces it):
- B1: only while guardian knows the proxy's connections ([proxy] with nginx on this box, or
  watchdog.proxy_peers not empty): without one, every client talks to the replicas directly, and
  that is the set-up; with only drain commands (a proxy elsewhere) its address is not known, and
  it would itself look like a client bypassing it.
- B2: a peer of kind OTHER (not the proxy, not guardian, not monitoring) with connections to a
  replica's own port at every look for >= W.bypass_after_s is bypassing: one hazard per
  (replica, peer), said once, with the remedy, until it is gone at a look.
- B3: a look without the kernel's view (None) keeps what was seen and who was bypassing (no news
  is not "gone").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ...config import Config
from ..actions import LogLine
from ..hazards import Hazard
from ..observations import ConnView, PeerKind
from ..rules import UNCHANGED, Rule
from ..vocab import Decision, Priority

NO_PROXY = Rule(  # enforced by proxy_configured(), which update() asks first
    "B1",
    "(no hazard)",
    "no proxy whose connections guardian knows (proxy.nginx_upstream_dir unset AND watchdog.proxy_peers empty)",
)
BYPASSING = Rule(  # enforced by update(), for each replica's view; Bypass.hazard() says it
    "B2",
    "bypass",
    "a peer of kind other has connections to the replica's own port at every look for >= W.bypass_after_s",
)
NO_VIEW = Rule(  # enforced by update(), for a replica whose view is None
    "B3", UNCHANGED, "the kernel's view could not be read at this look: what was seen, and who bypasses, stands"
)
RULES = (NO_PROXY, BYPASSING, NO_VIEW)

Seen = Mapping[tuple[str, str], float]  # (replica, peer) -> first look at which it was connected


@dataclass(frozen=True)
class Bypass:
    replica: str
    peer: str
    connections: int
    since: float

    def hazard(self, cfg: Config, now: float) -> Hazard:
        replica = cfg.replica(self.replica)
        unit = replica.unit if replica is not None else None
        port = f" on port {replica.port}" if replica is not None else ""
        return Hazard(
            f"bypass:{self.replica}:{self.peer}",
            f"replica {self.replica} ({unit}): {self.peer} talks to it directly{port}, not through the proxy "
            f"({self.connections} connection(s), for {now - self.since:.0f} s): its load skips the proxy's "
            f"balancing and draining; point it at the proxy ({BYPASSING.id})",
            self.replica,
            unit,
        )


def proxy_configured(cfg: Config) -> bool:
    """Guardian knows the proxy's connections (nginx on this box, or proxy_peers): else NO_PROXY."""
    return cfg.proxy.nginx_upstream_dir is not None or bool(cfg.watchdog.proxy_peers)


def update(
    seen: Seen, bypassing: Iterable[Bypass], views: Mapping[str, ConnView | None], now: float, cfg: Config
) -> tuple[dict[tuple[str, str], float], list[Bypass]]:
    """The peers seen connected from now on, and those bypassing the proxy (RULES), given what was
    seen and who was BYPASSING at the last look."""
    if not proxy_configured(cfg):  # NO_PROXY
        return {}, []
    still_seen: dict[tuple[str, str], float] = {}
    found: list[Bypass] = []
    for replica, view in views.items():
        if view is None:  # NO_VIEW: no news is not "gone"
            still_seen.update({key: since for key, since in seen.items() if key[0] == replica})
            found += [bypass for bypass in bypassing if bypass.replica == replica]
            continue
        for peer in view.peers:
            if peer.kind is not PeerKind.OTHER or peer.connections <= 0:
                continue
            since = seen.get((replica, peer.name), now)
            still_seen[(replica, peer.name)] = since
            if now - since >= cfg.watchdog.bypass_after_s:  # BYPASSING
                found.append(Bypass(replica, peer.name, peer.connections, since))
    return still_seen, found


def said(before: Iterable[Bypass], found: Iterable[Bypass], cfg: Config, now: float) -> list[LogLine]:
    """B2's lines: each client that started bypassing the proxy since the last look (BEFORE), said
    once at warning, and each that has gone, once at info."""
    before, found = tuple(before), tuple(found)
    was = {(b.replica, b.peer) for b in before}
    now_seen = {(f.replica, f.peer) for f in found}
    lines = [_started(client.hazard(cfg, now)) for client in found if (client.replica, client.peer) not in was]
    return lines + [_gone(client, cfg) for client in before if (client.replica, client.peer) not in now_seen]


def _started(hazard: Hazard) -> LogLine:
    return LogLine(
        Priority.WARNING,
        f"hazard: {hazard.message}",
        Decision.HAZARD,
        hazard.replica,
        hazard.unit,
        rule=BYPASSING.id,
        hazard=hazard.key,
    )


def _gone(client: Bypass, cfg: Config) -> LogLine:
    replica = cfg.replica(client.replica)
    return LogLine(
        Priority.INFO,
        f"replica {client.replica}: {client.peer} no longer talks to it directly",
        Decision.HAZARD,
        client.replica,
        replica.unit if replica is not None else None,
        rule=BYPASSING.id,
        hazard=f"bypass:{client.replica}:{client.peer}",
    )
