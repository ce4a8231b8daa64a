"""The voices' estimator prompt states on one frame axis (``PromptBank``), which the Euler arena
(cfm/arena.py) reads in place: every voice's prompt keys at a fixed address a captured graph can
read, stored once whatever the number of streams using the voice."""

from __future__ import annotations

import torch

from duplexcache.cfm.prompt_cache import FRAME_DIM


class PromptBank:
    """The voices' estimator prompt states, packed on one frame axis so a graph can read any voice.

    frames (steps, depth, cfg=2, heads, F, 2*head_dim); voice v owns frames [off_v, off_v + P_v)
    and `add` returns that slice as the voice's `PromptState.estimator_att` (a view: the state
    is stored once). Frame 0 is zeros and belongs to no voice: the arena's frame map points
    private and padding keys at it, so they read finite values.

    `capacity` frames (zero frame included) are allocated up front: the engine passes the sum of
    its voices' P + 1, so the address never changes and graphs captured at warm-up stay valid.
    A voice that does not fit grows (reallocates) `frames`; `version` counts reallocations so the
    arena can drop graphs that baked in the old address, and the owner re-points the voices'
    views (`view`).
    """

    def __init__(self, steps: int, depth: int, heads: int, head_dim: int, device: torch.device,
                 dtype: torch.dtype, capacity: int = 1) -> None:
        self.frames = torch.zeros(steps, depth, 2, heads, max(1, capacity), 2 * head_dim, device=device,
                                  dtype=dtype)
        self._slots: dict[str, tuple[int, int]] = {}   # voice -> (offset, frames)
        self.version = 0

    @property
    def num_frames(self) -> int:
        return self.frames.shape[FRAME_DIM]

    def offset(self, name: str) -> int:
        return self._slots[name][0]

    def view(self, name: str) -> torch.Tensor:
        off, n = self._slots[name]
        return self.frames.narrow(FRAME_DIM, off, n)

    def _free_offset(self, n: int) -> int | None:
        """First gap of n frames between slots (left by `remove`), or None."""
        pos = 1
        for off, m in sorted(set(self._slots.values())):   # an alias shares its target's slot
            if off - pos >= n:
                return pos
            pos = off + m
        return pos if self.num_frames - pos >= n else None

    def add(self, name: str, att: torch.Tensor) -> torch.Tensor:
        """Store a voice's prompt state att (steps, depth, 2, heads, P, 2hd); return its view."""
        if name in self._slots:
            raise ValueError(f"voice {name!r} already in the prompt bank")
        n = att.shape[FRAME_DIM]
        off = self._free_offset(n)
        if off is None:
            off = self.num_frames
            grown = self.frames.new_zeros(*self.frames.shape[:FRAME_DIM], off + n, self.frames.shape[-1])
            grown.narrow(FRAME_DIM, 0, off).copy_(self.frames)
            self.frames = grown
            self.version += 1
        self._slots[name] = (off, n)
        dst = self.frames.narrow(FRAME_DIM, off, n)
        dst.copy_(att)
        return dst

    def alias(self, name: str, target: str) -> None:
        """``name`` reads ``target``'s frames (an equal prompt state); the frames stay taken while
        either name holds them."""
        if name in self._slots:
            raise ValueError(f"voice {name!r} already in the prompt bank")
        self._slots[name] = self._slots[target]

    def remove(self, name: str) -> None:
        """Forget a voice; its frames become a gap the next `add` may reuse (no reallocation, so
        no graph is invalidated)."""
        del self._slots[name]

    def nbytes(self) -> int:
        return self.frames.numel() * self.frames.element_size()

    def voice_nbytes(self) -> int:
        """Bytes of the frames that registered voices own (their prompt states' estimator part)."""
        per_frame = self.nbytes() // self.num_frames
        return per_frame * sum(n for _, n in set(self._slots.values()))   # an alias's frames once
