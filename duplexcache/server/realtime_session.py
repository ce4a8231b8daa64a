"""One client's realtime session: client events in, engine calls and server events out.

Life cycle (docs/protocol.md has the wire view):

* on connect: ``session.created`` with the defaults; no engine session yet, so ``session.update``
  may change everything.
* the engine session is opened by the first ``input_audio_buffer.append``, ``response.create``
  or ``conversation.item.create``, with the settings of that moment; from then on the settings
  the session was opened with (voice, instructions, ...) are fixed, turn detection is not.
* admission errors reach the client as ``error`` events (the engine's code, a generic message:
  pool sizes stay in the log; an append hears the same code at most once per
  ``QUEUE_NOTICE_S``, though capacity is asked again at every append); a queued session gets ``session.queued`` events with its position
  and its input audio is discarded until it is admitted (``session.admitted``).

All engine calls go through worker threads (the engine is thread-safe per engine_api).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Callable

import numpy as np

from duplexcache.runtime_config import PrivateConfigKeyError, SessionConfigError, build_runtime_config
from duplexcache.context.builder import ReferenceAudioError
from duplexcache.runtime.engine_api import (ADMISSION_MESSAGES, AdmissionError, ResponseUsage, ServerBehindError,
                                            UserTextTooLong)
from duplexcache.server import frames
from duplexcache.server import protocol as proto
from duplexcache.server.audio_io import AudioError, InputAudio, OutputAudio
from duplexcache.server.auth import Handshake
from duplexcache.server.client_items import MAX_USER_TEXT_CHARS, response_metadata, user_content
from duplexcache.server.connection import Connection
from duplexcache.server.resume import ResumeReport
from duplexcache.server.session_config import ECHOED_TEXTS, SessionSettings, apply_update, to_wire
from duplexcache.server.session_host import SessionHost
from duplexcache.server.turns import Outgoing, ResponseTracker, wire_name

logger = logging.getLogger(__name__)

# Admission codes that the session's settings alone decide (remembered until they change); any
# other code is asked again on the next append, as capacity is.
_SETTINGS_REFUSALS = frozenset({"context_length_exceeded"})
# Longest audio one append may carry: what the engine buffers per session (engine_session's
# MAX_BUFFERED_SECONDS); a longer chunk could only be refused after decoding it.
MAX_CHUNK_SECONDS = 10
# Period of a queued session's session.queued / queue_update notices (server/app.py's housekeeping)
# and of the admission error a refused client's audio appends hear: often enough that a waiting
# client sees its position move and a streaming one learns it is refused, rarely enough that a
# client streaming 20 ms chunks into a refusal is not sent 50 errors a second. The deploy key
# server.queue_notice_s until issue 44 (docs/engine.md, "Retired switches").
QUEUE_NOTICE_S = 2.0


def _vad_factory(threshold: float, silence_duration_ms: int, prefix_padding_ms: int) -> Any:
    from duplexcache.server.vad import SileroVAD  # lazy: onnxruntime loads only for server_vad sessions

    return SileroVAD(threshold=threshold, silence_duration_ms=silence_duration_ms,
                     prefix_padding_ms=prefix_padding_ms)


class RealtimeSession:
    def __init__(self, server: SessionHost, conn: Connection, handshake: Handshake, client: str,
                 model: str | None):
        self.server = server
        self.engine = server.engine
        self.conn = conn
        self.handshake = handshake
        self.client = client              # the peer address the per-client caps count by
        self.model = model
        self.id = proto.new_id("sess")    # the wire id; the engine's id is self.sid
        self.placement_key = ""           # the context key a cluster router placed it by
        conn.label = self.id
        # On a server with a vision model every session may send images (conversation.item.create
        # input_image), so each opens as a video session: admission sizes it for a frame per unit.
        self.settings = SessionSettings(video=frames.vision_served(server.config))
        self.openai_client = handshake.openai_client
        self.queue_if_full = False
        self.sid: str | None = None       # engine session (set by RealtimeServer.register only)
        self.opening = False              # engine.open_session in flight
        self.refusals = 0                 # admission refusals of this connection (logged once)
        # (settings, error) of a refusal that only the settings decide (context too long, bad
        # voice prompt, ...): the same settings get the same error without asking the engine again
        self.settings_refusal: tuple[SessionSettings, proto.ProtocolError] | None = None
        # (code, when) of the last refusal to open sent: an append refused with the same code hears
        # it again only after QUEUE_NOTICE_S (capacity is still asked at every append)
        self.refusal_notice: tuple[str, float] | None = None
        self.queued = False
        self.live_since: float | None = None   # when the engine admitted it (queue_wait's session lengths)
        self.audio: InputAudio | None = None
        self.output: OutputAudio | None = None    # the replies in the client's format (set at open)
        self.vad: Any = None
        self.tracker = ResponseTracker(handshake.beta)
        self.connected_at = self.last_input_at = time.monotonic()
        self.last_queue_notice = 0.0
        self.buffer_ms = 0                # input since the last commit (ms at the client's rate)
        self._committed_ms = 0            # client audio ms at the last commit/clear
        self.item_id = proto.new_id("item")
        self.pending_texts: list[str] = []     # conversation.item.create while queued
        self.pending_response = False          # response.create while queued
        self.response_requested = False        # asked the engine for a reply that has not started yet

    @property
    def log_name(self) -> str:
        """The session in log lines: its wire id, plus the engine's id where that differs (the
        engine takes the wire id, so it seldom does)."""
        return self.id if self.sid in (None, self.id) else f"{self.id} (engine {self.sid})"

    # ---------------------------------------------------------------- sending
    def send(self, event: dict[str, Any]) -> None:
        self.conn.send(event)

    def emit(self, items: list[Outgoing]) -> None:
        for item in items:
            self.conn.send(item.event, response_id=item.response_id, audio_bytes=item.audio_bytes)

    def error(self, code: str, message: str, *, event_id: str | None = None, param: str | None = None,
              error_type: str = proto.INVALID_REQUEST) -> None:
        self.server.metrics.protocol_errors.labels(code=code).inc()
        logger.info("error to client (session %s): %s: %s", self.log_name, code, message)
        self.send(proto.error_event(code, message, error_type=error_type, event_id=event_id, param=param))

    def _wire_session(self, texts: bool = False) -> dict[str, Any]:
        """The session object; ``texts``: with the instructions and initial text (only where the
        client's event set them, or at session.created, where they are the defaults)."""
        fmt = self.settings.input_format(self.openai_client) if self.audio is None else self.audio.format
        return to_wire(self.id, self.settings, fmt, "default", self.model, texts=texts)

    def announce(self) -> None:
        self.send(proto.event("session.created", session=self._wire_session(texts=True), **self._resume_token()))

    def _resume_token(self) -> dict[str, str]:
        """``resume_token`` for a session.created event (none when the server does not resume)."""
        token = self.server.resumes.issue(self)
        return {} if token is None else {"resume_token": token}

    def announce_resumed(self, report: ResumeReport) -> None:
        """The first event on the connection that resumed this session (server/resume.py)."""
        self.last_input_at = time.monotonic()   # the idle limit counts from the resume, not the drop
        self.send(proto.event("session.resumed", session=self._wire_session(), **dataclasses.asdict(report)))

    # ---------------------------------------------------------------- client events
    async def handle(self, ev: proto.ClientEvent) -> None:
        handler: Callable[[proto.ClientEvent], Any] = {
            "session.update": self._session_update,
            "input_audio_buffer.append": self._append,
            "input_audio_buffer.commit": self._commit,
            "input_audio_buffer.clear": self._clear,
            "response.create": self._response_create,
            "response.cancel": self._response_cancel,
            "conversation.item.create": self._item_create,
            "conversation.item.truncate": self._item_truncate,
            "session.close": self._session_close,
        }[ev.type]
        await handler(ev)

    async def _session_update(self, ev: proto.ClientEvent) -> None:
        body = ev.data.get("session")
        if isinstance(body, dict) and "type" in body:
            self.openai_client = True  # a GA client (session.type is required in GA): 24 kHz defaults
        queue_if_full = ev.data.get("queue_if_full", self.queue_if_full)
        if not isinstance(queue_if_full, bool):
            raise proto.ProtocolError("invalid_value", "queue_if_full must be true or false", ev.event_id,
                                      param="queue_if_full")
        settings, changed = apply_update(self.settings, ev.data.get("session", {}), ev.event_id,
                                         audio_started=self.sid is not None,
                                         voice_aliases=self.server.config.server.voice_aliases,
                                         max_text_chars=self.server.config.server.max_session_text_chars)
        self._check_engine_settings(settings, ev.event_id)
        if settings != self.settings or queue_if_full != self.queue_if_full:
            self.refusal_notice = None  # a changed request hears its own answer, whatever it is
        self.settings, self.queue_if_full = settings, queue_if_full
        if "turn_detection" in changed:
            self.vad = None  # rebuilt with the new parameters on the next audio
            if self.sid is not None and not self.queued:
                await self._apply_turn_mode()
        # The texts are echoed only when this update set them: the reply is then no larger than
        # the request, where it used to carry the whole session (3.9 MB for a 40-byte update).
        body = ev.data.get("session")
        echo_texts = isinstance(body, dict) and any(name in body for name in ECHOED_TEXTS)
        self.send(proto.event("session.updated", session=self._wire_session(texts=echo_texts)))

    def _check_engine_settings(self, settings: SessionSettings, eid: str | None) -> None:
        """The engine's own validation of what it will be opened with (window limits, voice, ...)."""
        # An unknown voice would only fail when the session opens, after session.updated had
        # confirmed it, so the update is refused instead (OpenAI's names arrive here mapped by
        # server.voice_aliases, unless a deployment removed them).
        known = self.engine.voice_names() if settings.voice is not None else None
        if known is not None and settings.voice not in known:
            raise proto.ProtocolError("invalid_value", f"unknown voice {proto.clip(settings.voice, 64)!r} (this "
                                      f"server has: {', '.join(known)}; GET /v1/voices lists them)",
                                      eid, param="session.voice")
        try:
            build_runtime_config(self.server.config, settings.engine_session())
        except PrivateConfigKeyError as exc:
            raise proto.ProtocolError("private_config_key", str(exc), eid) from None
        except SessionConfigError as exc:
            raise proto.ProtocolError("invalid_session_config", str(exc), eid) from None

    async def _append(self, ev: proto.ClientEvent) -> None:
        audio_b64 = proto.field(ev, "audio", str)
        if not await self._ensure_session(ev.event_id, streaming=True):
            return
        assert self.audio is not None
        self.last_input_at = time.monotonic()
        # A chunk longer than the engine can buffer can only be refused: say so from its base64
        # length, before decoding and resampling it, and without counting it as received (a
        # 3.9 MiB frame was decoded, resampled and counted in the input timestamps, then refused).
        seconds = self.audio.format.samples_in(len(audio_b64) * 3 // 4) / self.audio.format.rate
        if seconds > MAX_CHUNK_SECONDS + 0.01:   # base64 padding: a chunk of exactly the bound passes
            raise proto.ProtocolError("invalid_audio", f"a chunk of {seconds:.1f} s; at most {MAX_CHUNK_SECONDS} s "
                                      "per append (send audio in real time, in chunks)", ev.event_id)
        try:
            pcm = self.audio.push(audio_b64)
        except AudioError as exc:
            raise proto.ProtocolError("invalid_audio", str(exc), ev.event_id) from None
        self.buffer_ms = self.audio.ms_in - self._committed_ms
        if self.queued:
            return  # discarded while waiting for admission (session.queued says so)
        if pcm.size:
            try:
                await asyncio.to_thread(self.engine.push_audio, self.sid, pcm)
            except ServerBehindError as exc:
                # the server's fault: said as a server error, so clients do not slow down for it
                raise proto.ProtocolError(exc.code, str(exc), ev.event_id, error_type=proto.SERVER_ERROR) from None
            except ValueError as exc:
                raise proto.ProtocolError("invalid_audio", str(exc), ev.event_id) from None
            if self.settings.turn.type == "server_vad":
                await self._feed_vad(pcm)

    async def _commit(self, ev: proto.ClientEvent) -> None:
        if self.audio is None or self.buffer_ms <= 0:
            raise proto.ProtocolError("input_audio_buffer_commit_empty",
                                      "the input audio buffer is empty: append audio before committing", ev.event_id)
        self._committed(self.audio.ms_in)

    def _committed(self, at_ms: int) -> None:
        previous, self.item_id = self.item_id, proto.new_id("item")
        self._committed_ms, self.buffer_ms = at_ms, 0
        self.send(proto.event("input_audio_buffer.committed", previous_item_id=self.tracker.last_item_id,
                              item_id=previous))
        self.tracker.last_item_id = previous

    async def _clear(self, ev: proto.ClientEvent) -> None:
        # Audio already pushed stays in the model's context (a duplex model hears continuously);
        # clear drops what the resampler and the VAD hold.
        if self.audio is not None:
            self.audio.clear()
            self._committed_ms = self.audio.ms_in
        if self.vad is not None:
            self.vad.reset()
        self.buffer_ms = 0
        self.send(proto.event("input_audio_buffer.cleared"))

    async def _feed_vad(self, pcm: np.ndarray) -> None:
        if self.vad is None:
            turn = self.settings.turn
            self.vad = await asyncio.to_thread(_vad_factory, turn.threshold, turn.silence_duration_ms,
                                               turn.prefix_padding_ms)
        for vad_event in await asyncio.to_thread(self.vad.feed, pcm):
            if vad_event.kind == "speech_started":
                self.send(proto.event("input_audio_buffer.speech_started", audio_start_ms=vad_event.audio_ms,
                                      item_id=self.item_id))
                if self.settings.turn.interrupt_response:
                    await self._cancel(None, quiet=True)
            elif vad_event.kind == "speech_stopped":
                self.send(proto.event("input_audio_buffer.speech_stopped", audio_end_ms=vad_event.audio_ms,
                                      item_id=self.item_id))
                self._committed(self.audio.ms_in if self.audio is not None else 0)
                if self.settings.turn.create_response and self.tracker.current is None:
                    await self._request_response()

    async def _request_response(self) -> None:
        if self.queued:
            self.pending_response = True
            return
        self.response_requested = True
        await asyncio.to_thread(self.engine.request_response, self.sid)

    async def _response_create(self, ev: proto.ClientEvent) -> None:
        if self.tracker.current is not None or self.response_requested:
            raise proto.ProtocolError("conversation_already_has_active_response",
                                      "a response is already in progress; cancel it first", ev.event_id)
        metadata = response_metadata(ev)
        if await self._ensure_session(ev.event_id):
            self.tracker.next_metadata = metadata
            await self._request_response()

    async def _response_cancel(self, ev: proto.ClientEvent) -> None:
        if not await self._cancel(None):
            raise proto.ProtocolError("response_cancel_not_active", "there is no response in progress to cancel",
                                      ev.event_id)

    async def _cancel(self, played_ms: int | None, *, quiet: bool = False) -> bool:
        """Barge-in / response.cancel: stop the reply, drop its unsent audio. False if none runs."""
        if self.sid is None or self.queued:
            return False
        if self.pending_response:
            self.pending_response = False
            return True
        current = self.tracker.current
        if current is not None and current.cancelling:
            return True
        if played_ms is None and current is not None:
            played_ms = self.conn.played_ms(current.id)
        cancelled = await asyncio.to_thread(self.engine.cancel_response, self.sid, played_ms)
        if not cancelled:
            if current is None and self.response_requested:
                # A reply asked for and not started: the engine withdrew the request (False: no
                # response existed). Forget it too, or every later response.create is refused as
                # already active and the call never hears another reply.
                self.response_requested = False
                if not quiet:
                    logger.info("session %s: requested reply withdrawn before it started", self.id)
                return True
            return False
        self.response_requested = False
        if self.output is not None:
            self.output.reset()
        if self.tracker.mark_cancelling() is not None:
            dropped = self.conn.drop_pending(current.id)
            logger.info("session %s: reply %s cancelled at %s ms played; %d unsent events dropped",
                        self.id, current.id, played_ms, dropped)
        elif not quiet:
            logger.info("session %s: requested reply cancelled before it started", self.id)
        return True

    async def _item_create(self, ev: proto.ClientEvent) -> None:
        item = proto.field(ev, "item", dict)
        text, images = user_content(item, ev.event_id)
        if images and not self.settings.video:
            param = f"item.content[{images[0][0]}]"
            raise proto.ProtocolError("vision_unavailable", f"{param}: image input needs a server with a vision model "
                                      "(model.vision is false)", ev.event_id, param=param)
        if not await self._ensure_session(ev.event_id):
            return
        if images and self.queued:
            raise proto.ProtocolError("session_queued", "item.content: images are taken once the session is admitted "
                                      "(session.admitted)", ev.event_id, param="item.content")
        for index, image in images:   # each rides with the session's next unit without a frame
            await frames.push_frame(self.engine, self.sid, image, f"item.content[{index}]", ev.event_id)
        if text and self.queued:
            # Held here until admission, so bounded here: what the engine takes in one message.
            pending = sum(len(t) for t in self.pending_texts)
            if pending + len(text) > MAX_USER_TEXT_CHARS:
                raise proto.ProtocolError(
                    "user_text_too_long", f"{len(text)} characters of user text with {pending} already waiting "
                    f"for admission: at most {MAX_USER_TEXT_CHARS} wait", ev.event_id, param="item.content")
            self.pending_texts.append(text)
        elif text:
            await self._add_user_text(text, ev.event_id)
        self._item_added(item, text, len(images))

    def _item_added(self, item: dict[str, Any], text: str, images: int) -> None:
        """``conversation.item.added`` (+ ``.done``) for a user message; its images are echoed
        without their bytes (``{type: input_image}``)."""
        item_id = item.get("id") if isinstance(item.get("id"), str) else proto.new_id("item")
        content = [{"type": "input_image"}] * images + ([{"type": "input_text", "text": text}] if text else [])
        wire_item = {"id": proto.clip(item_id), "object": "realtime.item", "type": "message", "role": "user",
                     "status": "completed", "content": content}
        self.send(proto.event(wire_name("conversation.item.added", self.handshake.beta),
                              previous_item_id=self.tracker.last_item_id, item=wire_item))
        if not self.handshake.beta:
            self.send(proto.event("conversation.item.done", previous_item_id=self.tracker.last_item_id,
                                  item=wire_item))
        self.tracker.last_item_id = wire_item["id"]

    async def _item_truncate(self, ev: proto.ClientEvent) -> None:
        item_id = proto.field(ev, "item_id", str)
        audio_end_ms = proto.field(ev, "audio_end_ms", int)
        content_index = proto.field(ev, "content_index", int, required=False, default=0)
        if audio_end_ms < 0:
            raise proto.ProtocolError("invalid_value", "audio_end_ms must be >= 0", ev.event_id, param="audio_end_ms")
        current = self.tracker.current
        if current is not None and current.item_id == item_id:
            await self._cancel(audio_end_ms)
        elif item_id in self.tracker.finished_items:
            # The reply already ended; the engine keeps its text (it truncates only a running reply).
            logger.info("session %s: truncate of finished item %s acknowledged only", self.id, item_id)
        else:
            raise proto.ProtocolError("item_not_found", f"no assistant item {proto.clip(item_id)!r} in this session",
                                      ev.event_id, param="item_id")
        self.send(proto.event("conversation.item.truncated", item_id=item_id, content_index=content_index,
                              audio_end_ms=audio_end_ms))

    async def _session_close(self, ev: proto.ClientEvent) -> None:
        await self.server.end_session(self)
        self.send(proto.event("response.done", response={"status": "completed",
                                                         "status_details": {"reason": "session_closed"}}))
        self.conn.close(proto.CLOSE_NORMAL, "session closed")

    # ---------------------------------------------------------------- the engine session
    async def _ensure_session(self, eid: str | None, *, streaming: bool = False) -> bool:
        """Open the engine session with the current settings; False if refused (error sent, unless
        ``streaming`` (an audio append) and the same admission error went out within
        ``QUEUE_NOTICE_S``)."""
        if self.sid is not None:
            return True
        server = self.server
        if server.stopping:
            raise proto.ProtocolError("server_shutting_down", "the server is shutting down", eid,
                                      error_type=proto.SERVER_ERROR)
        if server.sessions_of(self.client) >= server.config.server.max_sessions_per_client:
            raise proto.ProtocolError("rate_limit_exceeded", "too many sessions from this client address "
                                      f"(server.max_sessions_per_client = {server.config.server.max_sessions_per_client})",
                                      eid, error_type=proto.RATE_LIMIT)
        refusal: proto.ProtocolError | None = None
        if self.settings_refusal is not None and self.settings_refusal[0] == self.settings:
            refusal = self.settings_refusal[1]
        else:
            refusal = server.refusals.get(self.settings)   # another connection's, same settings
        if refusal is not None:
            # Building the context again would give the same answer, and costs what tokenizing the
            # instructions costs (~0.25 s for a 2 MB string, on every append a client streams).
            self.settings_refusal = (self.settings, refusal)
            if self._told_recently(refusal.code, streaming):
                return False
            raise proto.ProtocolError(refusal.code, refusal.message, eid, param=refusal.param,
                                      error_type=refusal.error_type)
        fmt = self.settings.input_format(self.openai_client)
        self.opening = True  # counts against the per-client cap while the engine decides
        try:
            # The engine takes the wire id: one id in the client's events, the logs and the
            # engine's per-session hashes (the reply policy's reply_units).
            sid = await asyncio.to_thread(self.engine.open_session, self.settings.engine_session(),
                                          queue_if_full=self.queue_if_full, sid=self.id)
        except AdmissionError as exc:
            code = getattr(exc, "code", "admission_refused")
            # Each append of a refused connection asks again (it gets in once there is room): warn
            # once per connection, not once per 100 ms chunk (9 refused callers logged 1406 lines)
            self.refusals += 1
            logger.log(logging.WARNING if self.refusals == 1 else logging.DEBUG,
                       "session %s refused by the engine (%d time(s)): %s: %s", self.id, self.refusals, code,
                       exc.reason)
            if code in _SETTINGS_REFUSALS:
                raise self._refuse_settings(proto.ProtocolError(code, proto.clip(exc.reason, 300), eid)) from None
            if self._told_recently(code, streaming):
                return False
            server.metrics.protocol_errors.labels(code=code).inc()
            message = ADMISSION_MESSAGES.get(code, proto.clip(exc.reason, 300))
            self.send(proto.error_event(code, message, event_id=eid, error_type=(
                proto.SERVER_ERROR if code in ADMISSION_MESSAGES else proto.INVALID_REQUEST)))
            return False
        except ReferenceAudioError as exc:
            raise self._refuse_settings(proto.ProtocolError("invalid_reference_audio", str(exc), eid,
                                                            param="session.voice")) from None
        except PrivateConfigKeyError as exc:
            raise self._refuse_settings(proto.ProtocolError("private_config_key", str(exc), eid)) from None
        except ValueError as exc:
            # any ValueError: most are the settings', but not surely, so not shared with other connections
            raise self._refuse_settings(proto.ProtocolError("invalid_session_config", str(exc), eid),
                                        shared=False) from None
        finally:
            self.opening = False
        self.audio = InputAudio(fmt)
        self.output = OutputAudio(self.settings.output_kind)
        self.conn.output_bytes_per_ms = self.output.bytes_per_second // 1000
        self.tracker.audio_bytes_per_second = self.output.bytes_per_second
        self.tracker.text_only = not self.settings.audio_output
        server.register(self, sid)
        self.queued = await asyncio.to_thread(self.engine.is_queued, sid)
        if self.queued:
            logger.info("session %s queued for admission", self.log_name)
            self.notify_queued(time.monotonic())
        else:
            await self._on_live()
        return True

    def _refuse_settings(self, error: proto.ProtocolError, shared: bool = True) -> proto.ProtocolError:
        """Remember a refusal that only the current settings decide; returns it to raise.
        ``shared``: for every connection of the server too (RefusalMemory)."""
        self.settings_refusal = (self.settings, error)
        if shared:
            self.server.refusals.put(self.settings, error)
        self.refusal_notice = (error.code, time.monotonic())
        return error

    def _told_recently(self, code: str, streaming: bool) -> bool:
        """Whether to refuse an append without an error: this refusal went out within
        ``QUEUE_NOTICE_S`` (a client streaming 20 ms chunks would get 50 errors a second; its
        audio is dropped either way). Otherwise the error is about to be sent: note when."""
        now = time.monotonic()
        last = self.refusal_notice
        if streaming and last is not None and last[0] == code \
                and now - last[1] < QUEUE_NOTICE_S:
            return True
        self.refusal_notice = (code, now)
        return False

    async def _apply_turn_mode(self) -> None:
        mode = "duplex" if self.settings.turn.type == "duplex" else "manual"
        await asyncio.to_thread(self.engine.set_turn_mode, self.sid, mode)

    async def _add_user_text(self, text: str, eid: str | None) -> None:
        try:
            await asyncio.to_thread(self.engine.add_user_text, self.sid, text)
        except UserTextTooLong as exc:   # more text than the session's window takes before its next unit
            raise proto.ProtocolError(exc.code, str(exc), eid, param="item.content") from None
        except ValueError as exc:   # text the engine cannot take as a message
            raise proto.ProtocolError("invalid_value", str(exc), eid, param="item.content") from None

    async def _on_live(self) -> None:
        self.live_since = time.monotonic()
        await self._apply_turn_mode()
        texts, self.pending_texts = self.pending_texts, []
        for text in texts:
            try:
                await self._add_user_text(text, None)
            except proto.ProtocolError as exc:   # its item.added went out at create: say why it is dropped
                self.error(exc.code, f"{exc.message}; the message sent while queued is dropped", param=exc.param)
        if self.pending_response:
            self.pending_response = False
            await self._request_response()

    def queue_position(self) -> int | None:
        """This session's place in the engine's queue (None when it is not queued)."""
        try:
            return self.engine.queue_position(self.sid)
        except Exception:  # noqa: BLE001 - a notice is best effort
            logger.exception("engine.queue_position failed")
            return None

    def notify_queued(self, now: float) -> None:
        position = self.queue_position()
        self.last_queue_notice = now
        self.send(proto.event("session.queued", position=position,
                              message="waiting for admission; input audio is discarded until session.admitted"))

    async def on_admitted(self) -> None:
        if not self.queued:
            return  # admission can be seen twice (is_queued and SessionAdmitted race)
        self.queued = False
        await self._on_live()
        self.send(proto.event("session.admitted", session=self._wire_session()))

    # ---------------------------------------------------------------- engine output
    def on_audio(self, pcm16: bytes) -> None:
        self.response_requested = False
        current = self.tracker.current
        if current is not None and current.cancelling:
            return   # dropped by the tracker too; kept out of the output resampler
        audio = pcm16 if self.output is None else self.output.encode(pcm16)
        if audio:
            self.emit(self.tracker.on_audio(audio))

    def on_text(self, text: str) -> None:
        self.response_requested = False
        self.emit(self.tracker.on_text(text))

    def on_done(self, status: str, usage: ResponseUsage | None) -> None:
        self.response_requested = False
        current = self.tracker.current
        if status == "cancelled" and current is not None and not current.cancelling:
            # the engine's own barge-in decision (duplex mode): drop what the client has not got yet
            self.conn.drop_pending(current.id)
        self.server.metrics.responses.labels(status=status).inc()
        if self.output is not None:
            if status == "cancelled":
                self.output.reset()
            else:
                tail = self.output.flush()   # what the G.711 resampler held back: the reply's end
                if tail:
                    self.emit(self.tracker.on_audio(tail))
        self.emit(self.tracker.on_done(status, usage))
