"""Command line entry point: ``duplexcache demo|verify|serve|bench``.

Each subcommand's implementation is imported lazily, so ``duplexcache verify thinker`` does not
import the web stack and ``duplexcache serve`` does not import the reference packages.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from duplexcache.bench.cli import BENCHMARKS   # names only: the module imports argparse alone

# verify target -> module exposing ``add_arguments(parser)`` and ``run(args) -> int``.
VERIFY_TARGETS = {
    "thinker": "duplexcache.verify.thinker",
    "talker": "duplexcache.verify.talker",
    "audio-encoder": "duplexcache.verify.audio_encoder",
    "flow": "duplexcache.verify.flow",
    "vision": "duplexcache.verify.vision",
}

# top-level command -> module exposing ``add_arguments(parser)`` and ``run(args) -> int``.
COMMANDS = {
    "demo": ("duplexcache.demo", "run many tiny sessions on CPU and print what they shared"),
    "serve": ("duplexcache.server.cli", "serve the realtime WebSocket API"),
    "bench": ("duplexcache.bench.cli", "run a benchmark: " + ", ".join(BENCHMARKS)),
}


def add_module_parser(subparsers, name: str, module: str, help_text: str) -> None:
    """A subcommand whose options and action come from ``module`` (``add_arguments``, ``run``)."""
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        # A command whose optional dependencies are missing (e.g. `serve` without the web
        # stack on a GPU image) stays listed and says why when it is used.
        parser.set_defaults(_import_error=exc)
        return
    mod.add_arguments(parser)
    parser.set_defaults(_run=mod.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duplexcache", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        add_module_parser(sub, name, module, help_text)
    verify = sub.add_parser("verify", help="compare a stage against its reference implementation")
    vsub = verify.add_subparsers(dest="target", required=True)
    for name, module in VERIFY_TARGETS.items():
        add_module_parser(vsub, name, module, f"verify the {name} against its reference")
    return parser


def main(argv: list[str] | None = None) -> int:
    # cuBLAS picks deterministic reductions only with a fixed workspace, read at its first use.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    from duplexcache.bench.cli import with_default_benchmark

    parser = build_parser()
    args, unknown = parser.parse_known_args(with_default_benchmark(list(sys.argv[1:] if argv is None else argv)))
    if unknown and getattr(args, "_import_error", None) is None:   # an unavailable command knows no options
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if getattr(args, "_import_error", None) is not None:
        print(f"duplexcache: this command is unavailable: {args._import_error}", file=sys.stderr)
        return 2
    problem = bench_device_problem(args) or out_dir_problem(args)
    if problem is not None:
        print(f"duplexcache bench {args.benchmark}: {problem}", file=sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except Exception as exc:
        # What is the user's to fix is one line: a checkpoint that cannot be loaded
        # (model.checkpoint_dir of a --config), an engine.memory_budget this machine cannot hold
        # (too small for one session, more than the device has free), a config key the model's
        # shapes refuse (a minicpmo45 Talker turn on the tiny preset). The modules are looked up,
        # not imported: a command that never loaded them cannot have raised their errors, and the
        # GPU image's `bench kernels` runs without pydantic, which config needs.
        checkpoint = sys.modules.get("duplexcache.models.checkpoint")
        config = sys.modules.get("duplexcache.config")
        if checkpoint is not None and isinstance(exc, checkpoint.CheckpointError):
            print(f"duplexcache {_command(args)}: checkpoint: {exc}", file=sys.stderr)
        elif config is not None and isinstance(exc, (config.BudgetError, config.ConfigError)):
            print(f"duplexcache {_command(args)}: {exc}", file=sys.stderr)
        else:
            raise
        return 2


def _command(args: argparse.Namespace) -> str:
    return " ".join(filter(None, (args.command, getattr(args, "benchmark", None))))


def out_dir_problem(args: argparse.Namespace) -> str | None:
    """A benchmark's ``--out`` that cannot be a directory (a file, no permission): said before the
    run, since results are first written after the first step (a minicpmo45 warm-up and a minute
    of callers later)."""
    out = getattr(args, "out", None)
    if getattr(args, "command", None) != "bench" or out is None:
        return None
    from pathlib import Path

    path = Path(out).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())   # nothing is created here
    if not existing.is_dir():
        return f"--out {out}: {existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"--out {out}: {existing} is not writable"
    return None


def bench_device_problem(args: argparse.Namespace) -> str | None:
    """A benchmark that builds models on CUDA (``--device cuda``, minicpmo45's default) on a
    machine without it: one line before anything is built (``serve`` asks the same)."""
    if getattr(args, "command", None) != "bench":
        return None
    from duplexcache.runtime.device import device_problem

    if not hasattr(args, "device"):
        return None
    from duplexcache.bench.common import default_device

    preset = getattr(args, "preset", None)
    device = args.device if preset is None else default_device(preset, args.device)
    return None if device is None else device_problem(device)


if __name__ == "__main__":
    sys.exit(main())
