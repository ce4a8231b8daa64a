"""Why the audio encoder is slower over the wire than in engine_ticks: per-unit cost of
``AudioEncoder.stream_step`` for B fresh sessions whose caches grow as audio arrives, with the
CUDA caching allocator's device allocations (cudaMalloc) counted per unit.

Arms (each in a fresh process, so the allocator starts empty as in a fresh server):
  grow   the serving default: caches start empty and grow by CACHE_GROWTH_FRAMES
  prime  the same after one block of B full caches was allocated and freed (the allocator keeps it)
  full   every cache allocated at its full size at open (grow=False), no growth

Usage: python scripts/probes/encoder_growth_probe.py --out DIR [--sessions 32 --units 40]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def run_arm(arm: str, sessions: int, units: int) -> dict:
    import numpy as np
    import torch

    from duplexcache.models.audio_encoder import AudioEncoder, AudioEncoderConfig

    torch.manual_seed(0)
    cfg = AudioEncoderConfig.minicpmo45()
    enc = AudioEncoder(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    probe = enc.new_stream_state(grow=False)
    full_bytes = probe.k.numel() * probe.k.element_size() * 2
    del probe
    torch.cuda.synchronize()
    if arm == "prime":
        block = torch.empty(sessions * full_bytes, dtype=torch.uint8, device="cuda")
        del block
    states = [enc.new_stream_state(grow=arm != "full") for _ in range(sessions)]
    rng = np.random.default_rng(0)

    def device_allocs() -> int:
        return int(torch.cuda.memory_stats().get("num_device_alloc", -1))

    rows = []
    for u in range(units):
        chunks = [rng.uniform(-0.3, 0.3, enc.expected_chunk_samples(s)).astype(np.float32) for s in states]
        torch.cuda.synchronize()
        before, t0 = device_allocs(), time.perf_counter()
        enc.stream_step(states, chunks)
        torch.cuda.synchronize()
        rows.append({"unit": u, "ms": round((time.perf_counter() - t0) * 1e3, 2),
                     "device_allocs": device_allocs() - before,
                     "capacity_frames": states[0].capacity})
    ms = sorted(r["ms"] for r in rows[1:])
    return {"arm": arm, "sessions": sessions, "units": units, "full_cache_bytes_per_session": full_bytes,
            "first_unit_ms": rows[0]["ms"], "p50_ms_after_first": ms[len(ms) // 2], "max_ms_after_first": ms[-1],
            "device_allocs_total": sum(r["device_allocs"] for r in rows), "per_unit": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--units", type=int, default=40)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        print(json.dumps(run_arm(args.arm, args.sessions, args.units)))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for arm in ("grow", "prime", "full"):
        proc = subprocess.run([sys.executable, __file__, "--out", str(out), "--arm", arm, "--sessions",
                               str(args.sessions), "--units", str(args.units)], capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(r)
        print(f"{arm:6s} first unit {r['first_unit_ms']:8.1f} ms, then p50 {r['p50_ms_after_first']:6.1f} "
              f"max {r['max_ms_after_first']:7.1f} ms; device allocations {r['device_allocs_total']}", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
