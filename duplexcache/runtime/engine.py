"""The duplex engine: many live sessions per device, one tick = one 1-second unit for each.

One tick, batched over every live session with a unit of audio buffered (>= 1 s; the first unit
is 1.035 s)::

    audio encoder   stream_step: the unit's PCM -> 10 embeddings (per-session streaming KV)
    Thinker         append [</unit>] <unit> + 10 embeddings, then decode <= 20 tokens:
                    <|listen|>  |  <|speak|> text.. (<|chunk_eos|> | <|turn_eos|>)   (policy.py)
    Talker          speaking units: condition = the unit's text + end token with the Thinker
                    hidden states that produced them -> 25 codes + end (KV kept for the turn)
    Code2Wav        25 codes + 3 lookahead -> 1 s of 24 kHz PCM

Lookahead: a unit's 25 codes are held back until the next speaking unit of the same turn, whose
first 3 codes are the lookahead (chunk of 28, not final). When the turn ends (``<|turn_eos|>``,
a ``<|listen|>`` after speaking, or a Talker turn at its position limit) the held codes go out
as the final chunk (25 codes, ``last``) in the same tick. So speech lags the text by one unit
inside a turn, and each non-final chunk is exactly 24 000 samples; the final chunk also flushes
the vocoder's 3840-sample cross-fade tail. Each turn is one Code2Wav stream (prompt state from the
voice, caches reset), as in the reference's per-response ``Token2wav.stream``.

Sessions open, stream and close at any time (thread-safe per engine_api): ``open_session``
admits against the ledger and the measured tick cost at once (shape arithmetic only, no model
call), and the next tick builds the context and prefills it in chunks of at most
``engine.prefill_chunk_tokens`` per tick; ``close_session`` releases the reservation at once and
the next tick frees the blocks, before it opens anything.

Isolation (docs/engine.md, runtime/isolation.py): bad audio is refused at ``push_audio``; inside
the tick a failure attributable to one session ends that session only, and a batched call that
raises is probed per session and re-run without the culprits.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from duplexcache.cfm.code2wav import BatchedCode2Wav, code2wav_session_bytes
from duplexcache.cfm.config import Code2WavConfig as CfmConfig
from duplexcache.cfm.config import Code2WavShape
from duplexcache.config import (
    DeployConfig,
    SessionConfigError,
    SessionRuntimeConfig,
    build_runtime_config,
)
from duplexcache.context import (
    EmbeddingResult,
    EncoderPath,
    SessionContext,
    SessionContextBuilder,
    build_session_context,
)
from duplexcache.kv.block_pool import BlockPool
from duplexcache.kv.decode_graphs import PagedDecodeGraphs
from duplexcache.kv.kv_cache_manager import KVCacheManager
from duplexcache.kv.paged_attention import PagedKVCache
from duplexcache.kv.talker_blocks import TalkerBlocks
from duplexcache.kv.window import WindowConfig
from duplexcache.models.audio_encoder import StreamingAudioEncoderState
from duplexcache.models.talker import TalkerUnitRequest, generate_unit
from duplexcache.runtime import turns
from duplexcache.runtime import memory_budget
from duplexcache.runtime.admission import (
    AdmissionLedger,
    Footprint,
    MemoryPlan,
    TickCostModel,
    plan_memory,
)
from duplexcache.runtime.bundle import ModelBundle, build_models
from duplexcache.runtime.engine_api import (
    INPUT_SAMPLE_RATE,
    AdmissionError,
    AudioDelta,
    InvalidAudioError,
    EngineEvent,
    EngineStats,
    ResponseDone,
    ResponseUsage,
    SessionAdmitted,
    SessionError,
    TextDelta,
    TierBytes,
)
from duplexcache.runtime.policy import (
    MAX_UNIT_TOKENS,
    ControlTokens,
    make_policy,
    text_token_ids,
)
from duplexcache.runtime.stage0 import (
    SessionContextInput,
    Stage0Runner,
    session_worst_case,
)
from duplexcache.runtime.turns import NO_REQUESTS, TurnState, UnitTurn
from duplexcache.runtime.isolation import (
    FaultInjector,
    Isolated,
    check_faults,
    precheck,
    run_isolated,
)
from duplexcache.runtime.voices import Voice
from duplexcache.runtime.warmup import WarmupReport, warm_up

logger = logging.getLogger(__name__)

# Audio a session may have buffered ahead of the ticks that consume it (1 s per tick).
MAX_BUFFERED_SECONDS = 10
MAX_BUFFERED_SAMPLES = MAX_BUFFERED_SECONDS * INPUT_SAMPLE_RATE
STAGES = ("encoder", "thinker", "talker", "code2wav", "tick")
LOOKAHEAD = 3
LATENCY_HISTORY = 4096


# What a refused client reads (AdmissionError.reason): no pool sizes; the numbers go to the log.
_CLIENT_REFUSALS = {
    "capacity_memory": "capacity_memory: the server has no memory for another session now; try again later",
    "capacity_compute": "capacity_compute: one more session would make the server miss its real-time "
                        "deadline; try again later",
}


def build_engine(deploy: DeployConfig) -> DuplexEngine:
    """The engine for a deploy config: the preset's models (random weights or the checkpoint)."""
    return DuplexEngine(deploy, build_models(deploy))


def pcm16_bytes(pcm: torch.Tensor) -> bytes:
    """float PCM in [-1, 1] -> little-endian int16 bytes (clipped)."""
    x = torch.clamp(pcm.detach().float().cpu(), -1.0, 1.0) * 32767.0
    return torch.round(x).to(torch.int16).numpy().astype("<i2").tobytes()


@dataclass
class _Session:
    """One engine session. ``audio``/``buffered`` are guarded by the engine lock; everything else
    belongs to the tick thread."""

    sid: str
    config: SessionRuntimeConfig
    voice: Voice
    footprint: Footprint
    audio: list[np.ndarray] = field(default_factory=list)
    buffered: int = 0
    encoder_state: StreamingAudioEncoderState | None = None
    opened: bool = False          # Stage 0 session exists
    unit_index: int = 0
    turn_index: int = 0
    c2w_sid: str | None = None    # Code2Wav stream of the current turn
    held: torch.Tensor | None = None  # 25 codes waiting for their lookahead
    turn: TurnState = field(default_factory=TurnState)   # turn control (runtime/turns.py)
    policy_state: Any = None      # the speak policy's per-session state (policy.new_session)
    # Seeds the session's random draws (Code2Wav noise, benchmark fills): "sess_<admission
    # ordinal>", the engine's own numbering, also when the server named the session, so a run's
    # audio does not depend on the server's random wire ids.
    seed_name: str = ""
    prefill_tick: int | None = None   # the tick that queued its context prefill


@dataclass(frozen=True)
class SessionInfo:
    """A read-only snapshot of one live session (``DuplexEngine.session_info``).

    Thinker counts are 0 until the tick that opens the session in Stage 0 (``opened``).
    ``window`` holds the marks this session compacts with (the client's, when allowed).
    """

    sid: str
    voice: str
    opened: bool
    units: int                     # units this session has run
    turns: int                     # audio turns started
    code2wav_stream: str | None    # the current turn's Code2Wav stream id, None between turns
    window: WindowConfig
    thinker_anchor_tokens: int     # the shared/anchored context (never released by the window)
    thinker_tokens: int            # anchor + window tokens now in the Thinker KV
    talker_tokens: int             # Talker KV tokens computed in the current turn
    talker_blocks: int             # Talker blocks held (a fast-forward may hold more than computed)


@dataclass(frozen=True)
class FastForwardResult:
    """What ``DuplexEngine.fast_forward`` added to one session."""

    thinker_tokens_appended: int
    talker_blocks_added: int


@dataclass
class _Unit:
    """One session's unit inside a tick."""

    session: _Session
    pcm: np.ndarray
    decision: int | None = None
    tokens: list[int] = field(default_factory=list)        # text + end token
    hidden: list[torch.Tensor] = field(default_factory=list)  # Thinker hidden that produced each
    codes: torch.Tensor | None = None
    turn: UnitTurn = NO_REQUESTS     # turn requests this unit applies
    rows: torch.Tensor | None = None  # what the unit appended before its decision


@dataclass
class _Final:
    """The last chunk of an audio turn."""

    session: _Session
    codes: torch.Tensor
    response_done: bool  # False when only the Talker's turn was cut (position limit)


def _select_attention_backend(cache: PagedKVCache) -> None:
    """On CUDA, decode batches read KV blocks in place with the Triton kernel (SPEC §5: the
    gather-then-SDPA path moves the KV twice, 3.4x slower on an H200); elsewhere the reference."""
    if cache.device.type != "cuda":
        return
    try:
        cache.set_decode_backend("triton")
    except (ImportError, ValueError) as exc:
        logger.warning("paged decode uses the gather+SDPA reference path on %s: %s", cache.device, exc)


def _pin_cuda_numerics(device: torch.device) -> None:
    """Sharing must be bit-exact, so the same work must give the same bits in every engine:
    cuDNN may otherwise pick a different convolution algorithm (and TF32) depending on free
    workspace, which changed Code2Wav's output between two engines of one process on an H200.
    Stage 2 runs float32 as the reference does, so TF32 convolutions are off too. These are
    process-wide torch settings: every engine in the process (and anything else) shares them."""
    if device.type != "cuda":
        return
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


class DuplexEngine:
    """Implements :class:`duplexcache.runtime.engine_api.EngineAPI` over real models."""

    def __init__(self, deploy: DeployConfig, models: ModelBundle) -> None:
        self.deploy = deploy
        self.models = models
        self.voices = models.voices
        _pin_cuda_numerics(models.device)
        self.control = ControlTokens.from_tokenizer(models.tokenizer)
        self._text_ids = text_token_ids(models.tokenizer, models.thinker.config.vocab_size)
        self.policy = make_policy(deploy.engine.speak_policy, self.control, self._text_ids)
        self.block_size = deploy.stage0.block_size
        w = deploy.stage0.window
        self.window = WindowConfig(mode=w.mode, high_tokens=w.high_tokens, low_tokens=w.low_tokens)
        self.reference_encodes = 0
        self.builder = SessionContextBuilder.from_config(deploy, models.tokenizer, self._embed_tokens,
                                                         self._encode_reference_audio)
        self.code2wav = BatchedCode2Wav(models.flow, models.hift, self._cfm_config())
        for v in self.voices.names():
            voice = self.voices.get(v)
            self.code2wav.register_voice(v, voice.prompt_tokens, voice.prompt_mel, voice.spk)
        self._ref_embeddings = {v: self._count_ref_embeddings(self.voices.get(v)) for v in self.voices.names()}
        self.plan = self._plan()
        self.ledger = AdmissionLedger(self.plan)
        self._build_pools()
        self._lock = threading.Lock()
        # Held by tick() and fast_forward(): both run models over the tick thread's state.
        self._tick_lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._queue: OrderedDict[str, _Session] = OrderedDict()
        self._closing: list[_Session] = []
        self._ids = itertools.count(1)
        self._ticks = 0
        self.late_ticks = 0
        self.latency_history: dict[str, deque] = {s: deque(maxlen=LATENCY_HISTORY) for s in STAGES}
        self._last_latency: dict[str, tuple[float, ...]] = {}
        self._pools: dict[str, TierBytes] = {}
        self.code2wav_peak = TierBytes(shared=0, private=0, free=self.plan.dynamic_bytes)
        self._closed = False
        # Graphs captured while the engine was built (each voice's Code2Wav prompt pass at
        # register_voice) were captured before serving: they count with the warm-up's.
        self._warmup_captures = self._graph_captures_total()
        self.warmup_report: WarmupReport | None = None
        # Admission by time: the measured per-session tick cost (runtime/admission.py).
        self.tick_cost = TickCostModel(deploy.engine.tick_seconds, deploy.engine.tick_headroom)
        # Fault injection for tests (runtime/isolation.py); None when serving: no YAML key or
        # client message reaches it, only ``install_faults``.
        self.faults: FaultInjector | None = None
        self._refresh_pools()
        logger.info("engine ready: %s", self.plan.describe())

    # ------------------------------------------------------------------ warm start

    def warmup(self, should_stop: Callable[[], bool] | None = None) -> WarmupReport:
        """Capture every decode and Code2Wav graph and run every Triton kernel a tick can need
        (runtime/warmup.py), so that ticks capture nothing. Touches no session; call before
        serving (the server does, before /health answers ok). ``should_stop`` is asked between
        captures (a server shutting down)."""
        with self._tick_lock:
            if self._closed:
                raise RuntimeError("engine is shut down")
            before = self._graph_captures_total()
            report = warm_up(self, should_stop or (lambda: False))
            self._warmup_captures += self._graph_captures_total() - before
            self.warmup_report = report
        return report

    def _graph_captures_total(self) -> int:
        """Decode-graph keys first used (captures on CUDA) + Code2Wav graphs captured."""
        decode = sum(g.stats.first_uses for g in (self.thinker_graphs, self.talker_graphs) if g is not None)
        return decode + self.code2wav.graph_stats.captures

    # ------------------------------------------------------------------ construction

    def _cfm_config(self) -> CfmConfig:
        c = self.deploy.code2wav
        prompt = max(self.voices.get(v).prompt_frames for v in self.voices.names())
        return CfmConfig(shape=Code2WavShape.from_flow(self.models.flow), max_num_seqs=c.max_num_seqs,
                         prompt_att_sharing=c.cfm_prompt_att_sharing,
                         arena_rows_from_graph_grid=c.cfm_arena_rows_from_graph_grid,
                         graph_grid=c.graph_grid or (), max_prompt_frames=max(prompt, 100),
                         use_cuda_graphs=self.models.device.type == "cuda")

    def _count_ref_embeddings(self, voice: Voice) -> int:
        with torch.no_grad():
            return int(self.models.audio_encoder.embed_audio(voice.ref_audio).shape[0])

    def _plan(self) -> MemoryPlan:
        e = self.deploy.engine
        # The voices' Code2Wav prompt states were computed by register_voice and live as long as
        # the engine: fixed, once per voice (sharing on or off), never per session.
        fixed = (self.code2wav.arena.nbytes() + sum(self.voices.get(v).nbytes() for v in self.voices.names())
                 + sum(self.code2wav.voice_bytes(v) for v in self.voices.names()))
        # The arena and the voices are already allocated: free memory is measured after them.
        budget = memory_budget.resolve_memory_budget(e, fixed, memory_budget.device_free_bytes(self.models.device),
                                                     where=str(self.models.device)) - e.activation_reserve
        refs = [self._footprint(self._default_config(v), self.voices.get(v)) for v in self.voices.names()]
        return plan_memory(budget, fixed, refs, self._thinker_block_bytes(), self._talker_block_bytes())

    def _thinker_block_bytes(self) -> int:
        c = self.models.thinker.config
        elem = torch.empty((), dtype=self.models.dtype).element_size()
        return 2 * c.num_hidden_layers * self.block_size * c.num_key_value_heads * c.head_dim * elem

    def _talker_block_bytes(self) -> int:
        c = self.models.talker.config
        elem = torch.empty((), dtype=self.models.dtype).element_size()
        return 2 * c.num_hidden_layers * self.block_size * c.num_key_value_heads * c.head_dim * elem

    def _build_pools(self) -> None:
        m, bs, dev, dt = self.models, self.block_size, self.models.device, self.models.dtype
        self.thinker_cache = m.thinker.make_kv_cache(self.plan.thinker_blocks, bs, dt, dev)
        self.thinker_manager = KVCacheManager(BlockPool(self.plan.thinker_blocks), bs, self.thinker_cache.bytes_per_block)
        self.stage0 = Stage0Runner(m.thinker, self.thinker_manager, self.thinker_cache, self.window,
                                   share_context=self.deploy.stage0.shared_anchor_blocks, block_size=bs)
        tc = m.talker.config
        self.talker_cache = PagedKVCache(tc.num_hidden_layers, self.plan.talker_blocks, bs, tc.num_key_value_heads,
                                         tc.head_dim, dt, dev)
        self.talker_kv = TalkerBlocks(BlockPool(self.plan.talker_blocks), bs)
        self.talker_pool = self.talker_kv.pool   # read by tests and stats; only talker_kv mutates it
        for cache in (self.thinker_cache, self.talker_cache):
            _select_attention_backend(cache)
            cache.ragged_steps_in_kernel = self.deploy.stage0.ragged_kernel
        self.thinker_graphs, self.talker_graphs = self._decode_graphs()
        self.stage0.use_decode_graphs(self.thinker_graphs)

    def _decode_graphs(self) -> tuple[PagedDecodeGraphs | None, PagedDecodeGraphs | None]:
        """CUDA graphs for the one-token steps of the Thinker and the Talker (``engine.decode_cuda_graphs``).

        Batch buckets up to the most sessions the budget admits; block-table widths up to the
        longest table a session can hold (the Thinker's model positions, the Talker's turn)."""
        if not self.deploy.engine.decode_cuda_graphs or not self._can_capture_decode():
            return None, None
        return self._make_decode_graphs(capture=self.models.device.type == "cuda")

    def _can_capture_decode(self) -> bool:
        if self.models.device.type != "cuda":
            logger.info("engine.decode_cuda_graphs applies to CUDA devices; decode on %s runs eagerly",
                        self.models.device)
            return False
        if any(c.decode_backend != "triton" for c in (self.thinker_cache, self.talker_cache)):
            logger.warning("engine.decode_cuda_graphs needs the Triton decode kernel; decode runs eagerly")
            return False
        return True

    def _make_decode_graphs(self, capture: bool) -> tuple[PagedDecodeGraphs, PagedDecodeGraphs]:
        m, bs = self.models, self.block_size
        max_batch = max(1, self.plan.planned_sessions)
        thinker = PagedDecodeGraphs("thinker", m.thinker.forward_paged, self.thinker_cache,
                                    m.thinker.config.hidden_size, m.dtype, max_batch=max_batch,
                                    max_blocks_per_seq=-(-self.stage0.max_positions // bs), capture=capture)
        tc = m.talker.config
        talker = PagedDecodeGraphs("talker", m.talker.forward_paged, self.talker_cache, tc.hidden_size, m.dtype,
                                   max_batch=max_batch, max_blocks_per_seq=-(-tc.max_position_embeddings // bs),
                                   capture=capture)
        return thinker, talker

    def _default_config(self, voice: str) -> SessionRuntimeConfig:
        return build_runtime_config(self.deploy, {"voice": voice})

    # ------------------------------------------------------------------ model adapters

    def _embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.models.thinker.embed(ids)  # checked on the host, then moved

    def _encode_reference_audio(self, audio: torch.Tensor, state: Any) -> EmbeddingResult:
        """Whole-clip encode (touches no per-session streaming state); counted for metrics/tests."""
        self.reference_encodes += 1
        with torch.no_grad():
            emb = self.models.audio_encoder.embed_audio(audio)
        return EmbeddingResult(emb.to(self.models.dtype), EncoderPath.WHOLE_CLIP)

    # ------------------------------------------------------------------ admission

    def context_tokens(self, client_session: Mapping[str, Any]) -> int:
        """The Thinker context length a ``session.update`` object would open with (instructions,
        reference audio, initial text), from shapes only; compare with ``server.max_context_tokens``."""
        cfg, voice = self._check_session(client_session)
        return self._context_layout(cfg, voice).total

    def _context_layout(self, cfg: SessionRuntimeConfig, voice: Voice) -> SessionContext:
        r = self._ref_embeddings[voice.name]
        return build_session_context(
            self.models.tokenizer, lambda ids: torch.zeros(len(ids), 1),
            lambda a, s: EmbeddingResult(torch.zeros(r, 1), EncoderPath.WHOLE_CLIP),
            cfg.instructions, voice.ref_audio, cfg.initial_user_text, model_revision=cfg.model_revision)

    def _footprint(self, cfg: SessionRuntimeConfig, voice: Voice) -> Footprint:
        """Worst-case footprint from shapes only: the context length comes from the context
        builder's own layout with zero-width stand-in embeddings (no model runs)."""
        ctx = self._context_layout(cfg, voice)
        max_pos = self.models.thinker.config.max_position_embeddings
        window = self._session_window(cfg)
        limit = self.deploy.server.max_context_tokens
        if ctx.total > limit:
            raise AdmissionError(
                f"context_length_exceeded: the session context (instructions, reference audio, initial "
                f"text) is {ctx.total} tokens; this server allows at most {limit}",
                code="context_length_exceeded")
        if window.enabled and ctx.total + window.high_tokens > max_pos:
            raise AdmissionError(
                f"context_length_exceeded: context of {ctx.total} tokens + window high {window.high_tokens} "
                f"exceeds the model's {max_pos} positions", code="context_length_exceeded")
        share = self.deploy.stage0.shared_anchor_blocks
        # The runner's own formula (Stage0Runner.worst_case), with this session's marks.
        wc = session_worst_case(ctx.total, window, max_pos, self.block_size, share)
        talker_blocks = -(-self.models.talker.config.max_position_embeddings // self.block_size)
        cfm = self.code2wav.config
        sharing = cfm.prompt_att_sharing
        setup = code2wav_session_bytes(cfm, voice.prompt_frames, sharing, "setup")
        steady = code2wav_session_bytes(cfm, voice.prompt_frames, sharing, "steady")
        encoder = self.models.audio_encoder.cfg.kv_bytes_per_session(self.models.dtype)
        dynamic = max(setup.private, steady.private) + encoder
        # What a stream shares (setup.shared / steady.shared) is the voice's prompt state, which
        # _plan already counts as fixed: a session reserves nothing for it.
        return Footprint(wc.private_blocks, wc.shared_blocks, ctx.extra_key if share else None, talker_blocks,
                         dynamic, voice.name, 0)

    def _session_window(self, cfg: SessionRuntimeConfig) -> WindowConfig:
        """The session's Stage 0 window: the server's mode with the client's marks (config.py
        already refused marks above the server's, or any marks when overrides are off)."""
        return WindowConfig(mode=cfg.window_mode, high_tokens=cfg.window_high_tokens,
                            low_tokens=cfg.window_low_tokens)

    def _check_session(self, client_session: Mapping[str, Any]) -> tuple[SessionRuntimeConfig, Voice]:
        cfg = build_runtime_config(self.deploy, client_session)
        if cfg.voice not in self.voices:
            raise SessionConfigError(f"unknown voice {cfg.voice!r} (known: {', '.join(self.voices.names())})")
        return cfg, self.voices.get(cfg.voice)

    def open_session(self, client_session: Mapping[str, Any], *, queue_if_full: bool = False,
                     sid: str | None = None) -> str:
        if self._closed:
            raise RuntimeError("engine is shut down")
        cfg, voice = self._check_session(client_session)
        fp = self._footprint(cfg, voice)
        with self._lock:
            if sid is not None and (sid in self._sessions or sid in self._queue):
                raise ValueError(f"session id {sid!r} is in use")
            refusal = self._refusal(fp) if not self._queue else (
                "capacity_memory" if self.ledger.refusal(fp) else "capacity_compute",
                "sessions are queued ahead of this one")
            if refusal is not None and not queue_if_full:
                code, detail = refusal
                logger.info("session refused (%s): %s", code, detail)
                raise AdmissionError(_CLIENT_REFUSALS[code], code=code)
            # Ordinals are drawn only here: a refused session leaves no trace (the ordinal seeds
            # the session's Code2Wav noise, so it must not depend on others' refusals).
            seed_name = f"sess_{next(self._ids)}"
            sid = sid or seed_name
            sess = _Session(sid, cfg, voice, fp, policy_state=self.policy.new_session(sid), seed_name=seed_name)
            if refusal is None:
                self.ledger.admit(sid, fp)
                self._sessions[sid] = sess
            else:
                self._queue[sid] = sess
                logger.info("session %s queued (%s): %s", sid, refusal[0], refusal[1])
        return sid

    def _refusal(self, fp: Footprint) -> tuple[str, str] | None:
        """(code, detail for the logs) when ``fp`` cannot be admitted now, memory first; None
        when it can. Compute: the measured per-session tick cost (none yet: memory only)."""
        reason = self.ledger.refusal(fp)
        if reason is not None:
            return "capacity_memory", reason
        reason = self.tick_cost.refusal(len(self._sessions))
        if reason is not None:
            return "capacity_compute", reason
        return None

    def is_queued(self, sid: str) -> bool:
        with self._lock:
            return sid in self._queue

    def queue_position(self, sid: str) -> int | None:
        """1 for the next queued session to be admitted, 2 for the one after...; None when
        ``sid`` is not queued (live, closed or unknown). For ``session.queued`` events."""
        with self._lock:
            for i, queued in enumerate(self._queue, start=1):
                if queued == sid:
                    return i
        return None

    def install_faults(self, faults: FaultInjector | None) -> None:
        """Test hook: make chosen stages raise for chosen sessions (runtime/isolation.py)."""
        self.faults = faults
        self.stage0.faults = faults

    def push_audio(self, sid: str, pcm: np.ndarray) -> None:
        if not isinstance(pcm, np.ndarray) or pcm.dtype != np.float32 or pcm.ndim != 1:
            raise ValueError(f"audio must be a float32 numpy array of shape (samples,) at {INPUT_SAMPLE_RATE} Hz")
        if pcm.size == 0 or not np.isfinite(pcm).all():
            raise InvalidAudioError("audio is empty or contains NaN/Inf")
        peak = float(np.abs(pcm).max())
        if peak > 1.0:
            # Checked here, at the edge: inside the batched encoder it would fail every session.
            raise InvalidAudioError(f"audio samples must be float PCM in [-1, 1]; this chunk peaks at {peak:.4g}")
        with self._lock:
            sess = self._sessions.get(sid)
            if sess is None:
                what = "queued" if sid in self._queue else "unknown"
                raise ValueError(f"cannot push audio to {what} session {sid!r}")
            if sess.buffered + pcm.size > MAX_BUFFERED_SAMPLES:
                # A client sending faster than real time would otherwise grow the buffer
                # without bound; the chunk is refused and the session goes on.
                raise ValueError(
                    f"audio buffer of session {sid!r} is full: {sess.buffered / INPUT_SAMPLE_RATE:.2f} s "
                    f"buffered + {pcm.size / INPUT_SAMPLE_RATE:.2f} s in this chunk > at most "
                    f"{MAX_BUFFERED_SECONDS} s; send audio in real time")
            sess.audio.append(pcm.copy())
            sess.buffered += pcm.size

    @staticmethod
    def _drop_oldest(sess: _Session, samples: int) -> None:
        """Drop the oldest ``samples`` of ``sess``'s buffer (engine lock held)."""
        if samples <= 0 or not sess.audio:
            return
        audio = np.concatenate(sess.audio)[samples:]
        sess.audio = [audio] if audio.size else []
        sess.buffered = int(audio.size)

    def close_session(self, sid: str) -> None:
        with self._lock:
            if self._queue.pop(sid, None) is not None:
                return
            sess = self._sessions.pop(sid, None)
            if sess is None:
                return
            self.ledger.release(sid)
            self._closing.append(sess)   # its memory is freed at the start of the next tick

    # ------------------------------------------------------------------ turn control (runtime/turns.py)

    def _turn_session(self, sid: str) -> _Session:
        """A live or queued session (call under the lock); ValueError if unknown."""
        sess = self._sessions.get(sid) or self._queue.get(sid)
        if sess is None:
            raise ValueError(f"unknown session {sid!r}")
        return sess

    def set_turn_mode(self, sid: str, mode: str) -> None:
        turns.check_mode(mode)
        with self._lock:
            self._turn_session(sid).turn.mode = mode

    def request_response(self, sid: str) -> None:
        with self._lock:
            self._turn_session(sid).turn.response_requested = True

    def cancel_response(self, sid: str, played_ms: int | None = None) -> bool:
        """See engine_api. A request not started yet is withdrawn (no response existed: False)."""
        if played_ms is not None and (not isinstance(played_ms, int) or played_ms < 0):
            raise ValueError(f"played_ms must be a non-negative int or None, got {played_ms!r}")
        with self._lock:
            state = self._turn_session(sid).turn
            state.response_requested = False
            if not state.replying:
                return False
            state.cancel_requested, state.cancel_played_ms = True, played_ms
            return True

    def add_user_text(self, sid: str, text: str) -> None:
        ids = turns.user_text_ids(self.models.tokenizer, text)
        with self._lock:
            sess = self._turn_session(sid)
            pending = sum(len(t) for t in sess.turn.pending_text)
            room = self._user_text_room(sess)
            if pending + len(ids) > room:
                raise ValueError(
                    f"user text of {len(ids)} tokens (with {pending} pending) does not fit session {sid!r}: "
                    f"at most {max(room, 0)} tokens of text fit before its next unit")
            sess.turn.pending_text.append(ids)

    def _user_text_room(self, sess: _Session) -> int:
        window = self._session_window(sess.config)
        # An int read of the tick thread's state: at most one tick old, and the tick checks again.
        try:
            have = self.stage0.num_tokens(sess.sid) if sess.opened else 0
        except ValueError:   # not in Stage 0 (yet, or any more)
            have = 0
        return turns.text_room(window.high_tokens if window.enabled else None, have,
                               self.stage0.max_positions, self.block_size)

    def _user_text_for(self, u: _Unit, events: list[EngineEvent]) -> list[int]:
        """The unit's user text ids, checked again on the tick thread (the session moved on since
        ``add_user_text``); refused text is dropped with a non-fatal error."""
        text = list(u.turn.user_text)
        if text and len(text) > self._user_text_room(u.session):
            events.append(SessionError(u.session.sid, "user_text_too_long",
                                       f"user text of {len(text)} tokens no longer fits the session; dropped"))
            return []
        return text

    def _note_reply_units(self, units: list[_Unit]) -> None:
        for u in units:
            if u.rows is not None and turns.note_unit(u.session.turn, u.rows, u.decision, u.tokens, self.control):
                with self._lock:
                    u.session.turn.replying = True

    def _finish_reply(self, sess: _Session) -> ResponseUsage:
        usage = turns.finish_reply(sess.turn)
        with self._lock:
            sess.turn.replying = False
            sess.turn.cancel_requested = False   # a cancel that came too late has nothing to stop
        return usage

    def _apply_cancels(self) -> list[EngineEvent]:
        """Cancels recorded since the last tick, at this unit boundary (before any unit runs)."""
        with self._lock:
            todo = []
            for sess in self._sessions.values():
                if sess.turn.cancel_requested:
                    todo.append((sess, sess.turn.cancel_played_ms))
                    sess.turn.cancel_requested = False
        events: list[EngineEvent] = []
        for sess, played_ms in todo:
            try:
                events += self._cancel_reply(sess, played_ms)
            except Exception as err:  # noqa: BLE001 - a failed rewind ends its session only
                events.append(self._end(sess, err))
        return events

    def _cancel_reply(self, sess: _Session, played_ms: int | None) -> list[EngineEvent]:
        """Drop the held codes, the Code2Wav stream and the Talker KV; rewind the Thinker to what
        was played (turns.py); then ResponseDone(cancelled)."""
        reply = sess.turn.reply
        if reply is None or not sess.opened:
            return []
        rewind = turns.plan_rewind(reply, played_ms, self.stage0.droppable_tail(sess.sid), self.control)
        if sess.c2w_sid is not None:
            self.code2wav.remove_session(sess.c2w_sid)
        sess.c2w_sid, sess.held = None, None
        self.talker_kv.free(sess.sid)
        close, listen = self._embed_tokens(torch.tensor([rewind.close_token, self.control.listen]))
        err = turns.apply_rewind(self.stage0, sess.sid, rewind, close[None], listen[None])
        usage = self._finish_reply(sess)
        logger.info("session %s: reply cancelled after %d of %d units played (%d Thinker tokens dropped, %d appended)",
                    sess.sid, rewind.played_units, len(reply), rewind.drop, rewind.appended)
        events: list[EngineEvent] = [ResponseDone(sess.sid, "cancelled", usage)]
        if err is not None:
            events.append(self._end(sess, err))
        return events

    # ------------------------------------------------------------------ read-only views

    def session_ids(self) -> list[str]:
        """Live (admitted, not queued) sessions, in admission order."""
        with self._lock:
            return list(self._sessions)

    def session_info(self, sid: str) -> SessionInfo:
        """A snapshot of live session ``sid`` (consistent between ticks); ValueError if unknown."""
        s = self._live_session(sid)
        opened = s.opened and sid in self.stage0.sessions
        return SessionInfo(
            sid=sid, voice=s.voice.name, opened=opened, units=s.unit_index, turns=s.turn_index,
            code2wav_stream=s.c2w_sid, window=self._session_window(s.config),
            thinker_anchor_tokens=self.stage0.sessions[sid].prefix_len if opened else 0,
            thinker_tokens=self.stage0.num_tokens(sid) if opened else 0,
            talker_tokens=self.talker_kv.num_tokens(sid), talker_blocks=self.talker_kv.num_blocks(sid))

    def _live_session(self, sid: str) -> _Session:
        with self._lock:
            sess = self._sessions.get(sid)
            if sess is None:
                what = "queued" if sid in self._queue else "unknown"
                raise ValueError(f"{what} session {sid!r} (live sessions: {', '.join(self._sessions) or 'none'})")
            return sess

    # ------------------------------------------------------------------ fast-forward (benchmarks)

    def fast_forward(self, sid: str, *, thinker_tokens: int | None = None, talker_full_turn: bool = False,
                     chunk_tokens: int = 512, seed: int = 0) -> FastForwardResult:
        """For benchmarks: brings per-session state to its steady size without running the audio path.

        ``thinker_tokens``: fill the session's Thinker window (the tokens after its anchor) up
        to this many tokens with embeddings of seeded random text ids, through the serving
        append path (``Stage0Runner.append``, ``chunk_tokens`` per forward), so blocks, window
        bookkeeping and pool accounting are exactly those of serving. The limit is the session's
        high mark (window off: the model's positions less the anchor); the fill stops at or
        below it, so the fill itself never compacts and the next unit compacts as in serving.
        The fill tokens are not unit starts. None leaves the Thinker as it is.

        ``talker_full_turn``: hold Talker blocks for a full turn (``max_position_embeddings``
        tokens, what admission reserved); they are held, not computed, and the turn's next
        units compute into them. Pool stats are refreshed afterwards.

        Call between ticks (it waits for a running tick). The session must be open in Stage 0
        (one tick after ``open_session``). ValueError on an unknown, queued or unopened session,
        on a length past the limit or below what the window holds already.
        """
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        with self._tick_lock:
            if self._closed:
                raise RuntimeError("engine is shut down")
            sess = self._live_session(sid)
            if not (sess.opened and sid in self.stage0.sessions):
                raise ValueError(f"session {sid!r} is not open in Stage 0 yet: run a tick after open_session")
            todo = self._thinker_fill_count(sid, thinker_tokens) if thinker_tokens is not None else 0
            appended = self._fill_thinker(sess, todo, chunk_tokens, seed)
            added = 0
            if talker_full_turn:
                added = self.talker_kv.grow(sid, self.models.talker.config.max_position_embeddings)
            self._refresh_pools()
        return FastForwardResult(appended, added)

    def _thinker_fill_count(self, sid: str, thinker_tokens: int) -> int:
        """Tokens to append so the window holds ``thinker_tokens``; ValueError when out of range::

            [ anchor (prefix) | window now ........ | fill ......... ]
                              |<-- have ----------->|<-- returned -->|
                              |<-- thinker_tokens (<= high) -------->|
        """
        prefix = self.stage0.sessions[sid].prefix_len
        have = self.stage0.num_tokens(sid) - prefix
        window = self.stage0.session_window(sid)
        if window.enabled:
            limit, what = window.high_tokens, f"the window's high mark ({window.high_tokens} tokens after the anchor)"
        else:
            limit = self.stage0.max_positions - prefix
            what = f"the model's {self.stage0.max_positions} positions less the {prefix}-token anchor"
        if thinker_tokens > limit:
            raise ValueError(f"session {sid!r}: thinker_tokens {thinker_tokens} is past {what}")
        if thinker_tokens < have:
            raise ValueError(f"session {sid!r}: thinker_tokens {thinker_tokens} is below the {have} window tokens "
                             "it holds already; fast_forward only grows")
        return thinker_tokens - have

    def _fill_thinker(self, sess: _Session, todo: int, chunk_tokens: int, seed: int) -> int:
        if todo == 0:
            return 0
        # Ids depend on (sid, seed, length so far) only, not on chunk_tokens: the same fill in
        # every configuration of a bench run, and chunking changes nothing but the forwards.
        start = self.stage0.num_tokens(sess.sid)
        g = torch.Generator().manual_seed(zlib.crc32(f"{sess.seed_name}/{seed}/{start}".encode()))
        ids = self._text_ids[torch.randint(len(self._text_ids), (todo,), generator=g)]
        for chunk in torch.split(ids, chunk_tokens):
            result = self.stage0.append({sess.sid: self._embed_tokens(chunk)}, unit_start=False)
            if sess.sid in result.errors:
                # Cannot happen at or below the high mark with the blocks admission reserved.
                err = result.errors[sess.sid]
                self._end(sess, err)
                raise RuntimeError(f"fast-forward ended session {sess.sid}: {err}") from err
        return todo

    # ------------------------------------------------------------------ the tick

    def tick(self) -> list[EngineEvent]:
        with self._tick_lock:
            return self._tick()

    def _tick(self) -> list[EngineEvent]:
        if self._closed:
            raise RuntimeError("engine is shut down")
        start = time.perf_counter()
        lat = dict.fromkeys(STAGES, 0.0)
        events: list[EngineEvent] = []
        with self._lock:
            closing, self._closing = self._closing, []
        for sess in closing:
            self._free(sess)
        events += self._admit_queued()
        with self._lock:
            pending = [s for s in self._sessions.values() if not s.opened]
        prefill_s = 0.0
        if pending:
            t = time.perf_counter()
            events += self._open(pending)
            prefill_s = time.perf_counter() - t
        events += self._apply_cancels()
        units = self._take_units()
        if units:
            events += self._run_units(units, lat)
        lat["tick"] = time.perf_counter() - start
        # The cost model learns the unit work only: prefill is bounded separately (one chunk).
        self.tick_cost.observe(lat["tick"] - prefill_s, len(units))
        with self._lock:
            live = set(self._sessions)
        # A session closed while this tick ran gets no more events.
        events = [e for e in events if e.sid in live or isinstance(e, SessionError)]
        self._finish_tick(lat)
        return events

    def _finish_tick(self, lat: dict[str, float]) -> None:
        for stage, value in lat.items():
            self.latency_history[stage].append(value)
        period = self.deploy.engine.tick_seconds
        if lat["tick"] > period:
            self.late_ticks += 1
            logger.warning("tick %d ran late: %.3f s > tick_seconds %.3f s (back-pressure: %d late ticks)",
                           self._ticks + 1, lat["tick"], period, self.late_ticks)
        self._refresh_pools()
        with self._lock:
            self._last_latency = {k: (v,) for k, v in lat.items()}
            self._ticks += 1

    def _admit_queued(self) -> list[EngineEvent]:
        events: list[EngineEvent] = []
        with self._lock:
            while self._queue:
                sid, sess = next(iter(self._queue.items()))
                if self._refusal(sess.footprint) is not None:
                    break  # FIFO: later sessions wait behind the first one
                del self._queue[sid]
                self.ledger.admit(sid, sess.footprint)
                self._sessions[sid] = sess
                events.append(SessionAdmitted(sid))
        return events

    def _open(self, pending: list[_Session]) -> list[EngineEvent]:
        """Build each new session's context (context cache on the way), queue it for its chunked
        prefill, and advance the prefills by one chunk (``engine.prefill_chunk_tokens``).

        A session whose prefill takes more than the tick it was queued in would start that many
        seconds behind real time and stay behind (one unit per tick): when it opens, the audio
        that arrived while it prefilled is trimmed to its first unit (logged)."""
        events: list[EngineEvent] = []
        for sess in pending:
            if sess.prefill_tick is not None:
                continue  # already queued in Stage 0
            try:
                check_faults(self.faults, "open", (sess.sid,), "precheck")
                sess.encoder_state = self.models.audio_encoder.new_stream_state()
                ctx = self.builder.build(sess.config.instructions, sess.voice.ref_audio,
                                         sess.config.initial_user_text, encoder_state=sess.encoder_state)
                context = SessionContextInput(ctx.inputs_embeds, ctx.token_ids, ctx.extra_key)
                # The window its footprint reserved.
                self.stage0.enqueue_open(sess.sid, context, self._session_window(sess.config))
            except Exception as err:  # noqa: BLE001 - one session's context never fails the tick
                events.append(self._end(sess, err))
                continue
            sess.prefill_tick = self._ticks
        result = self.stage0.prefill(self.deploy.engine.prefill_chunk_tokens)
        by_sid = {s.sid: s for s in pending}
        for sid, err in result.errors.items():
            if sid in by_sid:
                events.append(self._end(by_sid[sid], err))
        for sid in result.opened:
            sess = by_sid.get(sid)
            if sess is None:   # closed while this tick ran: freed at the start of the next
                continue
            sess.opened = True
            if sess.prefill_tick is not None and sess.prefill_tick < self._ticks:
                self._trim_after_prefill(sess)
        return events

    def _trim_after_prefill(self, sess: _Session) -> None:
        keep = self.models.audio_encoder.cfg.first_chunk_samples
        with self._lock:
            drop = sess.buffered - keep
            if drop > 0:
                self._drop_oldest(sess, drop)
        if drop > 0:
            logger.info("session %s: prefill took %d ticks; dropped %.2f s of audio received meanwhile",
                        sess.sid, self._ticks - (sess.prefill_tick or 0) + 1, drop / INPUT_SAMPLE_RATE)

    def _take_units(self) -> list[_Unit]:
        enc = self.models.audio_encoder
        units = []
        with self._lock:
            for sess in self._sessions.values():
                if not sess.opened:
                    continue
                need = enc.expected_chunk_samples(sess.encoder_state)
                if sess.buffered < need:
                    continue
                if sess.buffered >= need + 2 * enc.cfg.chunk_samples:
                    logger.debug("session %s is %.1f s behind", sess.sid, sess.buffered / INPUT_SAMPLE_RATE)
                audio = np.concatenate(sess.audio)
                rest = audio[need:]
                sess.audio = [rest] if rest.size else []
                sess.buffered = rest.size
                units.append(_Unit(sess, audio[:need], turn=turns.take_unit_requests(sess.turn)))
        return units

    def _run_units(self, units: list[_Unit], lat: dict[str, float]) -> list[EngineEvent]:
        events: list[EngineEvent] = []
        t = time.perf_counter()
        units, embeds = self._encoder(units, events)
        lat["encoder"] = time.perf_counter() - t
        t = time.perf_counter()
        units = self._thinker(units, embeds, events) if units else []
        lat["thinker"] = time.perf_counter() - t
        self._note_reply_units(units)
        for u in units:
            text = [tok for tok in u.tokens if tok not in self.control.ends]
            if text:
                events.append(TextDelta(u.session.sid, self._detokenize(text)))
        # A stage that had nothing to do this tick records 0 (not a sample).
        t = time.perf_counter()
        finals = self._talker(units, events)
        units = [u for u in units if u.session.sid not in self._ended(events)]
        if any(u.codes is not None for u in units):
            lat["talker"] = time.perf_counter() - t
        t = time.perf_counter()
        audio = self._code2wav(units, finals)
        if any(isinstance(e, AudioDelta) for e in audio):
            lat["code2wav"] = time.perf_counter() - t
        events += audio
        for u in units:
            u.session.unit_index += 1
        return events

    # ------------------------------------------------------------------ isolation helpers

    @staticmethod
    def _ended(events: list[EngineEvent]) -> set[str]:
        """Sessions this tick ended so far (their later stages must not run)."""
        return {e.sid for e in events if isinstance(e, SessionError) and e.fatal}

    def _end_all(self, units: list[_Unit], errors: Mapping[str, Exception], events: list[EngineEvent]) -> list[_Unit]:
        """End the sessions named in ``errors``; returns the units of the others."""
        for u in units:
            if u.session.sid in errors:
                events.append(self._end(u.session, errors[u.session.sid]))
        return [u for u in units if u.session.sid not in errors]

    # ------------------------------------------------------------------ audio encoder

    def _encoder(self, units: list[_Unit], events: list[EngineEvent]) -> tuple[list[_Unit], list[torch.Tensor]]:
        """One batched encoder step; a session whose audio fails ends alone (runtime/isolation.py)."""
        enc = self.models.audio_encoder
        _, errors = precheck(self.faults, "encoder", units, lambda u: u.session.sid, self._check_unit_audio)
        units = self._end_all(units, errors, events)

        def run(batch: list[_Unit]) -> list[torch.Tensor]:
            return enc.stream_step([u.session.encoder_state for u in batch], [torch.from_numpy(u.pcm) for u in batch])

        def snapshot(u: _Unit) -> tuple[int, int, int]:
            st = u.session.encoder_state
            return st.num_frames, st.num_chunks, st.num_resets

        def restore(u: _Unit, saved: object) -> None:
            st = u.session.encoder_state
            st.num_frames, st.num_chunks, st.num_resets = saved  # type: ignore[misc]

        iso: Isolated[_Unit, list[torch.Tensor]] = run_isolated(
            "encoder", units, run, lambda u: u.session.sid, self.faults, snapshot, restore)
        self._end_all(units, iso.errors, events)
        return iso.kept, iso.result or []

    def _check_unit_audio(self, u: _Unit) -> None:
        """What the encoder would refuse for this session alone (push_audio checked it already)."""
        if not np.isfinite(u.pcm).all() or float(np.abs(u.pcm).max(initial=0.0)) > 1.0:
            raise InvalidAudioError("audio samples must be finite float PCM in [-1, 1]")

    # ------------------------------------------------------------------ Thinker

    def _thinker(self, units: list[_Unit], embeds: list[torch.Tensor], events: list[EngineEvent]) -> list[_Unit]:
        """Append each unit's audio, then decode until every session listened or ended its text."""
        c = self.control
        kept, errors = precheck(self.faults, "thinker", list(zip(units, embeds)), lambda ue: ue[0].session.sid)
        self._end_all(units, errors, events)
        units = [u for u, _ in kept]
        embeds = [e for _, e in kept]
        inputs = {}
        for u, emb in zip(units, embeds):
            text = self._user_text_for(u, events)
            ids = ([c.unit_end] if u.session.unit_index > 0 else []) + text + [c.unit]
            tok = self._embed_tokens(torch.tensor(ids, dtype=torch.long))
            u.rows = inputs[u.session.sid] = torch.cat([tok, emb.to(tok.dtype)], dim=0)
        by_sid = {u.session.sid: u for u in units}
        result = self.stage0.append(inputs, unit_start=True)
        self._drop_failed(by_sid, result.errors, events)
        feed = {}
        for sid, logits in result.logits.items():
            u = by_sid[sid]
            decision = self.policy.decide(u.session.unit_index, logits, u.session.policy_state, u.pcm)
            # The decision fed back (into the KV) is the turn-forced one, so the model sees it.
            u.decision = turns.decide(u.turn, u.session.turn, decision, c)
            feed[sid] = u.decision
        while feed:
            result = self.stage0.decode(feed)
            self._drop_failed(by_sid, result.errors, events)
            nxt = {}
            for sid, fed in feed.items():
                if sid in result.errors or fed == c.listen or fed in c.ends:
                    continue  # the unit is complete: its last token is now in the KV
                u = by_sid[sid]
                num_text = len(u.tokens)
                if num_text >= MAX_UNIT_TOKENS - 2:
                    tok = c.chunk_eos   # decision + 18 text + end = 20 tokens
                else:
                    tok = self.policy.next_token(u.session.unit_index, num_text, result.logits[sid],
                                                 u.session.policy_state)
                u.tokens.append(tok)
                u.hidden.append(result.hidden[sid])   # the row whose logits chose ``tok``
                nxt[sid] = tok
            feed = nxt
        return [u for u in units if u.session.sid in by_sid]

    def _drop_failed(self, by_sid: dict[str, _Unit], errors: Mapping[str, Exception], events: list[EngineEvent]) -> None:
        for sid, err in errors.items():
            u = by_sid.pop(sid, None)
            if u is not None:
                events.append(self._end(u.session, err))

    def _detokenize(self, ids: list[int]) -> str:
        tok = self.models.tokenizer
        inner = getattr(tok, "_tok", None)
        if inner is not None:
            return inner.decode(ids)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ Talker

    def _talker(self, units: list[_Unit], events: list[EngineEvent]) -> dict[str, _Final]:
        """25 codes for each speaking unit. Returns held codes to flush as final chunks of turns
        that end before this unit (a listen after speaking, or a Talker turn at its limit).
        A session whose Talker work fails ends alone (``events``); the others keep their codes."""
        finals: dict[str, _Final] = {}
        cfg = self.models.talker.config
        speakers = []
        for u in units:
            s = u.session
            if u.decision != self.control.speak:
                if s.c2w_sid is not None:   # stopped speaking: the turn is over
                    self._close_turn(s, finals)
                continue
            need = len(u.tokens) + cfg.tokens_per_unit + 1
            have = self.talker_kv.num_tokens(s.sid)
            if have + need > cfg.max_position_embeddings:
                logger.info("session %s: Talker turn at %d tokens; starting a new audio turn", s.sid, have)
                self._close_turn(s, finals, response_done=False)   # the Thinker's turn goes on
            self.talker_kv.grow(s.sid, self.talker_kv.num_tokens(s.sid) + need)
            speakers.append(u)
        if not speakers:
            return finals
        _, errors = precheck(self.faults, "talker", speakers, lambda u: u.session.sid)
        speakers = self._end_all(speakers, errors, events)

        def run(batch: list[_Unit]) -> list:
            reqs = [TalkerUnitRequest(self.talker_kv.block_table(u.session.sid), self.talker_kv.num_tokens(u.session.sid),
                                      torch.tensor(u.tokens, dtype=torch.long), torch.stack(u.hidden))
                    for u in batch]
            return generate_unit(self.models.talker, self.talker_cache, reqs, graphs=self.talker_graphs)

        # A retry rewrites the same Talker KV slots (the computed length only moves below), so a failed
        # batch is probed per session (runtime/isolation.py).
        iso = run_isolated("talker", speakers, run, lambda u: u.session.sid, self.faults)
        self._end_all(speakers, iso.errors, events)
        for u, res in zip(iso.kept, iso.result or []):
            self.talker_kv.set_num_computed(u.session.sid, res.num_computed)
            u.codes = res.codes[: cfg.tokens_per_unit]
        return self._drop_ended_finals(finals, self._ended(events))

    def _drop_ended_finals(self, finals: dict[str, _Final], ended: set[str]) -> dict[str, _Final]:
        """Remove the closed-turn streams of sessions this tick ended (``_free`` only knows the
        current turn's stream); returns the finals of the others."""
        for csid, f in finals.items():
            if f.session.sid in ended:
                with contextlib.suppress(ValueError):   # already removed (unknown stream)
                    self.code2wav.remove_session(csid)
        return {csid: f for csid, f in finals.items() if f.session.sid not in ended}

    def _close_turn(self, s: _Session, finals: dict[str, _Final], response_done: bool = True) -> None:
        """End the audio turn: its held codes become the final chunk; the Talker KV resets."""
        assert s.c2w_sid is not None
        if s.held is not None:
            finals[s.c2w_sid] = _Final(s, s.held, response_done)
        else:
            self.code2wav.remove_session(s.c2w_sid)
        s.held, s.c2w_sid = None, None
        self.talker_kv.free(s.sid)

    # ------------------------------------------------------------------ Code2Wav

    def _code2wav(self, units: list[_Unit], finals: dict[str, _Final]) -> list[EngineEvent]:
        """Non-final chunks (held codes + lookahead) in one batched step, then the final chunks
        of every turn that ended in this tick in a second one."""
        chunks: dict[str, torch.Tensor] = {}
        owner = {csid: f.session for csid, f in finals.items()}
        for u in units:
            s = u.session
            if u.codes is None:
                continue
            if s.c2w_sid is None:
                s.turn_index += 1
                s.c2w_sid = f"{s.sid}#{s.turn_index}"
                seed = zlib.crc32(f"{s.seed_name}#{s.turn_index}".encode())
                self.code2wav.add_session(s.c2w_sid, s.voice.name, seed=seed)
            owner[s.c2w_sid] = s
            if s.held is not None:
                chunks[s.c2w_sid] = torch.cat([s.held, u.codes[:LOOKAHEAD]])
            s.held = u.codes
            if u.tokens and u.tokens[-1] == self.control.turn_eos:
                self._close_turn(s, finals)
        events: list[EngineEvent] = []
        final_chunks = {csid: f.codes for csid, f in finals.items()}
        for batch, last in ((chunks, False), (final_chunks, True)):
            ended = self._ended(events)   # a session ended by the first step has no final chunk
            batch = {csid: codes for csid, codes in batch.items() if owner[csid].sid not in ended}
            if batch:
                events += self._code2wav_step(batch, last, owner)
        self._note_code2wav_peak()
        for csid, f in self._drop_ended_finals(finals, self._ended(events)).items():
            self.code2wav.remove_session(csid)
            if f.response_done:
                events.append(ResponseDone(f.session.sid, "completed", self._finish_reply(f.session)))
        return events

    def _code2wav_step(self, batch: dict[str, torch.Tensor], last: bool, owner: dict[str, _Session]) -> list[EngineEvent]:
        """One Code2Wav step. A chunk that fails its check (the injected fault, or
        ``BatchedCode2Wav``'s own per-session validation) ends its session only. Code2Wav
        mutates every stream's caches group by group, so a batch that raises anyway cannot be
        re-run: that step's sessions skip this unit's audio (non-fatal ``audio_skipped``, their
        turn's stream restarts at the next speaking unit); the tick's other work is kept."""
        events: list[EngineEvent] = []
        kept, errors = precheck(self.faults, "code2wav", list(batch), lambda csid: owner[csid].sid)
        for csid, err in ((c, errors[owner[c].sid]) for c in batch if owner[c].sid in errors):
            events.append(self._end(owner[csid], err))
        batch = {csid: batch[csid] for csid in kept}
        if not batch:
            return events
        try:
            out = self.code2wav.step(batch, {sid: last for sid in batch})
        except Exception as err:  # noqa: BLE001 - see the docstring: the unit is skipped
            logger.error("Code2Wav step over %d streams failed; their audio for this unit is skipped: %r",
                         len(batch), err)
            for csid in batch:
                s = owner[csid]
                if s.c2w_sid == csid:
                    self.code2wav.remove_session(csid)
                    s.c2w_sid, s.held = None, None
                turns.note_audio(s.turn, 0)
                events.append(SessionError(s.sid, "audio_skipped", "this unit's audio could not be produced",
                                           fatal=False))
            return events
        for csid, err in out.errors.items():
            logger.error("Code2Wav refused %s: %s", csid, err)
            turns.note_audio(owner[csid].turn, 0)
            events.append(self._end(owner[csid], err))
        for csid, pcm in out.items():
            events.append(AudioDelta(owner[csid].sid, pcm16_bytes(pcm)))
            turns.note_audio(owner[csid].turn, int(pcm.numel()))
        return events

    # ------------------------------------------------------------------ ending sessions

    def _end(self, sess: _Session, err: Exception) -> SessionError:
        """End a session the engine cannot continue (it owns nothing afterwards)."""
        code = getattr(err, "code", "engine_error")
        logger.info("session %s ended: %s", sess.sid, err)
        with self._lock:
            if self._sessions.pop(sess.sid, None) is not None:
                self.ledger.release(sess.sid)
        self._free(sess)
        return SessionError(sess.sid, code, str(err), fatal=True)

    def _free(self, sess: _Session) -> None:
        """Free everything ``sess`` holds (tick thread only)."""
        if sess.sid in self.stage0.sessions or self.stage0.is_prefilling(sess.sid):
            self.stage0.close_session(sess.sid)
        sess.opened = False
        if sess.c2w_sid is not None:
            self.code2wav.remove_session(sess.c2w_sid)
            sess.c2w_sid, sess.held = None, None
        self.talker_kv.free(sess.sid)
        sess.encoder_state = None

    def shutdown(self) -> None:
        """Close every session and release the engine's memory (call with no tick running)."""
        with self._lock:
            sessions = list(self._sessions.values()) + self._closing
            for sid in list(self._sessions):
                self.ledger.release(sid)
            self._sessions.clear()
            self._queue.clear()
            self._closing = []
        for sess in sessions:
            self._free(sess)
        self._closed = True
        for graphs in (self.thinker_graphs, self.talker_graphs):
            if graphs is not None:
                graphs.close()
        self.stage0.use_decode_graphs(None)
        self.thinker_graphs = self.talker_graphs = None
        self.thinker_cache = self.talker_cache = None  # type: ignore[assignment]
        logger.info("engine shut down")

    # ------------------------------------------------------------------ stats

    def _code2wav_tier(self) -> TierBytes:
        """shared: the voices' prompt states (fixed, allocated at start); private: the streams'
        caches, which are what the dynamic region holds."""
        shared = sum(self.code2wav.voice_bytes(v) for v in self.voices.names())
        private = sum(self.code2wav.session_bytes(s).private for s in self.code2wav.sessions)
        return TierBytes(shared=shared, private=private, free=max(0, self.plan.dynamic_bytes - private))

    def _note_code2wav_peak(self) -> None:
        """Code2Wav streams end inside the tick that ends their turn; keep the busiest moment."""
        now = self._code2wav_tier()
        if now.shared + now.private > self.code2wav_peak.shared + self.code2wav_peak.private:
            self.code2wav_peak = now

    def _refresh_pools(self) -> None:
        """Bytes per tier, computed on the tick thread (stats() only reads the snapshot)."""
        ps = self.stage0.pool_stats()
        b = ps.bytes_per_block
        thinker = TierBytes(shared=ps.shared * b, private=(ps.used - ps.shared) * b, free=ps.free * b)
        tb = self.talker_cache.bytes_per_block if self.talker_cache is not None else 0
        talker = TierBytes(shared=0, private=self.talker_kv.num_used * tb, free=self.talker_kv.num_free * tb)
        c2w = self._code2wav_tier()
        with self._lock:
            enc = sum(s.encoder_state.nbytes for s in self._sessions.values() if s.encoder_state is not None)
        # The dynamic region holds both Code2Wav and encoder caches: its free bytes are shown once.
        c2w = TierBytes(shared=c2w.shared, private=c2w.private, free=max(0, c2w.free - enc))
        # The Euler arena (fixed at start) and the context cache's embeddings are shared by
        # every session; listing them here puts them on /metrics next to the pools.
        cache = self.builder.cache
        pools = {"thinker_kv": thinker, "talker_kv": talker, "code2wav": c2w,
                 "audio_encoder": TierBytes(shared=0, private=enc, free=0),
                 "cfm_arena": TierBytes(shared=self.code2wav.arena.nbytes(), private=0, free=0),
                 "context_cache": TierBytes(shared=cache.nbytes() if cache is not None else 0, private=0, free=0)}
        with self._lock:
            self._pools = pools

    def stats(self) -> EngineStats:
        cache = self.builder.cache
        with self._lock:
            return EngineStats(
                live_sessions=len(self._sessions), queued_sessions=len(self._queue), pools=dict(self._pools),
                context_cache_hits=cache.hits if cache is not None else 0,
                context_cache_misses=cache.misses if cache is not None else 0,
                cfm_prompt_passes=dict(self.code2wav.batch_stats.prompt_passes_per_voice), ticks=self._ticks,
                stage_latency_s=dict(self._last_latency),
                decode_graph_steps={name: g.stats.replays for name, g in
                                    (("thinker", self.thinker_graphs), ("talker", self.talker_graphs))
                                    if g is not None},
                graph_captures={"warmup": self._warmup_captures,
                                "tick": self._graph_captures_total() - self._warmup_captures},
                warmup_seconds=self.warmup_report.seconds if self.warmup_report is not None else None)
