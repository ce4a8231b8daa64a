"""The DiT estimator's fused steps: the residual + LayerNorm + adaLN modulation between its
sub-blocks, and the attention's q, k, v projections with their norms.

Every DiT block ends each sub-block (attention, causal conv, MLP) with a gated residual and starts
the next one with a LayerNorm (no affine, eps 1e-6) and its adaLN modulation:

    h' = h + gate * a                     (skipped before the first block)
    y  = LayerNorm(h') * (1 + scale) + shift

In the arena's solve `gate`, `1 + scale` and `shift` are one (hidden,) vector each per (Euler
step, layer): the timestep embedding is the same for every row, so `EulerArena` computes them
once (`dit_solve.modulations`). Written as torch operators this is five kernels over the
(rows x frames, hidden) activations (mul, add, layer_norm, mul, add), three times per block, in
each of the 10 Euler steps; the attention's input then takes three projections, two norms over
the heads and five copies (the keys into the row and the workspace). At tier 1 a solve was
~11 000 small kernels (H100, 2026-12-07, `scripts/probes/c2w_solve_tiers.py`), so launches and
their gaps were most of its fixed cost.

Two implementations of each step, bundled as `DitKernels`:

* torch (`residual_norm_modulate_torch`, `project_torch`): those operators, in the order the
  model code applies them, so their bits are the module path's (`DiTBlock.forward_chunk`). The
  CPU path and the reference.
* triton (`residual_norm_modulate_triton`, `project_triton`): one launch for the norm step (each
  program takes a few rows, adds the gated residual, stores h', normalises and modulates in
  float32; a bfloat16 h' is rounded before the norm reads it, as the torch path reads the stored
  tensor); for the projections one GEMM over the stacked q, k, v weights and one launch for both
  norms and the key writes. Another summation order, so other bits (within float32 rounding of
  the torch path; the tests bound it), the same in every engine of a process: sharing on and off
  run the same kernels, so they stay `torch.equal`.

Triton is optional, as for the private-key gather (`cfm/private_gather.py`): off CUDA the kernels
run only under ``TRITON_INTERPRET=1`` (tests).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
    """Whether the Triton kernels here can run on tensors of `device`."""
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


# ---- the attention's projections: one GEMM for q, k and v, then q/k LayerNorm and the key writes
def project_torch(attn, x: torch.Tensor, att: torch.Tensor, ws: torch.Tensor | None,
                  qkv_weight: torch.Tensor | None = None, qkv_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The module's operators: three projections, q_norm / k_norm on the heads, the new keys and
    values written to att[:, :, :W] (and copied to the workspace ws[:, :, :W] when given).
    x (B2, W, H); att, ws (B2, heads, >= W, 2hd) -> q (B2, heads, W, hd)."""
    b2, w, _ = x.shape
    nh, hd = attn.num_heads, attn.head_dim
    q = attn.to_q(x).reshape(b2, w, nh, hd).transpose(1, 2)
    k = attn.to_k(x).reshape(b2, w, nh, hd).transpose(1, 2)
    v = attn.to_v(x).reshape(b2, w, nh, hd).transpose(1, 2)
    att[:, :, :w, :hd] = attn.k_norm(k)
    att[:, :, :w, hd:] = v
    if ws is not None:
        ws[:, :, :w].copy_(att[:, :, :w])
    return attn.q_norm(q)


if triton is not None:
    @triton.jit
    def _qk_norm_scatter_kernel(qkv_ptr, qw_ptr, qb_ptr, kw_ptr, kb_ptr, q_ptr, att_ptr, ws_ptr,
                                W, HEADS, att_sb, att_sh, att_sw, ws_sb, ws_sh, ws_sw, q_eps, k_eps,
                                HD: tl.constexpr, BLOCK_HEADS: tl.constexpr, HAS_WS: tl.constexpr):
        m = tl.program_id(0)                 # one (row, frame): its q, k, v of every head
        b, w = m // W, m % W
        heads = tl.arange(0, BLOCK_HEADS)
        d = tl.arange(0, HD)
        mask = (heads < HEADS)[:, None]
        inner = HEADS * HD
        offs = heads[:, None] * HD + d[None, :]
        base = qkv_ptr + m * 3 * inner
        q = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        k = tl.load(base + inner + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(base + 2 * inner + offs, mask=mask, other=0.0)
        qc = q - (tl.sum(q, axis=1) / HD)[:, None]
        qn = qc * (1.0 / tl.sqrt(tl.sum(qc * qc, axis=1) / HD + q_eps))[:, None]
        qn = qn * tl.load(qw_ptr + d).to(tl.float32)[None, :] + tl.load(qb_ptr + d).to(tl.float32)[None, :]
        kc = k - (tl.sum(k, axis=1) / HD)[:, None]
        kn = kc * (1.0 / tl.sqrt(tl.sum(kc * kc, axis=1) / HD + k_eps))[:, None]
        kn = kn * tl.load(kw_ptr + d).to(tl.float32)[None, :] + tl.load(kb_ptr + d).to(tl.float32)[None, :]
        kn = kn.to(att_ptr.dtype.element_ty)
        tl.store(q_ptr + ((b * HEADS + heads[:, None]) * W + w) * HD + d[None, :],
                 qn.to(q_ptr.dtype.element_ty), mask=mask)
        a_offs = b * att_sb + heads[:, None] * att_sh + w * att_sw + d[None, :]
        tl.store(att_ptr + a_offs, kn, mask=mask)
        tl.store(att_ptr + a_offs + HD, v, mask=mask)
        if HAS_WS:
            w_offs = b * ws_sb + heads[:, None] * ws_sh + w * ws_sw + d[None, :]
            tl.store(ws_ptr + w_offs, kn, mask=mask)
            tl.store(ws_ptr + w_offs + HD, v, mask=mask)


def project_triton(attn, x: torch.Tensor, att: torch.Tensor, ws: torch.Tensor | None,
                   qkv_weight: torch.Tensor | None = None, qkv_bias: torch.Tensor | None = None) -> torch.Tensor:
    """`project_torch` as one GEMM over the concatenated q, k, v weights (`qkv_weight` (3 x
    inner, H), `qkv_bias`) and one kernel for both norms and the writes."""
    b2, w, _ = x.shape
    nh, hd = attn.num_heads, attn.head_dim
    if qkv_weight is None or qkv_bias is None:
        raise ValueError("project_triton needs the concatenated q, k, v weight and bias")
    for t in (att,) + ((ws,) if ws is not None else ()):
        if t.shape[0] != b2 or t.shape[1] != nh or t.shape[2] < w or t.shape[3] != 2 * hd or t.stride(3) != 1:
            raise ValueError(f"key buffer {tuple(t.shape)} strides {t.stride()} cannot take {b2} rows x {nh} heads "
                             f"x {w} frames x {2 * hd}")
    qkv = F.linear(x, qkv_weight, qkv_bias).contiguous()              # (B2, W, 3 x inner)
    q = torch.empty(b2, nh, w, hd, device=x.device, dtype=x.dtype)
    ws_arg = ws if ws is not None else att
    _qk_norm_scatter_kernel[(b2 * w,)](
        qkv, attn.q_norm.weight, attn.q_norm.bias, attn.k_norm.weight, attn.k_norm.bias, q, att, ws_arg,
        w, nh, att.stride(0), att.stride(1), att.stride(2), ws_arg.stride(0), ws_arg.stride(1), ws_arg.stride(2),
        attn.q_norm.eps, attn.k_norm.eps, HD=hd, BLOCK_HEADS=triton.next_power_of_2(nh), HAS_WS=ws is not None)
    return q


@dataclass(frozen=True)
class DitKernels:
    """What an arena's solve runs for the fused steps: the torch operators (`torch_kernels`) or
    the Triton kernels (`EulerArena` builds them with the concatenated q, k, v weights).
    norm(h, gate, a, shift, scale1) -> (h', y); project(attn, x, att, ws, layer) -> q."""

    name: str
    norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    project: Callable[..., torch.Tensor]


def torch_kernels() -> DitKernels:
    return DitKernels("torch", residual_norm_modulate_torch,
                      lambda attn, x, att, ws, layer: project_torch(attn, x, att, ws))


def triton_kernels(qkv_weight: torch.Tensor, qkv_bias: torch.Tensor) -> DitKernels:
    """qkv_weight (depth, 3 x inner, H), qkv_bias (depth, 3 x inner): every block's to_q, to_k,
    to_v stacked (static buffers of the arena, filled before its first solve)."""
    return DitKernels("triton", residual_norm_modulate_triton,
                      lambda attn, x, att, ws, layer: project_triton(attn, x, att, ws, qkv_weight[layer],
                                                                     qkv_bias[layer]))


def stack_qkv(blocks, weight: torch.Tensor, bias: torch.Tensor) -> None:
    """Fill `weight` (depth, 3 x inner, H) and `bias` with each block's q, k, v projections."""
    for i, block in enumerate(blocks):
        a = block.attn
        weight[i].copy_(torch.cat([a.to_q.weight, a.to_k.weight, a.to_v.weight]))
        bias[i].copy_(torch.cat([a.to_q.bias, a.to_k.bias, a.to_v.bias]))
