"""The tick's vision step: camera frames -> the Thinker's frame rows, one batched call per tick.

A video session (``SessionRuntimeConfig.video``, deploy ``model.vision: true``) sends frames
beside its audio; each frame rides with the session's next unit (first in, first out: a client
sending one frame per second of audio gets each frame on the unit of its second). Per tick::

    push_frame (server thread)   bytes --decode (Pillow), check, resize to the frame grid--> Frame
                                 (uint8 pixels: 0.6 MB a 448^2 frame, at most MAX_PENDING_FRAMES)
    take_units (tick)            each unit takes its session's oldest pending Frame
    VisionStage.run (tick)       every frame of the tick -> ONE VisionModel call (NaViT-packed
                                 batch, models/vision.py) -> (N, 64, H); each unit's rows become
                                 <image> v1..v64 </image> (66 rows)
    ThinkerStage.run             [</unit>] [text] <unit> + those 66 rows + the 10 audio rows

That is the reference's duplex layout (``models/vision.unit_input_ids``): the frame between
``<unit>`` and the unit's audio. The Thinker, its window, anchors and compaction see 66 more rows
in the unit and nothing else: a unit is one append, whatever it holds.

The vision call runs eagerly (no CUDA graph): frames of different sizes pack to different
lengths, and the call is one per tick, not one per token.

Admission (runtime/memory/session_sizing.py): a video session's unit is ``VIDEO_UNIT_TOKENS`` more, so
its window must hold a video unit, its user text has that much less room, and its dynamic
reservation adds one frame's activations through the encoder (``frame_activation_bytes``): the
batched call's activations grow with the frames in it.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from duplexcache.models.vision import (IMAGE_END_TOKEN, IMAGE_START_TOKEN, VisionConfig, VisionModel, best_resize,
                                       decode_jpeg)
from duplexcache.runtime.engine_api import EngineEvent
from duplexcache.runtime.engine_session import EndSession, Unit, end_all
from duplexcache.runtime.isolation import FaultInjector, precheck, run_isolated

if TYPE_CHECKING:
    from duplexcache.config import DeployConfig
    from duplexcache.runtime.bundle import ModelBundle

logger = logging.getLogger(__name__)

# Image formats a frame may come in (the OpenAI Realtime spec's PNG and JPEG; the MiniCPM-o SDK
# sends JPEG). Anything else Pillow could open (GIF, TIFF, ...) is refused by name.
FRAME_FORMATS = ("JPEG", "PNG")
# Frames a session may hold ahead of its units: one per unit, as many as its audio buffer holds
# seconds (engine_session.MAX_BUFFERED_SECONDS).
MAX_PENDING_FRAMES = 10
# Thinker rows one frame adds to its unit: <image> + query_num + </image>.
FRAME_EXTRA_TOKENS = 2


class InvalidImageError(ValueError):
    """A frame the engine cannot take: not an image, corrupt, too large, a refused format."""

    code = "invalid_image"


class VisionUnavailable(ValueError):
    """A frame sent to an engine without a vision model, or for a session not opened for video."""

    code = "vision_unavailable"


class TooManyFrames(ValueError):
    """A session already holds ``MAX_PENDING_FRAMES`` frames its units have not taken."""

    code = "too_many_frames"


@dataclass(frozen=True)
class Frame:
    """One decoded frame at its grid: uint8 pixels (3, 14*rows, 14*cols), normalised at encode."""

    pixels: torch.Tensor
    grid: tuple[int, int]


def frame_tokens(cfg: VisionConfig) -> int:
    """Thinker rows a frame adds to its unit (66 for MiniCPM-o 4.5)."""
    return cfg.query_num + FRAME_EXTRA_TOKENS


def max_frame_patches(cfg: VisionConfig) -> int:
    """Most patches a frame may have after the resize: a square frame's grid plus one patch each
    way (the resize keeps the area ~scale^2, rounding each side to a patch). An extreme aspect
    ratio (a 4096 x 1 strip) would resize to twice as many patches; it is refused, so the
    reservation per frame (``frame_activation_bytes``) is a real bound."""
    side = cfg.scale_resolution // cfg.patch_size + 1
    return side * side


def frame_activation_bytes(cfg: VisionConfig, dtype: torch.dtype) -> int:
    """What one frame adds to the tick's batched vision call, at the largest frame allowed: one
    encoder layer's activations (``VisionConfig.activation_bytes``, eager attention scores
    included: an upper bound for SDPA) plus its patches and its 66 output rows."""
    patches = max_frame_patches(cfg)
    item = torch.empty((), dtype=dtype).element_size()
    inputs = patches * cfg.num_channels * cfg.patch_size**2 * item
    out = frame_tokens(cfg) * cfg.llm_hidden_size * item
    return cfg.activation_bytes(patches, dtype) + inputs + out


def decode_frame(data: bytes, cfg: VisionConfig) -> Frame:
    """Image bytes -> a ``Frame`` at its grid; ``InvalidImageError`` says what is wrong (the
    server prefixes the wire field). Runs on the caller's thread, never in a tick."""
    from PIL import Image

    if not isinstance(data, (bytes, bytearray, memoryview)) or not len(data):
        raise InvalidImageError("expected non-empty image bytes")
    try:
        fmt = Image.open(io.BytesIO(bytes(data))).format
    except Exception:  # noqa: BLE001 - decode_jpeg below names what is wrong
        fmt = None
    if fmt is not None and fmt not in FRAME_FORMATS:
        raise InvalidImageError(f"unsupported image format {fmt} (send {' or '.join(FRAME_FORMATS)})")
    try:
        image = decode_jpeg(bytes(data), "image")
    except ValueError as exc:
        raise InvalidImageError(str(exc).removeprefix("image: ")) from None
    width, height = best_resize(image.width, image.height, cfg.scale_resolution, cfg.patch_size)
    grid = (height // cfg.patch_size, width // cfg.patch_size)
    if grid[0] * grid[1] > max_frame_patches(cfg):
        raise InvalidImageError(f"aspect ratio of {image.width}x{image.height} too extreme: it resizes to "
                                f"{grid[0]}x{grid[1]} patches, more than {max_frame_patches(cfg)}")
    resized = image.resize((width, height), resample=Image.Resampling.BICUBIC)   # as models/vision.preprocess_frame
    pixels = torch.from_numpy(np.asarray(resized, dtype=np.uint8).copy()).permute(2, 0, 1).contiguous()
    return Frame(pixels, grid)


def normalise(frame: Frame, cfg: VisionConfig) -> torch.Tensor:
    """uint8 -> the float32 pixels ``models/vision.preprocess_frame`` gives: /255, (x - mean) / std."""
    return (frame.pixels.float() / 255.0 - cfg.norm_mean) / cfg.norm_std


def vision_config(preset: str, thinker_hidden: int, checkpoint_dir: str | None = None) -> VisionConfig:
    """The vision shapes of a deployment: the checkpoint's ``config.json``, else the preset's
    (the tiny one's width is the tiny Thinker's). Shapes only: admission sizes frames with it."""
    if checkpoint_dir is not None:
        cfg = VisionConfig.from_dir(checkpoint_dir)
    elif preset == "minicpmo45":
        cfg = VisionConfig.minicpmo45()
    else:
        cfg = VisionConfig.tiny(llm_hidden_size=thinker_hidden)
    if cfg.llm_hidden_size != thinker_hidden:
        raise ValueError(f"vision resampler width {cfg.llm_hidden_size} != the Thinker's hidden {thinker_hidden}")
    return cfg


def build_vision_model(preset: str, thinker_hidden: int, dtype: torch.dtype, device: torch.device,
                       checkpoint_dir: str | None = None, seed: int = 0) -> VisionModel:
    """The preset's vision model (``model.vision``): seeded random weights, or the checkpoint's
    ``vpm.`` + ``resampler.`` loaded strictly."""
    cfg = vision_config(preset, thinker_hidden, checkpoint_dir)
    if checkpoint_dir is not None:
        return VisionModel.from_pretrained(checkpoint_dir, cfg, dtype=dtype, device=device).eval()
    # the engine's other models are drawn before it: a seed of its own keeps their weights unchanged
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 47)
        model = VisionModel(cfg)
    return model.to(device=device, dtype=dtype).eval()


def engine_vision(deploy: "DeployConfig", models: "ModelBundle") -> VisionModel | None:
    """The vision model an engine of ``deploy`` runs: None without ``model.vision``; the bundle's
    when it has one, else one built now (a bundle built for another deploy, e.g. shared by tests:
    the switch must reach the engine whoever built the models)."""
    if not deploy.model.vision:
        return None
    if models.vision is not None:
        return models.vision
    logger.info("model.vision is on and the model bundle has no vision model: building it")
    m = deploy.model
    return build_vision_model(m.preset, models.thinker.config.hidden_size, models.dtype, models.device,
                              m.checkpoint_dir)


class VisionStage:
    """The tick's frames -> each unit's 66 Thinker rows (``Unit.frame_rows``)."""

    def __init__(self, model: VisionModel, embed: Callable[[torch.Tensor], torch.Tensor], tokenizer: object,
                 end: EndSession) -> None:
        self.model = model
        self.cfg = model.cfg
        self.embed = embed
        ids = torch.tensor([tokenizer.token_id(IMAGE_START_TOKEN), tokenizer.token_id(IMAGE_END_TOKEN)])
        self.image_start, self.image_end = embed(ids).unbind(0)   # (H,) each
        self.end = end
        self.faults: FaultInjector | None = None
        self.frames_encoded = 0

    def run(self, units: list[Unit], events: list[EngineEvent]) -> list[Unit]:
        """Encode every frame of the tick in one call; returns the units still live. A session
        whose frame fails ends alone (runtime/isolation.py), the others keep theirs."""
        with_frame = [u for u in units if u.frame is not None]
        if not with_frame:
            return units
        with_frame, errors = precheck(self.faults, "vision", with_frame, lambda u: u.session.sid)
        end_all(units, errors, events, self.end)
        iso = run_isolated("vision", with_frame, self._encode, lambda u: u.session.sid, self.faults)
        end_all(units, iso.errors, events, self.end)
        for u, rows in zip(iso.kept, iso.result or []):
            u.frame_rows = rows
        self.frames_encoded += len(iso.kept)
        gone = set(errors) | set(iso.errors)
        return [u for u in units if u.session.sid not in gone]

    def _encode(self, batch: list[Unit]) -> list[torch.Tensor]:
        device = self.model.vpm.embeddings.patch_embedding.weight.device
        pixels = [normalise(u.frame, self.cfg).to(device) for u in batch]
        with torch.no_grad():
            tokens = self.model(pixels)   # (N, query_num, H)
        start, end = self.image_start.to(tokens.dtype)[None], self.image_end.to(tokens.dtype)[None]
        return [torch.cat([start, tokens[i], end], dim=0) for i in range(len(batch))]   # (66, H) each
