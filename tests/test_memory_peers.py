"""Peers are counted per model (issue 25's first defect): a memory.peer_urls replica that serves
another model carries none of this one's load, so the only replica of its model is not lowered."""

from __future__ import annotations

import asyncio

from harness import Running, lowerings, run_memguard, with_memory, cfg
from guardian.config import ReplicaConfig
from guardian.core.memory.memguard import MemoryView, ReplicaMemory
from guardian.core.observations import MemorySample
from guardian.core.vocab import MemVerdict, State
from guardian.observe.memory import MemoryObserver
from guardian.observe.probes import make_client
from guardian.observe.systemd import Systemd

GiB = 2**30
TOTAL = 128 * GiB


def _two_models(peer_urls: list[str]):
    config = with_memory(cfg(2), sustain_s=30, peer_urls=peer_urls)
    a, b = config.replicas
    replicas = [ReplicaConfig(**(a.model_dump() | {"model": "m1"})), ReplicaConfig(**(b.model_dump() | {"model": "m2"}))]
    return config.model_copy(update={"replicas": replicas})


async def _observed_peers(config):
    async with make_client() as client:
        return await MemoryObserver(Systemd(), client)._serving_peers(config)


def test_a_peer_url_is_counted_for_the_models_it_serves_only():
    peer = Running("--model", "m2").wait_up()
    try:
        found = asyncio.run(_observed_peers(_two_models([peer.url])))
    finally:
        peer.stop()
    assert found == {"m1": (), "m2": (peer.url,)}


def test_the_only_replica_of_its_model_waits_while_a_peer_serves_another_model():
    config = _two_models(["http://peer:8000"])

    def view() -> MemoryView:
        sample = MemorySample(TOTAL, 5 * GiB, 5 * GiB, None, None)
        replicas = tuple(
            ReplicaMemory(name=n, unit=f"vllm-{n}.service", model=m, fraction=f, running_fraction=f, started_at=0.0,
                          wiring_problem=None, state=State.HEALTHY)
            for n, m, f in (("a", "m1", 0.78), ("b", "m2", 0.70))
        )
        return MemoryView(sample, TOTAL, replicas, peers_serving={"m2": ("http://peer:8000",), "m1": ()})

    track, every, _ = run_memguard(config, [(100, view()), (130, view())])
    assert lowerings(every) == [] and track.verdict is MemVerdict.NO_PEER
    assert any("no other replica of m1 is serving" in line.message for line in every if hasattr(line, "message"))
