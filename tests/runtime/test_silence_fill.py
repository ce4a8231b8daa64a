"""A client that sends nothing (scheduler.SilenceFill, scheduler.fill_silence_after_ms): its
units are completed with silence once it has been quiet long enough, never while it sends in
real time, and its audio after the pause starts a new aligned stream."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import FIRST, UNIT, audio, engine, record_taken

from duplexcache.runtime.scheduler.core import SilenceFill

CHUNK = 1_600                 # 100 ms chunks
AFTER_MS = 500.0              # the default scheduler.fill_silence_after_ms
QUIET_S = (CHUNK + 8_000) / 16_000   # largest chunk + 500 ms: when a fill is due


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _engine(tmp_path, name: str, fill_ms: float | None, align_ms: float | None = None):
    eng = engine(tmp_path, name)
    clock = Clock()
    eng.table.clock = clock
    eng.set_silence_fill(fill_ms)
    eng.set_unit_alignment(align_ms)
    return eng, clock, record_taken(eng)


def _push(eng, sid: str, clock: Clock, stream: np.ndarray, start: int, chunks: int) -> int:
    """``chunks`` 100 ms chunks in real time: the clock moves 100 ms before each."""
    for _ in range(chunks):
        clock.now += CHUNK / 16_000
        eng.push_audio(sid, stream[start:start + CHUNK])
        start += CHUNK
    return start


def test_fill_is_due_after_the_largest_chunk_plus_the_wait():
    fill = SilenceFill(after_samples=8_000)

    class S:   # only the two fields `due` reads
        audio_until_s, largest_push = 10.0, CHUNK

    assert not fill.due(S, 10.0 + QUIET_S - 0.01) and fill.due(S, 10.0 + QUIET_S)
    S.audio_until_s = None
    assert not fill.due(S, 1e9)   # a session that never sent has nothing to continue
    with pytest.raises(ValueError):
        SilenceFill(after_samples=-1)


@pytest.mark.parametrize("fill_ms", [AFTER_MS, None])
def test_a_client_that_stops_sending_gets_its_units_filled_with_silence(tmp_path, fill_ms):
    """Push-to-talk: 0.5 s of speech, then nothing. With the fill, the first unit is that speech
    and silence once the client has been quiet long enough, and every later tick takes a unit of
    silence; without it the session never runs a unit (and could never reply)."""
    eng, clock, taken = _engine(tmp_path, f"fill_{fill_ms}", fill_ms)
    sid = eng.open_session({"voice": "default"})
    stream = audio(3, 1)
    _push(eng, sid, clock, stream, 0, 5)
    clock.now += QUIET_S - 0.05      # not quiet long enough yet
    eng.tick()
    assert taken == []
    for _ in range(3):
        clock.now += 1.0
        eng.tick()
    sess = eng.table.get_live(sid)
    if fill_ms is None:
        assert taken == [] and sess.silent_units == 0 and sess.buffered == 5 * CHUNK
        return
    assert [t.size for t in taken] == [FIRST, UNIT, UNIT] and sess.silent_units == 3
    np.testing.assert_array_equal(taken[0][:5 * CHUNK], stream[:5 * CHUNK])   # the speech, unchanged
    assert not taken[0][5 * CHUNK:].any() and not np.concatenate(taken[1:]).any()
    eng.shutdown()


def test_a_real_time_client_is_never_filled(tmp_path):
    """Chunks every 100 ms, three of them 0.4 s late: with units aligned to end 150 ms before a
    tick, the 5th tick finds less than a unit buffered (the session skips it and catches up). No unit
    gets silence, and the stream reaches the model as sent (after the first unit's alignment
    pad). A fill due right after the largest chunk (0 ms) would cut silence into the speech."""
    for fill_ms, filled in ((AFTER_MS, False), (0.0, True)):
        eng, clock, taken = _engine(tmp_path, f"jitter_{fill_ms}", fill_ms, align_ms=50.0)
        sid = eng.open_session({"voice": "default"})
        stream = audio(4, 10)
        n_chunks = stream.size // CHUNK
        late = np.zeros(n_chunks)
        late[47:50] = 0.4      # the chunks that complete the unit of the 5th tick, and the next two
        arrival = np.maximum.accumulate(100.0 + 0.1 * np.arange(1, n_chunks + 1) + late)   # in order
        sent = 0
        for tick in range(1, 10):
            while sent < n_chunks and arrival[sent] <= 100.0 + tick:
                clock.now = float(arrival[sent])
                eng.push_audio(sid, stream[sent * CHUNK:(sent + 1) * CHUNK])
                sent += 1
            clock.now = 100.0 + tick
            eng.tick()
        assert (eng.table.get_live(sid).silent_units > 0) is filled, fill_ms
        if not filled:
            fed = np.concatenate(taken)
            pad = int(np.flatnonzero(fed)[0])
            np.testing.assert_array_equal(fed[pad:], stream[:fed.size - pad])
            assert len(taken) >= 6
        eng.shutdown()


def test_audio_after_a_pause_starts_a_new_aligned_stream(tmp_path):
    """After silence filled its units, the client's next audio is aligned as a new session's:
    it ends the lead before the tick that takes it (the samples left after that tick)."""
    eng, clock, taken = _engine(tmp_path, "realign", AFTER_MS, align_ms=50.0)
    lead = CHUNK + 800
    sid = eng.open_session({"voice": "default"})
    stream = audio(5, 6)
    sent = _push(eng, sid, clock, stream, 0, 3)   # 0.3 s before the first tick
    eng.tick()
    for _ in range(2):                            # talking in real time
        sent = _push(eng, sid, clock, stream, sent, 10)
        eng.tick()
    before_pause = len(taken)
    clock.now += 3.0                              # the button is released for 3 s
    for _ in range(3):
        eng.tick()
    sess = eng.table.get_live(sid)
    assert sess.silent_units >= 2 and sess.buffered == 0
    sent = _push(eng, sid, clock, stream, sent, 4)   # it talks again: 0.4 s before the next tick
    eng.tick()
    resumed = taken[-1]
    assert len(taken) > before_pause + sess.silent_units - 1
    pad = int(np.flatnonzero(resumed)[0])          # the new stream starts with silence, then its audio
    assert 0 < pad < UNIT and sess.buffered == lead   # and leaves the lead, as a first unit does
    np.testing.assert_array_equal(resumed[pad:], stream[sent - 4 * CHUNK:sent - 4 * CHUNK + UNIT - pad])
    eng.shutdown()


@pytest.mark.parametrize("fill_ms", [AFTER_MS, None])
def test_a_pause_while_the_session_holds_a_backlog_is_heard_as_silence(tmp_path, fill_ms):
    """A session still holding a unit or more when its client pauses (its context was still
    prefilling, or it is behind) is never short at a tick, so no tick fills the pause: the
    chunk after it is preceded by the pause's silence, or the model would hear the two turns as
    one. A chunk 0.4 s late is no pause (less than fill_silence_after_ms): nothing is added."""
    eng, clock, _ = _engine(tmp_path, f"backlog_{fill_ms}", fill_ms)
    sid = eng.open_session({"voice": "default"})
    stream = audio(6, 4)
    sent = _push(eng, sid, clock, stream, 0, 20)     # 2 s of speech, no tick yet
    clock.now += 0.4
    sent = _push(eng, sid, clock, stream, sent, 1)   # 0.4 s late
    sess = eng.table.get_live(sid)
    assert sess.buffered == 21 * CHUNK
    clock.now += 3.0                                   # the client sends nothing for 3 s
    _push(eng, sid, clock, stream, sent, 1)
    buffered = np.concatenate(sess.audio)
    pause = 0 if fill_ms is None else 3 * 16_000
    assert buffered.size == 22 * CHUNK + pause
    np.testing.assert_array_equal(buffered[:21 * CHUNK], stream[:21 * CHUNK])
    assert not buffered[21 * CHUNK:21 * CHUNK + pause].any()
    np.testing.assert_array_equal(buffered[21 * CHUNK + pause:], stream[21 * CHUNK:22 * CHUNK])
    eng.shutdown()


def test_a_pause_filled_at_the_ticks_adds_no_more_silence_when_the_client_resumes(tmp_path):
    """The ticks filled the pause unit by unit: the chunk that ends it brings its own audio only
    (and starts a new aligned stream, as above), not the pause a second time."""
    eng, clock, taken = _engine(tmp_path, "filled_then_resume", AFTER_MS)
    sid = eng.open_session({"voice": "default"})
    stream = audio(7, 3)
    sent = _push(eng, sid, clock, stream, 0, 5)
    for _ in range(3):
        clock.now += 1.0
        eng.tick()
    sess = eng.table.get_live(sid)
    assert sess.silent_units >= 2 and sess.buffered == 0
    _push(eng, sid, clock, stream, sent, 1)
    assert sess.buffered == CHUNK and not sess.pause_filled
    eng.shutdown()


def test_a_client_ahead_of_real_time_that_waits_less_than_it_is_ahead_has_not_paused(tmp_path):
    """A client that sent 3 s of audio in 0.3 s (a file) and sends again 2 s later has sent
    nothing late: its audio reaches past that moment, so no silence goes between the two.
    Waiting past where its audio reaches by 3 s is a pause of 3 s."""
    eng, clock, _ = _engine(tmp_path, "ahead", AFTER_MS)
    sid = eng.open_session({"voice": "default"})
    stream = audio(8, 7)
    sent = 0
    for _ in range(30):                 # 3 s of audio, a chunk every 10 ms
        clock.now += 0.01
        eng.push_audio(sid, stream[sent:sent + CHUNK])
        sent += CHUNK
    clock.now += 2.0                    # 2.3 s after the first chunk: the audio reaches 3 s
    eng.push_audio(sid, stream[sent:sent + CHUNK])
    sent += CHUNK
    sess = eng.table.get_live(sid)
    assert sess.buffered == 31 * CHUNK
    # 31 chunks from 0.1 s before the first arrival: the audio reaches 0.71 s past now. The next
    # chunk arrives so that it starts 3 s after that (its own 0.1 s after the 3 s)
    clock.now += 0.71 + 3.0 + 0.1
    eng.push_audio(sid, stream[sent:sent + CHUNK])
    buffered = np.concatenate(sess.audio)
    assert buffered.size == 32 * CHUNK + 3 * 16_000 and not buffered[31 * CHUNK:31 * CHUNK + 48_000].any()
    eng.shutdown()
