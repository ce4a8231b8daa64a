"""Warm start of one engine: time to ready, graphs captured, and captures inside the first ticks.

    python scripts/probes/warm_start.py --config examples/minicpmo45-shared.yaml \\
        [--sessions 24] [--ticks 4] [--no-warmup] [--out DIR]

Builds the config's models and engine (``engine.memory_budget`` as configured, ``auto`` by
default), runs ``DuplexEngine.warmup()`` (unless ``--no-warmup``: the cold A/B), then opens
``--sessions`` sessions at once (voices alternating) and runs ``--ticks`` ticks with every
session's audio buffered, as if all clients connected in the same second. Reports: models and
engine build time, warm-up seconds and graphs (per model, Code2Wav), the graph captures of each
tick (0 after a warm-up), each tick's wall time and the tick in which every session got its
first audio. Writes ``warm_start.json`` under ``--out``. Speeds are for the report, never asserted.
A probe (its runs: docs/results/HISTORY.md); until issue 44 it was ``duplexcache bench warm-start``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from duplexcache.bench.common import usage_error, write_results
from duplexcache.config import ConfigError, DeployConfig
from duplexcache.models.checkpoint import CheckpointError
from duplexcache.runtime.bundle import build_models
from duplexcache.runtime.device import device_problem
from duplexcache.runtime.engine import DuplexEngine
from duplexcache.runtime.engine_api import AudioDelta

logger = logging.getLogger(__name__)

FIRST_UNIT, UNIT = 16_560, 16_000


def _audio(seed: int, units: int) -> np.ndarray:
    n = FIRST_UNIT + UNIT * (units - 1)
    return np.random.default_rng(seed).uniform(-0.3, 0.3, n).astype(np.float32)


def measure(deploy: DeployConfig, sessions: int, ticks: int, warmup: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    models = build_models(deploy)
    t_models = time.perf_counter() - t0
    eng = DuplexEngine(deploy, models)
    t_engine = time.perf_counter() - t0 - t_models
    report = eng.warmup() if warmup else None
    ready_s = time.perf_counter() - t0
    voices = eng.voices.names()
    sids = [eng.open_session({"voice": voices[i % len(voices)]}, queue_if_full=True) for i in range(sessions)]
    for i, sid in enumerate(sids):
        if not eng.is_queued(sid):
            eng.push_audio(sid, _audio(i, ticks))
    first_audio: dict[str, int] = {}
    per_tick = []
    for k in range(ticks):
        before = eng.stats().graph_captures.get("tick", 0)
        start = time.perf_counter()
        events = eng.tick()
        wall = time.perf_counter() - start
        for e in events:
            if isinstance(e, AudioDelta):
                first_audio.setdefault(e.sid, k + 1)
        captures = eng.stats().graph_captures.get("tick", 0) - before
        per_tick.append({"tick": k + 1, "wall_s": round(wall, 4), "graph_captures": captures})
        logger.info("tick %d: %.3f s, %d graph captures, %d/%d sessions have audio", k + 1, wall, captures,
                    len(first_audio), len(sids))
    stats = eng.stats()
    eng.shutdown()
    return {
        "config": {"preset": deploy.model.preset, "device": deploy.model.device, "sessions": sessions,
                   "ticks": ticks, "warmup": warmup, "memory_budget": str(deploy.engine.memory_budget),
                   "planned_sessions": eng.plan.planned_sessions},
        "models_s": round(t_models, 3), "engine_s": round(t_engine, 3), "ready_s": round(ready_s, 3),
        "warmup": None if report is None else {
            "seconds": round(report.seconds, 3), "graphs": report.graphs,
            "decode_graphs": report.decode_graphs, "code2wav_graphs": report.code2wav_graphs,
            "kernels": list(report.kernels)},
        "graph_captures": dict(stats.graph_captures),
        "per_tick": per_tick,
        "first_audio_tick": {sid: first_audio.get(sid) for sid in sids},
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="deploy YAML")
    p.add_argument("--sessions", type=int, default=24)
    p.add_argument("--ticks", type=int, default=4)
    p.add_argument("--no-warmup", action="store_true", help="the cold A/B: capture lazily inside ticks")
    p.add_argument("--out", type=Path, help="directory for warm_start.json")


def run(a: argparse.Namespace) -> int:
    if a.sessions < 1 or a.ticks < 1:
        return usage_error("warm-start", "--sessions and --ticks must be >= 1")
    try:
        deploy = DeployConfig.from_yaml(a.config)
    except (ConfigError, OSError) as exc:
        return usage_error("warm-start", str(exc))
    problem = device_problem(deploy.model.device)   # a cuda config on a machine without it: one line, nothing built
    if problem:
        return usage_error("warm-start", problem)
    try:
        result = measure(deploy, a.sessions, a.ticks, not a.no_warmup)
    except CheckpointError as exc:
        return usage_error("warm-start", f"checkpoint: {exc}")
    print(json.dumps(result, indent=2))
    if a.out is not None:
        write_results(a.out, result, stem="warm_start")
    return 0


if __name__ == "__main__":   # a probe script: python scripts/probes/warm_start.py ARGS (duplexcache importable)
    _parser = argparse.ArgumentParser(prog="scripts/probes/warm_start.py", description=__doc__.split("\n\n")[0])
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
