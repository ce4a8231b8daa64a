"""A session's estimator attention cache as private delta frames + views of the voice prompt.

Shape of one session's cache: (steps, layers, cfg=2, heads, frames, 2*head_dim); K and V side by
side on the last axis. The frame axis is `FRAME_DIM`.

Two classes with one interface:

* `SharedPromptAttCache`: private delta (newest first) + read-only views of the per-voice prompt
  tensor. Never builds the concatenation except in `materialize()`, which exists only for eager
  fallbacks and debugging.
* `PlainAttCache`: one ordinary private tensor (sharing off, or a verification fallback). It
  follows the reference trim literally (slices + cat).

Both report the same layout (`num_delta`, `head`, `trimmed`, `num_prompt`, `tail`): the arena
copies only the private delta into its row (`copy_private_to`) and reads the prompt frames from
the voice's slot of its `PromptBank` (for `PlainAttCache` those frames are bit-identical copies of
the voice's, so reading the bank instead of the copy changes no value).
"""
from __future__ import annotations

import torch

FRAME_DIM = 4


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class SharedPromptAttCache:
    """Estimator attention cache of one session, sharing the voice prompt's frames.

    Reference semantics (Token2wav.stream + DiT attention): the setup pass gives P prompt frames;
    each chunk's keys are `[new W frames | cache]`; after a chunk, if the cache is longer than
    P + tail (tail = 100), keep its first P entries and its last `tail` entries. With P >= tail the
    last `tail` entries are always prompt[P-tail:P], so the logical cache is always

        [ delta (d, private, newest first) | prompt[0:h] view | prompt[P-tail:P] view ]
                                                                ^ only once trimmed
        with  h = P           before the first trim (d <= tail),
              h = P - d       after it (d grows by W per chunk until d = P, then h = 0).

    Example, P = 300, tail = 100, W = 50 frames per chunk (n_k = frames of chunk k):

        setup      |<------------- prompt[0:300] ------------->|                   d=0   len 300
        chunk 1    |n1|<------------ prompt[0:300] ------------>|                  d=50  len 350
        chunk 2    |n2|n1|<---------- prompt[0:300] ----------->|                  d=100 len 400
        chunk 3    |n3|n2|n1|<-- prompt[0:150] -->|<prompt[200:300]>|              d=150 len 400
        chunk 6    |n6|n5|n4|n3|n2|n1|            |<prompt[200:300]>|              d=300 len 400
        chunk 7    |n7|n6|n5|n4|n3|n2|            |<prompt[200:300]>|   (n1 dropped)
                   '------ private, P frames -----''-- shared, tail -'

    At setup the session owns nothing (d = 0); at steady state it owns P frames and shares `tail`.
    """

    def __init__(self, prompt: torch.Tensor, tail: int) -> None:
        if prompt.dim() != 6:
            raise ValueError(f"prompt att cache must be 6-D, got shape {tuple(prompt.shape)}")
        num_prompt = prompt.shape[FRAME_DIM]
        if num_prompt < tail:
            raise ValueError(f"prompt of {num_prompt} frames is shorter than the kept tail {tail}")
        self.prompt = prompt            # shared, read-only; owned by the prompt registry
        self.num_prompt = num_prompt    # P
        self.tail = tail
        self.delta: torch.Tensor | None = None   # private, newest frame first
        self.head = num_prompt          # h: prompt[0:h] follows the delta
        self.trimmed = False            # whether prompt[P-tail:P] ends the cache

    # ---- layout --------------------------------------------------------------------------
    @property
    def num_delta(self) -> int:
        return 0 if self.delta is None else self.delta.shape[FRAME_DIM]

    def __len__(self) -> int:
        return self.num_delta + self.head + (self.tail if self.trimmed else 0)

    def parts(self) -> list[torch.Tensor]:
        """The logical cache as a list of views, in key order (no copy)."""
        out = []
        if self.num_delta:
            out.append(self.delta)
        if self.head:
            out.append(self.prompt.narrow(FRAME_DIM, 0, self.head))
        if self.trimmed:
            out.append(self.prompt.narrow(FRAME_DIM, self.num_prompt - self.tail, self.tail))
        return out

    def copy_range_to(self, dst: torch.Tensor, start: int, length: int) -> None:
        """Copy logical frames [start, start + length) into `dst` (frame axis of size `length`).

        `dst` is usually a slice of a static arena buffer; this copies from each part straight
        into it: no concatenation and no allocation.
        """
        if start < 0 or length < 0 or start + length > len(self):
            raise ValueError(f"range [{start}, {start + length}) outside cache of {len(self)} frames")
        if dst.shape[FRAME_DIM] != length:
            raise ValueError(f"dst has {dst.shape[FRAME_DIM]} frames, expected {length}")
        pos = 0   # logical index of the current part's first frame
        for part in self.parts():
            n = part.shape[FRAME_DIM]
            lo, hi = max(start, pos), min(start + length, pos + n)
            if lo < hi:
                dst.narrow(FRAME_DIM, lo - start, hi - lo).copy_(part.narrow(FRAME_DIM, lo - pos, hi - lo))
            pos += n

    def copy_private_to(self, dst: torch.Tensor) -> None:
        """Copy the private delta (its `num_delta` newest frames) into `dst` (an arena row)."""
        if self.num_delta:
            dst.copy_(self.delta)

    def materialize(self) -> torch.Tensor:
        """Concatenated copy of the logical cache. Eager fallbacks only: the arena never calls it."""
        return torch.cat(self.parts(), dim=FRAME_DIM)

    # ---- update after a chunk -----------------------------------------------------------
    def advance(self, new_frames: int, src: torch.Tensor) -> None:
        """Apply one chunk: the cache becomes `[new | old]`, then the reference trim.

        `src` holds the chunk's post-attention cache in key order, `[new (W) | old ...]`, for at
        least the first min(W + d, P) frames (the arena's attention buffer for this row). Only the
        new private delta is copied out of it; the prompt views never move.
        """
        if new_frames < 1:
            raise ValueError(f"a chunk must add at least one frame, got {new_frames}")
        total = new_frames + len(self)
        if total > self.num_prompt + self.tail:
            num_delta = min(self.num_delta + new_frames, self.num_prompt)
            self.head = self.num_prompt - num_delta
            self.trimmed = True
        else:
            num_delta = self.num_delta + new_frames
        if src.shape[FRAME_DIM] < num_delta:
            raise ValueError(f"src has {src.shape[FRAME_DIM]} frames, need {num_delta}")
        # Reallocate only while the delta grows; at steady state (d = P) the buffer is reused.
        if self.delta is None or self.delta.shape[FRAME_DIM] != num_delta:
            shape = list(src.shape)
            shape[FRAME_DIM] = num_delta
            self.delta = torch.empty(shape, dtype=src.dtype, device=src.device)
        self.delta.copy_(src.narrow(FRAME_DIM, 0, num_delta))

    # ---- accounting --------------------------------------------------------------------
    def private_bytes(self) -> int:
        return _nbytes(self.delta)

    def shared_bytes(self) -> int:
        """Bytes of the prompt frames this session references (they are stored once per voice)."""
        frames = self.head + (self.tail if self.trimmed else 0)
        return frames * _nbytes(self.prompt) // self.num_prompt


class PlainAttCache:
    """An ordinary private cache tensor, trimmed exactly as Token2wav.stream does.

    `data` starts as a private copy of the voice's prompt frames; the layout counters
    (`num_delta`, `head`, `trimmed`) follow `SharedPromptAttCache`'s, so `data` always reads
    `[delta | prompt[0:head] | prompt[P-tail:P] if trimmed]`.
    """

    def __init__(self, data: torch.Tensor, num_prompt: int, tail: int) -> None:
        if data.dim() != 6:
            raise ValueError(f"att cache must be 6-D, got shape {tuple(data.shape)}")
        if data.shape[FRAME_DIM] != num_prompt:
            raise ValueError(f"a stream starts from the prompt's {num_prompt} frames, got "
                             f"{data.shape[FRAME_DIM]}")
        self.data = data
        self.num_prompt = num_prompt
        self.tail = tail
        self.num_delta = 0
        self.head = num_prompt
        self.trimmed = False

    def __len__(self) -> int:
        return self.data.shape[FRAME_DIM]

    def copy_range_to(self, dst: torch.Tensor, start: int, length: int) -> None:
        if start < 0 or length < 0 or start + length > len(self):
            raise ValueError(f"range [{start}, {start + length}) outside cache of {len(self)} frames")
        dst.copy_(self.data.narrow(FRAME_DIM, start, length))

    def copy_private_to(self, dst: torch.Tensor) -> None:
        if self.num_delta:
            dst.copy_(self.data.narrow(FRAME_DIM, 0, self.num_delta))

    def materialize(self) -> torch.Tensor:
        return self.data

    def advance(self, new_frames: int, src: torch.Tensor) -> None:
        """The reference step literally: keys `[new | cache]` (cat), then the trim. `src` starts
        with the chunk's `new_frames` new frames (the arena row; it holds no prompt frames)."""
        if new_frames < 1:
            raise ValueError(f"a chunk must add at least one frame, got {new_frames}")
        if src.shape[FRAME_DIM] < new_frames:
            raise ValueError(f"src has {src.shape[FRAME_DIM]} frames, need {new_frames}")
        full = torch.cat([src.narrow(FRAME_DIM, 0, new_frames), self.data], dim=FRAME_DIM)
        total = full.shape[FRAME_DIM]
        if total > self.num_prompt + self.tail:
            self.data = torch.cat([full.narrow(FRAME_DIM, 0, self.num_prompt),
                                   full.narrow(FRAME_DIM, total - self.tail, self.tail)], dim=FRAME_DIM)
            self.num_delta = min(self.num_delta + new_frames, self.num_prompt)
            self.head = self.num_prompt - self.num_delta
            self.trimmed = True
        else:
            self.data = full
            self.num_delta += new_frames

    def private_bytes(self) -> int:
        return _nbytes(self.data)

    def shared_bytes(self) -> int:
        return 0


AttCache = SharedPromptAttCache | PlainAttCache
