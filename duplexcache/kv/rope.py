"""NeoX (half-split) rotary position embedding, and in-place re-rotation of cached keys.

Half-split layout: dimension ``i`` and ``i + head_dim/2`` form one rotating pair with
frequency ``inv_freq[i] = theta ** (-2i / head_dim)``. This is the layout of transformers'
Qwen3 / Llama (``rotate_half``), and ``rope_cos_sin`` + ``apply_rope`` compute exactly what
they compute: angles in float32, cos/sin cast to the activation dtype, then
``x * cos + rotate_half(x) * sin`` in that dtype.

Re-rotation: a key stored with RoPE at position ``p`` becomes the key at ``p - d`` by one
more rotation of every pair by ``-d * inv_freq`` (rotations compose by adding angles). After
a window drops ``d`` tokens (a whole number of blocks), the kept keys are rotated this way
in place, so positions stay equal to logical indices and nothing is moved.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from duplexcache.kv.kv_quant import FP8_KV_DTYPE, as_bytes, dequantize_fp8, quantize_fp8

__all__ = ["inv_freq", "rope_cos_sin", "rotate_half", "apply_rope", "rerotate_keys_"]


def inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """(head_dim/2,) float32 inverse frequencies, computed as transformers computes them."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    if theta <= 0:
        raise ValueError(f"rope theta must be positive, got {theta}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta ** exponents)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for ``positions`` (any shape, integer), each ``(*positions.shape, head_dim)``.

    Angles are computed in float32 whatever ``dtype`` is; the tables are then cast to ``dtype``.
    """
    freqs = positions.to(torch.float32)[..., None] * inv_freq(head_dim, theta, positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., head_dim): pair i and i + head_dim/2
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension's two halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (..., head_dim) by tables that broadcast against it.

    Callers arrange the broadcast: for ``x`` of shape (tokens, heads, head_dim) pass
    ``cos[:, None, :]``; for (batch, heads, tokens, head_dim) pass ``cos[:, None]`` of a
    (batch, tokens, head_dim) table. Computes in ``x``'s dtype (cast the tables to it).
    """
    if cos.shape[-1] != x.shape[-1] or sin.shape != cos.shape:
        raise ValueError(f"cos/sin {tuple(cos.shape)}/{tuple(sin.shape)} do not match x {tuple(x.shape)}")
    return x * cos + rotate_half(x) * sin


# Which implementation each re-rotation took; benchmarks and tests read it to prove the
# fused GPU kernel is the path actually used on CUDA.
rerotation_path_counts: dict[str, int] = {"torch": 0, "triton": 0}


def _is_cuda(t: torch.Tensor) -> bool:
    """``t.is_cuda``, behind a name so CPU tests can take the CUDA dispatch branch."""
    return t.is_cuda


def _fused_rerotation_available(device: torch.device) -> bool:
    try:
        from duplexcache.kv.triton_kernels import triton_available  # noqa: PLC0415
    except ImportError:
        return False
    return triton_available(device)


def rerotate_keys_(
    k_cache: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    delta: int,
    theta: float,
    layers: Sequence[int] | None = None,
    *,
    k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate the keys stored in ``block_ids`` by ``-delta`` positions, in place.

    ``k_cache``: (num_layers, num_blocks, block_size, kv_heads, head_dim). Every slot of the
    listed blocks, in the listed layers (default: all), is rotated exactly once (block ids
    must be distinct; block 0, the null block, is refused). The math is done in float32 and
    cast back to the cache dtype; V is not touched. One layer's listed blocks are gathered
    into a temporary at a time and scattered back, so the cache itself is never copied or
    reallocated. Returns ``k_cache``.

    Unused slots of a partial last block are rotated too; they hold no valid key, and the
    next write overwrites them.

    An fp8 cache (``float8_e4m3fn``, ``precision.kv_cache_dtype: fp8_e4m3``) passes its
    ``k_scale`` (layers, blocks, block_size, kv_heads): each key is dequantized, rotated in
    float32 and re-quantized with a fresh per-(token, head) scale, written to ``k_scale``.
    """
    if k_cache.dim() != 5:
        raise ValueError(f"k_cache must be (layers, blocks, block_size, heads, head_dim), got {tuple(k_cache.shape)}")
    num_layers, num_blocks, _, _, head_dim = k_cache.shape
    ids = torch.as_tensor(block_ids, dtype=torch.long).flatten()
    if ids.numel() == 0 or delta == 0:
        return k_cache
    id_list = ids.tolist()
    if len(set(id_list)) != len(id_list):
        raise ValueError(f"rerotate_keys_: duplicate block ids would be rotated twice: {id_list}")
    if min(id_list) < 1 or max(id_list) >= num_blocks:
        raise ValueError(f"rerotate_keys_: block ids must be in [1, {num_blocks}) (0 is the null block): {id_list}")
    layer_list = range(num_layers) if layers is None else list(layers)
    if any(not 0 <= l < num_layers for l in layer_list) or len(set(layer_list)) != len(layer_list):
        raise ValueError(f"rerotate_keys_: layers must be distinct and in [0, {num_layers}): {list(layer_list)}")
    if (k_scale is not None) != (k_cache.dtype == FP8_KV_DTYPE):
        raise ValueError(f"rerotate_keys_: k_scale goes with an fp8 cache and only with it (cache {k_cache.dtype})")
    if k_scale is not None and k_scale.shape != k_cache.shape[:4]:
        raise ValueError(f"rerotate_keys_: k_scale {tuple(k_scale.shape)} must be {tuple(k_cache.shape[:4])}")
    if layers is None and _is_cuda(k_cache) and _fused_rerotation_available(k_cache.device):
        # One fused kernel over all layers and blocks: the per-layer loop below costs ~6 ms
        # for 36 layers x 6000 tokens on an H200, the kernel ~0.5 ms (docs/benchmarks.md, "Stage 0: paged decode").
        from duplexcache.kv.triton_kernels import rerotate_keys_triton_  # noqa: PLC0415

        rerotation_path_counts["triton"] += 1
        # ids were validated above; the kernel's own check would sync the device again.
        return rerotate_keys_triton_(k_cache, ids.to(k_cache.device), delta, theta, k_scale=k_scale,
                                     check_ids=False)
    rerotation_path_counts["torch"] += 1
    # Rotation by -delta: cos(-a) = cos(a), sin(-a) = -sin(a). Angles in float32.
    angle = -float(delta) * inv_freq(head_dim, theta, k_cache.device)  # (head_dim/2,)
    emb = torch.cat((angle, angle))
    cos, sin = emb.cos(), emb.sin()  # (head_dim,) float32, broadcast over (n, bs, heads, head_dim)
    ids = ids.to(k_cache.device)
    for layer in layer_list:
        k_layer = k_cache[layer]  # view (num_blocks, block_size, heads, head_dim)
        if k_scale is not None:
            _rerotate_fp8_layer(k_layer, k_scale[layer], ids, cos, sin)
            continue
        k = k_layer.index_select(0, ids).to(torch.float32)  # temporary (n, bs, heads, head_dim)
        k = k * cos + rotate_half(k) * sin
        k_layer.index_copy_(0, ids, k.to(k_cache.dtype))  # scatter back into the cache storage
    return k_cache


def _rerotate_fp8_layer(k_layer: torch.Tensor, scale_layer: torch.Tensor, ids: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor) -> None:
    """One layer of an fp8 cache: dequantize the listed blocks, rotate in float32, re-quantize
    each (token, head) row with a fresh scale (its amax changed with the rotation)."""
    k = dequantize_fp8(k_layer.index_select(0, ids), scale_layer.index_select(0, ids), torch.float32)
    q, s = quantize_fp8(k * cos + rotate_half(k) * sin)
    as_bytes(k_layer).index_copy_(0, ids, as_bytes(q))  # CPU has no float8 index_copy_
    scale_layer.index_copy_(0, ids, s)
