"""server/resume.py on its own (no server, no engine): tokens, the kept events' bound, replay
or skip, expiry on a fake clock. The wire behaviour is tests/server/test_resume.py's."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from duplexcache.server import protocol as proto
from duplexcache.server.connection import Connection
from duplexcache.server.resume import KeptOutbox, ParkedSessions, ResumeRefusal

BYTES_PER_MS = 48   # pcm16 24 kHz


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass(eq=False)
class Session:
    client: str = "10.0.0.1"
    id: str = "sess_x"
    sid: str | None = "sess_x"
    conn: Any = None
    handshake: Any = field(default_factory=lambda: SimpleNamespace(dialect="openai"))
    resumed: list[Any] = field(default_factory=list)

    @property
    def log_name(self) -> str:
        return self.id

    def announce_resumed(self, report: Any) -> None:
        self.resumed.append(report)
        self.conn.send(proto.event("session.resumed", resume_token=report.resume_token))


def _conn() -> Connection:
    conn = Connection(SimpleNamespace(scope={}), max_bytes=1 << 20)
    conn.output_bytes_per_ms = BYTES_PER_MS
    return conn


def _audio(conn: Any, ms: int, rid: str = "resp_1") -> None:
    conn.send(proto.event("response.output_audio.delta", response_id=rid, delta="A" * 8),
              response_id=rid, audio_bytes=ms * BYTES_PER_MS)


def _registry(window_s: float = 30.0, max_bytes: int = 1 << 20) -> tuple[ParkedSessions, Clock]:
    clock = Clock()
    return ParkedSessions(window_s, max_bytes, clock=clock), clock


def _parked(registry: ParkedSessions) -> tuple[Session, str, Connection]:
    session = Session()
    old = _conn()
    session.conn = old
    token = registry.issue(session)
    _audio(old, 100)                     # queued, never written: kept for the resume
    assert registry.park(session, old, 1006)
    return session, token, old


def test_a_dropped_session_keeps_the_unwritten_events_and_replays_them():
    registry, clock = _registry()
    session, token, _ = _parked(registry)
    assert isinstance(session.conn, KeptOutbox) and len(registry) == 1
    _audio(session.conn, 200)
    session.conn.send(proto.event("response.done", response={"id": "resp_1"}), response_id="resp_1")
    clock.now += 5
    assert registry.claim({"resume": token}, "10.0.0.1", "openai") is session
    new = _conn()
    report = registry.attach(session, new, replay=True)
    assert (report.replayed_audio_ms, report.skipped_audio_ms, report.dropped_audio_ms, report.parked_ms) == \
        (300, 0, 0, 5000)
    assert session.conn is new and len(registry) == 0
    kinds = [item.kind for item in new._outbox]   # noqa: SLF001
    assert kinds == ["session.resumed", "response.output_audio.delta", "response.output_audio.delta", "response.done"]
    # the token resumed once; the new one works, the old one is refused by name
    used = registry.claim({"resume": token}, "10.0.0.1", "openai")
    assert isinstance(used, ResumeRefusal) and used.code == "resume_used" and used.param == "resume"
    assert registry.claim({"resume": report.resume_token}, "10.0.0.1", "openai") is session


def test_skip_leaves_out_the_kept_audio_but_not_the_other_events():
    registry, _ = _registry()
    session, token, _ = _parked(registry)
    session.conn.send(proto.event("response.done", response={"id": "resp_1"}), response_id="resp_1")
    new = _conn()
    report = registry.attach(session, new, replay=False)
    assert (report.replayed_audio_ms, report.skipped_audio_ms) == (0, 100)
    assert [item.kind for item in new._outbox] == ["session.resumed", "response.done"]   # noqa: SLF001


def test_the_kept_events_are_bounded_audio_dropped_and_counted_anything_else_ends_the_session():
    registry, _ = _registry(max_bytes=600)
    session, token, _ = _parked(registry)
    for _ in range(20):
        _audio(session.conn, 50)
    kept = session.conn
    assert kept.bytes <= 600 and kept.dropped_audio_bytes > 0 and not kept.closing
    kept.send(proto.event("response.done", response={"id": "resp_1", "pad": "x" * 700}))
    assert kept.closing                      # it could not keep a reply's end: the session ends
    assert registry.due() == [session]       # at the next housekeeping pass
    assert registry.claim({"resume": token}, "10.0.0.1", "openai").code == "resume_ended"


def test_refusals_and_expiry_on_the_clock():
    registry, clock = _registry(window_s=30.0)
    session, token, _ = _parked(registry)
    assert registry.claim({"resume": "nope"}, "10.0.0.1", "openai").code == "resume_unknown"
    assert registry.claim({"resume": ""}, "10.0.0.1", "openai").code == "resume_unknown"
    assert registry.claim({"resume": "x" * 10_000}, "10.0.0.1", "openai").code == "resume_unknown"
    assert registry.claim({"resume": token}, "10.0.0.2", "openai").code == "resume_forbidden"
    assert registry.claim({"resume": token}, "10.0.0.1", "minicpmo").code == "resume_dialect_mismatch"
    bad = registry.claim({"resume": token, "resume_replay": "later"}, "10.0.0.1", "openai")
    assert (bad.code, bad.param) == ("invalid_value", "resume_replay")
    clock.now += 29.9
    assert registry.due() == []
    clock.now += 0.2
    assert registry.due() == [session] and len(registry) == 0
    assert registry.claim({"resume": token}, "10.0.0.1", "openai").code == "resume_expired"
    assert registry.claim({"resume": token}, "10.0.0.9", "openai").code == "resume_forbidden"   # still not theirs


def test_goodbyes_and_server_closes_do_not_park():
    registry, _ = _registry()
    for code in (1000, 1001):
        session, conn = Session(), _conn()
        session.conn = conn
        registry.issue(session)
        assert not registry.park(session, conn, code)
    session, conn = Session(), _conn()
    session.conn = conn
    registry.issue(session)
    conn.closing = conn.server_closed = True   # a limit or an error closed it
    assert not registry.park(session, conn, None)
    session, conn = Session(sid=None), _conn()   # no engine session: nothing to keep
    session.conn = conn
    registry.issue(session)
    assert not registry.park(session, conn, 1006)
    # a session being ended (its engine session gone, its token not yet forgotten) is not taken over
    ending, conn = Session(), _conn()
    ending.conn = conn
    token = registry.issue(ending)
    ending.sid = None
    assert registry.claim({"resume": token}, "10.0.0.1", "openai").code == "resume_ended"
    ending.sid, conn.server_closed = "sess_x", True
    assert registry.claim({"resume": token}, "10.0.0.1", "openai").code == "resume_ended"
    off, _ = _registry(window_s=0)
    assert off.issue(Session()) is None
    assert off.claim({"resume": "t"}, "10.0.0.1", "openai").code == "resume_disabled"


def test_a_resume_takes_over_a_connection_the_server_still_holds():
    """A half-open socket: the client's network dropped but the server has not seen it yet."""
    async def main() -> None:   # the old connection's close starts its watchdog task
        registry, _ = _registry()
        session, old = Session(), _conn()
        session.conn = old
        token = registry.issue(session)
        _audio(old, 40)
        assert registry.claim({"resume": token}, "10.0.0.1", "openai") is session
        new = _conn()
        report = registry.attach(session, new, replay=True)
        assert session.conn is new and report.replayed_audio_ms == 40
        assert old.closing and old.server_closed   # closed with 1001; its handler will not end the session
        old._watchdog.cancel()   # noqa: SLF001 - no socket behind it to abort

    asyncio.run(main())
