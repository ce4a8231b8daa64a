"""Stage 0 GPU micro-benchmark: decode attention and key re-rotation on Qwen3-8B shapes.

    duplexcache bench kernels --out DIR [--quick]

Measures one decode step (all layers) for B sessions of T cached tokens each:
  (a) dense SDPA over contiguous (B, Hkv, T, D) K/V (the SPEC §5 anchor, 23.7 ms on an H200);
  (b) gather-then-SDPA over the paged cache (copies each layer's blocks, then (a));
  (c) the Triton paged kernel reading blocks in place (a small config sweep, best reported);
and the window compaction's re-rotation of ``kept`` tokens in every layer:
  (d) plain PyTorch (gather listed blocks, rotate in float32, scatter back) vs the fused kernel;
  (e) a unit's append as the ragged kernel path runs it, one program per token row vs the engine's
      row groups, whose tokens share each K/V tile (``ragged_rows*`` / ``ragged_groups*``).
Both kernels also run on the same K/V quantized to fp8 e4m3 with per-(token, kv head) scales
(``precision.kv_cache_dtype: fp8_e4m3``): ``triton_paged_fp8`` with (c)'s best config and
``triton_paged_fp8_own_config`` with the best of the same sweep over the fp8 sets, and
``triton_rerotate_fp8`` (dequantize, rotate, re-quantize), each with its error.
Each figure: CUDA events around a whole step, warm-up, then ``--repeats`` timed steps;
median, min, max. Errors: (c) vs (a) max-abs, both vs a float32 reference on a few sessions,
a ragged-length check of (c), and (d) Triton vs PyTorch. Writes results.json and results.md.

Memory: 36 distinct layers of dense + paged KV would need ~151 GB, so ``--distinct-layers``
(default 4) sets of K/V are allocated and layer l uses set l % n. Each set is ~2 GB, far above
the 60 MB L2, so reuse across layers does not let any call hit in cache.

Only torch, triton and numpy are needed (the kernels are in duplexcache.kv.triton_kernels).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from duplexcache.bench.common import alias_main, hardware_line, usage_error, write_results

logger = logging.getLogger(__name__)
PAGE = 16


@dataclass
class Shapes:
    batch: int = 64
    seq_len: int = 8000
    layers: int = 36
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    kept: int = 6000
    theta: float = 1e6
    distinct_layers: int = 4

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    def kv_bytes_per_step(self) -> int:
        """K and V of every session, every layer, read once (bf16)."""
        return 2 * self.batch * self.seq_len * self.kv_heads * self.head_dim * 2 * self.layers


@dataclass
class Timing:
    name: str
    times_ms: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        t = np.asarray(self.times_ms)
        return {"name": self.name, "median_ms": float(np.median(t)), "min_ms": float(t.min()),
                "max_ms": float(t.max()), "repeats": int(t.size)}


def time_cuda(name: str, fn: Callable[[], None], warmup: int, repeats: int) -> Timing:
    """Median-ready timings of ``fn`` with CUDA events, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    timing = Timing(name)
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        timing.times_ms.append(start.elapsed_time(end))
    return timing


def copy_bandwidth_gbs(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy, counting bytes read plus written (the memory ceiling)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = time_cuda("copy", lambda: dst.copy_(src), warmup=3, repeats=10).summary()["median_ms"]
    del src, dst
    return 2 * nbytes / (t * 1e-3) / 1e9


# ----------------------------------------------------------------------------- data
@dataclass
class LayerKV:
    dense_k: torch.Tensor  # (B, Hkv, T, D)
    dense_v: torch.Tensor
    paged_k: torch.Tensor  # (num_blocks, PAGE, Hkv, D), same values at shuffled blocks
    paged_v: torch.Tensor


def build_block_tables(batch: int, seq_len: int, gen: torch.Generator, device="cuda") -> tuple[torch.Tensor, int]:
    """Shuffled block ids (never 0, the null block) so sessions' blocks are interleaved."""
    per_seq = math.ceil(seq_len / PAGE)
    num_blocks = 1 + batch * per_seq
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1
    return ids.view(batch, per_seq).to(torch.int32).to(device), num_blocks


def to_paged(dense: torch.Tensor, bt: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Scatter dense (B, Hkv, T, D) into a (num_blocks, PAGE, Hkv, D) cache via ``bt``."""
    (b, h, t, d), nb = dense.shape, bt.shape[1]
    tok = dense.transpose(1, 2)  # (B, T, Hkv, D)
    if nb * PAGE != t:
        tok = F.pad(tok, (0, 0, 0, 0, 0, nb * PAGE - t))
    paged = torch.zeros(num_blocks, PAGE, h, d, dtype=dense.dtype, device=dense.device)
    paged[bt.long().flatten()] = tok.reshape(b * nb, PAGE, h, d)
    return paged


def build_layers(s: Shapes, bt: torch.Tensor, num_blocks: int) -> list[LayerKV]:
    layers, shape = [], (s.batch, s.kv_heads, s.seq_len, s.head_dim)
    for _ in range(s.distinct_layers):
        k = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        v = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        layers.append(LayerKV(k, v, to_paged(k, bt, num_blocks), to_paged(v, bt, num_blocks)))
    return layers


# ----------------------------------------------------------------------------- decode paths
def dense_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, Hq, D) vs K/V (B, Hkv, T, D) through SDPA's GQA mode."""
    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True).squeeze(2)


def dense_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Same result: the G q heads of a kv head become G query rows (no mask at decode)."""
    b, hq, d = q.shape
    qg = q.view(b, k.shape[1], hq // k.shape[1], d)  # (B, Hkv, G, D)
    return F.scaled_dot_product_attention(qg, k, v, scale=scale).reshape(b, hq, d)


def gather_then_sdpa(q, pk, pv, bt, seq_len: int, scale: float, dense_fn) -> torch.Tensor:
    """Copy each session's blocks into contiguous K/V, then dense attention (moves KV twice).

    All sessions have the same length here, so no mask is needed (favours this path)."""
    b, nb = bt.shape
    idx = bt.long()
    k = pk[idx].view(b, nb * PAGE, *pk.shape[2:])[:, :seq_len].transpose(1, 2)
    v = pv[idx].view(b, nb * PAGE, *pv.shape[2:])[:, :seq_len].transpose(1, 2)
    return dense_fn(q, k, v, scale)


def reference_fp32(q, k, v, scale: float, rows: int) -> torch.Tensor:
    """float32 attention for the first ``rows`` sessions (independent of SDPA kernels)."""
    g = q.shape[1] // k.shape[1]
    kf = k[:rows].float().repeat_interleave(g, dim=1)  # (rows, Hq, T, D)
    vf = v[:rows].float().repeat_interleave(g, dim=1)
    s = torch.einsum("bhd,bhtd->bht", q[:rows].float(), kf) * scale
    return torch.einsum("bht,bhtd->bhd", s.softmax(-1), vf)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


# ----------------------------------------------------------------------------- benches
@dataclass
class DecodeSetup:
    """Everything one decode step reads: per-layer-set K/V (dense and paged) and queries."""
    s: Shapes
    bt: torch.Tensor  # (B, max_blocks) int32
    layers: list[LayerKV]
    qs: list[torch.Tensor]  # (B, Hq, D) per layer set
    seq_lens: torch.Tensor  # (B,) int32
    scale: float

    @classmethod
    def build(cls, s: Shapes) -> "DecodeSetup":
        gen = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        bt, num_blocks = build_block_tables(s.batch, s.seq_len, gen)
        layers = build_layers(s, bt, num_blocks)
        qs = [torch.randn(s.batch, s.q_heads, s.head_dim, dtype=torch.bfloat16, device="cuda")
              for _ in range(s.distinct_layers)]
        seq_lens = torch.full((s.batch,), s.seq_len, dtype=torch.int32, device="cuda")
        return cls(s, bt, layers, qs, seq_lens, s.head_dim ** -0.5)

    def step(self, attn: Callable[[torch.Tensor, LayerKV], torch.Tensor]) -> Callable[[], None]:
        """One decode step: ``attn`` for every layer, cycling over the distinct K/V sets."""
        def run() -> None:
            for layer in range(self.s.layers):
                i = layer % self.s.distinct_layers
                attn(self.qs[i], self.layers[i])
        return run

    def triton(self, q: torch.Tensor, kv: LayerKV, **kw) -> torch.Tensor:
        from duplexcache.kv.triton_kernels import paged_decode_attention

        return paged_decode_attention(q, kv.paged_k, kv.paged_v, self.bt, self.seq_lens,
                                      self.scale, **kw)

    def gather(self, q: torch.Tensor, kv: LayerKV, dense_fn) -> torch.Tensor:
        return gather_then_sdpa(q, kv.paged_k, kv.paged_v, self.bt, self.s.seq_len, self.scale,
                                dense_fn)


def _time_baselines(d: DecodeSetup, args) -> tuple[dict[str, Timing], str, Callable]:
    """Dense SDPA in two forms (the faster one is the reference), then gather-then-SDPA."""
    timings = {}
    for name, fn in (("dense_sdpa_gqa", dense_gqa), ("dense_sdpa_grouped", dense_grouped)):
        timings[name] = time_cuda(name, d.step(
            lambda q, kv, f=fn: f(q, kv.dense_k, kv.dense_v, d.scale)), args.warmup, args.repeats)
    best_dense = min(timings, key=lambda n: timings[n].summary()["median_ms"])
    dense_fn = dense_gqa if best_dense == "dense_sdpa_gqa" else dense_grouped
    timings["gather_then_sdpa"] = time_cuda(
        "gather_then_sdpa", d.step(lambda q, kv: d.gather(q, kv, dense_fn)),
        args.warmup, args.repeats)
    return timings, best_dense, dense_fn


def _sweep_triton(d: DecodeSetup, args,
                  step: Callable[[dict], Callable[[], None]] | None = None) -> tuple[list[dict], dict]:
    """Short timing of each kernel config; returns the table and the best config's kwargs.
    ``step(kw)``: one decode step with those kwargs (default: the bf16 layer sets)."""
    if step is None:
        def step(kw: dict) -> Callable[[], None]:
            return d.step(lambda q, kv: d.triton(q, kv, **kw))
    sweep = []
    for block_n, splits, warps, stages in _sweep_grid(args.quick):
        kw = dict(num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages)
        t = time_cuda("sweep", step(kw), 2, max(5, args.repeats // 4))
        sweep.append({**kw, "num_splits": "auto" if splits is None else splits,
                      "median_ms": t.summary()["median_ms"]})
        logger.info("triton %s: %.3f ms", kw, sweep[-1]["median_ms"])
    best = min(sweep, key=lambda r: r["median_ms"])
    best_kw = {k: v for k, v in best.items() if k != "median_ms"}
    if best_kw["num_splits"] == "auto":
        best_kw["num_splits"] = None
    return sweep, best_kw


def quantize_paged(kv: LayerKV) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k e4m3, k scales, v e4m3, v scales) of one paged layer set, as an fp8 pool stores it."""
    from duplexcache.kv.kv_quant import quantize_fp8

    (k8, ks), (v8, vs) = quantize_fp8(kv.paged_k), quantize_fp8(kv.paged_v)
    return k8, ks, v8, vs


def _time_fp8_decode(d: DecodeSetup, args, best_kw: dict) -> tuple[dict[str, Timing], dict, list[dict]]:
    """The paged kernel over fp8 copies of the layer sets (bf16 compute, in-kernel dequant):
    with the bf16 sweep's best config (``triton_paged_fp8``), then the same config sweep over
    the fp8 sets and their own best (``triton_paged_fp8_own_config``): an fp8 tile holds half
    the bytes of a bf16 one, so its best block and stage counts can differ. Returns the
    timings, the errors and the fp8 sweep."""
    from duplexcache.kv.triton_kernels import paged_decode_attention

    sets = [quantize_paged(kv) for kv in d.layers]

    def attn(i: int, kw: dict) -> torch.Tensor:
        k8, ks, v8, vs = sets[i]
        return paged_decode_attention(d.qs[i], k8, v8, d.bt, d.seq_lens, d.scale, k_scale=ks, v_scale=vs, **kw)

    def step(kw: dict) -> Callable[[], None]:
        def run() -> None:
            for layer in range(d.s.layers):
                attn(layer % d.s.distinct_layers, kw)
        return run

    timings = {"triton_paged_fp8": time_cuda("triton_paged_fp8", step(best_kw), args.warmup, args.repeats)}
    sweep, own_kw = _sweep_triton(d, args, step)
    timings["triton_paged_fp8_own_config"] = time_cuda("triton_paged_fp8_own_config", step(own_kw),
                                                       args.warmup, args.repeats)
    kv0, q0 = d.layers[0], d.qs[0]
    ref = reference_fp32(q0, kv0.dense_k, kv0.dense_v, d.scale, rows=4)
    out, own = attn(0, best_kw), attn(0, own_kw)
    errors = {"triton_fp8_vs_fp32_ref_max_abs(4 sessions)": max_abs(out[:4], ref),
              "triton_fp8_own_config_vs_fp32_ref_max_abs(4 sessions)": max_abs(own[:4], ref),
              "triton_fp8_vs_bf16_triton_max_abs": max_abs(out, d.triton(q0, kv0, **best_kw)),
              "fp8_all_finite": bool(torch.isfinite(out).all() and torch.isfinite(own).all())}
    ragged_timings, ragged_errors = _time_ragged(d, args, sets)
    del sets
    return {**timings, **ragged_timings}, {**errors, **ragged_errors}, sweep


RAGGED_ROWS = 12   # a unit's append: </unit> <unit> + 10 audio embeddings per session


def _time_ragged(d: DecodeSetup, args, fp8_sets: list) -> tuple[dict[str, Timing], dict]:
    """A unit's append as the engine's ragged kernel path runs it: RAGGED_ROWS new tokens of every
    session, each a kernel row over its session's blocks with its own causal length, one program
    per row (``ragged_rows``: each row re-reads the window) vs row groups of ``tokens_per_program``
    rows sharing each K/V tile (``ragged_groups``, the engine's), over the bf16 and the fp8 sets."""
    from duplexcache.kv.kernel_work import row_groups_host, tokens_per_program
    from duplexcache.kv.triton_kernels import paged_decode_attention

    s, n = d.s, RAGGED_ROWS
    tables = d.bt.repeat_interleave(n, 0)
    back = torch.arange(n - 1, -1, -1, dtype=torch.int32, device=d.bt.device)   # the last row: the whole window
    lens = d.seq_lens.repeat_interleave(n) - back.repeat(s.batch)
    qs = [torch.randn(s.batch * n, s.q_heads, s.head_dim, device=lens.device).to(q.dtype) for q in d.qs]
    per = tokens_per_program(s.q_heads, s.kv_heads)
    groups = tuple(torch.tensor(g, dtype=torch.int32, device=lens.device) for g in row_groups_host([n] * s.batch, per))
    pools, timings, outs = {"": [(kv.paged_k, None, kv.paged_v, None) for kv in d.layers], "_fp8": fp8_sets}, {}, {}
    for fmt, sets in pools.items():
        for arm, kw in (("rows", {}), ("groups", {"row_groups": groups, "rows_per_group": per})):
            def attn(i: int, kw: dict = kw, sets: list = sets) -> torch.Tensor:
                k, ks, v, vs = sets[i]
                return paged_decode_attention(qs[i], k, v, tables, lens, d.scale, k_scale=ks, v_scale=vs, **kw)
            name = f"ragged_{arm}{fmt}"
            timings[name] = time_cuda(name, lambda: [attn(layer % s.distinct_layers) for layer in range(s.layers)],
                                      args.warmup, args.repeats)
            outs[name] = attn(0)
    return timings, {f"ragged_groups{f}_vs_rows_max_abs": max_abs(outs[f"ragged_groups{f}"], outs[f"ragged_rows{f}"])
                     for f in pools}


def _decode_errors(d: DecodeSetup, dense_fn: Callable, best_kw: dict) -> dict:
    """Max-abs errors on layer set 0: Triton and gather vs dense, both vs float32."""
    kv0, q0 = d.layers[0], d.qs[0]
    dense_out = dense_fn(q0, kv0.dense_k, kv0.dense_v, d.scale)
    tri_out = d.triton(q0, kv0, **best_kw)
    ref = reference_fp32(q0, kv0.dense_k, kv0.dense_v, d.scale, rows=4)
    return {
        "triton_vs_dense_max_abs": max_abs(tri_out, dense_out),
        "gather_vs_dense_max_abs": max_abs(d.gather(q0, kv0, dense_fn), dense_out),
        "dense_vs_fp32_ref_max_abs(4 sessions)": max_abs(dense_out[:4], ref),
        "triton_vs_fp32_ref_max_abs(4 sessions)": max_abs(tri_out[:4], ref),
        "triton_default_config_vs_dense_max_abs": max_abs(d.triton(q0, kv0), dense_out),
        "ragged_triton_vs_fp32_ref_max_abs": ragged_check(q0, kv0, d.bt, d.scale),
        "all_finite": bool(torch.isfinite(tri_out).all()),
    }


def bench_decode(s: Shapes, args, results: dict) -> None:
    d = DecodeSetup.build(s)
    timings, best_dense, dense_fn = _time_baselines(d, args)
    sweep, best_kw = _sweep_triton(d, args)
    timings["triton_paged"] = time_cuda("triton_paged", d.step(lambda q, kv: d.triton(q, kv, **best_kw)),
                                        args.warmup, args.repeats)
    fp8_timings, fp8_errors, fp8_sweep = _time_fp8_decode(d, args, best_kw)
    timings.update(fp8_timings)
    default = [r for r in sweep if (r["block_n"], r["num_splits"], r["num_warps"],
                                    r["num_stages"]) == (64, "auto", 4, 2)]
    results["decode"] = {
        "timings": {k: v.summary() for k, v in timings.items()},
        "best_dense": best_dense,
        "triton_best_config": min(sweep, key=lambda r: r["median_ms"]),
        "triton_default_config_sweep_ms": default[0]["median_ms"] if default else None,
        "triton_sweep": sweep,
        "triton_fp8_best_config": min(fp8_sweep, key=lambda r: r["median_ms"]),
        "triton_fp8_sweep": fp8_sweep,
        "errors": {**_decode_errors(d, dense_fn, best_kw), **fp8_errors},
        "kv_bytes_per_step": s.kv_bytes_per_step(),
        "kv_bytes_per_step_fp8": s.kv_bytes_per_step() // (2 * s.head_dim) * (s.head_dim + 4),
        "bandwidth_floor_ms": s.kv_bytes_per_step() / (results["copy_bandwidth_gbs"] * 1e9) * 1e3,
    }
    del d
    torch.cuda.empty_cache()


def _sweep_grid(quick: bool) -> list[tuple[int, int | None, int, int]]:
    """(block_n, num_splits or None for auto, num_warps, num_stages)."""
    if quick:
        return [(64, None, 4, 2), (64, 8, 4, 2)]
    grid = [(bn, sp, 4, 2) for bn in (32, 64, 128) for sp in (None, 4, 8, 16)]
    return grid + [(64, None, 8, 2), (64, None, 4, 3), (64, 4, 4, 3), (32, 8, 4, 3),
                   (64, None, 4, 4)]


def ragged_check(q: torch.Tensor, kv: LayerKV, bt: torch.Tensor, scale: float) -> float:
    """Random lengths 1..T (some ending mid-block): Triton vs per-session float32 attention."""
    from duplexcache.kv.triton_kernels import paged_decode_attention

    gen = torch.Generator().manual_seed(1)
    t = kv.dense_k.shape[2]
    lens = torch.randint(1, t + 1, (q.shape[0],), generator=gen)
    edge = torch.tensor([1, 17, t])[: lens.numel()]  # one token, one past a block, full
    lens[: edge.numel()] = edge
    out = paged_decode_attention(q, kv.paged_k, kv.paged_v, bt, lens.to(torch.int32).cuda(), scale)
    worst = 0.0
    for b in range(0, q.shape[0], 4):  # every 4th session keeps the check quick
        n = int(lens[b])
        ref = reference_fp32(q[b:b + 1], kv.dense_k[b:b + 1, :, :n], kv.dense_v[b:b + 1, :, :n], scale, rows=1)
        worst = max(worst, max_abs(out[b:b + 1], ref))
    return worst


def torch_rerotate_(k_cache: torch.Tensor, ids: torch.Tensor, delta: int, theta: float) -> None:
    """Plain PyTorch: gather listed blocks of all layers, rotate in float32, scatter back."""
    d = k_cache.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=k_cache.device).float() / d))
    ang = float(-delta) * inv
    cos, sin = torch.cat((ang, ang)).cos(), torch.cat((ang, ang)).sin()
    x = k_cache[:, ids].float()  # (L, n, PAGE, Hkv, D)
    rot = torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)
    k_cache[:, ids] = (x * cos + rot * sin).to(k_cache.dtype)


def _rerotate_fp64(k_cache: torch.Tensor, ids: torch.Tensor, delta: int,
                   theta: float) -> torch.Tensor:
    """float64 rotation of the listed blocks by -delta (exact angles), for error bars."""
    d = k_cache.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=k_cache.device).double() / d))
    ang = torch.cat((inv, inv)) * float(-delta)
    x = k_cache[:, ids].double()
    rot = torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)
    return x * ang.cos() + rot * ang.sin()


def _sweep_rerotate(work: torch.Tensor, ids: torch.Tensor, delta: int,
                    theta: float) -> tuple[list[dict], dict]:
    from duplexcache.kv.triton_kernels import rerotate_keys_triton_

    sweep = []
    for rows, warps in ((32, 4), (64, 4), (128, 4), (64, 8), (128, 8)):
        t = time_cuda("sweep", lambda r=rows, w=warps: rerotate_keys_triton_(
            work, ids, delta, theta, check_ids=False, block_rows=r, num_warps=w), 3, 30)
        sweep.append({"block_rows": rows, "num_warps": warps,
                      "median_ms": t.summary()["median_ms"]})
    best = min(sweep, key=lambda r: r["median_ms"])
    return sweep, {"block_rows": best["block_rows"], "num_warps": best["num_warps"]}


def _rerotate_fp8_errors(base: torch.Tensor, ids: torch.Tensor, delta: int, theta: float,
                         ref: torch.Tensor) -> dict:
    """The fused kernel on an fp8 copy of ``base`` vs the torch fp8 path and the float64 rotation."""
    from duplexcache.kv.kv_quant import dequantize_fp8, quantize_fp8
    from duplexcache.kv.rope import rerotate_keys_
    from duplexcache.kv.triton_kernels import rerotate_keys_triton_

    q8, s8 = quantize_fp8(base)
    a8, a_s, b8, b_s = q8.clone(), s8.clone(), q8.clone(), s8.clone()
    rerotate_keys_triton_(a8, ids, delta, theta, k_scale=a_s)
    # A layer list keeps rerotate_keys_ on its torch loop (all layers on CUDA go to the kernel).
    rerotate_keys_(b8, ids, delta, theta, layers=list(range(base.shape[0])), k_scale=b_s)
    got = dequantize_fp8(a8[:, ids], a_s[:, ids], torch.float32)
    return {
        "triton_fp8_vs_torch_fp8_max_abs": max_abs(got, dequantize_fp8(b8[:, ids], b_s[:, ids], torch.float32)),
        "triton_fp8_bytes_equal_to_torch_fraction": float((a8.view(torch.uint8) == b8.view(torch.uint8))
                                                          .float().mean()),
        "triton_fp8_vs_fp64_max_abs": max_abs(got, ref),
    }


def bench_rerotate(s: Shapes, args, results: dict) -> None:
    from duplexcache.kv.triton_kernels import rerotate_keys_triton_

    n_blocks = math.ceil(s.kept / PAGE)
    num_blocks = 1 + n_blocks + 64  # a few unlisted blocks must stay untouched
    gen = torch.Generator().manual_seed(2)
    ids = (torch.randperm(num_blocks - 1, generator=gen)[:n_blocks] + 1).cuda()
    base = torch.randn(s.layers, num_blocks, PAGE, s.kv_heads, s.head_dim, dtype=torch.bfloat16, device="cuda")
    delta = 2000

    a, b = base.clone(), base.clone()
    torch_rerotate_(a, ids, delta, s.theta)
    rerotate_keys_triton_(b, ids, delta, s.theta)
    ref = _rerotate_fp64(base, ids, delta, s.theta)
    unlisted = torch.ones(num_blocks, dtype=torch.bool, device="cuda")
    unlisted[ids] = False
    errors = {
        "triton_vs_torch_max_abs": max_abs(a, b),
        "triton_vs_torch_max_rel": float(((a.float() - b.float()).abs() / a.float().abs().clamp_min(1e-3)).max()),
        "unlisted_blocks_untouched": bool(torch.equal(b[:, unlisted], base[:, unlisted])),
        "torch_vs_fp64_max_abs": max_abs(a[:, ids], ref),
        "triton_vs_fp64_max_abs": max_abs(b[:, ids], ref),
        "bit_equal_to_torch_fraction": float((a == b).float().mean()),
    }
    errors.update(_rerotate_fp8_errors(base, ids, delta, s.theta, ref))
    del ref
    work = base.clone()
    sweep, best_kw = _sweep_rerotate(work, ids, delta, s.theta)
    reps = args.rerotate_repeats
    timings = {
        "torch_rerotate": time_cuda("torch_rerotate", lambda: torch_rerotate_(work, ids, delta, s.theta),
                                    args.warmup, reps),
        "triton_rerotate": time_cuda("triton_rerotate", lambda: rerotate_keys_triton_(
            work, ids, delta, s.theta, check_ids=False, **best_kw), args.warmup, reps),
        "triton_rerotate_checked_ids": time_cuda("triton_rerotate_checked_ids", lambda: rerotate_keys_triton_(
            work, ids, delta, s.theta, **best_kw), args.warmup, reps),
    }
    from duplexcache.kv.kv_quant import quantize_fp8

    work8, scales8 = quantize_fp8(base)
    timings["triton_rerotate_fp8"] = time_cuda("triton_rerotate_fp8", lambda: rerotate_keys_triton_(
        work8, ids, delta, s.theta, k_scale=scales8, check_ids=False, **best_kw), args.warmup, reps)
    del work8, scales8
    from duplexcache.kv.rope import rerotate_keys_   # the project's CPU/reference path (per-layer loop)
    timings["kv_rope_rerotate_keys_"] = time_cuda("kv_rope_rerotate_keys_", lambda: rerotate_keys_(
        work, ids, delta, s.theta), args.warmup, args.repeats)
    moved = 2 * s.layers * n_blocks * PAGE * s.kv_heads * s.head_dim * 2  # read + write
    results["rerotate"] = {
        "timings": {k: v.summary() for k, v in timings.items()},
        "errors": errors,
        "triton_best_config": min(sweep, key=lambda r: r["median_ms"]),
        "triton_sweep": sweep,
        "kept_tokens": n_blocks * PAGE,
        "bytes_moved": moved,
        "bandwidth_floor_ms": moved / (results["copy_bandwidth_gbs"] * 1e9) * 1e3,
    }


# ----------------------------------------------------------------------------- report
def markdown(results: dict, s: Shapes) -> str:
    lines = [f"# Stage 0 GPU bench\n", f"hardware: {results['hardware']}  ",
             f"copy bandwidth (read+write): {results['copy_bandwidth_gbs']:.0f} GB/s  ",
             f"shapes: B={s.batch} T={s.seq_len} layers={s.layers} Hq={s.q_heads} Hkv={s.kv_heads} D={s.head_dim} "
             f"bf16; {s.distinct_layers} distinct K/V sets cycled over the layers\n"]
    for part in ("decode", "rerotate"):
        if part not in results:
            continue
        r = results[part]
        lines += [f"## {part} (floor {r['bandwidth_floor_ms']:.2f} ms)\n",
                  "| path | median ms | min | max | repeats |", "|---|---|---|---|---|"]
        lines += [f"| {t['name']} | {t['median_ms']:.3f} | {t['min_ms']:.3f} | {t['max_ms']:.3f} | {t['repeats']} |"
                  for t in r["timings"].values()]
        lines.append("")
        lines += [f"- {k}: {v}" for k, v in r["errors"].items()]
        if part == "decode":
            lines.append(f"- best dense: {r['best_dense']}")
        lines.append(f"- triton best config: {r['triton_best_config']}")
        if "triton_fp8_best_config" in r:
            lines.append(f"- triton fp8 best config: {r['triton_fp8_best_config']}")
        lines.append("")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rerotate-repeats", type=int, default=100,
                   help="repeats for the sub-millisecond re-rotation timings")
    p.add_argument("--distinct-layers", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="two kernel configs instead of 17")
    p.add_argument("--skip-decode", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.repeats < 20 or args.rerotate_repeats < 20:
        return usage_error("kernels", "--repeats and --rerotate-repeats must be >= 20")
    if not torch.cuda.is_available():
        print("duplexcache bench kernels: needs CUDA (the Triton kernels run on the GPU)", file=sys.stderr)
        return 1
    import triton

    s = Shapes(distinct_layers=args.distinct_layers)
    t0 = time.time()
    results: dict = {"hardware": hardware_line("cuda:0", f"triton {triton.__version__}"), "shapes": s.__dict__,
                     "copy_bandwidth_gbs": copy_bandwidth_gbs(), "repeats": args.repeats,
                     "warmup": args.warmup}
    if not args.skip_decode:
        bench_decode(s, args, results)
    # Second, so the sub-millisecond kernel is timed on a card already at its working clocks.
    bench_rerotate(s, args, results)
    results["wall_s"] = time.time() - t0
    md = markdown(results, s)
    write_results(args.out, results, md)
    print(md)  # CLI output
    return 0


if __name__ == "__main__":
    raise SystemExit(alias_main("kernels"))
