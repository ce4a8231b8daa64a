"""Device setup of one engine: numerics pinning, the KV pools, the attention backend, decode graphs.

Everything here runs once, while the engine is built; nothing is per session or per tick.

Ownership of what ``build_kv_pools`` returns (``KVPools``):

* ``thinker_cache`` (``PagedKVCache``) holds the Thinker's K/V; ``thinker_manager``
  (``KVCacheManager`` over its own ``BlockPool``) owns its block tables and ref counts;
  ``stage0`` (``Stage0Runner``) owns the Stage 0 sessions and is the only caller of the manager.
* ``talker_cache`` holds the Talker's K/V; ``talker_kv`` (``TalkerBlocks`` over its own
  ``BlockPool``) owns the per-turn tables and is the only caller of that pool.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from duplexcache.config import Stage0Config
from duplexcache.kv.block_pool import BlockPool
from duplexcache.kv.decode_graphs import PagedDecodeGraphs
from duplexcache.kv.kv_cache_manager import KVCacheManager
from duplexcache.kv.paged_attention import PagedKVCache
from duplexcache.kv.talker_blocks import TalkerBlocks
from duplexcache.kv.window import WindowConfig
from duplexcache.kv.kernel_work import tokens_per_program
from duplexcache.runtime.memory.admission import MemoryPlan
from duplexcache.runtime.bundle import ModelBundle
from duplexcache.runtime.stage0.runner import Stage0Runner

logger = logging.getLogger(__name__)
# cuBLAS's deterministic workspace setting (its docs: ':4096:8' or ':16:8')
CUBLAS_WORKSPACE_CONFIG = ":4096:8"


def pin_cuda_numerics(device: torch.device) -> None:
    """Sharing must be bit-exact, so the same work must give the same bits in every engine:
    cuDNN may otherwise pick a different convolution algorithm (and TF32) depending on free
    workspace, which changed Code2Wav's output between two engines of one process on an H200.
    Stage 2 runs float32 as the reference does, so TF32 convolutions are off too. These are
    process-wide torch settings: every engine in the process (and anything else) shares them."""
    if device.type != "cuda":
        return
    # cuBLAS is deterministic across streams (warm-up, graph capture) only with a fixed workspace,
    # read when the process first uses cuBLAS: `duplexcache` (cli.main) sets it before any CUDA
    # work; a script or library caller that builds an engine first gets it here, in time unless it
    # ran a GEMM on the device before (scripts/batch_invariance.py did not set it until 2026-12-07).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def select_attention_backend(cache: PagedKVCache) -> None:
    """On CUDA, decode batches read KV blocks in place with the Triton kernel (SPEC §5: the
    gather-then-SDPA path moves the KV twice, 3.4x slower on an H200); elsewhere the reference."""
    if cache.device.type != "cuda":
        return
    try:
        cache.set_decode_backend("triton")
    except (ImportError, ValueError) as exc:
        logger.warning("paged decode uses the gather+SDPA reference path on %s: %s", cache.device, exc)


@dataclass(frozen=True)
class KVPools:
    """The two paged KV pools of an engine and the objects that own their blocks."""

    thinker_cache: PagedKVCache
    thinker_manager: KVCacheManager
    stage0: Stage0Runner
    talker_cache: PagedKVCache
    talker_kv: TalkerBlocks


# engine.batch_invariant: the paged decode kernel's split count, fixed for every batch, so a
# sequence's splits depend on its own length only. 8 keeps a split >= ~1000 tokens of an 8k
# window while 16+ sessions x kv heads x 8 still fill an H100's 132 SMs several times over.
BATCH_INVARIANT_SPLITS = 8


def window_config(stage0_cfg: Stage0Config) -> WindowConfig:
    """The Thinker window of the deploy config's ``stage0.window`` section."""
    w = stage0_cfg.window
    return WindowConfig(mode=w.mode, high_tokens=w.high_tokens, low_tokens=w.low_tokens)


def stage0_runner(thinker, cache: PagedKVCache, stage0_cfg: Stage0Config, window: WindowConfig) -> Stage0Runner:
    """A Stage 0 runner over ``cache`` with a fresh block pool and manager of the cache's size: the
    one way the engine and the benchmarks build Stage 0 (``stage0.shared_anchor_blocks`` reaches it here)."""
    manager = KVCacheManager(BlockPool(cache.num_blocks), stage0_cfg.block_size, cache.bytes_per_block)
    return Stage0Runner(thinker, manager, cache, window, share_context=stage0_cfg.shared_anchor_blocks,
                        block_size=stage0_cfg.block_size)


def build_kv_pools(models: ModelBundle, plan: MemoryPlan, stage0_cfg: Stage0Config, window: WindowConfig,
                   storage_dtype: torch.dtype | None = None, batch_invariant: bool = False) -> KVPools:
    """Allocate the Thinker and Talker pools at the plan's sizes and pick their attention paths.

    ``storage_dtype`` (``precision.kv_cache_dtype``): None stores the model dtype; fp8 e4m3 stores
    both pools quantized with per-token scales (the plan's block bytes must be that format's).
    """
    bs, dev, dt = stage0_cfg.block_size, models.device, models.dtype
    thinker_cache = models.thinker.make_kv_cache(plan.thinker_blocks, bs, dt, dev, storage_dtype)
    stage0 = stage0_runner(models.thinker, thinker_cache, stage0_cfg, window)
    tc = models.talker.config
    talker_cache = PagedKVCache(tc.num_hidden_layers, plan.talker_blocks, bs, tc.num_key_value_heads,
                                tc.head_dim, dt, dev, storage_dtype)
    talker_kv = TalkerBlocks(BlockPool(plan.talker_blocks), bs)
    # Admission sized the pools with plan's block bytes: a pool of another size per block
    # would hold more (or fewer) bytes than were reserved.
    assert (thinker_cache.bytes_per_block, talker_cache.bytes_per_block) == (
        plan.thinker_block_bytes, plan.talker_block_bytes), "KV pools and the memory plan disagree on block bytes"
    if thinker_cache.quantized:
        logger.info("KV pools in %s with a float32 scale per token and kv head (precision.kv_cache_dtype): "
                    "%d B per Thinker block, %d B per Talker block", thinker_cache.storage_dtype,
                    thinker_cache.bytes_per_block, talker_cache.bytes_per_block)
    for cache, cfg in ((thinker_cache, models.thinker.config), (talker_cache, tc)):
        select_attention_backend(cache)
        cache.ragged_steps_in_kernel = stage0_cfg.ragged_kernel
        # a kernel program takes several tokens of one sequence, which share each K/V tile it loads
        cache.ragged_tokens_per_program = tokens_per_program(cfg.num_attention_heads, cfg.num_key_value_heads)
        cache.fixed_num_splits = BATCH_INVARIANT_SPLITS if batch_invariant else None
    return KVPools(thinker_cache, stage0.manager, stage0, talker_cache, talker_kv)


def decode_graphs_supported(device: torch.device, caches: tuple[PagedKVCache, ...]) -> bool:
    """Whether one-token steps can be captured as CUDA graphs here (logged when not)."""
    if device.type != "cuda":
        logger.info("engine.cuda_graphs applies to CUDA devices; decode on %s runs eagerly", device)
        return False
    if any(c.decode_backend != "triton" for c in caches):
        logger.warning("engine.cuda_graphs needs the Triton decode kernel; decode runs eagerly")
        return False
    return True


# Token rows per session that the ragged-step graphs cover (engine.cuda_graphs): a unit's
# append is 12 rows (</unit>, <unit>, 10 audio embeddings), a speaking unit's Talker condition
# ~5 (its text and end token, a boundary); steps with more rows than this per session run eagerly.
RAGGED_ROWS_PER_SESSION = 16


# The graph buckets stop here however many sessions the plan holds (vLLM caps its capture sizes
# the same way); a step past them runs eagerly, where launches are a small share of its time.
# Uncapped, a small model on a large card (the tiny preset on an H100: 10230 planned sessions)
# had buckets every 8 sessions up to 10230 and spent minutes capturing thousands of graphs
# before serving. The exact-mode minicpmo45 plan measured on the H200 (49 sessions, rows up to
# 1024) keeps its buckets; a capacity-mode plan of ~100 loses its 2048-row bucket, so a unit
# tick appending for more than ~85 sessions (12 rows each) runs that step eagerly (unmeasured).
MAX_GRAPH_BATCH = 256
MAX_GRAPH_ROWS = 1024


def graph_batch(planned_sessions: int) -> int:
    """The largest batch bucket of the graph runners for a plan of ``planned_sessions``."""
    return max(1, min(planned_sessions, MAX_GRAPH_BATCH))


def make_decode_graphs(models: ModelBundle, kv: KVPools, max_batch: int, talker_turn_tokens: int,
                       capture: bool, ragged_steps: bool = False) -> tuple[PagedDecodeGraphs, PagedDecodeGraphs]:
    """CUDA graphs for the one-token steps of the Thinker and the Talker: batch buckets up to
    ``max_batch``, block-table widths up to the longest table a session can hold (the
    Thinker's model positions, the Talker's turn: ``talker_turn_tokens``). ``ragged_steps``
    (``engine.cuda_graphs`` with ``stage0.ragged_kernel``): row buckets up to
    ``RAGGED_ROWS_PER_SESSION`` rows per session too, for the short ragged steps run as token rows. Both capped (``MAX_GRAPH_BATCH``,
    ``MAX_GRAPH_ROWS``)."""
    bs = kv.stage0.block_size
    max_batch = graph_batch(max_batch)
    max_rows = min(RAGGED_ROWS_PER_SESSION * max_batch, MAX_GRAPH_ROWS) if ragged_steps else 0
    thinker = PagedDecodeGraphs("thinker", models.thinker.forward_paged, kv.thinker_cache,
                                models.thinker.config.hidden_size, models.dtype, max_batch=max_batch,
                                max_blocks_per_seq=-(-kv.stage0.max_positions // bs), capture=capture,
                                max_rows=max_rows)
    tc = models.talker.config
    talker = PagedDecodeGraphs("talker", models.talker.forward_paged, kv.talker_cache, tc.hidden_size, models.dtype,
                               max_batch=max_batch, max_blocks_per_seq=-(-talker_turn_tokens // bs),
                               capture=capture, max_rows=max_rows)
    return thinker, talker
