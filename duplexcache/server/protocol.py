"""The realtime wire protocol: OpenAI Realtime JSON events, one per WebSocket text frame.

docs/protocol.md documents every event and the differences from OpenAI's. This module parses
client frames and builds server events (no sockets), so every malformed-input case is testable
without a server. Client strings echoed back (event ids, names) are clipped (:func:`clip`) so a
client can never make the server send it back a large payload.
"""

from __future__ import annotations

import base64
import json
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

# error.type values (as in the OpenAI Realtime API)
INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
RATE_LIMIT = "rate_limit_error"

REALTIME_PATH = "/v1/realtime"   # where the realtime WebSocket is served

# The handshake header a cluster router places a session by (Ray Serve's proxy hands it to the
# router as the multiplexed model id; cluster/placement.py).
PLACEMENT_HEADER = "serve_multiplexed_model_id"

# Close codes (RFC 6455)
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TRY_AGAIN = 1013

CLIENT_EVENT_TYPES = (
    "session.update", "input_audio_buffer.append", "input_audio_buffer.commit", "input_audio_buffer.clear",
    "response.create", "response.cancel", "conversation.item.create", "conversation.item.truncate",
    "session.close",
)
# Longest client string (event id, field name, value) echoed back in an error.
MAX_ECHO_CHARS = 64
# Deepest nesting of objects/arrays accepted in a client event (the deepest real one, a GA
# session.update's audio.input.format, is 5 levels).
MAX_JSON_DEPTH = 32
# Longest error message sent (messages are ours, but may embed clipped client strings).
MAX_MESSAGE_CHARS = 400


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...({len(text)} chars)"


def unicode_problem(text: str) -> str | None:
    """Why ``text`` is not valid Unicode, or None. JSON can carry a lone surrogate (``"\\ud800"``),
    which no tokenizer can encode: said when it arrives, not when the engine meets it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"not valid Unicode: a lone surrogate at character {exc.start}"
    return None


class ProtocolError(ValueError):
    """A client event that cannot be used; ``code`` becomes ``error.code`` on the wire."""

    def __init__(self, code: str, message: str, event_id: str | None = None, *, param: str | None = None,
                 error_type: str = INVALID_REQUEST):
        self.code = code
        self.message = message
        self.event_id = event_id
        self.param = param
        self.error_type = error_type
        super().__init__(f"{code}: {message}")


@dataclass(frozen=True)
class ClientEvent:
    type: str
    event_id: str | None
    data: Mapping[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


# --------------------------------------------------------------------------------------------
# Parsing client events
# --------------------------------------------------------------------------------------------

def json_depth_over(obj: Any, limit: int) -> bool:
    """Whether ``obj`` nests objects/arrays more than ``limit`` deep; iterative, so a client's
    nesting cannot reach Python's recursion limit here."""
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _too_deep() -> ProtocolError:
    return ProtocolError("nesting_too_deep", f"the event nests objects or arrays more than {MAX_JSON_DEPTH} levels "
                         "deep; no event of this API needs more than a few")


def load_frame_json(text: str) -> Any:
    """A text frame's JSON, nested at most MAX_JSON_DEPTH deep (both dialects parse with it);
    raises ProtocolError (invalid_json, nesting_too_deep)."""
    try:
        obj = json.loads(text)
    except RecursionError:   # deeper than the JSON decoder's own recursion allows
        raise _too_deep() from None
    except json.JSONDecodeError as exc:
        raise ProtocolError("invalid_json", f"frame is not valid JSON: {clip(str(exc), 120)}") from None
    # Everything after this (the private-key walk, validation, the session echo) may recurse
    # into what the client sent; past this bound none of it sees the event.
    if json_depth_over(obj, MAX_JSON_DEPTH):
        raise _too_deep()
    return obj


def parse_client_event(text: str) -> ClientEvent:
    """Parse one text frame; raises ProtocolError naming what is wrong."""
    obj = load_frame_json(text)
    if not isinstance(obj, dict):
        raise ProtocolError("invalid_event", f"an event must be a JSON object, got {type(obj).__name__}")
    event_id = obj.get("event_id")
    if event_id is not None and not isinstance(event_id, str):
        raise ProtocolError("invalid_event", "event_id must be a string", param="event_id")
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("invalid_event", "an event needs a string 'type'", event_id, param="type")
    if kind not in CLIENT_EVENT_TYPES:
        raise ProtocolError("unknown_event_type",
                            f"unknown event type {clip(kind)!r} (known: {', '.join(CLIENT_EVENT_TYPES)})",
                            event_id, param="type")
    return ClientEvent(kind, event_id, obj)


def field(event: ClientEvent, name: str, typ: type | tuple[type, ...], *, required: bool = True,
          default: Any = None) -> Any:
    """One top-level field of a client event, type-checked (bool is not an int here)."""
    if name not in event.data or event.data[name] is None:
        if required:
            raise ProtocolError("missing_required_parameter", f"{event.type} needs {name!r}", event.event_id,
                                param=name)
        return default
    value = event.data[name]
    if isinstance(value, bool) and bool not in (typ if isinstance(typ, tuple) else (typ,)):
        value = None  # fall through to the type error
    if not isinstance(value, typ):
        names = "/".join(t.__name__ for t in (typ if isinstance(typ, tuple) else (typ,)))
        raise ProtocolError("invalid_value", f"{event.type}.{name} must be {names}", event.event_id, param=name)
    return value


# --------------------------------------------------------------------------------------------
# Building server events
# --------------------------------------------------------------------------------------------

def event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "event_id": new_id("event"), **fields}


def error_event(code: str, message: str, *, error_type: str = INVALID_REQUEST, event_id: str | None = None,
                param: str | None = None) -> dict[str, Any]:
    """``error`` as OpenAI sends it; ``error.event_id`` names the client event that caused it."""
    error: dict[str, Any] = {"type": error_type, "code": code, "message": clip(message, MAX_MESSAGE_CHARS),
                             "param": None if param is None else clip(param), "event_id": None}
    if event_id is not None:
        error["event_id"] = clip(event_id)
    return event("error", error=error)


def http_error_body(code: str, message: str, error_type: str = INVALID_REQUEST) -> dict[str, Any]:
    """The JSON body of a refused handshake (OpenAI's HTTP error shape)."""
    return {"error": {"message": message, "type": error_type, "param": None, "code": code}}


def audio_delta_b64(pcm16: bytes) -> str:
    return base64.b64encode(pcm16).decode("ascii")


def encode(obj: Mapping[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"))
