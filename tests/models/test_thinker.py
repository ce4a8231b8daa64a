"""Thinker (Qwen3) vs transformers' Qwen3ForCausalLM with the same random weights (CPU, float32)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from duplexcache.kv.paged_attention import PagedBatch
from duplexcache.models.checkpoint import load_strict
from duplexcache.models.thinker import Thinker, ThinkerConfig, num_parameters

TOL = 1e-5
SPECIAL_IDS = [151683, 151684, 151705, 151706, 151718, 151722]  # <unit>, </unit>, <|listen|>, ...


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.fixture(scope="module")
def models():
    """(ours, ref): transformers model with every weight randomised (norms too), loaded into ours."""
    torch.manual_seed(0)
    config = ThinkerConfig.tiny()
    ref = Qwen3ForCausalLM(Qwen3Config(**config.to_hf_config())).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    ours = Thinker(config).eval()
    load_strict(ours, ref.state_dict(), "thinker")
    return ours, ref


def _tokens(n: int, gen: torch.Generator) -> torch.Tensor:
    ids = torch.randint(0, 151748, (n,), generator=gen)
    ids[:: 4] = torch.tensor(SPECIAL_IDS)[torch.arange(len(ids[::4])) % len(SPECIAL_IDS)]
    return ids


def _ref_logits(ref, tokens: torch.Tensor) -> torch.Tensor:
    return ref(input_ids=tokens[None]).logits[0]


def test_state_dict_names_and_shapes_match_transformers(models):
    ours, ref = models
    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    assert list(ours_sd) == list(ref_sd)
    assert all(ours_sd[k].shape == ref_sd[k].shape for k in ref_sd)


@torch.no_grad()
def test_dense_prefill_matches(models):
    ours, ref = models
    gen = torch.Generator().manual_seed(1)
    ids = torch.stack([_tokens(19, gen), _tokens(19, gen)])
    positions = torch.stack([torch.arange(19), torch.arange(19) + 100])  # a shifted row too
    logits = ours.forward_dense(ours.embed(ids), positions)
    expected = ref(input_ids=ids, position_ids=positions).logits
    assert rel_err(logits, expected) <= TOL


@torch.no_grad()
def test_paged_prefill_then_decode_ragged(models):
    """3 sessions of 5, 17, 33 tokens (block size 16, shuffled blocks), then 3 decode steps."""
    ours, ref = models
    gen = torch.Generator().manual_seed(2)
    lengths, bs, steps = [5, 17, 33], 16, 3
    seqs = [_tokens(n, gen) for n in lengths]
    counts = [-(-(n + steps) // bs) for n in lengths]
    ids = (torch.randperm(sum(counts), generator=gen) + 1).tolist()
    tables = [[ids.pop() for _ in range(c)] for c in counts]
    cache = ours.make_kv_cache(num_blocks=sum(counts) + 1, block_size=bs)

    batch = PagedBatch.build(tables, [0, 0, 0], lengths, None, bs)
    hidden = ours.forward_paged(ours.embed(torch.cat(seqs)), batch, cache)
    assert rel_err(ours.compute_logits(hidden), torch.cat([_ref_logits(ref, s) for s in seqs])) <= TOL
    last = ours.logits_at(hidden, batch)
    assert torch.equal(last, ours.compute_logits(hidden[torch.tensor([4, 21, 54])]))  # last token of each

    for _ in range(steps):
        new = torch.randint(0, 151748, (3,), generator=gen)
        batch = PagedBatch.build(tables, [len(s) for s in seqs], [1, 1, 1], None, bs)
        seqs = [torch.cat([s, new[i : i + 1]]) for i, s in enumerate(seqs)]
        logits = ours.logits_at(ours.forward_paged(ours.embed(new), batch, cache), batch)
        assert rel_err(logits, torch.stack([_ref_logits(ref, s)[-1] for s in seqs])) <= TOL


@torch.no_grad()
def test_chunked_prefill_with_idle_sequence(models):
    """Second chunk of a prefill (computed > 0, several new tokens) next to a sequence with
    no new tokens (full cache hit) and a fresh one."""
    ours, ref = models
    gen = torch.Generator().manual_seed(3)
    bs = 4
    a, b, c = _tokens(11, gen), _tokens(8, gen), _tokens(6, gen)
    tables = [[3, 1, 7], [2, 5], [4, 6]]
    cache = ours.make_kv_cache(num_blocks=8, block_size=bs)
    first = PagedBatch.build(tables[:2], [0, 0], [6, 8], None, bs)
    ours.forward_paged(ours.embed(torch.cat([a[:6], b])), first, cache)
    second = PagedBatch.build(tables, [6, 8, 0], [5, 0, 6], None, bs)
    hidden = ours.forward_paged(ours.embed(torch.cat([a[6:], c])), second, cache)
    logits = ours.compute_logits(hidden)
    assert rel_err(logits[:5], _ref_logits(ref, a)[6:]) <= TOL
    assert rel_err(logits[5:], _ref_logits(ref, c)) <= TOL
    with pytest.raises(ValueError, match="sequence 1 has no new tokens"):
        ours.logits_at(hidden, second)
    assert ours.logits_at(hidden, second, seq_indices=[0, 2]).shape == (2, 151748)


@torch.no_grad()
def test_embedding_spans_dense_and_paged(models):
    """Audio-like embedding spans spliced into the token embeddings, vs transformers' inputs_embeds."""
    ours, ref = models
    gen = torch.Generator().manual_seed(4)
    ids = _tokens(24, gen)
    span_a, span_b = torch.randn(10, 64, generator=gen), torch.randn(3, 64, generator=gen)
    embeds = ours.build_inputs_embeds(ids, [(12, span_b), (1, span_a)])
    manual = ref.model.embed_tokens(ids).clone()
    manual[1:11], manual[12:15] = span_a, span_b
    assert torch.equal(embeds, manual)
    expected = ref(inputs_embeds=manual[None]).logits[0]
    assert rel_err(ours.forward_dense(embeds[None], torch.arange(24)[None])[0], expected) <= TOL
    cache = ours.make_kv_cache(num_blocks=3, block_size=16)
    batch = PagedBatch.build([[2, 1]], [0], [24], None, 16)
    assert rel_err(ours.compute_logits(ours.forward_paged(embeds, batch, cache)), expected) <= TOL


def test_input_errors(models):
    ours, _ = models
    with pytest.raises(ValueError, match="overlaps"):
        ours.build_inputs_embeds(torch.zeros(10, dtype=torch.long), [(0, torch.zeros(4, 64)), (2, torch.zeros(1, 64))])
    with pytest.raises(ValueError, match="outside"):
        ours.build_inputs_embeds(torch.zeros(10, dtype=torch.long), [(8, torch.zeros(4, 64))])
    with pytest.raises(ValueError, match=r"\(len, 64\)"):
        ours.build_inputs_embeds(torch.zeros(10, dtype=torch.long), [(0, torch.zeros(4, 32))])
    with pytest.raises(ValueError, match="token ids must be in"):
        ours.embed(torch.tensor([151748]))
    with pytest.raises(ValueError, match="positions"):
        ours.forward_dense(torch.zeros(1, 4, 64), torch.arange(3)[None])
    cache = ours.make_kv_cache(num_blocks=2, block_size=16)
    batch = PagedBatch.build([[1]], [0], [4], None, 16)
    with pytest.raises(ValueError, match="N=4"):
        ours.forward_paged(torch.zeros(3, 64), batch, cache)
    with pytest.raises(ValueError, match="block_size"):
        ours.forward_paged(torch.zeros(4, 64), PagedBatch.build([[1]], [0], [4], None, 8), cache)


def test_minicpmo45_shapes_on_meta():
    config = ThinkerConfig.minicpmo45()
    assert config.kv_bytes_per_token(torch.bfloat16) == 144 * 1024  # SPEC: 144 KiB/token in bf16
    assert config.kv_bytes_per_token(torch.bfloat16, torch.float8_e4m3fn) == 74.25 * 1024  # fp8 values + scales
    with torch.device("meta"):
        ref = Qwen3ForCausalLM(Qwen3Config(**config.to_hf_config()))
        ours = Thinker(config)
    ref_shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == ref_shapes
    # Qwen3-8B body with MiniCPM-o's 151748-token vocabulary, untied head: about 8.19e9.
    h, ffn, layers, vocab = 4096, 12288, 36, 151748
    per_layer = h * (32 * 128) * 2 + h * (8 * 128) * 2 + 3 * h * ffn + 2 * h + 2 * 128
    assert num_parameters(config) == layers * per_layer + 2 * vocab * h + h


@pytest.mark.parametrize(
    "extra,theta",
    [
        ({"rope_theta": 5e5}, 5e5),
        ({"rope_theta": 5e5, "rope_scaling": None}, 5e5),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 2e6}}, 2e6),
        ({}, 10000.0),
    ],
)
def test_from_hf_config_rope_theta(extra, theta):
    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96,
            "vocab_size": 100, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5}  # fmt: skip
    config = ThinkerConfig.from_hf_config({**base, **extra})
    assert config.rope_theta == theta and config.rms_norm_eps == 1e-5 and config.num_key_value_heads == 2


def test_from_hf_config_defaults_and_errors():
    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96,
            "vocab_size": 100}  # fmt: skip
    config = ThinkerConfig.from_hf_config(base)
    assert (config.head_dim, config.num_key_value_heads, config.tie_word_embeddings) == (16, 4, False)
    with pytest.raises(ValueError, match="yarn"):
        ThinkerConfig.from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="vocab_size"):
        ThinkerConfig.from_hf_config({k: v for k, v in base.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="multiple"):
        ThinkerConfig.from_hf_config({**base, "num_key_value_heads": 3})
    # The real Qwen3-8B config.json shape resolves to the minicpmo45 preset apart from the vocab.
    qwen3_8b = ThinkerConfig.minicpmo45().to_hf_config()
    assert ThinkerConfig.from_hf_config(qwen3_8b) == ThinkerConfig.minicpmo45()
