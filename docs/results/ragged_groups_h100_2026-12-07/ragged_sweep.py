"""Ad-hoc (not committed): the ragged append at engine shapes, rows_per_group x block_n x format."""
import json, sys, torch
from duplexcache.bench import gpu_stage0 as gb
from duplexcache.kv.triton_kernels import paged_decode_attention, row_groups_host
out = sys.argv[1]
s = gb.Shapes(batch=59, seq_len=7068, distinct_layers=3)
d = gb.DecodeSetup.build(s)
n = 12
dev = "cuda"
tables = d.bt.repeat_interleave(n, 0)
lens = d.seq_lens.repeat_interleave(n) - torch.arange(n - 1, -1, -1, dtype=torch.int32, device=dev).repeat(s.batch)
qs = [torch.randn(s.batch * n, s.q_heads, s.head_dim, device=dev, dtype=torch.bfloat16) for _ in d.qs]
sets = {"bf16": [(kv.paged_k, None, kv.paged_v, None) for kv in d.layers], "fp8": [gb.quantize_paged(kv) for kv in d.layers]}
rows = []
for fmt, ss in sets.items():
    # one decode step (1 row per session) for scale
    for per in (0, 1, 2, 4, 8, 16):
        for bn in (64, 128):
            if per == 0:
                def attn(i, ss=ss, bn=bn):
                    k, ks, v, vs = ss[i]
                    return paged_decode_attention(d.qs[i], k, v, d.bt, d.seq_lens, d.scale, k_scale=ks, v_scale=vs, block_n=bn)
            else:
                g = tuple(torch.tensor(x, dtype=torch.int32, device=dev) for x in row_groups_host([n] * s.batch, per))
                kw = {} if per == 1 else {"row_groups": g, "rows_per_group": per}
                def attn(i, ss=ss, bn=bn, kw=kw):
                    k, ks, v, vs = ss[i]
                    return paged_decode_attention(qs[i], k, v, tables, lens, d.scale, k_scale=ks, v_scale=vs, block_n=bn, **kw)
            t = gb.time_cuda("x", lambda: [attn(l % s.distinct_layers) for l in range(s.layers)], 3, 10).summary()
            rows.append({"fmt": fmt, "rows_per_group": per or "decode", "block_n": bn, "ms_36_layers": t["median_ms"], "min": t["min_ms"], "max": t["max_ms"]})
            print(rows[-1], flush=True)
json.dump(rows, open(out, "w"), indent=1)
