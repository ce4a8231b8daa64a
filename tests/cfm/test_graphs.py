"""The whole-Euler arena's graph path: lazy capture per key, replay, padding, buffer guard.

On CPU a fake backend stands in for torch.cuda.CUDAGraph: its `capture` records the solve and its
replay runs that recorded solve, so the decision logic (capture once per key, then replay; the
smallest tier that fits; padded rows) is exercised and its outputs are checked bit for bit
against the eager path. The CUDA tests at the bottom run the real graphs and skip on CPU.
"""
import copy

import pytest
import torch
from helpers import new_stage, run_plan, tiny_models, token_stream, voice_inputs

from duplexcache.cfm.arena import ArenaGraphError
from duplexcache.cfm.graph_capture import CudaGraphBackend

VOICES = {"a": voice_inputs(11, 10), "b": voice_inputs(12, 12)}    # P = 20 and 24 frames
# 7 sessions, staggered starts: batches of 2, 4, 6, 7 and setups of 1 row
PLAN = {f"s{i}": ("a" if i % 2 else "b", i // 2, token_stream(60 + i, 3)) for i in range(7)}


class FakeGraphBackend:
    """capture(fn) -> a replay that runs fn; counts both. Like the CUDA backend, capture does a
    warm-up call (its results are overwritten by the replay that follows)."""

    def __init__(self) -> None:
        self.captured = 0
        self.replayed = 0

    def capture(self, fn):
        fn()                       # warm-up
        self.captured += 1

        def replay():
            self.replayed += 1
            fn()
        return replay


def _run(stage, plan, ticks, device="cpu"):
    """sid -> mels (on the CPU)."""
    return {sid: mels for sid, (mels, _) in run_plan(stage, VOICES, plan, ticks, device).items()}


def test_cpu_default_is_eager():
    flow, hift = tiny_models()
    stage = new_stage(flow, hift, use_cuda_graphs=True)     # asked for, but the weights are on CPU
    assert stage.arena.graph_backend is None
    _run(stage, PLAN, 2)
    s = stage.graph_stats
    assert s.captures == 0 and s.replays == 0 and s.eager_runs > 0


@pytest.mark.parametrize("grid,rows_from_grid", [((1, 4), True), ((1, 2, 8), False)])
def test_fake_graphs_capture_once_per_key_and_replay(grid, rows_from_grid):
    flow, hift = tiny_models()
    kw = dict(prompt_att_sharing=True, max_num_seqs=8, graph_grid=grid, arena_rows_from_graph_grid=rows_from_grid)
    eager = _run(new_stage(flow, hift, **kw), PLAN, 6)
    fake = FakeGraphBackend()
    stage = new_stage(flow, hift, graph_backend=fake, **kw)
    assert stage.graph_stats.captures == 0                  # lazy: nothing captured before a solve
    got = _run(stage, PLAN, 6)
    s = stage.graph_stats
    assert s.eager_runs == 0                                # every solve went through a graph
    assert s.captures == fake.captured == len(stage.arena.graph_keys)
    assert s.replays == fake.replayed and s.replays > s.captures   # keys were reused
    for tier, width, lb in stage.arena.graph_keys:
        assert tier in grid and lb % stage.config.key_bucket == 0 or lb == stage.arena.key_capacity - width
    # same grid, same tiers, same padding -> the replayed path gives the eager bits
    for sid in PLAN:
        assert len(got[sid]) == 3
        for a, b in zip(got[sid], eager[sid]):
            assert torch.equal(a, b)


def test_smallest_tier_that_fits_with_padding():
    flow, hift = tiny_models()
    fake = FakeGraphBackend()
    stage = new_stage(flow, hift, graph_backend=fake, max_num_seqs=8, graph_grid=(1, 4, 8))
    plan = {f"s{i}": ("a", 0, token_stream(80 + i, 2)) for i in range(3)}   # 3 rows -> tier 4
    _run(stage, plan, 1)
    tiers = sorted({k[0] for k in stage.arena.graph_keys})
    assert tiers == [1, 4]                                   # setup rows at tier 1, the chunk at tier 4
    assert int(stage.arena.cache_len[3]) == 0                # the padded slot carries no cache


def test_replaced_buffer_is_refused():
    flow, hift = tiny_models()
    stage = new_stage(flow, hift, graph_backend=FakeGraphBackend(), max_num_seqs=2)
    plan = {"s0": ("a", 0, token_stream(90, 3))}
    _run(stage, plan, 1)
    stage.arena.att = torch.zeros_like(stage.arena.att)
    with pytest.raises(ArenaGraphError, match="changed"):
        stage.step({"s0": plan["s0"][2][1]})


def test_cache_length_buckets_share_graphs():
    """One width, growing caches: captures equal the distinct buckets met, not the chunks."""
    flow, hift = tiny_models()
    fake = FakeGraphBackend()
    stage = new_stage(flow, hift, graph_backend=fake, max_num_seqs=1)
    _run(stage, {"s0": ("a", 0, token_stream(91, 6))}, 6)
    a = stage.arena
    keys = a.graph_keys
    assert len(keys) == len(set(keys)) == stage.graph_stats.captures
    assert stage.graph_stats.replays == 8                   # 2 voices' prompt passes + 6 chunks
    assert len(keys) < 8


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cuda_models():
    flow, hift = tiny_models()
    return copy.deepcopy(flow).cuda(), copy.deepcopy(hift).cuda()


@cuda
def test_cuda_graphs_replay_and_match_eager(monkeypatch):
    # cuDNN may run float32 convolutions in TF32 by default; compare plain float32 against the CPU
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    flow, hift = _cuda_models()
    kw = dict(prompt_att_sharing=True, max_num_seqs=8, graph_grid=(1, 4, 8))
    graphed = new_stage(flow, hift, use_cuda_graphs=True, **kw)
    assert isinstance(graphed.arena.graph_backend, CudaGraphBackend)
    got = _run(graphed, PLAN, 6, "cuda")
    s = graphed.graph_stats
    assert s.eager_runs == 0 and s.captures > 0 and s.replays > s.captures
    eager = _run(new_stage(flow, hift, use_cuda_graphs=False, **kw), PLAN, 6, "cuda")
    cpu_flow, cpu_hift = tiny_models()
    cpu = _run(new_stage(cpu_flow, cpu_hift, **kw), PLAN, 6)
    for sid in PLAN:
        for a, b, c in zip(got[sid], eager[sid], cpu[sid]):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
            assert ((a - c).norm() / c.norm()).item() <= 1e-5   # measured 3e-5 with cuDNN TF32 on


@cuda
def test_cuda_sharing_on_off_bit_identical_with_graphs():
    flow, hift = _cuda_models()
    kw = dict(max_num_seqs=8, graph_grid=(1, 4, 8), use_cuda_graphs=True)
    on = _run(new_stage(flow, hift, prompt_att_sharing=True, **kw), PLAN, 6, "cuda")
    off = _run(new_stage(flow, hift, prompt_att_sharing=False, **kw), PLAN, 6, "cuda")
    for sid in PLAN:
        for a, b in zip(on[sid], off[sid]):
            assert torch.equal(a, b)


def test_warm_captures_ahead_and_keeps_the_bits():
    """EulerArena.warm (the engine's warm-up) captures a key over padded rows; the run that needs
    it later only replays, and the solves give the eager bits (warming wrote only scratch rows)."""
    flow, hift = tiny_models()
    kw = dict(prompt_att_sharing=True, max_num_seqs=8, graph_grid=(1, 4, 8), arena_rows_from_graph_grid=True)
    eager = _run(new_stage(flow, hift, **kw), PLAN, 6)
    lazy = new_stage(flow, hift, graph_backend=FakeGraphBackend(), **kw)
    _run(lazy, PLAN, 6)
    fake = FakeGraphBackend()
    stage = new_stage(flow, hift, graph_backend=fake, **kw)
    arena = stage.arena
    for tier, width, lb in lazy.arena.graph_keys:          # the keys this plan meets
        assert arena.warm(tier, width, lb) and not arena.warm(tier, width, lb)
        assert arena.has_graph(tier, width, lb)
    warmed = fake.captured
    got = _run(stage, PLAN, 6)
    assert fake.captured == warmed == len(lazy.arena.graph_keys)   # nothing captured while serving
    for sid in PLAN:
        for a, b in zip(got[sid], eager[sid]):
            assert torch.equal(a, b)
    assert not new_stage(flow, hift, **kw).arena.warm(1, 4, 0)     # no graph backend: nothing to warm
