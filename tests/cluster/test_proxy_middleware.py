"""cluster/proxy.py on hand-made ASGI apps (no Ray): a realtime WebSocket whose app ends without
closing it gets an error event and close 1011; a closed one or one the client left gets nothing."""

from __future__ import annotations

import asyncio
import importlib
import json

import pytest

from duplexcache.cluster.proxy import (PROXY_CALLBACK, PROXY_CALLBACK_ENV, ReplicaLossMiddleware,
                                      ResumeRoutingMiddleware, proxy_env)

SCOPE = {"type": "websocket", "path": "/v1/realtime"}


def _run(app, scope=SCOPE, incoming=({"type": "websocket.connect"},)):
    sent, queue = [], list(incoming)

    async def receive():
        if queue:
            return queue.pop(0)
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    async def main():
        await ReplicaLossMiddleware(app)(scope, receive, send)

    asyncio.run(main())
    return sent


async def _accept_then_die(scope, receive, send):
    await receive()
    await send({"type": "websocket.accept"})
    raise RuntimeError("ActorDiedError: the replica died")


def test_a_lost_replica_is_an_error_event_and_1011():
    sent = _run(_accept_then_die)
    assert [m["type"] for m in sent] == ["websocket.accept", "websocket.send", "websocket.close"]
    event = json.loads(sent[1]["text"])
    assert event["type"] == "error" and event["error"]["code"] == "replica_lost"
    assert "RuntimeError" in event["error"]["message"]
    assert sent[2]["code"] == 1011


def test_a_closed_session_or_a_departed_client_gets_nothing_more():
    async def closes(scope, receive, send):
        await receive()
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.close", "code": 1000})

    assert [m["type"] for m in _run(closes)] == ["websocket.accept", "websocket.close"]

    async def client_leaves(scope, receive, send):
        await receive()
        await send({"type": "websocket.accept"})
        await receive()   # the disconnect

    sent = _run(client_leaves, incoming=({"type": "websocket.connect"}, {"type": "websocket.disconnect", "code": 1000}))
    assert [m["type"] for m in sent] == ["websocket.accept"]


def test_other_requests_pass_through_and_errors_still_raise():
    with pytest.raises(RuntimeError):
        _run(_accept_then_die, scope={"type": "websocket", "path": "/other"})

    async def refuses(scope, receive, send):   # never accepted (e.g. a warming replica's denial)
        raise RuntimeError("no replica")

    with pytest.raises(RuntimeError):
        _run(refuses)
    assert proxy_env() == {PROXY_CALLBACK_ENV: PROXY_CALLBACK}
    module, name = PROXY_CALLBACK.split(":")    # what Ray's proxy imports and calls
    middlewares = getattr(importlib.import_module(module), name)()
    assert [m.cls for m in middlewares] == [ResumeRoutingMiddleware, ReplicaLossMiddleware]


def _routed_headers(scope) -> list[tuple[bytes, bytes]]:
    seen = {}

    async def app(scope, receive, send):
        seen["headers"] = scope.get("headers", [])

    asyncio.run(ResumeRoutingMiddleware(app)(scope, None, None))
    return seen["headers"]


def test_a_resume_is_pinned_to_the_replica_its_token_names():
    """A replica's tokens start with its id (server/resume.py); the proxy pins the handshake to it,
    replacing a placement header the client sent (either spelling Ray accepts)."""
    other = [(b"serve-multiplexed-model-id", b"ctx:abc"), (b"host", b"x")]
    scope = {**SCOPE, "query_string": b"resume=r1a2b3.SECRET_token-xyz&resume_replay=skip", "headers": other}
    assert _routed_headers(scope) == [(b"host", b"x"), (b"serve_multiplexed_model_id", b"replica:r1a2b3")]
    # no resume, a token without a replica, another path: untouched
    for query, path in ((b"model=x", "/v1/realtime"), (b"resume=plain-token", "/v1/realtime"),
                        (b"resume=r1.tok", "/other")):
        scope = {"type": "websocket", "path": path, "query_string": query, "headers": other}
        assert _routed_headers(scope) == other
