"""A deterministic EngineAPI for server tests, plus websocket client helpers.

FakeEngine: admission capacity ``capacity`` (live sessions); every tick admits queued sessions
while there is room, then gives each live session with >= 1 s buffered one unit: an AudioDelta
of 24000 samples all equal to the unit number (so order and size are checkable), a TextDelta
``"unit <n>"``, and a ResponseDone after every ``done_after_units`` units. Instructions
``"overflow"`` make a session fail fatally with context_length_exceeded after its first unit.
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

from duplexcache.config import DeployConfig, build_runtime_config
from duplexcache.runtime.engine_api import (
    AdmissionError, AudioDelta, EngineEvent, EngineStats, ResponseDone, SessionAdmitted, SessionError, TextDelta,
    TierBytes,
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


class FakeEngine:
    def __init__(self, deploy: DeployConfig, capacity: int = 16, done_after_units: int = 3,
                 tick_delay: float = 0.0):
        self.deploy = deploy
        self.capacity = capacity
        self.done_after_units = done_after_units
        self.tick_delay = tick_delay
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
        self.turn_calls: list[tuple] = []

    # ------------------------------------------------------------------ EngineAPI
    def open_session(self, client_session: Mapping[str, Any], *, queue_if_full: bool = False) -> str:
        with self._lock:
            self.open_calls += 1
        build_runtime_config(self.deploy, client_session)  # the real engine validates the same way
        if client_session.get("voice") == "broken-ref":
            from duplexcache.context import ReferenceAudioError
            raise ReferenceAudioError("reference audio for voice 'broken-ref' is empty")
        with self._lock:
            sid = f"sess_{next(self._ids)}"
            session = _FakeSession(dict(client_session))
            if len(self.live) < self.capacity:
                self._admit(sid, session)
            elif queue_if_full:
                self.queued[sid] = session
            else:
                raise AdmissionError(f"memory budget full: {len(self.live)} live sessions use all "
                                     f"{self.capacity * BYTES_PER_SESSION} private bytes")
            self.opened += 1
            return sid

    def is_queued(self, sid: str) -> bool:
        with self._lock:
            return sid in self.queued

    def push_audio(self, sid: str, pcm: np.ndarray) -> None:
        if not isinstance(pcm, np.ndarray) or pcm.dtype != np.float32 or pcm.ndim != 1:
            raise ValueError("audio must be a float32 array of shape (samples,)")
        if pcm.size == 0 or not np.isfinite(pcm).all():
            raise ValueError("audio is empty or not finite")
        with self._lock:
            session = self.live.get(sid)
            if session is None:
                raise ValueError(f"unknown or queued session {sid!r}")
            session.buffered += pcm.size
            session.received.append(pcm.copy())

    def close_session(self, sid: str) -> None:
        with self._lock:
            if self.live.pop(sid, None) is not None or self.queued.pop(sid, None) is not None:
                self.closed.append(sid)

    # Turn control: recorded only (the server branch drives these; the real engine applies them).
    def set_turn_mode(self, sid: str, mode: str) -> None:
        if mode not in ("duplex", "manual"):
            raise ValueError(f"unknown turn mode {mode!r}")
        with self._lock:
            self.turn_calls.append(("set_turn_mode", sid, mode))

    def request_response(self, sid: str) -> None:
        with self._lock:
            self.turn_calls.append(("request_response", sid))

    def cancel_response(self, sid: str, played_ms: int | None = None) -> bool:
        with self._lock:
            self.turn_calls.append(("cancel_response", sid, played_ms))
            return sid in self.live

    def add_user_text(self, sid: str, text: str) -> None:
        with self._lock:
            self.turn_calls.append(("add_user_text", sid, text))

    def tick(self) -> list[EngineEvent]:
        with self._lock:
            self.ticks_in_flight += 1
            self.max_ticks_in_flight = max(self.max_ticks_in_flight, self.ticks_in_flight)
        if self.tick_delay:
            time.sleep(self.tick_delay)
        events: list[EngineEvent] = []
        with self._lock:
            while self.queued and len(self.live) < self.capacity:
                sid = next(iter(self.queued))
                self._admit(sid, self.queued.pop(sid))
                events.append(SessionAdmitted(sid))
            for sid, session in list(self.live.items()):
                events.extend(self._run_unit(sid, session))
            self.ticks += 1
            self.ticks_in_flight -= 1
        return events

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

    # ------------------------------------------------------------------ helpers
    def _admit(self, sid: str, session: _FakeSession) -> None:
        self.live[sid] = session
        self.received[sid] = session.received

    def _run_unit(self, sid: str, session: _FakeSession) -> list[EngineEvent]:
        if session.buffered < UNIT_IN:
            return []
        session.buffered -= UNIT_IN
        session.units += 1
        pcm = np.full(UNIT_OUT, session.units, dtype="<i2").tobytes()
        out: list[EngineEvent] = [AudioDelta(sid, pcm), TextDelta(sid, f"unit {session.units}")]
        if session.config.get("instructions") == "overflow":
            del self.live[sid]
            self.closed.append(sid)
            return out + [SessionError(sid, "context_length_exceeded", "window cannot fit", fatal=True)]
        if session.units % self.done_after_units == 0:
            out.append(ResponseDone(sid))
        return out


# ---------------------------------------------------------------------- client helpers

def pcm16_b64(samples: np.ndarray) -> str:
    return base64.b64encode(samples.astype("<i2").tobytes()).decode("ascii")


def f32_b64(samples: np.ndarray) -> str:
    return base64.b64encode(samples.astype("<f4").tobytes()).decode("ascii")


async def send(ws: Any, event: dict[str, Any]) -> None:
    await ws.send(json.dumps(event))


async def recv(ws: Any, timeout: float = 10.0) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def recv_type(ws: Any, kind: str, timeout: float = 10.0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Receive until an event of ``kind``; returns it and the events skipped on the way."""
    skipped = []
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        event = await recv(ws, max(0.01, deadline - asyncio.get_running_loop().time()))
        if event["type"] == kind:
            return event, skipped
        skipped.append(event)


def wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
