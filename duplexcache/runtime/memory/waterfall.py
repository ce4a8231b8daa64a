"""The card waterfall: every byte of the device, by what holds it (issue 43).

One engine after its warm-up is split into named parts that add up to the device total exactly
(each part's bytes are what the part names; one remainder part per region says what nothing
else names, so an accounting error shows as a large remainder, never as a sum that is off).

CUDA (``total`` = ``torch.cuda.mem_get_info``'s total, the whole card)::

    total = allocated by PyTorch        weights, each fixed buffer (Code2Wav arena, voices,
                                        voice prompt states, vocoder copy, vocoder graph
                                        buffers), encoder graph buffers, Thinker KV pool,
                                        Talker KV pool, session caches in use, other allocated
          + cached by the allocator     graph pools (decode + encoder; Code2Wav + vocoder), the
                                        session dynamic region (held on purpose by the warm-up,
                                        runtime/warmup.py), allocator slack (the rest of
                                        reserved - allocated)
          + outside PyTorch             the CUDA context, cuBLAS/cuDNN/NCCL memory of their own
                                        (total - free - reserved)
          + free                        activation reserve (the warm-up's measured peak +
                                        margin, or engine.activation_reserve), headroom
                                        (engine.memory_headroom with a re-planned auto budget),
                                        free beyond them (negative: the plan overshot)

Host devices (CPU) have no device total: the figure is the host budget the engine plans in,
``total = weights + engine.memory_budget (resolved)``, split as the plan splits the budget
(fixed buffers, activation reserve, Thinker KV, Talker KV, dynamic region) with the plan's
remainder as ``unplanned``.

``admitted / floor-limited``: admitted is what admission takes of the reference session (the
plan's count, which the ledger admits exactly: tests/runtime/test_card_fill.py);
floor-limited = (total - weights) / the floor bytes of one session (runtime/memory/floor.py).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from duplexcache.runtime.memory.floor import session_floor

if TYPE_CHECKING:
    from duplexcache.runtime.engine import DuplexEngine

logger = logging.getLogger(__name__)

GIB = 2**30
MIB = 2**20

# Part groups, in waterfall order (the PNG colours them).
GROUPS = ("weights", "fixed", "graphs", "activation", "sessions", "allocator", "outside", "free")


@dataclass(frozen=True)
class Part:
    """One named slice of the device."""

    name: str
    bytes: int
    group: str


@dataclass(frozen=True)
class Waterfall:
    """The device split into parts that add up to ``total_bytes``."""

    device: str
    total_bytes: int
    total_source: str
    parts: tuple[Part, ...]
    admitted: int
    floor_bytes: int | None
    weight_bytes: int

    @property
    def parts_sum(self) -> int:
        return sum(p.bytes for p in self.parts)

    @property
    def floor_limited(self) -> float | None:
        """Sessions the card would hold at the floor: (total - weights) / floor."""
        if not self.floor_bytes:
            return None
        return (self.total_bytes - self.weight_bytes) / self.floor_bytes

    @property
    def ratio(self) -> float | None:
        fl = self.floor_limited
        return None if not fl else self.admitted / fl

    def part(self, name: str) -> int:
        for p in self.parts:
            if p.name == name:
                return p.bytes
        raise KeyError(name)

    def to_json(self) -> dict:
        return {"device": self.device, "total_bytes": self.total_bytes, "total_source": self.total_source,
                "parts": [asdict(p) for p in self.parts], "parts_sum_bytes": self.parts_sum,
                "weight_bytes": self.weight_bytes, "floor_bytes_per_session": self.floor_bytes,
                "admitted": self.admitted,
                "floor_limited": None if self.floor_limited is None else round(self.floor_limited, 3),
                "admitted_over_floor_limited": None if self.ratio is None else round(self.ratio, 4)}

    def ratio_line(self) -> str:
        if self.floor_limited is None:
            return f"admitted / floor-limited = n/a (admitted {self.admitted}; no floor)"
        return (f"admitted / floor-limited = {self.ratio:.3f} (admitted {self.admitted}; floor-limited "
                f"{self.floor_limited:.2f} = ({self.total_bytes / GIB:.2f} GiB total - {self.weight_bytes / GIB:.2f} "
                f"GiB weights) / {self.floor_bytes / MIB:.1f} MiB floor per session)")

    def lines(self) -> list[str]:
        """The waterfall as log/table lines: each part, its share and the running total."""
        out = [f"card waterfall on {self.device}: total {self.total_bytes / GIB:.3f} GiB ({self.total_source})"]
        running = 0
        for p in self.parts:
            running += p.bytes
            out.append(f"  {p.name:<34} {p.bytes / MIB:>12.1f} MiB  {100 * p.bytes / self.total_bytes:6.2f} %  "
                       f"(cumulative {running / GIB:8.3f} GiB)  [{p.group}]")
        out.append(f"  parts sum {self.parts_sum} B = total {self.total_bytes} B" if self.parts_sum == self.total_bytes
                   else f"  parts sum {self.parts_sum} B != total {self.total_bytes} B")
        out.append(self.ratio_line())
        return out


def session_floor_bytes(engine: DuplexEngine) -> int:
    """The floor of one session of ``engine``'s deploy config (runtime/memory/floor.py, shapes only)."""
    from duplexcache.cfm.config import Code2WavShape
    from duplexcache.kv.kv_quant import kv_storage_dtype

    deploy, models = engine.deploy, engine.models
    p = models.voices.get(models.voices.names()[0]).prompt_frames
    floor = session_floor(models.thinker.config, deploy.stage0.window.high_tokens, Code2WavShape.from_flow(models.flow),
                          p, models.audio_encoder.cfg, deploy.model.dtype,
                          code2wav_dtype=deploy.precision.code2wav_dtype,
                          kv_storage_dtype=kv_storage_dtype(deploy.precision.kv_cache_dtype),
                          encoder_storage_dtype=kv_storage_dtype(deploy.precision.encoder_cache_dtype))
    return floor.total


def fixed_parts(engine: DuplexEngine) -> list[Part]:
    """The engine's fixed buffers, one part each (their sum is the plan's ``fixed_bytes``)."""
    c2w, voices = engine.code2wav, engine.voices
    names = voices.names()
    return [Part("code2wav_arena", c2w.arena.nbytes(), "fixed"),
            Part("voices", sum(voices.get(v).nbytes() for v in names), "fixed"),
            Part("code2wav_voice_states", sum(c2w.voice_bytes(v) for v in names), "fixed"),
            Part("vocoder_copy", c2w.vocoder_copy_bytes, "fixed"),
            Part("vocoder_graph_buffers", c2w.vocoder_graph_bytes, "fixed")]


def engine_waterfall(engine: DuplexEngine) -> Waterfall:
    """The waterfall of ``engine`` now (call after its warm-up; see the module docstring)."""
    models, plan = engine.models, engine.plan
    weights = models.weight_bytes()
    fixed = fixed_parts(engine)
    enc_graphs = engine.encoder_graphs.nbytes() if engine.encoder_graphs is not None else 0
    sessions = [Part("thinker_kv_pool", plan.thinker_bytes, "sessions"),
                Part("talker_kv_pool", plan.talker_bytes, "sessions")]
    reserve = engine.activation_reserve
    floor = session_floor_bytes(engine)
    device = models.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        in_use = engine.table.encoder_bytes() + engine.recorder.code2wav_tier().private
        known = weights + sum(p.bytes for p in fixed) + enc_graphs + plan.thinker_bytes + plan.talker_bytes + in_use
        session_pools, fixed_pools = engine.session_graph_pool_bytes, engine.fixed_graph_pool_bytes
        graph_pools = session_pools + fixed_pools
        cached = reserved - allocated
        dynamic_cached = max(0, min(engine.dynamic_reserved_bytes - in_use, cached - graph_pools))
        headroom = engine.headroom_bytes
        act_free = max(0, reserve - session_pools - enc_graphs)
        parts = [Part("weights", weights, "weights"), *fixed,
                 Part("encoder_graph_buffers", enc_graphs, "graphs"),
                 *sessions,
                 Part("session_caches_in_use", in_use, "sessions"),
                 Part("other_allocated", allocated - known, "allocator"),
                 Part("graph_pools_decode_encoder", session_pools, "graphs"),
                 Part("graph_pools_code2wav_vocoder", fixed_pools, "graphs"),
                 Part("session_dynamic_region_cached", dynamic_cached, "sessions"),
                 Part("allocator_slack", cached - graph_pools - dynamic_cached, "allocator"),
                 Part("outside_pytorch", total - free - reserved, "outside"),
                 # The reserve covers the session side's graph pools and buffers too (held now,
                 # parts above): what stays free of it is the room for the transient activations.
                 Part("activation_reserve_free_part", act_free, "activation"),
                 Part("headroom", headroom, "free"),
                 Part("free_unplanned", free - act_free - headroom, "free")]
        return Waterfall(str(device), int(total), "torch.cuda.mem_get_info total", tuple(parts),
                         plan.planned_sessions, floor, weights)
    # A host device: the budget the engine plans in is the figure (module docstring).
    budget = plan.budget_bytes + reserve
    planned = plan.fixed_bytes + plan.thinker_bytes + plan.talker_bytes + plan.dynamic_bytes + reserve
    parts = [Part("weights", weights, "weights"), *fixed,
             Part("fixed_unattributed", plan.fixed_bytes - sum(p.bytes for p in fixed), "fixed"),
             Part("encoder_graph_buffers", enc_graphs, "graphs"),
             Part("activation_reserve", reserve - enc_graphs, "activation"),
             *sessions,
             Part("session_dynamic_region", plan.dynamic_bytes, "sessions"),
             Part("unplanned", budget - planned, "free")]
    return Waterfall(str(device), weights + budget, "host: weights + engine.memory_budget (resolved)", tuple(parts),
                     plan.planned_sessions, floor, weights)


def log_waterfall(wf: Waterfall, log: logging.Logger = logger) -> None:
    for line in wf.lines():
        log.info("%s", line)
