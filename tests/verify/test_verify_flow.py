"""``duplexcache verify flow`` on the tiny preset (CPU): exit codes 0 / 1 / 2."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference_stage2 import one_thread  # noqa: E402,F401  (autouse fixture; skips when the reference is absent)

from duplexcache.models.flow import FlowConfig, build_flow  # noqa: E402
from duplexcache.models.vocoder import VocoderConfig, build_vocoder  # noqa: E402
from duplexcache.verify import flow as verify_flow  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """A tiny token2wav directory: flow.pt, and hift.pt with Token2wav's "generator." prefix."""
    d = tmp_path_factory.mktemp("token2wav")
    torch.manual_seed(5)
    flow = build_flow(FlowConfig.tiny())
    verify_flow.randomize_flow_(flow, seed=5)
    hift = build_vocoder(VocoderConfig.tiny())
    verify_flow.randomize_hift_(hift, seed=6)
    torch.save(flow.state_dict(), d / "flow.pt")
    torch.save({"generator." + k: v for k, v in hift.state_dict().items()}, d / "hift.pt")
    return d


def test_random_weights_pass(run_verify, capsys):
    assert run_verify(verify_flow, "--preset", "tiny", "--random-weights", "--chunks", "3") == 0
    out = capsys.readouterr().out
    assert "mel      max rel err" in out and "waveform max rel err" in out and "PASS" in out


def test_checkpoint_pass(run_verify, checkpoint_dir, capsys):
    assert run_verify(verify_flow, "--checkpoint", str(checkpoint_dir), "--preset", "tiny", "--chunks", "4") == 0
    assert "PASS" in capsys.readouterr().out


def test_divergence_exits_1(run_verify, monkeypatch, capsys):
    # our side skips the cache trim: the cache passes P + 100 after chunk 3, so chunk 4 diverges
    monkeypatch.setattr(verify_flow, "trim_stream_cache", lambda cache, p: cache)
    assert run_verify(verify_flow, "--preset", "tiny", "--random-weights", "--chunks", "4") == 1
    assert "FAIL" in capsys.readouterr().out


def test_checkpoint_missing_key_exits_2(run_verify, checkpoint_dir, tmp_path, capsys):
    sd = torch.load(checkpoint_dir / "flow.pt", weights_only=True)
    del sd["encoder.up_encoders.0.self_attn.pos_bias_u"]
    torch.save(sd, tmp_path / "flow.pt")
    (tmp_path / "hift.pt").write_bytes((checkpoint_dir / "hift.pt").read_bytes())
    assert run_verify(verify_flow, "--checkpoint", str(tmp_path), "--preset", "tiny") == 2
    out = capsys.readouterr().out
    assert "encoder.up_encoders.0.self_attn.pos_bias_u" in out and "missing" in out


def test_checkpoint_without_hift_exits_2(run_verify, checkpoint_dir, tmp_path, capsys):
    (tmp_path / "flow.pt").write_bytes((checkpoint_dir / "flow.pt").read_bytes())
    assert run_verify(verify_flow, "--checkpoint", str(tmp_path), "--preset", "tiny") == 2
    assert "no hift.pt" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--preset", "tiny"], ["--preset", "tiny", "--random-weights", "--chunks", "2"]])
def test_bad_arguments_exit_2(run_verify, argv):
    assert run_verify(verify_flow, *argv) == 2
