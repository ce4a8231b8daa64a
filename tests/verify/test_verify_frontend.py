"""``duplexcache verify audio-encoder|talker``: pass on random weights, fail on a perturbed
weight (exit 1), refuse an unloadable checkpoint (exit 2)."""

import pytest
import torch

pytest.importorskip("transformers")

from duplexcache.verify import audio_encoder as verify_apm  # noqa: E402
from duplexcache.verify import talker as verify_talker  # noqa: E402


@pytest.mark.parametrize("mod", [verify_apm, verify_talker])
def test_random_tiny_passes(run_verify, mod, capsys):
    assert run_verify(mod, "--preset", "tiny", "--random-weights") == 0
    assert "PASS" in capsys.readouterr().out


def _perturb_apm(model):
    with torch.no_grad():
        model.apm.layers[0].fc2.weight.mul_(1.001)  # (a uniform bias shift would vanish in LayerNorm)


def _perturb_talker(model):
    with torch.no_grad():
        model.model.layers[-1].mlp.down_proj.weight.mul_(1.001)


@pytest.mark.parametrize("mod, hook", [(verify_apm, _perturb_apm), (verify_talker, _perturb_talker)])
def test_perturbed_weight_fails(run_verify, mod, hook, monkeypatch, capsys):
    monkeypatch.setattr(mod, "_post_load_hook", hook)
    assert run_verify(mod, "--preset", "tiny", "--random-weights") == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("mod", [verify_apm, verify_talker])
def test_unloadable_checkpoint_exits_2(run_verify, mod, tmp_path):
    assert run_verify(mod, "--checkpoint", str(tmp_path)) == 2  # no config, no weights
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    assert run_verify(mod, "--checkpoint", str(tmp_path)) == 2


def test_wrong_shape_checkpoint_exits_2(run_verify, tmp_path):
    from duplexcache.models.talker import TalkerConfig

    verify_talker.save_random_checkpoint(TalkerConfig.tiny(), tmp_path)
    cfg = (tmp_path / "config.json").read_text().replace('"num_audio_tokens": 50', '"num_audio_tokens": 51')
    (tmp_path / "config.json").write_text(cfg)
    assert run_verify(verify_talker, "--checkpoint", str(tmp_path)) == 2


def test_preset_without_random_weights_exits_2(run_verify):
    assert run_verify(verify_apm, "--preset", "tiny") == 2
    assert run_verify(verify_talker, "--preset", "tiny") == 2
