"""Bad input through the MiniCPM-o Realtime dialect (raw websockets, FakeEngine behind the real
server on loopback): each frame is answered by an ``error`` naming the field (``error.param``),
the session goes on (a corrected frame then works), and a good session beside it is unaffected.
Also the dialect's choice: the subprotocol is echoed, an OpenAI client on the same port is not
affected, and the API key is checked as for OpenAI clients."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
from server_fakes import FakeEngine, recv, send
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from duplexcache.config import DeployConfig
from duplexcache.server import minicpmo_protocol as mp
from duplexcache.server.app import REALTIME_PATH, create_app
from duplexcache.server.loopback import LoopbackServer

KEY = "sk-duplexcache-test"
TIMEOUT = 30.0


def _deploy() -> DeployConfig:
    deploy = DeployConfig.default("tiny")
    deploy.engine.tick_seconds = 0.05
    deploy.server.api_key = KEY
    deploy.server.max_sessions_per_client = 16
    return deploy


def _f32(seconds: float) -> str:
    t = np.arange(int(16_000 * seconds)) / 16_000
    return base64.b64encode((0.2 * np.sin(2 * np.pi * 220 * t)).astype("<f4").tobytes()).decode()


def _connect(srv: LoopbackServer, query: str = "?mode=audio&model=m", key: str = KEY):
    return connect(srv.ws_url(REALTIME_PATH) + query, subprotocols=["map.realtime"], max_size=None,
                   additional_headers={"Authorization": f"Bearer {key}"}, open_timeout=10)


# (what is sent, the error code, error.param); each is sent on a connection that has sent nothing else
BAD_INIT = [
    ({"type": "session.init", "payload": {"system_prompt": 5}}, "invalid_value", "payload.system_prompt"),
    ({"type": "session.init", "payload": {"systemprompt": "x"}}, "unknown_parameter", "payload.systemprompt"),
    ({"type": "session.init", "payload": {"config": {"top_k": 3}}}, "unknown_parameter", "payload.config.top_k"),
    ({"type": "session.init", "payload": {"config": {"tts_enabled": "no"}}}, "invalid_value",
     "payload.config.tts_enabled"),
    ({"type": "session.init", "payload": {"config": {"max_kv_tokens": "8k"}}}, "invalid_value",
     "payload.config.max_kv_tokens"),
    ({"type": "session.init", "payload": {"config": {"max_kv_tokens": 10**9}}}, "invalid_value",
     "payload.config.max_kv_tokens"),
    ({"type": "session.init", "payload": {"config": {"temperature": 0.7}}}, "unsupported_parameter",
     "payload.config.temperature"),
    ({"type": "session.init", "payload": {"config": {"max_tokens": 64}}}, "unsupported_parameter",
     "payload.config.max_tokens"),
    ({"type": "session.init", "payload": {"config": {"length_penalty": 1.1}}}, "unsupported_parameter",
     "payload.config.length_penalty"),
    ({"type": "session.init", "payload": {"config": {"vision_hd": True}}}, "unsupported_parameter",
     "payload.config.vision_hd"),
    ({"type": "session.init", "payload": {"max_slice_nums": 4}}, "unsupported_parameter", "payload.max_slice_nums"),
    ({"type": "session.init", "payload": {"voice": {"ref_audio_base64": "not base64!"}}}, "invalid_value",
     "payload.voice.ref_audio_base64"),
    ({"type": "session.init", "payload": {"voice": {"ref_audio_base64": 12}}}, "invalid_value",
     "payload.voice.ref_audio_base64"),
    ({"type": "session.init", "payload": {"voice": {"ref_audio_base64": base64.b64encode(b"abc").decode()}}},
     "invalid_value", "payload.voice.ref_audio_base64"),
    ({"type": "session.init", "payload": {"voice": {"ref_audio_base64": _f32(31.0)}}}, "reference_audio_too_long",
     "payload.voice.ref_audio_base64"),
    ({"type": "session.init", "payload": {"voice": {"ref_audio_base64": _f32(1.0),
                                                    "tts_ref_audio_base64": _f32(0.5)}}},
     "unsupported_parameter", "payload.voice.tts_ref_audio_base64"),
    # the fake engine has no reference voices: said by name, not ignored
    ({"type": "session.init", "payload": {"voice": {"ref_audio_base64": _f32(1.0)}}}, "unsupported_parameter",
     "payload.voice.ref_audio_base64"),
    ({"type": "session.init", "payload": {"system_prompt": "x" * (mp.MAX_SYSTEM_PROMPT_CHARS + 1)}},
     "system_prompt_too_long", "payload.system_prompt"),
    ({"type": "session.init", "payload": {"system_prompt": "\ud800"}}, "invalid_value", "payload.system_prompt"),
    ({"type": "session.init", "payload": []}, "invalid_value", "payload"),
    ({"type": "response.create"}, "unknown_event_type", "type"),
    ({"type": 3}, "invalid_event", "type"),
    ({"type": "input.append", "input": {"audio": _f32(0.1)}}, "session_not_initialized", "type"),
]
# sent after a good session.init
BAD_APPEND = [
    ({"type": "input.append", "input": {"audio": "%%%"}}, "invalid_audio", "input.audio"),
    ({"type": "input.append", "input": {"audio": base64.b64encode(b"abcdef").decode()}}, "invalid_audio",
     "input.audio"),
    ({"type": "input.append", "input": {"audio": base64.b64encode(np.full(4, 3.0, "<f4").tobytes()).decode()}},
     "invalid_audio", "input.audio"),
    ({"type": "input.append", "input": {"audio": 7}}, "invalid_value", "input.audio"),
    ({"type": "input.append", "input": {"audio": _f32(0.1), "force_listen": "yes"}}, "invalid_value",
     "input.force_listen"),
    ({"type": "input.append", "input": {"audio": _f32(0.1), "video_frames": ["/9j/"]}}, "unsupported_parameter",
     "input.video_frames"),
    ({"type": "input.append", "input": {"audio": _f32(0.1), "pitch": 2}}, "unknown_parameter", "input.pitch"),
    ({"type": "input.append", "audio": _f32(0.1)}, "missing_required_parameter", "input"),
    ({"type": "session.init", "payload": {}}, "session_already_initialized", "type"),
    ({"type": "session.close", "reason": 5}, "invalid_value", "reason"),
]


async def _good(srv: LoopbackServer, seconds: float) -> dict:
    """A well-behaved session: init, stream, hear replies, close."""
    async with _connect(srv) as ws:
        assert (await recv(ws, TIMEOUT))["type"] == "session.queue_done"
        await send(ws, {"type": "session.init", "payload": {"system_prompt": "You are a test."}})
        created = await recv(ws, TIMEOUT)
        assert created["type"] == "session.created", created
        for _ in range(int(seconds * 10)):
            await send(ws, {"type": "input.append", "input": {"audio": _f32(0.1)}})
            await asyncio.sleep(0.01)
        seen = []
        while sum(e["type"] == "response.done" for e in seen) < 1:
            seen.append(await recv(ws, TIMEOUT))
        await send(ws, {"type": "session.close", "reason": "done"})
        while seen[-1]["type"] != "session.closed":
            seen.append(await recv(ws, TIMEOUT))
        await asyncio.wait_for(ws.wait_closed(), TIMEOUT)
        return {"seen": seen, "code": ws.close_code}


async def _bad_init(srv: LoopbackServer, frame: dict) -> dict:
    async with _connect(srv) as ws:
        assert (await recv(ws, TIMEOUT))["type"] == "session.queue_done"
        await send(ws, frame)
        error = await recv(ws, TIMEOUT)
        # nothing was opened: a corrected session.init works on the same connection
        await send(ws, {"type": "session.init", "payload": {}})
        after = await recv(ws, TIMEOUT)
        return {"error": error, "after": after}


async def _bad_append(srv: LoopbackServer, frame: dict) -> dict:
    async with _connect(srv) as ws:
        await recv(ws, TIMEOUT)
        await send(ws, {"type": "session.init", "payload": {}})
        assert (await recv(ws, TIMEOUT))["type"] == "session.created"
        await send(ws, frame)
        error = await recv(ws, TIMEOUT)
        await send(ws, {"type": "input.append", "input": {"audio": _f32(0.1)}})   # still usable
        await send(ws, {"type": "session.close"})
        after = await recv(ws, TIMEOUT)
        return {"error": error, "after": after}


def test_bad_input_is_refused_by_field_and_the_sessions_go_on():
    deploy = _deploy()
    engine = FakeEngine(deploy, done_after_units=1)

    async def main(srv: LoopbackServer):
        good = asyncio.create_task(_good(srv, 2.2))
        inits = [await _bad_init(srv, frame) for frame, _, _ in BAD_INIT]
        appends = [await _bad_append(srv, frame) for frame, _, _ in BAD_APPEND]
        return await good, inits, appends

    with LoopbackServer(create_app(engine, deploy), max_frame_bytes=deploy.server.max_frame_bytes) as srv:
        good, inits, appends = asyncio.run(main(srv))

    for (frame, code, param), got in zip(BAD_INIT + BAD_APPEND, inits + appends):
        error = got["error"]
        assert error["type"] == "error", (frame, error)
        assert (error["error"]["code"], error["error"]["param"]) == (code, param), (str(frame)[:80], error)
        assert len(json.dumps(error)) < 1000   # nothing large echoed back
    for got in inits:
        assert got["after"]["type"] == "session.created", got
    for (frame, _, _), got in zip(BAD_APPEND, appends):
        assert got["after"]["type"] == "session.closed", (frame, got)
    assert good["code"] == 1000 and not [e for e in good["seen"] if e["type"] == "error"]
    assert [e["type"] for e in good["seen"]][-1] == "session.closed"
    assert engine.live == {} and engine.queued == {}   # every session, bad or good, was closed


def test_dialect_is_chosen_by_the_handshake_and_shares_its_checks():
    deploy = _deploy()
    engine = FakeEngine(deploy)

    async def main(srv: LoopbackServer):
        async with _connect(srv) as ws:
            first = await recv(ws, TIMEOUT)
            subprotocol = ws.subprotocol
        async with _connect(srv, query="") as ws:    # the subprotocol alone chooses it too
            by_subprotocol = await recv(ws, TIMEOUT)
        async with connect(srv.ws_url(REALTIME_PATH) + "?model=m",
                           additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:   # OpenAI's
            openai_first = await recv(ws, TIMEOUT)
        with pytest.raises(InvalidStatus) as refused:
            async with _connect(srv, key="wrong"):
                pass
        async with _connect(srv, query="?mode=video&model=m") as ws:
            video = await recv(ws, TIMEOUT)
            await asyncio.wait_for(ws.wait_closed(), TIMEOUT)
            video_close = ws.close_code
        return first, subprotocol, by_subprotocol, openai_first, refused.value, video, video_close

    with LoopbackServer(create_app(engine, deploy)) as srv:
        first, subprotocol, by_subprotocol, openai_first, refused, video, video_close = asyncio.run(main(srv))
    assert first["type"] == "session.queue_done" and subprotocol == "map.realtime"
    assert by_subprotocol["type"] == "session.queue_done"
    assert openai_first["type"] == "session.created" and openai_first["session"]["object"] == "realtime.session"
    assert refused.response.status_code == 401
    assert video["error"]["code"] == "unsupported_mode" and video["error"]["param"] == "mode"
    assert video_close == 1008


def test_parse_helpers_name_their_field():
    with pytest.raises(mp.ProtocolError) as err:
        mp.parse_session_init(mp.ClientEvent("session.init", {"payload": {"config": {"max_kv_tokens": True}}}))
    assert err.value.param == "payload.config.max_kv_tokens"
    init = mp.parse_session_init(mp.ClientEvent("session.init", {"payload": {
        "system_prompt": "hi", "config": {"tts_enabled": False, "max_kv_tokens": 100},
        "voice": {"ref_audio_base64": _f32(0.5), "tts_ref_audio_base64": _f32(0.5)}}}))
    assert (init.system_prompt, init.tts_enabled, init.max_kv_tokens) == ("hi", False, 100)
    assert init.ref_audio is not None and init.ref_audio.dtype == np.float32 and init.ref_audio.size == 8000
    usage = mp.Usage(10, 25, context_tokens=20, input_audio_seconds=3.0, output_text_tokens=4,
                     output_audio_seconds=2.0).to_wire()
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (50, 54, 104)
    assert usage["input_tokens_details"]["audio_tokens"] == 30 and usage["output_tokens_details"]["audio_tokens"] == 50


@pytest.mark.parametrize("depth", [40, 2000])
def test_deep_json_is_refused_as_in_the_openai_dialect(depth):
    """The dialect parses frames with the OpenAI dialect's bounds (issue 48: a deep event reached
    recursive walks); past 32 levels it is nesting_too_deep, not invalid_json or a traceback."""
    frame = '{"type": "input.append", "input": ' + '{"a": ' * depth + '1' + '}' * depth + '}'
    with pytest.raises(mp.ProtocolError) as err:
        mp.parse_client_event(frame)
    assert err.value.code == "nesting_too_deep"
