"""Content keys for shared context blocks: chained sha256 over (parent, tokens, extra key).

Why an extra key: the reference-audio positions of a session context are filled with the
same placeholder token id in every session, but the embeddings behind them (and so the
K/V) differ per reference clip and per model revision. Hashing token ids alone would let
two sessions with different voices share K/V. The extra key names those embeddings, e.g.
``sha256(reference audio bytes) + model revision``; use ``make_extra_key`` to build one.

Chaining makes a block's key depend on every token before it, so equal keys mean equal
K/V (given the same weights) for the whole prefix, not just the block.

Encoding (every field length-prefixed so no two inputs serialize to the same bytes)::

    sha256( kind(1 byte: b"F" full | b"P" partial)
          | parent key (32 bytes; 32 zero bytes for the first block)
          | u32 number of tokens | tokens as little-endian int64
          | u32 len(extra_key)   | extra_key )

A partial (last, not yet full) block uses kind ``b"P"``: its key never equals a full
block's key, so a copy-on-write template can never be mistaken for a shared full block.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

BlockHash = bytes

ROOT_PARENT: BlockHash = bytes(32)
_FULL = b"F"
_PARTIAL = b"P"


def _digest(kind: bytes, parent: BlockHash | None, token_ids: Sequence[int], extra_key: bytes) -> BlockHash:
    if parent is None:
        parent = ROOT_PARENT
    if len(parent) != 32:
        raise ValueError(f"parent key must be 32 bytes (a sha256 digest), got {len(parent)}")
    if not isinstance(extra_key, (bytes, bytearray)):
        raise ValueError(f"extra_key must be bytes, got {type(extra_key).__name__}")
    toks = np.asarray(token_ids, dtype="<i8")
    if toks.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {toks.shape}")
    h = hashlib.sha256()
    h.update(kind)
    h.update(parent)
    h.update(struct.pack("<I", toks.size))
    h.update(toks.tobytes())
    h.update(struct.pack("<I", len(extra_key)))
    h.update(bytes(extra_key))
    return h.digest()


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_key: bytes = b""
) -> BlockHash:
    """Key of one full block whose predecessor has key ``parent`` (None for the first)."""
    return _digest(_FULL, parent, token_ids, extra_key)


def hash_partial_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_key: bytes = b""
) -> BlockHash:
    """Key of a partial last block (fewer than block_size tokens), marked partial.

    Used for the read-only copy-on-write template of a context's last block.
    """
    if len(token_ids) == 0:
        raise ValueError("a partial block needs at least one token")
    return _digest(_PARTIAL, parent, token_ids, extra_key)


def make_extra_key(*parts: bytes | str) -> bytes:
    """sha256 over length-prefixed parts, e.g. ``make_extra_key(sha256(ref_audio), revision)``."""
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else bytes(p)
        h.update(struct.pack("<I", len(b)))
        h.update(b)
    return h.digest()


def per_block_extra_keys(
    extra_key: bytes | Sequence[bytes], num_tokens: int, block_size: int
) -> list[bytes]:
    """Expand ``extra_key`` to one key per block (full and partial) of a context.

    A single ``bytes`` applies to every block. A sequence must have exactly
    ``ceil(num_tokens / block_size)`` entries, so that, for example, the blocks of the
    system prompt before the reference audio can carry an empty extra key and be shared
    by sessions with different voices.
    """
    n = -(-num_tokens // block_size)
    if isinstance(extra_key, (bytes, bytearray)):
        return [bytes(extra_key)] * n
    keys = list(extra_key)
    if len(keys) != n:
        raise ValueError(
            f"got {len(keys)} per-block extra keys for {num_tokens} tokens in blocks of "
            f"{block_size}; need {n}"
        )
    return keys


def context_block_hashes(
    token_ids: Sequence[int], block_size: int, extra_key: bytes | Sequence[bytes] = b""
) -> tuple[list[BlockHash], BlockHash | None]:
    """Keys of a context's full blocks, and of its partial last block (None if none).

    Returns ``(full_keys, partial_key)``: ``full_keys[i]`` covers tokens
    ``[i*block_size, (i+1)*block_size)``; ``partial_key`` covers the remaining
    ``len(token_ids) % block_size`` tokens and chains from the last full key.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    extras = per_block_extra_keys(extra_key, len(token_ids), block_size)
    num_full = len(token_ids) // block_size
    keys: list[BlockHash] = []
    parent: BlockHash | None = None
    for i in range(num_full):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], extras[i])
        keys.append(parent)
    rem = len(token_ids) - num_full * block_size
    partial = None
    if rem:
        partial = hash_partial_block(parent, token_ids[num_full * block_size:], extras[num_full])
    return keys, partial
