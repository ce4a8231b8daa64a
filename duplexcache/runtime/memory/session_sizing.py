"""Session sizing: what a session would cost, from shapes only, and the engine's memory plan.

Admission must answer before any model runs (``DuplexEngine.open_session`` holds no tick), so
every size here comes from shapes: the context length from the context builder's own layout
with zero-width stand-in embeddings, the Thinker blocks from Stage 0's worst-case formula,
the Talker's from a full turn, the dynamic bytes from Code2Wav's and the encoder's shapes.

"Can I admit?" lives here (``refusal``); the engine's session table does the admitting.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from duplexcache.cfm.code2wav import BatchedCode2Wav, code2wav_session_bytes
from duplexcache.config import ConfigError, DeployConfig, SpeakPolicy, format_bytes
from duplexcache.runtime_config import SessionConfigError, SessionRuntimeConfig, build_runtime_config
from duplexcache.context import EmbeddingResult, EncoderPath, SessionContext, build_session_context
from duplexcache.context.tokenizer import Tokenizer
from duplexcache.kv.kv_quant import kv_storage_dtype
from duplexcache.kv.paged_attention import bytes_per_block
from duplexcache.kv.window import WindowConfig
from duplexcache.runtime.memory import memory_budget
from duplexcache.runtime.memory.admission import (AdmissionLedger, BudgetTooSmall, Footprint, MemoryPlan, TickCostModel,
                                           plan_memory)
from duplexcache.runtime.bundle import ModelBundle
from duplexcache.models.talker import TalkerConfig
from duplexcache.runtime.engine_api import AdmissionError
from duplexcache.runtime.policy import MAX_UNIT_TOKENS
from duplexcache.runtime.stage0.runner import session_worst_case
from duplexcache.runtime.voices import Voice

logger = logging.getLogger(__name__)



def refusal(ledger: AdmissionLedger, tick_cost: TickCostModel, fp: Footprint,
            live_sessions: int) -> tuple[str, str] | None:
    """(code, detail for the logs) when ``fp`` cannot be admitted now, memory first; None
    when it can. Compute: the measured per-session tick cost (none yet: memory only)."""
    reason = ledger.refusal(fp)
    if reason is not None:
        return "capacity_memory", reason
    reason = tick_cost.refusal(live_sessions)
    if reason is not None:
        return "capacity_compute", reason
    return None


class RefusalLog:
    """The refusals' details for the operator, without a line per refusal: a refused client asks
    again at every audio append (10 a second), and 13 refused callers wrote 7406 of a 60 s run's
    7798 log lines. Each cause is logged the first time and then at most once every
    ``interval_s``, with how many refusals the line stands for. Called under the session
    table's lock."""

    def __init__(self, log: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log, self.interval_s, self.clock = log, interval_s, clock
        self._last: dict[str, tuple[float, int]] = {}   # code -> (when last logged, refused since)

    def refused(self, code: str, detail: str) -> None:
        now = self.clock()
        last = self._last.get(code)
        if last is not None and now - last[0] < self.interval_s:
            self._last[code] = (last[0], last[1] + 1)
            return
        since = ""
        if last is not None and last[1]:
            since = f" ({last[1]} more refused for this cause in the last {now - last[0]:.0f} s)"
        self.log.info("session refused (%s): %s%s", code, detail, since)
        self._last[code] = (now, 0)


def session_window(cfg: SessionRuntimeConfig) -> WindowConfig:
    """The session's Stage 0 window: the server's mode with the client's marks (config.py
    already refused marks above the server's, or any marks when overrides are off)."""
    return WindowConfig(mode=cfg.window_mode, high_tokens=cfg.window_high_tokens, low_tokens=cfg.window_low_tokens)


def kv_block_bytes(config: Any, block_size: int, dtype: torch.dtype, storage_dtype: torch.dtype | None = None) -> int:
    """Bytes of one paged K+V block of a decoder with ``config``'s shapes; the pool's own formula,
    so an fp8 pool (``precision.kv_cache_dtype``) counts its values and scales."""
    return bytes_per_block(config.num_hidden_layers, block_size, config.num_key_value_heads, config.head_dim,
                           dtype, storage_dtype)


def largest_unit_tokens(config: TalkerConfig) -> int:
    """Talker KV tokens of the largest speaking unit: its condition rows (at most every token the
    Thinker decodes in a unit) plus the codes and the end code."""
    return MAX_UNIT_TOKENS + config.tokens_per_unit + 1


def resolve_turn_tokens(requested: int | None, config: TalkerConfig) -> int:
    """``engine.talker_turn_tokens`` checked against the Talker: None = its
    ``max_position_embeddings``; ConfigError (a ValueError: the CLI reports it in one line)
    outside [largest unit, max_position_embeddings], e.g. a minicpmo45 config on the tiny preset."""
    turn = config.max_position_embeddings if requested is None else requested
    low, high = largest_unit_tokens(config), config.max_position_embeddings
    if not low <= turn <= high:
        raise ConfigError(f"engine.talker_turn_tokens must be between {low} (one unit: {MAX_UNIT_TOKENS} condition "
                         f"rows + {config.tokens_per_unit} codes + end) and the Talker's max_position_embeddings "
                         f"{high}, got {turn}")
    return turn


def policy_turn_units(policy: SpeakPolicy) -> int | None:
    """The most units one audio turn of ``policy`` can span, None when it has no bound.

    An audio turn is a run of speaking units; a listening unit closes it (talker_stage.py).
    ``every_k_units`` speaks the last ``min(turn_units, k)`` units of each block of ``k``: with
    ``turn_units < k`` a listening unit follows every ``turn_units`` speaking ones, otherwise
    every unit speaks and the turn never ends. ``reply`` speaks ``reply_max_units`` units at most
    per reply; a caller who starts a new user turn while a reply runs can chain two replies
    without a listening unit between, which the Talker stage then cuts into audio turns at this
    bound (the path it already takes at ``talker_turn_tokens``). ``model``: the Thinker decides,
    no bound."""
    if policy.mode == "every_k_units":
        return policy.turn_units if policy.turn_units < policy.k else None
    if policy.mode == "reply":
        return policy.reply_max_units
    return None


def reserved_turn_tokens(deploy: DeployConfig, config: TalkerConfig) -> int:
    """Talker KV tokens admission reserves per session, and the cap the Talker stage holds an
    audio turn to: ``engine.talker_turn_tokens`` (checked), or the speak policy's longest turn
    at the largest unit's tokens when the policy bounds it and that is smaller. Both the ledger
    and the stage read this one number, so no turn can outgrow its reservation whatever the
    policy does (docs/engine.md, "Talker turns")."""
    turn = resolve_turn_tokens(deploy.engine.talker_turn_tokens, config)
    units = policy_turn_units(deploy.engine.speak_policy)
    if units is None:
        return turn
    return min(turn, units * largest_unit_tokens(config))


class SessionSizing:
    """Shape-only sizes for one engine's models and voices."""

    def __init__(self, deploy: DeployConfig, models: ModelBundle, code2wav: BatchedCode2Wav,
                 tokenizer: Tokenizer | None = None) -> None:
        self.deploy = deploy
        # the engine's (a MemoTokenizer shared with its context builder: what sizing tokenizes on
        # the caller's thread, the tick's build finds ready)
        self.tokenizer = tokenizer if tokenizer is not None else models.tokenizer
        self.models = models
        self.voices = models.voices
        self.code2wav = code2wav
        self.block_size = deploy.stage0.block_size
        # Talker KV tokens one audio turn may hold: admission reserves this many per session and
        # the Talker stage caps a turn at it (engine.talker_turn_tokens, or the policy's bound).
        self.talker_turn_tokens = reserved_turn_tokens(deploy, models.talker.config)
        # Reference-audio embedding counts per voice: the only model run sizing needs, once.
        self.ref_embeddings = {v: self.count_ref_embeddings(self.voices.get(v)) for v in self.voices.names()}
        # model.vision: a video session's unit carries a frame (runtime/stages/vision_stage.py); shapes only
        self.vision = None
        self.frame_tokens = 0
        if deploy.model.vision:
            from duplexcache.runtime.stages.vision_stage import frame_tokens, vision_config

            self.vision = vision_config(deploy.model.preset, models.thinker.config.hidden_size,
                                        deploy.model.checkpoint_dir)
            self.frame_tokens = frame_tokens(self.vision)

    def count_ref_embeddings(self, voice: Voice) -> int:
        with torch.no_grad():
            return int(self.models.audio_encoder.embed_audio(voice.ref_audio).shape[0])

    # ------------------------------------------------------------------ session configs

    def default_config(self, voice: str) -> SessionRuntimeConfig:
        return build_runtime_config(self.deploy, {"voice": voice})

    def check_session(self, client_session: Mapping[str, Any]) -> tuple[SessionRuntimeConfig, Voice]:
        """A client's ``session.update`` object as a runtime config and its voice;
        ``SessionConfigError`` names the problem."""
        cfg = build_runtime_config(self.deploy, client_session)
        if cfg.voice not in self.voices:
            raise SessionConfigError(f"unknown voice {cfg.voice!r} (known: {', '.join(self.voices.names())})")
        return cfg, self.voices.get(cfg.voice)

    def context_layout(self, cfg: SessionRuntimeConfig, voice: Voice) -> SessionContext:
        r = self.ref_embeddings[voice.name]
        return build_session_context(
            self.tokenizer, lambda ids: torch.zeros(len(ids), 1),
            lambda a, s: EmbeddingResult(torch.zeros(r, 1), EncoderPath.WHOLE_CLIP),
            cfg.instructions, voice.ref_audio, cfg.initial_user_text, model_revision=cfg.model_revision)

    # ------------------------------------------------------------------ footprints

    def footprint(self, cfg: SessionRuntimeConfig, voice: Voice) -> Footprint:
        """Worst-case footprint from shapes only: the context length comes from the context
        builder's own layout with zero-width stand-in embeddings (no model runs)."""
        ctx = self.context_layout(cfg, voice)
        max_pos = self.models.thinker.config.max_position_embeddings
        window = session_window(cfg)
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
        frame_bytes = self._video_check(cfg, window) if cfg.video else 0
        share = self.deploy.stage0.shared_anchor_blocks
        # The runner's own formula (Stage0Runner.worst_case), with this session's marks.
        wc = session_worst_case(ctx.total, window, max_pos, self.block_size, share)
        talker_blocks = -(-self.talker_turn_tokens // self.block_size)
        cfm = self.code2wav.config
        sharing = cfm.prompt_att_sharing
        elem = self.code2wav.dtype.itemsize   # precision.code2wav_dtype
        setup = code2wav_session_bytes(cfm, voice.prompt_frames, sharing, "setup", elem)
        steady = code2wav_session_bytes(cfm, voice.prompt_frames, sharing, "steady", elem)
        encoder = self.models.audio_encoder.cfg.kv_bytes_per_session(
            self.models.dtype, kv_storage_dtype(self.deploy.precision.encoder_cache_dtype))
        dynamic = max(setup.private, steady.private) + encoder + frame_bytes
        if not cfg.audio_output:
            # Text-only replies: its units never reach the Talker or Code2Wav (engine._run_units),
            # so it reserves no Talker turn and no Code2Wav stream caches, only its encoder cache.
            talker_blocks, dynamic = 0, encoder + frame_bytes
        # What a stream shares (setup.shared / steady.shared) is the voice's prompt state, which
        # plan() already counts as fixed: a session reserves nothing for it.
        return Footprint(wc.private_blocks, wc.shared_blocks, ctx.extra_key if share else None, talker_blocks,
                         dynamic, voice.name, 0)

    def _video_check(self, cfg: SessionRuntimeConfig, window: WindowConfig) -> int:
        """A video session's extra worst case: its units are ``frame_tokens`` longer, so its
        window must hold one (else its first compaction would end it); its frame's activations in
        the tick's batched vision call are reserved in the dynamic region. Returns those bytes."""
        from duplexcache.runtime.turns import UNIT_TOKENS_BOUND
        from duplexcache.runtime.stages.vision_stage import frame_activation_bytes

        assert self.vision is not None, "config.py refuses video sessions without model.vision"
        unit = UNIT_TOKENS_BOUND + self.frame_tokens
        need = unit + 2 * (self.block_size - 1)   # turns.text_room's slack: two partial blocks
        if window.enabled and window.high_tokens < need:
            raise AdmissionError(
                f"context_length_exceeded: a video unit is up to {unit} tokens ({self.frame_tokens} of them the "
                f"frame's); the session's window high mark {window.high_tokens} must be at least {need}",
                code="context_length_exceeded")
        return frame_activation_bytes(self.vision, self.models.dtype)

    # ------------------------------------------------------------------ the memory plan

    def thinker_block_bytes(self) -> int:
        return kv_block_bytes(self.models.thinker.config, self.block_size, self.models.dtype, self._kv_storage())

    def talker_block_bytes(self) -> int:
        return kv_block_bytes(self.models.talker.config, self.block_size, self.models.dtype, self._kv_storage())

    def _kv_storage(self) -> torch.dtype | None:
        return kv_storage_dtype(self.deploy.precision.kv_cache_dtype)   # precision.kv_cache_dtype

    def fixed_bytes(self) -> int:
        """The engine's fixed buffers (runtime/memory/waterfall.py lists them one by one)."""
        names = self.voices.names()
        # The voices' Code2Wav prompt states were computed by register_voice and live as long as
        # the engine: fixed, once per voice (sharing on or off), never per session.
        return (self.code2wav.arena.nbytes() + sum(self.voices.get(v).nbytes() for v in names)
                + sum(self.code2wav.voice_bytes(v) for v in names) + self.code2wav.vocoder_copy_bytes
                + self.code2wav.vocoder_graph_bytes)

    def plan(self, activation_reserve: int | None = None, headroom: int | None = None) -> MemoryPlan:
        """The pools' sizes for the budget left after what is already allocated.

        ``activation_reserve`` (default ``engine.activation_reserve``) and ``headroom``: a re-plan
        after a measured warm-up (runtime/memory/replan.py ``replan_after_warmup``) passes the measured
        reserve and, for an auto budget, ``engine.memory_headroom``: the budget is then what is
        free less the headroom, not ``memory_budget.AUTO_FREE_SHARE`` of it."""
        e = self.deploy.engine
        reserve = e.activation_reserve if activation_reserve is None else activation_reserve
        if reserve != e.activation_reserve or headroom is not None:
            e = e.model_copy(update={"activation_reserve": reserve})
        fixed = self.fixed_bytes()
        # The arena, the voices, the vocoder copy and its graphs' buffers are already allocated: free memory is
        # measured after them.
        free = memory_budget.device_free_bytes(self.models.device)
        if headroom is not None and e.memory_budget == "auto" and free is not None:
            total = fixed + free - headroom
            logger.info("engine.memory_budget = %.2f GiB (auto after warm-up: fixed %.2f GiB + %.2f GiB free - "
                        "engine.memory_headroom %.2f GiB)", total / 2**30, fixed / 2**30, free / 2**30,
                        headroom / 2**30)
        else:
            total = memory_budget.resolve_memory_budget(e, fixed, free, where=str(self.models.device))
        budget = total - e.activation_reserve
        refs = [self.footprint(self.default_config(v), self.voices.get(v)) for v in self.voices.names()]
        try:
            plan = plan_memory(budget, fixed, refs, self.thinker_block_bytes(), self.talker_block_bytes())
        except BudgetTooSmall as exc:
            # The plan's budget is what is left after activation_reserve, which the user never wrote.
            raise BudgetTooSmall(f"{exc} (engine.memory_budget {format_bytes(budget + e.activation_reserve)} "
                                 f"- engine.activation_reserve {format_bytes(e.activation_reserve)}); raise "
                                 "engine.memory_budget or use memory_budget: auto") from None
        return dataclasses.replace(plan, activation_reserve=e.activation_reserve)
