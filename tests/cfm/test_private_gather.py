"""The arena's private-key gather: the Triton kernel (run on CPU by Triton's interpreter) against
the torch gather and an independent per-key loop, and a whole plan solved through the kernel
against the old layout (`torch.equal`).

TRITON_INTERPRET must be set before the kernel is decorated and is process-wide (it would turn
every kernel of the collecting process into interpreted code), so in an ordinary run one test
reruns this file in a fresh process with TRITON_INTERPRET=1, where the others run directly.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from triton_interpreter import rerun_unless_interpreted, skip_unless_interpreted  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not installed: the kernel cannot be interpreted")

from helpers import make_config, run_plan, tiny_models, token_stream, voice_inputs  # noqa: E402

import duplexcache.cfm.private_gather as pg  # noqa: E402
from duplexcache.cfm.code2wav import BatchedCode2Wav  # noqa: E402

_INTERPRETED = pg._INTERPRETED and pg.triton_gather_available(torch.device("cpu"))
_RUNNER = "test_in_a_fresh_interpreter_process"


@pytest.fixture(autouse=True)
def _interpreted_only(request):
    skip_unless_interpreted(request, _INTERPRETED, _RUNNER)


def test_in_a_fresh_interpreter_process():
    out = rerun_unless_interpreted(_INTERPRETED, __file__)
    assert "4 passed" in out, out[-2000:]   # all but this one ran there


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_torch_gather_and_a_per_key_loop(dtype):
    gen = torch.Generator().manual_seed(0)
    steps, layers, heads, hd2, width, lb, keys = 2, 3, 3, 12, 5, 75, 90
    lengths = [4, 0, 70, 1]            # a padded row (0); 70 keys: two programs' blocks (64 keys each)
    caps = [7, 1, 80, 3]               # storages of different frame counts
    storages = [torch.randn(steps, layers, 2, heads, c, hd2, generator=gen).to(dtype) for c in caps]
    positions = torch.zeros(len(lengths), keys, dtype=torch.long)
    for r, (d, c) in enumerate(zip(lengths, caps)):
        positions[r, :d] = torch.randperm(c, generator=gen)[:d]
    base = torch.tensor([s.data_ptr() for s in storages])
    cap = torch.tensor(caps)
    tier = len(lengths)
    for step in range(steps):
        for layer in range(layers):
            fill = torch.randn(2 * tier, heads, keys, hd2, generator=gen).to(dtype)
            got, ref = fill.clone(), fill.clone()
            pg.gather_private_triton(got, base, cap, torch.tensor(lengths), positions, step * layers + layer,
                                     width, lb)
            pg.gather_private_torch(ref, storages, lengths, positions, step, layer, width)
            want = fill.clone()
            for r, d in enumerate(lengths):
                for j in range(d):
                    for c in range(2):
                        want[2 * r + c, :, width + j] = storages[r][step, layer, c, :, positions[r, j]]
            assert torch.equal(ref, want)
            assert torch.equal(got, want)                # keys j >= d_r and outside [W, W + d) untouched


VOICES = {"a": voice_inputs(11, 10), "b": voice_inputs(12, 12)}
PLAN = {f"s{i}": ("a" if i % 2 else "b", i // 2, token_stream(70 + i, 4)) for i in range(3)}


@pytest.mark.parametrize("sharing", [True, False])
def test_plan_through_the_kernel_equals_the_old_layout(sharing):
    """The solve with the Triton gather (what CUDA runs, inside its graphs) gives the old layout's
    bits: padded rows (tier 4 for 3 rows), trims, recycled delta frames, two voices."""
    flow, hift = tiny_models()
    kw = dict(prompt_att_sharing=sharing, max_num_seqs=4, graph_grid=(1, 4), arena_rows_from_graph_grid=True)
    old = BatchedCode2Wav(flow, hift, make_config(flow, **kw), prompt_in_place=False)
    new = BatchedCode2Wav(flow, hift, make_config(flow, **kw))
    new.arena.private_gather = "triton"
    want, got = run_plan(old, VOICES, PLAN, 6), run_plan(new, VOICES, PLAN, 6)
    for sid in PLAN:
        for kind in (0, 1):
            assert len(got[sid][kind]) == 4
            for a, b in zip(got[sid][kind], want[sid][kind], strict=True):
                assert torch.equal(a, b), sid
