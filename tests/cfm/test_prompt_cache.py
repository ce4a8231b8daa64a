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


@pytest.mark.parametrize("p,tail,widths", [
    (12, 4, [3] * 12),                            # steady state, every frame recycled 2 times over
    (12, 4, [5, 2, 7, 3, 3, 1, 6, 4, 2, 5, 7]),   # uneven chunks: recycled frames in several runs
    (9, 4, [20, 1, 3, 2]),                        # one chunk longer than P
])
def test_delta_storage_is_written_once_per_new_frame_and_trims_like_the_reference(p, tail, widths):
    """A chunk of W frames writes W storage frames (never-used ones first, then the dropped
    keys'), every other frame keeps its bits; the storage (P frames) never moves; the logical
    cache equals PlainAttCache's (the literal reference trim) after every chunk."""
    gen = torch.Generator().manual_seed(2)
    prompt = _frames(p, gen)
    shared = SharedPromptAttCache(prompt, tail)
    plain = PlainAttCache(prompt.clone(), p, tail)
    ptr = None
    for w in widths:
        new = _frames(w, gen)                               # the arena row holds these only
        before = None if shared.storage is None else shared.storage.clone()
        old_positions = list(shared.positions)
        shared.advance(w, new)
        plain.advance(w, new)
        assert torch.equal(shared.materialize(), plain.materialize())
        assert (shared.num_delta, shared.head, shared.trimmed) == (plain.num_delta, plain.head, plain.trimmed)
        storage = shared.storage
        assert storage.shape[FRAME_DIM] == p and storage.is_contiguous()
        ptr = ptr or storage.data_ptr()
        assert storage.data_ptr() == ptr                    # allocated once, at the first chunk
        kept_new = min(w, shared.num_delta)
        kept_old = shared.num_delta - kept_new
        assert len(set(shared.positions)) == shared.num_delta and all(0 <= q < p for q in shared.positions)
        assert shared.positions[kept_new:] == old_positions[:kept_old]   # kept keys stay where they were
        written = shared.positions[:kept_new]
        if before is not None:
            changed = [q for q in range(p) if not torch.equal(storage[..., q, :], before[..., q, :])]
            assert changed == sorted(written)               # W frames copied, nothing else touched
            unused = [q for q in range(p) if q not in old_positions]
            # never-used frames first, then the dropped keys' frames
            assert written[:len(unused)] == unused[:kept_new]
        for j, q in enumerate(written):
            assert torch.equal(storage[..., q, :], new[..., j, :])
        # where the arena reads the delta from: key j at storage frame positions[j]
        frames = shared.private_frames()
        assert frames[0] is storage and frames[1] == shared.positions
        dst = torch.full_like(plain.data[..., :shared.num_delta, :], float("nan"))
        shared.copy_private_to(dst)
        assert torch.equal(dst, plain.data[..., :shared.num_delta, :])
        assert torch.equal(storage.index_select(FRAME_DIM, torch.tensor(shared.positions)),
                           plain.data[..., :shared.num_delta, :])
    assert shared.private_bytes() == p * prompt[..., :1, :].numel() * 4
