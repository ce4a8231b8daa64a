"""The Code2Wav estimator (DiT) over an arena's static buffers: the Euler times and one
estimator call whose attention keys are assembled in a transient workspace from three places, the
row's new keys, the voice prompt's frames in the prompt bank and the session's private frames in
its own storage (cfm/arena.py's module docstring draws the layout; cfm/private_gather.py copies
the private frames). Pure functions of their tensors: what the arena captures as one graph.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from duplexcache.cfm.dit_norms import DitKernels


def twice(t: torch.Tensor) -> torch.Tensor:
    """(n, ...) -> (2n, ...) with every row repeated once in place: rows [r0, r0, r1, r1, ...].
    Same values as repeat_interleave(2, 0), written as expand + reshape so it never needs the host."""
    return t.unsqueeze(1).expand(t.shape[0], 2, *t.shape[1:]).flatten(0, 1)


def euler_times(n_timesteps: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t_k, dt_k) for k = 0..n-1, accumulated exactly like the reference solver (t += dt).

    Accumulated in float32 and then cast: a bfloat16 arena (precision.code2wav_dtype) would
    otherwise round every partial sum of t to 8 bits of mantissa."""
    out_dtype, dtype = dtype, torch.float32
    t_span = torch.linspace(0, 1, n_timesteps + 1, device=device, dtype=dtype)
    t_span = 1 - torch.cos(t_span * 0.5 * torch.pi)
    t, dt = t_span[0].unsqueeze(0), t_span[1] - t_span[0]
    ts, dts = [], []
    for step in range(1, n_timesteps + 1):
        ts.append(t.reshape(()))
        dts.append(dt.reshape(()))
        t = t + dt
        if step < n_timesteps:
            dt = t_span[step + 1] - t
    return torch.stack(ts).to(out_dtype), torch.stack(dts).to(out_dtype)


def attend(attn: nn.Module, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    b2, nh, w, hd = q.shape
    out = F.scaled_dot_product_attention(q, keys[..., :hd], keys[..., hd:], attn_mask=mask)
    return attn.proj(out.transpose(1, 2).reshape(b2, w, nh * hd))


PrivateGather = Callable[[torch.Tensor, int, int], None]   # (workspace, step, layer)


@dataclass
class AttentionKeys:
    """Where one solve's attention keys come from (see the module docstring).

    copied: the old layout, whole cache in the row (att is then K wide; the other fields unused).
    """

    width: int
    num_keys: int
    mask: torch.Tensor                  # (B2, 1, 1, num_keys) bool
    copied: bool
    workspace: torch.Tensor | None = None   # (B2, heads, K, 2hd), transient
    frame_idx: torch.Tensor | None = None   # (tier * Lb,) bank frame per cache key
    gather: PrivateGather | None = None     # copies each row's keys j < d_r from its session's storage
    step: int = 0                           # the Euler step being solved


def attention(attn: nn.Module, x: torch.Tensor, att: torch.Tensor, bank: torch.Tensor,
              keys: AttentionKeys, layer: int, kernels: DitKernels) -> torch.Tensor:
    """x (B2, W, H); att (B2, heads, >= W, 2hd), the rows' new keys, written in place at
    [0, W); bank (2, heads, F, 2hd), this (step, layer)'s prompt frames of every voice."""
    ws = None if keys.copied else keys.workspace
    q = kernels.project(attn, x, att, ws, layer)   # keys are [new | cache]: new frames first
    if keys.copied:
        return attend(attn, q, att[:, :, :keys.num_keys], keys.mask)
    width = keys.width
    lb = keys.num_keys - width
    if lb:
        b2, nh, cap, hd2 = ws.shape
        tier = b2 // 2
        # Every cache key from the bank: a prompt frame, or the zero frame (private and padding
        # keys); then the private keys (j < d_r) over it, read from the sessions' own storage.
        shared = bank.index_select(2, keys.frame_idx).unflatten(2, (tier, lb)).permute(2, 0, 1, 3, 4)
        ws.view(tier, 2, nh, cap, hd2)[:, :, :, width:keys.num_keys].copy_(shared)
        keys.gather(ws, keys.step, layer)
    return attend(attn, q, ws[:, :, :keys.num_keys], keys.mask)


SCALES = (1, 4, 7)   # scale_msa, scale_mlp, scale_conv among a block's 9 adaLN outputs


@torch.inference_mode()
def modulations(est: nn.Module, t_emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block's adaLN outputs per Euler step, computed once: the timestep embedding is the
    same for every row, so they are constants of the weights and the step. Each is the call the
    block makes on c (1, 1, H) and each scale is stored as `1 + scale`, the operands `models.flow.modulate`
    computes, so the solve's values are the per-call ones bit for bit.

    t_emb (steps, H) -> blocks (steps, depth, 9, H) in the order of `DiTBlock.modulation`, final
    (steps, 2, H): shift, 1 + scale of the final layer."""
    blocks, final = [], []
    for k in range(t_emb.shape[0]):
        c = t_emb[k].reshape(1, 1, -1)
        mods = []
        for block in est.blocks:
            parts = list(block.adaLN_modulation(c).chunk(9, dim=-1))
            for i in SCALES:
                parts[i] = 1 + parts[i]
            mods.append(torch.cat(parts, dim=0).reshape(9, -1))
        blocks.append(torch.stack(mods))
        shift, scale = est.final_layer.adaLN_modulation(c).chunk(2, dim=-1)
        final.append(torch.cat([shift, 1 + scale], dim=0).reshape(2, -1))
    return torch.stack(blocks), torch.stack(final)


def estimator_forward(est: nn.Module, x: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor,
                      cond: torch.Tensor, cnn_in: torch.Tensor, cnn_out: torch.Tensor, att: torch.Tensor,
                      bank: torch.Tensor, keys: AttentionKeys, block_mods: torch.Tensor, final_mod: torch.Tensor,
                      kernels: DitKernels) -> torch.Tensor:
    """One DiT call over B2 = 2 * tier rows at one Euler step. block_mods (depth, 9, H) and
    final_mod (2, H): that step's `modulations`; cnn_in/out (depth, B2, 2H, 2); att (depth, B2,
    heads, >= W, 2hd); bank (depth, 2, heads, F, 2hd). `kernels` (cfm/dit_norms.py): the gated
    residual + LayerNorm + modulation between sub-blocks and the attention's projections, as the
    torch operators or the fused kernels.
    The order of operations is `DiTBlock.forward_chunk`'s: attention, causal conv, MLP."""
    width, norm = x.shape[2], kernels.norm
    h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, width), cond], dim=1)
    h = est.in_proj(h.transpose(1, 2))                      # (B2, W, H)
    m = block_mods[0]
    h, y = norm(h, None, None, m[0], m[1])                  # norm1 of the first block
    for i, block in enumerate(est.blocks):
        m = block_mods[i]        # shift/scale1/gate for msa 0-2, mlp 3-5, conv 6-8
        a = attention(block.attn, y, att[i], bank[i], keys, i, kernels)
        h, y = norm(h, m[2], a, m[6], m[7])                 # + gate_msa * a; norm3
        conv, new_cnn = block.conv.forward_chunk(y, cnn_in[i])
        cnn_out[i].copy_(new_cnn)
        h, y = norm(h, m[8], conv, m[3], m[4])              # + gate_conv * conv; norm2
        mlp = block.mlp(y)
        nxt = block_mods[i + 1] if i + 1 < len(est.blocks) else None
        shift, scale1 = (nxt[0], nxt[1]) if nxt is not None else (final_mod[0], final_mod[1])
        h, y = norm(h, m[5], mlp, shift, scale1)            # + gate_mlp * mlp; next norm1 (or norm_final)
    return est.final_layer.linear(y).transpose(1, 2)        # (B2, mel, W)
