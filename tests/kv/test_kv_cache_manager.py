"""KVCacheManager: sharing, copy-on-write tail, free order, window drops, accounting."""

import random

import pytest
import torch

from duplexcache.kv.block_pool import BlockPool
from duplexcache.kv.kv_cache_manager import (
    KVCacheManager,
    OutOfBlocks,
    PoolStats,
    SessionBytes,
    apply_block_copies_,
    num_blocks_for_budget,
)

BS = 4
CTX10 = list(range(100, 110))  # 2 full blocks + a 2-token tail
CTX8 = list(range(200, 208))  # exactly 2 full blocks


def make(num_blocks: int = 12, bpb: int = 10) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks), block_size=BS, bytes_per_block=bpb)


def free_ids(m: KVCacheManager) -> list[int]:
    return m.pool.free_block_queue.block_ids()


def refs(m: KVCacheManager) -> dict[int, int]:
    return {b.block_id: b.ref_cnt for b in m.pool.blocks if b.ref_cnt}


def test_sequence_exact_ids_refs_and_free_order():
    m = make(12)
    a = m.allocate_context("a", CTX10, b"v1")
    assert a.block_ids == (1, 2, 3) and a.num_cached_tokens == 0
    assert (a.compute_start, a.compute_end, a.blocks_to_compute) == (0, 10, (1, 2, 3))
    assert a.cow_source_block_id is None and a.template_pairs == ((3, 4),)
    m.commit_context("a")
    c = m.allocate_context("c", CTX10, b"v1")
    assert c.block_ids == (1, 2, 5) and c.num_cached_tokens == 8
    assert (c.compute_start, c.compute_end, c.blocks_to_compute) == (8, 8, ())
    assert c.cow_source_block_id == 4 and c.cow_pairs == ((4, 5),) and c.template_pairs == ()
    assert refs(m) == {1: 2, 2: 2, 3: 1, 4: 2, 5: 1}
    assert m.append_slots("a", 3) == [6]  # 10 + 3 = 13 tokens -> 4th block
    assert m.block_table("a") == [1, 2, 3, 6] and m.num_tokens("a") == 13
    m.check_invariants()
    m.free("a")  # template 4 (2->1), then 6, 3 private to the front; 2, 1 still held by c
    assert free_ids(m) == [6, 3, 7, 8, 9, 10, 11]
    m.free("c")  # template 4, then 5 private to front; 2, 1 cached to the back
    assert free_ids(m) == [5, 6, 3, 7, 8, 9, 10, 11, 4, 2, 1]
    assert m.pool_stats() == PoolStats(num_blocks=11, used=0, shared=0, cached_free=3, free=11,
                                       bytes_per_block=10)
    m.check_invariants()
    # A later session hits the cached blocks again, taking them off the free list.
    d = m.allocate_context("d", CTX10, b"v1")
    assert d.block_ids == (1, 2, 5) and d.cow_source_block_id == 4
    assert free_ids(m) == [6, 3, 7, 8, 9, 10, 11]
    m.check_invariants()


def test_same_step_second_session_hits_first_sessions_blocks():
    """nano-vllm bug: two sequences with one prefix in one step got duplicate blocks."""
    m = make(12)
    a = m.allocate_context("a", CTX10, b"v")
    b = m.allocate_context("b", CTX10, b"v")  # no commit / forward in between
    assert a.block_ids[:2] == b.block_ids[:2] == (1, 2)
    assert b.num_cached_tokens == 8 and b.compute_start == 8
    # a's template is still pending (filled after the forward): b computes nothing and copies
    # its 2-token tail from the template after a's template_pairs (deferred copy-on-write).
    assert b.cow_source_block_id is None and b.cow_pairs == () and b.template_pairs == ()
    assert b.compute_end == 8 and b.blocks_to_compute == () and b.num_tokens_to_compute == 0
    assert a.template_pairs == ((3, 4),) and b.deferred_cow_pairs == ((4, 5),)
    assert a.deferred_cow_pairs == ()
    # b still references a's template (no copy), so both sessions account the same bytes.
    assert a.template_block_id == b.template_block_id == 4
    assert refs(m) == {1: 2, 2: 2, 3: 1, 4: 2, 5: 1}
    assert m.session_bytes("a") == m.session_bytes("b") == SessionBytes(private=10, shared=30)
    assert m.pool_stats().used == 5  # 2 shared + 2 private tails + 1 template, no duplicates
    m.commit_context("a")
    c = m.allocate_context("c", CTX10, b"v")  # a later step: the template is ready
    assert c.cow_pairs == ((4, c.block_ids[2]),) and c.compute_start == c.compute_end == 8
    assert c.deferred_cow_pairs == ()  # a ready template is copied before, not after
    assert m.num_cow_copies == 2  # b's deferred copy and c's
    m.check_invariants()


def test_full_hit_is_zero_length_prefill():
    """nano-vllm bug: context length a multiple of the block size, second session hits all."""
    m = make(12)
    a = m.allocate_context("a", CTX8, b"v")
    assert a.template_pairs == () and a.blocks_to_compute == (1, 2)
    b = m.allocate_context("b", CTX8, b"v")
    assert b.block_ids == (1, 2)
    assert (b.num_cached_tokens, b.compute_start, b.compute_end) == (8, 8, 8)
    assert b.num_tokens_to_compute == 0 and b.blocks_to_compute == () and b.cow_pairs == ()
    # The next tokens go to a fresh private block, never into the shared full block.
    assert m.append_slots("b", 1) == [3]
    assert m.block_table("b") == [1, 2, 3] and m.block_table("a") == [1, 2]
    m.check_invariants()


def test_same_tokens_different_extra_keys_never_share():
    m = make(16)
    m.allocate_context("a", CTX10, b"voice-A")
    b = m.allocate_context("b", CTX10, b"voice-B")
    assert b.num_cached_tokens == 0 and set(b.block_ids).isdisjoint(m.block_table("a"))
    # Per-block extra keys: the first block (system prompt) carries no audio -> shared.
    c = m.allocate_context("c", CTX10, [b"", b"voice-C", b"voice-C"])
    d = m.allocate_context("d", CTX10, [b"", b"voice-D", b"voice-D"])
    assert c.block_ids[0] == d.block_ids[0] and d.num_cached_tokens == 4
    assert c.block_ids[1] != d.block_ids[1]
    with pytest.raises(ValueError, match="per-block extra keys"):
        m.allocate_context("e", CTX10, [b"", b"x"])
    m.check_invariants()


def test_share_false_hashes_nothing():
    m = make(12)
    a = m.allocate_context("a", CTX10, b"v", share=False)
    b = m.allocate_context("b", CTX10, b"v", share=False)
    assert a.block_ids == (1, 2, 3) and b.block_ids == (4, 5, 6)
    assert a.template_pairs == () and b.num_cached_tokens == 0
    assert m.pool.cached_block_hash_to_block == {}
    # A sharing session later does not hit the unshared ones either.
    c = m.allocate_context("c", CTX10, b"v", share=True)
    assert c.num_cached_tokens == 0
    m.free("a")
    assert free_ids(m)[:3] == [3, 2, 1]  # all private: to the front
    m.check_invariants()


def test_cow_copies_template_contents_through_cache_tensors():
    torch.manual_seed(0)
    m = make(12)
    k = torch.zeros(2, 12, BS, 1, 2)  # (layers, blocks, block_size, heads, dim)
    v = torch.zeros_like(k)
    a = m.allocate_context("a", CTX10, b"v")
    for bid in a.blocks_to_compute:  # "forward" of a writes its blocks
        k[:, bid] = torch.randn(2, BS, 1, 2)
        v[:, bid] = torch.randn(2, BS, 1, 2)
    apply_block_copies_([k, v], a.template_pairs)
    m.commit_context("a")
    c = m.allocate_context("c", CTX10, b"v")
    apply_block_copies_([k, v], c.cow_pairs)
    tail_a, tail_c = a.block_ids[2], c.block_ids[2]
    assert tail_a != tail_c
    assert torch.equal(k[:, tail_c, :2], k[:, tail_a, :2]) and torch.equal(v[:, tail_c, :2], v[:, tail_a, :2])
    # The template is read-only shared state: it counts as shared bytes for both sessions.
    assert m.session_bytes("a") == SessionBytes(private=10, shared=30)
    assert m.session_bytes("c") == SessionBytes(private=10, shared=30)
    assert m.pool_stats() == PoolStats(num_blocks=11, used=5, shared=3, cached_free=0, free=6,
                                       bytes_per_block=10)


def test_uncommitted_template_is_uncached_on_free():
    m = make(12)
    m.allocate_context("a", CTX10, b"v")  # template 4 pending
    m.free("a")
    assert free_ids(m)[:2] == [4, 3]  # the never-filled template went to the front, unhashed
    assert free_ids(m)[-2:] == [2, 1]
    c = m.allocate_context("c", CTX10, b"v")
    assert c.cow_source_block_id is None and c.num_cached_tokens == 8
    assert len(c.template_pairs) == 1  # c fills a new template
    m.check_invariants()


def test_can_allocate_counts_hits_and_out_of_blocks_backstop():
    m = make(6)  # 5 usable
    m.allocate_context("a", CTX8, b"v")  # 2 blocks
    assert m.num_blocks_needed(CTX8, b"v") == 0  # all hits, in use
    assert m.num_blocks_needed(CTX8, b"w") == 2
    m.allocate_context("b", list(range(12)), b"x", share=False)  # 3 blocks -> 0 free
    assert m.can_allocate_context(CTX8, b"v") and not m.can_allocate_context(CTX8, b"w")
    with pytest.raises(OutOfBlocks, match="can_allocate_context"):
        m.allocate_context("c", CTX8, b"w")
    assert "c" not in m
    m.allocate_context("d", CTX8, b"v")
    assert not m.can_append("d", 1)
    with pytest.raises(OutOfBlocks, match="can_append"):
        m.append_slots("d", 1)
    m.free("b")
    m.free("a")
    m.free("d")  # CTX8 blocks now cached free: hits still cost free-list blocks
    assert m.num_blocks_needed(CTX8, b"v") == 2
    m.check_invariants()


def test_context_that_never_fits_and_budget_errors():
    m = make(4)  # 3 usable blocks
    with pytest.raises(ValueError, match=r"17 tokens needs 5 blocks of 4.*only 3 usable"):
        m.can_allocate_context(list(range(17)), b"")
    assert num_blocks_for_budget(1000, 100, session_tokens=64, block_size=16) == 10
    with pytest.raises(ValueError, match=r"1000 bytes gives 10 blocks.*needs 12 blocks"):
        num_blocks_for_budget(1000, 100, session_tokens=12 * 16, block_size=16)
    with pytest.raises(ValueError):
        num_blocks_for_budget(1000, 0)


def test_drop_blocks_window_cut():
    m = make(16)
    m.allocate_context("a", CTX10, b"v")  # anchor: blocks 0..2 of the table (ids 1, 2, 3)
    m.append_slots("a", 26)  # 36 tokens: 9 blocks; ids 5.. (4 is the template)
    table = m.block_table("a")
    assert table == [1, 2, 3, 5, 6, 7, 8, 9, 10]
    with pytest.raises(ValueError, match="anchor has 3 blocks"):
        m.drop_blocks("a", 2, 1)
    with pytest.raises(ValueError, match="9 blocks are full"):
        m.drop_blocks("a", 3, 7)
    dropped = m.drop_blocks("a", 3, 2)
    assert dropped == [5, 6]
    assert m.block_table("a") == [1, 2, 3, 7, 8, 9, 10] and m.num_tokens("a") == 28
    assert free_ids(m)[:2] == [6, 5]  # tail first, private to the front
    m.check_invariants()


def test_random_sessions_keep_contents_and_invariants():
    """Shadow model: every slot records which (session context, token) it holds; each live
    session's table must read back its own token sequence, whatever was shared or evicted."""
    rng = random.Random(1)
    m = make(24)
    slots: dict[int, list] = {}  # block id -> per-slot content
    expect: dict[str, list] = {}
    contexts = [(list(range(n)), bytes([e])) for n in (5, 8, 11, 16) for e in (1, 2)]
    pending: list[tuple] = []
    num_deferred = [0]

    def write(bid, off, val):
        slots.setdefault(bid, [None] * BS)[off] = val

    def end_step():  # the forward of this step, then template copies, deferred copies, commits
        live = [(sid, alloc, content) for sid, alloc, content in pending if sid in m]
        for sid, alloc, content in live:
            table = alloc.block_ids
            for i in alloc.token_range:
                write(table[i // BS], i % BS, content[i])
        for _, alloc, _ in live:
            for s, d in alloc.template_pairs:
                slots[d] = list(slots[s])
        for _, alloc, _ in live:
            for s, d in alloc.deferred_cow_pairs:
                slots[d] = list(slots[s])
        for sid, _, _ in live:
            m.commit_context(sid)
        pending.clear()

    def check_contents():
        for sid in m.session_ids():
            table = m.block_table(sid)
            got = [slots[table[i // BS]][i % BS] for i in range(m.num_tokens(sid))]
            assert got == expect[sid], sid

    for step in range(1500):
        r = rng.random()
        live = m.session_ids()
        if r < 0.35:
            toks, ek = rng.choice(contexts)
            sid = f"s{step}"
            if m.can_allocate_context(toks, ek):
                alloc = m.allocate_context(sid, toks, ek)
                for s, d in alloc.cow_pairs:
                    slots[d] = list(slots[s])
                num_deferred[0] += len(alloc.deferred_cow_pairs)
                content = [(t, ek) for t in toks]
                expect[sid] = content
                pending.append((sid, alloc, content))
        elif r < 0.6 and live:
            sid = rng.choice(live)
            n = rng.randint(1, 6)
            if m.can_append(sid, n):
                start = m.num_tokens(sid)
                m.append_slots(sid, n)
                table = m.block_table(sid)
                for j in range(n):
                    val = (sid, start + j)
                    write(table[(start + j) // BS], (start + j) % BS, val)
                    expect[sid].append(val)
        elif r < 0.7 and live:
            sid = rng.choice(live)
            full = m.num_tokens(sid) // BS
            anchor = m.num_context_blocks(sid)
            if full > anchor:
                k = rng.randint(1, full - anchor)
                m.drop_blocks(sid, anchor, k)
                del expect[sid][anchor * BS:(anchor + k) * BS]
        elif live:
            end_step()  # contract: the step's forward runs before any of its sessions is freed
            sid = rng.choice(live)
            m.free(sid)
            del expect[sid]
        if rng.random() < 0.3:
            end_step()
            check_contents()
        m.check_invariants()
    end_step()
    check_contents()
    assert m.num_hit_blocks > 0 and m.num_cow_copies > 0 and num_deferred[0] > 0


def test_allocation_never_evicts_its_own_hits():
    m = make(6)  # usable 1..5
    m.allocate_context("a", CTX8, b"v")  # 1, 2
    m.free("a")
    m.allocate_context("c", CTX8, b"w")  # 3, 4
    m.free("c")
    assert free_ids(m) == [5, 2, 1, 4, 3]
    # Hits 1, 2 (cached free, in the middle) must be taken off the list before the two new
    # blocks are popped; otherwise popping would evict hit block 2.
    b = m.allocate_context("b", CTX8 + list(range(8)), b"v")
    assert b.block_ids == (1, 2, 5, 4) and b.num_cached_tokens == 8
    assert m.num_blocks_needed(CTX8, b"w") == 2  # c's first block 3 still cached, its 4 evicted
    assert free_ids(m) == [3]
    m.check_invariants()


def test_deferred_cow_pairs_fill_same_step_tails_after_the_template():
    """The manager, not the runtime, says which tails are copied from a template that is
    filled after this step's forward; applying template_pairs then deferred_cow_pairs gives
    every session of one context its creator's tail bits."""
    torch.manual_seed(0)
    m = make(20)
    k = torch.zeros(2, 20, BS, 1, 2)  # (layers, blocks, block_size, heads, dim)
    v = torch.zeros_like(k)
    a = m.allocate_context("a", CTX10, b"v")  # creator: table 1 2 3, template 4
    b = m.allocate_context("b", CTX10, b"v")  # same step: hits 1 2, tail 5, deferred from 4
    c = m.allocate_context("c", CTX10, b"v", share=False)  # 6 7 8: computes all, no template
    d = m.allocate_context("d", CTX10, b"w")  # other voice: 9 10 11, its own template 12
    e = m.allocate_context("e", CTX8, b"v")  # no tail: 13 14, nothing to defer
    f = m.allocate_context("f", CTX10, b"v")  # a third same-step session: tail 15
    assert [x.block_ids for x in (a, b, c, d, e, f)] == [
        (1, 2, 3), (1, 2, 5), (6, 7, 8), (9, 10, 11), (13, 14), (1, 2, 15)]
    assert [x.template_pairs for x in (a, b, c, d, e, f)] == [((3, 4),), (), (), ((11, 12),), (), ()]
    assert [x.deferred_cow_pairs for x in (a, b, c, d, e, f)] == [(), ((4, 5),), (), (), (), ((4, 15),)]
    assert [x.token_range for x in (a, b, c, d, e, f)] == [
        range(10), range(8, 8), range(10), range(10), range(8), range(8, 8)]
    assert refs(m)[4] == 3 and m.num_cow_copies == 2
    m.check_invariants()
    # The step's forward writes each session's computed tokens...
    for x in (a, b, c, d, e, f):
        for i in x.token_range:
            bid = x.block_ids[i // BS]
            k[:, bid, i % BS] = torch.randn(2, 1, 2)
            v[:, bid, i % BS] = torch.randn(2, 1, 2)
    # ...then every template copy, then the deferred copies (they read the templates).
    apply_block_copies_([k, v], [p for x in (a, b, c, d, e, f) for p in x.template_pairs])
    apply_block_copies_([k, v], [p for x in (a, b, c, d, e, f) for p in x.deferred_cow_pairs])
    for tail in (5, 15):
        assert torch.equal(k[:, tail, :2], k[:, 3, :2]) and torch.equal(v[:, tail, :2], v[:, 3, :2])
        assert torch.count_nonzero(k[:, tail, :2]) == k[:, tail, :2].numel()  # really written
    for sid in "abcdef":
        m.commit_context(sid)
    # A later step gets the now-ready template as an ordinary copy before its forward.
    g = m.allocate_context("g", CTX10, b"v")
    assert g.block_ids == (1, 2, 16) and g.token_range == range(8, 8)
    assert g.cow_pairs == ((4, 16),) and g.deferred_cow_pairs == ()
    assert m.session_bytes("b") == m.session_bytes("a") == SessionBytes(private=10, shared=30)
    m.check_invariants()


def _session_of_26_tokens() -> KVCacheManager:
    m = make(16)
    m.allocate_context("a", CTX10, b"v")  # anchor table 1 2 3 (2 shared + tail), template 4
    m.commit_context("a")
    m.append_slots("a", 16)  # 26 tokens: 7 blocks, the last partial (tokens 24, 25)
    assert m.block_table("a") == [1, 2, 3, 5, 6, 7, 8] and free_ids(m) == list(range(9, 16))
    return m


@pytest.mark.parametrize("keep,released,table,free_front", [
    (26, [], [1, 2, 3, 5, 6, 7, 8], [9]),
    (25, [], [1, 2, 3, 5, 6, 7, 8], [9]),  # token 24 is still in block 8
    (24, [8], [1, 2, 3, 5, 6, 7], [8, 9]),  # the partial last block goes too
    (21, [8], [1, 2, 3, 5, 6, 7], [8, 9]),
    (20, [7, 8], [1, 2, 3, 5, 6], [8, 7, 9]),
    (13, [6, 7, 8], [1, 2, 3, 5], [8, 7, 6, 9]),
    (12, [5, 6, 7, 8], [1, 2, 3], [8, 7, 6, 5, 9]),  # back to the anchor blocks
    (10, [5, 6, 7, 8], [1, 2, 3], [8, 7, 6, 5, 9]),  # the context itself: anchor kept whole
])
def test_truncate_releases_every_block_past_the_last_kept_token(keep, released, table, free_front):
    m = _session_of_26_tokens()
    assert m.truncate("a", keep) == released
    assert m.block_table("a") == table and m.num_tokens("a") == keep
    assert free_ids(m)[:len(free_front)] == free_front and len(free_ids(m)) == 7 + len(released)
    assert m.num_truncated_blocks == len(released)
    assert refs(m) == {1: 1, 2: 1, 3: 1, 4: 1, **{b: 1 for b in table[3:]}}  # template kept
    m.check_invariants()
    # Appending again takes the released blocks back, old last block first.
    new = m.append_slots("a", 26 - keep)
    assert new == free_front[:len(released)]
    m.check_invariants()


@pytest.mark.parametrize("keep", [9, 0, 27, -1])
def test_truncate_refuses_anchor_tokens_and_growth(keep):
    m = _session_of_26_tokens()
    with pytest.raises(ValueError, match=r"truncate\('a', -?\d+\): must keep between the context \(10"):
        m.truncate("a", keep)
    assert m.block_table("a") == [1, 2, 3, 5, 6, 7, 8] and m.num_tokens("a") == 26
    with pytest.raises(ValueError, match="unknown session"):
        m.truncate("zz", 10)


def test_truncate_never_releases_shared_anchor_blocks():
    m = make(12)
    m.allocate_context("a", CTX8, b"v")  # 1 2: full, shared
    m.allocate_context("b", CTX8, b"v")
    m.append_slots("a", 9)  # 17 tokens: 3, 4, 5
    assert m.block_table("a") == [1, 2, 3, 4, 5]
    assert m.truncate("a", 8) == [3, 4, 5]
    assert m.block_table("a") == m.block_table("b") == [1, 2] and refs(m) == {1: 2, 2: 2}
    assert free_ids(m)[:3] == [5, 4, 3]
    m.check_invariants()


def test_abandon_context_unhashes_only_the_blocks_not_computed():
    m = make(12)
    a = m.allocate_context("a", CTX10, b"v1")           # full blocks 1, 2; tail 3; template 4
    m.abandon_context("a", computed_tokens=5)          # block 1 done, block 2 half done
    m.check_invariants()
    assert m.pool.num_free == 11 and "a" not in m
    b = m.allocate_context("b", CTX10, b"v1")
    # Block 1 (computed) is still a hit; block 2 and the never-filled template are not.
    assert b.num_cached_tokens == BS and b.block_ids[0] == a.block_ids[0]
    assert b.compute_start == BS and b.compute_end == 10 and b.template_pairs
