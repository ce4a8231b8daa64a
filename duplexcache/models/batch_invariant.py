"""Batch-invariant numerics: a session's bits do not depend on which sessions share its batch.

A batched kernel is free to pick its algorithm from the shapes it is given: a GEMM of 3 rows and
one of 40 rows may block the reduction over K differently (MKL on CPU: ``linear`` of 1-8 rows
and of 32 rows differ in the last bit; cuBLAS picks split-K and tile sizes by M), and a conv of
batch 1 takes another path than a conv of batch 2. A session that shares its tick with 7 others
then gets other bits than alone, which random weights (and long calls on real ones) turn into
other tokens. The fix is a fixed reduction order per row, whatever the batch:

* ``linear`` (every ``nn.Linear``): the rows are cut into tiles of exactly ``tile_rows`` rows
  (the last one padded with zeros) and each tile is its own GEMM of one fixed shape. Within one
  shape a row's output depends only on that row (checked over positions and neighbours in
  tests/models/test_batch_invariant.py); the padding rows are dropped.
* ``conv1d`` / ``conv_transpose1d``: the same over the batch axis (tiles of ``batch_tile``
  samples); so are SDPA (cuDNN/CUTLASS may pick kernels by batch) and the FFTs (cuFFT plans are
  made per batch count), and a batched ``matmul`` goes in tiles of ``tile_rows`` matrices
  (cuBLAS picks batched-GEMM algorithms by the batch count).
* Code2Wav's attention reduces over the arena's whole key capacity in this mode
  (``Code2WavConfig.fixed_key_length``): the key length otherwise followed the longest cache of
  the rows solved together.
* ``mean`` over the last axis (RMSNorm's ``x.pow(2).mean(-1)``): on CUDA PyTorch's generic
  reduction picks how it splits a row by the number of rows, so it is summed instead by a pairwise
  tree of elementwise adds whose order is fixed by the axis length alone (zero-padded to a power
  of two; adding 0.0 is exact).
* The rest of the tick is already row-wise on every backend this project runs: per-sequence
  attention (``paged_attention``'s reference path), LayerNorm and softmax (one block per row),
  argmax, max and elementwise ops (measured on CPU: equal at every batch size; on the H100 the
  Code2Wav conformer and estimator, LayerNorm-only, were equal beside 7 and 31 streams). On CUDA the paged decode kernel's
  split count is fixed per pool instead of chosen by the batch (``kv/triton_kernels.py``).

This is the published recipe for batch-invariant inference (fixed tiling and reduction order in
matmul, attention and norms), done here by dispatch rather than new GEMM kernels: a tile is an
ordinary library GEMM. Its price is the padding of the last tile and one launch per tile
(docs/benchmarks.md, "Batch invariance"). ``engine.batch_invariant`` turns it on; the engine
enters :class:`BatchInvariantMode` around every model call of a tick, prefill, warm-up and
fast-forward, so CUDA graphs captured at warm-up replay the tiled kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# Rows per GEMM tile. CPU: MKL's last-bit differences sit below 16 rows (tiles of 8, 16 and 32 are
# each invariant). CUDA: 64 rows keep cuBLAS on tensor-core tiles while a decode step of a few
# sessions wastes at most one tile of padding.
CPU_TILE_ROWS = 16
CUDA_TILE_ROWS = 64
# Batch elements per tile of the per-sample ops (conv, SDPA, FFT): their batch is a tick's streams
# or rows (1-32), not tokens, so a tile of 64 would compute up to 64x the work for one stream.
# Any fixed tile is invariant; 4 keeps the padding of a lone stream at 3 copies.
BATCH_TILE = 4


def tile_rows_for(device: torch.device) -> int:
    return CUDA_TILE_ROWS if device.type == "cuda" else CPU_TILE_ROWS


def _tiled(fn, x: torch.Tensor, tile: int) -> torch.Tensor:
    """``fn`` over ``x``'s first axis in tiles of exactly ``tile`` (zero-padded): ``fn`` maps a
    (tile, ...) tensor to a (tile, ...) tensor."""
    n = x.shape[0]
    if n == 0:
        return fn(x)
    outs = []
    for start in range(0, n, tile):
        # contiguous: a GEMM over a transposed view (a batch of one reshapes to a view where
        # a larger batch copies) takes another kernel and other bits
        part = x[start:start + tile].contiguous()
        rows = part.shape[0]
        if rows < tile:   # the last tile: pad to the one shape every tile has
            part = torch.cat([part, part.new_zeros((tile - rows, *part.shape[1:]))])
        outs.append(fn(part)[:rows])
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     tile: int = CPU_TILE_ROWS) -> torch.Tensor:
    """``F.linear`` whose row ``i`` depends only on ``x``'s row ``i`` (not on how many rows)."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    out = _tiled(lambda t: F.linear(t, weight, bias), rows, tile)
    return out.reshape(*lead, out.shape[-1])


def invariant_matmul(a: torch.Tensor, b: torch.Tensor, tile: int) -> torch.Tensor | None:
    """``a @ b`` in fixed-shape tiles, or None for a product this does not cover.

    (..., M, K) @ (K, N) is a ``linear`` over the flattened rows; (..., M, K) @ (..., K, N) with
    leading dims that broadcast is a batched GEMM over the flattened broadcast batch: cuBLAS may pick its algorithm
    by the batch count (the conformer's attention runs one per segment of streams), so the batch
    goes in tiles of exactly ``tile`` matrices."""
    if a.dim() >= 2 and b.dim() == 2:
        rows = a.reshape(-1, a.shape[-1])
        return _tiled(lambda t: t @ b, rows, tile).reshape(*a.shape[:-1], b.shape[-1])
    if a.dim() >= 3 and b.dim() >= 3:
        # a broadcast batch (the conformer's relative-position product: (n, h, t, d) @ (1, h, d, p))
        # is expanded first: left to matmul it became one batched GEMM of n * h matrices, whose
        # algorithm cuBLAS picks by n (H100, 2026-12-07: the probe's conformer output differed
        # beside one other stream; scripts/batch_invariance.py --trace)
        lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        a, b = a.expand(*lead, *a.shape[-2:]), b.expand(*lead, *b.shape[-2:])
        pairs = torch.cat([a.reshape(-1, *a.shape[-2:]).flatten(1), b.reshape(-1, *b.shape[-2:]).flatten(1)], 1)
        split = a.shape[-2] * a.shape[-1]

        def bmm(t: torch.Tensor) -> torch.Tensor:
            return torch.bmm(t[:, :split].view(-1, *a.shape[-2:]), t[:, split:].view(-1, *b.shape[-2:]))
        return _tiled(bmm, pairs, tile).reshape(*lead, a.shape[-2], b.shape[-1])
    return None


def invariant_mean_last(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """``x.mean(-1, keepdim)`` whose every row is summed in one fixed order: a pairwise tree of
    elementwise adds over the last axis (zero-padded to a power of two), so no reduction kernel
    chooses the order by the number of rows. Half-precision input is summed in float32, as
    ``torch.mean`` accumulates it."""
    d = x.shape[-1]
    s = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    width = 1 << max(d - 1, 0).bit_length()
    if width != d:
        s = F.pad(s, (0, width - d))
    while s.shape[-1] > 1:
        half = s.shape[-1] // 2
        s = s[..., :half] + s[..., half:]
    out = (s / d).to(x.dtype)
    return out if keepdim else out.squeeze(-1)


def _last_axis_mean(x: torch.Tensor, args: tuple, kwargs: dict) -> bool | None:
    """``keepdim`` if ``mean(x, *args, **kwargs)`` is a plain mean over x's last axis, else None."""
    if set(kwargs) - {"dim", "keepdim"} or not torch.is_floating_point(x) or x.dim() < 1 or x.shape[-1] == 0:
        return None
    dim = args[0] if args else kwargs.get("dim")
    keepdim = args[1] if len(args) > 1 else kwargs.get("keepdim", False)
    if len(args) > 2:
        return None
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    if not isinstance(dim, int) or dim not in (-1, x.dim() - 1):
        return None
    return bool(keepdim)


_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm)
_MEANS = (torch.mean, torch.Tensor.mean)
_FFTS = (torch.fft.rfft, torch.fft.irfft, torch.stft)


class BatchInvariantMode(TorchFunctionMode):
    """Within this mode ``F.linear``, ``F.conv1d`` / ``F.conv_transpose1d``, batched matmuls,
    ``F.scaled_dot_product_attention`` and the FFTs (``rfft``, ``irfft``, ``stft``) run in
    fixed-shape tiles over their batch axis, and a mean over the last axis in a fixed order
    (module docstring). Thread-local, like every torch
    function mode: enter it on the thread that runs the models. ``ops`` picks the families (all
    by default; the probes A/B them)."""

    FAMILIES = frozenset({"linear", "conv", "matmul", "sdpa", "fft", "mean"})

    def __init__(self, tile_rows: int, ops: frozenset[str] | None = None, batch_tile: int = BATCH_TILE) -> None:
        super().__init__()
        if tile_rows < 1 or batch_tile < 1:
            raise ValueError(f"tile_rows and batch_tile must be >= 1, got {tile_rows}, {batch_tile}")
        self.tile_rows = tile_rows     # rows (tokens) per GEMM tile: linear, matmul
        self.batch_tile = batch_tile   # batch elements per tile: conv, SDPA, FFT
        self.ops = self.FAMILIES if ops is None else frozenset(ops)
        if not self.ops <= self.FAMILIES:
            raise ValueError(f"unknown op families {sorted(self.ops - self.FAMILIES)}")
        self.calls = 0   # tiled calls made (tests check that the mode was in force)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ops, tile = self.ops, self.tile_rows
        if func is F.linear and "linear" in ops:
            self.calls += 1
            return invariant_linear(*args, **kwargs, tile=tile)
        if (func is F.conv1d or func is F.conv_transpose1d) and "conv" in ops:
            x, rest = args[0], args[1:]
            if x.dim() == 3:   # (B, C, L); an unbatched (C, L) input has nothing to vary with
                self.calls += 1
                return _tiled(lambda t: func(t, *rest, **kwargs), x, self.batch_tile)
        if func in _MATMULS and "matmul" in ops and not kwargs and len(args) == 2:
            out = invariant_matmul(args[0], args[1], tile)
            if out is not None:
                self.calls += 1
                return out
        if func is F.scaled_dot_product_attention and "sdpa" in ops:
            q, k, v = args[:3]
            mask = kwargs.pop("attn_mask", args[3] if len(args) > 3 else None)
            if q.dim() == 4 and k.shape[0] == q.shape[0] and v.shape[0] == q.shape[0] and \
                    (mask is None or (mask.dim() == 4 and mask.shape[0] in (1, q.shape[0]))):
                self.calls += 1
                return self._sdpa(q, k, v, mask, kwargs)
            if mask is not None:
                kwargs["attn_mask"] = mask
            return func(q, k, v, *args[4:], **kwargs)
        if func in _MEANS and "mean" in ops and args and isinstance(args[0], torch.Tensor):
            keepdim = _last_axis_mean(args[0], args[1:], kwargs)
            if keepdim is not None:
                self.calls += 1
                return invariant_mean_last(args[0], keepdim)
        if func in _FFTS and "fft" in ops and args and args[0].dim() >= 2:
            x, rest = args[0], args[1:]
            self.calls += 1
            return _tiled(lambda t: func(t, *rest, **kwargs), x, self.batch_tile)
        return func(*args, **kwargs)

    def _sdpa(self, q, k, v, mask, kwargs) -> torch.Tensor:
        """SDPA per tile of ``batch_tile`` batch elements (q, k, v and a per-element mask cut
        alike; a broadcast mask of batch 1 is passed whole)."""
        b = q.shape[0]
        per_row_mask = mask is not None and mask.shape[0] == b and b > 1
        outs = []
        tile = self.batch_tile
        for start in range(0, b, tile):
            stop = min(b, start + tile)
            parts = [t[start:stop] for t in (q, k, v)] + ([mask[start:stop]] if per_row_mask else [])
            rows = stop - start
            if rows < tile:
                parts = [torch.cat([p, p[-1:].expand(tile - rows, *p.shape[1:])]) for p in parts]
            m = parts[3] if per_row_mask else mask
            outs.append(F.scaled_dot_product_attention(*parts[:3], attn_mask=m, **kwargs)[:rows])
        return outs[0] if len(outs) == 1 else torch.cat(outs)
