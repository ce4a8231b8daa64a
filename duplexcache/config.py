"""Deploy configuration (one YAML file), one pydantic model per section.

Flow: ``configs/<preset>.yaml`` -> :class:`DeployConfig` (validated, unknown keys are errors)
-> ``runtime_config.build_runtime_config`` (the server-side plugin) merges what a client may set
in ``session.update`` with the server-owned switches -> ``SessionRuntimeConfig``.

Environment overrides are applied in exactly one place (``config_loading.apply_env_overrides``),
before validation, so validators see the final values: ``DUPLEXCACHE_CFM_GRAPH_GRID`` (the spec's) and
``DUPLEXCACHE_API_KEY`` (``server.api_key``, so the key need not be written into a file).

This module needs only pydantic, pyyaml and the standard library.
"""

from __future__ import annotations

import copy
import ipaddress
import logging
import os
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

# Re-exported: the value parsers and the loading helpers are part of this module's public surface.
from duplexcache.config_loading import (  # noqa: F401
    API_KEY_ENV, MERGED_SWITCHES, RETIRED_KEYS, ConfigError, apply_env_overrides, describe_validation_error,
    drop_retired_keys, merge_switches, move_keys,
)
from duplexcache.config_values import (  # noqa: F401
    AUTO, GRAPH_GRID_ENV, format_bytes, parse_budget, parse_bytes, parse_graph_grid,
)

logger = logging.getLogger(__name__)

PRESETS = ("tiny", "minicpmo45")


class BudgetError(ValueError):
    """``engine.memory_budget`` that cannot work on this machine, found when the engine starts: too
    small for one session, more than the device has free, or ``auto`` finding too little free. The
    CLI reports it in one line (exit 2), as it does a ConfigError."""


ByteSize = Annotated[int, BeforeValidator(parse_bytes)]
BudgetSize = Annotated[int | Literal["auto"], BeforeValidator(parse_budget)]


# --------------------------------------------------------------------------------------------
# One model per area
# --------------------------------------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class ModelConfig(_Strict):
    """Which model shapes to build and where its weights come from."""

    preset: Literal["tiny", "minicpmo45"] = "tiny"
    # Directory with a real checkpoint (and tokenizer); None = random weights.
    checkpoint_dir: str | None = None
    # Names the weights; part of the extra key of shared anchor blocks and context-cache keys,
    # so that two different weight sets never share KV computed from each other.
    revision: str = "random-init"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = Field("cpu", pattern=r"^(cpu|meta|mps|cuda(:[0-9]+)?)$")
    # Camera frames (docs/vision.md): build the vision encoder + resampler and take frames from
    # video sessions. Off: no vision weights, the audio-only memory plan, frames refused by name.
    vision: bool = False


class WindowSettings(_Strict):
    """Anchor-protected sliding window of the Thinker KV (SPEC section 2)."""

    mode: Literal["off", "basic", "rebuild"] = "basic"
    high_tokens: int = Field(8000, gt=0)
    low_tokens: int = Field(6000, gt=0)

    @model_validator(mode="after")
    def _low_below_high(self) -> "WindowSettings":
        if self.low_tokens >= self.high_tokens:
            raise ValueError(
                f"low_tokens ({self.low_tokens}) must be below high_tokens ({self.high_tokens})"
            )
        return self


class Stage0Config(_Strict):
    """Tier A: paged Thinker/Talker KV."""

    block_size: int = Field(16, gt=0)
    window: WindowSettings = Field(default_factory=WindowSettings)
    # Share full session-context blocks read-only across sessions with the same context.
    # Default off so `duplexcache bench` can A/B it.
    shared_anchor_blocks: bool = False
    # CUDA: ragged steps of <= 32 new tokens per sequence (a unit's append, the Talker's condition
    # rows) through the in-place paged kernel, one query row per token, instead of one gather +
    # SDPA per sequence per layer. Default on (H200: 40 real-time sessions vs 8 with it off);
    # off is the A/B reference. Ignored on CPU.
    ragged_kernel: bool = True


class ContextCacheConfig(_Strict):
    """Cross-session cache of built session-context embeddings (SPEC section 2)."""

    duplex_context_caching: bool = False
    capacity: int = Field(32, gt=0)


class Code2WavConfig(_Strict):
    """Tier B: Stage 2 prompt attention sharing and the whole-Euler arena."""

    cfm_prompt_att_sharing: bool = False
    cfm_arena_rows_from_graph_grid: bool = False
    max_num_seqs: int = Field(16, gt=0)
    # Graph tiers (batch sizes captured as graphs). Overridden by DUPLEXCACHE_CFM_GRAPH_GRID.
    graph_grid: tuple[int, ...] | None = None

    @model_validator(mode="before")
    @classmethod
    def _parse_grid(cls, data: Any) -> Any:
        if isinstance(data, dict) and "graph_grid" in data:
            data = dict(data)
            data["graph_grid"] = parse_graph_grid(data["graph_grid"], "code2wav.graph_grid")
        return data

    @model_validator(mode="after")
    def _arena_switch_must_act(self) -> "Code2WavConfig":
        if self.cfm_arena_rows_from_graph_grid:
            if self.graph_grid is None:
                # A switch that would change nothing is an error, not a silent no-op.
                raise ValueError(
                    "cfm_arena_rows_from_graph_grid is true but no graph grid is set "
                    f"(code2wav.graph_grid or {GRAPH_GRID_ENV}); it would change nothing"
                )
            if max(self.graph_grid) >= self.max_num_seqs:
                logger.warning(
                    "cfm_arena_rows_from_graph_grid saves nothing: largest graph tier %d >= "
                    "max_num_seqs %d", max(self.graph_grid), self.max_num_seqs,
                )
        return self

    @property
    def arena_rows(self) -> int:
        """Rows of the whole-Euler arena: the largest graph tier when the switch is on."""
        if self.cfm_arena_rows_from_graph_grid:
            assert self.graph_grid is not None, "validated in _arena_switch_must_act"
            return min(max(self.graph_grid), self.max_num_seqs)
        return self.max_num_seqs


class PrecisionConfig(_Strict):
    """Capacity mode (issue 15): number formats below the reference's, each an A/B switch whose
    error against the reference's format is measured (scripts/probes/code2wav_precision.py, kv_precision.py).

    ``code2wav_dtype``: the Code2Wav flow (conformer + estimator), its per-stream caches and the
    whole-Euler arena. ``float32`` is the reference's (exact mode, the default); ``bfloat16``
    halves the caches' bytes and runs the estimator's matmuls on bf16 tensor cores. The vocoder
    stays float32 either way (its caches are a few KiB per stream).

    ``kv_cache_dtype``: storage of the Thinker's and the Talker's paged KV pools. ``auto`` is
    the model dtype (exact mode, the default). ``fp8_e4m3`` stores K and V as float8 e4m3 with
    one float32 scale per token and kv head, set when the token is written (appends never touch
    earlier tokens); attention dequantizes and computes in the model dtype. Per (token, kv head)
    ``head_dim + 4`` bytes each for K and V instead of ``2 * head_dim`` in bf16 (0.52x at
    head_dim 128), and admission reserves those bytes (kv/kv_quant.py).

    ``encoder_cache_dtype``: storage of each session's streaming audio-encoder K/V cache, in the
    same format (``fp8_e4m3``: e4m3 + one float32 scale per frame and head, set when the frame
    is written; the layer reads it dequantized). ``auto``: the model dtype (exact, default)."""

    code2wav_dtype: Literal["float32", "bfloat16"] = "float32"
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = "auto"
    encoder_cache_dtype: Literal["auto", "fp8_e4m3"] = "auto"


class SpeakPolicy(_Strict):
    """When sessions speak. ``model``: the Thinker decides; ``every_k_units``: forced every k
    units (deterministic load for benchmarks, since random weights decide arbitrarily): in each
    block of ``k`` units the last ``min(turn_units, k)`` speak as one turn. ``k == turn_units``
    speaks every unit; a ``k`` larger than the run keeps one turn open for the whole run.
    ``reply``: a scripted conversation driven by the input audio (runtime/policy.py
    ``ReplyPolicy``): a 10 ms frame whose RMS exceeds ``speech_rms`` is user speech; the first
    unit in which ``end_quiet_ms`` of quiet has followed the user's last speech starts a reply of
    ``reply_min_units``..``reply_max_units`` units (a deterministic function of session id and
    turn index, ``policy.reply_units``); that quiet may go on into the audio the server already
    holds after the unit."""

    mode: Literal["model", "every_k_units", "reply"] = "every_k_units"
    k: int = Field(2, gt=0)
    turn_units: int = Field(2, gt=0)
    speech_rms: float = Field(0.01, gt=0, lt=1)
    reply_min_units: int = Field(2, gt=0)
    reply_max_units: int = Field(8, gt=0)
    end_quiet_ms: int = Field(200, ge=10, le=10_000)

    @model_validator(mode="after")
    def _reply_range(self) -> "SpeakPolicy":
        if self.reply_min_units > self.reply_max_units:
            raise ValueError(f"reply_min_units ({self.reply_min_units}) must be <= reply_max_units "
                             f"({self.reply_max_units})")
        return self


class EngineConfig(_Strict):
    """Admission and ticking."""

    # "auto": 0.9 of the device memory still free after the weights and the fixed allocations
    # (runtime/memory/memory_budget.py AUTO_FREE_SHARE; on CPU a fixed 512 MiB, capped by available
    # RAM), or a byte size, refused at start-up when it exceeds what is free.
    memory_budget: BudgetSize = AUTO
    # Kept free for activations/scratch; admission only hands out memory_budget - this. With
    # activation_from_warmup on CUDA, an upper bound for the first plan only: the re-plan keeps
    # the peak the warm-up measured + 1 GiB (runtime/memory/replan.py ACTIVATION_MARGIN) instead.
    activation_reserve: ByteSize = parse_bytes("64MiB")
    tick_seconds: float = Field(1.0, gt=0)
    # Admission by time: admit while the measured per-session cost predicts a tick under
    # tick_seconds x tick_headroom (runtime/memory/admission.py TickCostModel).
    tick_headroom: float = Field(0.8, gt=0)
    # Context prefill runs in chunks of at most this many tokens per tick (all opening
    # sessions together), so a long context never stalls the other sessions' tick.
    prefill_chunk_tokens: int = Field(512, gt=0)
    speak_policy: SpeakPolicy = Field(default_factory=SpeakPolicy)
    # CUDA devices (ignored elsewhere): replay CUDA graphs instead of launching kernel by kernel,
    # for the Thinker's and the Talker's one-token decode steps (kv/decode_graphs.py), their short
    # ragged steps as one row per token (a unit's append, the Talker's condition; with
    # stage0.ragged_kernel), the streaming audio encoder's layers as piecewise graphs
    # (models/audio_encoder_graphs.py) and the vocoder (cfm/vocoder_graphs.py). Off: every step,
    # the encoder and the vocoder launched eagerly: the reference the equality checks compare
    # with. Measured (H200): tick 1089 -> 390 ms at one session with the decode graphs; the
    # Thinker stage 111.5 -> 43.9 ms and the encoder 50.7 -> 4.5 ms with the other two; the
    # vocoder ~100 ms shorter ticks at 32-40 sessions (docs/results/HISTORY.md, "The graph
    # switches on the H200"). Until 2026-12-07 four switches (decode_cuda_graphs,
    # ragged_step_graphs, encoder_cuda_graphs, code2wav.vocoder_cuda_graphs); those still load,
    # with a warning (config_loading.MERGED_SWITCHES).
    cuda_graphs: bool = True
    # A session's text and audio bits do not depend on which other sessions share its ticks:
    # every GEMM and conv runs in fixed-shape row tiles and the paged decode kernel splits a
    # sequence by its own length only (models/batch_invariant.py). Off: kernels pick their
    # reduction by the batch's shape, so a session alone and beside others can differ in the
    # last bits (and then in tokens). The sharing switches stay bit-exact either way. Off by
    # default, as measured: the tiny CPU tick ~5x slower; on an H100 at 32 minicpmo45 sessions
    # 528 -> 1708 ms per tick, bit-equal alone and beside 1, 7 and 31 others
    # (docs/benchmarks.md, "Batch invariance" and "Batch invariance on the GPU").
    batch_invariant: bool = False
    # Most Talker KV tokens one audio turn may hold; None = the Talker's max_position_embeddings
    # (4096 for minicpmo45, ~150 s of speech). Admission reserves this many tokens' blocks per
    # live session (as a count: blocks are taken as tokens arrive), so it bounds the pool. A
    # unit that would pass it closes the audio turn and starts a new one with an empty Talker KV
    # while the Thinker's turn goes on (the path taken at the model's limit), so replies shorter
    # than the cap are bit-identical; at least one unit's worst case (runtime/stages/talker_stage.py).
    # A speak policy that bounds a turn (every_k_units with turn_units < k, reply) reserves and caps
    # its longest turn instead when that is smaller (runtime/memory/session_sizing.py
    # reserved_turn_tokens, docs/engine.md "Talker turns").
    talker_turn_tokens: int | None = Field(None, gt=0)
    # Voices made from clients' reference recordings (runtime/reference_voices.py) held at once:
    # each costs a Code2Wav prompt state and a prompt pass when first seen; sessions sending the
    # same recording share it. 0: clients may only name the server's voices.
    max_reference_voices: int = Field(8, ge=0)
    # Size the activation reserve from the device memory the warm-up measured (its peak above the
    # pools, graph pools included) plus a 1 GiB margin (runtime/memory/replan.py ACTIVATION_MARGIN),
    # and an auto budget from what is free then less memory_headroom: the engine plans, warms up,
    # re-plans once and warms up again (runtime/memory/replan.py replan_after_warmup). CUDA only;
    # elsewhere activation_reserve as written.
    activation_from_warmup: bool = False
    # What an auto budget re-planned after the warm-up leaves free on the device: the CUDA
    # context's lazy growth, cuBLAS/cuDNN workspaces, Triton and NCCL (replaces the first plan's
    # 10 % of free when activation_from_warmup is on).
    memory_headroom: ByteSize = parse_bytes("1GiB")

    @model_validator(mode="after")
    def _reserve_fits(self) -> "EngineConfig":
        # An "auto" budget is checked against the reserve when it is resolved at start-up.
        if self.memory_budget != AUTO and self.activation_reserve >= self.memory_budget:
            raise ValueError(
                f"activation_reserve ({format_bytes(self.activation_reserve)}) must be below "
                f"memory_budget ({format_bytes(self.memory_budget)})"
            )
        return self


# Characters of session text (instructions, initial_user_text) allowed per context token before
# the text is tokenized: a text longer than this many per token of server.max_context_tokens is
# refused on its length alone. A BPE token of ordinary text averages about 4 characters of
# English and fewer of most other languages, so text that could fit the context passes and a
# multi-megabyte string is never tokenized only to be refused.
TEXT_CHARS_PER_CONTEXT_TOKEN = 4

# OpenAI's Realtime voices (openai.types.realtime), which stock clients ask for.
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar")


class ServerConfig(_Strict):
    """The realtime WebSocket server: where it listens, who may connect, and per-client limits."""

    host: str = "127.0.0.1"  # loopback unless the deployment says otherwise
    port: int = Field(8000, ge=0, le=65535)
    max_frame_bytes: ByteSize = parse_bytes("4MiB")
    # Clients must present this key (Authorization: Bearer, or the openai-insecure-api-key.<key>
    # WebSocket subprotocol); None = no authentication. Env DUPLEXCACHE_API_KEY overrides.
    api_key: str | None = Field(None, min_length=1)
    # Browser Origins accepted besides the server's own (same host:port); ["*"] accepts any.
    allowed_origins: list[str] = Field(default_factory=list)
    idle_timeout_s: float = Field(120.0, ge=0)        # no input audio for this long ends a session; 0 = off
    max_session_s: float = Field(3600.0, ge=0)        # longest a connection may stay open; 0 = off
    # Encoded events queued for one client before it is dropped as too slow (besides 1024 events):
    # a client that stops reading holds at most this much of the server's memory.
    max_outbox_bytes: ByteSize = parse_bytes("8MiB")
    # A close that cannot be written this long (the client does not read) is abandoned: the
    # transport is aborted. The engine session is released before, when the close is decided.
    close_timeout_s: float = Field(5.0, gt=0)
    # An HTTP request (a WebSocket handshake too) whose headers have not all arrived this long after
    # the connection opened is dropped; uvicorn has no such timeout of its own.
    header_timeout_s: float = Field(10.0, gt=0)
    # Addresses (or CIDR networks) of reverse proxies whose X-Forwarded-For / X-Forwarded-Proto are
    # believed: the per-address caps then count the client they name. Empty: no proxy is trusted and
    # the caps count the TCP peer (uvicorn's own default trusts 127.0.0.1, so any local process could
    # name itself a new address per connection).
    trusted_proxies: list[str] = Field(default_factory=list)
    max_connections_per_client: int = Field(16, ge=1)  # open WebSockets per client address
    max_sessions_per_client: int = Field(8, ge=1)      # engine sessions (admitted or queued) per client address
    # Longest session context (instructions + reference audio + initial text, in tokens) that
    # open_session accepts; longer ones are refused with context_length_exceeded. It also bounds
    # the text a session.update may set: max_session_text_chars below.
    max_context_tokens: int = Field(8192, gt=0)
    # torch's CPU threads while the server runs. "auto": with the model on the CPU, one fewer than
    # the CPUs this process may use (at least 1), so the event loop keeps a core (on 2 cores, two
    # compute threads and the event loop oversubscribe them, and every parallel region waits for a
    # preempted thread); on CUDA, or with OMP_NUM_THREADS set (Ray sets it per replica), torch's
    # own count. An int sets it.
    compute_threads: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    # Voice names clients may ask for, mapped to this server's voices. Stock Realtime clients ask
    # for OpenAI's voices (LiveKit's default is "marin"), and a name the server does not have is
    # refused at session.update (GET /v1/voices lists the server's own), so by default OpenAI's
    # names map to "default", which every engine has. Checked against the engine's voices when
    # the server starts; {} refuses them.
    voice_aliases: dict[str, str] = Field(default_factory=lambda: {name: "default" for name in OPENAI_VOICES})
    # A session whose client's network dropped (no close frame) is parked this long: it keeps its
    # engine session and admission, hears silence, keeps what it sends (bounded by
    # max_outbox_bytes), and a new connection with its resume token takes it back
    # (server/resume.py, docs/protocol.md "Resume"). 0 = off: a dropped connection ends the session.
    resume_window_s: float = Field(30.0, ge=0, le=3600)

    @property
    def max_session_text_chars(self) -> int:
        """Longest instructions / initial_user_text (characters, each) a session.update may set:
        ``TEXT_CHARS_PER_CONTEXT_TOKEN`` per token of ``max_context_tokens`` (65536 at minicpmo45's
        16384). Longer is refused there, before any tokenizing (a cap on work, not the context
        limit, which the open checks in tokens). The deploy key server.max_session_text_chars
        until issue 44."""
        return TEXT_CHARS_PER_CONTEXT_TOKEN * self.max_context_tokens

    @model_validator(mode="after")
    def _trusted_proxies_are_addresses(self) -> "ServerConfig":
        for entry in self.trusted_proxies:
            if entry != "*":
                try:
                    ipaddress.ip_network(entry, strict=False)
                except ValueError:
                    raise ValueError(f"server.trusted_proxies: {entry!r} is not an IP address or CIDR network "
                                     "('*' trusts every peer)") from None
        return self


class SchedulerConfig(_Strict):
    """Pacing: which sessions run in which tick, and when (runtime/scheduler/core.py, docs/engine.md
    "Pacing"). The server keeps the clock with these; the engine's scheduler is set from them.
    Until 2026-12-07 these keys lived under ``server``; that spelling is still read, with a
    deprecation warning (``DeployConfig._moved_scheduler_keys``)."""

    # Each tick takes one unit per session, so a tick that runs over its period leaves every
    # session that much further behind, for good: the next on-time ticks take one unit per
    # second again. With catch-up, a session holding a whole unit more than the next tick
    # takes gets one extra tick before the next deadline (at most one per period).
    catch_up_ticks: bool = True
    # Prefill chunks of opening sessions run in the time left before the next tick, when their
    # measured time fits (runtime/scheduler/pacing.py), instead of inside the tick of every live session;
    # a tick with no chunk run before it still runs one itself.
    prefill_between_ticks: bool = True
    # Cut each session's units so that they end a fixed lead (its largest audio chunk plus 50 ms,
    # runtime/scheduler/core.py UNIT_ALIGN_MARGIN_MS) before a tick, by starting its first unit
    # with silence; off, units are cut from the stream's first sample and wait a random part of a
    # period for their tick, which every reply waits too (runtime/scheduler/core.py UnitAlignment).
    align_units_to_ticks: bool = True
    # Ticks per unit (engine.tick_seconds): with 2, the server ticks every half unit. Every
    # session's units stay on the unit tick (the grid's first phase); a session whose caller's
    # turn has ended (the speak policy's would_answer) gets its unit closed with silence at the
    # next tick between instead of waiting for the rest of it, while the measured cost leaves time
    # before the next unit tick, and is aligned to the unit tick again with silence
    # (runtime/scheduler/core.py EarlyClose; docs/engine.md, "Units on the unit tick"). 1: one
    # tick per unit. More than 1 needs align_units_to_ticks. 2 is the default since the graph
    # switches made a tick between cheap: 32 callers on an H100 answered at p99 1.16-1.35 s
    # against 1.72 s with one phase (docs/benchmarks.md, "Two phases by default").
    tick_phases: Literal[1, 2, 4] = 2
    # A session whose client sends nothing (push-to-talk between turns; a manual-turn client that
    # commits, asks for a reply and waits) would get no more units, so no reply. Once it has sent
    # nothing for this long beyond its largest chunk, its units are completed with silence until it
    # sends again (runtime/engine_session.py SilenceFill). None: wait for the client's audio.
    fill_silence_after_ms: float | None = Field(500.0, ge=0, le=60_000)

    @model_validator(mode="after")
    def _phases_need_alignment(self) -> "SchedulerConfig":
        if self.tick_phases > 1 and not self.align_units_to_ticks:
            raise ValueError(f"scheduler.tick_phases {self.tick_phases} keeps units on the unit tick by aligning "
                             "them: it needs scheduler.align_units_to_ticks (or tick_phases 1)")
        return self


# The scheduler's keys, read from ``server`` too until the release after 2026-12-07.
SCHEDULER_KEYS = tuple(SchedulerConfig.model_fields)
class ClusterConfig(_Strict):
    """Replicas on Ray Serve (``duplexcache serve --replicas N``, cluster/); ignored by one-engine serve."""

    replicas: int = Field(1, ge=1)                  # engines, one per GPU on CUDA
    # Replicas may grow to this many on live-session utilisation (None: a fixed count).
    max_replicas: int | None = Field(None, ge=1)
    target_utilisation: float = Field(0.75, gt=0, le=1)   # live / admissible sessions the autoscaler aims at
    # A replica being scaled down or redeployed takes no new sessions; its live ones may go on
    # for this long, then are closed with 1001 (going away).
    drain_timeout_s: float = Field(300.0, ge=0)


# Preset-specific values that differ from the field defaults above (the YAML files say the same).
_PRESET_OVERRIDES: dict[str, dict[str, Any]] = {
    "tiny": {"model": {"preset": "tiny"}},
    "minicpmo45": {
        "model": {"preset": "minicpmo45", "dtype": "bfloat16", "device": "cuda"},
        "code2wav": {"max_num_seqs": 32},
        "engine": {"activation_reserve": "8GiB", "prefill_chunk_tokens": 1024, "activation_from_warmup": True},
        "server": {"max_context_tokens": 16384},
    },
}


class DeployConfig(_Strict):
    """Everything one deployment is configured with; loaded from one YAML file."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    stage0: Stage0Config = Field(default_factory=Stage0Config)
    context_cache: ContextCacheConfig = Field(default_factory=ContextCacheConfig)
    code2wav: Code2WavConfig = Field(default_factory=Code2WavConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @model_validator(mode="before")
    @classmethod
    def _old_spellings(cls, data: Any) -> Any:
        """Retired keys dropped, merged switches read as their one switch and ``server.<key>`` of a
        scheduler key read as ``scheduler.<key>`` (moved 2026-12-07), each with a deprecation
        warning (config_loading.py)."""
        if not isinstance(data, Mapping):
            return data
        return move_keys(merge_switches(drop_retired_keys(data)), "server", "scheduler", SCHEDULER_KEYS)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> "DeployConfig":
        """Validate a raw dict after applying environment overrides; errors name the key path."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"deploy config must be a mapping at the top level, got {type(raw).__name__}")
        data = apply_env_overrides(raw, os.environ if environ is None else environ)
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(exc, cls)) from None
        except ValueError as exc:  # e.g. a bad graph grid parsed in a "before" validator
            raise ConfigError(str(exc)) from None

    @classmethod
    def from_yaml(cls, path: str | Path, environ: Mapping[str, str] | None = None) -> "DeployConfig":
        text = Path(path).read_text()
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        try:
            return cls.from_dict(raw or {}, environ)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    @classmethod
    def default(cls, preset: str = "tiny", environ: Mapping[str, str] | None = None) -> "DeployConfig":
        """The built-in defaults of a preset (what ``configs/<preset>.yaml`` writes out)."""
        if preset not in _PRESET_OVERRIDES:
            raise ConfigError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
        return cls.from_dict(copy.deepcopy(_PRESET_OVERRIDES[preset]), environ)

    @classmethod
    def from_packaged_yaml(cls, preset: str, environ: Mapping[str, str] | None = None) -> "DeployConfig":
        """Load ``duplexcache/configs/<preset>.yaml`` shipped with the package."""
        return cls.from_yaml(packaged_config_path(preset), environ)

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-able dict; ``DeployConfig.from_dict(c.to_dict()) == c``."""
        data = self.model_dump(mode="json")
        for key in ("memory_budget", "activation_reserve", "memory_headroom"):
            if data["engine"][key] != AUTO:
                data["engine"][key] = format_bytes(data["engine"][key])
        data["server"]["max_frame_bytes"] = format_bytes(data["server"]["max_frame_bytes"])
        if data["code2wav"]["graph_grid"] is not None:
            data["code2wav"]["graph_grid"] = list(data["code2wav"]["graph_grid"])
        return data

    def to_yaml(self, include_secrets: bool = False) -> str:
        """The config as YAML. ``server.api_key`` is written as null unless ``include_secrets``:
        the tools that write configs (scripts/gpu_bench.sh, the benchmarks) put them next to their
        results, which get committed, and a key set by DUPLEXCACHE_API_KEY comes back from the
        environment when the file is loaded."""
        data = self.to_dict()
        if not include_secrets:
            data["server"]["api_key"] = None
        return yaml.safe_dump(data, sort_keys=False)


def packaged_config_path(preset: str) -> Path:
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    return Path(str(resources.files("duplexcache") / "configs" / f"{preset}.yaml"))


# The per-session half moved to duplexcache/runtime_config.py (2026-12-07); these names are still
# found here, loaded on first use (runtime_config imports this module).
_MOVED_TO_RUNTIME_CONFIG = frozenset({
    "PrivateConfigKeyError", "SessionConfigError", "PRIVATE_RUNTIME_CONFIG_KEYS", "CLIENT_SESSION_KEYS",
    "CLIENT_WINDOW_KEYS", "INPUT_AUDIO_FORMATS", "SessionRuntimeConfig", "find_private_key", "build_runtime_config",
})


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_RUNTIME_CONFIG:
        from duplexcache import runtime_config

        return getattr(runtime_config, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
