"""Paged KV storage, batch metadata and the reference paged attention (CPU, float32)."""

from __future__ import annotations

import math

import pytest
import torch

from duplexcache.kv.paged_attention import (
    RAGGED_KERNEL_MAX_NEW,
    PagedBatch,
    PagedKVCache,
    attention_path,
    bytes_per_block,
    copy_blocks,
    num_blocks_for_budget,
    paged_attention,
    write_kv,
    _reference_paged_attention,
)

HQ, HKV, D = 4, 2, 8


def _naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, computed: int) -> torch.Tensor:
    """Independent reference: explicit loops over heads, softmax of masked scores.

    q: (T, HQ, D) new tokens at logical indices computed..computed+T-1; k, v: (S, HKV, D).
    """
    t = q.shape[0]
    out = torch.zeros_like(q)
    group = HQ // HKV
    for h in range(HQ):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        scores = q[:, h].double() @ kh.T / math.sqrt(D)  # (T, S)
        for i in range(t):
            scores[i, computed + i + 1 :] = float("-inf")
        out[:, h] = (scores.softmax(-1) @ vh).to(q.dtype)
    return out


def _shuffled_tables(counts: list[int], gen: torch.Generator) -> list[list[int]]:
    ids = (torch.randperm(sum(counts), generator=gen) + 1).tolist()
    return [[ids.pop() for _ in range(c)] for c in counts]


# (block_size, num_computed, num_new): prefill, decode, chunked prefill with a zero-length
# sequence (full cache hit), a chunk that starts exactly on a block boundary.
CASES = [
    (16, [0, 0, 0], [5, 17, 33]),
    (16, [5, 17, 33], [1, 1, 1]),
    (4, [3, 8, 7], [6, 0, 9]),
    (16, [32], [16]),
    (1, [2, 0], [3, 1]),
]


@pytest.mark.parametrize("block_size,computed,new", CASES)
def test_paged_attention_matches_naive(block_size, computed, new):
    gen = torch.Generator().manual_seed(0)
    layers = 2
    lens = [c + n for c, n in zip(computed, new)]
    tables = _shuffled_tables([-(-n // block_size) + 1 for n in lens], gen)  # one spare block each
    cache = PagedKVCache(layers, sum(len(t) for t in tables) + 1, block_size, HKV, D)
    ks = [torch.randn(layers, n, HKV, D, generator=gen) for n in lens]
    vs = [torch.randn(layers, n, HKV, D, generator=gen) for n in lens]

    # Fill the cached prefixes through the same write path, as an earlier step would have.
    prefix = PagedBatch.build(tables, [0] * len(lens), computed, None, block_size)
    step = PagedBatch.build(tables, computed, new, None, block_size)
    for layer in range(layers):
        write_kv(cache, layer, torch.cat([k[layer, :c] for k, c in zip(ks, computed)]),
                 torch.cat([v[layer, :c] for v, c in zip(vs, computed)]), prefix.slot_mapping)  # fmt: skip
        write_kv(cache, layer, torch.cat([k[layer, c:] for k, c in zip(ks, computed)]),
                 torch.cat([v[layer, c:] for v, c in zip(vs, computed)]), step.slot_mapping)  # fmt: skip

    q = torch.randn(sum(new), HQ, D, generator=gen)
    for layer in range(layers):
        out = paged_attention(q, cache, layer, step, scale=D**-0.5)
        start = 0
        for b in range(len(lens)):
            qb = q[start : start + new[b]]
            ref = _naive_attention(qb, ks[b][layer], vs[b][layer], computed[b])
            torch.testing.assert_close(out[start : start + new[b]], ref, rtol=1e-5, atol=1e-6)
            start += new[b]


def test_shared_block_written_in_same_forward_is_visible():
    """Sequence A prefills block 5; B shares block 5 as its cached prefix in the same step.

    Writes of a layer happen for every sequence before that layer's attention, so B must see
    A's keys (the "two sequences share a prefix in one step" case).
    """
    gen = torch.Generator().manual_seed(1)
    bs = 4
    cache = PagedKVCache(1, 8, bs, HKV, D)
    k_a, v_a = torch.randn(bs, HKV, D, generator=gen), torch.randn(bs, HKV, D, generator=gen)
    k_b, v_b = torch.randn(2, HKV, D, generator=gen), torch.randn(2, HKV, D, generator=gen)
    batch = PagedBatch.build([[5], [5, 6]], [0, bs], [bs, 2], None, bs)
    write_kv(cache, 0, torch.cat([k_a, k_b]), torch.cat([v_a, v_b]), batch.slot_mapping)
    q = torch.randn(bs + 2, HQ, D, generator=gen)
    out = paged_attention(q, cache, 0, batch, D**-0.5)
    ref_b = _naive_attention(q[bs:], torch.cat([k_a, k_b]), torch.cat([v_a, v_b]), bs)
    torch.testing.assert_close(out[bs:], ref_b, rtol=1e-5, atol=1e-6)


def test_batch_build_fields_exact():
    batch = PagedBatch.build([[7, 3, 9], [2]], [5, 0], [3, 2], None, block_size=4)
    assert batch.query_start_loc.tolist() == [0, 3, 5]
    assert batch.seq_lens.tolist() == [8, 2] and batch.seq_lens.dtype == torch.int32
    assert batch.block_tables.tolist() == [[7, 3, 9], [2, 0, 0]] and batch.block_tables.dtype == torch.int32
    # index 5,6,7 -> block 3 offsets 1..3; index 0,1 -> block 2 offsets 0..1
    assert batch.slot_mapping.tolist() == [13, 14, 15, 8, 9] and batch.slot_mapping.dtype == torch.int64
    assert batch.positions.tolist() == [5, 6, 7, 0, 1]
    assert batch.last_token_indices == [2, 4]
    assert not batch.is_decode
    explicit = PagedBatch.build([[1]], [0], [2], [[10, 11]], block_size=4)
    assert explicit.positions.tolist() == [10, 11]


def test_batch_zero_new_tokens():
    batch = PagedBatch.build([[1, 2], [3]], [20, 0], [0, 3], None, block_size=16)
    assert batch.query_start_loc.tolist() == [0, 0, 3]
    assert batch.last_token_indices == [None, 2]
    assert batch.num_tokens == 3


@pytest.mark.parametrize(
    "tables,computed,new,positions,match",
    [
        ([[1]], [10], [10], None, "needs 2 blocks"),
        ([[1, 0]], [10], [10], None, "null block"),
        ([[1]], [0], [2], [[0]], "2 new tokens but 1 positions"),
        ([[1]], [-1], [2], None, "negative"),
        ([[1], [2]], [0], [1, 1], None, "num_computed"),
    ],
)
def test_batch_build_errors(tables, computed, new, positions, match):
    with pytest.raises(ValueError, match=match):
        PagedBatch.build(tables, computed, new, positions, block_size=16)


def test_write_kv_lands_in_slot():
    cache = PagedKVCache(3, 4, 4, HKV, D)
    k = torch.randn(2, HKV, D)
    v = torch.randn(2, HKV, D)
    write_kv(cache, 1, k, v, torch.tensor([13, 2]))  # block 3 offset 1, block 0 offset 2
    assert torch.equal(cache.k[1, 3, 1], k[0]) and torch.equal(cache.v[1, 0, 2], v[1])
    assert cache.k[0].abs().sum() == 0 and cache.k[2].abs().sum() == 0  # other layers untouched
    with pytest.raises(ValueError, match="write_kv"):
        write_kv(cache, 0, k, v[:1], torch.tensor([1, 2]))


def test_copy_blocks():
    gen = torch.Generator().manual_seed(2)
    cache = PagedKVCache(2, 6, 4, HKV, D)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    k0, v0 = cache.k.clone(), cache.v.clone()
    copy_blocks(cache, [(1, 4), (2, 5)])
    assert torch.equal(cache.k[:, 4], k0[:, 1]) and torch.equal(cache.v[:, 5], v0[:, 2])
    for b in (0, 1, 2, 3):
        assert torch.equal(cache.k[:, b], k0[:, b]) and torch.equal(cache.v[:, b], v0[:, b])
    for pairs, match in [([(1, 0)], "null block"), ([(1, 4), (2, 4)], "duplicate"),
                         ([(1, 2), (2, 3)], "both source and destination"), ([(1, 6)], "out of range")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            copy_blocks(cache, pairs)


def test_bytes_per_block_and_budget():
    # MiniCPM-o 4.5 Thinker in bf16: 144 KiB per token, so 16 tokens per block.
    per_block = bytes_per_block(36, 16, 8, 128, torch.bfloat16)
    assert per_block == 144 * 1024 * 16
    assert num_blocks_for_budget(10 * per_block + per_block - 1, per_block) == 10
    with pytest.raises(ValueError, match="at least 2"):
        num_blocks_for_budget(per_block, per_block)
    cache = PagedKVCache.from_budget(5 * bytes_per_block(2, 4, HKV, D, torch.float32), 2, 4, HKV, D)
    assert cache.num_blocks == 5 and cache.total_bytes == 5 * cache.bytes_per_block
    assert cache.k.shape == (2, 5, 4, HKV, D)
    with pytest.raises(ValueError, match="null block"):
        PagedKVCache(1, 1, 4, HKV, D)


def test_attention_backend_selection():
    cache = PagedKVCache(1, 3, 4, HKV, D)
    with pytest.raises(ValueError, match="unknown attention backend"):
        cache.set_decode_backend("flash")
    if not torch.cuda.is_available():
        # Selecting the GPU kernel where it cannot run is refused, not a silent no-op.
        with pytest.raises(ValueError, match="needs Triton and CUDA"):
            cache.set_decode_backend("triton")
    assert cache.decode_backend == "reference"

    # With a decode kernel installed, CPU tensors still take the reference path.
    calls = []
    cache._decode_kernel = lambda *a: calls.append(a)
    other = PagedKVCache(1, 3, 4, HKV, D)  # the choice is per cache, not global
    assert other._decode_kernel is None
    batch = PagedBatch.build([[1], [2]], [1, 2], [1, 1], None, 4)
    assert batch.is_decode
    paged_attention(torch.randn(2, HQ, D), cache, 0, batch, 1.0)
    assert calls == [] and cache.path_counts == {"reference": 1, "decode_kernel": 0, "ragged_kernel": 0,
                                                          "per_sequence": 0}


def test_attention_path_routes_ragged_steps_only_when_switched_on():
    """The routing paged_attention uses: a ragged step of <= RAGGED_KERNEL_MAX_NEW tokens per
    sequence takes the kernel only with ragged_steps_in_kernel (stage0.ragged_kernel), only on
    CUDA, only with a kernel installed; longer steps and the CPU keep the reference."""
    cache = PagedKVCache(1, 8, 16, HKV, D)
    decode = PagedBatch.build([[1], [2]], [3, 4], [1, 1], None, 16)
    short = PagedBatch.build([[1, 2], [3, 7]], [3, 0], [12, RAGGED_KERNEL_MAX_NEW], None, 16)
    long = PagedBatch.build([[4, 5, 6]], [0], [RAGGED_KERNEL_MAX_NEW + 1], None, 16)
    assert attention_path(cache, short, on_cuda=True) == "reference"          # no kernel installed
    cache._decode_kernel = lambda *a: None
    assert attention_path(cache, decode, on_cuda=True) == "decode_kernel"
    assert attention_path(cache, short, on_cuda=True) == "reference"          # switch off
    cache.ragged_steps_in_kernel = True
    assert attention_path(cache, short, on_cuda=True) == "ragged_kernel"
    assert attention_path(cache, long, on_cuda=True) == "reference"
    assert attention_path(cache, short, on_cuda=False) == "reference"
    assert attention_path(cache, decode, on_cuda=False) == "reference"


def _decode_rows_reference(q, cache, layer, tables, seq_lens, scale):
    """One query row per entry, attending to the first seq_lens[i] tokens of tables[i] (float64)."""
    k_layer, v_layer = cache.k[layer], cache.v[layer]
    group = q.shape[1] // cache.num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, n in enumerate(seq_lens.tolist()):
        idx = torch.arange(n)
        blocks = tables[i][idx // cache.block_size].long()
        kb = k_layer[blocks, idx % cache.block_size].double().repeat_interleave(group, dim=1)  # (n, Hq, D)
        vb = v_layer[blocks, idx % cache.block_size].double().repeat_interleave(group, dim=1)
        att = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), kb) * scale, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", att, vb)
    return out


def test_ragged_step_as_decode_rows_is_causal_attention():
    """The ragged kernel path's inputs: token i of sequence b becomes a decode row over b's table
    with length index + 1; decode attention over those rows equals the causal reference."""
    g = torch.Generator().manual_seed(7)
    cache = PagedKVCache(1, 12, 4, HKV, D)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    batch = PagedBatch.build([[3, 5, 7], [2], [9, 4, 10, 11]], [5, 0, 9], [3, 2, 4], None, 4)
    assert batch.token_seq_ids.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    assert batch.token_seq_lens.tolist() == [6, 7, 8, 1, 2, 10, 11, 12, 13]
    rows, lens = batch.token_rows()
    assert rows.shape == (9, 4) and rows[3].tolist() == [2, 0, 0, 0] and batch.token_rows()[0] is rows
    assert torch.equal(lens, batch.token_seq_lens)
    q = torch.randn(9, HQ, D, generator=g)
    want = paged_attention(q, cache, 0, batch, 0.3)          # gather + SDPA per sequence (CPU)
    got = _decode_rows_reference(q, cache, 0, rows, lens, 0.3)
    torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-5)


def test_batch_invariant_ragged_steps_choose_each_sequence_s_path_by_its_own_append():
    """engine.batch_invariant (a fixed split count): a ragged step with one long append goes
    per sequence -- the short appends through the kernel (as they would beside no long one), the
    long one through gather + SDPA -- and the result is the causal attention of every token."""
    import duplexcache.kv.paged_attention as pa

    g = torch.Generator().manual_seed(11)
    cache = PagedKVCache(1, 24, 4, HKV, D)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    long_new = RAGGED_KERNEL_MAX_NEW + 3
    batch = PagedBatch.build([[3, 5], [1, 2, 4, 6, 7, 8, 9, 10, 11, 12, 13], [14, 15]], [2, 0, 5], [3, long_new, 1],
                             None, 4)
    seen = []

    def kernel(q, k, v, tables, seq_lens, scale, num_splits=None, **kw):
        seen.append((q.shape[0], num_splits))
        return _decode_rows_reference(q, cache, 0, tables, seq_lens, scale).float()

    cache._decode_kernel, cache.ragged_steps_in_kernel = kernel, True
    assert attention_path(cache, batch, on_cuda=True) == "reference"            # batch-chosen paths
    cache.fixed_num_splits = 8
    assert attention_path(cache, batch, on_cuda=True) == "per_sequence"
    alone = PagedBatch.build([[3, 5]], [2], [3], None, 4)
    assert attention_path(cache, alone, on_cuda=True) == "ragged_kernel"        # the same path alone
    q = torch.randn(batch.num_tokens, HQ, D, generator=g)
    got = pa._per_sequence_paths(q, cache, 0, batch, 0.3)
    assert seen == [(3 + 1, 8)]          # the two short sequences' 4 token rows, at the fixed splits
    want = pa._reference_paged_attention(q, cache, 0, batch, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_row_groups_reach_the_kernel_on_both_ragged_paths(monkeypatch):
    """cache.ragged_tokens_per_program: the ragged kernel path hands the
    kernel each sequence's tokens in runs of that many rows; the batch-invariant per-sequence path
    the short sequences' runs as they would be in a step of their own; 1 hands none."""
    g = torch.Generator().manual_seed(12)
    cache = PagedKVCache(1, 24, 4, HKV, D)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    seen = []

    def kernel(q, k, v, tables, seq_lens, scale, row_groups=None, rows_per_group=1, **kw):
        seen.append((None if row_groups is None else [t.tolist() for t in row_groups], rows_per_group))
        return _decode_rows_reference(q, cache, 0, tables, seq_lens, scale).float()

    import duplexcache.kv.paged_attention as pa

    cache._decode_kernel, cache.ragged_steps_in_kernel, cache.ragged_tokens_per_program = kernel, True, 2
    monkeypatch.setattr(pa, "attention_path", lambda *a: "ragged_kernel")   # the CUDA path, on CPU
    short = PagedBatch.build([[3, 5], [14, 15]], [2, 5], [3, 2], None, 4)
    q = torch.randn(short.num_tokens, HQ, D, generator=g)
    paged_attention(q, cache, 0, short, 0.3)
    assert seen.pop() == ([[0, 2, 3], [2, 1, 2]], 2)
    batch = PagedBatch.build([[3, 5], [1, 2, 4, 6, 7, 8, 9, 10, 11, 12, 13], [14, 15]], [2, 0, 5],
                             [3, RAGGED_KERNEL_MAX_NEW + 3, 2], None, 4)
    cache.fixed_num_splits = 8
    pa._per_sequence_paths(torch.randn(batch.num_tokens, HQ, D, generator=g), cache, 0, batch, 0.3)
    assert seen.pop() == ([[0, 2, 3], [2, 1, 2]], 2)
    cache.ragged_tokens_per_program = 1
    paged_attention(q, cache, 0, short, 0.3)
    assert seen.pop() == (None, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ragged_steps_take_the_kernel_and_match_the_reference():
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(8)
    cache = PagedKVCache(1, 40, 16, 2, 64, device="cuda")
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    cache.set_decode_backend("triton")
    off = PagedBatch.build([[3]], [2], [2], None, 16, "cuda")
    paged_attention(torch.randn(2, 8, 64, generator=g).cuda(), cache, 0, off, 0.125)
    assert cache.path_counts["reference"] == 1 and cache.path_counts["ragged_kernel"] == 0   # switch off
    cache.ragged_steps_in_kernel = True
    short = PagedBatch.build([[3, 5, 7], [2], [9, 4, 10]], [20, 0, 30], [12, 5, 1], None, 16, "cuda")
    long = PagedBatch.build([[11, 12, 13, 14, 15]], [0], [RAGGED_KERNEL_MAX_NEW + 1], None, 16, "cuda")
    for batch, path, groups in ((short, "ragged_kernel", 1), (short, "ragged_kernel", 4), (long, "reference", 4)):
        cache.ragged_tokens_per_program = groups   # a program takes 4 tokens of one sequence
        q = torch.randn(batch.num_tokens, 8, 64, generator=g).cuda()
        before = dict(cache.path_counts)
        got = paged_attention(q, cache, 0, batch, 0.125)
        assert cache.path_counts[path] == before[path] + 1
        want = _reference_paged_attention(q, cache, 0, batch, 0.125)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_split_counts_share_one_compiled_kernel():
    """The decode kernel's split count is a runtime argument: counts 5, 6 and 7 (one merge width,
    BLOCK_S 8) run on the kernels compiled for 5. As a constexpr each count was its own compile
    (132 variants for tiny's Talker, ~80 s of a cold first start on an H100)."""
    triton_kernels = pytest.importorskip("duplexcache.kv.triton_kernels")
    kernels = (triton_kernels._paged_decode_split_kernel, triton_kernels._paged_decode_merge_kernel)
    if not all(hasattr(k, "device_caches") for k in kernels):
        pytest.skip("this Triton keeps no per-device kernel cache to count")

    def compiled() -> int:
        return sum(len(entry[0]) for k in kernels for entry in k.device_caches.values())

    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(2, 8, 64, device="cuda", generator=g)
    k = torch.randn(20, 16, 2, 64, device="cuda", generator=g)
    v = torch.randn(20, 16, 2, 64, device="cuda", generator=g)
    table = torch.randint(1, 20, (2, 12), device="cuda", dtype=torch.int32, generator=g)
    seq_lens = torch.tensor([190, 77], device="cuda", dtype=torch.int32)
    outs = [triton_kernels.paged_decode_attention(q, k, v, table, seq_lens, 0.125, num_splits=5)]
    after_first = compiled()
    for splits in (6, 7):
        outs.append(triton_kernels.paged_decode_attention(q, k, v, table, seq_lens, 0.125, num_splits=splits))
    assert compiled() == after_first
    for out in outs[1:]:   # a different split count only changes the float summation order
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- fp8 storage
FP8 = torch.float8_e4m3fn


def _fill_pair(layers: int, lens: list[int], block_size: int, hkv: int, d: int, gen: torch.Generator):
    """A float cache and an fp8 cache written with the same K/V through ``write_kv``."""
    tables = _shuffled_tables([-(-n // block_size) for n in lens], gen)
    num_blocks = sum(len(t) for t in tables) + 1
    exact = PagedKVCache(layers, num_blocks, block_size, hkv, d)
    fp8 = PagedKVCache(layers, num_blocks, block_size, hkv, d, storage_dtype=FP8)
    batch = PagedBatch.build(tables, [0] * len(lens), lens, None, block_size)
    for layer in range(layers):
        k = torch.randn(sum(lens), hkv, d, generator=gen)
        v = torch.randn(sum(lens), hkv, d, generator=gen)
        write_kv(exact, layer, k, v, batch.slot_mapping)
        write_kv(fp8, layer, k, v, batch.slot_mapping)
    return exact, fp8, tables, batch


def test_fp8_cache_layout_and_bytes_per_block():
    cache = PagedKVCache(3, 5, 4, HKV, D, storage_dtype=FP8)
    assert cache.quantized and cache.dtype == torch.float32 and cache.storage_dtype == FP8
    assert cache.k.dtype == FP8 and cache.k.shape == (3, 5, 4, HKV, D)
    assert cache.k_scale.shape == cache.v_scale.shape == (3, 5, 4, HKV) and cache.k_scale.dtype == torch.float32
    # (head_dim values of 1 byte + one float32 scale) per (token, kv head), for K and for V.
    assert cache.bytes_per_block == 2 * 3 * 4 * HKV * (D + 4) == bytes_per_block(3, 4, HKV, D, torch.float32, FP8)
    assert cache.bytes_per_block == (cache.k[:, 0].nbytes + cache.v[:, 0].nbytes
                                     + cache.k_scale[:, 0].nbytes + cache.v_scale[:, 0].nbytes)
    # MiniCPM-o 4.5 Thinker: bf16 144 KiB per token, fp8 74.25 KiB (0.516x: 132 of 256 bytes per row).
    bf16, fp8 = bytes_per_block(36, 16, 8, 128, torch.bfloat16), bytes_per_block(36, 16, 8, 128, torch.bfloat16, FP8)
    assert (bf16 // 16, fp8 // 16) == (144 * 1024, 2 * 36 * 8 * 132)
    per_block = bytes_per_block(2, 4, HKV, D, torch.float32, FP8)
    sized = PagedKVCache.from_budget(7 * per_block + per_block - 1, 2, 4, HKV, D, storage_dtype=FP8)
    assert sized.num_blocks == 7 and sized.quantized and sized.total_bytes == 7 * per_block
    # The default stores the model dtype with no scales: unchanged layout and bytes.
    plain = PagedKVCache(3, 5, 4, HKV, D)
    assert not plain.quantized and plain.k_scale is None and plain.layer_scales(0) == (None, None)
    assert plain.bytes_per_block == bytes_per_block(3, 4, HKV, D, torch.float32) == 2 * 3 * 4 * HKV * D * 4
    assert PagedKVCache(1, 2, 4, HKV, D, storage_dtype=torch.float32).storage_dtype == torch.float32
    with pytest.raises(ValueError, match="storage_dtype"):
        PagedKVCache(1, 2, 4, HKV, D, storage_dtype=torch.bfloat16)


def test_fp8_write_kv_round_trip_and_appends_are_bit_stable():
    """Each written (token, head) row reads back within amax / 28 (tests/kv/test_kv_quant.py);
    writing more tokens into a block never changes the bytes or scales of earlier tokens."""
    gen = torch.Generator().manual_seed(3)
    cache = PagedKVCache(2, 4, 8, HKV, 32, storage_dtype=FP8)
    k, v = torch.randn(8, HKV, 32, generator=gen) * 5, torch.randn(8, HKV, 32, generator=gen)
    write_kv(cache, 1, k[:3], v[:3], torch.tensor([16, 17, 18]))  # block 2, offsets 0..2
    before = (cache.k.view(torch.uint8).clone(), cache.k_scale.clone(), cache.v.view(torch.uint8).clone(),
              cache.v_scale.clone())
    write_kv(cache, 1, k[3:], v[3:], torch.tensor([19, 20, 21, 22, 23]))  # the rest of block 2
    assert torch.equal(cache.k.view(torch.uint8)[1, 2, :3], before[0][1, 2, :3])
    assert torch.equal(cache.k_scale[1, 2, :3], before[1][1, 2, :3])
    assert torch.equal(cache.v.view(torch.uint8)[1, 2, :3], before[2][1, 2, :3])
    assert torch.equal(cache.v_scale[1, 2, :3], before[3][1, 2, :3])
    assert cache.k.view(torch.uint8)[0].sum() == 0 and cache.k.view(torch.uint8)[1, 3].sum() == 0  # untouched
    gk, gv = cache.gather_blocks(1, torch.tensor([2]))
    assert gk.dtype == gv.dtype == torch.float32 and gk.shape == (8, HKV, 32)
    for got, want in ((gk, k), (gv, v)):
        amax = want.abs().amax(-1, keepdim=True)
        assert ((got - want).abs() <= amax / 28 * (1 + 1e-6)).all()
    assert torch.equal(cache.k_scale[1, 2], k.abs().amax(-1) / 448)


@pytest.mark.parametrize("block_size,computed,new", CASES)
def test_fp8_reference_attention_dequantizes_and_stays_close_to_float(block_size, computed, new):
    """The gather + SDPA path on an fp8 pool equals exact attention over the dequantized K/V,
    and stays within a stated bound of the float pool's output.

    Bound (unit-normal q, k, v): max abs error <= max|v| / 14 and error norm <= 6 % of the
    output norm. Measured (D 8..128, three sequences up to 200 tokens): max abs 0.06..0.14
    (max|v| ~4.5), norm 2.6..3.3 %; a token that sees only itself gets its own V back, off by
    up to amax / 28.
    """
    gen = torch.Generator().manual_seed(4)
    lens = [c + n for c, n in zip(computed, new)]
    exact, fp8, tables, _ = _fill_pair(2, lens, block_size, HKV, D, gen)
    step = PagedBatch.build(tables, computed, new, None, block_size)
    q = torch.randn(sum(new), HQ, D, generator=gen)
    for layer in range(2):
        got = paged_attention(q, fp8, layer, step, scale=D**-0.5)
        want = paged_attention(q, exact, layer, step, scale=D**-0.5)
        start = 0
        for b in range(len(lens)):
            kb, vb = fp8.gather_blocks(layer, torch.tensor(tables[b]))
            ref = _naive_attention(q[start:start + new[b]], kb[:lens[b]], vb[:lens[b]], computed[b])
            torch.testing.assert_close(got[start:start + new[b]], ref, rtol=1e-5, atol=1e-6)
            start += new[b]
        vmax = exact.v[layer].abs().max()
        assert (got - want).abs().max() <= vmax / 14
        assert (got - want).norm() <= 0.06 * want.norm()


def test_fp8_copy_blocks_carries_scales():
    gen = torch.Generator().manual_seed(5)
    _, cache, _, _ = _fill_pair(2, [4, 4, 4], 4, HKV, D, gen)   # blocks 1..3 written
    k0, ks0 = cache.k.view(torch.uint8).clone(), cache.k_scale.clone()
    v0, vs0 = cache.v.view(torch.uint8).clone(), cache.v_scale.clone()
    copy_blocks(cache, [(1, 3)])
    assert torch.equal(cache.k.view(torch.uint8)[:, 3], k0[:, 1]) and torch.equal(cache.k_scale[:, 3], ks0[:, 1])
    assert torch.equal(cache.v.view(torch.uint8)[:, 3], v0[:, 1]) and torch.equal(cache.v_scale[:, 3], vs0[:, 1])
    assert torch.equal(cache.gather_blocks(0, torch.tensor([3]))[0], cache.gather_blocks(0, torch.tensor([1]))[0])
    assert torch.equal(cache.k_scale[:, :3], ks0[:, :3]) and torch.equal(cache.v_scale[:, :3], vs0[:, :3])


def test_fp8_ragged_rows_read_the_dequantized_cache():
    """The ragged kernel path's rows over an fp8 pool see exactly what the gather path sees."""
    g = torch.Generator().manual_seed(9)
    cache = PagedKVCache(1, 12, 4, HKV, D, storage_dtype=FP8)
    write_kv(cache, 0, torch.randn(44, HKV, D, generator=g), torch.randn(44, HKV, D, generator=g),
             torch.arange(4, 48))
    batch = PagedBatch.build([[3, 5, 7], [2], [9, 4, 10, 11]], [5, 0, 9], [3, 2, 4], None, 4)
    q = torch.randn(9, HQ, D, generator=g)
    want = paged_attention(q, cache, 0, batch, 0.3)
    plain = PagedKVCache(1, 12, 4, HKV, D)   # the dequantized values in a float pool
    k_all, v_all = cache.gather_blocks(0, torch.arange(12))   # (12 * 4, HKV, D)
    plain.k[0], plain.v[0] = k_all.view(12, 4, HKV, D), v_all.view(12, 4, HKV, D)
    rows, lens = batch.token_rows()
    got = _decode_rows_reference(q, plain, 0, rows, lens, 0.3)
    torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fp8_decode_and_ragged_kernel_match_the_reference():
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(10)
    cache = PagedKVCache(1, 40, 16, 2, 64, dtype=torch.bfloat16, device="cuda", storage_dtype=FP8)
    write_kv(cache, 0, torch.randn(600, 2, 64, generator=g).cuda(), torch.randn(600, 2, 64, generator=g).cuda(),
             torch.arange(16, 616, device="cuda"))
    cache.set_decode_backend("triton")
    cache.ragged_steps_in_kernel = True
    decode = PagedBatch.build([[3, 5, 7], [2], [9, 4, 10]], [20, 0, 30], [1, 1, 1], None, 16, "cuda")
    short = PagedBatch.build([[3, 5, 7], [2], [9, 4, 10]], [20, 0, 30], [12, 5, 1], None, 16, "cuda")
    # the ragged step one program per token, then in row groups of 4 tokens (the engine's for a GQA group of 4)
    for batch, path, groups in ((decode, "decode_kernel", 1), (short, "ragged_kernel", 1), (short, "ragged_kernel", 4)):
        cache.ragged_tokens_per_program = groups
        q = torch.randn(batch.num_tokens, 8, 64, generator=g).cuda().bfloat16()
        before = dict(cache.path_counts)
        got = paged_attention(q, cache, 0, batch, 0.125)
        assert cache.path_counts[path] == before[path] + 1
        want = _reference_paged_attention(q, cache, 0, batch, 0.125)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)   # bf16 compute
