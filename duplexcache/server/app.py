"""The realtime server: a FastAPI app (WebSocket ``/v1/realtime``, ``/health``, ``/metrics``).

Ownership:

* :class:`RealtimeServer` owns the engine handle, the session-id -> connection map, the metrics
  and the one tick task. It is the only code that calls the engine.
* :class:`Connection` owns one WebSocket and its outbox; only its sender task writes to the
  socket, so the tick loop never waits on a slow client.

The tick task calls ``engine.tick()`` in a worker thread (``asyncio.to_thread``) every
``engine.tick_seconds`` and awaits it before the next one, so two ticks never overlap; a tick
that overruns its period is logged and counted (``late_ticks``) and the next one starts at
once, without a catch-up burst. Other engine calls also go through worker threads so a busy
engine never stalls the event loop (the engine is thread-safe per ``engine_api``).

Warm start: the lifespan starts listening at once, then runs ``engine.warmup()`` (when the engine
has one: ``DuplexEngine`` captures every CUDA graph and compiles every kernel, runtime/warmup.py)
in a worker thread; the tick loop starts after it. Until then ``/health`` answers 503
``{"status": "warming"}`` and a WebSocket is accepted, sent an ``error`` event
(``server_warming_up``) and closed with 1013 (try again later): refusing is explicit, and a client
waiting through a 30 s warm-up inside the WebSocket handshake would hit its open timeout anyway.
A failed warm-up leaves the server up but unready (503 ``warmup_failed`` with the error), so a
load balancer never routes to it and the log says why.

The app is a plain ASGI app, so it can be served by uvicorn or mounted as a Ray Serve ingress.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, WebSocket
from fastapi.responses import JSONResponse, Response

from duplexcache.config import DeployConfig, PrivateConfigKeyError, SessionConfigError, SessionRuntimeConfig, \
    build_runtime_config
# Imported at start-up, not on first use: it loads torch, which would stall the event loop.
from duplexcache.context.builder import ReferenceAudioError
from duplexcache.runtime.engine_api import (
    INPUT_SAMPLE_RATE, OUTPUT_SAMPLE_RATE, AdmissionError, AudioDelta, EngineAPI, EngineEvent, ResponseDone,
    SessionAdmitted, SessionError, TextDelta,
)
from duplexcache.server import protocol as proto
from duplexcache.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

REALTIME_PATH = "/v1/realtime"
# Events queued for one client before it is dropped as too slow (about a minute of output).
MAX_PENDING_EVENTS = 1024
# A tick is late when it ends more than this fraction of a period after its deadline.
LATE_SLACK = 0.1
# WebSocket close code "Try Again Later" (RFC 6455 registry): the server is warming up.
CLOSE_TRY_AGAIN_LATER = 1013
# Engine-reported error codes that describe the client's input rather than a server fault.
_CLIENT_ERROR_CODES = frozenset({"invalid_audio", "context_length_exceeded", "invalid_reference_audio"})


@dataclass(frozen=True)
class _Close:
    code: int
    reason: str


class Connection:
    """One WebSocket: its session (if any) and an outbox drained by its own sender task."""

    def __init__(self, ws: WebSocket, max_pending: int = MAX_PENDING_EVENTS):
        self.ws = ws
        self.sid: str | None = None                       # set by RealtimeServer only
        self.runtime: SessionRuntimeConfig | None = None  # effective settings of the session
        self.created_sent = False                         # session.created went out (session is live)
        self.closing = False                              # a close frame is queued; send nothing more
        self._outbox: asyncio.Queue[dict[str, Any] | _Close] = asyncio.Queue()
        self._max_pending = max_pending
        self._sender: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._sender = asyncio.create_task(self._run_sender())

    def send(self, event: dict[str, Any]) -> None:
        if self.closing:
            return
        if self._outbox.qsize() >= self._max_pending:
            logger.warning("client of session %s is too slow (%d events pending); closing", self.sid,
                           self._outbox.qsize())
            self._abort(proto.CLOSE_POLICY, "client too slow")
            return
        self._outbox.put_nowait(event)

    def close(self, code: int, reason: str) -> None:
        """Queue a close frame after everything already queued."""
        if not self.closing:
            self.closing = True
            self._outbox.put_nowait(_Close(code, reason[:120]))  # close reasons are limited to 123 bytes

    def _abort(self, code: int, reason: str) -> None:
        """Drop the backlog and close now: the sender may be stuck in a send that never drains."""
        self.closing = True
        if self._sender is not None:
            self._sender.cancel()
        while not self._outbox.empty():
            self._outbox.get_nowait()
        self._sender = asyncio.create_task(self._close_now(code, reason))

    async def _close_now(self, code: int, reason: str, timeout: float = 5.0) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(code=code, reason=reason), timeout)

    async def finish(self, timeout: float = 5.0) -> None:
        """Let the sender flush (bounded by ``timeout``), then stop it."""
        if self._sender is None:
            return
        self.close(proto.CLOSE_NORMAL, "")
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(self._sender, timeout)

    async def _run_sender(self) -> None:
        try:
            while True:
                item = await self._outbox.get()
                if isinstance(item, _Close):
                    await self.ws.close(code=item.code, reason=item.reason)
                    return
                await self.ws.send_text(proto.encode(item))
        except Exception as exc:  # noqa: BLE001 - any send failure means the client is gone
            logger.debug("sender of session %s stopped: %r", self.sid, exc)
            self.closing = True


class RealtimeServer:
    def __init__(self, engine: EngineAPI, config: DeployConfig, metrics: ServerMetrics | None = None):
        if not isinstance(engine, EngineAPI):
            raise TypeError(f"engine {type(engine).__name__} does not implement EngineAPI")
        self.engine = engine
        self.config = config
        self.metrics = metrics or ServerMetrics()
        self._by_sid: dict[str, Connection] = {}
        self._connections: set[Connection] = set()
        self._stopping = asyncio.Event()
        self._tick_task: asyncio.Task[None] | None = None
        self.warm_state = "warming"            # -> "ready" | "warmup_failed"
        self.warmup_error: str | None = None

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    # ---------------------------------------------------------------- lifecycle

    @property
    def ready(self) -> bool:
        return self.warm_state == "ready"

    async def start(self) -> None:
        """Start warming up and then ticking, in the background (the app listens meanwhile)."""
        assert self._tick_task is None, "RealtimeServer.start called twice"
        self._tick_task = asyncio.create_task(self._warm_then_tick(), name="duplexcache-tick")

    async def _warm_then_tick(self) -> None:
        warmup = getattr(self.engine, "warmup", None)   # optional: not part of EngineAPI
        if warmup is not None:
            start = time.perf_counter()
            try:
                # should_stop: a shutdown during the warm-up does not wait for every capture.
                report = await asyncio.to_thread(warmup, should_stop=self._stopping.is_set)
            except Exception as exc:  # noqa: BLE001 - report it on /health, keep the process up
                logger.exception("engine warm-up failed; the server stays unready")
                self.warmup_error = f"{type(exc).__name__}: {exc}"
                self.warm_state = "warmup_failed"
                return
            if self._stopping.is_set():
                logger.info("warm-up stopped: the server is shutting down")
                return
            logger.info("warm-up finished in %.2f s (%s); ready", time.perf_counter() - start,
                        getattr(report, "describe", lambda: report)())
        self.metrics.update(await asyncio.to_thread(self.engine.stats))
        self.warm_state = "ready"
        await self._tick_loop()

    async def stop(self) -> None:
        """Graceful shutdown: finish the running tick, close every session, shut the engine down."""
        self._stopping.set()
        if self._tick_task is not None:
            await self._tick_task  # never shut the engine down under a running tick
        conns = list(self._connections)
        for conn in conns:
            await self._end_session(conn)
            conn.close(proto.CLOSE_GOING_AWAY, "server shutting down")
        await asyncio.gather(*(conn.finish() for conn in conns))
        await asyncio.to_thread(self.engine.shutdown)
        logger.info("server stopped: closed %d connection(s)", len(conns))

    # ---------------------------------------------------------------- tick loop

    async def _tick_loop(self) -> None:
        loop = asyncio.get_running_loop()
        period = self.config.engine.tick_seconds
        deadline = loop.time() + period
        while not self._stopping.is_set():
            await self._tick_once()
            now = loop.time()
            if now > deadline + LATE_SLACK * period:
                self.metrics.late_ticks.inc()
                logger.warning("tick ran late: ended %.3f s past its deadline (tick_seconds %.3f); "
                               "the next tick starts now", now - deadline, period)
                deadline = now  # no catch-up burst
            else:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), max(0.0, deadline - now))
            deadline += period

    async def _tick_once(self) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            events = await asyncio.to_thread(self.engine.tick)
        except Exception:  # noqa: BLE001 - an engine bug must not kill the server loop
            logger.exception("engine tick failed")
            self.metrics.tick_errors.inc()
            events = []
        self.metrics.tick_duration.observe(loop.time() - start)
        self._route(events)
        try:
            self.metrics.update(await asyncio.to_thread(self.engine.stats))
        except Exception:  # noqa: BLE001
            logger.exception("engine stats failed")

    def _route(self, events: list[EngineEvent]) -> None:
        for event in events:
            conn = self._by_sid.get(event.sid)
            if conn is None:
                logger.debug("dropping %s for closed session %s", type(event).__name__, event.sid)
                continue
            if isinstance(event, AudioDelta):
                conn.send(proto.audio_delta(event.pcm16))
            elif isinstance(event, TextDelta):
                conn.send(proto.text_delta(event.text))
            elif isinstance(event, ResponseDone):
                conn.send(proto.response_done())
            elif isinstance(event, SessionAdmitted):
                self._announce_created(conn)
            elif isinstance(event, SessionError):
                self._route_session_error(conn, event)
            else:
                logger.error("unknown engine event %r", event)

    def _route_session_error(self, conn: Connection, event: SessionError) -> None:
        kind = proto.INVALID_REQUEST if event.code in _CLIENT_ERROR_CODES else proto.SERVER_ERROR
        self._send_error(conn, event.code, event.message, error_type=kind)
        if event.fatal:
            # The engine already ended the session; forget it so nothing closes it twice.
            self._by_sid.pop(event.sid, None)
            conn.sid = None
            conn.close(proto.CLOSE_NORMAL, event.code)

    def _announce_created(self, conn: Connection) -> None:
        if conn.created_sent or conn.sid is None:
            return  # admission can be seen twice (is_queued and SessionAdmitted race); announce once
        assert conn.runtime is not None, "a session is registered together with its runtime config"
        conn.created_sent = True
        conn.send(proto.session_created(conn.sid, conn.runtime, OUTPUT_SAMPLE_RATE, INPUT_SAMPLE_RATE))

    def _send_error(self, conn: Connection, code: str, message: str, *, error_type: str = proto.INVALID_REQUEST,
                    event_id: str | None = None) -> None:
        self.metrics.protocol_errors.labels(code=code).inc()
        logger.info("error to client (session %s): %s: %s", conn.sid, code, message)
        conn.send(proto.error_event(code, message, error_type=error_type, event_id=event_id))

    # ---------------------------------------------------------------- sockets

    async def handle_socket(self, ws: WebSocket) -> None:
        await ws.accept()
        if self._stopping.is_set():
            await ws.close(code=proto.CLOSE_GOING_AWAY, reason="server shutting down")
            return
        conn = Connection(ws)
        conn.start()
        self._connections.add(conn)
        self.metrics.connections.set(len(self._connections))
        try:
            await self._receive_loop(conn)
        finally:
            await self._end_session(conn)  # a disconnect frees everything the session owned
            self._connections.discard(conn)
            self.metrics.connections.set(len(self._connections))
            await conn.finish()

    async def _receive_loop(self, conn: Connection) -> None:
        limit = self.config.server.max_frame_bytes
        while not conn.closing:
            try:
                message = await conn.ws.receive()
            except RuntimeError:  # receive after the socket closed
                return
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            if text is None:
                size = len(message.get("bytes") or b"")
            else:  # base64 JSON is ASCII: skip the copy that encoding would make
                size = len(text) if text.isascii() else len(text.encode("utf-8"))
            if size > limit:
                logger.warning("closing session %s: frame of %d bytes > max_frame_bytes %d", conn.sid, size, limit)
                self.metrics.protocol_errors.labels(code="frame_too_large").inc()
                conn.close(proto.CLOSE_TOO_BIG, f"frame of {size} bytes exceeds max_frame_bytes {limit}")
                return
            if text is None:
                self._send_error(conn, "binary_frame", "binary frames are not supported; send JSON text frames")
                continue
            try:
                await self._handle_event(conn, proto.parse_client_event(text))
            except proto.ProtocolError as exc:
                self._send_error(conn, exc.code, exc.message, event_id=exc.event_id)

    async def _handle_event(self, conn: Connection, event: proto.ClientEvent) -> None:
        if isinstance(event, proto.SessionUpdate):
            await self._open_session(conn, event)
        elif isinstance(event, proto.AudioAppend):
            await self._append_audio(conn, event)
        else:
            if conn.sid is None:
                raise proto.ProtocolError("session_not_found", "session.close without a session", event.event_id)
            await self._end_session(conn)
            conn.send(proto.response_done(reason="session_closed"))
            conn.close(proto.CLOSE_NORMAL, "session closed")

    async def _open_session(self, conn: Connection, event: proto.SessionUpdate) -> None:
        eid = event.event_id
        if conn.sid is not None:
            raise proto.ProtocolError("session_already_exists",
                                      f"this connection already has session {conn.sid}; open a new connection", eid)
        if self._stopping.is_set():
            raise proto.ProtocolError("server_shutting_down", "the server is shutting down", eid)
        runtime = _check_session_config(self.config, event.session, eid)
        try:
            sid = await asyncio.to_thread(self.engine.open_session, event.session,
                                          queue_if_full=event.queue_if_full)
        except AdmissionError as exc:
            raise proto.ProtocolError("admission_refused", exc.reason, eid) from None
        except ReferenceAudioError as exc:
            raise proto.ProtocolError("invalid_reference_audio", str(exc), eid) from None
        except PrivateConfigKeyError as exc:  # the engine checks again; same codes as ours
            raise proto.ProtocolError("private_config_key", str(exc), eid) from None
        except ValueError as exc:  # SessionConfigError or another refusal of the settings
            raise proto.ProtocolError("invalid_session_config", str(exc), eid) from None
        conn.sid, conn.runtime = sid, runtime
        self._by_sid[sid] = conn
        if await asyncio.to_thread(self.engine.is_queued, sid):
            logger.info("session %s queued for admission", sid)
        else:
            self._announce_created(conn)

    async def _append_audio(self, conn: Connection, event: proto.AudioAppend) -> None:
        eid = event.event_id
        if conn.sid is None:
            raise proto.ProtocolError("session_not_found",
                                      "send session.update before input_audio_buffer.append", eid)
        if not conn.created_sent:
            raise proto.ProtocolError("session_not_admitted",
                                      "the session is queued for admission; send audio after session.created", eid)
        assert conn.runtime is not None
        try:
            pcm = proto.decode_audio(event.audio_b64, conn.runtime.input_audio_format)
        except proto.ProtocolError as exc:
            raise proto.ProtocolError(exc.code, exc.message, eid) from None
        try:
            await asyncio.to_thread(self.engine.push_audio, conn.sid, pcm)
        except ValueError as exc:
            raise proto.ProtocolError("invalid_audio", str(exc), eid) from None

    async def _end_session(self, conn: Connection) -> None:
        sid, conn.sid = conn.sid, None
        if sid is None:
            return
        self._by_sid.pop(sid, None)
        try:
            # shielded: a cancelled connection task must still free the session's memory
            await asyncio.shield(asyncio.to_thread(self.engine.close_session, sid))
        except Exception:  # noqa: BLE001 - closing must go on for the other sessions
            logger.exception("engine.close_session(%s) failed", sid)
        logger.info("session %s closed", sid)


def _check_session_config(config: DeployConfig, session: dict[str, Any], eid: str | None) -> SessionRuntimeConfig:
    """The effective settings of a client session, or a ProtocolError naming what is wrong."""
    try:
        return build_runtime_config(config, session)
    except PrivateConfigKeyError as exc:
        raise proto.ProtocolError("private_config_key", str(exc), eid) from None
    except SessionConfigError as exc:
        raise proto.ProtocolError("invalid_session_config", str(exc), eid) from None


async def _refuse_unready(ws: WebSocket, server: RealtimeServer) -> None:
    """A connection before the warm-up finished: one error event, then close 1013."""
    await ws.accept()
    if server.warm_state == "warming":
        code, message = "server_warming_up", "the server is warming up (capturing CUDA graphs); retry when /health is ok"
    else:
        code, message = "server_unavailable", f"the server's warm-up failed: {server.warmup_error}"
    server.metrics.protocol_errors.labels(code=code).inc()
    with contextlib.suppress(Exception):   # the client may be gone already
        await ws.send_text(proto.encode(proto.error_event(code, message, error_type=proto.SERVER_ERROR)))
        await ws.close(code=CLOSE_TRY_AGAIN_LATER, reason=code)


def create_app(engine: EngineAPI, config: DeployConfig) -> FastAPI:
    """The ASGI app; its lifespan starts the tick loop and shuts everything down on exit."""
    server = RealtimeServer(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await server.start()
        try:
            yield
        finally:
            await server.stop()

    app = FastAPI(title="duplexcache realtime", lifespan=lifespan)
    app.state.server = server

    @app.get("/health")
    async def health() -> JSONResponse:
        if not server.ready and not server.stopping:
            # warming (capturing graphs, compiling kernels) or a failed warm-up: not ready to serve
            body: dict[str, Any] = {"status": server.warm_state}
            if server.warmup_error is not None:
                body["error"] = server.warmup_error
            return JSONResponse(body, status_code=503)
        stats = await asyncio.to_thread(engine.stats)
        stopping = server.stopping
        body = {"status": "stopping" if stopping else "ok", "live_sessions": stats.live_sessions,
                "queued_sessions": stats.queued_sessions, "connections": server.num_connections}
        return JSONResponse(body, status_code=503 if stopping else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        server.metrics.update(await asyncio.to_thread(engine.stats))
        body, content_type = server.metrics.render()
        return Response(content=body, media_type=content_type)

    @app.websocket(REALTIME_PATH)
    async def realtime(ws: WebSocket) -> None:
        if not server.ready and not server.stopping:
            await _refuse_unready(ws, server)
            return
        await server.handle_socket(ws)

    return app
