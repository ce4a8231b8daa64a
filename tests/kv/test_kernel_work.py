"""How the paged kernel's work is cut (kv/kernel_work.py): sequence splits and row groups."""

from __future__ import annotations

import pytest

from duplexcache.kv.kernel_work import default_num_splits, row_groups_host, tokens_per_program


def test_row_groups_host_cuts_each_sequence_into_runs_of_its_own():
    assert row_groups_host([5, 1, 0, 3], 2) == ([0, 2, 4, 5, 6, 8], [2, 2, 1, 1, 2, 1])
    # a graph bucket: padding rows one group each, then idle programs
    assert row_groups_host([3], 4, programs=6, padding_rows=2) == ([0, 3, 4, 0, 0, 0], [3, 1, 1, 0, 0, 0])
    with pytest.raises(ValueError, match="do not fit"):
        row_groups_host([3, 3], 2, programs=3)
    with pytest.raises(ValueError, match="rows_per_group"):
        row_groups_host([3], 0)
    # tl.dot's 16 rows: the Thinker's 32 q heads on 8 kv heads take 4 tokens, the Talker's MHA 16
    assert (tokens_per_program(32, 8), tokens_per_program(12, 12), tokens_per_program(6, 2)) == (4, 16, 4)
    assert tokens_per_program(32, 1) == 1


def test_default_num_splits():
    # 64 x 8 (seq, head) pairs already fill 132 SMs 3.9 times: one more split reaches 4 waves.
    assert default_num_splits(64, 8, 8000, 132) == 2
    # A single long sequence is cut into many splits, but none shorter than 256 tokens.
    assert default_num_splits(1, 8, 8000, 132) == 32
    assert default_num_splits(1, 8, 300, 132) == 2
    assert default_num_splits(1, 1, 10, 132) == 1
