#!/usr/bin/env bash
# issue 16: `duplexcache bench serve` (conversation workload) against `duplexcache serve --replicas R`
# for each R given (default 1 2), tiny preset on CPU; results under $OUT/replicas_R/. Usage:
#   OUT=docs/results/cluster_serve SESSIONS=2,4,6,8 DURATION=20 bash scripts/cluster_bench.sh 1 2
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:?set OUT to a results folder}
sessions=${SESSIONS:-2,4,6,8}
duration=${DURATION:-20}
port=${PORT:-8400}
mkdir -p "$out"
export RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S=${RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S:-60}
for replicas in "${@:-1 2}"; do
  cfg="$out/replicas_$replicas.yaml"
  python3 - "$cfg" <<'PY'
import sys
from duplexcache.config import DeployConfig
deploy = DeployConfig.default("tiny")
deploy.engine.speak_policy.mode = "reply"
# every caller of the load generator comes from 127.0.0.1: lift the per-address caps above the load
deploy.server.max_connections_per_client = deploy.server.max_sessions_per_client = 4096
open(sys.argv[1], "w").write(deploy.to_yaml())
PY
  echo "=== $replicas replica(s): server ($(date +%T)) ==="
  python3 -m duplexcache.cli serve --replicas "$replicas" --device cpu --config "$cfg" --port "$port" \
    >"$out/replicas_${replicas}_server.log" 2>&1 &
  server=$!
  python3 - "$port" "$replicas" <<'PY' || { echo "server not ready"; kill -INT "$server"; wait "$server"; continue; }
import json, sys, time, urllib.request
deadline = time.monotonic() + 300
while time.monotonic() < deadline:
    try:
        body = json.load(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=5))
        if len(body.get("cluster", {}).get("replicas", {})) == int(sys.argv[2]):
            sys.exit(0)
    except Exception:
        pass
    time.sleep(1)
sys.exit(1)
PY
  python3 -m duplexcache.cli bench serve --url "ws://127.0.0.1:$port/v1/realtime" --workload conversation \
    --sessions "$sessions" --ramp 3 --duration "$duration" --max-reply-latency 3.5 \
    --out "$out/replicas_$replicas" 2>&1 | tail -n 12
  kill -INT "$server"
  wait "$server"
done
