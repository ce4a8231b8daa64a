"""Stage 2 flow model: token -> mel, streaming, single session.

Our own implementation of MiniCPM-o 4.5's Code2Wav flow (``minicpmo-utils==1.0.5``,
``stepaudio2.cosyvoice2.flow``): a causal conformer encoder with a 2x upsampler
(``UpsampleConformerEncoderV2``), a DiT velocity estimator (``DiT``), a fixed-step Euler
solver with classifier-free guidance (``CausalConditionalCFM``) and the wrapper that ties them
to speech tokens and a speaker embedding (``CausalMaskedDiffWithXvec``).

Module and parameter names equal the reference's, so ``assets/token2wav/flow.pt`` loads with
``strict=True``. Inference only: dropout layers (no parameters) are left out, as they are the
identity in eval mode. Op order follows the reference where it decides float32 rounding.

Streaming caches of one session (``setup_cache`` / ``inference_chunk`` return them in a dict):

* ``conformer_cnn_cache`` ``(b, C, 2 + 2*up_stride)``: the pre-lookahead conv's last 2
  frames, then the upsampler's last ``2*up_stride`` frames.
* ``conformer_att_cache`` ``(num_blocks + num_up_blocks, b, heads, 2*T_tok, 2*d_k)``: K|V of
  every conformer layer. The first ``num_blocks`` layers run at token rate, so their caches
  (``T_tok`` frames) are tiled twice along time to stack with the upsampled layers' caches.
  Keys are ``[cache | new]``.
* ``estimator_cnn_cache`` ``(steps, depth, b=2, 2*hidden, 2)``: causal-conv state per Euler
  step and DiT block, rows ``[cond, uncond]``.
* ``estimator_att_cache`` ``(steps, depth, b=2, heads, T, 2*head_dim)``: K and V side by side
  on the last axis. **Keys of a chunk are ``[new frames | cache]``** (the reverse of the
  conformer), so after the prompt setup (P frames) and chunks c1, c2 the time axis reads::

      [ c2 | c1 | prompt(P) ]

  ``trim_stream_cache`` keeps the first P and the last 100 frames once it is longer than
  P + 100 (Token2wav.stream's rule): the newest frames (private to the session, rolling)
  and the prompt's tail (fixed for the whole call). The Euler noise is sliced from the fixed
  ``decoder.rand_noise`` buffer at offset = current estimator cache length.

A batched runner can supply the estimator K/V per row: ``DiTAttention.qkv`` gives the new
chunk's q, k, v and ``DiTAttention.attend`` runs attention over any keys; ``DiTBlock`` splits
into ``modulation`` / ``attention_input`` / ``finish`` around them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# Token2wav.stream keeps this many of the oldest estimator/conformer cache frames.
PROMPT_TAIL_FRAMES = 100


@dataclass(frozen=True)
class FlowConfig:
    """Hyperparameters of the flow model (names follow the reference constructors)."""

    vocab_size: int = 6561
    input_size: int = 512  # token embedding width = conformer input width
    output_size: int = 80  # mel bins
    spk_embed_dim: int = 192
    # conformer encoder
    encoder_output_size: int = 512
    encoder_heads: int = 8
    encoder_linear_units: int = 2048
    num_blocks: int = 6
    num_up_blocks: int = 4
    pre_lookahead_len: int = 3
    up_stride: int = 2
    up_scale_factor: float = 2.0
    key_bias: bool = True
    max_pos_len: int = 5000
    # DiT estimator
    dit_in_channels: int = 320
    dit_hidden_size: int = 512
    dit_depth: int = 16
    dit_heads: int = 8
    dit_head_dim: int = 64
    dit_mlp_ratio: float = 4.0
    # solver
    inference_cfg_rate: float = 0.7
    n_timesteps: int = 10
    noise_frames: int = 50 * 600  # the reference's 600 s noise buffer
    noise_seed: int = 0

    def __post_init__(self) -> None:
        if self.dit_in_channels != 4 * self.output_size:
            raise ValueError(
                f"dit_in_channels ({self.dit_in_channels}) must be 4 * output_size "
                f"({self.output_size}): x, mu, spk and cond are stacked on channels"
            )
        if self.encoder_output_size % self.encoder_heads:
            raise ValueError("encoder_output_size must be divisible by encoder_heads")
        if self.inference_cfg_rate <= 0:
            raise ValueError("inference_cfg_rate must be > 0 (the solver always runs CFG)")
        if self.n_timesteps < 1 or self.pre_lookahead_len < 1 or self.up_stride < 1:
            raise ValueError("n_timesteps, pre_lookahead_len and up_stride must be >= 1")

    @classmethod
    def minicpmo45(cls) -> "FlowConfig":
        return cls()

    @classmethod
    def tiny(cls) -> "FlowConfig":
        return cls(
            input_size=64, encoder_output_size=64, encoder_heads=2, encoder_linear_units=128,
            num_blocks=2, num_up_blocks=1, dit_hidden_size=64, dit_depth=2, dit_heads=2,
            dit_head_dim=32, max_pos_len=1000, noise_frames=2000,
        )


# ----------------------------------------------------------------------------------------
# Conformer encoder (UpsampleConformerEncoderV2)
# ----------------------------------------------------------------------------------------


def _rel_pos_table(d_model: int, max_len: int) -> torch.Tensor:
    """ESPnet relative positions, (1, 2*max_len - 1, d_model): +max_len-1 .. 0 .. -(max_len-1)."""
    cpu = torch.device("cpu")  # explicit: a default-device context must not change the table
    position = torch.arange(0, max_len, dtype=torch.float32, device=cpu).unsqueeze(1)  # (L, 1)
    div_term = torch.exp(
        torch.arange(0, d_model, 2, dtype=torch.float32, device=cpu) * -(math.log(10000.0) / d_model)
    )
    pos = torch.zeros(max_len, d_model, device=cpu)
    neg = torch.zeros(max_len, d_model, device=cpu)
    pos[:, 0::2] = torch.sin(position * div_term)
    pos[:, 1::2] = torch.cos(position * div_term)
    neg[:, 0::2] = torch.sin(-1 * position * div_term)
    neg[:, 1::2] = torch.cos(-1 * position * div_term)
    # positive offsets reversed, then negative offsets without the shared zero
    return torch.cat([torch.flip(pos, [0]), neg[1:]], dim=0).unsqueeze(0)


class RelPositionalEncoding(nn.Module):
    """Scales the input by sqrt(d) and serves centred windows of the relative table."""

    def __init__(self, d_model: int, max_len: int):
        super().__init__()
        self.xscale = math.sqrt(d_model)
        device = torch.empty(0).device
        if device.type == "meta":
            pe = torch.empty(1, 2 * max_len - 1, d_model, device=device)
        else:
            # computed on CPU as the reference does, so every device sees the same table
            pe = _rel_pos_table(d_model, max_len).to(device)
        self.register_buffer("pe", pe, persistent=False)  # not in the reference state dict

    def position_encoding(self, size: int) -> torch.Tensor:
        """(1, 2*size - 1, d): relative positions size-1 .. -(size-1)."""
        centre = self.pe.size(1) // 2
        if size > centre + 1:
            raise ValueError(f"sequence of {size} frames exceeds max_pos_len {centre + 1}")
        return self.pe[:, centre - size + 1: centre + size]


class LinearNoSubsampling(nn.Module):
    """Linear + LayerNorm input layer (names: out.0, out.1), then the x-scale."""

    def __init__(self, idim: int, odim: int, max_pos_len: int):
        super().__init__()
        self.out = nn.Sequential(nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5))
        self.pos_enc = RelPositionalEncoding(odim, max_pos_len)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.pos_enc.xscale

    def position_encoding(self, size: int) -> torch.Tensor:
        return self.pos_enc.position_encoding(size)


class RelPositionMultiHeadedAttention(nn.Module):
    """Transformer-XL style attention with ESPnet relative positions and a K|V cache."""

    def __init__(self, n_head: int, n_feat: int, key_bias: bool = True):
        super().__init__()
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat, bias=key_bias)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(n_head, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(n_head, self.d_k))
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)

    @staticmethod
    def rel_shift(x: torch.Tensor) -> torch.Tensor:
        """(b, h, t1, 2*t2 - 1) scores by relative offset -> (b, h, t1, t2) by key index."""
        b, h, t1, n = x.shape
        zero_pad = torch.zeros((b, h, t1, 1), device=x.device, dtype=x.dtype)
        x_padded = torch.cat([zero_pad, x], dim=-1).view(b, h, n + 1, t1)
        return x_padded[:, :, 1:].view_as(x)[:, :, :, : n // 2 + 1]

    def forward(
        self, x: torch.Tensor, pos_emb: torch.Tensor, cache: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (b, t1, d); pos_emb (1, 2*t2 - 1, d); cache (b, h, t2 - t1, 2*d_k) or None."""
        out, caches = self.forward_segments(x, [pos_emb], [cache], [x.size(0)])
        return out, caches[0]

    def forward_segments(
        self, x: torch.Tensor, pos_embs: list[torch.Tensor], caches: list[torch.Tensor | None], sizes: list[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Rows in consecutive segments of ``sizes`` rows, each with its own cache length: the
        projections run once over every row (they see one frame at a time); the attention runs per
        segment, over its keys ``[cache | new]`` with its relative positions ``pos_embs[i]``.
        One segment is ``forward``. Returns the output (b, t1, d) and each segment's new cache."""
        b = x.size(0)
        if sum(sizes) != b:
            raise ValueError(f"segments of {sizes} rows for a batch of {b}")
        q = self.linear_q(x).view(b, -1, self.h, self.d_k)  # (b, t1, h, d_k)
        k = self.linear_k(x).view(b, -1, self.h, self.d_k).transpose(1, 2)  # (b, h, t1, d_k)
        v = self.linear_v(x).view(b, -1, self.h, self.d_k).transpose(1, 2)
        q_u = (q + self.pos_bias_u).transpose(1, 2)  # (b, h, t1, d_k)
        q_v = (q + self.pos_bias_v).transpose(1, 2)
        outs, new_caches, start = [], [], 0
        for size, pos_emb, cache in zip(sizes, pos_embs, caches, strict=True):
            rows = slice(start, start + size)
            start += size
            out, new_cache = self._attend(q_u[rows], q_v[rows], k[rows], v[rows], pos_emb, cache)
            outs.append(out)
            new_caches.append(new_cache)
        out = outs[0] if len(outs) == 1 else torch.cat(outs)   # (b, h, t1, d_k)
        out = out.transpose(1, 2).contiguous().view(b, -1, self.h * self.d_k)
        return self.linear_out(out), new_caches

    def _attend(self, q_u: torch.Tensor, q_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                pos_emb: torch.Tensor, cache: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One segment's attention: q_u/q_v/k/v (n, h, t1, d_k) -> (n, h, t1, d_k), new cache."""
        if cache is not None and cache.size(0) > 0:
            k_cache, v_cache = torch.split(cache, cache.size(-1) // 2, dim=-1)
            k = torch.cat([k_cache, k], dim=2)  # keys: [cache | new]
            v = torch.cat([v_cache, v], dim=2)
        new_cache = torch.cat((k, v), dim=-1)  # (n, h, t2, 2*d_k)

        p = self.linear_pos(pos_emb).view(pos_emb.size(0), -1, self.h, self.d_k).transpose(1, 2)
        matrix_ac = torch.matmul(q_u, k.transpose(-2, -1))  # (n, h, t1, t2)
        matrix_bd = torch.matmul(q_v, p.transpose(-2, -1))  # (n, h, t1, 2*t2 - 1)
        if matrix_ac.shape != matrix_bd.shape:
            matrix_bd = self.rel_shift(matrix_bd)
        scores = (matrix_ac + matrix_bd) / math.sqrt(self.d_k)
        attn = torch.softmax(scores, dim=-1)
        return torch.matmul(attn, v), new_cache


class PositionwiseFeedForward(nn.Module):
    def __init__(self, idim: int, hidden_units: int):
        super().__init__()
        self.w_1 = nn.Linear(idim, hidden_units)
        self.activation = nn.SiLU()  # "swish"
        self.w_2 = nn.Linear(hidden_units, idim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(self.activation(self.w_1(x)))


class ConformerEncoderLayer(nn.Module):
    """Pre-norm self-attention + feed-forward (no macaron, no conv module, as configured)."""

    def __init__(self, size: int, heads: int, linear_units: int, key_bias: bool):
        super().__init__()
        self.self_attn = RelPositionMultiHeadedAttention(heads, size, key_bias)
        self.feed_forward = PositionwiseFeedForward(size, linear_units)
        self.norm_ff = nn.LayerNorm(size, eps=1e-12)
        self.norm_mha = nn.LayerNorm(size, eps=1e-12)

    def forward(
        self, x: torch.Tensor, pos_emb: torch.Tensor, att_cache: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, caches = self.forward_segments(x, [pos_emb], [att_cache], [x.size(0)])
        return x, caches[0]

    def forward_segments(
        self, x: torch.Tensor, pos_embs: list[torch.Tensor], att_caches: list[torch.Tensor | None], sizes: list[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``forward`` over rows in segments with their own cache lengths (the attention's
        ``forward_segments``); the norms and the feed-forward run once over every row."""
        x_att, new_att_caches = self.self_attn.forward_segments(self.norm_mha(x), pos_embs, att_caches, sizes)
        x = x + x_att
        x = x + self.feed_forward(self.norm_ff(x))
        return x, new_att_caches


class Upsample1D(nn.Module):
    """Nearest x`scale_factor` repeat, then a causal conv of width 2*stride + 1."""

    def __init__(self, channels: int, out_channels: int, stride: int, scale_factor: float):
        super().__init__()
        self.channels = channels
        self.stride = stride
        self.scale_factor = float(scale_factor)
        self.conv = nn.Conv1d(channels, out_channels, stride * 2 + 1, stride=1, padding=0)

    def forward_chunk(
        self, x: torch.Tensor, cache: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (b, c, t) -> (b, c, t*scale); cache (b, c, 2*stride) of repeated input frames."""
        out = F.interpolate(x, scale_factor=self.scale_factor, mode="nearest")
        if cache is None:
            cache = x.new_zeros(x.shape[0], x.shape[1], self.stride * 2)
        out = torch.cat([cache, out], dim=2)
        new_cache = out[..., -self.stride * 2:]
        return self.conv(out), new_cache


class PreLookaheadLayer(nn.Module):
    """Conv over `pre_lookahead_len` future tokens, then a causal conv; residual."""

    def __init__(self, channels: int, pre_lookahead_len: int):
        super().__init__()
        self.pre_lookahead_len = pre_lookahead_len
        self.conv1 = nn.Conv1d(channels, channels, kernel_size=pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=3)

    def forward_chunk(
        self, inputs: torch.Tensor, cache: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """inputs (b, t, c) -> (b, t - lookahead, c); cache (b, c, 2) of conv1 outputs."""
        out = inputs.transpose(1, 2).contiguous()
        out = F.leaky_relu(self.conv1(out))  # (b, c, t - lookahead)
        if cache is None:
            cache = out.new_zeros(out.shape[0], out.shape[1], 2)
        new_cache = out[..., -2:]
        out = self.conv2(torch.cat([cache, out], dim=2))
        out = out.transpose(1, 2).contiguous()
        return out + inputs[:, : -self.pre_lookahead_len], new_cache


class UpsampleConformerEncoderV2(nn.Module):
    """Token-rate conformer -> 2x upsample -> frame-rate conformer, streaming only."""

    def __init__(self, cfg: FlowConfig):
        super().__init__()
        d = cfg.encoder_output_size
        self._output_size = d
        self.embed = LinearNoSubsampling(cfg.input_size, d, cfg.max_pos_len)
        self.after_norm = nn.LayerNorm(d, eps=1e-5)
        self.pre_lookahead_layer = PreLookaheadLayer(d, cfg.pre_lookahead_len)
        self.encoders = nn.ModuleList(
            ConformerEncoderLayer(d, cfg.encoder_heads, cfg.encoder_linear_units, cfg.key_bias)
            for _ in range(cfg.num_blocks)
        )
        self.up_layer = Upsample1D(d, d, cfg.up_stride, cfg.up_scale_factor)
        # the reference builds up_embed with input_size; equal to d in every real config
        self.up_embed = LinearNoSubsampling(cfg.input_size, d, cfg.max_pos_len)
        self.up_encoders = nn.ModuleList(
            ConformerEncoderLayer(d, cfg.encoder_heads, cfg.encoder_linear_units, cfg.key_bias)
            for _ in range(cfg.num_up_blocks)
        )

    def output_size(self) -> int:
        return self._output_size

    def forward_chunk(
        self,
        xs: torch.Tensor,
        last_chunk: bool = False,
        cnn_cache: torch.Tensor | None = None,
        att_cache: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """xs (b, t, input_size) with lookahead -> (b, 2*(t - lookahead), d), caches.

        On the last chunk the lookahead is zero-padded, so the output is 2*t frames.
        """
        xs, cnn, att = self.forward_chunk_segments(xs, last_chunk, cnn_cache, [att_cache], [xs.shape[0]])
        return xs, cnn, att[0]

    def forward_chunk_segments(
        self,
        xs: torch.Tensor,
        last_chunk: bool,
        cnn_cache: torch.Tensor | None,
        att_caches: list[torch.Tensor | None],
        sizes: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """``forward_chunk`` over rows in consecutive segments of ``sizes`` rows, segment i with
        its own attention cache ``att_caches[i]`` (layers, n_i, heads, T_i, 2*d_k), so rows whose
        caches differ in length share one call: everything that sees one frame at a time (the
        embeddings, norms, projections, feed-forwards, the convolutions over the equal-shaped cnn
        caches) runs once over every row, the attention once per segment. Returns the output, the
        new cnn cache (b, C, 6) and each segment's new attention cache."""
        n_enc = len(self.encoders)
        if len(sizes) != len(att_caches) or sum(sizes) != xs.shape[0] or min(sizes, default=0) < 1:
            raise ValueError(f"segments of {sizes} rows with {len(att_caches)} caches for a batch of {xs.shape[0]}")
        if cnn_cache is not None and cnn_cache.shape[2] != 2 + self.up_layer.stride * 2:
            raise ValueError(f"conformer cnn cache must hold {2 + self.up_layer.stride * 2} frames")
        offsets1, caches1, caches2 = [], [], []
        for att_cache in att_caches:
            if att_cache is not None and att_cache.shape[3] % 2:
                raise ValueError(f"conformer att cache time axis must be even, got {tuple(att_cache.shape)}")
            offset1 = att_cache.shape[3] // 2 if att_cache is not None else 0
            offsets1.append(offset1)
            # first half of the token-rate caches (they are stored tiled twice)
            caches1.append(att_cache[:n_enc, :, :, :offset1] if att_cache is not None else [None] * n_enc)
            caches2.append(att_cache[n_enc:] if att_cache is not None else [None] * len(self.up_encoders))
        cnn_cache1 = cnn_cache[:, :, :2] if cnn_cache is not None else None
        cnn_cache2 = cnn_cache[:, :, 2:] if cnn_cache is not None else None

        xs = self.embed(xs)  # (b, t, d)
        if last_chunk:
            xs = F.pad(xs, (0, 0, 0, self.pre_lookahead_layer.pre_lookahead_len))
        xs, new_cnn_cache1 = self.pre_lookahead_layer.forward_chunk(xs, cnn_cache1)

        # NOTE: the reference takes both tables from `embed` (they are equal anyway)
        pos_embs = [self.embed.position_encoding(offset1 + xs.shape[1]) for offset1 in offsets1]
        new_att_caches1: list[list[torch.Tensor]] = [[] for _ in sizes]
        for idx, layer in enumerate(self.encoders):
            xs, new = layer.forward_segments(xs, pos_embs, [c[idx] for c in caches1], sizes)
            for seg, c in zip(new_att_caches1, new):
                seg.append(c)

        xs, new_cnn_cache2 = self.up_layer.forward_chunk(xs.transpose(1, 2).contiguous(), cnn_cache2)
        xs = self.up_embed(xs.transpose(1, 2).contiguous())  # (b, 2t, d)

        pos_embs = [self.embed.position_encoding(offset1 * self.up_layer.stride + xs.shape[1])
                    for offset1 in offsets1]
        new_att_caches2: list[list[torch.Tensor]] = [[] for _ in sizes]
        for idx, layer in enumerate(self.up_encoders):
            xs, new = layer.forward_segments(xs, pos_embs, [c[idx] for c in caches2], sizes)
            for seg, c in zip(new_att_caches2, new):
                seg.append(c)
        xs = self.after_norm(xs)

        new_att_caches = [
            torch.cat([torch.stack(c1, dim=0).repeat(1, 1, 1, 2, 1), torch.stack(c2, dim=0)], dim=0)
            for c1, c2 in zip(new_att_caches1, new_att_caches2)
        ]
        new_cnn_cache = torch.cat([new_cnn_cache1, new_cnn_cache2], dim=2)
        return xs, new_cnn_cache, new_att_caches


# ----------------------------------------------------------------------------------------
# DiT estimator
# ----------------------------------------------------------------------------------------


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden_features: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DiTAttention(nn.Module):
    """Multi-head attention with q/k LayerNorm, split so keys can come from outside.

    ``forward_chunk`` = ``qkv`` -> keys ``[new | cache]`` -> ``attend``.
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.inner_dim = num_heads * head_dim
        self.to_q = nn.Linear(dim, self.inner_dim, bias=True)
        self.to_k = nn.Linear(dim, self.inner_dim, bias=True)
        self.to_v = nn.Linear(dim, self.inner_dim, bias=True)
        self.q_norm = nn.LayerNorm(head_dim)
        self.k_norm = nn.LayerNorm(head_dim)
        self.proj = nn.Linear(self.inner_dim, dim)

    def _to_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        return x.reshape(b, t, self.num_heads, c // self.num_heads).transpose(1, 2)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (b, t, dim) -> q, k, v each (b, heads, t, head_dim), q and k normed."""
        q = self.q_norm(self._to_heads(self.to_q(x)))
        k = self.k_norm(self._to_heads(self.to_k(x)))
        v = self._to_heads(self.to_v(x))
        return q, k, v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q (b, h, t, hd); k, v (b, h, T, hd); mask (b, t, T) bool or None -> (b, t, dim)."""
        b, _, t, _ = q.shape
        if mask is not None:
            mask = mask.unsqueeze(1)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (b, h, t, hd)
        return self.proj(x.transpose(1, 2).reshape(b, t, -1))

    def forward_chunk(
        self, x: torch.Tensor, att_cache: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (b, t, dim); att_cache (b, h, T, 2*hd) -> out, new cache (b, h, t + T, 2*hd)."""
        q, k, v = self.qkv(x)
        if att_cache is not None:
            k_cache, v_cache = att_cache.chunk(2, dim=3)
            k = torch.cat([k, k_cache], dim=2)  # keys: [new | cache]
            v = torch.cat([v, v_cache], dim=2)
        new_att_cache = torch.cat([k, v], dim=3)
        return self.attend(q, k, v, mask), new_att_cache


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size)
        )
        self.frequency_embedding_size = frequency_embedding_size
        self.scale = 1000

    @staticmethod
    def timestep_embedding(t: torch.Tensor, dim: int, max_period: int = 10000) -> torch.Tensor:
        """t (n,) -> (n, dim) sinusoidal; frequencies built on CPU like the reference."""
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(start=0, end=half) / half).to(t)
        args = t[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
        return emb

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.timestep_embedding(t * self.scale, self.frequency_embedding_size))


class Transpose(nn.Module):
    def __init__(self, dim0: int, dim1: int):
        super().__init__()
        self.dim0, self.dim1 = dim0, dim1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.transpose(x, self.dim0, self.dim1)


class CausalConv1d(nn.Conv1d):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__(in_channels, out_channels, kernel_size)
        self.cache_len = kernel_size - 1

    def forward_chunk(
        self, x: torch.Tensor, cnn_cache: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (b, c, t); cnn_cache (b, c, k-1) of earlier inputs (zeros at the start)."""
        if cnn_cache is None:
            cnn_cache = x.new_zeros((x.shape[0], self.in_channels, self.cache_len))
        x = torch.cat([cnn_cache, x], dim=2)
        new_cnn_cache = x[..., -self.cache_len:]
        return super().forward(x), new_cnn_cache


class CausalConvBlock(nn.Module):
    """conv -> LayerNorm -> Mish -> conv, in a Sequential so names match (block.1/3/6)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.block = nn.Sequential(
            Transpose(1, 2), CausalConv1d(in_channels, out_channels, kernel_size), Transpose(1, 2),
            nn.LayerNorm(out_channels), nn.Mish(),
            Transpose(1, 2), CausalConv1d(out_channels, out_channels, kernel_size), Transpose(1, 2),
        )

    def forward_chunk(
        self, x: torch.Tensor, cnn_cache: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (b, t, c); cnn_cache (b, c_in + c_out, k-1) -> out, new cache."""
        c1 = c2 = None
        if cnn_cache is not None:
            c1, c2 = cnn_cache.split((self.in_channels, self.out_channels), dim=1)
        x = self.block[0](x)
        x, n1 = self.block[1].forward_chunk(x, c1)
        x = self.block[2:6](x)
        x, n2 = self.block[6].forward_chunk(x, c2)
        x = self.block[7](x)
        return x, torch.cat((n1, n2), dim=1)


class DiTBlock(nn.Module):
    """adaLN-zero block: attention, causal conv, MLP (in that order)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, mlp_ratio: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = DiTAttention(hidden_size, num_heads, head_dim)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = MLP(hidden_size, int(hidden_size * mlp_ratio))
        self.norm3 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.conv = CausalConvBlock(hidden_size, hidden_size, kernel_size=3)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 9 * hidden_size))

    def modulation(self, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """c (b, 1, hidden) -> 9 tensors (b, 1, hidden): shift/scale/gate for msa, mlp, conv."""
        return self.adaLN_modulation(c).chunk(9, dim=-1)

    def attention_input(self, x: torch.Tensor, mod: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return modulate(self.norm1(x), mod[0], mod[1])

    def finish(
        self, x: torch.Tensor, x_att: torch.Tensor, mod: tuple[torch.Tensor, ...],
        cnn_cache: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention residual, then conv and MLP sub-blocks -> (x, new cnn cache)."""
        _, _, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_conv, scale_conv, gate_conv = mod
        x = x + gate_msa * x_att
        x_conv, new_cnn_cache = self.conv.forward_chunk(modulate(self.norm3(x), shift_conv, scale_conv), cnn_cache)
        x = x + gate_conv * x_conv
        x = x + gate_mlp * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x, new_cnn_cache

    def forward_chunk(
        self, x: torch.Tensor, c: torch.Tensor, cnn_cache: torch.Tensor | None = None,
        att_cache: torch.Tensor | None = None, mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mod = self.modulation(c)
        x_att, new_att_cache = self.attn.forward_chunk(self.attention_input(x, mod), att_cache, mask)
        x, new_cnn_cache = self.finish(x, x_att, mod, cnn_cache)
        return x, new_cnn_cache, new_att_cache


class FinalLayer(nn.Module):
    def __init__(self, hidden_size: int, out_channels: int):
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, out_channels)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    """Velocity estimator over [x | mu | spk | cond] channels; no positional encoding."""

    def __init__(self, cfg: FlowConfig):
        super().__init__()
        self.in_channels = cfg.dit_in_channels
        self.out_channels = cfg.output_size
        self.t_embedder = TimestepEmbedder(cfg.dit_hidden_size)
        self.in_proj = nn.Linear(cfg.dit_in_channels, cfg.dit_hidden_size)
        self.blocks = nn.ModuleList(
            DiTBlock(cfg.dit_hidden_size, cfg.dit_heads, cfg.dit_head_dim, cfg.dit_mlp_ratio)
            for _ in range(cfg.dit_depth)
        )
        self.final_layer = FinalLayer(cfg.dit_hidden_size, self.out_channels)

    def embed_inputs(
        self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, mu, cond (b, 80, t); t (b,); spks (b, 80) -> hidden (b, t, H), c (b, 1, H)."""
        c = self.t_embedder(t).unsqueeze(1)
        spks = spks.unsqueeze(-1).expand(-1, -1, x.shape[-1])
        h = torch.cat([x, mu, spks, cond], dim=1)  # (b, 320, t)
        return self.in_proj(h.transpose(1, 2)), c

    def forward_chunk(
        self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
        cnn_cache: torch.Tensor | None = None, att_cache: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> velocity (b, 80, t), cnn cache (depth, b, 2H, 2), att cache (depth, b, h, t+T, 2hd)."""
        h, c = self.embed_inputs(x, mu, t, spks, cond)
        new_cnn, new_att = [], []
        for i, block in enumerate(self.blocks):
            h, cc, ac = block.forward_chunk(
                h, c, None if cnn_cache is None else cnn_cache[i], None if att_cache is None else att_cache[i]
            )
            new_cnn.append(cc)
            new_att.append(ac)
        out = self.final_layer(h, c).transpose(1, 2)
        return out, torch.stack(new_cnn, dim=0), torch.stack(new_att, dim=0)


# ----------------------------------------------------------------------------------------
# Flow matching solver and the token -> mel wrapper
# ----------------------------------------------------------------------------------------


def cosine_t_span(n_timesteps: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """t = 1 - cos(pi/2 * linspace(0, 1, n + 1))."""
    t_span = torch.linspace(0, 1, n_timesteps + 1, device=device, dtype=dtype)
    return 1 - torch.cos(t_span * 0.5 * torch.pi)


class CausalConditionalCFM(nn.Module):
    """Fixed-step Euler ODE solver with classifier-free guidance (rows [cond, uncond])."""

    def __init__(self, estimator: DiT, inference_cfg_rate: float = 0.7, noise_frames: int = 30000,
                 noise_seed: int = 0):
        super().__init__()
        self.estimator = estimator
        self.inference_cfg_rate = inference_cfg_rate
        self.out_channels = estimator.out_channels
        device = torch.empty(0).device
        if device.type == "meta":
            noise = torch.empty(1, self.out_channels, noise_frames, device=device)
        else:
            # Not in the checkpoint (the reference draws it from the global RNG at build
            # time); we draw it from a fixed seed so it is reproducible. verify copies it.
            gen = torch.Generator().manual_seed(noise_seed)
            noise = torch.randn(1, self.out_channels, noise_frames, generator=gen, device="cpu").to(device)
        self.register_buffer("rand_noise", noise, persistent=False)

    def solve_euler_chunk(
        self, x: torch.Tensor, t_span: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor,
        cond: torch.Tensor, cnn_cache: torch.Tensor | None, att_cache: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, dt = t_span[0].unsqueeze(0), t_span[1] - t_span[0]
        mu_in = torch.cat([mu, torch.zeros_like(mu)], dim=0)  # (2b, 80, t): cond rows, uncond rows
        spks_in = torch.cat([spks, torch.zeros_like(spks)], dim=0)
        cond_in = torch.cat([cond, torch.zeros_like(cond)], dim=0)
        new_cnn, new_att = [], []
        for step in range(1, len(t_span)):
            dphi_dt, cc, ac = self.estimator.forward_chunk(
                x.repeat(2, 1, 1), mu_in, t.repeat(2), spks_in, cond_in,
                None if cnn_cache is None else cnn_cache[step - 1],
                None if att_cache is None else att_cache[step - 1],
            )
            dphi_dt, cfg_dphi_dt = dphi_dt.chunk(2, dim=0)
            dphi_dt = (1.0 + self.inference_cfg_rate) * dphi_dt - self.inference_cfg_rate * cfg_dphi_dt
            x = x + dt * dphi_dt
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
            new_cnn.append(cc)
            new_att.append(ac)
        return x, torch.stack(new_cnn, dim=0), torch.stack(new_att, dim=0)

    @torch.inference_mode()
    def forward_chunk(
        self, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, n_timesteps: int = 10,
        temperature: float = 1.0, cnn_cache: torch.Tensor | None = None,
        att_cache: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mu, cond (b, 80, t); spks (b, 80); caches as in the module docstring."""
        offset = att_cache.shape[4] if att_cache is not None else 0
        if offset + mu.size(2) > self.rand_noise.size(2):
            raise ValueError(f"stream of {offset + mu.size(2)} frames exceeds the noise buffer")
        if att_cache is not None and att_cache.shape[0] < n_timesteps:
            raise ValueError(f"att cache holds {att_cache.shape[0]} steps, need {n_timesteps}")
        z = self.rand_noise[:, :, offset: offset + mu.size(2)] * temperature
        t_span = cosine_t_span(n_timesteps, mu.device, mu.dtype)
        return self.solve_euler_chunk(z, t_span, mu, spks, cond, cnn_cache, att_cache)


class CausalMaskedDiffWithXvec(nn.Module):
    """Speech tokens + speaker x-vector -> mel, streamed chunk by chunk."""

    def __init__(self, cfg: FlowConfig):
        super().__init__()
        self.cfg = cfg
        self.input_size = cfg.input_size
        self.output_size = cfg.output_size
        self.vocab_size = cfg.vocab_size
        self.pre_lookahead_len = cfg.pre_lookahead_len
        self.up_rate = cfg.up_stride
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.encoder = UpsampleConformerEncoderV2(cfg)
        self.encoder_proj = nn.Linear(self.encoder.output_size(), cfg.output_size)
        self.decoder = CausalConditionalCFM(
            DiT(cfg), cfg.inference_cfg_rate, cfg.noise_frames, cfg.noise_seed
        )

    def _check_tokens(self, token: torch.Tensor) -> None:
        if token.dim() != 2:
            raise ValueError(f"token must be (batch, time), got {tuple(token.shape)}")
        if token.numel() and (int(token.min()) < 0 or int(token.max()) >= self.vocab_size):
            raise ValueError(f"speech token ids must lie in [0, {self.vocab_size})")

    def _encode(self, token: torch.Tensor, spk: torch.Tensor, last_chunk: bool,
                cnn_cache: torch.Tensor | None, att_cache: torch.Tensor | None):
        self._check_tokens(token)
        spk = self.spk_embed_affine_layer(F.normalize(spk, dim=1))  # (b, 80)
        h, cnn, att = self.encoder.forward_chunk(self.input_embedding(token), last_chunk, cnn_cache, att_cache)
        return self.encoder_proj(h), spk, cnn, att  # h (b, t_mel, 80)

    @torch.inference_mode()
    def setup_cache(self, token: torch.Tensor, mel: torch.Tensor, spk: torch.Tensor,
                    n_timesteps: int = 10) -> dict[str, torch.Tensor]:
        """Run the voice prompt. token (b, t) incl. lookahead; mel (b, 2*(t - la), 80); spk (b, 192)."""
        if (token.shape[1] - self.pre_lookahead_len) * self.up_rate != mel.shape[1]:
            raise ValueError(
                f"prompt mel has {mel.shape[1]} frames; (tokens {token.shape[1]} - lookahead "
                f"{self.pre_lookahead_len}) * {self.up_rate} expected"
            )
        h, spk, ccnn, catt = self._encode(token, spk, False, None, None)
        _, ecnn, eatt = self.decoder.forward_chunk(
            h.transpose(1, 2).contiguous(), spk, mel.transpose(1, 2).contiguous(), n_timesteps, 1.0, None, None
        )
        return {"conformer_cnn_cache": ccnn, "conformer_att_cache": catt,
                "estimator_cnn_cache": ecnn, "estimator_att_cache": eatt}

    @torch.inference_mode()
    def inference_chunk(self, token: torch.Tensor, spk: torch.Tensor, cache: dict[str, torch.Tensor],
                        last_chunk: bool = False, n_timesteps: int = 10
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """token (b, t) incl. lookahead (unless last) -> mel (b, 80, t_mel), new cache."""
        h, spk, ccnn, catt = self._encode(
            token, spk, last_chunk, cache["conformer_cnn_cache"], cache["conformer_att_cache"]
        )
        cond = torch.zeros_like(h)
        feat, ecnn, eatt = self.decoder.forward_chunk(
            h.transpose(1, 2).contiguous(), spk, cond.transpose(1, 2).contiguous(), n_timesteps, 1.0,
            cache["estimator_cnn_cache"], cache["estimator_att_cache"],
        )
        return feat, {"conformer_cnn_cache": ccnn, "conformer_att_cache": catt,
                      "estimator_cnn_cache": ecnn, "estimator_att_cache": eatt}


def trim_stream_cache(cache: dict[str, torch.Tensor], prompt_frames: int,
                      tail: int = PROMPT_TAIL_FRAMES) -> dict[str, torch.Tensor]:
    """Token2wav.stream's cache bound, applied after each chunk.

    Once a cache's time axis is longer than P + tail, keep its first P and its last `tail`
    entries (estimator: newest P frames + prompt tail; conformer: same cut on its axis)::

        estimator  [ new ... | ... | prompt ]  ->  [ first P ][ last tail ]
    """
    out = dict(cache)
    att = cache["estimator_att_cache"]  # (steps, depth, 2, h, T, 2hd)
    if att.shape[4] > prompt_frames + tail:
        out["estimator_att_cache"] = torch.cat([att[:, :, :, :, :prompt_frames], att[:, :, :, :, -tail:]], dim=4)
    catt = cache["conformer_att_cache"]  # (layers, b, h, T, 2dk)
    if catt.shape[3] > prompt_frames + tail:
        out["conformer_att_cache"] = torch.cat([catt[:, :, :, :prompt_frames, :], catt[:, :, :, -tail:, :]], dim=3)
    return out


def build_flow(cfg: FlowConfig, device: torch.device | str | None = None) -> CausalMaskedDiffWithXvec:
    """Construct in eval mode; device='meta' builds shapes only."""
    with torch.device(device or "cpu"):
        model = CausalMaskedDiffWithXvec(cfg)
    return model.eval()
