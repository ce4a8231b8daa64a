"""Physical KV blocks, the free list threaded through them, and the pool that owns both.

Ownership (who may touch what):

* ``BlockPool`` owns every ``KVCacheBlock``, the ``FreeKVCacheBlockQueue`` and the map
  from block hash to cached block. Only the pool changes ``ref_cnt``, the hash and the
  free-list pointers.
* ``KVCacheManager`` (``kv_cache_manager.py``) owns the per-session block tables and asks
  the pool for blocks; it never edits a block's fields itself.
* The model runner only reads block ids.

Eviction order (pinned by ``tests/kv/test_block_pool.py``):

* A block whose ``ref_cnt`` drops to 0 and that has **no hash** (private to one session)
  goes to the **front** of the free list: its contents are useless to anyone, so it is
  reused first.
* A block that drops to 0 and **has a hash** (a shared context block or a copy-on-write
  template) goes to the **back** of the free list: it stays cached, and a later session
  with the same context can take it back out of the middle in O(1) (``touch``). New blocks
  are taken from the front, so cached blocks are evicted least recently freed first (LRU).
* Evicting a cached block removes its hash mapping before the block is handed out, so a
  later lookup can never return a block whose contents were overwritten (the "stale hash
  on reuse" bug of nano-vllm).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

BlockHash = bytes


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a mutating call needs.

    Admission must ask ``can_*`` first; seeing this error means a caller skipped that
    check (it is a backstop, not a flow-control signal).
    """


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical block of ``block_size`` token slots in every layer's K and V tensors.

    Identity matters (``eq=False``): two blocks are the same only if they are the same object.
    """

    # Index into the cache tensors' block dimension. Set once by BlockPool, never changed.
    block_id: int
    # Number of block tables (plus copy-on-write template holders) referencing this block.
    # Only BlockPool changes it.
    ref_cnt: int = 0
    # Content key of a full shared context block or of a copy-on-write template; None for a
    # private block. Only BlockPool sets or resets it, through the property below.
    _block_hash: BlockHash | None = None
    # Links of the doubly linked free list. Only FreeKVCacheBlockQueue touches them.
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    # True only for block 0, which the pool takes out at start (table padding points at it).
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHash | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHash) -> None:
        # Overwriting a set hash would leave the old key mapping to a block that no longer
        # holds that content; the pool must reset_hash() (evict) first.
        assert self._block_hash is None, (
            f"block {self.block_id} already has a hash; reset it before setting a new one"
        )
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        """Forget the hash (the pool calls this when it evicts the block from the map)."""
        self._block_hash = None

    def __repr__(self) -> str:
        h = self._block_hash.hex()[:8] if self._block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, threaded through the blocks themselves.

    Fake head and tail nodes remove the empty-list special cases. ``remove`` takes a block
    out of the middle in O(1), which is what a cache hit on a cached free block needs
    (a ``deque.remove`` would be O(n)).
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def _insert_between(
        self, block: KVCacheBlock, prev: KVCacheBlock, nxt: KVCacheBlock
    ) -> None:
        assert block.prev_free_block is None and block.next_free_block is None, (
            f"block {block.block_id} is already in the free list"
        )
        block.prev_free_block = prev
        block.next_free_block = nxt
        prev.next_free_block = block
        nxt.prev_free_block = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the back (evicted last)."""
        assert self._tail.prev_free_block is not None
        self._insert_between(block, self._tail.prev_free_block, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the front (handed out next)."""
        assert self._head.next_free_block is not None
        self._insert_between(block, self._head, self._head.next_free_block)

    def remove(self, block: KVCacheBlock) -> None:
        """Take ``block`` out of the list, wherever it is, in O(1)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"FreeKVCacheBlockQueue: block {block.block_id} is not in the free list")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = None
        block.next_free_block = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        """Take the front block."""
        first = self._head.next_free_block
        if first is None or first is self._tail:
            raise OutOfBlocks("FreeKVCacheBlockQueue: no free blocks")
        self.remove(first)
        return first

    def __iter__(self):
        node = self._head.next_free_block
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free_block

    def __len__(self) -> int:
        return self.num_free_blocks

    def block_ids(self) -> list[int]:
        """Free block ids from front to back (tests and debugging)."""
        return [b.block_id for b in self]


class BlockPool:
    """All ``num_blocks`` blocks of one model's KV cache; block 0 is the null block.

    The null block is taken out of the free list at start and never counted as free, used
    or cached; tables may point at it as padding.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"BlockPool needs at least 2 blocks (the null block + 1 usable), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        # Free blocks that still carry a hash (cached, evictable). Kept as a counter so
        # admission is O(1); check_invariants() recounts it.
        self.num_cached_free = 0
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        assert self.null_block.block_id == 0

    # ---------------------------------------------------------------- counters

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be handed out (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Free blocks, cached ones included (a cached free block can be evicted)."""
        return self.free_block_queue.num_free_blocks

    # ---------------------------------------------------------------- allocate / free

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out ``num_blocks`` blocks from the front of the free list, ref_cnt 1 each.

        A cached block taken this way is evicted: its hash mapping is removed first.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free:
            raise OutOfBlocks(
                f"BlockPool: asked for {num_blocks} blocks, only {self.num_free} free "
                f"(of {self.num_usable_blocks} usable); admission must check can_* first"
            )
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop a free cached block's hash mapping (it is about to be overwritten)."""
        h = block.block_hash
        assert h is not None
        mapped = self.cached_block_hash_to_block.pop(h, None)
        assert mapped is block, f"hash map points at {mapped} instead of evicted block {block.block_id}"
        block.reset_hash()
        self.num_cached_free -= 1
        logger.debug("evicted cached block %d", block.block_id)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Record one more reference to each block (a cache hit).

        A hit on a cached free block takes it out of the free list (from the middle, O(1)).
        """
        for block in blocks:
            assert not block.is_null, "the null block cannot be referenced"
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                if block.block_hash is not None:
                    self.num_cached_free -= 1
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given order (callers pass tail first).

        Blocks reaching ref_cnt 0: hashed (cached) ones are appended to the back in the
        given order, so the first one passed is evicted first; private ones go to the front
        in the given order, so the first one passed is handed out first.
        """
        private: list[KVCacheBlock] = []
        for block in ordered_blocks:
            assert not block.is_null, "the null block cannot be freed"
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than referenced"
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            if block.block_hash is not None:
                self.free_block_queue.append(block)
                self.num_cached_free += 1
            else:
                private.append(block)
        for block in reversed(private):
            self.free_block_queue.appendleft(block)

    # ---------------------------------------------------------------- hash map

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register ``block`` (in use, contents being computed) under ``block_hash``."""
        assert block.ref_cnt > 0, f"only an in-use block can be cached, block {block.block_id} is free"
        existing = self.cached_block_hash_to_block.get(block_hash)
        assert existing is None, (
            f"hash already maps to block {existing.block_id if existing else None}; "
            "look it up with get_cached_block before allocating a duplicate"
        )
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Remove an in-use block's hash (e.g. a template whose contents were never written)."""
        assert block.ref_cnt > 0, f"uncache_block needs an in-use block, {block.block_id} is free"
        h = block.block_hash
        if h is None:
            return
        assert self.cached_block_hash_to_block.get(h) is block
        del self.cached_block_hash_to_block[h]
        block.reset_hash()

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding ``block_hash``'s contents, in use or cached free, or None."""
        return self.cached_block_hash_to_block.get(block_hash)

    # ---------------------------------------------------------------- checks

    def check_invariants(self) -> None:
        """Raise AssertionError if the free list, counters or hash map disagree."""
        free = list(self.free_block_queue)
        assert len(free) == self.free_block_queue.num_free_blocks, (
            f"free list has {len(free)} blocks, counter says {self.free_block_queue.num_free_blocks}"
        )
        assert len({b.block_id for b in free}) == len(free), "a block is twice in the free list"
        assert all(b.ref_cnt == 0 and not b.is_null for b in free), "a used or null block is free"
        cached_free = sum(1 for b in free if b.block_hash is not None)
        assert cached_free == self.num_cached_free, (
            f"{cached_free} cached free blocks, counter says {self.num_cached_free}"
        )
        free_ids = {b.block_id for b in free}
        for b in self.blocks[1:]:
            if b.ref_cnt == 0:
                assert b.block_id in free_ids, f"block {b.block_id} has ref_cnt 0 but is not free"
        for h, b in self.cached_block_hash_to_block.items():
            assert b.block_hash == h, f"hash map entry for block {b.block_id} disagrees with its hash"
        hashed = [b for b in self.blocks if b.block_hash is not None]
        assert len(hashed) == len(self.cached_block_hash_to_block), (
            "a hashed block is missing from the hash map"
        )
        assert self.null_block.ref_cnt == 0 and self.null_block.block_hash is None
        assert self.null_block.prev_free_block is None, "the null block is in the free list"
