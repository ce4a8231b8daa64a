"""One client's session in the MiniCPM-o Realtime dialect (server/minicpmo_protocol.py).

Everything below the wire is the OpenAI dialect's: this class is a
:class:`~duplexcache.server.realtime_session.RealtimeSession` whose client events and server
events are MiniCPM-o's. Admission and queueing, the per-client caps, the refusal bookkeeping, the
input resampler and its checks, barge-in (``_cancel``), the housekeeping limits and the metrics
are the base class's, so the two dialects cannot drift apart there; the engine is never told
which dialect a session speaks.

Life cycle on the wire:

* on connect: ``session.queue_done`` (the SDK sends ``session.init`` only after it). Admission
  is decided at ``session.init``, because the session's size depends on it (system prompt,
  reference voice, window, ``tts_enabled``): a session that does not fit is queued
  (``session.queued``, then ``session.queue_update`` every ``realtime_session.QUEUE_NOTICE_S``, with
  ``position``, ``queue_length`` and ``estimated_wait_s`` from server/queue_wait.py) and gets
  ``session.queue_done`` again when admitted;
* ``session.created`` {session_id} once the engine session is live;
* ``input.append``: float32 16 kHz audio; ``force_listen`` cuts the reply in progress;
  ``video_frames`` (``mode=video``, a server with ``model.vision``): JPEG frames, each riding
  with the session's next unit (server/frames.py; a bad frame is an ``error`` naming
  ``input.video_frames[i]``, and the append's audio is still taken);
* replies: ``response.output_text.delta`` / ``response.output_audio.delta`` (float32 24 kHz;
  none with ``tts_enabled: false``, which is the engine's ``audio_output`` off: no Talker or
  Code2Wav work for the session), then an empty ``response.output_text.delta`` with
  ``end_of_turn``, ``response.output_text.done`` (the whole text as ``output_text``),
  ``response.done`` with the reply's usage and the session's cumulative ``usage``, and
  ``response.listen``: the model listens again;
* ``session.close`` -> ``session.closed`` {reason, usage}, then the socket closes (1000).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from duplexcache.context.builder import ReferenceAudioError
from duplexcache.runtime.engine_api import ResponseUsage
from duplexcache.server import frames
from duplexcache.server import minicpmo_protocol as mp
from duplexcache.server import protocol as proto
from duplexcache.server.audio_io import OUTPUT_RATE
from duplexcache.server.auth import Handshake
from duplexcache.server.connection import Connection
from duplexcache.server.realtime_session import RealtimeSession
from duplexcache.server.resume import ResumeReport
from duplexcache.server.session_config import SessionSettings
from duplexcache.server.session_host import SessionHost

logger = logging.getLogger(__name__)

# The audio encoder's embeddings per second of input (100 ms each) and the Talker's speech
# tokens per second of output: what usage counts audio in.
AUDIO_TOKENS_PER_SECOND = 10
SPEECH_TOKENS_PER_SECOND = 25
# The resampler's queries: the Thinker tokens of one camera frame (models/vision.py query_num).
VISION_TOKENS_PER_FRAME = 64


@dataclass
class _Reply:
    id: str
    text: list[str] = dataclasses.field(default_factory=list)
    audio_bytes: int = 0          # pcm16 bytes sent (what played_ms counts)
    cancelling: bool = False


class _Replies:
    """The reply in progress. Has what the base class's barge-in (``_cancel``) reads of the
    OpenAI dialect's ResponseTracker: ``current`` and ``mark_cancelling``."""

    def __init__(self) -> None:
        self.current: _Reply | None = None
        self.audio_bytes_per_second = 2 * OUTPUT_RATE   # set by the base class at open
        self.last_item_id: str | None = None

    def start(self) -> _Reply:
        if self.current is None:
            self.current = _Reply(proto.new_id("resp"))
        return self.current

    def mark_cancelling(self) -> _Reply | None:
        if self.current is not None:
            self.current.cancelling = True
        return self.current


class MiniCPMoSession(RealtimeSession):
    """A RealtimeSession spoken to in the MiniCPM-o Realtime protocol."""

    # app.RealtimeServer parses each text frame with its session's parser.
    parse_event = staticmethod(mp.parse_client_event)

    def __init__(self, server: SessionHost, conn: Connection, handshake: Handshake, client: str,
                 model: str | None, mode: str | None = None):
        super().__init__(server, conn, handshake, client, model)
        self.mode = mode
        # the dialect's input: float32 mono at 16 kHz, the engine's own rate
        self.settings = SessionSettings(input_kind="f32", input_rate=16_000, video=mode == "video")
        self.queue_if_full = True        # the SDK waits in the queue; it never retries a refusal
        self.tracker = _Replies()        # type: ignore[assignment]  # what _cancel reads
        self.initialized = False
        self.usage = mp.Usage(AUDIO_TOKENS_PER_SECOND, SPEECH_TOKENS_PER_SECOND)

    # ---------------------------------------------------------------- sending
    def announce(self) -> None:
        refusal = None
        if self.mode not in (None, *mp.MODES):
            refusal = f"mode={proto.clip(str(self.mode))!r} is not served (modes: {', '.join(mp.MODES)})"
        elif self.mode == "video" and not frames.vision_served(self.server.config):
            refusal = ("mode='video' needs a server with a vision model (model.vision is false); connect with "
                       "mode=audio")
        if refusal is not None:
            # after the accept, so the SDK's connect() raises with this code and message
            self.error("unsupported_mode", refusal, param="mode")
            self.conn.close(proto.CLOSE_POLICY, "unsupported mode")
            return
        self.send(mp.event("session.queue_done"))

    def _usage_wire(self) -> dict[str, Any]:
        if self.audio is not None:
            self.usage.input_audio_seconds = self.audio.ms_in / 1000
        return self.usage.to_wire()

    # ---------------------------------------------------------------- client events
    async def handle(self, ev: Any) -> None:
        if ev.type == "session.init":
            await self._init(ev)
        elif ev.type == "input.append":
            await self._input(ev)
        else:
            await self._close(ev)

    async def _init(self, ev: mp.ClientEvent) -> None:
        if self.initialized:
            raise proto.ProtocolError("session_already_initialized", "session.init was already sent on this "
                                      "connection", param="type")
        init = mp.parse_session_init(ev)
        # tts_enabled false: the engine's text-only switch (no Talker/Code2Wav work, nor reservation)
        settings = dataclasses.replace(self.settings, instructions=init.system_prompt, audio_output=init.tts_enabled)
        if init.max_kv_tokens is not None:
            settings = dataclasses.replace(settings, window=self._window(init.max_kv_tokens))
        if init.ref_audio is not None:
            settings = dataclasses.replace(settings, voice=await self._reference_voice(init.ref_audio))
        self.settings = settings
        self.initialized = True
        try:
            opened = await self._ensure_session(None)
        except proto.ProtocolError as exc:
            self.initialized = False   # nothing was opened: a corrected session.init may follow
            if exc.param == "session.voice":   # the base class names the OpenAI field
                exc.param = "payload.voice.ref_audio_base64"
            raise
        if not opened:
            self.initialized = False
            return
        try:
            self.usage.context_tokens = int(await asyncio.to_thread(self.engine.context_tokens,
                                                                    self.settings.engine_session()))
        except Exception:  # noqa: BLE001 - usage is best effort; the session is open
            logger.exception("session %s: counting its context tokens failed", self.log_name)
        if not self.queued:
            self._created()

    def _window(self, max_kv_tokens: int) -> dict[str, int]:
        """``max_kv_tokens`` as the session's window: its high mark, the low mark at the server's
        ratio (the window slides back to it when the high mark is reached)."""
        stage0 = self.server.config.stage0
        high, low = stage0.window.high_tokens, stage0.window.low_tokens
        param = "payload.config.max_kv_tokens"
        if not 2 <= max_kv_tokens <= high:
            raise proto.ProtocolError("invalid_value", f"{param}: must be between 2 and this server's window of "
                                      f"{high} tokens, got {max_kv_tokens}", param=param)
        return {"high_tokens": max_kv_tokens, "low_tokens": max(1, max_kv_tokens * low // high)}

    async def _reference_voice(self, ref_audio: Any) -> str:
        param = "payload.voice.ref_audio_base64"
        try:
            return await asyncio.to_thread(self.engine.add_reference_voice, ref_audio)
        except ReferenceAudioError as exc:
            raise proto.ProtocolError(getattr(exc, "code", "invalid_reference_audio"), f"{param}: {exc}",
                                      param=param) from None

    async def _input(self, ev: mp.ClientEvent) -> None:
        append = mp.parse_input_append(ev)
        if not self.initialized or self.sid is None:
            raise proto.ProtocolError("session_not_initialized", "input.append before session.init (send it after "
                                      "session.queue_done)", param="type")
        if append.force_listen:
            # barge-in: the reply in progress stops at the next unit and its unsent audio is dropped
            await self._cancel(None, quiet=True)
        # Frames first, so that each rides with the unit its audio completes; a refused frame is
        # reported after the append's audio is taken (the call goes on without a gap in its audio).
        refused = await self._frames(append.video_frames)
        if append.audio:
            try:
                await self._append(proto.ClientEvent("input_audio_buffer.append", None, {"audio": append.audio}))
            except proto.ProtocolError as exc:
                if exc.code == "invalid_audio":
                    exc.param = "input.audio"
                raise
        if refused is not None:
            raise refused

    async def _frames(self, images: tuple[bytes, ...]) -> proto.ProtocolError | None:
        """Hand ``input.video_frames`` to the engine; the first refusal, to raise after the audio."""
        if not images:
            return None
        if self.mode != "video":
            return proto.ProtocolError("unsupported_parameter", "input.video_frames: this session is mode=audio; "
                                       "connect with mode=video to send frames", param="input.video_frames")
        if self.queued:
            return None   # discarded while waiting for admission, as the audio is
        for i, image in enumerate(images):
            try:
                await frames.push_frame(self.engine, self.sid, image, f"input.video_frames[{i}]")
            except proto.ProtocolError as exc:
                return exc
            self.usage.vision_tokens += VISION_TOKENS_PER_FRAME
        return None

    async def _close(self, ev: mp.ClientEvent) -> None:
        reason = mp.close_reason(ev)
        await self.server.end_session(self)
        self.send(mp.event("session.closed", reason=reason, usage=self._usage_wire()))
        self.conn.close(proto.CLOSE_NORMAL, "session closed")

    # ---------------------------------------------------------------- admission
    def _created(self) -> None:
        self.send(mp.event("session.created", session_id=self.id, model=self.model, usage=self._usage_wire(),
                           **self._resume_token()))

    def announce_resumed(self, report: ResumeReport) -> None:
        self.last_input_at = time.monotonic()
        self.send(mp.event("session.resumed", session_id=self.id, usage=self._usage_wire(),
                           **dataclasses.asdict(report)))

    def notify_queued(self, now: float) -> None:
        position = self.queue_position()
        # the first notice is session.queued, later ones updates (the SDK reads both)
        kind = "session.queued" if self.last_queue_notice == 0.0 else "session.queue_update"
        self.last_queue_notice = now
        # The SDK cannot send audio until session.created: waiting in the queue is not idleness
        # (server.idle_timeout_s would otherwise end every queue wait longer than it).
        self.last_input_at = now
        queued = self.server.queued_sessions()
        wait = self.server.estimated_wait_s(position or queued, now)
        self.send(mp.event(kind, position=position, queue_length=max(queued, position or 0), estimated_wait_s=wait))

    async def on_admitted(self) -> None:
        if not self.queued:
            return  # admission can be seen twice (is_queued and SessionAdmitted race)
        self.queued = False
        await self._on_live()
        self.send(mp.event("session.queue_done"))
        self._created()

    # ---------------------------------------------------------------- engine output
    def on_audio(self, pcm16: bytes) -> None:
        self.response_requested = False
        if not pcm16:
            return
        reply = self.tracker.start()
        if reply.cancelling:
            return
        reply.audio_bytes += len(pcm16)
        # audio_bytes in pcm16 bytes: the outbox counts what was written for played_ms
        self.conn.send(mp.event("response.output_audio.delta", response_id=reply.id, audio=mp.float32_b64(pcm16),
                                sample_rate=OUTPUT_RATE), response_id=reply.id, audio_bytes=len(pcm16))

    def on_text(self, text: str) -> None:
        self.response_requested = False
        reply = self.tracker.start()
        if reply.cancelling:
            return
        reply.text.append(text)
        self.conn.send(mp.event("response.output_text.delta", response_id=reply.id, text=text, end_of_turn=False),
                       response_id=reply.id)

    def on_done(self, status: str, usage: ResponseUsage | None) -> None:
        self.response_requested = False
        reply, self.tracker.current = self.tracker.current, None
        if reply is None:
            reply = _Reply(proto.new_id("resp"))
        if status == "cancelled" and not reply.cancelling:
            self.conn.drop_pending(reply.id)   # the engine's own barge-in: drop what is not sent yet
        self.server.metrics.responses.labels(status=status).inc()
        text_tokens = usage.text_tokens if usage is not None else 0
        audio_s = usage.audio_seconds if usage is not None else reply.audio_bytes / 2 / OUTPUT_RATE
        self.usage.output_text_tokens += text_tokens
        self.usage.output_audio_seconds += audio_s
        text = "".join(reply.text)
        self.send(mp.event("response.output_text.delta", response_id=reply.id, text="", end_of_turn=True))
        # The whole text as output_text, not text: the SDK reads a done event's text as one more
        # TextDelta, which would repeat the reply's deltas to it.
        self.send(mp.event("response.output_text.done", response_id=reply.id, output_text=text))
        reply_usage = mp.Usage(AUDIO_TOKENS_PER_SECOND, SPEECH_TOKENS_PER_SECOND, output_text_tokens=text_tokens,
                               output_audio_seconds=audio_s).to_wire()
        self.send(mp.event("response.done", response={"id": reply.id, "status": status,
                                                      "output_text": text, "usage": reply_usage},
                           usage=self._usage_wire()))
        # The reply is over (completed or cut): the model listens again. The SDK moves to its
        # LISTENING state on it (it also counts it as a TurnCompleted, as it does response.done).
        self.send(mp.event("response.listen", response_id=reply.id))


def session_for(server: SessionHost, conn: Connection, handshake: Handshake, client: str,
                query: Any) -> RealtimeSession:
    """The session object for a new connection: this dialect's when the handshake chose it."""
    if handshake.dialect == "minicpmo":
        return MiniCPMoSession(server, conn, handshake, client, query.get("model"), query.get("mode"))
    return RealtimeSession(server, conn, handshake, client, query.get("model"))

