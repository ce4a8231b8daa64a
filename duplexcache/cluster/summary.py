"""The cluster summary behind every replica's ``/health``: one small named Ray actor that the
replicas report to with their routing stats (sessions, room, free bytes, late ticks)."""

from __future__ import annotations

import time
from typing import Any

import ray

SUMMARY_ACTOR = "duplexcache-cluster-summary"
SUMMARY_NAMESPACE = "duplexcache"
STALE_AFTER_S = 5.0      # a replica that has not reported for this long is shown as stale
FORGET_AFTER_S = 60.0    # ... and dropped after this long (it was scaled down or died)


@ray.remote(num_cpus=0)
class ClusterSummary:
    def __init__(self) -> None:
        self._rows: dict[str, tuple[float, dict[str, Any]]] = {}

    def report(self, replica: str, row: dict[str, Any]) -> None:
        self._rows[replica] = (time.monotonic(), row)

    def summary(self) -> dict[str, Any]:
        now = time.monotonic()
        replicas = {}
        for replica, (seen, row) in list(self._rows.items()):
            age = now - seen
            if age > FORGET_AFTER_S:
                del self._rows[replica]
                continue
            replicas[replica] = {**row, "age_s": round(age, 2), "stale": age > STALE_AFTER_S}
        fresh = [row for row in replicas.values() if not row["stale"]]
        return {"replicas": replicas,
                "live_sessions": sum(row["live_sessions"] for row in fresh),
                "headroom": sum(row["headroom"] for row in fresh),
                "late_ticks": sum(row["late_ticks"] for row in fresh)}


def start_summary() -> Any:
    """The summary actor, started if it is not running (detached: it outlives the driver that
    started it until ``stop_summary``)."""
    return ClusterSummary.options(name=SUMMARY_ACTOR, namespace=SUMMARY_NAMESPACE, lifetime="detached",
                                  get_if_exists=True).remote()


def stop_summary() -> None:
    try:
        ray.kill(ray.get_actor(SUMMARY_ACTOR, namespace=SUMMARY_NAMESPACE))
    except ValueError:
        pass
