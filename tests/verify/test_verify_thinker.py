"""``duplexcache verify thinker`` exit codes: 0 within tolerance, 1 above, 2 unloadable."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from duplexcache.models.thinker import ThinkerConfig
from duplexcache.verify import thinker as verify

SMALL = ThinkerConfig(vocab_size=500, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # fmt: skip


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-small")
    verify.save_random_checkpoint(SMALL, path, seed=1)
    return path


def test_preset_random_weights_through_cli(capsys):
    from duplexcache import cli

    assert cli.main(["verify", "thinker", "--preset", "tiny", "--random-weights"]) == 0
    out = capsys.readouterr().out
    for path in ("dense prefill", "paged prefill", "paged decode"):
        assert path in out
    assert "PASS (tolerance 1e-05 for float32)" in out


def test_checkpoint_dir_passes(run_verify, small_dir, capsys):
    assert run_verify(verify, "--checkpoint", str(small_dir), "--sessions", "4", "--block-size", "4") == 0
    assert "PASS" in capsys.readouterr().out


def test_minicpmo_dir_passes(run_verify, small_dir, tmp_path):
    """The ``llm.`` part of a MiniCPM-o-style checkpoint, next to other stages' weights."""
    from duplexcache.models.checkpoint import load_state_dict

    config = {"model_type": "minicpmo", **{k: v for k, v in SMALL.to_hf_config().items() if k != "model_type"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = {f"llm.{k}": v for k, v in load_state_dict(small_dir).items()}
    save_file({**state, "apm.w": torch.ones(3)}, tmp_path / "model.safetensors")
    assert run_verify(verify, "--checkpoint", str(tmp_path)) == 0


def test_perturbed_weight_fails(run_verify, small_dir, monkeypatch, capsys):
    def perturb(model):
        with torch.no_grad():
            model.model.layers[1].self_attn.k_norm.weight[3] += 1e-3

    monkeypatch.setattr(verify, "_post_load_hook", perturb)
    assert run_verify(verify, "--checkpoint", str(small_dir)) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "dense prefill" in out


def test_broken_file_exits_2(run_verify, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(SMALL.to_hf_config()))
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    assert run_verify(verify, "--checkpoint", str(tmp_path)) == 2
    assert "cannot load" in capsys.readouterr().out


def test_missing_key_and_missing_dir_exit_2(run_verify, small_dir, tmp_path, capsys):
    from duplexcache.models.checkpoint import load_state_dict

    state = load_state_dict(small_dir)
    del state["model.norm.weight"]
    (tmp_path / "config.json").write_text((small_dir / "config.json").read_text())
    save_file(state, tmp_path / "model.safetensors")
    assert run_verify(verify, "--checkpoint", str(tmp_path)) == 2
    assert "model.norm.weight" in capsys.readouterr().out
    assert run_verify(verify, "--checkpoint", str(tmp_path / "absent")) == 2
    assert run_verify(verify, "--preset", "tiny") == 2  # a preset without --random-weights has nothing to load
