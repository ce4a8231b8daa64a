"""What every ``duplexcache verify <target>`` command shares.

* The error measure: ``relative_error`` = max|ours - ref| / max|ref|, computed in float64.
* The exit-code policy: ``EXIT_PASS`` (0) every compared path within tolerance,
  ``EXIT_FAIL`` (1) one above it, ``EXIT_UNUSABLE`` (2) a checkpoint that cannot be loaded
  or arguments that cannot run.
* The weight source: ``--checkpoint DIR`` or ``--preset NAME --random-weights`` (random weights
  saved to a temporary directory, then loaded exactly like a checkpoint), plus ``--seed``.
* The result table: one line per compared path, then ``verify <target>: PASS|FAIL (...)``.
* The reference check: ``missing_reference`` turns a reference package that is not installed
  (``transformers``, ``minicpmo-utils``: test extras) into exit 2 with a one-line reason instead
  of a traceback; each target lists what it imports in ``REFERENCE_PACKAGES``.

Each target module keeps its own ``add_arguments(parser)`` / ``run(args) -> int`` and its own
comparisons; this module holds no model code, so the CLI can import every target cheaply.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = [
    "EXIT_FAIL",
    "EXIT_PASS",
    "EXIT_UNUSABLE",
    "FLOAT32_TOLERANCE",
    "add_source_arguments",
    "exit_unusable",
    "missing_reference",
    "reference_import_failed",
    "relative_error",
    "report",
    "run_on_source",
    "source_error",
    "verdict",
]

EXIT_PASS, EXIT_FAIL, EXIT_UNUSABLE = 0, 1, 2
FLOAT32_TOLERANCE = 1e-5  # the float32 fidelity rule (SPEC section 1)


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max|ours - ref| / max|ref| in float64; ``inf`` when the shapes differ (never broadcast),
    NaN when either side holds NaN (which fails every ``<= tolerance`` test)."""
    if ours.shape != ref.shape:
        return float("inf")
    ours, ref = ours.detach().double(), ref.detach().double()
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# --- arguments ----------------------------------------------------------------------------


def add_source_arguments(
    parser: argparse.ArgumentParser,
    presets: Mapping[str, Any],
    checkpoint_help: str,
    random_help: str = "random weights saved to a temp dir",
) -> None:
    """``--checkpoint DIR`` | ``--preset NAME`` (exactly one), ``--random-weights``, ``--seed``."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help=checkpoint_help)
    source.add_argument("--preset", choices=sorted(presets), help="build a model of this shape (with --random-weights)")
    parser.add_argument("--random-weights", action="store_true", help=random_help)
    parser.add_argument("--seed", type=int, default=0)


def source_error(args: argparse.Namespace) -> str | None:
    """Why the parsed source arguments cannot run, or None."""
    if args.preset is not None and not args.random_weights:
        return "--preset needs --random-weights (no checkpoint to load)"
    if args.random_weights and args.preset is None:
        return "--random-weights needs --preset"
    return None


def run_on_source(
    target: str,
    args: argparse.Namespace,
    presets: Mapping[str, Callable[[], Any]],
    save_random_checkpoint: Callable[..., None],
    verify_dir: Callable[[str], int],
) -> int:
    """``verify_dir(path)`` on ``--checkpoint``, or on a temp dir holding random weights of
    ``--preset``'s shape (``save_random_checkpoint(config, dir, seed=--seed)``)."""
    if args.random_weights:
        with tempfile.TemporaryDirectory(prefix=f"duplexcache-{target}-") as tmp:
            save_random_checkpoint(presets[args.preset](), tmp, seed=args.seed)
            return verify_dir(tmp)
    return verify_dir(args.checkpoint)


# --- results ------------------------------------------------------------------------------


def exit_unusable(target: str, message: str) -> int:
    """Say why the command cannot run (bad arguments, unloadable checkpoint); exit code 2."""
    print(f"verify {target}: {message}")
    return EXIT_UNUSABLE


def missing_reference(target: str, packages: Mapping[str, str]) -> int | None:
    """Exit 2 with a one-line reason when a reference module in ``packages`` (module -> the pip
    requirement that provides it) is not installed; None when all are."""
    for module, requirement in packages.items():
        if not _installed(module):
            return exit_unusable(target, f"the reference package {requirement} is not installed (no module "
                                         f"{module!r}); install it with: pip install '{requirement}' "
                                         f"(or pip install -e '.[test]')")
    return None


def _installed(module: str) -> bool:
    if sys.modules.get(module) is not None:  # already imported (flow's reference is a hand-made package)
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def reference_import_failed(target: str, exc: ImportError) -> int:
    """Exit 2 when the reference is installed but one of its own imports fails."""
    return exit_unusable(target, f"the reference cannot be imported: {type(exc).__name__}: {exc}")


def verdict(target: str, passed: bool, tolerance_note: str) -> int:
    """The closing line, ``verify <target>: PASS|FAIL (tolerance ...)``, and the exit code."""
    print(f"verify {target}: {'PASS' if passed else 'FAIL'} (tolerance {tolerance_note})")
    return EXIT_PASS if passed else EXIT_FAIL


def report(target: str, subject: str, errors: Mapping[str, float], tolerance: float, tolerance_note: str) -> int:
    """Print one line per compared path (``ok`` / ``FAIL``) and the verdict; return the exit code.

    ``subject`` names what was compared (the checkpoint path and run settings); the closing
    line reads ``(tolerance <tolerance_note>)``.
    """
    if not errors:
        raise ValueError(f"verify {target}: no compared paths to report")
    print(f"verify {target}: {subject}; relative error = max|ours - ref| / max|ref|")
    width = max(len(name) for name in errors) + 1
    for name, err in errors.items():
        print(f"  {name:<{width}} {err:.3e}  {'ok' if err <= tolerance else 'FAIL'}")
    return verdict(target, all(err <= tolerance for err in errors.values()), tolerance_note)
