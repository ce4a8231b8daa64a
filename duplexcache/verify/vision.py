"""``duplexcache verify vision``: the SigLIP NaViT encoder and the resampler against references.

Both sides load the same checkpoint (a MiniCPM-o dir with ``vpm.`` + ``resampler.``, or random
weights of ``--preset NAME --random-weights`` saved to a temp dir with the real names). The frames
are random pixels in [-1, 1] (what preprocessing yields) at the patch grids of common camera
sizes after the reference's resize (640x480, 480x640, 1280x720, square; tiny adds a grid longer
than its 8-patch position table). Compared, as max|ours - ref| / max|ref|:

* ``encoder``: each frame alone, ``vpm`` vs transformers' ``Idefics2VisionTransformer`` (the NaViT
  SigLIP transformers ships: the same layers and names, bucketed positions, patch masks), loaded
  strictly from the checkpoint's ``vpm.`` weights;
* ``encoder-batched``: all frames in one batch, ours (packed patch rows, key-padding mask) vs
  Idefics2 on its own padded batch (images zero-padded to the largest, a 2D patch mask), each
  frame's real patches;
* ``resampler``: ours on our encoder output vs ``reference_resampler`` on the same input;
* ``frame-tokens``: the whole path, our batched ``VisionModel(frames)`` vs Idefics2 then
  ``reference_resampler``, frame by frame.

``reference_resampler`` is written here from MiniCPM-o's published design (``Resampler`` of
``modeling_minicpmo.py``; no package ships it): one frame at a time, float64, plain matmuls, an
explicit softmax, a loop over heads, layer norms written out, the 2D sin-cos built from its
definition. It shares no code with ``duplexcache/models/vision.py``.

The verify grids avoid the sides where MiniCPM-o's position bucketing and Idefics2's differ
(``IDEFICS2_BUCKETING_DIFFERS``; none on the tiny table): there the reference is not the model.

Tolerance: ``FLOAT32_TOLERANCE`` (1e-5), float32 (``--device cuda``: TF32 off for the run).
Exit codes: 0 all within tolerance, 1 one above, 2 the checkpoint cannot be loaded.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

from duplexcache.models.checkpoint import CheckpointError, load_state_dict
from duplexcache.models.vision import (
    IDEFICS2_BUCKETING_DIFFERS, RESAMPLER_PREFIX, VPM_PREFIX, VisionConfig, VisionModel,
)
from duplexcache.verify.common import (
    FLOAT32_TOLERANCE, add_source_arguments, exit_unusable, missing_reference, relative_error, report,
    run_on_source, source_error,
)

TARGET = "vision"
REFERENCE_PACKAGES = {"transformers": "transformers>=4.51"}
PRESETS: dict[str, Callable[[], VisionConfig]] = {"tiny": VisionConfig.tiny, "minicpmo45": VisionConfig.minicpmo45}
TOLERANCE = FLOAT32_TOLERANCE
CAMERA_SIZES = ((640, 480), (480, 640), (1280, 720), (512, 512))  # (width, height)

# Test-only hook: called with the loaded model before comparing (to prove the check can fail).
_post_load_hook: Callable[[VisionModel], None] | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser, PRESETS, checkpoint_help="MiniCPM-o checkpoint directory (vpm. + resampler.)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (float32 either way; TF32 off)")


def run(args: argparse.Namespace) -> int:
    missing = missing_reference(TARGET, REFERENCE_PACKAGES)
    if missing is not None:
        return missing
    problem = source_error(args)
    if problem is None and args.device.startswith("cuda") and not torch.cuda.is_available():
        problem = f"--device {args.device}: CUDA is not available here"
    if problem:
        return exit_unusable(TARGET, problem)
    return run_on_source(TARGET, args, PRESETS, save_random_checkpoint, lambda path: _verify_dir(path, args))


def _verify_dir(path: str, args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    try:
        ours = VisionModel.from_pretrained(path, device=device).eval()
        ref = load_reference(path, ours.cfg).to(device)
        ref_resampler_sd = {k: v.to(device) for k, v in load_state_dict(path, RESAMPLER_PREFIX).items()}
    except (CheckpointError, ValueError, OSError, KeyError) as exc:
        return exit_unusable(TARGET, f"cannot load {path}: {exc}")
    if _post_load_hook is not None:
        _post_load_hook(ours)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        errors = compare(ours, ref, ref_resampler_sd, args.seed)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    grids = " ".join(f"{r}x{c}" for r, c in verify_grids(ours.cfg))
    return report(TARGET, f"{path} (grids {grids}, {device})", errors, TOLERANCE, f"{TOLERANCE:g}, float32")


# ----------------------------------------------------------------------------- weights


def _idefics2_config(cfg: VisionConfig):
    from transformers.models.idefics2.configuration_idefics2 import Idefics2VisionConfig

    hf = Idefics2VisionConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                              num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                              num_channels=cfg.num_channels, image_size=cfg.image_size, patch_size=cfg.patch_size,
                              layer_norm_eps=cfg.layer_norm_eps, hidden_act="gelu_pytorch_tanh")
    hf._attn_implementation = "eager"  # the plain softmax(QK^T)V path
    return hf


def save_random_checkpoint(cfg: VisionConfig, path: str | Path, seed: int = 0) -> None:
    """A MiniCPM-o-style dir: transformers' Idefics2 vision tower's tensors under ``vpm.`` and a
    resampler's under ``resampler.``, every tensor redrawn from a seeded normal (norm weights
    around 1), plus a ``config.json`` that ``VisionConfig.from_dir`` reads back."""
    from safetensors.torch import save_file
    from transformers.models.idefics2.modeling_idefics2 import Idefics2VisionTransformer

    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):  # names and shapes only: nothing of the reference's init is kept
        tower = Idefics2VisionTransformer(_idefics2_config(cfg))
    d, dv = cfg.llm_hidden_size, cfg.hidden_size
    shapes = {f"{VPM_PREFIX}{k}": tuple(t.shape) for k, t in tower.state_dict().items()}
    shapes.update({f"{RESAMPLER_PREFIX}{k}": s for k, s in {
        "query": (cfg.query_num, d), "kv_proj.weight": (d, dv), "attn.in_proj_weight": (3 * d, d),
        "attn.in_proj_bias": (3 * d,), "attn.out_proj.weight": (d, d), "attn.out_proj.bias": (d,),
        "ln_q.weight": (d,), "ln_q.bias": (d,), "ln_kv.weight": (d,), "ln_kv.bias": (d,),
        "ln_post.weight": (d,), "ln_post.bias": (d,), "proj": (d, d)}.items()})
    state = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=gen)
        if "norm" in name or ".ln_" in name:
            state[name] = 1.0 + 0.1 * noise if name.endswith("weight") else 0.1 * noise
        elif len(shape) >= 2 and "position_embedding" not in name and not name.endswith("query"):
            fan_in = math.prod(shape[1:])
            state[name] = noise / math.sqrt(fan_in)  # unit-scale activations at any width
        else:
            state[name] = 0.5 * noise  # biases, the position table, the queries
    Path(path).mkdir(parents=True, exist_ok=True)
    save_file(state, str(Path(path) / "model.safetensors"))
    config = {
        "hidden_size": d, "query_num": cfg.query_num, "drop_vision_last_layer": False,
        "vision_config": {"hidden_size": dv, "intermediate_size": cfg.intermediate_size,
                          "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
                          "image_size": cfg.image_size, "patch_size": cfg.patch_size, "model_type": "siglip",
                          "layer_norm_eps": cfg.layer_norm_eps},
        "slice_config": {"max_slice_nums": 1, "scale_resolution": cfg.scale_resolution, "patch_size": cfg.patch_size},
        # not in MiniCPM-o's config (it uses hidden_size // 128); the tiny preset needs its own
        "resampler_heads": cfg.resampler_heads,
    }
    (Path(path) / "config.json").write_text(json.dumps(config, indent=2))


def load_reference(path: str | Path, cfg: VisionConfig):
    """transformers' Idefics2VisionTransformer holding the checkpoint's ``vpm.`` weights (strict)."""
    from transformers.models.idefics2.modeling_idefics2 import Idefics2VisionTransformer

    ref = Idefics2VisionTransformer(_idefics2_config(cfg)).eval()
    ref.load_state_dict(load_state_dict(path, VPM_PREFIX), strict=True)
    return ref


# ----------------------------------------------------------------------------- the reference resampler


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def _sincos_1d(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """(n,) positions -> (n, dim): [sin(p * w_0..), cos(p * w_0..)], w_k = 1 / 10000^(2k / dim)."""
    k = torch.arange(dim // 2, dtype=torch.float64, device=positions.device)
    w = 1.0 / torch.pow(torch.tensor(10000.0, dtype=torch.float64), 2.0 * k / dim)
    angles = positions[:, None].double() * w[None, :]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


def reference_key_positions(rows: int, cols: int, dim: int, device: torch.device) -> torch.Tensor:
    """MiniCPM-o's ``get_2d_sincos_pos_embed`` by its definition: a grid from ``meshgrid(w, h)``
    (so channel block 0 holds the column), half the width each: (rows*cols, dim), row-major."""
    out = torch.empty(rows * cols, dim, dtype=torch.float64, device=device)
    for r in range(rows):
        cols_pos = torch.arange(cols, device=device)
        out[r * cols:(r + 1) * cols, : dim // 2] = _sincos_1d(cols_pos, dim // 2)
        out[r * cols:(r + 1) * cols, dim // 2:] = _sincos_1d(torch.full((cols,), r, device=device), dim // 2)
    return out


@torch.no_grad()
def reference_resampler(sd: dict[str, torch.Tensor], hidden: torch.Tensor, grid: tuple[int, int],
                        num_heads: int, eps: float) -> torch.Tensor:
    """One frame's encoder output (rows*cols, Dv) -> (query_num, D), float64, unbatched:

    kv = LN_kv(hidden @ W_kv^T); keys = kv + pos; values = kv; q = LN_q(query);
    per head h: softmax((q W_q,h + b) (keys W_k,h + b)^T / sqrt(d_h)) (values W_v,h + b);
    heads concatenated @ W_out^T + b_out; LN_post; @ proj.
    """
    p = {k: v.double() for k, v in sd.items()}
    x = hidden.double()
    d = p["query"].shape[1]
    kv = _layer_norm(x @ p["kv_proj.weight"].T, p["ln_kv.weight"], p["ln_kv.bias"], eps)  # (L, D)
    keys = kv + reference_key_positions(grid[0], grid[1], d, x.device)  # (L, D)
    q = _layer_norm(p["query"], p["ln_q.weight"], p["ln_q.bias"], eps)  # (Q, D)
    w_q, w_k, w_v = p["attn.in_proj_weight"][:d], p["attn.in_proj_weight"][d:2 * d], p["attn.in_proj_weight"][2 * d:]
    b_q, b_k, b_v = p["attn.in_proj_bias"][:d], p["attn.in_proj_bias"][d:2 * d], p["attn.in_proj_bias"][2 * d:]
    hd = d // num_heads
    heads = []
    for h in range(num_heads):
        cols = slice(h * hd, (h + 1) * hd)
        qh = q @ w_q[cols].T + b_q[cols]  # (Q, hd)
        kh = keys @ w_k[cols].T + b_k[cols]  # (L, hd)
        vh = kv @ w_v[cols].T + b_v[cols]  # (L, hd)
        scores = qh @ kh.T / math.sqrt(hd)  # (Q, L)
        weights = torch.exp(scores - scores.max(dim=1, keepdim=True).values)
        weights = weights / weights.sum(dim=1, keepdim=True)
        heads.append(weights @ vh)  # (Q, hd)
    out = torch.cat(heads, dim=1) @ p["attn.out_proj.weight"].T + p["attn.out_proj.bias"]  # (Q, D)
    return _layer_norm(out, p["ln_post.weight"], p["ln_post.bias"], eps) @ p["proj"]


# ----------------------------------------------------------------------------- comparison


def verify_grids(cfg: VisionConfig) -> list[tuple[int, int]]:
    """The (rows, cols) grids compared: camera sizes after resize, tiny also one past its table."""
    grids = list(dict.fromkeys(cfg.frame_grid(w, h) for w, h in CAMERA_SIZES))
    if cfg.num_patches_per_side <= 16:
        grids.append((2, cfg.num_patches_per_side + 2))
    bad = [g for g in grids if cfg.num_patches_per_side == 70 and set(g) & set(IDEFICS2_BUCKETING_DIFFERS)]
    if bad:
        raise ValueError(f"verify grids {bad} hit a side where Idefics2's bucketing differs")
    return grids


def _idefics2_batch(frames: list[torch.Tensor], patch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Idefics2's own NaViT batch: images zero-padded bottom/right to the largest, (B, rows, cols) mask."""
    max_h = max(f.shape[1] for f in frames)
    max_w = max(f.shape[2] for f in frames)
    pixels = torch.zeros(len(frames), 3, max_h, max_w, device=frames[0].device)
    mask = torch.zeros(len(frames), max_h // patch, max_w // patch, dtype=torch.bool, device=frames[0].device)
    for i, f in enumerate(frames):
        pixels[i, :, : f.shape[1], : f.shape[2]] = f
        mask[i, : f.shape[1] // patch, : f.shape[2] // patch] = True
    return pixels, mask


@torch.no_grad()
def compare(ours: VisionModel, ref, resampler_sd: dict[str, torch.Tensor], seed: int) -> dict[str, float]:
    """``resampler_sd``: the checkpoint's ``resampler.`` tensors, read by the reference directly
    (not from our module, so a weight our loading got wrong shows)."""
    cfg = ours.cfg
    device = ours.vpm.embeddings.patch_embedding.weight.device
    gen = torch.Generator().manual_seed(seed)
    grids = verify_grids(cfg)
    p = cfg.patch_size
    frames = [(torch.rand(3, r * p, c * p, generator=gen) * 2 - 1).to(device) for r, c in grids]

    ref_alone = [ref(f[None]).last_hidden_state[0] for f in frames]  # (rows*cols, Dv) each
    ours_alone = [ours.encode_patches([f])[0] for f in frames]
    errors = {"encoder": max(relative_error(a, b) for a, b in zip(ours_alone, ref_alone))}

    pixels, mask = _idefics2_batch(frames, p)
    ref_batched = ref(pixels, patch_attention_mask=mask).last_hidden_state  # (B, R*C, Dv)
    max_cols = mask.shape[2]
    ref_rows = [ref_batched[i].view(-1, max_cols, cfg.hidden_size)[:r, :c].reshape(r * c, -1)
                for i, (r, c) in enumerate(grids)]
    ours_batched = ours.encode_patches(frames)
    errors["encoder-batched"] = max(relative_error(a, b) for a, b in zip(ours_batched, ref_rows))

    sd = resampler_sd
    ref_tokens_ours_in = [reference_resampler(sd, h, g, cfg.resampler_heads, cfg.resampler_eps)
                          for h, g in zip(ours_alone, grids)]
    ours_tokens_ours_in = [ours.resampler(h[None], [g], torch.ones(1, h.shape[0], dtype=torch.bool, device=device))[0]
                           for h, g in zip(ours_alone, grids)]
    errors["resampler"] = max(relative_error(a, b) for a, b in zip(ours_tokens_ours_in, ref_tokens_ours_in))

    ours_tokens = ours(frames)  # (B, Q, D), one batch of mixed grids
    ref_tokens = [reference_resampler(sd, h, g, cfg.resampler_heads, cfg.resampler_eps)
                  for h, g in zip(ref_alone, grids)]
    errors["frame-tokens"] = max(relative_error(ours_tokens[i], t) for i, t in enumerate(ref_tokens))
    return errors
