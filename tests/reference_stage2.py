"""Test helper: the Stage 2 reference (minicpmo-utils 1.0.5, package ``stepaudio2``).

The import shim (an empty ``stepaudio2`` package object, so that ``stepaudio2/__init__`` and
its torchaudio/s3tokenizer imports never run), the reference builders and the transcription
of ``Token2wav.stream`` live in ``duplexcache.verify.flow`` (the verify command needs them at
run time too, lazily); this module gathers them for the tests, builds matched pairs, and holds the ``one_thread``
fixture that the Stage 2 test modules import.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("einops")
pytest.importorskip("scipy")
pytest.importorskip("onnxruntime")

from duplexcache.models.flow import FlowConfig, build_flow  # noqa: E402
from duplexcache.models.vocoder import VocoderConfig, build_vocoder  # noqa: E402
from duplexcache.verify.common import relative_error as rel_err  # noqa: E402,F401
from duplexcache.verify.flow import (  # noqa: E402,F401
    build_reference_flow, build_reference_hift, copy_noise, import_reference, make_inputs,
    randomize_flow_, randomize_hift_, stream_ours, stream_reference,
)

ref = import_reference()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread for a whole test module: on 2 shared cores, oversubscribed threads
    make the tiny Stage 2 convolutions ~20x slower, and another test (or the bench command run
    in-process) may have raised the count. Autouse in every module that imports it by name."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _matched_pair(build_reference, randomize_, build_ours, seed: int):
    """(ours, reference): the reference randomised with ``seed``, its weights loaded strictly into ours."""
    torch.manual_seed(seed)
    reference = build_reference()
    randomize_(reference, seed)
    ours = build_ours()
    ours.load_state_dict(reference.state_dict(), strict=True)
    return ours, reference


def tiny_flow_pair(seed: int = 0):
    """(ours, reference) tiny flows with the same random weights and noise."""
    cfg = FlowConfig.tiny()
    ours, ref_flow = _matched_pair(lambda: build_reference_flow(cfg), randomize_flow_, lambda: build_flow(cfg), seed)
    copy_noise(ours, ref_flow)
    return ours, ref_flow


def tiny_hift_pair(seed: int = 0):
    """(ours, reference) tiny HiFT vocoders with the same weights (the reference's own init, voiced F0)."""
    cfg = VocoderConfig.tiny()
    return _matched_pair(lambda: build_reference_hift(cfg), randomize_hift_, lambda: build_vocoder(cfg), seed)
