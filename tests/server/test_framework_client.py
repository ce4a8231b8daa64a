"""A voice-agent framework's stock OpenAI Realtime client against our server: LiveKit Agents'
``openai.realtime.RealtimeModel`` (livekit-plugins-openai), unmodified, pointed at a real server
on 127.0.0.1 with the deterministic FakeEngine behind it, gets the reply's audio back.

LiveKit rather than Pipecat: pipecat-ai pins Pillow>=11.1 (minicpmo-utils, our reference
implementation, pins Pillow==10.4.0), protobuf<7 and soxr~=1.0, so it cannot share the test
environment; livekit-agents + livekit-plugins-openai install beside it without changing a package.
"""

from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest
from server_fakes import FakeEngine

from duplexcache.config import DeployConfig
from duplexcache.server.app import create_app
from duplexcache.server.loopback import LoopbackServer

lk_openai = pytest.importorskip("livekit.plugins.openai", reason="livekit-plugins-openai is not installed")
rtc = pytest.importorskip("livekit.rtc")
aiohttp = pytest.importorskip("aiohttp")

TICK = 0.05
RATE = 24_000          # OpenAI's audio/pcm rate, both ways
UNIT_OUT = 24_000      # the FakeEngine's samples per unit (one second at 24 kHz)
DONE_AFTER_UNITS = 2   # units per reply


@pytest.fixture
def served():
    deploy = DeployConfig.default("tiny")
    deploy.engine.tick_seconds = TICK
    engine = FakeEngine(deploy, done_after_units=DONE_AFTER_UNITS)
    srv = LoopbackServer(create_app(engine, deploy)).start()
    yield engine, srv
    srv.stop()


def _frames(seconds: float, frame_ms: int = 100) -> list:
    """Speech-band noise as 24 kHz mono pcm16 frames (the fake engine does not listen to content)."""
    pcm = (np.random.default_rng(7).uniform(-0.3, 0.3, int(RATE * seconds)) * 32767).astype("<i2")
    step = RATE * frame_ms // 1000
    return [rtc.AudioFrame(data=pcm[i:i + step].tobytes(), sample_rate=RATE, num_channels=1,
                           samples_per_channel=step) for i in range(0, len(pcm), step)]


async def _drain(generation) -> tuple[list, list[str]]:
    """Every audio frame and text piece of one generation (it ends at the server's response.done)."""
    frames, texts = [], []

    async def _message(message) -> None:
        async def _audio() -> None:
            async for frame in message.audio_stream:
                frames.append(frame)

        async def _text() -> None:
            async for text in message.text_stream:
                texts.append(str(text))

        await asyncio.gather(_audio(), _text())

    async for message in generation.message_stream:
        await _message(message)
    return frames, texts


def _model(base_url: str, http, turn_detection, voice: str | None = "default"):
    """``voice`` None: LiveKit's own default voice, one of OpenAI's."""
    return lk_openai.realtime.RealtimeModel(
        base_url=base_url, api_key="unused", modalities=["audio"], turn_detection=turn_detection,
        input_audio_transcription=None, http_session=http, **({} if voice is None else {"voice": voice}))


async def _server_started_reply(base_url: str, voice: str | None = "default") -> tuple[list, list[str], list]:
    """LiveKit with semantic_vad (the server's duplex mode: the model decides when to speak):
    stream audio and take the first reply the server starts by itself."""
    from openai.types.realtime.realtime_audio_input_turn_detection import SemanticVad

    errors: list = []
    async with aiohttp.ClientSession() as http:
        session = _model(base_url, http, SemanticVad(type="semantic_vad"), voice).session()
        session.on("error", errors.append)
        generations: asyncio.Queue = asyncio.Queue()
        session.on("generation_created", generations.put_nowait)
        try:
            await session.update_instructions("Answer briefly.")
            # A unit needs a whole second buffered at the engine, and the server's resampler holds
            # a few samples back: 3 s give the reply's two units.
            for frame in _frames(3.0):
                session.push_audio(frame)
            generation = await asyncio.wait_for(generations.get(), 30)
            frames, texts = await asyncio.wait_for(_drain(generation), 60)
        finally:
            await session.aclose()
    return frames, texts, errors


async def _requested_reply(base_url: str) -> tuple[list, list[str], list]:
    """LiveKit with turn detection off (push to talk): commit, generate_reply(), take the reply."""
    errors: list = []
    async with aiohttp.ClientSession() as http:
        session = _model(base_url, http, None).session()
        session.on("error", errors.append)
        try:
            for frame in _frames(3.0):
                session.push_audio(frame)
            session.commit_audio()
            generation = await asyncio.wait_for(session.generate_reply(), 30)
            # The reply speaks one unit per tick of buffered input. The real engine fills silence
            # for a push-to-talk caller (scheduler.fill_silence_after_ms); the FakeEngine does not, and
            # a tick may take one of the 3 s before response.create lands (it did, ~1 run in 5),
            # leaving one unit for a two-unit reply. So the caller keeps sending, as a mic does.
            for frame in _frames(3.0):
                session.push_audio(frame)
            frames, texts = await asyncio.wait_for(_drain(generation), 60)
        finally:
            await session.aclose()
    return frames, texts, errors


def _check_reply(engine: FakeEngine, frames: list, texts: list[str]) -> None:
    assert frames and all(f.sample_rate == RATE and f.num_channels == 1 for f in frames)
    audio = np.concatenate([np.frombuffer(f.data, dtype="<i2") for f in frames])
    # One whole reply: DONE_AFTER_UNITS units of UNIT_OUT samples, each unit all equal to its
    # number (FakeEngine), so the audio is exactly what the engine made, in order.
    assert len(audio) == DONE_AFTER_UNITS * UNIT_OUT, len(audio)
    units = audio.reshape(DONE_AFTER_UNITS, UNIT_OUT)
    assert (units == units[:, :1]).all() and (np.diff(units[:, 0]) == 1).all(), units[:, 0]
    assert "".join(texts).strip(), texts
    # The server heard what LiveKit sent: 24 kHz on the wire reaches the engine as 16 kHz.
    (sid,) = engine.received
    assert sum(len(chunk) for chunk in engine.received[sid]) > 16_000


def test_livekit_realtime_model_gets_audio_back(served):
    engine, srv = served
    frames, texts, errors = asyncio.run(_server_started_reply(srv.http_url("/v1")))
    assert errors == [], errors
    _check_reply(engine, frames, texts)
    (sid,) = engine.turn_modes
    assert engine.turn_modes[sid][-1] == "duplex"  # semantic_vad is the model's own turn taking


def test_livekit_generate_reply(served):
    engine, srv = served
    frames, texts, errors = asyncio.run(_requested_reply(srv.http_url("/v1")))
    assert errors == [], errors
    _check_reply(engine, frames, texts)


@pytest.mark.parametrize("aliases", [None, {}], ids=["default_aliases", "no_aliases"])
def test_livekit_with_its_own_default_voice(aliases):
    """LiveKit asks for one of OpenAI's voices unless told otherwise. The server has only its own
    (a voice registry as the real engine's): with the default server.voice_aliases the engine
    opens the session with "default"; with none, the update is refused with an error naming them."""
    deploy = DeployConfig.default("tiny")
    deploy.engine.tick_seconds = TICK
    if aliases is not None:
        deploy.server.voice_aliases = aliases
    engine = FakeEngine(deploy, done_after_units=DONE_AFTER_UNITS)
    engine.voices = types.SimpleNamespace(names=lambda: ["default", "alt"])
    srv = LoopbackServer(create_app(engine, deploy)).start()
    try:
        frames, texts, errors = asyncio.run(_server_started_reply(srv.http_url("/v1"), voice=None))
    finally:
        srv.stop()
    if aliases is None:
        assert errors == [], errors
        _check_reply(engine, frames, texts)
        (config,) = engine.configs.values()
        assert config["voice"] == "default"
    else:
        assert any("unknown voice" in str(e) for e in errors), errors
