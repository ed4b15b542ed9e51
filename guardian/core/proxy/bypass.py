"""Clients that bypass the proxy (the seed's incident: a batch job had one box's own address in its
configuration; all its load went to one replica while the other had capacity to spare). Pure.

Rules: RULES, rendered into docs/rules.md's "What the kernel shows"; each is a row asked of its
own context: NO_PROXY_ROW of the config, NO_VIEW_ROW of a replica's look, BYPASSING_ROW of a peer.
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
from ..observations import ConnView, Peer, PeerKind
from ..rules import UNCHANGED, Row, Rule, first_match
from ..vocab import Decision, Priority

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


@dataclass(frozen=True)
class _Look:
    """One replica's connections at this look (None: the kernel's view could not be read), and what
    was seen and who was bypassing at the last one."""

    replica: str
    view: ConnView | None
    seen: Seen
    bypassing: tuple[Bypass, ...]


@dataclass(frozen=True)
class _Peer:
    """One peer connected to a replica at this look, and since when it has been at every look."""

    replica: str
    peer: Peer
    since: float
    now: float
    after_s: float  # W.bypass_after_s


NO_PROXY_ROW: Row[Config, None] = Row(
    NO_PROXY := Rule(
        "B1",
        "(no hazard)",
        "no proxy whose connections guardian knows (proxy.nginx_upstream_dir unset AND watchdog.proxy_peers empty)",
    ),
    lambda cfg: cfg.proxy.nginx_upstream_dir is None and not cfg.watchdog.proxy_peers,
    lambda cfg: None,
)
# Its evidence: what this replica's peers were seen since, and who of them bypassed, as they stand.
NO_VIEW_ROW: Row[_Look, tuple[dict[tuple[str, str], float], list[Bypass]]] = Row(
    NO_VIEW := Rule(
        "B3", UNCHANGED, "the kernel's view could not be read at this look: what was seen, and who bypasses, stands"
    ),
    lambda k: k.view is None,
    lambda k: (
        {key: since for key, since in k.seen.items() if key[0] == k.replica},
        [bypass for bypass in k.bypassing if bypass.replica == k.replica],
    ),
)
BYPASSING_ROW: Row[_Peer, Bypass] = Row(
    BYPASSING := Rule(  # Bypass.hazard() says it
        "B2",
        "bypass",
        "a peer of kind other has connections to the replica's own port at every look for >= W.bypass_after_s",
    ),
    lambda p: _other(p.peer) and p.now - p.since >= p.after_s,
    lambda p: Bypass(p.replica, p.peer.name, p.peer.connections, p.since),
)
RULES = (NO_PROXY_ROW.rule, BYPASSING_ROW.rule, NO_VIEW_ROW.rule)


def _other(peer: Peer) -> bool:
    """A client connected now: not the proxy, guardian or monitoring."""
    return peer.kind is PeerKind.OTHER and peer.connections > 0


def proxy_configured(cfg: Config) -> bool:
    """Guardian knows the proxy's connections (nginx on this box, or proxy_peers): else NO_PROXY."""
    return not NO_PROXY_ROW.holds(cfg)


def update(
    seen: Seen, bypassing: Iterable[Bypass], views: Mapping[str, ConnView | None], now: float, cfg: Config
) -> tuple[dict[tuple[str, str], float], list[Bypass]]:
    """The peers seen connected from now on, and those bypassing the proxy (RULES), given what was
    seen and who was BYPASSING at the last look."""
    if NO_PROXY_ROW.holds(cfg):
        return {}, []
    still_seen: dict[tuple[str, str], float] = {}
    found: list[Bypass] = []
    bypassing = tuple(bypassing)
    for replica, view in views.items():
        unchanged = first_match((NO_VIEW_ROW,), _Look(replica, view, seen, bypassing))
        if unchanged is not None:  # no news is not "gone"
            still_seen.update(unchanged[1][0])
            found += unchanged[1][1]
            continue
        assert view is not None, "a look without a view is kept as it stands"
        for peer in view.peers:
            if not _other(peer):
                continue
            since = seen.get((replica, peer.name), now)
            still_seen[(replica, peer.name)] = since
            bypass = first_match((BYPASSING_ROW,), _Peer(replica, peer, since, now, cfg.watchdog.bypass_after_s))
            if bypass is not None:
                found.append(bypass[1])
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
