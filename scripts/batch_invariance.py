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
exact mode; neither changes what is compared. Writes DIR/batch_invariance.json (after every arm).

Diagnostics: ``--arms on`` skips the off arm; ``--variants`` runs the on arm once per listed change
(VARIANTS below); ``--trace`` records the probe's Talker input and codes and its Code2Wav stages per
step and names the first step of each that differs from the lone run (on the H100 it found the
conformer's broadcast matmul, 2026-12-07).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import logging
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

# before torch: cuBLAS reads its workspace setting at its first use, and without a fixed workspace
# its reductions may differ run to run across streams (the `duplexcache` CLI sets the same)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np
import torch

from duplexcache.config import DeployConfig
from duplexcache.models.batch_invariant import BatchInvariantMode
from duplexcache.runtime.bundle import build_models
from duplexcache.runtime import engine as engine_module
from duplexcache.runtime.engine import DuplexEngine
from duplexcache.runtime.engine_api import AudioDelta, TextDelta
from duplexcache.runtime.stages import code2wav_stage as code2wav_stage_module
from duplexcache.runtime.stages import talker_stage as talker_stage_module

logger = logging.getLogger("batch_invariance")
STAGES = ("encoder", "thinker", "talker", "code2wav", "tick")


# Diagnostic variants (--variants): each changes one thing about the engine or the neighbours, so the
# first one whose probe is equal beside 1 and 31 names what varied. "same_voice": every neighbour
# speaks the probe's voice; "grid": Code2Wav graph tiers 1,4,8,16,32 (as the standalone probe
# scripts/code2wav_invariance_probe.py runs) instead of one per batch size; "eager_vocoder": the
# vocoder without CUDA graphs; "prompt_sharing": the voice prompt's attention cache shared;
# "tile1": the per-sample ops (conv, SDPA, FFT) one sample per call instead of tiles of 4;
# "no_mean": the mode without its fixed-order last-axis mean (RMSNorm's), the A/B of that family;
# "eager_llm": the Thinker, Talker and encoder without CUDA graphs (decode, ragged step, encoder pieces).
VARIANTS = ("default", "same_voice", "grid", "eager_vocoder", "prompt_sharing", "tile1", "no_mean", "eager_llm")


def _deploy(preset: str, device: str, batch_invariant: bool, variant: str = "default") -> DeployConfig:
    data = DeployConfig.default(preset, environ={}).to_dict()
    data["model"]["device"] = device
    data["stage0"]["window"].update(high_tokens=2048, low_tokens=1536)
    data["engine"].update(batch_invariant=batch_invariant, talker_turn_tokens=512, tick_headroom=1e9,
                          speak_policy={"mode": "every_k_units", "k": 3, "turn_units": 3})
    if variant == "grid":
        data["code2wav"].update(graph_grid=[1, 4, 8, 16, 32], max_num_seqs=32)
    elif variant == "prompt_sharing":
        data["code2wav"]["cfm_prompt_att_sharing"] = True
    elif variant == "eager_llm":
        data["engine"]["cuda_graphs"] = False   # the vocoder's graphs stay on (_mode_defaults)
    return DeployConfig.from_dict(data, environ={})


def _vocoder_graphs(on: bool):
    """The engines built inside with the vocoder's CUDA graphs ``on`` whatever engine.cuda_graphs
    says (one switch for every graph in the deploy config; the variants part them)."""
    build = code2wav_stage_module.code2wav_config
    return mock.patch.object(code2wav_stage_module, "code2wav_config", lambda deploy, models: dataclasses.replace(
        build(deploy, models), vocoder_cuda_graphs=on))


def _mode_defaults(variant: str):
    """The engine's BatchInvariantMode while the variant's engines run: "tile1" a per-sample tile of
    1, "no_mean" every op family but the last-axis mean; the mode as built otherwise. "eager_vocoder"
    and "eager_llm" part engine.cuda_graphs: the vocoder eager, the rest as graphs, and the reverse."""
    if variant == "eager_vocoder":
        return _vocoder_graphs(False)
    if variant == "eager_llm":
        return _vocoder_graphs(True)
    if variant == "tile1":
        return mock.patch.object(engine_module, "BatchInvariantMode", functools.partial(BatchInvariantMode, batch_tile=1))
    if variant == "no_mean":
        return mock.patch.object(engine_module, "BatchInvariantMode", functools.partial(
            BatchInvariantMode, ops=BatchInvariantMode.FAMILIES - {"mean"}))
    return contextlib.nullcontext()


@contextlib.contextmanager
def _trace(eng: DuplexEngine, sid: str) -> Iterator[dict[str, list]]:
    """While open, record session ``sid``'s Talker inputs and codes per unit (text ids, the Thinker's hidden rows)
    and its Code2Wav inputs and outputs per step: the codes of its chunk, the conformer output (mu),
    the solved mel and the float PCM (host copies: numerics unchanged)."""
    c2w, stage = eng.code2wav, eng.code2wav_stage
    rec: dict[str, list] = {"talker_text": [], "talker_hidden": [], "talker_codes": [],
                            "codes": [], "mu": [], "mel": [], "pcm": []}
    generate_unit = talker_stage_module.generate_unit

    def generate_hook(talker, cache, reqs, **kwargs):
        # the Talker's input from the Thinker (text ids, hidden rows) and its codes, for the session's
        # request (found by its block table): which of the two first differs names the stage
        results = generate_unit(talker, cache, reqs, **kwargs)
        table = eng.talker_kv.block_table(sid)   # [] between turns: no request matches
        if table:
            for req, res in zip(reqs, results):
                if req.block_table == table:
                    hidden = req.thinker_hidden
                    hidden = torch.stack(list(hidden)) if not torch.is_tensor(hidden) else hidden
                    rec["talker_text"].append(req.text_token_ids.detach().cpu().clone())
                    rec["talker_hidden"].append(hidden.detach().float().cpu().clone())
                    rec["talker_codes"].append(res.codes.detach().cpu().clone())
        return results
    streams: set[str] = set()    # Code2Wav's stream ids of the session (a new one per audio turn)
    stage_step, run_rows, vocode = stage._step, c2w._run_rows, c2w._vocode_group

    def step_hook(batch, last, owner):
        streams.clear()
        streams.update(csid for csid in batch if owner[csid].sid == sid)
        for csid in streams:
            rec["codes"].append(torch.as_tensor(batch[csid]).detach().cpu().clone())
        return stage_step(batch, last, owner)

    def rows_hook(rows, width, tier):
        for work, *_ in rows:
            if work.sid in streams:
                rec["mu"].append(work.mu.detach().float().cpu().clone())
        return run_rows(rows, width, tier)

    def vocode_hook(members, lasts):
        out = vocode(members, lasts)
        for csid in streams & set(out):
            rec["mel"].append(c2w.sessions[csid].last_mel.detach().float().cpu().clone())
            rec["pcm"].append(out[csid].detach().cpu().clone())
        return out
    stage._step, c2w._run_rows, c2w._vocode_group = step_hook, rows_hook, vocode_hook
    # the Talker stage calls its module's generate_unit: patched only while this engine runs
    with mock.patch.object(talker_stage_module, "generate_unit", generate_hook):
        yield rec


def _first_difference(got: dict[str, list], ref: dict[str, list]) -> dict:
    """Per recorded stage: the first step whose tensor differs from the alone run's, and by how much."""
    out = {}
    for stage in ("talker_text", "talker_hidden", "talker_codes", "codes", "mu", "mel", "pcm"):
        a, b = got.get(stage, []), ref.get(stage, [])
        first = None
        for i, (x, y) in enumerate(zip(a, b)):
            if x.shape != y.shape or not torch.equal(x, y):
                diff = None if x.shape != y.shape else float((x.double() - y.double()).abs().max())
                first = {"step": i, "max_abs": diff, "elements": None if x.shape != y.shape else
                         int((x != y).sum())}
                break
        out[stage] = {"steps": [len(a), len(b)], "first_difference": first}
    return out


def _audio(seed: int, units: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-0.3, 0.3, 16_560 + 16_000 * (units - 1)).astype(np.float32)


def probe(models, deploy: DeployConfig, others: int, units: int, same_voice: bool = False,
          trace: bool = False) -> dict:
    eng = DuplexEngine(deploy, models)
    voices = eng.voices.names()
    first = eng.open_session({"voice": voices[0], "instructions": "probe"})
    sids = [first] + [eng.open_session({"voice": voices[0 if same_voice else (i + 1) % len(voices)],
                                        "instructions": f"other {i % 3}"})
                      for i in range(others)]
    with _trace(eng, first) if trace else contextlib.nullcontext() as rec:
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
    return {"pcm": bytes(pcm), "text": text, "ms": {s: statistics.median(v) for s, v in lat.items() if v},
            "trace": rec}


def _pcm_diff(got: bytes, ref: bytes) -> dict | None:
    """Samples that differ and the largest difference in LSB (None when the lengths differ)."""
    if len(got) != len(ref):
        return None
    d = np.frombuffer(got, "<i2").astype(np.int32) - np.frombuffer(ref, "<i2")
    where = np.flatnonzero(d)
    return {"samples": int(where.size), "max_lsb": int(np.abs(d).max(initial=0)),
            "first_sample": int(where[0]) if where.size else None, "last_sample": int(where[-1]) if where.size else None}


def _arm(models, args, counts: list[int], arm: bool, variant: str) -> dict:
    """The probe alone twice (the control), then beside each count of others, for one arm and variant."""
    deploy = _deploy(args.preset, args.device, arm, variant)
    with _mode_defaults(variant):
        alone = probe(models, deploy, 0, args.units, trace=args.trace)
        # the control: the same lone run again. Unequal means the run is not deterministic, and a
        # difference beside others says nothing about batch invariance
        again = probe(models, deploy, 0, args.units)
        rows = {"0": {"equal": True, "ms": alone["ms"], "pcm_bytes": len(alone["pcm"]),
                      "repeat_equal": again["pcm"] == alone["pcm"] and again["text"] == alone["text"],
                      "repeat_pcm_diff": _pcm_diff(again["pcm"], alone["pcm"])}}
        logger.info("batch_invariant=%s %s alone twice: equal %s %s", arm, variant, rows["0"]["repeat_equal"],
                    rows["0"]["repeat_pcm_diff"])
        for n in counts:
            got = probe(models, deploy, n, args.units, same_voice=variant == "same_voice", trace=args.trace)
            diff = _pcm_diff(got["pcm"], alone["pcm"])
            rows[str(n)] = {"text_equal": got["text"] == alone["text"], "pcm_equal": got["pcm"] == alone["pcm"],
                            "equal": got["text"] == alone["text"] and got["pcm"] == alone["pcm"],
                            "pcm_diff": diff, "ms": got["ms"]}
            if args.trace:
                rows[str(n)]["code2wav_trace"] = _first_difference(got["trace"], alone["trace"])
            logger.info("batch_invariant=%s %s beside %d: text %s, pcm %s %s; ms %s; trace %s", arm, variant, n,
                        rows[str(n)]["text_equal"], rows[str(n)]["pcm_equal"], diff, got["ms"],
                        rows[str(n)].get("code2wav_trace"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="minicpmo45")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--others", default="1,7,31")
    ap.add_argument("--units", type=int, default=6)
    ap.add_argument("--arms", default="on,off", help="engine.batch_invariant arms to run: on, off or both")
    ap.add_argument("--variants", default="default",
                    help=f"comma-separated diagnostic variants of the on arm ({', '.join(VARIANTS)})")
    ap.add_argument("--trace", action="store_true",
                    help="record the probe's Talker inputs and codes per unit and its Code2Wav codes, mu, mel and PCM "
                         "per step, and name the first that differs")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    counts = [int(c) for c in args.others.split(",")]
    arms = [a.strip() for a in args.arms.split(",")]
    variants = [v.strip() for v in args.variants.split(",")]
    if set(arms) - {"on", "off"} or set(variants) - set(VARIANTS):
        ap.error(f"--arms takes on/off, --variants {', '.join(VARIANTS)}")
    models = build_models(_deploy(args.preset, args.device, True))
    # --trace copies tensors to the host inside the ticks: its per-stage ms are not the switch's cost
    result = {"preset": args.preset, "device": args.device, "units": args.units, "traced": args.trace, "arms": {},
              "hardware": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "date": time.strftime("%Y-%m-%d")}
    args.out.mkdir(parents=True, exist_ok=True)
    for arm in arms:
        for variant in (variants if arm == "on" else ["default"]):
            name = arm if variant == "default" else f"{arm}_{variant}"
            result["arms"][name] = _arm(models, args, counts, arm == "on", variant)
            # written after every arm: a run cut short keeps what it measured
            (args.out / "batch_invariance.json").write_text(json.dumps(result, indent=2))
    top = str(counts[-1])
    if "on" in result["arms"] and "off" in result["arms"]:
        for stage in STAGES:
            on, off = result["arms"]["on"][top]["ms"].get(stage), result["arms"]["off"][top]["ms"].get(stage)
            if on is not None and off is not None:
                print(f"{stage:9s} beside {top}: on {on:8.1f} ms  off {off:8.1f} ms  cost {on - off:+8.1f} ms")
    for arm, rows in result["arms"].items():
        print(arm, {n: r["equal"] for n, r in rows.items()})


if __name__ == "__main__":
    main()
