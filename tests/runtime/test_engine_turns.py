"""Turn control (runtime/turns.py): manual mode, request/cancel with Thinker truncation, user text,
and the Stage 0 tail truncation it rests on. Engines run the tiny preset tick by tick."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import audio, collect, engine
from test_stage0 import BS, make_context, make_runner, make_thinker

from duplexcache.context.tokenizer import ByteTokenizer
from duplexcache.kv.window import WindowConfig
from duplexcache.runtime import turns
from duplexcache.runtime.engine_api import AudioDelta, ResponseDone, SessionError, TextDelta, UserTextTooLong
from duplexcache.runtime.policy import ControlTokens

# Every unit speaks while a reply runs (a turn ends only at unit 99): replies end by cancel.
LONG_TURNS = {"engine": {"speak_policy": {"mode": "every_k_units", "k": 100, "turn_units": 100}}}
UNIT_SPLIT = 16_560 + 4 * 16_000   # the first 5 units of a bystander's input
CONTROL = ControlTokens.from_tokenizer(ByteTokenizer())


# ---------------------------------------------------------------------- Stage 0 tail truncation

def _embeds(thinker, n: int, seed: int) -> torch.Tensor:
    ids = torch.randint(10, 500, (n,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return thinker.embed(ids)


@pytest.mark.parametrize("kept_after_anchor", [30, 0])
def test_drop_last_tokens_equals_a_session_that_never_had_them(kept_after_anchor):
    thinker = make_thinker()
    ctx = make_context(thinker, 40, seed=1)
    a, b = _embeds(thinker, kept_after_anchor, 2), _embeds(thinker, 25, 3)
    nxt = _embeds(thinker, 7, 4)
    run, ref = make_runner(thinker), make_runner(thinker)
    for r in (run, ref):
        r.open_session("s", ctx)
        r.open_session("other", ctx)      # shares the anchor's full blocks (sharing on)
        if kept_after_anchor:
            r.append({"s": a}, unit_start=True)
    run.append({"s": b}, unit_start=True)
    released = run.drop_last_tokens("s", 25)
    assert released                                     # whole blocks went back to the pool
    assert run.num_tokens("s") == ref.num_tokens("s") == 40 + kept_after_anchor
    assert run.pool_stats().free == ref.pool_stats().free
    assert run.sessions["s"].unit_starts == ref.sessions["s"].unit_starts
    run.manager.check_invariants()
    got = run.append({"s": nxt, "other": nxt[:3]}, unit_start=True)
    want = ref.append({"s": nxt, "other": nxt[:3]}, unit_start=True)
    assert torch.equal(got["s"], want["s"])
    assert torch.equal(got["other"], want["other"])     # the shared anchor was never written


def test_drop_last_tokens_refuses_the_anchor_and_follows_the_rebuild_history():
    thinker = make_thinker()
    runner = make_runner(thinker, window=WindowConfig(mode="rebuild", high_tokens=64, low_tokens=32))
    runner.open_session("s", make_context(thinker, 40, seed=1))
    runner.append({"s": _embeds(thinker, 20, 2)}, unit_start=True)
    with pytest.raises(ValueError, match="after the 40-token anchor"):
        runner.drop_last_tokens("s", 21)
    runner.drop_last_tokens("s", 8)
    assert runner.sessions["s"].history.num_tokens == runner.num_tokens("s") - 40 == 12
    assert runner.droppable_tail("s") == 12
    for i in range(4):                                   # compacts from the truncated history
        runner.append({"s": _embeds(thinker, 16, 10 + i)}, unit_start=True)
    assert runner.sessions["s"].num_compactions > 0
    sink_end = runner.num_anchor_blocks("s") * BS
    assert runner.droppable_tail("s") == runner.num_tokens("s") - sink_end


# ---------------------------------------------------------------------- rules (no model)

def _reply(sent: list[int | None], rows: int = 12, text: int = 3) -> list[turns.ReplyUnit]:
    return [turns.ReplyUnit(rows, torch.zeros(rows, 4), text, CONTROL.chunk_eos, s) for s in sent]


def test_played_units_counts_units_whose_audio_started():
    reply = _reply([24_000, 24_000, None])
    assert turns.played_units(reply, None) == 2
    assert [turns.played_units(reply, ms) for ms in (0, 1, 999, 1000, 1001, 5000)] == [0, 1, 1, 1, 2, 2]


def test_plan_rewind_layout_and_clamps():
    reply = _reply([24_000, 24_000, None])              # 3 units of 12 + 1 + 3 + 1 = 17 tokens
    p2 = turns.plan_rewind(reply, None, 1000, CONTROL)
    assert (p2.played_units, p2.drop, p2.close_token, len(p2.listen_units)) == (2, 1 + 17, CONTROL.turn_eos, 1)
    p0 = turns.plan_rewind(reply, 0, 1000, CONTROL)
    assert (p0.drop, p0.close_token, len(p0.listen_units)) == (3 * 17 - 12, CONTROL.listen, 2)
    # Kept tokens + appended == a session that said only the played units, then listened.
    # (a speaking unit holds 17 tokens whichever end token closes it, a listening unit 12 + 1)
    for p in (p0, p2):
        assert 3 * 17 - p.drop + p.appended == 17 * p.played_units + 13 * (3 - p.played_units)
    # The window cut into the reply: what it kept counts as played.
    assert turns.plan_rewind(reply, 0, 20, CONTROL).played_units == 2
    # Rows no longer kept count as played.
    reply[0].rows = reply[1].rows = None
    assert turns.plan_rewind(reply, 0, 1000, CONTROL).played_units == 2


# ---------------------------------------------------------------------- engine: manual mode

def _spy_decisions(eng, sid: str) -> list[int]:
    """The first token fed after each unit's append for ``sid`` (its decision, as the KV sees it)."""
    fed: list[int] = []
    decode, append = eng.stage0.decode, eng.stage0.append
    state = {"unit": False}

    def append_spy(inputs, unit_start):
        if sid in inputs and unit_start:
            state["unit"] = True
        return append(inputs, unit_start)

    def decode_spy(tokens):
        if state["unit"] and sid in tokens:
            fed.append(int(tokens[sid]))
            state["unit"] = False
        return decode(tokens)

    eng.stage0.append, eng.stage0.decode = append_spy, decode_spy
    return fed


def test_manual_mode_is_silent_until_request_response(tmp_path):
    eng = engine(tmp_path, "manual", LONG_TURNS)
    sid = eng.open_session({"voice": "default"})
    eng.set_turn_mode(sid, "manual")
    eng.push_audio(sid, audio(0, 5))
    fed = _spy_decisions(eng, sid)
    per_tick = []
    for i in range(5):
        if i == 2:
            eng.request_response(sid)
        per_tick.append(collect(eng.tick()).get(sid, {"audio": [], "text": [], "done": 0}))
    assert [len(d["audio"]) for d in per_tick] == [0, 0, 1, 1, 1]    # audio in the tick of its text
    assert [bool(d["text"]) for d in per_tick] == [False, False, True, True, True]
    c = CONTROL
    assert fed == [c.listen, c.listen, c.speak, c.speak, c.speak]     # the forced tokens are in the KV
    with pytest.raises(ValueError, match="turn mode"):
        eng.set_turn_mode(sid, "auto")
    with pytest.raises(ValueError, match="unknown session"):
        eng.request_response("nope")
    assert eng.cancel_response(sid) is True


# ---------------------------------------------------------------------- engine: cancel

class _EndTurnAt:
    """The engine's policy, but the unit ``end_unit`` ends its turn (a reference reply of P units)."""

    def __init__(self, policy, end_unit: int):
        self.policy, self.end_unit = policy, end_unit

    def new_session(self, sid):
        return self.policy.new_session(sid)

    def decide(self, unit_index, logits, state=None, pcm=None, ahead=None):
        return self.policy.decide(unit_index, logits, state, pcm)

    def next_token(self, unit_index, num_text, logits, state=None):
        tok = self.policy.next_token(unit_index, num_text, logits, state)
        return CONTROL.turn_eos if tok == CONTROL.chunk_eos and unit_index == self.end_unit else tok


def _run(tmp_path, name: str, cancel_ms=None, cancel: bool = False, reference_units: int | None = None,
         bystander: bool = False) -> dict:
    """Session A: manual, reply requested for unit 1 (units 1, 2, 3 speak), cancelled after tick 3
    (when ``cancel``); a second reply requested for unit 5. ``reference_units``: instead of a
    cancel, A's reply says only that many units (0: it never replies before unit 5)."""
    eng = engine(tmp_path, name, LONG_TURNS)
    b = None
    if bystander:   # duplex, speaking every unit; 4 units ahead, so the reference policy never hits it
        b = eng.open_session({"voice": "alt"})
        pcm = audio(1, 10)
        eng.push_audio(b, pcm[:UNIT_SPLIT])
        for _ in range(4):
            eng.tick()
        eng.push_audio(b, pcm[UNIT_SPLIT:])
    a = eng.open_session({"voice": "default"})
    eng.set_turn_mode(a, "manual")
    eng.push_audio(a, audio(0, 6))
    if reference_units:
        eng.policy = _EndTurnAt(eng.policy, end_unit=reference_units)
    ticks, after_cancel = [], {}
    for i in range(6):
        if (i == 1 and reference_units != 0) or i == 5:
            eng.request_response(a)
        if i == 4 and cancel:
            assert eng.cancel_response(a, cancel_ms) is True
        events = eng.tick()
        ticks.append(events)
        if i == 4:
            after_cancel = {"tokens": eng.stage0.num_tokens(a), "thinker_free": eng.stage0.pool_stats().free,
                            "talker_free": eng.talker_pool.num_free, "streams": len(eng.code2wav.sessions),
                            "talker_blocks": eng.session_info(a).talker_blocks}
    return {"a": a, "b": b, "ticks": ticks, "after": after_cancel, "eng": eng}


def _of(events, sid, kind):
    return [e for e in events if e.sid == sid and isinstance(e, kind)]


@pytest.mark.parametrize("played_ms,played", [(None, 3), (999, 1), (0, 0)])
def test_cancel_keeps_what_a_session_that_said_only_the_played_units_holds(tmp_path, played_ms, played):
    got = _run(tmp_path, "cancel", cancel_ms=played_ms, cancel=True)
    ref = _run(tmp_path, "reference", reference_units=played)
    a = got["a"]
    done = _of(got["ticks"][4], a, ResponseDone)
    assert len(done) == 1 and done[0].status == "cancelled"
    assert done[0].usage.text_tokens == 3 * 3 and done[0].usage.audio_seconds == 3.0   # 3 units said and sent
    assert not _of(got["ticks"][4], a, AudioDelta) and not _of(got["ticks"][4], a, TextDelta)
    assert got["after"]["streams"] == 0 and got["after"]["talker_blocks"] == 0
    # A session that said only the played units (then listened): same Thinker length, same pools.
    assert got["after"] == ref["after"]
    # ... and the same next reply (the rewritten KV continues like the reference's).
    assert [e.text for e in _of(got["ticks"][5], a, TextDelta)] == [e.text for e in _of(ref["ticks"][5], a, TextDelta)]
    assert _of(got["ticks"][5], a, TextDelta)


def test_cancel_leaves_other_sessions_byte_identical(tmp_path):
    """B's audio and text with A's reply cancelled after 3 units == with A's reply ending by itself
    after the same 3 units (the reference without a cancel). A run where A keeps speaking is not
    the reference: B's Code2Wav group then holds A too, and CPU groups round differently with
    their row count (docs/stage2.md, Exactness), which is not the cancel's doing."""
    got = _run(tmp_path, "cancel", cancel_ms=500, cancel=True, bystander=True)
    ref = _run(tmp_path, "ends", reference_units=3, bystander=True)
    b = got["b"]
    for mine, theirs in zip(got["ticks"], ref["ticks"]):
        assert [e.pcm16 for e in _of(mine, b, AudioDelta)] == [e.pcm16 for e in _of(theirs, b, AudioDelta)]
        assert [e.text for e in _of(mine, b, TextDelta)] == [e.text for e in _of(theirs, b, TextDelta)]
    assert sum(len(_of(t, b, AudioDelta)) for t in got["ticks"]) == 6
    # No audio in the cancel's tick (the turn's final chunk is dropped); the reference sent its
    # last unit's chunk and then its final chunk in tick 3, the cancelled run only the chunk.
    assert not _of(got["ticks"][4], got["a"], AudioDelta)
    assert len(_of(ref["ticks"][3], ref["a"], AudioDelta)) == 2 and len(_of(got["ticks"][3], got["a"], AudioDelta)) == 1
    (done,) = _of(ref["ticks"][3], ref["a"], ResponseDone)   # the reference's reply completed by itself
    assert done.status == "completed"
    assert done.usage.text_tokens == 9 and done.usage.audio_seconds == (3 * 24_000 + 6 * 480 + 3840) / 24_000
    assert got["eng"].cancel_response(got["a"]) is True    # the second reply is in progress
    assert got["eng"].cancel_response(b) is True            # duplex: b is speaking


def test_cancel_without_a_reply_returns_false_and_withdraws_a_request(tmp_path):
    eng = engine(tmp_path, "idle", LONG_TURNS)
    sid = eng.open_session({"voice": "default"})
    eng.set_turn_mode(sid, "manual")
    eng.push_audio(sid, audio(0, 2))
    eng.tick()
    eng.request_response(sid)
    assert eng.cancel_response(sid) is False
    assert sid not in collect(eng.tick())                  # the withdrawn request did not speak
    with pytest.raises(ValueError, match="played_ms"):
        eng.cancel_response(sid, -1)


# ---------------------------------------------------------------------- engine: user text

def test_add_user_text_enters_the_thinker_before_the_next_unit(tmp_path):
    eng = engine(tmp_path, "text", LONG_TURNS)
    x, y = (eng.open_session({"voice": "default"}) for _ in range(2))
    for sid in (x, y):
        eng.set_turn_mode(sid, "manual")
        eng.push_audio(sid, audio(0, 2))                   # same audio, same context
    logits: dict[str, list[torch.Tensor]] = {x: [], y: []}
    append = eng.stage0.append

    def spy(inputs, unit_start):
        result = append(inputs, unit_start)
        if unit_start:
            for sid in (x, y):
                if sid in result.logits:
                    logits[sid].append(result.logits[sid].clone())
        return result

    eng.stage0.append = spy
    eng.tick()
    assert torch.equal(logits[x][0], logits[y][0])        # the control: identical until the text
    text = "hello there"
    eng.add_user_text(x, text)
    eng.tick()
    # "\n" <|im_start|> "user\n" text <|im_end|> "\n" <|im_start|> "assistant\n" (byte tokenizer)
    expected = 1 + 1 + len("user\n" + text) + 1 + 1 + 1 + len("assistant\n")
    assert eng.stage0.num_tokens(x) - eng.stage0.num_tokens(y) == expected
    assert not torch.equal(logits[x][1], logits[y][1])


def test_add_user_text_is_refused_past_the_session_limits(tmp_path):
    eng = engine(tmp_path, "limits", {"stage0": {"window": {"mode": "basic", "high_tokens": 400, "low_tokens": 200}}})
    sid = eng.open_session({"voice": "default"})
    room = 400 - turns.UNIT_TOKENS_BOUND - 2 * (16 - 1)
    with pytest.raises(UserTextTooLong, match="does not fit"):
        eng.add_user_text(sid, "x" * room)
    eng.add_user_text(sid, "x" * (room - 40))
    with pytest.raises(UserTextTooLong, match="with .* pending"):
        eng.add_user_text(sid, "y" * 30)
    with pytest.raises(ValueError, match="non-empty"):
        eng.add_user_text(sid, "")
    eng.push_audio(sid, audio(0, 1))
    events = eng.tick()                                    # the text fits: no error, the session goes on
    assert not [e for e in events if e.sid == sid and isinstance(e, SessionError)]
    anchor = eng.session_info(sid).thinker_anchor_tokens
    speaking_unit = 11 + 1 + 3 + 1        # <unit> a1..a10 (no </unit> before unit 0) <|speak|> 3 text, end
    assert eng.stage0.num_tokens(sid) == anchor + (room - 40 + 20) + speaking_unit


def test_add_user_text_window_off_counts_the_positions_left(tmp_path):
    eng = engine(tmp_path, "off", {"stage0": {"window": {"mode": "off"}}})
    sid = eng.open_session({"voice": "default"})
    eng.push_audio(sid, audio(0, 1))
    eng.tick()
    left = eng.stage0.max_positions - eng.stage0.num_tokens(sid) - turns.UNIT_TOKENS_BOUND
    with pytest.raises(UserTextTooLong, match="does not fit"):
        eng.add_user_text(sid, "z" * left)


def test_user_text_that_no_longer_fits_at_the_tick_is_dropped_with_an_error(tmp_path):
    eng = engine(tmp_path, "late", {"stage0": {"window": {"mode": "off"}}})
    sid = eng.open_session({"voice": "default"})
    # Not open in Stage 0 yet: the call counts no context, so the text passes the first check ...
    limit = eng.stage0.max_positions - turns.UNIT_TOKENS_BOUND
    eng.add_user_text(sid, "w" * (limit - 20 - 5))            # 20: the chat-format wrapping
    eng.push_audio(sid, audio(0, 1))
    events = eng.tick()                                         # ... the tick sees the context
    (err,) = [e for e in events if isinstance(e, SessionError)]
    assert err.sid == sid and err.code == "user_text_too_long" and not err.fatal
    anchor = eng.session_info(sid).thinker_anchor_tokens
    assert eng.stage0.num_tokens(sid) == anchor + 11 + 1 + 3 + 1   # the unit ran without the text
