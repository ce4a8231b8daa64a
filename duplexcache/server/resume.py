"""Sessions that outlive their connection: a dropped client comes back with its resume token.

A voice call runs over networks that drop for a second and come back. When a client's
connection ends without a goodbye of its own (the network dropped: no close frame, or its
keepalive pings went unanswered; :data:`CLIENT_GOODBYES` says what counts as one), its session
is *parked* for ``server.resume_window_s`` instead of ended:

* the engine session stays as it was: Thinker context, voice, place in the conversation, and
  its admission (it still counts against ``server.max_sessions_per_client``);
* its input is heard as silence (the engine fills a session that sends nothing with silence
  after ``scheduler.fill_silence_after_ms``: runtime/scheduler/core.py ``SilenceFill``);
* what the session sends meanwhile -- the events its old connection had not written yet, then
  every new one -- is kept in a :class:`KeptOutbox`, bounded as a live connection's outbox is
  (``server.max_outbox_bytes``, 1024 events): audio past the bound is dropped and counted, any
  other event past it ends the parked session (its client could not have read it either).

A new WebSocket to ``/v1/realtime?resume=<token>`` (``&resume_replay=skip`` to leave out the kept
audio; ``replay``, the default, sends it) from the same client address re-attaches to the
session: ``session.resumed`` {resume_token (a new one), replayed_audio_ms, skipped_audio_ms,
dropped_audio_ms}, then the kept events in order, then the session goes on. Every token resumes
once; a refusal is an ``error`` event with one of :data:`REFUSALS`' codes, then close 1008.
A parked session past its window is closed like any other (the engine frees its memory) at the
next housekeeping pass of the server (every 0.5 s or less).

Tokens are ``secrets.token_urlsafe(32)`` (256 bits), kept here only as SHA-256 digests, bound to
the client address the per-client caps count (server/auth.py ``client_address``: the TCP peer,
or the forwarded address when the peer is a trusted proxy). A replica of a cluster prefixes its
tokens with its id and a dot, which the proxy reads to send the resume to that replica
(cluster/proxy.py).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from duplexcache.server import protocol as proto
from duplexcache.server.connection import MAX_PENDING_EVENTS, Connection, _Out, close_frame_received

if TYPE_CHECKING:
    from duplexcache.server.realtime_session import RealtimeSession

logger = logging.getLogger(__name__)

RESUME_QUERY = "resume"             # ?resume=<token>
REPLAY_QUERY = "resume_replay"      # ?resume_replay=replay|skip
REPLAY_MODES = ("replay", "skip")
# WebSocket close codes that end a session without parking it: the client said goodbye (1000
# normal, 1001 going away: a page closed). A close frame without a code (1005: a browser's
# ws.close()) is one too, but uvicorn reports a connection lost without any close frame as 1005
# as well, so 1005 is a goodbye only where the server can see that a close frame arrived
# (connection.close_frame_received). Anything else -- a lost connection (1006, or 1005 without a
# frame), a client's error code -- is a network or a client that dropped, and parks the session.
CLIENT_GOODBYES = frozenset({1000, 1001})
NO_STATUS = 1005
# Tokens of sessions that ended, remembered to refuse them by name (resume_expired, ...) rather
# than as unknown; the oldest are forgotten first.
REMEMBERED_ENDED_TOKENS = 4096
MAX_TOKEN_CHARS = 256               # longer is not a token of ours (refused before hashing it)

REFUSALS = {
    "resume_disabled": "this server does not resume sessions (server.resume_window_s is 0)",
    "resume_unknown": "no session of this server has this resume token (a cluster: its replica may be gone)",
    "resume_forbidden": "this resume token was given to another client",
    "resume_expired": "the session was not resumed within server.resume_window_s and has been closed",
    "resume_used": "this resume token was used already; the resumed session.resumed event carried a new one",
    "resume_ended": "the session has ended (it was closed, or it had not started when its connection dropped)",
    "resume_dialect_mismatch": "the session speaks another protocol dialect than this connection",
}


@dataclass(frozen=True)
class ResumeRefusal:
    code: str
    message: str
    param: str = RESUME_QUERY


@dataclass(frozen=True)
class ResumeReport:
    """What ``session.resumed`` tells the client about the gap."""

    resume_token: str
    replayed_audio_ms: int
    skipped_audio_ms: int
    dropped_audio_ms: int
    parked_ms: int


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def route_prefix_of(token: str) -> str | None:
    """The replica id a cluster token starts with (``<replica>.<secret>``), or None."""
    prefix, dot, _ = token.rpartition(".")
    return prefix if dot and prefix else None


class KeptOutbox:
    """Stands in for a parked session's :class:`Connection`: keeps what the session sends.

    It has the members a session uses of its connection (``send``, ``drop_pending``,
    ``played_ms``, ``close`` ...), so the engine's output goes on reaching the session as if its
    client were there."""

    ws = None

    def __init__(self, old: Connection, max_bytes: int, max_events: int = MAX_PENDING_EVENTS):
        self.label = old.label
        self.output_bytes_per_ms = old.output_bytes_per_ms
        self.sent_audio_bytes = old.sent_audio_bytes    # what the old socket wrote (a cancel's played_ms)
        self.items: collections.deque[_Out] = collections.deque(old.take_backlog())
        self.bytes = sum(len(item.text) for item in self.items)
        self.max_bytes = max_bytes
        self.max_events = max_events
        self.dropped_audio_bytes = 0
        self.closing = False       # the session must end (a close, or a non-audio event past the bound)
        self.dropped = False

    def send(self, event: dict[str, Any], *, response_id: str | None = None, audio_bytes: int = 0) -> None:
        if self.closing:
            return
        text = proto.encode(event)
        if len(self.items) >= self.max_events or self.bytes + len(text) > self.max_bytes:
            if audio_bytes:
                self.dropped_audio_bytes += audio_bytes   # said in session.resumed (dropped_audio_ms)
                return
            logger.warning("parked session %s: %s does not fit what it keeps (%d events, %d bytes); ending it",
                           self.label, event.get("type"), len(self.items), self.bytes)
            self.closing = True
            return
        self.items.append(_Out(text, str(event.get("type")), response_id, audio_bytes))
        self.bytes += len(text)

    def drop_pending(self, response_id: str) -> int:
        keep = [item for item in self.items if item.response_id != response_id]
        dropped = len(self.items) - len(keep)
        self.items = collections.deque(keep)
        self.bytes = sum(len(item.text) for item in keep)
        return dropped

    def played_ms(self, response_id: str) -> int:
        return self.sent_audio_bytes.get(response_id, 0) // self.output_bytes_per_ms

    def audio_ms(self, items: Any = None) -> int:
        return sum(item.audio_bytes for item in (self.items if items is None else items)) // self.output_bytes_per_ms

    def discard_backlog(self) -> None:
        self.items.clear()
        self.bytes = 0

    def close(self, code: int, reason: str) -> None:
        self.closing = True

    def drop(self, code: int, reason: str) -> None:
        self.closing = True

    def abort(self) -> None:
        pass

    async def finish(self, timeout: float | None = None) -> None:
        pass


@dataclass
class _Ticket:
    session: "RealtimeSession"
    client: str
    parked_at: float | None = None      # clock time it was parked; None while connected
    dropped_ms: int = 0


class ParkedSessions:
    """Resume tokens of the server's sessions, and the sessions parked waiting for theirs.

    Owned by :class:`~duplexcache.server.app.RealtimeServer`, which asks it at each disconnect
    (:meth:`park`), at each ``?resume=`` handshake (:meth:`claim`, :meth:`attach`) and at each
    housekeeping pass (:meth:`due`: the parked sessions to close now)."""

    def __init__(self, window_s: float, max_bytes: int, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.max_bytes = max_bytes
        self.clock = clock
        self.route_prefix = ""                           # a cluster replica's id (cluster/replica.py)
        self._tickets: dict[str, _Ticket] = {}           # token digest -> ticket, one per session
        self._digest_of: dict["RealtimeSession", str] = {}   # session -> its token's digest
        # digest -> (refusal code, client) of tokens that no longer resume (oldest first)
        self._ended: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.window_s > 0

    def __len__(self) -> int:
        """Sessions parked now."""
        return sum(ticket.parked_at is not None for ticket in self._tickets.values())

    # ---------------------------------------------------------------- tokens

    def issue(self, session: "RealtimeSession") -> str | None:
        """A new resume token for ``session`` (its previous one stops working); None when off."""
        if not self.enabled:
            return None
        old = self._digest_of.get(session)
        ticket = self._tickets.pop(old) if old is not None else _Ticket(session, session.client)
        if old is not None:
            self._remember(old, "resume_used", ticket.client)
        token = secrets.token_urlsafe(32)
        if self.route_prefix:
            token = f"{self.route_prefix}.{token}"
        digest = _digest(token)
        self._tickets[digest] = ticket
        self._digest_of[session] = digest
        return token

    def forget(self, session: "RealtimeSession", code: str = "resume_ended") -> None:
        """``session`` ended: its token is refused with ``code`` from now on."""
        digest = self._digest_of.pop(session, None)
        if digest is not None:
            ticket = self._tickets.pop(digest)
            self._remember(digest, code, ticket.client)

    def _remember(self, digest: str, code: str, client: str) -> None:
        self._ended[digest] = (code, client)
        self._ended.move_to_end(digest)
        while len(self._ended) > REMEMBERED_ENDED_TOKENS:
            self._ended.popitem(last=False)

    # ---------------------------------------------------------------- parking

    def is_parked(self, session: "RealtimeSession") -> bool:
        digest = self._digest_of.get(session)
        return digest is not None and self._tickets[digest].parked_at is not None

    def park(self, session: "RealtimeSession", conn: Connection, close_code: int | None) -> bool:
        """Park ``session`` whose connection ``conn`` ended with ``close_code`` (None: the server
        saw the transport die under it), if that is a dropped network and not a goodbye or the
        server's own close, and the session has an engine session to keep. True if parked: the
        session's ``conn`` is then a :class:`KeptOutbox`."""
        digest = self._digest_of.get(session)
        goodbye = close_code in CLIENT_GOODBYES or (close_code == NO_STATUS and close_frame_received(conn.ws))
        if digest is None or session.conn is not conn or conn.server_closed or session.sid is None or goodbye:
            return False
        ticket = self._tickets[digest]
        session.conn = KeptOutbox(conn, self.max_bytes)
        ticket.parked_at = self.clock()
        logger.info("session %s parked for %.0f s: its connection dropped (code %s); %d ms of reply audio kept",
                    session.log_name, self.window_s, close_code, session.conn.audio_ms())
        return True

    def due(self) -> list["RealtimeSession"]:
        """Parked sessions to close now: their window passed (their tokens then answer
        resume_expired), or they were closed while parked: they could not keep what they were
        sent, or the engine ended them (resume_ended)."""
        now = self.clock()
        out = []
        for digest, ticket in list(self._tickets.items()):
            if ticket.parked_at is None:
                continue
            if getattr(ticket.session.conn, "closing", False):   # closed while parked (the bound, an engine error)
                logger.info("parked session %s was closed while parked; ending it", ticket.session.log_name)
                self.forget(ticket.session, "resume_ended")
                out.append(ticket.session)
            elif now - ticket.parked_at >= self.window_s:
                logger.info("parked session %s was not resumed within %.0f s; closing it",
                            ticket.session.log_name, self.window_s)
                self.forget(ticket.session, "resume_expired")
                out.append(ticket.session)
        return out

    # ---------------------------------------------------------------- resuming

    def claim(self, query: Mapping[str, str], client: str, dialect: str) -> "RealtimeSession | ResumeRefusal":
        """The session the handshake's ``resume`` token names, if this client may resume it now."""
        token = query.get(RESUME_QUERY, "")
        replay = query.get(REPLAY_QUERY, "replay")
        if replay not in REPLAY_MODES:
            return ResumeRefusal("invalid_value", f"{REPLAY_QUERY} must be one of {', '.join(REPLAY_MODES)}, got "
                                 f"{proto.clip(replay)!r}", REPLAY_QUERY)
        if not self.enabled:
            return _refusal("resume_disabled")
        digest = _digest(token) if 0 < len(token) <= MAX_TOKEN_CHARS else ""
        ticket = self._tickets.get(digest)
        if ticket is None:
            code, owner = self._ended.get(digest, ("resume_unknown", client))
            return _refusal("resume_forbidden" if owner != client else code)
        if ticket.client != client:
            return _refusal("resume_forbidden")
        if ticket.session.handshake.dialect != dialect:
            return _refusal("resume_dialect_mismatch")
        conn = ticket.session.conn
        if ticket.session.sid is None or (isinstance(conn, Connection) and conn.server_closed):
            # no engine session (not opened, or being ended: a goodbye whose handler has not
            # finished), or a connection the server is closing: nothing to take over
            return _refusal("resume_ended")
        return ticket.session

    def attach(self, session: "RealtimeSession", conn: Connection, replay: bool) -> ResumeReport:
        """Re-attach ``session`` (from :meth:`claim`) to ``conn``: the kept events are queued on it
        (without the kept audio unless ``replay``) and the session gets a new token. A session
        still attached to a connection (the server has not yet seen that one drop: a half-open
        socket) is taken from it first; that connection is closed with 1001."""
        ticket = self._tickets[self._digest_of[session]]
        old = session.conn
        if isinstance(old, Connection):
            logger.info("session %s is resumed while its old connection is still open; closing that one",
                        session.log_name)
            session.conn = KeptOutbox(old, self.max_bytes)
            ticket.parked_at = self.clock()
            old.close(proto.CLOSE_GOING_AWAY, "session resumed on another connection")
        kept = session.conn
        assert isinstance(kept, KeptOutbox), "attach() of a session that is not parked"
        parked_ms = round((self.clock() - (ticket.parked_at or self.clock())) * 1000)
        items = list(kept.items) if replay else [item for item in kept.items if not item.audio_bytes]
        replayed_ms = kept.audio_ms(items)
        report = ResumeReport(self.issue(session) or "", replayed_ms, kept.audio_ms() - replayed_ms,
                              kept.dropped_audio_bytes // kept.output_bytes_per_ms, parked_ms)
        ticket.parked_at = None
        conn.label = session.id
        conn.output_bytes_per_ms = kept.output_bytes_per_ms
        conn.sent_audio_bytes = kept.sent_audio_bytes
        session.conn = conn
        session.announce_resumed(report)
        conn.adopt(items)
        logger.info("session %s resumed after %d ms parked: %d ms of audio replayed, %d ms skipped, %d ms dropped",
                    session.log_name, parked_ms, report.replayed_audio_ms, report.skipped_audio_ms,
                    report.dropped_audio_ms)
        return report


def _refusal(code: str) -> ResumeRefusal:
    return ResumeRefusal(code, REFUSALS[code])
