#!/usr/bin/env bash
# Sets up (idempotent, see scripts/setup.sh) and runs pytest on CPU: the whole suite, or just the
# arguments given (e.g. `bash scripts/test.sh tests/runtime/test_demo.py -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if [ "$#" -eq 0 ]; then
  # The whole suite on DUPLEXCACHE_TEST_WORKERS pytest-xdist workers (default 2, the CI machine's
  # cores; 0 runs it in this process). --dist loadfile keeps a file on one worker, so its
  # module-scoped fixtures (engines, the Ray cluster) are built once. Each test process uses one
  # torch thread (tests/conftest.py), so 2 workers use 2 cores: ~6 min instead of ~11 here.
  workers="${DUPLEXCACHE_TEST_WORKERS:-2}"
  if [ "$workers" = "0" ]; then
    set -- tests
  else
    set -- -n "$workers" --dist loadfile tests
  fi
fi
echo "[test] python -m pytest $*"
python -m pytest "$@"
