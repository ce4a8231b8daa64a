"""ContextCache: hit/miss counters, LRU order (FIFO must fail), key covers every field."""

from __future__ import annotations

import pytest
import torch

from duplexcache.context import ContextCache, ContextCacheEntry, EncoderPath, context_key, make_context_cache


def _entry(tag: int) -> ContextCacheEntry:
    return ContextCacheEntry(
        token_ids=torch.tensor([tag]), inputs_embeds=torch.full((1, 2), float(tag)),
        prefix_token_count=1, audio_embedding_count=0, suffix_token_count=0,
        encoder_path=None, streaming_side_effects=None,
    )


def _key(name: str) -> bytes:
    return context_key(name, False, None, None)


class FifoContextCache(ContextCache):
    """The review's trap: same container, but a hit does not refresh recency."""

    def get(self, key):
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
        else:
            self.hits += 1
        return entry


def _touch_then_overflow(cache: ContextCache) -> tuple[bytes, bytes]:
    """Fill to capacity 3 with a, b, c; touch a; insert d. Returns (touched, oldest untouched)."""
    a, b, c, d = (_key(n) for n in "abcd")
    for k, tag in ((a, 1), (b, 2), (c, 3)):
        cache.put(k, _entry(tag))
    assert cache.get(a) is not None
    cache.put(d, _entry(4))
    return a, b


def test_hit_and_miss_counters():
    cache = ContextCache(capacity=4)
    k = _key("x")
    assert cache.get(k) is None
    cache.put(k, _entry(7))
    got = cache.get(k)
    assert got is not None and torch.equal(got.token_ids, torch.tensor([7]))
    assert (cache.hits, cache.misses, cache.evictions) == (1, 1, 0)
    assert cache.stats().size == 1
    assert cache.stats().nbytes == 8 + 2 * 4  # one int64 id + two float32 values


def test_lru_keeps_touched_entry_and_fifo_would_not():
    cache = ContextCache(capacity=3)
    touched, untouched = _touch_then_overflow(cache)
    # Membership right after the overflow, before anything else re-inserts.
    assert touched in cache
    assert untouched not in cache
    assert cache.evictions == 1
    assert list(cache.keys()) == [_key("c"), _key("a"), _key("d")]

    fifo = FifoContextCache(capacity=3)
    touched, untouched = _touch_then_overflow(fifo)
    # The same sequence under FIFO evicts the touched entry: the assertions above would fail.
    assert touched not in fifo
    assert untouched in fifo


def test_membership_check_does_not_count_as_use():
    cache = ContextCache(capacity=2)
    a, b, c = _key("a"), _key("b"), _key("c")
    cache.put(a, _entry(1))
    cache.put(b, _entry(2))
    assert a in cache  # must not refresh a
    cache.put(c, _entry(3))
    assert a not in cache and b in cache and c in cache
    assert cache.hits == 0 and cache.misses == 0


def test_put_existing_key_refreshes_without_eviction():
    cache = ContextCache(capacity=2)
    a, b, c = _key("a"), _key("b"), _key("c")
    cache.put(a, _entry(1))
    cache.put(b, _entry(2))
    cache.put(a, _entry(5))
    cache.put(c, _entry(3))
    assert a in cache and b not in cache
    assert cache.evictions == 1


@pytest.mark.parametrize("capacity", [0, -1, 1.5, True, "32"])
def test_bad_capacity(capacity):
    with pytest.raises(ValueError, match="capacity"):
        ContextCache(capacity)


BASE = dict(instructions="Be brief.", has_ref_audio=True, initial_user_text="hi", ref_audio_sha256="ab" * 32)


@pytest.mark.parametrize("field,value", [
    ("instructions", "Be verbose."),
    ("initial_user_text", "hello"),
    ("initial_user_text", None),
    ("ref_audio_sha256", "cd" * 32),
])
def test_key_distinguishes_field(field, value):
    other = dict(BASE, **{field: value})
    assert context_key(**other) != context_key(**BASE)


def test_key_distinguishes_has_ref_audio():
    without = dict(BASE, has_ref_audio=False, ref_audio_sha256=None)
    assert context_key(**without) != context_key(**BASE)


def test_key_field_boundaries_are_unambiguous():
    assert context_key("ab", False, "c", None) != context_key("a", False, "bc", None)
    assert context_key("a", False, "", None) != context_key("a", False, None, None)


def test_key_rejects_inconsistent_audio_fields():
    with pytest.raises(ValueError, match="ref_audio_sha256"):
        context_key("a", True, None, None)
    with pytest.raises(ValueError, match="ref_audio_sha256"):
        context_key("a", False, None, "ab")


def test_streaming_entry_requires_side_effects():
    with pytest.raises(AssertionError):
        ContextCacheEntry(torch.tensor([1]), torch.zeros(1, 2), 1, 0, 0, EncoderPath.STREAMING, None)


def test_make_context_cache_off_and_on():
    assert make_context_cache(False, 32) is None
    cache = make_context_cache(True, 5)
    assert isinstance(cache, ContextCache) and cache.capacity == 5
