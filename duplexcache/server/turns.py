"""Engine output -> OpenAI response events, one response at a time per session.

The engine marks only the end of a reply (ResponseDone); a reply starts with the session's first
TextDelta/AudioDelta after the previous ResponseDone. :class:`ResponseTracker` assigns the
response and item ids and emits, in OpenAI's order::

    response.created, response.output_item.added, response.content_part.added,
    (response.output_audio.delta | response.output_audio_transcript.delta)*,
    response.output_audio.done, response.output_audio_transcript.done, response.content_part.done,
    response.output_item.done, response.done {status, usage}

Beta connections get the beta names of the renamed events (``response.audio.delta``, ...).

A text-only session (``modalities: ["text"]``, the engine's ``audio_output`` off) gets OpenAI's
text events instead: ``response.output_text.delta`` / ``response.output_text.done`` and
``output_text`` content, no audio events.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

from duplexcache.runtime.engine_api import ResponseUsage
from duplexcache.server.audio_io import PCM16_OUTPUT_BYTES_PER_SECOND
from duplexcache.server.protocol import event, new_id

OUTPUT_BYTES_PER_SECOND = PCM16_OUTPUT_BYTES_PER_SECOND  # RealtimeSession sets G.711's at open
_BETA_NAMES = {
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
    "conversation.item.added": "conversation.item.created",
}


def wire_name(kind: str, beta: bool) -> str:
    return _BETA_NAMES.get(kind, kind) if beta else kind


@dataclass
class Response:
    id: str
    item_id: str
    audio_bytes: int = 0
    text: list[str] = field(default_factory=list)
    cancelling: bool = False  # cancel asked for; ignore engine output until its ResponseDone
    metadata: dict[str, str] | None = None   # response.create's response.metadata, echoed back


@dataclass(frozen=True)
class Outgoing:
    event: dict[str, Any]
    response_id: str | None = None
    audio_bytes: int = 0


class ResponseTracker:
    def __init__(self, beta: bool):
        self.beta = beta
        self.audio_bytes_per_second = OUTPUT_BYTES_PER_SECOND   # of the client's output format
        self.current: Response | None = None
        self.last_item_id: str | None = None
        self.finished_items: set[str] = set()
        # response.create's metadata for the next response: clients (LiveKit's generate_reply)
        # match response.created to their request by it, as OpenAI echoes it.
        self.next_metadata: dict[str, str] | None = None
        self.text_only = False   # set at open: the session's replies are text (no audio events)

    def _ev(self, kind: str, **fields: Any) -> dict[str, Any]:
        return event(wire_name(kind, self.beta), **fields)

    def _part(self, text: str) -> dict[str, Any]:
        if self.text_only:
            return {"type": "output_text", "text": text}
        return {"type": "output_audio", "transcript": text}

    def _item(self, r: Response, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [self._part("".join(r.text))]
        return {"id": r.item_id, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": status, "content": content}

    def _ids(self, r: Response) -> dict[str, Any]:
        return {"response_id": r.id, "item_id": r.item_id, "output_index": 0, "content_index": 0}

    def _start(self) -> tuple[Response, list[Outgoing]]:
        if self.current is not None:
            return self.current, []
        r = self.current = Response(new_id("resp"), new_id("item"), metadata=self.next_metadata)
        self.next_metadata = None
        out = [
            Outgoing(self._ev("response.created", response={
                "id": r.id, "object": "realtime.response", "status": "in_progress", "status_details": None,
                "output": [], "usage": None, "metadata": r.metadata})),
            Outgoing(self._ev("response.output_item.added", response_id=r.id, output_index=0,
                              item=self._item(r, "in_progress"))),
            Outgoing(self._ev("conversation.item.added", previous_item_id=self.last_item_id,
                              item=self._item(r, "in_progress"))),
            Outgoing(self._ev("response.content_part.added", **self._ids(r), part=self._part(""))),
        ]
        self.last_item_id = r.item_id
        return r, out

    def on_audio(self, pcm16: bytes) -> list[Outgoing]:
        if self.current is not None and self.current.cancelling:
            return []
        r, out = self._start()
        r.audio_bytes += len(pcm16)
        delta = base64.b64encode(pcm16).decode("ascii")
        out.append(Outgoing(self._ev("response.output_audio.delta", **self._ids(r), delta=delta), r.id, len(pcm16)))
        return out

    def on_text(self, text: str) -> list[Outgoing]:
        if self.current is not None and self.current.cancelling:
            return []
        r, out = self._start()
        r.text.append(text)
        kind = "response.output_text.delta" if self.text_only else "response.output_audio_transcript.delta"
        out.append(Outgoing(self._ev(kind, **self._ids(r), delta=text), r.id))
        return out

    def mark_cancelling(self) -> Response | None:
        if self.current is not None:
            self.current.cancelling = True
        return self.current

    def on_done(self, status: str, usage: ResponseUsage | None) -> list[Outgoing]:
        r, out = self._start()
        self.current = None
        self.finished_items.add(r.item_id)
        transcript = "".join(r.text)
        ids = self._ids(r)
        audio_seconds = r.audio_bytes / self.audio_bytes_per_second
        if usage is None:
            usage = ResponseUsage(text_tokens=0, audio_seconds=audio_seconds)
        item_status = "completed" if status == "completed" else "incomplete"
        if self.text_only:
            out.append(Outgoing(self._ev("response.output_text.done", **ids, text=transcript)))
        else:
            out += [Outgoing(self._ev("response.output_audio.done", **ids)),
                    Outgoing(self._ev("response.output_audio_transcript.done", **ids, transcript=transcript))]
        out += [
            Outgoing(self._ev("response.content_part.done", **ids, part=self._part(transcript))),
            Outgoing(self._ev("response.output_item.done", response_id=r.id, output_index=0,
                              item=self._item(r, item_status))),
            Outgoing(self._ev("response.done", response={
                "id": r.id, "object": "realtime.response", "status": status,
                "status_details": None if status == "completed" else {"type": status, "reason": "client_cancelled"},
                "output": [self._item(r, item_status)], "metadata": r.metadata,
                "usage": {"total_tokens": usage.text_tokens, "input_tokens": 0, "output_tokens": usage.text_tokens,
                          "output_token_details": {"text_tokens": usage.text_tokens, "audio_tokens": 0},
                          "output_audio_seconds": round(usage.audio_seconds, 3)}})),
        ]
        return out
