"""PagedDecodeGraphs: bucketing, padding and the static-buffer step, against the eager paged step.

On CPU the runner runs its padded static-buffer step eagerly (``capture=False``): the same
buffer filling, padding rows and bucket/width choice the CUDA graphs replay. The reference is
the model's own eager ``forward_paged`` on an unpadded batch, with the same random weights and
its own KV pool. The CUDA test (skipped without a GPU) checks that a replayed graph gives the
bits of the same padded step run eagerly.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from duplexcache.kv.decode_graphs import MIN_WIDTH_BLOCKS, PagedDecodeGraphs, batch_buckets, width_classes
from duplexcache.kv.paged_attention import PagedBatch, PagedKVCache
from duplexcache.models.talker import Talker, TalkerConfig, TalkerUnitRequest, generate_unit
from duplexcache.models.thinker import Thinker, ThinkerConfig

BS = 16


def test_buckets_and_widths():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(3) == (1, 2, 4)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(9) == (1, 2, 4, 8, 16)
    assert batch_buckets(33) == (1, 2, 4, 8, 16, 24, 32, 40)
    assert width_classes(1) == (MIN_WIDTH_BLOCKS,)
    assert width_classes(17) == (16, 32)
    assert width_classes(2560)[-1] == 4096
    for bad in (0, -1):
        with pytest.raises(ValueError):
            batch_buckets(bad)
        with pytest.raises(ValueError):
            width_classes(bad)


def make_thinker(seed: int = 0) -> Thinker:
    torch.manual_seed(seed)
    return Thinker(dataclasses.replace(ThinkerConfig.tiny(), vocab_size=512)).eval()


def prefill(model, cache: PagedKVCache, tables: list[list[int]], lengths: list[int], seed: int) -> None:
    """Write ``lengths[b]`` random tokens of each sequence into ``cache`` (one eager ragged step)."""
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(sum(lengths), model.config.hidden_size, generator=g).to(cache.device)
    batch = PagedBatch.build(tables, [0] * len(tables), lengths, None, BS, cache.device)
    with torch.inference_mode():
        model.forward_paged(embeds, batch, cache)


def two_caches(model, num_blocks: int = 40, storage_dtype: torch.dtype | None = None
               ) -> tuple[PagedKVCache, PagedKVCache]:
    c = model.config
    heads = c.num_key_value_heads
    return tuple(PagedKVCache(c.num_hidden_layers, num_blocks, BS, heads, c.head_dim, storage_dtype=storage_dtype)
                 for _ in range(2))


def _values(cache: PagedKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's K and V of blocks 1.. as values (an fp8 pool's dequantized)."""
    ids = torch.arange(1, cache.num_blocks)
    kv = [cache.gather_blocks(layer, ids) for layer in range(cache.num_layers)]
    return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])


@pytest.mark.parametrize("storage", [None, torch.float8_e4m3fn], ids=["model_dtype", "fp8"])
def test_padded_step_matches_eager_decode_over_several_steps(storage):
    """3 sequences of different lengths (bucket 4: one padding row), 5 decode steps: the
    hidden states and every K/V the steps wrote match the eager unpadded step (fp8: each row
    is quantized with its own scale, so a padding row cannot change a real row's bytes)."""
    model = make_thinker()
    eager_cache, graph_cache = two_caches(model, storage_dtype=storage)
    tables = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]
    lengths = [33, 17, 255]   # the last one crosses into its 17th block: width class 32
    for cache in (eager_cache, graph_cache):
        prefill(model, cache, tables, lengths, seed=1)
    runner = PagedDecodeGraphs("thinker", model.forward_paged, graph_cache, model.config.hidden_size,
                               torch.float32, max_batch=5, max_blocks_per_seq=40, capture=False)
    assert runner.buckets == (1, 2, 4, 8) and runner.widths == (16, 32, 64)
    pool_before = _values(graph_cache)[0].clone()
    computed = list(lengths)
    g = torch.Generator().manual_seed(2)
    for step in range(5):
        embeds = torch.randn(3, model.config.hidden_size, generator=g)
        batch = PagedBatch.build(tables, computed, [1, 1, 1], None, BS)
        with torch.inference_mode():
            want = model.forward_paged(embeds, batch, eager_cache)
            got = runner.run(embeds, tables, computed)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        computed = [c + 1 for c in computed]
    assert runner.stats.replays == 5 and runner.stats.captures == 0
    # Padding rows only ever touch the null block: every other block equals the eager pool.
    (gk, gv), (ek, ev) = _values(graph_cache), _values(eager_cache)
    torch.testing.assert_close(gk, ek, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gv, ev, rtol=1e-5, atol=1e-5)
    assert not torch.equal(gk, pool_before)   # the steps did write


def test_run_refuses_what_it_cannot_hold():
    model = make_thinker()
    cache, _ = two_caches(model)
    runner = PagedDecodeGraphs("thinker", model.forward_paged, cache, model.config.hidden_size, torch.float32,
                               max_batch=2, max_blocks_per_seq=16, capture=False)
    h = model.config.hidden_size
    assert runner.can_run(2, 16) and not runner.can_run(3, 1) and not runner.can_run(1, 17) and not runner.can_run(0, 1)
    assert runner.accepts([[1], [2]]) and runner.stats.eager_fallbacks == 0
    assert not runner.accepts([[1], [2], [3]]) and not runner.accepts([list(range(1, 18))])
    assert runner.stats.eager_fallbacks == 2
    with pytest.raises(ValueError, match="outside the captured range"):
        runner.run(torch.zeros(3, h), [[1], [2], [3]], [0, 0, 0])
    with pytest.raises(ValueError, match="past its"):
        runner.run(torch.zeros(1, h), [[1]], [16])           # index 16 needs a second block
    with pytest.raises(ValueError, match="null block"):
        runner.run(torch.zeros(1, h), [[0]], [0])
    with pytest.raises(ValueError, match="rows"):
        runner.run(torch.zeros(2, h), [[1]], [0])
    with pytest.raises(ValueError, match="CUDA"):
        PagedDecodeGraphs("x", model.forward_paged, cache, h, torch.float32, max_batch=1, max_blocks_per_seq=1)


def test_stage0_decode_goes_through_the_runner_and_falls_back_when_too_many():
    from duplexcache.kv.block_pool import BlockPool
    from duplexcache.kv.kv_cache_manager import KVCacheManager
    from duplexcache.kv.window import WindowConfig
    from duplexcache.runtime.stage0.runner import SessionContextInput, Stage0Runner

    def runner_pair():
        model = make_thinker(seed=3)
        out = []
        for _ in range(2):
            cache = model.make_kv_cache(64, BS)
            out.append(Stage0Runner(model, KVCacheManager(BlockPool(64), BS, cache.bytes_per_block), cache,
                                    WindowConfig(mode="off"), share_context=False, block_size=BS))
        return model, out

    model, (eager, graphed) = runner_pair()
    graphs = PagedDecodeGraphs("thinker", model.forward_paged, graphed.cache, model.config.hidden_size,
                               torch.float32, max_batch=2, max_blocks_per_seq=8, capture=False)
    graphed.use_decode_graphs(graphs)
    with pytest.raises(ValueError, match="another KV cache"):
        eager.use_decode_graphs(graphs)
    ids = torch.randint(10, 500, (20,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ctx = SessionContextInput(model.embed(ids).clone(), ids, b"k")
    for r in (eager, graphed):
        for sid in ("a", "b", "c"):
            r.open_session(sid, ctx)
    for step, sids in enumerate((["a", "b"], ["a", "b", "c"], ["c"])):   # the 3-session step falls back
        toks = {sid: 11 + step for sid in sids}
        want, got = eager.decode(toks), graphed.decode(toks)
        for sid in sids:
            torch.testing.assert_close(got.logits[sid], want.logits[sid], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.hidden[sid], want.hidden[sid], rtol=1e-5, atol=1e-5)
    assert graphs.stats.replays == 2 and graphs.stats.eager_fallbacks == 1


def talker_units(max_batch: int, ragged_kernel: bool = False):
    """A tiny Talker, an eager cache and a runner's cache, a runner, and three speaking units'
    requests (condition rows 3, 5 and 4)."""
    torch.manual_seed(5)
    cfg = TalkerConfig.tiny()
    talker = Talker(cfg).eval()
    caches = [PagedKVCache(cfg.num_hidden_layers, 20, BS, cfg.num_key_value_heads, cfg.head_dim) for _ in range(2)]
    caches[1].ragged_steps_in_kernel = ragged_kernel
    graphs = PagedDecodeGraphs("talker", talker.forward_paged, caches[1], cfg.hidden_size, torch.float32,
                               max_batch=max_batch, max_blocks_per_seq=8, capture=False)
    tables = [[1, 4, 6, 8], [2, 3, 5, 7], [9, 10, 11, 12]]
    g = torch.Generator().manual_seed(6)
    reqs = [TalkerUnitRequest(t, 0, torch.randint(0, cfg.num_text_tokens, (n,), generator=g),
                              torch.randn(n, cfg.llm_dim, generator=g)) for t, n in zip(tables, (3, 5, 4))]
    return cfg, talker, caches, graphs, reqs


def test_generate_unit_with_graphs_gives_the_same_codes():
    cfg, talker, caches, graphs, reqs = talker_units(max_batch=4)
    want = generate_unit(talker, caches[0], reqs)
    got = generate_unit(talker, caches[1], reqs, graphs=graphs)
    for w, r in zip(want, got):
        assert torch.equal(w.codes, r.codes) and w.num_computed == r.num_computed
    assert graphs.stats.replays == cfg.tokens_per_unit + 1   # 24 one-token steps + the closing step as two
    # Too many requests for the runner: the whole unit runs eagerly and says so.
    small = PagedDecodeGraphs("talker", talker.forward_paged, caches[1], cfg.hidden_size, torch.float32,
                              max_batch=2, max_blocks_per_seq=8, capture=False)
    again = [dataclasses.replace(r, num_computed=w.num_computed) for r, w in zip(reqs, want)]
    generate_unit(talker, caches[1], again, graphs=small)
    assert small.stats.replays == 0 and small.stats.eager_fallbacks == 1


@pytest.mark.parametrize("storage", [None, torch.float8_e4m3fn], ids=["model_dtype", "fp8"])
def test_ragged_step_as_token_rows_matches_the_eager_ragged_step(storage):
    """``run_ragged`` (engine.cuda_graphs): a unit-sized append of 12, 11 and 1 tokens to
    three sequences of different lengths, run as 24 token rows (bucket 24 of max_batch 30),
    gives the eager ragged step's hidden states and writes the same K/V; a second ragged step
    then reads what the first wrote. Padding rows touch only the null block."""
    model = make_thinker()
    eager_cache, graph_cache = two_caches(model, storage_dtype=storage)
    tables = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]
    lengths = [20, 17, 250]
    for cache in (eager_cache, graph_cache):
        prefill(model, cache, tables, lengths, seed=1)
        cache.ragged_steps_in_kernel = True   # what stage0.ragged_kernel sets; run_ragged needs it
    runner = PagedDecodeGraphs("thinker", model.forward_paged, graph_cache, model.config.hidden_size,
                               torch.float32, max_batch=30, max_blocks_per_seq=40, capture=False)
    computed = list(lengths)
    g = torch.Generator().manual_seed(2)
    for num_new in ([12, 11, 1], [3, 0, 5]):
        assert runner.accepts_ragged(tables, num_new)
        embeds = torch.randn(sum(num_new), model.config.hidden_size, generator=g)
        batch = PagedBatch.build(tables, computed, num_new, None, BS)
        with torch.inference_mode():
            want = model.forward_paged(embeds, batch, eager_cache)
            got = runner.run_ragged(embeds, tables, computed, num_new)
        assert got.shape == want.shape == (sum(num_new), model.config.hidden_size)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        computed = [c + n for c, n in zip(computed, num_new)]
    assert runner.stats.ragged_replays == 2 and runner.stats.replays == 0
    (gk, gv), (ek, ev) = _values(graph_cache), _values(eager_cache)
    torch.testing.assert_close(gk, ek, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gv, ev, rtol=1e-5, atol=1e-5)


def test_the_static_step_carries_each_programs_row_group():
    """cache.ragged_tokens_per_program: a ragged step's static buffers name each kernel program's rows
    (runs of one sequence's tokens, then the padding rows one each, then idle programs) and the
    step's PagedBatch hands them to the kernel; a decode step, and the switch off, one row each."""
    model = make_thinker()
    cache, _ = two_caches(model)
    prefill(model, cache, [[1, 2], [3]], [5, 2], seed=1)
    cache.ragged_steps_in_kernel, cache.ragged_tokens_per_program = True, 4
    seen = []

    def forward(embeds, batch, c):
        seen.append([t.tolist() for t in batch.row_groups])
        return model.forward_paged(embeds, batch, c)

    runner = PagedDecodeGraphs("thinker", forward, cache, model.config.hidden_size, torch.float32,
                               max_batch=16, max_blocks_per_seq=16, capture=False)
    with torch.inference_mode():
        runner.run_ragged(torch.zeros(7, model.config.hidden_size), [[1, 2], [3]], [5, 2], [6, 1])   # bucket 8
        runner.run(torch.zeros(2, model.config.hidden_size), [[1, 2], [3]], [11, 3])                 # bucket 2
        cache.ragged_tokens_per_program = 1
        runner.run_ragged(torch.zeros(7, model.config.hidden_size), [[1, 2], [3]], [12, 4], [2, 5])
    assert seen[0] == [[0, 4, 6, 7, 0, 0, 0, 0], [4, 2, 1, 1, 0, 0, 0, 0]]
    assert seen[1] == [[0, 1], [1, 1]]
    assert seen[2] == [list(range(8)), [1] * 8]


def test_accepts_ragged_only_short_steps_that_fit_with_the_ragged_kernel():
    model = make_thinker()
    cache, _ = two_caches(model)
    runner = PagedDecodeGraphs("thinker", model.forward_paged, cache, model.config.hidden_size, torch.float32,
                               max_batch=40, max_blocks_per_seq=16, capture=False)
    tables = [[1, 2], [3]]
    assert not runner.accepts_ragged(tables, [12, 10])      # stage0.ragged_kernel off: the reference path
    cache.ragged_steps_in_kernel = True
    assert runner.accepts_ragged(tables, [12, 10])
    assert not runner.accepts_ragged(tables, [33, 1])       # past the ragged kernel's tokens per sequence
    assert not runner.accepts_ragged(tables, [30, 11])      # 41 rows: past the largest bucket
    assert not runner.accepts_ragged([list(range(1, 18)), [3]], [1, 1])   # a table past the widest graph
    assert runner.accepts_ragged([list(range(1, 18)), [3]], [0, 2])       # ... unless it adds no token
    assert not runner.accepts_ragged(tables, [0, 0])
    assert runner.stats.eager_fallbacks == 0                # long steps are eager by design, not fallbacks


def test_row_buckets_past_max_batch_take_a_unit_tick_of_every_session():
    """``max_rows``: coarse power-of-two row buckets past the decode buckets, for ragged steps only
    (a decode step of more sequences than ``max_batch`` still falls back); 5 sessions x 12 rows
    on a max_batch-4 runner replay the 64-row bucket and match the eager ragged step."""
    from duplexcache.kv.decode_graphs import row_buckets

    assert row_buckets(48, 768) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 64, 128, 256, 512, 1024)
    assert row_buckets(4) == batch_buckets(4) and row_buckets(1, 3) == (1, 2, 4)
    model = make_thinker()
    eager_cache, graph_cache = two_caches(model)
    tables = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]]
    lengths = [5, 9, 1, 14, 3]
    for cache in (eager_cache, graph_cache):
        prefill(model, cache, tables, lengths, seed=1)
        cache.ragged_steps_in_kernel = True
    runner = PagedDecodeGraphs("thinker", model.forward_paged, graph_cache, model.config.hidden_size,
                               torch.float32, max_batch=4, max_blocks_per_seq=16, capture=False, max_rows=64)
    assert runner.buckets == (1, 2, 4) and runner.row_buckets == (1, 2, 4, 8, 16, 32, 64) and runner.max_rows == 64
    assert [b for b, _ in runner.keys()][:1] == [64]         # the warm-up captures the row buckets, largest first
    num_new = [12] * 5
    assert runner.accepts_ragged(tables, num_new) and not runner.accepts_ragged(tables * 2, [12] * 10)
    assert not runner.accepts(tables)                        # a 5-sequence decode step: past max_batch
    embeds = torch.randn(60, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = model.forward_paged(embeds, PagedBatch.build(tables, lengths, num_new, None, BS), eager_cache)
        got = runner.run_ragged(embeds, tables, lengths, num_new)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_values(graph_cache)[0], _values(eager_cache)[0], rtol=1e-5, atol=1e-5)
    assert runner.is_warm(64, 16)


def test_generate_unit_runs_its_condition_step_as_token_rows():
    """With ``ragged_graphs`` the condition step (3 + 5 + 4 rows) replays the runner too, and the
    codes are the eager unit's."""
    cfg, talker, caches, graphs, reqs = talker_units(max_batch=16, ragged_kernel=True)
    want = generate_unit(talker, caches[0], reqs)
    got = generate_unit(talker, caches[1], reqs, graphs=graphs, ragged_graphs=True)
    for w, r in zip(want, got):
        assert torch.equal(w.codes, r.codes) and w.num_computed == r.num_computed
    assert graphs.stats.ragged_replays == 1 and graphs.stats.replays == cfg.tokens_per_unit + 1
    # Without the switch the condition step stays eager (the A/B reference).
    again = [dataclasses.replace(r, num_computed=w.num_computed) for r, w in zip(reqs, want)]
    generate_unit(talker, caches[1], again, graphs=graphs)
    assert graphs.stats.ragged_replays == 1


def test_talker_position_limit_is_checked_without_the_device():
    cfg = dataclasses.replace(TalkerConfig.tiny(), max_position_embeddings=20)
    talker = Talker(cfg).eval()
    cache = PagedKVCache(cfg.num_hidden_layers, 4, BS, cfg.num_key_value_heads, cfg.head_dim)
    batch = PagedBatch.build([[1, 2]], [20], [1], None, BS)
    with pytest.raises(ValueError, match="position 20 >= max_position_embeddings 20"):
        talker.forward_paged(torch.zeros(1, cfg.hidden_size), batch, cache)


def test_warm_prepares_keys_without_touching_sequences():
    """warm() (the engine's warm-up) runs a key's all-padding step: only the null block is
    written, a later run of that key is no first use, and keys() lists largest first."""
    model = make_thinker()
    cache, _ = two_caches(model)
    cache.k.normal_()
    live_k, live_v = cache.k[:, 1:].clone(), cache.v[:, 1:].clone()
    runner = PagedDecodeGraphs("thinker", model.forward_paged, cache, model.config.hidden_size, torch.float32,
                               max_batch=5, max_blocks_per_seq=40, capture=False)
    assert runner.keys() == [(b, w) for b in (8, 4, 2, 1) for w in (64, 32, 16)]
    assert runner.keys(max_width=32) == [(b, w) for b in (8, 4, 2, 1) for w in (32, 16)]
    with torch.inference_mode():
        assert runner.warm(4, 16) and not runner.warm(4, 16)
        assert runner.stats.first_uses == 1 and runner.is_warm(4, 16) and not runner.is_warm(2, 16)
        assert torch.equal(cache.k[:, 1:], live_k) and torch.equal(cache.v[:, 1:], live_v)
        runner.run(torch.zeros(3, model.config.hidden_size), [[1], [2], [3]], [0, 0, 0])   # bucket 4, width 16
        assert runner.stats.first_uses == 1                                             # already warm
        runner.run(torch.zeros(1, model.config.hidden_size), [[1]], [1])                  # bucket 1: a first use
        assert runner.stats.first_uses == 2 and runner.stats.captures == 0
    with pytest.raises(ValueError, match="bucket x width"):
        runner.warm(3, 16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("storage", [None, torch.float8_e4m3fn], ids=["model_dtype", "fp8"])
def test_cuda_graph_replay_equals_the_same_padded_step_eagerly(storage):
    """fp8: the graph captured the scale tensors' addresses (allocated with the pool) too."""
    pytest.importorskip("triton")
    model = make_thinker().cuda()
    c = model.config
    caches = [PagedKVCache(c.num_hidden_layers, 40, BS, c.num_key_value_heads, c.head_dim, device="cuda",
                           storage_dtype=storage) for _ in range(2)]
    tables, lengths = [[1, 2, 3], [4, 5]], [40, 20]
    runners = []
    for capture, cache in zip((True, False), caches):
        cache.set_decode_backend("triton")
        prefill(model, cache, tables, lengths, seed=1)
        runners.append(PagedDecodeGraphs("thinker", model.forward_paged, cache, c.hidden_size, torch.float32,
                                         max_batch=4, max_blocks_per_seq=8, capture=capture))
    computed = list(lengths)
    for step in range(3):
        embeds = torch.randn(2, c.hidden_size, generator=torch.Generator().manual_seed(step)).cuda()
        with torch.inference_mode():
            outs = [r.run(embeds, tables, computed) for r in runners]
        assert torch.equal(outs[0], outs[1]), step
        computed = [n + 1 for n in computed]
    assert runners[0].stats.captures == 1 and runners[0].stats.replays == 3
    k0, k1 = caches[0].k[:, 1:], caches[1].k[:, 1:]
    if storage is not None:   # torch.equal has no float8 kernel: compare the bytes
        k0, k1 = k0.view(torch.uint8), k1.view(torch.uint8)
    assert torch.equal(k0, k1)
    if storage is not None:
        assert torch.equal(caches[0].k_scale[:, 1:], caches[1].k_scale[:, 1:])
        assert torch.equal(caches[0].v_scale[:, 1:], caches[1].v_scale[:, 1:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ragged_step_as_graph_rows_matches_the_eager_ragged_kernel_step():
    """On the device: a unit-sized ragged step (12 and 11 tokens) replayed from a captured decode
    graph as token rows gives the eager ragged-kernel step's hidden states and K/V to float32
    rounding (another row count and split plan), and a second replay reads what the first wrote."""
    pytest.importorskip("triton")
    model = make_thinker().cuda()
    c = model.config
    caches = [PagedKVCache(c.num_hidden_layers, 40, BS, c.num_key_value_heads, c.head_dim, device="cuda")
              for _ in range(2)]
    tables, lengths = [[1, 2, 3, 6], [4, 5, 7]], [30, 20]
    for cache in caches:
        cache.set_decode_backend("triton")
        cache.ragged_steps_in_kernel = True
        prefill(model, cache, tables, lengths, seed=1)
    runner = PagedDecodeGraphs("thinker", model.forward_paged, caches[1], c.hidden_size, torch.float32,
                               max_batch=24, max_blocks_per_seq=8, capture=True)
    computed = list(lengths)
    for step, num_new in enumerate(([12, 11], [2, 9])):
        embeds = torch.randn(sum(num_new), c.hidden_size, generator=torch.Generator().manual_seed(step)).cuda()
        batch = PagedBatch.build(tables, computed, num_new, None, BS, "cuda")
        with torch.inference_mode():
            want = model.forward_paged(embeds, batch, caches[0])
            assert runner.accepts_ragged(tables, num_new)
            got = runner.run_ragged(embeds, tables, computed, num_new)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        computed = [n + k for n, k in zip(computed, num_new)]
    assert caches[0].path_counts["ragged_kernel"] > 0 and runner.stats.ragged_replays == 2
    torch.testing.assert_close(caches[1].k[:, 1:], caches[0].k[:, 1:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(caches[1].v[:, 1:], caches[0].v[:, 1:], rtol=1e-4, atol=1e-4)
