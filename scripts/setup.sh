#!/usr/bin/env bash
# Creates .venv and installs duplexcache with its test dependencies.
# torch is pinned first: the pin resolves to the CPU build on this machine's disk; an
# unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test]"
