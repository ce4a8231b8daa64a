"""Anchor-protected sliding window over a session's paged KV: when to cut, and where.

``plan_compaction`` only computes the plan; the runtime applies it with
``KVCacheManager.drop_blocks`` and, in mode ``basic``, ``rope.rerotate_keys_`` on the kept
blocks (in mode ``rebuild`` it re-prefills the kept tokens instead, for A/B checks).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

WindowMode = Literal["off", "basic", "rebuild"]
_MODES = ("off", "basic", "rebuild")


class ContextLengthExceeded(ValueError):
    """No compaction can make the session fit; the runtime ends it with this error code."""

    code = "context_length_exceeded"


@dataclass(frozen=True)
class WindowConfig:
    """Window switch and marks, in tokens counted on top of the anchor prefix.

    Compaction starts once a session would pass ``prefix + high_tokens`` and brings it back
    to ``prefix + low_tokens`` or just under.
    """

    mode: WindowMode = "off"
    high_tokens: int = 8000
    low_tokens: int = 6000

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"window mode must be one of {_MODES}, got {self.mode!r}")
        if not isinstance(self.high_tokens, int) or not isinstance(self.low_tokens, int):
            raise ValueError(
                f"window marks must be ints, got high={self.high_tokens!r} low={self.low_tokens!r}"
            )
        if self.low_tokens < 0:
            raise ValueError(f"window low_tokens must be >= 0, got {self.low_tokens}")
        if self.low_tokens >= self.high_tokens:
            raise ValueError(
                f"window low_tokens ({self.low_tokens}) must be < high_tokens ({self.high_tokens})"
            )

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


@dataclass(frozen=True)
class WindowPlan:
    """One compaction. Block indices are positions in the session's block table *before*
    the drop; ``kept_block_range`` are the table entries whose keys must be re-rotated by
    ``-delta_tokens`` (after the drop they sit at ``kept_block_range_after``)."""

    sink_blocks: int
    first_dropped_block: int
    num_dropped_blocks: int
    delta_tokens: int
    kept_block_range: range
    new_num_tokens: int  # session length after the drop, before the incoming tokens
    # True: the kept region starts at a unit start; False: no unit start at or after the
    # needed cut, so the block-aligned cut was used (the kept region starts mid-unit);
    # None: unit starts were not given.
    unit_aligned: bool | None = None
    # False when the incoming tokens are so many that even dropping every droppable block
    # leaves the session above prefix + low (but within prefix + high).
    reached_low: bool = True

    @property
    def kept_block_range_after(self) -> range:
        d = self.num_dropped_blocks
        return range(self.kept_block_range.start - d, self.kept_block_range.stop - d)


def plan_compaction(
    prefix_len: int,
    num_tokens: int,
    num_incoming: int,
    cfg: WindowConfig,
    block_size: int = 16,
    unit_starts: Iterable[int] | None = None,
) -> WindowPlan | None:
    """Plan the window cut needed before appending ``num_incoming`` tokens, or None.

    None when the window is off or ``num_tokens + num_incoming <= prefix_len + high``.
    Otherwise whole blocks right after the anchor are released so the new total
    (kept + incoming) is ``<= prefix_len + low``, as close to it as a block boundary allows::

        block size 4, prefix 6 -> sink_blocks = ceil(6/4) = 2 (anchor: tokens 0..7)
        table idx   0    1    2    3    4    5    6    7
                  [PPPP|PPuu|uuuu|uuuu|uuuu|uuuu|uuuu|uu  ]   P prefix, u later tokens
                  |anchor   |dropped  |kept ...........   |
                             ^first_dropped_block = 2
                                        ^cut = 4: smallest block boundary whose drop
                                         brings total <= prefix + low
        after:    [PPPP|PPuu|uuuu|uuuu|uuuu|uu  ]  kept keys re-rotated by -delta (= 2*4)

    Anchor blocks are never released, including the tokens after the prefix that share the
    anchor's last block. Only full blocks are released; the session's partial last block is
    always kept.

    Unit alignment: when ``unit_starts`` (token indices, before the cut, where units begin)
    are given, the cut moves forward to the first block boundary that is also a unit start,
    so the kept window starts with a whole unit (dropping a little more than needed). If no
    block boundary between the needed cut and the last droppable boundary is a unit start,
    the plan falls back to the block-aligned cut and says so (``unit_aligned=False``): a
    partial unit at the window start is harmless to attention and better than an overflow.

    Raises ContextLengthExceeded when even dropping every droppable block cannot bring the
    total to ``prefix_len + high`` or below (too many incoming tokens, or an anchor so long
    that the window has no room).
    """
    if not cfg.enabled:
        return None
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if prefix_len < 0 or num_incoming < 0 or num_tokens < prefix_len:
        raise ValueError(
            f"need 0 <= prefix_len <= num_tokens and num_incoming >= 0; got prefix_len={prefix_len}, "
            f"num_tokens={num_tokens}, num_incoming={num_incoming}"
        )
    total = num_tokens + num_incoming
    if total <= prefix_len + cfg.high_tokens:
        return None
    sink = -(-prefix_len // block_size)
    last_cut = max(sink, num_tokens // block_size)  # first kept block if we drop all droppable
    min_total = total - (last_cut - sink) * block_size
    if min_total > prefix_len + cfg.high_tokens:
        raise ContextLengthExceeded(
            f"context_length_exceeded: prefix {prefix_len} + {num_tokens - prefix_len} kept + "
            f"{num_incoming} incoming tokens; dropping all {last_cut - sink} droppable blocks of "
            f"{block_size} leaves {min_total} > prefix + high = {prefix_len + cfg.high_tokens}"
        )
    excess = total - (prefix_len + cfg.low_tokens)
    need_cut = sink + -(-excess // block_size)
    reached_low = need_cut <= last_cut
    cut, unit_aligned = _align_cut(min(need_cut, last_cut), last_cut, block_size, unit_starts)
    num_dropped = cut - sink
    return WindowPlan(
        sink_blocks=sink,
        first_dropped_block=sink,
        num_dropped_blocks=num_dropped,
        delta_tokens=num_dropped * block_size,
        kept_block_range=range(cut, -(-num_tokens // block_size)),
        new_num_tokens=num_tokens - num_dropped * block_size,
        unit_aligned=unit_aligned,
        reached_low=reached_low,
    )


def _align_cut(cut: int, last_cut: int, block_size: int,
               unit_starts: Iterable[int] | None) -> tuple[int, bool | None]:
    """First block boundary in ``[cut, last_cut]`` that is a unit start, else ``cut`` (fallback)."""
    if unit_starts is None:
        return cut, None
    starts = set(unit_starts)
    for c in range(cut, last_cut + 1):
        if c * block_size in starts:
            return c, True
    logger.debug("no unit start on a block boundary in blocks [%d, %d]; cutting at %d", cut, last_cut, cut)
    return cut, False
