"""OpenBMB's `openbmb-realtime` SDK, unmodified, in video mode against a real tiny server with
``model.vision: true`` (issue 47): ``client.video.connect`` and ``send_audio_video(pcm, jpeg)``
get replies while the frames go through the vision stage; a corrupt JPEG gets an ``error`` naming
``input.video_frames[0]`` (the SDK ends its session on any error: its own choice); an audio-only
session beside it goes on hearing replies, without an error. The OpenAI dialect's image input
(``conversation.item.create`` with ``input_image``) is checked on the same server."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import sys
from pathlib import Path

import numpy as np
import torch
from openbmb_realtime import AudioDelta, ErrorEvent, RealtimeClient, TextDelta
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from test_minicpmo_sdk import KEY, TIMEOUT, Listener, _count, _deploy, _stream, _tone  # noqa: E402

from duplexcache.server.app import create_app
from duplexcache.server.loopback import LoopbackServer

RATE = 16_000


def _jpeg(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (240, 320, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG")
    return buf.getvalue()


async def _stream_video(session, seconds: float, freq: float, seed: int) -> None:
    """Whole seconds of audio, each with a frame, as a camera client sends them."""
    pcm = _tone(seconds, freq) if freq else np.zeros(int(RATE * seconds), "<f4")
    for k, i in enumerate(range(0, pcm.size, RATE)):
        await session.send_audio_video(pcm[i:i + RATE].tobytes(), _jpeg(seed + k))
        await asyncio.sleep(0)


def _engine(deploy):
    from duplexcache.runtime.engine import build_engine

    torch.set_num_threads(1)
    policy = deploy.engine.speak_policy
    policy.mode, policy.reply_min_units, policy.reply_max_units = "reply", 2, 2
    deploy.model.vision = True
    return build_engine(deploy)


def test_sdk_video_mode_replies_a_corrupt_jpeg_is_named_and_an_audio_bystander_goes_on():
    deploy = _deploy()
    engine = _engine(deploy)

    async def main(srv: LoopbackServer):
        client = RealtimeClient(api_key=KEY, base_url=srv.http_url(), connect_timeout=TIMEOUT)
        video = await client.video.connect(model="minicpm-o-4.5-realtime", system_prompt="You see a camera.")
        bystander = await client.audio.connect(model="minicpm-o-4.5-realtime")
        seen, heard = Listener(video), Listener(bystander)
        await asyncio.gather(_stream_video(video, 1.0, 220.0, 0), _stream(bystander, 1.0))
        await asyncio.gather(_stream_video(video, 2.0, 0.0, 10), _stream(bystander, 1.3, freq=0))
        await seen.until(lambda ev: _count(AudioDelta)(ev) and _count(TextDelta)(ev), "the video session's reply")
        await heard.until(_count(AudioDelta), "the bystander's first reply")
        encoded = engine.vision_stage.frames_encoded
        corrupt = _jpeg(99)[:300]   # a JPEG header and the start of its scan: truncated
        await video.send_audio_video(_tone(1.0).tobytes(), corrupt)
        await seen.until(_count(ErrorEvent), "the corrupt frame's error")
        before = _count(AudioDelta)(heard.events)
        await _stream(bystander, 1.0)   # the bystander's next turn is answered as before
        await _stream(bystander, 1.3, freq=0)
        await heard.until(lambda ev: _count(AudioDelta)(ev) > before, "the bystander's second reply")
        await bystander.close()
        await asyncio.wait_for(heard.task, TIMEOUT)
        return seen.events, heard.events, encoded

    with LoopbackServer(create_app(engine, deploy)) as srv:
        video_events, bystander_events, encoded = asyncio.run(main(srv))
    assert encoded >= 2   # the frames went through the vision stage
    (error,) = [e for e in video_events if isinstance(e, ErrorEvent)]
    assert error.code == "invalid_image" and "input.video_frames[0]" in error.message, error
    assert "truncated" in error.message or "corrupt" in error.message, error
    assert not [e for e in bystander_events if isinstance(e, ErrorEvent)]
    engine.shutdown()


def test_openai_image_input_rides_with_the_next_unit_and_bad_images_are_named():
    from websockets.asyncio.client import connect

    deploy = _deploy()
    engine = _engine(deploy)
    good = "data:image/jpeg;base64," + base64.b64encode(_jpeg(1)).decode()

    async def item(ws, content: list[dict]) -> dict:
        await ws.send(json.dumps({"type": "conversation.item.create",
                                  "item": {"type": "message", "role": "user", "content": content}}))
        while True:
            ev = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
            if ev["type"] in ("error", "conversation.item.added", "conversation.item.created"):
                return ev

    async def main(srv: LoopbackServer):
        async with connect(srv.ws_url("/v1/realtime"), additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            json.loads(await ws.recv())   # session.created
            added = await item(ws, [{"type": "input_text", "text": "what is this?"},
                                    {"type": "input_image", "image_url": good, "detail": "low"}])
            cut = "data:image/jpeg;base64," + base64.b64encode(_jpeg(1)[:300]).decode()   # truncated JPEG
            bad = await item(ws, [{"type": "input_text", "text": "and this?"},
                                  {"type": "input_image", "image_url": cut}])
            remote = await item(ws, [{"type": "input_image", "image_url": "https://example.com/a.jpg"}])
            pending = engine.table.get_live(engine.session_ids()[0]).frames
            frames_held = len(pending)
            pcm = base64.b64encode((_tone(1.1) * 32767).astype("<i2").tobytes()).decode()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": pcm}))
            for _ in range(int(TIMEOUT / 0.05)):
                if engine.vision_stage.frames_encoded:
                    break
                await asyncio.sleep(0.05)
            return added, bad, remote, frames_held

    with LoopbackServer(create_app(engine, deploy)) as srv:
        added, bad, remote, frames_held = asyncio.run(main(srv))
    assert added["type"] == "conversation.item.added", added
    assert [p["type"] for p in added["item"]["content"]] == ["input_image", "input_text"]
    assert frames_held == 1 and engine.vision_stage.frames_encoded == 1
    assert bad["type"] == "error" and bad["error"]["code"] == "invalid_image", bad
    assert bad["error"]["param"] == "item.content[1]" and "item.content[1]" in bad["error"]["message"]
    assert remote["type"] == "error" and remote["error"]["param"] == "item.content[0].image_url", remote
    engine.shutdown()
