"""The per-session runtime config: what a client's ``session.update`` may set, merged with the
server-owned switches of the deploy config (:func:`build_runtime_config`, the server-side
plugin) -> :class:`SessionRuntimeConfig`.

Server-owned keys (:data:`PRIVATE_RUNTIME_CONFIG_KEYS`) are never taken from a client: a client
dict that names one raises :class:`PrivateConfigKeyError`, which the server turns into an
``error`` event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from duplexcache.config import DeployConfig


class PrivateConfigKeyError(ValueError):
    """A client tried to set a server-owned runtime key (see PRIVATE_RUNTIME_CONFIG_KEYS)."""

    def __init__(self, key: str):
        self.key = key
        super().__init__(
            f"session key {key!r} is server-owned and cannot be set by a client "
            "(it is configured in the deploy YAML)"
        )


class SessionConfigError(ValueError):
    """A client session dict with an unknown key or a bad value (not a private key)."""


# Keys a client must never set: they change memory use or sharing for every session.
PRIVATE_RUNTIME_CONFIG_KEYS: frozenset[str] = frozenset({
    "duplex_context_caching", "context_cache_capacity", "capacity",
    "cfm_prompt_att_sharing", "cfm_arena_rows_from_graph_grid", "max_num_seqs", "graph_grid",
    "shared_anchor_blocks", "block_size", "window_mode", "mode",
    "memory_budget", "activation_reserve", "activation_from_warmup",
    "memory_headroom", "cuda_graphs", "tick_seconds", "speak_policy", "tick_headroom",
    "prefill_chunk_tokens", "max_context_tokens",
    "preset", "checkpoint_dir", "revision", "model_revision", "dtype", "device",
    "max_frame_bytes", "code2wav_dtype", "kv_cache_dtype", "encoder_cache_dtype", "vision",
})

# What a client may put in session.update's session object.
CLIENT_SESSION_KEYS: frozenset[str] = frozenset({
    "instructions", "voice", "initial_user_text", "input_audio_format", "window", "audio_output", "video",
})
CLIENT_WINDOW_KEYS: frozenset[str] = frozenset({"high_tokens", "low_tokens"})
INPUT_AUDIO_FORMATS = ("pcm16", "f32")


@dataclass(frozen=True)
class SessionRuntimeConfig:
    """Everything one session runs with: client-chosen fields plus server-owned switches."""

    # client-settable
    instructions: str
    voice: str
    initial_user_text: str | None
    input_audio_format: str
    window_high_tokens: int
    window_low_tokens: int
    # False: text-only replies; the session's units never enter the Talker or Code2Wav, and its
    # footprint reserves neither (OpenAI's modalities ["text"], MiniCPM-o's tts_enabled false)
    audio_output: bool
    # server-owned
    window_mode: str
    block_size: int
    shared_anchor_blocks: bool
    duplex_context_caching: bool
    context_cache_capacity: int
    cfm_prompt_att_sharing: bool
    cfm_arena_rows_from_graph_grid: bool
    model_revision: str
    # client-settable, last for its default: the session sends camera frames (model.vision), so
    # its units may carry a frame's tokens and admission sizes it for that (docs/vision.md)
    video: bool = False


def find_private_key(obj: Any, prefix: str = "") -> str | None:
    """The dotted path of the first server-owned key anywhere in ``obj`` (nested dicts too).
    Iterative: a client's session object may nest deeper than Python's recursion limit."""
    stack: list[tuple[Any, str]] = [(obj, prefix)]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, Mapping):
            continue
        nested = []
        for key, value in node.items():
            if key in PRIVATE_RUNTIME_CONFIG_KEYS:
                return f"{path}{key}"
            nested.append((value, f"{path}{key}."))
        stack.extend(reversed(nested))   # a level's own keys first, then its values in key order
    return None


def _check_str(session: Mapping[str, Any], key: str, default: str | None) -> str | None:
    value = session.get(key, default)
    if value is not None and not isinstance(value, str):
        raise SessionConfigError(f"session key {key!r} must be a string, got {type(value).__name__}")
    return value


def _client_window(deploy: DeployConfig, window: Any) -> tuple[int, int]:
    server = deploy.stage0.window
    if window is None:
        return server.high_tokens, server.low_tokens
    if not isinstance(window, Mapping):
        raise SessionConfigError(f"session key 'window' must be an object, got {window!r}")
    unknown = sorted(set(window) - CLIENT_WINDOW_KEYS)
    if unknown:
        raise SessionConfigError(f"unknown session key 'window.{unknown[0]}' "
                                 f"(allowed: {', '.join(sorted(CLIENT_WINDOW_KEYS))})")
    high = window.get("high_tokens", server.high_tokens)
    low = window.get("low_tokens", server.low_tokens)
    for name, value in (("high_tokens", high), ("low_tokens", low)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise SessionConfigError(f"window.{name} must be a positive int, got {value!r}")
    # Admission reserves memory for the server's high mark; a client may only shrink it (always
    # allowed: only its own footprint shrinks; stage0.client_window_override until issue 44).
    if high > server.high_tokens:
        raise SessionConfigError(
            f"window.high_tokens {high} exceeds the server limit {server.high_tokens}")
    if low >= high:
        raise SessionConfigError(f"window.low_tokens ({low}) must be below high_tokens ({high})")
    return high, low


def build_runtime_config(deploy: DeployConfig, client_session: Mapping[str, Any] | None) -> SessionRuntimeConfig:
    """Merge a client's session.update fields with the server-owned deploy switches.

    Raises PrivateConfigKeyError when the client names a server-owned key (anywhere, nested
    too), SessionConfigError for unknown keys or bad values.
    """
    session = {} if client_session is None else client_session
    if not isinstance(session, Mapping):
        raise SessionConfigError(f"session must be an object, got {type(session).__name__}")
    private = find_private_key(session)
    if private is not None:
        raise PrivateConfigKeyError(private)
    unknown = sorted(set(session) - CLIENT_SESSION_KEYS)
    if unknown:
        raise SessionConfigError(
            f"unknown session key {unknown[0]!r} (allowed: {', '.join(sorted(CLIENT_SESSION_KEYS))})")
    audio_format = _check_str(session, "input_audio_format", "pcm16")
    if audio_format not in INPUT_AUDIO_FORMATS:
        raise SessionConfigError(
            f"input_audio_format must be one of {INPUT_AUDIO_FORMATS}, got {audio_format!r}")
    high, low = _client_window(deploy, session.get("window"))
    audio_output = session.get("audio_output", True)
    if not isinstance(audio_output, bool):
        raise SessionConfigError(f"session key 'audio_output' must be true or false, got {audio_output!r}")
    video = session.get("video", False)
    if not isinstance(video, bool):
        raise SessionConfigError(f"session key 'video' must be true or false, got {type(video).__name__}")
    if video and not deploy.model.vision:
        raise SessionConfigError("session key 'video': this server has no vision model (model.vision is false); "
                                 "open an audio-only session")
    return SessionRuntimeConfig(
        instructions=_check_str(session, "instructions", "") or "",
        voice=_check_str(session, "voice", "default") or "default",
        initial_user_text=_check_str(session, "initial_user_text", None),
        input_audio_format=audio_format,
        window_high_tokens=high,
        window_low_tokens=low,
        audio_output=audio_output,
        window_mode=deploy.stage0.window.mode,
        block_size=deploy.stage0.block_size,
        shared_anchor_blocks=deploy.stage0.shared_anchor_blocks,
        duplex_context_caching=deploy.context_cache.duplex_context_caching,
        context_cache_capacity=deploy.context_cache.capacity,
        cfm_prompt_att_sharing=deploy.code2wav.cfm_prompt_att_sharing,
        cfm_arena_rows_from_graph_grid=deploy.code2wav.cfm_arena_rows_from_graph_grid,
        model_revision=deploy.model.revision,
        video=video,
    )
