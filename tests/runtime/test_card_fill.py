"""Issue 43: the card filled. Admission takes exactly the sessions the plan holds, every one of
them runs at its worst case at once (full Thinker window, a whole Talker turn, a full encoder
cache) to the end of a long turn and past it without an allocation failure; and the Talker
turn reserved from the speak policy bounds what a turn holds whatever the policy then does."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from duplexcache.bench.fast_forward import fast_forward_session
from duplexcache.runtime.engine_api import AdmissionError, SessionError
from duplexcache.runtime.policy import ScriptedPolicy
from duplexcache.runtime.memory.session_sizing import largest_unit_tokens, policy_turn_units, reserved_turn_tokens
from tests.runtime.engine_helpers import FIRST, UNIT, engine

# A small card: a short window (the fast-forward on CPU is quadratic in it) and a budget that
# holds a handful of sessions, so filling it stays within seconds per unit.
SMALL_CARD = {"stage0": {"window": {"mode": "basic", "high_tokens": 512, "low_tokens": 384}},
              "engine": {"memory_budget": "136MiB", "activation_reserve": "8MiB"}}
ALWAYS_SPEAK = {"mode": "every_k_units", "k": 1000, "turn_units": 1000}


def _fill(eng) -> list[str]:
    """Open sessions until admission refuses one for memory."""
    sids = []
    while True:
        try:
            sids.append(eng.open_session({"voice": "default"}))
        except AdmissionError as exc:
            assert exc.code == "capacity_memory", exc
            return sids
        assert len(sids) <= 64, "admission never refused: the budget is not the limit"


def _push_units(eng, sids: list[str], units: int, rng: np.random.Generator) -> list:
    events = []
    for sid in sids:
        eng.push_audio(sid, rng.uniform(-0.3, 0.3, FIRST + UNIT * (units - 1)).astype(np.float32))
    for _ in range(units + 2):
        events += eng.tick()
    return events


def _sections(speak_policy: dict, turn_tokens: int) -> dict:
    return {**SMALL_CARD, "engine": {**SMALL_CARD["engine"], "talker_turn_tokens": turn_tokens,
                                     "speak_policy": speak_policy}}


def test_every_admitted_session_runs_a_long_turn_at_its_worst_case(tmp_path):
    # a whole turn of 3 units: the run below goes to its end and into the next turn
    turn = 3 * 46
    eng = engine(tmp_path, "fill", _sections(ALWAYS_SPEAK, turn))
    sids = _fill(eng)
    assert len(sids) == eng.plan.planned_sessions >= 3
    # opening costs nothing yet: prefill every context, then hold every pool at its worst case
    events = []
    while eng.prefill_pending():
        events += eng.tick()
    for sid in sids:
        fast_forward_session(eng, sid, thinker_tokens=512, talker_full_turn=True, encoder_full_cache=True)
    assert eng.talker_kv.num_free >= 0
    assert eng.talker_kv.num_used == len(sids) * -(-turn // eng.block_size)
    events += _push_units(eng, sids, 4, np.random.default_rng(0))
    errors = [e for e in events if isinstance(e, SessionError)]
    assert errors == []
    assert sorted(eng.session_ids()) == sorted(sids)
    for sid in sids:   # each reached its turn's end (the fast-forward held it) and went on in a new one
        assert 0 < eng.talker_kv.num_tokens(sid) <= turn
        assert eng.talker_kv.num_blocks(sid) <= -(-turn // eng.block_size)
    eng.shutdown()


def test_policy_turn_units():
    from duplexcache.config import SpeakPolicy

    assert policy_turn_units(SpeakPolicy(mode="every_k_units", k=3, turn_units=2)) == 2
    assert policy_turn_units(SpeakPolicy(mode="every_k_units", k=2, turn_units=2)) is None   # every unit speaks
    assert policy_turn_units(SpeakPolicy(mode="reply", reply_min_units=2, reply_max_units=5)) == 5
    assert policy_turn_units(SpeakPolicy(mode="model")) is None


def test_talker_reserve_is_the_policys_turn_and_wired_from_the_yaml(tmp_path):
    bounded = {"mode": "every_k_units", "k": 3, "turn_units": 2}
    on = engine(tmp_path, "on", _sections(bounded, 512))
    unit = largest_unit_tokens(on.models.talker.config)
    assert on.sizing.talker_turn_tokens == 2 * unit == reserved_turn_tokens(on.deploy, on.models.talker.config)
    assert on.talker_stage.turn_tokens == on.sizing.talker_turn_tokens   # the stage caps at what the ledger holds
    fp = on.sizing.footprint(on.sizing.default_config("default"), on.voices.get("default"))
    assert fp.talker_blocks == -(-2 * unit // on.block_size)
    # a policy with no bound (every unit speaks: one endless turn) reserves the whole talker_turn_tokens
    unbounded = engine(tmp_path, "unbounded", _sections(ALWAYS_SPEAK, 512))
    assert unbounded.sizing.talker_turn_tokens == unbounded.talker_stage.turn_tokens == 512
    assert unbounded.plan.talker_blocks > on.plan.talker_blocks   # the Talker pool holds whole turns
    # a bound above talker_turn_tokens: the configured cap stays the smaller reservation
    capped = engine(tmp_path, "capped", _sections({"mode": "reply", "reply_min_units": 2, "reply_max_units": 8}, 2 * unit))
    assert capped.sizing.talker_turn_tokens == 2 * unit < 8 * unit
    for eng in (on, unbounded, capped):
        eng.shutdown()


def test_a_policy_that_outruns_the_reserved_turn_is_cut_at_it(tmp_path, caplog):
    """Soundness does not rest on the policy analysis: the reservation is the policy's 2-unit
    turn, then every session speaks without end; the Talker stage cuts each turn at the
    reservation (a new audio turn) and no pool runs short on a full card."""
    eng = engine(tmp_path, "outrun", _sections({"mode": "every_k_units", "k": 3, "turn_units": 2}, 512))
    reserved = eng.sizing.talker_turn_tokens
    eng.policy = ScriptedPolicy(eng.control, eng._text_ids, k=1000, turn_units=1000)
    sids = _fill(eng)
    assert len(sids) == eng.plan.planned_sessions
    with caplog.at_level(logging.INFO, logger="duplexcache.runtime.stages.talker_stage"):
        events = _push_units(eng, sids, 4, np.random.default_rng(1))
    assert [e for e in events if isinstance(e, SessionError)] == []
    assert "starting a new audio turn" in caplog.text
    for sid in sids:
        assert eng.talker_kv.num_tokens(sid) <= reserved
    eng.shutdown()


@pytest.mark.parametrize("policy", [ALWAYS_SPEAK])
def test_admission_refuses_exactly_past_the_plan(tmp_path, policy):
    eng = engine(tmp_path, "count", _sections(policy, 256))
    assert len(_fill(eng)) == eng.plan.planned_sessions
    eng.shutdown()
