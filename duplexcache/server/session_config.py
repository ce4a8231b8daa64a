"""A connection's session settings, changed by ``session.update`` in any of three shapes.

* GA (OpenAI Realtime, ``openai.types.realtime``): ``{type: "realtime", instructions,
  audio: {input: {format: {type: "audio/pcm", rate}, turn_detection}, output: {format, voice}}}``
* beta (``openai.types.beta.realtime``): flat ``voice``, ``input_audio_format`` ("pcm16",
  "g711_ulaw", "g711_alaw"), ``output_audio_format``, ``turn_detection``.
* ours (duplexcache's original dialect, still spoken by its own clients): flat ``instructions``,
  ``voice``, ``initial_user_text``, ``window``, ``input_audio_format`` ("pcm16" | "f32") and the
  extension ``input_sample_rate``.

The one ambiguity between them: a beta client's ``"pcm16"`` is 24 kHz, ours is 16 kHz. A
connection that identifies itself as an OpenAI client (``?model=`` in the URL, an ``OpenAI-Beta``
header or subprotocol, or a ``session.update`` with ``type``) gets OpenAI's default, 24 kHz;
any other connection keeps our original 16 kHz. An explicit rate always wins.

Standard OpenAI fields this server does not act on (tools, tracing, transcription, ...) are
accepted and ignored where that is harmless and refused (naming the field) where a client would
otherwise get something other than it asked for; anything else is an unknown-field error.
"""

from __future__ import annotations

import collections
import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from duplexcache.config import TEXT_CHARS_PER_CONTEXT_TOKEN
from duplexcache.runtime_config import find_private_key
from duplexcache.server.audio_io import ENGINE_RATE, G711_RATE, OUTPUT_RATE, InputFormat
from duplexcache.server.protocol import ProtocolError, clip, unicode_problem

OPENAI_RATE = 24_000
TURN_TYPES = ("duplex", "server_vad", "none")  # "none" = JSON null: the client commits and asks

# Wire name -> (kind, rate or None for "the connection's default")
_FORMAT_NAMES: dict[str, tuple[str, int | None]] = {
    "audio/pcm": ("pcm16", OPENAI_RATE), "pcm16": ("pcm16", None),
    "audio/pcmu": ("pcmu", 8000), "g711_ulaw": ("pcmu", 8000),
    "audio/pcma": ("pcma", 8000), "g711_alaw": ("pcma", 8000),
    "f32": ("f32", ENGINE_RATE),
}
_BETA_FORMAT_NAMES = {"pcm16": "pcm16", "pcmu": "g711_ulaw", "pcma": "g711_alaw", "f32": "f32"}
# Settings the engine session is opened with: fixed once the session's audio has started.
FIXED_ONCE_STARTED = ("instructions", "voice", "initial_user_text", "window", "input_audio_format",
                      "output_audio_format", "output_modalities")
MODALITIES = ("audio", "text")

# Standard fields accepted and ignored (no effect on what the client gets back that matters).
_IGNORED = frozenset({"type", "model", "id", "object", "expires_at", "include", "prompt", "tracing", "truncation",
                      "max_output_tokens", "max_response_output_tokens", "temperature", "tool_choice",
                      "input_audio_transcription", "input_audio_noise_reduction", "speed", "client_secret"})
_OURS = frozenset({"initial_user_text", "window", "input_sample_rate"})
_BETA = frozenset({"instructions", "voice", "input_audio_format", "output_audio_format", "turn_detection",
                   "modalities", "tools", "audio", "output_modalities"})


@dataclass(frozen=True)
class TurnDetection:
    type: str = "duplex"
    threshold: float = 0.5
    silence_duration_ms: int = 500
    prefix_padding_ms: int = 300
    create_response: bool = True
    interrupt_response: bool = True

    def to_wire(self) -> dict[str, Any] | None:
        if self.type == "none":
            return None
        if self.type == "duplex":
            return {"type": "duplex", "interrupt_response": self.interrupt_response}
        return {"type": "server_vad", "threshold": self.threshold, "silence_duration_ms": self.silence_duration_ms,
                "prefix_padding_ms": self.prefix_padding_ms, "create_response": self.create_response,
                "interrupt_response": self.interrupt_response}


@dataclass(frozen=True)
class SessionSettings:
    instructions: str = ""
    voice: str | None = None             # None: the engine's default voice
    initial_user_text: str | None = None
    window: Mapping[str, Any] | None = None
    input_kind: str = "pcm16"
    input_rate: int | None = None        # None: the connection's default (see module docstring)
    output_kind: str = "pcm16"           # pcm16 (24 kHz), pcmu or pcma (G.711 at 8 kHz)
    turn: TurnDetection = field(default_factory=TurnDetection)
    audio_output: bool = True            # False: text-only replies (modalities ["text"], tts_enabled false)
    video: bool = False                  # the session may send camera frames / images (server/frames.py)

    def input_format(self, openai_defaults: bool) -> InputFormat:
        rate = self.input_rate or (OPENAI_RATE if openai_defaults else ENGINE_RATE)
        return InputFormat(self.input_kind, rate)

    def engine_session(self) -> dict[str, Any]:
        """The dict ``engine.open_session`` takes (only what the client set; engine defaults otherwise)."""
        out: dict[str, Any] = {"instructions": self.instructions}
        if self.voice is not None:
            out["voice"] = self.voice
        if self.initial_user_text is not None:
            out["initial_user_text"] = self.initial_user_text
        if self.window is not None:
            out["window"] = dict(self.window)
        if not self.audio_output:
            out["audio_output"] = False   # the engine skips the Talker and Code2Wav for it
        if self.video:
            out["video"] = True
        return out


def _bad(field_path: str, message: str, eid: str | None, code: str = "invalid_value") -> ProtocolError:
    return ProtocolError(code, f"session.{field_path}: {message}", eid, param=f"session.{field_path}")


def _str(value: Any, path: str, eid: str | None, nullable: bool = False, max_chars: int | None = None) -> str | None:
    if value is None and nullable:
        return None
    if not isinstance(value, str):
        raise _bad(path, f"must be a string, got {type(value).__name__}", eid)
    if max_chars is not None and len(value) > max_chars:
        # Refused on its length alone, before anything reads the text (a 3.9 MB string used to be
        # tokenized in full at the open, 0.5-2.2 s, only to be refused as too many tokens).
        raise _bad(path, f"{len(value)} characters; this server takes at most {max_chars} "
                   f"({TEXT_CHARS_PER_CONTEXT_TOKEN} per token of server.max_context_tokens)", eid,
                   code="string_above_max_length")
    problem = unicode_problem(value)
    if problem is not None:
        raise _bad(path, problem, eid)
    return value


def _format(value: Any, path: str, eid: str | None) -> tuple[str, int | None]:
    """A GA format object ({type, rate}) or a beta/our format name -> (kind, rate or None)."""
    rate: Any = None
    if isinstance(value, Mapping):
        rate, value = value.get("rate"), value.get("type", "audio/pcm")
    if not isinstance(value, str) or value not in _FORMAT_NAMES:
        raise _bad(path, f"unsupported audio format {clip(repr(value))} (supported: {', '.join(_FORMAT_NAMES)})", eid)
    kind, default_rate = _FORMAT_NAMES[value]
    if rate is not None:
        if not isinstance(rate, int) or isinstance(rate, bool):
            raise _bad(path + ".rate", f"must be an integer, got {clip(repr(rate))}", eid)
        try:
            InputFormat(kind, rate)
        except ValueError as exc:
            raise _bad(path + ".rate", str(exc), eid) from None
        return kind, rate
    return kind, default_rate


def _turn(value: Any, current: TurnDetection, path: str, eid: str | None) -> TurnDetection:
    if value is None:
        return replace(current, type="none")
    if not isinstance(value, Mapping):
        raise _bad(path, "must be an object or null", eid)
    kind = value.get("type", "server_vad")
    # semantic_vad asks the model to judge the end of the user's turn, which is what duplex does.
    kind = {"semantic_vad": "duplex"}.get(kind, kind)
    if kind not in ("duplex", "server_vad"):
        raise _bad(path + ".type", f"unsupported turn detection {clip(repr(kind))} "
                   "(supported: duplex, server_vad, semantic_vad (= duplex), or null)", eid)
    out = replace(current, type=kind)
    for name, typ, lo, hi in (("threshold", float, 0.0, 1.0), ("silence_duration_ms", int, 0, 10_000),
                              ("prefix_padding_ms", int, 0, 10_000)):
        if name in value:
            got = value[name]
            if isinstance(got, bool) or not isinstance(got, (int, float)) or (typ is int and not isinstance(got, int)) \
                    or not lo <= got <= hi:
                raise _bad(f"{path}.{name}", f"must be a {typ.__name__} in [{lo}, {hi}], got {clip(repr(got))}", eid)
            out = replace(out, **{name: typ(got)})
    for name in ("create_response", "interrupt_response"):
        if name in value and value[name] is not None:
            if not isinstance(value[name], bool):
                raise _bad(f"{path}.{name}", "must be true or false", eid)
            out = replace(out, **{name: value[name]})
    return out


def _output_kind(value: Any, path: str, eid: str | None) -> str:
    """The output format a client asks for: 24 kHz pcm16 or G.711 at 8 kHz (``OutputAudio``)."""
    kind, rate = _format(value, path, eid)
    if kind == "f32" or (kind == "pcm16" and rate not in (None, OUTPUT_RATE)):
        raise _bad(path, "this server sends 24 kHz pcm16 (audio/pcm) or G.711 (audio/pcmu, audio/pcma)", eid)
    return kind


def _audio_output(value: Any, path: str, eid: str | None) -> bool:
    """``modalities`` (beta: ["audio", "text"] or ["text"]) / ``output_modalities`` (GA: ["audio"]
    or ["text"]): whether replies are spoken. Text only turns the engine's ``audio_output`` off."""
    if not isinstance(value, list) or not value or not all(isinstance(m, str) for m in value):
        raise _bad(path, f"must be a non-empty list of {' / '.join(MODALITIES)}, got {clip(repr(value))}", eid)
    unknown = [m for m in value if m not in MODALITIES]
    if unknown:
        raise _bad(path, f"unknown modality {clip(unknown[0])!r} (this server has: {', '.join(MODALITIES)})", eid)
    return "audio" in value


def apply_update(settings: SessionSettings, session: Any, eid: str | None, *, audio_started: bool,
                 voice_aliases: Mapping[str, str] | None = None,
                 max_text_chars: int | None = None) -> tuple[SessionSettings, list[str]]:
    """``settings`` changed by one ``session.update`` body; also returns the names it changed.
    A voice named in ``voice_aliases`` (server.voice_aliases) becomes the server's voice it maps to,
    before the comparison with the current one (a client that repeats its alias changes nothing).
    ``instructions`` and ``initial_user_text`` longer than ``max_text_chars`` are refused
    (``string_above_max_length``) before anything else reads them.

    Raises ProtocolError naming the offending field (``error.param``) and changes nothing then.
    """
    if not isinstance(session, Mapping):
        raise ProtocolError("invalid_request_error", "session.update needs 'session' as an object", eid,
                            param="session")
    private = find_private_key(session)
    if private is not None:
        raise ProtocolError("private_config_key",
                            f"session key {clip(private)!r} is server-owned and cannot be set by a client", eid,
                            param=f"session.{clip(private)}")
    for key in session:
        if key not in _IGNORED and key not in _OURS and key not in _BETA:
            raise _bad(clip(str(key)), "unknown session field", eid, code="unknown_parameter")
    new: dict[str, Any] = {}
    if "instructions" in session:
        new["instructions"] = _str(session["instructions"], "instructions", eid, max_chars=max_text_chars) or ""
    if "voice" in session:
        new["voice"] = _str(session["voice"], "voice", eid, nullable=True)
    if "initial_user_text" in session:
        new["initial_user_text"] = _str(session["initial_user_text"], "initial_user_text", eid, nullable=True,
                                        max_chars=max_text_chars)
    if "window" in session:
        if session["window"] is not None and not isinstance(session["window"], Mapping):
            raise _bad("window", "must be an object", eid)
        new["window"] = session["window"]
    if "input_audio_format" in session:
        new["input_kind"], new["input_rate"] = _format(session["input_audio_format"], "input_audio_format", eid)
    if "input_sample_rate" in session:
        new["input_rate"] = session["input_sample_rate"]
    if "output_audio_format" in session:
        new["output_kind"] = _output_kind(session["output_audio_format"], "output_audio_format", eid)
    for key in ("modalities", "output_modalities"):
        if key in session:
            new["audio_output"] = _audio_output(session[key], key, eid)
    if session.get("tools"):
        raise _bad("tools", "tools (function calling) are not supported by this server", eid)
    turn = settings.turn
    if "turn_detection" in session:
        turn = _turn(session["turn_detection"], turn, "turn_detection", eid)
    audio = session.get("audio")
    if audio is not None:
        new, turn = _apply_ga_audio(audio, new, turn, eid)
    if "input_rate" in new and new["input_rate"] is not None:
        try:
            InputFormat(new.get("input_kind", settings.input_kind), new["input_rate"])
        except ValueError as exc:
            raise _bad("input_sample_rate", str(exc), eid) from None
    if voice_aliases and new.get("voice") in voice_aliases:
        new["voice"] = voice_aliases[new["voice"]]
    changed = [name for name, value in new.items() if getattr(settings, name) != value]
    if audio_started:
        fixed = [name for name in changed if _public_name(name) in FIXED_ONCE_STARTED]
        if fixed:
            name = _public_name(fixed[0])
            raise _bad(name, f"{name} cannot change once the session's audio has started "
                       "(open a new connection for a new session)", eid, code="session_field_fixed")
    if turn != settings.turn:
        changed.append("turn_detection")
    return replace(settings, **new, turn=turn), changed


def _public_name(name: str) -> str:
    if name == "output_kind":
        return "output_audio_format"
    if name == "audio_output":
        return "output_modalities"
    return "input_audio_format" if name in ("input_kind", "input_rate") else name


def _apply_ga_audio(audio: Any, new: dict[str, Any], turn: TurnDetection,
                    eid: str | None) -> tuple[dict[str, Any], TurnDetection]:
    if not isinstance(audio, Mapping):
        raise _bad("audio", "must be an object", eid)
    inp, out = audio.get("input") or {}, audio.get("output") or {}
    if not isinstance(inp, Mapping) or not isinstance(out, Mapping):
        raise _bad("audio", "input and output must be objects", eid)
    if "format" in inp:
        new["input_kind"], new["input_rate"] = _format(inp["format"], "audio.input.format", eid)
    if "turn_detection" in inp:
        turn = _turn(inp["turn_detection"], turn, "audio.input.turn_detection", eid)
    if "format" in out:
        new["output_kind"] = _output_kind(out["format"], "audio.output.format", eid)
    if "voice" in out:
        new["voice"] = _str(out["voice"], "audio.output.voice", eid, nullable=True)
    return new, turn


# The client's own texts, echoed in a session object only where the event set them (to_wire).
ECHOED_TEXTS = ("instructions", "initial_user_text")


def to_wire(sid: str, settings: SessionSettings, fmt: InputFormat, engine_voice: str,
            model: str | None, texts: bool = True) -> dict[str, Any]:
    """The session object of session.created/updated: GA shape, beta flat fields and our extras.

    ``texts`` False leaves out ``instructions`` and ``initial_user_text`` (ECHOED_TEXTS): a
    ``session.update`` that did not set them is answered without them, so a 40-byte update cannot
    ask for 64K characters back (docs/protocol.md)."""
    input_format = {"type": {"pcm16": "audio/pcm", "pcmu": "audio/pcmu", "pcma": "audio/pcma",
                             "f32": "f32"}[fmt.kind]}
    if fmt.kind in ("pcm16", "f32"):
        input_format["rate"] = fmt.rate
    output_format = ({"type": "audio/pcm", "rate": OUTPUT_RATE} if settings.output_kind == "pcm16"
                     else {"type": f"audio/{settings.output_kind}"})
    turn = settings.turn.to_wire()
    voice = settings.voice or engine_voice
    wire = {
        "type": "realtime", "object": "realtime.session", "id": sid, "model": model,
        "output_modalities": ["audio"] if settings.audio_output else ["text"], "instructions": settings.instructions,
        "audio": {"input": {"format": input_format, "turn_detection": turn},
                  "output": {"format": output_format, "voice": voice}},
        # beta (flat) view of the same settings
        "voice": voice, "turn_detection": turn,
        "input_audio_format": _BETA_FORMAT_NAMES[fmt.kind],
        "output_audio_format": _BETA_FORMAT_NAMES[settings.output_kind],
        "modalities": ["audio", "text"] if settings.audio_output else ["text"],
        # duplexcache extras
        "initial_user_text": settings.initial_user_text, "window": dict(settings.window or {}),
        "input_sample_rate": fmt.rate,
        "output_sample_rate": OUTPUT_RATE if settings.output_kind == "pcm16" else G711_RATE,
    }
    if not texts:
        for name in ECHOED_TEXTS:
            del wire[name]
    return wire


class RefusalMemory:
    """Refusals that a session's settings alone decide (context too long, bad reference audio,
    ...), remembered by a hash of those settings for every connection of the server: a client
    that opens connection after connection with the same refused settings is answered from here,
    not by building (tokenizing) its context again each time. Least recently used first out."""

    def __init__(self, size: int = 1024):
        self._size = size
        self._by_hash: collections.OrderedDict[str, ProtocolError] = collections.OrderedDict()

    @staticmethod
    def key(settings: SessionSettings) -> str:
        """The hash of what the engine session would be opened with (what decides the refusal)."""
        canonical = json.dumps(settings.engine_session(), sort_keys=True, default=str)
        return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()

    def get(self, settings: SessionSettings) -> ProtocolError | None:
        key = self.key(settings)
        error = self._by_hash.get(key)
        if error is not None:
            self._by_hash.move_to_end(key)
        return error

    def put(self, settings: SessionSettings, error: ProtocolError) -> None:
        key = self.key(settings)
        self._by_hash[key] = error
        self._by_hash.move_to_end(key)
        while len(self._by_hash) > self._size:
            self._by_hash.popitem(last=False)

    def __len__(self) -> int:
        return len(self._by_hash)
