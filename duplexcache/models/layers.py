"""Building blocks shared by the Thinker (Qwen3) and the Talker (Llama backbone).

Both are pre-norm decoders with the same layer::

    x -> input_layernorm -> self_attn (q/k/v proj, [per-head q/k norm], NeoX RoPE, GQA, o_proj) -> + x
      -> post_attention_layernorm -> SwiGLU MLP -> + residual

The only difference is Qwen3's per-head RMSNorm on q and k before RoPE, which the Thinker adds
by subclassing ``GQAttention`` (overriding ``norm_qk``) rather than by a flag here.

Attribute names are those of transformers (``q_proj``, ``gate_proj``, ``input_layernorm``, ...)
and are registered in transformers' order, so state dicts load strictly and list in the same
key order. ``MultiModalProjector`` is MiniCPM-o's Linear-ReLU-Linear, used by the audio
encoder and by the Talker's projectors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from duplexcache.kv.paged_attention import PagedBatch, PagedKVCache, paged_attention, write_kv
from duplexcache.kv.rope import apply_rope

__all__ = ["DecoderLayer", "GQAttention", "MultiModalProjector", "RMSNorm", "SwiGLUMLP", "check_paged_step"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, scale in the input dtype (same order of casts as transformers).
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases (Qwen3MLP / LlamaMLP)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GQAttention(nn.Module):
    """Grouped-query self-attention with NeoX RoPE, dense or over a paged KV cache.

    ``forward(x, cos, sin)`` without a batch is the dense causal path, x (B, T, hidden);
    with ``batch`` and ``cache`` it is one ragged paged step, x (N, hidden): the new K/V are
    written to their slots first, then every token attends to its own sequence's cache.
    ``cos``/``sin`` are rope tables of shape (*x.shape[:-1], head_dim) (any float dtype; they
    are cast to the activation dtype, which is what transformers does).
    """

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int, bias: bool = False
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"GQAttention: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.layer_idx = layer_idx  # which layer of the shared PagedKVCache this module owns
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook applied to (..., heads, head_dim) q and k before RoPE; Llama has none."""
        return q, k

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        q, k = self.norm_qk(q, k)
        cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)  # broadcast over heads
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: PagedBatch | None = None,
        cache: PagedKVCache | None = None,
    ) -> torch.Tensor:
        if batch is None:
            return self._forward_dense(x, cos, sin)
        q, k, v = self._qkv(x, cos, sin)  # (N, h, D)
        write_kv(cache, self.layer_idx, k, v, batch.slot_mapping)
        out = paged_attention(q, cache, self.layer_idx, batch, self.scale)  # (N, Hq, D)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def _forward_dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)  # (B, T, h, D)
        group = self.num_heads // self.num_kv_heads
        q = q.transpose(1, 2)  # (B, Hq, T, D)
        k = k.repeat_interleave(group, dim=2).transpose(1, 2)
        v = v.repeat_interleave(group, dim=2).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DecoderLayer(nn.Module):
    """Pre-norm residual layer around a given attention module and MLP."""

    def __init__(self, self_attn: GQAttention, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        # Registration order = transformers' state-dict key order.
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: PagedBatch | None = None,
        cache: PagedKVCache | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class MultiModalProjector(nn.Module):
    """MiniCPM-o's projector: Linear(in, out), ReLU, Linear(out, out)."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(in_dim, out_dim)
        self.relu = nn.ReLU()
        self.linear2 = nn.Linear(out_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.relu(self.linear1(x)))


def check_paged_step(
    who: str,
    inputs_embeds: torch.Tensor,
    batch: PagedBatch,
    cache: PagedKVCache,
    *,
    hidden_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """ValueError unless ``inputs_embeds`` is (batch.num_tokens, hidden_size) and ``cache`` is
    shaped for the model (layers, kv heads, head_dim) with the batch's block size."""
    if tuple(inputs_embeds.shape) != (batch.num_tokens, hidden_size):
        raise ValueError(
            f"{who}.forward_paged: inputs_embeds must be (N={batch.num_tokens}, {hidden_size}), "
            f"got {tuple(inputs_embeds.shape)}"
        )
    cache_shape = (cache.num_layers, cache.num_kv_heads, cache.head_dim)
    model_shape = (num_layers, num_kv_heads, head_dim)
    if cache_shape != model_shape:
        raise ValueError(
            f"{who}.forward_paged: KV cache (layers, kv heads, head_dim) {cache_shape} != model {model_shape}"
        )
    if cache.block_size != batch.block_size:
        raise ValueError(
            f"{who}.forward_paged: batch block_size {batch.block_size} != cache block_size {cache.block_size}"
        )
