#!/usr/bin/env bash
# Runs every GPU measurement of docs/benchmarks.md on one CUDA machine, each step on its own
# (a failing step is logged and the next one still runs). Usage:
#   OUT=/path/to/results bash scripts/gpu_bench.sh [smoke|full]
# smoke: every benchmark on the tiny preset (catches device bugs in seconds);
# full:  the minicpmo45 figures (random weights; about 10 minutes on an H200).
# Needs torch with CUDA, triton, numpy, pyyaml, safetensors, pydantic, tqdm, matplotlib.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-full}
out=${OUT:?set OUT to a results folder}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T)) ==="
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc ($(date +%T)) ==="
  tail -n 25 "$out/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'

if [ "$mode" = smoke ]; then
  step smoke_bench 120 python3 -m duplexcache.cli bench --preset tiny --device cuda --sessions 1,2 --out "$out/smoke_bench"
  step smoke_ticks 120 python3 -m duplexcache.bench.engine_ticks --preset tiny --device cuda --sessions 1,2 --ticks 2 --out "$out/smoke_ticks"
  step smoke_setup 120 python3 -m duplexcache.bench.session_setup --preset tiny --device cuda --sessions 3 --repeats 1 --out "$out/smoke_setup"
  step gpu_tests 240 python3 -m pytest -q -x tests/cfm/test_graphs.py tests/kv/test_paged_attention.py -p no:cacheprovider
else
  step session_setup 200 python3 -m duplexcache.bench.session_setup --preset minicpmo45 --device cuda --sessions 8 --repeats 3 --out "$out/session_setup"
  step bench 330 python3 -m duplexcache.cli bench --preset minicpmo45 --device cuda --sessions 1,2,4,8 --memory-budget 80GiB --out "$out/bench"
  step engine_ticks 330 python3 -m duplexcache.bench.engine_ticks --preset minicpmo45 --device cuda --sessions 1,8,16,32 --max-seconds 300 --out "$out/engine_ticks"
fi
