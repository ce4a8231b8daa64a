"""How the paged attention kernel's work is cut (host side, no Triton needed): the sequence splits
of one program row (``default_num_splits``) and, in a ragged step, which token rows one program
takes together (``tokens_per_program``, ``row_groups_host``). The engine, its CUDA graphs' static
buffers, the warm-up and the benchmarks all cut the work here, so they cut it the same way."""

from __future__ import annotations

from collections.abc import Sequence

import torch

_SM_COUNT: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: the split count only matters for coverage in tests
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def default_num_splits(batch: int, num_kv_heads: int, max_tokens: int, num_sms: int,
                       min_tokens_per_split: int = 256, waves: int = 4) -> int:
    """Splits per (sequence, kv head) so the grid fills ``waves`` x SMs, but no split is
    shorter than ``min_tokens_per_split`` (short splits pay more in merge than they gain)."""
    want = -(-waves * num_sms // max(1, batch * num_kv_heads))
    cap = max(1, -(-max_tokens // min_tokens_per_split))
    return max(1, min(want, cap))


def tokens_per_program(num_q_heads: int, num_kv_heads: int) -> int:
    """How many tokens of one sequence a program of the paged kernel takes in a ragged step
    (``row_groups``): as many as fill tl.dot's 16-row minimum with their GQA group's q heads
    (Thinker 32/8: 4 tokens; Talker 12/12: 16), so the q tile of a one-token decode step, whose
    spare rows were padding, stays the same size."""
    group = num_q_heads // num_kv_heads
    return max(1, 16 // (1 << max(0, group - 1).bit_length()))


def row_groups_host(num_new: Sequence[int], rows_per_group: int, programs: int | None = None,
                    padding_rows: int = 0) -> tuple[list[int], list[int]]:
    """``(first_row, row_count)`` of a ragged step whose sequence ``b`` adds ``num_new[b]`` token
    rows (flattened in order): each sequence's rows cut into runs of ``rows_per_group`` from its
    first token, so a row's group depends on its own sequence only. ``padding_rows`` rows after
    the real ones (a graph bucket's) get a group each; ``programs`` pads the lists with idle
    programs (count 0) to a fixed length."""
    if rows_per_group < 1:
        raise ValueError(f"rows_per_group must be >= 1, got {rows_per_group}")
    first: list[int] = []
    count: list[int] = []
    at = 0
    for n in num_new:
        for off in range(0, n, rows_per_group):
            first.append(at + off)
            count.append(min(rows_per_group, n - off))
        at += n
    first += range(at, at + padding_rows)
    count += [1] * padding_rows
    if programs is not None:
        if len(first) > programs:
            raise ValueError(f"{len(first)} row groups do not fit {programs} programs")
        first += [0] * (programs - len(first))
        count += [0] * (programs - len(count))
    return first, count
