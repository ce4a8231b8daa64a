#!/usr/bin/env bash
# Sets up (idempotent, see scripts/setup.sh) and runs pytest on CPU: the whole suite, or just the
# arguments given (e.g. `bash scripts/test.sh tests/runtime/test_demo.py -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if [ "$#" -eq 0 ]; then
  set -- tests
fi
echo "[test] python -m pytest $*"
python -m pytest "$@"
