"""Phased ticks (scheduler.tick_phases): a turn's unit closed with silence at the next tick
(scheduler.EarlyClose, ReplyPolicy.would_answer)."""
from __future__ import annotations

import copy
import dataclasses
import sys
import types
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import FIRST, UNIT, collect, engine

import duplexcache.runtime.scheduler.core as scheduler_module
from duplexcache.context.tokenizer import ByteTokenizer
from duplexcache.runtime.scheduler.core import EarlyClose, EngineSession
from duplexcache.runtime.policy import ControlTokens, ReplyPolicy, ReplyState, text_token_ids

CONTROL = ControlTokens.from_tokenizer(ByteTokenizer())
TEXT = text_token_ids(ByteTokenizer(), 151748)
LOUD, QUIET = 0.1, 0.02
CHUNK = 1_600            # 100 ms chunks
MARGIN_MS = 50.0
LEAD = CHUNK + 800       # what an aligned session holds after each unit
PERIOD = UNIT // 2       # two phases: a tick every 8000 samples of audio


def _noise(rms: float, seed: int, n: int) -> np.ndarray:
    if n == 0:
        return np.zeros(0, np.float32)
    x = np.random.default_rng(seed).standard_normal(n)
    return (x * rms / np.sqrt(np.mean(x * x))).astype(np.float32)


def _policy() -> ReplyPolicy:
    return ReplyPolicy(CONTROL, TEXT, speech_rms=0.05, reply_min_units=2, reply_max_units=2, end_quiet_ms=200)


def test_would_answer_judges_the_received_audio_and_changes_nothing():
    p = _policy()
    speech_then = lambda quiet_ms: np.concatenate([_noise(LOUD, 1, 4_800), _noise(QUIET, 2, quiet_ms * 16)])
    quiet = lambda ms, seed=3: _noise(QUIET, seed, ms * 16)
    state = ReplyState("s")
    before = copy.deepcopy(state)
    assert p.would_answer(state, speech_then(200), quiet(0))              # 200 ms of quiet after the turn
    assert p.would_answer(state, speech_then(150), quiet(50))             # counted through what follows the cut
    assert not p.would_answer(state, speech_then(100), quiet(50))         # 150 ms: the turn may go on
    assert not p.would_answer(state, speech_then(300), np.concatenate([quiet(50), _noise(LOUD, 4, 800)]))
    assert not p.would_answer(state, quiet(500), quiet(100))              # no user turn waits
    assert state == before                                                # a question, not a decision
    waiting = ReplyState("s", heard_speech=True, quiet_samples=1_000)     # speech ended in the last unit
    assert p.would_answer(waiting, quiet(150), quiet(0))                  # 62.5 + 150 ms
    assert not p.would_answer(ReplyState("s", heard_speech=True), quiet(100), quiet(50))
    replying = ReplyState("s", speaking=True, reply_left=1)
    assert not p.would_answer(replying, speech_then(400), quiet(50))      # a reply runs: no early close
    last = ReplyState("s", speaking=True, reply_left=0)                   # its last unit was the one before
    assert p.would_answer(last, speech_then(400), quiet(50))
    with pytest.raises(ValueError, match="ReplyState"):
        p.would_answer(None, quiet(10), quiet(0))
    # What the engine does with a yes: the unit completed with silence is a reply for decide too.
    pcm = np.concatenate([speech_then(200)[:PERIOD], np.zeros(UNIT - PERIOD, np.float32)])
    assert p.decide(3, None, ReplyState("s"), pcm) == CONTROL.speak


def test_early_close_cuts_whole_periods_of_a_later_unit_only():
    close = EarlyClose(PERIOD, UNIT, lambda *_: True)
    sess = EngineSession("s", None, None, None, audio_started=True)
    for buffered, cut in ((0, 0), (PERIOD - 1, 0), (PERIOD, PERIOD), (PERIOD + LEAD, PERIOD), (UNIT - 1, PERIOD)):
        sess.buffered = buffered
        assert close.cut(sess, UNIT) == cut, buffered
    sess.buffered = UNIT
    assert close.cut(sess, UNIT) == 0                  # a whole unit: the tick takes it anyway
    sess.buffered = PERIOD + LEAD
    assert close.cut(sess, FIRST) == 0                 # the first unit is longer: never closed early
    sess.realign = True
    assert close.cut(sess, UNIT) == 0                  # its next audio is aligned first
    sess.realign, sess.audio_started = False, False
    assert close.cut(sess, UNIT) == 0
    quarters = EarlyClose(UNIT // 4, UNIT, lambda *_: True)
    sess.audio_started, sess.buffered = True, 3 * UNIT // 4 + LEAD
    assert quarters.cut(sess, UNIT) == 3 * UNIT // 4
    for bad in ((0, UNIT), (UNIT, UNIT), (UNIT + 1, UNIT)):
        with pytest.raises(ValueError):
            EarlyClose(*bad, lambda *_: True)


def _stream() -> np.ndarray:
    """Quiet, 1 s of speech from sample 4000 to 20000, then quiet: with units aligned (the first
    taken at tick 0 ends at stream sample 2400), the turn ends 1600 samples into the unit
    stream[18400:34400]."""
    return np.concatenate([_noise(QUIET, 10, 4_000), _noise(LOUD, 11, 16_000), _noise(QUIET, 12, 60_000)])


def _call(tmp_path, name: str, phases: int, mode: str = "reply", callers: int = 1, room=None) -> tuple:
    """Real-time clients sending 100 ms chunks (the same stream) to an engine ticking every half
    unit of audio (0.3 s before the first tick), for 9 ticks. Returns the engine's stats, the
    first caller's session, the units it heard, the samples left after each tick, which ticks
    spoke, and the stream. ``room`` replaces the early close's room test. Units stay on the unit
    tick, every ``phases``-th tick from the first (the server says which: tick(unit_tick=...))."""
    policy = {"mode": mode, "speech_rms": 0.05, "reply_min_units": 2, "reply_max_units": 2, "end_quiet_ms": 200}
    eng = engine(tmp_path, name, {"engine": {"speak_policy": policy}})
    eng.set_unit_alignment(MARGIN_MS)
    eng.set_tick_phases(phases)
    if room is not None:
        eng.scheduler.early_close = dataclasses.replace(eng.scheduler.early_close, room=room)
    sids = [eng.open_session({"voice": "default"}) for _ in range(callers)]
    first_taken = _record_first(eng, sids[0])
    stream, sent, left, spoke = _stream(), 0, [], []
    for tick in range(9):
        for _ in range(3 if tick == 0 else PERIOD // CHUNK):
            for sid in sids:
                eng.push_audio(sid, stream[sent:sent + CHUNK])
            sent += CHUNK
        got = collect(eng.tick(unit_tick=tick % phases == 0))
        assert not any(got.get(sid, {"errors": []})["errors"] for sid in sids)
        left.append(eng.table.get_live(sids[0]).buffered)
        spoke.append([bool(got.get(sid, {"text": []})["text"]) for sid in sids])
    stats, sess = eng.stats(), eng.table.get_live(sids[0])
    eng.shutdown()
    spoke = [s[0] for s in spoke] if callers == 1 else spoke
    return stats, sess, first_taken, left, spoke, stream


def _record_first(eng, sid: str) -> list[np.ndarray]:
    """The PCM of every unit of ``sid`` the table hands out, as they are handed out."""
    taken: list[np.ndarray] = []
    real = eng.scheduler.take_units

    def recording(*args, **kwargs):
        units = real(*args, **kwargs)
        taken.extend(u.pcm for u in units if u.session.sid == sid)
        return units

    eng.scheduler.take_units = recording
    return taken


def test_a_turn_is_answered_at_the_tick_between_and_the_session_goes_back_to_the_unit_tick(tmp_path):
    """Two phases: the turn is answered at the tick between (3), half a unit before one phase
    answers it (4); the reply's second unit comes at the next unit tick (4) and every later unit
    on the unit ticks (even), each leaving the lead; the model heard one whole unit of silence
    after the turn."""
    stats1, _, taken1, _, spoke1, _ = _call(tmp_path, "one_phase", 1)
    # One phase: the unit holding the end of the turn completes at tick 4 and answers there.
    assert spoke1 == [False] * 4 + [True, False, True, False, False] and stats1.early_closes == 0
    assert np.concatenate(taken1).size == FIRST + 4 * UNIT   # ticks 0, 2, 4, 6, 8 without the close
    stats, sess, taken, left, spoke, stream = _call(tmp_path, "two_phases", 2)
    # At tick 3 the session holds 10400 samples of that unit, the last 6400 + 2400 of them quiet:
    # the unit is closed after one period, completed with silence, and answered half a unit sooner.
    assert spoke == [False] * 3 + [True, True, False, False, False, False]
    assert stats.early_closes == 1 and sess.early_closes == 1 and sess.early_silence == UNIT - PERIOD
    # What the model heard: the stream after the first unit's alignment silence, with a whole
    # unit of silence where the unit was closed (half completing it, half putting the next unit
    # back on the unit tick); nothing dropped or reordered.
    pad = FIRST - LEAD
    heard = np.concatenate(taken)
    rest = heard.size - pad - 26_400 - UNIT
    want = np.concatenate([np.zeros(pad, np.float32), stream[:26_400], np.zeros(UNIT, np.float32),
                           stream[26_400:26_400 + rest]])
    np.testing.assert_array_equal(heard, want)
    taken_at = [0, 2, 3, 4, 6, 8]
    assert len(taken) == len(taken_at) and [t.size for t in taken] == [FIRST] + [UNIT] * (len(taken) - 1)
    assert [left[t] for t in taken_at] == [LEAD] * len(taken_at)


def test_a_tick_between_unit_ticks_starts_no_session(tmp_path):
    """A new session's first unit (aligned) and a quiet client's silence fill wait for a unit tick."""
    eng = engine(tmp_path, "between")
    eng.set_unit_alignment(MARGIN_MS)
    eng.set_silence_fill(0.0)
    eng.set_tick_phases(2)
    sid = eng.open_session({"voice": "default"})
    for seed in range(3):
        eng.push_audio(sid, _noise(QUIET, seed, CHUNK))
    eng.tick(unit_tick=False)
    sess = eng.table.get_live(sid)
    assert not sess.audio_started and sess.buffered == 3 * CHUNK
    assert eng.last_tick_units == 0          # what the server times ticks between by
    eng.tick()
    assert sess.audio_started and sess.buffered == LEAD and eng.last_tick_units == 1
    eng.table.clock = lambda: sess.audio_until_s + 10.0        # the client went quiet long ago
    eng.tick(unit_tick=False)
    assert sess.silent_units == 0 and sess.buffered == LEAD
    assert eng.last_tick_units == 0          # not the last tick's that ran any
    eng.tick()
    assert sess.silent_units == 1
    eng.shutdown()


def test_the_room_between_unit_ticks_is_the_time_left_before_the_next_one(tmp_path, monkeypatch):
    eng = engine(tmp_path, "room_home", {"engine": {"tick_seconds": 1.0, "tick_headroom": 0.9}})
    eng.set_tick_phases(2)
    assert eng.scheduler.tick_cost.limit_s == pytest.approx(0.9)   # admission: one unit tick per unit
    assert eng.scheduler.tick_has_room(50)                         # nothing measured yet: room
    for units in (1, 3, 5):                             # 0.1 s + 0.1 s per unit
        eng.scheduler.tick_cost.observe(0.1 + 0.1 * units, units)
    # the engine's clock stands still (no test waits on this machine's speed)
    monkeypatch.setattr(scheduler_module, "time", types.SimpleNamespace(perf_counter=lambda: 100.0))
    eng.scheduler.unit_tick, eng.scheduler.unit_tick_started = False, 100.0 - 0.65
    # 0.65 s since the unit tick started: room while 0.65 + 0.1 + 0.1 (n + 1) <= 1.0
    assert [eng.scheduler.early_close.room(n) for n in range(3)] == [True, True, False]
    eng.scheduler.unit_tick = True                               # a unit tick: a unit x headroom, 0.9 s
    assert eng.scheduler.early_close.room(6) and not eng.scheduler.early_close.room(8)
    # A tick between that ran 0.1 s past the line: the ticks between keep that much more room
    eng.scheduler.unit_tick = False
    eng.scheduler.finish_tick(0.1 + 0.1 * 2 + 0.1, 0.0, 2)
    assert eng.scheduler.between_margin_s() == pytest.approx(0.1)
    eng.scheduler.unit_tick, eng.scheduler.unit_tick_started = False, 100.0 - 0.65
    assert [eng.scheduler.early_close.room(n) for n in range(3)] == [True, False, False]
    eng.scheduler.unit_tick = True                               # unit ticks (admission) keep their limit
    assert eng.scheduler.early_close.room(6)
    eng.scheduler.finish_tick(0.9, 0.0, 4)                       # a unit tick's overrun is not the margin
    assert eng.scheduler.between_margin_s() == pytest.approx(0.1)
    eng.shutdown()


def test_an_overrun_between_ages_out_by_unit_ticks(tmp_path):
    """One outlier between unit ticks (a pause of the host, say) stops early closes, so no tick
    between comes to replace it: its margin ends after BETWEEN_OVERRUN_UNIT_TICKS unit ticks."""
    eng = engine(tmp_path, "room_age", {"engine": {"tick_seconds": 1.0, "tick_headroom": 0.9}})
    eng.set_tick_phases(2)
    sched = eng.scheduler
    for units in (1, 3, 5):
        sched.tick_cost.observe(0.1 + 0.1 * units, units)
    sched.start_tick(True, 0.0)
    sched.start_tick(False, 0.5)
    sched.finish_tick(0.3 + 0.8, 0.0, 2)                         # 0.8 s past the line
    assert sched.between_margin_s() == pytest.approx(0.8)
    sched.start_tick(False, 0.6)
    sched.finish_tick(0.3 + 0.05, 0.0, 2)
    for tick in range(1, scheduler_module.BETWEEN_OVERRUN_UNIT_TICKS):
        sched.start_tick(True, float(tick))                      # unit ticks only: no early close fits
        sched.finish_tick(0.2, 0.0, 1)
        assert sched.between_margin_s() == pytest.approx(0.8), tick
    sched.start_tick(True, 99.0)
    assert sched.between_margin_s() == 0.0
    eng.shutdown()


def test_an_early_close_joins_a_tick_only_while_it_has_room(tmp_path):
    """Two callers whose turns end alike: with room for one unit per tick, the first is closed
    early at tick 3 and the second waits for its whole unit at tick 4, as without phases."""
    stats, _, _, _, spoke, _ = _call(tmp_path, "room", 2, callers=2, room=lambda units: units < 1)
    assert stats.early_closes == 1
    assert [t for t, s in enumerate(spoke) if s[0]][:1] == [3] and [t for t, s in enumerate(spoke) if s[1]][:1] == [4]


def test_no_early_close_without_a_policy_that_can_tell_a_turn_ended(tmp_path):
    """The scripted every_k_units policy has no would_answer: phased ticks, no early close."""
    stats, sess, taken, _, _, stream = _call(tmp_path, "scripted", 2, mode="every_k_units")
    assert stats.early_closes == 0 and sess.early_silence == 0
    heard = np.concatenate(taken)[FIRST - LEAD:]
    np.testing.assert_array_equal(heard, stream[:heard.size])


def test_a_phased_engine_judges_late_ticks_against_a_unit(tmp_path, monkeypatch):
    """Units stay on the unit tick, which keeps real time: a unit tick and a tick between are
    both judged against a unit's time (the server judges its grid's points: tick_loop.py)."""
    eng = engine(tmp_path, "late_period", {"engine": {"tick_seconds": 1.0}})
    periods = []
    real = eng.recorder.finish_tick
    monkeypatch.setattr(eng.recorder, "finish_tick", lambda lat, period: (periods.append(period), real(lat, period)))
    eng.tick()
    eng.set_tick_phases(2)
    eng.tick()
    eng.tick(unit_tick=False)
    eng.shutdown()
    assert periods == [1.0, 1.0, 1.0]


def test_the_early_close_period_is_the_audio_between_two_ticks(tmp_path):
    eng = engine(tmp_path, "phases")
    with pytest.raises(ValueError, match="tick phases"):
        eng.set_tick_phases(0)
    eng.set_tick_phases(4)
    assert eng.scheduler.early_close.period_samples == UNIT // 4
    eng.set_tick_phases(1)                       # a tick per unit: nothing to close early
    assert eng.scheduler.early_close is None
    eng.shutdown()
    fast = engine(tmp_path, "fast", {"engine": {"tick_seconds": 0.25}})
    fast.set_tick_phases(2)                      # ticks every 0.125 s of audio
    assert fast.scheduler.early_close.period_samples == 2_000
    fast.set_tick_phases(1)                      # one phase: no early close, whatever the period
    assert fast.scheduler.early_close is None
    fast.shutdown()
