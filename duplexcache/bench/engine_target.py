"""The bench target that goes through the serving engine (``runtime.engine.DuplexEngine``).

Each configuration is a ``DuplexEngine(deploy, models)`` built from that configuration's deploy
config, so every switch travels the same wiring as ``duplexcache serve``; the weights
(``ModelBundle``) are built once per bench run and shared, as memory does not depend on them.

The workload, and what the bench does to the engine beyond the public EngineAPI (each is
stated in report.json under ``workload``):

* Speaking: the engine's scripted policy speaks in 2-unit turns, which never lets a Code2Wav
  stream reach its steady size. The bench installs ``ScriptedPolicy(k=K, turn_units=K)`` with
  a large K, so every unit speaks and one turn spans the whole run.
* Fast-forward to steady state: the Thinker window is filled to ``prefix + high_tokens``
  through ``engine.stage0.append`` (real token embeddings of seeded random ids), and every
  session's Talker table is grown to a full turn (``max_position_embeddings`` tokens) through
  the engine's own ``_grow_talker`` (blocks held, not computed). Code2Wav reaches P private
  frames by real units.
* Memory: ``engine.stats().pools`` (refreshed with ``_refresh_pools`` after a fast-forward),
  plus the Euler arena and the context cache, which the engine's pools do not list.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from duplexcache.bench.components import (
    FRAMES_PER_UNIT,
    SessionOutput,
    _high_mark,
    check_code2wav_steady,
)
from duplexcache.bench.memory import Tier
from duplexcache.config import DeployConfig
from duplexcache.runtime.engine import DuplexEngine
from duplexcache.runtime.engine_api import AudioDelta, SessionError, TextDelta
from duplexcache.runtime.policy import ScriptedPolicy, text_token_ids

logger = logging.getLogger(__name__)

INSTRUCTIONS = "You are a helpful voice assistant. Answer briefly."
ALWAYS_SPEAK_K = 1_000_000   # one turn for the whole run: every unit speaks


class EngineTarget:
    """``n`` sessions on a fresh engine for one configuration."""

    name = "engine"

    def __init__(self, models, deploy: DeployConfig, max_sessions: int) -> None:
        self.models = models
        self.engine = DuplexEngine(deploy, models)
        e = self.engine
        e.policy = ScriptedPolicy(e.control, text_token_ids(models.tokenizer, models.thinker.config.vocab_size),
                                  k=ALWAYS_SPEAK_K, turn_units=ALWAYS_SPEAK_K)
        self.voice = "default"
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
        """Open ``n`` sessions and tick until each produced its first audio chunk (context
        prefilled, voice set up, first unit done)."""
        for _ in range(n):
            sid = self.engine.open_session({"instructions": INSTRUCTIONS, "voice": self.voice})
            self.outputs[sid] = SessionOutput()
            self._pushed[sid] = 0
        while not all(o.audio for o in self.outputs.values()):
            if self.units > 4:
                raise RuntimeError("bench: sessions produced no audio after 4 ticks")
            self.run_unit()

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
        """Thinker windows to their high mark, Talker tables to a full turn (module docstring)."""
        e = self.engine
        st, mgr = e.stage0, e.stage0.manager
        todo = {sid: s.prefix_len + _high_mark(st, sid) - mgr.num_tokens(sid) for sid, s in st.sessions.items()} \
            if e.window.enabled else {}
        most, step = max(todo.values(), default=0), 0
        while any(v > 0 for v in todo.values()):
            inputs = {}
            for i, (sid, left) in enumerate(todo.items()):
                if left > 0:
                    n = min(left, chunk_tokens)
                    g = torch.Generator().manual_seed(7_000_003 * step + i)
                    inputs[sid] = e._embed_tokens(torch.randint(0, 151_000, (n,), generator=g))
                    todo[sid] -= n
            res = st.append(inputs, unit_start=False)
            if res.errors:
                sid, err = next(iter(res.errors.items()))
                raise RuntimeError(f"bench: fast-forward ended session {sid}: {err}")
            step += 1
        full_turn = self.models.talker.config.max_position_embeddings
        for sess in list(e._sessions.values()):
            e._grow_talker(sess, full_turn)
        check_code2wav_steady(e.code2wav)
        return max(0, most)

    # ---------------------------------------------------------------- accounting
    def pools(self) -> dict[str, Tier]:
        e = self.engine
        e._refresh_pools()
        out = {name: Tier(t.shared, t.private, t.free) for name, t in e.stats().pools.items()}
        out["cfm_arena"] = Tier(e.code2wav.arena.nbytes(), 0)
        cache = e.builder.cache
        out["context_cache"] = Tier(cache.nbytes() if cache is not None else 0, 0)
        return out

    def close(self) -> None:
        self.engine.shutdown()
