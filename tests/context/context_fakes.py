"""Fakes shared by the context tests: a counting reference-audio encoder and its state."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from duplexcache.context import EmbeddingResult, EncoderPath

HIDDEN = 8
SAMPLES_PER_EMBEDDING = 1600  # 10 embeddings per second at 16 kHz


@dataclass
class FakeEncoderState:
    """Stand-in for a session's streaming encoder state (e.g. its KV length)."""

    frames_seen: int = 0
    replays: int = 0


@dataclass
class StreamingRecord:
    """The encoder's record of what a streaming encode did to a state; replayable."""

    frames: int
    applied_to: list = field(default_factory=list)

    def __call__(self, state: FakeEncoderState) -> None:
        state.frames_seen += self.frames
        state.replays += 1
        self.applied_to.append(state)


class CountingEncoder:
    """Deterministic encoder: each 100 ms of audio -> one (HIDDEN,) embedding via a seeded matrix."""

    def __init__(self, streaming: bool, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.proj = torch.randn(SAMPLES_PER_EMBEDDING, HIDDEN, generator=gen)
        self.streaming = streaming
        self.calls = 0

    def expected(self, audio: torch.Tensor) -> torch.Tensor:
        n = audio.numel() // SAMPLES_PER_EMBEDDING
        return audio[: n * SAMPLES_PER_EMBEDDING].reshape(n, SAMPLES_PER_EMBEDDING) @ self.proj

    def __call__(self, audio: torch.Tensor, state: FakeEncoderState | None) -> EmbeddingResult:
        self.calls += 1
        emb = self.expected(audio)
        if not self.streaming:
            return EmbeddingResult(emb, EncoderPath.WHOLE_CLIP)
        record = StreamingRecord(frames=audio.numel() // 160)  # 50 frames/s
        # The live encode advances the session's state itself (not via the record).
        state.frames_seen += record.frames
        return EmbeddingResult(emb, EncoderPath.STREAMING, record)


def make_embedding(vocab: int = 151_800, seed: int = 0) -> torch.nn.Embedding:
    torch.manual_seed(seed)
    return torch.nn.Embedding(vocab, HIDDEN)


def make_audio(seconds: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(int(seconds * 16_000), generator=gen) * 2 - 1) * 0.5
