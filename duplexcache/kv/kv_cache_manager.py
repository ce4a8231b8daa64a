"""Per-session block tables over one ``BlockPool``: shared context blocks, copy-on-write tail,
window drops and memory accounting.

Lifecycle of one session (what the runtime calls, in order)::

    ok = mgr.can_allocate_context(token_ids, extra_key, share)      # admission asks
    alloc = mgr.allocate_context(sid, token_ids, extra_key, share)  # then does
    # (apply_block_copies_ below, or paged_attention.copy_blocks(cache, pairs), copy K and V;
    #  an fp8 pool's k_scale/v_scale are laid out per block too and must be copied with them)
    apply_block_copies_([k, v], alloc.cow_pairs)      # before the forward: tail from template
    forward over tokens alloc.compute_start .. alloc.compute_end-1 (may be empty)
    apply_block_copies_([k, v], alloc.template_pairs) # after the forward: fill new template
    apply_block_copies_([k, v], alloc.deferred_cow_pairs)  # then: tail from a same-step template
    mgr.commit_context(sid)                           # template now ready for later steps
    per tick:  mgr.can_append(sid, n) -> mgr.append_slots(sid, n) -> forward
    window:    plan = plan_compaction(...); mgr.drop_blocks(sid, plan.first_dropped_block,
               plan.num_dropped_blocks); rerotate_keys_(k, kept ids, plan.delta_tokens, theta)
    rebuild:   mgr.truncate(sid, sink_blocks * block_size), then re-prefill the kept tokens
    end:       mgr.free(sid)

Context layout (block_size 16, a 53-token context)::

    tokens   0........15 16.......31 32.......47 48..52
    blocks   [ full 0  ][ full 1   ][ full 2   ][tail ]
             shared read-only, keyed  ^          private; its 5 tokens are copied from
             by chained sha256         |          a read-only template block (cow_pairs)
                                       |          when one with the same key is cached
             a second session with the same context references the same 3 blocks
             (ref_cnt 2), whether the first session was allocated in an earlier step
             or earlier in the same step.

Same-step hits: a hit may name blocks whose K/V another session computes in the *same*
forward. That is correct because the paged forward writes every sequence's K/V of a layer
before that layer's attention (docs/design.md). The runtime must therefore run the forward
for every allocation it made before freeing any of them. The tail template such a creator
registers is filled only after the forward, so a same-step session gets its tail as a
``deferred_cow_pairs`` copy, applied after every ``template_pairs`` copy of the step.

Full hit: when every context block hits (context length a multiple of 16, or a ready
template for the tail), there is nothing to compute (``compute_start == compute_end``).
The session produces no logits for its last context token; the duplex loop does not need
them because the next input is always a ``<unit>`` with audio.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from duplexcache.kv.block_hash import BlockHash, context_block_hashes
from duplexcache.kv.block_pool import BlockPool, KVCacheBlock, OutOfBlocks

logger = logging.getLogger(__name__)

__all__ = ["ContextAllocation", "KVCacheManager", "OutOfBlocks", "PoolStats", "SessionBytes", "apply_block_copies_",
           "num_blocks_for_budget"]


def num_blocks_for_budget(
    budget_bytes: int, bytes_per_block: int, session_tokens: int = 1, block_size: int = 16
) -> int:
    """Number of pool blocks (null block included) that fit in ``budget_bytes``.

    Raises ValueError, naming the numbers, if the pool could not hold even one session of
    ``session_tokens`` tokens (pass the worst case: context + window high mark + one unit).
    """
    if bytes_per_block <= 0 or block_size <= 0:
        raise ValueError(f"bytes_per_block ({bytes_per_block}) and block_size ({block_size}) must be > 0")
    if budget_bytes < 0 or session_tokens < 0:
        raise ValueError(f"budget_bytes ({budget_bytes}) and session_tokens ({session_tokens}) must be >= 0")
    num_blocks = budget_bytes // bytes_per_block
    need = -(-session_tokens // block_size)
    if num_blocks - 1 < max(need, 1):
        raise ValueError(
            f"KV budget of {budget_bytes} bytes gives {num_blocks} blocks of {bytes_per_block} bytes "
            f"(1 is the null block), but one session of {session_tokens} tokens needs {max(need, 1)} "
            f"blocks of {block_size} tokens = {(max(need, 1) + 1) * bytes_per_block} bytes with the null block"
        )
    return num_blocks


def apply_block_copies_(tensors: Sequence[torch.Tensor], pairs: Sequence[tuple[int, int]]) -> None:
    """Copy whole blocks ``src -> dst`` in place, in order, in each tensor.

    Each tensor is laid out ``(num_layers, num_blocks, block_size, ...)`` (the paged K and V
    caches, and an fp8 pool's ``k_scale``/``v_scale``: pass them too), so a block is copied in
    every layer.
    """
    if not pairs:
        return
    src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
    if len(set(dst.tolist())) != len(pairs) or set(src.tolist()) & set(dst.tolist()):
        # A chain (a->b, b->c) would depend on order; the manager never emits one.
        raise ValueError(f"block copies must have distinct destinations disjoint from sources: {pairs}")
    for t in tensors:
        s, d = src.to(t.device), dst.to(t.device)
        t[:, d] = t[:, s]


@dataclass(frozen=True)
class ContextAllocation:
    """What ``allocate_context`` did, and what the runtime must compute and copy.

    The session computes tokens ``[compute_start, compute_end)`` of its context, writing
    them into ``blocks_to_compute`` (fresh blocks; a forward with num_computed=compute_start,
    num_new=compute_end-compute_start). Tokens ``[0, num_cached_tokens)`` are in shared full
    blocks that are (or, for a same-step hit, are being) computed by another session.
    """

    session_id: str
    block_ids: tuple[int, ...]  # the session's whole block table after allocation
    num_tokens: int  # context length
    num_cached_tokens: int  # tokens of hit full blocks (a multiple of block_size)
    compute_start: int  # first token to compute (== num_cached_tokens)
    compute_end: int  # one past the last token to compute
    blocks_to_compute: tuple[int, ...]  # blocks the forward writes, in table order
    # Ready read-only template the partial last block is copied from before the forward
    # (cow_pairs), or None: the tail is computed, or copied after it (deferred_cow_pairs).
    cow_source_block_id: int | None
    # (src, dst) whole-block copies to apply BEFORE the session's next forward:
    # template -> the session's private tail block.
    cow_pairs: tuple[tuple[int, int], ...] = ()
    # (src, dst) copies to apply AFTER the forward that computes this context, then call
    # commit_context(sid): the session's computed tail -> a new read-only template.
    template_pairs: tuple[tuple[int, int], ...] = ()
    # The template of this context's tail that the session references (counted in its
    # shared bytes), or None (share=False, or no partial tail). Four cases:
    #   cow_pairs set             -> a ready template, copied before the forward;
    #   template_pairs set        -> this session creates it (computes the tail, then copies);
    #   deferred_cow_pairs set    -> another session created it earlier in this same step
    #                                and fills it after the forward: copied after that;
    #   none of them              -> some full block missed, so the session computes its
    #                                whole tail itself (compute_end == num_tokens).
    template_block_id: int | None = None
    # (src, dst) copies to apply AFTER the forward AND after every allocation's template_pairs
    # of the step: template (filled by its creator's template_pairs) -> this session's private
    # tail. Then the tail is not computed (compute_end stops at the last full block), and every
    # session of one context holds the same K/V bits in its tail.
    deferred_cow_pairs: tuple[tuple[int, int], ...] = ()

    @property
    def token_range(self) -> range:
        return range(self.compute_start, self.compute_end)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.compute_end - self.compute_start


@dataclass(frozen=True)
class SessionBytes:
    """Bytes a session references: ``private`` (its own) and ``shared`` (referenced by others
    too, or cached content-addressed blocks). Shared bytes are counted per referencing session."""

    private: int
    shared: int

    @property
    def total(self) -> int:
        return self.private + self.shared


@dataclass(frozen=True)
class PoolStats:
    """Block counts of the pool; the null block is not counted anywhere.

    ``used + free == num_blocks``; ``shared <= used`` counts in-use content-addressed blocks
    once each; ``cached_free <= free`` counts free blocks whose content is still cached.
    """

    num_blocks: int
    used: int
    shared: int
    cached_free: int
    free: int
    bytes_per_block: int = 0

    def to_bytes(self) -> dict[str, int]:
        b = self.bytes_per_block
        return {
            "shared": self.shared * b,
            "private": (self.used - self.shared) * b,
            "cached_free": self.cached_free * b,
            "free": self.free * b,
        }


@dataclass
class _Session:
    """Block state of one session. Only KVCacheManager mutates it."""

    blocks: list[KVCacheBlock]
    num_tokens: int
    num_context_tokens: int
    # Copy-on-write template this session holds a reference on (created or used by it).
    template: KVCacheBlock | None = None
    # True while the template this session created has no contents yet (see commit_context).
    template_pending: bool = False
    dropped_tokens: int = 0  # total tokens released by window compactions


@dataclass
class _ContextPlan:
    """Result of the read-only lookup shared by can_allocate_context and allocate_context."""

    num_tokens: int
    full_keys: list[BlockHash | None]
    partial_key: BlockHash | None
    hits: list[KVCacheBlock]
    template: KVCacheBlock | None  # ready template to copy the tail from
    make_template: bool  # allocate and register a new template
    ref_only_template: KVCacheBlock | None = None  # referenced for accounting, not copied from
    # A template registered but not yet filled (created earlier in this step): copied from
    # after the step's forward (deferred copy-on-write).
    deferred_template: KVCacheBlock | None = None
    num_new_blocks: int = 0
    num_free_hits: int = 0

    @property
    def blocks_needed(self) -> int:
        """Free-list blocks this allocation consumes (new blocks + hits taken off the free list)."""
        return self.num_new_blocks + self.num_free_hits


class KVCacheManager:
    """Block tables of all sessions over one pool; sessions are named by string ids."""

    def __init__(self, block_pool: BlockPool, block_size: int = 16, bytes_per_block: int = 0) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if bytes_per_block < 0:
            raise ValueError(f"bytes_per_block must be >= 0, got {bytes_per_block}")
        self.pool = block_pool
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self._sessions: dict[str, _Session] = {}
        # Templates registered but not yet filled (their creator has not committed).
        self._pending_templates: set[int] = set()
        # Counters for metrics.
        self.num_hit_blocks = 0
        self.num_miss_blocks = 0
        self.num_cow_copies = 0  # ready and deferred template -> tail copies
        self.num_truncated_blocks = 0

    # ---------------------------------------------------------------- queries

    def __contains__(self, sid: str) -> bool:
        return sid in self._sessions

    def session_ids(self) -> list[str]:
        return list(self._sessions)

    def _get(self, sid: str) -> _Session:
        try:
            return self._sessions[sid]
        except KeyError:
            raise ValueError(f"unknown session {sid!r}") from None

    def block_table(self, sid: str) -> list[int]:
        return [b.block_id for b in self._get(sid).blocks]

    def num_tokens(self, sid: str) -> int:
        return self._get(sid).num_tokens

    def num_context_blocks(self, sid: str) -> int:
        """Blocks holding the context (full + partial): the anchor, never dropped."""
        return -(-self._get(sid).num_context_tokens // self.block_size)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---------------------------------------------------------------- context allocation

    def _plan_context(self, token_ids: Sequence[int], extra_key, share: bool) -> _ContextPlan:
        n = len(token_ids)
        bs = self.block_size
        num_full = n // bs
        has_tail = n % bs != 0
        if not share:
            return _ContextPlan(n, [None] * num_full, None, [], None, False,
                                num_new_blocks=num_full + int(has_tail))
        full_keys, partial_key = context_block_hashes(token_ids, bs, extra_key)
        hits: list[KVCacheBlock] = []
        for key in full_keys:  # stop at the first miss: compute must be one contiguous range
            block = self.pool.get_cached_block(key)
            if block is None:
                break
            hits.append(block)
        template, make_template, ref_only, deferred = None, False, None, None
        if partial_key is not None:
            existing = self.pool.get_cached_block(partial_key)
            if existing is None:
                make_template = True
            elif len(hits) < num_full:
                # A full block missed (evicted): the session recomputes from there, tail
                # included, but still references the template so accounting is the same for
                # every session of one context.
                ref_only = existing
            elif existing.block_id in self._pending_templates:
                deferred = existing  # filled after this step's forward by its creator
            else:
                template = existing
        num_new = (num_full - len(hits)) + int(has_tail) + int(make_template)
        free_hits = [b for b in hits if b.ref_cnt == 0]
        for t in (template, ref_only, deferred):
            if t is not None and t.ref_cnt == 0:
                free_hits.append(t)
        return _ContextPlan(n, list(full_keys), partial_key, hits, template, make_template,
                            ref_only_template=ref_only, deferred_template=deferred,
                            num_new_blocks=num_new, num_free_hits=len(free_hits))

    def num_blocks_needed(self, token_ids: Sequence[int], extra_key: bytes | Sequence[bytes] = b"",
                          share: bool = True) -> int:
        """Free-list blocks ``allocate_context`` would consume now (cache hits lower it)."""
        return self._plan_context(token_ids, extra_key, share).blocks_needed

    def can_allocate_context(self, token_ids: Sequence[int], extra_key: bytes | Sequence[bytes] = b"",
                             share: bool = True) -> bool:
        """Whether ``allocate_context`` would succeed now, counting cache hits.

        Raises ValueError if the context could never fit, even in an empty pool.
        """
        plan = self._plan_context(token_ids, extra_key, share)
        need = self.blocks_for_tokens(len(token_ids))
        if need > self.pool.num_usable_blocks:
            raise ValueError(
                f"context of {len(token_ids)} tokens needs {need} blocks of {self.block_size}, "
                f"but the pool has only {self.pool.num_usable_blocks} usable blocks"
            )
        return plan.blocks_needed <= self.pool.num_free

    def allocate_context(self, sid: str, token_ids: Sequence[int],
                         extra_key: bytes | Sequence[bytes] = b"", share: bool = True) -> ContextAllocation:
        """Create session ``sid`` with its context; see ContextAllocation for what to do next.

        With ``share=False`` nothing is hashed or looked up: every block is private.
        Raises OutOfBlocks if ``can_allocate_context`` was not checked and blocks run out.
        """
        if sid in self._sessions:
            raise ValueError(f"session {sid!r} already has blocks")
        plan = self._plan_context(token_ids, extra_key, share)
        if plan.blocks_needed > self.pool.num_free:
            raise OutOfBlocks(
                f"allocate_context({sid!r}): needs {plan.blocks_needed} free blocks, "
                f"{self.pool.num_free} free; call can_allocate_context first"
            )
        bs, n = self.block_size, plan.num_tokens
        blocks = self._take_context_blocks(plan)
        sess = _Session(blocks=blocks, num_tokens=n, num_context_tokens=n)
        self._sessions[sid] = sess
        cow_pairs, template_pairs, deferred_pairs = self._attach_template(sess, plan)
        # A tail copied from a template (now or after the forward) is not computed.
        compute_end = (n // bs) * bs if cow_pairs or deferred_pairs else n
        start = len(plan.hits) * bs
        to_compute = tuple(b.block_id for b in blocks[start // bs:-(-compute_end // bs)])
        return ContextAllocation(
            session_id=sid, block_ids=tuple(b.block_id for b in blocks), num_tokens=n,
            num_cached_tokens=start, compute_start=start, compute_end=compute_end,
            blocks_to_compute=to_compute,
            cow_source_block_id=plan.template.block_id if plan.template is not None else None,
            cow_pairs=cow_pairs, template_pairs=template_pairs,
            template_block_id=sess.template.block_id if sess.template is not None else None,
            deferred_cow_pairs=deferred_pairs,
        )

    def _take_context_blocks(self, plan: _ContextPlan) -> list[KVCacheBlock]:
        """Reference the hits, allocate the rest, register new full blocks; returns the table."""
        bs, n = self.block_size, plan.num_tokens
        num_full, num_hits = n // bs, len(plan.hits)
        # Take hits off the free list first, so allocating new blocks cannot evict them.
        self.pool.touch(plan.hits)
        for t in (plan.template, plan.ref_only_template, plan.deferred_template):
            if t is not None:
                self.pool.touch([t])
        fresh = self.pool.get_new_blocks(num_full - num_hits + int(n % bs != 0))
        for i, block in enumerate(fresh[:num_full - num_hits]):
            key = plan.full_keys[num_hits + i]
            # Register so a later session (same step included) hits instead of duplicating.
            # A key past the first miss may still be cached (its parent was evicted); the
            # cached copy stays, this one stays private.
            if key is not None and self.pool.get_cached_block(key) is None:
                self.pool.cache_full_block(block, key)
        self.num_hit_blocks += num_hits
        self.num_miss_blocks += num_full - num_hits
        return list(plan.hits) + fresh

    def _attach_template(self, sess: _Session, plan: _ContextPlan) -> tuple[tuple, tuple, tuple]:
        """Give the session its tail template reference (templates were touched already).

        Returns (cow_pairs, template_pairs, deferred_cow_pairs); at most one is non-empty.
        """
        tail = sess.blocks[-1].block_id if sess.blocks else None
        if plan.template is not None:  # ready: copy it into the private tail before the forward
            sess.template = plan.template
            self.num_cow_copies += 1
            return ((plan.template.block_id, tail),), (), ()
        if plan.deferred_template is not None:  # filled this step: copy after the forward
            sess.template = plan.deferred_template
            self.num_cow_copies += 1
            return (), (), ((plan.deferred_template.block_id, tail),)
        if plan.make_template:  # this session computes the tail; keep a read-only copy
            (template,) = self.pool.get_new_blocks(1)
            assert plan.partial_key is not None
            self.pool.cache_full_block(template, plan.partial_key)
            sess.template, sess.template_pending = template, True
            self._pending_templates.add(template.block_id)
            return (), ((tail, template.block_id),), ()
        sess.template = plan.ref_only_template  # may be None
        return (), (), ()

    def commit_context(self, sid: str) -> None:
        """Mark the context of ``sid`` computed and its template_pairs copied.

        Until then a template the session created is offered to other sessions only as a
        deferred copy (``deferred_cow_pairs``, applied after the step's template_pairs),
        never as a ready ``cow_pairs`` copy that would run before the template is filled.
        """
        sess = self._get(sid)
        if sess.template_pending:
            assert sess.template is not None
            self._pending_templates.discard(sess.template.block_id)
            sess.template_pending = False

    # ---------------------------------------------------------------- decode / units

    def _blocks_to_append(self, sess: _Session, num_new_tokens: int) -> int:
        return self.blocks_for_tokens(sess.num_tokens + num_new_tokens) - len(sess.blocks)

    def can_append(self, sid: str, num_new_tokens: int) -> bool:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        return self._blocks_to_append(self._get(sid), num_new_tokens) <= self.pool.num_free

    def append_slots(self, sid: str, num_new_tokens: int) -> list[int]:
        """Grow ``sid`` by ``num_new_tokens`` token slots; returns the ids of the new blocks.

        New tokens land at logical indices ``num_tokens(sid) .. +num_new_tokens-1`` (read it
        before the call). Appended blocks are private: only context blocks are shared.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        sess = self._get(sid)
        need = self._blocks_to_append(sess, num_new_tokens)
        if need > self.pool.num_free:
            raise OutOfBlocks(
                f"append_slots({sid!r}, {num_new_tokens}): needs {need} blocks, {self.pool.num_free} "
                "free; call can_append first"
            )
        new = self.pool.get_new_blocks(need)
        sess.blocks.extend(new)
        sess.num_tokens += num_new_tokens
        return [b.block_id for b in new]

    # ---------------------------------------------------------------- release

    def _release_template(self, sess: _Session) -> list[KVCacheBlock]:
        if sess.template is None:
            return []
        if sess.template_pending:
            # Never filled: its key must not survive, or a later session would copy garbage.
            self.pool.uncache_block(sess.template)
            self._pending_templates.discard(sess.template.block_id)
        t, sess.template, sess.template_pending = sess.template, None, False
        return [t]

    def free(self, sid: str) -> None:
        """Release all blocks of ``sid``.

        Order: its template reference first, then the table tail first. Blocks reaching
        ref_cnt 0 go to the free list: private ones to the front, cached ones to the back in
        this order, so a context's later blocks are evicted before its first ones.
        """
        sess = self._sessions.pop(sid, None)
        if sess is None:
            raise ValueError(f"unknown session {sid!r}")
        self.pool.free_blocks(self._release_template(sess) + sess.blocks[::-1])

    def abandon_context(self, sid: str, computed_tokens: int) -> None:
        """Free ``sid`` whose context prefill stopped after ``computed_tokens`` tokens (a chunked
        prefill closed or failed midway). Its full context blocks from the first one not fully
        computed lose their hash first: they were registered at ``allocate_context`` and a later
        session must never hit K/V that was never written."""
        sess = self._get(sid)
        bs = self.block_size
        for block in sess.blocks[computed_tokens // bs: sess.num_context_tokens // bs]:
            h = block.block_hash
            if h is not None and self.pool.get_cached_block(h) is block:
                assert block.ref_cnt == 1, f"uncomputed context block {block.block_id} is shared"
                self.pool.uncache_block(block)
        self.free(sid)

    def drop_blocks(self, sid: str, start_block: int, num_blocks: int) -> list[int]:
        """Release table entries ``[start_block, start_block + num_blocks)`` (a window cut).

        The remaining entries keep their order; ``num_tokens`` falls by
        ``num_blocks * block_size``. Only full blocks after the context (anchor) may be
        dropped. Returns the dropped block ids.

            before: [anchor 0..s-1][dropped s..s+k-1][kept s+k..]   (table indices)
            after:  [anchor 0..s-1][kept, now at s..]
        """
        sess = self._get(sid)
        anchor = self.num_context_blocks(sid)
        full = sess.num_tokens // self.block_size
        if num_blocks < 0 or start_block < anchor or start_block + num_blocks > full:
            raise ValueError(
                f"drop_blocks({sid!r}, start={start_block}, n={num_blocks}): must drop whole "
                f"blocks in [{anchor}, {full}) (anchor has {anchor} blocks, {full} blocks are full)"
            )
        dropped = sess.blocks[start_block:start_block + num_blocks]
        del sess.blocks[start_block:start_block + num_blocks]
        sess.num_tokens -= num_blocks * self.block_size
        sess.dropped_tokens += num_blocks * self.block_size
        self.pool.free_blocks(dropped[::-1])
        return [b.block_id for b in dropped]

    def truncate(self, sid: str, num_tokens: int) -> list[int]:
        """Shorten ``sid`` to its first ``num_tokens`` tokens; returns the released ids in table order.

        Every block past the one holding token ``num_tokens - 1`` is released, the partial
        last block included (which ``drop_blocks`` cannot do). ``num_tokens`` must be at least
        the context length, so anchor blocks are never released. Released blocks are private
        (only context blocks are shared): freed tail first, so they go to the front of the
        free list with the old last block handed out first (the ``free`` order).

            block 4, context 6 (anchor = table idx 0..1), 17 tokens, truncate(sid, 8):
            logical  0-3   4-7  | 8-11  12-15  16
            table    [ 0 ][ 1 ] | [ 2 ][ 3 ][ 4: partial ]
                     kept       | released: entries 4, 3, 2 become the free list's first 3
            truncate(sid, 9) would keep table idx 2 (it holds token 8) and release 3 and 4.
        """
        sess = self._get(sid)
        if not sess.num_context_tokens <= num_tokens <= sess.num_tokens:
            raise ValueError(
                f"truncate({sid!r}, {num_tokens}): must keep between the context "
                f"({sess.num_context_tokens} tokens, the anchor) and the session's {sess.num_tokens} tokens"
            )
        keep = self.blocks_for_tokens(num_tokens)
        released = sess.blocks[keep:]
        assert all(b.block_hash is None and b.ref_cnt == 1 for b in released), (
            f"truncate({sid!r}): a block past the anchor is shared: {released}"
        )
        del sess.blocks[keep:]
        sess.num_tokens = num_tokens
        self.num_truncated_blocks += len(released)
        self.pool.free_blocks(released[::-1])
        return [b.block_id for b in released]

    # ---------------------------------------------------------------- accounting

    def session_bytes(self, sid: str) -> SessionBytes:
        """Bytes referenced by ``sid``; a block is shared if hashed or referenced more than once."""
        sess = self._get(sid)
        held = sess.blocks + ([sess.template] if sess.template is not None else [])
        shared = sum(1 for b in held if b.block_hash is not None or b.ref_cnt > 1)
        return SessionBytes(private=(len(held) - shared) * self.bytes_per_block,
                            shared=shared * self.bytes_per_block)

    def pool_stats(self) -> PoolStats:
        p = self.pool
        free = p.num_free
        used = p.num_usable_blocks - free
        # Only hashed blocks are ever referenced by two sessions, so the in-use shared blocks
        # are exactly the hashed ones that are not on the free list.
        shared = len(p.cached_block_hash_to_block) - p.num_cached_free
        return PoolStats(num_blocks=p.num_usable_blocks, used=used, shared=shared,
                         cached_free=p.num_cached_free, free=free, bytes_per_block=self.bytes_per_block)

    def check_invariants(self) -> None:
        """Raise AssertionError if ref counts, tables, free list or hash map disagree."""
        self.pool.check_invariants()
        holders: dict[int, int] = {}
        for sid, sess in self._sessions.items():
            assert len(sess.blocks) == self.blocks_for_tokens(sess.num_tokens), (
                f"session {sid}: {len(sess.blocks)} blocks for {sess.num_tokens} tokens"
            )
            held = sess.blocks + ([sess.template] if sess.template is not None else [])
            assert len({b.block_id for b in held}) == len(held), f"session {sid} holds a block twice"
            for b in held:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for b in self.pool.blocks[1:]:
            assert b.ref_cnt == holders.get(b.block_id, 0), (
                f"block {b.block_id}: ref_cnt {b.ref_cnt}, held by {holders.get(b.block_id, 0)} sessions"
            )
        creators = {s.template.block_id for s in self._sessions.values()
                    if s.template is not None and s.template_pending}
        assert creators == self._pending_templates, (
            f"pending templates {sorted(self._pending_templates)} != uncommitted creators' {sorted(creators)}"
        )
        for bid in self._pending_templates:
            assert self.pool.blocks[bid].block_hash is not None, f"pending template {bid} lost its hash"
        for b in self.pool.blocks[1:]:
            if b.ref_cnt > 1:
                assert b.block_hash is not None, f"block {b.block_id} is shared but not content-addressed"
