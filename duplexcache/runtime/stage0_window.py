"""Stage 0 window bookkeeping and byte accounting, kept apart from the runner's batching.

What lives here:

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

from dataclasses import dataclass, field

import torch

from duplexcache.kv.kv_cache_manager import SessionBytes


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
    dtype_bytes: int = 2,
    block_size: int = 16,
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
    if context_tokens <= 0 or window_tokens < 0 or block_size <= 0 or dtype_bytes <= 0:
        raise ValueError(
            f"need context_tokens > 0, window_tokens >= 0, block_size > 0, dtype_bytes > 0; got "
            f"{context_tokens}, {window_tokens}, {block_size}, {dtype_bytes}"
        )
    per_block = (2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
                 * dtype_bytes * block_size)
    table_blocks = -(-(context_tokens + window_tokens) // block_size)
    if not share:
        return SessionBytes(private=table_blocks * per_block, shared=0)
    full = context_tokens // block_size
    template = int(context_tokens % block_size != 0)
    return SessionBytes(private=(table_blocks - full) * per_block, shared=(full + template) * per_block)
