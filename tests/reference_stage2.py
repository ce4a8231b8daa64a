"""Test helper: the Stage 2 reference (minicpmo-utils 1.0.5, package ``stepaudio2``).

The import shim (an empty ``stepaudio2`` package object, so that ``stepaudio2/__init__`` and
its torchaudio/s3tokenizer imports never run), the reference builders and the transcription
of ``Token2wav.stream`` live in ``duplexcache.verify.flow`` (the verify command needs them at
run time too, lazily); this module gathers them for the tests and builds matched pairs.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("einops")
pytest.importorskip("scipy")
pytest.importorskip("onnxruntime")

from duplexcache.models.flow import FlowConfig, build_flow  # noqa: E402
from duplexcache.models.vocoder import VocoderConfig, build_vocoder  # noqa: E402
from duplexcache.verify.flow import (  # noqa: E402,F401
    build_reference_flow, build_reference_hift, copy_noise, import_reference, make_inputs,
    randomize_flow_, randomize_hift_, rel_err, stream_ours, stream_reference,
)

ref = import_reference()


def tiny_flow_pair(seed: int = 0):
    """(ours, reference) tiny flows with the same random weights and noise."""
    cfg = FlowConfig.tiny()
    torch.manual_seed(seed)
    ref_flow = build_reference_flow(cfg)
    randomize_flow_(ref_flow, seed)
    ours = build_flow(cfg)
    ours.load_state_dict(ref_flow.state_dict(), strict=True)
    copy_noise(ours, ref_flow)
    return ours, ref_flow


def tiny_hift_pair(seed: int = 0):
    cfg = VocoderConfig.tiny()
    torch.manual_seed(seed)
    ref_hift = build_reference_hift(cfg)
    randomize_hift_(ref_hift, seed)
    ours = build_vocoder(cfg)
    ours.load_state_dict(ref_hift.state_dict(), strict=True)
    return ours, ref_hift
