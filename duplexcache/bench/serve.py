"""``duplexcache bench serve``: drive a running server over WebSockets at real-time pace, the way callers meet it.

How it measures and what its figures mean: docs/bench_methods.md, "duplexcache bench serve".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import re
import shlex
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from duplexcache.bench import workload as wl
from duplexcache.bench.common import argv_after, hardware_line, int_list, write_results
from duplexcache.bench.plot import pyplot, save_figure
from duplexcache.bench.serve_client import GAP_S, TURN_WORKLOADS, Caller, SessionTrace, session_row
from duplexcache.bench.serve_metrics import (  # noqa: F401 - counters, stage_totals: read through this module too
    COUNTERS, between_tick_ms_mean, counters, delta, scrape, stage_ms_mean, stage_totals,
)
from duplexcache.bench.video import is_video
from duplexcache.config import API_KEY_ENV

logger = logging.getLogger(__name__)

SERVE_WORKLOADS = (*TURN_WORKLOADS, "continuous")
MAX_SESSIONS = 1024
MAX_STEPS = 16
MAX_DURATION_S = 3600.0
MAX_RAMP_S = 600.0
INSTRUCTIONS = "You are a friendly voice assistant. Keep every answer short."
MAX_INSTRUCTION_CHARS = 1_000_000
_REPEATS = re.compile(r" \(x\d+\)$")   # serve_client.collapse_repeats' suffix
IDLE_WAIT_S = 30.0      # between steps: at most this long for the server to free the last step's sessions


def _unit_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--user-units wants MIN,MAX, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"--user-units needs 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def _bounded(name: str, lo: float, hi: float, kind: type = float):
    """An argparse type: a ``kind`` (float or int) in [lo, hi]."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} wants {'a whole number' if kind is int else 'a number'}, got {text!r}") from None
        if not lo <= value <= hi or math.isnan(value):
            raise argparse.ArgumentTypeError(f"{name} must be in [{lo:g}, {hi:g}], got {text!r}")
        return value
    return parse


def long_instructions(chars: int) -> str:
    """Instructions of exactly ``chars`` characters (a repeated sentence, cut)."""
    sentence = "Answer briefly, warmly and in the language of the question. "
    return (sentence * (chars // len(sentence) + 1))[:chars]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="the server's realtime WebSocket, e.g. ws://127.0.0.1:8000/v1/realtime")
    parser.add_argument("--sessions", type=int_list("--sessions", MAX_SESSIONS, MAX_STEPS), default=(8,), help="a count, or a comma list for a sweep")
    parser.add_argument("--workload", choices=SERVE_WORKLOADS, default="conversation")
    parser.add_argument("--duration", type=_bounded("--duration", 1, MAX_DURATION_S), default=60.0,
                        help="seconds of audio each session streams")
    parser.add_argument("--ramp", type=_bounded("--ramp", 0, MAX_RAMP_S), default=5.0,
                        help="seconds over which a step's sessions connect")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--voices", default="default,alt",
                        help="comma list of server voices the sessions use in turn (the server must know them)")
    parser.add_argument("--user-units", type=_unit_range, default=(2, 6),
                        help="conversation: user turns last MIN,MAX units (seconds)")
    parser.add_argument("--turn-ends", choices=("unit", "random"), default="unit",
                        help="conversation: where a user turn's speech ends: on a unit boundary of the caller's "
                             "stream (every turn of a call at one phase of the server's grid), or at a seeded "
                             "random 10 ms frame of the turn's last unit (any phase, as calls do)")
    parser.add_argument("--max-lead-units", type=int, default=wl.ConversationShape.max_lead_units,
                        help="conversation: a session starts after 0..this many quiet units (its random phase)")
    parser.add_argument("--reply-min-units", type=int, default=wl.ConversationShape.reply_min_units,
                        help="must equal the server's engine.speak_policy.reply_min_units")
    parser.add_argument("--reply-max-units", type=int, default=wl.ConversationShape.reply_max_units,
                        help="must equal the server's engine.speak_policy.reply_max_units")
    parser.add_argument("--max-reply-latency", type=_bounded("--max-reply-latency", 0, 60), default=1.5,
                        help="real-time criterion: reply latency p99 at most this (seconds)")
    parser.add_argument("--drain", type=_bounded("--drain", 0, 120), default=5.0,
                        help="seconds to wait after the last audio for scheduled replies")
    parser.add_argument("--long-context-callers", type=_bounded("--long-context-callers", 0, MAX_SESSIONS, int), default=0,
                        help="callers added to each step that open with --long-context-chars of instructions "
                             "(issue 11: a long context's prefill must not stall the others); reported apart")
    parser.add_argument("--long-context-chars", type=_bounded("--long-context-chars", 1, MAX_INSTRUCTION_CHARS, int), default=16000,
                        help="their instructions' length; a random-weight preset's byte tokenizer makes ~1 token "
                             "per character, and over server.max_context_tokens they are refused")
    parser.add_argument("--long-context-at", type=_bounded("--long-context-at", 0, MAX_DURATION_S), default=None,
                        help="seconds after a step's start when they connect, 0.5 s apart (default: --ramp + 5)")
    parser.add_argument("--minicpmo-share", type=_bounded("--minicpmo-share", 0, 1), default=0.0,
                        help="share of the callers that speak the MiniCPM-o Realtime dialect (map.realtime, a "
                        "reference recording per voice) instead of OpenAI's, spread evenly; 0.5 = every other one")
    parser.add_argument("--video-share", type=_bounded("--video-share", 0, 1), default=0.0,
                        help="share of the callers that are video callers (MiniCPM-o dialect, mode=video, a 640x480 "
                        "JPEG with each second of audio; the server needs model.vision: true), spread evenly")
    parser.add_argument("--ready-timeout", type=_bounded("--ready-timeout", 0, MAX_DURATION_S), default=600.0,
                        help="seconds to wait for a server whose /health says it is still warming up before the "
                             "first step (a server that nothing answers for fails at once)")
    parser.add_argument("--hardware", default=None, help="hardware line for the report (default: nvidia-smi / platform)")
    parser.add_argument("--out", type=Path, default=Path("bench-serve-out"))


# ------------------------------------------------------------------------------ server side

def http_base(url: str) -> str:
    """ws(s)://host:port/path -> http(s)://host:port (the same server's HTTP endpoints)."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ValueError(f"--url must be ws:// or wss:// with a host, got {url!r}")
    try:
        parts.port   # urllib checks the range only when asked
    except ValueError:
        raise ValueError(f"--url needs a port from 0 to 65535, got {url!r}") from None
    return urlunsplit(("http" if parts.scheme == "ws" else "https", parts.netloc, "", "", ""))


def auth_headers() -> dict[str, str]:
    """The server's key from DUPLEXCACHE_API_KEY (the variable `duplexcache serve` reads), as a
    Bearer header for the callers' WebSockets and for /metrics; empty without it. Taken from the
    environment only, never a flag: results.json records the command line."""
    key = os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


class ServerUnreachable(RuntimeError):
    """Nothing answers at the URL's host and port, or the server did not finish warming up."""


async def wait_ready(client: Any, base: str, timeout: float, poll_s: float = 1.0) -> None:
    """Before the first step: fail at once when nothing listens at ``base`` (every caller would only
    collect connection errors), and wait while ``/health`` answers 503 ``warming`` (a server just
    started captures its graphs first; callers would be turned away with ``server_warming_up``).
    Any other answer, a 404 from a server without ``/health`` included, lets the sweep start."""
    import httpx

    loop = asyncio.get_running_loop()
    deadline: float | None = None   # counted from the first "warming": a slow first request is not the wait
    while True:
        try:
            response = await client.get(base + "/health", timeout=10.0)
        except httpx.TransportError as exc:
            raise ServerUnreachable(f"nothing answers at {base} (from --url): {type(exc).__name__}: {exc}; "
                                    "is `duplexcache serve` running there?") from exc
        body: Any = None
        if response.status_code == 503:
            with contextlib.suppress(ValueError):   # a 503 that is not JSON: not our warming server
                body = response.json()
        status = body.get("status") if isinstance(body, dict) else None
        if status == "warmup_failed":
            raise ServerUnreachable(f"the server at {base} failed its warm-up: {body.get('error')}")
        if status != "warming":
            return
        if deadline is None:
            logger.info("the server at %s is warming up; waiting up to %.0f s for /health to be ready", base, timeout)
            deadline = loop.time() + timeout
        elif loop.time() >= deadline:
            raise ServerUnreachable(f"the server at {base} was still warming up after {timeout:.0f} s "
                                    "(--ready-timeout)")
        await asyncio.sleep(poll_s)


class VoicesMissing(RuntimeError):
    """--voices names a voice the server does not have (every session would be refused)."""


async def check_voices(client: Any, base: str, voices: list[str]) -> None:
    """Before the first step: the server's ``/v1/voices`` must list every voice of --voices, else
    every caller that asks for a missing one would be refused at its session.update. A server
    without that route (404, not JSON) is not checked."""
    response = await client.get(base + "/v1/voices", timeout=10.0)
    try:
        body = response.json() if response.status_code == 200 else None
    except ValueError:
        body = None
    known = body.get("voices") if isinstance(body, dict) else None
    if not isinstance(known, list):
        return
    aliases = body.get("aliases") if isinstance(body.get("aliases"), dict) else {}
    missing = [v for v in voices if v not in known and v not in aliases]
    if missing:
        raise VoicesMissing(f"the server at {base} has no voice {', '.join(repr(v) for v in missing)} "
                            f"(it has: {', '.join(map(str, known))}); pick from those with --voices")


async def wait_idle(client: Any, base: str, timeout: float = IDLE_WAIT_S) -> None:
    """Until /health reports no live sessions (the server frees closed sessions at its next tick)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        try:
            body = (await client.get(base + "/health", timeout=5.0)).json()
            # behind a cluster, the summary's count over every replica (a report period old)
            live = body.get("cluster", {}).get("live_sessions", body.get("live_sessions", 0))
            if live == 0 and body.get("live_sessions", 0) == 0 and body.get("queued_sessions", 0) == 0:
                return
        except Exception as exc:  # noqa: BLE001
            logger.debug("health: %s", exc)
        await asyncio.sleep(0.25)
    logger.warning("server still reports live sessions after %.0f s; starting the next step anyway", timeout)


# ------------------------------------------------------------------------------ one step

def percentiles(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None, "max": None, "n": 0}
    a = np.asarray(values, dtype=np.float64)
    return {"p50": round(float(np.percentile(a, 50)), 4), "p95": round(float(np.percentile(a, 95)), 4),
            "p99": round(float(np.percentile(a, 99)), 4), "max": round(float(a.max()), 4), "n": int(a.size)}


def summarize_step(n: int, rows: list[dict[str, Any]], before: dict, after: dict, wall_s: float,
                   max_latency: float, workload: str) -> dict[str, Any]:
    """The step's figures over its ``n`` regular callers; rows marked ``long_context`` (the
    callers of ``--long-context-callers``) are summarised apart, so the figures stay comparable
    with a run without them and show what their prefill did to everyone else."""
    long_rows = [r for r in rows if r.get("long_context")]
    rows = [r for r in rows if not r.get("long_context")]
    latencies = [x for r in rows for x in r["reply_latency_s"]]
    ratios = [r["audio_received_ratio"] for r in rows if r["audio_received_ratio"] is not None]
    late = delta(after["late_ticks"], before["late_ticks"])
    lat = percentiles(latencies)
    # A server that falls behind real time and never catches up adds the same delay to every
    # later reply: the last reply of a session is then later than its first.
    growth = [r["reply_latency_s"][-1] - r["reply_latency_s"][0] for r in rows if len(r["reply_latency_s"]) >= 2]
    all_audio = all(r["got_audio"] for r in rows)
    if workload in TURN_WORKLOADS:
        latency_ok = lat["p99"] is not None and lat["p99"] <= max_latency
    else:
        latency_ok = True   # no user turns, no replies: the latency part does not apply
    capped = sum(any("rate_limit_exceeded" in e for e in r["errors"]) for r in rows)
    if capped:
        # Every caller of this load generator comes from one address: a per-address cap on the
        # server refuses them, and the step then measures the cap, not the engine.
        logger.warning("%d of %d sessions were refused with rate_limit_exceeded: the server caps sessions per "
                       "client address (server.max_sessions_per_client / max_connections_per_client) and every "
                       "caller of this benchmark has the same address; raise those limits on the server", capped, n)
    return {
        "sessions": n, "wall_s": round(wall_s, 3),
        "reply_latency_s": lat,
        "reply_latency_growth_s": percentiles(growth),
        "sessions_rate_limited": capped,
        "max_gap_s": percentiles([r["max_gap_s"] for r in rows]),
        "audio_received_ratio": percentiles(ratios),
        "gaps_over_200ms": sum(r["gaps_over_200ms"] for r in rows),
        "sessions_with_audio": sum(r["got_audio"] for r in rows),
        "sessions_with_errors": sum(bool(r["errors"]) for r in rows),
        "sessions_by_dialect": _dialect_summary(rows),
        "errors_top": top_errors(rows),
        "replies_scheduled": sum(r["replies_scheduled"] for r in rows),
        "replies_done": sum(r["replies_done"] for r in rows),
        **{key: delta(after.get(key), before.get(key)) for key in COUNTERS},   # late_ticks, catch_up_ticks, ...
        "stage_ms_mean": stage_ms_mean(before, after),   # per tick, the server's own timers
        "between_tick_ms_mean": between_tick_ms_mean(before, after),   # phased ticks between unit ticks, with units
        "realtime": bool(all_audio and late == 0 and latency_ok),
        **({"long_context": _long_context_summary(long_rows)} if long_rows else {}),
        **({"without_errors": _without_errors_summary(rows)} if any(r["errors"] for r in rows) else {}),
        "per_session": rows + long_rows,
    }


def top_errors(rows: list[dict[str, Any]], limit: int = 3) -> list[list[Any]]:
    """The most common errors of a step as [message, sessions that met it], most sessions first;
    a caller's ``(xN)`` repeat count is dropped, so one message counts once per session."""
    seen = Counter(e for r in rows for e in {_REPEATS.sub("", err) for err in r["errors"]})
    return [[message, count] for message, count in seen.most_common(limit)]


def _without_errors_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The sessions that met no error (admitted at once, never refused), apart: when the card
    holds fewer sessions than the step has callers, the refused ones get in late, one by one, and
    their first replies set the step's p99; this is what the admitted callers heard."""
    clean = [r for r in rows if not r["errors"]]
    return {"sessions": len(clean),
            "reply_latency_s": percentiles([x for r in clean for x in r["reply_latency_s"]]),
            "gaps_over_200ms": sum(r["gaps_over_200ms"] for r in clean),
            "sessions_with_audio": sum(r["got_audio"] for r in clean)}


def _long_context_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"callers": len(rows), "with_audio": sum(r["got_audio"] for r in rows),
            "with_errors": sum(bool(r["errors"]) for r in rows),
            "first_errors": [r["errors"][0] for r in rows if r["errors"]],
            "reply_latency_s": percentiles([x for r in rows for x in r["reply_latency_s"]]),
            "gaps_over_200ms": sum(r["gaps_over_200ms"] for r in rows)}


def caller_dialect(index: int, share: float) -> str:
    """The wire protocol of caller ``index`` when ``share`` of the callers speak MiniCPM-o's:
    spread evenly (0.5: the odd callers), so both dialects ramp up together."""
    return "minicpmo" if math.floor((index + 1) * share) > math.floor(index * share) else "openai"


def _dialect_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per wire protocol: callers, those that got audio, those with errors."""
    out: dict[str, Any] = {}
    for row in rows:
        d = out.setdefault(row.get("dialect", "openai"), {"sessions": 0, "with_audio": 0, "with_errors": 0})
        d["sessions"] += 1
        d["with_audio"] += bool(row["got_audio"])
        d["with_errors"] += bool(row["errors"])
    return out


def _voice_names(args: argparse.Namespace) -> list[str]:
    return [v for v in args.voices.split(",") if v.strip()]


async def run_step(n: int, args: argparse.Namespace, client: Any, base: str, bar: Any = None) -> dict[str, Any]:
    shape = wl.ConversationShape(user_min_units=args.user_units[0], user_max_units=args.user_units[1],
                                 reply_min_units=args.reply_min_units, reply_max_units=args.reply_max_units,
                                 max_lead_units=args.max_lead_units,
                                 ragged_turn_ends=args.turn_ends == "random")
    voices = wl.pick_voices(n, _voice_names(args), args.seed)
    units = max(1, int(args.duration))
    callers = [Caller(i, voices[i], args.workload, units, args.seed, shape, INSTRUCTIONS,
                      start_delay_s=args.ramp * i / max(1, n - 1) if n > 1 else 0.0, drain_s=args.drain,
                      dialect="minicpmo-video" if is_video(i, args.video_share)
                      else caller_dialect(i, args.minicpmo_share))
               for i in range(n)]
    # Long-context callers join later (0.5 s apart) and stop with the others: they open while
    # the regular callers are live, which is the case issue 11 is about.
    extra = args.long_context_callers
    at = args.ramp + 5.0 if args.long_context_at is None else args.long_context_at
    long_voices = wl.pick_voices(extra, _voice_names(args), args.seed + 1) if extra else []
    callers += [Caller(n + j, long_voices[j], args.workload, max(1, units - int(at)), args.seed, shape,
                       long_instructions(args.long_context_chars), start_delay_s=at + 0.5 * j, drain_s=args.drain)
                for j in range(extra)]
    traces = [SessionTrace(c.index, c.voice, c.dialect) for c in callers]
    before = await scrape(client, base)
    start = time.perf_counter()
    # Bounded: connect timeouts + ramp + audio + drain, with slack for a slow server.
    last_start_s = max(c.start_delay_s for c in callers)
    limit = last_start_s + units + args.drain + 2 * callers[0].ready_timeout_s + 30.0
    tasks = [asyncio.create_task(c.run(args.url, t, auth_headers())) for c, t in zip(callers, traces)]
    ticker = asyncio.create_task(_progress(bar, args.ramp + units)) if bar is not None else None
    done, pending = await asyncio.wait(tasks, timeout=limit)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task, trace in zip(tasks, traces):
        if task in pending:
            trace.errors.append(f"step time limit of {limit:.0f} s reached")
    if ticker is not None:
        ticker.cancel()
    wall = time.perf_counter() - start
    await asyncio.sleep(1.5)   # the server counts a late tick when the tick ends: let the last ones land
    after = await scrape(client, base)
    rows = [{**session_row(t), **({"long_context": True} if t.index >= n else {})} for t in traces]
    return summarize_step(n, rows, before, after, wall, args.max_reply_latency, args.workload)


async def _progress(bar: Any, seconds: float) -> None:
    for _ in range(int(math.ceil(seconds))):
        await asyncio.sleep(1.0)
        bar.update(1)


# ------------------------------------------------------------------------------ the sweep

def criterion(args: argparse.Namespace) -> dict[str, Any]:
    return {"every_session_received_audio": True, "late_ticks": 0,
            "reply_latency_p99_max_s": args.max_reply_latency if args.workload in TURN_WORKLOADS else None,
            "text": "largest step in which every session received audio, the server counted 0 late ticks "
                    f"and reply latency p99 <= {args.max_reply_latency:g} s"
                    + ("" if args.workload in TURN_WORKLOADS else " (latency not applicable: no user turns)")}


def largest_realtime(steps: list[dict[str, Any]]) -> int | None:
    ok = [s["sessions"] for s in steps if s["realtime"]]
    return max(ok) if ok else None


def _results(args: argparse.Namespace, argv: list[str], steps: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "command": "duplexcache bench serve " + shlex.join(argv),
        "hardware": args.hardware or hardware_line(None),
        "url": args.url,
        "config": {"sessions": list(args.sessions), "workload": args.workload, "duration_s": args.duration,
                   "ramp_s": args.ramp, "seed": args.seed, "voices": _voice_names(args),
                   "user_units": list(args.user_units), "max_lead_units": args.max_lead_units,
                   "turn_ends": args.turn_ends, "minicpmo_share": args.minicpmo_share, "video_share": args.video_share,
                   "reply_units": [args.reply_min_units, args.reply_max_units], "drain_s": args.drain,
                   "gap_threshold_s": GAP_S, "input": "16 kHz pcm16 in 0.1 s chunks at real-time pace",
                   "api_key": bool(auth_headers())},   # whether a key was sent, never the key
        "criterion": criterion(args),
        "largest_realtime_sessions": largest_realtime(steps),
        "steps": steps,
    }


async def run_sweep(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    import httpx
    from tqdm import tqdm

    base = http_base(args.url)
    steps: list[dict[str, Any]] = []
    per_step = int(math.ceil(args.ramp + max(1, int(args.duration))))
    async with httpx.AsyncClient(headers=auth_headers()) as client:
        await wait_ready(client, base, args.ready_timeout)
        await check_voices(client, base, _voice_names(args))
        with tqdm(total=per_step * len(args.sessions), desc="bench serve", unit="s", file=sys.stderr,
                  disable=None) as bar:
            for k, n in enumerate(args.sessions):
                if k:
                    await wait_idle(client, base)
                logger.info("step %d/%d: %d sessions, %s, %.0f s", k + 1, len(args.sessions), n, args.workload,
                            args.duration)
                step = await run_step(n, args, client, base, bar)
                steps.append(step)
                lat = step["reply_latency_s"]
                logger.info("%d sessions: audio %d/%d, reply latency p50 %s p99 %s s, late ticks %s, real-time %s",
                            n, step["sessions_with_audio"], n, lat["p50"], lat["p99"], step["late_ticks"],
                            step["realtime"])
                write_results(args.out, _results(args, argv, steps))   # a killed sweep keeps its steps
    return _results(args, argv, steps)


def plot_latency(results: dict[str, Any], path: Path) -> Path:
    """Reply latency p50/p95/p99 vs sessions, with the criterion's limit."""
    plt = pyplot()

    steps = results["steps"]
    ns = [s["sessions"] for s in steps]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for q, style in (("p50", "o-"), ("p95", "s--"), ("p99", "^-")):
        ys = [s["reply_latency_s"][q] if s["reply_latency_s"][q] is not None else float("nan") for s in steps]
        ax.plot(ns, ys, style, label=q)
    limit = results["criterion"]["reply_latency_p99_max_s"]
    if limit is not None:
        ax.axhline(limit, color="black", linewidth=0.8, linestyle=":", label=f"limit {limit:g} s")
    ax.set_xlabel("concurrent sessions")
    ax.set_ylabel("reply latency (s)")
    ax.set_title(f"duplexcache bench serve ({results['config']['workload']}): {results['hardware'][:60]}",
                 fontsize=9)
    return save_figure(fig, ax, path)


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run the sweep against ``args.url``; 0 when every step ran (whatever it measured)."""
    try:
        http_base(args.url)
    except ValueError as exc:
        print(f"duplexcache bench serve: {exc}", file=sys.stderr)
        return 2
    if not _voice_names(args):
        print("duplexcache bench serve: --voices names no voice", file=sys.stderr)
        return 2
    if not 1 <= args.reply_min_units <= args.reply_max_units or args.max_lead_units < 0:
        print("duplexcache bench serve: need 1 <= --reply-min-units <= --reply-max-units and --max-lead-units >= 0", file=sys.stderr)
        return 2
    if argv is None:   # what followed ``serve`` on the command line, for the report
        argv = argv_after("serve")
    try:
        results = asyncio.run(run_sweep(args, argv))
    except ServerUnreachable as exc:
        print(f"duplexcache bench serve: {exc}", file=sys.stderr)
        return 1
    except VoicesMissing as exc:
        print(f"duplexcache bench serve: {exc}", file=sys.stderr)
        return 2
    write_results(args.out, results)
    plot_latency(results, args.out / "reply_latency.png")
    for s in results["steps"]:
        lat = s["reply_latency_s"]
        print(f"{s['sessions']:>4} sessions: audio {s['sessions_with_audio']}/{s['sessions']}, reply latency "
              f"p50/p95/p99 {lat['p50']}/{lat['p95']}/{lat['p99']} s (last - first reply of a session: p50 "
              f"{s['reply_latency_growth_s']['p50']} s), gaps > 200 ms {s['gaps_over_200ms']}, "
              f"late ticks {s['late_ticks']} (catch-up ticks {s['catch_up_ticks']}, early closes {s.get('early_closes')}), errors in {s['sessions_with_errors']} sessions, "
              f"real-time {s['realtime']}")
        if s.get("errors_top"):
            print("      errors: " + "; ".join(f"{message} ({count} sessions)" for message, count in s["errors_top"]))
        if s.get("stage_ms_mean"):
            print("      server ms per tick (mean): " + ", ".join(f"{k} {v}" for k, v in s["stage_ms_mean"].items()))
        if s.get("between_tick_ms_mean") is not None:
            print(f"      server ms per tick between unit ticks that ran units (mean): {s['between_tick_ms_mean']}")
        if "without_errors" in s:
            ok = s["without_errors"]
            lat = ok["reply_latency_s"]
            print(f"      the {ok['sessions']} sessions without errors: "
                  f"audio {ok['sessions_with_audio']}/{ok['sessions']}, "
                  f"reply latency p50/p95/p99/max {lat['p50']}/{lat['p95']}/{lat['p99']}/{lat['max']} s "
                  f"({lat['n']} replies), gaps > 200 ms {ok['gaps_over_200ms']}")
        if "long_context" in s:
            lc = s["long_context"]
            print(f"      + {lc['callers']} long-context callers: audio {lc['with_audio']}/{lc['callers']}, reply "
                  f"latency p50 {lc['reply_latency_s']['p50']} s, errors {lc['first_errors'] or 'none'} "
                  f"(prefill chunks between ticks in the step: {s.get('prefill_chunks_between_ticks')})")
    print(f"largest real-time step: {results['largest_realtime_sessions']} ({results['criterion']['text']})")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'reply_latency.png'}")
    return 0
