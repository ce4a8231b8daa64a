"""Batched Code2Wav against the single-session reference path, sharing on/off, tiers, bad input."""
import pytest
import torch
from helpers import (
    TAIL,
    new_stage,
    reference_stream,
    run_plan,
    tiny_models,
    token_stream,
    voice_inputs,
)

from duplexcache.cfm.code2wav import code2wav_session_bytes
from duplexcache.cfm.config import Code2WavConfig
from duplexcache.cfm.prompt_cache import SharedPromptAttCache

VOICES = {"a": voice_inputs(11, 10), "b": voice_inputs(12, 12)}    # P = 20 and 24 frames


def _run(stage, plan, num_ticks):
    """sid -> (mels, pcms)."""
    return run_plan(stage, VOICES, plan, num_ticks)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_batched_matches_single_session_reference():
    flow, hift = tiny_models()
    plan = {  # different voices, start ticks, lengths; s3 ends with a wider final chunk (16 frames)
        "s0": ("a", 0, token_stream(1, 4)),
        "s1": ("b", 0, token_stream(2, 3)),
        "s2": ("a", 1, token_stream(3, 3)),
        "s33": ("b", 2, token_stream(4, 2, last_keeps_lookahead=True)),
    }
    stage = new_stage(flow, hift)
    got = _run(stage, plan, 4)
    for sid, (voice, _, toks) in plan.items():
        ref_mels, ref_pcms = reference_stream(flow, hift, VOICES[voice], toks, stage.config.prompt_pad_token,
                                              seed=len(sid))
        for a, b in zip(got[sid][0], ref_mels):
            assert a.shape == b.shape and _rel(a, b) <= 1e-5
        for a, b in zip(got[sid][1], ref_pcms):
            assert a.shape == b.shape and _rel(a, b) <= 1e-5


SHARING_PLAN = {f"s{i}": ("a" if i % 2 else "b", i // 3, token_stream(20 + i, 3 + i % 2)) for i in range(8)}


def test_sharing_on_off_bit_identical_and_stored_once():
    flow, hift = tiny_models()
    off = _run(new_stage(flow, hift, prompt_att_sharing=False), SHARING_PLAN, 6)
    stage = new_stage(flow, hift, prompt_att_sharing=True)
    for name, v in VOICES.items():
        stage.register_voice(name, *v)
    # tick 0 by hand to inspect the setup state
    first = {sid: p for sid, p in SHARING_PLAN.items() if p[1] == 0}
    for sid, (voice, _, _) in first.items():
        stage.add_session(sid, voice, seed=len(sid))
    stage._open_pending()
    for sid, (voice, _, _) in first.items():
        sess = stage.sessions[sid]
        assert isinstance(sess.att, SharedPromptAttCache)
        assert sess.att.private_bytes() == 0 and stage.session_bytes(sid).private == 0
        prompt = stage.registry.state(voice).estimator_att
        assert sess.att.prompt is prompt
        assert stage.session_bytes(sid).shared == stage.voice_bytes(voice)
    ptrs = {stage.sessions[s].att.prompt.data_ptr() for s in first}
    assert len(ptrs) == 2                                  # once per voice, in the arena's prompt bank
    bank = stage.arena.bank.frames.untyped_storage().data_ptr()
    assert all(stage.sessions[s].att.prompt.untyped_storage().data_ptr() == bank for s in first)
    # replay the whole plan on a fresh stage (same schedule as `off`) and compare bits
    stage = new_stage(flow, hift, prompt_att_sharing=True)
    on = _run(stage, SHARING_PLAN, 6)
    for sid in SHARING_PLAN:
        assert len(on[sid][0]) >= 3
        for a, b in zip(on[sid][0], off[sid][0]):
            assert torch.equal(a, b)
    for voice in VOICES:
        assert stage.registry.ref_count(voice) == 4
    # steady state: P private frames + tail shared; the voice prompt exists once per voice
    s0 = stage.sessions["s1"].att
    frame = s0.prompt[..., :1, :].numel() * 4
    p = s0.num_prompt
    assert s0.private_bytes() == p * frame and s0.shared_bytes() == TAIL * frame
    voice_ptrs = {stage.sessions[s].att.prompt.data_ptr() for s in SHARING_PLAN}
    assert len(voice_ptrs) == 2
    for sid in SHARING_PLAN:
        stage.remove_session(sid)
    # the voice states outlive their streams (the next turn must not pay the pass again)
    for voice in VOICES:
        assert stage.registry.ref_count(voice) == 0 and stage.voice_bytes(voice) > 0
    assert stage.batch_stats.prompt_passes_per_voice == {"a": 1, "b": 1}


def test_replay_groups_match_one_big_batch(monkeypatch):
    flow, hift = tiny_models()
    plan = {f"s{i}": ("a" if i % 2 else "b", 0, token_stream(40 + i, 3)) for i in range(7)}
    big = _run(new_stage(flow, hift, prompt_att_sharing=True), plan, 3)

    def boom(self):
        raise AssertionError("materialize() on the arena path")
    monkeypatch.setattr(SharedPromptAttCache, "materialize", boom)
    stage = new_stage(flow, hift, prompt_att_sharing=True, max_num_seqs=8, graph_grid=(1, 2),
                      arena_rows_from_graph_grid=True)
    assert stage.arena.rows == 2
    calls = []
    orig = SharedPromptAttCache.private_frames
    monkeypatch.setattr(SharedPromptAttCache, "private_frames",
                        lambda self: (calls.append(1), orig(self))[1])

    def no_copy(self, *a):
        raise AssertionError("cache frames were copied into an arena row")
    monkeypatch.setattr(SharedPromptAttCache, "copy_range_to", no_copy)
    monkeypatch.setattr(SharedPromptAttCache, "copy_private_to", no_copy)
    small = _run(stage, plan, 3)
    # every row of every chunk after the first (the first has no delta): where its delta is, no copy
    assert len(calls) == 7 * 2
    # Not bit-exact on CPU: a row's GEMMs see a different batch size (2 vs 7 rows).
    for sid in plan:
        for a, b in zip(small[sid][0], big[sid][0]):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def test_bad_inputs_fail_only_their_session():
    flow, hift = tiny_models()
    stage = new_stage(flow, hift)
    stage.register_voice("a", *VOICES["a"])
    with pytest.raises(ValueError, match="unknown voice"):
        stage.add_session("z", "nope")
    for sid in ("good", "oov", "neg", "empty", "done", "short"):
        stage.add_session(sid, "a")
    toks = token_stream(5, 2)
    first = {sid: toks[0] for sid in ("good", "done", "short")}
    out = stage.step({**first, "oov": torch.tensor([1, 2, 6561, 3, 4, 5, 6, 7]),
                      "neg": [-1, 2, 3, 4, 5], "empty": [], "ghost": toks[0]}, {"done": True})
    assert set(out) == {"good", "done", "short"}
    assert "6561" in str(out.errors["oov"]) and "-1" in str(out.errors["neg"])
    assert "empty" in str(out.errors["empty"]) and "unknown session" in str(out.errors["ghost"])
    out = stage.step({"good": toks[1], "done": toks[1], "short": [1, 2, 3]}, {"good": True})
    assert set(out) == {"good"}
    assert "after the final chunk" in str(out.errors["done"])
    assert "lookahead" in str(out.errors["short"])
    # the good session is unaffected: same mel as running it alone
    alone = new_stage(flow, hift)
    alone.register_voice("a", *VOICES["a"])
    alone.add_session("good", "a")
    alone.step({"good": toks[0]})
    alone.step({"good": toks[1]}, {"good": True})
    assert torch.allclose(alone.sessions["good"].last_mel, stage.sessions["good"].last_mel, rtol=1e-6, atol=1e-6)


def test_session_bytes_shapes():
    cfg = Code2WavConfig()
    frame = 10 * 16 * 2 * 8 * 128 * 4
    assert frame == 1.25 * 2 ** 20
    setup_on = code2wav_session_bytes(cfg, 300, True, "setup")
    setup_off = code2wav_session_bytes(cfg, 300, False, "setup")
    steady_on = code2wav_session_bytes(cfg, 300, True, "steady")
    steady_off = code2wav_session_bytes(cfg, 300, False, "steady")
    assert setup_on.private == 0 and setup_on.shared == setup_off.private
    spk = 80 * 4                                    # the projected x-vector: the voice's when sharing
    assert steady_on.shared == 100 * frame + spk
    assert steady_off.private - steady_on.private == 100 * frame + spk
    with pytest.raises(ValueError, match="stage"):
        code2wav_session_bytes(cfg, 300, True, "warm")


def test_stage_refuses_grid_switch_without_grid():
    from duplexcache.cfm.graph_grid import GraphGridError
    flow, hift = tiny_models()
    with pytest.raises(GraphGridError, match="would change nothing"):
        new_stage(flow, hift, arena_rows_from_graph_grid=True, graph_grid=())
    assert new_stage(flow, hift, max_num_seqs=8, graph_grid=(1, 4),
                     arena_rows_from_graph_grid=True).arena.rows == 4


def test_private_session_frees_its_setup_tensors():
    """Sharing off: once a session's caches move on, its private copy of the voice's prompt state
    must be freed; a leftover reference would cost P frames of estimator cache per session
    (375 MiB at full size)."""
    import gc
    import weakref
    flow, hift = tiny_models()
    stage = new_stage(flow, hift, prompt_att_sharing=False)
    stage.register_voice("a", *VOICES["a"])
    stage.add_session("x", "a")
    stage._open_pending()
    x = stage.sessions["x"]
    copies = [x.att.data, x.conformer_att, x.conformer_cnn, x.estimator_cnn]
    voice_state = stage.registry.state("a").tensors()
    assert not any(c.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
                   for c in copies for v in voice_state)           # private copies, not views
    refs = [weakref.ref(t) for t in copies]
    del x, copies
    toks = token_stream(7, 2)
    stage.step({"x": toks[0]})
    stage.step({"x": toks[1]}, {"x": True})
    gc.collect()
    assert refs and all(r() is None for r in refs)
    b = stage.session_bytes("x")
    assert b.shared == 0 and b.private == stage.sessions["x"].att.private_bytes() + sum(
        t.numel() * 4 for t in (stage.sessions["x"].spk, stage.sessions["x"].conformer_cnn,
                                stage.sessions["x"].conformer_att, stage.sessions["x"].estimator_cnn,
                                stage.sessions["x"].vocoder.mel, stage.sessions["x"].vocoder.source,
                                stage.sessions["x"].vocoder.speech))


def test_bfloat16_flow_sharing_on_off_bit_identical_and_near_float32():
    """precision.code2wav_dtype bfloat16: sharing on/off stays bit-identical in the new format
    (views vs private copies of the same bf16 prompt state), the caches are bf16, the PCM is
    float32 (the vocoder's), and the mel stays near float32's on the same weights."""
    import copy

    flow, hift = tiny_models()
    flow16 = copy.deepcopy(flow).to(torch.bfloat16)
    plan = {sid: SHARING_PLAN[sid] for sid in ("s0", "s1", "s3", "s4")}
    off = _run(new_stage(flow16, hift, prompt_att_sharing=False), plan, 5)
    stage = new_stage(flow16, hift, prompt_att_sharing=True)
    on = _run(stage, plan, 5)
    ref = _run(new_stage(flow, hift, prompt_att_sharing=True), plan, 5)
    assert stage.dtype == torch.bfloat16 and stage.arena.att.dtype == torch.bfloat16
    assert stage.sessions["s1"].att.prompt.dtype == torch.bfloat16
    for sid in plan:
        assert len(on[sid][0]) >= 3
        for a, b, r in zip(on[sid][0], off[sid][0], ref[sid][0]):
            assert torch.equal(a, b) and a.dtype == torch.bfloat16
            assert 0 < _rel(a.float(), r) < 0.1         # the format differs, the model does not
        for pcm in on[sid][1]:
            assert pcm.dtype == torch.float32


def test_session_bytes_in_bfloat16():
    """The flow's caches take 2 bytes per element; the vocoder's stay float32."""
    cfg = Code2WavConfig()
    for stage, sharing in (("setup", True), ("setup", False), ("steady", True), ("steady", False)):
        f32 = code2wav_session_bytes(cfg, 300, sharing, stage)
        bf16 = code2wav_session_bytes(cfg, 300, sharing, stage, 2)
        vocoder = (80 * cfg.mel_cache_len + 2 * cfg.source_cache_len) * 4 if stage == "steady" else 0
        assert bf16.shared * 2 == f32.shared
        assert (bf16.private - vocoder) * 2 == f32.private - vocoder


def test_ids_in_vocab_skips_only_the_range_check(monkeypatch):
    """``step(..., ids_in_vocab=True)``: the range check (a device wait for a chunk on the GPU) is
    not run, every other check is; without it an out-of-vocabulary id still fails its session."""
    flow, hift = tiny_models()
    stage = new_stage(flow, hift)
    stage.register_voice("a", *VOICES["a"])
    for sid in ("good", "empty", "oov"):
        stage.add_session(sid, "a")
    checked: list[str] = []
    real = type(stage)._check_tokens
    monkeypatch.setattr(type(stage), "_check_tokens",
                        lambda self, tok, who: (checked.append(who), real(self, tok, who)))
    toks = token_stream(5, 1)
    out = stage.step({"good": toks[0], "empty": []}, ids_in_vocab=True)
    assert set(out) == {"good"} and "empty" in str(out.errors["empty"]) and checked == []
    out = stage.step({"oov": torch.tensor([1, 2, 6561, 3, 4, 5, 6, 7])})
    assert "6561" in str(out.errors["oov"]) and checked == ["session 'oov'"]
