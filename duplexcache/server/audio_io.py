"""Input audio at the edge: decode a client's format and resample it to the engine's 16 kHz.

Formats (``InputFormat``):

* ``pcm16``  little-endian int16 mono at 24 kHz (OpenAI's ``audio/pcm``) or 16 kHz;
* ``pcmu`` / ``pcma``  G.711 mu-law / A-law at 8 kHz (OpenAI's ``audio/pcmu``/``audio/pcma``,
  beta ``g711_ulaw``/``g711_alaw``), decoded with the standard library's ``audioop``
  (``audioop-lts`` on Python >= 3.13);
* ``f32``  little-endian float32 mono (our extension), refused when any |sample| > 1.0 so one
  client's bad floats never reach the batched tick.

:class:`InputAudio` is per session: it keeps one streaming ``soxr`` resampler, so chunk
boundaries do not click and the output does not depend on how the client chunked its audio.
16 kHz input passes through untouched (bit-exact).
"""

from __future__ import annotations

import base64
import binascii
import warnings
from dataclasses import dataclass

import numpy as np
import soxr

try:  # stdlib up to 3.12 (deprecated there); the audioop-lts backport provides it on 3.13+
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import audioop
except ModuleNotFoundError:  # pragma: no cover - depends on the Python version
    audioop = None  # type: ignore[assignment]

ENGINE_RATE = 16_000
KINDS = ("pcm16", "pcmu", "pcma", "f32")
RATES: dict[str, tuple[int, ...]] = {"pcm16": (24_000, 16_000), "pcmu": (8_000,), "pcma": (8_000,),
                                     "f32": (16_000, 24_000)}
_BYTES_PER_SAMPLE = {"pcm16": 2, "pcmu": 1, "pcma": 1, "f32": 4}


class AudioError(ValueError):
    """Audio a client sent that cannot be used (becomes an ``invalid_audio`` error to that client)."""


@dataclass(frozen=True)
class InputFormat:
    kind: str
    rate: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown input audio kind {self.kind!r} (known: {', '.join(KINDS)})")
        if self.rate not in RATES[self.kind]:
            raise ValueError(f"{self.kind} input at {self.rate} Hz is not supported "
                             f"(supported: {', '.join(map(str, RATES[self.kind]))} Hz)")

    def samples_in(self, num_bytes: int) -> int:
        return num_bytes // _BYTES_PER_SAMPLE[self.kind]


def decode(audio_b64: str, fmt: InputFormat) -> np.ndarray:
    """Base64 audio in ``fmt`` -> float32 (samples,) at ``fmt.rate``; AudioError naming the problem."""
    try:
        raw = base64.b64decode(audio_b64, validate=True)
    except (binascii.Error, ValueError):
        raise AudioError("audio is not valid base64") from None
    if not raw:
        raise AudioError("audio is empty")
    width = _BYTES_PER_SAMPLE[fmt.kind]
    if len(raw) % width:
        raise AudioError(f"{fmt.kind} audio needs a multiple of {width} bytes, got {len(raw)}")
    if fmt.kind == "pcm16":
        return np.frombuffer(raw, dtype="<i2").astype(np.float32) / np.float32(32768.0)
    if fmt.kind == "f32":
        pcm = np.frombuffer(raw, dtype="<f4").astype(np.float32)
        if not np.isfinite(pcm).all():
            raise AudioError("f32 audio contains NaN or infinite samples")
        peak = float(np.abs(pcm).max())
        if peak > 1.0:
            raise AudioError(f"f32 audio must lie in [-1, 1]; a sample has magnitude {peak:.4g}")
        return pcm
    if audioop is None:  # pragma: no cover
        raise AudioError("G.711 input needs the audioop-lts package on this Python")
    linear = audioop.ulaw2lin(raw, 2) if fmt.kind == "pcmu" else audioop.alaw2lin(raw, 2)
    return np.frombuffer(linear, dtype="<i2").astype(np.float32) / np.float32(32768.0)


class InputAudio:
    """One session's input stream: decode + streaming resample to 16 kHz."""

    def __init__(self, fmt: InputFormat):
        self.format = fmt
        self._resampler = (None if fmt.rate == ENGINE_RATE
                           else soxr.ResampleStream(fmt.rate, ENGINE_RATE, 1, dtype="float32", quality="HQ"))
        self.samples_in = 0  # at the client's rate

    def push(self, audio_b64: str) -> np.ndarray:
        """Decode one chunk; returns the 16 kHz float32 samples ready now (may be empty)."""
        pcm = decode(audio_b64, self.format)
        self.samples_in += pcm.size
        if self._resampler is None:
            return pcm
        out = self._resampler.resample_chunk(pcm, last=False)
        # HQ resampling can overshoot full-scale input by a hair; the engine wants [-1, 1].
        return np.clip(out, -1.0, 1.0, out=out).astype(np.float32, copy=False)

    @property
    def ms_in(self) -> int:
        """Milliseconds of client audio received so far."""
        return self.samples_in * 1000 // self.format.rate

    def clear(self) -> None:
        """Drop what the resampler holds (input_audio_buffer.clear)."""
        if self._resampler is not None:
            self._resampler.clear()


# ------------------------------------------------------------------------------------- output

OUTPUT_RATE = 24_000          # the engine's audio: pcm16 mono
PCM16_OUTPUT_BYTES_PER_SECOND = 2 * OUTPUT_RATE
OUTPUT_KINDS = ("pcm16", "pcmu", "pcma")
G711_RATE = 8_000


class OutputAudio:
    """One session's output stream in the client's format: 24 kHz pcm16 as the engine makes it, or
    G.711 mu-law / A-law at 8 kHz (telephony clients: OpenAI's ``audio/pcmu``/``audio/pcma``).

    G.711 goes through one streaming ``soxr`` resampler per session, so the 1 s units join without a
    click; the resampler holds a few milliseconds back, which :meth:`flush` returns at the end of a
    reply (and :meth:`reset` drops, on a cancel), so no reply's tail starts the next one."""

    def __init__(self, kind: str = "pcm16"):
        if kind not in OUTPUT_KINDS:
            raise ValueError(f"unknown output audio kind {kind!r} (known: {', '.join(OUTPUT_KINDS)})")
        if kind != "pcm16" and audioop is None:  # pragma: no cover - depends on the Python version
            raise ValueError("G.711 output needs the audioop-lts package on this Python")
        self.kind = kind
        self.rate = OUTPUT_RATE if kind == "pcm16" else G711_RATE
        self.bytes_per_second = PCM16_OUTPUT_BYTES_PER_SECOND if kind == "pcm16" else G711_RATE  # 1 byte a sample
        self._resampler: soxr.ResampleStream | None = None
        self.reset()

    def encode(self, pcm16: bytes) -> bytes:
        """24 kHz pcm16 from the engine -> this stream's bytes ready now (may be empty for G.711)."""
        if self._resampler is None:
            return pcm16
        return self._g711(self._resampler.resample_chunk(np.frombuffer(pcm16, dtype="<i2"), last=False))

    def flush(self) -> bytes:
        """What the resampler still holds (the end of a reply); the stream starts afresh after it."""
        if self._resampler is None:
            return b""
        tail = self._resampler.resample_chunk(np.zeros(0, dtype=np.int16), last=True)
        self.reset()
        return self._g711(tail)

    def reset(self) -> None:
        """Drop what the resampler holds (a cancelled reply)."""
        self._resampler = (None if self.kind == "pcm16"
                           else soxr.ResampleStream(OUTPUT_RATE, G711_RATE, 1, dtype="int16", quality="HQ"))

    def _g711(self, pcm: np.ndarray) -> bytes:
        linear = np.ascontiguousarray(pcm, dtype="<i2").tobytes()
        return audioop.lin2ulaw(linear, 2) if self.kind == "pcmu" else audioop.lin2alaw(linear, 2)
