import time, torch, statistics, sys
from duplexcache.models.audio_encoder import AudioEncoder, AudioEncoderConfig
torch.manual_seed(0)
cfg = AudioEncoderConfig.tiny(encoder_layers=8) if 'encoder_layers' in AudioEncoderConfig.tiny.__code__.co_varnames else AudioEncoderConfig.tiny()
enc = AudioEncoder(cfg).eval()
torch.set_num_threads(1)
B = int(sys.argv[1]) if len(sys.argv) > 1 else 32
gen = torch.Generator().manual_seed(1)
states = [enc.new_stream_state() for _ in range(B)]
times = []
outs = []
for t in range(8):
    pcm = [torch.rand(16560 if t == 0 else 16000, generator=gen) - 0.5 for _ in range(B)]
    t0 = time.perf_counter(); o = enc.stream_step(states, pcm); times.append(time.perf_counter() - t0)
    outs.append(torch.stack(o).clone())
print(f"B={B} layers={cfg.encoder_layers} ms per step (ticks 2..8): median {1000*statistics.median(times[2:]):.1f} min {1000*min(times[2:]):.1f} max {1000*max(times[2:]):.1f}")
torch.save(outs, sys.argv[2] if len(sys.argv) > 2 else "/tmp/enc_out.pt")
