"""Cross-session context cache (SPEC section 2, switch ``duplex_context_caching``).

Many sessions open with the same system instructions and the same reference voice. Building
their session context means embedding the text tokens and running the reference audio through
the audio encoder; with the cache on, the second and later sessions reuse the first one's
result.

* Key: sha256 over (instructions, has_ref_audio, initial_user_text, sha256 of the reference
  audio's float32 PCM bytes) -- see :func:`context_key`.
* Eviction: LRU over an ``OrderedDict``; a hit calls ``move_to_end``, an insert past
  ``capacity`` pops the least recently used entry.
* The entry records which encoder path produced the audio embeddings, as reported by the
  encoder itself (never re-derived here). When it was the streaming path, the entry also holds
  the encoder's record of its side effects on the session's encoder state, and a hit replays
  them on the new session's state (the builder does that, see ``context/builder.py``).

Not thread-safe: the engine builds contexts from its single tick thread.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

logger = logging.getLogger(__name__)


class EncoderPath(str, enum.Enum):
    """How the reference audio was encoded."""

    WHOLE_CLIP = "whole_clip"  # one offline pass; touches no per-session state
    STREAMING = "streaming"    # the session's streaming encoder; advances its state


# Replays an encoder's streaming side effects on another session's encoder state.
StreamingSideEffects = Callable[[Any], None]


def context_key(
    instructions: str,
    has_ref_audio: bool,
    initial_user_text: str | None,
    ref_audio_sha256: str | None,
) -> bytes:
    """sha256 digest naming one session context.

    The fields are serialized as a JSON list, so field boundaries are unambiguous and
    ``initial_user_text=None`` differs from ``""``.
    """
    if has_ref_audio != (ref_audio_sha256 is not None):
        raise ValueError("ref_audio_sha256 must be given exactly when has_ref_audio is true")
    payload = json.dumps(
        ["duplexcache.context.v1", instructions, bool(has_ref_audio), initial_user_text, ref_audio_sha256],
        ensure_ascii=False,
    )
    return hashlib.sha256(payload.encode("utf-8")).digest()


@dataclass(frozen=True)
class ContextCacheEntry:
    """A built session context, shared read-only by every session that hits it."""

    token_ids: torch.Tensor        # (T,) int64, filler id at audio positions
    inputs_embeds: torch.Tensor    # (T, H); callers must not write into it
    prefix_token_count: int
    audio_embedding_count: int
    suffix_token_count: int
    encoder_path: EncoderPath | None           # None without reference audio
    streaming_side_effects: StreamingSideEffects | None  # set iff encoder_path is STREAMING

    def __post_init__(self) -> None:
        streaming = self.encoder_path is EncoderPath.STREAMING
        assert streaming == (self.streaming_side_effects is not None), (
            "a streaming entry needs its side-effect record, and only a streaming entry has one")


@dataclass(frozen=True)
class ContextCacheStats:
    hits: int
    misses: int
    evictions: int
    size: int
    capacity: int
    nbytes: int  # tensor bytes held by the entries (embeddings + token ids)


class ContextCache:
    """LRU map from :func:`context_key` digests to :class:`ContextCacheEntry`."""

    def __init__(self, capacity: int = 32):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
            raise ValueError(f"context cache capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity
        # Oldest (least recently used) first.
        self._entries: OrderedDict[bytes, ContextCacheEntry] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, key: bytes) -> ContextCacheEntry | None:
        """Look up ``key``; a hit becomes the most recently used entry."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: bytes, entry: ContextCacheEntry) -> None:
        """Insert (or refresh) ``key``; evicts the least recently used entry past capacity."""
        if key in self._entries:
            self._entries.move_to_end(key)
        self._entries[key] = entry
        while len(self._entries) > self.capacity:
            old_key, _ = self._entries.popitem(last=False)
            self.evictions += 1
            logger.debug("context cache evicted %s", old_key.hex()[:12])

    def __contains__(self, key: object) -> bool:
        # Membership does not count as use: it neither reorders nor counts a hit.
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> Iterator[bytes]:
        """Keys from least to most recently used."""
        return iter(list(self._entries))

    def clear(self) -> None:
        self._entries.clear()

    def nbytes(self) -> int:
        return sum(e.inputs_embeds.nbytes + e.token_ids.nbytes for e in self._entries.values())

    def stats(self) -> ContextCacheStats:
        return ContextCacheStats(self.hits, self.misses, self.evictions, len(self._entries), self.capacity,
                                 self.nbytes())


def make_context_cache(duplex_context_caching: bool, capacity: int) -> ContextCache | None:
    """The cache a deployment runs with: None when ``duplex_context_caching`` is off, so the
    builder never consults one. Takes plain values (``cfg.context_cache.*`` from the deploy
    config, or the same fields of a SessionRuntimeConfig)."""
    if not duplex_context_caching:
        return None
    logger.info("cross-session context cache on (capacity %d)", capacity)
    return ContextCache(capacity)
