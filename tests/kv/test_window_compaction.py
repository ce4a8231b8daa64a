"""Window compaction end to end on the KV core: plan -> drop_blocks -> rerotate_keys_ leaves
every kept key equal to RoPE at its new logical index, and the anchor untouched."""

import torch

from duplexcache.kv.block_pool import BlockPool
from duplexcache.kv.kv_cache_manager import KVCacheManager
from duplexcache.kv.rope import apply_rope, rerotate_keys_, rope_cos_sin
from duplexcache.kv.window import WindowConfig, plan_compaction

BS, D, H, L, THETA = 4, 8, 1, 2, 1e4


def roped(raw: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    cos, sin = rope_cos_sin(pos, D, THETA)
    return apply_rope(raw, cos[:, None], sin[:, None])


def test_compaction_keeps_positions_equal_to_logical_indices():
    torch.manual_seed(0)
    m = KVCacheManager(BlockPool(32), block_size=BS)
    k = torch.zeros(L, 32, BS, H, D)
    prefix = 6
    m.allocate_context("s", list(range(prefix)), b"v")
    m.commit_context("s")
    m.append_slots("s", 40)  # 46 tokens
    raw = torch.randn(L, 46, H, D)  # per-token un-rotated keys (the "model")
    table = m.block_table("s")
    for i in range(46):
        for layer in range(L):
            k[layer, table[i // BS], i % BS] = roped(raw[layer, i:i + 1], torch.tensor([i]))[0]
    cfg = WindowConfig("basic", high_tokens=40, low_tokens=20)
    plan = plan_compaction(prefix, m.num_tokens("s"), 2, cfg, block_size=BS)
    assert plan is not None and plan.sink_blocks == 2
    kept_ids = [table[j] for j in plan.kept_block_range]
    anchor_before = k[:, table[:2]].clone()
    m.drop_blocks("s", plan.first_dropped_block, plan.num_dropped_blocks)
    rerotate_keys_(k, kept_ids, plan.delta_tokens, THETA)
    new_table = m.block_table("s")
    assert [new_table[j] for j in plan.kept_block_range_after] == kept_ids
    assert torch.equal(k[:, new_table[:2]], anchor_before)  # anchor never rewritten
    n = m.num_tokens("s")
    assert n == plan.new_num_tokens and n + 2 <= prefix + cfg.low_tokens
    old_index = list(range(8)) + list(range(8 + plan.delta_tokens, 46))  # surviving tokens
    for new_i, old_i in enumerate(old_index):
        for layer in range(L):
            want = roped(raw[layer, old_i:old_i + 1], torch.tensor([new_i]))[0]
            got = k[layer, new_table[new_i // BS], new_i % BS]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    m.check_invariants()
