"""Issue 49 probe: what one whole-Euler Code2Wav solve costs per graph tier, and where its kernels go.

    python scripts/probes/c2w_solve_tiers.py --out DIR [--tiers 1,4,8,16,24,32] [--profile-tiers 1,16]
                                             [--chunks 5] [--norms triton,torch]

Why: exact mode's tick at 32 sessions grows ~13-16 ms per audio chunk (docs/benchmarks.md, "Per-stage
cost per extra session"), mostly Code2Wav's float32 solve. A solve is one CUDA-graph replay per
(tier, width, cache bucket) over `tier` rows, so its cost is a fixed part (the kernels every replay
launches, whatever its rows) plus a part per row. This probe separates the two: for every tier it
opens that many streams of one voice on the minicpmo45 flow (random weights, the engine's CUDA
numerics pinned), runs them to the steady cache (P + 100 frames), then times `--chunks` more steps:
the step's wall clock (conformer + solve + vocoder, synchronised) and the solve alone (CUDA events
around the arena's replay). A least-squares line over the tiers gives ms per solve and ms per row.
At each `--profile-tiers` tier one replay runs under torch.profiler: its kernels by name (count and
device ms) and the replay's device span, so a span well above the kernels' sum is launch gaps.
`--norms` runs the sweep once per implementation of the estimator's fused steps (cfm/dit_norms.py:
the residual + LayerNorm + modulation and the q, k, v projections with their norms, as the Triton
kernels the engine runs on CUDA or as the torch operators), each on a fresh stage, in one process:
the A/B of those kernels.

Writes results.json and results.md to --out.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from duplexcache.bench.common import hardware_line, int_list, write_results
from duplexcache.bench.gpu_stage2 import chunk_tokens, stage2_models, voice
from duplexcache.cfm import BatchedCode2Wav, Code2WavConfig, Code2WavShape
from duplexcache.runtime.memory.device_setup import pin_cuda_numerics

logger = logging.getLogger(__name__)
PROMPT_FRAMES = 300


class SolveTimer:
    """Wraps the arena's `run` with CUDA events (one pair per replay); optionally profiles one."""

    def __init__(self, stage: BatchedCode2Wav) -> None:
        self.run = stage.arena.run
        self.events: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        self.profile_next = False
        self.profile: dict | None = None
        stage.arena.run = self

    def __call__(self, tier: int, width: int, max_cache_len: int) -> None:
        if self.profile_next:
            self.profile_next = False
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                self.run(tier, width, max_cache_len)
                torch.cuda.synchronize()
            self.profile = kernel_table(prof, tier)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.run(tier, width, max_cache_len)
        end.record()
        self.events.append((tier, start, end))

    def take(self) -> list[float]:
        torch.cuda.synchronize()
        out = [s.elapsed_time(e) for _, s, e in self.events]
        self.events.clear()
        return out


def kernel_table(prof, tier: int, top: int = 30) -> dict:
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name: dict[str, list[float]] = {}
    for k in kernels:
        by_name.setdefault(k.name, []).append(k.time_range.elapsed_us() / 1e3)
    rows = sorted(({"name": n[:110], "count": len(t), "ms": round(sum(t), 3)} for n, t in by_name.items()),
                  key=lambda r: -r["ms"])
    span = (max(k.time_range.end for k in kernels) - min(k.time_range.start for k in kernels)) / 1e3 if kernels else 0
    return {"tier": tier, "kernels": len(kernels), "kernel_ms": round(sum(r["ms"] for r in rows), 3),
            "span_ms": round(span, 3), "top": rows[:top]}


def run_tier(stage: BatchedCode2Wav, timer: SolveTimer, tier: int, args, vocab: int, device) -> dict:
    sids = [f"t{tier}s{i}" for i in range(tier)]
    for i, sid in enumerate(sids):
        stage.add_session(sid, "v", seed=i)
    steps, solves = [], []
    for tick in range(args.warmup + args.chunks + (1 if tier in args.profile_tiers else 0)):
        chunks = {sid: chunk_tokens(i, tick, vocab).to(device) for i, sid in enumerate(sids)}
        timed = args.warmup <= tick < args.warmup + args.chunks
        timer.profile_next = tick == args.warmup + args.chunks
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = stage.step(chunks)
        torch.cuda.synchronize()
        wall = 1000 * (time.perf_counter() - t0)
        assert not out.errors, out.errors
        solve = timer.take()
        if timed:
            steps.append(wall)
            solves.append(sum(solve))
        if tick == args.warmup + args.chunks - 1:   # the last timed step's mels, for the arms' comparison
            args.mels[tier] = torch.stack([stage.sessions[sid].last_mel.float().cpu() for sid in sids])
    for sid in sids:
        stage.remove_session(sid)
    res = {"tier": tier, "step_ms": float(np.median(steps)), "step_min_ms": float(min(steps)),
           "solve_ms": float(np.median(solves)), "solve_min_ms": float(min(solves)),
           "solve_max_ms": float(max(solves)), "n": len(steps)}
    if tier in args.profile_tiers:
        res["profile"] = timer.profile
    logger.info("tier %d: step %.1f ms, solve %.1f ms", tier, res["step_ms"], res["solve_ms"])
    return res


def fit(rows: list[dict], key: str) -> dict:
    x = np.array([r["tier"] for r in rows], float)
    y = np.array([r[key] for r in rows], float)
    if len(x) < 2:
        return {}
    slope, intercept = np.polyfit(x, y, 1)
    return {"ms_per_row": round(float(slope), 3), "ms_fixed": round(float(intercept), 3)}


def markdown(res: dict) -> str:
    lines = ["# Code2Wav solve cost per tier", "", f"hardware: {res['hardware']}", "",
             f"minicpmo45 flow, {res['dtype']}, random weights, one voice (P = {PROMPT_FRAMES}), steady cache, "
             f"{res['chunks']} timed steps per tier after {res['warmup']}; tiers {res['tiers']}", "",
             "| norms | tier | step ms (median / min) | solve ms (median / min / max) | solve ms per row |",
             "|---|---:|---|---|---:|"]
    for arm in res["arms"]:
        for r in arm["rows"]:
            lines.append(f"| {arm['norms']} | {r['tier']} | {r['step_ms']:.1f} / {r['step_min_ms']:.1f} | "
                         f"{r['solve_ms']:.1f} / {r['solve_min_ms']:.1f} / {r['solve_max_ms']:.1f} | "
                         f"{r['solve_ms'] / r['tier']:.2f} |")
    lines.append("")
    lines += [f"least squares over the tiers, norms {arm['norms']}: solve {arm['fit_solve']}, step {arm['fit_step']}"
              for arm in res["arms"]]
    if "mel_rel_l2_between_arms" in res:
        lines += ["", f"mel relative L2 between the arms, per tier: {res['mel_rel_l2_between_arms']}"]
    for arm in res["arms"]:
        lines += _profiles(arm)
    return "\n".join(lines) + "\n"


def _profiles(arm: dict) -> list[str]:
    lines = []
    for r in arm["rows"]:
        p = r.get("profile")
        if not p:
            continue
        lines += ["", f"## One replay at tier {p['tier']} under torch.profiler (norms {arm['norms']})", "",
                  f"{p['kernels']} kernels, {p['kernel_ms']:.1f} ms of kernels in a {p['span_ms']:.1f} ms span", "",
                  "| kernel | count | ms |", "|---|---:|---:|"]
        lines += [f"| `{k['name']}` | {k['count']} | {k['ms']:.2f} |" for k in p["top"]]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--tiers", type=int_list("--tiers"), default="1,4,8,16,24,32")
    ap.add_argument("--profile-tiers", type=int_list("--profile-tiers"), default="1,16")
    ap.add_argument("--chunks", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=8, help="steps before timing (7 reach the P + 100 cache)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--norms", default="triton,torch", help="arms: the fused kernel (triton) and/or torch")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not torch.cuda.is_available():
        logger.error("this probe times CUDA-graph replays: it needs a CUDA device")
        return 2
    device = torch.device("cuda")
    pin_cuda_numerics(device)
    _, _, flow, hift = stage2_models("minicpmo45", device, args.seed)
    tiers = tuple(sorted(set(args.tiers)))
    res = {"hardware": hardware_line(device), "dtype": "float32", "tiers": list(tiers), "chunks": args.chunks,
           "warmup": args.warmup, "arms": []}
    mels = {}
    for norms in args.norms.split(","):
        args.mels = mels.setdefault(norms, {})
        cfg = Code2WavConfig(shape=Code2WavShape.from_flow(flow), max_num_seqs=max(tiers), prompt_att_sharing=True,
                             graph_grid=tiers, max_prompt_frames=PROMPT_FRAMES, use_cuda_graphs=True)
        stage = BatchedCode2Wav(flow, hift, cfg, dit_norms=norms)
        stage.register_voice("v", *voice(PROMPT_FRAMES, args.seed, flow.vocab_size))
        timer = SolveTimer(stage)
        rows = [run_tier(stage, timer, t, args, flow.vocab_size, device) for t in tiers]
        res["arms"].append({"norms": stage.arena.dit_norms, "rows": rows, "fit_solve": fit(rows, "solve_ms"),
                            "fit_step": fit(rows, "step_ms")})
        del stage, timer
        torch.cuda.empty_cache()
        write_results(args.out, res, markdown(res))
    if len(mels) == 2:   # the two arms' mels (same sessions, tokens and noise): relative L2 per tier
        a, b = mels.values()
        res["mel_rel_l2_between_arms"] = {t: float((a[t] - b[t]).norm() / b[t].norm()) for t in a}
        write_results(args.out, res, markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
