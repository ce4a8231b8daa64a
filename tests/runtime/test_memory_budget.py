"""``engine.memory_budget`` resolution (runtime/memory/memory_budget.py) and the packaged configs'
budgets on an H200 and an 80 GB card, computed on the ``meta`` device.

The minicpmo45 engine is built on ``meta`` (shapes and bytes only, no weights: never build
minicpmo45 weights on a CPU) with the free device memory injected, so the plan is the engine's own
arithmetic end to end. Free memory after the weights, from the H200 start-up failure of issue 10:
115 341 166 944 bytes of ~141 GB; an 80 GB card keeps the same ~25.7 GB outside (weights, CUDA
context), so 54.3 GB.
"""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from engine_helpers import engine

from duplexcache.config import DeployConfig, packaged_config_path
from duplexcache.kv.decode_graphs import batch_buckets, width_classes
from duplexcache.runtime.memory import memory_budget as MB
from duplexcache.runtime import warmup as W
from duplexcache.runtime.engine import DuplexEngine

GB = 10**9
H200_AVAILABLE = 115_341_166_944            # free after the weights on the H200 (measured)
CARD_80GB_AVAILABLE = 80 * GB - (141 * GB - H200_AVAILABLE)
CARDS = {"H200": H200_AVAILABLE, "80GB": CARD_80GB_AVAILABLE}
CONFIGS = {"minicpmo45.yaml": packaged_config_path("minicpmo45"),
           "minicpmo45-shared.yaml": Path(__file__).resolve().parents[2] / "examples" / "minicpmo45-shared.yaml",
           "minicpmo45-capacity.yaml": Path(__file__).resolve().parents[2] / "examples" / "minicpmo45-capacity.yaml"}


# ---------------------------------------------------------------------------- arithmetic

def _engine_cfg(**engine):
    return DeployConfig.from_dict({"engine": engine}, environ={}).engine


def test_auto_takes_the_share_of_what_is_free(monkeypatch):
    cfg = _engine_cfg(memory_budget="auto", activation_reserve="8GiB")
    assert MB.AUTO_FREE_SHARE == 0.9
    assert MB.resolve_memory_budget(cfg, 10 * GB, 100 * GB) == 10 * GB + 90 * GB
    monkeypatch.setattr(MB, "AUTO_FREE_SHARE", 0.5)   # the constant, not a literal, sizes the budget
    assert MB.resolve_memory_budget(cfg, 10 * GB, 100 * GB) == 60 * GB
    with pytest.raises(ValueError, match="activation_reserve"):   # nothing left for sessions
        MB.resolve_memory_budget(cfg, 10 * GB, 2 * GB)


def test_fixed_budget_must_fit_what_is_free():
    cfg = _engine_cfg(memory_budget="120GiB", activation_reserve="8GiB")
    fixed = 19 * GB
    with pytest.raises(MB.BudgetExceedsDevice) as info:
        MB.resolve_memory_budget(cfg, fixed, H200_AVAILABLE - fixed, where="cuda:0")
    assert str(info.value).startswith(f"engine.memory_budget {120 * 2**30} bytes exceeds the {H200_AVAILABLE} "
                                      "bytes available on cuda:0")
    assert MB.resolve_memory_budget(cfg, fixed, None) == 120 * 2**30      # host device: not checked
    ok = _engine_cfg(memory_budget="100GiB", activation_reserve="8GiB")
    assert MB.resolve_memory_budget(ok, fixed, H200_AVAILABLE - fixed) == 100 * 2**30


def test_cuda_free_memory_is_read_after_the_allocator_releases_its_cache(monkeypatch):
    """The auto budget on CUDA must not depend on what the caching allocator happens to hold:
    the temporaries of building the weights stay cached (reserved, counted as used by the
    driver) until something empties the cache. Simulated allocator: 13 GiB cached, released by
    ``empty_cache``; free memory must be read after the release."""
    cached = {"bytes": 13 * 2**30}
    calls = []

    def empty_cache():
        calls.append("empty_cache")
        cached["bytes"] = 0

    def mem_get_info(device=None):
        calls.append("mem_get_info")
        return 40 * 2**30 - cached["bytes"], 80 * 2**30

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    assert MB.device_free_bytes(torch.device("cuda", 0)) == 40 * 2**30
    assert calls == ["empty_cache", "mem_get_info"]
    assert MB.device_free_bytes(torch.device("cpu")) is None and calls == ["empty_cache", "mem_get_info"]


def test_host_ram_is_memavailable_not_memfree(tmp_path, monkeypatch):
    """A machine that has read many files (a CI runner after pip install) has little MemFree and
    much reclaimable page cache; auto on CPU must count the cache (CI once refused the tests'
    sessions with capacity_memory when this read MemFree)."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        8000000 kB\nMemFree:          300000 kB\n"
                       "MemAvailable:    6000000 kB\nCached:          5000000 kB\n")
    assert MB.host_available_bytes(str(meminfo)) == 6_000_000 * 1024
    monkeypatch.setattr(MB.os, "sysconf", lambda name: {"SC_AVPHYS_PAGES": 10, "SC_PAGE_SIZE": 4096}[name])
    assert MB.host_available_bytes(str(tmp_path / "absent")) == 40960          # no /proc: sysconf
    meminfo.write_text("MemTotal:        8000000 kB\nMemFree:          300000 kB\n")   # old kernels
    assert MB.host_available_bytes(str(meminfo)) == 40960


def test_auto_on_a_host_device(monkeypatch):
    cfg = _engine_cfg()
    monkeypatch.setattr(MB, "host_available_bytes", lambda: 64 * GB)
    assert MB.resolve_memory_budget(cfg, 0, None) == MB.CPU_AUTO_BUDGET == 512 * 2**20
    monkeypatch.setattr(MB, "host_available_bytes", lambda: 400 * 2**20)   # a small machine
    assert MB.resolve_memory_budget(cfg, 0, None) == int(0.9 * 400 * 2**20)


def test_tiny_default_serves_with_auto_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(MB, "host_available_bytes", lambda: 64 * GB)
    eng = engine(tmp_path, "auto", {"engine": {"memory_budget": "auto"}})   # the packaged default
    assert eng.deploy.engine.memory_budget == "auto"
    assert eng.plan.budget_bytes == MB.CPU_AUTO_BUDGET - eng.deploy.engine.activation_reserve
    assert eng.plan.planned_sessions >= 4


# ---------------------------------------------------------------------------- minicpmo45 on meta

@pytest.fixture(scope="module")
def meta_models():
    from duplexcache.runtime.bundle import meta_model_bundle

    return meta_model_bundle("minicpmo45")


def _meta_engine(monkeypatch, models, path: Path, budget: str | None = None, available: int | None = None):
    """The engine of a deploy YAML on meta; ``available``: device bytes free after the weights."""
    from duplexcache.models.audio_encoder import AudioEncoder

    # The reference-audio length check reads values (isfinite), which meta tensors do not have.
    monkeypatch.setattr(AudioEncoder, "_check_mel", lambda self, mel, batched: None)
    raw = DeployConfig.from_yaml(path, environ={}).to_dict()
    raw["model"]["device"] = "meta"
    if budget is not None:
        raw["engine"]["memory_budget"] = budget
    deploy = DeployConfig.from_dict(raw, environ={})
    if available is not None:
        # What mem_get_info would say once the fixed allocations (arena, voices) are made: the
        # engine asks after allocating them, so the injected figure is ``available - fixed``.
        resolve = MB.resolve_memory_budget

        def on_the_card(engine_cfg, fixed, free, *, where="the device"):
            assert free is None, "meta is not a CUDA device: nothing measured"
            return resolve(engine_cfg, fixed, available - fixed, where=where)

        monkeypatch.setattr(MB, "resolve_memory_budget", on_the_card)
    return DuplexEngine(deploy, models)


@pytest.mark.parametrize("card", CARDS)
@pytest.mark.parametrize("config", CONFIGS)
def test_packaged_minicpmo45_configs_start_on_h200_and_80gb(monkeypatch, caplog, meta_models, config, card):
    caplog.set_level(logging.INFO)
    available = CARDS[card]
    eng = _meta_engine(monkeypatch, meta_models, CONFIGS[config], available=available)
    plan, e = eng.plan, eng.deploy.engine
    assert e.memory_budget == "auto" and MB.AUTO_FREE_SHARE == 0.9
    budget = plan.budget_bytes + e.activation_reserve
    assert budget == plan.fixed_bytes + int(0.9 * (available - plan.fixed_bytes))
    assert available - budget >= 0.1 * (available - plan.fixed_bytes) - 1   # the headroom stays free
    assert plan.planned_sessions >= 2
    # What its warm-up captures (the counts docs/engine.md quotes).
    buckets = batch_buckets(plan.planned_sessions)
    thinker_w = width_classes(W.thinker_width_bound(eng))
    talker_w = width_classes(-(-eng.models.talker.config.max_position_embeddings // eng.block_size))
    c2w = W.code2wav_keys(eng)
    logging.getLogger(__name__).info(
        "%s on %s: budget %.1f GB, fixed %.1f GB, %d sessions; warm-up: %d decode graphs "
        "(%d buckets x (%d Thinker + %d Talker widths)), %d Code2Wav graphs", config, card, budget / GB,
        plan.fixed_bytes / GB, plan.planned_sessions, len(buckets) * (len(thinker_w) + len(talker_w)),
        len(buckets), len(thinker_w), len(talker_w), len(c2w))
    assert thinker_w[-1] <= 1024 and len(c2w) >= 1


def test_a_fixed_budget_above_the_h200s_free_memory_is_refused(monkeypatch, meta_models):
    """The issue-10 start-up failure, kept for fixed budgets: 120 GiB on the H200."""
    with pytest.raises(MB.BudgetExceedsDevice, match=f"exceeds the {H200_AVAILABLE} bytes available"):
        _meta_engine(monkeypatch, meta_models, CONFIGS["minicpmo45-shared.yaml"], budget="120GiB",
                     available=H200_AVAILABLE)


def test_code2wav_arena_rows_hold_the_chunk_only_and_the_plan_admits_more(monkeypatch, meta_models):
    """Issue 43: the arena's key storage is rows x the widest chunk (the setup pass's P frames
    fit in it), not rows x K (K = chunk + P + tail, the old layout's whole cache per row); the
    plan's fixed bytes drop by exactly the difference and the same card plans more sessions."""
    from duplexcache.cfm.arena import EulerArena

    eng = _meta_engine(monkeypatch, meta_models, CONFIGS["minicpmo45-shared.yaml"], available=CARD_80GB_AVAILABLE)
    c2w, cfg = eng.code2wav, eng.code2wav.config
    arena = c2w.arena
    frame = cfg.shape.att_frame_bytes(arena.att.element_size())
    w, p, k = cfg.max_chunk_frames, cfg.max_prompt_frames, arena.key_capacity
    assert (w, p, k) == (56, 300, 56 + 300 + cfg.cache_tail_frames)
    assert arena.rows * w >= p
    assert arena._att_storage.numel() * arena.att.element_size() == arena.rows * w * frame
    old = EulerArena(c2w.flow.decoder.estimator, rows=arena.rows, max_query=w, max_cache=cfg.max_cache_frames,
                     n_timesteps=cfg.shape.n_timesteps, cfg_rate=cfg.cfg_rate, key_bucket=cfg.key_bucket,
                     max_setup_query=p, use_cuda_graphs=False, max_private=p, prompt_in_place=False,
                     prompt_bank_frames=1)   # the voices' frames are theirs (voice_bytes), not the arena's
    fixed = eng.sizing.fixed_bytes()
    new_plan = eng.sizing.plan()
    c2w.arena = old
    try:
        assert eng.sizing.fixed_bytes() - fixed == old.nbytes() - arena.nbytes() == arena.rows * (k - w) * frame
        old_plan = eng.sizing.plan()
    finally:
        c2w.arena = arena
    logging.getLogger(__name__).info("80 GB card: arena %.2f -> %.2f GiB, %d -> %d planned sessions",
                                     old.nbytes() / 2**30, arena.nbytes() / 2**30, old_plan.planned_sessions,
                                     new_plan.planned_sessions)
    assert new_plan.planned_sessions > old_plan.planned_sessions
