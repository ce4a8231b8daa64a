"""Engine tick benchmark: per-stage tick latency of the duplex engine at several session counts.

How it measures and what its figures mean: docs/bench_methods.md, "duplexcache bench ticks".
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from duplexcache.bench import floor as fl
from duplexcache.bench import video
from duplexcache.bench import workload as wl
from duplexcache.bench.common import alias_main, hardware_line, sync, usage_error, write_results
from duplexcache.bench.engine_ticks_config import TickBenchConfig, config_from_args, make_deploy
from duplexcache.bench.engine_ticks_config import add_arguments as add_config_arguments
from duplexcache.bench.engine_ticks_report import (
    SHAPE_SUMS,
    STAGES,
    per_session_costs,
    report_markdown,
    session_floor,
    summarize,
)
from duplexcache.bench.fast_forward import fast_forward_session
from duplexcache.bench.tick_profile import profile_ticks, profiled_units
from duplexcache.config import DeployConfig, format_bytes
from duplexcache.runtime.bundle import ModelBundle, build_models
from duplexcache.runtime.engine import DuplexEngine
from duplexcache.runtime.engine_api import (
    INPUT_SAMPLE_RATE,
    AdmissionError,
    AudioDelta,
    SessionError,
    TextDelta,
)
from duplexcache.runtime.voices import VoiceRegistry

logger = logging.getLogger(__name__)

REALTIME_S = 1.0  # one tick is one 1-second unit: slower than this falls behind the audio
VOICES = ("default", "alt")
INSTRUCTIONS = "You are a friendly voice assistant. Keep every answer short."

EngineFactory = Callable[[DeployConfig, ModelBundle], DuplexEngine]


# --------------------------------------------------------------------------------------------
# Inputs and statistics
# --------------------------------------------------------------------------------------------

def session_audio(index: int, units: int, first: int, unit: int, seed: int = 0) -> np.ndarray:
    """``units`` units of 16 kHz input for session ``index``: a tone (pitch per session) plus
    seeded noise, float32 in [-0.5, 0.5]."""
    n = first + unit * (units - 1)
    t = np.arange(n, dtype=np.float64) / INPUT_SAMPLE_RATE
    tone = 0.2 * np.sin(2 * math.pi * (180.0 + 35.0 * index) * t)
    noise = np.random.default_rng(seed * 100_003 + index).uniform(-0.1, 0.1, n)
    return (tone + noise).astype(np.float32)


# --------------------------------------------------------------------------------------------
# One session count
# --------------------------------------------------------------------------------------------

@dataclass
class RunResult:
    """One session count. ``status``: ok | refused | oom | error | stopped | skipped."""

    sessions: int
    status: str = "ok"
    note: str = ""
    admitted: int = 0
    planned_sessions: int | None = None
    per_tick: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in (*STAGES, "wall")})
    text_sessions: list[int] = field(default_factory=list)   # sessions with text, per recorded tick
    scheduled_speakers: list[int] = field(default_factory=list)   # sessions the workload says speak, per recorded tick
    schedule_mismatches: list[str] = field(default_factory=list)  # ticks (warm-up included) off the schedule
    audio_chunks: list[int] = field(default_factory=list)
    session_errors: int = 0
    late_ticks: int = 0
    decode_graph_steps: dict[str, int] = field(default_factory=dict)   # over the recorded ticks
    ragged_graph_steps: dict[str, int] = field(default_factory=dict)   # over the recorded ticks
    warmup_s: float | None = None          # DuplexEngine.warmup() (None: not run)
    warmup_graphs: int | None = None
    tick_graph_captures: int = 0           # graphs captured inside recorded ticks (0 when warm)
    max_memory_allocated: int | None = None
    memory_allocated_after: int | None = None   # after the engine was freed: should be the weights
    seconds: float = 0.0
    profile: dict[str, Any] | None = None   # --profile-ticks: bench/tick_profile.summarize_profile
    video: dict[str, Any] | None = None     # --video-share: video sessions and bytes per session (bench/video.py)
    # The shapes the recorded ticks ran, summed over sessions before each tick (the floor's TickShape)
    shape_sums: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in SHAPE_SUMS})

    @property
    def all_under_1s(self) -> bool | None:
        """Every recorded tick (synchronised wall clock) under 1 s; None when nothing ran."""
        if self.status != "ok" or not self.per_tick["wall"]:
            return None
        return max(self.per_tick["wall"]) < REALTIME_S

    def to_dict(self) -> dict[str, Any]:
        return {"sessions": self.sessions, "status": self.status, "note": self.note, "admitted": self.admitted,
                "planned_sessions": self.planned_sessions, "recorded_ticks": len(self.per_tick["wall"]),
                "stages_s": {s: summarize(v) for s, v in self.per_tick.items()},
                "all_ticks_under_1s": self.all_under_1s, "per_tick_s": self.per_tick,
                "text_sessions_per_tick": self.text_sessions, "scheduled_speakers_per_tick": self.scheduled_speakers,
                "schedule_mismatches": self.schedule_mismatches, "audio_chunks_per_tick": self.audio_chunks,
                "session_errors": self.session_errors, "late_ticks": self.late_ticks,
                "decode_graph_steps": self.decode_graph_steps, "ragged_graph_steps": self.ragged_graph_steps,
                "warmup_s": self.warmup_s,
                "warmup_graphs": self.warmup_graphs, "tick_graph_captures": self.tick_graph_captures,
                "max_memory_allocated": self.max_memory_allocated,
                "memory_allocated_after": self.memory_allocated_after, "seconds": round(self.seconds, 3),
                "profile": self.profile, "shape_sums_per_tick": self.shape_sums, "video": self.video}


class _Deadline:
    def __init__(self, start: float, max_seconds: float) -> None:
        self.start, self.max_seconds = start, max_seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def passed(self) -> bool:
        return self.elapsed() >= self.max_seconds


def session_voices(cfg: TickBenchConfig, n: int, available: list[str]) -> list[str]:
    """``default``/``alt`` alternating; the conversation workload draws from every voice."""
    if cfg.workload == "conversation":
        return wl.pick_voices(n, available, cfg.seed)
    return [VOICES[i % len(VOICES)] for i in range(n)]


def _open_all(eng: DuplexEngine, n: int, res: RunResult, cfg: TickBenchConfig) -> list[str]:
    """Open ``n`` sessions; on the first refusal record it and return what was admitted."""
    sids: list[str] = []
    for i, voice in enumerate(session_voices(cfg, n, eng.voices.names())):
        session = {"voice": voice, "instructions": INSTRUCTIONS}
        if video.is_video(i, cfg.video_share):
            session["video"] = True
        try:
            sids.append(eng.open_session(session))
        except AdmissionError as exc:
            res.status, res.note = "refused", f"admitted {len(sids)} of {n}: {exc.reason}"
            logger.info("n=%d: admission refused after %d sessions: %s", n, len(sids), exc.reason)
            break
    res.admitted = len(sids)
    return sids


class _Feed:
    """Each session's workload script and input, fed one unit per tick as a real-time client does."""

    def __init__(self, eng: DuplexEngine, cfg: TickBenchConfig, sids: list[str], units: int) -> None:
        enc = eng.models.audio_encoder.cfg
        if (enc.first_chunk_samples, enc.chunk_samples) != (wl.FIRST_UNIT_SAMPLES, wl.UNIT_SAMPLES):
            raise ValueError(f"the workload's units ({wl.FIRST_UNIT_SAMPLES}, {wl.UNIT_SAMPLES} samples) differ "
                             f"from the encoder's ({enc.first_chunk_samples}, {enc.chunk_samples})")
        self.cfg, self.sids = cfg, sids
        self.scripts = [cfg.script(i, sid, units) for i, sid in enumerate(sids)]
        # turns/continuous keep the tone-plus-noise input of earlier runs
        self.tones = None if cfg.workload == "conversation" else \
            [session_audio(i, units, enc.first_chunk_samples, enc.chunk_samples, cfg.seed) for i in range(len(sids))]
        self.unit = 0

    def _audio(self, i: int, u: int) -> np.ndarray:
        if self.tones is None:
            return wl.unit_audio(self.scripts[i], i, u, self.cfg.seed)
        start = 0 if u == 0 else wl.FIRST_UNIT_SAMPLES + (u - 1) * wl.UNIT_SAMPLES
        return self.tones[i][start:start + wl.unit_samples(u)]

    def push(self, eng: DuplexEngine) -> set[str]:
        """Push the next unit to every live session; returns the sessions scheduled to speak in it."""
        live = set(eng.session_ids())
        speakers = set()
        for i, sid in enumerate(self.sids):
            if sid not in live:
                continue   # the engine ended it; counted as a session error already
            if video.is_video(i, self.cfg.video_share):   # its second's frame first: it rides with this unit
                eng.push_frame(sid, video.frame_jpeg(i, self.unit))
            eng.push_audio(sid, self._audio(i, self.unit))
            if self.scripts[i].speaks[self.unit]:
                speakers.add(sid)
        self.unit += 1
        return speakers


def _run_tick(eng: DuplexEngine, feed: _Feed, res: RunResult, device: torch.device) -> tuple[list, float, set[str]]:
    """Feed one unit, tick (synchronised wall clock around ``tick()`` only), check the schedule."""
    scheduled = feed.push(eng)
    sync(device)
    t0 = time.perf_counter()
    events = eng.tick()
    sync(device)
    wall = time.perf_counter() - t0
    res.session_errors += sum(isinstance(e, SessionError) for e in events)
    spoke = {e.sid for e in events if isinstance(e, TextDelta)}
    if spoke != scheduled:
        res.schedule_mismatches.append(f"unit {feed.unit - 1}: {len(spoke)} sessions spoke, "
                                       f"{len(scheduled)} scheduled")
    return events, wall, scheduled


def _sample_shape(eng: DuplexEngine, feed: _Feed, res: RunResult) -> None:
    """What each live session's coming tick attends over (read before the tick), summed into
    ``res.shape_sums``: the time floor is computed for these shapes."""
    models = eng.models
    unit_tokens = fl.talker_unit_tokens(models.talker.config)
    turn = eng.sizing.talker_turn_tokens
    live = set(eng.session_ids())
    sums = dict.fromkeys(SHAPE_SUMS, 0.0)
    for i, sid in enumerate(feed.sids):
        if sid not in live:
            continue
        info = eng.session_info(sid)
        sums["sessions"] += 1
        sums["thinker_window_tokens"] += info.thinker_tokens - info.thinker_anchor_tokens
        sums["encoder_cache_frames"] += fl.encoder_cache_frames_at(info.units, models.audio_encoder.cfg)
        sums["prompt_frames"] += models.voices.get(info.voice).prompt_frames
        if feed.scripts[i].speaks[feed.unit]:
            # a unit that would pass the turn's limit starts a new audio turn (runtime/stages/talker_stage.py)
            have = info.talker_tokens if info.talker_tokens + unit_tokens <= turn else 0
            sums["speakers"] += 1
            sums["talker_kv_tokens"] += have + unit_tokens / 2
    for key, value in sums.items():
        res.shape_sums[key].append(value)


def _record_tick(eng: DuplexEngine, feed: _Feed, res: RunResult, device: torch.device) -> None:
    before = eng.stats().ticks
    _sample_shape(eng, feed, res)
    events, wall, scheduled = _run_tick(eng, feed, res, device)
    st = eng.stats()
    assert st.ticks == before + 1, f"engine tick counter went {before} -> {st.ticks}"
    for stage in STAGES:
        res.per_tick[stage].append(float(st.stage_latency_s.get(stage, (0.0,))[-1]))
    res.per_tick["wall"].append(wall)
    res.text_sessions.append(len({e.sid for e in events if isinstance(e, TextDelta)}))
    res.scheduled_speakers.append(len(scheduled))
    res.audio_chunks.append(sum(isinstance(e, AudioDelta) for e in events))


def _fill_windows(eng: DuplexEngine, sids: list[str]) -> None:
    """Each live session's Thinker window to the middle of its marks (``--steady-window``)."""
    for sid in sids:
        if sid not in eng.session_ids():
            continue   # the engine ended it; counted as a session error already
        info = eng.session_info(sid)
        if not info.window.enabled:
            continue
        have = info.thinker_tokens - info.thinker_anchor_tokens
        target = max(have, (info.window.low_tokens + info.window.high_tokens) // 2)
        fast_forward_session(eng, sid, thinker_tokens=target)
    logger.info("filled %d Thinker windows to the middle of their marks", len(sids))


def _drive(eng: DuplexEngine, n: int, cfg: TickBenchConfig, res: RunResult, deadline: _Deadline,
           sids: list[str]) -> None:
    """Open (into ``sids``), feed, warm up and record; the caller closes the sessions."""
    res.planned_sessions = eng.plan.planned_sessions
    sids += _open_all(eng, n, res, cfg)
    if cfg.video_share > 0:
        res.video = {"sessions": sum(video.is_video(i, cfg.video_share) for i in range(len(sids))),
                     "bytes_per_session": video.video_bytes(eng)}
    if res.status == "refused":
        return
    units = cfg.warmup_ticks + cfg.ticks + (1 if cfg.steady_window else 0) + profiled_units(cfg.profile_ticks, eng.models.device)
    feed = _Feed(eng, cfg, list(sids), units)
    device = eng.models.device
    for k in range(cfg.warmup_ticks):
        if deadline.passed():
            res.status = "stopped"
            res.note = f"wall-clock budget of {cfg.max_seconds:.0f} s spent after {k} warm-up ticks"
            return
        _, wall, _ = _run_tick(eng, feed, res, device)
        logger.info("n=%d warm-up tick %d/%d: %.2f s", n, k + 1, cfg.warmup_ticks, wall)
    if cfg.steady_window:
        _fill_windows(eng, sids)
        # One more unrecorded tick: the longer block tables need decode graphs of a wider class,
        # captured on first use; the recorded ticks should show the steady cost, not the capture.
        _run_tick(eng, feed, res, device)
    late_before = eng.late_ticks
    graphs_before = dict(eng.stats().decode_graph_steps)
    ragged_before = dict(eng.stats().ragged_graph_steps)
    captures_before = eng.stats().graph_captures["tick"]
    for k in range(cfg.ticks):
        if deadline.passed():
            res.status = "stopped"
            res.note = f"wall-clock budget of {cfg.max_seconds:.0f} s spent after {k} recorded ticks"
            break
        _record_tick(eng, feed, res, device)
        logger.info("n=%d tick %d/%d: %.1f ms (wall %.1f ms), %d of %d sessions speaking", n, k + 1, cfg.ticks,
                    1e3 * res.per_tick["tick"][-1], 1e3 * res.per_tick["wall"][-1], res.text_sessions[-1], len(sids))
    res.late_ticks = eng.late_ticks - late_before
    res.tick_graph_captures = eng.stats().graph_captures["tick"] - captures_before
    res.decode_graph_steps = {k: v - graphs_before.get(k, 0) for k, v in eng.stats().decode_graph_steps.items()}
    res.ragged_graph_steps = {k: v - ragged_before.get(k, 0) for k, v in eng.stats().ragged_graph_steps.items()}
    if cfg.profile_ticks and res.status == "ok":
        # After the recorded ticks, so the profiler's overhead never reaches the latency figures.
        res.profile = profile_ticks(lambda: _run_tick(eng, feed, res, device)[1], cfg.profile_ticks, device)
        logger.info("n=%d: profiled %d ticks: %.1f ms of kernels per tick, %.1f ms wall", n, cfg.profile_ticks,
                    res.profile["device_ms_per_tick"], res.profile["wall_ms_per_tick"])
    if res.session_errors and res.status == "ok":
        res.status, res.note = "error", f"{res.session_errors} session errors during the run"
    if res.schedule_mismatches and res.status == "ok":
        # A tick whose speakers are not the scheduled ones skipped (or added) work, and its
        # latency would not be the workload's.
        res.status = "error"
        res.note = f"ticks off the workload's schedule: {'; '.join(res.schedule_mismatches[:5])}"


def run_sessions(models: ModelBundle, deploy: DeployConfig, n: int, cfg: TickBenchConfig,
                 deadline: _Deadline, engine_factory: EngineFactory = DuplexEngine) -> RunResult:
    """One session count on a fresh engine; always closes, shuts down and frees it."""
    res = RunResult(n)
    device = models.device
    t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    eng: DuplexEngine | None = None
    sids: list[str] = []
    try:
        eng = engine_factory(deploy, models)
        if cfg.warm_up:   # a no-op on CPU (no graphs to capture)
            report = eng.warmup()
            res.warmup_s, res.warmup_graphs = round(report.seconds, 3), report.graphs
            logger.info("n=%d: warm-up %.1f s, %d graphs", n, report.seconds, report.graphs)
        _drive(eng, n, cfg, res, deadline, sids)
    except torch.OutOfMemoryError as exc:
        res.status, res.note = "oom", f"out of memory: {str(exc).splitlines()[0]}"
        logger.error("n=%d: %s", n, res.note)
    except Exception as exc:  # the sweep reports the failure and stops; the traceback goes to the log
        res.status, res.note = "error", f"{type(exc).__name__}: {exc}"
        logger.exception("n=%d failed", n)
    finally:
        if device.type == "cuda":
            res.max_memory_allocated = int(torch.cuda.max_memory_allocated(device))
        if eng is not None:
            _close(eng, sids)
        del eng
        gc.collect()   # the engine's pools and graphs must be gone before the next budget check
        if device.type == "cuda":
            torch.cuda.empty_cache()
            res.memory_allocated_after = int(torch.cuda.memory_allocated(device))
    res.seconds = time.perf_counter() - t0
    return res


def _close(eng: DuplexEngine, sids: list[str]) -> None:
    try:
        for sid in sids:
            eng.close_session(sid)   # idempotent, also for sessions the engine already ended
        eng.shutdown()
    except Exception:  # cleanup must not hide the run's own result
        logger.exception("engine shutdown failed")


# --------------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------------

def largest_realtime(rows: list[RunResult]) -> int | None:
    """The largest session count tried whose every recorded tick ran under 1 s."""
    ok = [r.sessions for r in rows if r.all_under_1s]
    return max(ok) if ok else None


def _skip_reason(rows: list[RunResult], deadline: _Deadline, cfg: TickBenchConfig) -> str | None:
    if deadline.passed():
        return f"wall-clock budget of {cfg.max_seconds:.0f} s spent ({deadline.elapsed():.0f} s elapsed)"
    if not rows:
        return None
    last = rows[-1]
    if last.status in ("refused", "oom", "error", "stopped"):
        return f"n={last.sessions} ended {last.status}"
    if last.status == "skipped":
        return last.note
    return None


def run_benchmark(cfg: TickBenchConfig, out: Path | None = None, models: ModelBundle | None = None,
                  engine_factory: EngineFactory = DuplexEngine, floor_device: str = "auto") -> dict[str, Any]:
    """Build the models once (unless given), run every session count, write the report after
    each one when ``out`` is set. Returns the JSON-able results. ``floor_device``: whose peaks
    the time floor uses (``--floor-device``, bench/floor.py ``resolve_floor_device``)."""
    deadline = _Deadline(time.perf_counter(), cfg.max_seconds)
    deploy = make_deploy(cfg)
    if floor_device not in fl.FLOOR_DEVICES:
        raise ValueError(f"floor_device must be one of {', '.join(fl.FLOOR_DEVICES)}, got {floor_device!r}")
    if models is None:
        logger.info("building %s models on %s (%s)", cfg.preset, cfg.device, deploy.model.dtype)
        models = build_models(deploy, seed=cfg.seed)
        sync(models.device)
    if cfg.workload == "conversation" and len(models.voices) < wl.MIN_VOICES:
        # A copy of the registry: the caller's bundle keeps its voices (and its memory plan).
        voices = VoiceRegistry([models.voices.get(v) for v in models.voices.names()])
        models = dataclasses.replace(models, voices=voices)
        logger.info("conversation workload: voices %s", ", ".join(wl.ensure_voices(voices)))
    build_s = deadline.elapsed()
    weights_alloc = int(torch.cuda.memory_allocated(models.device)) if models.device.type == "cuda" else None
    logger.info("models ready in %.1f s (%s of weights)", build_s, format_bytes(models.weight_bytes()))
    rows: list[RunResult] = []
    results: dict[str, Any] = {}
    for n in cfg.sessions:
        reason = _skip_reason(rows, deadline, cfg)
        if reason is not None:
            logger.info("n=%d skipped: %s", n, reason)
            rows.append(RunResult(n, status="skipped", note=reason))
            continue
        logger.info("n=%d: fresh engine, %d warm-up + %d recorded ticks (%.0f s elapsed)",
                    n, cfg.warmup_ticks, cfg.ticks, deadline.elapsed())
        res = run_sessions(models, deploy, n, cfg, deadline, engine_factory)
        rows.append(res)
        _check_freed(res, weights_alloc)
        wall = summarize(res.per_tick["wall"])
        logger.info("n=%d %s in %.1f s: wall p50 %s s, max %s s, all < 1 s: %s %s", n, res.status, res.seconds,
                    _fmt(wall["p50"]), _fmt(wall["max"]), res.all_under_1s, res.note)
        results = _results(cfg, deploy, models, rows, build_s, weights_alloc, deadline, floor_device)
        if out is not None:
            write_results(out, results, report_markdown(results))
    results = _results(cfg, deploy, models, rows, build_s, weights_alloc, deadline, floor_device)
    if out is not None:
        write_results(out, results, report_markdown(results))
    return results


def _check_freed(res: RunResult, weights_alloc: int | None) -> None:
    """The next engine's budget check needs this one's pools gone; say so loudly if they are not."""
    if weights_alloc is None or res.memory_allocated_after is None:
        return
    left = res.memory_allocated_after - weights_alloc
    if left > 2**30:
        logger.warning("n=%d: %s still allocated after the engine was freed (a reference kept it alive); "
                       "the next engine's budget check may fail", res.sessions, format_bytes(left))


def _fmt(x: float | None, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def _results(cfg: TickBenchConfig, deploy: DeployConfig, models: ModelBundle, rows: list[RunResult],
             build_s: float, weights_alloc: int | None, deadline: _Deadline,
             floor_device: str = "auto") -> dict[str, Any]:
    skipped = [r.sessions for r in rows if r.status == "skipped"]
    return {
        "hardware": hardware_line(models.device),
        "config": {"preset": cfg.preset, "device": cfg.device, "dtype": deploy.model.dtype,
                   "sessions": list(cfg.sessions), "ticks": cfg.ticks, "warmup_ticks": cfg.warmup_ticks,
                   "memory_budget": (deploy.engine.memory_budget if deploy.engine.memory_budget == "auto"
                                     else format_bytes(deploy.engine.memory_budget)),
                   "activation_reserve": format_bytes(deploy.engine.activation_reserve),
                   "all_switches": cfg.all_switches, "workload": cfg.workload, "speak_policy": cfg.describe_policy(),
                   "max_seconds": cfg.max_seconds, "seed": cfg.seed, "steady_window": cfg.steady_window,
                   "cuda_graphs": deploy.engine.cuda_graphs, "ragged_kernel": cfg.ragged_kernel,
                   "warm_up": cfg.warm_up, "graph_grid": list(deploy.code2wav.graph_grid or ()),
                   "code2wav_dtype": deploy.precision.code2wav_dtype,
                   "kv_cache_dtype": deploy.precision.kv_cache_dtype,
                   "encoder_cache_dtype": deploy.precision.encoder_cache_dtype,
                   "talker_turn_tokens": deploy.engine.talker_turn_tokens,
                   "profile_ticks": cfg.profile_ticks, "floor_device": floor_device,
                   "video_share": cfg.video_share},
        "model_build_s": round(build_s, 3),
        "weight_bytes": models.weight_bytes(),
        "memory_allocated_after_build": weights_alloc,
        "largest_sessions_all_ticks_under_1s": largest_realtime(rows),
        "skipped_sessions": skipped,
        "elapsed_s": round(deadline.elapsed(), 3),
        "runs": [r.to_dict() for r in rows],
        "per_session": per_session_costs(rows, session_floor(deploy, models, rows, floor_device)),
    }


# --------------------------------------------------------------------------------------------
# Command line: duplexcache bench ticks (options: engine_ticks_config.add_arguments)
# --------------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of engine_ticks_config, and the floor's device."""
    add_config_arguments(p)
    p.add_argument("--floor-device", choices=fl.FLOOR_DEVICES, default="auto",
                   help="peak HBM bandwidth and dense FLOP/s for the per-session floor (bench/floor.py): auto "
                        "(by torch.cuda.get_device_name; none on CPU or an unknown GPU), none, or a table entry")



def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        return usage_error("ticks", exc)
    results = run_benchmark(cfg, args.out, floor_device=args.floor_device)
    print(report_markdown(results), flush=True)
    logger.info("wrote %s and %s", args.out / "results.json", args.out / "results.md")
    return 0


if __name__ == "__main__":
    sys.exit(alias_main("ticks"))
