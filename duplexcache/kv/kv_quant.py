"""fp8 (e4m3) KV storage: per-token, per-kv-head scales (``precision.kv_cache_dtype: fp8_e4m3``).

A quantized pool stores each K/V row ``x`` (one token, one kv head: ``head_dim`` values) as
``round_e4m3(x / s)`` plus one float32 scale ``s = max(amax(|x|) / 448, FP8_SCALE_FLOOR)``::

    k, v             : (L, num_blocks, block_size, Hkv, D)  float8_e4m3fn
    k_scale, v_scale : (L, num_blocks, block_size, Hkv)     float32
    read:  x ~= k.float() * k_scale[..., None], then cast to the model dtype

Why per token (not per block or per tensor): a token's scale is fixed when it is written and
never changes while it stays, so appending token t+1 to a block never re-quantizes tokens
0..t. Appends stay bit-stable, shared prefix blocks stay valid for every reader, and a block's
bytes depend only on what was written into it (the same reasons the float pool has).

Error: e4m3 keeps 3 mantissa bits, so a value in the normal range is off by at most 2^-4 of
itself; below that (subnormals of the scaled value) by at most ``s * 2^-10``. Per row:
``|x_hat - x| <= |x| / 16 + s / 1024 <= amax / 16`` (up to the floor on an all-zero row).

Bytes: ``D`` bytes + 4 bytes of scale per (token, kv head) for each of K and V, against
``2 * D`` in bf16: at D = 128, 132 / 256 = 0.52 of bf16's bytes.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
# Largest finite e4m3fn value: the row's amax maps to it, so no stored value overflows.
FP8_E4M3_MAX = 448.0
# Lower bound of a scale, so an all-zero row (or padding) gets a finite scale and stores zeros.
FP8_SCALE_FLOOR = 1e-8

# Bytes of one row's scale (float32), stored next to its head_dim e4m3 values.
FP8_SCALE_BYTES = 4

# precision.kv_cache_dtype -> storage dtype of the pool (None: the model dtype, exact mode).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8_e4m3": FP8_KV_DTYPE}


def kv_storage_dtype(name: str) -> torch.dtype | None:
    """The pool's storage dtype for a ``precision.kv_cache_dtype`` value (None: model dtype)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; choose one of {tuple(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


def is_quantized(storage_dtype: torch.dtype | None) -> bool:
    """Whether a pool with this storage dtype keeps scales (only fp8 e4m3 today)."""
    if storage_dtype is None or not storage_dtype.is_floating_point or storage_dtype.itemsize != 1:
        return False
    if storage_dtype != FP8_KV_DTYPE:
        raise ValueError(f"KV storage {storage_dtype} is not supported; fp8 storage is {FP8_KV_DTYPE}")
    return True


def row_bytes(head_dim: int, dtype: torch.dtype, storage_dtype: torch.dtype | None = None) -> int:
    """Bytes one stored row (one token or frame, one head: ``head_dim`` values) takes:
    ``head_dim`` values of ``dtype``, or in fp8 ``head_dim`` bytes plus its float32 scale."""
    if is_quantized(storage_dtype):
        return head_dim + FP8_SCALE_BYTES
    return head_dim * torch.empty((), dtype=dtype, device="meta").element_size()


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows over the last dim -> (``x / scale`` in e4m3, float32 scale of shape ``x.shape[:-1]``).

    The math runs in float32 whatever ``x`` is. The clamp guards the one rounding case where
    ``amax / (amax / 448)`` lands a hair above 448 (CUDA's cast would make it NaN).
    """
    xf = x.to(torch.float32)
    scale = (xf.abs().amax(dim=-1) / FP8_E4M3_MAX).clamp_min(FP8_SCALE_FLOOR)
    q = (xf / scale[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q.float() * scale[..., None]`` cast to ``dtype`` (the model dtype compute runs in)."""
    return (q.to(torch.float32) * scale[..., None]).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of an fp8 tensor: CPU torch has no ``index_copy_`` for float8 (moving bytes
    is exact either way)."""
    return t.view(torch.uint8)


__all__ = [
    "FP8_E4M3_MAX",
    "FP8_KV_DTYPE",
    "FP8_SCALE_BYTES",
    "FP8_SCALE_FLOOR",
    "KV_CACHE_DTYPES",
    "as_bytes",
    "dequantize_fp8",
    "is_quantized",
    "kv_storage_dtype",
    "quantize_fp8",
    "row_bytes",
]
