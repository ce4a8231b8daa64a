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


def test_batched_matmul_sdpa_and_ffts_are_tiled_correct_and_batch_invariant():
    """The families beyond linear/conv (the conformer's attention matmuls, the Code2Wav DiT's
    SDPA, the vocoder's FFTs): each routed through the mode (calls counted), equal to the plain
    op within float32 rounding, and element 0's bits the same in a batch of 1 and of 9."""
    g = torch.Generator().manual_seed(11)
    a, b = torch.randn(9, 4, 12, 16, generator=g), torch.randn(9, 4, 16, 20, generator=g)
    pos = torch.randn(1, 4, 16, 23, generator=g)   # the conformer's relative positions: batch 1, broadcast
    w = torch.randn(16, 24, generator=g)
    q, k, v = (torch.randn(9, 4, 10, 16, generator=g) for _ in range(3))
    mask = torch.rand(9, 1, 1, 10, generator=g) > 0.3
    mask[..., 0] = True
    sig = torch.randn(9, 400, generator=g)
    rows = torch.randn(9, 7, 24, generator=g)   # RMSNorm's mean over a last axis of 24 (not a power of two)
    spec = torch.randn(9, 30, 9, dtype=torch.complex64, generator=g)
    ops = {
        "matmul": lambda n: torch.matmul(a[:n], b[:n]),
        "matmul_operator": lambda n: a[:n] @ b[:n],
        "matmul_broadcast": lambda n: torch.matmul(a[:n], pos),
        "bmm": lambda n: torch.bmm(a[:n].flatten(0, 1), b[:n].flatten(0, 1)),
        "matmul_2d": lambda n: a[:n] @ w,
        "sdpa": lambda n: F.scaled_dot_product_attention(q[:n], k[:n], v[:n], attn_mask=mask[:n]),
        "mean_last": lambda n: rows[:n].pow(2).mean(-1, keepdim=True),
        "torch_mean_last": lambda n: torch.mean(rows[:n], dim=-1),
        "irfft": lambda n: torch.fft.irfft(spec[:n], n=16, dim=-1),
        "rfft": lambda n: torch.fft.rfft(sig[:n], dim=-1),
        "stft": lambda n: torch.stft(sig[:n], 16, 4, window=torch.hann_window(16), return_complex=True),
    }
    for name, op in ops.items():
        mode = BatchInvariantMode(tile_rows=4)
        with mode:
            one, nine = op(1), op(9)
        assert mode.calls == 2, name
        torch.testing.assert_close(nine, op(9), msg=name)
        assert torch.equal(one[0], nine[0]), name


def test_op_families_can_be_chosen_and_unknown_ones_are_refused():
    mode = BatchInvariantMode(tile_rows=4, ops=frozenset({"linear"}))
    with mode:
        torch.matmul(torch.randn(2, 3, 4), torch.randn(2, 4, 5))
    assert mode.calls == 0
    with pytest.raises(ValueError, match="unknown op families"):
        BatchInvariantMode(4, ops=frozenset({"gemm"}))


def test_mean_over_the_last_axis_keeps_other_means_and_dtypes_as_they_were():
    """Only a plain mean over the last axis is rerouted: other axes, whole-tensor means and a
    dtype argument go to torch as written; bfloat16 is summed in float32 like torch.mean."""
    from duplexcache.models.batch_invariant import invariant_mean_last
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 6, 33, generator=g)
    mode = BatchInvariantMode(tile_rows=4, ops=frozenset({"mean"}))
    with mode:
        middle, whole, typed = x.mean(1), x.mean(), x.mean(-1, dtype=torch.float64)
    assert mode.calls == 0
    assert torch.equal(middle, x.mean(1)) and torch.equal(whole, x.mean()) and torch.equal(typed, x.mean(-1, dtype=torch.float64))
    xb = x.to(torch.bfloat16)
    got = invariant_mean_last(xb, keepdim=True)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 6, 1)
    torch.testing.assert_close(got.float(), xb.float().mean(-1, keepdim=True), atol=1e-2, rtol=1e-2)
    assert torch.equal(invariant_mean_last(x[:1]), invariant_mean_last(x)[:1])
