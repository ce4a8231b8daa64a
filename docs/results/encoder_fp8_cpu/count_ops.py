import sys, torch
from torch.profiler import profile, ProfilerActivity
from duplexcache.models.audio_encoder import AudioEncoder, AudioEncoderConfig
torch.manual_seed(0)
enc = AudioEncoder(AudioEncoderConfig.tiny()).eval()
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
    evs = prof.events()
    leaves = [e for e in evs if not e.cpu_children and e.name.startswith("aten::") and e.name not in
              ("aten::empty", "aten::empty_strided", "aten::as_strided", "aten::view", "aten::slice", "aten::select",
               "aten::transpose", "aten::unsqueeze", "aten::expand", "aten::reshape", "aten::t", "aten::permute",
               "aten::_reshape_alias", "aten::alias", "aten::detach", "aten::lift_fresh", "aten::resolve_conj",
               "aten::resolve_neg", "aten::result_type", "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense")]
    print(sys.argv[1], "fp8" if dt else "model dtype", "compute ops per stream_step (32 sessions):", len(leaves))
