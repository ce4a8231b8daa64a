"""Our Stage 2 flow model against minicpmo-utils 1.0.5 (tiny shapes, float32, CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference_stage2 as R  # noqa: E402  (skips when the reference is absent)
from reference_stage2 import one_thread  # noqa: E402,F401  (autouse fixture)

from duplexcache.models.checkpoint import CheckpointError, load_strict  # noqa: E402
from duplexcache.models.flow import (  # noqa: E402
    DiTBlock, FlowConfig, build_flow, trim_stream_cache,
)

N_STEPS = 10
PROMPT_TOKENS = 10  # P = 20 frames: the trim (P + 100) starts at the 3rd chunk
NUM_CHUNKS = 4


@pytest.fixture(scope="module")
def streamed():
    ours, ref_flow = R.tiny_flow_pair(seed=0)
    our_hift, ref_hift = R.tiny_hift_pair(seed=1)
    inp = R.make_inputs(FlowConfig.tiny(), PROMPT_TOKENS, NUM_CHUNKS, seed=3)
    ref_out = R.stream_reference(ref_flow, ref_hift, inp, N_STEPS)
    our_out = R.stream_ours(ours, our_hift, inp, N_STEPS)
    return inp, ours, ref_flow, our_out, ref_out


def test_streaming_mel_and_waveform_match_reference(streamed):
    inp, _, _, (our_mels, our_wavs, _), (ref_mels, ref_wavs, _) = streamed
    assert len(our_mels) == NUM_CHUNKS >= 3
    # 25 tokens -> 50 frames per chunk, the last chunk included (its lookahead is padded)
    assert [m.shape[2] for m in our_mels] == [50] * NUM_CHUNKS
    mel_err = R.rel_err(torch.cat(our_mels, 2), torch.cat(ref_mels, 2))
    wav_err = R.rel_err(torch.cat(our_wavs, 1), torch.cat(ref_wavs, 1))
    assert mel_err <= 1e-5 and wav_err <= 1e-5, (mel_err, wav_err)
    # same op order in float32: in fact bit-exact
    for a, b in zip(our_mels + our_wavs, ref_mels + ref_wavs):
        assert torch.equal(a, b)
    assert torch.cat(ref_mels, 2).abs().max() > 0.1  # not a degenerate all-zero estimator
    assert torch.cat(ref_wavs, 1).abs().max() > 1e-3


def test_stream_caches_match_reference_after_trim(streamed):
    inp, _, _, (_, _, ours), (_, _, ref) = streamed
    p = inp.prompt_mel.shape[1]
    # the trim has run: P newest + 100 prompt-tail frames
    assert ours["estimator_att_cache"].shape[4] == p + 100
    assert ours["conformer_att_cache"].shape[3] == p + 100
    # the reference's scratch holds 16 step slots; ours exactly n_timesteps
    assert ours["estimator_att_cache"].shape[0] == N_STEPS
    assert torch.equal(ours["estimator_att_cache"], ref["estimator_att_cache"][:N_STEPS])
    assert torch.equal(ours["estimator_cnn_cache"], ref["estimator_cnn_cache"][:N_STEPS])
    assert torch.equal(ours["conformer_att_cache"], ref["conformer_att_cache"])
    assert torch.equal(ours["conformer_cnn_cache"], ref["conformer_cnn_cache"])


def test_comparison_can_fail():
    ours, ref_flow = R.tiny_flow_pair(seed=0)
    with torch.no_grad():
        ours.decoder.estimator.blocks[1].attn.to_k.weight[0, 0] += 1e-3
    inp = R.make_inputs(FlowConfig.tiny(), PROMPT_TOKENS, 1, seed=3)
    a = ours.setup_cache(inp.prompt_token, inp.prompt_mel, inp.spk, N_STEPS)["estimator_att_cache"]
    b = ref_flow.setup_cache(inp.prompt_token, inp.prompt_mel, inp.spk, N_STEPS)["estimator_att_cache"]
    assert R.rel_err(a, b[:N_STEPS]) > 1e-5


def test_state_dict_loads_strictly_both_ways():
    ours, ref_flow = R.tiny_flow_pair(seed=0)
    assert list(ours.state_dict()) == list(ref_flow.state_dict())
    fresh = build_flow(FlowConfig.tiny())
    fresh.load_state_dict(ref_flow.state_dict(), strict=True)
    ref_fresh = R.build_reference_flow(FlowConfig.tiny())
    ref_fresh.load_state_dict(ours.state_dict(), strict=True)
    for (k, a), (_, b) in zip(ours.state_dict().items(), ref_fresh.state_dict().items()):
        assert torch.equal(a, b), k


def _shapes(module: torch.nn.Module) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def test_minicpmo45_on_meta_matches_reference_names_and_shapes():
    cfg = FlowConfig.minicpmo45()
    ours = build_flow(cfg, device="meta")
    ref = R.build_reference_flow(cfg, device="meta")
    assert all(p.is_meta for p in ours.parameters())
    # the reference's pos_bias_u/v use torch.Tensor(h, d_k), which ignores the device context
    assert all(p.is_meta for n, p in ref.named_parameters() if ".pos_bias_" not in n)
    assert _shapes(ours) == _shapes(ref)
    n = sum(p.numel() for p in ours.parameters())
    assert n == sum(p.numel() for p in ref.parameters())
    assert ours.decoder.estimator.blocks[15].attn.to_q.weight.shape == (512, 512)
    assert len(ours.encoder.encoders) == 6 and len(ours.encoder.up_encoders) == 4


def test_missing_key_is_named():
    ours, ref_flow = R.tiny_flow_pair(seed=0)
    sd = ref_flow.state_dict()
    del sd["decoder.estimator.blocks.1.attn.k_norm.weight"]
    with pytest.raises(CheckpointError, match=r"decoder\.estimator\.blocks\.1\.attn\.k_norm\.weight"):
        load_strict(build_flow(FlowConfig.tiny()), sd, "flow")


@pytest.mark.parametrize(
    "length, expect",
    [
        (20 + 100, list(range(120))),  # not longer than P + 100: untouched
        (20 + 101, list(range(20)) + list(range(21, 121))),
        (20 + 150, list(range(20)) + list(range(70, 170))),
    ],
)
def test_trim_keeps_first_p_and_last_100(length, expect):
    # frame index written into the payload, so we can read back which frames were kept
    est = torch.arange(length, dtype=torch.float32).view(1, 1, 1, 1, length, 1).expand(2, 1, 2, 1, length, 4)
    conf = torch.arange(length, dtype=torch.float32).view(1, 1, 1, length, 1).expand(3, 1, 1, length, 2)
    out = trim_stream_cache({"estimator_att_cache": est, "conformer_att_cache": conf, "x": None}, 20)
    assert out["estimator_att_cache"][0, 0, 0, 0, :, 0].tolist() == expect
    assert out["conformer_att_cache"][0, 0, 0, :, 0].tolist() == expect
    assert out["x"] is None


def test_block_pieces_compose_to_forward_chunk():
    # the batched runner supplies K/V itself through qkv/attend; that must equal forward_chunk
    torch.manual_seed(0)
    block = DiTBlock(32, 2, 16, 4.0).eval()
    x, c = torch.randn(2, 5, 32), torch.randn(2, 1, 32)
    cache = torch.randn(2, 2, 7, 32)  # (b, heads, T, 2*head_dim)
    ref_x, ref_cnn, ref_att = block.forward_chunk(x, c, None, cache)
    mod = block.modulation(c)
    q, k, v = block.attn.qkv(block.attention_input(x, mod))
    k_all = torch.cat([k, cache[..., :16]], dim=2)  # [new | cache]
    v_all = torch.cat([v, cache[..., 16:]], dim=2)
    out, cnn = block.finish(x, block.attn.attend(q, k_all, v_all), mod, None)
    assert torch.equal(out, ref_x) and torch.equal(cnn, ref_cnn)
    assert torch.equal(ref_att, torch.cat([k_all, v_all], dim=3))


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="dit_in_channels"):
        FlowConfig(dit_in_channels=300)
    flow = build_flow(FlowConfig.tiny())
    spk = torch.randn(1, 192)
    with pytest.raises(ValueError, match="prompt mel"):
        flow.setup_cache(torch.zeros(1, 13, dtype=torch.long), torch.randn(1, 21, 80), spk)
    with pytest.raises(ValueError, match="token ids"):
        flow.setup_cache(torch.full((1, 13), 6561), torch.randn(1, 20, 80), spk)


def test_conformer_forward_chunk_batched_rows_match_rows_alone():
    """Sessions with equal cache lengths run the conformer as one batch (BatchedCode2Wav groups
    them so): each row equals that row run alone, up to the CPU GEMMs' batch-size rounding
    (observed 5.4e-7 relative; bound: the project's float32 1e-5); the caches keep one row per session."""
    flow = build_flow(FlowConfig.tiny())
    R.randomize_flow_(flow, 4)
    enc, d = flow.encoder, FlowConfig.tiny().encoder_output_size
    gen = torch.Generator().manual_seed(2)
    layers = len(enc.encoders) + len(enc.up_encoders)
    heads = FlowConfig.tiny().encoder_heads
    cnn = torch.randn(3, d, 6, generator=gen)
    att = torch.randn(layers, 3, heads, 12, 2 * d // heads, generator=gen)
    for last, tokens in ((False, 8), (True, 5)):
        xs = torch.randn(3, tokens, d, generator=gen)
        h, new_cnn, new_att = enc.forward_chunk(xs, last, cnn, att)
        frames = 2 * (tokens if last else tokens - 3)
        assert h.shape == (3, frames, d) and new_att.shape == (layers, 3, heads, 12 + frames, 2 * d // heads)
        for i in range(3):
            hi, ci, ai = enc.forward_chunk(xs[i:i + 1], last, cnn[i:i + 1], att[:, i:i + 1])
            assert R.rel_err(h[i:i + 1], hi) <= 1e-5
            assert R.rel_err(new_cnn[i:i + 1], ci) <= 1e-5 and R.rel_err(new_att[:, i:i + 1], ai) <= 1e-5


def test_conformer_segments_match_each_segment_alone():
    """Rows whose conformer caches differ in length share one call in segments
    (``forward_chunk_segments``: the attention per segment, everything else once): each segment
    equals ``forward_chunk`` over its rows alone up to the CPU GEMMs' batch-size rounding (the
    project's float32 bound 1e-5), a segment without a cache (a stream's first chunk) included,
    and each segment gets its own new cache. Segment sizes that do not add up are refused."""
    flow = build_flow(FlowConfig.tiny())
    R.randomize_flow_(flow, 5)
    enc, cfg = flow.encoder, FlowConfig.tiny()
    d, heads = cfg.encoder_output_size, cfg.encoder_heads
    layers = len(enc.encoders) + len(enc.up_encoders)
    gen = torch.Generator().manual_seed(6)
    sizes, lengths = [2, 1, 3], [12, None, 20]
    cnn = torch.randn(sum(sizes), d, 6, generator=gen)
    atts = [None if t is None else torch.randn(layers, n, heads, t, 2 * d // heads, generator=gen)
            for n, t in zip(sizes, lengths)]
    for last, tokens in ((False, 8), (True, 5)):
        xs = torch.randn(sum(sizes), tokens, d, generator=gen)
        h, new_cnn, new_atts = enc.forward_chunk_segments(xs, last, cnn, atts, sizes)
        frames = 2 * (tokens if last else tokens - 3)
        start = 0
        for n, t, att, new_att in zip(sizes, lengths, atts, new_atts):
            rows = slice(start, start + n)
            start += n
            hs, cs, as_ = enc.forward_chunk(xs[rows], last, cnn[rows], att)
            assert new_att.shape == (layers, n, heads, (t or 0) + frames, 2 * d // heads)
            assert R.rel_err(h[rows], hs) <= 1e-5 and R.rel_err(new_cnn[rows], cs) <= 1e-5
            assert R.rel_err(new_att, as_) <= 1e-5
    with pytest.raises(ValueError, match="segments"):
        enc.forward_chunk_segments(xs, False, cnn, atts, [2, 1, 2])
