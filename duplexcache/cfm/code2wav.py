"""Batched Stage 2: speech tokens of many sessions -> 24 kHz PCM, one estimator solve per group.

Per tick: each session's chunk (25 tokens + 3 lookahead; a final chunk may be shorter and keeps
its lookahead) goes through the conformer, one call for the sessions whose chunks have equal
lengths and finality; inside it the attention runs once per conformer cache length (its rel-pos
attention has no per-row mask, so rows attend together only at equal shapes) and everything
else once for the call (`UpsampleConformerEncoderV2.forward_chunk_segments`), then all sessions
with the same frame count solve the 10 Euler steps together in the
`EulerArena` (each row with its own cache length and noise offset), then the Token2wav trim
rule, then the vocoder, batched over the sessions whose vocoder caches and mel chunks have equal
lengths (`models.vocoder.hift_stream_steps`: mel cache, source cache, Hamming cross-fade; each
session's NSF noise from its own generator). `batch_stats` counts the batched calls.

CUDA graphs: on a CUDA device every estimator solve (setup passes included) goes through the
arena's graph path: the first solve of a (tier, width, cache bucket) key captures it, later ones
replay it (`graph_stats` counts captures, replays and eager runs). On CPU the same solve runs
eagerly. The vocoder replays graphs too (`config.vocoder_cuda_graphs`, set from the deploy's
`engine.cuda_graphs`; the shapes of the engine's chunks; `cfm.vocoder_graphs`,
`vocoder_graph_stats`). The conformer runs eagerly, one call per shape group (at steady state one
group each).

Voices and streams: `register_voice` runs the voice's prompt setup pass (conformer + estimator
over the prompt, one row at tier 1) once, and the registry keeps its `PromptState` as long as the
voice is registered. A stream (`add_session`, one per audio turn in the engine) never runs a model:
at the next `step` it takes views of the voice's state (sharing on) or a private copy of it
(sharing off; every such copy of a tick is one `torch._foreach_copy_`), before its first chunk.

Ownership: the session object owns its caches; the arena only borrows rows during a solve; the
registry owns the voices' prompt states. Prompt tensors are never written: after a chunk each
cache is replaced by a new private tensor (or, for the estimator attention, a private delta).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from duplexcache.cfm.arena import EulerArena
from duplexcache.cfm.graph_capture import ArenaStats, GraphBackend
from duplexcache.cfm.batching import BatchStats, group_by
from duplexcache.cfm.config import Code2WavConfig
from duplexcache.cfm.graph_grid import arena_rows, replay_groups
from duplexcache.cfm.prompt_cache import AttCache, PlainAttCache, SharedPromptAttCache
from duplexcache.cfm.prompt_registry import PromptRegistry, PromptState, VoicePrompt
from duplexcache.cfm.vocoder_graphs import VocoderGraphs
from duplexcache.kv.kv_cache_manager import SessionBytes   # one type for every pool's per-session bytes
from duplexcache.models.vocoder import HiftStreamState, frozen_weight_norm, hift_stream_steps

logger = logging.getLogger(__name__)

PART_RANGE = "duplexcache.c2w."   # profiler range prefix of a step's parts (bench/tick_profile.py)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _own(t: torch.Tensor) -> torch.Tensor:
    """`t` if it is its storage's only content, else a private copy: a session must never keep a
    view of a batched tensor alive (that would hold the whole batch and break `session_bytes`)."""
    return t if t.untyped_storage().nbytes() == _nbytes(t) else t.clone()


@dataclass
class _Session:
    """One live stream. Only `BatchedCode2Wav` mutates it."""

    sid: str
    voice: str
    prompt: PromptState | None   # the voice's state (registry-owned) when shared; None when private
    prompt_shared: bool
    prompt_frames: int           # P of the voice prompt (the trim keeps first P + last tail)
    spk: torch.Tensor            # (80,) projected x-vector
    conformer_cnn: torch.Tensor
    conformer_att: torch.Tensor
    estimator_cnn: torch.Tensor
    att: AttCache
    vocoder: HiftStreamState
    generator: torch.Generator
    chunks: int = 0
    finished: bool = False
    last_mel: torch.Tensor | None = field(default=None, repr=False)   # (80, W) of the latest chunk


@dataclass
class _Pending:
    voice: str
    seed: int


@dataclass
class _Work:
    """One session's chunk between the conformer and the solve."""

    sid: str
    last: bool
    mu: torch.Tensor      # (80, W)
    spk: torch.Tensor     # (80,)
    cond: torch.Tensor | None
    noise_offset: int


class StepOutput(dict):
    """sid -> float32 PCM (n,) at 24 kHz; `errors` maps the sessions refused this step to why."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: dict[str, ValueError] = {}


class BatchedCode2Wav:
    """Many Code2Wav sessions per estimator call, with optional shared prompt attention."""

    def __init__(self, flow: nn.Module, hift: nn.Module, config: Code2WavConfig,
                 graph_backend: GraphBackend | None = None, prompt_in_place: bool = True,
                 dit_norms: str = "auto") -> None:
        """On CUDA (and `config.use_cuda_graphs`) every estimator solve is a CUDA-graph replay,
        captured lazily per (tier, width, cache bucket); elsewhere it runs eagerly. `graph_backend`
        replaces the CUDA one (tests inject a fake to exercise the capture logic on CPU).
        `prompt_in_place=False` builds the arena's old layout (the whole cache copied into each
        row): only the reference of the equality tests and the GPU check, not a deploy setting;
        `dit_norms` picks the estimator's fused kernels or the torch operators (`EulerArena`'s,
        "auto": the kernels on CUDA) for the tests and the probe's A/B, not a deploy setting."""
        # The vocoder without weight norm's per-call recompute (same values; models.vocoder)
        self.flow, self.hift, self.config = flow, frozen_weight_norm(hift), config
        # What the copy holds beyond the models' own weights (0 when hift had no weight norm):
        # the engine's memory plan counts it as fixed.
        self.vocoder_copy_bytes = 0 if self.hift is hift else sum(
            _nbytes(t) for t in (*self.hift.parameters(), *self.hift.buffers()))
        est = flow.decoder.estimator
        self.device = next(est.parameters()).device
        self.dtype = next(est.parameters()).dtype   # precision.code2wav_dtype: caches and arena too
        rows = arena_rows(config.max_num_seqs, config.graph_grid, config.arena_rows_from_graph_grid)
        self.arena = EulerArena(
            est, rows=rows, max_query=config.max_chunk_frames, max_cache=config.max_cache_frames,
            n_timesteps=config.shape.n_timesteps, cfg_rate=config.cfg_rate, key_bucket=config.key_bucket,
            max_setup_query=config.max_prompt_frames, use_cuda_graphs=config.use_cuda_graphs,
            graph_backend=graph_backend, max_private=config.max_prompt_frames,
            prompt_in_place=prompt_in_place, prompt_bank_frames=config.prompt_bank_frames,
            fixed_key_length=config.fixed_key_length, dit_norms=dit_norms)
        self.registry = PromptRegistry(config.prompt_att_sharing)
        self.sessions: dict[str, _Session] = {}
        self._pending: dict[str, _Pending] = {}
        self._batch_stats = BatchStats()
        # A new stream's vocoder state: empty caches and the Hamming cross-fade window. Built
        # once (the window is a host-to-device copy) and shared read-only: the vocoder replaces a
        # stream's caches with new tensors and never writes the window.
        self._fresh_vocoder = HiftStreamState.create(config.shape.mel_bins, self.device)
        self.vocoder_graphs = self._vocoder_graphs(self.arena.graph_backend)

    def _vocoder_graphs(self, backend: GraphBackend | None) -> VocoderGraphs | None:
        """The vocoder's graphs share the arena's backend (on CUDA, its memory pool)."""
        cfg = self.config
        if backend is None or not cfg.vocoder_cuda_graphs or not cfg.vocoder_graph_shapes:
            return None
        return VocoderGraphs(self.hift, cfg.vocoder_graph_shapes, self.arena.rows, cfg.graph_grid, backend)

    def set_graph_backend(self, backend: GraphBackend) -> None:
        """Replace the graph backend of the arena and the vocoder before anything was captured
        (tests give a CPU engine a fake one to exercise the capture logic)."""
        if self.arena.graph_keys or (self.vocoder_graphs is not None and self.vocoder_graphs.graph_keys):
            raise RuntimeError("set_graph_backend after graphs were captured")
        self.arena.graph_backend = backend
        self.vocoder_graphs = self._vocoder_graphs(backend)

    @property
    def graph_stats(self) -> ArenaStats:
        """Counters of the estimator solves: graph captures, replays, eager runs."""
        return self.arena.stats

    @property
    def vocoder_graph_stats(self) -> ArenaStats:
        """Counters of the vocoder calls through `vocoder_graphs` (all 0 when it is off)."""
        return self.vocoder_graphs.stats if self.vocoder_graphs is not None else ArenaStats()

    @property
    def vocoder_graph_bytes(self) -> int:
        """Bytes of the vocoder graphs' static buffers, allocated at construction (fixed)."""
        return self.vocoder_graphs.nbytes() if self.vocoder_graphs is not None else 0

    @property
    def batch_stats(self) -> BatchStats:
        """Counters of the batched conformer and vocoder calls (and the latest step's groups)."""
        return self._batch_stats

    # ---- voices and sessions -----------------------------------------------------------
    @torch.inference_mode()
    def register_voice(self, name: str, tokens: torch.Tensor, mel: torch.Tensor, spk: torch.Tensor,
                       share_equal: bool = True) -> None:
        """tokens (T,) prompt speech tokens; mel (T * up_rate, 80); spk (192,). Runs the voice's
        prompt pass now (the only one for this voice); its state lives until `unregister_voice`.
        A voice whose inputs equal a registered voice's takes that
        voice's state instead (`PromptRegistry.register_alias`); ``share_equal=False`` runs a
        pass of its own (the per-voice reference the tests compare against)."""
        if self.registry.has_voice(name):
            raise ValueError(f"voice {name!r} is already registered")
        cfg = self.config
        tokens = torch.as_tensor(tokens).reshape(-1)
        if mel.dim() != 2 or mel.shape[0] != tokens.numel() * cfg.up_rate:
            raise ValueError(f"voice {name!r}: mel {tuple(mel.shape)} must be ({tokens.numel() * cfg.up_rate}, bins)")
        if not cfg.cache_tail_frames <= mel.shape[0] <= cfg.max_prompt_frames:
            raise ValueError(f"voice {name!r}: prompt of {mel.shape[0]} frames outside "
                             f"[{cfg.cache_tail_frames}, {cfg.max_prompt_frames}]")
        self._check_tokens(tokens, f"voice {name!r}")
        prompt = VoicePrompt(tokens.to(self.device), mel.to(self.device), spk.reshape(-1).to(self.device))
        same = self.registry.same_prompt(prompt) if share_equal else None
        if same is not None:
            # A voice with another's prompt inputs (a client's reference recording, whose Code2Wav
            # prompt is the base voice's) shares that voice's state and bank slot: no setup pass,
            # no bytes, and no growth of the bank, which would drop the graphs captured over it.
            self.registry.register_alias(name, same)
            self.arena.bank.alias(name, same)
            self._batch_stats.prompt_passes_per_voice.setdefault(name, 0)   # listed, with no pass
            logger.info("voice %r: same Code2Wav prompt as %r, sharing its prompt state", name, same)
            return
        version = self.arena.bank.version
        self.registry.register_voice(name, prompt, self._prompt_pass(name, prompt))
        if self.arena.bank.version != version:
            self._rebind_prompts()

    def _rebind_prompts(self) -> None:
        """The arena's prompt bank grew (reallocated): point every voice's state and every sharing
        stream at the new frames, so nothing keeps the old bank alive."""
        for voice in self.registry.names():
            self.registry.state(voice).estimator_att = self.arena.bank.view(voice)
        for sess in self.sessions.values():
            if sess.prompt is not None and isinstance(sess.att, SharedPromptAttCache):
                sess.att.prompt = sess.prompt.estimator_att

    def unregister_voice(self, name: str) -> None:
        """Remove a voice and free its prompt state; refused while a stream (queued or live) uses it."""
        queued = sum(p.voice == name for p in self._pending.values())
        if queued:
            raise ValueError(f"voice {name!r} still has {queued} queued streams")
        self.registry.unregister_voice(name)
        self.arena.remove_voice(name)

    def add_session(self, sid: str, voice: str, seed: int = 0) -> None:
        """Queue a stream of `voice`; it opens from the voice's prompt state at the next `step`
        (no model call). `seed` drives the vocoder's NSF noise for this stream only."""
        if sid in self.sessions or sid in self._pending:
            raise ValueError(f"session {sid!r} already exists")
        self.registry.acquire(voice)   # raises ValueError for an unknown voice
        self._pending[sid] = _Pending(voice, seed)

    def remove_session(self, sid: str) -> None:
        pending = self._pending.pop(sid, None)
        sess = self.sessions.pop(sid, None) if pending is None else None
        if pending is None and sess is None:
            raise ValueError(f"unknown session {sid!r}")
        self.registry.release(pending.voice if pending is not None else sess.voice)

    # ---- the tick ----------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, chunks: dict[str, Sequence[int] | torch.Tensor], last: dict[str, bool] | None = None,
             ids_in_vocab: bool = False) -> StepOutput:
        """Vocode one chunk for each session in `chunks`. A bad chunk fails only its session.

        ``ids_in_vocab``: the caller guarantees every token id is in the vocabulary (the engine's
        Talker codes: the end code is never drawn), so the range check, which waits for the
        device when a chunk lives there, is skipped; shapes are still checked."""
        last = last or {}
        out = StepOutput()
        tokens: dict[str, torch.Tensor] = {}
        for sid, chunk in chunks.items():
            try:
                tokens[sid] = self._validate(sid, chunk, bool(last.get(sid, False)), ids_in_vocab)
            except ValueError as err:
                out.errors[sid] = err
        self._open_pending()
        lasts = {sid: bool(last.get(sid, False)) for sid in tokens}
        conformer_calls = group_by(tokens, lambda sid: self._conformer_key(sid, tokens[sid], lasts[sid]))
        encoded: dict[str, _Work] = {}
        n_segments = 0
        with record_function(PART_RANGE + "conformer"):
            for i, members in enumerate(conformer_calls):
                segments = group_by(members, self._attention_key)
                conformer_calls[i] = [sid for seg in segments for sid in seg]   # the call's row order
                n_segments += len(segments)
                encoded.update(self._encode_call(segments, tokens, lasts))
        work = [encoded[sid] for sid in tokens]
        by_width: dict[int, list[_Work]] = {}
        for w in work:
            by_width.setdefault(w.mu.shape[1], []).append(w)
        with record_function(PART_RANGE + "solve"):
            for width, group in by_width.items():
                for g in replay_groups(len(group), self.config.graph_grid, self.arena.rows):
                    self._solve(group[g.start:g.start + g.rows], width, g.tier)
        vocoder_groups = group_by(tokens, self._vocoder_key)
        pcm: dict[str, torch.Tensor] = {}
        with record_function(PART_RANGE + "vocoder"):
            for members in vocoder_groups:
                pcm.update(self._vocode_group(members, lasts))
        for sid in tokens:
            out[sid] = pcm[sid]
        self._batch_stats.record_step(conformer_calls, vocoder_groups, n_segments)
        return out

    def _validate(self, sid: str, chunk: Sequence[int] | torch.Tensor, last: bool, ids_in_vocab: bool) -> torch.Tensor:
        cfg = self.config
        sess = self.sessions.get(sid)
        if sess is None and sid not in self._pending:
            raise ValueError(f"unknown session {sid!r}")
        if sess is not None and sess.finished:
            raise ValueError(f"session {sid!r}: chunk after the final chunk")
        tok = torch.as_tensor(chunk).reshape(-1)
        if tok.numel() == 0:
            raise ValueError(f"session {sid!r}: empty chunk")
        if tok.dtype.is_floating_point or tok.dtype == torch.bool:
            raise ValueError(f"session {sid!r}: token ids must be integers, got {tok.dtype}")
        if tok.numel() > cfg.max_chunk_tokens:
            raise ValueError(f"session {sid!r}: chunk of {tok.numel()} tokens exceeds {cfg.max_chunk_tokens}")
        if not last and tok.numel() <= cfg.pre_lookahead_len:
            raise ValueError(f"session {sid!r}: a non-final chunk needs more than "
                             f"{cfg.pre_lookahead_len} tokens (it ends with the lookahead)")
        if not ids_in_vocab:
            self._check_tokens(tok, f"session {sid!r}")
        return tok.to(dtype=torch.long).to(self.device, non_blocking=True)   # no wait for queued work

    def _check_tokens(self, tok: torch.Tensor, who: str) -> None:
        lo, hi = int(tok.min()), int(tok.max())
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{who}: token id {bad} outside the vocabulary [0, {self.config.vocab_size})")

    # ---- prompt state (per voice) and stream starts ---------------------------------------
    def _prompt_pass(self, voice: str, vp: VoicePrompt) -> PromptState:
        """The voice prompt's setup pass: conformer over the prompt tokens + lookahead pad, then
        the estimator over the prompt (no caches), one row at tier 1.

        A row's bits can depend on how many rows share its GEMMs. Running the pass alone (batch 1
        conformer, tier-1 solve; the solve reads only what `load_row` wrote, since a row with no
        cache attends to its own new keys only) makes the state a function of the voice alone,
        the same bits the per-stream pass gave every stream, whichever streams started with it.
        """
        cfg = self.config
        pad = torch.full((cfg.pre_lookahead_len,), cfg.prompt_pad_token, dtype=torch.long, device=self.device)
        tokens = torch.cat([vp.tokens.long(), pad])[None]
        h, spk, ccnn, (catt,) = self._conformer(tokens, vp.spk[None], False, None, [None], [1])
        work = _Work(voice, False, h[0], spk[0], vp.mel.transpose(0, 1), noise_offset=0)
        width = work.mu.shape[1]
        self._run_rows([(work, None, None, None)], width, tier=1)
        self._batch_stats.record_prompt_pass(voice)
        logger.info("voice %r: prompt pass over %d frames", voice, width)
        return PromptState(
            spk=_own(spk[0]), conformer_cnn=_own(ccnn), conformer_att=_own(catt),
            estimator_cnn=self.arena.new_cnn_cache(0).clone(),
            # stored once, in the arena's prompt bank, where every solve reads it in place
            estimator_att=self.arena.add_voice(voice, self.arena.new_att_cache(0, width)))

    def _open_pending(self) -> None:
        """Open every queued stream from its voice's prompt state: views of it (sharing on) or a
        private copy (sharing off; all copies of this tick in one `torch._foreach_copy_`)."""
        if not self._pending:
            return
        states = {sid: self.registry.state(p.voice) for sid, p in self._pending.items()}
        if not self.config.prompt_att_sharing:
            src = [t for sid in self._pending for t in states[sid].tensors()]
            dst = [torch.empty_like(t) for t in src]
            torch._foreach_copy_(dst, src)
            n = len(fields(PromptState))
            states = {sid: PromptState(*dst[i * n:(i + 1) * n]) for i, sid in enumerate(self._pending)}
        for sid, p in self._pending.items():
            self._open(sid, p, states[sid], shared=self.config.prompt_att_sharing)
        self._batch_stats.stream_starts += len(self._pending)
        self._pending.clear()

    def _open(self, sid: str, p: _Pending, state: PromptState, shared: bool) -> None:
        tail = self.config.cache_tail_frames
        att: AttCache
        if shared:
            att = SharedPromptAttCache(state.estimator_att, tail)
        else:
            att = PlainAttCache(state.estimator_att, state.num_frames, tail)
        gen = torch.Generator(device=self.device).manual_seed(p.seed)
        # A private session keeps no PromptState: its copied tensors are referenced only by the
        # caches that start from them, so each is freed as soon as its cache moves on.
        self.sessions[sid] = _Session(
            sid, p.voice, state if shared else None, shared, state.num_frames, state.spk,
            state.conformer_cnn, state.conformer_att, state.estimator_cnn,
            att, dataclasses.replace(self._fresh_vocoder), gen)

    # ---- per-chunk pieces ----------------------------------------------------------------
    def _conformer(self, tokens: torch.Tensor, spk: torch.Tensor, last: bool, cnn: torch.Tensor | None,
                   atts: list[torch.Tensor | None], sizes: list[int]):
        """tokens (b, n), prompt x-vectors (b, 192), rows in segments of ``sizes`` rows with the
        attention caches ``atts`` -> mu (b, 80, frames), projected spk (b, 80), new conformer
        caches cnn (b, C, 6) and one att (layers, n_i, heads, T_i, 2*d_k) per segment."""
        flow = self.flow
        # a voice's x-vector is float32; a bfloat16 flow (precision.code2wav_dtype) takes its own
        spk = flow.spk_embed_affine_layer(F.normalize(spk, dim=1).to(self.dtype))
        h, cnn, atts = flow.encoder.forward_chunk_segments(flow.input_embedding(tokens), last, cnn, atts, sizes)
        h = flow.encoder_proj(h)                      # (b, frames, 80)
        return h.transpose(1, 2), spk, cnn, atts

    def _conformer_key(self, sid: str, tokens: torch.Tensor, last: bool) -> tuple[int, bool]:
        """Rows share one conformer call only with equal chunk length and ``last`` (the last
        chunk pads the lookahead for every row of the call, and the convolutions see the time
        axis); inside the call, rows attend together only with equal cache lengths
        (``_attention_key``)."""
        return tokens.numel(), last

    def _attention_key(self, sid: str) -> int:
        """The conformer cache length: P of the session's voice plus the frames it has kept."""
        return self.sessions[sid].conformer_att.shape[3]

    def _vocoder_key(self, sid: str) -> tuple[int, int, int, int]:
        """Rows batch in one vocoder call only with equal mel/source/speech cache lengths (first
        chunk or not) and equal new mel frames; `last` only changes how the output is cut."""
        sess = self.sessions[sid]
        v = sess.vocoder
        return v.mel.shape[2], v.source.shape[2], v.speech.shape[1], sess.last_mel.shape[1]

    def _encode_call(self, segments: list[list[str]], tokens: dict[str, torch.Tensor],
                     lasts: dict[str, bool]) -> dict[str, _Work]:
        """One conformer call over sessions with equal `_conformer_key`, in segments of equal
        cache length; each session then gets private copies of its new caches (trimmed to first
        P + last tail, Token2wav.stream's conformer bound, the same cut as the estimator's)."""
        members = [sid for seg in segments for sid in seg]
        sessions = [self.sessions[sid] for sid in members]
        last = lasts[members[0]]
        spk = torch.stack([self.registry.voice(s.voice).spk for s in sessions])       # (b, 192)
        mu, spk, cnn, catts = self._conformer(
            torch.stack([tokens[sid] for sid in members]), spk, last,
            torch.cat([s.conformer_cnn for s in sessions]),                          # (b, C, 6)
            [torch.cat([self.sessions[sid].conformer_att for sid in seg], dim=1)     # (L, n, h, T, 2dk)
             for seg in segments],
            [len(seg) for seg in segments])
        tail = self.config.cache_tail_frames
        noise_frames = self.flow.decoder.rand_noise.shape[2]
        seg_rows = [(catt, j) for catt, seg in zip(catts, segments) for j in range(len(seg))]   # member order
        out = {}
        for i, (sid, sess, (catt, j)) in enumerate(zip(members, sessions, seg_rows)):
            att, p = catt[:, j:j + 1], sess.prompt_frames
            if att.shape[3] > p + tail:
                att = torch.cat([att[:, :, :, :p], att[:, :, :, -tail:]], dim=3)
            sess.conformer_att = _own(att)
            sess.conformer_cnn = _own(cnn[i:i + 1])
            offset = len(sess.att)
            if offset + mu.shape[2] > noise_frames:
                raise AssertionError(f"session {sid!r}: noise buffer of {noise_frames} frames exhausted")
            out[sid] = _Work(sid, last, mu[i], spk[i], None, offset)
        return out

    def _solve(self, group: list[_Work], width: int, tier: int) -> None:
        sessions = [self.sessions[w.sid] for w in group]
        self._run_rows([(w, s.estimator_cnn, s.att, s.voice) for w, s in zip(group, sessions)], width, tier)
        for r, (w, sess) in enumerate(zip(group, sessions)):
            sess.last_mel = self.arena.mel(r, width).clone()
            sess.estimator_cnn = self.arena.new_cnn_cache(r).clone()
            # the row holds the chunk's new keys only: the cache copies those it keeps (W frames)
            sess.att.advance(width, self.arena.new_att_cache(r, width))

    def _run_rows(self, rows: list[tuple[_Work, torch.Tensor | None, AttCache | None, str | None]], width: int,
                  tier: int) -> None:
        """rows: (work, estimator cnn cache, attention cache, voice whose bank slot the cache reads)."""
        noise = self.flow.decoder.rand_noise[0]      # (80, frames), sliced at each row's own offset
        max_len = 0
        for r, (w, cnn, att, voice) in enumerate(rows):
            self.arena.load_row(r, width, noise[:, w.noise_offset:w.noise_offset + width], w.mu, w.spk,
                                w.cond, cnn, att, voice)
            max_len = max(max_len, 0 if att is None else len(att))
        for r in range(len(rows), tier):
            self.arena.pad_row(r, width)
        self.arena.run(tier, width, max_len)

    def _vocode_group(self, members: list[str], lasts: dict[str, bool]) -> dict[str, torch.Tensor]:
        """One vocoder forward over sessions with equal `_vocoder_key`; each row's NSF noise comes
        from its session's own generator, so the PCM is what the session would get alone."""
        sessions = [self.sessions[sid] for sid in members]
        flags = [lasts[sid] for sid in members]
        # The vocoder runs float32 whatever the flow's dtype (a no-op for a float32 flow).
        mel = torch.stack([s.last_mel for s in sessions]).float()                    # (b, 80, W)
        pcms = hift_stream_steps(self.hift, [s.vocoder for s in sessions], mel, flags,
                                 [s.generator for s in sessions],
                                 self.vocoder_graphs.run if self.vocoder_graphs is not None else None)
        out = {}
        for sid, sess, last, pcm in zip(members, sessions, flags, pcms):
            sess.chunks += 1
            sess.finished = last
            out[sid] = pcm[0].float()
        return out

    # ---- accounting --------------------------------------------------------------------
    def session_bytes(self, sid: str) -> SessionBytes:
        """Bytes this session holds privately vs references in its voice's shared prompt state."""
        sess = self.sessions.get(sid)
        if sess is None:
            raise ValueError(f"unknown session {sid!r}")
        private, shared = sess.att.private_bytes(), sess.att.shared_bytes()
        src = sess.prompt   # None for a private session: everything it holds is private
        for t, name in ((sess.spk, "spk"), (sess.conformer_cnn, "conformer_cnn"),
                        (sess.conformer_att, "conformer_att"), (sess.estimator_cnn, "estimator_cnn")):
            if src is not None and t is getattr(src, name):
                shared += _nbytes(t)
            else:
                private += _nbytes(t)
        v = sess.vocoder
        private += _nbytes(v.mel) + _nbytes(v.source) + _nbytes(v.speech)
        return SessionBytes(private, shared)

    def voice_bytes(self, voice: str) -> int:
        """Bytes of the voice's prompt state: allocated once by `register_voice`, held until
        `unregister_voice` whatever the number of streams (0 for an unknown voice)."""
        return self.registry.state_bytes(voice)


VOCODER_DTYPE_BYTES = 4   # the vocoder (hift) and its stream caches run float32 in every mode


def code2wav_session_bytes(config: Code2WavConfig, prompt_frames: int, sharing: bool,
                           stage: Literal["setup", "steady"], dtype_bytes: int = 4) -> SessionBytes:
    """Shape-only bytes of one stream's Stage-2 caches (estimator + conformer + vocoder).

    setup: the stream just opened, before its first chunk; steady: after enough chunks that the
    estimator holds P private frames (+ the prompt tail, shared when `sharing`). `shared` is what
    the stream references in its voice's prompt state, which exists once per voice from
    `register_voice` on (sharing on or off): setup-with-sharing's `shared` is those bytes, and a
    memory plan counts them once per voice as fixed, never per stream. `dtype_bytes` is the
    flow's element size (precision.code2wav_dtype); the vocoder's caches are float32 always.
    """
    if stage not in ("setup", "steady"):
        raise ValueError(f"stage must be 'setup' or 'steady', got {stage!r}")
    s, tail = config.shape, config.cache_tail_frames
    if prompt_frames < tail:
        raise ValueError(f"prompt_frames {prompt_frames} < cache tail {tail}")
    att_f, conf_f = s.att_frame_bytes(dtype_bytes), s.conformer_frame_bytes(dtype_bytes)
    spk = s.mel_bins * dtype_bytes   # the projected x-vector (the voice's, shared when sharing)
    small = s.estimator_cnn_bytes(dtype_bytes) + s.conformer_size * (2 + 2 * config.up_rate) * dtype_bytes
    if stage == "setup":
        total = prompt_frames * (att_f + conf_f) + small + spk
        return SessionBytes(0, total) if sharing else SessionBytes(total, 0)
    vocoder = (s.mel_bins * config.mel_cache_len + 2 * config.source_cache_len) * VOCODER_DTYPE_BYTES
    conformer = (prompt_frames + tail) * conf_f
    if sharing:
        return SessionBytes(prompt_frames * att_f + conformer + small + vocoder, tail * att_f + spk)
    return SessionBytes((prompt_frames + tail) * att_f + conformer + small + vocoder + spk, 0)
