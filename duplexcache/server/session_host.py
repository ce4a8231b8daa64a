"""What a client's session needs from the server that holds it: the narrow interface
``RealtimeSession`` (and its MiniCPM-o dialect) is written against, so that the session modules
do not import the server (``server/app.py`` imports them, never the other way round).

``RealtimeServer`` satisfies it; a test may hand a session any object that does.
"""

from __future__ import annotations

from typing import Any, Protocol

from duplexcache.config import DeployConfig
from duplexcache.runtime.engine_api import EngineAPI
from duplexcache.server.metrics import ServerMetrics
from duplexcache.server.session_config import RefusalMemory


class SessionHost(Protocol):
    engine: EngineAPI
    config: DeployConfig
    metrics: ServerMetrics
    refusals: RefusalMemory   # settings-decided refusals, shared by every connection

    async def end_session(self, session: Any) -> None:
        """Close ``session``'s engine session (idempotent) and forget it (``session``: the
        ``RealtimeSession`` calling; typed loosely so this module need not import it)."""
        ...

    def queued_sessions(self) -> int:
        """Connections whose engine session waits in the admission queue."""
        ...

    def estimated_wait_s(self, position: int, now: float) -> float:
        """Seconds until the queued session at ``position`` (1 = next) is admitted."""
        ...
