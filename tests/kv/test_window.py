"""plan_compaction: block-aligned, unit-aligned, fallback and exceeded cases, plus a brute-force
reference over many random inputs."""

import random

import pytest

from duplexcache.kv.window import ContextLengthExceeded, WindowConfig, WindowPlan, plan_compaction

CFG = WindowConfig(mode="basic", high_tokens=100, low_tokens=60)

# (name, prefix, num_tokens, incoming, unit_starts, expected (dropped, kept range, new_num_tokens,
#  unit_aligned, reached_low) or None)
CASES = [
    ("under-high", 20, 100, 10, None, None),
    ("exactly-high", 20, 110, 10, None, None),
    # total 125 > 120; sink 2 blocks (32 tokens); excess over 80 is 45 -> 3 blocks (2, 3, 4).
    ("block-aligned", 20, 115, 10, None, (3, range(5, 8), 67, None, True)),
    ("one-over-high", 20, 111, 10, None, (3, range(5, 7), 63, None, True)),
    # unit start at token 80 = block 5 exactly at the needed cut.
    ("unit-at-needed-cut", 20, 115, 10, [33, 80, 97], (3, range(5, 8), 67, True, True)),
    # first unit start on a block boundary at or after the needed cut is 96 = block 6.
    ("unit-aligned-moves-cut", 20, 115, 10, [33, 70, 96, 101], (4, range(6, 8), 51, True, True)),
    # no unit start on a block boundary in blocks 5..7 -> block-aligned cut, flagged.
    ("unit-fallback", 20, 115, 10, [33, 70, 113, 128], (3, range(5, 8), 67, False, True)),
    # a unit start on a boundary before the needed cut does not count.
    ("unit-before-cut-ignored", 20, 115, 10, [48, 64], (3, range(5, 8), 67, False, True)),
    # incoming so large that low is out of reach; all full blocks dropped, still <= high.
    ("low-unreachable", 20, 119, 60, None, (5, range(7, 8), 39, None, False)),
    # prefix 0: no anchor blocks.
    ("no-prefix", 0, 100, 10, None, (4, range(4, 7), 36, None, True)),
]


@pytest.mark.parametrize("name,prefix,n,inc,units,want", CASES, ids=[c[0] for c in CASES])
def test_plan_table(name, prefix, n, inc, units, want):
    plan = plan_compaction(prefix, n, inc, CFG, block_size=16, unit_starts=units)
    if want is None:
        assert plan is None
        return
    dropped, kept, new_n, aligned, reached = want
    sink = -(-prefix // 16)
    assert plan == WindowPlan(sink_blocks=sink, first_dropped_block=sink, num_dropped_blocks=dropped,
                              delta_tokens=dropped * 16, kept_block_range=kept, new_num_tokens=new_n,
                              unit_aligned=aligned, reached_low=reached)
    assert plan.kept_block_range_after == range(kept.start - dropped, kept.stop - dropped)


@pytest.mark.parametrize("prefix,n,inc", [(20, 40, 100), (20, 47, 95), (200, 210, 150)])
def test_exceeded(prefix, n, inc):
    with pytest.raises(ContextLengthExceeded, match="context_length_exceeded") as e:
        plan_compaction(prefix, n, inc, CFG)
    assert e.value.code == "context_length_exceeded" and isinstance(e.value, ValueError)
    assert f"prefix + high = {prefix + 100}" in str(e.value)


def test_off_never_plans():
    assert plan_compaction(20, 10_000, 100, WindowConfig(mode="off", high_tokens=100, low_tokens=60)) is None


@pytest.mark.parametrize("kw,match", [
    (dict(mode="on"), "mode"), (dict(low_tokens=8000), "must be <"), (dict(low_tokens=-1), ">= 0"),
    (dict(high_tokens=10.5), "ints"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        WindowConfig(**kw)


def test_bad_inputs():
    with pytest.raises(ValueError, match="prefix_len <= num_tokens"):
        plan_compaction(50, 40, 1, CFG)


def reference_plan(prefix, n, inc, high, low, bs, units):
    """Brute force: try every number of dropped blocks from 0 up."""
    if n + inc <= prefix + high:
        return None
    sink = -(-prefix // bs)
    droppable = max(0, n // bs - sink)
    fits = [k for k in range(droppable + 1) if n + inc - k * bs <= prefix + low]
    if not fits:
        if n + inc - droppable * bs > prefix + high:
            return "exceeded"
        return droppable, None if units is None else ((sink + droppable) * bs in units)
    k = fits[0]
    if units is None:
        return k, None
    aligned = [j for j in range(k, droppable + 1) if (sink + j) * bs in units]
    return (aligned[0], True) if aligned else (k, False)


def test_matches_brute_force_reference():
    rng = random.Random(0)
    for _ in range(3000):
        bs = rng.choice([4, 16])
        high = rng.randint(2, 200)
        low = rng.randint(0, high - 1)
        prefix = rng.randint(0, 80)
        n = prefix + rng.randint(0, 260)
        inc = rng.randint(0, 40)
        units = None if rng.random() < 0.3 else set(rng.sample(range(n + 1), k=min(n + 1, rng.randint(0, 30))))
        cfg = WindowConfig("basic", high, low)
        want = reference_plan(prefix, n, inc, high, low, bs, units)
        if want == "exceeded":
            with pytest.raises(ContextLengthExceeded):
                plan_compaction(prefix, n, inc, cfg, bs, units)
            continue
        plan = plan_compaction(prefix, n, inc, cfg, bs, units)
        if want is None:
            assert plan is None
            continue
        assert (plan.num_dropped_blocks, plan.unit_aligned) == want, (prefix, n, inc, high, low, bs, units)
        assert plan.new_num_tokens + inc <= prefix + high
        if plan.reached_low:
            assert plan.new_num_tokens + inc <= prefix + low
