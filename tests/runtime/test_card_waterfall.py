"""Issue 43: the card waterfall adds up to the device total, each part the bytes it names; the
measured re-plan after the warm-up and its switches (engine.activation_from_warmup,
activation_margin, memory_headroom) are wired from the deploy YAML."""
from __future__ import annotations

import pytest
import torch

from duplexcache.runtime import warmup
from duplexcache.runtime.memory import memory_budget
from duplexcache.runtime.memory.admission import BudgetTooSmall
from duplexcache.runtime.bundle import build_models
from duplexcache.runtime.engine import DuplexEngine
from duplexcache.runtime.warmup import WarmupReport
from tests.runtime.engine_helpers import deploy_from_yaml, engine, tiny_models

MIB = 2**20


def _tensor_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def test_waterfall_sums_to_the_host_total_and_each_part_is_its_tensors(tmp_path):
    eng = engine(tmp_path, "wf")
    eng.warmup()
    wf = eng.waterfall()
    assert wf.parts_sum == wf.total_bytes
    models = eng.models
    # host total: the weights + the resolved budget (engine.memory_budget 512MiB in these tests)
    assert wf.total_bytes == models.weight_bytes() + 512 * MIB
    assert wf.part("weights") == sum(p.numel() * p.element_size() for m in
                                     (models.thinker, models.talker, models.audio_encoder, models.flow, models.hift)
                                     for p in m.parameters())
    tc, kc = eng.thinker_cache, eng.talker_cache
    assert wf.part("thinker_kv_pool") == _tensor_bytes(tc.k, tc.v, tc.k_scale, tc.v_scale)
    assert wf.part("talker_kv_pool") == _tensor_bytes(kc.k, kc.v, kc.k_scale, kc.v_scale)
    assert wf.part("code2wav_arena") == eng.code2wav.arena.nbytes() > 0
    assert wf.part("fixed_unattributed") == 0          # every fixed byte of the plan is named
    assert wf.part("activation_reserve") == eng.deploy.engine.activation_reserve
    assert wf.part("unplanned") >= 0
    assert wf.admitted == eng.plan.planned_sessions
    assert 0 < wf.ratio < 1
    assert wf.lines()[-1].startswith("admitted / floor-limited = ")
    data = wf.to_json()
    assert sum(p["bytes"] for p in data["parts"]) == data["total_bytes"] == data["parts_sum_bytes"]
    eng.shutdown()


def test_waterfall_png(tmp_path):
    from duplexcache.runtime.memory.waterfall import plot_waterfall

    eng = engine(tmp_path, "png")
    path = plot_waterfall(eng.waterfall(), tmp_path / "waterfall.png")
    assert path.stat().st_size > 1000
    eng.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.xfail(strict=False, raises=BudgetTooSmall, reason=(
    "measured on an H100 (2026-12-07, docs/results/card_h100_2026-12-07_arena/card_tests_cuda.log): tiny under a "
    "fixed 4 GiB budget plans ~440 sessions, warm-up 1 captures graph buckets that large and peaks 5.4 GiB above "
    "the pools, so the re-plan's measured reserve exceeds the whole budget (BudgetTooSmall). The re-plan does not "
    "converge when the warm-up peak grows with the planned sessions faster than the sessions' own bytes; "
    "minicpmo45 is unaffected (the card runs in docs/benchmarks.md). Open in issue 43."))
def test_waterfall_sums_to_the_card_on_cuda(tmp_path):
    """On the GPU: the parts add up to mem_get_info's total exactly, the remainders are small,
    and the allocator's slack after the warm-up is at most 1 GiB (run with
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as serve sets it)."""
    # a fixed budget: tiny under an auto budget would plan thousands of sessions on an 80 GB card
    # (the minicpmo45 auto path runs in scripts/gpu_bench.sh card_waterfall)
    deploy = deploy_from_yaml(tmp_path, "cuda", {"model": {"device": "cuda"},
                                                 "engine": {"memory_budget": "4GiB", "activation_from_warmup": True,
                                                            "activation_margin": "256MiB"}})
    eng = DuplexEngine(deploy, build_models(deploy, seed=0))
    eng.warmup()
    wf = eng.waterfall()
    _, total = torch.cuda.mem_get_info()
    assert wf.total_bytes == total == wf.parts_sum
    assert abs(wf.part("other_allocated")) < 0.01 * total
    assert 0 <= wf.part("allocator_slack") <= 2**30
    assert wf.part("free_unplanned") >= 0
    assert wf.part("thinker_kv_pool") > 0 and wf.part("talker_kv_pool") > 0
    assert eng.activation_reserve < 4 * 2**30   # re-planned from the measured peak
    eng.shutdown()


def _measured(monkeypatch, peak: int, free: int | None = None) -> None:
    """A device that measures (as CUDA does): the warm-up reports ``peak``; ``free`` device memory."""
    monkeypatch.setattr(warmup, "activation_peak", lambda engine: peak)
    if free is not None:
        monkeypatch.setattr(memory_budget, "device_free_bytes", lambda device: free)


def test_activation_from_warmup_replans_from_the_measured_peak(tmp_path, monkeypatch):
    sections = {"engine": {"memory_budget": "256MiB", "activation_reserve": "64MiB",
                           "activation_from_warmup": True, "activation_margin": "4MiB"}}
    eng = engine(tmp_path, "replan", sections)
    first = eng.plan
    _measured(monkeypatch, 12 * MIB)
    eng.warmup()
    # reserve = the measured peak (nothing held after releasing the pools on CPU) + the margin
    assert eng.activation_reserve == 16 * MIB
    assert eng.plan.budget_bytes == 256 * MIB - 16 * MIB
    assert eng.plan.planned_sessions > first.planned_sessions
    assert eng.waterfall().part("activation_reserve") == 16 * MIB
    sid = eng.open_session({"voice": "default"})   # the re-planned engine serves
    assert sid in eng.session_ids()
    eng.shutdown()


def test_activation_from_warmup_off_keeps_the_plan(tmp_path, monkeypatch):
    eng = engine(tmp_path, "noreplan", {"engine": {"memory_budget": "256MiB", "activation_reserve": "64MiB",
                                                    "activation_from_warmup": False}})
    first = eng.plan
    _measured(monkeypatch, 12 * MIB)
    eng.warmup()
    assert eng.plan is first and eng.activation_reserve == 64 * MIB
    eng.shutdown()


def test_auto_budget_after_warmup_is_free_less_the_headroom(tmp_path, monkeypatch):
    sections = {"engine": {"memory_budget": "auto", "activation_reserve": "64MiB", "activation_from_warmup": True,
                           "activation_margin": "4MiB", "memory_headroom": "32MiB"}}
    deploy = deploy_from_yaml(tmp_path, "auto", sections)
    eng = DuplexEngine(deploy, tiny_models())
    _measured(monkeypatch, 12 * MIB, free=300 * MIB)
    eng.warmup()
    fixed = eng.sizing.fixed_bytes()
    # budget = fixed + free - memory_headroom, of which the measured reserve is kept back
    assert eng.plan.budget_bytes + eng.activation_reserve == fixed + 300 * MIB - 32 * MIB
    assert eng.headroom_bytes == 32 * MIB
    eng.shutdown()
