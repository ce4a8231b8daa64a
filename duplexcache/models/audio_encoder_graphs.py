"""Piecewise CUDA graphs of the streaming audio encoder (deploy key ``engine.cuda_graphs``).

Why: the encoder runs every tick for every session with audio, eagerly: on the H200 at 40
sessions its stage launched 652 kernels for 11 ms of kernel time in a ~96 ms span (profile of
2026-12-05), and the launch count does not shrink with sessions, so a tick of one or two reply
starts pays ~50 ms of it. Measured on the H200 (2026-12-06): the encoder stage 50.7 -> 4.5 ms
at one session, 60.7 -> 10.9 at two. Its per-session caches move as they grow (``StreamingAudioEncoderState``
grows by 125 frames), so the layers' cache store and gather cannot be captured; everything
between them can (vLLM's piecewise graphs, with the cache traffic as the eager piece).

Per tick, for a key (batch bucket, frames per chunk ``n``):

    eager   the conv fronts into the static input, positions and the key mask (one copy each)
    piece 0 positions added, layer 0's norm and q/k/v projections      -> static X, Q, K, V
    eager   layer l's new K/V into every session's cache, then every session's valid frames
            of layer l into the static gather buffer (``TickKV``: two multi-tensor copies)
    piece l+1  layer l's attention over the gather buffer (masked past each session's
            length), its feed-forward, then layer l+1's projections (the last piece: the
            final layer norm into X)

So a tick launches L + 1 replays and 2L multi-tensor copies instead of ~25 kernels per layer.
The pieces exchange nothing through the graphs' memory pool: each reads and writes static
buffers (per ``n``: X, Q, K, V of ``max_batch`` rows; shared: the gather buffer of
``max_cache_frames`` keys and the mask), so any capture order is safe. The pieces run without
autograd (the memory that once outlived the engine was their autograd history, docs/results/HISTORY.md).
The gather buffer is the eager tick's gather buffer at its largest, held for good: at minicpmo45
shapes 2 x 1500 frames x 1024 values per row, 6 MiB per row in bf16.

Numerics: the keys run to ``max_cache_frames`` with a mask instead of to the tick's longest
session, and the GEMMs multiply the bucket's rows; rows past the real ones are padding (their
mask admits key 0 only, so nothing is NaN) and are dropped. Sharing on vs off runs the same
pieces, so it stays bit-identical; the eager layers are the A/B reference. ``capture=False``
runs the same pieces eagerly over the static buffers: how the CPU tests check them.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from duplexcache.cfm.graph_capture import CudaGraphBackend
from duplexcache.kv.decode_graphs import batch_buckets, upload_host
from duplexcache.kv.kv_quant import is_quantized
from duplexcache.models.audio_encoder import AudioEncoder, StreamingAudioEncoderState, TickKV, stored_keys_values

logger = logging.getLogger(__name__)

EncoderKey = tuple[int, int]   # (batch bucket, frames per chunk)


@dataclass
class EncoderGraphStats:
    replays: int = 0     # ticks run through the pieces (graph replays, or eager with capture=False)
    captures: int = 0    # keys captured (each L + 1 pieces)
    first_uses: int = 0  # keys prepared (a capture on CUDA; the first run with capture=False)
    fallbacks: int = 0   # ticks the runner declined (more sessions than its largest bucket)


class _FrameBuffers:
    """The static activations of one chunk width ``n``: input, positions, X, Q, K, V."""

    def __init__(self, rows: int, n: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        d = heads * head_dim
        self.x_in = torch.zeros(rows, n, d, dtype=dtype, device=device)
        self.positions = torch.zeros(rows, n, dtype=torch.int64, device=device)
        self.x = torch.zeros(rows, n, d, dtype=dtype, device=device)
        # (B, n, H, D), the projections' own layout: [:, :, h] views as (B, H, n, D) are strided
        # exactly as the eager layer's q/k/v
        self.q, self.k, self.v = (torch.zeros(rows, n, heads, head_dim, dtype=dtype, device=device) for _ in range(3))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.x_in, self.positions, self.x, self.q, self.k, self.v))


class EncoderGraphs:
    """The streaming encoder's layers as piecewise graphs over static buffers (module docstring).

    ``run`` replaces ``AudioEncoder._stream_layers`` for a tick it ``accepts``; the caller has
    reset and reserved the states as for the eager layers. Owns its buffers and graphs."""

    def __init__(self, encoder: AudioEncoder, *, max_batch: int, storage_dtype: torch.dtype | None = None,
                 capture: bool = True) -> None:
        cfg = encoder.cfg
        weight = encoder.apm.conv1.weight
        if capture and weight.device.type != "cuda":
            raise ValueError(f"encoder graphs need a CUDA encoder, got {weight.device}")
        self.encoder = encoder
        self.capture = capture
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.dtype = weight.dtype
        self.quantized = is_quantized(storage_dtype)
        self.widths = tuple(sorted({cfg.chunk_frames(cfg.chunk_samples), cfg.chunk_frames(cfg.first_chunk_samples)}))
        dev, rows, heads, head_dim = weight.device, self.max_batch, cfg.encoder_attention_heads, cfg.head_dim
        self.key_frames = cfg.max_cache_frames
        self._frames = {n: _FrameBuffers(rows, n, heads, head_dim, self.dtype, dev) for n in self.widths}
        store = self.dtype if storage_dtype is None else storage_dtype
        self._stored = torch.zeros(2, rows, self.key_frames, heads, head_dim, dtype=store, device=dev)
        self._scales = (torch.zeros(2, rows, self.key_frames, heads, dtype=torch.float32, device=dev)
                        if self.quantized else None)
        self._mask = torch.zeros(rows, 1, 1, self.key_frames, dtype=torch.bool, device=dev)
        self._mask[..., 0] = True   # a row's first key: padding rows attend to it, never to nothing
        self._backend = CudaGraphBackend() if capture else None
        self._pieces: dict[EncoderKey, list[Callable[[], None]]] = {}
        self.stats = EncoderGraphStats()

    # ------------------------------------------------------------------ public

    def nbytes(self) -> int:
        """Static buffers (the graphs' temporaries live in their pool, not counted here)."""
        fixed = [self._stored, self._mask] + ([self._scales] if self._scales is not None else [])
        return sum(t.numel() * t.element_size() for t in fixed) + sum(f.nbytes() for f in self._frames.values())

    def keys(self) -> list[EncoderKey]:
        """Every (batch bucket, chunk width), largest first: what a warm-up prepares."""
        return [(b, n) for b in reversed(self.buckets) for n in reversed(self.widths)]

    def accepts(self, states: list[StreamingAudioEncoderState], lens: list[int]) -> bool:
        """Whether ``run`` takes this tick: it fits a bucket, its chunks a width, and the states
        are stored as the runner's buffers are (fp8 or not). A refusal is counted."""
        ok = (0 < len(states) <= self.max_batch and max(lens) in self.widths
              and all(s.quantized == self.quantized for s in states))
        if not ok:
            self.stats.fallbacks += 1
        return ok

    def warm(self, batch: int, n: int) -> bool:
        """Prepare key (batch, n) without touching a session (its pieces read the static buffers
        only). Returns False when it was ready already."""
        if batch not in self.buckets or n not in self.widths:
            raise ValueError(f"encoder graphs: ({batch}, {n}) is not a bucket x width ({self.buckets} x {self.widths})")
        if (batch, n) in self._pieces:
            return False
        self._prepare(batch, n)
        return True

    def run(self, states: list[StreamingAudioEncoderState], fronts: list[torch.Tensor],
            groups: list[tuple[list[int], torch.Tensor]]) -> torch.Tensor:
        """``AudioEncoder._stream_layers`` through the pieces: returns the final-norm hidden
        states (B, n, d) of the tick's padded batch (a fresh tensor)."""
        starts = [s.num_frames for s in states]
        lens = [f.shape[0] for f in fronts]
        num = len(states)
        batch, n = next(b for b in self.buckets if b >= num), max(lens)
        pieces = self._pieces.get((batch, n)) or self._prepare(batch, n)
        buf = self._frames[n]
        self._fill(buf, batch, starts, lens, groups)
        traffic = TickKV(states, starts, lens, self._stored[:, :batch],
                         None if self._scales is None else self._scales[:, :batch])
        pieces[0]()
        for layer, piece in enumerate(pieces[1:]):
            traffic.store(layer, buf.k[:batch].transpose(1, 2), buf.v[:batch].transpose(1, 2))
            traffic.copy_valid(layer)
            piece()
        self.stats.replays += 1
        return buf.x[:num].clone()

    # ------------------------------------------------------------------ internals

    def _fill(self, buf: _FrameBuffers, batch: int, starts: list[int], lens: list[int],
              groups: list[tuple[list[int], torch.Tensor]]) -> None:
        """The tick's inputs into the static buffers: the conv fronts (zero past a short chunk,
        as the eager batch), positions and the key mask (host-built, one copy each)."""
        num, n = len(starts), buf.x_in.shape[1]
        x = buf.x_in
        if len(groups) == 1 and groups[0][0] == list(range(num)) and lens[0] == n:
            x[:num].copy_(groups[0][1])
        else:
            x[:num].zero_()
            for idxs, front in groups:
                x[torch.tensor(idxs).to(x.device, non_blocking=True), : front.shape[1]] = front
        top = self.encoder.apm.embed_positions.weight.shape[0] - 1
        positions = np.zeros((batch, n), dtype=np.int64)
        positions[:num] = np.minimum(np.asarray(starts)[:, None] + np.arange(n), top)
        mask = np.zeros((batch, self.key_frames), dtype=bool)
        mask[:, 0] = True   # padding rows
        for b, (start, length) in enumerate(zip(starts, lens)):
            mask[b, : start + length] = True
        upload_host(positions, buf.positions[:batch], pinned=self.capture)
        upload_host(mask, self._mask[:batch, 0, 0], pinned=self.capture)

    def _prepare(self, batch: int, n: int) -> list[Callable[[], None]]:
        """Key (batch, n): its L + 1 pieces, captured (CUDA) or as eager callables."""
        fns = [self._piece(batch, n, layer) for layer in range(len(self.encoder.apm.layers) + 1)]
        if self._backend is not None:
            fns = [self._backend.capture(fn) for fn in fns]
            self.stats.captures += 1
            logger.info("encoder graphs: captured batch=%d frames=%d (%d pieces)", batch, n, len(fns))
        self._pieces[(batch, n)] = fns
        self.stats.first_uses += 1
        return fns

    def _piece(self, batch: int, n: int, index: int) -> Callable[[], None]:
        """Piece ``index``: layer ``index - 1`` from its attention on (none for 0), then layer
        ``index``'s projections into Q, K, V (the last piece: the final norm). Everything it
        reads and writes is a static buffer."""
        apm, buf = self.encoder.apm, self._frames[n]
        layers = apm.layers
        pos_table = apm.embed_positions.weight
        scales = None if self._scales is None else self._scales[:, :batch]

        # Autograd off inside the piece, whoever calls it (a capture, the warm-up, a tick): with it
        # on, the copies into the static buffers would chain every piece's activations into the
        # buffers' grad_fn, a C++ reference cycle that outlives the engine (H100, 2026-12-06: 7 GiB
        # still allocated after the engine was freed; scripts/probes/graph_leak_probe.py).
        @torch.no_grad()
        def piece() -> None:
            if index == 0:
                # contiguous as the eager layers' input: a strided sum could change GEMM bits
                x = (buf.x_in[:batch] + pos_table[buf.positions[:batch]]).contiguous()
            else:
                keys, values = stored_keys_values(self._stored[:, :batch], scales, self.dtype)
                x = layers[index - 1].finish(buf.x[:batch], buf.q[:batch].transpose(1, 2), keys, values,
                                             self._mask[:batch])
            if index == len(layers):
                buf.x[:batch].copy_(apm.layer_norm(x))
                return
            q, k, v = layers[index].project(x)
            buf.q[:batch].copy_(q.transpose(1, 2))
            buf.k[:batch].copy_(k.transpose(1, 2))
            buf.v[:batch].copy_(v.transpose(1, 2))
            buf.x[:batch].copy_(x)

        return piece
