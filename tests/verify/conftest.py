"""Shared fixtures of the ``duplexcache verify <target>`` tests."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from types import ModuleType

import pytest


def _run_verify(module: ModuleType, *argv: str) -> int:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return module.run(parser.parse_args(list(argv)))


@pytest.fixture
def run_verify() -> Callable[..., int]:
    """``run_verify(module, *argv)``: parse ``argv`` with the target module's own
    ``add_arguments`` and return ``module.run(args)``, the command's exit code."""
    return _run_verify
