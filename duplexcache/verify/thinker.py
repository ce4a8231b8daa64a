"""``duplexcache verify thinker``: this project's Thinker against transformers' Qwen3ForCausalLM.

Both load the same checkpoint (or a random one built with transformers and saved to a temp
dir). The same random ragged sessions then run through three paths of this project:

* dense prefill (one session at a time, no cache),
* paged prefill (all sessions in one ragged batch over shuffled, non-contiguous blocks),
* paged decode (``--decode-steps`` steps, one token per session per step),

and each path's logits are compared with transformers' full (uncached) forward of the same
tokens. Relative error = max|ours - ref| / max|ref| over the compared logits.

Exit codes: 0 all paths within tolerance, 1 a path above it, 2 the checkpoint cannot be loaded.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from duplexcache.kv.paged_attention import PagedBatch
from duplexcache.models.checkpoint import CheckpointError, checkpoint_keys, load_state_dict, read_hf_config
from duplexcache.models.thinker import Thinker, ThinkerConfig, select_qwen3_config
from duplexcache.verify.common import (
    FLOAT32_TOLERANCE, add_source_arguments, exit_unusable, missing_reference, relative_error, report,
    run_on_source, source_error,
)

logger = logging.getLogger(__name__)

TARGET = "thinker"
# reference module -> the pip requirement providing it (checked before anything runs)
REFERENCE_PACKAGES = {"transformers": "transformers>=4.51"}
PRESETS: dict[str, Callable[[], ThinkerConfig]] = {"tiny": ThinkerConfig.tiny, "minicpmo45": ThinkerConfig.minicpmo45}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Max relative error allowed per dtype. float32 is the fidelity rule of the spec; the half
# precisions only bound rounding differences between two implementations of the same math.
TOLERANCES = {"float32": FLOAT32_TOLERANCE, "bfloat16": 3e-2, "float16": 5e-3}
_BASE_LENGTHS = (5, 17, 33)

# Test-only hook: called with the loaded Thinker before comparing (e.g. to perturb a weight
# and prove that the comparison can fail). None in normal use.
_post_load_hook: Callable[[Thinker], None] | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(
        parser, PRESETS, checkpoint_help="Qwen3 or MiniCPM-o checkpoint directory",
        random_help="random weights saved with transformers",
    )  # fmt: skip
    parser.add_argument("--sessions", type=int, default=3, help="ragged sessions (lengths 5, 17, 33, ...)")
    parser.add_argument("--decode-steps", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cpu")


def run(args: argparse.Namespace) -> int:
    missing = missing_reference(TARGET, REFERENCE_PACKAGES)
    if missing is not None:
        return missing
    problem = source_error(args)
    if problem is None and (args.sessions < 1 or args.decode_steps < 0 or args.block_size < 1):
        problem = "--sessions and --block-size must be >= 1, --decode-steps >= 0"
    if problem:
        return exit_unusable(TARGET, problem)
    return run_on_source(TARGET, args, PRESETS, save_random_checkpoint, lambda path: _verify_dir(path, args))


def _verify_dir(path: str, args: argparse.Namespace) -> int:
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    try:
        ours = Thinker.from_pretrained(path, dtype=dtype, device=device)
    except (CheckpointError, ValueError, OSError) as exc:
        return exit_unusable(TARGET, f"cannot load {path}: {exc}")
    try:
        ref = load_reference(path, dtype, device)
    except Exception as exc:  # whatever transformers raises, the checkpoint is unusable for the check
        return exit_unusable(TARGET, f"transformers cannot load {path}: {type(exc).__name__}: {exc}")
    if _post_load_hook is not None:
        _post_load_hook(ours)
    errors = compare_paths(ours, ref, args.sessions, args.block_size, args.decode_steps, args.seed)
    tol = TOLERANCES[args.dtype]
    subject = f"{path} ({args.dtype}, {args.device}, {args.sessions} sessions, block size {args.block_size})"
    return report(TARGET, subject, errors, tol, f"{tol:g} for {args.dtype}")


def save_random_checkpoint(config: ThinkerConfig, path: str | Path, seed: int = 0) -> None:
    """A random Qwen3ForCausalLM of ``config``'s shape, saved with transformers' save_pretrained.

    All weights are randomised, norms included (transformers initialises norms to 1, which
    would hide a mistake in how a norm weight is applied).
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**config.to_hf_config()))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.05)
    model.save_pretrained(str(path))


def load_reference(path: str | Path, dtype: torch.dtype, device: torch.device):
    """transformers' Qwen3ForCausalLM for ``path``: from_pretrained for a Qwen3 dir; for a
    MiniCPM-o dir (LLM under ``llm.``) a Qwen3ForCausalLM of the LLM config loading those keys."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if "llm.model.embed_tokens.weight" not in checkpoint_keys(path):
        return Qwen3ForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    config = ThinkerConfig.from_hf_config(select_qwen3_config(read_hf_config(path)))
    model = Qwen3ForCausalLM(Qwen3Config(**config.to_hf_config()))
    missing, unexpected = model.load_state_dict(load_state_dict(path, prefix="llm."), strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise ValueError(f"missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.to(device=device, dtype=dtype).eval()


def session_lengths(num_sessions: int) -> list[int]:
    """5, 17, 33, 12, 24, 40, ...: ragged, crossing block boundaries at block size 16."""
    return [_BASE_LENGTHS[i % 3] + 7 * (i // 3) for i in range(num_sessions)]


@torch.no_grad()
def compare_paths(
    ours: Thinker, ref, num_sessions: int, block_size: int, decode_steps: int, seed: int
) -> dict[str, float]:
    """Max relative error of dense prefill, paged prefill and paged decode vs ``ref``."""
    device = ours.lm_head.weight.device
    gen = torch.Generator().manual_seed(seed)
    vocab = ours.config.vocab_size
    lengths = session_lengths(num_sessions)
    seqs = [torch.randint(0, vocab, (n,), generator=gen).to(device) for n in lengths]

    def ref_logits(tokens: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, V), uncached
        return ref(input_ids=tokens[None]).logits[0]

    errors = {"dense prefill": 0.0}
    for tokens in seqs:
        positions = torch.arange(tokens.shape[0], device=device)[None]
        dense = ours.forward_dense(ours.embed(tokens)[None], positions)[0]
        errors["dense prefill"] = max(errors["dense prefill"], relative_error(dense, ref_logits(tokens)))

    # Shuffled block ids so tables are non-contiguous and interleaved between sessions.
    blocks_needed = [-(-(n + decode_steps) // block_size) for n in lengths]
    ids = (torch.randperm(sum(blocks_needed), generator=gen) + 1).tolist()
    tables = [[ids.pop() for _ in range(k)] for k in blocks_needed]
    cache = ours.make_kv_cache(num_blocks=sum(blocks_needed) + 1, block_size=block_size)

    batch = PagedBatch.build(tables, [0] * num_sessions, lengths, None, block_size, device)
    hidden = ours.forward_paged(ours.embed(torch.cat(seqs)), batch, cache)
    ref_all = torch.cat([ref_logits(t) for t in seqs])
    errors["paged prefill"] = relative_error(ours.compute_logits(hidden), ref_all)

    if decode_steps:
        errors["paged decode"] = 0.0
    for _ in range(decode_steps):
        new = torch.randint(0, vocab, (num_sessions,), generator=gen).to(device)
        computed = [t.shape[0] for t in seqs]
        seqs = [torch.cat([t, new[i : i + 1]]) for i, t in enumerate(seqs)]
        batch = PagedBatch.build(tables, computed, [1] * num_sessions, None, block_size, device)
        logits = ours.logits_at(ours.forward_paged(ours.embed(new), batch, cache), batch)
        ref_last = torch.stack([ref_logits(t)[-1] for t in seqs])
        errors["paged decode"] = max(errors["paged decode"], relative_error(logits, ref_last))
    return errors
