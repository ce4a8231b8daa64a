"""EncoderGraphs (engine.cuda_graphs): the streaming encoder's layers as piecewise graphs.

On CPU the runner runs its pieces eagerly over the static buffers (``capture=False``): the same
buffer filling, padding rows, masked keys and eager cache traffic the CUDA graphs replay. The
reference is the encoder's own eager layers (``stream_step`` without graphs), which the other
encoder tests check against transformers' Whisper; the CUDA test (skipped without a GPU)
compares captured pieces with the same pieces run eagerly.
"""
from __future__ import annotations

import pytest
import torch

from duplexcache.models.audio_encoder import AudioEncoder, AudioEncoderConfig
from duplexcache.models.audio_encoder_graphs import EncoderGraphs


def chunks(gen: torch.Generator, states, cfg: AudioEncoderConfig) -> list[torch.Tensor]:
    return [torch.rand(cfg.first_chunk_samples if s.num_chunks == 0 else cfg.chunk_samples, generator=gen) - 0.5
            for s in states]


@pytest.mark.parametrize("storage", [None, torch.float8_e4m3fn], ids=["model_dtype", "fp8"])
def test_pieces_give_the_eager_layers_results_over_many_ticks(storage):
    """3 sessions in bucket 4 (a padding row), a 4th joining at tick 2 (its longer first chunk
    pads the others: width 52 -> the other key), through a cache reset (tiny: 128 frames): every
    embedding and every cached frame as the eager layers give them, to float32 rounding (the
    pieces multiply the bucket's rows and attend over masked keys up to the cache's end; fp8: a
    value on a rounding edge may land one e4m3 step apart, so a few stored values differ)."""
    cfg = AudioEncoderConfig.tiny()
    torch.manual_seed(3)
    enc = AudioEncoder(cfg).eval()
    graphs = EncoderGraphs(enc, max_batch=4, storage_dtype=storage, capture=False)
    assert graphs.widths == (cfg.chunk_frames(cfg.chunk_samples), cfg.chunk_frames(cfg.first_chunk_samples))
    eager = [enc.new_stream_state(storage_dtype=storage) for _ in range(4)]
    graphed = [enc.new_stream_state(storage_dtype=storage) for _ in range(4)]
    gen = torch.Generator().manual_seed(4)
    resets = 0
    for tick in range(6):
        live = [0, 1, 2] if tick < 2 else [0, 1, 2, 3]
        pcm = chunks(gen, [eager[i] for i in live], cfg)
        want = enc.stream_step([eager[i] for i in live], pcm)
        got = enc.stream_step([graphed[i] for i in live], pcm, graphs=graphs)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6 if storage is None else 1e-4)
        resets = max(s.num_resets for s in eager)
    assert resets > 0                                   # the tiny cache (128 frames) reset on the way
    for a, b in zip(eager, graphed):
        assert (a.num_frames, a.num_chunks, a.num_resets) == (b.num_frames, b.num_chunks, b.num_resets)
        for layer in range(cfg.encoder_layers):
            for x, y in zip(a.stored(layer, a.num_frames), b.stored(layer, b.num_frames)):
                if x.dtype == torch.float8_e4m3fn:
                    assert (x.view(torch.uint8) != y.view(torch.uint8)).float().mean() < 0.01
                else:
                    torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)
    assert graphs.stats.replays == 6 and graphs.stats.fallbacks == 0
    assert graphs.stats.first_uses == 2                  # (4, 50-frame chunks) and (4, 52) at the join


def test_a_runner_declines_what_it_cannot_hold_and_warms_its_keys():
    cfg = AudioEncoderConfig.tiny()
    enc = AudioEncoder(cfg).eval()
    graphs = EncoderGraphs(enc, max_batch=2, capture=False)
    gen = torch.Generator().manual_seed(1)
    states = [enc.new_stream_state() for _ in range(3)]
    enc.stream_step(states, chunks(gen, states, cfg), graphs=graphs)   # 3 sessions > bucket 2: eager
    fp8 = [enc.new_stream_state(storage_dtype=torch.float8_e4m3fn)]
    enc.stream_step(fp8, chunks(gen, fp8, cfg), graphs=graphs)         # another storage format: eager
    assert graphs.stats.fallbacks == 2 and graphs.stats.replays == 0
    assert graphs.keys() == [(b, n) for b in (2, 1) for n in reversed(graphs.widths)]
    assert graphs.warm(2, graphs.widths[0]) and not graphs.warm(2, graphs.widths[0])
    with pytest.raises(ValueError, match="bucket x width"):
        graphs.warm(3, graphs.widths[0])
    assert graphs.nbytes() > 0


class _RunTwiceBackend:
    """CudaGraphBackend's calls on the CPU: the warm-up run, then the "captured" run, returning
    something that repeats it."""

    def capture(self, fn):
        fn()
        fn()
        return fn


def test_pieces_keep_no_autograd_history_in_the_static_buffers():
    """Captured with autograd on (the warm-up once ran its encoder keys so): the pieces' copies
    must not give the static buffers a grad_fn, which would hold every piece's activations in a
    C++ reference cycle past the engine's life (H100: 7 GiB left after the engine was freed)."""
    cfg = AudioEncoderConfig.tiny()
    enc = AudioEncoder(cfg).eval()
    assert any(p.requires_grad for p in enc.parameters())   # the case the pieces must survive
    graphs = EncoderGraphs(enc, max_batch=2, capture=False)
    graphs._backend = _RunTwiceBackend()
    with torch.enable_grad():
        for batch, n in graphs.keys():
            graphs.warm(batch, n)
    leaked = [name for name, t in vars(graphs._frames[graphs.widths[0]]).items()
              if isinstance(t, torch.Tensor) and (t.requires_grad or t.grad_fn is not None)]
    assert not leaked and not graphs._stored.requires_grad


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_captured_pieces_equal_the_same_pieces_eagerly():
    cfg = AudioEncoderConfig.tiny()
    torch.manual_seed(3)
    enc = AudioEncoder(cfg).eval().cuda()
    runners = [EncoderGraphs(enc, max_batch=4, capture=c) for c in (True, False)]
    states = [[enc.new_stream_state() for _ in range(3)] for _ in runners]
    gen = torch.Generator().manual_seed(4)
    for _ in range(4):
        pcm = chunks(gen, states[0], cfg)
        got, want = (enc.stream_step(s, pcm, graphs=r) for s, r in zip(states, runners))
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    assert runners[0].stats.captures == 2 and runners[0].stats.replays == 4
