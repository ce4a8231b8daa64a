"""Capacity-mode A/B: the Thinker's next-token distributions with fp8 K/V against exact K/V.

    python scripts/probes/kv_precision.py --out DIR [--preset minicpmo45] [--sessions 4]
                                       [--windows 1000,4000,8000] [--decode 32] [--chunk 1024]

One Thinker (seeded random weights, the model dtype) and two paged caches that differ only in
the K/V storage format (``precision.kv_cache_dtype``: ``auto`` = the model dtype, the exact
reference, against ``fp8_e4m3``). Both arms run in lockstep on the same token ids:

* ``--sessions`` sequences of seeded random token ids are prefilled up to each window of
  ``--windows`` in forwards of at most ``--chunk`` tokens (as the engine's context prefill and
  window fill do: every chunk attends to the K/V already stored, so the fp8 arm reads its own
  rounded K/V from the second chunk on, as serving would);
* at each window, ``--decode`` more tokens are fed one at a time, all sessions in one batch
  (teacher-forced: the same ids in both arms; on CUDA through the in-place Triton decode kernel,
  the serving path), and each step's next-token distribution of the fp8 arm is compared with the
  exact arm's: top-1 agreement, KL(exact || fp8) in nats (mean, p99, max) and the logits'
  relative error.

``--encoder-chunks N`` (0: skip) adds the audio encoder's cache (``precision.encoder_cache_dtype``):
``--sessions`` streams of N seeded random 1 s chunks through ``stream_step`` with an exact and an
fp8 cache each (the same weights and audio); per chunk, the relative error of the fp8 arm's
embeddings against the exact arm's (mean, max, first and last ten chunks: drift across the 30 s
resets), and the cache bytes per session of each format.

Bytes per token of each format come from the caches. Random weights: attention over random
tokens is flatter than a trained model's, so these errors say how the format behaves on these
shapes, not what a trained checkpoint would show (no checkpoint here). Writes results.json and
results.md to ``--out``; no pass/fail threshold (a measurement reported next to the bytes it buys).
"""

from __future__ import annotations

import argparse
import sys
import logging
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from duplexcache.bench.common import hardware_line, int_list, usage_error, write_results
from duplexcache.kv.kv_quant import kv_storage_dtype
from duplexcache.kv.paged_attention import PagedBatch, PagedKVCache
from duplexcache.models.presets import PRESETS, build_random_models

logger = logging.getLogger(__name__)
ARMS = ("auto", "fp8_e4m3")   # precision.kv_cache_dtype
DTYPES = {"minicpmo45": torch.bfloat16, "tiny": torch.float32}


def make_cache(config, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
               kv_cache_dtype: str) -> PagedKVCache:
    """A Thinker-shaped paged cache in ``kv_cache_dtype`` (``auto``: ``dtype``)."""
    cache = PagedKVCache(config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads,
                         config.head_dim, dtype=dtype, device=device,
                         storage_dtype=kv_storage_dtype(kv_cache_dtype))
    if device.type == "cuda":
        cache.set_decode_backend("triton")   # the serving decode path
    return cache


class _Arm:
    """One cache and the sessions' block tables and lengths in it (tables are the same in both arms)."""

    def __init__(self, cache: PagedKVCache, tables: list[list[int]]) -> None:
        self.cache = cache
        self.tables = tables
        self.lengths = [0] * len(tables)

    def forward(self, thinker, embeds: torch.Tensor, counts: list[int], seqs: list[int]) -> torch.Tensor:
        """Append ``counts[i]`` rows of ``embeds`` to sequence ``seqs[i]``; the hidden states."""
        batch = PagedBatch.build([self.tables[s] for s in seqs], [self.lengths[s] for s in seqs], counts, None,
                                 self.cache.block_size, self.cache.device)
        hidden = thinker.forward_paged(embeds, batch, self.cache)
        for s, n in zip(seqs, counts):
            self.lengths[s] += n
        return thinker.logits_at(hidden, batch).float()


def compare(exact: torch.Tensor, other: torch.Tensor) -> dict[str, np.ndarray]:
    """Per row: top-1 agreement, KL(exact || other) in nats, relative error of the logits."""
    lp, lq = F.log_softmax(exact, -1), F.log_softmax(other, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    rel = torch.linalg.vector_norm(other - exact, dim=-1) / torch.linalg.vector_norm(exact, dim=-1).clamp_min(1e-30)
    return {"top1": (exact.argmax(-1) == other.argmax(-1)).cpu().numpy(),
            "kl": kl.clamp_min(0).cpu().numpy(), "rel": rel.cpu().numpy()}


def window_row(window: int, rows: list[dict[str, np.ndarray]]) -> dict:
    top1 = np.concatenate([r["top1"] for r in rows])
    kl = np.concatenate([r["kl"] for r in rows]).astype(np.float64)
    rel = np.concatenate([r["rel"] for r in rows]).astype(np.float64)
    return {"window": window, "steps": int(top1.size), "top1_agreement": float(top1.mean()),
            "kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max()),
            "logits_rel_error_mean": float(rel.mean()), "logits_rel_error_max": float(rel.max())}


def run_windows(args: argparse.Namespace, device: torch.device) -> dict:
    dtype = DTYPES[args.preset]
    thinker = build_random_models(args.preset, device, dtype, args.seed, parts=("thinker",)).thinker
    cfg = thinker.config
    total = args.windows[-1] + len(args.windows) * args.decode
    if total > cfg.max_position_embeddings:
        raise ValueError(f"windows + decode steps ({total}) exceed the Thinker's {cfg.max_position_embeddings} positions")
    bs = args.block_size
    per_seq = -(-total // bs)
    tables = [list(range(1 + s * per_seq, 1 + (s + 1) * per_seq)) for s in range(args.sessions)]
    arms = {name: _Arm(make_cache(cfg, 1 + args.sessions * per_seq, bs, dtype, device, name), tables)
            for name in ARMS}
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, min(cfg.vocab_size, args.max_token_id), (args.sessions, total), generator=gen)
    bytes_per_token = {name: arm.cache.bytes_per_block / bs for name, arm in arms.items()}
    results = []
    start = time.perf_counter()
    with torch.no_grad():
        for window in args.windows:
            # prefill every session up to ``window`` tokens, one session and one chunk per forward
            for s in range(args.sessions):
                while arms["auto"].lengths[s] < window:
                    pos = arms["auto"].lengths[s]
                    n = min(args.chunk, window - pos)
                    embeds = thinker.embed(ids[s, pos:pos + n].to(device)).to(dtype)
                    for arm in arms.values():
                        arm.forward(thinker, embeds, [n], [s])
            rows = []
            for _ in range(args.decode):
                pos = arms["auto"].lengths[0]
                embeds = thinker.embed(ids[:, pos].to(device)).to(dtype)
                seqs = list(range(args.sessions))
                logits = {name: arm.forward(thinker, embeds, [1] * args.sessions, seqs) for name, arm in arms.items()}
                rows.append(compare(logits["auto"], logits["fp8_e4m3"]))
            results.append(window_row(window, rows))
            logger.info("window %d: top-1 agreement %.4f, KL mean %.3g max %.3g (%.0f s)", window,
                        results[-1]["top1_agreement"], results[-1]["kl_mean"], results[-1]["kl_max"],
                        time.perf_counter() - start)
    return {"bytes_per_token": bytes_per_token, "windows": results, "thinker_dtype": str(dtype).removeprefix("torch."),
            "layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim}


def run_encoder(args: argparse.Namespace, device: torch.device) -> dict:
    """The encoder cache arm: exact vs fp8 streams over the same audio (module docstring)."""
    dtype = DTYPES[args.preset]
    encoder = build_random_models(args.preset, device, dtype, args.seed, parts=("audio_encoder",)).audio_encoder
    cfg = encoder.cfg
    gen = torch.Generator().manual_seed(args.seed + 1)
    errors: list[list[float]] = []
    with torch.no_grad():
        states = {name: [encoder.new_stream_state(storage_dtype=kv_storage_dtype(name)) for _ in range(args.sessions)]
                  for name in ARMS}
        for chunk in range(args.encoder_chunks):
            n = cfg.first_chunk_samples if chunk == 0 else cfg.chunk_samples
            pcm = [(torch.rand(n, generator=gen) - 0.5).to(device) for _ in range(args.sessions)]
            out = {name: encoder.stream_step(states[name], pcm) for name in ARMS}
            errors.append([float(torch.linalg.vector_norm((b - a).float())
                                 / torch.linalg.vector_norm(a.float()).clamp_min(1e-30))
                           for a, b in zip(out["auto"], out["fp8_e4m3"])])
    per_chunk = np.array(errors)   # (chunks, sessions)
    edge = min(10, len(per_chunk))
    return {"chunks": args.encoder_chunks, "resets": states["fp8_e4m3"][0].num_resets,
            "rel_error_mean": float(per_chunk.mean()), "rel_error_max": float(per_chunk.max()),
            "rel_error_first_chunks": float(per_chunk[:edge].mean()),
            "rel_error_last_chunks": float(per_chunk[-edge:].mean()),
            "bytes_per_session": {name: cfg.kv_bytes_per_session(dtype, kv_storage_dtype(name)) for name in ARMS}}


def markdown(res: dict) -> str:
    b = res["bytes_per_token"]
    lines = ["# Thinker K/V in fp8_e4m3 against exact (precision.kv_cache_dtype)", "",
             f"{res['hardware']}; {res['preset']} ({res['thinker_dtype']}), {res['sessions']} sessions, "
             f"{res['decode']} decode steps per window, prefill chunks of {res['chunk']} tokens", "",
             f"Bytes per token: exact {b['auto']:.0f}, fp8 {b['fp8_e4m3']:.0f} "
             f"({b['fp8_e4m3'] / b['auto']:.3f}x, scales included)", "",
             "| window (tokens) | steps | top-1 agreement | KL mean | KL p99 | KL max | logits rel. error mean / max |",
             "|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["windows"]:
        lines.append(f"| {r['window']} | {r['steps']} | {r['top1_agreement']:.4f} | {r['kl_mean']:.3g} | "
                     f"{r['kl_p99']:.3g} | {r['kl_max']:.3g} | {r['logits_rel_error_mean']:.3g} / "
                     f"{r['logits_rel_error_max']:.3g} |")
    enc = res.get("encoder")
    if enc:
        b = enc["bytes_per_session"]
        lines += ["", "## Audio encoder cache in fp8_e4m3 (precision.encoder_cache_dtype)", "",
                  f"{res['sessions']} sessions x {enc['chunks']} chunks ({enc['resets']} cache resets per session); "
                  f"bytes per session: exact {b['auto'] / 2**20:.3f} MiB, fp8 {b['fp8_e4m3'] / 2**20:.3f} MiB", "",
                  "| embeddings rel. error | mean | max | first 10 chunks | last 10 chunks |", "|---|---:|---:|---:|---:|",
                  f"| fp8 vs exact | {enc['rel_error_mean']:.3g} | {enc['rel_error_max']:.3g} | "
                  f"{enc['rel_error_first_chunks']:.3g} | {enc['rel_error_last_chunks']:.3g} |"]
    return "\n".join(lines) + "\n"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", type=Path, default=Path("out/kv-precision"))
    ap.add_argument("--preset", choices=PRESETS, default="minicpmo45")
    ap.add_argument("--device", default=None, help="default: cuda for minicpmo45, cpu for tiny")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--windows", type=int_list("--windows"), default=(1000, 4000, 8000),
                    help="cache lengths at which the decode steps are compared (ascending)")
    ap.add_argument("--decode", type=int, default=32, help="decode steps compared per window")
    ap.add_argument("--chunk", type=int, default=1024, help="most tokens per prefill forward")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-token-id", type=int, default=151_643, help="ids are drawn below this (the text ids)")
    ap.add_argument("--encoder-chunks", type=int, default=60,
                    help="1 s chunks of the audio-encoder cache arm (0: skip it)")
    ap.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    if args.encoder_chunks < 0:
        return usage_error("kv-precision", "--encoder-chunks must be >= 0")
    if min(args.sessions, args.decode, args.chunk, args.block_size, args.max_token_id) < 1:
        return usage_error("kv-precision", "--sessions, --decode, --chunk, --block-size, --max-token-id must be positive")
    if list(args.windows) != sorted(set(args.windows)) or args.windows[0] < 1:
        return usage_error("kv-precision", "--windows must be positive and ascending")
    device = torch.device(args.device or ("cuda" if args.preset == "minicpmo45" else "cpu"))
    res = {"hardware": hardware_line(device), "preset": args.preset, "sessions": args.sessions,
           "decode": args.decode, "chunk": args.chunk, "block_size": args.block_size, "seed": args.seed,
           **run_windows(args, device)}
    if args.encoder_chunks:
        res["encoder"] = run_encoder(args, device)
    md = markdown(res)
    write_results(args.out, res, md)
    print(md)
    return 0


if __name__ == "__main__":   # a probe script: python scripts/probes/kv_precision.py ARGS (duplexcache importable)
    _parser = argparse.ArgumentParser(prog="scripts/probes/kv_precision.py", description=__doc__.split("\n\n")[0])
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
