"""The engine's warm start (runtime/warmup.py): after ``warmup()`` a tick captures nothing.

This CPU cannot capture CUDA graphs, so the engine is given what it would have on CUDA with the
capture step swapped for a stand-in: decode runners with ``capture=False`` (each key's first use
runs its padded step; ``first_uses`` counts what would have been a capture) and a fake arena
backend whose ``capture`` runs the solve and returns it as the replay. The key lists, the
bucketing and the engine's counters are the real ones. A CUDA test at the bottom captures for
real and skips without CUDA.
"""
from __future__ import annotations

import os

import pytest
import torch
from engine_helpers import audio, collect, engine, tiny_models

from duplexcache.cfm.graph_grid import replay_tiers
from duplexcache.runtime.memory import device_setup
from duplexcache.runtime import warmup as W
from duplexcache.runtime.engine import DuplexEngine

UNITS = 5
# A small budget (3 planned sessions) and window keep the key lists short: warming the tiny
# preset's default 512 MiB plan (39 sessions, 49 Code2Wav keys) takes a minute of CPU.
SMALL = {"engine": {"memory_budget": "128MiB", "activation_reserve": "16MiB"},
         "stage0": {"window": {"high_tokens": 400, "low_tokens": 200}}}


class FakeArenaBackend:
    """capture(fn): runs fn once (the CUDA backend's side-stream warm-up) and returns it as the replay."""

    def __init__(self) -> None:
        self.captured = 0

    def capture(self, fn):
        fn()
        self.captured += 1
        return fn


def graphed_engine(tmp_path, monkeypatch, name: str, sections: dict | None = None) -> DuplexEngine:
    monkeypatch.setattr(DuplexEngine, "_can_capture_decode", lambda self: True)
    eng = engine(tmp_path, name, sections or SMALL)   # engine.cuda_graphs at its default: on
    eng.code2wav.set_graph_backend(FakeArenaBackend())
    return eng


def serve_units(eng: DuplexEngine, voices=("default", "alt", "default")) -> dict:
    """Three sessions (2 voices) for UNITS units; the default policy speaks every unit and ends a
    turn every 2 units, so non-final and final Code2Wav chunks both run."""
    sids = [eng.open_session({"voice": v}) for v in voices]
    for i, sid in enumerate(sids):
        eng.push_audio(sid, audio(i, UNITS))
    events = []
    for _ in range(UNITS + 1):
        events += eng.tick()
    out = collect(events)
    assert all(out[sid]["audio"] and not out[sid]["errors"] for sid in sids), out
    return out


def test_after_warmup_ticks_capture_nothing(tmp_path, monkeypatch):
    """After the warm-up no tick captures: decode, Code2Wav and vocoder graphs, and every (bucket,
    chunk width) of the encoder's pieces (sessions joining with their longer first chunk). One
    engine for both, since each warm-up costs ~30 s of CI."""
    monkeypatch.setattr(DuplexEngine, "_can_capture_encoder", lambda self: True)
    eng = graphed_engine(tmp_path, monkeypatch, "warm")
    report = eng.warmup()
    assert report.encoder_graphs == len(eng.encoder_graphs.keys()) > 0
    stats = eng.stats()
    assert stats.graph_captures == {"warmup": report.graphs, "tick": 0} and report.graphs > 0
    assert report.decode_graphs["thinker"] > 0 and report.decode_graphs["talker"] > 0
    assert report.code2wav_graphs > 0 and report.vocoder_graphs > 0
    assert report.code2wav_graphs + report.vocoder_graphs == eng.code2wav.arena.graph_backend.captured
    assert stats.warmup_seconds == report.seconds
    eager_before = eng.code2wav.graph_stats.eager_runs   # the voices' prompt passes at registration
    serve_units(eng)
    stats = eng.stats()
    assert stats.graph_captures["tick"] == 0, "a tick captured a graph the warm-up missed"
    assert stats.decode_graph_steps["thinker"] > 0 and stats.decode_graph_steps["talker"] > 0
    assert eng.code2wav.graph_stats.replays > report.code2wav_graphs   # the ticks replayed
    assert eng.code2wav.graph_stats.eager_runs == eager_before   # no solve ran op by op in a tick
    vocoder = eng.code2wav.vocoder_graph_stats                   # every vocoder call replayed
    assert vocoder.eager_runs == 0 and vocoder.replays > report.vocoder_graphs
    assert stats.encoder_graph_ticks > 0


def test_without_warmup_the_ticks_capture(tmp_path, monkeypatch):
    """The control: the same load on a cold engine captures inside ticks, and only keys that the
    warm-up's lists hold."""
    eng = graphed_engine(tmp_path, monkeypatch, "cold")
    serve_units(eng)
    stats = eng.stats()
    assert stats.graph_captures["warmup"] == 0 and stats.graph_captures["tick"] > 0
    warm = {k: set(v) for k, v in W.decode_keys(eng).items()}
    for name, graphs in (("thinker", eng.thinker_graphs), ("talker", eng.talker_graphs)):
        assert graphs._used <= warm[name]
    arena = eng.code2wav.arena
    listed = {(t, w, arena.bucket(w, n)) for t, w, n in W.code2wav_keys(eng)}
    assert set(arena.graph_keys) <= listed and arena.graph_keys
    vocoder = eng.code2wav.vocoder_graphs
    assert set(vocoder.graph_keys) <= {(t, *shape) for t, shape in W.vocoder_keys(eng)} and vocoder.graph_keys


def test_warmup_touches_no_session_state(tmp_path, monkeypatch):
    eng = graphed_engine(tmp_path, monkeypatch, "state")
    sid = eng.open_session({"voice": "default"})
    eng.push_audio(sid, audio(0, 2))
    eng.tick()                                    # one live, open session before the warm-up
    cold = eng.stats().graph_captures["tick"]     # its first tick captured lazily
    before = (eng.stats().pools, eng.thinker_manager.pool.num_free, eng.talker_pool.num_free,
              eng.ledger.thinker_reserved, eng.ledger.talker_reserved, eng.ledger.dynamic_reserved,
              eng.session_info(sid), sorted(eng.code2wav.sessions))
    blocks = eng.stage0.block_table(sid)
    k_before = eng.thinker_cache.k[:, blocks].clone()
    eng.warmup()
    eng.recorder.refresh_pools()
    after = (eng.stats().pools, eng.thinker_manager.pool.num_free, eng.talker_pool.num_free,
             eng.ledger.thinker_reserved, eng.ledger.talker_reserved, eng.ledger.dynamic_reserved,
             eng.session_info(sid), sorted(eng.code2wav.sessions))
    assert after == before
    assert torch.equal(eng.thinker_cache.k[:, blocks], k_before)   # its KV untouched
    again = eng.warmup()                                            # nothing left to capture
    assert again.graphs == 0 and eng.stats().graph_captures["tick"] == cold > 0
    eng.shutdown()


def test_warmup_stops_when_asked(tmp_path, monkeypatch):
    eng = graphed_engine(tmp_path, monkeypatch, "stop")
    asked = []
    report = eng.warmup(should_stop=lambda: asked.append(1) or len(asked) > 3)   # 3 captures, then stop
    assert report.cancelled and report.graphs == 3 and report.kernels == ()
    assert eng.stats().graph_captures == {"warmup": 3, "tick": 0}
    assert not eng.warmup().cancelled                                            # the rest, later


def test_cpu_engine_warmup_is_a_no_op(tmp_path):
    """On CPU as configured there are no graphs: warm-up reports 0 and serving is unchanged."""
    eng = engine(tmp_path, "cpu", SMALL)
    report = eng.warmup()
    assert report.graphs == 0 and report.kernels == () and eng.stats().graph_captures == {"warmup": 0, "tick": 0}


def test_thinker_widths_stop_at_a_reference_sessions_table(tmp_path, monkeypatch):
    eng = graphed_engine(tmp_path, monkeypatch, "widths")
    bound = W.thinker_width_bound(eng)
    keys = W.decode_keys(eng)
    widths = sorted({w for _, w in keys["thinker"]})
    assert widths[-1] >= bound and (len(widths) == 1 or widths[-2] < bound)
    assert widths[-1] < eng.thinker_graphs.max_width       # the model's positions need more
    assert sorted({b for b, _ in keys["thinker"]}) == list(eng.thinker_graphs.row_buckets)   # decode + row buckets
    assert keys["talker"] == eng.talker_graphs.keys()      # every width of one full turn
    assert keys["thinker"][0][0] == max(eng.thinker_graphs.row_buckets)   # largest first


def test_dynamic_region_is_what_the_plan_needs_up_to_what_is_free():
    gib = 1 << 30
    assert W.dynamic_region_bytes(10 * gib, 40 * gib) == 10 * gib
    assert W.dynamic_region_bytes(10 * gib, 5 * gib) == 4 * gib      # 1 GiB stays free: short of the plan
    assert W.dynamic_region_bytes(10 * gib, gib // 2) == 0


def test_code2wav_key_arithmetic():
    # P = 300, chunks of 50 frames, tail 100: P, P + 50, P + 100 (then the trim holds it)
    assert W.code2wav_cache_lengths(300, 50, 100) == [300, 350, 400]
    assert W.code2wav_cache_lengths(120, 56, 100) == [120, 176, 220]
    assert replay_tiers((1, 4, 8, 16), 16, 40) == (1, 4, 8, 16)
    assert replay_tiers((1, 4, 8, 16), 16, 3) == (1, 4)           # 2 or 3 rows take tier 4
    assert replay_tiers((), 32, 5) == (1, 2, 3, 4, 5)              # no grid: every row count
    assert replay_tiers((), 4, 9) == (1, 2, 3, 4)


def test_null_block_step_is_a_valid_step_that_writes_only_the_null_block():
    """The kernels' warm-up step (run on CUDA) through the CPU reference path: shapes agree with
    both models and no block but the null block changes."""
    m = tiny_models()
    for model in (m.thinker, m.talker):
        c = model.config
        cache = model.make_kv_cache(4, 16, m.dtype, m.device) if hasattr(model, "make_kv_cache") else None
        if cache is None:
            from duplexcache.kv.paged_attention import PagedKVCache
            cache = PagedKVCache(c.num_hidden_layers, 4, 16, c.num_key_value_heads, c.head_dim, m.dtype, m.device)
        cache.k.normal_()
        live = cache.k[:, 1:].clone()
        with torch.no_grad():
            out = model.forward_paged(torch.zeros(12, c.hidden_size), W._null_block_step(12, cache), cache)
        assert out.shape == (12, c.hidden_size)
        assert torch.equal(cache.k[:, 1:], live)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures real CUDA graphs")
def test_cuda_warmup_captures_and_ticks_capture_nothing(tmp_path):
    from duplexcache.runtime.bundle import build_models
    from engine_helpers import deploy_from_yaml

    deploy = deploy_from_yaml(tmp_path, "cuda", {**SMALL, "model": {"device": "cuda"},
                                                 "code2wav": {"max_num_seqs": 4}})
    eng = DuplexEngine(deploy, build_models(deploy))
    # The voices' Code2Wav prompt passes captured their graph at construction (before serving).
    at_start = eng.code2wav.graph_stats.captures
    assert eng.stats().graph_captures == {"warmup": at_start, "tick": 0}
    report = eng.warmup()
    assert eng.thinker_graphs is not None and eng.thinker_graphs.stats.captures == report.decode_graphs["thinker"]
    assert eng.code2wav.graph_stats.captures - at_start == report.code2wav_graphs > 0
    assert eng.code2wav.vocoder_graph_stats.captures == report.vocoder_graphs > 0
    serve_units(eng)
    assert eng.stats().graph_captures == {"warmup": at_start + report.graphs, "tick": 0}
    eng.shutdown()


def test_the_prefill_warm_up_opens_and_frees_a_throwaway_context(tmp_path):
    """run_prefill_once (CUDA warm-ups call it) prefills three chunks through Stage 0 and gives
    every block back: no session left, the pool's free count as before."""
    eng = engine(tmp_path, "prefill_warmup", {"engine": {"prefill_chunk_tokens": 48}})
    pool = eng.stage0.manager.pool
    free_before = pool.num_free
    calls = []
    timing = [False]                              # inside PrefillTimes.measure
    real = eng.stage0.prefill
    eng.stage0.prefill = lambda chunk: calls.append((chunk, timing[0])) or real(chunk)
    real_measure = eng.scheduler.prefill_times.measure

    def measure(chunk):
        timing[0] = True
        try:
            return real_measure(chunk)
        finally:
            timing[0] = False

    eng.scheduler.prefill_times.measure = measure
    assert eng.predicted_prefill_s() is None
    assert W.run_prefill_once(eng) == 144
    # three chunks, one call each; only the third is timed for the server's pacing (the first
    # pays the first use of its shapes, the second the first use of attention over a context)
    assert calls == [(48, False), (48, False), (48, True)]
    assert eng.predicted_prefill_s() is not None
    assert not eng.stage0.is_prefilling(W.PREFILL_WARMUP_SID) and W.PREFILL_WARMUP_SID not in eng.stage0.sessions
    assert pool.num_free == free_before
    eng.shutdown()


def test_graph_buckets_stop_at_the_caps_however_large_the_plan(tmp_path, monkeypatch):
    """A small model on a large card plans thousands of sessions (tiny on an H100: 10230); the
    runners' buckets stop at MAX_GRAPH_BATCH sessions and MAX_GRAPH_ROWS token rows, so the
    warm-up captures a few hundred graphs, not thousands (bigger steps run eagerly)."""
    eng = graphed_engine(tmp_path, monkeypatch, "caps")
    kv = device_setup.KVPools(eng.thinker_cache, eng.thinker_manager, eng.stage0, eng.talker_cache, eng.talker_kv)
    thinker, talker = device_setup.make_decode_graphs(eng.models, kv, 10230, eng.sizing.talker_turn_tokens,
                                                      capture=False, ragged_steps=True)
    for graphs in (thinker, talker):
        assert graphs.max_batch == device_setup.MAX_GRAPH_BATCH == max(graphs.buckets)
        assert graphs.row_buckets[-1] == device_setup.MAX_GRAPH_ROWS
        assert len(graphs.keys()) <= 40 * len(graphs.widths)
    assert device_setup.graph_batch(10230) == device_setup.MAX_GRAPH_BATCH and device_setup.graph_batch(0) == 1
    assert device_setup.graph_batch(49) == 49   # the plans measured on the H200 are unchanged


def test_the_graph_switches_default_on_and_the_engine_caps_their_buckets(tmp_path, monkeypatch):
    """A deploy YAML not naming engine.cuda_graphs: the defaults (which the packaged YAMLs write out,
    tests/test_config.py) build the ragged-step rows and the encoder pieces, and every runner the engine builds is sized by ``graph_batch`` (a plan of more
    sessions than the cap gets buckets up to the cap, not up to the plan)."""
    monkeypatch.setattr(device_setup, "MAX_GRAPH_BATCH", 2)
    monkeypatch.setattr(DuplexEngine, "_can_capture_encoder", lambda self: True)
    eng = graphed_engine(tmp_path, monkeypatch, "defaults")
    assert eng.plan.planned_sessions > 2
    assert eng.thinker_graphs.max_batch == eng.talker_graphs.max_batch == eng.encoder_graphs.max_batch == 2
    assert eng.stage0.ragged_graphs and eng.thinker_graphs.row_buckets[-1] > 2
    eng.shutdown()


def test_pinned_cuda_numerics_fix_the_cublas_workspace(monkeypatch):
    """An engine built outside the CLI (a script, a library caller) still gets cuBLAS's fixed
    workspace: scripts/batch_invariance.py ran without it on the H100 (2026-12-07)."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    for flag in ("benchmark", "deterministic", "allow_tf32"):
        monkeypatch.setattr(torch.backends.cudnn, flag, getattr(torch.backends.cudnn, flag))
    tf32 = torch.backends.cuda.matmul.allow_tf32
    device_setup.pin_cuda_numerics(torch.device("cpu"))
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ          # nothing to pin off CUDA
    device_setup.pin_cuda_numerics(torch.device("cuda"))       # sets flags only; no device needed
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == device_setup.CUBLAS_WORKSPACE_CONFIG == ":4096:8"
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    torch.backends.cuda.matmul.allow_tf32 = tf32
