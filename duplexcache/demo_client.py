"""The demo's WebSocket client: everything it knows about the wire protocol is in this module.

One client opens a session, streams its audio, then waits — by events, with no idle timer — until
``done(result)`` says it has what it asked for (e.g. N ``response.done`` events). The caller puts
one overall deadline around all clients; this module never gives up on its own.

Protocol tolerance: the server may send ``session.created`` on connect, before any client event
(OpenAI's order), or only in answer to the first ``session.update`` (this project's older order),
and may answer ``session.update`` with ``session.updated``. The client sends its
``session.update`` at once and starts streaming at the first of ``session.created`` /
``session.updated``: frames on one socket are handled in order, so the update is applied before
the first audio either way. Spoken text may arrive as ``response.output_text.delta`` or as
``response.output_audio_transcript.delta``; unknown events are ignored.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import numpy as np

logger = logging.getLogger(__name__)

OUT_RATE = 24_000          # response.output_audio.delta: pcm16 mono at 24 kHz
SEND_SAMPLES = 4_000       # 0.25 s of 16 kHz input per input_audio_buffer.append
SESSION_EVENTS = ("session.created", "session.updated")
TEXT_EVENTS = ("response.output_text.delta", "response.output_audio_transcript.delta")


class ServerError(RuntimeError):
    """The server sent an ``error`` event, or closed the socket before the client was done."""


@dataclass
class ClientResult:
    index: int
    voice: str
    sid: str = ""
    pcm: list[bytes] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    done: int = 0                                   # response.done events seen (replies)
    closing: bool = False                           # session.close sent: its response.done is no reply
    changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # set on each response.done

    @property
    def seconds_out(self) -> float:
        return sum(len(p) for p in self.pcm) / 2 / OUT_RATE


def session_update(voice: str, instructions: str) -> dict[str, Any]:
    # input_audio_format pcm16 = 16 kHz mono int16 little-endian, the engine's own rate
    return {"type": "session.update",
            "session": {"voice": voice, "instructions": instructions, "input_audio_format": "pcm16"}}


def audio_append(pcm16: np.ndarray) -> dict[str, Any]:
    return {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm16.tobytes()).decode("ascii")}


def take_event(res: ClientResult, event: dict[str, Any]) -> None:
    """Fold one server event into ``res``; an ``error`` event fails the client."""
    kind = event.get("type")
    if kind == "response.output_audio.delta":
        res.pcm.append(base64.b64decode(event["delta"]))
    elif kind in TEXT_EVENTS:
        res.text.append(event["delta"])
    elif kind == "response.done" and not res.closing:
        res.done += 1
        res.changed.set()
    elif kind in SESSION_EVENTS:
        res.sid = event.get("session", {}).get("id") or res.sid
    elif kind == "error":
        raise ServerError(f"client {res.index}: server error {event.get('error')}")


async def _receive(ws: Any, res: ClientResult, session_ready: asyncio.Event) -> None:
    """Every event until the server closes the socket."""
    async for frame in ws:
        event = json.loads(frame)
        take_event(res, event)
        if event.get("type") in SESSION_EVENTS:
            session_ready.set()


async def run_client(url: str, res: ClientResult, audio: np.ndarray, instructions: str,
                     done: Callable[[ClientResult], Awaitable[None]], ready: asyncio.Event,
                     close: asyncio.Event) -> None:
    """Stream ``audio`` (float32, 16 kHz), await ``done(res)``, set ``ready``, close once ``close`` is set."""
    from websockets.asyncio.client import connect

    async with connect(url, max_size=None, open_timeout=60) as ws:
        session_ready = asyncio.Event()
        receiver = asyncio.create_task(_receive(ws, res, session_ready))
        try:
            await ws.send(json.dumps(session_update(res.voice, instructions)))
            await _unless_receiver_ends(receiver, session_ready.wait(), res, "before the session was created")
            pcm16 = (np.clip(audio, -1, 1) * 32767).astype("<i2")
            for start in range(0, pcm16.size, SEND_SAMPLES):
                await ws.send(json.dumps(audio_append(pcm16[start:start + SEND_SAMPLES])))
            await _unless_receiver_ends(receiver, done(res), res, "before the replies were done")
            ready.set()
            await close.wait()
            res.closing = True
            await ws.send(json.dumps({"type": "session.close"}))
            await receiver  # the server answers and closes the socket
        finally:
            receiver.cancel()


async def _unless_receiver_ends(receiver: asyncio.Task, wait: Awaitable[None], res: ClientResult,
                                when: str) -> None:
    """Await ``wait``; if the receiver ends first (server error or closed socket), raise why."""
    waiter = asyncio.ensure_future(wait)
    try:
        await asyncio.wait({receiver, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not waiter.done():
            waiter.cancel()
    if waiter.done() and not waiter.cancelled():
        waiter.result()
        return
    if receiver.exception() is not None:
        raise receiver.exception()
    raise ServerError(f"client {res.index}: the server closed the connection {when}")


def until_responses(count: int) -> Callable[[ClientResult], Awaitable[None]]:
    """``done`` for a known number of replies: returns at the ``count``-th ``response.done``."""
    async def wait(res: ClientResult) -> None:
        while res.done < count:
            res.changed.clear()
            await res.changed.wait()
    return wait
