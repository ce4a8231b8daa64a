"""``duplexcache verify talker``: this project's Talker against transformers' LlamaModel.

Both load the same checkpoint (a MiniCPM-o dir, Talker under ``tts.`` with ``tts_config``, or a
random one saved to a temp dir with ``--preset NAME --random-weights``, whose backbone is a
transformers LlamaModel). Compared, as max|ours - ref| / max|ref|:

* ``dense``: final hidden states of ragged sessions vs LlamaModel's uncached forward;
* ``logits``: code logits vs the weight-normed head written out by hand (g * v / ||v||);
* ``paged prefill`` / ``paged decode``: the same sessions through the paged KV pool over
  shuffled, non-contiguous blocks, then one-token decode steps, vs LlamaModel.

Exit codes: 0 all within tolerance, 1 one above, 2 the checkpoint cannot be loaded.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from duplexcache.kv.paged_attention import PagedBatch, PagedKVCache
from duplexcache.models.checkpoint import CheckpointError, checkpoint_keys, load_state_dict
from duplexcache.models.talker import Talker, TalkerConfig
from duplexcache.verify.common import (
    FLOAT32_TOLERANCE, add_source_arguments, exit_unusable, missing_reference, relative_error, report,
    run_on_source, source_error,
)

TARGET = "talker"
# reference module -> the pip requirement providing it (checked before anything runs)
REFERENCE_PACKAGES = {"transformers": "transformers>=4.51"}
PRESETS: dict[str, Callable[[], TalkerConfig]] = {"tiny": TalkerConfig.tiny, "minicpmo45": TalkerConfig.minicpmo45}
TOLERANCE = FLOAT32_TOLERANCE
_LENGTHS = (5, 17, 33)

# Test-only hook: called with the loaded Talker before comparing (to prove the check can fail).
_post_load_hook: Callable[[Talker], None] | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser, PRESETS, checkpoint_help="MiniCPM-o checkpoint directory (Talker under tts.)")
    parser.add_argument("--decode-steps", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)


def run(args: argparse.Namespace) -> int:
    missing = missing_reference(TARGET, REFERENCE_PACKAGES)
    if missing is not None:
        return missing
    problem = source_error(args)
    if problem is None and (args.decode_steps < 0 or args.block_size < 1):
        problem = "--decode-steps must be >= 0 and --block-size >= 1"
    if problem:
        return exit_unusable(TARGET, problem)
    return run_on_source(TARGET, args, PRESETS, save_random_checkpoint, lambda path: _verify_dir(path, args))


def _verify_dir(path: str, args: argparse.Namespace) -> int:
    try:
        ours = Talker.from_pretrained(path).eval()
        ref = load_reference(path, ours.config)
    except (CheckpointError, ValueError, OSError, KeyError) as exc:
        return exit_unusable(TARGET, f"cannot load {path}: {exc}")
    if _post_load_hook is not None:
        _post_load_hook(ours)
    errors = compare(ours, ref, args.block_size, args.decode_steps, args.seed)
    return report(TARGET, path, errors, TOLERANCE, f"{TOLERANCE:g}, float32")


def save_random_checkpoint(cfg: TalkerConfig, path: str | Path, seed: int = 0) -> None:
    """A MiniCPM-o-style dir: transformers' LlamaModel under ``tts.model.`` plus random heads,
    embeddings and projectors under their MiniCPMTTS names. Norm weights are randomised too."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    state = {}
    with torch.no_grad():
        for name, t in LlamaModel(LlamaConfig(**cfg.to_llama_dict())).state_dict().items():
            t.copy_(1.0 + 0.1 * torch.randn_like(t) if "norm" in name else 0.05 * torch.randn_like(t))
            state[f"tts.model.{name}"] = t.contiguous()
    h, llm = cfg.hidden_size, cfg.llm_dim
    shapes = {"emb_text.weight": (cfg.num_text_tokens, h), "emb_code.0.weight": (cfg.num_audio_tokens, h),
              "head_code.0.parametrizations.weight.original0": (cfg.num_audio_tokens, 1),
              "head_code.0.parametrizations.weight.original1": (cfg.num_audio_tokens, h)}
    for proj in ("projector_spk", "projector_semantic"):
        shapes.update({f"{proj}.linear1.weight": (h, llm), f"{proj}.linear1.bias": (h,),
                       f"{proj}.linear2.weight": (h, h), f"{proj}.linear2.bias": (h,)})
    for name, shape in shapes.items():
        state[f"tts.{name}"] = 0.05 * torch.randn(shape)
    Path(path).mkdir(parents=True, exist_ok=True)
    save_file(state, str(Path(path) / "model.safetensors"))
    tts = {k: getattr(cfg, k) for k in TalkerConfig.__dataclass_fields__}
    (Path(path) / "config.json").write_text(json.dumps({"tts_config": {**tts, "num_vq": 1}}, indent=2))


def load_reference(path: str | Path, cfg: TalkerConfig):
    """transformers' LlamaModel holding the checkpoint's backbone weights (strict)."""
    from transformers import LlamaConfig, LlamaModel

    prefix = "tts.model." if "tts.emb_code.0.weight" in set(checkpoint_keys(path)) else "model."
    ref = LlamaModel(LlamaConfig(**cfg.to_llama_dict())).eval()
    ref.load_state_dict(load_state_dict(path, prefix), strict=True)
    return ref


def reference_logits(ours: Talker, hidden: torch.Tensor) -> torch.Tensor:
    sd = ours.head_code[0].state_dict()
    g, v = sd["parametrizations.weight.original0"], sd["parametrizations.weight.original1"]
    return hidden @ (g * v / v.norm(dim=1, keepdim=True)).T


@torch.no_grad()
def compare(ours: Talker, ref, block_size: int, decode_steps: int, seed: int) -> dict[str, float]:
    cfg = ours.config
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randn(n, cfg.hidden_size, generator=gen) for n in _LENGTHS]

    def ref_hidden(x: torch.Tensor) -> torch.Tensor:
        return ref(inputs_embeds=x[None]).last_hidden_state[0]

    refs = [ref_hidden(s) for s in seqs]
    dense = [ours.forward_dense(s[None])[0] for s in seqs]
    errors = {"dense": max(relative_error(a, b) for a, b in zip(dense, refs)),
              "logits": max(relative_error(ours.code_logits(a), reference_logits(ours, b))
                            for a, b in zip(dense, refs))}
    need = [-(-(n + decode_steps) // block_size) for n in _LENGTHS]
    ids = (torch.randperm(sum(need), generator=gen) + 1).tolist()
    tables = [[ids.pop() for _ in range(k)] for k in need]
    cache = PagedKVCache(cfg.num_hidden_layers, sum(need) + 1, block_size, cfg.num_key_value_heads, cfg.head_dim)
    batch = PagedBatch.build(tables, [0] * 3, list(_LENGTHS), None, block_size, "cpu")
    hidden = ours.forward_paged(torch.cat(seqs), batch, cache)
    errors["paged prefill"] = relative_error(hidden, torch.cat(refs))
    if decode_steps:
        errors["paged decode"] = 0.0
    for _ in range(decode_steps):
        new = torch.randn(3, cfg.hidden_size, generator=gen)
        computed = [s.shape[0] for s in seqs]
        seqs = [torch.cat([s, new[i:i + 1]]) for i, s in enumerate(seqs)]
        batch = PagedBatch.build(tables, computed, [1] * 3, None, block_size, "cpu")
        got = ours.forward_paged(new, batch, cache)
        want = torch.stack([ref_hidden(s)[-1] for s in seqs])
        errors["paged decode"] = max(errors["paged decode"], relative_error(got, want))
    return errors
