"""The engine computes each voice's Code2Wav prompt state once, at start: many sessions and turns
later there is still one prompt pass per voice, and the audio equals an engine that runs the pass
for every turn's stream (what every turn start used to do)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import audio, collect, engine

VOICES = ["default", "alt", "default"]
UNITS = 6          # speak_policy every_k_units k=2, turn_units=2: three turns per session


def _per_stream_pass(eng) -> None:
    """Make `eng` run a fresh prompt pass for every Code2Wav stream: each stream gets a voice of
    its own, registered from the voice's prompt inputs when the stream starts and removed when it
    ends."""
    c2w = eng.code2wav
    add, remove = c2w.add_session, c2w.remove_session

    def add_with_pass(sid: str, voice: str, seed: int = 0) -> None:
        v = eng.voices.get(voice)
        c2w.register_voice(f"{voice}@{sid}", v.prompt_tokens, v.prompt_mel, v.spk, share_equal=False)
        add(sid, f"{voice}@{sid}", seed)

    def remove_and_forget(sid: str) -> None:
        voice = (c2w.sessions[sid] if sid in c2w.sessions else c2w._pending[sid]).voice
        remove(sid)
        c2w.unregister_voice(voice)
    c2w.add_session, c2w.remove_session = add_with_pass, remove_and_forget


def _run(eng) -> dict[str, bytes]:
    sids = [eng.open_session({"voice": v}) for v in VOICES]
    for i, sid in enumerate(sids):
        eng.push_audio(sid, audio(i, UNITS))
    out = {sid: b"" for sid in sids}
    for _ in range(UNITS + 1):
        for sid, got in collect(eng.tick()).items():
            assert not got["errors"], got["errors"]
            out[sid] += b"".join(got["audio"])
    for sid in sids:
        assert eng.session_info(sid).turns >= 3
        eng.close_session(sid)
    eng.tick()
    return {f"{i}{VOICES[i]}": out[sid] for i, sid in enumerate(sids)}


@pytest.mark.parametrize("sharing", [True, False])
def test_one_prompt_pass_per_voice_and_audio_equals_per_stream_passes(tmp_path, sharing):
    sections = {"code2wav": {"cfm_prompt_att_sharing": sharing}}
    eng = engine(tmp_path, "voices", sections)
    voices = eng.voices.names()
    assert eng.stats().cfm_prompt_passes == {v: 1 for v in voices}     # at start, before any session
    got = _run(eng)
    assert eng.stats().cfm_prompt_passes == {v: 1 for v in voices}
    streams = eng.code2wav.batch_stats.stream_starts
    assert streams >= 3 * len(VOICES)
    ref = engine(tmp_path, "ref", sections)
    _per_stream_pass(ref)
    want = _run(ref)
    assert sum(ref.stats().cfm_prompt_passes.values()) == len(voices) + streams
    assert all(len(a) > 0 for a in got.values())
    assert got == want
