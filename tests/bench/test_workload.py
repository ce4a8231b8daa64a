"""The conversation workload (duplexcache/bench/workload.py): seeded, in range, >= 3 voices, and
its schedule is what the server's reply policy does with its audio (checked by running the
policy itself over the script's audio, unit by unit)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from duplexcache.bench import workload as wl
from duplexcache.context.tokenizer import ByteTokenizer
from duplexcache.runtime.policy import ControlTokens, ReplyPolicy, reply_units, text_token_ids
from duplexcache.runtime.voices import VoiceRegistry

UNITS = 120
SHAPE = wl.ConversationShape()


def _scripts(seed: int) -> list[wl.SessionScript]:
    return [wl.conversation_script(i, f"sess_{i + 1}", UNITS, seed) for i in range(12)]


def _script_audio(script: wl.SessionScript, index: int, seed: int) -> np.ndarray:
    return np.concatenate([wl.unit_audio(script, index, u, seed) for u in range(script.units)])


def test_conversation_is_seeded_and_deterministic():
    a, b, c = _scripts(0), _scripts(0), _scripts(1)
    assert a == b
    assert [s.speech for s in a] != [s.speech for s in c]
    # sessions start at different phases
    assert len({s.turns[0].user_start for s in a}) > 1
    assert np.array_equal(_script_audio(a[3], 3, seed=5), _script_audio(b[3], 3, seed=5))
    assert not np.array_equal(_script_audio(a[3], 3, seed=5), _script_audio(a[3], 3, seed=6))


def test_turn_lengths_are_in_range_and_the_units_agree_with_the_turns():
    users, replies = set(), set()
    for s in _scripts(0):
        assert s.units == UNITS and s.workload == "conversation"
        assert 0 <= s.turns[0].user_start <= SHAPE.max_lead_units
        speech, speaks = [False] * UNITS, [False] * UNITS
        for prev, t in zip((None, *s.turns), s.turns):
            assert SHAPE.user_min_units <= t.user_units <= SHAPE.user_max_units
            assert t.reply_units == reply_units(s.sid, t.index, SHAPE.reply_min_units, SHAPE.reply_max_units)
            if prev is not None:
                assert 0 <= t.user_start - prev.reply_end <= SHAPE.max_gap_units
            users.add(t.user_units)
            replies.add(t.reply_units)
            for u in range(t.user_start, min(t.user_end, UNITS)):
                speech[u] = True
            for u in range(t.user_end, min(t.reply_end, UNITS)):
                speaks[u] = True
        assert list(s.speech) == speech and list(s.speaks) == speaks
        assert not any(a and b for a, b in zip(s.speech, s.speaks))   # nobody talks over anybody
        assert s.turns[-1].user_start < UNITS <= s.turns[-1].reply_end + SHAPE.max_gap_units + 1
        assert s.complete_turns(UNITS) == [t for t in s.turns if t.reply_end <= UNITS]
    assert users == set(range(2, 7)) and replies == set(range(2, 9))


def test_unit_audio_levels_and_lengths():
    s = _scripts(0)[0]
    for u in range(12):
        pcm = wl.unit_audio(s, 0, u)
        assert pcm.dtype == np.float32 and pcm.shape == (16_560 if u == 0 else 16_000,)
        rms = float(np.sqrt(np.mean(pcm.astype(np.float64) ** 2)))
        # the reply policy's default threshold (0.01) lies well between the two levels
        assert (rms > 0.05) if s.speech[u] else (rms < 0.002)
    with pytest.raises(ValueError):
        wl.unit_audio(s, 0, UNITS)


def test_ragged_turn_ends_stop_speech_inside_the_last_unit_of_each_turn():
    """--turn-ends random: the last unit of every user turn is speech up to a seeded 10 ms frame,
    then quiet (the RMS of each frame tells), at many different points; other units unchanged."""
    shape = wl.ConversationShape(ragged_turn_ends=True)
    plain = wl.conversation_script(2, "sess_3", UNITS, 7)
    ragged = wl.conversation_script(2, "sess_3", UNITS, 7, shape)
    assert ragged.ragged_turn_ends and ragged.turns == plain.turns and ragged.speech == plain.speech
    last_units = {t.user_end - 1 for t in ragged.turns if t.user_end <= UNITS}
    ends = set()
    for u in range(UNITS):
        n = wl.speech_samples(ragged, 2, u, seed=7)
        pcm = wl.unit_audio(ragged, 2, u, seed=7)
        if u not in last_units:
            assert n == (pcm.size if ragged.speech[u] else 0)
            np.testing.assert_array_equal(pcm, wl.unit_audio(plain, 2, u, seed=7))
            continue
        assert 0 < n <= pcm.size and n % wl.END_FRAME_SAMPLES == 0
        frames = pcm[:pcm.size // 160 * 160].reshape(-1, 160)
        loud = np.sqrt(np.mean(frames.astype(np.float64) ** 2, axis=1)) > 0.01
        assert loud[:n // 160].all() and not loud[n // 160:].any()
        ends.add(n)
    assert len(ends) >= len(last_units) // 2 and len(last_units) >= 10
    assert wl.speech_samples(plain, 2, min(last_units), seed=7) == 16_000
    # bench serve takes the turn's end when the 0.1 s chunk holding its last speech sample is sent
    from duplexcache.bench.serve_client import _unit_chunks, turn_end_chunk
    for u in last_units:
        c = turn_end_chunk(ragged, 2, u, seed=7)
        chunks = _unit_chunks(wl.unit_audio(ragged, 2, u, seed=7))
        start = sum(x.size for x in chunks[:c])
        assert start < wl.speech_samples(ragged, 2, u, seed=7) <= start + chunks[c].size
    assert turn_end_chunk(plain, 2, min(last_units), seed=7) == 9    # a whole unit: its last chunk


def test_reply_policy_follows_the_script():
    """The server's policy, fed the script's audio, speaks exactly the script's reply units."""
    tok = ByteTokenizer()
    control = ControlTokens.from_tokenizer(tok)
    policy = ReplyPolicy(control, text_token_ids(tok, 151748), speech_rms=0.01,
                         reply_min_units=SHAPE.reply_min_units, reply_max_units=SHAPE.reply_max_units)
    logits = torch.zeros(151748)
    for i, s in enumerate(_scripts(3)):
        state = policy.new_session(s.sid)
        decisions = [policy.decide(u, logits, state, wl.unit_audio(s, i, u, seed=3)) == control.speak
                     for u in range(UNITS)]
        assert decisions == list(s.speaks), s.sid


def test_continuous_and_turns_scripts():
    c = wl.continuous_script("sess_1", 5)
    assert c.speech == c.speaks == (True,) * 5 and c.turns == ()
    t = wl.turns_script("sess_1", 8, k=4, turn_units=2)
    assert t.speaks == (False, False, True, True) * 2 and all(t.speech)


def test_at_least_three_voices():
    from duplexcache.runtime.voices import synthetic_voice

    reg = VoiceRegistry([synthetic_voice("default"), synthetic_voice("alt")])
    names = wl.ensure_voices(reg)
    assert len(names) == 3 and names[:2] == ["default", "alt"]
    extra = reg.get(names[2])
    assert extra.prompt_frames == reg.get("default").prompt_frames
    assert not torch.equal(extra.ref_audio[:100], reg.get("default").ref_audio[:100])
    assert wl.ensure_voices(reg) == names                         # idempotent
    picked = wl.pick_voices(7, names, seed=0)
    assert set(picked) == set(names) and picked == wl.pick_voices(7, names, seed=0)
    with pytest.raises(ValueError):
        wl.pick_voices(2, [])


def test_bad_shapes():
    with pytest.raises(ValueError):
        wl.ConversationShape(user_min_units=3, user_max_units=2)
    with pytest.raises(ValueError):
        wl.ConversationShape(reply_min_units=0)
    with pytest.raises(ValueError):
        wl.conversation_script(0, "sess_1", 0)
