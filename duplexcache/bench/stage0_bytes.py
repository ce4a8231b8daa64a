"""Per-session Stage 0 KV bytes from shapes alone (no weights, no KV tensors; runs on CPU).

    duplexcache bench stage0-bytes                 # minicpmo45, bf16, the docs table
    duplexcache bench stage0-bytes --contexts 96 400 --high 8000

For each context length, at session start (window empty) and at a full window (context +
``high`` tokens, the most a session holds: compaction runs before an append would pass it),
with context sharing on and off. Every row is computed twice, by the closed-form
``stage0_session_bytes`` and by a real ``KVCacheManager`` over a pool large enough for two
sessions (a first session warms the shared cache, the second is measured); the two must agree.
"""

from __future__ import annotations

import argparse
import logging

import torch

from duplexcache.bench.common import alias_main
from duplexcache.kv.block_pool import BlockPool
from duplexcache.kv.kv_cache_manager import KVCacheManager, SessionBytes
from duplexcache.kv.kv_quant import KV_CACHE_DTYPES, kv_storage_dtype
from duplexcache.kv.paged_attention import bytes_per_block
from duplexcache.models.thinker import ThinkerConfig
from duplexcache.runtime.stage0.window import stage0_session_bytes

logger = logging.getLogger(__name__)
MIB = 1024 * 1024


def _measured(config: ThinkerConfig, context: int, window: int, share: bool, dtype: torch.dtype,
              block_size: int, storage_dtype: torch.dtype | None = None) -> SessionBytes:
    """Bytes the manager reports for the second of two sessions with the same context."""
    per_block = bytes_per_block(config.num_hidden_layers, block_size, config.num_key_value_heads,
                                config.head_dim, dtype, storage_dtype)
    need = 2 * (-(-(context + window) // block_size) + 1) + 1
    mgr = KVCacheManager(BlockPool(need), block_size, per_block)
    ids = [151700 + i % 16 for i in range(context)]  # any ids: both sessions use the same ones
    for sid in ("warm", "s"):
        mgr.allocate_context(sid, ids, b"ref-audio-sha256|revision", share)
        mgr.commit_context(sid)
    mgr.append_slots("s", window)
    return mgr.session_bytes("s")


def table_rows(config: ThinkerConfig, contexts: list[int], high: int, dtype: torch.dtype,
               block_size: int = 16, storage_dtype: torch.dtype | None = None) -> list[dict]:
    rows = []
    for context in contexts:
        for point, window in (("start", 0), (f"full window (+{high})", high)):
            row = {"context": context, "point": point}
            for share in (True, False):
                formula = stage0_session_bytes(config, context, window, share, dtype, block_size,
                                               storage_dtype)
                measured = _measured(config, context, window, share, dtype, block_size, storage_dtype)
                if formula != measured:
                    raise AssertionError(f"formula {formula} != manager {measured} (context {context}, "
                                         f"window {window}, share {share})")
                row["on" if share else "off"] = formula
            rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [
        "| context tokens | point | private, sharing on | shared (on) | private, sharing off | saved per session |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        on, off = r["on"], r["off"]
        saved = off.private - on.private
        lines.append(
            f"| {r['context']} | {r['point']} | {on.private / MIB:.2f} MiB | {on.shared / MIB:.2f} MiB | "
            f"{off.private / MIB:.2f} MiB | {saved / MIB:.2f} MiB ({100 * saved / off.private:.1f}%) |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=("minicpmo45", "tiny"), default="minicpmo45")
    parser.add_argument("--contexts", type=int, nargs="+", default=[96, 400])
    parser.add_argument("--high", type=int, default=8000, help="window high mark (tokens over the context)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-dtype", choices=tuple(KV_CACHE_DTYPES), default="auto",
                        help="precision.kv_cache_dtype: fp8_e4m3 counts e4m3 values plus their scales")


def run(args: argparse.Namespace) -> int:
    config = getattr(ThinkerConfig, args.preset)()
    dtype = getattr(torch, args.dtype)
    storage = kv_storage_dtype(args.kv_cache_dtype)
    rows = table_rows(config, args.contexts, args.high, dtype, args.block_size, storage)
    per_token = config.kv_bytes_per_token(dtype, storage)
    print(f"Stage 0 KV per session, preset {args.preset}, {args.dtype}, KV {args.kv_cache_dtype}, block "
          f"{args.block_size}, {per_token / 1024:g} KiB/token, {per_token * args.block_size / MIB:.2f} MiB/block")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(alias_main("stage0-bytes"))
