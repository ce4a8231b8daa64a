"""``duplexcache bench memory``: memory per session and concurrency, A/B per switch, in one run.

    duplexcache bench memory [--preset tiny|minicpmo45] [--device cpu|cuda] [--sessions 1,2,4,8]
                             [--memory-budget 80GiB] [--realtime] [--out DIR]

(``duplexcache bench`` with these options and no benchmark name runs it too: bench/cli.py.)

Writes DIR/report.json (schema: docs/results/README.md), DIR/memory.png and prints a table.
The measured target is the serving engine (``engine_target.py``).
Needs torch, numpy, pydantic, pyyaml, tqdm and matplotlib; no web library.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from duplexcache.bench.common import usage_error
from duplexcache.runtime.memory.floor import SessionFloor, session_floor
from duplexcache.bench.matrix import config_matrix
from duplexcache.bench.report import RunMeta, build_report, format_table, write_report
from duplexcache.bench.runner import run_sweep
from duplexcache.cfm.config import Code2WavShape
from duplexcache.config import ConfigError, DeployConfig, parse_bytes
from duplexcache.kv.kv_quant import kv_storage_dtype

logger = logging.getLogger(__name__)

DEFAULT_SESSIONS = {"tiny": "1,2,4,8", "minicpmo45": "1,2,4,8"}
FF_CHUNK = {"tiny": 1024, "minicpmo45": 2048}
# The tiny preset (without --config) fills a smaller window so a CPU run stays within minutes
# (the fast-forward prefill is quadratic in the window); the report states the window it used.
TINY_WINDOW = (2048, 1536)


def parse_sessions(text: str) -> list[int]:
    """``"1,2,4,8"`` -> [1, 2, 4, 8]: positive, strictly increasing, at least two counts."""
    try:
        counts = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--sessions must be comma-separated ints like '1,2,4,8', got {text!r}") from None
    if len(counts) < 2 or any(n <= 0 for n in counts) or counts != sorted(set(counts)):
        raise ValueError(f"--sessions needs >= 2 positive, strictly increasing counts, got {text!r}")
    return counts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=("tiny", "minicpmo45"), default=None,
                        help="model shapes (default: --config's model.preset, else tiny)")
    parser.add_argument("--config", type=Path, default=None,
                        help="deploy YAML to start from (default: the preset's packaged config)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: the deploy config's model.device")
    parser.add_argument("--sessions", default=None, help="session counts, e.g. 1,2,4,8,16,32")
    parser.add_argument("--memory-budget", default=None,
                        help="device memory for weights + sessions used for the ceiling, e.g. 80GiB "
                             "(default: the GPU's total memory on cuda, else engine.memory_budget, "
                             "which excludes weights)")
    parser.add_argument("--realtime", action="store_true",
                        help="also report the ceiling that keeps every tick under 1 s")
    parser.add_argument("--units", type=int, default=None,
                        help="units (ticks) per session before steady state (default: until Code2Wav "
                             "owns P private frames; 7 ticks for P = 300 on the engine)")
    parser.add_argument("--window-high", type=int, default=None,
                        help=f"override stage0.window.high_tokens (tiny default: {TINY_WINDOW[0]})")
    parser.add_argument("--window-low", type=int, default=None,
                        help=f"override stage0.window.low_tokens (tiny default: {TINY_WINDOW[1]})")
    parser.add_argument("--talker-turn-tokens", type=int, default=None,
                        help="engine.talker_turn_tokens: the most Talker KV tokens one audio turn holds, "
                             "what admission reserves and the fast-forward holds per session (default: the "
                             "deploy config's, else the Talker's max_position_embeddings)")
    parser.add_argument("--no-waterfall", dest="waterfall", action="store_false",
                        help="skip the card waterfall (engine target: one engine of the deploy config as given, "
                             "warmed up as serve does, every device byte by part; report.json 'waterfall' and "
                             "waterfall.png)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))


def load_deploy(args: argparse.Namespace) -> DeployConfig:
    if args.config:
        base = DeployConfig.from_yaml(args.config)
        args.preset = args.preset or base.model.preset
    else:
        args.preset = args.preset or "tiny"
        base = DeployConfig.from_packaged_yaml(args.preset)
    data = base.to_dict()
    data["model"]["preset"] = args.preset
    if args.device:
        data["model"]["device"] = args.device
    high, low = args.window_high, args.window_low
    if args.preset == "tiny" and not args.config and high is None and low is None:
        high, low = TINY_WINDOW
    if high is not None:
        data["stage0"]["window"]["high_tokens"] = high
    if low is not None:
        data["stage0"]["window"]["low_tokens"] = low
    if args.talker_turn_tokens is not None:
        data["engine"]["talker_turn_tokens"] = args.talker_turn_tokens
    return DeployConfig.from_dict(data, environ={})


@dataclass
class _Setup:
    """What the engine target contributes to the run: how to build it and what it measures."""

    configs: list
    make_target: object
    weight_bytes: int
    floor: SessionFloor
    units: int
    prompt_frames: int
    notes: dict
    models: object = None   # the engine target's weights (the card waterfall builds one more engine on them)


def _fit_engine_budget(deploy: DeployConfig, configs, device: torch.device):
    """The engine preallocates its pools from engine.memory_budget and refuses a budget above
    the memory left after the weights; on a smaller GPU the bench lowers it (and logs it)."""
    if deploy.engine.memory_budget == "auto":   # sized from the free memory at start-up: it fits
        return configs
    free, _ = torch.cuda.mem_get_info(device)
    limit = int(free * 0.9) // 2**20 * 2**20
    if deploy.engine.memory_budget <= limit:
        return configs
    logger.warning("engine.memory_budget %d MiB > 90%% of the %d MiB free after weights; the bench uses %d MiB",
                   deploy.engine.memory_budget // 2**20, free // 2**20, limit // 2**20)
    data = deploy.to_dict()
    data["engine"]["memory_budget"] = limit
    return config_matrix(DeployConfig.from_dict(data, environ={}))


def _engine_setup(deploy: DeployConfig, configs, args) -> _Setup:
    from duplexcache.bench.engine_target import ALWAYS_SPEAK_K, EngineTarget
    from duplexcache.runtime.bundle import build_models
    from duplexcache.runtime.memory.session_sizing import resolve_turn_tokens

    models = build_models(configs[0].deploy, seed=args.seed)
    if models.device.type == "cuda":
        configs = _fit_engine_budget(deploy, configs, models.device)
    p = models.voices.get("default").prompt_frames
    floor = session_floor(models.thinker.config, deploy.stage0.window.high_tokens,
                          Code2WavShape.from_flow(models.flow), p, models.audio_encoder.cfg, deploy.model.dtype,
                          code2wav_dtype=deploy.precision.code2wav_dtype,
                          kv_storage_dtype=kv_storage_dtype(deploy.precision.kv_cache_dtype),
                          encoder_storage_dtype=kv_storage_dtype(deploy.precision.encoder_cache_dtype))
    turn = resolve_turn_tokens(deploy.engine.talker_turn_tokens, models.talker.config)
    notes = {
        "speak_policy": f"engine.speak_policy every_k_units k={ALWAYS_SPEAK_K} turn_units={ALWAYS_SPEAK_K} in "
                        "the deploy config: every unit speaks, one turn spans the run",
        "fast_forward": "fast_forward_session per session: Thinker window filled to prefix + high_tokens "
                        f"through the serving append path (embeddings of seeded random text ids); Talker "
                        f"blocks held for a full turn (engine.talker_turn_tokens = {turn} tokens), not computed; "
                        "Code2Wav reaches P private frames by real units; encoder cache grown to max_cache_frames "
                        "(held, not computed)",
        "setup_sample": "after the tick that produced each session's first audio chunk (tick 2: speech "
                        "lags text by one unit); every context is prefilled between ticks before the first "
                        "unit, so each session's units fall on the same ticks in every configuration",
    }
    return _Setup(configs, lambda cfg, n: EngineTarget(models, cfg.deploy, n), models.weight_bytes(), floor,
                  args.units or EngineTarget.units_to_steady(p), p, notes, models)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    start = time.perf_counter()
    try:   # bad options and configs are one line (exit 2), and a typo fails now, not after the sweep
        if args.memory_budget is not None:
            parse_bytes(args.memory_budget)
        deploy = load_deploy(args)
        sessions = parse_sessions(args.sessions or DEFAULT_SESSIONS[args.preset])
    except (ConfigError, OSError, ValueError) as exc:
        return usage_error("memory", exc)
    device = torch.device(deploy.model.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("duplexcache bench memory: --device cuda but torch sees no CUDA device")
    configs = config_matrix(deploy)
    setup = _engine_setup(deploy, configs, args)
    configs = setup.configs
    with tqdm(total=len(configs) * len(sessions), desc="bench", file=sys.stderr, unit="run") as bar:
        results = run_sweep(configs, sessions, setup.make_target, setup.units, device,
                            FF_CHUNK[args.preset], progress=bar)
    report = build_report(results, _run_meta(args, deploy, configs, device, sessions, setup))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wf = None
    if args.waterfall:
        from duplexcache.bench.plot import plot_waterfall

        wf = card_waterfall(setup.models, deploy)
        report["waterfall"] = wf.to_json()
        plot_waterfall(wf, out / "waterfall.png")
    report["wall_s"] = round(time.perf_counter() - start, 1)
    path = write_report(report, out)
    from duplexcache.bench.plot import plot_memory

    plot_memory(report, out / "memory.png")
    print(format_table(report))
    if wf is not None:
        print("\n".join(wf.lines()))
        print(f"wrote {out / 'waterfall.png'}")
    print(f"wrote {path} and {out / 'memory.png'} in {report['wall_s']} s")
    return 0 if report["all_equal"] else 1


def card_waterfall(models, deploy: DeployConfig):
    """The card waterfall of ``deploy`` as given (runtime/memory/waterfall.py): one engine on the bench's
    weights, warmed up as ``duplexcache serve`` warms up (a measured re-plan included), after
    the sweep's engines are gone, then shut down."""
    import gc

    from duplexcache.runtime.engine import DuplexEngine

    gc.collect()
    if models.device.type == "cuda":
        torch.cuda.empty_cache()
    engine = DuplexEngine(deploy, models)
    try:
        engine.warmup()
        return engine.waterfall()
    finally:
        engine.shutdown()


def _run_meta(args, deploy: DeployConfig, configs, device: torch.device, sessions: list[int],
              setup: _Setup) -> RunMeta:
    w = deploy.stage0.window
    source = "component accounting of tensor storage (KV pool blocks, caches, arena)"
    if device.type == "cuda":
        source += "; plus torch.cuda allocator deltas (memory_allocated, max_memory_allocated, memory_reserved)"
    workload = {
        "sessions": sessions,
        "units_before_steady": setup.units,
        "chunks_compared": "every audio chunk and text delta of units 1.." + str(setup.units + 1),
        "same_context_all_sessions": True,
        "voice_prompt_frames": setup.prompt_frames,
        "window": {"mode": w.mode, "high_tokens": w.high_tokens, "low_tokens": w.low_tokens},
        "graph_grid": list(configs[0].deploy.code2wav.graph_grid or ()),
        "thinker_dtype": deploy.model.dtype,
        "code2wav_dtype": deploy.precision.code2wav_dtype,
        "talker_turn_tokens": deploy.engine.talker_turn_tokens,   # None: the Talker's max_position_embeddings
        "kv_cache_dtype": deploy.precision.kv_cache_dtype,
        "encoder_cache_dtype": deploy.precision.encoder_cache_dtype,
        "seed": args.seed,
        **setup.notes,
    }
    if args.memory_budget is not None:
        budget, includes_weights = parse_bytes(args.memory_budget), True
    elif device.type == "cuda":
        budget, includes_weights = torch.cuda.get_device_properties(device).total_memory, True
    else:
        budget, includes_weights = configs[0].deploy.engine.memory_budget, False
        if budget == "auto":   # a host device: what the engine resolves auto to
            from duplexcache.runtime.memory.memory_budget import resolve_memory_budget
            budget = resolve_memory_budget(configs[0].deploy.engine, 0, None)
    return RunMeta(preset=args.preset, device=str(device), target="engine", memory_source=source,
                   memory_budget=budget, activation_reserve=deploy.engine.activation_reserve,
                   weight_bytes=setup.weight_bytes, floor=setup.floor, workload=workload,
                   realtime=args.realtime, budget_includes_weights=includes_weights)
