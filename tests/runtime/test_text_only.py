"""Text-only sessions (``audio_output: false``, the engine switch behind OpenAI's ``modalities:
["text"]`` and MiniCPM-o's ``tts_enabled: false``): their replies are text, their units never
enter the Talker or Code2Wav, admission reserves neither for them, and a voiced session beside
one gets the same bytes as alone (engine.batch_invariant). Tiny preset on CPU."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import audio, collect, engine

from duplexcache.config import SessionConfigError
from duplexcache.runtime.engine_api import AudioDelta, ResponseDone, TextDelta

UNITS = 4
SPEAK = {"mode": "every_k_units", "k": 3, "turn_units": 3}   # units 1-3 speak as one turn


def _run(tmp_path, name: str, text_only_neighbour: bool):
    eng = engine(tmp_path, name, {"engine": {"speak_policy": SPEAK, "batch_invariant": True}})
    probe = eng.open_session({"voice": "default", "instructions": "probe"})
    sids = [probe]
    if text_only_neighbour:
        sids.append(eng.open_session({"voice": "alt", "instructions": "text", "audio_output": False}))
    while eng.prefill_pending():
        eng.prefill_step()
    for i, sid in enumerate(sids):
        eng.push_audio(sid, audio(77 if sid == probe else 5, UNITS))
    events = []
    for _ in range(UNITS + 1):
        events += eng.tick()
    infos = {sid: eng.session_info(sid) for sid in sids}
    return eng, sids, events, infos


def test_text_only_session_gets_text_and_never_enters_talker_or_code2wav(tmp_path):
    eng, (probe, text_sid), events, infos = _run(tmp_path, "text_only", True)
    try:
        got = collect(events)
        # the text-only session answered in text, its reply ended (turn_eos after unit 3), no audio
        assert got[text_sid]["text"] and got[text_sid]["done"] == 1 and not got[text_sid]["audio"]
        assert not got[text_sid]["errors"]
        assert infos[text_sid].talker_units == 0 and infos[text_sid].code2wav_chunks == 0
        assert infos[text_sid].talker_blocks == 0 and infos[text_sid].turns == 0
        # the same unit schedule for the voiced one went through both stages
        assert got[probe]["audio"] and got[probe]["done"] == 1
        assert infos[probe].talker_units == 4 and infos[probe].code2wav_chunks == 5   # 4 units + 1 turn's final chunk
        usage = next(e.usage for e in events if isinstance(e, ResponseDone) and e.sid == text_sid)
        assert usage.text_tokens > 0 and usage.audio_seconds == 0.0
    finally:
        eng.shutdown()


def test_a_voiced_session_beside_a_text_only_one_is_bit_identical_to_alone(tmp_path):
    alone_eng, (probe,), alone, _ = _run(tmp_path, "alone", False)
    alone_eng.shutdown()
    beside_eng, (probe2, _), beside, _ = _run(tmp_path, "beside", True)
    beside_eng.shutdown()

    def probe_out(events, sid):
        pcm = b"".join(e.pcm16 for e in events if e.sid == sid and isinstance(e, AudioDelta))
        return pcm, [e.text for e in events if e.sid == sid and isinstance(e, TextDelta)]

    pcm, text = probe_out(alone, probe)
    assert len(pcm) > 0 and text
    assert probe_out(beside, probe2) == (pcm, text)


def test_text_only_footprint_reserves_no_talker_turn_nor_code2wav_caches(tmp_path):
    eng = engine(tmp_path, "fp")
    try:
        cfg_v, voice = eng.sizing.check_session({"voice": "default"})
        cfg_t, _ = eng.sizing.check_session({"voice": "default", "audio_output": False})
        voiced, text = eng.sizing.footprint(cfg_v, voice), eng.sizing.footprint(cfg_t, voice)
        assert voiced.talker_blocks > 0 and text.talker_blocks == 0
        encoder = eng.models.audio_encoder.cfg.kv_bytes_per_session(eng.models.dtype, None)
        assert text.dynamic_private_bytes == encoder < voiced.dynamic_private_bytes
        assert text.thinker_private_blocks == voiced.thinker_private_blocks
        eng.open_session({"voice": "default", "audio_output": False})
        assert eng.ledger.talker_reserved == 0 and eng.ledger.dynamic_reserved == encoder
        with pytest.raises(SessionConfigError, match="audio_output"):
            eng.open_session({"voice": "default", "audio_output": "no"})
    finally:
        eng.shutdown()
