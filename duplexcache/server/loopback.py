"""Run an ASGI app on 127.0.0.1 on a free port in a background thread (tests and the demo).

    with LoopbackServer(app) as srv:
        ... connect to srv.ws_url("/v1/realtime") ...
    # leaving the block runs the app's graceful shutdown and joins the thread

uvicorn installs signal handlers only on the main thread, so running it in a thread is safe.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import uvicorn

from duplexcache.config import ServerConfig
from duplexcache.server.http_limits import header_timeout_protocol

logger = logging.getLogger(__name__)

# Let frames a little over the app's max_frame_bytes reach the app, so the app (not the
# transport) closes the socket and names the limit in the close reason.
WS_SIZE_HEADROOM = 64 * 1024
# An idle HTTP keep-alive connection is closed after this many seconds: uvicorn's own default,
# passed explicitly so that the bound holds whatever uvicorn's default becomes. An idle
# connection costs the server a socket and nothing else, and a client that reconnects after 5 s
# pays one handshake. The deploy key server.keep_alive_timeout_s until issue 44 (docs/engine.md,
# "Retired switches").
KEEP_ALIVE_TIMEOUT_S = 5.0


def uvicorn_config(app: Any, host: str, port: int, max_frame_bytes: int, log_level: str = "warning",
                   graceful_timeout: float | None = 10.0, server: ServerConfig | None = None) -> uvicorn.Config:
    """The uvicorn settings the CLI and the loopback server share; ``server`` (the deploy's
    ``server`` section; its defaults when None) gives the header timeout, ``KEEP_ALIVE_TIMEOUT_S``
    the keep-alive one."""
    server = server or ServerConfig()
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on",
        ws_max_size=max_frame_bytes + WS_SIZE_HEADROOM,
        # base64 audio barely compresses (~25%), and deflating every frame costs event-loop CPU
        # that the tick loop and the other sessions need more than the network needs the bytes.
        ws_per_message_deflate=False,
        timeout_graceful_shutdown=graceful_timeout,
        # Forwarded headers are the app's to judge (server.trusted_proxies, server/auth.py):
        # uvicorn's own default believes X-Forwarded-For from 127.0.0.1, so any local process could
        # name a new client address per connection and pass the per-address caps.
        proxy_headers=False,
        timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S,
        http=header_timeout_protocol(server.header_timeout_s),
    )


def _server_config_of(app: Any) -> ServerConfig | None:
    """The deploy's server section of an app made by create_app (None for another app)."""
    realtime = getattr(getattr(app, "state", None), "server", None)
    config = getattr(realtime, "config", None)
    return getattr(config, "server", None)


class LoopbackServer:
    def __init__(self, app: Any, max_frame_bytes: int = 4 * 2**20, start_timeout: float = 20.0):
        self.app = app
        self._server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", 0, max_frame_bytes,
                                                     server=_server_config_of(app)))
        self._thread = threading.Thread(target=self._server.run, name="duplexcache-loopback", daemon=True)
        self._start_timeout = start_timeout
        self.port: int | None = None

    def start(self, wait_ready: bool = True) -> "LoopbackServer":
        """Start listening; with ``wait_ready`` also wait until ``/health`` stops answering
        "warming" (the engine's warm-up ran), so clients are not refused as too early."""
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("loopback server exited during start-up (see the log)")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"loopback server did not start within {self._start_timeout} s")
            time.sleep(0.01)
        sockets = [s for server in self._server.servers for s in server.sockets]
        self.port = sockets[0].getsockname()[1]
        logger.info("loopback server listening on 127.0.0.1:%d", self.port)
        if wait_ready:
            self.wait_ready(max(0.0, deadline - time.monotonic()) + self._start_timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        """Poll ``/health`` until it is not 503 "warming"; RuntimeError on a failed warm-up."""
        deadline = time.monotonic() + timeout
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # never via an HTTP proxy
        while True:
            try:
                with direct.open(self.http_url("/health"), timeout=5):
                    return   # 200 (or an app without /health: 404 raises below)
            except urllib.error.HTTPError as exc:
                if exc.code != 503:
                    return
                body = json.loads(exc.read() or b"{}")
                if body.get("status") == "warmup_failed":
                    raise RuntimeError(f"server warm-up failed: {body.get('error')}") from None
                if body.get("status") != "warming":
                    return   # e.g. stopping: not ours to wait for
            if time.monotonic() > deadline:
                raise RuntimeError(f"server was not ready within {timeout:.0f} s (still warming up)")
            time.sleep(0.02)

    def stop(self, timeout: float = 20.0) -> None:
        """Ask uvicorn to exit (runs the app's lifespan shutdown) and join its thread."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"loopback server did not stop within {timeout} s")

    def http_url(self, path: str = "") -> str:
        assert self.port is not None, "start() first"
        return f"http://127.0.0.1:{self.port}{path}"

    def ws_url(self, path: str = "") -> str:
        assert self.port is not None, "start() first"
        return f"ws://127.0.0.1:{self.port}{path}"

    def __enter__(self) -> "LoopbackServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
