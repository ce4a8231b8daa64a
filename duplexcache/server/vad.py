"""Server-side voice activity detection: Silero VAD run through onnxruntime on the CPU.

The model comes from the ``silero-vad`` package (MIT), which ships ``silero_vad.onnx`` in its
data; we locate the file through the package's installed metadata, so neither the package's
torch code nor any network is touched at run time.

Streaming layout (16 kHz): the model scores fixed windows of 512 samples (32 ms) and needs the
64 samples before each window as context; its recurrent state (2, 1, 128) carries across windows.

    stream:   |<-- w0 (512) -->|<-- w1 (512) -->|<-- w2 ...
    model in:  [ctx 64][ w0 ]     [ctx=w0[-64:]][ w1 ] ...    (ctx of w0 = 64 zeros)

``feed`` buffers whatever does not fill a window, so the windows (and so the events) are the
same however the stream is chunked.

Events follow OpenAI's ``server_vad``: speech starts at the first window whose probability is
>= ``threshold``; ``speech_started.audio_ms`` is that window's start minus ``prefix_padding_ms``
(not before 0). A pause starts at a window below ``threshold - 0.15`` (the hysteresis Silero's
own iterator uses) and is cancelled by a window >= ``threshold``; speech stops at the first
window below ``threshold - 0.15`` that ends ``silence_duration_ms`` or more after the pause began.
``speech_stopped.audio_ms`` is that window's end, so it includes ``silence_duration_ms`` as
OpenAI's ``audio_end_ms`` does.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

logger = logging.getLogger(__name__)

SAMPLE_RATE = 16_000
WINDOW = 512             # samples the model scores at once at 16 kHz (32 ms)
CONTEXT = 64             # samples of the previous window the model sees before each window
STATE_SHAPE = (2, 1, 128)
HYSTERESIS = 0.15        # speech continues until the probability falls this far below threshold
_MODEL_FILE = "silero_vad/data/silero_vad.onnx"
_MODEL_DIST = "silero-vad"


class VadModelMissing(RuntimeError):
    """The silero-vad package (which ships the ONNX model) is not installed."""


@dataclass(frozen=True)
class VadEvent:
    kind: Literal["speech_started", "speech_stopped"]
    audio_ms: int  # milliseconds since the stream's first sample


def model_path() -> Path:
    """Where the installed ``silero-vad`` package keeps ``silero_vad.onnx``."""
    try:
        dist = importlib.metadata.distribution(_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise VadModelMissing("server VAD needs the 'silero-vad' package (pip install silero-vad); "
                              "it ships the Silero ONNX model") from None
    path = Path(str(dist.locate_file(_MODEL_FILE)))
    if not path.is_file():
        raise VadModelMissing(f"silero-vad {dist.version} has no {_MODEL_FILE} at {path}")
    return path


@functools.lru_cache(maxsize=1)
def _session():  # -> onnxruntime.InferenceSession
    """One inference session for the process: run() is thread-safe and the graph holds no state
    (the recurrent state is an input), so every stream shares it."""
    import onnxruntime  # imported here: only servers with VAD on need it

    opts = onnxruntime.SessionOptions()
    # One window is a few kFLOPs: threads would cost more than they save and steal the tick's cores.
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    path = model_path()
    logger.info("loading Silero VAD from %s", path)
    return onnxruntime.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


class SileroVAD:
    """Speech start/stop events for one 16 kHz mono stream. Not thread-safe: one per session."""

    def __init__(self, threshold: float = 0.5, silence_duration_ms: int = 500, prefix_padding_ms: int = 300):
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {threshold}")
        if silence_duration_ms < 0 or prefix_padding_ms < 0:
            raise ValueError(f"silence_duration_ms ({silence_duration_ms}) and prefix_padding_ms "
                             f"({prefix_padding_ms}) must be >= 0")
        self.threshold = float(threshold)
        self.silence_duration_ms = int(silence_duration_ms)
        self.prefix_padding_ms = int(prefix_padding_ms)
        self._session = _session()
        self.reset()

    def reset(self) -> None:
        """Forget the stream: state, context, buffered samples, position and speech flag."""
        self._state = np.zeros(STATE_SHAPE, dtype=np.float32)
        self._context = np.zeros(CONTEXT, dtype=np.float32)
        self._pending = np.zeros(0, dtype=np.float32)
        self._windows_done = 0          # windows scored since the stream began
        self._speaking = False
        self._silence_start: int | None = None  # sample where the current run of silence began

    @property
    def speaking(self) -> bool:
        return self._speaking

    def feed(self, pcm: np.ndarray) -> list[VadEvent]:
        """Score every whole window ``pcm`` completes; return the events they cause, in order."""
        pcm = _check_pcm(pcm)
        buf = np.concatenate([self._pending, pcm]) if self._pending.size else pcm
        whole = buf.size - buf.size % WINDOW
        events: list[VadEvent] = []
        for start in range(0, whole, WINDOW):
            prob = self._score(buf[start:start + WINDOW])
            event = self._step(prob)
            if event is not None:
                events.append(event)
        self._pending = buf[whole:].copy()
        return events

    def _score(self, window: np.ndarray) -> float:
        x = np.concatenate([self._context, window])[None, :]  # (1, CONTEXT + WINDOW)
        out, self._state = self._session.run(
            None, {"input": x, "state": self._state, "sr": np.array(SAMPLE_RATE, dtype=np.int64)})
        self._context = window[-CONTEXT:].copy()
        return float(out[0, 0])

    def _step(self, prob: float) -> VadEvent | None:
        """Advance one window; the state machine of OpenAI's server_vad with Silero's hysteresis."""
        start = self._windows_done * WINDOW
        end = start + WINDOW
        self._windows_done += 1
        if not self._speaking:
            if prob >= self.threshold:
                self._speaking = True
                self._silence_start = None
                return VadEvent("speech_started", max(0, _ms(start) - self.prefix_padding_ms))
            return None
        if prob >= self.threshold:
            self._silence_start = None  # speech resumed: the pause does not count
            return None
        if prob >= self.threshold - HYSTERESIS:
            return None  # unsure: neither resets a pause nor ends speech (it still counts as pause time)
        if self._silence_start is None:
            self._silence_start = start
        if _ms(end - self._silence_start) >= self.silence_duration_ms:
            self._speaking = False
            self._silence_start = None
            return VadEvent("speech_stopped", _ms(end))
        return None


def _ms(samples: int) -> int:
    return samples * 1000 // SAMPLE_RATE


def _check_pcm(pcm: np.ndarray) -> np.ndarray:
    if not isinstance(pcm, np.ndarray):
        raise TypeError(f"pcm must be a numpy array, got {type(pcm).__name__}")
    if pcm.ndim != 1:
        raise ValueError(f"pcm must be 1-D mono samples, got shape {pcm.shape}")
    if pcm.dtype != np.float32:
        raise ValueError(f"pcm must be float32 in [-1, 1], got {pcm.dtype}")
    if not np.isfinite(pcm).all():
        raise ValueError("pcm has non-finite samples")
    return pcm
