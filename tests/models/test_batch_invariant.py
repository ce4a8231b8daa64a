"""models/batch_invariant.py: a row's output does not depend on the rows beside it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from duplexcache.models.batch_invariant import BatchInvariantMode, invariant_linear


def _differs_somewhere(fn, make, batches=(1, 2, 3, 5, 8, 17)) -> bool:
    full = fn(make(32))
    return any(not torch.equal(fn(make(32)[:m])[0], full[0]) for m in batches)


@pytest.mark.parametrize("k,n", [(32, 1), (64, 64), (256, 256), (512, 1024)])
def test_linear_row_is_the_same_in_every_batch_and_position(k, n):
    g = torch.Generator().manual_seed(k + n)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    row = torch.randn(k, generator=g)
    alone = invariant_linear(row[None], w, b)[0]
    for m in (2, 7, 16, 17, 40):
        for pos in (0, m // 2, m - 1):
            x = torch.randn(m, k, generator=g)
            x[pos] = row
            assert torch.equal(invariant_linear(x, w, b)[pos], alone), (m, pos)


def test_linear_of_a_transposed_batch_of_one_equals_the_batched_row():
    """A (1, t, C) transpose reshapes to a strided view where a larger batch copies: the GEMM
    over the view took another kernel (the vocoder's f0 classifier differed by one bit)."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(1, 32, generator=g), torch.randn(1, generator=g)
    x8 = torch.randn(8, 32, 33, generator=g)
    one = invariant_linear(x8[:1].transpose(1, 2), w, b)
    eight = invariant_linear(x8.transpose(1, 2), w, b)
    assert torch.equal(one[0], eight[0])


def test_mode_tiles_linear_and_conv_and_leaves_other_ops_alone():
    g = torch.Generator().manual_seed(5)
    lin = torch.nn.Linear(64, 64)
    conv = torch.nn.Conv1d(16, 16, 3, padding=1)
    x, y = torch.randn(3, 64, generator=g), torch.randn(5, 16, 20, generator=g)
    mode = BatchInvariantMode(tile_rows=16)
    with mode, torch.no_grad():
        got_lin, got_conv, soft = lin(x), conv(y), x.softmax(-1)
    assert mode.calls == 2
    with torch.no_grad():
        torch.testing.assert_close(got_lin, lin(x))
        torch.testing.assert_close(got_conv, conv(y))
    assert torch.equal(soft, x.softmax(-1))


def test_conv1d_in_the_mode_gives_a_batch_of_one_the_batched_bits():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 64, 3, generator=g)
    x = torch.randn(9, 64, 60, generator=g)
    with BatchInvariantMode(tile_rows=4):
        one = F.conv1d(x[:1], w, padding=1)
        nine = F.conv1d(x, w, padding=1)
    assert torch.equal(one[0], nine[0])


def test_tile_rows_must_be_positive():
    with pytest.raises(ValueError, match="tile_rows"):
        BatchInvariantMode(0)
