"""CacheAffinityRouter.choose_replicas on fake replicas (Ray's router machinery is not started:
the method reads only the replicas' ids and routing stats and the request's multiplexed id)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve.request_router", reason="the cluster extra is not installed")
from duplexcache.cluster.router import CacheAffinityRouter  # noqa: E402


def _replica(rid: str, stats: dict | None):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid), routing_stats=stats)


def _request(key: str):
    return SimpleNamespace(metadata=SimpleNamespace(multiplexed_model_id=key))


class _Counter:
    def __init__(self):
        self.seen = []

    def inc(self, tags):
        self.seen.append(tags["reason"])


def _router(ttl: float = 60.0) -> CacheAffinityRouter:
    router = CacheAffinityRouter.__new__(CacheAffinityRouter)   # no Ray controller behind it
    router.initialize_state(sent_ttl_s=ttl)
    router._placements = _Counter()
    return router


def _choose(router, replicas, key):
    (chosen,) = asyncio.run(router.choose_replicas(replicas, _request(key)))
    return [r.replica_id.unique_id for r in chosen]


def test_a_burst_lands_by_context_and_every_choice_is_counted():
    router = _router()
    replicas = [_replica("a", {"headroom": 10, "context_keys": []}),
                _replica("b", {"headroom": 10, "context_keys": []})]
    picks = [_choose(router, replicas, key) for key in ("k1", "k2", "k1", "k2", "k1")]
    assert picks == [["a"], ["b"], ["a"], ["b"], ["a"]]
    assert router._placements.seen == ["new_context", "new_context", "affinity", "affinity", "affinity"]


def test_sends_expire_once_the_replicas_must_have_reported_them():
    router = _router(ttl=0.0)
    replicas = [_replica("a", {"headroom": 10, "context_keys": []}),
                _replica("b", {"headroom": 10, "context_keys": []})]
    assert _choose(router, replicas, "k1") == ["a"] and _choose(router, replicas, "k2") == ["a"]


def test_pins_unreported_replicas_and_keyless_requests():
    router = _router()
    replicas = [_replica("a", {"headroom": 1, "context_keys": ["k1"]}), _replica("b", None)]
    assert _choose(router, replicas, "replica:b") == ["b"]          # pinned, stats or not
    assert _choose(router, replicas, "replica:gone") == ["a", "b"]  # gone: any answers (and names itself)
    assert _choose(router, replicas, "k2") == ["a"]                 # b has not reported: left out
    assert _choose(router, replicas, "") == ["a"]                   # no header: a (its one slot went to k2)
    assert router._placements.seen == ["new_context", "all_full"]
    assert _choose(router, [_replica("x", None)], "k1") == ["x"]    # nobody reported: any replica
    draining = [_replica("a", {"headroom": 5, "context_keys": ["k1"], "draining": True}),
                _replica("b", {"headroom": 1, "context_keys": []})]
    assert _choose(router, draining, "k1") == ["b"]


def test_a_burst_without_placement_headers_is_spread_by_room():
    """Issue 46: four stock clients connecting at once (no placement header) all landed on one
    replica: only keyed sends were counted against its room. 8 unkeyed handshakes split 4 and 4."""
    router = _router()
    replicas = [_replica("a", {"headroom": 10, "context_keys": []}),
                _replica("b", {"headroom": 10, "context_keys": []})]
    picks = [_choose(router, replicas, "")[0] for _ in range(8)]
    assert sorted(picks.count(r) for r in "ab") == [4, 4], picks
    assert router._placements.seen == ["no_key"] * 8
