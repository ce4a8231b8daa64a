"""OpenBMB's `openbmb-realtime` SDK (pinned in the test extras), unmodified, against our server.

The MiniCPM-o Realtime dialect (server/minicpmo_protocol.py) on the same port as OpenAI's:
``client.audio.connect(...)`` returns, ``send_audio`` streams seconds of 16 kHz float32, text and
audio deltas arrive, ``interrupt()`` cuts the reply in progress (no audio of it after its
``response.done``), usage is read and ``close()`` ends cleanly; a second session sending the same
reference recording shares the first one's voice (the engine's counters: one voice made, one
reuse, one Code2Wav prompt pass). With the server full the SDK hears the queue events and its
``connect`` returns once room frees.

The frames the SDK receives are also recorded (a wrapper around websockets' ``recv``, below the
SDK), to check reply ids the SDK does not expose.
"""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
import torch
from openbmb_realtime import (AudioDelta, RealtimeClient, RealtimeConfig, RealtimeError, SessionClosed,
                              SessionQueued, SessionReady, SessionState, TextDelta, TurnCompleted, WorkerAssigned)
from server_fakes import FakeEngine
from websockets.asyncio.client import ClientConnection

from duplexcache.config import DeployConfig
from duplexcache.server.app import create_app
from duplexcache.server.loopback import LoopbackServer

KEY = "sk-duplexcache-test"
RATE = 16_000
CHUNK = RATE // 10
TIMEOUT = 120.0   # per awaited condition: only a broken server gets near it
REPLY_UNITS = 6


def _deploy() -> DeployConfig:
    deploy = DeployConfig.default("tiny")
    deploy.engine.tick_seconds = 0.05
    deploy.engine.tick_headroom = 1e9   # admit by memory only: a loaded CI box must not refuse
    deploy.server.api_key = KEY
    deploy.server.max_sessions_per_client = 16
    return deploy


def _tone(seconds: float, freq: float = 220.0) -> np.ndarray:
    t = np.arange(int(RATE * seconds)) / RATE
    return (0.2 * np.sin(2 * np.pi * freq * t)).astype("<f4")


REFERENCE = base64.b64encode(_tone(1.0, 330.0).tobytes()).decode()


@pytest.fixture
def wire(monkeypatch) -> list[dict]:
    """Every JSON frame any websockets client receives, in order (the SDK uses websockets)."""
    frames: list[dict] = []
    real = ClientConnection.recv

    async def recv(self, *args, **kwargs):
        data = await real(self, *args, **kwargs)
        frames.append(json.loads(data))
        return data

    monkeypatch.setattr(ClientConnection, "recv", recv)
    return frames


class Listener:
    """Collects a session's SDK events in the background."""

    def __init__(self, session) -> None:
        self.events: list = []
        self.task = asyncio.create_task(self._run(session))

    async def _run(self, session) -> None:
        async for event in session:
            self.events.append(event)

    async def until(self, predicate, what: str) -> None:
        async def poll():
            while not predicate(self.events):
                if self.task.done():
                    raise AssertionError(f"the session ended before {what}: {self.events[-3:]}")
                await asyncio.sleep(0.01)
        await asyncio.wait_for(poll(), TIMEOUT)


async def _stream(session, seconds: float, freq: float = 220.0) -> None:
    """``seconds`` of tone (speech to the reply policy), or of silence with ``freq`` 0."""
    pcm = _tone(seconds, freq) if freq else np.zeros(int(RATE * seconds), "<f4")
    for i in range(0, pcm.size, CHUNK):
        await session.send_audio(pcm[i:i + CHUNK].tobytes())
        await asyncio.sleep(0)


def _client(srv: LoopbackServer) -> RealtimeClient:
    return RealtimeClient(api_key=KEY, base_url=srv.http_url(), connect_timeout=TIMEOUT)


def _count(kind):
    return lambda events: sum(isinstance(e, kind) for e in events)


def test_sdk_streams_hears_interrupts_reads_usage_and_shares_a_reference_voice(wire):
    from duplexcache.runtime.engine import build_engine

    torch.set_num_threads(1)   # CI's two cores are shared
    deploy = _deploy()
    # Scripted replies (runtime/policy.py ReplyPolicy): after each user turn (speech, then quiet)
    # a reply of REPLY_UNITS units, long enough to be interrupted in the middle.
    policy = deploy.engine.speak_policy
    policy.mode, policy.reply_min_units, policy.reply_max_units = "reply", REPLY_UNITS, REPLY_UNITS
    engine = build_engine(deploy)

    async def main(srv: LoopbackServer):
        client = _client(srv)
        session = await client.audio.connect(model="minicpm-o-4.5-realtime", system_prompt="You are a test.",
                                             reference_audio_base64=REFERENCE)
        assert session.state is SessionState.READY and session.id.startswith("sess_")
        heard = Listener(session)
        # A user turn (unit 0: speech, then quiet); its reply starts at unit 1.
        await _stream(session, 1.0)
        await _stream(session, 1.3, freq=0)
        await heard.until(lambda ev: _count(AudioDelta)(ev) and _count(TextDelta)(ev), "the first reply's deltas")
        first = next(f for f in wire if f["type"] == "response.output_audio.delta")
        cut = first["response_id"]
        session.interrupt()               # the next input.append carries force_listen
        await _stream(session, 2.2, freq=0)
        await heard.until(lambda ev: any(f["type"] == "response.done" and f["response"]["id"] == cut for f in wire),
                          "the interrupted reply's response.done")
        await _stream(session, 1.0)       # the session goes on: another user turn, another reply
        await _stream(session, 1.3, freq=0)
        await heard.until(lambda ev: any(f["type"] == "response.output_audio.delta" and f["response_id"] != cut
                                         for f in wire), "the next reply's audio")
        events = list(heard.events)

        # a second session with the same recording: its voice is the first one's, shared
        other = await client.audio.connect(model="minicpm-o-4.5-realtime", reference_audio_base64=REFERENCE)
        other_heard = Listener(other)
        await _stream(other, 1.0)
        await _stream(other, 1.3, freq=0)
        await other_heard.until(_count(AudioDelta), "the second session's audio")
        stats = engine.stats()
        metrics = await asyncio.to_thread(_metrics, srv)
        listed = await asyncio.to_thread(_get_json, srv, "/v1/voices")
        named = await _openai_names_a_reference_voice(srv, next(v for v in stats.cfm_prompt_passes
                                                                if v.startswith("ref-")))

        await session.close()
        await other.close()
        await asyncio.wait_for(asyncio.gather(heard.task, other_heard.task), TIMEOUT)
        usage = session.usage   # read after close(): session.closed carries the final snapshot
        return session, cut, events, heard.events, usage, stats, metrics, listed, named

    with LoopbackServer(create_app(engine, deploy)) as srv:
        session, cut, events, all_events, usage, stats, metrics, listed, named = asyncio.run(main(srv))

    # the interrupt cut the reply: cancelled, and nothing of it after its response.done
    done_at = next(i for i, f in enumerate(wire) if f["type"] == "response.done" and f["response"]["id"] == cut)
    assert wire[done_at]["response"]["status"] == "cancelled"
    assert [f["type"] for f in wire[done_at + 1:] if f.get("response_id") == cut] == ["response.listen"]
    kinds = [type(e).__name__ for e in events]
    assert "Interrupted" in kinds and "TurnCompleted" in kinds[kinds.index("Interrupted"):]
    # usage the SDK read, the final snapshot (session.closed's): input audio at 10 tokens a second
    # of the 6.8 s sent plus the context (prompt and reference audio), text and speech tokens out
    closed = next(f for f in wire if f["type"] == "session.closed")
    assert usage is not None and usage.audio_input_tokens == 68 and usage.prompt_tokens > usage.audio_input_tokens
    assert (usage.prompt_tokens, usage.completion_tokens) == (closed["usage"]["input_tokens"],
                                                              closed["usage"]["output_tokens"])
    assert usage.completion_tokens > 0 and usage.audio_output_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # close() ended it cleanly: the server's session.closed, the SDK's own SessionClosed last
    assert session.state is SessionState.CLOSED
    assert isinstance(all_events[-1], SessionClosed) and all_events[-1].reason == "user_stop"
    assert [f["reason"] for f in wire if f["type"] == "session.closed"] == ["user_stop", "user_stop"]
    assert [f for f in wire if f["type"] == "error"] == [named]   # the OpenAI client's, below; none of the SDK's
    # every reply ends: end_of_turn delta, output_text.done (its whole text), response.done, then
    # response.listen (the model listens again); the SDK's text is the deltas', not repeated
    types = [f["type"] for f in wire]
    for i, f in enumerate(wire):
        if f["type"] == "response.done":
            rid = f["response"]["id"]
            assert types[i - 2:i + 2] == ["response.output_text.delta", "response.output_text.done",
                                          "response.done", "response.listen"], types[i - 2:i + 2]
            assert wire[i - 2]["end_of_turn"] and wire[i - 2]["response_id"] == rid
            assert wire[i - 1]["output_text"] == f["response"]["output_text"] == "".join(
                d["text"] for d in wire if d["type"] == "response.output_text.delta" and d["response_id"] == rid)
            assert wire[i + 1]["response_id"] == rid
    sdk_text = "".join(e.text for e in all_events if isinstance(e, TextDelta))
    first_session_replies = {f["response_id"] for f in wire[:done_at + 1] if f["type"] == "response.output_text.delta"}
    assert sdk_text.startswith("".join(d["text"] for d in wire if d["type"] == "response.output_text.delta"
                                       and d["response_id"] in first_session_replies))
    # one voice made from the recording, reused once; its Code2Wav prompt is the default voice's,
    # so it shares that voice's prompt state: no prompt pass of its own (and no bank growth)
    ref = [v for v in stats.cfm_prompt_passes if v.startswith("ref-")]
    assert len(ref) == 1 and stats.cfm_prompt_passes[ref[0]] == 0 and stats.cfm_prompt_passes["default"] == 1
    assert (stats.reference_voices, stats.reference_voices_added, stats.reference_voice_reuses) == (1, 1, 1)
    assert "duplexcache_reference_voice_reuses_total 1.0" in metrics
    assert "duplexcache_reference_voices_added_total 1.0" in metrics
    # a reference voice is the sender's: not listed, and no other client may ask for it by name
    assert sorted(listed["voices"]) == ["alt", "default"]
    assert named["type"] == "error" and named["error"]["param"] == "session.voice", named
    assert "ref-" not in named["error"]["message"].split("server has:")[1]


def _get_json(srv: LoopbackServer, path: str) -> dict:
    import httpx

    return httpx.get(srv.http_url(path), headers={"Authorization": f"Bearer {KEY}"}).json()


async def _openai_names_a_reference_voice(srv: LoopbackServer, voice: str) -> dict:
    """An OpenAI-dialect client asking for a reference voice by its name: the answer."""
    from websockets.asyncio.client import connect

    async with connect(srv.ws_url("/v1/realtime"), additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        json.loads(await ws.recv())   # session.created
        await ws.send(json.dumps({"type": "session.update", "session": {"voice": voice}}))
        return json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))


def _metrics(srv: LoopbackServer) -> str:
    import httpx

    return httpx.get(srv.http_url("/metrics"), headers={"Authorization": f"Bearer {KEY}"}).text


async def _keep_talking(session) -> None:
    while True:
        await _stream(session, 0.1, freq=0)
        await asyncio.sleep(0.1)


def test_sdk_waits_in_the_queue_and_is_admitted_when_room_frees(wire, monkeypatch):
    """Waiting longer than server.idle_timeout_s in the queue is not idleness: the SDK cannot
    send audio before session.created."""
    import duplexcache.server.realtime_session as realtime_session_module

    monkeypatch.setattr(realtime_session_module, "QUEUE_NOTICE_S", 0.2)   # notices every 0.2 s, not 2
    deploy = _deploy()
    deploy.server.idle_timeout_s = 0.6
    engine = FakeEngine(deploy, capacity=1)

    async def main(srv: LoopbackServer):
        client = _client(srv)
        first = await client.audio.connect(model="m")
        talking = asyncio.create_task(_keep_talking(first))   # the first caller is not idle
        second_task = asyncio.create_task(client.audio.connect(model="m"))

        async def queued_a_while():   # 6 notices: over a second in the queue
            while sum(f["type"] in ("session.queued", "session.queue_update") for f in wire) < 6:
                await asyncio.sleep(0.01)
        await asyncio.wait_for(queued_a_while(), TIMEOUT)
        assert not second_task.done()    # connect() waits while queued
        talking.cancel()
        await first.close()              # room frees: the next tick admits the queued session
        second = await asyncio.wait_for(second_task, TIMEOUT)
        events = []
        while not second._events.empty():   # what the SDK queued for its reader before connect returned
            events.append(second._events.get_nowait())
        await second.close()
        return second, events

    app = create_app(engine, deploy)
    with LoopbackServer(app) as srv:
        second, events = asyncio.run(main(srv))
    # both sessions' lengths, admission to close, are what later estimates average
    lived = list(app.state.server.queue_wait._lived)   # noqa: SLF001
    assert len(lived) == 2 and lived[0] > 1.0

    queued = [e for e in events if isinstance(e, SessionQueued)]
    assert len(queued) >= 6 and queued[0].position == 1 and queued[0].queue_length == 1
    # estimated_wait_s (server/queue_wait.py): no session has ended yet, so the first caller's age
    # (it is the one live session) is the estimate for position 1; it grows as that caller lives on
    waits = [e.estimated_wait_seconds for e in queued]
    assert all(isinstance(w, float) and w >= 0 for w in waits) and waits[-1] > waits[0]
    kinds = [type(e) for e in events]
    assert kinds.index(SessionQueued) < len(kinds) - 1 - kinds[::-1].index(WorkerAssigned) < kinds.index(SessionReady)
    assert second.state is SessionState.CLOSED
    types = [f["type"] for f in wire]
    assert types.count("session.queued") == 1 and "session.queue_update" in types


def test_sdk_fields_are_honoured_or_refused_by_name(wire):
    """A field the engine cannot honour fails connect() with the code and the field's name; the
    others do what they say: system_prompt, max_kv_tokens (the window), tts_enabled false (text
    replies, no audio)."""
    deploy = _deploy()
    engine = FakeEngine(deploy, done_after_units=1)

    async def main(srv: LoopbackServer):
        client = _client(srv)
        with pytest.raises(RealtimeError) as temperature:
            await client.audio.connect(model="m", config=RealtimeConfig(temperature=0.7))
        with pytest.raises(RealtimeError) as video:
            await client.video.connect(model="m")
        text_only = await client.audio.connect(model="m", system_prompt="Answer in text.",
                                               config=RealtimeConfig(tts_enabled=False, max_kv_tokens=4000))
        heard = Listener(text_only)
        await _stream(text_only, 2.1)
        await heard.until(lambda ev: sum(f["type"] == "response.done" for f in wire) >= 2, "two replies")
        await heard.until(lambda ev: text_only.state is SessionState.LISTENING, "response.listen")
        await text_only.close()
        await asyncio.wait_for(heard.task, TIMEOUT)
        return temperature.value, video.value, heard.events, text_only.usage

    with LoopbackServer(create_app(engine, deploy)) as srv:
        temperature, video, events, usage = asyncio.run(main(srv))
    assert temperature.code == "unsupported_parameter" and "payload.config.temperature" in temperature.message
    assert video.code == "unsupported_mode" and "mode='video'" in video.message
    # the session was opened with its prompt and its window from max_kv_tokens (low mark at the
    # server's ratio), and its replies came as text only
    (config,) = engine.configs.values()
    assert config["instructions"] == "Answer in text."
    assert config["window"] == {"high_tokens": 4000, "low_tokens": 3000}
    assert config["audio_output"] is False   # tts_enabled false is the engine's text-only switch
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "unit 1unit 2"
    assert not [e for e in events if isinstance(e, AudioDelta)]
    assert usage.audio_output_tokens == 0 and usage.completion_tokens == 4   # the fake's 2 text tokens a unit
