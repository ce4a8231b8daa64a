"""bench/tick_profile.py: per-tick numbers from profiler averages, and the --profile-ticks wiring.

The summary is checked against hand-computed sums over fake averages (not torch's own tables);
the wiring test runs a tiny engine and requires the engine's stage ranges and Code2Wav's parts
to appear, so a range that is renamed or dropped fails here.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from duplexcache.bench import engine_ticks as et
from duplexcache.bench.tick_profile import profile_markdown, summarize_profile
from duplexcache.cfm.code2wav import PART_RANGE
from duplexcache.config import DeployConfig
from duplexcache.runtime.bundle import build_models
from duplexcache.runtime.engine import STAGE_RANGE

torch.set_num_threads(1)


def _avg(key, count, cpu, self_cpu, dev, self_dev):
    return SimpleNamespace(key=key, count=count, cpu_time_total=cpu, self_cpu_time_total=self_cpu,
                           device_time_total=dev, self_device_time_total=self_dev)


def test_summary_is_per_tick_and_splits_ranges_from_ops():
    evs = [_avg(STAGE_RANGE + "thinker", 2, 4000.0, 100.0, 3000.0, 0.0),
           _avg(PART_RANGE + "solve", 2, 1000.0, 50.0, 2500.0, 0.0),
           _avg("aten::mm", 40, 900.0, 900.0, 2000.0, 2000.0),
           _avg("aten::copy_", 100, 600.0, 500.0, 1000.0, 1000.0)]
    s = summarize_profile(evs, ticks=2, wall_s=[0.010, 0.030])
    assert s["wall_ms_per_tick"] == 20.0
    assert s["device_ms_per_tick"] == 1.5            # (2000 + 1000) us over 2 ticks, ranges excluded
    assert s["device_busy_fraction"] == 0.075
    ranges = {r["name"]: r for r in s["ranges"]}
    assert ranges[STAGE_RANGE + "thinker"] == {"name": STAGE_RANGE + "thinker", "calls_per_tick": 1.0,
                                               "host_ms_per_tick": 2.0, "device_ms_per_tick": 1.5}
    assert [o["name"] for o in s["top_device"]] == ["aten::mm", "aten::copy_"]
    assert s["top_host"][0] == {"name": "aten::mm", "calls_per_tick": 20.0, "host_ms_per_tick": 0.45,
                                "device_ms_per_tick": 1.0}
    assert "| aten::" not in profile_markdown(3, s)   # op names are code-quoted
    with pytest.raises(ValueError):
        summarize_profile(evs, ticks=0, wall_s=[])


def test_profile_ticks_reach_the_report_with_every_stage_range(tmp_path):
    models = build_models(DeployConfig.default("tiny"), seed=0)
    cfg = et.TickBenchConfig("tiny", "cpu", (2,), 1, 2, workload="continuous", profile_ticks=2)
    results = et.run_benchmark(cfg, tmp_path, models=models)
    run = results["runs"][0]
    assert run["status"] == "ok", run["note"]
    assert run["recorded_ticks"] == 1                 # profiled ticks are not recorded ticks
    prof = run["profile"]
    assert prof["ticks"] == 2
    names = {r["name"] for r in prof["ranges"]}
    assert {STAGE_RANGE + s for s in ("encoder", "thinker", "talker", "code2wav")} <= names
    assert {PART_RANGE + p for p in ("conformer", "solve", "vocoder")} <= names
    assert all(r["calls_per_tick"] == 1.0 for r in prof["ranges"])
    assert "Profile at 2 sessions" in (tmp_path / "results.md").read_text()
    assert results["config"]["profile_ticks"] == 2


def test_range_breakdown_counts_calls_inside_host_ranges_and_kernels_inside_device_spans():
    from duplexcache.bench.tick_profile import Span, range_breakdown
    name = STAGE_RANGE + "code2wav"
    spans = [Span(name, 0.0, 1000.0, False),            # host range
             Span(name, 100.0, 2100.0, True),            # its span on the device
             Span("cudaLaunchKernel", 10.0, 20.0, False),
             Span("cudaGraphLaunch", 30.0, 40.0, False),
             Span("cudaStreamSynchronize", 500.0, 900.0, False),
             Span("cudaLaunchKernel", 1500.0, 1510.0, False),   # after the host range: not counted
             Span("gemm", 0.0, 300.0, True),                   # 200 us inside the span
             Span("conv", 1000.0, 1500.0, True),
             Span("late", 2000.0, 2500.0, True)]               # 100 us inside
    (row,) = range_breakdown(spans, ticks=2)
    assert row == {"name": name, "syncs": 0.5, "sync_ms": 0.2, "launches": 1.0,
                   "device_span_ms": 1.0, "kernel_ms": 0.4}


def test_profiled_units_include_the_sync_sites_tick_on_cuda():
    """The feed must hold audio for every tick the profile runs (a short script failed a run)."""
    from duplexcache.bench.tick_profile import profiled_units
    assert profiled_units(2, torch.device("cpu")) == 2
    assert profiled_units(2, torch.device("cuda")) == 3
    assert profiled_units(0, torch.device("cuda")) == 0
