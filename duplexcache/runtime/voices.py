"""Named voices: what a session's ``voice`` field selects.

A voice has two halves, used by two stages:

* ``ref_audio`` (16 kHz float32 mono): the reference recording. Its audio-encoder embeddings
  (10 per second) sit in the Thinker's session context between ``<|audio_start|>`` and
  ``<|audio_end|>``, so sessions of one voice share one context (and, with
  ``shared_anchor_blocks``, its KV blocks).
* the Code2Wav prompt: ``prompt_tokens`` (T,) speech tokens, ``prompt_mel`` (2T, 80) and
  ``spk`` (192,) speaker embedding. The prompt setup pass over them gives the per-voice prompt
  state that ``cfm_prompt_att_sharing`` stores once per voice.

Random weights (no checkpoint): :func:`synthetic_voice` makes a voice deterministically from its
name (the seed is sha256 of the name), so "default" is the same voice on every machine and every
run. A checkpoint directory may ship real voices as ``<checkpoint_dir>/voices/<name>.safetensors``
with the four tensors ``ref_audio``, ``prompt_tokens``, ``prompt_mel``, ``spk``
(:meth:`VoiceRegistry.load_dir`); they replace synthetic voices of the same name.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

REF_SAMPLE_RATE = 16_000
TOKENS_PER_SECOND = 25       # speech tokens per second (Talker / Code2Wav)
MEL_FRAMES_PER_TOKEN = 2     # the flow upsamples tokens x2 -> 50 mel frames per second
SPK_EMBED_DIM = 192
MEL_BINS = 80
VOICE_TENSORS = ("ref_audio", "prompt_tokens", "prompt_mel", "spk")


@dataclass(frozen=True)
class Voice:
    """One voice. Tensors are CPU and read-only by convention (stages copy what they keep)."""

    name: str
    ref_audio: torch.Tensor      # (S,) float32 in [-1, 1], 16 kHz
    prompt_tokens: torch.Tensor  # (T,) int64 speech tokens
    prompt_mel: torch.Tensor     # (T * 2, 80) float32
    spk: torch.Tensor            # (192,) float32

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"voice name must be a non-empty string, got {self.name!r}")
        a, t, m, s = self.ref_audio, self.prompt_tokens, self.prompt_mel, self.spk
        if a.dim() != 1 or a.dtype != torch.float32 or a.numel() == 0:
            raise ValueError(f"voice {self.name!r}: ref_audio must be float32 (samples,), got "
                             f"{a.dtype} {tuple(a.shape)}")
        if t.dim() != 1 or t.dtype != torch.long or t.numel() == 0:
            raise ValueError(f"voice {self.name!r}: prompt_tokens must be int64 (T,), got {t.dtype} {tuple(t.shape)}")
        if m.dim() != 2 or m.shape[0] != t.numel() * MEL_FRAMES_PER_TOKEN:
            raise ValueError(f"voice {self.name!r}: prompt_mel {tuple(m.shape)} must be "
                             f"({t.numel() * MEL_FRAMES_PER_TOKEN}, bins)")
        if s.dim() != 1:
            raise ValueError(f"voice {self.name!r}: spk must be 1-D, got {tuple(s.shape)}")

    @property
    def prompt_frames(self) -> int:
        """P: mel frames of the Code2Wav prompt."""
        return self.prompt_mel.shape[0]

    @property
    def ref_seconds(self) -> float:
        return self.ref_audio.numel() / REF_SAMPLE_RATE

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ref_audio, self.prompt_tokens, self.prompt_mel, self.spk))


def _seed_of(name: str) -> int:
    return int.from_bytes(hashlib.sha256(b"duplexcache.voice.v1\0" + name.encode("utf-8")).digest()[:8], "little")


def synthetic_voice(name: str, ref_seconds: float = 1.0, prompt_seconds: float = 2.4,
                    speech_vocab: int = 6561) -> Voice:
    """A deterministic voice for random weights: seeded from ``name`` only.

    The reference audio is a few harmonics of a name-dependent pitch plus a little noise
    (peak 0.5), so it is valid normalized PCM; the prompt tokens, mel and speaker embedding are
    seeded normals / integers. ``prompt_seconds`` sets P = 50 frames per second.
    """
    if ref_seconds <= 0 or prompt_seconds <= 0:
        raise ValueError(f"ref_seconds and prompt_seconds must be > 0, got {ref_seconds}, {prompt_seconds}")
    gen = torch.Generator().manual_seed(_seed_of(name))
    n = int(round(ref_seconds * REF_SAMPLE_RATE))
    t = torch.arange(n, dtype=torch.float64) / REF_SAMPLE_RATE
    pitch = 100.0 + 150.0 * float(torch.rand((), generator=gen, dtype=torch.float64))
    wave = sum(math.pow(0.5, h) * torch.sin(2 * math.pi * pitch * (h + 1) * t) for h in range(4))
    noise = 0.05 * torch.randn(n, generator=gen, dtype=torch.float64)
    audio = wave + noise
    audio = (0.5 * audio / audio.abs().max()).to(torch.float32)
    num_tokens = int(round(prompt_seconds * TOKENS_PER_SECOND))
    tokens = torch.randint(0, speech_vocab, (num_tokens,), generator=gen)
    mel = torch.randn(num_tokens * MEL_FRAMES_PER_TOKEN, MEL_BINS, generator=gen)
    spk = torch.randn(SPK_EMBED_DIM, generator=gen)
    return Voice(name, audio, tokens, mel, spk)


class VoiceRegistry:
    """Voice name -> :class:`Voice`. Filled at engine start; read-only while serving."""

    def __init__(self, voices: list[Voice] | None = None) -> None:
        self._voices: dict[str, Voice] = {}
        # Voices made from a client's reference recording (runtime/reference_voices.py): usable
        # by the sessions that sent the recording, never listed, so no other client learns of
        # them or asks for them by name (names() feeds /v1/voices and session.update's check).
        self._unlisted: set[str] = set()
        for v in voices or []:
            self.add(v)

    def add(self, voice: Voice, replace: bool = False, listed: bool = True) -> None:
        if voice.name in self._voices and not replace:
            raise ValueError(f"voice {voice.name!r} is already registered")
        if not listed:
            self._unlisted.add(voice.name)
        self._voices[voice.name] = voice

    def remove(self, name: str) -> None:
        """Forget a voice (a client's reference voice that no session holds any more)."""
        self._voices.pop(name, None)
        self._unlisted.discard(name)

    def get(self, name: str) -> Voice:
        try:
            return self._voices[name]
        except KeyError:
            raise ValueError(f"unknown voice {name!r} (known: {', '.join(sorted(self.names()))})") from None

    def __contains__(self, name: object) -> bool:
        return name in self._voices

    def __len__(self) -> int:
        return len(self._voices)

    def names(self) -> list[str]:
        """The server's voices, those a client may name (reference voices are not listed)."""
        return [name for name in list(self._voices) if name not in self._unlisted]

    @classmethod
    def synthetic(cls, names: tuple[str, ...] = ("default", "alt"), **kwargs) -> VoiceRegistry:
        return cls([synthetic_voice(n, **kwargs) for n in names])

    def load_dir(self, path: str | Path) -> int:
        """Add (replacing same-named) voices from ``path/*.safetensors``; returns how many."""
        from safetensors.torch import load_file

        directory = Path(path)
        if not directory.is_dir():
            raise ValueError(f"voice directory {str(directory)!r} does not exist")
        count = 0
        for file in sorted(directory.glob("*.safetensors")):
            tensors = load_file(str(file))
            missing = [k for k in VOICE_TENSORS if k not in tensors]
            if missing:
                raise ValueError(f"voice file {file} lacks tensors {missing} (needs {', '.join(VOICE_TENSORS)})")
            self.add(Voice(file.stem, tensors["ref_audio"].float(), tensors["prompt_tokens"].long(),
                           tensors["prompt_mel"].float(), tensors["spk"].float()), replace=True)
            count += 1
        logger.info("loaded %d voices from %s", count, directory)
        return count
