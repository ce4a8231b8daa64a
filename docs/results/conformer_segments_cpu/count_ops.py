"""Compute ops of the Code2Wav conformer in one step (a proxy for CUDA launches), 40 streams of 3
voices (prompts of 20, 22 and 24 frames) at spread ages, so that their conformer caches have 9
lengths, as a conversation's streams do; the tiny flow's widths with minicpmo45's 6 + 4 conformer
layers. A compute op: a leaf aten op that is not a view. Also: the step's conformer calls and
attention segments (BatchStats).

usage (repo root): PYTHONPATH=.:tests/cfm python docs/results/conformer_segments_cpu/count_ops.py LABEL
"""
import dataclasses
import sys

import torch
from helpers import make_config, randomize, token_stream, voice_inputs
from torch.profiler import ProfilerActivity, profile

from duplexcache.cfm.code2wav import PART_RANGE, BatchedCode2Wav
from duplexcache.models.flow import FlowConfig, build_flow
from duplexcache.models.vocoder import VocoderConfig, build_vocoder

VIEWS = {"aten::empty", "aten::empty_strided", "aten::as_strided", "aten::view", "aten::slice",
         "aten::select", "aten::transpose", "aten::unsqueeze", "aten::expand", "aten::reshape",
         "aten::t", "aten::permute", "aten::_reshape_alias", "aten::alias", "aten::detach",
         "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::result_type",
         "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense", "aten::unbind",
         "aten::split", "aten::chunk", "aten::narrow", "aten::view_as", "aten::_unsafe_view",
         "aten::split_with_sizes"}

torch.manual_seed(0)
flow = build_flow(dataclasses.replace(FlowConfig.tiny(), num_blocks=6, num_up_blocks=4))
randomize(flow, 1)
hift = build_vocoder(VocoderConfig.tiny())
randomize(hift, 2)
stage = BatchedCode2Wav(flow, hift, make_config(flow, max_num_seqs=40))
for i, name in enumerate("abc"):
    stage.register_voice(name, *voice_inputs(11 + i, 10 + i))
streams = {f"s{i}": ("abc"[i % 3], token_stream(100 + i, 8)) for i in range(40)}
for tick in range(4):   # streams start at ticks 0..3: at the measured step their ages are 0..3 chunks
    for i, (sid, (voice, _)) in enumerate(streams.items()):
        if i % 4 == tick:
            stage.add_session(sid, voice, seed=i)
    chunks = {sid: toks[tick - int(sid[1:]) % 4] for sid, (_, toks) in streams.items()
              if sid in stage.sessions or sid in stage._pending}
    if tick < 3:
        stage.step(chunks)
    else:
        segments_before = getattr(stage.batch_stats, "conformer_segments", 0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            stage.step(chunks)


def inside(e, name: str) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name == name:
            return True
        p = p.cpu_parent
    return False


ops = sum(1 for e in prof.events() if e.name.startswith("aten::") and e.name not in VIEWS and not e.cpu_children
          and inside(e, PART_RANGE + "conformer"))
s = stage.batch_stats
print(f"{sys.argv[1]}: conformer compute ops in the step: {ops}; calls {len(s.last_conformer_groups)}, "
      f"rows {sum(map(len, s.last_conformer_groups))}, "
      f"attention segments {getattr(s, 'conformer_segments', 0) - segments_before or 'one per call'}")
