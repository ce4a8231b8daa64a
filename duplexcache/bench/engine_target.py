"""The bench target that goes through the serving engine (``runtime.engine.DuplexEngine``).

Each configuration is a ``DuplexEngine(deploy, models)`` built from that configuration's deploy
config, so every switch travels the same wiring as ``duplexcache serve``; the weights
(``ModelBundle``) are built once per bench run and shared, as memory does not depend on them.

The workload, and how the bench brings the engine to its steady state (each is stated in
report.json under ``workload``); it uses only the engine's public API:

* Speaking: the default scripted policy speaks in 2-unit turns, which never lets a Code2Wav
  stream reach its steady size. The bench's deploy config sets ``engine.speak_policy`` to
  ``every_k_units`` with ``k = turn_units = ALWAYS_SPEAK_K``, so every unit speaks and one turn
  spans the whole run (the same setting a deploy YAML can make).
* Fast-forward to steady state (bench/fast_forward.py): each session's Thinker window to its
  high mark, a full Talker turn and a full encoder cache held; Code2Wav reaches P private
  frames by real units.
* Memory: ``engine.stats().pools``, which lists the Euler arena and the context cache too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from duplexcache.bench.fast_forward import fast_forward_session
from duplexcache.bench.memory import Tier
from duplexcache.config import DeployConfig
from duplexcache.runtime.engine import DuplexEngine
from duplexcache.runtime.engine_api import AudioDelta, SessionError, TextDelta

logger = logging.getLogger(__name__)

INSTRUCTIONS = "You are a helpful voice assistant. Answer briefly."
ALWAYS_SPEAK_K = 1_000_000   # one turn for the whole run: every unit speaks
FRAMES_PER_UNIT = 50         # 25 speech tokens, x2 upsampling


@dataclass
class SessionOutput:
    """What one session produced: its text and its pcm16 audio, per unit (the equality check's input)."""

    text: list[int] = field(default_factory=list)
    audio: list[torch.Tensor] = field(default_factory=list)


def check_code2wav_steady(code2wav) -> None:
    """Raise if any Code2Wav session's estimator cache is not at its steady length P + tail
    (the bench must not call a state "steady" that is not)."""
    tail = code2wav.config.cache_tail_frames
    for sid, sess in code2wav.sessions.items():
        want = sess.prompt_frames + tail
        if len(sess.att) != want:
            raise RuntimeError(f"bench: Code2Wav session {sid} holds {len(sess.att)} cache frames, not the "
                               f"steady {want} (P + tail); run more units (--units)")


def always_speak(deploy: DeployConfig) -> DeployConfig:
    """``deploy`` with the speak policy the bench runs: every unit speaks, one turn per run."""
    data = deploy.to_dict()
    data["engine"]["speak_policy"] = {"mode": "every_k_units", "k": ALWAYS_SPEAK_K, "turn_units": ALWAYS_SPEAK_K}
    return DeployConfig.from_dict(data, environ={})


class EngineTarget:
    """``n`` sessions on a fresh engine for one configuration."""

    name = "engine"

    def __init__(self, models, deploy: DeployConfig, max_sessions: int, voices: tuple[str, ...] = ("default",),
                 contexts: int = 1) -> None:
        """Session ``i`` speaks with ``voices[i % len(voices)]`` and opens with the
        ``i % contexts``-th instructions (1: every session has the same context)."""
        if contexts < 1 or not voices:
            raise ValueError(f"need >= 1 voice and >= 1 context (got {voices!r}, {contexts})")
        self.models = models
        self.engine = DuplexEngine(always_speak(deploy), models)
        self.voices = voices
        self.contexts = contexts
        self.outputs: dict[str, SessionOutput] = {}
        self.tick_s: list[float] = []
        self._pushed: dict[str, int] = {}
        self.units = 0

    @staticmethod
    def units_to_steady(prompt_frames: int, cache_tail: int = 100) -> int:
        """Ticks until Code2Wav owns P private frames: speech lags text by one unit, so the
        first chunk comes out in tick 2; each chunk adds 50 frames; trim past P + tail."""
        return 1 + -(-max(prompt_frames, cache_tail + 1) // FRAMES_PER_UNIT)

    # ---------------------------------------------------------------- workload
    def open_sessions(self, n: int) -> None:
        """Open ``n`` sessions, prefill every context, then tick until each produced its first
        audio chunk (voice set up, first unit done).

        Every session's first unit runs in the same tick in every configuration: the contexts
        are prefilled between ticks (``prefill_step``) before any audio is pushed. Without that
        hold, a switch that skips prefill work (shared anchor blocks: a later session's context
        is a cache hit) lets sessions go live ticks earlier than in ``all_off``, which prefills
        ``engine.prefill_chunk_tokens`` per tick; the tick batches then differ and the equality
        check compares different schedules, not the switch (docs/benchmarks.md, "Equality")."""
        for i in range(n):
            instructions = INSTRUCTIONS if i % self.contexts == 0 else f"{INSTRUCTIONS} Context {i % self.contexts}."
            sid = self.engine.open_session({"instructions": instructions, "voice": self.voices[i % len(self.voices)]})
            self.outputs[sid] = SessionOutput()
            self._pushed[sid] = 0
        self.prefill_all()
        live_ticks = 0   # ticks since every context was prefilled
        while not all(o.audio for o in self.outputs.values()):
            if live_ticks > 4:
                raise RuntimeError("bench: sessions produced no audio after 4 ticks")
            live_ticks += not self.engine.prefill_pending()
            self.run_unit()

    def prefill_all(self) -> None:
        """Build and prefill every pending context now, between ticks (no unit runs)."""
        while self.engine.prefill_pending():
            for ev in self.engine.prefill_step():
                if isinstance(ev, SessionError):
                    raise RuntimeError(f"bench: session {ev.sid} could not open: {ev.code}: {ev.message}")

    def run_unit(self) -> None:
        enc = self.models.audio_encoder.cfg
        for i, sid in enumerate(self.outputs):
            need = enc.first_chunk_samples if self._pushed[sid] == 0 else enc.chunk_samples
            g = torch.Generator().manual_seed(1_000_003 * self.units + i)
            self.engine.push_audio(sid, (0.1 * torch.randn(need, generator=g)).numpy().astype(np.float32))
            self._pushed[sid] += need
        start = time.perf_counter()
        events = self.engine.tick()
        if self.models.device.type == "cuda":
            torch.cuda.synchronize(self.models.device)
        self.tick_s.append(time.perf_counter() - start)
        self.units += 1
        for ev in events:
            if isinstance(ev, SessionError):
                raise RuntimeError(f"bench: session {ev.sid} failed: {ev.code}: {ev.message}")
            if isinstance(ev, AudioDelta):
                self.outputs[ev.sid].audio.append(torch.frombuffer(bytearray(ev.pcm16), dtype=torch.uint8))
            elif isinstance(ev, TextDelta):
                self.outputs[ev.sid].text.extend(ev.text.encode("utf-8"))

    def fast_forward_window(self, chunk_tokens: int = 512) -> int:
        """Thinker windows to their high mark, Talker tables to a full turn (module docstring);
        returns the most Thinker tokens one session took."""
        e = self.engine
        most = 0
        for sid in e.session_ids():
            window = e.session_info(sid).window
            high = window.high_tokens if window.enabled else None
            done = fast_forward_session(e, sid, thinker_tokens=high, talker_full_turn=True, encoder_full_cache=True,
                                        chunk_tokens=chunk_tokens)
            most = max(most, done.thinker_tokens_appended)
        check_code2wav_steady(e.code2wav)
        return most

    # ---------------------------------------------------------------- accounting
    def pools(self) -> dict[str, Tier]:
        return {name: Tier(t.shared, t.private, t.free) for name, t in self.engine.stats().pools.items()}

    def close(self) -> None:
        self.engine.shutdown()
