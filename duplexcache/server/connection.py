"""One WebSocket's outbox, drained by its own sender task.

Only the sender task writes to the socket, so the tick loop never waits on a slow client. The
outbox is a deque (not an asyncio.Queue) so that a cancelled reply's audio that has not been
written yet can be taken back out (:meth:`Connection.drop_pending`), and so the sender can count
the audio of each response it actually wrote (what the client can have played).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import WebSocket

from duplexcache.server import protocol as proto
from duplexcache.server.audio_io import PCM16_OUTPUT_BYTES_PER_SECOND

logger = logging.getLogger(__name__)

# Events queued for one client before it is dropped as too slow (about a minute of output).
MAX_PENDING_EVENTS = 1024
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
    event: dict[str, Any]
    response_id: str | None = None  # set on a response's audio/transcript deltas
    audio_bytes: int = 0


class Connection:
    def __init__(self, ws: WebSocket, max_pending: int = MAX_PENDING_EVENTS):
        self.ws = ws
        self.closing = False              # a close is queued; send nothing more
        self._outbox: collections.deque[_Out | _Close] = collections.deque()
        self._ready = asyncio.Event()
        self._max_pending = max_pending
        self._sender: asyncio.Task[None] | None = None
        self.label = "-"                  # for logs: the session id once known
        self.sent_audio_bytes: dict[str, int] = {}  # response id -> bytes written (newest few, in order)
        self.output_bytes_per_ms = OUTPUT_BYTES_PER_MS

    def start(self) -> None:
        self._sender = asyncio.create_task(self._run_sender())

    def send(self, event: dict[str, Any], *, response_id: str | None = None, audio_bytes: int = 0) -> None:
        if self.closing:
            return
        if len(self._outbox) >= self._max_pending:
            logger.warning("client of session %s is too slow (%d events pending); closing", self.label,
                           len(self._outbox))
            self._abort(proto.CLOSE_POLICY, "client too slow")
            return
        self._outbox.append(_Out(event, response_id, audio_bytes))
        self._ready.set()

    def drop_pending(self, response_id: str) -> int:
        """Take a response's unsent deltas out of the outbox; returns how many were dropped."""
        keep = [item for item in self._outbox if not (isinstance(item, _Out) and item.response_id == response_id)]
        dropped = len(self._outbox) - len(keep)
        self._outbox.clear()
        self._outbox.extend(keep)
        return dropped

    def played_ms(self, response_id: str) -> int:
        """Milliseconds of the response's audio written to the socket (at most what was played)."""
        return self.sent_audio_bytes.get(response_id, 0) // self.output_bytes_per_ms

    def _count_written(self, response_id: str, audio_bytes: int) -> None:
        counts = self.sent_audio_bytes
        if response_id not in counts and len(counts) >= REMEMBERED_RESPONSES:
            del counts[next(iter(counts))]  # the oldest response: its reply is long over
        counts[response_id] = counts.get(response_id, 0) + audio_bytes

    def close(self, code: int, reason: str) -> None:
        """Queue a close frame after everything already queued."""
        if not self.closing:
            self.closing = True
            self._outbox.append(_Close(code, reason[:120]))  # close reasons are limited to 123 bytes
            self._ready.set()

    def _abort(self, code: int, reason: str) -> None:
        """Drop the backlog and close now: the sender may be stuck in a send that never drains."""
        self.closing = True
        if self._sender is not None:
            self._sender.cancel()
        self._outbox.clear()
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
                if not self._outbox:
                    self._ready.clear()
                    await self._ready.wait()
                    continue
                item = self._outbox.popleft()
                if isinstance(item, _Close):
                    await self.ws.close(code=item.code, reason=item.reason)
                    return
                await self.ws.send_text(proto.encode(item.event))
                if item.audio_bytes and item.response_id is not None:
                    self._count_written(item.response_id, item.audio_bytes)
        except Exception as exc:  # noqa: BLE001 - any send failure means the client is gone
            logger.debug("sender of session %s stopped: %r", self.label, exc)
            self.closing = True
