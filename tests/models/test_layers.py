"""models/layers.py: the decoder pieces shared by the Thinker and the Talker (CPU, float32)."""

from __future__ import annotations

import math

import pytest
import torch

from duplexcache.kv.paged_attention import PagedBatch, PagedKVCache
from duplexcache.kv.rope import rope_cos_sin
from duplexcache.models.layers import GQAttention, RMSNorm, SwiGLUMLP, check_paged_step
from duplexcache.models.thinker import ThinkerAttention, ThinkerConfig

H, HEADS, KV_HEADS, D = 32, 4, 2, 8


def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen) + (1.0 if p.dim() == 1 else 0.0))


def _reference_attention(attn: GQAttention, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The same layer written out per head with an explicit causal softmax, x (T, hidden)."""
    t = x.shape[0]
    q = (x @ attn.q_proj.weight.T).view(t, HEADS, D)
    k = (x @ attn.k_proj.weight.T).view(t, KV_HEADS, D)
    v = (x @ attn.v_proj.weight.T).view(t, KV_HEADS, D)
    q, k = attn.norm_qk(q, k)
    ang = positions[:, None].float() * (10000.0 ** (-torch.arange(0, D, 2).float() / D))  # (T, D/2)
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]

    def rot(a):  # pair i with i + D/2
        a1, a2 = a[..., : D // 2], a[..., D // 2 :]
        return torch.cat([a1 * cos - a2 * sin, a2 * cos + a1 * sin], dim=-1)

    q, k = rot(q), rot(k)
    out = torch.empty(t, HEADS, D)
    for h in range(HEADS):
        kv = h // (HEADS // KV_HEADS)
        scores = q[:, h] @ k[:, kv].T / math.sqrt(D)
        scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
        out[:, h] = scores.softmax(-1) @ v[:, kv]
    return out.reshape(t, -1) @ attn.o_proj.weight.T


@pytest.mark.parametrize("with_qk_norm", [False, True])
def test_attention_dense_and_paged_match_written_out_reference(with_qk_norm):
    if with_qk_norm:
        cfg = ThinkerConfig(vocab_size=10, hidden_size=H, intermediate_size=48, num_hidden_layers=1,
                            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=D, rope_theta=10000.0)
        attn = ThinkerAttention(cfg, layer_idx=0)
    else:
        attn = GQAttention(H, HEADS, KV_HEADS, D, layer_idx=0)
    _randomize(attn, seed=1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(11, H, generator=gen)
    pos = torch.arange(11)
    want = _reference_attention(attn, x, pos)
    cos, sin = rope_cos_sin(pos, D, 10000.0)
    with torch.no_grad():
        dense = attn(x[None], cos[None], sin[None])[0]
        cache = PagedKVCache(1, 6, 4, KV_HEADS, D)
        batch = PagedBatch.build([[5, 2, 4]], [0], [11], None, 4, "cpu")
        paged = attn(x, cos, sin, batch, cache)
    assert torch.allclose(dense, want, rtol=1e-5, atol=1e-6)
    assert torch.allclose(paged, want, rtol=1e-5, atol=1e-6)


def test_qwen3_attention_adds_only_the_qk_norms():
    cfg = ThinkerConfig(vocab_size=10, hidden_size=H, intermediate_size=48, num_hidden_layers=1,
                        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=D)
    plain = [k for k in GQAttention(H, HEADS, KV_HEADS, D, 0).state_dict()]
    qwen3 = [k for k in ThinkerAttention(cfg, 0).state_dict()]
    assert plain == ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"]
    assert qwen3 == plain + ["q_norm.weight", "k_norm.weight"]


def test_rmsnorm_and_swiglu_match_formulas():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, H, generator=gen)
    norm, mlp = RMSNorm(H, 1e-6), SwiGLUMLP(H, 48)
    _randomize(norm, 4)
    _randomize(mlp, 5)
    want_norm = norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    gate, up = x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T
    want_mlp = (gate * torch.sigmoid(gate) * up) @ mlp.down_proj.weight.T
    with torch.no_grad():
        assert torch.allclose(norm(x), want_norm, rtol=1e-5, atol=1e-6)
        assert torch.allclose(mlp(x), want_mlp, rtol=1e-5, atol=1e-6)


def test_bad_head_counts_and_paged_inputs_raise():
    with pytest.raises(ValueError, match="num_kv_heads"):
        GQAttention(H, 3, 2, D, 0)
    cache = PagedKVCache(2, 4, 4, KV_HEADS, D)
    batch = PagedBatch.build([[1, 2]], [0], [5], None, 4, "cpu")
    shape = dict(hidden_size=H, num_layers=2, num_kv_heads=KV_HEADS, head_dim=D)
    check_paged_step("M", torch.zeros(5, H), batch, cache, **shape)  # fits: no error
    with pytest.raises(ValueError, match=r"M.forward_paged: inputs_embeds must be \(N=5, 32\)"):
        check_paged_step("M", torch.zeros(4, H), batch, cache, **shape)
    with pytest.raises(ValueError, match="KV cache"):
        check_paged_step("M", torch.zeros(5, H), batch, cache, **{**shape, "num_layers": 3})
    with pytest.raises(ValueError, match="block_size"):
        check_paged_step("M", torch.zeros(5, H), batch, PagedKVCache(2, 4, 8, KV_HEADS, D), **shape)
