"""Clients that bypass the proxy (core/proxy/bypass.py, rules B1-B3), at their boundaries."""

from __future__ import annotations

from pathlib import Path

import pytest

from guardian.config import Config, ProxyConfig, ReplicaConfig, WatchdogConfig
from guardian.core.proxy import bypass
from guardian.core.actions import LogLine
from guardian.core.observations import ConnView, Peer, PeerKind, ReplicaObservation
from guardian.core.vocab import Decision, Priority
from harness import OK, Box, of


def cfg(proxy: bool = True, proxy_peers: list[str] | None = None) -> Config:
    return Config(
        replicas=[ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:8001", model="m")],
        watchdog=WatchdogConfig(bypass_after_s=30, proxy_peers=proxy_peers or []),
        proxy=ProxyConfig(nginx_upstream_dir=Path("/var/lib/guardian/nginx")) if proxy else ProxyConfig(),
    )


def view(*peers: Peer) -> ConnView:
    n = sum(p.connections for p in peers)
    return ConnView(connections=n, flowing=0, bytes_out=0, waiting=0, since_s=2.0, cpu_s=None,
                    peers=peers)


JOB = Peer(PeerKind.OTHER, "batch.service", 3)
NGINX = Peer(PeerKind.PROXY, "nginx.service", 8)
GUARDIAN = Peer(PeerKind.GUARDIAN, "guardian.service", 2)
PROM = Peer(PeerKind.MONITORING, "prometheus.service", 1)


def run(c: Config, looks: list[tuple[float, ConnView | None]]) -> list[bypass.Bypass]:
    seen: dict = {}
    found: list[bypass.Bypass] = []
    for now, v in looks:
        seen, found = bypass.update(seen, found, {"a": v}, now, c)
    return found


@pytest.mark.parametrize("last, bypassing", [(129.9, False), (130.0, True), (130.1, True)])
def test_a_client_connected_straight_to_the_port_for_bypass_after_s_is_a_hazard(last, bypassing):
    found = run(cfg(), [(100.0, view(JOB, NGINX)), (115.0, view(JOB, NGINX)), (last, view(JOB, NGINX))])
    assert [(b.replica, b.peer) for b in found] == ([("a", "batch.service")] if bypassing else [])
    if bypassing:
        h = found[0].hazard(cfg(), last)
        assert h.key == "bypass:a:batch.service" and "point it at the proxy" in h.message
        assert "port 8001" in h.message and "vllm-a.service" in h.message and "3 connection(s)" in h.message


def test_the_proxy_guardian_and_monitoring_are_never_bypassing():
    assert run(cfg(), [(100.0, view(NGINX, GUARDIAN, PROM)), (200.0, view(NGINX, GUARDIAN, PROM))]) == []


def test_without_a_proxy_every_client_is_direct_and_none_is_a_hazard():
    assert run(cfg(proxy=False), [(100.0, view(JOB)), (200.0, view(JOB))]) == []
    assert run(cfg(proxy=False, proxy_peers=["haproxy.service"]), [(100.0, view(JOB)), (200.0, view(JOB))])


def test_a_look_without_the_peer_starts_its_time_again_and_a_look_without_a_view_keeps_it():
    assert run(cfg(), [(100.0, view(JOB)), (110.0, view(NGINX)), (120.0, view(JOB)), (140.0, view(JOB))]) == []
    assert run(cfg(), [(100.0, view(JOB)), (110.0, None), (130.0, view(JOB))])


def answering(now: float, v: ConnView | None) -> ReplicaObservation:
    """Replica a answering every probe (its unit unknown: D-Bus down), the kernel's view V of its clients."""
    return ReplicaObservation(name="a", at=now, unit=None, health=OK, metrics_probe=OK, metrics=None,
                              models_probe=OK, models=None, conns=v)


def hazard_lines(actions: list) -> list[LogLine]:
    return [a for a in of(actions, LogLine) if a.decision is Decision.HAZARD]


def test_the_tick_says_a_bypass_once_at_warning_and_once_more_when_it_has_gone():
    """Through the real tick.decide: one hazard line per (replica, peer), with its rule and key."""
    box, said = Box(cfg(), proxy_reports=False), []
    for now, v in [(100.0, view(JOB, NGINX)), (120.0, view(JOB, NGINX)), (130.0, view(JOB, NGINX)),
                   (140.0, view(JOB, NGINX)), (150.0, view(NGINX))]:
        said += [(now, a) for a in hazard_lines(box.tick(now, a=answering(now, v)))]
        if now == 140.0:
            assert [(b.replica, b.peer) for b in box.core.bypassing] == [("a", "batch.service")]
    assert [(t, a.priority, a.rule, a.hazard) for t, a in said] == [
        (130.0, Priority.WARNING, "B2", "bypass:a:batch.service"),
        (150.0, Priority.INFO, "B2", "bypass:a:batch.service"),
    ]
    assert "point it at the proxy" in said[0][1].message and box.core.bypassing == ()


def test_with_only_drain_commands_the_proxys_address_is_unknown_and_no_client_is_a_bypass():
    c = Config(
        replicas=[ReplicaConfig(name="a", unit="vllm-a.service", url="http://127.0.0.1:8001", model="m")],
        watchdog=WatchdogConfig(bypass_after_s=30),
        proxy=ProxyConfig(drain_command=["/usr/local/bin/drain"]),
    )
    remote_proxy = Peer(PeerKind.OTHER, "10.0.0.5", 8)
    assert run(c, [(100.0, view(remote_proxy)), (200.0, view(remote_proxy))]) == []
    c2 = c.model_copy(update={"watchdog": WatchdogConfig(bypass_after_s=30, proxy_peers=["10.0.0.5"])})
    assert [b.peer for b in run(c2, [(100.0, view(JOB)), (200.0, view(JOB))])] == ["batch.service"]


def test_a_look_without_the_kernels_view_does_not_say_a_bypass_gone_and_back():
    box, said = Box(cfg(), proxy_reports=False), []
    for now, v in [(100.0, view(JOB)), (130.0, view(JOB)), (132.0, None), (134.0, view(JOB))]:
        said += [a.message for a in hazard_lines(box.tick(now, a=answering(now, v)))]
    assert len(said) == 1 and "point it at the proxy" in said[0], said
    assert [b.peer for b in box.core.bypassing] == ["batch.service"]


def test_b3_a_look_without_a_view_keeps_who_was_bypassing():
    found = run(cfg(), [(100.0, view(JOB)), (130.0, view(JOB)), (132.0, None)])
    assert [(b.replica, b.peer, b.since) for b in found] == [("a", "batch.service", 100.0)]
