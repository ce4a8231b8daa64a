"""``duplexcache verify vision``: passes on random tiny weights, fails on a perturbed weight of the
encoder or of the resampler (exit 1), refuses an unloadable checkpoint (exit 2)."""

import pytest
import torch

pytest.importorskip("transformers")

from duplexcache.verify import vision as verify_vision  # noqa: E402


def test_random_tiny_passes(run_verify, capsys):
    assert run_verify(verify_vision, "--preset", "tiny", "--random-weights") == 0
    out = capsys.readouterr().out
    assert "PASS" in out
    for path in ("encoder", "encoder-batched", "resampler", "frame-tokens"):
        assert f"  {path} " in out


def _perturb_encoder(model):
    with torch.no_grad():
        model.vpm.encoder.layers[0].mlp.fc2.weight.mul_(1.001)  # (a uniform shift would vanish in LayerNorm)


def _perturb_resampler(model):
    with torch.no_grad():
        model.resampler.attn.in_proj_weight.mul_(1.001)


def _perturb_position_table(model):
    with torch.no_grad():  # row 0 (every grid's first patch), scaled: not a uniform shift
        model.vpm.embeddings.position_embedding.weight[0].mul_(1.01)


@pytest.mark.parametrize("hook", [_perturb_encoder, _perturb_resampler, _perturb_position_table])
def test_perturbed_weight_fails(run_verify, hook, monkeypatch, capsys):
    monkeypatch.setattr(verify_vision, "_post_load_hook", hook)
    assert run_verify(verify_vision, "--preset", "tiny", "--random-weights") == 1
    assert "FAIL" in capsys.readouterr().out


def test_unloadable_checkpoint_exits_2(run_verify, tmp_path):
    assert run_verify(verify_vision, "--checkpoint", str(tmp_path)) == 2  # no config, no weights
    (tmp_path / "config.json").write_text('{"hidden_size": 64, "vision_config": {}}')
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    assert run_verify(verify_vision, "--checkpoint", str(tmp_path)) == 2


def test_preset_without_random_weights_exits_2(run_verify):
    assert run_verify(verify_vision, "--preset", "tiny") == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_exits_2(run_verify, capsys):
    assert run_verify(verify_vision, "--preset", "tiny", "--random-weights", "--device", "cuda") == 2
    assert "CUDA is not available" in capsys.readouterr().out
