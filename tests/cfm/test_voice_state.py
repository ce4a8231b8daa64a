"""A voice's prompt state is computed once, at `register_voice`, and every stream (turn) starts
from it: pass counts, bits against a per-stream-pass reference, cheap batched starts, removal."""
import gc
import weakref

import pytest
import torch
from helpers import new_stage, tiny_models, token_stream, voice_inputs

from duplexcache.cfm.code2wav import code2wav_session_bytes
from duplexcache.cfm.prompt_cache import PlainAttCache, SharedPromptAttCache

VOICES = {"a": voice_inputs(11, 10), "b": voice_inputs(12, 12)}    # P = 20 and 24 frames
SESSIONS, TURNS, CHUNKS = 4, 3, 2
# session i, turn t: a stream of CHUNKS chunks from tick 3 * t + i // 2, so each turn start
# shares its tick with another session's start and with other sessions' continuing chunks
SCHEDULE = {f"s{i}#{t}": ("a" if i % 2 else "b", 3 * t + i // 2, token_stream(100 + 10 * i + t, CHUNKS))
            for i in range(SESSIONS) for t in range(TURNS)}
NUM_TICKS = 3 * (TURNS - 1) + (SESSIONS - 1) // 2 + CHUNKS


def drive(stage, schedule, voice_of=lambda stream, voice: voice):
    """Open each stream at its tick (seeded from its name), send one chunk per tick, remove it
    after its final chunk (as the engine ends a turn). Returns stream -> list of (mel, pcm)."""
    got = {stream: [] for stream in schedule}
    for tick in range(NUM_TICKS):
        chunks, last = {}, {}
        for stream, (voice, start, toks) in schedule.items():
            if tick == start:
                stage.add_session(stream, voice_of(stream, voice), seed=sum(stream.encode()))
            k = tick - start
            if 0 <= k < len(toks):
                chunks[stream], last[stream] = toks[k], k == len(toks) - 1
        out = stage.step(chunks, last)
        assert not out.errors, out.errors
        for stream in chunks:
            got[stream].append((stage.sessions[stream].last_mel.clone(), out[stream]))
            if last[stream]:
                stage.remove_session(stream)
    return got


def _register(stage):
    for name, v in VOICES.items():
        stage.register_voice(name, *v)


@pytest.mark.parametrize("sharing", [True, False])
def test_one_prompt_pass_per_voice_over_many_turns_and_sessions(sharing, monkeypatch):
    flow, hift = tiny_models()
    stage = new_stage(flow, hift, prompt_att_sharing=sharing)
    _register(stage)
    assert stage.batch_stats.prompt_passes == 2
    assert stage.batch_stats.prompt_passes_per_voice == {"a": 1, "b": 1}
    # a stream start calls no model: count every conformer call and every estimator solve
    calls = []
    for obj, name in ((stage.flow.encoder, "forward_chunk"), (stage.arena, "run"), (stage.hift, "forward_drawn")):
        real = getattr(obj, name)
        monkeypatch.setattr(obj, name, lambda *a, _real=real, **kw: (calls.append(1), _real(*a, **kw))[1])
    stage.add_session("probe", "a")
    stage.step({})                                  # opens the stream, runs nothing
    assert calls == [] and "probe" in stage.sessions
    stage.remove_session("probe")
    got = drive(stage, SCHEDULE)
    assert all(len(v) == CHUNKS for v in got.values())
    assert calls                                    # the counters do see the chunks' model calls
    s = stage.batch_stats
    assert s.prompt_passes == 2 and s.prompt_passes_per_voice == {"a": 1, "b": 1}
    assert s.stream_starts == 1 + SESSIONS * TURNS
    assert not stage.sessions and all(stage.registry.ref_count(v) == 0 for v in VOICES)
    assert all(stage.voice_bytes(v) == stage.registry.state(v).nbytes() > 0 for v in VOICES)


@pytest.mark.parametrize("sharing", [True, False])
def test_audio_equals_a_per_stream_pass_reference(sharing):
    """The reference registers one voice per stream, so every stream gets its own prompt pass (what
    each stream start used to run); chunk batches are formed from shapes only, so both runs batch
    the same rows and mel and PCM must be torch.equal."""
    flow, hift = tiny_models()
    stage = new_stage(flow, hift, prompt_att_sharing=sharing)
    _register(stage)
    got = drive(stage, SCHEDULE)
    ref_stage = new_stage(flow, hift, prompt_att_sharing=sharing)
    for stream, (voice, _, _) in SCHEDULE.items():
        ref_stage.register_voice(f"{voice}@{stream}", *VOICES[voice], share_equal=False)
    ref = drive(ref_stage, SCHEDULE, voice_of=lambda stream, voice: f"{voice}@{stream}")
    assert ref_stage.batch_stats.prompt_passes == len(SCHEDULE) and stage.batch_stats.prompt_passes == 2
    for stream in SCHEDULE:
        assert len(got[stream]) == len(ref[stream]) == CHUNKS
        for (mel, pcm), (ref_mel, ref_pcm) in zip(got[stream], ref[stream]):
            assert torch.equal(mel, ref_mel) and torch.equal(pcm, ref_pcm)


def test_prompt_pass_does_not_depend_on_the_arena_history():
    """A voice registered after the arena ran chunks of other sessions (its rows hold their data)
    gets the bits of the same pass in a fresh stage."""
    flow, hift = tiny_models()
    stage = new_stage(flow, hift)
    _register(stage)
    drive(stage, {k: v for k, v in SCHEDULE.items() if k.endswith("#0")})
    late = voice_inputs(13, 11)
    stage.register_voice("late", *late)
    fresh = new_stage(flow, hift)
    fresh.register_voice("late", *late)
    assert stage.registry.state("late").equal(fresh.registry.state("late"))


def test_voice_state_is_the_reference_setup_cache():
    """Against the single-session reference (`flow.setup_cache`, its own estimator code): the
    conformer caches are torch.equal; the estimator's differ by GEMM rounding only (~1e-6)."""
    flow, hift = tiny_models()
    stage = new_stage(flow, hift)
    _register(stage)
    for voice, (tokens, mel, spk) in VOICES.items():
        pad = torch.full((3,), stage.config.prompt_pad_token, dtype=torch.long)
        ref = flow.setup_cache(torch.cat([tokens, pad])[None], mel[None], spk[None])
        state = stage.registry.state(voice)
        assert torch.equal(state.conformer_cnn, ref["conformer_cnn_cache"])
        assert torch.equal(state.conformer_att, ref["conformer_att_cache"])
        for got, want in ((state.estimator_cnn, ref["estimator_cnn_cache"]),
                          (state.estimator_att, ref["estimator_att_cache"])):
            assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_stream_starts_take_views_or_one_batched_copy(monkeypatch):
    flow, hift = tiny_models()
    copies = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dst, src: (copies.append(len(dst)), real(dst, src))[1])
    for sharing in (True, False):
        stage = new_stage(flow, hift, prompt_att_sharing=sharing)
        _register(stage)
        sids = [f"x{i}" for i in range(5)]
        for i, sid in enumerate(sids):
            stage.add_session(sid, "ab"[i % 2])
        stage.step({})
        for i, sid in enumerate(sids):
            sess, state = stage.sessions[sid], stage.registry.state("ab"[i % 2])
            att = sess.att.prompt if sharing else sess.att.data
            own = [att, sess.conformer_att, sess.conformer_cnn, sess.estimator_cnn, sess.spk]
            for mine, voice in zip(own, [state.estimator_att, state.conformer_att, state.conformer_cnn,
                                         state.estimator_cnn, state.spk]):
                assert torch.equal(mine, voice)
                assert (mine.data_ptr() == voice.data_ptr()) is sharing
            assert isinstance(sess.att, SharedPromptAttCache if sharing else PlainAttCache)
        # sharing on: no copy at all; off: one copy call for every tensor of all five streams
        assert copies == ([] if sharing else [5 * len(state.tensors())])


def test_unregister_voice_frees_it_only_when_no_stream_uses_it():
    flow, hift = tiny_models()
    stage = new_stage(flow, hift)
    _register(stage)
    stage.add_session("q", "a")                     # queued, not opened yet
    with pytest.raises(ValueError, match="1 queued streams"):
        stage.unregister_voice("a")
    stage.step({})
    with pytest.raises(ValueError, match="still has 1 streams"):
        stage.unregister_voice("a")
    ref = weakref.ref(stage.registry.state("a").estimator_att)
    stage.remove_session("q")
    stage.unregister_voice("a")
    gc.collect()
    assert ref() is None and stage.voice_bytes("a") == 0
    with pytest.raises(ValueError, match="unknown voice"):
        stage.add_session("r", "a")
    with pytest.raises(ValueError, match="unknown voice"):
        stage.unregister_voice("a")
    stage.register_voice("a", *VOICES["a"])         # registering again is a second pass
    assert stage.batch_stats.prompt_passes_per_voice == {"a": 2, "b": 1}
    with pytest.raises(ValueError, match="already registered"):
        stage.register_voice("a", *VOICES["a"])
    assert stage.batch_stats.prompt_passes == 3


def test_voice_bytes_are_the_formulas_shared_setup_bytes():
    """The bytes allocated once per voice are the formula's (the memory plan's fixed part)."""
    flow, hift = tiny_models()
    for sharing in (True, False):
        stage = new_stage(flow, hift, prompt_att_sharing=sharing)
        _register(stage)
        for voice, (tokens, _, _) in VOICES.items():
            p = 2 * tokens.numel()
            assert stage.voice_bytes(voice) == code2wav_session_bytes(stage.config, p, True, "setup").shared
            assert stage.voice_bytes(voice) == code2wav_session_bytes(stage.config, p, False, "setup").private


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_one_pass_per_voice_and_per_stream_bits(monkeypatch):
    """On CUDA the prompt pass is a graph captured at register_voice; the sharing-off copies are
    one `_foreach_copy_` on the device. Same checks as the CPU tests, on graphs."""
    import copy
    # the engine's pinned numerics: otherwise cuDNN may pick another algorithm in another stage
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    cpu_flow, cpu_hift = tiny_models()
    flow, hift = copy.deepcopy(cpu_flow).cuda(), copy.deepcopy(cpu_hift).cuda()
    for sharing in (True, False):
        stage = new_stage(flow, hift, prompt_att_sharing=sharing, use_cuda_graphs=True)
        _register(stage)
        assert stage.graph_stats.captures == 2 and stage.batch_stats.prompt_passes == 2
        got = drive(stage, SCHEDULE)
        assert stage.batch_stats.prompt_passes == 2 and stage.graph_stats.eager_runs == 0
        ref_stage = new_stage(flow, hift, prompt_att_sharing=sharing, use_cuda_graphs=True)
        for stream, (voice, _, _) in SCHEDULE.items():
            ref_stage.register_voice(f"{voice}@{stream}", *VOICES[voice], share_equal=False)
        ref = drive(ref_stage, SCHEDULE, voice_of=lambda stream, voice: f"{voice}@{stream}")
        for stream in SCHEDULE:
            for (mel, pcm), (ref_mel, ref_pcm) in zip(got[stream], ref[stream]):
                assert torch.equal(mel, ref_mel) and torch.equal(pcm, ref_pcm)


def test_a_voice_with_another_voices_prompt_shares_its_state_and_bank_slot():
    """A reference-recording voice's Code2Wav prompt is its base voice's: registering it takes
    the base's state and bank frames (no pass, no bytes, no bank growth, so no captured graph is
    dropped), its streams give the base voice's bits, and either name can go first."""
    flow, hift = tiny_models()
    stage = new_stage(flow, hift, prompt_att_sharing=True)
    _register(stage)
    bank_before, version = stage.arena.bank.nbytes(), stage.arena.bank.version
    stage.register_voice("ref-a", *VOICES["a"])
    assert stage.batch_stats.prompt_passes == 2 and stage.batch_stats.prompt_passes_per_voice["ref-a"] == 0
    assert stage.arena.bank.version == version and stage.arena.bank.nbytes() == bank_before
    assert stage.voice_bytes("ref-a") == 0 and stage.registry.state("ref-a") is stage.registry.state("a")
    assert stage.arena.bank.offset("ref-a") == stage.arena.bank.offset("a")
    # "s1" and "1s": drive() seeds a stream's vocoder noise by its name's byte sum, equal here
    schedule = {"s1": ("a", 0, token_stream(7, CHUNKS)), "1s": ("ref-a", 0, token_stream(7, CHUNKS))}
    got = drive(stage, schedule)
    for (mel, pcm), (ref_mel, ref_pcm) in zip(got["s1"], got["1s"]):
        assert torch.equal(mel, ref_mel) and torch.equal(pcm, ref_pcm)
    # the base goes first: the alias now owns the state (its bytes are counted), its frames stay taken
    a_bytes = stage.voice_bytes("a")
    stage.unregister_voice("a")
    assert stage.voice_bytes("ref-a") == a_bytes and stage.registry.alias_of("ref-a") is None
    stage.register_voice("c", *voice_inputs(13, 10))     # same P as "a": must not reuse a's frames
    assert stage.arena.bank.offset("c") != stage.arena.bank.offset("ref-a")
    # a voice with its own inputs, or share_equal=False, still runs its own pass
    stage.register_voice("a-own", *VOICES["a"], share_equal=False)
    assert stage.batch_stats.prompt_passes_per_voice["a-own"] == 1
