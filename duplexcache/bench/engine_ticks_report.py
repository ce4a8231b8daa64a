"""The engine tick benchmark's report: results.md, and the per-stage cost per extra session.

Split out of engine_ticks.py. The Markdown reads only the JSON-able results dict that
``engine_ticks.run_benchmark`` returns; the per-session fit reads its ``RunResult`` rows.

Per-stage cost per extra session (``per_session`` in results.json, its own table in results.md):
over the session counts that ran ``ok`` (two or more), each stage's p50 tick ms is fitted by
least squares against the session count: the slope is the ms one more session adds to a tick,
the intercept the fixed per-tick cost, with the slope's standard error (three or more counts).
Beside it, the floor for the same shapes (bench/floor.py ``tick_floor``): one extra session's own
HBM bytes and matmul FLOPs per tick at the device's peak bandwidth and dense FLOP/s, from the
shapes the recorded ticks ran (before each recorded tick: every session's Thinker window and
encoder cache, the speakers' Talker turn length, the share of sessions speaking), the model's
dtype, ``precision.code2wav_dtype`` (the vocoder stays float32) and ``precision.kv_cache_dtype``.
``distance to floor`` = slope / floor. With ``--profile-ticks`` at every fitted count, ``profiled ticks:
span / kernels`` fits the profiled ticks alone: the slope of the stage's device span (the tick's wall for
``tick`` and ``wall``) and of its kernel ms. Both come from the same ticks, so their difference is the host
time between kernels that grows with sessions; the recorded ticks' slope beside them can differ because the
profiled ticks speak in other proportions (a tick's Code2Wav work follows its chunks). ``--floor-device``:
the peak table's entry (``auto``: by ``torch.cuda.get_device_name``; on CPU or an unknown GPU the floor's
bytes and FLOPs are still reported, its time is not).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from duplexcache.bench import floor as fl
from duplexcache.bench.tick_profile import profile_markdown
from duplexcache.config import DeployConfig
from duplexcache.kv.kv_quant import kv_storage_dtype
from duplexcache.runtime.bundle import ModelBundle
from duplexcache.runtime.engine_parts import STAGE_RANGE

if TYPE_CHECKING:
    from duplexcache.bench.engine_ticks import RunResult

STAGES = ("encoder", "vision", "thinker", "talker", "code2wav", "tick")   # the engine's stages, in tick order
# Per recorded tick, over the live sessions: how many, their Thinker window tokens (after the
# anchor), encoder cache frames and voice prompt frames; over the scheduled speakers: how many
# and the Talker KV tokens their steps attend over (mean over the unit's steps).
SHAPE_SUMS = ("sessions", "thinker_window_tokens", "encoder_cache_frames", "prompt_frames", "speakers",
              "talker_kv_tokens")
PER_SESSION_STAGES = (*STAGES, "wall")


def summarize(values: list[float]) -> dict[str, float | int | None]:
    """p50/p99/max in seconds over the ticks where the stage ran (value > 0)."""
    ran = np.asarray([v for v in values if v > 0.0], dtype=np.float64)
    if ran.size == 0:
        return {"p50": None, "p99": None, "max": None, "n": 0}
    return {"p50": float(np.percentile(ran, 50)), "p99": float(np.percentile(ran, 99)),
            "max": float(ran.max()), "n": int(ran.size)}


def _stage_cell(s: dict) -> str:
    if s["n"] == 0:
        return "-"
    return f"{s['p50'] * 1e3:.1f} / {s['p99'] * 1e3:.1f} / {s['max'] * 1e3:.1f}"


def markdown(results: dict[str, Any]) -> str:
    c = results["config"]
    lines = [
        "# Engine tick benchmark", "",
        f"hardware: {results['hardware']}  ",
        f"preset {c['preset']} on {c['device']} ({c['dtype']}), random weights, workload "
        f"{c.get('workload', 'turns')}, speak policy {c['speak_policy']}; sharing switches {'on' if c['all_switches'] else 'off'}; "
        f"budget {c['memory_budget']} (reserve {c['activation_reserve']}); Thinker windows "
        f"{'filled to (low + high) / 2 before the recorded ticks' if c.get('steady_window') else 'as the units left them'}; "
        # reports written before issue 44 name the decode graphs' switch
        f"CUDA graphs {'on' if c.get('cuda_graphs', c.get('decode_cuda_graphs')) else 'off'}; "
        f"ragged kernel {'on' if c.get('ragged_kernel') else 'off'}; "
        f"Code2Wav graph grid {c.get('graph_grid') or 'none (every tier)'}, "
        f"{c.get('code2wav_dtype', 'float32')}; KV {c.get('kv_cache_dtype', 'auto')}; encoder cache {c.get('encoder_cache_dtype', 'auto')}; "
        f"Talker turn {c.get('talker_turn_tokens') or 'model limit'}; "
        f"warm-up before the ticks {'on' if c.get('warm_up') else 'off'}  ",
        f"{c['warmup_ticks']} warm-up + {c['ticks']} recorded ticks per session count; models built once in "
        f"{results['model_build_s']:.1f} s; whole run {results['elapsed_s']:.1f} s "
        f"(budget {c['max_seconds']:.0f} s)", "",
        "Per stage: p50 / p99 / max in ms over the recorded ticks where the stage ran (the engine's "
        "timers, no device sync inside a tick: a stage's host time until the next wait, so the Talker's "
        "device tail counts in Code2Wav's, which ends with the tick's one copy of audio to the host). "
        "`wall`: synchronised wall clock around `tick()`, the figure the 1 s test uses.", "",
        "| sessions | status | " + " | ".join(f"{s} ms" for s in (*STAGES, "wall"))
        + " | all ticks < 1 s | sessions speaking per tick (min..max) | graphed decode steps (Thinker/Talker) "
        "| warm-up s (graphs) | graphs captured in recorded ticks | peak alloc GiB | left after free GiB |",
        "|---" * (len(STAGES) + 10) + "|",
    ]
    for r in results["runs"]:
        cells = [_stage_cell(r["stages_s"][s]) for s in (*STAGES, "wall")]
        under = {True: "yes", False: "no", None: "-"}[r["all_ticks_under_1s"]]
        text = f"{min(r['text_sessions_per_tick'])}..{max(r['text_sessions_per_tick'])}" \
            if r["text_sessions_per_tick"] else "-"
        mem = "-" if r["max_memory_allocated"] is None else f"{r['max_memory_allocated'] / 2**30:.2f}"
        # device memory still allocated once the engine was freed (the weights: a later engine's
        # budget sees the rest; the graph switches left ~30 GiB on the H200, docs/benchmarks.md)
        left = "-" if r.get("memory_allocated_after") is None else f"{r['memory_allocated_after'] / 2**30:.2f}"
        steps, ragged = r.get("decode_graph_steps") or {}, r.get("ragged_graph_steps") or {}
        graphed = f"{steps['thinker']}/{steps['talker']}" if steps else "-"
        if any(ragged.values()):
            graphed += f" (+{ragged['thinker']}/{ragged['talker']} ragged)"
        warm = "-" if r.get("warmup_s") is None else f"{r['warmup_s']:.1f} ({r['warmup_graphs']})"
        lines.append(f"| {r['sessions']} | {r['status']} | " + " | ".join(cells)
                     + f" | {under} | {text} | {graphed} | {warm} | {r.get('tick_graph_captures', '-')} | {mem} | {left} |")
    lines += _video_lines(results)
    best = results["largest_sessions_all_ticks_under_1s"]
    lines += ["", f"**Largest session count tried with every tick < 1 s: {best if best is not None else 'none'}**"]
    notes = [f"- n={r['sessions']}: {r['status']}: {r['note']}" for r in results["runs"] if r["note"]]
    if notes:
        lines += ["", "Notes:", *notes]
    lines += ["", *(profile_markdown(r["sessions"], r["profile"]) for r in results["runs"] if r.get("profile"))]
    return "\n".join(lines)


def _video_lines(results: dict[str, Any]) -> list[str]:
    """``--video-share``: video sessions per run and the memory plan's bytes per session."""
    rows = [r for r in results["runs"] if r.get("video")]
    if not rows:
        return []
    lines = ["", f"Video (--video-share {results['config'].get('video_share')}): a 640x480 JPEG with each unit of a "
             "video session; `vision ms` is the batched encoder + resampler call per tick. Bytes per session from the "
             "memory plan (window full, a full Talker turn, the dynamic reservation):"]
    for r in rows:
        b = r["video"]["bytes_per_session"] or {}
        lines.append(f"- n={r['sessions']}: {r['video']['sessions']} video sessions; audio "
                     f"{b.get('audio', 0) / 2**20:.1f} MiB, video {b.get('video', 0) / 2**20:.1f} MiB "
                     f"(+{b.get('frame_activation', 0) / 2**20:.1f} MiB: a frame's activations), "
                     f"{b.get('thinker_tokens_per_frame', 0)} Thinker tokens per frame")
    return lines


# --------------------------------------------------------------------------------------------
# Per-stage cost per extra session: the slope over the session counts, beside the floor
# --------------------------------------------------------------------------------------------

def fit_line(xs: list[float], ys: list[float]) -> dict[str, float | int | None]:
    """Least-squares line ``y = intercept + slope * x``: slope, intercept and the slope's
    standard error (None with fewer than 3 points, where the residuals have no freedom left).
    Needs two or more distinct x."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError(f"a line needs two or more distinct x, got {xs!r}")
    x, y = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    xm = x.mean()
    sxx = float(((x - xm) ** 2).sum())
    slope = float(((x - xm) * (y - y.mean())).sum()) / sxx
    intercept = float(y.mean() - slope * xm)
    stderr = None
    if x.size > 2:
        residual = y - (intercept + slope * x)
        stderr = math.sqrt(float((residual ** 2).sum()) / (x.size - 2) / sxx)
    return {"slope": slope, "intercept": intercept, "slope_stderr": stderr, "points": int(x.size)}


def _ok_rows(rows: list[RunResult]) -> list[RunResult]:
    return [r for r in rows if r.status == "ok" and r.per_tick["wall"]]


def tick_shape(rows: list[RunResult], models: ModelBundle) -> fl.TickShape | None:
    """The mean shapes of the recorded ticks of every ``ok`` run (session-weighted); None when none ran."""
    ok = _ok_rows(rows)
    total = {k: sum(sum(r.shape_sums[k]) for r in ok) for k in SHAPE_SUMS}
    if total["sessions"] == 0:
        return None
    n = total["sessions"]
    unit_tokens = fl.talker_unit_tokens(models.talker.config)
    talker = total["talker_kv_tokens"] / total["speakers"] if total["speakers"] else unit_tokens / 2
    return fl.TickShape(speaking_fraction=total["speakers"] / n,
                        thinker_window_tokens=total["thinker_window_tokens"] / n,
                        talker_turn_tokens=talker, prompt_frames=max(1, round(total["prompt_frames"] / n)),
                        encoder_cache_frames=total["encoder_cache_frames"] / n)


def session_floor(deploy: DeployConfig, models: ModelBundle, rows: list[RunResult], floor_device: str) -> fl.TickFloor | None:
    """The time floor of one extra session for the shapes the recorded ticks ran (None before any ran)."""
    shape = tick_shape(rows, models)
    if shape is None:
        return None
    p = deploy.precision
    return fl.tick_floor(models.thinker.config, models.talker.config, models.audio_encoder.cfg, models.flow.cfg,
                         models.hift.cfg, shape, deploy.model.dtype,
                         code2wav_dtype=p.code2wav_dtype, kv_storage_dtype=kv_storage_dtype(p.kv_cache_dtype),
                         encoder_storage_dtype=kv_storage_dtype(p.encoder_cache_dtype),
                         peak=fl.resolve_floor_device(floor_device, models.device))


def per_session_costs(rows: list[RunResult], floor: fl.TickFloor | None) -> dict[str, Any]:
    """Per stage (and ``wall``): the least-squares slope of p50 tick ms over the session counts
    that ran ``ok`` (ms per extra session per tick), its intercept (fixed ms per tick) and
    standard error, beside the floor (``tick`` and ``wall``: the four stages' sum) and
    ``distance_to_floor`` = slope / floor."""
    ok = _ok_rows(rows)
    stages: dict[str, Any] = {}
    for stage in PER_SESSION_STAGES:
        points = [(r.sessions, summarize(r.per_tick[stage])["p50"]) for r in ok]
        points = [(n, 1e3 * p50) for n, p50 in points if p50 is not None]
        fit: dict[str, Any] = {"slope": None, "intercept": None, "slope_stderr": None, "points": len(points)}
        if len({n for n, _ in points}) >= 2:
            fit = fit_line([n for n, _ in points], [ms for _, ms in points])
        # the vision stage has no floor model (bench/floor.py): its slope stands alone
        modelled = floor is not None and (stage in ("tick", "wall") or stage in floor.work)
        floor_ms = floor.ms("tick" if stage in ("tick", "wall") else stage) if modelled else None
        distance = None if fit["slope"] is None or not floor_ms else fit["slope"] / floor_ms
        stages[stage] = {"slope_ms": fit["slope"], "intercept_ms": fit["intercept"],
                         "slope_stderr_ms": fit["slope_stderr"], "points": fit["points"],
                         "sessions": [n for n, _ in points], "p50_ms": [ms for _, ms in points],
                         "floor_ms": floor_ms, "distance_to_floor": distance,
                         "profiled_span_slope_ms": _profiled_slope(ok, stage, "span"),
                         "kernel_slope_ms": _profiled_slope(ok, stage, "kernels")}
    return {"stages": stages, "floor": None if floor is None else floor.to_json()}


def _profiled_slope(ok: list[RunResult], stage: str, what: str) -> float | None:
    """With ``--profile-ticks`` at two or more counts, the slope over the profiled ticks of the
    stage's ``span`` (its device span; ``tick``/``wall``: the profiled tick's wall) or its
    ``kernels`` (kernel ms; ``tick``/``wall``: every kernel of the tick). None without a device
    profile at every count."""
    whole = stage in ("tick", "wall")
    points = []
    for r in ok:
        prof = r.profile or {}
        if whole:
            ms = prof.get("wall_ms_per_tick" if what == "span" else "device_ms_per_tick") or None
        else:
            key = "device_span_ms" if what == "span" else "kernel_ms"
            ms = next((b[key] for b in prof.get("range_breakdown", ())
                       if b["name"] == STAGE_RANGE + stage and b.get(key)), None)
        if ms is None:
            return None
        points.append((r.sessions, ms))
    if len({n for n, _ in points}) < 2:
        return None
    return fit_line([n for n, _ in points], [ms for _, ms in points])["slope"]


def per_session_markdown(results: dict[str, Any]) -> str:
    """The per-stage cost per extra session table (appended to results.md)."""
    per = results.get("per_session") or {}
    floor = per.get("floor")
    lines = ["## Per-stage cost per extra session", "",
             "Slope of each stage's p50 tick ms over the session counts that ran ok (least squares; ± its "
             "standard error), the fixed per-tick cost (intercept), and the floor: one extra session's own HBM "
             "bytes and matmul FLOPs per tick at the device's peaks (bench/floor.py). `tick` and `wall` are "
             "compared with the four stages' floors summed.", ""]
    if floor is not None:
        dev = floor["device"]
        shape = floor["shape"]
        peak = "no device peaks (the floor's time is not claimed here)" if dev is None else \
            f"{dev['name']}: {dev['hbm_gb_s']:.0f} GB/s, " \
            + ", ".join(f"{d} {t:.1f} TFLOP/s" for d, t in dev["tflops"].items())
        lines += [f"Floor device: {peak}. Shapes of the recorded ticks: {shape['speaking_fraction']:.2f} of sessions "
                  f"speaking, Thinker window {shape['thinker_window_tokens']:.0f} tokens, Talker turn "
                  f"{shape['talker_turn_tokens']:.0f} tokens, P {shape['prompt_frames']} frames, encoder cache "
                  f"{shape['encoder_cache_frames']:.0f} frames.", ""]
    lines += ["| stage | ms per extra session (± SE) | profiled ticks: span / kernels | fixed ms per tick "
              "| sessions fitted | floor ms per session | distance to floor |", "|---|---|---|---|---|---|---|"]

    def cell(x: float | None, digits: int = 2) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    for stage, s in (per.get("stages") or {}).items():
        slope = cell(s["slope_ms"]) + ("" if s["slope_stderr_ms"] is None else f" ± {s['slope_stderr_ms']:.2f}")
        fitted = ",".join(str(n) for n in s["sessions"]) or "-"
        distance = "-" if s["distance_to_floor"] is None else f"{s['distance_to_floor']:.1f}x"
        span, kernels = s.get("profiled_span_slope_ms"), s.get("kernel_slope_ms")
        profiled = "-" if span is None and kernels is None else f"{cell(span)} / {cell(kernels)}"
        lines.append(f"| {stage} | {slope} | {profiled} | {cell(s['intercept_ms'], 1)} | {fitted} "
                     f"| {cell(s['floor_ms'], 3)} | {distance} |")
    return "\n".join(lines)


def report_markdown(results: dict[str, Any]) -> str:
    """results.md: the tick table (engine_ticks_report.markdown), then the per-session table."""
    return markdown(results) + "\n\n" + per_session_markdown(results) + "\n"
