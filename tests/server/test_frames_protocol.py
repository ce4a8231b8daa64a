"""Frames on the wire (server/frames.py, minicpmo_protocol.py): what each dialect's image fields
parse to, and every refusal naming its field; an image sent to a server without a vision model
is refused by feature (FakeEngine behind the real server, no vision)."""
from __future__ import annotations

import asyncio
import base64
import json

import pytest
from server_fakes import FakeEngine
from websockets.asyncio.client import connect

from duplexcache.config import DeployConfig
from duplexcache.server import frames
from duplexcache.server import minicpmo_protocol as mp
from duplexcache.server.app import create_app
from duplexcache.server.loopback import LoopbackServer
from duplexcache.server.protocol import ProtocolError

JPEG_B64 = base64.b64encode(b"\xff\xd8\xff\xe0 not really a jpeg").decode()


def _append(frames_value) -> mp.InputAppend:
    body = {"type": "input.append", "input": {"audio": "", "video_frames": frames_value}}
    return mp.parse_input_append(mp.ClientEvent("input.append", body))


def test_video_frames_parse_to_bytes_and_bad_ones_are_named():
    assert _append([JPEG_B64]).video_frames == (base64.b64decode(JPEG_B64),)
    assert _append(None).video_frames == ()
    for value, param, what in ((JPEG_B64, "input.video_frames", "must be a list"),
                               ([JPEG_B64] * 5, "input.video_frames", "at most 4"),
                               ([JPEG_B64, 7], "input.video_frames[1]", "non-empty base64"),
                               (["%%%"], "input.video_frames[0]", "not valid base64")):
        with pytest.raises(ProtocolError, match=what) as err:
            _append(value)
        assert err.value.param == param


def test_slicing_settings_accept_the_duplex_values_only():
    def init(payload):
        return mp.parse_session_init(mp.ClientEvent("session.init", {"type": "session.init", "payload": payload}))

    init({"max_slice_nums": 1, "config": {"vision_hd": False}})
    with pytest.raises(ProtocolError, match="never sliced") as err:
        init({"max_slice_nums": 9})
    assert err.value.param == "payload.max_slice_nums"
    with pytest.raises(ProtocolError, match="high-definition") as err:
        init({"config": {"vision_hd": True}})
    assert err.value.param == "payload.config.vision_hd"


def test_image_data_urls():
    part = {"type": "input_image", "image_url": "data:image/png;base64," + JPEG_B64, "detail": "high"}
    assert frames.image_from_data_url(part, "item.content[0]", None) == base64.b64decode(JPEG_B64)
    for bad, param, what in (({"image_url": "https://example.com/x.jpg"}, "item.content[0].image_url", "remote"),
                             ({"image_url": "data:image/gif;base64," + JPEG_B64}, "item.content[0].image_url",
                              "JPEG or PNG"),
                             ({"image_url": "data:image/jpeg;base64,@@@"}, "item.content[0].image_url",
                              "not valid base64"),
                             ({"image_url": None}, "item.content[0].image_url", "data URL string"),
                             ({"image_url": "data:image/jpeg;base64,x", "detail": "ultra"},
                              "item.content[0].detail", "auto, low or high")):
        with pytest.raises(ProtocolError, match=what) as err:
            frames.image_from_data_url({"type": "input_image", **bad}, "item.content[0]", None)
        assert err.value.param == param


def test_an_image_to_a_server_without_vision_is_refused_by_feature():
    deploy = DeployConfig.default("tiny")
    deploy.engine.tick_seconds = 0.05
    engine = FakeEngine(deploy)

    async def main(srv: LoopbackServer):
        async with connect(srv.ws_url("/v1/realtime")) as ws:
            json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user",
                "content": [{"type": "input_image", "image_url": "data:image/jpeg;base64," + JPEG_B64}]}}))
            return json.loads(await asyncio.wait_for(ws.recv(), 30))

    with LoopbackServer(create_app(engine, deploy)) as srv:
        err = asyncio.run(main(srv))
    assert err["type"] == "error" and err["error"]["code"] == "vision_unavailable", err
    assert err["error"]["param"] == "item.content[0]" and "model.vision is false" in err["error"]["message"]


def test_usage_counts_vision_tokens_in_the_input():
    usage = mp.Usage(10, 25, context_tokens=7, input_audio_seconds=2.0, vision_tokens=128).to_wire()
    assert usage["input_tokens_details"]["vision_tokens"] == 128
    assert usage["input_tokens"] == 7 + 20 + 128
