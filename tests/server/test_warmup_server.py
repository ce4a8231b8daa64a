"""The server's warm start: /health says "warming" (503) and WebSockets are refused with a clear
error until the engine's warm-up finished, then 200 and normal service; a failed warm-up stays
unready. A real uvicorn server on loopback with a FakeEngine whose warm-up waits on an event."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fakes import FakeEngine, recv, send, wait_for
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from duplexcache.config import DeployConfig
from duplexcache.server.app import REALTIME_PATH, create_app
from duplexcache.server.protocol import CLOSE_TRY_AGAIN
from duplexcache.server.loopback import LoopbackServer

WARMUP_GRAPHS = 7


class WarmingEngine(FakeEngine):
    """A FakeEngine with a warm-up that lasts until ``release`` is set (and may fail)."""

    def __init__(self, deploy: DeployConfig, fail: str | None = None) -> None:
        super().__init__(deploy)
        self.release = threading.Event()
        self.fail = fail
        self.warmed = False
        self.stopped_early = False

    def warmup(self, should_stop=None) -> None:
        while not self.release.wait(0.01):
            if should_stop is not None and should_stop():
                self.stopped_early = True
                return
        assert self.release.is_set()
        if self.fail:
            raise RuntimeError(self.fail)
        self.warmed = True

    def stats(self):
        captures = {"warmup": WARMUP_GRAPHS, "tick": 0} if self.warmed else {}
        return dataclasses.replace(super().stats(), graph_captures=captures,
                                   warmup_seconds=1.5 if self.warmed else None)


@pytest.fixture
def warming():
    servers = []

    def _start(fail: str | None = None):
        deploy = DeployConfig.default("tiny")
        deploy.engine.tick_seconds = 0.05
        engine = WarmingEngine(deploy, fail)
        srv = LoopbackServer(create_app(engine, deploy)).start(wait_ready=False)
        servers.append((srv, engine))
        return engine, srv

    yield _start
    for srv, engine in servers:
        engine.release.set()
        srv.stop()


def _metric(text: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(name)


async def _refused_while_warming(srv: LoopbackServer) -> None:
    async with connect(srv.ws_url(REALTIME_PATH), open_timeout=10) as ws:
        event = await recv(ws)
        assert event["type"] == "error" and event["error"]["code"] == "server_warming_up"
        with pytest.raises(ConnectionClosed) as closed:
            await recv(ws)
    assert closed.value.rcvd.code == CLOSE_TRY_AGAIN


async def _session_opens(srv: LoopbackServer) -> None:
    async with connect(srv.ws_url(REALTIME_PATH), open_timeout=10) as ws:
        await send(ws, {"type": "session.update", "session": {}})
        assert (await recv(ws))["type"] == "session.created"


def test_health_warming_then_ok(warming):
    engine, srv = warming()
    reply = httpx.get(srv.http_url("/health"))
    assert reply.status_code == 503 and reply.json() == {"status": "warming"}
    asyncio.run(_refused_while_warming(srv))
    assert engine.ticks == 0 and engine.opened == 0        # no tick and no session before ready
    metrics = httpx.get(srv.http_url("/metrics")).text
    assert _metric(metrics, "duplexcache_protocol_errors_total", code="server_warming_up") == 1
    engine.release.set()
    srv.wait_ready(10)
    reply = httpx.get(srv.http_url("/health"))
    assert reply.status_code == 200 and reply.json()["status"] == "ok"
    wait_for(lambda: engine.ticks > 0, what="the tick loop to start after the warm-up")
    asyncio.run(_session_opens(srv))
    metrics = httpx.get(srv.http_url("/metrics")).text
    assert _metric(metrics, "duplexcache_graph_captures_total", where="warmup") == WARMUP_GRAPHS
    assert _metric(metrics, "duplexcache_graph_captures_total", where="tick") == 0
    assert _metric(metrics, "duplexcache_warmup_seconds") == 1.5


def test_failed_warmup_stays_unready(warming):
    engine, srv = warming(fail="out of memory while capturing")
    engine.release.set()
    with pytest.raises(RuntimeError, match="out of memory while capturing"):
        srv.wait_ready(10)
    reply = httpx.get(srv.http_url("/health"))
    assert reply.status_code == 503 and reply.json()["status"] == "warmup_failed"
    assert "out of memory" in reply.json()["error"] and engine.ticks == 0


def test_stop_during_warmup_does_not_wait_for_it():
    deploy = DeployConfig.default("tiny")
    engine = WarmingEngine(deploy)
    srv = LoopbackServer(create_app(engine, deploy)).start(wait_ready=False)
    srv.stop(timeout=10)             # never released: the warm-up must notice the shutdown
    assert engine.stopped_early and engine.shutdown_called and engine.ticks == 0


class WaterfallEngine(WarmingEngine):
    """A warming FakeEngine that accounts its card (runtime/memory/waterfall.py's interface)."""

    def waterfall(self):
        from duplexcache.runtime.memory.waterfall import Part, Waterfall

        assert self.warmed, "the waterfall is taken after the warm-up"
        return Waterfall("cuda:0", 1000, "test", (Part("weights", 400, "weights"),
                                                  Part("thinker_kv_pool", 500, "sessions"),
                                                  Part("free_unplanned", 100, "free")),
                         admitted=6, floor_bytes=100, weight_bytes=400)


def test_waterfall_logged_once_after_warmup_and_on_metrics(caplog):
    deploy = DeployConfig.default("tiny")
    deploy.engine.tick_seconds = 0.05
    engine = WaterfallEngine(deploy)
    srv = LoopbackServer(create_app(engine, deploy)).start(wait_ready=False)
    try:
        with caplog.at_level("INFO", logger="duplexcache.server.app"):
            engine.release.set()
            srv.wait_ready(10)
        metrics = httpx.get(srv.http_url("/metrics")).text
    finally:
        srv.stop()
    assert _metric(metrics, "duplexcache_device_bytes", part="thinker_kv_pool") == 500
    assert _metric(metrics, "duplexcache_device_total_bytes") == 1000
    assert _metric(metrics, "duplexcache_admitted_over_floor_limited") == 1.0   # 6 / ((1000 - 400) / 100)
    assert caplog.text.count("card waterfall on cuda:0") == 1
    assert "admitted / floor-limited = 1.000" in caplog.text
