"""Audio encoder vs transformers' WhisperFeatureExtractor / WhisperEncoder, streaming vs a dense
block-causal reference built from transformers' layers, and input validation."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from duplexcache.models.audio_encoder import (CACHE_GROWTH_FRAMES, AudioEncoder, AudioEncoderConfig, LogMel,
                                              StreamingAudioEncoderState, mel_filter_bank)

transformers = pytest.importorskip("transformers")
from transformers import WhisperConfig, WhisperFeatureExtractor  # noqa: E402
from transformers.models.whisper.modeling_whisper import WhisperEncoder as HFWhisperEncoder  # noqa: E402


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def make_pair(cfg: AudioEncoderConfig, seed: int = 0):
    """Our encoder with random weights and transformers' WhisperEncoder holding the same weights."""
    torch.manual_seed(seed)
    ours = AudioEncoder(cfg).eval()
    hf_cfg = WhisperConfig(d_model=cfg.d_model, encoder_layers=cfg.encoder_layers,
                           encoder_attention_heads=cfg.encoder_attention_heads,
                           encoder_ffn_dim=cfg.encoder_ffn_dim, max_source_positions=cfg.max_source_positions,
                           num_mel_bins=cfg.num_mel_bins)
    hf = HFWhisperEncoder(hf_cfg).eval()
    hf.load_state_dict(ours.apm.state_dict(), strict=True)
    return ours, hf


def ref_project(ours: AudioEncoder, frames: torch.Tensor, pool: int) -> torch.Tensor:
    """Projection + AvgPool written out by hand from the state dict: (F, d) -> (F // pool, out)."""
    sd = ours.audio_projection_layer.state_dict()
    x = F.linear(F.relu(F.linear(frames, sd["linear1.weight"], sd["linear1.bias"])),
                 sd["linear2.weight"], sd["linear2.bias"])
    n = x.shape[0] // pool
    return x[: n * pool].reshape(n, pool, x.shape[-1]).mean(dim=1)


def test_log_mel_matches_whisper_feature_extractor():
    fe = WhisperFeatureExtractor()
    assert np.abs(mel_filter_bank().numpy() - fe.mel_filters).max() < 1e-7
    torch.manual_seed(0)
    audio = (torch.rand(16560) * 2 - 1) * 0.5
    ours = LogMel()(audio)
    ref = fe._np_extract_fbank_features(audio.numpy()[None].astype(np.float64), "cpu")[0]
    assert ours.shape == (80, 103)
    assert np.abs(ours.numpy() - ref).max() < 1e-5


def test_whole_utterance_matches_whisper_encoder():
    cfg = AudioEncoderConfig.tiny(max_source_positions=32)  # transformers insists on 2 * 32 mel frames
    ours, hf = make_pair(cfg)
    mel = torch.randn(2, 80, 64)
    with torch.no_grad():
        ref = hf(mel).last_hidden_state
        got = ours.apm(mel)
        emb = ours.encode_mel(mel)
    assert rel_err(got, ref) <= 1e-5
    assert emb.shape == (2, 32 // 5, cfg.out_dim)
    for b in range(2):
        assert rel_err(emb[b], ref_project(ours, ref[b], cfg.pool_step)) <= 1e-5


def reference_stream(ours: AudioEncoder, hf, mels: list[torch.Tensor], max_cache: int) -> list[torch.Tensor]:
    """The documented semantics, built densely: per segment between resets, concatenate the conv
    outputs, add positions 0.., run transformers' layers with a block-causal chunk mask."""
    outs, segment = [], []
    with torch.no_grad():
        for mel in mels:
            front = F.gelu(hf.conv2(F.gelu(hf.conv1(mel[None]))))[0].T  # (F, d)
            if sum(s.shape[0] for s in segment) + front.shape[0] > max_cache:
                segment = []
            segment.append(front)
            x = torch.cat(segment)
            chunk_id = torch.cat([torch.full((s.shape[0],), i) for i, s in enumerate(segment)])
            allowed = chunk_id[None, :] <= chunk_id[:, None]
            mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
            x = (x + hf.embed_positions.weight[: x.shape[0]])[None]
            for layer in hf.layers:
                x = layer(x, mask)
            x = hf.layer_norm(x)[0, -front.shape[0]:]
            outs.append(ref_project(ours, x, ours.cfg.pool_step))
    return outs


def test_streaming_matches_block_causal_reference_with_small_reset():
    cfg = AudioEncoderConfig.tiny(max_source_positions=64, max_cache_frames=40)
    ours, hf = make_pair(cfg, seed=1)
    torch.manual_seed(2)
    # Two sessions with different chunk sizes, batched in one step each tick.
    sizes = {0: [23, 20, 20, 30, 20, 20], 1: [40, 10, 35, 20, 20, 5]}  # mel frames per chunk
    mels = {s: [torch.randn(80, m) for m in sizes[s]] for s in sizes}
    states = [ours.new_stream_state(), ours.new_stream_state()]
    got = {0: [], 1: []}
    for t in range(6):
        out = ours.stream_step_mel(states, [mels[0][t], mels[1][t]])
        got[0].append(out[0])
        got[1].append(out[1])
    for s in (0, 1):
        ref = reference_stream(ours, hf, mels[s], cfg.max_cache_frames)
        for t, (a, b) in enumerate(zip(got[s], ref)):
            assert a.shape == b.shape, (s, t)
            if a.numel():
                assert rel_err(a, b) <= 1e-5, (s, t)
    # session 0 frames: 12, 10, 10 (=32), 15 -> 47 > 40 reset, 10 (25), 10 (35)
    assert states[0].num_resets == 1 and states[0].num_frames == 35
    # session 1 frames: 20, 5, 18 -> 43 > 40 reset, 10 (28), 10 -> 38, 3 -> 41 > 40 reset
    assert states[1].num_resets == 2 and states[1].num_frames == 3


def test_streaming_reset_at_real_1500_frames():
    cfg = AudioEncoderConfig.tiny(max_source_positions=1500, max_cache_frames=1500, encoder_layers=1)
    ours, hf = make_pair(cfg, seed=3)
    torch.manual_seed(4)
    mels = [torch.randn(80, 103)] + [torch.randn(80, 100) for _ in range(30)]  # 52 + 30 x 50 frames
    state = ours.new_stream_state()
    got = [ours.stream_step_mel([state], [m])[0] for m in mels]
    # 52 + 28 x 50 = 1452 frames fit; the 30th chunk would make 1502 > 1500, so it starts fresh.
    assert state.num_resets == 1 and state.num_frames == 100
    ref = reference_stream(ours, hf, mels, 1500)
    for t in (0, 1, 28, 29, 30):
        assert got[t].shape == (10, cfg.out_dim)
        assert rel_err(got[t], ref[t]) <= 1e-5, t


def test_stream_step_audio_gives_ten_embeddings_per_second():
    ours = AudioEncoder(AudioEncoderConfig.tiny()).eval()
    torch.manual_seed(5)
    state = ours.new_stream_state()
    first = ours.stream_step([state], [torch.rand(16560) - 0.5])[0]
    second = ours.stream_step([state], [torch.rand(16000) - 0.5])[0]
    assert first.shape == second.shape == (10, 96)
    assert state.num_frames == 52 + 50 and state.num_chunks == 2
    whole = ours.embed_audio(torch.rand(32000) - 0.5)
    assert whole.shape == (20, 96)


@pytest.mark.parametrize("growth", [16, 48, CACHE_GROWTH_FRAMES])
def test_growing_cache_is_bit_identical_to_whole_cache(growth):
    """Sessions batched in stream_step, one opening a tick later (padded batch), over several
    grows and resets: every output equals the run whose caches were allocated whole at open."""
    cfg = AudioEncoderConfig.tiny()  # max_cache_frames 128: chunks of 52, 50 -> reset every 2-3 chunks
    ours = AudioEncoder(cfg).eval()
    per_frame = cfg.kv_bytes_per_session(torch.float32) // cfg.max_cache_frames
    gen = torch.Generator().manual_seed(6)
    ticks = 7
    starts = {"a": 0, "b": 1, "c": 0}
    audio = {sid: [torch.rand(16560 if t == start else 16000, generator=gen) - 0.5 for t in range(start, ticks)]
             for sid, start in starts.items()}
    outs = {}
    for grow in (True, False):
        states, got, grows = {}, {sid: [] for sid in starts}, 0
        for t in range(ticks):
            for sid, start in starts.items():
                if t == start:
                    states[sid] = ours.new_stream_state(grow=grow, growth_frames=growth)
                    assert states[sid].nbytes == (0 if grow else cfg.kv_bytes_per_session(torch.float32))
            live = [sid for sid in starts if sid in states]
            before = {sid: states[sid].capacity for sid in live}
            for sid, out in zip(live, ours.stream_step([states[s] for s in live],
                                                       [audio[s][t - starts[s]] for s in live])):
                got[sid].append(out)
                st = states[sid]
                if grow:  # the next multiple of the step that holds the frames, capped; kept across resets
                    step = min(cfg.max_cache_frames, -(-st.num_frames // growth) * growth)
                    assert st.capacity == max(before[sid], step)
                    grows += st.capacity > before[sid]
                assert st.num_frames <= st.capacity <= cfg.max_cache_frames
                assert st.nbytes == st.capacity * per_frame <= cfg.kv_bytes_per_session(torch.float32)
        outs[grow] = got
        if grow:
            assert all(s.num_resets >= 2 for s in states.values())
            assert grows >= (2 * len(starts) if growth <= 48 else len(starts))
    for sid in starts:
        assert len(outs[True][sid]) == ticks - starts[sid]
        for t, (a, b) in enumerate(zip(outs[True][sid], outs[False][sid])):
            assert torch.equal(a, b), (growth, sid, t)


def test_cache_grows_by_steps_and_keeps_capacity_across_resets():
    cfg = AudioEncoderConfig.tiny(max_source_positions=64, max_cache_frames=40)
    ours = AudioEncoder(cfg).eval()
    state = ours.new_stream_state(growth_frames=12)
    per_frame = cfg.kv_bytes_per_session(torch.float32) // cfg.max_cache_frames
    caps = []
    for mel_frames in (9, 20, 20, 30, 20):  # encoder frames 5, 10, 10, 15, 10: 5, 15, 25, 40, reset
        ours.stream_step_mel([state], [torch.randn(80, mel_frames)])
        caps.append(state.capacity)
    # 5 -> 12, 15 -> 24, 25 -> 36, 40 -> 40 (capped, not 48), reset: 10 frames in the kept 40
    assert caps == [12, 24, 36, 40, 40] and state.num_resets == 1 and state.num_frames == 10
    assert state.nbytes == 40 * per_frame == cfg.kv_bytes_per_session(torch.float32)
    with pytest.raises(ValueError, match="max_frames 40"):
        state.reserve(41)
    with pytest.raises(ValueError, match="growth_frames"):
        ours.new_stream_state(growth_frames=0)


def test_minicpmo45_cache_bytes_at_setup_on_meta():
    """What a new session's encoder cache costs, from the minicpmo45 shapes (no weights built)."""
    cfg = AudioEncoderConfig.minicpmo45()
    with torch.device("meta"):
        model = AudioEncoder(cfg).to(torch.bfloat16)
    state = model.new_stream_state()
    per_frame = 2 * 24 * 1024 * 2  # K and V, 24 layers, d_model 1024, bf16
    assert state.nbytes == 0
    state.reserve(52)    # first chunk: 1.035 s -> 52 frames
    state.reserve(102)   # second chunk: the session's first audio comes out in this tick
    assert state.nbytes == CACHE_GROWTH_FRAMES * per_frame == 12_288_000  # 11.7 MiB
    state.reserve(1500)
    assert state.nbytes == cfg.kv_bytes_per_session(torch.bfloat16)  # 140.6 MiB, what admission reserves
    assert model.new_stream_state(grow=False).nbytes == cfg.kv_bytes_per_session(torch.bfloat16)
    # fp8 (precision.encoder_cache_dtype): 64 value bytes + a 4-byte scale per (frame, head): 74.7 MiB
    fp8 = model.new_stream_state(grow=False, storage_dtype=torch.float8_e4m3fn)
    assert fp8.nbytes == cfg.kv_bytes_per_session(torch.bfloat16, torch.float8_e4m3fn) == 2 * 24 * 1500 * 16 * 68


@pytest.mark.parametrize("audio, rate, match", [
    (torch.zeros(0), 16000, "empty"),
    (torch.zeros(100), 16000, "too short"),
    (torch.zeros(16000), 24000, "sample rate"),
    (torch.zeros(16000, dtype=torch.int16), 16000, "float PCM"),
    (torch.full((16000,), float("nan")), 16000, "NaN"),
    (torch.zeros(2, 16000), 16000, "mono"),
    (torch.full((16000,), 3000.0), 16000, "32768"),
    ("not audio", 16000, "float"),
])
def test_bad_audio_raises_clear_value_error(audio, rate, match):
    ours = AudioEncoder(AudioEncoderConfig.tiny())
    with pytest.raises(ValueError, match=match):
        ours.embed_audio(audio, rate)


def test_bad_stream_inputs():
    ours = AudioEncoder(AudioEncoderConfig.tiny())
    state = ours.new_stream_state()
    with pytest.raises(ValueError, match="first streaming chunk must have 16560"):
        ours.stream_step([state], [torch.zeros(16000)])
    with pytest.raises(ValueError, match="80 bins"):
        ours.stream_step_mel([state], [torch.zeros(40, 100)])
    with pytest.raises(ValueError, match="states but"):
        ours.stream_step_mel([state], [])
    assert state.num_frames == 0 and state.num_chunks == 0  # nothing was half-applied
    with pytest.raises(ValueError, match="max_cache_frames"):
        AudioEncoderConfig.tiny(max_source_positions=100, max_cache_frames=200)


def test_minicpmo45_shapes_on_meta():
    cfg = AudioEncoderConfig.minicpmo45()
    with torch.device("meta"):
        model = AudioEncoder(cfg)
    sd = model.state_dict()
    assert sd["apm.conv1.weight"].shape == (1024, 80, 3)
    assert sd["apm.embed_positions.weight"].shape == (1500, 1024)
    assert "apm.layers.23.self_attn.k_proj.bias" not in sd and "apm.layers.23.self_attn.q_proj.bias" in sd
    assert sd["audio_projection_layer.linear1.weight"].shape == (4096, 1024)
    assert sd["audio_projection_layer.linear2.weight"].shape == (4096, 4096)
    with torch.device("meta"):  # transformers' whisper-medium encoder, same names and shapes
        hf = HFWhisperEncoder(WhisperConfig(d_model=1024, encoder_layers=24, encoder_attention_heads=16,
                                            encoder_ffn_dim=4096, max_source_positions=1500))
    hf_shapes = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert {k[4:]: tuple(v.shape) for k, v in sd.items() if k.startswith("apm.")} == hf_shapes
    assert cfg.kv_bytes_per_session(torch.bfloat16) == 2 * 24 * 1500 * 1024 * 2


def test_fp8_cache_grows_like_its_whole_allocation_and_stays_near_the_exact_cache():
    """precision.encoder_cache_dtype: fp8_e4m3. The growing fp8 cache gives the outputs of the
    fp8 cache allocated whole (torch.equal, over grows and a reset); those outputs differ from
    the exact cache's by fp8's rounding only (relative error of every chunk's embeddings within
    5 %, measured 0.14-0.23 %); the bytes are values + scales, what admission reserves."""
    cfg = AudioEncoderConfig.tiny()   # max_cache_frames 128: a reset every 2-3 chunks
    ours = AudioEncoder(cfg).eval()
    fp8 = torch.float8_e4m3fn
    gen = torch.Generator().manual_seed(11)
    chunks = [torch.rand(16560 if t == 0 else 16000, generator=gen) - 0.5 for t in range(6)]
    outs = {}
    for name, kwargs in (("exact", {}), ("fp8", {"storage_dtype": fp8}),
                         ("fp8_whole", {"storage_dtype": fp8, "grow": False})):
        state = ours.new_stream_state(growth_frames=16, **kwargs)
        outs[name] = [ours.stream_step([state], [c])[0] for c in chunks]
        if name != "exact":
            assert state.quantized and state.k.dtype == fp8 and state.k_scale.shape == state.k.shape[:-1]
            assert state.num_resets >= 1
    full = cfg.kv_bytes_per_session(torch.float32, fp8)
    rows = 2 * cfg.encoder_layers * cfg.max_cache_frames * cfg.encoder_attention_heads
    assert full == rows * (cfg.head_dim + 4) < cfg.kv_bytes_per_session(torch.float32)
    assert state.nbytes == full   # the whole allocation: values + scales
    for a, b in zip(outs["fp8"], outs["fp8_whole"]):
        assert torch.equal(a, b)
    errs = [float((b - a).norm() / a.norm()) for a, b in zip(outs["exact"], outs["fp8"])]
    assert all(0 < e < 0.05 for e in errs), errs
    with pytest.raises(ValueError, match="scales exactly when it is fp8"):
        StreamingAudioEncoderState(k=torch.zeros(1, 1, 0, 4, dtype=fp8), v=torch.zeros(1, 1, 0, 4, dtype=fp8),
                                   max_frames=8)


def test_same_length_chunks_are_featurised_together_with_the_per_session_result():
    """stream_step sends every same-length chunk through one log-mel, one conv front and one
    projection (one host sync per length, not per session): each session's embeddings match the
    session stepped alone up to float rounding, mixed first/later chunks included; a bad chunk
    is still refused by name."""
    ours = AudioEncoder(AudioEncoderConfig.tiny()).eval()
    gen = torch.Generator().manual_seed(21)
    alone = [ours.new_stream_state() for _ in range(4)]
    together = [ours.new_stream_state() for _ in range(4)]
    for t in range(3):
        # session 3 joins a tick late: its first (longer) chunk rides with the others' later ones
        live = [i for i in range(4) if t > 0 or i < 3]
        pcm = {i: torch.rand(16560 if t == (1 if i == 3 else 0) else 16000, generator=gen) - 0.5 for i in live}
        batched = ours.stream_step([together[i] for i in live], [pcm[i] for i in live])
        for i, got in zip(live, batched):
            want = ours.stream_step([alone[i]], [pcm[i]])[0]
            assert got.shape == want.shape and rel_err(got, want) <= 1e-5, (t, i)
    # A batched log-mel normalises each clip by its own maximum (Whisper floors a clip at its max
    # - 8): a clip with a silent half and the same clip 60 dB quieter have different floors, so a
    # max over the whole batch would change the quiet one.
    clip = torch.rand(16000, generator=gen) - 0.5
    clip[8000:] = 0
    two = ours.log_mel(torch.stack([clip, 1e-3 * clip]))
    for got, alone in zip(two, (ours.log_mel(clip), ours.log_mel(1e-3 * clip))):
        assert torch.allclose(got, alone, atol=1e-5)
    assert not torch.allclose(two[0], two[1])
    bad = [torch.rand(16000, generator=gen) - 0.5 for _ in range(2)]
    bad[1][7] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        ours.stream_step(together[:2], bad)


@pytest.mark.parametrize("storage", [None, torch.float8_e4m3fn])
def test_batched_cache_store_and_gather_equal_each_session_alone(storage):
    """TickKV's store / gather (one quantize and one dequantize per layer for the batch, one
    multi-tensor copy into a zeroed buffer reused by every layer) give torch.equal caches and keys
    to each session's own write, then read, zero-padded and stacked: the per-session path they
    replace. Two layers in a row: the second gather must not see the first layer's rows."""
    from duplexcache.models.audio_encoder import TickKV

    ours = AudioEncoder(AudioEncoderConfig.tiny()).eval()
    gen = torch.Generator().manual_seed(5)
    starts, lens = [0, 7, 20], [9, 5, 9]          # different offsets and chunk lengths, one padded row
    heads, hd = ours.cfg.encoder_attention_heads, ours.cfg.head_dim
    old = torch.randn(3, heads, 20, hd, generator=gen)
    k, v = (torch.randn(3, heads, 9, hd, generator=gen) * 3 for _ in range(2))
    batched = [ours.new_stream_state(growth_frames=16, storage_dtype=storage) for _ in range(3)]
    alone = [ours.new_stream_state(growth_frames=16, storage_dtype=storage) for _ in range(3)]
    for b in range(3):                              # earlier frames, written the same way in both
        for st in (batched[b], alone[b]):
            st.reserve(starts[b] + lens[b])
            if starts[b]:
                for layer in (0, 1):
                    st.write(layer, 0, old[b, :, :starts[b]] + layer, old[b, :, :starts[b]] * 2)
    traffic = TickKV(batched, starts, lens)
    key_lens = [s + n for s, n in zip(starts, lens)]
    k_max = max(key_lens)
    for layer, scale in ((1, 1.0), (0, -2.0)):       # the buffer is reused: layer 0 must not see layer 1
        traffic.store(layer, k * scale, v * scale)
        for b, st in enumerate(alone):
            st.write(layer, starts[b], k[b, :, :lens[b]] * scale, v[b, :, :lens[b]] * scale)
        keys, values = traffic.gather(layer, torch.float32)
        reads = [st.read(layer, n, torch.float32) for st, n in zip(alone, key_lens)]
        want_k = torch.stack([F.pad(kb, (0, 0, 0, k_max - kb.shape[1])) for kb, _ in reads])
        want_v = torch.stack([F.pad(vb, (0, 0, 0, k_max - vb.shape[1])) for _, vb in reads])
        assert torch.equal(keys, want_k) and torch.equal(values, want_v)
        for a, b, n in zip(batched, alone, key_lens):   # frames past n are unwritten (empty) in both
            assert all(torch.equal(x.view(torch.uint8) if x.dtype == storage else x,
                                   y.view(torch.uint8) if y.dtype == storage else y)
                       for x, y in zip(a.stored(layer, n), b.stored(layer, n)))
    mixed = [ours.new_stream_state(), ours.new_stream_state(storage_dtype=torch.float8_e4m3fn)]
    with pytest.raises(ValueError, match="mixes"):
        TickKV(mixed, [0, 0], [1, 1])


@pytest.mark.parametrize("storage", [None, torch.float8_e4m3fn])
def test_stream_step_ops_do_not_grow_with_sessions(storage):
    """A tick's cache stores and gathers are one multi-tensor copy per dtype for the whole batch
    and the batch is built with one indexed write per chunk length: the compute ops of a steady
    step (what become kernel launches on CUDA) are the same for 3 sessions and for 12.
    The per-session copies this replaced added 4 ops per session and layer."""
    from torch.profiler import ProfilerActivity, profile

    from op_count import compute_ops   # tests/models/op_count.py

    ours = AudioEncoder(AudioEncoderConfig.tiny()).eval()
    counts = {}
    for n in (3, 12):
        states = [ours.new_stream_state(storage_dtype=storage) for _ in range(n)]
        gen = torch.Generator().manual_seed(n)
        ours.stream_step(states, [torch.rand(16560, generator=gen) - 0.5 for _ in states])
        # From log-mels: the PCM checks before them run on the host's copy of each chunk (no
        # device work), so only the device-side step is counted.
        mels = list(ours.log_mel(torch.rand(n, 16000, generator=gen) - 0.5))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            ours.stream_step_mel(states, mels)
        counts[n] = compute_ops(prof)
    assert counts[3] == counts[12], counts
