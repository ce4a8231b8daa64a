"""Stage 0's typed objects at its boundary, and the one worst-case formula.

Split out of ``stage0.py`` (which re-exports every name here): the engine's admission needs
``session_worst_case`` before any runner exists, and callers build ``SessionContextInput`` and
read ``StepResult`` / ``PrefillResult`` without the runner's batching.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from duplexcache.kv.window import WindowConfig


class BlockBudgetTooSmall(ValueError):
    """The KV pool cannot hold even one session at its worst case (context + full window)."""

    code = "kv_budget_too_small"


@dataclass(frozen=True)
class WorstCaseBlocks:
    """Blocks one session references at its longest (``Stage0Runner.worst_case``).

    ``shared_blocks`` (full context blocks + template) exist once per distinct context, not
    once per session; ``private_blocks`` are the session's own.
    """

    table_blocks: int  # ceil(longest / block_size)
    template_blocks: int  # 1: a reference to the context tail's copy-on-write template
    shared_blocks: int  # full context blocks + template; 0 without sharing

    @property
    def total(self) -> int:
        return self.table_blocks + self.template_blocks

    @property
    def private_blocks(self) -> int:
        return self.total - self.shared_blocks


def session_longest_tokens(prefix_len: int, window: WindowConfig, max_positions: int) -> int:
    """The most tokens one session's table can hold: ``prefix + high`` with a window
    (compaction runs before an append would pass it; a session whose ``prefix + high`` exceeds
    the model's positions is refused at open), the model's positions without one."""
    if prefix_len <= 0:
        raise ValueError(f"prefix_len must be > 0, got {prefix_len}")
    return prefix_len + window.high_tokens if window.enabled else max_positions


def session_worst_case(prefix_len: int, window: WindowConfig, max_positions: int, block_size: int,
                       share_context: bool) -> WorstCaseBlocks:
    """Blocks one session references at its longest, split into private and shared.

    The one formula for the runner (``Stage0Runner.worst_case``) and the engine's admission
    (which needs it before any runner exists). Table blocks are ``ceil(longest / block_size)``;
    with sharing, a context that ends mid-block adds one reference to its read-only
    copy-on-write template (a block outside the table). Block 16, context 40, high 96, sharing on::

        longest = 40 + 96 = 136 tokens -> table = ceil(136 / 16) = 9 blocks
        table idx  0      1      | 2      3      ...  8        |
        logical    0-15   16-31  | 32-47  48-63  ...  128-135  |  (outside the table)
                   [full] [full] | [tail] [win]  ...  [win]    |  [template T]
                   shared        | private                     |  shared
        full = 40 // 16 = 2            template = (40 % 16 != 0) = 1
        shared  = full + template = 3  (paid once per distinct context)
        private = table - full    = 7  (the tail is a private copy of T)
        total   = table + template = 10
        sharing off: 9 private table blocks, no template (total 9).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    longest = session_longest_tokens(prefix_len, window, max_positions)
    table = -(-longest // block_size)
    if not share_context:
        return WorstCaseBlocks(table_blocks=table, template_blocks=0, shared_blocks=0)
    full = prefix_len // block_size
    template = int(prefix_len % block_size != 0)
    return WorstCaseBlocks(table_blocks=table, template_blocks=template, shared_blocks=full + template)


@dataclass(frozen=True)
class SessionContextInput:
    """The anchor of one session: its whole context, already embedded.

    ``inputs_embeds`` (T, H): token embeddings with the reference-audio embeddings spliced
    in. ``token_ids`` (T): audio positions carry a filler id, which is why ``extra_key``
    (sha256 of the reference audio + model revision) must name the embeddings: two sessions
    share context blocks only if token ids AND extra key are equal.
    """

    inputs_embeds: torch.Tensor
    token_ids: Sequence[int]
    extra_key: bytes = b""

    def __post_init__(self) -> None:
        if self.inputs_embeds.dim() != 2:
            raise ValueError(f"context inputs_embeds must be (T, H), got {tuple(self.inputs_embeds.shape)}")
        ids = self.token_ids.tolist() if isinstance(self.token_ids, torch.Tensor) else list(self.token_ids)
        object.__setattr__(self, "token_ids", tuple(int(t) for t in ids))
        if len(self.token_ids) != self.inputs_embeds.shape[0] or not self.token_ids:
            raise ValueError(
                f"context has {len(self.token_ids)} token ids and {self.inputs_embeds.shape[0]} "
                "embeddings; they must be equal and non-zero"
            )
        if not isinstance(self.extra_key, (bytes, bytearray)):
            raise ValueError(f"context extra_key must be bytes, got {type(self.extra_key).__name__}")

    @property
    def prefix_len(self) -> int:
        """Anchor length: every context token is protected from the window."""
        return len(self.token_ids)


@dataclass
class StepResult(Mapping):
    """Per-session outcome of one call: logits (V,) for sessions that ran, errors for those
    that ended. Reads like a mapping of logits; ``result[sid]`` re-raises a session's error.

    ``hidden[sid]`` (H,) is the final-norm hidden state of the session's last new token: the
    row ``lm_head`` turned into ``logits[sid]`` (same keys as ``logits``). Only that row is
    kept; the other rows of the forward are not returned.
    """

    logits: dict[str, torch.Tensor] = field(default_factory=dict)
    errors: dict[str, Exception] = field(default_factory=dict)
    hidden: dict[str, torch.Tensor] = field(default_factory=dict)

    def __getitem__(self, sid: str) -> torch.Tensor:
        if sid in self.errors:
            raise self.errors[sid]
        return self.logits[sid]

    def __iter__(self) -> Iterator[str]:
        return iter(self.logits)

    def __len__(self) -> int:
        return len(self.logits)


@dataclass
class PrefillResult:
    """What one ``Stage0Runner.prefill`` call did."""

    opened: list[str] = field(default_factory=list)
    errors: dict[str, Exception] = field(default_factory=dict)
    computed_tokens: int = 0
