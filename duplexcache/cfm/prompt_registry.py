"""Per-voice prompt state, computed once when the voice is registered and kept as long as it is.

The setup pass over a voice prompt (conformer + estimator over the prompt tokens and mel) gives a
`PromptState`. `BatchedCode2Wav.register_voice` runs it once and hands it to the registry, which
keeps it until `unregister_voice`; a stream (one per audio turn) never runs it. With
`cfm_prompt_att_sharing` on, a stream takes views of the state; with it off, a private copy. Either
way the registry counts the streams of each voice (`ref_count`), so a voice in use cannot be
removed. Nothing is evicted when a voice has no stream: the next turn must not pay the pass again.
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
    """Setup-pass result for one voice prompt. Read-only once registered: streams replace, never
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
class _Voice:
    prompt: VoicePrompt
    state: PromptState
    streams: int = 0   # live streams of this voice; only the registry changes it
    alias_of: str | None = None   # the voice whose state this one shares (same prompt inputs)


class PromptRegistry:
    """Voice name -> prompt inputs and prompt state, with the number of streams using each."""

    def __init__(self, sharing: bool) -> None:
        self.sharing = sharing
        self._voices: dict[str, _Voice] = {}

    # ---- voices ----------------------------------------------------------------------
    def register_voice(self, name: str, prompt: VoicePrompt, state: PromptState) -> None:
        if name in self._voices:
            raise ValueError(f"voice {name!r} is already registered")
        self._voices[name] = _Voice(prompt, state)

    def same_prompt(self, prompt: VoicePrompt) -> str | None:
        """A registered voice (not itself an alias) whose prompt inputs equal ``prompt``'s, bit
        for bit: its setup pass gave the state ``prompt`` would get (the pass runs alone, batch
        1, so its bits depend on the inputs only)."""
        if prompt.tokens.is_meta:   # shapes-only engines (memory plans) have no values to compare
            return None
        for name, entry in self._voices.items():
            p = entry.prompt
            if entry.alias_of is None and p.tokens.shape == prompt.tokens.shape and p.mel.shape == prompt.mel.shape \
                    and torch.equal(p.tokens, prompt.tokens) and torch.equal(p.mel, prompt.mel) \
                    and torch.equal(p.spk, prompt.spk):
                return name
        return None

    def register_alias(self, name: str, target: str) -> None:
        """Register ``name`` as sharing ``target``'s prompt inputs and state (no setup pass, no
        bytes). Its streams are counted under its own name."""
        if name in self._voices:
            raise ValueError(f"voice {name!r} is already registered")
        entry = self._entry(target)
        self._voices[name] = _Voice(entry.prompt, entry.state, alias_of=target)

    def alias_of(self, name: str) -> str | None:
        return self._entry(name).alias_of

    def unregister_voice(self, name: str) -> None:
        """Forget the voice and free its prompt state; refused while a stream uses it."""
        entry = self._entry(name)
        if entry.streams:
            raise ValueError(f"voice {name!r} still has {entry.streams} streams")
        del self._voices[name]
        # The state outlives its first owner while an alias holds it: the oldest alias owns it now.
        heirs = [n for n, e in self._voices.items() if e.alias_of == name]
        for n in heirs:
            self._voices[n].alias_of = heirs[0] if n != heirs[0] else None
        logger.debug("unregistered voice %r (%d prompt-state bytes freed)", name, entry.state.nbytes())

    def _entry(self, name: str) -> _Voice:
        try:
            return self._voices[name]
        except KeyError:
            raise ValueError(f"unknown voice {name!r}") from None

    def voice(self, name: str) -> VoicePrompt:
        return self._entry(name).prompt

    def state(self, name: str) -> PromptState:
        """The voice's prompt state (read-only)."""
        return self._entry(name).state

    def has_voice(self, name: str) -> bool:
        return name in self._voices

    def names(self) -> list[str]:
        return list(self._voices)

    # ---- streams -----------------------------------------------------------------------
    def acquire(self, name: str) -> PromptState:
        """The voice's state, counting one more stream of the voice."""
        entry = self._entry(name)
        entry.streams += 1
        return entry.state

    def release(self, name: str) -> None:
        """One stream of the voice ended. The state stays (it lives as long as the voice)."""
        entry = self._entry(name)
        assert entry.streams > 0, f"release of voice {name!r} without a stream"
        entry.streams -= 1

    def ref_count(self, name: str) -> int:
        """Live streams of the voice (0 for an unknown voice)."""
        entry = self._voices.get(name)
        return 0 if entry is None else entry.streams

    def state_bytes(self, name: str) -> int:
        """Bytes of the voice's prompt state (0 for an unknown voice, and for an alias: the bytes
        are its target's, counted once there)."""
        entry = self._voices.get(name)
        return 0 if entry is None or entry.alias_of is not None else entry.state.nbytes()
