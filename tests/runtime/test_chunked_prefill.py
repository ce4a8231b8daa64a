"""Stage0Runner's chunked open (enqueue_open / prefill): bounded work per call, the same K/V as
the one-forward open, shared blocks still shared, and nothing left behind by a session closed
or failing mid-prefill."""

from __future__ import annotations

import math

import pytest
import torch
from engine_helpers import record_sdpa
from test_stage0 import BS, make_context, make_runner, make_thinker, unit_inputs

from duplexcache.runtime.isolation import FaultInjector


def _kv_of(runner, sid: str, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The session's K and V for its first ``num_tokens`` tokens, all layers, in logical order."""
    table = torch.tensor(runner.block_table(sid), dtype=torch.long)
    k = runner.cache.k[:, table].flatten(1, 2)[:, :num_tokens]
    v = runner.cache.v[:, table].flatten(1, 2)[:, :num_tokens]
    return k.clone(), v.clone()


def _prefill_all(runner, chunk: int) -> list:
    results = []
    while runner._prefills:
        results.append(runner.prefill(chunk))
    return results


def test_chunked_prefill_matches_the_one_forward_open_and_bounds_each_call():
    thinker = make_thinker()
    ctx = make_context(thinker, 150, seed=1)
    whole = make_runner(thinker, share=False)
    whole.open_session("a", ctx)
    chunked = make_runner(thinker, share=False)
    chunked.enqueue_open("a", ctx)
    assert chunked.is_prefilling("a") and "a" not in chunked.sessions
    results = _prefill_all(chunked, 64)
    assert [r.computed_tokens for r in results] == [64, 64, 22]
    assert [r.opened for r in results] == [[], [], ["a"]]
    kw, vw = _kv_of(whole, "a", 150)
    kc, vc = _kv_of(chunked, "a", 150)
    # Chunks change the GEMM row counts, so the bits may differ in the last place (on CPU too):
    # equal within float32 rounding, and the next step's logits agree the same way.
    torch.testing.assert_close(kc, kw, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vc, vw, rtol=1e-5, atol=1e-5)
    step = unit_inputs(thinker, ["a"], 11, 0)
    torch.testing.assert_close(chunked.append(step, True)["a"], whole.append(step, True)["a"], rtol=1e-4, atol=1e-4)


def test_chunks_are_aligned_so_the_same_context_always_gets_the_same_bits():
    """A context computed after another session used part of the budget is computed with the
    same chunks as one computed first: sharing off (every session computes) stays bit-identical."""
    thinker = make_thinker()
    ctx = make_context(thinker, 100, seed=2)
    other = make_context(thinker, 40, seed=3, extra_key=b"other")
    runner = make_runner(thinker, share=False)
    runner.enqueue_open("first", ctx)
    runner.enqueue_open("filler", other)
    runner.enqueue_open("second", ctx)
    while runner._prefills:
        r = runner.prefill(64)
        assert r.computed_tokens <= 64 and not r.errors
    assert all(torch.equal(x, y) for x, y in zip(_kv_of(runner, "first", 100), _kv_of(runner, "second", 100)))


def test_chunked_opens_share_full_context_blocks():
    thinker = make_thinker()
    ctx = make_context(thinker, 70, seed=4)
    runner = make_runner(thinker, share=True)
    runner.enqueue_open("a", ctx)
    runner.enqueue_open("b", ctx)
    results = _prefill_all(runner, 32)
    assert sum(r.computed_tokens for r in results) == 70      # b hits a's blocks: nothing recomputed
    ta, tb = runner.block_table("a"), runner.block_table("b")
    assert ta[: 70 // BS] == tb[: 70 // BS]
    assert ta[-1] != tb[-1]                                    # private copy-on-write tails
    sids = ["a", "b"]
    step = unit_inputs(thinker, sids, 11, 0)
    step["b"] = step["a"]
    res = runner.append(step, unit_start=True)
    assert torch.equal(res["a"], res["b"])


@pytest.mark.parametrize("how", ["close", "fault"])
def test_a_prefill_stopped_midway_leaves_no_uncomputed_block_to_hit(how):
    thinker = make_thinker()
    ctx = make_context(thinker, 100, seed=5)
    runner = make_runner(thinker, share=True)
    free = runner.manager.pool.num_free
    runner.enqueue_open("a", ctx)
    runner.prefill(32)                                          # 2 of 6 full blocks computed
    if how == "close":
        runner.close_session("a")
    else:
        faults = FaultInjector()
        faults.arm("open", "a", "batched")
        runner.faults = faults
        assert "a" in runner.prefill(32).errors
        runner.faults = None
    assert not runner.is_prefilling("a") and runner.manager.pool.num_free == free
    runner.manager.check_invariants()
    runner.enqueue_open("b", ctx)
    results = _prefill_all(runner, 1000)
    # Only the 2 computed blocks are hits; the rest is computed again, not read as garbage.
    assert sum(r.computed_tokens for r in results) == 100 - 2 * BS
    ref = make_runner(thinker, share=True)
    ref.enqueue_open("b", ctx)
    _prefill_all(ref, 32)
    torch.testing.assert_close(_kv_of(runner, "b", 100), _kv_of(ref, "b", 100), rtol=1e-5, atol=1e-5)


def test_prefill_attention_is_chunk_by_context_never_context_by_context(monkeypatch):
    thinker = make_thinker()
    n, chunk = 400, 64
    runner = make_runner(thinker, num_blocks=64, share=False)
    shapes = []
    record_sdpa(monkeypatch, lambda q, k: shapes.append((q.shape[-2], k.shape[-2])))
    runner.enqueue_open("a", make_context(thinker, n, seed=6))
    calls = _prefill_all(runner, chunk)
    assert len(calls) == math.ceil(n / chunk)
    assert max(q for q, _ in shapes) == chunk and max(q * k for q, k in shapes) <= chunk * n


def test_enqueue_open_refuses_caller_mistakes_before_allocating():
    thinker = make_thinker()
    runner = make_runner(thinker)
    ctx = make_context(thinker, 40, seed=7)
    runner.enqueue_open("a", ctx)
    with pytest.raises(ValueError, match="already waiting"):
        runner.enqueue_open("a", ctx)
    with pytest.raises(ValueError, match="chunk_tokens"):
        runner.prefill(0)
