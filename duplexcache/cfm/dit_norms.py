"""The DiT estimator's residual + LayerNorm + adaLN modulation, as one step.

Every DiT block ends each sub-block (attention, causal conv, MLP) with a gated residual and starts
the next one with a LayerNorm (no affine, eps 1e-6) and its adaLN modulation:

    h' = h + gate * a                     (skipped before the first block)
    y  = LayerNorm(h') * (1 + scale) + shift

In the arena's solve `gate`, `1 + scale` and `shift` are one (hidden,) vector each per (Euler
step, layer): the timestep embedding is the same for every row, so `EulerArena` computes them
once (`dit_solve.Modulations`). Written as torch operators this is five kernels over the
(rows x frames, hidden) activations (mul, add, layer_norm, mul, add), three times per block, in
each of the 10 Euler steps: at tier 1 the solve is ~11 000 small kernels (H100, 2026-12-07,
`scripts/probes/c2w_solve_tiers.py`), so launches and their gaps are most of its fixed cost.

Two implementations of the same function:

* `residual_norm_modulate_torch`: those operators, in the order the model code applies them, so
  its bits are the module path's (`DiTBlock.forward_chunk`). The CPU path and the reference.
* `residual_norm_modulate_triton`: one launch; each program takes a few rows, adds the gated
  residual, stores h', and normalises and modulates in float32 (a bfloat16 h' is rounded before
  the norm reads it, as the torch path reads the stored tensor). Another summation order, so
  other bits (within float32 rounding of the torch path; the tests bound it), the same in every
  engine of a process: sharing on and off run the same kernel, so they stay `torch.equal`.

Triton is optional, as for the private-key gather (`cfm/private_gather.py`): off CUDA the kernel
runs only under ``TRITON_INTERPRET=1`` (tests).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from duplexcache.cfm.private_gather import triton_gather_available

try:  # Triton is an optional GPU dependency.
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

LAYER_NORM_EPS = 1e-6    # every DiT norm (norm1/2/3, norm_final): LayerNorm(hidden, eps=1e-6, no affine)
ROWS_PER_PROGRAM = 4


def norm_kernel_available(device: torch.device) -> bool:
    """Whether `residual_norm_modulate_triton` can run on tensors of `device`."""
    return triton_gather_available(device)


def residual_norm_modulate_torch(h: torch.Tensor, gate: torch.Tensor | None, a: torch.Tensor | None,
                                 shift: torch.Tensor, scale1: torch.Tensor,
                                 eps: float = LAYER_NORM_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """h, a (..., H); gate, shift, scale1 (H,) or broadcastable -> (h', y). No residual when gate is None."""
    if gate is not None:
        h = h + gate * a
    return h, F.layer_norm(h, (h.shape[-1],), eps=eps) * scale1 + shift


if triton is not None:
    @triton.jit
    def _residual_norm_modulate_kernel(h_ptr, a_ptr, gate_ptr, shift_ptr, scale_ptr, h_out_ptr, y_ptr,
                                       M, W, H, a_sb, a_sw, a_sh, eps,
                                       HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_H)
        cmask = cols < H
        mask = (rows < M)[:, None] & cmask[None, :]
        offs = rows[:, None] * H + cols[None, :]
        x = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            # a may be a strided (B, W, H) view (the conv's output is transposed back, not copied)
            a_offs = ((rows // W) * a_sb + (rows % W) * a_sw)[:, None] + cols[None, :] * a_sh
            a = tl.load(a_ptr + a_offs, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(gate_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            x = x + g[None, :] * a
            out = x.to(h_out_ptr.dtype.element_ty)
            tl.store(h_out_ptr + offs, out, mask=mask)
            x = out.to(tl.float32)
        mean = tl.sum(x, axis=1) / H
        d = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / H + eps)
        s1 = tl.load(scale_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        sh = tl.load(shift_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        y = d * rstd[:, None] * s1[None, :] + sh[None, :]
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def residual_norm_modulate_triton(h: torch.Tensor, gate: torch.Tensor | None, a: torch.Tensor | None,
                                  shift: torch.Tensor, scale1: torch.Tensor,
                                  eps: float = LAYER_NORM_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """h (B, W, H) contiguous; a (B, W, H) any strides; gate, shift, scale1 hold H values each."""
    if h.dim() != 3 or not h.is_contiguous():
        raise ValueError(f"h must be a contiguous (B, W, H) tensor, got {tuple(h.shape)} strides {h.stride()}")
    b, w, hidden = h.shape
    has_res = gate is not None
    if has_res and a.shape != h.shape:
        raise ValueError(f"residual {tuple(a.shape)} does not match h {tuple(h.shape)}")
    vecs = [v.reshape(-1) for v in ((gate,) if has_res else ()) + (shift, scale1)]
    if any(v.numel() != hidden or not v.is_contiguous() for v in vecs):
        raise ValueError(f"gate, shift and scale1 must hold {hidden} contiguous values each")
    h_out = torch.empty_like(h) if has_res else h
    y = torch.empty_like(h)
    m = b * w
    a_arg = a if has_res else h
    a_sb, a_sw, a_sh = a_arg.stride()
    grid = (triton.cdiv(m, ROWS_PER_PROGRAM),)
    _residual_norm_modulate_kernel[grid](
        h, a_arg, vecs[0], vecs[-2], vecs[-1], h_out, y, m, w, hidden, a_sb, a_sw, a_sh, eps,
        HAS_RES=has_res, BLOCK_M=ROWS_PER_PROGRAM, BLOCK_H=triton.next_power_of_2(hidden))
    return h_out, y
