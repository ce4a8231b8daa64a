"""All aten ops (views included: what costs host time on any device) of one steady
AudioEncoder.stream_step_mel at 40 sessions, tiny widths with 24 layers. usage: PYTHONPATH=. python ... LABEL"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from duplexcache.models.audio_encoder import AudioEncoder, AudioEncoderConfig

torch.manual_seed(0)
enc = AudioEncoder(AudioEncoderConfig.tiny(encoder_layers=24)).eval()
states = [enc.new_stream_state() for _ in range(40)]
g = torch.Generator().manual_seed(1)
enc.stream_step(states, [torch.rand(16560, generator=g) - 0.5 for _ in states])
mels = list(enc.log_mel(torch.rand(40, 16000, generator=g) - 0.5))
with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
    enc.stream_step_mel(states, mels)
ops = [e for e in prof.events() if e.name.startswith("aten::")]
top = sorted({e.name for e in ops}, key=lambda n: -sum(1 for e in ops if e.name == n))[:5]
print(sys.argv[1], "aten ops:", len(ops), {n: sum(1 for e in ops if e.name == n) for n in top})
