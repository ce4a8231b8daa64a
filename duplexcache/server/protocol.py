"""The realtime wire protocol: OpenAI-Realtime-style JSON events, one per WebSocket text frame.

Client events
    ``session.update``          {session: {instructions, voice, initial_user_text, window{...},
                                 input_audio_format: "pcm16"|"f32"}, queue_if_full?: bool}
                                creates the session (once per connection)
    ``input_audio_buffer.append`` {audio: base64 of 16 kHz mono pcm16 little-endian or float32}
    ``session.close``           ends the session; the server answers ``response.done`` and
                                closes the socket
Server events
    ``session.created``         {session: {id, effective settings}}
    ``response.output_audio.delta`` {delta: base64 pcm16 24 kHz mono}
    ``response.output_text.delta``  {delta: text}
    ``response.done``           {response: {status, ...}}
    ``error``                   {error: {type, code, message, event_id?}}

Every event carries ``type`` and ``event_id``. This module only parses and builds events (no
sockets), so every malformed-input case is testable without a server.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Union

import numpy as np

from duplexcache.config import INPUT_AUDIO_FORMATS, SessionRuntimeConfig, find_private_key

# error.type values (as in the OpenAI Realtime API)
INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"

# Close codes (RFC 6455)
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009

CLIENT_EVENT_TYPES = ("session.update", "input_audio_buffer.append", "session.close")


class ProtocolError(ValueError):
    """A client event that cannot be used; ``code`` becomes ``error.code`` on the wire."""

    def __init__(self, code: str, message: str, event_id: str | None = None):
        self.code = code
        self.message = message
        self.event_id = event_id
        super().__init__(f"{code}: {message}")


@dataclass(frozen=True)
class SessionUpdate:
    session: dict[str, Any]
    queue_if_full: bool
    event_id: str | None


@dataclass(frozen=True)
class AudioAppend:
    audio_b64: str
    event_id: str | None


@dataclass(frozen=True)
class SessionClose:
    event_id: str | None


ClientEvent = Union[SessionUpdate, AudioAppend, SessionClose]


def new_event_id() -> str:
    return "event_" + uuid.uuid4().hex[:20]


# --------------------------------------------------------------------------------------------
# Parsing client events
# --------------------------------------------------------------------------------------------

def parse_client_event(text: str) -> ClientEvent:
    """Parse one text frame; raises ProtocolError naming what is wrong."""
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ProtocolError("invalid_json", f"frame is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("invalid_event", f"an event must be a JSON object, got {type(obj).__name__}")
    event_id = obj.get("event_id")
    if event_id is not None and not isinstance(event_id, str):
        raise ProtocolError("invalid_event", "event_id must be a string")
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("invalid_event", "an event needs a string 'type'", event_id)
    if kind == "session.update":
        return _parse_session_update(obj, event_id)
    if kind == "input_audio_buffer.append":
        audio = obj.get("audio")
        if not isinstance(audio, str):
            raise ProtocolError("invalid_audio", "input_audio_buffer.append needs 'audio' as a base64 string",
                                event_id)
        return AudioAppend(audio, event_id)
    if kind == "session.close":
        return SessionClose(event_id)
    raise ProtocolError("unknown_event_type",
                        f"unknown event type {kind!r} (known: {', '.join(CLIENT_EVENT_TYPES)})", event_id)


def _parse_session_update(obj: Mapping[str, Any], event_id: str | None) -> SessionUpdate:
    session = obj.get("session", {})
    if not isinstance(session, dict):
        raise ProtocolError("invalid_session_config", "session.update needs 'session' as an object", event_id)
    queue_if_full = obj.get("queue_if_full", False)
    if not isinstance(queue_if_full, bool):
        raise ProtocolError("invalid_event", "queue_if_full must be true or false", event_id)
    # Server-owned keys are refused here, before the engine sees them (the engine checks too).
    private = find_private_key(session)
    if private is not None:
        raise ProtocolError("private_config_key",
                            f"session key {private!r} is server-owned and cannot be set by a client", event_id)
    return SessionUpdate(session, queue_if_full, event_id)


def decode_audio(audio_b64: str, audio_format: str) -> np.ndarray:
    """Base64 pcm16 (little-endian) or float32 -> float32 array (samples,) in [-1, 1).

    Raises ProtocolError("invalid_audio") for bad base64, empty audio, a byte count that is not
    a whole number of samples, or non-finite float samples.
    """
    if audio_format not in INPUT_AUDIO_FORMATS:
        raise ValueError(f"unknown input_audio_format {audio_format!r}")
    try:
        raw = base64.b64decode(audio_b64, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError("invalid_audio", "audio is not valid base64") from None
    if not raw:
        raise ProtocolError("invalid_audio", "audio is empty")
    if audio_format == "pcm16":
        if len(raw) % 2:
            raise ProtocolError("invalid_audio", f"pcm16 audio needs an even byte count, got {len(raw)}")
        return (np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0).astype(np.float32)
    if len(raw) % 4:
        raise ProtocolError("invalid_audio", f"f32 audio needs a multiple of 4 bytes, got {len(raw)}")
    pcm = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    if not np.isfinite(pcm).all():
        raise ProtocolError("invalid_audio", "f32 audio contains NaN or infinite samples")
    return pcm


# --------------------------------------------------------------------------------------------
# Building server events
# --------------------------------------------------------------------------------------------

def _event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "event_id": new_event_id(), **fields}


def session_created(sid: str, cfg: SessionRuntimeConfig, output_sample_rate: int,
                    input_sample_rate: int) -> dict[str, Any]:
    """``session.created`` with the settings the session actually runs with."""
    return _event("session.created", session={
        "id": sid,
        "instructions": cfg.instructions,
        "voice": cfg.voice,
        "initial_user_text": cfg.initial_user_text,
        "input_audio_format": cfg.input_audio_format,
        "input_sample_rate": input_sample_rate,
        "output_audio_format": "pcm16",
        "output_sample_rate": output_sample_rate,
        "window": {"mode": cfg.window_mode, "high_tokens": cfg.window_high_tokens,
                   "low_tokens": cfg.window_low_tokens},
    })


def audio_delta(pcm16: bytes) -> dict[str, Any]:
    return _event("response.output_audio.delta", delta=base64.b64encode(pcm16).decode("ascii"))


def text_delta(text: str) -> dict[str, Any]:
    return _event("response.output_text.delta", delta=text)


def response_done(status: str = "completed", reason: str | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {"status": status}
    if reason is not None:
        response["status_details"] = {"reason": reason}
    return _event("response.done", response=response)


def error_event(code: str, message: str, *, error_type: str = INVALID_REQUEST,
                event_id: str | None = None) -> dict[str, Any]:
    """``error``; ``event_id`` inside ``error`` names the client event that caused it."""
    error: dict[str, Any] = {"type": error_type, "code": code, "message": message}
    if event_id is not None:
        error["event_id"] = event_id
    return _event("error", error=error)


def encode(event: Mapping[str, Any]) -> str:
    return json.dumps(event, separators=(",", ":"))
