"""The engine tick benchmark's Markdown report (results.md).

Split out of engine_ticks.py; reads only the JSON-able results dict that
``engine_ticks.run_benchmark`` returns.
"""

from __future__ import annotations

from typing import Any

from duplexcache.bench.tick_profile import profile_markdown

STAGES = ("encoder", "vision", "thinker", "talker", "code2wav", "tick")   # the engine's stages, in tick order


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
        f"decode CUDA graphs {'on' if c.get('decode_cuda_graphs') else 'off'}; "
        f"ragged kernel {'on' if c.get('ragged_kernel') else 'off'}; "
        f"ragged step graphs {'on' if c.get('ragged_step_graphs') else 'off'}; "
        f"encoder graphs {'on' if c.get('encoder_cuda_graphs') else 'off'}; "
        f"Code2Wav graph grid {c.get('graph_grid') or 'none (every tier)'}, "
        f"{c.get('code2wav_dtype', 'float32')}; KV {c.get('kv_cache_dtype', 'auto')}; encoder cache {c.get('encoder_cache_dtype', 'auto')}; "
        f"Talker turn {c.get('talker_turn_tokens') or 'model limit'}; "
        f"warm-up before the ticks {'on' if c.get('warm_up') else 'off'}  ",
        f"{c['warmup_ticks']} warm-up + {c['ticks']} recorded ticks per session count; models built once in "
        f"{results['model_build_s']:.1f} s; whole run {results['elapsed_s']:.1f} s "
        f"(budget {c['max_seconds']:.0f} s)", "",
        "Per stage: p50 / p99 / max in ms over the recorded ticks where the stage ran (the engine's "
        "timers, no device sync inside a tick). `wall`: synchronised wall clock around `tick()`, the "
        "figure the 1 s test uses.", "",
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
