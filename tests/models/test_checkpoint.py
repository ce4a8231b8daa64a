"""Checkpoint reading, strict loading and Thinker.from_pretrained (plain Qwen3 and MiniCPM-o)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

from duplexcache.models.checkpoint import CheckpointError, load_state_dict, load_strict, read_hf_config
from duplexcache.models.thinker import Thinker, ThinkerConfig

SMALL = ThinkerConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # fmt: skip


def _hf_model(config: ThinkerConfig, seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**config.to_hf_config())).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    return model


def _assert_same_weights(ours: nn.Module, state: dict[str, torch.Tensor]) -> None:
    got = ours.state_dict()
    assert set(got) == set(state)
    for k, v in state.items():
        assert torch.equal(got[k], v), k


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 2, bias=False)


def _pair_state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: torch.randn_like(v) for k, v in Pair().state_dict().items()}


# --- file formats -------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["safetensors", "pt", "bin", "wrapped_pt"])
def test_load_formats(tmp_path, fmt):
    state = _pair_state()
    if fmt == "safetensors":
        save_file(state, tmp_path / "model.safetensors")
    elif fmt == "wrapped_pt":
        torch.save({"state_dict": state}, tmp_path / "flow.pt")
    else:
        torch.save(state, tmp_path / f"weights.{fmt}")
    loaded = load_state_dict(tmp_path)
    assert set(loaded) == set(state) and all(torch.equal(loaded[k], state[k]) for k in state)
    single = next(p for p in tmp_path.iterdir())
    assert set(load_state_dict(single)) == set(state)  # a file path works too


def test_sharded_safetensors_with_index(tmp_path):
    state = _pair_state()
    save_file({k: v for k, v in state.items() if k.startswith("a.")}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({k: v for k, v in state.items() if k.startswith("b.")}, tmp_path / "model-00002-of-00002.safetensors")
    save_file({"stray": torch.zeros(1)}, tmp_path / "not-in-index.safetensors")  # ignored: index wins
    weight_map = {k: f"model-0000{1 if k.startswith('a.') else 2}-of-00002.safetensors" for k in state}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    loaded = load_state_dict(tmp_path)
    assert set(loaded) == set(state) and all(torch.equal(loaded[k], state[k]) for k in state)


def test_prefix_selects_and_strips(tmp_path):
    state = _pair_state()
    full = {**{f"llm.{k}": v for k, v in state.items()}, "apm.w": torch.ones(2), "tts.w": torch.ones(3)}
    save_file(full, tmp_path / "model.safetensors")
    loaded = load_state_dict(tmp_path, prefix="llm.")
    assert set(loaded) == set(state) and all(torch.equal(loaded[k], state[k]) for k in state)
    with pytest.raises(CheckpointError, match=r"no keys under prefix 'vpm\.'.*'apm\.'"):
        load_state_dict(tmp_path, prefix="vpm.")


def test_duplicate_key_across_files(tmp_path):
    save_file({"x": torch.zeros(1)}, tmp_path / "a.safetensors")
    save_file({"x": torch.ones(1)}, tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match="'x' appears in more than one file"):
        load_state_dict(tmp_path)


def test_unreadable_inputs(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x00not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_state_dict(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_state_dict(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_state_dict(empty)
    with pytest.raises(CheckpointError, match="no config.json"):
        read_hf_config(empty)
    (empty / "config.json").write_text("{broken")
    with pytest.raises(CheckpointError, match="cannot read"):
        read_hf_config(empty)


# --- strict loading -----------------------------------------------------------------------


def test_load_strict_reports_missing_unexpected_and_shapes():
    module = Pair()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    state = _pair_state()
    del state["a.bias"]
    state["c.weight"] = torch.zeros(1)
    state["b.weight"] = torch.zeros(5, 5)
    with pytest.raises(CheckpointError) as info:
        load_strict(module, state, "talker")
    err = info.value
    assert err.component == "talker"
    assert err.missing == ["a.bias"] and err.unexpected == ["c.weight"]
    assert err.shape_mismatch == [("b.weight", (5, 5), (2, 4))]
    msg = str(err)
    assert msg.startswith("talker:") and "a.bias" in msg and "c.weight" in msg and "(5, 5)" in msg
    # Nothing was loaded: a failed load leaves the module unchanged.
    assert all(torch.equal(module.state_dict()[k], v) for k, v in before.items())

    good = _pair_state(1)
    load_strict(module, good, "talker")
    _assert_same_weights(module, good)


def test_error_message_lists_first_keys_only():
    err = CheckpointError("thinker", missing=[f"k{i:02d}" for i in range(20)])
    assert "20 missing keys" in str(err) and "k07" in str(err) and "k08" not in str(err) and "12 more" in str(err)


# --- Thinker.from_pretrained ----------------------------------------------------------------


def test_from_pretrained_plain_qwen3_dir(tmp_path):
    ref = _hf_model(SMALL)
    ref.save_pretrained(tmp_path, max_shard_size="40KB")  # sharded, with an index
    assert (tmp_path / "model.safetensors.index.json").exists()
    ours = Thinker.from_pretrained(tmp_path)
    assert ours.config == SMALL
    _assert_same_weights(ours, ref.state_dict())
    half = Thinker.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert half.lm_head.weight.dtype == torch.bfloat16


def _write_minicpmo_dir(path, config: ThinkerConfig, llm_state: dict, nested: bool) -> None:
    """A MiniCPM-o-like checkpoint: all stages in one state dict, LLM under ``llm.``."""
    llm_fields = {k: v for k, v in config.to_hf_config().items() if k != "model_type"}
    cfg = {"model_type": "minicpmo", "architectures": ["MiniCPMO"], "audio_config": {"d_model": 8},
           "tts_config": {"hidden_size": 8}}  # fmt: skip
    cfg.update({"llm_config": {**llm_fields, "model_type": "qwen3"}} if nested else llm_fields)
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = {f"llm.{k}": v.contiguous() for k, v in llm_state.items()}
    tensors.update({"apm.layers.0.weight": torch.ones(4, 4), "tts.emb.weight": torch.ones(6, 2)})
    save_file(tensors, path / "model.safetensors")


@pytest.mark.parametrize("nested", [False, True])
def test_from_pretrained_minicpmo_prefix(tmp_path, nested):
    ref = _hf_model(SMALL, seed=3)
    _write_minicpmo_dir(tmp_path, SMALL, ref.state_dict(), nested)
    ours = Thinker.from_pretrained(tmp_path)
    assert ours.config == SMALL
    _assert_same_weights(ours, ref.state_dict())
    ids = torch.randint(0, SMALL.vocab_size, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_dense(ours.embed(ids), torch.arange(9)[None]),
                                   ref(input_ids=ids).logits, rtol=0, atol=1e-5)  # fmt: skip


def test_from_pretrained_missing_and_extra_llm_keys(tmp_path):
    state = _hf_model(SMALL).state_dict()
    del state["model.layers.1.self_attn.k_norm.weight"]
    state["model.layers.2.mlp.up_proj.weight"] = torch.zeros(48, 32)
    _write_minicpmo_dir(tmp_path, SMALL, state, nested=False)
    with pytest.raises(CheckpointError, match=r"thinker: 1 missing keys: model\.layers\.1\.self_attn\.k_norm\.weight; "
                       r"1 unexpected keys: model\.layers\.2\.mlp\.up_proj\.weight"):  # fmt: skip
        Thinker.from_pretrained(tmp_path)


def test_from_pretrained_tied_embeddings(tmp_path):
    config = ThinkerConfig(**{**SMALL.__dict__, "tie_word_embeddings": True})
    ref = _hf_model(config)
    ref.save_pretrained(tmp_path)
    ours = Thinker.from_pretrained(tmp_path)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert torch.equal(ours.lm_head.weight, ref.lm_head.weight)


def test_from_pretrained_not_a_thinker(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMALL.to_hf_config()))
    save_file({"encoder.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="found neither"):
        Thinker.from_pretrained(tmp_path)
