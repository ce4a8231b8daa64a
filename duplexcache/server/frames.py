"""Camera frames and images from either dialect into the engine (``push_frame``), errors by field.

Both dialects hand image bytes to the engine's ``push_frame(sid, image)`` (EngineAPI;
runtime/stages/vision_stage.py decodes and checks them); the engine's refusals come back here as
``error`` events naming the wire field, and the session goes on:

=====================  ================================  =====================================
refusal                code                              when
=====================  ================================  =====================================
no vision model        ``vision_unavailable``            ``model.vision`` false, or the session
                                                         was not opened for video
bad image              ``invalid_image``                 not an image, corrupt or truncated,
                                                         over 4096^2 pixels, a format other
                                                         than JPEG / PNG, an extreme aspect ratio
too many pending       ``too_many_frames``               10 frames ahead of the session's audio
bad data URL           ``invalid_value``                 OpenAI's ``image_url`` not a base64
                                                         ``data:image/jpeg|png`` URL
=====================  ================================  =====================================
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from typing import Any

from duplexcache.server import protocol as proto

# The data URL prefixes OpenAI's input_image takes (its spec: PNG and JPEG); remote URLs are not fetched.
IMAGE_DATA_URLS = ("data:image/jpeg;base64,", "data:image/jpg;base64,", "data:image/png;base64,")
IMAGE_DETAILS = (None, "auto", "low", "high")


def vision_served(deploy: Any) -> bool:
    """Whether this server takes frames: ``model.vision`` is on (the engine then has a vision stage)."""
    return bool(deploy.model.vision)


async def push_frame(engine: Any, sid: str, data: bytes, param: str, event_id: str | None = None) -> None:
    """``data`` for session ``sid``'s next unit; a refusal raises ``ProtocolError`` naming ``param``."""
    try:
        await asyncio.to_thread(engine.push_frame, sid, data)
    except ValueError as exc:   # InvalidImageError, TooManyFrames, VisionUnavailable, unknown session
        raise proto.ProtocolError(getattr(exc, "code", "invalid_value"), f"{param}: {exc}", event_id,
                                  param=param) from None


def image_from_data_url(part: dict[str, Any], param: str, event_id: str | None) -> bytes:
    """An OpenAI ``input_image`` content part -> the image bytes of its base64 data URL."""
    detail = part.get("detail")
    if detail not in IMAGE_DETAILS:
        raise proto.ProtocolError("invalid_value", f"{param}.detail must be auto, low or high, got "
                                  f"{proto.clip(repr(detail))}", event_id, param=f"{param}.detail")
    url = part.get("image_url")
    field = f"{param}.image_url"
    if not isinstance(url, str) or not url:
        raise proto.ProtocolError("invalid_value", f"{field} must be a data URL string", event_id, param=field)
    head = url[:32].lower()
    prefix = next((p for p in IMAGE_DATA_URLS if head.startswith(p)), None)
    if prefix is None:
        raise proto.ProtocolError("invalid_value", f"{field}: expected a base64 data URL of a JPEG or PNG image "
                                  f"(data:image/jpeg;base64,...); got {proto.clip(url, 40)!r} (remote URLs are "
                                  "not fetched)", event_id, param=field)
    try:
        data = base64.b64decode(url[len(prefix):], validate=True)
    except (binascii.Error, ValueError):
        raise proto.ProtocolError("invalid_value", f"{field}: the data URL's payload is not valid base64", event_id,
                                  param=field) from None
    if not data:
        raise proto.ProtocolError("invalid_value", f"{field}: the image is empty", event_id, param=field)
    return data
