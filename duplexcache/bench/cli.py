"""``duplexcache bench BENCHMARK [options]``: every benchmark of the package behind one command.

Each benchmark (``BENCHMARKS`` below, as ``duplexcache bench --help`` lists them) is a module
exposing ``add_arguments(parser)`` and ``run(args) -> int``, imported when the parser is built.
``duplexcache bench`` with options and no benchmark name is ``duplexcache bench memory`` (what
the command meant before it had benchmarks), so the commands recorded with earlier results
still run. ``python -m duplexcache.bench.<module>`` is an alias of its subcommand
(bench/common.py ``alias_main``).
"""

from __future__ import annotations

import argparse

# benchmark -> (module exposing add_arguments(parser) and run(args) -> int, help)
BENCHMARKS = {
    "memory": ("duplexcache.bench.memory_sweep", "memory per session and the concurrency ceiling, A/B per switch"),
    "ticks": ("duplexcache.bench.engine_ticks", "per-stage tick latency and the largest real-time session count"),
    "serve": ("duplexcache.bench.serve", "drive a running server over WebSockets at real-time pace"),
    "soak": ("duplexcache.bench.soak", "long calls over WebSockets with compacting windows, recorded over time"),
    "setup": ("duplexcache.bench.session_setup",
              "setup time and private bytes of later sessions with the same context"),
    "kernels": ("duplexcache.bench.gpu_stage0", "Stage 0 GPU kernels: paged decode attention, key re-rotation"),
    "stage2": ("duplexcache.bench.gpu_stage2", "batched Code2Wav with CUDA graphs, prompt sharing on vs off"),
    "stage0-bytes": ("duplexcache.bench.stage0_bytes", "Stage 0 KV bytes per session from shapes alone"),
}
DEFAULT = "memory"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from duplexcache.cli import add_module_parser

    parser.epilog = (f"`duplexcache bench [options]` with no BENCHMARK runs {DEFAULT}; "
                     "`duplexcache bench BENCHMARK --help` lists a benchmark's options.")
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, (module, help_text) in BENCHMARKS.items():
        add_module_parser(sub, name, module, help_text)


def run(args: argparse.Namespace) -> int:
    """Never reached through ``duplexcache bench``: the benchmark's parser sets its own ``run``."""
    raise SystemExit(f"duplexcache bench: no benchmark named (one of {', '.join(BENCHMARKS)})")


def with_default_benchmark(argv: list[str]) -> list[str]:
    """``duplexcache [-v] bench [options]`` -> ``... bench memory [options]``: when the token after
    ``bench`` is an option (not -h/--help) or there is none, the memory benchmark is meant."""
    i = next((k for k, a in enumerate(argv) if not a.startswith("-")), None)
    if i is None or argv[i] != "bench":
        return argv
    rest = argv[i + 1:]
    if not rest or (rest[0].startswith("-") and rest[0] not in ("-h", "--help")):
        return [*argv[:i + 1], DEFAULT, *rest]
    return argv
