"""The realtime server end to end: a real uvicorn server on loopback, the `websockets` client,
and the deterministic FakeEngine (see server_fakes.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fakes import FakeEngine, f32_b64, pcm16_b64, recv, recv_type, send, sid_of, wait_for
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

import duplexcache.server.tick_loop as tick_loop_module
from duplexcache.config import DeployConfig
from duplexcache.server.app import REALTIME_PATH, create_app
from duplexcache.server.loopback import LoopbackServer

TICK = 0.05
PACED_TICK = 0.2   # the prefill pacing tests: periods with room for slack on a busy machine
MAX_FRAME = 256 * 1024


@pytest.fixture
def serve():
    servers = []

    def _start(capacity: int = 16, catch_up_ticks: bool = True, prefill_between_ticks: bool = True,
               tick_seconds: float = TICK, server: dict | None = None, scheduler: dict | None = None,
               **engine_kwargs):
        deploy = DeployConfig.default("tiny")
        deploy.engine.tick_seconds = tick_seconds
        deploy.scheduler.catch_up_ticks = catch_up_ticks
        deploy.scheduler.prefill_between_ticks = prefill_between_ticks
        for key, value in (server or {}).items():
            setattr(deploy.server, key, value)
        for key, value in (scheduler or {}).items():
            setattr(deploy.scheduler, key, value)
        deploy.server.max_frame_bytes = MAX_FRAME
        deploy.server.max_sessions_per_client = 16  # every test client comes from 127.0.0.1
        engine = FakeEngine(deploy, capacity=capacity, **engine_kwargs)
        srv = LoopbackServer(create_app(engine, deploy), max_frame_bytes=MAX_FRAME).start()
        servers.append(srv)
        return engine, srv

    yield _start
    for srv in servers:
        srv.stop()


def _connect(srv: LoopbackServer):
    return connect(srv.ws_url(REALTIME_PATH), max_size=None, open_timeout=10)


async def _create(ws, queue_if_full: bool = False, **session) -> str:
    """session.created arrives on connect; then our settings (session.updated). Returns the wire id."""
    created = await recv(ws)
    assert created["type"] == "session.created", created
    if session or queue_if_full:
        await send(ws, {"type": "session.update", "session": session, "queue_if_full": queue_if_full})
        updated = await recv(ws)
        assert updated["type"] == "session.updated", updated
    return created["session"]["id"]


async def _open(ws, **session) -> str:
    """Create and start the engine session (the first append opens it) with 0.1 s of silence."""
    wire_id = await _create(ws, **session)
    await send(ws, {"type": "input_audio_buffer.append", "audio": pcm16_b64(np.zeros(1600, np.int16))})
    return wire_id


async def _stream_one(srv: LoopbackServer, index: int, seconds: int = 5):
    """One client: create, stream `seconds` of audio in 0.25 s chunks, collect until the last unit."""
    fmt = "pcm16" if index % 2 == 0 else "f32"
    audio = np.random.default_rng(index).uniform(-0.5, 0.5, 16000 * seconds).astype(np.float32)
    if fmt == "pcm16":
        ints = (audio * 32767).astype(np.int16)
        expected = ints.astype(np.float32) / 32768.0  # what the engine must receive
        chunks = [pcm16_b64(ints[i:i + 4000]) for i in range(0, len(ints), 4000)]
    else:
        expected = audio
        chunks = [f32_b64(audio[i:i + 4000]) for i in range(0, len(audio), 4000)]
    async with _connect(srv) as ws:
        wire_id = await _create(ws, instructions=f"session {index}", input_audio_format=fmt)
        for chunk in chunks:
            await send(ws, {"type": "input_audio_buffer.append", "audio": chunk})
        events = []
        while sum(e["type"] == "response.output_audio.delta" for e in events) < seconds:
            events.append(await recv(ws))
        await send(ws, {"type": "session.close"})
        final, rest = await recv_type(ws, "response.done")
        with pytest.raises(ConnectionClosed):
            await recv(ws)
        return wire_id, expected, events + rest, final, ws.close_code


def test_eight_sessions_stream_concurrently(serve):
    engine, srv = serve()

    async def main():
        return await asyncio.gather(*(_stream_one(srv, i) for i in range(8)))

    results = asyncio.run(main())
    assert len({wire_id for wire_id, *_ in results}) == 8
    for index, (wire_id, expected, events, final, close_code) in enumerate(results):
        sid = sid_of(engine, f"session {index}")
        deltas = [base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta"]
        for unit, delta in enumerate(deltas, start=1):  # 24000 pcm16 samples per unit, in order
            assert np.array_equal(np.frombuffer(delta, "<i2"), np.full(24000, unit, np.int16))
        assert [e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta"] == \
            [f"unit {u}" for u in range(1, 6)]
        done = [e for e in events if e["type"] == "response.done"]
        assert len(done) == 1 and done[0]["response"]["status"] == "completed"  # after unit 3 (done_after_units)
        assert done[0]["response"]["usage"]["output_audio_seconds"] == 3.0
        # two responses (units 1-3, 4-5): ids assigned by the server, every delta names its response
        created = [e["response"]["id"] for e in events if e["type"] == "response.created"]
        assert len(created) == 2 and created[0] == done[0]["response"]["id"]
        assert all(e["response_id"] in created for e in events if e["type"].endswith(".delta"))
        assert not [e for e in events if e["type"] == "error"]
        assert all(isinstance(e["event_id"], str) and e["event_id"] for e in events)
        assert final["response"]["status_details"] == {"reason": "session_closed"}
        assert close_code == 1000
        assert np.array_equal(np.concatenate(engine.received[sid]), expected)
    wait_for(lambda: len(engine.closed) == 8, what="all sessions closed")
    assert engine.live == {} and engine.max_ticks_in_flight == 1


def _metric(srv, name: str, **labels: str) -> float:
    """One sample of the server's /metrics (``name`` with exactly ``labels``)."""
    text = httpx.get(srv.http_url("/metrics")).text
    return next(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name == name and s.labels == labels)


async def _expect_error(ws, event, code: str, event_id: str | None = None) -> dict:
    if isinstance(event, (bytes, str)):
        await ws.send(event)
    else:
        await send(ws, event)
    reply = await recv(ws)
    assert reply["type"] == "error", reply
    assert reply["error"]["code"] == code, reply
    if event_id is not None:
        assert reply["error"]["event_id"] == event_id
    return reply


def test_malformed_input_gets_errors_while_another_session_streams(serve):
    engine, srv = serve()

    bystander_in = asyncio.Event()

    async def bystander():
        async with _connect(srv) as ws:
            await _create(ws)
            for i in range(3):
                await send(ws, {"type": "input_audio_buffer.append", "audio": pcm16_b64(np.zeros(16000, np.int16))})
                await recv_type(ws, "response.output_audio.delta")
                # the engine session opens at the first append: only now does it count as open
                bystander_in.set()
                await asyncio.sleep(0.02)
            return True

    async def offender():
        append = {"type": "input_audio_buffer.append"}
        await bystander_in.wait()
        async with _connect(srv) as ws:
            await _create(ws)
            await _expect_error(ws, "{oops", "invalid_json")
            await _expect_error(ws, {"type": "conversation.item.delete", "event_id": "e1"}, "unknown_event_type", "e1")
            await _expect_error(ws, b"\x00\x01", "binary_frame")
            reply = await _expect_error(ws, {"type": "session.update", "event_id": "e2",
                                             "session": {"memory_budget": "1TiB"}}, "private_config_key", "e2")
            assert "memory_budget" in reply["error"]["message"]
            assert engine.open_calls == 1  # only the bystander's: the server refused this one itself
            reply = await _expect_error(ws, {"type": "session.update", "session": {"colour": "red"}},
                                        "unknown_parameter")
            assert reply["error"]["param"] == "session.colour"
            await _expect_error(ws, {"type": "session.update", "session": {"window": {"high_tokens": 10**9}}},
                                "invalid_session_config")
            await send(ws, {"type": "session.update", "session": {"voice": "broken-ref"}})
            assert (await recv(ws))["type"] == "session.updated"
            # the engine session opens at the first append, and refuses the voice then
            await _expect_error(ws, {**append, "audio": pcm16_b64(np.zeros(10, np.int16))}, "invalid_reference_audio")
            await send(ws, {"type": "session.update", "session": {"voice": "default", "instructions": "offender"}})
            assert (await recv(ws))["type"] == "session.updated"  # not started yet: still changeable
            await _expect_error(ws, {**append, "audio": base64.b64encode(b"\x01\x02\x03").decode()}, "invalid_audio")
            await _expect_error(ws, {**append, "audio": ""}, "invalid_audio")
            await _expect_error(ws, {**append, "audio": "***"}, "invalid_audio")
            await _expect_error(ws, {**append}, "missing_required_parameter")
            reply = await _expect_error(ws, {"type": "session.update", "session": {"voice": "alt"}},
                                        "session_field_fixed")
            assert reply["error"]["param"] == "session.voice"
            # the session continues after all that
            await send(ws, {**append, "audio": pcm16_b64(np.ones(16000, np.int16))})
            delta, skipped = await recv_type(ws, "response.output_audio.delta")
            assert not [e for e in skipped if e["type"] == "error"]
        async with _connect(srv) as ws:
            await _create(ws, input_audio_format="f32", instructions="f32 offender")
            await _expect_error(ws, {**append, "audio": base64.b64encode(b"\x00" * 6).decode()}, "invalid_audio")
            nan = np.array([0.1, np.nan], dtype=np.float32)
            reply = await _expect_error(ws, {**append, "audio": f32_b64(nan)}, "invalid_audio")
            assert "NaN" in reply["error"]["message"]
            # finite but out of range: refused here, to this client only (it would break the tick)
            loud = np.full(16000, 0.5, dtype=np.float32)
            loud[100] = 1.01
            reply = await _expect_error(ws, {**append, "audio": f32_b64(loud)}, "invalid_audio")
            assert "1.01" in reply["error"]["message"]
            f32_sid = sid_of(engine, "f32 offender")
        return sid_of(engine, "offender"), f32_sid

    async def main():
        return await asyncio.gather(bystander(), offender())

    ok, (sid, f32_sid) = asyncio.run(main())
    assert ok
    assert engine.opened == 3  # bystander + two offender sessions: no refused update was admitted
    assert sum(len(a) for a in engine.received[sid]) == 16000  # only the valid append reached the engine
    assert engine.received[f32_sid] == []
    body = httpx.get(srv.http_url("/metrics")).text
    assert 'duplexcache_protocol_errors_total{code="invalid_audio"} 6.0' in body


@pytest.mark.parametrize("size", [MAX_FRAME + 1000, 4 * MAX_FRAME])  # app check, transport check
def test_oversize_frame_closes_only_that_socket(serve, size):
    # the transport's check drops the socket without a close frame: the session then waits out
    # the resume window (docs/protocol.md), kept short here so the test does not wait 30 s
    engine, srv = serve(server={"resume_window_s": 0.5})

    async def main():
        async with _connect(srv) as other, _connect(srv) as ws:
            await _create(other)
            await _open(ws, instructions="oversize")
            # The first append opens the engine session; wait for it, or the oversize frame can
            # close the socket before the server got to open it (seen under load in CI).
            await asyncio.to_thread(wait_for, lambda: any(c.get("instructions") == "oversize"
                                                          for c in engine.configs.values()), what="engine open")
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": "A" * size}))
            with pytest.raises(ConnectionClosed):
                await recv(ws)
            assert ws.close_code == 1009
            await send(other, {"type": "input_audio_buffer.append", "audio": pcm16_b64(np.zeros(16000, np.int16))})
            await recv_type(other, "response.output_audio.delta")
            return ws.close_reason

    reason = asyncio.run(main())
    if size < MAX_FRAME + 64 * 1024:
        assert "max_frame_bytes" in reason
    sid = sid_of(engine, "oversize")
    wait_for(lambda: sid in engine.closed, what="oversize session closed")
    assert sum(a.size for a in engine.received[sid]) == 1600  # only the opening append


def test_client_disconnect_mid_stream_closes_session(serve):
    # a vanished client's session waits out the resume window before it closes: 0.5 s, not 30
    engine, srv = serve(server={"resume_window_s": 0.5})

    async def main():
        ws = await _connect(srv)
        await _create(ws, instructions="vanishing")
        await send(ws, {"type": "input_audio_buffer.append", "audio": pcm16_b64(np.zeros(40000, np.int16))})
        await recv_type(ws, "response.output_audio.delta")
        ws.transport.abort()  # no close handshake: the client just vanishes

    asyncio.run(main())
    sid = sid_of(engine, "vanishing")
    wait_for(lambda: sid in engine.closed, what="engine sees close of the vanished session")
    assert engine.live == {}
    assert httpx.get(srv.http_url("/health")).json()["connections"] == 0


def test_admission_refuses_then_admits_and_queue_gets_notices(serve, caplog):
    engine, srv = serve(capacity=2)
    caplog.set_level(logging.DEBUG, logger="duplexcache.server.realtime_session")
    silence = {"type": "input_audio_buffer.append", "audio": pcm16_b64(np.zeros(1600, np.int16))}

    async def main():
        async with _connect(srv) as a, _connect(srv) as b, _connect(srv) as c, _connect(srv) as d:
            await _open(a, instructions="a")
            await _open(b, instructions="b")
            await _create(c, instructions="c")
            reply = await _expect_error(c, silence, "admission_refused")
            assert reply["error"]["type"] == "server_error"
            assert "bytes" not in reply["error"]["message"]  # pool sizes stay in the log
            await _create(d, queue_if_full=True, instructions="d")
            await send(d, silence)
            queued = await recv(d)
            assert queued["type"] == "session.queued" and queued["position"] == 1
            queued = await recv(d)  # periodic notices (QUEUE_NOTICE_S)
            assert queued["type"] == "session.queued"
            assert engine.stats().queued_sessions == 1
            await send(d, silence)  # discarded while queued, no error
            await send(a, {"type": "session.close"})
            admitted, skipped = await recv_type(d, "session.admitted")  # a tick admits it into the freed room
            assert {e["type"] for e in skipped} <= {"session.queued"}
            await _expect_error(c, silence, "admission_refused")  # still full
            await send(b, {"type": "session.close"})
            wait_for(lambda: sid_of(engine, "b") in engine.closed, what="b closed")
            await send(c, silence)  # the refused socket stays usable and gets in once there is room
            wait_for(lambda: engine.opened == 4, what="c admitted")
            # refused twice, warned once (each append of a refused connection asks again)
            refused = [r for r in caplog.records if "refused by the engine" in r.getMessage()]
            assert [r.levelno for r in refused] == [logging.WARNING, logging.DEBUG]
            await send(d, silence)
            wait_for(lambda: sum(x.size for x in engine.received[sid_of(engine, "d")]) == 1600, what="d's audio")

    asyncio.run(main())
    assert engine.opened == 4
    wait_for(lambda: engine.live == {} and engine.queued == {}, what="everything closed")
    assert set(engine.closed) == {sid_of(engine, x) for x in "abcd"}


def test_health_and_metrics(serve):
    engine, srv = serve(capacity=4)

    async def main():
        async with _connect(srv) as a, _connect(srv) as b:
            for ws in (a, b):
                await _create(ws, instructions=str(id(ws)))
                await send(ws, {"type": "input_audio_buffer.append", "audio": pcm16_b64(np.zeros(16000, np.int16))})
                await recv_type(ws, "response.output_audio.delta")
            health = httpx.get(srv.http_url("/health"))
            metrics = httpx.get(srv.http_url("/metrics"))
            return health, metrics

    health, metrics = asyncio.run(main())
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "live_sessions": 2, "queued_sessions": 0, "connections": 2,
                             "parked_sessions": 0}
    assert metrics.headers["content-type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(metrics.text) for s in fam.samples}
    assert samples[("duplexcache_live_sessions", ())] == 2
    assert samples[("duplexcache_queued_sessions", ())] == 0
    assert samples[("duplexcache_connections", ())] == 2
    pool = (("pool", "thinker_kv"),)
    assert samples[("duplexcache_bytes", pool + (("tier", "private"),))] == 2 * 256 * 1024
    assert samples[("duplexcache_bytes", pool + (("tier", "shared"),))] == 256 * 1024
    assert samples[("duplexcache_bytes", pool + (("tier", "free"),))] == 2 * 256 * 1024
    assert samples[("duplexcache_context_cache_hits_total", ())] == 1
    assert samples[("duplexcache_context_cache_misses_total", ())] == 1
    assert samples[("duplexcache_cfm_fallbacks_total", ())] == 0
    assert ("duplexcache_late_ticks_total", ()) in samples
    # one thinker sample per completed tick, each observed exactly once
    count = samples[("duplexcache_stage_latency_seconds_count", (("stage", "thinker"),))]
    assert 1 <= count <= engine.ticks
    assert samples[("duplexcache_stage_latency_seconds_sum", (("stage", "code2wav"),))] == pytest.approx(0.03 * count)


def test_after_a_late_tick_the_loop_keeps_the_grid(serve, monkeypatch):
    """The deadline after a late tick comes from pacing.deadline_after_late (the grid's next
    point), not from the time the late tick ended."""

    calls = []
    real = tick_loop_module.deadline_after_late

    def recording(deadline, now, period):
        due = real(deadline, now, period)
        calls.append((deadline, now, period, due))
        return due

    monkeypatch.setattr(tick_loop_module, "deadline_after_late", recording)
    engine, srv = serve(tick_delay=0.5)   # 10 periods: every tick is late
    wait_for(lambda: len(calls) >= 2, timeout=60, what="two late ticks")
    for deadline, now, period, due in calls:
        assert now < due and ((due - deadline) / period) == pytest.approx(round((due - deadline) / period))


def test_slow_ticks_are_counted_never_overlap_and_leave_the_loop_free(serve):
    slow = 0.5  # 10 periods: every tick is late, however fast the machine
    engine, srv = serve(tick_delay=slow)
    in_tick, release = threading.Event(), threading.Event()
    real_tick = engine.tick

    def held_tick(**kwargs):  # the next tick stays in flight until released
        in_tick.set()
        release.wait(60)
        return real_tick(**kwargs)

    engine.tick = held_tick
    try:
        wait_for(in_tick.is_set, timeout=60, what="a tick in flight")
        # were the tick run on the event loop, /health could not answer until it is released
        assert httpx.get(srv.http_url("/health"), timeout=60).status_code == 200
        assert not release.is_set()
    finally:
        release.set()
        engine.tick = real_tick
    wait_for(lambda: engine.ticks >= 2, timeout=60, what="two slow ticks")
    assert _metric(srv, "duplexcache_late_ticks_total") >= 1
    assert engine.max_ticks_in_flight == 1


@pytest.mark.parametrize("catch_up", [True, False])
def test_sessions_behind_get_one_extra_tick_per_period_when_catch_up_is_on(serve, catch_up):
    engine, srv = serve(catch_up_ticks=catch_up)
    engine.behind = 3   # as after a tick that ran over: three sessions hold a whole unit extra
    wait_for(lambda: engine.ticks >= 12, timeout=60, what="twelve ticks")
    extra, ticks = _metric(srv, "duplexcache_catch_up_ticks_total"), engine.ticks
    if catch_up:
        # every extra tick follows a tick on the grid (the counter may be one tick ahead)
        assert 1 <= extra and 2 * extra <= ticks + 1
    else:
        assert extra == 0 and engine.behind_asked == 0
    engine.behind = 0
    before = _metric(srv, "duplexcache_catch_up_ticks_total")
    wait_for(lambda: engine.ticks >= ticks + 6, timeout=60, what="six more ticks")
    # nobody behind: only a tick already decided may still come
    assert _metric(srv, "duplexcache_catch_up_ticks_total") - before <= 1


# (an unmeasured chunk needs half a period: tests/runtime/test_pacing.py; here every cost is
# given, so a busy machine's slow loop cannot make the slack look too short)
@pytest.mark.parametrize("between, cost", [(True, 0.0001), (True, 1.0), (False, 0.0001)])
def test_prefill_chunks_run_before_the_tick_when_they_fit(serve, between, cost):
    # 0.2 s periods: a busy machine's slow loop (late ticks leave no slack) cannot eat them all
    engine, srv = serve(prefill_between_ticks=between, tick_seconds=PACED_TICK)
    engine.prefill_cost = cost
    engine.pending_chunks = 12
    wait_for(lambda: not engine.prefill_pending(), timeout=60, what="every prefill chunk")
    moved = engine.chunks_between_ticks
    assert _metric(srv, "duplexcache_prefill_chunks_between_ticks_total") == moved
    assert engine.pacing_prefill is between
    assert moved + engine.chunks_in_ticks == 12
    if between and cost < PACED_TICK:
        # 0.1 ms: many fit in one period (on an idle machine all 12 move; a busy one, whose late
        # ticks leave no slack, leaves some to the ticks)
        assert moved >= 1
    else:
        assert moved == 0      # switched off, or a chunk longer than the period: the ticks run them


@pytest.mark.parametrize("scheduler, told, field", [
    ({}, 50.0, "unit_alignment_ms"),
    ({"tick_phases": 1, "align_units_to_ticks": False}, None, "unit_alignment_ms"),
    ({}, 500.0, "silence_fill_ms"), ({"fill_silence_after_ms": 250.0}, 250.0, "silence_fill_ms"),
    ({"fill_silence_after_ms": None}, None, "silence_fill_ms"),
])
def test_pacing_switches_reach_the_engine(serve, scheduler, told, field):
    """scheduler.align_units_to_ticks -> set_unit_alignment (UNIT_ALIGN_MARGIN_MS, 50 ms), and
    scheduler.fill_silence_after_ms -> set_silence_fill, as the tick loop starts (what the fake
    engine was told; "unset" until then)."""
    engine, _ = serve(scheduler=scheduler)
    wait_for(lambda: getattr(engine, field) != "unset", timeout=30, what="the tick loop to start")
    assert getattr(engine, field) == told


@pytest.mark.parametrize("phases", [1, 2])
def test_tick_phases_reach_the_engine_and_divide_the_period(serve, monkeypatch, phases):
    """scheduler.tick_phases -> set_tick_phases, and the tick loop waits for deadlines on a grid of
    engine.tick_seconds / tick_phases (the period it hands its wait, recorded: no wall clock)."""
    from duplexcache.server.app import RealtimeServer

    periods: list[float] = []
    real = RealtimeServer._wait_for

    async def recording(self, deadline, period, pacing):
        periods.append(period)
        await real(self, deadline, period, pacing)

    monkeypatch.setattr(RealtimeServer, "_wait_for", recording)
    engine, _ = serve(tick_seconds=0.3, scheduler={"tick_phases": phases})
    wait_for(lambda: len(periods) >= 2, timeout=60, what="two waits of the tick loop")
    assert engine.tick_phases == phases
    assert periods[:2] == [pytest.approx(0.3 / phases)] * 2


class _RecordingGrid(tick_loop_module.UnitGrid):
    """The tick loop's grid, recording its verdict for each deadline asked (which points are unit
    ticks is pacing.UnitGrid's, tested in tests/runtime/test_pacing.py)."""

    verdicts: list[bool] = []

    def unit_tick(self, deadline: float) -> bool:
        verdict = super().unit_tick(deadline)
        self.verdicts.append(verdict)
        return verdict


@pytest.fixture
def recording_grid(monkeypatch):
    monkeypatch.setattr(_RecordingGrid, "verdicts", [])
    monkeypatch.setattr(tick_loop_module, "UnitGrid", _RecordingGrid)
    return _RecordingGrid


@pytest.mark.parametrize("phases", [1, 2])
def test_phased_ticks_mark_the_unit_ticks(serve, recording_grid, phases):
    """scheduler.tick_phases 2 -> tick(unit_tick=...) with the grid's verdict for the tick's
    deadline (units stay on the unit tick; the fake engine records each tick's argument); one
    phase: every tick is a unit tick (engine.tick() without the argument). Compared tick by tick
    with what the grid said, so a slow machine whose late tick skips a grid point cannot fail it."""
    engine, _ = serve(tick_seconds=0.4, scheduler={"tick_phases": phases})
    wait_for(lambda: len(engine.unit_ticks) >= 5, timeout=60, what="five ticks")
    assert engine.tick_phases == phases
    ticks = engine.unit_ticks[:5]
    if phases == 2:
        assert ticks == recording_grid.verdicts[:5] and False in ticks and True in ticks
    else:
        assert ticks == [True] * 5 and not any(v is False for v in recording_grid.verdicts)


def test_a_catch_up_tick_of_phased_ticks_is_not_a_unit_tick(serve, recording_grid):
    """Two phases with sessions behind: the extra tick the server runs at once after sessions_behind()
    > 0 is a tick between, even where the grid's deadline is a unit tick's (a second unit tick
    would restart the time the room between unit ticks is measured from)."""
    engine, srv = serve(tick_seconds=0.4, scheduler={"tick_phases": 2})
    engine.behind = 1
    wait_for(lambda: sum(engine.catch_ups) >= 4, timeout=60, what="catch-up ticks")
    n = len(engine.catch_ups)
    pairs = list(zip(engine.unit_ticks[:n], engine.catch_ups, recording_grid.verdicts[:n]))
    catch_ups = [(tick, verdict) for tick, catch_up, verdict in pairs if catch_up]
    assert catch_ups and all(tick is False for tick, _ in catch_ups)
    assert any(verdict for _, verdict in catch_ups)        # one came where the grid said "unit tick"
    assert any(tick for tick, catch_up, _ in pairs if not catch_up)


def test_a_late_tick_of_phased_ticks_is_logged_by_the_server(serve, caplog):
    """Two phases, the engine judges its ticks against a unit and the server against half of one: the
    server logs the late ticks the engine does not count (which kind of tick, how late; this fake
    keeps no count, and a tick the real engine counts is logged once: tests/runtime/test_demo.py)."""
    caplog.set_level(logging.WARNING, logger="duplexcache.server.app")
    engine, srv = serve(tick_seconds=0.4, tick_delay=1.0, scheduler={"tick_phases": 2})
    wait_for(lambda: _metric(srv, "duplexcache_late_ticks_total") >= 1, timeout=60, what="a late tick")
    late = [r.getMessage() for r in caplog.records if "ran late" in r.getMessage()]
    assert late and late[0].startswith(("unit tick ran late", "tick between unit ticks ran late"))


@pytest.mark.parametrize("units_between", [0, 2])
def test_ticks_between_that_ran_units_are_timed_apart(serve, units_between):
    """duplexcache_between_tick_duration_seconds times the ticks between unit ticks that ran
    units (what the room test must predict): none while they run none, never a unit tick. Every
    tick of the fake reports the same units from the first one, so timing the unit ticks too would
    count about twice as many; counted by ticks, not by time, so a slow machine cannot fail it."""
    engine, srv = serve(tick_seconds=0.4, scheduler={"tick_phases": 2},
                        tick_units=units_between)
    wait_for(lambda: engine.unit_ticks.count(True) >= 3 and engine.unit_ticks.count(False) >= 3,
             timeout=60, what="three unit ticks and three ticks between")
    timed = _metric(srv, "duplexcache_between_tick_duration_seconds_count")
    between = engine.unit_ticks.count(False)   # read after: at most one more, still in flight
    if units_between:
        assert between - 1 <= timed <= between
    else:
        assert timed == 0


def test_compute_threads_auto_leaves_the_event_loop_a_cpu():
    from duplexcache.server.app import compute_threads

    assert compute_threads("auto", "cpu", 2) == 1
    assert compute_threads("auto", "cpu", 16) == 15
    assert compute_threads("auto", "cpu", 1) == 1
    assert compute_threads("auto", "cuda", 16) is None and compute_threads("auto", "cuda:1", 16) is None
    assert compute_threads(3, "cuda", 16) == 3
    assert compute_threads("auto", "cpu", 16, omp_threads="4") is None   # set by the host (Ray replicas)
    assert compute_threads(2, "cpu", 16, omp_threads="4") == 2


def test_compute_threads_reach_torch_while_serving_and_are_restored(serve, monkeypatch):
    import torch

    before = torch.get_num_threads()
    calls = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), real(n)))
    engine, srv = serve(server={"compute_threads": 1})
    wait_for(lambda: engine.ticks >= 1, timeout=60, what="a tick")
    assert calls == [1] and torch.get_num_threads() == 1
    srv.stop()
    assert calls == [1, before] and torch.get_num_threads() == before


def test_a_failing_prefill_step_leaves_the_chunks_to_the_ticks(serve, caplog):
    engine, srv = serve(tick_seconds=PACED_TICK)
    engine.prefill_cost = 0.0001   # fits any slack: the server tries every period that has one
    engine.prefill_error = RuntimeError("engine bug")
    engine.pending_chunks = 8
    with caplog.at_level("ERROR", logger="duplexcache.server.app"):
        wait_for(lambda: not engine.prefill_pending(), timeout=60, what="the ticks to run every chunk")
    assert engine.chunks_in_ticks == 8 and engine.chunks_between_ticks == 0
    # at most one attempt per period (a tick runs between two): no retry every poll
    assert 1 <= engine.prefill_failures <= engine.ticks + 1
    assert "the next tick prefills instead" in caplog.text
    assert httpx.get(srv.http_url("/health")).status_code == 200


def test_a_chunk_refused_because_the_server_is_behind_is_a_server_error_and_the_session_goes_on(serve):
    from duplexcache.runtime.engine_api import ServerBehindError

    engine, srv = serve()
    append = {"type": "input_audio_buffer.append", "audio": pcm16_b64(np.zeros(16000, np.int16))}

    async def main():
        async with _connect(srv) as ws:
            await _create(ws)
            await send(ws, append)
            await recv_type(ws, "response.output_audio.delta")
            engine.push_error = ServerBehindError("audio buffer of session 'x' is full: the server is running "
                                                  "behind real time and dropped this chunk")
            await send(ws, {**append, "event_id": "late1"})
            reply, _ = await recv_type(ws, "error")   # the first reply's text and audio may come between
            assert reply["error"]["code"] == "server_behind" and reply["error"]["event_id"] == "late1"
            engine.push_error = None
            await send(ws, append)
            delta, skipped = await recv_type(ws, "response.output_audio.delta")
            return reply, skipped

    reply, skipped = asyncio.run(main())
    assert reply["error"]["type"] == "server_error" and "behind real time" in reply["error"]["message"]
    assert not [e for e in skipped if e["type"] == "error"]
    assert _metric(srv, "duplexcache_protocol_errors_total", code="server_behind") == 1


def test_fatal_engine_error_ends_session(serve):
    engine, srv = serve()

    async def main():
        async with _connect(srv) as ws:
            await _create(ws, instructions="overflow")
            await send(ws, {"type": "input_audio_buffer.append", "audio": pcm16_b64(np.zeros(16000, np.int16))})
            error, skipped = await recv_type(ws, "error")
            with pytest.raises(ConnectionClosed):
                await recv(ws)
            return error, skipped, ws.close_code

    error, skipped, code = asyncio.run(main())
    sid = sid_of(engine, "overflow")
    assert [e["type"] for e in skipped][-2:] == ["response.output_audio.delta",
                                                 "response.output_audio_transcript.delta"]
    assert error["error"]["code"] == "context_length_exceeded" and code == 1000
    assert engine.closed == [sid]


def test_voice_aliases_from_the_yaml_reach_the_engine_session(tmp_path):
    """A stock client's voice ("alloy") mapped by server.voice_aliases in the deploy YAML: the
    update is answered with the server's voice, the engine opens the session with it, and the
    client repeating its alias after the audio started is no change (not session_field_fixed)."""
    path = tmp_path / "deploy.yaml"
    path.write_text("server:\n  voice_aliases: {alloy: alt}\n")
    deploy = DeployConfig.from_yaml(path)
    deploy.server.max_frame_bytes = MAX_FRAME
    engine = FakeEngine(deploy)

    async def main(srv):
        async with _connect(srv) as ws:
            await recv(ws)
            await send(ws, {"type": "session.update", "session": {"type": "realtime",
                                                                   "audio": {"output": {"voice": "alloy"}}}})
            updated = await recv(ws)
            await send(ws, {"type": "input_audio_buffer.append", "audio": pcm16_b64(np.zeros(1600, np.int16))})
            wait_for(lambda: len(engine.live) == 1, what="the session to open")
            await send(ws, {"type": "session.update", "session": {"voice": "alloy"}})
            again, _ = await recv_type(ws, "session.updated")
            return updated, again

    with LoopbackServer(create_app(engine, deploy), max_frame_bytes=MAX_FRAME) as srv:
        updated, again = asyncio.run(main(srv))
    assert updated["type"] == "session.updated" and updated["session"]["audio"]["output"]["voice"] == "alt"
    assert again["session"]["audio"]["output"]["voice"] == "alt"
    [config] = engine.configs.values()
    assert config["voice"] == "alt"


async def _refused_quietly(ws, append: dict, times: int, code: str) -> None:
    """``times`` appends refused at once: the first hears ``code``, the rest nothing (an unchanged
    session.update's answer is the next event)."""
    await _expect_error(ws, append, code)
    for _ in range(times - 1):
        await send(ws, append)
    await send(ws, {"type": "session.update", "session": {}})
    assert (await recv(ws))["type"] == "session.updated"


def test_session_texts_over_4_characters_per_context_token_are_refused_at_the_update(serve):
    """The session text limit follows server.max_context_tokens (4 characters per token; the
    retired server.max_session_text_chars): at 100 tokens, 400 characters of instructions or
    initial_user_text pass the update and 401 are refused there, naming the limit, before the
    engine sees them."""
    engine, srv = serve(server={"max_context_tokens": 100})

    async def main():
        async with _connect(srv) as ws:
            await _create(ws, instructions="a" * 400, initial_user_text="b" * 400)
            replies = [await _expect_error(ws, {"type": "session.update", "session": {key: "c" * 401}},
                                           "string_above_max_length") for key in ("instructions", "initial_user_text")]
            await send(ws, {"type": "session.update", "session": {"instructions": "d" * 400}})
            return replies, await recv(ws)

    replies, after = asyncio.run(main())
    for reply, key in zip(replies, ("instructions", "initial_user_text")):
        assert reply["error"]["param"] == f"session.{key}"
        assert "401 characters" in reply["error"]["message"] and "at most 400" in reply["error"]["message"]
    assert after["type"] == "session.updated" and after["session"]["instructions"] == "d" * 400
    assert engine.open_calls == 0


def test_a_refusal_that_only_the_settings_decide_is_not_asked_again_until_they_change(serve):
    """context_length_exceeded at open: every later append with the same settings is refused
    without the engine building the context again (the tokenizing is the cost); a changed
    session.update asks again. A capacity refusal is asked again each time (room may free up)."""
    engine, srv = serve()
    silence = {"type": "input_audio_buffer.append", "audio": pcm16_b64(np.zeros(1600, np.int16))}

    async def main():
        async with _connect(srv) as ws:
            await _create(ws, instructions="far too long")
            engine.admission_code = "context_length_exceeded"
            await _refused_quietly(ws, silence, 3, "context_length_exceeded")
            calls_same_settings = engine.open_calls
            await send(ws, {"type": "session.update", "session": {"instructions": "shorter"}})
            assert (await recv(ws))["type"] == "session.updated"
            await _expect_error(ws, silence, "context_length_exceeded")
            calls_after_update = engine.open_calls
            engine.admission_code = "capacity_memory"
            await send(ws, {"type": "session.update", "session": {"instructions": "short"}})
            assert (await recv(ws))["type"] == "session.updated"
            await _refused_quietly(ws, silence, 2, "capacity_memory")
            engine.admission_code = "replica_draining"   # a code the server does not know: asked again too
            await _refused_quietly(ws, silence, 2, "replica_draining")
            calls_capacity = engine.open_calls
            engine.admission_code = None
            await send(ws, silence)   # the same settings, room now: it opens
            wait_for(lambda: len(engine.live) == 1, what="the session to open")
            return calls_same_settings, calls_after_update, calls_capacity

    calls_same_settings, calls_after_update, calls_capacity = asyncio.run(main())
    assert calls_same_settings == 1
    assert calls_after_update == 2
    assert calls_capacity == 6
    assert engine.open_calls == 7


@pytest.mark.parametrize("code", ["capacity_compute", "context_length_exceeded"])
def test_a_refused_stream_hears_its_refusal_once_per_queue_notice_period(serve, monkeypatch, code):
    """A client streaming audio into a refused session is told once per QUEUE_NOTICE_S, not
    at every append (50 errors a second at 20 ms chunks); response.create still gets its answer."""
    import duplexcache.server.realtime_session as realtime_session_module

    assert realtime_session_module.QUEUE_NOTICE_S == 2.0   # server.queue_notice_s's default, kept
    silence = {"type": "input_audio_buffer.append", "audio": pcm16_b64(np.zeros(320, np.int16))}

    async def burst(srv, engine):
        async with _connect(srv) as ws:
            await _create(ws, instructions="i")
            engine.admission_code = code
            await _refused_quietly(ws, silence, 10, code)
            await _expect_error(ws, {"type": "response.create"}, code)  # not an append: always answered
            await send(ws, {"type": "session.update", "session": {"instructions": "j"}})
            assert (await recv(ws))["type"] == "session.updated"
            await _expect_error(ws, silence, code)  # a changed request hears its own answer
            return engine.open_calls

    async def spaced(srv, engine):
        async with _connect(srv) as ws:
            await _create(ws, instructions="i")
            engine.admission_code = code
            errors = []
            for _ in range(3):
                errors.append(await _expect_error(ws, silence, code))
                await asyncio.sleep(0.1)   # twice the period: told again
            return len(errors)

    monkeypatch.setattr(realtime_session_module, "QUEUE_NOTICE_S", 30.0)
    engine, srv = serve()
    asked = asyncio.run(burst(srv, engine))
    assert asked == (12 if code == "capacity_compute" else 2)  # capacity is asked at every append
    monkeypatch.setattr(realtime_session_module, "QUEUE_NOTICE_S", 0.05)
    engine, srv = serve()
    assert asyncio.run(spaced(srv, engine)) == 3


def test_graceful_shutdown_closes_every_session(serve):
    engine, srv = serve(capacity=1)

    async def main():
        async with _connect(srv) as a, _connect(srv) as b:
            await _open(a)
            await _create(b, queue_if_full=True)
            await send(b, {"type": "input_audio_buffer.append", "audio": pcm16_b64(np.zeros(16, np.int16))})
            await recv_type(b, "session.queued")
            await asyncio.to_thread(srv.stop)
            for ws in (a, b):
                with pytest.raises(ConnectionClosed):
                    while True:
                        await recv(ws)
            return a.close_code, b.close_code

    codes = asyncio.run(main())
    assert set(codes) <= {1001, 1012}  # ours (going away) or uvicorn's (service restart)
    assert engine.shutdown_called and engine.live == {} and engine.queued == {}
    assert len(engine.closed) == 2 and set(engine.closed) == set(engine.configs)  # the live one and the queued one


class _StuckSocket:
    """A client that never reads: every send blocks; records the close."""

    def __init__(self):
        self.closed_with = None
        self.sent = 0

    async def send_text(self, text):
        self.sent += 1
        await asyncio.Event().wait()

    async def close(self, code, reason):
        self.closed_with = (code, reason)


def test_slow_client_is_dropped_not_buffered_forever():
    from duplexcache.server.connection import Connection
    from duplexcache.server.protocol import event

    async def main():
        ws = _StuckSocket()
        conn = Connection(ws, max_pending=4)
        conn.start()
        for i in range(10):
            conn.send(event("response.output_audio_transcript.delta", delta=str(i)))
            await asyncio.sleep(0)
        await conn.finish(timeout=1.0)
        return ws, conn

    ws, conn = asyncio.run(main())
    assert conn.closing and ws.sent == 1  # the stuck send did not keep the rest queued
    assert ws.closed_with == (1008, "client too slow")


@pytest.mark.parametrize("bound", ["events", "bytes"])
def test_a_dropped_client_tells_the_server_at_once(bound):
    """Past either outbox bound the client is dropped and ``on_drop`` runs right then (the server
    ends the engine session there), before any close is written; the backlog is gone."""
    from duplexcache.server.connection import Connection
    from duplexcache.server.protocol import event

    dropped = []

    async def main():
        ws = _StuckSocket()
        conn = (Connection(ws, max_pending=4) if bound == "events" else Connection(ws, max_bytes=300))
        conn.on_drop = lambda: dropped.append(conn.pending_bytes)
        conn.start()
        for i in range(10):
            conn.send(event("response.output_audio_transcript.delta", delta="x" * 50))
            await asyncio.sleep(0)
        assert dropped == [0] and conn.dropped   # told once, with nothing left queued
        await conn.finish(timeout=1.0)
        return ws

    ws = asyncio.run(main())
    assert ws.closed_with == (1008, "client too slow")


def test_written_audio_is_counted_for_the_newest_responses_only():
    """A long call's replies do not each keep a count: the newest few do, the current one exactly."""
    from duplexcache.server.connection import REMEMBERED_RESPONSES, Connection
    from duplexcache.server.protocol import event

    class Reader:
        async def send_text(self, text):
            pass

        async def close(self, code, reason):
            pass

    async def main():
        conn = Connection(Reader())
        conn.start()
        for i in range(50):
            for _ in range(3):
                conn.send(event("response.output_audio.delta", delta="AA=="), response_id=f"r{i}", audio_bytes=96)
        await conn.finish(timeout=5.0)
        return conn

    conn = asyncio.run(main())
    assert list(conn.sent_audio_bytes) == [f"r{i}" for i in range(50 - REMEMBERED_RESPONSES, 50)]
    assert conn.played_ms("r49") == 3 * 96 // 48 and conn.played_ms("r0") == 0
