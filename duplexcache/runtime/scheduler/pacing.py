"""Pacing decisions the server's tick loop makes between ticks (docs/engine.md, "Pacing").

Two kinds of extra work may run between two ticks on the grid of ``engine.tick_seconds``:

* a **catch-up tick** for sessions a late tick left a whole unit behind (``scheduler.catch_up_ticks``);
* **prefill chunks** of sessions that are opening (``scheduler.prefill_between_ticks``): a chunk run in
  the time left before the next tick adds nothing to any tick, where a chunk inside the tick adds
  its whole cost to the tick of every live session (issue 11). When no chunk fits, the tick runs
  one itself, as without the switch, so an opening session always progresses.

``PrefillTimes`` keeps the measured cost of recent between-tick chunks; ``prefill_fits`` is the rule.

After a late tick the next one starts at once; ``deadline_after_late`` says when it is due.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T")

# A chunk runs between ticks only if the time left is this many times its predicted cost.
PREFILL_MARGIN = 1.25
# Before any chunk was measured: only with at least this fraction of a period left.
UNMEASURED_FRACTION = 0.5
RECENT_CHUNKS = 4


def deadline_after_late(deadline: float, now: float, period: float) -> float:
    """The deadline of the tick that starts at once at ``now``, after a tick that was due at
    ``deadline`` and ended late: the next point of the same grid (``deadline + k * period``, the
    first after ``now``).

    The grid is the clock at which every session's units are taken, and a session's audio keeps
    arriving in real time. A grid restarted at ``now`` would take every later unit that much
    after it arrived, for the rest of the call (a late tick's delay passed on to every reply), and
    would undo the alignment of units to ticks (``scheduler.align_units_to_ticks``). Grid points
    already past are skipped, not run in a burst: the units they leave are a backlog that
    catch-up ticks take (``scheduler.catch_up_ticks``)."""
    if period <= 0:
        raise ValueError(f"period must be > 0, got {period}")
    if now < deadline:
        return deadline
    due = deadline + (math.floor((now - deadline) / period) + 1) * period
    # (now - deadline) / period can round up to a whole number when now sits a few ulps before a
    # grid point, and the point found is then ``now`` itself: the next one is due
    return due if due > now else due + period


@dataclass(frozen=True)
class UnitGrid:
    """The server's tick grid, ``period`` apart from ``origin``, with a unit tick at every
    ``phases``-th point (``scheduler.tick_phases``; every session's units stay on the unit ticks;
    1: every tick is one).

    A tick runs at the grid point before its deadline (the loop's ``deadline`` is the end of the
    tick's period; after a late tick the one that starts at once is due at the next point,
    ``deadline_after_late``), so the tick due at point ``k`` belongs to point ``k - 1``."""

    origin: float
    period: float
    phases: int = 1

    def __post_init__(self) -> None:
        if self.period <= 0 or self.phases < 1:
            raise ValueError(f"UnitGrid: need period > 0 and phases >= 1, got {self.period}, {self.phases}")

    def point(self, t: float) -> int:
        """The index of the grid point nearest ``t``."""
        return round((t - self.origin) / self.period)

    def unit_tick(self, deadline: float) -> bool:
        """Whether the tick due at ``deadline`` (a grid point) is a unit tick."""
        return (self.point(deadline) - 1) % self.phases == 0

    def next_unit_point(self, deadline: float) -> float:
        """The first point at or after the grid point ``deadline`` where a unit tick starts."""
        k = self.point(deadline)
        return self.origin + -(-k // self.phases) * self.phases * self.period


def prefill_fits(slack_s: float, chunk_s: float | None, period_s: float) -> bool:
    """Whether one prefill chunk predicted to take ``chunk_s`` (None: never measured) fits the
    ``slack_s`` seconds left before the next tick of a ``period_s`` grid."""
    if chunk_s is None:
        return slack_s >= UNMEASURED_FRACTION * period_s
    return slack_s >= PREFILL_MARGIN * chunk_s


class PrefillTimes:
    """Wall time of the recent prefill chunks (synchronised on CUDA, so the time is the chunk's,
    not its launch's), and whether one ran between ticks since the last tick.

    Every chunk a server-paced engine runs is timed, inside a tick too, and the CUDA warm-up
    records one: on an H200 at 32 live sessions a period leaves ~300 ms of slack, less than the
    half period an unmeasured chunk needs, so a server that learnt only from chunks run between
    ticks never ran one there (measured: 0 of 16 chunks, 2026-12-04)."""

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter) -> None:
        self.device = device
        self.clock = clock
        self._recent: deque[float] = deque(maxlen=RECENT_CHUNKS)
        self.ran_since_tick = False
        self.between_ticks = False   # a server runs chunks in its slack (set_prefill_between_ticks)

    def measure(self, chunk: Callable[[], T]) -> T:
        """Run one chunk and keep its time (a chunk inside a tick, or the warm-up's), without
        marking that a chunk ran between ticks."""
        # Synchronised on both sides: work still queued before the chunk (a tick's, launched
        # asynchronously) would otherwise be timed as this chunk's.
        self._sync()
        start = self.clock()
        result = chunk()
        self._sync()
        self.record(self.clock() - start)
        return result

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def record(self, seconds: float) -> None:
        self._recent.append(seconds)

    def run(self, chunk: Callable[[], T]) -> T:
        """Run one chunk between ticks: timed as ``measure`` does, and the next tick runs none."""
        result = self.measure(chunk)
        self.ran_since_tick = True
        return result

    def predicted_s(self) -> float | None:
        """The largest of the recent chunk times (later chunks attend over a longer context and
        cost more), None before the first."""
        return max(self._recent) if self._recent else None

    def chunk_in_tick(self, pending: Sequence[Any]) -> bool:
        """Whether this tick runs a prefill chunk itself (called once per tick; it resets the
        "ran since the last tick" mark). Not when a chunk ran in the slack before it; with a
        server pacing chunks between ticks, not for sessions that only became pending since the
        last tick either (the slack after this tick takes them): only a session that has waited
        a whole tick (``ticks_pending`` >= 1) without a chunk gets one inside the tick."""
        ran, self.ran_since_tick = self.ran_since_tick, False
        if ran or not pending:
            return False
        return not self.between_ticks or any(s.ticks_pending > 0 for s in pending)
