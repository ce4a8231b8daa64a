"""What a realtime client's items and responses carry, checked field by field before anything
reaches the engine: a user message's text and images (``conversation.item.create``) and
``response.create``'s metadata (docs/protocol.md). Errors are ``ProtocolError`` naming the field.
"""

from __future__ import annotations

from typing import Any

from duplexcache.server import frames
from duplexcache.server import protocol as proto

MAX_USER_TEXT_CHARS = 8192   # characters of one user message (and of the messages waiting for admission)


def user_content(item: dict[str, Any], eid: str | None) -> tuple[str, list[tuple[int, bytes]]]:
    """The text and the images (content index, bytes) of a user message item (the only kind this
    server takes); a message of images only has no text."""
    if item.get("type", "message") != "message" or item.get("role") != "user":
        raise proto.ProtocolError("unsupported_item", "conversation.item.create takes user messages only "
                                  "({type: message, role: user, content: [{type: input_text, text}]})", eid,
                                  param="item")
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise proto.ProtocolError("invalid_value", "item.content must be a non-empty list", eid, param="item.content")
    parts, images = [], []
    for index, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            images.append((index, frames.image_from_data_url(part, f"item.content[{index}]", eid)))
            continue
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "text") \
                or not isinstance(part.get("text"), str):
            raise proto.ProtocolError("unsupported_content", "only input_text and input_image content parts are "
                                      "supported", eid, param="item.content")
        parts.append(part["text"])
    if images and not parts:
        return "", images
    return checked_text("".join(parts), eid), images


def checked_text(text: str, eid: str | None) -> str:
    if not text or len(text) > MAX_USER_TEXT_CHARS:
        raise proto.ProtocolError("invalid_value", f"a user message needs 1 to {MAX_USER_TEXT_CHARS} characters",
                                  eid, param="item.content")
    problem = proto.unicode_problem(text)
    if problem is not None:
        raise proto.ProtocolError("invalid_value", f"the text is {problem}", eid, param="item.content")
    return text


def response_metadata(ev: proto.ClientEvent) -> dict[str, str] | None:
    """``response.create``'s ``response.metadata`` (OpenAI: at most 16 string pairs, keys up to
    64 and values up to 512 characters), or None; anything else is a client error."""
    response = ev.data.get("response")
    if response is None:
        return None
    if not isinstance(response, dict):
        raise proto.ProtocolError("invalid_value", "response must be an object", ev.event_id, param="response")
    metadata = response.get("metadata")
    if metadata is None:
        return None
    if (not isinstance(metadata, dict) or len(metadata) > 16
            or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                       for k, v in metadata.items())):
        raise proto.ProtocolError("invalid_value", "response.metadata must map at most 16 string keys "
                                  "(<= 64 characters) to string values (<= 512 characters)", ev.event_id,
                                  param="response.metadata")
    return dict(metadata)
