"""Whole-Euler arena: all 10 Euler steps of a micro-batch as one unit over static buffers.

Row layout: session row r holds its cond row and its uncond row side by side (cfg axis right
after the row axis), so a tier of `t` rows is the contiguous prefix `[:t]` of every buffer and a
session's slot `[:, :, r]` has exactly the per-session cache layout
(steps, layers, cfg=2, heads, frames, 2*head_dim).

Attention buffer, per (step, layer, row, cfg, head), along the key axis:

    0        W          W + L_r                  W + Lb             K (capacity)
    | new KV | cache (L_r frames, from copy_range_to) | masked padding |  unused  |
    '--- the row's next cache, in reference key order ---'

The estimator writes the chunk's new K/V into [0, W) in place, so after a run `[0, W + L_r)` is
the reference's `new_att_cache` for that row; nothing is concatenated. Keys past W + L_r are
masked (rows of one micro-batch have their own cache lengths). Lb is a cache-length bucket.

On CUDA each (tier, query width W, bucket Lb) is captured once as a CUDA graph; static buffers
are allocated at the largest size, graphs are captured largest first into one memory pool, and a
replay picks the smallest bucket that fits. On CPU the same `_euler` runs eagerly.
"""
from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from duplexcache.cfm.prompt_cache import AttCache

logger = logging.getLogger(__name__)


class ArenaShapeError(ValueError):
    """A micro-batch does not fit the arena's static buffers."""


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


def euler_times(n_timesteps: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t_k, dt_k) for k = 0..n-1, accumulated exactly like the reference solver (t += dt)."""
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
    return torch.stack(ts), torch.stack(dts)


def _attention(attn: nn.Module, x: torch.Tensor, att: torch.Tensor, mask: torch.Tensor,
               width: int, num_keys: int) -> torch.Tensor:
    """x (B2, W, H); att (B2, heads, K, 2hd) updated in place at [0, W); mask (B2, 1, 1, keys)."""
    b2, w, _ = x.shape
    nh, hd = attn.num_heads, attn.head_dim
    q = attn.to_q(x).reshape(b2, w, nh, hd).transpose(1, 2)   # (B2, heads, W, hd)
    k = attn.to_k(x).reshape(b2, w, nh, hd).transpose(1, 2)
    v = attn.to_v(x).reshape(b2, w, nh, hd).transpose(1, 2)
    q, k = attn.q_norm(q), attn.k_norm(k)
    att[:, :, :width, :hd] = k       # keys are [new | cache]: new frames first
    att[:, :, :width, hd:] = v
    keys = att[:, :, :num_keys]
    out = F.scaled_dot_product_attention(q, keys[..., :hd], keys[..., hd:], attn_mask=mask)
    return attn.proj(out.transpose(1, 2).reshape(b2, w, nh * hd))


def _estimator(est: nn.Module, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
               cond: torch.Tensor, cnn_in: torch.Tensor, cnn_out: torch.Tensor, att: torch.Tensor,
               mask: torch.Tensor, num_keys: int) -> torch.Tensor:
    """One DiT call over B2 = 2 * tier rows. cnn_in/out (depth, B2, 2H, 2); att (depth, B2, heads, K, 2hd)."""
    width = x.shape[2]
    c = est.t_embedder(t).unsqueeze(1)                       # (B2, 1, H)
    h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, width), cond], dim=1)
    h = est.in_proj(h.transpose(1, 2))                      # (B2, W, H)
    for i, block in enumerate(est.blocks):
        (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp,
         shift_conv, scale_conv, gate_conv) = block.adaLN_modulation(c).chunk(9, dim=-1)
        a = _attention(block.attn, _modulate(block.norm1(h), shift_msa, scale_msa), att[i], mask,
                       width, num_keys)
        h = h + gate_msa * a
        conv, new_cnn = block.conv.forward_chunk(_modulate(block.norm3(h), shift_conv, scale_conv), cnn_in[i])
        cnn_out[i].copy_(new_cnn)
        h = h + gate_conv * conv
        h = h + gate_mlp * block.mlp(_modulate(block.norm2(h), shift_mlp, scale_mlp))
    return est.final_layer(h, c).transpose(1, 2)             # (B2, mel, W)


class EulerArena:
    """Static buffers for `rows` sessions and the whole-Euler solve over a prefix of them."""

    def __init__(self, estimator: nn.Module, rows: int, max_query: int, max_cache: int,
                 n_timesteps: int, cfg_rate: float, key_bucket: int = 64,
                 tiers: tuple[int, ...] = (), use_cuda_graphs: bool = True) -> None:
        p = next(estimator.parameters())
        device, dtype = p.device, p.dtype
        self.estimator = estimator
        self.rows, self.max_query, self.max_cache = rows, max_query, max_cache
        self.n_timesteps, self.cfg_rate, self.key_bucket = n_timesteps, cfg_rate, key_bucket
        self.tiers = tuple(t for t in tiers if t <= rows)
        depth = len(estimator.blocks)
        attn = estimator.blocks[0].attn
        hidden = estimator.in_proj.out_features
        mel = estimator.out_channels
        self.key_capacity = max(max_query, max_query + max_cache)
        z = dict(device=device, dtype=dtype)
        self.x = torch.zeros(rows, mel, max_query, **z)        # initial noise per row
        self.out = torch.zeros(rows, mel, max_query, **z)      # mel per row after 10 steps
        self.mu = torch.zeros(rows, mel, max_query, **z)
        self.cond = torch.zeros(rows, mel, max_query, **z)
        self.spks = torch.zeros(rows, mel, **z)
        self.cnn_in = torch.zeros(n_timesteps, depth, rows, 2, 2 * hidden, 2, **z)
        self.cnn_out = torch.zeros_like(self.cnn_in)
        self.att = torch.zeros(n_timesteps, depth, rows, 2, attn.num_heads, self.key_capacity,
                               2 * attn.head_dim, **z)
        self.cache_len = torch.zeros(rows, dtype=torch.long, device=device)
        self.t_steps, self.dt_steps = euler_times(n_timesteps, device, dtype)
        self.use_graphs = use_cuda_graphs and device.type == "cuda"
        self._graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._buffer_ptrs = self._ptrs()

    # ---- filling rows ------------------------------------------------------------------
    def load_row(self, row: int, width: int, noise: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor,
                 cond: torch.Tensor | None, cnn_cache: torch.Tensor | None, att_cache: AttCache | None) -> None:
        """Copy one session's inputs into row `row`. noise, mu, cond (mel, W); spks (mel,).

        The attention cache is written by `att_cache.copy_range_to` straight into the arena.
        """
        cache_len = 0 if att_cache is None else len(att_cache)
        if width > self.max_query or width + cache_len > self.key_capacity:
            raise ArenaShapeError(
                f"chunk of {width} frames with a cache of {cache_len} does not fit the arena "
                f"(max query {self.max_query}, key capacity {self.key_capacity})")
        self.x[row, :, :width].copy_(noise)
        self.mu[row, :, :width].copy_(mu)
        self.spks[row].copy_(spks)
        if cond is None:
            self.cond[row, :, :width].zero_()
        else:
            self.cond[row, :, :width].copy_(cond)
        if cnn_cache is None:
            self.cnn_in[:, :, row].zero_()
        else:
            self.cnn_in[:, :, row].copy_(cnn_cache)
        if cache_len:
            att_cache.copy_range_to(self.att[:, :, row, :, :, width:width + cache_len], 0, cache_len)
        self.cache_len[row] = cache_len

    def pad_row(self, row: int, width: int) -> None:
        """A slot the replay computes but nobody reads: zero inputs, only its own new keys valid."""
        for buf in (self.x, self.mu, self.cond):
            buf[row, :, :width].zero_()
        self.spks[row].zero_()
        self.cnn_in[:, :, row].zero_()
        self.cache_len[row] = 0

    # ---- reading rows ------------------------------------------------------------------
    def mel(self, row: int, width: int) -> torch.Tensor:
        return self.out[row, :, :width]

    def new_cnn_cache(self, row: int) -> torch.Tensor:
        return self.cnn_out[:, :, row]                      # (steps, depth, 2, 2H, 2)

    def new_att_cache(self, row: int, length: int) -> torch.Tensor:
        """View of the row's cache after the run, `[new | old]`, first `length` frames."""
        return self.att[:, :, row, :, :, :length]          # (steps, depth, 2, heads, length, 2hd)

    # ---- running -----------------------------------------------------------------------
    def bucket(self, width: int, cache_len: int) -> int:
        """Smallest cache-length bucket >= cache_len: a multiple of key_bucket, capped to capacity."""
        return min(self.key_bucket * math.ceil(cache_len / self.key_bucket), self.key_capacity - width)

    def run(self, tier: int, width: int, max_cache_len: int) -> None:
        """Solve rows [0, tier) (all loaded or padded) for a chunk of `width` frames."""
        if not 1 <= tier <= self.rows:
            raise ArenaShapeError(f"tier {tier} outside 1..{self.rows}")
        lb = self.bucket(width, max_cache_len)
        if lb < max_cache_len:
            raise ArenaShapeError(f"cache of {max_cache_len} frames does not fit with width {width}")
        if self.use_graphs:
            self._replay(tier, width, lb)
        else:
            self._euler(tier, width, lb)

    @torch.inference_mode()
    def _euler(self, tier: int, width: int, lb: int) -> None:
        """All n Euler steps with CFG over rows [0, tier). Reads and writes static buffers only."""
        num_keys = width + lb
        x = self.x[:tier, :, :width]
        mu_in = torch.stack([self.mu[:tier, :, :width], torch.zeros_like(self.mu[:tier, :, :width])], 1).flatten(0, 1)
        cond_in = torch.stack([self.cond[:tier, :, :width], torch.zeros_like(self.cond[:tier, :, :width])], 1).flatten(0, 1)
        spks_in = torch.stack([self.spks[:tier], torch.zeros_like(self.spks[:tier])], 1).flatten(0, 1)
        keys = torch.arange(num_keys, device=x.device)
        valid = keys.unsqueeze(0) < (width + self.cache_len[:tier]).unsqueeze(1)      # (tier, keys)
        mask = valid.repeat_interleave(2, dim=0)[:, None, None, :]                   # (2*tier, 1, 1, keys)
        for k in range(self.n_timesteps):
            x_in = x.repeat_interleave(2, dim=0)                                      # rows: cond, uncond
            t_in = self.t_steps[k].expand(2 * tier)
            dphi = _estimator(self.estimator, x_in, mu_in, t_in, spks_in, cond_in,
                              self.cnn_in[k, :, :tier].flatten(1, 2), self.cnn_out[k, :, :tier].flatten(1, 2),
                              self.att[k, :, :tier].flatten(1, 2), mask, num_keys)
            dphi = dphi.unflatten(0, (tier, 2))
            dphi = (1.0 + self.cfg_rate) * dphi[:, 0] - self.cfg_rate * dphi[:, 1]
            x = x + self.dt_steps[k] * dphi
        self.out[:tier, :, :width].copy_(x)

    # ---- CUDA graphs -------------------------------------------------------------------
    def _ptrs(self) -> tuple[int, ...]:
        return tuple(b.data_ptr() for b in (self.x, self.out, self.mu, self.cond, self.spks,
                                            self.cnn_in, self.cnn_out, self.att, self.cache_len))

    def capture(self, widths: list[int], tiers: list[int] | None = None) -> None:
        """Capture graphs for every (tier, width, bucket), largest first, into one pool."""
        if not self.use_graphs:
            return
        tiers = sorted(tiers or list(self.tiers) or [self.rows], reverse=True)
        for tier in tiers:
            for width in sorted(widths, reverse=True):
                buckets = {self.bucket(width, n) for n in range(0, self.max_cache + 1)}
                for lb in sorted(buckets, reverse=True):
                    self._capture_one(tier, width, lb)

    def _capture_one(self, tier: int, width: int, lb: int) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._euler(tier, width, lb)   # warm-up (allocator, kernels)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._euler(tier, width, lb)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[(tier, width, lb)] = graph

    def _replay(self, tier: int, width: int, lb: int) -> None:
        # Graphs bake in buffer addresses: refuse to replay if a buffer was replaced.
        if self._ptrs() != self._buffer_ptrs:
            raise RuntimeError("EulerArena static buffers changed since capture")
        graph = self._graphs.get((tier, width, lb))
        if graph is None:
            logger.debug("no CUDA graph for tier=%d width=%d bucket=%d; running eagerly", tier, width, lb)
            self._euler(tier, width, lb)
            return
        graph.replay()

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (self.x, self.out, self.mu, self.cond, self.spks,
                                                         self.cnn_in, self.cnn_out, self.att))
