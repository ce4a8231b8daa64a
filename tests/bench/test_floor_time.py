"""The time floor of one extra session (bench/floor.py) and the per-session slope (bench/engine_ticks.py).

Checked against independent sources:
* the closed-form FLOP counts against ``torch.utils.flop_counter.FlopCounterMode`` over the real
  tiny modules on CPU (Thinker dense forward, a streaming encoder chunk, a flow chunk, the
  vocoder). On CPU the counter does not see ``scaled_dot_product_attention``, so those
  attention terms are checked by hand arithmetic instead;
* the slope against a synthetic series built from a known line;
* the minicpmo45 bytes by hand arithmetic from the shapes (SPEC numbers).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from duplexcache.bench import engine_ticks as et
from duplexcache.bench import engine_ticks_report as etr
from duplexcache.bench import floor as fl
from duplexcache.cfm.config import Code2WavShape
from duplexcache.models.audio_encoder import AudioEncoder
from duplexcache.models.flow import build_flow
from duplexcache.models.presets import preset_configs
from duplexcache.models.thinker import Thinker
from duplexcache.models.vocoder import build_vocoder, frozen_weight_norm

torch.set_num_threads(1)  # 2 shared cores
H100 = fl.DEVICE_PEAKS["h100-sxm"]


def _counted(fn) -> int:
    with FlopCounterMode(display=False) as mode:
        fn()
    return mode.get_total_flops()


def _shape(**kw) -> fl.TickShape:
    base = dict(speaking_fraction=0.5, thinker_window_tokens=7000, talker_turn_tokens=90, prompt_frames=300,
                encoder_cache_frames=725)
    return fl.TickShape(**{**base, **kw})


# ----------------------------------------------------------------------------- closed forms vs counted


def test_thinker_flops_match_the_counted_dense_forward():
    tk = preset_configs("tiny")[0]
    model = Thinker(tk).eval()
    t = 12
    with torch.no_grad():
        got = _counted(lambda: model.forward_dense(torch.randn(1, t, tk.hidden_size), torch.arange(t)[None]))
    # every row through the layers and the LM head; attention (sdpa, not counted on CPU) left out
    layers = tk.num_hidden_layers * fl.decoder_layer_flops(tk.hidden_size, tk.num_attention_heads,
                                                           tk.num_key_value_heads, tk.head_dim, tk.intermediate_size, t)
    assert got == layers + 2 * t * tk.hidden_size * tk.vocab_size
    assert fl.attention_flops(2, 4, 16, t * t) == 4 * 2 * 4 * 16 * 144


def test_encoder_chunk_flops_match_the_counted_stream_step():
    enc_cfg = preset_configs("tiny")[2]
    enc = AudioEncoder(enc_cfg).eval()
    state = enc.new_stream_state()
    gen = torch.Generator().manual_seed(0)
    enc.stream_step([state], [0.1 * torch.rand(enc_cfg.first_chunk_samples, generator=gen)])
    cached = fl.encoder_cache_frames_at(1, enc_cfg)
    assert cached == 52 == enc_cfg.chunk_frames(enc_cfg.first_chunk_samples)
    got = _counted(lambda: enc.stream_step([state], [0.1 * torch.rand(enc_cfg.chunk_samples, generator=gen)]))
    matmul, attention = fl.encoder_chunk_flops(enc_cfg, cached)
    assert got == matmul
    assert attention == 4 * enc_cfg.encoder_layers * enc_cfg.d_model * 50 * (cached + 50)


def test_flow_chunk_and_vocoder_flops_match_the_counted_forwards():
    _, _, _, flow_cfg, voc_cfg = preset_configs("tiny")
    flow = build_flow(flow_cfg)
    p = 24
    gen = torch.Generator().manual_seed(0)
    spk = torch.randn(1, 192, generator=gen)
    cache = flow.setup_cache(torch.randint(0, 100, (1, p // 2 + 3), generator=gen),
                             torch.randn(1, p, 80, generator=gen), spk)
    got = _counted(lambda: flow.inference_chunk(torch.randint(0, 100, (1, 28), generator=gen), spk, cache))
    matmul, attention = fl.flow_chunk_flops(flow_cfg, 28, p // 2, p)
    frames = 50
    estimator_attention = 2 * flow_cfg.n_timesteps * fl.attention_flops(
        flow_cfg.dit_depth, flow_cfg.dit_heads, flow_cfg.dit_head_dim, frames * (frames + p))
    # the conformer's attention is explicit matmuls (counted), the estimator's is sdpa (not on CPU)
    assert got == matmul + attention - estimator_attention
    vocoder = frozen_weight_norm(build_vocoder(voc_cfg))
    assert _counted(lambda: vocoder(torch.randn(1, 80, 58, generator=gen))) == fl.vocoder_flops(voc_cfg, 58)


def test_code2wav_shape_of_config_equals_the_built_flows():
    flow_cfg = preset_configs("tiny")[3]
    assert fl.code2wav_shape_of(flow_cfg) == Code2WavShape.from_flow(build_flow(flow_cfg, device="meta"))
    assert fl.code2wav_shape_of(preset_configs("minicpmo45")[3]) == Code2WavShape.minicpmo45()


# ----------------------------------------------------------------------------- the floor's switches


def _floor(preset: str = "minicpmo45", shape: fl.TickShape | None = None, **kw) -> fl.TickFloor:
    tk, tl, enc, flow, voc = preset_configs(preset)
    return fl.tick_floor(tk, tl, enc, flow, voc, shape or _shape(), kw.pop("dtype", "bfloat16"), peak=H100, **kw)


def test_minicpmo45_thinker_bytes_by_hand():
    f = _floor(shape=_shape(speaking_fraction=1.0))
    # a speaking unit: append + <|speak|> + 3 text + end = 6 reads of 7000 tokens x 144 KiB (bf16 K+V, 36 layers)
    assert f.work["thinker"].own_bytes == 6 * 7000 * 2 * 36 * 8 * 128 * 2
    listening = _floor(shape=_shape(speaking_fraction=0.0))
    assert listening.work["thinker"].own_bytes == 2 * 7000 * 2 * 36 * 8 * 128 * 2
    assert listening.work["talker"].own_bytes == 0 and listening.ms("code2wav") == 0
    # the Code2Wav cache of P = 300 own frames, float32: estimator 1.25 MiB + conformer 40 KiB per frame
    assert f.work["code2wav"].own_bytes == 300 * (10 * 16 * 2 * 8 * 2 * 64 * 4 + 10 * 8 * 2 * 64 * 4)


def test_floor_follows_code2wav_dtype_and_kv_dtype():
    fp32 = _floor(code2wav_dtype="float32")
    bf16 = _floor(code2wav_dtype="bfloat16")
    assert bf16.ms("code2wav") < fp32.ms("code2wav")
    # the vocoder stays float32 in both: only the flow's FLOPs move to the bf16 peak
    assert bf16.work["code2wav"].matmul_flops["float32"] == fl.vocoder_flops(preset_configs("minicpmo45")[4], 58) / 2
    assert bf16.work["code2wav"].own_bytes == fp32.work["code2wav"].own_bytes / 2
    fp8 = _floor(kv_storage_dtype=torch.float8_e4m3fn)
    assert fp8.ms("thinker") < fp32.ms("thinker") and fp8.ms("talker") < fp32.ms("talker")
    assert fp8.work["thinker"].own_bytes == fp32.work["thinker"].own_bytes * 132 / 256   # 128 bytes + 4 of scale
    assert fp8.work["thinker"].matmul_flops == fp32.work["thinker"].matmul_flops
    enc8 = _floor(encoder_storage_dtype=torch.float8_e4m3fn)
    assert enc8.work["encoder"].own_bytes < fp32.work["encoder"].own_bytes


def test_floor_follows_the_preset_shapes_and_the_run_shapes():
    tiny, big = _floor("tiny", dtype="float32"), _floor("minicpmo45")
    for stage in fl.STAGE_FLOOR_NAMES:
        assert tiny.ms(stage) < big.ms(stage), stage
    longer = _floor(shape=_shape(thinker_window_tokens=14000))
    assert longer.work["thinker"].own_bytes == 2 * big.work["thinker"].own_bytes
    assert _floor(shape=_shape(speaking_fraction=1.0)).ms("code2wav") == pytest.approx(2 * big.ms("code2wav"))
    assert big.ms("tick") == pytest.approx(sum(big.ms(s) for s in fl.STAGE_FLOOR_NAMES))
    assert fl.TickFloor(big.work, big.shape, None).ms("thinker") is None   # no peaks, no time claimed
    with pytest.raises(ValueError, match="speaking_fraction"):
        _shape(speaking_fraction=1.5)


def test_talker_turn_and_encoder_cache_lengths():
    tl, enc = preset_configs("minicpmo45")[1], preset_configs("minicpmo45")[2]
    unit = fl.talker_unit_tokens(tl)
    assert unit == 3 + 1 + 25 + 1
    assert [fl.encoder_cache_frames_at(u, enc) for u in (0, 1, 2)] == [0, 52, 102]
    frames = [fl.encoder_cache_frames_at(u, enc) for u in range(60)]
    # 52 + 28 * 50 = 1452 frames: unit 29's chunk would pass 1500, so the cache empties; then every 30 units
    assert [u for u, f in enumerate(frames) if f == 0] == [0, 29, 59] and max(frames) + 50 <= enc.max_cache_frames


def test_floor_device_from_the_device_name():
    assert fl.peak_for_device_name("NVIDIA H100 80GB HBM3") is fl.DEVICE_PEAKS["h100-sxm"]
    assert fl.peak_for_device_name("NVIDIA H100 PCIe") is fl.DEVICE_PEAKS["h100-pcie"]
    assert fl.peak_for_device_name("NVIDIA H100 NVL") is fl.DEVICE_PEAKS["h100-nvl"]
    assert fl.peak_for_device_name("NVIDIA H200") is fl.DEVICE_PEAKS["h200"]
    assert fl.peak_for_device_name("NVIDIA A100-SXM4-80GB") is None
    assert fl.resolve_floor_device("auto", torch.device("cpu")) is None
    assert fl.resolve_floor_device("none", torch.device("cpu")) is None
    assert fl.resolve_floor_device("h200", torch.device("cpu")) is fl.DEVICE_PEAKS["h200"]
    with pytest.raises(ValueError, match="--floor-device"):
        fl.resolve_floor_device("b200", torch.device("cpu"))
    with pytest.raises(ValueError, match="no float8"):
        H100.flops_per_s("float8")


# ----------------------------------------------------------------------------- the slope


def test_fit_line_recovers_a_synthetic_line():
    xs = [8, 16, 24, 32]
    fit = etr.fit_line(xs, [12.5 + 3.25 * x for x in xs])
    assert fit["slope"] == pytest.approx(3.25, abs=1e-12) and fit["intercept"] == pytest.approx(12.5, abs=1e-9)
    assert fit["slope_stderr"] == pytest.approx(0.0, abs=1e-9) and fit["points"] == 4
    # residuals +1, -1, -1, +1 around the same line: slope unchanged, error sqrt(4 / 2 / 320)
    noisy = etr.fit_line(xs, [12.5 + 3.25 * x + e for x, e in zip(xs, (1, -1, -1, 1))])
    assert noisy["slope"] == pytest.approx(3.25) and noisy["slope_stderr"] == pytest.approx(math.sqrt(4 / 2 / 320))
    assert etr.fit_line([1, 2], [1.0, 3.0])["slope_stderr"] is None
    with pytest.raises(ValueError, match="distinct"):
        etr.fit_line([4, 4], [1.0, 2.0])


def _run(n: int, ms_per_session: dict[str, float], fixed_ms: float, status: str = "ok") -> et.RunResult:
    """A run whose every tick costs ``fixed_ms + ms_per_session[stage] * n`` (3 recorded ticks)."""
    r = et.RunResult(n, status=status)
    for stage in etr.PER_SESSION_STAGES:
        r.per_tick[stage] = [1e-3 * (fixed_ms + ms_per_session[stage] * n)] * 3
    return r


def test_per_session_costs_are_the_slope_beside_the_floor():
    per = {"encoder": 1.5, "vision": 0.5, "thinker": 4.0, "talker": 2.0, "code2wav": 8.0, "tick": 15.5, "wall": 16.0}
    rows = [_run(n, per, 40.0) for n in (16, 32, 48, 58)]
    rows.append(_run(64, {s: 100.0 for s in per}, 0.0, status="oom"))   # not fitted
    floor = _floor()
    out = etr.per_session_costs(rows, floor)
    for stage, slope in per.items():
        s = out["stages"][stage]
        assert s["slope_ms"] == pytest.approx(slope) and s["intercept_ms"] == pytest.approx(40.0)
        assert s["sessions"] == [16, 32, 48, 58] and s["points"] == 4
        if stage == "vision":   # bench/floor.py models no vision stage: a slope, no floor
            assert s["floor_ms"] is None and s["distance_to_floor"] is None
            continue
        want = floor.ms("tick" if stage in ("tick", "wall") else stage)
        assert s["floor_ms"] == want and s["distance_to_floor"] == pytest.approx(slope / want)
    one = etr.per_session_costs(rows[:1], None)["stages"]["tick"]   # one count: no line, no floor
    assert one["slope_ms"] is None and one["floor_ms"] is None and one["distance_to_floor"] is None
    md = etr.per_session_markdown({"per_session": out})
    assert "## Per-stage cost per extra session" in md
    assert "| stage | ms per extra session (± SE) | profiled ticks: span / kernels | fixed ms per tick | sessions fitted " \
           "| floor ms per session | distance to floor |" in md
    code2wav = next(line for line in md.splitlines() if line.startswith("| code2wav |"))
    assert f"{8.0 / floor.ms('code2wav'):.1f}x" in code2wav and "16,32,48,58" in code2wav


def test_the_profiled_slopes_come_from_the_profiles_at_every_count():
    """--profile-ticks: the slopes of a stage's device span and kernel ms over the profiled ticks
    (the tick's: its wall and all its kernels) beside the recorded ticks' slope."""
    per = {"encoder": 1.5, "vision": 0.5, "thinker": 4.0, "talker": 2.0, "code2wav": 8.0, "tick": 15.5, "wall": 16.0}
    rows = [_run(n, per, 40.0) for n in (8, 32)]
    for r in rows:   # the Thinker's span grows 3 ms per session, its kernels 2.5; the tick's wall 9, kernels 6
        r.profile = {"device_ms_per_tick": 100.0 + 6.0 * r.sessions, "wall_ms_per_tick": 150.0 + 9.0 * r.sessions,
                     "range_breakdown": [{"name": "duplexcache.stage.thinker", "kernel_ms": 20.0 + 2.5 * r.sessions,
                                          "device_span_ms": 30.0 + 3.0 * r.sessions}]}
    stages = etr.per_session_costs(rows, None)["stages"]
    assert stages["thinker"]["kernel_slope_ms"] == pytest.approx(2.5)
    assert stages["thinker"]["profiled_span_slope_ms"] == pytest.approx(3.0)
    assert stages["tick"]["kernel_slope_ms"] == pytest.approx(6.0)
    assert stages["wall"]["profiled_span_slope_ms"] == pytest.approx(9.0)
    assert stages["code2wav"]["kernel_slope_ms"] is None    # no range for it: no claim
    rows[0].profile = None                                  # one count without a profile: none at all
    assert etr.per_session_costs(rows, None)["stages"]["thinker"]["kernel_slope_ms"] is None
    lines = etr.per_session_markdown({"per_session": {"stages": stages}}).splitlines()
    assert next(x for x in lines if x.startswith("| thinker |")).startswith("| thinker | 4.00 | 3.00 / 2.50 |")
    assert next(x for x in lines if x.startswith("| code2wav |")).startswith("| code2wav | 8.00 | - |")
