"""Wall time of AudioEncoder.stream_step, 32 sessions, tiny widths with 24 layers, 1 CPU thread:
median (min..max) of chunks 2..10. usage: PYTHONPATH=. python .../time_step.py LABEL"""
import statistics
import sys
import time

import torch

from duplexcache.models.audio_encoder import AudioEncoder, AudioEncoderConfig

torch.set_num_threads(1)
torch.manual_seed(0)
enc = AudioEncoder(AudioEncoderConfig.tiny(encoder_layers=24)).eval()
for dt in (None, torch.float8_e4m3fn):
    states = [enc.new_stream_state(storage_dtype=dt) for _ in range(32)]
    g = torch.Generator().manual_seed(1)
    times = []
    for t in range(10):
        chunks = [torch.rand(16560 if t == 0 else 16000, generator=g) - 0.5 for _ in states]
        t0 = time.perf_counter()
        enc.stream_step(states, chunks)
        times.append(1e3 * (time.perf_counter() - t0))
    rest = times[1:]
    print(f"{sys.argv[1]} {'fp8' if dt else 'model dtype'}: {statistics.median(rest):.1f} ms "
          f"({min(rest):.1f}..{max(rest):.1f})")
