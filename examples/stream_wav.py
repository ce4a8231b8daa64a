"""Stream a 16 kHz mono WAV to a duplexcache server and write the spoken reply to a 24 kHz WAV.

    duplexcache serve &                      # tiny preset on CPU
    python examples/stream_wav.py --in question.wav --out reply.wav
    python examples/stream_wav.py --out reply.wav          # no --in: a 3 s test tone

Audio goes out in real-time-sized chunks (``--chunk-ms``, paced at real time unless
``--fast``); the reply's ``response.output_audio.delta`` events are collected while sending.
Once the input is sent and the server has been quiet for ``--idle-seconds``, the client sends
``session.close`` and writes what it got. Needs only ``websockets`` and numpy.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import time
import wave
from dataclasses import dataclass, field

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

IN_RATE = 16_000
OUT_RATE = 24_000


@dataclass
class Reply:
    session: dict = field(default_factory=dict)
    audio: bytearray = field(default_factory=bytearray)  # pcm16 at 24 kHz
    text: list[str] = field(default_factory=list)
    responses: int = 0
    errors: list[dict] = field(default_factory=list)
    last_event: float = field(default_factory=time.monotonic)


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


async def _receive(ws, reply: Reply) -> None:
    try:
        async for frame in ws:
            event = json.loads(frame)
            reply.last_event = time.monotonic()
            kind = event.get("type")
            if kind == "response.output_audio.delta":
                reply.audio += base64.b64decode(event["delta"])
            elif kind == "response.output_text.delta":
                reply.text.append(event["delta"])
            elif kind == "response.done":
                reply.responses += 1
            elif kind == "error":
                reply.errors.append(event["error"])
                print(f"server error: {event['error']}", file=sys.stderr)
    except ConnectionClosed:
        pass


async def _send_audio(ws, samples: np.ndarray, chunk: int, realtime: bool) -> None:
    start = time.monotonic()
    for i, offset in enumerate(range(0, len(samples), chunk)):
        data = samples[offset:offset + chunk].astype("<i2").tobytes()
        await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                  "audio": base64.b64encode(data).decode("ascii")}))
        if realtime:  # pace against the wall clock so sending drift does not accumulate
            await asyncio.sleep(max(0.0, start + (i + 1) * chunk / IN_RATE - time.monotonic()))


async def stream(url: str, samples: np.ndarray, *, instructions: str = "", voice: str | None = None,
                 chunk_ms: int = 100, realtime: bool = True, idle_seconds: float = 2.0,
                 timeout: float = 60.0) -> Reply:
    """Run one session: send ``samples`` (int16, 16 kHz), collect the reply."""
    session: dict = {"instructions": instructions, "input_audio_format": "pcm16"}
    if voice:
        session["voice"] = voice
    reply = Reply()
    async with connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        first = json.loads(await asyncio.wait_for(ws.recv(), timeout))
        if first.get("type") != "session.created":
            raise RuntimeError(f"session was not created: {first}")
        reply.session = first["session"]
        receiver = asyncio.create_task(_receive(ws, reply))
        await _send_audio(ws, samples, max(1, IN_RATE * chunk_ms // 1000), realtime)
        deadline = time.monotonic() + timeout
        reply.last_event = max(reply.last_event, time.monotonic())
        while time.monotonic() - reply.last_event < idle_seconds and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await ws.send(json.dumps({"type": "session.close"}))
        await asyncio.wait_for(receiver, timeout)  # ends when the server closes the socket
    return reply


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://127.0.0.1:8000/v1/realtime")
    parser.add_argument("--in", dest="inp", help="16 kHz mono 16-bit WAV (default: a test tone)")
    parser.add_argument("--out", default="reply.wav", help="where to write the 24 kHz reply")
    parser.add_argument("--instructions", default="You are a helpful voice assistant.")
    parser.add_argument("--voice", default=None)
    parser.add_argument("--tone-seconds", type=float, default=3.0)
    parser.add_argument("--chunk-ms", type=int, default=100)
    parser.add_argument("--idle-seconds", type=float, default=2.0, help="quiet time that ends the reply")
    parser.add_argument("--fast", action="store_true", help="send as fast as possible, not in real time")
    args = parser.parse_args(argv)
    samples = read_wav_16k(args.inp) if args.inp else make_tone(args.tone_seconds)
    reply = asyncio.run(stream(args.url, samples, instructions=args.instructions, voice=args.voice,
                               chunk_ms=args.chunk_ms, realtime=not args.fast, idle_seconds=args.idle_seconds))
    write_wav_24k(args.out, bytes(reply.audio))
    print(f"session {reply.session.get('id')}: sent {len(samples) / IN_RATE:.2f} s, got "
          f"{len(reply.audio) / 2 / OUT_RATE:.2f} s of audio in {reply.responses} response(s), "
          f"{len(reply.errors)} error(s) -> {args.out}")
    return 1 if reply.errors else 0


if __name__ == "__main__":
    sys.exit(main())
