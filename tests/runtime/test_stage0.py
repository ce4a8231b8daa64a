"""Stage0Runner: shared anchor blocks, isolation of contexts, batching, errors, accounting.

Every comparison runs the SAME random Thinker weights through two runners (sharing on and
off) with their own pools; bit-exact means torch.equal.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from duplexcache.kv.block_pool import BlockPool
from duplexcache.kv.kv_cache_manager import KVCacheManager
from duplexcache.kv.window import ContextLengthExceeded, WindowConfig
from duplexcache.models.thinker import Thinker, ThinkerConfig
from duplexcache.runtime.stage0.runner import (
    BlockBudgetTooSmall,
    SessionContextInput,
    Stage0Runner,
    WorstCaseBlocks,
    session_worst_case,
    stage0_session_bytes,
)

BS = 16
OFF = WindowConfig(mode="off")


def tiny_config(**kw) -> ThinkerConfig:
    # tiny() shapes with a small vocabulary so every forward and lm_head stays fast.
    return dataclasses.replace(ThinkerConfig.tiny(), vocab_size=512, **kw)


def make_thinker(seed: int = 0, dtype=torch.float32, **kw) -> Thinker:
    torch.manual_seed(seed)
    return Thinker(tiny_config(**kw)).to(dtype).eval()


def make_runner(thinker: Thinker, num_blocks: int = 64, window: WindowConfig = OFF, share: bool = True):
    cache = thinker.make_kv_cache(num_blocks, BS, thinker.lm_head.weight.dtype)
    mgr = KVCacheManager(BlockPool(num_blocks), BS, cache.bytes_per_block)
    return Stage0Runner(thinker, mgr, cache, window, share_context=share, block_size=BS)


def make_context(thinker: Thinker, num_tokens: int, seed: int, voice_seed: int | None = None,
                 extra_key: bytes = b"voice-a|rev0") -> SessionContextInput:
    """Context with a filler-id "audio" span in the middle, as the session builder makes it."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 500, (num_tokens,), generator=g)
    audio = slice(num_tokens // 4, num_tokens // 4 + 10)
    ids[audio] = 7  # filler id: identical across voices
    with torch.no_grad():
        embeds = thinker.embed(ids).clone()
        gv = torch.Generator().manual_seed(1000 + (seed if voice_seed is None else voice_seed))
        embeds[audio] = torch.randn(10, thinker.config.hidden_size, generator=gv).to(embeds.dtype)
    return SessionContextInput(embeds, ids, extra_key)


def unit_inputs(thinker: Thinker, sids, n: int, step: int) -> dict[str, torch.Tensor]:
    """Different random embeddings per session and step (seeded)."""
    out = {}
    for i, sid in enumerate(sids):
        g = torch.Generator().manual_seed(10_000 * step + i)
        out[sid] = torch.randn(n, thinker.config.hidden_size, generator=g).to(thinker.lm_head.weight.dtype)
    return out


def run_script(runner: Stage0Runner, thinker: Thinker, sids, steps: int = 3) -> list[dict[str, torch.Tensor]]:
    """Alternate units of 11 embeddings and 2 greedy decode steps; returns logits per call."""
    outs = []
    for step in range(steps):
        res = runner.append(unit_inputs(thinker, sids, 11, step), unit_start=True)
        assert not res.errors
        outs.append(dict(res.logits))
        for _ in range(2):
            res = runner.decode({sid: int(res[sid].argmax()) for sid in sids})
            assert not res.errors
            outs.append(dict(res.logits))
    return outs


def dense_last_logits(thinker: Thinker, embeds: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        pos = torch.arange(embeds.shape[0])[None]
        return thinker.forward_dense(embeds[None], pos)[0, -1]


def open_counting_tokens(runner: Stage0Runner, contexts) -> list[int]:
    """Open sessions; return the number of tokens of each forward the runner ran."""
    counts: list[int] = []
    forward = runner._forward

    def counting(work):
        counts.append(sum(w.embeds.shape[0] for w in work))
        return forward(work)

    runner._forward = counting
    try:
        assert not runner.open_sessions(contexts).errors
    finally:
        runner._forward = forward
    return counts


# ---------------------------------------------------------------- sharing


def test_same_context_one_physical_copy_and_bit_exact_vs_unshared():
    thinker = make_thinker()
    ctx = make_context(thinker, 40, seed=1)  # 2 full blocks + 8-token tail
    shared, private = make_runner(thinker, share=True), make_runner(thinker, share=False)
    sids = ["s0", "s1", "s2", "s3"]
    # With sharing only the first session computes (its tail is then the template the other
    # 3 copy); without sharing each of the 4 computes its 40 tokens in a forward of its own.
    assert open_counting_tokens(shared, {sid: ctx for sid in sids}) == [40]
    assert open_counting_tokens(private, {sid: ctx for sid in sids}) == [40, 40, 40, 40]
    # The 3 tails came from the manager's deferred copy-on-write pairs, not a recomputation.
    assert shared.manager.num_cow_copies == 3 and private.manager.num_cow_copies == 0
    tables = [shared.block_table(s) for s in sids]
    full = tables[0][:2]
    assert all(t[:2] == full for t in tables), tables  # same physical full blocks everywhere
    assert [shared.manager.pool.blocks[b].ref_cnt for b in full] == [4, 4]
    assert len({t[2] for t in tables}) == 4  # private copy-on-write tails
    # One copy of the full blocks: 4 tails + 2 full + 1 template (vs 4 * 3 unshared).
    assert shared.pool_stats().used == 7 and private.pool_stats().used == 12
    # Every tail holds the same bits as the template it was copied from.
    k, v = shared.cache.k, shared.cache.v
    for t in tables[1:]:
        assert torch.equal(k[:, t[2], :8], k[:, tables[0][2], :8])
        assert torch.equal(v[:, t[2], :8], v[:, tables[0][2], :8])
    out_shared = run_script(shared, thinker, sids)
    out_private = run_script(private, thinker, sids)
    for a, b in zip(out_shared, out_private):
        for sid in sids:
            assert torch.equal(a[sid], b[sid]), sid
    shared.manager.check_invariants()
    # Independent reference: dense forward over context + unit of s0 (first append).
    first = torch.cat([ctx.inputs_embeds, unit_inputs(thinker, sids, 11, 0)["s0"]])
    torch.testing.assert_close(out_shared[0]["s0"], dense_last_logits(thinker, first), rtol=1e-5, atol=1e-5)


def test_sharing_stays_bit_exact_when_matmuls_depend_on_row_count():
    """GPU GEMMs choose kernels by row count, so the same row can come out with other last bits
    inside a bigger batch (seen on an H200). Emulate that on the CPU with a k_proj whose output
    depends on how many rows it got: opening 2 same-context sessions must still give unshared
    logits torch.equal to shared ones, which holds only if each session's context is prefilled
    in a forward of its own, exactly as the shared copy was (a batched unshared prefill fails)."""
    thinker = make_thinker()
    k_proj = thinker.model.layers[0].self_attn.k_proj
    plain = k_proj.forward
    k_proj.forward = lambda x: plain(x) * (1.0 + 1e-6 * (x.shape[0] % 97))  # row-count dependent
    ctx = make_context(thinker, 40, seed=1)
    sids = ["s0", "s1"]
    outs = []
    for share in (True, False):
        runner = make_runner(thinker, share=share)
        assert not runner.open_sessions({sid: ctx for sid in sids}).errors
        outs.append(run_script(runner, thinker, sids))
    for a, b in zip(*outs):
        for sid in sids:
            assert torch.equal(a[sid], b[sid])


def test_later_session_copies_ready_template_and_matches_unshared():
    thinker = make_thinker()
    ctx = make_context(thinker, 40, seed=1)
    shared, private = make_runner(thinker, share=True), make_runner(thinker, share=False)
    for r in (shared, private):
        r.open_session("a", ctx)
    misses_before = shared.manager.num_miss_blocks
    for r in (shared, private):
        r.open_session("b", ctx)  # a later call: full hit + copy of the ready template
    assert shared.manager.num_miss_blocks == misses_before and shared.manager.num_cow_copies == 1
    assert shared.block_table("a")[:2] == shared.block_table("b")[:2]
    for a, b in zip(run_script(shared, thinker, ["a", "b"], 2), run_script(private, thinker, ["a", "b"], 2)):
        assert all(torch.equal(a[s], b[s]) for s in ("a", "b"))


def test_different_contexts_never_share():
    thinker = make_thinker()
    r = make_runner(thinker)
    r.open_sessions({"x": make_context(thinker, 48, seed=1), "y": make_context(thinker, 48, seed=2)})
    assert not set(r.block_table("x")) & set(r.block_table("y"))
    assert all(r.manager.pool.blocks[b].ref_cnt == 1 for b in r.block_table("x") + r.block_table("y"))


def test_same_ids_different_extra_key_never_share_and_differ():
    thinker = make_thinker()
    ctx_a = make_context(thinker, 40, seed=1, voice_seed=1, extra_key=b"voice-a|rev0")
    ctx_b = make_context(thinker, 40, seed=1, voice_seed=2, extra_key=b"voice-b|rev0")
    assert ctx_a.token_ids == ctx_b.token_ids  # filler ids hide the different voices
    assert not torch.equal(ctx_a.inputs_embeds, ctx_b.inputs_embeds)
    r = make_runner(thinker)
    r.open_sessions({"a": ctx_a, "b": ctx_b})
    assert not set(r.block_table("a")) & set(r.block_table("b"))
    # The first block (before the audio span) has equal embeddings but is keyed by extra_key too.
    same = unit_inputs(thinker, ["a"], 5, 0)["a"]
    out = r.append({"a": same, "b": same}, unit_start=True)
    assert not torch.equal(out["a"], out["b"])
    ref_b = dense_last_logits(thinker, torch.cat([ctx_b.inputs_embeds, same]))
    torch.testing.assert_close(out["b"], ref_b, rtol=1e-5, atol=1e-5)


def test_full_block_context_is_a_zero_length_prefill_on_hit():
    thinker = make_thinker()
    ctx = make_context(thinker, 32, seed=3)  # exactly 2 blocks: no tail, no template
    r = make_runner(thinker)
    r.open_session("a", ctx)
    computed_before = r.manager.num_miss_blocks
    r.open_session("b", ctx)
    assert r.manager.num_miss_blocks == computed_before
    assert r.block_table("a") == r.block_table("b")
    inputs = unit_inputs(thinker, ["a", "b"], 3, 0)
    out = r.append(inputs, unit_start=True)
    ref = dense_last_logits(thinker, torch.cat([ctx.inputs_embeds, inputs["b"]]))
    torch.testing.assert_close(out["b"], ref, rtol=1e-5, atol=1e-5)
    assert r.block_table("a")[:2] == r.block_table("b")[:2] and r.block_table("a")[2] != r.block_table("b")[2]


# ---------------------------------------------------------------- lifecycle and errors


def test_close_all_returns_pool_to_free_with_shared_blocks_cached():
    thinker = make_thinker()
    r = make_runner(thinker)
    ctx = make_context(thinker, 40, seed=1)
    r.open_sessions({f"s{i}": ctx for i in range(3)})
    run_script(r, thinker, [f"s{i}" for i in range(3)], 1)
    for i in range(3):
        r.close_session(f"s{i}")
    r.manager.check_invariants()
    st = r.pool_stats()
    assert st.used == 0 and st.free == st.num_blocks
    assert st.cached_free == 3  # 2 full context blocks + the tail template, still cached (LRU)


def test_context_longer_than_position_limit_fails_only_that_session():
    thinker = make_thinker(max_position_embeddings=128)
    r = make_runner(thinker, window=WindowConfig("basic", high_tokens=64, low_tokens=32))
    res = r.open_sessions({"ok": make_context(thinker, 40, seed=1), "long": make_context(thinker, 80, seed=2)})
    assert set(res.errors) == {"long"} and isinstance(res.errors["long"], ContextLengthExceeded)
    assert "context_length_exceeded" in str(res.errors["long"])
    with pytest.raises(ContextLengthExceeded):
        res["long"]
    assert "long" not in r.sessions and "long" not in r.manager
    assert not r.append(unit_inputs(thinker, ["ok"], 12, 0), unit_start=True).errors


def flood_one_of_two():
    """Open "a" and "b" on one 40-token context (window 48/32), then append a normal unit to
    "a" and more than the whole window to "b". Returns (thinker, runner, ctx, result)."""
    thinker = make_thinker()
    r = make_runner(thinker, window=WindowConfig("basic", high_tokens=48, low_tokens=32))
    ctx = make_context(thinker, 40, seed=1)
    r.open_sessions({"a": ctx, "b": ctx})
    inputs = unit_inputs(thinker, ["a", "b"], 12, 0)
    inputs["b"] = torch.randn(60, thinker.config.hidden_size)  # more than the whole window
    res = r.append(inputs, unit_start=True)
    return thinker, r, ctx, res


def test_too_many_incoming_tokens_end_only_that_session():
    thinker, r, _, res = flood_one_of_two()
    assert set(res.logits) == {"a"} and isinstance(res.errors["b"], ContextLengthExceeded)
    assert "b" not in r.manager
    r.manager.check_invariants()
    assert not r.append(unit_inputs(thinker, ["a"], 12, 1), unit_start=True).errors


def test_window_off_ends_session_at_pool_limit():
    thinker = make_thinker()
    r = make_runner(thinker, num_blocks=6)  # 5 usable blocks
    r.open_sessions({"a": make_context(thinker, 40, seed=1)})  # 3 blocks + template
    for step in range(2):  # 52 then 64 tokens: 4 blocks + template = all 5
        assert not r.append(unit_inputs(thinker, ["a"], 12, step), unit_start=True).errors
    res = r.append(unit_inputs(thinker, ["a"], 12, 2), unit_start=True)  # 76 tokens: a 5th table block
    assert isinstance(res.errors["a"], ContextLengthExceeded) and "free" in str(res.errors["a"])
    assert r.pool_stats().used == 0


def test_block_budget_too_small_names_the_numbers():
    thinker = make_thinker()
    r = make_runner(thinker, num_blocks=8, window=WindowConfig("basic", high_tokens=200, low_tokens=100))
    ctx = make_context(thinker, 40, seed=1)
    with pytest.raises(BlockBudgetTooSmall, match=r"needs up to 16 blocks .*context 40 \+ window high 200.* only 7"):
        r.can_open(ctx)
    with pytest.raises(BlockBudgetTooSmall):
        r.open_session("a", ctx)
    assert r.pool_stats().used == 0


def test_caller_mistakes_raise_value_error():
    thinker = make_thinker()
    r = make_runner(thinker)
    ctx = make_context(thinker, 20, seed=1)
    r.open_session("a", ctx)
    r.open_session("b", ctx)
    with pytest.raises(ValueError, match="already open"):
        r.open_session("a", ctx)
    with pytest.raises(ValueError, match="unknown session"):
        r.append({"zz": torch.zeros(1, 64)}, unit_start=False)
    with pytest.raises(ValueError, match="inputs_embeds must be"):
        r.append({"a": torch.zeros(2, 64), "b": torch.zeros(2, 63)}, unit_start=False)
    assert r.num_tokens("a") == 20  # the valid session of the refused call was not touched
    with pytest.raises(ValueError, match="token ids"):
        SessionContextInput(torch.zeros(3, 64), [1, 2], b"")


# ---------------------------------------------------------------- accounting


@pytest.mark.parametrize("ctx_len,window", [(40, 0), (40, 30), (32, 50), (5, 100)])
@pytest.mark.parametrize("share", [True, False])
def test_stage0_session_bytes_matches_manager(ctx_len, window, share):
    """The pure-shape formula used for docs/stage0.md equals what the manager reports."""
    cfg = tiny_config()
    mgr = KVCacheManager(BlockPool(64), BS, 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * BS)
    ids = list(range(ctx_len))
    mgr.allocate_context("warm", ids, b"k", share)  # another session with the context first
    mgr.commit_context("warm")
    mgr.allocate_context("s", ids, b"k", share)
    mgr.append_slots("s", window)
    want = stage0_session_bytes(cfg, ctx_len, window, share, dtype=torch.float32, block_size=BS)
    assert mgr.session_bytes("s") == want


def test_minicpmo45_bytes_table_from_shapes_only():
    """The docs/stage0.md table: 144 KiB/token in bf16, 2.25 MiB per 16-token block."""
    from duplexcache.bench.stage0_bytes import table_rows

    rows = table_rows(ThinkerConfig.minicpmo45(), [96, 400], 8000, torch.bfloat16)
    mib = 1024 * 1024
    got = [(r["context"], r["on"].private / mib, r["on"].shared / mib, r["off"].private / mib) for r in rows]
    assert got == [
        (96, 0.0, 13.5, 13.5),  # 6 full blocks, all shared
        (96, 1125.0, 13.5, 1138.5),  # + 500 private window blocks
        (400, 0.0, 56.25, 56.25),  # 25 full blocks
        (400, 1125.0, 56.25, 1181.25),
    ]


def test_evicted_context_is_recomputed_not_read_stale():
    """nano-vllm's stale-hash bug: once other sessions overwrite a cached context's blocks,
    reopening that context must recompute it, and its logits must match a dense forward."""
    thinker = make_thinker()
    r = make_runner(thinker, num_blocks=9)  # 8 usable blocks
    ctx_a, ctx_b = make_context(thinker, 40, seed=1), make_context(thinker, 128, seed=2)
    r.open_session("a", ctx_a)
    r.close_session("a")
    assert r.pool_stats().cached_free == 3
    r.open_session("b", ctx_b)  # 8 blocks: evicts every cached block of ctx_a
    r.close_session("b")
    misses = r.manager.num_miss_blocks
    r.open_session("a2", ctx_a)
    assert r.manager.num_miss_blocks == misses + 2  # both full blocks recomputed
    inputs = unit_inputs(thinker, ["a2"], 6, 0)
    out = r.append(inputs, unit_start=True)
    ref = dense_last_logits(thinker, torch.cat([ctx_a.inputs_embeds, inputs["a2"]]))
    torch.testing.assert_close(out["a2"], ref, rtol=1e-5, atol=1e-5)
    r.manager.check_invariants()


# ---------------------------------------------------------------- worst case for admission


@pytest.mark.parametrize("mode,high,prefix,share,table,template,shared", [
    ("basic", 96, 40, True, 9, 1, 3),  # ceil(136/16) = 9; 2 full + template shared
    ("basic", 96, 40, False, 9, 0, 0),  # no template, nothing shared
    ("basic", 96, 32, True, 8, 0, 2),  # context on a block boundary: no template
    ("basic", 96, 41, True, 9, 1, 3),  # ceil(137/16) = 9
    ("basic", 97, 40, True, 9, 1, 3),  # 137 tokens: still 9
    ("basic", 105, 40, True, 10, 1, 3),  # 145 tokens: a 10th block
    ("rebuild", 96, 5, True, 7, 1, 1),  # ceil(101/16) = 7; the template is the only shared block
    ("off", 96, 40, True, 8, 1, 3),  # no window: the model's 128 positions -> 8 blocks
    ("off", 96, 40, False, 8, 0, 0),
])
def test_worst_case_blocks_exact(mode, high, prefix, share, table, template, shared):
    thinker = make_thinker(max_position_embeddings=128, num_hidden_layers=1)
    r = make_runner(thinker, window=WindowConfig(mode, high_tokens=high, low_tokens=high // 2), share=share)
    wc = r.worst_case(prefix)
    assert wc == WorstCaseBlocks(table_blocks=table, template_blocks=template, shared_blocks=shared)
    assert r.worst_case_blocks(prefix) == table + template == wc.private_blocks + wc.shared_blocks
    # The engine's admission calls the same pure function, with the same inputs it sees.
    assert session_worst_case(prefix, r.window, 128, BS, share) == wc
    # Independent closed form (stage0_session_bytes, itself checked against a real manager):
    # a session holding its longest table has exactly the worst case's private/shared split.
    per_block = r.cache.bytes_per_block
    ref = stage0_session_bytes(thinker.config, prefix, r.longest_tokens(prefix) - prefix, share,
                               dtype=torch.float32, block_size=BS)
    assert (wc.private_blocks * per_block, wc.shared_blocks * per_block) == (ref.private, ref.shared)
    with pytest.raises(ValueError, match="prefix_len"):
        r.worst_case(0)


def test_window_off_fits_alone_needs_only_the_context():
    """Without a window a session runs until the pool or the model's positions end it, so
    only its context (+ template) must fit the pool; its worst case is the model's positions."""
    thinker = make_thinker()
    r = make_runner(thinker, num_blocks=5)  # 4 usable blocks, window off
    ctx = make_context(thinker, 40, seed=1)
    assert r.worst_case_blocks(40) == 40960 // BS + 1
    assert r.can_open(ctx)  # 3 context blocks + template = 4
    with pytest.raises(BlockBudgetTooSmall, match=r"needs up to 5 blocks .*context 49 \+ window high 0"):
        r.can_open(make_context(thinker, 49, seed=2))  # ceil(49/16) = 4 blocks + template > 4


# ---------------------------------------------------------------- hidden states for the Talker


def test_hidden_rows_are_exactly_what_lm_head_consumed():
    """``StepResult.hidden[sid]`` is the final-norm row whose logits the call returns: captured
    independently with a pre-hook on lm_head, and lm_head of the returned rows gives the
    returned logits bit for bit; each row also matches a dense forward's last hidden state."""
    thinker = make_thinker()
    r = make_runner(thinker)
    ctxs = {"a": make_context(thinker, 40, seed=1), "b": make_context(thinker, 21, seed=2),
            "c": make_context(thinker, 40, seed=1)}
    r.open_sessions(ctxs)
    consumed: list[torch.Tensor] = []
    hook = thinker.lm_head.register_forward_pre_hook(lambda m, a: consumed.append(a[0].clone()))
    try:
        inputs = unit_inputs(thinker, ["a", "b", "c"], 11, 0)
        inputs["b"] = inputs["b"][:4]  # ragged: 11, 4, 11 new tokens
        res_append = r.append(inputs, unit_start=True)
        res_decode = r.decode({sid: int(res_append[sid].argmax()) for sid in ("c", "a")})
    finally:
        hook.remove()
    assert len(consumed) == 2
    for res, rows in ((res_append, consumed[0]), (res_decode, consumed[1])):
        sids = list(res.logits)
        assert list(res.hidden) == sids
        hidden = torch.stack([res.hidden[s] for s in sids])  # (B, H): only the last rows
        assert hidden.shape == (len(sids), thinker.config.hidden_size)
        assert torch.equal(hidden, rows)
        assert torch.equal(thinker.compute_logits(hidden), torch.stack([res.logits[s] for s in sids]))
    assert list(res_decode.hidden) == ["c", "a"]
    # Independent reference: dense forward over context + unit, hidden state entering lm_head.
    dense: list[torch.Tensor] = []
    hook = thinker.lm_head.register_forward_pre_hook(lambda m, a: dense.append(a[0][0, -1].clone()))
    try:
        dense_last_logits(thinker, torch.cat([ctxs["b"].inputs_embeds, inputs["b"]]))
    finally:
        hook.remove()
    torch.testing.assert_close(res_append.hidden["b"], dense[0], rtol=1e-5, atol=1e-5)


def test_ended_session_has_no_hidden_row():
    _, r, ctx, res = flood_one_of_two()
    assert set(res.errors) == {"b"} and set(res.hidden) == set(res.logits) == {"a"}
    assert r.open_sessions({"c": ctx}).hidden == {}  # opening computes no logits, no rows
