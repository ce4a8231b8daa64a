"""Engine statistics: per-stage tick latencies, late ticks, pool bytes per tier, the Code2Wav peak.

The tick thread writes (``record_tick``, ``refresh_pools``, ``note_code2wav_peak``); any thread
reads ``snapshot`` (``DuplexEngine.stats``). The snapshot fields are guarded by the session
table's lock, the one lock ``stats()`` already takes for the session counts, so a snapshot is
consistent with the counts it reports.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping

from duplexcache.cfm.code2wav import BatchedCode2Wav
from duplexcache.context import SessionContextBuilder
from duplexcache.kv.decode_graphs import PagedDecodeGraphs
from duplexcache.kv.talker_blocks import TalkerBlocks
from duplexcache.runtime.engine_api import EngineStats, TierBytes
from duplexcache.runtime.engine_session import SessionTable
from duplexcache.runtime.stage0.runner import Stage0Runner

logger = logging.getLogger(__name__)

STAGES = ("encoder", "vision", "thinker", "talker", "code2wav", "tick")
LATENCY_HISTORY = 4096


class EngineStatsRecorder:
    """What ``DuplexEngine.stats`` reports, kept up to date by the tick thread."""

    def __init__(self, table: SessionTable, stage0: Stage0Runner, talker_kv: TalkerBlocks, talker_block_bytes: int,
                 code2wav: BatchedCode2Wav, voice_names: list[str], builder: SessionContextBuilder,
                 dynamic_bytes: int) -> None:
        self.table = table
        self.stage0 = stage0
        self.talker_kv = talker_kv
        self.talker_block_bytes = talker_block_bytes   # 0 once the engine released the pool
        self.code2wav = code2wav
        self.voice_names = voice_names
        self.builder = builder
        self.dynamic_bytes = dynamic_bytes
        self.ticks = 0
        self.late_ticks = 0
        self.latency_history: dict[str, deque] = {s: deque(maxlen=LATENCY_HISTORY) for s in STAGES}
        self.last_latency: dict[str, tuple[float, ...]] = {}
        self.pools: dict[str, TierBytes] = {}
        self.code2wav_peak = TierBytes(shared=0, private=0, free=dynamic_bytes)

    def finish_tick(self, lat: dict[str, float], period: float) -> None:
        """Record one tick's per-stage seconds (0 for a stage with nothing to do) and refresh
        the pool bytes. A tick over ``period`` is late: logged and counted (back-pressure the
        operator can see)."""
        for stage, value in lat.items():
            self.latency_history[stage].append(value)
        if lat["tick"] > period:
            self.late_ticks += 1
            # (the vision stage only where it ran: audio-only deployments log as before)
            parts = {s: lat.get(s, 0.0) for s in STAGES if s != "tick" and (s != "vision" or lat.get(s))}
            # "other": what the tick did outside the four stages (opening sessions in Stage 0,
            # cancels, prefill chunks run inside the tick, the stats themselves)
            breakdown = ", ".join(f"{s} {v * 1e3:.0f}" for s, v in parts.items())
            logger.warning("tick %d ran late: %.3f s > its period %.3f s (ms: %s, other %.0f; back-pressure: "
                           "%d late ticks)", self.ticks + 1, lat["tick"], period, breakdown,
                           (lat["tick"] - sum(parts.values())) * 1e3, self.late_ticks)
        self.refresh_pools()
        with self.table.lock:
            self.last_latency = {k: (v,) for k, v in lat.items()}
            self.ticks += 1

    # ------------------------------------------------------------------ pool bytes

    def code2wav_tier(self) -> TierBytes:
        """shared: the voices' prompt states (fixed, allocated at start); private: the streams'
        caches, which are what the dynamic region holds."""
        shared = sum(self.code2wav.voice_bytes(v) for v in self.voice_names)
        private = sum(self.code2wav.session_bytes(s).private for s in self.code2wav.sessions)
        return TierBytes(shared=shared, private=private, free=max(0, self.dynamic_bytes - private))

    def note_code2wav_peak(self) -> None:
        """Code2Wav streams end inside the tick that ends their turn; keep the busiest moment."""
        now = self.code2wav_tier()
        if now.shared + now.private > self.code2wav_peak.shared + self.code2wav_peak.private:
            self.code2wav_peak = now

    def refresh_pools(self) -> None:
        """Bytes per tier, computed on the tick thread (``snapshot`` only reads them)."""
        ps = self.stage0.pool_stats()
        b = ps.bytes_per_block
        thinker = TierBytes(shared=ps.shared * b, private=(ps.used - ps.shared) * b, free=ps.free * b)
        tb = self.talker_block_bytes
        talker = TierBytes(shared=0, private=self.talker_kv.num_used * tb, free=self.talker_kv.num_free * tb)
        c2w = self.code2wav_tier()
        enc = self.table.encoder_bytes()
        # The dynamic region holds both Code2Wav and encoder caches: its free bytes are shown once.
        c2w = TierBytes(shared=c2w.shared, private=c2w.private, free=max(0, c2w.free - enc))
        # The Euler arena (fixed at start) and the context cache's embeddings are shared by
        # every session; listing them here puts them on /metrics next to the pools.
        cache = self.builder.cache
        pools = {"thinker_kv": thinker, "talker_kv": talker, "code2wav": c2w,
                 "audio_encoder": TierBytes(shared=0, private=enc, free=0),
                 "cfm_arena": TierBytes(shared=self.code2wav.arena.nbytes(), private=0, free=0),
                 "context_cache": TierBytes(shared=cache.nbytes() if cache is not None else 0, private=0, free=0)}
        with self.table.lock:
            self.pools = pools

    # ------------------------------------------------------------------ the snapshot

    def snapshot(self, decode_graphs: Mapping[str, PagedDecodeGraphs | None], warmup_captures: int,
                 captures_total: int, warmup_seconds: float | None, encoder_graph_ticks: int = 0,
                 early_closes: int = 0) -> EngineStats:
        cache = self.builder.cache
        table = self.table
        with table.lock:
            return EngineStats(
                live_sessions=len(table.live), queued_sessions=len(table.queue), pools=dict(self.pools),
                context_cache_hits=cache.hits if cache is not None else 0,
                context_cache_misses=cache.misses if cache is not None else 0,
                cfm_prompt_passes=dict(self.code2wav.batch_stats.prompt_passes_per_voice), ticks=self.ticks,
                stage_latency_s=dict(self.last_latency),
                decode_graph_steps={name: g.stats.replays for name, g in decode_graphs.items() if g is not None},
                ragged_graph_steps={name: g.stats.ragged_replays for name, g in decode_graphs.items() if g is not None},
                encoder_graph_ticks=encoder_graph_ticks,
                graph_captures={"warmup": warmup_captures, "tick": captures_total - warmup_captures},
                warmup_seconds=warmup_seconds, early_closes=early_closes,
                window_compactions=self.stage0.compactions)
