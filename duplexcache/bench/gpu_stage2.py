"""Stage 2 GPU benchmark: batched streaming Code2Wav with CUDA graphs, prompt sharing on vs off.

    duplexcache bench stage2 --out DIR [--batches 1,8,32] [--chunks 10]

On the minicpmo45 flow + HiFT shapes (random weights, float32, as the reference runs):
  (a) milliseconds per 1 s chunk (25 tokens + 3 lookahead) for B sessions at steady cache
      length P + 100 (P = 300; sessions are fast-forwarded by running chunks), with CUDA graphs,
      cfm_prompt_att_sharing off and on; median, min, max over --chunks timed chunks after
      --warmup chunks; and how many sessions stay real time (ms per chunk < 1000);
  (b) private and shared bytes per session at setup and at steady state, off vs on: component
      accounting (`session_bytes`, `voice_bytes`, `code2wav_session_bytes`) and the
      torch.cuda.memory_allocated delta divided by B;
  (c) arena bytes with and without cfm_arena_rows_from_graph_grid for 24 sessions, grid
      1,4,8,16, max_num_seqs 32, plus a timed run of 24 sessions on the 16-row arena;
  (d) mel of sharing on vs off, torch.equal, every session, every chunk (>= 2 chunks);
  (e) when minicpmo-utils (package stepaudio2) imports, the reference single-session time per
      chunk (Token2wav.stream's loop over the reference modules, with its trim rule), the
      figure SPEC section 5 anchors at 180 ms on an H200.
A chunk's time is wall clock around `BatchedCode2Wav.step` with the device synchronized before
and after: it includes the batched conformer and vocoder calls and every host-side cost.
Writes results.json and results.md to --out. Needs only torch and numpy (+ the reference for (e)).
"""
from __future__ import annotations

import argparse
import gc
import logging
import platform
import time
from pathlib import Path

import numpy as np
import torch

from duplexcache.bench.common import alias_main, hardware_line, int_list, sync, usage_error, write_results
from duplexcache.cfm import (
    BatchedCode2Wav,
    Code2WavConfig,
    Code2WavShape,
    EulerArena,
    code2wav_session_bytes,
)
from duplexcache.cfm.graph_grid import arena_rows, replay_groups
from duplexcache.models.flow import FlowConfig, build_flow
from duplexcache.models.presets import PRESETS, build_random_models

logger = logging.getLogger(__name__)
MIB = 2 ** 20
CHUNK_TOKENS, LOOKAHEAD = 25, 3


# ---- set-up ------------------------------------------------------------------------------
def stage2_models(preset: str, device: torch.device, seed: int):
    """Our flow + HiFT from the package's random-model builder, then verify's recipe on top:
    every flow weight redrawn so every path is exercised, and a voiced HiFT F0 predictor."""
    from duplexcache.verify.flow import (  # torch-only module
        randomize_flow_,
        randomize_hift_,
    )

    m = build_random_models(preset, device, torch.float32, seed, parts=("flow", "hift"))
    randomize_flow_(m.flow, seed)
    randomize_hift_(m.hift, seed + 1)
    return m.flow_config, m.vocoder_config, m.flow, m.hift


def voice(prompt_frames: int, seed: int, vocab: int):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (prompt_frames // 2,), generator=gen)
    return tokens, torch.randn(prompt_frames, 80, generator=gen), torch.randn(192, generator=gen)


def chunk_tokens(sid: int, tick: int, vocab: int) -> torch.Tensor:
    """Session `sid`'s chunk at `tick`: the same stream whatever the batch or the sharing mode."""
    gen = torch.Generator().manual_seed(1_000_003 * sid + tick)
    return torch.randint(0, vocab, (CHUNK_TOKENS + LOOKAHEAD,), generator=gen)


def allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def summary(times_ms: list[float]) -> dict:
    t = np.asarray(times_ms)
    return {"median_ms": float(np.median(t)), "min_ms": float(t.min()), "max_ms": float(t.max()), "n": int(t.size)}


# ---- (a), (b), (d): one batch size in one stage ---------------------------------------
def run_batch(stage: BatchedCode2Wav, batch: int, args, device: torch.device, vocab: int, mels: dict) -> dict:
    """Set up `batch` sessions, fast-forward them to steady state, time `args.chunks` chunks."""
    sids = [f"b{batch}s{i}" for i in range(batch)]
    sync(device)
    m0 = allocated(device)
    for i, sid in enumerate(sids):
        stage.add_session(sid, "v", seed=i)
    stage.step({})                                              # setup pass only
    sync(device)
    m_setup = allocated(device)
    setup_acc = stage.session_bytes(sids[0])
    times = []
    for tick in range(args.warmup + args.chunks):
        chunks = {sid: chunk_tokens(i, tick, vocab).to(device) for i, sid in enumerate(sids)}
        before = stage.graph_stats.replays, stage.graph_stats.captures
        sync(device)
        t0 = time.perf_counter()
        out = stage.step(chunks)
        sync(device)
        ms = 1000 * (time.perf_counter() - t0)
        assert not out.errors, out.errors
        del out
        if tick >= args.warmup:
            times.append(ms)
            if stage.arena.use_graphs and stage.graph_stats.captures != before[1]:
                logger.warning("a graph was captured inside the timed window (batch %d tick %d)", batch, tick)
        for i, sid in enumerate(sids[:args.compare_sessions]):
            mels[(batch, i, tick)] = stage.sessions[sid].last_mel.cpu()
    cache_len = len(stage.sessions[sids[0]].att)
    sync(device)
    m_steady = allocated(device)
    steady_acc = stage.session_bytes(sids[0])
    voice_bytes = stage.voice_bytes("v")      # before the last session releases the voice
    for sid in sids:
        stage.remove_session(sid)
    res = {"batch": batch, **summary(times), "realtime": bool(np.median(times) < 1000.0),
           "steady_cache_frames": cache_len,
           "accounting_setup": {"private": setup_acc.private, "shared": setup_acc.shared},
           "accounting_steady": {"private": steady_acc.private, "shared": steady_acc.shared},
           "voice_bytes": voice_bytes}
    if m0 is not None:
        res["alloc_per_session_setup"] = (m_setup - m0) / batch
        res["alloc_per_session_steady"] = (m_steady - m0) / batch
    return res


def run_mode(flow, hift, sharing: bool, args, device, prompt, mels: dict) -> dict:
    cfg = Code2WavConfig(shape=Code2WavShape.from_flow(flow), max_num_seqs=max(args.batches),
                         prompt_att_sharing=sharing, graph_grid=args.grid, max_prompt_frames=args.prompt_frames,
                         use_cuda_graphs=True)
    sync(device)
    m0 = allocated(device)
    stage = BatchedCode2Wav(flow, hift, cfg)
    sync(device)
    arena_alloc = None if m0 is None else allocated(device) - m0
    stage.register_voice("v", *prompt)
    rows = [run_batch(stage, b, args, device, flow.vocab_size, mels) for b in args.batches]
    s = stage.graph_stats
    out = {"sharing": sharing, "arena_rows": stage.arena.rows, "arena_bytes": stage.arena.nbytes(),
           "arena_alloc_delta": arena_alloc, "graph_keys": [list(k) for k in stage.arena.graph_keys],
           "captures": s.captures, "replays": s.replays, "eager_runs": s.eager_runs, "batches": rows,
           # Conformer / vocoder calls per step (one per shape group; 1 each at steady state) and
           # the conformer's attention segments (one per cache length inside a call).
           "batch_stats": {k: getattr(stage.batch_stats, k) for k in ("steps", "conformer_calls", "conformer_segments",
                                                                      "conformer_rows", "vocoder_calls", "vocoder_rows")},
           "max_realtime_batch": max([r["batch"] for r in rows if r["realtime"]], default=0)}
    del stage
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# ---- (c) arena bytes and a grid-sized run ------------------------------------------------
def arena_bytes(flow_cfg: FlowConfig, cfg: Code2WavConfig, sessions: int, grid: tuple[int, ...]) -> dict:
    """Arena bytes with and without rows-from-grid, on the meta device (shapes only)."""
    est = build_flow(flow_cfg, "meta").decoder.estimator
    out = {"sessions": sessions, "grid": list(grid), "max_num_seqs": cfg.max_num_seqs}
    for on in (False, True):
        rows = arena_rows(cfg.max_num_seqs, grid, on)
        arena = EulerArena(est, rows, cfg.max_chunk_frames, cfg.max_cache_frames, cfg.shape.n_timesteps,
                           cfg.cfg_rate, cfg.key_bucket, max_setup_query=cfg.max_prompt_frames, use_cuda_graphs=False,
                           max_private=cfg.max_prompt_frames)
        groups = replay_groups(sessions, grid, rows)
        out["on" if on else "off"] = {"rows": rows, "bytes": arena.nbytes(),
                                      "replay_groups": [list(g) for g in groups]}
    return out


def grid_run(flow, hift, args, device, prompt, sessions: int, grid: tuple[int, ...]) -> dict:
    cfg = Code2WavConfig(shape=Code2WavShape.from_flow(flow), max_num_seqs=32, prompt_att_sharing=True,
                         graph_grid=grid, arena_rows_from_graph_grid=True, max_prompt_frames=args.prompt_frames)
    stage = BatchedCode2Wav(flow, hift, cfg)
    stage.register_voice("v", *prompt)
    sub = argparse.Namespace(**{**vars(args), "chunks": max(2, args.chunks // 2)})
    res = run_batch(stage, sessions, sub, device, flow.vocab_size, {})
    res.update(arena_rows=stage.arena.rows, captures=stage.graph_stats.captures,
               replays=stage.graph_stats.replays, eager_runs=stage.graph_stats.eager_runs)
    del stage
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


# ---- (e) the reference, one session at a time -------------------------------------------
def reference_times(flow, hift, flow_cfg, voc_cfg, args, device) -> dict:
    """Token2wav.stream's per-chunk work over the reference modules (same weights), timed."""
    try:
        from duplexcache.verify import flow as vf
        vf.import_reference()
    except (ImportError, ModuleNotFoundError) as exc:   # the reference is optional here
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
    ref_flow, ref_hift = vf.build_reference_flow(flow_cfg, device), vf.build_reference_hift(voc_cfg, device)
    ref_flow.load_state_dict(flow.state_dict(), strict=True)
    ref_hift.load_state_dict(hift.state_dict(), strict=True)
    vf.copy_noise(flow, ref_flow)
    common = vf.import_reference().common
    n = args.warmup + args.ref_chunks
    inp = vf.make_inputs(flow_cfg, args.prompt_frames // 2, n + 1, args.seed, device)
    p, tail, mel_keep, src_keep = args.prompt_frames, 100, 8, 8 * 480
    window = torch.from_numpy(np.hamming(2 * src_keep))
    with torch.inference_mode():
        cache = ref_flow.setup_cache(inp.prompt_token, inp.prompt_mel, inp.spk, n_timesteps=10)
        hc = dict(mel=torch.zeros(1, 80, 0, device=device), source=torch.zeros(1, 1, 0, device=device),
                  speech=torch.zeros(1, 0, device=device))
        times = []
        for i, (tokens, _) in enumerate(inp.chunks[:n]):
            sync(device)
            t0 = time.perf_counter()
            chunk_mel, cache = ref_flow.inference_chunk(token=tokens, spk=inp.spk, cache=cache, last_chunk=False,
                                                        n_timesteps=10)
            chunk_mel = chunk_mel.clone()   # the reference returns views into its scratch buffer
            for key, dim in (("estimator_att_cache", 4), ("conformer_att_cache", 3)):
                att = cache[key]
                if att.shape[dim] > p + tail:
                    cache[key] = torch.cat([att.narrow(dim, 0, p), att.narrow(dim, att.shape[dim] - tail, tail)], dim)
            mel = torch.cat([hc["mel"], chunk_mel], dim=2)
            speech, source = ref_hift(mel, hc["source"])
            if hc["speech"].shape[-1] > 0:
                speech = common.fade_in_out(speech, hc["speech"], window)
            hc = dict(mel=mel[..., -mel_keep:].clone(), source=source[:, :, -src_keep:].clone(),
                      speech=speech[:, -src_keep:].clone())
            sync(device)
            if i >= args.warmup:
                times.append(1000 * (time.perf_counter() - t0))
    del ref_flow, ref_hift, cache
    gc.collect()
    return {"available": True, "steady_cache_frames": p + tail, **summary(times),
            "spec_anchor_ms": 180.0, "realtime_sessions_one_at_a_time": int(1000 // np.median(times))}


# ---- report --------------------------------------------------------------------------------
def hardware(device: torch.device) -> str:
    return hardware_line(device, f"python {platform.python_version()}",
                         f"tf32 matmul {torch.backends.cuda.matmul.allow_tf32}, cudnn {torch.backends.cudnn.allow_tf32} "
                         "(defaults)")


def markdown(res: dict) -> str:
    mib = lambda b: "-" if b is None else f"{b / MIB:.1f}"
    lines = ["# Stage 2 GPU benchmark", "", f"hardware: {res['hardware']}",
             (f"workload: preset {res['preset']}, float32, random weights, P = {res['prompt_frames']}, chunk = 25 + 3 "
              f"tokens (50 mel frames), steady cache P + 100, warm-up {res['warmup']}, timed {res['chunks']} chunks, "
              f"graph grid {res['grid']}"), "",
             "## (a) ms per 1 s chunk (whole tick: conformer + graphed 10-step CFM + vocoder) and (b) bytes",
             "", ("| sharing | batch | median ms | min | max | real time | private MiB/sess (acct, setup/steady) "
                  "| shared MiB/sess (setup/steady) | alloc delta MiB/sess (setup/steady) |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for mode in res["modes"]:
        for r in mode["batches"]:
            a, b = r["accounting_setup"], r["accounting_steady"]
            lines.append(
                f"| {'on' if mode['sharing'] else 'off'} | {r['batch']} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | "
                f"{r['max_ms']:.1f} | {'yes' if r['realtime'] else 'no'} | {mib(a['private'])} / {mib(b['private'])} | "
                f"{mib(a['shared'])} / {mib(b['shared'])} | {mib(r.get('alloc_per_session_setup'))} / "
                f"{mib(r.get('alloc_per_session_steady'))} |")
    lines.append("")
    for mode in res["modes"]:
        lines.append(f"sharing {'on' if mode['sharing'] else 'off'}: largest real-time batch measured "
                     f"{mode['max_realtime_batch']}; graph captures {mode['captures']}, replays {mode['replays']}, "
                     f"eager runs {mode['eager_runs']}; arena {mode['arena_rows']} rows, {mib(mode['arena_bytes'])} MiB")
    lines += ["", "shape-only accounting (code2wav_session_bytes), MiB private/shared: " + ", ".join(
        f"{k} {mib(v['private'])}/{mib(v['shared'])}" for k, v in res["analytic_bytes"].items())]
    c = res["arena"]
    lines += ["", f"## (c) arena, {c['sessions']} sessions, grid {c['grid']}, max_num_seqs {c['max_num_seqs']}", "",
              "| rows_from_graph_grid | rows | arena MiB | replay groups (start, rows, tier) |", "|---|---|---|---|"]
    for k in ("off", "on"):
        lines.append(f"| {k} | {c[k]['rows']} | {mib(c[k]['bytes'])} | {c[k]['replay_groups']} |")
    g = res.get("grid_run")
    if g and "error" in g:
        lines.append(f"\n24-session run failed: {g['error']}")
    elif g:
        lines.append(f"\n24 sessions on the {g['arena_rows']}-row arena: median {g['median_ms']:.1f} ms "
                     f"(min {g['min_ms']:.1f}, max {g['max_ms']:.1f}, n {g['n']}); replays {g['replays']}, "
                     f"eager runs {g['eager_runs']}")
    d = res["equality"]
    lines += ["", (f"## (d) mel sharing on vs off: torch.equal on {d['compared']} (session, chunk) pairs over "
                   f"{d['chunks_per_session']} chunks each: **{d['all_equal']}**"), ""]
    e = res["reference"]
    if e.get("available"):
        lines.append(f"## (e) reference, one session, steady cache: median {e['median_ms']:.1f} ms per chunk "
                     f"(min {e['min_ms']:.1f}, max {e['max_ms']:.1f}, n {e['n']}); SPEC anchor 180 ms")
    else:
        lines.append(f"## (e) reference not run: {e.get('reason') or e.get('error')}")
    return "\n".join(lines) + "\n"


def guarded(fn) -> dict:
    """Run an optional section; a failure is reported in the results instead of losing the rest."""
    try:
        return fn()
    except Exception as exc:
        logger.exception("section failed")
        return {"available": False, "error": f"{type(exc).__name__}: {exc}"}


def _sorted_ints(option: str):
    parse = int_list(option)
    return lambda text: sorted(set(parse(text)))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--batches", type=_sorted_ints("--batches"), default="1,8,32")
    ap.add_argument("--chunks", type=int, default=10, help="timed chunks per batch (>= 10 for a report)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed chunks first (2 reach the P + 100 cache)")
    ap.add_argument("--ref-chunks", type=int, default=20)
    ap.add_argument("--prompt-frames", type=int, default=300)
    ap.add_argument("--grid", type=lambda text: tuple(_sorted_ints("--grid")(text)), default="1,4,8,16,32",
                    help="graph tiers for (a); (c) always uses 1,4,8,16")
    ap.add_argument("--preset", choices=PRESETS, default="minicpmo45")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare-sessions", type=int, default=4, help="sessions per batch whose mel is compared")
    ap.add_argument("--no-grid-run", action="store_true")
    ap.add_argument("--no-reference", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.warmup < 2:
        return usage_error("stage2", "--warmup must be >= 2 (the cache reaches P + 100 after two chunks)")
    if args.chunks < 1:
        return usage_error("stage2", "--chunks must be positive")
    device = torch.device(args.device)
    out_dir = args.out
    flow_cfg, voc_cfg, flow, hift = stage2_models(args.preset, device, args.seed)
    prompt = voice(args.prompt_frames, args.seed + 7, flow.vocab_size)
    res = {"hardware": hardware(device), "preset": args.preset, "prompt_frames": args.prompt_frames,
           "warmup": args.warmup, "chunks": args.chunks, "grid": list(args.grid), "modes": []}
    dump = lambda: write_results(out_dir, res)   # partial results survive a later failure or a time limit
    mels: dict[bool, dict] = {False: {}, True: {}}
    for sharing in (False, True):
        logger.info("timing sharing=%s batches=%s", sharing, args.batches)
        res["modes"].append(run_mode(flow, hift, sharing, args, device, prompt, mels[sharing]))
        dump()
    keys = sorted(mels[False])
    equal = [torch.equal(mels[False][k], mels[True][k]) for k in keys]
    res["equality"] = {"compared": len(keys), "chunks_per_session": args.warmup + args.chunks,
                       "all_equal": bool(keys) and all(equal), "unequal": [list(k) for k, e in zip(keys, equal) if not e]}
    cfg = Code2WavConfig(shape=Code2WavShape.from_flow(flow), max_num_seqs=32, max_prompt_frames=args.prompt_frames)
    res["analytic_bytes"] = {f"{stage} {'on' if on else 'off'}": vars(code2wav_session_bytes(cfg, args.prompt_frames, on, stage))
                             for stage in ("setup", "steady") for on in (False, True)}
    res["arena"] = arena_bytes(flow_cfg, cfg, 24, (1, 4, 8, 16))
    dump()
    if not args.no_grid_run:
        logger.info("24 sessions on the grid-sized arena")
        res["grid_run"] = guarded(lambda: grid_run(flow, hift, args, device, prompt, 24, (1, 4, 8, 16)))
        dump()
    res["reference"] = {"available": False, "reason": "--no-reference"} if args.no_reference else \
        guarded(lambda: reference_times(flow, hift, flow_cfg, voc_cfg, args, device))
    dump()
    md = markdown(res)
    write_results(out_dir, res, md)
    print(md)
    return 0 if res["equality"]["all_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(alias_main("stage2"))
