"""Pacing rules of the server's tick loop (runtime/scheduler/pacing.py)."""
from __future__ import annotations

import torch

import pytest

from duplexcache.runtime.scheduler.pacing import (PREFILL_MARGIN, RECENT_CHUNKS, PrefillTimes, UnitGrid, deadline_after_late,
                                       prefill_fits)


def test_a_chunk_fits_with_its_margin_and_an_unmeasured_one_needs_half_a_period():
    assert prefill_fits(0.5, None, 1.0) and not prefill_fits(0.49, None, 1.0)
    assert prefill_fits(PREFILL_MARGIN * 0.1, 0.1, 1.0)
    assert not prefill_fits(PREFILL_MARGIN * 0.1 - 1e-6, 0.1, 1.0)
    assert not prefill_fits(-0.2, 0.001, 1.0)          # past the deadline: nothing fits


def test_prefill_times_predicts_the_largest_recent_chunk_and_says_once_that_one_ran():
    clock = iter([0.0, 0.3, 1.0, 1.1] + [2.0, 2.05] * RECENT_CHUNKS)
    times = PrefillTimes(torch.device("cpu"), clock=lambda: next(clock))
    assert times.predicted_s() is None
    assert times.run(lambda: "chunk") == "chunk"
    times.run(lambda: None)
    assert abs(times.predicted_s() - 0.3) < 1e-9   # the larger of 0.3 and 0.1
    assert times.ran_since_tick
    for _ in range(RECENT_CHUNKS):                   # the 0.3 s chunk leaves the window
        times.run(lambda: None)
    assert abs(times.predicted_s() - 0.05) < 1e-9


class _Pending:
    def __init__(self, ticks_pending: int) -> None:
        self.ticks_pending = ticks_pending


def test_the_tick_runs_a_chunk_only_when_none_ran_before_it_and_the_slack_had_its_chance():
    times = PrefillTimes(torch.device("cpu"))
    new, waited = [_Pending(0)], [_Pending(0), _Pending(1)]
    assert not times.chunk_in_tick([])                         # nothing to prefill
    assert times.chunk_in_tick(new)                            # the engine alone: as before
    times.between_ticks = True                                 # a server paces chunks in its slack
    assert not times.chunk_in_tick(new)                        # pending since the last tick: the slack's
    assert times.chunk_in_tick(waited)                         # waited a whole tick: the tick runs one
    times.run(lambda: None)
    assert not times.chunk_in_tick(waited)                     # one ran in the slack: none in the tick
    assert times.chunk_in_tick(waited)                         # ...and the mark is reset


def test_a_measured_chunk_informs_the_prediction_without_claiming_the_slack():
    # chunks inside a tick and the warm-up's are measured too: on an H200 the slack (~300 ms at 32
    # sessions) is under the half period an unmeasured chunk needs, so otherwise none ever ran there
    clock = iter([0.0, 0.06])
    times = PrefillTimes(torch.device("cpu"), clock=lambda: next(clock))
    assert times.measure(lambda: "chunk") == "chunk"
    assert abs(times.predicted_s() - 0.06) < 1e-9 and not times.ran_since_tick
    times.record(0.08)
    assert abs(times.predicted_s() - 0.08) < 1e-9
    assert prefill_fits(0.3, times.predicted_s(), 1.0) and not prefill_fits(0.3, None, 1.0)


def test_a_chunk_on_cuda_is_timed_between_two_synchronisations(monkeypatch):
    # work queued before the chunk must not count as the chunk's (the warm-up launches its first
    # chunk asynchronously, then times the second)
    trace = []
    ticks = iter([1.0, 1.05])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: trace.append("sync"))
    times = PrefillTimes(torch.device("cuda"), clock=lambda: trace.append("clock") or next(ticks))
    times.measure(lambda: trace.append("chunk"))
    assert trace == ["sync", "clock", "chunk", "sync", "clock"]
    assert abs(times.predicted_s() - 0.05) < 1e-9


def test_after_a_late_tick_the_grid_keeps_its_phase():
    # due at 10.0, ended at 10.3: the next tick (started at once) is due at 11.0, not at 11.3
    assert deadline_after_late(10.0, 10.3, 1.0) == 11.0
    # ended 2.5 periods late: the points already past are skipped, not run in a burst
    assert deadline_after_late(10.0, 12.5, 1.0) == 13.0
    assert deadline_after_late(10.0, 11.0, 1.0) == 12.0    # on a grid point: the next one
    assert deadline_after_late(10.0, 9.9, 1.0) == 10.0     # not late: the same deadline
    for now in (10.05, 10.99, 11.5, 17.25):
        due = deadline_after_late(10.0, now, 0.5)
        assert now < due <= now + 0.5 and ((due - 10.0) / 0.5).is_integer()
    # a few ulps before a grid point (a server test met it): the division rounds up to a whole
    # number of periods, and the point found is `now` itself; the next one is due
    deadline, now = 14302.06016712772, 14302.21016712772
    assert now < deadline_after_late(deadline, now, 0.05) <= now + 0.05
    with pytest.raises(ValueError):
        deadline_after_late(10.0, 10.3, 0.0)


def test_unit_grid_marks_every_phases_th_tick_and_finds_the_next_unit_point():
    grid = UnitGrid(100.0, 0.5, 2)
    # the tick due at 100.5 runs at the origin (a unit tick), the one due at 101.0 between
    assert [grid.unit_tick(100.0 + 0.5 * k) for k in range(1, 6)] == [True, False, True, False, True]
    assert grid.next_unit_point(100.5) == 101.0 and grid.next_unit_point(101.0) == 101.0
    assert grid.next_unit_point(101.5) == 102.0
    four = UnitGrid(0.0, 0.25, 4)
    assert [four.unit_tick(0.25 * k) for k in range(1, 9)] == [True, False, False, False] * 2
    assert four.next_unit_point(0.25) == 1.0 and four.next_unit_point(1.25) == 2.0
    one = UnitGrid(3.0, 1.0)
    assert all(one.unit_tick(3.0 + k) for k in range(1, 5)) and one.next_unit_point(5.0) == 5.0
    with pytest.raises(ValueError):
        UnitGrid(0.0, 0.0)
