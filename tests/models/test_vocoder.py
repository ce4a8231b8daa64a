"""Our HiFT vocoder and its streaming step against minicpmo-utils 1.0.5 (tiny, float32, CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference_stage2 as R  # noqa: E402  (skips when the reference is absent)
from reference_stage2 import one_thread  # noqa: E402,F401  (autouse fixture)

from duplexcache.models.checkpoint import CheckpointError, load_strict  # noqa: E402
from duplexcache.models.vocoder import (  # noqa: E402
    HiftStreamState, VocoderConfig, build_vocoder, hift_state_dict_from_checkpoint, hift_stream_step,
    hift_stream_steps, istft, periodic_hann,
)


@pytest.fixture(scope="module")
def pair():
    return R.tiny_hift_pair(seed=1)


def test_forward_matches_reference_with_same_seed(pair):
    ours, ref = pair
    gen = torch.Generator().manual_seed(0)
    mel = torch.randn(1, 80, 12, generator=gen)
    cache_source = 0.1 * torch.randn(1, 1, 960, generator=gen)
    for cs in (torch.zeros(1, 1, 0), cache_source):
        torch.manual_seed(7)
        a, sa = ours(mel, cs)
        after_a = torch.rand(4)
        torch.manual_seed(7)
        b, sb = ref(mel, cs)
        after_b = torch.rand(4)
        assert a.shape == (1, 12 * 480) and sa.shape == (1, 1, 12 * 480)
        assert torch.equal(a, b) and torch.equal(sa, sb)
        assert torch.equal(after_a, after_b)  # the RNG advanced exactly as in the reference
    assert torch.equal(sa[:, :, :960], cache_source)
    # voiced (f0 ~ 100-200 Hz), so the harmonic source path ran; and the output is not silent
    assert (ours.f0_predictor(mel) > 10).all() and a.abs().max() > 1e-3


def test_different_seed_changes_output(pair):
    # the source noise matters, so the equality above is not vacuous
    ours, _ = pair
    mel = torch.randn(1, 80, 6, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    a, _ = ours(mel)
    torch.manual_seed(2)
    b, _ = ours(mel)
    assert R.rel_err(a, b) > 1e-5


def _reference_stream(ref, chunks, seed):
    """Token2wav.stream's vocoder half, around the reference HiFT and fade_in_out."""
    window = torch.from_numpy(np.hamming(2 * 3840))
    hc = dict(mel=torch.zeros(1, 80, 0), source=torch.zeros(1, 1, 0), speech=torch.zeros(1, 0))
    out = []
    for i, (chunk_mel, last) in enumerate(chunks):
        mel = torch.concat([hc["mel"], chunk_mel], dim=2)
        torch.manual_seed(seed + i)
        speech, source = ref(mel, hc["source"])
        first = hc["speech"].shape[-1] == 0
        if not first:
            speech = R.ref.common.fade_in_out(speech, hc["speech"], window)
        hc = dict(mel=mel[..., -8:].clone(), source=source[:, :, -3840:].clone(), speech=speech[:, -3840:].clone())
        if not last:
            speech = torch.cat([torch.zeros(1, 3840), speech[:, :-3840]], 1) if first else speech[:, :-3840]
        out.append(speech)
    return out


def test_stream_step_matches_reference_stream(pair):
    ours, ref = pair
    gen = torch.Generator().manual_seed(3)
    chunks = [(torch.randn(1, 80, 10, generator=gen), i == 3) for i in range(4)]
    expect = _reference_stream(ref, chunks, seed=11)
    state = HiftStreamState.create()
    got = []
    for i, (mel, last) in enumerate(chunks):
        torch.manual_seed(11 + i)
        got.append(hift_stream_step(ours, state, mel, last))
    # 480 samples per new frame; the first chunk starts with 3840 samples of silence; the
    # last also releases the 8 frames (3840 samples) held back so far
    assert [w.shape[1] for w in got] == [4800, 4800, 4800, 4800 + 3840]
    assert torch.count_nonzero(got[0][:, :3840]) == 0
    for a, b in zip(got, expect):
        assert torch.equal(a, b)
    assert state.mel.shape == (1, 80, 8) and state.source.shape == (1, 1, 3840)


def test_state_dict_strict_both_ways_and_checkpoint_names(pair):
    ours, ref = pair
    assert list(ours.state_dict()) == list(ref.state_dict())
    build_vocoder(VocoderConfig.tiny()).load_state_dict(ref.state_dict(), strict=True)
    R.build_reference_hift(VocoderConfig.tiny()).load_state_dict(ours.state_dict(), strict=True)
    # hift.pt as Token2wav reads it: "generator." prefix, maybe pre-parametrization weight norm
    old = {}
    for k, v in ours.state_dict().items():
        k = k.replace("parametrizations.weight.original0", "weight_g").replace("parametrizations.weight.original1", "weight_v")
        old["generator." + k] = v
    assert any(k.endswith("weight_g") for k in old)
    fresh = build_vocoder(VocoderConfig.tiny())
    load_strict(fresh, hift_state_dict_from_checkpoint(old), "hift")
    for (k, a), b in zip(fresh.state_dict().items(), ours.state_dict().values()):
        assert torch.equal(a, b), k


def test_missing_key_is_named(pair):
    ours, _ = pair
    sd = dict(ours.state_dict())
    del sd["conv_post.parametrizations.weight.original1"]
    with pytest.raises(CheckpointError, match=r"conv_post\.parametrizations\.weight\.original1"):
        load_strict(build_vocoder(VocoderConfig.tiny()), sd, "hift")


def test_minicpmo45_on_meta_matches_reference_defaults():
    ours = build_vocoder(VocoderConfig.minicpmo45(), device="meta")
    with torch.device("meta"):
        ref = R.ref.hifigan.HiFTGenerator()  # the reference's own defaults
    assert all(p.is_meta for p in ours.parameters())
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == {
        k: tuple(v.shape) for k, v in ref.state_dict().items()
    }


def test_hann_window_equals_scipy():
    from scipy.signal import get_window

    for n in (16, 17, 512):
        want = torch.from_numpy(get_window("hann", n, fftbins=True).astype(np.float32))
        assert torch.equal(periodic_hann(n), want)


def test_bad_inputs_raise_value_error(pair):
    ours, _ = pair
    with pytest.raises(ValueError, match="480"):
        VocoderConfig(upsample_rates=(8, 5, 2))
    with pytest.raises(ValueError, match="speech_feat"):
        ours(torch.randn(1, 81, 4))
    with pytest.raises(ValueError, match="chunk_mel"):
        hift_stream_step(ours, HiftStreamState.create(), torch.randn(2, 80, 4), False)


def _streams(rows):
    return [HiftStreamState.create() for _ in range(rows)], [torch.Generator().manual_seed(100 + i) for i in range(rows)]


def test_batched_stream_steps_match_one_stream_at_a_time(pair):
    """b streams in one generator forward vs each alone (same per-stream generator seeds): the
    NSF source (every random draw) is torch.equal; the PCM differs only by the CPU convolutions'
    batch-size rounding (observed 6.7e-7 relative L2)."""
    ours, _ = pair
    gen = torch.Generator().manual_seed(5)
    chunks = [torch.randn(3, 80, 10, generator=gen) for _ in range(3)]
    lasts = [[False] * 3, [False] * 3, [False, True, True]]      # rows 1 and 2 end at chunk 3
    states, gens = _streams(3)
    batched = [hift_stream_steps(ours, states, mel, last, gens) for mel, last in zip(chunks, lasts)]
    for row in range(3):
        (state,), (g,) = _streams(1)
        g.manual_seed(100 + row)
        for k, (mel, last) in enumerate(zip(chunks, lasts)):
            alone = hift_stream_step(ours, state, mel[row:row + 1], last[row], g)
            got = batched[k][row]
            assert got.shape == alone.shape == (1, 4800 + (3840 if last[row] else 0))
            assert R.rel_err(got, alone) <= 1e-5
        assert torch.equal(g.get_state(), gens[row].get_state())
        # every cache is the stream's own tensor, not a view of the batch
        for t in (states[row].mel, states[row].source, states[row].speech):
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        assert R.rel_err(states[row].source, state.source) <= 1e-5


def test_per_row_generators_draw_like_one_row_each(pair):
    """The NSF source with one generator per row equals each row run alone with its generator,
    bit for bit (the harmonic source is elementwise in f0; only the draws could differ)."""
    ours, _ = pair
    f0 = 100 + 50 * torch.rand(3, 960, 1, generator=torch.Generator().manual_seed(1))
    f0[1, :400] = 0                                                   # an unvoiced stretch: noise only
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    sine = ours.m_source.l_sin_gen
    batched = sine(f0, sine.draw(3, 960, f0.device, gens))
    for i in range(3):
        alone = sine(f0[i:i + 1], sine.draw(1, 960, f0.device, torch.Generator().manual_seed(i)))
        assert torch.equal(batched[i:i + 1], alone)
    assert not torch.equal(batched[0, :, 1:], batched[2, :, 1:])    # different seeds, different noise


def test_batched_stream_steps_refuse_bad_batches(pair):
    ours, _ = pair
    states, gens = _streams(2)
    mel = torch.randn(2, 80, 4)
    hift_stream_steps(ours, states[:1], mel[:1], [False], gens[:1])   # now states[0] holds caches
    with pytest.raises(ValueError, match="equal cache lengths"):
        hift_stream_steps(ours, states, mel, [False, False], gens)
    states, gens = _streams(2)
    with pytest.raises(ValueError, match="distinct"):
        hift_stream_steps(ours, states, mel, [False, False], [gens[0], gens[0]])
    with pytest.raises(ValueError, match="distinct"):
        hift_stream_steps(ours, states, mel, [False, False], [None, None])
    with pytest.raises(ValueError, match="generators for 2"):
        hift_stream_steps(ours, states, mel, [False, False], gens[:1])
    with pytest.raises(ValueError, match="last_chunk"):
        hift_stream_steps(ours, states, mel, [False], gens)
    with pytest.raises(ValueError, match="chunk_mel"):
        hift_stream_steps(ours, states, mel[:1], [False, False], gens)


def test_frozen_weight_norm_copy_is_bit_identical_and_leaves_the_original():
    """The serving copy computes each weight-normed weight once: every stream step's PCM and
    caches are torch.equal to the parametrized vocoder's, the copy has no parametrization left,
    and the original keeps its checkpoint key names."""
    from torch.nn.utils import parametrize

    from duplexcache.models.vocoder import frozen_weight_norm
    ours, _ = pair_module = R.tiny_hift_pair(seed=3)
    keys = list(ours.state_dict())
    frozen = frozen_weight_norm(ours)
    assert frozen is not ours
    assert not any(parametrize.is_parametrized(m) for m in frozen.modules())
    assert any(parametrize.is_parametrized(m) for m in ours.modules()) and list(ours.state_dict()) == keys
    assert frozen_weight_norm(frozen) is frozen          # nothing left to freeze: no second copy
    # every weight is a registered parameter again (the memory plan counts .parameters())
    weights = [m.weight for m in frozen.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)]
    assert weights and all(isinstance(w, torch.nn.Parameter) for w in weights)
    # each weight-normed weight (the size of its direction `original1`) replaces its two originals
    assert sum(p.numel() for p in frozen.parameters()) == sum(
        p.numel() for name, p in ours.named_parameters() if not name.endswith("original0"))
    gen = torch.Generator().manual_seed(11)
    chunks = [torch.randn(2, 80, 10, generator=gen) for _ in range(3)]
    lasts = [[False, False], [False, False], [True, True]]
    runs = []
    for model in (ours, frozen):
        states, gens = _streams(2)
        pcm = [hift_stream_steps(model, states, mel, last, gens) for mel, last in zip(chunks, lasts)]
        runs.append((pcm, states))
    (pcm_a, st_a), (pcm_b, st_b) = runs
    for a, b in zip(pcm_a, pcm_b):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    for sa, sb in zip(st_a, st_b):
        assert torch.equal(sa.mel, sb.mel) and torch.equal(sa.source, sb.source) and torch.equal(sa.speech, sb.speech)


def test_frozen_weight_norm_leaves_the_global_rng_alone():
    from duplexcache.models.vocoder import frozen_weight_norm
    ours, _ = R.tiny_hift_pair(seed=4)
    before = torch.random.get_rng_state()
    frozen_weight_norm(ours)
    assert torch.equal(before, torch.random.get_rng_state())


def test_istft_is_torch_istft_bit_for_bit():
    """The sync-free iSTFT runs torch.istft's ops: equal outputs for batches and lengths."""
    window = periodic_hann(16)
    gen = torch.Generator().manual_seed(3)
    for rows, frames in ((1, 5), (3, 233), (2, 6961)):
        spec = torch.complex(torch.randn(rows, 9, frames, generator=gen), torch.randn(rows, 9, frames, generator=gen))
        assert torch.equal(istft(spec, 16, 4, window), torch.istft(spec, 16, 4, 16, window=window))


def test_forward_drawn_is_forward_with_its_draws(pair):
    """Drawing the NSF noise first (what a CUDA graph replays around) changes no bit, and leaves
    each generator where the forward leaves it."""
    ours, _ = pair
    mel = torch.randn(2, 80, 12, generator=torch.Generator().manual_seed(4))
    cache = torch.randn(2, 1, 480, generator=torch.Generator().manual_seed(5))
    gens = [torch.Generator().manual_seed(10 + i) for i in range(2)]
    speech, source = ours(mel, cache, gens)
    drawn_gens = [torch.Generator().manual_seed(10 + i) for i in range(2)]
    noise = ours.draw_noise(2, 12, mel.device, drawn_gens)
    speech2, source2 = ours.forward_drawn(mel, cache, noise)
    assert torch.equal(speech, speech2) and torch.equal(source, source2)
    for a, b in zip(gens, drawn_gens):
        assert torch.equal(a.get_state(), b.get_state())
    assert noise.phases.shape == (2, 9) and torch.equal(noise.phases[:, 0], torch.zeros(2))
