"""The arena reads the voice prompt in place (PromptBank) and each session's private delta in
place (its own storage); its rows hold only the chunk's new keys.

Compared bit for bit with the old layout (`prompt_in_place=False`: the whole cache copied into
every row), sharing on and off, over several chunks (trims and recycled delta frames included),
two voices, staggered starts and replay groups with padded rows; and the arena's bytes are rows x
the widest chunk (or the setup pass, if wider), nothing per cache frame.
"""
import pytest
import torch
from helpers import TAIL, make_config, run_plan, tiny_models, token_stream, voice_inputs
from test_graphs import FakeGraphBackend

from duplexcache.cfm.code2wav import BatchedCode2Wav
from duplexcache.cfm.prompt_cache import PlainAttCache, SharedPromptAttCache

VOICES = {"a": voice_inputs(11, 10), "b": voice_inputs(12, 12)}    # P = 20 and 24 frames
# 9 sessions of both voices, starts at ticks 0..3, 4 or 5 chunks each (10 frames a chunk, tail 8:
# the first trim comes at the first chunk, the delta reaches P at the 2nd or 3rd), one with a
# wider final chunk (16 frames)
PLAN = {f"s{i}": ("a" if i % 2 else "b", i // 3, token_stream(90 + i, 4 + i % 2)) for i in range(8)}
PLAN["wide"] = ("a", 1, token_stream(99, 4, last_keeps_lookahead=True))
PLAN["long"] = ("b", 0, token_stream(98, 8))   # the delta's frames recycled 5 times over
TICKS = 8


def _stage(in_place: bool, graph_backend=None, **kw) -> BatchedCode2Wav:
    flow, hift = tiny_models()
    return BatchedCode2Wav(flow, hift, make_config(flow, **kw), graph_backend=graph_backend,
                           prompt_in_place=in_place)


def _assert_equal(got, want):
    for sid in PLAN:
        mels, pcms = got[sid]
        assert len(mels) == len(PLAN[sid][2]) >= 4
        for a, b in zip(mels, want[sid][0], strict=True):
            assert torch.equal(a, b), sid
        for a, b in zip(pcms, want[sid][1], strict=True):
            assert torch.equal(a, b), sid


@pytest.mark.parametrize("kw", [
    dict(max_num_seqs=16),                                               # one replay, all rows
    dict(max_num_seqs=8, graph_grid=(1, 2, 4), arena_rows_from_graph_grid=True),   # groups + padded rows
])
def test_in_place_equals_copied_arena_sharing_on_and_off(kw):
    old = run_plan(_stage(False, prompt_att_sharing=False, **kw), VOICES, PLAN, TICKS)
    for sharing in (False, True):
        stage = _stage(True, prompt_att_sharing=sharing, **kw)
        assert stage.arena.row_capacity == stage.config.max_chunk_frames   # the chunk's keys only
        got = run_plan(stage, VOICES, PLAN, TICKS)
        _assert_equal(got, old)
        want_type = SharedPromptAttCache if sharing else PlainAttCache
        assert all(isinstance(s.att, want_type) for s in stage.sessions.values())
    # the old layout with sharing on gives the same bits too (the reference sharing on/off check)
    _assert_equal(run_plan(_stage(False, prompt_att_sharing=True, **kw), VOICES, PLAN, TICKS), old)


def test_in_place_through_the_graph_path_equals_eager():
    """The fake backend records and replays the solve: the captured solve reads the bank and the
    frame map through static buffers only, so replays for other rows and voices stay exact."""
    kw = dict(prompt_att_sharing=True, max_num_seqs=8, graph_grid=(1, 4, 8))
    eager = run_plan(_stage(False, **kw), VOICES, PLAN, TICKS)
    fake = FakeGraphBackend()
    stage = _stage(True, graph_backend=fake, **kw)
    got = run_plan(stage, VOICES, PLAN, TICKS)
    assert fake.captured > 0 and fake.replayed > fake.captured
    assert stage.graph_stats.eager_runs == 0
    _assert_equal(got, eager)


@pytest.mark.parametrize("rows", [8, 1])
def test_arena_bytes_are_rows_times_the_widest_chunk(rows):
    """Exact: the keys' storage is rows x W frames (W the widest chunk), or the setup pass's P
    frames where that is more (one row here: P = 24 > W = 16); the old layout's is rows x K,
    K = W + P + tail. Nothing else changes size."""
    old, new = _stage(False, max_num_seqs=rows).arena, _stage(True, max_num_seqs=rows).arena
    cfg = make_config(tiny_models()[0])
    s = cfg.shape
    w, p = cfg.max_chunk_frames, cfg.max_prompt_frames
    assert (old.key_capacity, new.key_capacity) == (w + p + TAIL, w + p + TAIL)
    assert (old.row_capacity, new.row_capacity) == (w + p + TAIL, w)
    frame = s.att_frame_bytes(4)          # one key slot of one row: steps x layers x cfg x heads x 2hd
    assert frame == s.n_timesteps * s.depth * 2 * s.num_heads * 2 * s.head_dim * 4
    keys = max(rows * w, p)
    assert new.att_setup.shape[5] == p and new.att.shape[2] == rows
    assert new.att.untyped_storage().nbytes() == new.att_setup.untyped_storage().nbytes() == keys * frame
    assert old.nbytes() - new.nbytes() == (rows * (w + p + TAIL) - keys) * frame
    if rows > 1:
        assert new.att.numel() * 4 == keys * frame
    # the voices' frames are their prompt states (voice_bytes), not the arena's
    stage = _stage(True, max_num_seqs=8)
    before = stage.arena.nbytes()
    for name, v in VOICES.items():
        stage.register_voice(name, *v)
    assert stage.arena.nbytes() == before - (20 + 24) * frame
    assert stage.registry.state("a").estimator_att.numel() * 4 == 20 * frame   # counted in voice_bytes


def test_prompt_bank_growth_rebinds_views_and_keeps_the_bits():
    """A bank too small for the voices reallocates: earlier voices' states and sharing streams are
    re-pointed (nothing reads the old frames) and graphs that read the bank are captured again."""
    kw = dict(prompt_att_sharing=True, max_num_seqs=8)
    want = run_plan(_stage(False, **kw), VOICES, PLAN, TICKS)
    fake = FakeGraphBackend()
    stage = _stage(True, graph_backend=fake, prompt_bank_frames=1, **kw)
    stage.register_voice("a", *VOICES["a"])
    first = stage.arena.bank.frames
    stage.add_session("early", "a")
    stage._open_pending()
    stage.step({"early": token_stream(5, 1)[0]})          # captures a key that reads the bank
    bank_keys = [k for k in stage.arena.graph_keys if k[2] > 0]
    assert bank_keys
    stage.register_voice("b", *VOICES["b"])               # does not fit: the bank grows
    assert stage.arena.bank.frames is not first
    assert not any(k in stage.arena.graph_keys for k in bank_keys)
    frames = stage.arena.bank.frames.untyped_storage().data_ptr()
    assert stage.sessions["early"].att.prompt.untyped_storage().data_ptr() == frames
    assert stage.registry.state("a").estimator_att.untyped_storage().data_ptr() == frames
    stage.remove_session("early")
    got = run_plan(_NoReRegister(stage), VOICES, PLAN, TICKS)
    _assert_equal(got, want)


class _NoReRegister:
    """`run_plan` registers the voices; this stage has them already."""

    def __init__(self, stage: BatchedCode2Wav) -> None:
        self._stage = stage

    def register_voice(self, *a) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self._stage, name)


def test_unregistered_voice_leaves_a_gap_the_next_voice_reuses():
    stage = _stage(True, max_num_seqs=4, prompt_bank_frames=1 + 24 + 20)
    stage.register_voice("b", *VOICES["b"])
    stage.register_voice("a", *VOICES["a"])
    bank = stage.arena.bank
    assert (bank.offset("b"), bank.offset("a"), bank.version) == (1, 25, 0)
    stage.unregister_voice("b")
    stage.register_voice("a2", *VOICES["a"], share_equal=False)   # 20 frames fit the 24-frame gap
    assert (bank.offset("a2"), bank.version) == (1, 0)
    assert torch.equal(bank.view("a2"), bank.view("a"))
