"""The DiT's fused residual + LayerNorm + modulation (cfm/dit_norms.py): the Triton kernel (run on
CPU by Triton's interpreter, and on CUDA where there is one) against the torch operators and a
float64 reference; a whole plan solved through it against the torch path; sharing on/off through
it `torch.equal`; which one the arena picks.

TRITON_INTERPRET must be set before the kernel is decorated and is process-wide, so in an ordinary
run one test reruns this file in a fresh process with TRITON_INTERPRET=1, where the others run
directly (the CUDA test and the choice test run in the ordinary process).
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from triton_interpreter import rerun_unless_interpreted  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not installed: the kernel cannot run")

from helpers import make_config, run_plan, tiny_models, token_stream, voice_inputs  # noqa: E402

import duplexcache.cfm.dit_norms as dn  # noqa: E402
from duplexcache.cfm.arena import _kernel_choice  # noqa: E402
from duplexcache.cfm.code2wav import BatchedCode2Wav  # noqa: E402

_INTERPRETED = dn.norm_kernel_available(torch.device("cpu"))
_RUNNER = "test_in_a_fresh_interpreter_process"
interpreted = pytest.mark.skipif(not _INTERPRETED, reason=f"needs the Triton interpreter; {_RUNNER} runs it")
cuda = pytest.mark.skipif(_INTERPRETED or not torch.cuda.is_available(), reason="needs a compiled CUDA kernel")


def test_in_a_fresh_interpreter_process():
    out = rerun_unless_interpreted(_INTERPRETED, __file__)
    assert "9 passed" in out, out[-2000:]   # the interpreted tests and the choice test


def _inputs(dtype, device="cpu", b=3, w=7, hidden=96, strided=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(b, w, hidden, generator=gen) * 3 + 1).to(device, dtype)
    a = torch.randn(b, hidden, w, generator=gen).to(device, dtype).transpose(1, 2) if strided else \
        torch.randn(b, w, hidden, generator=gen).to(device, dtype)
    gate, shift = (torch.randn(hidden, generator=gen).to(device, dtype) for _ in range(2))
    scale1 = (1 + torch.randn(hidden, generator=gen)).to(device, dtype)
    return h, gate, a, shift, scale1


def _float64(h, gate, a, shift, scale1, residual):
    h, gate, a, shift, scale1 = (t.double() for t in (h, gate, a, shift, scale1))
    if residual:
        h = h + gate * a
    return h, F.layer_norm(h, (h.shape[-1],), eps=dn.LAYER_NORM_EPS) * scale1 + shift


def _check(dtype, device, residual, strided, hidden=96):
    """Each output within a few roundings of the dtype of the float64 value, and no further from it
    than the torch operators' output (plus one rounding)."""
    h, gate, a, shift, scale1 = _inputs(dtype, device, hidden=hidden, strided=strided)
    args = (gate, a) if residual else (None, None)
    got_h, got_y = dn.residual_norm_modulate_triton(h, *args, shift, scale1)
    ref_h, ref_y = dn.residual_norm_modulate_torch(h, *args, shift, scale1)
    want_h, want_y = _float64(h, gate, a, shift, scale1, residual)
    ulp = torch.finfo(dtype).eps
    for got, ref, want in ((got_h, ref_h, want_h), (got_y, ref_y, want_y)):
        assert got.dtype == dtype and got.shape == h.shape and got.is_contiguous()
        err_got = ((got.double() - want).abs() / (want.abs() + 1)).max().item()
        err_ref = ((ref.double() - want).abs() / (want.abs() + 1)).max().item()
        assert err_got <= 8 * ulp, (err_got, ulp)
        assert err_got <= err_ref + 2 * ulp, (err_got, err_ref)
    if not residual:
        assert got_h is h


@interpreted
@pytest.mark.parametrize("dtype,residual,strided", [
    (torch.float32, True, False), (torch.float32, True, True), (torch.float32, False, False),
    (torch.bfloat16, True, True)])
def test_kernel_against_float64_and_the_torch_operators(dtype, residual, strided):
    _check(dtype, "cpu", residual, strided)


@interpreted
def test_kernel_refuses_what_it_cannot_read():
    h, gate, a, shift, scale1 = _inputs(torch.float32)
    with pytest.raises(ValueError, match="contiguous"):
        dn.residual_norm_modulate_triton(h.transpose(0, 1), gate, a, shift, scale1)
    with pytest.raises(ValueError, match="96 contiguous values"):
        dn.residual_norm_modulate_triton(h, gate, a, shift[:10], scale1)


@interpreted
@pytest.mark.parametrize("with_workspace", [True, False])
def test_projections_kernel_against_the_module_operators(with_workspace):
    """One GEMM over the stacked q, k, v weights and one kernel for q_norm, k_norm and the key
    writes: q, the row's new keys and values, and the workspace's copy of them within float32
    rounding of the module's operators; everything past the chunk's frames untouched."""
    from duplexcache.models.flow import DiTAttention

    torch.manual_seed(0)
    attn = DiTAttention(64, 2, 32)
    for norm in (attn.q_norm, attn.k_norm):   # affine norms that are not the identity
        torch.nn.init.normal_(norm.weight)
        torch.nn.init.normal_(norm.bias)
    b2, w, cap = 4, 5, 9
    x = torch.randn(b2, w, 64)
    fill = torch.randn(b2, 2, cap + 3, 64)
    weight, bias = torch.zeros(1, 192, 64), torch.zeros(1, 192)
    dn.stack_qkv([type("Block", (), {"attn": attn})()], weight, bias)
    outs = {}
    for name in ("torch", "triton"):
        att = fill.clone()[:, :, 1:cap + 1]                 # a strided view, as the arena's rows are
        ws = fill.clone()[:, :, :cap] if with_workspace else None
        fn = dn.project_torch if name == "torch" else dn.project_triton
        with torch.no_grad():
            q = fn(attn, x, att, ws, weight[0], bias[0])
        outs[name] = q, att, ws
    (q_ref, att_ref, ws_ref), (q, att, ws) = outs["torch"], outs["triton"]
    assert q.shape == (b2, 2, w, 32) and torch.allclose(q, q_ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(att, att_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(att[:, :, w:], fill[:, :, 1 + w:cap + 1])
    if with_workspace:
        assert torch.allclose(ws, ws_ref, atol=1e-5, rtol=1e-5) and torch.equal(ws[:, :, :w], att[:, :, :w])
        assert torch.equal(ws[:, :, w:], fill[:, :, w:cap])


VOICES = {"a": voice_inputs(11, 10)}
# Small: the interpreter runs every program of every kernel in Python
PLAN = {"s0": ("a", 0, token_stream(80, 2))}


@interpreted
def test_a_plan_through_the_kernels_is_near_the_torch_path():
    """What CUDA runs (the fused kernels inside the solve) against the torch operators: within
    float32 rounding over a stream (the voice's setup pass, a chunk, the final chunk). Sharing on vs off
    through the kernels is `torch.equal` on CUDA (tests/cfm/test_graphs.py), where they run."""
    flow, hift = tiny_models()
    kw = dict(max_num_seqs=2, graph_grid=(1, 2), arena_rows_from_graph_grid=True, prompt_att_sharing=True)
    runs = {}
    for norms in ("torch", "triton"):
        stage = BatchedCode2Wav(flow, hift, make_config(flow, **kw), dit_norms=norms)
        assert stage.arena.kernels.name == norms and stage.arena.private_gather == "torch"   # only these kernels
        runs[norms] = run_plan(stage, VOICES, PLAN, 2)
    for sid in PLAN:
        for kind in (0, 1):
            ref, got = runs["torch"][sid][kind], runs["triton"][sid][kind]
            assert len(got) == 2
            for r, g in zip(ref, got, strict=True):
                assert ((g - r).norm() / r.norm()).item() <= 1e-5, sid
            assert kind == 1 or any(not torch.equal(g, r) for r, g in zip(ref, got))   # the kernels did run


def test_the_arena_picks_the_kernel_on_cuda_only():
    cuda_dev, cpu = torch.device("cuda"), torch.device("cpu")
    assert _kernel_choice("dit_norms", "auto", cuda_dev, True) == "triton"
    assert _kernel_choice("dit_norms", "auto", cuda_dev, False) == "torch"
    assert _kernel_choice("dit_norms", "auto", cpu, True) == "torch"   # the interpreter is for tests only
    assert _kernel_choice("dit_norms", "torch", cuda_dev, True) == "torch"
    with pytest.raises(ValueError, match="cannot run"):
        _kernel_choice("dit_norms", "triton", cpu, False)
    with pytest.raises(ValueError, match="must be"):
        _kernel_choice("dit_norms", "fast", cpu, True)
    flow, hift = tiny_models()
    stage = BatchedCode2Wav(flow, hift, make_config(flow))
    assert stage.arena.dit_norms == "torch" and stage.arena.kernels.name == "torch"
    assert stage.arena.qkv_weight.numel() == 0          # no stacked projections without the kernels


@cuda
def test_a_cuda_stage_runs_the_kernels():
    """What the engine's Code2Wav stage builds on CUDA (dit_norms "auto") runs the fused kernels."""
    flow, hift = (copy.deepcopy(m).cuda() for m in tiny_models())   # the helpers cache the CPU models
    stage = BatchedCode2Wav(flow, hift, make_config(flow))
    assert stage.arena.dit_norms == "triton" and stage.arena.kernels.name == "triton"
    assert stage.arena.qkv_weight.shape[0] == len(flow.decoder.estimator.blocks)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_against_float64_and_the_torch_operators(dtype):
    for residual, strided in ((True, False), (True, True), (False, False)):
        _check(dtype, "cuda", residual, strided, hidden=512)
