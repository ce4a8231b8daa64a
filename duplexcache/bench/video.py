"""Video workloads of the benchmarks (issue 47): camera frames at 1 fps beside the audio.

``--video-share F`` (``bench ticks`` and ``bench serve``): that share of the sessions, spread
evenly, are video sessions; each sends one frame with each second (unit) of its audio, as
OpenBMB's SDK ``send_audio_video(pcm, jpeg)`` does. ``bench ticks`` opens them with
``video: true`` and pushes the frame beside the unit's audio (``DuplexEngine.push_frame``,
decoded before the tick, outside its timing); ``bench serve``'s video callers speak the
MiniCPM-o dialect in ``mode=video`` (``input.video_frames`` on the first chunk of each unit).
The deployment needs ``model.vision: true`` (``bench ticks`` sets it when the share is above 0).

Frames: a 640 x 480 JPEG per (session, unit mod 4), smooth colour fields that differ by session
and second (a camera's frames differ from second to second; the bytes are cached, the engine
decodes every one). ``video_bytes``: the memory plan's bytes per audio and per video session
(``SessionSizing.footprint``: Thinker window + Talker turn + dynamic, a frame's activations
included), from shapes only.
"""

from __future__ import annotations

import functools
import io
import math
from typing import Any

import numpy as np

FRAME_SIZE = (640, 480)     # a webcam's VGA frame: 28 x 37 patches after the ~448^2 resize
DISTINCT_FRAMES = 4         # per session, cycled: every unit's frame differs from the one before


def is_video(index: int, share: float) -> bool:
    """Whether session ``index`` is a video session when ``share`` of them are (spread evenly)."""
    return math.floor((index + 1) * share) > math.floor(index * share)


@functools.lru_cache(maxsize=256)
def frame_jpeg(index: int, unit: int, size: tuple[int, int] = FRAME_SIZE) -> bytes:
    """Session ``index``'s frame for ``unit``: JPEG bytes (quality 85)."""
    from PIL import Image

    width, height = size
    k = unit % DISTINCT_FRAMES
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = 0.7 * index + 1.3 * k
    rgb = np.stack([np.sin(x / 37.0 + phase), np.cos(y / 23.0 - phase), np.sin((x + y) / 51.0 + 2 * phase)], -1)
    pixels = ((rgb + 1.0) * 127.5).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=85)
    return buf.getvalue()


def video_bytes(engine: Any) -> dict[str, int] | None:
    """Bytes per session at its worst case (window full, a full Talker turn) from the engine's
    memory plan: ``audio``, ``video`` (None without ``model.vision``) and the frame's share."""
    sizing = engine.sizing
    if sizing.vision is None:
        return None
    plan = engine.plan

    def total(client_session: dict[str, Any]) -> int:
        fp = sizing.footprint(*sizing.check_session(client_session))
        return (fp.thinker_private_blocks * plan.thinker_block_bytes + fp.talker_blocks * plan.talker_block_bytes
                + fp.dynamic_private_bytes)

    audio, video = total({}), total({"video": True})
    return {"audio": audio, "video": video, "frame_activation": video - audio,
            "thinker_tokens_per_frame": sizing.frame_tokens}
