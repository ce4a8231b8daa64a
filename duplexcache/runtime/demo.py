"""``duplexcache demo``: several concurrent clients talk to the tiny engine on CPU.

It builds the engine (tiny preset, random weights; with no ``--config`` the three sharing
switches are turned on so there is something to share), serves it on loopback with the real
WebSocket server, and runs ``--sessions`` clients at once, alternating ``--voices`` voices. Each
client streams ``--seconds`` units of synthetic 16 kHz audio as fast as the server takes it,
waits for the turns the speaking policy will finish, saves the reply as a 24 kHz WAV under
``--out``, and closes. Without the web stack (``duplexcache.server`` not importable) the same
clients drive the engine directly, and the demo says so.

The table at the end: sessions, ticks, audio seconds out, per-stage p50 latency over the ticks
that ran units, bytes per tier of each pool while all sessions were live, context-cache hits.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import statistics
import sys
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from duplexcache.config import DeployConfig
from duplexcache.runtime.engine import STAGES, DuplexEngine, build_engine
from duplexcache.runtime.engine_api import (
    AudioDelta,
    EngineStats,
    ResponseDone,
    TextDelta,
)
from duplexcache.runtime.policy import ScriptedPolicy

logger = logging.getLogger(__name__)

FIRST_UNIT, UNIT = 16_560, 16_000
OUT_RATE = 24_000
SEND_SAMPLES = 4_000      # 0.25 s per input_audio_buffer.append
IDLE_TIMEOUT_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", type=int, default=4, help="concurrent clients (default 4)")
    parser.add_argument("--seconds", type=int, default=3, help="seconds (units) of audio per client (default 3)")
    parser.add_argument("--voices", type=int, default=2, help="voices to alternate (default 2)")
    parser.add_argument("--config", metavar="YAML", help="deploy config (default: tiny preset, sharing on)")
    parser.add_argument("--out", default="out/demo", help="directory for the reply WAV files (default out/demo)")
    parser.add_argument("--direct", action="store_true", help="drive the engine directly, without the server")


@dataclass
class ClientResult:
    index: int
    voice: str
    sid: str = ""
    pcm: list[bytes] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    done: int = 0

    @property
    def seconds_out(self) -> float:
        return sum(len(p) for p in self.pcm) / 2 / OUT_RATE


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


# ------------------------------------------------------------------------------ server clients

async def _ws_client(url: str, res: ClientResult, audio: np.ndarray, turns: int | None,
                     ready: asyncio.Event, close: asyncio.Event) -> None:
    from websockets.asyncio.client import connect

    async with connect(url, max_size=None, open_timeout=20) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {"voice": res.voice,
                                                                       "instructions": "You are a demo."}}))
        created = json.loads(await ws.recv())
        if created["type"] != "session.created":
            raise RuntimeError(f"client {res.index}: expected session.created, got {created}")
        res.sid = created["session"]["id"]
        pcm16 = (np.clip(audio, -1, 1) * 32767).astype("<i2")
        for start in range(0, pcm16.size, SEND_SAMPLES):
            chunk = base64.b64encode(pcm16[start:start + SEND_SAMPLES].tobytes()).decode()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        while turns is None or res.done < turns:
            try:
                event = json.loads(await asyncio.wait_for(ws.recv(), IDLE_TIMEOUT_S))
            except asyncio.TimeoutError:
                break
            _take(res, event)
        ready.set()
        await close.wait()
        await ws.send(json.dumps({"type": "session.close"}))
        async for _ in ws:  # drain until the server closes the socket
            pass


def _take(res: ClientResult, event: dict) -> None:
    kind = event["type"]
    if kind == "response.output_audio.delta":
        res.pcm.append(base64.b64decode(event["delta"]))
    elif kind == "response.output_text.delta":
        res.text.append(event["delta"])
    elif kind == "response.done":
        res.done += 1
    elif kind == "error":
        raise RuntimeError(f"client {res.index}: server error {event['error']}")


async def _run_server(engine: DuplexEngine, deploy: DeployConfig, results: list[ClientResult],
                      audios: list[np.ndarray], turns: int | None) -> EngineStats:
    from duplexcache.server.app import REALTIME_PATH, create_app
    from duplexcache.server.loopback import LoopbackServer

    srv = LoopbackServer(create_app(engine, deploy), max_frame_bytes=deploy.server.max_frame_bytes).start()
    try:
        readies = [asyncio.Event() for _ in results]
        close = asyncio.Event()
        url = srv.ws_url(REALTIME_PATH)
        tasks = [asyncio.create_task(_ws_client(url, r, a, turns, ev, close))
                 for r, a, ev in zip(results, audios, readies)]
        await _wait_ready(readies, tasks)
        snapshot = engine.stats()   # every session is still live here
        close.set()
        await asyncio.gather(*tasks)
        return snapshot
    finally:
        await asyncio.to_thread(srv.stop)


async def _wait_ready(readies: list[asyncio.Event], tasks: list[asyncio.Task]) -> None:
    """Until every client got its replies; a failing client fails the demo at once."""
    waiting = [asyncio.create_task(ev.wait()) for ev in readies]
    pending = set(waiting) | set(tasks)
    while not all(ev.is_set() for ev in readies):
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task.exception() is not None:
                raise task.exception()


# ------------------------------------------------------------------------------ direct mode

def _run_direct(engine: DuplexEngine, results: list[ClientResult], audios: list[np.ndarray],
                seconds: int) -> EngineStats:
    by_sid = {}
    for res, audio in zip(results, audios):
        res.sid = engine.open_session({"voice": res.voice, "instructions": "You are a demo."})
        engine.push_audio(res.sid, audio)
        by_sid[res.sid] = res
    for _ in range(seconds + 1):
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
    snapshot = engine.stats()
    for res in results:
        engine.close_session(res.sid)
    engine.tick()
    engine.shutdown()
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
           wall: float) -> str:
    d = engine.deploy
    lines = [
        f"duplexcache demo ({mode}): preset {d.model.preset}, {len(results)} sessions, "
        f"{len({r.voice for r in results})} voices, {wall:.1f} s wall",
        f"switches: shared_anchor_blocks={d.stage0.shared_anchor_blocks} "
        f"duplex_context_caching={d.context_cache.duplex_context_caching} "
        f"cfm_prompt_att_sharing={d.code2wav.cfm_prompt_att_sharing} speak_policy={d.engine.speak_policy.mode}",
        f"ticks {snapshot.ticks} (late {engine.late_ticks}); audio out "
        f"{sum(r.seconds_out for r in results):.2f} s; responses {sum(r.done for r in results)}; "
        f"context cache hits {snapshot.context_cache_hits} misses {snapshot.context_cache_misses}",
        "p50 latency per tick (ms): " + "  ".join(f"{s} {_p50_ms(engine, s):.1f}" for s in STAGES),
        f"{'pool (bytes)':<14}{'shared':>14}{'private':>14}{'free':>14}",
    ]
    pools = dict(snapshot.pools)
    pools["code2wav peak"] = engine.code2wav_peak   # streams end with their turn: show the busiest moment
    for name, tier in pools.items():
        lines.append(f"{name:<14}{tier.shared:>14,}{tier.private:>14,}{tier.free:>14,}")
    lines.append(f"{'session':<10}{'voice':<10}{'audio s':>9}  text")
    for r in results:
        lines.append(f"{r.index:<10}{r.voice:<10}{r.seconds_out:>9.2f}  {''.join(r.text)[:40]!r}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.sessions < 1 or args.seconds < 1 or args.voices < 1:
        print("duplexcache demo: --sessions, --seconds and --voices must be >= 1", file=sys.stderr)
        return 2
    start = time.perf_counter()
    deploy = demo_deploy(args.config)
    engine = build_engine(deploy)
    names = engine.voices.names()
    if args.voices > len(names):
        print(f"duplexcache demo: only {len(names)} voices exist ({', '.join(names)})", file=sys.stderr)
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
    if mode == "direct":
        snapshot = _run_direct(engine, results, audios, args.seconds)
    else:
        snapshot = asyncio.run(_run_server(engine, deploy, results, audios, expected_turns(engine, args.seconds)))
    paths = write_wavs(results, Path(args.out))
    print(report(engine, snapshot, results, mode, time.perf_counter() - start))
    print(f"wrote {len(paths)} WAV files under {args.out}")
    return 0
