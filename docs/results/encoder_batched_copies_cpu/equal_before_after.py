"""Streaming encoder outputs of 6 sessions joining one tick apart (first chunks ride with later ones), 40 ticks, bfloat16 weights, cache in the model dtype and in fp8; saved to compare two checkouts with torch.equal."""
import sys, torch
from duplexcache.models.audio_encoder import AudioEncoder, AudioEncoderConfig
torch.manual_seed(0)
enc = AudioEncoder(AudioEncoderConfig.tiny()).eval().to(torch.bfloat16)
outs = {}
for name, dt in (("model", None), ("fp8", torch.float8_e4m3fn)):
    states = [enc.new_stream_state(storage_dtype=dt, growth_frames=16) for _ in range(6)]
    g = torch.Generator().manual_seed(1)
    res = []
    for t in range(40):
        # sessions join late: session i starts at tick i
        live = [i for i in range(6) if i <= t]
        chunks = [torch.rand(16560 if states[i].num_chunks == 0 else 16000, generator=g) - 0.5 for i in live]
        res.append(enc.stream_step([states[i] for i in live], chunks))
    outs[name] = res
torch.save(outs, sys.argv[1])
