"""One WebSocket's outbox, drained by its own sender task.

Only the sender task writes to the socket, so the tick loop never waits on a slow client. The
outbox is a deque (not an asyncio.Queue) so that a cancelled reply's audio that has not been
written yet can be taken back out (:meth:`Connection.drop_pending`), and so the sender can count
the audio of each response it actually wrote (what the client can have played).

A client that does not read must cost only itself (issue 48). Events are encoded when queued, so
the outbox is bounded in bytes (``server.max_outbox_bytes``) as well as in events; a client past
either bound is dropped: its backlog is discarded, the server is told at once (``on_drop``: the
engine session and its slots are released), and a close that cannot be written within
``close_timeout`` (``server.close_timeout_s``) is abandoned by aborting the transport. Waiting on
the close frame alone is not enough: it queues behind a full send buffer, and asyncio's
``transport.close()`` waits for that buffer to drain, which a client that never reads never lets
happen.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable

from fastapi import WebSocket

from duplexcache.server import protocol as proto
from duplexcache.server.audio_io import PCM16_OUTPUT_BYTES_PER_SECOND

logger = logging.getLogger(__name__)

# Events queued for one client before it is dropped as too slow (about a minute of output).
MAX_PENDING_EVENTS = 1024
# Bytes (encoded JSON) queued for one client before it is dropped (server.max_outbox_bytes).
MAX_OUTBOX_BYTES = 8 * 2**20
# How long a close may take to be written before the transport is aborted (server.close_timeout_s).
CLOSE_TIMEOUT_S = 5.0
# Responses whose written audio is remembered: only the newest is ever asked for (a cancel or a
# barge-in of the current reply); a few more cover a reply that ends as the next begins, and the
# bound keeps an hour-long call from keeping a count per reply.
REMEMBERED_RESPONSES = 8
OUTPUT_BYTES_PER_MS = PCM16_OUTPUT_BYTES_PER_SECOND // 1000  # RealtimeSession sets G.711's (8) at open


@dataclass(frozen=True)
class _Close:
    code: int
    reason: str


@dataclass(frozen=True)
class _Out:
    text: str                       # the event, encoded when queued (its size is what is bounded)
    kind: str                       # the event's type, for logs and tests
    response_id: str | None = None  # set on a response's audio/transcript deltas
    audio_bytes: int = 0


# The ASGI scope keys under which TransportScope leaves the connection's transport and protocol.
TRANSPORT_SCOPE_KEY = "duplexcache.transport"
PROTOCOL_SCOPE_KEY = "duplexcache.ws_protocol"


class TransportScope:
    """ASGI middleware that puts the asyncio transport of a uvicorn WebSocket into its scope.

    ASGI gives an app no way to abort a connection, only to ask for a close, and uvicorn writes
    that close behind whatever the socket has not drained. The ``send`` uvicorn hands the app is
    its protocol's bound method, and the protocol holds the transport; by the time Starlette's
    own layers have wrapped ``send`` that is out of reach, so this is the outermost layer
    (create_app). Another ASGI server (Ray Serve's proxy) may have none: then a dropped client is
    still released from the engine at once, only its socket waits."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            protocol = getattr(send, "__self__", None)
            transport = getattr(protocol, "transport", None)
            if callable(getattr(transport, "abort", None)):
                scope = {**scope, TRANSPORT_SCOPE_KEY: transport, PROTOCOL_SCOPE_KEY: protocol}
        await self.app(scope, receive, send)


_UNSET = object()


def close_frame_received(ws: Any) -> bool | None:
    """Whether the client sent a close frame (None: cannot tell). uvicorn reports both a close
    frame without a status code and a connection lost without any close frame as code 1005; its
    WebSocket protocol (websockets' ``close_rcvd``, on the sans-I/O ``conn`` or the legacy
    protocol itself) still knows which it was. A resume needs the difference (server/resume.py)."""
    scope = getattr(ws, "scope", None)
    protocol = scope.get(PROTOCOL_SCOPE_KEY) if isinstance(scope, dict) else None
    for holder in (getattr(protocol, "conn", None), protocol):
        received = getattr(holder, "close_rcvd", _UNSET)
        if received is not _UNSET:
            return received is not None
    return None


def transport_of(ws: Any) -> Any:
    """The asyncio transport under a WebSocket (TransportScope), or None."""
    scope = getattr(ws, "scope", None)
    return scope.get(TRANSPORT_SCOPE_KEY) if isinstance(scope, dict) else None


class Connection:
    def __init__(self, ws: WebSocket, max_pending: int = MAX_PENDING_EVENTS, max_bytes: int = MAX_OUTBOX_BYTES,
                 close_timeout: float = CLOSE_TIMEOUT_S, on_drop: Callable[[], None] | None = None):
        self.ws = ws
        self.closing = False              # a close is queued; send nothing more
        self.dropped = False              # the server dropped this client (its outbox passed a bound)
        self.server_closed = False        # the server decided to close it (not the client or the network)
        self._outbox: collections.deque[_Out | _Close] = collections.deque()
        self._outbox_bytes = 0
        self._ready = asyncio.Event()
        self._max_pending = max_pending
        self._max_bytes = max_bytes
        self._close_timeout = close_timeout
        self.on_drop = on_drop            # the server's: release the engine session now
        self._sender: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self.label = "-"                  # for logs: the session id once known
        self.sent_audio_bytes: dict[str, int] = {}  # response id -> bytes written (newest few, in order)
        self.output_bytes_per_ms = OUTPUT_BYTES_PER_MS

    @property
    def pending_bytes(self) -> int:
        """Encoded bytes queued and not yet handed to the socket."""
        return self._outbox_bytes

    def start(self) -> None:
        self._sender = asyncio.create_task(self._run_sender())

    def send(self, event: dict[str, Any], *, response_id: str | None = None, audio_bytes: int = 0) -> None:
        if self.closing:
            return
        text = proto.encode(event)
        # the byte bound applies to a backlog: one event alone always fits an empty outbox
        too_many_bytes = bool(self._outbox) and self._outbox_bytes + len(text) > self._max_bytes
        if len(self._outbox) >= self._max_pending or too_many_bytes:
            logger.warning("client of session %s is too slow (%d events, %d bytes pending); dropping it", self.label,
                           len(self._outbox), self._outbox_bytes + len(text))
            self.drop(proto.CLOSE_POLICY, "client too slow")
            return
        self._outbox.append(_Out(text, str(event.get("type")), response_id, audio_bytes))
        self._outbox_bytes += len(text)
        self._ready.set()

    def take_backlog(self) -> list[_Out]:
        """Take every event not yet written out of the outbox (a session parked after its
        client's network dropped keeps them for the connection that resumes it: server/resume.py)."""
        items = [item for item in self._outbox if isinstance(item, _Out)]
        self._outbox = collections.deque(item for item in self._outbox if not isinstance(item, _Out))
        self._outbox_bytes = 0
        return items

    def adopt(self, items: list[_Out]) -> None:
        """Queue events encoded for another connection of the same session (a resume's replay),
        under the same bounds as :meth:`send`."""
        for item in items:
            if self.closing:
                return
            if len(self._outbox) >= self._max_pending or (self._outbox and self._outbox_bytes + len(item.text) >
                                                          self._max_bytes):
                logger.warning("client of session %s cannot take the replay of its resumed session; dropping it",
                               self.label)
                self.drop(proto.CLOSE_POLICY, "client too slow")
                return
            self._outbox.append(item)
            self._outbox_bytes += len(item.text)
        self._ready.set()

    def drop_pending(self, response_id: str) -> int:
        """Take a response's unsent deltas out of the outbox; returns how many were dropped."""
        keep = [item for item in self._outbox if not (isinstance(item, _Out) and item.response_id == response_id)]
        dropped = len(self._outbox) - len(keep)
        self._outbox.clear()
        self._outbox.extend(keep)
        self._outbox_bytes = sum(len(item.text) for item in keep if isinstance(item, _Out))
        return dropped

    def played_ms(self, response_id: str) -> int:
        """Milliseconds of the response's audio written to the socket (at most what was played)."""
        return self.sent_audio_bytes.get(response_id, 0) // self.output_bytes_per_ms

    def _count_written(self, response_id: str, audio_bytes: int) -> None:
        counts = self.sent_audio_bytes
        if response_id not in counts and len(counts) >= REMEMBERED_RESPONSES:
            del counts[next(iter(counts))]  # the oldest response: its reply is long over
        counts[response_id] = counts.get(response_id, 0) + audio_bytes

    def discard_backlog(self) -> None:
        """Drop every event not yet written (a limit's close: a client idle or over time gets its
        error and close next, not after a minute of audio it is not reading)."""
        if not self.closing:
            self._outbox.clear()
            self._outbox_bytes = 0

    def close(self, code: int, reason: str) -> None:
        """Queue a close frame after everything already queued; bounded by ``close_timeout``."""
        if self.closing:
            return
        self.closing = self.server_closed = True
        self._outbox.append(_Close(code, reason[:120]))  # close reasons are limited to 123 bytes
        self._ready.set()
        self._watch_close()

    def drop(self, code: int, reason: str) -> None:
        """Drop this client now: discard the backlog, tell the server (its engine session ends at
        once) and close; the sender may be stuck in a send that never drains, so it is cancelled,
        and a close that cannot be written within ``close_timeout`` aborts the transport."""
        if self.dropped:
            return
        self.closing = self.dropped = self.server_closed = True
        if self._sender is not None:
            self._sender.cancel()
        self._outbox.clear()
        self._outbox_bytes = 0
        if self.on_drop is not None:
            self.on_drop()
        self._sender = asyncio.create_task(self._close_now(code, reason[:120]))
        self._watch_close()

    def abort(self) -> None:
        """Abort the transport: no close frame, the peer sees a reset; the receive loop sees a disconnect."""
        transport = transport_of(self.ws)
        if transport is not None:   # aborting a transport already lost does nothing
            logger.info("aborting the transport of session %s: its close could not be written", self.label)
            transport.abort()

    def _watch_close(self) -> None:
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._close_watchdog())

    async def _close_watchdog(self) -> None:
        """Abort the transport when, ``close_timeout`` after the close was decided, the sender has
        not written the close or the transport still holds bytes the client has not taken."""
        await asyncio.sleep(self._close_timeout)
        sender = self._sender
        transport = transport_of(self.ws)
        stuck = (sender is not None and not sender.done()) or (
            transport is not None and transport.get_write_buffer_size() > 0)
        if stuck:
            if sender is not None:
                sender.cancel()
            self.abort()

    async def _close_now(self, code: int, reason: str) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(code=code, reason=reason), self._close_timeout)

    async def finish(self, timeout: float | None = None) -> None:
        """Let the sender flush (bounded by ``timeout``, default ``close_timeout``), then stop it;
        a sender still stuck then has its transport aborted."""
        if self._sender is None:
            return
        self.close(proto.CLOSE_NORMAL, "")
        timeout = self._close_timeout if timeout is None else timeout
        try:
            await asyncio.wait_for(self._sender, timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self.abort()
        except Exception:  # noqa: BLE001 - the sender's own failure: the client is gone
            pass

    async def _run_sender(self) -> None:
        try:
            while True:
                if not self._outbox:
                    self._ready.clear()
                    await self._ready.wait()
                    continue
                item = self._outbox.popleft()
                if isinstance(item, _Close):
                    await self.ws.close(code=item.code, reason=item.reason)
                    return
                self._outbox_bytes -= len(item.text)
                await self.ws.send_text(item.text)
                if item.audio_bytes and item.response_id is not None:
                    self._count_written(item.response_id, item.audio_bytes)
        except Exception as exc:  # noqa: BLE001 - any send failure means the client is gone
            logger.debug("sender of session %s stopped: %r", self.label, exc)
            self.closing = True
