"""Whole-Euler arena: all 10 Euler steps of a micro-batch as one unit over static buffers.

Row layout: session row r holds its cond row and its uncond row side by side (cfg axis right
after the row axis), so a tier of `t` rows is the contiguous prefix `[:t]` of every buffer and a
session's slot `[:, :, r]` has exactly the per-session cache layout
(steps, layers, cfg=2, heads, frames, 2*head_dim).

Attention: a row holds only its chunk's new keys; the session's private delta frames stay in the
session's own storage and the voice prompt's keys in the `PromptBank` (once per voice); the solve
reads both in place. Per (step, layer, row, cfg, head), along the key axis (d_r = the row's
private delta, s_r = its shared prompt frames, L_r = d_r + s_r):

    arena row (static, per row)        0        W            row_capacity (the widest chunk)
                                       | new KV |   unused   |

    session storage (its own, P frames; `SharedPromptAttCache.storage`, `PlainAttCache.data`)
                                       | frames in any order: delta key j at pos_r[j], j < d_r |

    PromptBank (static, per voice)     0     off_v                  off_v + P_v
                                       | 0 | ... | voice v: prompt[0:P_v] | ... |   (frame 0 = zeros)

    frame_map[r, j] (j < Lb)           0 .. 0 | off_v + [0, h_r) | off_v + [P_v - tail, P_v) | 0 ..
                                       'd_r -'  '-- s_r = h_r (+ tail once trimmed) --'      pad

    workspace (transient, one per solve, K wide, reused by every (step, layer)):
                                       0        W          W + d_r     W + L_r         W + Lb     K
                                       | new KV | delta    | prompt frames | zero frames | unused |
                                       '--------- reference key order ---------'  masked

At each attention the workspace gets the row's `[0, W)`, then every cache key's bank frame (the
frame map: prompt frames, and the zero frame for the private and padding keys; one
`index_select` per (step, layer) over the tier's rows), then the private keys j < d_r over
those, gathered from each row's session storage at `pos_r[j]` (cfm/private_gather.py: on CUDA a
Triton kernel reading a static per-row table of storage addresses, frame counts, delta lengths
and positions, filled by `load_row` and sent once per `run`, so it runs inside the captured
graph; on CPU one `index_select` per row). So the workspace holds, value for value and stride
for stride, what the old layout's row held (`[new KV | cache copied in | padding]`, K wide), and
the attention call is the same call: sharing on/off and old/new layout stay `torch.equal`.
Nothing of a cache is copied into the arena, and after a solve the session copies only the
chunk's W new keys out of the row (`advance`). Keys past W + L_r are masked (rows of one
micro-batch have their own cache lengths; masked keys read finite zeros, so they add exact
zeros). Lb is a cache-length bucket. K = max(largest setup width, largest chunk width + largest
cache): the setup pass (width P, no cache) and a chunk (width <= 56, cache <= P + 100) never need
more.

Storage: one allocation of max(rows x row_capacity, P) frames holds two views, `att` (the rows,
row_capacity = the widest chunk) and `att_setup` (one row of P frames: the voice's setup pass,
run alone at tier 1 by `register_voice`, which is wider than a chunk and has no cache); a solve
writes into the view its width needs. Both addresses are fixed, so graphs of either stay valid.
minicpmo45 (16 rows, W 56, float32, 1.25 MiB a frame): keys 1.09 GiB, `nbytes` 1.18 GiB, where
rows of [new | delta] took 7.04 GiB and the whole cache copied per row 8.99 GiB.

The old layout (the whole cache copied into each K-wide row, `prompt_in_place=False`) is kept
only as the reference the equality tests (tests/cfm/test_inplace_attention.py) and the CUDA check
(tests/cfm/test_inplace_attention_cuda.py) compare against. Cost of the in-place read: the
workspace plus one gather of the bank frames per (step, layer) and the private-key gather,
transient (the workspace and the gathered bank frames, about 2 x 2 x tier x heads x K x 2hd
elements; ~135 MiB at 20 rows of minicpmo45, in the graph pool). The row table points rows
without a delta (padded rows, a first chunk) at a live buffer (the bank), so a replay never
holds a freed address; a run drops its rows' storage references when it ends (a session may
replace its storage after the chunk), so every run loads its rows first (`warm` pads them).

CUDA graphs (policy: capture at warm-up, lazy as a fallback). `run` looks up the key (tier, W,
Lb); the first time a key is needed it is captured (one eager warm-up on a side stream, then the
capture) and from then on replayed. `warm(tier, W, L)` captures a key over padded rows ahead of
time: the engine's warm-up (runtime/warmup.py) captures every key its sessions can meet before
the server reports ready, so a tick captures nothing. Tiers come from the graph grid via `replay_groups` (the smallest tier that fits; rows
past the batch are padded slots whose inputs are zeros), so the set of keys is small: per tier,
one width per chunk size and one bucket per 64 frames of cache. All graphs share one memory pool.
That is safe in any capture order because `_euler` keeps nothing in the pool between replays:
every result is copied into the static buffers, which live outside the pool, and replays never
overlap (one stream). The warm-up does not capture the whole grid: only the
widths and cache buckets the engine's chunks produce (most (tier, W, Lb) keys never occur), each
capture costing about two eager solves. On CPU (or with graphs off) the same `_euler` runs eagerly.
`stats` counts captures, replays and eager runs, so a caller can prove which path ran.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from duplexcache.cfm.dit_norms import norm_kernel_available, stack_qkv, torch_kernels, triton_kernels
from duplexcache.cfm.dit_solve import AttentionKeys, PrivateGather, estimator_forward, euler_times, modulations, twice
from duplexcache.cfm.graph_capture import ArenaStats, CudaGraphBackend, GraphBackend
from duplexcache.cfm.private_gather import gather_private_torch, gather_private_triton, triton_gather_available
from duplexcache.cfm.prompt_bank import PromptBank
from duplexcache.cfm.prompt_cache import FRAME_DIM, AttCache

logger = logging.getLogger(__name__)

GraphKey = tuple[int, int, int]   # (tier, query width W, cache-length bucket Lb)


class ArenaShapeError(ValueError):
    """A micro-batch does not fit the arena's static buffers."""


class ArenaGraphError(RuntimeError):
    """EulerArena: a captured graph would read or write memory that is no longer the arena's."""


class EulerArena:
    """Static buffers for `rows` sessions and the whole-Euler solve over a prefix of them.

    max_query: widest chunk (frames) that comes with a cache; max_cache: longest cache (P + 100);
    max_setup_query: widest setup pass (P frames, no cache); max_private: most private (delta)
    frames a row's cache holds (P: the trim keeps the newest P frames); None means max_cache (a
    cache all private). The estimator's weights must be final before the first `run` (graphs read
    them in place; the timestep embedding is computed once).

    prompt_in_place=False keeps the old layout (each row K wide, the whole cache copied in): the
    reference the equality tests compare against, not a deploy setting. private_gather picks the
    copy of the private keys: "auto" (Triton on CUDA, the torch gather elsewhere), "torch" or
    "triton" (tests: the CPU interpreter, or the eager reference on a GPU); dit_norms the same
    for the estimator's fused steps, the residual + LayerNorm + modulation and the attention's
    projections (cfm/dit_norms.py).
    """

    def __init__(self, estimator: nn.Module, rows: int, max_query: int, max_cache: int,
                 n_timesteps: int, cfg_rate: float, key_bucket: int = 64, max_setup_query: int = 0,
                 use_cuda_graphs: bool = True, graph_backend: GraphBackend | None = None,
                 max_private: int | None = None, prompt_in_place: bool = True,
                 prompt_bank_frames: int = 1, fixed_key_length: bool = False,
                 private_gather: Literal["auto", "torch", "triton"] = "auto",
                 dit_norms: Literal["auto", "torch", "triton"] = "auto") -> None:
        if rows < 1 or max_query < 1 or max_cache < 0 or key_bucket < 1:
            raise ValueError(f"bad arena shape: rows={rows} max_query={max_query} max_cache={max_cache} "
                             f"key_bucket={key_bucket}")
        p = next(estimator.parameters())
        device, dtype = p.device, p.dtype
        self.estimator = estimator
        self.rows, self.max_cache = rows, max_cache
        self.max_query = max(max_query, max_setup_query)
        self.n_timesteps, self.cfg_rate, self.key_bucket = n_timesteps, cfg_rate, key_bucket
        self.fixed_key_length = fixed_key_length   # Code2WavConfig.fixed_key_length
        depth = len(estimator.blocks)
        attn = estimator.blocks[0].attn
        hidden = estimator.in_proj.out_features
        mel = estimator.out_channels
        self.key_capacity = max(max_setup_query, max_query + max_cache)
        self.prompt_in_place = prompt_in_place
        self.max_private = max_cache if max_private is None else min(max_private, max_cache)
        # Frames a row keeps: the chunk's new keys only (old layout: K, the whole cache copied in).
        self.row_capacity = max_query if prompt_in_place else self.key_capacity
        self.setup_capacity = max_setup_query
        private_gather = _kernel_choice("private_gather", private_gather, device, triton_gather_available(device))
        self.private_gather = private_gather
        # the projections kernel reads a head as one power-of-two block
        head_pow2 = attn.head_dim & (attn.head_dim - 1) == 0
        self.dit_norms = _kernel_choice("dit_norms", dit_norms, device, norm_kernel_available(device) and head_pow2)
        z = dict(device=device, dtype=dtype)
        width = self.max_query
        self.x = torch.zeros(rows, mel, width, **z)        # initial noise per row
        self.out = torch.zeros(rows, mel, width, **z)      # mel per row after n steps
        self.mu = torch.zeros(rows, mel, width, **z)
        self.cond = torch.zeros(rows, mel, width, **z)
        self.spks = torch.zeros(rows, mel, **z)
        self.cnn_in = torch.zeros(n_timesteps, depth, rows, 2, 2 * hidden, 2, **z)
        self.cnn_out = torch.zeros_like(self.cnn_in)
        # The rows' new keys, and the setup pass's (wider than a chunk, one row, no cache): one
        # allocation, two views of it (a solve uses the one its width needs; both addresses are
        # fixed, so graphs of either stay valid). Old layout: rows K wide, the setup fits a row.
        frame = (2, attn.num_heads, 2 * attn.head_dim)
        frames = max(rows * self.row_capacity, max_setup_query)
        self._att_storage = torch.zeros(n_timesteps * depth * frames * math.prod(frame), **z)
        self.att = self._att_view_of(rows, self.row_capacity)
        self.att_setup = self._att_view_of(1, max_setup_query)
        self.bank = PromptBank(n_timesteps, depth, attn.num_heads, attn.head_dim, device, dtype,
                               prompt_bank_frames)
        self._bank_version = self.bank.version
        # Per row, in one buffer (one host-to-device copy per run): cache length, private delta
        # frames d_r, and where the delta is: its storage's address and frame count (the Triton
        # gather reads them; `private_gather.py`).
        self._row_index = torch.zeros(4, rows, dtype=torch.long, device=device)
        self.cache_len, self.private_len, self.private_base, self.private_cap = self._row_index.unbind(0)
        # Per row and cache key: the bank frame it reads (0 = the zero frame) and, for j < d_r,
        # the storage frame of delta key j. Filled on the host by load_row, copied once per run.
        self._row_maps = torch.zeros(2, rows, self.key_capacity, dtype=torch.long, device=device)
        self.frame_map, self.private_pos = self._row_maps.unbind(0)
        self._host_row_maps = torch.zeros(2, rows, self.key_capacity, dtype=torch.long)
        # Rows' lengths and storages as loaded, sent once per run: a per-row write of a Python int
        # into a device tensor is a blocking copy each.
        self._host_cache_len = [0] * rows
        self._host_private_len = [0] * rows
        # Each row's delta storage, held from load_row to the end of its run only (a session's
        # replaced storage must not outlive its chunk here).
        self._row_storage: list[torch.Tensor | None] = [None] * rows
        self.t_steps, self.dt_steps = euler_times(n_timesteps, device, dtype)
        self.t_emb = torch.zeros(n_timesteps, hidden, **z)   # timestep embedding per Euler step
        # every block's adaLN outputs per step (dit_solve.modulations), computed with t_emb
        self.block_mods = torch.zeros(n_timesteps, depth, 9, hidden, **z)
        self.final_mods = torch.zeros(n_timesteps, 2, hidden, **z)
        # the fused kernels' q, k, v projections stacked per block (filled with the above)
        inner = 3 * attn.num_heads * attn.head_dim
        fused = self.dit_norms == "triton"
        self.qkv_weight = torch.zeros(depth if fused else 0, inner, hidden, **z)
        self.qkv_bias = torch.zeros(depth if fused else 0, inner, **z)
        self.kernels = triton_kernels(self.qkv_weight, self.qkv_bias) if fused else torch_kernels()
        self._t_emb_ready = False
        if graph_backend is None and use_cuda_graphs and device.type == "cuda":
            graph_backend = CudaGraphBackend()
        if prompt_in_place and private_gather == "torch" and isinstance(graph_backend, CudaGraphBackend):
            # the torch gather reads the rows' tensors on the host: a graph would bake in the first ones
            raise ValueError("CUDA graphs of the Code2Wav arena need Triton (the private-key gather runs "
                             "inside the graph); install triton or turn code2wav's CUDA graphs off")
        self.graph_backend = graph_backend
        self._graphs: dict[GraphKey, Callable[[], None]] = {}
        self.stats = ArenaStats()
        self._buffer_ptrs = self._ptrs()

    def _att_view_of(self, rows: int, frames: int) -> torch.Tensor:
        steps, depth = self.n_timesteps, len(self.estimator.blocks)
        attn = self.estimator.blocks[0].attn
        shape = (steps, depth, rows, 2, attn.num_heads, frames, 2 * attn.head_dim)
        return self._att_storage[:math.prod(shape)].view(shape)

    def _att_view(self, width: int) -> torch.Tensor:
        """The view a solve of `width` frames writes its new keys into: the rows, or (wider than
        a row: the setup pass) the setup view."""
        return self.att if width <= self.row_capacity else self.att_setup

    @property
    def use_graphs(self) -> bool:
        return self.graph_backend is not None

    @property
    def graph_keys(self) -> list[GraphKey]:
        return list(self._graphs)

    # ---- filling rows ------------------------------------------------------------------
    def add_voice(self, name: str, att: torch.Tensor) -> torch.Tensor:
        """Store a voice's prompt state (steps, depth, 2, heads, P, 2hd) in the bank, once; returns
        the view that is the voice's state from now on. If the bank had to grow, graphs captured
        over the old bank are dropped (captured again when next needed) and the caller must
        re-point earlier voices' views (`bank.view`)."""
        view = self.bank.add(name, att)
        if self.bank.version != self._bank_version:
            # Only graphs with cache keys (bucket > 0) read the bank.
            stale = [key for key in self._graphs if key[2] > 0]
            if stale:
                logger.warning("prompt bank grew to %d frames after %d graphs reading it were captured: "
                               "dropping them (size code2wav's prompt_bank_frames for every voice)",
                               self.bank.num_frames, len(stale))
                for key in stale:
                    del self._graphs[key]
            self._bank_version = self.bank.version
            self._buffer_ptrs = self._ptrs()
        return view

    def remove_voice(self, name: str) -> None:
        self.bank.remove(name)

    def load_row(self, row: int, width: int, noise: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor,
                 cond: torch.Tensor | None, cnn_cache: torch.Tensor | None, att_cache: AttCache | None,
                 voice: str | None = None) -> None:
        """Copy one session's inputs into row `row`. noise, mu, cond (mel, W); spks (mel,).

        Nothing of the cache is copied: the row gets where its private delta is (the session's
        storage and each delta key's position in it, `private_frames`), and which bank frames
        its prompt keys are (`voice`'s slot); the solve reads both in place. (Old layout: the
        whole cache copied into the row, by `copy_range_to`.)
        """
        cache_len = 0 if att_cache is None else len(att_cache)
        private = 0 if att_cache is None else att_cache.num_delta
        if width > self.max_query or width + cache_len > self.key_capacity:
            raise ArenaShapeError(
                f"chunk of {width} frames with a cache of {cache_len} does not fit the arena "
                f"(max query {self.max_query}, key capacity {self.key_capacity})")
        if width > self.row_capacity and (row != 0 or cache_len):
            raise ArenaShapeError(f"only the setup pass (row 0, no cache) may be wider than the arena rows "
                                  f"({self.row_capacity} frames): {width} frames in row {row} with a "
                                  f"cache of {cache_len}")
        if self.prompt_in_place and private > self.max_private:
            raise ArenaShapeError(f"a cache of {private} private frames exceeds the arena's "
                                  f"{self.max_private} (max_private)")
        if self.prompt_in_place and cache_len > private and voice is None:
            raise ValueError("a cache with prompt frames needs its voice (the bank slot to read)")
        self.x[row, :, :width].copy_(noise)
        self.mu[row, :, :width].copy_(mu)
        self.spks[row].copy_(spks)
        if cond is None:
            self.cond[row, :, :width].zero_()
        else:
            self.cond[row, :, :width].copy_(cond)
        if cnn_cache is None:
            self.cnn_in[:, :, row].zero_()
        else:
            self.cnn_in[:, :, row].copy_(cnn_cache)
        fmap, pmap = self._host_row_maps[:, row]
        fmap.zero_()
        storage = None
        if not self.prompt_in_place:
            if cache_len:
                att_cache.copy_range_to(self.att[:, :, row, :, :, width:width + cache_len], 0, cache_len)
            private = 0
        elif cache_len:
            if private:
                storage, positions = att_cache.private_frames()
                self._check_storage(storage, len(positions), private)
                pmap[:private] = torch.tensor(positions, dtype=torch.long)
            off, p, head, tail = self.bank.offset(voice), att_cache.num_prompt, att_cache.head, att_cache.tail
            if self.bank.view(voice).shape[FRAME_DIM] != p:
                raise ValueError(f"voice {voice!r} has {self.bank.view(voice).shape[FRAME_DIM]} prompt "
                                 f"frames, the cache {p}")
            # cache key j: [0, d) private, [d, d + head) prompt[0:head], then prompt[P - tail:P]
            fmap[private:private + head] = torch.arange(off, off + head)
            if att_cache.trimmed:
                fmap[private + head:private + head + tail] = torch.arange(off + p - tail, off + p)
        self._host_cache_len[row] = cache_len
        self._host_private_len[row] = private
        self._row_storage[row] = storage

    def _check_storage(self, storage: torch.Tensor, num_positions: int, private: int) -> None:
        attn = self.estimator.blocks[0].attn
        want = (self.n_timesteps, len(self.estimator.blocks), 2, attn.num_heads, 2 * attn.head_dim)
        got = tuple(storage.shape[:FRAME_DIM]) + tuple(storage.shape[FRAME_DIM + 1:])
        if got != want or storage.dtype != self.att.dtype or storage.device != self.att.device:
            raise ValueError(f"private storage {tuple(storage.shape)} {storage.dtype} on {storage.device} does "
                             f"not match the arena's frames {want} {self.att.dtype} on {self.att.device}")
        if not storage.is_contiguous():
            raise ValueError("a cache's private storage must be contiguous (the gather computes its strides)")
        if num_positions != private:
            raise ValueError(f"the cache lists {num_positions} delta positions for {private} delta frames")

    def pad_row(self, row: int, width: int) -> None:
        """A slot the replay computes but nobody reads: zero inputs, only its own new keys valid."""
        for buf in (self.x, self.mu, self.cond):
            buf[row, :, :width].zero_()
        self.spks[row].zero_()
        self.cnn_in[:, :, row].zero_()
        self._host_cache_len[row] = 0
        self._host_private_len[row] = 0
        self._host_row_maps[0, row].zero_()   # every cache key reads the zero frame (all masked)
        self._row_storage[row] = None         # its address: a live arena buffer, never read

    # ---- reading rows ------------------------------------------------------------------
    def mel(self, row: int, width: int) -> torch.Tensor:
        return self.out[row, :, :width]

    def new_cnn_cache(self, row: int) -> torch.Tensor:
        return self.cnn_out[:, :, row]                      # (steps, depth, 2, 2H, 2)

    def new_att_cache(self, row: int, length: int) -> torch.Tensor:
        """View of the row's new keys after a run of `length` frames (the chunk's W, or the setup
        pass's P in row 0): the row holds nothing else."""
        view = self._att_view(length)
        if length > view.shape[5] or row >= view.shape[2]:
            raise ArenaShapeError(f"{length} frames of row {row} asked of rows of {self.row_capacity} "
                                  f"(setup: row 0, {self.setup_capacity})")
        return view[:, :, row, :, :, :length]              # (steps, depth, 2, heads, length, 2hd)

    # ---- running -----------------------------------------------------------------------
    def bucket(self, width: int, cache_len: int) -> int:
        """Smallest cache-length bucket >= cache_len: a multiple of key_bucket, capped to capacity
        (with ``fixed_key_length``: the capacity, whatever the cache length)."""
        if self.fixed_key_length:
            return self.key_capacity - width
        return min(self.key_bucket * math.ceil(cache_len / self.key_bucket), self.key_capacity - width)

    def run(self, tier: int, width: int, max_cache_len: int) -> None:
        """Solve rows [0, tier) (all loaded or padded) for a chunk of `width` frames.

        With a graph backend: replay the graph of (tier, width, bucket), capturing it first if
        this key was never needed before. Without one: run eagerly.
        """
        if not 1 <= tier <= self.rows:
            raise ArenaShapeError(f"tier {tier} outside 1..{self.rows}")
        if not 1 <= width <= self.max_query:
            raise ArenaShapeError(f"width {width} outside 1..{self.max_query}")
        if width > self.row_capacity and tier != 1:
            raise ArenaShapeError(f"width {width} is wider than the arena rows ({self.row_capacity}): "
                                  f"only a setup pass at tier 1 may be")
        lb = self.bucket(width, max_cache_len)
        if lb < max_cache_len:
            raise ArenaShapeError(f"cache of {max_cache_len} frames does not fit with width {width}")
        missing = [r for r in range(tier) if self._host_private_len[r] and self._row_storage[r] is None]
        if missing:
            raise ArenaShapeError(f"rows {missing} were not loaded since the last run (a run consumes its rows)")
        self._prepare_time_embedding()
        # A row without a delta reads nothing from its storage; its address is still a live
        # buffer's (the bank: frame 0 is zeros), so no replay can hold a freed pointer.
        dummy = self.bank.frames
        stores = [dummy if s is None else s for s in self._row_storage[:tier]]
        self._row_index[:, :tier].copy_(torch.tensor(
            [self._host_cache_len[:tier], self._host_private_len[:tier], [s.data_ptr() for s in stores],
             [s.shape[FRAME_DIM] for s in stores]], dtype=torch.long), non_blocking=True)
        if self.prompt_in_place:
            self._row_maps[:, :tier].copy_(self._host_row_maps[:, :tier], non_blocking=True)
        try:
            self._solve(tier, width, lb)
        finally:
            # A session's storage may be replaced after its chunk (PlainAttCache): the arena
            # must not keep it alive. A later run loads its rows again first.
            self._row_storage[:tier] = [None] * tier

    def _solve(self, tier: int, width: int, lb: int) -> None:
        if self.graph_backend is None:
            self.stats.eager_runs += 1
            self._euler(tier, width, lb)
            return
        # Graphs bake in buffer addresses: refuse to replay if a buffer was replaced.
        if self._ptrs() != self._buffer_ptrs:
            raise ArenaGraphError("EulerArena static buffers changed since the arena was built; "
                                  "captured graphs would use freed memory")
        key = (tier, width, lb)
        replay = self._graphs.get(key)
        if replay is None:
            logger.info("capturing whole-Euler graph tier=%d width=%d bucket=%d", tier, width, lb)
            replay = self.graph_backend.capture(lambda: self._euler(tier, width, lb))
            self._graphs[key] = replay
            self.stats.captures += 1
        replay()
        self.stats.replays += 1

    def has_graph(self, tier: int, width: int, max_cache_len: int) -> bool:
        return (tier, width, self.bucket(width, max_cache_len)) in self._graphs

    def warm(self, tier: int, width: int, max_cache_len: int) -> bool:
        """Capture the graph `run(tier, width, max_cache_len)` would need, over padded rows
        [0, tier) (scratch: every `run` loads its rows first). Returns False when there is no
        graph backend or the key is captured already."""
        if self.graph_backend is None or self.has_graph(tier, width, max_cache_len):
            return False
        for row in range(tier):
            self.pad_row(row, width)
        self.run(tier, width, max_cache_len)
        return True

    @torch.inference_mode()
    def _prepare_time_embedding(self) -> None:
        """t_emb[k] = t_embedder(t_k) and every block's adaLN outputs of it, computed once, outside
        any graph: the embedder builds its frequency table on the host, and a host-to-device copy
        cannot be captured; the adaLN outputs are the same for every row and every solve."""
        if not self._t_emb_ready:
            self.t_emb.copy_(self.estimator.t_embedder(self.t_steps))
            blocks, final = modulations(self.estimator, self.t_emb)
            self.block_mods.copy_(blocks)
            self.final_mods.copy_(final)
            if self.qkv_weight.numel():
                stack_qkv(self.estimator.blocks, self.qkv_weight, self.qkv_bias)
            self._t_emb_ready = True

    @torch.inference_mode()
    def _euler(self, tier: int, width: int, lb: int) -> None:
        """All n Euler steps with CFG over rows [0, tier). Reads and writes static buffers only
        (anything else it allocates dies before it returns), so it can be captured as is."""
        num_keys = width + lb
        x = self.x[:tier, :, :width]
        mu = self.mu[:tier, :, :width]
        cond = self.cond[:tier, :, :width]
        spks = self.spks[:tier]
        # rows: cond, uncond, cond, uncond, ... (the uncond row has mu, spk and cond zeroed)
        mu_in = torch.stack([mu, torch.zeros_like(mu)], 1).flatten(0, 1)
        cond_in = torch.stack([cond, torch.zeros_like(cond)], 1).flatten(0, 1)
        spks_in = torch.stack([spks, torch.zeros_like(spks)], 1).flatten(0, 1)
        keys = torch.arange(num_keys, device=x.device)
        valid = keys.unsqueeze(0) < (width + self.cache_len[:tier]).unsqueeze(1)      # (tier, keys)
        mask = twice(valid)[:, None, None, :]                                        # (2*tier, 1, 1, keys)
        spec = AttentionKeys(width, num_keys, mask, copied=not self.prompt_in_place)
        att = self._att_view(width)
        if self.prompt_in_place:
            attn = self.estimator.blocks[0].attn
            # One workspace for every (step, layer): K wide like the old rows, so the attention
            # sees the same strides. Transient (the graph pool), never per row.
            spec.workspace = torch.empty(2 * tier, attn.num_heads, self.key_capacity, 2 * attn.head_dim,
                                         device=x.device, dtype=x.dtype)
            spec.frame_idx = self.frame_map[:tier, :lb].reshape(-1)
            spec.gather = self._private_gather(tier, width, lb)
        for k in range(self.n_timesteps):
            spec.step = k
            dphi = estimator_forward(self.estimator, twice(x), mu_in, spks_in, cond_in,
                                     self.cnn_in[k, :, :tier].flatten(1, 2), self.cnn_out[k, :, :tier].flatten(1, 2),
                                     att[k, :, :tier].flatten(1, 2), self.bank.frames[k], spec,
                                     self.block_mods[k], self.final_mods[k], self.kernels)
            dphi = dphi.unflatten(0, (tier, 2))
            dphi = (1.0 + self.cfg_rate) * dphi[:, 0] - self.cfg_rate * dphi[:, 1]
            x = x + self.dt_steps[k] * dphi
        self.out[:tier, :, :width].copy_(x)

    def _private_gather(self, tier: int, width: int, lb: int) -> PrivateGather:
        """The copy of every row's private keys (j < d_r) into the workspace, per (step, layer)."""
        if self.private_gather == "triton":
            depth = len(self.estimator.blocks)
            return lambda ws, step, layer: gather_private_triton(
                ws, self.private_base, self.private_cap, self.private_len, self.private_pos,
                step * depth + layer, width, lb)
        lengths = self._host_private_len[:tier]
        storages = self._row_storage[:tier]
        return lambda ws, step, layer: gather_private_torch(ws, storages, lengths, self.private_pos, step,
                                                            layer, width)

    def _ptrs(self) -> tuple[int, ...]:
        return tuple(b.data_ptr() for b in (self.x, self.out, self.mu, self.cond, self.spks, self.cnn_in,
                                            self.cnn_out, self.att, self.att_setup, self.t_steps,
                                            self.dt_steps, self.t_emb, self.block_mods, self.final_mods,
                                            self.qkv_weight, self.qkv_bias, self.bank.frames, self._row_index,
                                            self._row_maps))

    def index_nbytes(self) -> int:
        """Bytes of the int64 row indexes (lengths, storage addresses, frame and position maps):
        the part of `nbytes` that does not scale with the flow's dtype."""
        return sum(b.numel() * b.element_size() for b in (self._row_index, self._row_maps))

    def nbytes(self) -> int:
        """Bytes of the static buffers (the graph pool's scratch is not included): the keys'
        storage is rows x row_capacity frames (or the setup view's, if larger). The bank's
        frames that voices own are their prompt states (`voice_bytes`, counted once per voice by
        the memory plan); its zero frame and any gap left by a removed voice count here."""
        bufs = (self.x, self.out, self.mu, self.cond, self.spks, self.cnn_in, self.cnn_out, self._att_storage,
                self.block_mods, self.final_mods, self.qkv_weight, self.qkv_bias, self._row_index, self._row_maps)
        return (sum(b.numel() * b.element_size() for b in bufs)
                + self.bank.nbytes() - self.bank.voice_nbytes())


def _kernel_choice(name: str, choice: str, device: torch.device, available: bool) -> str:
    """`choice` as run: "auto" is "triton" on CUDA where the kernel is available, else "torch"
    (the CPU interpreter is for tests, which ask for "triton"); an explicit "triton" that cannot
    run is an error."""
    if choice == "auto":
        return "triton" if device.type == "cuda" and available else "torch"
    if choice not in ("torch", "triton"):
        raise ValueError(f"{name} must be 'auto', 'torch' or 'triton', got {choice!r}")
    if choice == "triton" and not available:
        raise ValueError(f"{name} 'triton' cannot run on {device} here (no Triton, or off CUDA without "
                         "TRITON_INTERPRET=1)")
    return choice
