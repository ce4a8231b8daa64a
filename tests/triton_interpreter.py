"""Rerunning a test file under Triton's CPU interpreter.

TRITON_INTERPRET must be set before a kernel is decorated and is process-wide: set in the
collecting process it would turn every kernel of the run (the CUDA tests' too) into interpreted
code. So a file of interpreted-kernel tests has one runner test that reruns the file in a fresh
process with TRITON_INTERPRET=1, where the file's other tests run directly.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def rerun_interpreted(test_file: str | Path) -> str:
    """Run ``test_file`` with pytest in a fresh process under TRITON_INTERPRET=1 (from the
    repository root); assert it passed and return its output."""
    path = Path(test_file).resolve()
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-rs", "-p", "no:cacheprovider",
                           str(path)], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc.stdout


def skip_unless_interpreted(request: pytest.FixtureRequest, interpreted: bool, runner: str) -> None:
    """For a file's autouse fixture: its tests run only where the kernels are interpreted; the
    runner test (named ``runner``) runs only where they are not."""
    if not interpreted and request.node.name != runner:
        pytest.skip(f"the kernels are not interpreted in this process; {runner} runs this test")


def rerun_unless_interpreted(interpreted: bool, test_file: str | Path) -> str:
    """The runner test's body: skip where the kernels are interpreted (the file's tests ran
    directly), else rerun the file under the interpreter and return its output."""
    if interpreted:
        pytest.skip("the kernels are interpreted in this process; the tests here ran directly")
    return rerun_interpreted(test_file)
