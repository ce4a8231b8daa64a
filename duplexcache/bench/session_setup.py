"""Session setup benchmark: time and private KV bytes of the 2nd and later sessions that open with the same context.

How it measures and what its figures mean: docs/bench_methods.md, "duplexcache bench setup".
"""

from __future__ import annotations

import argparse
import datetime as _dt
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from duplexcache.bench.common import alias_main, default_device, hardware_line, sync, usage_error, write_results
from duplexcache.config import DeployConfig
from duplexcache.context.builder import (
    EmbeddingResult,
    SessionContextBuilder,
    build_session_context,
)
from duplexcache.context.context_cache import EncoderPath
from duplexcache.context.tokenizer import ByteTokenizer
from duplexcache.models.audio_encoder import AudioEncoder
from duplexcache.models.presets import build_random_models
from duplexcache.models.thinker import Thinker
from duplexcache.runtime.memory.device_setup import stage0_runner, window_config
from duplexcache.runtime.stage0.runner import SessionContextInput, Stage0Runner

logger = logging.getLogger(__name__)

PRESET_DTYPES = {"tiny": torch.float32, "minicpmo45": torch.bfloat16}
SAMPLE_RATE = 16_000
UNIT_AUDIO_SECONDS = 1.0  # one duplex unit: <unit> + 10 audio embeddings
# Filler for the system prompt; one ASCII char is one ByteTokenizer token.
_FILLER = "You are a friendly voice assistant. Keep answers short and speak naturally. "


class SetupBenchError(RuntimeError):
    """The session setup benchmark found a broken invariant (pool not free, logits differ...)."""


# ----------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class SetupBenchConfig:
    preset: str = "tiny"
    device: str = "cpu"
    sessions: int = 8
    repeats: int = 5
    instructions_tokens: int = 96  # text tokens of the whole context (prefix + suffix)
    ref_seconds: float = 6.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.preset not in PRESET_DTYPES:
            raise ValueError(f"unknown preset {self.preset!r} (known: {', '.join(PRESET_DTYPES)})")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but torch sees no CUDA device")
        if self.sessions < 2:
            raise ValueError(f"sessions must be >= 2 (the first vs the later ones), got {self.sessions}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if not 0.1 <= self.ref_seconds <= 30.0:
            raise ValueError(f"ref_seconds must be in [0.1, 30] (the encoder's window), got {self.ref_seconds}")

    @property
    def dtype(self) -> torch.dtype:
        return PRESET_DTYPES[self.preset]


@dataclass(frozen=True)
class Combination:
    """One A/B cell: the two switches, named as in the deploy config."""

    context_cache: bool
    shared_anchor_blocks: bool

    @property
    def name(self) -> str:
        return f"cache_{'on' if self.context_cache else 'off'}+shared_{'on' if self.shared_anchor_blocks else 'off'}"

    def deploy(self, preset: str) -> DeployConfig:
        deploy = DeployConfig.default(preset, environ={})
        deploy.context_cache.duplex_context_caching = self.context_cache
        deploy.stage0.shared_anchor_blocks = self.shared_anchor_blocks
        return deploy


COMBINATIONS = tuple(Combination(c, s) for c in (False, True) for s in (False, True))
BASELINE = COMBINATIONS[0]


# ----------------------------------------------------------------------------- models


class CountingModels:
    """The two callables the context builder takes, counting their calls.

    ``encode_reference_audio`` is the whole-clip path (``AudioEncoder.embed_audio``), which
    touches no per-session streaming state; it reports that path, as the builder requires.
    """

    def __init__(self, thinker: Thinker, encoder: AudioEncoder) -> None:
        self.thinker, self.encoder = thinker, encoder
        self.encoder_calls = 0
        self.embed_calls = 0

    @property
    def device(self) -> torch.device:
        return self.thinker.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.thinker.lm_head.weight.dtype

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        self.embed_calls += 1
        with torch.no_grad():
            return self.thinker.embed(ids.to(self.device))

    def encode_reference_audio(self, audio: torch.Tensor, encoder_state: Any) -> EmbeddingResult:
        self.encoder_calls += 1
        emb = self.encoder.embed_audio(audio)
        return EmbeddingResult(emb.to(self.dtype), EncoderPath.WHOLE_CLIP)


# ----------------------------------------------------------------------------- workload


def make_instructions(num_text_tokens: int, has_ref_audio: bool = True) -> str:
    """System instructions giving a context of exactly ``num_text_tokens`` text tokens
    (prefix + suffix, ByteTokenizer) around the reference audio."""
    # Context layout with empty instructions, from the builder itself (zero-width stand-ins).
    audio = torch.zeros(SAMPLE_RATE) if has_ref_audio else None
    empty = build_session_context(
        ByteTokenizer(), lambda ids: torch.zeros(len(ids), 1),
        lambda a, s: EmbeddingResult(torch.zeros(1, 1), EncoderPath.WHOLE_CLIP), "", audio)
    overhead = empty.total - empty.audio_embedding_count
    if num_text_tokens < overhead:
        raise ValueError(f"instructions_tokens must be >= {overhead} (the context's special tokens), "
                         f"got {num_text_tokens}")
    n = num_text_tokens - overhead
    return (_FILLER * (n // len(_FILLER) + 1))[:n]


def make_audio(seconds: float, seed: int) -> torch.Tensor:
    """Seeded noise PCM in [-0.5, 0.5], float32, 16 kHz."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(round(seconds * SAMPLE_RATE), generator=gen) - 0.5).to(torch.float32)


@dataclass
class SessionSample:
    """One session's setup."""

    context_s: float
    open_s: float
    private_bytes: int
    shared_bytes: int
    encoder_calls: int
    embed_calls: int
    cache_hit: bool

    @property
    def total_s(self) -> float:
        return self.context_s + self.open_s


@dataclass
class RepeatResult:
    samples: list[SessionSample]
    pool_used_bytes: int  # after all sessions opened
    context_cache_bytes: int
    logits: dict[str, torch.Tensor] = field(default_factory=dict)  # sid -> (V,), equality pass only


class SessionSetupBench:
    """Runs every combination over one set of weights and one K/V tensor."""

    def __init__(self, cfg: SetupBenchConfig, thinker: Thinker, encoder: AudioEncoder) -> None:
        self.cfg = cfg
        self.models = CountingModels(thinker, encoder)
        self.device = torch.device(cfg.device)
        self.instructions = make_instructions(cfg.instructions_tokens)
        self.ref_audio = make_audio(cfg.ref_seconds, cfg.seed + 1)
        deploy = BASELINE.deploy(cfg.preset)
        self.window = window_config(deploy.stage0)
        self.block_size = deploy.stage0.block_size
        probe = self._builder(BASELINE).build(self.instructions, self.ref_audio)
        self.context_len = probe.total
        self.audio_embeddings = probe.audio_embedding_count
        self.unit_embeds = self._unit_embeds()
        self.cache = thinker.make_kv_cache(self._num_blocks(), self.block_size)

    def _builder(self, combo: Combination) -> SessionContextBuilder:
        return SessionContextBuilder.from_config(combo.deploy(self.cfg.preset), ByteTokenizer(),
                                                 self.models.embed_tokens, self.models.encode_reference_audio)

    def _unit_embeds(self) -> torch.Tensor:
        """``<unit>`` + the audio embeddings of a fixed 1 s clip: (11, H)."""
        unit_id = ByteTokenizer().token_id("<unit>")
        with torch.no_grad():
            tok = self.models.thinker.embed(torch.tensor([unit_id], device=self.device))
            audio = self.models.encoder.embed_audio(make_audio(UNIT_AUDIO_SECONDS, self.cfg.seed + 2))
        return torch.cat([tok, audio.to(tok.dtype)], dim=0)

    def _num_blocks(self) -> int:
        """Room for every session (context + one unit, private tail) plus one template; at
        least what ``Stage0Runner.check_fits_alone`` asks for one session at the window's high mark."""
        bs = self.block_size
        per_session = -(-(self.context_len + self.unit_embeds.shape[0]) // bs) + 1
        worst = -(-(self.context_len + (self.window.high_tokens if self.window.enabled else 0)) // bs) + 1
        return 1 + max(self.cfg.sessions * per_session + 1, worst)

    def _runner(self, combo: Combination) -> Stage0Runner:
        # A fresh pool over the same K/V tensor: no block hash survives from the previous repeat.
        return stage0_runner(self.models.thinker, self.cache, combo.deploy(self.cfg.preset).stage0, self.window)

    def _open_one(self, builder: SessionContextBuilder, runner: Stage0Runner, sid: str) -> SessionSample:
        enc0, emb0 = self.models.encoder_calls, self.models.embed_calls
        sync(self.device)
        t0 = time.perf_counter()
        ctx = builder.build(self.instructions, self.ref_audio)
        sync(self.device)
        t1 = time.perf_counter()
        runner.open_session(sid, SessionContextInput(ctx.inputs_embeds, ctx.token_ids, ctx.extra_key))
        sync(self.device)
        t2 = time.perf_counter()
        b = runner.session_bytes(sid)
        return SessionSample(t1 - t0, t2 - t1, b.private, b.shared, self.models.encoder_calls - enc0,
                             self.models.embed_calls - emb0, ctx.cache_hit)

    def run_repeat(self, combo: Combination, sessions: int, check_logits: bool = False) -> RepeatResult:
        """Open ``sessions`` sessions with one context one after another, then close them all."""
        builder, runner = self._builder(combo), self._runner(combo)
        if (builder.cache is not None) != combo.context_cache or runner.share_context != combo.shared_anchor_blocks:
            raise SetupBenchError(f"{combo.name}: a switch did not reach its component")
        sids = [f"s{i:03d}" for i in range(sessions)]
        samples = [self._open_one(builder, runner, sid) for sid in sids]
        stats = runner.pool_stats()
        result = RepeatResult(samples, stats.used * stats.bytes_per_block,
                              builder.cache.nbytes() if builder.cache is not None else 0)
        if check_logits:
            for sid in sids:  # each alone, so every forward has the same shape
                logits = runner.append({sid: self.unit_embeds}, unit_start=True)[sid]
                result.logits[sid] = logits.to("cpu", torch.float32, copy=True)  # a plain tensor, not an inference one
        for sid in sids:
            runner.close_session(sid)
        runner.manager.check_invariants()
        stats = runner.pool_stats()
        if stats.used != 0 or stats.free != stats.num_blocks:
            raise SetupBenchError(f"{combo.name}: pool not all free after closing every session: {stats}")
        return result

    def warm_up(self) -> None:
        """Every code path once (kernels, allocator, lazy inits), results discarded."""
        for combo in COMBINATIONS:
            self.run_repeat(combo, 2, check_logits=True)

    def run(self) -> dict[str, Any]:
        self.warm_up()
        results: dict[Combination, list[RepeatResult]] = {c: [] for c in COMBINATIONS}
        # Combinations interleaved within each repeat, so background load drifts hit all four alike.
        for r in range(self.cfg.repeats):
            for combo in COMBINATIONS:
                results[combo].append(self.run_repeat(combo, self.cfg.sessions, check_logits=(r == 0)))
            logger.info("repeat %d/%d done", r + 1, self.cfg.repeats)
        return self.report(results)

    # ------------------------------------------------------------------------- report

    def report(self, results: dict[Combination, list[RepeatResult]]) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "benchmark": "session_setup",
            "meta": {
                "preset": cfg.preset, "device": cfg.device, "dtype": str(cfg.dtype).replace("torch.", ""),
                "hardware": hardware_line(self.device), "date": _dt.date.today().isoformat(),
                "torch": torch.__version__, "threads": torch.get_num_threads(),
                "sessions": cfg.sessions, "repeats": cfg.repeats, "seed": cfg.seed,
                "context": {"text_tokens": self.context_len - self.audio_embeddings,
                            "audio_embeddings": self.audio_embeddings, "ref_seconds": cfg.ref_seconds,
                            "total_tokens": self.context_len, "block_size": self.block_size,
                            "full_blocks": self.context_len // self.block_size,
                            "tail_tokens": self.context_len % self.block_size},
                "kv_bytes_per_block": self.cache.bytes_per_block,
                "window": asdict(self.window),
            },
            "combinations": [summarize(c, rs) for c, rs in results.items()],
            "equality": equality_report(results),
        }


def _spread(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    return {"median": float(np.median(arr)), "min": float(arr.min()), "max": float(arr.max())}


def _same(values: list[int]) -> int | dict[str, int]:
    """A figure that should not vary: the value, or its min/max if it does."""
    return values[0] if len(set(values)) == 1 else {"min": min(values), "max": max(values)}


def summarize(combo: Combination, repeats: list[RepeatResult]) -> dict[str, Any]:
    """First session vs sessions 2..N, pooled over repeats (times in ms)."""
    first = [r.samples[0] for r in repeats]
    later = [s for r in repeats for s in r.samples[1:]]

    def side(samples: list[SessionSample]) -> dict[str, Any]:
        return {
            "total_ms": _spread([s.total_s * 1e3 for s in samples]),
            "context_ms": _spread([s.context_s * 1e3 for s in samples]),
            "open_ms": _spread([s.open_s * 1e3 for s in samples]),
            "private_bytes": _same([s.private_bytes for s in samples]),
            "shared_bytes": _same([s.shared_bytes for s in samples]),
            "encoder_calls_per_session": _same([s.encoder_calls for s in samples]),
            "embed_calls_per_session": _same([s.embed_calls for s in samples]),
            "context_cache_hits": sum(s.cache_hit for s in samples),
            "num_samples": len(samples),
        }

    return {
        "name": combo.name,
        "context_cache": combo.context_cache,
        "shared_anchor_blocks": combo.shared_anchor_blocks,
        "first": side(first),
        "later": side(later),
        "encoder_calls_later_total": sum(s.encoder_calls for s in later),
        "pool_used_bytes_after_all": _same([r.pool_used_bytes for r in repeats]),
        "context_cache_bytes": _same([r.context_cache_bytes for r in repeats]),
        "pool_all_free_after_close": True,  # run_repeat raises otherwise
    }


def equality_report(results: dict[Combination, list[RepeatResult]]) -> dict[str, Any]:
    """Logits after one identical unit, every session of every combination vs the baseline's first."""
    ref = results[BASELINE][0].logits["s000"]
    per_combo = {}
    for combo, repeats in results.items():
        logits = repeats[0].logits
        per_combo[combo.name] = {
            "all_equal": all(torch.equal(ref, x) for x in logits.values()),
            "max_abs_diff": max(float((ref - x).abs().max()) for x in logits.values()),
            "sessions_checked": len(logits),
        }
    return {
        "reference": f"{BASELINE.name} session s000",
        "what": "next-token logits after appending <unit> + 10 audio embeddings, torch.equal",
        "all_equal": all(v["all_equal"] for v in per_combo.values()),
        "finite": bool(torch.isfinite(ref).all()),
        "per_combination": per_combo,
    }


def _kib(value: int | dict[str, int], unit: int = 1024, digits: int = 1) -> str:
    """Bytes (or their min-max) in KiB; ``unit=2**20, digits=2``: in MiB."""
    if isinstance(value, dict):
        return f"{value['min'] / unit:.{digits}f}-{value['max'] / unit:.{digits}f}"
    return f"{value / unit:.{digits}f}"


def _ms(spread: dict[str, float]) -> str:
    return f"{spread['median']:.2f} ({spread['min']:.2f}-{spread['max']:.2f})"


_HEADER = (
    "| context cache | shared anchors | session 1 setup ms | sessions 2..N setup ms | 2..N context build ms "
    "| 2..N Stage 0 open ms | 2..N speedup vs off/off | private KiB s1 / 2..N | shared KiB 2..N "
    "| encoder calls s1 / all 2..N | pool used after N (MiB) |"
)


def _row(x: dict[str, Any], baseline_ms: float) -> str:
    f, later = x["first"], x["later"]
    cells = [
        "on" if x["context_cache"] else "off",
        "on" if x["shared_anchor_blocks"] else "off",
        _ms(f["total_ms"]), _ms(later["total_ms"]), _ms(later["context_ms"]), _ms(later["open_ms"]),
        f"{baseline_ms / later['total_ms']['median']:.2f}x",
        f"{_kib(f['private_bytes'])} / {_kib(later['private_bytes'])}",
        _kib(later["shared_bytes"]),
        f"{f['encoder_calls_per_session']} / {x['encoder_calls_later_total']}",
        _kib(x["pool_used_bytes_after_all"], 2**20, 2),
    ]
    return "| " + " | ".join(cells) + " |"


def format_markdown(report: dict[str, Any]) -> str:
    """The results table (times: median (min-max) in ms; bytes from ``session_bytes``)."""
    m, c = report["meta"], report["meta"]["context"]
    n, eq = m["sessions"], report["equality"]
    base = next(x for x in report["combinations"] if x["name"] == BASELINE.name)
    max_diff = max(v["max_abs_diff"] for v in eq["per_combination"].values())
    intro = (f"Preset `{m['preset']}` ({m['dtype']}) on {m['device']} ({m['hardware']}), {m['date']}; "
             f"N = {n} sessions one after another x {m['repeats']} repeats; context {c['total_tokens']} tokens "
             f"({c['text_tokens']} text + {c['audio_embeddings']} audio embeddings from {c['ref_seconds']:g} s) = "
             f"{c['full_blocks']} full blocks + {c['tail_tokens']}-token tail; "
             f"KV block {_kib(m['kv_bytes_per_block'])} KiB.")
    notes = (f"Times: median (min-max) over {m['repeats']} repeats (session 1) and the "
             f"{(n - 1) * m['repeats']} later sessions; encoder calls 2..N: their total. Bytes: "
             "`session_bytes` right after open (a shared block counts in every session that holds it); "
             "pool used: distinct blocks in use with all sessions open.")
    verdict = "all equal" if eq["all_equal"] else "DIFFERENT"
    equality = (f"Equality: {eq['what']}, every session of every combination vs {eq['reference']}: "
                f"**{verdict}** (max abs diff {max_diff:.3g}).")
    rows = [_row(x, base["later"]["total_ms"]["median"]) for x in report["combinations"]]
    lines = [intro, "", _HEADER, "|---|---|" + "---:|" * 9, *rows, "", notes, "", equality]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=tuple(PRESET_DTYPES), default="tiny")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda for minicpmo45 (never build its weights on a CPU), cpu for tiny")
    parser.add_argument("--sessions", type=int, default=8, help="sessions opened one after another (>= 2)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--instructions-tokens", type=int, default=96,
                        help="text tokens of the context (system prompt + special tokens)")
    parser.add_argument("--ref-seconds", type=float, default=6.0, help="reference audio (10 embeddings per s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: 1 on cpu, where the tiny preset is per-op bound)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write session_setup.json and .md here")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = SetupBenchConfig(args.preset, default_device(args.preset, args.device), args.sessions, args.repeats,
                               args.instructions_tokens, args.ref_seconds, args.seed)
    except ValueError as err:   # bad settings: a usage error, not a traceback
        return usage_error("setup", err)
    # The builder is rebuilt per repeat; its "cache on" notice would repeat 4 x repeats times.
    logging.getLogger("duplexcache.context").setLevel(logging.WARNING)
    if args.threads is not None or cfg.device == "cpu":
        torch.set_num_threads(args.threads or 1)
    t0 = time.perf_counter()
    m = build_random_models(cfg.preset, cfg.device, cfg.dtype, cfg.seed, parts=("thinker", "audio_encoder"))
    logger.info("built %s models on %s in %.1f s", cfg.preset, cfg.device, time.perf_counter() - t0)
    report = SessionSetupBench(cfg, m.thinker, m.audio_encoder).run()
    report["meta"]["command"] = (
        f"duplexcache bench setup --preset {cfg.preset} --device {cfg.device} "
        f"--sessions {cfg.sessions} --repeats {cfg.repeats} --instructions-tokens {cfg.instructions_tokens} "
        f"--ref-seconds {cfg.ref_seconds:g}")
    report["meta"]["wall_s"] = round(time.perf_counter() - t0, 2)
    table = format_markdown(report)
    print(table)
    if args.out is not None:
        write_results(args.out, report, table, stem="session_setup")
        logger.info("wrote %s", args.out / "session_setup.json")
    if not report["equality"]["all_equal"]:
        logger.error("logits differ across combinations: %s", report["equality"]["per_combination"])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(alias_main("setup"))
