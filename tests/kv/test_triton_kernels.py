"""Triton kernels, run on CPU through Triton's interpreter (TRITON_INTERPRET=1).

Each kernel is compared with an independent plain-PyTorch reference (float64) on the same
random data. Shapes are tiny: the interpreter executes every program in numpy.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from triton_interpreter import rerun_unless_interpreted, skip_unless_interpreted  # noqa: E402

# The interpreter must be on before any Triton function is decorated, and it is process-wide:
# setting it here at import would turn every kernel of the collecting process into interpreted
# code, so CUDA tests collected after this module (test_paged_attention, test_decode_graphs)
# would run their kernels in the interpreter on a GPU machine. So this module never touches the
# environment: in an ordinary run one test reruns this file in a fresh process with
# TRITON_INTERPRET=1, where the tests below run directly.
triton = pytest.importorskip("triton", reason="triton is not installed: kernels cannot be "
                             "interpreted on CPU")

import numpy as np  # noqa: E402

import duplexcache.kv.triton_kernels as tk  # noqa: E402
from duplexcache.kv.kernel_work import row_groups_host  # noqa: E402

_TRITON_VER = tuple(int(x) for x in triton.__version__.split(".")[:2])
_NUMPY_VER = tuple(int(x) for x in np.__version__.split(".")[:2])
if _TRITON_VER < (3, 8) and _NUMPY_VER >= (2, 4):
    pytest.skip(f"triton {triton.__version__}'s interpreter calls int() on 1-element arrays, "
                f"which numpy {np.__version__} refuses, in every loop with a runtime bound; "
                "use triton>=3.8 (fixed there) to run these tests", allow_module_level=True)

from triton.runtime.interpreter import InterpretedFunction as _INTERPRETED_FN  # noqa: E402
_INTERP_OK = (os.environ.get("TRITON_INTERPRET", "0") == "1"
              and isinstance(triton.language.standard.sum, _INTERPRETED_FN)
              and isinstance(tk._rerotate_kernel, _INTERPRETED_FN))

_RUNNER = "test_kernels_in_fresh_interpreter_process"


@pytest.fixture(autouse=True)
def _interpret_env(request):
    skip_unless_interpreted(request, _INTERP_OK, _RUNNER)


def test_kernels_in_fresh_interpreter_process():
    out = rerun_unless_interpreted(_INTERP_OK, __file__)
    # The rerun must really interpret the kernels: all but the runner and the bf16 test pass.
    assert " passed" in out and "failed" not in out, out[-2000:]
    assert "not interpreted in this process" not in out, out[-2000:]


PAGE = 16
FP8 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------- helpers
def _make_paged(seq_lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                gen: torch.Generator, extra_blocks: int = 3):
    """Random cache with shuffled block ids; returns (k, v, block_tables, tables as lists)."""
    need = [math.ceil(n / PAGE) for n in seq_lens]
    num_blocks = 1 + sum(need) + extra_blocks
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # never block 0
    tables, pos = [], 0
    for n in need:
        tables.append(perm[pos:pos + n])
        pos += n
    max_blocks = max(1, max(need))
    bt = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for b, row in enumerate(tables):
        bt[b, :len(row)] = torch.tensor(row, dtype=torch.int32)
    shape = (num_blocks, PAGE, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    return k, v, bt, tables


def _reference_decode(q, k, v, tables, seq_lens, scale):
    """Gather each sequence token by token, then softmax attention in float64."""
    batch, num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[2]
    out = torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float64)
    for b, n in enumerate(seq_lens):
        if n == 0:
            continue
        idx = [(tables[b][i // PAGE], i % PAGE) for i in range(n)]
        kb = torch.stack([k[blk, off] for blk, off in idx]).double()  # (n, Hkv, D)
        vb = torch.stack([v[blk, off] for blk, off in idx]).double()
        for h in range(num_q_heads):
            s = (kb[:, h // group] @ q[b, h].double()) * scale  # (n,)
            out[b, h] = torch.softmax(s, dim=0) @ vb[:, h // group]
    return out


# ----------------------------------------------------------------------------- decode
DECODE_CASES = [
    # (seq_lens, Hq, Hkv, D, num_splits, block_n)
    ([1, 16, 17, 45], 4, 2, 32, 1, 16),    # one split; lengths at / just past a page edge
    ([100, 33, 64, 5], 4, 2, 32, 3, 16),   # several splits, some empty for short rows
    ([70, 0, 129], 8, 2, 16, 4, 32),       # GQA group 4, a padding row (seq_len 0)
    ([50, 90], 2, 2, 64, 8, 64),           # MHA (group 1, padded to 16 rows), many empty splits
    ([200], 6, 2, 32, None, 32),           # group 3 (not a power of two), default splits
]


@pytest.mark.parametrize("seq_lens,hq,hkv,d,splits,block_n", DECODE_CASES)
def test_paged_decode_matches_reference(seq_lens, hq, hkv, d, splits, block_n):
    gen = torch.Generator().manual_seed(1234 + sum(seq_lens))
    k, v, bt, tables = _make_paged(seq_lens, hkv, d, torch.float32, gen)
    q = torch.randn(len(seq_lens), hq, d, generator=gen)
    scale = d ** -0.5
    out = tk.paged_decode_attention(q, k, v, bt, torch.tensor(seq_lens, dtype=torch.int32),
                                    scale, num_splits=splits, block_n=block_n)
    ref = _reference_decode(q, k, v, tables, seq_lens, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_paged_decode_kernel_runs_a_ragged_step_as_rows():
    """The ragged path of paged_attention: each new token a row with its sequence's table and
    length index + 1. The kernel on those rows equals the gather + SDPA causal reference."""
    from duplexcache.kv.paged_attention import PagedBatch, PagedKVCache, _reference_paged_attention

    gen = torch.Generator().manual_seed(77)
    cache = PagedKVCache(1, 12, PAGE, 2, 32)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    batch = PagedBatch.build([[3, 5, 7], [2], [9, 4]], [20, 0, 30], [3, 2, 1], None, PAGE)
    q = torch.randn(batch.num_tokens, 4, 32, generator=gen)
    tables, seq_lens = batch.token_rows()
    out = tk.paged_decode_attention(q, cache.k[0], cache.v[0], tables, seq_lens, 0.2, num_splits=2, block_n=16)
    ref = _reference_paged_attention(q, cache, 0, batch, 0.2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _ragged_case(gen: torch.Generator, storage_dtype=None):
    """A ragged step over a one-layer pool: sequences append 5, 1, 9, 0 and 3 tokens."""
    from duplexcache.kv.paged_attention import PagedBatch, PagedKVCache, write_kv

    cache = PagedKVCache(1, 16, PAGE, 2, 32, storage_dtype=storage_dtype)
    write_kv(cache, 0, torch.randn(15 * PAGE, 2, 32, generator=gen), torch.randn(15 * PAGE, 2, 32, generator=gen),
             torch.arange(PAGE, 16 * PAGE))
    batch = PagedBatch.build([[3, 5, 7], [2], [9, 4, 11], [6], [8, 10]], [20, 0, 30, 5, 14], [5, 1, 9, 0, 3],
                             None, PAGE)
    return cache, batch, torch.randn(batch.num_tokens, 4, 32, generator=gen)


@pytest.mark.parametrize("rows_per_group", [2, 4, 8])
@pytest.mark.parametrize("fp8", [False, True])
def test_paged_decode_row_groups_match_the_causal_reference(rows_per_group, fp8):
    """a kernel program takes up to ``rows_per_group`` tokens of one sequence,
    which share its K/V tiles, each masked to its own causal length. Equal (float32) to the gather
    + SDPA causal reference, with idle programs past the groups, and to the kernel's one program
    per row."""
    from duplexcache.kv.paged_attention import _reference_paged_attention

    cache, batch, q = _ragged_case(torch.Generator().manual_seed(90 + rows_per_group), FP8 if fp8 else None)
    tables, seq_lens = batch.token_rows()
    ks, vs = cache.layer_scales(0)
    first, count = row_groups_host(batch.num_new_list, rows_per_group, programs=batch.num_tokens + 3)
    groups = (torch.tensor(first, dtype=torch.int32), torch.tensor(count, dtype=torch.int32))
    out = tk.paged_decode_attention(q, cache.k[0], cache.v[0], tables, seq_lens, 0.2, k_scale=ks, v_scale=vs,
                                    num_splits=3, block_n=16, row_groups=groups, rows_per_group=rows_per_group)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _reference_paged_attention(q, cache, 0, batch, 0.2), rtol=1e-5, atol=1e-5)
    per_row = tk.paged_decode_attention(q, cache.k[0], cache.v[0], tables, seq_lens, 0.2, k_scale=ks, v_scale=vs,
                                        num_splits=3, block_n=16)
    torch.testing.assert_close(out, per_row, rtol=1e-5, atol=1e-5)


def test_a_sequences_row_groups_give_the_same_bits_alone_and_beside_others():
    """engine.batch_invariant with row groups: a sequence's groups depend on its own tokens, so
    at a fixed split count its rows are bit-equal whether its step holds other sequences or not."""
    from duplexcache.kv.paged_attention import PagedBatch

    cache, batch, q = _ragged_case(torch.Generator().manual_seed(95))
    tables, seq_lens = batch.token_rows()
    groups = batch.token_row_groups(4)
    beside = tk.paged_decode_attention(q, cache.k[0], cache.v[0], tables, seq_lens, 0.2, num_splits=2,
                                       block_n=16, row_groups=groups, rows_per_group=4)
    alone_batch = PagedBatch.build([[9, 4, 11]], [30], [9], None, PAGE)   # the third sequence on its own
    rows = slice(6, 15)
    t, n = alone_batch.token_rows()
    alone = tk.paged_decode_attention(q[rows].clone(), cache.k[0], cache.v[0], t, n, 0.2, num_splits=2,
                                      block_n=16, row_groups=alone_batch.token_row_groups(4), rows_per_group=4)
    assert torch.equal(alone, beside[rows])


def test_paged_decode_reads_blocks_in_place_shared_blocks():
    """Two sequences share their first blocks (a shared context), then diverge; a garbage
    value in the null block and in unlisted blocks must not leak in."""
    gen = torch.Generator().manual_seed(7)
    hkv, d = 2, 32
    k = torch.randn(10, PAGE, hkv, d, generator=gen)
    v = torch.randn(10, PAGE, hkv, d, generator=gen)
    k[0].fill_(1e4)
    v[0].fill_(1e4)  # the null block is padding: never part of any softmax
    tables = [[3, 7, 5], [3, 7, 9, 2]]
    seq_lens = [40, 60]
    bt = torch.tensor([[3, 7, 5, 0], [3, 7, 9, 2]], dtype=torch.int32)
    q = torch.randn(2, 4, d, generator=gen)
    out = tk.paged_decode_attention(q, k, v, bt, torch.tensor(seq_lens, dtype=torch.int32),
                                    d ** -0.5, num_splits=2, block_n=16)
    ref = _reference_decode(q, k, v, tables, seq_lens, d ** -0.5)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(tk.interpreter_enabled(), reason="Triton's CPU interpreter runs tl.dot on "
                    "bf16's raw uint16 storage (wrong by ~1e10); bf16 is checked on the GPU by "
                    "duplexcache.bench.gpu_stage0")
def test_paged_decode_bf16_close_to_float64():
    gen = torch.Generator().manual_seed(99)
    seq_lens = [80, 31]
    k, v, bt, tables = _make_paged(seq_lens, 2, 32, torch.bfloat16, gen)
    q = torch.randn(2, 4, 32, generator=gen).to(torch.bfloat16)
    out = tk.paged_decode_attention(q, k, v, bt, torch.tensor(seq_lens, dtype=torch.int32),
                                    32 ** -0.5, num_splits=2, block_n=16)
    assert out.dtype == torch.bfloat16
    ref = _reference_decode(q, k, v, tables, seq_lens, 32 ** -0.5)
    rel = (out.double() - ref).norm() / ref.norm()
    assert rel < 1e-2, rel


def test_paged_decode_rejects_bad_inputs():
    q = torch.randn(2, 4, 32)
    k = torch.randn(5, PAGE, 2, 32)
    bt = torch.zeros(2, 3, dtype=torch.int32)
    sl = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        tk.paged_decode_attention(torch.randn(2, 3, 32), k, k, bt, sl, 1.0)
    with pytest.raises(ValueError, match="head_dim mismatch"):
        tk.paged_decode_attention(torch.randn(2, 4, 16), k, k, bt, sl, 1.0)
    with pytest.raises(ValueError, match="power of two"):
        tk.paged_decode_attention(torch.randn(2, 4, 24), torch.randn(5, PAGE, 2, 24),
                                  torch.randn(5, PAGE, 2, 24), bt, sl, 1.0)
    with pytest.raises(ValueError, match="dtype mismatch"):
        tk.paged_decode_attention(q.double(), k, k, bt, sl, 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        tk.paged_decode_attention(q, k, k, bt[:1], sl, 1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        tk.paged_decode_attention(q, k, k, bt, sl[:1], 1.0)
    with pytest.raises(ValueError, match="block_n"):
        tk.paged_decode_attention(q, k, k, bt, sl, 1.0, block_n=24)


# ----------------------------------------------------------------------------- re-rotation
def _rope_neox(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Forward NeoX RoPE in float64: x (..., T, H, D) rotated to positions (T,)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = positions.double()[:, None] * inv[None, :]  # (T, D/2)
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., : d // 2].double(), x[..., d // 2:].double()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _reference_rerotate(k: torch.Tensor, block_ids: list[int], delta: int, theta: float):
    """Plain PyTorch: float32 angles of -delta, applied to the listed blocks only."""
    out = k.clone()
    d = k.shape[-1]
    ang = float(-delta) * tk.rope_inv_freq(d, theta)  # float32, as the spec asks
    cos, sin = ang.cos(), ang.sin()
    sel = out[:, block_ids].float()
    x1, x2 = sel[..., : d // 2], sel[..., d // 2:]
    out[:, block_ids] = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(k.dtype)
    return out


@pytest.mark.parametrize("delta,block_ids", [(32, [2, 5, 3]), (4096, [1, 6]), (-48, [4])])
def test_rerotate_matches_reference_and_leaves_others(delta, block_ids):
    gen = torch.Generator().manual_seed(5 + delta)
    k = torch.randn(3, 8, PAGE, 2, 32, generator=gen)
    ref = _reference_rerotate(k, block_ids, delta, 1e6)
    got = tk.rerotate_keys_triton_(k.clone(), torch.tensor(block_ids), delta, 1e6,
                                   block_rows=8)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    untouched = [b for b in range(8) if b not in block_ids]
    assert torch.equal(got[:, untouched], k[:, untouched])  # bit-exact: never written


def test_rerotate_equals_rope_at_shifted_positions():
    """Keys written at positions p, rotated by -delta, equal keys written at p - delta."""
    gen = torch.Generator().manual_seed(11)
    theta, delta, d = 1e6, 160, 64
    raw = torch.randn(2, 4, PAGE, 2, d, generator=gen, dtype=torch.float64)
    blocks = [1, 3]
    start = 2000  # the kept tokens sat at positions start .. start + 31
    pos = torch.arange(start, start + 2 * PAGE)
    k = torch.zeros(2, 4, PAGE, 2, d)
    expect = k.clone()
    for j, blk in enumerate(blocks):
        p = pos[j * PAGE:(j + 1) * PAGE]
        for layer in range(2):
            k[layer, blk] = _rope_neox(raw[layer, blk], p, theta).float()
            expect[layer, blk] = _rope_neox(raw[layer, blk], p - delta, theta).float()
    tk.rerotate_keys_triton_(k, blocks, delta, theta)
    # float32 angle math on positions up to 2000: error of a few 1e-5 is expected.
    torch.testing.assert_close(k, expect, rtol=0, atol=5e-4)


def test_rerotate_bf16_and_zero_delta():
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(2, 4, PAGE, 2, 32, generator=gen).to(torch.bfloat16)
    same = tk.rerotate_keys_triton_(k.clone(), [1, 2], 0, 1e6)
    assert torch.equal(same, k)
    got = tk.rerotate_keys_triton_(k.clone(), [1, 2], 64, 1e6)
    ref = _reference_rerotate(k, [1, 2], 64, 1e6)
    # Both round a float32 result to bf16 once; cos/sin of numpy vs torch may differ in the
    # last float32 bit, which can flip one bf16 rounding: allow one bf16 ulp (2^-7 relative).
    torch.testing.assert_close(got.float(), ref.float(), rtol=2 ** -7, atol=2 ** -7)
    assert not torch.equal(got, k)


def test_rerotate_rejects_bad_ids():
    k = torch.randn(1, 4, PAGE, 1, 16)
    with pytest.raises(ValueError, match="duplicates"):
        tk.rerotate_keys_triton_(k, [1, 1], 16, 1e6)
    with pytest.raises(ValueError, match="null"):
        tk.rerotate_keys_triton_(k, [0, 2], 16, 1e6)
    with pytest.raises(ValueError, match="null"):
        tk.rerotate_keys_triton_(k, [4], 16, 1e6)
    with pytest.raises(ValueError, match="delta"):
        tk.rerotate_keys_triton_(k, [1], 1.5, 1e6)


def test_cpu_tensors_without_interpreter_raise(monkeypatch):
    monkeypatch.setattr(tk, "_INTERPRETED", False)  # as if imported for CUDA
    with pytest.raises(tk.TritonUnavailableError, match="CUDA"):
        tk.rerotate_keys_triton_(torch.randn(1, 2, PAGE, 1, 16), [1], 16, 1e6)


# ----------------------------------------------------------------------------- bench helpers
def test_bench_paths_agree_on_cpu():
    """The GPU bench's dense, gather and paged layouts compute one function (tiny, fp32)."""
    from duplexcache.bench import gpu_stage0 as gb

    gen = torch.Generator().manual_seed(21)
    b, hq, hkv, t, d = 3, 4, 2, 40, 32
    bt, num_blocks = gb.build_block_tables(b, t, gen, device="cpu")
    k = torch.randn(b, hkv, t, d, generator=gen)
    v = torch.randn(b, hkv, t, d, generator=gen)
    q = torch.randn(b, hq, d, generator=gen)
    pk, pv = gb.to_paged(k, bt, num_blocks), gb.to_paged(v, bt, num_blocks)
    scale = d ** -0.5
    ref = gb.reference_fp32(q, k, v, scale, rows=b)
    torch.testing.assert_close(gb.dense_gqa(q, k, v, scale), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb.dense_grouped(q, k, v, scale), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb.gather_then_sdpa(q, pk, pv, bt, t, scale, gb.dense_gqa), ref,
                               rtol=1e-5, atol=1e-5)
    out = tk.paged_decode_attention(q, pk, pv, bt, torch.full((b,), t, dtype=torch.int32),
                                    scale, num_splits=2, block_n=16)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # The bench's fp8 arm: the same layer set quantized as a pool stores it, within fp8's bound.
    k8, ks, v8, vs = gb.quantize_paged(gb.LayerKV(k, v, pk, pv))
    assert k8.dtype == torch.float8_e4m3fn and ks.shape == pk.shape[:-1]
    out8 = tk.paged_decode_attention(q, k8, v8, bt, torch.full((b,), t, dtype=torch.int32), scale,
                                     k_scale=ks, v_scale=vs, num_splits=2, block_n=16)
    assert (out8 - ref).abs().max() <= v.abs().max() / 14 and (out8 - ref).norm() <= 0.06 * ref.norm()


def test_bench_torch_rerotate_matches_kernel_and_project_rope():
    from duplexcache.bench import gpu_stage0 as gb

    gen = torch.Generator().manual_seed(8)
    k = torch.randn(2, 6, PAGE, 2, 32, generator=gen)
    ids = [5, 1, 3]
    a = k.clone()
    gb.torch_rerotate_(a, torch.tensor(ids), 320, 1e6)
    b = tk.rerotate_keys_triton_(k.clone(), ids, 320, 1e6)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    rope = pytest.importorskip("duplexcache.kv.rope")
    c = rope.rerotate_keys_(k.clone(), ids, 320, 1e6)
    torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-5)
    # The bench's fp8 arm (kernel vs the torch fp8 path vs float64), on CPU through the interpreter.
    ids_t = torch.tensor(ids)
    errs = gb._rerotate_fp8_errors(k, ids_t, 320, 1e6, gb._rerotate_fp64(k, ids_t, 320, 1e6))
    # Below 1 and a large error against float64 here, from the interpreter's e4m3 cast only
    # (test_rerotate_fp8_matches_the_torch_path_and_the_float_rotation pins it); the bound of
    # that test, (sqrt(2) + 1) * amax / 28, is for CUDA runs of the bench.
    assert errs["triton_fp8_bytes_equal_to_torch_fraction"] > 0.95
    assert set(errs) == {"triton_fp8_vs_torch_fp8_max_abs", "triton_fp8_bytes_equal_to_torch_fraction",
                         "triton_fp8_vs_fp64_max_abs"} and all(math.isfinite(e) for e in errs.values())


# ----------------------------------------------------------------------------- fp8 storage
# An fp8 pool (precision.kv_cache_dtype: fp8_e4m3) holds e4m3 values and one float32 scale per
# (token, kv head). The interpreter loads float8_e4m3fn and converts it (and stores it, for the
# re-rotation) exactly as torch does, so float32-compute cases run here; bf16 compute needs a
# GPU (the interpreter's tl.dot on bf16 is wrong, see test_paged_decode_bf16_close_to_float64).


def _quantized(k: torch.Tensor, v: torch.Tensor):
    from duplexcache.kv.kv_quant import dequantize_fp8, quantize_fp8

    (k8, ks), (v8, vs) = quantize_fp8(k), quantize_fp8(v)
    return k8, ks, v8, vs, dequantize_fp8(k8, ks, torch.float32), dequantize_fp8(v8, vs, torch.float32)


@pytest.mark.parametrize("seq_lens,hq,hkv,d,splits,block_n", DECODE_CASES[:4])
def test_paged_decode_fp8_dequantizes_in_kernel(seq_lens, hq, hkv, d, splits, block_n):
    """In-kernel dequantization equals float64 attention over the dequantized K/V (1e-5), and
    the result stays within the fp8 bound of the float cache's attention.

    Bound (unit-normal q, k, v): max abs error <= max|v| / 14, error norm <= 6 % of the output
    norm (the reference path's bound, tests/kv/test_paged_attention.py). Measured here: against
    the dequantized K/V <= 4.2e-7; against the float cache max abs 0.020..0.068 (max|v| ~4.4),
    norm 2.8..3.7 %.
    """
    gen = torch.Generator().manual_seed(4321 + sum(seq_lens))
    k, v, bt, tables = _make_paged(seq_lens, hkv, d, torch.float32, gen)
    k8, ks, v8, vs, kd, vd = _quantized(k, v)
    q = torch.randn(len(seq_lens), hq, d, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = tk.paged_decode_attention(q, k8, v8, bt, lens, d ** -0.5, k_scale=ks, v_scale=vs,
                                    num_splits=splits, block_n=block_n)
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _reference_decode(q, kd, vd, tables, seq_lens, d ** -0.5),
                               rtol=1e-5, atol=1e-5)
    exact = _reference_decode(q, k, v, tables, seq_lens, d ** -0.5)
    assert (out.double() - exact).abs().max() <= v.abs().max() / 14
    assert (out.double() - exact).norm() <= 0.06 * exact.norm()


def test_paged_decode_fp8_ragged_step_as_rows_matches_the_gather_path():
    """The ragged path on an fp8 pool: kernel rows (fp8 + scales in place) equal the gather +
    SDPA reference, which dequantizes in torch, and stay within the fp8 bound (max|v| / 14,
    6 % of the norm) of the float pool's attention."""
    from duplexcache.kv.paged_attention import PagedBatch, PagedKVCache, _reference_paged_attention, write_kv

    gen = torch.Generator().manual_seed(78)
    cache = PagedKVCache(1, 12, PAGE, 2, 32, storage_dtype=FP8)
    exact = PagedKVCache(1, 12, PAGE, 2, 32)
    k, v = torch.randn(11 * PAGE, 2, 32, generator=gen), torch.randn(11 * PAGE, 2, 32, generator=gen)
    for c in (cache, exact):
        write_kv(c, 0, k, v, torch.arange(PAGE, 12 * PAGE))
    batch = PagedBatch.build([[3, 5, 7], [2], [9, 4]], [20, 0, 30], [3, 2, 1], None, PAGE)
    q = torch.randn(batch.num_tokens, 4, 32, generator=gen)
    tables, seq_lens = batch.token_rows()
    ks, vs = cache.layer_scales(0)
    out = tk.paged_decode_attention(q, cache.k[0], cache.v[0], tables, seq_lens, 0.2, k_scale=ks, v_scale=vs,
                                    num_splits=2, block_n=16)
    torch.testing.assert_close(out, _reference_paged_attention(q, cache, 0, batch, 0.2), rtol=1e-5, atol=1e-5)
    want = _reference_paged_attention(q, exact, 0, batch, 0.2)
    assert (out - want).abs().max() <= v.abs().max() / 14 and (out - want).norm() <= 0.06 * want.norm()


@pytest.mark.skipif(tk.interpreter_enabled(), reason="Triton's CPU interpreter runs tl.dot on "
                    "bf16's raw uint16 storage; fp8 dequantized to bf16 is checked on CUDA")
def test_paged_decode_fp8_bf16_compute_close_to_float64():
    gen = torch.Generator().manual_seed(98)
    seq_lens = [80, 31]
    k, v, bt, tables = _make_paged(seq_lens, 2, 32, torch.float32, gen)
    k8, ks, v8, vs, kd, vd = _quantized(k, v)
    q = torch.randn(2, 4, 32, generator=gen).to(torch.bfloat16)
    out = tk.paged_decode_attention(q, k8, v8, bt, torch.tensor(seq_lens, dtype=torch.int32), 32 ** -0.5,
                                    k_scale=ks, v_scale=vs, num_splits=2, block_n=16)
    ref = _reference_decode(q, kd, vd, tables, seq_lens, 32 ** -0.5)
    assert out.dtype == torch.bfloat16 and (out.double() - ref).norm() / ref.norm() < 1e-2


def test_paged_decode_fp8_needs_both_scales():
    k8 = torch.randn(5, PAGE, 2, 32).to(FP8)
    q, bt, sl = torch.randn(2, 4, 32), torch.zeros(2, 3, dtype=torch.int32), torch.tensor([3, 4], dtype=torch.int32)
    s = torch.ones(5, PAGE, 2)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        tk.paged_decode_attention(q, k8, k8, bt, sl, 1.0)
    with pytest.raises(ValueError, match="go together"):
        tk.paged_decode_attention(q, k8, k8, bt, sl, 1.0, k_scale=s)
    with pytest.raises(ValueError, match="fp8"):
        tk.paged_decode_attention(q, k8.float(), k8.float(), bt, sl, 1.0, k_scale=s, v_scale=s)
    with pytest.raises(ValueError, match="k_scale must be float32"):
        tk.paged_decode_attention(q, k8, k8, bt, sl, 1.0, k_scale=s[:4], v_scale=s)


def _interpreter_e4m3_carry_bug(triton_vals: torch.Tensor, torch_vals: torch.Tensor) -> torch.Tensor:
    """Where Triton's CPU interpreter casts float32 -> e4m3 wrongly: a value that rounds up to
    the next power of two (127.9 -> 128) loses the carry and lands one binade low (64). Found
    with the cast alone (no kernel math); the CUDA cast instruction rounds correctly."""
    pow2 = torch_vals.abs() == torch.exp2(torch.log2(torch_vals.abs()).round())
    return pow2 & (triton_vals * 2 == torch_vals)


def test_rerotate_fp8_matches_the_torch_path_and_the_float_rotation():
    """Triton and torch both dequantize, rotate in float32 and re-quantize per (token, head).

    Scales agree to float32 rounding. Stored values: identical bytes, except (CUDA) where the
    two float32 rotations straddle an e4m3 rounding boundary, one step apart (<= amax / 14:
    the widest step is 32 of 448), and (interpreter) where its float32 -> e4m3 cast drops a
    carry (``_interpreter_e4m3_carry_bug``). Against the float keys rotated without
    quantization, the torch path is within (sqrt(2) * amax_before + amax_after) / 28: the
    first rounding's error, turned by the rotation (a pair's error grows by up to sqrt(2) in
    one coordinate), plus the second rounding's.
    """
    from duplexcache.kv import rope
    from duplexcache.kv.kv_quant import dequantize_fp8, quantize_fp8

    gen = torch.Generator().manual_seed(31)
    k = torch.randn(3, 8, PAGE, 2, 32, generator=gen) * 4
    k8, ks = quantize_fp8(k)
    ids, delta = [2, 5, 3], 4096
    a8, a_s = k8.clone(), ks.clone()
    tk.rerotate_keys_triton_(a8, torch.tensor(ids), delta, 1e6, k_scale=a_s, block_rows=8)
    b8, b_s = k8.clone(), ks.clone()
    rope.rerotate_keys_(b8, ids, delta, 1e6, k_scale=b_s)
    torch.testing.assert_close(a_s, b_s, rtol=1e-6, atol=0)
    differ = a8.view(torch.uint8) != b8.view(torch.uint8)
    if tk.interpreter_enabled():
        bug = _interpreter_e4m3_carry_bug(a8.float(), b8.float())
        assert bug.any(), "the interpreter's cast seems fixed: compare bytes exactly"
        differ &= ~bug
        assert not differ.any(), f"{int(differ.sum())} bytes differ outside the interpreter's cast bug"
    else:
        got, want = dequantize_fp8(a8, a_s, torch.float32), dequantize_fp8(b8, b_s, torch.float32)
        assert ((got - want).abs() <= want.abs().amax(-1, keepdim=True) / 14 + 1e-6).all()
        assert differ.float().mean() < 0.01
    untouched = [b for b in range(8) if b not in ids]
    assert torch.equal(a8.view(torch.uint8)[:, untouched], k8.view(torch.uint8)[:, untouched])
    assert torch.equal(a_s[:, untouched], ks[:, untouched])
    ref = _reference_rerotate(k, ids, delta, 1e6)[:, ids]
    got = dequantize_fp8(b8, b_s, torch.float32)[:, ids]
    bound = (2 ** 0.5 * k[:, ids].abs().amax(-1, keepdim=True) + ref.abs().amax(-1, keepdim=True)) / 28
    assert ((got - ref).abs() <= bound + 1e-6).all()


def test_rerotate_fp8_needs_its_scales():
    k8 = torch.randn(1, 4, PAGE, 1, 16).to(FP8)
    with pytest.raises(ValueError, match="k_scale"):
        tk.rerotate_keys_triton_(k8, [1], 16, 1e6)
    with pytest.raises(ValueError, match="k_scale"):
        tk.rerotate_keys_triton_(k8.float(), [1], 16, 1e6, k_scale=torch.ones(1, 4, PAGE, 1))
    with pytest.raises(ValueError, match="k_scale must be float32"):
        tk.rerotate_keys_triton_(k8, [1], 16, 1e6, k_scale=torch.ones(1, 4, PAGE, 2))


def test_bench_fp8_arm_times_the_bf16_best_then_its_own_sweep(monkeypatch):
    """`bench kernels`' fp8 arm: the bf16 sweep's best config, then the same sweep over the fp8
    sets and a timing of their own best; the configs reach the kernel (its calls are counted) and
    both fp8 outputs stay within fp8's bound of the float32 reference (CPU, the interpreter)."""
    import argparse

    from duplexcache.bench import gpu_stage0 as gb

    gen = torch.Generator().manual_seed(5)
    b, hq, hkv, t, d = 2, 4, 2, 40, 32
    s = gb.Shapes(batch=b, seq_len=t, layers=1, q_heads=hq, kv_heads=hkv, head_dim=d, distinct_layers=1)
    bt, num_blocks = gb.build_block_tables(b, t, gen, device="cpu")
    k, v = torch.randn(b, hkv, t, d, generator=gen), torch.randn(b, hkv, t, d, generator=gen)
    kv = gb.LayerKV(k, v, gb.to_paged(k, bt, num_blocks), gb.to_paged(v, bt, num_blocks))
    setup = gb.DecodeSetup(s, bt, [kv], [torch.randn(b, hq, d, generator=gen)],
                           torch.full((b,), t, dtype=torch.int32), d ** -0.5)
    seen: list[tuple[str, int]] = []
    real = tk.paged_decode_attention

    def counting(*a, **kw):
        seen.append((kw.get("k_scale") is not None, kw.get("block_n")))
        return real(*a, **kw)

    def one_call(name, fn, warmup, repeats):   # no CUDA events on CPU: run once, a made-up time
        before = len(seen)
        fn()
        block_n = seen[before][1]
        return gb.Timing(name, [float(block_n == 32) + 1.0])   # block 32 is "slow": the best is another

    monkeypatch.setattr(tk, "paged_decode_attention", counting)
    monkeypatch.setattr(gb, "time_cuda", one_call)
    monkeypatch.setattr(gb, "_sweep_grid", lambda quick: [(32, 2, 4, 2), (16, 2, 4, 2)])
    args = argparse.Namespace(quick=True, warmup=0, repeats=1)
    timings, errors, sweep = gb._time_fp8_decode(setup, args, dict(num_splits=2, block_n=32, num_warps=4,
                                                                     num_stages=2))
    assert set(timings) == {"triton_paged_fp8", "triton_paged_fp8_own_config", "ragged_rows", "ragged_groups",
                            "ragged_rows_fp8", "ragged_groups_fp8"}
    assert [r["block_n"] for r in sweep] == [32, 16] and [r["median_ms"] for r in sweep] == [2.0, 1.0]
    assert all(fp8 for fp8, _ in seen[:5])                        # every timed call read the fp8 sets
    # a unit's append, one program per token row vs the row groups: the same attention (float32)
    assert errors["ragged_groups_vs_rows_max_abs"] < 1e-5 and errors["ragged_groups_fp8_vs_rows_max_abs"] < 1e-5
    assert [bn for _, bn in seen[:3]] == [32, 32, 16]             # the bf16 best, then the sweep's two, ...
    assert seen[3] == (True, 16)                                  # ... then the fp8 sweep's own best
    ref = gb.reference_fp32(setup.qs[0], k, v, setup.scale, rows=b)
    bound = v.abs().max().item() / 14
    assert errors["triton_fp8_vs_fp32_ref_max_abs(4 sessions)"] <= bound
    assert errors["triton_fp8_own_config_vs_fp32_ref_max_abs(4 sessions)"] <= bound
    assert errors["fp8_all_finite"] and ref.shape == (b, hq, d)
