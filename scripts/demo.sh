#!/usr/bin/env bash
# Sets up (idempotent) and runs the main job on the embedded default: tiny preset, random weights, CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
duplexcache demo "$@"
