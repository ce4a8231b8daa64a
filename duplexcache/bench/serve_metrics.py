"""What ``duplexcache bench serve`` reads from the server's ``/metrics``: the counters a step
reports (their differences over the step) and the per-stage tick latency histogram; behind a
cluster, the sum over every replica's own ``/metrics`` (docs/deploy.md).
"""

from __future__ import annotations

import logging
from typing import Any

from duplexcache.server.protocol import PLACEMENT_HEADER

logger = logging.getLogger("duplexcache.bench.serve")   # the benchmark's one logger name


def delta(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else after - before


# The server counters a step reports (their differences over the step), by a part of the family name.
COUNTERS = {"late_ticks": "late_tick", "graph_captures": "graph_capture", "catch_up_ticks": "catch_up_tick",
            "prefill_chunks_between_ticks": "prefill_chunks_between", "early_closes": "early_closes"}


def no_counters() -> dict[str, float | None]:
    return dict.fromkeys(COUNTERS)


def counters(metrics_text: str) -> dict[str, float | None]:
    """Sums of the ``late_ticks``-, ``graph_capture``- and ``catch_up_tick``-like counters
    (None: none exported)."""
    from prometheus_client.parser import text_string_to_metric_families

    found = no_counters()
    for family in text_string_to_metric_families(metrics_text):
        key = next((k for k, part in COUNTERS.items() if part in family.name), None)
        if key is None:
            continue
        total = sum(s.value for s in family.samples if s.name in (family.name, family.name + "_total"))
        found[key] = (found[key] or 0.0) + total
    return found


STAGE_HISTOGRAM = "stage_latency_seconds"   # the server's per-stage tick latency (server/metrics.py)
BETWEEN_HISTOGRAM = "between_tick_duration_seconds"   # its ticks between unit ticks that ran units


def stage_totals(metrics_text: str) -> dict[str, float]:
    """``stage_sum:<stage>`` and ``stage_count:<stage>`` of the server's per-stage latency
    histogram (seconds, ticks), and ``between_sum`` / ``between_count`` of its ticks between unit
    ticks that ran units; empty when it exports neither."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name.endswith(BETWEEN_HISTOGRAM):
            for s in family.samples:
                kind = s.name.rsplit("_", 1)[-1]
                if kind in ("sum", "count"):
                    found[f"between_{kind}"] = found.get(f"between_{kind}", 0.0) + s.value
            continue
        if not family.name.endswith(STAGE_HISTOGRAM):
            continue
        for s in family.samples:
            stage, kind = s.labels.get("stage"), s.name.rsplit("_", 1)[-1]
            if stage and kind in ("sum", "count"):
                key = f"stage_{kind}:{stage}"
                found[key] = found.get(key, 0.0) + s.value
    return found


def stage_ms_mean(before: dict, after: dict) -> dict[str, float] | None:
    """Each stage's mean ms per tick over a step, from the histogram's sums and counts (None when
    the server exports no stage histogram or ran no tick)."""
    out = {}
    for key in after:
        if not key.startswith("stage_sum:"):
            continue
        stage = key.split(":", 1)[1]
        total = delta(after[key], before.get(key))
        ticks = delta(after.get(f"stage_count:{stage}"), before.get(f"stage_count:{stage}"))
        if total is not None and ticks:
            out[stage] = round(total / ticks * 1e3, 1)
    return out or None


def between_tick_ms_mean(before: dict, after: dict) -> float | None:
    """Mean ms of the server's ticks between unit ticks that ran units (``scheduler.tick_phases``
    > 1) over a step; None when it exports no such histogram or ran none."""
    total = delta(after.get("between_sum"), before.get("between_sum"))
    ticks = delta(after.get("between_count"), before.get("between_count"))
    return round(total / ticks * 1e3, 1) if total is not None and ticks else None


def _scraped(metrics_text: str) -> dict[str, float | None]:
    return {**counters(metrics_text), **stage_totals(metrics_text)}


async def http_get(client: Any, url: str) -> Any:
    response = await client.get(url, timeout=10.0)
    response.raise_for_status()
    return response


async def scrape(client: Any, base: str) -> dict[str, float | None]:
    """The server's counters; behind a cluster (``duplexcache serve --replicas``, whose ``/health``
    lists the replicas) the sum over every replica's own ``/metrics`` (docs/deploy.md)."""
    try:
        replicas = await _cluster_replicas(client, base)
        if not replicas:
            return _scraped((await http_get(client, base + "/metrics")).text)
        total = no_counters()
        for replica in replicas:
            pin = {PLACEMENT_HEADER: f"replica:{replica}"}   # the router sends it to that replica
            response = await client.get(base + "/metrics", timeout=10.0, headers=pin)
            response.raise_for_status()
            for key, value in _scraped(response.text).items():
                if value is not None:
                    total[key] = (total.get(key) or 0.0) + value
        return total
    except Exception as exc:  # noqa: BLE001 - a server without /metrics gives nulls, not a failed run
        logger.warning("could not read %s/metrics: %s", base, exc)
        return no_counters()


async def _cluster_replicas(client: Any, base: str) -> list[str]:
    try:
        body = (await http_get(client, base + "/health")).json()
    except Exception:  # noqa: BLE001 - no /health: a plain server
        return []
    return sorted(body.get("cluster", {}).get("replicas", {})) if isinstance(body, dict) else []
