"""The Ray Serve request router of the realtime replicas: cache affinity, then headroom.

Ray Serve's proxy turns the ``serve_multiplexed_model_id`` header of a WebSocket handshake into
the request's multiplexed model id, which is what this router sees before the first frame; the
replicas report their room and the contexts they hold as routing stats
(``DuplexReplica.record_routing_stats``, every ``app.ROUTING_STATS_PERIOD_S``). The decision
itself is :func:`duplexcache.cluster.placement.place`. A header ``replica:<id>`` pins a request
to one replica (scraping each replica's ``/metrics``); if that replica takes no requests (gone,
draining) another one answers, and its ``/health`` (``replica``) and ``/metrics``
(``target_info``) say which.

A WebSocket stays on its replica for its whole life (it is one long request), so placement is
sticky by construction. Stats are seconds old while a burst of sessions is placed in
milliseconds: the router counts what it sent in the last few report periods against the replica
(a context it sent is "held", every send -- with a context or without -- takes one slot of room)
until the replica's own report surely includes it; one router per proxy, so with several proxies
each counts its own sends.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from duplexcache.cluster.placement import PIN_PREFIX, ReplicaLoad, place, with_sent

logger = logging.getLogger(__name__)


def replica_load(replica: RunningReplica) -> ReplicaLoad | None:
    """The load a replica reported (None before its first report: it is still warming up)."""
    stats: dict[str, Any] = replica.routing_stats or {}
    if "headroom" not in stats:
        return None
    return ReplicaLoad(replica.replica_id.unique_id, int(stats["headroom"]),
                       frozenset(stats.get("context_keys", ())), bool(stats.get("draining", False)))


class CacheAffinityRouter(RequestRouter):
    def initialize_state(self, sent_ttl_s: float = 3.0, **kwargs: Any) -> None:
        # A send counts against its replica until that replica has surely reported it: a report
        # may have been taken just before the session's handshake arrived (request_router_kwargs
        # sets it to a few routing-stats periods).
        self._sent_ttl_s = sent_ttl_s
        self._sent: dict[str, list[tuple[float, str]]] = {}   # replica -> (time, key) of recent sends
        self._placements = None
        try:
            from ray.util.metrics import Counter

            self._placements = Counter("duplexcache_placements", "Sessions placed, by reason",
                                       tag_keys=("reason",))
        except Exception:  # noqa: BLE001 - metrics are optional; the log line still says it
            logger.debug("ray metrics unavailable: placements are only logged")

    def _recent_sends(self) -> dict[str, list[str | None]]:
        cutoff = time.monotonic() - self._sent_ttl_s
        for rid in list(self._sent):
            self._sent[rid] = [(t, key) for t, key in self._sent[rid] if t >= cutoff]
        return {rid: [key for _, key in sends] for rid, sends in self._sent.items()}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        key = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if key.startswith(PIN_PREFIX):
            pinned = by_id.get(key[len(PIN_PREFIX):])
            if pinned is not None:
                return [[pinned]]
            # gone or draining: answer from another one (its /health and /metrics name it), not hang
            logger.warning("request pinned to replica %r, which takes no requests (running: %s)",
                           key[len(PIN_PREFIX):], sorted(by_id))
            return [candidate_replicas]
        loads = [load for load in map(replica_load, candidate_replicas) if load is not None]
        if not loads:  # nobody has reported yet: any replica (its own admission decides)
            return [candidate_replicas]
        choice = place(key or None, with_sent(loads, self._recent_sends()))
        # Every placement takes a slot of room until the replica's report includes it, keyed or
        # not: a burst of handshakes without a placement header all saw the same room and landed
        # on one replica while the other sat idle. The router cannot tell such a handshake from
        # an unpinned GET of /health (Ray hands it neither the path nor the scope type), so a
        # probe holds a slot for sent_ttl_s too: pessimistic by a few slots, never overbooked.
        self._sent.setdefault(choice.replica, []).append((time.monotonic(), key or None))
        logger.info("placed a request with context %s on replica %s (%s)", key or "(none)", choice.replica,
                    choice.reason)
        if self._placements is not None:
            self._placements.inc(tags={"reason": choice.reason})
        return [[by_id[choice.replica]]]
