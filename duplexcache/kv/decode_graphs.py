"""CUDA graphs of a decoder's one-token paged step (the Thinker's and the Talker's decode).

Why: at minicpmo45 shapes a decode step launches ~900 small kernels (36 layers of norms, RoPE,
projections, the KV write and the paged attention kernel). Launched one by one from Python an
H200 tick spent 760 ms of CPU for 97 ms of GPU work at one session (profiled 2026-12-02), so the
engine was launch-bound long before it was GPU-bound. A captured graph replays all of them with
one launch, the way vLLM and SGLang run decode.

A graph has fixed shapes and fixed addresses, so every input lives in a static buffer that each
step overwrites, and the graph is keyed by

* ``batch``: the number of sequences, rounded up to a bucket (1, 2, 4, 8, then multiples of 8 up
  to ``max_batch``). Rows past the real ones are padding: position 0, one token, written to and
  read from slot 0 of the null block, which no live sequence reads. Every operation in the step
  is row-wise except attention, and attention only reads a row's own blocks, so padding rows
  never change a real row.
* ``width``: the block-table width, a power of two of blocks (>= 16) that covers the longest
  table. The attention kernel sizes its sequence splits from the width, so one width per graph
  keeps the split plan (and the summation order) fixed.

Graphs are captured the first time a (batch, width) is needed, into one memory pool, or ahead of
time by ``warm`` (the engine's warm-up, runtime/warmup.py, captures every key a reference session
can need before the server reports ready, largest first so smaller graphs reuse the pool).

Numerics: a padded step multiplies ``bucket`` rows where the eager step multiplies ``B``, and
cuBLAS may pick another kernel for another row count, so a graphed step can differ from the
eager step in the last bits. Every session of a step sees the same bucket, so two engines that
run the same sessions in the same ticks (sharing on vs off) still agree bit for bit.

``capture=False`` runs the same padded static-buffer step eagerly; that is how the CPU tests
exercise the buffer filling, padding and bucketing without a GPU.

Short ragged steps (``run_ragged``, deploy key ``engine.cuda_graphs``): the in-place
kernel already runs a ragged step as one decode row per new token (its sequence's table, its
causal length; ``PagedBatch.token_rows``), and every other operation is row-wise, so a step of
a few tokens per sequence (a unit's append, the Talker's condition) is a decode step over its
token rows. When they fit a bucket it replays the same graphs, one launch instead of the ~900
of an eager step: at one or two sessions those launches were most of a tick. A runner built with
``max_rows`` adds coarse row buckets past ``max_batch`` (powers of two) for such steps, so a unit
tick of every session (~12 rows each) replays a graph too. The static buffers also name each
kernel program's row group (``_GROUP_FIRST`` / ``_GROUP_COUNT``): in a ragged step, runs of one
sequence's tokens that share each K/V tile (``cache.ragged_tokens_per_program``); in a decode step,
and for padding rows, one row each, so the same graph serves both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from duplexcache.kv.paged_attention import NULL_BLOCK_ID, RAGGED_KERNEL_MAX_NEW, PagedBatch, PagedKVCache
from duplexcache.kv.kernel_work import row_groups_host

logger = logging.getLogger(__name__)

PagedForward = Callable[[torch.Tensor, PagedBatch, PagedKVCache], torch.Tensor]

MIN_WIDTH_BLOCKS = 16
# Packed host row per sequence: position, slot, seq_len, the kernel's row group of this program
# index (first row, row count), then the block table.
_POS, _SLOT, _SEQ_LEN, _GROUP_FIRST, _GROUP_COUNT, _TABLE = 0, 1, 2, 3, 4, 5


def upload_host(host: np.ndarray, dest: torch.Tensor, pinned: bool) -> None:
    """Copy a host array into a static device buffer without waiting. ``pinned`` (CUDA): stage it
    in pinned memory; the caching host allocator keeps the staging buffer until the copy ran, so
    the next step cannot overwrite it early."""
    staged = torch.from_numpy(host)
    if pinned:
        staged = staged.pin_memory()
    dest.copy_(staged, non_blocking=True)


_WARMUP_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def warmup_stream(device: torch.device | None = None) -> torch.cuda.Stream:
    """The one side stream (per device, for the process) on which every graph capture runs its
    eager warm-up. One, not a new one per capture: the caching allocator keeps freed blocks per
    stream, and cuBLAS keeps a workspace per (handle, stream) for the life of the process, so
    hundreds of captures on fresh pooled streams spread both over up to 32 streams."""
    dev = torch.device("cuda" if device is None else device)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[dev] = torch.cuda.Stream(dev)
    return _WARMUP_STREAMS[dev]


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then multiples of 8, up to the first bucket that holds ``max_batch``."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    buckets = [1]
    while buckets[-1] < max_batch:
        last = buckets[-1]
        buckets.append(last * 2 if last < 8 else last + 8)
    return tuple(buckets)


def row_buckets(max_batch: int, max_rows: int = 0) -> tuple[int, ...]:
    """``batch_buckets(max_batch)``, then powers of two up to the first that holds ``max_rows``
    (coarse: each is a graph per width class, and a padded row costs only its GEMM share)."""
    buckets = list(batch_buckets(max_batch))
    while buckets[-1] < max_rows:
        buckets.append(1 << buckets[-1].bit_length())   # the next power of two above the last
    return tuple(buckets)


def width_classes(max_blocks_per_seq: int) -> tuple[int, ...]:
    """Powers of two from ``MIN_WIDTH_BLOCKS`` up to the first that covers ``max_blocks_per_seq``."""
    if max_blocks_per_seq < 1:
        raise ValueError(f"max_blocks_per_seq must be >= 1, got {max_blocks_per_seq}")
    widths = [MIN_WIDTH_BLOCKS]
    while widths[-1] < max_blocks_per_seq:
        widths.append(widths[-1] * 2)
    return tuple(widths)


@dataclass
class DecodeGraphStats:
    """Counters of one runner (cumulative)."""

    replays: int = 0          # steps run through the static buffers (graph replays, or eager when capture=False)
    ragged_replays: int = 0   # ragged steps run as token rows (run_ragged); not counted in replays
    captures: int = 0         # graphs captured
    # First uses of a (batch, width) key: a capture on CUDA; with capture=False the step that would
    # have captured (how CPU tests prove that a warm-up leaves nothing to capture in a tick).
    first_uses: int = 0
    eager_fallbacks: int = 0  # steps the runner declined (too many sequences or too long a table)
    # Growth of the allocator's reserved bytes during captures: the graphs' activations, which
    # live in the activation reserve. Approximate: the first engine of a process pays for
    # segments that later engines reuse (92 MiB vs 0-2 MiB at minicpmo45 shapes), so it is not
    # listed with the engine's pools (they hold session state, counted exactly).
    pool_bytes: int = 0


class PagedDecodeGraphs:
    """One decoder's one-token paged step over static buffers, replayed from CUDA graphs.

    ``forward(embeds, batch, cache) -> hidden`` is the model's paged forward (``forward_paged``);
    it must not synchronise with the host. ``run`` takes the real rows and returns their hidden
    states (a fresh tensor). The runner owns its buffers and graphs; ``close`` drops them.
    """

    def __init__(self, name: str, forward: PagedForward, cache: PagedKVCache, hidden_size: int,
                 dtype: torch.dtype, *, max_batch: int, max_blocks_per_seq: int, capture: bool = True,
                 max_rows: int = 0) -> None:
        if capture and cache.device.type != "cuda":
            raise ValueError(f"{name}: CUDA graphs need a CUDA cache, got {cache.device}")
        if capture and cache.decode_backend != "triton":
            # The reference attention loops over sequences on the host with their lengths: it
            # cannot be captured with lengths that change every step.
            raise ValueError(f"{name}: CUDA graphs need the cache's in-place decode kernel "
                             "(set_decode_backend('triton'))")
        self.name = name
        self.forward = forward
        self.cache = cache
        self.capture = capture
        self.buckets = batch_buckets(max_batch)            # decode steps: one row per sequence
        self.row_buckets = row_buckets(max_batch, max_rows)   # ragged steps as token rows (run_ragged)
        self.widths = width_classes(max_blocks_per_seq)
        self.max_batch, self.max_width = self.buckets[-1], self.widths[-1]
        self.max_rows = self.row_buckets[-1]
        dev = cache.device
        self._embeds = torch.zeros(self.max_rows, hidden_size, dtype=dtype, device=dev)
        self._packed = torch.zeros(self.max_rows, _TABLE + self.max_width, dtype=torch.int64, device=dev)
        self._query_start = torch.arange(self.max_rows + 1, dtype=torch.int64, device=dev)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._used: set[tuple[int, int]] = set()   # keys run (captured) at least once
        self.stats = DecodeGraphStats()

    # ------------------------------------------------------------------ public

    def can_run(self, num_seqs: int, max_table_blocks: int) -> bool:
        return 0 < num_seqs <= self.max_batch and max_table_blocks <= self.max_width

    def accepts(self, block_tables: list[list[int]]) -> bool:
        """``can_run`` for these sequences; a refusal is counted as an eager fallback."""
        ok = self.can_run(len(block_tables), max((len(t) for t in block_tables), default=0))
        if not ok:
            self.stats.eager_fallbacks += 1
        return ok

    def accepts_ragged(self, block_tables: list[list[int]], num_new: list[int]) -> bool:
        """Whether ``run_ragged`` takes this step: the cache sends short ragged steps through the
        in-place kernel (``stage0.ragged_kernel``; off, they keep the reference path), no
        sequence adds more than that kernel's limit, and the token rows fit a graph. A refusal
        is not a fallback: long steps (context prefill, many sessions) are eager by design."""
        rows = sum(num_new)
        longest = max((len(t) for t, n in zip(block_tables, num_new) if n > 0), default=0)
        return (self.cache.ragged_steps_in_kernel and 0 < rows <= self.max_rows
                and max(num_new) <= RAGGED_KERNEL_MAX_NEW and longest <= self.max_width)

    def run_ragged(self, embeds: torch.Tensor, block_tables: list[list[int]], num_computed: list[int],
                   num_new: list[int]) -> torch.Tensor:
        """A ragged step as one decode row per new token: ``embeds`` (N, H), the tokens of each
        sequence in order, ``num_new[b]`` of them at logical indices ``num_computed[b]``... of
        ``block_tables[b]``. Each row writes its token's K/V and attends over its causal length,
        as the ragged kernel path does (``accepts_ragged`` first). Returns the hidden states (N, H)."""
        row_tables: list[list[int]] = []
        row_computed: list[int] = []
        for table, computed, n in zip(block_tables, num_computed, num_new):
            row_tables += [table] * n
            row_computed += range(computed, computed + n)
        out = self._run(embeds, row_tables, row_computed, self.max_rows, num_new)
        self.stats.ragged_replays += 1
        return out

    def run(self, embeds: torch.Tensor, block_tables: list[list[int]], num_computed: list[int]) -> torch.Tensor:
        """Append one token per sequence: ``embeds`` (B, H), the token of sequence ``b`` at
        logical index ``num_computed[b]`` of ``block_tables[b]`` (which must cover it).
        Returns the final hidden states (B, H)."""
        out = self._run(embeds, block_tables, num_computed, self.max_batch)
        self.stats.replays += 1
        return out

    def _run(self, embeds: torch.Tensor, block_tables: list[list[int]], num_computed: list[int],
             most_rows: int, num_new: list[int] | None = None) -> torch.Tensor:
        num_seqs = len(block_tables)
        if embeds.shape[0] != num_seqs or len(num_computed) != num_seqs:
            raise ValueError(f"{self.name}: {embeds.shape[0]} rows, {num_seqs} tables, {len(num_computed)} lengths")
        longest = max((len(t) for t in block_tables), default=0)
        if not (0 < num_seqs <= most_rows and longest <= self.max_width):
            raise ValueError(f"{self.name}: {num_seqs} sequences / {longest} blocks is outside the captured range "
                             f"({most_rows} / {self.max_width}); check can_run first")
        # the row buckets begin with the decode buckets: a decode step picks the same bucket either way
        batch = next(b for b in self.row_buckets if b >= num_seqs)
        width = next(w for w in self.widths if w >= longest)
        self._note_use(batch, width)
        if self.capture:
            # Capture first: it overwrites the static buffers with a harmless step.
            graph, out = self._graphs.get((batch, width)) or self._capture(batch, width)
            self._fill(embeds, block_tables, num_computed, batch, width, num_new)
            graph.replay()
        else:
            self._fill(embeds, block_tables, num_computed, batch, width, num_new)
            out = self._step(batch, width, num_computed)
        return out[:num_seqs].clone()

    def keys(self, max_width: int | None = None) -> list[tuple[int, int]]:
        """Every (row bucket, width class), widths up to ``max_width`` blocks (default: all),
        largest first: the order a warm-up captures them in."""
        widths = [w for w in self.widths if max_width is None or w <= max_width] or [self.widths[0]]
        return [(b, w) for b in reversed(self.row_buckets) for w in reversed(widths)]

    def is_warm(self, batch: int, width: int) -> bool:
        return (batch, width) in self._used

    def warm(self, batch: int, width: int) -> bool:
        """Prepare key (batch, width) without touching any sequence: capture its graph (CUDA), or
        with ``capture=False`` run its step once. Every row is a padding row (slot 0 of the null
        block), as in a capture. Returns False when the key was ready already."""
        if batch not in self.row_buckets or width not in self.widths:
            raise ValueError(f"{self.name}: ({batch}, {width}) is not a bucket x width class "
                             f"({self.row_buckets} x {self.widths})")
        if self.is_warm(batch, width):
            return False
        self._note_use(batch, width)
        if self.capture:
            self._capture(batch, width)
        else:
            self._pad_all(batch)
            self._step(batch, width)
        return True

    def close(self) -> None:
        self._graphs.clear()
        self._used.clear()
        self._pool = None

    def _note_use(self, batch: int, width: int) -> None:
        if (batch, width) not in self._used:
            self._used.add((batch, width))
            self.stats.first_uses += 1

    # ------------------------------------------------------------------ internals

    def _pad_all(self, batch: int) -> None:
        """Every row a padding row (slot 0 of the null block), each its own row group."""
        self._packed[:batch].zero_()
        self._packed[:batch, _SEQ_LEN] = 1
        self._packed[:batch, _GROUP_FIRST] = torch.arange(batch, device=self._packed.device)
        self._packed[:batch, _GROUP_COUNT] = 1

    def _fill(self, embeds: torch.Tensor, tables: list[list[int]], num_computed: list[int],
              batch: int, width: int, num_new: list[int] | None = None) -> None:
        """Write a step into the static buffers. ``num_new`` (a ragged step): the rows' sequences,
        whose runs of rows become the kernel's row groups; None: one group per row (decode)."""
        bs = self.cache.block_size
        host = np.zeros((batch, _TABLE + width), dtype=np.int64)
        host[:, _SEQ_LEN] = 1   # padding rows: one token at position 0 in slot 0 of the null block
        per = self.cache.ragged_tokens_per_program
        if num_new is not None and per > 1:
            # program g takes group g; the padding rows one each, the programs left over idle
            first, count = row_groups_host(num_new, per, programs=batch, padding_rows=batch - len(tables))
            host[:, _GROUP_FIRST], host[:, _GROUP_COUNT] = first, count
        else:
            host[:, _GROUP_FIRST], host[:, _GROUP_COUNT] = np.arange(batch), 1
        # run_ragged passes one table object per token row: convert each once (a list written
        # row by row cost ~4 ms at 32 sessions x 12 rows of ~450 blocks; ~0.6 ms converted once)
        converted: dict[int, np.ndarray] = {}
        for b, (table, computed) in enumerate(zip(tables, num_computed)):
            if computed < 0 or computed >= len(table) * bs:
                raise ValueError(f"{self.name}: sequence {b} writes index {computed} past its "
                                 f"{len(table)}-block table")
            block = table[computed // bs]
            if block == NULL_BLOCK_ID:
                raise ValueError(f"{self.name}: sequence {b} would write into the null block")
            host[b, _POS] = computed
            host[b, _SLOT] = block * bs + computed % bs
            host[b, _SEQ_LEN] = computed + 1
            row = converted.get(id(table))
            if row is None:
                row = converted[id(table)] = np.asarray(table, dtype=np.int64)
            host[b, _TABLE:_TABLE + row.size] = row
        upload_host(host, self._packed[:batch, :_TABLE + width], pinned=self.capture)
        self._embeds[: embeds.shape[0]].copy_(embeds)

    def _step(self, batch: int, width: int, num_computed: list[int] | None = None) -> torch.Tensor:
        """The captured computation: everything it reads lives in the static buffers."""
        p = self._packed[:batch]
        computed = list(num_computed or []) + [0] * (batch - len(num_computed or []))
        step = PagedBatch(
            query_start_loc=self._query_start[: batch + 1],
            seq_lens=p[:, _SEQ_LEN].to(torch.int32),
            block_tables=p[:, _TABLE:_TABLE + width].to(torch.int32),
            slot_mapping=p[:, _SLOT].contiguous(),
            positions=p[:, _POS].contiguous(),
            block_size=self.cache.block_size,
            # Host lists for the reference (CPU) path; the in-place kernel reads seq_lens only.
            num_computed_list=computed,
            num_new_list=[1] * batch,
            row_groups=(p[:, _GROUP_FIRST].to(torch.int32), p[:, _GROUP_COUNT].to(torch.int32)),
        )
        return self.forward(self._embeds[:batch], step, self.cache)

    def _capture(self, batch: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        dev = self.cache.device
        # The buffers must describe a harmless step while warming up and capturing: every row
        # a padding row (slot 0 of the null block).
        self._pad_all(batch)
        torch.cuda.synchronize(dev)
        reserved = torch.cuda.memory_reserved(dev)
        side = warmup_stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        # no autograd (a graph never runs backward; see CudaGraphBackend.capture)
        with torch.no_grad(), torch.cuda.stream(side):   # compiles kernels, creates cuBLAS state outside the capture
            self._step(batch, width)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph, pool=self._pool):
            out = self._step(batch, width)
        torch.cuda.synchronize(dev)
        self.stats.captures += 1
        self.stats.pool_bytes += max(0, torch.cuda.memory_reserved(dev) - reserved)
        self._graphs[(batch, width)] = (graph, out)
        logger.info("%s: captured decode graph batch=%d width=%d blocks (%d graphs)", self.name, batch,
                    width, len(self._graphs))
        return graph, out
