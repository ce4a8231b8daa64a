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
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from duplexcache.cfm.private_gather import gather_private_torch, gather_private_triton, triton_gather_available
from duplexcache.cfm.prompt_bank import PromptBank
from duplexcache.cfm.prompt_cache import FRAME_DIM, AttCache
from duplexcache.kv.decode_graphs import warmup_stream

logger = logging.getLogger(__name__)

GraphKey = tuple[int, int, int]   # (tier, query width W, cache-length bucket Lb)


class ArenaShapeError(ValueError):
    """A micro-batch does not fit the arena's static buffers."""


class ArenaGraphError(RuntimeError):
    """EulerArena: a captured graph would read or write memory that is no longer the arena's."""


@dataclass
class ArenaStats:
    """How solves ran. Only `EulerArena.run` changes these."""

    captures: int = 0     # graphs captured (one per distinct key)
    replays: int = 0      # solves run by replaying a captured graph
    eager_runs: int = 0   # solves run op by op (CPU, or graphs off)


class GraphBackend(Protocol):
    """Turns a solve into something replayable. `capture(fn)` runs/records `fn` (which reads and
    writes only static buffers) and returns a callable that repeats it."""

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]: ...


class CudaGraphBackend:
    """torch.cuda.CUDAGraph capture into one shared memory pool."""

    def __init__(self) -> None:
        self.pool = None   # set by the first capture, shared by every later one

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        # Warm-up on a side stream first: lazy cuBLAS/cuDNN initialisation and the allocator's
        # first allocations must not happen inside the capture.
        stream = warmup_stream()
        stream.wait_stream(torch.cuda.current_stream())
        # No autograd: a graph never runs backward, and with it on the static outputs would keep
        # the captured run's activations alive through their grad_fn.
        with torch.no_grad(), torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph, pool=self.pool):
            fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


def _twice(t: torch.Tensor) -> torch.Tensor:
    """(n, ...) -> (2n, ...) with every row repeated once in place: rows [r0, r0, r1, r1, ...].
    Same values as repeat_interleave(2, 0), written as expand + reshape so it never needs the host."""
    return t.unsqueeze(1).expand(t.shape[0], 2, *t.shape[1:]).flatten(0, 1)


def euler_times(n_timesteps: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t_k, dt_k) for k = 0..n-1, accumulated exactly like the reference solver (t += dt).

    Accumulated in float32 and then cast: a bfloat16 arena (precision.code2wav_dtype) would
    otherwise round every partial sum of t to 8 bits of mantissa."""
    out_dtype, dtype = dtype, torch.float32
    t_span = torch.linspace(0, 1, n_timesteps + 1, device=device, dtype=dtype)
    t_span = 1 - torch.cos(t_span * 0.5 * torch.pi)
    t, dt = t_span[0].unsqueeze(0), t_span[1] - t_span[0]
    ts, dts = [], []
    for step in range(1, n_timesteps + 1):
        ts.append(t.reshape(()))
        dts.append(dt.reshape(()))
        t = t + dt
        if step < n_timesteps:
            dt = t_span[step + 1] - t
    return torch.stack(ts).to(out_dtype), torch.stack(dts).to(out_dtype)


def _qkv(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b2, w, _ = x.shape
    nh, hd = attn.num_heads, attn.head_dim
    q = attn.to_q(x).reshape(b2, w, nh, hd).transpose(1, 2)   # (B2, heads, W, hd)
    k = attn.to_k(x).reshape(b2, w, nh, hd).transpose(1, 2)
    v = attn.to_v(x).reshape(b2, w, nh, hd).transpose(1, 2)
    return attn.q_norm(q), attn.k_norm(k), v


def _attend(attn: nn.Module, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    b2, nh, w, hd = q.shape
    out = F.scaled_dot_product_attention(q, keys[..., :hd], keys[..., hd:], attn_mask=mask)
    return attn.proj(out.transpose(1, 2).reshape(b2, w, nh * hd))


PrivateGather = Callable[[torch.Tensor, int, int], None]   # (workspace, step, layer)


@dataclass
class _Keys:
    """Where one solve's attention keys come from (see the module docstring).

    copied: the old layout, whole cache in the row (att is then K wide; the other fields unused).
    """

    width: int
    num_keys: int
    mask: torch.Tensor                  # (B2, 1, 1, num_keys) bool
    copied: bool
    workspace: torch.Tensor | None = None   # (B2, heads, K, 2hd), transient
    frame_idx: torch.Tensor | None = None   # (tier * Lb,) bank frame per cache key
    gather: PrivateGather | None = None     # copies each row's keys j < d_r from its session's storage
    step: int = 0                           # the Euler step being solved


def _attention(attn: nn.Module, x: torch.Tensor, att: torch.Tensor, bank: torch.Tensor,
               keys: _Keys, layer: int) -> torch.Tensor:
    """x (B2, W, H); att (B2, heads, >= W, 2hd), the rows' new keys, written in place at
    [0, W); bank (2, heads, F, 2hd), this (step, layer)'s prompt frames of every voice."""
    q, k, v = _qkv(attn, x)
    hd, width = attn.head_dim, keys.width
    att[:, :, :width, :hd] = k       # keys are [new | cache]: new frames first
    att[:, :, :width, hd:] = v
    if keys.copied:
        return _attend(attn, q, att[:, :, :keys.num_keys], keys.mask)
    ws = keys.workspace
    ws[:, :, :width].copy_(att[:, :, :width])
    lb = keys.num_keys - width
    if lb:
        b2, nh, cap, hd2 = ws.shape
        tier = b2 // 2
        # Every cache key from the bank: a prompt frame, or the zero frame (private and padding
        # keys); then the private keys (j < d_r) over it, read from the sessions' own storage.
        shared = bank.index_select(2, keys.frame_idx).unflatten(2, (tier, lb)).permute(2, 0, 1, 3, 4)
        ws.view(tier, 2, nh, cap, hd2)[:, :, :, width:keys.num_keys].copy_(shared)
        keys.gather(ws, keys.step, layer)
    return _attend(attn, q, ws[:, :, :keys.num_keys], keys.mask)


def _estimator(est: nn.Module, x: torch.Tensor, mu: torch.Tensor, c: torch.Tensor, spks: torch.Tensor,
               cond: torch.Tensor, cnn_in: torch.Tensor, cnn_out: torch.Tensor, att: torch.Tensor,
               bank: torch.Tensor, keys: _Keys) -> torch.Tensor:
    """One DiT call over B2 = 2 * tier rows. c (B2, 1, H) timestep embedding;
    cnn_in/out (depth, B2, 2H, 2); att (depth, B2, heads, >= W, 2hd); bank (depth, 2, heads, F, 2hd)."""
    width = x.shape[2]
    h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, width), cond], dim=1)
    h = est.in_proj(h.transpose(1, 2))                      # (B2, W, H)
    for i, block in enumerate(est.blocks):
        (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp,
         shift_conv, scale_conv, gate_conv) = block.adaLN_modulation(c).chunk(9, dim=-1)
        a = _attention(block.attn, _modulate(block.norm1(h), shift_msa, scale_msa), att[i], bank[i], keys, i)
        h = h + gate_msa * a
        conv, new_cnn = block.conv.forward_chunk(_modulate(block.norm3(h), shift_conv, scale_conv), cnn_in[i])
        cnn_out[i].copy_(new_cnn)
        h = h + gate_conv * conv
        h = h + gate_mlp * block.mlp(_modulate(block.norm2(h), shift_mlp, scale_mlp))
    return est.final_layer(h, c).transpose(1, 2)             # (B2, mel, W)


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
    "triton" (tests: the CPU interpreter, or the eager reference on a GPU).
    """

    def __init__(self, estimator: nn.Module, rows: int, max_query: int, max_cache: int,
                 n_timesteps: int, cfg_rate: float, key_bucket: int = 64, max_setup_query: int = 0,
                 use_cuda_graphs: bool = True, graph_backend: GraphBackend | None = None,
                 max_private: int | None = None, prompt_in_place: bool = True,
                 prompt_bank_frames: int = 1, fixed_key_length: bool = False,
                 private_gather: Literal["auto", "torch", "triton"] = "auto") -> None:
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
        if private_gather == "auto":
            private_gather = "triton" if device.type == "cuda" and triton_gather_available(device) else "torch"
        if private_gather not in ("torch", "triton"):
            raise ValueError(f"private_gather must be 'auto', 'torch' or 'triton', got {private_gather!r}")
        if private_gather == "triton" and not triton_gather_available(device):
            raise ValueError(f"private_gather 'triton' cannot run on {device} here (no Triton, or off CUDA "
                             "without TRITON_INTERPRET=1)")
        self.private_gather = private_gather
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
        """t_emb[k] = t_embedder(t_k), computed once, outside any graph: the embedder builds its
        frequency table on the host, and a host-to-device copy cannot be captured."""
        if not self._t_emb_ready:
            self.t_emb.copy_(self.estimator.t_embedder(self.t_steps))
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
        mask = _twice(valid)[:, None, None, :]                                        # (2*tier, 1, 1, keys)
        spec = _Keys(width, num_keys, mask, copied=not self.prompt_in_place)
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
            c = self.t_emb[k].reshape(1, 1, -1)                                        # same t for every row
            spec.step = k
            dphi = _estimator(self.estimator, _twice(x), mu_in, c, spks_in, cond_in,
                              self.cnn_in[k, :, :tier].flatten(1, 2), self.cnn_out[k, :, :tier].flatten(1, 2),
                              att[k, :, :tier].flatten(1, 2), self.bank.frames[k], spec)
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
                                            self.dt_steps, self.t_emb, self.bank.frames, self._row_index,
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
                self._row_index, self._row_maps)
        return (sum(b.numel() * b.element_size() for b in bufs)
                + self.bank.nbytes() - self.bank.voice_nbytes())
