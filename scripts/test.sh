#!/usr/bin/env bash
# Sets up (idempotent) and runs the whole test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest tests "$@"
