"""The server's clock: when the engine ticks (``RealtimeServer`` mixes this in).

The tick task ticks the engine every ``engine.tick_seconds / scheduler.tick_phases`` on a fixed
grid (``pacing.UnitGrid``), each tick in a worker thread and awaited before the next, so two
never overlap; a tick that overruns its period is logged and counted (``late_ticks``) and the next
one starts at once, due at the grid's next point (no catch-up burst). Sessions a late tick left a
whole unit behind get one extra tick per period (``scheduler.catch_up_ticks``), and prefill chunks
of opening sessions run in the time left before the next tick when they fit
(``scheduler.prefill_between_ticks``). Which sessions a tick runs is the engine's scheduler's
(runtime/scheduler/core.py); this keeps time and hands every tick's events to ``_route``.

The host class provides ``engine``, ``config``, ``metrics``, ``_stopping`` (an asyncio.Event),
``_route(events)`` and the ``failed_ticks_in_a_row`` / ``last_tick_error`` counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

from duplexcache.runtime.scheduler.core import UNIT_ALIGN_MARGIN_MS
from duplexcache.runtime.scheduler.pacing import UnitGrid, deadline_after_late, prefill_fits

logger = logging.getLogger("duplexcache.server.app")   # one logger name for the server's lines

# A tick is late when it ends more than this fraction of a period after its deadline.
LATE_SLACK = 0.1
# How often the wait for the next tick looks for a session that started opening, whose prefill
# chunks may then run in the rest of the period (scheduler.prefill_between_ticks).
PREFILL_POLL_S = 0.05


class TickLoop:
    async def _tick_loop(self) -> None:
        loop = asyncio.get_running_loop()
        scheduler = self.config.scheduler
        # scheduler.tick_phases ticks per unit: each takes the units complete by then
        period = self.config.engine.tick_seconds / scheduler.tick_phases
        pacing = scheduler.prefill_between_ticks   # decided once: the config does not change
        self.engine.set_prefill_between_ticks(pacing)
        self.engine.set_unit_alignment(UNIT_ALIGN_MARGIN_MS if scheduler.align_units_to_ticks else None)
        self.engine.set_silence_fill(scheduler.fill_silence_after_ms)
        # with phases, units stay on the unit tick (every tick_phases-th point of the grid), and
        # the engine is told which tick is one
        phased = scheduler.tick_phases > 1
        self.engine.set_tick_phases(scheduler.tick_phases)
        grid = UnitGrid(loop.time(), period, scheduler.tick_phases)
        deadline = grid.origin + period
        caught_up_at = None   # the deadline of the period that already had its extra tick
        catching_up = False
        while not self._stopping.is_set():
            # a catch-up tick is an extra tick, never a unit tick: it must not move the start that
            # the room of the ticks between is measured from (engine._tick_has_room)
            unit_tick = grid.unit_tick(deadline) and not catching_up
            catching_up = False
            engine_late = self.engine.late_ticks   # the engine's own count
            await self._tick_once(unit_tick if phased else None)
            now = loop.time()
            if phased and deadline < now <= grid.next_unit_point(deadline) + LATE_SLACK * period:
                # A unit tick ran into the time of the ticks between: they start now (and take
                # early closes only while there is room), the unit tick after them is on time
                deadline = deadline_after_late(deadline, now, period)
                continue
            if now > deadline + LATE_SLACK * period:
                if self._stopping.is_set():
                    # the tick that ran while the server stopped (its sessions closing, the engine
                    # shutting down) serves no caller: neither counted nor logged as late
                    break
                self.metrics.late_ticks.inc()
                # The engine logs the warning for a tick over its own period (one line, not two);
                # phased, that period is a unit and this grid's point a fraction of one, so the
                # server says it unless the engine counted (and logged) this tick late too.
                engine_said_it = self.engine.late_ticks > engine_late
                (logger.warning if phased and not engine_said_it else logger.debug)(
                    "%s ran late: ended %.3f s past its deadline (period %.3f s); the next tick starts now",
                    "tick" if not phased else "unit tick" if unit_tick else "tick between unit ticks",
                    now - deadline, period)
                # the next tick starts now and is due at the grid's next point (runtime/scheduler/pacing.py)
                deadline = deadline_after_late(deadline, now, period)
                continue
            if caught_up_at != deadline and self._sessions_behind() > 0:
                # The sessions behind real time get one extra tick now, before the deadline
                # (docs/engine.md, "Pacing"); the deadline stays where it was.
                self.metrics.catch_up_ticks.inc()
                caught_up_at, catching_up = deadline, True
                await asyncio.sleep(0)   # let the event loop take the frames that arrived meanwhile
                continue
            await self._wait_for(deadline, period, pacing)
            deadline += period

    async def _wait_for(self, deadline: float, period: float, pacing: bool) -> None:
        """Until ``deadline`` (or shutdown). With ``scheduler.prefill_between_ticks``, prefill chunks
        of opening sessions run meanwhile while their measured time fits (runtime/scheduler/pacing.py), and
        the wait wakes every ``PREFILL_POLL_S`` to see whether a session started opening."""
        loop = asyncio.get_running_loop()
        while not self._stopping.is_set():
            if pacing:
                pacing = await self._prefill_in_slack(deadline, period)
            left = deadline - loop.time()
            if left <= 0:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), min(left, PREFILL_POLL_S) if pacing else left)

    async def _prefill_in_slack(self, deadline: float, period: float) -> bool:
        """Chunks while they fit; False when ``prefill_step`` failed (the tick prefills instead,
        and this wait tries no more: one logged failure per period, not one per poll)."""
        loop = asyncio.get_running_loop()
        try:
            while not self._stopping.is_set() and self.engine.prefill_pending():
                if not prefill_fits(deadline - loop.time(), self.engine.predicted_prefill_s(), period):
                    return True
                events = await asyncio.to_thread(self.engine.prefill_step)
                self.metrics.prefill_chunks_between_ticks.inc()
                await self._route(events)
        except Exception:  # noqa: BLE001 - an engine bug must not stop the tick loop
            logger.exception("prefill between ticks failed; the next tick prefills instead")
            return False
        return True

    def _sessions_behind(self) -> int:
        """Sessions holding a whole unit more than the next tick takes; 0 with
        ``scheduler.catch_up_ticks`` off."""
        if not self.config.scheduler.catch_up_ticks:
            return 0
        try:
            return int(self.engine.sessions_behind())
        except Exception:  # noqa: BLE001 - pacing must not kill the tick loop
            logger.exception("engine.sessions_behind failed")
            return 0

    async def _tick_once(self, unit_tick: bool | None = None) -> None:
        """One engine tick; ``unit_tick`` (``scheduler.tick_phases`` > 1 only) says whether it is
        one: None calls ``engine.tick()`` as every engine takes it."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        tick = self.engine.tick if unit_tick is None else functools.partial(self.engine.tick, unit_tick=unit_tick)
        try:
            events = await asyncio.to_thread(tick)
        except Exception as exc:  # noqa: BLE001 - an engine bug must not kill the server loop
            logger.exception("engine tick failed")
            self.metrics.tick_errors.inc()
            self.failed_ticks_in_a_row += 1
            self.last_tick_error = f"{type(exc).__name__}: {exc}"
            events = []
        else:
            self.failed_ticks_in_a_row = 0
        self.metrics.tick_duration.observe(loop.time() - start)
        if unit_tick is False and self.failed_ticks_in_a_row == 0 and self.engine.last_tick_units > 0:
            self.metrics.between_tick_duration.observe(loop.time() - start)
        await self._route(events)
        try:
            self.metrics.update(await asyncio.to_thread(self.engine.stats))
        except Exception:  # noqa: BLE001
            logger.exception("engine stats failed")
