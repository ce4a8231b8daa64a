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
import tempfile
from pathlib import Path
from typing import Callable

import torch

from duplexcache.kv.paged_attention import PagedBatch, PagedKVCache
from duplexcache.models.checkpoint import CheckpointError, checkpoint_keys, load_state_dict
from duplexcache.models.talker import Talker, TalkerConfig

PRESETS: dict[str, Callable[[], TalkerConfig]] = {"tiny": TalkerConfig.tiny, "minicpmo45": TalkerConfig.minicpmo45}
TOLERANCE = 1e-5  # float32 fidelity rule
_LENGTHS = (5, 17, 33)

# Test-only hook: called with the loaded Talker before comparing (to prove the check can fail).
_post_load_hook: Callable[[Talker], None] | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="MiniCPM-o checkpoint directory (Talker under tts.)")
    source.add_argument("--preset", choices=sorted(PRESETS), help="build a model of this shape (with --random-weights)")
    parser.add_argument("--random-weights", action="store_true", help="random weights saved to a temp dir")
    parser.add_argument("--decode-steps", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    if (args.preset is not None) != bool(args.random_weights):
        print("verify talker: --preset and --random-weights go together")
        return 2
    if args.decode_steps < 0 or args.block_size < 1:
        print("verify talker: --decode-steps must be >= 0 and --block-size >= 1")
        return 2
    if args.random_weights:
        with tempfile.TemporaryDirectory(prefix="duplexcache-talker-") as tmp:
            save_random_checkpoint(PRESETS[args.preset](), tmp, seed=args.seed)
            return _verify_dir(tmp, args)
    return _verify_dir(args.checkpoint, args)


def _verify_dir(path: str, args: argparse.Namespace) -> int:
    try:
        ours = Talker.from_pretrained(path).eval()
        ref = load_reference(path, ours.config)
    except (CheckpointError, ValueError, OSError, KeyError) as exc:
        print(f"verify talker: cannot load {path}: {exc}")
        return 2
    if _post_load_hook is not None:
        _post_load_hook(ours)
    errors = compare(ours, ref, args.block_size, args.decode_steps, args.seed)
    print(f"verify talker: {path}; relative error = max|ours - ref| / max|ref|")
    for name, err in errors.items():
        print(f"  {name:<14} {err:.3e}  {'ok' if err <= TOLERANCE else 'FAIL'}")
    passed = all(err <= TOLERANCE for err in errors.values())
    print(f"verify talker: {'PASS' if passed else 'FAIL'} (tolerance {TOLERANCE:g}, float32)")
    return 0 if passed else 1


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


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.double(), ref.double()
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


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
