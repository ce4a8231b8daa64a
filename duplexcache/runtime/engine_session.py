"""Engine sessions: the per-session object, a tick's per-session unit, and the session table.

Ownership (who may touch what):

* ``EngineSession`` owns one session's engine-side state: its buffered input audio, its
  encoder stream, its turn state and its Code2Wav stream of the current turn. ``audio`` /
  ``buffered`` and the turn requests are guarded by ``SessionTable.lock`` (the server's threads
  write them); everything else belongs to the tick thread.
* The KV lives elsewhere, keyed by session id: the Thinker's in ``Stage0Runner`` (through
  ``KVCacheManager``), the Talker's in ``kv/talker_blocks.TalkerBlocks``.
* ``SessionTable`` owns the live / queued / closing sets, the admission ordinals and the lock,
  and keeps the ledger's reservations in step with the live set: a session is in ``live`` if
  and only if the ledger holds its footprint.

The engine asks "can I admit?" (``session_sizing.refusal``) and the table only does it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from duplexcache.runtime_config import SessionRuntimeConfig
from duplexcache.kv.talker_blocks import TalkerBlocks
from duplexcache.kv.window import WindowConfig
from duplexcache.models.audio_encoder import StreamingAudioEncoderState
from duplexcache.runtime import turns
from duplexcache.runtime.memory.admission import AdmissionLedger, Footprint
from duplexcache.runtime.engine_api import (
    INPUT_SAMPLE_RATE,
    EngineEvent,
    InvalidAudioError,
    ResponseUsage,
    ServerBehindError,
    SessionAdmitted,
    SessionError,
    UserTextTooLong,
)
from duplexcache.runtime.policy import ControlTokens
from duplexcache.runtime.memory.session_sizing import session_window
from duplexcache.runtime.stage0.runner import Stage0Runner
from duplexcache.runtime.turns import NO_REQUESTS, TurnState, UnitTurn
from duplexcache.runtime.voices import Voice

logger = logging.getLogger(__name__)

# Audio a session may have buffered ahead of the ticks that consume it (1 s per tick).
MAX_BUFFERED_SECONDS = 10
MAX_BUFFERED_SAMPLES = MAX_BUFFERED_SECONDS * INPUT_SAMPLE_RATE


@dataclass
class EngineSession:
    """One engine session. ``audio``/``buffered`` are guarded by the table's lock; everything
    else belongs to the tick thread."""

    sid: str
    config: SessionRuntimeConfig
    voice: Voice
    footprint: Footprint
    audio: list[np.ndarray] = field(default_factory=list)
    buffered: int = 0
    largest_push: int = 0         # samples in the largest chunk pushed (UnitAlignment's lead)
    audio_started: bool = False   # a unit of its audio has been taken
    left_after_take: int = 0      # samples it still held right after its last unit was taken
    # Samples accepted since the first push and when that was (SessionTable.clock): how far
    # ahead of real time the client sends, when its buffer is full.
    received: int = 0
    first_push_s: float | None = None
    # Where its audio reaches on the wall clock (SilenceFill): each chunk starts where the one
    # before it ended, or at its own arrival less its duration when later (a pause, or jitter)
    audio_until_s: float | None = None
    realign: bool = False         # its units were filled with silence: its next audio is aligned again
    pause_filled: bool = False    # a tick filled the current pause (its next chunk brings no silence)
    silent_units: int = 0         # units completed with silence because the client sent nothing
    early_closes: int = 0         # units closed early at a turn's end (EarlyClose)
    early_silence: int = 0        # samples of silence those units were completed with
    encoder_state: StreamingAudioEncoderState | None = None
    opened: bool = False          # Stage 0 session exists
    ticks_pending: int = 0        # ticks that ended while it was not open yet
    unit_index: int = 0
    turn_index: int = 0
    c2w_sid: str | None = None    # Code2Wav stream of the current turn
    talker_units: int = 0         # its units the Talker ran (0 for a text-only session)
    code2wav_chunks: int = 0      # Code2Wav chunks made for it, final ones included
    held: torch.Tensor | None = None  # the 3 codes the turn's next chunk starts with (code2wav_stage)
    turn: TurnState = field(default_factory=TurnState)   # turn control (runtime/turns.py)
    policy_state: Any = None      # the speak policy's per-session state (policy.new_session)
    # Seeds the session's random draws (Code2Wav noise, benchmark fills): "sess_<admission
    # ordinal>", the engine's own numbering, also when the server named the session, so a run's
    # audio does not depend on the server's random wire ids.
    seed_name: str = ""
    prefill_tick: int | None = None   # the tick that queued its context prefill
    # Camera frames not taken by a unit yet, oldest first (runtime/stages/vision_stage.py;
    # lock-guarded like ``audio``): each unit takes one.
    frames: deque = field(default_factory=deque)


@dataclass(frozen=True)
class SessionInfo:
    """A read-only snapshot of one live session (``DuplexEngine.session_info``).

    Thinker counts are 0 until the tick that opens the session in Stage 0 (``opened``).
    ``window`` holds the marks this session compacts with (the client's, when allowed).
    """

    sid: str
    voice: str
    opened: bool
    units: int                     # units this session has run
    turns: int                     # audio turns started
    code2wav_stream: str | None    # the current turn's Code2Wav stream id, None between turns
    window: WindowConfig
    thinker_anchor_tokens: int     # the shared/anchored context (never released by the window)
    thinker_tokens: int            # anchor + window tokens now in the Thinker KV
    talker_tokens: int             # Talker KV tokens computed in the current turn
    talker_blocks: int             # Talker blocks held (a fast-forward may hold more than computed)
    talker_units: int = 0          # its units the Talker ran (cumulative; 0 when audio_output is off)
    code2wav_chunks: int = 0       # Code2Wav chunks made for it (cumulative)


@dataclass
class Unit:
    """One session's unit inside a tick; each stage fills its part."""

    session: EngineSession
    pcm: np.ndarray
    ahead: np.ndarray | None = None   # what the session held after the unit when it was taken
    decision: int | None = None
    tokens: list[int] = field(default_factory=list)        # text + end token
    hidden: list[torch.Tensor] = field(default_factory=list)  # Thinker hidden that produced each
    codes: torch.Tensor | None = None
    turn: UnitTurn = NO_REQUESTS     # turn requests this unit applies
    rows: torch.Tensor | None = None  # what the unit appended before its decision
    frame: Any = None                 # the camera frame this unit carries (vision_stage.Frame)
    frame_rows: torch.Tensor | None = None   # its <image> v1..v64 </image> rows (vision_stage)


@dataclass
class FinalChunk:
    """The last chunk of an audio turn."""

    session: EngineSession
    codes: torch.Tensor
    response_done: bool  # False when only the Talker's turn was cut (position limit)


def session_info(s: EngineSession, stage0: Stage0Runner, talker_kv: TalkerBlocks) -> SessionInfo:
    """The snapshot of ``s``, its KV counts read from their owners."""
    opened = s.opened and s.sid in stage0.sessions
    return SessionInfo(
        sid=s.sid, voice=s.voice.name, opened=opened, units=s.unit_index, turns=s.turn_index,
        code2wav_stream=s.c2w_sid, window=session_window(s.config),
        thinker_anchor_tokens=stage0.sessions[s.sid].prefix_len if opened else 0,
        thinker_tokens=stage0.num_tokens(s.sid) if opened else 0,
        talker_tokens=talker_kv.num_tokens(s.sid), talker_blocks=talker_kv.num_blocks(s.sid),
        talker_units=s.talker_units, code2wav_chunks=s.code2wav_chunks)


# Ends a session the engine cannot continue; returns the event that tells its client.
EndSession = Callable[[EngineSession, Exception], SessionError]


def ended(events: list[EngineEvent]) -> set[str]:
    """Sessions this tick ended so far (their later stages must not run)."""
    return {e.sid for e in events if isinstance(e, SessionError) and e.fatal}


def end_all(units: list[Unit], errors: dict[str, Exception], events: list[EngineEvent],
            end: EndSession) -> list[Unit]:
    """End the sessions named in ``errors``; returns the units of the others."""
    for u in units:
        if u.session.sid in errors:
            events.append(end(u.session, errors[u.session.sid]))
    return [u for u in units if u.session.sid not in errors]


def check_pcm(pcm: np.ndarray) -> None:
    """Refuse audio the batched encoder would fail on, at the edge (ValueError for a wrong
    type or shape, ``InvalidAudioError`` for bad samples): inside the tick it would fail every
    session of the batch."""
    if not isinstance(pcm, np.ndarray) or pcm.dtype != np.float32 or pcm.ndim != 1:
        raise ValueError(f"audio must be a float32 numpy array of shape (samples,) at {INPUT_SAMPLE_RATE} Hz")
    if pcm.size == 0 or not np.isfinite(pcm).all():
        raise InvalidAudioError("audio is empty or contains NaN/Inf")
    peak = float(np.abs(pcm).max())
    if peak > 1.0:
        raise InvalidAudioError(f"audio samples must be float PCM in [-1, 1]; this chunk peaks at {peak:.4g}")


class SessionTable:
    """Live (admitted), queued and closing sessions under one lock, in step with the ledger."""

    def __init__(self, ledger: AdmissionLedger) -> None:
        self.ledger = ledger
        self.lock = threading.Lock()
        self.live: dict[str, EngineSession] = {}
        self.queue: OrderedDict[str, EngineSession] = OrderedDict()
        self.closing: list[EngineSession] = []   # closed; their memory is freed by the next tick
        self._ids = itertools.count(1)
        self.clock: Callable[[], float] = time.monotonic   # tests set their own
        # What push_audio puts before a chunk after a pause (the scheduler sets it: scheduler.silence_fill)
        self.silence_fill: Any = None

    # ------------------------------------------------------------------ membership (lock held)

    def check_free_id(self, sid: str | None) -> None:
        if sid is not None and (sid in self.live or sid in self.queue):
            raise ValueError(f"session id {sid!r} is in use")

    def next_seed_name(self) -> str:
        """The next admission ordinal's name. Drawn only for a session that is kept (live or
        queued): the ordinal seeds its Code2Wav noise, so it must not depend on others' refusals."""
        return f"sess_{next(self._ids)}"

    def admit(self, sess: EngineSession) -> None:
        self.ledger.admit(sess.sid, sess.footprint)
        self.live[sess.sid] = sess

    def refusal(self, fp: Footprint, refusal: Callable[[Footprint], tuple[str, str] | None]) -> tuple[str, str] | None:
        """Why a new session cannot be admitted now (``refusal``), or None. With sessions queued
        it waits behind them (FIFO), refused with the cause the ledger names."""
        if not self.queue:
            return refusal(fp)
        return ("capacity_memory" if self.ledger.refusal(fp) else "capacity_compute",
                "sessions are queued ahead of this one")

    def enqueue(self, sess: EngineSession) -> None:
        self.queue[sess.sid] = sess

    # ------------------------------------------------------------------ membership (takes the lock)

    def admit_queued(self, refusal: Callable[[Footprint], object]) -> list[EngineEvent]:
        """Admit queued sessions in FIFO order while ``refusal`` says None."""
        events: list[EngineEvent] = []
        with self.lock:
            while self.queue:
                sid, sess = next(iter(self.queue.items()))
                if refusal(sess.footprint) is not None:
                    break  # FIFO: later sessions wait behind the first one
                del self.queue[sid]
                self.admit(sess)
                events.append(SessionAdmitted(sid))
        return events

    def close(self, sid: str) -> None:
        """A queued session leaves at once; a live one releases its reservation at once and
        its memory at the start of the next tick."""
        with self.lock:
            if self.queue.pop(sid, None) is not None:
                return
            sess = self.live.pop(sid, None)
            if sess is None:
                return
            self.ledger.release(sid)
            self.closing.append(sess)

    def take_closing(self) -> list[EngineSession]:
        with self.lock:
            closing, self.closing = self.closing, []
        return closing

    def remove(self, sid: str) -> None:
        """Drop a live session the engine ended (no-op when already gone)."""
        with self.lock:
            if self.live.pop(sid, None) is not None:
                self.ledger.release(sid)

    def clear(self) -> list[EngineSession]:
        """Forget every session (shutdown); returns the live and closing ones, whose memory
        the caller frees."""
        with self.lock:
            sessions = list(self.live.values()) + self.closing
            for sid in list(self.live):
                self.ledger.release(sid)
            self.live.clear()
            self.queue.clear()
            self.closing = []
        return sessions

    # ------------------------------------------------------------------ lookups

    def live_ids(self) -> list[str]:
        with self.lock:
            return list(self.live)

    def get_live(self, sid: str) -> EngineSession:
        """Live session ``sid``; ValueError naming why not (queued or unknown)."""
        with self.lock:
            sess = self.live.get(sid)
            if sess is None:
                what = "queued" if sid in self.queue else "unknown"
                raise ValueError(f"{what} session {sid!r} (live sessions: {', '.join(self.live) or 'none'})")
            return sess

    def pending(self) -> list[EngineSession]:
        """Live sessions not open in Stage 0 yet."""
        with self.lock:
            return [s for s in self.live.values() if not s.opened]

    def note_tick_for_pending(self) -> None:
        with self.lock:
            for s in self.live.values():
                if not s.opened:
                    s.ticks_pending += 1

    def is_queued(self, sid: str) -> bool:
        with self.lock:
            return sid in self.queue

    def queue_position(self, sid: str) -> int | None:
        """1 for the next queued session to be admitted, 2 for the one after...; None when
        ``sid`` is not queued (live, closed or unknown). For ``session.queued`` events."""
        with self.lock:
            for i, queued in enumerate(self.queue, start=1):
                if queued == sid:
                    return i
        return None

    def encoder_bytes(self) -> int:
        """Bytes of the live sessions' streaming encoder caches."""
        with self.lock:
            return sum(s.encoder_state.nbytes for s in self.live.values() if s.encoder_state is not None)

    # ------------------------------------------------------------------ audio

    def push_audio(self, sid: str, pcm: np.ndarray) -> None:
        check_pcm(pcm)
        with self.lock:
            sess = self.live.get(sid)
            if sess is None:
                what = "queued" if sid in self.queue else "unknown"
                raise ValueError(f"cannot push audio to {what} session {sid!r}")
            now = self.clock()
            if sess.first_push_s is None:
                sess.first_push_s = now
            pause = 0 if self.silence_fill is None else self.silence_fill.pause_before(sess, now, int(pcm.size))
            # the pause's silence fits in what the buffer has left beside the chunk (a longer pause
            # is heard shorter, never refused)
            pause = max(0, min(pause, MAX_BUFFERED_SAMPLES - sess.buffered - int(pcm.size)))
            if sess.buffered + pcm.size > MAX_BUFFERED_SAMPLES:
                # The buffer would otherwise grow without bound; the chunk is refused and the
                # session goes on. Whose fault it is decides the error: a client more than half
                # the buffer ahead of real time sends too fast; one that is not is waiting for
                # a server that runs behind (late ticks), and must not be told to slow down.
                ahead_s = (sess.received + pcm.size) / INPUT_SAMPLE_RATE - (now - sess.first_push_s)
                full = (f"audio buffer of session {sid!r} is full: {sess.buffered / INPUT_SAMPLE_RATE:.2f} s "
                        f"buffered + {pcm.size / INPUT_SAMPLE_RATE:.2f} s in this chunk > at most "
                        f"{MAX_BUFFERED_SECONDS} s")
                if ahead_s > MAX_BUFFERED_SECONDS / 2:
                    raise ValueError(f"{full}; send audio in real time (this client is {ahead_s:.1f} s ahead)")
                raise ServerBehindError(f"{full}: the server is running behind real time and dropped this "
                                        f"chunk; your audio arrives in real time")
            if pause:
                logger.info("session %s: %.2f s without audio before this chunk; the model hears it as silence",
                            sid, pause / INPUT_SAMPLE_RATE)
                sess.audio.append(np.zeros(pause, np.float32))
                sess.buffered += pause
            start = now - pcm.size / INPUT_SAMPLE_RATE   # the earliest this chunk can have begun
            sess.audio_until_s = max(start if sess.audio_until_s is None else sess.audio_until_s, start) \
                + pcm.size / INPUT_SAMPLE_RATE
            sess.pause_filled = False
            sess.audio.append(pcm.copy())
            sess.buffered += pcm.size
            sess.received += pcm.size
            sess.largest_push = max(sess.largest_push, int(pcm.size))

    def trim_audio(self, sess: EngineSession, keep: int) -> int:
        """Drop the oldest buffered samples of ``sess`` beyond ``keep``; returns how many."""
        with self.lock:
            drop = sess.buffered - keep
            if drop > 0 and sess.audio:
                audio = np.concatenate(sess.audio)[drop:]
                sess.audio = [audio] if audio.size else []
                sess.buffered = int(audio.size)
                while len(sess.frames) > 1:   # the frames of the dropped seconds go too: the newest stays
                    sess.frames.popleft()
        return drop

    def push_frame(self, sid: str, frame: Any, max_pending: int) -> None:
        """Queue a decoded camera frame for ``sid``'s next unit without one (stages/vision_stage.py)."""
        from duplexcache.runtime.stages.vision_stage import TooManyFrames, VisionUnavailable

        with self.lock:
            sess = self.live.get(sid)
            if sess is None:
                what = "queued" if sid in self.queue else "unknown"
                raise ValueError(f"cannot push a frame to {what} session {sid!r}")
            if not sess.config.video:
                raise VisionUnavailable(f"session {sid!r} was not opened for video (session key 'video')")
            if len(sess.frames) >= max_pending:
                raise TooManyFrames(f"session {sid!r} already holds {len(sess.frames)} frames its audio has not "
                                    f"reached; send at most one frame per second of audio")
            sess.frames.append(frame)

    # ------------------------------------------------------------------ turn control (runtime/turns.py)

    def turn_session(self, sid: str) -> EngineSession:
        """A live or queued session (call under the lock); ValueError if unknown."""
        sess = self.live.get(sid) or self.queue.get(sid)
        if sess is None:
            raise ValueError(f"unknown session {sid!r}")
        return sess

    def set_turn_mode(self, sid: str, mode: str) -> None:
        turns.check_mode(mode)
        with self.lock:
            self.turn_session(sid).turn.mode = mode

    def request_response(self, sid: str) -> None:
        with self.lock:
            self.turn_session(sid).turn.response_requested = True

    def cancel_response(self, sid: str, played_ms: int | None) -> bool:
        """Record a cancel; a request not started yet is withdrawn (no response existed: False)."""
        if played_ms is not None and (not isinstance(played_ms, int) or played_ms < 0):
            raise ValueError(f"played_ms must be a non-negative int or None, got {played_ms!r}")
        with self.lock:
            state = self.turn_session(sid).turn
            state.response_requested = False
            if not state.replying:
                return False
            state.cancel_requested, state.cancel_played_ms = True, played_ms
            return True

    def add_user_text(self, sid: str, ids: list[int], room: Callable[[EngineSession], int]) -> None:
        """Queue user text for ``sid``'s next unit if it fits (``room``: tokens that fit now)."""
        with self.lock:
            sess = self.turn_session(sid)
            pending = sum(len(t) for t in sess.turn.pending_text)
            fits = room(sess)
            if pending + len(ids) > fits:
                raise UserTextTooLong(
                    f"user text of {len(ids)} tokens (with {pending} pending) does not fit session {sid!r}: "
                    f"at most {max(fits, 0)} tokens of text fit before its next unit")
            sess.turn.pending_text.append(ids)

    def take_cancels(self) -> list[tuple[EngineSession, int | None]]:
        """Cancels recorded since the last tick: (session, played ms), each taken once."""
        with self.lock:
            todo = []
            for sess in self.live.values():
                if sess.turn.cancel_requested:
                    todo.append((sess, sess.turn.cancel_played_ms))
                    sess.turn.cancel_requested = False
        return todo

    def note_reply_units(self, units: list[Unit], control: ControlTokens) -> None:
        for u in units:
            if u.rows is not None and turns.note_unit(u.session.turn, u.rows, u.decision, u.tokens, control):
                with self.lock:
                    u.session.turn.replying = True

    def finish_reply(self, sess: EngineSession) -> ResponseUsage:
        usage = turns.finish_reply(sess.turn)
        with self.lock:
            sess.turn.replying = False
            sess.turn.cancel_requested = False   # a cancel that came too late has nothing to stop
        return usage
