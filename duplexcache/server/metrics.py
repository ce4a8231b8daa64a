"""Prometheus metrics of one server, fed from engine stats snapshots and server-side events.

Each :class:`ServerMetrics` has its own ``CollectorRegistry`` (not the process-global one), so
several apps in one process (tests, a Ray Serve replica) do not collide.

The engine reports cumulative counts; :meth:`ServerMetrics.update` turns them into Prometheus
counter increments by remembering the last snapshot, and observes a tick's stage latencies
exactly once (keyed by ``EngineStats.ticks``), so it may be called by both the tick loop and a
``/metrics`` scrape.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from duplexcache.runtime.engine_api import TIERS, EngineStats

logger = logging.getLogger(__name__)

PREFIX = "duplexcache_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# EngineStats counter field -> metric attribute name on ServerMetrics
_ENGINE_COUNTERS = ("context_cache_hits", "context_cache_misses", "cfm_fallbacks", "early_closes",
                    "reference_voices_added", "reference_voice_reuses", "window_compactions")
GRAPH_CAPTURE_PLACES = ("warmup", "tick")


class ServerMetrics:
    def __init__(self, target_info: dict[str, str] | None = None) -> None:
        # target_info: labels naming this server (a Ray Serve replica's id), exported as target_info
        self.registry = CollectorRegistry(auto_describe=True, target_info=target_info)
        r = self.registry
        self.live_sessions = Gauge(PREFIX + "live_sessions", "Sessions admitted and running", registry=r)
        self.queued_sessions = Gauge(PREFIX + "queued_sessions", "Sessions waiting for admission", registry=r)
        self.connections = Gauge(PREFIX + "connections", "Open WebSocket connections", registry=r)
        self.bytes = Gauge(PREFIX + "bytes", "Bytes per memory pool and tier (shared counted once)",
                           ["pool", "tier"], registry=r)
        self.context_cache_hits = Counter(PREFIX + "context_cache_hits", "Cross-session context cache hits",
                                          registry=r)
        self.context_cache_misses = Counter(PREFIX + "context_cache_misses",
                                            "Cross-session context cache misses", registry=r)
        self.cfm_fallbacks = Counter(PREFIX + "cfm_fallbacks",
                                     "Prompt-state rows that diverged and fell back to per-session tensors",
                                     registry=r)
        self.late_ticks = Counter(PREFIX + "late_ticks", "Ticks that started after their deadline", registry=r)
        self.catch_up_ticks = Counter(PREFIX + "catch_up_ticks", "Extra ticks run for sessions behind real time "
                                      "(scheduler.catch_up_ticks)", registry=r)
        self.prefill_chunks_between_ticks = Counter(
            PREFIX + "prefill_chunks_between_ticks", "Prefill chunks run before a tick instead of inside it "
            "(scheduler.prefill_between_ticks)", registry=r)
        self.early_closes = Counter(PREFIX + "early_closes", "Units closed with silence at the first tick after "
                                    "their caller's turn ended (scheduler.tick_phases > 1)", registry=r)
        self.reference_voices = Gauge(PREFIX + "reference_voices", "Voices made from clients' reference "
                                      "recordings, held now (engine.max_reference_voices)", registry=r)
        self.reference_voices_added = Counter(PREFIX + "reference_voices_added", "Reference recordings made into "
                                              "voices (one Code2Wav prompt pass each)", registry=r)
        self.reference_voice_reuses = Counter(PREFIX + "reference_voice_reuses", "Sessions given a voice already "
                                              "made from the same recording (its state shared)", registry=r)
        self.window_compactions = Counter(PREFIX + "window_compactions", "Thinker window compactions (the "
                                          "anchor kept, whole blocks after it dropped), every session", registry=r)
        self.tick_errors = Counter(PREFIX + "tick_errors", "Ticks that raised an exception", registry=r)
        self.protocol_errors = Counter(PREFIX + "protocol_errors", "Error events sent to clients",
                                       ["code"], registry=r)
        self.responses = Counter(PREFIX + "responses", "Replies ended, by status (completed, cancelled)",
                                 ["status"], registry=r)
        self.limit_closes = Counter(PREFIX + "limit_closes", "Sessions ended by a server limit "
                                    "(idle_timeout_s, max_session_s)", ["reason"], registry=r)
        self.tick_duration = Histogram(PREFIX + "tick_duration_seconds", "Wall time of one engine tick",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.between_tick_duration = Histogram(
            PREFIX + "between_tick_duration_seconds", "Wall time of a tick between unit ticks that ran units "
            "(scheduler.tick_phases > 1: the turns that just ended; what the room test must predict)",
            buckets=LATENCY_BUCKETS, registry=r)
        self.stage_latency = Histogram(PREFIX + "stage_latency_seconds", "Per-stage latency within a tick",
                                       ["stage"], buckets=LATENCY_BUCKETS, registry=r)
        self.graph_captures = Counter(PREFIX + "graph_captures",
                                      "CUDA graphs captured (decode + Code2Wav), by where: warmup or tick "
                                      "(a warm engine captures nothing inside a tick)", ["where"], registry=r)
        self.warmup_seconds = Gauge(PREFIX + "warmup_seconds", "How long the engine's warm-up took", registry=r)
        self.cfm_prompt_passes = Counter(PREFIX + "cfm_prompt_passes",
                                         "Code2Wav voice-prompt setup passes, by voice (one per registered "
                                         "voice; a growing count means turn starts pay the pass again)",
                                         ["voice"], registry=r)
        self.device_bytes = Gauge(PREFIX + "device_bytes", "The card waterfall after the warm-up: device bytes "
                                  "by part, adding up to the device total (runtime/memory/waterfall.py)", ["part"], registry=r)
        self.device_total_bytes = Gauge(PREFIX + "device_total_bytes", "The device total the waterfall's parts add "
                                        "up to (CUDA: mem_get_info's total; CPU: weights + the memory budget)",
                                        registry=r)
        self.admitted_over_floor_limited = Gauge(
            PREFIX + "admitted_over_floor_limited", "Sessions admission takes / (device total - weights) / the "
            "floor bytes of one session", registry=r)
        self.memory_in_use = Gauge(PREFIX + "memory_in_use_bytes", "Memory the serving process holds now, read at "
                                   "each /metrics scrape (CUDA: torch's allocated and reserved bytes and the card's "
                                   "used bytes; CPU: the resident set)", ["kind"], registry=r)
        for where in GRAPH_CAPTURE_PLACES:   # export 0 before the first capture
            self.graph_captures.labels(where=where)
        self._last_captures = dict.fromkeys(GRAPH_CAPTURE_PLACES, 0)
        self._last_counts = {name: 0 for name in _ENGINE_COUNTERS}
        self._last_tick = 0
        self._last_prompt_passes: dict[str, int] = {}

    def update(self, stats: EngineStats) -> None:
        """Bring every engine-fed metric up to ``stats``."""
        self.live_sessions.set(stats.live_sessions)
        self.queued_sessions.set(stats.queued_sessions)
        self.reference_voices.set(stats.reference_voices)
        for pool, tiers in stats.pools.items():
            for tier in TIERS:
                self.bytes.labels(pool=pool, tier=tier).set(getattr(tiers, tier))
        for name in _ENGINE_COUNTERS:
            value = getattr(stats, name)
            delta = value - self._last_counts[name]
            if delta < 0:
                # The engine's counters went backwards (restarted?); take the new baseline.
                logger.warning("engine counter %s went backwards (%d -> %d)", name, self._last_counts[name], value)
            elif delta:
                getattr(self, name).inc(delta)
            self._last_counts[name] = value
        for where, value in stats.graph_captures.items():
            if where not in self._last_captures:
                logger.warning("unknown graph capture place %r in engine stats", where)
                continue
            delta = value - self._last_captures[where]
            if delta > 0:
                self.graph_captures.labels(where=where).inc(delta)
            self._last_captures[where] = value   # a counter that went backwards is a new baseline
        for voice, value in stats.cfm_prompt_passes.items():
            delta = value - self._last_prompt_passes.get(voice, 0)
            if delta > 0:
                self.cfm_prompt_passes.labels(voice=voice).inc(delta)
            self._last_prompt_passes[voice] = value
        if stats.warmup_seconds is not None:
            self.warmup_seconds.set(stats.warmup_seconds)
        if stats.ticks > self._last_tick:
            for stage, samples in stats.stage_latency_s.items():
                child = self.stage_latency.labels(stage=stage)
                for seconds in samples:
                    child.observe(seconds)
            self._last_tick = stats.ticks

    def set_waterfall(self, wf: Any) -> None:
        """Export a card waterfall (runtime/memory/waterfall.py ``Waterfall``): one gauge child per part."""
        for part in wf.parts:
            self.device_bytes.labels(part=part.name).set(part.bytes)
        self.device_total_bytes.set(wf.total_bytes)
        if wf.ratio is not None:
            self.admitted_over_floor_limited.set(wf.ratio)

    def sample_memory(self, device: str) -> None:
        """Set ``memory_in_use_bytes`` to what ``device`` holds now (a soak plots it over a call)."""
        for kind, value in memory_in_use(device).items():
            self.memory_in_use.labels(kind=kind).set(value)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def memory_in_use(device: str) -> dict[str, int]:
    """Bytes held now: on CUDA torch's ``allocated`` and ``reserved`` and the card's ``device_used``
    (total - free, every process); on the CPU this process's ``resident`` set (Linux; empty elsewhere)."""
    if device.startswith("cuda"):
        import torch

        dev = torch.device(device)
        free, total = torch.cuda.mem_get_info(dev)
        return {"allocated": torch.cuda.memory_allocated(dev), "reserved": torch.cuda.memory_reserved(dev),
                "device_used": total - free}
    try:
        with open("/proc/self/statm") as f:
            return {"resident": int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")}
    except (OSError, ValueError, AttributeError):
        return {}
