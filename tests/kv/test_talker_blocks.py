"""TalkerBlocks: exact block ids, ref counts and free-list order of the Talker's per-turn tables."""

import pytest

from duplexcache.kv.block_pool import BlockPool
from duplexcache.kv.talker_blocks import TalkerBlocks


def manager(num_blocks: int = 9, block_size: int = 4) -> TalkerBlocks:
    return TalkerBlocks(BlockPool(num_blocks), block_size)


def test_grow_takes_blocks_in_free_list_order_with_ref_count_one():
    kv = manager()
    assert kv.grow("a", 5) == 2 and kv.block_table("a") == [1, 2]
    assert kv.grow("b", 1) == 1 and kv.block_table("b") == [3]
    assert kv.grow("a", 8) == 0 and kv.grow("a", 9) == 1 and kv.block_table("a") == [1, 2, 4]
    assert all(kv.pool.blocks[i].ref_cnt == 1 for i in (1, 2, 3, 4))
    assert kv.num_used == 4 and kv.num_free == 4
    kv.pool.check_invariants()


def test_free_gives_back_tail_first_and_forgets_the_length():
    kv = manager()
    kv.grow("a", 12)
    kv.set_num_computed("a", 10)
    assert kv.num_tokens("a") == 10 and kv.num_blocks("a") == 3
    kv.free("a")
    # Freed tail first, private: they head the free list with the old tail first.
    assert kv.pool.free_block_queue.block_ids()[:3] == [3, 2, 1]
    assert kv.num_tokens("a") == kv.num_blocks("a") == 0 and kv.block_table("a") == []
    assert all(kv.pool.blocks[i].ref_cnt == 0 for i in (1, 2, 3))
    kv.free("a")   # nothing held: a no-op
    kv.pool.check_invariants()


def test_can_grow_is_asked_first_and_grow_asserts():
    kv = manager(num_blocks=3)            # 2 usable blocks
    assert kv.can_grow("a", 8) and not kv.can_grow("a", 9)
    assert kv.blocks_to_grow("a", 9) == 3
    with pytest.raises(AssertionError, match="admission bug"):
        kv.grow("a", 9)
    assert kv.num_free == 2               # the refused grow took nothing


def test_computed_length_cannot_pass_the_table():
    kv = manager()
    kv.grow("a", 4)
    with pytest.raises(AssertionError, match="computed in 4 slots"):
        kv.set_num_computed("a", 5)
