"""Ray Serve proxy middlewares for the realtime WebSocket.

* :class:`ResumeRoutingMiddleware`: a handshake resuming a session (``?resume=<token>``,
  server/resume.py) goes to the replica that holds it. A replica's tokens start with its id and
  a dot; the middleware turns that into the ``replica:<id>`` pin the router obeys
  (cluster/router.py), which Ray's proxy reads from the placement header after this runs.
* :class:`ReplicaLossMiddleware`: a realtime session whose replica went away without closing it
  gets an ``error`` event (``replica_lost``) and close 1011, instead of a dropped socket (1006).

A replica process that dies (killed, out of memory, node lost) cannot say anything itself; the
proxy that holds the client's WebSocket can. Ray Serve loads proxy middlewares from the function
named by ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` in the proxy's environment;
``duplexcache serve --replicas`` sets it (docs/deploy.md says how on a cluster of one's own).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Awaitable, Callable
from urllib.parse import parse_qs

from duplexcache.cluster.placement import PIN_PREFIX
from duplexcache.server import protocol as proto
from duplexcache.server.resume import RESUME_QUERY, route_prefix_of

logger = logging.getLogger(__name__)

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "duplexcache.cluster.proxy:proxy_middlewares"

Message = dict[str, Any]


def resume_pin(scope: dict[str, Any]) -> str | None:
    """The ``replica:<id>`` pin for a realtime handshake that resumes a replica's session, or None."""
    if scope.get("type") != "websocket" or not scope.get("path", "").endswith(proto.REALTIME_PATH):
        return None
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    tokens = query.get(RESUME_QUERY)
    replica = route_prefix_of(tokens[0]) if tokens else None
    return f"{PIN_PREFIX}{replica}" if replica else None


class ResumeRoutingMiddleware:
    """Pins a resuming handshake to the replica its token names (replacing any placement header:
    the session is where it is, whatever context the client names)."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        pin = resume_pin(scope)
        if pin is not None:
            header = proto.PLACEMENT_HEADER.encode()
            headers = [(k, v) for k, v in scope.get("headers", [])
                       if k.lower().replace(b"-", b"_") != header]
            scope = {**scope, "headers": headers + [(header, pin.encode())]}
            logger.info("resuming handshake pinned to %s", pin)
        await self.app(scope, receive, send)


class ReplicaLossMiddleware:
    """Wraps Ray's proxy app; passes every message through and watches realtime WebSockets."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope.get("type") != "websocket" or not scope.get("path", "").endswith(proto.REALTIME_PATH):
            await self.app(scope, receive, send)
            return
        seen = {"accepted": False, "closed": False, "client_left": False}

        async def watched_receive() -> Message:
            message = await receive()
            if message.get("type") == "websocket.disconnect":
                seen["client_left"] = True
            return message

        async def watched_send(message: Message) -> None:
            kind = message.get("type")
            if kind == "websocket.accept":
                seen["accepted"] = True
            elif kind == "websocket.close":
                seen["closed"] = True
            await send(message)

        failure: BaseException | None = None
        try:
            await self.app(scope, watched_receive, watched_send)
        except Exception as exc:  # noqa: BLE001 - the replica died under the request: answer below
            failure = exc
        if seen["accepted"] and not seen["closed"] and not seen["client_left"]:
            reason = f"{type(failure).__name__}" if failure is not None else "the replica ended the connection"
            logger.warning("realtime session lost its replica (%s); telling the client", reason)
            event = proto.error_event("replica_lost", "the server replica holding this session went away "
                                      f"({reason}); reconnect to be placed on another one",
                                      error_type=proto.SERVER_ERROR)
            with contextlib.suppress(Exception):   # the client may be gone too
                await send({"type": "websocket.send", "text": proto.encode(event)})
                await send({"type": "websocket.close", "code": proto.CLOSE_INTERNAL_ERROR, "reason": "replica_lost"})
            return
        if failure is not None:
            raise failure


def proxy_middlewares() -> list[Any]:
    """What Ray Serve's proxy calls (``PROXY_CALLBACK_ENV``): the middlewares to wrap itself in."""
    from starlette.middleware import Middleware

    return [Middleware(ResumeRoutingMiddleware), Middleware(ReplicaLossMiddleware)]


def proxy_env() -> dict[str, str]:
    """Environment for the Ray job whose Serve proxies should run the middleware."""
    return {PROXY_CALLBACK_ENV: PROXY_CALLBACK}
