"""Paged KV storage, ragged batch metadata, and the reference paged attention.

Storage layout (one pool per model, shared by every session)::

    k, v : (num_layers, num_blocks, block_size, num_kv_heads, head_dim)

    session block table [7, 3, 9]           block_size = 4
    logical index  0 1 2 3 | 4 5 6 7 | 8 9 . .
    block          7 7 7 7 | 3 3 3 3 | 9 9 - -
    offset         0 1 2 3 | 0 1 2 3 | 0 1
    slot = block * block_size + offset, e.g. index 5 -> 3 * 4 + 1 = 13

Block 0 is the null block: it is never handed out, and table padding points at it.

A forward step runs over a flattened ragged batch (``PagedBatch``): the new tokens of every
sequence are concatenated, ``query_start_loc`` marks where each sequence's tokens start. Each
layer first writes the K/V of all new tokens (``write_kv``), then attends (``paged_attention``),
so new tokens see the cached prefix of their own sequence plus the new tokens before them.

On CPU (and for long prefills) attention gathers each sequence's blocks and runs SDPA: simple
and exact, but it moves the KV twice and launches a dozen kernels per sequence per layer. A GPU
kernel that reads blocks in place can be selected per cache with
``cache.set_decode_backend("triton")``. It serves decode batches, and (with
``cache.ragged_steps_in_kernel``, deploy key ``stage0.ragged_kernel``) also ragged steps whose
sequences add at most ``RAGGED_KERNEL_MAX_NEW`` tokens each (a unit's append, the Talker's
condition rows): each new token becomes one query row with its own sequence's block table and
``seq_len = its logical index + 1``. Its K/V are already written, so that length is exactly the
causal mask. One launch per layer replaces one gather + SDPA per sequence per layer.

fp8 storage (``storage_dtype=torch.float8_e4m3fn``): ``write_kv`` quantizes each new (token,
kv head) row with its own scale, every reader (gather + SDPA, the kernel, re-rotation)
dequantizes to the model dtype, and ``copy_blocks`` copies scales with their blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from duplexcache.kv.kv_quant import FP8_SCALE_FLOOR, as_bytes, dequantize_fp8, is_quantized, quantize_fp8, row_bytes
from duplexcache.kv.kernel_work import row_groups_host

logger = logging.getLogger(__name__)

NULL_BLOCK_ID = 0

DECODE_BACKENDS = ("reference", "triton")

# Ragged steps up to this many new tokens per sequence use the in-place kernel (one query row per
# token, each reading its sequence's prefix). Longer ones (a context prefill, a window fill) read
# the prefix once per token, so the gather + SDPA path is cheaper there.
RAGGED_KERNEL_MAX_NEW = 32


class PagedKVCache:
    """The K and V block pool of one model (all layers).

    ``k``/``v``: (num_layers, num_blocks, block_size, num_kv_heads, head_dim). The tensors are
    owned here; block ownership (who may write which block) belongs to the KV manager.

    ``storage_dtype`` None (the default) stores the model ``dtype`` itself. ``torch.float8_e4m3fn``
    (``precision.kv_cache_dtype: fp8_e4m3``) stores e4m3 values plus float32 ``k_scale``/``v_scale``
    of shape (num_layers, num_blocks, block_size, num_kv_heads), one per token and kv head, set
    when the token is written (kv/kv_quant.py). Every reader here dequantizes; code outside this
    module reads values through ``gather_blocks`` or passes ``layer_scales`` to the kernels.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        storage_dtype: torch.dtype | None = None,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value <= 0:
                raise ValueError(f"PagedKVCache: {name} must be positive, got {value}")
        if num_blocks < 2:
            # Block 0 is reserved as the null block, so one usable block needs two.
            raise ValueError(f"PagedKVCache: num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype  # the model dtype: what writers hand in and readers get back
        # What k/v hold: the model dtype (exact), or fp8 e4m3 with one float32 scale per
        # (token, kv head) in k_scale/v_scale (kv/kv_quant.py). The scales are allocated here
        # with the pool, once, so CUDA graphs capture their addresses like k/v's.
        self.storage_dtype = dtype if storage_dtype is None else storage_dtype
        self.quantized = is_quantized(storage_dtype)
        if self.storage_dtype != dtype and not self.quantized:
            # Another float format would need its own cast on every read; only fp8 has one.
            raise ValueError(f"PagedKVCache: storage_dtype {storage_dtype} must be the model dtype {dtype} "
                             "or torch.float8_e4m3fn")
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=self.storage_dtype, device=device)
        self.v = torch.zeros(shape, dtype=self.storage_dtype, device=device)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if self.quantized:
            # Floor, not 0: an unwritten slot dequantizes to 0 * floor = 0, like the float pool.
            self.k_scale = torch.full(shape[:-1], FP8_SCALE_FLOOR, dtype=torch.float32, device=device)
            self.v_scale = torch.full(shape[:-1], FP8_SCALE_FLOOR, dtype=torch.float32, device=device)
        # Attention path for decode batches; the kernel is resolved when selected, so a missing
        # kernel module is an error at selection time, not a silent fallback later.
        self.decode_backend = "reference"
        self._decode_kernel: Callable | None = None
        # Short ragged steps through the decode kernel too (stage0.ragged_kernel); needs the kernel.
        self.ragged_steps_in_kernel = False
        # Tokens of one sequence a kernel program takes in a ragged step, sharing each K/V tile it
        # loads (the engine: kernel_work.tokens_per_program of the model's heads); 1: one program
        # per token row, each re-reading its sequence's K/V (bench kernels' reference arm).
        self.ragged_tokens_per_program = 1
        # The decode kernel's split count: None picks it from the batch (default_num_splits); a
        # number fixes it, so a sequence is cut by its own length only (engine.batch_invariant).
        self.fixed_num_splits: int | None = None
        # How many attention calls took each path: lets tests and benchmarks prove a path is used.
        self.path_counts: dict[str, int] = {"reference": 0, "decode_kernel": 0, "ragged_kernel": 0,
                                            "per_sequence": 0}


    def set_decode_backend(self, name: str) -> None:
        """Select the decode attention path of this cache: ``reference`` (gather + SDPA) or
        ``triton`` (the in-place kernel of ``kv/triton_kernels.py``).

        ``triton`` needs CUDA and Triton; it is refused here when either is missing, rather than
        silently running the reference path. It applies to decode batches (one new token per
        sequence) on CUDA tensors; prefill and CPU tensors use the reference path.
        """
        if name not in DECODE_BACKENDS:
            raise ValueError(f"unknown attention backend {name!r}; choose one of {DECODE_BACKENDS}")
        if name == "reference":
            self.decode_backend, self._decode_kernel = name, None
            return
        from duplexcache.kv import triton_kernels  # noqa: PLC0415 - optional GPU dependency

        if not triton_kernels.triton_available("cuda"):
            raise ValueError("attention backend 'triton' needs Triton and CUDA, and one of them is missing here")
        self.decode_backend, self._decode_kernel = name, triton_kernels.paged_decode_attention
        logger.info("paged attention: decode batches on CUDA use the triton kernel")

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype,
                               self.storage_dtype)

    def layer_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(k_scale, v_scale) of one layer, each (num_blocks, block_size, Hkv); (None, None) unquantized."""
        if not self.quantized:
            return None, None
        assert self.k_scale is not None and self.v_scale is not None, "a quantized pool has scales"
        return self.k_scale[layer], self.v_scale[layer]

    def gather_blocks(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``blocks`` (n,) in one layer as tokens, each (n * block_size, Hkv, D).

        Unquantized: the stored values as they are (a gather, no cast). fp8: dequantized to the
        model dtype. The accessor for every reader outside this module that wants values.
        """
        k, v = self.k[layer][blocks].flatten(0, 1), self.v[layer][blocks].flatten(0, 1)
        if not self.quantized:
            return k, v
        ks, vs = self.layer_scales(layer)
        return (dequantize_fp8(k, ks[blocks].flatten(0, 1), self.dtype),
                dequantize_fp8(v, vs[blocks].flatten(0, 1), self.dtype))

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    @classmethod
    def from_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        storage_dtype: torch.dtype | None = None,
    ) -> "PagedKVCache":
        """Preallocate as many blocks as fit in ``budget_bytes`` (the null block included)."""
        per_block = bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype, storage_dtype)
        num_blocks = num_blocks_for_budget(budget_bytes, per_block)
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, storage_dtype)


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    storage_dtype: torch.dtype | None = None) -> int:
    """Bytes of K and V over all layers for one block, scales included.

    ``storage_dtype`` None: ``head_dim`` values of ``dtype`` per (token, kv head). fp8:
    ``head_dim`` bytes plus one float32 scale per (token, kv head), for each of K and V.
    """
    return 2 * num_layers * block_size * num_kv_heads * row_bytes(head_dim, dtype, storage_dtype)


def num_blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    """Number of whole blocks (null block included) that fit in ``budget_bytes``."""
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 2:
        raise ValueError(
            f"KV budget of {budget_bytes} bytes holds {num_blocks} blocks of {block_bytes} bytes; "
            "need at least 2 (block 0 is the null block)"
        )
    return num_blocks


@dataclass
class PagedBatch:
    """Metadata of one ragged forward step. Built once per step, read by every layer.

    Tensors live on the model's device; the ``*_list`` fields are host copies so the CPU
    reference path never synchronises with the device.
    """

    query_start_loc: torch.Tensor  # (B+1,) int64, offsets of each sequence's new tokens
    seq_lens: torch.Tensor  # (B,) int32, computed + new
    block_tables: torch.Tensor  # (B, max_blocks) int32, padded with the null block
    slot_mapping: torch.Tensor  # (N,) int64, cache slot of each new token
    positions: torch.Tensor  # (N,) int64, RoPE position of each new token
    block_size: int
    num_computed_list: list[int]
    num_new_list: list[int]
    # Per new token (N,), on the host: its sequence and its causal length (logical index + 1).
    # Set by build(); only the ragged kernel path reads them (token_rows moves them once).
    token_seq_ids: torch.Tensor | None = None
    token_seq_lens: torch.Tensor | None = None
    # A step of token rows (a graph's): each program's (first row, row count), int32 on the device,
    # for the kernel's row groups (kernel_work.row_groups_host); None: one program per row.
    row_groups: tuple[torch.Tensor, torch.Tensor] | None = None
    _token_rows: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, init=False)
    _token_groups: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False,
                                                                                     init=False)

    def token_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step as one decode row per new token, on the batch's device: ``(block_tables
        (N, max_blocks) int32, seq_lens (N,) int32)``. Computed on first use, then kept for the
        other layers."""
        if self.token_seq_ids is None or self.token_seq_lens is None:
            raise ValueError("this PagedBatch was not built with per-token metadata")
        if self._token_rows is None:
            dev = self.block_tables.device
            ids = self.token_seq_ids.to(dev, non_blocking=True)
            self._token_rows = (self.block_tables.index_select(0, ids), self.token_seq_lens.to(dev, non_blocking=True))
        return self._token_rows

    def token_row_groups(self, rows_per_group: int, short_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's row groups of ``token_rows``: each sequence's new tokens in runs of
        ``rows_per_group`` (int32, on the batch's device; kept for the other layers). ``short_only``:
        of the sequences adding at most RAGGED_KERNEL_MAX_NEW tokens only, their rows renumbered
        from 0 in order (the kernel part of a batch-invariant step with a long append)."""
        key = (rows_per_group, short_only)
        if key not in self._token_groups:
            num_new = [n for n in self.num_new_list if n <= RAGGED_KERNEL_MAX_NEW] if short_only else self.num_new_list
            self._token_groups[key] = _groups_to(row_groups_host(num_new, rows_per_group), self.block_tables.device)
        return self._token_groups[key]

    @property
    def num_seqs(self) -> int:
        return len(self.num_new_list)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def seq_lens_list(self) -> list[int]:
        return [c + n for c, n in zip(self.num_computed_list, self.num_new_list)]

    @property
    def is_decode(self) -> bool:
        """True when every sequence adds exactly one token (the decode-kernel case)."""
        return self.num_seqs > 0 and all(n == 1 for n in self.num_new_list)

    @property
    def last_token_indices(self) -> list[int | None]:
        """Flat index of each sequence's last new token (None when it has no new token)."""
        return last_token_rows(self.num_new_list)

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        num_computed: list[int],
        num_new: list[int],
        positions: list[list[int]] | None,
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "PagedBatch":
        """Flatten a ragged step. Token ``i`` of a sequence lives at ``table[i // bs]``, offset ``i % bs``."""
        num_seqs = len(block_tables)
        if len(num_computed) != num_seqs or len(num_new) != num_seqs:
            raise ValueError(
                f"PagedBatch: {num_seqs} block tables but {len(num_computed)} num_computed "
                f"and {len(num_new)} num_new"
            )
        if positions is not None and len(positions) != num_seqs:
            raise ValueError(f"PagedBatch: {num_seqs} sequences but {len(positions)} position lists")
        if block_size <= 0:
            raise ValueError(f"PagedBatch: block_size must be positive, got {block_size}")
        for b in range(num_seqs):
            _check_sequence(b, block_tables[b], num_computed[b], num_new[b], block_size)
            if positions is not None and len(positions[b]) != num_new[b]:
                raise ValueError(
                    f"PagedBatch: sequence {b} has {num_new[b]} new tokens but {len(positions[b])} positions"
                )
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [list(t) + [NULL_BLOCK_ID] * (max_blocks - len(t)) for t in block_tables]
        tables = torch.tensor(padded, dtype=torch.int64).reshape(num_seqs, max_blocks)
        new_t = torch.tensor(num_new, dtype=torch.int64)
        starts = torch.zeros(num_seqs + 1, dtype=torch.int64)
        torch.cumsum(new_t, 0, out=starts[1:])
        # Vectorised over all tokens on the host (no per-sequence loop), moved to the device once:
        # token j of the flat batch belongs to sequence seq[j] and sits at logical index[j].
        seq = torch.repeat_interleave(torch.arange(num_seqs), new_t)  # (N,)
        index = torch.arange(int(starts[-1])) - starts[seq] + torch.tensor(num_computed, dtype=torch.int64)[seq]
        slots = tables[seq, index // block_size] * block_size + index % block_size
        if positions is None:
            flat_positions = index
        else:
            flat_positions = torch.tensor([p for plist in positions for p in plist], dtype=torch.int64)
        return cls(
            # host-built metadata: copies that do not wait for the device (non_blocking)
            query_start_loc=starts.to(device, non_blocking=True),
            seq_lens=torch.tensor([c + n for c, n in zip(num_computed, num_new)],
                                  dtype=torch.int32).to(device, non_blocking=True),
            block_tables=tables.to(dtype=torch.int32).to(device, non_blocking=True),
            slot_mapping=slots.to(device, non_blocking=True),
            positions=flat_positions.to(device, non_blocking=True),
            block_size=block_size,
            num_computed_list=list(num_computed),
            num_new_list=list(num_new),
            token_seq_ids=seq,
            token_seq_lens=(index + 1).to(torch.int32),
        )


def _check_sequence(b: int, table: list[int], computed: int, new: int, block_size: int) -> None:
    if computed < 0 or new < 0:
        raise ValueError(f"PagedBatch: sequence {b} has negative counts (computed={computed}, new={new})")
    seq_len = computed + new
    needed = -(-seq_len // block_size)
    if len(table) < needed:
        raise ValueError(
            f"PagedBatch: sequence {b} needs {needed} blocks for {seq_len} tokens "
            f"(block_size {block_size}) but its block table has {len(table)}"
        )
    if NULL_BLOCK_ID in table[:needed]:
        raise ValueError(f"PagedBatch: sequence {b} uses the null block {NULL_BLOCK_ID} for live tokens: {table}")


def _groups_to(groups: tuple[list[int], list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    first, count = (torch.tensor(g, dtype=torch.int32) for g in groups)
    return first.to(device, non_blocking=True), count.to(device, non_blocking=True)


def last_token_rows(num_new: list[int]) -> list[int | None]:
    """Flat index of each sequence's last new token in a step that adds ``num_new[b]`` tokens to
    sequence ``b``, in order (None for a sequence with none)."""
    out: list[int | None] = []
    start = 0
    for n in num_new:
        out.append(start + n - 1 if n > 0 else None)
        start += n
    return out


def write_kv(cache: PagedKVCache, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V, each ``(N, num_kv_heads, head_dim)``, at their cache slots."""
    if k.shape != v.shape or k.dim() != 3 or k.shape[0] != slot_mapping.shape[0]:
        raise ValueError(
            f"write_kv: k {tuple(k.shape)} and v {tuple(v.shape)} must both be (N, kv_heads, head_dim) "
            f"with N = {slot_mapping.shape[0]} slots"
        )
    heads_dim = (cache.num_kv_heads, cache.head_dim)
    if cache.quantized:
        _write_kv_fp8(cache, layer, k, v, slot_mapping)
        return
    # The layer slice is contiguous (layer is the outermost dim), so this view aliases the pool.
    cache.k[layer].view(-1, *heads_dim).index_copy_(0, slot_mapping, k.to(cache.dtype))
    cache.v[layer].view(-1, *heads_dim).index_copy_(0, slot_mapping, v.to(cache.dtype))


def _write_kv_fp8(cache: PagedKVCache, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize each new (token, kv head) row with its own scale and store row and scale at its
    slot. Only the written slots change: earlier tokens of the block keep their bytes and scales."""
    heads_dim = (cache.num_kv_heads, cache.head_dim)
    for values, store, scales in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
        assert scales is not None, "a quantized pool has scales"
        q, s = quantize_fp8(values)  # (N, Hkv, D) e4m3, (N, Hkv) float32
        as_bytes(store[layer]).view(-1, *heads_dim).index_copy_(0, slot_mapping, as_bytes(q))
        scales[layer].view(-1, cache.num_kv_heads).index_copy_(0, slot_mapping, s)


def paged_attention(
    q: torch.Tensor, cache: PagedKVCache, layer: int, batch: PagedBatch, scale: float
) -> torch.Tensor:
    """Causal attention of the new tokens over their own sequence. q: (N, Hq, D) -> (N, Hq, D)."""
    if q.dim() != 3 or q.shape[0] != batch.num_tokens or q.shape[2] != cache.head_dim:
        raise ValueError(f"paged_attention: q {tuple(q.shape)} must be (N={batch.num_tokens}, heads, {cache.head_dim})")
    if q.shape[1] % cache.num_kv_heads != 0:
        raise ValueError(
            f"paged_attention: {q.shape[1]} query heads is not a multiple of {cache.num_kv_heads} kv heads"
        )
    path = attention_path(cache, batch, q.is_cuda)
    cache.path_counts[path] += 1
    if path == "decode_kernel":
        groups = batch.row_groups if cache.ragged_tokens_per_program > 1 else None
        return _kernel(q, cache, layer, batch.block_tables, batch.seq_lens, scale, groups)
    if path == "ragged_kernel":
        tables, seq_lens = batch.token_rows()
        rows = cache.ragged_tokens_per_program
        return _kernel(q, cache, layer, tables, seq_lens, scale, batch.token_row_groups(rows) if rows > 1 else None)
    if path == "per_sequence":
        return _per_sequence_paths(q, cache, layer, batch, scale)
    return _reference_paged_attention(q, cache, layer, batch, scale)


def _kernel(q: torch.Tensor, cache: PagedKVCache, layer: int, tables: torch.Tensor, seq_lens: torch.Tensor,
            scale: float, row_groups: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The in-place kernel over token rows; ``row_groups``: runs of one sequence's rows that share
    each K/V tile (up to ``cache.ragged_tokens_per_program`` rows each)."""
    # fp8: the kernel loads e4m3 values and their scales and dequantizes in registers.
    ks, vs = cache.layer_scales(layer)
    return cache._decode_kernel(q, cache.k[layer], cache.v[layer], tables, seq_lens, scale,
                                k_scale=ks, v_scale=vs, num_splits=cache.fixed_num_splits,
                                row_groups=row_groups, rows_per_group=cache.ragged_tokens_per_program)


def _per_sequence_paths(q: torch.Tensor, cache: PagedKVCache, layer: int, batch: PagedBatch,
                        scale: float) -> torch.Tensor:
    """A ragged step with a long append, batch-invariant: each sequence takes the path its own
    append picks (the kernel up to RAGGED_KERNEL_MAX_NEW tokens, else gather + SDPA), so a
    session's bits do not depend on a neighbour's long append."""
    long = [n > RAGGED_KERNEL_MAX_NEW for n in batch.num_new_list]
    out = _reference_paged_attention(q, cache, layer, batch, scale, only=long)
    rows = [t for b, (start, n) in enumerate(zip(_starts(batch.num_new_list), batch.num_new_list))
            if not long[b] for t in range(start, start + n)]
    if rows:
        idx = torch.tensor(rows, dtype=torch.long, device=q.device)
        tables, seq_lens = batch.token_rows()
        # the short sequences' rows keep the groups they have in a step of their own
        per = cache.ragged_tokens_per_program
        groups = batch.token_row_groups(per, short_only=True) if per > 1 else None
        out[idx] = _kernel(q.index_select(0, idx), cache, layer, tables.index_select(0, idx),
                           seq_lens.index_select(0, idx), scale, groups)
    return out


def _starts(num_new: list[int]) -> list[int]:
    starts, at = [], 0
    for n in num_new:
        starts.append(at)
        at += n
    return starts


def attention_path(cache: PagedKVCache, batch: PagedBatch, on_cuda: bool) -> str:
    """Which path ``paged_attention`` takes: ``decode_kernel``, ``ragged_kernel`` or ``reference``.
    The kernel runs on CUDA only; ragged steps take it only with ``cache.ragged_steps_in_kernel``."""
    if cache._decode_kernel is None or not on_cuda:
        return "reference"
    if batch.is_decode:
        return "decode_kernel"
    if cache.ragged_steps_in_kernel and batch.token_seq_ids is not None:
        if max(batch.num_new_list) <= RAGGED_KERNEL_MAX_NEW:
            return "ragged_kernel"
        # batch-invariant (fixed splits): the path must not depend on a neighbour's append
        if cache.fixed_num_splits is not None and batch.num_seqs > 1:
            return "per_sequence"
    return "reference"


def _reference_paged_attention(
    q: torch.Tensor, cache: PagedKVCache, layer: int, batch: PagedBatch, scale: float,
    only: list[bool] | None = None,
) -> torch.Tensor:
    """Gather each sequence's blocks into a contiguous K/V and run SDPA with a causal offset
    (``only``: the sequences to compute; the other rows are left unwritten)."""
    out = torch.empty_like(q)
    group = q.shape[1] // cache.num_kv_heads
    bs = cache.block_size
    start = 0
    for b in range(batch.num_seqs):
        computed, new = batch.num_computed_list[b], batch.num_new_list[b]
        if new == 0:
            continue
        if only is not None and not only[b]:
            start += new
            continue
        seq_len = computed + new
        blocks = batch.block_tables[b, : -(-seq_len // bs)].long()
        k, v = cache.gather_blocks(layer, blocks)  # (n * bs, Hkv, D); fp8 comes back dequantized
        k, v = k[:seq_len], v[:seq_len]  # (S, Hkv, D)
        # GQA: query head h reads kv head h // group (same order as transformers' repeat_kv).
        k = k.repeat_interleave(group, dim=1).transpose(0, 1).to(q.dtype)  # (Hq, S, D)
        v = v.repeat_interleave(group, dim=1).transpose(0, 1).to(q.dtype)
        qb = q[start : start + new].transpose(0, 1)  # (Hq, T, D)
        # New token t sits at logical index computed + t and sees keys 0 .. computed + t: the causal
        # mask aligned to the lower right of the (T, S) score matrix. As a bias object (not a
        # materialised boolean mask) CUDA runs it in the memory-efficient kernel; a boolean (T, S)
        # mask sent a 1024-token chunk over a 16k context to the math kernel (a (Hq, T, S) fp32
        # score matrix per layer, ~530 ms per chunk on an H200). On CPU it materialises the same mask.
        # (4-D: the fused kernels take only (B, H, L, D) inputs; a 3-D call falls back to the mask.)
        ob = F.scaled_dot_product_attention(
            qb[None], k[None], v[None], attn_mask=causal_lower_right(new, seq_len), scale=scale
        )[0]
        out[start : start + new] = ob.transpose(0, 1)
        start += new
    return out


def copy_blocks(cache: PagedKVCache, pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks ``src -> dst`` in every layer (copy-on-write of a shared partial block)."""
    if not pairs:
        return
    srcs = [s for s, _ in pairs]
    dsts = [d for _, d in pairs]
    for s, d in pairs:
        if not (0 <= s < cache.num_blocks and 0 <= d < cache.num_blocks):
            raise ValueError(f"copy_blocks: block pair ({s}, {d}) out of range [0, {cache.num_blocks})")
        if d == NULL_BLOCK_ID:
            raise ValueError("copy_blocks: cannot write into the null block 0")
    if len(set(dsts)) != len(dsts):
        raise ValueError(f"copy_blocks: duplicate destination blocks in {pairs}")
    if set(srcs) & set(dsts):
        # A block that is both read and written in one call would make the result depend on order.
        raise ValueError(f"copy_blocks: blocks {sorted(set(srcs) & set(dsts))} are both source and destination")
    src = torch.tensor(srcs, dtype=torch.long, device=cache.device)
    dst = torch.tensor(dsts, dtype=torch.long, device=cache.device)
    cache.k[:, dst] = cache.k[:, src]
    cache.v[:, dst] = cache.v[:, src]
    if cache.quantized:
        # A token's scale travels with its bytes: the copy dequantizes exactly like the source.
        cache.k_scale[:, dst] = cache.k_scale[:, src]
        cache.v_scale[:, dst] = cache.v_scale[:, src]
