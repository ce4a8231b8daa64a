"""Vision path: camera frame -> SigLIP NaViT encoder (``vpm.``) -> perceiver resampler (``resampler.``).

Pipeline (preset ``minicpmo45``; MiniCPM-o 4.5's ``config.json`` / ``configuration_minicpmo.py``,
``modeling_navit_siglip.py`` and ``modeling_minicpmo.py`` read for names and shapes)::

    JPEG --decode (Pillow), RGB--> resize, aspect kept, area ~ 448^2, sides rounded to multiples of 14
      --/255, (x - 0.5) / 0.5--> (3, 14h, 14w)                    one frame, h x w patches (~32 x 32)
      --patchify--> (h*w, 3*14*14)                                 row-major patches, (c, ky, kx) each
      --patch_embedding (the Conv2d k14 s14, as a matmul)
        + position_embedding[bucketed (row, col) on a 70 x 70 table]--> (h*w, 1152)
      --27 pre-LN SigLIP layers (16 heads, GELU-tanh MLP 4304) --> post_layernorm   (h*w, 1152)
      --resampler: kv_proj 1152->4096 (no bias), ln_kv; keys + 2D sin-cos(row, col); 64 learned
        queries (ln_q) attend once (32 heads of 128), ln_post, @ proj (4096, 4096)--> (64, 4096)

The 64 rows are the frame's vision tokens: they replace the 64 placeholder positions between
``<image>`` and ``</image>`` in the Thinker's input (``frame_token_ids``).

NaViT details, which the tests pin down:

* Variable resolution: a frame keeps its own h x w patch grid; frames of different sizes are
  batched by zero-padding to the longest patch count, and a key-padding mask keeps every frame's
  attention (encoder and resampler) on its own patches. A frame's tokens do not depend on what it
  was batched with (up to float rounding), and padding rows are dropped.
* Position bucketing: the position table is the 980-pixel SigLIP's 70 x 70 grid. Patch row ``i``
  of ``h`` sits at fractional coordinate i/h and takes the table row of the bucket that
  coordinate falls in (``bucket_coords``); columns likewise. The fractional coordinates are
  float32 ``arange(0, 1 - 1e-6, 1/h)`` as in MiniCPM-o's ``modeling_navit_siglip.py`` (the
  trained model's): transformers' ``Idefics2VisionEmbeddings`` computes ``i * (1/h)`` instead,
  and at 70 buckets the two round a coordinate that lands on a bucket edge differently for
  h in {25, 49, 50, 55} (``IDEFICS2_BUCKETING_DIFFERS``). This file follows MiniCPM-o.
* No size limit: a side longer than 70 patches still buckets (coordinates are fractions), and the
  resampler's sin-cos table is computed for whatever grid comes, as the reference's cache grows.
* Resampler positions: ``pos[row, col] = [sin(col*w), cos(col*w), sin(row*w), cos(row*w)]`` with
  w_k = 10000^(-k / (D/4)), k < D/4: the first half of the width encodes the COLUMN (the
  reference builds its grid with ``meshgrid(w, h)``), added to the keys only, never the values.

Slicing: MiniCPM-V/o cut large images into a source view plus up to ``max_slice_nums`` slices of
~448^2. In duplex the reference passes ``max_slice_nums=1`` for camera frames (its
``streaming_prefill`` default, warm-up and benchmark), so a frame is never sliced: one resize to
~448^2 area (upscaling allowed), one 64-token image. ``frame_token_ids`` can lay out slices
(``<slice>`` 64 ``</slice>`` after the image) for completeness; ``preprocess_frame`` makes none.

Thinker-side layout of a unit that carries a frame (the reference's ``streaming_prefill``: unit
token, then the frame, then the unit's audio)::

    [</unit>] <unit> <image> v1 .. v64 </image> a1 .. a10  then <|listen|> | <|speak|> ...

The resampler is MiniCPM-o 4.5's 2D one (``Resampler.forward(x, tgt_sizes)``): MiniCPM-V 4.5's "3D"
resampler, which compresses several video frames together with temporal positions, is not in
MiniCPM-o 4.5's modeling file; each frame here is resampled alone.

Parameter names are those of the checkpoint (``vpm.embeddings.patch_embedding.weight``,
``vpm.encoder.layers.N.self_attn.q_proj.weight``, ``resampler.attn.in_proj_weight``, ...), so
``VisionModel.from_pretrained`` loads a MiniCPM-o directory strictly.
"""

from __future__ import annotations

import io
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from PIL import Image as PILImage

    from duplexcache.context.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Grid = tuple[int, int]  # (rows, cols) of patches

# Grid sides (patches) at which MiniCPM-o's bucketing and transformers' Idefics2 bucketing differ
# on the 70 x 70 table (computed by tests/models/test_vision.py; none on the tiny 8 x 8 table).
IDEFICS2_BUCKETING_DIFFERS = (25, 49, 50, 55)

# A decoded frame larger than this is refused before resizing (a 4K frame is 8.3 Mpx): a JPEG
# header can claim 65535 x 65535 and Pillow would allocate it.
MAX_FRAME_PIXELS = 4096 * 4096


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class VisionConfig:
    # SigLIP so400m-patch14 (NaViT, 980 px) as MiniCPM-o 4.5's ``vision_config``
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 980  # the position table covers image_size // patch_size = 70 per side
    patch_size: int = 14
    layer_norm_eps: float = 1e-6
    # resampler (``query_num``; embed dim = the Thinker's hidden size; heads = hidden // 128)
    query_num: int = 64
    llm_hidden_size: int = 4096
    resampler_heads: int = 32
    resampler_eps: float = 1e-6
    # preprocessing (``preprocessor_config.json`` / ``slice_config``)
    scale_resolution: int = 448
    max_slice_nums: int = 1  # duplex frames: never sliced (see the module docstring)
    norm_mean: float = 0.5
    norm_std: float = 0.5

    def __post_init__(self) -> None:
        if self.num_attention_heads < 1 or self.resampler_heads < 1 or self.num_hidden_layers < 0:
            raise ValueError("num_attention_heads and resampler_heads must be >= 1, num_hidden_layers >= 0")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} not divisible by heads {self.num_attention_heads}")
        if self.llm_hidden_size % self.resampler_heads:
            raise ValueError(f"llm_hidden_size {self.llm_hidden_size} not divisible by {self.resampler_heads} heads")
        if self.llm_hidden_size % 4:
            raise ValueError("llm_hidden_size must be a multiple of 4 (2D sin-cos positions)")
        if self.image_size < self.patch_size:
            raise ValueError("image_size must be at least one patch")
        if self.max_slice_nums != 1:
            raise ValueError("only max_slice_nums=1 (no slicing, the duplex setting) is implemented")

    @property
    def num_patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def tiny(cls, **overrides) -> "VisionConfig":
        """CPU-fast shape: 8 x 8 position table (112 px), 56-px frames (4 x 4 patches ~), the
        tiny Thinker's hidden size 64; 64 queries as in the real model so the layout is the same."""
        fields = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      image_size=112, llm_hidden_size=64, resampler_heads=4, scale_resolution=56)
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def minicpmo45(cls) -> "VisionConfig":
        return cls()

    @classmethod
    def from_dir(cls, path: str | Path) -> "VisionConfig":
        """Read a MiniCPM-o ``config.json``: ``vision_config``, ``query_num``, ``hidden_size`` (the
        Thinker's), ``drop_vision_last_layer`` (the reference builds the encoder and then drops its
        last layer when true, so the checkpoint then holds one layer fewer)."""
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        raw = json.loads(cfg_path.read_text())
        if "vision_config" not in raw:
            raise KeyError(f"{cfg_path} has no vision_config")
        vis = raw["vision_config"]
        layers = vis.get("num_hidden_layers", 27) - (1 if raw.get("drop_vision_last_layer", False) else 0)
        slice_cfg = raw.get("slice_config") or {}
        return cls(
            hidden_size=vis.get("hidden_size", 1152), intermediate_size=vis.get("intermediate_size", 4304),
            num_hidden_layers=layers, num_attention_heads=vis.get("num_attention_heads", 16),
            num_channels=vis.get("num_channels", 3), image_size=vis.get("image_size", 980),
            patch_size=vis.get("patch_size", 14), layer_norm_eps=vis.get("layer_norm_eps", 1e-6),
            query_num=raw.get("query_num", 64), llm_hidden_size=raw["hidden_size"],
            resampler_heads=raw.get("resampler_heads", raw["hidden_size"] // 128),
            scale_resolution=slice_cfg.get("scale_resolution", 448),
        )

    # --- sizes (no weights needed: admission and the bench use them) ---

    def frame_grid(self, width: int, height: int) -> tuple[int, int]:
        """The (rows, cols) patch grid a ``width`` x ``height`` frame is resized to."""
        w, h = best_resize(width, height, self.scale_resolution, self.patch_size)
        return h // self.patch_size, w // self.patch_size

    def activation_bytes(self, patches: int, dtype: torch.dtype) -> int:
        """Peak activation bytes of one frame of ``patches`` patches through one encoder layer
        (the residual, q/k/v, the attention scores of one layer, the MLP hidden), not counting the
        weights: what a batch adds per frame."""
        item = torch.empty((), dtype=dtype).element_size()
        residual = patches * self.hidden_size
        qkv = 3 * patches * self.hidden_size
        scores = self.num_attention_heads * patches * patches  # eager; SDPA's flash path holds none
        mlp = patches * self.intermediate_size
        return (residual + qkv + scores + mlp) * item


# ----------------------------------------------------------------------------- preprocessing


def _ensure_divide(length: float, patch: int) -> int:
    """Round to the nearest multiple of ``patch`` (at least one patch)."""
    return max(round(length / patch) * patch, patch)


def best_resize(width: int, height: int, scale_resolution: int, patch: int) -> tuple[int, int]:
    """The (width, height) an unsliced frame is resized to: aspect ratio kept, area about
    ``scale_resolution``^2 (up- or down-scaled: the reference's ``allow_upscale=True`` when it
    does not slice), each side rounded to a multiple of ``patch``."""
    if width < 1 or height < 1:
        raise ValueError(f"image size {width}x{height} is empty")
    ratio = width / height
    new_h = int(scale_resolution / math.sqrt(ratio))
    new_w = int(new_h * ratio)
    return _ensure_divide(new_w, patch), _ensure_divide(new_h, patch)


def decode_jpeg(data: bytes, field: str = "image") -> "PILImage.Image":
    """JPEG (or any Pillow-readable image) bytes -> an RGB PIL image, fully decoded.

    Raises ``ValueError`` naming ``field`` and the problem: not bytes, empty, not an image,
    truncated or corrupt, too many pixels. Pillow decodes lazily, so ``load()`` is forced here:
    a truncated JPEG must fail now, not inside the tick that encodes it.
    """
    from PIL import Image, UnidentifiedImageError

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"{field}: expected image bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise ValueError(f"{field}: empty image data")
    try:
        img = Image.open(io.BytesIO(bytes(data)))
    except UnidentifiedImageError as exc:
        raise ValueError(f"{field}: not a decodable image ({len(data)} bytes; expected JPEG)") from exc
    except Image.DecompressionBombError as exc:
        raise ValueError(f"{field}: image too large: {exc}") from exc
    except (OSError, SyntaxError, ValueError) as exc:  # a header cut short
        raise ValueError(f"{field}: corrupt or truncated image data: {exc}") from exc
    width, height = img.size
    if width * height > MAX_FRAME_PIXELS:
        raise ValueError(f"{field}: image too large ({width}x{height} > {MAX_FRAME_PIXELS} pixels)")
    try:
        img.load()
    except (OSError, SyntaxError, ValueError) as exc:  # truncated / corrupt entropy-coded data
        raise ValueError(f"{field}: corrupt or truncated {img.format or 'image'} data: {exc}") from exc
    return img.convert("RGB")


def preprocess_frame(image: "PILImage.Image", cfg: VisionConfig) -> torch.Tensor:
    """An RGB PIL frame -> normalised pixels (3, 14*rows, 14*cols), float32: bicubic resize to
    ``best_resize``, /255, (x - mean) / std (0.5, 0.5: pixels land in [-1, 1])."""
    import numpy as np
    from PIL import Image

    w, h = best_resize(image.width, image.height, cfg.scale_resolution, cfg.patch_size)
    resized = image.convert("RGB").resize((w, h), resample=Image.Resampling.BICUBIC)
    pixels = torch.from_numpy(np.asarray(resized, dtype=np.float32) / 255.0)  # (H, W, 3)
    return ((pixels - cfg.norm_mean) / cfg.norm_std).permute(2, 0, 1).contiguous()  # (3, H, W)


def patchify(pixels: torch.Tensor, patch: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """(3, H, W) with H, W multiples of ``patch`` -> (rows*cols, 3*patch*patch) row-major patches,
    each flattened (channel, y, x) like the Conv2d kernel, and the grid (rows, cols)."""
    c, height, width = pixels.shape
    if height % patch or width % patch or height == 0 or width == 0:
        raise ValueError(f"frame {height}x{width} is not a positive multiple of the {patch}-pixel patch")
    rows, cols = height // patch, width // patch
    x = pixels.reshape(c, rows, patch, cols, patch).permute(1, 3, 0, 2, 4)  # (rows, cols, C, py, px)
    return x.reshape(rows * cols, c * patch * patch), (rows, cols)


# ----------------------------------------------------------------------------- positions


def bucket_coords(n: int, num_buckets: int) -> torch.Tensor:
    """Table row (or column) of each of ``n`` patches along one side: the bucket of 1/num_buckets
    width that the fractional coordinate i/n falls in, with MiniCPM-o's float32 rounding (see the
    module docstring: it differs from Idefics2's at a few sides)."""
    fractional = torch.arange(0, 1 - 1e-6, 1 / n, dtype=torch.float32)  # (n,)
    boundaries = torch.arange(1 / num_buckets, 1.0, 1 / num_buckets, dtype=torch.float32)  # (B-1,)
    return torch.bucketize(fractional, boundaries, right=True)


def navit_position_ids(rows: int, cols: int, num_patches_per_side: int) -> torch.Tensor:
    """Position-table index of each patch of a rows x cols grid, row-major: (rows*cols,)."""
    r = bucket_coords(rows, num_patches_per_side)
    c = bucket_coords(cols, num_patches_per_side)
    return (r[:, None] * num_patches_per_side + c[None, :]).flatten()


def sincos_2d(rows: int, cols: int, dim: int) -> torch.Tensor:
    """The resampler's key positions for a rows x cols grid: (rows*cols, dim), row-major, float32.
    Column sin-cos in the first half, row sin-cos in the second (computed in float64)."""
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)  # (D/4,)
    col = torch.arange(cols, dtype=torch.float64)[:, None] * omega  # (cols, D/4)
    row = torch.arange(rows, dtype=torch.float64)[:, None] * omega  # (rows, D/4)
    col_emb = torch.cat([col.sin(), col.cos()], dim=-1)  # (cols, D/2)
    row_emb = torch.cat([row.sin(), row.cos()], dim=-1)  # (rows, D/2)
    grid = torch.cat([col_emb[None, :, :].expand(rows, cols, -1), row_emb[:, None, :].expand(rows, cols, -1)], -1)
    return grid.reshape(rows * cols, dim).float()


# ----------------------------------------------------------------------------- encoder (vpm)


class VisionEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Kept as a Conv2d so the checkpoint's (D, 3, 14, 14) weight loads as is; applied as a
        # matmul on flattened patches (stride == kernel: the same sum), which packs any grid.
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.num_patches_per_side**2, cfg.hidden_size)

    def forward(self, patches: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """patches (B, L, 3*p*p), position_ids (B, L) -> (B, L, D)."""
        weight = self.patch_embedding.weight.flatten(1)  # (D, 3*p*p), (c, y, x) order
        return F.linear(patches, weight, self.patch_embedding.bias) + self.position_embedding(position_ids)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.q_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """x (B, L, D); key_mask (B, 1, 1, L) bool, True = a real patch (None: all real)."""
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, hd)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)  # (B, H, L, hd)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))  # SigLIP's gelu_pytorch_tanh


class VisionEncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.self_attn = VisionAttention(cfg)
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), key_mask)
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))


class SiglipVisionTransformer(nn.Module):
    """The ``vpm.`` module: embeddings, encoder layers, post_layernorm (its output is what the
    resampler reads: MiniCPM-o takes ``last_hidden_state`` after post_layernorm)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = VisionEmbeddings(cfg)
        self.encoder = VisionEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, patches: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """patches (B, L, 3*p*p) zero-padded, position_ids (B, L), valid (B, L) bool -> (B, L, D);
        rows where ``valid`` is False are padding (finite, meaningless)."""
        # A batch of one grid has no padding: no mask, SDPA's fastest path.
        key_mask = None if bool(valid.all()) else valid[:, None, None, :]  # (B, 1, 1, L)
        x = self.embeddings(patches, position_ids)
        for layer in self.encoder.layers:
            x = layer(x, key_mask)
        return self.post_layernorm(x)


# ----------------------------------------------------------------------------- resampler


class ResamplerAttention(nn.Module):
    """One multi-head cross-attention with ``nn.MultiheadAttention``'s parameter names (the
    checkpoint's ``resampler.attn.in_proj_weight`` stacks q, k, v), batch-first, over SDPA."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * dim))
        self.out_proj = nn.Linear(dim, dim)
        nn.init.xavier_uniform_(self.in_proj_weight)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """q (Q, D) shared by the batch, k/v (B, L, D), key_mask (B, 1, 1, L) -> (B, Q, D)."""
        wq, wk, wv = self.in_proj_weight.chunk(3)
        bq, bk, bv = self.in_proj_bias.chunk(3)
        b, n, d = k.shape
        hd = d // self.num_heads
        qh = F.linear(q, wq, bq).view(1, -1, self.num_heads, hd).transpose(1, 2)  # (1, H, Q, hd)
        kh = F.linear(k, wk, bk).view(b, n, self.num_heads, hd).transpose(1, 2)  # (B, H, L, hd)
        vh = F.linear(v, wv, bv).view(b, n, self.num_heads, hd).transpose(1, 2)  # (B, H, L, hd)
        out = F.scaled_dot_product_attention(qh.expand(b, -1, -1, -1), kh, vh, attn_mask=key_mask)
        return self.out_proj(out.transpose(1, 2).reshape(b, -1, d))  # (B, Q, D)


class Resampler(nn.Module):
    """64 learned queries read a frame's patches once: (B, L, 1152) -> (B, 64, 4096)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.llm_hidden_size
        self.query = nn.Parameter(torch.zeros(cfg.query_num, d))
        self.kv_proj = nn.Linear(cfg.hidden_size, d, bias=False)
        self.attn = ResamplerAttention(d, cfg.resampler_heads)
        self.ln_q = nn.LayerNorm(d, eps=cfg.resampler_eps)
        self.ln_kv = nn.LayerNorm(d, eps=cfg.resampler_eps)
        self.ln_post = nn.LayerNorm(d, eps=cfg.resampler_eps)
        self.proj = nn.Parameter(d**-0.5 * torch.randn(d, d))
        nn.init.normal_(self.query, std=0.02)
        self._pos_cache: dict[tuple[int, int], torch.Tensor] = {}

    def key_positions(self, grid: tuple[int, int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """(rows*cols, D) sin-cos of a grid, cached per grid (a camera sends one size)."""
        table = self._pos_cache.get(grid)
        if table is None or table.device != device:
            table = sincos_2d(grid[0], grid[1], self.query.shape[1]).to(device)
            self._pos_cache[grid] = table
        return table.to(dtype)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int]], valid: torch.Tensor) -> torch.Tensor:
        """x (B, L, Dv) encoder output, grids [(rows, cols)] * B, valid (B, L) -> (B, Q, D)."""
        b, n, _ = x.shape
        pos = torch.zeros(b, n, self.query.shape[1], device=x.device, dtype=x.dtype)  # (B, L, D)
        for i, grid in enumerate(grids):
            pos[i, : grid[0] * grid[1]] = self.key_positions(grid, x.device, x.dtype)
        kv = self.ln_kv(self.kv_proj(x))  # (B, L, D)
        key_mask = None if bool(valid.all()) else valid[:, None, None, :]
        out = self.attn(self.ln_q(self.query), kv + pos, kv, key_mask)  # positions on keys only
        return self.ln_post(out) @ self.proj


# ----------------------------------------------------------------------------- the model


class VisionModel(nn.Module):
    """``vpm`` + ``resampler``: frames (normalised pixels) -> (N, 64, llm_hidden) vision tokens."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vpm = SiglipVisionTransformer(cfg)
        self.resampler = Resampler(cfg)

    def pack(self, frames: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[Grid]]:
        """Frames (3, H_i, W_i) -> zero-padded patches (B, L, 3*p*p), position ids (B, L),
        valid (B, L) bool and the grids, L = the most patches of any frame."""
        if not frames:
            raise ValueError("no frames to encode")
        device = self.vpm.embeddings.patch_embedding.weight.device
        per_frame = [patchify(f, self.cfg.patch_size) for f in frames]
        grids = [g for _, g in per_frame]
        longest = max(p.shape[0] for p, _ in per_frame)
        patches = torch.zeros(len(frames), longest, per_frame[0][0].shape[1], dtype=frames[0].dtype, device=device)
        position_ids = torch.zeros(len(frames), longest, dtype=torch.long, device=device)
        valid = torch.zeros(len(frames), longest, dtype=torch.bool, device=device)
        for i, (p, (rows, cols)) in enumerate(per_frame):
            patches[i, : p.shape[0]] = p
            position_ids[i, : p.shape[0]] = navit_position_ids(rows, cols, self.cfg.num_patches_per_side)
            valid[i, : p.shape[0]] = True
        return patches, position_ids, valid, grids

    def encode_patches(self, frames: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each frame's encoder output (rows*cols, hidden): the ``vpm`` stage alone."""
        patches, position_ids, valid, grids = self.pack(frames)
        hidden = self.vpm(patches.to(self.dtype), position_ids, valid)
        return [hidden[i, : r * c] for i, (r, c) in enumerate(grids)]

    def forward(self, frames: list[torch.Tensor]) -> torch.Tensor:
        """Frames of any sizes, batched -> (N, query_num, llm_hidden)."""
        patches, position_ids, valid, grids = self.pack(frames)
        hidden = self.vpm(patches.to(self.dtype), position_ids, valid)  # (B, L, hidden)
        return self.resampler(hidden, grids, valid)

    @property
    def dtype(self) -> torch.dtype:
        return self.vpm.embeddings.patch_embedding.weight.dtype

    def encode_jpegs(self, jpegs: list[bytes]) -> torch.Tensor:
        """JPEG bytes -> (N, query_num, llm_hidden); a bad image raises ValueError naming it."""
        frames = [preprocess_frame(decode_jpeg(data, f"frame {i}"), self.cfg) for i, data in enumerate(jpegs)]
        return self(frames)

    @classmethod
    def from_pretrained(cls, path: str | Path, cfg: VisionConfig | None = None,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> "VisionModel":
        """Load ``vpm.`` and ``resampler.`` of a MiniCPM-o checkpoint directory, strictly."""
        from duplexcache.models import checkpoint

        cfg = cfg or VisionConfig.from_dir(path)
        model = cls(cfg)
        checkpoint.load_strict(model.vpm, checkpoint.load_state_dict(path, VPM_PREFIX), "vision encoder (vpm)")
        checkpoint.load_strict(model.resampler, checkpoint.load_state_dict(path, RESAMPLER_PREFIX), "resampler")
        return model.to(device=device, dtype=dtype)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_dict().values())


VPM_PREFIX = "vpm."
RESAMPLER_PREFIX = "resampler."


# ----------------------------------------------------------------------------- Thinker layout

IMAGE_START_TOKEN = "<image>"
IMAGE_END_TOKEN = "</image>"
SLICE_START_TOKEN = "<slice>"
SLICE_END_TOKEN = "</slice>"
# The id written at vision positions of token_ids (the processor's placeholder; the 64 resampler
# rows replace its embeddings), as ``<|audio|>`` is for audio positions.
IMAGE_FILLER_TOKEN = "<unk>"


def frame_token_ids(tokenizer: "Tokenizer", query_num: int = 64, num_slices: int = 0) -> list[int]:
    """The ids a frame occupies in the Thinker's input: ``<image>`` + ``query_num`` fillers +
    ``</image>``, then per slice ``<slice>`` + fillers + ``</slice>`` (duplex frames: no slices,
    66 positions)."""
    filler = tokenizer.token_id(IMAGE_FILLER_TOKEN)
    ids = [tokenizer.token_id(IMAGE_START_TOKEN), *[filler] * query_num, tokenizer.token_id(IMAGE_END_TOKEN)]
    for _ in range(num_slices):
        ids += [tokenizer.token_id(SLICE_START_TOKEN), *[filler] * query_num, tokenizer.token_id(SLICE_END_TOKEN)]
    return ids


def unit_input_ids(tokenizer: "Tokenizer", audio_tokens: int, *, frame: bool, close_previous: bool = True,
                   query_num: int = 64) -> tuple[list[int], slice | None, slice]:
    """A unit's appended ids, ``[</unit>] <unit> [frame] <|audio|> * audio_tokens``, and where
    the vision rows and the audio rows go in it (the positions whose embeddings are replaced).
    The frame sits between ``<unit>`` and the audio, as the reference's ``streaming_prefill``
    feeds it; the decision token (listen / speak) follows the audio."""
    ids = [tokenizer.token_id("</unit>")] if close_previous else []
    ids.append(tokenizer.token_id("<unit>"))
    vision = None
    if frame:
        start = len(ids) + 1  # after <image>
        ids += frame_token_ids(tokenizer, query_num)
        vision = slice(start, start + query_num)
    audio = slice(len(ids), len(ids) + audio_tokens)
    ids += [tokenizer.token_id("<|audio|>")] * audio_tokens
    return ids, vision, audio
