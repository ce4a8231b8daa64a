"""Stream a 16 kHz mono WAV to a duplexcache server and write the spoken reply to a 24 kHz WAV.

    duplexcache serve &                      # tiny preset on CPU
    python examples/stream_wav.py --in question.wav --out reply.wav
    python examples/stream_wav.py --out reply.wav          # no --in: a 3 s test tone

Audio goes out in real-time-sized chunks (``--chunk-ms``, paced at real time unless
``--fast``); the reply's ``response.output_audio.delta`` events are collected while sending. The
client then waits for ``--responses`` ``response.done`` events (a reply is done when the server
says so, however late its ticks run), sends ``session.close`` and writes what it got.
``--timeout`` is one overall deadline: reaching it, or getting no audio at all, exits 1 with the
reason (the server's late-tick figures from its ``/metrics`` when it can read them), as does a
server that cannot be reached or refuses the connection. A server with a key: set
``DUPLEXCACHE_API_KEY`` here too (sent as a Bearer header).
Needs only ``websockets`` and numpy.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import time
import urllib.error
import urllib.request
import wave
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

IN_RATE = 16_000
OUT_RATE = 24_000

# ---------------------------------------------------------------- the protocol, all of it
# The server may send session.created on connect (OpenAI's order) or in answer to our first
# session.update (older duplexcache), and may answer the update with session.updated: streaming
# starts at the first of them (one socket's frames are handled in order, so the update is applied
# before the audio either way). Spoken text comes as output_text or output_audio_transcript deltas.
SESSION_EVENTS = ("session.created", "session.updated")
AUDIO_DELTA = "response.output_audio.delta"
TEXT_DELTAS = ("response.output_text.delta", "response.output_audio_transcript.delta")
REPLY_DONE = "response.done"


def session_update(instructions: str, voice: str | None) -> dict:
    session: dict = {"instructions": instructions, "input_audio_format": "pcm16"}  # pcm16 at 16 kHz
    if voice:
        session["voice"] = voice
    return {"type": "session.update", "session": session}


def audio_append(pcm16: bytes) -> dict:
    return {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm16).decode("ascii")}


SESSION_CLOSE = {"type": "session.close"}
# ---------------------------------------------------------------- end of the protocol


class NoReply(RuntimeError):
    """The reply did not come within the deadline; the message says what is known about why."""


@dataclass
class Reply:
    session: dict = field(default_factory=dict)
    audio: bytearray = field(default_factory=bytearray)  # pcm16 at 24 kHz
    text: list[str] = field(default_factory=list)
    responses: int = 0
    errors: list[dict] = field(default_factory=list)
    session_ready: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # any response.done or error
    closing: bool = False  # session.close sent: its answering response.done is no reply
    wanted: int = 1  # replies to keep: a reply the server starts after them (before the close) is not ours

    @property
    def complete(self) -> bool:
        return self.responses >= self.wanted


def read_wav_16k(path: str) -> np.ndarray:
    """int16 samples of a 16 kHz mono 16-bit WAV (no resampling: say so instead)."""
    with wave.open(path, "rb") as wav:
        rate, channels, width = wav.getframerate(), wav.getnchannels(), wav.getsampwidth()
        if (rate, channels, width) != (IN_RATE, 1, 2):
            raise ValueError(f"{path}: need 16 kHz mono 16-bit PCM, got {rate} Hz, {channels} channel(s), "
                             f"{8 * width}-bit (convert it first, e.g. with sox or ffmpeg)")
        return np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2").copy()


def make_tone(seconds: float, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * IN_RATE)) / IN_RATE
    return (0.3 * 32767 * np.sin(2 * np.pi * freq * t)).astype("<i2")


def write_wav_24k(path: str, pcm16: bytes) -> None:
    with wave.open(path, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(OUT_RATE)
        wav.writeframes(pcm16)


def _take(reply: Reply, event: dict) -> None:
    kind = event.get("type")
    # Past the wanted replies the server may already have started another one (its response.done
    # can arrive before our session.close is read): it is neither counted nor written.
    if kind == AUDIO_DELTA and not reply.complete:
        reply.audio += base64.b64decode(event["delta"])
    elif kind in TEXT_DELTAS and not reply.complete:
        reply.text.append(event["delta"])
    elif kind == REPLY_DONE and not reply.closing and not reply.complete:
        reply.responses += 1
        reply.changed.set()
    elif kind in SESSION_EVENTS:
        reply.session = event.get("session", {}) or reply.session
        reply.session_ready.set()
    elif kind == "error":
        reply.errors.append(event.get("error"))
        reply.changed.set()
        print(f"server error: {event.get('error')}", file=sys.stderr)


async def _receive(ws, reply: Reply) -> None:
    try:
        async for frame in ws:
            _take(reply, json.loads(frame))
    except ConnectionClosed:
        pass


async def _send_audio(ws, samples: np.ndarray, chunk: int, realtime: bool) -> None:
    start = time.monotonic()
    for i, offset in enumerate(range(0, len(samples), chunk)):
        await ws.send(json.dumps(audio_append(samples[offset:offset + chunk].astype("<i2").tobytes())))
        if realtime:  # pace against the wall clock so sending drift does not accumulate
            await asyncio.sleep(max(0.0, start + (i + 1) * chunk / IN_RATE - time.monotonic()))


async def _until(reply: Reply, receiver: asyncio.Task, condition) -> bool:
    """Wait (by events) until ``condition()``; False if the server closed the socket first."""
    while not condition():
        if receiver.done():
            return False
        reply.changed.clear()
        waiter = asyncio.create_task(reply.changed.wait())
        await asyncio.wait({waiter, receiver}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
    return True


async def _session(url: str, samples: np.ndarray, reply: Reply, *, instructions: str, voice: str | None,
                   chunk_ms: int, realtime: bool, responses: int) -> None:
    async with connect(url, max_size=None, additional_headers=auth_headers() or None) as ws:
        receiver = asyncio.create_task(_receive(ws, reply))
        try:
            await ws.send(json.dumps(session_update(instructions, voice)))
            ready = asyncio.create_task(reply.session_ready.wait())
            await asyncio.wait({ready, receiver}, return_when=asyncio.FIRST_COMPLETED)
            ready.cancel()
            if not reply.session_ready.is_set():
                raise RuntimeError(f"the server closed the connection before creating the session "
                                   f"(errors: {reply.errors})")
            await _send_audio(ws, samples, max(1, IN_RATE * chunk_ms // 1000), realtime)
            if await _until(reply, receiver, lambda: reply.responses >= responses or reply.errors):
                reply.closing = True
                await ws.send(json.dumps(SESSION_CLOSE))
            await receiver  # ends when the server closes the socket
        finally:
            receiver.cancel()


async def stream(url: str, samples: np.ndarray, *, instructions: str = "", voice: str | None = None,
                 chunk_ms: int = 100, realtime: bool = True, responses: int = 1,
                 timeout: float = 300.0) -> Reply:
    """Run one session: send ``samples`` (int16, 16 kHz), collect ``responses`` replies.

    Raises NoReply (with the server's late-tick figures) when ``timeout`` seconds pass first."""
    reply = Reply(wanted=responses)
    try:
        await asyncio.wait_for(_session(url, samples, reply, instructions=instructions, voice=voice,
                                        chunk_ms=chunk_ms, realtime=realtime, responses=responses), timeout)
    except asyncio.TimeoutError:
        raise NoReply(f"{reply.responses} of {responses} replies and {len(reply.audio) / 2 / OUT_RATE:.2f} s "
                      f"of audio within --timeout {timeout:g} s; {await asyncio.to_thread(server_load, url)}") from None
    return reply


def metrics_url(ws_url: str) -> str:
    """The server's /metrics next to its WebSocket endpoint (ws -> http, wss -> https)."""
    parts = urlsplit(ws_url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, "/metrics", "", ""))


def auth_headers() -> dict[str, str]:
    """The server's key, if it has one: DUPLEXCACHE_API_KEY (the variable the server reads) as
    a Bearer header, for the WebSocket and for /metrics."""
    key = os.environ.get("DUPLEXCACHE_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def server_load(ws_url: str) -> str:
    """What the server's /metrics says about its ticks: how long they take and how many ran late."""
    url = metrics_url(ws_url)
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=auth_headers()), timeout=10) as response:
            text = response.read().decode("utf-8", "replace")
    except (OSError, urllib.error.URLError) as exc:
        return f"could not read the server's {url} ({exc})"
    values = {}
    for line in text.splitlines():  # Prometheus text format: "name{labels} value"
        name, _, value = line.rpartition(" ")
        if name and not line.startswith("#"):
            try:
                values[name] = float(value)
            except ValueError:
                continue
    count = values.get("duplexcache_tick_duration_seconds_count")
    if not count:
        return "the server has run no tick (is its engine stalled?)"
    late = int(values.get("duplexcache_late_ticks_total", 0))
    mean = values.get("duplexcache_tick_duration_seconds_sum", 0.0) / count
    if late:
        return (f"the server is overloaded: {late} of {int(count)} ticks ran late, {mean:.1f} s per tick on "
                f"average; try fewer sessions or a longer --timeout")
    return f"the server ran {int(count)} ticks ({mean:.2f} s each on average) without finishing the reply"


def refusal_reason(exc: Exception) -> str:
    """The server's own words from a refused handshake's JSON body (OpenAI's error shape), if any."""
    body = getattr(getattr(exc, "response", None), "body", None) or b""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return ""
    return f" ({message})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://127.0.0.1:8000/v1/realtime")
    parser.add_argument("--in", dest="inp", help="16 kHz mono 16-bit WAV (default: a test tone)")
    parser.add_argument("--out", default="reply.wav", help="where to write the 24 kHz reply")
    parser.add_argument("--instructions", default="You are a helpful voice assistant.")
    parser.add_argument("--voice", default=None)
    parser.add_argument("--tone-seconds", type=float, default=3.0)
    parser.add_argument("--chunk-ms", type=int, default=100)
    parser.add_argument("--responses", type=int, default=1, help="replies (response.done events) to wait for")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="overall deadline in seconds; reaching it is a failure (default 300)")
    parser.add_argument("--fast", action="store_true", help="send as fast as possible, not in real time")
    args = parser.parse_args(argv)
    if args.responses < 1 or not args.timeout > 0:
        parser.error("--responses must be >= 1 and --timeout > 0")
    samples = read_wav_16k(args.inp) if args.inp else make_tone(args.tone_seconds)
    try:
        reply = asyncio.run(stream(args.url, samples, instructions=args.instructions, voice=args.voice,
                                   chunk_ms=args.chunk_ms, realtime=not args.fast, responses=args.responses,
                                   timeout=args.timeout))
    except NoReply as exc:
        print(f"FAILED: no complete reply: {exc}", file=sys.stderr)
        return 1
    except InvalidHandshake as exc:   # e.g. HTTP 401 without the key, 429 over the per-address cap
        print(f"FAILED: the server at {args.url} refused the connection: {exc}{refusal_reason(exc)}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"FAILED: cannot connect to {args.url}: {exc}; is `duplexcache serve` running?", file=sys.stderr)
        return 1
    write_wav_24k(args.out, bytes(reply.audio))
    print(f"session {reply.session.get('id')}: sent {len(samples) / IN_RATE:.2f} s, got "
          f"{len(reply.audio) / 2 / OUT_RATE:.2f} s of audio in {reply.responses} response(s), "
          f"{len(reply.errors)} error(s) -> {args.out}")
    if not reply.audio:
        print("FAILED: no audio came back", file=sys.stderr)
        return 1
    return 1 if reply.errors else 0


if __name__ == "__main__":
    sys.exit(main())
