"""Access control (API key on header or subprotocol, Origin) and the fair limits at the edge
(idle timeout, maximum duration, per-address connection and session caps, bounded echo)."""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import numpy as np
import pytest
from server_fakes import LoopbackServers, connect_realtime, pcm16_b64, recv, recv_type, send, wait_for
from websockets.exceptions import ConnectionClosed, InvalidStatus

from duplexcache.server import cli
from duplexcache.server.loopback import LoopbackServer

KEY = "sk-test-key"
TICK = 0.05


@pytest.fixture
def serve():
    servers = LoopbackServers(TICK)
    yield lambda **server_settings: servers.start(server=server_settings)
    servers.stop_all()


_connect = connect_realtime


async def _refused(srv: LoopbackServer, **kwargs) -> tuple[int, dict]:
    with pytest.raises(InvalidStatus) as info:
        async with _connect(srv, **kwargs):
            pass
    response = info.value.response
    return response.status_code, json.loads(response.body)


def test_api_key_and_origin(serve):
    engine, srv = serve(api_key=KEY, allowed_origins=["https://app.example"])
    own_origin = f"http://127.0.0.1:{srv.port}"

    async def main():
        refusals = [
            await _refused(srv),
            await _refused(srv, additional_headers={"Authorization": "Bearer wrong"}),
            await _refused(srv, subprotocols=["realtime", "openai-insecure-api-key.wrong"]),
            await _refused(srv, additional_headers={"Authorization": f"Bearer {KEY}"}, origin="https://evil.example"),
        ]
        accepted = []
        async with _connect(srv, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            accepted.append(((await recv(ws))["type"], ws.subprotocol))
        async with _connect(srv, subprotocols=["realtime", f"openai-insecure-api-key.{KEY}",
                                               "openai-beta.realtime-v1"], origin="https://app.example") as ws:
            accepted.append(((await recv(ws))["type"], ws.subprotocol))
        async with _connect(srv, subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"], origin=own_origin) as ws:
            accepted.append(((await recv(ws))["type"], ws.subprotocol))
        return refusals, accepted

    refusals, accepted = asyncio.run(main())
    assert [status for status, _ in refusals] == [401, 401, 401, 403]
    for status, body in refusals:  # OpenAI's HTTP error shape
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == ("invalid_api_key" if status == 401 else "origin_not_allowed")
        assert KEY not in body["error"]["message"]
    assert accepted == [("session.created", None), ("session.created", "realtime"), ("session.created", "realtime")]
    assert engine.open_calls == 0
    # /metrics (pool sizes) needs the key too; /health does not
    assert httpx.get(srv.http_url("/metrics")).status_code == 401
    assert httpx.get(srv.http_url("/metrics"), headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(srv.http_url("/health")).status_code == 200


def test_no_key_configured_means_open(serve):
    _, srv = serve()

    async def main():
        async with _connect(srv) as ws:
            return (await recv(ws))["type"]

    assert asyncio.run(main()) == "session.created"
    assert httpx.get(srv.http_url("/metrics")).status_code == 200


def test_cli_flags_and_env_set_the_key(monkeypatch):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    deploy = cli.load_deploy_config(parser.parse_args(["--api-key", "k1", "--allowed-origins", "https://a, https://b"]))
    assert deploy.server.api_key == "k1" and deploy.server.allowed_origins == ["https://a", "https://b"]
    monkeypatch.setenv("DUPLEXCACHE_API_KEY", "k2")
    assert cli.load_deploy_config(parser.parse_args([])).server.api_key == "k2"
    assert cli.load_deploy_config(parser.parse_args([])).server.host == "127.0.0.1"


def test_idle_session_is_closed_an_active_one_is_not(serve):
    # The idle timer is wall-clock by nature: the margins are wide (an active client sends every
    # 0.1 s against a 3 s limit), so only a 3 s stall of this process could fail it.
    engine, srv = serve(idle_timeout_s=3.0)

    async def idle():
        async with _connect(srv) as ws:
            error, _ = await recv_type(ws, "error", timeout=20)
            with pytest.raises(ConnectionClosed):
                await recv(ws)
            return error["error"]["code"], ws.close_code

    async def active():
        async with _connect(srv) as ws:
            for _ in range(60):  # 6 s of audio, 0.1 s at a time: never 3 s without input
                await send(ws, {"type": "input_audio_buffer.append", "audio": pcm16_b64(np.zeros(1600, np.int16))})
                await asyncio.sleep(0.1)
            events = []
            while True:
                try:
                    events.append(await recv(ws, timeout=0.2))
                except asyncio.TimeoutError:
                    break
            return [e["error"]["code"] for e in events if e["type"] == "error"]

    async def main():
        return await asyncio.gather(idle(), active())

    (code, close_code), active_errors = asyncio.run(main())
    assert (code, close_code) == ("idle_timeout", 1008)
    assert "idle_timeout" not in active_errors
    body = httpx.get(srv.http_url("/metrics")).text
    assert 'duplexcache_limit_closes_total{reason="idle_timeout_s"} 1.0' in body


def test_maximum_session_duration(serve):
    engine, srv = serve(max_session_s=0.5)

    async def main():
        async with _connect(srv) as ws:
            await send(ws, {"type": "input_audio_buffer.append", "audio": pcm16_b64(np.zeros(1600, np.int16))})
            error, _ = await recv_type(ws, "error", timeout=20)
            with pytest.raises(ConnectionClosed):
                while True:
                    await recv(ws)
            return error["error"]

    error = asyncio.run(main())
    assert error["code"] == "session_expired" and "0.5 s" in error["message"]
    wait_for(lambda: engine.live == {} and len(engine.closed) == 1, what="the expired session freed")


def test_per_address_connection_and_session_caps(serve):
    engine, srv = serve(max_connections_per_client=3, max_sessions_per_client=2)
    append = {"type": "input_audio_buffer.append", "audio": pcm16_b64(np.zeros(1600, np.int16))}

    async def main():
        a, b, c = [await _connect(srv) for _ in range(3)]
        status, body = await _refused(srv)
        for ws in (a, b, c):
            await recv(ws)  # session.created
            await send(ws, append)
        error, _ = await recv_type(c, "error")
        await a.close()
        wait_for(lambda: len(engine.closed) == 1, what="a's session closed")
        # the server counts a's connection until its clean-up ends, just after the engine close
        wait_for(lambda: httpx.get(srv.http_url("/health")).json()["connections"] == 2,
                 what="a's connection gone")
        async with _connect(srv) as d:  # room again for a connection ...
            assert (await recv(d))["type"] == "session.created"
        await send(c, append)  # ... and for c's session
        wait_for(lambda: engine.opened == 3, what="c's session opened")
        for ws in (b, c):
            await ws.close()
        return status, body, error["error"]

    status, body, error = asyncio.run(main())
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
    assert "max_sessions_per_client" in error["message"]


def test_error_echo_is_bounded(serve):
    _, srv = serve()
    huge = "e" * 100_000

    async def main():
        async with _connect(srv) as ws:
            await recv(ws)
            sizes = []
            for event in ({"type": "no.such.event", "event_id": huge},
                          {"type": huge},
                          {"type": "session.update", "event_id": huge, "session": {huge: 1}},
                          {"type": "conversation.item.truncate", "event_id": huge, "item_id": huge,
                           "audio_end_ms": 10}):
                await send(ws, event)
                raw = await asyncio.wait_for(ws.recv(), 10)
                assert json.loads(raw)["type"] == "error"
                sizes.append(len(raw))
            return sizes

    assert max(asyncio.run(main())) < 1200
