"""A/B of one prefill chunk's attention over a long paged context (one Thinker layer, minicpmo45 shapes).

    python scripts/probes/prefill_attention_ab.py [--chunk 1024] [--contexts 1024,4096,8192,16384] [--out DIR]

A: the path before 2026-12-03 — 3-D SDPA with an explicit boolean (T, S) mask (what
``_reference_paged_attention`` did). B: ``duplexcache.kv.paged_attention.paged_attention`` as it is
now (4-D SDPA with a lower-right causal bias). Same cache, same query; prints and writes the
median ms per call of each and the largest difference of their outputs. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from duplexcache.kv.paged_attention import PagedBatch, PagedKVCache, paged_attention
from duplexcache.models.thinker import ThinkerConfig

logger = logging.getLogger("prefill_attention_ab")


def boolean_mask_attention(q: torch.Tensor, cache: PagedKVCache, batch: PagedBatch, scale: float) -> torch.Tensor:
    """The A side: one sequence, gathered K/V, 3-D SDPA with a materialised causal mask."""
    computed, new = batch.num_computed_list[0], batch.num_new_list[0]
    seq_len = computed + new
    group = q.shape[1] // cache.num_kv_heads
    blocks = batch.block_tables[0, : -(-seq_len // cache.block_size)].long()
    k = cache.k[0][blocks].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1).transpose(0, 1)
    v = cache.v[0][blocks].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1).transpose(0, 1)
    key_idx = torch.arange(seq_len, device=q.device)
    query_idx = torch.arange(computed, seq_len, device=q.device)
    mask = key_idx[None, :] <= query_idx[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale).transpose(0, 1)


def timed_ms(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--contexts", default="1024,4096,8192,16384", help="total sequence lengths after the chunk")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("out/prefill_attention"))
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("prefill_attention_ab: needs CUDA")
    cfg = ThinkerConfig.minicpmo45()
    bs, dev, dtype = 16, torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    rows = []
    for total in (int(x) for x in a.contexts.split(",")):
        blocks = -(-total // bs)
        cache = PagedKVCache(1, blocks + 1, bs, cfg.num_key_value_heads, cfg.head_dim, dtype, dev)
        cache.k.normal_()
        cache.v.normal_()
        batch = PagedBatch.build([list(range(1, blocks + 1))], [total - a.chunk], [a.chunk], None, bs, dev)
        q = torch.randn(a.chunk, cfg.num_attention_heads, cfg.head_dim, dtype=dtype, device=dev)
        scale = cfg.head_dim ** -0.5
        out_a = boolean_mask_attention(q, cache, batch, scale)
        out_b = paged_attention(q, cache, 0, batch, scale)
        row = {"context": total, "chunk": a.chunk,
               "boolean_mask_ms": timed_ms(lambda: boolean_mask_attention(q, cache, batch, scale), a.repeats),
               "lower_right_bias_ms": timed_ms(lambda: paged_attention(q, cache, 0, batch, scale), a.repeats),
               "max_abs_diff": float((out_a.float() - out_b.float()).abs().max())}
        logger.info("context %5d, chunk %d: boolean mask %.2f ms, lower-right bias %.2f ms per layer (max |diff| %.3g)",
                    total, a.chunk, row["boolean_mask_ms"], row["lower_right_bias_ms"], row["max_abs_diff"])
        rows.append(row)
        del cache
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps({"hardware": torch.cuda.get_device_name(), "layers_per_chunk":
                                                    cfg.num_hidden_layers, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
