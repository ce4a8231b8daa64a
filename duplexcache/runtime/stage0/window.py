"""Stage 0 window bookkeeping and byte accounting, kept apart from the runner's batching.

What lives here:

* ``Stage0Session``: one session's window state (its marks, unit starts, history, compactions).
* ``compact_basic`` / ``compact_rebuild``: one compaction, as ``Stage0Runner`` applies it
  before an append; ``drop_last_tokens`` / ``droppable_tail``: a cancelled reply's cut.
* ``SessionHistory``: the per-session token history the ``rebuild`` reference mode
  re-prefills from (inputs_embeds after the anchor prefix, plus unit starts).
* ``stage0_session_bytes``: pure-shape accounting of one session's KV bytes, used by
  ``duplexcache/bench/stage0_bytes.py`` and docs/stage0.md (no weights, no tensors).

Index arithmetic of one compaction (block size 4, prefix 6, see ``kv.window``)::

    logical idx  0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15 | 16 17
    table idx    0       | 1       | 2         | 3           | 4
                 [P P P P|P P u u  |u u u  u  |u  u  u  u   |u  u ]
                 |anchor (sink=2)  |dropped   |kept (re-rotated by -delta=4)
    history idx              0 1   | 2 3 4 5  | 6 ...          (logical idx - prefix)

    after:       [P P P P|P P u u  |u  u  u  u   |u  u ]   logical idx of old 12 is now 8

The history drops entries ``[sink*bs - prefix, sink*bs - prefix + delta)``: the same
tokens the manager dropped, so ``history[i]`` stays the token at logical index ``prefix + i``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from duplexcache.kv.kv_cache_manager import KVCacheManager, SessionBytes
from duplexcache.kv.paged_attention import PagedKVCache, bytes_per_block
from duplexcache.kv.rope import rerotate_keys_
from duplexcache.kv.window import WindowConfig, WindowPlan

logger = logging.getLogger(__name__)


@dataclass
class SessionHistory:
    """Inputs of one session after its prefix, for the ``rebuild`` window mode only.

    ``rebuild`` is the A/B reference for ``basic``: it costs a re-prefill of the whole kept
    window on every compaction and holds every kept input embedding in memory, so it is
    not meant for production.
    """

    prefix_len: int
    chunks: list[torch.Tensor] = field(default_factory=list)
    num_tokens: int = 0

    def append(self, embeds: torch.Tensor) -> None:
        self.chunks.append(embeds.detach())
        self.num_tokens += embeds.shape[0]

    def tensor(self) -> torch.Tensor:
        """(num_tokens, H) history, concatenated once and kept as a single chunk."""
        if len(self.chunks) != 1:
            self.chunks = [torch.cat(self.chunks, dim=0)]
        return self.chunks[0]

    def drop(self, first_logical: int, num: int) -> None:
        """Forget the tokens at logical indices ``[first_logical, first_logical + num)``."""
        start = first_logical - self.prefix_len
        if start < 0 or start + num > self.num_tokens:
            raise AssertionError(
                f"history drop [{first_logical}, {first_logical + num}) outside "
                f"[{self.prefix_len}, {self.prefix_len + self.num_tokens})"
            )
        h = self.tensor()
        self.chunks = [torch.cat((h[:start], h[start + num:]), dim=0)]
        self.num_tokens -= num

    def keep_before(self, logical: int) -> None:
        """Forget the tokens at logical indices ``logical`` and later (a tail truncation)."""
        start = logical - self.prefix_len
        if not 0 <= start <= self.num_tokens:
            raise AssertionError(f"history cut at {logical} outside [{self.prefix_len}, "
                                 f"{self.prefix_len + self.num_tokens}]")
        self.chunks = [self.tensor()[:start]]
        self.num_tokens = start

    def since(self, logical: int) -> torch.Tensor:
        """History from logical index ``logical`` on, (n, H)."""
        start = logical - self.prefix_len
        assert 0 <= start <= self.num_tokens, f"logical {logical} outside the history"
        return self.tensor()[start:]


def shift_unit_starts(unit_starts: list[int], first_dropped: int, delta: int) -> list[int]:
    """Unit starts after dropping ``[first_dropped, first_dropped + delta)``: drop those inside,
    shift those after by ``-delta``."""
    out = []
    for s in unit_starts:
        if s < first_dropped:
            out.append(s)
        elif s >= first_dropped + delta:
            out.append(s - delta)
    return out


def stage0_session_bytes(
    config,
    context_tokens: int,
    window_tokens: int,
    share: bool,
    dtype: torch.dtype = torch.bfloat16,
    block_size: int = 16,
    storage_dtype: torch.dtype | None = None,
) -> SessionBytes:
    """KV bytes one Stage 0 session references, from shapes alone.

    ``config``: anything with ``num_hidden_layers``, ``num_key_value_heads``, ``head_dim``
    (e.g. ``ThinkerConfig.minicpmo45()``). ``window_tokens``: tokens held after the context
    (0 at session start; ``high_tokens`` at a full window, the most a session holds since
    compaction runs before an append would pass ``prefix + high``).

    Mirrors ``KVCacheManager.session_bytes``: with sharing, the context's full blocks are
    shared and so is the copy-on-write template the session holds when the context ends
    mid-block; every block from the partial context block on is private::

        share=True,  context 40, window 30, block 16:
            [ctx 0-15][ctx 16-31][ctx 32-39 + win 0-7][win 8-23][win 24-29]  + template
             shared    shared     private              private   private      shared
        share=False: all 5 table blocks private, no template.
    """
    if context_tokens <= 0 or window_tokens < 0 or block_size <= 0:
        raise ValueError(
            f"need context_tokens > 0, window_tokens >= 0, block_size > 0; got "
            f"{context_tokens}, {window_tokens}, {block_size}"
        )
    # the pool's own formula (fp8 in precision.kv_cache_dtype: values plus their float32 scales)
    per_block = bytes_per_block(config.num_hidden_layers, block_size, config.num_key_value_heads,
                                config.head_dim, dtype, storage_dtype)
    table_blocks = -(-(context_tokens + window_tokens) // block_size)
    if not share:
        return SessionBytes(private=table_blocks * per_block, shared=0)
    full = context_tokens // block_size
    template = int(context_tokens % block_size != 0)
    return SessionBytes(private=(table_blocks - full) * per_block, shared=(full + template) * per_block)


# ------------------------------------------------------------------ per-session window state


@dataclass
class Stage0Session:
    """Window state of one Stage 0 session; the manager owns its blocks, this owns the rest."""

    sid: str
    prefix_len: int
    window: WindowConfig  # this session's marks (the runner's mode)
    unit_starts: list[int] = field(default_factory=list)  # logical indices where units begin
    history: SessionHistory | None = None  # rebuild mode only
    num_compactions: int = 0


# ------------------------------------------------------------------ compaction (``Stage0Runner`` calls these)


def compact_basic(manager: KVCacheManager, cache: PagedKVCache, sess: Stage0Session, plan: WindowPlan,
                  rope_theta: float) -> None:
    """Drop the planned blocks and re-rotate the kept non-anchor keys by -delta, in place
    (an fp8 cache's keys are re-quantized with fresh scales: ``k_scale`` goes along).

    ``kept_block_range_after`` starts at ``sink_blocks``: the anchor is never in it.
    """
    manager.drop_blocks(sess.sid, plan.first_dropped_block, plan.num_dropped_blocks)
    table = manager.block_table(sess.sid)
    kept = [table[i] for i in plan.kept_block_range_after]
    assert plan.kept_block_range_after.start >= plan.sink_blocks, "window would rotate an anchor block"
    rerotate_keys_(cache.k, kept, plan.delta_tokens, rope_theta, k_scale=cache.k_scale)
    after_drop(sess, plan, manager.block_size)


def compact_rebuild(manager: KVCacheManager, sess: Stage0Session, plan: WindowPlan,
                    embeds: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Reference mode: forget the planned tokens, release the whole kept window, and
    return the kept tokens + ``embeds`` to prefill from scratch after the anchor.

        sink 3, block 16: [anchor 0..47][dropped][kept ... partial]
        truncate(sid, 48) -> [anchor 0..47]          (every later block released)
        re-prefill        -> [anchor 0..47][kept + new, fresh blocks from 48]
    """
    assert sess.history is not None
    after_drop(sess, plan, manager.block_size)
    start = plan.sink_blocks * manager.block_size  # first logical index after the anchor blocks
    manager.truncate(sess.sid, start)
    kept = sess.history.since(start)
    assert start + kept.shape[0] == plan.new_num_tokens, "history and plan disagree on the kept length"
    return torch.cat((kept.to(embeds.dtype), embeds), dim=0), start


def after_drop(sess: Stage0Session, plan: WindowPlan, block_size: int) -> None:
    first = plan.first_dropped_block * block_size
    sess.unit_starts = shift_unit_starts(sess.unit_starts, first, plan.delta_tokens)
    if sess.history is not None:
        sess.history.drop(first, plan.delta_tokens)
    sess.num_compactions += 1
    logger.debug("session %s: window dropped %d blocks (delta %d), %d tokens left", sess.sid,
                 plan.num_dropped_blocks, plan.delta_tokens, plan.new_num_tokens)


# ------------------------------------------------------------------ truncation (a cancelled reply)


def drop_last_tokens(manager: KVCacheManager, sess: Stage0Session, num_tokens: int) -> list[int]:
    """Forget the last ``num_tokens`` tokens of ``sess`` (a cancelled reply's unplayed text).

    The manager's ``truncate`` releases every block past the new last token (tail first, so
    they head the free list) and resets the session's length; the next append writes from
    there. The kept partial last block keeps stale K/V past the new length: attention reads
    only ``< length`` and the next append overwrites those slots before anything reads them.
    The anchor is never cut (ValueError), so every block that may be written afterwards is
    private: shared blocks are all anchor blocks, and an anchor that ends on a block
    boundary makes the next append take a fresh block. Window bookkeeping follows: unit
    starts at or past the cut are forgotten; in ``rebuild`` mode the input history too::

        block 16, anchor 40, 75 tokens, drop_last_tokens(sid, 20) -> 55 tokens kept:
        table idx   0       1        2                 3             4
        logical     0..15   16..31   32..39 | 40..47   48..54 55..63 64..74
                    anchor  anchor   anchor | window   kept   stale  released
        block 3 keeps 48..54; its slots 55..63 are written by the next append.

    Returns the released block ids (table order)."""
    sid = sess.sid
    have = manager.num_tokens(sid)
    if not 0 <= num_tokens <= have - sess.prefix_len:
        raise ValueError(
            f"session {sid!r}: cannot drop {num_tokens} of its {have} tokens: only the "
            f"{have - sess.prefix_len} tokens after the {sess.prefix_len}-token anchor may be dropped"
        )
    keep = have - num_tokens
    released = manager.truncate(sid, keep)
    if keep % manager.block_size:
        tail = manager.pool.blocks[manager.block_table(sid)[-1]]
        assert tail.block_hash is None and tail.ref_cnt == 1, f"session {sid}: next write would hit a shared block"
    sess.unit_starts = [s for s in sess.unit_starts if s < keep]
    if sess.history is not None:
        sess.history.keep_before(keep)
    logger.debug("session %s: dropped its last %d tokens (%d blocks released), %d left", sid, num_tokens,
                 len(released), keep)
    return released


def droppable_tail(manager: KVCacheManager, sess: Stage0Session) -> int:
    """How many of ``sess``'s last tokens are contiguous since they were appended (what
    ``drop_last_tokens`` may take back as one span): every token after the anchor until the
    window first compacts; after that, the tokens from the first block past the anchor on,
    since the kept window starts there and tokens before it in the anchor's last block are
    older than the window's cut."""
    have = manager.num_tokens(sess.sid)
    if sess.num_compactions == 0:
        return have - sess.prefix_len
    return max(0, have - manager.num_context_blocks(sess.sid) * manager.block_size)
