"""The vocoder's graph path (cfm/vocoder_graphs.py): replays per (tier, shape), eager for other
shapes, groups larger than the largest tier split, and the PCM of the eager path bit for bit.

On CPU a fake backend stands in for torch.cuda.CUDAGraph (its replay runs the recorded forward),
so what is exercised is the decision logic and the static buffers: the noise drawn outside the
replay and copied in, padded rows, outputs copied out before the next replay overwrites them.
The CUDA test at the bottom captures for real and skips on CPU.
"""
import copy

import pytest
import torch
from helpers import CHUNK, new_stage, run_plan, tiny_models, token_stream, voice_inputs
from test_graphs import FakeGraphBackend

from duplexcache.cfm.vocoder_graphs import VocoderGraphs
from duplexcache.models.vocoder import MEL_CACHE_FRAMES, SAMPLES_PER_FRAME

VOICES = {"a": voice_inputs(11, 10), "b": voice_inputs(12, 12)}
# 7 sessions with staggered starts: first chunks, continuing ones and finals in every tick
PLAN = {f"s{i}": ("a" if i % 2 else "b", i // 2, token_stream(60 + i, 3)) for i in range(7)}
FIRST = CHUNK * 2                                          # a chunk's frames: (CHUNK + 3 - 3) * up_rate
SOURCE = MEL_CACHE_FRAMES * SAMPLES_PER_FRAME
SHAPES = ((FIRST, 0), (MEL_CACHE_FRAMES + FIRST, SOURCE))  # first and continuing chunks (and finals of CHUNK)


def _pcms(stage, plan=PLAN, ticks=6):
    return {sid: pcms for sid, (_, pcms) in run_plan(stage, VOICES, plan, ticks).items()}


@pytest.mark.parametrize("grid", [(1, 4, 8), (1, 2)])
def test_replays_give_the_eager_pcm(grid):
    """Bit for bit where the replays cover a group at once (tier 4 or 8: padding changes no row);
    where a group of 3-4 rows is split into replays of 2 (grid (1, 2)) only as batch sizes do."""
    flow, hift = tiny_models()
    eager = _pcms(new_stage(flow, hift, max_num_seqs=8, graph_grid=grid))
    fake = FakeGraphBackend()
    stage = new_stage(flow, hift, max_num_seqs=8, graph_grid=grid, vocoder_graph_shapes=SHAPES, vocoder_cuda_graphs=True)
    stage.set_graph_backend(fake)
    got = _pcms(stage)
    stats = stage.vocoder_graph_stats
    assert stats.eager_runs == 0 and stats.captures == len(stage.vocoder_graphs.graph_keys) > 0
    assert stats.replays > stats.captures                  # keys were reused
    tiers = {key[0] for key in stage.vocoder_graphs.graph_keys}
    assert tiers <= set(grid)                              # (1, 2): groups of 3-4 rows split in two
    for sid in PLAN:
        assert len(got[sid]) == 3
        for a, b in zip(got[sid], eager[sid]):
            if max(grid) >= 4:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_other_shapes_run_eagerly_and_count():
    flow, hift = tiny_models()
    plan = {"w": ("a", 0, token_stream(90, 2, last_keeps_lookahead=True))}   # a wider final chunk
    eager = _pcms(new_stage(flow, hift, graph_grid=(1, 4)), plan, 2)
    stage = new_stage(flow, hift, graph_grid=(1, 4), vocoder_graph_shapes=SHAPES, vocoder_cuda_graphs=True)
    stage.set_graph_backend(FakeGraphBackend())
    got = _pcms(stage, plan, 2)
    assert stage.vocoder_graph_stats.replays == 1 and stage.vocoder_graph_stats.eager_runs == 1
    assert all(torch.equal(a, b) for a, b in zip(got["w"], eager["w"]))


def test_switch_off_or_no_backend_means_no_graphs():
    flow, hift = tiny_models()
    off = new_stage(flow, hift, vocoder_graph_shapes=SHAPES, vocoder_cuda_graphs=False)
    off.set_graph_backend(FakeGraphBackend())
    assert off.vocoder_graphs is None and off.vocoder_graph_bytes == 0
    cpu = new_stage(flow, hift, vocoder_graph_shapes=SHAPES, vocoder_cuda_graphs=True)            # CPU: no arena backend either
    assert cpu.vocoder_graphs is None
    _pcms(off, {"x": ("a", 0, token_stream(91, 2))}, 2)
    assert off.vocoder_graph_stats.replays == 0


def test_static_buffers_are_allocated_up_front_and_counted():
    flow, hift = tiny_models()
    graphs = VocoderGraphs(hift, SHAPES, rows=4, grid=(1, 4), backend=FakeGraphBackend())
    harmonics = hift.cfg.nb_harmonics + 1
    per_row = 0
    for frames, cached in SHAPES:
        samples = frames * SAMPLES_PER_FRAME
        per_row += 80 * frames + cached + harmonics + samples * harmonics + 2 * samples
    assert graphs.nbytes() == 4 * 4 * per_row
    assert graphs.tiers(1) == (1,) and graphs.tiers(3) == graphs.tiers(9) == (1, 4)
    assert not graphs.warm(4, (FIRST + 1, 0))             # not a graphed shape
    assert graphs.warm(4, SHAPES[0]) and not graphs.warm(4, SHAPES[0])
    with pytest.raises(ValueError, match="bad vocoder graph shape"):
        VocoderGraphs(hift, ((0, 0),), rows=4, grid=(), backend=FakeGraphBackend())


def test_captures_allow_only_deterministic_cudnn_algorithms():
    """The algorithm a capture picks is baked into its replays; two graphed engines (sharing on
    and off) must agree bit for bit, so captures run with cudnn.deterministic (and only them)."""
    flow, hift = tiny_models()
    seen = []

    class Recording(FakeGraphBackend):
        def capture(self, fn):
            seen.append(torch.backends.cudnn.deterministic)
            return super().capture(fn)

    graphs = VocoderGraphs(hift, SHAPES, rows=4, grid=(1, 4), backend=Recording())
    before = torch.backends.cudnn.deterministic
    assert graphs.warm(4, SHAPES[0]) and graphs.warm(1, SHAPES[1])
    assert seen == [True, True] and torch.backends.cudnn.deterministic == before


def test_set_graph_backend_refuses_after_a_capture():
    flow, hift = tiny_models()
    stage = new_stage(flow, hift, graph_grid=(1, 4), vocoder_graph_shapes=SHAPES, vocoder_cuda_graphs=True)
    stage.set_graph_backend(FakeGraphBackend())
    stage.vocoder_graphs.warm(1, SHAPES[0])
    with pytest.raises(RuntimeError, match="after graphs were captured"):
        stage.set_graph_backend(FakeGraphBackend())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replays_are_deterministic_and_close_to_eager():
    """On the GPU: two graphed stages give the same bits (what sharing on/off compares), and the
    replayed vocoder is within batch-size rounding of the eager one at the same tier (cuDNN may
    pick other convolution algorithms inside a capture, so not bit for bit). On the H200
    (2026-12-05) the first assertion failed before captures were limited to deterministic cuDNN
    algorithms; on an H100 after that change it passed, and the eager arm, run with torch's
    defaults (TF32 convolutions), was 2.1e-4 off. The engine pins cuDNN to deterministic
    algorithms without TF32 (device_setup.pin_cuda_numerics), so this test does too."""
    from duplexcache.runtime.memory.device_setup import pin_cuda_numerics

    saved = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32,
             torch.backends.cuda.matmul.allow_tf32)
    pin_cuda_numerics(torch.device("cuda"))
    try:
        _graphs_against_eager()
    finally:
        (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32,
         torch.backends.cuda.matmul.allow_tf32) = saved


def _graphs_against_eager() -> None:
    cpu_flow, cpu_hift = tiny_models()
    flow, hift = copy.deepcopy(cpu_flow).cuda(), copy.deepcopy(cpu_hift).cuda()   # the shared CPU models stay
    grid = (1, 4, 8)
    plan = {f"g{i}": ("a", 0, token_stream(70 + i, 3)) for i in range(4)}   # 4 rows: tier 4, no padding

    def pcms(**kw):
        stage = new_stage(flow, hift, max_num_seqs=8, graph_grid=grid, use_cuda_graphs=True, **kw)
        got = {sid: p for sid, (_, p) in run_plan(stage, VOICES, plan, 3, "cuda").items()}
        return stage, got

    _, eager = pcms(vocoder_cuda_graphs=False)
    graphed, a = pcms(vocoder_graph_shapes=SHAPES, vocoder_cuda_graphs=True)
    _, b = pcms(vocoder_graph_shapes=SHAPES, vocoder_cuda_graphs=True)
    assert graphed.vocoder_graphs is not None
    assert graphed.vocoder_graph_stats.replays >= 2 and graphed.vocoder_graph_stats.eager_runs == 0
    worst = 0.0
    for sid in plan:
        for x, y, z in zip(a[sid], b[sid], eager[sid]):
            assert torch.equal(x, y)
            worst = max(worst, ((x - z).abs().max() / z.abs().max()).item())
    print(f"graphed vs eager vocoder, largest relative difference: {worst:.3g}")
    assert worst <= 1e-5
