"""Gather each arena row's private cache keys from its session's own storage (cfm/arena.py).

Every session keeps its private delta frames in a tensor of its own (`SharedPromptAttCache.storage`,
`PlainAttCache.data`), shape (steps, layers, cfg=2, heads, cap, 2*head_dim), contiguous, with
delta key j at frame `pos[j]` of it. At each (step, layer) of a solve the arena copies row r's
keys j < d_r into its transient workspace (B2, heads, K, 2*head_dim) at `[W, W + d_r)`:

    workspace[2r + c, h, W + j, :] = storage_r[step, layer, c, h, pos_r[j], :]     j < d_r

Two implementations of the same copy:

* `gather_private_torch`: one `index_select` per row. It needs the rows' tensors and lengths on
  the host, so a CUDA graph would bake them in: the CPU path and the reference.
* `gather_private_triton`: one launch over (rows, blocks of keys), reading everything from static device
  buffers the arena fills before each replay: a per-row int64 base address (cast to a pointer
  in the kernel), a per-row frame capacity (the storage's frame count, which fixes its strides),
  the rows' delta lengths and a (rows, positions) map. So it runs inside the arena's captured
  whole-Euler graph; rows without a delta point at a live buffer of the arena (never read).

Both are pure copies, so the workspace (and hence the attention) is value for value the same.
Triton is optional: without it (or off CUDA, unless ``TRITON_INTERPRET=1`` was set before this
module was imported, which runs the kernel on CPU tensors for tests) `triton_gather_available`
is False and the arena uses the torch gather.
"""
from __future__ import annotations

import os

import torch

try:  # Triton is an optional GPU dependency.
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

# Triton decides at decoration time whether a kernel is compiled or interpreted.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_gather_available(device: torch.device) -> bool:
    """Whether `gather_private_triton` can run on tensors of `device`."""
    if triton is None:
        return False
    if device.type == "cuda":
        return True
    return _INTERPRETED and device.type == "cpu"


def gather_private_torch(ws: torch.Tensor, storages: list[torch.Tensor | None], lengths: list[int],
                         positions: torch.Tensor, step: int, layer: int, width: int) -> None:
    """ws (2 * tier, heads, K, 2hd); storages[r] row r's storage (None or unused when
    lengths[r] == 0); positions (>= tier, >= max length) int64 on ws's device."""
    tier = len(lengths)
    rows = ws.unflatten(0, (tier, 2))
    for r, d in enumerate(lengths):
        if d:
            src = storages[r][step, layer]                       # (2, heads, cap, 2hd)
            rows[r, :, :, width:width + d].copy_(src.index_select(2, positions[r, :d]))


if triton is not None:

    # step_layer takes every value 0..steps x layers - 1 and width every chunk width: unspecialized,
    # so one compile serves every launch of a solve (Triton would compile apart values equal to 1
    # or divisible by 16).
    @triton.jit(do_not_specialize=["step_layer", "width"])
    def _gather_private_kernel(ws_ptr, base_ptr, cap_ptr, len_ptr, pos_ptr,
                               ws_stride_b, ws_stride_h, ws_stride_k, pos_stride,
                               step_layer, width,
                               HEADS: tl.constexpr, HD2: tl.constexpr, BLOCK_J: tl.constexpr,
                               BLOCK_CH: tl.constexpr, BLOCK_E: tl.constexpr):
        # one program per (row r, block of BLOCK_J cache keys): it copies the (cfg, head, 2hd)
        # tiles of the keys j < d_r
        r = tl.program_id(0)
        j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
        live = j < tl.load(len_ptr + r)
        pos = tl.load(pos_ptr + r * pos_stride + tl.where(live, j, 0))   # a dead key reads key 0's slot
        cap = tl.load(cap_ptr + r)
        src = tl.load(base_ptr + r).to(tl.pointer_type(ws_ptr.dtype.element_ty))
        ch = tl.arange(0, BLOCK_CH)             # c * HEADS + h
        e = tl.arange(0, BLOCK_E)
        mask = live[:, None, None] & (ch[None, :, None] < 2 * HEADS) & (e[None, None, :] < HD2)
        # storage (steps, layers, 2, heads, cap, HD2), contiguous
        plane = (step_layer * 2 * HEADS + ch[None, :, None]).to(tl.int64)
        vals = tl.load(src + (plane * cap + pos[:, None, None]) * HD2 + e[None, None, :], mask=mask)
        c = ch // HEADS
        h = ch % HEADS
        dst = ((2 * r + c[None, :, None]).to(tl.int64) * ws_stride_b + h[None, :, None] * ws_stride_h
               + (width + j[:, None, None]).to(tl.int64) * ws_stride_k + e[None, None, :])
        tl.store(ws_ptr + dst, vals, mask=mask)


def gather_private_triton(ws: torch.Tensor, base: torch.Tensor, cap: torch.Tensor, lengths: torch.Tensor,
                          positions: torch.Tensor, step_layer: int, width: int, num_keys: int) -> None:
    """ws (2 * tier, heads, K, 2hd), last axis contiguous; base/cap/lengths (>= tier,) int64:
    row r's storage address, its frame count and d_r; positions (>= tier, P) int64. Copies keys
    j < min(d_r, num_keys) of every row; `step_layer` = step * layers + layer."""
    if ws.stride(3) != 1:
        raise ValueError("the workspace's last axis must be contiguous")
    tier, heads, hd2 = ws.shape[0] // 2, ws.shape[1], ws.shape[3]
    if num_keys < 1:
        return
    block_ch, block_e = triton.next_power_of_2(2 * heads), triton.next_power_of_2(hd2)
    # about 8192 elements a program (minicpmo45: 4 keys of 16 x 128)
    block_j = min(64, max(1, 8192 // (block_ch * block_e)))
    _gather_private_kernel[(tier, triton.cdiv(num_keys, block_j))](
        ws, base, cap, lengths, positions, ws.stride(0), ws.stride(1), ws.stride(2), positions.stride(0),
        step_layer, width, HEADS=heads, HD2=hd2, BLOCK_J=block_j, BLOCK_CH=block_ch, BLOCK_E=block_e)
