"""Stage0Runner window: anchor protection, basic (in-place re-rotation) vs rebuild, long calls.

Shapes: tiny Thinker (hidden 64, 4 q heads, 2 kv heads, head_dim 16), block 16, a 40-token
context (anchor = 3 blocks = 48 slots), window high 96 / low 64 tokens over the prefix.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch

from duplexcache.kv.block_pool import BlockPool
from duplexcache.kv.kv_cache_manager import KVCacheManager
from duplexcache.kv.window import WindowConfig
from duplexcache.models.thinker import Thinker, ThinkerConfig
from duplexcache.runtime.stage0.runner import (
    BlockBudgetTooSmall,
    SessionContextInput,
    Stage0Runner,
)

logger = logging.getLogger(__name__)
BS = 16
HIGH, LOW = 96, 64
CTX = 40
U32 = 2.0**-24  # unit roundoff of float32
UBF16 = 2.0**-8  # unit roundoff of bfloat16


def make_thinker(layers: int, dtype=torch.float32, seed: int = 0) -> Thinker:
    torch.manual_seed(seed)
    cfg = dataclasses.replace(ThinkerConfig.tiny(), vocab_size=512, num_hidden_layers=layers)
    return Thinker(cfg).to(dtype).eval()


def make_runner(thinker: Thinker, mode: str, share: bool = True, num_blocks: int = 48,
                high: int = HIGH, low: int = LOW) -> Stage0Runner:
    cache = thinker.make_kv_cache(num_blocks, BS, thinker.lm_head.weight.dtype)
    mgr = KVCacheManager(BlockPool(num_blocks), BS, cache.bytes_per_block)
    return Stage0Runner(thinker, mgr, cache, WindowConfig(mode, high_tokens=high, low_tokens=low), share, BS)


def context(thinker: Thinker, seed: int = 1, n: int = CTX) -> SessionContextInput:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 500, (n,), generator=g)
    with torch.no_grad():
        embeds = thinker.embed(ids).clone()
    return SessionContextInput(embeds, ids, b"voice|rev")


def unit(thinker: Thinker, sid_index: int, step: int, n: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * step + sid_index)
    return torch.randn(n, thinker.config.hidden_size, generator=g).to(thinker.lm_head.weight.dtype)


def anchor_kv(r: Stage0Runner, sid: str) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    ids = r.block_table(sid)[: r.num_anchor_blocks(sid)]
    return ids, r.cache.k[:, ids].clone(), r.cache.v[:, ids].clone()


def run_call(r: Stage0Runner, thinker: Thinker, sids: list[str], units: int,
             first_step: int = 0) -> list[dict[str, torch.Tensor]]:
    outs = []
    for step in range(first_step, units):
        res = r.append({s: unit(thinker, i, step) for i, s in enumerate(sids)}, unit_start=True)
        assert not res.errors, res.errors
        outs.append(dict(res.logits))
    return outs


# ---------------------------------------------------------------- re-rotation is applied once, V untouched


def _rotate64(k: torch.Tensor, delta: int, theta: float) -> torch.Tensor:
    """Independent float64 NeoX rotation of k (..., D) by -delta positions."""
    d = k.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.cat([inv, inv]) * -delta
    k = k.double()
    rot = torch.cat([-k[..., d // 2:], k[..., : d // 2]], dim=-1)
    return k * ang.cos() + rot * ang.sin()


def test_basic_compaction_rotates_kept_keys_once_and_keeps_anchor_and_values():
    thinker = make_thinker(2)
    r = make_runner(thinker, "basic")
    r.open_sessions({"a": context(thinker)})
    a_ids, a_k, a_v = anchor_kv(r, "a")
    step = 0
    while True:  # run up to the append that compacts
        n_before = r.num_tokens("a")
        table = r.block_table("a")
        k_before, v_before = r.cache.k[:, table].clone(), r.cache.v[:, table].clone()
        assert not r.append({"a": unit(thinker, 0, step)}, unit_start=True).errors
        step += 1
        if r.sessions["a"].num_compactions:
            break
    delta = n_before + 12 - r.num_tokens("a")
    assert delta > 0 and delta % BS == 0
    sink, drop = 3, delta // BS
    assert r.block_table("a")[:sink] == table[:sink] == a_ids
    assert r.block_table("a")[sink:len(table) - drop] == table[sink + drop:]  # kept blocks not moved
    kept_after = r.cache.k[:, r.block_table("a")]
    old_slots = n_before - (sink + drop) * BS  # kept slots that held keys before the append
    got = kept_after[:, sink:].flatten(1, 2)[:, :old_slots]
    before = k_before[:, sink + drop:].flatten(1, 2)[:, :old_slots]
    once = _rotate64(before, delta, thinker.config.rope_theta)
    # float32 rotation of |k| <= sqrt(D)*|w_knorm| keys: a few ulps (angles exact to ~delta*u).
    tol = 8 * U32 * (delta + 8) * float(before.abs().max())
    assert float((got.double() - once).abs().max()) <= tol
    twice = _rotate64(once, delta, thinker.config.rope_theta)
    assert float((got.double() - twice).abs().max()) > 1e3 * tol  # not rotated twice
    v_got = r.cache.v[:, r.block_table("a")][:, sink:].flatten(1, 2)[:, :old_slots]
    assert torch.equal(v_got, v_before[:, sink + drop:].flatten(1, 2)[:, :old_slots])  # V untouched
    # Anchor blocks: bit-identical to just before the compacting append (their 8 slots after
    # the 40-token context were filled by the first append), context slots identical to open.
    assert torch.equal(r.cache.k[:, a_ids], k_before[:, :sink]) and torch.equal(r.cache.v[:, a_ids], v_before[:, :sink])
    assert torch.equal(r.cache.k[:, a_ids].flatten(1, 2)[:, :CTX], a_k.flatten(1, 2)[:, :CTX])
    assert torch.equal(r.cache.v[:, a_ids].flatten(1, 2)[:, :CTX], a_v.flatten(1, 2)[:, :CTX])


# ---------------------------------------------------------------- basic vs rebuild


def _post_attention_jacobian_inf_norm(thinker: Thinker, embeds: torch.Tensor) -> float:
    """max_i sum_j |d logit_i / d o_j| at the last token of a 1-layer model, in float64,
    where o is the attention output (input of o_proj)."""
    th = make_thinker(1).double()
    th.load_state_dict({k: v.double() for k, v in thinker.state_dict().items()})
    layer = th.model.layers[0]
    x = embeds.double()
    captured = {}
    hook = layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a: captured.setdefault("o", a[0]))
    with torch.no_grad():
        th.forward_dense(x[None], torch.arange(x.shape[0])[None])
    hook.remove()
    o_last, x_last = captured["o"][0, -1], x[-1]

    def logits_of(o: torch.Tensor) -> torch.Tensor:
        h = x_last + layer.self_attn.o_proj(o)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return th.compute_logits(th.model.norm(h))

    jac = torch.autograd.functional.jacobian(logits_of, o_last)  # (V, Hq*D)
    return float(jac.abs().sum(dim=1).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_layer_basic_matches_rebuild_within_derived_bound(dtype):
    """1 layer: layer-0 K/V depend only on the token and its position, not on the context,
    so basic and rebuild hold the same keys up to the rounding of the re-rotation.

    Key bound (per kept key, per head, 2-norm; keys have |k|_2 = sqrt(D)*|w_knorm| after
    k_norm, D = 16, RoPE preserves it):
    * float32: rebuild rotates k0 once by (p-delta)*f; basic rotated k0 by p*f (at write) and
      then by -delta*f in float32. Each angle p*f is exact to ~2u*p (f <= 1), so the angles
      differ by <= 2u(p + delta + p - delta) = 4u*p; each rotation adds <= 4u|k| of
      arithmetic rounding (cos, sin, two products and a sum). |dk| <= (4 p_max + 12) u |k|.
    * bfloat16: RoPE runs in bf16 (cos/sin cast, products, sum: <= 5u_bf16 each path) and
      basic rounds once more when storing the re-rotated key: |dk| <= 11 u_bf16 |k| plus the
      float32 angle term above (negligible).
    Logit bound (first order): scores s_j = q.k_j / sqrt(D) with |q|_2 = sqrt(D)|w_qnorm|,
    so |ds| <= |w_qnorm|_max |dk|_2; the attention output moves by <= 2 |ds|_max |v|_max per
    element (softmax: |dp|_1 <= 2 |ds|_inf); the logits by <= J |do|_inf with J the
    inf-norm of d logits / d o at the last token (autograd, float64, same weights). The
    post-attention path then rounds differently for different inputs: + 4 u |logit|_max
    (a couple of ulps at the output and at the lm_head input).
    """
    u = U32 if dtype == torch.float32 else UBF16
    thinker = make_thinker(1, dtype)
    basic, rebuild = make_runner(thinker, "basic"), make_runner(thinker, "rebuild")
    ctx = context(thinker)
    for r in (basic, rebuild):
        r.open_sessions({"a": ctx})
    out_b, out_r = run_call(basic, thinker, ["a"], 1), run_call(rebuild, thinker, ["a"], 1)
    a_ids, a_k, a_v = anchor_kv(basic, "a")  # anchor slots all written now (40 context + 8)
    out_b += run_call(basic, thinker, ["a"], 20, first_step=1)
    out_r += run_call(rebuild, thinker, ["a"], 20, first_step=1)
    assert basic.sessions["a"].num_compactions >= 3 and rebuild.sessions["a"].num_compactions >= 3
    assert basic.num_tokens("a") == rebuild.num_tokens("a")
    assert torch.equal(basic.cache.k[:, a_ids], a_k) and torch.equal(basic.cache.v[:, a_ids], a_v)

    n, p_max = basic.num_tokens("a"), CTX + HIGH
    kb = basic.cache.k[:, basic.block_table("a")].flatten(1, 2)[:, :n].float()  # (L, n, Hkv, D)
    kr = rebuild.cache.k[:, rebuild.block_table("a")].flatten(1, 2)[:, :n].float()
    k_norm = float(kb.norm(dim=-1).max())
    key_bound = ((4 * p_max + 12) * U32 + (11 * u if dtype == torch.bfloat16 else 0.0)) * k_norm
    dk = float((kb - kr).norm(dim=-1).max())
    assert dk <= key_bound, (dk, key_bound)

    wq = float(thinker.model.layers[0].self_attn.q_norm.weight.detach().abs().max())
    v_max = float(basic.cache.v[:, basic.block_table("a")].abs().max())
    embeds = torch.cat([ctx.inputs_embeds.float(), torch.cat([unit(thinker, 0, s).float() for s in range(20)])])
    # The sequence the last step saw: anchor, then the kept tokens.
    jac = _post_attention_jacobian_inf_norm(thinker, embeds[: n])
    logit_max = max(float(o["a"].float().abs().max()) for o in out_b)
    tol = jac * 2 * wq * dk * v_max + 4 * u * logit_max
    diff = max(float((b["a"].float() - r_["a"].float()).abs().max()) for b, r_ in zip(out_b, out_r))
    logger.info("1 layer %s: basic vs rebuild max |dlogit| %.3g, derived tol %.3g (|dk| %.3g <= %.3g)",
                dtype, diff, tol, dk, key_bound)
    assert diff <= tol, (diff, tol)
    assert tol < (0.01 if dtype == torch.float32 else 0.2) * logit_max  # the bound is not vacuous


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_layer_rebuild_diverges_measurably(dtype):
    """2 layers: layer-1 K/V of a kept token depend on the tokens it attended to; rebuild
    recomputes them without the dropped tokens, basic keeps the originals. So the modes
    differ by a real modelling difference, not rounding. Measured on these seeds (max
    |dlogit| over 14 units, 2 compactions, |logit| ~ 2.3): float32 7.2e-3 (vs 4.8e-7 for one
    layer: 4 orders above rounding), bfloat16 1.2e-2 (about 1.5 ulp at |logit| ~ 2, i.e.
    the same size as bf16 rounding, so in bf16 it is not separable from rounding here).
    Before the first compaction both modes run the identical computation (equal logits)."""
    u = U32 if dtype == torch.float32 else UBF16
    thinker = make_thinker(2, dtype)
    basic, rebuild = make_runner(thinker, "basic"), make_runner(thinker, "rebuild")
    for r in (basic, rebuild):
        r.open_sessions({"a": context(thinker)})
    out_b, out_r = run_call(basic, thinker, ["a"], 14), run_call(rebuild, thinker, ["a"], 14)
    first_compaction = next(i for i in range(14) if (CTX + 12 * (i + 1)) > CTX + HIGH)
    before = max(float((b["a"].float() - r_["a"].float()).abs().max())
                 for b, r_ in zip(out_b[:first_compaction], out_r[:first_compaction]))
    after = max(float((b["a"].float() - r_["a"].float()).abs().max())
                for b, r_ in zip(out_b[first_compaction:], out_r[first_compaction:]))
    logit_max = max(float(o["a"].float().abs().max()) for o in out_b)
    logger.info("2 layers %s: basic vs rebuild max |dlogit| %.3g before the first cut, %.3g after",
                dtype, before, after)
    assert before == 0.0  # identical computation until the first compaction
    assert after > 0
    if dtype == torch.float32:
        assert after > 1e3 * u * logit_max  # a real divergence, far above rounding
    assert after < 0.05 * logit_max


# ---------------------------------------------------------------- a 10-minute call


def test_ten_minute_call_stays_bounded_never_touches_anchor_and_leaks_nothing():
    """600 units of 12 tokens (10 min at 1 unit/s) with 2 sessions sharing one context."""
    thinker = make_thinker(1)
    r = make_runner(thinker, "basic", num_blocks=32)
    r.open_sessions({"a": context(thinker), "b": context(thinker)})
    run_call(r, thinker, ["a", "b"], 1)  # fills the anchor's last 8 slots
    a_ids, a_k, a_v = anchor_kv(r, "a")
    b_ids, b_k, b_v = anchor_kv(r, "b")
    assert a_ids[:2] == b_ids[:2] and a_ids[2] != b_ids[2]  # 2 shared full blocks, private tails
    max_blocks = math.ceil((CTX + HIGH) / BS)
    peak = 0
    for step in range(1, 600):
        res = r.append({"a": unit(thinker, 0, step), "b": unit(thinker, 1, step)}, unit_start=True)
        assert not res.errors
        for sid, ids in (("a", a_ids), ("b", b_ids)):
            table = r.block_table(sid)
            assert table[:3] == ids and len(table) <= max_blocks
            assert CTX <= r.num_tokens(sid) <= CTX + HIGH
        peak = max(peak, r.pool_stats().used)
        if step % 100 == 99:
            r.manager.check_invariants()
            assert torch.equal(r.cache.k[:, a_ids], a_k) and torch.equal(r.cache.v[:, a_ids], a_v)
            assert torch.equal(r.cache.k[:, b_ids], b_k) and torch.equal(r.cache.v[:, b_ids], b_v)
    assert r.sessions["a"].num_compactions >= 140  # one cut every ~4 units
    assert peak <= 2 * max_blocks - 2 + 1  # 2 shared full blocks counted once, + template
    for sid in ("a", "b"):
        r.close_session(sid)
    r.manager.check_invariants()
    st = r.pool_stats()
    assert st.used == 0 and st.free == st.num_blocks == 31
    assert st.cached_free == 3  # only the shared context blocks + template stay cached


# ---------------------------------------------------------------- rebuild releases the whole kept window


def test_rebuild_truncates_to_the_anchor_and_reprefills_into_released_blocks():
    """Rebuild = release the kept window (partial last block included) and re-prefill it.

    Context 40 (anchor = table idx 0..2), units of 12: after 8 units the session holds
    136 = 40 + 96 tokens in 9 blocks (idx 8 partial: tokens 128..135). The 9th unit would
    reach 148 > 136: the cut moves to the unit start 112 (block 7), so 4 blocks (64 tokens)
    are dropped and 72 tokens are kept. Rebuild truncates to 48 tokens, releasing idx 3..8
    (6 blocks, tail first to the free-list front), then takes 3 of them back for the
    24 kept + 12 new tokens.
    """
    thinker = make_thinker(1)
    r = make_runner(thinker, "rebuild", share=False)
    r.open_sessions({"a": context(thinker)})
    run_call(r, thinker, ["a"], 8)
    assert r.num_tokens("a") == CTX + HIGH and r.sessions["a"].num_compactions == 0
    old = r.block_table("a")
    assert len(old) == 9
    free_before = r.manager.pool.free_block_queue.block_ids()
    calls = []
    truncate = r.manager.truncate

    def recording_truncate(sid, n):
        out = truncate(sid, n)
        calls.append((sid, n, out))
        return out

    r.manager.truncate = recording_truncate
    run_call(r, thinker, ["a"], 9, first_step=8)
    assert calls == [("a", 48, old[3:])]  # all 6 blocks after the anchor, partial idx 8 too
    assert r.num_tokens("a") == 72 + 12 and r.sessions["a"].num_compactions == 1
    assert r.block_table("a") == old[:3] + [old[8], old[7], old[6]]
    assert r.manager.pool.free_block_queue.block_ids() == [old[5], old[4], old[3]] + free_before
    r.manager.check_invariants()


def test_worst_case_blocks_is_reached_exactly_and_never_passed():
    """``worst_case_blocks`` is the true peak of one session: reached with the window full,
    never passed across compactions, in both window modes and with sharing on and off."""
    thinker = make_thinker(1)
    for mode in ("basic", "rebuild"):
        for share in (True, False):
            r = make_runner(thinker, mode, share=share)
            r.open_sessions({"a": context(thinker)})
            want = r.worst_case_blocks(CTX)
            assert want == (10 if share else 9)  # ceil(136/16) = 9 table blocks (+ template)
            peak = 0
            for step in range(16):  # 2 compactions
                assert not r.append({"a": unit(thinker, 0, step)}, unit_start=True).errors
                peak = max(peak, r.pool_stats().used)  # one session: used == blocks it holds
            assert r.sessions["a"].num_compactions >= 2
            assert peak == want, (mode, share, peak, want)


# ---------------------------------------------------------------- per-session windows

SMALL = WindowConfig("basic", high_tokens=48, low_tokens=24)


def _trajectory(r: Stage0Runner, thinker: Thinker, sids: list[str], units: int) -> dict[str, list[int]]:
    """Session lengths after each unit (each session gets the unit of its own index)."""
    out: dict[str, list[int]] = {s: [] for s in sids}
    for step in range(units):
        res = r.append({s: unit(thinker, i, step) for i, s in enumerate(sids)}, unit_start=True)
        assert not res.errors, res.errors
        for s in sids:
            out[s].append(r.num_tokens(s))
    return out


@pytest.mark.parametrize("mode", ["basic", "rebuild"])
def test_two_sessions_compact_at_their_own_marks_in_one_batch(mode):
    """Session "a" keeps the runner's 96/64 window, "b" opens with 48/24; both run in the same
    ragged appends. Each follows exactly the lengths of a runner of its own window alone."""
    thinker = make_thinker(1)
    small = WindowConfig(mode, high_tokens=SMALL.high_tokens, low_tokens=SMALL.low_tokens)
    mixed = make_runner(thinker, mode)
    mixed.open_sessions({"a": context(thinker), "b": context(thinker)}, {"b": small})
    assert mixed.session_window("a") == mixed.window and mixed.session_window("b") == small
    got = _trajectory(mixed, thinker, ["a", "b"], 12)
    solo_a, solo_b = make_runner(thinker, mode), make_runner(thinker, mode, high=48, low=24)
    solo_a.open_sessions({"a": context(thinker)})
    solo_b.open_sessions({"x": context(thinker)})
    want_a = _trajectory(solo_a, thinker, ["a"], 12)["a"]
    # "b" is the second session of the mixed batch: its units are unit(thinker, 1, step).
    want_b = [0] * 12
    for step in range(12):
        assert not solo_b.append({"x": unit(thinker, 1, step)}, unit_start=True).errors
        want_b[step] = solo_b.num_tokens("x")
    assert got["a"] == want_a and got["b"] == want_b
    assert want_a != want_b  # the marks matter: not one window for both
    assert max(got["b"]) <= CTX + 48 < max(got["a"]) <= CTX + HIGH
    assert mixed.sessions["b"].num_compactions > mixed.sessions["a"].num_compactions >= 1
    mixed.manager.check_invariants()


def test_lower_window_has_a_smaller_worst_case_and_reaches_it_exactly():
    thinker = make_thinker(1)
    r = make_runner(thinker, "basic")
    big, small = r.worst_case(CTX), r.worst_case(CTX, SMALL)
    assert (big.table_blocks, small.table_blocks) == (9, 6)  # ceil(136/16), ceil(88/16)
    assert big.shared_blocks == small.shared_blocks == 3 and small.private_blocks < big.private_blocks
    r.open_session("b", context(thinker), window=SMALL)
    peak = 0
    for step in range(12):
        assert not r.append({"b": unit(thinker, 0, step)}, unit_start=True).errors
        peak = max(peak, r.pool_stats().used)
    assert peak == r.worst_case_blocks(CTX, SMALL) == 7


def test_window_fits_alone_uses_the_sessions_marks():
    """A pool too small for the default window still takes a session that brings a smaller one."""
    thinker = make_thinker(1)
    r = make_runner(thinker, "basic", num_blocks=8)  # 7 usable: default needs 10, SMALL needs 7
    with pytest.raises(BlockBudgetTooSmall, match="needs up to 10 blocks"):
        r.can_open(context(thinker))
    assert r.can_open(context(thinker), SMALL)
    r.open_session("b", context(thinker), window=SMALL)
    assert not r.append({"b": unit(thinker, 0, 0)}, unit_start=True).errors


def test_per_session_window_caller_mistakes():
    thinker = make_thinker(1)
    r = make_runner(thinker, "basic")
    with pytest.raises(ValueError, match="window mode 'rebuild' differs"):
        r.open_session("a", context(thinker), window=WindowConfig("rebuild", 48, 24))
    with pytest.raises(ValueError, match="not being opened"):
        r.open_sessions({"a": context(thinker)}, {"zz": SMALL})
    with pytest.raises(ValueError, match="must be a WindowConfig"):
        r.open_session("a", context(thinker), window=(48, 24))
    assert not r.sessions and r.pool_stats().used == 0  # nothing was allocated
    with pytest.raises(ValueError, match="unknown session"):
        r.session_window("a")


# ---------------------------------------------------------------- fp8 KV (precision.kv_cache_dtype)


def _fp8_runner(thinker: Thinker, mode: str = "basic") -> Stage0Runner:
    cache = thinker.make_kv_cache(48, BS, torch.float32, storage_dtype=torch.float8_e4m3fn)
    mgr = KVCacheManager(BlockPool(48), BS, cache.bytes_per_block)
    return Stage0Runner(thinker, mgr, cache, WindowConfig(mode, high_tokens=HIGH, low_tokens=LOW), True, BS)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).clone()


def test_fp8_basic_compaction_requantizes_kept_keys_and_keeps_anchor_and_values():
    """An fp8 pool through a ``basic`` compaction: each kept key is dequantized, rotated once by
    -delta and re-quantized with a fresh scale (within amax_after / 28 of the float64 rotation
    of the dequantized key); V bytes and scales, and the anchor's K, stay bit-identical."""
    thinker = make_thinker(2)
    r = _fp8_runner(thinker)
    c = r.cache
    r.open_sessions({"a": context(thinker)})
    step = 0
    while True:
        n_before, table = r.num_tokens("a"), r.block_table("a")
        k8, ks = _bytes(c.k[:, table]), c.k_scale[:, table].clone()
        v8, vs = _bytes(c.v[:, table]), c.v_scale[:, table].clone()
        deq_before = torch.stack([c.gather_blocks(layer, torch.tensor(table))[0] for layer in range(2)])
        assert not r.append({"a": unit(thinker, 0, step)}, unit_start=True).errors
        step += 1
        if r.sessions["a"].num_compactions:
            break
    delta = n_before + 12 - r.num_tokens("a")
    sink, drop = 3, delta // BS
    after = r.block_table("a")
    old_slots = n_before - (sink + drop) * BS
    got = torch.stack([c.gather_blocks(layer, torch.tensor(after))[0] for layer in range(2)])[:, sink * BS:][:, :old_slots]
    once = _rotate64(deq_before[:, (sink + drop) * BS:][:, :old_slots], delta, thinker.config.rope_theta)
    assert ((got.double() - once).abs() <= once.abs().amax(-1, keepdim=True) / 28 + 1e-6).all()
    kept_scales = c.k_scale[:, after][:, sink:].flatten(1, 2)[:, :old_slots]
    assert not torch.equal(kept_scales, ks[:, sink + drop:].flatten(1, 2)[:, :old_slots])   # fresh scales
    assert torch.equal(_bytes(c.v[:, after])[:, sink:].flatten(1, 2)[:, :old_slots],
                       v8[:, sink + drop:].flatten(1, 2)[:, :old_slots])
    assert torch.equal(c.v_scale[:, after][:, sink:].flatten(1, 2)[:, :old_slots],
                       vs[:, sink + drop:].flatten(1, 2)[:, :old_slots])
    assert torch.equal(_bytes(c.k[:, after[:sink]]), k8[:, :sink]) and torch.equal(c.k_scale[:, after[:sink]], ks[:, :sink])


def test_fp8_call_through_compactions_stays_close_to_float():
    """A 2-layer call with several ``basic`` compactions on an fp8 pool against the float pool:
    logits within 3 % of the float logits' norm at every step (measured: at most 0.31 %; the
    tiny model's logits are dominated by the residual stream, not by attention)."""
    thinker = make_thinker(2)
    exact, fp8 = make_runner(thinker, "basic"), _fp8_runner(thinker)
    for r in (exact, fp8):
        r.open_sessions({"a": context(thinker)})
    out_e, out_8 = run_call(exact, thinker, ["a"], 20), run_call(fp8, thinker, ["a"], 20)
    assert fp8.sessions["a"].num_compactions >= 3
    rel = [float((b["a"] - a["a"]).norm() / a["a"].norm()) for a, b in zip(out_e, out_8)]
    logger.info("fp8 vs float logits over %d steps: rel. error max %.3g", len(rel), max(rel))
    assert max(rel) <= 0.03, rel
