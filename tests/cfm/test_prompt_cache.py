"""SharedPromptAttCache layout against the reference trim applied to plain tensors."""
import pytest
import torch

from duplexcache.cfm.prompt_cache import FRAME_DIM, PlainAttCache, SharedPromptAttCache


def _frames(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(2, 3, 2, 2, n, 4, generator=gen)   # (steps, layers, cfg, heads, frames, 2hd)


def _ref_step(cache: torch.Tensor, new: torch.Tensor, p: int, tail: int) -> torch.Tensor:
    """Token2wav.stream on a plain tensor: keys [new | cache], then keep first P + last tail."""
    full = torch.cat([new, cache], dim=FRAME_DIM)
    if full.shape[FRAME_DIM] > p + tail:
        full = torch.cat([full[..., :p, :], full[..., -tail:, :]], dim=FRAME_DIM)
    return full


@pytest.mark.parametrize("p,tail,widths", [
    (12, 4, [3] * 8),           # steady state reached (d = P)
    (12, 12, [5, 5, 7, 2, 9]),  # tail == P, uneven chunks
    (9, 4, [20, 1, 1]),         # one chunk longer than P
])
def test_layout_matches_reference_trim(p, tail, widths):
    gen = torch.Generator().manual_seed(0)
    prompt = _frames(p, gen)
    shared = SharedPromptAttCache(prompt, tail)
    plain = PlainAttCache(prompt.clone(), p, tail)
    ref = prompt.clone()
    assert shared.private_bytes() == 0 and len(shared) == p
    for w in widths:
        new = _frames(w, gen)
        src = torch.cat([new, ref], dim=FRAME_DIM)       # the arena's [new | old] (test only)
        ref = _ref_step(ref, new, p, tail)
        shared.advance(w, src)
        plain.advance(w, torch.cat([new, plain.data], dim=FRAME_DIM))
        assert len(shared) == ref.shape[FRAME_DIM]
        assert torch.equal(shared.materialize(), ref)
        assert torch.equal(plain.materialize(), ref)
        # both report the same layout (the arena reads it to copy only the delta into a row)
        assert (plain.num_delta, plain.head, plain.trimmed) == (shared.num_delta, shared.head, shared.trimmed)
        for cache in (shared, plain):
            dst = torch.full_like(ref[..., :cache.num_delta, :], float("nan"))
            cache.copy_private_to(dst)
            assert torch.equal(dst, ref[..., :cache.num_delta, :])
        # every part but the delta is a view of the one prompt tensor
        for part in shared.parts()[1 if shared.num_delta else 0:]:
            assert part.untyped_storage().data_ptr() == prompt.untyped_storage().data_ptr()
        # arbitrary ranges straight from the parts
        for start, length in [(0, len(shared)), (1, len(shared) - 2), (shared.num_delta, 1), (len(shared) - 3, 3)]:
            dst = torch.full_like(ref[..., :length, :], float("nan"))
            shared.copy_range_to(dst, start, length)
            assert torch.equal(dst, ref[..., start:start + length, :])


def test_steady_state_bytes_and_views():
    gen = torch.Generator().manual_seed(1)
    p, tail, w = 12, 4, 3
    prompt = _frames(p, gen)
    frame = prompt[..., :1, :].numel() * 4
    cache = SharedPromptAttCache(prompt, tail)
    assert (cache.private_bytes(), cache.shared_bytes()) == (0, p * frame)
    ref = prompt.clone()
    # after one chunk: [n1 | prompt[0:P]] (no trim yet: P + 3 <= P + tail)
    new = _frames(w, gen)
    src = torch.cat([new, ref], dim=FRAME_DIM)
    ref = _ref_step(ref, new, p, tail)
    cache.advance(w, src)
    assert (cache.num_delta, cache.head, cache.trimmed) == (3, 12, False)
    # second chunk: 18 > 16 -> [n2 n1 | prompt[0:6] | prompt[8:12]]
    new = _frames(w, gen)
    src = torch.cat([new, ref], dim=FRAME_DIM)
    ref = _ref_step(ref, new, p, tail)
    cache.advance(w, src)
    assert (cache.num_delta, cache.head, cache.trimmed) == (6, 6, True)
    assert torch.equal(cache.parts()[2], prompt[..., 8:12, :])
    for _ in range(5):
        new = _frames(w, gen)
        src = torch.cat([new, ref], dim=FRAME_DIM)
        ref = _ref_step(ref, new, p, tail)
        cache.advance(w, src)
    assert (cache.num_delta, cache.head) == (p, 0)
    assert cache.private_bytes() == p * frame and cache.shared_bytes() == tail * frame
    assert torch.equal(cache.materialize(), ref)


def test_bad_arguments():
    prompt = torch.zeros(1, 1, 2, 1, 6, 4)
    with pytest.raises(ValueError, match="shorter than the kept tail"):
        SharedPromptAttCache(prompt, 8)
    cache = SharedPromptAttCache(prompt, 4)
    with pytest.raises(ValueError, match="outside cache"):
        cache.copy_range_to(torch.zeros(1, 1, 2, 1, 3, 4), 5, 3)
    with pytest.raises(ValueError, match="at least one frame"):
        cache.advance(0, prompt)
