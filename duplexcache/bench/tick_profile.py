"""Where a tick's time goes: a few engine ticks under ``torch.profiler`` (``bench ticks --profile-ticks``).

The engine runs each stage inside a profiler range (``runtime.engine.STAGE_RANGE`` + stage name),
and Code2Wav's batched step marks its parts (``cfm.code2wav.PART_RANGE`` + part). This module
only turns a finished profile into numbers per tick:

* per range: host time (CPU time inside the range, what Python and the launches cost) and device
  time (kernels launched inside it, CUDA graph replays included);
* the whole device's kernel time per tick next to the tick's wall clock: a tick whose kernels
  fill a small part of its wall is host-bound, and more GPU work per session is not the cure;
* the operators with the most device time and the most host time (self time, per tick);
* per range, the synchronising runtime calls (each one stops the host from queueing ahead), the
  launches, and the kernel time inside the range's span on the device (``range_breakdown``);
* the Python lines that synchronised during one more tick (``sync_sites``, CUDA only).

The profiler's own overhead inflates host time, so these tables say where time goes, not how
fast a tick is: the recorded ticks (no profiler) give the latency.
"""
from __future__ import annotations

import bisect
import collections
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from duplexcache.cfm.code2wav import PART_RANGE
from duplexcache.runtime.engine import STAGE_RANGE

RANGE_PREFIXES = (STAGE_RANGE, PART_RANGE)
# CUDA runtime calls that block the host until the device catches up, and those that launch work
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")


@dataclass(frozen=True)
class OpTime:
    name: str
    calls_per_tick: float
    host_ms_per_tick: float
    device_ms_per_tick: float

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "calls_per_tick": round(self.calls_per_tick, 2),
                "host_ms_per_tick": round(self.host_ms_per_tick, 3),
                "device_ms_per_tick": round(self.device_ms_per_tick, 3)}


def _self_device_us(ev: Any) -> float:
    return float(getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0.0))


def _device_us(ev: Any) -> float:
    return float(getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0))


def summarize_profile(averages: Iterable[Any], ticks: int, wall_s: list[float], top: int = 25) -> dict[str, Any]:
    """``averages``: ``prof.key_averages()`` (FunctionEventAvg-like: key, count, cpu_time_total,
    self_cpu_time_total, device_time_total, self_device_time_total, in microseconds)."""
    if ticks < 1:
        raise ValueError(f"ticks must be >= 1, got {ticks}")
    evs = list(averages)
    per = 1e-3 / ticks   # microseconds over all ticks -> ms per tick
    ranges = [OpTime(e.key, e.count / ticks, e.cpu_time_total * per, _device_us(e) * per)
              for e in evs if e.key.startswith(RANGE_PREFIXES)]
    ops = [OpTime(e.key, e.count / ticks, e.self_cpu_time_total * per, _self_device_us(e) * per)
           for e in evs if not e.key.startswith(RANGE_PREFIXES)]
    kernel_ms = sum(o.device_ms_per_tick for o in ops)
    wall_ms = 1e3 * sum(wall_s) / max(len(wall_s), 1)
    return {
        "ticks": ticks,
        "wall_ms_per_tick": round(wall_ms, 3),
        "device_ms_per_tick": round(kernel_ms, 3),
        "device_busy_fraction": round(kernel_ms / wall_ms, 3) if wall_ms else None,
        "ranges": [r.to_dict() for r in sorted(ranges, key=lambda r: r.name)],
        "top_device": [o.to_dict() for o in sorted(ops, key=lambda o: -o.device_ms_per_tick)[:top]],
        "top_host": [o.to_dict() for o in sorted(ops, key=lambda o: -o.host_ms_per_tick)[:top]],
    }


@dataclass(frozen=True)
class Span:
    """One timed event: a range instance, a kernel, a runtime call (microseconds)."""

    name: str
    start: float
    end: float
    on_device: bool


def _overlap(spans: list[Span], starts: list[float], lo: float, hi: float) -> float:
    """Microseconds of ``spans`` (sorted by start; ``starts`` their starts) inside [lo, hi]."""
    total, i = 0.0, max(bisect.bisect_left(starts, lo) - 1, 0)
    while i < len(spans) and spans[i].start < hi:
        total += max(0.0, min(spans[i].end, hi) - max(spans[i].start, lo))
        i += 1
    return total


def range_breakdown(spans: Iterable[Span], ticks: int) -> list[dict[str, Any]]:
    """Per profiler range, per tick: the host calls that wait for the device (syncs, and the ms
    they block), the launches (kernels, graphs, copies), the range's span on the device and the
    kernel time inside that span (busy < span: the device waited for the host)."""
    spans = list(spans)
    ranges = [s for s in spans if s.name.startswith(RANGE_PREFIXES)]
    kernels = sorted((s for s in spans if s.on_device and not s.name.startswith(RANGE_PREFIXES)),
                     key=lambda s: s.start)
    kstarts = [k.start for k in kernels]
    calls = sorted((s for s in spans if not s.on_device and s.name in SYNC_CALLS + LAUNCH_CALLS),
                   key=lambda s: s.start)
    cstarts = [c.start for c in calls]
    out: dict[str, dict[str, float]] = {}
    for r in ranges:
        row = out.setdefault(r.name, dict.fromkeys(("syncs", "sync_ms", "launches", "device_span_ms",
                                                    "kernel_ms"), 0.0))
        if r.on_device:
            row["device_span_ms"] += (r.end - r.start) / 1e3
            row["kernel_ms"] += _overlap(kernels, kstarts, r.start, r.end) / 1e3
            continue
        for c in calls[bisect.bisect_left(cstarts, r.start):bisect.bisect_right(cstarts, r.end)]:
            if c.name in SYNC_CALLS:
                row["syncs"] += 1
                row["sync_ms"] += (c.end - c.start) / 1e3
            else:
                row["launches"] += 1
    return [{"name": name, **{k: round(v / ticks, 3) for k, v in row.items()}} for name, row in sorted(out.items())]


def _spans(events: Iterable[Any]) -> list[Span]:
    return [Span(e.name, float(e.time_range.start), float(e.time_range.end), e.device_type != DeviceType.CPU)
            for e in events]


def sync_sites(run_tick: Callable[[], float], top: int = 20) -> list[dict[str, Any]]:
    """The Python lines that made the device synchronise during one tick (CUDA only), most
    frequent first: ``torch.cuda.set_sync_debug_mode`` warns at each synchronising call."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_tick()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = collections.Counter(f"{w.filename}:{w.lineno}" for w in caught
                                if "synchroniz" in str(w.message).lower())
    return [{"site": site, "syncs": n} for site, n in sites.most_common(top)]


def profiled_units(ticks: int, device: torch.device) -> int:
    """Units of audio ``profile_ticks`` consumes: the profiled ticks, plus the sync-sites tick on CUDA."""
    return ticks + (1 if ticks and device.type == "cuda" else 0)


def profile_ticks(run_tick: Callable[[], float], ticks: int, device: torch.device) -> dict[str, Any]:
    """Run ``run_tick`` (returns its wall seconds) ``ticks`` times under the profiler, then (on
    CUDA) one more tick with the sync debug mode on to name the lines that synchronise."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    walls: list[float] = []
    with profile(activities=activities) as prof:
        for _ in range(ticks):
            walls.append(run_tick())
    summary = summarize_profile(prof.key_averages(), ticks, walls)
    summary["range_breakdown"] = range_breakdown(_spans(prof.events()), ticks)
    summary["sync_sites"] = []
    if device.type == "cuda":
        try:
            summary["sync_sites"] = sync_sites(run_tick)
        except Exception as exc:  # noqa: BLE001 - the profile above stands without the sites
            summary["sync_sites_error"] = f"{type(exc).__name__}: {exc}"
    return summary


def profile_markdown(n: int, summary: dict[str, Any]) -> str:
    """The summary as markdown tables (results.md appends one block per session count)."""
    lines = [f"### Profile at {n} sessions ({summary['ticks']} ticks under torch.profiler)", "",
             f"wall {summary['wall_ms_per_tick']:.1f} ms per tick (profiler overhead included); kernels "
             f"{summary['device_ms_per_tick']:.1f} ms per tick (device busy "
             f"{summary['device_busy_fraction']})", "",
             "| range | calls/tick | host ms/tick | device ms/tick |", "|---|---:|---:|---:|"]
    lines += [f"| {r['name']} | {r['calls_per_tick']} | {r['host_ms_per_tick']:.1f} | {r['device_ms_per_tick']:.1f} |"
              for r in summary["ranges"]]
    if summary.get("range_breakdown"):
        lines += ["", "| range | syncs/tick | sync ms/tick | launches/tick | device span ms | kernel ms in span |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['name']} | {r['syncs']:.1f} | {r['sync_ms']:.1f} | {r['launches']:.0f} | "
                  f"{r['device_span_ms']:.1f} | {r['kernel_ms']:.1f} |" for r in summary["range_breakdown"]]
    if summary.get("sync_sites"):
        lines += ["", "lines that synchronised (one tick):", "", "| site | syncs |", "|---|---:|"]
        lines += [f"| `{x['site']}` | {x['syncs']} |" for x in summary["sync_sites"]]
    tables = (("top_device", "most device time (self)"), ("top_host", "most host time (self)"))
    if not summary["device_ms_per_tick"]:
        tables = tables[1:]   # no kernels were seen (CPU): a device ranking would be noise
    for key, title in tables:
        lines += ["", f"{title}:", "", "| op | calls/tick | host ms/tick | device ms/tick |", "|---|---:|---:|---:|"]
        lines += [f"| `{o['name'][:80]}` | {o['calls_per_tick']} | {o['host_ms_per_tick']:.2f} | "
                  f"{o['device_ms_per_tick']:.2f} |" for o in summary[key][:15]]
    return "\n".join(lines) + "\n"
