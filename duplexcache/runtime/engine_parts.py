"""The engine's parts, wired from the deploy config and the memory plan: the one place that
reads the engine's switches and builds its parts from them (the numerics mode, the speak
policy, the scheduler with the tick's limits, the reference voices; and, for a re-plan again,
the pools, the graphs and the stages over them); the order of a tick's stages; and the
registration of voices made from clients' recordings.

Functions of a ``DuplexEngine`` (runtime/engine.py): the engine calls them at start, the warm-up
at a re-plan (runtime/warmup.py); nothing else builds these parts. The engine reads no switch
itself (tests/test_package_structure.py): it hands ``deploy`` to the builders here and holds what
they return.
"""

from __future__ import annotations

import functools
import gc
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import record_function

from duplexcache.config import DeployConfig
from duplexcache.context import EmbeddingResult, EncoderPath
from duplexcache.kv.decode_graphs import PagedDecodeGraphs
from duplexcache.kv.kv_quant import kv_storage_dtype
from duplexcache.models.audio_encoder_graphs import EncoderGraphs
from duplexcache.models.batch_invariant import BatchInvariantMode, tile_rows_for
from duplexcache.runtime.memory import device_setup
from duplexcache.runtime.memory.admission import AdmissionLedger, MemoryPlan
from duplexcache.runtime.stages.code2wav_stage import Code2WavStage
from duplexcache.runtime.engine_api import AudioDelta, EngineEvent, SessionError
from duplexcache.runtime.engine_session import EngineSession, SessionTable, Unit, ended
from duplexcache.runtime.engine_stats import EngineStatsRecorder
from duplexcache.runtime.isolation import FaultInjector
from duplexcache.runtime.policy import ControlTokens, DecisionPolicy, make_policy
from duplexcache.runtime.reference_voices import ReferenceVoices
from duplexcache.runtime.scheduler.core import Scheduler
from duplexcache.runtime.stages.talker_stage import TalkerStage
from duplexcache.runtime.stages.thinker_stage import ThinkerStage
from duplexcache.runtime.stages.vision_stage import VisionStage, engine_vision
from duplexcache.runtime.voices import Voice

if TYPE_CHECKING:
    from duplexcache.runtime.engine import DuplexEngine

logger = logging.getLogger("duplexcache.runtime.engine")   # the engine's lines: one logger name

STAGE_RANGE = "duplexcache.stage."   # profiler range prefix of each tick stage (bench/tick_profile.py)


def numerics_mode(deploy: DeployConfig, device: torch.device) -> BatchInvariantMode | None:
    """``engine.batch_invariant``: the mode every model call of a tick, prefill, warm-up and
    fast-forward runs in (graphs captured at warm-up bake its tiles in); None: plain kernels."""
    return BatchInvariantMode(tile_rows_for(device)) if deploy.engine.batch_invariant else None


def build_policy(deploy: DeployConfig, control: ControlTokens, text_ids: torch.Tensor) -> DecisionPolicy:
    """The speak policy ``engine.speak_policy`` names (the Thinker stage holds it)."""
    return make_policy(deploy.engine.speak_policy, control, text_ids)


def build_scheduler(engine: DuplexEngine) -> Scheduler:
    """Which sessions run in which tick, and when (runtime/scheduler/core.py), over the engine's
    session table, with the tick's limits ``engine.tick_seconds`` and ``engine.tick_headroom``
    (the admission's tick-cost model); a server sets its pacing (``set_unit_alignment`` ...)."""
    enc, e = engine.models.audio_encoder, engine.deploy.engine
    return Scheduler(engine.table, e.tick_seconds, e.tick_headroom, engine.models.device, enc.cfg.chunk_samples,
                     lambda s: enc.expected_chunk_samples(s.encoder_state), engine._would_answer)


def build_reference_voices(engine: DuplexEngine) -> ReferenceVoices:
    """Voices from clients' reference recordings, made on first sight and shared after; at most
    ``engine.max_reference_voices`` held (runtime/reference_voices.py)."""
    return ReferenceVoices(engine.deploy.engine.max_reference_voices, engine.voices.get("default"),
                           functools.partial(register_voice, engine), functools.partial(unregister_voice, engine),
                           functools.partial(voices_in_use, engine))


def build_session_side(engine: DuplexEngine, plan: MemoryPlan, policy: Any,
                       faults: FaultInjector | None = None) -> None:
    """The plan's ledger, pools, graphs and the stages over them: everything sized by the
    plan, built at start and again by a re-plan after a measured warm-up (``warmup``). The
    session table (and what a server set on it) is kept; a re-plan runs with no session."""
    engine.plan = plan
    engine.ledger = AdmissionLedger(plan)
    if engine.models.device.type == "cuda":
        # The warm-up's activation peak is measured from here (runtime/warmup.py).
        torch.cuda.synchronize(engine.models.device)
        torch.cuda.reset_peak_memory_stats(engine.models.device)
        engine.reserved_before_pools = torch.cuda.memory_reserved(engine.models.device)
    else:
        engine.reserved_before_pools = 0
    build_pools(engine)
    if engine.table is None:
        engine.table = SessionTable(engine.ledger)
    else:
        assert not engine.table.live and not engine.table.queue, "re-plan with sessions open"
        engine.table.ledger = engine.ledger
    models, deploy = engine.models, engine.deploy
    engine.recorder = EngineStatsRecorder(engine.table, engine.stage0, engine.talker_kv,
                                          engine.talker_cache.bytes_per_block, engine.code2wav, engine.voices.names(),
                                          engine.builder, plan.dynamic_bytes)
    engine.latency_history = engine.recorder.latency_history   # per stage, the last LATENCY_HISTORY ticks
    engine.code2wav_stage = Code2WavStage(engine.code2wav, engine.talker_kv, engine.control, engine.table, engine._end,
                                          engine.recorder.note_code2wav_peak)
    engine.talker_stage = TalkerStage(models.talker, engine.talker_cache, engine.talker_kv, engine.talker_graphs,
                                      engine.control, engine.code2wav_stage, engine._end,
                                      engine.sizing.talker_turn_tokens, ragged_graphs=engine.stage0.ragged_graphs)
    engine.thinker_stage = ThinkerStage(engine.stage0, models.audio_encoder, engine.builder, models.tokenizer,
                                        engine.control, policy, engine._embed_tokens, engine.table, engine._end,
                                        deploy.engine.prefill_chunk_tokens,
                                        kv_storage_dtype(deploy.precision.encoder_cache_dtype), engine.encoder_graphs)
    # model.vision: camera frames of video sessions, one batched call per tick (stages/vision_stage.py)
    vision = engine_vision(deploy, models)
    engine.vision_stage = None if vision is None else VisionStage(vision, engine._embed_tokens, models.tokenizer,
                                                                  engine._end)
    engine.thinker_stage.frame_tokens = engine.sizing.frame_tokens
    if faults is not None:
        engine.install_faults(faults)


def release_session_side(engine: DuplexEngine) -> None:
    """Drop the pools and the graphs over them (a re-plan), so their memory can be freed."""
    for graphs in (engine.thinker_graphs, engine.talker_graphs):
        if graphs is not None:
            graphs.close()
    engine.stage0.use_decode_graphs(None)
    engine.thinker_graphs = engine.talker_graphs = engine.encoder_graphs = None
    for name in ("talker_stage", "thinker_stage", "code2wav_stage", "recorder", "stage0", "thinker_manager",
                 "thinker_cache", "talker_cache", "talker_kv", "talker_pool"):
        setattr(engine, name, None)
    gc.collect()
    if engine.models.device.type == "cuda":
        torch.cuda.synchronize(engine.models.device)
        torch.cuda.empty_cache()

def release_graphs_and_pools(engine: DuplexEngine) -> None:
    """At shutdown, after every session was freed: close the graphs, drop the KV pools."""
    for graphs in (engine.thinker_graphs, engine.talker_graphs):
        if graphs is not None:
            graphs.close()
    engine.stage0.use_decode_graphs(None)
    engine.thinker_graphs = engine.talker_graphs = engine.talker_stage.graphs = None
    engine.encoder_graphs = engine.thinker_stage.encoder_graphs = None
    engine.thinker_cache = engine.talker_cache = None  # type: ignore[assignment]
    engine.recorder.talker_block_bytes = 0   # the Talker pool is gone


def build_pools(engine: DuplexEngine) -> None:
    # stage0.window: the Thinker window Stage 0 holds (engine.stage0.window; a session may lower its marks)
    window = device_setup.window_config(engine.deploy.stage0)
    kv = device_setup.build_kv_pools(engine.models, engine.plan, engine.deploy.stage0, window,
                                     kv_storage_dtype(engine.deploy.precision.kv_cache_dtype),
                                     batch_invariant=engine.deploy.engine.batch_invariant)
    engine.thinker_cache, engine.thinker_manager, engine.stage0 = kv.thinker_cache, kv.thinker_manager, kv.stage0
    engine.talker_cache, engine.talker_kv = kv.talker_cache, kv.talker_kv
    engine.talker_pool = engine.talker_kv.pool   # read by tests and stats; only talker_kv mutates it
    engine.thinker_graphs: PagedDecodeGraphs | None = None
    engine.talker_graphs: PagedDecodeGraphs | None = None
    # ``engine.cuda_graphs``: the one-token steps replay CUDA graphs, and the short ragged steps
    # (a unit's append, the Talker's condition) the same graphs as token rows when the in-place
    # kernel runs them (``stage0.ragged_kernel``; off, its reference attention runs them eagerly).
    graphs_on = engine.deploy.engine.cuda_graphs
    ragged_steps = graphs_on and engine.deploy.stage0.ragged_kernel
    if graphs_on and engine._can_capture_decode():
        engine.thinker_graphs, engine.talker_graphs = device_setup.make_decode_graphs(
            engine.models, kv, engine.plan.planned_sessions, engine.sizing.talker_turn_tokens,
            capture=engine.models.device.type == "cuda", ragged_steps=ragged_steps)
    engine.stage0.use_decode_graphs(engine.thinker_graphs, ragged_steps=ragged_steps)
    # The switch is CUDA-only and on by default: off CUDA that it cannot act is expected (info),
    # on CUDA a misconfiguration (warning, from device_setup.decode_graphs_supported).
    cannot_act = logger.warning if engine.models.device.type == "cuda" else logger.info
    if graphs_on and engine.thinker_graphs is not None and not ragged_steps:
        logger.info("engine.cuda_graphs with stage0.ragged_kernel off: short ragged steps run eagerly")
    engine.encoder_graphs: EncoderGraphs | None = None
    if graphs_on:
        if engine._can_capture_encoder():
            engine.encoder_graphs = EncoderGraphs(
                engine.models.audio_encoder, max_batch=device_setup.graph_batch(engine.plan.planned_sessions),
                storage_dtype=kv_storage_dtype(engine.deploy.precision.encoder_cache_dtype),
                capture=engine.models.device.type == "cuda")
            # from the activation reserve, as the decode graphs' buffers: the eager tick's
            # gather buffer at its largest, held for good
            logger.info("encoder graphs: %.1f MiB of static buffers", engine.encoder_graphs.nbytes() / 2**20)
        else:
            cannot_act("engine.cuda_graphs needs a CUDA device; the audio encoder runs eagerly")


def run_units(engine: DuplexEngine, units: list[Unit], lat: dict[str, float]) -> list[EngineEvent]:
    # Each stage runs inside a profiler range named STAGE_RANGE + stage, so a torch.profiler
    # trace (`bench ticks --profile-ticks`) charges kernels to the stage that launched them.
    events: list[EngineEvent] = []
    t = time.perf_counter()
    with record_function(STAGE_RANGE + "encoder"):
        units, embeds = engine.thinker_stage.encode(units, events)
    lat["encoder"] = time.perf_counter() - t
    if engine.vision_stage is not None and any(u.frame is not None for u in units):
        t = time.perf_counter()
        with record_function(STAGE_RANGE + "vision"):
            units = engine.vision_stage.run(units, events)
        lat["vision"] = time.perf_counter() - t
    t = time.perf_counter()
    with record_function(STAGE_RANGE + "thinker"):
        units = engine.thinker_stage.run(units, embeds, events) if units else []
    lat["thinker"] = time.perf_counter() - t
    engine.table.note_reply_units(units, engine.control)
    events += engine.thinker_stage.text_events(units)
    # Text-only sessions (audio_output off) stop here: their replies are their text, and
    # their units never enter the Talker or Code2Wav.
    events += engine.thinker_stage.end_text_replies([u for u in units if not u.session.config.audio_output])
    voiced = [u for u in units if u.session.config.audio_output]
    # A stage that had nothing to do this tick records 0 (not a sample).
    t = time.perf_counter()
    with record_function(STAGE_RANGE + "talker"):
        finals = engine.talker_stage.run(voiced, events)
    units = [u for u in units if u.session.sid not in ended(events)]
    voiced = [u for u in voiced if u.session.sid not in ended(events)]
    if any(u.codes is not None for u in voiced):
        lat["talker"] = time.perf_counter() - t
    t = time.perf_counter()
    with record_function(STAGE_RANGE + "code2wav"):
        audio = engine.code2wav_stage.run(voiced, finals)
    if any(isinstance(e, AudioDelta) for e in audio):
        lat["code2wav"] = time.perf_counter() - t
    events += audio
    for u in units:
        u.session.unit_index += 1
    return events


def graph_captures_total(engine: DuplexEngine) -> int:
    """Decode-graph keys first used (captures on CUDA) + Code2Wav graphs captured."""
    decode = sum(g.stats.first_uses for g in (engine.thinker_graphs, engine.talker_graphs, engine.encoder_graphs)
                 if g is not None)
    return decode + engine.code2wav.graph_stats.captures + engine.code2wav.vocoder_graph_stats.captures


def encode_reference_audio(engine: DuplexEngine, audio: torch.Tensor) -> EmbeddingResult:
    """Whole-clip encode (touches no per-session streaming state); counted for metrics/tests."""
    engine.reference_encodes += 1
    with torch.no_grad():
        emb = engine.models.audio_encoder.embed_audio(audio)
    return EmbeddingResult(emb.to(engine.models.dtype), EncoderPath.WHOLE_CLIP)


def install_faults(engine: DuplexEngine, faults: FaultInjector | None) -> None:
    """Make chosen stages raise for chosen sessions (a test hook, runtime/isolation.py)."""
    engine.faults = faults
    for part in (engine.stage0, engine.thinker_stage, engine.talker_stage, engine.code2wav_stage, engine.vision_stage):
        if part is not None:
            part.faults = faults


def apply_cancels(engine: DuplexEngine) -> list[EngineEvent]:
    """Cancels recorded since the last tick, at this unit boundary (before any unit runs)."""
    events: list[EngineEvent] = []
    for sess, played_ms in engine.table.take_cancels():
        try:
            events += engine.thinker_stage.cancel_reply(sess, played_ms, engine.code2wav_stage.drop_turn)
        except Exception as err:  # noqa: BLE001 - a failed rewind ends its session only
            events.append(engine._end(sess, err))
    return events


def end_session(engine: DuplexEngine, sess: EngineSession, err: Exception) -> SessionError:
    """End a session the engine cannot continue (it owns nothing afterwards)."""
    code = getattr(err, "code", "engine_error")
    logger.info("session %s ended: %s", sess.sid, err)
    engine.table.remove(sess.sid)
    free_session(engine, sess)
    return SessionError(sess.sid, code, str(err), fatal=True)


def free_session(engine: DuplexEngine, sess: EngineSession) -> None:
    """Free everything ``sess`` holds (tick thread only)."""
    if sess.sid in engine.stage0.sessions or engine.stage0.is_prefilling(sess.sid):
        engine.stage0.close_session(sess.sid)
    sess.opened = False
    engine.code2wav_stage.drop_turn(sess)
    sess.encoder_state = None


def register_voice(engine: DuplexEngine, voice: Voice) -> None:
    # Under the tick lock: the prompt pass and the encoder run use the models a tick uses
    # (and their numerics: engine.batch_invariant).
    with engine._tick_lock, engine._numerics():
        before = engine._graph_captures_total()
        embeddings = engine.sizing.count_ref_embeddings(voice)
        engine.code2wav.register_voice(voice.name, voice.prompt_tokens, voice.prompt_mel, voice.spk)
        engine.sizing.ref_embeddings[voice.name] = embeddings
        engine.voices.add(voice, listed=False)
        engine.recorder.voice_names.append(voice.name)
        # captured outside any tick (as at start): not a capture inside a tick
        engine._warmup_captures += engine._graph_captures_total() - before
        engine.recorder.refresh_pools()

def unregister_voice(engine: DuplexEngine, name: str) -> None:
    with engine._tick_lock:
        engine.voices.remove(name)
        engine.code2wav.unregister_voice(name)
        engine.sizing.ref_embeddings.pop(name, None)
        engine.recorder.voice_names.remove(name)
        engine.recorder.refresh_pools()

def voices_in_use(engine: DuplexEngine) -> set[str]:
    table = engine.table
    with table.lock:
        return {s.voice.name for s in (*table.live.values(), *table.queue.values(), *table.closing)}
