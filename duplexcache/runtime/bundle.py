"""The models one engine serves, built for a preset with random weights or loaded from a checkpoint.

Random weights come from ``models/presets.py`` (``build_random_models``, the package's one
builder of random-weight models: shapes per preset, stages aligned, the flow re-drawn).

Checkpoint (``model.checkpoint_dir``): the Thinker (``llm.``), Talker (``tts.``) and audio encoder
(``apm.`` + ``audio_projection_layer.``) load strictly from the directory; Stage 2 loads
``assets/token2wav/flow.pt`` and ``hift.pt`` strictly; voices come from ``voices/*.safetensors``
when present (see runtime/voices.py). Checkpoint loading is untested here (no weights).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from duplexcache.config import DeployConfig
from duplexcache.context.tokenizer import Tokenizer, load_tokenizer
from duplexcache.models.audio_encoder import AudioEncoder
from duplexcache.models.flow import FlowConfig, build_flow
from duplexcache.models.presets import build_random_models, preset_configs
from duplexcache.models.talker import Talker
from duplexcache.models.thinker import Thinker
from duplexcache.models.vocoder import (
    VocoderConfig,
    build_vocoder,
    hift_state_dict_from_checkpoint,
)
from duplexcache.runtime.voices import VoiceRegistry, synthetic_voice

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Synthetic voice lengths per preset: (reference audio seconds, Code2Wav prompt seconds).
# minicpmo45 uses the reference's 6 s prompt (P = 300 frames); tiny keeps CPU runs short.
VOICE_SECONDS = {"tiny": (1.0, 2.4), "minicpmo45": (6.0, 6.0)}
DEFAULT_VOICES = ("default", "alt")


@dataclass
class ModelBundle:
    """Everything the engine runs. Stage 2's flow is in ``precision.code2wav_dtype`` (float32 by
    default, as in the reference), its vocoder (hift) float32 always."""

    thinker: Thinker
    talker: Talker
    audio_encoder: AudioEncoder
    flow: nn.Module
    hift: nn.Module
    tokenizer: Tokenizer
    voices: VoiceRegistry
    dtype: torch.dtype
    device: torch.device
    vision: nn.Module | None = None   # model.vision: the vision encoder + resampler (runtime/stages/vision_stage.py)

    def weight_bytes(self) -> int:
        mods = (self.thinker, self.talker, self.audio_encoder, self.flow, self.hift, self.vision)
        return sum(p.numel() * p.element_size() for m in mods if m is not None for p in m.parameters())


def build_models(deploy: DeployConfig, seed: int = 0) -> ModelBundle:
    """Build (random weights) or load (``checkpoint_dir``) the preset's models on the config's device."""
    m = deploy.model
    dtype, device = DTYPES[m.dtype], torch.device(m.device)
    if device.type == "meta":
        raise ValueError("model.device 'meta' builds shapes only; the engine needs real weights")
    if m.checkpoint_dir is not None:
        _, _, _, flow_cfg, voc_cfg = preset_configs(m.preset)
        models = _load_models(deploy, dtype, device, flow_cfg, voc_cfg)
    else:
        r = build_random_models(m.preset, device, dtype, seed)
        ref_s, prompt_s = VOICE_SECONDS[m.preset]
        voices = VoiceRegistry([synthetic_voice(n, ref_s, prompt_s, r.flow_config.vocab_size)
                                for n in DEFAULT_VOICES])
        logger.info("built %s models with random weights on %s (%s)", m.preset, device, m.dtype)
        models = ModelBundle(r.thinker, r.talker, r.audio_encoder, code2wav_flow(deploy, r.flow), r.hift,
                             load_tokenizer(None), voices, dtype, device)
    if m.vision:   # only then: audio-only deployments hold no vision weights
        from duplexcache.runtime.stages.vision_stage import build_vision_model

        models.vision = build_vision_model(m.preset, models.thinker.config.hidden_size, dtype, device,
                                           m.checkpoint_dir, seed)
    return models


def meta_model_bundle(preset: str, dtype: torch.dtype = torch.bfloat16, vision: bool = False) -> ModelBundle:
    """The preset's models on the ``meta`` device: shapes and bytes, no weights, nothing computed.
    For planning a card from shapes alone (scripts/probes/card_capacity.py, the memory-plan tests); never
    a bundle to serve with (``build_models`` refuses ``meta``)."""
    tk, tl, enc, flow_cfg, voc = preset_configs(preset)
    meta = torch.device("meta")
    with meta:
        thinker, talker, encoder = Thinker(tk).to(dtype), Talker(tl).to(dtype), AudioEncoder(enc).to(dtype)
    ref_s, prompt_s = VOICE_SECONDS[preset]
    voices = VoiceRegistry([synthetic_voice(n, ref_s, prompt_s, flow_cfg.vocab_size) for n in DEFAULT_VOICES])
    bundle = ModelBundle(thinker, talker, encoder, build_flow(flow_cfg, device="meta"),
                         build_vocoder(voc, device="meta"), load_tokenizer(None), voices, dtype, meta)
    if vision:
        from duplexcache.models.vision import VisionModel
        from duplexcache.runtime.stages.vision_stage import vision_config

        with meta:
            bundle.vision = VisionModel(vision_config(preset, tk.hidden_size)).to(dtype)
    return bundle


def code2wav_flow(deploy: DeployConfig, flow: nn.Module) -> nn.Module:
    """The flow in ``precision.code2wav_dtype``: the float32 weights rounded once (capacity mode
    runs the same weights as exact mode, which is what its measured error compares). ``flow`` is
    a fresh module: it is converted in place (no second copy of the weights)."""
    dtype = DTYPES[deploy.precision.code2wav_dtype]
    if dtype != torch.float32:
        logger.info("Code2Wav flow in %s (precision.code2wav_dtype; the vocoder stays float32)", dtype)
    return flow.to(dtype)


def engine_flow(deploy: DeployConfig, models: ModelBundle) -> nn.Module:
    """The flow an engine of ``deploy`` runs: the bundle's when it is in ``precision.code2wav_dtype``
    (``build_models`` built it so), else a private copy in that format (a bundle built for another
    deploy, e.g. one shared by tests): the switch must reach Code2Wav whoever built the models."""
    dtype = DTYPES[deploy.precision.code2wav_dtype]
    if next(models.flow.parameters()).dtype == dtype:
        return models.flow
    logger.info("the model bundle's flow is not in precision.code2wav_dtype %s: this engine runs a copy in it", dtype)
    return copy.deepcopy(models.flow).to(dtype)


def _load_models(deploy: DeployConfig, dtype: torch.dtype, device: torch.device,
                 flow_cfg: FlowConfig, voc_cfg: VocoderConfig) -> ModelBundle:
    from duplexcache.models import checkpoint

    root = Path(deploy.model.checkpoint_dir)
    thinker = Thinker.from_pretrained(root, dtype=dtype, device=device)
    talker = Talker.from_pretrained(root, dtype=dtype, device=device).eval()
    encoder = AudioEncoder.from_pretrained(root, dtype=dtype, device=device).eval()
    t2w = root / "assets" / "token2wav"
    flow = build_flow(flow_cfg)
    checkpoint.load_strict(flow, checkpoint.load_state_dict(t2w / "flow.pt"), "flow")
    hift = build_vocoder(voc_cfg)
    checkpoint.load_strict(hift, hift_state_dict_from_checkpoint(checkpoint.load_state_dict(t2w / "hift.pt")), "hift")
    ref_s, prompt_s = VOICE_SECONDS[deploy.model.preset]
    voices = VoiceRegistry([synthetic_voice(n, ref_s, prompt_s, flow_cfg.vocab_size) for n in DEFAULT_VOICES])
    if (root / "voices").is_dir():
        voices.load_dir(root / "voices")
    return ModelBundle(thinker, talker, encoder, code2wav_flow(deploy, flow.to(device)).eval(), hift.to(device).eval(),
                       load_tokenizer(root), voices, dtype, device)
