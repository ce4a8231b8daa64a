"""Admission against one memory budget: exact capacity from shapes, shared parts paid once."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import engine, tiny_models

from duplexcache.cfm.code2wav import code2wav_session_bytes
from duplexcache.context import SessionContextBuilder
from duplexcache.runtime.memory.admission import (
    AdmissionLedger,
    BudgetTooSmall,
    Footprint,
    MemoryPlan,
)
from duplexcache.runtime.engine_api import AdmissionError, SessionAdmitted
from duplexcache.runtime.stage0.runner import stage0_session_bytes

RESERVE = 1 << 20


def _independent_session_bytes(eng, share: bool) -> tuple[int, int]:
    """(private per session, shared once) of a default-voice session, from shapes alone, with
    the context length taken from a real context build (not from the engine's counting path)."""
    m = tiny_models()
    voice = m.voices.get("default")
    builder = SessionContextBuilder(m.tokenizer, eng._embed_tokens, eng._encode_reference_audio, model_revision="x")
    ctx = builder.build("", voice.ref_audio)
    high = eng.deploy.stage0.window.high_tokens
    kv = stage0_session_bytes(m.thinker.config, ctx.total, high, share, dtype=torch.float32, block_size=16)
    tc = m.talker.config
    talker = -(-tc.max_position_embeddings // 16) * 2 * tc.num_hidden_layers * 16 * tc.num_key_value_heads * tc.head_dim * 4
    cfm = eng.code2wav.config
    setup = code2wav_session_bytes(cfm, voice.prompt_frames, False, "setup")
    steady = code2wav_session_bytes(cfm, voice.prompt_frames, False, "steady")
    enc = m.audio_encoder.cfg.kv_bytes_per_session(m.dtype)
    return kv.private + talker + max(setup.private, steady.private) + enc, kv.shared


@pytest.mark.parametrize("k", [2, 3])
def test_budget_for_exactly_k_sessions_refuses_the_next_and_admits_after_close(tmp_path, k, caplog):
    probe = engine(tmp_path, "probe")
    per_session, _ = _independent_session_bytes(probe, share=False)
    nulls = probe.plan.thinker_block_bytes + probe.plan.talker_block_bytes
    # With sharing off the second voice's context costs nothing up front; the fixed part is the
    # arena, the voices' tensors and each voice's Code2Wav prompt state once (from shapes).
    voices = [probe.voices.get(n) for n in probe.voices.names()]
    cfm = probe.code2wav.config
    # ... and the engine's weight-norm-free vocoder copy (models.vocoder.frozen_weight_norm)
    hift = probe.code2wav.hift
    copy_bytes = sum(t.numel() * t.element_size() for t in (*hift.parameters(), *hift.buffers()))
    assert probe.code2wav.vocoder_copy_bytes == copy_bytes > 0
    assert probe.plan.fixed_bytes == probe.code2wav.arena.nbytes() + sum(v.nbytes() for v in voices) + sum(
        code2wav_session_bytes(cfm, v.prompt_frames, True, "setup").shared for v in voices) + copy_bytes
    budget = probe.plan.fixed_bytes + nulls + k * per_session + per_session // 2
    eng = engine(tmp_path, f"k{k}", {"engine": {"memory_budget": budget + RESERVE, "activation_reserve": RESERVE}})
    assert eng.plan.planned_sessions == k
    sids = [eng.open_session({"voice": "default"}) for _ in range(k)]
    with caplog.at_level(logging.INFO, logger="duplexcache.runtime.engine"), pytest.raises(AdmissionError) as info:
        eng.open_session({"voice": "default"})
    # The client reads the cause, never pool sizes; the numbers go to the log.
    assert info.value.code == "capacity_memory" and "blocks" not in info.value.reason
    logged = caplog.text
    assert f"{k} live sessions" in logged and "Thinker KV needs" in logged and "blocks" in logged
    # a refused client asks again at every append: the cause is not logged again at once (RefusalLog)
    with caplog.at_level(logging.INFO, logger="duplexcache.runtime.engine"), pytest.raises(AdmissionError):
        eng.open_session({"voice": "default"})
    assert sum("session refused" in r.getMessage() for r in caplog.records) == 1
    assert eng.stats().live_sessions == k           # the refused session owns nothing
    eng.close_session(sids[0])
    again = eng.open_session({"voice": "default"})
    assert eng.stats().live_sessions == k
    queued = eng.open_session({"voice": "default"}, queue_if_full=True)
    assert eng.is_queued(queued)
    eng.close_session(again)
    assert SessionAdmitted(queued) in eng.tick()


def test_a_cause_of_refusal_is_logged_once_per_interval_with_the_refusals_it_stands_for(caplog):
    from duplexcache.runtime.memory.session_sizing import RefusalLog

    now = [0.0]
    log = RefusalLog(logging.getLogger("test.refusals"), interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="test.refusals"):
        for t in (0.0, 0.1, 0.2, 5.0):           # a refused client asking at every append
            now[0] = t
            log.refused("capacity_memory", "Thinker KV needs 501 blocks")
        log.refused("capacity_compute", "tick 0.9 s")   # another cause has its own line
        now[0] = 10.5
        log.refused("capacity_memory", "Thinker KV needs 501 blocks")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["session refused (capacity_memory): Thinker KV needs 501 blocks",
                     "session refused (capacity_compute): tick 0.9 s",
                     "session refused (capacity_memory): Thinker KV needs 501 blocks "
                     "(3 more refused for this cause in the last 10 s)"]


def test_budget_too_small_for_one_session_is_a_clear_error(tmp_path):
    # The fixed part plus half a session, from the plan (a fixed "100MiB" stopped being too small
    # when the Code2Wav arena stopped copying the voice prompt into every row).
    probe = engine(tmp_path, "probe")
    per_session, _ = _independent_session_bytes(probe, share=False)
    nulls = probe.plan.thinker_block_bytes + probe.plan.talker_block_bytes
    budget = probe.plan.fixed_bytes + nulls + per_session // 2 + RESERVE
    with pytest.raises(BudgetTooSmall, match="cannot hold one session"):
        engine(tmp_path, "small", {"engine": {"memory_budget": budget, "activation_reserve": RESERVE}})


@pytest.mark.parametrize("share", [True, False])
def test_thinker_reservation_is_the_runners_worst_case_for_the_real_context(tmp_path, share):
    """One formula: the ledger reserves what ``Stage0Runner.worst_case`` says for the context the
    session really opens with (the footprint counts that context from shapes before any model
    runs; the runner sees the built one), with the session's own window."""
    eng = engine(tmp_path, f"wc{share}", {"stage0": {"shared_anchor_blocks": share}})
    sid = eng.open_session({"voice": "alt", "instructions": "be brief",
                            "window": {"high_tokens": 300, "low_tokens": 100}})
    reserved = eng.ledger.thinker_reserved
    eng.tick()
    s = eng.stage0.sessions[sid]
    wc = eng.stage0.worst_case(s.prefix_len, s.window)
    assert s.window.high_tokens == 300 and s.prefix_len > 16
    assert reserved == wc.private_blocks + wc.shared_blocks == wc.total   # the first session pays both
    assert wc.table_blocks == -(-(s.prefix_len + 300) // 16)
    assert (wc.shared_blocks > 0) is share


def _fp(voice="v", ctx=b"c", shared=4, private=10, talker=3, dyn=100, vshared=50):
    return Footprint(private, shared, ctx if shared else None, talker, dyn, voice, vshared)


def test_ledger_shared_parts_paid_once_per_context_and_voice():
    plan = MemoryPlan(budget_bytes=0, fixed_bytes=0, thinker_blocks=1 + 4 + 3 * 10, thinker_block_bytes=1,
                      talker_blocks=1 + 9, talker_block_bytes=1, dynamic_bytes=50 + 3 * 100, planned_sessions=3)
    led = AdmissionLedger(plan)
    assert led.cost(_fp()) == (14, 3, 150)
    for i in range(3):
        assert led.refusal(_fp()) is None
        led.admit(f"s{i}", _fp())
    assert led.cost(_fp()) == (10, 3, 100)          # joining the live context/voice: private only
    assert (led.thinker_reserved, led.dynamic_reserved) == (34, 350)
    assert "Thinker KV needs 10 blocks" in led.refusal(_fp())
    other = _fp(voice="w", ctx=b"d")
    assert "Thinker KV needs 14 blocks" in led.refusal(other)   # a new context pays its anchor
    for i in range(3):
        led.release(f"s{i}")
    assert (led.thinker_reserved, led.talker_reserved, led.dynamic_reserved) == (0, 0, 0)
    with pytest.raises(ValueError, match="no reservation"):
        led.release("s0")


def test_sharing_on_admits_more_sessions_in_the_same_budget(tmp_path):
    sections = {"engine": {"memory_budget": "160MiB", "activation_reserve": "1MiB"}}
    off = engine(tmp_path, "off", sections)
    on = engine(tmp_path, "on", {**sections, "stage0": {"shared_anchor_blocks": True},
                                 "code2wav": {"cfm_prompt_att_sharing": True}})

    def fill(eng):
        n = 0
        while True:
            try:
                eng.open_session({"voice": "default"})
            except AdmissionError:
                return n
            n += 1

    n_off, n_on = fill(off), fill(on)
    assert n_off == off.plan.planned_sessions and n_on >= on.plan.planned_sessions
    assert n_on > n_off
