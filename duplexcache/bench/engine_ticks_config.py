"""The engine tick benchmark's settings: ``TickBenchConfig``, the deploy config it runs
(``make_deploy``) and the options of ``duplexcache bench ticks`` that fill it.

Split out of engine_ticks.py (which runs it); the options are documented there.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from duplexcache.bench import workload as wl
from duplexcache.bench.common import default_device, int_list
from duplexcache.config import AUTO, DeployConfig, format_bytes, parse_budget, parse_bytes

logger = logging.getLogger(__name__)

CONTINUOUS_K = 1_000_000   # every_k_units block longer than any run: one endless turn
# minicpmo45 on an H200: weights take ~18 GiB of the 140; 80 GiB of pools leaves room for
# activations. tiny keeps its preset budget (the pools are preallocated, also on the CPU).
DEFAULT_BUDGET = {"minicpmo45": "80GiB"}
# The three sharing switches of the Two-Tier Omni Cache. cfm_arena_rows_from_graph_grid is left
# at its default: it needs a graph grid, and setting one changes what Code2Wav captures.
SWITCHES = {"stage0": ("shared_anchor_blocks",), "context_cache": ("duplex_context_caching",),
            "code2wav": ("cfm_prompt_att_sharing",)}


@dataclass
class TickBenchConfig:
    preset: str = "tiny"
    device: str = "cpu"
    sessions: tuple[int, ...] = (1, 8, 16, 32)
    ticks: int = 6
    warmup_ticks: int = 2
    memory_budget: str | None = None   # None: DEFAULT_BUDGET or the preset's own
    all_switches: bool = True
    max_seconds: float = 420.0
    speak_k: int = 2
    seed: int = 0
    steady_window: bool = False   # fill each Thinker window to (low + high) // 2 after the warm-up
    cuda_graphs: bool = True   # engine.cuda_graphs (CUDA only; off: every step, the encoder and the vocoder eager)
    turn_units: int = 2   # scripted policy: the last min(turn_units, k) units of every k speak, as one turn
    ragged_kernel: bool = True    # stage0.ragged_kernel (CUDA only; off is the A/B reference)
    workload: str = "turns"   # turns | continuous | conversation (bench/workload.py)
    warm_up: bool = True      # DuplexEngine.warmup() before the first tick, as `duplexcache serve` does
    graph_grid: tuple[int, ...] | None = None   # code2wav.graph_grid (+ arena rows from it); None: the preset's
    code2wav_dtype: str = "float32"   # precision.code2wav_dtype (bfloat16: capacity mode)
    kv_cache_dtype: str = "auto"      # precision.kv_cache_dtype (fp8_e4m3: capacity mode)
    encoder_cache_dtype: str = "auto"   # precision.encoder_cache_dtype (fp8_e4m3: capacity mode)
    talker_turn_tokens: int | None = None   # engine.talker_turn_tokens (None: the Talker's limit)
    profile_ticks: int = 0   # ticks run under torch.profiler after the recorded ones (bench/tick_profile.py)
    video_share: float = 0.0   # share of video sessions, a frame each unit (bench/video.py; model.vision on when > 0)

    def __post_init__(self) -> None:
        if self.workload not in wl.WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r} (known: {', '.join(wl.WORKLOADS)})")
        if self.workload == "conversation" and self.preset == "minicpmo45" and not self.steady_window:
            logger.info("conversation workload on minicpmo45: Thinker windows are filled to (low + high) / 2 "
                        "before the recorded ticks (--steady-window)")
            self.steady_window = True
        if self.preset not in ("tiny", "minicpmo45"):
            raise ValueError(f"unknown preset {self.preset!r} (known: tiny, minicpmo45)")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.preset == "minicpmo45" and self.device != "cuda":
            raise ValueError("the minicpmo45 preset (8B parameters) needs --device cuda")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda but torch sees no CUDA device")
        if not self.sessions or any(not isinstance(n, int) or n < 1 for n in self.sessions):
            raise ValueError(f"sessions must be positive ints, got {self.sessions!r}")
        self.sessions = tuple(sorted(set(self.sessions)))
        if not 0.0 <= self.video_share <= 1.0:
            raise ValueError(f"video_share must be in [0, 1], got {self.video_share}")
        if self.profile_ticks < 0:
            raise ValueError(f"profile_ticks must be >= 0, got {self.profile_ticks}")
        if self.ticks < 1 or self.warmup_ticks < 0:
            raise ValueError(f"need ticks >= 1 and warmup_ticks >= 0, got {self.ticks}, {self.warmup_ticks}")
        if self.max_seconds <= 0:
            raise ValueError(f"max_seconds must be positive, got {self.max_seconds}")
        if self.speak_k < 1 or self.turn_units < 1:
            raise ValueError(f"speak_k and turn_units must be >= 1, got {self.speak_k}, {self.turn_units}")
        if self.memory_budget is not None:
            parse_budget(self.memory_budget)   # "auto" or a size; raises ValueError naming a bad one
        if self.warmup_ticks < 2:
            logger.warning("warmup_ticks=%d: the first Code2Wav step (graph capture on CUDA) "
                           "falls in a recorded tick", self.warmup_ticks)

    def speak_policy(self) -> dict[str, Any]:
        """``engine.speak_policy`` of the workload."""
        if self.workload == "conversation":
            shape = wl.ConversationShape()
            return {"mode": "reply", "reply_min_units": shape.reply_min_units,
                    "reply_max_units": shape.reply_max_units}
        if self.workload == "continuous":
            return {"mode": "every_k_units", "k": CONTINUOUS_K, "turn_units": CONTINUOUS_K}
        return {"mode": "every_k_units", "k": self.speak_k, "turn_units": self.turn_units}

    def describe_policy(self) -> str:
        p = self.speak_policy()
        if p["mode"] == "reply":
            return f"reply (conversation) {p['reply_min_units']}..{p['reply_max_units']} units"
        return f"every_k_units k={p['k']} turn_units={min(p['turn_units'], p['k'])}"

    def script(self, index: int, sid: str, units: int) -> wl.SessionScript:
        """What session ``index`` says and when it is scheduled to speak."""
        if self.workload == "conversation":
            return wl.conversation_script(index, sid, units, self.seed)
        if self.workload == "continuous":
            return wl.continuous_script(sid, units)
        return wl.turns_script(sid, units, self.speak_k, self.turn_units)

    def budget(self) -> str | None:
        return self.memory_budget or DEFAULT_BUDGET.get(self.preset)


def make_deploy(cfg: TickBenchConfig) -> DeployConfig:
    """The preset's defaults with the bench's device, budget, switches and scripted policy."""
    raw = DeployConfig.default(cfg.preset).to_dict()
    raw["model"]["device"] = cfg.device
    if cfg.device == "cpu":
        raw["model"]["dtype"] = "float32"
    budget = cfg.budget()
    if budget is not None:
        raw["engine"]["memory_budget"] = budget
        reserve = parse_bytes(raw["engine"]["activation_reserve"])
        if budget != AUTO and reserve >= parse_bytes(budget):   # e.g. a small test budget under the 8 GiB reserve
            raw["engine"]["activation_reserve"] = format_bytes(parse_bytes(budget) // 8)
    for section, keys in SWITCHES.items():
        for key in keys:
            raw[section][key] = cfg.all_switches
    raw["engine"]["speak_policy"] = cfg.speak_policy()
    raw["engine"]["cuda_graphs"] = cfg.cuda_graphs
    raw["stage0"]["ragged_kernel"] = cfg.ragged_kernel
    raw["precision"]["code2wav_dtype"] = cfg.code2wav_dtype
    raw["precision"]["kv_cache_dtype"] = cfg.kv_cache_dtype
    raw["precision"]["encoder_cache_dtype"] = cfg.encoder_cache_dtype
    raw["engine"]["talker_turn_tokens"] = cfg.talker_turn_tokens
    raw["model"]["vision"] = cfg.video_share > 0
    if cfg.graph_grid is not None:
        raw["code2wav"]["graph_grid"] = list(cfg.graph_grid)
        raw["code2wav"]["cfm_arena_rows_from_graph_grid"] = True
    return DeployConfig.from_dict(raw, environ={})


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=("tiny", "minicpmo45"), default="tiny")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda for minicpmo45, cpu for tiny")
    p.add_argument("--sessions", type=int_list("--sessions"), default=(1, 8, 16, 32))
    p.add_argument("--ticks", type=int, default=6)
    p.add_argument("--warmup-ticks", type=int, default=2)
    p.add_argument("--memory-budget", default=None,
                   help="engine.memory_budget (default: 80GiB for minicpmo45, the preset's for tiny)")
    p.add_argument("--all-switches", choices=("on", "off"), default="on",
                   help="shared_anchor_blocks, duplex_context_caching, cfm_prompt_att_sharing")
    p.add_argument("--speak-k", type=int, default=2,
                   help="scripted policy: speak in the last min(turn_units, k) of every k units")
    p.add_argument("--turn-units", type=int, default=2,
                   help="scripted policy: units per turn (k=2 with 2: two-unit turns; k=turn=1000: one turn)")
    p.add_argument("--workload", choices=wl.WORKLOADS, default="turns",
                   help="turns: --speak-k/--turn-units lockstep; continuous: one endless turn; conversation: "
                        "user turns and replies (reply policy, >= 3 voices; implies --steady-window on minicpmo45)")
    p.add_argument("--steady-window", action="store_true",
                   help="before the recorded ticks, fill each Thinker window to (low + high) / 2 tokens")
    p.add_argument("--cuda-graphs", choices=("on", "off"), default="on",
                   help="engine.cuda_graphs: the Thinker/Talker decode and short ragged steps, the audio encoder "
                        "and the vocoder replay CUDA graphs (off: all eager, the reference)")
    p.add_argument("--ragged-kernel", choices=("on", "off"), default="on",
                   help="stage0.ragged_kernel: short ragged steps through the in-place paged kernel")
    p.add_argument("--video-share", type=float, default=0.0,
                   help="share of the sessions that are video sessions, spread evenly: a 640x480 JPEG frame with "
                        "each unit (1 fps, bench/video.py); builds the vision model (model.vision) when above 0")
    p.add_argument("--warm-up", choices=("on", "off"), default="on",
                   help="CUDA: DuplexEngine.warmup() before the first tick (as `duplexcache serve`); off: graphs "
                        "are captured inside ticks (the cold A/B)")
    p.add_argument("--graph-grid", type=int_list("--graph-grid"), default=None,
                   help="code2wav.graph_grid, e.g. 1,4,8,16 (arena rows from the grid); default: the preset's")
    p.add_argument("--code2wav-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="precision.code2wav_dtype: the Code2Wav flow, its caches and arena (bfloat16: capacity mode)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8_e4m3"), default="auto",
                   help="precision.kv_cache_dtype: Thinker and Talker KV pools in fp8 e4m3 + per-token scales "
                        "(capacity mode)")
    p.add_argument("--encoder-cache-dtype", choices=("auto", "fp8_e4m3"), default="auto",
                   help="precision.encoder_cache_dtype: each session's audio-encoder cache in fp8 e4m3 + scales")
    p.add_argument("--talker-turn-tokens", type=int, default=None,
                   help="engine.talker_turn_tokens: the Talker KV reserve per session (default: the Talker's limit)")
    p.add_argument("--profile-ticks", type=int, default=0,
                   help="after the recorded ticks, run this many under torch.profiler: host/device ms per stage")
    p.add_argument("--max-seconds", type=float, default=420.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out/engine_ticks"))


def config_from_args(a: argparse.Namespace) -> TickBenchConfig:
    """The settings the options name; ValueError for a bad combination."""
    return TickBenchConfig(a.preset, default_device(a.preset, a.device), a.sessions, a.ticks, a.warmup_ticks,
                           a.memory_budget, a.all_switches == "on", a.max_seconds, a.speak_k, a.seed, a.steady_window,
                           a.cuda_graphs == "on", a.turn_units, a.ragged_kernel == "on", a.workload,
                           a.warm_up == "on", a.graph_grid, a.code2wav_dtype, a.kv_cache_dtype,
                           a.encoder_cache_dtype, a.talker_turn_tokens, a.profile_ticks, a.video_share)
