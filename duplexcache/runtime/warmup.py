"""The engine's warm start: capture every graph and compile every kernel before serving.

Why: a fresh engine captured its decode CUDA graphs (per batch bucket x block-table width) and
its Code2Wav whole-Euler graphs (per tier x width x cache bucket) lazily inside ticks, and Triton
JIT-compiled its kernels on first use. On an H200 (minicpmo45 shapes) 24 clients connecting in
the first seconds saw first audio after 13-16 s, and 11 of them none within 16 s.

``warm_up(engine)`` runs before the server reports ready (``DuplexEngine.warmup``):

* decode graphs (``kv/decode_graphs.py``): every batch bucket up to the planned session count x
  every width class a reference session's table can reach -- the Thinker's up to its worst-case
  blocks (context + window high mark; the model's 40 960 positions would add classes of 1024 to
  4096 blocks that no reference session can reach), the Talker's up to one full turn. Largest
  first, so the smaller graphs reuse the one memory pool. A session with a longer table (long
  instructions) still captures its class lazily, counted as a tick capture.
* Code2Wav graphs (``cfm/arena.py``): every replay tier batches of up to the planned session
  count can use x every chunk width (a non-final chunk of 3 carried + 25 codes, a final chunk of
  the 3 carried codes) x every cache bucket a voice's estimator cache passes through (P, P + W,
  ... up to P + 100 frames; a final chunk only after P), plus each voice's setup pass (tier 1,
  width P, no cache).
* Triton kernels, once each, on the null block: paged decode (also inside every decode capture),
  the short ragged step (when ``stage0.ragged_kernel``; every split count it can pick, since the
  split count is a compile-time constant) and the fused key re-rotation (window ``basic``).
  Graphs off (``engine.cuda_graphs: false``, the eager reference): eager decode steps of
  arbitrary batch sizes may still compile split variants inside ticks.
* a context prefill of three ``engine.prefill_chunk_tokens`` chunks through Stage 0
  (``run_prefill_once``): the first chunk of the first long context otherwise pays ~600 ms of
  first-use costs inside a tick, and the third gives the server's pacing a chunk time.
* the audio encoder's piecewise graphs (``engine.cuda_graphs``): every batch bucket x
  chunk width (a first chunk's 52 frames and a later one's 50 at minicpmo45 shapes).
* the audio encoder (its conv front eager in every tick, its layers too without graphs), over a first unit and a second unit of the planned
  session count on throwaway states (``run_encoder_once``): its first batch otherwise paid its
  library initialisation (cuDNN) and the device allocations of the batch inside a tick (H200,
  32 sessions: a 2.1 s first unit; ``scripts/probes/encoder_growth_probe.py``).
* the CUDA caching allocator holds the plan's dynamic region once (``reserve_dynamic_region``):
  the sessions' encoder caches and Code2Wav stream caches are allocated as sessions open and
  grow, and each new size used to be a device allocation (cudaMalloc, which waits for the
  device) inside a tick: ~50 per tick while 32 young sessions grew. One block of the region's
  size, allocated and freed, stays cached, and those tensors are carved from it.

Nothing here touches a session or the pools' accounting: decode captures use padding rows (slot 0
of the null block, as a padded replay does), Code2Wav captures use padded arena rows (scratch
that every solve reloads), and the kernel runs write only the null block, which no live sequence
reads. On CPU there is nothing to capture or compile: decode graphs exist only on CUDA and the
arena runs eagerly; tests give the engine ``capture=False`` decode runners and a fake arena
backend to exercise the same key lists.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from duplexcache.cfm.graph_grid import replay_tiers
from duplexcache.kv.decode_graphs import width_classes
from duplexcache.kv.paged_attention import NULL_BLOCK_ID, PagedBatch, PagedKVCache
from duplexcache.runtime.memory import replan
from duplexcache.runtime.stages.code2wav_stage import chunk_widths
from duplexcache.runtime.stage0.types import SessionContextInput

if TYPE_CHECKING:
    from duplexcache.runtime.engine import DuplexEngine

logger = logging.getLogger(__name__)

Code2WavKey = tuple[int, int, int]   # (tier, width, largest cache length of the batch)


@dataclass(frozen=True)
class WarmupReport:
    """What one warm-up did."""

    seconds: float
    decode_graphs: dict[str, int] = field(default_factory=dict)   # keys prepared per model
    code2wav_graphs: int = 0
    kernels: tuple[str, ...] = ()                                 # Triton kernels run once
    cancelled: bool = False                                       # stopped early (server shutting down)
    vocoder_graphs: int = 0
    encoder_graphs: int = 0   # audio-encoder keys (each its layers' pieces), engine.cuda_graphs
    # CUDA: the device memory the warm-up needed above the pools, from the pools' build to its
    # peak (graph pools and static buffers, transient activations, library workspaces), the
    # dynamic region's reservation excluded; None where nothing measures it (CPU).
    activation_peak_bytes: int | None = None

    @property
    def graphs(self) -> int:
        return sum(self.decode_graphs.values()) + self.code2wav_graphs + self.vocoder_graphs + self.encoder_graphs

    def describe(self) -> str:
        per_model = ", ".join(f"{k} {v}" for k, v in self.decode_graphs.items()) or "none"
        return (f"warm-up took {self.seconds:.2f} s: {self.graphs} graphs (decode: {per_model}; "
                f"Code2Wav: {self.code2wav_graphs}; vocoder: {self.vocoder_graphs}; "
                f"audio encoder: {self.encoder_graphs}), "
                f"kernels: {', '.join(self.kernels) or 'none'}")


# ------------------------------------------------------------------------------ key lists

def thinker_width_bound(engine: DuplexEngine) -> int:
    """Blocks of the longest Thinker table a reference session (any voice) can hold."""
    sizing = engine.sizing
    fps = [sizing.footprint(sizing.default_config(v), engine.voices.get(v)) for v in engine.voices.names()]
    return max(fp.thinker_private_blocks + fp.thinker_shared_blocks for fp in fps)


def decode_keys(engine: DuplexEngine) -> dict[str, list[tuple[int, int]]]:
    """Per model, the (batch bucket, width class) keys a warm-up captures, largest first."""
    keys: dict[str, list[tuple[int, int]]] = {}
    if engine.thinker_graphs is not None:
        bound = width_classes(thinker_width_bound(engine))[-1]
        keys["thinker"] = engine.thinker_graphs.keys(max_width=bound)
    if engine.talker_graphs is not None:
        keys["talker"] = engine.talker_graphs.keys()
    return keys


def code2wav_chunk_widths(engine: DuplexEngine) -> tuple[int, int]:
    """Frames of the chunks the engine sends (runtime/code2wav_stage.chunk_widths)."""
    return chunk_widths(engine.code2wav.config, engine.models.talker.config.tokens_per_unit)


def code2wav_cache_lengths(prompt_frames: int, chunk_width: int, tail: int) -> list[int]:
    """Estimator cache lengths a stream passes through: P after the setup pass, then one chunk
    more each step until the reference trim holds it at P + tail."""
    lengths, length = [prompt_frames], prompt_frames
    while length < prompt_frames + tail:
        length = min(length + chunk_width, prompt_frames + tail)
        lengths.append(length)
    return lengths


def code2wav_keys(engine: DuplexEngine) -> list[Code2WavKey]:
    """Every (tier, width, cache length) whose graph a tick can need, one per arena graph key,
    largest tier first (smaller captures reuse the pool). Only non-final chunks grow a stream's
    cache, and a final chunk always follows one, so finals start at the lengths after P."""
    arena, cfg = engine.code2wav.arena, engine.code2wav.config
    prompts = sorted({engine.voices.get(v).prompt_frames for v in engine.voices.names()})
    non_final, final = code2wav_chunk_widths(engine)
    starts = {p: code2wav_cache_lengths(p, non_final, cfg.cache_tail_frames) for p in prompts}
    by_width: dict[int, set[int]] = {}   # a union, should the two widths ever coincide
    by_width.setdefault(non_final, set()).update(n for p in prompts for n in starts[p])
    by_width.setdefault(final, set()).update(n for p in prompts for n in starts[p][1:])
    tiers = replay_tiers(cfg.graph_grid, arena.rows, max(1, engine.plan.planned_sessions))
    wanted = [(t, w, n) for t in reversed(tiers) for w, lengths in by_width.items() for n in sorted(lengths)]
    wanted += [(1, p, 0) for p in prompts]   # the setup pass: one prompt per replay, no cache
    keys, seen = [], set()
    for tier, width, length in wanted:
        graph_key = (tier, width, arena.bucket(width, length))
        if graph_key not in seen:
            seen.add(graph_key)
            keys.append((tier, width, length))
    return keys


def vocoder_keys(engine: DuplexEngine) -> list[tuple[int, tuple[int, int]]]:
    """Every (tier, shape) of a vocoder graph a tick can need, largest tier first."""
    graphs = engine.code2wav.vocoder_graphs
    if graphs is None:
        return []
    tiers = graphs.tiers(max(1, engine.plan.planned_sessions))
    return [(tier, shape) for tier in reversed(tiers) for shape in graphs.shapes]


# ------------------------------------------------------------------------------ kernels

def _null_block_step(num_new: int, cache: PagedKVCache) -> PagedBatch:
    """One sequence of ``num_new`` tokens that lives in the null block only (slots 0..n-1)."""
    dev, bs = cache.device, cache.block_size
    if num_new > bs:
        raise ValueError(f"a null-block step holds at most {bs} tokens, got {num_new}")
    idx = torch.arange(num_new, dtype=torch.int64)
    return PagedBatch(
        query_start_loc=torch.tensor([0, num_new], dtype=torch.int64, device=dev),
        seq_lens=torch.tensor([num_new], dtype=torch.int32, device=dev),
        block_tables=torch.full((1, 1), NULL_BLOCK_ID, dtype=torch.int32, device=dev),
        slot_mapping=(NULL_BLOCK_ID * bs + idx).to(dev),
        positions=idx.to(dev),
        block_size=bs, num_computed_list=[0], num_new_list=[num_new],
        token_seq_ids=torch.zeros(num_new, dtype=torch.int64), token_seq_lens=(idx + 1).to(torch.int32))


@torch.no_grad()
def run_kernels_once(engine: DuplexEngine) -> tuple[str, ...]:
    """JIT-compile the Triton kernels the ticks use, on the null block (CUDA only)."""
    m = engine.models
    if m.device.type != "cuda":
        return ()
    ran = []
    models = (("thinker", m.thinker, engine.thinker_cache, m.thinker.config.hidden_size),
              ("talker", m.talker, engine.talker_cache, m.talker.config.hidden_size))
    for name, model, cache, hidden in models:
        if cache.decode_backend != "triton":
            continue
        # A decode row, then a short ragged step (a unit's append is 12 tokens): the paths
        # paged_attention picks for them (the ragged one only with stage0.ragged_kernel).
        for num_new in (1, min(12, cache.block_size)):
            before = dict(cache.path_counts)
            model.forward_paged(torch.zeros(num_new, hidden, dtype=m.dtype, device=m.device),
                                _null_block_step(num_new, cache), cache)
            ran += [f"{name}:{p}" for p, n in cache.path_counts.items() if n > before.get(p, 0) and p != "reference"]
    ran += _ragged_split_variants(engine)
    if engine.stage0.window.mode == "basic" and engine.thinker_cache.decode_backend == "triton":
        from duplexcache.kv.triton_kernels import rerotate_keys_triton_

        # Three ids (not 1: Triton specialises an int argument equal to 1) of the null block,
        # whose contents no sequence reads; check_ids=False because the null block is refused.
        ids = torch.full((3,), NULL_BLOCK_ID, dtype=torch.long, device=m.device)
        # An fp8 pool compiles the scaled variant (k_scale in place; the null block's scales too).
        rerotate_keys_triton_(engine.thinker_cache.k, ids, engine.stage0.block_size, m.thinker.config.rope_theta,
                              k_scale=engine.thinker_cache.k_scale, check_ids=False)
        ran.append("thinker:rerotate")
    torch.cuda.synchronize(m.device)
    return tuple(dict.fromkeys(ran))


# Fewest query rows of a ragged step: the Thinker's first append is <unit> + 10 audio embeddings,
# the Talker's condition rows at least one text token + the end token.
RAGGED_MIN_ROWS = {"thinker": 11, "talker": 2}


def _ragged_split_variants(engine: DuplexEngine) -> list[str]:
    """Run every split count the ragged path can pick, so no kernel compiles inside a tick. The
    split count comes from the row count and the table width (``default_num_splits``); a ragged
    step has any row count >= RAGGED_MIN_ROWS and any width, so every value from 1 to the one of
    the fewest rows can occur: Thinker 1..6, Talker 1..22 at minicpmo45 shapes on an H200. The
    count is a runtime argument of the kernels, so this compiles one split kernel and one merge
    kernel per power-of-two merge width (BLOCK_S); the other counts only launch."""
    from duplexcache.kv.kernel_work import default_num_splits, num_sms
    from duplexcache.kv.triton_kernels import paged_decode_attention

    m, ran = engine.models, []
    for name, model, cache in (("thinker", m.thinker, engine.thinker_cache),
                               ("talker", m.talker, engine.talker_cache)):
        if cache.decode_backend != "triton" or not cache.ragged_steps_in_kernel:
            continue
        c = model.config
        most = default_num_splits(RAGGED_MIN_ROWS[name], c.num_key_value_heads, 2**31, num_sms(m.device))
        q = torch.zeros(1, c.num_attention_heads, c.head_dim, dtype=m.dtype, device=m.device)
        table = torch.full((1, 1), NULL_BLOCK_ID, dtype=torch.int32, device=m.device)
        seq_lens = torch.ones(1, dtype=torch.int32, device=m.device)
        k_scale, v_scale = cache.layer_scales(0)   # None, None unless the pool is fp8
        # engine.batch_invariant fixes the count: only that one can occur
        counts = [cache.fixed_num_splits] if cache.fixed_num_splits is not None else range(1, most + 1)
        for splits in counts:   # one row of the null block, as a padding row reads it
            paged_decode_attention(q, cache.k[0], cache.v[0], table, seq_lens, c.head_dim ** -0.5,
                                   k_scale=k_scale, v_scale=v_scale, num_splits=splits)
        ran.append(f"{name}:ragged_splits_{counts[0]}..{counts[-1]}")
    return ran


# ------------------------------------------------------------------------------ context prefill

# Not a valid id of any context: the warm-up's throwaway context never matches a real one.
PREFILL_WARMUP_SID = "__warmup_prefill__"
PREFILL_WARMUP_KEY = b"duplexcache-warmup-prefill"


@torch.no_grad()
def run_prefill_once(engine: DuplexEngine) -> int:
    """Prefill a throwaway context of three ``engine.prefill_chunk_tokens`` chunks through Stage 0
    (the path a long context takes) and free it; returns the tokens prefilled.

    Why: the first chunk of the first long context paid ~600 ms on an H200 (first use of the
    chunk's GEMM shapes and of SDPA with a lower-right causal bias: lazy kernel loads, allocator
    growth) inside the tick of 32 live sessions; later chunks cost 43-73 ms. Three chunks: the
    first has no computed context, the second is the first with one (its own first-use costs),
    the third is a warm chunk, and only its time goes to the server's pacing: timing the second
    kept the first four chunks of a 16384-token context out of the slack on the H200 (the
    predicted time stayed over what a period at 32 sessions leaves, 2026-12-04). The blocks go
    back to the pool; the ones the context hashed stay as evictable cached blocks under a key no
    session uses."""
    chunk = engine.thinker_stage.prefill_chunk_tokens
    stage0, window = engine.stage0, engine.stage0.window
    limit = engine.models.thinker.config.max_position_embeddings - 1
    tokens = min(3 * chunk, limit, window.high_tokens if window.mode != "off" else limit)
    if tokens < 1:
        return 0
    m = engine.models
    embeds = torch.zeros(tokens, m.thinker.config.hidden_size, dtype=m.dtype, device=m.device)
    context = SessionContextInput(embeds, [0] * tokens, PREFILL_WARMUP_KEY)
    stage0.enqueue_open(PREFILL_WARMUP_SID, context, window)
    walls = []
    try:
        for step in range(tokens // chunk + 2):
            if step >= 2:   # a warm chunk: timed for the server's pacing
                result = engine.scheduler.prefill_times.measure(lambda: stage0.prefill(chunk))
            else:           # first uses: timed for the log only
                _sync(m.device)
                start = time.perf_counter()
                result = stage0.prefill(chunk)
                _sync(m.device)
                walls.append(time.perf_counter() - start)
            if result.errors:
                raise RuntimeError(f"warm-up prefill failed: {result.errors[PREFILL_WARMUP_SID]}")
            if result.opened:
                break
    finally:
        stage0.close_session(PREFILL_WARMUP_SID)
    _sync(m.device)
    predicted = engine.scheduler.prefill_times.predicted_s()
    logger.info("warm-up prefill: chunks of %d tokens took %s ms (first uses), then %s ms (timed for pacing)",
                chunk, " / ".join(f"{1e3 * w:.1f}" for w in walls),
                "-" if predicted is None else f"{1e3 * predicted:.1f}")
    return tokens


@torch.no_grad()
def run_encoder_once(engine: DuplexEngine) -> int:
    """A first unit, then a second, through the audio encoder for the planned session count on
    throwaway states (CUDA only; no session or pool is touched), through its piecewise graphs
    when the engine has them (``engine.cuda_graphs``). Returns the batch size."""
    m = engine.models
    if m.device.type != "cuda":
        return 0
    stage = engine.thinker_stage
    enc = stage.encoder
    batch = max(1, engine.plan.planned_sessions)
    states = [enc.new_stream_state(storage_dtype=stage.encoder_storage) for _ in range(batch)]
    for _ in range(2):
        pcm = [torch.zeros(enc.expected_chunk_samples(s)) for s in states]
        enc.stream_step(states, pcm, graphs=stage.encoder_graphs)
    _sync(m.device)
    return batch


def dynamic_region_bytes(planned: int, free: int) -> int:
    """What ``reserve_dynamic_region`` holds: the plan's dynamic bytes, at most what is free less
    1 GiB (kept for the CUDA context and workspaces)."""
    return max(0, min(planned, free - (1 << 30)))


def reserve_dynamic_region(engine: DuplexEngine) -> int:
    """Allocate the plan's dynamic region (the sessions' encoder and Code2Wav stream caches; the
    voices' prompt states are fixed bytes, allocated already) as one block and free it, so the
    caching allocator keeps it (CUDA only). Bounded by what the device has free, less 1 GiB.
    Returns the bytes."""
    m = engine.models
    if m.device.type != "cuda":
        return 0
    free, _ = torch.cuda.mem_get_info(m.device)
    n = dynamic_region_bytes(engine.plan.dynamic_bytes, free)
    if n < engine.plan.dynamic_bytes:
        # The plan sized the pools before the warm-up's graphs took their memory; a region that
        # no longer fits means the sessions' growing caches may not either (seen on the H200 when
        # the encoder pieces' captures kept their activations, fixed since: docs/results/HISTORY.md).
        logger.warning("warm-up: the device has %.1f GiB free for the plan's %.1f GiB dynamic region (the "
                       "sessions' encoder and Code2Wav caches); the graphs captured since the plan took the rest, "
                       "so the planned sessions may run out of device memory", n / 2**30,
                       engine.plan.dynamic_bytes / 2**30)
    if n:
        block = torch.empty(n, dtype=torch.uint8, device=m.device)
        del block
    return n


def _log_device_memory(engine: DuplexEngine) -> None:
    """Where the device memory stands after the warm-up: what the graphs' pools took is the part
    the memory plan does not count (docs/results/HISTORY.md, "The graph switches: the retained memory
    explained")."""
    device = engine.models.device
    if device.type != "cuda":
        return
    pools = {name: graphs.stats.pool_bytes for name, graphs in
             (("thinker", engine.thinker_graphs), ("talker", engine.talker_graphs)) if graphs is not None}
    free, _ = torch.cuda.mem_get_info(device)
    logger.info("warm-up: device memory allocated %.2f GiB, reserved %.2f GiB, free %.2f GiB; decode graph pools "
                "grew reserved by %s", torch.cuda.memory_allocated(device) / 2**30,
                torch.cuda.memory_reserved(device) / 2**30, free / 2**30,
                ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in pools.items()) or "nothing (no decode graphs)")


def cached_bytes(device: torch.device) -> int:
    """What the caching allocator holds beyond allocated tensors after giving back every block it
    can (graphs' private pools are not given back): 0 off CUDA."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------ the warm-up

def _never() -> bool:
    return False


# Autograd off for all of it: nothing here runs backward, and a capture with it on keeps its
# activations alive (CudaGraphBackend.capture).
@torch.no_grad()
def warm_up(engine: DuplexEngine, should_stop: Callable[[], bool] = _never) -> WarmupReport:
    """Capture every graph and run every kernel a tick can need (see the module docstring).
    Call with no tick running (``DuplexEngine.warmup`` holds the tick lock). ``should_stop`` is
    asked between captures: a server shutting down does not wait for the rest."""
    start = time.perf_counter()
    decode: dict[str, int] = {}
    c2w, kernels, cancelled = 0, (), False
    device = engine.models.device
    before = cached_bytes(device)
    for name, keys in decode_keys(engine).items():
        graphs = engine.thinker_graphs if name == "thinker" else engine.talker_graphs
        assert graphs is not None
        decode[name] = 0
        for batch, width in keys:
            if should_stop():
                break
            decode[name] += graphs.warm(batch, width)
        logger.info("warm-up: %s decode graphs %d (buckets %s, widths %s)", name, decode[name],
                    sorted({b for b, _ in keys}), sorted({w for _, w in keys}))
    encoder = 0
    for batch, frames in engine.encoder_graphs.keys() if engine.encoder_graphs is not None else ():
        if should_stop():
            break
        encoder += engine.encoder_graphs.warm(batch, frames)
    # The graphs' private pools, measured as what stays cached once everything else cached is
    # given back: those of the session side (decode, encoder) are rebuilt with the pools; the
    # Code2Wav and vocoder graphs' are captured once and kept (the card waterfall names both).
    mid = cached_bytes(device)
    engine.session_graph_pool_bytes = max(0, mid - before)
    arena = engine.code2wav.arena
    for tier, width, length in code2wav_keys(engine) if arena.use_graphs else ():
        if should_stop():
            break
        c2w += arena.warm(tier, width, length)
    vocoder = 0
    for tier, shape in vocoder_keys(engine):
        if should_stop():
            break
        vocoder += engine.code2wav.vocoder_graphs.warm(tier, shape)
    engine.fixed_graph_pool_bytes += max(0, cached_bytes(device) - mid)
    peak = None
    if should_stop():
        cancelled = True
    else:
        kernels = run_kernels_once(engine)
        if engine.models.device.type == "cuda":
            kernels += (f"thinker:prefill_{run_prefill_once(engine)}_tokens",
                        f"audio_encoder:batch_{run_encoder_once(engine)}")
        peak = replan.activation_peak(engine)
        if engine.models.device.type == "cuda":
            # The transients of the runs above stay cached unless given back: allocator slack
            # that no session could use (issue 43). The graphs' private pools are not released.
            torch.cuda.empty_cache()
            engine.dynamic_reserved_bytes = reserve_dynamic_region(engine)
            kernels += (f"allocator:dynamic_{engine.dynamic_reserved_bytes >> 20}_MiB",)
    report = WarmupReport(time.perf_counter() - start, decode, c2w, kernels, cancelled, vocoder, encoder, peak)
    if peak is not None:
        logger.info("warm-up: activation peak %.2f GiB above the pools (graph pools and buffers, transients, "
                    "workspaces); the plan reserved %.2f GiB", peak / 2**30, engine.activation_reserve / 2**30)
    _log_device_memory(engine)
    logger.info("engine %s%s", report.describe(), " (cancelled)" if cancelled else "")
    return report


def run_warmup(engine: DuplexEngine, should_stop: Callable[[], bool] | None = None) -> WarmupReport:
    """Capture every decode and Code2Wav graph and run every Triton kernel a tick can need, so
    that ticks capture nothing (``DuplexEngine.warmup``). Touches no session; call before serving
    (the server does, before /health answers ok). ``should_stop`` is asked between captures (a
    server shutting down). With ``engine.activation_from_warmup`` on a device that measures
    (CUDA), the first warm-up's peak re-plans the pools once and the engine warms again
    (docs/engine.md "Memory: the order of start-up")."""
    with engine._tick_lock:
        if engine._closed:
            raise RuntimeError("engine is shut down")
        stop = should_stop or (lambda: False)
        before = engine._graph_captures_total()
        with engine._numerics():
            report = warm_up(engine, stop)
            if (engine.deploy.engine.activation_from_warmup and not engine._replanned and not report.cancelled
                    and report.activation_peak_bytes is not None):
                report = replan.replan_until_covered(engine, report, lambda: warm_up(engine, stop))
        engine._warmup_captures += engine._graph_captures_total() - before
        engine.warmup_report = report
    return report
