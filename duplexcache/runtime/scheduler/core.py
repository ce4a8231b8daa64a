"""The scheduler: which sessions run in which tick, and when (docs/engine.md, "Pacing").

It owns the engine's pacing and time, configured once by a server before its first tick from the
deploy config's ``scheduler`` section (through the engine's pacing setters, ``EngineAPI``):

* unit alignment (``UnitAlignment``: a session's units complete a fixed lead before a tick of the
  server's grid), silence fill (``SilenceFill``: a quiet client's units completed with silence)
  and early closes (``EarlyClose``: a caller's turn answered at the next phased tick);
* phases (``scheduler.tick_phases``): whether the tick in progress is a unit tick (every
  session's units stay on it) and when the last one started;
* catch-up (``sessions_behind``), prefill between ticks (``pacing.PrefillTimes``);
* the tick-cost model (``admission.TickCostModel``), which admission by time and the early closes'
  room read;
* taking each tick's units from the session table (``take_units``).

The server's tick loop keeps the clock (``pacing.UnitGrid``) and routes events; the engine runs
the units this hands it. The session table (``engine_session.SessionTable``) owns the sessions
and their buffered audio under its lock; this reads and cuts that audio under the same lock.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from duplexcache.runtime import turns
from duplexcache.runtime.memory.admission import TickCostModel
from duplexcache.runtime.engine_api import INPUT_SAMPLE_RATE
from duplexcache.runtime.engine_session import EngineSession, SessionTable, Unit
from duplexcache.runtime.scheduler.pacing import PrefillTimes

logger = logging.getLogger(__name__)
# Scheduler.between_margin_s: the overruns of ticks between in the latest this many unit ticks. They
# age out by unit ticks, not by ticks between: a large margin stops the early closes, so no tick between
# would come to replace one outlier, and the margin would stay for good.
BETWEEN_OVERRUN_UNIT_TICKS = 16

# What an aligned session's units end before their tick beyond its largest chunk
# (UnitAlignment.lead): chunks arrive whole and a little late (the client's timer, the network,
# the event loop), and a unit not complete at its tick waits a whole period for the next one, so
# the lead covers that jitter; every reply waits it once more, so it is kept small. 50 ms is
# 800 samples at 16 kHz. The deploy key scheduler.unit_align_margin_ms until issue 44
# (docs/engine.md, "Retired switches").
UNIT_ALIGN_MARGIN_MS = 50.0


@dataclass(frozen=True)
class UnitAlignment:
    """Where a server-paced engine puts a session's unit boundaries (docs/engine.md, "Pacing").

    The server ticks on a fixed grid, and each tick takes one unit from every session holding
    one. Cut from the stream's first sample, a session's units complete at a random phase of the
    grid and wait up to a whole period for the tick that takes them: every reply starts that much
    later. So the first unit starts with silence, as much as makes every unit complete ``lead``
    samples before a tick, where ``lead`` = the session's largest pushed chunk + ``margin``
    (chunks arrive whole, and a little late). Every later unit is then taken ``lead`` after its
    last sample arrived, not up to a period after.
    """

    margin_samples: int   # arrival jitter allowed beyond the session's largest chunk
    unit_samples: int     # samples of every unit after the first

    def __post_init__(self) -> None:
        if self.margin_samples < 0 or self.unit_samples <= 0:
            raise ValueError(f"need margin_samples >= 0 and unit_samples > 0, got {self.margin_samples}, "
                             f"{self.unit_samples}")

    def lead(self, largest_push: int) -> int:
        return largest_push + self.margin_samples

    def first_pad(self, buffered: int, need: int, largest_push: int) -> int | None:
        """Samples of silence before a session's first ``buffered`` samples, whose first unit
        takes ``need``: the fewest that leave ``lead`` samples (plus whole units, a backlog) after
        the first unit. None while fewer than ``lead`` samples are buffered (wait a tick). 0 when
        the lead is a whole unit or more: a client sending chunks that long completes a unit only
        when a chunk arrives, and the units are cut from its first sample as without alignment."""
        lead = self.lead(largest_push)
        if lead >= self.unit_samples:
            return 0
        if buffered < lead:
            return None
        short = need + lead - buffered
        return short if short >= 0 else short % self.unit_samples


@dataclass(frozen=True)
class SilenceFill:
    """What a server-paced engine hears while a client sends nothing (docs/engine.md, "Pacing").

    The duplex model runs on the session's audio: a tick takes a unit only from a session that
    holds one. A client that stops sending (push-to-talk between turns, a manual-turn client that
    commits and waits for ``response.create``'s reply) would stop its session, reply included. So
    once a session has held less than a unit for ``after_samples`` longer than its largest chunk
    takes to arrive, its unit is completed with silence, as if the microphone were open and quiet.
    A client that sends in real time never waits that long between chunks, so its speech is never
    cut with silence; when it sends again, its audio starts a new aligned stream
    (``UnitAlignment.first_pad``), as a new session's does.

    A pause while the session still holds a unit or more (its context was prefilling, or it is
    behind) never leaves it short at a tick, so no unit is filled then; the audio after the pause
    would follow the audio before it at once, and the model would hear two turns as one. So a
    chunk that arrives ``after_samples`` or more later than real time allows (the previous
    chunk's arrival plus this chunk's duration) is preceded by that much silence, unless the
    pause was already filled at a tick. "Real time allows" follows the client's audio, not its
    sends: a client that sent ahead (a file, faster than real time) and then waits less than it
    is ahead has not paused (``EngineSession.audio_until_s``).
    """

    after_samples: int    # quiet beyond the session's largest chunk before silence fills a unit

    def __post_init__(self) -> None:
        if self.after_samples < 0:
            raise ValueError(f"after_samples must be >= 0, got {self.after_samples}")

    def pause_before(self, sess: "EngineSession", now: float, samples: int) -> int:
        """Samples of silence to put before a chunk of ``samples`` arriving at ``now``: the time
        the client sent nothing beyond the chunk's own duration, when that is ``after_samples`` or
        more and no tick filled the pause (0 otherwise)."""
        if sess.audio_until_s is None or sess.pause_filled:
            return 0
        gap = round((now - sess.audio_until_s) * INPUT_SAMPLE_RATE) - samples
        return gap if gap >= self.after_samples else 0

    def due(self, sess: "EngineSession", now: float) -> bool:
        """Whether ``sess``'s client has sent nothing for long enough at ``now``."""
        if sess.audio_until_s is None:
            return False
        quiet = round((now - sess.audio_until_s) * INPUT_SAMPLE_RATE)   # whole samples: no float edge
        return quiet >= sess.largest_push + self.after_samples


@dataclass(frozen=True)
class EarlyClose:
    """Where a server that ticks ``phases`` times per unit (``scheduler.tick_phases``) closes a
    session's unit early: at the first tick after its caller's turn ended (docs/engine.md,
    "Phased ticks").

    A reply starts in the tick that takes the unit holding the end of the caller's turn. With
    one tick per unit that unit completes up to a whole unit after the turn ended, and the reply
    waits for it. With ticks every ``period_samples`` of audio, a session whose unit is only
    partly received, whose audio ends with the end of a turn (the speak policy's
    ``would_answer``, on the received audio alone) and which holds at least one period, has its
    unit cut after the last whole period it holds and completed with silence, and the tick takes
    it now, if the tick has ``room`` for it. What it holds past the cut (less than a period,
    quiet) starts its next unit.

    Every session's units stay on the unit tick (the grid's first phase): the ticks between take
    only early closes (and whole units a session already holds), and a session closed early is
    aligned to the unit tick again (``UnitAlignment.first_pad``) at the next one, so its next unit
    starts with the silence that puts it back. Its caller's turn is still answered at the tick
    between, the ticks between stay small (a GPU pays the fixed part of a tick again for each),
    and the model hears a whole unit of silence in all after the turn: the reply's audio runs one
    unit further ahead of what the caller has heard. (Until issue 44 ``scheduler.phase_units:
    spread`` could leave a session on the phase it was closed on instead; home answered sooner:
    docs/engine.md, "Retired switches".)
    """

    period_samples: int   # samples of audio between two ticks (tick_seconds / phases)
    unit_samples: int     # samples of every unit after the first
    # Whether the session's speak policy would start a reply on a unit of (received audio,
    # silence), given the audio held past the cut (ReplyPolicy.would_answer)
    answers: Callable[["EngineSession", np.ndarray, np.ndarray], bool]
    # Whether a tick already holding this many units has room for one more (the engine's
    # measured tick cost; for a tick between unit ticks, the time left before the next unit tick)
    room: Callable[[int], bool] = lambda units: True

    def __post_init__(self) -> None:
        if not 0 < self.period_samples < self.unit_samples:
            raise ValueError(f"need 0 < period_samples < unit_samples, got {self.period_samples}, {self.unit_samples}")

    def cut(self, sess: "EngineSession", need: int) -> int:
        """Samples of ``sess``'s buffered audio its unit would take if closed now (whole periods,
        fewer than ``need``); 0 when it cannot be closed early: its first unit (whose length
        differs), a unit right after a silence fill or alignment, or less than a period held."""
        if need != self.unit_samples or not sess.audio_started or sess.realign or sess.buffered >= need:
            return 0
        return sess.buffered // self.period_samples * self.period_samples


class Scheduler:
    """The pacing of one engine (module docstring). Tick-thread state, except ``sessions_behind``
    and the setters, which a server calls between ticks."""

    def __init__(self, table: SessionTable, tick_seconds: float, tick_headroom: float, device: torch.device,
                 unit_samples: int, samples_needed: Callable[[EngineSession], int],
                 would_answer: Callable[[EngineSession, np.ndarray, np.ndarray], bool]) -> None:
        self.table = table
        self.tick_seconds = tick_seconds
        self.unit_samples = unit_samples            # samples of every unit after the first
        self.samples_needed = samples_needed        # samples a session's next unit takes
        self.would_answer = would_answer            # the speak policy's would_answer, on a closed unit
        # Admission by time: the measured per-session tick cost (runtime/memory/admission.py).
        self.tick_cost = TickCostModel(tick_seconds, tick_headroom)
        self.prefill_times = PrefillTimes(device)   # prefill chunk times, for a server's pacing
        self.alignment: UnitAlignment | None = None   # set_unit_alignment
        self.early_close: EarlyClose | None = None    # set_tick_phases
        self.early_closes = 0                         # units closed early, all sessions
        # With phases: whether the tick in progress is a unit tick, and when the last unit tick
        # started (perf_counter; None before the first), for the room of the ticks between
        self.unit_tick = True
        self.unit_tick_started: float | None = None
        self.unit_ticks = 0   # unit ticks started (the clock the overruns below age by)
        # How far recent ticks between ran past the cost line's prediction: (unit_ticks when it
        # ran, seconds). A unit tick has at most 3 phase ticks between (tick_phases <= 4); catch-up
        # ticks count as ticks between too, so the bound may drop the oldest overrun a little
        # early, and it keeps a caller that never starts a unit tick from growing the deque
        self.between_overrun: deque[tuple[int, float]] = deque(maxlen=4 * BETWEEN_OVERRUN_UNIT_TICKS)

    @property
    def silence_fill(self) -> SilenceFill | None:
        return self.table.silence_fill   # the table's push_audio reads it too (a pause's silence)

    # ---------------------------------------------------------------- set by a server, once
    def set_prefill_between_ticks(self, enabled: bool) -> None:
        """A server that runs ``prefill_step`` in its slack: a tick then leaves a session that
        became pending since the last tick to that slack (runtime/scheduler/pacing.py)."""
        self.prefill_times.between_ticks = enabled

    def set_unit_alignment(self, margin_ms: float | None) -> None:
        """``scheduler.align_units_to_ticks``: each new session's units end ``margin_ms`` (a server
        passes ``UNIT_ALIGN_MARGIN_MS``) plus its largest chunk before a tick (``UnitAlignment``);
        None cuts units from the first sample."""
        self.alignment = None if margin_ms is None else UnitAlignment(
            round(margin_ms * INPUT_SAMPLE_RATE / 1000), self.unit_samples)

    def set_silence_fill(self, after_ms: float | None) -> None:
        """``scheduler.fill_silence_after_ms``: a session whose client has sent nothing for
        ``after_ms`` longer than its largest chunk takes gets its unit completed with silence, and
        a chunk after such a pause comes after its silence (``SilenceFill``); None waits for audio."""
        self.table.silence_fill = None if after_ms is None else SilenceFill(round(after_ms * INPUT_SAMPLE_RATE / 1000))

    def set_tick_phases(self, phases: int) -> None:
        """``scheduler.tick_phases``: with more than one tick per unit, a session whose caller's
        turn has ended has its unit closed with silence at the next tick (``EarlyClose``) when the
        speak policy would answer it. Units stay on the unit tick: the server says which tick is
        one (``tick(unit_tick=...)``), admission counts one tick per unit, and a tick between
        takes an early close only while it would end before the next unit tick is due."""
        if phases < 1:
            raise ValueError(f"tick phases must be >= 1, got {phases}")
        # the audio that arrives between two ticks: an early close cuts whole periods of it
        period = round(self.tick_seconds / phases * INPUT_SAMPLE_RATE)
        early = phases > 1 and 0 < period < self.unit_samples   # 1: the server's ticks as they were
        self.early_close = EarlyClose(period, self.unit_samples, self.would_answer,
                                      self.tick_has_room) if early else None

    # ---------------------------------------------------------------- a tick
    def start_tick(self, unit_tick: bool, start: float) -> None:
        self.unit_tick = unit_tick
        if unit_tick:
            self.unit_tick_started = start
            self.unit_ticks += 1
            while self.between_overrun and \
                    self.unit_ticks - self.between_overrun[0][0] >= BETWEEN_OVERRUN_UNIT_TICKS:
                self.between_overrun.popleft()

    def finish_tick(self, tick_s: float, prefill_s: float, units: int) -> None:
        # The cost model learns the unit work only: prefill is bounded separately (one chunk).
        work_s = tick_s - prefill_s
        predicted = self.tick_cost.predicted_s(units)
        if not self.unit_tick and units and predicted is not None:
            self.between_overrun.append((self.unit_ticks, max(0.0, work_s - predicted)))
        self.tick_cost.observe(work_s, units)

    @property
    def period_s(self) -> float:
        """What a tick is judged late against: a unit's time (with phases, the unit tick keeps
        real time; the ticks between take only what fits before the next one)."""
        return self.tick_seconds

    def tick_has_room(self, units: int) -> bool:
        """Whether a tick of ``units`` units has room for one more (the measured tick cost;
        before any measurement, yes): within a unit's time x tick_headroom, or, for a tick between
        unit ticks, before the next unit tick is due, one unit after the last one started: that
        unit tick runs every session, and its start is what keeps them in real time."""
        predicted = self.tick_cost.predicted_s(units + 1)
        if predicted is None:
            return True
        if self.unit_tick or self.unit_tick_started is None:
            return predicted <= self.tick_cost.limit_s
        since_unit_tick = time.perf_counter() - self.unit_tick_started
        return since_unit_tick + predicted + self.between_margin_s() <= self.tick_seconds

    def between_margin_s(self) -> float:
        """What a tick between adds to its predicted cost before it takes an early close: the most
        that one of the ticks between of the latest BETWEEN_OVERRUN_UNIT_TICKS unit ticks ran past
        the line (an outlier stops early closes for that long at most). The line is fit mostly through
        unit ticks of every session; a tick between of a few reply starts pays the fixed part of
        every stage and can run past it (an H100 at 59 capacity callers: 3 consecutive ticks
        between 0.12-0.19 s past the next unit tick's start, docs/benchmarks.md). A late tick
        between delays every session's unit tick; a skipped early close delays one reply by
        half a unit, so the margin is the worst recent overrun, not a typical one."""
        return max((overrun for _, overrun in self.between_overrun), default=0.0)

    def sessions_behind(self) -> int:
        """Opened sessions a whole unit behind: one still held a unit right after its last unit
        was taken (so it held two at that tick) and holds its next unit now. A session on time
        holds less than a unit after each take, whatever arrives while the tick runs (the server
        gives them a catch-up tick: scheduler.catch_up_ticks)."""
        table = self.table
        with table.lock:
            return sum(1 for s in table.live.values() if s.opened and s.left_after_take >= self.unit_samples
                       and s.buffered >= self.samples_needed(s))

    def take_units(self) -> list[Unit]:
        """One unit for every opened session with enough audio buffered
        (``samples_needed(session)``); a session two units past that is logged. With
        ``self.alignment``, a session's first unit starts with the silence ``first_pad`` asks for,
        and so does its first unit after a silence fill. With ``self.silence_fill``, a session
        whose client has sent nothing for long enough gets its unit completed with silence. With
        ``self.early_close``, a session whose received audio ends a caller's turn gets its unit
        cut after its last whole period and completed with silence (``EarlyClose``). A tick
        between unit ticks (``unit_tick`` False, ``scheduler.tick_phases`` > 1) fills and aligns
        no session: both start units, which stay on the unit tick."""
        units = []
        short: list[tuple[EngineSession, int]] = []   # sessions holding part of a unit, with its size
        fill, align, unit_tick, table = self.silence_fill, self.alignment, self.unit_tick, self.table
        behind = 2 * self.unit_samples
        with table.lock:
            now = table.clock()
            for sess in table.live.values():
                if not sess.opened:
                    continue
                need = self.samples_needed(sess)
                if fill is not None and sess.buffered < need and fill.due(sess, now):
                    if not unit_tick:
                        continue
                    if not sess.pause_filled:   # once per pause: every quiet tick would repeat it
                        logger.info("session %s: no audio for %.2f s; its units are filled with silence until "
                                    "it sends again", sess.sid, now - sess.audio_until_s)
                    sess.audio.append(np.zeros(need - sess.buffered, np.float32))
                    sess.buffered = need
                    sess.silent_units += 1
                    sess.pause_filled, sess.realign = True, align is not None
                elif align is not None and (not sess.audio_started or (sess.realign and sess.buffered)):
                    if not unit_tick:
                        continue
                    pad = align.first_pad(sess.buffered, need, sess.largest_push)
                    if pad is None:
                        continue
                    logger.debug("session %s: unit starts with %d samples of silence (%d buffered, lead %d)",
                                 sess.sid, pad, sess.buffered, align.lead(sess.largest_push))
                    if pad:
                        sess.audio.insert(0, np.zeros(pad, np.float32))
                        sess.buffered += pad
                    sess.realign = False
                if sess.buffered < need:
                    if self.early_close is not None:
                        short.append((sess, need))
                    continue
                if sess.buffered >= need + behind:
                    logger.debug("session %s is %.1f s behind", sess.sid, sess.buffered / INPUT_SAMPLE_RATE)
                audio = np.concatenate(sess.audio)
                rest = audio[need:]
                sess.audio = [rest] if rest.size else []
                sess.buffered = sess.left_after_take = rest.size
                sess.audio_started = True
                units.append(Unit(sess, audio[:need], ahead=rest, turn=turns.take_unit_requests(sess.turn),
                                  frame=sess.frames.popleft() if sess.frames else None))
            # after the whole units: an early close joins this tick only while the tick has room
            for sess, need in short:
                if self.early_close.room(len(units)):
                    unit = self._close_early(self.early_close, sess, need)
                    if unit is not None:
                        units.append(unit)
        return units

    def _close_early(self, early: EarlyClose, sess: EngineSession, need: int) -> Unit | None:
        """``sess``'s unit closed now with silence (``EarlyClose``), or None (lock held)."""
        cut = early.cut(sess, need)
        if not cut:
            return None
        audio = np.concatenate(sess.audio)
        heard, rest = audio[:cut], audio[cut:]
        if not early.answers(sess, heard, rest):
            return None
        silence = need - cut
        logger.debug("session %s: turn ended; its unit is closed after %d samples with %d of silence",
                      sess.sid, cut, silence)
        sess.audio = [rest] if rest.size else []
        sess.buffered = sess.left_after_take = rest.size
        sess.early_closes += 1
        sess.early_silence += silence
        sess.realign = True   # the next unit tick puts its units back on the unit tick
        self.early_closes += 1
        pcm = np.concatenate([heard, np.zeros(silence, np.float32)])
        return Unit(sess, pcm, ahead=rest, turn=turns.take_unit_requests(sess.turn),
                    frame=sess.frames.popleft() if sess.frames else None)
