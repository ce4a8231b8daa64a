"""Voices made from a client's reference recording, one per distinct recording, shared.

A client may bring its own voice as a recording (16 kHz float32 mono) instead of naming one of
the server's voices. :meth:`ReferenceVoices.add` turns it into an ordinary named voice,
``ref-<sha256 prefix>``, so everything below treats it like any other:

* the Thinker context holds the recording's audio-encoder embeddings between
  ``<|audio_start|>`` and ``<|audio_end|>`` (the reference-audio path of context/builder.py); the
  context cache and the shared anchor blocks key it by the recording's sha256, so sessions that
  send the same recording share one context;
* Code2Wav registers the voice under its name; since its prompt inputs are the base voice's
  (below), ``BatchedCode2Wav.register_voice`` finds them equal and shares the base voice's prompt
  state and prompt-bank frames: no setup pass, no bytes, and no growth of the bank, which would
  drop every Code2Wav graph captured at warm-up (measured on an H100, 2026-12-07: each re-capture
  took 1-1.5 s inside a tick, 22 late ticks).

The Code2Wav prompt itself (speech tokens, prompt mel, speaker embedding) is the base voice's:
turning a recording into a speech prompt needs a speech tokenizer and a speaker encoder, which
the engine does not have. So the reply's timbre is the base voice's; what the recording changes
is the Thinker's context (docs/protocol.md says so).

Recordings are few and their state lives as long as it is used: at most ``limit`` at a time
(``engine.max_reference_voices``); a new one evicts the least recently used voice that no
session holds and that was not handed out within ``grace_s`` (a session between being given the
name and opening with it), and is refused when none can go.

Nothing here knows which wire protocol a client speaks.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Iterable

import numpy as np
import torch

from duplexcache.context.builder import ReferenceAudioError, audio_sha256, validate_reference_audio
from duplexcache.runtime.voices import Voice

logger = logging.getLogger(__name__)

PREFIX = "ref-"
GRACE_S = 60.0


class ReferenceVoicesFull(ReferenceAudioError):
    """Every reference-voice slot is held by a session (``engine.max_reference_voices``)."""

    code = "reference_voices_full"


class ReferenceVoices:
    """The reference voices of one engine; thread-safe (called from the server's worker threads)."""

    def __init__(self, limit: int, base: Voice, register: Callable[[Voice], None],
                 unregister: Callable[[str], None], in_use: Callable[[], Iterable[str]],
                 clock: Callable[[], float] = time.monotonic, grace_s: float = GRACE_S) -> None:
        self.limit = limit
        self.base = base
        self._register = register        # makes the voice usable (registries, Code2Wav pass)
        self._unregister = unregister
        self._in_use = in_use            # voice names held by live or queued sessions
        self._clock = clock
        self._grace_s = grace_s
        self._lock = threading.Lock()
        self._last_used: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.added = 0                   # recordings registered (cumulative)
        self.reuses = 0                  # requests answered with a voice already registered
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._last_used)

    @staticmethod
    def name_of(audio: torch.Tensor) -> str:
        return PREFIX + audio_sha256(audio)[:24]

    def add(self, ref_audio: Any) -> str:
        """The voice name for this recording, registering it on first sight.

        ReferenceAudioError for audio the engine cannot use, ReferenceVoicesFull when every slot
        is held."""
        if self.limit <= 0:
            raise ReferenceAudioError("this server takes no reference recordings (engine.max_reference_voices: 0)")
        audio = validate_reference_audio(np.ascontiguousarray(ref_audio, dtype=np.float32)
                                         if isinstance(ref_audio, np.ndarray) else ref_audio)
        name = self.name_of(audio)
        with self._lock:
            now = self._clock()
            if name in self._last_used:
                self.reuses += 1
                self._last_used[name] = now
                self._last_used.move_to_end(name)
                return name
            if len(self._last_used) >= self.limit:
                self._evict_one(now)
            voice = Voice(name, audio.clone(), self.base.prompt_tokens, self.base.prompt_mel, self.base.spk)
            self._register(voice)
            self._last_used[name] = now
            self.added += 1
        logger.info("reference voice %s registered (%.2f s of audio; %d held)", name, voice.ref_seconds,
                    len(self._last_used))
        return name

    def _evict_one(self, now: float) -> None:
        held = set(self._in_use())
        for name, last in self._last_used.items():   # oldest first
            if name not in held and now - last >= self._grace_s:
                self._unregister(name)
                del self._last_used[name]
                self.evicted += 1
                logger.info("reference voice %s evicted (least recently used, no session)", name)
                return
        raise ReferenceVoicesFull(f"all {self.limit} reference voices are in use (engine.max_reference_voices); "
                                  "try again later")
