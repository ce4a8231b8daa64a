"""Builds a session's context (the Stage 0 anchor) in MiniCPM-o 4.5's layout.

With reference audio (the voice to clone), ``R`` = 10 embeddings per second of it::

    prefix                                                 audio            suffix
    <|im_start|> "system\\n{instructions}\\n" <|audio_start|> e_0 .. e_{R-1}  <|audio_end|> <|im_end|>  [user turn]

Without reference audio the ``"\\n" <|audio_start|>`` / ``<|audio_end|>`` pair is left out
(the newline belongs to the audio segment, so the system turn stays balanced)::

    <|im_start|> "system\\n{instructions}"  <|im_end|>  [user turn]

The optional user turn, counted in the suffix::

    "\\n" <|im_start|> "user\\n{initial_user_text}" <|im_end|> "\\n" <|im_start|> "assistant\\n"

``token_ids`` carries the filler id ``<|audio|>`` at the R audio positions; the embeddings
behind them differ per voice, so Stage 0 shared anchor blocks use :attr:`SessionContext.extra_key`
(sha256 of the context key and model revision) next to the ids.

With a :class:`ContextCache` (``duplex_context_caching`` on) a hit skips the token embedding and
the reference-audio encode; when the recorded encode took the streaming path, the encoder's
recorded side effects are replayed on the new session's encoder state. With no cache
(the default) nothing is looked up.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from duplexcache.config import DeployConfig
from duplexcache.context.context_cache import (
    ContextCache,
    ContextCacheEntry,
    EncoderPath,
    StreamingSideEffects,
    context_key,
    make_context_cache,
)
from duplexcache.context.tokenizer import AUDIO_FILLER_TOKEN, Tokenizer

logger = logging.getLogger(__name__)

REF_AUDIO_SAMPLE_RATE = 16_000
# One audio embedding covers 100 ms; less than that yields no embedding at all.
MIN_REF_AUDIO_SAMPLES = REF_AUDIO_SAMPLE_RATE // 10
# The Whisper-shaped encoder sees at most 30 s (1500 frames) before its cache resets.
MAX_REF_AUDIO_SECONDS = 30.0


class ReferenceAudioError(ValueError):
    """Reference audio that cannot be used (empty, too short/long, wrong rate, not PCM)."""


@dataclass(frozen=True)
class EmbeddingResult:
    """What a reference-audio encoder returns: the embeddings and the path it actually took.

    ``streaming_side_effects`` is the encoder's own record of what the encode did to the
    session's encoder state; it is required for the streaming path and must be None for the
    whole-clip path (which touches no per-session state).
    """

    embeddings: torch.Tensor  # (R, H)
    path: EncoderPath
    streaming_side_effects: StreamingSideEffects | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, EncoderPath):
            raise ValueError(f"EmbeddingResult.path must be an EncoderPath, got {self.path!r}")
        if (self.path is EncoderPath.STREAMING) != (self.streaming_side_effects is not None):
            raise ValueError(
                "EmbeddingResult: the streaming path must report its streaming_side_effects "
                "and the whole-clip path must report none"
            )


# encode_reference_audio(audio (S,) float32 16 kHz, encoder_state) -> EmbeddingResult
EncodeReferenceAudio = Callable[[torch.Tensor, Any], EmbeddingResult]
# embed_tokens(ids (n,) int64) -> (n, H)
EmbedTokens = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SessionContext:
    """A session's context: token ids, the embeddings to prefill, and its segment lengths."""

    token_ids: torch.Tensor      # (T,) int64; audio positions hold the filler id
    inputs_embeds: torch.Tensor  # (T, H); shared with the cache on a hit: read-only
    prefix_token_count: int
    audio_embedding_count: int
    suffix_token_count: int      # includes the optional user turn
    total: int                   # anchor length T
    context_key: bytes           # sha256 over the context fields (the cache key)
    extra_key: bytes             # sha256(context_key + model revision): extra key of anchor blocks
    cache_hit: bool
    encoder_path: EncoderPath | None  # None without reference audio


class _Special(str):
    """A special-token spelling inside a segment list (looked up by id, never BPE-encoded)."""


def _layout(instructions: str, has_ref_audio: bool, initial_user_text: str | None):
    """(prefix parts, suffix parts) of the context; audio goes between them."""
    prefix: list[str] = [_Special("<|im_start|>"), f"system\n{instructions}"]
    suffix: list[str] = [_Special("<|im_end|>")]
    if has_ref_audio:
        prefix += ["\n", _Special("<|audio_start|>")]
        suffix = [_Special("<|audio_end|>")] + suffix
    if initial_user_text is not None:
        suffix += ["\n", _Special("<|im_start|>"), f"user\n{initial_user_text}", _Special("<|im_end|>"),
                   "\n", _Special("<|im_start|>"), "assistant\n"]
    return prefix, suffix


def _encode_parts(tokenizer: Tokenizer, parts: Sequence[str]) -> list[int]:
    ids: list[int] = []
    for part in parts:
        if isinstance(part, _Special):
            ids.append(tokenizer.token_id(part))
        else:
            ids.extend(tokenizer.encode(part))
    return ids


def validate_reference_audio(ref_audio: Any, sample_rate: int = REF_AUDIO_SAMPLE_RATE) -> torch.Tensor:
    """Check reference audio and return it as a contiguous float32 (S,) CPU tensor.

    Expects float32 mono PCM in [-1, 1] at 16 kHz, between 0.1 s and 30 s long.
    """
    if isinstance(ref_audio, np.ndarray):
        ref_audio = torch.from_numpy(ref_audio)
    if not isinstance(ref_audio, torch.Tensor):
        raise ReferenceAudioError(
            f"reference audio must be a float32 mono PCM tensor or array, got {type(ref_audio).__name__}")
    if sample_rate != REF_AUDIO_SAMPLE_RATE:
        raise ReferenceAudioError(
            f"reference audio must be {REF_AUDIO_SAMPLE_RATE} Hz, got {sample_rate} Hz (resample it first)")
    if ref_audio.dtype != torch.float32:
        raise ReferenceAudioError(
            f"reference audio must be float32 PCM in [-1, 1], got dtype {ref_audio.dtype} "
            "(convert pcm16 with x / 32768)")
    if ref_audio.dim() != 1:
        raise ReferenceAudioError(f"reference audio must be mono with shape (samples,), got {tuple(ref_audio.shape)}")
    num = ref_audio.numel()
    if num == 0:
        raise ReferenceAudioError("reference audio is empty")
    if num < MIN_REF_AUDIO_SAMPLES:
        raise ReferenceAudioError(
            f"reference audio is too short: {num} samples ({num / REF_AUDIO_SAMPLE_RATE * 1000:.0f} ms); "
            f"at least {MIN_REF_AUDIO_SAMPLES} samples (100 ms) are needed for one embedding")
    if num > MAX_REF_AUDIO_SECONDS * REF_AUDIO_SAMPLE_RATE:
        raise ReferenceAudioError(
            f"reference audio is too long: {num / REF_AUDIO_SAMPLE_RATE:.1f} s (at most {MAX_REF_AUDIO_SECONDS:.0f} s)")
    audio = ref_audio.detach().to("cpu").contiguous()
    if not bool(torch.isfinite(audio).all()):
        raise ReferenceAudioError("reference audio contains NaN or infinite samples")
    peak = float(audio.abs().max())
    if peak > 1.0:
        raise ReferenceAudioError(
            f"reference audio is not normalized PCM: peak {peak:.3g} > 1.0 (pcm16 samples cast to float?)")
    return audio


def audio_sha256(audio: torch.Tensor) -> str:
    """sha256 hex of the float32 little-endian PCM bytes."""
    data = audio.detach().to("cpu").contiguous().numpy().astype("<f4", copy=False).tobytes()
    return hashlib.sha256(data).hexdigest()


def anchor_extra_key(key: bytes, model_revision: str) -> bytes:
    """Extra key of Stage 0 shared anchor blocks: names the embeddings behind filler ids."""
    return hashlib.sha256(b"duplexcache.anchor.v1\0" + key + b"\0" + model_revision.encode("utf-8")).digest()


def _check_embeddings(name: str, emb: Any, rows: int | None, hidden: int | None) -> torch.Tensor:
    if not isinstance(emb, torch.Tensor) or emb.dim() != 2:
        shape = tuple(emb.shape) if isinstance(emb, torch.Tensor) else type(emb).__name__
        raise ValueError(f"{name} must return a (rows, hidden) tensor, got {shape}")
    if rows is not None and emb.shape[0] != rows:
        raise ValueError(f"{name} returned {emb.shape[0]} rows, expected {rows}")
    if hidden is not None and emb.shape[1] != hidden:
        raise ValueError(f"{name} returned hidden size {emb.shape[1]}, expected {hidden}")
    return emb


def _encode_audio(encode_reference_audio: EncodeReferenceAudio, audio: torch.Tensor, encoder_state: Any,
                  text_embeds: torch.Tensor) -> EmbeddingResult:
    result = encode_reference_audio(audio, encoder_state)
    if not isinstance(result, EmbeddingResult):
        raise ValueError(
            f"encode_reference_audio must return an EmbeddingResult, got {type(result).__name__}")
    emb = _check_embeddings("encode_reference_audio", result.embeddings, None, text_embeds.shape[1])
    if emb.shape[0] == 0:
        raise ValueError("encode_reference_audio returned no embeddings")
    if emb.dtype != text_embeds.dtype or emb.device != text_embeds.device:
        raise ValueError(
            f"reference-audio embeddings are {emb.dtype} on {emb.device}, "
            f"token embeddings {text_embeds.dtype} on {text_embeds.device}")
    return result


@torch.no_grad()  # cached embeddings must not hold an autograd graph alive
def _build_entry(tokenizer: Tokenizer, embed_tokens: EmbedTokens, encode_reference_audio: EncodeReferenceAudio,
                 instructions: str, audio: torch.Tensor | None, initial_user_text: str | None,
                 encoder_state: Any) -> ContextCacheEntry:
    """The uncached path: tokenize, embed the text, encode the reference audio, concatenate."""
    prefix_parts, suffix_parts = _layout(instructions, audio is not None, initial_user_text)
    prefix_ids = _encode_parts(tokenizer, prefix_parts)
    suffix_ids = _encode_parts(tokenizer, suffix_parts)
    text_ids = torch.tensor(prefix_ids + suffix_ids, dtype=torch.long)
    # One embedding call for all text tokens; the filler id is never looked up.
    text_embeds = _check_embeddings("embed_tokens", embed_tokens(text_ids), len(text_ids), None)
    prefix_emb, suffix_emb = text_embeds[: len(prefix_ids)], text_embeds[len(prefix_ids):]
    path, side_effects, parts = None, None, [prefix_emb]
    num_audio = 0
    if audio is not None:
        result = _encode_audio(encode_reference_audio, audio, encoder_state, text_embeds)
        path, side_effects = result.path, result.streaming_side_effects
        num_audio = result.embeddings.shape[0]
        parts.append(result.embeddings)
    parts.append(suffix_emb)
    filler = tokenizer.token_id(AUDIO_FILLER_TOKEN)
    token_ids = torch.tensor(prefix_ids + [filler] * num_audio + suffix_ids, dtype=torch.long)
    return ContextCacheEntry(
        token_ids=token_ids,
        inputs_embeds=torch.cat(parts, dim=0),  # (T, H)
        prefix_token_count=len(prefix_ids),
        audio_embedding_count=num_audio,
        suffix_token_count=len(suffix_ids),
        encoder_path=path,
        streaming_side_effects=side_effects,
    )


def build_session_context(
    tokenizer: Tokenizer,
    embed_tokens: EmbedTokens,
    encode_reference_audio: EncodeReferenceAudio,
    instructions: str,
    ref_audio: torch.Tensor | np.ndarray | None,
    initial_user_text: str | None = None,
    *,
    encoder_state: Any = None,
    cache: ContextCache | None = None,
    model_revision: str = "",
    sample_rate: int = REF_AUDIO_SAMPLE_RATE,
) -> SessionContext:
    """Build (or fetch from ``cache``) the session context; see the module docstring.

    Bad input raises before anything is cached, so a failed build leaves no entry behind.
    """
    if not isinstance(instructions, str):
        raise ValueError(f"instructions must be a str, got {type(instructions).__name__}")
    if initial_user_text is not None and not isinstance(initial_user_text, str):
        raise ValueError(f"initial_user_text must be a str or None, got {type(initial_user_text).__name__}")
    audio = None if ref_audio is None else validate_reference_audio(ref_audio, sample_rate)
    key = context_key(instructions, audio is not None, initial_user_text,
                      None if audio is None else audio_sha256(audio))

    entry = cache.get(key) if cache is not None else None
    hit = entry is not None
    if cache is not None:
        logger.debug("context cache %s for %s", "hit" if hit else "miss", key.hex()[:12])
    if entry is not None:
        if entry.encoder_path is EncoderPath.STREAMING:
            # The skipped encode would have advanced this session's streaming encoder state.
            assert entry.streaming_side_effects is not None, "checked by ContextCacheEntry"
            entry.streaming_side_effects(encoder_state)
    else:
        entry = _build_entry(tokenizer, embed_tokens, encode_reference_audio, instructions, audio,
                             initial_user_text, encoder_state)
        if cache is not None:
            cache.put(key, entry)

    total = entry.prefix_token_count + entry.audio_embedding_count + entry.suffix_token_count
    assert entry.token_ids.shape[0] == total == entry.inputs_embeds.shape[0], "context length mismatch"
    return SessionContext(
        token_ids=entry.token_ids,
        inputs_embeds=entry.inputs_embeds,
        prefix_token_count=entry.prefix_token_count,
        audio_embedding_count=entry.audio_embedding_count,
        suffix_token_count=entry.suffix_token_count,
        total=total,
        context_key=key,
        extra_key=anchor_extra_key(key, model_revision),
        cache_hit=hit,
        encoder_path=entry.encoder_path,
    )


class SessionContextBuilder:
    """Owns what every session's context is built with: one per model, shared by sessions.

    ``cache`` is None unless ``duplex_context_caching`` is on (see :meth:`from_config`).
    """

    def __init__(self, tokenizer: Tokenizer, embed_tokens: EmbedTokens,
                 encode_reference_audio: EncodeReferenceAudio, *, model_revision: str,
                 cache: ContextCache | None = None):
        self.tokenizer = tokenizer
        self.embed_tokens = embed_tokens
        self.encode_reference_audio = encode_reference_audio
        self.model_revision = model_revision
        self.cache = cache

    @classmethod
    def from_config(cls, deploy: DeployConfig, tokenizer: Tokenizer, embed_tokens: EmbedTokens,
                    encode_reference_audio: EncodeReferenceAudio) -> "SessionContextBuilder":
        """Cache iff ``context_cache.duplex_context_caching``; revision from ``model.revision``."""
        cache = make_context_cache(deploy.context_cache.duplex_context_caching, deploy.context_cache.capacity)
        return cls(tokenizer, embed_tokens, encode_reference_audio,
                   model_revision=deploy.model.revision, cache=cache)

    def build(self, instructions: str, ref_audio: torch.Tensor | np.ndarray | None,
              initial_user_text: str | None = None, *, encoder_state: Any = None,
              sample_rate: int = REF_AUDIO_SAMPLE_RATE) -> SessionContext:
        return build_session_context(
            self.tokenizer, self.embed_tokens, self.encode_reference_audio, instructions, ref_audio,
            initial_user_text, encoder_state=encoder_state, cache=self.cache,
            model_revision=self.model_revision, sample_rate=sample_rate)
