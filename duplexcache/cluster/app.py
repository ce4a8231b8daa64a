"""The Ray Serve application: N :class:`~duplexcache.cluster.replica.DuplexReplica` behind Ray's
proxy, placed by :class:`~duplexcache.cluster.router.CacheAffinityRouter`.

``build_app(deploy)`` is what ``duplexcache serve --replicas N`` runs; ``app``/``build_app_from_args``
(``duplexcache/cluster/__init__.py``) are the import paths for ``serve run`` on a Ray cluster of
one's own.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

from duplexcache.cluster.replica import DuplexReplica
from duplexcache.config import ConfigError, DeployConfig

DEPLOYMENT_NAME = "DuplexReplica"
# Ray's graceful wait between the drain timeout and a forced kill (the app's lifespan closes the
# sessions with 1001 and shuts the engine down in this time).
SHUTDOWN_MARGIN_S = 30.0
# A replica takes as many WebSockets as this (its own admission refuses or queues sessions
# beyond its room; Ray must not queue the handshakes in front of it).
MAX_ONGOING_REQUESTS = 4096
# How often each replica reports its room and the contexts it holds to the routers
# (DuplexReplica.record_routing_stats). Placement needs stats no older than a session's opening
# takes (a context prefill runs over ticks of a second), while the router counts its own sends
# of the last few periods against a replica, so a burst placed between two reports is not sent
# to one replica; a report costs one admission_room() call. The deploy key
# cluster.routing_stats_period_s until issue 44 (docs/engine.md, "Retired switches").
ROUTING_STATS_PERIOD_S = 1.0


def deployment_options(deploy: DeployConfig) -> dict[str, Any]:
    """Ray Serve options of the replica deployment, all from ``deploy`` (``cluster:`` section)."""
    cluster = deploy.cluster
    gpus = 1 if deploy.model.device.startswith("cuda") else 0
    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "ray_actor_options": {"num_gpus": gpus, "num_cpus": 0 if gpus == 0 else 1},
        "max_ongoing_requests": MAX_ONGOING_REQUESTS,
        "graceful_shutdown_wait_loop_s": 1.0,
        "graceful_shutdown_timeout_s": cluster.drain_timeout_s + SHUTDOWN_MARGIN_S,
        "health_check_period_s": 2.0,
        "request_router_config": RequestRouterConfig(
            request_router_class="duplexcache.cluster.router:CacheAffinityRouter",
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=max(5.0, 2 * ROUTING_STATS_PERIOD_S),
            # a send counts until the replica surely reported it (report + controller push + slack)
            request_router_kwargs={"sent_ttl_s": max(5.0, 4 * ROUTING_STATS_PERIOD_S + 2.0)}),
    }
    if cluster.max_replicas is None:
        options["num_replicas"] = cluster.replicas
    else:
        if cluster.max_replicas < cluster.replicas:
            raise ConfigError(f"cluster.max_replicas {cluster.max_replicas} < cluster.replicas {cluster.replicas}")
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=cluster.replicas, max_replicas=cluster.max_replicas, initial_replicas=cluster.replicas,
            policy=AutoscalingPolicy(policy_function="duplexcache.cluster.autoscale:SessionUtilisationPolicy",
                                     policy_kwargs={"target_utilisation": cluster.target_utilisation}))
    return options


def build_app(deploy: DeployConfig) -> Any:
    """The bound Ray Serve application for ``deploy`` (run it with ``serve.run``)."""
    ingress = serve.ingress()(DuplexReplica)
    deployment = serve.deployment(ingress, **deployment_options(deploy))
    # without the cluster section: changing the replica count is then a scale, not a redeploy
    return deployment.bind(deploy.model_dump(mode="json", exclude={"cluster"}) | {"cluster": _replica_view(deploy)})


def _replica_view(deploy: DeployConfig) -> dict[str, Any]:
    """What a replica reads of ``cluster:`` (the drain limit); the counts stay out of its arguments."""
    return {"drain_timeout_s": deploy.cluster.drain_timeout_s}
