"""A session's estimator attention cache as private delta frames + views of the voice prompt.

Shape of one session's cache: (steps, layers, cfg=2, heads, frames, 2*head_dim); K and V side by
side on the last axis. The frame axis is `FRAME_DIM`.

Two classes with one interface:

* `SharedPromptAttCache`: private delta (newest first) + read-only views of the per-voice prompt
  tensor. The delta lives in a storage of P frames, allocated once at the first chunk and never
  shifted: a host list names each delta key's storage position, and a chunk writes only its W new
  frames (into never-used positions, then the positions of the keys the trim drops). Never builds
  the concatenation except in `materialize()`, which exists only for eager fallbacks and debugging.
* `PlainAttCache`: one ordinary private tensor (sharing off, or a verification fallback). It
  follows the reference trim literally (slices + cat); its delta is frames [0, d) of it, in order.

Both report the same layout (`num_delta`, `head`, `trimmed`, `num_prompt`, `tail`) and where the
delta's frames are (`private_frames`: a storage tensor and the position of each delta key): the
arena reads the delta in place from there and the prompt frames from the voice's slot of its
`PromptBank` (for `PlainAttCache` those frames are bit-identical copies of the voice's, so reading
the bank instead of the copy changes no value). Nothing copies the delta into an arena row.
"""
from __future__ import annotations

import torch

FRAME_DIM = 4


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def position_runs(positions: list[int]) -> list[tuple[int, int, int]]:
    """(key index, storage position, length) of each maximal run of consecutive positions, so a
    copy between key order and storage order is one narrow copy per run (usually one or two)."""
    runs: list[tuple[int, int, int]] = []
    for j, pos in enumerate(positions):
        if runs and runs[-1][1] + runs[-1][2] == pos:
            key, start, n = runs[-1]
            runs[-1] = (key, start, n + 1)
        else:
            runs.append((j, pos, 1))
    return runs


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

    Storage of the delta (`storage`, P frames, allocated at the first chunk): key j of the delta
    is frame `positions[j]` of it. A chunk of W frames takes W free positions, never-used ones
    first (frames [used, P)), then those of the old keys the trim drops (the oldest), and copies
    the new frames there; `positions` becomes [new positions | kept old positions]. So a chunk
    copies W frames, never the whole delta, and the storage never moves (the arena keeps its
    address in a table its graphs read). Before the delta reaches P frames, positions = [0, d)
    in chunk order; the trim then recycles the oldest chunk's frames.
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
        self.storage: torch.Tensor | None = None   # private, P frames once the first chunk came
        self.positions: list[int] = []  # storage frame of each delta key, newest key first
        self.used = 0                   # storage frames [used, P) were never written
        self.head = num_prompt          # h: prompt[0:h] follows the delta
        self.trimmed = False            # whether prompt[P-tail:P] ends the cache

    # ---- layout --------------------------------------------------------------------------
    @property
    def num_delta(self) -> int:
        return len(self.positions)

    @property
    def delta(self) -> torch.Tensor | None:
        """The delta in key order (a view when its positions are one ascending run, else a copy):
        references and tests only, the arena reads `private_frames`."""
        if not self.positions:
            return None
        runs = position_runs(self.positions)
        if len(runs) == 1:
            return self.storage.narrow(FRAME_DIM, runs[0][1], runs[0][2])
        return torch.cat([self.storage.narrow(FRAME_DIM, pos, n) for _, pos, n in runs], dim=FRAME_DIM)

    def private_frames(self) -> tuple[torch.Tensor, list[int]] | None:
        """(storage, positions): delta key j is frame positions[j] of storage (contiguous,
        (steps, layers, 2, heads, P, 2hd)); None while there is no delta."""
        return (self.storage, self.positions) if self.positions else None

    def __len__(self) -> int:
        return self.num_delta + self.head + (self.tail if self.trimmed else 0)

    def parts(self) -> list[torch.Tensor]:
        """The logical cache as a list of tensors, in key order: the delta (see `delta`), then
        views of the prompt (no copy)."""
        return ([self.delta] if self.positions else []) + self._prompt_parts()

    def _prompt_parts(self) -> list[torch.Tensor]:
        out = []
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
        # the delta's runs of storage frames, then the prompt views
        parts = [self.storage.narrow(FRAME_DIM, p, n) for _, p, n in position_runs(self.positions)]
        parts += self._prompt_parts()
        pos = 0   # logical index of the current part's first frame
        for part in parts:
            n = part.shape[FRAME_DIM]
            lo, hi = max(start, pos), min(start + length, pos + n)
            if lo < hi:
                dst.narrow(FRAME_DIM, lo - start, hi - lo).copy_(part.narrow(FRAME_DIM, lo - pos, hi - lo))
            pos += n

    def copy_private_to(self, dst: torch.Tensor) -> None:
        """Copy the private delta (its `num_delta` newest frames, key order) into `dst`. The
        arena never calls it (it reads `private_frames` in place); references and tests do."""
        for key, pos, n in position_runs(self.positions):
            dst.narrow(FRAME_DIM, key, n).copy_(self.storage.narrow(FRAME_DIM, pos, n))

    def materialize(self) -> torch.Tensor:
        """Concatenated copy of the logical cache. Eager fallbacks only: the arena never calls it."""
        return torch.cat(self.parts(), dim=FRAME_DIM)

    # ---- update after a chunk -----------------------------------------------------------
    def advance(self, new_frames: int, src: torch.Tensor) -> None:
        """Apply one chunk: the cache becomes `[new | old]`, then the reference trim.

        `src` holds the chunk's new keys in key order (the arena row's first W frames; at least
        the first min(W, P) of them). Only the new frames the trim keeps are copied, into free
        storage positions; the kept old frames and the prompt views never move.
        """
        if new_frames < 1:
            raise ValueError(f"a chunk must add at least one frame, got {new_frames}")
        p, d = self.num_prompt, self.num_delta
        total = new_frames + len(self)
        if total > p + self.tail:
            num_delta = min(d + new_frames, p)
            head, trimmed = p - num_delta, True
        else:
            num_delta, head, trimmed = d + new_frames, self.head, self.trimmed
        kept_new = min(new_frames, num_delta)     # < new_frames only for a chunk longer than P
        kept_old = num_delta - kept_new           # the newest old keys; the trim drops the rest
        if src.shape[FRAME_DIM] < kept_new:
            raise ValueError(f"src has {src.shape[FRAME_DIM]} frames, need {kept_new}")
        if self.storage is None:
            # P frames once: the memory plan reserves them from the first chunk on (steady state)
            self.storage = torch.empty(self.prompt.shape, dtype=self.prompt.dtype, device=self.prompt.device)
        # never-used frames first, then the dropped keys' frames (ascending: long copy runs)
        fresh = min(kept_new, p - self.used)
        free = list(range(self.used, self.used + fresh)) + sorted(self.positions[kept_old:])
        new_positions = free[:kept_new]
        for key, pos, n in position_runs(new_positions):
            self.storage.narrow(FRAME_DIM, pos, n).copy_(src.narrow(FRAME_DIM, key, n))
        self.used += fresh
        self.positions = new_positions + self.positions[:kept_old]
        self.head, self.trimmed = head, trimmed

    # ---- accounting --------------------------------------------------------------------
    def private_bytes(self) -> int:
        return _nbytes(self.storage)

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

    def private_frames(self) -> tuple[torch.Tensor, list[int]] | None:
        """(data, [0, d)): the delta is the first d frames of `data`, in key order."""
        return (self.data, list(range(self.num_delta))) if self.num_delta else None

    def materialize(self) -> torch.Tensor:
        return self.data

    def advance(self, new_frames: int, src: torch.Tensor) -> None:
        """The reference step literally: keys `[new | cache]` (cat), then the trim. `src` starts
        with the chunk's `new_frames` new frames (the arena row: it holds nothing else)."""
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
