"""How long a queued session will wait for admission, estimated from what the server has seen.

A queued session at ``position`` p is admitted once p live sessions have ended (each end frees
about one session's room: the sessions ahead of it take the first p - 1). With N sessions live,
each lasting D seconds on average, one ends every D / N seconds in the steady state, so::

    estimated_wait_s = p * D / N

D is the mean length (admission to close) of the last :data:`HISTORY` sessions that ended on this
server; before any has ended, the mean age of the live ones, a lower bound of D (they have lived
at least that long). With nothing live the wait is 0: the next tick admits the session. It is an
estimate: sessions differ in size (one that ends may free room for two, or not enough for one)
and in length. The MiniCPM-o dialect sends it as ``estimated_wait_s`` in ``session.queued`` /
``session.queue_update`` (docs/protocol.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

HISTORY = 32


class QueueWaitEstimate:
    """The server's record of how long sessions live, and the wait it predicts from it."""

    def __init__(self, history: int = HISTORY) -> None:
        self._lived: deque[float] = deque(maxlen=history)

    def session_ended(self, lived_s: float) -> None:
        """A live session ended after ``lived_s`` seconds (admission to close)."""
        self._lived.append(max(0.0, lived_s))

    def estimate(self, position: int, live_ages_s: Iterable[float]) -> float:
        """Seconds until the session at ``position`` (1 = next) is admitted, given the ages of the
        live sessions; >= 0, proportional to ``position``."""
        ages = list(live_ages_s)
        if not ages or position < 1:
            return 0.0
        lived = self._lived if self._lived else ages
        mean_s = sum(lived) / len(lived)
        return round(max(0.0, position * mean_s / len(ages)), 2)
