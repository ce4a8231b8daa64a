"""Where does Code2Wav's batch variance come from on CUDA? (issue #42's remaining 1-LSB samples.)

    python scripts/code2wav_invariance_probe.py --out DIR [--preset minicpmo45] [--chunks 5]

One probe stream alone, then beside 7 and 31 others (starting one tick before, with, and after
it, so cache lengths and conformer segments differ), on the standalone `BatchedCode2Wav` with the
engine's graph grid. For each choice of `BatchInvariantMode` op families (none, linear+conv as
first built, + batched matmul, SDPA and FFT), each with and without the arena's fixed key
length, eager and with CUDA graphs, the probe's conformer
output (mu), solved mel and PCM are compared bit for bit with its alone run: the first stage that
differs names the culprit. Writes DIR/code2wav_invariance.json.
"""
from __future__ import annotations

import argparse
import os
import contextlib
import dataclasses
import gc
import json
import logging
import time
from pathlib import Path

# before torch: cuBLAS reads its workspace setting at its first use (the `duplexcache` CLI sets the same)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch

from duplexcache.bench.gpu_stage2 import chunk_tokens, stage2_models, voice
from duplexcache.cfm import BatchedCode2Wav, Code2WavConfig, Code2WavShape
from duplexcache.models.batch_invariant import BatchInvariantMode, tile_rows_for
from duplexcache.runtime.stages.code2wav_stage import vocoder_graph_shapes
from duplexcache.runtime.memory.device_setup import pin_cuda_numerics

logger = logging.getLogger("code2wav_invariance")
ALL = set(BatchInvariantMode.FAMILIES)
# name -> (BatchInvariantMode op families or None for no mode, Code2WavConfig.fixed_key_length)
VARIANTS = {"none": (None, False), "linear_conv": ({"linear", "conv"}, False), "all": (ALL, False),
            "linear_conv_fixed_keys": ({"linear", "conv"}, True), "matmul_fixed_keys": ({"linear", "conv", "matmul"}, True),
            "all_fixed_keys": (ALL, True)}


def make_stage(flow, hift, graphs: bool, prompt, fixed_keys: bool) -> BatchedCode2Wav:
    cfg = Code2WavConfig(shape=Code2WavShape.from_flow(flow), max_num_seqs=32, prompt_att_sharing=True,
                         arena_rows_from_graph_grid=True, graph_grid=(1, 4, 8, 16), max_prompt_frames=300,
                         prompt_bank_frames=301, use_cuda_graphs=graphs, vocoder_cuda_graphs=graphs,
                         fixed_key_length=fixed_keys)
    cfg = dataclasses.replace(cfg, vocoder_graph_shapes=vocoder_graph_shapes(cfg, 25))
    stage = BatchedCode2Wav(flow, hift, cfg)
    stage.register_voice("v", *prompt)
    return stage


def run(flow, hift, prompt, others: int, chunks: int, graphs: bool, variant,
        device: torch.device) -> list[dict[str, torch.Tensor]]:
    """The probe's per-chunk mu, mel and pcm beside ``others`` streams."""
    ops, fixed_keys = variant
    mode = BatchInvariantMode(tile_rows_for(device), frozenset(ops)) if ops is not None else None
    got: list[dict[str, torch.Tensor]] = []
    with mode if mode is not None else contextlib.nullcontext():
        stage = make_stage(flow, hift, graphs, prompt, fixed_keys)
        real_encode = stage._encode_call
        seen: dict[str, torch.Tensor] = {}

        def encode(segments, tokens, lasts):
            out = real_encode(segments, tokens, lasts)
            if "p" in out:
                seen["mu"] = out["p"].mu.detach().clone().cpu()
            return out
        stage._encode_call = encode
        starts = {"p": 1, **{f"o{i}": i % 3 for i in range(others)}}
        for tick in range(chunks + 2):
            batch = {}
            for sid, start in starts.items():
                k = tick - start
                if k == 0:
                    stage.add_session(sid, "v", seed=1 if sid == "p" else 100 + int(sid[1:]))
                if 0 <= k < chunks:
                    batch[sid] = chunk_tokens(7 if sid == "p" else 1000 + int(sid[1:]), k, flow.vocab_size).to(device)
            out = stage.step(batch, {sid: False for sid in batch})
            assert not out.errors, out.errors
            if "p" in batch:
                got.append({"mu": seen.pop("mu"), "mel": stage.sessions["p"].last_mel.detach().cpu(),
                            "pcm": out["p"].detach().cpu()})
    del stage
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return got


def compare(alone, beside) -> dict:
    res = {}
    for part in ("mu", "mel", "pcm"):
        eq = [torch.equal(a[part], b[part]) for a, b in zip(alone, beside)]
        diff = max(float((a[part].float() - b[part].float()).abs().max()) for a, b in zip(alone, beside))
        res[part] = {"equal_per_chunk": eq, "max_abs_diff": diff}
    res["first_differing"] = next((p for p in ("mu", "mel", "pcm") if not all(res[p]["equal_per_chunk"])), None)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="minicpmo45")
    ap.add_argument("--chunks", type=int, default=5)
    ap.add_argument("--others", default="7,31")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = torch.device(args.device)
    pin_cuda_numerics(device)
    _, _, flow, hift = stage2_models(args.preset, device, seed=0)
    prompt = voice(300, 5, flow.vocab_size)
    result = {"preset": args.preset, "hardware": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "date": time.strftime("%Y-%m-%d"),
              "chunks": args.chunks, "runs": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for graphs in (False, True) if device.type == "cuda" else (False,):
        for name in args.variants.split(","):
            key = f"{name}/{'graphs' if graphs else 'eager'}"
            t0 = time.perf_counter()
            alone = run(flow, hift, prompt, 0, args.chunks, graphs, VARIANTS[name], device)
            row = {}
            for n in (int(x) for x in args.others.split(",")):
                row[str(n)] = compare(alone, run(flow, hift, prompt, n, args.chunks, graphs, VARIANTS[name], device))
            result["runs"][key] = row
            logger.info("%s (%.0f s): %s", key, time.perf_counter() - t0,
                        {n: r["first_differing"] for n, r in row.items()})
            (args.out / "code2wav_invariance.json").write_text(json.dumps(result, indent=2))
    for key, row in result["runs"].items():
        print(f"{key:24s}", {n: r["first_differing"] or "equal" for n, r in row.items()},
              {n: r["pcm"]["max_abs_diff"] for n, r in row.items()})


if __name__ == "__main__":
    main()
