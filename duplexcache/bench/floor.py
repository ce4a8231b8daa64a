"""The time floor (``tick_floor``, used by ``bench ticks``): per stage, the ms one extra session
adds to a tick at best, from the bytes of its own state read and the matmul FLOPs of its own rows
per tick, at a device's peak HBM bandwidth and dense FLOP/s (``DEVICE_PEAKS``). The byte floor
(``SessionFloor``, ``session_floor``) lives with the memory plan in ``runtime/memory/floor.py``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from duplexcache.runtime.memory.floor import dtype_bytes


# --------------------------------------------------------------------------------------------
# The time floor: what one extra session costs a tick at best, from shapes and device peaks
# --------------------------------------------------------------------------------------------
#
# Per stage, one session's share of one tick (a 1 s unit) is what the device must do for it and
# for no other session: read its own state (Thinker window KV, Talker turn KV, Code2Wav caches,
# encoder cache) and push its own rows through the shared weights. The weights themselves are
# read once per step whatever the batch, so they belong to the fixed per-tick cost (the
# intercept of the measured line), not to the slope. Time = max(own bytes / HBM bandwidth,
# attention FLOPs / peak) for the attention (memory bound; its FLOPs only matter if the reads do
# not) + matmul FLOPs / the dense peak of the dtype they run in (the GEMMs, compute bound at a
# full batch, are other kernels than the attention, so the two add). Element-wise work, launches
# and host time are left out: the floor is what no implementation of these shapes can beat.

STAGE_FLOOR_NAMES = ("encoder", "thinker", "talker", "code2wav")
TEXT_TOKENS_PER_UNIT = 3   # the every_k_units and reply policies' text per speaking unit (runtime/policy.py)
UNIT_MARKER_ROWS = 2       # </unit> <unit> ride in a unit's Thinker append beside its audio embeddings


@dataclass(frozen=True)
class DevicePeak:
    """A device's peak HBM bandwidth and dense matmul throughput per compute dtype (datasheet
    figures, no sparsity)."""

    name: str
    hbm_gb_s: float
    tflops: dict[str, float]   # dtype name ("bfloat16", "float32") -> dense TFLOP/s

    def flops_per_s(self, dtype: str) -> float:
        if dtype not in self.tflops:
            raise ValueError(f"no {dtype} peak for {self.name} (known: {', '.join(self.tflops)})")
        return self.tflops[dtype] * 1e12

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "hbm_gb_s": self.hbm_gb_s, "tflops": dict(self.tflops)}


# NVIDIA datasheets (dense, no sparsity). float32 is the CUDA-core rate: the engine turns TF32
# off (runtime/memory/device_setup.py), so float32 GEMMs and convolutions run there.
DEVICE_PEAKS: dict[str, DevicePeak] = {
    "h100-sxm": DevicePeak("H100 SXM", 3350.0, {"bfloat16": 989.4, "float16": 989.4, "float32": 66.9}),
    "h100-pcie": DevicePeak("H100 PCIe", 2000.0, {"bfloat16": 756.0, "float16": 756.0, "float32": 51.2}),
    "h100-nvl": DevicePeak("H100 NVL", 3900.0, {"bfloat16": 835.0, "float16": 835.0, "float32": 60.0}),
    "h200": DevicePeak("H200", 4800.0, {"bfloat16": 989.4, "float16": 989.4, "float32": 66.9}),
}
FLOOR_DEVICES = ("auto", "none", *DEVICE_PEAKS)


def peak_for_device_name(name: str) -> DevicePeak | None:
    """The table's entry for a ``torch.cuda.get_device_name`` string (None: not in the table)."""
    n = name.upper()
    if "H200" in n:
        return DEVICE_PEAKS["h200"]
    if "H100" in n:
        if "PCIE" in n:
            return DEVICE_PEAKS["h100-pcie"]
        if "NVL" in n:
            return DEVICE_PEAKS["h100-nvl"]
        return DEVICE_PEAKS["h100-sxm"]   # "NVIDIA H100 80GB HBM3": the SXM part
    return None


def resolve_floor_device(choice: str, device: torch.device) -> DevicePeak | None:
    """``--floor-device``: a table key, ``none``, or ``auto`` (the CUDA device's name; None on CPU
    or on a GPU the table does not know, so no time floor is claimed for it)."""
    if choice not in FLOOR_DEVICES:
        raise ValueError(f"--floor-device must be one of {', '.join(FLOOR_DEVICES)}, got {choice!r}")
    if choice == "none":
        return None
    if choice != "auto":
        return DEVICE_PEAKS[choice]
    if device.type != "cuda":
        return None
    return peak_for_device_name(torch.cuda.get_device_name(device))


@dataclass(frozen=True)
class StageWork:
    """One session's share of one tick of one stage, averaged over its speaking and listening
    units: bytes of its own state read, attention FLOPs (in ``attention_dtype``) and matmul FLOPs
    per compute dtype."""

    own_bytes: float
    attention_flops: float
    attention_dtype: str
    matmul_flops: dict[str, float]

    def scaled(self, factor: float) -> "StageWork":
        return StageWork(self.own_bytes * factor, self.attention_flops * factor, self.attention_dtype,
                         {d: f * factor for d, f in self.matmul_flops.items()})

    def plus(self, other: "StageWork") -> "StageWork":
        if self.attention_dtype != other.attention_dtype:
            raise ValueError(f"attention in {self.attention_dtype} and {other.attention_dtype}")
        flops = dict(self.matmul_flops)
        for d, f in other.matmul_flops.items():
            flops[d] = flops.get(d, 0.0) + f
        return StageWork(self.own_bytes + other.own_bytes, self.attention_flops + other.attention_flops,
                         self.attention_dtype, flops)

    def seconds(self, peak: DevicePeak) -> float:
        attention = max(self.own_bytes / (peak.hbm_gb_s * 1e9),
                        self.attention_flops / peak.flops_per_s(self.attention_dtype))
        return attention + sum(f / peak.flops_per_s(d) for d, f in self.matmul_flops.items())

    def to_json(self) -> dict[str, Any]:
        return {"own_bytes": round(self.own_bytes), "attention_flops": round(self.attention_flops),
                "attention_dtype": self.attention_dtype,
                "matmul_flops": {d: round(f) for d, f in self.matmul_flops.items()}}


def _dtype_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def _linear(rows: float, fan_in: int, fan_out: int) -> float:
    return 2.0 * rows * fan_in * fan_out


def decoder_layer_flops(hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int, rows: float) -> float:
    """Matmul FLOPs of ``rows`` rows through one GQA + SwiGLU decoder layer (q, k, v, o, gate, up, down)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return _linear(rows, hidden, q) + 2 * _linear(rows, hidden, kv) + _linear(rows, q, hidden) \
        + 3 * _linear(rows, hidden, ffn)


def attention_flops(layers: int, heads: int, head_dim: int, query_key_pairs: float) -> float:
    """QK^T and PV over ``query_key_pairs`` (sum over rows of the keys each row attends to)."""
    return 4.0 * layers * heads * head_dim * query_key_pairs


@dataclass(frozen=True)
class TickShape:
    """What an average session does in one tick, and the lengths its steps attend over.

    ``speaking_fraction``: the share of session-units that speak (the workload's, over the
    recorded ticks); ``thinker_window_tokens``: Thinker KV tokens after the anchor (the shared
    anchor prefix could be read once for all sessions, so it is not counted);
    ``talker_turn_tokens``: the mean Talker KV length a speaking step attends over;
    ``prompt_frames``: the voice prompt P (Code2Wav's private cache frames);
    ``encoder_cache_frames``: the mean streaming-encoder cache a chunk attends over."""

    speaking_fraction: float
    thinker_window_tokens: float
    talker_turn_tokens: float
    prompt_frames: int
    encoder_cache_frames: float
    text_tokens: int = TEXT_TOKENS_PER_UNIT

    def __post_init__(self) -> None:
        if not 0.0 <= self.speaking_fraction <= 1.0:
            raise ValueError(f"speaking_fraction must be in [0, 1], got {self.speaking_fraction}")
        for name in ("thinker_window_tokens", "talker_turn_tokens", "encoder_cache_frames"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.prompt_frames < 1 or self.text_tokens < 0:
            raise ValueError(f"prompt_frames must be >= 1 and text_tokens >= 0, got {self.prompt_frames}, "
                             f"{self.text_tokens}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def thinker_tick_work(config, encoder_config, shape: TickShape, dtype: torch.dtype | str,
                      kv_storage_dtype: torch.dtype | None = None) -> StageWork:
    """One session's Thinker share of a tick. A unit appends ``</unit> <unit>`` + its audio
    embeddings (one step), then decodes: a listening unit feeds ``<|listen|>`` (one step); a
    speaking unit feeds ``<|speak|>``, its text tokens and an end token (text + 2 steps). Every
    step reads the session's window KV once; the LM head runs on the rows whose logits pick a token."""
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    append = UNIT_MARKER_ROWS + encoder_config.chunk_frames(encoder_config.chunk_samples) // encoder_config.pool_step
    w = shape.thinker_window_tokens
    kv_token = config.kv_bytes_per_token(torch_dtype, kv_storage_dtype)
    c = config

    def unit(decode_steps: int, logit_rows: int) -> StageWork:
        rows = append + decode_steps
        linear = c.num_hidden_layers * decoder_layer_flops(c.hidden_size, c.num_attention_heads,
                                                           c.num_key_value_heads, c.head_dim,
                                                           c.intermediate_size, rows)
        return StageWork((1 + decode_steps) * w * kv_token,
                         attention_flops(c.num_hidden_layers, c.num_attention_heads, c.head_dim, rows * w),
                         _dtype_name(dtype),
                         {_dtype_name(dtype): linear + _linear(logit_rows, c.hidden_size, c.vocab_size)})

    listen = unit(1, 1)                                             # <|listen|>; the decision's logits
    speak = unit(shape.text_tokens + 2, shape.text_tokens + 2)      # speak, text, end; logits until the end
    f = shape.speaking_fraction
    return speak.scaled(f).plus(listen.scaled(1.0 - f))


def talker_unit_tokens(talker_config, text_tokens: int = TEXT_TOKENS_PER_UNIT) -> int:
    """Talker KV tokens one speaking unit adds: its condition rows (text + end), the codes and the end code."""
    return text_tokens + 1 + talker_config.tokens_per_unit + 1


def talker_tick_work(config, shape: TickShape, dtype: torch.dtype | str,
                     kv_storage_dtype: torch.dtype | None = None) -> StageWork:
    """One session's Talker share of a tick (speaking units only): the condition step (text +
    end rows, their Thinker hidden rows through the projector), ``tokens_per_unit - 1`` one-code
    steps and the closing step (last code + end code), each reading the turn's KV once; the code
    head on the ``tokens_per_unit`` rows that pick a code."""
    from duplexcache.kv.paged_attention import bytes_per_block

    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    c = config
    cond = shape.text_tokens + 1
    rows = cond + c.tokens_per_unit + 1
    steps = 1 + (c.tokens_per_unit - 1) + 1
    kv_token = bytes_per_block(c.num_hidden_layers, 1, c.num_key_value_heads, c.head_dim, torch_dtype, kv_storage_dtype)
    linear = (c.num_hidden_layers * decoder_layer_flops(c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                                                        c.head_dim, c.intermediate_size, rows)
              + _linear(cond, c.llm_dim, c.hidden_size) + _linear(cond, c.hidden_size, c.hidden_size)
              + _linear(c.tokens_per_unit, c.hidden_size, c.num_audio_tokens))
    t = shape.talker_turn_tokens
    speak = StageWork(steps * t * kv_token, attention_flops(c.num_hidden_layers, c.num_attention_heads, c.head_dim,
                                                            rows * t),
                      _dtype_name(dtype), {_dtype_name(dtype): linear})
    return speak.scaled(shape.speaking_fraction)


def encoder_chunk_flops(config, cache_frames: float, samples: int | None = None) -> tuple[float, float]:
    """(matmul, attention) FLOPs of one streaming chunk (``AudioEncoderConfig``): the mel
    filterbank and the conv front end over its mel frames, the layers over its encoder frames
    (attending to the cache and the chunk), the projection (Linear d->out, ReLU, Linear out->out)
    over every frame before the pool."""
    c = config
    samples = c.chunk_samples if samples is None else samples
    mel = samples // c.hop_length
    frames = c.chunk_frames(samples)
    d = c.d_model
    matmul = (2.0 * (c.n_fft // 2 + 1) * c.num_mel_bins * mel     # the mel filterbank
              + 2.0 * c.num_mel_bins * d * 3 * mel + 2.0 * d * d * 3 * frames
              + c.encoder_layers * (4 * _linear(frames, d, d) + _linear(frames, d, c.encoder_ffn_dim)
                                    + _linear(frames, c.encoder_ffn_dim, d))
              + _linear(frames, d, c.out_dim) + _linear(frames, c.out_dim, c.out_dim))
    return matmul, attention_flops(c.encoder_layers, c.encoder_attention_heads, c.head_dim,
                                   frames * (cache_frames + frames))


def encoder_cache_frames_at(unit_index: int, config) -> int:
    """Frames in a session's streaming-encoder cache when its unit ``unit_index`` (0-based) is
    encoded: every earlier chunk since the last reset (a chunk that would pass
    ``max_cache_frames`` empties the cache first; models/audio_encoder.py)."""
    cached = 0
    for k in range(unit_index + 1):
        frames = config.chunk_frames(config.first_chunk_samples if k == 0 else config.chunk_samples)
        if cached + frames > config.max_cache_frames:
            cached = 0
        if k == unit_index:
            return cached
        cached += frames
    return cached


def encoder_tick_work(config, shape: TickShape, dtype: torch.dtype | str,
                      storage_dtype: torch.dtype | None = None) -> StageWork:
    """One session's encoder share of a tick: every unit, speaking or not."""
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    matmul, attention = encoder_chunk_flops(config, shape.encoder_cache_frames)
    own = config.kv_bytes_per_session(torch_dtype, storage_dtype) * shape.encoder_cache_frames / config.max_cache_frames
    return StageWork(own, attention, _dtype_name(dtype), {_dtype_name(dtype): matmul})


def _conformer_layer_flops(d: int, heads: int, ffn: int, rows: int, cache: int) -> tuple[float, float]:
    """(matmul, attention) FLOPs of a relative-position conformer layer: q, k, v, out and the
    position projection (over 2 * keys - 1 offsets), the content and position scores, PV, the
    feed-forward."""
    keys = cache + rows
    offsets = 2 * keys - 1
    matmul = 4 * _linear(rows, d, d) + _linear(offsets, d, d) + _linear(rows, d, ffn) + _linear(rows, ffn, d)
    attention = 2.0 * rows * d * keys + 2.0 * rows * d * offsets + 2.0 * rows * d * keys
    return matmul, attention


def flow_chunk_flops(flow_config, tokens: int, token_cache: int, estimator_cache: int) -> tuple[float, float]:
    """(matmul, attention) FLOPs of one non-final flow chunk (``FlowConfig``) of ``tokens`` speech
    tokens (lookahead included): the speaker projection, the token-rate conformer (``token_cache``
    cached tokens), the 2x upsample and the frame-rate conformer (twice the cache), the
    projection to mel, then the Euler solve: ``n_timesteps`` estimator passes over a batch of 2
    (classifier-free guidance) whose blocks attend over ``estimator_cache`` cached frames."""
    f = flow_config
    d, la, up = f.encoder_output_size, f.pre_lookahead_len, f.up_stride
    n = tokens - la
    frames = n * up
    matmul = _linear(1, f.spk_embed_dim, f.output_size) + _linear(tokens, f.input_size, d)
    matmul += 2.0 * d * d * (la + 1) * n + 2.0 * d * d * 3 * n          # pre-lookahead convs
    attention = 0.0
    for _ in range(f.num_blocks):
        m, a = _conformer_layer_flops(d, f.encoder_heads, f.encoder_linear_units, n, token_cache)
        matmul, attention = matmul + m, attention + a
    matmul += 2.0 * d * d * (2 * up + 1) * frames + _linear(frames, f.input_size, d)   # up conv, up_embed
    for _ in range(f.num_up_blocks):
        m, a = _conformer_layer_flops(d, f.encoder_heads, f.encoder_linear_units, frames, token_cache * up)
        matmul, attention = matmul + m, attention + a
    matmul += _linear(frames, d, f.output_size)                          # encoder_proj
    h, inner, mlp = f.dit_hidden_size, f.dit_heads * f.dit_head_dim, int(f.dit_hidden_size * f.dit_mlp_ratio)
    per_pass = (_linear(1, 256, h) + _linear(1, h, h)                    # timestep embedding (one row)
                + _linear(frames, f.dit_in_channels, h)
                + f.dit_depth * (_linear(1, h, 9 * h) + 3 * _linear(frames, h, inner) + _linear(frames, inner, h)
                                 + 2 * 2.0 * h * h * 3 * frames              # the causal conv pair
                                 + _linear(frames, h, mlp) + _linear(frames, mlp, h))
                + _linear(1, h, 2 * h) + _linear(frames, h, f.output_size))
    passes = 2 * f.n_timesteps
    matmul += passes * per_pass
    attention += passes * attention_flops(f.dit_depth, f.dit_heads, f.dit_head_dim, frames * (frames + estimator_cache))
    return matmul, attention


def _conv_out(length: int, kernel: int, stride: int = 1, padding: int = 0, dilation: int = 1) -> int:
    return (length + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def vocoder_flops(voc_config, mel_frames: int) -> float:
    """Matmul/convolution FLOPs of the HiFT vocoder (``VocoderConfig``) over ``mel_frames``: the
    F0 predictor, the harmonic merge, conv_pre, each upsampling stage (transposed conv, the
    source branch's down conv and resblock, the resblocks), conv_post. The STFTs are FFTs, not counted."""
    v = voc_config
    samples = mel_frames * int(np.prod(v.upsample_rates)) * v.hop_len
    c_f = v.f0_cond_channels
    flops = 2.0 * v.in_channels * c_f * 3 * mel_frames + 4 * 2.0 * c_f * c_f * 3 * mel_frames   # F0 predictor convs
    flops += _linear(mel_frames, c_f, 1)
    flops += _linear(samples, v.nb_harmonics + 1, 1)
    flops += 2.0 * v.in_channels * v.base_channels * 7 * mel_frames
    stft_frames = samples // v.hop_len + 1
    down_rates = [1] + list(v.upsample_rates[::-1][:-1])
    cum = [int(x) for x in np.cumprod(down_rates)[::-1]]
    length = mel_frames
    n = len(v.upsample_rates)

    def resblock(ch: int, kernel: int, dilations: tuple[int, ...], length: int) -> float:
        return sum(2 * 2.0 * ch * ch * kernel * length for _ in dilations)

    for i, (u, k) in enumerate(zip(v.upsample_rates, v.upsample_kernel_sizes)):
        c_in, c_out = v.base_channels // 2**i, v.base_channels // 2 ** (i + 1)
        flops += 2.0 * c_in * c_out * k * length                        # ConvTranspose1d: per input position
        length = (length - 1) * u - 2 * ((k - u) // 2) + k
        if i == n - 1:
            length += 1                                                  # the reflection pad
        d = cum[i]
        down_len = stft_frames if d == 1 else _conv_out(stft_frames, d * 2, d, d // 2)
        flops += 2.0 * (v.n_fft + 2) * c_out * (1 if d == 1 else 2 * d) * down_len
        flops += resblock(c_out, v.source_resblock_kernel_sizes[i], v.source_resblock_dilation_sizes[i], length)
        for kk, dd in zip(v.resblock_kernel_sizes, v.resblock_dilation_sizes):
            flops += resblock(c_out, kk, dd, length)
    flops += 2.0 * (v.base_channels // 2**n) * (v.n_fft + 2) * 7 * length
    return flops


def code2wav_shape_of(flow_config):
    """The ``Code2WavShape`` (cache bytes per frame) of a ``FlowConfig``, without building the flow."""
    from duplexcache.cfm.config import Code2WavShape

    f = flow_config
    return Code2WavShape(n_timesteps=f.n_timesteps, depth=f.dit_depth, num_heads=f.dit_heads, head_dim=f.dit_head_dim,
                         hidden_size=f.dit_hidden_size, mel_bins=f.output_size,
                         conformer_blocks=f.num_blocks + f.num_up_blocks, conformer_heads=f.encoder_heads,
                         conformer_size=f.encoder_output_size)


def code2wav_tick_work(flow_config, voc_config, shape: TickShape, code2wav_dtype: torch.dtype | str,
                       chunk_config=None) -> StageWork:
    """One session's Code2Wav share of a tick (speaking units only): one non-final chunk (the 3
    carried codes + the unit's 25) through the flow in ``code2wav_dtype`` at the steady cache
    (P own frames + the shared prompt tail), then the vocoder (always float32) over the chunk's
    frames plus its mel cache. Own bytes: the session's P frames of the estimator and conformer
    attention caches. A turn's final chunk (3 codes) is left out."""
    from duplexcache.cfm.config import Code2WavConfig

    cc = chunk_config or Code2WavConfig()
    p = shape.prompt_frames
    cache = p + cc.cache_tail_frames
    flow_mm, flow_att = flow_chunk_flops(flow_config, cc.max_chunk_tokens, cache // 2, cache)
    frames = (cc.max_chunk_tokens - cc.pre_lookahead_len) * cc.up_rate
    voc = vocoder_flops(voc_config, frames + cc.mel_cache_len)
    name = _dtype_name(code2wav_dtype)
    element = dtype_bytes(code2wav_dtype)
    frame = code2wav_shape_of(flow_config)
    own = p * (frame.att_frame_bytes(element) + frame.conformer_frame_bytes(element))
    flops = {name: flow_mm}
    flops["float32"] = flops.get("float32", 0.0) + voc
    return StageWork(own, flow_att, name, flops).scaled(shape.speaking_fraction)


@dataclass(frozen=True)
class TickFloor:
    """Per stage, one extra session's share of a tick (``StageWork``), and its time on ``peak``."""

    work: dict[str, StageWork]
    shape: TickShape
    peak: DevicePeak | None

    def ms(self, stage: str) -> float | None:
        """ms per extra session per tick of ``stage`` (``tick``: the four stages' sum); None
        without device peaks."""
        if self.peak is None:
            return None
        if stage == "tick":
            return sum(1e3 * w.seconds(self.peak) for w in self.work.values())
        return 1e3 * self.work[stage].seconds(self.peak)

    def to_json(self) -> dict[str, Any]:
        stages = {s: {**w.to_json(), "ms": self.ms(s)} for s, w in self.work.items()}
        return {"device": None if self.peak is None else self.peak.to_json(), "shape": self.shape.to_json(),
                "stages": stages, "tick_ms": self.ms("tick")}


def tick_floor(thinker_config, talker_config, encoder_config, flow_config, voc_config, shape: TickShape,
               dtype: torch.dtype | str, code2wav_dtype: torch.dtype | str = torch.float32,
               kv_storage_dtype: torch.dtype | None = None, encoder_storage_dtype: torch.dtype | None = None,
               peak: DevicePeak | None = None) -> TickFloor:
    """The four stages' floors for one extra session. ``dtype``: the Thinker's, Talker's and
    encoder's compute dtype; ``code2wav_dtype``: the flow's (``precision.code2wav_dtype``; the
    vocoder stays float32); ``kv_storage_dtype``: the Thinker and Talker KV pools'
    (``precision.kv_cache_dtype``); ``encoder_storage_dtype``: the encoder cache's."""
    work = {
        "encoder": encoder_tick_work(encoder_config, shape, dtype, encoder_storage_dtype),
        "thinker": thinker_tick_work(thinker_config, encoder_config, shape, dtype, kv_storage_dtype),
        "talker": talker_tick_work(talker_config, shape, dtype, kv_storage_dtype),
        "code2wav": code2wav_tick_work(flow_config, voc_config, shape, code2wav_dtype),
    }
    return TickFloor(work, shape, peak)
