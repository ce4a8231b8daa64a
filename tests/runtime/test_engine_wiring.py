"""Every deploy switch reaches the component that uses it: YAML on vs off -> observable effect."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import audio, deploy_from_yaml, engine, tiny_models
from test_warmup import FakeArenaBackend

from duplexcache.bench.fast_forward import fast_forward_session
from duplexcache.cfm.prompt_cache import PlainAttCache, SharedPromptAttCache
from duplexcache.config import ConfigError
from duplexcache.runtime_config import SessionConfigError
from duplexcache.kv.window import WindowConfig
from duplexcache.runtime.engine_api import AudioDelta, TextDelta
from duplexcache.runtime.policy import ModelPolicy, ScriptedPolicy


def _open_two(eng, voice="default"):
    sids = [eng.open_session({"voice": voice}) for _ in range(2)]
    eng.tick()
    return sids


@pytest.mark.parametrize("on", [True, False])
def test_shared_anchor_blocks_reach_stage0(tmp_path, on):
    eng = engine(tmp_path, "anchor", {"stage0": {"shared_anchor_blocks": on}})
    assert eng.stage0.share_context is on
    a, b = _open_two(eng)
    ta, tb = eng.stage0.block_table(a), eng.stage0.block_table(b)
    blocks = eng.thinker_manager.pool.blocks
    if on:
        assert ta[0] == tb[0] and blocks[ta[0]].ref_cnt == 2 and eng.stats().pools["thinker_kv"].shared > 0
    else:
        assert ta[0] != tb[0] and blocks[ta[0]].ref_cnt == 1 and eng.stats().pools["thinker_kv"].shared == 0


@pytest.mark.parametrize("on", [True, False])
def test_duplex_context_caching_skips_the_reference_encode(tmp_path, on):
    eng = engine(tmp_path, "ctx", {"context_cache": {"duplex_context_caching": on, "capacity": 3}})
    _open_two(eng)
    if on:
        assert eng.builder.cache is not None and eng.builder.cache.capacity == 3
        assert eng.reference_encodes == 1
        s = eng.stats()
        assert (s.context_cache_hits, s.context_cache_misses) == (1, 1)
    else:
        assert eng.builder.cache is None and eng.reference_encodes == 2


@pytest.mark.parametrize("mode", ["basic", "off"])
def test_window_settings_reach_stage0(tmp_path, mode):
    eng = engine(tmp_path, "win", {"stage0": {"window": {"mode": mode, "high_tokens": 40, "low_tokens": 20}},
                                   "engine": {"speak_policy": {"k": 8}}})   # listen units: cheap ticks
    assert (eng.stage0.window.mode, eng.stage0.window.high_tokens, eng.stage0.window.low_tokens) == (mode, 40, 20)
    sid = eng.open_session({"voice": "default"})
    eng.push_audio(sid, audio(0, 4))
    for _ in range(5):
        eng.tick()
    compactions = eng.stage0.sessions[sid].num_compactions
    prefix = eng.stage0.sessions[sid].prefix_len
    if mode == "basic":
        assert compactions >= 1 and eng.stage0.num_tokens(sid) <= prefix + 40
    else:
        assert compactions == 0 and eng.stage0.num_tokens(sid) > prefix + 40


SERVER_WINDOW = {"stage0": {"window": {"mode": "basic", "high_tokens": 80, "low_tokens": 40}},
                 "engine": {"speak_policy": {"k": 8}}}   # listen units: cheap ticks


def test_client_window_marks_reach_stage0_and_admission(tmp_path):
    """A client lowering the window gets its own marks in Stage 0 (compacts at them, in the same
    batch as a default session) and reserves the smaller worst case the runner computes."""
    eng = engine(tmp_path, "cw", SERVER_WINDOW)
    a = eng.open_session({"voice": "default"})
    cost_a = eng.ledger.thinker_reserved
    b = eng.open_session({"voice": "default", "window": {"high_tokens": 48, "low_tokens": 16}})
    cost_b = eng.ledger.thinker_reserved - cost_a
    eng.tick()                                           # opens both in Stage 0
    st = eng.stage0
    assert st.session_window(a) == WindowConfig("basic", 80, 40) == st.window
    assert st.session_window(b) == WindowConfig("basic", 48, 16)
    prefix = st.sessions[a].prefix_len
    assert st.sessions[b].prefix_len == prefix
    # sharing off: a session reserves its whole table at its own high mark, as the runner says
    assert cost_a == st.worst_case(prefix).private_blocks == -(-(prefix + 80) // 16)
    assert cost_b == st.worst_case(prefix, st.session_window(b)).private_blocks == -(-(prefix + 48) // 16)
    assert cost_b < cost_a
    for i, sid in enumerate((a, b)):
        eng.push_audio(sid, audio(i, 7))
    longest = {a: 0, b: 0}
    for _ in range(7):                                   # a reaches prefix + 80 at the 7th unit
        eng.tick()
        for sid in (a, b):
            longest[sid] = max(longest[sid], st.num_tokens(sid))
    assert longest[b] <= prefix + 48 < longest[a] <= prefix + 80
    assert st.sessions[b].num_compactions > st.sessions[a].num_compactions >= 1


def test_client_window_limits_are_kept(tmp_path):
    eng = engine(tmp_path, "cw_max", SERVER_WINDOW)
    with pytest.raises(SessionConfigError, match="exceeds the server limit 80"):
        eng.open_session({"voice": "default", "window": {"high_tokens": 81, "low_tokens": 20}})
    assert eng.stats().live_sessions == 0


@pytest.mark.parametrize("on", [True, False])
def test_cfm_prompt_att_sharing_reaches_code2wav(tmp_path, on):
    # every unit speaks in one long turn, so both Code2Wav streams are alive to inspect
    eng = engine(tmp_path, "cfm", {"code2wav": {"cfm_prompt_att_sharing": on},
                                   "engine": {"speak_policy": {"k": 100, "turn_units": 100}}})
    assert eng.code2wav.registry.sharing is on
    a, b = (eng.open_session({"voice": "default"}) for _ in range(2))
    for i, sid in enumerate((a, b)):
        eng.push_audio(sid, audio(i, 2))
    eng.tick()
    eng.tick()
    sa, sb = (eng.code2wav.sessions[eng.session_info(s).code2wav_stream] for s in (a, b))
    if on:
        assert isinstance(sa.att, SharedPromptAttCache) and sa.prompt is sb.prompt
        assert sa.att.prompt.untyped_storage().data_ptr() == sb.att.prompt.untyped_storage().data_ptr()
        assert eng.code2wav.registry.ref_count("default") == 2
    else:
        # Off: each session owns a whole cache tensor (its own copy of the prompt frames).
        assert isinstance(sa.att, PlainAttCache) and isinstance(sb.att, PlainAttCache)
        assert sa.att.data.untyped_storage().data_ptr() != sb.att.data.untyped_storage().data_ptr()
    # either way the voices' prompt states exist once each (fixed) and no stream ran a pass
    voices = eng.voices.names()
    assert eng.stats().pools["code2wav"].shared == sum(eng.code2wav.voice_bytes(v) for v in voices) > 0
    assert eng.stats().cfm_prompt_passes == {v: 1 for v in voices}


@pytest.mark.parametrize("on", [True, False])
def test_arena_rows_from_graph_grid_and_max_num_seqs(tmp_path, on):
    eng = engine(tmp_path, "arena", {"code2wav": {"cfm_arena_rows_from_graph_grid": on, "graph_grid": [1, 2],
                                                  "max_num_seqs": 4}})
    assert eng.code2wav.config.graph_grid == (1, 2) and eng.code2wav.config.max_num_seqs == 4
    assert eng.code2wav.arena.rows == (2 if on else 4)


@pytest.mark.parametrize("on", [True, False])
def test_cuda_graphs_reach_the_vocoder(tmp_path, on):
    """``engine.cuda_graphs`` -> ``code2wav_config`` -> the vocoder's graphs (with the arena's graph
    backend, which only CUDA gives: a fake one here) replay its calls; off, the vocoder is eager."""
    eng = engine(tmp_path, "vocoder", {"engine": {"cuda_graphs": on}, "code2wav": {"graph_grid": [1, 4]}})
    cfg = eng.code2wav.config
    assert cfg.vocoder_cuda_graphs is on
    per_unit = eng.models.talker.config.tokens_per_unit
    first = (3 + per_unit - 3) * 2
    assert cfg.vocoder_graph_shapes[:2] == ((first, 0), (8 + first, 8 * 480))
    assert eng.code2wav.vocoder_graphs is None          # CPU: no graph backend
    eng.code2wav.set_graph_backend(FakeArenaBackend())           # what CUDA would give it
    assert (eng.code2wav.vocoder_graphs is not None) is on
    sid = eng.open_session({"voice": "default"})
    eng.push_audio(sid, audio(0, 3))
    for _ in range(3):
        eng.tick()
    assert (eng.code2wav.vocoder_graph_stats.replays > 0) is on


def test_arena_switch_without_grid_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="would change nothing"):
        engine(tmp_path, "arena_bad", {"code2wav": {"cfm_arena_rows_from_graph_grid": True}})


def test_speak_policy_block_size_and_budget_reach_the_engine(tmp_path):
    small = engine(tmp_path, "a", {"engine": {"speak_policy": {"mode": "model"}, "memory_budget": "256MiB"},
                                   "stage0": {"block_size": 32}})
    big = engine(tmp_path, "b", {"engine": {"speak_policy": {"mode": "every_k_units", "k": 3}}})
    assert isinstance(small.policy, ModelPolicy)
    assert isinstance(big.policy, ScriptedPolicy) and big.policy.k == 3
    assert [big.policy.speaks(u) for u in range(6)] == [False, True, True, False, True, True]
    # turn_units reaches the schedule: 1 of every 3 units speaks; k == turn_units speaks always
    one = engine(tmp_path, "c", {"engine": {"speak_policy": {"k": 3, "turn_units": 1}}})
    assert [one.policy.speaks(u) for u in range(6)] == [False, False, True, False, False, True]
    always = engine(tmp_path, "d", {"engine": {"speak_policy": {"k": 1000, "turn_units": 1000}}})
    assert all(always.policy.speaks(u) for u in range(999)) and always.policy.turn_units == 1000
    assert small.thinker_cache.block_size == small.talker_cache.block_size == 32
    assert small.plan.budget_bytes == (256 << 20) - (64 << 20)
    assert small.plan.planned_sessions < big.plan.planned_sessions
    assert big.thinker_cache.num_blocks == big.plan.thinker_blocks > small.thinker_cache.num_blocks


@pytest.mark.parametrize("on", [True, False])
def test_cuda_graphs_reach_the_decode_steps_of_the_thinker_and_the_talker(tmp_path, monkeypatch, on):
    """``engine.cuda_graphs`` builds one runner per model and the decode steps of both go through
    them. This CPU cannot capture, so the test lets the engine treat it as capable: the runners
    then run their padded static-buffer steps eagerly (``capture=False``)."""
    from duplexcache.runtime.engine import DuplexEngine

    sections = {"engine": {"cuda_graphs": on, "speak_policy": {"k": 100, "turn_units": 100}}}
    plain = engine(tmp_path, "graphs_cpu", sections)   # on CPU as configured: eager, and says so
    assert plain.thinker_graphs is None and plain.talker_graphs is None and plain.stats().decode_graph_steps == {}
    monkeypatch.setattr(DuplexEngine, "_can_capture_decode", lambda self: True)
    eng = engine(tmp_path, "graphs", sections)
    if not on:
        assert eng.thinker_graphs is None and eng.stage0.decode_graphs is None and eng.talker_stage.graphs is None
        return
    assert eng.stage0.decode_graphs is eng.thinker_graphs and not eng.thinker_graphs.capture
    assert eng.talker_stage.graphs is eng.talker_graphs
    assert eng.thinker_graphs.max_batch >= eng.plan.planned_sessions
    sids = [eng.open_session({"voice": v}) for v in ("default", "alt")]
    for i, sid in enumerate(sids):
        eng.push_audio(sid, audio(i, 2))
    texts = 0
    for _ in range(2):
        texts += sum(isinstance(e, TextDelta) for e in eng.tick())
    steps = eng.stats().decode_graph_steps
    assert texts == 4 and steps["thinker"] >= 2 * 4      # decision + 3 text tokens per unit, both units
    assert steps["talker"] == 2 * (eng.models.talker.config.tokens_per_unit + 1)
    eng.shutdown()
    assert eng.thinker_graphs is None and eng.stage0.decode_graphs is None


def _text_and_pcm(eng, sids, events) -> tuple[list, dict]:
    return ([(e.sid, e.text) for e in events if isinstance(e, TextDelta)],
            {sid: b"".join(e.pcm16 for e in events if isinstance(e, AudioDelta) and e.sid == sid) for sid in sids})


def _assert_same_replies(on: tuple[list, dict], off: tuple[list, dict]) -> None:
    """The graphs' replies against the eager reference's: the same text, PCM within float32
    rounding of padded rows (a GEMM over a bucket's rows may round apart by an LSB or two)."""
    import numpy as np

    (text_on, pcm_on), (text_off, pcm_off) = on, off
    assert text_on == text_off and len(text_on) == 6
    for sid in pcm_on:
        a = np.frombuffer(pcm_on[sid], dtype=np.int16).astype(np.int32)
        b = np.frombuffer(pcm_off[sid], dtype=np.int16).astype(np.int32)
        assert a.size == b.size > 0 and np.abs(a - b).max() <= 2


def test_cuda_graphs_reach_the_unit_append_and_the_talker_condition(tmp_path, monkeypatch):
    """``engine.cuda_graphs``: each unit's append to the Thinker and each speaking unit's Talker
    condition step go through the decode runners as token rows (on), or stay eager (off, the
    reference); the text and audio agree. As the decode-step test above, the CPU engine is let
    treat itself as capable (runners with ``capture=False``)."""
    from duplexcache.runtime.engine import DuplexEngine

    monkeypatch.setattr(DuplexEngine, "_can_capture_decode", lambda self: True)
    outputs = {}
    for arm in (True, False):
        sections = {"engine": {"cuda_graphs": arm, "speak_policy": {"k": 100, "turn_units": 100}}}
        eng = engine(tmp_path, f"ragged_graphs_{arm}", sections)
        assert eng.stage0.ragged_graphs is arm and eng.talker_stage.ragged_graphs is arm
        if arm:   # row buckets for a tick of every session's unit
            for graphs in (eng.thinker_graphs, eng.talker_graphs):
                assert graphs.max_rows >= 16 * eng.plan.planned_sessions and graphs.max_batch >= eng.plan.planned_sessions
        sids = [eng.open_session({"voice": v}) for v in ("default", "alt")]
        for i, sid in enumerate(sids):
            eng.push_audio(sid, audio(i, 3))
        events = [e for _ in range(3) for e in eng.tick()]
        ragged = eng.stats().ragged_graph_steps
        if arm:
            assert ragged["thinker"] >= 3 and ragged["talker"] >= 3   # a unit append and a condition per tick
        else:
            assert not any(ragged.values())
        outputs[arm] = _text_and_pcm(eng, sids, events)
        eng.shutdown()
    _assert_same_replies(outputs[True], outputs[False])


def test_ragged_kernel_off_keeps_the_ragged_steps_eager_under_cuda_graphs(tmp_path, monkeypatch):
    """The short ragged steps replay graphs only through the in-place kernel: with
    ``stage0.ragged_kernel`` off (its reference attention) they stay eager under ``engine.cuda_graphs``
    and no row bucket is captured for them, while the decode steps still replay."""
    from duplexcache.runtime.engine import DuplexEngine

    monkeypatch.setattr(DuplexEngine, "_can_capture_decode", lambda self: True)
    eng = engine(tmp_path, "ragged_kernel_off", {"stage0": {"ragged_kernel": False},
                                                 "engine": {"speak_policy": {"k": 100, "turn_units": 100}}})
    assert eng.thinker_graphs is not None and eng.thinker_graphs.max_rows == eng.thinker_graphs.max_batch   # no row bucket
    assert not eng.stage0.ragged_graphs and not eng.talker_stage.ragged_graphs
    sid = eng.open_session({"voice": "default"})
    eng.push_audio(sid, audio(0, 2))
    for _ in range(2):
        eng.tick()
    stats = eng.stats()
    assert not any(stats.ragged_graph_steps.values()) and stats.decode_graph_steps["thinker"] > 0
    eng.shutdown()


def test_cuda_graphs_reach_the_encoder_step(tmp_path, monkeypatch):
    """``engine.cuda_graphs``: the Thinker stage's encoder step runs the piecewise runner (on; CPU:
    its pieces eagerly over the static buffers) or the eager layers (off); the text and audio
    agree (float32 rounding may move PCM by an LSB)."""
    from duplexcache.runtime.engine import DuplexEngine

    monkeypatch.setattr(DuplexEngine, "_can_capture_encoder", lambda self: True)
    outputs = {}
    for arm in (True, False):
        sections = {"engine": {"cuda_graphs": arm, "speak_policy": {"k": 100, "turn_units": 100}}}
        eng = engine(tmp_path, f"encoder_graphs_{arm}", sections)
        assert (eng.thinker_stage.encoder_graphs is not None) is arm
        assert eng.thinker_stage.encoder_graphs is eng.encoder_graphs
        sids = [eng.open_session({"voice": v}) for v in ("default", "alt")]
        for i, sid in enumerate(sids):
            eng.push_audio(sid, audio(i, 3))
        events = [e for _ in range(3) for e in eng.tick()]
        assert eng.stats().encoder_graph_ticks == (3 if arm else 0)
        outputs[arm] = _text_and_pcm(eng, sids, events)
        eng.shutdown()
        assert eng.encoder_graphs is None
    _assert_same_replies(outputs[True], outputs[False])


def test_cuda_graphs_that_cannot_act_say_so(tmp_path, caplog):
    """On this CPU nothing can be captured, so the switch (on by default, CUDA-only) cannot act:
    the engine says so at info level and the decode steps, the Thinker's appends and the encoder
    stay eager (a switch that silently does nothing is a bug)."""
    with caplog.at_level("INFO", logger="duplexcache"):
        eng = engine(tmp_path, "graphs_on_cpu", {"engine": {"cuda_graphs": True}})
    assert eng.thinker_graphs is None and eng.stage0.ragged_graphs is False and eng.encoder_graphs is None
    messages = [r.getMessage() for r in caplog.records]
    assert any("engine.cuda_graphs applies to CUDA devices" in m for m in messages)
    assert any("engine.cuda_graphs needs a CUDA device; the audio encoder runs eagerly" in m for m in messages)
    eng.shutdown()


@pytest.mark.parametrize("on", [True, False])
def test_ragged_kernel_reaches_both_kv_caches(tmp_path, on):
    """``stage0.ragged_kernel`` sets the dispatch flag of the Thinker's and the Talker's caches
    (the kernel path itself runs on CUDA only: tests/kv/test_paged_attention.py checks it there)."""
    eng = engine(tmp_path, "ragged", {"stage0": {"ragged_kernel": on}})
    assert eng.thinker_cache.ragged_steps_in_kernel is on and eng.talker_cache.ragged_steps_in_kernel is on
    # a kernel program takes 16 / the GQA group tokens of one sequence (tiny: 4 q heads on 2 kv heads: 8)
    for cache, cfg in ((eng.thinker_cache, eng.models.thinker.config), (eng.talker_cache, eng.models.talker.config)):
        assert cache.ragged_tokens_per_program == 16 // (cfg.num_attention_heads // cfg.num_key_value_heads) == 8


def test_code2wav_dtype_reaches_the_flow_the_arena_the_caches_and_admission(tmp_path):
    """precision.code2wav_dtype: the engine's flow, arena and per-stream caches take the format,
    the vocoder stays float32, admission reserves the format's bytes, and the audio differs from
    float32's (the switch acts) while every session still gets it."""
    import torch

    from duplexcache.cfm.code2wav import code2wav_session_bytes

    base = {"engine": {"speak_policy": {"k": 1000, "turn_units": 1000}}}   # one turn: the stream stays open
    engines = {dt: engine(tmp_path, f"prec_{dt}", {**base, "precision": {"code2wav_dtype": dt}})
               for dt in ("float32", "bfloat16")}
    pcm = {}
    for dt, eng in engines.items():
        want = getattr(torch, dt)
        c2w = eng.code2wav
        assert next(c2w.flow.parameters()).dtype == want and c2w.dtype == want
        assert c2w.arena.att.dtype == want and c2w.arena.x.dtype == want
        assert next(c2w.hift.parameters()).dtype == torch.float32
        # admission reserves this format's Code2Wav bytes (the encoder's part is the same in both)
        cfg = eng.sizing.default_config("default")
        fp = eng.sizing.footprint(cfg, eng.models.voices.get("default"))
        encoder = eng.models.audio_encoder.cfg.kv_bytes_per_session(eng.models.dtype)
        p = eng.models.voices.get("default").prompt_frames
        steady = code2wav_session_bytes(c2w.config, p, c2w.config.prompt_att_sharing, "steady", want.itemsize)
        assert fp.dynamic_private_bytes - encoder == steady.private
        sid = eng.open_session({"voice": "default"})
        eng.push_audio(sid, audio(3, 4))
        got, streams_seen = [], 0
        for _ in range(4):
            got += [e.pcm16 for e in eng.tick() if hasattr(e, "pcm16")]
            for stream in c2w.sessions.values():   # the per-stream caches are in the format too
                assert stream.estimator_cnn.dtype == want and stream.conformer_att.dtype == want
                streams_seen += 1
        assert got and streams_seen, f"{dt}: no audio"
        pcm[dt] = b"".join(got)
        eng.shutdown()
    # the bfloat16 model's own weights are rounded copies of the shared float32 bundle's
    assert engines["float32"].code2wav.flow is engines["float32"].models.flow
    assert engines["bfloat16"].code2wav.flow is not engines["bfloat16"].models.flow
    assert len(pcm["float32"]) == len(pcm["bfloat16"]) and pcm["float32"] != pcm["bfloat16"]


def test_build_models_casts_the_flow_once_so_the_engine_runs_it_without_a_copy(tmp_path):
    """Serving builds its models from the same deploy: the bundle's flow is already bfloat16 (the
    float32 weights rounded), and the engine runs that module, not a second copy of the weights."""
    import torch

    from duplexcache.runtime.bundle import build_models

    deploy = deploy_from_yaml(tmp_path, "prec_build", {"precision": {"code2wav_dtype": "bfloat16"}})
    models = build_models(deploy, seed=0)
    assert next(models.flow.parameters()).dtype == torch.bfloat16
    assert next(models.hift.parameters()).dtype == torch.float32
    f32 = next(tiny_models().flow.parameters())   # the float32 bundle of the same seed
    assert torch.equal(next(models.flow.parameters()), f32.to(torch.bfloat16))   # the same weights, rounded
    eng = engine(tmp_path, "prec_engine", {"precision": {"code2wav_dtype": "bfloat16"}}, models=models)
    assert eng.code2wav.flow is models.flow
    eng.shutdown()


def _one_speaking_session(eng, seed: int, ticks: int) -> tuple[str, list[bytes]]:
    """Open a session, push 4 units of seeded audio, run ``ticks`` ticks: its id and audio chunks."""
    sid = eng.open_session({"voice": "default"})
    eng.push_audio(sid, audio(seed, 4))
    got: list[bytes] = []
    for _ in range(ticks):
        got += [e.pcm16 for e in eng.tick() if hasattr(e, "pcm16")]
    return sid, got


def test_kv_cache_dtype_reaches_both_kv_pools_and_admission(tmp_path):
    """precision.kv_cache_dtype: fp8_e4m3 makes the Thinker's and the Talker's pools fp8 with
    per-(token, kv head) scales, the memory plan and the ledger count the fp8 block bytes
    (values + scales), and the engine ticks and speaks; auto keeps the model dtype, no scales."""
    import torch

    from duplexcache.kv.paged_attention import bytes_per_block

    base = {"engine": {"speak_policy": {"k": 1000, "turn_units": 1000}}}   # one turn: the Talker runs
    engines = {dt: engine(tmp_path, f"kv_{dt}", {**base, "precision": {"kv_cache_dtype": dt}})
               for dt in ("auto", "fp8_e4m3")}
    pcm, layer0_k = {}, {}
    for dt, eng in engines.items():
        fp8 = dt == "fp8_e4m3"
        m = eng.models
        for cache, cfg, plan_bytes in ((eng.thinker_cache, m.thinker.config, eng.plan.thinker_block_bytes),
                                       (eng.talker_cache, m.talker.config, eng.plan.talker_block_bytes)):
            assert cache.dtype == m.dtype and cache.quantized is fp8
            assert cache.k.dtype == cache.v.dtype == (torch.float8_e4m3fn if fp8 else m.dtype)
            want = bytes_per_block(cfg.num_hidden_layers, eng.block_size, cfg.num_key_value_heads, cfg.head_dim,
                                   m.dtype, torch.float8_e4m3fn if fp8 else None)
            assert cache.bytes_per_block == plan_bytes == want
            if fp8:
                assert cache.k_scale.shape == cache.k.shape[:-1] == cache.v_scale.shape
                assert want == 2 * cfg.num_hidden_layers * eng.block_size * cfg.num_key_value_heads * (cfg.head_dim + 4)
            else:
                assert cache.k_scale is None and cache.v_scale is None
                assert want == 2 * cfg.num_hidden_layers * eng.block_size * cfg.num_key_value_heads * cfg.head_dim * 4
        # The ledger charges sessions the plan's block bytes (what KVCacheManager reports too).
        assert eng.thinker_manager.bytes_per_block == eng.plan.thinker_block_bytes
        sid, got = _one_speaking_session(eng, seed=3, ticks=4)
        assert got, f"{dt}: no audio"
        pcm[dt] = b"".join(got)
        if fp8:   # both pools were written through the quantizing path (scales above the floor)
            assert (eng.thinker_cache.k_scale > 1e-8).any() and (eng.talker_cache.v_scale > 1e-8).any()
        n = eng.stage0.num_tokens(sid)
        layer0_k[dt] = eng.thinker_cache.gather_blocks(0, torch.tensor(eng.stage0.block_table(sid)))[0][:n]
        eng.shutdown()
    # fp8 blocks are smaller, so the same budget holds more of them (float32 tiny: 20 of 64 bytes a row)
    assert engines["fp8_e4m3"].plan.thinker_blocks > engines["auto"].plan.thinker_blocks
    assert engines["fp8_e4m3"].plan.talker_blocks > engines["auto"].plan.talker_blocks
    # Same audio here: the tiny random Talker's sampled codes do not flip on fp8's small error.
    # The Thinker saw the same inputs, so its layer-0 keys (a function of the input alone)
    # differ by exactly one e4m3 rounding: not equal, within amax / 28 per (token, head).
    assert len(pcm["auto"]) == len(pcm["fp8_e4m3"])
    exact, fp8_k = layer0_k["auto"], layer0_k["fp8_e4m3"]
    assert exact.shape == fp8_k.shape and not torch.equal(exact, fp8_k)
    assert ((fp8_k - exact).abs() <= exact.abs().amax(-1, keepdim=True) / 28 * (1 + 1e-6)).all()


def test_encoder_cache_dtype_reaches_the_sessions_encoder_caches_and_admission(tmp_path):
    """precision.encoder_cache_dtype: fp8_e4m3 opens every session's streaming encoder cache in
    e4m3 with per-(frame, head) scales, admission reserves its fp8 bytes (the dynamic part of a
    footprint shrinks by exactly the difference), the bench's fast-forward grows it to those bytes, and the
    engine ticks and speaks; auto keeps the model dtype."""
    import torch

    base = {"engine": {"speak_policy": {"k": 1000, "turn_units": 1000}}}
    engines = {dt: engine(tmp_path, f"enc_{dt}", {**base, "precision": {"encoder_cache_dtype": dt}})
               for dt in ("auto", "fp8_e4m3")}
    dynamic = {}
    for dt, eng in engines.items():
        fp8 = dt == "fp8_e4m3"
        cfg = eng.models.audio_encoder.cfg
        full = cfg.kv_bytes_per_session(eng.models.dtype, torch.float8_e4m3fn if fp8 else None)
        dynamic[dt] = eng.sizing.footprint(eng.sizing.default_config("default"), eng.voices.get("default")).dynamic_private_bytes
        sid, got = _one_speaking_session(eng, seed=5, ticks=3)
        assert got, f"{dt}: no audio"
        state = eng.table.get_live(sid).encoder_state
        assert state.quantized is fp8 and state.k.dtype == (torch.float8_e4m3fn if fp8 else eng.models.dtype)
        if fp8:
            assert (state.k_scale[:, : state.num_frames] > 0).all()   # written through the quantizing path
        fast_forward_session(eng, sid, encoder_full_cache=True)
        assert state.nbytes == full == eng.stats().pools["audio_encoder"].private
        eng.shutdown()
    cfg = engines["auto"].models.audio_encoder.cfg
    saved = cfg.kv_bytes_per_session(torch.float32) - cfg.kv_bytes_per_session(torch.float32, torch.float8_e4m3fn)
    assert dynamic["auto"] - dynamic["fp8_e4m3"] == saved > 0
