"""Compute ops of one AudioEncoder.stream_step at 32 sessions (a proxy for CUDA launches).

A compute op is a leaf aten op that is not a view or a host-side bookkeeping op; a `_foreach_*`
op counts once with everything under it (on CUDA its fast path is one kernel for the list; on
CPU it loops). The tiny preset's widths with minicpmo45's 24 layers (the count scales with the
layers), second chunk of every session, so every session has a cache to store into and gather.

usage: PYTHONPATH=. python docs/results/encoder_batched_copies_cpu/count_ops.py LABEL
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from duplexcache.models.audio_encoder import AudioEncoder, AudioEncoderConfig

NOT_COMPUTE = {"aten::empty", "aten::empty_strided", "aten::as_strided", "aten::view", "aten::slice",
               "aten::select", "aten::transpose", "aten::unsqueeze", "aten::expand", "aten::reshape",
               "aten::t", "aten::permute", "aten::_reshape_alias", "aten::alias", "aten::detach",
               "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::result_type",
               "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense", "aten::unbind",
               "aten::split", "aten::chunk", "aten::narrow", "aten::view_as", "aten::_unsafe_view"}


def compute_ops(prof) -> int:
    def under_foreach(e) -> bool:
        p = e.cpu_parent
        while p is not None:
            if p.name.startswith("aten::_foreach_"):
                return True
            p = p.cpu_parent
        return False
    n = 0
    for e in prof.events():
        if not e.name.startswith("aten::") or e.name in NOT_COMPUTE or under_foreach(e):
            continue
        if e.name.startswith("aten::_foreach_") or not e.cpu_children:
            n += 1
    return n


torch.manual_seed(0)
enc = AudioEncoder(AudioEncoderConfig.tiny(encoder_layers=24)).eval()
for dt in (None, torch.float8_e4m3fn):
    states = [enc.new_stream_state(storage_dtype=dt) for _ in range(32)]
    g = torch.Generator().manual_seed(1)
    for t in range(2):
        chunks = [torch.rand(16560 if t == 0 else 16000, generator=g) - 0.5 for _ in states]
        if t == 1:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                enc.stream_step(states, chunks)
        else:
            enc.stream_step(states, chunks)
    print(sys.argv[1], "fp8" if dt else "model dtype",
          "compute ops per stream_step (32 sessions, 24 layers):", compute_ops(prof))
