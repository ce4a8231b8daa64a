"""Issue #42, engine.batch_invariant: a session's text and pcm16 are the same bytes alone and
beside 1, 7 and 31 other sessions (other voices, contexts and audio), tiny preset on CPU.

The probe session is opened first in every run (its Code2Wav noise seed follows the open order)
and gets the same audio; the others join the same ticks. With the switch off the same runs
differ (the plain GEMMs and convs pick their reduction by batch shape), so the switch reaches the
engine from the deploy YAML and the test can fail."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import audio, engine

from duplexcache.runtime.engine_api import AudioDelta, TextDelta

UNITS = 4
SPEAK = {"mode": "every_k_units", "k": 3, "turn_units": 3}   # units 1-3 speak as one turn


def _probe(tmp_path, others: int, batch_invariant: bool) -> tuple[bytes, list[str], int]:
    eng = engine(tmp_path, f"bi{others}{batch_invariant}",
                 {"engine": {"speak_policy": SPEAK, "batch_invariant": batch_invariant}})
    probe = eng.open_session({"voice": "default", "instructions": "probe"})
    sids = [probe] + [eng.open_session({"voice": ("alt", "default")[i % 2], "instructions": f"other {i % 3}"})
                      for i in range(others)]
    while eng.prefill_pending():     # every session's first unit on the same tick
        eng.prefill_step()
    for i, sid in enumerate(sids):
        eng.push_audio(sid, audio(77 if sid == probe else i, UNITS))
    pcm, text = bytearray(), []
    for _ in range(UNITS + 1):
        for e in eng.tick():
            if e.sid == probe and isinstance(e, AudioDelta):
                pcm += e.pcm16
            elif e.sid == probe and isinstance(e, TextDelta):
                text.append(e.text)
    calls = eng.batch_invariant.calls if eng.batch_invariant is not None else 0
    eng.shutdown()
    return bytes(pcm), text, calls


def test_a_session_gives_the_same_bytes_alone_and_beside_1_7_31_others(tmp_path):
    pcm, text, calls = _probe(tmp_path, 0, True)
    assert len(pcm) > 0 and text and calls > 0
    for others in (1, 7, 31):
        got_pcm, got_text, _ = _probe(tmp_path, others, True)
        assert got_text == text, others
        assert got_pcm == pcm, others


def test_without_the_switch_a_neighbour_changes_the_bits(tmp_path):
    alone, _, calls = _probe(tmp_path, 0, False)
    beside, _, _ = _probe(tmp_path, 7, False)
    assert calls == 0
    assert len(alone) == len(beside) > 0
    assert alone != beside


def test_the_trace_names_the_first_stage_that_differs():
    """scripts/batch_invariance.py --trace: with the switch off a neighbour changes the probe's
    Talker input first (the Thinker's hidden rows); two lone runs trace equal at every stage."""
    import importlib.util
    script = Path(__file__).parents[2] / "scripts" / "batch_invariance.py"
    spec = importlib.util.spec_from_file_location("batch_invariance_script", script)
    bi = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bi)
    deploy = bi._deploy("tiny", "cpu", False)
    models = bi.build_models(deploy)
    alone, again = (bi.probe(models, deploy, 0, 4, trace=True) for _ in range(2))
    beside = bi.probe(models, deploy, 1, 4, trace=True)
    same = bi._first_difference(again["trace"], alone["trace"])
    assert all(s["steps"][0] > 0 and s["first_difference"] is None for s in same.values()), same
    diff = bi._first_difference(beside["trace"], alone["trace"])
    assert diff["talker_hidden"]["first_difference"] is not None, diff
    assert diff["pcm"]["first_difference"] is not None, diff
