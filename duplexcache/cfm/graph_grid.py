"""Graph tiers of the whole-Euler arena (`DUPLEXCACHE_CFM_GRAPH_GRID`).

The grid is parsed once, with the deploy config (`duplexcache.config_values.parse_graph_grid`,
which also reads the environment variable), never on the hot path, so a bad value fails the
start-up with a message naming it instead of failing a solve mid-call.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

from duplexcache.config_values import GRAPH_GRID_ENV

logger = logging.getLogger(__name__)


class GraphGridError(ValueError):
    """A graph-grid setting that is malformed or would silently change nothing."""


def arena_rows(max_num_seqs: int, grid: tuple[int, ...], rows_from_graph_grid: bool) -> int:
    """Rows of the static arena.

    Off: `max_num_seqs` (one replay covers every live session). On: the largest tier, and larger
    batches run as several replay groups. On without a grid would change nothing: an error.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if not rows_from_graph_grid:
        return max_num_seqs
    if not grid:
        raise GraphGridError(
            f"cfm_arena_rows_from_graph_grid is on but {GRAPH_GRID_ENV} is not set: "
            "the switch would change nothing; set a grid such as '1,4,8,16' or turn it off")
    largest = max(grid)
    if largest >= max_num_seqs:
        logger.warning(
            "cfm_arena_rows_from_graph_grid saves nothing: largest graph tier %d >= max_num_seqs %d;"
            " the arena keeps %d rows", largest, max_num_seqs, max_num_seqs)
        return max_num_seqs
    return largest


class ReplayGroup(NamedTuple):
    start: int   # first batch row of the group
    rows: int    # real rows in the group
    tier: int    # rows the replay computes (rows <= tier <= arena rows); the rest are padding


def replay_groups(batch_size: int, grid: tuple[int, ...], arena_rows: int) -> list[ReplayGroup]:
    """Cover a batch with replay groups, using the smallest tier that fits each group.

    Full groups take the largest usable tier; the remainder takes the smallest tier >= it.
    Without a grid (eager), a group's tier is its row count.

        batch 21, grid (1, 4, 8, 16), arena 16  ->  (0, 16, 16), (16, 5, 8)
    """
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    tiers = [t for t in grid if t <= arena_rows]
    if grid and not tiers:
        raise GraphGridError(f"no graph tier of {grid} fits an arena of {arena_rows} rows")
    largest = max(tiers) if tiers else arena_rows
    groups = []
    start = 0
    while start < batch_size:
        rows = min(largest, batch_size - start)
        tier = min(t for t in tiers if t >= rows) if tiers else rows
        groups.append(ReplayGroup(start, rows, tier))
        start += rows
    return groups


def replay_tiers(grid: tuple[int, ...], arena_rows: int, max_batch: int) -> tuple[int, ...]:
    """Every tier `replay_groups` can pick for a batch of 1..max_batch rows (what a warm-up
    captures). Without a grid that is every row count up to min(arena rows, max_batch)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    return tuple(sorted({g.tier for n in range(1, max_batch + 1) for g in replay_groups(n, grid, arena_rows)}))
