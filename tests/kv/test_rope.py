"""NeoX RoPE helpers against transformers' Qwen3 rotary code, and in-place key re-rotation."""

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from duplexcache.kv import rope
from duplexcache.kv.kv_quant import dequantize_fp8, quantize_fp8
from duplexcache.kv.rope import apply_rope, rerotate_keys_, rope_cos_sin

THETA = 1e6
D = 16


def hf_rope(x_bhtd: torch.Tensor, positions: torch.Tensor, theta: float = THETA):
    cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=x_bhtd.shape[-1],
                      rope_parameters={"rope_type": "default", "rope_theta": theta})
    cos, sin = Qwen3RotaryEmbedding(cfg)(x_bhtd, positions[None])
    out, _ = apply_rotary_pos_emb(x_bhtd, x_bhtd, cos, sin)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers_bit_exact(dtype):
    torch.manual_seed(0)
    pos = torch.tensor([0, 1, 7, 300, 8191, 123456])
    x = torch.randn(1, 3, len(pos), D).to(dtype)  # (B, H, T, D)
    cos, sin = rope_cos_sin(pos, D, THETA, dtype=dtype)  # (T, D)
    ours = apply_rope(x, cos[None, None], sin[None, None])
    assert torch.equal(ours, hf_rope(x, pos))


def rope_keys(raw: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """raw (T, H, D) -> RoPE at positions, float32."""
    cos, sin = rope_cos_sin(positions, raw.shape[-1], THETA)
    return apply_rope(raw, cos[:, None], sin[:, None])


def make_cache(layers=2, blocks=8, bs=4, heads=2, dtype=torch.float32):
    torch.manual_seed(1)
    return torch.randn(layers, blocks, bs, heads, D).to(dtype)


@pytest.mark.parametrize("base,tol", [(0, 1e-5), (8000, 2e-3)])
def test_rotate_by_minus_delta_equals_rope_at_shifted_position(base, tol):
    # Keys for logical index p = base + 4*j + o are stored in block ids [3, 5, 6], RoPE'd at p.
    bs, delta = 4, 8
    ids = [3, 5, 6]
    raw = torch.randn(2, len(ids) * bs, 2, D)  # (layers, tokens, heads, D)
    pos = torch.arange(base, base + len(ids) * bs)
    k_cache = make_cache()
    for layer in range(2):
        k_cache[layer, ids] = rope_keys(raw[layer], pos).reshape(len(ids), bs, 2, D)
    rerotate_keys_(k_cache, ids, delta, THETA)
    for layer in range(2):
        want = rope_keys(raw[layer], pos - delta).reshape(len(ids), bs, 2, D)
        # Equal up to float32 rounding of the angles (larger at large positions).
        torch.testing.assert_close(k_cache[layer, ids], want, rtol=0, atol=tol)
        assert not torch.allclose(k_cache[layer, ids], rope_keys(raw[layer], pos).reshape(len(ids), bs, 2, D))


def test_in_place_only_listed_blocks_and_layers_each_once():
    k_cache = make_cache(layers=3)
    v_cache = make_cache(layers=3) + 1
    before_k, before_v = k_cache.clone(), v_cache.clone()
    ptr = k_cache.untyped_storage().data_ptr()
    out = rerotate_keys_(k_cache, [2, 4], 16, THETA, layers=[0, 2])
    assert out is k_cache and k_cache.untyped_storage().data_ptr() == ptr  # no new storage
    assert torch.equal(v_cache, before_v)
    untouched = [b for b in range(8) if b not in (2, 4)]
    assert torch.equal(k_cache[:, untouched], before_k[:, untouched])
    assert torch.equal(k_cache[1], before_k[1])
    # Exactly one rotation: compare with an independent single rotation of the originals.
    ang = -16 * (1.0 / THETA ** (torch.arange(0, D, 2).float() / D))
    c, s = torch.cat([ang, ang]).cos(), torch.cat([ang, ang]).sin()
    x = before_k[[0, 2]][:, [2, 4]]
    want = x * c + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * s
    assert torch.equal(k_cache[[0, 2]][:, [2, 4]], want)
    # Rotating back restores the keys up to rounding.
    rerotate_keys_(k_cache, [2, 4], -16, THETA, layers=[0, 2])
    torch.testing.assert_close(k_cache, before_k, rtol=0, atol=1e-6)


def test_bf16_cache_computed_in_float32():
    k_cache = make_cache(dtype=torch.bfloat16)
    before = k_cache.clone()
    rerotate_keys_(k_cache, [1, 7], 40, THETA)
    ang = -40 * (1.0 / THETA ** (torch.arange(0, D, 2).float() / D))
    c, s = torch.cat([ang, ang]).cos(), torch.cat([ang, ang]).sin()
    x = before[:, [1, 7]].float()
    want = (x * c + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * s).to(torch.bfloat16)
    assert k_cache.dtype == torch.bfloat16 and torch.equal(k_cache[:, [1, 7]], want)


@pytest.mark.parametrize("ids,layers,match", [
    ([2, 2], None, "duplicate"), ([0, 3], None, "null block"), ([8], None, r"\[1, 8\)"),
    ([2], [0, 0], "layers"), ([2], [5], "layers"),
])
def test_bad_arguments(ids, layers, match):
    with pytest.raises(ValueError, match=match):
        rerotate_keys_(make_cache(), ids, 4, THETA, layers=layers)


# ---------------------------------------------------------------- fp8 caches (per-token scales)
FP8 = torch.float8_e4m3fn


def make_fp8_cache(layers=2, blocks=8, bs=4, heads=2):
    """(float keys, e4m3 keys, scales): keys of magnitude ~1..10 quantized per (token, head)."""
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(layers, blocks, bs, heads, D, generator=gen) * torch.linspace(1, 10, heads)[:, None]
    q, s = quantize_fp8(k)
    return k, q, s


def test_fp8_rerotation_requantizes_with_fresh_scales():
    """Dequantize, rotate in float32, re-quantize: within amax / 28 per (token, head) of the
    rotated dequantized keys (one more e4m3 rounding, with the rotated row's own scale), and
    within (sqrt(2) * amax_before + amax_after) / 28 of the float keys rotated without any
    quantization (the first rounding's error turned by the rotation, plus the second's)."""
    k, q, s = make_fp8_cache(layers=3)
    q_before, s_before = q.view(torch.uint8).clone(), s.clone()
    ids, delta = [2, 5, 6], 1000
    rerotate_keys_(q, ids, delta, THETA, layers=[0, 2], k_scale=s)
    ang = -delta * (1.0 / THETA ** (torch.arange(0, D, 2).float() / D))
    c, sn = torch.cat([ang, ang]).cos(), torch.cat([ang, ang]).sin()

    def rot(x):
        return x * c + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * sn

    got = dequantize_fp8(q, s, torch.float32)[[0, 2]][:, ids]
    from_deq = rot(dequantize_fp8(q_before.view(FP8), s_before, torch.float32)[[0, 2]][:, ids])
    from_float = rot(k[[0, 2]][:, ids])
    amax = from_deq.abs().amax(-1, keepdim=True)
    assert ((got - from_deq).abs() <= amax / 28 * (1 + 1e-6)).all()
    bound = (2 ** 0.5 * k[[0, 2]][:, ids].abs().amax(-1, keepdim=True) + from_float.abs().amax(-1, keepdim=True)) / 28
    assert ((got - from_float).abs() <= bound + 1e-6).all()
    # Fresh scales: the rotated row's amax / 448, as a write would set it.
    assert torch.equal(s[[0, 2]][:, ids], from_deq.abs().amax(-1) / 448)
    # Only the listed blocks of the listed layers changed (bytes and scales).
    untouched = [b for b in range(8) if b not in ids]
    assert torch.equal(q.view(torch.uint8)[:, untouched], q_before[:, untouched])
    assert torch.equal(s[:, untouched], s_before[:, untouched])
    assert torch.equal(q.view(torch.uint8)[1], q_before[1]) and torch.equal(s[1], s_before[1])


def test_fp8_rerotation_needs_its_scales():
    _, q, s = make_fp8_cache()
    with pytest.raises(ValueError, match="k_scale"):
        rerotate_keys_(q, [1], 4, THETA)
    with pytest.raises(ValueError, match="k_scale"):
        rerotate_keys_(make_cache(), [1], 4, THETA, k_scale=s)
    with pytest.raises(ValueError, match="k_scale"):
        rerotate_keys_(q, [1], 4, THETA, k_scale=s[:, :3])


# ---------------------------------------------------------------- CUDA dispatch (decided on CPU)


class _RecordingKernel:
    """Stands in for ``rerotate_keys_triton_``: records each call, touches nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, k_cache, block_ids, delta, theta, **kwargs):
        self.calls.append((k_cache, block_ids.clone(), delta, theta, kwargs))
        return k_cache


@pytest.fixture
def fake_cuda(monkeypatch):
    """Make rerotate_keys_ believe its cache is on CUDA with the fused kernel available; the
    kernel itself is replaced by a recorder. Returns (recorder, set_is_cuda)."""
    kernel = _RecordingKernel()
    # By dotted path: importing triton_kernels (and so triton) at this module's top would
    # decorate Triton functions before tests/kv/test_triton_kernels.py enables the interpreter.
    monkeypatch.setattr("duplexcache.kv.triton_kernels.rerotate_keys_triton_", kernel)
    monkeypatch.setattr(rope, "_fused_rerotation_available", lambda device: True)
    # Counters are module state: start each test from a known point.
    monkeypatch.setattr(rope, "rerotation_path_counts", {"torch": 0, "triton": 0})

    def set_is_cuda(value: bool) -> None:
        monkeypatch.setattr(rope, "_is_cuda", lambda t: value)

    return kernel, set_is_cuda


def test_cuda_tensor_dispatches_to_fused_kernel(fake_cuda):
    kernel, set_is_cuda = fake_cuda
    set_is_cuda(True)
    k_cache = make_cache()
    before = k_cache.clone()
    out = rope.rerotate_keys_(k_cache, [5, 2, 7], 12, THETA)
    assert out is k_cache
    assert len(kernel.calls) == 1
    got_cache, got_ids, got_delta, got_theta, kwargs = kernel.calls[0]
    assert got_cache is k_cache  # the cache itself, in place: no copy handed to the kernel
    assert got_ids.dtype == torch.long and got_ids.tolist() == [5, 2, 7]
    assert got_ids.device == k_cache.device
    assert (got_delta, got_theta) == (12, THETA)
    assert kwargs == {"k_scale": None, "check_ids": False}  # ids were validated once on the host already
    assert torch.equal(k_cache, before)  # the torch loop did not run as well
    assert rope.rerotation_path_counts == {"torch": 0, "triton": 1}


def test_cpu_tensor_never_dispatches_to_fused_kernel(fake_cuda):
    kernel, _ = fake_cuda  # kernel "available", but the tensor is a real CPU tensor
    k_cache = make_cache()
    before = k_cache.clone()
    rope.rerotate_keys_(k_cache, [5, 2], 12, THETA)
    assert kernel.calls == []
    assert not torch.equal(k_cache[:, [5, 2]], before[:, [5, 2]])  # rotated by the torch path
    assert rope.rerotation_path_counts == {"torch": 1, "triton": 0}


@pytest.mark.parametrize("case", ["layers", "kernel_unavailable", "bad_ids", "no_op"])
def test_cuda_dispatch_exceptions(fake_cuda, monkeypatch, case):
    """The fused kernel runs only for all layers, when available, after validation, and not
    for an empty or zero-delta rotation."""
    kernel, set_is_cuda = fake_cuda
    set_is_cuda(True)
    k_cache = make_cache()
    if case == "layers":  # the kernel rotates every layer; a layer subset takes the torch loop
        rope.rerotate_keys_(k_cache, [3], 4, THETA, layers=[1])
        assert rope.rerotation_path_counts == {"torch": 1, "triton": 0}
    elif case == "kernel_unavailable":
        monkeypatch.setattr(rope, "_fused_rerotation_available", lambda device: False)
        rope.rerotate_keys_(k_cache, [3], 4, THETA)
        assert rope.rerotation_path_counts == {"torch": 1, "triton": 0}
    elif case == "bad_ids":
        with pytest.raises(ValueError, match="duplicate"):
            rope.rerotate_keys_(k_cache, [3, 3], 4, THETA)
        assert rope.rerotation_path_counts == {"torch": 0, "triton": 0}
    else:
        rope.rerotate_keys_(k_cache, [3], 0, THETA)
        rope.rerotate_keys_(k_cache, [], 4, THETA)
        assert rope.rerotation_path_counts == {"torch": 0, "triton": 0}
    assert kernel.calls == []


def test_cuda_dispatch_hands_an_fp8_cache_its_scales(fake_cuda):
    kernel, set_is_cuda = fake_cuda
    set_is_cuda(True)
    _, q, s = make_fp8_cache()
    rope.rerotate_keys_(q, [3, 4], 8, THETA, k_scale=s)
    assert len(kernel.calls) == 1 and kernel.calls[0][4]["k_scale"] is s
