"""Runs the A/B sweep: every configuration at every session count, in one process.

Per (configuration, n), on a fresh target (fresh pools and caches, shared weights)::

    open n sessions + first unit      -> "setup" sample (context prefilled, voice set up, unit 1 done)
    units 2 .. units                  -> Code2Wav owns P private frames, cache at P + 100
    fast-forward the Thinker window   -> every session at prefix + high_tokens
                                      -> "steady" sample
    one more unit at steady state     (exercises the window compaction)
    outputs (text ids + pcm of every unit) compared with all_off at the same n: torch.equal

The all_off configuration runs first so the others can be compared with it as they finish.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from duplexcache.bench.matrix import BASELINE, BenchConfig
from duplexcache.bench.memory import Tier

if TYPE_CHECKING:
    from duplexcache.bench.engine_target import EngineTarget

logger = logging.getLogger(__name__)


# The runner drives an ``engine_target.EngineTarget`` (one per configuration and session count).
MakeTarget = Callable[[BenchConfig, int], "EngineTarget"]


@dataclass
class Point:
    """One (configuration, n) measurement."""

    sessions: int
    setup: dict[str, Tier]
    steady: dict[str, Tier]
    tick_s: list[float]
    cuda: dict[str, dict[str, int]] | None = None


@dataclass
class ConfigResult:
    config: BenchConfig
    points: list[Point] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    compared_sessions: int = 0

    @property
    def equal_to_all_off(self) -> bool:
        return not self.mismatches and self.compared_sessions > 0


class _CudaMeter:
    """Allocator deltas since the target was created: allocated, peak allocated, reserved."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.enabled = device.type == "cuda"
        if self.enabled:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            self.base_alloc = torch.cuda.memory_allocated(device)
            self.base_reserved = torch.cuda.memory_reserved(device)

    def sample(self) -> dict[str, int] | None:
        if not self.enabled:
            return None
        torch.cuda.synchronize(self.device)
        return {
            "allocated_delta": torch.cuda.memory_allocated(self.device) - self.base_alloc,
            "peak_allocated_delta": torch.cuda.max_memory_allocated(self.device) - self.base_alloc,
            "reserved_delta": torch.cuda.memory_reserved(self.device) - self.base_reserved,
        }


def measure_point(target: EngineTarget, n: int, units: int, device: torch.device,
                  ff_chunk: int) -> tuple[Point, dict]:
    """Run the per-n script above on ``target``; returns the point and the outputs."""
    if units < 1:
        raise ValueError(f"units must be >= 1 (got {units})")
    meter = _CudaMeter(device)
    target.open_sessions(n)
    setup, cuda_setup = target.pools(), meter.sample()
    while target.units < units:
        target.run_unit()
    target.fast_forward_window(ff_chunk)
    steady, cuda_steady = target.pools(), meter.sample()
    target.run_unit()
    cuda = None if cuda_setup is None else {"setup": cuda_setup, "steady": cuda_steady}
    return Point(n, setup, steady, list(target.tick_s), cuda), target.outputs


def compare_outputs(name: str, n: int, outputs: dict, baseline: dict) -> list[str]:
    """Mismatch descriptions (empty = every session's text and audio torch.equal the baseline)."""
    bad = []
    if set(outputs) != set(baseline):
        return [f"{name} n={n}: session ids differ from {BASELINE}"]
    for sid in sorted(outputs):
        a, b = outputs[sid], baseline[sid]
        if a.text != b.text:
            bad.append(f"{name} n={n} {sid}: text differs")
        if len(a.audio) != len(b.audio) or not all(torch.equal(x, y) for x, y in zip(a.audio, b.audio)):
            bad.append(f"{name} n={n} {sid}: audio differs")
    return bad


def run_sweep(configs: Sequence[BenchConfig], sessions: Sequence[int], make_target: MakeTarget,
              units: int, device: torch.device, ff_chunk: int = 512, progress=None) -> list[ConfigResult]:
    """Every configuration at every session count; ``configs[0]`` must be all_off."""
    if not configs or configs[0].name != BASELINE:
        raise ValueError(f"the first configuration must be {BASELINE!r} (the equality reference)")
    if len(set(sessions)) < 2:
        raise ValueError(f"need at least two distinct session counts for a slope, got {list(sessions)}")
    baseline: dict[int, dict] = {}
    results = []
    for cfg in configs:
        res = ConfigResult(cfg)
        for n in sessions:
            if progress is not None:
                progress.set_postfix_str(f"{cfg.name} n={n}")
            target = make_target(cfg, n)
            try:
                point, outputs = measure_point(target, n, units, device, ff_chunk)
            finally:
                target.close()
            res.points.append(point)
            if cfg.name == BASELINE:
                baseline[n] = outputs
            res.mismatches += compare_outputs(cfg.name, n, outputs, baseline[n])
            res.compared_sessions += len(outputs)
            del target, outputs
            gc.collect()
            if device.type == "cuda":
                # The next engine checks the free memory before preallocating its pools; the
                # caching allocator would otherwise still hold this engine's pools.
                torch.cuda.empty_cache()
            if progress is not None:
                progress.update(1)
        for msg in res.mismatches:
            logger.warning("equality check failed: %s", msg)
        results.append(res)
    return results
