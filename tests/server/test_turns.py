"""Turn taking over the wire: server_vad (with a VAD fake of SileroVAD's shape), client-driven
turns (commit / response.create / response.cancel), user text items, truncate, barge-in dropping
unsent audio, the beta event names, and an engine without the turn API (refused at start)."""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed
from server_fakes import FakeEngine, LoopbackServers, connect_realtime, pcm16_b64, recv, recv_type, send, sid_of

from duplexcache.config import DeployConfig
from duplexcache.server import realtime_session

TICK = 0.05
LOUD = pcm16_b64(np.full(8000, 12000, np.int16))    # 0.5 s at 16 kHz
QUIET = pcm16_b64(np.zeros(8000, np.int16))


@dataclass(frozen=True)
class VadEvent:
    kind: str
    audio_ms: int


class FakeVAD:
    """SileroVAD's interface: speech while a chunk's peak is above ``threshold``."""

    made: list["FakeVAD"] = []

    def __init__(self, threshold: float = 0.5, silence_duration_ms: int = 500, prefix_padding_ms: int = 300):
        self.params = (threshold, silence_duration_ms, prefix_padding_ms)
        self.ms = 0
        self.speaking = False
        FakeVAD.made.append(self)

    def feed(self, pcm: np.ndarray) -> list[VadEvent]:
        loud = float(np.abs(pcm).max()) > self.params[0]
        out = []
        if loud != self.speaking:
            self.speaking = loud
            out.append(VadEvent("speech_started" if loud else "speech_stopped", self.ms))
        self.ms += pcm.size // 16
        return out

    def reset(self) -> None:
        self.speaking = False


@pytest.fixture
def serve(monkeypatch):
    FakeVAD.made = []
    monkeypatch.setattr(realtime_session, "_vad_factory", FakeVAD)
    servers = LoopbackServers(TICK)
    yield servers.start
    servers.stop_all()


_connect = connect_realtime


async def _update(ws, **session) -> dict:
    await send(ws, {"type": "session.update", "session": session})
    event, _ = await recv_type(ws, "session.updated")
    return event


async def _append(ws, audio: str, times: int = 1) -> None:
    for _ in range(times):
        await send(ws, {"type": "input_audio_buffer.append", "audio": audio})


@pytest.mark.parametrize("output", ["pcm16", "g711_ulaw"])
def test_server_vad_commits_answers_and_barge_in_cancels(serve, output):
    """With G.711 output (a telephony client) the milliseconds played that the cancel reports are
    counted at 8 bytes per ms, not pcm16's 48."""
    engine, srv = serve(done_after_units=50)

    async def main():
        async with _connect(srv) as ws:
            await recv(ws)
            updated = await _update(ws, instructions="vad", output_audio_format=output, turn_detection={
                "type": "server_vad", "threshold": 0.3, "silence_duration_ms": 200, "prefix_padding_ms": 100})
            assert updated["session"]["turn_detection"]["type"] == "server_vad"
            await _append(ws, LOUD, 2)
            started, _ = await recv_type(ws, "input_audio_buffer.speech_started")
            await _append(ws, QUIET)
            stopped, _ = await recv_type(ws, "input_audio_buffer.speech_stopped")
            committed, _ = await recv_type(ws, "input_audio_buffer.committed")
            await _append(ws, QUIET, 4)           # the reply runs on the next units
            created, _ = await recv_type(ws, "response.created")
            first, _ = await recv_type(ws, "response.output_audio.delta")
            await _append(ws, LOUD, 4)            # the user talks over the reply: barge-in
            await recv_type(ws, "input_audio_buffer.speech_started")
            done, skipped = await recv_type(ws, "response.done")
            return started, stopped, committed, created, first, done, skipped

    started, stopped, committed, created, first, done, skipped = asyncio.run(main())
    sid = sid_of(engine, "vad")
    assert FakeVAD.made[0].params == (0.3, 200, 100)   # the client's settings reached the VAD
    assert (started["audio_start_ms"], stopped["audio_end_ms"]) == (0, 1000)
    assert committed["item_id"] == started["item_id"] == stopped["item_id"]
    assert engine.turn_modes[sid] == ["manual"] and engine.response_requests[sid] == 1
    assert done["response"]["status"] == "cancelled" and done["response"]["id"] == created["response"]["id"]
    (cancel_sid, played_ms), = engine.cancels
    assert cancel_sid == sid and played_ms is not None
    first_bytes = len(base64.b64decode(first["delta"]))
    if output == "pcm16":
        assert played_ms % 1000 == 0 and first_bytes == 48_000   # whole 1 s units at 24 kHz pcm16
    else:
        # one byte per 8 kHz sample; the resampler holds ~20 ms of each reply back until its end
        assert 7_700 < first_bytes <= 8_000
        assert played_ms > 0 and 0 <= -played_ms % 1000 <= 40, played_ms
    assert not [e for e in skipped if e["type"] == "response.output_audio.delta"
                and e["response_id"] != created["response"]["id"]]
    metrics = srv.app.state.server.metrics.registry
    assert metrics.get_sample_value("duplexcache_responses_total", {"status": "cancelled"}) == 1


async def expect_error(ws, event, code):
    await send(ws, event)
    error, _ = await recv_type(ws, "error")
    assert error["error"]["code"] == code, error
    return error


def test_client_driven_turns_items_and_truncate(serve):
    engine, srv = serve(done_after_units=50)

    async def main():
        async with _connect(srv) as ws:
            await recv(ws)
            await _update(ws, instructions="manual", turn_detection=None)
            await expect_error(ws, {"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty")
            await expect_error(ws, {"type": "response.cancel"}, "response_cancel_not_active")
            await _append(ws, QUIET)
            await send(ws, {"type": "input_audio_buffer.clear"})
            await recv_type(ws, "input_audio_buffer.cleared")
            await expect_error(ws, {"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty")
            await _append(ws, QUIET)
            await send(ws, {"type": "input_audio_buffer.commit"})
            await recv_type(ws, "input_audio_buffer.committed")
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}
            await send(ws, {"type": "conversation.item.create", "item": item})
            added, _ = await recv_type(ws, "conversation.item.added")
            await recv_type(ws, "conversation.item.done")
            await expect_error(ws, {"type": "conversation.item.create",
                                    "item": {"type": "function_call_output", "output": "x"}}, "unsupported_item")
            await send(ws, {"type": "response.create"})
            await expect_error(ws, {"type": "response.create"}, "conversation_already_has_active_response")
            await _append(ws, QUIET, 6)
            delta, _ = await recv_type(ws, "response.output_audio.delta")
            await expect_error(ws, {"type": "conversation.item.truncate", "item_id": "item_nope", "content_index": 0,
                                    "audio_end_ms": 5}, "item_not_found")
            await send(ws, {"type": "conversation.item.truncate", "item_id": delta["item_id"], "content_index": 0,
                            "audio_end_ms": 420})
            truncated, _ = await recv_type(ws, "conversation.item.truncated")
            done, _ = await recv_type(ws, "response.done")
            return added, truncated, done

    added, truncated, done = asyncio.run(main())
    sid = sid_of(engine, "manual")
    assert added["item"]["role"] == "user"
    assert engine.user_texts == {sid: ["Hello there"]}
    assert truncated["audio_end_ms"] == 420 and done["response"]["status"] == "cancelled"
    assert engine.cancels == [(sid, 420)]  # the client's played position reaches the engine
    assert engine.response_requests == {sid: 1}


def test_response_create_metadata_is_echoed_on_created_and_done(serve):
    """OpenAI echoes response.create's metadata; clients (LiveKit's generate_reply) match on it."""
    engine, srv = serve(done_after_units=2)

    async def main():
        async with _connect(srv) as ws:
            await recv(ws)
            await _update(ws, instructions="meta", turn_detection=None)
            bad = {"type": "response.create", "response": {"metadata": {"k": 7}}}
            await send(ws, bad)
            error, _ = await recv_type(ws, "error")
            assert error["error"]["code"] == "invalid_value" and error["error"]["param"] == "response.metadata"
            await send(ws, {"type": "response.create", "response": {"metadata": {"client_event_id": "abc"}}})
            await _append(ws, QUIET, 8)
            created, _ = await recv_type(ws, "response.created")
            done, _ = await recv_type(ws, "response.done")
            await send(ws, {"type": "response.create"})       # the next one carries none
            await _append(ws, QUIET, 8)
            created2, _ = await recv_type(ws, "response.created")
            return created, done, created2

    created, done, created2 = asyncio.run(main())
    assert created["response"]["metadata"] == done["response"]["metadata"] == {"client_event_id": "abc"}
    assert created2["response"]["metadata"] is None


def test_cancel_drops_unsent_audio_from_the_outbox():
    from duplexcache.server.connection import Connection
    from duplexcache.server.protocol import event

    class Stuck:
        async def send_text(self, text):
            await asyncio.Event().wait()

        async def close(self, code, reason):
            pass

    async def main():
        conn = Connection(Stuck())
        for rid in ("r1", "r2", "r1"):
            conn.send(event("response.output_audio.delta", delta="AA=="), response_id=rid, audio_bytes=2)
        conn.send(event("response.done"))
        dropped = conn.drop_pending("r1")
        return dropped, [(item.response_id, item.kind) for item in conn._outbox]

    dropped, left = asyncio.run(main())
    assert dropped == 2 and left == [("r2", "response.output_audio.delta"), (None, "response.done")]


def test_beta_client_gets_beta_names_and_24k(serve):
    engine, srv = serve(done_after_units=1)

    async def main():
        async with _connect(srv, additional_headers={"OpenAI-Beta": "realtime=v1"}) as ws:
            created = await recv(ws)
            await _update(ws, instructions="beta", input_audio_format="pcm16")
            await _append(ws, pcm16_b64(np.zeros(24000, np.int16)))  # 1 s at 24 kHz ...
            await _append(ws, pcm16_b64(np.zeros(2400, np.int16)))
            delta, skipped = await recv_type(ws, "response.audio.delta")
            done, rest = await recv_type(ws, "response.done")
            return created, skipped + rest

    created, events = asyncio.run(main())
    assert created["session"]["input_audio_format"] == "pcm16" and created["session"]["input_sample_rate"] == 24000
    kinds = {e["type"] for e in events}
    assert {"response.audio_transcript.delta", "conversation.item.created"} <= kinds
    assert not kinds & {"response.output_audio_transcript.delta", "response.output_audio.delta"}
    received = sum(a.size for a in engine.received[sid_of(engine, "beta")])
    assert 16000 <= received <= 17600  # ... arrives as ~1.1 s at 16 kHz


class _NoTurnEngine:
    """An engine built before the turn API: the core calls only."""

    def __init__(self, deploy, **kwargs):
        self._inner = FakeEngine(deploy, **kwargs)
        for name in ("open_session", "is_queued", "push_audio", "close_session", "tick", "stats", "shutdown"):
            setattr(self, name, getattr(self._inner, name))


def test_an_engine_missing_part_of_the_contract_is_refused_at_start():
    """The server calls every EngineAPI member without probing, so an engine that lacks one is
    refused when the server is built, naming what it lacks (not at the first call that needs it)."""
    from duplexcache.server.app import create_app

    deploy = DeployConfig.default("tiny", environ={})
    with pytest.raises(TypeError, match="does not implement EngineAPI") as info:
        create_app(_NoTurnEngine(deploy), deploy)
    for name in ("set_turn_mode", "request_response", "cancel_response", "add_user_text", "warmup", "late_ticks"):
        assert name in str(info.value)
    create_app(FakeEngine(deploy), deploy)   # the whole contract: accepted


def _user_message(text: str) -> dict:
    return {"type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}


def test_user_text_the_session_cannot_take_is_an_error_and_the_session_goes_on(serve):
    """Live: the engine's refusal (more text than fits before the next unit) is user_text_too_long.
    Queued: at most MAX_USER_TEXT_CHARS wait for admission, and a waiting message the engine then
    refuses is reported as dropped; the others reach it."""
    engine, srv = serve(capacity=1)
    engine.user_text_room = 9000
    limit = realtime_session.MAX_USER_TEXT_CHARS

    async def main():
        async with _connect(srv) as a, _connect(srv) as b:
            await recv(a)
            await _update(a, instructions="a", turn_detection=None)
            await _append(a, QUIET)
            await send(a, _user_message("x" * 6000))
            await recv_type(a, "conversation.item.done")
            live = await expect_error(a, _user_message("y" * 6000), "user_text_too_long")
            surrogate = await expect_error(a, _user_message("ok \ud800"), "invalid_value")   # JSON carries it
            await recv(b)
            await send(b, {"type": "session.update", "queue_if_full": True,
                           "session": {"instructions": "b", "turn_detection": None}})
            await recv_type(b, "session.updated")
            await _append(b, QUIET)
            await recv_type(b, "session.queued")
            await send(b, _user_message("p" * 5000))
            await recv_type(b, "conversation.item.done")
            queued = await expect_error(b, _user_message("q" * (limit - 4000)), "user_text_too_long")
            await send(b, _user_message("r" * 3000))
            await recv_type(b, "conversation.item.done")
            await send(b, _user_message("s" * 100))   # waits too, but will not fit the engine's 9000
            await recv_type(b, "conversation.item.done")
            engine.user_text_room = 8050
            await send(a, {"type": "session.close"})
            dropped, _ = await recv_type(b, "error")
            admitted, _ = await recv_type(b, "session.admitted")
            await send(b, _user_message("t"))   # the session goes on
            await recv_type(b, "conversation.item.done")
            return live, surrogate, queued, dropped

    live, surrogate, queued, dropped = asyncio.run(main())
    assert "lone surrogate at character 3" in surrogate["error"]["message"]
    assert live["error"]["param"] == "item.content" and "does not fit" in live["error"]["message"]
    assert f"at most {realtime_session.MAX_USER_TEXT_CHARS} wait" in queued["error"]["message"]
    assert dropped["error"]["code"] == "user_text_too_long"
    assert "sent while queued is dropped" in dropped["error"]["message"]
    assert engine.user_texts[sid_of(engine, "a")] == ["x" * 6000]
    assert engine.user_texts[sid_of(engine, "b")] == ["p" * 5000, "r" * 3000, "t"]


def test_an_unexpected_failure_ends_that_connection_only_with_1011(serve):
    """A bug met while handling one client's event: an error event and close 1011 for that client
    (it used to be 1000, as if all were well), the server and the other clients go on."""
    engine, srv = serve()

    async def main():
        async with _connect(srv) as a, _connect(srv) as b:
            for ws, name in ((a, "a"), (b, "b")):
                await recv(ws)
                await _update(ws, instructions=name, turn_detection=None)
                await _append(ws, QUIET)
            engine.user_text_failure = RuntimeError("engine bug")
            await send(a, _user_message("hello"))
            error, _ = await recv_type(a, "error")
            with pytest.raises(ConnectionClosed):
                while True:
                    await recv(a)
            engine.user_text_failure = None
            await send(b, _user_message("hello"))
            await recv_type(b, "conversation.item.done")
            return error, a.close_code

    error, code = asyncio.run(main())
    assert error["error"]["code"] == "server_error" and error["error"]["type"] == "server_error"
    assert "engine bug" not in error["error"]["message"]   # internals stay in the log
    assert code == 1011
    assert engine.user_texts == {sid_of(engine, "b"): ["hello"]}
