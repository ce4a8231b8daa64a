"""The tick-cost changes reach the engine and change no output.

* The Thinker stage hands policies a ``RowLogits`` of one ``StepLogits`` per step, so every
  session's pick of a step comes from one batched argmax; the tokens and audio are those of the
  same engine fed plain per-session logits tensors (the path it replaced). The tiny model's
  rows pick alike, so which row answers which session is tested on distinct rows in
  test_engine_policy.py (test_step_logits_...).
* The engine's Code2Wav vocoder is the weight-norm-free copy; the bundle's vocoder keeps its
  parametrization (and checkpoint names).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.nn.utils import parametrize

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import audio, collect, engine, tiny_models

from duplexcache.runtime.policy import RowLogits, StepLogits, logits_tensor

# every other unit speaks; its text tokens are the argmax over the text ids (logits drive each pick)
SECTIONS = {"engine": {"speak_policy": {"mode": "every_k_units", "k": 2, "turn_units": 1}}}


class _Spy:
    """Wraps the engine's policy; ``per_row`` hands it each session's plain logits tensor instead."""

    def __init__(self, policy, per_row: bool) -> None:
        self.policy, self.per_row = policy, per_row
        self.kinds: set[type] = set()
        self.steps: set[StepLogits] = set()   # the objects, not ids: a freed one's id is reused
        self.picks = 0   # next_token calls: each is one session's pick in one step

    def _logits(self, logits):
        self.kinds.add(type(logits))
        if isinstance(logits, RowLogits):
            self.steps.add(logits.step)
        return logits_tensor(logits) if self.per_row else logits

    def new_session(self, sid):
        return self.policy.new_session(sid)

    def decide(self, unit_index, logits, state=None, pcm=None, ahead=None):
        return self.policy.decide(unit_index, self._logits(logits), state, pcm)

    def next_token(self, unit_index, num_text, logits, state=None):
        self.picks += 1
        return self.policy.next_token(unit_index, num_text, self._logits(logits), state)


def _run(tmp_path, name: str, per_row: bool):
    eng = engine(tmp_path, name, SECTIONS)
    spy = eng.policy = _Spy(eng.policy, per_row)
    sids = [eng.open_session({"voice": v}) for v in ("default", "alt", "default")]
    for i, sid in enumerate(sids):
        eng.push_audio(sid, audio(i, 4))
    events = []
    for _ in range(4):
        events += eng.tick()
    eng.shutdown()
    return collect(events), spy


def test_policies_get_batched_row_logits_and_the_picks_are_the_per_row_ones(tmp_path):
    batched, spy = _run(tmp_path, "batched", per_row=False)
    per_row, _ = _run(tmp_path, "per_row", per_row=True)
    assert spy.kinds == {RowLogits}
    # a step's sessions share one StepLogits: a StepLogits per pick would make these equal
    assert 4 <= len(spy.steps) < spy.picks
    assert batched == per_row
    assert any(d["text"] for d in batched.values())   # the run decoded text, so picks were made


def test_the_engine_vocoder_is_the_frozen_copy(tmp_path):
    eng = engine(tmp_path, "frozen")
    assert not any(parametrize.is_parametrized(m) for m in eng.code2wav.hift.modules())
    assert any(parametrize.is_parametrized(m) for m in tiny_models().hift.modules())
    assert eng.code2wav.hift is not tiny_models().hift
    for name, p in tiny_models().hift.named_parameters():
        if "parametrizations" not in name:
            assert torch.equal(p, eng.code2wav.hift.get_parameter(name))
    eng.shutdown()
