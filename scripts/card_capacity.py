"""Expected sessions admitted on a card, from shapes only (no weights, nothing on a device).

    python scripts/card_capacity.py [--total-gib 79.6] [--fixed-gib 9.87] [--activation-gib 3.0]

The plan's own arithmetic (runtime/admission.py plan_memory) over the minicpmo45 shapes of
examples/minicpmo45-shared.yaml as `gpu_bench.sh serve_conversation` serves it (the reply
policy, reply_max_units 8; window 8000; sharing on; float32 Code2Wav; bf16 KV), before and
after issue 43's changes. What shapes cannot give is an argument, with the H100 measurement
of issue 43 as its default: the device total, the fixed buffers (the Code2Wav arena is being
cut by the in-place prompt attention, elsewhere), what lives outside PyTorch (CUDA context,
cuBLAS/Triton: total - free - reserved = 79.6 - 10.96 - 66.33 GiB), and the warm-up's
activation peak (the graph pools measured 1.4 GiB on the H100, docs/benchmarks.md, plus the
prefill and encoder transients: an assumption until the GPU run measures it).
"""

from __future__ import annotations

import argparse
import logging

import torch

from duplexcache.bench.floor import session_floor
from duplexcache.cfm.code2wav import code2wav_session_bytes
from duplexcache.cfm.config import Code2WavConfig, Code2WavShape
from duplexcache.kv.paged_attention import bytes_per_block
from duplexcache.models.audio_encoder import AudioEncoderConfig
from duplexcache.models.talker import TalkerConfig
from duplexcache.models.thinker import ThinkerConfig
from duplexcache.runtime.policy import MAX_UNIT_TOKENS

logger = logging.getLogger("card_capacity")

GIB, MIB = 2**30, 2**20
WEIGHTS = 18125065184          # weight_bytes of minicpmo45 (issue 43)
BLOCK = 16
HIGH = 8000                    # stage0.window.high_tokens
P = 300                        # the voices' prompt frames (6 s)
# Thinker private blocks of the reference session at a full window: ceil((C + 8000) / 16) - C // 16
# for its context C; the H100 plan (10031 blocks for 20 sessions, issue 43) gives 501 (C % 16 != 0)
# with 10 shared blocks for the two voices' contexts.
THINKER_PRIVATE, THINKER_SHARED = 501, 10
REPLY_MAX_UNITS = 8


def per_session(talker_tokens: int) -> tuple[int, dict[str, int]]:
    dt = torch.bfloat16
    th, tk = ThinkerConfig.minicpmo45(), TalkerConfig.minicpmo45()
    tb = bytes_per_block(th.num_hidden_layers, BLOCK, th.num_key_value_heads, th.head_dim, dt)
    kb = bytes_per_block(tk.num_hidden_layers, BLOCK, tk.num_key_value_heads, tk.head_dim, dt)
    cfg = Code2WavConfig(shape=Code2WavShape.minicpmo45(), prompt_att_sharing=True)
    setup = code2wav_session_bytes(cfg, P, True, "setup", 4)
    steady = code2wav_session_bytes(cfg, P, True, "steady", 4)
    enc = AudioEncoderConfig.minicpmo45().kv_bytes_per_session(dt)
    parts = {"thinker": THINKER_PRIVATE * tb, "talker": -(-talker_tokens // BLOCK) * kb,
             "dynamic": max(setup.private, steady.private) + enc, "thinker_block": tb, "talker_block": kb}
    return parts["thinker"] + parts["talker"] + parts["dynamic"], parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-gib", type=float, default=79.6)
    ap.add_argument("--fixed-gib", type=float, default=9.87, help="fixed buffers (today's H100 plan: 9.87)")
    ap.add_argument("--outside-gib", type=float, default=2.31, help="outside PyTorch (H100: 79.6 - 10.96 - 66.33)")
    ap.add_argument("--activation-gib", type=float, default=3.0, help="warm-up peak above the pools (assumed)")
    ap.add_argument("--margin-gib", type=float, default=1.0, help="engine.activation_margin")
    ap.add_argument("--headroom-gib", type=float, default=1.0, help="engine.memory_headroom")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    total, fixed = a.total_gib * GIB, a.fixed_gib * GIB
    tk = TalkerConfig.minicpmo45()
    unit = MAX_UNIT_TOKENS + tk.tokens_per_unit + 1
    floor = session_floor(ThinkerConfig.minicpmo45(), HIGH, Code2WavShape.minicpmo45(), P,
                          AudioEncoderConfig.minicpmo45(), "bfloat16").total
    floor_limited = (total - WEIGHTS) / floor
    logger.info("floor %.1f MiB per session; floor-limited (%.1f GiB - weights) / floor = %.2f sessions",
                floor / MIB, a.total_gib, floor_limited)
    for name, talker_tokens, budget in (
            ("before (8 GiB reserve, 0.9 x free, whole 4096-token turns)", tk.max_position_embeddings,
             None),
            ("after (measured reserve + margin, free - headroom, reply turns)", REPLY_MAX_UNITS * unit,
             total - WEIGHTS - a.outside_gib * GIB - a.headroom_gib * GIB)):
        cost, parts = per_session(talker_tokens)
        if budget is None:   # today: fixed + 0.9 x free after weights and fixed, less 8 GiB
            free = total - WEIGHTS - a.outside_gib * GIB - fixed
            room = 0.9 * free - 8 * GIB
        else:
            room = budget - fixed - (a.activation_gib + a.margin_gib) * GIB
        room -= parts["thinker_block"] + parts["talker_block"] + THINKER_SHARED * parts["thinker_block"]
        n = int(room // cost)
        logger.info("%s: per session %.1f MiB (Thinker %.1f, Talker %.1f, Code2Wav+encoder %.1f); %d admitted; "
                    "admitted / floor-limited = %.3f", name, cost / MIB, parts["thinker"] / MIB,
                    parts["talker"] / MIB, parts["dynamic"] / MIB, n, n / floor_limited)


if __name__ == "__main__":
    main()
