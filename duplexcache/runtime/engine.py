"""The duplex engine: many live sessions per device, one tick = one 1-second unit for each.

One tick, batched over every live session with a unit of audio buffered (>= 1 s; the first unit
is 1.035 s): the audio encoder (10 embeddings), the Thinker (listen | speak text), the Talker
(25 codes), Code2Wav (1 s of 24 kHz PCM in the same tick): runtime/engine_parts.py ``run_units``.

This module keeps the session API of ``engine_api.EngineAPI``, the life cycle and the tick's
order; the rest has its owner (docs/design.md, "Rooms"): the session table (``engine_session``),
which sessions run in which tick (``scheduler``), footprints and the plan (``session_sizing``),
the parts built from the deploy config (``engine_parts``, ``device_setup``), the stages, the
warm-up (``warmup``) and the statistics (``engine_stats``). Sessions open, stream and close at
any time (thread-safe per engine_api); a failure attributable to one session ends that session
only (docs/engine.md, "Isolation").
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from duplexcache.config import DeployConfig
from duplexcache.context import EmbeddingResult, SessionContextBuilder
from duplexcache.context.tokenizer import MemoTokenizer
from duplexcache.runtime import engine_parts, turns
from duplexcache.runtime.memory import device_setup
from duplexcache.runtime.memory.admission import Footprint, Headroom, headroom
from duplexcache.runtime.bundle import ModelBundle, build_models
from duplexcache.runtime.stages.code2wav_stage import LOOKAHEAD, build_code2wav, pcm16_bytes
from duplexcache.runtime.engine_api import (ADMISSION_MESSAGES, AdmissionError, EngineEvent, EngineStats,
                                            SessionError, TierBytes)
from duplexcache.runtime.engine_session import (MAX_BUFFERED_SAMPLES, MAX_BUFFERED_SECONDS, EngineSession,
                                                SessionInfo, SessionTable, Unit, session_info)
from duplexcache.runtime.engine_stats import LATENCY_HISTORY, STAGES
from duplexcache.runtime.isolation import FaultInjector
from duplexcache.runtime.policy import ControlTokens, text_token_ids
from duplexcache.runtime.stages.vision_stage import MAX_PENDING_FRAMES, VisionUnavailable, decode_frame
from duplexcache.runtime.memory.session_sizing import RefusalLog, SessionSizing, refusal
from duplexcache.runtime.warmup import WarmupReport, cached_bytes, run_warmup

# Names other modules import from here (their home is where the work moved).
__all__ = ["LATENCY_HISTORY", "LOOKAHEAD", "MAX_BUFFERED_SAMPLES", "MAX_BUFFERED_SECONDS", "STAGES",
           "DuplexEngine", "SessionInfo", "build_engine", "pcm16_bytes"]

logger = logging.getLogger(__name__)

STAGE_RANGE = engine_parts.STAGE_RANGE


def build_engine(deploy: DeployConfig) -> DuplexEngine:
    """The engine for a deploy config: the preset's models (random weights or the checkpoint)."""
    return DuplexEngine(deploy, build_models(deploy))


class DuplexEngine:
    """Implements :class:`duplexcache.runtime.engine_api.EngineAPI` over real models."""

    def __init__(self, deploy: DeployConfig, models: ModelBundle) -> None:
        self.deploy = deploy
        self.models = models
        self.voices = models.voices
        device_setup.pin_cuda_numerics(models.device)
        self.control = ControlTokens.from_tokenizer(models.tokenizer)
        self._text_ids = text_token_ids(models.tokenizer, models.thinker.config.vocab_size)
        # The engine reads no switch itself: engine_parts builds each part from ``deploy``.
        policy = engine_parts.build_policy(deploy, self.control, self._text_ids)
        self.batch_invariant = engine_parts.numerics_mode(deploy, models.device)   # None: plain kernels
        self.reference_encodes = 0
        # One memo for the context's two tokenizations: open_session's sizing (a worker thread)
        # fills it, the tick's context build reads it (context/tokenizer.py MemoTokenizer).
        self.context_tokenizer = MemoTokenizer(models.tokenizer)
        self.builder = SessionContextBuilder.from_config(deploy, self.context_tokenizer, self._embed_tokens,
                                                         self._encode_reference_audio)
        with self._numerics():   # a voice's prompt state with the same kernels as a tick's
            self.code2wav = build_code2wav(deploy, models)   # every voice's prompt state computed once
        self.sizing = SessionSizing(deploy, models, self.code2wav, self.context_tokenizer)
        self.block_size = self.sizing.block_size   # stage0.block_size, of both KV pools
        self.refusal_log = RefusalLog(logger)
        # The auto budget's headroom (the plan holds its activation reserve): set by a re-plan.
        self.headroom_bytes = 0
        self.dynamic_reserved_bytes = 0   # what the warm-up held of the dynamic region (CUDA)
        # The graphs' private pools the warm-up measured (CUDA; runtime/warmup.py): decode and
        # encoder graphs (rebuilt with the pools), Code2Wav and vocoder graphs (kept for good).
        self.session_graph_pool_bytes = 0
        # each voice's Code2Wav prompt pass was captured by build_code2wav: its pool is held now
        self.fixed_graph_pool_bytes = cached_bytes(models.device)
        self._replanned = False
        # Held by tick() and between_ticks(): both run models over the tick thread's state.
        self._tick_lock = threading.Lock()
        self.table: SessionTable | None = None
        engine_parts.build_session_side(self, self.sizing.plan(), policy)
        self._closed = False
        self.scheduler = engine_parts.build_scheduler(self)   # which sessions run in which tick, and when
        self.last_tick_units = 0   # units the last tick ran (a server times its ticks between by it)
        # Graphs captured while the engine was built (each voice's Code2Wav prompt pass at
        # register_voice) were captured before serving: they count with the warm-up's.
        self._warmup_captures = self._graph_captures_total()
        self.warmup_report: WarmupReport | None = None
        self.faults: FaultInjector | None = None   # tests only (install_faults; runtime/isolation.py)
        self.reference_voices = engine_parts.build_reference_voices(self)   # from clients' recordings
        self.recorder.refresh_pools()
        logger.info("engine ready: %s", self.plan.describe())

    def _can_capture_decode(self) -> bool:
        return device_setup.decode_graphs_supported(self.models.device, (self.thinker_cache, self.talker_cache))

    def _can_capture_encoder(self) -> bool:
        return self.models.device.type == "cuda"

    def warmup(self, should_stop: Callable[[], bool] | None = None) -> WarmupReport:
        """Every graph captured and every kernel compiled before serving (runtime/warmup.py run_warmup)."""
        return run_warmup(self, should_stop)

    def waterfall(self) -> Any:
        """The card waterfall now (runtime/memory/waterfall.py): every byte of the device by part."""
        from duplexcache.runtime.memory.waterfall import engine_waterfall

        return engine_waterfall(self)

    def describe_plan(self) -> str:
        return self.plan.describe()

    def _graph_captures_total(self) -> int:
        return engine_parts.graph_captures_total(self)

    # ------------------------------------------------------------------ model adapters

    def _embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.models.thinker.embed(ids)  # checked on the host, then moved

    def _encode_reference_audio(self, audio: torch.Tensor, state: Any) -> EmbeddingResult:
        return engine_parts.encode_reference_audio(self, audio)   # whole clip, counted

    # ------------------------------------------------------------------ sessions

    def context_tokens(self, client_session: Mapping[str, Any]) -> int:
        """The Thinker context length a ``session.update`` object would open with (instructions,
        reference audio, initial text), from shapes only; compare with ``server.max_context_tokens``."""
        cfg, voice = self.sizing.check_session(client_session)
        return self.sizing.context_layout(cfg, voice).total

    def open_session(self, client_session: Mapping[str, Any], *, queue_if_full: bool = False,
                     sid: str | None = None) -> str:
        if self._closed:
            raise RuntimeError("engine is shut down")
        cfg, voice = self.sizing.check_session(client_session)
        fp = self.sizing.footprint(cfg, voice)
        table = self.table
        with table.lock:
            table.check_free_id(sid)
            why = table.refusal(fp, self._refusal)
            if why is not None and not queue_if_full:
                code, detail = why
                self.refusal_log.refused(code, detail)
                raise AdmissionError(ADMISSION_MESSAGES[code], code=code)
            seed_name = table.next_seed_name()
            sid = sid or seed_name
            sess = EngineSession(sid, cfg, voice, fp, policy_state=self.policy.new_session(sid), seed_name=seed_name)
            if why is None:
                table.admit(sess)
            else:
                table.enqueue(sess)
                logger.info("session %s queued (%s): %s", sid, why[0], why[1])
        return sid

    def _refusal(self, fp: Footprint) -> tuple[str, str] | None:
        return refusal(self.ledger, self.scheduler.tick_cost, fp, len(self.table.live))

    def add_reference_voice(self, ref_audio: np.ndarray | torch.Tensor) -> str:
        """See engine_api; registered on first sight (may wait for a running tick then), the same
        name and state after. ReferenceAudioError for unusable audio or when every slot is held."""
        if self._closed:
            raise RuntimeError("engine is shut down")
        return self.reference_voices.add(ref_audio)

    def voice_names(self) -> list[str]:
        return sorted(self.voices.names())

    def is_queued(self, sid: str) -> bool:
        return self.table.is_queued(sid)

    def queue_position(self, sid: str) -> int | None:
        return self.table.queue_position(sid)

    def install_faults(self, faults: FaultInjector | None) -> None:
        """Test hook: make chosen stages raise for chosen sessions (runtime/isolation.py)."""
        engine_parts.install_faults(self, faults)

    def push_audio(self, sid: str, pcm: np.ndarray) -> None:
        self.table.push_audio(sid, pcm)

    def push_frame(self, sid: str, image: bytes) -> None:
        """See engine_api; decoded here, on the caller's thread (runtime/stages/vision_stage.py)."""
        if self.vision_stage is None:
            raise VisionUnavailable("camera frames need a server with a vision model (model.vision is false)")
        self.table.get_live(sid)   # an unknown session is told so before its image is decoded
        self.table.push_frame(sid, decode_frame(image, self.vision_stage.cfg), MAX_PENDING_FRAMES)

    def close_session(self, sid: str) -> None:
        self.table.close(sid)

    def set_turn_mode(self, sid: str, mode: str) -> None:
        self.table.set_turn_mode(sid, mode)

    def request_response(self, sid: str) -> None:
        self.table.request_response(sid)

    def cancel_response(self, sid: str, played_ms: int | None = None) -> bool:
        """See engine_api. A request not started yet is withdrawn (no response existed: False)."""
        return self.table.cancel_response(sid, played_ms)

    def add_user_text(self, sid: str, text: str) -> None:
        ids = turns.user_text_ids(self.models.tokenizer, text)
        self.table.add_user_text(sid, ids, self.thinker_stage.user_text_room)

    def session_ids(self) -> list[str]:
        """Live (admitted, not queued) sessions, in admission order."""
        return self.table.live_ids()

    def admission_room(self) -> Headroom:
        return headroom(self.plan, self.scheduler.tick_cost, len(self.table.live_ids()))

    def session_info(self, sid: str) -> SessionInfo:
        """A snapshot of live session ``sid`` (consistent between ticks); ValueError if unknown."""
        return session_info(self.table.get_live(sid), self.stage0, self.talker_kv)

    # ------------------------------------------------------------------ the tick

    def tick(self, unit_tick: bool = True) -> list[EngineEvent]:
        """One tick. ``unit_tick`` False: a tick between unit ticks (``scheduler.tick_phases`` > 1): it
        takes early closes and the units sessions already hold, and starts none (no alignment, no fill)."""
        with self._tick_lock, self._numerics():
            return self._tick(unit_tick)

    def _numerics(self) -> contextlib.AbstractContextManager:
        """The batch-invariant mode when ``engine.batch_invariant`` is on (entered on the thread
        that runs the models: torch function modes are thread-local)."""
        return self.batch_invariant if self.batch_invariant is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def between_ticks(self) -> Iterator[None]:
        """Model work on the tick thread's state outside a tick (a prefill chunk, bench/fast_forward.py):
        waits for a running tick, refuses after shutdown, runs in the tick's numerics."""
        with self._tick_lock:
            if self._closed:
                raise RuntimeError("engine is shut down")
            with self._numerics():
                yield

    def _tick(self, unit_tick: bool = True) -> list[EngineEvent]:
        if self._closed:
            raise RuntimeError("engine is shut down")
        start = time.perf_counter()
        sched = self.scheduler
        sched.start_tick(unit_tick, start)
        lat = dict.fromkeys(STAGES, 0.0)
        events: list[EngineEvent] = []
        for sess in self.table.take_closing():
            self._free(sess)
        events += self.table.admit_queued(self._refusal)
        prefill_s = 0.0
        pending = self.table.pending()
        if sched.prefill_times.chunk_in_tick(pending):
            t = time.perf_counter()
            if sched.prefill_times.between_ticks:   # timed (synchronised) so the slack can take the next one
                events += sched.prefill_times.measure(lambda: self._prefill_chunk(pending))
            else:
                events += self._prefill_chunk(pending)
            prefill_s = time.perf_counter() - t
        events += engine_parts.apply_cancels(self)
        units = sched.take_units()
        self.last_tick_units = len(units)
        if units:
            events += self._run_units(units, lat)
        lat["tick"] = time.perf_counter() - start
        sched.finish_tick(lat["tick"], prefill_s, len(units))
        self.table.note_tick_for_pending()
        self.recorder.finish_tick(lat, sched.period_s)
        return self._for_live(events)

    def _for_live(self, events: list[EngineEvent]) -> list[EngineEvent]:
        """A session closed while the tick thread worked gets no more events (errors excepted)."""
        live = set(self.table.live_ids())
        return [e for e in events if e.sid in live or isinstance(e, SessionError)]

    def _prefill_chunk(self, pending: list[EngineSession] | None = None) -> list[EngineEvent]:
        pending = self.table.pending() if pending is None else pending
        return self.thinker_stage.open_pending(pending, self._ticks) if pending else []

    def prefill_pending(self) -> bool:
        """Whether a session waits for its context to be built or prefilled."""
        return bool(self.table.pending())

    def prefill_step(self) -> list[EngineEvent]:
        """One prefill chunk between ticks (runtime/scheduler/pacing.py: the server runs it when
        ``predicted_prefill_s()`` fits before the next tick); the next tick then runs none."""
        with self.between_ticks():
            for sess in self.table.take_closing():   # as a tick does: no chunk for a closed session
                self._free(sess)
            return self._for_live(self.scheduler.prefill_times.run(self._prefill_chunk))

    def predicted_prefill_s(self) -> float | None:
        return self.scheduler.prefill_times.predicted_s()

    # Pacing (EngineAPI): the scheduler's (runtime/scheduler/core.py), set by a server before its first tick.
    def set_prefill_between_ticks(self, enabled: bool) -> None:
        self.scheduler.set_prefill_between_ticks(enabled)

    def set_unit_alignment(self, margin_ms: float | None) -> None:
        self.scheduler.set_unit_alignment(margin_ms)

    def set_tick_phases(self, phases: int) -> None:
        self.scheduler.set_tick_phases(phases)

    def set_silence_fill(self, after_ms: float | None) -> None:
        self.scheduler.set_silence_fill(after_ms)

    def sessions_behind(self) -> int:
        return self.scheduler.sessions_behind()

    def _would_answer(self, sess: EngineSession, pcm: np.ndarray, after: np.ndarray) -> bool:
        would_answer = getattr(self.policy, "would_answer", None)   # the policy in use now (tests swap it)
        return would_answer is not None and bool(would_answer(sess.policy_state, pcm, after))

    def _run_units(self, units: list[Unit], lat: dict[str, float]) -> list[EngineEvent]:
        return engine_parts.run_units(self, units, lat)   # the stages in order (tests wrap this)

    def _end(self, sess: EngineSession, err: Exception) -> SessionError:
        return engine_parts.end_session(self, sess, err)   # the stages' callback for a session they cannot go on with

    def _free(self, sess: EngineSession) -> None:
        engine_parts.free_session(self, sess)

    def shutdown(self) -> None:
        """Close every session and release the engine's memory (call with no tick running)."""
        for sess in self.table.clear():
            self._free(sess)
        self._closed = True
        engine_parts.release_graphs_and_pools(self)
        logger.info("engine shut down")

    def stats(self) -> EngineStats:
        snapshot = self.recorder.snapshot(
            {"thinker": self.thinker_graphs, "talker": self.talker_graphs}, self._warmup_captures,
            self._graph_captures_total(), self.warmup_report.seconds if self.warmup_report is not None else None,
            self.encoder_graphs.stats.replays if self.encoder_graphs is not None else 0,
            early_closes=self.scheduler.early_closes)
        return dataclasses.replace(snapshot, reference_voices=len(self.reference_voices),
                                   reference_voices_added=self.reference_voices.added,
                                   reference_voice_reuses=self.reference_voices.reuses)

    # ------------------------------------------------------------------ read by the demo, benchmarks and tests

    @property
    def policy(self) -> Any:
        """The speak policy (settable: tests swap it; the Thinker stage reads this one)."""
        return self.thinker_stage.policy

    @policy.setter
    def policy(self, policy: Any) -> None:
        self.thinker_stage.policy = policy

    @property
    def activation_reserve(self) -> int:
        """The current plan's (``engine.activation_reserve`` until a warm-up re-plans)."""
        return self.plan.activation_reserve

    @property
    def _ticks(self) -> int:
        return self.recorder.ticks

    @property
    def late_ticks(self) -> int:
        return self.recorder.late_ticks

    @property
    def code2wav_peak(self) -> TierBytes:
        return self.recorder.code2wav_peak
