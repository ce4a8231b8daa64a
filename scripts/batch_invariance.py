"""engine.batch_invariant on a real preset (issue #42): is a session's output the same alone and
beside 1, 7 and 31 others, and what does the switch cost per stage? One process, both arms.

    python scripts/batch_invariance.py --preset minicpmo45 --device cuda --out DIR

For each arm (switch on, then off): the probe alone twice (the control: a run that is not
deterministic says nothing about invariance), then for each neighbour count a fresh engine, the probe session
opened first (its Code2Wav noise seed follows the open order), every context prefilled before the
first unit, the same seeded audio for the probe, other voices / contexts / audio for the others.
The probe's text and pcm16 are compared with the alone run (bytes); per-stage tick latency is the
median over the ticks after the first two (graph captures) at the largest neighbour count.
The window is short (2048/1536) and a Talker turn 512 tokens so 32 sessions fit an 80 GB card in
exact mode; neither changes what is compared. Writes DIR/batch_invariance.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import time
from pathlib import Path

# before torch: cuBLAS reads its workspace setting at its first use, and without a fixed workspace
# its reductions may differ run to run across streams (the `duplexcache` CLI sets the same)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np
import torch

from duplexcache.config import DeployConfig
from duplexcache.runtime.bundle import build_models
from duplexcache.runtime.engine import DuplexEngine
from duplexcache.runtime.engine_api import AudioDelta, TextDelta

logger = logging.getLogger("batch_invariance")
STAGES = ("encoder", "thinker", "talker", "code2wav", "tick")


def _deploy(preset: str, device: str, batch_invariant: bool) -> DeployConfig:
    data = DeployConfig.default(preset, environ={}).to_dict()
    data["model"]["device"] = device
    data["stage0"]["window"].update(high_tokens=2048, low_tokens=1536)
    data["engine"].update(batch_invariant=batch_invariant, talker_turn_tokens=512, tick_headroom=1e9,
                          speak_policy={"mode": "every_k_units", "k": 3, "turn_units": 3})
    return DeployConfig.from_dict(data, environ={})


def _audio(seed: int, units: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-0.3, 0.3, 16_560 + 16_000 * (units - 1)).astype(np.float32)


def probe(models, deploy: DeployConfig, others: int, units: int) -> dict:
    eng = DuplexEngine(deploy, models)
    voices = eng.voices.names()
    first = eng.open_session({"voice": voices[0], "instructions": "probe"})
    sids = [first] + [eng.open_session({"voice": voices[(i + 1) % len(voices)], "instructions": f"other {i % 3}"})
                      for i in range(others)]
    while eng.prefill_pending():
        eng.prefill_step()
    for i, sid in enumerate(sids):
        eng.push_audio(sid, _audio(77 if sid == first else i, units))
    pcm, text, lat = bytearray(), [], {s: [] for s in STAGES}
    for k in range(units + 1):
        for e in eng.tick():
            if e.sid == first and isinstance(e, AudioDelta):
                pcm += e.pcm16
            elif e.sid == first and isinstance(e, TextDelta):
                text.append(e.text)
        if k >= 2:   # past the first ticks' graph captures
            for s in STAGES:
                lat[s].append(eng.latency_history[s][-1] * 1000)
    eng.shutdown()
    del eng
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"pcm": bytes(pcm), "text": text, "ms": {s: statistics.median(v) for s, v in lat.items() if v}}


def _pcm_diff(got: bytes, ref: bytes) -> dict | None:
    """Samples that differ and the largest difference in LSB (None when the lengths differ)."""
    if len(got) != len(ref):
        return None
    d = np.frombuffer(got, "<i2").astype(np.int32) - np.frombuffer(ref, "<i2")
    return {"samples": int(np.count_nonzero(d)), "max_lsb": int(np.abs(d).max(initial=0))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="minicpmo45")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--others", default="1,7,31")
    ap.add_argument("--units", type=int, default=6)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    counts = [int(c) for c in args.others.split(",")]
    models = build_models(_deploy(args.preset, args.device, True))
    result = {"preset": args.preset, "device": args.device, "units": args.units, "arms": {},
              "hardware": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "date": time.strftime("%Y-%m-%d")}
    for arm in (True, False):
        deploy = _deploy(args.preset, args.device, arm)
        alone = probe(models, deploy, 0, args.units)
        # the control: the same lone run again. Unequal means the run is not deterministic, and a
        # difference beside others says nothing about batch invariance
        again = probe(models, deploy, 0, args.units)
        rows = {"0": {"equal": True, "ms": alone["ms"], "pcm_bytes": len(alone["pcm"]),
                      "repeat_equal": again["pcm"] == alone["pcm"] and again["text"] == alone["text"],
                      "repeat_pcm_diff": _pcm_diff(again["pcm"], alone["pcm"])}}
        logger.info("batch_invariant=%s alone twice: equal %s %s", arm, rows["0"]["repeat_equal"],
                    rows["0"]["repeat_pcm_diff"])
        for n in counts:
            got = probe(models, deploy, n, args.units)
            diff = _pcm_diff(got["pcm"], alone["pcm"])
            rows[str(n)] = {"text_equal": got["text"] == alone["text"], "pcm_equal": got["pcm"] == alone["pcm"],
                            "equal": got["text"] == alone["text"] and got["pcm"] == alone["pcm"],
                            "pcm_diff": diff, "ms": got["ms"]}
            logger.info("batch_invariant=%s beside %d: text %s, pcm %s %s; ms %s", arm, n,
                        rows[str(n)]["text_equal"], rows[str(n)]["pcm_equal"], diff, got["ms"])
        result["arms"]["on" if arm else "off"] = rows
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "batch_invariance.json").write_text(json.dumps(result, indent=2))
    top = str(counts[-1])
    for stage in STAGES:
        on, off = result["arms"]["on"][top]["ms"].get(stage), result["arms"]["off"][top]["ms"].get(stage)
        if on is not None and off is not None:
            print(f"{stage:9s} beside {top}: on {on:8.1f} ms  off {off:8.1f} ms  cost {on - off:+8.1f} ms")
    for arm, rows in result["arms"].items():
        print(arm, {n: r["equal"] for n, r in rows.items()})


if __name__ == "__main__":
    main()
