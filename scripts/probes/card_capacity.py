"""Expected sessions admitted on a card for a minicpmo45 deploy config, from shapes only.

    python scripts/probes/card_capacity.py [--config examples/minicpmo45-shared.yaml] [--policy reply]
                                    [--total-gib 79.6] [--outside-gib 2.31] [--activation-gib 3.0]

The engine itself plans on the ``meta`` device (the models' shapes, no weights, nothing
allocated; as tests/runtime/test_memory_budget.py does): the same footprints, fixed buffers and
``plan_memory`` that serve uses, with the device's free memory injected. Two plans: before issue
43 (the config's fixed activation_reserve, ``fixed + 0.9 x free``, whole Talker turns: the
``model`` policy's reservation) and after (``engine.activation_from_warmup``: the measured peak
plus the re-plan's 1 GiB margin, ``free - memory_headroom``, the policy's Talker turn). What
shapes cannot give is an argument, defaulting to issue 43's H100 measurement: the device total (79.6 GiB), what lives outside PyTorch (CUDA
context, cuBLAS, Triton: 79.6 - 10.96 free - 66.33 reserved = 2.31 GiB) and the warm-up's peak
above the pools (assumed 3 GiB: the graph pools measured 1.4 GiB, plus the prefill and encoder
transients; the GPU run measures it). ``--policy reply`` is what ``gpu_bench.sh`` serves with.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

GIB, MIB = 2**30, 2**20
WEIGHTS = 18125065184          # minicpmo45's weight_bytes (issue 43)

logger = logging.getLogger("card_capacity")


def meta_models():
    """minicpmo45 with meta weights (shapes only), the two synthetic voices."""
    from duplexcache.models.audio_encoder import AudioEncoder
    from duplexcache.runtime.bundle import meta_model_bundle

    # The reference-audio check reads values (isfinite), which meta tensors do not have.
    AudioEncoder._check_mel = lambda self, mel, batched: None
    return meta_model_bundle("minicpmo45")


def plan_on_card(models, config: Path, policy: str | None, after: bool, free_after_weights: int,
                 activation: int):
    """The engine's plan on ``meta`` with ``free_after_weights`` bytes free on the device."""
    from duplexcache.config import DeployConfig
    from duplexcache.runtime.memory import memory_budget as MB
    from duplexcache.runtime.memory.replan import ACTIVATION_MARGIN
    from duplexcache.runtime.engine import DuplexEngine

    raw = DeployConfig.from_yaml(config, environ={}).to_dict()
    raw["model"]["device"] = "meta"
    if policy:
        raw["engine"]["speak_policy"]["mode"] = policy
    if not after:   # whole Talker turns, as before issue 43: a policy with no bound reserves them
        raw["engine"]["speak_policy"]["mode"] = "model"
    deploy = DeployConfig.from_dict(raw, environ={})
    # mem_get_info after the fixed buffers are allocated: the engine asks once they are
    fixed_box: list[int] = []
    resolve = MB.resolve_memory_budget
    MB.device_free_bytes = lambda device: free_after_weights - fixed_box[0] if fixed_box else None

    def on_the_card(engine_cfg, fixed, free, *, where="the device"):
        return resolve(engine_cfg, fixed, free_after_weights - fixed, where=where)

    MB.resolve_memory_budget = on_the_card
    try:
        eng = DuplexEngine(deploy, models)   # plan 1: the config's reserve, 0.9 x free
        if not after:
            return eng.plan, deploy.engine.activation_reserve, eng
        e = deploy.engine
        fixed_box.append(eng.sizing.fixed_bytes())
        # plan 2, as replan_after_warmup makes it: measured peak + margin, free - headroom
        reserve = activation + ACTIVATION_MARGIN
        return eng.sizing.plan(activation_reserve=reserve, headroom=e.memory_headroom), reserve, eng
    finally:
        MB.resolve_memory_budget = resolve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=Path("examples/minicpmo45-shared.yaml"))
    ap.add_argument("--policy", choices=("reply", "model", "every_k_units"), default="reply",
                    help="engine.speak_policy.mode (gpu_bench.sh serves the example with reply)")
    ap.add_argument("--total-gib", type=float, default=79.6)
    ap.add_argument("--outside-gib", type=float, default=2.31, help="outside PyTorch (H100: 79.6 - 10.96 - 66.33)")
    ap.add_argument("--activation-gib", type=float, default=3.0, help="warm-up peak above the pools (assumed)")
    ap.add_argument("--arena-cut-gib", type=float, default=0.0,
                    help="fixed bytes another change gives back (the Code2Wav arena without the prompt copy per "
                         "row): counted as free memory, the arena here stays as built")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    models = meta_models()
    total = int(a.total_gib * GIB)
    free_after_weights = total - WEIGHTS - int(a.outside_gib * GIB) + int(a.arena_cut_gib * GIB)
    for after in (False, True):
        plan, reserve, eng = plan_on_card(models, a.config, a.policy, after, free_after_weights,
                                          int(a.activation_gib * GIB))
        from duplexcache.runtime.memory.floor import session_floor
        from duplexcache.cfm.config import Code2WavShape
        from duplexcache.kv.kv_quant import kv_storage_dtype

        d = eng.deploy
        floor = session_floor(models.thinker.config, d.stage0.window.high_tokens,
                              Code2WavShape.from_flow(models.flow), models.voices.get("default").prompt_frames,
                              models.audio_encoder.cfg, d.model.dtype, code2wav_dtype=d.precision.code2wav_dtype,
                              kv_storage_dtype=kv_storage_dtype(d.precision.kv_cache_dtype),
                              encoder_storage_dtype=kv_storage_dtype(d.precision.encoder_cache_dtype)).total
        floor_limited = (total - WEIGHTS) / floor
        fp = eng.sizing.footprint(eng.sizing.default_config("default"), eng.voices.get("default"))
        per = (fp.thinker_private_blocks * plan.thinker_block_bytes + fp.talker_blocks * plan.talker_block_bytes
               + fp.dynamic_private_bytes)
        logger.info("%s, %s policy: fixed %.2f GiB, activation reserve %.2f GiB, budget %.2f GiB; per session "
                    "%.1f MiB (Thinker %d blocks, Talker %d blocks = %.1f MiB, Code2Wav+encoder %.1f MiB); "
                    "%d admitted; floor %.1f MiB, floor-limited %.2f; admitted / floor-limited = %.3f",
                    "after" if after else "before", d.engine.speak_policy.mode, plan.fixed_bytes / GIB, reserve / GIB,
                    (plan.budget_bytes + reserve) / GIB, per / MIB, fp.thinker_private_blocks, fp.talker_blocks,
                    fp.talker_blocks * plan.talker_block_bytes / MIB, fp.dynamic_private_bytes / MIB,
                    plan.planned_sessions, floor / MIB, floor_limited, plan.planned_sessions / floor_limited)


if __name__ == "__main__":
    main()
