"""Issue 43: the card waterfall adds up to the device total, each part the bytes it names; the
measured re-plan after the warm-up and its switches (engine.activation_from_warmup,
memory_headroom) are wired from the deploy YAML, its margin is replan.ACTIVATION_MARGIN."""
from __future__ import annotations

import pytest
import torch

from duplexcache.runtime.memory import memory_budget, replan
from duplexcache.runtime.memory.admission import BudgetTooSmall
from duplexcache.runtime.bundle import build_models
from duplexcache.runtime.engine import DuplexEngine
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
    from duplexcache.bench.plot import plot_waterfall

    eng = engine(tmp_path, "png")
    path = plot_waterfall(eng.waterfall(), tmp_path / "waterfall.png")
    assert path.stat().st_size > 1000
    eng.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_waterfall_sums_to_the_card_on_cuda(tmp_path, monkeypatch):
    """On the GPU: the parts add up to mem_get_info's total exactly, the remainders are small,
    and the allocator's slack after the warm-up is at most 1 GiB (run with
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as serve sets it)."""
    # a fixed budget: tiny under an auto budget would plan thousands of sessions on an 80 GB card
    # (the minicpmo45 auto path runs in scripts/gpu_bench.sh card_waterfall)
    monkeypatch.setattr(replan, "ACTIVATION_MARGIN", 256 * MIB)   # a margin in scale with the 4 GiB budget
    deploy = deploy_from_yaml(tmp_path, "cuda", {"model": {"device": "cuda"},
                                                 "engine": {"memory_budget": "4GiB", "activation_from_warmup": True}})
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


def _small_margin(monkeypatch) -> None:
    """The re-plan's margin (1 GiB on a card) scaled to these CPU budgets of a few hundred MiB."""
    assert replan.ACTIVATION_MARGIN == 2**30
    monkeypatch.setattr(replan, "ACTIVATION_MARGIN", 4 * MIB)


def _measured(monkeypatch, peak: int, free: int | None = None) -> None:
    """A device that measures (as CUDA does): the warm-up reports ``peak``; ``free`` device memory."""
    _small_margin(monkeypatch)
    monkeypatch.setattr(replan, "activation_peak", lambda engine: peak)
    if free is not None:
        monkeypatch.setattr(memory_budget, "device_free_bytes", lambda device: free)


def test_activation_from_warmup_replans_from_the_measured_peak(tmp_path, monkeypatch):
    sections = {"engine": {"memory_budget": "256MiB", "activation_reserve": "64MiB",
                           "activation_from_warmup": True}}
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
                           "memory_headroom": "32MiB"}}
    deploy = deploy_from_yaml(tmp_path, "auto", sections)
    eng = DuplexEngine(deploy, tiny_models())
    _measured(monkeypatch, 12 * MIB, free=300 * MIB)
    eng.warmup()
    fixed = eng.sizing.fixed_bytes()
    # budget = fixed + free - memory_headroom, of which the measured reserve is kept back
    assert eng.plan.budget_bytes + eng.activation_reserve == fixed + 300 * MIB - 32 * MIB
    assert eng.headroom_bytes == 32 * MIB
    eng.shutdown()


def test_a_peak_the_budget_cannot_hold_is_scaled_to_the_batch_and_checked(tmp_path, monkeypatch):
    """A small preset under a fixed budget (the CUDA failure of 2026-12-07): plan 1 holds many
    sessions, so warm-up 1 measures activations at graph batches that large and its peak alone
    exceeds the budget. The re-plan reserves the peak in proportion to the sessions it can still
    hold, and the next warm-up, measuring at that plan's batches, confirms the estimate."""
    sections = {"engine": {"memory_budget": "256MiB", "activation_reserve": "64MiB",
                           "activation_from_warmup": True}}
    eng = engine(tmp_path, "scaled", sections)
    first = eng.plan.planned_sessions
    per_session = 2 * 256 * MIB // first          # activations in proportion to the graph batches
    peaks = []

    def peak(engine):
        peaks.append(per_session * engine.plan.planned_sessions)
        return peaks[-1]

    _small_margin(monkeypatch)
    monkeypatch.setattr(replan, "activation_peak", peak)
    with pytest.raises(BudgetTooSmall):              # the measured peak as such leaves no session
        eng.sizing.plan(activation_reserve=per_session * first + 4 * MIB)
    eng.warmup()
    n = eng.plan.planned_sessions
    assert 1 <= n < first
    # the reserve is the peak's share for n sessions (+ the margin); the last warm-up measured under it
    assert eng.activation_reserve >= per_session * n + 4 * MIB
    assert len(peaks) == 2 and peaks[-1] <= eng.activation_reserve
    sid = eng.open_session({"voice": "default"})
    assert sid in eng.session_ids()
    eng.shutdown()


def test_an_estimate_the_next_warmup_exceeds_is_replanned_from_that_peak(tmp_path, monkeypatch):
    """The scaled reserve is an estimate, checked: when the next warm-up's own peak runs over it,
    the engine re-plans from the line through the two measurements, and stops re-planning once a
    warm-up measures under its reserve (at most MAX_ESTIMATED_REPLANS times)."""
    sections = {"engine": {"memory_budget": "256MiB", "activation_reserve": "64MiB",
                           "activation_from_warmup": True}}
    eng = engine(tmp_path, "rechecked", sections)
    peaks, reserves = [], []

    def peak(engine):
        reserves.append(engine.activation_reserve)
        if len(peaks) == 0:
            peaks.append(512 * MIB)                              # more than the whole budget
        elif len(peaks) == 1:
            peaks.append(engine.activation_reserve + 8 * MIB)    # over the estimate
        else:
            peaks.append(MIB)                                    # under any reserve
        return peaks[-1]

    _small_margin(monkeypatch)
    monkeypatch.setattr(replan, "activation_peak", peak)
    eng.warmup()
    assert len(peaks) == 3
    assert reserves[2] != reserves[1] and peaks[-1] <= eng.activation_reserve == reserves[2]
    eng.shutdown()


def test_estimated_replans_are_bounded(tmp_path, monkeypatch, caplog):
    """Each estimated re-plan costs a whole warm-up: after MAX_ESTIMATED_REPLANS the engine serves
    with the last plan and says the reserve ran short."""
    sections = {"engine": {"memory_budget": "256MiB", "activation_reserve": "64MiB",
                           "activation_from_warmup": True}}
    eng = engine(tmp_path, "bounded", sections)
    peaks = []

    def peak(engine):   # too large for the budget, then over the estimate
        peaks.append(512 * MIB if not peaks else engine.activation_reserve + 8 * MIB)
        return peaks[-1]

    _small_margin(monkeypatch)
    monkeypatch.setattr(replan, "activation_peak", peak)
    monkeypatch.setattr(replan, "MAX_ESTIMATED_REPLANS", 1)
    eng.warmup()
    assert len(peaks) == 2 and peaks[-1] > eng.activation_reserve
    assert "still exceeds the reserve" in caplog.text
    assert eng.open_session({"voice": "default"}) in eng.session_ids()   # it serves with the last plan
    eng.shutdown()
