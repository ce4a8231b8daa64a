"""The MiniCPM-o Realtime wire protocol (OpenBMB's ``openbmb-realtime`` SDK), beside OpenAI's.

A client of this dialect opens ``GET /v1/realtime?mode=audio&model=NAME`` with the WebSocket
subprotocol ``map.realtime`` and ``Authorization: Bearer KEY``. Either the subprotocol or the
``mode`` query parameter selects it (:func:`wants_minicpmo`); OpenAI clients send neither.

Client events (JSON text frames):

* ``session.init`` ``{payload: {system_prompt, config: {length_penalty, max_tokens, temperature,
  max_kv_tokens, tts_enabled, vision_hd}, voice: {ref_audio_base64, tts_ref_audio_base64},
  max_slice_nums}}``, sent once, after the server's ``session.queue_done``;
* ``input.append`` ``{input: {audio, force_listen, video_frames}}``: ``audio`` is 16 kHz mono
  little-endian float32, base64; ``video_frames`` (``mode=video`` only) a list of base64 JPEG
  frames, the SDK's ``send_audio_video(pcm, jpeg)`` one per second of audio;
* ``session.close`` ``{reason}``.

This module parses and checks those frames (no sockets, no engine) and builds the server events;
every refusal is a :class:`~duplexcache.server.protocol.ProtocolError` whose ``param`` is the
dotted path of the offending field, so a client always learns which field was wrong.
docs/protocol.md has the compatibility table.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from duplexcache.server.protocol import ProtocolError, clip, load_frame_json, new_id, unicode_problem

SUBPROTOCOL = "map.realtime"
MODES = ("audio", "video")
CLIENT_EVENT_TYPES = ("session.init", "input.append", "session.close")
# Longest reference recording taken (seconds at 16 kHz float32); the engine's own limit on
# reference audio applies too. Bounds what one session.init can make the server decode and hash.
MAX_REF_AUDIO_SECONDS = 30.0
REF_SAMPLE_RATE = 16_000
MAX_SYSTEM_PROMPT_CHARS = 32_768
MAX_CLOSE_REASON_CHARS = 120

_PAYLOAD_KEYS = frozenset({"system_prompt", "config", "voice", "max_slice_nums"})
_CONFIG_KEYS = frozenset({"length_penalty", "max_tokens", "temperature", "max_kv_tokens", "tts_enabled",
                          "vision_hd"})
_VOICE_KEYS = frozenset({"ref_audio_base64", "tts_ref_audio_base64"})
_INPUT_KEYS = frozenset({"audio", "force_listen", "video_frames"})
# Sampling knobs: the engine samples with the deploy's settings for every session (speak
# policy, Talker sampling), so a per-session value cannot be honoured; refused by name.
_ENGINE_WIDE = {
    "temperature": "the engine samples with the server's settings for every session",
    "max_tokens": "the engine ends a reply by the model's own end of turn (or engine.talker_turn_tokens)",
    "length_penalty": "the engine decodes token by token in real time; there is no beam search to penalize",
}


def wants_minicpmo(subprotocols: Sequence[str], query: Mapping[str, str]) -> bool:
    """Whether a handshake speaks this dialect: the SDK offers ``map.realtime`` and always sends
    ``?mode=``; an OpenAI client does neither."""
    return SUBPROTOCOL in subprotocols or "mode" in query


@dataclass(frozen=True)
class ClientEvent:
    type: str
    data: Mapping[str, Any]


@dataclass(frozen=True)
class SessionInit:
    """What ``session.init`` asked for, checked; refusals were raised while parsing."""

    system_prompt: str = ""
    ref_audio: np.ndarray | None = None    # float32 16 kHz mono, the reference voice
    ref_audio_b64_chars: int = 0
    tts_enabled: bool = True
    max_kv_tokens: int | None = None


# Frames one input.append may carry (the SDK sends one with each second of audio).
MAX_FRAMES_PER_APPEND = 4


@dataclass(frozen=True)
class InputAppend:
    audio: str                # base64 float32 16 kHz (decoded by the session's InputAudio)
    force_listen: bool = False
    video_frames: tuple[bytes, ...] = ()   # image bytes, decoded by the engine (push_frame)


def _bad(param: str, message: str, code: str = "invalid_value") -> ProtocolError:
    return ProtocolError(code, f"{param}: {message}", param=param)


def _unknown(keys: Any, allowed: frozenset[str], prefix: str) -> None:
    for key in keys:
        if key not in allowed:
            raise _bad(f"{prefix}{clip(str(key))}", f"unknown field (known: {', '.join(sorted(allowed))})",
                       code="unknown_parameter")


def parse_client_event(text: str) -> ClientEvent:
    """One text frame; raises ProtocolError naming what is wrong."""
    obj = load_frame_json(text)   # the OpenAI dialect's bounds: valid JSON, at most 32 levels deep
    if not isinstance(obj, dict):
        raise ProtocolError("invalid_event", f"an event must be a JSON object, got {type(obj).__name__}")
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("invalid_event", "an event needs a string 'type'", param="type")
    if kind not in CLIENT_EVENT_TYPES:
        raise ProtocolError("unknown_event_type",
                            f"unknown event type {clip(kind)!r} (known: {', '.join(CLIENT_EVENT_TYPES)})",
                            param="type")
    return ClientEvent(kind, obj)


def _object(value: Any, param: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _bad(param, f"must be an object, got {type(value).__name__}")
    return value


def _bool(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise _bad(param, f"must be true or false, got {clip(repr(value))}")
    return value


def decode_ref_audio(value: Any, param: str) -> np.ndarray:
    """A base64 float32 16 kHz mono recording, checked (the engine checks it again)."""
    if not isinstance(value, str):
        raise _bad(param, f"must be a base64 string, got {type(value).__name__}")
    limit = int(MAX_REF_AUDIO_SECONDS * REF_SAMPLE_RATE) * 4
    if len(value) > limit * 4 // 3 + 4:   # checked before decoding: a huge string costs nothing more
        raise _bad(param, f"reference audio longer than {MAX_REF_AUDIO_SECONDS:g} s "
                   f"({len(value)} base64 characters)", code="reference_audio_too_long")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(param, "is not valid base64") from None
    if not raw:
        raise _bad(param, "reference audio is empty")
    if len(raw) % 4:
        raise _bad(param, f"float32 audio needs a multiple of 4 bytes, got {len(raw)}")
    pcm = np.frombuffer(raw, "<f4").astype(np.float32)
    if not np.isfinite(pcm).all():
        raise _bad(param, "reference audio contains NaN or infinite samples")
    peak = float(np.abs(pcm).max())
    if peak > 1.0:
        raise _bad(param, f"float32 samples must lie in [-1, 1]; one has magnitude {peak:.4g}")
    return pcm


def parse_session_init(ev: ClientEvent) -> SessionInit:
    """``session.init``'s payload; every field does what it says or is refused here by name."""
    payload = _object(ev.data.get("payload", {}), "payload")
    _unknown(payload, _PAYLOAD_KEYS, "payload.")
    system_prompt = payload.get("system_prompt") or ""
    if not isinstance(system_prompt, str):
        raise _bad("payload.system_prompt", f"must be a string, got {type(system_prompt).__name__}")
    if len(system_prompt) > MAX_SYSTEM_PROMPT_CHARS:
        raise _bad("payload.system_prompt", f"at most {MAX_SYSTEM_PROMPT_CHARS} characters, got {len(system_prompt)}",
                   code="system_prompt_too_long")
    problem = unicode_problem(system_prompt)
    if problem is not None:
        raise _bad("payload.system_prompt", problem)
    slices = payload.get("max_slice_nums")
    if slices is not None and slices != 1:
        raise _bad("payload.max_slice_nums", f"camera frames are never sliced here (1, the duplex setting), got "
                   f"{clip(repr(slices))}", code="unsupported_parameter")
    config = _object(payload.get("config") or {}, "payload.config")
    _unknown(config, _CONFIG_KEYS, "payload.config.")
    for name, why in _ENGINE_WIDE.items():
        if config.get(name) is not None:
            raise _bad(f"payload.config.{name}", f"not supported per session: {why}", code="unsupported_parameter")
    if config.get("vision_hd") is not None and _bool(config["vision_hd"], "payload.config.vision_hd"):
        raise _bad("payload.config.vision_hd", "high-definition (sliced) frames are not served: each frame is one "
                   "~448x448 image of 64 tokens", code="unsupported_parameter")
    tts_enabled = True if config.get("tts_enabled") is None else _bool(config["tts_enabled"],
                                                                        "payload.config.tts_enabled")
    max_kv = config.get("max_kv_tokens")
    if max_kv is not None and (isinstance(max_kv, bool) or not isinstance(max_kv, int) or max_kv <= 0):
        raise _bad("payload.config.max_kv_tokens", f"must be a positive integer, got {clip(repr(max_kv))}")
    voice = _object(payload.get("voice") or {}, "payload.voice")
    _unknown(voice, _VOICE_KEYS, "payload.voice.")
    ref_b64 = voice.get("ref_audio_base64") or None
    ref = None if ref_b64 is None else decode_ref_audio(ref_b64, "payload.voice.ref_audio_base64")
    tts_b64 = voice.get("tts_ref_audio_base64") or None
    if tts_b64 is not None:
        tts = decode_ref_audio(tts_b64, "payload.voice.tts_ref_audio_base64")
        # One recording serves both halves of a voice (the Thinker's context and the Code2Wav
        # prompt); a second, different one would need a separate speech prompt per session.
        if ref is None or not np.array_equal(tts, ref):
            raise _bad("payload.voice.tts_ref_audio_base64", "a TTS reference different from ref_audio_base64 is not "
                       "supported: send the voice once as ref_audio_base64", code="unsupported_parameter")
    return SessionInit(system_prompt, ref, 0 if ref_b64 is None else len(ref_b64), tts_enabled, max_kv)


def parse_input_append(ev: ClientEvent) -> InputAppend:
    body = _object(ev.data.get("input"), "input") if "input" in ev.data else None
    if body is None:
        raise _bad("input", "input.append needs 'input' ({audio, force_listen})", code="missing_required_parameter")
    _unknown(body, _INPUT_KEYS, "input.")
    audio = body.get("audio", "")
    if not isinstance(audio, str):
        raise _bad("input.audio", f"must be a base64 string, got {type(audio).__name__}")
    force = body.get("force_listen", False)
    frames = _video_frames(body.get("video_frames"))
    return InputAppend(audio, False if force is None else _bool(force, "input.force_listen"), frames)


def _video_frames(value: Any) -> tuple[bytes, ...]:
    """``input.video_frames``: base64 strings -> bytes (the images are checked by the engine)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _bad("input.video_frames", f"must be a list of base64 JPEG strings, got {type(value).__name__}")
    if len(value) > MAX_FRAMES_PER_APPEND:
        raise _bad("input.video_frames", f"at most {MAX_FRAMES_PER_APPEND} frames per input.append (one per second "
                   f"of audio), got {len(value)}")
    frames = []
    for i, item in enumerate(value):
        param = f"input.video_frames[{i}]"
        if not isinstance(item, str) or not item:
            raise _bad(param, f"must be a non-empty base64 JPEG string, got {clip(repr(type(item).__name__))}")
        try:
            frames.append(base64.b64decode(item, validate=True))
        except (binascii.Error, ValueError):
            raise _bad(param, "is not valid base64") from None
    return tuple(frames)


def close_reason(ev: ClientEvent) -> str:
    reason = ev.data.get("reason", "user_stop")
    if not isinstance(reason, str):
        raise _bad("reason", f"must be a string, got {type(reason).__name__}")
    return clip(reason, MAX_CLOSE_REASON_CHARS)


# --------------------------------------------------------------------------------------------
# Server events
# --------------------------------------------------------------------------------------------

def event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "event_id": new_id("event"), **fields}


@dataclass
class Usage:
    """Cumulative token counts of one session, in the SDK's usage shape.

    Input: the session context's tokens (system prompt, reference voice) once, plus the audio
    encoder's embeddings of the input audio (``audio_tokens_per_second`` each second). Output:
    the reply's text tokens plus its speech tokens (``speech_tokens_per_second`` of audio)."""

    audio_tokens_per_second: int
    speech_tokens_per_second: int
    context_tokens: int = 0
    vision_tokens: int = 0        # 64 per camera frame taken
    input_audio_seconds: float = 0.0
    output_text_tokens: int = 0
    output_audio_seconds: float = 0.0

    def to_wire(self) -> dict[str, Any]:
        audio_in = int(self.input_audio_seconds * self.audio_tokens_per_second)
        audio_out = int(round(self.output_audio_seconds * self.speech_tokens_per_second))
        inp = self.context_tokens + audio_in + self.vision_tokens
        out = self.output_text_tokens + audio_out
        return {"input_tokens": inp, "output_tokens": out, "total_tokens": inp + out,
                "input_tokens_details": {"text_tokens": self.context_tokens, "audio_tokens": audio_in,
                                         "vision_tokens": self.vision_tokens},
                "output_tokens_details": {"text_tokens": self.output_text_tokens, "audio_tokens": audio_out}}


def float32_b64(pcm16: bytes) -> str:
    """The engine's 24 kHz int16 audio as base64 float32 (the dialect's sample format both ways)."""
    samples = np.frombuffer(pcm16, "<i2").astype(np.float32) / 32768.0
    return base64.b64encode(samples.astype("<f4").tobytes()).decode("ascii")
