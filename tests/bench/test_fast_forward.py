"""The benchmarks' fast-forward (duplexcache/bench/fast_forward.py) on a live tiny engine.

It must go through the serving append path (so the next real unit compacts the window exactly
as serving does), be seeded, refuse bad requests before changing anything, and hold a full
Talker turn and a full encoder cache.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "runtime"))
from engine_helpers import audio, collect, engine

from duplexcache.bench.fast_forward import fast_forward_session
from duplexcache.runtime.memory.session_sizing import largest_unit_tokens

HIGH, LOW = 80, 40
WINDOW = {"stage0": {"window": {"mode": "basic", "high_tokens": HIGH, "low_tokens": LOW}},
          "engine": {"speak_policy": {"k": 8}}}   # listen units: cheap ticks


def _opened(tmp_path, name: str, sections: dict = WINDOW, units: int = 2):
    """An engine with one session that has run its first unit (open in Stage 0)."""
    eng = engine(tmp_path, name, sections)
    sid = eng.open_session({"voice": "default"})
    eng.push_audio(sid, audio(0, units))
    assert not collect(eng.tick()).get(sid, {}).get("errors")
    return eng, sid


def _thinker_kv(eng, sid: str, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of logical tokens [start, stop) of ``sid``, (layers, tokens, kv_heads, head_dim)."""
    cache, table = eng.thinker_cache, eng.stage0.block_table(sid)
    idx = torch.tensor(table, dtype=torch.long)
    k = cache.k[:, idx].flatten(1, 2)[:, start:stop]
    v = cache.v[:, idx].flatten(1, 2)[:, start:stop]
    return k.clone(), v.clone()


def test_fill_to_high_mark_then_next_unit_compacts_as_serving(tmp_path):
    eng, sid = _opened(tmp_path, "ff")
    before = eng.session_info(sid)
    anchor, have = before.thinker_anchor_tokens, before.thinker_tokens - before.thinker_anchor_tokens
    assert before.opened and anchor > 0 and 0 < have < HIGH and before.talker_blocks == 0
    assert eng.session_ids() == [sid] and before.window.high_tokens == HIGH

    res = fast_forward_session(eng, sid, thinker_tokens=HIGH, talker_full_turn=True, chunk_tokens=16)
    after = eng.session_info(sid)
    # a full turn is what admission reserved: this policy's 2-unit turn (session_sizing.reserved_turn_tokens)
    talker_max = eng.sizing.talker_turn_tokens
    assert talker_max == 2 * largest_unit_tokens(eng.models.talker.config)
    assert res.thinker_tokens_appended == HIGH - have and after.thinker_tokens == anchor + HIGH
    assert res.talker_blocks_added == after.talker_blocks == -(-talker_max // eng.block_size)
    assert after.talker_tokens == 0   # held, not computed
    assert eng.stage0.sessions[sid].num_compactions == 0   # the fill stops at the high mark
    # pools are refreshed by the fast-forward itself (no tick in between)
    pools = eng.stats().pools
    table = eng.stage0.block_table(sid)
    assert pools["thinker_kv"].private + pools["thinker_kv"].shared == len(table) * eng.thinker_cache.bytes_per_block
    assert pools["talker_kv"].private == after.talker_blocks * eng.talker_cache.bytes_per_block

    # the next real unit passes prefix + high: the window compacts on the serving path
    out = collect(eng.tick()).get(sid, {"errors": []})
    assert not out["errors"]
    now = eng.session_info(sid)
    assert eng.stage0.sessions[sid].num_compactions == 1 and now.units == 2
    assert now.thinker_anchor_tokens == anchor and now.thinker_tokens <= anchor + HIGH
    assert eng.stage0.block_table(sid)[: eng.stage0.num_anchor_blocks(sid)] == table[: eng.stage0.num_anchor_blocks(sid)]


def test_full_encoder_cache_is_held_not_computed(tmp_path):
    eng, sid = _opened(tmp_path, "enc")
    state = eng.table.get_live(sid).encoder_state
    full = eng.models.audio_encoder.cfg.kv_bytes_per_session(eng.models.dtype)
    frames = state.num_frames
    assert 0 < state.nbytes < full   # the cache grows by blocks: one unit holds less than the whole
    fast_forward_session(eng, sid, encoder_full_cache=True)
    assert state.nbytes == full == eng.stats().pools["audio_encoder"].private
    assert state.num_frames == frames   # held, not computed
    assert not collect(eng.tick()).get(sid, {}).get("errors")


def test_fill_is_seeded_and_chunking_changes_only_rounding(tmp_path):
    kv = {}
    for name, chunk, seed in (("a", 7, 0), ("b", 512, 0), ("c", 512, 0), ("d", 512, 1)):
        eng, sid = _opened(tmp_path, name)
        start = eng.session_info(sid).thinker_tokens
        fast_forward_session(eng, sid, thinker_tokens=HIGH, chunk_tokens=chunk, seed=seed)
        kv[name] = _thinker_kv(eng, sid, start, eng.session_info(sid).thinker_tokens)
        eng.shutdown()
    for x, y in zip(kv["b"], kv["c"]):
        assert torch.equal(x, y)            # same seed, same chunks: bit-identical
    for x, y in zip(kv["a"], kv["b"]):      # chunked prefill = one prefill, up to rounding
        assert x.shape == y.shape and torch.allclose(x, y, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(kv["b"][0], kv["d"][0])   # another seed, other tokens


def test_bad_requests_are_refused_before_anything_changes(tmp_path):
    eng, sid = _opened(tmp_path, "bad")
    with pytest.raises(ValueError, match="unknown session 'nope'"):
        fast_forward_session(eng, "nope", thinker_tokens=HIGH)
    fresh = eng.open_session({"voice": "default"})
    with pytest.raises(ValueError, match="not open in Stage 0 yet"):
        fast_forward_session(eng, fresh, thinker_tokens=HIGH)
    before = eng.session_info(sid)
    with pytest.raises(ValueError, match="past the window's high mark"):
        fast_forward_session(eng, sid, thinker_tokens=HIGH + 1, talker_full_turn=True)
    with pytest.raises(ValueError, match="chunk_tokens"):
        fast_forward_session(eng, sid, thinker_tokens=HIGH, chunk_tokens=0)
    assert eng.session_info(sid) == before   # nothing grew, Talker included
    fast_forward_session(eng, sid, thinker_tokens=50)
    with pytest.raises(ValueError, match="below the 50 window tokens"):
        fast_forward_session(eng, sid, thinker_tokens=40)
    assert fast_forward_session(eng, sid, thinker_tokens=50).thinker_tokens_appended == 0


def test_window_off_limit_is_the_model_positions(tmp_path):
    eng, sid = _opened(tmp_path, "off", {"stage0": {"window": {"mode": "off"}}, "engine": {"speak_policy": {"k": 8}}},
                       units=1)
    info = eng.session_info(sid)
    limit = eng.models.thinker.config.max_position_embeddings - info.thinker_anchor_tokens
    with pytest.raises(ValueError, match="positions less the"):
        fast_forward_session(eng, sid, thinker_tokens=limit + 1)


def test_full_talker_turn_is_used_by_the_next_speaking_units(tmp_path):
    eng, sid = _opened(tmp_path, "talk", {"engine": {"speak_policy": {"k": 100, "turn_units": 100}}}, units=3)
    held = fast_forward_session(eng, sid, talker_full_turn=True).talker_blocks_added
    assert held > 0 and eng.session_info(sid).talker_tokens == 30   # unit 1 spoke: 4 + 26 tokens
    free = eng.talker_pool.num_free
    got = collect(eng.tick())[sid]
    assert [len(a) // 2 for a in got["audio"]] == [24000] and not got["errors"]
    info = eng.session_info(sid)
    assert info.talker_tokens == 60 and eng.talker_pool.num_free == free   # computed into held blocks
