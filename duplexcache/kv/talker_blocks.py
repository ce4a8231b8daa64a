"""The Talker's KV blocks: one block table per session, for the current audio turn only.

The Talker attends only within an audio turn (its KV resets when the turn ends), no block is
shared between sessions, and admission reserved a full turn (``engine.talker_turn_tokens``,
by default ``max_position_embeddings`` tokens) for every live session. So this manager is much smaller than ``KVCacheManager``: no
hashes, no window, no copy-on-write; every block a session holds has ``ref_cnt`` 1.

Ownership (who may touch what):

* ``BlockPool`` owns the blocks, their ref counts and the free list.
* ``TalkerBlocks`` owns each session's table and its computed length; only it asks the pool
  for blocks or gives them back.
* The Talker stage (``runtime/stages/talker_stage.py``) reads tables and reports computed lengths.

A table grows ahead of the tokens it will hold (a fast-forward may hold a whole turn before
computing any of it)::

    block 16, 40 tokens computed, grow(sid, 58):
    table idx   0        1         2              3
    tokens      0..15    16..31    32..39 40..47  48..57 (58..63 unused)
                computed computed  computed | to be computed by the next unit
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from duplexcache.kv.block_pool import BlockPool, KVCacheBlock

logger = logging.getLogger(__name__)


@dataclass
class _Table:
    """One session's Talker blocks (table order) and how many tokens of them are computed."""

    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_computed: int = 0


class TalkerBlocks:
    """Per-session Talker block tables over one ``BlockPool``."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self._tables: dict[str, _Table] = {}

    # ------------------------------------------------------------------ can / do

    def blocks_to_grow(self, sid: str, num_tokens: int) -> int:
        """Blocks ``grow(sid, num_tokens)`` would take from the pool (0 when the table is long enough)."""
        return max(0, -(-num_tokens // self.block_size) - self.num_blocks(sid))

    def can_grow(self, sid: str, num_tokens: int) -> bool:
        return self.blocks_to_grow(sid, num_tokens) <= self.pool.num_free

    def grow(self, sid: str, num_tokens: int) -> int:
        """Extend ``sid``'s table to hold ``num_tokens`` tokens; returns the blocks added.

        The ledger reserved a full turn for every live session, so the pool has the blocks:
        a shortfall here is an admission bug, not a caller's mistake."""
        need = self.blocks_to_grow(sid, num_tokens)
        if need > 0:
            assert need <= self.pool.num_free, f"Talker pool short for {sid}: admission bug"
            self._tables.setdefault(sid, _Table()).blocks.extend(self.pool.get_new_blocks(need))
        return need

    def free(self, sid: str) -> None:
        """Give back every block of ``sid`` and forget its computed length; a session without
        blocks is a no-op. Tail first, as every pool caller frees: the private blocks go to the
        front of the free list and the old tail is the first handed out again."""
        table = self._tables.pop(sid, None)
        if table is not None and table.blocks:
            self.pool.free_blocks(table.blocks[::-1])

    def set_num_computed(self, sid: str, num_tokens: int) -> None:
        """Record that the first ``num_tokens`` tokens of ``sid``'s table hold computed K/V."""
        table = self._tables.get(sid)
        held = len(table.blocks) * self.block_size if table is not None else 0
        assert 0 <= num_tokens <= held, f"session {sid}: {num_tokens} Talker tokens computed in {held} slots"
        if table is not None:
            table.num_computed = num_tokens

    # ------------------------------------------------------------------ reads

    def block_table(self, sid: str) -> list[int]:
        table = self._tables.get(sid)
        return [b.block_id for b in table.blocks] if table is not None else []

    def num_blocks(self, sid: str) -> int:
        table = self._tables.get(sid)
        return len(table.blocks) if table is not None else 0

    def num_tokens(self, sid: str) -> int:
        """Tokens of ``sid``'s current turn whose K/V is computed (0 between turns)."""
        table = self._tables.get(sid)
        return table.num_computed if table is not None else 0

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_used(self) -> int:
        return self.pool.num_usable_blocks - self.pool.num_free
