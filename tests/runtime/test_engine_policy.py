"""Decision policies, the 20-token unit cap, the model-driven mode, the reply mode, and the voice
registry."""
from __future__ import annotations

import numpy as np

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import FIRST as FIRST_UNIT
from engine_helpers import audio, collect, engine, tiny_models

from duplexcache.bench.fast_forward import fast_forward_session
from duplexcache.context.tokenizer import ByteTokenizer
from duplexcache.runtime.policy import (
    MAX_UNIT_TOKENS,
    ControlTokens,
    ModelPolicy,
    ReplyPolicy,
    ReplyState,
    ScriptedPolicy,
    reply_units,
    DEFAULT_END_QUIET_MS,
    leading_quiet,
    text_token_ids,
    trailing_quiet,
)
from duplexcache.runtime.voices import VoiceRegistry, synthetic_voice

CONTROL = ControlTokens.from_tokenizer(ByteTokenizer())
TEXT = text_token_ids(ByteTokenizer(), 151748)


def test_control_ids_are_the_spec_ids():
    assert (CONTROL.unit, CONTROL.unit_end, CONTROL.listen, CONTROL.speak, CONTROL.chunk_eos) == \
        (151683, 151684, 151705, 151706, 151718)
    assert CONTROL.turn_eos == 151717


def test_scripted_schedule_and_end_tokens():
    p = ScriptedPolicy(CONTROL, TEXT, k=4, turn_units=2, text_tokens=2)
    logits = torch.zeros(151748)
    logits[CONTROL.listen] = 100.0            # the model wants to listen; the script overrides it
    logits[ord("h")] = 5.0
    assert [p.decide(u, logits) for u in range(8)] == [CONTROL.listen] * 2 + [CONTROL.speak] * 2 + \
        [CONTROL.listen] * 2 + [CONTROL.speak] * 2
    assert [p.next_token(2, n, logits) for n in range(3)] == [ord("h"), ord("h"), CONTROL.chunk_eos]
    assert p.next_token(3, 2, logits) == CONTROL.turn_eos


def test_model_policy_restricts_the_logits():
    p = ModelPolicy(CONTROL, TEXT)
    logits = torch.zeros(151748)
    logits[CONTROL.unit] = 50.0                # never legal as a decision or as text
    logits[CONTROL.speak] = 1.0
    assert p.decide(0, logits) == CONTROL.speak
    logits[ord("a")] = 3.0
    assert p.next_token(0, 0, logits) == ord("a")
    logits[CONTROL.turn_eos] = 4.0
    assert p.next_token(0, 1, logits) == CONTROL.turn_eos
    with pytest.raises(ValueError):
        ModelPolicy(CONTROL, TEXT, temperature=-1)


class _Chatty(ScriptedPolicy):
    """Speaks and never ends its text: the engine must cut the unit at 20 tokens."""

    def next_token(self, unit_index, num_text, logits, state=None):
        return ord("x")


def test_unit_is_capped_at_20_tokens(tmp_path):
    eng = engine(tmp_path, "cap")
    eng.policy = _Chatty(CONTROL, TEXT, k=1)
    sid = eng.open_session({"voice": "default"})
    eng.tick()                          # opens (no audio yet)
    before = eng.stage0.num_tokens(sid)
    eng.push_audio(sid, audio(0, 1))
    got = collect(eng.tick())[sid]
    assert got["text"] == ["x" * (MAX_UNIT_TOKENS - 2)]
    # <unit> + 10 audio + speak + 18 text + chunk_eos
    assert eng.stage0.num_tokens(sid) - before == 1 + 10 + MAX_UNIT_TOKENS


def test_model_mode_runs_and_keeps_legal_tokens(tmp_path):
    eng = engine(tmp_path, "model", {"engine": {"speak_policy": {"mode": "model"}}})
    sids = [eng.open_session({"voice": v}) for v in ("default", "alt")]
    for i, sid in enumerate(sids):
        eng.push_audio(sid, audio(i, 2))
    events = eng.tick() + eng.tick() + eng.tick()
    assert not [e for e in events if type(e).__name__ == "SessionError"]
    for d in collect(events).values():
        assert all(32 <= ord(ch) < 127 for t in d["text"] for ch in t)


def test_synthetic_voices_are_deterministic_and_distinct():
    a, b, c = synthetic_voice("default"), synthetic_voice("default"), synthetic_voice("alt")
    assert torch.equal(a.ref_audio, b.ref_audio) and torch.equal(a.prompt_tokens, b.prompt_tokens)
    assert not torch.equal(a.ref_audio, c.ref_audio)
    assert a.ref_audio.abs().max() <= 0.5 + 1e-6 and a.prompt_frames == 120
    # the engine's embedding count equals the whole-clip encoder's own output length
    assert tiny_models().audio_encoder.embed_audio(a.ref_audio).shape[0] == 10


def test_voice_dir_round_trip(tmp_path):
    v = synthetic_voice("studio", ref_seconds=0.5, prompt_seconds=2.0)
    save_file({"ref_audio": v.ref_audio, "prompt_tokens": v.prompt_tokens, "prompt_mel": v.prompt_mel,
               "spk": v.spk}, str(tmp_path / "studio.safetensors"))
    reg = VoiceRegistry.synthetic()
    assert reg.load_dir(tmp_path) == 1 and reg.names() == ["default", "alt", "studio"]
    assert torch.equal(reg.get("studio").prompt_mel, v.prompt_mel)
    with pytest.raises(ValueError, match="unknown voice 'nope'"):
        reg.get("nope")
    save_file({"ref_audio": v.ref_audio}, str(tmp_path / "broken.safetensors"))
    with pytest.raises(ValueError, match="lacks tensors"):
        reg.load_dir(tmp_path)


def test_talker_turn_at_its_position_limit_starts_a_new_audio_turn(tmp_path):
    import dataclasses

    from duplexcache.models.talker import Talker

    base = tiny_models()
    torch.manual_seed(0)
    # a unit costs 4 condition rows (3 text + end) + 26 codes = 30 Talker tokens: 2 fit in 64, 3 do not
    talker = Talker(dataclasses.replace(base.talker.config, max_position_embeddings=64)).eval()
    # one endless Thinker turn: every unit speaks
    eng = engine(tmp_path, "tturn", {"engine": {"speak_policy": {"k": 100, "turn_units": 100}}},
                 models=dataclasses.replace(base, talker=talker))
    sid = eng.open_session({"voice": "default"})
    eng.push_audio(sid, audio(0, 3))
    got = [collect(eng.tick()).get(sid, {"audio": [], "done": 0}) for _ in range(3)]
    assert [len(a) // 2 for a in got[0]["audio"]] == [len(a) // 2 for a in got[1]["audio"]] == [24000]
    # unit 2 does not fit the Talker turn: the old turn's 3 carried codes are flushed as its final
    # chunk (6 frames + the 3840-sample cross-fade tail), no response.done (the Thinker is still
    # speaking), and unit 2 opens a new audio turn whose first chunk plays after that tail
    assert [len(a) // 2 for a in got[2]["audio"]] == [6720, 24000] and got[2]["done"] == 0
    s = eng.session_info(sid)
    assert s.turns == 2 and s.talker_tokens == 30 and s.code2wav_stream == f"{sid}#2"



def _three_units(eng) -> list[list[bytes]]:
    """The audio chunks of one session's first three ticks (every unit speaks)."""
    sid = eng.open_session({"voice": "default"})
    eng.push_audio(sid, audio(0, 3))
    return [collect(eng.tick()).get(sid, {"audio": []})["audio"] for _ in range(3)]


def test_talker_turn_tokens_caps_the_turn_on_the_model_limit_path(tmp_path):
    """engine.talker_turn_tokens reaches the Talker stage (the turn closes at the cap exactly as
    at the model's position limit, same audio bytes), admission (blocks reserved per session),
    the decode graphs (table widths) and the bench's fast-forward; a turn under the cap is unchanged."""
    import dataclasses

    from duplexcache.models.talker import Talker
    from duplexcache.runtime.memory import device_setup

    base = tiny_models()
    speak = {"speak_policy": {"k": 100, "turn_units": 100}}
    assert base.talker.config.max_position_embeddings == 512
    # the model limit at 64, same weights: the reference for the cap
    short = Talker(dataclasses.replace(base.talker.config, max_position_embeddings=64)).eval()
    short.load_state_dict(base.talker.state_dict())
    by_limit = _three_units(engine(tmp_path, "limit", {"engine": speak}, models=dataclasses.replace(base, talker=short)))
    capped_eng = engine(tmp_path, "cap", {"engine": {**speak, "talker_turn_tokens": 64}})
    by_cap = _three_units(capped_eng)
    uncapped = _three_units(engine(tmp_path, "nocap", {"engine": speak}))
    assert by_cap == by_limit and [len(a) // 2 for a in by_cap[2]] == [6720, 24000]   # unit 2 opened a new turn
    assert by_cap[1] == uncapped[1] and by_cap[2] != uncapped[2]   # unit 1 fits: bit-identical

    eng = capped_eng
    blocks = -(-64 // eng.block_size)
    fp = eng.sizing.footprint(eng.sizing.default_config("default"), eng.voices.get("default"))
    assert eng.sizing.talker_turn_tokens == eng.talker_stage.turn_tokens == 64 and fp.talker_blocks == blocks
    assert eng.plan.talker_blocks == 1 + eng.plan.planned_sessions * blocks
    kv = device_setup.KVPools(eng.thinker_cache, eng.thinker_manager, eng.stage0, eng.talker_cache, eng.talker_kv)
    _, talker_graphs = device_setup.make_decode_graphs(eng.models, kv, 2, eng.sizing.talker_turn_tokens, capture=False)
    assert talker_graphs.max_width >= blocks and talker_graphs.max_width < -(-512 // eng.block_size)
    sid = eng.session_ids()[0]
    fast_forward_session(eng, sid, talker_full_turn=True)
    assert eng.session_info(sid).talker_blocks == blocks

    for bad in (MAX_UNIT_TOKENS + 25, 513):   # below one unit's worst case / above the model
        with pytest.raises(ValueError, match="talker_turn_tokens must be between 46 .* and .* 512"):
            engine(tmp_path, f"bad{bad}", {"engine": {"talker_turn_tokens": bad}})


# ------------------------------------------------------------------------------ reply mode

LOUD, QUIET = 0.1, 0.02     # RMS of a user-speech unit and of a quiet one in these tests


def _unit(rms: float, seed: int, n: int = 16_000) -> np.ndarray:
    """A unit of noise with exactly this RMS."""
    x = np.random.default_rng(seed).standard_normal(n)
    return (x * rms / np.sqrt(np.mean(x * x))).astype(np.float32)


def test_reply_units_is_deterministic_and_covers_its_range():
    got = [reply_units(f"sess_{i}", t, 2, 8) for i in range(40) for t in range(5)]
    assert got == [reply_units(f"sess_{i}", t, 2, 8) for i in range(40) for t in range(5)]
    assert set(got) == set(range(2, 9))                         # every length in [2, 8] occurs
    assert reply_units("sess_1", 0, 3, 3) == 3
    assert [reply_units("sess_1", t, 2, 8) for t in range(6)] != [reply_units("sess_2", t, 2, 8) for t in range(6)]
    for bad in ((0, 2), (3, 2)):
        with pytest.raises(ValueError):
            reply_units("sess_1", 0, *bad)


def test_reply_policy_decisions():
    p = ReplyPolicy(CONTROL, TEXT, speech_rms=0.05, reply_min_units=2, reply_max_units=8, text_tokens=1)
    state = p.new_session("sess_7")
    assert isinstance(state, ReplyState)
    logits = torch.zeros(151748)
    logits[CONTROL.listen] = 100.0            # the model wants to listen; the script decides
    logits[ord("k")] = 5.0
    r0, r1 = reply_units("sess_7", 0, 2, 8), reply_units("sess_7", 1, 2, 8)
    # quiet, quiet (nothing to answer), loud, loud, quiet -> reply 0 of r0 units (the quiet unit
    # that ends the user's turn is its first); quiet during the reply, then quiet listens until
    # the next loud burst, and the next quiet unit starts reply 1
    script = [QUIET, QUIET, LOUD, LOUD] + [QUIET] * r0 + [QUIET, LOUD, QUIET]
    want = "LLLL" + "S" * r0 + "LLS"
    got, ends = "", []
    for u, rms in enumerate(script):
        d = p.decide(u, logits, state, _unit(rms, u))
        got += "S" if d == CONTROL.speak else "L"
        if d == CONTROL.speak:
            assert p.next_token(u, 0, logits, state) == ord("k")
            ends.append(p.next_token(u, 1, logits, state))
    assert got == want
    assert ends[:r0] == [CONTROL.chunk_eos] * (r0 - 1) + [CONTROL.turn_eos]
    assert ends[r0] == (CONTROL.turn_eos if r1 == 1 else CONTROL.chunk_eos)
    assert state.reply_units == r1 and state.turns == 2   # r0's length is in `want` above
    # a threshold just above the loud units: nothing is speech, nothing is answered
    # (10 ms frames of noise vary by a few per cent around the unit's RMS, hence the margin)
    # A user turn spoken while a reply runs (no barge-in: the reply goes on) is answered as soon
    # as the reply ends, when its quiet has come: it is never dropped
    s3 = p.new_session("sess_7")
    script3 = [LOUD, QUIET] + [LOUD] * (r0 - 1) + [QUIET, QUIET]
    got3 = "".join("S" if p.decide(u, logits, s3, _unit(rms, u)) == CONTROL.speak else "L"
                   for u, rms in enumerate(script3))
    assert got3 == "L" + "S" * r0 + "S" + ("S" if r1 >= 2 else "L") and s3.turns == 2
    deaf = ReplyPolicy(CONTROL, TEXT, speech_rms=LOUD * 1.5, reply_min_units=2, reply_max_units=8)
    s2 = deaf.new_session("sess_7")
    assert all(deaf.decide(u, logits, s2, _unit(r, u)) == CONTROL.listen for u, r in enumerate(script))
    with pytest.raises(ValueError, match="ReplyState"):
        p.decide(0, logits, None, _unit(LOUD, 0))
    with pytest.raises(ValueError):
        ReplyPolicy(CONTROL, TEXT, speech_rms=0.05, reply_min_units=4, reply_max_units=3)
    with pytest.raises(ValueError, match="end_quiet_ms"):
        ReplyPolicy(CONTROL, TEXT, speech_rms=0.05, reply_min_units=2, reply_max_units=3, end_quiet_ms=0)


def test_trailing_quiet_counts_from_the_last_speech_frame():
    quiet, loud = _unit(QUIET, 1), _unit(LOUD, 2)
    assert trailing_quiet(quiet, 0.05) == (False, 16_000)
    assert trailing_quiet(loud, 0.05) == (True, 0)
    x = np.concatenate([loud[:11_200], quiet[11_200:]])          # 700 ms of speech, then 300 ms quiet
    assert trailing_quiet(x, 0.05) == (True, 4_800)
    first = np.concatenate([_unit(LOUD, 3, 50), _unit(QUIET, 4, 16_510)])   # the 1.035 s first unit
    # frames are cut from the end: the 16560-sample unit has an 80-sample head frame, loud here
    assert trailing_quiet(first, 0.05) == (True, 16_560 - 80)
    assert trailing_quiet(np.zeros(0, np.float32), 0.05) == (False, 0)


def _decisions(p: ReplyPolicy, units: list[np.ndarray], sid: str = "sess_3") -> str:
    state, logits = p.new_session(sid), torch.zeros(151748)
    return "".join("S" if p.decide(u, logits, state, x) == CONTROL.speak else "L" for u, x in enumerate(units))


def test_reply_answers_in_the_unit_that_holds_the_end_of_speech():
    """A unit cut across the end of a turn (speech, then quiet) answers at once when its quiet
    lasts end_quiet_ms; shorter quiet waits for the next unit, and quiet adds up across units."""
    loud, quiet = _unit(LOUD, 5), _unit(QUIET, 6)
    split = np.concatenate([loud[:11_200], quiet[11_200:]])      # speech to 700 ms, 300 ms of quiet
    r = reply_units("sess_3", 0, 2, 2)
    policy = ReplyPolicy(CONTROL, TEXT, speech_rms=0.05, reply_min_units=2, reply_max_units=2)
    assert DEFAULT_END_QUIET_MS == 200 and policy.end_quiet_samples == 200 * 16
    assert _decisions(policy, [quiet, loud, split, quiet, quiet]) == "LL" + "S" * r + "L"
    patient = ReplyPolicy(CONTROL, TEXT, speech_rms=0.05, reply_min_units=2, reply_max_units=2, end_quiet_ms=400)
    assert _decisions(patient, [quiet, loud, split, quiet, quiet]) == "LLL" + "S" * r
    slow = ReplyPolicy(CONTROL, TEXT, speech_rms=0.05, reply_min_units=2, reply_max_units=2, end_quiet_ms=1_500)
    assert _decisions(slow, [loud, split, quiet, quiet, quiet]) == "LLLSS"     # 300 + 1000 < 1500 <= 2300
    # speech again before the quiet is long enough: the count starts over from its last frame
    assert _decisions(slow, [loud, split, split, quiet, quiet]) == "LLLLS"


def test_leading_quiet_counts_to_the_first_speech_frame():
    quiet, loud = _unit(QUIET, 7), _unit(LOUD, 8)
    assert leading_quiet(quiet, 0.05) == 16_000 and leading_quiet(loud, 0.05) == 0
    x = np.concatenate([quiet[:2_400], loud[2_400:]])             # 150 ms quiet, then speech
    assert leading_quiet(x, 0.05) == 2_400
    assert leading_quiet(quiet[:2_405], 0.05) == 2_405             # a short last frame counts whole
    assert leading_quiet(np.zeros(0, np.float32), 0.05) == 0


def test_reply_hears_the_quiet_after_the_unit():
    """Speech to 900 ms leaves 100 ms of quiet in the unit: the unit alone answers one unit later;
    with the 150 ms already received after it (the lookahead) it answers in that unit. Speech in
    the lookahead keeps the old answer; so does a unit with no audio after it (nothing to hear)."""
    loud, quiet = _unit(LOUD, 9), _unit(QUIET, 10)
    late = np.concatenate([loud[:14_400], quiet[14_400:]])        # speech to 900 ms, 100 ms quiet
    r = reply_units("sess_3", 0, 2, 2)

    def run(policy, ahead_of_split):
        state, logits, got = policy.new_session("sess_3"), torch.zeros(151748), ""
        for u, (x, ahead) in enumerate([(loud, loud[:2_400]), (late, ahead_of_split), (quiet, quiet[:2_400]),
                                        (quiet, quiet[:2_400]), (quiet, None)]):
            got += "S" if policy.decide(u, logits, state, x, ahead) == CONTROL.speak else "L"
        return got

    hear = ReplyPolicy(CONTROL, TEXT, speech_rms=0.05, reply_min_units=2, reply_max_units=2)
    assert r == 2
    assert run(hear, quiet[:2_400]) == "LSSLL"                     # answered in the unit holding the end
    assert run(hear, quiet[:800]) == "LLSSL"                       # 100 + 50 ms < 200 ms
    assert run(hear, np.concatenate([quiet[:800], loud[800:2_400]])) == "LLSSL"   # speech goes on
    assert run(hear, None) == "LLSSL"


def test_reply_mode_settings_reach_the_engine_policy(tmp_path):
    from duplexcache.config import ConfigError

    eng = engine(tmp_path, "reply_wiring", {"engine": {"speak_policy": {
        "mode": "reply", "speech_rms": 0.03, "reply_min_units": 3, "reply_max_units": 5, "end_quiet_ms": 450}}})
    assert isinstance(eng.policy, ReplyPolicy)
    assert (eng.policy.speech_rms, eng.policy.reply_min_units, eng.policy.reply_max_units) == (0.03, 3, 5)
    assert eng.policy.end_quiet_samples == 450 * 16
    sid = eng.open_session({"voice": "default"})
    assert eng.table.live[sid].policy_state == ReplyState(sid)   # per-session state from open
    eng.shutdown()
    with pytest.raises(ConfigError, match="reply_min_units"):
        engine(tmp_path, "reply_bad", {"engine": {"speak_policy": {"reply_min_units": 9, "reply_max_units": 8}}})


@pytest.mark.parametrize("lookahead", [True, False])
def test_the_engine_gives_the_policy_what_it_holds_after_the_unit(tmp_path, lookahead):
    """Through the engine, tick by tick: the second unit's speech ends 100 ms before its end and
    the client has already sent 150 ms of quiet after it when the tick takes it: the reply starts
    in that unit's tick. Without that quiet in the buffer (``lookahead`` False: the client sends
    it with the next unit) one tick later."""
    eng = engine(tmp_path, f"lookahead_{lookahead}", {"engine": {"speak_policy": {
        "mode": "reply", "speech_rms": 0.05, "reply_min_units": 2, "reply_max_units": 2}}})
    sid = eng.open_session({"voice": "default"})
    loud, quiet = _unit(LOUD, 11), _unit(QUIET, 12)
    late = np.concatenate([loud[:14_400], quiet[14_400:]])          # speech to 900 ms, 100 ms quiet
    pushes = [_unit(LOUD, 10, FIRST_UNIT), np.concatenate([late, quiet[:2_400]]),
              quiet[2_400:], np.concatenate([quiet[:2_400], quiet[2_400:]]), quiet]
    if not lookahead:   # the same audio, each unit sent whole: nothing held past the second
        pushes = [pushes[0], late, quiet, quiet, quiet]
    spoke = []
    for pcm in pushes:                   # one unit (plus what follows it) per tick
        eng.push_audio(sid, pcm)
        out = collect(eng.tick()).get(sid, {"text": [], "errors": []})
        assert not out["errors"]
        spoke.append(bool(out["text"]))
    eng.shutdown()
    assert spoke == ([False, True, True, False, False] if lookahead else [False, False, True, True, False])


def test_reply_through_the_engine_has_the_scripted_length(tmp_path):
    """A 2-unit burst, then quiet: one reply of reply_units(sid, 0) units, then silence. The
    quiet units are above the default threshold (0.01) and below the YAML's (0.05), so this
    also fails if speech_rms does not reach the policy."""
    eng = engine(tmp_path, "reply_engine", {"engine": {"speak_policy": {
        "mode": "reply", "speech_rms": 0.05, "reply_min_units": 2, "reply_max_units": 4}}})
    sid = eng.open_session({"voice": "default"})
    length = reply_units(sid, 0, 2, 4)
    units = [_unit(LOUD, 0, FIRST_UNIT)] + [_unit(LOUD, 1)] + [_unit(QUIET, 2 + k) for k in range(length + 1)]
    per_tick = []
    for pcm in units:                    # one unit per tick, as a real-time client sends it
        eng.push_audio(sid, pcm)
        per_tick.append(collect(eng.tick()).get(sid, {"audio": [], "text": [], "done": 0, "errors": []}))
    eng.shutdown()
    assert not any(t["errors"] for t in per_tick)
    spoke = [bool(t["text"]) for t in per_tick]
    assert spoke == [False, False] + [True] * length + [False]
    done = [t["done"] for t in per_tick]
    assert done == [0] * (1 + length) + [1, 0]   # the reply's last unit ends the turn
    samples = [sum(len(a) // 2 for a in t["audio"]) for t in per_tick]
    # each unit's audio leaves in its own tick; the final chunk (the last 3 codes, 6 mel frames)
    # carries the vocoder's 3840-sample tail
    assert samples == [0, 0] + [24_000] * (length - 1) + [24_000 + 6 * 480 + 3840, 0]


def test_full_buffer_message_names_the_chunk(tmp_path):
    eng = engine(tmp_path, "flood_msg")
    sid = eng.open_session({"voice": "default"})
    with pytest.raises(ValueError, match=r"0\.00 s buffered \+ 12\.00 s in this chunk > at most 10 s"):
        eng.push_audio(sid, np.zeros(12 * 16_000, np.float32))
    eng.shutdown()


def test_token_set_argmax_is_the_gathered_argmax_and_keeps_one_copy_per_device():
    from duplexcache.runtime.policy import TokenSet

    ids = torch.tensor([7, 3, 11, 5])
    s = TokenSet(ids)
    logits = torch.zeros(16)
    logits[11] = logits[5] = 2.0          # a tie: the first of the set in set order wins (11)
    logits[0] = 9.0                        # outside the set
    assert s.argmax(logits) == 11 == int(ids[int(torch.argmax(logits[ids]))])
    assert len(s) == 4
    # "meta" stands in for a GPU on this CPU: ids.to(meta) makes a new tensor every call, so only
    # a cache hands back the same copy (on "cpu", .to() would return the ids themselves anyway)
    meta = torch.device("meta")
    assert s.on(meta) is s.on(meta) and s.on(meta).device == meta
    if torch.cuda.is_available():
        cuda = torch.device("cuda", torch.cuda.current_device())
        assert s.on(cuda) is s.on(cuda) and s.argmax(logits.to(cuda)) == 11


def test_step_logits_pick_each_row_as_its_own_argmax_with_one_batched_pick():
    """StepLogits answers every session of a step from one batched argmax (one host sync);
    each answer equals TokenSet.argmax over that row alone, ties included."""
    from duplexcache.runtime.policy import RowLogits, StepLogits, TokenSet, logits_tensor

    g = torch.Generator().manual_seed(0)
    rows = {f"s{i}": torch.randn(64, generator=g).to(torch.bfloat16) for i in range(5)}
    rows["s1"][[9, 4]] = 50.0                         # a tie inside the set: set order decides
    text, decision = TokenSet(torch.tensor([9, 2, 4, 30, 31])), TokenSet(torch.tensor([40, 41]))
    step = StepLogits(rows)
    for sid, row in rows.items():
        assert text.argmax(step.row(sid)) == text.argmax(row)
        assert decision.argmax(step.row(sid)) == decision.argmax(row)
    assert text.argmax(step.row("s1")) == 9
    assert len(step._picks) == 2                      # one batched pick per token set, not per row
    assert isinstance(step.row("s0"), RowLogits) and logits_tensor(step.row("s0")) is rows["s0"]
    with pytest.raises(KeyError):
        step.row("nobody")
    # a policy that builds its token set per call: each short-lived set gets its own pick, even
    # when Python hands a freed set's id to the next one
    for k in range(20):
        assert TokenSet(torch.tensor([k, 40 + k % 3])).argmax(step.row("s2")) == \
            TokenSet(torch.tensor([k, 40 + k % 3])).argmax(rows["s2"])
    # the policies take a RowLogits where they took a tensor
    p = ScriptedPolicy(CONTROL, TEXT, k=4, turn_units=2)
    big = {"a": torch.zeros(151748), "b": torch.zeros(151748)}
    big["a"][ord("h")], big["b"][ord("q")] = 5.0, 5.0
    step = StepLogits(big)
    assert [p.next_token(2, 0, step.row(s)) for s in ("a", "b")] == [ord("h"), ord("q")]
    m = ModelPolicy(CONTROL, TEXT, temperature=0.5, generator=torch.Generator().manual_seed(1))
    assert m.next_token(2, 0, step.row("a")) in set(TEXT.tolist()) | set(CONTROL.ends)
