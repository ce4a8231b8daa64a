"""server/queue_wait.py: the queue's estimated_wait_s (p * mean session length / live sessions)."""
from __future__ import annotations

import pytest

from duplexcache.server.queue_wait import QueueWaitEstimate


def test_estimate_is_position_times_mean_length_over_live_sessions():
    est = QueueWaitEstimate(history=3)
    # nothing ended yet: the live sessions' mean age (a lower bound of their length)
    assert est.estimate(1, [10.0, 30.0]) == pytest.approx(10.0)    # 1 * 20 / 2
    assert est.estimate(3, [10.0, 30.0]) == pytest.approx(30.0)    # grows with the position
    for lived in (40.0, 60.0, 80.0, 100.0):   # the last 3 ended sessions: mean 80
        est.session_ended(lived)
    assert est.estimate(1, [1.0, 2.0, 3.0, 4.0]) == pytest.approx(20.0)   # 1 * 80 / 4
    assert est.estimate(2, [1.0, 2.0, 3.0, 4.0]) == pytest.approx(40.0)


def test_estimate_is_zero_with_nothing_live_and_never_negative():
    est = QueueWaitEstimate()
    assert est.estimate(1, []) == 0.0      # the next tick admits it
    est.session_ended(-5.0)                # a clock that stepped back counts as 0
    assert est.estimate(2, [0.0]) == 0.0
    assert isinstance(est.estimate(1, [3.0]), float)
