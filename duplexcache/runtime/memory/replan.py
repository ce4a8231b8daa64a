"""The memory plan re-made from a measured warm-up (``engine.activation_from_warmup``, issue 43).

A warm-up (runtime/warmup.py) captures every graph at the plan's batch buckets and reads the
allocator's peak above the pools; this module turns that peak into the activation reserve of a
new plan, rebuilds the pools for it, and, when the reserve had to be estimated, has the next
warm-up check it (docs/engine.md, "Memory: the order of start-up").
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch

from duplexcache.runtime import engine_parts
from duplexcache.runtime.memory.admission import BudgetTooSmall, MemoryPlan

if TYPE_CHECKING:
    from duplexcache.runtime.engine import DuplexEngine
    from duplexcache.runtime.warmup import WarmupReport

logger = logging.getLogger(__name__)

# Re-plans from an estimated reserve (replan_after_warmup) a start-up may make before it serves with
# what it has: each is a whole warm-up, and the second is already measured at a batch the budget holds.
MAX_ESTIMATED_REPLANS = 3

# Added to the measured activation peak to make the re-planned reserve (engine.activation_margin
# until issue 44 retired it: no config ever set another value). Plan 2 holds more sessions than
# warm-up 1 measured, so its graph buckets and encoder batch are larger: the margin covers that
# difference, and warm-up 2 logs its own peak against the reserve so a short margin shows. The H100
# card runs of issue 43 served with 1 GiB (docs/results/HISTORY.md, "The whole card on an H100 before
# the arena change"); docs/engine.md, "Memory: the order of start-up".
ACTIVATION_MARGIN = 2**30


def activation_peak(engine: DuplexEngine) -> int | None:
    """Device memory reserved at the peak since the pools were built, less the pools: what the
    graphs, the warm-up's runs at the largest batch and the libraries needed beyond the plan's
    preallocated blocks (CUDA; called before the dynamic region is reserved). None off CUDA:
    host memory has no allocator peak to read, and the configured reserve stands."""
    device = engine.models.device
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device) - engine.reserved_before_pools
    return max(0, peak - engine.plan.thinker_bytes - engine.plan.talker_bytes)


def replan_after_warmup(engine: DuplexEngine, report: WarmupReport,
                        measured: list[tuple[int, int]] | None = None) -> bool:
    """Re-plan the pools from a measured warm-up (``engine.activation_from_warmup``). Returns
    True when the reserve is an estimate (see below) that the next warm-up must confirm.

    The order (docs/engine.md, "Memory: the order of start-up")::

        weights, fixed buffers          built, allocated
        plan 1                          engine.activation_reserve as written (an upper bound)
        pools 1, warm-up 1              measures the peak P above the pools
        release pools 1 and graphs      what stays held (Code2Wav/vocoder graph pools captured
                                        once, workspaces) is H: it is out of "free" now
        plan 2                          reserve = P - H + ACTIVATION_MARGIN; an auto budget =
                                        fixed + free - memory_headroom
        pools 2, warm-up 2              captures again at plan 2's batch buckets; its own peak is
                                        logged against the reserve

    Plan 2 holds more sessions than plan 1, so its graph buckets are larger: the margin covers
    the larger batches' activations (warm-up 2's peak is logged so a short margin shows).

    When P - H alone leaves the budget no session (a small preset under a fixed budget: plan 1
    sized for hundreds of sessions, so warm-up 1 captured graphs for batches that large), the
    peak was measured at a batch the budget cannot hold beside it. Then the reserve is scaled
    down with the batch: the peak as a line in the planned sessions (through the origin from one
    measurement; through the last two once ``measured``, the (sessions, peak) pairs of the
    earlier re-plans, holds another), for the most sessions whose plan, with that reserve,
    still holds them. That is an estimate, so the caller warms up again and, if that warm-up's
    own peak exceeds the reserve, re-plans from it (``replan_until_covered``)."""
    e = engine.deploy.engine
    assert report.activation_peak_bytes is not None
    device = engine.models.device
    base = engine.reserved_before_pools
    policy = engine.policy
    measured_at = max(1, engine.plan.planned_sessions)
    engine_parts.release_session_side(engine)
    held = (torch.cuda.memory_reserved(device) - base) if device.type == "cuda" else 0
    peak = max(0, report.activation_peak_bytes - max(0, held))
    headroom = e.memory_headroom if e.memory_budget == "auto" else 0
    plan_headroom = headroom if e.memory_budget == "auto" else None
    logger.info("re-plan after warm-up: peak %.2f GiB above the pools, %.2f GiB of it still held after releasing "
                "them; activation reserve %.2f GiB (+ a margin of %.2f GiB) instead of "
                "engine.activation_reserve %.2f GiB", report.activation_peak_bytes / 2**30, held / 2**30,
                peak / 2**30, ACTIVATION_MARGIN / 2**30, e.activation_reserve / 2**30)
    measured = [] if measured is None else measured
    measured.append((measured_at, peak))
    # the peak's line in the planned sessions: (n0, p0) = (0, 0) until a second measurement
    (n0, p0), (n1, p1) = (0, 0), (measured_at, peak)
    if len(measured) > 1 and measured[-2][0] != measured_at:
        (n0, p0) = measured[-2]

    def plan_for(sessions: int) -> tuple[int, MemoryPlan | None]:
        """The reserve for graph batches of ``sessions`` (on the peak's line), and its plan."""
        on_line = p1 + -(-(p1 - p0) * (sessions - n1) // (n1 - n0))    # rounded up
        reserve = max(0, min(on_line, max(p0, p1)) if sessions <= max(n0, n1) else on_line) + ACTIVATION_MARGIN
        try:
            return reserve, engine.sizing.plan(activation_reserve=reserve, headroom=plan_headroom)
        except BudgetTooSmall:
            return reserve, None

    reserve, plan = plan_for(measured_at)
    estimated = plan is None
    if estimated:
        # the most sessions n whose plan, with the reserve scaled to n, still holds n (more sessions
        # mean a larger reserve and so a smaller plan: the first n that fails ends the range)
        lo, hi = 0, measured_at - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            _, trial = plan_for(mid)
            if trial is not None and trial.planned_sessions >= mid:
                lo = mid
            else:
                hi = mid - 1
        if lo == 0:
            raise BudgetTooSmall(
                f"the warm-up's activation peak ({peak / 2**30:.2f} GiB above the pools at the graph batches of "
                f"{measured_at} planned sessions) leaves the budget no session, even scaled down to one "
                "session's batch; raise engine.memory_budget or use memory_budget: auto")
        # the reserve for lo + 1 sessions: its plan holds at most lo, so its batches are covered
        reserve, plan = plan_for(lo + 1)
        if plan is None:
            reserve, plan = plan_for(lo)
        logger.warning("re-plan: the measured peak (at graph batches for %d sessions) leaves the budget no session; "
                       "reserving its estimate for a plan of %d sessions (%.2f GiB with the margin), which the "
                       "next warm-up checks", measured_at, plan.planned_sessions, reserve / 2**30)
    engine.headroom_bytes = headroom   # the reserve is the plan's (plan.activation_reserve)
    engine._replanned = True
    engine_parts.build_session_side(engine, plan, policy, engine.faults)
    engine.recorder.refresh_pools()
    logger.info("re-planned: %s", plan.describe())
    return estimated


def replan_until_covered(engine: DuplexEngine, report: WarmupReport,
                         warm_up: Callable[[], WarmupReport]) -> WarmupReport:
    """Re-plan from ``report`` and warm up again (``warm_up``); returns the last warm-up's report.

    A measured re-plan is final (its margin covers the next warm-up); an estimated one is checked
    by the next warm-up, and re-planned from that peak if it ran over, at most
    ``MAX_ESTIMATED_REPLANS`` times."""
    measured: list[tuple[int, int]] = []
    for _ in range(MAX_ESTIMATED_REPLANS):
        estimated = replan_after_warmup(engine, report, measured)
        report = warm_up()
        if (not estimated or report.cancelled or report.activation_peak_bytes is None
                or report.activation_peak_bytes <= engine.activation_reserve):
            return report
    logger.warning("warm-up: after %d estimated re-plans the last warm-up's peak (%.2f GiB) still exceeds the "
                   "reserve (%.2f GiB); serving with that plan: raise engine.memory_budget", MAX_ESTIMATED_REPLANS,
                   report.activation_peak_bytes / 2**30, engine.activation_reserve / 2**30)
    return report
