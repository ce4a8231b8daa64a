"""One realtime replica on Ray Serve: an engine and the unchanged FastAPI app as its ingress.

Ray Serve gives the replica its life cycle: the app's lifespan warms the engine up and starts the
tick loop when the replica starts, and stops it (closing every session with 1001) when Ray
shuts the replica down. The replica adds what the cluster needs:

* ``record_routing_stats``: room (``engine.admission_room()``) and the context keys it holds,
  for ``router.CacheAffinityRouter``; also pushed to the cluster summary shown in ``/health``;
* ``record_autoscaling_stats``: live and admissible sessions, for ``autoscale.session_policy``;
* ``check_health``: a failed warm-up or a run of failed ticks makes the replica unhealthy; it
  first sends each session an ``error`` event (``replica_failed``, naming the cause) and closes
  it with 1011, then Ray replaces the replica and new sessions go to the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray
from ray import serve

from duplexcache.cluster.placement import context_key
from duplexcache.cluster.summary import SUMMARY_ACTOR, SUMMARY_NAMESPACE
from duplexcache.config import DeployConfig
from duplexcache.server import protocol as proto
from duplexcache.server.app import create_app
from duplexcache.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

# Ray Serve's controller actor (its get_serve_instance_details is the REST API's source).
CONTROLLER_ACTOR = "SERVE_CONTROLLER_ACTOR"
SERVE_NAMESPACE = "serve"
DRAIN_POLL_S = 2.0
# This many failed ticks in a row: the engine is broken, the replica reports itself unhealthy.
FAILED_TICKS_UNHEALTHY = 3
# A context stays "held" this long after its last session closed (its context-cache entry and
# anchor blocks usually outlive the session, so the next caller with it still gains).
RECENT_CONTEXT_S = 600.0
MAX_RECENT_CONTEXTS = 256


class DuplexReplica:
    """The deployment class (cluster/app.py wraps it with ``serve.deployment`` and ``serve.ingress``)."""

    def __init__(self, deploy: dict[str, Any]) -> None:
        from duplexcache.runtime.engine import build_engine

        self.deploy = DeployConfig.from_dict(deploy, environ={})
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.engine = build_engine(self.deploy)
        self.asgi_app = create_app(self.engine, self.deploy, ServerMetrics(target_info={"replica": self.replica_id}))
        self.server = self.asgi_app.state.server
        # resume tokens name this replica, so the proxy sends a resume here (cluster/proxy.py)
        self.server.resumes.route_prefix = self.replica_id
        self.asgi_app.state.health_extras.append(self._cluster_health)
        self._recent: dict[str, float] = {}     # context key -> last time a session held it
        self._seq = 0
        self._failed: str | None = None
        self._summary: Any = None
        self._drain_watch: asyncio.Task[None] | None = None
        self.draining = False
        logger.info("replica %s: engine ready (%s)", self.replica_id, self.engine.describe_plan())

    def __serve_build_asgi_app__(self) -> Any:
        return self.asgi_app

    # ---------------------------------------------------------------- what the router reads

    def context_keys(self) -> list[str]:
        now = time.monotonic()
        revision = self.deploy.model.revision
        for instructions, voice in self.server.session_contexts():
            self._recent[context_key(instructions, voice, revision)] = now
        for key in self.server.placement_keys():   # connected, not opened yet: the router's word
            self._recent[key] = now
        for key, seen in list(self._recent.items()):
            if now - seen > RECENT_CONTEXT_S:
                del self._recent[key]
        if len(self._recent) > MAX_RECENT_CONTEXTS:
            for key in sorted(self._recent, key=self._recent.get)[:-MAX_RECENT_CONTEXTS]:
                del self._recent[key]
        return sorted(self._recent)

    def load(self) -> dict[str, Any]:
        live = len(self.engine.session_ids())
        room = self.engine.admission_room()
        opening = max(0, self.server.num_connections - live)   # connected, engine session not open yet
        ready = self.server.ready and self._failed is None
        self._seq += 1
        return {"seq": self._seq, "headroom": max(0, room.sessions - opening) if ready else 0, "limit": room.limit,
                "live_sessions": live, "admissible": live + room.sessions,
                "connections": self.server.num_connections, "late_ticks": self.engine.late_ticks,
                "context_keys": self.context_keys(), "draining": self.draining,
                "status": ("draining" if self.draining else self.server.warm_state) if ready else "failed"}

    async def record_routing_stats(self) -> dict[str, Any]:
        if self._drain_watch is None:   # the first call runs on the replica's event loop
            self._drain_watch = asyncio.create_task(self._watch_for_drain(), name="duplexcache-drain-watch")
        load = self.load()
        self._push_summary(load)
        return load

    # ---------------------------------------------------------------- draining

    async def _watch_for_drain(self) -> None:
        """Ray stops routing to a replica it scales down and waits for its requests; a WebSocket
        is one long request, so the replica bounds the wait itself: once the controller lists it
        as STOPPING, its live sessions get ``cluster.drain_timeout_s``, then an ``error`` event
        (``replica_draining``) and close 1001. Ray's own kill comes SHUTDOWN_MARGIN_S later."""
        try:
            controller = ray.get_actor(CONTROLLER_ACTOR, namespace=SERVE_NAMESPACE)
        except ValueError:  # no Serve controller (a test harness): Ray's own drain only
            logger.warning("replica %s: no Serve controller to watch; sessions last until Ray stops the replica",
                           self.replica_id)
            return
        failures = 0
        while True:
            await asyncio.sleep(DRAIN_POLL_S)
            try:
                details = await controller.get_serve_instance_details.remote()
            except Exception as exc:  # noqa: BLE001 - a controller restart: keep watching
                failures += 1
                if failures == 1 or failures % 30 == 0:
                    logger.warning("replica %s: reading its state from the controller failed (%d times): %s",
                                   self.replica_id, failures, exc)
                continue
            if (_replica_state(details, self.replica_id) or "").rsplit(".", 1)[-1] == "STOPPING":
                break
        self.draining = True
        limit = self.deploy.cluster.drain_timeout_s
        logger.info("replica %s is draining: %d connection(s) may go on for up to %.0f s (cluster.drain_timeout_s)",
                    self.replica_id, self.server.num_connections, limit)
        deadline = time.monotonic() + limit
        while self.server.num_connections and time.monotonic() < deadline:
            await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        closed = self.server.close_all(
            "replica_draining", f"this replica is being shut down and the session reached the drain limit of "
            f"{limit:g} s (cluster.drain_timeout_s); reconnect to continue on another one", proto.CLOSE_GOING_AWAY)
        logger.info("replica %s drained (%d session(s) closed at the limit)", self.replica_id, closed)

    def record_autoscaling_stats(self) -> dict[str, float]:
        load = self.load()
        return {"live_sessions": float(load["live_sessions"]), "admissible_sessions": float(load["admissible"])}

    # ---------------------------------------------------------------- health

    def check_health(self) -> None:
        if self._failed is None:
            if self.server.warm_state == "warmup_failed":
                self._fail(f"engine warm-up failed: {self.server.warmup_error}")
            elif self.server.failed_ticks_in_a_row >= FAILED_TICKS_UNHEALTHY:
                self._fail(f"{self.server.failed_ticks_in_a_row} engine ticks failed in a row "
                           f"(last: {self.server.last_tick_error})")
        if self._failed is not None:
            raise RuntimeError(f"replica {self.replica_id} failed: {self._failed}")

    def _fail(self, reason: str) -> None:
        self._failed = reason
        closed = self.server.close_all("replica_failed", f"the replica serving this session failed ({reason}); "
                                       "reconnect to be placed on another one", proto.CLOSE_INTERNAL_ERROR)
        logger.error("replica %s failed: %s; closed %d session(s) with an error", self.replica_id, reason, closed)

    # ---------------------------------------------------------------- cluster summary

    def _summary_actor(self) -> Any:
        if self._summary is None:
            try:
                self._summary = ray.get_actor(SUMMARY_ACTOR, namespace=SUMMARY_NAMESPACE)
            except ValueError:   # not started (a replica run outside `duplexcache serve --replicas`)
                return None
        return self._summary

    def _push_summary(self, load: dict[str, Any]) -> None:
        actor = self._summary_actor()
        if actor is not None:
            row = {k: load[k] for k in ("headroom", "live_sessions", "admissible", "late_ticks", "status")}
            row["free_bytes"] = self._free_bytes()
            actor.report.remote(self.replica_id, row)

    def _free_bytes(self) -> int:
        """Unreserved bytes over the engine's pools (from the stats snapshot: never waits on a tick)."""
        return sum(tier.free for tier in self.engine.stats().pools.values())

    async def _cluster_health(self) -> dict[str, Any]:
        actor = self._summary_actor()
        body: dict[str, Any] = {"replica": self.replica_id, "context_keys": self.context_keys()}
        if actor is not None:
            body["cluster"] = await actor.summary.remote()
        return body


def _replica_state(details: dict[str, Any], replica_id: str) -> str | None:
    """This replica's state in the controller's ServeInstanceDetails (None if it is not listed)."""
    for app in details.get("applications", {}).values():
        for deployment in app.get("deployments", {}).values():
            for replica in deployment.get("replicas", []):
                if replica.get("replica_id") == replica_id:
                    return str(replica.get("state"))
    return None
