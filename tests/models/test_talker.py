"""Talker vs transformers' LlamaModel (same weights), paged vs dense, one unit vs a dense loop."""

import pytest
import torch
import torch.nn.functional as F

from duplexcache.kv.paged_attention import PagedBatch, PagedKVCache
from duplexcache.models.talker import (Talker, TalkerConfig, TalkerSampling, TalkerUnitRequest, generate_unit,
                                       unit_cache_tokens)

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaModel  # noqa: E402


def rel_err(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def make_pair(seed: int = 0):
    torch.manual_seed(seed)
    cfg = TalkerConfig.tiny()  # GQA: 4 q heads over 2 kv heads
    talker = Talker(cfg).eval()
    hf = LlamaModel(LlamaConfig(**cfg.to_llama_dict())).eval()
    hf.load_state_dict(talker.model.state_dict(), strict=True)
    return cfg, talker, hf


def ref_logits(talker: Talker, hidden: torch.Tensor) -> torch.Tensor:
    """weight_norm head written out: W = g * v / ||v|| (norm over each output row)."""
    sd = talker.head_code[0].state_dict()
    g, v = sd["parametrizations.weight.original0"], sd["parametrizations.weight.original1"]
    return hidden @ (g * v / v.norm(dim=1, keepdim=True)).T


def test_backbone_matches_llama_model():
    cfg, talker, hf = make_pair()
    x = torch.randn(2, 21, cfg.hidden_size)
    with torch.no_grad():
        ref = hf(inputs_embeds=x).last_hidden_state
        got = talker.forward_dense(x)
        assert rel_err(got, ref) <= 1e-5
        assert rel_err(talker.code_logits(got), ref_logits(talker, ref)) <= 1e-5


def test_paged_decode_matches_dense():
    cfg, talker, hf = make_pair(seed=1)
    bs = 16
    cache = PagedKVCache(cfg.num_hidden_layers, 12, bs, cfg.num_key_value_heads, cfg.head_dim)
    tables = [[7, 2, 9], [3, 11, 5]]  # non-contiguous, interleaved blocks
    lens = [40, 26]
    seqs = [torch.randn(n, cfg.hidden_size) for n in lens]
    # Feed ragged steps: prefill, single-token decodes, then a 3-token step.
    plan = [[18, 5], [1, 1], [1, 1], [1, 0], [3, 3]] + [[1, 1]] * 16
    done = [0, 0]
    got = [[], []]
    with torch.no_grad():
        for step in plan:
            new = [min(n, lens[b] - done[b]) for b, n in enumerate(step)]
            batch = PagedBatch.build(tables, done, new, None, bs, "cpu")
            embeds = torch.cat([seqs[b][done[b]:done[b] + new[b]] for b in range(2)])
            hidden = talker.forward_paged(embeds, batch, cache)
            start = 0
            for b in range(2):
                got[b].append(hidden[start:start + new[b]])
                start += new[b]
                done[b] += new[b]
        assert done == lens
        for b in range(2):
            ref = hf(inputs_embeds=seqs[b][None]).last_hidden_state[0]
            dense = talker.forward_dense(seqs[b][None])[0]
            assert rel_err(torch.cat(got[b]), ref) <= 1e-5
            assert rel_err(dense, ref) <= 1e-5


def dense_unit_reference(talker: Talker, hf, prefix: torch.Tensor, cond: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """Greedy unit by full recompute with transformers' LlamaModel: 25 codes (end masked) + end."""
    cfg = talker.config
    seq = torch.cat([prefix, cond])
    codes = []
    with torch.no_grad():
        for _ in range(cfg.tokens_per_unit):
            logits = ref_logits(talker, hf(inputs_embeds=seq[None]).last_hidden_state[0, -1])
            logits[cfg.end_token_id] = float("-inf")
            code = int(logits.argmax())
            codes.append(code)
            seq = torch.cat([seq, talker.emb_code[0].weight[code][None]])
        seq = torch.cat([seq, talker.emb_code[0].weight[cfg.end_token_id][None]])
    return codes + [cfg.end_token_id], seq


def test_generate_unit_greedy_matches_dense_over_two_units():
    cfg, talker, hf = make_pair(seed=2)
    cache = PagedKVCache(cfg.num_hidden_layers, 20, 16, cfg.num_key_value_heads, cfg.head_dim)
    tables = [[1, 4, 6, 8, 10, 12], [2, 3, 5, 7, 9, 11]]
    prefixes = [torch.zeros(0, cfg.hidden_size), torch.zeros(0, cfg.hidden_size)]
    computed = [0, 0]
    torch.manual_seed(3)
    for unit in range(2):
        reqs = []
        for b, n in enumerate([4, 7]):
            reqs.append(TalkerUnitRequest(tables[b], computed[b], torch.randint(0, cfg.num_text_tokens, (n,)),
                                          torch.randn(n, cfg.llm_dim), boundary_token_ids=(5,)))
        results = generate_unit(talker, cache, reqs)
        for b, (req, res) in enumerate(zip(reqs, results)):
            with torch.no_grad():
                cond = talker.build_condition(req.text_token_ids, req.thinker_hidden, (5,))
                # Condition built by hand: emb_text + L2-normalised projector_semantic, then boundary.
                sem = talker.projector_semantic.linear2(F.relu(talker.projector_semantic.linear1(req.thinker_hidden)))
                hand = torch.cat([talker.emb_text.weight[req.text_token_ids] + sem / sem.norm(dim=-1, keepdim=True),
                                  talker.emb_text.weight[5][None]])
            assert rel_err(cond, hand) <= 1e-6
            want, prefixes[b] = dense_unit_reference(talker, hf, prefixes[b], hand)
            assert res.codes.tolist() == want, (unit, b)
            assert res.codes.shape == (cfg.tokens_per_unit + 1,)
            assert res.num_computed == computed[b] + unit_cache_tokens(cond.shape[0], cfg)
            computed[b] = res.num_computed
    assert computed == [2 * (5 + 26), 2 * (8 + 26)]


def test_seeded_sampling_is_reproducible_and_never_draws_end():
    cfg, talker, _ = make_pair(seed=4)

    def run(seed):
        cache = PagedKVCache(cfg.num_hidden_layers, 8, 16, cfg.num_key_value_heads, cfg.head_dim)
        torch.manual_seed(0)
        req = TalkerUnitRequest([1, 2, 3], 0, torch.tensor([1, 2]), torch.randn(2, cfg.llm_dim))
        gen = torch.Generator().manual_seed(seed)
        return generate_unit(talker, cache, [req], TalkerSampling(temperature=1.0, top_k=20, generator=gen))[0]

    a, b, c = run(11), run(11), run(12)
    assert torch.equal(a.codes, b.codes)
    assert not torch.equal(a.codes, c.codes)
    assert (a.codes[:-1] != cfg.end_token_id).all() and a.codes[-1] == cfg.end_token_id


def test_generate_unit_rejects_short_block_table_and_bad_condition():
    cfg, talker, _ = make_pair()
    cache = PagedKVCache(cfg.num_hidden_layers, 8, 16, cfg.num_key_value_heads, cfg.head_dim)
    # 10 cached + 3 condition rows + 26 codes = 39 tokens > 2 blocks x 16 slots.
    short = TalkerUnitRequest([1, 2], 10, torch.tensor([1, 2, 3]), torch.randn(3, cfg.llm_dim))
    with pytest.raises(ValueError, match="cache slots"):
        generate_unit(talker, cache, [short])
    bad = TalkerUnitRequest([1, 2, 3], 0, torch.tensor([1, 2, 3]), torch.randn(2, cfg.llm_dim))
    with pytest.raises(ValueError, match="build_condition"):
        generate_unit(talker, cache, [bad])


def test_minicpmo45_names_and_shapes_on_meta():
    cfg = TalkerConfig.minicpmo45()
    with torch.device("meta"):
        talker = Talker(cfg)
        hf = LlamaModel(LlamaConfig(**cfg.to_llama_dict()))
    sd = talker.state_dict()
    assert {k[6:]: v.shape for k, v in sd.items() if k.startswith("model.")} == \
        {k: v.shape for k, v in hf.state_dict().items()}
    assert sd["head_code.0.parametrizations.weight.original0"].shape == (6562, 1)
    assert sd["head_code.0.parametrizations.weight.original1"].shape == (6562, 768)
    assert sd["emb_code.0.weight"].shape == (6562, 768)
    assert sd["projector_semantic.linear1.weight"].shape == (768, 4096)
    assert sd["projector_spk.linear2.weight"].shape == (768, 768)
    assert sd["emb_text.weight"].shape == (152064, 768)
    # 60 KiB per token in bf16 (SPEC): 20 layers x (K + V) x 768 x 2 bytes.
    assert 20 * 2 * cfg.num_key_value_heads * cfg.head_dim * 2 == 60 * 1024


@pytest.mark.parametrize("boundary", [(), (5, 9)])
def test_conditions_of_a_batch_equal_each_units_own(boundary):
    """``build_conditions`` (one projection, one embedding, one add for every unit of the tick)
    gives each unit's ``build_condition`` rows in request order, hidden given as a (T, llm_dim)
    tensor or as T rows; its compute ops do not grow with the units (they were ~10 per unit)."""
    from torch.profiler import ProfilerActivity, profile

    from op_count import compute_ops   # tests/models/op_count.py

    cfg, talker, _ = make_pair(seed=6)
    gen = torch.Generator().manual_seed(7)

    def requests(n):
        out = []
        for b in range(n):
            t = 2 + b % 3
            ids = torch.randint(0, cfg.num_text_tokens, (t,), generator=gen)
            hidden = torch.randn(t, cfg.llm_dim, generator=gen)
            out.append(TalkerUnitRequest([1], 0, ids, hidden if b % 2 else list(hidden.unbind(0)), boundary))
        return out

    reqs = requests(5)
    with torch.no_grad():
        rows, sizes = talker.build_conditions(reqs)
        alone = [talker.build_condition(r.text_token_ids, torch.stack(list(r.thinker_hidden)), r.boundary_token_ids)
                 for r in reqs]
    assert sizes == [a.shape[0] for a in alone]
    assert rel_err(rows, torch.cat(alone)) <= 1e-6   # the projector's GEMM sees 5 units' rows at once

    def ops(n):
        batch = requests(n)
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
            talker.build_conditions(batch)
        return compute_ops(prof)
    assert ops(12) == ops(3)
