"""BlockPool / FreeKVCacheBlockQueue: exact block ids, ref counts and free-list order."""

import random

import pytest

from duplexcache.kv.block_hash import hash_block_tokens
from duplexcache.kv.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, OutOfBlocks


def key(i: int) -> bytes:
    return hash_block_tokens(None, [i], b"")


def test_null_block_taken_out_and_never_counted():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.num_free == 4 == pool.num_usable_blocks
    assert pool.free_block_queue.block_ids() == [1, 2, 3, 4]
    blocks = pool.get_new_blocks(4)
    assert [b.block_id for b in blocks] == [1, 2, 3, 4]
    with pytest.raises(OutOfBlocks):
        pool.get_new_blocks(1)
    pool.check_invariants()


def test_pool_too_small_is_value_error():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)


def test_block_hash_setter_refuses_overwrite():
    b = KVCacheBlock(block_id=3)
    b.block_hash = key(1)
    with pytest.raises(AssertionError, match="already has a hash"):
        b.block_hash = key(2)
    b.reset_hash()
    b.block_hash = key(2)
    assert b.block_hash == key(2)


def test_queue_remove_from_middle_append_appendleft():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[3])
    q.remove(blocks[0])
    assert q.block_ids() == [1, 2, 4, 5] and q.num_free_blocks == 4
    q.appendleft(blocks[3])
    q.append(blocks[0])
    assert q.block_ids() == [3, 1, 2, 4, 5, 0]
    assert q.popleft() is blocks[3]
    assert len(q) == 5 == len(list(q))
    with pytest.raises(RuntimeError, match="not in the free list"):
        q.remove(blocks[3])
    with pytest.raises(AssertionError, match="already in the free list"):
        q.append(blocks[1])


def test_free_order_private_front_cached_back_in_given_order():
    pool = BlockPool(8)
    a = pool.get_new_blocks(5)  # ids 1..5
    pool.cache_full_block(a[0], key(0))
    pool.cache_full_block(a[1], key(1))
    # Free tail first, as the manager does: 5, 4, 3 private; 2, 1 cached.
    pool.free_blocks(a[::-1])
    # Private: first freed (5) ends at the very front; cached: first freed (2) evicted first.
    assert pool.free_block_queue.block_ids() == [5, 4, 3, 6, 7, 2, 1]
    assert pool.num_cached_free == 2
    pool.check_invariants()


# (ops, expected free list, expected ref counts by id). Ops: ("new", n) -> appended to `held`,
# ("free", idx list into held), ("cache", held idx, key id), ("touch", key id).
CASES = [
    ("alloc-free-private-first-passed-is-front", [("new", 2), ("free", [1, 0])], [2, 1, 3, 4], {}),
    ("double-ref-then-free-once", [("new", 1), ("cache", 0, 7), ("touch", 7), ("free", [0])],
     [2, 3, 4], {1: 1}),
    ("hit-on-cached-free-takes-from-middle",
     [("new", 3), ("cache", 1, 9), ("free", [2, 1, 0]), ("touch", 9)],
     [3, 1, 4], {2: 1}),
    ("evict-order-is-lru",
     [("new", 2), ("cache", 0, 1), ("cache", 1, 2), ("free", [1]), ("free", [0]), ("new", 2)],
     [2, 1], {3: 1, 4: 1}),
]


@pytest.mark.parametrize("name,ops,free_ids,refs", CASES, ids=[c[0] for c in CASES])
def test_table_driven_pool_ops(name, ops, free_ids, refs):
    pool = BlockPool(5)
    held = []
    for op in ops:
        if op[0] == "new":
            held += pool.get_new_blocks(op[1])
        elif op[0] == "free":
            pool.free_blocks([held[i] for i in op[1]])
        elif op[0] == "cache":
            pool.cache_full_block(held[op[1]], key(op[2]))
        elif op[0] == "touch":
            pool.touch([pool.get_cached_block(key(op[1]))])
        pool.check_invariants()
    assert pool.free_block_queue.block_ids() == free_ids
    assert {b.block_id: b.ref_cnt for b in pool.blocks if b.ref_cnt} == refs


def test_stale_hash_removed_when_cached_block_is_evicted():
    pool = BlockPool(3)  # usable: 1, 2
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_block(b, key(5))
    pool.free_blocks([b])
    assert pool.get_cached_block(key(5)) is b
    pool.get_new_blocks(1)  # takes 2 (front), cached 1 survives
    assert pool.get_cached_block(key(5)) is b
    (reused,) = pool.get_new_blocks(1)  # must evict 1
    assert reused is b and reused.block_hash is None
    assert pool.get_cached_block(key(5)) is None  # no stale mapping to the overwritten block
    assert pool.num_cached_free == 0
    pool.cache_full_block(reused, key(6))  # the evicted block can be re-keyed
    pool.check_invariants()


def test_lru_touched_block_survives_eviction_fifo_would_not():
    pool = BlockPool(4)  # usable 1, 2, 3
    blocks = pool.get_new_blocks(3)
    for i, b in enumerate(blocks):
        pool.cache_full_block(b, key(i))
    pool.free_blocks(blocks)  # freed (and cached) in order 1, 2, 3: 1 is the oldest
    assert pool.free_block_queue.block_ids() == [1, 2, 3]
    old = pool.get_cached_block(key(0))
    pool.touch([old])  # a session hits the oldest cached block ...
    pool.free_blocks([old])  # ... and releases it: now most recently used
    assert pool.free_block_queue.block_ids() == [2, 3, 1]
    (evicted,) = pool.get_new_blocks(1)
    # LRU evicts 2 (the least recently used); FIFO by first-free time would have evicted 1.
    assert evicted.block_id == 2
    assert pool.get_cached_block(key(0)) is old
    assert pool.get_cached_block(key(1)) is None
    pool.check_invariants()


def test_random_ops_keep_invariants():
    rng = random.Random(0)
    pool = BlockPool(17)
    held: list = []
    for step in range(400):
        r = rng.random()
        if r < 0.4 and pool.num_free:
            blocks = pool.get_new_blocks(rng.randint(1, min(3, pool.num_free)))
            for b in blocks:
                if rng.random() < 0.5:
                    pool.cache_full_block(b, key(1000 + step * 4 + len(held) % 4 + b.block_id * 100000))
            held += blocks
        elif r < 0.6:
            cached = [b for b in pool.cached_block_hash_to_block.values()]
            if cached:
                b = rng.choice(cached)
                pool.touch([b])
                held.append(b)
        elif held:
            i = rng.randrange(len(held))
            pool.free_blocks([held.pop(i)])
        pool.check_invariants()
        assert pool.num_free + len({id(b) for b in held}) == pool.num_usable_blocks
