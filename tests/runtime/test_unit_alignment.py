"""Units cut on the server's tick grid (scheduler.UnitAlignment, scheduler.align_units_to_ticks)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import FIRST, UNIT, audio, collect, engine, record_taken

from duplexcache.runtime.scheduler.core import UNIT_ALIGN_MARGIN_MS, UnitAlignment

CHUNK = 1_600          # a client sending 100 ms chunks
MARGIN_MS = UNIT_ALIGN_MARGIN_MS   # what a server passes: 50 ms, 800 samples
LEAD = CHUNK + 800


def test_first_pad_leaves_the_lead_after_the_first_unit():
    assert MARGIN_MS == 50.0   # scheduler.unit_align_margin_ms's default until issue 44; LEAD assumes 800 samples
    align = UnitAlignment(margin_samples=800, unit_samples=UNIT)
    assert align.lead(CHUNK) == LEAD
    # a client sending a unit or more per chunk: nothing to align (cut from the first sample)
    assert [align.first_pad(b, FIRST, UNIT) for b in (0, 5_000, FIRST, 40_000)] == [0, 0, 0, 0]
    assert align.first_pad(LEAD - 1, FIRST, CHUNK) is None  # too little audio to place the unit yet
    for buffered in (LEAD, 4_800, FIRST, FIRST + LEAD, 40_000, 123_457):
        pad = align.first_pad(buffered, FIRST, CHUNK)
        assert 0 <= pad <= FIRST
        rest = buffered + pad - FIRST
        assert rest >= LEAD and (rest - LEAD) % UNIT == 0, buffered   # the lead, plus whole units behind
    assert align.first_pad(4_800, FIRST, CHUNK) == FIRST + LEAD - 4_800
    with pytest.raises(ValueError):
        UnitAlignment(margin_samples=-1, unit_samples=UNIT)


def _run(eng, stream: np.ndarray, before_first_tick: int, ticks: int, taken: list) -> tuple[dict, list[int]]:
    """A real-time client: ``before_first_tick`` chunks, then 1 s of chunks before every later
    tick. Returns the events and the samples left buffered after each tick."""
    taken_here = record_taken(eng)
    sid = eng.open_session({"voice": "default"})
    sent, events, left = 0, [], []
    for tick in range(ticks):
        chunks = before_first_tick if tick == 0 else UNIT // CHUNK
        for _ in range(chunks):
            eng.push_audio(sid, stream[sent:sent + CHUNK])
            sent += CHUNK
        events += eng.tick()
        left.append(eng.table.get_live(sid).buffered)
    taken.extend(taken_here)
    return collect(events)[sid], left


@pytest.mark.parametrize("before_first_tick", [3, 25])   # 0.3 s; 2.5 s (a session that opened late)
def test_aligned_units_are_the_stream_after_silence_and_leave_the_lead(tmp_path, before_first_tick):
    stream = audio(7, 12)
    eng = engine(tmp_path, "aligned")
    eng.set_unit_alignment(MARGIN_MS)
    taken: list[np.ndarray] = []
    got, left = _run(eng, stream, before_first_tick, ticks=6, taken=taken)
    assert len(taken) >= 5
    fed = np.concatenate(taken)
    pad = int(np.flatnonzero(fed)[0])          # the stream is noise: its first sample is not 0
    assert 0 < pad <= FIRST
    np.testing.assert_array_equal(fed[pad:], stream[:fed.size - pad])   # nothing dropped or reordered
    # after the first unit the session holds the lead (plus whole units: the late opener's
    # backlog), and every later tick, a second of audio after the last, leaves the same
    first_left = before_first_tick * CHUNK + pad - FIRST
    assert first_left >= LEAD and (first_left - LEAD) % UNIT == 0
    assert left == [first_left] * len(left), left

    # The same units fed to an engine that does not align give the same text and audio.
    plain = engine(tmp_path, "plain")
    sid = plain.open_session({"voice": "default"})
    events = []
    for pcm in taken:
        plain.push_audio(sid, pcm)
        events += plain.tick()
    want = collect(events)[sid]
    assert got["text"] == want["text"] and got["audio"] == want["audio"]
    eng.shutdown()
    plain.shutdown()


def test_without_alignment_units_start_at_the_first_sample(tmp_path):
    stream = audio(8, 4)
    eng = engine(tmp_path, "unaligned")
    taken: list[np.ndarray] = []
    _, left = _run(eng, stream, 3, ticks=4, taken=taken)
    fed = np.concatenate(taken)
    np.testing.assert_array_equal(fed, stream[:fed.size])
    # the first unit waited for 1.035 s of audio: none at the first tick (0.3 s buffered), so
    # three units in four ticks, and the rest of the stream stays buffered past the phase
    assert len(taken) == 3 and [t.size for t in taken] == [FIRST, UNIT, UNIT]
    assert left[-1] == 3 * CHUNK + 3 * UNIT - fed.size
    eng.shutdown()
