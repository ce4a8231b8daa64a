"""uvicorn's HTTP protocol with a header timeout (``server.header_timeout_s``).

uvicorn times out an idle keep-alive connection (``timeout_keep_alive``) but not a request whose
headers never finish: a client that opens connections and sends half a request line keeps each
socket (and its slot in the per-address caps' handshake count, once the headers do arrive) for as
long as it likes; 300 of them stayed open 25 s+ (issue 48). This subclass of uvicorn's h11
protocol drops a connection whose request headers are not complete ``header_timeout`` seconds
after it opened or after its previous response (the keep-alive timer covers an idle connection;
this one covers a connection that has started a request and stalls). A WebSocket upgrade hands the
transport to the WebSocket protocol once its headers are in, so the timer is gone by then.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


class _HeaderTimeoutH11(H11Protocol):
    header_timeout: float = 10.0   # set per server by header_timeout_protocol()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # IDLE: no complete request head yet (a part of one, or the first bytes of the next one)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm_header_timer()
        else:
            self._cancel_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return   # a response is being written: the keep-alive timer takes over after it
        logger.info("dropping a connection from %s: request headers not complete within %.1f s "
                    "(server.header_timeout_s)", self.client, self.header_timeout)
        # abort, not close: a client that trickles a request may not read either
        self.transport.abort()


def header_timeout_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class that drops requests whose headers take over ``header_timeout`` s."""
    return type("HeaderTimeoutH11Protocol", (_HeaderTimeoutH11,), {"header_timeout": float(header_timeout)})
