"""Where the first tick of a long context's prefill goes (issue 11): the prefill bench with the
context build, the Stage 0 chunk and the rest of the tick timed separately (synchronised).

    python scripts/probes/prefill_first_tick_profile.py [--sessions 32] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from duplexcache.bench.engine_ticks_config import TickBenchConfig, make_deploy
from prefill_isolation import CONTINUOUS   # its sibling probe (scripts/probes/)
import prefill_isolation
from duplexcache.config import DeployConfig
from duplexcache.runtime.stage0 import runner as stage0_module
from duplexcache.runtime.stages import thinker_stage

logger = logging.getLogger("prefill_first_tick_profile")
TIMINGS: list[tuple[str, float]] = []


def timed(name, fn):
    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.synchronize()
            TIMINGS.append((name, time.perf_counter() - start))
    return wrapper


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    p = argparse.ArgumentParser()
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--out", type=Path, default=Path("out/prefill_profile"))
    a = p.parse_args()
    cfg = TickBenchConfig(preset="minicpmo45", device="cuda", sessions=(a.sessions,), memory_budget="100GiB",
                          warmup_ticks=8, seed=0, speak_k=CONTINUOUS, turn_units=CONTINUOUS)
    raw = make_deploy(cfg).to_dict()
    raw["engine"]["tick_headroom"] = 1e9
    deploy = DeployConfig.from_dict(raw, environ={})
    # time the pieces of a prefill tick
    stage = thinker_stage.ThinkerStage
    original_open = stage.open_pending

    def open_pending(self, pending, tick):
        if not any(s.prefill_tick is None for s in pending):
            return timed("stage0.prefill (a chunk)", original_open)(self, pending, tick)
        real_build = self.builder.build
        self.builder.build = timed("context build (tokenize, embed, reference audio)", real_build)
        try:
            return timed("open_pending (first tick, total)", original_open)(self, pending, tick)
        finally:
            self.builder.build = real_build

    stage.open_pending = open_pending
    runner = stage0_module.Stage0Runner
    runner._start_prefill = timed("stage0._start_prefill (allocate, hash, copy)", runner._start_prefill)
    result = prefill_isolation.measure(deploy, a.sessions, 8, 4, 0)
    a.out.mkdir(parents=True, exist_ok=True)
    rows = [{"what": n, "ms": round(1e3 * t, 2)} for n, t in TIMINGS]
    (a.out / "results.json").write_text(json.dumps({"timings": rows, "prefill_ms": result["prefill_ms"],
                                                    "baseline_ms": result["baseline_ms"]}, indent=1))
    for row in rows:
        print(f"{row['what']:55s} {row['ms']:9.2f} ms")
    print("prefill ticks (ms):", [round(t) for t in result["prefill_ms"]["ticks"]])


if __name__ == "__main__":
    main()
