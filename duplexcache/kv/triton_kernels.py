"""GPU paths for the Thinker's paged KV cache (Triton).

Two kernels live here:

* ``paged_decode_attention``: one query token per sequence attends to all of its cached
  tokens, reading K/V blocks *in place* through the block table (no gather copy).
  Flash-decoding layout: each sequence's tokens are cut into ``num_splits`` ranges; one
  program handles one (sequence, kv head, split) and all q heads of that GQA group, with an
  online softmax; a second small kernel merges the splits by their log-sum-exp. A ragged step
  runs as token rows; ``row_groups`` let one program take several tokens of one sequence, which
  read (and dequantize) each K/V tile once (kv/kernel_work.py; docs/engine.md, "Row groups").
* ``rerotate_keys_triton_``: the window compaction's in-place re-rotation of kept keys by
  ``-delta`` (NeoX half-split RoPE, float32 angle math), one launch over all layers and all
  listed blocks.

Both take an fp8 pool too (``precision.kv_cache_dtype: fp8_e4m3``, kv/kv_quant.py): e4m3
values plus one float32 scale per (token, kv head), passed as ``k_scale``/``v_scale``. The
decode kernel dequantizes each loaded row in registers (value * scale, cast to q's dtype);
the re-rotation dequantizes, rotates and re-quantizes each row with a fresh scale. Without
scales the scaled code is compiled out (``HAS_SCALES``), so the float path is unchanged.

Cache layout (see kv/paged_attention.py)::

    k_cache_layer: (num_blocks, block_size, num_kv_heads, head_dim)
    token i of a sequence -> block_tables[b, i // block_size], slot i % block_size
    block 0 is the null block: table padding points at it, so masked loads stay in bounds.

Triton is optional. Without it (or without CUDA, unless ``TRITON_INTERPRET=1`` is set before
this module is imported, which runs the kernels on CPU tensors for tests) the public
functions raise ``TritonUnavailableError``; the CPU reference lives in kv/paged_attention.py.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from duplexcache.kv.kernel_work import default_num_splits, num_sms
from duplexcache.kv.kv_quant import FP8_E4M3_MAX, FP8_SCALE_FLOOR

logger = logging.getLogger(__name__)

try:  # Triton is an optional GPU dependency.
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR: Exception | None = None
except Exception as exc:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    _TRITON_IMPORT_ERROR = exc

_LOG2E = 1.4426950408889634


class TritonUnavailableError(RuntimeError):
    """Raised when a Triton kernel is requested but cannot run here."""


# Triton decides at decoration time whether a kernel is compiled or interpreted, so what
# counts is the variable's value when this module was imported, not its value now.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def interpreter_enabled() -> bool:
    """True when the kernels here were built for Triton's CPU interpreter
    (``TRITON_INTERPRET=1`` when this module was imported)."""
    return triton is not None and _INTERPRETED


def triton_available(device: torch.device | str | None = None) -> bool:
    """Whether the kernels here can run on tensors of ``device`` (default: CUDA)."""
    if triton is None:
        return False
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type == "cuda":
        return torch.cuda.is_available()
    return interpreter_enabled()


def _require_runnable(device: torch.device) -> None:
    if triton is None:
        raise TritonUnavailableError(
            f"Triton is not installed ({_TRITON_IMPORT_ERROR}); use the PyTorch reference "
            "backend in duplexcache.kv.paged_attention")
    if device.type == "cuda":
        return
    if not interpreter_enabled():
        raise TritonUnavailableError(
            f"Triton kernels need CUDA tensors, got device {device}; use the PyTorch reference "
            "backend in duplexcache.kv.paged_attention (or set TRITON_INTERPRET=1 before "
            "importing this module to run the kernels on CPU for testing)")


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


# --------------------------------------------------------------------------------------
# Kernels (defined only when Triton imports).
# --------------------------------------------------------------------------------------
if triton is not None:

    # The split count is a runtime argument, not a constexpr: a ragged step can pick any count
    # from 1 to ~22 (default_num_splits of its row count), and as a constexpr each count was its
    # own compile (tiny's Talker: 132 variants, ~80 s of a cold first start on an H100). Neither
    # it nor the strides of the log-sum-exp parts (num_q_heads x num_splits, num_splits) are
    # specialized on (Triton would compile apart counts equal to 1 or whose stride is a
    # multiple of 16), so only the merge's BLOCK_S (a power of two) still varies.
    _SPLIT_ARGS = ["num_splits", "stride_lb", "stride_lh"]

    @triton.jit(do_not_specialize=_SPLIT_ARGS)
    def _paged_decode_split_kernel(
        Q, K, V, BT, SL, OUT_PART, LSE_PART,
        KS, VS,  # fp8 pools: (num_blocks, block_size, Hkv) float32 scales; unused otherwise
        GS, GC,  # GROUPED: (programs,) int32 first row and row count of each program's group
        qk_scale_log2,  # softmax scale * log2(e): the softmax runs in base 2
        stride_qb, stride_qh,
        stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh,
        stride_ksb, stride_kst, stride_ksh,
        stride_vsb, stride_vst, stride_vsh,
        stride_btb,
        stride_ob, stride_oh, stride_os,
        stride_lb, stride_lh,
        num_splits,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr, HAS_SCALES: tl.constexpr,
        GROUPED: tl.constexpr, ROWS: tl.constexpr,
    ):
        """One program = (row group, kv head, split s); all GROUP q heads of the kv head.

        A row is one query token with its own causal length ``SL[row]`` and block-table row.
        Without GROUPED a group is one row (a decode step: one program per sequence). With
        GROUPED, program g takes rows ``GS[g] .. GS[g] + GC[g] - 1`` (at most ROWS, consecutive
        tokens of one sequence, GC = 0: an idle program): they share the first row's block
        table, so each K/V tile is loaded (and, fp8, dequantized) once for all of them, and
        each row masks the keys past its own length. The q tile holds ROWS x GROUP rows
        (token-major) padded to BLOCK_G >= 16, tl.dot's minimum; padding rows are never stored.
        With HAS_SCALES, K/V tiles are e4m3 and each token row is dequantized in registers
        (value * its scale, cast to q's dtype) before its dot, as the reference path
        dequantizes before SDPA.
        """
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)

        # The group's rows are in causal order: its last row is the longest, and the splits
        # are cut from that length (a decode row: its own).
        if GROUPED:
            first = tl.load(GS + pid)
            count = tl.load(GC + pid)
            seq_len = tl.load(SL + first + count - 1, mask=count > 0, other=0)
        else:
            first = pid
            count = 1
            seq_len = tl.load(SL + first)
        # Split length is a multiple of BLOCK_N so every tile but the last one is full.
        per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, seq_len)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, HEAD_DIM)
        token = offs_g // GROUP   # the row's token within the group
        g_mask = (offs_g < ROWS * GROUP) & (token < count)
        rows = first + token
        row_len = tl.load(SL + rows, mask=g_mask, other=0)   # each row's causal length
        heads = kvh * GROUP + offs_g % GROUP
        q_ptrs = Q + rows.to(tl.int64)[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=g_mask[:, None], other=0.0)  # (BLOCK_G, D)

        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)

        bt_row = BT + first.to(tl.int64) * stride_btb
        for t0 in range(start, end, BLOCK_N):
            offs_n = t0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            # Out-of-range tokens read the null block 0, which always exists.
            blk = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
            slot = offs_n % PAGE
            k_row = K + blk * stride_kb + slot * stride_kt + kvh * stride_kh  # (BLOCK_N,)
            k = tl.load(k_row[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
            if HAS_SCALES:
                ks = tl.load(KS + blk * stride_ksb + slot * stride_kst + kvh * stride_ksh,
                             mask=n_mask, other=0.0)
                k = (k.to(tl.float32) * ks[:, None]).to(Q.dtype.element_ty)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
            s = tl.where(n_mask[None, :] & (offs_n[None, :] < row_len[:, None]), s,
                         float("-inf"))  # (BLOCK_G, BLOCK_N)

            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row with no key yet (a short row of a group, a padding row) keeps m = -inf;
            # exp2 against 0 keeps its alpha and p at 0 instead of NaN (-inf - -inf).
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_ref)  # first tile: exp2(-inf) = 0
            p = tl.exp2(s - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)

            v_row = V + blk * stride_vb + slot * stride_vt + kvh * stride_vh
            v = tl.load(v_row[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
            if HAS_SCALES:
                vs = tl.load(VS + blk * stride_vsb + slot * stride_vst + kvh * stride_vsh,
                             mask=n_mask, other=0.0)
                v = (v.to(tl.float32) * vs[:, None]).to(Q.dtype.element_ty)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        # An empty split (start >= end) leaves l_i = 0 and m_i = -inf: store lse = -inf and
        # zeros so the merge gives it no weight.
        has = l_i > 0.0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))

        o_ptrs = (OUT_PART + rows.to(tl.int64)[:, None] * stride_ob + heads[:, None] * stride_oh
                  + split * stride_os + offs_d[None, :])
        tl.store(o_ptrs, out, mask=g_mask[:, None])
        tl.store(LSE_PART + rows.to(tl.int64) * stride_lb + heads * stride_lh + split, lse,
                 mask=g_mask)

    @triton.jit(do_not_specialize=_SPLIT_ARGS)
    def _paged_decode_merge_kernel(
        OUT_PART, LSE_PART, OUT,
        stride_ob, stride_oh, stride_os,
        stride_lb, stride_lh,
        stride_outb, stride_outh,
        num_splits,
        BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):
        """One program = (sequence b, q head): weight each split by 2^(lse_s - max lse)."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, HEAD_DIM)
        s_mask = offs_s < num_splits

        lse = tl.load(LSE_PART + b.to(tl.int64) * stride_lb + h * stride_lh + offs_s,
                      mask=s_mask, other=float("-inf"))
        m = tl.max(lse, axis=0)
        m = tl.where(m == float("-inf"), 0.0, m)  # seq_len 0: every split empty -> zeros
        w = tl.exp2(lse - m)
        denom = tl.sum(w, axis=0)
        denom = tl.where(denom > 0.0, denom, 1.0)

        o_ptrs = (OUT_PART + b.to(tl.int64) * stride_ob + h * stride_oh
                  + offs_s[:, None] * stride_os + offs_d[None, :])
        parts = tl.load(o_ptrs, mask=s_mask[:, None], other=0.0)  # (BLOCK_S, D)
        out = tl.sum(parts * w[:, None], axis=0) / denom
        tl.store(OUT + b.to(tl.int64) * stride_outb + h * stride_outh + offs_d,
                 out.to(OUT.dtype.element_ty))

    @triton.jit
    def _rerotate_kernel(
        KC, BIDS, COS, SIN,  # COS/SIN: (D/2,) float32 tables of the angle -delta * inv_freq
        KS,  # fp8 pools: (L, num_blocks, block_size, Hkv) float32 scales; unused otherwise
        num_ids,
        stride_kl, stride_kb, stride_kt, stride_kh,
        stride_sl, stride_sb, stride_st, stride_sh,
        NUM_KV_HEADS: tl.constexpr, PAGE: tl.constexpr, HALF: tl.constexpr,
        BLOCK_R: tl.constexpr, HAS_SCALES: tl.constexpr,
        FP8_MAX: tl.constexpr, SCALE_FLOOR: tl.constexpr,
    ):
        """One program = BLOCK_R (token, kv head) rows of one listed block in one layer.

        With HAS_SCALES the rows are e4m3: each is dequantized with its scale, rotated, and
        re-quantized with a fresh scale (amax / FP8_MAX, floored), as kv_quant.quantize_fp8
        does. A row's two halves are in one program, so its amax needs no cross-program step.
        """
        pid = tl.program_id(0)
        layer = pid // num_ids
        i = pid % num_ids
        blk = tl.load(BIDS + i).to(tl.int64)

        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_mask = rows < PAGE * NUM_KV_HEADS
        t = rows // NUM_KV_HEADS
        h = rows % NUM_KV_HEADS
        base = KC + layer.to(tl.int64) * stride_kl + blk * stride_kb + t * stride_kt + h * stride_kh

        offs = tl.arange(0, HALF)
        cos = tl.load(COS + offs)[None, :]
        sin = tl.load(SIN + offs)[None, :]

        p1 = base[:, None] + offs[None, :]
        p2 = p1 + HALF
        x1 = tl.load(p1, mask=r_mask[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(p2, mask=r_mask[:, None], other=0.0).to(tl.float32)
        if HAS_SCALES:
            s_ptr = (KS + layer.to(tl.int64) * stride_sl + blk * stride_sb + t * stride_st
                     + h * stride_sh)
            s_old = tl.load(s_ptr, mask=r_mask, other=1.0)
            x1 = x1 * s_old[:, None]
            x2 = x2 * s_old[:, None]
        # NeoX rotate_half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
        y1 = x1 * cos - x2 * sin
        y2 = x2 * cos + x1 * sin
        if HAS_SCALES:
            amax = tl.maximum(tl.max(tl.abs(y1), axis=1), tl.max(tl.abs(y2), axis=1))
            s_new = tl.maximum(amax / FP8_MAX, SCALE_FLOOR)
            y1 = tl.minimum(tl.maximum(y1 / s_new[:, None], -FP8_MAX), FP8_MAX)
            y2 = tl.minimum(tl.maximum(y2 / s_new[:, None], -FP8_MAX), FP8_MAX)
            tl.store(s_ptr, s_new, mask=r_mask)
        tl.store(p1, y1.to(KC.dtype.element_ty), mask=r_mask[:, None])
        tl.store(p2, y2.to(KC.dtype.element_ty), mask=r_mask[:, None])


# --------------------------------------------------------------------------------------
# Paged decode attention
# --------------------------------------------------------------------------------------
def _check_decode_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be (batch, num_q_heads, head_dim), got shape {tuple(q.shape)}")
    if k.dim() != 4 or v.shape != k.shape:
        raise ValueError("k_cache_layer and v_cache_layer must both be (num_blocks, block_size, "
                         f"num_kv_heads, head_dim); got {tuple(k.shape)} and {tuple(v.shape)}")
    batch, num_q_heads, head_dim = q.shape
    _, page, num_kv_heads, kd = k.shape
    if kd != head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, the cache has {kd}")
    if not _is_pow2(head_dim) or head_dim < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    if v.dtype != k.dtype or (q.dtype != k.dtype and k.dtype != torch.float8_e4m3fn):
        raise ValueError(f"dtype mismatch: q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k_cache_layer and v_cache_layer need a contiguous last dimension")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be (batch={batch}, max_blocks), got "
                         f"{tuple(block_tables.shape)}")
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be (batch={batch},), got {tuple(seq_lens.shape)}")
    if block_tables.dtype not in (torch.int32, torch.int64) or seq_lens.dtype not in (
            torch.int32, torch.int64):
        raise ValueError("block_tables and seq_lens must be int32 or int64, got "
                         f"{block_tables.dtype} and {seq_lens.dtype}")
    devices = {t.device for t in (q, k, v, block_tables, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")


def _check_scales(k: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """Whether the cache is fp8 with scales; refuses a half-given or misshapen pair."""
    if k_scale is None and v_scale is None:
        if k.dtype == torch.float8_e4m3fn:
            raise ValueError("an fp8 KV cache needs k_scale and v_scale (one float32 per token and kv head)")
        return False
    if k_scale is None or v_scale is None:
        raise ValueError("k_scale and v_scale go together")
    if k.dtype != torch.float8_e4m3fn:
        raise ValueError(f"scales are for an fp8 (float8_e4m3fn) cache, got {k.dtype}")
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc.shape != k.shape[:3] or sc.dtype != torch.float32 or sc.device != k.device:
            raise ValueError(f"{name} must be float32 (num_blocks, block_size, num_kv_heads) = "
                             f"{tuple(k.shape[:3])} on {k.device}, got {sc.dtype} "
                             f"{tuple(sc.shape)} on {sc.device}")
    return True


def paged_decode_attention(
    q: torch.Tensor,
    k_cache_layer: torch.Tensor,
    v_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    row_groups: tuple[torch.Tensor, torch.Tensor] | None = None,
    rows_per_group: int = 1,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Decode attention over a paged KV cache, reading blocks in place.

    Args:
        q: (B, Hq, D), one query token per row (already RoPE'd): a decode step's one token per
            sequence, or a ragged step's tokens as rows (each with its own table row and length).
        k_cache_layer, v_cache_layer: (num_blocks, block_size, Hkv, D) for one layer.
        block_tables: (B, max_blocks) int32, padded with the null block 0.
        seq_lens: (B,) int32, number of cached tokens each query attends to (including its
            own token, which must already be written). Contract (not checked, it would cost a
            device sync): ``seq_lens[b] <= max_blocks * block_size``. A row with
            ``seq_lens[b] == 0`` (batch padding) returns zeros.
        scale: softmax scale, usually ``D ** -0.5``.
        k_scale, v_scale: for an fp8 (float8_e4m3fn) cache, the layer's float32 scales
            (num_blocks, block_size, Hkv); each loaded row is dequantized to q's dtype in
            registers. None for a cache in q's dtype.
        num_splits: sequence splits per (row group, kv head); default from the SM count and B.
        row_groups: ``(first_row, row_count)``, each (programs,) int32 on q's device: program
            g takes rows ``first_row[g] .. + row_count[g] - 1``, consecutive tokens of one
            sequence in causal order (``row_count`` 0: an idle program), which share each K/V
            tile it loads and the first row's table (kernel_work.row_groups_host). Every row must
            be in exactly one group. None: one row per program.
        rows_per_group: with ``row_groups``, the most rows of a group (``tokens_per_program``).
        block_n: keys per tile; default 64 for a 16-bit cache, 128 for fp8 (whose tile carries
            half the bytes: 22.7 -> 21.4 ms at B=64, T=8000 on an H100, docs/results/ragged_groups_h100_2026-12-07).

    Returns:
        (B, Hq, D) in q's dtype.
    """
    _check_decode_inputs(q, k_cache_layer, v_cache_layer, block_tables, seq_lens)
    has_scales = _check_scales(k_cache_layer, k_scale, v_scale)
    _require_runnable(q.device)
    if block_n is None:
        block_n = 128 if has_scales else 64
    if not _is_pow2(block_n) or block_n < 16:
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    batch, num_q_heads, head_dim = q.shape
    page, num_kv_heads = k_cache_layer.shape[1], k_cache_layer.shape[2]
    group = num_q_heads // num_kv_heads
    max_tokens = block_tables.shape[1] * page
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, max_tokens, num_sms(q.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    out = torch.empty_like(q)
    if batch == 0:
        return out
    out_part = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32,
                           device=q.device)
    lse_part = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    # float32 inputs keep full precision (Triton's default dot on float32 is tf32); 16-bit
    # inputs take the default.
    precision = "ieee" if q.dtype == torch.float32 else None
    # Without scales the kernel never reads KS/VS (HAS_SCALES is compiled out); K's scale-shaped
    # stand-in only gives the pointer arguments a tensor.
    ks = k_scale if has_scales else k_cache_layer[..., 0]
    vs = v_scale if has_scales else v_cache_layer[..., 0]
    rows = rows_per_group if row_groups is not None else 1
    if rows < 1:
        raise ValueError(f"rows_per_group must be >= 1, got {rows}")
    if row_groups is not None:
        first_row, row_count = row_groups
        if first_row.shape != row_count.shape or first_row.dim() != 1 or first_row.dtype != torch.int32 \
                or row_count.dtype != torch.int32:
            raise ValueError("row_groups must be two (programs,) int32 tensors")
        programs = first_row.shape[0]
    else:
        first_row = row_count = seq_lens   # stand-ins the kernel never reads
        programs = batch
    _paged_decode_split_kernel[(programs, num_kv_heads, num_splits)](
        q, k_cache_layer, v_cache_layer, block_tables, seq_lens, out_part, lse_part, ks, vs,
        first_row, row_count,
        float(scale) * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache_layer.stride(0), k_cache_layer.stride(1), k_cache_layer.stride(2),
        v_cache_layer.stride(0), v_cache_layer.stride(1), v_cache_layer.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        vs.stride(0), vs.stride(1), vs.stride(2),
        block_tables.stride(0),
        out_part.stride(0), out_part.stride(1), out_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        num_splits,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(rows * group)), HEAD_DIM=head_dim,
        PAGE=page, BLOCK_N=block_n, DOT_PRECISION=precision,
        HAS_SCALES=has_scales, GROUPED=row_groups is not None, ROWS=rows,
        num_warps=num_warps, num_stages=num_stages,
    )
    _paged_decode_merge_kernel[(batch, num_q_heads)](
        out_part, lse_part, out,
        out_part.stride(0), out_part.stride(1), out_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        out.stride(0), out.stride(1),
        num_splits, BLOCK_S=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
        num_warps=4,
    )
    return out


# --------------------------------------------------------------------------------------
# Fused re-rotation of kept keys
# --------------------------------------------------------------------------------------
def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """NeoX inverse frequencies in float32: theta ** (-2i / head_dim), i < head_dim / 2.

    Computed on ``device`` itself, as the forward RoPE computes them there."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta ** exponents)


_INV_FREQ_CACHE: dict[tuple[int, float, str], torch.Tensor] = {}


def _cached_inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    # Built once per device: a per-call host tensor would need a host-to-device copy, which
    # stalls the host for longer than the kernel itself runs.
    key = (head_dim, float(theta), str(device))
    if key not in _INV_FREQ_CACHE:
        _INV_FREQ_CACHE[key] = rope_inv_freq(head_dim, theta, device)
    return _INV_FREQ_CACHE[key]


def _block_ids_tensor(block_ids: torch.Tensor | Sequence[int], num_blocks: int,
                      device: torch.device, check_ids: bool) -> torch.Tensor:
    ids = block_ids if isinstance(block_ids, torch.Tensor) else torch.tensor(
        list(block_ids), dtype=torch.int64)
    if ids.dim() != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {tuple(ids.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_ids must be an integer tensor, got {ids.dtype}")
    if check_ids and ids.numel() > 0:
        # One host sync; compaction is rare, and a duplicate id would rotate a key twice.
        host = ids.cpu()
        if int(host.min()) < 1 or int(host.max()) >= num_blocks:
            raise ValueError(f"block_ids must lie in [1, {num_blocks}) (block 0 is the null "
                             f"block), got min {int(host.min())} max {int(host.max())}")
        if torch.unique(host).numel() != host.numel():
            raise ValueError("block_ids contains duplicates: a kept key would be rotated twice")
    return ids.to(device=device)


def rerotate_keys_triton_(
    k_cache: torch.Tensor,
    block_ids: torch.Tensor | Sequence[int],
    delta: int,
    theta: float,
    *,
    k_scale: torch.Tensor | None = None,
    check_ids: bool = True,
    block_rows: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """Rotate every key of the listed blocks, in every layer, by -delta positions, in place.

    fp8 caches (``float8_e4m3fn``) pass ``k_scale`` (L, num_blocks, block_size, Hkv) float32:
    each (token, kv head) row is dequantized, rotated, and re-quantized with a fresh scale,
    which is written back to ``k_scale`` in place.

    ``k_cache`` is (L, num_blocks, block_size, Hkv, D) and contiguous in its last dim; V is
    never touched. Angles are float32 ``(-delta) * inv_freq`` (cos/sin by torch, once); the
    rotation runs in float32 and is cast back once. ``check_ids`` validates ids on the host
    (range, no null block, no duplicates); it costs one device sync when ids live on the GPU.
    Each listed block is read and written by exactly one program, so in place is race-free.
    Returns ``k_cache``.
    """
    if k_cache.dim() != 5:
        raise ValueError("k_cache must be (num_layers, num_blocks, block_size, num_kv_heads, "
                         f"head_dim), got shape {tuple(k_cache.shape)}")
    if isinstance(delta, bool) or not isinstance(delta, int):
        raise ValueError(f"delta must be an int number of positions, got {delta!r}")
    num_layers, num_blocks, page, num_kv_heads, head_dim = k_cache.shape
    if head_dim % 2 or not _is_pow2(head_dim // 2):
        raise ValueError(f"head_dim must be even with a power-of-two half, got {head_dim}")
    if k_cache.stride(-1) != 1:
        raise ValueError("k_cache needs a contiguous last dimension")
    if not _is_pow2(block_rows):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    has_scales = k_scale is not None
    if has_scales != (k_cache.dtype == torch.float8_e4m3fn):
        raise ValueError(f"k_scale goes with an fp8 (float8_e4m3fn) cache and only with it; "
                         f"cache {k_cache.dtype}, k_scale {'given' if has_scales else 'missing'}")
    if has_scales and (k_scale.shape != k_cache.shape[:4] or k_scale.dtype != torch.float32
                       or k_scale.device != k_cache.device):
        raise ValueError(f"k_scale must be float32 {tuple(k_cache.shape[:4])} on {k_cache.device}, "
                         f"got {k_scale.dtype} {tuple(k_scale.shape)} on {k_scale.device}")
    _require_runnable(k_cache.device)
    ids = _block_ids_tensor(block_ids, num_blocks, k_cache.device, check_ids)
    if delta == 0 or ids.numel() == 0 or num_layers == 0:
        return k_cache
    # The D/2 angles are computed once by torch in float32, as the forward RoPE computes
    # them; device cos/sin in the kernel could take a fast approximate path whose error grows
    # with |angle| (here up to |delta| radians).
    angle = float(-delta) * _cached_inv_freq(head_dim, theta, k_cache.device)
    cos, sin = angle.cos(), angle.sin()
    grid = (num_layers * ids.numel(), triton.cdiv(page * num_kv_heads, block_rows))
    ks = k_scale if has_scales else k_cache[..., 0]  # a stand-in the kernel never reads
    _rerotate_kernel[grid](
        k_cache, ids, cos, sin, ks, ids.numel(),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        ks.stride(0), ks.stride(1), ks.stride(2), ks.stride(3),
        NUM_KV_HEADS=num_kv_heads, PAGE=page, HALF=head_dim // 2, BLOCK_R=block_rows,
        HAS_SCALES=has_scales, FP8_MAX=FP8_E4M3_MAX, SCALE_FLOOR=FP8_SCALE_FLOOR,
        num_warps=num_warps,
    )
    return k_cache


__all__ = [
    "TritonUnavailableError",
    "interpreter_enabled",
    "paged_decode_attention",
    "rerotate_keys_triton_",
    "rope_inv_freq",
    "triton_available",
]
