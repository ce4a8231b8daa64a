"""Chained block keys: parent chaining, extra key, partial marker, unambiguous encoding."""

import pytest

from duplexcache.kv.block_hash import (
    context_block_hashes,
    hash_block_tokens,
    hash_partial_block,
    make_extra_key,
)


def test_chaining_and_extra_key():
    k0 = hash_block_tokens(None, [1, 2, 3, 4], b"e")
    assert k0 == hash_block_tokens(None, [1, 2, 3, 4], b"e") and len(k0) == 32
    assert k0 != hash_block_tokens(None, [1, 2, 3, 4], b"f")
    assert hash_block_tokens(k0, [5], b"e") != hash_block_tokens(None, [5], b"e")
    # Same block, different earlier blocks -> different key.
    a, _ = context_block_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4, b"")
    b, _ = context_block_hashes([0, 2, 3, 4, 9, 9, 9, 9], 4, b"")
    assert a[1] != b[1]


def test_partial_marker_and_encoding_is_unambiguous():
    assert hash_partial_block(None, [1, 2], b"") != hash_block_tokens(None, [1, 2], b"")
    # Token/extra boundary cannot be shifted.
    assert hash_block_tokens(None, [1], b"\x02") != hash_block_tokens(None, [1, 2], b"")
    assert make_extra_key("ab", "c") != make_extra_key("a", "bc")
    with pytest.raises(ValueError):
        hash_partial_block(None, [], b"")
    with pytest.raises(ValueError, match="bytes"):
        hash_block_tokens(None, [1], "str")


def test_context_block_hashes_layout():
    toks = list(range(10))
    full, partial = context_block_hashes(toks, 4, b"x")
    assert len(full) == 2
    assert full[1] == hash_block_tokens(hash_block_tokens(None, toks[:4], b"x"), toks[4:8], b"x")
    assert partial == hash_partial_block(full[1], toks[8:], b"x")
    assert context_block_hashes(toks[:8], 4, b"x") == (full, None)
    full2, _ = context_block_hashes(toks, 4, [b"", b"x", b"x"])
    assert full2[0] == hash_block_tokens(None, toks[:4], b"") != full[0]
