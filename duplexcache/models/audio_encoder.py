"""Audio encoder: log-mel front end, Whisper-medium-shaped encoder, MiniCPM-o projection + pooling.

Pipeline (preset ``minicpmo45``)::

    16 kHz PCM --log-mel (80 bins, n_fft 400, hop 160)--> (80, M)       100 mel frames / s
      --conv1 (k3, s1) + GELU, conv2 (k3, s2) + GELU--> (F, 1024)        F = (M - 1) // 2 + 1, 50 / s
      --+ embed_positions[pos]--> 24 pre-LN layers --> layer_norm
      --audio_projection_layer: Linear 1024->4096, ReLU, Linear 4096->4096
      --AvgPool1d(5) over time--> (F // 5, 4096)                         10 embeddings / s

Module and parameter names follow transformers' ``WhisperEncoder`` under ``apm.`` and MiniCPM-o's
``audio_projection_layer.linear1/linear2``, so both a Whisper checkpoint (encoder part) and a
MiniCPM-o checkpoint load with ``strict=True``.

Whole-clip mode (``encode_mel`` / ``embed_audio``): every frame attends to every frame of the clip,
positions run 0..F-1, exactly as ``WhisperEncoder`` (which additionally insists on F = 1500).
Clips longer than ``max_source_positions`` frames are cut into independent 30 s segments.

Streaming mode (``stream_step`` / ``stream_step_mel``), the exact semantics:

* A session feeds one chunk per tick: the first chunk is ``first_chunk_samples`` (16560 = 1.035 s,
  giving 103 mel frames -> 52 encoder frames), every later chunk ``chunk_samples`` (16000 = 1 s,
  100 mel frames -> 50 encoder frames). Each chunk's log-mel is computed on that chunk alone (its
  own reflect padding and its own ``max - 8`` clamp) and the conv front end runs on that chunk
  alone (zero padding at the chunk edges). Nothing of the audio or the mel is carried over.
* What is cached: for every layer, the K and V of every encoder frame seen since the last reset,
  in a per-session buffer ``(layers, capacity, heads, head_dim)`` (frames before heads, so a
  session's valid rows of a layer are one contiguous block: see ``TickKV``). The capacity starts at 0 and
  grows by ``CACHE_GROWTH_FRAMES`` up to ``max_cache_frames`` as audio arrives (a grow copies the
  valid rows into a larger buffer); it is kept across resets. Only rows ``[0, n + F)`` are ever
  read, so the capacity never changes an output.
* Attention: a frame of chunk c attends to all cached frames (chunks before c, since the last
  reset) and to all frames of chunk c (bidirectional inside the chunk). It never sees the future.
* Positions: the frames of a chunk get positions ``n .. n + F - 1`` where ``n`` is the number of
  frames cached before the chunk, i.e. positions keep running across chunks.
* Reset: if ``n + F > max_cache_frames`` (1500 = 30 s), the cache is emptied *before* the chunk;
  the chunk then starts at position 0 and attends only to itself. So no position ever reaches
  ``max_source_positions`` and no chunk is ever split by a reset.
* Output: the chunk's frames, after the final layer_norm and the projection, are pooled with
  ``AvgPool1d(pool_step)`` over this chunk only (a trailing remainder of F % 5 frames is dropped,
  as ``nn.AvgPool1d`` does): 52 -> 10 and 50 -> 10 embeddings.

The equivalent dense computation (what the tests build independently): concatenate the conv
outputs of all chunks between two resets, add the positions above, and run the layers with a
block-causal mask in which frame i may attend frame j iff chunk(j) <= chunk(i).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from duplexcache.kv.kv_quant import as_bytes, dequantize_fp8, is_quantized, quantize_fp8, row_bytes
from duplexcache.models.layers import MultiModalProjector

if TYPE_CHECKING:
    from duplexcache.models.audio_encoder_graphs import EncoderGraphs

logger = logging.getLogger(__name__)

SAMPLE_RATE = 16000

# The streaming K/V cache grows by this many encoder frames (50 / s): 2.5 s, 11.7 MiB per session
# on the minicpmo45 shapes in bf16. A session has encoded two chunks (52 + 50 = 102 frames) when
# it produces its first audio, so its setup holds one step instead of the whole 30 s (140.6 MiB);
# 125 divides 1500, so 12 grows (each copying at most 129 MiB, one every 2.5 s during the first
# 30 s only: the capacity is kept across resets) fill the cache.
CACHE_GROWTH_FRAMES = 125


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class AudioEncoderConfig:
    num_mel_bins: int = 80
    d_model: int = 1024
    encoder_layers: int = 24
    encoder_attention_heads: int = 16
    encoder_ffn_dim: int = 4096
    max_source_positions: int = 1500  # rows of embed_positions (30 s at 50 frames/s)
    layer_norm_eps: float = 1e-5
    out_dim: int = 4096  # Thinker hidden size
    pool_step: int = 5  # 50 frames/s -> 10 embeddings/s
    max_cache_frames: int = 1500  # streaming reset threshold (frames)
    sample_rate: int = SAMPLE_RATE
    n_fft: int = 400
    hop_length: int = 160
    chunk_samples: int = 16000  # 1 s
    first_chunk_samples: int = 16560  # 1.035 s

    def __post_init__(self) -> None:
        if self.d_model % self.encoder_attention_heads:
            raise ValueError(f"d_model {self.d_model} not divisible by heads {self.encoder_attention_heads}")
        if self.d_model % 2:
            raise ValueError("d_model must be even for sinusoidal positions")
        if not 0 < self.max_cache_frames <= self.max_source_positions:
            raise ValueError(
                f"max_cache_frames ({self.max_cache_frames}) must be in 1..max_source_positions "
                f"({self.max_source_positions}): positions past the table do not exist"
            )
        if self.pool_step < 1 or self.n_fft < 2 or self.hop_length < 1:
            raise ValueError("pool_step, n_fft and hop_length must be positive")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads

    def chunk_frames(self, samples: int) -> int:
        """Encoder frames of a streaming chunk of ``samples``: the log-mel keeps samples // hop
        frames and the stride-2 conv halves them, rounding up (16000 -> 50, 16560 -> 52)."""
        return (samples // self.hop_length - 1) // 2 + 1

    @classmethod
    def tiny(cls, **overrides) -> "AudioEncoderConfig":
        fields = dict(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
                      max_source_positions=160, out_dim=96, max_cache_frames=128)
        fields.update(overrides)
        if "max_cache_frames" not in overrides:  # follow a smaller position table
            fields["max_cache_frames"] = min(128, fields["max_source_positions"])
        return cls(**fields)

    @classmethod
    def minicpmo45(cls) -> "AudioEncoderConfig":
        return cls()

    def kv_bytes_per_session(self, dtype: torch.dtype, storage_dtype: torch.dtype | None = None) -> int:
        """Bytes of one session's streaming K+V cache at its full ``max_cache_frames``: the most it
        grows to (it starts empty and grows by ``CACHE_GROWTH_FRAMES``), so admission reserves this.
        ``storage_dtype`` fp8 (``precision.encoder_cache_dtype``): 1 byte per value plus a float32
        scale per (frame, head), for K and V."""
        rows = 2 * self.encoder_layers * self.max_cache_frames * self.encoder_attention_heads
        return rows * row_bytes(self.head_dim, dtype, storage_dtype)

    @classmethod
    def from_dir(cls, path: str | Path) -> "AudioEncoderConfig":
        """Read a Whisper ``config.json`` or a MiniCPM-o one (``audio_config`` + ``hidden_size``)."""
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        raw = json.loads(cfg_path.read_text())
        audio = raw.get("audio_config", raw)
        out_dim = raw["hidden_size"] if "audio_config" in raw else audio.get("d_model", 1024) * 4
        fields = dict(
            num_mel_bins=audio.get("num_mel_bins", 80),
            d_model=audio["d_model"],
            encoder_layers=audio["encoder_layers"],
            encoder_attention_heads=audio["encoder_attention_heads"],
            encoder_ffn_dim=audio["encoder_ffn_dim"],
            max_source_positions=audio.get("max_source_positions", 1500),
            out_dim=raw.get("audio_out_dim", out_dim),
            pool_step=raw.get("audio_pool_step", 5),
        )
        fields["max_cache_frames"] = min(1500, fields["max_source_positions"])
        return cls(**fields)


# ----------------------------------------------------------------------------- log-mel


def _hz_to_mel_slaney(hz: torch.Tensor) -> torch.Tensor:
    # Slaney scale: linear below 1 kHz, logarithmic above (as librosa / Whisper).
    f_sp = 200.0 / 3
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, math.log(6.4) / 27.0
    mel = hz / f_sp
    log_part = min_log_mel + torch.log(torch.clamp(hz, min=min_log_hz) / min_log_hz) / logstep
    return torch.where(hz >= min_log_hz, log_part, mel)


def _mel_to_hz_slaney(mel: torch.Tensor) -> torch.Tensor:
    f_sp = 200.0 / 3
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, math.log(6.4) / 27.0
    hz = mel * f_sp
    log_part = min_log_hz * torch.exp(logstep * (mel - min_log_mel))
    return torch.where(mel >= min_log_mel, log_part, hz)


def mel_filter_bank(n_fft: int = 400, n_mels: int = 80, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """Slaney-normalised triangular filters, (n_fft // 2 + 1, n_mels), float32, 0..8 kHz."""
    n_freqs = n_fft // 2 + 1
    # Built on the CPU in float64 even under a meta/cuda default device: it is a constant table.
    f64 = dict(dtype=torch.float64, device="cpu")
    fft_freqs = torch.linspace(0, sample_rate // 2, n_freqs, **f64)
    mel_lo, mel_hi = _hz_to_mel_slaney(torch.tensor([0.0, 8000.0], **f64)).tolist()
    mel_pts = torch.linspace(mel_lo, mel_hi, n_mels + 2, **f64)
    edges = _mel_to_hz_slaney(mel_pts)  # (n_mels + 2,)
    widths = edges[1:] - edges[:-1]
    slopes = edges[None, :] - fft_freqs[:, None]  # (n_freqs, n_mels + 2)
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    filters = torch.clamp(torch.minimum(down, up), min=0.0)
    filters = filters * (2.0 / (edges[2:] - edges[:-2]))[None, :]  # slaney area normalisation
    return filters.to(torch.float32)


class LogMel(nn.Module):
    """Whisper's log-mel spectrogram in torch: (N,) float waveform -> (n_mels, N // hop)."""

    def __init__(self, n_fft: int = 400, hop_length: int = 160, n_mels: int = 80,
                 sample_rate: int = SAMPLE_RATE) -> None:
        super().__init__()
        self.n_fft, self.hop_length = n_fft, hop_length
        self.register_buffer("window", torch.hann_window(n_fft, device="cpu"), persistent=False)
        self.register_buffer("filters", mel_filter_bank(n_fft, n_mels, sample_rate), persistent=False)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        """(..., N) -> (..., n_mels, N // hop): leading dims are independent clips (a batch of
        same-length chunks in one call), each normalised by its own maximum."""
        audio = audio.to(torch.float32)
        window = self.window.to(audio.device, torch.float32, non_blocking=True)   # no wait on the queue
        stft = torch.stft(audio, self.n_fft, self.hop_length, window=window,
                          center=True, pad_mode="reflect", return_complex=True)
        power = stft[..., :-1].abs() ** 2  # Whisper drops the last frame: N // hop frames
        mel = self.filters.to(audio.device, torch.float32, non_blocking=True).T @ power
        log_spec = torch.clamp(mel, min=1e-10).log10()
        log_spec = torch.maximum(log_spec, log_spec.amax(dim=(-2, -1), keepdim=True) - 8.0)
        return (log_spec + 4.0) / 4.0


def validate_audio(audio, sample_rate: int, *, expected_rate: int = SAMPLE_RATE,
                   min_samples: int = 400) -> torch.Tensor:
    """Check a mono float PCM clip and return it as a 1-D float32 tensor, or raise ValueError."""
    if sample_rate != expected_rate:
        raise ValueError(f"audio sample rate must be {expected_rate} Hz, got {sample_rate} Hz (resample first)")
    if not isinstance(audio, torch.Tensor):
        try:
            audio = torch.as_tensor(audio)
        except Exception as exc:  # lists of strings, objects, ...
            raise ValueError(f"audio must be a float array, got {type(audio).__name__}") from exc
    if not audio.is_floating_point():
        raise ValueError(
            f"audio must be float PCM in [-1, 1], got dtype {audio.dtype} (int16 PCM: divide by 32768)")
    if audio.dim() == 2 and audio.shape[0] == 1:
        audio = audio[0]
    if audio.dim() != 1:
        raise ValueError(f"audio must be mono 1-D (samples,), got shape {tuple(audio.shape)}")
    if audio.numel() == 0:
        raise ValueError("audio is empty")
    if audio.numel() < min_samples:
        raise ValueError(f"audio too short: {audio.numel()} samples, need at least {min_samples}")
    if not torch.isfinite(audio).all():
        raise ValueError("audio contains NaN or Inf")
    peak = audio.abs().max().item()
    if peak > 1.0:
        raise ValueError(f"audio must be float PCM in [-1, 1], peak is {peak:.3g} (int16 PCM: divide by 32768)")
    return audio.to(torch.float32)


# ----------------------------------------------------------------------------- encoder


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's fixed positional table: [sin | cos] halves, (length, channels)."""
    inc = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-inc * torch.arange(channels // 2, dtype=torch.float32))
    t = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([t.sin(), t.cos()], dim=1)


class WhisperAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.scaling = self.head_dim ** -0.5
        self.k_proj = nn.Linear(d_model, d_model, bias=False)  # Whisper's k has no bias
        self.v_proj = nn.Linear(d_model, d_model)
        self.q_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)

    def forward(self, x: torch.Tensor, kv_hook=None) -> torch.Tensor:
        q, k, v = self.project(x)
        mask = None
        if kv_hook is not None:  # streaming: store this chunk's K/V, attend over cache + chunk
            k, v, mask = kv_hook(k, v)
        return self.attend(q, k, v, mask)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, d) -> q, k, v (B, H, T, D)."""
        # q is scaled before the product, as Whisper does, so SDPA runs with scale 1.
        q = self._heads(self.q_proj(x) * self.scaling)
        return q, self._heads(self.k_proj(x)), self._heads(self.v_proj(x))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q (B, H, T, D) over keys/values (B, H, K, D), ``mask`` (B, 1, 1, K) or None -> (B, T, d)."""
        if q.is_cuda:
            # Not cuDNN's attention: it plans per shape, and the streaming key length grows every
            # tick; on an H200 that cost ~2 ms of CPU per layer per tick (46 ms of a 400 ms tick).
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        b, _, t, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1))


class WhisperEncoderLayer(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        self.self_attn = WhisperAttention(cfg.d_model, cfg.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, kv_hook=None) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), kv_hook)
        return self.feed_forward(x)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer up to its attention's keys: q, k, v of ``x`` (piecewise graphs run the
        store and gather of a streaming cache between ``project`` and ``finish``)."""
        return self.self_attn.project(self.self_attn_layer_norm(x))

    def finish(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """The layer from its attention on: ``forward`` is ``finish(x, *project(x) [through the hook])``."""
        return self.feed_forward(x + self.self_attn.attend(q, k, v, mask))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    """Parameter names as transformers' WhisperEncoder (conv1, conv2, embed_positions, layers, layer_norm)."""

    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, cfg.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(cfg.d_model, cfg.d_model, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, cfg.d_model)
        self.embed_positions.requires_grad_(False)
        with torch.no_grad():
            self.embed_positions.weight.copy_(sinusoids(cfg.max_source_positions, cfg.d_model))
        self.layers = nn.ModuleList(WhisperEncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.layer_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)

    def conv_front(self, mel: torch.Tensor) -> torch.Tensor:
        """(B, n_mels, M) -> (B, F, d), F = (M - 1) // 2 + 1."""
        x = F.gelu(self.conv1(mel))
        return F.gelu(self.conv2(x)).transpose(1, 2)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """Whole clip, full attention, positions 0..F-1: (B, n_mels, M) -> (B, F, d)."""
        x = self.conv_front(mel)
        if x.shape[1] > self.cfg.max_source_positions:
            raise ValueError(f"{x.shape[1]} frames exceed max_source_positions {self.cfg.max_source_positions}")
        x = x + self.embed_positions.weight[: x.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


# ----------------------------------------------------------------------------- streaming state


@dataclass
class StreamingAudioEncoderState:
    """One session's streaming encoder state. Owned by the session; the encoder only updates it.

    ``k``/``v``: (layers, capacity, heads, head_dim); frames ``[0, num_frames)`` are valid. The
    capacity grows by ``growth_frames`` (``reserve``) and never exceeds ``max_frames``. Frames
    come before heads so that a layer's valid frames, ``k[layer, :n]``, are one contiguous block:
    the batch's stores and gathers are then one multi-tensor copy each (``TickKV``).

    ``precision.encoder_cache_dtype: fp8_e4m3``: ``k``/``v`` hold e4m3 and ``k_scale``/``v_scale``
    (layers, capacity, heads) one float32 scale per frame and head, set when the frame is written
    (kv/kv_quant.py); ``write`` quantizes, ``read`` dequantizes to the layer's dtype.
    """

    k: torch.Tensor
    v: torch.Tensor
    max_frames: int  # the encoder's max_cache_frames: the capacity never grows past it
    growth_frames: int = CACHE_GROWTH_FRAMES
    num_frames: int = 0  # frames cached since the last reset == position of the next frame
    num_chunks: int = 0  # chunks fed since the session started (the first one is longer)
    num_resets: int = 0
    k_scale: torch.Tensor | None = None   # fp8 storage only
    v_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.growth_frames < 1:
            raise ValueError(f"growth_frames must be >= 1, got {self.growth_frames}")
        if self.capacity > self.max_frames:
            raise ValueError(f"capacity {self.capacity} exceeds max_frames {self.max_frames}")
        if is_quantized(self.k.dtype) != (self.k_scale is not None and self.v_scale is not None):
            raise ValueError(f"an encoder cache stored as {self.k.dtype} needs scales exactly when it is fp8")

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def capacity(self) -> int:
        """Frames the buffers hold room for."""
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes allocated now (the capacity, not the worst case), scales included."""
        tensors = [self.k, self.v] + ([self.k_scale, self.v_scale] if self.quantized else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer's K/V rows (heads, n, head_dim) at frames ``[start, start + n)`` (the
        one-session path; a tick stores the batch with ``TickKV``)."""
        k, v = k.transpose(0, 1), v.transpose(0, 1)   # (n, heads, head_dim), the stored order
        if self.quantized:
            (k8, ks), (v8, vs) = quantize_fp8(k), quantize_fp8(v)
            self.write_stored(layer, start, k8, v8, ks, vs)
        else:
            self.write_stored(layer, start, k, v)

    def write_stored(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        """``write`` of rows already in the storage format and order: k/v (n, heads, head_dim),
        fp8 rows with their scales (n, heads)."""
        end = start + k.shape[0]
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v
        if self.quantized:
            self.k_scale[layer, start:end] = k_scale
            self.v_scale[layer, start:end] = v_scale

    def stored(self, layer: int, length: int) -> tuple[torch.Tensor, ...]:
        """Views of one layer's frames ``[0, length)`` as stored, each one contiguous block:
        (k, v) of (length, heads, head_dim), plus (k_scale, v_scale) of (length, heads) when
        quantized."""
        out = (self.k[layer, :length], self.v[layer, :length])
        if self.quantized:
            out += (self.k_scale[layer, :length], self.v_scale[layer, :length])
        return out

    def layer_blocks(self, start: int, end: int) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Frames ``[start, end)`` of every layer as stored: per stored tensor (k, v, then the fp8
        scales), one view per layer, ``blocks[tensor][layer]`` is ``stored(layer, end)[tensor][start:]``.
        Made with one ``unbind`` per tensor, so a tick's per-layer copy lists index tuples
        instead of making views (`AudioEncoder._stream_layers`)."""
        tensors = (self.k, self.v) + ((self.k_scale, self.v_scale) if self.quantized else ())
        return tuple(t[:, start:end].unbind(0) for t in tensors)

    def read(self, layer: int, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K/V of frames ``[0, length)``, each (heads, length, head_dim) in ``dtype``
        (views of the cache when it is not quantized)."""
        k, v = self.k[layer, :length], self.v[layer, :length]
        if self.quantized:
            k = dequantize_fp8(k, self.k_scale[layer, :length], dtype)
            v = dequantize_fp8(v, self.v_scale[layer, :length], dtype)
        return k.transpose(0, 1), v.transpose(0, 1)

    def reserve(self, frames: int) -> None:
        """Make room for rows ``[0, frames)``: grow to the next multiple of ``growth_frames``
        (at most ``max_frames``), copying the valid rows; no-op when they fit already."""
        if frames <= self.capacity:
            return
        if frames > self.max_frames:
            raise ValueError(f"{frames} frames exceed the cache's max_frames {self.max_frames}")
        grown = min(self.max_frames, -(-frames // self.growth_frames) * self.growth_frames)
        logger.debug("audio encoder cache grows %d -> %d frames", self.capacity, grown)
        # K, then V, each old buffer freed as it is replaced: the transient peak is the old cache
        # plus half the new one, for one session at a time (sessions grow one after another).
        self.k = self._copy_into(self.k, grown)
        self.v = self._copy_into(self.v, grown)
        if self.quantized:
            self.k_scale = self._copy_into(self.k_scale, grown)
            self.v_scale = self._copy_into(self.v_scale, grown)

    def _copy_into(self, old: torch.Tensor, frames: int) -> torch.Tensor:
        # empty, not zeros: rows past num_frames are written before they are ever read.
        new = old.new_empty(old.shape[0], frames, *old.shape[2:])
        new[:, : self.num_frames] = old[:, : self.num_frames]
        return new

    def reset(self) -> None:
        # The capacity is kept: a long session holds the full cache at steady state anyway (what
        # admission reserved and the floor counts), so dropping it would only re-pay the grows
        # every 30 s. Stale rows stay but are unreachable: attention reads [0, num_frames).
        self.num_frames = 0
        self.num_resets += 1


def _one_format(states: list[StreamingAudioEncoderState]) -> bool:
    """Whether the batch's caches are fp8 (all of them) or not (none); a mix is refused."""
    formats = {s.quantized for s in states}
    if len(formats) != 1:
        raise ValueError("a batch of encoder states mixes fp8 and unquantized caches")
    return formats.pop()


def _copy_pairs(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every i as one multi-tensor copy: on CUDA a single kernel
    when every pair is dense with equal strides (each pair here is one contiguous block), where
    a loop of ``copy_`` launches one kernel per pair. The fast path wants one dtype per list, so
    the pairs go in one call per dtype (fp8 values, moved as bytes, and their float32 scales: two).
    """
    by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for d, s in zip(dst, src, strict=True):
        if is_quantized(d.dtype):
            d, s = as_bytes(d), as_bytes(s)
        pair = by_dtype.setdefault(d.dtype, ([], []))
        pair[0].append(d)
        pair[1].append(s)
    for dsts, srcs in by_dtype.values():
        torch._foreach_copy_(dsts, srcs)


class TickKV:
    """One tick's traffic between a batch's encoder caches and the layers' attention.

    Each layer stores its new K/V frames into every session's cache and gathers every session's
    valid frames into one zero-padded batch. The views both need (each session's block of each
    layer, via ``layer_blocks``; each session's row of the padded buffer) are made here, once for
    the tick, and the buffer is zeroed once and reused by every layer (rows past a session's
    length are never written, so they stay zero). A layer's store and gather are then a list built
    by tuple indexing and one multi-tensor copy each: the host work per layer no longer grows
    with views per session. Call ``reserve`` on the states first (views must not outlive a grow).
    """

    def __init__(self, states: list[StreamingAudioEncoderState], starts: list[int], lens: list[int],
                 stored: torch.Tensor | None = None, scales: torch.Tensor | None = None) -> None:
        """``stored``/``scales``: gather into these buffers (2, >= B, >= max key length, heads,
        head_dim) / (..., heads) instead of fresh zeroed ones: the encoder graphs' static
        buffers, whose rows past a session's length hold stale frames (their keys are masked)."""
        self.quantized = _one_format(states)
        self.lens = lens
        self.key_lens = [b + n for b, n in zip(starts, lens)]
        # per session, per stored tensor (k, v, then the fp8 scales), per layer
        self.new_blocks = [s.layer_blocks(b, b + n) for s, b, n in zip(states, starts, lens)]
        self.valid_blocks = [s.layer_blocks(0, n) for s, n in zip(states, self.key_lens)]
        k_max = max(self.key_lens)
        first = states[0]
        heads, head_dim = first.k.shape[2], first.k.shape[3]
        if stored is None:
            stored = first.k.new_zeros(2, len(states), k_max, heads, head_dim)
            scales = first.k_scale.new_zeros(2, len(states), k_max, heads) if self.quantized else None
        elif (scales is not None) != self.quantized or stored.shape[1] < len(states) or stored.shape[2] < k_max:
            raise ValueError(f"gather buffer {tuple(stored.shape)} cannot hold {len(states)} sessions of up to "
                             f"{k_max} frames{' with scales' if self.quantized else ''}")
        self.stored, self.scales = stored, scales
        k_max = stored.shape[2]
        buffers = [self.stored[0], self.stored[1]]
        if self.scales is not None:
            buffers += [self.scales[0], self.scales[1]]
        rows = [buf.unbind(0) for buf in buffers]
        self._gather_dst = [r[b] if n == k_max else r[b][:n] for b, n in enumerate(self.key_lens) for r in rows]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write row b's first ``lens[b]`` new K/V frames of ``k``/``v`` (B, H, N, D) into session
        b's cache after its earlier frames: one multi-tensor copy for the batch. fp8 caches: the
        chunk is quantized once (per-row scales: each row's bytes are those of quantizing it alone)."""
        # (B, N, H, D): the projections' own layout, so no copy (``WhisperAttention._heads``)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        new = [k, v]
        if self.quantized:
            (k8, ks), (v8, vs) = quantize_fp8(k), quantize_fp8(v)
            new = [k8, v8, ks, vs]
        rows = [t.unbind(0) for t in new]                 # one call per tensor, not a view per row
        width = k.shape[1]
        dst = [cache[layer] for blocks in self.new_blocks for cache in blocks]
        src = [r[b] if n == width else r[b][:n] for b, n in enumerate(self.lens) for r in rows]
        _copy_pairs(dst, src)

    def gather(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Each session's first ``key_lens[b]`` frames of ``layer`` as one zero-padded (B, H, K, D)
        batch in ``dtype``, K = max(key_lens): one multi-tensor copy into the tick's buffer; fp8
        caches are copied as stored and dequantized once for the batch (zero scales on the padding
        give zeros). Equal to padding each session's ``read`` and stacking (test). The result may
        be a view of the buffer: valid until the next layer's gather."""
        self.copy_valid(layer)
        return stored_keys_values(self.stored, self.scales, dtype)

    def copy_valid(self, layer: int) -> None:
        """``gather``'s copy alone: each session's valid frames of ``layer`` into the buffer."""
        _copy_pairs(self._gather_dst, [cache[layer] for blocks in self.valid_blocks for cache in blocks])


def stored_keys_values(stored: torch.Tensor, scales: torch.Tensor | None,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A gather buffer (2, B, K, H, D) as stored (+ fp8 scales) -> keys, values (B, H, K, D) in
    ``dtype`` (views of the buffer when nothing is converted)."""
    kv = dequantize_fp8(stored, scales, dtype) if scales is not None else stored.to(dtype)
    return kv[0].transpose(1, 2), kv[1].transpose(1, 2)


def _same_length(tensors: list[torch.Tensor], dim: int = -1) -> list[list[int]]:
    """Indices of ``tensors`` grouped by their size along ``dim``, in first-seen order."""
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.shape[dim], []).append(i)
    return list(groups.values())


# ----------------------------------------------------------------------------- full module


class AudioEncoder(nn.Module):
    """``apm`` (Whisper encoder) + ``audio_projection_layer`` + AvgPool, whole-clip and streaming."""

    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.apm = WhisperEncoder(cfg)
        self.audio_projection_layer = MultiModalProjector(cfg.d_model, cfg.out_dim)
        self.audio_avg_pooler = nn.AvgPool1d(cfg.pool_step, stride=cfg.pool_step)
        self.log_mel = LogMel(cfg.n_fft, cfg.hop_length, cfg.num_mel_bins, cfg.sample_rate)

    # -- whole clip ---------------------------------------------------------------------------

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, F, d) encoder frames -> (B, F // pool_step, out_dim) embeddings."""
        x = self.audio_projection_layer(hidden)
        if x.shape[1] < self.cfg.pool_step:  # fewer frames than one pool window: no embedding
            return x[:, :0]
        return self.audio_avg_pooler(x.transpose(1, 2)).transpose(1, 2)

    def encode_mel(self, mel: torch.Tensor) -> torch.Tensor:
        """(B, n_mels, M) log-mel -> (B, F // pool_step, out_dim); F <= max_source_positions."""
        self._check_mel(mel, batched=True)
        return self.project(self.apm(mel.to(self.apm.conv1.weight.dtype)))

    @torch.no_grad()
    def embed_audio(self, audio, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
        """A whole clip (e.g. reference audio) -> (N, out_dim), 10 embeddings per second.

        Clips longer than one encoder window (30 s) are cut into independent windows.
        """
        audio = validate_audio(audio, sample_rate, expected_rate=self.cfg.sample_rate,
                               min_samples=self.cfg.n_fft)
        window = self.cfg.max_source_positions * 2 * self.cfg.hop_length
        pieces = []
        for start in range(0, audio.numel(), window):
            piece = audio[start:start + window]
            if piece.numel() < self.cfg.n_fft:  # a few ms left over: too short for one frame
                break
            mel = self.log_mel(piece.to(self.apm.conv1.weight.device))
            pieces.append(self.encode_mel(mel[None])[0])
        return torch.cat(pieces, dim=0)

    # -- streaming ----------------------------------------------------------------------------

    def new_stream_state(self, *, grow: bool = True, growth_frames: int = CACHE_GROWTH_FRAMES,
                         storage_dtype: torch.dtype | None = None) -> StreamingAudioEncoderState:
        """A fresh session state. ``grow`` (serving): the cache starts empty, so opening a session
        costs nothing until audio arrives, and grows by ``growth_frames``. ``grow=False``: the
        whole ``max_cache_frames`` is allocated now (the reference the growing cache must match).
        ``storage_dtype``: None stores the weights' dtype; fp8 (``precision.encoder_cache_dtype``)
        stores e4m3 values plus a float32 scale per (frame, head)."""
        w = self.apm.conv1.weight
        frames = 0 if grow else self.cfg.max_cache_frames
        shape = (self.cfg.encoder_layers, frames, self.cfg.encoder_attention_heads, self.cfg.head_dim)
        store = w.dtype if storage_dtype is None else storage_dtype
        scales = {}
        if is_quantized(storage_dtype):
            scales = {name: torch.zeros(shape[:-1], dtype=torch.float32, device=w.device)
                      for name in ("k_scale", "v_scale")}
        return StreamingAudioEncoderState(k=torch.zeros(shape, dtype=store, device=w.device),
                                          v=torch.zeros(shape, dtype=store, device=w.device),
                                          max_frames=self.cfg.max_cache_frames, growth_frames=growth_frames,
                                          **scales)

    def expected_chunk_samples(self, state: StreamingAudioEncoderState) -> int:
        return self.cfg.first_chunk_samples if state.num_chunks == 0 else self.cfg.chunk_samples

    @torch.no_grad()
    def stream_step(self, states: list[StreamingAudioEncoderState], chunks: list,
                    sample_rate: int = SAMPLE_RATE, graphs: EncoderGraphs | None = None) -> list[torch.Tensor]:
        """One tick for several sessions: PCM chunk per session -> (chunk_frames // 5, out_dim) each.
        ``graphs`` (``engine.cuda_graphs``): the layers as piecewise graphs when it
        accepts the tick (models/audio_encoder_graphs.py)."""
        if len(states) != len(chunks):
            raise ValueError(f"{len(states)} states but {len(chunks)} chunks")
        audios = []
        for state, chunk in zip(states, chunks):
            audio = validate_audio(chunk, sample_rate, expected_rate=self.cfg.sample_rate,
                                   min_samples=self.cfg.n_fft)
            want = self.expected_chunk_samples(state)
            if audio.numel() != want:
                which = "first" if state.num_chunks == 0 else "later"
                raise ValueError(f"{which} streaming chunk must have {want} samples, got {audio.numel()}")
            audios.append(audio)
        # Chunks of one length (every session's 1 s after its first) go to the device and through
        # the log-mel together: one copy and one STFT per length, not per session.
        device = self.apm.conv1.weight.device
        mels: list[torch.Tensor] = [torch.empty(0)] * len(audios)
        for idxs in _same_length(audios):
            batch = torch.stack([audios[i] for i in idxs]).to(device, non_blocking=True)
            for i, mel in zip(idxs, self.log_mel(batch)):
                mels[i] = mel
        return self.stream_step_mel(states, mels, graphs)

    @torch.no_grad()
    def stream_step_mel(self, states: list[StreamingAudioEncoderState],
                        mels: list[torch.Tensor], graphs: EncoderGraphs | None = None) -> list[torch.Tensor]:
        """One tick from log-mel chunks (n_mels, M_i); semantics in the module docstring."""
        if len(states) != len(mels):
            raise ValueError(f"{len(states)} states but {len(mels)} mel chunks")
        if not states:
            return []
        dtype = self.apm.conv1.weight.dtype
        for mel in mels:
            self._check_mel(mel, batched=False, finite=False)   # shapes here, values per group below
        # Same-length chunks share one finiteness check (one host sync) and one conv front.
        fronts: list[torch.Tensor] = [torch.empty(0)] * len(mels)
        groups: list[tuple[list[int], torch.Tensor]] = []   # (sessions, their fronts (G, F, d))
        for idxs in _same_length(mels):
            group = torch.stack([mels[i] for i in idxs])
            if not torch.isfinite(group).all():
                raise ValueError("log-mel contains NaN or Inf")
            groups.append((idxs, self.apm.conv_front(group.to(dtype))))
            for i, front in zip(idxs, groups[-1][1]):
                fronts[i] = front  # (F_i, d), a view of the group's tensor
        for state, front in zip(states, fronts):
            if front.shape[0] > self.cfg.max_cache_frames:
                raise ValueError(f"chunk of {front.shape[0]} frames exceeds max_cache_frames "
                                 f"{self.cfg.max_cache_frames}")
            if state.num_frames + front.shape[0] > self.cfg.max_cache_frames:
                logger.debug("audio encoder cache reset at %d frames", state.num_frames)
                state.reset()
        for state, front in zip(states, fronts):  # before any layer writes: a grow copies valid rows
            state.reserve(state.num_frames + front.shape[0])
        if graphs is not None and graphs.accepts(states, [f.shape[0] for f in fronts]):
            hidden = graphs.run(states, fronts, groups)
        else:
            hidden = self._stream_layers(states, fronts, groups)
        for state, front in zip(states, fronts):
            state.num_frames += front.shape[0]
            state.num_chunks += 1
        outs: list[torch.Tensor] = [torch.empty(0)] * len(fronts)
        for idxs in _same_length(fronts, dim=0):   # one projection per chunk length
            n = fronts[idxs[0]].shape[0]
            rows = hidden[idxs, :n] if len(idxs) < hidden.shape[0] else hidden[:, :n]
            for i, out in zip(idxs, self.project(rows)):
                outs[i] = out
        return outs

    def _stream_layers(self, states: list[StreamingAudioEncoderState], fronts: list[torch.Tensor],
                       groups: list[tuple[list[int], torch.Tensor]]) -> torch.Tensor:
        """Run the layers over a padded batch of chunks, reading/writing each session's cache.
        ``groups``: the conv fronts of equal-length chunks, one tensor per length (``fronts`` are
        its rows): the batch is built from them with one indexed write per length."""
        starts = [s.num_frames for s in states]
        lens = [f.shape[0] for f in fronts]
        n_max, key_lens = max(lens), [s + n for s, n in zip(starts, lens)]
        k_max = max(key_lens)
        pos_table = self.apm.embed_positions.weight
        device = pos_table.device
        if len(groups) == 1 and groups[0][0] == list(range(len(states))):
            x = groups[0][1]   # every chunk has one length (the steady case): no padding
        else:
            # Frames past a row's length are padding: computed, never stored, dropped at the end.
            x = fronts[0].new_zeros(len(fronts), n_max, self.cfg.d_model)  # (B, N, d)
            for idxs, front in groups:
                x[torch.tensor(idxs).to(device, non_blocking=True), : front.shape[1]] = front
        # Frame j of row b sits at position starts[b] + j (clamped on padding, which is dropped)
        top = pos_table.shape[0] - 1
        positions = (torch.tensor(starts)[:, None] + torch.arange(n_max)).clamp_(max=top)   # on the host
        # contiguous as the per-session build was: a (B, d, F)-strided sum could change GEMM bits
        x = (x + pos_table[positions.to(device, non_blocking=True)]).contiguous()
        # Key j of row b is real iff j < key_lens[b]; padded query rows are computed and dropped.
        lengths = torch.tensor(key_lens).to(x.device, non_blocking=True)
        valid = torch.arange(k_max, device=x.device)[None, :] < lengths[:, None]
        mask = valid[:, None, None, :]  # (B, 1, 1, K)

        traffic = TickKV(states, starts, lens)   # every layer's cache views, made once for the tick
        for idx, layer in enumerate(self.apm.layers):
            def kv_hook(k, v, idx=idx):  # k, v: (B, H, N, D) for this chunk
                traffic.store(idx, k, v)
                keys, values = traffic.gather(idx, k.dtype)
                return keys, values, mask

            x = layer(x, kv_hook)
        return self.apm.layer_norm(x)

    def _check_mel(self, mel: torch.Tensor, batched: bool, finite: bool = True) -> None:
        want = 3 if batched else 2
        if not isinstance(mel, torch.Tensor) or mel.dim() != want:
            shape = "(B, n_mels, frames)" if batched else "(n_mels, frames)"
            raise ValueError(f"log-mel must be a tensor of shape {shape}, got "
                             f"{tuple(mel.shape) if isinstance(mel, torch.Tensor) else type(mel).__name__}")
        if mel.shape[-2] != self.cfg.num_mel_bins:
            raise ValueError(f"log-mel must have {self.cfg.num_mel_bins} bins, got {mel.shape[-2]}")
        if mel.shape[-1] < 1:
            raise ValueError("log-mel has no frames")
        if finite and not torch.isfinite(mel).all():
            raise ValueError("log-mel contains NaN or Inf")

    # -- loading ------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, cfg: AudioEncoderConfig | None = None,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> "AudioEncoder":
        """Load a Whisper checkpoint dir (encoder only; projection stays random) or a MiniCPM-o dir."""
        from duplexcache.models import checkpoint

        cfg = cfg or AudioEncoderConfig.from_dir(path)
        model = cls(cfg)
        keys = set(checkpoint.checkpoint_keys(path))
        enc_prefix = next((p for p in ("apm.", "model.encoder.", "encoder.", "")
                           if f"{p}conv1.weight" in keys), None)
        if enc_prefix is None:
            raise checkpoint.CheckpointError(f"audio encoder: no conv1.weight under any known prefix in {path}")
        checkpoint.load_strict(model.apm, checkpoint.load_state_dict(path, enc_prefix), "audio encoder (apm)")
        if "audio_projection_layer.linear1.weight" in keys:
            sd = checkpoint.load_state_dict(path, "audio_projection_layer.")
            checkpoint.load_strict(model.audio_projection_layer, sd, "audio projection")
        else:
            logger.warning("%s has no audio_projection_layer: projection weights stay random", path)
        return model.to(device=device, dtype=dtype)

