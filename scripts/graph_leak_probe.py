"""Which graph switch keeps device memory after its engine is freed? (tiny preset, CUDA).

For each arm: build an engine, warm up, run a few ticks with two sessions, shut down, drop every
reference, collect, empty the cache, and print torch.cuda.memory_allocated / reserved against
the weights alone. Usage: python3 scripts/graph_leak_probe.py
"""
from __future__ import annotations

import gc
import logging

import numpy as np
import torch

from duplexcache.config import DeployConfig
from duplexcache.runtime.bundle import build_models
from duplexcache.runtime.engine import DuplexEngine

ARMS = {"off": {}, "ragged": {"ragged_step_graphs": True}, "encoder": {"encoder_cuda_graphs": True},
        "units": {"talker_unit_graphs": True}}


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    base = DeployConfig.from_yaml("duplexcache/configs/tiny.yaml")
    cuda = torch.cuda.is_available()
    base.model.device = "cuda" if cuda else "cpu"   # CPU: a dry run of the script itself
    models = build_models(base)
    weights = torch.cuda.memory_allocated() if cuda else 0
    for name, switches in ARMS.items():
        deploy = DeployConfig.from_yaml("duplexcache/configs/tiny.yaml")
        deploy.model.device = base.model.device
        for key, value in switches.items():
            setattr(deploy.engine, key, value)
        eng = DuplexEngine(deploy, models)
        eng.warmup()
        sids = [eng.open_session({}) for _ in range(2)]
        for sid in sids:
            eng.push_audio(sid, (np.random.default_rng(0).standard_normal(16000 * 3) * 0.1).astype(np.float32))
        for _ in range(3):
            eng.tick()
        for sid in sids:
            eng.close_session(sid)
        eng.shutdown()
        del eng
        gc.collect()
        if not cuda:
            print(f"{name}: ran (CPU)", flush=True)
            continue
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        print(f"{name}: allocated +{(torch.cuda.memory_allocated() - weights) / 2**20:.1f} MiB, "
              f"reserved {torch.cuda.memory_reserved() / 2**20:.1f} MiB", flush=True)


if __name__ == "__main__":
    main()
