"""Issue 46: a session whose network drops is parked and resumed with its token (server/resume.py).

The REAL engine (tiny preset, CPU, random weights) behind the real server on loopback, real
sockets: a client's TCP connection is cut by aborting its transport (no close frame: the server
sees 1006, as when a phone loses its network). Clients are told apart by X-Forwarded-For from a
trusted proxy (127.0.0.1), so "another client" is another address as the per-client caps count.
Every wait is bounded; nothing asserts on speed.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from server_fakes import pcm16_b64, recv, send
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from duplexcache.config import DeployConfig
from duplexcache.runtime.bundle import ModelBundle, build_models
from duplexcache.runtime.engine import DuplexEngine
from duplexcache.server.app import REALTIME_PATH, create_app
from duplexcache.server.loopback import LoopbackServer
from duplexcache.server.resume import route_prefix_of

torch.set_num_threads(1)  # 2 shared cores

IN_RATE = 16_000
CHUNK = IN_RATE // 10                # 0.1 s per append
TICK_S = 0.05
WAIT_S = 60.0                        # bounded waits: only a hang (or a bug) reaches them
PRIVATE_POOLS = ("thinker_kv", "talker_kv", "code2wav")


@pytest.fixture(scope="module")
def models() -> ModelBundle:
    return build_models(DeployConfig.default("tiny"), seed=0)


def tiny_deploy(**server: Any) -> DeployConfig:
    deploy = DeployConfig.default("tiny")
    assert deploy.engine.speak_policy.mode == "every_k_units" and deploy.engine.speak_policy.k == 2
    deploy.engine.tick_seconds = TICK_S
    deploy.engine.tick_headroom = 1e9     # admit by memory only: the tests must not depend on this CPU's speed
    deploy.server.trusted_proxies = ["127.0.0.1"]   # X-Forwarded-For names the client
    # A client that stops sending is heard as silence after 3 s: long enough that the second unit
    # of a reply (every_k_units: units 0 and 1 speak as one turn) waits for it, so a cut after the
    # reply's first audio is a cut mid-reply, deterministically.
    deploy.scheduler.fill_silence_after_ms = 3000.0
    for name, value in server.items():
        setattr(deploy.server, name, value)
    return deploy


def sine(seconds: float, hz: float = 220.0) -> np.ndarray:
    t = np.arange(int(seconds * IN_RATE)) / IN_RATE
    return (0.2 * np.sin(2 * np.pi * hz * t) * 32767).astype(np.int16)


def wait(predicate, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


async def await_(predicate, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@dataclass
class Heard:
    events: list[dict[str, Any]] = field(default_factory=list)
    audio: dict[str, int] = field(default_factory=dict)       # response id -> audio bytes
    done: list[str] = field(default_factory=list)              # response ids, in order
    errors: list[dict[str, Any]] = field(default_factory=list)

    def take(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        kind = event["type"]
        if kind == "response.output_audio.delta":
            self.audio[event["response_id"]] = self.audio.get(event["response_id"], 0) + \
                len(base64.b64decode(event["delta"]))
        elif kind == "response.done":
            self.done.append(event["response"].get("id", ""))   # session.close's has none
        elif kind == "error":
            self.errors.append(event["error"])


def _connect(srv: LoopbackServer, client: str, query: str = ""):
    return connect(srv.ws_url(REALTIME_PATH + query), max_size=None, open_timeout=20,
                   additional_headers={"X-Forwarded-For": client})


async def _open(srv: LoopbackServer, client: str, first_audio: np.ndarray) -> tuple[Any, str, str]:
    """A connected session with its engine session open; returns (ws, wire id, resume token)."""
    ws = await _connect(srv, client).__aenter__()
    created = await recv(ws, WAIT_S)
    assert created["type"] == "session.created", created
    await send(ws, {"type": "session.update", "session": {"input_audio_format": "pcm16"}})
    assert (await recv(ws, WAIT_S))["type"] == "session.updated"
    for start in range(0, first_audio.size, CHUNK):
        await send(ws, {"type": "input_audio_buffer.append", "audio": pcm16_b64(first_audio[start:start + CHUNK])})
    server = srv.app.state.server
    await await_(lambda: server.engine_sid(created["session"]["id"]) is not None, "the engine session to open")
    return ws, created["session"]["id"], created["resume_token"]


def _cut(ws: Any) -> None:
    """The network drops: the TCP connection goes without a close frame (the server sees 1006)."""
    ws.transport.abort()


async def _refused(srv: LoopbackServer, client: str, query: str) -> tuple[dict[str, Any], int | None]:
    async with _connect(srv, client, query) as ws:
        event = await recv(ws, WAIT_S)
        with pytest.raises(ConnectionClosed):
            await recv(ws, WAIT_S)
    return event, ws.close_code


def _engine_snapshot(engine: DuplexEngine) -> dict[str, Any]:
    pools = engine.stats().pools
    ps = engine.stage0.pool_stats()
    return {"private": {name: pools[name].private for name in PRIVATE_POOLS},
            "thinker_used": ps.used, "talker_free": engine.talker_pool.num_free,
            "ledger": (len(engine.ledger), engine.ledger.thinker_reserved, engine.ledger.talker_reserved,
                       engine.ledger.dynamic_reserved)}


# ------------------------------------------------------------------ 1. cut mid-reply, resumed


async def _bystander(srv: LoopbackServer, stop: asyncio.Event) -> Heard:
    """Streams real-time audio and reads its replies until ``stop`` and two whole replies (its
    speak policy answers every 2 units); closes cleanly."""
    heard = Heard()
    ws, _, _ = await _open(srv, "10.0.0.9", sine(0.1, 330))
    pcm = sine(60.0, 330)
    reader = asyncio.create_task(_read(ws, heard))
    i = 1
    while not stop.is_set() or len(heard.done) < 2:
        assert i < 590, f"the bystander's replies did not come: {heard}"

        await send(ws, {"type": "input_audio_buffer.append", "audio": pcm16_b64(pcm[i * CHUNK:(i + 1) * CHUNK])})
        i += 1
        await asyncio.sleep(0.1)
    await send(ws, {"type": "session.close"})
    await asyncio.wait_for(reader, WAIT_S)
    assert ws.close_code == 1000
    return heard


async def _read(ws: Any, heard: Heard) -> None:
    try:
        async for raw in ws:
            heard.take(json.loads(raw))
    except ConnectionClosed:
        pass


def test_a_call_cut_mid_reply_resumes_with_the_rest_and_the_same_context(models):
    deploy = tiny_deploy(resume_window_s=30.0)
    engine = DuplexEngine(deploy, models)
    app = create_app(engine, deploy)
    server = app.state.server
    caller = "10.0.0.1"
    facts: dict[str, Any] = {}

    async def run(srv: LoopbackServer) -> Heard:
        stop = asyncio.Event()
        bystander = asyncio.create_task(_bystander(srv, stop))
        ws, wire_id, token = await _open(srv, caller, sine(1.2))
        facts["token"], facts["wire_id"] = token, wire_id
        sid = server.engine_sid(wire_id)
        before = Heard()
        while not before.audio:                  # the reply's first audio: unit 0 of the turn
            before.take(await recv(ws, WAIT_S))
        [cut_reply] = before.audio
        assert cut_reply not in before.done
        info = engine.session_info(sid)
        facts["before"] = (info.units, info.thinker_tokens)
        _cut(ws)
        await await_(lambda: server.resumes.is_parked(server._by_sid[sid]), "the session to be parked")  # noqa: SLF001
        # parked: the engine goes on (silence completes the turn) and the reply's end is kept
        session = server._by_sid[sid]   # noqa: SLF001
        await await_(lambda: any(item.kind == "response.done" for item in session.conn.items),
                     "the cut reply to finish while parked")
        facts["parked_health"] = (server.num_connections, len(server.resumes), server.sessions_of(caller))

        after = Heard()
        async with _connect(srv, caller, f"?resume={token}") as ws2:
            resumed = await recv(ws2, WAIT_S)
            assert resumed["type"] == "session.resumed", resumed
            facts["resumed"] = resumed
            while cut_reply not in after.done:      # the rest of the cut reply, replayed
                after.take(await recv(ws2, WAIT_S))
            replayed = len(after.done)
            pcm = sine(3.0, 260)
            for start in range(0, pcm.size, CHUNK):
                await send(ws2, {"type": "input_audio_buffer.append", "audio": pcm16_b64(pcm[start:start + CHUNK])})
            while len(after.done) < replayed + 1:   # a later reply, in the same session
                after.take(await recv(ws2, WAIT_S))
            info = engine.session_info(sid)
            facts["after"] = (info.units, info.thinker_tokens)
            facts["sid_after"] = server.engine_sid(wire_id)
            facts["cut_reply"] = cut_reply
            await send(ws2, {"type": "session.close"})
            with pytest.raises(ConnectionClosed):
                while True:
                    after.take(await recv(ws2, WAIT_S))
        stop.set()
        facts["bystander"] = await bystander
        facts["sid"] = sid
        return after

    with LoopbackServer(app) as srv:
        after = asyncio.run(run(srv))
        # a used token, and the one the resume gave after a clean close, are refused by name
        used, used_code = asyncio.run(_refused(srv, caller, f"?resume={facts['token']}"))
        ended, _ = asyncio.run(_refused(srv, caller, f"?resume={facts['resumed']['resume_token']}"))
        wait(lambda: not engine.stats().live_sessions, "every session to close")
        engine.thinker_manager.check_invariants()

    resumed = facts["resumed"]
    assert resumed["session"]["id"] == facts["wire_id"]
    assert resumed["replayed_audio_ms"] > 0 and resumed["dropped_audio_ms"] == 0 and resumed["skipped_audio_ms"] == 0
    assert resumed["resume_token"] != facts["token"]
    # the rest of the cut reply arrived on the new connection, then its response.done
    assert after.audio.get(facts["cut_reply"], 0) > 0 and after.done[0] == facts["cut_reply"]
    assert not after.errors
    # the same engine session, its Thinker context grown from where it was: not a new context
    assert facts["sid_after"] == facts["sid"]
    (units0, tokens0), (units1, tokens1) = facts["before"], facts["after"]
    assert units1 > units0 and tokens1 > tokens0, (facts["before"], facts["after"])
    # parked: no connection, one parked session, still counted against the client's sessions
    assert facts["parked_health"] == (1, 1, 1)
    assert used["error"]["code"] == "resume_used" and used_code == 1008
    assert ended["error"]["code"] == "resume_ended"
    bystander = facts["bystander"]
    assert not bystander.errors and len(bystander.done) >= 2


# ------------------------------------------------------------------ 2. refusals, expiry, memory


def test_resume_refusals_have_their_codes_and_an_expired_session_frees_every_byte(models):
    deploy = tiny_deploy(resume_window_s=1.5)
    engine = DuplexEngine(deploy, models)
    app = create_app(engine, deploy)
    server = app.state.server
    assert server.resumes.window_s == 1.5
    out: dict[str, Any] = {}

    async def run(srv: LoopbackServer) -> None:
        out["wrong"] = await _refused(srv, "10.0.0.1", "?resume=not-a-token")
        out["bad_replay"] = await _refused(srv, "10.0.0.1", "?resume=x&resume_replay=sometimes")
        # a bystander stays connected throughout
        by_ws, by_id, _ = await _open(srv, "10.0.0.9", sine(0.3, 330))
        out["baseline"] = _engine_snapshot(engine)
        ws, wire_id, token = await _open(srv, "10.0.0.2", sine(0.3))
        sid = server.engine_sid(wire_id)
        _cut(ws)
        await await_(lambda: len(server.resumes) == 1, "the session to be parked")
        out["foreign"] = await _refused(srv, "10.0.0.3", f"?resume={token}")
        # not resumed within the window: closed, its memory freed
        await await_(lambda: sid not in engine.session_ids() and len(server.resumes) == 0,
                     "the parked session to expire")
        # its reservations are all back: the ledger is what it was with the bystander alone
        await await_(lambda: _engine_snapshot(engine)["ledger"] == out["baseline"]["ledger"],
                     "the expired session's ledger entries to be freed", timeout=10)
        out["expired"] = await _refused(srv, "10.0.0.2", f"?resume={token}")
        # a clean close (code 1000) is a goodbye: nothing is parked
        ws, wire_id, token = await _open(srv, "10.0.0.4", sine(0.3))
        sid = server.engine_sid(wire_id)
        await ws.close()
        await await_(lambda: sid not in engine.session_ids(), "a closed session to end")
        out["parked_after_close"] = len(server.resumes)
        out["closed"] = await _refused(srv, "10.0.0.4", f"?resume={token}")
        out["bystander_alive"] = server.engine_sid(by_id) is not None
        await send(by_ws, {"type": "input_audio_buffer.append", "audio": pcm16_b64(sine(0.1, 330))})
        await by_ws.close()
        await await_(lambda: not engine.session_ids(), "the bystander to close")

    with LoopbackServer(app) as srv:
        asyncio.run(run(srv))
        t0 = engine.stats().ticks
        wait(lambda: engine.stats().ticks >= t0 + 2, "two ticks after the last close")
        final = _engine_snapshot(engine)

    assert out["wrong"][0]["error"]["code"] == "resume_unknown" and out["wrong"][1] == 1008
    assert out["bad_replay"][0]["error"]["code"] == "invalid_value"
    assert out["bad_replay"][0]["error"]["param"] == "resume_replay"
    assert out["foreign"][0]["error"]["code"] == "resume_forbidden"
    assert out["expired"][0]["error"]["code"] == "resume_expired"
    assert "resume_window_s" in out["expired"][0]["error"]["message"]
    assert out["parked_after_close"] == 0 and out["closed"][0]["error"]["code"] == "resume_ended"
    assert out["bystander_alive"]
    # the expired session's private bytes are all back: the ledger and pools as with the
    # bystander alone, and nothing at all once it closed too
    assert final["ledger"] == (0, 0, 0, 0), final
    for name in PRIVATE_POOLS:
        assert final["private"][name] == 0, (name, final)
    assert out["baseline"]["ledger"][0] == 1


def test_resume_off_ends_a_dropped_session_and_names_itself(models):
    deploy = tiny_deploy(resume_window_s=0.0)
    engine = DuplexEngine(deploy, models)
    app = create_app(engine, deploy)
    out: dict[str, Any] = {}

    async def run(srv: LoopbackServer) -> None:
        async with _connect(srv, "10.0.0.1") as ws:
            out["created"] = await recv(ws, WAIT_S)
        ws = await _connect(srv, "10.0.0.1").__aenter__()
        await recv(ws, WAIT_S)
        await send(ws, {"type": "input_audio_buffer.append", "audio": pcm16_b64(sine(0.3))})
        await await_(lambda: engine.session_ids(), "the engine session to open")
        _cut(ws)
        await await_(lambda: not engine.session_ids(), "the dropped session to end at once")
        out["disabled"] = await _refused(srv, "10.0.0.1", "?resume=anything")

    with LoopbackServer(app) as srv:
        asyncio.run(run(srv))
    assert "resume_token" not in out["created"]
    assert out["disabled"][0]["error"]["code"] == "resume_disabled"


def test_the_yaml_window_reaches_the_registry_and_tokens_carry_a_route_prefix(tmp_path, models):
    deploy = tiny_deploy()
    path = tmp_path / "deploy.yaml"
    text = deploy.to_yaml().replace("resume_window_s: 30.0", "resume_window_s: 12.5")
    assert "resume_window_s: 12.5" in text
    path.write_text(text)
    loaded = DeployConfig.from_yaml(path, environ={})
    server = create_app(DuplexEngine(loaded, models), loaded).state.server
    assert server.resumes.window_s == 12.5
    server.resumes.route_prefix = "replica7"

    class Stub:
        client = "10.0.0.1"

    token = server.resumes.issue(Stub())
    assert route_prefix_of(token) == "replica7" and len(token.split(".", 1)[1]) >= 43   # 256 bits, base64url
    assert route_prefix_of("no-prefix-token") is None


def test_a_minicpmo_session_resumes_in_its_own_dialect(models):
    """The MiniCPM-o dialect's session.created carries the token too; its resume speaks that
    dialect (?mode=audio, map.realtime) and an OpenAI-dialect resume of it is refused."""
    deploy = tiny_deploy(resume_window_s=30.0)
    engine = DuplexEngine(deploy, models)
    app = create_app(engine, deploy)
    server = app.state.server
    out: dict[str, Any] = {}

    def minicpmo(query: str):
        return connect(srv.ws_url(REALTIME_PATH + query), subprotocols=["map.realtime"], max_size=None,
                       open_timeout=20, additional_headers={"X-Forwarded-For": "10.0.0.5"})

    async def run() -> None:
        ws = await minicpmo("?mode=audio&model=m").__aenter__()
        assert (await recv(ws, WAIT_S))["type"] == "session.queue_done"
        await send(ws, {"type": "session.init", "payload": {"system_prompt": "You are a test."}})
        created = await recv(ws, WAIT_S)
        assert created["type"] == "session.created", created
        audio = base64.b64encode((sine(0.3) / 32767).astype("<f4").tobytes()).decode()
        await send(ws, {"type": "input.append", "input": {"audio": audio}})
        await await_(lambda: server.engine_sid(created["session_id"]) is not None, "the engine session to open")
        _cut(ws)
        await await_(lambda: len(server.resumes) == 1, "the session to be parked")
        token = created["resume_token"]
        out["mismatch"] = await _refused(srv, "10.0.0.5", f"?resume={token}")
        async with minicpmo(f"?mode=audio&model=m&resume={token}") as ws2:
            out["resumed"] = await recv(ws2, WAIT_S)
            await send(ws2, {"type": "session.close"})
            while (event := await recv(ws2, WAIT_S))["type"] != "session.closed":
                pass
        out["created"] = created

    with LoopbackServer(app) as srv:
        asyncio.run(run())
        wait(lambda: not engine.session_ids(), "the session to close")
    assert out["mismatch"][0]["error"]["code"] == "resume_dialect_mismatch"
    resumed = out["resumed"]
    assert resumed["type"] == "session.resumed" and resumed["session_id"] == out["created"]["session_id"]
    assert resumed["resume_token"] != out["created"]["resume_token"] and "usage" in resumed
