# Shared by scripts/gpu_bench.sh and scripts/probes/gpu_probes.sh (sourced, not run): the results folder,
# step() and serve_conversation(), then the machine's GPU and library versions.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
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

# Reply latency criterion of the serve modes. With units aligned to the ticks (the default) the reply
# policy answers in the unit holding the end of speech when 200 ms of quiet follow it, else in the next
# unit, taken `lead` (~150 ms) after it arrived; its audio leaves when that tick ends (< 1 s on a server
# that keeps pace): under 1 + 0.2 + 0.15 + 1 s. Without alignment: a whole quiet unit, up to one period
# of phase, and the tick: under 3 s. So a server that keeps pace answers within 3 s either way; later
# replies mean it fell behind. Issue 10's 1.5 s p99 needs ticks under ~0.15 s (docs/results/HISTORY.md,
# "Units on the grid").
REPLY_LATENCY_S=${REPLY_LATENCY_S:-3.0}

serve_conversation() {  # NAME BASE_YAML SESSIONS DURATION [OVERRIDES]: start `duplexcache serve` with the reply policy,
  # wait for /health 200, run `bench serve --workload conversation` (SERVE_BENCH=soak: `bench soak`), stop the server. OVERRIDES: space-separated
  # SECTION.KEY=VALUE (a YAML value), e.g. "scheduler.tick_phases=1 scheduler.catch_up_ticks=false";
  # SERVE_OVERRIDES adds more to every arm
  local name=$1 base=$2 sessions=$3 duration=$4 overrides="${5:-} ${SERVE_OVERRIDES:-}" port=${SERVE_PORT:-8000}
  local cfg="$out/$name.yaml"
  python3 - "$cfg" "$base" $overrides <<'PY' || return 1
import sys
import yaml
from duplexcache.config import DeployConfig
deploy = DeployConfig.from_yaml(sys.argv[2])
for item in sys.argv[3:]:
    key, _, value = item.partition("=")
    *path, field = key.split(".")        # e.g. engine.speak_policy.end_quiet_ms
    target = deploy
    for part in path:
        target = getattr(target, part)
    setattr(target, field, yaml.safe_load(value))
deploy.engine.speak_policy.mode = "reply"
deploy.server.host = "127.0.0.1"
# every caller of the load generator comes from 127.0.0.1: lift the per-address caps above the load
deploy.server.max_connections_per_client = deploy.server.max_sessions_per_client = 4096
open(sys.argv[1], "w").write(deploy.to_yaml())
PY
  echo "=== $name: server ($(date +%T)) ==="
  python3 -m duplexcache.cli serve --config "$cfg" --port "$port" >"$out/${name}_server.log" 2>&1 &
  local server=$!
  # /health may answer 503 ("warming") before it answers 200; give the model build and warm-up 240 s
  # (SERVE_READY_S: the card modes' measured re-plan warms up twice)
  if python3 - "$port" "$server" "${SERVE_READY_S:-240}" <<'PY'
import os, sys, time, urllib.request, urllib.error
url, deadline = f"http://127.0.0.1:{sys.argv[1]}/health", time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    try:
        os.kill(int(sys.argv[2]), 0)   # the server exited: stop waiting
    except OSError:
        sys.exit(1)
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            if r.status == 200:
                sys.exit(0)
    except (urllib.error.URLError, OSError):
        pass
    time.sleep(2)
sys.exit(1)
PY
  then
    step "$name" "${SERVE_STEP_LIMIT:-300}" python3 -m duplexcache.cli bench "${SERVE_BENCH:-serve}" --url "ws://127.0.0.1:$port/v1/realtime" \
      --workload "${SERVE_WORKLOAD:-conversation}" --sessions "$sessions" --ramp 5 --duration "$duration" --max-reply-latency "$REPLY_LATENCY_S" \
      ${SERVE_EXTRA:-} --out "$out/$name"
    if [ -n "${SERVE_THEN_ADMITTED:-}" ]; then
      # a second load on the same server with exactly as many callers as the first one had admitted
      # (callers with no error): "every caller gets audio, 0 late ticks at the count the card admits"
      local admitted
      admitted=$(python3 -c 'import json, sys; s = json.load(open(sys.argv[1]))["steps"][0]
print(sum(1 for p in s["per_session"] if not p["errors"]))' "$out/$name/results.json") && [ "$admitted" -gt 0 ] &&
        step "${name}_admitted" "${SERVE_STEP_LIMIT:-300}" python3 -m duplexcache.cli bench "${SERVE_BENCH:-serve}" \
          --url "ws://127.0.0.1:$port/v1/realtime" --workload "${SERVE_WORKLOAD:-conversation}" --sessions "$admitted" \
          --ramp 5 --duration "$duration" --max-reply-latency "$REPLY_LATENCY_S" ${SERVE_EXTRA:-} --out "$out/${name}_admitted"
    fi
    # the server's own counters after the run: graph captures inside ticks (0 after a warm-up), late ticks
    python3 -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=30).read().decode())' \
      "http://127.0.0.1:$port/metrics" >"$out/${name}_metrics.txt" 2>&1
    grep -E '^duplexcache_(window_compactions|memory_in_use_bytes|device_bytes|device_total_bytes|admitted_over_floor_limited|graph_captures_total|warmup_seconds|cfm_prompt_passes_total|late_ticks|catch_up_ticks|early_closes|prefill_chunks_between_ticks|tick_errors|(between_)?tick_duration_seconds_(count|sum))' "$out/${name}_metrics.txt"
  else
    echo "=== $name: the server exited or was not healthy within ${SERVE_READY_S:-240} s ==="
  fi
  # SIGINT: uvicorn shuts the app down gracefully; SIGKILL only if it has not exited 20 s later
  kill -INT "$server" 2>/dev/null
  for _ in $(seq 20); do kill -0 "$server" 2>/dev/null || break; sleep 1; done
  kill -KILL "$server" 2>/dev/null; wait "$server" 2>/dev/null
  tail -n 10 "$out/${name}_server.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
