"""A deterministic EngineAPI for server tests, plus websocket client helpers.

FakeEngine: admission capacity ``capacity`` (live sessions); every tick admits queued sessions
while there is room, then gives each live session with >= 1 s buffered one unit: an AudioDelta
of 24000 samples all equal to the unit number (so order and size are checkable), a TextDelta
``"unit <n>"``, and a ResponseDone after every ``done_after_units`` units. Instructions
``"overflow"`` make a session fail fatally with context_length_exceeded after its first unit.

Turn control (engine_api's pinned turn API): in turn mode "duplex" every unit speaks as above; in
"manual" a unit speaks only inside a reply that ``request_response`` started (a reply is
``done_after_units`` units). ``cancel_response`` ends the reply at the next tick with
ResponseDone(status="cancelled") and records ``(sid, played_ms)`` in ``cancels``;
``add_user_text`` records into ``user_texts``. ``queue_position`` is 1-based. A session opened
with ``audio_output: false`` gets no AudioDelta (text only), as the engine's.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from duplexcache.config import DeployConfig
from duplexcache.runtime_config import build_runtime_config
from duplexcache.runtime.memory.admission import Headroom
from duplexcache.runtime.engine_api import (
    TURN_MODES, AdmissionError, AudioDelta, EngineEvent, EngineStats, ResponseDone, ResponseUsage, SessionAdmitted,
    SessionError, TextDelta, TierBytes, UserTextTooLong,
)

UNIT_IN = 16_000
UNIT_OUT = 24_000
BYTES_PER_SESSION = 256 * 1024


@dataclass
class _FakeSession:
    config: Mapping[str, Any]
    buffered: int = 0
    units: int = 0
    received: list[np.ndarray] = field(default_factory=list)
    turn_mode: str = "duplex"
    reply_units: int = 0          # units spoken in the current reply (0 = no reply running)
    requested: bool = False       # request_response() seen, reply not started yet
    cancel_pending: bool = False


class FakeEngine:
    def __init__(self, deploy: DeployConfig, capacity: int = 16, done_after_units: int = 3,
                 tick_delay: float = 0.0, tick_units: int | None = None):
        self.deploy = deploy
        self.capacity = capacity
        self.done_after_units = done_after_units
        self.tick_delay = tick_delay
        self.behind = 0          # what sessions_behind() reports (server catch-up ticks)
        self.push_error: Exception | None = None   # raised by every push_audio while set
        self.pending_chunks = 0                    # prefill chunks of opening sessions still to run
        self.prefill_cost: float | None = None     # what predicted_prefill_s() reports
        self.chunks_in_ticks = 0
        self.prefill_error: Exception | None = None   # raised by every prefill_step while set
        self.prefill_failures = 0
        self.chunks_between_ticks = 0
        self._ran_between = False
        self.pacing_prefill: bool | None = None    # what the server told set_prefill_between_ticks
        self.unit_alignment_ms: float | None | str = "unset"   # what it told set_unit_alignment
        self.silence_fill_ms: float | None | str = "unset"     # what it told set_silence_fill
        self.tick_phases: int | str = "unset"                   # what it told set_tick_phases
        self.unit_ticks: list[bool] = []                        # each tick's unit_tick argument
        self.tick_units = tick_units   # what every tick reports in last_tick_units (None: its live sessions)
        self.last_tick_units = 0      # DuplexEngine's: units the last tick ran
        self.catch_ups: list[bool] = []                         # each tick: did it follow a "behind" answer?
        self._behind_answered = False
        self.behind_asked = 0
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.live: dict[str, _FakeSession] = {}
        self.queued: dict[str, _FakeSession] = {}
        self.received: dict[str, list[np.ndarray]] = {}  # every sid ever live -> pushed audio
        self.closed: list[str] = []
        self.ticks = 0
        self.ticks_in_flight = 0
        self.max_ticks_in_flight = 0
        self.shutdown_called = False
        self.opened = 0
        self.open_calls = 0  # every call, refused ones included
        self.turn_modes: dict[str, list[str]] = {}       # sid -> every mode set, in order
        self.response_requests: dict[str, int] = {}
        self.cancels: list[tuple[str, int | None]] = []
        self.user_texts: dict[str, list[str]] = {}
        self.user_text_room: int | None = None           # characters of user text a session takes (None: any)
        self.user_text_failure: Exception | None = None  # raised by add_user_text (a bug of the engine's)
        self.admission_code: str | None = None           # refuse every open_session with this code
        self.configs: dict[str, dict[str, Any]] = {}     # sid -> the client session it was opened with
        self.late_ticks = 0                              # the engine's own late count (the server's is separate)
        self.voices: Any = None                          # a VoiceRegistry makes voice names checked

    # ------------------------------------------------------------------ EngineAPI
    def open_session(self, client_session: Mapping[str, Any], *, queue_if_full: bool = False,
                     sid: str | None = None) -> str:
        with self._lock:
            self.open_calls += 1
        build_runtime_config(self.deploy, client_session)  # the real engine validates the same way
        if client_session.get("voice") == "broken-ref":
            from duplexcache.context import ReferenceAudioError
            raise ReferenceAudioError("reference audio for voice 'broken-ref' is empty")
        if self.admission_code is not None:
            error = AdmissionError(f"refused by test ({self.admission_code}): 123456 private bytes in use")
            error.code = self.admission_code
            raise error
        with self._lock:
            if sid is not None and (sid in self.live or sid in self.queued):
                raise ValueError(f"session id {sid!r} is in use")
            sid = sid or f"sess_{next(self._ids)}"
            session = _FakeSession(dict(client_session))
            if len(self.live) < self.capacity:
                self._admit(sid, session)
            elif queue_if_full:
                self.queued[sid] = session
            else:
                raise AdmissionError(f"memory budget full: {len(self.live)} live sessions use all "
                                     f"{self.capacity * BYTES_PER_SESSION} private bytes")
            self.opened += 1
            self.configs[sid] = dict(client_session)
            return sid

    def is_queued(self, sid: str) -> bool:
        with self._lock:
            return sid in self.queued

    def queue_position(self, sid: str) -> int | None:
        with self._lock:
            order = list(self.queued)
            return order.index(sid) + 1 if sid in self.queued else None

    # ------------------------------------------------------------------ turn control
    def _session(self, sid: str) -> _FakeSession:
        session = self.live.get(sid) or self.queued.get(sid)
        if session is None:
            raise ValueError(f"unknown session {sid!r}")
        return session

    def set_turn_mode(self, sid: str, mode: str) -> None:
        if mode not in TURN_MODES:
            raise ValueError(f"unknown turn mode {mode!r}")
        with self._lock:
            self._session(sid).turn_mode = mode
            self.turn_modes.setdefault(sid, []).append(mode)

    def request_response(self, sid: str) -> None:
        with self._lock:
            self._session(sid).requested = True
            self.response_requests[sid] = self.response_requests.get(sid, 0) + 1

    def cancel_response(self, sid: str, played_ms: int | None = None) -> bool:
        with self._lock:
            session = self._session(sid)
            if not (session.reply_units or session.requested) or session.cancel_pending:
                return False
            session.cancel_pending = True
            self.cancels.append((sid, played_ms))
            return True

    def add_user_text(self, sid: str, text: str) -> None:
        with self._lock:
            self._session(sid)
            if self.user_text_failure is not None:
                raise self.user_text_failure
            have = sum(len(t) for t in self.user_texts.get(sid, []))
            if self.user_text_room is not None and have + len(text) > self.user_text_room:
                raise UserTextTooLong(f"user text of {len(text)} characters (with {have} pending) does not fit")
            self.user_texts.setdefault(sid, []).append(text)

    def push_audio(self, sid: str, pcm: np.ndarray) -> None:
        if not isinstance(pcm, np.ndarray) or pcm.dtype != np.float32 or pcm.ndim != 1:
            raise ValueError("audio must be a float32 array of shape (samples,)")
        if pcm.size == 0 or not np.isfinite(pcm).all():
            raise ValueError("audio is empty or not finite")
        with self._lock:
            session = self.live.get(sid)
            if session is None:
                raise ValueError(f"unknown or queued session {sid!r}")
            if self.push_error is not None:
                raise self.push_error
            session.buffered += pcm.size
            session.received.append(pcm.copy())

    def close_session(self, sid: str) -> None:
        with self._lock:
            if self.live.pop(sid, None) is not None or self.queued.pop(sid, None) is not None:
                self.closed.append(sid)

    def tick(self, unit_tick: bool = True) -> list[EngineEvent]:
        self.unit_ticks.append(unit_tick)
        with self._lock:   # the server ticks at once after sessions_behind() > 0: a catch-up tick
            self.catch_ups.append(self._behind_answered)
            self._behind_answered = False
        with self._lock:
            self.ticks_in_flight += 1
            self.max_ticks_in_flight = max(self.max_ticks_in_flight, self.ticks_in_flight)
        if self.tick_delay:
            time.sleep(self.tick_delay)
        events: list[EngineEvent] = []
        with self._lock:
            if self.pending_chunks > 0 and not self._ran_between:   # the real engine's rule (less deferral)
                self.pending_chunks -= 1
                self.chunks_in_ticks += 1
            self._ran_between = False
            while self.queued and len(self.live) < self.capacity:
                sid = next(iter(self.queued))
                self._admit(sid, self.queued.pop(sid))
                events.append(SessionAdmitted(sid))
            for sid, session in list(self.live.items()):
                events.extend(self._run_unit(sid, session))
            self.last_tick_units = len(self.live) if self.tick_units is None else self.tick_units
            self.ticks += 1
            self.ticks_in_flight -= 1
        return events

    def prefill_pending(self) -> bool:
        with self._lock:
            return self.pending_chunks > 0

    def prefill_step(self) -> list[EngineEvent]:
        if self.prefill_error is not None:
            self.prefill_failures += 1
            raise self.prefill_error
        with self._lock:
            if self.pending_chunks > 0:
                self.pending_chunks -= 1
                self.chunks_between_ticks += 1
            self._ran_between = True
        return []

    def predicted_prefill_s(self) -> float | None:
        return self.prefill_cost

    def set_prefill_between_ticks(self, enabled: bool) -> None:
        self.pacing_prefill = enabled

    def set_unit_alignment(self, margin_ms: float | None) -> None:
        self.unit_alignment_ms = margin_ms

    def set_silence_fill(self, after_ms: float | None) -> None:
        self.silence_fill_ms = after_ms

    def set_tick_phases(self, phases: int) -> None:
        self.tick_phases = phases

    def sessions_behind(self) -> int:
        with self._lock:
            self.behind_asked += 1
            self._behind_answered = self.behind > 0
            return self.behind

    def stats(self) -> EngineStats:
        with self._lock:
            live = len(self.live)
            return EngineStats(
                live_sessions=live, queued_sessions=len(self.queued),
                pools={"thinker_kv": TierBytes(shared=BYTES_PER_SESSION if live else 0,
                                               private=live * BYTES_PER_SESSION,
                                               free=(self.capacity - live) * BYTES_PER_SESSION)},
                context_cache_hits=max(0, self.opened - 1), context_cache_misses=min(1, self.opened),
                cfm_fallbacks=0, ticks=self.ticks,
                stage_latency_s={"thinker": (0.002,), "code2wav": (0.03,)} if self.ticks else {},
            )

    def shutdown(self) -> None:
        with self._lock:
            self.shutdown_called = True
            for sid in list(self.live) + list(self.queued):
                self.closed.append(sid)
            self.live.clear()
            self.queued.clear()

    # ------------------------------------------------------------------ the rest of EngineAPI
    def warmup(self, should_stop: Any = None) -> None:
        return None   # nothing to warm

    def waterfall(self) -> None:
        return None   # no device to account

    def describe_plan(self) -> str:
        return f"fake engine: {self.capacity} sessions"

    def session_ids(self) -> list[str]:
        with self._lock:
            return list(self.live)

    def admission_room(self) -> Headroom:
        with self._lock:
            return Headroom(max(0, self.capacity - len(self.live)), "memory")

    def context_tokens(self, client_session: Mapping[str, Any]) -> int:
        return len(str(client_session.get("instructions", "")))

    def voice_names(self) -> list[str] | None:
        return None if self.voices is None else sorted(self.voices.names())

    def push_frame(self, sid: str, image: bytes) -> None:
        from duplexcache.runtime.stages.vision_stage import VisionUnavailable
        raise VisionUnavailable("camera frames need a server with a vision model (model.vision is false)")

    def add_reference_voice(self, ref_audio: Any) -> str:
        from duplexcache.context import ReferenceAudioError
        error = ReferenceAudioError("this engine takes no reference voices")
        error.code = "unsupported_parameter"   # what the MiniCPM-o dialect reports for it
        raise error

    # ------------------------------------------------------------------ helpers
    def _admit(self, sid: str, session: _FakeSession) -> None:
        self.live[sid] = session
        self.received[sid] = session.received

    def _run_unit(self, sid: str, session: _FakeSession) -> list[EngineEvent]:
        out: list[EngineEvent] = []
        if session.cancel_pending:
            out.append(ResponseDone(sid, status="cancelled", usage=self._usage(session)))
            session.cancel_pending = session.requested = False
            session.reply_units = 0
        if session.buffered < UNIT_IN:
            return out
        session.buffered -= UNIT_IN
        session.units += 1
        speaks = session.turn_mode == "duplex" or session.requested or session.reply_units > 0
        if not speaks:
            return out
        session.requested = False
        session.reply_units += 1
        pcm = np.full(UNIT_OUT, session.units, dtype="<i2").tobytes()
        if session.config.get("audio_output", True):   # as the engine: a text-only session gets no audio
            out.append(AudioDelta(sid, pcm))
        out.append(TextDelta(sid, f"unit {session.units}"))
        if session.config.get("instructions") == "overflow":
            del self.live[sid]
            self.closed.append(sid)
            return out + [SessionError(sid, "context_length_exceeded", "window cannot fit", fatal=True)]
        if session.reply_units == self.done_after_units:
            out.append(ResponseDone(sid, usage=self._usage(session)))
            session.reply_units = 0
        return out

    @staticmethod
    def _usage(session: _FakeSession) -> ResponseUsage:
        spoken = session.config.get("audio_output", True)
        return ResponseUsage(text_tokens=2 * session.reply_units,
                             audio_seconds=float(session.reply_units) if spoken else 0.0)


# ---------------------------------------------------------------------- client helpers

def pcm16_b64(samples: np.ndarray) -> str:
    return base64.b64encode(samples.astype("<i2").tobytes()).decode("ascii")


def f32_b64(samples: np.ndarray) -> str:
    return base64.b64encode(samples.astype("<f4").tobytes()).decode("ascii")


async def send(ws: Any, event: dict[str, Any]) -> None:
    await ws.send(json.dumps(event))


async def recv(ws: Any, timeout: float = 60.0) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def recv_type(ws: Any, kind: str, timeout: float = 60.0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Receive until an event of ``kind``; returns it and the events skipped on the way."""
    skipped = []
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        event = await recv(ws, max(0.01, deadline - asyncio.get_running_loop().time()))
        if event["type"] == kind:
            return event, skipped
        skipped.append(event)


def sid_of(engine: FakeEngine, instructions: str) -> str:
    """The engine id of the session opened with ``instructions`` (the server assigns wire ids)."""
    sids = [sid for sid, cfg in engine.configs.items() if cfg.get("instructions") == instructions]
    assert len(sids) == 1, (instructions, engine.configs)
    return sids[0]


def wait_for(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class LoopbackServers:
    """Real apps on loopback over fake engines (one tiny deploy each), stopped together.

    ``start(engine_cls, server={...}, **engine_kwargs)`` sets ``deploy.server`` fields from
    ``server`` and returns ``(engine, server)``; tests use it through a fixture that calls
    ``stop_all`` at teardown."""

    def __init__(self, tick_seconds: float) -> None:
        self.tick_seconds = tick_seconds
        self._servers: list = []

    def start(self, engine_cls=FakeEngine, server: Mapping[str, Any] | None = None, **engine_kwargs):
        from duplexcache.server.app import create_app
        from duplexcache.server.loopback import LoopbackServer

        deploy = DeployConfig.default("tiny")
        deploy.engine.tick_seconds = self.tick_seconds
        for name, value in (server or {}).items():
            setattr(deploy.server, name, value)
        engine = engine_cls(deploy, **engine_kwargs)
        srv = LoopbackServer(create_app(engine, deploy)).start()
        self._servers.append(srv)
        return engine, srv

    def stop_all(self) -> None:
        for srv in self._servers:
            srv.stop()
        self._servers.clear()


def connect_realtime(srv, **kwargs):
    """A websockets client connection to ``srv``'s realtime endpoint (no frame size limit)."""
    from websockets.asyncio.client import connect

    from duplexcache.server.app import REALTIME_PATH

    return connect(srv.ws_url(REALTIME_PATH), max_size=None, open_timeout=10, **kwargs)
