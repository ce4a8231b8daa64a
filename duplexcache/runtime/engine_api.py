"""The interface between the realtime server and the engine, and the typed objects it passes.

The server (``duplexcache.server``) is written against :class:`EngineAPI` only; the real engine
(``duplexcache.runtime.engine``) and the test fake both satisfy it. Nothing here imports a web
library or torch.

Threading contract (the server relies on it):

* ``tick()``, ``prefill_step()`` and ``warmup()`` run in a worker thread, one call at a time
  (the server never overlaps them).
* ``open_session``, ``push_audio``, ``close_session``, ``is_queued``, ``queue_position``,
  ``stats`` and the turn-control calls (``set_turn_mode``, ``request_response``,
  ``cancel_response``, ``add_user_text``) may be called from another thread while a tick runs.
  They must be short (queue the input, take a short lock) and must not wait for the running tick
  to finish.

Everything the server (``duplexcache.server``) and the cluster (``duplexcache.cluster``) call on
an engine is a member of :class:`EngineAPI`: they call it, never probe for it (a test checks that
no ``getattr`` on an engine is left in either package).

Session life cycle::

    open_session ──admitted──> live ──tick()...──> close_session (idempotent, frees everything)
         │                       ^
         └──queue_if_full──> queued ──(a tick admits it: SessionAdmitted event)

A refused session (no room, not queued) raises :class:`AdmissionError` and owns nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Union, runtime_checkable

import numpy as np

INPUT_SAMPLE_RATE = 16_000   # pcm pushed by push_audio
OUTPUT_SAMPLE_RATE = 24_000  # pcm16 in AudioDelta
TIERS = ("shared", "private", "free")


class ServerBehindError(ValueError):
    """``push_audio`` refused a chunk because the session's input buffer is full while its client
    sends in real time: the server is behind, not the client (a ``ValueError`` like every other
    refused chunk, with ``code`` ``server_behind`` instead of the client's ``invalid_audio``)."""

    code = "server_behind"


# What a client is told for each admission code (the one text per code: the engine raises it,
# the server sends it); the engine's own detail (which may name pool sizes) goes to its log only.
ADMISSION_MESSAGES = {
    "capacity_memory": "The server has no memory for another session right now; try again later.",
    "capacity_compute": "The server cannot run another session in real time right now; try again later.",
    "admission_refused": "The server cannot admit another session right now; try again later.",
}


class AdmissionError(Exception):
    """A session that cannot be admitted now; ``reason`` says why (e.g. which memory ran out).

    ``code`` names the cause for clients: ``capacity_memory`` (the memory budget is full),
    ``capacity_compute`` (one more session would make the tick late), ``context_length_exceeded``
    (the session's context is longer than the server allows), or ``admission_refused``."""

    code = "admission_refused"

    def __init__(self, reason: str, code: str | None = None):
        self.reason = reason
        if code is not None:
            self.code = code
        super().__init__(reason)


class UserTextTooLong(ValueError):
    """``add_user_text`` refused a message because the session's window cannot take that much
    text before its next unit (with what is already waiting). Only that message fails; the
    server reports ``code`` to that client."""

    code = "user_text_too_long"


class InvalidAudioError(ValueError):
    """Audio a client pushed that the engine refuses (e.g. float samples outside [-1, 1]).
    Only that push fails; the server reports ``code`` to that client."""

    code = "invalid_audio"


# --------------------------------------------------------------------------------------------
# Events returned by tick()
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class AudioDelta:
    """Speech output: little-endian int16 mono PCM at 24 kHz."""

    sid: str
    pcm16: bytes

    def __post_init__(self) -> None:
        if len(self.pcm16) % 2:
            raise ValueError(f"AudioDelta for {self.sid!r}: pcm16 has an odd byte count {len(self.pcm16)}")


@dataclass(frozen=True, slots=True)
class TextDelta:
    sid: str
    text: str


RESPONSE_STATUSES = ("completed", "cancelled")


@dataclass(frozen=True, slots=True)
class ResponseUsage:
    """What one response produced: its text tokens (end tokens not counted) and the seconds of
    audio sent for it (a cancelled response counts what went out before the cancel)."""

    text_tokens: int = 0
    audio_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class ResponseDone:
    """The end of one response (a spoken turn): ``completed`` (the turn ended by itself) or
    ``cancelled`` (``cancel_response``). A response starts with its session's first TextDelta
    or AudioDelta after the previous ResponseDone."""

    sid: str
    status: str = "completed"
    usage: ResponseUsage = ResponseUsage()

    def __post_init__(self) -> None:
        if self.status not in RESPONSE_STATUSES:
            raise ValueError(f"ResponseDone status must be one of {RESPONSE_STATUSES}, got {self.status!r}")


@dataclass(frozen=True, slots=True)
class SessionError:
    """A per-session failure, e.g. ``context_length_exceeded`` or ``invalid_audio``.

    ``fatal`` means the engine has already ended the session (it owns nothing any more); the
    server reports the error and closes the connection. A non-fatal error is only reported.
    """

    sid: str
    code: str
    message: str
    fatal: bool = False


@dataclass(frozen=True, slots=True)
class SessionAdmitted:
    """A session opened with ``queue_if_full=True`` left the queue and is now live."""

    sid: str


EngineEvent = Union[AudioDelta, TextDelta, ResponseDone, SessionError, SessionAdmitted]


# --------------------------------------------------------------------------------------------
# Stats
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TierBytes:
    """Bytes of one memory pool by tier. ``shared`` is counted once however many sessions share it."""

    shared: int
    private: int
    free: int

    def __post_init__(self) -> None:
        for name in TIERS:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"TierBytes.{name} must be a non-negative int, got {value!r}")


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine.

    Counters (``context_cache_*``, ``cfm_fallbacks``, ``cfm_prompt_passes``, ``ticks``) are cumulative since start.
    ``stage_latency_s`` holds the per-stage latency samples (seconds) of the most recent
    completed tick, the one numbered ``ticks``; a consumer observes them once per new ``ticks``.
    """

    live_sessions: int
    queued_sessions: int
    pools: Mapping[str, TierBytes] = field(default_factory=dict)  # e.g. "thinker_kv", "cfm_prompt"
    context_cache_hits: int = 0
    context_cache_misses: int = 0
    # Always 0 since a voice's prompt state is computed once (issue 10): there are no per-stream
    # rows left to compare. Kept for the /metrics series; remove together with metrics.py's.
    cfm_fallbacks: int = 0
    # Code2Wav voice prompt passes per voice (one at start per voice; never one per turn).
    cfm_prompt_passes: Mapping[str, int] = field(default_factory=dict)
    ticks: int = 0
    stage_latency_s: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    # Decode steps run through CUDA graphs, per model ("thinker", "talker"); empty when off.
    decode_graph_steps: Mapping[str, int] = field(default_factory=dict)
    # Short ragged steps (unit appends, Talker conditions) run through the same graphs as token
    # rows (engine.cuda_graphs), per model; not counted in decode_graph_steps.
    ragged_graph_steps: Mapping[str, int] = field(default_factory=dict)
    # Encoder ticks run through its piecewise graphs (engine.cuda_graphs); 0 when off.
    encoder_graph_ticks: int = 0
    # Graphs captured (decode + Code2Wav), by where: "warmup" (before serving) or "tick" (lazily,
    # inside a tick: a warm engine keeps this at 0). Empty for an engine that does not count them.
    graph_captures: Mapping[str, int] = field(default_factory=dict)
    # How long the warm-up took; None before (or without) one.
    warmup_seconds: float | None = None
    # Units closed with silence at the first tick after their caller's turn ended
    # (scheduler.tick_phases > 1, runtime/engine_session.py EarlyClose).
    early_closes: int = 0
    # Voices made from clients' reference recordings (runtime/reference_voices.py): held now,
    # registered since start (one Code2Wav prompt pass each), and sessions that were given a
    # voice already registered for the same recording (its state shared, nothing computed).
    reference_voices: int = 0
    reference_voices_added: int = 0
    # Thinker window compactions since start, every session (anchor kept, whole blocks dropped).
    window_compactions: int = 0
    reference_voice_reuses: int = 0


# --------------------------------------------------------------------------------------------
# The interface
# --------------------------------------------------------------------------------------------

@runtime_checkable
class EngineAPI(Protocol):
    def open_session(self, client_session: Mapping[str, Any], *, queue_if_full: bool = False,
                     sid: str | None = None) -> str:
        """Create a session from a client's ``session.update`` object; returns its id.

        ``sid``: the id to use (the server passes its wire id, so one id names the session in
        the server's events and logs, the engine and its per-session hashes such as the reply
        policy's ``reply_units``); ValueError if it is in use. None: the engine numbers it.

        Raises AdmissionError (no room and not queued), PrivateConfigKeyError or
        SessionConfigError (duplexcache.config), ReferenceAudioError (duplexcache.context).
        With ``queue_if_full`` a session that does not fit is queued (``is_queued`` is true)
        and a later tick emits SessionAdmitted for it.
        """
        ...

    def is_queued(self, sid: str) -> bool:
        """True while the session waits for admission (False once live, closed or unknown)."""
        ...

    def push_audio(self, sid: str, pcm: np.ndarray) -> None:
        """Append input audio: float32, 16 kHz, mono, shape (samples,). ValueError on bad audio
        or an unknown/queued session."""
        ...

    def close_session(self, sid: str) -> None:
        """End a live or queued session and free everything it owns; idempotent."""
        ...

    def set_turn_mode(self, sid: str, mode: str) -> None:
        """``"duplex"`` (default): the speak policy decides every unit. ``"manual"``: the session
        never starts a reply by itself; it speaks only after ``request_response``. ValueError on
        an unknown mode or session."""
        ...

    def request_response(self, sid: str) -> None:
        """Force the session's next unit to speak; the reply then runs as the policy/model
        continues it (until ``<|turn_eos|>``, a listen decision or the Talker's limit)."""
        ...

    def cancel_response(self, sid: str, played_ms: int | None = None) -> bool:
        """Stop the reply in progress at the next unit boundary: no more audio for it, then
        ``ResponseDone(status="cancelled")``. ``played_ms``: ms of this reply's audio the client
        played (None: all that was sent); the Thinker forgets the text of units not played.
        Returns False when no reply is in progress."""
        ...

    def add_user_text(self, sid: str, text: str) -> None:
        """Append a user text message (chat format) to the Thinker's context before the
        session's next unit. UserTextTooLong when it cannot fit the session's limits; ValueError
        for text that is not a message (empty, not encodable)."""
        ...

    def tick(self, unit_tick: bool = True) -> list[EngineEvent]:
        """Run one 1-second unit for every live session with >= 1 s of audio buffered.
        ``unit_tick`` False (after ``set_tick_phases(phases)`` with phases > 1): a tick between unit
        ticks, which takes early closes and units already held but starts no session's units."""
        ...

    def stats(self) -> EngineStats:
        ...

    def shutdown(self) -> None:
        """Close every session and release the engine's memory."""
        ...

    # ---------------------------------------------------------------- start-up
    def warmup(self, should_stop: Callable[[], bool] | None = None) -> Any:
        """Capture every graph and compile every kernel a tick can need, before serving; returns
        a report whose ``describe()`` is one log line, or None for an engine with nothing to warm.
        ``should_stop`` is asked between captures (a server shutting down)."""
        ...

    def waterfall(self) -> Any:
        """The card waterfall (``runtime/waterfall.Waterfall``: ``lines()``, every byte of the
        device by part), or None for an engine that does not account its device."""
        ...

    def describe_plan(self) -> str:
        """The memory plan in one line (pools, planned sessions), for start-up logs."""
        ...

    # ---------------------------------------------------------------- pacing (the scheduler)
    # A server sets these once, before its first tick, from its config (scheduler.*).
    def set_prefill_between_ticks(self, enabled: bool) -> None:
        """The server runs ``prefill_step`` in the slack between ticks: a tick then leaves a
        session that became pending since the last tick to that slack."""
        ...

    def set_unit_alignment(self, margin_ms: float | None) -> None:
        """Each new session's units end ``margin_ms`` plus its largest chunk before a tick of the
        server's grid; None cuts units from the stream's first sample."""
        ...

    def set_silence_fill(self, after_ms: float | None) -> None:
        """A session whose client sent nothing for ``after_ms`` past its unit has the unit
        completed with silence; None waits for audio."""
        ...

    def set_tick_phases(self, phases: int) -> None:
        """The server ticks ``phases`` times per unit; with more than one, units stay on the unit
        tick and the server says which tick is one (``tick(unit_tick=...)``)."""
        ...

    def prefill_pending(self) -> bool:
        """Whether a session waits for its context to be built or prefilled."""
        ...

    def prefill_step(self) -> list[EngineEvent]:
        """One prefill chunk between ticks (the next tick then runs none)."""
        ...

    def predicted_prefill_s(self) -> float | None:
        """Seconds the next ``prefill_step`` is expected to take (None: not measured yet)."""
        ...

    def sessions_behind(self) -> int:
        """Live sessions holding a whole unit more than the next tick takes (a server ticks
        early for them: scheduler.catch_up_ticks)."""
        ...

    # Ticks the engine counted late (its own period), and the units the last tick ran.
    late_ticks: int
    last_tick_units: int

    # ---------------------------------------------------------------- sessions and voices
    def queue_position(self, sid: str) -> int | None:
        """1 for the next queued session to be admitted, 2 for the one after...; None when
        ``sid`` is not queued."""
        ...

    def session_ids(self) -> list[str]:
        """Live (admitted, not queued) sessions, in admission order."""
        ...

    def admission_room(self) -> Any:
        """How many more sessions the engine would admit now (``runtime/admission.Headroom``:
        ``sessions``, ``limit``), from its plan and measured tick cost."""
        ...

    def context_tokens(self, client_session: Mapping[str, Any]) -> int:
        """The Thinker context length a ``session.update`` object would open with."""
        ...

    def voice_names(self) -> list[str] | None:
        """The voices a session may name, sorted; None: the engine does not check names."""
        ...

    def push_frame(self, sid: str, image: bytes) -> None:
        """A camera frame (JPEG or PNG bytes) for video session ``sid``'s next unit without one.
        A ValueError with ``code`` ``vision_unavailable`` without ``model.vision`` or for a session
        not opened with ``video``, ``invalid_image`` for a bad image, ``too_many_frames`` past 10."""
        ...

    def add_reference_voice(self, ref_audio: Any) -> str:
        """A voice name made from a client's reference recording (16 kHz float32 mono), the same
        name for the same recording; ReferenceAudioError (``duplexcache.context``) when unusable."""
        ...


def missing_members(engine: Any) -> list[str]:
    """The EngineAPI members ``engine`` lacks (a server refuses such an engine at start)."""
    members = [name for name in dir(EngineAPI) if not name.startswith("_")] + ["late_ticks", "last_tick_units"]
    return sorted({name for name in members if not hasattr(engine, name)})


TURN_MODES = ("duplex", "manual")
