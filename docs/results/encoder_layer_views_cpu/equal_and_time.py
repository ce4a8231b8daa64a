"""AudioEncoder.stream_step at 40 sessions, tiny widths with 24 layers, 1 CPU thread: the
embeddings of 4 chunks (saved to compare two checkouts with torch.equal) and the wall time of
chunks 2..10 (median, min..max). usage: PYTHONPATH=. python .../equal_and_time.py LABEL OUT.pt"""
import statistics
import sys
import time

import torch

from duplexcache.models.audio_encoder import AudioEncoder, AudioEncoderConfig

torch.set_num_threads(1)
torch.manual_seed(0)
enc = AudioEncoder(AudioEncoderConfig.tiny(encoder_layers=24)).eval()
saved = {}
for dt in (None, torch.float8_e4m3fn):
    states = [enc.new_stream_state(storage_dtype=dt) for _ in range(40)]
    g = torch.Generator().manual_seed(1)
    times, outs = [], []
    for t in range(10):
        # sessions 0..3 start a chunk late: first and later chunks mix in one step
        chunks = [torch.rand(16560 if t == (1 if i < 4 else 0) else 16000, generator=g) - 0.5
                  for i, _ in enumerate(states)]
        active = [(s, c) for i, (s, c) in enumerate(zip(states, chunks)) if not (i < 4 and t == 0)]
        t0 = time.perf_counter()
        out = enc.stream_step([s for s, _ in active], [c for _, c in active])
        times.append(1e3 * (time.perf_counter() - t0))
        if t < 4:
            outs.append(torch.cat(out))
    saved["fp8" if dt else "model"] = torch.stack([o.sum(0) for o in outs]), outs
    rest = times[1:]
    print(f"{sys.argv[1]} {'fp8' if dt else 'model dtype'}: {statistics.median(rest):.1f} ms "
          f"({min(rest):.1f}..{max(rest):.1f})")
torch.save(saved, sys.argv[2])
