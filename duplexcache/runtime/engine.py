"""The duplex engine: many live sessions per device, one tick = one 1-second unit for each.

One tick, batched over every live session with a unit of audio buffered (>= 1 s; the first unit
is 1.035 s)::

    audio encoder   stream_step: the unit's PCM -> 10 embeddings        (thinker_stage.py)
    Thinker         append the unit, decode <= 20 tokens: listen | speak text..   (thinker_stage.py)
    Talker          speaking units -> 25 codes (KV kept for the turn)   (talker_stage.py)
    Code2Wav        3 carried + 25 codes -> 1 s of 24 kHz PCM, same tick (code2wav_stage.py)

This module keeps the life cycle (build, warm-up, shutdown), the session API of
``engine_api.EngineAPI`` and the tick's order; the work is delegated (docs/engine.md, "Module
layout"): session state to ``engine_session.SessionTable``, footprints and the memory plan to
``session_sizing``, pools and graphs to ``device_setup``, the stages to their runners, the
Talker's blocks to ``kv/talker_blocks``, statistics to ``engine_stats``.

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
import dataclasses
import gc
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch.profiler import record_function

from duplexcache.config import DeployConfig
from duplexcache.context import EmbeddingResult, EncoderPath, SessionContextBuilder
from duplexcache.context.tokenizer import MemoTokenizer
from duplexcache.kv.decode_graphs import PagedDecodeGraphs
from duplexcache.kv.kv_quant import kv_storage_dtype
from duplexcache.models.batch_invariant import BatchInvariantMode, tile_rows_for
from duplexcache.models.audio_encoder_graphs import EncoderGraphs
from duplexcache.runtime import device_setup, turns
from duplexcache.runtime.admission import AdmissionLedger, Footprint, MemoryPlan, TickCostModel
from duplexcache.runtime.bundle import ModelBundle, build_models
from duplexcache.runtime.code2wav_stage import LOOKAHEAD, Code2WavStage, build_code2wav, pcm16_bytes
from duplexcache.runtime.engine_api import (INPUT_SAMPLE_RATE, AdmissionError, AudioDelta, EngineEvent, EngineStats,
                                            SessionError, TierBytes)
from duplexcache.runtime.engine_session import (MAX_BUFFERED_SAMPLES, MAX_BUFFERED_SECONDS, EarlyClose,
                                                EngineSession, SessionInfo, SessionTable, SilenceFill, Unit, UnitAlignment, ended,
                                                session_info)
from duplexcache.runtime.engine_stats import LATENCY_HISTORY, STAGES, EngineStatsRecorder
from duplexcache.runtime.fast_forward import FastForwardRequest, FastForwardResult, fast_forward
from duplexcache.runtime.isolation import FaultInjector
from duplexcache.runtime.pacing import PrefillTimes
from duplexcache.runtime.policy import ControlTokens, make_policy, text_token_ids
from duplexcache.runtime.reference_voices import ReferenceVoices
from duplexcache.runtime.voices import Voice
from duplexcache.runtime.session_sizing import CLIENT_REFUSALS, RefusalLog, SessionSizing, refusal
from duplexcache.runtime.talker_stage import TalkerStage
from duplexcache.runtime.thinker_stage import ThinkerStage
from duplexcache.runtime.warmup import WarmupReport, cached_bytes, replan_after_warmup, warm_up

# Names other modules import from here (their home is where the work moved).
__all__ = ["LATENCY_HISTORY", "LOOKAHEAD", "MAX_BUFFERED_SAMPLES", "MAX_BUFFERED_SECONDS", "STAGES",
           "DuplexEngine", "FastForwardResult", "SessionInfo", "build_engine", "pcm16_bytes"]

logger = logging.getLogger(__name__)

STAGE_RANGE = "duplexcache.stage."   # profiler range prefix of each tick stage (bench/tick_profile.py)


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
        policy = make_policy(deploy.engine.speak_policy, self.control, self._text_ids)
        # engine.batch_invariant: every model call of a tick, prefill, warm-up and fast-forward
        # runs in this mode (graphs captured at warm-up bake its tiles in); None = plain kernels.
        self.batch_invariant = (BatchInvariantMode(tile_rows_for(models.device))
                                if deploy.engine.batch_invariant else None)
        self.block_size = deploy.stage0.block_size
        self.window = device_setup.window_config(deploy.stage0)
        self.reference_encodes = 0
        # One memo for the context's two tokenizations: open_session's sizing (a worker thread)
        # fills it, the tick's context build reads it (context/tokenizer.py MemoTokenizer).
        self.context_tokenizer = MemoTokenizer(models.tokenizer)
        self.builder = SessionContextBuilder.from_config(deploy, self.context_tokenizer, self._embed_tokens,
                                                         self._encode_reference_audio)
        with self._numerics():   # a voice's prompt state with the same kernels as a tick's
            self.code2wav = build_code2wav(deploy, models)   # every voice's prompt state computed once
        self.sizing = SessionSizing(deploy, models, self.code2wav, self.context_tokenizer)
        self.refusal_log = RefusalLog(logger)
        # What the plan keeps for activations, and the headroom an auto budget left free: the
        # configured reserve until a measured warm-up re-plans (warmup(); runtime/warmup.py).
        self.activation_reserve = deploy.engine.activation_reserve
        self.headroom_bytes = 0
        self.dynamic_reserved_bytes = 0   # what the warm-up held of the dynamic region (CUDA)
        # The graphs' private pools the warm-up measured (CUDA; runtime/warmup.py): decode and
        # encoder graphs (rebuilt with the pools), Code2Wav and vocoder graphs (kept for good).
        self.session_graph_pool_bytes = 0
        # each voice's Code2Wav prompt pass was captured by build_code2wav: its pool is held now
        self.fixed_graph_pool_bytes = cached_bytes(models.device)
        self._replanned = False
        # Held by tick() and fast_forward(): both run models over the tick thread's state.
        self._tick_lock = threading.Lock()
        self.table: SessionTable | None = None
        self._build_session_side(self.sizing.plan(), policy)
        self._closed = False
        self.prefill_times = PrefillTimes(models.device)   # prefill chunk times, for a server's pacing
        self._unit_alignment: UnitAlignment | None = None   # set by a server (set_unit_alignment)
        # server.phase_units home (set_tick_phases): when the last unit tick started, for the room
        # of the ticks between (perf_counter; None before the first)
        self._unit_tick_started: float | None = None
        self._unit_tick = True   # whether the tick in progress is a unit tick
        self.last_tick_units = 0   # units the last tick ran (a server times its ticks between by it)
        # Graphs captured while the engine was built (each voice's Code2Wav prompt pass at
        # register_voice) were captured before serving: they count with the warm-up's.
        self._warmup_captures = self._graph_captures_total()
        self.warmup_report: WarmupReport | None = None
        # Admission by time: the measured per-session tick cost (runtime/admission.py).
        self.tick_cost = TickCostModel(deploy.engine.tick_seconds, deploy.engine.tick_headroom)
        # Fault injection for tests (runtime/isolation.py); None when serving: no YAML key or
        # client message reaches it, only ``install_faults``.
        self.faults: FaultInjector | None = None
        # Voices from clients' reference recordings, made on first sight and shared after.
        self.reference_voices = ReferenceVoices(deploy.engine.max_reference_voices, self.voices.get("default"),
                                                self._register_voice, self._unregister_voice, self._voices_in_use)
        self.recorder.refresh_pools()
        logger.info("engine ready: %s", self.plan.describe())

    def _build_session_side(self, plan: MemoryPlan, policy: Any, faults: FaultInjector | None = None) -> None:
        """The plan's ledger, pools, graphs and the stages over them: everything sized by the
        plan, built at start and again by a re-plan after a measured warm-up (``warmup``). The
        session table (and what a server set on it) is kept; a re-plan runs with no session."""
        self.plan = plan
        self.ledger = AdmissionLedger(plan)
        if self.models.device.type == "cuda":
            # The warm-up's activation peak is measured from here (runtime/warmup.py).
            torch.cuda.synchronize(self.models.device)
            torch.cuda.reset_peak_memory_stats(self.models.device)
            self.reserved_before_pools = torch.cuda.memory_reserved(self.models.device)
        else:
            self.reserved_before_pools = 0
        self._build_pools()
        if self.table is None:
            self.table = SessionTable(self.ledger)
        else:
            assert not self.table.live and not self.table.queue, "re-plan with sessions open"
            self.table.ledger = self.ledger
        models, deploy = self.models, self.deploy
        self.recorder = EngineStatsRecorder(self.table, self.stage0, self.talker_kv, self.talker_cache.bytes_per_block,
                                            self.code2wav, self.voices.names(), self.builder, plan.dynamic_bytes)
        self.latency_history = self.recorder.latency_history   # per stage, the last LATENCY_HISTORY ticks
        self.code2wav_stage = Code2WavStage(self.code2wav, self.talker_kv, self.control, self.table, self._end,
                                            self.recorder.note_code2wav_peak)
        self.talker_stage = TalkerStage(models.talker, self.talker_cache, self.talker_kv, self.talker_graphs,
                                        self.control, self.code2wav_stage, self._end, self.sizing.talker_turn_tokens,
                                        ragged_graphs=deploy.engine.ragged_step_graphs)
        self.thinker_stage = ThinkerStage(self.stage0, models.audio_encoder, self.builder, models.tokenizer,
                                          self.control, policy, self._embed_tokens, self.table, self._end,
                                          kv_storage_dtype(deploy.precision.encoder_cache_dtype), self.encoder_graphs)
        if faults is not None:
            self.install_faults(faults)

    def _release_session_side(self) -> None:
        """Drop the pools and the graphs over them (a re-plan), so their memory can be freed."""
        for graphs in (self.thinker_graphs, self.talker_graphs):
            if graphs is not None:
                graphs.close()
        self.stage0.use_decode_graphs(None)
        self.thinker_graphs = self.talker_graphs = self.encoder_graphs = None
        for name in ("talker_stage", "thinker_stage", "code2wav_stage", "recorder", "stage0", "thinker_manager",
                     "thinker_cache", "talker_cache", "talker_kv", "talker_pool"):
            setattr(self, name, None)
        gc.collect()
        if self.models.device.type == "cuda":
            torch.cuda.synchronize(self.models.device)
            torch.cuda.empty_cache()

    def _build_pools(self) -> None:
        kv = device_setup.build_kv_pools(self.models, self.plan, self.deploy.stage0, self.window,
                                         kv_storage_dtype(self.deploy.precision.kv_cache_dtype),
                                         batch_invariant=self.deploy.engine.batch_invariant)
        self.thinker_cache, self.thinker_manager, self.stage0 = kv.thinker_cache, kv.thinker_manager, kv.stage0
        self.talker_cache, self.talker_kv = kv.talker_cache, kv.talker_kv
        self.talker_pool = self.talker_kv.pool   # read by tests and stats; only talker_kv mutates it
        self.thinker_graphs: PagedDecodeGraphs | None = None
        self.talker_graphs: PagedDecodeGraphs | None = None
        # CUDA graphs for the one-token steps (``engine.decode_cuda_graphs``).
        if self.deploy.engine.decode_cuda_graphs and self._can_capture_decode():
            self.thinker_graphs, self.talker_graphs = device_setup.make_decode_graphs(
                self.models, kv, self.plan.planned_sessions, self.sizing.talker_turn_tokens,
                capture=self.models.device.type == "cuda", ragged_steps=self.deploy.engine.ragged_step_graphs)
        self.stage0.use_decode_graphs(self.thinker_graphs, ragged_steps=self.deploy.engine.ragged_step_graphs)
        # The graph switches are CUDA-only and on by default: off CUDA that is expected (info), on
        # CUDA a switch that cannot act is a misconfiguration (warning).
        cannot_act = logger.warning if self.models.device.type == "cuda" else logger.info
        if self.deploy.engine.ragged_step_graphs and (self.thinker_graphs is None or not self.deploy.stage0.ragged_kernel):
            cannot_act("engine.ragged_step_graphs needs decode graphs (engine.decode_cuda_graphs on a CUDA "
                       "device) and stage0.ragged_kernel; short ragged steps run eagerly")
        self.encoder_graphs: EncoderGraphs | None = None
        if self.deploy.engine.encoder_cuda_graphs:
            if self._can_capture_encoder():
                self.encoder_graphs = EncoderGraphs(
                    self.models.audio_encoder, max_batch=device_setup.graph_batch(self.plan.planned_sessions),
                    storage_dtype=kv_storage_dtype(self.deploy.precision.encoder_cache_dtype),
                    capture=self.models.device.type == "cuda")
                # from the activation reserve, as the decode graphs' buffers: the eager tick's
                # gather buffer at its largest, held for good
                logger.info("encoder graphs: %.1f MiB of static buffers", self.encoder_graphs.nbytes() / 2**20)
            else:
                cannot_act("engine.encoder_cuda_graphs needs a CUDA device; the encoder runs eagerly")

    def _can_capture_decode(self) -> bool:
        return device_setup.decode_graphs_supported(self.models.device, (self.thinker_cache, self.talker_cache))

    def _can_capture_encoder(self) -> bool:
        return self.models.device.type == "cuda"

    def warmup(self, should_stop: Callable[[], bool] | None = None) -> WarmupReport:
        """Capture every decode and Code2Wav graph and run every Triton kernel a tick can need
        (runtime/warmup.py), so that ticks capture nothing. Touches no session; call before
        serving (the server does, before /health answers ok). ``should_stop`` is asked between
        captures (a server shutting down)."""
        with self._tick_lock:
            if self._closed:
                raise RuntimeError("engine is shut down")
            stop = should_stop or (lambda: False)
            before = self._graph_captures_total()
            with self._numerics():
                report = warm_up(self, stop)
                if self._replan_wanted(report):
                    # Plan, warm, re-plan once, warm again (docs/engine.md "Memory: the order of start-up").
                    replan_after_warmup(self, report)
                    report = warm_up(self, stop)
            self._warmup_captures += self._graph_captures_total() - before
            self.warmup_report = report
        return report

    def _replan_wanted(self, report: WarmupReport) -> bool:
        """Whether this warm-up's measurement re-plans the pools: once, with
        ``engine.activation_from_warmup``, on a device that measures (CUDA), not cancelled."""
        return (self.deploy.engine.activation_from_warmup and not self._replanned and not report.cancelled
                and report.activation_peak_bytes is not None)

    def waterfall(self) -> Any:
        """The card waterfall now (runtime/waterfall.py): every byte of the device by part."""
        from duplexcache.runtime.waterfall import engine_waterfall

        return engine_waterfall(self)

    def _graph_captures_total(self) -> int:
        """Decode-graph keys first used (captures on CUDA) + Code2Wav graphs captured."""
        decode = sum(g.stats.first_uses for g in (self.thinker_graphs, self.talker_graphs, self.encoder_graphs)
                     if g is not None)
        return decode + self.code2wav.graph_stats.captures + self.code2wav.vocoder_graph_stats.captures

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
                raise AdmissionError(CLIENT_REFUSALS[code], code=code)
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
        return refusal(self.ledger, self.tick_cost, fp, len(self.table.live))

    def add_reference_voice(self, ref_audio: np.ndarray | torch.Tensor) -> str:
        """The name of a voice made from a reference recording (16 kHz float32 mono), for a
        session's ``voice``; registered on first sight, the same name (and state) for the same
        recording after. Optional EngineAPI member. May wait for a running tick (only when the
        recording is new). ReferenceAudioError for unusable audio or when every slot is held."""
        if self._closed:
            raise RuntimeError("engine is shut down")
        return self.reference_voices.add(ref_audio)

    def _register_voice(self, voice: Voice) -> None:
        # Under the tick lock: the prompt pass and the encoder run use the models a tick uses
        # (and their numerics: engine.batch_invariant).
        with self._tick_lock, self._numerics():
            before = self._graph_captures_total()
            embeddings = self.sizing.count_ref_embeddings(voice)
            self.code2wav.register_voice(voice.name, voice.prompt_tokens, voice.prompt_mel, voice.spk)
            self.sizing.ref_embeddings[voice.name] = embeddings
            self.voices.add(voice, listed=False)
            self.recorder.voice_names.append(voice.name)
            # captured outside any tick (as at start): not a capture inside a tick
            self._warmup_captures += self._graph_captures_total() - before
            self.recorder.refresh_pools()

    def _unregister_voice(self, name: str) -> None:
        with self._tick_lock:
            self.voices.remove(name)
            self.code2wav.unregister_voice(name)
            self.sizing.ref_embeddings.pop(name, None)
            self.recorder.voice_names.remove(name)
            self.recorder.refresh_pools()

    def _voices_in_use(self) -> set[str]:
        table = self.table
        with table.lock:
            return {s.voice.name for s in (*table.live.values(), *table.queue.values(), *table.closing)}

    def is_queued(self, sid: str) -> bool:
        return self.table.is_queued(sid)

    def queue_position(self, sid: str) -> int | None:
        """1 for the next queued session to be admitted, 2 for the one after...; None when
        ``sid`` is not queued (live, closed or unknown). For ``session.queued`` events."""
        return self.table.queue_position(sid)

    def install_faults(self, faults: FaultInjector | None) -> None:
        """Test hook: make chosen stages raise for chosen sessions (runtime/isolation.py)."""
        self.faults = faults
        for part in (self.stage0, self.thinker_stage, self.talker_stage, self.code2wav_stage):
            part.faults = faults

    def push_audio(self, sid: str, pcm: np.ndarray) -> None:
        self.table.push_audio(sid, pcm)

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

    def session_info(self, sid: str) -> SessionInfo:
        """A snapshot of live session ``sid`` (consistent between ticks); ValueError if unknown."""
        return session_info(self.table.get_live(sid), self.stage0, self.talker_kv)

    def fast_forward(self, sid: str, *, thinker_tokens: int | None = None, talker_full_turn: bool = False,
                     encoder_full_cache: bool = False, chunk_tokens: int = 512, seed: int = 0) -> FastForwardResult:
        """For benchmarks: bring ``sid``'s Thinker window to ``thinker_tokens`` and/or hold a full
        Talker turn (``engine.talker_turn_tokens``) and/or a full audio-encoder cache, without running the audio path
        (runtime/fast_forward.py says how); pool stats are refreshed afterwards. Call between
        ticks (it waits for a running tick)."""
        req = FastForwardRequest(thinker_tokens, talker_full_turn, encoder_full_cache, chunk_tokens, seed)
        with self._tick_lock:
            if self._closed:
                raise RuntimeError("engine is shut down")
            with self._numerics():
                result = fast_forward(self.table.get_live(sid), req, self.stage0, self.talker_kv,
                                      self.sizing.talker_turn_tokens, self._text_ids,
                                      self._embed_tokens, self._end)
            self.recorder.refresh_pools()
        return result

    # ------------------------------------------------------------------ the tick

    def tick(self, unit_tick: bool = True) -> list[EngineEvent]:
        """One tick. ``unit_tick`` False: a tick between unit ticks of a server whose units stay
        on the unit tick (``server.phase_units: home``): it takes early closes and the whole units
        sessions already hold, and starts no session's units (no alignment, no silence fill)."""
        with self._tick_lock, self._numerics():
            return self._tick(unit_tick)

    def _numerics(self) -> contextlib.AbstractContextManager:
        """The batch-invariant mode when ``engine.batch_invariant`` is on (entered on the thread
        that runs the models: torch function modes are thread-local)."""
        return self.batch_invariant if self.batch_invariant is not None else contextlib.nullcontext()

    def _tick(self, unit_tick: bool = True) -> list[EngineEvent]:
        if self._closed:
            raise RuntimeError("engine is shut down")
        start = time.perf_counter()
        self._unit_tick = unit_tick
        if unit_tick:
            self._unit_tick_started = start
        lat = dict.fromkeys(STAGES, 0.0)
        events: list[EngineEvent] = []
        for sess in self.table.take_closing():
            self._free(sess)
        events += self.table.admit_queued(self._refusal)
        prefill_s = 0.0
        pending = self.table.pending()
        if self.prefill_times.chunk_in_tick(pending):
            t = time.perf_counter()
            if self.prefill_times.between_ticks:   # timed (synchronised) so the slack can take the next one
                events += self.prefill_times.measure(lambda: self._prefill_chunk(pending))
            else:
                events += self._prefill_chunk(pending)
            prefill_s = time.perf_counter() - t
        events += self._apply_cancels()
        enc = self.models.audio_encoder
        units = self.table.take_units(lambda s: enc.expected_chunk_samples(s.encoder_state), 2 * enc.cfg.chunk_samples,
                                      self._unit_alignment, unit_tick)
        self.last_tick_units = len(units)
        if units:
            events += self._run_units(units, lat)
        lat["tick"] = time.perf_counter() - start
        # The cost model learns the unit work only: prefill is bounded separately (one chunk).
        self.tick_cost.observe(lat["tick"] - prefill_s, len(units))
        self.table.note_tick_for_pending()
        self.recorder.finish_tick(lat, self.deploy.engine.tick_seconds / self.tick_cost.phases)
        return self._for_live(events)

    def _for_live(self, events: list[EngineEvent]) -> list[EngineEvent]:
        """A session closed while the tick thread worked gets no more events (errors excepted)."""
        live = set(self.table.live_ids())
        return [e for e in events if e.sid in live or isinstance(e, SessionError)]

    def _prefill_chunk(self, pending: list[EngineSession] | None = None) -> list[EngineEvent]:
        pending = self.table.pending() if pending is None else pending
        return self.thinker_stage.open_pending(pending, self._ticks, self.deploy.engine.prefill_chunk_tokens) \
            if pending else []

    def prefill_pending(self) -> bool:
        """Whether a session waits for its context to be built or prefilled."""
        return bool(self.table.pending())

    def prefill_step(self) -> list[EngineEvent]:
        """One prefill chunk between ticks (runtime/pacing.py: the server runs it when
        ``predicted_prefill_s()`` fits before the next tick); the next tick then runs none."""
        with self._tick_lock:
            if self._closed:
                raise RuntimeError("engine is shut down")
            for sess in self.table.take_closing():   # as a tick does: no chunk for a closed session
                self._free(sess)
            with self._numerics():
                return self._for_live(self.prefill_times.run(self._prefill_chunk))

    def predicted_prefill_s(self) -> float | None:
        return self.prefill_times.predicted_s()

    def set_prefill_between_ticks(self, enabled: bool) -> None:
        """Called by a server that runs ``prefill_step`` in its slack: a tick then leaves a session
        that became pending since the last tick to that slack (runtime/pacing.py)."""
        self.prefill_times.between_ticks = enabled

    def set_unit_alignment(self, margin_ms: float | None) -> None:
        """Called by a server that ticks on a grid (``server.align_units_to_ticks``): each new
        session's units then end ``margin_ms`` plus its largest chunk before a tick
        (``engine_session.UnitAlignment``); None cuts units from the stream's first sample."""
        self._unit_alignment = None if margin_ms is None else UnitAlignment(
            round(margin_ms * INPUT_SAMPLE_RATE / 1000), self.models.audio_encoder.cfg.chunk_samples)

    def set_tick_phases(self, phases: int, home: bool = False) -> None:
        """Called by a server that ticks ``phases`` times per unit (``server.tick_phases``): with
        more than one, a session whose caller's turn has ended has its unit closed with silence at
        the next tick (``engine_session.EarlyClose``) when the speak policy would answer it (a
        policy without ``would_answer`` never does). Spread (``home`` False), the sessions' units
        fall on every phase and admission by time counts ``phases`` ticks per unit. ``home``
        (``server.phase_units: home``): units stay on the unit tick, the server says which tick is
        one (``tick(unit_tick=...)``), admission counts one tick per unit, and a tick between
        takes an early close only while it would end before the next unit tick is due."""
        if phases < 1:
            raise ValueError(f"tick phases must be >= 1, got {phases}")
        home = home and phases > 1
        self.tick_cost.set_phases(1 if home else phases)
        # the audio that arrives between two ticks: a cut at whole periods of it keeps the
        # session's units where they were on the grid, a whole number of ticks earlier
        unit = self.models.audio_encoder.cfg.chunk_samples
        period = round(self.deploy.engine.tick_seconds / phases * INPUT_SAMPLE_RATE)
        early = phases > 1 and 0 < period < unit   # 1: the server's ticks as they were, no early close
        self.table.early_close = EarlyClose(period, unit, self._would_answer, self._tick_has_room,
                                            home) if early else None

    def _would_answer(self, sess: EngineSession, pcm: np.ndarray, after: np.ndarray) -> bool:
        would_answer = getattr(self.policy, "would_answer", None)   # the policy in use now (tests swap it)
        return would_answer is not None and bool(would_answer(sess.policy_state, pcm, after))

    def _tick_has_room(self, units: int) -> bool:
        """Whether a tick of ``units`` units has room for one more (the measured tick cost;
        before any measurement, yes): within its phased period, or, for a tick between unit ticks
        (``server.phase_units: home``), before the next unit tick is due, one unit after the
        last one started: that unit tick runs every session, and its start is what keeps them
        in real time."""
        predicted = self.tick_cost.predicted_s(units + 1)
        if predicted is None:
            return True
        if self._unit_tick or self._unit_tick_started is None:
            return predicted <= self.tick_cost.tick_limit_s
        since_unit_tick = time.perf_counter() - self._unit_tick_started
        return since_unit_tick + predicted <= self.deploy.engine.tick_seconds

    def set_silence_fill(self, after_ms: float | None) -> None:
        """Called by a server (``server.fill_silence_after_ms``): a session whose client has sent
        nothing for ``after_ms`` longer than its largest chunk takes gets its unit completed with
        silence, and a chunk after such a pause comes after its silence
        (``engine_session.SilenceFill``), so replies go on and turns stay apart; None waits for audio."""
        self.table.silence_fill = None if after_ms is None else SilenceFill(round(after_ms * INPUT_SAMPLE_RATE / 1000))

    def sessions_behind(self) -> int:
        """Live sessions a whole unit behind their audio (server/app.py ticks early for them)."""
        enc = self.models.audio_encoder
        return self.table.count_behind(enc.cfg.chunk_samples, lambda s: enc.expected_chunk_samples(s.encoder_state))

    def _run_units(self, units: list[Unit], lat: dict[str, float]) -> list[EngineEvent]:
        # Each stage runs inside a profiler range named STAGE_RANGE + stage, so a torch.profiler
        # trace (`bench ticks --profile-ticks`) charges kernels to the stage that launched them.
        events: list[EngineEvent] = []
        t = time.perf_counter()
        with record_function(STAGE_RANGE + "encoder"):
            units, embeds = self.thinker_stage.encode(units, events)
        lat["encoder"] = time.perf_counter() - t
        t = time.perf_counter()
        with record_function(STAGE_RANGE + "thinker"):
            units = self.thinker_stage.run(units, embeds, events) if units else []
        lat["thinker"] = time.perf_counter() - t
        self.table.note_reply_units(units, self.control)
        events += self.thinker_stage.text_events(units)
        # A stage that had nothing to do this tick records 0 (not a sample).
        t = time.perf_counter()
        with record_function(STAGE_RANGE + "talker"):
            finals = self.talker_stage.run(units, events)
        units = [u for u in units if u.session.sid not in ended(events)]
        if any(u.codes is not None for u in units):
            lat["talker"] = time.perf_counter() - t
        t = time.perf_counter()
        with record_function(STAGE_RANGE + "code2wav"):
            audio = self.code2wav_stage.run(units, finals)
        if any(isinstance(e, AudioDelta) for e in audio):
            lat["code2wav"] = time.perf_counter() - t
        events += audio
        for u in units:
            u.session.unit_index += 1
        return events

    def _apply_cancels(self) -> list[EngineEvent]:
        """Cancels recorded since the last tick, at this unit boundary (before any unit runs)."""
        events: list[EngineEvent] = []
        for sess, played_ms in self.table.take_cancels():
            try:
                events += self.thinker_stage.cancel_reply(sess, played_ms, self.code2wav_stage.drop_turn)
            except Exception as err:  # noqa: BLE001 - a failed rewind ends its session only
                events.append(self._end(sess, err))
        return events

    # ------------------------------------------------------------------ ending sessions

    def _end(self, sess: EngineSession, err: Exception) -> SessionError:
        """End a session the engine cannot continue (it owns nothing afterwards)."""
        code = getattr(err, "code", "engine_error")
        logger.info("session %s ended: %s", sess.sid, err)
        self.table.remove(sess.sid)
        self._free(sess)
        return SessionError(sess.sid, code, str(err), fatal=True)

    def _free(self, sess: EngineSession) -> None:
        """Free everything ``sess`` holds (tick thread only)."""
        if sess.sid in self.stage0.sessions or self.stage0.is_prefilling(sess.sid):
            self.stage0.close_session(sess.sid)
        sess.opened = False
        self.code2wav_stage.drop_turn(sess)
        sess.encoder_state = None

    def shutdown(self) -> None:
        """Close every session and release the engine's memory (call with no tick running)."""
        for sess in self.table.clear():
            self._free(sess)
        self._closed = True
        for graphs in (self.thinker_graphs, self.talker_graphs):
            if graphs is not None:
                graphs.close()
        self.stage0.use_decode_graphs(None)
        self.thinker_graphs = self.talker_graphs = self.talker_stage.graphs = None
        self.encoder_graphs = self.thinker_stage.encoder_graphs = None
        self.thinker_cache = self.talker_cache = None  # type: ignore[assignment]
        self.recorder.talker_block_bytes = 0   # the Talker pool is gone
        logger.info("engine shut down")

    def stats(self) -> EngineStats:
        return dataclasses.replace(self._stats(), reference_voices=len(self.reference_voices),
                                   reference_voices_added=self.reference_voices.added,
                                   reference_voice_reuses=self.reference_voices.reuses)

    def _stats(self) -> EngineStats:
        return self.recorder.snapshot(
            {"thinker": self.thinker_graphs, "talker": self.talker_graphs}, self._warmup_captures,
            self._graph_captures_total(), self.warmup_report.seconds if self.warmup_report is not None else None,
            self.encoder_graphs.stats.replays if self.encoder_graphs is not None else 0)

    # ------------------------------------------------------------------ views kept for callers and tests

    @property
    def policy(self) -> Any:
        """The speak policy (settable: tests swap it; the Thinker stage reads this one)."""
        return self.thinker_stage.policy

    @policy.setter
    def policy(self, policy: Any) -> None:
        self.thinker_stage.policy = policy

    @property
    def _sessions(self) -> dict[str, EngineSession]:
        return self.table.live

    @property
    def _ticks(self) -> int:
        return self.recorder.ticks

    @property
    def late_ticks(self) -> int:
        return self.recorder.late_ticks

    @late_ticks.setter
    def late_ticks(self, value: int) -> None:
        self.recorder.late_ticks = value

    @property
    def code2wav_peak(self) -> TierBytes:
        return self.recorder.code2wav_peak
