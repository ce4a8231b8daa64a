"""models/presets.py: the one builder of random-weight models (the engine's bundle and every bench)."""
import pytest
import torch

from duplexcache.config import DeployConfig
from duplexcache.models.presets import PARTS, build_random_models
from duplexcache.runtime.bundle import build_models


def test_all_parts_are_the_bundles_weights():
    """The bundle builds through it: with every part, the same seed gives the same tensors."""
    bundle = build_models(DeployConfig.default("tiny"), seed=5)
    m = build_random_models("tiny", "cpu", torch.float32, seed=5)
    for part in PARTS:
        ours, theirs = getattr(m, part).state_dict(), getattr(bundle, part).state_dict()
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), part


def test_only_the_parts_asked_for_on_the_device_and_dtype():
    m = build_random_models("minicpmo45", "meta", torch.bfloat16, parts=("thinker", "audio_encoder"))
    assert m.talker is None and m.flow is None and m.hift is None
    assert m.audio_encoder.cfg.out_dim == m.thinker.config.hidden_size
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16
               for mod in (m.thinker, m.audio_encoder) for p in mod.parameters())
    stage2 = build_random_models("tiny", "cpu", torch.bfloat16, parts=("flow", "hift"))
    assert stage2.thinker is None
    assert all(p.dtype == torch.float32 for mod in (stage2.flow, stage2.hift) for p in mod.parameters())


def test_flow_is_redrawn_not_zero_initialised():
    """The reference zero-inits the flow's output layer; left so, Code2Wav would do no work."""
    flow = build_random_models("tiny", "cpu", torch.float32, parts=("flow",)).flow
    assert all(p.abs().sum() > 0 for p in flow.parameters() if p.numel() > 1)


def test_bad_preset_or_part():
    with pytest.raises(ValueError, match="unknown preset"):
        build_random_models("huge", "cpu", torch.float32)
    with pytest.raises(ValueError, match="unknown model parts"):
        build_random_models("tiny", "cpu", torch.float32, parts=("thinker", "speaker"))
