"""The browser page: ``/`` serves a plain HTML/JS client of ``/v1/realtime`` (no build step).

* ``GET /``            the page (``static/index.html``)
* ``GET /static/...``  its script, AudioWorklet processor and style sheet
* ``GET /v1/voices``   ``{"voices": [...], "default": "default", "aliases": {...}}`` for the page's voice picker

The page needs a secure context for the microphone and AudioWorklet: https, or a loopback
address (127.0.0.1 / localhost) as in the tests and the demo.
"""

from __future__ import annotations

import importlib.resources
import logging
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles


logger = logging.getLogger(__name__)

STATIC_DIR = importlib.resources.files("duplexcache.server") / "static"
DEFAULT_VOICE = "default"


def voice_names(engine: Any) -> list[str]:
    """The engine's voice names; an engine that does not check names offers only the default voice."""
    names = engine.voice_names()
    return [DEFAULT_VOICE] if names is None else names


def mount_page(app: FastAPI) -> None:
    """Add the page's routes to ``app`` (made by server.app.create_app, whose state holds the server)."""
    static_dir = str(STATIC_DIR)
    if not (STATIC_DIR / "index.html").is_file():
        raise RuntimeError(f"the page's files are missing from {static_dir} (is package-data installed?)")
    # The page is static and tiny; no-cache makes a browser pick up a new version on reload.
    no_cache = {"Cache-Control": "no-cache"}

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(f"{static_dir}/index.html", media_type="text/html", headers=no_cache)

    @app.get("/v1/voices")
    async def voices() -> JSONResponse:
        server = app.state.server
        names = voice_names(server.engine)
        default = DEFAULT_VOICE if DEFAULT_VOICE in names else names[0]
        # other names a session.update may use (server.voice_aliases), each with the voice it gets
        return JSONResponse({"voices": names, "default": default, "aliases": server.config.server.voice_aliases},
                            headers=no_cache)

    app.mount("/static", StaticFiles(directory=static_dir), name="static")
