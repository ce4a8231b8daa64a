"""Per-voice prompt state, computed once and shared read-only by every session of the voice.

The setup pass over a voice prompt (conformer + estimator over the prompt tokens and mel) gives a
`PromptState`. With `cfm_prompt_att_sharing` on, the rows produced for several sessions of one
voice in one batch are compared with `torch.equal` before they are deduplicated into one shared
state; if any row differs, every session keeps its own row (ordinary per-session tensors), a
warning is logged and `fallbacks` counts it. Shared states are ref-counted and freed by
`evict_prompt` when their last session ends.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VoicePrompt:
    """A voice's prompt inputs (what Token2wav._prepare_prompt yields)."""

    tokens: torch.Tensor   # (T,) prompt speech tokens, without the lookahead pad
    mel: torch.Tensor      # (P, mel_bins), P = T * up_rate
    spk: torch.Tensor      # (spk_embed_dim,) speaker x-vector

    @property
    def num_frames(self) -> int:
        return self.mel.shape[0]


@dataclass
class PromptState:
    """Setup-pass result for one voice prompt. Read-only once published: sessions replace, never
    write, these tensors."""

    spk: torch.Tensor            # (mel_bins,) normalized + projected x-vector
    conformer_cnn: torch.Tensor  # (1, C, 2 + 2 * up_stride)
    conformer_att: torch.Tensor  # (blocks, 1, heads, P, 2 * d_k)
    estimator_cnn: torch.Tensor  # (steps, depth, 2, 2H, 2)
    estimator_att: torch.Tensor  # (steps, depth, 2, heads, P, 2 * head_dim)

    @property
    def num_frames(self) -> int:
        return self.estimator_att.shape[4]

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def equal(self, other: "PromptState") -> bool:
        return all(torch.equal(a, b) for a, b in zip(self.tensors(), other.tensors()))


@dataclass
class _Entry:
    state: PromptState
    ref_count: int   # sessions holding `state`; only the registry changes it


class PromptRegistry:
    """Voice name -> prompt inputs, and voice name -> shared prompt state (ref-counted)."""

    def __init__(self, sharing: bool) -> None:
        self.sharing = sharing
        self._voices: dict[str, VoicePrompt] = {}
        self._shared: dict[str, _Entry] = {}
        self.fallbacks = 0    # batches whose rows diverged and were kept per session
        self.hits = 0         # sessions that reused an existing shared state

    # ---- voices ----------------------------------------------------------------------
    def register_voice(self, name: str, prompt: VoicePrompt) -> None:
        if name in self._voices:
            raise ValueError(f"voice {name!r} is already registered")
        self._voices[name] = prompt

    def voice(self, name: str) -> VoicePrompt:
        try:
            return self._voices[name]
        except KeyError:
            raise ValueError(f"unknown voice {name!r}") from None

    def has_voice(self, name: str) -> bool:
        return name in self._voices

    # ---- shared states ----------------------------------------------------------------
    def acquire(self, voice: str) -> PromptState | None:
        """The voice's shared state with one more reference, or None if there is none."""
        entry = self._shared.get(voice)
        if entry is None:
            return None
        entry.ref_count += 1
        self.hits += 1
        return entry.state

    def publish(self, voice: str, rows: list[PromptState]) -> tuple[list[PromptState], bool]:
        """Rows computed in one batch for sessions of `voice` -> (state per session, shared?).

        Sharing on and every row equal to the first: one shared state, referenced len(rows)
        times. Otherwise (sharing off, or divergence) each session keeps its own row.
        """
        if not rows:
            raise ValueError("publish needs at least one row")
        if voice in self._shared:
            raise ValueError(f"voice {voice!r} already has a shared prompt state")
        if not self.sharing:
            return rows, False
        if not all(rows[0].equal(r) for r in rows[1:]):
            self.fallbacks += 1
            logger.warning(
                "prompt state rows of voice %r differ across %d sessions of one batch; "
                "keeping per-session tensors (fallback #%d)", voice, len(rows), self.fallbacks)
            return rows, False
        self._shared[voice] = _Entry(rows[0], ref_count=len(rows))
        return [rows[0]] * len(rows), True

    def release(self, voice: str) -> None:
        """Drop one reference; the last one evicts the voice's prompt state."""
        entry = self._shared.get(voice)
        assert entry is not None and entry.ref_count > 0, f"release of voice {voice!r} without a reference"
        entry.ref_count -= 1
        if entry.ref_count == 0:
            self.evict_prompt(voice)

    def evict_prompt(self, voice: str) -> None:
        entry = self._shared.get(voice)
        if entry is None:
            return
        if entry.ref_count:
            raise ValueError(f"voice {voice!r} still has {entry.ref_count} sessions")
        del self._shared[voice]
        logger.debug("evicted prompt state of voice %r", voice)

    def shared_state(self, voice: str) -> PromptState | None:
        entry = self._shared.get(voice)
        return None if entry is None else entry.state

    def ref_count(self, voice: str) -> int:
        entry = self._shared.get(voice)
        return 0 if entry is None else entry.ref_count

    def shared_bytes(self, voice: str) -> int:
        state = self.shared_state(voice)
        return 0 if state is None else state.nbytes()
