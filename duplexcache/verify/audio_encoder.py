"""``duplexcache verify audio-encoder``: this project's audio encoder against transformers' WhisperEncoder.

Both load the same checkpoint (a Whisper dir, a MiniCPM-o dir with ``apm.`` +
``audio_projection_layer.``, or a random one saved to a temp dir with ``--preset NAME
--random-weights``). Compared, as max|ours - ref| / max|ref|:

* ``encoder``: a whole clip of 2 * max_source_positions mel frames vs ``WhisperEncoder``;
* ``projection``: Linear-ReLU-Linear + AvgPool on top, vs the same math written out by hand;
* ``streaming``: ``--chunks`` chunks through the streaming cache (crossing a reset when the
  cache is short enough) vs a dense block-causal pass through transformers' layers.

Exit codes: 0 all within tolerance, 1 one above, 2 the checkpoint cannot be loaded.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from duplexcache.models.audio_encoder import AudioEncoder, AudioEncoderConfig
from duplexcache.models.checkpoint import CheckpointError, checkpoint_keys, load_state_dict
from duplexcache.verify.common import (
    FLOAT32_TOLERANCE, add_source_arguments, exit_unusable, missing_reference, relative_error, report,
    run_on_source, source_error,
)

TARGET = "audio-encoder"
# reference module -> the pip requirement providing it (checked before anything runs)
REFERENCE_PACKAGES = {"transformers": "transformers>=4.51"}
PRESETS: dict[str, Callable[[], AudioEncoderConfig]] = {
    "tiny": AudioEncoderConfig.tiny, "minicpmo45": AudioEncoderConfig.minicpmo45}
TOLERANCE = FLOAT32_TOLERANCE

# Test-only hook: called with the loaded encoder before comparing (to prove the check can fail).
_post_load_hook: Callable[[AudioEncoder], None] | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser, PRESETS, checkpoint_help="Whisper or MiniCPM-o checkpoint directory")
    parser.add_argument("--chunks", type=int, default=4, help="streaming chunks (1 s each after the first)")


def run(args: argparse.Namespace) -> int:
    missing = missing_reference(TARGET, REFERENCE_PACKAGES)
    if missing is not None:
        return missing
    problem = source_error(args)
    if problem is None and args.chunks < 1:
        problem = "--chunks must be >= 1"
    if problem:
        return exit_unusable(TARGET, problem)
    return run_on_source(TARGET, args, PRESETS, save_random_checkpoint, lambda path: _verify_dir(path, args))


def _verify_dir(path: str, args: argparse.Namespace) -> int:
    try:
        ours = AudioEncoder.from_pretrained(path).eval()
        ref = load_reference(path, ours.cfg)
    except (CheckpointError, ValueError, OSError, KeyError) as exc:
        return exit_unusable(TARGET, f"cannot load {path}: {exc}")
    if _post_load_hook is not None:
        _post_load_hook(ours)
    errors = compare(ours, ref, args.chunks, args.seed)
    return report(TARGET, path, errors, TOLERANCE, f"{TOLERANCE:g}, float32")


def _whisper_config(cfg: AudioEncoderConfig):
    from transformers import WhisperConfig

    return WhisperConfig(d_model=cfg.d_model, encoder_layers=cfg.encoder_layers,
                         encoder_attention_heads=cfg.encoder_attention_heads, encoder_ffn_dim=cfg.encoder_ffn_dim,
                         max_source_positions=cfg.max_source_positions, num_mel_bins=cfg.num_mel_bins)


def save_random_checkpoint(cfg: AudioEncoderConfig, path: str | Path, seed: int = 0) -> None:
    """A MiniCPM-o-style dir: transformers' WhisperEncoder under ``apm.`` + a random projection."""
    from safetensors.torch import save_file
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    torch.manual_seed(seed)
    hf_cfg = _whisper_config(cfg)
    enc = WhisperEncoder(hf_cfg)
    state = {}
    with torch.no_grad():
        for name, t in enc.state_dict().items():
            if "embed_positions" not in name:  # keep the sinusoid table; randomise the rest, norms too
                t.copy_(1.0 + 0.1 * torch.randn_like(t) if "layer_norm" in name and name.endswith("weight")
                        else 0.05 * torch.randn_like(t))
            state[f"apm.{name}"] = t.contiguous()
    shapes = {"linear1.weight": (cfg.out_dim, cfg.d_model), "linear1.bias": (cfg.out_dim,),
              "linear2.weight": (cfg.out_dim, cfg.out_dim), "linear2.bias": (cfg.out_dim,)}
    for name, shape in shapes.items():
        state[f"audio_projection_layer.{name}"] = 0.05 * torch.randn(shape)
    Path(path).mkdir(parents=True, exist_ok=True)
    save_file(state, str(Path(path) / "model.safetensors"))
    config = {"audio_config": hf_cfg.to_dict(), "hidden_size": cfg.out_dim, "audio_pool_step": cfg.pool_step}
    (Path(path) / "config.json").write_text(json.dumps(config, indent=2))


def load_reference(path: str | Path, cfg: AudioEncoderConfig):
    """transformers' WhisperEncoder holding the checkpoint's encoder weights (strict)."""
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    keys = set(checkpoint_keys(path))
    prefix = next(p for p in ("apm.", "model.encoder.", "encoder.", "") if f"{p}conv1.weight" in keys)
    ref = WhisperEncoder(_whisper_config(cfg)).eval()
    ref.load_state_dict(load_state_dict(path, prefix or None) if prefix else load_state_dict(path), strict=True)
    return ref


def reference_projection(ours: AudioEncoder, frames: torch.Tensor) -> torch.Tensor:
    sd, pool = ours.audio_projection_layer.state_dict(), ours.cfg.pool_step
    x = F.linear(F.relu(F.linear(frames, sd["linear1.weight"], sd["linear1.bias"])),
                 sd["linear2.weight"], sd["linear2.bias"])
    n = x.shape[0] // pool
    return x[: n * pool].reshape(n, pool, x.shape[-1]).mean(dim=1)


@torch.no_grad()
def reference_stream(ours: AudioEncoder, ref, mels: list[torch.Tensor]) -> list[torch.Tensor]:
    """The streaming semantics as one dense pass per chunk: the segment since the last reset,
    positions from 0, a block-causal chunk mask, transformers' layers."""
    outs, segment = [], []
    for mel in mels:
        front = F.gelu(ref.conv2(F.gelu(ref.conv1(mel[None]))))[0].T
        if sum(s.shape[0] for s in segment) + front.shape[0] > ours.cfg.max_cache_frames:
            segment = []
        segment.append(front)
        chunk_id = torch.cat([torch.full((s.shape[0],), i) for i, s in enumerate(segment)])
        allowed = chunk_id[None, :] <= chunk_id[:, None]
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
        x = torch.cat(segment)
        x = (x + ref.embed_positions.weight[: x.shape[0]])[None]
        for layer in ref.layers:
            x = layer(x, mask)
        outs.append(reference_projection(ours, ref.layer_norm(x)[0, -front.shape[0]:]))
    return outs


@torch.no_grad()
def compare(ours: AudioEncoder, ref, num_chunks: int, seed: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(seed)
    cfg = ours.cfg
    mel = torch.randn(1, cfg.num_mel_bins, 2 * cfg.max_source_positions, generator=gen)
    ref_frames = ref(mel).last_hidden_state
    errors = {"encoder": relative_error(ours.apm(mel), ref_frames),
              "projection": relative_error(ours.encode_mel(mel)[0], reference_projection(ours, ref_frames[0]))}
    mels = [torch.randn(cfg.num_mel_bins, 103 if i == 0 else 100, generator=gen) for i in range(num_chunks)]
    state = ours.new_stream_state()
    got = [ours.stream_step_mel([state], [m])[0] for m in mels]
    errors["streaming"] = max(relative_error(a, b) for a, b in zip(got, reference_stream(ours, ref, mels)))
    return errors
