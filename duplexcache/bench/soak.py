"""``duplexcache bench soak``: long calls over the wire, recorded over time (issue 46).

How it measures and what its figures mean: docs/bench_methods.md, "duplexcache bench soak".
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from duplexcache.bench import workload as wl
from duplexcache.bench.common import argv_after, hardware_line, write_results
from duplexcache.bench.plot import pyplot
from duplexcache.bench.serve import (INSTRUCTIONS, SERVE_WORKLOADS, ServerUnreachable, auth_headers, http_base,
                                     percentiles, wait_ready)
from duplexcache.bench.serve_client import Caller, SessionTrace, Wire, pair_replies, session_row, split_replies

logger = logging.getLogger(__name__)

MAX_SESSIONS = 1024
MAX_DURATION_S = 4 * 3600.0
GiB = 2**30
# The figures compared between the first and the last interval (flat = within noise).
COMPARED = ("reply_latency_p50_s", "reply_latency_p99_s", "late_ticks", "memory_bytes", "held_bytes")


def _positive(kind: type, name: str, upper: float):
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} wants a number, got {text!r}") from None
        if not 0 < value <= upper:
            raise argparse.ArgumentTypeError(f"{name} must be in (0, {upper:g}], got {text}")
        return value
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True,
                        help="the server's realtime WebSocket, e.g. ws://127.0.0.1:8000/v1/realtime")
    parser.add_argument("--sessions", type=_positive(int, "--sessions", MAX_SESSIONS), default=8,
                        help="concurrent callers, each for the whole soak")
    parser.add_argument("--duration", type=_positive(float, "--duration", MAX_DURATION_S), default=540.0,
                        help="seconds of audio each caller streams")
    parser.add_argument("--interval", type=_positive(float, "--interval", 3600), default=30.0,
                        help="seconds per recorded row")
    parser.add_argument("--window-high", type=_positive(int, "--window-high", 1 << 20), default=None,
                        help="the window high mark each caller asks for (session.update window.high_tokens); "
                             "unset: the server's")
    parser.add_argument("--window-low", type=_positive(int, "--window-low", 1 << 20), default=None,
                        help="its low mark (window.low_tokens; default: half the high mark)")
    parser.add_argument("--workload", choices=SERVE_WORKLOADS, default="conversation")
    parser.add_argument("--ramp", type=float, default=5.0, help="seconds over which the callers connect")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--voices", default="default,alt", help="comma list of server voices the callers use in turn")
    parser.add_argument("--reply-min-units", type=int, default=wl.ConversationShape.reply_min_units,
                        help="must equal the server's engine.speak_policy.reply_min_units")
    parser.add_argument("--reply-max-units", type=int, default=wl.ConversationShape.reply_max_units,
                        help="must equal the server's engine.speak_policy.reply_max_units")
    parser.add_argument("--max-reply-latency", type=float, default=3.0,
                        help="drawn on the plot as the reply-latency limit (seconds)")
    parser.add_argument("--ready-timeout", type=float, default=600.0,
                        help="seconds to wait for a server still warming up")
    parser.add_argument("--hardware", default=None, help="hardware line for the report")
    parser.add_argument("--out", type=Path, default=Path("bench-soak-out"))


# ------------------------------------------------------------------------------ callers

def windowed_wire(window: dict[str, int]) -> type:
    """The OpenAI wire (serve_client.Wire) whose ``session.update`` also sets the Thinker window."""

    class WindowedWire(Wire):
        @staticmethod
        def session_update(voice: str, instructions: str) -> str:
            event = json.loads(Wire.session_update(voice, instructions))
            event["session"]["window"] = dict(window)
            return json.dumps(event)

    return WindowedWire


@dataclass(frozen=True)
class SoakCaller(Caller):
    """A ``bench serve`` caller that asks for its own Thinker window (``window``: (key, tokens) pairs)."""

    window: tuple[tuple[str, int], ...] = ()

    @property
    def wire(self) -> Any:
        return windowed_wire(dict(self.window)) if self.window else super().wire


def requested_window(args: argparse.Namespace) -> dict[str, int]:
    """The window each caller sends (empty: the server's own); ValueError naming the option."""
    if args.window_high is None:
        if args.window_low is not None:
            raise ValueError("--window-low needs --window-high")
        return {}
    low = args.window_low if args.window_low is not None else max(1, args.window_high // 2)
    if low >= args.window_high:
        raise ValueError(f"--window-low ({low}) must be below --window-high ({args.window_high})")
    return {"high_tokens": args.window_high, "low_tokens": low}


def make_callers(args: argparse.Namespace) -> list[SoakCaller]:
    shape = wl.ConversationShape(reply_min_units=args.reply_min_units, reply_max_units=args.reply_max_units)
    names = [v.strip() for v in args.voices.split(",") if v.strip()]
    voices = wl.pick_voices(args.sessions, names, args.seed)
    window = tuple(requested_window(args).items())
    n = args.sessions
    return [SoakCaller(i, voices[i], args.workload, max(1, int(args.duration)), args.seed, shape, INSTRUCTIONS,
                       start_delay_s=args.ramp * i / max(1, n - 1) if n > 1 else 0.0, window=window)
            for i in range(n)]


# ------------------------------------------------------------------------------ the server's figures

def server_figures(metrics_text: str) -> dict[str, Any]:
    """What a row takes from one ``/metrics`` read: late ticks and compactions (cumulative), live
    sessions, bytes held per pool (shared + private) and memory in use by kind."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {"late_ticks": None, "compactions": None, "live_sessions": None, "pools": {}, "memory": {}}
    for family in text_string_to_metric_families(metrics_text):
        name = family.name.removeprefix("duplexcache_")
        for s in family.samples:
            if name == "late_ticks" and s.name.endswith("_total"):
                out["late_ticks"] = s.value
            elif name == "window_compactions" and s.name.endswith("_total"):
                out["compactions"] = s.value
            elif name == "live_sessions":
                out["live_sessions"] = s.value
            elif name == "bytes" and s.labels.get("tier") in ("shared", "private"):
                pool = s.labels.get("pool", "?")
                out["pools"][pool] = out["pools"].get(pool, 0.0) + s.value
            elif name == "memory_in_use_bytes":
                out["memory"][s.labels.get("kind", "?")] = s.value
    return out


def memory_of(figures: dict[str, Any]) -> float | None:
    """The memory figure plotted: the card's used bytes on CUDA, else the resident set."""
    memory = figures["memory"]
    return memory.get("device_used", memory.get("resident"))


async def read_metrics(client: Any, base: str) -> dict[str, Any] | None:
    try:
        response = await client.get(base + "/metrics", timeout=10.0)
        response.raise_for_status()
        return server_figures(response.text)
    except Exception as exc:  # noqa: BLE001 - a missed read is a gap in the row, not a failed soak
        logger.warning("could not read %s/metrics: %s", base, exc)
        return None


# ------------------------------------------------------------------------------ rows

def reply_starts(trace: SessionTrace) -> list[tuple[float, float]]:
    """(first audio arrival, latency) of each reply that answers a user turn."""
    starts = [reply[0][0] for reply in split_replies(trace)]
    return [(trace.turn_ends[turn] + latency, latency) for turn, latency in pair_replies(trace.turn_ends, starts)]


def make_row(index: int, t0: float, t1: float, traces: list[SessionTrace], before: dict[str, Any] | None,
             after: dict[str, Any] | None, callers: int, since: float) -> dict[str, Any]:
    """One interval [t0, t1) (client clock; ``since`` = the soak's start)."""
    latencies = [lat for tr in traces for at, lat in reply_starts(tr) if t0 <= at < t1]
    lat = percentiles(latencies)

    def delta(key: str) -> float | None:
        if before is None or after is None or before[key] is None or after[key] is None:
            return None
        return after[key] - before[key]

    row: dict[str, Any] = {
        "interval": index, "t_start_s": round(t0 - since, 2), "t_end_s": round(t1 - since, 2),
        "replies": lat["n"], "reply_latency_p50_s": lat["p50"], "reply_latency_p99_s": lat["p99"],
        "late_ticks": delta("late_ticks"),
        "live_sessions": after["live_sessions"] if after else None,
        "memory_bytes": memory_of(after) if after else None,
        "held_bytes": sum(after["pools"].values()) if after else None,
        "compactions_per_session": (round(after["compactions"] / callers, 3)
                                    if after and after["compactions"] is not None else None),
    }
    for pool, held in sorted((after or {}).get("pools", {}).items()):
        row[f"pool_{pool}_bytes"] = held
    for kind, value in sorted((after or {}).get("memory", {}).items()):
        row[f"memory_{kind}_bytes"] = value
    return row


def compare(rows: list[dict[str, Any]], interval_s: float) -> dict[str, Any]:
    """First vs last interval for each compared figure (the first and the last interval that
    has it: the first may hold no reply yet), with both intervals' numbers and last - first. A
    last interval shorter than half the others (the seconds the callers took to finish) is left
    out when there are others."""
    out = {}
    rows = [row for row in rows if row["t_end_s"] - row["t_start_s"] >= 0.5 * interval_s] or rows
    for key in COMPARED:
        have = [row for row in rows if row.get(key) is not None]
        if not have:
            out[key] = {"first": None, "last": None, "change": None, "intervals": None}
            continue
        a, b = have[0][key], have[-1][key]
        out[key] = {"first": a, "last": b, "change": round(b - a, 4),
                    "intervals": [have[0]["interval"], have[-1]["interval"]]}
    return out


async def record(args: argparse.Namespace, client: Any, base: str, traces: list[SessionTrace],
                 tasks: list[asyncio.Task], since: float, callers: int) -> list[dict[str, Any]]:
    """A row every ``--interval`` until every caller is done."""
    loop = asyncio.get_running_loop()
    rows: list[dict[str, Any]] = []
    before = await read_metrics(client, base)
    t0 = since
    while True:
        finished = await _sleep_or_done(tasks, t0 + args.interval - loop.time())
        t1 = loop.time()
        after = await read_metrics(client, base)
        row = make_row(len(rows), t0, t1, traces, before, after, callers, since)
        rows.append(row)
        logger.info("soak %5.0f s: replies %d, latency p50/p99 %s/%s s, late ticks %s, memory %s, "
                    "compactions/session %s", row["t_end_s"], row["replies"], row["reply_latency_p50_s"],
                    row["reply_latency_p99_s"], row["late_ticks"], row["memory_bytes"], row["compactions_per_session"])
        before, t0 = after, t1
        if finished:
            return rows


async def _sleep_or_done(tasks: list[asyncio.Task], seconds: float) -> bool:
    """Wait ``seconds`` or until every task ended; True when they all did."""
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, seconds))
    return not pending


async def run_soak(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    import httpx

    base = http_base(args.url)
    callers = make_callers(args)
    traces = [SessionTrace(c.index, c.voice, c.dialect) for c in callers]
    async with httpx.AsyncClient(headers=auth_headers()) as client:
        await wait_ready(client, base, args.ready_timeout)
        since = asyncio.get_running_loop().time()
        tasks = [asyncio.create_task(c.run(args.url, t, auth_headers())) for c, t in zip(callers, traces)]
        rows = await record(args, client, base, traces, tasks, since, len(callers))
        await asyncio.gather(*tasks, return_exceptions=True)
    sessions = [session_row(t) for t in traces]
    window = requested_window(args)
    return {
        "benchmark": "soak", "argv": argv, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "hardware": args.hardware or hardware_line(),
        "config": {"url": args.url, "sessions": args.sessions, "duration_s": args.duration, "interval_s": args.interval,
                   "workload": args.workload, "window": window or "server default", "seed": args.seed},
        "rows": rows,
        "first_vs_last": compare(rows, args.interval),
        "compactions_per_session": rows[-1]["compactions_per_session"] if rows else None,
        "sessions_with_errors": sum(bool(s["errors"]) for s in sessions),
        "errors_first": sorted({e for s in sessions for e in s["errors"]})[:5],
        "sessions": sessions,
    }


# ------------------------------------------------------------------------------ output

def write_csv(rows: list[dict[str, Any]], path: Path) -> Path:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def plot_soak(results: dict[str, Any], path: Path) -> Path:
    """Four panels over the call: reply latency, late ticks, memory (in use, and held per pool),
    compactions per session."""
    plt = pyplot()
    rows = results["rows"]
    t = [r["t_end_s"] / 60 for r in rows]

    def series(key: str, scale: float = 1.0) -> list[float]:
        return [r[key] / scale if r.get(key) is not None else math.nan for r in rows]

    fig, axes = plt.subplots(4, 1, figsize=(8, 10), sharex=True)
    ax = axes[0]
    ax.plot(t, series("reply_latency_p50_s"), "o-", label="p50")
    ax.plot(t, series("reply_latency_p99_s"), "^-", label="p99")
    ax.axhline(results.get("reply_latency_limit_s") or math.nan, color="black", linewidth=0.8, linestyle=":",
               label="limit")
    ax.set_ylabel("reply latency (s)")
    axes[1].bar(t, series("late_ticks"), width=0.6 * (t[1] - t[0]) if len(t) > 1 else 0.5, label="late ticks")
    axes[1].set_ylabel("late ticks / interval")
    ax = axes[2]
    ax.plot(t, series("memory_bytes", GiB), "k-", label="memory in use")
    for key in sorted(k for k in rows[-1] if k.startswith("pool_")):
        ax.plot(t, series(key, GiB), "--", label=key.removeprefix("pool_").removesuffix("_bytes"))
    ax.set_ylabel("GiB")
    axes[3].plot(t, series("compactions_per_session"), "s-", label="window compactions per session")
    axes[3].set_ylabel("compactions")
    axes[3].set_xlabel("minutes into the soak")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    cfg = results["config"]
    axes[0].set_title(f"duplexcache bench soak: {cfg['sessions']} callers, {cfg['duration_s']:g} s, window "
                      f"{cfg['window']}\n{results['hardware'][:90]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def describe(results: dict[str, Any]) -> list[str]:
    lines = [f"soak: {len(results['rows'])} intervals; compactions per session {results['compactions_per_session']}; "
             f"sessions with errors {results['sessions_with_errors']}"]
    for key, c in results["first_vs_last"].items():
        lines.append(f"  {key:<22} first {c['first']}  last {c['last']}  change {c['change']}")
    if results["errors_first"]:
        lines.append("  errors: " + "; ".join(results["errors_first"]))
    return lines


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    try:
        http_base(args.url)
        requested_window(args)
    except ValueError as exc:
        print(f"duplexcache bench soak: {exc}", file=sys.stderr)
        return 2
    if argv is None:
        argv = argv_after("soak")
    try:
        results = asyncio.run(run_soak(args, argv))
    except ServerUnreachable as exc:
        print(f"duplexcache bench soak: {exc}", file=sys.stderr)
        return 1
    results["reply_latency_limit_s"] = args.max_reply_latency
    write_results(args.out, results, stem="soak")
    write_csv(results["rows"], args.out / "soak.csv")
    plot_soak(results, args.out / "soak.png")
    for line in describe(results):
        print(line)
    print(f"wrote {args.out / 'soak.json'}, soak.csv and soak.png")
    return 0


if __name__ == "__main__":
    from duplexcache.bench.common import alias_main

    raise SystemExit(alias_main("soak"))
