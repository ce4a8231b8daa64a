"""The five model configs of a preset, and the one builder of their seeded random weights.

Every random-weight model in the package comes from :func:`build_random_models`: the engine's
bundle (``runtime/bundle.py``) and every benchmark, each asking for the parts it runs. Shapes come
from each model's ``tiny()`` / ``minicpmo45()`` config; the tiny configs are aligned here so the
stages connect (the audio encoder's output width and the Talker's ``llm_dim`` are the Thinker's
hidden size, the Talker embeds the Thinker's text ids).

Random weights: every model keeps its own init (seeded by ``seed``), except the flow, whose
reference zero-inits the adaLN and output layers; with those zeros the estimator would output
zeros and Code2Wav would do no real work, so the flow is re-drawn from a seeded normal.

Imports torch and the model files only (no config, no web stack): the GPU benchmarks use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from duplexcache.models.audio_encoder import AudioEncoder, AudioEncoderConfig
from duplexcache.models.flow import FlowConfig, build_flow
from duplexcache.models.talker import Talker, TalkerConfig
from duplexcache.models.thinker import Thinker, ThinkerConfig
from duplexcache.models.vocoder import VocoderConfig, build_vocoder

PRESETS = ("tiny", "minicpmo45")
PARTS = ("thinker", "talker", "audio_encoder", "flow", "hift")


def preset_configs(preset: str) -> tuple[ThinkerConfig, TalkerConfig, AudioEncoderConfig, FlowConfig, VocoderConfig]:
    """The five model configs of a preset, aligned so the stages connect."""
    if preset == "minicpmo45":
        return (ThinkerConfig.minicpmo45(), TalkerConfig.minicpmo45(), AudioEncoderConfig.minicpmo45(),
                FlowConfig.minicpmo45(), VocoderConfig.minicpmo45())
    if preset == "tiny":
        thinker = ThinkerConfig.tiny()
        talker = TalkerConfig.tiny(llm_dim=thinker.hidden_size, num_text_tokens=thinker.vocab_size)
        encoder = AudioEncoderConfig.tiny(out_dim=thinker.hidden_size)
        return thinker, talker, encoder, FlowConfig.tiny(), VocoderConfig.tiny()
    raise ValueError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")


def randomize_(module: nn.Module, seed: int) -> None:
    """Seeded normal weights everywhere (std 0.5/sqrt(fan_in) for matrices, 0.1 otherwise)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            std = 0.5 / math.sqrt(p.shape[-1]) if p.dim() >= 2 else 0.1
            p.copy_((torch.randn(p.shape, generator=gen) * std).to(p.dtype))


@dataclass
class RandomModels:
    """The parts asked for (the others are None), in eval mode on one device. Stage 2 (flow,
    hift) is float32 whatever ``dtype`` the language models got, as in the reference."""

    thinker_config: ThinkerConfig
    talker_config: TalkerConfig
    encoder_config: AudioEncoderConfig
    flow_config: FlowConfig
    vocoder_config: VocoderConfig
    thinker: Thinker | None = None
    talker: Talker | None = None
    audio_encoder: AudioEncoder | None = None
    flow: nn.Module | None = None
    hift: nn.Module | None = None


def build_random_models(preset: str, device: torch.device | str, dtype: torch.dtype, seed: int = 0,
                        parts: Iterable[str] = PARTS) -> RandomModels:
    """Seeded random weights of ``preset``'s ``parts``, parameters created directly on ``device``
    (``meta`` gives shapes only): the minicpmo45 Thinker built on the host first would need 32 GB
    of host memory and minutes of CPU init before the copy. With every part, the weights are the
    ones ``runtime.bundle.build_models`` has always built for the same seed."""
    parts = set(parts)
    unknown = parts - set(PARTS)
    if unknown:
        raise ValueError(f"unknown model parts {sorted(unknown)} (known: {', '.join(PARTS)})")
    device = torch.device(device)
    out = RandomModels(*preset_configs(preset))
    torch.manual_seed(seed)
    with device:
        if "thinker" in parts:
            out.thinker = Thinker(out.thinker_config).to(dtype=dtype).eval()
        if "talker" in parts:
            out.talker = Talker(out.talker_config).to(dtype=dtype).eval()
        if "audio_encoder" in parts:
            out.audio_encoder = AudioEncoder(out.encoder_config).to(dtype=dtype).eval()
    if "flow" in parts:
        flow = build_flow(out.flow_config)   # on the host: randomize_ draws from a CPU generator
        randomize_(flow, seed + 1)
        out.flow = flow.to(device).eval()
    if "hift" in parts:
        out.hift = build_vocoder(out.vocoder_config, device)
    return out
