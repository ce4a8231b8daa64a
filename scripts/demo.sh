#!/usr/bin/env bash
# Sets up (idempotent, see scripts/setup.sh) and runs the main job on the embedded default: tiny
# preset, random weights, CPU. Arguments go to `duplexcache demo` (e.g. --sessions 1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
echo "[demo] duplexcache demo $*"
duplexcache demo "$@"
