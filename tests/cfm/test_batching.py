"""Conformer and vocoder batched across sessions: groups, equality with one-session-at-a-time,
per-session RNG streams, and private cache bytes."""
import zlib

import torch
from helpers import TAIL, new_stage, tiny_models, token_stream, voice_inputs

import duplexcache.cfm.code2wav as c2w
import duplexcache.models.vocoder as voc
from duplexcache.cfm.batching import BatchStats, group_by
from duplexcache.cfm.code2wav import code2wav_session_bytes

VOICES = {"a": voice_inputs(11, 10), "b": voice_inputs(12, 12)}    # P = 20 and 24 frames

# Tick 3 of this plan is a mixed step (P_a = 20, P_b = 24, tail 8, 10 frames per chunk):
#   st1, st2  voice a, 4th chunk, conformer cache 28 (trimmed to P + tail)   steady
#   fin       voice a, final chunk of 5 tokens (no lookahead left)            final
#   stb       voice b, 3rd chunk, conformer cache 32                          steady, other P
#   new1/2    voice a, opened this tick + first chunk, conformer cache 20      first chunk
#   newb      voice b, opened this tick + first chunk, conformer cache 24      first chunk
#   wide      voice a, final chunk that keeps its lookahead (16 mel frames)    final, wider
#   idle      voice a, opened this tick, no chunk                              opened only
MIXED = {
    "st1": ("a", 0, token_stream(1, 5)), "fin": ("a", 0, token_stream(2, 4)),
    "stb": ("b", 1, token_stream(3, 4)), "new1": ("a", 3, token_stream(4, 3)),
    "wide": ("a", 1, token_stream(5, 3, last_keeps_lookahead=True)), "st2": ("a", 0, token_stream(6, 5)),
    "new2": ("a", 3, token_stream(7, 3)), "newb": ("b", 3, token_stream(8, 3)),
}


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _seed(sid):
    return zlib.crc32(sid.encode())


def test_group_by_keeps_first_seen_order():
    assert group_by([5, 2, 7, 4, 9], lambda x: x % 2) == [[5, 7, 9], [2, 4]]
    assert group_by([], lambda x: x) == []


def drive(stage, plan, num_ticks, idle_at=None):
    """Like helpers.run_plan, but also adds an `idle` session (no chunk) at tick `idle_at`, and
    records the batch stats of every tick."""
    for name, (tok, mel, spk) in VOICES.items():
        stage.register_voice(name, tok, mel, spk)
    got = {sid: ([], []) for sid in plan}
    stats = []
    for tick in range(num_ticks):
        if tick == idle_at:
            stage.add_session("idle", "a", seed=99)
        chunks, last = {}, {}
        for sid, (voice, start, toks) in plan.items():
            if tick == start:
                stage.add_session(sid, voice, seed=_seed(sid))
            k = tick - start
            if 0 <= k < len(toks):
                chunks[sid], last[sid] = toks[k], k == len(toks) - 1
        out = stage.step(chunks, last)
        assert not out.errors, out.errors
        stats.append(BatchStats(**vars(stage.batch_stats)))
        for sid in chunks:
            got[sid][0].append(stage.sessions[sid].last_mel.clone())
            got[sid][1].append(out[sid])
    return got, stats


def test_mixed_step_forms_the_right_groups():
    flow, hift = tiny_models()
    stage = new_stage(flow, hift)
    _, stats = drive(stage, MIXED, 4, idle_at=3)
    s = stats[3]
    # conformer calls: equal (chunk tokens, last), first-seen order; inside a call the rows are in
    # attention segments of equal cache length (first-seen order, sessions in order): st1+st2
    # (voice a, steady), stb (voice b: another P), new1+new2 and newb (first chunks)
    assert s.last_conformer_groups == (("st1", "st2", "stb", "new1", "new2", "newb"), ("fin",), ("wide",))
    assert s.conformer_segments - stats[2].conformer_segments == 6
    # vocoder: equal cache lengths and mel width; final and other-voice chunks join the steady group
    assert s.last_vocoder_groups == (("st1", "fin", "stb", "st2"), ("new1", "new2", "newb"), ("wide",))
    assert "idle" in stage.sessions and stage.sessions["idle"].chunks == 0
    assert s.stream_starts - stats[2].stream_starts == 4     # new1, new2, newb, idle: no pass each
    assert s.prompt_passes == 2                                # one per voice, at register_voice
    assert s.conformer_calls - stats[2].conformer_calls == 3
    assert s.vocoder_calls - stats[2].vocoder_calls == 3
    assert s.conformer_rows - stats[2].conformer_rows == s.vocoder_rows - stats[2].vocoder_rows == 8


def test_steady_state_is_one_conformer_and_one_vocoder_call_per_step():
    flow, hift = tiny_models()
    stage = new_stage(flow, hift)
    plan = {f"s{i}": ("a", 0, token_stream(60 + i, 4)) for i in range(6)}
    _, stats = drive(stage, plan, 3)
    for s in stats:
        assert len(s.last_conformer_groups) == 1 and len(s.last_conformer_groups[0]) == 6
        assert len(s.last_vocoder_groups) == 1 and len(s.last_vocoder_groups[0]) == 6
    assert stats[-1].conformer_calls == stats[-1].vocoder_calls == 3 and stats[-1].steps == 3


def _singleton_groups(items, key):
    return [[x] for x in items]


def test_grouped_equals_one_session_at_a_time(monkeypatch):
    """The same plan with every conformer/vocoder group forced to one session (the pre-batching
    path; the estimator batches the same way in both runs). On CPU a row's GEMMs round differently
    with the row count, so bits differ; observed (relative L2): mel 1.2e-7, PCM 5.1e-7."""
    flow, hift = tiny_models()
    grouped, _ = drive(new_stage(flow, hift), MIXED, 6, idle_at=3)
    monkeypatch.setattr(c2w, "group_by", _singleton_groups)
    alone_stage = new_stage(flow, hift)
    alone, stats = drive(alone_stage, MIXED, 6, idle_at=3)
    assert all(len(g) == 1 for s in stats for g in s.last_conformer_groups + s.last_vocoder_groups)
    worst_mel = worst_pcm = 0.0
    for sid in MIXED:
        assert len(grouped[sid][0]) == len(MIXED[sid][2])
        for a, b in zip(grouped[sid][0], alone[sid][0]):
            assert a.shape == b.shape
            worst_mel = max(worst_mel, _rel(a, b))
        for a, b in zip(grouped[sid][1], alone[sid][1]):
            assert a.shape == b.shape
            worst_pcm = max(worst_pcm, _rel(a, b))
    assert worst_mel <= 1e-6 and worst_pcm <= 1e-5, (worst_mel, worst_pcm)


def _record_draws(monkeypatch):
    """Log every random tensor the vocoder draws (initial phases, source noise, discarded noise)."""
    log = []
    for name in ("_rand_rows", "_normal_like"):
        real = getattr(voc, name)

        def spy(*args, _real=real, **kw):
            out = _real(*args, **kw)
            log.append(out.clone())
            return out
        monkeypatch.setattr(voc, name, spy)
    return log


def test_rng_streams_are_per_session(monkeypatch):
    """A batched vocoder call draws for each row exactly the numbers that session draws alone
    (torch.equal), and leaves each session's generator in the same state."""
    flow, hift = tiny_models()
    log = _record_draws(monkeypatch)
    stage = new_stage(flow, hift)
    plan = {f"s{i}": ("a", 0, token_stream(70 + i, 3)) for i in range(4)}
    drive(stage, plan, 2)
    assert [len(g) for g in stage.batch_stats.last_vocoder_groups] == [4]
    assert len(log) == 2 * 3 and all(t.shape[0] == 4 for t in log)   # 2 steps x 3 draws, 4 rows
    batched = list(log)
    for row, sid in enumerate(plan):
        log.clear()
        alone = new_stage(flow, hift)
        alone.register_voice("a", *VOICES["a"])
        alone.add_session(sid, "a", seed=_seed(sid))
        for toks in plan[sid][2][:2]:
            alone.step({sid: toks})
        assert len(log) == 6
        for b, a in zip(batched, log):
            assert torch.equal(b[row:row + 1], a)
        g_batched, g_alone = stage.sessions[sid].generator, alone.sessions[sid].generator
        assert torch.equal(g_batched.get_state(), g_alone.get_state())
    # the sessions' streams differ (distinct seeds), so the row checks are not vacuous
    assert len({bytes(t.numpy()) for t in batched[1]}) == 4


def test_batched_caches_are_private_and_accounted():
    """After batched calls no session keeps a view of a batch tensor: each cache tensor is its
    storage's only content, and steady-state bytes equal `code2wav_session_bytes`."""
    flow, hift = tiny_models()
    for sharing in (False, True):
        stage = new_stage(flow, hift, prompt_att_sharing=sharing)
        plan = {f"s{i}": ("a", 0, token_stream(80 + i, 4)) for i in range(3)}
        drive(stage, plan, 3)
        assert len(stage.batch_stats.last_conformer_groups[0]) == 3
        for sid in plan:
            sess = stage.sessions[sid]
            for t in (sess.conformer_att, sess.conformer_cnn, sess.vocoder.mel, sess.vocoder.source,
                      sess.vocoder.speech, sess.estimator_cnn):
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
            assert sess.conformer_att.shape[3] == 20 + TAIL
            want = code2wav_session_bytes(stage.config, 20, sharing, "steady")
            got = stage.session_bytes(sid)
            assert (got.private, got.shared) == (want.private, want.shared)


def test_sharing_on_off_bit_identical_with_batched_groups():
    """Mixed phases, both ways the same groups: mel and PCM torch.equal."""
    flow, hift = tiny_models()
    off, s_off = drive(new_stage(flow, hift, prompt_att_sharing=False), MIXED, 5, idle_at=3)
    on, s_on = drive(new_stage(flow, hift, prompt_att_sharing=True), MIXED, 5, idle_at=3)
    assert [s.last_conformer_groups for s in s_on] == [s.last_conformer_groups for s in s_off]
    assert any(len(g) > 1 for s in s_on for g in s.last_conformer_groups)
    for sid in MIXED:
        for a, b in zip(on[sid][0] + on[sid][1], off[sid][0] + off[sid][1]):
            assert torch.equal(a, b)
