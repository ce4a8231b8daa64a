"""Does engine.cuda_graphs keep device memory after its engine is freed, and who allocated it?

Runs the path `duplexcache bench ticks` runs (fresh engine, warm-up, a few ticks, close, shutdown,
collect, empty the cache) once per arm, with the allocator's history of live blocks on, and then
attributes what is still allocated: by the first duplexcache frame of each live block's allocation
stack and by memory pool (a graph's private pool or the default one). It also lists the CUDA
tensors Python still reaches and the CUDAGraph objects still alive.

Usage: python3 scripts/probes/graph_leak_probe.py [--preset minicpmo45] [--arms on,off] [--out DIR]
An arm name ending in ``+fresh`` warms every capture up on a new pooled stream, as the runners did
before ``warmup_stream`` (the A/B of that change).
(tiny and CPU: a dry run of the script itself; nothing is attributed without CUDA.) Until issue 44
merged the graph switches into engine.cuda_graphs the arms were ragged, encoder, both and off (the
decode graphs on in each): docs/results/graph_leak_h100/.
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import logging
import warnings
from pathlib import Path
from typing import Any

import torch

import duplexcache.cfm.graph_capture as graph_capture_module
import duplexcache.kv.decode_graphs as decode_graphs_module
from duplexcache.bench.engine_ticks import run_benchmark
from duplexcache.bench.engine_ticks_config import TickBenchConfig, make_deploy
from duplexcache.runtime.bundle import build_models

logger = logging.getLogger("graph_leak_probe")

ARMS = {"off": {"cuda_graphs": False}, "on": {"cuda_graphs": True}}   # TickBenchConfig fields


def _site(frames: list[dict[str, Any]]) -> str:
    """The innermost duplexcache frame of an allocation stack (else the innermost frame)."""
    ours = [f for f in frames if "duplexcache" in f.get("filename", "")]
    pick = ours[:3] if ours else frames[:1]
    return " <- ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in pick) or "?"


def attribute_live_blocks(snapshot: dict[str, Any]) -> dict[str, Any]:
    """Live (allocated) bytes of an allocator snapshot, by allocation site and by pool."""
    by_site: collections.Counter[str] = collections.Counter()
    by_pool: collections.Counter[str] = collections.Counter()
    by_size: collections.Counter[int] = collections.Counter()
    by_stream: collections.Counter[str] = collections.Counter()
    for seg in snapshot.get("segments", []):
        pool = str(tuple(seg.get("segment_pool_id", (0, 0))))
        by_stream[str(seg.get("stream"))] += seg["total_size"]
        for block in seg.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            by_size[block["size"]] += 1
            frames = block.get("frames") or []
            if not frames and block.get("history"):
                frames = block["history"][-1].get("frames", [])
            by_site[_site(frames)] += block["size"]
            by_pool[pool] += block["size"]
    return {"by_site": by_site.most_common(25), "by_pool": by_pool.most_common(10),
            "reserved_by_pool": _reserved_by_pool(snapshot), "reserved_by_stream": by_stream.most_common(40),
            "live_blocks_by_size": by_size.most_common(15)}


def _reserved_by_pool(snapshot: dict[str, Any]) -> list[tuple[str, int]]:
    pools: collections.Counter[str] = collections.Counter()
    for seg in snapshot.get("segments", []):
        pools[str(tuple(seg.get("segment_pool_id", (0, 0))))] += seg["total_size"]
    return pools.most_common(10)


def reachable_cuda_objects() -> dict[str, Any]:
    """CUDA tensors and CUDAGraphs Python still reaches, with what refers to the largest."""
    seen: dict[int, torch.Tensor] = {}
    graphs = 0
    warnings.simplefilter("ignore", FutureWarning)   # isinstance on deprecated torch module attributes
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.cuda.CUDAGraph):
                graphs += 1
            elif isinstance(obj, torch.Tensor) and obj.is_cuda:
                seen.setdefault(obj.untyped_storage().data_ptr(), obj)
        except Exception:  # some objects refuse isinstance/attribute checks mid-teardown
            continue
    largest = sorted(seen.values(), key=lambda t: t.untyped_storage().nbytes(), reverse=True)[:8]
    rows = []
    for t in largest:
        refs = [type(r).__name__ + (f"[{sorted(r)[:4]}]" if isinstance(r, dict) else "")
                for r in gc.get_referrers(t) if r is not seen and r is not largest][:4]
        rows.append({"shape": list(t.shape), "dtype": str(t.dtype), "bytes": t.untyped_storage().nbytes(),
                     "referrers": refs})
    return {"cuda_graphs_alive": graphs, "tensors": len(seen),
            "tensor_bytes": sum(t.untyped_storage().nbytes() for t in seen.values()), "largest": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="minicpmo45")
    parser.add_argument("--arms", default="on,off")
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    base = TickBenchConfig(preset=args.preset, device=device, sessions=(args.sessions,), ticks=2, warmup_ticks=8,
                           steady_window=cuda, profile_ticks=2 if cuda else 0,
                           workload="continuous", memory_budget="auto" if cuda else None, max_seconds=170,
                           graph_grid=(1, 4, 8, 16) if args.preset == "minicpmo45" else None)
    models = build_models(make_deploy(base), seed=0)
    weights = torch.cuda.memory_allocated() if cuda else 0
    report: dict[str, Any] = {"weights_allocated": weights, "arms": {}}
    shared_stream, previous = decode_graphs_module.warmup_stream, 0
    for name in args.arms.split(","):
        switches, _, fresh = name.partition("+")
        stream_of = (lambda device=None: torch.cuda.Stream(device)) if fresh else shared_stream
        decode_graphs_module.warmup_stream = graph_capture_module.warmup_stream = stream_of
        cfg = TickBenchConfig(**{**base.__dict__, **ARMS[switches]})
        if cuda:
            torch.cuda.memory._record_memory_history(enabled="state", stacks="python", max_entries=100_000)
        run_benchmark(cfg, models=models)
        gc.collect()
        arm: dict[str, Any] = {"reachable": reachable_cuda_objects()}
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            arm["allocated_over_weights"] = torch.cuda.memory_allocated() - weights
            arm["allocated_added_by_arm"] = arm["allocated_over_weights"] - previous
            previous = arm["allocated_over_weights"]
            arm["reserved"] = torch.cuda.memory_reserved()
            arm["live"] = attribute_live_blocks(torch.cuda.memory._snapshot())
            torch.cuda.memory._record_memory_history(enabled=None)
        report["arms"][name] = arm
        logger.info("%s: %s", name, json.dumps({k: v for k, v in arm.items() if k != "live"})[:2000])
        for site, size in arm.get("live", {}).get("by_site", [])[:10]:
            logger.info("  %8.1f MiB  %s", size / 2**20, site)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "leak_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
