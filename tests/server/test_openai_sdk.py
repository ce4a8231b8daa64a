"""The official `openai` Python SDK's realtime client, unmodified, against our server.

`AsyncOpenAI(base_url=.../v1).realtime.connect(model=...)`: connect (with the API key), session.update
(GA shape: voice, instructions, 24 kHz input), stream audio, hear audio deltas and the transcript,
and cut a reply with response.cancel. The FakeEngine variants run everywhere; the real tiny engine
variant runs once the engine has the turn API (branch `turns`), and skips with that reason before.
"""

from __future__ import annotations

import asyncio
import base64
import copy

import numpy as np
import pytest
import soxr
from openai import AsyncOpenAI
from server_fakes import FakeEngine

from duplexcache.config import DeployConfig
from duplexcache.server.app import create_app
from duplexcache.server.loopback import LoopbackServer

KEY = "sk-duplexcache-test"
TICK = 0.05
TIMEOUT = 120.0  # per awaited event; generous: only a broken server gets near it


def _deploy() -> DeployConfig:
    deploy = DeployConfig.default("tiny")
    deploy.engine.tick_seconds = TICK
    # admission by time measures this machine's ticks: a busy CI box must not refuse a session here
    deploy.engine.tick_headroom = 1e9
    deploy.server.api_key = KEY
    return deploy


def _tone_24k(seconds: float) -> np.ndarray:
    t = np.arange(int(24_000 * seconds)) / 24_000
    return (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2")


def _client(srv: LoopbackServer) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=srv.http_url("/v1"), api_key=KEY, max_retries=0)


GA_UPDATE = {"type": "realtime", "instructions": "You are a test.",
             "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}},
                       "output": {"voice": "alt", "format": {"type": "audio/pcm", "rate": 24000}}}}


async def _until(conn, kind: str, seen: list) -> object:
    async def loop():
        async for event in conn:
            seen.append(event)
            if event.type == kind:
                return event
        raise AssertionError(f"connection closed before {kind}")
    return await asyncio.wait_for(loop(), TIMEOUT)


async def _until_seen(conn, kinds: set[str], seen: list) -> None:
    """Read events until every kind in ``kinds`` is in ``seen`` (earlier events count: a reply's
    transcript delta comes a unit before its audio)."""
    async def loop():
        if kinds <= {e.type for e in seen}:
            return
        async for event in conn:
            seen.append(event)
            if kinds <= {e.type for e in seen}:
                return
        raise AssertionError(f"connection closed before {kinds - {e.type for e in seen}}")
    await asyncio.wait_for(loop(), TIMEOUT)


async def _manual_turns(conn, seen: list, voice: str | None = None) -> None:
    """After session.created, GA_UPDATE with turn_detection null (the client commits and asks),
    answered by session.updated."""
    await _until(conn, "session.created", seen)
    update = copy.deepcopy(GA_UPDATE)   # never mutate the shared constant
    update["audio"]["input"]["turn_detection"] = None
    if voice is not None:
        update["audio"]["output"]["voice"] = voice
    await conn.session.update(session=update)
    await _until(conn, "session.updated", seen)


def _real_tiny_engine(deploy: DeployConfig):
    """The real engine on the tiny preset (one torch thread: CI's two cores are shared)."""
    import torch

    from duplexcache.runtime.engine import build_engine

    torch.set_num_threads(1)
    return build_engine(deploy)


async def _stream(conn, pcm: np.ndarray, chunk: int = 4800) -> None:
    for i in range(0, pcm.size, chunk):
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + chunk].tobytes()).decode())


def test_sdk_streams_24k_audio_and_hears_audio_and_transcript():
    deploy = _deploy()
    engine = FakeEngine(deploy, done_after_units=2)
    pcm = _tone_24k(2.1)  # a little over 2 units: the streaming resampler holds back a few ms

    async def main(srv: LoopbackServer) -> list:
        seen: list = []
        async with _client(srv).realtime.connect(model="duplexcache-tiny") as conn:
            created = await _until(conn, "session.created", seen)
            assert created.session.audio.input.format.rate == 24000  # OpenAI's default for its clients
            await conn.session.update(session=GA_UPDATE)
            updated = await _until(conn, "session.updated", seen)
            assert updated.session.audio.output.voice == "alt"
            await _stream(conn, pcm)
            done = await _until(conn, "response.done", seen)
            assert done.response.status == "completed"
            assert done.response.usage.output_tokens == 4  # the fake's 2 tokens per unit, 2 units
        return seen

    with LoopbackServer(create_app(engine, deploy)) as srv:
        seen = asyncio.run(main(srv))
    kinds = [e.type for e in seen]
    first = kinds.index("response.created")
    assert kinds[first:first + 4] == ["response.created", "response.output_item.added", "conversation.item.added",
                                      "response.content_part.added"]
    audio = b"".join(base64.b64decode(e.delta) for e in seen if e.type == "response.output_audio.delta")
    assert np.array_equal(np.frombuffer(audio, "<i2"), np.repeat(np.arange(1, 3, dtype=np.int16), 24000))
    transcript = "".join(e.delta for e in seen if e.type == "response.output_audio_transcript.delta")
    assert transcript == "unit 1unit 2"
    assert [e for e in seen if e.type == "response.output_audio_transcript.done"][0].transcript == transcript
    # The engine got the session's settings and the 24 kHz input resampled to 16 kHz.
    (sid, received), = engine.received.items()
    got = np.concatenate(received)
    want = soxr.resample(pcm.astype(np.float32) / 32768.0, 24_000, 16_000, quality="HQ")
    assert 0 <= want.size - got.size <= 480  # the streaming resampler holds back its last few ms
    np.testing.assert_allclose(got, want[:got.size], atol=1e-5)  # chunking does not change the samples
    assert sid in engine.closed


def test_sdk_text_modality_gets_text_events_and_no_audio():
    """GA ``output_modalities: ["text"]`` is the engine's text-only switch (``audio_output`` off,
    the one MiniCPM-o's ``tts_enabled: false`` uses): OpenAI's text events, no audio events."""
    deploy = _deploy()
    engine = FakeEngine(deploy, done_after_units=2)

    async def main(srv: LoopbackServer) -> list:
        seen: list = []
        async with _client(srv).realtime.connect(model="duplexcache-tiny") as conn:
            await _until(conn, "session.created", seen)
            await conn.session.update(session={**GA_UPDATE, "output_modalities": ["text"]})
            updated = await _until(conn, "session.updated", seen)
            assert updated.session.output_modalities == ["text"]
            await _stream(conn, _tone_24k(2.1))
            done = await _until(conn, "response.done", seen)
            assert done.response.output[0].content[0].type == "output_text"
        return seen

    with LoopbackServer(create_app(engine, deploy)) as srv:
        seen = asyncio.run(main(srv))
    (config,) = engine.configs.values()
    assert config["audio_output"] is False
    kinds = {e.type for e in seen}
    assert not {k for k in kinds if "audio" in k}, kinds
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    assert text == "unit 1unit 2"
    assert [e.text for e in seen if e.type == "response.output_text.done"] == [text]


def test_sdk_response_cancel_cuts_a_reply():
    deploy = _deploy()
    engine = FakeEngine(deploy, done_after_units=50)

    async def main(srv: LoopbackServer) -> list:
        seen: list = []
        async with _client(srv).realtime.connect(model="duplexcache-tiny") as conn:
            await _manual_turns(conn, seen)
            await _stream(conn, _tone_24k(1.0))
            await conn.input_audio_buffer.commit()
            await _until(conn, "input_audio_buffer.committed", seen)
            await conn.response.create()
            await _stream(conn, _tone_24k(30.0))  # keeps units running; the reply would be 50 units long
            await _until(conn, "response.output_audio.delta", seen)
            await conn.response.cancel()
            done = await _until(conn, "response.done", seen)
            assert done.response.status == "cancelled"
        return seen

    with LoopbackServer(create_app(engine, deploy)) as srv:
        seen = asyncio.run(main(srv))
    (sid, modes), = engine.turn_modes.items()
    assert modes == ["manual"] and engine.response_requests == {sid: 1}
    (cancel_sid, played_ms), = engine.cancels
    assert cancel_sid == sid and played_ms is not None and played_ms % 1000 == 0  # whole fake units written
    deltas = [e for e in seen if e.type == "response.output_audio.delta"]
    assert 1 <= len(deltas) < 50


def test_sdk_against_the_real_tiny_engine():
    deploy = _deploy()
    deploy.engine.tick_seconds = 0.2
    # One endless speaking turn once a reply is requested, so the reply is still going when the
    # client cancels it (the default scripted turns end after two units).
    deploy.engine.speak_policy.k = deploy.engine.speak_policy.turn_units = 1000
    engine = _real_tiny_engine(deploy)

    async def main(srv: LoopbackServer) -> list:
        seen: list = []
        async with _client(srv).realtime.connect(model="duplexcache-tiny") as conn:
            await _manual_turns(conn, seen, voice="default")
            await _stream(conn, _tone_24k(1.0))
            await conn.response.create()
            await _stream(conn, _tone_24k(6.0))
            await _until_seen(conn, {"response.output_audio.delta", "response.output_audio_transcript.delta"}, seen)
            await conn.response.cancel()
            done = await _until(conn, "response.done", seen)
            assert done.response.status == "cancelled"
        return seen

    with LoopbackServer(create_app(engine, deploy)) as srv:
        asyncio.run(main(srv))


def test_sdk_push_to_talk_gets_its_reply_without_sending_more_audio():
    """A push-to-talk client (turn detection null): it streams while the button is held, commits,
    asks for a reply and then sends nothing. The server hears silence once the client has been
    quiet for ``scheduler.fill_silence_after_ms`` (engine_session.SilenceFill), so the model keeps
    running units and the reply comes; waiting for the client's audio, it never would."""
    deploy = _deploy()
    deploy.engine.tick_seconds = 0.2
    engine = _real_tiny_engine(deploy)

    async def main(srv: LoopbackServer) -> list:
        seen: list = []
        async with _client(srv).realtime.connect(model="duplexcache-tiny") as conn:
            await _manual_turns(conn, seen, voice="default")
            pcm = _tone_24k(1.5)
            for i in range(0, pcm.size, 2400):   # 100 ms chunks in real time: the button is held
                await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + 2400].tobytes()).decode())
                await asyncio.sleep(0.1)
            await conn.input_audio_buffer.commit()
            await _until(conn, "input_audio_buffer.committed", seen)
            await conn.response.create()          # ... and released: no more audio from here on
            await _until(conn, "response.output_audio.delta", seen)
        return seen

    with LoopbackServer(create_app(engine, deploy)) as srv:
        asyncio.run(main(srv))
