"""Device check: the runtime split count gives the same bytes as the constexpr one, and compiles less."""
# .whl/old_triton_kernels.py was `git show 92791ba:duplexcache/kv/triton_kernels.py` (the constexpr split count)
import importlib.util, json, os, sys, time
import torch
out = os.environ["OUT"]

def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod); return mod

res = {}
for label, path in (("old", ".whl/old_triton_kernels.py"), ("new", "duplexcache/kv/triton_kernels.py")):
    mod = load(path, f"tk_{label}")
    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, d, page = 16, 2, 128, 16
    nblocks = 600
    q = torch.randn(3, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(nblocks, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(nblocks, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    table = torch.randint(1, nblocks, (3, 512), device="cuda", dtype=torch.int32, generator=g)
    seq_lens = torch.tensor([7000, 33, 4100], device="cuda", dtype=torch.int32)
    torch.cuda.synchronize(); t0 = time.perf_counter()
    outs = {}
    for splits in range(1, 23):
        outs[splits] = mod.paged_decode_attention(q, k, v, table, seq_lens, d ** -0.5, num_splits=splits).clone()
    torch.cuda.synchronize(); res[f"{label}_first_22_splits_s"] = time.perf_counter() - t0
    # fp8 pool
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    ks = torch.rand(nblocks, page, hkv, device="cuda", generator=g) + 0.5
    vs = torch.rand(nblocks, page, hkv, device="cuda", generator=g) + 0.5
    for splits in (1, 3, 16, 22):
        outs[f"fp8_{splits}"] = mod.paged_decode_attention(q, k8, v8, table, seq_lens, d ** -0.5, k_scale=ks, v_scale=vs, num_splits=splits).clone()
    qf, kf, vf = q.float(), k.float(), v.float()
    for splits in (1, 5, 16):
        outs[f"fp32_{splits}"] = mod.paged_decode_attention(qf, kf, vf, table, seq_lens, d ** -0.5, num_splits=splits).clone()
    outs["auto"] = mod.paged_decode_attention(q, k, v, table, seq_lens, d ** -0.5).clone()
    # launch time after compile (steady)
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(200):
        mod.paged_decode_attention(q, k, v, table, seq_lens, d ** -0.5, num_splits=7)
    torch.cuda.synchronize(); res[f"{label}_launch_us"] = (time.perf_counter() - t0) / 200 * 1e6
    res[label] = outs
equal = {str(key): bool(torch.equal(res["old"][key], res["new"][key])) for key in res["old"]}
summary = {k: v for k, v in res.items() if k not in ("old", "new")}
summary["all_equal"] = all(equal.values()); summary["equal"] = equal
print(json.dumps(summary, indent=1))
json.dump(summary, open(f"{out}/splits_check.json", "w"), indent=1)
