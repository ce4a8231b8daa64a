"""Run an ASGI app on 127.0.0.1 on a free port in a background thread (tests and the demo).

    with LoopbackServer(app) as srv:
        ... connect to srv.ws_url("/v1/realtime") ...
    # leaving the block runs the app's graceful shutdown and joins the thread

uvicorn installs signal handlers only on the main thread, so running it in a thread is safe.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import uvicorn

logger = logging.getLogger(__name__)

# Let frames a little over the app's max_frame_bytes reach the app, so the app (not the
# transport) closes the socket and names the limit in the close reason.
WS_SIZE_HEADROOM = 64 * 1024


def uvicorn_config(app: Any, host: str, port: int, max_frame_bytes: int, log_level: str = "warning",
                   graceful_timeout: float | None = 10.0) -> uvicorn.Config:
    """The uvicorn settings the CLI and the loopback server share."""
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on",
        ws_max_size=max_frame_bytes + WS_SIZE_HEADROOM,
        # base64 audio barely compresses (~25%), and deflating every frame costs event-loop CPU
        # that the tick loop and the other sessions need more than the network needs the bytes.
        ws_per_message_deflate=False,
        timeout_graceful_shutdown=graceful_timeout,
    )


class LoopbackServer:
    def __init__(self, app: Any, max_frame_bytes: int = 4 * 2**20, start_timeout: float = 20.0):
        self.app = app
        self._server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", 0, max_frame_bytes))
        self._thread = threading.Thread(target=self._server.run, name="duplexcache-loopback", daemon=True)
        self._start_timeout = start_timeout
        self.port: int | None = None

    def start(self) -> "LoopbackServer":
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
        return self

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
