"""Capacity-mode A/B: what ``precision.code2wav_dtype: bfloat16`` saves and what it costs.

    python scripts/probes/code2wav_precision.py --out DIR [--preset minicpmo45] [--sessions 4] [--chunks 60]
                                                [--batches 1,8,32] [--timed-chunks 10]

One process, one set of float32 flow + HiFT weights (random, redrawn as `bench stage2` does so
every path is exercised); the bfloat16 flow is a copy of the same weights rounded once, so the
two arms differ only in the number format:

* **error over a long call**: ``--sessions`` streams of ``--chunks`` chunks each (60: a minute of
  speech per session; 25 + 3 tokens per chunk, the same tokens in both arms), through
  ``BatchedCode2Wav`` with prompt sharing on. Per session: the mel's relative error against
  float32 over the whole call (Frobenius norm of the difference / norm of the float32 mel), the
  worst chunk's, the first and last ten chunks' (drift along the call), and the waveform's SNR
  (dB, signal = the float32 PCM). The vocoder runs float32 in both arms, so PCM differences come
  from the mel.
* **bytes**: each arm's private bytes per stream at steady state (`session_bytes`), the voice's
  prompt state, the arena; and the shape-only figure `code2wav_session_bytes` uses for admission.
* **time**: ms per `step` (conformer + estimator solve + vocoder, device synchronised around it)
  for each batch size of ``--batches`` at the steady cache, after ``--warmup`` chunks; median,
  min, max over ``--timed-chunks``. CUDA graphs on CUDA, eager elsewhere.

Writes results.json and results.md to --out. The error has no pass/fail threshold here: it is a
measurement reported next to the bytes it buys (docs/results/HISTORY.md, "Capacity mode").
"""

from __future__ import annotations

import argparse
import copy
import gc
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

from duplexcache.bench.common import hardware_line, int_list, sync, usage_error, write_results
from duplexcache.bench.gpu_stage2 import allocated, chunk_tokens, stage2_models, summary, voice
from duplexcache.cfm import BatchedCode2Wav, Code2WavConfig, Code2WavShape, code2wav_session_bytes
from duplexcache.models.presets import PRESETS

logger = logging.getLogger(__name__)
MIB = 2 ** 20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EDGE_CHUNKS = 10   # chunks averaged at the start and at the end of the call (drift)


def make_stage(flow: torch.nn.Module, hift: torch.nn.Module, args: argparse.Namespace,
               rows: int) -> BatchedCode2Wav:
    cfg = Code2WavConfig(shape=Code2WavShape.from_flow(flow), max_num_seqs=rows, prompt_att_sharing=True,
                         graph_grid=tuple(sorted({1, *args.batches, rows})), max_prompt_frames=args.prompt_frames,
                         use_cuda_graphs=True)
    return BatchedCode2Wav(flow, hift, cfg)


def long_call(stage: BatchedCode2Wav, args: argparse.Namespace, device: torch.device) -> dict[str, list]:
    """Every session's mel (80, W) and PCM of every chunk, on the host, float32."""
    sids = [f"s{i}" for i in range(args.sessions)]
    for i, sid in enumerate(sids):
        stage.add_session(sid, "v", seed=i)
    mels: dict[str, list] = {sid: [] for sid in sids}
    pcms: dict[str, list] = {sid: [] for sid in sids}
    vocab = stage.flow.vocab_size
    for tick in range(args.chunks):
        out = stage.step({sid: chunk_tokens(i, tick, vocab).to(device) for i, sid in enumerate(sids)})
        if out.errors:
            raise RuntimeError(f"chunk {tick}: {out.errors}")
        for sid in sids:
            mels[sid].append(stage.sessions[sid].last_mel.float().cpu())
            pcms[sid].append(out[sid].float().cpu())
    bytes_steady = stage.session_bytes(sids[0])
    for sid in sids:
        stage.remove_session(sid)
    return {"mel": [mels[s] for s in sids], "pcm": [pcms[s] for s in sids],
            "steady_private": bytes_steady.private, "steady_shared": bytes_steady.shared}


def rel_error(ref: torch.Tensor, other: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(other - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))


def snr_db(ref: torch.Tensor, other: torch.Tensor) -> float:
    noise = float(torch.sum((other - ref).double() ** 2))
    signal = float(torch.sum(ref.double() ** 2))
    return float("inf") if noise == 0 else 10 * float(np.log10(signal / noise))


def call_errors(ref: dict, other: dict) -> list[dict]:
    """Per session: the errors of ``other``'s call against ``ref``'s (both from ``long_call``)."""
    rows = []
    for i, (mr, mo, pr, po) in enumerate(zip(ref["mel"], other["mel"], ref["pcm"], other["pcm"])):
        per_chunk = [rel_error(a, b) for a, b in zip(mr, mo)]
        edge = min(EDGE_CHUNKS, len(per_chunk))
        rows.append({"session": i,
                     "mel_rel_error": rel_error(torch.cat(mr, 1), torch.cat(mo, 1)),
                     "mel_rel_error_worst_chunk": max(per_chunk),
                     "mel_rel_error_first_chunks": float(np.mean(per_chunk[:edge])),
                     "mel_rel_error_last_chunks": float(np.mean(per_chunk[-edge:])),
                     "pcm_snr_db": snr_db(torch.cat(pr), torch.cat(po)),
                     "seconds": sum(p.numel() for p in pr) / 24000})
    return rows


def time_batches(stage: BatchedCode2Wav, args: argparse.Namespace, device: torch.device) -> list[dict]:
    vocab = stage.flow.vocab_size
    rows = []
    for batch in args.batches:
        sids = [f"t{batch}_{i}" for i in range(batch)]
        for i, sid in enumerate(sids):
            stage.add_session(sid, "v", seed=i)
        times = []
        for tick in range(args.warmup + args.timed_chunks):
            chunks = {sid: chunk_tokens(i, tick, vocab).to(device) for i, sid in enumerate(sids)}
            sync(device)
            t0 = time.perf_counter()
            out = stage.step(chunks)
            sync(device)
            if out.errors:
                raise RuntimeError(f"batch {batch} chunk {tick}: {out.errors}")
            if tick >= args.warmup:
                times.append(1000 * (time.perf_counter() - t0))
        for sid in sids:
            stage.remove_session(sid)
        rows.append({"batch": batch, **summary(times)})
    return rows


def run_arm(name: str, flow: torch.nn.Module, hift: torch.nn.Module, args: argparse.Namespace,
            device: torch.device, prompt) -> tuple[dict, dict]:
    """One arm's bytes and times, and its long call's mel and PCM (for the error)."""
    logger.info("arm %s: a %d-chunk call of %d sessions, then batches %s", name, args.chunks, args.sessions,
                args.batches)
    sync(device)
    m0 = allocated(device)
    stage = make_stage(flow, hift, args, max(args.sessions, *args.batches))
    stage.register_voice("v", *prompt)
    sync(device)
    fixed_alloc = None if m0 is None else allocated(device) - m0
    call = long_call(stage, args, device)
    timing = time_batches(stage, args, device)
    elem = stage.dtype.itemsize
    arm = {"code2wav_dtype": name, "arena_rows": stage.arena.rows, "arena_bytes": stage.arena.nbytes(),
           "arena_index_bytes": stage.arena.index_nbytes(),
           "voice_bytes": stage.voice_bytes("v"), "fixed_alloc_delta": fixed_alloc,
           "steady_private_bytes": call["steady_private"], "steady_shared_bytes": call["steady_shared"],
           "admission_bytes": {stage_name: vars(code2wav_session_bytes(stage.config, args.prompt_frames, True,
                                                                       stage_name, elem))
                               for stage_name in ("setup", "steady")},
           "graph_captures": stage.graph_stats.captures, "times": timing}
    del stage
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return arm, call


def markdown(res: dict) -> str:
    mib = lambda b: "-" if b is None else f"{b / MIB:.1f}"
    arms = res["arms"]
    lines = ["# Code2Wav in bfloat16 against float32 (precision.code2wav_dtype)", "",
             f"hardware: {res['hardware']}",
             f"workload: preset {res['preset']}, random weights (redrawn), P = {res['prompt_frames']}, "
             f"{res['sessions']} sessions x {res['chunks']} chunks of 25 + 3 tokens, prompt sharing on", "",
             "## Error of bfloat16 over the call, per session", "",
             "| session | audio s | mel rel. error (call) | worst chunk | first 10 / last 10 chunks | waveform SNR (dB) |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in res["error"]:
        lines.append(f"| {r['session']} | {r['seconds']:.0f} | {r['mel_rel_error']:.2e} | "
                     f"{r['mel_rel_error_worst_chunk']:.2e} | {r['mel_rel_error_first_chunks']:.2e} / "
                     f"{r['mel_rel_error_last_chunks']:.2e} | {r['pcm_snr_db']:.1f} |")
    lines += ["", "## Bytes", "", "| dtype | private MiB / stream (steady) | admission MiB / stream (steady) "
              "| voice prompt state MiB | arena MiB (rows) |", "|---|---:|---:|---:|---:|"]
    for a in arms:
        lines.append(f"| {a['code2wav_dtype']} | {mib(a['steady_private_bytes'])} | "
                     f"{mib(a['admission_bytes']['steady']['private'])} | {mib(a['voice_bytes'])} | "
                     f"{mib(a['arena_bytes'])} ({a['arena_rows']}) |")
    lines += ["", "## ms per step (median, min..max)", "", "| batch | " + " | ".join(a["code2wav_dtype"] for a in arms)
              + " |", "|---:|" + "---:|" * len(arms)]
    for i, batch in enumerate(res["batches"]):
        cells = [f"{a['times'][i]['median_ms']:.1f} ({a['times'][i]['min_ms']:.1f}..{a['times'][i]['max_ms']:.1f})"
                 for a in arms]
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", type=Path, default=Path("out/precision"))
    ap.add_argument("--preset", choices=PRESETS, default="minicpmo45")
    ap.add_argument("--device", default=None, help="default: cuda for minicpmo45, cpu for tiny")
    ap.add_argument("--sessions", type=int, default=4, help="sessions of the long call whose error is measured")
    ap.add_argument("--chunks", type=int, default=60, help="chunks (1 s each) of the long call")
    ap.add_argument("--batches", type=int_list("--batches"), default=(1, 8, 32), help="batch sizes timed")
    ap.add_argument("--warmup", type=int, default=3, help="untimed chunks per batch (2 reach the P + 100 cache)")
    ap.add_argument("--timed-chunks", type=int, default=10)
    ap.add_argument("--prompt-frames", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    if args.sessions < 1 or args.chunks < 1 or args.timed_chunks < 1:
        return usage_error("code2wav-precision", "--sessions, --chunks and --timed-chunks must be positive")
    if args.warmup < 2:
        return usage_error("code2wav-precision", "--warmup must be >= 2 (the cache reaches P + 100 after two chunks)")
    if any(b < 1 for b in args.batches):
        return usage_error("code2wav-precision", "--batches must be positive")
    device = torch.device(args.device or ("cuda" if args.preset == "minicpmo45" else "cpu"))
    _, _, flow, hift = stage2_models(args.preset, device, args.seed)
    prompt = voice(args.prompt_frames, args.seed + 7, flow.vocab_size)
    res = {"hardware": hardware_line(device), "preset": args.preset, "prompt_frames": args.prompt_frames,
           "sessions": args.sessions, "chunks": args.chunks, "batches": list(args.batches),
           "warmup": args.warmup, "timed_chunks": args.timed_chunks, "arms": []}
    calls = {}
    for name, dtype in DTYPES.items():
        arm_flow = flow if dtype == torch.float32 else copy.deepcopy(flow).to(dtype)
        arm, calls[name] = run_arm(name, arm_flow, hift, args, device, prompt)
        res["arms"].append(arm)
        write_results(args.out, res)   # partial results survive a later failure
        del arm_flow
    res["error"] = call_errors(calls["float32"], calls["bfloat16"])
    md = markdown(res)
    write_results(args.out, res, md)
    print(md)
    return 0


if __name__ == "__main__":   # a probe script: python scripts/probes/code2wav_precision.py ARGS (duplexcache importable)
    _parser = argparse.ArgumentParser(prog="scripts/probes/code2wav_precision.py", description=__doc__.split("\n\n")[0])
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
