"""``duplexcache demo``: several concurrent clients talk to the tiny engine on CPU.

It builds the engine (tiny preset, random weights; with no ``--config`` the three sharing
switches are turned on so there is something to share), serves it on loopback with the real
WebSocket server, and runs ``--sessions`` clients at once, alternating ``--voices`` voices. Each
client streams ``--seconds`` units of synthetic 16 kHz audio as fast as the server takes it,
waits for the replies the speaking policy will finish (``response.done`` events; with the
``model`` policy, until the engine has run every unit sent), saves the reply as a 24 kHz WAV
under ``--out``, and closes. Without the web stack (``duplexcache.server`` not importable) the
same clients drive the engine directly, and the demo says so.

It waits by events, never by an idle timer: a busy machine makes ticks late, not the demo wrong.
The one wall-clock limit is ``--timeout``, an overall deadline; reaching it, or getting no audio
back at all, is a failure (exit 1) with the reason (e.g. how late the ticks ran). While it waits
it logs a line per finished reply and a heartbeat with the engine's tick count.

The table at the end: sessions, ticks, audio seconds out, per-stage p50 latency over the ticks
that ran units, bytes per tier of each pool while all sessions were live, context-cache hits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time
import wave
from pathlib import Path
from typing import Awaitable, Callable

import numpy as np

from duplexcache.config import ConfigError, DeployConfig
from duplexcache.demo_client import OUT_RATE, ClientResult, ServerError, run_client, until_responses
from duplexcache.runtime.engine import STAGES, DuplexEngine, build_engine
from duplexcache.runtime.engine_api import (
    AudioDelta,
    EngineStats,
    ResponseDone,
    TextDelta,
)
from duplexcache.runtime.policy import ScriptedPolicy
from duplexcache.runtime.switches import describe_switches

logger = logging.getLogger(__name__)

FIRST_UNIT, UNIT = 16_560, 16_000
INSTRUCTIONS = "You are a demo."
DEFAULT_TIMEOUT_S = 300.0   # overall deadline: generous, a loaded 2-core machine runs ticks 10 s late
CLOSE_TIMEOUT_S = 60.0      # at least this long for the sessions to close once the replies are in
HEARTBEAT_S = 15.0          # a progress line at least this often while waiting
# Ticks past the units it sent that a client waits when the model decides when to speak (no reply
# count is known): one to open the session, one for a reply's last Code2Wav chunk, and one for
# audio still on its way through the server. Extra ticks with no audio buffered do nothing.
EXTRA_TICKS = 3
DIRECT_SLACK_TICKS = 10     # direct mode: ticks past the units sent before missing replies fail it
RANDOM_WEIGHTS_NOTE = "random weights: text and audio are noise (no checkpoint loaded: model.checkpoint_dir)"


class DemoFailed(RuntimeError):
    """The demo could not show what it set out to (the message says why); exit code 1."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", type=int, default=4, help="concurrent clients (default 4)")
    parser.add_argument("--seconds", type=int, default=3, help="seconds (units) of audio per client (default 3)")
    parser.add_argument("--voices", type=int, default=2, help="voices to alternate (default 2)")
    parser.add_argument("--config", metavar="YAML", help="deploy config (default: tiny preset, sharing on)")
    parser.add_argument("--out", default="out/demo", help="directory for the reply WAV files (default out/demo)")
    parser.add_argument("--direct", action="store_true", help="drive the engine directly, without the server")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"overall deadline in seconds; reaching it fails the demo "
                             f"(default {DEFAULT_TIMEOUT_S:.0f})")


def demo_deploy(config: str | None) -> DeployConfig:
    if config is not None:
        return DeployConfig.from_yaml(config)
    deploy = DeployConfig.default("tiny")
    deploy.stage0.shared_anchor_blocks = True
    deploy.context_cache.duplex_context_caching = True
    deploy.code2wav.cfm_prompt_att_sharing = True
    return deploy


def client_audio(index: int, seconds: int) -> np.ndarray:
    n = FIRST_UNIT + UNIT * (seconds - 1)
    t = np.arange(n) / 16_000
    rng = np.random.default_rng(index)
    tone = 0.2 * np.sin(2 * np.pi * (180 + 40 * index) * t)
    return (tone + rng.normal(0, 0.02, n)).astype(np.float32)


def expected_turns(engine: DuplexEngine, seconds: int) -> int | None:
    """Turns the scripted policy finishes within ``seconds`` units (None: the model decides)."""
    policy = engine.policy
    if not isinstance(policy, ScriptedPolicy):
        return None
    return sum(1 for u in range(seconds) if policy.speaks(u) and u % policy.k == policy.k - 1)


def diagnose(engine: DuplexEngine) -> str:
    """Why replies may not have come: how late the engine's ticks ran, or that it ran none."""
    period = engine.deploy.engine.tick_seconds
    ticks = engine.stats().ticks
    if engine.late_ticks:
        over = [t - period for t in engine.latency_history["tick"] if t > period]
        return (f"ticks are running {max(over, default=0.0):.1f} s late on this machine ({engine.late_ticks} of "
                f"{ticks} ticks took longer than tick_seconds {period:g} s); try --sessions 1, a smaller "
                f"--seconds, a larger --timeout, or a quieter machine")
    return f"the engine ran {ticks} ticks without finishing the replies (is its tick stalled?)"


# ------------------------------------------------------------------------------ server clients

def _ticks_after_sending(engine: DuplexEngine, seconds: int) -> Callable[[ClientResult], Awaitable[None]]:
    """``done`` when the model decides: enough ticks for every unit this client sent."""
    async def wait(res: ClientResult) -> None:
        target = (await asyncio.to_thread(engine.stats)).ticks + seconds + EXTRA_TICKS
        while (await asyncio.to_thread(engine.stats)).ticks < target:
            await asyncio.sleep(0.1)
    return wait


def server_late_ticks(metrics_url: str) -> int | None:
    """The server's ``duplexcache_late_ticks_total`` from its /metrics, as an operator reads it:
    every tick that ended past its deadline, unit ticks and the ticks between them (the engine's
    own count has unit ticks only). None when it cannot be read."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(metrics_url, timeout=10) as response:
            text = response.read().decode()
    except OSError:
        return None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "duplexcache_late_ticks_total":
                return int(sample.value)
    return None


async def _run_server(engine: DuplexEngine, deploy: DeployConfig, results: list[ClientResult],
                      audios: list[np.ndarray], turns: int | None, seconds: int, timeout: float,
                      served: list[bool], late: list[int | None]) -> EngineStats:
    from duplexcache.server.app import REALTIME_PATH, create_app
    from duplexcache.server.loopback import LoopbackServer

    srv = LoopbackServer(create_app(engine, deploy), max_frame_bytes=deploy.server.max_frame_bytes).start()
    served.append(True)
    done = until_responses(turns) if turns is not None else _ticks_after_sending(engine, seconds)
    readies = [asyncio.Event() for _ in results]
    close = asyncio.Event()
    url = srv.ws_url(REALTIME_PATH)
    tasks = [asyncio.create_task(run_client(url, r, a, INSTRUCTIONS, done, ev, close))
             for r, a, ev in zip(results, audios, readies)]
    try:
        await _wait_ready(engine, results, readies, tasks, turns, timeout)
        snapshot = engine.stats()   # every session is still live here
        close.set()
        try:  # closing waits for a running tick at most; bounded so a wedged server cannot hang the demo
            await asyncio.wait_for(asyncio.gather(*tasks), max(CLOSE_TIMEOUT_S, timeout))
        except asyncio.TimeoutError:
            raise DemoFailed(f"the server did not close the sessions within {max(CLOSE_TIMEOUT_S, timeout):g} s; "
                             f"{diagnose(engine)}") from None
        # after the closes: every tick the server logged as late by now is in the table's count
        late.append(await asyncio.to_thread(server_late_ticks, srv.http_url("/metrics")))
        return snapshot
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(srv.stop)


async def _wait_ready(engine: DuplexEngine, results: list[ClientResult], readies: list[asyncio.Event],
                      tasks: list[asyncio.Task], turns: int | None, timeout: float) -> None:
    """Until every client has its replies; a failing client fails the demo at once, and so does
    the overall deadline. Logs a line per finished client and a heartbeat while waiting."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    waiting = {asyncio.create_task(ev.wait()): i for i, ev in enumerate(readies)}
    pending: set[asyncio.Task] = set(waiting) | set(tasks)
    try:
        while not all(ev.is_set() for ev in readies):
            left = deadline - loop.time()
            if left <= 0:
                raise DemoFailed(_timeout_message(engine, results, turns, timeout))
            done, pending = await asyncio.wait(pending, timeout=min(HEARTBEAT_S, left),
                                               return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task in waiting:
                    res = results[waiting[task]]
                    logger.info("demo: session %d has its replies (%d, %.2f s of audio); %d of %d sessions done",
                                res.index, res.done, res.seconds_out, sum(ev.is_set() for ev in readies),
                                len(readies))
                elif task.exception() is not None:
                    raise task.exception()
            if not done:
                stats = await asyncio.to_thread(engine.stats)
                logger.info("demo: waiting for replies: %d of %d sessions done, %d replies so far; engine "
                            "ticks %d (%d late); deadline in %.0f s", sum(ev.is_set() for ev in readies),
                            len(readies), sum(r.done for r in results), stats.ticks, engine.late_ticks,
                            deadline - loop.time())
    finally:
        for task in waiting:
            task.cancel()


def _timeout_message(engine: DuplexEngine, results: list[ClientResult], turns: int | None, timeout: float) -> str:
    want = f"{turns * len(results)}" if turns is not None else "?"
    return (f"no complete replies within --timeout {timeout:g} s: {sum(r.done for r in results)} of {want} "
            f"replies, {sum(r.seconds_out for r in results):.2f} s of audio; {diagnose(engine)}")


# ------------------------------------------------------------------------------ direct mode

def _run_direct(engine: DuplexEngine, results: list[ClientResult], audios: list[np.ndarray],
                seconds: int, turns: int | None, timeout: float) -> EngineStats:
    """Tick by tick until every client has ``turns`` replies (or, when the model decides, until
    every unit sent has run); at most ``seconds + DIRECT_SLACK_TICKS`` ticks."""
    by_sid = {}
    for res, audio in zip(results, audios):
        res.sid = engine.open_session({"voice": res.voice, "instructions": INSTRUCTIONS})
        engine.push_audio(res.sid, audio)
        by_sid[res.sid] = res
    deadline = time.monotonic() + timeout
    limit = seconds + (DIRECT_SLACK_TICKS if turns is not None else 1)   # + 1: the tick that opens them
    for tick in range(limit):
        if turns is not None and all(r.done >= turns for r in results):
            break
        if time.monotonic() > deadline:
            raise DemoFailed(_timeout_message(engine, results, turns, timeout))
        for event in engine.tick():
            res = by_sid.get(event.sid)
            if res is None:
                continue
            if isinstance(event, AudioDelta):
                res.pcm.append(event.pcm16)
            elif isinstance(event, TextDelta):
                res.text.append(event.text)
            elif isinstance(event, ResponseDone):
                res.done += 1
        logger.info("demo: tick %d: %d replies so far", tick + 1, sum(r.done for r in results))
    if turns is not None and not all(r.done >= turns for r in results):
        raise DemoFailed(f"the engine ran {limit} ticks for {seconds} units sent and finished "
                         f"{sum(r.done for r in results)} of {turns * len(results)} replies")
    snapshot = engine.stats()
    for res in results:
        engine.close_session(res.sid)
    engine.tick()
    return snapshot


# ------------------------------------------------------------------------------ output

def write_wavs(results: list[ClientResult], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for res in results:
        path = out / f"session{res.index}_{res.voice}.wav"
        with wave.open(str(path), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(OUT_RATE)
            w.writeframes(b"".join(res.pcm))
        paths.append(path)
    return paths


def _p50_ms(engine: DuplexEngine, stage: str) -> float:
    """Median over the ticks in which the stage ran."""
    values = [v for v in engine.latency_history[stage] if v > 0]
    return 1000 * statistics.median(values) if values else 0.0


def report(engine: DuplexEngine, snapshot: EngineStats, results: list[ClientResult], mode: str,
           wall: float, late_ticks: int | None = None) -> str:
    """The table; ``late_ticks``: the server's count (its log's late ticks), else the engine's."""
    d = engine.deploy
    late = engine.late_ticks if late_ticks is None else late_ticks
    lines = [
        f"duplexcache demo ({mode}): preset {d.model.preset}, {len(results)} sessions, "
        f"{len({r.voice for r in results})} voices, {wall:.1f} s wall",
        describe_switches(d),
        f"ticks {snapshot.ticks} (late {late}); audio out "
        f"{sum(r.seconds_out for r in results):.2f} s; responses {sum(r.done for r in results)}; "
        f"context cache hits {snapshot.context_cache_hits} misses {snapshot.context_cache_misses}",
        "p50 latency per tick (ms): " + "  ".join(f"{s} {_p50_ms(engine, s):.1f}" for s in STAGES),
        f"{'pool (bytes)':<14}{'shared':>14}{'private':>14}{'free':>14}",
    ]
    pools = dict(snapshot.pools)
    pools["code2wav peak"] = engine.code2wav_peak   # streams end with their turn: show the busiest moment
    for name, tier in pools.items():
        lines.append(f"{name:<14}{tier.shared:>14,}{tier.private:>14,}{tier.free:>14,}")
    if d.model.checkpoint_dir is None:
        lines.append(RANDOM_WEIGHTS_NOTE)
    lines.append(f"{'session':<10}{'voice':<10}{'audio s':>9}  text")
    for r in results:
        lines.append(f"{r.index:<10}{r.voice:<10}{r.seconds_out:>9.2f}  {''.join(r.text)[:40]!r}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.sessions < 1 or args.seconds < 1 or args.voices < 1 or not args.timeout > 0:
        print("duplexcache demo: --sessions, --seconds and --voices must be >= 1 and --timeout > 0", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        deploy = demo_deploy(args.config)
    except (ConfigError, OSError) as exc:
        print(f"duplexcache demo: {exc}", file=sys.stderr)
        return 2
    print(f"duplexcache demo: building the {deploy.model.preset} engine on {deploy.model.device} "
          f"({'checkpoint ' + deploy.model.checkpoint_dir if deploy.model.checkpoint_dir else 'random weights'})",
          flush=True)
    engine = build_engine(deploy)
    served: list[bool] = []   # the loopback server started: its stop shuts the engine down
    try:
        return _run_built(args, deploy, engine, start, served)
    finally:
        if not served:
            engine.shutdown()


def _run_built(args: argparse.Namespace, deploy: DeployConfig, engine: DuplexEngine, start: float,
               served: list[bool]) -> int:
    names = engine.voices.names()
    if args.voices > len(names):
        print(f"duplexcache demo: only {len(names)} voices exist ({', '.join(names)})", file=sys.stderr)
        return 2
    turns = expected_turns(engine, args.seconds)
    if turns == 0:
        print(f"duplexcache demo: --seconds {args.seconds} is too short for a reply: the speaking policy "
              f"ends a turn every {engine.policy.k} units", file=sys.stderr)
        return 2
    results = [ClientResult(i, names[i % args.voices]) for i in range(args.sessions)]
    audios = [client_audio(i, args.seconds) for i in range(args.sessions)]
    mode = "direct"
    if not args.direct:
        try:
            import duplexcache.server.app
            import duplexcache.server.loopback  # noqa: F401
            mode = "WebSocket server on loopback"
        except ImportError as exc:
            print(f"duplexcache demo: server not importable ({exc}); driving the engine directly")
    wanted = (f"{turns} replies each" if turns is not None
              else f"every unit to run ({args.seconds} ticks + {EXTRA_TICKS})")
    print(f"duplexcache demo: {describe_switches(deploy)}\n"
          f"duplexcache demo: {mode}: {args.sessions} clients send {args.seconds} s of audio and wait for "
          f"{wanted} (deadline {args.timeout:g} s)", flush=True)
    late: list[int | None] = []   # the server's late ticks, read from its /metrics
    try:
        if mode == "direct":
            snapshot = _run_direct(engine, results, audios, args.seconds, turns, args.timeout)
        else:
            snapshot = asyncio.run(_run_server(engine, deploy, results, audios, turns, args.seconds, args.timeout,
                                               served, late))
    except (DemoFailed, ServerError) as exc:
        print(f"duplexcache demo: FAILED: {exc}", file=sys.stderr)
        return 1
    print(report(engine, snapshot, results, mode, time.perf_counter() - start, late[0] if late else None))
    if sum(r.seconds_out for r in results) == 0:
        print(f"duplexcache demo: FAILED: no audio came back ({sum(r.done for r in results)} replies); "
              f"{diagnose(engine)}", file=sys.stderr)
        return 1
    paths = write_wavs(results, Path(args.out))
    print(f"wrote {len(paths)} WAV files under {args.out}")
    return 0
