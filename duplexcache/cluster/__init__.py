"""Replicas on Ray Serve (optional: ``pip install duplexcache[cluster]``); see docs/deploy.md.

``serve run duplexcache.cluster:app`` serves the deploy config named by ``DUPLEXCACHE_CONFIG``
(default: the tiny preset); ``serve run duplexcache.cluster:build_app_from_args config=FILE
replicas=N`` takes them as arguments. The one-engine ``duplexcache serve`` never imports this.
"""

from __future__ import annotations

import os
from typing import Any

CONFIG_ENV = "DUPLEXCACHE_CONFIG"


def _deploy(config: str | None, replicas: str | int | None) -> Any:
    from duplexcache.config import DeployConfig

    deploy = DeployConfig.from_yaml(config) if config else DeployConfig.default("tiny")
    if replicas is not None:
        deploy.cluster.replicas = int(replicas)
    return deploy


def build_app_from_args(args: dict[str, str]) -> Any:
    """Application builder for ``serve run duplexcache.cluster:build_app_from_args config=... replicas=...``."""
    from duplexcache.cluster.app import build_app

    unknown = set(args) - {"config", "replicas"}
    if unknown:
        raise ValueError(f"unknown arguments {sorted(unknown)} (allowed: config, replicas)")
    return build_app(_deploy(args.get("config"), args.get("replicas")))


def __getattr__(name: str) -> Any:
    if name == "app":   # built on first access, so importing the package needs no Ray
        from duplexcache.cluster.app import build_app

        return build_app(_deploy(os.environ.get(CONFIG_ENV), None))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
