"""Grouping of sessions into batched conformer / vocoder calls, and the counters that show it.

The conformer and the HiFT vocoder have no per-row cache lengths (no masks): rows batch only when
their caches and chunks have equal shapes. Sessions are therefore grouped by a shape key and each
group runs as one call; the conformer's key is the chunk's shape only, and inside a call its
attention runs once per cache length (a segment). At steady state (full chunks) a step is one
conformer call and one vocoder call whatever the batch size, with one segment per voice prompt
length and per stream age below the trim (a stream's first two chunks).
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


def group_by(items: Iterable[T], key: Callable[[T], Hashable]) -> list[list[T]]:
    """Items with equal keys, in order of each key's first item; items keep their order inside
    a group (so a batch's row order follows the caller's session order)."""
    groups: dict[Hashable, list[T]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return list(groups.values())


@dataclass
class BatchStats:
    """How the per-step conformer and vocoder work was batched. Only `BatchedCode2Wav` writes it.

    Counters are cumulative; `last_*_groups` list the session ids of each batched call of the
    latest `step` (one tuple per call, rows in order).
    """

    steps: int = 0
    prompt_passes: int = 0           # voice prompt setup passes (one per registered voice)
    prompt_passes_per_voice: dict[str, int] = field(default_factory=dict)
    stream_starts: int = 0           # streams opened from a voice's state (no pass, no model call)
    conformer_calls: int = 0         # batched chunk calls
    conformer_segments: int = 0      # attention segments inside them (one per cache length)
    conformer_rows: int = 0
    vocoder_calls: int = 0
    vocoder_rows: int = 0
    last_conformer_groups: tuple[tuple[str, ...], ...] = field(default=())
    last_vocoder_groups: tuple[tuple[str, ...], ...] = field(default=())

    def record_prompt_pass(self, voice: str) -> None:
        self.prompt_passes += 1
        self.prompt_passes_per_voice[voice] = self.prompt_passes_per_voice.get(voice, 0) + 1

    def record_step(self, conformer: list[list[str]], vocoder: list[list[str]], conformer_segments: int) -> None:
        self.steps += 1
        self.conformer_calls += len(conformer)
        self.conformer_segments += conformer_segments
        self.conformer_rows += sum(map(len, conformer))
        self.vocoder_calls += len(vocoder)
        self.vocoder_rows += sum(map(len, vocoder))
        self.last_conformer_groups = tuple(tuple(g) for g in conformer)
        self.last_vocoder_groups = tuple(tuple(g) for g in vocoder)
