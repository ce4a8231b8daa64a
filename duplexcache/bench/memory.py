"""Memory arithmetic of the bench: held bytes per tier, slope fits with spread, the ceiling.

"Held" memory of a configuration = the bytes actually held for sessions: used blocks of the KV
pools (private + shared, each shared block counted once), Code2Wav private state + shared
prompt state (counted once), encoder caches, context-cache entries and the Stage-2 arena.
Free pool blocks are preallocated capacity, not memory a session costs, so they are left out.

Slope: an ordinary least-squares line through (sessions, held bytes) over every session count
of the sweep, plus the min/max of the per-step increments ``(b[i+1]-b[i]) / (n[i+1]-n[i])``;
each step is one repeat of the slope measurement, so the repeat count is ``len(counts) - 1``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

MIB = 2**20


@dataclass(frozen=True)
class Tier:
    """Bytes of one component by tier (``shared`` counted once)."""

    shared: int
    private: int
    free: int = 0

    def __post_init__(self) -> None:
        for name in ("shared", "private", "free"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"Tier.{name} must be a non-negative int, got {value!r}")

    @property
    def held(self) -> int:
        return self.shared + self.private


def held_bytes(pools: Mapping[str, Tier]) -> int:
    """Shared + private bytes over every pool (free capacity excluded)."""
    return sum(t.held for t in pools.values())


def tiers_to_json(pools: Mapping[str, Tier]) -> dict[str, dict[str, int]]:
    return {name: asdict(t) for name, t in sorted(pools.items())}


@dataclass(frozen=True)
class SlopeFit:
    """MiB per additional session, with its spread."""

    slope_mib: float          # least-squares slope
    intercept_mib: float      # least-squares intercept (fixed bytes at 0 sessions)
    step_min_mib: float       # smallest per-step increment
    step_max_mib: float       # largest per-step increment
    repeats: int              # number of per-step increments (len(counts) - 1)
    max_residual_mib: float   # largest |measured - fitted| over the sweep

    def to_json(self) -> dict[str, float | int]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def fit_slope(sessions: Sequence[int], held: Sequence[int]) -> SlopeFit:
    """Least-squares slope of held bytes vs session count (needs >= 2 distinct counts)."""
    if len(sessions) != len(held):
        raise ValueError(f"{len(sessions)} session counts but {len(held)} byte samples")
    pairs = sorted(zip(sessions, held))
    xs = [float(n) for n, _ in pairs]
    ys = [b / MIB for _, b in pairs]
    if len(set(xs)) < 2:
        raise ValueError(f"a slope needs at least two distinct session counts, got {list(sessions)}")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    steps = [(ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) for i in range(len(xs) - 1) if xs[i + 1] != xs[i]]
    resid = max(abs(y - (intercept + slope * x)) for x, y in zip(xs, ys))
    return SlopeFit(slope, intercept, min(steps), max(steps), len(steps), resid)


def ceiling_from_fit(fit: SlopeFit, available_bytes: int) -> int:
    """Largest n with ``intercept + n * slope <= available`` (the fitted steady line).

    ``available = memory budget - weights - activation reserve``. A non-positive slope means
    memory does not limit the count; that is a broken measurement, so it raises.
    """
    if fit.slope_mib <= 0:
        raise ValueError(f"steady slope {fit.slope_mib} MiB/session is not positive; no ceiling")
    room = available_bytes / MIB - fit.intercept_mib
    return max(0, int(room // fit.slope_mib))


def measured_ceiling(sessions: Sequence[int], held: Sequence[int], available_bytes: int,
                     tick_max_s: Sequence[float] | None = None, realtime_s: float | None = None) -> int:
    """Largest MEASURED session count whose held bytes fit ``available_bytes`` (and, when
    ``realtime_s`` is given, whose slowest tick stayed under it); 0 if none did."""
    best = 0
    for i, (n, b) in enumerate(zip(sessions, held)):
        fits = b <= available_bytes
        if realtime_s is not None and tick_max_s is not None:
            fits = fits and tick_max_s[i] < realtime_s
        if fits:
            best = max(best, n)
    return best
