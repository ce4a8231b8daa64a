"""One session can never hurt another (engine side): bad audio at the edge, faults inside the
batched tick, bounded context prefill, context limits, admission by time.

Bit-identity baselines. On CPU the Thinker's GEMMs and Code2Wav are not batch-invariant (a
session's audio differs in the last bits when another session shares its batch; measured), so
"unchanged" is always against a run whose batches hold the same sessions:
* a refused push never puts the bad client into a batch: the baseline runs without it;
* a session ended by a fault is compared with a run where it closes at the start of the tick
  the fault fires in (what the others' batches then hold in both runs).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import FIRST, audio, collect, engine, record_sdpa

from duplexcache.runtime.engine_api import AdmissionError, InvalidAudioError, SessionError
from duplexcache.runtime.isolation import FaultInjector

TICKS = 3
# Audio deltas of a session over TICKS ticks of the default policy (k = 2): units 0-1 are one turn
# (a chunk in each unit's tick, then the turn's final chunk), unit 2 opens the next turn.
AUDIO_DELTAS = 4


def _merge(into: dict, events) -> None:
    for sid, d in collect(events).items():
        out = into.setdefault(sid, {"audio": [], "text": [], "errors": []})
        out["audio"] += d["audio"]
        out["text"] += d["text"]
        out["errors"] += d["errors"]


def _pools(eng) -> tuple:
    """Everything that must be back to a fresh engine's state once every session is gone."""
    st = eng.stats()
    return (dict(st.pools), eng.thinker_manager.pool.num_free, eng.talker_pool.num_free,
            len(eng.code2wav.sessions), len(eng.stage0.sessions))


def _close_all(eng) -> None:
    for sid in eng.session_ids():
        eng.close_session(sid)
    eng.tick()


# ---------------------------------------------------------------------------- bad audio


def test_out_of_range_f32_audio_is_refused_to_the_sender_and_the_bystander_is_unchanged(tmp_path):
    def run(with_bad_client: bool) -> dict:
        eng = engine(tmp_path, f"bad{with_bad_client}")
        bystander = eng.open_session({"voice": "default"})
        eng.push_audio(bystander, audio(0, TICKS))
        out: dict = {}
        if with_bad_client:
            bad = eng.open_session({"voice": "alt", "input_audio_format": "f32"})
            loud = np.full(FIRST, 1.01, dtype=np.float32)      # finite, slightly out of range
            with pytest.raises(InvalidAudioError) as info:
                eng.push_audio(bad, loud)
            assert info.value.code == "invalid_audio" and isinstance(info.value, ValueError)
            assert "1.01" in str(info.value)
        for _ in range(TICKS):
            _merge(out, eng.tick())
        if with_bad_client:
            assert bad in eng.session_ids() and bad not in out   # still live; nothing to report
        eng.shutdown()
        return out[bystander]

    with_bad, alone = run(True), run(False)
    assert with_bad["errors"] == [] and len(alone["audio"]) == AUDIO_DELTAS
    assert with_bad["audio"] == alone["audio"] and with_bad["text"] == alone["text"]


# ---------------------------------------------------------------------------- fault injection

STAGE_POINTS = [("encoder", "precheck"), ("encoder", "batched"), ("thinker", "precheck"),
                ("thinker", "batched"), ("talker", "precheck"), ("talker", "batched"),
                ("code2wav", "precheck")]


def _three_sessions(tmp_path, name: str, fault: tuple[str, str] | None, close_victim: bool) -> tuple[dict, object]:
    """Sessions sess_1, sess_2 (the victim), sess_3 speak every unit. Before tick 2 the victim
    either gets a fault armed or (the baseline) closes."""
    eng = engine(tmp_path, name)
    sids = [eng.open_session({"voice": "default"}) for _ in range(3)]
    for i, sid in enumerate(sids):
        eng.push_audio(sid, audio(i, TICKS))
    out: dict = {}
    _merge(out, eng.tick())
    if fault is not None:
        faults = FaultInjector()
        faults.arm(fault[0], sids[1], fault[1])
        eng.install_faults(faults)
    if close_victim:
        eng.close_session(sids[1])
    for _ in range(TICKS - 1):
        _merge(out, eng.tick())
    return out, eng


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    out, eng = _three_sessions(tmp_path_factory.mktemp("base"), "base", None, close_victim=True)
    fresh = engine(tmp_path_factory.mktemp("fresh"), "fresh")
    _close_all(eng)
    assert _pools(eng) == _pools(fresh)
    return out, _pools(fresh)


@pytest.mark.parametrize("stage,point", STAGE_POINTS)
def test_a_fault_at_any_stage_ends_only_that_session(tmp_path, baseline, stage, point):
    base, fresh_pools = baseline
    out, eng = _three_sessions(tmp_path, f"{stage}_{point}", (stage, point), close_victim=False)
    victim = "sess_2"
    assert eng.faults.fired and eng.faults.fired[0][:2] == (stage, victim)
    errors = [e for d in out.values() for e in d["errors"]]
    assert len(errors) == 1 and errors[0].sid == victim and errors[0].fatal
    assert errors[0].code == "injected_fault"
    assert victim not in eng.session_ids()
    for sid in ("sess_1", "sess_3"):
        assert out[sid]["audio"] == base[sid]["audio"], f"{sid} audio changed by {stage}/{point}"
        assert out[sid]["text"] == base[sid]["text"]
        assert len(out[sid]["audio"]) == AUDIO_DELTAS
    _close_all(eng)
    assert _pools(eng) == fresh_pools


def test_a_fault_while_opening_ends_only_that_session(tmp_path):
    eng = engine(tmp_path, "openfault")
    fresh = _pools(eng)
    faults = FaultInjector()
    eng.install_faults(faults)
    ok = eng.open_session({"voice": "default"})
    victim = eng.open_session({"voice": "alt", "instructions": "x" * 700})   # two prefill chunks
    faults.arm("open", victim, "batched")
    eng.push_audio(ok, audio(0, 2))
    out: dict = {}
    for _ in range(2):
        _merge(out, eng.tick())
    assert [e.code for e in out[victim]["errors"]] == ["injected_fault"]
    assert out[ok]["errors"] == [] and len(out[ok]["text"]) == 2
    assert eng.session_ids() == [ok]
    _close_all(eng)
    assert _pools(eng) == fresh


def test_fault_injection_is_off_unless_a_test_installs_it(tmp_path):
    eng = engine(tmp_path, "nofaults")
    assert eng.faults is None and eng.stage0.faults is None
    with pytest.raises(ValueError, match="unknown stage"):
        FaultInjector().arm("vocoder", "sess_1")


# ---------------------------------------------------------------------------- long contexts


def _instructions_for(eng, tokens: int, voice: str = "default") -> str:
    """Instructions that make the context exactly ``tokens`` long (byte tokenizer: 1 per char)."""
    base = eng.context_tokens({"voice": voice, "instructions": "x"})
    text = "x" * (tokens - base + 1)
    assert eng.context_tokens({"voice": voice, "instructions": text}) == tokens
    return text


def test_a_context_of_the_maximum_length_prefills_in_bounded_chunks_without_a_dense_mask(tmp_path, monkeypatch):
    limit, chunk = 2048, 256
    sections = {"server": {"max_context_tokens": limit}, "engine": {"prefill_chunk_tokens": chunk}}
    eng = engine(tmp_path, "longctx", sections)
    scores: list[tuple[int, int, int]] = []   # (heads, query rows, key columns) of each attention call
    record_sdpa(monkeypatch, lambda q, k: scores.append((q.shape[-3], q.shape[-2], k.shape[-2])))
    bystander = eng.open_session({"voice": "default"})
    eng.push_audio(bystander, audio(0, 1))
    eng.tick()
    long_sid = eng.open_session({"voice": "alt", "instructions": _instructions_for(eng, limit, "alt")})
    eng.push_audio(long_sid, audio(1, 4))          # sent while its context prefills
    ticks, opened = 0, False
    while not opened:
        scores.clear()
        eng.push_audio(bystander, audio(ticks, 2)[FIRST:])     # one more second, in real time
        assert len(collect(eng.tick())[bystander]["text"]) == 1  # the bystander runs every tick
        ticks += 1
        opened = eng.session_info(long_sid).opened
        # At most one chunk of new rows per forward; the score matrix is chunk x context at most.
        assert max(rows for _, rows, _ in scores) <= chunk
        assert max(h * rows * cols for h, rows, cols in scores) <= eng.models.thinker.config.num_attention_heads * chunk * limit
    assert ticks == math.ceil(limit / chunk)
    assert eng.session_info(long_sid).thinker_anchor_tokens == limit
    # The audio that arrived while it prefilled was trimmed to one unit: it starts in real time.
    assert eng.table.live[long_sid].buffered <= FIRST
    events = eng.tick()
    assert not [e for e in events if isinstance(e, SessionError)]
    assert eng.session_info(long_sid).units == 1
    eng.shutdown()


def test_a_context_over_the_limit_is_refused_at_open_session_naming_both_numbers(tmp_path):
    limit = 1024
    eng = engine(tmp_path, "overlimit", {"server": {"max_context_tokens": limit}})
    text = _instructions_for(eng, limit)
    eng.open_session({"voice": "default", "instructions": text})          # exactly the limit: fine
    with pytest.raises(AdmissionError) as info:
        eng.open_session({"voice": "default", "instructions": text + "y"})
    assert info.value.code == "context_length_exceeded"
    assert str(limit + 1) in info.value.reason and str(limit) in info.value.reason
    assert len(eng.session_ids()) == 1


# ---------------------------------------------------------------------------- admission by time


def test_admission_by_time_refuses_with_capacity_compute_once_measured(tmp_path):
    # No tick can take under a microsecond, so once a unit has been measured one more session
    # is predicted late; before any measurement admission is by memory only.
    eng = engine(tmp_path, "compute", {"engine": {"tick_seconds": 1e-6, "tick_headroom": 1.0}})
    first = eng.open_session({"voice": "default"})
    second = eng.open_session({"voice": "default"})           # no measurement yet: admitted
    eng.push_audio(first, audio(0, 1))
    eng.tick()
    assert eng.scheduler.tick_cost.predicted_s(2) is not None and eng.scheduler.tick_cost.predicted_s(2) > 0
    with pytest.raises(AdmissionError) as info:
        eng.open_session({"voice": "default"})
    assert info.value.code == "capacity_compute" and "blocks" not in info.value.reason
    queued = [eng.open_session({"voice": "default"}, queue_if_full=True) for _ in range(2)]
    assert [eng.queue_position(q) for q in queued] == [1, 2]
    assert eng.queue_position(first) is None and eng.queue_position("nope") is None
    eng.close_session(queued[0])
    assert eng.queue_position(queued[1]) == 1
    eng.close_session(second)
    assert eng.tick() == [] and eng.is_queued(queued[1])     # one live session is too many already
    eng.close_session(first)
    assert [e.sid for e in eng.tick()] == [queued[1]]        # nobody live: the first is always admitted


def test_tick_headroom_reaches_admission(tmp_path):
    eng = engine(tmp_path, "headroom", {"engine": {"tick_seconds": 1e-6, "tick_headroom": 1e9}})
    assert eng.scheduler.tick_cost.limit_s == pytest.approx(1e3)
    sid = eng.open_session({"voice": "default"})
    eng.push_audio(sid, audio(0, 1))
    eng.tick()
    assert eng.scheduler.tick_cost.per_unit_s is not None
    eng.open_session({"voice": "default"})       # 1000 s of headroom: admitted


def test_prefill_chunk_tokens_reaches_stage0(tmp_path, monkeypatch):
    eng = engine(tmp_path, "chunkwire", {"engine": {"prefill_chunk_tokens": 123}})
    seen = []
    real = eng.stage0.prefill
    monkeypatch.setattr(eng.stage0, "prefill", lambda chunk: seen.append(chunk) or real(chunk))
    eng.open_session({"voice": "default"})
    eng.tick()
    assert seen == [123]


def test_tick_cost_model_formula():
    from duplexcache.runtime.memory.admission import TickCostModel

    m = TickCostModel(tick_seconds=1.0, headroom=0.8, window=4)
    assert m.refusal(100) is None                  # no measurement: memory decides
    assert m.refusal(0) is None                    # nobody live: always admit one
    m.observe(0.4, 2)                              # one unit count: flat, no extrapolation
    assert (m.fixed_s, m.per_unit_s) == (pytest.approx(0.4), 0.0)
    assert m.refusal(100) is None
    m.observe(0.5, 4)                              # counts 2..4 span less than MIN_SPAN_UNITS: flat at the top
    assert (m.fixed_s, m.per_unit_s) == (pytest.approx(0.5), 0.0)
    m.observe(0.9, 6)                              # span 4: the line 0.1 s + 0.125 s per session
    assert m.fixed_s == pytest.approx(0.1) and m.per_unit_s == pytest.approx(0.125)
    assert m.predicted_s(5) == pytest.approx(0.725)
    assert m.refusal(4) is None and m.refusal(5) is not None and "tick_headroom" in m.refusal(5)
    m.observe(0.0, 0)                              # an idle tick is no point of the line
    assert m.fixed_s == pytest.approx(0.1) and m.per_unit_s == pytest.approx(0.125)
    for _ in range(3):                             # the window forgets: (6, 0.9) and three ticks at 8 units
        m.observe(1.0, 8)
    assert (m.fixed_s, m.per_unit_s) == (pytest.approx(1.0), 0.0)   # span 2: flat, and over the limit
    assert m.refusal(1) is not None
    m3 = TickCostModel(tick_seconds=1.0, headroom=0.8, window=4)
    for units in (2, 4, 6):
        m3.observe(0.1 + 0.125 * units, units)
    for _ in range(10):                            # a quiet spell longer than the window
        m3.observe(0.001, 0)
    m3.observe(1.0, 8)                             # a slow first tick of the next burst
    assert m3.per_unit_s > 0 and m3.fixed_s < 0.5  # still a line through the older ticks, not flat at 1 s
    m2 = TickCostModel(1.0, 1.0)
    m2.observe(0.6, 1)
    m2.observe(0.5, 5)                             # noise: slower with fewer units -> flat, not a negative slope
    assert (m2.fixed_s, m2.per_unit_s) == (pytest.approx(0.5), 0.0)
    with pytest.raises(ValueError):
        TickCostModel(1.0, 0.0)


def test_tick_cost_model_admits_a_gpu_ramp_that_the_origin_line_refused():
    # H200, `bench serve` with 32 callers (2026-12-04): idle ticks while the server waited, then a
    # first tick of one session at 73 ms. The line through the origin predicted 804 ms at 11
    # sessions and refused callers of a card that ticks 32 in ~700 ms.
    from duplexcache.runtime.memory.admission import TickCostModel

    m = TickCostModel(tick_seconds=1.0, headroom=0.8)
    for _ in range(7):
        m.observe(0.001, 0)
    m.observe(0.073, 1)
    assert m.refusal(10) is None and m.refusal(31) is None
    for units in (4, 10, 16, 24):                  # then the card's line: 0.3 s + 0.02 s per session
        m.observe(0.3 + 0.02 * units, units)
    # the cheap 1-unit tick still tilts the line (0.17 s + 0.027 s per session): 23 of the 25 that
    # fit are admitted until the window forgets it, where the origin line stopped at 10
    assert 0.02 < m.per_unit_s < 0.03
    assert m.refusal(22) is None and m.refusal(30) is not None


def test_refused_sessions_change_nobody_s_output(tmp_path):
    sections = {"engine": {"tick_seconds": 1e-6, "tick_headroom": 1.0}, "server": {"max_context_tokens": 512}}

    def run(refusals: bool) -> dict:
        eng = engine(tmp_path, f"refusals{refusals}", sections)
        sids = [eng.open_session({"voice": v}) for v in ("default", "alt")]
        for i, sid in enumerate(sids):
            eng.push_audio(sid, audio(i, TICKS))
        out: dict = {}
        for _ in range(TICKS):
            _merge(out, eng.tick())
            if refusals:
                for session, code in (({"voice": "default"}, "capacity_compute"),
                                      ({"voice": "alt", "instructions": "z" * 600}, "context_length_exceeded")):
                    with pytest.raises(AdmissionError) as info:
                        eng.open_session(session)
                    assert info.value.code == code
        # A refused session drew no id: the next one (queued) is the third.
        assert eng.open_session({"voice": "default"}, queue_if_full=True) == "sess_3"
        eng.shutdown()
        return out

    assert run(True) == run(False)
