"""Autoscaling on live-session utilisation (a Ray Serve custom autoscaling policy).

Ray's default policy scales on ongoing requests; for realtime sessions a request is a whole call
and a replica's capacity is what its admission says (memory and measured tick cost), so this
policy reads the replicas' own figures (``DuplexReplica.record_autoscaling_stats``): the
replicas needed are ``ceil(live / (admissible per replica x target_utilisation))``, within
``[min_replicas, max_replicas]``, never dropping more than one replica per decision (a drain
takes up to ``cluster.drain_timeout_s``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def replicas_needed(live: Mapping[Any, float], admissible: Mapping[Any, float], current: int,
                    target_utilisation: float, min_replicas: int, max_replicas: int) -> int:
    """The replica count for the reported per-replica figures (see the module docstring)."""
    if not live or not admissible:
        return max(min_replicas, min(max_replicas, current))
    per_replica = sum(admissible.values()) / len(admissible)
    if per_replica <= 0:   # every reporting replica is full or failed: grow by one
        return max(min_replicas, min(max_replicas, current + 1))
    needed = math.ceil(sum(live.values()) / (per_replica * target_utilisation))
    needed = max(needed, current - 1)
    return max(min_replicas, min(max_replicas, needed))


class SessionUtilisationPolicy:
    """Instantiated once by Ray Serve with ``policy_kwargs``; called every autoscaling period."""

    def __init__(self, target_utilisation: float = 0.75) -> None:
        if not 0 < target_utilisation <= 1:
            raise ValueError(f"target_utilisation must be in (0, 1], got {target_utilisation}")
        self.target_utilisation = target_utilisation

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        target = replicas_needed(metrics.get("live_sessions", {}), metrics.get("admissible_sessions", {}),
                                 ctx.current_num_replicas, self.target_utilisation,
                                 ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas)
        return target, {}
