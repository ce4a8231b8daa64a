"""report.json, the terminal table, and a schema check for both (schema: docs/results/README.md).

Every number in the report comes from the runner's samples; nothing is estimated here except
the fitted ceiling, whose method the report states next to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from duplexcache.bench.common import hardware_info, write_results
from duplexcache.runtime.memory.floor import SessionFloor
from duplexcache.bench.memory import (
    MIB,
    SlopeFit,
    ceiling_from_fit,
    fit_slope,
    held_bytes,
    measured_ceiling,
    tiers_to_json,
)
from duplexcache.bench.runner import ConfigResult

SCHEMA_VERSION = 1
REALTIME_S = 1.0
CEILING_METHOD = (
    "largest n with intercept + n * slope <= available, from the least-squares fit of held bytes "
    "at steady state; available = {available}"
)
CONFIG_KEYS = ("name", "setup_slope_mib", "steady_slope_mib", "ceiling_sessions", "bytes_per_tier",
               "floor_mib", "equal_to_all_off")
TOP_KEYS = ("configs", "preset", "device", "hardware", "date")


@dataclass(frozen=True)
class RunMeta:
    """What the report says about the run besides the per-configuration numbers."""

    preset: str
    device: str
    target: str
    memory_source: str
    memory_budget: int
    activation_reserve: int
    weight_bytes: int
    floor: SessionFloor
    workload: dict[str, Any]
    realtime: bool = False
    # True: the budget is device memory for weights + sessions (--memory-budget, or the GPU's
    # total); False: it is the engine's engine.memory_budget, which excludes the weights.
    budget_includes_weights: bool = True

    @property
    def available_bytes(self) -> int:
        weights = self.weight_bytes if self.budget_includes_weights else 0
        return self.memory_budget - weights - self.activation_reserve

    @property
    def available_formula(self) -> str:
        if self.budget_includes_weights:
            return "memory_budget - weight_bytes - activation_reserve"
        return "engine.memory_budget - activation_reserve (engine.memory_budget excludes the weights)"


def _tick_stats(ticks: Sequence[float]) -> dict[str, float]:
    s = sorted(ticks)
    return {"median": s[len(s) // 2], "min": s[0], "max": s[-1], "count": len(s)}


def _config_entry(res: ConfigResult, meta: RunMeta) -> dict[str, Any]:
    ns = [p.sessions for p in res.points]
    setup_held = [held_bytes(p.setup) for p in res.points]
    steady_held = [held_bytes(p.steady) for p in res.points]
    setup_fit, steady_fit = fit_slope(ns, setup_held), fit_slope(ns, steady_held)
    available = meta.available_bytes
    # Ticks after the first (the first one also sets up the voice), per session count.
    later_max = [max(p.tick_s[1:]) if len(p.tick_s) > 1 else p.tick_s[0] for p in res.points]
    floor_mib = meta.floor.total / MIB
    largest = res.points[-1]
    entry: dict[str, Any] = {
        "name": res.config.name,
        "switches_on": list(res.config.switches_on),
        "setup_slope_mib": round(setup_fit.slope_mib, 6),
        "steady_slope_mib": round(steady_fit.slope_mib, 6),
        "setup_fit": setup_fit.to_json(),
        "steady_fit": steady_fit.to_json(),
        "ceiling_sessions": _safe_ceiling(steady_fit, available),
        "ceiling_measured_sessions": measured_ceiling(ns, steady_held, available),
        "ceiling_realtime_sessions": (measured_ceiling(ns, steady_held, available, later_max, REALTIME_S)
                                      if meta.realtime else None),
        "bytes_per_tier": {"sessions": largest.sessions, "setup": tiers_to_json(largest.setup),
                           "steady": tiers_to_json(largest.steady)},
        "floor_mib": round(floor_mib, 6),
        "measured_over_floor": round(steady_fit.slope_mib / floor_mib, 4) if floor_mib else None,
        "equal_to_all_off": res.equal_to_all_off,
        "equality": "PASS" if res.equal_to_all_off else "FAIL",
        "mismatches": res.mismatches[:20],
        "points": [{
            "sessions": p.sessions,
            "setup_held_bytes": sh, "steady_held_bytes": st,
            "setup": tiers_to_json(p.setup), "steady": tiers_to_json(p.steady),
            "tick_s": _tick_stats(p.tick_s), "cuda": p.cuda,
        } for p, sh, st in zip(res.points, setup_held, steady_held)],
    }
    if all(p.cuda is not None for p in res.points):
        entry["cuda_steady_peak_slope_mib"] = fit_slope(
            ns, [p.cuda["steady"]["peak_allocated_delta"] for p in res.points]).to_json()
        entry["cuda_steady_reserved_slope_mib"] = fit_slope(
            ns, [p.cuda["steady"]["reserved_delta"] for p in res.points]).to_json()
    return entry


def _safe_ceiling(fit: SlopeFit, available: int) -> int | None:
    try:
        return ceiling_from_fit(fit, available)
    except ValueError:
        return None


def build_report(results: Sequence[ConfigResult], meta: RunMeta) -> dict[str, Any]:
    configs = [_config_entry(r, meta) for r in results]
    sessions = [p.sessions for p in results[0].points] if results else []
    return {
        "schema_version": SCHEMA_VERSION,
        "preset": meta.preset,
        "device": meta.device,
        "hardware": hardware_info(meta.device),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "target": meta.target,
        "memory_source": meta.memory_source,
        "sessions": sessions,
        "repeat_count": max(0, len(sessions) - 1),
        "repeat_note": ("each slope is a least-squares fit over all session counts; its spread is the "
                        "min/max of the per-step increments, so repeats = number of steps"),
        "memory_budget_bytes": meta.memory_budget,
        "activation_reserve_bytes": meta.activation_reserve,
        "weight_bytes": meta.weight_bytes,
        "available_bytes": meta.available_bytes,
        "ceiling_method": CEILING_METHOD.format(available=meta.available_formula),
        "budget_includes_weights": meta.budget_includes_weights,
        "floor": {**meta.floor.to_json(), "mib": round(meta.floor.total / MIB, 6)},
        "workload": meta.workload,
        "all_equal": all(c["equal_to_all_off"] for c in configs),
        "configs": configs,
    }


def validate_report(report: dict[str, Any]) -> None:
    """Raise ValueError naming the first missing or mistyped field of the documented schema."""
    for key in TOP_KEYS:
        if key not in report:
            raise ValueError(f"report.json: missing top-level key {key!r}")
    if not isinstance(report["configs"], list) or not report["configs"]:
        raise ValueError("report.json: 'configs' must be a non-empty list")
    for i, c in enumerate(report["configs"]):
        for key in CONFIG_KEYS:
            if key not in c:
                raise ValueError(f"report.json: configs[{i}] lacks {key!r}")
        if not isinstance(c["equal_to_all_off"], bool):
            raise ValueError(f"report.json: configs[{i}].equal_to_all_off must be true/false")
        for key in ("setup_slope_mib", "steady_slope_mib", "floor_mib"):
            if not isinstance(c[key], (int, float)):
                raise ValueError(f"report.json: configs[{i}].{key} must be a number")
    wf = report.get("waterfall")   # optional: the engine target writes it unless --no-waterfall
    if wf is not None:
        for key in ("device", "total_bytes", "parts", "parts_sum_bytes", "admitted", "floor_limited",
                    "admitted_over_floor_limited"):
            if key not in wf:
                raise ValueError(f"report.json: waterfall lacks {key!r}")
        if sum(p["bytes"] for p in wf["parts"]) != wf["total_bytes"]:
            raise ValueError("report.json: the waterfall's parts do not add up to its total_bytes")


def format_table(report: dict[str, Any]) -> str:
    """The terminal table: one row per configuration."""
    head = (f"{'configuration':<32} {'setup MiB/sess':>14} {'steady MiB/sess':>15} {'(step min..max)':>19} "
            f"{'meas/floor':>10} {'ceiling':>8} {'equal':>6}")
    title = (f"duplexcache bench: preset {report['preset']}, device {report['device']}, target "
             f"{report['target']}, sessions {report['sessions']}; memory: {report['memory_source']}")
    budget = (f"floor {report['floor']['mib']:.3f} MiB/session; available "
              f"{report['available_bytes'] / MIB:.1f} MiB; repeats per slope {report['repeat_count']}")
    lines = [title, budget, head, "-" * len(head)]
    for c in report["configs"]:
        fit = c["steady_fit"]
        spread = f"{fit['step_min_mib']:.3f}..{fit['step_max_mib']:.3f}"
        ratio = "-" if c["measured_over_floor"] is None else f"{c['measured_over_floor']:.2f}"
        ceiling = "-" if c["ceiling_sessions"] is None else str(c["ceiling_sessions"])
        lines.append(f"{c['name']:<32} {c['setup_slope_mib']:>14.3f} {c['steady_slope_mib']:>15.3f} "
                     f"{spread:>19} {ratio:>10} {ceiling:>8} {c['equality']:>6}")
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: Path) -> Path:
    validate_report(report)
    return write_results(out_dir, report, stem="report")
