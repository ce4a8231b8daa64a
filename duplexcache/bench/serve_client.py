"""One simulated caller of ``duplexcache bench serve``: the wire protocol, the real-time sender,
the receiver, and what one session measured.

All protocol knowledge sits in :class:`Wire` (event names, audio formats and rates), so a
protocol change (e.g. the OpenAI-compatible one: ``session.created`` on connect, then
``session.updated``) is adapted in one place. The client already tolerates an unsolicited
``session.created`` before its ``session.update``: it takes the session id from the first
``session.created``/``session.updated`` and starts sending then.

Timing: every time is ``loop.time()`` of the client's event loop (monotonic seconds).
* a user turn ends when the last chunk of its last speech unit has been sent;
* reply latency = first audio delta of the reply - end of the user turn it answers;
* a gap: the client plays each reply from its first delta; a delta that arrives after
  everything received so far has played out leaves a gap of (arrival - play-out end); gaps
  longer than :data:`GAP_S` are counted (arrival times against audio duration).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import itertools
import json
import logging
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np

from duplexcache.bench import workload as wl
from duplexcache.bench.video import frame_jpeg

logger = logging.getLogger(__name__)

GAP_S = 0.2
CHUNK_SAMPLES = 1_600        # 0.1 s of 16 kHz input per input_audio_buffer.append


def handshake_refusal_message(exc: BaseException) -> str:
    """' (<message>)' from a refused handshake's JSON error body (the server says why: a wrong
    path, the key, a per-address cap), or '' when the exception carries none."""
    body = getattr(getattr(exc, "response", None), "body", None) or b""
    try:
        return f" ({json.loads(body)['error']['message']})"
    except (ValueError, KeyError, TypeError):
        return ""


class Wire:
    """The realtime protocol as this client speaks it (duplexcache/server/protocol.py)."""

    INPUT_RATE = 16_000
    OUTPUT_RATE = 24_000
    INPUT_FORMAT = "pcm16"
    SUBPROTOCOLS: list[str] | None = None

    @staticmethod
    def url(url: str) -> str:
        return url

    @staticmethod
    def session_update(voice: str, instructions: str) -> str:
        return json.dumps({"type": "session.update", "session": {
            "voice": voice, "instructions": instructions, "input_audio_format": Wire.INPUT_FORMAT}})

    @staticmethod
    def append(pcm: np.ndarray) -> str:
        """float PCM in [-1, 1] -> an ``input_audio_buffer.append`` of pcm16 little-endian."""
        samples = np.round(np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2")
        return json.dumps({"type": "input_audio_buffer.append",
                           "audio": base64.b64encode(samples.tobytes()).decode("ascii")})

    @staticmethod
    def parse(text: str | bytes) -> tuple[str, Any]:
        """One server event -> (kind, value): ``session`` (its id), ``audio`` (output samples),
        ``text``, ``done`` (status), ``error`` ("code: message") or ``other`` (the type)."""
        event = json.loads(text)
        kind = event.get("type")
        if kind in ("session.created", "session.updated"):
            return "session", (event.get("session") or {}).get("id")
        if kind in ("response.output_audio.delta", "response.audio.delta"):
            return "audio", len(base64.b64decode(event.get("delta", ""))) // 2
        if kind in ("response.output_text.delta", "response.text.delta"):
            return "text", event.get("delta", "")
        if kind == "response.done":
            response = event.get("response") or {}
            reason = (response.get("status_details") or {}).get("reason")
            return "done", reason or response.get("status", "completed")
        if kind == "error":
            err = event.get("error") or {}
            return "error", f"{err.get('code')}: {err.get('message')}"
        return "other", kind


class MiniCPMoWire:
    """The MiniCPM-o Realtime dialect as this client speaks it (server/minicpmo_protocol.py):
    ``?mode=audio`` and the ``map.realtime`` subprotocol, ``session.init`` with the caller's
    voice as a reference recording, ``input.append`` of float32 16 kHz, float32 24 kHz audio
    deltas. Its callers share one reference voice per voice name (the server makes each once)."""

    INPUT_RATE = Wire.INPUT_RATE
    OUTPUT_RATE = Wire.OUTPUT_RATE
    SUBPROTOCOLS = ["map.realtime"]
    MODEL = "duplexcache-bench"

    @staticmethod
    def url(url: str) -> str:
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        query.update({"mode": "audio", "model": query.get("model", MiniCPMoWire.MODEL)})
        return urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), parts.fragment))

    @staticmethod
    def session_update(voice: str, instructions: str) -> str:
        return json.dumps({"type": "session.init", "payload": {
            "system_prompt": instructions, "voice": {"ref_audio_base64": reference_recording(voice)}}})

    @staticmethod
    def append(pcm: np.ndarray) -> str:
        samples = np.clip(pcm, -1.0, 1.0).astype("<f4")
        return json.dumps({"type": "input.append",
                           "input": {"audio": base64.b64encode(samples.tobytes()).decode("ascii")}})

    @staticmethod
    def parse(text: str | bytes) -> tuple[str, Any]:
        """As :meth:`Wire.parse`, for this dialect's events."""
        event = json.loads(text)
        kind = event.get("type")
        if kind == "session.created":
            return "session", event.get("session_id")
        if kind == "response.output_audio.delta":
            return "audio", len(base64.b64decode(event.get("audio", ""))) // 4
        if kind == "response.output_text.delta":
            return "text", event.get("text", "")
        if kind == "response.done":
            return "done", (event.get("response") or {}).get("status", "completed")
        if kind == "error":
            err = event.get("error") or {}
            return "error", f"{err.get('code')}: {err.get('message')}"
        return "other", kind


@functools.lru_cache(maxsize=None)
def reference_recording(voice: str, seconds: float = 1.0) -> str:
    """A deterministic 16 kHz float32 recording for a voice name (base64): a few harmonics of a
    pitch drawn from the name, so callers of one voice send the same recording."""
    pitch = 100.0 + int(hashlib.sha256(voice.encode("utf-8")).hexdigest()[:8], 16) % 150
    t = np.arange(int(Wire.INPUT_RATE * seconds)) / Wire.INPUT_RATE
    wave = sum(0.5 ** h * np.sin(2 * np.pi * pitch * (h + 1) * t) for h in range(4))
    samples = (0.4 * wave / np.abs(wave).max()).astype("<f4")
    return base64.b64encode(samples.tobytes()).decode("ascii")


class MiniCPMoVideoWire(MiniCPMoWire):
    """The MiniCPM-o dialect in ``mode=video``: each unit's first chunk carries that second's
    camera frame (``input.video_frames``), as the SDK's ``send_audio_video`` (bench/video.py)."""

    VIDEO = True

    @staticmethod
    def url(url: str) -> str:
        return MiniCPMoWire.url(url).replace("mode=audio", "mode=video")

    @staticmethod
    def append_with_frame(pcm: np.ndarray, jpeg: bytes) -> str:
        event = json.loads(MiniCPMoWire.append(pcm))
        event["input"]["video_frames"] = [base64.b64encode(jpeg).decode("ascii")]
        return json.dumps(event)


WIRES: dict[str, Any] = {"openai": Wire, "minicpmo": MiniCPMoWire, "minicpmo-video": MiniCPMoVideoWire}


@dataclass
class SessionTrace:
    """What one session sent and received (client clock)."""

    index: int
    voice: str
    dialect: str = "openai"                 # which wire protocol the caller spoke (WIRES)
    sid: str | None = None
    connected_at: float | None = None
    ready_at: float | None = None           # session id known; audio starts
    units_sent: int = 0
    turn_ends: dict[int, float] = field(default_factory=dict)   # turn index -> user turn end
    audio: list[tuple[float, int]] = field(default_factory=list)   # (arrival, samples)
    dones: list[float] = field(default_factory=list)               # response.done arrivals
    errors: list[str] = field(default_factory=list)
    script: wl.SessionScript | None = None


# Workloads with user turns, so with reply latencies: push_to_talk is the conversation of a caller
# that sends audio only while it speaks (the server hears silence in between: fill_silence_after_ms).
TURN_WORKLOADS = ("conversation", "push_to_talk")


def turn_end_chunk(script: wl.SessionScript, index: int, unit: int, seed: int) -> int:
    """The chunk of ``unit`` (0.1 s pieces, ``_unit_chunks``) that holds a turn's last speech
    sample: the turn ends, for its reply latency, when that chunk has been sent."""
    return (wl.speech_samples(script, index, unit, seed) - 1) // CHUNK_SAMPLES


def _unit_chunks(pcm: np.ndarray) -> list[np.ndarray]:
    """A unit's samples in <= 0.1 s pieces whose last one ends on the unit boundary."""
    return [pcm[i:i + CHUNK_SAMPLES] for i in range(0, pcm.size, CHUNK_SAMPLES)]


@dataclass(frozen=True)
class Caller:
    """How one simulated caller behaves."""

    index: int
    voice: str
    workload: str
    units: int
    seed: int
    shape: wl.ConversationShape
    instructions: str
    start_delay_s: float
    ready_timeout_s: float = 30.0
    drain_s: float = 5.0
    dialect: str = "openai"     # "openai" (Wire) or "minicpmo" (MiniCPMoWire)

    @property
    def wire(self) -> Any:
        return WIRES[self.dialect]

    def script(self, sid: str) -> wl.SessionScript:
        if self.workload in TURN_WORKLOADS:
            return wl.conversation_script(self.index, sid, self.units, self.seed, self.shape)
        return wl.continuous_script(sid, self.units)

    async def run(self, url: str, trace: SessionTrace, headers: dict[str, str] | None = None) -> None:
        """Connect after ``start_delay_s`` (with ``headers``, e.g. the server's key), stream the
        script in real time, drain, close. Every failure is recorded in ``trace.errors`` (never
        raised: one caller must not stop the others)."""
        from websockets.asyncio.client import connect

        await asyncio.sleep(self.start_delay_s)
        loop = asyncio.get_running_loop()
        try:
            wire = self.wire
            async with connect(wire.url(url), max_size=None, open_timeout=self.ready_timeout_s,
                               additional_headers=headers or None, subprotocols=wire.SUBPROTOCOLS) as ws:
                trace.connected_at = loop.time()
                ready = asyncio.Event()
                receiver = asyncio.create_task(self._receive(ws, trace, ready))
                try:
                    await ws.send(wire.session_update(self.voice, self.instructions))
                    await asyncio.wait_for(ready.wait(), self.ready_timeout_s)
                    if trace.sid is None:   # the server refused the session (the error is recorded)
                        return
                    await self._send(ws, trace)
                    await self._drain(trace)
                finally:
                    receiver.cancel()
                    await asyncio.gather(receiver, return_exceptions=True)
        except asyncio.TimeoutError:
            trace.errors.append(f"timeout: no session id within {self.ready_timeout_s:.0f} s"
                                if trace.ready_at is None else "timeout")
        except Exception as exc:  # noqa: BLE001 - recorded per session; the step goes on
            trace.errors.append(f"{type(exc).__name__}: {exc}{handshake_refusal_message(exc)}")

    async def _receive(self, ws: Any, trace: SessionTrace, ready: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        async for message in ws:
            now = loop.time()
            kind, value = self.wire.parse(message)
            if kind == "session":
                if trace.sid is None:
                    trace.sid, trace.ready_at = value, now
                    trace.script = self.script(str(value))
                    ready.set()
                elif value is not None and value != trace.sid:
                    trace.errors.append(f"session id changed from {trace.sid} to {value}")
            elif kind == "audio":
                trace.audio.append((now, value))
            elif kind == "done":
                if value != "session_closed":
                    trace.dones.append(now)
            elif kind == "error":
                trace.errors.append(value)
                if trace.sid is None:
                    ready.set()   # refused before it started (bad voice, admission): stop waiting

    async def _send(self, ws: Any, trace: SessionTrace) -> None:
        """Each unit's chunks at real-time pace from the moment the session was ready; a
        push-to-talk caller sends only the units of its own turns and nothing in between (the
        button is released), on the same clock."""
        assert trace.script is not None
        loop = asyncio.get_running_loop()
        start, sent = loop.time(), 0
        ends = {t.user_end - 1: t.index for t in trace.script.turns}   # last speech unit -> turn
        for u in range(trace.script.units):
            silent = self.workload == "push_to_talk" and not trace.script.speech[u]
            last = turn_end_chunk(trace.script, self.index, u, self.seed) if u in ends else None
            for c, chunk in enumerate(_unit_chunks(wl.unit_audio(trace.script, self.index, u, self.seed))):
                await asyncio.sleep(max(0.0, start + sent / Wire.INPUT_RATE - loop.time()))
                if not silent and c == 0 and getattr(self.wire, "VIDEO", False):   # 1 fps: a frame per unit
                    await ws.send(self.wire.append_with_frame(chunk, frame_jpeg(self.index, u)))
                elif not silent:
                    await ws.send(self.wire.append(chunk))
                sent += chunk.size
                if c == last:
                    trace.turn_ends[ends[u]] = loop.time()
            trace.units_sent = u + 1

    async def _drain(self, trace: SessionTrace) -> None:
        """Wait (at most ``drain_s``) for every reply that was scheduled in full."""
        assert trace.script is not None
        want = len(trace.script.complete_turns(trace.units_sent))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_s
        while len(trace.dones) < want and loop.time() < deadline:
            await asyncio.sleep(0.05)


# ------------------------------------------------------------------------------ analysis

def split_replies(trace: SessionTrace) -> list[list[tuple[float, int]]]:
    """Audio deltas grouped by reply: a reply ends with its ``response.done`` (sent after its
    last chunk); deltas after the last ``done`` form an unfinished reply."""
    replies: list[list[tuple[float, int]]] = []
    current: list[tuple[float, int]] = []
    dones = iter(sorted(trace.dones))
    next_done = next(dones, None)
    for t, n in sorted(trace.audio):
        while next_done is not None and next_done < t:
            if current:
                replies.append(current)
                current = []
            next_done = next(dones, None)
        current.append((t, n))
    if current:
        replies.append(current)
    return replies


def playback_gaps(deltas: list[tuple[float, int]], rate: int = Wire.OUTPUT_RATE) -> list[float]:
    """Silences a client playing ``deltas`` from the first arrival would hear."""
    gaps = []
    play_end = None
    for t, n in deltas:
        if play_end is not None and t > play_end:
            gaps.append(t - play_end)
        play_end = max(play_end if play_end is not None else t, t) + n / rate
    return gaps


def pair_replies(turn_ends: dict[int, float], starts: list[float]) -> list[tuple[int, float]]:
    """(turn index, latency) of each reply: it answers the latest user turn that ended before its
    first audio and that no earlier reply answered. A reply that is missing (a refused append, an
    ended session) then leaves its turn unanswered instead of shifting every later reply onto the
    turn before its own (the k-th reply was paired with the k-th turn: seen as 34-38 s latencies)."""
    pairs: list[tuple[int, float]] = []
    answered = -1
    for start in starts:
        before = [k for k, end in turn_ends.items() if end <= start and k > answered]
        if before:
            answered = max(before)
            pairs.append((answered, start - turn_ends[answered]))
    return pairs


def session_row(trace: SessionTrace) -> dict[str, Any]:
    """The per-session row of results.json."""
    script = trace.script
    replies = split_replies(trace)
    received_s = sum(n for _, n in trace.audio) / Wire.OUTPUT_RATE
    latencies: list[float] = []
    scheduled_s: float | None = None
    complete = 0
    if script is not None and script.workload == "conversation":
        complete = len(script.complete_turns(trace.units_sent))
        scheduled_s = float(sum(t.reply_units for t in script.complete_turns(trace.units_sent)))
        latencies = [latency for _, latency in pair_replies(trace.turn_ends, [r[0][0] for r in replies])]
    elif script is not None:
        scheduled_s = float(trace.units_sent)   # every unit speaks, its audio out in its own tick
    gaps = [g for reply in replies for g in playback_gaps(reply)]
    long_gaps = [g for g in gaps if g > GAP_S]
    return {
        "index": trace.index, "sid": trace.sid, "voice": trace.voice, "dialect": trace.dialect, "units_sent": trace.units_sent,
        "replies_scheduled": complete, "replies_done": len(trace.dones), "replies_with_audio": len(replies),
        "reply_latency_s": [round(x, 4) for x in latencies],
        "gaps_over_200ms": len(long_gaps), "max_gap_s": round(max(gaps), 4) if gaps else 0.0,
        "audio_received_s": round(received_s, 4), "audio_scheduled_s": scheduled_s,
        "audio_received_ratio": round(received_s / scheduled_s, 4) if scheduled_s else None,
        "got_audio": received_s > 0, "errors": collapse_repeats(trace.errors),
    }


def collapse_repeats(messages: list[str]) -> list[str]:
    """Runs of the same message as one, with its count: a refused caller is refused again at
    every append (10 a second), and 13 such callers made a 60 s step's results.json 800 kB."""
    runs = ((message, len(list(run))) for message, run in itertools.groupby(messages))
    return [message if count == 1 else f"{message} (x{count})" for message, count in runs]
