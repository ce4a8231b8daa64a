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
    periodic_hann,
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
