"""Decision policies, the 20-token unit cap, the model-driven mode, and the voice registry."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import audio, collect, engine, tiny_models

from duplexcache.context.tokenizer import ByteTokenizer
from duplexcache.runtime.policy import (
    MAX_UNIT_TOKENS,
    ControlTokens,
    ModelPolicy,
    ScriptedPolicy,
    text_token_ids,
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

    def next_token(self, unit_index, num_text, logits):
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
    assert [len(a) // 2 for a in got[1]["audio"]] == [24000]
    # unit 2 does not fit the Talker turn: unit 1's codes are flushed as a final chunk, no
    # response.done (the Thinker is still speaking), and unit 2 opens a new audio turn
    assert [len(a) // 2 for a in got[2]["audio"]] == [27840] and got[2]["done"] == 0
    s = eng.session_info(sid)
    assert s.turns == 2 and s.talker_tokens == 30 and s.code2wav_stream == f"{sid}#2"
