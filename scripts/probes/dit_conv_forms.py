"""Issue 49 probe: the DiT's causal conv block as the model runs it vs as time-major GEMMs.

    python scripts/probes/dit_conv_forms.py --out DIR [--preset minicpmo45] [--device cuda]
                                            [--dtypes bfloat16,float32] [--rows 32] [--frames 50]

Why: in a capacity tick at 59 sessions (H100, 2026-12-07, docs/benchmarks.md "Per-stage cost per
extra session") Code2Wav's kernels were mostly small ones, among them 1936 cuDNN ``nchwToNhwc``
layout conversions per tick. Each DiT block's ``CausalConvBlock`` transposes its (rows, frames,
hidden) input to channels-first, concatenates the 2-frame cache, runs a kernel-3 ``Conv1d``, and
transposes back, twice per block, in every Euler step of every solve.

The probe times one ``forward_chunk`` of one block at the engine's shapes (``--rows``: a solve
tier's rows with classifier-free guidance, 2 x 16; ``--frames``: a unit's 50 mel frames) in two
forms over the same weights and inputs:

* ``module``: ``CausalConvBlock.forward_chunk``, what the engine runs;
* ``gemm``: each conv as one matmul of the three shifted time-major frames (rows, frames, 3 x hidden)
  with the weight laid out (3 x hidden, hidden), then LayerNorm and Mish on the time-major rows: no
  transposes and no layout conversion. Same function, another summation order, so its bits differ.

Per dtype: median / min / max ms over ``--repeats`` calls (CUDA events on CUDA, the wall clock on
CPU), each form's max-abs error against the module in float64, the two forms' max-abs difference,
and whether their new caches agree. Writes results.json and results.md to --out. A measurement to
decide on, not a switch: a form that changes bits would need capacity mode's error table rerun.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from duplexcache.bench.common import hardware_line, usage_error, write_results
from duplexcache.models.flow import CausalConvBlock
from duplexcache.models.presets import PRESETS, preset_configs
from duplexcache.runtime.memory.device_setup import pin_cuda_numerics

logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def gemm_forward_chunk(block: CausalConvBlock, x: torch.Tensor,
                       cnn_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``block.forward_chunk(x, cnn_cache)`` with each conv as a time-major GEMM:
    x (b, t, c); cnn_cache (b, c_in + c_out, 2) -> out (b, t, c_out), new cache (same layout)."""
    c1, c2 = cnn_cache.split((block.in_channels, block.out_channels), dim=1)
    conv1, norm, mish, conv2 = block.block[1], block.block[3], block.block[4], block.block[6]
    h, n1 = _conv_time_major(conv1, x, c1)
    h, n2 = _conv_time_major(conv2, mish(norm(h)), c2)
    return h, torch.cat((n1, n2), dim=1)


def _conv_time_major(conv: torch.nn.Conv1d, x: torch.Tensor,
                     cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out[b, t, o] = bias[o] + sum_{k, i} W[o, i, k] * [cache | x][b, t + k, i], as one matmul."""
    k = conv.kernel_size[0]
    t = x.shape[1]
    full = torch.cat([cache.transpose(1, 2), x], dim=1)                       # (b, t + k - 1, c_in)
    windows = torch.cat([full[:, j:j + t] for j in range(k)], dim=2)          # (b, t, k * c_in)
    weight = conv.weight.permute(2, 1, 0).reshape(k * conv.in_channels, conv.out_channels)
    return F.linear(windows, weight.t(), conv.bias), full[:, -(k - 1):].transpose(1, 2)


def _time(fn, device: torch.device, warmup: int, repeats: int) -> dict:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    t = np.asarray(times)
    return {"median_ms": float(np.median(t)), "min_ms": float(t.min()), "max_ms": float(t.max()), "repeats": repeats}


def measure(args: argparse.Namespace, dtype_name: str) -> dict:
    """One dtype: both forms timed on the same block and inputs, errors against float64."""
    device = torch.device(args.device)
    pin_cuda_numerics(device)   # the engine's cuDNN settings (no TF32, fixed algorithms), not torch's defaults
    hidden = preset_configs(args.preset)[3].dit_hidden_size
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    ref_block = CausalConvBlock(hidden, hidden, kernel_size=3).double().eval()
    x64 = torch.randn(args.rows, args.frames, hidden, generator=gen, dtype=torch.float64)
    cache64 = torch.randn(args.rows, 2 * hidden, 2, generator=gen, dtype=torch.float64)
    with torch.inference_mode():
        want, want_cache = ref_block.forward_chunk(x64, cache64)
        dtype = DTYPES[dtype_name]
        block = CausalConvBlock(hidden, hidden, kernel_size=3).eval()
        block.load_state_dict(ref_block.state_dict())
        block = block.to(device=device, dtype=dtype)
        x, cache = x64.to(device, dtype), cache64.to(device, dtype)
        forms = {"module": lambda: block.forward_chunk(x, cache), "gemm": lambda: gemm_forward_chunk(block, x, cache)}
        outs = {name: fn() for name, fn in forms.items()}
        timings = {name: _time(fn, device, args.warmup, args.repeats) for name, fn in forms.items()}
    err = {name: float((out.double().cpu() - want).abs().max()) for name, (out, _) in outs.items()}
    (mod, mod_cache), (gemm, gemm_cache) = outs["module"], outs["gemm"]
    return {"dtype": dtype_name, "hidden": hidden, "rows": args.rows, "frames": args.frames, "timings": timings,
            "max_abs_error_vs_float64": err, "max_abs_error_of_module_cache": float((mod_cache.double().cpu()
                                                                                      - want_cache).abs().max()),
            "forms_max_abs_difference": float((mod.float() - gemm.float()).abs().max()),
            "forms_bit_equal": bool(torch.equal(mod, gemm)), "caches_equal": bool(torch.equal(mod_cache, gemm_cache))}


def markdown(results: dict) -> str:
    lines = ["# DiT causal conv block: module vs time-major GEMMs", "", f"hardware: {results['hardware']}  ",
             f"preset {results['preset']}, {results['rows']} rows x {results['frames']} frames", "",
             "| dtype | form | median ms | min | max | max-abs error vs float64 |", "|---|---|---|---|---|---|"]
    for r in results["dtypes"]:
        for form, t in r["timings"].items():
            lines.append(f"| {r['dtype']} | {form} | {t['median_ms']:.4f} | {t['min_ms']:.4f} | {t['max_ms']:.4f} "
                         f"| {r['max_abs_error_vs_float64'][form]:.3g} |")
    lines.append("")
    lines += [f"- {r['dtype']}: forms bit-equal {r['forms_bit_equal']} (max-abs difference "
              f"{r['forms_max_abs_difference']:.3g}); new caches equal {r['caches_equal']}" for r in results["dtypes"]]
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--preset", choices=sorted(PRESETS), default="minicpmo45")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated: bfloat16, float32")
    p.add_argument("--rows", type=int, default=32, help="a solve tier's rows with guidance: 2 x 16")
    p.add_argument("--frames", type=int, default=50, help="mel frames of a unit's chunk")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    names = [d for d in args.dtypes.split(",") if d]
    if not names or any(d not in DTYPES for d in names):
        return usage_error("dit_conv_forms", f"--dtypes takes {', '.join(DTYPES)}, got {args.dtypes!r}")
    if args.rows < 1 or args.frames < 1 or args.repeats < 1 or args.warmup < 0:
        return usage_error("dit_conv_forms", "--rows, --frames and --repeats must be >= 1, --warmup >= 0")
    results = {"hardware": hardware_line(torch.device(args.device)), "preset": args.preset, "rows": args.rows,
               "frames": args.frames, "dtypes": []}
    for name in names:
        results["dtypes"].append(measure(args, name))
        logger.info("%s: %s", name, {f: t["median_ms"] for f, t in results["dtypes"][-1]["timings"].items()})
        write_results(args.out, results, markdown(results))
    return 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
