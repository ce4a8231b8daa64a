"""Issue 49 probe: where the device waits in a tick. Runs any ``duplexcache`` command (meant for
``bench ticks ... --profile-ticks N``) with each profiled block exported as a chrome trace, then
attributes the device's idle gaps (no kernel, copy or memset running) to the host:

    TRACE_OUT=DIR python scripts/probes/trace_gaps.py bench ticks --preset minicpmo45 --device cuda ... --profile-ticks 2

Per profiled block, ``DIR/gaps_N.json``: the window from the first to the last device event, its
busy and idle ms, idle by gap size, by the engine's profiler range (stage or Code2Wav part) whose
launch ended the gap, by the host operator that launched it, and by the host operator running at
the gap's middle (what the host was doing while the device waited). The trace itself is deleted
(tens of MB). An analysis aid, not a benchmark: the profiler's overhead lengthens host time.
"""
import bisect
import collections
import json
import os
import sys

import duplexcache.bench.tick_profile as tp
from torch.profiler import profile as _profile

OUT = os.environ["TRACE_OUT"]
os.makedirs(OUT, exist_ok=True)


def analyse(path):
    ev = json.load(open(path))["traceEvents"]
    dev = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    launches = {e["args"].get("correlation"): e for e in ev if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"}
    ranges = [e for e in ev if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e["name"].startswith("duplexcache.")]
    ops = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function")]
    dev.sort(key=lambda e: e["ts"])
    gaps = []
    t_first = dev[0]["ts"]
    busy = 0.0
    cur_s = cur_e = None
    for e in dev:
        s, en = e["ts"], e["ts"] + e["dur"]
        if cur_e is None:
            cur_s, cur_e = s, en
            continue
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((cur_e, s, e))
            cur_s, cur_e = s, en
        else:
            cur_e = max(cur_e, en)
    busy += cur_e - cur_s
    t_last = cur_e

    def innermost(items, t):
        best = None
        for r in items:
            if r["ts"] <= t <= r["ts"] + r["dur"] and (best is None or r["dur"] < best["dur"]):
                best = r
        return best
    ranges.sort(key=lambda r: r["ts"])
    by_range = collections.Counter()
    by_op = collections.Counter()
    by_launch_op = collections.Counter()
    sizes = collections.Counter()
    ops_main = sorted(ops, key=lambda o: o["ts"])
    starts = [o["ts"] for o in ops_main]
    for g0, g1, nxt in gaps:
        d = g1 - g0
        if d < 5:
            sizes["<5us"] += d
            continue
        sizes["5-50us" if d < 50 else "50-500us" if d < 500 else ">500us"] += d
        lau = launches.get(nxt["args"].get("correlation"))
        t = lau["ts"] if lau else g1
        r = innermost(ranges, t)
        by_range[r["name"] if r else "(none)"] += d
        if lau is not None:
            i = bisect.bisect_right(starts, t)
            cands = [o for o in ops_main[max(0, i - 400):i] if o["ts"] + o["dur"] >= t]
            top = min(cands, key=lambda o: o["dur"]) if cands else None
            by_launch_op[top["name"][:80] if top else lau["name"]] += d
        mid = (g0 + g1) / 2
        i = bisect.bisect_right(starts, mid)
        cands = [o for o in ops_main[max(0, i - 400):i] if o["ts"] + o["dur"] >= mid]
        top = min(cands, key=lambda o: o["dur"]) if cands else None
        by_op[top["name"][:80] if top else "(no host op)"] += d
    ms = lambda c: {k: round(v / 1e3, 2) for k, v in c.most_common(25)}
    return {"trace": os.path.basename(path), "window_ms": round((t_last - t_first) / 1e3, 1),
            "busy_ms": round(busy / 1e3, 1), "idle_ms": round((t_last - t_first - busy) / 1e3, 1),
            "gap_sizes_ms": ms(sizes), "idle_by_range_of_next_launch": ms(by_range),
            "idle_by_host_op_at_gap_middle": ms(by_op), "idle_by_host_op_launching_next": ms(by_launch_op)}


class TracedProfile(_profile):
    n = 0

    def __exit__(self, *a):
        r = super().__exit__(*a)
        TracedProfile.n += 1
        path = f"{OUT}/trace_{TracedProfile.n}.json"
        self.export_chrome_trace(path)
        try:
            res = analyse(path)
            json.dump(res, open(f"{OUT}/gaps_{TracedProfile.n}.json", "w"), indent=1)
            print(json.dumps(res, indent=1), flush=True)
        except Exception as exc:  # noqa: BLE001
            print("analysis failed", repr(exc), flush=True)
        os.remove(path)
        return r


tp.profile = TracedProfile
from duplexcache.cli import main  # noqa: E402
sys.exit(main(sys.argv[1:]))
