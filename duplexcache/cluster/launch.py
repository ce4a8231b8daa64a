"""``duplexcache serve --replicas N``: a local Ray instance (or the one ``RAY_ADDRESS`` names),
Ray Serve's proxy on ``server.host:server.port``, N replicas; Ctrl-C or SIGTERM drains and stops."""

from __future__ import annotations

import logging
import os
import signal
import threading

from duplexcache.config import DeployConfig

logger = logging.getLogger(__name__)

APP_NAME = "duplexcache"


def serve_replicas(deploy: DeployConfig) -> int:
    import ray
    from ray import serve

    from duplexcache.cluster.app import build_app
    from duplexcache.cluster.proxy import proxy_env
    from duplexcache.cluster.summary import start_summary, stop_summary

    # a CUDA replica holds one GPU; on CPU the replicas take no CPU reservation (torch's threads)
    # proxy_env: Serve's proxies wrap themselves in cluster/proxy.py (replica_lost to the client)
    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, configure_logging=False,
             runtime_env={"env_vars": proxy_env()})
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        start_summary()
        serve.start(http_options={"host": deploy.server.host, "port": deploy.server.port})
        serve.run(build_app(deploy), name=APP_NAME, route_prefix="/")
        logger.info("serving %d replica(s) of preset %s on ws://%s:%d/v1/realtime (Ray Serve); Ctrl-C stops",
                    deploy.cluster.replicas, deploy.model.preset, deploy.server.host, deploy.server.port)
        stop.wait()
        logger.info("stopping: live sessions may finish for up to %.0f s (cluster.drain_timeout_s)",
                    deploy.cluster.drain_timeout_s)
    finally:
        serve.shutdown()
        stop_summary()
        ray.shutdown()
    return 0
