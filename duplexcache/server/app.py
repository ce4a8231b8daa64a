"""The realtime server: a FastAPI app (WebSocket ``/v1/realtime``, ``/health``, ``/metrics``).

Ownership:

* :class:`RealtimeServer` owns the engine handle, the engine-session-id -> session map, the
  metrics, the per-client limits, the tick task and the housekeeping task (idle timeout,
  maximum duration, queue notices). It admits or refuses each handshake (server/auth.py).
* :class:`~duplexcache.server.realtime_session.RealtimeSession` is one client's session: it turns
  client events into engine calls and engine output into OpenAI events (docs/protocol.md).
* :class:`~duplexcache.server.connection.Connection` owns one WebSocket and its outbox; only its
  sender task writes to the socket, so the tick loop never waits on a slow client.

The tick task calls ``engine.tick()`` in a worker thread (``asyncio.to_thread``) every
``engine.tick_seconds`` / ``scheduler.tick_phases`` and awaits it before the next one, so two ticks never overlap; a tick
that overruns its period is logged and counted (``late_ticks``) and the next one starts at
once, without a catch-up burst. Other engine calls also go through worker threads so a busy
engine never stalls the event loop (the engine is thread-safe per ``engine_api``).

Warm start: the lifespan starts listening at once, then runs ``engine.warmup()`` (``DuplexEngine``
captures every CUDA graph and compiles every kernel, runtime/warmup.py; an engine with nothing to
warm returns None) in a worker thread; the tick loop starts after it. Until then ``/health`` answers 503
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
import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response

from duplexcache.config import ConfigError, DeployConfig
from duplexcache.runtime.engine_api import (
    AudioDelta, EngineAPI, EngineEvent, ResponseDone, SessionAdmitted, SessionError, TextDelta, missing_members,
)
from duplexcache.server import protocol as proto
from duplexcache.server.auth import Refusal, bearer_ok, check_handshake, client_address
from duplexcache.server.connection import Connection, TransportScope, transport_of
from duplexcache.server.metrics import ServerMetrics
from duplexcache.server.minicpmo_session import session_for
from duplexcache.server.queue_wait import QueueWaitEstimate
from duplexcache.server import realtime_session
from duplexcache.server.realtime_session import RealtimeSession
from duplexcache.server.resume import RESUME_QUERY, REPLAY_QUERY, ParkedSessions, ResumeRefusal
from duplexcache.server.session_config import RefusalMemory
from duplexcache.server.tick_loop import TickLoop

logger = logging.getLogger(__name__)

REALTIME_PATH = proto.REALTIME_PATH
# Engine-reported error codes that describe the client's input rather than a server fault.
_CLIENT_ERROR_CODES = frozenset({"invalid_audio", "context_length_exceeded", "invalid_reference_audio"})
MAX_PLACEMENT_KEY = 128   # characters of the placement header kept
# Longest pause of the housekeeping loop (idle/duration limits, queue notices).
HOUSEKEEPING_PERIOD_S = 0.5


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        return os.cpu_count() or 1


def compute_threads(setting: int | str, device: str, cpus: int, omp_threads: str | None = None) -> int | None:
    """torch's CPU thread count for ``server.compute_threads`` (None: leave torch's own).

    ``auto`` leaves it alone when ``OMP_NUM_THREADS`` (``omp_threads``) is set: whoever set it
    knows the host better (Ray sets it for each replica of ``serve --replicas``)."""
    if setting != "auto":
        return int(setting)
    if device.split(":")[0] != "cpu" or omp_threads:
        return None   # on CUDA the host thread launches kernels; torch's CPU pool is not the tick's
    return max(1, cpus - 1)


def _check_voice_aliases(engine: EngineAPI, config: DeployConfig) -> None:
    """server.voice_aliases must map to voices the engine has (an engine without a voice registry,
    such as a test fake, is not checked)."""
    known = engine.voice_names()
    if known is None:
        return
    missing = sorted({v for v in config.server.voice_aliases.values() if v not in known})
    if missing:
        raise ConfigError(f"server.voice_aliases maps to voices this engine does not have: {', '.join(missing)} "
                          f"(it has: {', '.join(known)})")


class RealtimeServer(TickLoop):
    def __init__(self, engine: EngineAPI, config: DeployConfig, metrics: ServerMetrics | None = None):
        missing = missing_members(engine)
        if missing:
            raise TypeError(f"engine {type(engine).__name__} does not implement EngineAPI (missing {missing})")
        self.engine = engine
        self.config = config
        self.metrics = metrics or ServerMetrics()
        _check_voice_aliases(engine, config)
        self._by_sid: dict[str, RealtimeSession] = {}
        self._sessions: set[RealtimeSession] = set()
        self._stopping = asyncio.Event()
        self._tick_task: asyncio.Task[None] | None = None
        self._housekeeping_task: asyncio.Task[None] | None = None
        self._pending_clients: dict[str, int] = {}  # handshakes in progress per address
        self._ending: set[asyncio.Task[None]] = set()  # end_session of dropped clients, in flight
        self.refusals = RefusalMemory()        # settings-decided refusals, for every connection
        self.queue_wait = QueueWaitEstimate()  # session lengths: the queue's estimated_wait_s
        # resume tokens, and sessions whose connection dropped waiting for theirs (server/resume.py)
        self.resumes = ParkedSessions(config.server.resume_window_s, config.server.max_outbox_bytes)
        self.warm_state = "warming"            # -> "ready" | "warmup_failed"
        self.warmup_error: str | None = None
        self._saved_compute_threads: int | None = None    # torch's, while ours is set
        self.failed_ticks_in_a_row = 0         # a cluster replica reports itself unhealthy on a run
        self.last_tick_error: str | None = None

    @property
    def num_connections(self) -> int:
        """Connected sessions (parked ones have no connection: ``len(self.resumes)``)."""
        return len(self._sessions) - len(self.resumes)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def engine_sid(self, session_id: str) -> str | None:
        """The engine's id of the session with wire id ``session_id`` (None until the engine session opens)."""
        return next((s.sid for s in self._sessions if s.id == session_id), None)

    def session_contexts(self) -> list[tuple[str, str | None]]:
        """(instructions, voice) of every session the engine holds or is opening (cluster placement)."""
        return [(s.settings.instructions, s.settings.voice) for s in self._sessions
                if s.sid is not None or s.opening]

    def placement_keys(self) -> list[str]:
        """The context keys clients named in their handshake (cluster/placement.py), opened or not."""
        return [s.placement_key for s in self._sessions if s.placement_key]

    def close_all(self, code: str, message: str, close_code: int) -> int:
        """Send every connection an ``error`` event naming why, then close it with ``close_code``
        (a cluster replica that failed: 1011; one whose drain ran out: 1001). Returns how many."""
        sessions = [s for s in self._sessions if not s.conn.closing]
        for session in sessions:
            session.error(code, message, error_type=proto.SERVER_ERROR)
            session.conn.close(close_code, code)
        return len(sessions)

    def queued_sessions(self) -> int:
        return sum(1 for s in self._sessions if s.queued)

    def estimated_wait_s(self, position: int, now: float) -> float:
        """Seconds until the queued session at ``position`` is admitted (server/queue_wait.py),
        from the ages of the live sessions at ``now`` (time.monotonic)."""
        live_ages = [now - s.live_since for s in self._sessions
                     if s.live_since is not None and s.sid is not None and not s.queued]
        return self.queue_wait.estimate(position, live_ages)

    def connections_of(self, client: str) -> int:
        # a parked session holds no connection (it counts in sessions_of)
        return sum(s.client == client and not self.resumes.is_parked(s) for s in self._sessions) + \
            self._pending_clients.get(client, 0)

    def sessions_of(self, client: str) -> int:
        return sum(s.client == client and (s.sid is not None or s.opening) for s in self._sessions)

    # ---------------------------------------------------------------- lifecycle

    @property
    def ready(self) -> bool:
        return self.warm_state == "ready"

    async def start(self) -> None:
        """Start warming up and then ticking, in the background (the app listens meanwhile)."""
        assert self._tick_task is None, "RealtimeServer.start called twice"
        threads = compute_threads(self.config.server.compute_threads, self.config.model.device, available_cpus(),
                                  os.environ.get("OMP_NUM_THREADS"))
        if threads is not None:
            import torch   # the engine has it loaded already

            self._saved_compute_threads = torch.get_num_threads()   # process-wide: restored in stop()
            torch.set_num_threads(threads)
            logger.info("torch CPU threads %d (server.compute_threads %s; it was %d)", threads,
                        self.config.server.compute_threads, self._saved_compute_threads)
        self._tick_task = asyncio.create_task(self._warm_then_tick(), name="duplexcache-tick")
        self._housekeeping_task = asyncio.create_task(self._housekeeping_loop(), name="duplexcache-housekeeping")

    async def _warm_then_tick(self) -> None:
        start = time.perf_counter()
        try:
            # should_stop: a shutdown during the warm-up does not wait for every capture.
            report = await asyncio.to_thread(self.engine.warmup, should_stop=self._stopping.is_set)
        except Exception as exc:  # noqa: BLE001 - report it on /health, keep the process up
            logger.exception("engine warm-up failed; the server stays unready")
            self.warmup_error = f"{type(exc).__name__}: {exc}"
            self.warm_state = "warmup_failed"
            return
        if self._stopping.is_set():
            logger.info("warm-up stopped: the server is shutting down")
            return
        logger.info("warm-up finished in %.2f s (%s); ready", time.perf_counter() - start,
                    "nothing to warm" if report is None else report.describe())
        await self._log_waterfall()
        self.metrics.update(await asyncio.to_thread(self.engine.stats))
        self.warm_state = "ready"
        await self._tick_loop()

    async def _log_waterfall(self) -> None:
        """The card waterfall once, after the warm-up (issue 43): logged line by line and set on
        /metrics as ``duplexcache_device_bytes{part=...}``. An engine that does not account its
        device returns None; a failure to account is logged, never fatal."""
        try:
            wf = await asyncio.to_thread(self.engine.waterfall)
        except Exception:  # noqa: BLE001 - accounting must not keep a warm server from serving
            logger.exception("card waterfall failed")
            return
        if wf is None:
            return
        for line in wf.lines():
            logger.info("%s", line)
        self.metrics.set_waterfall(wf)

    async def stop(self) -> None:
        """Graceful shutdown: finish the running tick, close every session, shut the engine down."""
        self._stopping.set()
        if self._tick_task is not None:
            await self._tick_task  # never shut the engine down under a running tick
        if self._housekeeping_task is not None:
            await self._housekeeping_task
        sessions = list(self._sessions)
        for session in sessions:
            await self.end_session(session)
            session.conn.close(proto.CLOSE_GOING_AWAY, "server shutting down")
        await asyncio.gather(*(session.conn.finish() for session in sessions))
        await asyncio.to_thread(self.engine.shutdown)
        if self._saved_compute_threads is not None:
            import torch

            torch.set_num_threads(self._saved_compute_threads)
            self._saved_compute_threads = None
        logger.info("server stopped: closed %d connection(s)", len(sessions))

    async def _route(self, events: list[EngineEvent]) -> None:
        for event in events:
            session = self._by_sid.get(event.sid)
            if session is None:
                logger.debug("dropping %s for closed session %s", type(event).__name__, event.sid)
                continue
            if isinstance(event, AudioDelta):
                session.on_audio(event.pcm16)
            elif isinstance(event, TextDelta):
                session.on_text(event.text)
            elif isinstance(event, ResponseDone):
                session.on_done(event.status, event.usage)
            elif isinstance(event, SessionAdmitted):
                try:
                    await session.on_admitted()
                except Exception:  # noqa: BLE001 - one session's failure must not stop the routing
                    logger.exception("admitting session %s failed", session.id)
            elif isinstance(event, SessionError):
                self._route_session_error(session, event)
            else:
                logger.error("unknown engine event %r", event)

    def _route_session_error(self, session: RealtimeSession, event: SessionError) -> None:
        if event.code in _CLIENT_ERROR_CODES:
            session.error(event.code, event.message)
        else:  # the engine's detail is for the log, not the client
            logger.error("engine error for session %s: %s: %s", session.log_name, event.code, event.message)
            session.error(event.code, "The server failed to process this session's audio.",
                          error_type=proto.SERVER_ERROR)
        if event.fatal:
            # The engine already ended the session; forget it so nothing closes it twice.
            self._by_sid.pop(event.sid, None)
            session.sid = None
            session.conn.close(proto.CLOSE_NORMAL, event.code)

    # ---------------------------------------------------------------- limits and notices

    async def _housekeeping_loop(self) -> None:
        cfg = self.config.server
        # QUEUE_NOTICE_S read through its module: a test may shorten it
        limits = [v for v in (cfg.idle_timeout_s, cfg.max_session_s, realtime_session.QUEUE_NOTICE_S) if v > 0]
        period = min([HOUSEKEEPING_PERIOD_S] + [v / 4 for v in limits])
        while not self._stopping.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), period)
            now = time.monotonic()
            for session in self.resumes.due():   # parked past server.resume_window_s: freed now
                await self.end_session(session)
                self._sessions.discard(session)
            self.metrics.connections.set(self.num_connections)
            for session in list(self._sessions):
                try:
                    await self._enforce_limits(session, now)
                except Exception:  # noqa: BLE001
                    logger.exception("housekeeping of session %s failed", session.id)

    async def _enforce_limits(self, session: RealtimeSession, now: float) -> None:
        cfg = self.config.server
        if self.resumes.is_parked(session):
            return   # no connection to check; its window is the resume registry's (due())
        transport = transport_of(session.conn.ws)
        if transport is not None and transport.is_closing() and not session.conn.closing:
            # The ASGI server closed the socket on its own (uvicorn: a keepalive ping not answered)
            # and waits for a send buffer this client does not drain; until it drains, the receive
            # loop hears nothing and the session would live on. Drop it: the engine session ends
            # now (or is parked for a resume: a network that stopped answering), and the transport
            # is aborted if its close cannot be written.
            logger.info("session %s: its connection was closed under it (no pong?); dropping it", session.log_name)
            conn = session.conn
            self.resumes.park(session, conn, None)
            conn.drop(proto.CLOSE_GOING_AWAY, "connection closed")
            return
        if session.conn.closing:
            # Its close is on the way, but may never be written (a client that does not read): the
            # limits still end it, and its transport is aborted (they used to skip it for good).
            if (cfg.max_session_s and now - session.connected_at > cfg.max_session_s) or \
                    (cfg.idle_timeout_s and now - session.last_input_at > cfg.idle_timeout_s):
                await self.end_session(session)
                session.conn.abort()
            return
        if cfg.max_session_s and now - session.connected_at > cfg.max_session_s:
            self.metrics.limit_closes.labels(reason="max_session_s").inc()
            await self._expire(session, "session expired", "session_expired", f"the session hit the maximum "
                               f"duration of {cfg.max_session_s:g} s (server.max_session_s)")
        elif cfg.idle_timeout_s and now - session.last_input_at > cfg.idle_timeout_s:
            self.metrics.limit_closes.labels(reason="idle_timeout_s").inc()
            await self._expire(session, "idle timeout", "idle_timeout", f"no input audio for "
                               f"{cfg.idle_timeout_s:g} s (server.idle_timeout_s); the session is closed")
        elif session.queued and now - session.last_queue_notice >= realtime_session.QUEUE_NOTICE_S:
            session.notify_queued(now)

    async def _expire(self, session: RealtimeSession, reason: str, code: str, message: str) -> None:
        # Audio the client has not read is dropped (it may never read it); the error saying why
        # and the close go out next.
        session.conn.discard_backlog()
        session.error(code, message)
        await self.end_session(session)
        session.conn.close(proto.CLOSE_POLICY, reason)

    # ---------------------------------------------------------------- sockets

    async def handle_socket(self, ws: WebSocket) -> None:
        peer = ws.client.host if ws.client is not None else "unknown"
        client = client_address(peer, ws.headers, self.config.server.trusted_proxies)
        if self._stopping.is_set():
            await _refuse(ws, Refusal(503, "server_shutting_down", "The server is shutting down.",
                                      proto.SERVER_ERROR))
            return
        verdict = check_handshake(self.config.server, ws.headers, ws.query_params)
        if isinstance(verdict, Refusal):
            logger.warning("refused a connection from %s: %s", client, verdict.code)
            self.metrics.protocol_errors.labels(code=verdict.code).inc()
            await _refuse(ws, verdict)
            return
        cap = self.config.server.max_connections_per_client
        if self.connections_of(client) >= cap:
            logger.warning("refused a connection from %s: %d open (server.max_connections_per_client)", client, cap)
            self.metrics.protocol_errors.labels(code="rate_limit_exceeded").inc()
            await _refuse(ws, Refusal(429, "rate_limit_exceeded", f"Too many connections from this client address "
                                      f"(server.max_connections_per_client = {cap}).", proto.RATE_LIMIT))
            return
        self._pending_clients[client] = self._pending_clients.get(client, 0) + 1
        try:
            await ws.accept(subprotocol=verdict.subprotocol)
        finally:
            self._pending_clients[client] -= 1
            if not self._pending_clients[client]:
                del self._pending_clients[client]
        cfg = self.config.server
        conn = Connection(ws, max_bytes=cfg.max_outbox_bytes, close_timeout=cfg.close_timeout_s)
        conn.start()
        if RESUME_QUERY in ws.query_params:
            resumed = self._resume(conn, verdict.dialect, client, ws.query_params)
            if resumed is None:
                await conn.finish()
                return
            session = resumed
        else:
            session = session_for(self, conn, verdict, client, ws.query_params)   # the handshake's dialect
            # the context key a cluster router placed this connection by (cluster/placement.py)
            session.placement_key = ws.headers.get(proto.PLACEMENT_HEADER, "")[:MAX_PLACEMENT_KEY]
            self._sessions.add(session)
            session.announce()
        # A client dropped as too slow frees its engine session now, not when its socket goes.
        conn.on_drop = functools.partial(self._end_soon, session, conn)
        self.metrics.connections.set(self.num_connections)
        close_code: int | None = None
        try:
            close_code = await self._receive_loop(session, conn)
        finally:
            # A disconnect frees everything the session owned, unless its network dropped and it
            # is parked for a resume, or it was resumed on another connection already.
            if session.conn is conn and (self.stopping or not self.resumes.park(session, conn, close_code)):
                await self.end_session(session)
                self._sessions.discard(session)
                self.resumes.forget(session)   # its token now answers resume_ended
            self.metrics.connections.set(self.num_connections)
            await conn.finish()

    def _resume(self, conn: Connection, dialect: str, client: str, query: Any) -> RealtimeSession | None:
        """The parked session a ``?resume=`` handshake names, re-attached to ``conn``; None (after
        an ``error`` event and close 1008) when this client may not resume it."""
        claimed = self.resumes.claim(query, client, dialect)
        if isinstance(claimed, ResumeRefusal):
            logger.warning("refused a resume from %s: %s", client, claimed.code)
            self.metrics.protocol_errors.labels(code=claimed.code).inc()
            conn.send(proto.error_event(claimed.code, claimed.message, param=claimed.param))
            conn.close(proto.CLOSE_POLICY, claimed.code)
            return None
        self.resumes.attach(claimed, conn, replay=query.get(REPLAY_QUERY, "replay") == "replay")
        return claimed

    async def _receive_loop(self, session: RealtimeSession, conn: Connection) -> int | None:
        """Until the connection ends; returns the client's close code (1006: the network
        dropped), or None when the server ended it."""
        limit = self.config.server.max_frame_bytes
        while not conn.closing:
            try:
                message = await conn.ws.receive()
            except RuntimeError:  # receive after the socket closed
                return None
            if message["type"] == "websocket.disconnect":
                return int(message.get("code", 1005))
            text = message.get("text")
            if text is None:
                size = len(message.get("bytes") or b"")
            else:  # base64 JSON is ASCII: skip the copy that encoding would make
                size = len(text) if text.isascii() else len(text.encode("utf-8"))
            if size > limit:
                logger.warning("closing session %s: frame of %d bytes > max_frame_bytes %d", session.id, size, limit)
                self.metrics.protocol_errors.labels(code="frame_too_large").inc()
                conn.close(proto.CLOSE_TOO_BIG, f"frame of {size} bytes exceeds max_frame_bytes {limit}")
                return None
            if text is None:
                session.error("binary_frame", "binary frames are not supported; send JSON text frames")
                continue
            try:
                await session.handle(getattr(session, "parse_event", proto.parse_client_event)(text))
            except proto.ProtocolError as exc:
                session.error(exc.code, exc.message, event_id=exc.event_id, param=exc.param,
                              error_type=exc.error_type)
            except Exception:  # noqa: BLE001 - a bug of ours: say so and end this connection only
                # (it used to end the socket with 1000, as if all were well, and a bare traceback)
                logger.exception("session %s: handling a client event failed; closing its connection",
                                 session.log_name)
                session.error("server_error", "The server failed to handle this event; the session is closed.",
                              error_type=proto.SERVER_ERROR)
                conn.close(proto.CLOSE_INTERNAL_ERROR, "server error")
                return None
        return None

    def register(self, session: RealtimeSession, sid: str) -> None:
        session.sid = sid
        self._by_sid[sid] = session
        logger.info("session %s opened", session.log_name)

    def _end_soon(self, session: RealtimeSession, conn: Connection) -> None:
        if session.conn is not conn:
            return   # parked or resumed elsewhere: this connection no longer holds the session
        task = asyncio.create_task(self.end_session(session))
        self._ending.add(task)   # held: the loop keeps only weak references to tasks
        task.add_done_callback(self._ending.discard)

    async def end_session(self, session: RealtimeSession) -> None:
        name = session.log_name
        sid, session.sid = session.sid, None
        if sid is None:
            return
        self._by_sid.pop(sid, None)
        if session.live_since is not None and not session.queued:
            self.queue_wait.session_ended(time.monotonic() - session.live_since)
        try:
            # shielded: a cancelled connection task must still free the session's memory
            await asyncio.shield(asyncio.to_thread(self.engine.close_session, sid))
        except Exception:  # noqa: BLE001 - closing must go on for the other sessions
            logger.exception("engine.close_session(%s) failed", sid)
        logger.info("session %s closed", name)


async def _refuse(ws: WebSocket, refusal: Refusal) -> None:
    """Refuse a handshake with an HTTP error and OpenAI's JSON body (or a policy close)."""
    body = proto.http_error_body(refusal.code, refusal.message, refusal.error_type)
    try:
        await ws.send_denial_response(JSONResponse(body, status_code=refusal.status))
    except RuntimeError:  # the ASGI server has no denial-response extension
        await ws.close(code=proto.CLOSE_POLICY, reason=refusal.code)


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
        await ws.close(code=proto.CLOSE_TRY_AGAIN, reason=code)


def create_app(engine: EngineAPI, config: DeployConfig, metrics: ServerMetrics | None = None) -> FastAPI:
    """The ASGI app; its lifespan starts the tick loop and shuts everything down on exit."""
    server = RealtimeServer(engine, config, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await server.start()
        try:
            yield
        finally:
            await server.stop()

    app = FastAPI(title="duplexcache realtime", lifespan=lifespan)
    # outermost: it must see the server's own send (a client that must go is aborted through it)
    app.add_middleware(TransportScope)
    app.state.server = server
    app.state.health_extras = []   # async callables returning more /health fields

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
                "queued_sessions": stats.queued_sessions, "connections": server.num_connections,
                "parked_sessions": len(server.resumes)}
        for extra in app.state.health_extras:   # e.g. the cluster summary of a Ray Serve replica
            body.update(await extra())
        return JSONResponse(body, status_code=503 if stopping else 200)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if not bearer_ok(config.server, request.headers):  # pool sizes are for operators only
            return JSONResponse(proto.http_error_body("invalid_api_key", "Missing or incorrect API key."),
                                status_code=401)
        server.metrics.update(await asyncio.to_thread(engine.stats))
        await asyncio.to_thread(server.metrics.sample_memory, config.model.device)
        body, content_type = server.metrics.render()
        return Response(content=body, media_type=content_type)

    @app.websocket(REALTIME_PATH)
    async def realtime(ws: WebSocket) -> None:
        if not server.ready and not server.stopping:
            await _refuse_unready(ws, server)
            return
        await server.handle_socket(ws)

    from duplexcache.server.page import mount_page  # the browser page at / and its files
    mount_page(app)

    # Last, so it matches only what no route above did: a WebSocket to another path. Starlette's
    # own answer is a bare 403, which reads as "not allowed" when the client has the path wrong.
    @app.websocket("/{path:path}")
    async def unknown_websocket(ws: WebSocket, path: str) -> None:
        await _refuse(ws, Refusal(404, "not_found", f"No WebSocket endpoint at /{path}; the realtime API "
                                                   f"is at {REALTIME_PATH}."))

    return app
