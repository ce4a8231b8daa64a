"""The byte floor: private bytes one session cannot avoid at steady state, from shapes alone.

A session must hold, however well everything else is shared:

* its own window tokens: the Thinker K/V of the ``high_tokens`` tokens after the anchor
  (the most the window keeps before compacting), ``high * kv_bytes_per_token``;
* its own delta frames: the Code2Wav estimator attention of the ``P`` newest frames
  (``P * att_frame_bytes``; the 100-frame prompt tail can be shared, these cannot);
* its own encoder cache: the streaming audio encoder's K/V at its full ``max_cache_frames``
  (it grows by blocks as audio arrives and holds all of them after 30 s).

The talker's per-turn KV, conformer caches and vocoder caches are private too but are not in
the floor the spec defines; they show up as the gap between measured and floor. No tensor is
allocated: the numbers come from the models' configs (the same per-token and per-frame byte
methods the memory plan uses), so this works for the minicpmo45 shapes on any machine. The card
waterfall (``waterfall.py``) and the benchmarks (``bench/floor.py``'s time floor, ``bench
memory``) read it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class SessionFloor:
    """Bytes per component of one session's unavoidable private state."""

    thinker_window: int
    code2wav_delta: int
    audio_encoder_cache: int

    @property
    def total(self) -> int:
        return self.thinker_window + self.code2wav_delta + self.audio_encoder_cache

    def to_json(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def dtype_bytes(dtype: torch.dtype | str) -> int:
    """Element size of a torch dtype or its name (``"bfloat16"``)."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype name {dtype!r}")
    return torch.empty((), dtype=dtype, device="meta").element_size()


def session_floor(thinker_config, window_tokens: int, code2wav_shape, prompt_frames: int,
                  encoder_config, dtype: torch.dtype | str,
                  code2wav_dtype: torch.dtype | str = torch.float32,
                  kv_storage_dtype: torch.dtype | None = None,
                  encoder_storage_dtype: torch.dtype | None = None) -> SessionFloor:
    """The floor of one session (see the module docstring).

    ``thinker_config``: has ``kv_bytes_per_token(dtype)`` (``ThinkerConfig``);
    ``code2wav_shape``: has ``att_frame_bytes(dtype_bytes)`` (``Code2WavShape``);
    ``encoder_config``: has ``kv_bytes_per_session(dtype)`` (``AudioEncoderConfig``).
    ``dtype`` is the Thinker's and the encoder's; Code2Wav keeps float32 as the reference does
    (``code2wav_dtype``), whatever the Thinker runs in. ``kv_storage_dtype``: the Thinker KV
    pool's storage (``precision.kv_cache_dtype``; None: ``dtype``; fp8 counts its scales);
    ``encoder_storage_dtype`` the encoder cache's (``precision.encoder_cache_dtype``).
    """
    if window_tokens <= 0 or prompt_frames <= 0:
        raise ValueError(f"window_tokens ({window_tokens}) and prompt_frames ({prompt_frames}) must be > 0")
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return SessionFloor(
        thinker_window=window_tokens * thinker_config.kv_bytes_per_token(torch_dtype, kv_storage_dtype),
        code2wav_delta=prompt_frames * code2wav_shape.att_frame_bytes(dtype_bytes(code2wav_dtype)),
        audio_encoder_cache=encoder_config.kv_bytes_per_session(torch_dtype, encoder_storage_dtype),
    )
