"""Stage 2 vocoder: HiFT (neural source filter + iSTFT head), mel (80, 50 Hz) -> 24 kHz.

Our own implementation of ``stepaudio2.flashcosyvoice.modules.hifigan.HiFTGenerator``
(``minicpmo-utils==1.0.5``) with the same module and parameter names, so ``hift.pt`` (after
stripping a ``generator.`` prefix) loads with ``strict=True``. Weight norm uses
``torch.nn.utils.parametrizations.weight_norm`` as the reference does, so the keys are
``*.parametrizations.weight.original0/1``.

Randomness: the NSF source draws from the RNG (initial harmonic phases, additive noise) in the
reference's order -- ``rand(b, harmonics+1)``, ``randn(b, L, harmonics+1)``, ``randn(b, L, 1)``
(the last one unused, drawn anyway) -- so seeding the same RNG gives the same waveform.
``generator`` may also be a list with one ``torch.Generator`` per batch row (``RowGenerators``):
then each row draws its own numbers from its own generator, in the order a batch of one would,
so a batched forward gives every session the noise it would get alone. The draws depend only on
the batch's shape, so ``HiFTGenerator.draw_noise`` makes them before the forward and
``forward_drawn`` is a pure function of its tensors: what ``cfm.vocoder_graphs`` captures as a
CUDA graph. The iSTFT is ``istft``, torch.istft's own ops without its host-side window check
(the one sync of the forward).

``HiftStreamState`` + ``hift_stream_step`` reproduce the vocoder half of
``Token2wav.stream``: an 8-frame mel cache, a 3840-sample source and speech cache, a Hamming
cross-fade over 3840 samples, silence in front of the first chunk and the held-back tail
released by the last chunk. ``hift_stream_steps`` does the same for several streams whose
caches have equal lengths, in one generator forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn import Conv1d, ConvTranspose1d
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

logger = logging.getLogger(__name__)

MEL_CACHE_FRAMES = 8  # Token2wav.mel_cache_len (160 ms)
SAMPLES_PER_FRAME = 480  # 24 kHz / 50 Hz

# One generator for the whole batch (or None: the global RNG), or one generator per batch row.
RowGenerators = torch.Generator | Sequence[torch.Generator | None] | None


def _per_row(generator: RowGenerators) -> bool:
    return isinstance(generator, (list, tuple))


def check_row_generators(generators: Sequence[torch.Generator | None], rows: int) -> None:
    """Per-row generators must be one per row and distinct: a generator shared by two rows (or
    two rows on the global RNG) would interleave their draws, unlike one session at a time."""
    if len(generators) != rows:
        raise ValueError(f"{len(generators)} generators for {rows} batch rows")
    if rows > 1 and (any(g is None for g in generators) or len({id(g) for g in generators}) != rows):
        raise ValueError("per-row generators must be distinct torch.Generator objects")


def _normal_like(like: torch.Tensor, generator: RowGenerators) -> torch.Tensor:
    """``empty_like(like).normal_()``; per row, each draw has the strides a batch of one has, so
    the same values land on the same elements as in a one-session run."""
    if not _per_row(generator):
        return torch.empty_like(like).normal_(generator=generator)
    check_row_generators(generator, like.shape[0])
    return torch.cat([torch.empty_like(like[i:i + 1]).normal_(generator=g) for i, g in enumerate(generator)])


def _rand_rows(rows: int, cols: int, device: torch.device, generator: RowGenerators) -> torch.Tensor:
    """``torch.rand(rows, cols)``, or one ``rand(1, cols)`` per row from that row's generator."""
    if not _per_row(generator):
        return torch.rand(rows, cols, device=device, generator=generator)
    check_row_generators(generator, rows)
    return torch.cat([torch.rand(1, cols, device=device, generator=g) for g in generator])


@dataclass(frozen=True)
class NSFNoise:
    """The NSF source's random numbers for one forward, drawn by ``HiFTGenerator.draw_noise``.

    ``phases``: each harmonic's initial phase, (b, harmonics + 1), the fundamental's 0.
    ``additive``: the additive noise before its amplitude, (b, samples, harmonics + 1), laid out
    as the sine waves are (harmonics-major per row) so each value sits where the reference puts it.
    """

    phases: torch.Tensor
    additive: torch.Tensor


def istft(spec: torch.Tensor, n_fft: int, hop: int, window: torch.Tensor) -> torch.Tensor:
    """``torch.istft(spec, n_fft, hop, n_fft, window)`` (centred, one-sided, unnormalised),
    bit for bit, without the host sync.

    The same ATen ops in the same order (an inverse real FFT over the transposed frames, the
    window, overlap-add by ``unfold_backward``, the centre trim, the division by the summed
    squared window). torch.istft also asks the host whether that sum ever falls below 1e-11
    (NOLA), a blocking read in every call and one a CUDA graph cannot hold; the vocoder's
    periodic Hann window at hop n_fft / 4 never does (``VocoderConfig`` checks it once).
    spec (b, n_fft/2 + 1, frames) complex -> (b, hop * (frames - 1)).
    """
    frames = spec.shape[-1]
    length = n_fft + hop * (frames - 1)
    frames_time = torch.fft.irfft(spec.transpose(1, 2), n=n_fft, dim=-1, norm="backward")   # (b, frames, n_fft)
    y = torch.ops.aten.unfold_backward(frames_time * window.view(1, 1, n_fft), [spec.shape[0], length], 1, n_fft, hop)
    envelope = torch.ops.aten.unfold_backward(window.pow(2).expand(1, frames, n_fft), [1, length], 1, n_fft, hop)
    half = n_fft // 2
    return y[:, half:-half] / envelope[:, half:-half]


def nola_holds(n_fft: int, hop: int, window: torch.Tensor) -> bool:
    """The overlap-added squared window never falls below torch.istft's 1e-11 inside the trim."""
    frames = 2 * n_fft // hop + 1
    length = n_fft + hop * (frames - 1)
    envelope = torch.ops.aten.unfold_backward(window.pow(2).expand(1, frames, n_fft), [1, length], 1, n_fft, hop)
    return bool(envelope[:, n_fft // 2:-(n_fft // 2)].abs().min() >= 1e-11)


@dataclass(frozen=True)
class VocoderConfig:
    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    n_fft: int = 16
    hop_len: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_cond_channels: int = 512

    def __post_init__(self) -> None:
        if int(np.prod(self.upsample_rates)) * self.hop_len != SAMPLES_PER_FRAME:
            raise ValueError("prod(upsample_rates) * hop_len must be 480 samples per mel frame")
        if self.sampling_rate == 22050:
            raise ValueError("the 22.05 kHz SourceModuleHnNSF variant is not implemented")
        if self.base_channels % (2 ** len(self.upsample_rates)):
            raise ValueError("base_channels must halve cleanly at every upsample")
        n = len(self.upsample_rates)
        if not (len(self.upsample_kernel_sizes) == n == len(self.source_resblock_kernel_sizes)):
            raise ValueError("upsample and source resblock lists must have equal length")

    @classmethod
    def minicpmo45(cls) -> "VocoderConfig":
        return cls()

    @classmethod
    def tiny(cls) -> "VocoderConfig":
        return cls(base_channels=32, f0_cond_channels=32)


def _get_padding(kernel_size: int, dilation: int = 1) -> int:
    return int((kernel_size * dilation - dilation) / 2)


def _init_conv(m: nn.Module, std: float = 0.01) -> None:
    if "Conv" in m.__class__.__name__:
        m.weight.data.normal_(0.0, std)


def periodic_hann(n: int) -> torch.Tensor:
    """scipy.signal.get_window('hann', n, fftbins=True) as float32, without scipy.

    Evaluated as scipy does (0.5 - 0.5*cos over linspace(-pi, pi, n + 1), float64, last
    point dropped) so the float32 values are identical.
    """
    fac = np.linspace(-np.pi, np.pi, n + 1)
    w = np.zeros(n + 1)
    for k, a in enumerate((0.5, 0.5)):
        w += a * np.cos(k * fac)
    return torch.from_numpy(w[:n].astype(np.float32))


class Snake(nn.Module):
    """x + 1/alpha * sin^2(alpha * x), alpha per channel (linear scale)."""

    def __init__(self, in_features: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(in_features))
        self.no_div_by_zero = 0.000000001

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.unsqueeze(0).unsqueeze(-1)  # (1, C, 1)
        return x + (1.0 / (alpha + self.no_div_by_zero)) * torch.pow(torch.sin(x * alpha), 2)


class ResBlock(nn.Module):
    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]):
        super().__init__()
        self.convs1 = nn.ModuleList(
            weight_norm(Conv1d(channels, channels, kernel_size, 1, dilation=d, padding=_get_padding(kernel_size, d)))
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            weight_norm(Conv1d(channels, channels, kernel_size, 1, dilation=1, padding=_get_padding(kernel_size, 1)))
            for _ in dilations
        )
        self.convs1.apply(_init_conv)
        self.convs2.apply(_init_conv)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = c2(a2(c1(a1(x)))) + x
        return x


class SineGen2(nn.Module):
    """Harmonic sine source at 24 kHz; phase integrated at frame rate, then upsampled."""

    def __init__(self, samp_rate: int, upsample_scale: int, harmonic_num: int, sine_amp: float,
                 noise_std: float, voiced_threshold: float):
        super().__init__()
        self.sine_amp = sine_amp
        self.noise_std = noise_std
        self.harmonic_num = harmonic_num
        self.sampling_rate = samp_rate
        self.voiced_threshold = voiced_threshold
        self.upsample_scale = upsample_scale

    def draw(self, rows: int, samples: int, device: torch.device, generator: RowGenerators) -> NSFNoise:
        """The forward's random numbers, in the reference's order per generator: the initial
        phases, the additive noise, then a draw the reference makes and discards."""
        harmonics = self.harmonic_num + 1
        phases = _rand_rows(rows, harmonics, device, generator)
        phases[:, 0] = 0   # no random phase for the fundamental
        # the sine waves' layout (a transposed interpolation output): values land as in the reference
        additive = _normal_like(torch.empty(rows, harmonics, samples, device=device).transpose(1, 2), generator)
        _normal_like(torch.empty(rows, samples, 1, device=device), generator)   # SourceModuleHnNSF2's unused branch
        return NSFNoise(phases, additive)

    def _f02sine(self, f0_values: torch.Tensor, phases: torch.Tensor) -> torch.Tensor:
        """f0_values (b, L, harmonics+1) in Hz -> sines (b, L, harmonics+1)."""
        rad_values = (f0_values / self.sampling_rate) % 1
        rad_values[:, 0, :] = rad_values[:, 0, :] + phases
        rad_values = F.interpolate(rad_values.transpose(1, 2), scale_factor=1 / self.upsample_scale,
                                   mode="linear").transpose(1, 2)
        phase = torch.cumsum(rad_values, dim=1) * 2 * np.pi
        phase = F.interpolate(phase.transpose(1, 2) * self.upsample_scale, scale_factor=self.upsample_scale,
                              mode="linear").transpose(1, 2)
        return torch.sin(phase)

    def forward(self, f0: torch.Tensor, noise: NSFNoise) -> torch.Tensor:
        """f0 (b, L, 1) -> voiced sines + noise (b, L, harmonics+1)."""
        # 1..harmonics+1 made on f0's device (exact small integers: the values of the reference's
        # host tensor, without its blocking copy)
        harmonics = torch.arange(1, self.harmonic_num + 2, dtype=torch.float32, device=f0.device).reshape(1, 1, -1)
        sine_waves = self._f02sine(torch.multiply(f0, harmonics), noise.phases) * self.sine_amp
        uv = (f0 > self.voiced_threshold).type(torch.float32)
        noise_amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
        return sine_waves * uv + noise_amp * noise.additive


class SourceModuleHnNSF2(nn.Module):
    """Merges the harmonics into one excitation signal (names: l_linear)."""

    def __init__(self, sampling_rate: int, upsample_scale: int, harmonic_num: int, sine_amp: float,
                 add_noise_std: float, voiced_threshod: float):
        super().__init__()
        self.sine_amp = sine_amp
        self.l_sin_gen = SineGen2(sampling_rate, upsample_scale, harmonic_num, sine_amp, add_noise_std,
                                  voiced_threshod)
        self.l_linear = nn.Linear(harmonic_num + 1, 1)
        self.l_tanh = nn.Tanh()

    def forward(self, x: torch.Tensor, noise: NSFNoise) -> torch.Tensor:
        """x: f0 (b, L, 1) -> source (b, L, 1). The reference's noise branch is unused (its draw
        is made by `SineGen2.draw`, to keep the RNG in step)."""
        with torch.no_grad():
            sine_wavs = self.l_sin_gen(x, noise)
        return self.l_tanh(self.l_linear(sine_wavs))


class ConvRNNF0Predictor(nn.Module):
    def __init__(self, num_class: int = 1, in_channels: int = 80, cond_channels: int = 512):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            layers += [weight_norm(nn.Conv1d(in_channels if i == 0 else cond_channels, cond_channels, 3, padding=1)),
                       nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, num_class)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """mel (b, 80, t) -> f0 (b, t), non-negative."""
        x = self.condnet(x).transpose(1, 2)
        return torch.abs(self.classifier(x).squeeze(-1))


class HiFTGenerator(nn.Module):
    """HiFTNet generator: F0 -> NSF source; mel + source STFT -> magnitude/phase -> iSTFT."""

    def __init__(self, cfg: VocoderConfig | None = None):
        super().__init__()
        cfg = cfg or VocoderConfig()
        self.cfg = cfg
        self.out_channels = 1
        self.sampling_rate = cfg.sampling_rate
        self.istft_params = {"n_fft": cfg.n_fft, "hop_len": cfg.hop_len}
        self.lrelu_slope = cfg.lrelu_slope
        self.audio_limit = cfg.audio_limit
        self.num_kernels = len(cfg.resblock_kernel_sizes)
        self.num_upsamples = len(cfg.upsample_rates)
        up_scale = int(np.prod(cfg.upsample_rates)) * cfg.hop_len
        self.m_source = SourceModuleHnNSF2(cfg.sampling_rate, up_scale, cfg.nb_harmonics, cfg.nsf_alpha,
                                           cfg.nsf_sigma, cfg.nsf_voiced_threshold)
        self.f0_upsamp = nn.Upsample(scale_factor=up_scale)
        base = cfg.base_channels
        self.conv_pre = weight_norm(Conv1d(cfg.in_channels, base, 7, 1, padding=3))
        self.ups = nn.ModuleList(
            weight_norm(ConvTranspose1d(base // 2**i, base // 2 ** (i + 1), k, u, padding=(k - u) // 2))
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes))
        )
        # source branch: STFT frames downsampled to each upsampling stage's rate
        down_rates = [1] + list(cfg.upsample_rates[::-1][:-1])
        cum = np.cumprod(down_rates)[::-1]
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (u, k, d) in enumerate(zip(cum, cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes)):
            ch, u = base // 2 ** (i + 1), int(u)
            if u == 1:
                self.source_downs.append(Conv1d(cfg.n_fft + 2, ch, 1, 1))
            else:
                self.source_downs.append(Conv1d(cfg.n_fft + 2, ch, u * 2, u, padding=u // 2))
            self.source_resblocks.append(ResBlock(ch, k, d))
        self.resblocks = nn.ModuleList(
            ResBlock(base // 2 ** (i + 1), k, d)
            for i in range(self.num_upsamples)
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes)
        )
        ch = base // 2**self.num_upsamples
        self.conv_post = weight_norm(Conv1d(ch, cfg.n_fft + 2, 7, 1, padding=3))
        self.ups.apply(_init_conv)
        self.conv_post.apply(_init_conv)
        self.reflection_pad = nn.ReflectionPad1d((1, 0))
        window = periodic_hann(cfg.n_fft)
        if not nola_holds(cfg.n_fft, cfg.hop_len, window):
            raise ValueError(f"the Hann window at n_fft {cfg.n_fft}, hop {cfg.hop_len} breaks the iSTFT's NOLA condition")
        if torch.empty(0).device.type == "meta":
            window = window.to("meta")
        self.register_buffer("stft_window", window, persistent=False)  # not in hift.pt
        self.f0_predictor = ConvRNNF0Predictor(cond_channels=cfg.f0_cond_channels)

    def _stft(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, hop = self.istft_params["n_fft"], self.istft_params["hop_len"]
        spec = torch.view_as_real(torch.stft(x, n, hop, n, window=self.stft_window.to(x.device), return_complex=True))
        return spec[..., 0], spec[..., 1]  # (b, n/2+1, frames) each

    def _istft(self, magnitude: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
        n, hop = self.istft_params["n_fft"], self.istft_params["hop_len"]
        magnitude = torch.clip(magnitude, max=1e2)
        real = magnitude * torch.cos(phase)
        img = magnitude * torch.sin(phase)
        return istft(torch.complex(real, img), n, hop, self.stft_window.to(magnitude.device))

    def decode(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """x mel (b, 80, t); s source (b, 1, 480*t) -> speech (b, 480*t)."""
        s_real, s_imag = self._stft(s.squeeze(1))
        s_stft = torch.cat([s_real, s_imag], dim=1)  # (b, n_fft + 2, frames)
        x = self.conv_pre(x)
        for i in range(self.num_upsamples):
            x = self.ups[i](F.leaky_relu(x, self.lrelu_slope))
            if i == self.num_upsamples - 1:
                x = self.reflection_pad(x)
            x = x + self.source_resblocks[i](self.source_downs[i](s_stft))
            xs = None
            for j in range(self.num_kernels):
                if xs is None:
                    xs = self.resblocks[i * self.num_kernels + j](x)
                else:
                    xs += self.resblocks[i * self.num_kernels + j](x)
            x = xs / self.num_kernels
        x = self.conv_post(F.leaky_relu(x))
        half = self.istft_params["n_fft"] // 2 + 1
        magnitude = torch.exp(x[:, :half, :])
        phase = torch.sin(x[:, half:, :])  # the reference's (redundant) sin, kept for equality
        x = self._istft(magnitude, phase)
        return torch.clamp(x, -self.audio_limit, self.audio_limit)

    @torch.inference_mode()
    def forward(self, speech_feat: torch.Tensor, cache_source: torch.Tensor | None = None,
                generator: RowGenerators = None) -> tuple[torch.Tensor, torch.Tensor]:
        """speech_feat (b, 80, t) -> speech (b, 480*t), source (b, 1, 480*t).

        cache_source (b, 1, n) overwrites the first n source samples (continuity across chunks).
        `generator`: one for the batch, or a list with one per row (see the module docstring).
        """
        if speech_feat.dim() != 3 or speech_feat.shape[1] != self.cfg.in_channels:
            raise ValueError(f"speech_feat must be (b, {self.cfg.in_channels}, t), got {tuple(speech_feat.shape)}")
        noise = self.draw_noise(speech_feat.shape[0], speech_feat.shape[2], speech_feat.device, generator)
        return self.forward_drawn(speech_feat, cache_source, noise)

    def draw_noise(self, rows: int, mel_frames: int, device: torch.device, generator: RowGenerators = None) -> NSFNoise:
        """The random numbers a forward over (rows, mels, mel_frames) uses (see the module docstring)."""
        return self.m_source.l_sin_gen.draw(rows, mel_frames * SAMPLES_PER_FRAME, device, generator)

    @torch.inference_mode()
    def forward_drawn(self, speech_feat: torch.Tensor, cache_source: torch.Tensor | None,
                      noise: NSFNoise) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with its random numbers given: no RNG, no host sync (CUDA-graph safe)."""
        f0 = self.f0_predictor(speech_feat)  # (b, t)
        s = self.f0_upsamp(f0[:, None]).transpose(1, 2)  # (b, 480t, 1)
        s = self.m_source(s, noise).transpose(1, 2)  # (b, 1, 480t)
        if cache_source is not None and cache_source.shape[2] != 0:
            s[:, :, : cache_source.shape[2]] = cache_source
        return self.decode(speech_feat, s), s


def fade_in_out(fade_in: torch.Tensor, fade_out: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Cross-fade the first len(window)/2 samples of `fade_in` with the last of `fade_out`.

    The window stays float64 (np.hamming), as in Token2wav, so the blend is computed in
    float64 and rounded once into the float32 output.
    """
    n = int(window.shape[0] / 2)
    out = fade_in.clone()
    out[..., :n] = fade_in[..., :n] * window[:n] + fade_out[..., -n:] * window[n:]
    return out


@dataclass
class HiftStreamState:
    """One session's vocoder stream (Token2wav.hift_cache_dict + its constants)."""

    mel: torch.Tensor  # (1, 80, <=8) last mel frames fed again with the next chunk
    source: torch.Tensor  # (1, 1, <=3840) NSF source continuing into the next chunk
    speech: torch.Tensor  # (1, <=3840) held-back tail, cross-faded into the next chunk
    window: torch.Tensor = field(repr=False)  # float64 Hamming, 2*3840
    mel_cache_len: int = MEL_CACHE_FRAMES
    source_cache_len: int = MEL_CACHE_FRAMES * SAMPLES_PER_FRAME

    @classmethod
    def create(cls, num_mels: int = 80, device: torch.device | str = "cpu") -> "HiftStreamState":
        source_len = MEL_CACHE_FRAMES * SAMPLES_PER_FRAME
        return cls(
            mel=torch.zeros(1, num_mels, 0, device=device),
            source=torch.zeros(1, 1, 0, device=device),
            speech=torch.zeros(1, 0, device=device),
            window=torch.from_numpy(np.hamming(2 * source_len)).to(device),
        )


def hift_stream_step(hift: HiFTGenerator, state: HiftStreamState, chunk_mel: torch.Tensor,
                     last_chunk: bool, generator: torch.Generator | None = None) -> torch.Tensor:
    """Vocode one chunk of mel (1, 80, t) and return the float PCM (1, n) ready to play.

    Every chunk but the last holds back its final 3840 samples (cross-faded into the next
    chunk); the first chunk is shifted right by 3840 samples of silence so chunk lengths stay
    480 * t. Updates `state` in place. `generator` None draws from the global RNG.
    """
    if chunk_mel.dim() != 3 or chunk_mel.shape[0] != 1:
        raise ValueError(f"chunk_mel must be (1, mels, t), got {tuple(chunk_mel.shape)}")
    return hift_stream_steps(hift, [state], chunk_mel, [last_chunk], [generator])[0]


def _stack_states(states: Sequence[HiftStreamState]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The streams' caches as batches; every stream must hold caches of the same lengths."""
    lengths = {(s.mel.shape[2], s.source.shape[2], s.speech.shape[1]) for s in states}
    if len(lengths) != 1:
        raise ValueError(f"streams batched together must have equal cache lengths "
                         f"(mel, source, speech), got {sorted(lengths)}")
    if len(states) == 1:
        return states[0].mel, states[0].source, states[0].speech
    return (torch.cat([s.mel for s in states]), torch.cat([s.source for s in states]),
            torch.cat([s.speech for s in states]))


# `HiFTGenerator.forward_drawn`, or something that computes the same (cfm.vocoder_graphs' replay)
DrawnForward = Callable[[torch.Tensor, torch.Tensor | None, NSFNoise], tuple[torch.Tensor, torch.Tensor]]


def hift_stream_steps(hift: HiFTGenerator, states: Sequence[HiftStreamState], chunk_mel: torch.Tensor,
                      last_chunk: Sequence[bool], generators: Sequence[torch.Generator | None],
                      forward: DrawnForward | None = None) -> list[torch.Tensor]:
    """`hift_stream_step` for b streams at once: one generator forward over (b, 80, cache + t).

    The streams' caches must have equal lengths (all first chunks, or all past it: the mel, source
    and speech caches are then full). Each row's NSF noise comes from its own generator in
    `generators` (distinct), drawn as a one-stream run would, so row i's PCM is what
    `hift_stream_step(hift, states[i], chunk_mel[i:i+1], last_chunk[i], generators[i])` returns
    up to the GEMMs' batch-size rounding. Each state gets new private tensors (clones, never views
    of the batch), so a stream's cache bytes are its own. Returns one (1, n) PCM per row.
    `forward` runs the generator on the drawn noise (default `hift.forward_drawn`).
    """
    b = len(states)
    if chunk_mel.dim() != 3 or chunk_mel.shape[0] != b or b == 0:
        raise ValueError(f"chunk_mel must be ({b}, mels, t) for {b} streams, got {tuple(chunk_mel.shape)}")
    if len(last_chunk) != b:
        raise ValueError(f"{len(last_chunk)} last_chunk flags for {b} streams")
    check_row_generators(generators, b)
    mel_cache, source_cache, speech_cache = _stack_states(states)
    mel = torch.cat([mel_cache, chunk_mel], dim=2)
    # a batch of one passes its generator itself: exactly the single-stream call
    noise = hift.draw_noise(b, mel.shape[2], mel.device, generators[0] if b == 1 else list(generators))
    speech, source = (forward or hift.forward_drawn)(mel, source_cache, noise)
    is_first_chunk = speech_cache.shape[-1] == 0
    if not is_first_chunk:
        speech = fade_in_out(speech, speech_cache, states[0].window)
    out = []
    for i, state in enumerate(states):
        hold = state.source_cache_len
        state.mel = mel[i:i + 1, :, -state.mel_cache_len:].clone()
        state.source = source[i:i + 1, :, -hold:].clone()
        state.speech = speech[i:i + 1, -hold:].clone()
        pcm = speech[i:i + 1]
        if not last_chunk[i]:
            if is_first_chunk:
                silence = torch.zeros(1, hold, device=speech.device, dtype=speech.dtype)
                pcm = torch.cat([silence, pcm[:, :-hold]], dim=1)
            else:
                pcm = pcm[:, :-hold]
        out.append(pcm)
    return out


def frozen_weight_norm(hift: nn.Module) -> nn.Module:
    """A copy of ``hift`` whose weight-normed convolutions hold their weights as plain parameters.

    Weight norm recomputes every convolution's weight (``g * v / |v|``) on every forward: about
    70 extra kernels and a fresh weight tensor per conv per call, and cuDNN pays its per-call
    set-up again for the new tensors (on an H200, 0.66 ms of host time per conv call in the
    engine's vocoder). Serving never changes the weights, so the copy computes each weight once
    with the same function (``leave_parametrized=True``): the forward's values are bit for bit
    those of ``hift``. ``hift`` itself (and its checkpoint key names) is left as it is. A module
    without weight norm is returned as is."""
    if not any(parametrize.is_parametrized(m) for m in hift.modules()):
        return hift
    # A new module loaded from the state dict, not a deepcopy: parametrization classes are made
    # per module instance, and a deepcopy shares them, so removing the copy's would break hift.
    # Built on meta (no random init: the global RNG is left alone), then given hift's values.
    param = next(hift.parameters())
    frozen = build_vocoder(hift.cfg, "meta").to(param.dtype).to_empty(device=param.device)
    frozen.load_state_dict(hift.state_dict(), strict=True)
    with torch.no_grad():
        for name, buf in hift.named_buffers():    # non-persistent ones (the STFT window) too
            frozen.get_buffer(name).copy_(buf)
        for m in [m for m in frozen.modules() if parametrize.is_parametrized(m, "weight")]:
            parametrize.remove_parametrizations(m, "weight", leave_parametrized=True)
            # weight norm has two originals, so the removal leaves `weight` a plain attribute:
            # register it again so .parameters() (the memory plan's bytes) and .to() see it
            weight = m.weight
            del m.weight
            m.weight = nn.Parameter(weight, requires_grad=False)
    return frozen.eval()


def build_vocoder(cfg: VocoderConfig, device: torch.device | str | None = None) -> HiFTGenerator:
    with torch.device(device or "cpu"):
        model = HiFTGenerator(cfg)
    if torch.device(device or "cpu").type != "meta":
        model.to(device or "cpu")  # the STFT window is computed on CPU (numpy)
    return model.eval()


def hift_state_dict_from_checkpoint(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keys of a ``hift.pt`` as our module names them.

    Drops the ``generator.`` prefix Token2wav strips, and renames pre-parametrization weight
    norm keys (``*.weight_g`` / ``*.weight_v``, which torch's weight_norm load hook accepts in
    the reference) to ``*.parametrizations.weight.original0`` / ``original1``.
    """
    out = {}
    for key, value in state_dict.items():
        key = key.replace("generator.", "")
        if key.endswith(".weight_g"):
            key = key[: -len("weight_g")] + "parametrizations.weight.original0"
        elif key.endswith(".weight_v"):
            key = key[: -len("weight_v")] + "parametrizations.weight.original1"
        out[key] = value
    return out
