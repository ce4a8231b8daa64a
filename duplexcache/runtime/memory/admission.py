"""One memory budget for every per-session cache, and admission against it.

The budget (``engine.memory_budget - engine.activation_reserve``; weights live outside it) is
split once, at start-up, into::

    budget = fixed                       Code2Wav arena + the two null blocks + voice prompts
                                         + the vocoder copy without weight norm
           + Thinker KV pool             preallocated blocks (shared anchors + private windows)
           + Talker KV pool              preallocated blocks (one full turn per session)
           + dynamic region              Code2Wav session caches + audio-encoder caches
                                         (+ per-voice prompt states when shared)

The split is sized for the *reference session* of each voice (empty instructions, that voice's
reference audio): ``n = (budget - fixed - shared parts) // per-session worst case`` sessions fit,
and each pool gets ``n`` sessions' worth plus the shared parts of every voice's context once.

Admission is a ledger over the same numbers. A session reserves its worst case at admission:

* Thinker: its private blocks at a full window (``context + high_tokens`` with the session's
  own high mark -- a client may lower it --, or the model's position limit with the window
  off) and, when ``shared_anchor_blocks`` is on, the shared context blocks + copy-on-write
  template -- paid once per distinct context (by anchor key). The block counts come from
  ``runtime.stage0.session_worst_case``, the formula ``Stage0Runner.worst_case`` uses, so the
  ledger and the runner cannot disagree;
* Talker: one full turn (``engine.talker_turn_tokens``, by default the Talker's
  ``max_position_embeddings`` tokens), as a count: blocks are taken as tokens arrive;
* dynamic: its steady Code2Wav caches and its audio-encoder cache, plus the voice's prompt state
  -- paid once per voice when ``cfm_prompt_att_sharing`` is on.

``refusal(fp)`` asks ("can I?") and names the numbers; ``admit`` only asserts. Because every
live session stays within its reservation and the pools hold the reservations, the mutating
pool calls in the engine can only assert: there is no out-of-memory path.
"""

from __future__ import annotations

from collections import deque

import logging
import math
from collections import Counter
from dataclasses import dataclass

from duplexcache.config import BudgetError, format_bytes

logger = logging.getLogger(__name__)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


@dataclass(frozen=True)
class Footprint:
    """Worst-case memory of one session: what it owns and what it may share."""

    thinker_private_blocks: int
    thinker_shared_blocks: int     # full context blocks + template; 0 unless anchors are shared
    context_key: bytes | None      # names the shared anchor (None when nothing is shared)
    talker_blocks: int
    dynamic_private_bytes: int     # Code2Wav caches + audio-encoder cache
    voice: str
    voice_shared_bytes: int        # the voice's prompt state; 0 unless prompt sharing is on

    def __post_init__(self) -> None:
        for name in ("thinker_private_blocks", "thinker_shared_blocks", "talker_blocks",
                     "dynamic_private_bytes", "voice_shared_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"Footprint.{name} must be >= 0, got {getattr(self, name)}")
        if self.thinker_shared_blocks and self.context_key is None:
            raise ValueError("a footprint with shared Thinker blocks needs a context_key")


@dataclass(frozen=True)
class MemoryPlan:
    """How the budget is split (bytes and block counts; pool block counts include the null block)."""

    budget_bytes: int
    fixed_bytes: int
    thinker_blocks: int
    thinker_block_bytes: int
    talker_blocks: int
    talker_block_bytes: int
    dynamic_bytes: int
    planned_sessions: int
    # What was set aside for activations before the split (``budget_bytes`` is the budget less
    # it): ``engine.activation_reserve``, or the reserve a re-plan measured (memory/replan.py).
    activation_reserve: int = 0

    @property
    def thinker_bytes(self) -> int:
        return self.thinker_blocks * self.thinker_block_bytes

    @property
    def talker_bytes(self) -> int:
        return self.talker_blocks * self.talker_block_bytes

    def describe(self) -> str:
        return (f"budget {format_bytes(self.budget_bytes)}: fixed {_mib(self.fixed_bytes)}, Thinker KV "
                f"{self.thinker_blocks} blocks ({_mib(self.thinker_bytes)}), Talker KV {self.talker_blocks} "
                f"blocks ({_mib(self.talker_bytes)}), dynamic {_mib(self.dynamic_bytes)}; sized for "
                f"{self.planned_sessions} reference sessions")


class BudgetTooSmall(BudgetError):
    """The budget cannot hold even one reference session."""


def plan_memory(budget_bytes: int, fixed_bytes: int, references: list[Footprint],
                thinker_block_bytes: int, talker_block_bytes: int) -> MemoryPlan:
    """Split ``budget_bytes`` for the reference sessions (one per voice), see the module docstring."""
    if not references:
        raise ValueError("plan_memory needs at least one reference footprint")
    contexts = {fp.context_key: fp.thinker_shared_blocks for fp in references if fp.thinker_shared_blocks}
    voices = {fp.voice: fp.voice_shared_bytes for fp in references}
    shared_blocks = sum(contexts.values())
    shared_bytes = shared_blocks * thinker_block_bytes + sum(voices.values())
    tp = max(fp.thinker_private_blocks for fp in references)
    tk = max(fp.talker_blocks for fp in references)
    dyn = max(fp.dynamic_private_bytes for fp in references)
    per_session = tp * thinker_block_bytes + tk * talker_block_bytes + dyn
    nulls = thinker_block_bytes + talker_block_bytes
    room = budget_bytes - fixed_bytes - nulls - shared_bytes
    n = room // per_session if per_session > 0 else 0
    if n < 1:
        raise BudgetTooSmall(
            f"memory budget of {_mib(budget_bytes)} cannot hold one session: fixed {_mib(fixed_bytes)} "
            f"+ null blocks {_mib(nulls)} + shared context/voice state {_mib(shared_bytes)} + one session's "
            f"worst case {_mib(per_session)} (Thinker {tp} blocks, Talker {tk} blocks, Code2Wav+encoder "
            f"{_mib(dyn)}) = {_mib(fixed_bytes + nulls + shared_bytes + per_session)}")
    thinker_blocks = 1 + n * tp + shared_blocks
    talker_blocks = 1 + n * tk
    dynamic = budget_bytes - fixed_bytes - thinker_blocks * thinker_block_bytes - talker_blocks * talker_block_bytes
    assert dynamic >= n * dyn + sum(voices.values()), "plan leaves the dynamic region short"
    return MemoryPlan(budget_bytes, fixed_bytes, thinker_blocks, thinker_block_bytes, talker_blocks,
                      talker_block_bytes, dynamic, n)


class AdmissionLedger:
    """Reservations of the admitted sessions against a :class:`MemoryPlan`."""

    def __init__(self, plan: MemoryPlan) -> None:
        self.plan = plan
        self.thinker_capacity = plan.thinker_blocks - 1   # the null block is never handed out
        self.talker_capacity = plan.talker_blocks - 1
        self.dynamic_capacity = plan.dynamic_bytes
        self._sessions: dict[str, Footprint] = {}
        self._contexts: Counter[bytes] = Counter()
        self._voices: Counter[str] = Counter()
        self.thinker_reserved = 0
        self.talker_reserved = 0
        self.dynamic_reserved = 0

    def __contains__(self, sid: object) -> bool:
        return sid in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def cost(self, fp: Footprint) -> tuple[int, int, int]:
        """(Thinker blocks, Talker blocks, dynamic bytes) admitting ``fp`` now would reserve:
        shared parts already paid by a live session of the same context/voice are free."""
        thinker = fp.thinker_private_blocks
        if fp.thinker_shared_blocks and self._contexts[fp.context_key] == 0:
            thinker += fp.thinker_shared_blocks
        dynamic = fp.dynamic_private_bytes
        if fp.voice_shared_bytes and self._voices[fp.voice] == 0:
            dynamic += fp.voice_shared_bytes
        return thinker, fp.talker_blocks, dynamic

    def refusal(self, fp: Footprint) -> str | None:
        """Why ``fp`` cannot be admitted now (every short pool, with numbers), or None."""
        thinker, talker, dynamic = self.cost(fp)
        problems = []
        if self.thinker_reserved + thinker > self.thinker_capacity:
            problems.append(
                f"Thinker KV needs {thinker} blocks ({_mib(thinker * self.plan.thinker_block_bytes)}) but only "
                f"{self.thinker_capacity - self.thinker_reserved} of {self.thinker_capacity} are unreserved")
        if self.talker_reserved + talker > self.talker_capacity:
            problems.append(
                f"Talker KV needs {talker} blocks ({_mib(talker * self.plan.talker_block_bytes)}) but only "
                f"{self.talker_capacity - self.talker_reserved} of {self.talker_capacity} are unreserved")
        if self.dynamic_reserved + dynamic > self.dynamic_capacity:
            problems.append(
                f"Code2Wav/encoder caches need {_mib(dynamic)} but only "
                f"{_mib(self.dynamic_capacity - self.dynamic_reserved)} of {_mib(self.dynamic_capacity)} are unreserved")
        if not problems:
            return None
        return (f"memory budget full ({len(self._sessions)} live sessions, budget "
                f"{format_bytes(self.plan.budget_bytes)}): " + "; ".join(problems))

    def admit(self, sid: str, fp: Footprint) -> None:
        assert sid not in self._sessions, f"session {sid} admitted twice"
        reason = self.refusal(fp)
        assert reason is None, f"admit() without a passing refusal() check: {reason}"
        thinker, talker, dynamic = self.cost(fp)
        self.thinker_reserved += thinker
        self.talker_reserved += talker
        self.dynamic_reserved += dynamic
        if fp.thinker_shared_blocks:
            self._contexts[fp.context_key] += 1
        if fp.voice_shared_bytes:
            self._voices[fp.voice] += 1
        self._sessions[sid] = fp

    def release(self, sid: str) -> None:
        """Give back ``sid``'s reservation (the last session of a context/voice frees its shared part)."""
        fp = self._sessions.pop(sid, None)
        if fp is None:
            raise ValueError(f"session {sid!r} holds no reservation")
        self.thinker_reserved -= fp.thinker_private_blocks
        self.talker_reserved -= fp.talker_blocks
        self.dynamic_reserved -= fp.dynamic_private_bytes
        if fp.thinker_shared_blocks:
            self._contexts[fp.context_key] -= 1
            if self._contexts[fp.context_key] == 0:
                del self._contexts[fp.context_key]
                self.thinker_reserved -= fp.thinker_shared_blocks
        if fp.voice_shared_bytes:
            self._voices[fp.voice] -= 1
            if self._voices[fp.voice] == 0:
                del self._voices[fp.voice]
                self.dynamic_reserved -= fp.voice_shared_bytes
        assert min(self.thinker_reserved, self.talker_reserved, self.dynamic_reserved) >= 0, "negative reservation"


class TickCostModel:
    """Admission by time: the tick cost as a line in the number of units it runs.

    After every tick the engine reports the time of its unit work (the tick less the context
    prefill, which is bounded separately by ``engine.prefill_chunk_tokens``) and how many units
    ran. Over the last ``window`` ticks that ran units, a least-squares line::

        predicted(n) = fixed + per_unit * n

    On a GPU a batched tick has a large part that does not grow with the batch (launches, graph
    replays, the Code2Wav solve of a tier): at minicpmo45 shapes 32 sessions tick in ~700 ms and
    each further one adds ~20 ms, so a line through the origin (tick / units) read from the first
    ticks of a few sessions predicts ~70 ms per session and refuses the eleventh caller of a card
    that runs 32 in real time (seen twice on an H200, docs/results/HISTORY.md). A slope is therefore
    trusted only when the ticks seen span at least ``MIN_SPAN_UNITS`` unit counts (a slope read
    from neighbouring counts is mostly noise times a long lever) and it is positive. Until then,
    and when the fitted slope is <= 0, the prediction is flat: the mean tick at the largest unit
    count seen (``per_unit`` 0), so a session is refused only when measured ticks already run
    over the limit, never on an extrapolation the data cannot support.

    One more session is admitted while ``predicted(live + 1) <= tick_seconds * tick_headroom``
    (every live session may run a unit in one tick). Before the first tick with units there is
    no measurement and admission is by memory only.

    A server that ticks ``scheduler.tick_phases`` times per unit keeps every session's units on
    the unit tick (the ticks between take only the early closes that fit before the next one:
    scheduler/core.py ``Scheduler.tick_has_room``), so the test stays one unit tick of every
    session against one unit's time.
    """

    MIN_SPAN_UNITS = 4

    def __init__(self, tick_seconds: float, headroom: float, window: int = 128) -> None:
        if tick_seconds <= 0 or headroom <= 0 or window < 2:
            raise ValueError(f"TickCostModel: tick_seconds {tick_seconds} and headroom {headroom} must be > 0 "
                             f"and window {window} >= 2")
        self.limit_s = tick_seconds * headroom   # what one tick of every session may take
        self._points: deque[tuple[int, float]] = deque(maxlen=window)   # (units, seconds)
        self.fixed_s = 0.0
        self.per_unit_s: float | None = None
        self.samples = 0          # ticks with units seen

    def observe(self, tick_s: float, units: int) -> None:
        """One tick's unit-work time and its unit count.

        Idle ticks are not points of the line: a tick without units skips every stage, so it
        costs ~0 where one unit already pays the whole fixed part; with them the intercept would
        be pulled to 0 (the line through the origin again). Nor do they take room in the window:
        a server idle for ``window`` seconds would forget every measurement, and the first ticks
        of the next burst (a few neighbouring unit counts) would be its whole model, flat at
        their mean. The line measured before a quiet spell stays."""
        if units <= 0:
            return
        self._points.append((units, max(0.0, tick_s)))
        self.samples += 1
        self._fit()

    def _fit(self) -> None:
        points = list(self._points)
        xs = [n for n, _ in points]
        if max(xs) - min(xs) >= self.MIN_SPAN_UNITS:
            mx = sum(xs) / len(xs)
            my = sum(t for _, t in points) / len(points)
            sxx = sum((n - mx) ** 2 for n in xs)
            slope = sum((n - mx) * (t - my) for n, t in points) / sxx
            if slope > 0:
                self.per_unit_s, self.fixed_s = slope, max(0.0, my - slope * mx)
                return
        top = max(xs)
        at_top = [t for n, t in points if n == top]
        self.per_unit_s, self.fixed_s = 0.0, sum(at_top) / len(at_top)

    def predicted_s(self, sessions: float) -> float | None:
        """The predicted tick with ``sessions`` units, None before any measurement."""
        if self.per_unit_s is None:
            return None
        return self.fixed_s + self.per_unit_s * sessions

    def refusal(self, live_sessions: int) -> str | None:
        """Why one more session would make the tick late (numbers for the log), or None. The
        first session is always admitted: with nobody live there is no one to protect."""
        if live_sessions == 0:
            return None
        units = live_sessions + 1
        predicted = self.predicted_s(units)
        if predicted is None or predicted <= self.limit_s:
            return None
        return (f"predicted tick {predicted * 1e3:.1f} ms with {units} sessions' units "
                f"(fixed {self.fixed_s * 1e3:.1f} ms + {self.per_unit_s * 1e3:.1f} ms per session) exceeds "  # type: ignore[operator]
                f"tick_seconds x tick_headroom = {self.limit_s * 1e3:.1f} ms")


@dataclass(frozen=True)
class Headroom:
    """How many more reference sessions an engine could admit now, and what limits it."""

    sessions: int
    limit: str               # "memory" or "compute"


def headroom(plan: MemoryPlan, tick_cost: TickCostModel, live_sessions: int) -> Headroom:
    """Free reference-session slots: the plan's count less the live sessions (each reserves at
    most a reference session's worst case), or fewer when the measured tick cost says so."""
    memory = max(0, plan.planned_sessions - live_sessions)
    if tick_cost.per_unit_s is None or live_sessions == 0:
        return Headroom(memory, "memory")
    if tick_cost.per_unit_s == 0:   # a flat prediction: room while the measured tick fits
        compute = memory if tick_cost.fixed_s <= tick_cost.limit_s else 0
    else:
        # n sessions fit while fixed + per_unit * n <= limit. The fitted line is float
        # arithmetic: 0.7 / 0.1 must count 7 sessions, not 6.999...
        fits = math.floor((tick_cost.limit_s - tick_cost.fixed_s) / tick_cost.per_unit_s + 1e-6)
        compute = max(0, fits - live_sessions)
    return Headroom(compute, "compute") if compute < memory else Headroom(memory, "memory")
